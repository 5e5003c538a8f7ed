"""Bounded fuzzing of the record readers: damaged files give one-line DataErrors, never more.

Every case either reads correctly or raises DataError whose message is one
line naming the file; no other exception escapes, and no case allocates more
than a small multiple of the file's size (measured with tracemalloc, which
sees numpy's allocations). Each test uses a seeded RNG and a fixed number of
cases, so a failure reproduces with its case number.
"""

from __future__ import annotations

import json
import random
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from conftest import shared_data

from bertforge.data import native
from bertforge.data.errors import DataError
from bertforge.data.record_reader import open_records
from bertforge.data.record_schema import FEATURES
from bertforge.data.record_writer import write_records
from bertforge.data.rows import PretrainingArrays
from bertforge.data.tfrecord import HEADER_BYTES, masked_crc

SAMPLE = "tfrecord/graphcore_sample_text.tfrecord"
ALLOWANCE = 1 << 20  # bytes any case may allocate beyond a few times the file's size (numpy, json, messages)


def small_arrays(count: int = 24, seq_len: int = 32, predictions: int = 5, vocab: int = 300,
                 seed: int = 0) -> PretrainingArrays:
    """Valid records with every field varied, small enough to fuzz quickly."""
    rng = np.random.default_rng(seed)
    length = rng.integers(8, seq_len + 1, count)
    col = np.arange(seq_len)
    mask = (col < length[:, None]).astype(np.int8)
    segments = ((col >= length[:, None] // 2) & (mask > 0)).astype(np.int8)
    positions = np.sort(rng.integers(1, 8, (count, predictions)), axis=1).astype(np.int32)
    return PretrainingArrays(
        input_ids=(rng.integers(0, vocab, (count, seq_len)) * mask).astype(np.int32),
        segment_ids=segments, input_mask=mask, masked_lm_positions=positions,
        masked_lm_ids=rng.integers(0, vocab, (count, predictions)).astype(np.int32),
        masked_lm_weights=(rng.random((count, predictions)) < 0.8).astype(np.float32),
        next_sentence_labels=rng.integers(0, 2, count).astype(np.int64))


def check_case(path: Path, case: str, **kwargs) -> PretrainingArrays | None:
    """Open and read all of ``path``: its records, or None for a one-line DataError naming it.
    Fails the test on any other exception or on an allocation beyond the bound."""
    size = path.stat().st_size
    tracemalloc.start()
    try:
        with open_records(path, **kwargs) as records:
            return records.take(np.arange(len(records)))
    except DataError as err:
        message = str(err)
        assert "\n" not in message and message.startswith(f"{path}: "), f"{case}: {message!r}"
        return None
    except Exception as err:  # noqa: BLE001 - what the test is about
        pytest.fail(f"{case}: {type(err).__name__}: {err}")
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak <= 8 * size + ALLOWANCE, f"{case}: allocated {peak} bytes for a file of {size}"


def rows_of(arrays: PretrainingArrays) -> list[bytes]:
    """Each record as bytes, to compare records as a whole."""
    n = len(arrays)
    columns = [getattr(arrays, name).reshape(n, -1 if n else 0).astype(np.float64) for name in FEATURES]
    return [row.tobytes() for row in np.concatenate(columns, axis=1)]


class Tally:
    """Counts outcomes, and checks that a read that succeeded read the original records
    (``subset``: some of them, in order, as when bad records are skipped)."""

    def __init__(self, original: PretrainingArrays):
        self.original = rows_of(original)
        self.ok = self.errors = 0

    def __call__(self, result: PretrainingArrays | None, case: str, subset: bool = False) -> None:
        if result is None:
            self.errors += 1
            return
        self.ok += 1
        rows = rows_of(result)
        if subset:
            it = iter(self.original)
            assert all(row in it for row in rows), f"{case}: read records that are not in the original"
        else:
            assert rows == self.original, f"{case}: read different records without an error"


# ---------------------------------------------------------------- native

def _native_parts(data: bytes) -> tuple[bytes, dict]:
    """(the rows region with its preamble, the parsed header) of a native file."""
    _, _, _, offset, length, _ = native._PREAMBLE.unpack_from(data)
    return data[:offset], json.loads(data[offset:offset + length])


def _native_with(rows: bytes, header: object, text: bytes | None = None) -> bytes:
    """A native file of these rows and header (or header ``text``), with a valid preamble and checksum:
    what a hand edit that kept the file consistent would leave."""
    text = json.dumps(header).encode() if text is None else text
    import google_crc32c

    preamble = native._PREAMBLE.pack(native.MAGIC, native.VERSION, 0, len(rows), len(text),
                                     google_crc32c.value(text))
    return preamble + rows[native._PREAMBLE.size:] + text


_HUGE_AND_ODD = [10**9, 1e9, 2**31, 2**63, 2**64 + 1, 10**30, -1, -(2**63), 0, 1.5, float("nan"),
                 float("inf"), "128", "", None, True, False, [], [1], {}, {"a": 1}]


def _mutate_header(header: dict, rng: random.Random) -> tuple[dict, str]:
    """One edit of a header field (top level, a field description, or a checksum)."""
    header = json.loads(json.dumps(header))
    where = rng.random()
    if where < 0.6:
        key = rng.choice(sorted(header))
        target, label = header, key
    elif where < 0.85:
        entry = rng.choice(header["fields"])
        key = rng.choice(sorted(entry))
        target, label = entry, f"fields[{entry['name']}].{key}"
    else:
        crcs = header["block_crc32c"]
        if crcs and rng.random() < 0.5:
            target, key, label = dict(enumerate(crcs)), 0, "block_crc32c[0]"
            value = rng.choice(_HUGE_AND_ODD)
            header["block_crc32c"] = [value] + crcs[1:]
            return header, f"{label} = {value!r}"
        target, key, label = header, "block_crc32c", "block_crc32c"
    action = rng.random()
    if action < 0.1:
        del target[key]
        return header, f"del {label}"
    if action < 0.3 and isinstance(target[key], int) and not isinstance(target[key], bool):
        value = target[key] + rng.choice([-1, 1, 2, 64, 1 << 20])  # plausible but wrong
    elif action < 0.4 and isinstance(target[key], str):
        value = rng.choice(["<u2", "<i4", "<f8", "|O", "O", "<U4", "V8", "bits", "plain", "input_ids"])
    else:
        value = rng.choice(_HUGE_AND_ODD)
    target[key] = value
    return header, f"{label} = {value!r}"


def test_fuzzed_native_headers(tmp_path):
    """400 header edits (huge, negative, fractional, wrong-typed and missing values in every field,
    checksum fixed as a hand edit leaves it) + 8 whole-header replacements: about 1 s."""
    arrays = small_arrays()
    good = write_records(tmp_path / "good.bfrec", arrays, "native", vocab_size=300).read_bytes()
    rows, header = _native_parts(good)
    rng = random.Random(11)
    path = tmp_path / "x.bfrec"
    tally = Tally(arrays)
    cases = [_mutate_header(header, rng) for _ in range(400)]
    texts = [b"", b"null", b"[]", b"1e999", b"{" * 100_000, b'{"count": ' + b"9" * 5000 + b"}",
             b"\xff\xfe{}", json.dumps({**header, "seq_len": 10**9}).encode()]
    for i, (edited, label) in enumerate(cases + [(None, f"header text {t[:20]!r}") for t in texts]):
        text = texts[i - len(cases)] if edited is None else None
        path.write_bytes(_native_with(rows, edited, text))
        tally(check_case(path, f"case {i}: {label}"), f"case {i}: {label}")
    # Most edits are errors; a few are harmless (a larger vocab_size, the same value again …).
    assert tally.errors >= 350 and tally.ok + tally.errors == 408
    path.write_bytes(_native_with(rows, {**header, "seq_len": 10**9}))
    with pytest.raises(DataError) as err:
        open_records(path)
    assert str(err.value) == f"{path}: header field 'seq_len' is 1000000000, expected an integer in 1..65536"
    path.write_bytes(_native_with(rows, {**header, "count": 1e9}))
    with pytest.raises(DataError) as err:
        open_records(path)
    assert str(err.value) == f"{path}: header field 'count' is 1000000000.0, expected an integer"


def test_fuzzed_native_preambles_truncations_and_flips(tmp_path):
    """100 preamble field edits (offsets and lengths up to 2**64 - 1), 100 truncations, 200 random
    byte flips anywhere in the file (checksums not fixed): about 1 s."""
    arrays = small_arrays()
    good = write_records(tmp_path / "good.bfrec", arrays, "native", vocab_size=300).read_bytes()
    rng = random.Random(12)
    path = tmp_path / "x.bfrec"
    tally = Tally(arrays)
    for i in range(100):
        fields = list(native._PREAMBLE.unpack_from(good))
        slot = rng.randrange(1, 6)
        limit = (1 << 32) - 1 if slot in (1, 2, 5) else (1 << 64) - 1
        fields[slot] = rng.choice([0, 1, limit, fields[slot] + 1, fields[slot] - 1, rng.randrange(limit)])
        fields[slot] = min(max(fields[slot], 0), limit)
        path.write_bytes(native._PREAMBLE.pack(*fields) + good[native._PREAMBLE.size:])
        case = f"preamble case {i}: field {slot} = {fields[slot]}"
        tally(check_case(path, case), case)
    for i in range(100):
        cut = rng.randrange(len(good))
        path.write_bytes(good[:cut])
        assert check_case(path, f"truncation {i} at {cut}") is None
    for i in range(200):
        data = bytearray(good)
        for _ in range(rng.randint(1, 3)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
        tally(check_case(path, f"flip case {i}", vocab_size=300), f"flip case {i}")
    # Every byte is covered by a checksum or a check (no single-bit flip of this file passes: checked
    # once, exhaustively); what passes here is a preamble "edit" to the value it had (flags 0, …).
    assert tally.errors >= 280 and tally.ok + tally.errors == 300


# ---------------------------------------------------------------- TFRecord

def _frame_offsets(data: bytes) -> list[int]:
    out, position = [], 0
    while position < len(data):
        out.append(position)
        position += 16 + struct.unpack_from("<Q", data, position)[0]
    return out


def _fuzz_tfrecord(good: bytes, path: Path, rng: random.Random, cases: int) -> Tally:
    """``cases`` of each: byte flips, truncations, length-field edits (with the length's checksum
    fixed half the time), and data edits with both checksums fixed (the parser's own checks).

    Each is read verified (then it reads the original records or fails), verified skipping bad
    records (then it reads some of them, in order), and unverified (data checksums not read, by
    design: only the one-line error or none is checked)."""
    offsets = _frame_offsets(good)
    path.write_bytes(good)
    tally = Tally(check_case(path, "the original"))

    def run(data: bytes, case: str, same: bool = True) -> None:
        path.write_bytes(data)
        verified = check_case(path, case)
        skipping = check_case(path, case, max_bad=1000, vocab_size=30522)
        check_case(path, case, verify=False)
        if same:  # (an edit with its checksums fixed may be a valid record: only no crash is checked)
            tally(verified, case)
            tally(skipping, case, subset=True)

    for i in range(cases):
        data = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        run(bytes(data), f"flip case {i}")
    for i in range(cases):
        run(good[:rng.randrange(len(good))], f"truncation {i}")
    for i in range(cases):
        data = bytearray(good)
        at = rng.choice(offsets)
        length = struct.unpack_from("<Q", data, at)[0]
        new = rng.choice([0, 1, length - 1, length + 1, length * 2, 2**31, 2**63, 2**64 - 1,
                          rng.randrange(2**64)])
        struct.pack_into("<Q", data, at, min(max(new, 0), 2**64 - 1))
        if rng.random() < 0.5:
            struct.pack_into("<I", data, at + 8, masked_crc(bytes(data[at:at + 8])))
        run(bytes(data), f"length case {i} at {at}: {new}")
    for i in range(cases):
        data = bytearray(good)
        at = rng.choice(offsets)
        length = struct.unpack_from("<Q", data, at)[0]
        for _ in range(rng.randint(1, 3)):
            data[at + HEADER_BYTES + rng.randrange(length)] = rng.randrange(256)
        end = at + HEADER_BYTES + length
        struct.pack_into("<I", data, end, masked_crc(bytes(data[at + HEADER_BYTES:end])))
        run(bytes(data), f"data case {i} at {at}", same=False)  # may be a valid edit
    return tally


def test_fuzzed_tfrecords_of_our_writer(tmp_path):
    """4 × 50 damaged copies of a 24-record file our writer made, each read three ways
    (verified, skipping bad records, unverified with every record taken): about 7 s."""
    good = write_records(tmp_path / "good.tfrecord", small_arrays(), "tfrecord").read_bytes()
    tally = _fuzz_tfrecord(good, tmp_path / "x.tfrecord", random.Random(13), 50)
    assert tally.ok + tally.errors == 300 and tally.errors >= 150


@pytest.mark.shared_data
def test_fuzzed_tfrecords_of_the_graphcore_sample(tmp_path):
    """4 × 35 damaged copies of the shared 45-record sample (TensorFlow's own key order), each
    read three ways: about 9 s."""
    good = shared_data(SAMPLE).read_bytes()
    tally = _fuzz_tfrecord(good, tmp_path / "x.tfrecord", random.Random(14), 35)
    assert tally.ok + tally.errors == 210 and tally.errors >= 105
