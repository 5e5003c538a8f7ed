"""The official SQuAD v1.1 metric (``evaluate-v1.1.py``): exact match and F1, ×100.

An answer is normalized by lowercasing, removing ASCII punctuation, removing
the articles "a", "an", "the" (whole words), and collapsing whitespace. Exact
match is 1 when the normalized prediction equals a normalized ground truth;
F1 is the harmonic mean of token precision and recall against a ground truth
(0 when no token is shared). Each question takes its best score over its
ground truths; a question without a prediction scores 0. Both are averaged
over all questions of the dataset, in file order, as the official script sums them.

SQuAD v2.0 (:func:`evaluate_v2`) is the official ``evaluate-v2.0.py``; see there.
"""

from __future__ import annotations

import logging
import math
import re
import string
from collections import Counter
from collections.abc import Callable, Iterator
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


def _read_dataset(dataset: Any) -> tuple[str, dict]:
    """(its source for messages, the dataset object) of a SQuAD JSON object, its ``"data"`` list
    or a file path."""
    source = "<dataset>"
    if isinstance(dataset, (str, Path)):
        source, dataset = str(dataset), load_json(dataset)
    if isinstance(dataset, list):  # the "data" list alone
        dataset = {"data": dataset}
    if not isinstance(dataset, dict) or not isinstance(dataset.get("data"), list):
        raise SquadError(f"{source}: expected a SQuAD dataset with a 'data' list")
    return source, dataset


def _questions(dataset: dict, source: str) -> Iterator[tuple[str, str, dict]]:
    """(field path, id, question object) of every question of a dataset, in file order."""
    for a, article in enumerate(dataset["data"]):
        paragraphs = get_field(article, "paragraphs", list, source, f"data[{a}]")
        for p, paragraph in enumerate(paragraphs):
            qas = get_field(paragraph, "qas", list, source, f"data[{a}].paragraphs[{p}]")
            for q, qa in enumerate(qas):
                path = f"data[{a}].paragraphs[{p}].qas[{q}]"
                yield path, get_field(qa, "id", str, source, path), qa


def evaluate(dataset: Any, predictions: dict[str, str], predictions_source: str = "predictions"
             ) -> dict[str, float]:
    """``{"exact_match": …, "f1": …}`` of ``predictions`` (question id → text) on ``dataset``.

    ``dataset`` is a SQuAD JSON object (``{"data": [...]}``), its ``"data"``
    list, or the path of a SQuAD JSON file. A malformed dataset or predictions
    object is a :class:`SquadError` naming the file (``predictions_source`` for
    the predictions), the field's path and the question id.
    """
    source, dataset = _read_dataset(dataset)
    check_predictions(predictions, predictions_source)

    exact_match = f1 = 0.0
    total = unanswered = 0
    for path, qas_id, qa in _questions(dataset, source):
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


# ------------------------------------------------------------------ SQuAD v2.0


def _v2_tokens(text: str) -> list[str]:
    return normalize_answer(text).split()


def exact_v2(gold: str, prediction: str) -> int:
    """``compute_exact`` of the official v2.0 script: normalized equality, 0 or 1."""
    return int(normalize_answer(gold) == normalize_answer(prediction))


def f1_v2(gold: str, prediction: str) -> float:
    """``compute_f1`` of the official v2.0 script.

    Unlike v1.1, an answer that normalizes to nothing (the no-answer ``""``)
    scores 1 against another such answer and 0 against any other.
    """
    gold_tokens, predicted = _v2_tokens(gold), _v2_tokens(prediction)
    if not gold_tokens or not predicted:
        return int(gold_tokens == predicted)
    shared = sum((Counter(gold_tokens) & Counter(predicted)).values())
    if shared == 0:
        return 0
    precision = 1.0 * shared / len(predicted)
    recall = 1.0 * shared / len(gold_tokens)
    return (2 * precision * recall) / (precision + recall)


def _check_na_probs(na_probs: Any, source: str) -> dict[str, float]:
    if not isinstance(na_probs, dict):
        raise SquadError(f"{source}: expected an object of question id → number, got {json_kind(na_probs)}")
    for qas_id, value in na_probs.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise SquadError(f"{source}: question {qas_id}: expected a finite number, got "
                             f"{json_kind(value) if not isinstance(value, float) else value}")
    return na_probs


def _best_threshold(predictions: dict[str, str], scores: dict[str, float], na_probs: dict[str, float],
                    has_answer: dict[str, bool]) -> tuple[float, float]:
    """``find_best_thresh`` of the official script, step for step.

    Start from "every question gets no answer" (the no-answer questions are
    right); walk the questions by rising null odds (a stable sort of
    ``na_probs`` in its own order), letting each answer: a question with an
    answer adds its raw score, a no-answer one loses its point if the
    prediction is not empty. The best running total and the odds where it was
    reached are kept (the first of equal totals; within a run of equal odds
    that can be a total no single threshold gives, as in the official script).
    """
    score: float = sum(1 for qas_id in has_answer if not has_answer[qas_id])
    best = score
    threshold = 0.0
    for qas_id in sorted(na_probs, key=lambda k: na_probs[k]):
        if qas_id not in scores:
            continue
        if has_answer[qas_id]:
            score += scores[qas_id]
        elif predictions[qas_id]:
            score -= 1
        if score > best:
            best, threshold = score, na_probs[qas_id]
    return 100.0 * best / len(scores), threshold


def _eval_dict(exact: dict[str, float], f1: dict[str, float], ids: list[str] | None = None
               ) -> dict[str, float]:
    ids = list(exact) if ids is None else ids
    return {"exact": 100.0 * sum(exact[k] for k in ids) / len(ids),
            "f1": 100.0 * sum(f1[k] for k in ids) / len(ids), "total": len(ids)}


def evaluate_v2(dataset: Any, predictions: dict[str, str], na_probs: dict[str, float] | None = None,
                na_prob_thresh: float = 1.0, predictions_source: str = "predictions",
                na_probs_source: str = "null odds") -> dict[str, float]:
    """The official SQuAD v2.0 scores (``evaluate-v2.0.py``) of ``predictions``.

    A question's gold answers are its ``answers`` texts that do not normalize
    to nothing, or ``[""]`` when none is left (an unanswerable question:
    only the empty prediction is right). ``exact`` and ``f1`` (×100) are the
    best over the gold answers with :func:`exact_v2` and :func:`f1_v2`,
    averaged over the ``total`` questions; ``HasAns_*`` over those whose
    ``answers`` list is not empty, ``NoAns_*`` over the rest (each group only
    when it has questions). ``na_probs`` (``--na-prob-file``: the
    ``null_odds.json`` of a v2 prediction) turns a prediction into no answer
    where its value is above ``na_prob_thresh``, and adds the best scores over
    all such thresholds: ``best_exact`` at ``best_exact_thresh`` and
    ``best_f1`` at ``best_f1_thresh`` (see :func:`_best_threshold`).

    The official script fails (a KeyError) when a question has no prediction
    or, given ``na_probs``, a predicted question has no null odds; here that is
    a :class:`SquadError` naming the first such question. Other problems are
    :class:`SquadError` as for :func:`evaluate`.
    """
    source, dataset = _read_dataset(dataset)
    check_predictions(predictions, predictions_source)
    if na_probs is not None:
        _check_na_probs(na_probs, na_probs_source)
    if not math.isfinite(na_prob_thresh):
        raise SquadError(f"the no-answer threshold must be a finite number, got {na_prob_thresh}")

    # Dicts keyed by question id, filled in file order: the official script's
    # sums run in that order (a repeated id keeps its first place, its last values).
    has_answer: dict[str, bool] = {}
    exact_raw: dict[str, float] = {}
    f1_raw: dict[str, float] = {}
    for path, qas_id, qa in _questions(dataset, source):
        texts = answer_texts(qa, source, path, qas_id)
        has_answer[qas_id] = bool(texts)
        if qas_id not in predictions:
            raise SquadError(f"{location(source, path, qas_id)}: no prediction in {predictions_source} "
                             "(SQuAD v2.0 scores every question)")
        gold = [text for text in texts if normalize_answer(text)] or [""]
        exact_raw[qas_id] = max(exact_v2(g, predictions[qas_id]) for g in gold)
        f1_raw[qas_id] = max(f1_v2(g, predictions[qas_id]) for g in gold)
    if not exact_raw:
        raise SquadError(f"{source}: the dataset has no questions")

    odds = na_probs if na_probs is not None else {k: 0.0 for k in predictions}
    missing = next((k for k in exact_raw if k not in odds), None)
    if missing is not None:
        raise SquadError(f"{na_probs_source}: no value for question {missing}")
    # apply_no_ans_threshold: odds above the threshold make the prediction "no answer".
    exact = {k: float(not has_answer[k]) if odds[k] > na_prob_thresh else s for k, s in exact_raw.items()}
    f1 = {k: float(not has_answer[k]) if odds[k] > na_prob_thresh else s for k, s in f1_raw.items()}
    result = _eval_dict(exact, f1)
    for prefix, ids in (("HasAns", [k for k, v in has_answer.items() if v]),
                        ("NoAns", [k for k, v in has_answer.items() if not v])):
        if ids:
            result.update({f"{prefix}_{k}": v for k, v in _eval_dict(exact, f1, ids).items()})
    if na_probs is not None:  # the official script searches thresholds only with --na-prob-file
        result["best_exact"], result["best_exact_thresh"] = _best_threshold(predictions, exact_raw, odds,
                                                                            has_answer)
        result["best_f1"], result["best_f1_thresh"] = _best_threshold(predictions, f1_raw, odds, has_answer)
    return result


def format_scores(scores: dict[str, float]) -> str:
    """The scores on one console line: v1.1 ``exact_match … f1 …``, v2.0 ``exact … f1 …``
    with the HasAns / NoAns F1 and, when searched, the best F1 and its threshold."""
    if "exact_match" in scores:
        return f"exact_match {scores['exact_match']:.2f} f1 {scores['f1']:.2f}"
    line = f"exact {scores['exact']:.2f} f1 {scores['f1']:.2f}"
    for key in ("HasAns_f1", "NoAns_f1"):
        if key in scores:
            line += f" {key} {scores[key]:.2f}"
    if "best_f1" in scores:
        line += f" best_f1 {scores['best_f1']:.2f} (null threshold {scores['best_f1_thresh']:.3f})"
    return line
