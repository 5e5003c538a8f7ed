"""`bertforge retrieval eval` end to end: SQuAD → BEIR → a tiny BERT's run, scored as pytrec_eval
scores the run file; the corpus cache; bad data."""

import json

import pytest
import torch
from conftest import shared_data

from bertforge.cli import main
from bertforge.config import ModelConfig
from bertforge.formats.hf import export_hf
from bertforge.models.bert import BertForPreTraining


@pytest.fixture(scope="module")
def tiny_squad_ir(tmp_path_factory):
    """Articles 1 and 2 of the SQuAD dev set (94 paragraphs, 359 questions) as a BEIR directory,
    and a random 2-layer BERT (hidden 32) with the uncased vocab as a transformers directory."""
    root = tmp_path_factory.mktemp("ir")
    dev = json.loads(shared_data("squad/dev-v1.1.json").read_text(encoding="utf-8"))
    (root / "squad.json").write_text(json.dumps({"data": dev["data"][1:3]}), encoding="utf-8")
    assert main(["retrieval", "from-squad", str(root / "squad.json"), str(root / "beir")]) == 0
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=64, max_position_embeddings=512)
    export_hf(BertForPreTraining(cfg), root / "model", vocab_path=shared_data("vocab/bert-base-uncased-vocab.txt"))
    return root


def read_run(path):
    run = {}
    for line in path.read_text().splitlines():
        q, _, doc, _, score, _ = line.split()
        run.setdefault(q, {})[doc] = float(score)
    return run


@pytest.mark.shared_data
def test_eval_writes_metrics_equal_to_pytrec_eval_on_its_run_file(tiny_squad_ir, capsys):
    pytrec_eval = pytest.importorskip("pytrec_eval")
    root = tiny_squad_ir
    argv = ["retrieval", "eval", str(root / "model"), str(root / "beir"), "--out", str(root / "out"),
            "--no-progress", "--document-max-length", "128"]
    assert main(argv) == 0
    printed = json.loads(capsys.readouterr().out.splitlines()[-1])
    metrics = json.loads((root / "out" / "metrics.json").read_text())
    assert printed == metrics and (metrics["queries"], metrics["documents"]) == (359, 94)
    run = read_run(root / "out" / "run.trec")
    assert len(run) == 359 and all(len(docs) == 94 for docs in run.values())  # top 100 of 94: all
    qrels = {}
    for line in (root / "beir" / "qrels" / "test.tsv").read_text().splitlines()[1:]:
        q, d, s = line.split("\t")
        qrels.setdefault(q, {})[d] = int(s)
    trec = pytrec_eval.RelevanceEvaluator(qrels, {"ndcg_cut.10", "map_cut.100", "recall.1,10,100"}).evaluate(run)
    for ours, theirs in [("ndcg@10", "ndcg_cut_10"), ("map@100", "map_cut_100"), ("recall@1", "recall_1"),
                         ("recall@10", "recall_10"), ("recall@100", "recall_100")]:
        assert metrics[ours] == pytest.approx(sum(t[theirs] for t in trec.values()) / 359, abs=1e-12), ours
    assert metrics["recall@100"] == 1.0 and metrics["recall@1"] < 0.5  # random weights: far from perfect
    cached = list((root / "out" / "cache").glob("corpus-*.safetensors"))
    assert len(cached) == 1
    # again: the corpus comes from the cache (its file untouched), the metrics are the same
    stamp = cached[0].stat().st_mtime_ns
    assert main(argv) == 0 and json.loads((root / "out" / "metrics.json").read_text()) == metrics
    assert cached[0].stat().st_mtime_ns == stamp
    # other settings are another model: a second cache file
    assert main([*argv[:-1], "96"]) == 0
    assert len(list((root / "out" / "cache").glob("corpus-*.safetensors"))) == 2


@pytest.mark.shared_data
def test_eval_refuses_bad_qrels_with_one_line_and_writes_nothing(tiny_squad_ir, tmp_path, capsys):
    beir = tmp_path / "beir"
    beir.mkdir()
    for name in ("corpus.jsonl", "queries.jsonl"):
        (beir / name).write_text((tiny_squad_ir / "beir" / name).read_text())
    (beir / "qrels").mkdir()
    (beir / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n5733a5f54776f41900660f45\ta9-p9\t1\n")
    status = main(["retrieval", "eval", str(tiny_squad_ir / "model"), str(beir), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert status == 2 and err == f"error: {beir / 'qrels' / 'test.tsv'}:2: corpus-id 'a9-p9' is not in corpus.jsonl"
    assert not (tmp_path / "out").exists()


@pytest.mark.shared_data
@pytest.mark.slow
def test_late_interaction_eval_scores_maxsim_of_the_models_token_embeddings(tiny_squad_ir, tmp_path):
    """--late-interaction: the run's top 5 and scores are MaxSim of what LateInteraction.encode
    gives (its new projection drawn from the same seed), and its metrics trec_eval's of the run file."""
    pytrec_eval = pytest.importorskip("pytrec_eval")
    from bertforge.tasks.retrieval.beir import read_beir
    from bertforge.tasks.retrieval.model import LateInteraction, load_embedder

    root, data = tiny_squad_ir, read_beir(tiny_squad_ir / "beir")
    torch.manual_seed(0)
    assert main(["retrieval", "eval", str(root / "model"), str(root / "beir"), "--late-interaction", "--top-k", "5",
                 "--document-max-length", "32", "--no-progress", "--out", str(tmp_path / "out")]) == 0
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    run = read_run(tmp_path / "out" / "run.trec")
    assert len(run) == 359 and all(len(docs) == 5 for docs in run.values())
    torch.manual_seed(0)
    model = load_embedder(root / "model", late_interaction=True, document_max_length=32)
    assert isinstance(model, LateInteraction)
    query_ids = list(data.queries)[:3]
    queries = model.encode([data.queries[q] for q in query_ids], "query")
    docs = model.encode(list(data.corpus.values()), "document")
    for query_id, query in zip(query_ids, queries):
        by_hand = {d: float((query @ t.T).max(dim=1).values.sum()) for d, t in zip(data.corpus, docs)}
        best = sorted(by_hand, key=by_hand.get, reverse=True)[:5]
        assert sorted(run[query_id]) == sorted(best)
        for d in best:
            assert run[query_id][d] == pytest.approx(by_hand[d], rel=1e-6)
    trec = pytrec_eval.RelevanceEvaluator(data.qrels, {"recall.1"}).evaluate(run)
    assert metrics["recall@1"] == pytest.approx(sum(t["recall_1"] for t in trec.values()) / 359, abs=1e-12)
