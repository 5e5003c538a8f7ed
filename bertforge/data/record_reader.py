"""Reading record files of either format (:mod:`.record_schema`), with random access.

:func:`open_records` gives a :class:`RecordFile` whose ``take`` returns any rows.
For TFRecords, opening with ``verify=True`` (the default) reads the whole file
once: both checksums of every record and every feature are checked, and bad
records are an error naming the file and byte offset, or, with ``max_bad`` > 0,
skipped and counted. :func:`write_index` writes the ``tfrecord`` package's index
of a TFRecord file.
"""

from __future__ import annotations

import json
import mmap
from array import array
from pathlib import Path

import numpy as np

from bertforge.fileio import atomic_file

from . import native
from .errors import DataError
from .record_schema import (
    CHUNK_ROWS,
    KINDS,
    TFRECORD_SUFFIXES,
    canonical,
    detect_format,
    features_of,
    field_of,
    row_problems,
    tokenizer_sidecar,
    width_of,
)
from .rows import Rows, arrays_class, concat_rows
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
    example_features,
    example_spans,
    read_frame,
)


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
    header_tokenizer: dict | None  # the tokenizer that made it, as a native header or a TFRecord's sidecar says
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


_ONEOF_FIELD = {BYTES: 1, FLOAT: 2, INT64: 3}  # Feature's oneof field numbers
_ONEOF_NAME = {number: kind for kind, number in _ONEOF_FIELD.items()}
_MAX_ERRORS_KEPT = 10
# The features whose value counts give the shapes: (seq_len, max_predictions), packed (seq_len, width, S).
_SHAPE_FEATURES = (("input_ids", "masked_lm_positions"),
                   ("packed_input_ids", "packed_masked_lm_positions", "packed_next_sentence_labels"))


def read_tokenizer_sidecar(path: Path) -> dict | None:
    """The tokenizer that made the TFRecord file ``path``, as its sidecar says (``data create`` writes
    one); None without a sidecar (TFRecords of other tools); a DataError naming a damaged one."""
    sidecar = tokenizer_sidecar(Path(path))
    try:
        text = sidecar.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        return native.tokenizer_identity(json.loads(text).get("tokenizer"), "field")
    except (ValueError, AttributeError) as err:  # not JSON, not an object, a bad field
        raise DataError(f"{sidecar}: not the tokenizer of {Path(path).name} ({err})") from None


class TFRecordFile(RecordFile):
    """A TFRecord file: the frame offsets are found by one scan when opened."""

    _MAPPED = ("_buffer", "_data")

    def __init__(self, path: Path, *, verify: bool = True, max_bad: int = 0,
                 vocab_size: int | None = None):
        self.path, self.format = Path(path), "tfrecord"
        self.verify, self.max_bad, self.vocab_size = verify, max_bad, vocab_size
        self.seq_len = self.max_predictions = self.max_sequences_per_pack = 0
        self.header_vocab_size = None  # TFRecords declare none
        self.header_tokenizer = read_tokenizer_sidecar(self.path)  # data create writes one beside them
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
            if len(pending) == 3 * CHUNK_ROWS:
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
            features = example_features(self._buffer, start, start + length, KINDS)
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
                features = example_features(self._buffer, start, start + length, KINDS)
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
        features = features_of(slots)
        if self.seq_len == 0:  # no record so far had readable input_ids and masked_lm_positions
            empty = {field_of(name): np.zeros((len(starts), 1), np.int64) for name in features}
            return canonical(empty), {i: self._unreadable(start, length) for i, (start, length)
                                       in enumerate(zip(starts.tolist(), lengths.tolist()))}
        kinds, first, last, fast = example_spans(self._data, starts, starts + lengths, features)
        problems: dict[int, str] = {}
        for i in np.flatnonzero(~fast).tolist():  # unusual layouts: the general parser
            start = int(starts[i])
            try:
                found = example_features(self._buffer, start, start + int(lengths[i]), KINDS)
            except (FormatError, IndexError) as err:
                problems[i] = f"not a valid tf.train.Example ({err or 'a field runs past its end'})"
                continue
            for j, name in enumerate(features_of(slots)):
                kind, first[i, j], last[i, j] = found.get(name, (None, 0, 0))
                kinds[i, j] = 0 if kind is None else _ONEOF_FIELD.get(kind, 0)
        for j, name in enumerate(features):
            expected = _ONEOF_FIELD[KINDS[name]]
            for i in np.flatnonzero(kinds[:, j] != expected).tolist():
                if i not in problems:
                    problems[i] = (f"feature {name} is missing or holds no list" if kinds[i, j] == 0 else
                                   f"feature {name} is a {_ONEOF_NAME[kinds[i, j]]}, "
                                   f"expected {KINDS[name]}")
        columns = {}
        for j, name in enumerate(features):
            width = width_of(name, self.seq_len, self.max_predictions, slots)
            decode = decode_float_rows if KINDS[name] == FLOAT else decode_varint_rows
            columns[name], counts = decode(self._data, first[:, j], last[:, j] - first[:, j], width)
            for i in np.flatnonzero(counts != width).tolist():
                if i not in problems:
                    packed = f", max_sequences_per_pack {slots}" if slots else ""
                    problems[i] = (f"feature {name} holds malformed values" if counts[i] < 0 else
                                   f"feature {name} has {counts[i]} values, expected {width} "
                                   f"(seq_len {self.seq_len}, max_predictions {self.max_predictions}{packed} "
                                   "as in the file's first record)")
        raw = arrays_class(slots)(**{field_of(name): columns[name] for name in features})
        if not slots:
            raw.next_sentence_labels = raw.next_sentence_labels[:, 0]
        for i, message in row_problems(raw, self.seq_len, self.vocab_size).items():
            problems.setdefault(i, message)
        return canonical(vars(raw), slots), dict(sorted(problems.items()))

    # -- reading

    def take(self, indices) -> Rows:
        rows = self._indices(indices)
        parts = []
        for start in range(0, max(len(rows), 1), CHUNK_ROWS):
            chunk = rows[start:start + CHUNK_ROWS]
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
        self.header_tokenizer = self.header.tokenizer
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
            # The header's max_id (below its vocab_size) is what readers trust to bound the ids
            # without reading them: a header that claims less than the rows hold is refused.
            for start in range(0, len(self), CHUNK_ROWS):
                rows = self._rows[start:start + CHUNK_ROWS]
                largest = np.maximum(rows["input_ids"].max(axis=1, initial=0),
                                     rows["masked_lm_ids"].max(axis=1, initial=0))
                over = np.flatnonzero(largest > self.header.max_id)
                if over.size:
                    index = start + int(over[0])
                    return (f"record {index} (byte offset {self.offset(index)}): token id {int(largest[over[0]])} "
                            f"above the header's max_id {self.header.max_id} (a header edited or written for "
                            f"other rows)")
        if vocab_size is None:
            return None
        if self.header.vocab_size is not None and self.header.vocab_size != vocab_size:
            return (f"written for a vocab of {self.header.vocab_size} tokens (the header's vocab_size), "
                    f"read with vocab_size {vocab_size}")
        if self.header.max_id >= vocab_size:
            for start in range(0, len(self), CHUNK_ROWS):  # find the record to name it
                rows = np.arange(start, min(start + CHUNK_ROWS, len(self)))
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


def index_path_for(tfrecord_path: str | Path) -> Path:
    """Where a TFRecord's index goes: ``x.tfrecord`` → ``x.index``; other names get ``.index`` added."""
    path = Path(tfrecord_path)
    if path.suffix in TFRECORD_SUFFIXES:
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


