"""The retrieval metrics of BEIR and MTEB, as trec_eval defines them.

A run gives each query a score per retrieved document. trec_eval ranks a query's documents by
score, highest first, and equal scores by document id, *descending* (byte order): that order
is :func:`trec_ranking`, and every metric below reads it. A document is relevant when its
grade in the qrels is at least 1; ``num_rel`` is the number of relevant documents in the qrels
(retrieved or not).

    ndcg@10     trec_eval's ndcg_cut_10: DCG of the first 10 (gain = the grade, discount
                log2(rank + 1)) over the DCG of the qrels' best 10 grades
    mrr@10      1 / rank of the first relevant document, 0 when none is in the first 10: trec_eval's
                recip_rank of the run cut to its first 10 (trec_eval's recip_rank itself has no cut-off;
                sentence-transformers' MRR@10 is this one)
    map@100     trec_eval's map_cut_100: the precisions at the ranks (≤ 100) of the relevant
                documents, summed, over num_rel
    recall@k    trec_eval's recall_k: relevant documents in the first k over num_rel

As trec_eval, only queries that are both in the run and in the qrels are scored; a judged query
with no relevant document scores 0 everywhere (and counts in the mean). The means are over the
scored queries.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

RECALL_CUTOFFS = (1, 10, 100)
METRICS = ("ndcg@10", "mrr@10", "map@100", *(f"recall@{k}" for k in RECALL_CUTOFFS))
DEPTH = 100  # the deepest rank any metric reads: a run of the first 100 scores as the whole run


def trec_ranking(scores: Mapping[str, float]) -> list[str]:
    """Document ids in trec_eval's order: score descending, then id descending."""
    return [doc for doc, _ in sorted(scores.items(), key=lambda item: (item[1], item[0]), reverse=True)]


def _dcg(gains: list[int]) -> float:
    return sum(gain / math.log2(rank + 2) for rank, gain in enumerate(gains) if gain > 0)


def query_metrics(ranking: list[str], judged: Mapping[str, int]) -> dict[str, float]:
    """Each metric of one query: ``ranking`` in trec_eval's order, ``judged`` its qrels (id → grade)."""
    relevant = [judged.get(doc, 0) >= 1 for doc in ranking[:DEPTH]]
    num_rel = sum(grade >= 1 for grade in judged.values())
    if num_rel == 0:
        return dict.fromkeys(METRICS, 0.0)
    ideal = _dcg(sorted((g for g in judged.values() if g > 0), reverse=True)[:10])
    first = next((rank for rank, hit in enumerate(relevant[:10], start=1) if hit), None)
    hits, precisions = 0, 0.0
    for rank, hit in enumerate(relevant, start=1):
        if hit:
            hits += 1
            precisions += hits / rank
    result = {
        "ndcg@10": _dcg([judged.get(doc, 0) for doc in ranking[:10]]) / ideal,
        "mrr@10": 1.0 / first if first else 0.0,
        "map@100": precisions / num_rel,
    }
    for k in RECALL_CUTOFFS:
        result[f"recall@{k}"] = sum(relevant[:k]) / num_rel
    return result


def evaluate_run(qrels: Mapping[str, Mapping[str, int]], run: Mapping[str, Mapping[str, float]]
                 ) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """(the mean of each metric, each query's) over the queries in both ``run`` and ``qrels``."""
    per_query = {q: query_metrics(trec_ranking(run[q]), qrels[q]) for q in run if q in qrels}
    if not per_query:
        raise ValueError("no query of the run is in the qrels: nothing to score")
    means = {name: sum(scores[name] for scores in per_query.values()) / len(per_query) for name in METRICS}
    return means, per_query
