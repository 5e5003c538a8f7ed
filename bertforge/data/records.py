"""Pre-training record files, in two formats behind one API.

* ``tfrecord`` -- google-research/bert's: TFRecord frames of ``tf.train.Example``
  with exactly the reference features (all int64 lists but the float
  ``masked_lm_weights``), readable by TensorFlow, the ``tfrecord`` package,
  DALI and Graphcore's loaders, and able to read theirs (:mod:`.tfrecord`).
* ``native`` -- ours: fixed-size rows in narrow dtypes behind a JSON header,
  memory-mapped, for O(1) opening and fancy-index random access (:mod:`.native`).

Either holds unpacked rows (one sequence each, :class:`.instances.PretrainingArrays`)
or packed rows (:class:`.packing.PackedArrays`; in TFRecords Graphcore's
``packed_*`` features); ``max_sequences_per_pack`` says which (0: unpacked).

Writing (:class:`RecordWriter`, :func:`write_records`) validates every row and
streams to a hidden temporary file that is renamed into place only when
complete. Reading (:func:`open_records`) gives a :class:`RecordFile` with
random access (``take``) to either format. For TFRecords, opening with
``verify=True`` (the default) reads the whole file once: both checksums of
every record and every feature are checked, and bad records are an error
naming the file and byte offset, or, with ``max_bad`` > 0, skipped and counted.
"""

from __future__ import annotations

import contextlib
import mmap
import sys
from array import array
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from ..fileio import atomic_file
from . import native
from .errors import DataError
from .instances import PretrainingArrays
from .packing import PackedArrays, PackingStats, Rows, arrays_class, concat_rows, unpack_rows
from .tfrecord import (
    BYTES,
    FLOAT,
    HEADER_BYTES,
    INT64,
    ChecksumError,
    FormatError,
    LengthError,
    TruncatedError,
    decode_float_rows,
    decode_varint_rows,
    encode_frames,
    example_features,
    example_spans,
    masked_crc,
    ragged_gather,
    read_frame,
)

FORMATS = ("tfrecord", "native")
FEATURES = ("input_ids", "input_mask", "segment_ids", "masked_lm_positions", "masked_lm_ids",
            "masked_lm_weights", "next_sentence_labels")
PACKED_FEATURES = tuple(f"packed_{f.name}" for f in fields(PackedArrays))  # Graphcore's names
SUFFIXES = {"tfrecord": ".tfrecord", "native": ".bfrec"}  # what our commands name files

_FLOAT_FEATURES = ("masked_lm_weights", "packed_masked_lm_mask", "packed_next_sentence_mask")
_KINDS = {name: FLOAT if name in _FLOAT_FEATURES else INT64 for name in FEATURES + PACKED_FEATURES}
_ONEOF_FIELD = {BYTES: 1, FLOAT: 2, INT64: 3}  # Feature's oneof field numbers
_ONEOF_NAME = {number: kind for kind, number in _ONEOF_FIELD.items()}
_SEQUENCE_FEATURES = ("input_ids", "input_mask", "segment_ids", "position_ids")  # seq_len values each
_FLOAT_FIELDS = ("masked_lm_weights", "masked_lm_mask", "next_sentence_mask")  # may hold floats
_TFRECORD_SUFFIXES = (".tfrecord", ".tfrecords")
_CHUNK_ROWS = 4096  # rows encoded, decoded or validated in one numpy batch: bounds memory
_MIN_ENCODE_ROWS = 256  # a writer gathers smaller writes up to this many rows before encoding
_ID_LIMIT = 1 << 31  # token ids are held as int32


# ---------------------------------------------------------------- validation

def _features(max_sequences_per_pack: int) -> tuple[str, ...]:
    """The record features of unpacked (0) or packed rows."""
    return PACKED_FEATURES if max_sequences_per_pack else FEATURES


def _field(feature: str) -> str:
    """The PretrainingArrays or PackedArrays field a record feature holds."""
    return feature.removeprefix("packed_")


def _width(name: str, seq_len: int, max_predictions: int, max_sequences_per_pack: int = 0) -> int:
    """Values per row of a feature or field; packed rows hold max_predictions + S - 1 predictions."""
    name = _field(name)
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
    for name in map(_field, _features(max_sequences_per_pack)):
        values = np.asarray(getattr(arrays, name))
        width = _width(name, seq_len, max_predictions, max_sequences_per_pack)
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


def _canonical(columns: dict[str, np.ndarray], max_sequences_per_pack: int = 0) -> Rows:
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


# ---------------------------------------------------------------- writing

class _Abort(Exception):
    """Thrown into the atomic file to make it clean up."""


@dataclass(frozen=True)
class EncodedRecords:
    """Records already validated and encoded for one file layout, ready to be appended.

    ``data`` holds the records one after the other (uint8); record i is
    ``data[ends[i] - length_i:ends[i]]``, and ``max_ids[i]`` its largest token
    id. Made by :meth:`RecordEncoder.encode` (in worker processes, say) and
    appended by :meth:`RecordWriter.write_encoded`, which only copies bytes.
    """

    layout: tuple  # RecordEncoder.layout: the files these bytes fit
    data: np.ndarray
    ends: np.ndarray
    max_ids: np.ndarray

    def __len__(self) -> int:
        return len(self.ends)

    def take(self, rows: slice) -> EncodedRecords:
        """The records of a slice (any step: round-robin over files) as their own batch."""
        picked = np.arange(len(self))[rows]
        if len(picked) == len(self):
            return self
        lengths = np.diff(self.ends, prepend=0)
        if len(lengths) and (lengths == lengths[0]).all():  # fixed-size rows: a strided view
            data = self.data.reshape(len(self), -1)[rows].reshape(-1)
        else:
            data = ragged_gather(self.data, self.ends[picked] - lengths[picked], lengths[picked])
        return EncodedRecords(self.layout, data, np.cumsum(lengths[picked]), self.max_ids[picked])


class RecordEncoder:
    """Validates rows and encodes them as the records of one format and layout.

    ``vocab_size`` (when given) bounds the token ids; for the native format it
    (or ``id_bound``, a bound on the ids known in advance) also picks the id
    dtype: uint16 up to 65536, else int32. With ``max_sequences_per_pack`` S
    the rows are packed (:class:`.packing.PackedArrays`, ``max_predictions``
    per sequence). Two encoders with the same ``layout`` make records that
    can go into the same file.
    """

    def __init__(self, fmt: str, seq_len: int, max_predictions: int,
                 vocab_size: int | None = None, *, id_bound: int | None = None,
                 max_sequences_per_pack: int = 0):
        if fmt not in FORMATS:
            raise DataError(f"unknown record format {fmt!r} (formats: {', '.join(FORMATS)})")
        if seq_len < 1 or not 1 <= max_predictions <= seq_len:
            raise ValueError(f"need 1 <= max_predictions ({max_predictions}) <= seq_len ({seq_len})")
        if fmt == "native" and seq_len > native.MAX_SEQ_LEN:  # positions are at most uint16
            raise DataError(f"seq_len {seq_len}: the native format holds sequences of at most "
                            f"{native.MAX_SEQ_LEN} tokens")
        if not 0 <= max_sequences_per_pack <= native.MAX_SEQUENCES_PER_PACK:
            raise DataError(f"max_sequences_per_pack={max_sequences_per_pack} must be in "
                            f"0..{native.MAX_SEQUENCES_PER_PACK}")
        self.format = fmt
        self.seq_len, self.max_predictions, self.vocab_size = seq_len, max_predictions, vocab_size
        self.max_sequences_per_pack = max_sequences_per_pack
        self.id_dtype = None
        if fmt == "native":
            self.id_dtype = native.id_dtype_for(vocab_size if vocab_size is not None else id_bound)
            self.row_dtype = native.row_dtype(seq_len, max_predictions, self.id_dtype, max_sequences_per_pack)[0]
        self.layout = (fmt, seq_len, max_predictions, vocab_size,
                       None if self.id_dtype is None else self.id_dtype.str, max_sequences_per_pack)

    def check(self, arrays: Rows, where: str, first: int = 0) -> None:
        """A DataError naming ``where``, the record (``first`` + row) and the first bad value."""
        problem = _shape_problem(arrays, self.seq_len, self.max_predictions, self.max_sequences_per_pack)
        if problem:
            raise DataError(f"{where}: write() of rows {first}..: {problem}")
        for start in range(0, len(arrays.input_ids), _CHUNK_ROWS):
            problems = row_problems(arrays.take(slice(start, start + _CHUNK_ROWS)), self.seq_len,
                                    self.vocab_size)
            if problems:
                row, message = next(iter(problems.items()))
                raise DataError(f"{where}: record {first + start + row} "
                                f"(row {start + row} of this write): {message}")

    def encode(self, arrays: Rows, where: str = "records", first: int = 0,
               check: bool = True) -> EncodedRecords:
        """The records of all rows of ``arrays``, checked first unless ``check`` is False.

        Memory is a few times the encoded size: callers bound the row count.
        """
        if check:
            self.check(arrays, where, first)
        n = len(arrays.input_ids)
        if n == 0:
            return EncodedRecords(self.layout, np.zeros(0, np.uint8), np.zeros(0, np.int64),
                                  np.zeros(0, np.int64))
        input_ids, masked_lm_ids = np.asarray(arrays.input_ids), np.asarray(arrays.masked_lm_ids)
        max_ids = np.maximum(input_ids.max(axis=1), masked_lm_ids.max(axis=1)).astype(np.int64)
        names = _features(self.max_sequences_per_pack)
        if self.format == "native":
            rows = native.to_rows(_canonical({_field(name): np.asarray(getattr(arrays, _field(name)))
                                              for name in names}, self.max_sequences_per_pack), self.row_dtype)
            data = rows.view(np.uint8).reshape(-1)
            ends = np.arange(1, n + 1, dtype=np.int64) * self.row_dtype.itemsize
        else:
            columns = {name: np.asarray(getattr(arrays, _field(name))).reshape(n, -1) for name in names}
            data, lengths = encode_frames(columns, _KINDS)
            ends = np.cumsum(lengths)
        return EncodedRecords(self.layout, data, ends, max_ids)


class RecordWriter:
    """Write records to ``path`` in ``fmt``, streaming: memory does not grow with the row count.

    Use as a context manager. Leaving the block normally completes the file
    and renames it into place; leaving it with an exception (or calling
    :meth:`abort`) removes the temporary and leaves nothing under ``path``.
    Every ``write`` is validated first (shapes, ids < ``vocab_size`` when
    given, positions < ``seq_len``, 0/1 masks, segments and labels); a bad
    write raises DataError and writes none of its rows. Writes of fewer than
    256 rows are gathered before encoding, so memory holds at most that many
    rows, or one write's rows, in 4096-row chunks. :meth:`write_encoded`
    appends records that a :class:`RecordEncoder` of the same layout made
    elsewhere (``self.encoder``), e.g. in worker processes.

    For the native format ``vocab_size`` (or ``id_bound``, a bound on the ids
    known in advance) also picks the id dtype: uint16 up to 65536, else int32.
    With ``max_sequences_per_pack`` the file holds packed rows (:class:`.packing.PackedArrays`).
    """

    def __init__(self, path: str | Path, fmt: str, seq_len: int, max_predictions: int,
                 vocab_size: int | None = None, *, id_bound: int | None = None,
                 max_sequences_per_pack: int = 0):
        self.encoder = RecordEncoder(fmt, seq_len, max_predictions, vocab_size, id_bound=id_bound,
                                     max_sequences_per_pack=max_sequences_per_pack)
        self.path = Path(path)
        self.format = fmt
        self.seq_len, self.max_predictions, self.vocab_size = seq_len, max_predictions, vocab_size
        self.count = 0
        self._pending: list[Rows] = []  # validated rows not yet encoded
        self._pending_rows = 0
        with contextlib.ExitStack() as stack:
            tmp = stack.enter_context(atomic_file(self.path))
            self._file = stack.enter_context(open(tmp, "wb"))
            self._native = None
            if fmt == "native":
                assert self.encoder.id_dtype is not None  # a native encoder picks one
                self._native = native.NativeWriter(self._file, seq_len, max_predictions,
                                                   self.encoder.id_dtype, vocab_size, max_sequences_per_pack)
            self._stack = stack.pop_all()
        self._open = True

    def write(self, arrays: Rows) -> None:
        """Append the rows of ``arrays`` (any integer dtypes; weights any float dtype)."""
        self._check_open()
        self.encoder.check(arrays, str(self.path), self.count)  # all rows before writing any
        n = len(arrays.input_ids)
        self.count += n
        if n >= _MIN_ENCODE_ROWS:
            self._flush()
            self._encode(arrays)
        elif n:  # small writes are gathered (copied: the caller may reuse its arrays); encoding has a fixed cost
            self._pending.append(type(arrays)(**{f.name: np.array(getattr(arrays, f.name)) for f in fields(arrays)}))
            self._pending_rows += n
            if self._pending_rows >= _MIN_ENCODE_ROWS:
                self._flush()

    def write_encoded(self, records: EncodedRecords) -> None:
        """Append records encoded (and validated) by a :class:`RecordEncoder` of this layout."""
        self.write_encoded_bytes(records.layout, records.data, len(records),
                                 int(records.max_ids.max(initial=-1)))

    def write_encoded_bytes(self, layout: tuple, data: np.ndarray, count: int, max_id: int) -> None:
        """Append ``count`` whole records, ``data`` (uint8), that an encoder of ``layout`` made.

        :meth:`write_encoded` without the per-record arrays: for records that
        come as bytes from a file, with only their count and largest token id.
        """
        self._check_open()
        if layout != self.encoder.layout:
            raise ValueError(f"{self.path}: records encoded for {layout} do not fit "
                             f"this file ({self.encoder.layout})")
        self._flush()
        self.count += count
        self._append_bytes(data, count, max_id)

    def _check_open(self) -> None:
        if not self._open:
            raise ValueError(f"{self.path}: the writer is closed")

    def _flush(self) -> None:
        if self._pending:
            self._encode(concat_rows(self._pending))
            self._pending, self._pending_rows = [], 0

    def _encode(self, arrays: Rows) -> None:
        for start in range(0, len(arrays.input_ids), _CHUNK_ROWS):
            self._append(self.encoder.encode(arrays.take(slice(start, start + _CHUNK_ROWS)),
                                              check=False))

    def _append(self, records: EncodedRecords) -> None:
        self._append_bytes(records.data, len(records), int(records.max_ids.max(initial=-1)))

    def _append_bytes(self, data: np.ndarray, count: int, max_id: int) -> None:
        if not count:
            return
        if self._native is not None:
            self._native.append(data, count, max_id)
        else:
            # numpy's stubs give ndarray its __buffer__ only for Python >= 3.12; it is a buffer on every version
            self._file.write(data)  # type: ignore[arg-type]

    def close(self) -> Path:
        """Complete the file and move it into place."""
        if self._open:
            self._flush()
            self._open = False
            if self._native is not None:
                self._native.finish()
            self._stack.close()
        return self.path

    def abort(self) -> None:
        """Give up: remove the temporary file; nothing appears under ``path``."""
        if self._open:
            self._open = False
            self._stack.__exit__(_Abort, _Abort(), None)

    def __enter__(self) -> RecordWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        elif self._open:
            self._open = False
            self._stack.__exit__(exc_type, exc, tb)


def write_records(path: str | Path, arrays: Rows, fmt: str = "tfrecord",
                  vocab_size: int | None = None) -> Path:
    """Write all of ``arrays`` (unpacked or packed rows) to one file; returns its path."""
    seq_len = np.asarray(arrays.input_ids).shape[1]
    slots = arrays.max_sequences_per_pack if isinstance(arrays, PackedArrays) else 0
    max_predictions = np.asarray(arrays.masked_lm_positions).shape[1] - max(slots - 1, 0)
    id_bound = None
    if vocab_size is None and len(arrays):  # the native id dtype can follow the data
        id_bound = 1 + max(int(np.max(arrays.input_ids)), int(np.max(arrays.masked_lm_ids)))
    with RecordWriter(path, fmt, seq_len, max_predictions, vocab_size, id_bound=id_bound,
                      max_sequences_per_pack=slots) as writer:
        writer.write(arrays)
    return Path(path)


# ---------------------------------------------------------------- reading

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
    if path.suffix in _TFRECORD_SUFFIXES:
        return "tfrecord"
    if path.suffix == SUFFIXES["native"]:
        return "native"
    raise DataError(f"{path}: neither a TFRecord nor a bertforge native record file "
                    f"(first bytes: {head[:8].hex(' ') or 'none, the file is empty'})")


class RecordFile:
    """Random access to the records of one file, either format.

    ``take(indices)`` returns those rows, in that order, as PretrainingArrays
    (repeats allowed), or PackedArrays when ``max_sequences_per_pack`` is not 0
    (``max_predictions`` is then per sequence, as Graphcore's ``--mask-tokens``).
    ``skipped`` counts bad records passed over when opened with ``max_bad`` > 0;
    ``errors`` holds the first few of their messages.
    """

    path: Path
    format: str
    seq_len: int
    max_predictions: int
    max_sequences_per_pack: int  # 0: unpacked rows
    header_vocab_size: int | None  # the vocab size the file says it was written for (native only)
    skipped: int
    errors: list[str]

    def __len__(self) -> int:
        raise NotImplementedError

    def take(self, indices) -> Rows:
        raise NotImplementedError

    def offset(self, index: int) -> int:
        """Byte offset of record ``index`` in the file."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def _indices(self, indices) -> np.ndarray:
        rows = np.asarray(indices, dtype=np.int64).reshape(-1)
        if rows.size and (rows.min() < 0 or rows.max() >= len(self)):
            bad = int(rows[(rows < 0) | (rows >= len(self))][0])
            raise IndexError(f"{self.path}: record index {bad} out of range for {len(self)} records")
        return rows

    def _check(self, arrays: Rows, rows: np.ndarray, vocab_size: int | None) -> None:
        problems = row_problems(arrays, self.seq_len, vocab_size)
        if problems:
            row, message = next(iter(problems.items()))
            index = int(rows[row])
            raise DataError(f"{self.path}: record {index} (byte offset {self.offset(index)}): {message}")

    def __enter__(self) -> RecordFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getstate__(self) -> dict:  # for loader worker processes: the memory map is not pickled
        return {k: v for k, v in vars(self).items() if k not in self._MAPPED}

    def __setstate__(self, state: dict) -> None:
        vars(self).update(state)
        self._map()

    _MAPPED: tuple[str, ...] = ()

    def _map(self) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        packed = f", max_sequences_per_pack={self.max_sequences_per_pack}" if self.max_sequences_per_pack else ""
        return (f"RecordFile({str(self.path)!r}, format={self.format!r}, records={len(self)}, "
                f"seq_len={self.seq_len}, max_predictions={self.max_predictions}{packed})")


def _mmap(path: Path) -> mmap.mmap | bytes:
    if path.stat().st_size == 0:
        return b""  # mmap cannot map an empty file
    with open(path, "rb") as file:
        return mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)


def _unmap(buffer) -> None:
    if isinstance(buffer, mmap.mmap):
        try:
            buffer.close()
        except BufferError:  # an array still views it; the map goes with the last reference
            pass


_MAX_ERRORS_KEPT = 10
# The features whose value counts give the shapes: (seq_len, max_predictions), packed (seq_len, width, S).
_SHAPE_FEATURES = (("input_ids", "masked_lm_positions"),
                   ("packed_input_ids", "packed_masked_lm_positions", "packed_next_sentence_labels"))


class TFRecordFile(RecordFile):
    """A TFRecord file: the frame offsets are found by one scan when opened."""

    _MAPPED = ("_buffer", "_data")

    def __init__(self, path: Path, *, verify: bool = True, max_bad: int = 0,
                 vocab_size: int | None = None):
        self.path, self.format = Path(path), "tfrecord"
        self.verify, self.max_bad, self.vocab_size = verify, max_bad, vocab_size
        self.seq_len = self.max_predictions = self.max_sequences_per_pack = 0
        self.header_vocab_size = None  # TFRecords declare none
        self.skipped, self.errors = 0, []
        self._map()
        try:
            self._scan()
        except BaseException:
            self.close()
            raise

    def _map(self) -> None:
        self._buffer = _mmap(self.path)
        self._data = np.frombuffer(self._buffer, np.uint8)

    def __len__(self) -> int:
        return len(self._starts)

    def offset(self, index: int) -> int:
        return int(self._starts[index]) - HEADER_BYTES

    def close(self) -> None:
        self._data = np.zeros(0, np.uint8)
        _unmap(self._buffer)

    # -- opening

    def _bad(self, number: int, offset: int, message: str) -> None:
        text = f"{self.path}: record {number} (byte offset {offset}): {message}"
        self.skipped += 1
        if len(self.errors) < _MAX_ERRORS_KEPT:
            self.errors.append(text)
        if self.skipped > self.max_bad:
            if self.max_bad:
                text += f" ({self.skipped} bad records, more than max_bad={self.max_bad})"
            raise DataError(text)

    def _scan(self) -> None:
        """Find every record; with ``verify``, check checksums and decode and check every record.

        Records are checked a chunk at a time as the scan goes, so the file is
        read once and memory holds one chunk besides the offsets.
        """
        size = len(self._data)
        kept: list[np.ndarray] = [np.zeros((0, 3), np.int64)]  # (file order number, offset, data length)
        pending = array("q")
        position = number = 0
        while position < size:
            try:
                length, end = read_frame(self._buffer, position, size, self.verify)
            except LengthError as err:
                raise DataError(f"{self.path}: record {number} (byte offset {position}): {err}; "
                                "the records after it cannot be located") from None
            except TruncatedError as err:
                self._bad(number, position, str(err))
                break
            except ChecksumError as err:
                self._bad(number, position, str(err))
                end = err.end
            else:
                pending.extend((number, position, length))
            position, number = end, number + 1
            if len(pending) == 3 * _CHUNK_ROWS:
                kept.append(self._checked(np.frombuffer(pending, np.int64).reshape(-1, 3).copy()))
                pending = array("q")
        if pending:
            kept.append(self._checked(np.frombuffer(pending, np.int64).reshape(-1, 3).copy()))
        frames = np.concatenate(kept)
        self._numbers, self._starts, self._lengths = frames[:, 0], frames[:, 1] + HEADER_BYTES, frames[:, 2]

    def _checked(self, frames: np.ndarray) -> np.ndarray:
        """The frames whose records decode and validate (all of them without ``verify``)."""
        starts, lengths = frames[:, 1] + HEADER_BYTES, frames[:, 2]
        if self.seq_len == 0:
            self._infer_shape(starts, lengths)
        if not self.verify:
            return frames
        _, problems = self._decode(starts, lengths)
        for row, message in problems.items():
            self._bad(int(frames[row, 0]), int(frames[row, 1]), message)
        return np.delete(frames, list(problems), axis=0)

    def _unreadable(self, start: int, length: int) -> str:
        """Why a record gives no seq_len and max_predictions."""
        try:
            features = example_features(self._buffer, start, start + length, _KINDS)
        except (FormatError, IndexError) as err:
            return f"not a valid tf.train.Example ({err or 'a field runs past its end'})"
        names = _SHAPE_FEATURES[1 if "packed_input_ids" in features else 0]
        for name in names:
            kind, first, last = features.get(name, (None, 0, 0))
            if kind != INT64 or first == last:
                return f"feature {name} is missing or not a non-empty {INT64}"
        return f"the {' or '.join(names)} values are malformed or do not fit together"

    def _infer_shape(self, starts: np.ndarray, lengths: np.ndarray) -> None:
        """seq_len, max_predictions (and, packed, max_sequences_per_pack) from the first record
        that decodes: it has Graphcore's packed features or the reference's."""
        for start, length in zip(starts.tolist(), lengths.tolist()):
            try:
                features = example_features(self._buffer, start, start + length, _KINDS)
                packed = "packed_input_ids" in features
                spans = [features[name] for name in _SHAPE_FEATURES[packed]]
            except (FormatError, IndexError, KeyError):
                continue
            counts = [int((self._data[a:b] < 0x80).sum()) for _, a, b in spans]
            if not all(kind == INT64 for kind, _, _ in spans) or min(counts) == 0:
                continue
            if not packed:
                self.seq_len, self.max_predictions = counts
                return
            seq_len, width, slots = counts
            if 1 <= slots <= native.MAX_SEQUENCES_PER_PACK and width >= slots:
                self.seq_len, self.max_predictions, self.max_sequences_per_pack = seq_len, width - slots + 1, slots
                return

    def _decode(self, starts: np.ndarray, lengths: np.ndarray) -> tuple[Rows, dict[int, str]]:
        """The records at these data offsets decoded, and a message for each that is invalid (zeros there)."""
        slots = self.max_sequences_per_pack
        features = _features(slots)
        if self.seq_len == 0:  # no record so far had readable input_ids and masked_lm_positions
            empty = {_field(name): np.zeros((len(starts), 1), np.int64) for name in features}
            return _canonical(empty), {i: self._unreadable(start, length) for i, (start, length)
                                       in enumerate(zip(starts.tolist(), lengths.tolist()))}
        kinds, first, last, fast = example_spans(self._data, starts, starts + lengths, features)
        problems: dict[int, str] = {}
        for i in np.flatnonzero(~fast).tolist():  # unusual layouts: the general parser
            start = int(starts[i])
            try:
                found = example_features(self._buffer, start, start + int(lengths[i]), _KINDS)
            except (FormatError, IndexError) as err:
                problems[i] = f"not a valid tf.train.Example ({err or 'a field runs past its end'})"
                continue
            for j, name in enumerate(_features(slots)):
                kind, first[i, j], last[i, j] = found.get(name, (None, 0, 0))
                kinds[i, j] = 0 if kind is None else _ONEOF_FIELD.get(kind, 0)
        for j, name in enumerate(features):
            expected = _ONEOF_FIELD[_KINDS[name]]
            for i in np.flatnonzero(kinds[:, j] != expected).tolist():
                if i not in problems:
                    problems[i] = (f"feature {name} is missing or holds no list" if kinds[i, j] == 0 else
                                   f"feature {name} is a {_ONEOF_NAME[kinds[i, j]]}, "
                                   f"expected {_KINDS[name]}")
        columns = {}
        for j, name in enumerate(features):
            width = _width(name, self.seq_len, self.max_predictions, slots)
            decode = decode_float_rows if _KINDS[name] == FLOAT else decode_varint_rows
            columns[name], counts = decode(self._data, first[:, j], last[:, j] - first[:, j], width)
            for i in np.flatnonzero(counts != width).tolist():
                if i not in problems:
                    packed = f", max_sequences_per_pack {slots}" if slots else ""
                    problems[i] = (f"feature {name} holds malformed values" if counts[i] < 0 else
                                   f"feature {name} has {counts[i]} values, expected {width} "
                                   f"(seq_len {self.seq_len}, max_predictions {self.max_predictions}{packed} "
                                   "as in the file's first record)")
        raw = arrays_class(slots)(**{_field(name): columns[name] for name in features})
        if not slots:
            raw.next_sentence_labels = raw.next_sentence_labels[:, 0]
        for i, message in row_problems(raw, self.seq_len, self.vocab_size).items():
            problems.setdefault(i, message)
        return _canonical(vars(raw), slots), dict(sorted(problems.items()))

    # -- reading

    def take(self, indices) -> Rows:
        rows = self._indices(indices)
        parts = []
        for start in range(0, max(len(rows), 1), _CHUNK_ROWS):
            chunk = rows[start:start + _CHUNK_ROWS]
            arrays, problems = self._decode(self._starts[chunk], self._lengths[chunk])
            if problems:
                row, message = next(iter(problems.items()))
                index = int(chunk[row])
                raise DataError(f"{self.path}: record {self._numbers[index]} "
                                f"(byte offset {self.offset(index)}): {message}")
            parts.append(arrays)
        return parts[0] if len(parts) == 1 else concat_rows(parts)


class NativeFile(RecordFile):
    """A native file: header read when opened, rows memory-mapped."""

    _MAPPED = ("_buffer", "_rows")

    def __init__(self, path: Path, *, verify: bool = True, vocab_size: int | None = None):
        self.path, self.format = Path(path), "native"
        self.vocab_size = vocab_size
        self.skipped, self.errors = 0, []
        size = self.path.stat().st_size
        with open(self.path, "rb") as file:
            try:
                self.header = native.read_header(file, size)
            except ValueError as err:  # read_header checks every field: nothing else escapes it
                raise DataError(f"{self.path}: {err}") from None
        self.seq_len, self.max_predictions = self.header.seq_len, self.header.max_predictions
        self.max_sequences_per_pack = self.header.max_sequences_per_pack
        self.header_vocab_size = self.header.vocab_size
        self._map()
        try:
            problem = self.problem(verify, vocab_size)
            if problem:
                raise DataError(f"{self.path}: {problem}")
        except BaseException:
            self.close()
            raise

    def _map(self) -> None:
        self._buffer = _mmap(self.path)
        data = np.frombuffer(self._buffer, np.uint8, count=self.header.count * self.header.dtype.itemsize,
                             offset=native.DATA_OFFSET)
        self._rows = data.view(self.header.dtype)

    def problem(self, verify: bool = True, vocab_size: int | None = None) -> str | None:
        """What is wrong with the rows (their block checksums, with ``verify``) or with their token
        ids for ``vocab_size`` (the header's vocab size, then each id); None when nothing is."""
        if verify:
            bad = native.bad_block(self._rows.view(np.uint8), self.header)
            if bad is not None:
                return (f"corrupt data in the block at byte offset {native.DATA_OFFSET + bad} "
                        "(its checksum does not match)")
        if vocab_size is None:
            return None
        if self.header.vocab_size is not None and self.header.vocab_size != vocab_size:
            return (f"written for a vocab of {self.header.vocab_size} tokens (the header's vocab_size), "
                    f"read with vocab_size {vocab_size}")
        if self.header.max_id >= vocab_size:
            for start in range(0, len(self), _CHUNK_ROWS):  # find the record to name it
                rows = np.arange(start, min(start + _CHUNK_ROWS, len(self)))
                problems = row_problems(native.from_rows(self._rows[rows], self.seq_len,
                                                         self.max_sequences_per_pack), self.seq_len, vocab_size)
                if problems:
                    row, message = next(iter(problems.items()))
                    index = int(rows[row])
                    return f"record {index} (byte offset {self.offset(index)}): {message}"
            return f"the header says token id {self.header.max_id} occurs, not below vocab_size {vocab_size}"
        return None

    def __len__(self) -> int:
        return self.header.count

    def offset(self, index: int) -> int:
        return native.DATA_OFFSET + index * self.header.dtype.itemsize

    def close(self) -> None:
        self._rows = np.zeros(0, self.header.dtype)
        _unmap(self._buffer)

    def take(self, indices) -> Rows:
        rows = self._indices(indices)
        arrays = native.from_rows(self._rows[rows], self.seq_len, self.max_sequences_per_pack)
        self._check(arrays, rows, self.vocab_size)  # cheap, and catches damage when not verified
        return arrays


def open_records(path: str | Path, *, verify: bool = True, max_bad: int = 0,
                 vocab_size: int | None = None) -> RecordFile:
    """Open a record file of either format for random access.

    ``verify``: TFRecord -- check both checksums and decode and validate every
    record now (one pass over the file, ~50k records/s on one core); without
    it only each frame's length and the length's checksum are read, and
    records are decoded and validated when taken. Native -- check the crc32c
    of every 16 MiB block of rows (one pass at about the speed of reading the
    file); without it only the header's own checksum and the sizes. ``take``
    always validates the values it returns. ``max_bad``: how many bad TFRecord
    records may be skipped (counted in ``skipped``) before it is an error; a
    damaged native file is always an error. ``vocab_size``: token ids must be
    below it.
    """
    path = Path(path)
    fmt = detect_format(path)
    if fmt == "native":
        return NativeFile(path, verify=verify, vocab_size=vocab_size)
    return TFRecordFile(path, verify=verify, max_bad=max_bad, vocab_size=vocab_size)


def read_records(path: str | Path, **kwargs) -> Rows:
    """Every record of a file (keyword arguments as :func:`open_records`)."""
    with open_records(path, **kwargs) as records:
        return records.take(np.arange(len(records)))


# ---------------------------------------------------------------- index and inspection

def index_path_for(tfrecord_path: str | Path) -> Path:
    """Where a TFRecord's index goes: ``x.tfrecord`` → ``x.index``; other names get ``.index`` added."""
    path = Path(tfrecord_path)
    if path.suffix in _TFRECORD_SUFFIXES:
        return path.with_suffix(".index")
    return path.with_name(path.name + ".index")


def write_index(tfrecord_path: str | Path, index_path: str | Path | None = None) -> Path:
    """Write the ``tfrecord`` package's index (``tfrecord2idx``): "offset length" per record.

    The length covers the whole frame (header, data, checksum). Lengths and
    their checksums are checked; the data is not read.
    """
    path = Path(tfrecord_path)
    index = Path(index_path) if index_path is not None else index_path_for(path)
    if detect_format(path) != "tfrecord":
        raise DataError(f"{path}: not a TFRecord file, so it has no index")
    buffer = _mmap(path)
    lines: list[str] = []
    try:
        position, size = 0, len(buffer)
        while position < size:
            try:
                _, end = read_frame(buffer, position, size, verify=False)
            except FormatError as err:
                raise DataError(f"{path}: record {len(lines)} (byte offset {position}): {err}") from None
            lines.append(f"{position} {end - position}\n")
            position = end
    finally:
        _unmap(buffer)
    with atomic_file(index) as tmp:
        tmp.write_text("".join(lines), encoding="ascii")
    return index


def _token(vocab: list[str] | None, token_id: int) -> str:
    if vocab is None:
        return str(token_id)
    return vocab[token_id] if 0 <= token_id < len(vocab) else f"<{token_id}?>"


def describe(path: str | Path, num: int = 3, vocab_path: str | Path | None = None) -> str:
    """What ``bertforge data inspect`` prints: count, validation, and ``num`` records as text.

    Without a vocab the tokens are shown as ids. In each record the masked
    positions are listed as ``position shown→target``; a packed record is shown
    as its sequences. The last line gives the packing factor (real sequences
    per row) and the padding fraction of the whole file.
    """
    return inspect_records(path, num, vocab_path)[0]


def inspect_records(path: str | Path, num: int = 3,
                    vocab_path: str | Path | None = None) -> tuple[str, bool]:
    """(:func:`describe`'s text, whether validation passed).

    A file that cannot be opened at all (not a record file, a damaged native
    header, a TFRecord whose framing is lost) is a DataError; a file that opens
    but has bad records or data (checksums, values, token ids beyond the vocab)
    fails validation: the text says which, and the records that can be read are shown.
    """
    from .tokenizer import read_vocab

    vocab = read_vocab(vocab_path) if vocab_path else None
    vocab_size = len(vocab) if vocab else None
    failure = None
    records: RecordFile
    if detect_format(path) == "native":  # open on the header alone, then validate
        records = native_file = NativeFile(Path(path), verify=False)
        problem = native_file.problem(verify=True, vocab_size=vocab_size)
        if problem:
            failure = f"validation: FAILED: {path}: {problem}"
    else:
        records = open_records(path, verify=True, max_bad=sys.maxsize, vocab_size=vocab_size)
        if records.skipped:
            failure = (f"validation: FAILED for {records.skipped} record(s), which a reader skips "
                       f"only with max_bad >= {records.skipped}; first: {records.errors[0]}")
    with records:
        slots = records.max_sequences_per_pack
        packed = f", packed: up to {slots} sequences per record" if slots else ""
        lines = [(f"{path}: {records.format}, {len(records)} records, seq_len {records.seq_len}, "
                  f"max_predictions {records.max_predictions}{packed}")]
        checked = ("both checksums and every feature of every record" if records.format == "tfrecord"
                   else "header and data checksums")
        if vocab_size:
            checked += f", token ids below vocab_size {vocab_size}"
        lines.append(failure or f"validation: OK ({checked})")
        for index in range(min(num, len(records))):
            try:
                row = records.take([index])
            except DataError as err:  # a damaged native row: say so, show no more
                lines.append(f"record {index}: {err}")
                break
            sequences = unpack_rows(row) if isinstance(row, PackedArrays) else row
            for k in range(len(sequences)):
                a = sequences.take([k])
                length = int(a.input_mask[0].sum())
                ids = a.input_ids[0, :length].tolist()
                segment_b = int(np.argmax(a.segment_ids[0, :length])) if a.segment_ids[0].any() else length
                label = int(a.next_sentence_labels[0])
                real = a.masked_lm_weights[0] > 0
                which = f", sequence {k + 1} of {len(sequences)}" if slots else ""
                lines.append(f"record {index} (byte offset {records.offset(index)}{which}): next_sentence_label "
                             f"{label} ({'B is a random span' if label else 'B follows A'}), {length} tokens, "
                             f"{int(real.sum())} masked")
                lines.append("  A: " + " ".join(_token(vocab, t) for t in ids[:segment_b]))
                lines.append("  B: " + " ".join(_token(vocab, t) for t in ids[segment_b:]))
                targets = [f"{p} {_token(vocab, ids[p] if p < length else 0)}→{_token(vocab, t)}"
                           for p, t in zip(a.masked_lm_positions[0][real].tolist(),
                                           a.masked_lm_ids[0][real].tolist())]
                lines.append("  masked: " + ", ".join(targets))
        lines.append(_packing_line(records))
    return "\n".join(lines), failure is None


def _packing_line(records: RecordFile) -> str:
    """The packing factor and padding fraction of every record that can be read."""
    stats = PackingStats()
    try:
        for start in range(0, len(records), _CHUNK_ROWS):
            stats.add(records.take(np.arange(start, min(start + _CHUNK_ROWS, len(records)))))
    except DataError:  # damaged rows (already reported above)
        return "packing: not counted (the file has damaged records)"
    return f"packing: {stats.summary()}"


__all__ = ["FEATURES", "FORMATS", "SUFFIXES", "EncodedRecords", "NativeFile", "RecordEncoder", "RecordFile",
           "RecordWriter", "TFRecordFile",
           "describe", "detect_format", "index_path_for", "inspect_records", "open_records", "read_records",
           "row_problems", "write_index", "write_records"]
