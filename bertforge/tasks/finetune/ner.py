"""Token classification (CoNLL-2003 NER): files → examples → BERT features, predictions back to
words, and entity-level scores equal to ``seqeval``'s (conlleval's).

Files (:func:`read_conll`)
    One token per line, columns separated by spaces or tabs (``word POS chunk tag``, or only
    ``word tag``): the word is the first column, the tag the last. Sentences are separated by
    blank lines; a ``-DOCSTART-`` line marks a document boundary and is not a sentence. Files are
    UTF-8 (a leading byte-order mark is ignored). A line with one column, a line whose number of
    columns differs from the file's first token line, or a tag that is not ``O``, ``B-X``,
    ``I-X``, ``E-X`` or ``S-X`` raises :class:`NerError` naming the file and line
    (``dev.txt:12: tag 'PER' is not O, B-X, I-X, E-X or S-X``). Read with ``labelled=False``
    (prediction) only the first column is kept, so a file of words alone is accepted.
    :func:`find_files` finds a data directory's train/dev/test files by their usual names.

Labels (:func:`label_list`)
    ``O`` first, then every other tag of the training file in sorted order. The list is saved
    with a fine-tuned model and reused: a tag it lacks in a file to score is an error naming the
    tag, the file and the line.

Features (:func:`convert_examples`)
    ``[CLS] WordPieces [SEP]``, zero-padded, segment 0. As Hugging Face's ``run_ner`` with
    ``label_all_tokens=False``, only a word's first WordPiece carries its label; every other
    position (later WordPieces, [CLS], [SEP], padding) has -100, which the loss ignores. Words
    are tokenized as ``BertTokenizerFast(..., is_split_into_words=True)`` does (the same ids
    and label positions, tested), after the reference's Python cleaning and lowercasing of
    non-ASCII text (as :func:`bertforge.data.tokenizer.encode_texts`).
    With a ``tokenizer.json`` (:class:`~bertforge.data.fast_tokenizer.FastTokenizer`) the
    words are its pipeline's, each with the space before it as in running text (a byte-level
    BPE's ``add_prefix_space``, as ``run_ner`` sets it for RoBERTa-like tokenizers), between its
    classifier and separator tokens, padded with its [PAD] id: ``run_ner``'s
    ``tokenize_and_align_labels`` for every sentence that fits (tested).

    Unlike ``run_ner``, which truncates a sentence and so loses its last words' labels and
    predictions, a sentence longer than ``seq_len - 2`` WordPieces is split at word boundaries
    into consecutive windows (filled greedily), so every word is labelled and predicted exactly
    once; :attr:`NerFeatures.split_sentences` counts them. A single word longer than a whole
    window keeps its first ``seq_len - 2`` WordPieces (counted in ``truncated_words``). A word
    that tokenizes to nothing (only control or zero-width characters, such as U+200B) becomes
    one ``[UNK]``, so that it is still predicted (counted in ``empty_words``); ``run_ner``
    would drop it.

Scores (:func:`entity_scores`)
    seqeval's default mode, which is conlleval's: an entity is a maximal chunk, started by
    ``B-``/``S-``, by ``I-``/``E-`` after ``O`` or an ended chunk, or by a change of type, so
    IOB1 (CoNLL-2003's original scheme), IOB2, IOBES and stray ``I-`` tags are all read.
    Precision, recall and F1 are micro-averaged over entities, 0 when undefined, per type too;
    accuracy is per token.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from bertforge.data.fast_tokenizer import FastTokenizer
from bertforge.data.tokenizer import CLS, SEP, UNK, reference_clean
from bertforge.fileio import atomic_file

from . import FinetuneError

IGNORE = -100  # the label of a position the loss and the scores skip (torch's ignore_index)
OUTSIDE = "O"
DOCSTART = "-DOCSTART-"
TAG = re.compile(r"(?:O|[BIES]-\S+)\Z")
_COLUMNS = re.compile(r"[ \t]+")
# Each split's usual file names: ours, Hugging Face's conll2003 (valid.txt) and the shared task's.
FILE_NAMES = {"train": ("train.txt", "eng.train"),
              "dev": ("dev.txt", "valid.txt", "eng.testa"),
              "test": ("test.txt", "eng.testb")}


class NerError(FinetuneError):
    """A user-facing problem with NER input; the message names the file and line."""


# ------------------------------------------------------------------ reading


@dataclass
class NerExamples:
    """The sentences of one CoNLL file: ``words[i]`` and (when labelled) ``tags[i]`` of sentence ``i``.

    ``lines[i]`` is the line of sentence ``i``'s first word (word ``j`` is on line
    ``lines[i] + j``), to name in messages. Unlabelled examples have ``tags == []``.
    """

    path: str
    words: list[list[str]]
    tags: list[list[str]]
    lines: list[int]
    labelled: bool = True

    def __len__(self) -> int:
        return len(self.words)

    def head(self, count: int) -> NerExamples:
        """The first ``count`` sentences."""
        return NerExamples(self.path, self.words[:count], self.tags[:count], self.lines[:count],
                           self.labelled)

    def where(self, sentence: int, word: int = 0) -> str:
        """``file:line`` of a word, for messages."""
        return f"{self.path}:{self.lines[sentence] + word}"


def _read_lines(path: Path) -> list[str]:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise NerError(f"file not found: {path}") from None
    except IsADirectoryError:
        raise NerError(f"{path}: is a directory, not a CoNLL file") from None
    except OSError as err:
        raise NerError(f"{path}: cannot be read ({err.strerror or err})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise NerError(f"{path}:{line}: not valid UTF-8 (byte offset {err.start})") from None
    # Split on "\n" only: str.splitlines would also break lines at U+2028, U+0085, … inside a word.
    return text.removeprefix("\ufeff").split("\n")


def read_conll(path: str | Path, labelled: bool = True) -> NerExamples:
    """The sentences of a CoNLL-2003-format file (see the module's docstring).

    With ``labelled=False`` (words to predict) only the first column is read.
    """
    path = Path(path)
    words: list[list[str]] = []
    tags: list[list[str]] = []
    lines: list[int] = []
    sentence: list[str] = []
    sentence_tags: list[str] = []
    columns = 0  # of the file's first token line; every token line must have as many
    first_line = 0

    def end_sentence() -> None:
        if sentence:
            words.append(sentence.copy())
            tags.append(sentence_tags.copy())
            lines.append(first_line)
            sentence.clear()
            sentence_tags.clear()

    for number, raw in enumerate(_read_lines(path), start=1):
        line = raw.rstrip("\r").strip(" \t")
        if not line:
            end_sentence()
            continue
        fields = _COLUMNS.split(line)
        if fields[0] == DOCSTART:  # a document boundary (its columns are not checked: not a token)
            end_sentence()
            continue
        if labelled and len(fields) < 2:
            raise NerError(f"{path}:{number}: expected a word and its tag, got one column "
                           f"{line!r} (read a file of words alone as unlabelled)")
        if columns == 0:
            columns = len(fields)
        elif len(fields) != columns:
            raise NerError(f"{path}:{number}: {len(fields)} columns where the file's first token line "
                           f"has {columns}")
        if labelled and not TAG.match(fields[-1]):
            raise NerError(f"{path}:{number}: tag {fields[-1]!r} is not O, B-X, I-X, E-X or S-X")
        if not sentence:
            first_line = number
        sentence.append(fields[0])
        if labelled:
            sentence_tags.append(fields[-1])
    end_sentence()
    if not words:
        raise NerError(f"{path}: no sentences")
    return NerExamples(str(path), words, tags if labelled else [], lines, labelled)


def is_labelled(path: str | Path) -> bool:
    """Whether a CoNLL file's first token line has a tag in its last column (of two or more).

    A file of ``word POS chunk`` without its NER column looks labelled (chunk tags are
    IOB tags): this cannot tell.
    """
    for raw in _read_lines(Path(path)):
        fields = _COLUMNS.split(raw.rstrip("\r").strip(" \t"))
        if fields[0] and fields[0] != DOCSTART:
            return len(fields) >= 2 and TAG.match(fields[-1]) is not None
    return False


def find_files(data_dir: str | Path) -> dict[str, Path]:
    """``{"train": …, "dev": …, "test": …}``: the splits present in a directory, by :data:`FILE_NAMES`."""
    directory = Path(data_dir)
    if not directory.is_dir():
        raise NerError(f"{directory}: not a directory of CoNLL files "
                       f"({', '.join(names[0] for names in FILE_NAMES.values())})")
    found: dict[str, Path] = {}
    for split, names in FILE_NAMES.items():
        present = [directory / name for name in names if (directory / name).is_file()]
        if len(present) > 1:  # which one was meant is a guess: refuse to make it
            raise NerError(f"{directory}: both {present[0].name} and {present[1].name} hold the {split} split")
        if present:
            found[split] = present[0]
    return found


def label_list(examples: NerExamples) -> list[str]:
    """The labels of a training set: ``O`` (always, a model must be able to say "no entity")
    first, then the other tags sorted."""
    if not examples.labelled:
        raise NerError(f"{examples.path}: the labels come from a labelled file")
    return [OUTSIDE] + sorted({tag for sentence in examples.tags for tag in sentence} - {OUTSIDE})


# ------------------------------------------------------------------ features


@dataclass
class NerFeatures:
    """All windows of all sentences as numpy arrays, row ``i`` = window ``i``.

    Rows of one sentence are consecutive, in order; every word of every sentence has its first
    WordPiece in exactly one row, where ``word_index`` names it.
    """

    input_ids: np.ndarray       # (N, T) int32: [CLS] WordPieces [SEP], padded with 0
    segment_ids: np.ndarray     # (N, T) int32: all 0 (one segment)
    input_mask: np.ndarray      # (N, T) int32: 1 real token, 0 padding
    labels: np.ndarray          # (N, T) int64: the word's label id at its first WordPiece, else -100
    word_index: np.ndarray      # (N, T) int32: the word (in its sentence) whose first WordPiece is there, else -1
    sentence_index: np.ndarray  # (N,) int64: index into the examples
    label_list: list[str] = field(default_factory=list)  # label id → tag
    split_sentences: int = 0    # sentences longer than one window (seq_len - 2 WordPieces)
    truncated_words: int = 0    # words longer than a window: only their first seq_len - 2 WordPieces kept
    empty_words: int = 0        # words that tokenize to nothing, given one [UNK]

    def __len__(self) -> int:
        return len(self.input_ids)

    def __repr__(self) -> str:  # not the arrays
        return (f"NerFeatures({len(self)} × {self.input_ids.shape[1]}, "
                f"sentences={len(np.unique(self.sentence_index))}, labels={len(self.label_list)}, "
                f"split_sentences={self.split_sentences}, truncated_words={self.truncated_words}, "
                f"empty_words={self.empty_words})")


def _token_id(tokenizer: Tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise NerError(f"the vocab has no {token} token")
    return token_id


def word_pieces(examples: NerExamples, tokenizer: Tokenizer | FastTokenizer) -> tuple[list[list[list[int]]], int]:
    """Each sentence's words' token ids, and how many words had none (given one [UNK]).

    As ``BertTokenizerFast(is_split_into_words=True)``: each word pre-tokenized on its own; a
    ``tokenizer.json``'s words each with the space before it (:attr:`FastTokenizer.words`).
    """
    if isinstance(tokenizer, FastTokenizer):
        unk = tokenizer.specials.unk
        encodings = tokenizer.encode_words([list(sentence) for sentence in examples.words])
    else:
        lowercase = bool(getattr(tokenizer.normalizer, "lowercase", False))
        unk = _token_id(tokenizer, UNK)
        cleaned = [[reference_clean(word, lowercase) for word in sentence] for sentence in examples.words]
        encodings = tokenizer.encode_batch(cleaned, is_pretokenized=True, add_special_tokens=False)
    result: list[list[list[int]]] = []
    empty = 0
    for s, (sentence, encoding) in enumerate(zip(examples.words, encodings, strict=True)):
        pieces: list[list[int]] = [[] for _ in sentence]
        for token_id, word in zip(encoding.ids, encoding.word_ids, strict=True):
            assert word is not None  # only special tokens have none, and none were added
            pieces[word].append(token_id)
        for w, ids in enumerate(pieces):
            if not ids:
                if unk is None:
                    raise NerError(f"{examples.where(s, w)}: the word has no tokens, and the tokenizer no unknown "
                                   "token to stand for it")
                ids.append(unk)
                empty += 1
        result.append(pieces)
    return result, empty


def _ends(tokenizer: Tokenizer | FastTokenizer) -> tuple[int, int, int]:
    """(classifier, separator, padding) ids: a tokenizer.json's roles, else BERT's tokens (padding 0)."""
    if isinstance(tokenizer, FastTokenizer):
        return tokenizer.specials.cls, tokenizer.specials.sep, tokenizer.pad_id
    return _token_id(tokenizer, CLS), _token_id(tokenizer, SEP), 0


def _windows(lengths: list[int], room: int) -> list[tuple[int, int]]:
    """(first word, end word) of consecutive windows of at most ``room`` WordPieces, filled greedily
    (``lengths`` already capped at ``room``)."""
    windows = []
    start, used = 0, 0
    for word, length in enumerate(lengths):
        if used + length > room:
            windows.append((start, word))
            start, used = word, 0
        used += length
    windows.append((start, len(lengths)))
    return windows


def convert_examples(examples: NerExamples, tokenizer: Tokenizer | FastTokenizer, seq_len: int,
                     label_list: Sequence[str]) -> NerFeatures:
    """The features of ``examples`` (see the module's docstring).

    ``tokenizer`` is :func:`bertforge.data.fast_tokenizer.task_tokenizer`'s; ``label_list`` the
    model's labels (:func:`label_list` of the training file). Unlabelled examples get -100
    everywhere. A tag not in ``label_list`` raises :class:`NerError` naming it, the file and line.
    """
    room = seq_len - 2
    if room < 1:
        raise NerError(f"seq_len={seq_len} leaves no room for a word between [CLS] and [SEP]")
    label_ids = {label: i for i, label in enumerate(label_list)}
    cls_id, sep_id, pad_id = _ends(tokenizer)
    pieces, empty = word_pieces(examples, tokenizer)

    plans: list[tuple[int, list[list[int]], list[tuple[int, int]]]] = []
    split = truncated = 0
    for s, words in enumerate(pieces):
        truncated += sum(len(ids) > room for ids in words)
        words = [ids[:room] for ids in words]
        windows = _windows([len(ids) for ids in words], room)
        split += len(windows) > 1
        plans.append((s, words, windows))

    n = sum(len(windows) for _, _, windows in plans)
    shape = (n, seq_len)
    input_ids = np.full(shape, pad_id, np.int32)
    input_mask = np.zeros(shape, np.int32)
    labels = np.full(shape, IGNORE, np.int64)
    word_index = np.full(shape, -1, np.int32)
    sentence_index = np.zeros(n, np.int64)

    row = 0
    for s, words, windows in plans:
        tags = examples.tags[s] if examples.labelled else None
        for start, end in windows:
            position = 1  # after [CLS]
            input_ids[row, 0] = cls_id
            for w in range(start, end):
                ids = words[w]
                input_ids[row, position:position + len(ids)] = ids
                word_index[row, position] = w
                if tags is not None:
                    label = label_ids.get(tags[w])
                    if label is None:
                        raise NerError(f"{examples.where(s, w)}: tag {tags[w]!r} is not one of the model's "
                                       f"labels ({', '.join(label_list)})")
                    labels[row, position] = label
                position += len(ids)
            input_ids[row, position] = sep_id
            input_mask[row, :position + 1] = 1
            sentence_index[row] = s
            row += 1

    return NerFeatures(input_ids, np.zeros(shape, np.int32), input_mask, labels, word_index, sentence_index,
                       list(label_list), split, truncated, empty)


# ------------------------------------------------------------------ predictions


def word_predictions(features: NerFeatures, predictions: np.ndarray, examples: NerExamples,
                     label_list: Sequence[str] | None = None) -> list[list[str]]:
    """The predicted tag of every word of every sentence, from the model's output on ``features``.

    ``predictions`` are logits (N, T, labels), whose argmax is taken, or label ids (N, T);
    ``label_list`` maps ids to tags (default: the features' own).
    """
    labels = list(features.label_list if label_list is None else label_list)
    predictions = np.asarray(predictions)
    if predictions.ndim == 3:
        if predictions.shape[2] != len(labels):
            raise NerError(f"the logits have {predictions.shape[2]} labels, the label list {len(labels)}")
        predictions = predictions.argmax(axis=-1)
    if predictions.shape != features.input_ids.shape:
        raise NerError(f"predictions of shape {predictions.shape} for features of shape "
                       f"{features.input_ids.shape}")
    rows, columns = np.nonzero(features.word_index >= 0)
    sentences = features.sentence_index[rows]
    words = features.word_index[rows, columns].astype(np.int64)
    ids = predictions[rows, columns].astype(np.int64)
    if len(ids) and (ids.min() < 0 or ids.max() >= len(labels)):
        raise NerError(f"a predicted label id is outside the {len(labels)} labels")
    # Each word's slot in all the examples' words, laid end to end.
    lengths = np.array([len(sentence) for sentence in examples.words], np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    if len(sentences) and (sentences.max() >= len(lengths) or (words >= lengths[sentences]).any()):
        raise NerError(f"the features are not those of {examples.path}: they have more words")
    slots = offsets[sentences] + words
    flat = np.full(int(offsets[-1]), -1, np.int64)
    flat[slots] = ids
    if len(slots) != len(flat) or (flat < 0).any():
        raise NerError(f"the features are not those of {examples.path}: not every word is predicted once")
    tags = np.array(labels, dtype=object)[flat]
    return [tags[offsets[i]:offsets[i + 1]].tolist() for i in range(len(lengths))]


def write_predictions(path: str | Path, examples: NerExamples, predictions: Sequence[Sequence[str]]) -> Path:
    """A CoNLL file of ``word gold prediction`` lines (``word prediction`` when unlabelled), a blank
    line after each sentence: what the ``conlleval`` script reads. Written atomically."""
    if len(predictions) != len(examples) or any(
            len(p) != len(w) for p, w in zip(predictions, examples.words, strict=True)):
        raise NerError(f"the predictions do not match the sentences of {examples.path}")
    lines = []
    for s, (words, predicted) in enumerate(zip(examples.words, predictions, strict=True)):
        gold = examples.tags[s] if examples.labelled else None
        for w, (word, tag) in enumerate(zip(words, predicted, strict=True)):
            lines.append(f"{word} {gold[w]} {tag}\n" if gold is not None else f"{word} {tag}\n")
        lines.append("\n")
    path = Path(path)
    with atomic_file(path) as tmp:
        tmp.write_text("".join(lines), encoding="utf-8")
    return path


# ------------------------------------------------------------------ scores


def _split_tag(tag: str) -> tuple[str, str | None]:
    if not TAG.match(tag):
        raise NerError(f"tag {tag!r} is not O, B-X, I-X, E-X or S-X")
    return (OUTSIDE, None) if tag == OUTSIDE else (tag[0], tag[2:])


def entities(tags: Sequence[str]) -> list[tuple[str, int, int]]:
    """The entities of one sentence's tags as (type, first, last) word, conlleval's way (seqeval's
    ``get_entities``): a chunk ends before ``B-``/``S-``/``O``, after ``E-``/``S-``, or at a type
    change; it starts at ``B-``/``S-``, at ``I-``/``E-`` after ``O`` or an ended chunk, or at a
    type change."""
    found = []
    previous, previous_type = OUTSIDE, None
    start = 0
    for i, tag in enumerate([*tags, OUTSIDE]):  # the O after the end closes the last chunk
        prefix, type_ = _split_tag(tag)
        ends = previous != OUTSIDE and (previous in "ES" or prefix in "BSO" or previous_type != type_)
        if ends:
            found.append((str(previous_type), start, i - 1))
        starts = prefix != OUTSIDE and (prefix in "BS" or previous in "OES" or previous_type != type_)
        if starts:
            start = i
        previous, previous_type = prefix, type_
    return found


def _prf(correct: int, predicted: int, true: int) -> tuple[float, float, float]:
    # 0 when undefined, and the F1 computed in seqeval's order of operations (equal to the last bit).
    precision = correct / predicted if predicted else 0.0
    recall = correct / true if true else 0.0
    denominator = precision + recall
    return precision, recall, 2.0 * precision * recall / (denominator if denominator else 1.0)


def entity_scores(true_tags: Sequence[Sequence[str]], pred_tags: Sequence[Sequence[str]]) -> dict:
    """Entity-level scores of predicted tags against the true ones, sentence by sentence.

    Returns ``{"precision", "recall", "f1"`` (micro-averaged over entities), ``"accuracy"`` (per
    token), ``"support"`` (true entities), ``"predicted"``, ``"correct"``, ``"types": {type:
    {"precision", "recall", "f1", "support"}}}`` (every type true or predicted, sorted) —
    equal to seqeval's ``precision_score``, ``recall_score``, ``f1_score``, ``accuracy_score``
    and ``classification_report(output_dict=True)`` in its default mode. Nothing to score gives
    zeros (seqeval raises on no tokens).
    """
    if len(true_tags) != len(pred_tags):
        raise NerError(f"{len(true_tags)} true sentences but {len(pred_tags)} predicted")
    true: dict[str, set[tuple[int, int, int]]] = {}
    pred: dict[str, set[tuple[int, int, int]]] = {}
    tokens = same = 0
    for s, (gold, guess) in enumerate(zip(true_tags, pred_tags, strict=True)):
        if len(gold) != len(guess):
            raise NerError(f"sentence {s}: {len(gold)} true tags but {len(guess)} predicted")
        for chunks, into in ((entities(gold), true), (entities(guess), pred)):
            for type_, first, last in chunks:
                into.setdefault(type_, set()).add((s, first, last))
        tokens += len(gold)
        same += sum(a == b for a, b in zip(gold, guess, strict=True))
    types: dict[str, dict[str, float | int]] = {}
    for type_ in sorted(true.keys() | pred.keys()):
        gold_set, guess_set = true.get(type_, set()), pred.get(type_, set())
        p, r, f = _prf(len(gold_set & guess_set), len(guess_set), len(gold_set))
        types[type_] = {"precision": p, "recall": r, "f1": f, "support": len(gold_set)}
    support = sum(len(chunks) for chunks in true.values())
    predicted = sum(len(chunks) for chunks in pred.values())
    correct = sum(len(chunks & pred.get(type_, set())) for type_, chunks in true.items())
    p, r, f = _prf(correct, predicted, support)
    return {"precision": p, "recall": r, "f1": f, "accuracy": same / tokens if tokens else 0.0,
            "support": support, "predicted": predicted, "correct": correct, "types": types}


def overall(scores: dict) -> dict[str, float]:
    """The overall precision, recall, F1 and accuracy of :func:`entity_scores`' result."""
    return {key: float(scores[key]) for key in ("precision", "recall", "f1", "accuracy")}
