"""TensorFlow 1 name-based checkpoints (tensor bundles), read and written without TensorFlow.

``tf.train.Saver`` writes a checkpoint ``PREFIX`` (``model.ckpt-28252``) as

* ``PREFIX.index``: a table in leveldb's SSTable layout (data blocks of
  prefix-compressed key/value entries with restart points, a metaindex
  block, an index block naming each data block by a key at least its last,
  and a 48-byte footer ending in a magic number; every block carries a
  masked crc32c). The entry of the empty key is a ``BundleHeaderProto``
  (number of shards, endianness, version); every other key is a variable's
  name and its value a ``BundleEntryProto`` (dtype, shape, shard, offset and
  size in the shard, masked crc32c of the bytes);
* ``PREFIX.data-00000-of-0000N``: the shards, each tensor's little-endian
  bytes one after another;
* ``checkpoint`` beside it: a text proto naming the newest prefix.

The few protobuf fields needed are decoded and encoded here by hand. Reading
verifies every block's and every tensor's crc32c. :func:`write_bundle` writes
the bytes TensorFlow's ``BundleWriter`` writes for the same tensors (one
shard, tensors in name order, uncompressed blocks of 256 KiB, a restart
every 16 keys), so real TensorFlow reads what it writes.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import google_crc32c
import numpy as np
import torch

from bertforge.fileio import fsync
from bertforge.runs import CheckpointError

MAGIC = 0xDB4775248B80FB57  # leveldb's table magic number, the last 8 bytes of an .index
FOOTER_SIZE = 48  # two block handles padded to 40 bytes, then the magic
BLOCK_TRAILER = 5  # compression type byte + masked crc32c
BLOCK_SIZE = 256 * 1024  # TensorFlow's table::Options defaults
RESTART_INTERVAL = 16
STATE_FILE = "checkpoint"  # the text proto naming the newest prefix of a directory
NO_COMPRESSION, SNAPPY = 0, 1

# tensorflow/core/framework/types.proto: enum value -> torch dtype
DTYPES: dict[int, torch.dtype] = {
    1: torch.float32, 2: torch.float64, 3: torch.int32, 4: torch.uint8, 5: torch.int16, 6: torch.int8,
    9: torch.int64, 10: torch.bool, 14: torch.bfloat16, 19: torch.float16,
}
DTYPE_NAMES = {1: "float32", 2: "float64", 3: "int32", 4: "uint8", 5: "int16", 6: "int8", 7: "string",
               9: "int64", 10: "bool", 14: "bfloat16", 19: "float16"}
TF_DTYPES = {dtype: number for number, dtype in DTYPES.items()}


def data_file(prefix: Path | str, shard: int, num_shards: int) -> Path:
    return Path(f"{prefix}.data-{shard:05d}-of-{num_shards:05d}")


def index_file(prefix: Path | str) -> Path:
    return Path(f"{prefix}.index")


def find_prefix(path: Path | str) -> Path | None:
    """The checkpoint prefix ``path`` names, or None when it is not a TF1 checkpoint: a prefix
    (``PREFIX.index`` exists), its ``.index`` or a ``.data-…`` file, or a directory whose
    ``checkpoint`` file names one (TensorFlow's latest_checkpoint)."""
    path = Path(path)
    if index_file(path).is_file():
        return path
    if path.name.endswith(".index") and path.is_file():
        return path.with_name(path.name.removesuffix(".index"))
    if ".data-" in path.name and path.is_file():
        prefix = path.with_name(path.name.rsplit(".data-", 1)[0])
        return prefix if index_file(prefix).is_file() else None
    if path.is_dir() and (path / STATE_FILE).is_file():
        name = read_state(path / STATE_FILE)
        if name is not None:
            prefix = Path(name) if Path(name).is_absolute() else path / name
            return prefix if index_file(prefix).is_file() else None
    return None


def read_state(path: Path) -> str | None:
    """``model_checkpoint_path`` of a ``checkpoint`` state file, else None."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() == "model_checkpoint_path":
            return value.strip().strip('"')
    return None


def write_state(directory: Path, prefix_name: str) -> None:
    """The ``checkpoint`` state file ``tf.train.Saver`` writes beside a single checkpoint."""
    text = f'model_checkpoint_path: "{prefix_name}"\nall_model_checkpoint_paths: "{prefix_name}"\n'
    (directory / STATE_FILE).write_text(text, encoding="utf-8")


# ------------------------------------------------------------ checksums and varints

def masked_crc32c(data: bytes) -> int:
    """leveldb's masked crc32c: checksums stored next to data that may hold checksums."""
    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    """(value, next position) of the base-128 varint at ``pos``; IndexError when cut short."""
    result = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")


def _put_varint(value: int) -> bytes:
    value &= 0xFFFFFFFFFFFFFFFF  # negative int64 fields take ten bytes, as protobuf writes them
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


# ------------------------------------------------------------ the protobuf messages

def _fields(data: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) of a serialized message: ints for varint and fixed fields, bytes otherwise."""
    pos = 0
    while pos < len(data):
        tag, pos = _varint(data, pos)
        number, wire = tag >> 3, tag & 7
        value: int | bytes
        if wire == 0:
            value, pos = _varint(data, pos)
        elif wire == 1:
            (value,), pos = struct.unpack_from("<Q", data, pos), pos + 8
        elif wire == 5:
            (value,), pos = struct.unpack_from("<I", data, pos), pos + 4
        elif wire == 2:
            length, pos = _varint(data, pos)
            if pos + length > len(data):
                raise ValueError("a field runs past the end of its message")
            value, pos = data[pos:pos + length], pos + length
        else:
            raise ValueError(f"wire type {wire} of field {number} is not one a bundle uses")
        yield number, value


def _int64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


@dataclasses.dataclass(frozen=True)
class Entry:
    """A ``BundleEntryProto``: where one tensor is and what it holds."""

    dtype: int
    shape: tuple[int, ...]
    shard: int = 0
    offset: int = 0
    size: int = 0
    crc32c: int = 0  # masked
    sliced: bool = False  # a partitioned variable, stored as slices under other keys

    @classmethod
    def parse(cls, data: bytes) -> Entry:
        values: dict[str, object] = {"dtype": 0, "shape": ()}
        for number, value in _fields(data):
            if number == 1 and isinstance(value, int):
                values["dtype"] = value
            elif number == 2 and isinstance(value, bytes):
                values["shape"] = _parse_shape(value)
            elif number in (3, 4, 5) and isinstance(value, int):
                values[("shard", "offset", "size")[number - 3]] = _int64(value)
            elif number == 6 and isinstance(value, int):
                values["crc32c"] = value
            elif number == 7:
                values["sliced"] = True
        return cls(**values)  # type: ignore[arg-type]

    def serialize(self) -> bytes:
        """The bytes TensorFlow writes: fields in number order, zero scalars left out (proto3)."""
        dims = b"".join(b"\x12" + _length(b"\x08" + _put_varint(d) if d else b"") for d in self.shape)
        out = b"\x08" + _put_varint(self.dtype) + b"\x12" + _length(dims)  # the shape is always set
        for number, value in ((3, self.shard), (4, self.offset), (5, self.size)):
            if value:
                out += bytes([number << 3]) + _put_varint(value)
        if self.crc32c:
            out += b"\x35" + struct.pack("<I", self.crc32c)
        return out


def _length(data: bytes) -> bytes:
    return _put_varint(len(data)) + data


def _parse_shape(data: bytes) -> tuple[int, ...]:
    dims = []
    for number, value in _fields(data):
        if number == 2 and isinstance(value, bytes):  # Dim {int64 size = 1; string name = 2}
            size = 0
            for dim_number, dim_value in _fields(value):
                if dim_number == 1 and isinstance(dim_value, int):
                    size = _int64(dim_value)
            dims.append(size)
        elif number == 3 and value:
            raise ValueError("a tensor of unknown rank")
    return tuple(dims)


HEADER = b"\x08\x01\x1a\x02\x08\x01"  # BundleHeaderProto: 1 shard, little-endian, version {producer: 1}


def _parse_header(data: bytes, source: Path) -> int:
    """The number of shards of a ``BundleHeaderProto``; refuses big-endian and newer versions."""
    num_shards, endianness, min_consumer = 0, 0, 0
    for number, value in _fields(data):
        if number == 1 and isinstance(value, int):
            num_shards = value
        elif number == 2 and isinstance(value, int):
            endianness = value
        elif number == 3 and isinstance(value, bytes):
            for version_number, version_value in _fields(value):
                if version_number == 2 and isinstance(version_value, int):
                    min_consumer = version_value
    if endianness != 0:
        raise CheckpointError(f"{source}: a big-endian checkpoint, which is not supported")
    if min_consumer > 1:
        raise CheckpointError(f"{source}: bundle version needs a reader of version {min_consumer} or newer")
    if num_shards < 1:
        raise CheckpointError(f"{source}: the header names {num_shards} data shards")
    return num_shards


# ------------------------------------------------------------ the table (.index)

def _read_block(data: bytes, handle: bytes, source: Path) -> bytes:
    """The contents of the block a handle points to, its checksum verified."""
    offset, pos = _varint(handle, 0)
    size, _ = _varint(handle, pos)
    end = offset + size
    if end + BLOCK_TRAILER > len(data):
        raise CheckpointError(f"{source}: a block at byte {offset} runs past the end of the file (truncated?)")
    block, kind = data[offset:end], data[end]
    (stored,) = struct.unpack_from("<I", data, end + 1)
    if masked_crc32c(data[offset:end + 1]) != stored:
        raise CheckpointError(f"{source}: the block at byte {offset} fails its crc32c (damaged or edited)")
    if kind == SNAPPY:  # TensorFlow builds with snappy compressed the blocks (leveldb's default) until 2.x
        try:
            return snappy_decompress(block)
        except ValueError as err:
            raise CheckpointError(f"{source}: the snappy block at byte {offset} is damaged ({err})") from None
    if kind != NO_COMPRESSION:
        raise CheckpointError(f"{source}: the block at byte {offset} has unknown compression type {kind}")
    return block


def snappy_decompress(data: bytes) -> bytes:
    """Snappy's raw format: the uncompressed length (a varint), then literals and back-references.

    A tag byte's low 2 bits: 0, a literal of (tag >> 2) + 1 bytes (60..63: the
    length - 1 in the next 1..4 bytes); 1, a copy of 4..11 bytes from an 11-bit
    offset; 2 and 3, a copy of (tag >> 2) + 1 bytes from a 16- or 32-bit offset.
    A copy may overlap what it writes (offset < length): it repeats the last
    ``offset`` bytes.
    """
    size, pos = _varint(data, 0)
    out = bytearray()
    while pos < len(data):
        tag, pos = data[pos], pos + 1
        kind = tag & 3
        if kind == 0:
            length = tag >> 2
            if length >= 60:
                extra = length - 59
                length, pos = int.from_bytes(data[pos:pos + extra], "little"), pos + extra
            length += 1
            if pos + length > len(data):
                raise ValueError("a literal runs past the end")
            out += data[pos:pos + length]
            pos += length
            continue
        if kind == 1:
            length, offset, pos = ((tag >> 2) & 7) + 4, ((tag >> 5) << 8) | data[pos], pos + 1
        else:
            width = 2 if kind == 2 else 4
            length, offset = (tag >> 2) + 1, int.from_bytes(data[pos:pos + width], "little")
            pos += width
        if not 0 < offset <= len(out):
            raise ValueError(f"a copy from {offset} bytes back, with {len(out)} written")
        period = out[len(out) - offset:len(out) - offset + length]
        out += (period * (length // len(period) + 1))[:length]
    if len(out) != size or pos != len(data):
        raise ValueError(f"{len(out)} bytes decoded, {size} announced")
    return bytes(out)


def _block_entries(block: bytes) -> Iterator[tuple[bytes, bytes]]:
    """(key, value) of a block, in order: prefix-compressed keys, then the restart array."""
    (num_restarts,) = struct.unpack_from("<I", block, len(block) - 4)
    end = len(block) - 4 - 4 * num_restarts
    if end < 0:
        raise ValueError("restart array larger than its block")
    pos, key = 0, b""
    while pos < end:
        shared, pos = _varint(block, pos)
        unshared, pos = _varint(block, pos)
        length, pos = _varint(block, pos)
        if shared > len(key) or pos + unshared + length > end:
            raise ValueError(f"entry at byte {pos} runs past its block")
        key = key[:shared] + block[pos:pos + unshared]
        pos += unshared
        yield key, block[pos:pos + length]
        pos += length


def read_table(path: Path) -> list[tuple[bytes, bytes]]:
    """Every (key, value) of an SSTable file, in key order, each block's crc32c verified."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except OSError as err:
        raise CheckpointError(f"{path}: cannot be read ({err.strerror})") from None
    if len(data) < FOOTER_SIZE or struct.unpack_from("<Q", data, len(data) - 8)[0] != MAGIC:
        raise CheckpointError(f"{path}: not a TensorFlow checkpoint index (no table footer; truncated?)")
    try:
        footer = data[-FOOTER_SIZE:]
        _, pos = _varint(footer, 0)  # the metaindex handle: TensorFlow's tables have no meta blocks
        _, pos = _varint(footer, pos)
        index = _read_block(data, footer[pos:], path)
        entries: list[tuple[bytes, bytes]] = []
        for _, handle in _block_entries(index):
            entries.extend(_block_entries(_read_block(data, handle, path)))
    except CheckpointError:
        raise
    except (ValueError, IndexError, struct.error) as err:
        raise CheckpointError(f"{path}: not a readable TensorFlow checkpoint index ({err})") from None
    return entries


class _BlockBuilder:
    """leveldb's BlockBuilder: keys prefix-compressed against the previous one, a full key
    (a restart point) every ``restart_interval`` entries, the restart offsets at the end."""

    def __init__(self, restart_interval: int):
        self.interval = restart_interval
        self.buffer = bytearray()
        self.restarts = [0]
        self.counter = 0
        self.last_key = b""

    def add(self, key: bytes, value: bytes) -> None:
        shared = 0
        if self.counter < self.interval:
            limit = min(len(key), len(self.last_key))
            while shared < limit and key[shared] == self.last_key[shared]:
                shared += 1
        else:
            self.restarts.append(len(self.buffer))
            self.counter = 0
        self.buffer += _put_varint(shared) + _put_varint(len(key) - shared) + _put_varint(len(value))
        self.buffer += key[shared:] + value
        self.last_key = key
        self.counter += 1

    def size_estimate(self) -> int:
        return len(self.buffer) + 4 * len(self.restarts) + 4

    def finish(self) -> bytes:
        return bytes(self.buffer) + b"".join(struct.pack("<I", r) for r in self.restarts) + \
            struct.pack("<I", len(self.restarts))


def _shortest_separator(start: bytes, limit: bytes) -> bytes:
    """A short key >= ``start`` and < ``limit`` (leveldb's BytewiseComparator)."""
    n = min(len(start), len(limit))
    i = 0
    while i < n and start[i] == limit[i]:
        i += 1
    if i < n and start[i] < 0xFF and start[i] + 1 < limit[i]:
        return start[:i] + bytes([start[i] + 1])
    return start


def _short_successor(key: bytes) -> bytes:
    for i, byte in enumerate(key):
        if byte != 0xFF:
            return key[:i] + bytes([byte + 1])
    return key


def build_table(entries: list[tuple[bytes, bytes]],
                compress: Callable[[bytes], bytes] | None = None) -> bytes:
    """An SSTable of ``entries`` (sorted by key), laid out as leveldb's TableBuilder lays it out.

    ``compress`` (a snappy compressor, for tests of older TensorFlow's files): blocks that it
    shrinks by at least an eighth are stored compressed, leveldb's rule.
    """
    out = bytearray()

    def write_block(block: _BlockBuilder) -> bytes:
        raw = block.finish()
        packed = compress(raw) if compress is not None else raw
        contents = (packed + bytes([SNAPPY]) if len(packed) < len(raw) - len(raw) // 8
                    else raw + bytes([NO_COMPRESSION]))
        handle = _put_varint(len(out)) + _put_varint(len(contents) - 1)
        out.extend(contents + struct.pack("<I", masked_crc32c(contents)))
        return handle

    data, index = _BlockBuilder(RESTART_INTERVAL), _BlockBuilder(1)
    pending: bytes | None = None  # the handle of the last data block, indexed once the next key is known
    last = b""
    for key, value in entries:
        if pending is not None:
            index.add(_shortest_separator(last, key), pending)
            pending = None
        data.add(key, value)
        last = key
        if data.size_estimate() >= BLOCK_SIZE:
            pending, data = write_block(data), _BlockBuilder(RESTART_INTERVAL)
    if data.counter or data.buffer:
        pending = write_block(data)
    metaindex = write_block(_BlockBuilder(RESTART_INTERVAL))
    if pending is not None:
        index.add(_short_successor(last), pending)
    index_handle = write_block(index)
    footer = (metaindex + index_handle).ljust(FOOTER_SIZE - 8, b"\0") + struct.pack("<Q", MAGIC)
    return bytes(out + footer)


# ------------------------------------------------------------ the bundle

class BundleReader:
    """The variables of a checkpoint prefix: ``entries`` (name -> Entry) from the index alone,
    tensors read one at a time with :meth:`read`, each checked against its crc32c."""

    def __init__(self, prefix: Path | str):
        self.prefix = Path(prefix)
        source = index_file(self.prefix)
        table = read_table(source)
        if not table or table[0][0] != b"":
            raise CheckpointError(f"{source}: no bundle header (not a tf.train.Saver checkpoint?)")
        try:
            self.num_shards = _parse_header(table[0][1], source)
            self.entries: dict[str, Entry] = {}
            for key, value in table[1:]:
                self.entries[key.decode("utf-8")] = Entry.parse(value)
        except (ValueError, IndexError, struct.error, UnicodeDecodeError) as err:
            raise CheckpointError(f"{source}: not a readable checkpoint index ({err})") from None

    def read(self, name: str) -> torch.Tensor:
        """The tensor ``name`` on the CPU, in its own dtype and shape."""
        entry = self.entries[name]
        source = index_file(self.prefix)
        if entry.sliced:
            raise CheckpointError(f"{source}: variable {name} is partitioned into slices, which is not supported")
        if entry.dtype not in DTYPES:
            raise CheckpointError(f"{source}: variable {name} has dtype "
                                  f"{DTYPE_NAMES.get(entry.dtype, entry.dtype)}, which is not supported")
        dtype = DTYPES[entry.dtype]
        count = int(np.prod(entry.shape, dtype=np.int64)) if entry.shape else 1
        expected = count * torch.empty((), dtype=dtype).element_size()
        if entry.size != expected or min(entry.shape, default=0) < 0 or not 0 <= entry.shard < self.num_shards:
            raise CheckpointError(f"{source}: variable {name}: {entry.size} bytes for shape "
                                  f"{list(entry.shape)} of {DTYPE_NAMES[entry.dtype]} (damaged index?)")
        raw = self.read_bytes(name)
        if masked_crc32c(raw) != entry.crc32c:
            raise CheckpointError(f"{self.shard(name)}: variable {name} fails its crc32c (damaged or edited)")
        if not raw:
            return torch.empty(entry.shape, dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(entry.shape)

    def shard(self, name: str) -> Path:
        """The data file that holds ``name``."""
        return data_file(self.prefix, self.entries[name].shard, self.num_shards)

    def read_bytes(self, name: str) -> bytes:
        """The stored bytes of ``name`` as they are (the caller checks them: a string's crc32c
        covers its length prefix too)."""
        entry, shard = self.entries[name], self.shard(name)
        try:
            with open(shard, "rb") as f:
                f.seek(entry.offset)
                raw = f.read(entry.size)
        except FileNotFoundError:
            raise CheckpointError(f"{shard}: missing (the data of {self.prefix.name})") from None
        except OSError as err:
            raise CheckpointError(f"{shard}: cannot be read ({err.strerror})") from None
        if len(raw) != entry.size:
            raise CheckpointError(f"{shard}: ends before variable {name} (truncated?)")
        return raw


def write_bundle(prefix: Path | str, tensors: dict[str, torch.Tensor]) -> None:
    """``PREFIX.index`` and ``PREFIX.data-00000-of-00001`` holding ``tensors``, byte for byte as
    TensorFlow's BundleWriter writes them (tensors in name order, one shard)."""
    prefix = Path(prefix)
    entries: list[tuple[bytes, bytes]] = [(b"", HEADER)]
    offset = 0
    with open(data_file(prefix, 0, 1), "wb") as f:
        for name in sorted(tensors, key=lambda n: n.encode("utf-8")):
            tensor = tensors[name].detach().cpu().contiguous()
            if tensor.dtype not in TF_DTYPES:
                raise CheckpointError(f"{name}: dtype {tensor.dtype} has no TensorFlow checkpoint equivalent")
            raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
            f.write(raw)
            entry = Entry(TF_DTYPES[tensor.dtype], tuple(tensor.shape), 0, offset, len(raw), masked_crc32c(raw))
            entries.append((name.encode("utf-8"), entry.serialize()))
            offset += len(raw)
    index_file(prefix).write_bytes(build_table(entries))
    fsync(data_file(prefix, 0, 1))
    fsync(index_file(prefix))
