"""Hard negatives mined by a model: ``bertforge retrieval mine``.

For each training query, the passages an encoder ranks highest, its positives left out, kept by
the rules of sentence-transformers' ``mine_hard_negatives`` (``sentence_transformers/util/
hard_negatives.py``) with ``output_format="n-tuple"``, so that the same model, rows and settings
give the same negatives (tests/tasks/test_retrieval_mine.py):

- The queries are the rows' distinct query texts; a query's positives are the distinct positive
  texts of its rows, all left out of its candidates. The candidates are the distinct texts of
  ``corpus`` and of the positives together (the positives alone without a corpus).
- Each query keeps its ``range_max + P`` best candidates by cosine similarity (P: the most rows
  one query has), so that its positives cannot push a negative out of the range. Then a
  candidate is dropped when it is a positive, within ``absolute_margin`` of the query's lowest
  positive score (``score + margin > positive``), above ``positive - |positive| ×
  relative_margin``, above ``max_score`` or below ``min_score``.
- Of what is left, best first, the first ``range_min`` are skipped (ranks among the remaining
  candidates, as theirs) and the next ``range_max - range_min`` are the window: ``top`` takes
  its first ``num_negatives``, ``random`` draws ``num_negatives`` positions of the window with
  ``random.Random(seed).sample`` (the same draws as theirs after ``random.seed(seed)``), each
  row best first.
- A query that gets fewer than ``num_negatives`` negatives is left out. The rows written are one
  per distinct (query, positive), grouped by query in the order queries first appear (theirs'
  order): ``{"query", "positive", "negatives": [...]}``, the rows ``retrieval train`` reads.

``range_max`` defaults as theirs: ``range_min + num_negatives + P``, or ``range_min + 10 ×
num_negatives + P`` when a margin or ``max_score`` can drop candidates. The search is
evaluate.py's exact one; a late-interaction model (MaxSim scores) is refused, as theirs takes
single vectors.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from bertforge.config import ConfigError
from bertforge.fileio import atomic_file

from .evaluate import Encoder, dense_search, encode_texts
from .pairs import Pairs

SAMPLING = ("top", "random")


@dataclass
class MiningSettings:
    """``mine_hard_negatives``' settings, named as there."""

    num_negatives: int = 3
    range_min: int = 0
    range_max: int | None = None
    max_score: float | None = None
    min_score: float | None = None
    absolute_margin: float | None = None
    relative_margin: float | None = None
    sampling_strategy: Literal["top", "random"] = "top"
    seed: int = 0                 # of ``random``'s draws

    def window(self, most_rows: int) -> int:
        """``range_max``, given or by default; refused in one line when it leaves too few candidates."""
        if self.num_negatives < 1:
            raise ConfigError(f"--num-negatives {self.num_negatives}: at least 1")
        if self.sampling_strategy not in SAMPLING:
            raise ConfigError(f"--sampling-strategy {self.sampling_strategy!r}: one of {', '.join(SAMPLING)}")
        if self.range_min < 0:
            raise ConfigError(f"--range-min {self.range_min}: must not be negative")
        range_max = self.range_max
        if range_max is None:
            filtered = self.absolute_margin is not None or self.relative_margin is not None \
                or self.max_score is not None
            range_max = self.range_min + self.num_negatives * (10 if filtered else 1) + most_rows
        if range_max - self.range_min < self.num_negatives:
            raise ConfigError(f"--range-max {range_max}: the ranks {self.range_min} to {range_max} hold fewer than "
                              f"--num-negatives {self.num_negatives} candidates")
        return range_max


@dataclass
class Mined:
    """The rows (``{"query", "positive", "negatives"}``) and what the filters dropped."""

    rows: list[dict[str, Any]]
    queries: int                                          # distinct queries
    left_out: int                                         # rows without enough negatives
    skipped: dict[str, int] = field(default_factory=dict)  # candidates dropped, by filter


def _queries_and_positives(pairs: Pairs) -> tuple[list[str], list[list[str]], int]:
    """The distinct queries in order, each one's distinct positives, and the most rows of one query."""
    positives: dict[str, list[str]] = {}
    rows: dict[str, int] = {}
    for query, positive in zip(pairs.queries, pairs.positives):
        kept = positives.setdefault(query, [])
        if positive not in kept:
            kept.append(positive)
        rows[query] = rows.get(query, 0) + 1
    return list(positives), list(positives.values()), max(rows.values())


def _drop(scores: torch.Tensor, removed: torch.Tensor, name: str, skipped: dict[str, int]) -> None:
    """Set the removed candidates' scores to -inf, counting them under ``name``."""
    scores[removed] = -float("inf")
    if int(removed.sum()):
        skipped[name] = int(removed.sum())


def _filter(scores: torch.Tensor, lowest_positive: torch.Tensor, settings: MiningSettings) -> dict[str, int]:
    """The margins and score bounds applied in place to ``scores`` ``[queries, candidates]``."""
    skipped: dict[str, int] = {}
    floor = lowest_positive[:, None]
    if settings.absolute_margin is not None:
        _drop(scores, scores + settings.absolute_margin > floor, "absolute_margin", skipped)
    if settings.relative_margin is not None:  # |positive| × margin below it: the same side for negative scores
        _drop(scores, scores > floor - floor.abs() * settings.relative_margin, "relative_margin", skipped)
    if settings.max_score is not None:
        _drop(scores, scores > settings.max_score, "max_score", skipped)
    if settings.min_score is not None:
        _drop(scores, scores < settings.min_score, "min_score", skipped)
    return skipped


def _choose(scores: torch.Tensor, indices: torch.Tensor, settings: MiningSettings, range_max: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores, candidate indices) ``[queries, num_negatives]`` of the window, best first; -inf marks none."""
    n = settings.num_negatives
    scores, local = scores.topk(range_max, dim=1)
    scores, indices = scores[:, settings.range_min:], indices.gather(1, local)[:, settings.range_min:]
    if settings.sampling_strategy == "top":
        return scores[:, :n], indices[:, :n]
    draws = random.Random(settings.seed)
    options = (scores.shape[1] - scores.isinf().sum(1)).clamp(min=n)  # positions of real candidates, if enough
    picked = torch.tensor([draws.sample(range(int(count)), k=n) for count in options], dtype=torch.long)
    scores, indices = scores.gather(1, picked), indices.gather(1, picked)
    scores, order = scores.sort(dim=1, descending=True)
    return scores, indices.gather(1, order)


def mine_negatives(model: Encoder, pairs: Pairs, corpus: Sequence[str] = (), settings: MiningSettings | None = None,
                   batch_size: int = 32, progress: bool = False) -> Mined:
    """``pairs``' rows with the hard negatives ``model`` gives them among ``corpus`` and the positives."""
    settings = settings or MiningSettings()
    queries, positives, most_rows = _queries_and_positives(pairs)
    range_max = settings.window(most_rows)
    candidates = list(dict.fromkeys([*corpus, *pairs.positives]))
    where = {text: i for i, text in enumerate(candidates)}
    documents = encode_texts(model, candidates, "document", batch_size, progress, "corpus")
    query_vectors = encode_texts(model, queries, "query", batch_size, progress, "queries")
    if not isinstance(documents, torch.Tensor) or not isinstance(query_vectors, torch.Tensor):
        raise ConfigError("mining takes a single-vector model; this one is late interaction (MaxSim)")
    width = range_max + most_rows
    found, indices = dense_search(query_vectors, documents, min(width, len(candidates)))
    scores = torch.full((len(queries), width), -float("inf"))
    scores[:, :found.shape[1]] = found
    columns = torch.full((len(queries), width), -1, dtype=torch.long)
    columns[:, :found.shape[1]] = indices
    positive_ids = [torch.tensor([where[p] for p in own]) for own in positives]
    for q, own in enumerate(positive_ids):
        scores[q, torch.isin(columns[q], own)] = -float("inf")
    unit_queries = torch.nn.functional.normalize(query_vectors, dim=1)
    unit_documents = torch.nn.functional.normalize(documents, dim=1)
    lowest_positive = torch.stack([(unit_documents[own] @ unit_queries[q]).min()
                                   for q, own in enumerate(positive_ids)])
    skipped = _filter(scores, lowest_positive, settings)
    chosen_scores, chosen = _choose(scores, columns, settings, range_max)
    rows: list[dict[str, Any]] = []
    left_out = 0
    for q, query in enumerate(queries):
        if bool(chosen_scores[q].isinf().any()):
            left_out += len(positives[q])
            continue
        negatives = [candidates[i] for i in chosen[q].tolist()]
        rows.extend({"query": query, "positive": positive, "negatives": negatives} for positive in positives[q])
    return Mined(rows, len(queries), left_out, skipped)


def write_rows(rows: Sequence[dict[str, Any]], out: str | Path) -> None:
    """The rows as JSON Lines, written whole or not at all."""
    with atomic_file(Path(out)) as tmp:
        tmp.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
