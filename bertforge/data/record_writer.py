"""Writing record files of either format (:mod:`.record_schema`).

:class:`RecordWriter` (and :func:`write_records`) validates every row and
streams to a hidden temporary file that is renamed into place only when
complete; :class:`RecordEncoder` validates and encodes rows apart from any file,
so that worker processes can encode and a writer only copies bytes.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from bertforge.fileio import atomic_file

from . import native
from .errors import DataError
from .record_schema import (
    CHUNK_ROWS,
    FORMATS,
    KINDS,
    _shape_problem,
    canonical,
    features_of,
    field_of,
    row_problems,
    tokenizer_sidecar,
)
from .rows import PackedArrays, Rows, concat_rows
from .tfrecord import (
    encode_frames,
    ragged_gather,
)

_MIN_ENCODE_ROWS = 256  # a writer gathers smaller writes up to this many rows before encoding



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
    the rows are packed (:class:`.rows.PackedArrays`, ``max_predictions``
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
        for start in range(0, len(arrays.input_ids), CHUNK_ROWS):
            problems = row_problems(arrays.take(slice(start, start + CHUNK_ROWS)), self.seq_len,
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
        names = features_of(self.max_sequences_per_pack)
        if self.format == "native":
            rows = native.to_rows(canonical({field_of(name): np.asarray(getattr(arrays, field_of(name)))
                                              for name in names}, self.max_sequences_per_pack), self.row_dtype)
            data = rows.view(np.uint8).reshape(-1)
            ends = np.arange(1, n + 1, dtype=np.int64) * self.row_dtype.itemsize
        else:
            columns = {name: np.asarray(getattr(arrays, field_of(name))).reshape(n, -1) for name in names}
            data, lengths = encode_frames(columns, KINDS)
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
    known in advance) also picks the id dtype: uint16 up to 65536, else int32,
    and ``tokenizer`` (:meth:`.vocab.Vocabulary.identity`), when given, goes
    into the header; a TFRecord has no header, so it goes into a sidecar file beside it
    (:func:`.record_schema.tokenizer_sidecar`), written atomically with it. With
    ``max_sequences_per_pack`` the file holds packed rows (:class:`.rows.PackedArrays`).
    """

    def __init__(self, path: str | Path, fmt: str, seq_len: int, max_predictions: int,
                 vocab_size: int | None = None, *, id_bound: int | None = None,
                 max_sequences_per_pack: int = 0, tokenizer: dict | None = None):
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
            if fmt == "tfrecord" and tokenizer is not None:  # the sidecar, in place just before the file
                sidecar = stack.enter_context(atomic_file(tokenizer_sidecar(self.path)))
                sidecar.write_text(json.dumps({"tokenizer": tokenizer}, indent=1) + "\n", encoding="utf-8")
            elif fmt == "tfrecord":  # an earlier file's sidecar would name another tokenizer
                tokenizer_sidecar(self.path).unlink(missing_ok=True)
            self._file = stack.enter_context(open(tmp, "wb"))
            self._native = None
            if fmt == "native":
                assert self.encoder.id_dtype is not None  # a native encoder picks one
                self._native = native.NativeWriter(self._file, seq_len, max_predictions, self.encoder.id_dtype,
                                                   vocab_size, max_sequences_per_pack, tokenizer)
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
        for start in range(0, len(arrays.input_ids), CHUNK_ROWS):
            self._append(self.encoder.encode(arrays.take(slice(start, start + CHUNK_ROWS)),
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
        """Complete the file and move it into place; on an error (a full disk) the file is
        closed and removed, and nothing appears under ``path``."""
        if self._open:
            self._open = False
            with self._stack:  # an error completing the file goes through atomic_file
                self._flush()
                if self._native is not None:
                    self._native.finish()
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

