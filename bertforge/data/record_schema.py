"""What a pre-training record holds, in either format, and when a row of it is valid.

Two formats hold the same rows (:mod:`.rows`):

* ``tfrecord`` -- google-research/bert's: TFRecord frames of ``tf.train.Example``
  with exactly the reference features (all int64 lists but the float
  ``masked_lm_weights``), readable by TensorFlow, the ``tfrecord`` package,
  DALI and Graphcore's loaders, and able to read theirs (:mod:`.tfrecord`).
* ``native`` -- ours: fixed-size rows in narrow dtypes behind a JSON header,
  memory-mapped, for O(1) opening and fancy-index random access (:mod:`.native`).

Either holds unpacked rows (one sequence each) or packed rows (in TFRecords
Graphcore's ``packed_*`` features); ``max_sequences_per_pack`` says which (0:
unpacked). This module names the features, their widths and dtypes, checks rows
(:func:`row_problems`) and tells the format of a file (:func:`detect_format`);
:mod:`.record_writer` writes files, :mod:`.record_reader` reads them and
:mod:`.record_inspect` describes them.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import numpy as np

from . import native
from .errors import DataError
from .rows import PackedArrays, PretrainingArrays, Rows, arrays_class
from .tfrecord import (
    FLOAT,
    HEADER_BYTES,
    INT64,
    masked_crc,
)

FORMATS = ("tfrecord", "native")
FEATURES = ("input_ids", "input_mask", "segment_ids", "masked_lm_positions", "masked_lm_ids",
            "masked_lm_weights", "next_sentence_labels")
PACKED_FEATURES = tuple(f"packed_{f.name}" for f in fields(PackedArrays))  # Graphcore's names
SUFFIXES = {"tfrecord": ".tfrecord", "native": ".bfrec"}  # what our commands name files

_FLOAT_FEATURES = ("masked_lm_weights", "packed_masked_lm_mask", "packed_next_sentence_mask")
KINDS = {name: FLOAT if name in _FLOAT_FEATURES else INT64 for name in FEATURES + PACKED_FEATURES}
_SEQUENCE_FEATURES = ("input_ids", "input_mask", "segment_ids", "position_ids")  # seq_len values each
_FLOAT_FIELDS = ("masked_lm_weights", "masked_lm_mask", "next_sentence_mask")  # may hold floats
TFRECORD_SUFFIXES = (".tfrecord", ".tfrecords")
# Beside a TFRecord file (which has no header): the tokenizer that made it, Vocabulary.identity() as JSON.
TOKENIZER_SIDECAR = ".made-with.json"
CHUNK_ROWS = 4096  # rows encoded, decoded or validated in one numpy batch: bounds memory
_ID_LIMIT = 1 << 31  # token ids are held as int32


# ---------------------------------------------------------------- validation


def tokenizer_sidecar(path: Path) -> Path:
    """Where the tokenizer that made the TFRecord file ``path`` is said: ``path`` + TOKENIZER_SIDECAR."""
    return path.with_name(path.name + TOKENIZER_SIDECAR)


def features_of(max_sequences_per_pack: int) -> tuple[str, ...]:
    """The record features of unpacked (0) or packed rows."""
    return PACKED_FEATURES if max_sequences_per_pack else FEATURES


def field_of(feature: str) -> str:
    """The PretrainingArrays or PackedArrays field a record feature holds."""
    return feature.removeprefix("packed_")


def width_of(name: str, seq_len: int, max_predictions: int, max_sequences_per_pack: int = 0) -> int:
    """Values per row of a feature or field; packed rows hold max_predictions + S - 1 predictions."""
    name = field_of(name)
    if name in ("next_sentence_labels", "next_sentence_mask"):
        return max_sequences_per_pack or 1
    if name in _SEQUENCE_FEATURES:
        return seq_len
    return max_predictions + max(max_sequences_per_pack - 1, 0)


def _shape_problem(arrays: Rows, seq_len: int, max_predictions: int, max_sequences_per_pack: int) -> str | None:
    kind = arrays_class(max_sequences_per_pack)
    if not isinstance(arrays, kind):
        return f"got {type(arrays).__name__}, expected {kind.__name__} for this file"
    n = len(arrays.input_ids)
    for name in map(field_of, features_of(max_sequences_per_pack)):
        values = np.asarray(getattr(arrays, name))
        width = width_of(name, seq_len, max_predictions, max_sequences_per_pack)
        expected = (n,) if name == "next_sentence_labels" and not max_sequences_per_pack else (n, width)
        if values.shape != expected:
            return f"{name} has shape {values.shape}, expected {expected}"
        numeric = np.issubdtype(values.dtype, np.number) or values.dtype == bool
        if not numeric or (name not in _FLOAT_FIELDS and np.issubdtype(values.dtype, np.floating)):
            return f"{name} has dtype {values.dtype}, expected integers"
    return None


def row_problems(arrays: Rows, seq_len: int, vocab_size: int | None) -> dict[int, str]:
    """For each row with a value out of range, a message naming the first such field and value.

    Token ids must be in [0, vocab_size) (or fit int32 when no vocab size is
    given), positions in [0, seq_len), masks, segments and labels 0 or 1,
    weights finite. Packed rows: sequence indices in [0, S], whole numbers
    also where the file holds floats, and each sequence laid out as
    Graphcore's script does (its [CLS] at seq_len - k, its next-sentence
    slot S - k marked). Rows are checked all at once; only bad rows cost Python work.
    """
    id_limit = _ID_LIMIT if vocab_size is None else vocab_size
    id_rule = f"a token id in [0, {vocab_size}) (vocab_size)" if vocab_size else "a token id in [0, 2**31)"
    position_rule = f"a position in [0, {seq_len}) (seq_len)"
    checks = [("input_ids", id_limit, id_rule), ("masked_lm_ids", id_limit, id_rule),
              ("input_mask", 2, "0 or 1"), ("segment_ids", 2, "0 or 1"),
              ("masked_lm_positions", seq_len, position_rule),
              ("next_sentence_labels", 2, "0 or 1")]
    slots = arrays.max_sequences_per_pack if isinstance(arrays, PackedArrays) else 0
    if slots:
        index_rule = f"a sequence index in 0..{slots}"
        checks[2] = ("input_mask", slots + 1, index_rule)
        checks += [("position_ids", seq_len, position_rule), ("masked_lm_mask", slots + 1, index_rule),
                   ("next_sentence_mask", 2, "0 or 1")]
    problems: dict[int, str] = {}

    def report(name: str, values: np.ndarray, bad: np.ndarray, rule: str) -> None:
        for row in np.flatnonzero(bad.any(axis=1)).tolist():
            if row not in problems:
                column = int(np.argmax(bad[row]))
                problems[row] = f"{name}[{column}] = {values[row, column]} is not {rule}"

    for name, limit, rule in checks:
        values = np.asarray(getattr(arrays, name))
        values = values.reshape(len(values), int(np.prod(values.shape[1:])))  # labels: (N, 1)
        bad = (values < 0) | (values >= limit)
        if np.issubdtype(values.dtype, np.floating):  # packed masks: TFRecord floats
            bad |= values != np.floor(values)
        report(name, values, bad, rule)
    if isinstance(arrays, PretrainingArrays):
        weights = np.asarray(arrays.masked_lm_weights)
        report("masked_lm_weights", weights, ~np.isfinite(weights), "finite")
    else:
        assert isinstance(arrays, PackedArrays)  # slots > 0
        mask = np.asarray(arrays.input_mask)
        for k in range(1, slots + 1):
            present = np.asarray(arrays.next_sentence_mask)[:, slots - k] > 0
            cls_ok = mask[:, seq_len - k] == k
            for row in np.flatnonzero(present != cls_ok).tolist():
                problems.setdefault(row, f"next_sentence_mask[{slots - k}] = {int(present[row])}, but "
                                         f"input_mask[{seq_len - k}] = {mask[row, seq_len - k]}: sequence "
                                         f"{k}'s [CLS] goes there, its label in slot {slots - k}")
    return dict(sorted(problems.items()))


def canonical(columns: dict[str, np.ndarray], max_sequences_per_pack: int = 0) -> Rows:
    """Arrays in PretrainingArrays' dtypes (int32 ids, int8 masks, float32 weights, int64 labels),
    or PackedArrays' (int8 sequence indices, int32 positions)."""
    if max_sequences_per_pack:
        return PackedArrays(
            input_ids=columns["input_ids"].astype(np.int32, copy=False),
            input_mask=columns["input_mask"].astype(np.int8, copy=False),
            segment_ids=columns["segment_ids"].astype(np.int8, copy=False),
            position_ids=columns["position_ids"].astype(np.int32, copy=False),
            masked_lm_positions=columns["masked_lm_positions"].astype(np.int32, copy=False),
            masked_lm_ids=columns["masked_lm_ids"].astype(np.int32, copy=False),
            masked_lm_mask=columns["masked_lm_mask"].astype(np.int8, copy=False),
            next_sentence_labels=columns["next_sentence_labels"].astype(np.int64, copy=False),
            next_sentence_mask=columns["next_sentence_mask"].astype(np.int8, copy=False),
        )
    return PretrainingArrays(
        input_ids=columns["input_ids"].astype(np.int32, copy=False),
        segment_ids=columns["segment_ids"].astype(np.int8, copy=False),
        input_mask=columns["input_mask"].astype(np.int8, copy=False),
        masked_lm_positions=columns["masked_lm_positions"].astype(np.int32, copy=False),
        masked_lm_ids=columns["masked_lm_ids"].astype(np.int32, copy=False),
        masked_lm_weights=columns["masked_lm_weights"].astype(np.float32, copy=False),
        next_sentence_labels=columns["next_sentence_labels"].reshape(-1).astype(np.int64, copy=False),
    )


def detect_format(path: str | Path) -> str:
    """``native`` or ``tfrecord``, from the first bytes, else from the name (``*.tfrecord``,
    ``*.tfrecords``, ``*.bfrec``: a damaged or empty file of that name is read as that format)."""
    path = Path(path)
    try:
        with open(path, "rb") as file:
            head = file.read(HEADER_BYTES)
    except FileNotFoundError:
        raise DataError(f"record file not found: {path}") from None
    except IsADirectoryError:
        raise DataError(f"{path}: is a directory, not a record file") from None
    if head[:len(native.MAGIC)] == native.MAGIC:
        return "native"
    if len(head) == HEADER_BYTES and masked_crc(head[:8]) == int.from_bytes(head[8:], "little"):
        return "tfrecord"
    # A file named as a record file is read as one, so that damage at its start is reported as
    # what it is (a corrupt first record, bad magic bytes) rather than as "not a record file".
    if path.suffix in TFRECORD_SUFFIXES:
        return "tfrecord"
    if path.suffix == SUFFIXES["native"]:
        return "native"
    raise DataError(f"{path}: neither a TFRecord nor a bertforge native record file "
                    f"(first bytes: {head[:8].hex(' ') or 'none, the file is empty'})")


