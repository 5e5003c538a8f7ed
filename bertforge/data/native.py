"""bertforge's own record format: fixed-size rows, memory-mapped, for fast random access.

Layout of one file::

    preamble (64 bytes): magic "\\x89BFREC\\r\\n", uint32 version, uint32 flags (0),
                         uint64 header offset, uint64 header length, uint32 crc32c of the header
    rows:                count × row_bytes, from byte 64
    header:              UTF-8 JSON, at the end (the count is known only then)

A row is one record: a numpy structured dtype whose fields are stored as
narrowly as the values allow (token ids as uint16 while the vocab has at most
65536 entries, positions as uint8 up to sequence length 256, ``input_mask``
and ``segment_ids`` as bits, labels as uint8). Rows rather than one array per
feature: a record is one contiguous read, and a writer streams rows straight
to the file in one pass with no temporary files.

The header holds the count, shapes, the row dtype (name, dtype, width, offset
and encoding of each field), the largest token id written, the crc32c of
every 16 MiB block of the row region, and (files written since BPE vocabs
came, by ``data create``) the tokenizer that made the rows: ``"tokenizer":
{"kind", "name", "vocab_size", "fingerprint"}`` (:meth:`.vocab.Vocabulary.identity`;
a file without it is read as before). Opening reads 64 bytes and the header,
so it is O(1); rows are read through a memory map, so ``take`` is one numpy
fancy index. Verifying means reading the whole row region once for the block
checksums (about the speed of reading the file: crc32c runs at >10 GB/s).
A truncated file is detected from the sizes in the preamble and header.

Packed rows (:class:`.rows.PackedArrays`) have their own row layout; the
header then says ``"max_sequences_per_pack": S`` (a file without that field
holds unpacked rows), and ``max_predictions`` is per sequence (a row holds
``max_predictions + S - 1``), as in Graphcore's packed TFRecords.

A header is not trusted: every field is checked for type and range (a hand
edit such as ``"seq_len": 1e9`` is a one-line error naming the field), the
field layout must be exactly the one these shapes give, and the rows it
describes must fill the file to the byte, so nothing is ever allocated from a
header number beyond what the file holds.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import BinaryIO

import google_crc32c
import numpy as np

from .rows import MAX_SEQUENCES_PER_PACK, PackedArrays, PretrainingArrays, Rows

MAGIC = b"\x89BFREC\r\n"
VERSION = 1
_PREAMBLE = struct.Struct("<8sIIQQI")
DATA_OFFSET = 64  # rows start here, aligned
BLOCK_BYTES = 1 << 24  # one checksum per 16 MiB of rows

_BITS = "bits"  # a 0/1 field stored as packed bits (little bit order)
_PLAIN = "plain"


def row_dtype(seq_len: int, max_predictions: int, id_dtype: np.dtype,
              max_sequences_per_pack: int = 0) -> tuple[np.dtype, dict]:
    """The row dtype and the encoding of each field (packed rows with ``max_sequences_per_pack``).

    Wider fields first, so that numpy's alignment adds little padding.
    """
    position_dtype = np.dtype(np.uint8 if seq_len <= 256 else np.uint16)
    bit_bytes = (seq_len + 7) // 8
    slots = max_sequences_per_pack
    byte = np.dtype(np.uint8)
    if slots:
        width = max_predictions + slots - 1
        fields = [
            ("input_ids", id_dtype, seq_len, _PLAIN),
            ("masked_lm_ids", id_dtype, width, _PLAIN),
            ("position_ids", position_dtype.newbyteorder("<"), seq_len, _PLAIN),
            ("masked_lm_positions", position_dtype.newbyteorder("<"), width, _PLAIN),
            ("input_mask", byte, seq_len, _PLAIN),  # sequence indices
            ("masked_lm_mask", byte, width, _PLAIN),
            ("segment_ids", byte, bit_bytes, _BITS),
            ("next_sentence_labels", byte, slots, _PLAIN),
            ("next_sentence_mask", byte, slots, _PLAIN),
        ]
        dtype = np.dtype([(name, dt, (w,)) for name, dt, w, _ in fields], align=True)
        return dtype, {name: encoding for name, _, _, encoding in fields}
    fields = [
        ("masked_lm_weights", np.dtype("<f4"), max_predictions, _PLAIN),
        ("input_ids", id_dtype, seq_len, _PLAIN),
        ("masked_lm_ids", id_dtype, max_predictions, _PLAIN),
        ("masked_lm_positions", position_dtype.newbyteorder("<"), max_predictions, _PLAIN),
        ("input_mask", np.dtype(np.uint8), bit_bytes, _BITS),
        ("segment_ids", np.dtype(np.uint8), bit_bytes, _BITS),
        ("next_sentence_labels", np.dtype(np.uint8), 1, _PLAIN),
    ]
    dtype = np.dtype([(name, dt, (width,)) for name, dt, width, _ in fields], align=True)
    return dtype, {name: encoding for name, _, _, encoding in fields}


def id_dtype_for(bound: int | None) -> np.dtype:
    """uint16 token ids when every id is known to be below 65536, else int32."""
    return np.dtype("<u2") if bound is not None and bound <= 1 << 16 else np.dtype("<i4")


def _bit_fields(packed: bool) -> tuple[str, ...]:
    return ("segment_ids",) if packed else ("input_mask", "segment_ids")


def to_rows(arrays: Rows, dtype: np.dtype) -> np.ndarray:
    """Validated arrays → structured rows."""
    rows = np.zeros(len(arrays), dtype)
    assert dtype.names is not None  # a structured dtype (row_dtype's)
    bit_fields = _bit_fields(isinstance(arrays, PackedArrays))
    for name in dtype.names:
        values = getattr(arrays, name)
        if name in bit_fields:
            values = np.packbits(values.astype(np.uint8), axis=1, bitorder="little")
        elif values.ndim == 1:  # unpacked next_sentence_labels
            values = values.reshape(-1, 1)
        rows[name] = values
    return rows


def from_rows(rows: np.ndarray, seq_len: int, max_sequences_per_pack: int = 0) -> Rows:
    """Structured rows → arrays in PretrainingArrays' (or, packed, PackedArrays') dtypes."""
    def bits(name: str) -> np.ndarray:
        return np.unpackbits(rows[name], axis=1, count=seq_len, bitorder="little").view(np.int8)

    if max_sequences_per_pack:
        return PackedArrays(
            input_ids=rows["input_ids"].astype(np.int32),
            input_mask=rows["input_mask"].astype(np.int8),
            segment_ids=bits("segment_ids"),
            position_ids=rows["position_ids"].astype(np.int32),
            masked_lm_positions=rows["masked_lm_positions"].astype(np.int32),
            masked_lm_ids=rows["masked_lm_ids"].astype(np.int32),
            masked_lm_mask=rows["masked_lm_mask"].astype(np.int8),
            next_sentence_labels=rows["next_sentence_labels"].astype(np.int64),
            next_sentence_mask=rows["next_sentence_mask"].astype(np.int8),
        )

    return PretrainingArrays(
        input_ids=rows["input_ids"].astype(np.int32),
        segment_ids=bits("segment_ids"),
        input_mask=bits("input_mask"),
        masked_lm_positions=rows["masked_lm_positions"].astype(np.int32),
        masked_lm_ids=rows["masked_lm_ids"].astype(np.int32),
        masked_lm_weights=rows["masked_lm_weights"].astype(np.float32),
        next_sentence_labels=rows["next_sentence_labels"][:, 0].astype(np.int64),
    )


class NativeWriter:
    """Streams rows (made by :func:`to_rows`) to an open binary file; :meth:`finish` writes the header."""

    def __init__(self, file: BinaryIO, seq_len: int, max_predictions: int, id_dtype: np.dtype,
                 vocab_size: int | None, max_sequences_per_pack: int = 0, tokenizer: dict | None = None):
        self.file = file
        self.tokenizer = tokenizer
        self.seq_len, self.max_predictions, self.vocab_size = seq_len, max_predictions, vocab_size
        self.max_sequences_per_pack = max_sequences_per_pack
        self.dtype, self.encodings = row_dtype(seq_len, max_predictions, id_dtype, max_sequences_per_pack)
        self.count = 0
        self.max_id = -1
        self.block_crcs: list[int] = []
        self._block_fill = 0  # bytes of the current block written so far
        file.write(bytes(DATA_OFFSET))  # the preamble, written last

    def append(self, data: np.ndarray, count: int, max_id: int) -> None:
        """Append ``count`` rows already laid out in this writer's dtype (``data``: their bytes)."""
        if count == 0:
            return
        if len(data) != count * self.dtype.itemsize:
            raise ValueError(f"{len(data)} bytes are not {count} rows of {self.dtype.itemsize} bytes")
        self.max_id = max(self.max_id, max_id)
        data = data.view()
        data.flags.writeable = False  # google_crc32c reads only read-only buffers
        # numpy's stubs give ndarray its __buffer__ only for Python >= 3.12; it is a buffer on every version
        self.file.write(data)  # type: ignore[call-overload]
        self.count += count
        # Extend the running block checksums, starting a new one every BLOCK_BYTES.
        while len(data):
            if self._block_fill == 0:
                self.block_crcs.append(0)
            take = min(len(data), BLOCK_BYTES - self._block_fill)
            self.block_crcs[-1] = google_crc32c.extend(self.block_crcs[-1], data[:take])
            self._block_fill = (self._block_fill + take) % BLOCK_BYTES
            data = data[take:]

    def finish(self) -> None:
        assert self.dtype.names is not None and self.dtype.fields is not None  # row_dtype is structured
        names = list(self.dtype.names)
        header = {
            "format": "bertforge-records", "version": VERSION,
            "count": self.count, "seq_len": self.seq_len, "max_predictions": self.max_predictions,
            "vocab_size": self.vocab_size, "max_id": self.max_id,
            "row_bytes": self.dtype.itemsize,
            "fields": [{"name": name, "dtype": self.dtype[name].base.str,
                        "width": self.dtype[name].shape[0], "offset": self.dtype.fields[name][1],
                        "encoding": self.encodings[name]} for name in names],
            "block_bytes": BLOCK_BYTES, "block_crc32c": self.block_crcs,
        }
        if self.max_sequences_per_pack:  # absent: unpacked rows, as every file before packing
            header["max_sequences_per_pack"] = self.max_sequences_per_pack
        if self.tokenizer is not None:  # absent: not known, as in every file before BPE vocabs
            header["tokenizer"] = self.tokenizer
        text = json.dumps(header, indent=1).encode()
        header_offset = DATA_OFFSET + self.count * self.dtype.itemsize
        self.file.write(text)
        self.file.seek(0)
        self.file.write(_PREAMBLE.pack(MAGIC, VERSION, 0, header_offset, len(text),
                                       google_crc32c.value(text)))


@dataclass
class Header:
    """What a native file's header says, checked against the file's size."""

    count: int
    seq_len: int
    max_predictions: int
    vocab_size: int | None
    max_id: int
    dtype: np.dtype
    block_bytes: int
    block_crcs: list[int]
    max_sequences_per_pack: int = 0  # 0: unpacked rows
    tokenizer: dict | None = None  # what made the rows (Vocabulary.identity()); None: not said


MAX_SEQ_LEN = 1 << 16  # positions are stored as uint16 at most
_ID_DTYPES = ("<u2", "<i4")  # what id_dtype_for picks


def _int(h: dict, key: str, low: int, high: int | None = None) -> int:
    """The header's integer ``key`` in [low, high]; a ValueError naming the field otherwise."""
    value = _optional_int(h, key, low, high)
    if value is None:
        raise ValueError(f"header field {key!r} is null, expected an integer")
    return value


def _optional_int(h: dict, key: str, low: int, high: int | None = None) -> int | None:
    """Like :func:`_int`, and null is allowed."""
    if key not in h:
        raise ValueError(f"header field {key!r} is missing")
    value = h[key]
    if value is None:
        return None
    # bool is an int in Python, and 1e9 parses as a float: neither is a count
    if type(value) is not int:
        raise ValueError(f"header field {key!r} is {_show(value)}, expected an integer")
    if value < low or (high is not None and value > high):
        bound = f"at least {low}" if high is None else f"in {low}..{high}"
        raise ValueError(f"header field {key!r} is {_show(value)}, expected an integer {bound}")
    return value


def _show(value: object) -> str:
    """A header value for a one-line message: its JSON text, cut short."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def read_header(file: BinaryIO, size: int) -> Header:
    """Parse and check the preamble and header; ValueError says what is wrong, in one line.

    Every field is checked for type and range before it is used, and the rows
    the header describes must fill the file exactly: nothing is allocated from
    a header number beyond what the file holds.
    """
    preamble = file.read(DATA_OFFSET)
    if len(preamble) < _PREAMBLE.size or preamble[:8] != MAGIC:
        raise ValueError("not a bertforge native record file (bad magic bytes)")
    _, version, flags, header_offset, header_len, header_crc = _PREAMBLE.unpack_from(preamble)
    if version != VERSION:
        raise ValueError(f"native format version {version}; this bertforge reads version {VERSION}")
    if flags != 0:
        raise ValueError(f"unknown flags {flags:#x} in the preamble (version {VERSION} has none)")
    if header_offset + header_len != size:
        raise ValueError(f"truncated or damaged: the preamble says {header_offset + header_len} bytes, "
                         f"the file has {size}")
    if header_offset < DATA_OFFSET or header_len == 0:
        raise ValueError(f"damaged preamble: header at byte offset {header_offset}, {header_len} bytes "
                         f"(rows start at {DATA_OFFSET}, the header follows them)")
    if any(preamble[_PREAMBLE.size:]):  # the writer leaves zeros
        raise ValueError(f"damaged preamble: bytes {_PREAMBLE.size}..{DATA_OFFSET - 1} are not all zero")
    file.seek(header_offset)
    raw = file.read(header_len)  # at most the file's size (checked above)
    if len(raw) != header_len:
        raise ValueError(f"truncated: the header at byte offset {header_offset} has {len(raw)} of "
                         f"{header_len} bytes")
    if google_crc32c.value(raw) != header_crc:
        raise ValueError(f"corrupt header at byte offset {header_offset} (its checksum does not match)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"the header is not UTF-8 JSON (bad byte at header offset {err.start})") from None
    try:
        h = json.loads(text)
    except (ValueError, RecursionError) as err:  # JSONDecodeError, too many digits, deep nesting
        first_line = (str(err).splitlines() or [type(err).__name__])[0]
        raise ValueError(f"the header is not valid JSON ({first_line})") from None
    if not isinstance(h, dict):
        raise ValueError(f"the header is a JSON {type(h).__name__}, expected an object")
    if h.get("format") != "bertforge-records":
        raise ValueError(f"header field 'format' is {_show(h.get('format'))}, expected \"bertforge-records\"")
    if _int(h, "version", 0) != version:
        raise ValueError(f"header field 'version' is {h['version']}, the preamble says {version}")
    seq_len = _int(h, "seq_len", 1, MAX_SEQ_LEN)
    max_predictions = _int(h, "max_predictions", 1, seq_len)
    vocab_size = _optional_int(h, "vocab_size", 1, 1 << 31)
    slots = _int(h, "max_sequences_per_pack", 1, MAX_SEQUENCES_PER_PACK) if "max_sequences_per_pack" in h else 0
    count = _int(h, "count", 0)
    row_bytes = _int(h, "row_bytes", 1)
    # The rows must end where the header starts: this bounds count × row_bytes by the file size.
    if DATA_OFFSET + count * row_bytes != header_offset:
        raise ValueError(f"damaged: {count} rows of {row_bytes} bytes do not end "
                         f"where the header starts ({header_offset})")
    dtype = _header_dtype(h, seq_len, max_predictions, row_bytes, slots)
    id_limit = (1 << 16) if dtype["input_ids"].base == np.dtype("<u2") else 1 << 31
    if vocab_size is not None:
        id_limit = min(id_limit, vocab_size)
    max_id = _int(h, "max_id", -1, id_limit - 1)
    if count and max_id == -1:
        raise ValueError(f"header field 'max_id' is -1 (no token), but the file has {count} rows")
    block_bytes = _int(h, "block_bytes", 1)
    crcs = h.get("block_crc32c")
    blocks = -(-count * row_bytes // block_bytes)
    if not isinstance(crcs, list) or len(crcs) != blocks:
        raise ValueError(f"header field 'block_crc32c' is {_show(crcs)}, expected a list of {blocks} "
                         f"checksum(s) (one per {block_bytes} bytes of rows)")
    if any(type(crc) is not int or not 0 <= crc < 1 << 32 for crc in crcs):
        bad = next(crc for crc in crcs if type(crc) is not int or not 0 <= crc < 1 << 32)
        raise ValueError(f"header field 'block_crc32c' holds {_show(bad)}, expected uint32 checksums")
    tokenizer = tokenizer_identity(h["tokenizer"], "header field") if "tokenizer" in h else None
    return Header(count, seq_len, max_predictions, vocab_size, max_id, dtype, block_bytes, crcs, slots, tokenizer)


_TOKENIZER_FIELDS = {"kind": str, "name": str, "vocab_size": int, "fingerprint": str}


def tokenizer_identity(value: object, where: str) -> dict:
    """A ``tokenizer`` object (:meth:`.vocab.Vocabulary.identity`: a native header's field, a TFRecord's
    sidecar), its fields checked; a ValueError naming ``where`` and the first bad one."""
    if not isinstance(value, dict):
        raise ValueError(f"{where} 'tokenizer' is {_show(value)}, expected an object")
    for key, kind in _TOKENIZER_FIELDS.items():
        if type(value.get(key)) is not kind:
            raise ValueError(f"{where} 'tokenizer' has {key} {_show(value.get(key))}, expected "
                             f"{'an integer' if kind is int else 'a string'}")
    return {key: value[key] for key in _TOKENIZER_FIELDS}


def _header_dtype(h: dict, seq_len: int, max_predictions: int, row_bytes: int, slots: int = 0) -> np.dtype:
    """The row dtype the header describes, which must be version 1's layout for its shapes."""
    fields = h.get("fields")
    if not isinstance(fields, list) or not all(isinstance(f, dict) for f in fields):
        raise ValueError(f"header field 'fields' is {_show(fields)}, expected a list of objects")
    names = [f.get("name") for f in fields]
    ids = next((f.get("dtype") for f in fields if f.get("name") == "input_ids"), None)
    if ids not in _ID_DTYPES:
        raise ValueError(f"header field 'fields': input_ids has dtype {_show(ids)}, "
                         f"expected one of {', '.join(_ID_DTYPES)}")
    dtype, encodings = row_dtype(seq_len, max_predictions, np.dtype(ids), slots)
    assert dtype.names is not None and dtype.fields is not None  # row_dtype is structured
    expected = [{"name": name, "dtype": dtype[name].base.str, "width": dtype[name].shape[0],
                 "offset": dtype.fields[name][1], "encoding": encodings[name]} for name in dtype.names]
    if names != list(dtype.names):
        packing = f" for packed rows (max_sequences_per_pack {slots})" if slots else " for unpacked rows"
        raise ValueError(f"header field 'fields' names {_show(names)}, expected {list(dtype.names)}{packing}")
    for got, want in zip(fields, expected):
        for key, value in want.items():
            if got.get(key) != value or type(got.get(key)) is not type(value):
                raise ValueError(f"header field 'fields': {want['name']} has {key} {_show(got.get(key))}, "
                                 f"expected {_show(value)} for seq_len {seq_len}, "
                                 f"max_predictions {max_predictions}")
    if row_bytes != dtype.itemsize:
        raise ValueError(f"header field 'row_bytes' is {row_bytes}, expected {dtype.itemsize} for seq_len "
                         f"{seq_len}, max_predictions {max_predictions}")
    return dtype


def bad_block(data: np.ndarray, header: Header) -> int | None:
    """The byte offset (from the row region's start) of the first block whose crc32c differs."""
    for i, expected in enumerate(header.block_crcs):
        block = data[i * header.block_bytes:(i + 1) * header.block_bytes]
        if google_crc32c.value(block) != expected:
            return i * header.block_bytes
    expected_blocks = -(-len(data) // header.block_bytes)
    return None if expected_blocks == len(header.block_crcs) else 0
