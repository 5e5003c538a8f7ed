"""The official SQuAD v1.1 metric (``evaluate-v1.1.py``): exact match and F1, ×100.

An answer is normalized by lowercasing, removing ASCII punctuation, removing
the articles "a", "an", "the" (whole words), and collapsing whitespace. Exact
match is 1 when the normalized prediction equals a normalized ground truth;
F1 is the harmonic mean of token precision and recall against a ground truth
(0 when no token is shared). Each question takes its best score over its
ground truths; a question without a prediction scores 0. Both are averaged
over all questions of the dataset, in file order, as the official script sums them.
"""

from __future__ import annotations

import logging
import re
import string
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .data import SquadError, load_json

log = logging.getLogger(__name__)

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """Lowercase, drop punctuation and articles, collapse whitespace (in the official order)."""
    text = text.lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match_score(prediction: str, ground_truth: str) -> bool:
    return normalize_answer(prediction) == normalize_answer(ground_truth)


def f1_score(prediction: str, ground_truth: str) -> float:
    predicted = normalize_answer(prediction).split()
    truth = normalize_answer(ground_truth).split()
    shared = sum((Counter(predicted) & Counter(truth)).values())
    if shared == 0:
        return 0
    precision = shared / len(predicted)
    recall = shared / len(truth)
    return 2 * precision * recall / (precision + recall)


def _best(metric: Callable[[str, str], float], prediction: str, ground_truths: list[str]) -> float:
    return max(metric(prediction, truth) for truth in ground_truths)


def evaluate(dataset: Any, predictions: dict[str, str]) -> dict[str, float]:
    """``{"exact_match": …, "f1": …}`` of ``predictions`` (question id → text) on ``dataset``.

    ``dataset`` is a SQuAD JSON object (``{"data": [...]}``), its ``"data"``
    list, or the path of a SQuAD JSON file.
    """
    source = "<dataset>"
    if isinstance(dataset, (str, Path)):
        source, dataset = str(dataset), load_json(dataset)
    articles = dataset["data"] if isinstance(dataset, dict) and "data" in dataset else dataset
    if not isinstance(articles, list):
        raise SquadError(f"{source}: expected a SQuAD dataset with a 'data' list")
    if not isinstance(predictions, dict):
        raise SquadError(f"predictions should map question ids to answer texts, "
                         f"got {type(predictions).__name__}")

    exact_match = f1 = 0.0
    total = unanswered = 0
    for a, article in enumerate(articles):
        for p, paragraph in enumerate(_get(article, "paragraphs", f"{source}: data[{a}]")):
            for q, qa in enumerate(_get(paragraph, "qas", f"{source}: data[{a}].paragraphs[{p}]")):
                qas_id = _get(qa, "id", f"{source}: data[{a}].paragraphs[{p}].qas[{q}]")
                total += 1
                if qas_id not in predictions:
                    unanswered += 1
                    continue
                prediction = predictions[qas_id]
                if not isinstance(prediction, str):
                    raise SquadError(f"prediction for question {qas_id} should be a string, "
                                     f"got {type(prediction).__name__}")
                where = f"{source}: question {qas_id}"
                truths = [_get(answer, "text", f"{where}, answer")
                          for answer in _get(qa, "answers", where)]
                if not truths:
                    raise SquadError(f"{where}: no ground-truth answers")
                exact_match += _best(exact_match_score, prediction, truths)
                f1 += _best(f1_score, prediction, truths)
    if total == 0:
        raise SquadError(f"{source}: the dataset has no questions")
    if unanswered:
        log.warning("%d of %d questions have no prediction and score 0", unanswered, total)
    return {"exact_match": 100.0 * exact_match / total, "f1": 100.0 * f1 / total}


def _get(obj: Any, key: str, where: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise SquadError(f"{where}: missing field '{key}'")
    return obj[key]
