"""Training rows of a retrieval fine-tune: (query, positive, hard negatives…) from JSON Lines, Parquet or a
``datasets`` ``save_to_disk`` directory.

A JSON Lines row is ``{"query": …, "positive": …, "negatives": […]}`` (what ``bertforge retrieval
from-squad`` writes); a table has string columns ``query`` and ``positive`` and, for hard negatives,
``negative_1``, ``negative_2``, … (sentence-transformers' column layout). A row with an empty text,
or fewer negatives than asked for, is an error naming the file and line (row).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from bertforge.data import DataError
from bertforge.data.text import json_objects, read_rows


@dataclass
class Pairs:
    """Each row's query, positive and first ``negatives`` hard negatives (``negatives[j][i]``: row i's j-th)."""

    queries: list[str] = field(default_factory=list)
    positives: list[str] = field(default_factory=list)
    negatives: list[list[str]] = field(default_factory=list)


def _text(value: object, path: Path, where: str, name: str) -> str:
    if not isinstance(value, str) or not value.strip():
        got = "empty" if isinstance(value, str) else "null" if value is None else type(value).__name__
        raise DataError(f"{path}: {where}: {name!r} is {got}, not a text")
    return value


def read_pairs(path: str | Path, negatives: int = 0) -> Pairs:
    """The rows of ``path`` with ``negatives`` hard negatives each (0: in-batch negatives alone)."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"training data not found: {path}")
    pairs = Pairs(negatives=[[] for _ in range(negatives)])
    if path.is_dir() or path.name.endswith(".parquet"):
        columns = ["query", "positive", *(f"negative_{j + 1}" for j in range(negatives))]
        values = [[(row, _text(text, path, f"row {row}", column)) for row, text in read_rows(path, column)]
                  for column in columns]
        pairs.queries, pairs.positives = [t for _, t in values[0]], [t for _, t in values[1]]
        pairs.negatives = [[t for _, t in column] for column in values[2:]]
    else:
        for number, row in json_objects(path):
            _add_json_row(pairs, path, number, row, negatives)
    if not pairs.queries:
        raise DataError(f"{path}: no training rows")
    return pairs


def _add_json_row(pairs: Pairs, path: Path, number: int, row: dict, negatives: int) -> None:
    where = f"line {number}"
    pairs.queries.append(_text(row.get("query"), path, where, "query"))
    pairs.positives.append(_text(row.get("positive"), path, where, "positive"))
    given = row.get("negatives") or []
    if not isinstance(given, list) or len(given) < negatives:
        count = len(given) if isinstance(given, list) else 0
        raise DataError(f"{path}: {where}: {count} negatives, fewer than the {negatives} asked for")
    for j in range(negatives):
        pairs.negatives[j].append(_text(given[j], path, where, f"negatives[{j}]"))
