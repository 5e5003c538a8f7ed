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

from .data import SquadError, answer_texts, get_field, json_kind, load_json, location

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


def check_predictions(predictions: Any, source: str = "predictions") -> dict[str, str]:
    """``predictions`` checked to be a JSON object of question id → answer string.

    The first wrong entry is an error naming ``source`` and the question id, e.g.
    ``predictions.json: question 56be4db0acb8001400a502ec: expected a string answer, got an integer``.
    """
    if not isinstance(predictions, dict):
        raise SquadError(f"{source}: expected an object of question id → answer text, "
                         f"got {json_kind(predictions)}")
    for qas_id, text in predictions.items():
        if not isinstance(text, str):
            raise SquadError(f"{source}: question {qas_id}: expected a string answer, got {json_kind(text)}")
    return predictions


def evaluate(dataset: Any, predictions: dict[str, str], predictions_source: str = "predictions"
             ) -> dict[str, float]:
    """``{"exact_match": …, "f1": …}`` of ``predictions`` (question id → text) on ``dataset``.

    ``dataset`` is a SQuAD JSON object (``{"data": [...]}``), its ``"data"``
    list, or the path of a SQuAD JSON file. A malformed dataset or predictions
    object is a :class:`SquadError` naming the file (``predictions_source`` for
    the predictions), the field's path and the question id.
    """
    source = "<dataset>"
    if isinstance(dataset, (str, Path)):
        source, dataset = str(dataset), load_json(dataset)
    if isinstance(dataset, list):  # the "data" list alone
        dataset = {"data": dataset}
    if not isinstance(dataset, dict) or not isinstance(dataset.get("data"), list):
        raise SquadError(f"{source}: expected a SQuAD dataset with a 'data' list")
    check_predictions(predictions, predictions_source)

    exact_match = f1 = 0.0
    total = unanswered = 0
    for a, article in enumerate(dataset["data"]):
        paragraphs = get_field(article, "paragraphs", list, source, f"data[{a}]")
        for p, paragraph in enumerate(paragraphs):
            qas = get_field(paragraph, "qas", list, source, f"data[{a}].paragraphs[{p}]")
            for q, qa in enumerate(qas):
                path = f"data[{a}].paragraphs[{p}].qas[{q}]"
                qas_id = get_field(qa, "id", str, source, path)
                truths = answer_texts(qa, source, path, qas_id)
                if not truths:
                    raise SquadError(f"{location(source, path, qas_id)}: no ground-truth answers")
                total += 1
                if qas_id not in predictions:
                    unanswered += 1
                    continue
                prediction = predictions[qas_id]
                exact_match += _best(exact_match_score, prediction, truths)
                f1 += _best(f1_score, prediction, truths)
    if total == 0:
        raise SquadError(f"{source}: the dataset has no questions")
    if unanswered:
        log.warning("%d of %d questions have no prediction and score 0", unanswered, total)
    return {"exact_match": 100.0 * exact_match / total, "f1": 100.0 * f1 / total}
