"""Sequence packing (bertforge/data/packing.py): SPFHP, Graphcore's packed layout, the
packed model and loss, packed records in both formats, and the commands.

The central check: a packed batch gives the loss and the gradients of the same
sequences unpacked (fp32, dropout off), on real records and on synthetic ones.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from conftest import shared_data

from bertforge.config import MODEL_PRESETS, ModelConfig
from bertforge.data import DataError
from bertforge.data.loader import RecordStream
from bertforge.data.packing import PackingStats, pack_arrays, pack_command, pack_indices, pack_rows, spfhp, unpack_rows
from bertforge.data.record_inspect import inspect_records
from bertforge.data.record_reader import open_records, read_records
from bertforge.data.record_writer import write_records
from bertforge.data.rows import PackedArrays, PretrainingArrays
from bertforge.models.bert import BertForPreTraining
from bertforge.training.pretrain import forward_loss, training_loss

SAMPLE_RECORDS = "tfrecord/graphcore_sample_text.tfrecord"
SAMPLE_TEXT = "text/sample_text.txt"
VOCAB = "vocab/bert-base-uncased-vocab.txt"


def synthetic(n: int, seq_len: int, max_predictions: int, vocab_size: int, seed: int = 0) -> PretrainingArrays:
    """Unpacked rows of varied lengths as the reference lays them out: [CLS] A [SEP] B [SEP], padding 0,
    about 15% of the tokens but [CLS] predicted."""
    rng = np.random.default_rng(seed)
    a = PretrainingArrays(
        input_ids=np.zeros((n, seq_len), np.int32), segment_ids=np.zeros((n, seq_len), np.int8),
        input_mask=np.zeros((n, seq_len), np.int8), masked_lm_positions=np.zeros((n, max_predictions), np.int32),
        masked_lm_ids=np.zeros((n, max_predictions), np.int32),
        masked_lm_weights=np.zeros((n, max_predictions), np.float32),
        next_sentence_labels=rng.integers(0, 2, n).astype(np.int64))
    for i, length in enumerate(rng.integers(5, seq_len + 1, n).tolist()):
        a.input_ids[i, :length] = rng.integers(1, vocab_size, length)
        a.input_mask[i, :length] = 1
        a.segment_ids[i, rng.integers(2, length):length] = 1
        count = min(max_predictions, max(1, round(0.15 * length)))
        positions = np.sort(rng.choice(np.arange(1, length), count, replace=False))
        a.masked_lm_positions[i, :count] = positions
        a.masked_lm_ids[i, :count] = rng.integers(1, vocab_size, count)
        a.masked_lm_weights[i, :count] = 1
    return a


def sequences(a: PretrainingArrays) -> list[tuple]:
    """Each sequence as a comparable tuple: tokens, segments, label, real predictions."""
    real = a.masked_lm_weights > 0
    return sorted((tuple(a.input_ids[i][a.input_mask[i] > 0]), tuple(a.segment_ids[i][a.input_mask[i] > 0]),
                   int(a.next_sentence_labels[i]), tuple(a.masked_lm_positions[i][real[i]]),
                   tuple(a.masked_lm_ids[i][real[i]])) for i in range(len(a)))


# ---------------------------------------------------------------- the algorithm and the layout

def test_spfhp_fills_the_tightest_pack_first():
    histogram = np.zeros(9, np.int64)
    histogram[[6, 2, 1]] = [2, 2, 1]  # two of length 6, two of 2, one of 1, into packs of 8
    assert sorted(spfhp(histogram, 8, 3)) == [((1,), 1), ((6, 2), 2)]
    histogram[:] = 0
    histogram[[5, 3, 2, 1]] = [3, 1, 4, 2]
    # The 5s open 3 packs (room 3); the 3 fills one; two 2s go into the other two (room 1) and
    # the other two 2s open packs of their own (a length's count is placed in one go); the 1s
    # go to the least room that fits: the (5, 2) packs.
    assert sorted(spfhp(histogram, 8, 3)) == [((2,), 2), ((5, 2, 1), 2), ((5, 3), 1)]


def test_pack_indices_cover_every_sequence_within_the_limits():
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 129, 5000)
    predictions = np.minimum(20, np.maximum(1, np.round(lengths * 0.15))).astype(np.int64)
    packs = pack_indices(lengths, predictions, 128, 3, 20, seed=3)
    used = packs[packs >= 0]
    assert sorted(used.tolist()) == list(range(5000))
    tokens = np.where(packs >= 0, lengths[np.maximum(packs, 0)], 0).sum(axis=1)
    preds = np.where(packs >= 0, predictions[np.maximum(packs, 0)], 0).sum(axis=1)
    assert tokens.max() <= 128 and preds.max() <= 22 and (packs >= 0).sum(axis=1).max() == 3
    # Uniform lengths up to 128 waste half the tokens unpacked; SPFHP with 3 per pack wastes few.
    assert 1 - lengths.sum() / (len(packs) * 128) < 0.02
    assert np.array_equal(packs, pack_indices(lengths, predictions, 128, 3, 20, seed=3))


def test_packed_row_is_laid_out_as_graphcores_script_lays_it_out():
    """Two sequences into a row of 12, as pack_pretraining_data.py's create_multi_sequence_example."""
    a = PretrainingArrays(
        input_ids=np.array([[101, 7, 8, 102, 9, 102, 0, 0, 0, 0, 0, 0],
                            [101, 5, 102, 6, 102, 0, 0, 0, 0, 0, 0, 0]], np.int32),
        segment_ids=np.array([[0, 0, 0, 0, 1, 1] + [0] * 6, [0, 0, 0, 1, 1] + [0] * 7], np.int8),
        input_mask=np.array([[1] * 6 + [0] * 6, [1] * 5 + [0] * 7], np.int8),
        masked_lm_positions=np.array([[2, 4], [3, 0]], np.int32),
        masked_lm_ids=np.array([[70, 90], [60, 0]], np.int32),
        masked_lm_weights=np.array([[1, 1], [1, 0]], np.float32),
        next_sentence_labels=np.array([1, 0], np.int64))
    p = pack_rows(a, np.array([[0, 1, -1]]), max_predictions=2)
    np.testing.assert_array_equal(p.input_ids[0], [7, 8, 102, 9, 102, 5, 102, 6, 102, 0, 101, 101])
    np.testing.assert_array_equal(p.input_mask[0], [1, 1, 1, 1, 1, 2, 2, 2, 2, 0, 2, 1])
    np.testing.assert_array_equal(p.segment_ids[0], [0, 0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 0])
    np.testing.assert_array_equal(p.position_ids[0], [1, 2, 3, 4, 5, 1, 2, 3, 4, 0, 0, 0])
    np.testing.assert_array_equal(p.masked_lm_positions[0], [1, 3, 7, 0])  # p - 1 + the sequence's offset
    np.testing.assert_array_equal(p.masked_lm_ids[0], [70, 90, 60, 0])
    np.testing.assert_array_equal(p.masked_lm_mask[0], [1, 1, 2, 0])
    np.testing.assert_array_equal(p.next_sentence_labels[0], [0, 0, 1])  # sequence k in slot S - k
    np.testing.assert_array_equal(p.next_sentence_mask[0], [0, 1, 1])
    assert sequences(unpack_rows(p)) == sequences(a)


def test_packing_real_records_keeps_every_sequence():
    a = read_records(shared_data(SAMPLE_RECORDS))
    p = pack_arrays(a, 3, seed=1)
    assert sequences(unpack_rows(p)) == sequences(a)
    stats = PackingStats()
    stats.add(p)
    assert (stats.sequences, stats.tokens) == (45, int(a.input_mask.sum()))


# ---------------------------------------------------------------- same loss and gradients

def loss_and_gradients(model: torch.nn.Module, batch: dict[str, torch.Tensor]):
    model.zero_grad()
    out = forward_loss(model, batch)
    out["loss"].backward()
    values = {key: float(out[key].detach()) for key in ("loss", "mlm_loss", "nsp_loss", "mlm_correct", "mlm_count",
                                              "nsp_correct", "nsp_count")}
    return values, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_packing_changes_nothing(a: PretrainingArrays, max_sequences_per_pack: int, vocab_size: int) -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(**MODEL_PRESETS["tiny"], vocab_size=vocab_size, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0)
    model = BertForPreTraining(cfg).eval()  # fp32, no dropout
    packed = pack_arrays(a, max_sequences_per_pack, seed=2)
    assert len(packed) < len(a)
    unpacked_out, unpacked_grads = loss_and_gradients(model, a.to_torch())
    packed_out, packed_grads = loss_and_gradients(model, packed.to_torch())
    assert packed_out["nsp_count"] == unpacked_out["nsp_count"] == len(a)
    # The training loop's throughput counts these real sequences, not the rows.
    assert float(training_loss(model, packed.to_torch())["sequences"]) == len(a)
    assert "sequences" not in training_loss(model, a.to_torch())
    assert packed_out["mlm_count"] == unpacked_out["mlm_count"] == float((a.masked_lm_weights > 0).sum())
    for key, value in unpacked_out.items():
        assert packed_out[key] == pytest.approx(value, abs=1e-5), key
    assert packed_grads.keys() == unpacked_grads.keys()
    for name, grad in unpacked_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-5, atol=1e-5, msg=name)


def test_packed_batch_gives_the_loss_and_gradients_of_the_same_sequences_unpacked():
    assert_packing_changes_nothing(synthetic(48, 64, 10, 500, seed=4), 3, 500)


def test_packed_batch_of_real_records_gives_the_same_loss_and_gradients(tmp_path):
    """Records that ``bertforge data create`` made from the shared sample text, at seq 64."""
    from bertforge.data.create import create

    path = tmp_path / "sample.tfrecord"
    create([shared_data(SAMPLE_TEXT)], shared_data(VOCAB), path, seq_len=64, max_predictions=10,
           dupe_factor=1, seed=7)
    a = read_records(path)
    assert_packing_changes_nothing(a, 3, 30522)


# ---------------------------------------------------------------- files

@pytest.mark.parametrize("fmt", ["tfrecord", "native"])
def test_packed_records_round_trip_and_refuse_mixing(tmp_path, fmt):
    a = synthetic(40, 64, 10, 500, seed=5)
    packed = pack_arrays(a, 3, seed=0)
    path = write_records(tmp_path / f"packed.{fmt}", packed, fmt, vocab_size=500)
    with open_records(path) as records:
        assert (records.max_sequences_per_pack, records.seq_len, records.max_predictions) == (3, 64, 10)
        back = records.take(np.arange(len(records)))
    assert isinstance(back, PackedArrays)
    for name in ("input_ids", "input_mask", "segment_ids", "position_ids", "masked_lm_positions",
                 "masked_lm_ids", "masked_lm_mask", "next_sentence_labels", "next_sentence_mask"):
        np.testing.assert_array_equal(getattr(back, name), getattr(packed, name), err_msg=name)
    write_records(tmp_path / f"plain.{fmt}", a, fmt, vocab_size=500)
    with pytest.raises(DataError) as err:
        RecordStream([path, tmp_path / f"plain.{fmt}"], 4, 0)
    assert str(err.value) == (f"{tmp_path / f'plain.{fmt}'}: unpacked records, but {path} has packed records "
                              "(up to 3 sequences per record): the files of one data set must agree")


def test_a_packed_row_out_of_layout_is_refused(tmp_path):
    packed = pack_arrays(synthetic(10, 64, 10, 500), 3)
    packed.next_sentence_mask[0, 2] = 0  # every row has a first sequence, whose slot is S - 1
    with pytest.raises(DataError) as err:
        write_records(tmp_path / "x.tfrecord", packed)
    assert str(err.value) == (f"{tmp_path / 'x.tfrecord'}: record 0 (row 0 of this write): next_sentence_mask[2] "
                              "= 0, but input_mask[63] = 1: sequence 1's [CLS] goes there, its label in slot 2")


def test_tensorflow_reads_our_packed_records_with_graphcores_feature_spec(tmp_path):
    """The dtypes and lengths Graphcore's loaders parse; TensorFlow is the reader."""
    tf = pytest.importorskip("tensorflow")
    packed = pack_arrays(synthetic(20, 64, 10, 500, seed=6), 3)
    path = write_records(tmp_path / "packed.tfrecord", packed)
    spec = {f"packed_{name}": tf.io.FixedLenFeature([width], dtype) for name, width, dtype in (
        ("input_ids", 64, tf.int64), ("input_mask", 64, tf.int64), ("segment_ids", 64, tf.int64),
        ("position_ids", 64, tf.int64), ("masked_lm_positions", 12, tf.int64),
        ("masked_lm_ids", 12, tf.int64), ("masked_lm_mask", 12, tf.float32),
        ("next_sentence_labels", 3, tf.int64), ("next_sentence_mask", 3, tf.float32))}
    for i, raw in enumerate(tf.data.TFRecordDataset(str(path))):
        parsed = tf.io.parse_single_example(raw, spec)
        for key, value in parsed.items():
            np.testing.assert_array_equal(value.numpy(), getattr(packed, key.removeprefix("packed_"))[i])


# ---------------------------------------------------------------- commands and training

def test_data_pack_and_inspect(tmp_path, capsys):
    from bertforge.cli import main

    source = tmp_path / "in"
    a = synthetic(60, 64, 10, 500, seed=8)
    write_records(source / "a.bfrec", a.take(slice(0, 30)), "native", vocab_size=500)
    write_records(source / "b.bfrec", a.take(slice(30, 60)), "native", vocab_size=500)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["data", "pack", str(source), str(out)]) == 2
    assert capsys.readouterr().err == (f"error: {out}: not empty; pass --overwrite to replace it, or give a "
                                       "new directory\n")
    assert main(["data", "pack", str(source), str(out), "--overwrite", "--format", "tfrecord"]) == 0
    shards = sorted(p.name for p in out.iterdir())
    assert shards == ["part-00000-of-00002.tfrecord", "part-00001-of-00002.tfrecord"]
    packed = [read_records(out / name) for name in shards]
    assert sequences(unpack_rows(PackedArrays.concat(packed))) == sequences(a)
    capsys.readouterr()
    text, ok = inspect_records(out / shards[0], num=1)
    lines = text.splitlines()
    assert ok and lines[0].endswith("packed: up to 3 sequences per record")
    assert lines[2].startswith("record 0 (byte offset 0, sequence 1 of ")
    rows = len(packed[0])
    real = int(packed[0].next_sentence_mask.sum())
    tokens = int((packed[0].input_mask > 0).sum())
    assert lines[-1] == (f"packing: packing factor {real / rows:.3f} sequences per row ({real} sequences in "
                         f"{rows} rows), padding {100 * (1 - tokens / (rows * 64)):.1f}% of tokens")
    with pytest.raises(DataError, match="already packed"):
        pack_command(str(out), tmp_path / "again", 3)


def test_data_create_pack_packs_what_create_makes(tmp_path, capsys):
    from bertforge.cli import main

    args = ["data", "create", "--input", str(shared_data(SAMPLE_TEXT)), "--vocab", str(shared_data(VOCAB)),
            "--seq-len", "128", "--short-seq-prob", "1", "--dupe-factor", "2", "--num-output-files", "2"]
    assert main([*args, "--output", str(tmp_path / "plain" / "s.tfrecord")]) == 0
    assert main([*args, "--output", str(tmp_path / "packed" / "s.tfrecord"), "--pack", "3"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    names = ["s-00000-of-00002.tfrecord", "s-00001-of-00002.tfrecord"]
    # no temporary left; each shard with its tokenizer's sidecar
    assert sorted(p.name for p in (tmp_path / "packed").iterdir()) == sorted(
        names + [f"{name}.made-with.json" for name in names])
    plain = PretrainingArrays.concat([read_records(tmp_path / "plain" / name) for name in names])
    packed = PackedArrays.concat([read_records(tmp_path / "packed" / name) for name in names])
    assert sequences(unpack_rows(packed)) == sequences(plain)
    stats = PackingStats()
    stats.add(packed)
    assert stats.packing_factor > 1.4 and last == f"packed: {stats.summary()}"


def test_pretrain_on_packed_records(tmp_path):
    """Packed shards train and evaluate (an unpacked eval set), counting real sequences."""
    from bertforge.config import ConfigError, load_config
    from bertforge.training.pretrain import pretrain

    a = synthetic(96, 64, 10, 500, seed=9)  # random ids: no vocab has their [CLS] and [MASK] (issue 21)
    write_records(tmp_path / "plain" / "train.bfrec", a, "native", vocab_size=500)
    write_records(tmp_path / "eval.bfrec", a.take(slice(0, 16)), "native", vocab_size=500)
    stats, _ = pack_command(str(tmp_path / "plain"), tmp_path / "packed", 3)
    cfg = load_config("pretrain_tiny", [
        ("data.input", str(tmp_path / "packed")), ("data.eval_input", str(tmp_path / "eval.bfrec")),
        ("model.vocab_size", 500), ("data.seq_len", 64), ("data.max_predictions", 10),  # per sequence
        ("train.micro_batch_size", 8), ("train.global_batch_size", 8),
        ("train.steps", 2), ("train.warmup_steps", 1), ("execution.threads", 2), ("log.every", 1),
        ("log.progress", False), ("log.run_dir", str(tmp_path / "runs")), ("log.name", "packed"),
        ("checkpoint.every", 0)])
    summary = pretrain(cfg)
    assert summary["steps"] == 2 and np.isfinite(summary["last_loss"])
    assert summary["last_eval"]["sequences"] == 16
    assert stats.sequences == 96 and stats.rows < 96
    shutil.rmtree(tmp_path / "runs")
    # Samples are counted as global_batch_size per step, which packed rows would overstate or understate.
    cfg.log.name, cfg.train.eval_every_samples = "by_samples", 64
    with pytest.raises(ConfigError, match=r"packed records, but train.eval_every_samples and log.mlperf count"):
        pretrain(cfg)
    assert not (tmp_path / "runs" / "by_samples").exists()
