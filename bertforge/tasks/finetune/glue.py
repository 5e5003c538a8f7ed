"""GLUE: the tasks' files → examples → fixed-length BERT features; leaderboard files; the download.

The tasks (:data:`TASKS`)
    CoLA, SST-2, MRPC, STS-B, QQP, MNLI, QNLI, RTE, WNLI and the diagnostic set
    AX (test only, predicted with the MNLI model), in the layout that GLUE's
    ``download_glue_data.py`` leaves (and :func:`download_glue` makes)::

        CoLA/{train,dev,test}.tsv   SST-2/…   MRPC/…   STS-B/…   QQP/…   QNLI/…   RTE/…   WNLI/…
        MNLI/{train,dev_matched,dev_mismatched,test_matched,test_mismatched}.tsv
        diagnostic/diagnostic.tsv

    Which column holds what differs per task and between train/dev and test;
    the table follows google-research/bert's ``run_classifier.py`` processors
    and Hugging Face's ``transformers/data/processors/glue.py`` (v4) column
    for column, and the header names of the files as GLUE publishes them
    (those Hugging Face ``datasets``' GLUE script reads by name). CoLA's
    train/dev files alone have no header.

Reading
    Tab-separated, with quoting off (``csv.reader(delimiter="\\t",
    quotechar=None)``, as both references read it: GLUE's text holds quote
    characters that are text); UTF-8, a leading byte-order mark ignored (MRPC's
    train/dev files start with one). The header must name the columns read
    (``sentence1`` where text_a is read...), which catches a file of another
    task or split. A row with too few columns, a label outside the task's
    labels or an STS-B score that is not a number from 0 to 5 raises :class:`GlueError`:
    ``MRPC/dev.tsv:7: label 'yes' is not one of 0, 1``. Except where the
    references skip: QQP's train file has rows with too few columns (broken
    by stray newlines in questions), which both references drop; they are
    skipped too and listed in :attr:`GlueExamples.skipped_lines`.

Features
    ``[CLS] a [SEP]`` or ``[CLS] a [SEP] b [SEP]``, zero-padded, segment 0
    then 1, exactly as ``run_classifier.convert_single_example``: a pair too
    long loses one token at a time from the longer side (the second when
    equal), a single text its tail. Tokens are the reference ``FullTokenizer``'s
    (:func:`bertforge.data.tokenizer.encode_texts`). With a ``tokenizer.json``
    (:class:`~bertforge.data.fast_tokenizer.FastTokenizer`) they are
    transformers' ``run_glue``'s instead: ``tokenizer(a, b, truncation=True,
    max_length=seq_len)`` (the file's special tokens and type ids, ``tokenizers``'
    longest-first truncation), padded with the [PAD] id.

Leaderboard files
    :func:`write_test_predictions` writes what gluebenchmark.com's submission
    takes: ``CoLA.tsv`` … ``MNLI-m.tsv``, ``MNLI-mm.tsv``, ``AX.tsv``, each a
    header ``index<TAB>prediction`` and one row per test example, the test
    file's index and the label as the task names it (``entailment``, ``1``);
    STS-B's score clipped to [0, 5] with 3 decimals, as GLUE's baseline
    (jiant) writes it.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import re
import shutil
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from bertforge.data.download import fetch_verified
from bertforge.data.fast_tokenizer import FastTokenizer
from bertforge.data.tokenizer import encode_texts
from bertforge.fileio import atomic_directory, atomic_file

from . import FinetuneError
from .metrics import TASK_METRICS

log = logging.getLogger(__name__)


class GlueError(FinetuneError):
    """A user-facing problem with GLUE input; the message names the file and line."""


# ------------------------------------------------------------------ the tasks


@dataclass(frozen=True)
class Columns:
    """Where one kind of file (train/dev, or test) of a task keeps what we read.

    Each is ``(column index, header name)``; index -1 is the last column (the
    references read MNLI's and STS-B's label there). ``header`` False: the
    file has no header row (CoLA's train and dev).
    """

    text_a: tuple[int, str]
    text_b: tuple[int, str] | None = None
    label: tuple[int, str] | None = None
    id: tuple[int, str] | None = None
    header: bool = True

    @property
    def min_columns(self) -> int:
        """The fewest columns a row needs: every column read, the label after the others when last."""
        used = [c for c in (self.text_a, self.text_b, self.label, self.id) if c is not None]
        width = max(index for index, _ in used if index >= 0) + 1
        return width + 1 if self.label is not None and self.label[0] < 0 else width


@dataclass(frozen=True)
class GlueTask:
    """One GLUE task: its files, columns, labels and metrics."""

    name: str                          # "CoLA"; also its key in TASKS
    directory: str                     # its directory in the GLUE layout
    files: dict[str, str]              # split -> file name in that directory
    labeled: Columns                   # train and dev files
    test: Columns                      # test files (no label)
    labels: tuple[str, ...] | None     # the class names, in class-id order; None: regression (STS-B)
    main_metric: str                   # the one BERT's paper reports, for model selection
    leaderboard: dict[str, str]        # test split -> submission file name
    skip_short_rows: bool = False      # QQP: drop rows with too few columns, as the references do
    model_task: str | None = None      # AX: predicted with MNLI's model (and labels)
    test_examples: dict[str, int] = field(default_factory=dict)  # rows the leaderboard expects

    @property
    def metrics(self) -> tuple[str, ...]:
        """What :func:`bertforge.tasks.finetune.metrics.glue_metrics` reports for this task."""
        return TASK_METRICS[self.name]

    @property
    def is_regression(self) -> bool:
        return self.labels is None

    @property
    def num_labels(self) -> int:
        """The classifier's outputs: the number of classes, 1 for a regression."""
        return 1 if self.labels is None else len(self.labels)

    @property
    def splits(self) -> tuple[str, ...]:
        return tuple(self.files)

    @property
    def dev_splits(self) -> tuple[str, ...]:
        """The labeled evaluation splits: ("dev",), MNLI's ("dev_matched", "dev_mismatched")."""
        return tuple(s for s in self.files if s.startswith("dev"))

    @property
    def test_splits(self) -> tuple[str, ...]:
        return tuple(s for s in self.files if s.startswith("test"))

    def columns(self, split: str) -> Columns:
        return self.test if split.startswith("test") else self.labeled


_SPLITS = {"train": "train.tsv", "dev": "dev.tsv", "test": "test.tsv"}
_ENTAILMENT = ("entailment", "not_entailment")
_NLI = ("contradiction", "entailment", "neutral")  # run_classifier's MnliProcessor order
_MNLI_LABELED = Columns(text_a=(8, "sentence1"), text_b=(9, "sentence2"), label=(-1, "gold_label"),
                        id=(0, "index"))
_MNLI_TEST = Columns(text_a=(8, "sentence1"), text_b=(9, "sentence2"), id=(0, "index"))
_PAIR_LABELED = Columns(text_a=(1, "sentence1"), text_b=(2, "sentence2"), label=(3, "label"), id=(0, "index"))
_PAIR_TEST = Columns(text_a=(1, "sentence1"), text_b=(2, "sentence2"), id=(0, "index"))

TASKS: dict[str, GlueTask] = {task.name: task for task in (
    GlueTask(
        "CoLA", "CoLA", _SPLITS,
        # train/dev: source, label, the author's "*" mark, sentence; no header.
        labeled=Columns(text_a=(3, ""), label=(1, ""), header=False),
        test=Columns(text_a=(1, "sentence"), id=(0, "index")),
        labels=("0", "1"), main_metric="mcc", leaderboard={"test": "CoLA.tsv"},
        test_examples={"test": 1063}),
    GlueTask(
        "SST-2", "SST-2", _SPLITS,
        labeled=Columns(text_a=(0, "sentence"), label=(1, "label")),
        test=Columns(text_a=(1, "sentence"), id=(0, "index")),
        labels=("0", "1"), main_metric="accuracy", leaderboard={"test": "SST-2.tsv"},
        test_examples={"test": 1821}),
    GlueTask(
        # train/dev: "Quality #1 ID #2 ID #1 String #2 String"; test (made by download_glue_data.py):
        # "index #1 ID #2 ID #1 String #2 String".
        "MRPC", "MRPC", _SPLITS,
        labeled=Columns(text_a=(3, "#1 String"), text_b=(4, "#2 String"), label=(0, "Quality")),
        test=Columns(text_a=(3, "#1 String"), text_b=(4, "#2 String"), id=(0, "index")),
        labels=("0", "1"), main_metric="f1", leaderboard={"test": "MRPC.tsv"},
        test_examples={"test": 1725}),
    GlueTask(
        # "index genre filename year old_index source1 source2 sentence1 sentence2 score"
        "STS-B", "STS-B", _SPLITS,
        labeled=Columns(text_a=(7, "sentence1"), text_b=(8, "sentence2"), label=(-1, "score"), id=(0, "index")),
        test=Columns(text_a=(7, "sentence1"), text_b=(8, "sentence2"), id=(0, "index")),
        labels=None, main_metric="spearman", leaderboard={"test": "STS-B.tsv"},
        test_examples={"test": 1379}),
    GlueTask(
        # "id qid1 qid2 question1 question2 is_duplicate"; test: "id question1 question2"
        "QQP", "QQP", _SPLITS,
        labeled=Columns(text_a=(3, "question1"), text_b=(4, "question2"), label=(5, "is_duplicate"),
                        id=(0, "id")),
        test=Columns(text_a=(1, "question1"), text_b=(2, "question2"), id=(0, "id")),
        labels=("0", "1"), main_metric="f1", leaderboard={"test": "QQP.tsv"}, skip_short_rows=True,
        test_examples={"test": 390965}),
    GlueTask(
        # "index promptID pairID genre sentence1_binary_parse sentence2_binary_parse sentence1_parse
        # sentence2_parse sentence1 sentence2 label1 [label2 … label5] gold_label"
        "MNLI", "MNLI",
        {"train": "train.tsv", "dev_matched": "dev_matched.tsv", "dev_mismatched": "dev_mismatched.tsv",
         "test_matched": "test_matched.tsv", "test_mismatched": "test_mismatched.tsv"},
        labeled=_MNLI_LABELED, test=_MNLI_TEST, labels=_NLI, main_metric="accuracy",
        leaderboard={"test_matched": "MNLI-m.tsv", "test_mismatched": "MNLI-mm.tsv"},
        test_examples={"test_matched": 9796, "test_mismatched": 9847}),
    GlueTask(
        "QNLI", "QNLI", _SPLITS,
        labeled=Columns(text_a=(1, "question"), text_b=(2, "sentence"), label=(3, "label"), id=(0, "index")),
        test=Columns(text_a=(1, "question"), text_b=(2, "sentence"), id=(0, "index")),
        labels=_ENTAILMENT, main_metric="accuracy", leaderboard={"test": "QNLI.tsv"},
        test_examples={"test": 5463}),
    GlueTask(
        "RTE", "RTE", _SPLITS, labeled=_PAIR_LABELED, test=_PAIR_TEST, labels=_ENTAILMENT,
        main_metric="accuracy", leaderboard={"test": "RTE.tsv"}, test_examples={"test": 3000}),
    GlueTask(
        "WNLI", "WNLI", _SPLITS, labeled=_PAIR_LABELED, test=_PAIR_TEST, labels=("0", "1"),
        main_metric="accuracy", leaderboard={"test": "WNLI.tsv"}, test_examples={"test": 146}),
    GlueTask(
        # "index sentence1 sentence2": GLUE's AX.tsv, saved as diagnostic/diagnostic.tsv.
        "AX", "diagnostic", {"test": "diagnostic.tsv"}, labeled=_PAIR_LABELED, test=_PAIR_TEST,
        labels=_NLI, main_metric="mcc", leaderboard={"test": "AX.tsv"}, model_task="MNLI",
        test_examples={"test": 1104}),
)}

_ALIASES = {"diagnostic": "AX", "sst": "SST-2", "sts": "STS-B"}


def get_task(task: str | GlueTask) -> GlueTask:
    """A task by name: any case, with or without the hyphen ("sts-b", "SST2", "mnli"); "diagnostic" is AX."""
    if isinstance(task, GlueTask):
        return task
    key = task.lower().replace("-", "").replace("_", "")
    for name, value in TASKS.items():
        if name.lower().replace("-", "") == key:
            return value
    if key in _ALIASES:
        return TASKS[_ALIASES[key]]
    raise GlueError(f"unknown GLUE task {task!r}; expected one of {', '.join(TASKS)}")


# ------------------------------------------------------------------ reading


@dataclass
class GlueExamples:
    """The examples of one file, in file order.

    ``ids`` are the file's id column (``index``; QQP's ``id``), the leaderboard's
    ``index``; where a file has none (CoLA, SST-2 and MRPC train/dev) the
    example's 0-based number. ``labels`` are the label strings of the file
    (``"entailment"``, ``"1"``), floats for STS-B, None for a test file.
    """

    task: str                        # a key of TASKS
    split: str
    source: Path
    ids: list[str]
    text_a: list[str]
    text_b: list[str] | None         # None for single-sentence tasks (CoLA, SST-2)
    labels: list[str] | list[float] | None
    lines: list[int]                 # each example's line in the file (1-based)
    skipped_lines: list[int] = field(default_factory=list)  # QQP's short rows, skipped

    def __len__(self) -> int:
        return len(self.text_a)


def task_file(data_dir: str | Path, task: str | GlueTask, split: str) -> Path:
    """The file of a task's split: under ``data_dir/<task directory>/`` (``data_dir`` the GLUE
    directory), else directly under ``data_dir`` (``data_dir`` the task's own directory)."""
    spec = get_task(task)
    if split not in spec.files:
        raise GlueError(f"{spec.name} has no split {split!r}; its splits are {', '.join(spec.files)}")
    data_dir = Path(data_dir)
    nested = data_dir / spec.directory / spec.files[split]
    if nested.exists() or not (data_dir / spec.files[split]).exists():
        return nested
    return data_dir / spec.files[split]


def read_task(data_dir: str | Path, task: str | GlueTask, split: str) -> GlueExamples:
    """The examples of ``task``'s ``split`` ("train", "dev", "test"; MNLI's "dev_matched",
    "dev_mismatched", "test_matched", "test_mismatched"), from the GLUE directory (or the
    task's own directory) ``data_dir``; see :func:`read_file`."""
    path = task_file(data_dir, task, split)
    if not path.exists():
        raise GlueError(missing_file(data_dir, task, split))
    return read_file(path, task, split)


def missing_file(data_dir: str | Path, task: str | GlueTask, split: str) -> str:
    """What to say when ``split``'s file is in neither place :func:`task_file` looks."""
    spec = get_task(task)
    return f"{data_dir}: no {spec.files[split]} in it or in its {spec.directory}/ ({spec.name}'s {split} split)"


def _open_tsv(path: Path) -> Iterable[tuple[int, list[str]]]:
    """(line number, fields) of each row; quoting off, as the references read GLUE."""
    try:
        # utf-8-sig: MRPC's train/dev files start with a byte-order mark (transformers reads so too).
        with open(path, encoding="utf-8-sig") as f:
            reader = csv.reader(f, delimiter="\t", quotechar=None)
            for row in reader:
                yield reader.line_num, row
    except FileNotFoundError:
        raise GlueError(f"file not found: {path}") from None
    except IsADirectoryError:
        raise GlueError(f"{path}: is a directory, not a .tsv file") from None
    except UnicodeDecodeError:
        raise GlueError(f"{path}:{_first_bad_line(path)}: not valid UTF-8") from None
    except csv.Error as err:  # a NUL byte, a field over csv's size limit
        raise GlueError(f"{path}: not a readable TSV file ({err})") from None
    except OSError as err:
        raise GlueError(f"{path}: cannot be read ({err.strerror or err})") from None


def _first_bad_line(path: Path) -> int:
    """The number of the first line that is not UTF-8 (the text reader only knows a block offset)."""
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError:
                return number
    return 0


def _check_header(path: Path, line: int, header: list[str], columns: Columns, spec: GlueTask, split: str) -> None:
    for column in (columns.id, columns.text_a, columns.text_b, columns.label):
        if column is None:
            continue
        index, name = column
        found = header[index] if -len(header) <= index < len(header) else None
        if found is None or found.strip() != name:
            where = "last column" if index < 0 else f"column {index + 1}"
            raise GlueError(f"{path}:{line}: expected {spec.name} {split} header with {name!r} in its {where}, "
                            f"got {found!r} (header: {' | '.join(header)[:200]})")


def read_file(path: str | Path, task: str | GlueTask, split: str) -> GlueExamples:
    """The examples of one GLUE file, read as ``task``'s ``split`` (which decides its columns)."""
    spec = get_task(task)
    if split not in spec.files:
        raise GlueError(f"{spec.name} has no split {split!r}; its splits are {', '.join(spec.files)}")
    path = Path(path)
    columns = spec.columns(split)
    need = columns.min_columns
    ids: list[str] = []
    text_a: list[str] = []
    text_b: list[str] = []
    labels: list = []
    lines: list[int] = []
    skipped: list[int] = []
    header_seen = not columns.header
    allowed = set(spec.labels or ())
    for line, row in _open_tsv(path):
        if not header_seen:
            _check_header(path, line, row, columns, spec, split)
            header_seen = True
            continue
        if len(row) < need:
            if spec.skip_short_rows:
                skipped.append(line)
                continue
            raise GlueError(f"{path}:{line}: {len(row)} column{'s' if len(row) != 1 else ''}, "
                            f"{spec.name} {split} rows need at least {need}")
        text_a.append(row[columns.text_a[0]])
        if columns.text_b is not None:
            text_b.append(row[columns.text_b[0]])
        if columns.label is not None:
            value = row[columns.label[0]]
            if spec.labels is None:
                labels.append(_score(value, path, line))
            elif value in allowed:
                labels.append(value)
            else:
                raise GlueError(f"{path}:{line}: label {value!r} is not one of {', '.join(spec.labels)}")
        ids.append(row[columns.id[0]] if columns.id is not None else str(len(ids)))
        lines.append(line)
    if not header_seen:
        raise GlueError(f"{path}: the file is empty (expected a {spec.name} {split} header)")
    if not lines:
        raise GlueError(f"{path}: no examples")
    if skipped:
        log.warning("%s: skipped %d rows with fewer than %d columns (lines %s)", path, len(skipped), need,
                    ", ".join(map(str, skipped[:10])) + (" …" if len(skipped) > 10 else ""))
    return GlueExamples(spec.name, split, path, ids, text_a, text_b if columns.text_b is not None else None,
                        labels if columns.label is not None else None, lines, skipped)


def _score(value: str, path: Path, line: int) -> float:
    try:
        score = float(value)
    except ValueError:
        score = math.nan
    if not math.isfinite(score):
        raise GlueError(f"{path}:{line}: score {value!r} is not a number")
    if not 0.0 <= score <= 5.0:  # STS-B's similarity scale; the predictions are clipped to it too
        raise GlueError(f"{path}:{line}: score {value!r} is outside STS-B's 0-5")
    return score


# ------------------------------------------------------------------ features


@dataclass
class GlueFeatures:
    """All examples as numpy arrays, row ``i`` = example ``i``.

    The (N, T) arrays are int32, zero-padded as the reference pads them.
    """

    input_ids: np.ndarray        # (N, T) int32
    input_mask: np.ndarray       # (N, T) int32: 1 real token, 0 padding
    segment_ids: np.ndarray      # (N, T) int32: 0 [CLS] a [SEP], 1 b [SEP]
    labels: np.ndarray | None    # (N,) int64 class ids, float32 scores (STS-B); None for a test set
    ids: list[str]               # the examples' ids (the leaderboard's index)
    truncated: int = 0           # examples that lost tokens to fit seq_len

    def __len__(self) -> int:
        return len(self.input_ids)

    def __repr__(self) -> str:
        return (f"GlueFeatures({len(self)} × {self.input_ids.shape[1]}, labels="
                f"{None if self.labels is None else self.labels.dtype}, truncated={self.truncated})")


def truncate_pair(tokens_a: list[int], tokens_b: list[int], max_length: int) -> None:
    """Shorten the pair in place to ``max_length`` tokens in all: one token at a time from the end
    of the longer one (of b when equal), as run_classifier's ``_truncate_seq_pair``."""
    excess = len(tokens_a) + len(tokens_b) - max_length
    if excess <= 0:
        return
    # Closed form of the reference's loop: cut the longer down to the shorter, then alternate
    # (b first) so that a keeps the odd token.
    a, b = len(tokens_a), len(tokens_b)
    total = max_length
    if abs(a - b) >= excess:
        a, b = (a - excess, b) if a > b else (a, b - excess)
    else:
        a, b = (total + 1) // 2, total // 2
    del tokens_a[a:]
    del tokens_b[b:]


def _token_id(tokenizer: Tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise GlueError(f"the vocab has no {token} token")
    return token_id


def convert_examples(examples: GlueExamples, tokenizer: Tokenizer | FastTokenizer, seq_len: int,
                     label_list: Sequence[str] | None = None) -> GlueFeatures:
    """The reference's features for ``examples`` (``run_classifier.convert_single_example``), or
    with a ``tokenizer.json``'s :class:`FastTokenizer` ``run_glue``'s (the module's docstring).

    ``tokenizer`` is :func:`bertforge.data.fast_tokenizer.task_tokenizer`'s.
    ``label_list`` maps label strings to class ids (its order is the ids');
    by default the task's labels (:attr:`GlueTask.labels`). STS-B's scores
    become float32 labels. A test set has no labels (``labels`` None).
    As in the reference, a second text that tokenizes to nothing makes a
    single-text example (a WordPiece vocab.txt).
    """
    spec = get_task(examples.task)
    if label_list is None:
        label_list = spec.labels
    elif spec.labels is None:
        raise GlueError(f"{spec.name} is a regression task: its scores take no label_list")
    if seq_len < 3:
        raise GlueError(f"seq_len={seq_len} leaves no room for a token after [CLS] and [SEP]")
    if isinstance(tokenizer, FastTokenizer):
        rows = _pipeline_rows(examples, tokenizer, seq_len)
    else:
        rows = _reference_rows(examples, tokenizer, seq_len)
    return GlueFeatures(*rows[:3], _labels(examples, label_list), list(examples.ids), rows[3])


def _reference_rows(examples: GlueExamples, tokenizer: Tokenizer, seq_len: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(input_ids, input_mask, segment_ids, examples truncated) as ``run_classifier.py``."""
    cls_id, sep_id = _token_id(tokenizer, "[CLS]"), _token_id(tokenizer, "[SEP]")
    n = len(examples)
    tokens_a = encode_texts(tokenizer, examples.text_a)
    tokens_b = encode_texts(tokenizer, examples.text_b) if examples.text_b is not None else [[] for _ in range(n)]

    input_ids = np.zeros((n, seq_len), np.int32)
    input_mask = np.zeros((n, seq_len), np.int32)
    segment_ids = np.zeros((n, seq_len), np.int32)
    truncated = 0
    for i, (a, b) in enumerate(zip(tokens_a, tokens_b, strict=True)):
        if b:
            if len(a) + len(b) > seq_len - 3:
                truncate_pair(a, b, seq_len - 3)
                truncated += 1
        elif len(a) > seq_len - 2:
            a = a[:seq_len - 2]
            truncated += 1
        row = [cls_id, *a, sep_id] + ([*b, sep_id] if b else [])
        input_ids[i, :len(row)] = row
        input_mask[i, :len(row)] = 1
        if b:
            segment_ids[i, len(a) + 2:len(row)] = 1
    return input_ids, input_mask, segment_ids, truncated


def _pipeline_rows(examples: GlueExamples, tokenizer: FastTokenizer, seq_len: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(input_ids, input_mask, segment_ids, examples truncated) as ``run_glue``'s
    ``tokenizer(a, b, truncation=True, max_length=seq_len)``, padded with the [PAD] id."""
    second = None if examples.text_b is None else list(examples.text_b)
    encodings = tokenizer.encode(list(examples.text_a), second, max_length=seq_len)
    n = len(encodings)
    input_ids = np.full((n, seq_len), tokenizer.pad_id, np.int32)
    input_mask = np.zeros((n, seq_len), np.int32)
    segment_ids = np.zeros((n, seq_len), np.int32)
    for i, encoding in enumerate(encodings):
        input_ids[i, :len(encoding.ids)] = encoding.ids
        input_mask[i, :len(encoding.ids)] = 1
        segment_ids[i, :len(encoding.ids)] = encoding.type_ids
    return input_ids, input_mask, segment_ids, sum(bool(e.overflowing) for e in encodings)


def _labels(examples: GlueExamples, label_list: Sequence[str] | None) -> np.ndarray | None:
    """Class ids (of ``label_list``), STS-B's float32 scores (no list), or None for a test set."""
    if examples.labels is None:
        return None
    if label_list is None:
        return np.asarray(examples.labels, dtype=np.float32)
    label_map = {label: i for i, label in enumerate(label_list)}
    missing = sorted({str(x) for x in examples.labels} - set(label_map))
    if missing:
        raise GlueError(f"{examples.source}: labels {missing} are not in the label list {list(label_list)}")
    return np.array([label_map[str(x)] for x in examples.labels], dtype=np.int64)


# ------------------------------------------------------------------ leaderboard files


def leaderboard_file(task: str | GlueTask, split: str = "test") -> str:
    """The submission file name for a task's test split (MNLI: "test_matched" → ``MNLI-m.tsv``)."""
    spec = get_task(task)
    if split not in spec.leaderboard:
        raise GlueError(f"{spec.name} has no test split {split!r} for the leaderboard; "
                        f"its are {', '.join(spec.leaderboard)}")
    return spec.leaderboard[split]


def write_test_predictions(out_dir: str | Path, task: str | GlueTask, ids: Sequence[str],
                           predictions: Sequence | np.ndarray, label_list: Sequence[str] | None = None,
                           *, split: str = "test") -> Path:
    """Write a task's test predictions as the GLUE leaderboard takes them; the file's path.

    ``ids`` are the test file's ids (:attr:`GlueExamples.ids`); ``predictions``
    class ids into ``label_list`` (default: the task's labels; AX's are
    MNLI's), or STS-B's scores (clipped to [0, 5], written with 3 decimals).
    MNLI has two test sets: ``split="test_matched"`` (``MNLI-m.tsv``) or
    ``"test_mismatched"`` (``MNLI-mm.tsv``). The file is written atomically.
    """
    spec = get_task(task)
    name = leaderboard_file(spec, split)
    values = np.asarray(predictions)
    if values.ndim != 1 or len(values) != len(ids):
        raise GlueError(f"{name}: {len(ids)} ids but predictions of shape {values.shape}")
    if len(set(ids)) != len(ids):
        raise GlueError(f"{name}: the ids are not unique")
    if any(not str(i) or re.search(r"[\t\r\n]", str(i)) for i in ids):
        raise GlueError(f"{name}: an id is empty or holds a tab or newline")
    if spec.labels is None:
        if label_list is not None:
            raise GlueError(f"{spec.name} is a regression task: its scores take no label_list")
        scores = values.astype(np.float64)
        if not np.isfinite(scores).all():
            raise GlueError(f"{name}: a score is not finite")
        cells = [f"{s:.3f}" for s in np.clip(scores, 0.0, 5.0)]
    else:
        names = list(label_list if label_list is not None else spec.labels)
        if not np.issubdtype(values.dtype, np.integer) or (values < 0).any() or (values >= len(names)).any():
            raise GlueError(f"{name}: predictions must be class ids 0..{len(names) - 1} into {names}")
        cells = [names[int(v)] for v in values]
    expected = spec.test_examples.get(split)
    if expected is not None and len(ids) != expected:
        log.warning("%s: %d predictions; the leaderboard expects %d", name, len(ids), expected)
    path = Path(out_dir) / name
    with atomic_file(path) as tmp, open(tmp, "w", encoding="utf-8", newline="") as f:
        f.write("index\tprediction\n")
        f.writelines(f"{i}\t{cell}\n" for i, cell in zip(ids, cells, strict=True))
    return path


# ------------------------------------------------------------------ download


@dataclass(frozen=True)
class Source:
    """One file to download, with the size and SHA-256 it must have."""

    url: str
    size: int
    sha256: str


# The archives download_glue_data.py (github.com/nyu-mll/GLUE-baselines) fetches. Sizes and SHA-256
# from Hugging Face datasets' datasets/glue/dataset_infos.json ("download_checksums" for these very
# URLs); the archives' digests agree with tensorflow_datasets' url_checksums/glue.txt (same files at
# their earlier firebase URLs) and with Transformers.jl's src/datasets/glue/*.jl.
_GLUE_URL = "https://dl.fbaipublicfiles.com/glue/data"
_SENTEVAL_URL = "https://dl.fbaipublicfiles.com/senteval/senteval_data"
SOURCES: dict[str, tuple[Source, ...]] = {
    "CoLA": (Source(f"{_GLUE_URL}/CoLA.zip", 376971,
                    "f212fcd832b8f7b435fb991f101abf89f96b933ab400603bf198960dfc32cbff"),),
    "SST-2": (Source(f"{_GLUE_URL}/SST-2.zip", 7439277,
                     "d67e16fb55739c1b32cdce9877596db1c127dc322d93c082281f64057c16deaa"),),
    # MRPC is not GLUE's to host: the script builds it from SentEval's copy of the corpus and
    # GLUE's list of dev pairs, as we do (_build_mrpc).
    "MRPC": (Source(f"{_SENTEVAL_URL}/msr_paraphrase_train.txt", 1047044,
                    "60a9b09084528f0673eedee2b69cb941920f0b8cd0eeccefc464a98768457f89"),
             Source(f"{_SENTEVAL_URL}/msr_paraphrase_test.txt", 441275,
                    "a04e271090879aaba6423d65b94950c089298587d9c084bf9cd7439bd785f784"),
             Source(f"{_GLUE_URL}/mrpc_dev_ids.tsv", 6222,
                    "971d7767d81b997fd9060ade0ec23c4fc31cbb226a55d1bd4a1bac474eb81dc7")),
    "STS-B": (Source(f"{_GLUE_URL}/STS-B.zip", 802872,
                     "e60a6393de5a8b5b9bac5020a1554b54e3691f9d600b775bd131e613ac179c85"),),
    "QQP": (Source(f"{_GLUE_URL}/QQP-clean.zip", 41696084,
                   "40e7c862c04eb26ee04b67fd900e76c45c6ba8e6d8fab4f8f1f8072a1a3fbae0"),),
    "MNLI": (Source(f"{_GLUE_URL}/MNLI.zip", 312783507,
                    "e7c1d896d26ed6caf700110645df426cc2d8ebf02a5ab743d5a5c68ac1c83633"),),
    "QNLI": (Source(f"{_GLUE_URL}/QNLIv2.zip", 10627589,
                    "e634e78627a29adaecd4f955359b22bf5e70f2cbd93b493f2d624138a0c0e5f5"),),
    "RTE": (Source(f"{_GLUE_URL}/RTE.zip", 697150,
                   "6bf86de103ecd335f3441bd43574d23fef87ecc695977a63b82d5efb206556ee"),),
    "WNLI": (Source(f"{_GLUE_URL}/WNLI.zip", 28999,
                    "ae0e8e4d16f4d46d4a0a566ec7ecceccfd3fbfaa4a7a4b4e02848c0f2561ac46"),),
    "AX": (Source(f"{_GLUE_URL}/AX.tsv", 222257,
                  "0e13510b1bb14436ff7e2ee82338f0efb0133ecf2e73507a697dc210db3f05fd"),),
}

# Written last into a task's directory, listing its files and sizes: a directory with it whole is
# complete; one without it (an interrupted unzip by hand) is not taken for whole.
COMPLETE_MARKER = ".bertforge-complete.json"
DOWNLOADS = ".downloads"  # archives and their .part files, under the GLUE directory


def is_complete(directory: Path, spec: GlueTask) -> bool:
    """Whether ``directory`` holds the task's files as :func:`download_glue` left them."""
    try:
        listed = json.loads((directory / COMPLETE_MARKER).read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if not set(spec.files.values()) <= set(listed):
        return False
    return all((directory / name).is_file() and (directory / name).stat().st_size == size
               for name, size in listed.items())


def download_glue(out_dir: str | Path, tasks: Iterable[str] | None = None, *,
                  sources: dict[str, tuple[Source, ...]] | None = None, retries: int = 5,
                  retry_wait: float = 2.0, timeout: float = 60.0) -> dict[str, Path]:
    """Download GLUE tasks into ``out_dir`` in the official layout; {task: its directory}.

    ``tasks``: names as :func:`get_task` takes them (default: all ten, AX
    included). Each archive is fetched resumably and checked against its
    published size and SHA-256 (:data:`SOURCES`; ``sources`` replaces entries,
    for a mirror), then unpacked into a temporary directory that becomes the
    task's directory only when whole, with a list of its files and sizes
    (:data:`COMPLETE_MARKER`); the archive is then deleted. A task whose
    directory is complete is not fetched again; one without that list (half
    unpacked, or unpacked by hand) is fetched again and replaced.
    """
    out_dir = Path(out_dir)
    table = {**SOURCES, **(sources or {})}
    if isinstance(tasks, str):  # one name, not its letters
        tasks = [tasks]
    names = [get_task(t).name for t in tasks] if tasks is not None else list(TASKS)
    done: dict[str, Path] = {}
    for name in dict.fromkeys(names):
        spec = TASKS[name]
        directory = out_dir / spec.directory
        if is_complete(directory, spec):
            log.info("%s: complete in %s", name, directory)
            done[name] = directory
            continue
        downloads = out_dir / DOWNLOADS
        files = [fetch_verified(s.url, downloads / _file_name(s.url), ("sha256", s.sha256), size=s.size,
                                retries=retries, retry_wait=retry_wait, timeout=timeout)
                 for s in table[name]]
        with atomic_directory(directory) as tmp:
            if name == "MRPC":
                _build_mrpc(tmp, *files)
            elif name == "AX":
                shutil.copyfile(files[0], tmp / spec.files["test"])
            else:
                _unzip_task(files[0], spec, tmp)
            missing = [f for f in spec.files.values() if not (tmp / f).is_file()]
            if missing:
                raise GlueError(f"{table[name][0].url}: has no {spec.directory}/{missing[0]}")
            sizes = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
            (tmp / COMPLETE_MARKER).write_text(json.dumps({"task": name, "files": sizes}, indent=1) + "\n",
                                               encoding="utf-8")
        for file in files:
            file.unlink()
        if not any(downloads.iterdir()):
            downloads.rmdir()
        log.info("%s: unpacked into %s", name, directory)
        done[name] = directory
    return done


def _file_name(url: str) -> str:
    return url.rsplit("/", 1)[-1].split("?", 1)[0]


def _unzip_task(archive: Path, spec: GlueTask, into: Path) -> None:
    """Extract the archive's ``<task directory>/…`` members into ``into``."""
    try:
        with zipfile.ZipFile(archive) as zf:
            for info in zf.infolist():
                parts = Path(info.filename).parts
                if info.is_dir() or len(parts) < 2 or parts[0] != spec.directory:
                    continue  # __MACOSX/ and the like
                if any(part in ("..", "") for part in parts) or os.path.isabs(info.filename):
                    raise GlueError(f"{archive}: unsafe member name {info.filename!r}")
                target = into.joinpath(*parts[1:])
                target.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(info) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
    except zipfile.BadZipFile as err:
        raise GlueError(f"{archive}: not a readable zip archive ({err})") from None


def _build_mrpc(into: Path, train_txt: Path, test_txt: Path, dev_ids_tsv: Path) -> None:
    """MRPC's train/dev/test.tsv from the corpus files, byte for byte as download_glue_data.py
    writes them: train and dev keep the corpus header (with its byte-order mark), dev holds the
    pairs GLUE lists, test gets an ``index`` column instead of the label."""
    def rows(path: Path) -> tuple[str, list[list[str]]]:
        with open(path, encoding="utf-8") as f:
            header = f.readline()
            body = []
            for number, line in enumerate(f, start=2):
                fields = line.strip().split("\t")
                if len(fields) != 5:
                    raise GlueError(f"{path}:{number}: {len(fields)} fields, expected 5")
                body.append(fields)
        return header, body

    with open(dev_ids_tsv, encoding="utf-8") as f:
        dev_ids = {tuple(line.strip().split("\t")) for line in f}
    header, train_rows = rows(train_txt)
    _, test_rows = rows(test_txt)
    with open(into / "train.tsv", "w", encoding="utf-8") as train, open(into / "dev.tsv", "w",
                                                                        encoding="utf-8") as dev:
        train.write(header)
        dev.write(header)
        for label, id1, id2, s1, s2 in train_rows:
            (dev if (id1, id2) in dev_ids else train).write(f"{label}\t{id1}\t{id2}\t{s1}\t{s2}\n")
    with open(into / "test.tsv", "w", encoding="utf-8") as test:
        test.write("index\t#1 ID\t#2 ID\t#1 String\t#2 String\n")
        for index, (_, id1, id2, s1, s2) in enumerate(test_rows):
            test.write(f"{index}\t{id1}\t{id2}\t{s1}\t{s2}\n")
