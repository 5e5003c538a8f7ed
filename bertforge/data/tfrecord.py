"""TFRecord files of ``tf.train.Example`` protobufs, read and written without TensorFlow.

A TFRecord file is a sequence of frames::

    uint64 length (little endian) | uint32 masked crc32c(length bytes) | data | uint32 masked crc32c(data)

with ``masked(crc) = ((crc >> 15) | (crc << 17)) + 0xa282ead8 (mod 2**32)``. The data
of a pre-training record is a serialized ``tf.train.Example``::

    Example  { Features features = 1; }
    Features { map<string, Feature> feature = 1; }
    Feature  { oneof kind { BytesList bytes_list = 1; FloatList float_list = 2;
                            Int64List int64_list = 3; } }
    FloatList / Int64List { repeated float / int64 value = 1 [packed = true]; }

The protobuf wire format is encoded and decoded here by hand, for a whole batch
of records at once with numpy: encoding lays every record of a batch out in
one byte matrix (varints of token ids from a lookup table, a block of rows at
a time so that it stays in the CPU's cache) and keeps its used bytes; decoding
walks the Example headers of all records together (a record in an unusual
layout falls back to a general parser) and turns all their packed varints
into one array. The per-record Python work left is the data checksum, one C
call (google-crc32c: Google's crc32c library, using the CPU's crc32
instructions; Apache-2.0 like this project); the length checksums come from a
table of the lengths present.

Byte compatibility: for the same map order our Example bytes are identical to
protobuf's (tests check this on the 45 records of the shared sample file).
TensorFlow itself does not fix the order: its C++ map iterates in a per-message
hash order, so each of the 45 records of the sample file has its own key
order. We write the keys sorted, which is what protobuf's deterministic
serialization emits; readers (TensorFlow, the ``tfrecord`` package, ours)
accept any order.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Sequence

import google_crc32c
import numpy as np

log = logging.getLogger(__name__)

if google_crc32c.implementation != "c":  # its pure-Python fallback is ~1000x slower
    log.warning("google-crc32c has no compiled extension here: TFRecord checksums will be slow")

HEADER_BYTES = 12  # length + its crc
FOOTER_BYTES = 4  # crc of the data
_MASK_DELTA = 0xA282EAD8

INT64 = "int64_list"
FLOAT = "float_list"
BYTES = "bytes_list"
_KIND_OF_FIELD = {1: BYTES, 2: FLOAT, 3: INT64}  # Feature's oneof field numbers
_FIELD_OF_KIND = {kind: number for number, kind in _KIND_OF_FIELD.items()}

# Wire-format tag bytes: (field number << 3) | wire type, where 2 = length-delimited.
_TAG_LEN1 = 0x0A  # field 1, length-delimited
_TAG_LEN2 = 0x12  # field 2, length-delimited


class FormatError(ValueError):
    """Bytes that are not what they should be; the caller adds the file and offset."""


class LengthError(FormatError):
    """A frame's length is damaged: the frames after it cannot be found."""


class TruncatedError(FormatError):
    """The file ends inside a frame."""


class ChecksumError(FormatError):
    """A frame's data does not match its checksum; ``end`` is where the next frame starts."""

    def __init__(self, message: str, end: int):
        super().__init__(message)
        self.end = end


def masked_crc(data) -> int:
    """TFRecord's masked crc32c of a read-only bytes-like object."""
    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


# ---------------------------------------------------------------- encoding

def varint_sizes(values: np.ndarray) -> np.ndarray:
    """Bytes each value takes as a protobuf varint (negative int64 take 10), as uint8."""
    v = values.astype(np.int64, copy=False).view(np.uint64)
    sizes = np.ones(v.shape, np.uint8)
    top = int(v.max(initial=0))
    for shift in range(7, 64, 7):
        if top < 1 << shift:  # no value needs more bytes
            break
        sizes += v >= np.uint64(1 << shift)
    return sizes


# For values below 2**28 (up to 4 varint bytes) all bytes are made at once in
# a uint32: the 7-bit groups spread 8 bits apart, plus the continuation bits
# of a varint of that many bytes; viewed as little-endian bytes, that is the varint.
_CONTINUATION_BITS = np.array([0, 0, 0x80, 0x8080, 0x808080], "<u4")


def _spread_varints(values: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """The varints of values below 2**28 as little-endian uint32 (the first ``sizes`` bytes)."""
    v = values.astype("<u4")
    spread = (v & 0x7F) | ((v << 1) & 0x7F00) | ((v << 2) & 0x7F0000) | ((v << 3) & 0x7F000000)
    return spread | _CONTINUATION_BITS[sizes]


_SMALL = 1 << 16  # values below this are encoded by table lookup (token ids, lengths)
_SMALL_SIZES = varint_sizes(np.arange(_SMALL))
_SMALL_VARINTS = _spread_varints(np.arange(_SMALL), _SMALL_SIZES)
_USED_WORDS = np.array([0, 0x1, 0x101, 0x10101, 0x1010101], "<u4")  # the first s of 4 bytes, as bools
_BLOCK_BYTES = 1 << 20  # of the byte matrix filled at a time: about the CPU's L2 cache


class _Batch:
    """N records under construction: one (N, W) byte matrix, filled piece by piece, left to right.

    Each piece of an Example (a tag, a varint, a run of packed values) gets the
    columns its longest row needs; where rows need fewer, a mask marks the
    bytes that are real. Reading the matrix row by row through the mask gives
    every record, one after the other. Pieces are listed first, then the matrix
    is filled and read a block of rows at a time.

    A piece is ``(width, data, sizes)``: ``bytes``, the same in every row; an
    (N, W) uint8 array; (N, K) little-endian uint32 varints, of which value j of
    row i uses the first ``sizes[i, j]`` bytes; or (N, K, L) bytes, likewise
    (``sizes`` None: all used).
    """

    def __init__(self, n: int):
        self.n = n
        self.pieces: list[tuple[int, bytes | np.ndarray, np.ndarray | None]] = []

    def constant(self, data: bytes) -> None:
        previous = self.pieces[-1][1] if self.pieces else None
        if isinstance(previous, bytes):  # join neighbouring constants
            self.pieces.pop()
            data = previous + data
        self.pieces.append((len(data), data, None))

    def raw(self, block: np.ndarray) -> None:
        """(N, W) bytes, every one used."""
        self.pieces.append((block.shape[1], block, None))

    def varints(self, values: np.ndarray) -> np.ndarray:
        """Add the packed varints of (N, K) integers; returns each row's byte count."""
        n, k = values.shape
        if values.dtype.kind == "u" or (values.size and int(values.min()) >= 0):
            top = int(values.max(initial=0))
        else:
            top = -1  # negative: ten bytes each
        if 0 <= top < 0x80:  # masks, labels, short positions: a byte each
            self.raw(values.astype(np.uint8))
            return np.full(n, k, np.int64)
        if 0 <= top < 1 << 28:
            if top < _SMALL:  # token ids, lengths: from a table
                small = values.astype(np.intp, copy=False)
                sizes, words = _SMALL_SIZES[small], _SMALL_VARINTS[small]
            else:
                sizes = varint_sizes(values)
                words = _spread_varints(values, sizes)
            longest = int(sizes.max())
            if longest == int(sizes.min()):  # one size: no gaps, only its bytes
                self.pieces.append((k * longest, words.view(np.uint8).reshape(n, k, 4)[:, :, :longest],
                                    None))
            else:
                self.pieces.append((4 * k, words, sizes))
            return sizes.sum(axis=1, dtype=np.int64)
        # Large or negative values: one byte position at a time, in 64 bits.
        sizes = varint_sizes(values)
        v = values.astype(np.int64, copy=False).view(np.uint64)
        longest = int(sizes.max())
        lanes = np.empty((n, k, longest), np.uint8)
        for b in range(longest):
            lanes[:, :, b] = (v >> np.uint64(7 * b)) & np.uint64(0x7F)
            lanes[:, :, b] |= (sizes > b + 1).view(np.uint8) << np.uint8(7)  # continuation bit
        self.pieces.append((k * longest, lanes, sizes))
        return sizes.sum(axis=1, dtype=np.int64)

    def length(self, values: np.ndarray) -> None:
        """One varint per row."""
        self.varints(values.reshape(self.n, 1))

    def build(self) -> np.ndarray:
        """The used bytes of every row, one row after the other."""
        width = sum(piece[0] for piece in self.pieces)
        # A few hundred KB of rows at a time: the pieces are filled column by
        # column, which is fast only while the block stays in the CPU's cache.
        step = max(1, _BLOCK_BYTES // width)
        matrix = np.empty((min(step, self.n), width), np.uint8)
        ragged = any(sizes is not None for _, _, sizes in self.pieces)
        used = np.ones(matrix.shape, bool) if ragged else None
        total = sum(self.n * w if sizes is None else int(sizes.sum(dtype=np.int64))
                    for w, _, sizes in self.pieces)
        out = np.empty(total, np.uint8)
        filled = 0
        for first in range(0, self.n, step):
            rows = slice(first, min(first + step, self.n))
            block = matrix[:rows.stop - rows.start]
            column = 0
            for piece_width, data, sizes in self.pieces:
                target = block[:, column:column + piece_width]
                if isinstance(data, bytes):
                    target[:] = np.frombuffer(data, np.uint8)
                elif data.dtype == np.uint32:
                    assert sizes is not None and used is not None  # uint32 varints always come with sizes
                    target.view("<u4")[:] = data[rows]
                    used[:len(block), column:column + piece_width].view("<u4")[:] = _USED_WORDS[sizes[rows]]
                elif data.ndim == 3:
                    target.reshape(data[rows].shape)[:] = data[rows]
                    if sizes is not None:
                        assert used is not None  # ragged
                        np.less(np.arange(data.shape[2]), sizes[rows, :, None],
                                out=used[:len(block), column:column + piece_width].reshape(data[rows].shape))
                else:
                    target[:] = data[rows]
                column += piece_width
            if used is None:
                part = block.reshape(-1)
            else:
                part = np.compress(used[:len(block)].reshape(-1), block.reshape(-1))
            out[filled:filled + len(part)] = part
            filled += len(part)
        return out


def _size(values: np.ndarray) -> np.ndarray:
    return varint_sizes(values).astype(np.int64)


def encode_frames(columns: dict[str, np.ndarray], kinds: dict[str, str],
                  order: Sequence[str] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Framed TFRecords of N Examples, one per row of the columns: (bytes, each frame's length).

    ``columns[name]`` is (N, K): integers for INT64 features, floats for FLOAT
    ones. ``order`` is the order of the map entries (default: sorted keys, as
    protobuf's deterministic serialization). K must be at least 1 (protobuf
    omits an empty packed list, which this encoder does not do). The frames
    are the uint8 array's bytes, one after the other.
    """
    order = sorted(columns) if order is None else list(order)
    n = len(columns[order[0]])
    if n == 0:
        return np.zeros(0, np.uint8), np.zeros(0, np.int64)
    entries = _Batch(n)
    features_len = np.zeros(n, np.int64)
    # Each entry's lengths depend on its payload, so entries are built first and
    # the frame's own header, which depends on them all, put in front after.
    for name in order:
        values = columns[name]
        if values.shape[1] < 1:
            raise ValueError(f"feature {name} has no values")
        key = name.encode()
        at = len(entries.pieces)
        if kinds[name] == FLOAT:
            raw = np.ascontiguousarray(values, dtype="<f4").view(np.uint8).reshape(n, -1)
            entries.raw(raw)
            payload_len = np.full(n, raw.shape[1], np.int64)
        else:
            payload_len = entries.varints(values)
        payload = entries.pieces[at:]
        del entries.pieces[at:]
        list_len = 1 + _size(payload_len) + payload_len  # tag 1, length, values
        feature_len = 1 + _size(list_len) + list_len  # oneof tag, length, list
        entry_len = 2 + len(key) + 1 + _size(feature_len) + feature_len  # key field, value field
        features_len += 1 + _size(entry_len) + entry_len
        entries.constant(bytes([_TAG_LEN1]))
        entries.length(entry_len)
        entries.constant(bytes([_TAG_LEN1, len(key)]) + key + bytes([_TAG_LEN2]))
        entries.length(feature_len)
        entries.constant(bytes([(_FIELD_OF_KIND[kinds[name]] << 3) | 2]))
        entries.length(list_len)
        entries.constant(bytes([_TAG_LEN1]))
        entries.length(payload_len)
        entries.pieces += payload
    example_len = 1 + _size(features_len) + features_len
    batch = _Batch(n)
    batch.raw(example_len.astype("<u8").view(np.uint8).reshape(n, 8))
    batch.constant(bytes(4) + bytes([_TAG_LEN1]))  # the length's crc, filled in below; Example tag
    batch.length(features_len)
    batch.pieces += entries.pieces
    batch.constant(bytes(4))  # the data's crc
    out = batch.build()

    # The checksums: the length's from a table of the lengths present, the data's one C call each.
    frame_len = HEADER_BYTES + example_len + FOOTER_BYTES
    frame_start = np.cumsum(frame_len) - frame_len
    lengths, which = np.unique(example_len, return_inverse=True)
    length_crcs = np.array([masked_crc(struct.pack("<Q", length)) for length in lengths.tolist()],
                           "<u4")[which]
    readable = out.view()
    readable.flags.writeable = False  # google_crc32c reads only read-only buffers
    value = google_crc32c.value
    data_crcs = _mask(np.fromiter(
        (value(readable[start:start + length]) for start, length
         in zip((frame_start + HEADER_BYTES).tolist(), example_len.tolist())), np.uint32, n))
    for crcs, where in ((length_crcs, frame_start + 8), (data_crcs, frame_start + HEADER_BYTES + example_len)):
        out[where[:, None] + np.arange(4)] = crcs.astype("<u4").view(np.uint8).reshape(n, 4)
    return out, frame_len


def _mask(crcs: np.ndarray) -> np.ndarray:
    """TFRecord's masking of crc32c values, for an array of them."""
    crcs = crcs.astype(np.uint32)
    return ((crcs >> np.uint32(15)) | (crcs << np.uint32(17))) + np.uint32(_MASK_DELTA)


def encode_records(columns: dict[str, np.ndarray], kinds: dict[str, str],
                   order: Sequence[str] | None = None) -> bytes:
    """Framed TFRecord bytes of N Examples, one per row of the columns (see :func:`encode_frames`)."""
    return encode_frames(columns, kinds, order)[0].tobytes()


# ---------------------------------------------------------------- framing

def read_frame(buf, pos: int, size: int, verify: bool) -> tuple[int, int]:
    """(data length, end of the frame) of the frame at ``pos``; a FormatError subclass if it is bad.

    The length's own checksum is always checked (8 bytes, so nearly free):
    without it a damaged length would send the reader anywhere.
    """
    if size - pos < HEADER_BYTES:
        raise TruncatedError(f"truncated record: {size - pos} bytes left, a record header needs 12")
    length, length_crc = struct.unpack_from("<QI", buf, pos)
    if masked_crc(buf[pos:pos + 8]) != length_crc:
        raise LengthError("corrupt record length (its checksum does not match)")
    end = pos + HEADER_BYTES + length + FOOTER_BYTES
    if end > size:
        raise TruncatedError(f"truncated record: its length says {length} data bytes, "
                             f"the file ends {size - pos - HEADER_BYTES} bytes after the header")
    if verify:
        stored, = struct.unpack_from("<I", buf, end - FOOTER_BYTES)
        if masked_crc(buf[pos + HEADER_BYTES:end - FOOTER_BYTES]) != stored:
            raise ChecksumError("corrupt record data (its checksum does not match)", end)
    return length, end


# ---------------------------------------------------------------- decoding

def _varint(buf, pos: int) -> tuple[int, int]:
    """(value, position after it) of the varint at ``pos``."""
    byte = buf[pos]
    if byte < 0x80:  # the common case: one byte
        return byte, pos + 1
    value, shift = byte & 0x7F, 7
    while True:
        pos += 1
        byte = buf[pos]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos + 1
        shift += 7
        if shift > 63:
            raise FormatError("varint longer than 10 bytes")


def _skip(buf, pos: int, wire_type: int) -> int:
    """Position after a field value of this wire type (unknown fields are skipped)."""
    if wire_type == 0:
        return _varint(buf, pos)[1]
    if wire_type == 1:
        return pos + 8
    if wire_type == 2:
        length, pos = _varint(buf, pos)
        return pos + length
    if wire_type == 5:
        return pos + 4
    raise FormatError(f"unsupported protobuf wire type {wire_type}")


def _fields(buf, pos: int, end: int):
    """(field number, wire type, value start, value end) of each field of a message."""
    while pos < end:
        key, pos = _varint(buf, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == 2:
            length, start = _varint(buf, pos)
            pos = start + length
        else:
            start = pos
            pos = _skip(buf, pos, wire_type)
        if pos > end:
            raise FormatError("a protobuf field runs past the end of its message")
        yield number, wire_type, start, pos


def example_features(buf, start: int, end: int, wanted=None) -> dict[str, tuple[str | None, int, int]]:
    """Map each feature name of the Example in ``buf[start:end]`` to (kind, payload start, end).

    The payload is the packed values of the list (empty when the list is
    empty; kind None when the Feature holds no list). Features not in ``wanted`` (when given) are passed over. Keys come
    out in the order the record stores them. This is the general parser (any
    field order, unknown fields); :func:`example_spans` is the fast one.
    """
    features: dict[str, tuple[str | None, int, int]] = {}
    for number, wire, f_start, f_end in _fields(buf, start, end):
        if number != 1 or wire != 2:
            continue  # Example has only field 1
        for e_number, e_wire, e_start, e_end in _fields(buf, f_start, f_end):
            if e_number != 1 or e_wire != 2:
                continue
            name, value = None, None
            for k_number, k_wire, k_start, k_end in _fields(buf, e_start, e_end):
                if k_number == 1 and k_wire == 2:
                    name = bytes(buf[k_start:k_end]).decode("utf-8", "replace")
                elif k_number == 2 and k_wire == 2:
                    value = (k_start, k_end)
            if name is None or (wanted is not None and name not in wanted):
                continue
            features[name] = _feature_payload(buf, name, *value) if value else (None, 0, 0)
    return features


def _feature_payload(buf, name: str, start: int, end: int) -> tuple[str | None, int, int]:
    kind, span = None, (start, start)
    for number, wire, l_start, l_end in _fields(buf, start, end):
        if number not in _KIND_OF_FIELD or wire != 2:
            continue
        kind, span = _KIND_OF_FIELD[number], (l_start, l_start)
        for v_number, v_wire, v_start, v_end in _fields(buf, l_start, l_end):
            if v_number != 1:
                continue
            if v_wire != 2:
                raise FormatError(f"{name}: values are not packed (not supported)")
            if span[1] != span[0]:
                raise FormatError(f"{name}: values split over several packed runs (not supported)")
            span = (v_start, v_end)
    return (kind, *span)


# Batch decoding: the same reading for N records at once, in numpy.

def _bytes_at(data: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """data[positions] as int64, positions clipped into the buffer.

    A clipped read is garbage, but only for a record whose lengths then fail
    to add up, so it never gets through.
    """
    return np.take(data, positions, mode="clip").astype(np.int64)


def _read_varints(data: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(values, positions after them) of the varints at ``positions``; -1 positions where invalid."""
    values = _bytes_at(data, positions)
    if (values < 0x80).all():  # the common case: all one byte
        return values, positions + 1
    values &= 0x7F
    after = np.where(values == _bytes_at(data, positions), positions + 1, -1)
    live = after < 0
    for k in range(1, 10):
        byte = _bytes_at(data, positions[live] + k)
        values[live] |= (byte & 0x7F) << (7 * k)
        stop = np.flatnonzero(live)[byte < 0x80]
        after[stop] = positions[stop] + k + 1
        live[stop] = False
        if not live.any():
            break
    return values, after


def example_spans(data: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                  names: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Where each named feature's packed values are, for N Examples at once.

    Walks the map entries of all records together, one entry per step, with
    numpy. It reads the layout every protobuf serializer writes (map entry =
    key then value, Feature = one list with one packed run); a record in any
    other layout is flagged and left to :func:`example_features`.

    Returns (kind, start, end, ok): kind (N, F) holds the Feature's oneof
    field number (2 float_list, 3 int64_list; 0 where the name is missing),
    start/end (N, F) the payload spans, ok (N,) whether the fast read worked.
    """
    n, f = len(starts), len(names)
    keys = [name.encode() for name in names]
    key_lengths = np.array([len(key) for key in keys])
    key_matrix = np.full((f, key_lengths.max()), -1, np.int64)  # the names, padded with -1
    for j, key in enumerate(keys):
        key_matrix[j, :len(key)] = np.frombuffer(key, np.uint8)
    kind = np.zeros((n, f), np.int64)
    span_start = np.zeros((n, f), np.int64)
    span_end = np.zeros((n, f), np.int64)
    ok = _bytes_at(data, starts) == _TAG_LEN1
    length, pos = _read_varints(data, starts + 1)
    ok &= (pos >= 0) & (length == ends - pos)
    while True:
        rows = np.flatnonzero(ok & (pos < ends))
        if len(rows) == 0:
            break
        p = pos[rows]
        good = _bytes_at(data, p) == _TAG_LEN1
        length, p = _read_varints(data, p + 1)
        good &= (p >= 0) & (length >= 0) & (length <= ends[rows] - p)  # no overflow on garbage
        entry_end = np.where(good, p + length, ends[rows])
        key_len = _bytes_at(data, p + 1)
        good &= (_bytes_at(data, p) == _TAG_LEN1) & (key_len < 0x80)
        # The key against every wanted name at once: (rows, names, bytes) comparisons.
        block = _bytes_at(data, (p + 2)[:, None] + np.arange(key_matrix.shape[1]))
        same = (block[:, None, :] == key_matrix[None]) | (np.arange(key_matrix.shape[1]) >= key_len[:, None, None])
        same = same.all(axis=2) & (key_len[:, None] == key_lengths[None])
        name_index = np.where(same.any(axis=1), same.argmax(axis=1), -1)
        q = p + 2 + key_len
        good &= _bytes_at(data, q) == _TAG_LEN2
        length, q = _read_varints(data, q + 1)  # the Feature
        good &= (q >= 0) & (length == entry_end - q)
        tag = _bytes_at(data, q)
        good &= (q >= 0) & (tag & 7 == 2) & (tag >> 3 >= 1) & (tag >> 3 <= 3)
        length, q = _read_varints(data, q + 1)  # the list
        good &= (q >= 0) & (length == entry_end - q)
        has_values = length > 0
        length, q_values = _read_varints(data, q + 1)
        good &= ~has_values | ((_bytes_at(data, q) == _TAG_LEN1)
                               & (q_values >= 0) & (length == entry_end - q_values))
        found = good & (name_index >= 0)
        r, j = rows[found], name_index[found]
        kind[r, j] = tag[found] >> 3
        span_start[r, j] = np.where(has_values, q_values, q)[found]
        span_end[r, j] = entry_end[found]
        ok[rows[~good]] = False
        pos[rows] = np.where(good, entry_end, ends[rows])
    return kind, span_start, span_end, ok


def ragged_gather(data: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of ``data[starts[i]:starts[i] + lengths[i]]`` over i."""
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, data.dtype)
    shift = starts - (np.cumsum(lengths) - lengths)
    return data[np.arange(total, dtype=np.int64) + np.repeat(shift, lengths)]


def decode_varint_rows(data: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
                       width: int) -> tuple[np.ndarray, np.ndarray]:
    """Decode N runs of packed varints, each expected to hold ``width`` values.

    Returns ((N, width) int64 values, (N,) count of values found in each run).
    A row whose count differs from ``width`` is left as zeros for the caller to
    reject; a run whose last varint is cut off, or that holds a varint longer
    than 10 bytes, counts -1.
    """
    n = len(starts)
    out = np.zeros((n, width), np.int64)
    stream = ragged_gather(data, starts, lengths)
    if len(stream) == 0:
        return out, np.zeros(n, np.int64)
    if len(stream) == n * width and stream.max() < 0x80 and (lengths == width).all():
        return stream.reshape(n, width).astype(np.int64), lengths.copy()  # one byte per value
    ends = stream < 0x80  # the last byte of every varint
    run_end = np.cumsum(lengths)
    last = run_end[lengths > 0] - 1
    cut = np.zeros(n, bool)
    cut[lengths > 0] = ~ends[last]
    ends[last] = True  # so that a cut-off varint cannot reach into the next run
    cumulative = np.concatenate([[0], np.cumsum(ends)])
    counts = cumulative[run_end] - cumulative[run_end - lengths]
    counts[cut] = -1

    # Each value from its last byte back: an earlier byte belongs to it until
    # the previous value's last byte. The most significant group comes last.
    last_bytes = np.flatnonzero(ends)
    values = (stream[last_bytes] & 0x7F).astype(np.int64)
    more = last_bytes > 0
    for k in range(1, 11):
        earlier = np.maximum(last_bytes - k, 0)
        more &= (last_bytes >= k) & ~ends[earlier]
        if not more.any():
            break
        if k == 10:  # an eleventh byte: not a varint
            value_row = np.searchsorted(run_end, last_bytes[more], side="right")
            counts[np.unique(value_row)] = -1
            break
        values = np.where(more, (values << 7) | (stream[earlier] & 0x7F), values)
    good = counts == width
    first_value = cumulative[run_end - lengths]
    out[good] = values[first_value[good, None] + np.arange(width)]
    return out, counts


def decode_float_rows(data: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
                      width: int) -> tuple[np.ndarray, np.ndarray]:
    """Like :func:`decode_varint_rows` for packed little-endian float32 runs."""
    n = len(starts)
    out = np.zeros((n, width), np.float32)
    counts = np.where(lengths % 4 == 0, lengths // 4, -1)
    good = counts == width
    if good.any():
        raw = ragged_gather(data, starts[good], lengths[good])
        out[good] = raw.view("<f4").reshape(-1, width)
    return out, counts
