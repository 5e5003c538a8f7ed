"""Rerankers (tasks/retrieval/rerank.py, rerank_train.py): our scores equal sentence-transformers' CrossEncoder.predict
on its own directories and on our exports, our losses equal their BinaryCrossEntropyLoss and ListNetLoss in value
and gradient, and `retrieval train --kind cross-encoder` / `retrieval eval --rerank` run end to end (the reranked
run scored as pytrec_eval scores it)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from conftest import shared_data
from test_preemption import checkpoints
from test_squad_dist import cut_copy
from torch import nn

from bertforge.cli import main
from bertforge.config import ModelConfig
from bertforge.data.bpe import train_bpe
from bertforge.models.modernbert import ModernBertForSequenceClassification
from bertforge.tasks.finetune import FinetuneError
from bertforge.tasks.retrieval.model import text_ids
from bertforge.tasks.retrieval.rerank import (
    Reranker,
    RerankerSettings,
    binary_loss,
    export_cross_encoder,
    listwise_loss,
    load_reranker,
)

st = pytest.importorskip("sentence_transformers")
transformers = pytest.importorskip("transformers")


def squad_rows(count: int, negatives: int) -> list[dict]:
    """Real SQuAD questions (each paragraph's first), each with its paragraph and the next ``negatives``
    paragraphs as negatives."""
    data = json.loads(shared_data("squad/dev-v1.1.json").read_text(encoding="utf-8"))["data"]
    paragraphs = [p for article in data[:2] for p in article["paragraphs"]]
    return [{"query": p["qas"][0]["question"], "positive": p["context"],
             "negatives": [paragraphs[(k + j + 1) % len(paragraphs)]["context"] for j in range(negatives)]}
            for k, p in enumerate(paragraphs[:count])]


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory) -> Path:
    """A tiny random BertForSequenceClassification (num_labels=1) with the uncased vocab, saved by CrossEncoder
    with a maximum length of 48 (so real paragraphs are cut); its transformers directory beside it."""
    root = tmp_path_factory.mktemp("ce")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, num_labels=1, max_position_embeddings=128,
                                     initializer_range=0.3)  # logits that differ between pairs
    transformers.BertForSequenceClassification(config).save_pretrained(root / "hf")
    transformers.BertTokenizerFast(str(shared_data("vocab/bert-base-uncased-vocab.txt"))).save_pretrained(root / "hf")
    st.CrossEncoder(str(root / "hf"), max_length=48, device="cpu").save(str(root / "ce"))
    return root


def pairs_of(rows: list[dict]) -> list[tuple[str, str]]:
    return [(row["query"], text) for row in rows for text in [row["positive"], *row["negatives"]]]


@pytest.mark.shared_data
def test_our_scores_of_crossencoder_and_transformers_directories_equal_predict(cross_encoder):
    pairs = pairs_of(squad_rows(6, 2)) + [("a long question " * 40, "short"), ("why", "")]
    for directory, longest in [(cross_encoder / "ce", 48), (cross_encoder / "hf", 128)]:
        ours = load_reranker(directory)
        theirs = st.CrossEncoder(str(directory), device="cpu")
        assert ours.settings == RerankerSettings(max_length=longest) and theirs.max_seq_length == longest
        expected = torch.tensor(theirs.predict(pairs, batch_size=5))  # their sigmoid
        assert (ours.predict(pairs, batch_size=7) - expected).abs().max().item() <= 1e-5
        logits = torch.tensor(theirs.predict(pairs, activation_fn=nn.Identity()))
        got = ours.score([q for q, _ in pairs], [p for _, p in pairs])
        assert (got - logits).abs().max().item() <= 1e-5
        assert logits.std().item() > 1e-4  # the pairs score differently: the check can fail
        # the same ids, token types and mask as their tokenizer's (pairs cut longest-first)
        queries, passages = [q for q, _ in pairs], [p for _, p in pairs]
        expected_ids = theirs.tokenizer(queries, passages, truncation=True, padding=True, return_tensors="pt",
                                        max_length=theirs.max_seq_length)
        for name, value in ours.batch(ours.tokenize(queries, passages)).items():
            assert torch.equal(value, expected_ids[name]), name


@pytest.mark.shared_data
def test_our_exports_load_in_crossencoder_with_our_scores(cross_encoder, tmp_path):
    pairs = pairs_of(squad_rows(4, 2)) + [("Ünïcode façade?", "naïve café, [SEP] in a text")]
    ours = load_reranker(cross_encoder / "ce", activation="identity")
    out = export_cross_encoder(ours, tmp_path / "bert")
    theirs = st.CrossEncoder(str(out), device="cpu")
    assert theirs.max_seq_length == 48 and isinstance(theirs.activation_fn, nn.Identity)
    assert (torch.tensor(theirs.predict(pairs)) - ours.predict(pairs)).abs().max().item() <= 1e-5
    assert load_reranker(out).settings == ours.settings  # and back

    # a ModernBERT with its BPE tokenizer.json (no token types), cut at 64 tokens by both
    text = shared_data("text/sample_text.txt").read_text(encoding="utf-8")
    vocab = train_bpe([[line] for line in text.splitlines() if line.strip()], 600, tmp_path / "tokenizer.json")
    torch.manual_seed(0)
    config = ModelConfig(family="modernbert", vocab_size=600, hidden_size=32, num_hidden_layers=3,
                         num_attention_heads=2, intermediate_size=64, max_position_embeddings=128,
                         local_attention=16)
    modern = Reranker(ModernBertForSequenceClassification(config, 1).eval(), text_ids(tmp_path, vocab),
                      RerankerSettings(max_length=64))
    out = export_cross_encoder(modern, tmp_path / "modernbert")
    theirs = st.CrossEncoder(str(out), device="cpu")
    long = [(" ".join(text.split()[:60]), " ".join(text.split()[60:200]))]
    scores = modern.predict(pairs + long)
    assert (torch.tensor(theirs.predict(pairs + long)) - scores).abs().max().item() <= 1e-5
    assert scores.std().item() > 1e-4


@pytest.mark.shared_data
@pytest.mark.parametrize("loss", ["bce", "listwise"])
def test_our_losses_equal_sentence_transformers_losses_in_value_and_gradient(cross_encoder, loss):
    from sentence_transformers.cross_encoder import losses

    rows = squad_rows(5, 3)
    theirs = st.CrossEncoder(str(cross_encoder / "ce"), device="cpu").eval()  # no dropout on either side
    ours = load_reranker(cross_encoder / "ce").eval()
    batch = ours.batch(ours.tokenize(*zip(*pairs_of(rows))))
    logits = ours(**batch)
    if loss == "bce":
        labels = torch.tensor([1.0, 0.0, 0.0, 0.0] * len(rows))
        mine = binary_loss(logits, labels)
        pairs = pairs_of(rows)
        reference = losses.BinaryCrossEntropyLoss(theirs)([[q for q, _ in pairs], [p for _, p in pairs]], labels)
    else:
        mine = listwise_loss(logits.view(len(rows), 4))
        # ListNet's target is the softmax of the labels: 0 for the positive, -inf for the negatives is one-hot
        labels = [torch.tensor([0.0, -math.inf, -math.inf, -math.inf]) for _ in rows]
        reference = losses.ListNetLoss(theirs)([[r["query"] for r in rows],
                                                [[r["positive"], *r["negatives"]] for r in rows]], labels)
    assert mine.item() == pytest.approx(reference.item(), abs=1e-6) and mine.item() > 0.1
    mine.backward()
    reference.backward()
    theirs_grads = {name: p.grad for name, p in theirs[0].model.named_parameters() if p.grad is not None}
    ours_grads = {name: p.grad for name, p in ours.model.named_parameters() if p.grad is not None}
    assert ours_grads.keys() == theirs_grads.keys() and len(ours_grads) > 30
    largest = max(g.abs().max().item() for g in theirs_grads.values())
    for name, grad in ours_grads.items():  # within 1e-5 of the largest gradient entry (float32 sums)
        assert (grad - theirs_grads[name]).abs().max().item() <= 1e-5 * largest, name


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def train(tmp_path: Path, cross_encoder: Path, name: str, *flags: str, steps: int = 2) -> Path:
    out = tmp_path / name
    data = write_rows(tmp_path / "rows.jsonl", squad_rows(16, 3))
    assert main(["retrieval", "train", "--kind", "cross-encoder", "--init", str(cross_encoder / "ce"),
                 "--data", str(data), "--negatives", "3", "--out", str(out), "--no-progress",
                 "--train.global_batch_size", "4", "--train.micro_batch_size", "2", "--train.steps", str(steps),
                 "--train.epochs", "0", "--log.every", "1", *flags]) == 0
    return out


def losses_of(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if "loss" in row and row.get("split") != "eval"]


@pytest.mark.slow
@pytest.mark.shared_data
@pytest.mark.parametrize("loss", ["bce", "listwise"])
def test_a_run_trains_resumes_and_exports_a_crossencoder(cross_encoder, tmp_path, loss):
    """4 steps with a checkpoint every 2; a copy cut at step 2, resumed, ends at the same losses and weights;
    the run and its CrossEncoder export score alike, and otherwise than the start."""
    whole = train(tmp_path, cross_encoder, "whole", "--loss", loss, "--checkpoint.every", "2",
                  "--checkpoint.keep", "0", steps=4)
    assert checkpoints(whole) == ["step_00000002", "step_00000004"] and len(losses_of(whole)) == 4
    cut = cut_copy(whole, tmp_path / "cut", 2)
    for name in ("reranker.yaml", "tokenizer.json"):  # (cut_copy knows the other runs' files)
        shutil.copyfile(whole / name, cut / name)
    assert main(["retrieval", "train", "--resume", str(cut), "--no-progress"]) == 0  # a reranker's run, found
    assert losses_of(cut) == losses_of(whole)[2:]
    pairs = pairs_of(squad_rows(3, 2))
    ours = load_reranker(whole)
    assert torch.equal(load_reranker(cut).predict(pairs), ours.predict(pairs))
    exported = st.CrossEncoder(str(whole / "cross-encoder"), device="cpu")
    assert (torch.tensor(exported.predict(pairs)) - ours.predict(pairs)).abs().max().item() <= 1e-5
    assert (ours.predict(pairs) - load_reranker(cross_encoder / "ce").predict(pairs)).abs().max().item() > 1e-5


@pytest.mark.slow
@pytest.mark.shared_data
def test_eval_reranks_the_bi_encoders_top_k_and_scores_it_as_pytrec_eval(cross_encoder, tmp_path, capsys):
    pytrec_eval = pytest.importorskip("pytrec_eval")
    dev = json.loads(shared_data("squad/dev-v1.1.json").read_text(encoding="utf-8"))
    (tmp_path / "squad.json").write_text(json.dumps({"data": dev["data"][1:2]}), encoding="utf-8")
    assert main(["retrieval", "from-squad", str(tmp_path / "squad.json"), str(tmp_path / "beir")]) == 0
    # the bi-encoder: the same tiny BERT's encoder, mean-pooled
    argv = ["retrieval", "eval", str(cross_encoder / "hf"), str(tmp_path / "beir"), "--no-progress",
            "--document-max-length", "64"]
    assert main([*argv, "--out", str(tmp_path / "plain")]) == 0
    assert main([*argv, "--out", str(tmp_path / "reranked"), "--rerank", "5",
                 "--reranker", str(cross_encoder / "ce")]) == 0
    metrics = json.loads((tmp_path / "reranked" / "metrics.json").read_text())
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == metrics and metrics["reranked"] == 5
    run, plain = read_run(tmp_path / "reranked" / "run.trec"), read_run(tmp_path / "plain" / "run.trec")
    queries = {json.loads(line)["_id"]: json.loads(line)["text"]
               for line in (tmp_path / "beir" / "queries.jsonl").read_text().splitlines()}
    corpus = {json.loads(line)["_id"]: json.loads(line)["text"]
              for line in (tmp_path / "beir" / "corpus.jsonl").read_text().splitlines()}
    theirs = st.CrossEncoder(str(cross_encoder / "ce"), device="cpu")
    for q, docs in list(run.items())[:20]:  # the bi-encoder's first 5, scored by CrossEncoder.predict
        first = sorted(plain[q], key=lambda d: (plain[q][d], d), reverse=True)[:5]
        assert sorted(docs) == sorted(first)
        scores = theirs.predict([(queries[q], corpus[d]) for d in first], activation_fn=nn.Identity())
        assert max(abs(docs[d] - s) for d, s in zip(first, scores)) <= 1e-5
    qrels: dict[str, dict[str, int]] = {}
    for line in (tmp_path / "beir" / "qrels" / "test.tsv").read_text().splitlines()[1:]:
        q, d, s = line.split("\t")
        qrels.setdefault(q, {})[d] = int(s)
    trec = pytrec_eval.RelevanceEvaluator(qrels, {"ndcg_cut.10", "recall.1,10"}).evaluate(run)
    for ours, name in [("ndcg@10", "ndcg_cut_10"), ("recall@1", "recall_1"), ("recall@10", "recall_10")]:
        assert metrics[ours] == pytest.approx(sum(t[name] for t in trec.values()) / len(trec), abs=1e-12), ours


def read_run(path: Path) -> dict[str, dict[str, float]]:
    run: dict[str, dict[str, float]] = {}
    for line in path.read_text().splitlines():
        q, _, doc, _, score, _ = line.split()
        run.setdefault(q, {})[doc] = float(score)
    return run


@pytest.mark.shared_data
@pytest.mark.parametrize("flags, message", [
    (["--negatives", "0"], "--negatives 0: a reranker learns from hard negatives"),
    (["--negatives", "3", "--pooling", "cls"], "--pooling: a bi-encoder setting"),
    (["--negatives", "5"], "fewer than the 5 asked for"),
])
def test_bad_reranker_training_is_one_line_and_writes_nothing(cross_encoder, tmp_path, capsys, flags, message):
    data = write_rows(tmp_path / "rows.jsonl", squad_rows(8, 3))
    assert main(["retrieval", "train", "--kind", "cross-encoder", "--init", str(cross_encoder / "ce"), "--data",
                 str(data), "--out", str(tmp_path / "run"), "--no-progress", *flags]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and message in error[0]
    assert not (tmp_path / "run").exists()


def test_an_embedding_model_is_no_reranker_and_rerank_needs_one(cross_encoder, tmp_path, capsys):
    config = transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=128)
    transformers.BertModel(config).save_pretrained(tmp_path / "encoder")
    with pytest.raises(FinetuneError, match=r"architectures \['BertModel'\] is not a reranker"):
        load_reranker(tmp_path / "encoder")
    assert main(["retrieval", "eval", str(cross_encoder / "hf"), str(tmp_path), "--rerank", "5"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == "error: --rerank K and --reranker MODEL go together"
    assert main(["retrieval", "train", "--init", str(cross_encoder / "hf"), "--data", "rows.jsonl", "--loss", "bce",
                 "--out", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == ("error: --loss is a cross-encoder setting "
                                                                "(--kind cross-encoder)")
    assert not (tmp_path / "run").exists()
