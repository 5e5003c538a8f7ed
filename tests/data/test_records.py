"""Record files: TFRecord (read other tools' records, byte-exact encoding) and the native format."""

from __future__ import annotations

import itertools
import pickle
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from conftest import shared_data

from bertforge.data.errors import DataError
from bertforge.data.record_inspect import describe
from bertforge.data.record_reader import index_path_for, open_records, read_records, write_index
from bertforge.data.record_schema import FEATURES, FORMATS, detect_format
from bertforge.data.record_writer import RecordEncoder, RecordWriter, write_records
from bertforge.data.rows import PretrainingArrays
from bertforge.data.tfrecord import (
    FLOAT,
    INT64,
    FormatError,
    encode_records,
    example_features,
    example_spans,
    masked_crc,
)

SAMPLE = "tfrecord/graphcore_sample_text.tfrecord"
SAMPLE_INDEX = "tfrecord/graphcore_sample_text.index"
VOCAB = "vocab/bert-base-uncased-vocab.txt"
KINDS = {name: FLOAT if name == "masked_lm_weights" else INT64 for name in FEATURES}
DTYPES = {"input_ids": np.int32, "segment_ids": np.int8, "input_mask": np.int8,
          "masked_lm_positions": np.int32, "masked_lm_ids": np.int32,
          "masked_lm_weights": np.float32, "next_sentence_labels": np.int64}


def assert_equal_arrays(a: PretrainingArrays, b: PretrainingArrays) -> None:
    for name in FEATURES:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype == DTYPES[name], name
        np.testing.assert_array_equal(x, y, err_msg=name)


def frames(path: Path) -> list[tuple[int, int]]:
    """(offset, data length) of each TFRecord frame, read with struct as a cross-check."""
    raw = path.read_bytes()
    out, position = [], 0
    while position < len(raw):
        length, = struct.unpack_from("<Q", raw, position)
        out.append((position, length))
        position += 16 + length
    return out


def framed(data: bytes) -> bytes:
    """One TFRecord frame around ``data``."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc(length)) + data + struct.pack("<I", masked_crc(data))


@pytest.fixture(scope="module")
def sample() -> Path:
    return shared_data(SAMPLE)


@pytest.fixture(scope="module")
def sample_arrays(sample) -> PretrainingArrays:
    return read_records(sample)


@pytest.fixture(scope="module")
def many(sample_arrays) -> PretrainingArrays:
    """3000 real records: the sample's 45 repeated, with the order shuffled."""
    order = np.random.default_rng(0).permutation(np.arange(3000) % 45)
    return sample_arrays.take(order)


# ---------------------------------------------------------------- TFRecord framing and other tools' files

@pytest.mark.smoke
def test_masked_crc32c():
    # crc32c("123456789") = 0xE3069283, the standard check value; masked by hand:
    # (0x1C60D | 0x25060000) + 0xA282EAD8 = 0xC78AB0E5 (mod 2**32).
    assert masked_crc(b"123456789") == 0xC78AB0E5
    assert masked_crc(b"") == 0xA282EAD8  # crc32c of nothing is 0


def test_reads_the_graphcore_sample(sample, sample_arrays):
    with open_records(sample, vocab_size=30522) as records:
        assert (len(records), records.seq_len, records.max_predictions, records.skipped) == (45, 128, 20, 0)
        assert [records.offset(i) for i in range(45)] == [offset for offset, _ in frames(sample)]
    a = sample_arrays
    assert a.input_ids.shape == (45, 128) and a.masked_lm_ids.shape == (45, 20)
    lengths = a.input_mask.sum(axis=1)
    # input_mask is 1 exactly on the real tokens; padding is 0 everywhere.
    np.testing.assert_array_equal(a.input_mask, np.arange(128) < lengths[:, None])
    assert (a.input_ids[a.input_mask == 0] == 0).all() and (a.segment_ids[a.input_mask == 0] == 0).all()
    assert (a.input_ids[:, 0] == 101).all()  # [CLS]
    assert (a.input_ids[np.arange(45), lengths - 1] == 102).all()  # [SEP] last
    # Segment B starts right after the first [SEP] and runs to the end.
    first_sep = np.argmax(a.input_ids == 102, axis=1)
    np.testing.assert_array_equal(a.segment_ids, (np.arange(128) > first_sep[:, None]) & (a.input_mask == 1))
    assert set(a.next_sentence_labels.tolist()) == {0, 1}
    assert int(a.next_sentence_labels.sum()) == 20
    # Predictions fill the first slots; positions are sorted and inside the sequence.
    real = a.masked_lm_weights > 0
    np.testing.assert_array_equal(real, np.arange(20) < real.sum(axis=1, keepdims=True))
    assert all((np.diff(positions[used]) > 0).all() for positions, used in zip(a.masked_lm_positions, real))
    assert (a.masked_lm_positions[real] < np.repeat(lengths, real.sum(axis=1))).all()

    # Record 0, checked by hand against the vocab file (id = line number - 1):
    # [CLS] the [MASK] from his wood pile refused to [MASK] [MASK] a fire to [MASK] his bed [MASK] clothes ,
    assert a.input_ids[0, :20].tolist() == [101, 1996, 103, 2013, 2010, 3536, 8632, 4188, 2000, 103, 103,
                                            1037, 2543, 2000, 103, 2010, 2793, 103, 4253, 1010]
    assert a.masked_lm_positions[0, :5].tolist() == [2, 9, 10, 14, 17]
    assert a.masked_lm_ids[0, :5].tolist() == [11772, 2785, 2571, 4318, 1011]  # chips kind ##le dry -
    assert a.next_sentence_labels[0] == 0

    # With the masks undone, record 0 is sample_text.txt's text.
    vocab = shared_data(VOCAB).read_text(encoding="utf-8").split("\n")
    ids = a.input_ids[0, :lengths[0]].copy()
    ids[a.masked_lm_positions[0][real[0]]] = a.masked_lm_ids[0][real[0]]
    text = " ".join(vocab[i] for i in ids).replace(" ##", "")
    assert text.startswith("[CLS] the chips from his wood pile refused to kindle a fire to dry his "
                           "bed - clothes , and he had recourse to a more provident neighbor ' s")
    sample_text = shared_data("text/sample_text.txt").read_text(encoding="utf-8").lower()
    assert "the chips from his wood pile refused to kindle a fire to dry his bed-clothes" in sample_text


def test_reencoding_the_sample_is_byte_identical(sample, sample_arrays):
    raw = sample.read_bytes()
    orders = set()
    for i, (offset, length) in enumerate(frames(sample)):
        start = offset + 12
        order = list(example_features(raw, start, start + length))
        orders.add(tuple(order))
        columns = {name: getattr(sample_arrays, name)[i:i + 1].reshape(1, -1) for name in FEATURES}
        assert encode_records(columns, KINDS, order) == raw[offset:start + length + 4], i
    # TensorFlow wrote the map in hash order, different from record to record, so no
    # fixed order reproduces its file; ours is sorted (protobuf's deterministic order).
    assert len(orders) == 45


def test_default_order_is_sorted_and_values_equal(tmp_path, sample, sample_arrays):
    out = write_records(tmp_path / "x.tfrecord", sample_arrays)
    raw = out.read_bytes()
    (_, length), = frames(out)[:1]
    assert list(example_features(raw, 12, 12 + length)) == sorted(FEATURES)
    assert len(frames(out)) == 45
    # Same records, so each frame is exactly as long as TensorFlow's.
    assert [n for _, n in frames(out)] == [n for _, n in frames(sample)]
    assert_equal_arrays(read_records(out), sample_arrays)


def _protobuf_example_class():
    """tf.train.Example built from its .proto definition with the protobuf library (an oracle)."""
    descriptor_pb2 = pytest.importorskip("google.protobuf.descriptor_pb2")
    from google.protobuf import descriptor_pool, message_factory

    F = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(name="bertforge_test/example.proto", package="bftest",
                                              syntax="proto3")

    def message(name: str, *fields):
        m = file.message_type.add(name=name)
        for field_name, number, kind, label, type_name in fields:
            m.field.add(name=field_name, number=number, type=kind, label=label, type_name=type_name)
        return m

    repeated, optional = F.LABEL_REPEATED, F.LABEL_OPTIONAL
    message("BytesList", ("value", 1, F.TYPE_BYTES, repeated, None))
    message("FloatList", ("value", 1, F.TYPE_FLOAT, repeated, None))  # proto3: packed
    message("Int64List", ("value", 1, F.TYPE_INT64, repeated, None))
    feature = message("Feature", ("bytes_list", 1, F.TYPE_MESSAGE, optional, ".bftest.BytesList"),
                      ("float_list", 2, F.TYPE_MESSAGE, optional, ".bftest.FloatList"),
                      ("int64_list", 3, F.TYPE_MESSAGE, optional, ".bftest.Int64List"))
    feature.oneof_decl.add(name="kind")
    for field in feature.field:
        field.oneof_index = 0
    features = message("Features", ("feature", 1, F.TYPE_MESSAGE, repeated, ".bftest.Features.FeatureEntry"))
    entry = features.nested_type.add(name="FeatureEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=F.TYPE_STRING, label=optional)
    entry.field.add(name="value", number=2, type=F.TYPE_MESSAGE, label=optional, type_name=".bftest.Feature")
    message("Example", ("features", 1, F.TYPE_MESSAGE, optional, ".bftest.Features"))
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("bftest.Example"))


@pytest.mark.smoke
def test_protobuf_reads_ours_and_serializes_the_same_bytes(tmp_path, sample, sample_arrays):
    Example = _protobuf_example_class()
    out = write_records(tmp_path / "x.tfrecord", sample_arrays)
    raw, theirs = out.read_bytes(), sample.read_bytes()
    for i, ((offset, length), (t_offset, t_length)) in enumerate(zip(frames(out), frames(sample))):
        example = Example.FromString(raw[offset + 12:offset + 12 + length])
        feature = example.features.feature
        for name in FEATURES:
            kind = "float_list" if name == "masked_lm_weights" else "int64_list"
            assert feature[name].WhichOneof("kind") == kind
            np.testing.assert_array_equal(np.array(getattr(feature[name], kind).value),
                                          getattr(sample_arrays, name)[i].reshape(-1))
        # Our bytes are protobuf's deterministic serialization, and protobuf
        # reads TensorFlow's record as the same message.
        assert example.SerializeToString(deterministic=True) == raw[offset + 12:offset + 12 + length]
        assert Example.FromString(theirs[t_offset + 12:t_offset + 12 + t_length]) == example


@pytest.mark.parametrize("values", [
    [[0, 1, 127], [5, 6, 7]],  # one byte each
    [[128, 300, 16383], [200, 201, 202]],  # two bytes each
    [[0, 128, 16384], [65535, 3, 129]],  # mixed sizes, from the table of small values
    [[65536, 1, (1 << 28) - 1], [1 << 21, 127, 128]],  # mixed, up to four bytes
    [[1 << 28, -1, 0], [(1 << 63) - 1, -(1 << 63), 1 << 35]],  # up to ten bytes
])
def test_varint_widths_serialize_as_protobuf_does(values):
    Example = _protobuf_example_class()
    ids = np.array(values, np.int64)
    columns = {"ids": ids, "label": np.array([[1], [0]]), "w": np.array([[0.5, -2.0], [1e30, 0.0]])}
    kinds = {"ids": INT64, "label": INT64, "w": FLOAT}
    raw = encode_records(columns, kinds)
    expected = b""
    for i in range(len(ids)):
        example = Example()
        example.features.feature["ids"].int64_list.value.extend(ids[i].tolist())
        example.features.feature["label"].int64_list.value.extend(columns["label"][i].tolist())
        example.features.feature["w"].float_list.value.extend(columns["w"][i].tolist())
        expected += framed(example.SerializeToString(deterministic=True))
    assert raw == expected


def test_index_is_byte_identical_to_tfrecord2idx(tmp_path, sample):
    expected = shared_data(SAMPLE_INDEX).read_bytes()
    assert write_index(sample, tmp_path / "given.index").read_bytes() == expected
    copy = tmp_path / "graphcore_sample_text.tfrecord"
    shutil.copyfile(sample, copy)
    assert write_index(copy) == tmp_path / "graphcore_sample_text.index"
    assert (tmp_path / "graphcore_sample_text.index").read_bytes() == expected
    assert expected.startswith(b"0 841\n841 788\n1629 830\n") and expected.count(b"\n") == 45
    # Shard names that do not end in .tfrecord keep their whole name.
    assert index_path_for("d/wiki.tfrecord-00001-of-00010") == Path("d/wiki.tfrecord-00001-of-00010.index")
    assert index_path_for("d/part_7.tfrecords") == Path("d/part_7.index")


# ---------------------------------------------------------------- round trips

@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip(tmp_path, fmt, many):
    path = write_records(tmp_path / f"x.{fmt}", many, fmt, vocab_size=30522)
    assert detect_format(path) == fmt
    with open_records(path, vocab_size=30522) as records:
        assert (len(records), records.format, records.seq_len, records.max_predictions) == (3000, fmt, 128, 20)
        assert_equal_arrays(records.take(np.arange(3000)), many)
        # Any order, repeats allowed; an empty take has the right shapes.
        picks = [2999, 0, 17, 17, 1500, 3]
        assert_equal_arrays(records.take(picks), many.take(picks))
        empty = records.take([])
        assert empty.input_ids.shape == (0, 128) and empty.masked_lm_weights.shape == (0, 20)
        with pytest.raises(IndexError, match="record index 3000 out of range"):
            records.take([0, 3000])
        # Loader workers get the file by pickling.
        clone = pickle.loads(pickle.dumps(records))
        assert_equal_arrays(clone.take(picks), many.take(picks))
        clone.close()


def test_tfrecord_to_native_to_tfrecord(tmp_path, sample, sample_arrays):
    native = write_records(tmp_path / "a.bfrec", read_records(sample), "native", vocab_size=30522)
    back = write_records(tmp_path / "b.tfrecord", read_records(native), "tfrecord")
    assert_equal_arrays(read_records(back), sample_arrays)
    assert back.read_bytes() == write_records(tmp_path / "c.tfrecord", sample_arrays).read_bytes()


def test_native_ids_wider_than_uint16(tmp_path, sample_arrays):
    a = sample_arrays.take(slice(0, 5))
    a.input_ids = a.input_ids.copy()
    a.input_ids[3, 7] = 70000  # a large vocab: ids no longer fit 16 bits
    path = write_records(tmp_path / "wide.bfrec", a, "native")
    with open_records(path) as records:
        assert records.header.dtype["input_ids"].base == np.dtype("<i4")
        assert_equal_arrays(records.take(np.arange(5)), a)
    with pytest.raises(DataError, match=r"record 3 \(byte offset \d+\): input_ids\[7\] = 70000 is not a "
                                        r"token id in \[0, 30522\)"):
        open_records(path, vocab_size=30522)


@pytest.mark.parametrize("fmt", FORMATS)
def test_streaming_writer_equals_write_records(tmp_path, fmt, many):
    whole = write_records(tmp_path / f"whole.{fmt}", many, fmt, vocab_size=30522)
    cuts = [0, 1, 1, 700, 2999, 3000]  # includes an empty write
    with RecordWriter(tmp_path / f"parts.{fmt}", fmt, 128, 20, vocab_size=30522) as writer:
        for start, stop in itertools.pairwise(cuts):
            writer.write(many.take(slice(start, stop)))
        assert writer.count == 3000
    assert (tmp_path / f"parts.{fmt}").read_bytes() == whole.read_bytes()


@pytest.mark.parametrize("fmt", FORMATS)
def test_encoded_records_appended_round_robin_equal_written_rows(tmp_path, fmt, many):
    """What worker processes do: encode batches elsewhere; the writers only append the bytes."""
    files = 3
    expected = [write_records(tmp_path / f"rows{k}.{fmt}", many.take(slice(k, None, files)), fmt,
                              vocab_size=30522) for k in range(files)]
    encoder = RecordEncoder(fmt, 128, 20, vocab_size=30522)
    paths = [tmp_path / f"encoded{k}.{fmt}" for k in range(files)]
    writers = [RecordWriter(path, fmt, 128, 20, vocab_size=30522) for path in paths]
    done = 0
    for start, stop in itertools.pairwise([0, 1, 1, 700, 2999, 3000]):  # includes an empty batch
        records = encoder.encode(many.take(slice(start, stop)), where="batch", first=start)
        assert len(records) == stop - start and records.data.dtype == np.uint8
        assert records.ends[-1:].tolist() == ([len(records.data)] if stop > start else [])
        for k, writer in enumerate(writers):
            writer.write_encoded(records.take(slice((k - done) % files, None, files)))
        done += len(records)
    for writer in writers:
        writer.close()
    assert [w.count for w in writers] == [1000, 1000, 1000]
    for path, want in zip(paths, expected, strict=True):
        assert path.read_bytes() == want.read_bytes()
    with open_records(paths[1]) as records:
        assert records.offset(1) == int(encoder.encode(many.take(slice(1, 2))).ends[0]) + (
            0 if fmt == "tfrecord" else 64)  # native rows start after the 64-byte preamble


def test_encoder_checks_rows_and_layouts(tmp_path, sample_arrays):
    encoder = RecordEncoder("native", 128, 20, vocab_size=30522)
    bad = sample_arrays.take(slice(0, 4))
    bad.input_ids = bad.input_ids.copy()
    bad.input_ids[2, 9] = 30522
    with pytest.raises(DataError, match=r"^chunk 7: record 12 \(row 2 of this write\): input_ids\[9\] = 30522 "
                                        r"is not a token id in \[0, 30522\) \(vocab_size\)$"):
        encoder.encode(bad, where="chunk 7", first=10)
    records = encoder.encode(sample_arrays.take(slice(0, 4)))
    assert records.max_ids.tolist() == np.maximum(sample_arrays.input_ids[:4].max(axis=1),
                                                  sample_arrays.masked_lm_ids[:4].max(axis=1)).tolist()
    for other in (RecordWriter(tmp_path / "x.tfrecord", "tfrecord", 128, 20, vocab_size=30522),
                  RecordWriter(tmp_path / "x.bfrec", "native", 128, 20, vocab_size=70000),
                  RecordWriter(tmp_path / "y.bfrec", "native", 512, 20, vocab_size=30522)):
        with pytest.raises(ValueError, match="do not fit this file"):
            other.write_encoded(records)
        other.abort()
    with RecordWriter(tmp_path / "ok.bfrec", "native", 128, 20, vocab_size=30522) as writer:
        writer.write_encoded(records)
    assert read_records(tmp_path / "ok.bfrec").input_ids.tolist() == sample_arrays.input_ids[:4].tolist()


@pytest.mark.parametrize("fmt", FORMATS)
def test_empty_file(tmp_path, fmt):
    with RecordWriter(tmp_path / f"empty.{fmt}", fmt, 128, 20) as writer:
        pass
    assert writer.count == 0
    with open_records(tmp_path / f"empty.{fmt}") as records:
        assert len(records) == 0
        assert records.take([]).input_ids.shape[0] == 0
    size = (tmp_path / f"empty.{fmt}").stat().st_size
    assert size == 0 if fmt == "tfrecord" else 64 < size < 4096  # native: the preamble and header


def test_native_is_smaller_and_laid_out_as_documented(tmp_path, many):
    tf_path = write_records(tmp_path / "x.tfrecord", many, "tfrecord")
    native_path = write_records(tmp_path / "x.bfrec", many, "native", vocab_size=30522)
    with open_records(native_path) as records:
        # 80 weight + 256 id + 40 target + 20 position + 16 + 16 mask/segment bits + 1 label, to 4-byte alignment
        assert records.header.dtype.itemsize == 432
        header_bytes = native_path.stat().st_size - 64 - 3000 * 432
        assert 0 < header_bytes < 4096
    assert tf_path.stat().st_size == sum(16 + n for _, n in frames(tf_path))
    assert native_path.stat().st_size < 0.55 * tf_path.stat().st_size


# ---------------------------------------------------------------- damage and validation

def _copy(sample: Path, tmp_path: Path, name: str = "x.tfrecord") -> Path:
    path = tmp_path / name
    shutil.copyfile(sample, path)
    path.chmod(0o644)
    return path


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def test_corrupt_record_is_named_by_offset_and_skipping_is_bounded(tmp_path, sample, sample_arrays):
    path = _copy(sample, tmp_path)
    offsets = [offset for offset, _ in frames(sample)]
    _flip(path, offsets[3] + 12 + 40)  # inside record 3's data
    with pytest.raises(DataError) as err:
        open_records(path)
    assert str(err.value) == (f"{path}: record 3 (byte offset {offsets[3]}): corrupt record data "
                              "(its checksum does not match)")
    with open_records(path, max_bad=1) as records:
        assert (len(records), records.skipped) == (44, 1)
        assert records.errors == [str(err.value)]
        assert_equal_arrays(records.take(np.arange(44)), sample_arrays.take([i for i in range(45) if i != 3]))
        assert records.offset(3) == offsets[4]
    # Without verification the data checksums are not read: the damage goes unnoticed here.
    _flip(path, offsets[3] + 12 + 40)
    _flip(path, offsets[5] - 1)  # record 4's data checksum
    with open_records(path, verify=False) as records:
        assert len(records) == 45
        assert_equal_arrays(records.take(np.arange(45)), sample_arrays)
    _flip(path, offsets[9] - 2)  # and record 8's
    with pytest.raises(DataError, match=rf"record 8 \(byte offset {offsets[8]}\).*\(2 bad records, "
                                        r"more than max_bad=1\)"):
        open_records(path, max_bad=1)


def test_damaged_length_and_truncation(tmp_path, sample, sample_arrays):
    offsets = [offset for offset, _ in frames(sample)]
    path = _copy(sample, tmp_path)
    _flip(path, offsets[10] + 1)  # record 10's length: the rest cannot be framed, even with max_bad
    with pytest.raises(DataError, match=rf"record 10 \(byte offset {offsets[10]}\): corrupt record length"):
        open_records(path, max_bad=5)

    path = _copy(sample, tmp_path, "cut.tfrecord")
    size = path.stat().st_size
    with open(path, "r+b") as file:
        file.truncate(size - 100)
    with pytest.raises(DataError, match=rf"record 44 \(byte offset {offsets[44]}\): truncated record"):
        open_records(path)
    with open_records(path, max_bad=1) as records:
        assert (len(records), records.skipped) == (44, 1)
        assert_equal_arrays(records.take(np.arange(44)), sample_arrays.take(slice(0, 44)))
    with open(path, "r+b") as file:
        file.truncate(offsets[44] + 5)  # inside the header of the last record
    with pytest.raises(DataError, match="truncated record: 5 bytes left"):
        open_records(path)
    with pytest.raises(DataError, match="truncated record"):
        write_index(path)


def test_token_ids_beyond_the_vocab_and_wrong_lengths(tmp_path, sample_arrays):
    a = sample_arrays.take(slice(0, 6))
    a.masked_lm_ids = a.masked_lm_ids.copy()
    a.masked_lm_ids[4, 2] = 30522
    for fmt in FORMATS:
        path = write_records(tmp_path / f"big.{fmt}", a, fmt)  # no vocab given: accepted
        with open_records(path) as records:
            offset = records.offset(4)
        with pytest.raises(DataError) as err:
            open_records(path, vocab_size=30522)
        assert str(err.value) == (f"{path}: record 4 (byte offset {offset}): masked_lm_ids[2] = 30522 "
                                  "is not a token id in [0, 30522) (vocab_size)")
    with pytest.raises(DataError, match=r"record 4 \(row 4 of this write\): masked_lm_ids\[2\] = 30522"):
        write_records(tmp_path / "refused.tfrecord", a, vocab_size=30522)
    assert not (tmp_path / "refused.tfrecord").exists()

    # A file whose records have different lengths: the first record sets seq_len.
    short = PretrainingArrays(**{name: getattr(a, name)[:, :64] if name in ("input_ids", "input_mask", "segment_ids")
                                 else getattr(a, name) for name in FEATURES})
    short.masked_lm_positions = np.minimum(short.masked_lm_positions, 63)
    first = write_records(tmp_path / "128.tfrecord", a.take(slice(0, 2)))
    second = write_records(tmp_path / "64.tfrecord", short)
    mixed = tmp_path / "mixed.tfrecord"
    mixed.write_bytes(first.read_bytes() + second.read_bytes())
    offset = first.stat().st_size
    with pytest.raises(DataError) as err:
        open_records(mixed)
    assert str(err.value) == (f"{mixed}: record 2 (byte offset {offset}): feature input_ids has 64 values, "
                              "expected 128 (seq_len 128, max_predictions 20 as in the file's first record)")
    with open_records(mixed, max_bad=6) as records:
        assert (len(records), records.skipped, records.seq_len) == (2, 6, 128)
    # Records keep their file-order numbers in messages after a skipped one.
    _flip(mixed, offset - 2)  # record 1's data checksum
    with open_records(mixed, max_bad=7) as records:
        assert (len(records), records.skipped) == (1, 7)
        assert records.errors[0] == (f"{mixed}: record 1 (byte offset {frames(mixed)[1][0]}): corrupt record "
                                     "data (its checksum does not match)")
        assert records.errors[1].startswith(f"{mixed}: record 2 (byte offset {offset}): feature input_ids")


def test_writer_rejects_bad_rows_and_shapes(tmp_path, sample_arrays):
    path = tmp_path / "x.tfrecord"
    with RecordWriter(path, "tfrecord", 128, 20, vocab_size=30522) as writer:
        writer.write(sample_arrays.take(slice(0, 3)))
        bad = sample_arrays.take(slice(3, 6))
        bad.segment_ids = bad.segment_ids.copy()
        bad.segment_ids[1, 5] = 2
        with pytest.raises(DataError, match=r"record 4 \(row 1 of this write\): segment_ids\[5\] = 2 is not 0 or 1"):
            writer.write(bad)
        with pytest.raises(DataError, match=r"input_ids has shape \(3, 64\), expected \(3, 128\)"):
            writer.write(PretrainingArrays(**{**vars(sample_arrays.take(slice(0, 3))),
                                              "input_ids": sample_arrays.input_ids[:3, :64]}))
        positions = sample_arrays.take(slice(0, 2))
        positions.masked_lm_positions = positions.masked_lm_positions + 128
        with pytest.raises(DataError, match=r"masked_lm_positions\[0\] = 130 is not a position in \[0, 128\)"):
            writer.write(positions)
        assert writer.count == 3
    assert_equal_arrays(read_records(path), sample_arrays.take(slice(0, 3)))


@pytest.mark.parametrize("fmt", FORMATS)
def test_failed_writer_leaves_nothing(tmp_path, fmt, sample_arrays):
    path = tmp_path / f"shard.{fmt}"
    with pytest.raises(RuntimeError, match="crash"), RecordWriter(path, fmt, 128, 20) as writer:
        writer.write(sample_arrays)
        assert not path.exists()
        raise RuntimeError("crash")
    assert list(tmp_path.iterdir()) == []
    writer = RecordWriter(path, fmt, 128, 20)
    writer.write(sample_arrays)
    writer.abort()
    assert list(tmp_path.iterdir()) == []
    assert RecordWriter(path, fmt, 128, 20).close() == path and path.exists()


def test_damaged_native_files(tmp_path, sample_arrays):
    path = write_records(tmp_path / "x.bfrec", sample_arrays, "native", vocab_size=30522)
    size = path.stat().st_size
    good = path.read_bytes()

    _flip(path, 64 + 432 * 7 + 100)  # a byte of record 7
    with pytest.raises(DataError) as err:
        open_records(path)
    assert str(err.value) == f"{path}: corrupt data in the block at byte offset 64 (its checksum does not match)"
    with open_records(path, verify=False) as records:  # the header alone is checked
        assert len(records) == 45

    path.write_bytes(good[:-1])
    with pytest.raises(DataError, match=rf"truncated or damaged: the preamble says {size} bytes, "
                                        rf"the file has {size - 1}"):
        open_records(path)
    path.write_bytes(good[:size - 10] + b"X" + good[size - 9:])
    with pytest.raises(DataError, match=r"corrupt header at byte offset \d+"):
        open_records(path)
    path.write_bytes(good[:64 + 432 * 45 - 432] + good[64 + 432 * 45:])  # a whole row missing
    with pytest.raises(DataError, match="truncated or damaged"):
        open_records(path)


def test_detect_format(tmp_path, sample_arrays):
    assert detect_format(write_records(tmp_path / "a", sample_arrays, "native")) == "native"
    assert detect_format(write_records(tmp_path / "b", sample_arrays, "tfrecord")) == "tfrecord"
    (tmp_path / "c.tfrecord").write_bytes(b"")
    assert detect_format(tmp_path / "c.tfrecord") == "tfrecord"
    (tmp_path / "d.txt").write_text("hello, world\n")
    with pytest.raises(DataError, match=r"d.txt: neither a TFRecord nor a bertforge native record file "
                                        r"\(first bytes: 68 65 6c 6c 6f 2c 20 77\)"):
        open_records(tmp_path / "d.txt")
    with pytest.raises(DataError, match="record file not found"):
        detect_format(tmp_path / "missing")


def test_unusual_but_valid_protobuf_layouts(tmp_path, sample_arrays):
    """A map entry with its value before its key, and an extra bytes feature, go the slow path."""
    def varint(value: int) -> bytes:
        out = b""
        while True:
            out += bytes([value & 0x7F | (0x80 if value > 0x7F else 0)])
            value >>= 7
            if not value:
                return out

    def field(number: int, payload: bytes) -> bytes:
        return varint(number << 3 | 2) + varint(len(payload)) + payload

    def record(i: int, swap: bool, extra: bool) -> bytes:
        entries = []
        for name in FEATURES:
            values = getattr(sample_arrays, name)[i].reshape(-1)
            if name == "masked_lm_weights":
                feature = field(2, field(1, values.astype("<f4").tobytes()))
            else:
                feature = field(3, field(1, b"".join(varint(int(v)) for v in values)))
            key, value = field(1, name.encode()), field(2, feature)
            entries.append(field(1, value + key if swap and name == "input_ids" else key + value))
        if extra:
            entries.append(field(1, field(1, b"note") + field(2, field(1, field(1, b"from another tool")))))
        return framed(field(1, b"".join(entries)))

    path = tmp_path / "odd.tfrecord"
    path.write_bytes(b"".join(record(i, swap=i % 2 == 0, extra=i % 3 == 0) for i in range(6)))
    assert_equal_arrays(read_records(path), sample_arrays.take(slice(0, 6)))

    # Unpacked values (legal protobuf, written by no BERT tool) are refused by name.
    unpacked = b"".join(varint(1 << 3) + varint(int(v)) for v in sample_arrays.segment_ids[0])
    data = field(1, field(1, field(1, b"segment_ids") + field(2, field(3, unpacked))))
    path.write_bytes(record(0, False, False) + framed(data))
    with pytest.raises(DataError, match=r"record 1 \(byte offset \d+\): not a valid tf.train.Example "
                                        r"\(segment_ids: values are not packed \(not supported\)\)"):
        open_records(path)


def test_describe(tmp_path, sample):
    text = describe(sample, num=2, vocab_path=shared_data(VOCAB))
    lines = text.split("\n")
    assert lines[0] == f"{sample}: tfrecord, 45 records, seq_len 128, max_predictions 20"
    assert lines[1] == ("validation: OK (both checksums and every feature of every record, "
                        "token ids below vocab_size 30522)")
    assert lines[2] == "record 0 (byte offset 0): next_sentence_label 0 (B follows A), 128 tokens, 20 masked"
    assert lines[3].startswith("  A: [CLS] the [MASK] from his wood pile refused to [MASK] [MASK] a fire")
    assert lines[3].endswith("[SEP]") and lines[4].startswith("  B: ") and lines[4].endswith("[SEP]")
    assert lines[5].startswith("  masked: 2 [MASK]→chips, 9 [MASK]→kind, 10 [MASK]→##le, 14 [MASK]→dry")
    assert lines[6].startswith("record 1 (byte offset 841): ") and len(lines) == 11
    assert lines[10] == ("packing: packing factor 1.000 sequences per row (45 sequences in 45 rows), "
                         "padding 16.3% of tokens")

    path = _copy(sample, tmp_path)
    _flip(path, 841 + 12 + 3)
    text = describe(path, num=1)
    assert text.split("\n")[1] == (f"validation: FAILED for 1 record(s), which a reader skips only with "
                                   f"max_bad >= 1; first: {path}: record 1 (byte offset 841): corrupt record "
                                   "data (its checksum does not match)")
    assert text.split("\n")[3].startswith("  A: 101 1996 103 2013 2010 3536 8632 4188 2000 103 103")


def test_take_concat_and_to_torch(sample_arrays):
    picks = np.array([44, 0, 7, 7])
    for name in FEATURES:
        np.testing.assert_array_equal(getattr(sample_arrays.take(picks), name),
                                      getattr(sample_arrays, name)[picks], err_msg=name)
    both = PretrainingArrays.concat([sample_arrays.take(slice(0, 10)), sample_arrays.take(slice(10, 45))])
    assert_equal_arrays(both, sample_arrays)
    torch = pytest.importorskip("torch")
    batch = sample_arrays.take(slice(1, None, 2)).to_torch()  # strided rows: made contiguous
    names = {"input_ids": "input_ids", "token_type_ids": "segment_ids", "attention_mask": "input_mask",
             "masked_lm_positions": "masked_lm_positions", "masked_lm_ids": "masked_lm_ids",
             "masked_lm_weights": "masked_lm_weights", "next_sentence_labels": "next_sentence_labels"}
    assert sorted(batch) == sorted(names)
    for key, name in names.items():
        tensor = batch[key]
        compact = {"masked_lm_weights": torch.float32, "attention_mask": torch.uint8}  # the rest int32
        assert tensor.dtype == compact.get(key, torch.int32), key
        assert tensor.is_contiguous()
        np.testing.assert_array_equal(tensor.numpy(), getattr(sample_arrays, name)[1::2], err_msg=key)


def test_damaged_examples_with_valid_checksums(tmp_path, sample):
    """Random edits inside Examples (checksums redone): the fast batch parser agrees with the
    general one record by record, and reading skips the invalid records and nothing else goes wrong."""
    raw = sample.read_bytes()
    originals = [raw[offset + 12:offset + 12 + length] for offset, length in frames(sample)][:8]
    rng = np.random.default_rng(7)
    outcomes = {"fast": 0, "general": 0, "kept": 0}
    for _ in range(150):
        datas = []
        for data in originals:
            data = bytearray(data)
            for _ in range(int(rng.integers(1, 3))):  # overwrite, delete or insert a byte
                i, edit = int(rng.integers(len(data))), int(rng.integers(3))
                if edit == 0:
                    data[i] = int(rng.integers(256))
                elif edit == 1:
                    del data[i]
                else:
                    data.insert(i, int(rng.integers(256)))
            datas.append(bytes(data))
        buffer = b"".join(datas)
        ends = np.cumsum([len(d) for d in datas])
        starts = ends - [len(d) for d in datas]
        kinds, first, last, fast = example_spans(np.frombuffer(buffer, np.uint8), starts, ends, FEATURES)
        for r in range(len(datas)):
            try:
                general = example_features(buffer, int(starts[r]), int(ends[r]), set(FEATURES))
            except (FormatError, IndexError):
                general = None
            if not fast[r]:
                outcomes["general"] += 1
                continue
            outcomes["fast"] += 1
            assert general is not None  # the fast path never accepts what the general one refuses
            for j, name in enumerate(FEATURES):
                kind, a, b = general.get(name, (None, 0, 0))
                number = {None: 0, "bytes_list": 1, "float_list": 2, "int64_list": 3}[kind]
                assert (number, a, b) == (kinds[r, j], first[r, j], last[r, j]) or number == kinds[r, j] == 0
        path = tmp_path / "damaged.tfrecord"
        path.write_bytes(b"".join(framed(data) for data in datas))
        with open_records(path, max_bad=8, vocab_size=30522) as records:  # no other exception
            assert len(records) + records.skipped == 8
            records.take(np.arange(len(records)))
            outcomes["kept"] += len(records)
    assert outcomes["fast"] > 200 and outcomes["general"] > 900
    assert outcomes["kept"] > 20  # edits that leave a valid record (a changed token id, say)


@pytest.mark.parametrize("fmt", FORMATS)
def test_any_integer_dtypes_are_written(tmp_path, fmt, sample_arrays):
    wide = PretrainingArrays(**{name: getattr(sample_arrays, name).astype(np.float64 if name == "masked_lm_weights"
                                                                          else np.int64) for name in FEATURES})
    wide.input_mask = wide.input_mask.astype(bool)
    assert_equal_arrays(read_records(write_records(tmp_path / "w", wide, fmt)), sample_arrays)


@pytest.mark.parametrize("fmt", FORMATS)
def test_writer_memory_does_not_grow_with_rows(tmp_path, fmt, many):
    import tracemalloc

    batch = many.take(slice(0, 500))

    def peak_bytes(batches: int) -> int:
        tracemalloc.start()
        with RecordWriter(tmp_path / f"m{batches}.{fmt}", fmt, 128, 20, vocab_size=30522) as writer:
            for _ in range(batches):
                writer.write(batch)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return peak

    small, large = peak_bytes(2), peak_bytes(20)
    assert (tmp_path / f"m20.{fmt}").stat().st_size > 9 * (tmp_path / f"m2.{fmt}").stat().st_size
    assert large < 1.2 * small and large < 8 << 20  # one batch's worth, whatever the row count


# ---------------------------------------------------------------- data inspect: exit status and damaged files

def test_inspect_exit_status(tmp_path, sample, sample_arrays, capsys):
    """0 when the file validates, 1 when it opens but fails validation, 2 (one line) when it is no record file."""
    from bertforge.cli import main

    assert main(["data", "inspect", str(sample), "--num", "0"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == ("validation: OK (both checksums and every feature of "
                                                       "every record)")
    path = _copy(sample, tmp_path)
    _flip(path, 841 + 12 + 3)  # record 1's data
    assert main(["data", "inspect", str(path), "--num", "1"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[1] == (f"validation: FAILED for 1 record(s), which a reader skips only with max_bad >= 1; first: "
                      f"{path}: record 1 (byte offset 841): corrupt record data (its checksum does not match)")
    assert out[2].startswith("record 0 (byte offset 0): ")

    native_path = write_records(tmp_path / "x.bfrec", sample_arrays, "native", vocab_size=30522)
    assert main(["data", "inspect", str(native_path), "--num", "0"]) == 0
    capsys.readouterr()
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("".join(f"t{i}\n" for i in range(500)))
    assert main(["data", "inspect", str(native_path), "--num", "1", "--vocab", str(vocab)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[1] == (f"validation: FAILED: {native_path}: written for a vocab of 30522 tokens (the header's "
                      "vocab_size), read with vocab_size 500")
    assert out[2].startswith("record 0 (byte offset 64): next_sentence_label 0")
    _flip(native_path, 64 + 432 * 7 + 100)
    assert main(["data", "inspect", str(native_path)]) == 1
    assert capsys.readouterr().out.splitlines()[1] == (
        f"validation: FAILED: {native_path}: corrupt data in the block at byte offset 64 (its checksum does not match)")

    text = tmp_path / "d.txt"
    text.write_text("hello, world\n")
    assert main(["data", "inspect", str(text)]) == 2
    assert capsys.readouterr().err == (f"error: {text}: neither a TFRecord nor a bertforge native record file "
                                       "(first bytes: 68 65 6c 6c 6f 2c 20 77)\n")
    cut = _copy(sample, tmp_path, "cut.tfrecord")
    cut.write_bytes(cut.read_bytes()[:5])  # not even one record header
    assert main(["data", "inspect", str(cut)]) == 1
    assert capsys.readouterr().out.splitlines()[1].endswith(
        f"{cut}: record 0 (byte offset 0): truncated record: 5 bytes left, a record header needs 12")


def test_native_header_vocab_must_match_the_readers(tmp_path, sample_arrays):
    path = write_records(tmp_path / "x.bfrec", sample_arrays, "native", vocab_size=30522)
    with open_records(path, vocab_size=30522) as records:
        assert (records.header_vocab_size, len(records)) == (30522, 45)
    with pytest.raises(DataError) as err:
        open_records(path, vocab_size=30528)  # padded to a multiple of 8: still not the records' vocab
    assert str(err.value) == (f"{path}: written for a vocab of 30522 tokens (the header's vocab_size), "
                              "read with vocab_size 30528")
    with pytest.raises(DataError, match="seq_len 65537: the native format holds sequences of at most 65536"):
        RecordWriter(tmp_path / "long.bfrec", "native", 65537, 20)


def test_a_native_header_that_understates_its_ids_is_refused(tmp_path, sample_arrays, monkeypatch, capsys):
    """A header whose max_id (and so vocab_size) is below the ids its rows hold fails validation,
    naming the first such record: readers trust it to bound the ids (issue 21)."""
    from bertforge.cli import main
    from bertforge.data import native

    true_max = int(max(sample_arrays.input_ids.max(), sample_arrays.masked_lm_ids.max()))
    first = int(np.flatnonzero(np.maximum(sample_arrays.input_ids.max(axis=1),
                                          sample_arrays.masked_lm_ids.max(axis=1)) > 999)[0])
    finish = native.NativeWriter.finish

    def understated(writer):
        writer.max_id, writer.vocab_size = 999, 1000  # a consistent header, for other rows
        finish(writer)

    monkeypatch.setattr(native.NativeWriter, "finish", understated)
    path = write_records(tmp_path / "x.bfrec", sample_arrays, "native")
    monkeypatch.undo()
    assert true_max > 999
    expected = (f"{path}: record {first} (byte offset {64 + 432 * first}): token id "
                f"{int(max(sample_arrays.input_ids[first].max(), sample_arrays.masked_lm_ids[first].max()))} "
                f"above the header's max_id 999 (a header edited or written for other rows)")
    with pytest.raises(DataError) as err:
        open_records(path)
    assert str(err.value) == expected
    assert main(["data", "inspect", str(path), "--num", "0"]) == 1
    assert capsys.readouterr().out.splitlines()[1] == f"validation: FAILED: {expected}"
    with open_records(path, verify=False) as records:  # the header alone still opens
        assert records.header.max_id == 999
