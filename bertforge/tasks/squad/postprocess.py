"""Start/end logits → answer text, as google-research/bert's ``write_predictions`` does.

For each example, over all its windows: the ``n_best_size`` highest start and
end logits of each window make candidate spans; a span is kept if both ends
lie in the context, the window is the start token's max-context window, the
end is not before the start and it is at most ``max_answer_length``
WordPieces long. Candidates are ranked by start + end logit (ties keep the
window, start-rank, end-rank order, as the reference's stable sort does),
mapped back to the original text (:func:`get_final_text`), and the first
``n_best_size`` distinct texts form the n-best list with softmax
probabilities. The prediction is the n-best's first text; an example with no
valid span gets the reference's placeholder ``"empty"``.

With a tokenizer.json's features (their ``offsets``) a span's text is the
context's characters from its first token's start to its last token's end,
as transformers' ``utils_qa.postprocess_qa_predictions`` cuts it (the same
answers and null odds, tested); every context token may start a span.

SQuAD v2.0 (``version_2_with_negative``, as run_squad with that flag): the
null answer's score is the lowest ``start_logit[0] + end_logit[0]`` ([CLS])
over the example's windows (the first window among equals). It joins the
candidates as the span (0, 0) with text ``""``, ranked among them (after
spans of equal score), and is appended to the n-best when it did not make it
there. ``score_diff`` = null score − the start and end logits of the best
non-empty entry; the prediction is ``""`` when ``score_diff >
null_score_diff_threshold``, else that entry's text, and ``score_diff`` is
the question's entry in ``null_odds.json``. When no span is valid the
reference fails (its best non-null entry is None); here, as in transformers'
port (``compute_predictions_logits``), an ``"empty"`` entry with logits 0 is
put first, so that ``score_diff`` is the null score.
"""

from __future__ import annotations

import functools
import json
import math
import re
import string
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from tokenizers import normalizers, pre_tokenizers

from bertforge.fileio import atomic_file

from .data import SquadError, SquadExample, SquadFeatures, reference_clean

N_BEST_SIZE = 20
MAX_ANSWER_LENGTH = 30


# ASCII text needs no Unicode tables: drop control characters, tabs and newlines
# are spaces, and the reference's punctuation is exactly string.punctuation.
_ASCII_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_ASCII_CLEAN = {**{code: None for code in [*range(32), 127]}, 9: " ", 10: " ", 13: " "}
_PUNCTUATION = re.escape(string.punctuation)
_ASCII_TOKEN = re.compile(f"[^ {_PUNCTUATION}]+|[{_PUNCTUATION}]")


@functools.cache
def _basic_tokenizer(do_lower_case: bool) -> Callable[[str], list[str]]:
    """BERT's BasicTokenizer (clean, split on whitespace and punctuation, and for
    uncased lowercase and strip accents) without WordPiece: a regular expression
    for ASCII text (ten times quicker), ``tokenizers`` for the rest."""
    normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                            strip_accents=do_lower_case, lowercase=do_lower_case)
    pre_tokenizer = pre_tokenizers.BertPreTokenizer()

    def tokenize(text: str) -> list[str]:
        if text.isascii():
            if _ASCII_CONTROL.search(text):
                text = text.translate(_ASCII_CLEAN)
            return _ASCII_TOKEN.findall(text.lower() if do_lower_case else text)
        text = reference_clean(text, do_lower_case)  # Python's cleaning and lowercasing
        return [word for word, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(text))]

    return tokenize


def _nth_non_space(text: str, n: int) -> int:
    """Position in ``text`` of its ``n``-th (from 0) character that is not a space."""
    position = 0
    for piece in text.split(" "):
        if n < len(piece):
            return position + n
        n -= len(piece)
        position += len(piece) + 1
    raise IndexError(n)


def get_final_text(pred_text: str, orig_text: str, do_lower_case: bool = True) -> str:
    """The part of ``orig_text`` (original words) that the normalized ``pred_text`` covers.

    ``orig_text`` is tokenized as the model saw it; if that and ``orig_text``
    have the same number of non-space characters, they are taken to align
    character by character and ``pred_text``'s position maps back ("Steve
    Smith's" with prediction "steve smith" gives "Steve Smith"). When the
    prediction is not found or the lengths differ (a ligature, a dropped
    control character), the whole ``orig_text`` is returned, as the reference does.
    """
    tok_text = " ".join(_basic_tokenizer(do_lower_case)(orig_text))
    start = tok_text.find(pred_text)
    end = start + len(pred_text) - 1
    if (start == -1 or end < start  # not found, or an empty prediction
            or len(tok_text) - tok_text.count(" ") != len(orig_text) - orig_text.count(" ")
            or tok_text[start] == " " or tok_text[end] == " "):
        return orig_text
    # The n-th non-space character of tok_text is the n-th of orig_text.
    first = _nth_non_space(orig_text, start - tok_text.count(" ", 0, start))
    last = _nth_non_space(orig_text, end - tok_text.count(" ", 0, end))
    return orig_text[first:last + 1]


def _softmax(scores: list[float]) -> list[float]:
    # Python floats and math.exp, summed in order, as the reference computes them.
    top = max(scores)
    exps = [math.exp(score - top) for score in scores]
    total = sum(exps)
    return [x / total for x in exps]


def _check_logits(name: str, logits: Any, shape: tuple[int, ...]) -> np.ndarray:
    array = np.asarray(logits, dtype=np.float64)  # the reference adds them as Python floats
    if array.shape != shape:
        raise SquadError(f"{name} has shape {array.shape}; the features need {shape}")
    if not np.isfinite(array).all():
        row = int(np.nonzero(~np.isfinite(array).all(axis=1))[0][0])
        raise SquadError(f"{name} of feature {row} are not all finite")
    return array


class SquadPredictions(tuple[dict[str, str], dict[str, list[dict[str, Any]]]]):
    """``(predictions, nbest)``, which unpacks as v1.1 callers expect, plus ``null_odds``:
    ``{qas_id: score_diff}`` with SQuAD v2.0 (the reference's ``null_odds.json``), else None."""

    null_odds: dict[str, float] | None

    def __new__(cls, predictions: dict[str, str], nbest: dict[str, list[dict[str, Any]]],
                null_odds: dict[str, float] | None = None) -> SquadPredictions:
        self = super().__new__(cls, (predictions, nbest))
        self.null_odds = null_odds
        return self

    @property
    def predictions(self) -> dict[str, str]:
        return self[0]

    @property
    def nbest(self) -> dict[str, list[dict[str, Any]]]:
        return self[1]


# run_squad's starting point for the lowest null score: an int, as are the null
# logits of an example that no window beats it for.
_NO_NULL_SCORE = 1000000


def postprocess(examples: Sequence[SquadExample], features: SquadFeatures, start_logits: Any,
                end_logits: Any, n_best_size: int = N_BEST_SIZE,
                max_answer_length: int = MAX_ANSWER_LENGTH, do_lower_case: bool = True,
                version_2_with_negative: bool = False, null_score_diff_threshold: float = 0.0,
                ) -> SquadPredictions:
    """Predictions ``{qas_id: answer text}`` and n-best lists ``{qas_id: [entry, …]}``
    (and with ``version_2_with_negative`` the null odds; see the module docstring).

    ``start_logits`` and ``end_logits`` are (len(features), max_seq_length)
    arrays (numpy or anything ``np.asarray`` takes), row ``i`` for feature
    ``i``. Each n-best entry is ``{"text", "probability", "start_logit",
    "end_logit"}``, best first: the reference's ``nbest_predictions.json``.
    """
    if n_best_size < 1 or max_answer_length < 1:
        raise SquadError(f"n_best_size={n_best_size} and max_answer_length={max_answer_length} "
                         "must be at least 1")
    shape = features.input_ids.shape
    if len(features) and int(features.example_index[-1]) >= len(examples):
        raise SquadError(f"the features refer to example {int(features.example_index[-1])}; "
                         f"only {len(examples)} examples were given")
    logits = (_check_logits("start_logits", start_logits, shape), _check_logits("end_logits", end_logits, shape))
    spans = _top_spans(features, logits, n_best_size, max_answer_length)
    bounds = np.searchsorted(features.example_index, np.arange(len(examples) + 1))
    predictions: dict[str, str] = {}
    all_nbest: dict[str, list[dict[str, Any]]] = {}
    null_odds: dict[str, float] = {}
    for index, example in enumerate(examples):
        rows = range(int(bounds[index]), int(bounds[index + 1]))
        null = _null_answer(logits, rows) if version_2_with_negative else None
        candidates = _ranked_candidates(logits, spans, rows, null)
        nbest = _nbest(example, features, candidates, n_best_size, do_lower_case, null)
        probabilities = _softmax([s + e for _, s, e in nbest])
        all_nbest[example.qas_id] = [
            {"text": text, "probability": p, "start_logit": s, "end_logit": e}
            for (text, s, e), p in zip(nbest, probabilities, strict=True)]
        if null is not None:
            text, start_logit, end_logit = next(entry for entry in nbest if entry[0])
            # In the reference's order of operations, so that the floats are the same.
            score_diff = null.score - start_logit - end_logit
            null_odds[example.qas_id] = score_diff
            predictions[example.qas_id] = "" if score_diff > null_score_diff_threshold else text
        else:
            predictions[example.qas_id] = nbest[0][0]
    return SquadPredictions(predictions, all_nbest, null_odds if version_2_with_negative else None)


class _Spans(NamedTuple):
    """Each window's best start and end positions, (N, k) and its valid (start, end) pairs, (N, k, k)."""

    top_start: np.ndarray
    top_end: np.ndarray
    valid: np.ndarray


def _top_spans(features: SquadFeatures, logits: tuple[np.ndarray, np.ndarray], n_best_size: int,
               max_answer_length: int) -> _Spans:
    """Each window's ``n_best_size`` best starts and ends, highest logit first, lower position first
    among equals (the reference's stable sort), and which pairs of them make a valid span."""
    start_logits, end_logits = logits
    k = min(n_best_size, start_logits.shape[1])
    top_start = np.argsort(-start_logits, axis=1, kind="stable")[:, :k]
    top_end = np.argsort(-end_logits, axis=1, kind="stable")[:, :k]
    feature_rows = np.arange(len(features))[:, None]
    # A max-context token is always a context token; an end need only be in the context.
    start_ok = features.token_is_max_context[feature_rows, top_start]
    end_ok = features.token_to_orig[feature_rows, top_end] >= 0
    length = top_end[:, None, :] - top_start[:, :, None] + 1
    valid = (start_ok[:, :, None] & end_ok[:, None, :] & (length >= 1)
             & (length <= max_answer_length))                       # (N, k starts, k ends)
    return _Spans(top_start, top_end, valid)


class _Null(NamedTuple):
    """SQuAD v2.0's null answer of one example: the window with the lowest null score (-1: none
    below _NO_NULL_SCORE), that score and its [CLS] start and end logits."""

    row: int
    score: float
    start_logit: float
    end_logit: float


def _null_answer(logits: tuple[np.ndarray, np.ndarray], rows: range) -> _Null:
    start_logits, end_logits = logits
    if len(rows):
        null_scores = start_logits[rows.start:rows.stop, 0] + end_logits[rows.start:rows.stop, 0]
        lowest = int(np.argmin(null_scores))  # the first among equals, as the reference's strict <
        if null_scores[lowest] < _NO_NULL_SCORE:
            row = rows.start + lowest
            return _Null(row, float(null_scores[lowest]), float(start_logits[row, 0]), float(end_logits[row, 0]))
    return _Null(-1, _NO_NULL_SCORE, 0, 0)


def _ranked_candidates(logits: tuple[np.ndarray, np.ndarray], spans: _Spans, rows: range,
                       null: _Null | None) -> Iterator[tuple[int, int, int, float, float]]:
    """(row, start, end, start logit, end logit) of one example's valid spans (and its null span,
    given one), best score first."""
    start_logits, end_logits = logits
    # np.nonzero walks (window, start rank, end rank) in the reference's order;
    # a stable sort by score keeps that order among equal scores.
    window, start_rank, end_rank = np.nonzero(spans.valid[rows.start:rows.stop])
    feature_rows = rows.start + window
    starts = spans.top_start[feature_rows, start_rank]
    ends = spans.top_end[feature_rows, end_rank]
    start_scores = start_logits[feature_rows, starts]
    end_scores = end_logits[feature_rows, ends]
    if null is not None:  # the null span (0, 0) joins last, so it ranks after equal scores
        feature_rows = np.append(feature_rows, null.row)
        starts, ends = np.append(starts, 0), np.append(ends, 0)
        start_scores = np.append(start_scores, null.start_logit)
        end_scores = np.append(end_scores, null.end_logit)
    order = np.argsort(-(start_scores + end_scores), kind="stable")
    return zip(feature_rows[order].tolist(), starts[order].tolist(), ends[order].tolist(),
               start_scores[order].tolist(), end_scores[order].tolist(), strict=True)


def _nbest(example: SquadExample, features: SquadFeatures,
           candidates: Iterable[tuple[int, int, int, float, float]], n_best_size: int, do_lower_case: bool,
           null: _Null | None) -> list[tuple[str, float, float]]:
    """(text, start logit, end logit) of the first ``n_best_size`` distinct texts of ``candidates``,
    with SQuAD v2.0's null answer and the placeholders where no span is valid."""
    nbest: list[tuple[str, float, float]] = []
    seen: set[str] = set()
    for row, start, end, start_logit, end_logit in candidates:
        if len(nbest) >= n_best_size:
            break
        if start == 0:  # the null answer: only context tokens (never [CLS]) start a span
            assert null is not None  # only v2.0 has a (0, 0) candidate
            seen.add("")
            nbest.append(("", null.start_logit, null.end_logit))
            continue
        text = _span_text(example, features, row, start, end, do_lower_case)
        if text not in seen:
            seen.add(text)
            nbest.append((text, start_logit, end_logit))
    if null is not None:
        if "" not in seen:  # the null answer is always among the n-best
            nbest.append(("", null.start_logit, null.end_logit))
        if len(nbest) == 1:  # no valid span: where the reference fails, transformers' placeholder
            nbest.insert(0, ("empty", 0.0, 0.0))
    if not nbest:  # no valid span at all: the reference's placeholder
        nbest.append(("empty", 0.0, 0.0))
    return nbest


def _span_text(example: SquadExample, features: SquadFeatures, row: int, start: int, end: int,
               do_lower_case: bool) -> str:
    """The original text of WordPieces ``start..end`` of feature ``row``: with a tokenizer.json's
    offsets the context's characters from the first token's start to the last one's end."""
    if features.offsets is not None:
        return example.context[int(features.offsets[row, start, 0]):int(features.offsets[row, end, 1])]
    # WordPieces rejoined: "##" continuations glued back to their word.
    pieces = " ".join([features.vocab[i] for i in features.input_ids[row, start:end + 1].tolist()])
    tok_text = " ".join(pieces.replace(" ##", "").replace("##", "").split())
    first_word = features.token_to_orig[row, start]
    last_word = features.token_to_orig[row, end]
    orig_text = " ".join(example.doc_tokens[first_word:last_word + 1])
    return get_final_text(tok_text, orig_text, do_lower_case)


def write_predictions(predictions: dict[str, str], prediction_file: str | Path,
                      nbest: dict[str, list[dict[str, Any]]] | None = None,
                      nbest_file: str | Path | None = None, null_odds: dict[str, float] | None = None,
                      null_odds_file: str | Path | None = None) -> None:
    """Write ``predictions.json`` (and ``nbest_predictions.json``, and for SQuAD v2.0
    ``null_odds.json``) as the reference does.

    Each file appears whole or not at all.
    """
    for obj, path in ((predictions, prediction_file), (nbest, nbest_file), (null_odds, null_odds_file)):
        if obj is None or path is None:
            continue
        with atomic_file(Path(path)) as tmp:
            tmp.write_text(json.dumps(obj, indent=4) + "\n", encoding="utf-8")
