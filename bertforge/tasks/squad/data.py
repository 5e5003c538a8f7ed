"""SQuAD v1.1 and v2.0 questions → examples → fixed-length BERT features.

This reproduces google-research/bert's ``run_squad.py`` (``read_squad_examples``
and ``convert_examples_to_features``) exactly — the same windows, ids, masks,
max-context flags and answer positions — but tokenizes with the fast
``tokenizers`` WordPiece of :func:`bertforge.data.tokenizer.load_tokenizer`,
in batches, instead of word by word in Python.

Examples
    A context is split into words on the reference's whitespace (space, tab,
    CR, LF, U+202F). For training each question must have exactly one answer;
    its character offset becomes a start and end word.

Features
    ``[CLS] question [SEP] window of the context [SEP]``, zero-padded to
    ``max_seq_length``. The question keeps its first ``max_query_length``
    WordPieces (longer ones are truncated, as the reference does, and counted).
    A context longer than what is left is covered by overlapping windows that
    advance by ``doc_stride`` tokens; a token seen by several windows is scored
    only in the one where it has the most context on both sides.

Tokenization
    Non-ASCII text is first cleaned and (for an uncased vocab) lowercased in
    Python, as the reference does: the fast tokenizer lowercases character by
    character (a word-final capital sigma) and drops private-use characters.
    What still differs is about 750 rare code points whose Unicode properties
    differ between Python's ``unicodedata`` (which the reference uses) and the
    ``tokenizers`` crate; none occurs in the SQuAD v1.1 files.

A tokenizer.json (:class:`~bertforge.data.fast_tokenizer.FastTokenizer`)
    Features are transformers' ``run_qa``'s instead (:func:`pipeline_features`):
    the question whole, the context in windows that overlap by ``doc_stride``
    tokens, answer positions from the answers' characters, and each context
    token's character offsets, through which post-processing cuts answers out
    of the context.

SQuAD v2.0 (``version_2_with_negative``, run_squad's flag of that name)
    For training every question needs a boolean ``is_impossible``; an
    impossible one becomes an example with answer ``""`` at word -1 (the
    reference's values) whose windows all point at [CLS] (start = end = 0);
    its ``answers`` must be an empty list (the reference does not read them,
    the official v2.0 scorer does: a question with both is refused). A possible
    question is read as in v1.1. Without the flag ``is_impossible`` is not
    read, as in the reference: a SQuAD 2.0 training file then fails on its
    first unanswerable question (it has no answer), with a hint to pass the
    flag. Not for training, ``is_impossible`` is only checked (a boolean when
    present, and no answers when true); the reference does not read it there either.

Bad input
    Missing or mistyped fields, an empty context, duplicate question ids, a
    training question without exactly one answer, an empty answer or an
    ``answer_start`` outside its context raise :class:`SquadError` naming the
    file, the field's path and the question id
    (``dev.json: data[3].paragraphs[0].qas[2].answers (question ID): expected a list, got a string``).
    A training answer whose text is not found in the words at its ``answer_start``
    is skipped, as the reference skips it; the skips are returned with their
    reason, so callers can count and report them.
"""

from __future__ import annotations

import bisect
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
from tokenizers import Tokenizer

from bertforge.data.fast_tokenizer import FastTokenizer
from bertforge.data.tokenizer import reference_clean

MAX_SEQ_LENGTH = 384
DOC_STRIDE = 128
MAX_QUERY_LENGTH = 64

# The reference's whitespace for splitting a context into words (not Unicode's).
_WORD = re.compile(r"[^ \t\r\n\u202f]+")


class SquadError(ValueError):
    """A user-facing problem with SQuAD input; the message names the file, question or field."""


@dataclass
class SquadExample:
    """One question about one context.

    ``doc_tokens`` are the context's whitespace-separated words; examples of
    the same paragraph share one list. ``answer_text``, ``start_word`` and
    ``end_word`` are set for training only; a SQuAD v2.0 training question
    with ``is_impossible`` has ``""``, -1, -1, as in the reference.
    """

    qas_id: str
    question: str
    doc_tokens: list[str]
    answer_text: str | None = None
    start_word: int | None = None
    end_word: int | None = None
    is_impossible: bool = False
    context: str = ""                 # the paragraph's text, as in the file
    answer_start: int | None = None   # the answer's first character in it (training)


@dataclass(frozen=True)
class SkippedAnswer:
    """A training question left out because its answer is not in the context where it says."""

    qas_id: str
    reason: str


@dataclass
class SquadFeatures:
    """All windows of all examples as numpy arrays, row ``i`` = feature ``i``.

    Rows of one example are consecutive, in window order. The (N, T) arrays are
    int32; ``torch.from_numpy`` shares them without copying, and the model
    takes int32 ids, masks and segments (positions need ``.long()`` for a loss).
    """

    input_ids: np.ndarray             # (N, T) int32, padded with 0 as the reference does
    input_mask: np.ndarray            # (N, T) int32: 1 real token, 0 padding
    segment_ids: np.ndarray           # (N, T) int32: 0 question, 1 context window
    token_to_orig: np.ndarray         # (N, T) int32: word index in doc_tokens, -1 off the context
    token_is_max_context: np.ndarray  # (N, T) bool: this window scores the token
    example_index: np.ndarray         # (N,) int64: index into the examples list
    doc_span_index: np.ndarray        # (N,) int32: window number within its example
    start_positions: np.ndarray | None  # (N,) int64, training only; 0 when the answer is outside
    end_positions: np.ndarray | None    # (N,) int64, training only
    vocab: list[str]                  # id → WordPiece, to show or post-process a window
    truncated_questions: int = 0      # questions longer than max_query_length WordPieces
    offsets: np.ndarray | None = None  # (N, T, 2) int32, a tokenizer.json's: each context token's characters
    #                                    [start, end) in its example's context, -1 off the context

    def __len__(self) -> int:
        return len(self.input_ids)

    def __repr__(self) -> str:  # not the arrays and the vocab
        training = self.start_positions is not None
        return (f"SquadFeatures({len(self)} × {self.input_ids.shape[1]}, "
                f"examples={len(np.unique(self.example_index))}, training={training}, "
                f"truncated_questions={self.truncated_questions})")

    def tokens(self, index: int) -> list[str]:
        """The WordPieces of feature ``index`` without the padding (the reference's ``tokens``)."""
        length = int(self.input_mask[index].sum())
        return [self.vocab[i] for i in self.input_ids[index, :length]]


# ------------------------------------------------------------------ reading


def split_context(context: str) -> tuple[list[str], list[int]]:
    """The context's words and the character offset where each starts."""
    matches = list(_WORD.finditer(context))
    return [m.group() for m in matches], [m.start() for m in matches]


_KINDS: dict[type, str] = {dict: "an object", list: "a list", str: "a string", int: "an integer",
                           float: "a number", bool: "a boolean"}


def json_kind(value: Any) -> str:
    """What a parsed JSON value is, in JSON's words (for messages)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return next((name for kind, name in _KINDS.items() if isinstance(value, kind)), type(value).__name__)


def location(source: str, path: str = "", qas_id: str | None = None) -> str:
    """``dev.json: data[3].paragraphs[0].qas[2] (question ID)``: where a problem is."""
    where = f"{source}: {path}" if path else source
    return f"{where} (question {qas_id})" if qas_id is not None else where


def get_field(obj: Any, key: str, kind: type, source: str, path: str = "",
              qas_id: str | None = None) -> Any:
    """``obj[key]``, checked to be an object with that field of that JSON type.

    Errors name the file, the field's path and (when known) the question id:
    ``dev.json: data[3].paragraphs[0].qas[2].answers (question ID): expected a list, got a string``.
    """
    if not isinstance(obj, dict):
        raise SquadError(f"{location(source, path, qas_id)}: expected an object, got {json_kind(obj)}")
    if key not in obj:
        raise SquadError(f"{location(source, path, qas_id)}: missing field '{key}'")
    value = obj[key]
    # bool is an int in Python; an answer_start of true is still a mistake.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        child = f"{path}.{key}" if path else key
        raise SquadError(f"{location(source, child, qas_id)}: expected {_KINDS[kind]}, got {json_kind(value)}")
    return value


def answer_texts(qa: dict, source: str, path: str, qas_id: str, need_offsets: bool = False) -> list[str]:
    """The texts of a question's ``answers`` (each checked: an object with a string ``text``,
    and an integer ``answer_start`` when ``need_offsets``)."""
    answers = get_field(qa, "answers", list, source, path, qas_id)
    texts = []
    for i, answer in enumerate(answers):
        texts.append(get_field(answer, "text", str, source, f"{path}.answers[{i}]", qas_id))
        if need_offsets:
            get_field(answer, "answer_start", int, source, f"{path}.answers[{i}]", qas_id)
    return texts


def _training_answer(qa: dict, context: str, words: list[str], starts: list[int],
                     source: str, path: str, qas_id: str) -> tuple[str, int, int] | str:
    """(text, start word, end word) of a training question, or why it is skipped."""
    texts = answer_texts(qa, source, path, qas_id, need_offsets=True)
    where = location(source, path, qas_id)
    if len(texts) != 1:
        # run_squad without version_2_with_negative refuses these too; say why when it is one.
        hint = (" (it is marked is_impossible: SQuAD v2.0 training needs --version 2)"
                if qa.get("is_impossible") is True else "")
        raise SquadError(f"{where}: a training question needs exactly 1 answer, has {len(texts)}{hint}")
    text = texts[0]
    offset = qa["answers"][0]["answer_start"]  # checked by answer_texts
    if not text.strip():
        raise SquadError(f"{where}: the answer text is empty")
    if offset < 0 or offset + len(text) > len(context):
        raise SquadError(f"{where}: answer_start {offset} + {len(text)} characters of answer "
                         f"is outside the context ({len(context)} characters)")
    # The words holding the answer's first and last characters; a character in
    # the whitespace after a word belongs to that word, as in the reference.
    start_word = bisect.bisect_right(starts, offset) - 1
    end_word = bisect.bisect_right(starts, offset + len(text) - 1) - 1
    if start_word < 0:
        return f"answer_start {offset} is in the whitespace before the first word"
    # The reference keeps an answer only if its text can be found in those
    # words (annotations that split a word still match; bad offsets do not).
    found = " ".join(words[start_word:end_word + 1])
    wanted = " ".join(text.split())
    if wanted not in found:
        return f"answer {wanted!r} not found at answer_start {offset} (words there: {found!r})"
    return text, start_word, end_word


def parse_examples(dataset: Any, is_training: bool = False, source: str = "<squad>",
                   version_2_with_negative: bool = False) -> tuple[list[SquadExample], list[SkippedAnswer]]:
    """Examples from a parsed SQuAD v1.1 (or, with ``version_2_with_negative``, v2.0)
    JSON object (``{"data": [...]}``).

    Returns the examples in file order and the training answers that were
    skipped (always empty when not training). Answers that are present are
    checked when not training too (each an object with a string ``text``), so
    that a dev set to be scored after training is refused before it starts.
    """
    articles = get_field(dataset, "data", list, source)
    examples: list[SquadExample] = []
    skipped: list[SkippedAnswer] = []
    seen: set[str] = set()
    for a, article in enumerate(articles):
        paragraphs = get_field(article, "paragraphs", list, source, f"data[{a}]")
        for p, paragraph in enumerate(paragraphs):
            path = f"data[{a}].paragraphs[{p}]"
            context = get_field(paragraph, "context", str, source, path)
            qas = get_field(paragraph, "qas", list, source, path)
            words, starts = split_context(context)
            if not words:
                raise SquadError(f"{location(source, path)}: the context is empty")
            for q, qa in enumerate(qas):
                path_q = f"{path}.qas[{q}]"
                qas_id = get_field(qa, "id", str, source, path_q)
                question = get_field(qa, "question", str, source, path_q, qas_id)
                if qas_id in seen:
                    raise SquadError(f"{location(source, path_q, qas_id)}: the question id is used twice")
                seen.add(qas_id)
                example = SquadExample(qas_id, question, words, context=context)
                if version_2_with_negative and (is_training or "is_impossible" in qa):
                    # Training needs it (run_squad reads qa["is_impossible"]); elsewhere only checked.
                    impossible = get_field(qa, "is_impossible", bool, source, path_q, qas_id)
                    if impossible and (is_training or "answers" in qa):
                        # Training would ignore the answers and scoring would count them: refuse both.
                        count = len(get_field(qa, "answers", list, source, path_q, qas_id))
                        if count:
                            raise SquadError(f"{location(source, path_q, qas_id)}: is_impossible is true but it has "
                                             f"{count} answer{'s' if count > 1 else ''}; an unanswerable question "
                                             f"has none (SQuAD v2.0 keeps guesses in plausible_answers)")
                    if is_training and impossible:
                        example.answer_text, example.start_word, example.end_word = "", -1, -1
                        example.is_impossible = True
                        examples.append(example)
                        continue
                if is_training:
                    answer = _training_answer(qa, context, words, starts, source, path_q, qas_id)
                    if isinstance(answer, str):
                        skipped.append(SkippedAnswer(qas_id, answer))
                        continue
                    example.answer_text, example.start_word, example.end_word = answer
                    example.answer_start = qa["answers"][0]["answer_start"]
                elif "answers" in qa:
                    answer_texts(qa, source, path_q, qas_id)
                examples.append(example)
    return examples, skipped


def load_json(path: str | Path) -> Any:
    """A JSON file, with file-naming errors for a missing or malformed file."""
    path = Path(path)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise SquadError(f"file not found: {path}") from None
    except UnicodeDecodeError as err:
        raise SquadError(f"{path}: not valid UTF-8 at byte offset {err.start}") from None
    except json.JSONDecodeError as err:
        raise SquadError(f"{path}: not valid JSON: {err}") from None
    except IsADirectoryError:
        raise SquadError(f"{path}: is a directory, not a JSON file") from None
    except RecursionError:
        raise SquadError(f"{path}: not valid JSON: nested too deeply") from None
    except ValueError as err:  # e.g. an integer of more than 4300 digits
        raise SquadError(f"{path}: not valid JSON: {err}") from None
    except OSError as err:  # unreadable: permissions, an I/O error
        raise SquadError(f"{path}: cannot be read ({err.strerror or err})") from None


def read_examples(path: str | Path, is_training: bool = False, version_2_with_negative: bool = False
                  ) -> tuple[list[SquadExample], list[SkippedAnswer]]:
    """Examples from a SQuAD v1.1 (or v2.0) JSON file; see :func:`parse_examples`."""
    return parse_examples(load_json(path), is_training, source=str(path),
                          version_2_with_negative=version_2_with_negative)


def example_from_text(question: str, context: str, qas_id: str = "q0") -> SquadExample:
    """An example for a question about free text (no answer)."""
    words, _ = split_context(context)
    if not words:
        raise SquadError("the context is empty")
    return SquadExample(qas_id, question, words, context=context)


# ------------------------------------------------------------------ features


def _lowercases(tokenizer: Tokenizer) -> bool:
    return bool(getattr(tokenizer.normalizer, "lowercase", False))


def _token_id(tokenizer: Tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise SquadError(f"the vocab has no {token} token")
    return token_id


def _id_to_token(tokenizer: Tokenizer) -> list[str]:
    vocab = tokenizer.get_vocab()
    tokens = [""] * (max(vocab.values()) + 1)
    for token, i in vocab.items():
        tokens[i] = token
    return tokens


def _doc_spans(num_tokens: int, max_tokens: int, stride: int) -> list[tuple[int, int]]:
    """(start, length) windows over the context's WordPieces, the reference's way."""
    spans = []
    start = 0
    while start < num_tokens:
        length = min(num_tokens - start, max_tokens)
        spans.append((start, length))
        if start + length == num_tokens:
            break
        start += min(length, stride)
    return spans


def _max_context_span(spans: list[tuple[int, int]], num_tokens: int) -> np.ndarray:
    """For each context token, the window that scores it: the one where the smaller of
    its left and right context is largest (+0.01 per window token; first wins ties)."""
    starts = np.array([s for s, _ in spans])[:, None]
    lengths = np.array([n for _, n in spans])[:, None]
    position = np.arange(num_tokens)[None, :]
    left = position - starts
    right = starts + lengths - 1 - position
    # Same float64 arithmetic as the reference, so ties break identically.
    score = np.minimum(left, right) + 0.01 * lengths
    score = np.where((left >= 0) & (right >= 0), score, -np.inf)
    return score.argmax(axis=0)


def _improve_span(doc_ids: list[int], start: int, end: int,
                  answer_ids: list[int]) -> tuple[int, int]:
    """The first sub-span of [start, end] whose WordPieces are exactly the answer's.

    The reference compares space-joined WordPieces; a WordPiece holds no space,
    so that is list equality, possible only at the answer's length.
    """
    length = len(answer_ids)
    if length:
        for new_start in range(start, end - length + 2):
            if doc_ids[new_start:new_start + length] == answer_ids:
                return new_start, new_start + length - 1
    return start, end


@dataclass
class _Plan:
    """One example's tokenization and windows, before the arrays are allocated."""

    query: list[int]
    doc_ids: np.ndarray
    tok_to_orig: np.ndarray
    spans: list[tuple[int, int]]
    answer: tuple[int, int] | None  # WordPiece start/end of the answer (training)


def convert_examples_to_features(examples: Sequence[SquadExample], tokenizer: Tokenizer | FastTokenizer,
                                 max_seq_length: int = MAX_SEQ_LENGTH, doc_stride: int = DOC_STRIDE,
                                 max_query_length: int = MAX_QUERY_LENGTH,
                                 is_training: bool = False) -> SquadFeatures:
    """The reference's features for ``examples``, as numpy arrays.

    ``tokenizer`` is :func:`bertforge.data.fast_tokenizer.task_tokenizer`'s; whether
    it lowercases is read from it. With ``is_training`` the examples need
    answers (from ``read_examples(..., is_training=True)``) and start/end
    positions are filled in (0, 0 for a window that does not hold the answer,
    and for every window of a SQuAD v2.0 ``is_impossible`` example: both as
    in the reference, in v1.1 and v2.0 alike). A ``tokenizer.json``'s
    :class:`FastTokenizer` makes ``run_qa``'s features instead (:func:`pipeline_features`).
    """
    if isinstance(tokenizer, FastTokenizer):
        return pipeline_features(examples, tokenizer, max_seq_length, doc_stride, is_training)
    if max_query_length < 0 or doc_stride < 1:
        raise SquadError(f"max_query_length={max_query_length} and doc_stride={doc_stride} "
                         "must be at least 0 and 1")
    if max_seq_length < max_query_length + 4:
        raise SquadError(f"max_seq_length={max_seq_length} leaves no room for the context after "
                         f"max_query_length={max_query_length} and [CLS] [SEP] [SEP]")
    cls_id, sep_id = _token_id(tokenizer, "[CLS]"), _token_id(tokenizer, "[SEP]")
    lowercase = _lowercases(tokenizer)
    doc_keys, docs = _encode_contexts(examples, tokenizer, lowercase)
    questions, answers = _encode_questions(examples, tokenizer, lowercase, is_training)
    plans: list[_Plan] = []
    truncated = 0
    for index, example in enumerate(examples):
        query = questions[index]
        if len(query) > max_query_length:
            query = query[:max_query_length]
            truncated += 1
        plans.append(_plan(example, docs[doc_keys[id(example.doc_tokens)]], query,
                           answers[index] if is_training else None, max_seq_length, doc_stride))
    arrays = _feature_arrays(sum(len(plan.spans) for plan in plans), max_seq_length, is_training)
    _fill_features(arrays, plans, cls_id, sep_id)
    return SquadFeatures(**arrays, vocab=_id_to_token(tokenizer), truncated_questions=truncated)


def _encode_contexts(examples: Sequence[SquadExample], tokenizer: Tokenizer, lowercase: bool
                     ) -> tuple[dict[int, int], list[tuple[np.ndarray, np.ndarray, np.ndarray]]]:
    """({id of an example's doc_tokens: its context's index}, (WordPiece ids, tok_to_orig,
    orig_to_tok) of each distinct context).

    Each distinct context is tokenized once, as one string (its words joined by
    spaces, which split WordPieces just as tokenizing word by word does); each
    WordPiece's character offset tells which word it came from.
    """
    doc_keys: dict[int, int] = {}
    contexts: list[list[str]] = []
    for example in examples:
        if id(example.doc_tokens) not in doc_keys:
            doc_keys[id(example.doc_tokens)] = len(contexts)
            contexts.append([reference_clean(word, lowercase) for word in example.doc_tokens])
    doc_encodings = tokenizer.encode_batch([" ".join(words) for words in contexts],
                                           add_special_tokens=False)
    docs = []
    for encoding, words in zip(doc_encodings, contexts, strict=True):
        word_starts = np.cumsum([0] + [len(word) + 1 for word in words[:-1]])
        token_starts = np.array([start for start, _ in encoding.offsets], dtype=np.int64)
        tok_to_orig = np.searchsorted(word_starts, token_starts, side="right") - 1
        # orig_to_tok[w] = index of word w's first WordPiece (of the next word's,
        # when w has none, as in the reference); one extra entry for the end.
        counts = np.bincount(tok_to_orig, minlength=len(words))
        orig_to_tok = np.concatenate([[0], np.cumsum(counts)])
        docs.append((np.array(encoding.ids, dtype=np.int32), tok_to_orig, orig_to_tok))
    return doc_keys, docs


def _encode_questions(examples: Sequence[SquadExample], tokenizer: Tokenizer, lowercase: bool,
                      is_training: bool) -> tuple[list[list[int]], list[list[int]]]:
    """(question WordPieces, answer WordPieces: training only) of every example, each tokenized as
    a whole string, as in the reference."""
    def encode(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in tokenizer.encode_batch_fast(texts, add_special_tokens=False)]

    questions = encode([reference_clean(x.question, lowercase) for x in examples])
    if not is_training:
        return questions, []
    missing = [x.qas_id for x in examples if x.answer_text is None or x.start_word is None
               or x.end_word is None]
    if missing:
        raise SquadError(f"question {missing[0]}: training needs an answer "
                         "(read the file with is_training=True)")
    # (none is missing: checked above; an impossible example's "" encodes to nothing and is not used)
    return questions, encode([reference_clean(cast(str, x.answer_text), lowercase) for x in examples])


def _plan(example: SquadExample, doc: tuple[np.ndarray, np.ndarray, np.ndarray], query: list[int],
          answer_ids: list[int] | None, max_seq_length: int, doc_stride: int) -> _Plan:
    """One example's windows over its context and, training (``answer_ids``), its answer's WordPieces."""
    doc_ids, tok_to_orig, orig_to_tok = doc
    answer = None
    if answer_ids is not None and not example.is_impossible:  # an impossible one points at [CLS] everywhere
        assert example.start_word is not None and example.end_word is not None  # checked by _encode_questions
        start = int(orig_to_tok[example.start_word])
        end = int(orig_to_tok[example.end_word + 1]) - 1
        answer = _improve_span(doc_ids.tolist(), start, end, answer_ids)
    spans = _doc_spans(len(doc_ids), max_seq_length - len(query) - 3, doc_stride)
    return _Plan(query, doc_ids, tok_to_orig, spans, answer)


def _feature_arrays(n: int, max_seq_length: int, is_training: bool) -> dict[str, Any]:
    """The zeroed arrays of ``n`` features, by SquadFeatures' field names (positions: training only)."""
    shape = (n, max_seq_length)
    return {"input_ids": np.zeros(shape, np.int32), "input_mask": np.zeros(shape, np.int32),
            "segment_ids": np.zeros(shape, np.int32), "token_to_orig": np.full(shape, -1, np.int32),
            "token_is_max_context": np.zeros(shape, bool), "example_index": np.zeros(n, np.int64),
            "doc_span_index": np.zeros(n, np.int32),
            "start_positions": np.zeros(n, np.int64) if is_training else None,
            "end_positions": np.zeros(n, np.int64) if is_training else None}


def _fill_features(arrays: dict[str, Any], plans: list[_Plan], cls_id: int, sep_id: int) -> None:
    """Write every window of every plan, in order, as one row: [CLS] question [SEP] window [SEP]."""
    input_ids, start_positions, end_positions = arrays["input_ids"], arrays["start_positions"], arrays["end_positions"]
    row = 0
    for index, plan in enumerate(plans):
        best_span = _max_context_span(plan.spans, len(plan.doc_ids)) if plan.spans else None
        offset = len(plan.query) + 2  # where the window starts: after [CLS] question [SEP]
        for k, (start, length) in enumerate(plan.spans):
            assert best_span is not None  # plan.spans is not empty
            window = slice(offset, offset + length)
            input_ids[row, 0] = cls_id
            input_ids[row, 1:offset - 1] = plan.query
            input_ids[row, offset - 1] = sep_id
            input_ids[row, window] = plan.doc_ids[start:start + length]
            input_ids[row, offset + length] = sep_id
            arrays["input_mask"][row, :offset + length + 1] = 1
            arrays["segment_ids"][row, offset:offset + length + 1] = 1
            arrays["token_to_orig"][row, window] = plan.tok_to_orig[start:start + length]
            arrays["token_is_max_context"][row, window] = best_span[start:start + length] == k
            arrays["example_index"][row] = index
            arrays["doc_span_index"][row] = k
            if plan.answer is not None and start <= plan.answer[0] and plan.answer[1] < start + length:
                assert start_positions is not None and end_positions is not None  # an answer means training
                start_positions[row] = plan.answer[0] - start + offset
                end_positions[row] = plan.answer[1] - start + offset
            row += 1


# ------------------------------------------------------------------ a tokenizer.json's features


def pipeline_features(examples: Sequence[SquadExample], tokenizer: FastTokenizer, max_seq_length: int = MAX_SEQ_LENGTH,
                      doc_stride: int = DOC_STRIDE, is_training: bool = False) -> SquadFeatures:
    """transformers' ``run_qa`` features (``prepare_train_features`` / ``prepare_validation_features``).

    ``tokenizer(question.lstrip(), context, truncation="only_second", max_length=max_seq_length,
    stride=doc_stride, return_overflowing_tokens=True, return_offsets_mapping=True)``: the file's
    special tokens around question and context, the context cut into windows that overlap by
    ``doc_stride`` tokens (run_squad's windows advance by it instead), the question whole. Training
    positions come from the answer's characters: the first and last context tokens that hold them,
    or the classifier token (where ``[CLS]`` is, else 0) when the window does not hold the whole
    answer, and for an unanswerable question. ``offsets`` keeps each context token's characters, from
    which post-processing cuts the answer out of the context; every context token is scored in
    every window that holds it (run_qa has no max-context rule).
    """
    if is_training:
        missing = [x.qas_id for x in examples if not x.is_impossible and (x.answer_start is None or not x.answer_text)]
        if missing:
            raise SquadError(f"question {missing[0]}: training needs an answer "
                             "(read the file with is_training=True)")
    encodings = tokenizer.encode([x.question.lstrip() for x in examples], [x.context for x in examples],
                                 max_length=max_seq_length, strategy="only_second", stride=doc_stride)
    windows = [(index, k, window) for index, encoding in enumerate(encodings)
               for k, window in enumerate([encoding, *encoding.overflowing])]
    arrays = _feature_arrays(len(windows), max_seq_length, is_training)
    arrays["input_ids"][:] = tokenizer.pad_id
    offsets = np.full((len(windows), max_seq_length, 2), -1, np.int32)
    for row, (index, k, window) in enumerate(windows):
        example = examples[index]
        length = len(window.ids)
        in_context = np.array([sequence == 1 for sequence in window.sequence_ids], bool)
        arrays["input_ids"][row, :length] = window.ids
        arrays["input_mask"][row, :length] = 1
        arrays["segment_ids"][row, :length] = window.type_ids
        offsets[row, :length][in_context] = np.array(window.offsets, np.int32).reshape(-1, 2)[in_context]
        word_starts = np.array(split_context(example.context)[1])
        words = np.maximum(np.searchsorted(word_starts, offsets[row, :length, 0], side="right") - 1, 0)
        arrays["token_to_orig"][row, :length] = np.where(in_context, words, -1)
        arrays["token_is_max_context"][row, :length] = in_context
        arrays["example_index"][row], arrays["doc_span_index"][row] = index, k
        if is_training:
            start, end = _answer_tokens(example, window.ids, offsets[row, :length], in_context, tokenizer.specials.cls)
            arrays["start_positions"][row], arrays["end_positions"][row] = start, end
    return SquadFeatures(**arrays, vocab=list(tokenizer.tokens), offsets=offsets)


def _answer_tokens(example: SquadExample, ids: list[int], offsets: np.ndarray, in_context: np.ndarray,
                   cls_id: int) -> tuple[int, int]:
    """run_qa's start and end positions of the answer in one window: the context tokens holding its
    first and last characters, or the classifier token's position where the window does not hold it."""
    cls_index = ids.index(cls_id) if cls_id in ids else 0
    if example.is_impossible or example.answer_start is None or example.answer_text is None:
        return cls_index, cls_index
    start_char = example.answer_start
    end_char = start_char + len(example.answer_text)
    context = np.flatnonzero(in_context)
    first, last = int(context[0]), int(context[-1])
    if not (offsets[first, 0] <= start_char and offsets[last, 1] >= end_char):
        return cls_index, cls_index
    start = first
    while start < len(ids) and in_context[start] and offsets[start, 0] <= start_char:
        start += 1
    end = last
    while offsets[end, 1] >= end_char:
        end -= 1
    return start - 1, end + 1
