"""The retrieval metrics against pytrec_eval (trec_eval's own code), ties and grades included."""

import random

import pytest

from bertforge.tasks.retrieval.metrics import METRICS, evaluate_run, query_metrics, trec_ranking

pytrec_eval = pytest.importorskip("pytrec_eval")

TREC_NAMES = {"ndcg@10": "ndcg_cut_10", "map@100": "map_cut_100",
              "recall@1": "recall_1", "recall@10": "recall_10", "recall@100": "recall_100"}


def random_case(seed):
    """Queries with graded judgements (some with none relevant) and runs of up to 150 documents
    whose scores come from a few values, so that most ranks are ties."""
    rng = random.Random(seed)
    docs = [f"d{i}" for i in range(200)]
    qrels, run = {}, {}
    for q in range(40):
        judged = rng.sample(docs, rng.randint(1, 12))
        qrels[f"q{q}"] = {d: rng.choice([0, 0, 1, 2, 3]) for d in judged}
        if q % 7 == 0:
            qrels[f"q{q}"] = dict.fromkeys(judged, 0)  # judged, none relevant
        if q != 5:  # q5: judged but not retrieved; trec_eval leaves it out
            run[f"q{q}"] = {d: float(rng.randint(0, 6)) / 4 for d in rng.sample(docs, rng.randint(5, 150))}
    run["unjudged"] = {"d1": 1.0}
    return qrels, run


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.smoke
def test_every_metric_equals_trec_eval_on_ties_and_grades(seed):
    qrels, run = random_case(seed)
    means, per_query = evaluate_run(qrels, run)
    trec = pytrec_eval.RelevanceEvaluator(qrels, {"ndcg_cut.10", "map_cut.100", "recall.1,10,100"}).evaluate(run)
    assert sorted(per_query) == sorted(trec)  # the same queries scored: q5 and "unjudged" left out
    assert len(per_query) == 39
    for q, theirs in trec.items():
        for ours, name in TREC_NAMES.items():
            assert per_query[q][ours] == pytest.approx(theirs[name], abs=1e-12), (q, ours)
    # mrr@10: trec_eval's recip_rank of the run cut to its first 10 in trec_eval's own order
    cut = {q: {d: run[q][d] for d in trec_ranking(run[q])[:10]} for q in run}
    recip = pytrec_eval.RelevanceEvaluator(qrels, {"recip_rank"}).evaluate(cut)
    for q, theirs in recip.items():
        assert per_query[q]["mrr@10"] == pytest.approx(theirs["recip_rank"], abs=1e-12), q
    for name in METRICS:
        assert means[name] == pytest.approx(sum(s[name] for s in per_query.values()) / 39)
    assert 0 < means["ndcg@10"] < 1


def test_equal_scores_rank_by_document_id_descending():
    """trec_eval's order: with all scores equal, d3 (grade 2) comes first and d1 (grade 1) third."""
    judged = {"d1": 1, "d2": 0, "d3": 2}
    scores = {"d1": 0.5, "d2": 0.5, "d3": 0.5, "d4": 0.1}
    assert trec_ranking(scores) == ["d3", "d2", "d1", "d4"]
    ours = query_metrics(trec_ranking(scores), judged)
    assert ours["mrr@10"] == 1.0 and ours["recall@1"] == 0.5
    assert ours["map@100"] == pytest.approx((1 / 1 + 2 / 3) / 2)
    theirs = pytrec_eval.RelevanceEvaluator({"q": judged}, {"ndcg_cut.10"}).evaluate({"q": scores})
    dcg, ideal = 2 / 1 + 1 / 2, 2 / 1 + 1 / 1.5849625007211563  # d3 at rank 1, d1 at 3; the best: d3, d1
    assert ours["ndcg@10"] == pytest.approx(theirs["q"]["ndcg_cut_10"]) == pytest.approx(dcg / ideal)


def test_a_relevant_document_past_rank_10_counts_for_recall_not_mrr():
    scores = {f"d{i:03d}": 1.0 - i / 100 for i in range(50)}
    ours = query_metrics(trec_ranking(scores), {"d011": 1})  # rank 12
    assert ours["mrr@10"] == 0.0 and ours["recall@10"] == 0.0 and ours["recall@100"] == 1.0
    assert ours["map@100"] == pytest.approx(1 / 12)
