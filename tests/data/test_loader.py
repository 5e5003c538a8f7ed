"""The record stream: even split across ranks, seeded shuffling, exact resume, dynamic masking."""

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import shared_data

from bertforge.config import ConfigError, DataConfig
from bertforge.data.errors import DataError
from bertforge.data.loader import MaskingSpec, Prefetcher, RecordStream, is_records, record_files, remask
from bertforge.data.record_reader import read_records
from bertforge.data.record_writer import write_records
from bertforge.data.rows import PretrainingArrays
from bertforge.data.vocab import Vocabulary

# bert-base-uncased's layout: [CLS] 101, [SEP] 102, [MASK] 103 in 30522 tokens
BERT_SPECIALS = MaskingSpec(Vocabulary.wordpiece(["[PAD]", *(f"[unused{i}]" for i in range(99)), "[UNK]", "[CLS]",
                                                  "[SEP]", "[MASK]", *(f"w{i}" for i in range(30418))]))


def numbered_arrays(first: int, count: int, seq_len: int = 16, predictions: int = 3) -> PretrainingArrays:
    """Records whose first token after [CLS] is their number, so a batch tells which records it holds."""
    ids = np.zeros((count, seq_len), np.int32)
    ids[:, 0], ids[:, 1], ids[:, 2] = 101, np.arange(first, first + count) + 1000, 102
    mask = (ids > 0).astype(np.int8)
    return PretrainingArrays(
        input_ids=ids, segment_ids=np.zeros_like(mask), input_mask=mask,
        masked_lm_positions=np.zeros((count, predictions), np.int32),
        masked_lm_ids=np.zeros((count, predictions), np.int32),
        masked_lm_weights=np.zeros((count, predictions), np.float32),
        next_sentence_labels=np.zeros(count, np.int64))


@pytest.fixture(params=["native", "tfrecord"])
def shards(request, tmp_path) -> list[Path]:
    sizes = [10, 7, 5]
    files, first = [], 0
    for i, n in enumerate(sizes):
        files.append(write_records(tmp_path / f"shard{i}.{request.param}", numbered_arrays(first, n),
                                   fmt=request.param))
        first += n
    return files


def record_numbers(batch: dict[str, torch.Tensor]) -> list[int]:
    return (batch["input_ids"][:, 1] - 1000).tolist()


def test_ranks_get_disjoint_equal_shares(shards):
    streams = [RecordStream(shards, batch_size=4, seed=3, rank=r, world_size=2, shuffle_buffer=5) for r in (0, 1)]
    assert [s.batches_per_epoch for s in streams] == [2, 2]  # 22 records → 11 per rank → 2 batches of 4
    seen = [sum((record_numbers(s.next()) for _ in range(2)), []) for s in streams]
    assert len(seen[0]) == len(seen[1]) == 8
    assert not set(seen[0]) & set(seen[1])
    assert len(set(seen[0])) == 8 and all(0 <= n < 22 for n in seen[0] + seen[1])


def test_order_is_shuffled_and_seeded(shards):
    def epoch(seed: int) -> list[int]:
        stream = RecordStream(shards, batch_size=2, seed=seed, shuffle_buffer=8)
        return sum((record_numbers(stream.next()) for _ in range(stream.batches_per_epoch)), [])

    first = epoch(1)
    assert sorted(first) == list(range(22))  # every record once per epoch
    assert first == epoch(1) and first != epoch(2)
    assert first != sorted(first)


def test_resume_mid_epoch_gives_the_same_batches(shards):
    whole = RecordStream(shards, batch_size=3, seed=5, shuffle_buffer=4)
    batches = [whole.next() for _ in range(12)]  # 7 batches per epoch: crosses into epoch 1
    assert whole.state() == {"epoch": 1, "index": 5}
    resumed = RecordStream(shards, batch_size=3, seed=5, shuffle_buffer=4, epoch=0, index=4)
    for expected in batches[4:]:
        got = resumed.next()
        assert all(torch.equal(got[k], expected[k]) for k in expected)
    # a new epoch orders the records differently
    second_epoch = batches[7:12] + [whole.next(), whole.next()]
    assert sum(map(record_numbers, batches[:7]), []) != sum(map(record_numbers, second_epoch), [])


def test_remask_restores_originals_and_masks_like_the_reference():
    records = read_records(shared_data("tfrecord/graphcore_sample_text.tfrecord"))
    original = restore(records)
    rng = np.random.default_rng(0)
    counts = {"mask": 0, "same": 0, "random": 0}
    for _ in range(20):
        again = remask(records, BERT_SPECIALS, rng)
        assert np.array_equal(restore(again), original)
        n_tokens = records.input_mask.sum(1)
        expected = np.minimum(20, np.maximum(1, np.round(n_tokens * 0.15)))
        assert np.array_equal(again.masked_lm_weights.sum(1), expected)
        for row in range(len(original)):
            k = int(expected[row])
            pos = again.masked_lm_positions[row, :k]
            assert np.all(np.diff(pos) > 0) and np.all(pos < n_tokens[row])
            assert not np.isin(original[row, pos], [101, 102]).any()
            shown = again.input_ids[row, pos]
            counts["mask"] += int((shown == 103).sum())
            counts["same"] += int((shown == original[row, pos]).sum())
            counts["random"] += int(((shown != 103) & (shown != original[row, pos])).sum())
    total = sum(counts.values())
    assert total > 10000
    assert counts["mask"] / total == pytest.approx(0.8, abs=0.02)
    assert counts["same"] / total == pytest.approx(0.1, abs=0.015)
    assert counts["random"] / total == pytest.approx(0.1, abs=0.015)


def restore(a: PretrainingArrays) -> np.ndarray:
    ids = a.input_ids.astype(np.int64).copy()
    for row in range(len(ids)):
        real = a.masked_lm_weights[row] > 0
        ids[row, a.masked_lm_positions[row][real]] = a.masked_lm_ids[row][real]
    return ids


def test_dynamic_masking_differs_per_epoch_but_resumes_exactly(tmp_path):
    src = shared_data("tfrecord/graphcore_sample_text.tfrecord")
    stream = RecordStream([src], batch_size=45, seed=1, masking=BERT_SPECIALS)
    first, second = stream.next(), stream.next()  # one batch per epoch
    assert sorted(first["next_sentence_labels"].tolist()) == sorted(second["next_sentence_labels"].tolist())
    assert not torch.equal(first["masked_lm_positions"], second["masked_lm_positions"])
    again = RecordStream([src], batch_size=45, seed=1, masking=BERT_SPECIALS, epoch=1, index=0).next()
    assert all(torch.equal(again[k], second[k]) for k in second)


def test_static_masks_are_passed_through_unchanged():
    src = shared_data("tfrecord/graphcore_sample_text.tfrecord")
    records = read_records(src)
    batch = RecordStream([src], batch_size=45, seed=1, shuffle_buffer=1).next()  # a window of 1: file order
    expected = records.to_torch()
    assert all(torch.equal(batch[k], expected[k]) for k in expected)


def test_prefetcher_hands_out_the_streams_batches_and_positions(shards):
    plain = RecordStream(shards, batch_size=4, seed=3, shuffle_buffer=5)
    ahead = Prefetcher(RecordStream(shards, batch_size=4, seed=3, shuffle_buffer=5))  # 4 batches ahead
    try:
        for _ in range(7):  # across the end of the first epoch (5 batches)
            expected, batch = plain.next(), ahead.next()
            assert batch.keys() == expected.keys() and all(torch.equal(batch[k], expected[k]) for k in expected)
            assert ahead.state() == plain.state()  # the position of what was handed out, not read ahead
    finally:
        ahead.close()
    assert ahead.state() == {"epoch": 1, "index": 2} and DataConfig().prefetch == 4


def test_four_reader_threads_hand_out_one_threads_batches_and_positions(shards):
    """Reader threads load batches at once (each with its own dynamic masks), yet the batches, their
    masks and the positions are one thread's, across an epoch's end and after a resume mid-epoch."""
    def stream(**position):
        return RecordStream(shards, batch_size=3, seed=7, shuffle_buffer=4, masking=BERT_SPECIALS, **position)

    def batches(source, count):
        out = []
        for _ in range(count):
            batch = source.next()
            out.append(({k: v.clone() for k, v in batch.items()}, source.state()))
        return out

    one, four = Prefetcher(stream(), threads=1), Prefetcher(stream(), 2, threads=4)
    try:
        expected, got = batches(one, 17), batches(four, 17)  # 7 batches an epoch: into the third
    finally:
        one.close(), four.close()
    for (want, want_state), (batch, state) in zip(expected, got):
        assert state == want_state and all(torch.equal(batch[k], want[k]) for k in want)
    assert got[-1][1] == {"epoch": 2, "index": 3}
    assert expected[8][1] == {"epoch": 1, "index": 2}
    resumed = Prefetcher(stream(**expected[8][1]), threads=4)
    try:
        rest = batches(resumed, 8)
    finally:
        resumed.close()
    assert [state for _, state in rest] == [state for _, state in expected[9:]]
    assert all(torch.equal(b[k], want[k]) for (b, _), (want, _) in zip(rest, expected[9:]) for k in want)


@pytest.mark.parametrize("pairs, message", [
    ({"data.reader_threads": 0}, "data.reader_threads=0 must be at least 1"),
    ({"data.reader_threads": 4, "data.prefetch": 0},
     "data.reader_threads=4 needs data.prefetch of at least 1 (the reader threads read ahead; data.prefetch=0 "
     "reads in the training thread)"),
])
def test_a_bad_reader_thread_count_is_one_line(pairs, message):
    from bertforge.config import load_config

    with pytest.raises(ConfigError) as err:
        load_config("tiny", list(pairs.items()))
    assert str(err.value) == message


def test_record_discovery(shards, tmp_path):
    assert record_files(str(shards[0].parent)) == sorted(shards)
    assert record_files(str(shards[0].parent / "shard*")) == sorted(shards)
    assert is_records(str(shards[0].parent))
    # A directory's TFRecord indexes and hidden files (a writer's temporary) are not shards.
    (shards[0].parent / "shard0.index").write_text("0 10\n")
    (shards[0].parent / ".shard3.tmp").write_bytes(b"")
    assert record_files(str(shards[0].parent)) == sorted(shards)
    with pytest.raises(DataError, match="no record files found at .*nothing"):
        record_files(str(tmp_path / "nothing*"))
    text = tmp_path / "corpus.txt"
    text.write_text("One sentence.\nAnother one.\n")
    assert not is_records(str(text))
    # Records and text in one directory: training on either kind alone would drop the other (issue 21).
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for shard in shards:
        (mixed / shard.name).write_bytes(shard.read_bytes())
    (mixed / "notes.txt").write_text("One sentence.\n")
    with pytest.raises(DataError) as err:
        is_records(str(mixed))
    assert str(err.value) == (f"{mixed}: holds {len(shards)} record file(s) ({sorted(shards)[0].name}, …) and "
                              f"1 other file(s) (notes.txt, …): point data.input at records or at text, not both")


# ---------------------------------------------------------------- records against the config (load_data)

def small_vocab_arrays(count: int, seq_len: int = 16, predictions: int = 3) -> PretrainingArrays:
    """numbered_arrays with every token id below 300."""
    arrays = numbered_arrays(0, count, seq_len, predictions)
    arrays.input_ids[:, 1] -= 900
    return arrays


def records_config(tmp_path: Path, **overrides):
    from bertforge.config import load_config

    pairs = {"log.run_dir": str(tmp_path / "runs"), "data.prefetch": 0, "train.micro_batch_size": 4,
             "train.global_batch_size": 4, **overrides}
    return load_config("tiny", list(pairs.items()))


@pytest.mark.parametrize("fmt", ["native", "tfrecord"])
def test_records_decide_the_shapes_and_a_set_shape_must_agree(fmt, tmp_path):
    """The config's default seq_len / max_predictions give way to the records' (16, 3); a value the
    config sets must equal the records': records of 16 do not train under data.seq_len 512."""
    from bertforge.training.pretrain import load_data

    path = write_records(tmp_path / f"train.{fmt}", numbered_arrays(0, 12), fmt=fmt)
    cfg = records_config(tmp_path, **{"data.input": str(path)})
    data = load_data(cfg.model, cfg.data, cfg.train, tmp_path, given=cfg.given)
    assert data.decided == {"data.seq_len": 16, "data.max_predictions": 3, "model.vocab_size": cfg.model.vocab_size}
    assert data.eval_set is None and (cfg.data.seq_len, cfg.data.max_predictions) == (128, 20)  # cfg unchanged
    assert data.make_stream({"epoch": 0, "index": 0}).next()["input_ids"].shape == (4, 16)
    cfg = records_config(tmp_path, **{"data.input": str(path), "data.seq_len": 16, "data.max_predictions": 3})
    load_data(cfg.model, cfg.data, cfg.train, tmp_path, given=cfg.given)
    for key, value, records in (("seq_len", 512, 16), ("max_predictions", 76, 3)):
        cfg = records_config(tmp_path, **{"data.input": str(path), f"data.{key}": value})
        with pytest.raises(ConfigError) as err:
            load_data(cfg.model, cfg.data, cfg.train, tmp_path, given=cfg.given)
        assert str(err.value) == (f"data.{key}={value}, but the records have {key} {records} ({path}): leave "
                                  f"data.{key} out to train on these records, or give records of {key} {value}")


@pytest.mark.parametrize("fmt", ["native", "tfrecord"])
def test_eval_records_and_other_shards_must_have_the_training_shape(fmt, tmp_path):
    from bertforge.training.pretrain import load_data

    shards = tmp_path / "shards"
    first = write_records(shards / f"a.{fmt}", numbered_arrays(0, 12), fmt=fmt)
    wide = write_records(tmp_path / f"eval.{fmt}", numbered_arrays(0, 4, seq_len=32), fmt=fmt)
    cfg = records_config(tmp_path, **{"data.input": str(shards), "data.eval_input": str(wide)})
    with pytest.raises(DataError) as err:
        load_data(cfg.model, cfg.data, cfg.train, tmp_path, given=cfg.given)
    assert str(err.value) == (f"{wide}: eval records of seq_len 32, but the training records ({first}) have "
                              f"seq_len 16")
    same = write_records(tmp_path / f"eval16.{fmt}", numbered_arrays(0, 4), fmt=fmt)
    cfg = records_config(tmp_path, **{"data.input": str(shards), "data.eval_input": str(same)})
    assert len(load_data(cfg.model, cfg.data, cfg.train, tmp_path, given=cfg.given).eval_set) == 4
    # Fewer prediction slots (masked at a lower rate, as ModernBERT's eval set): scored as they are.
    fewer = write_records(tmp_path / f"eval16p2.{fmt}", numbered_arrays(0, 4, predictions=2), fmt=fmt)
    cfg = records_config(tmp_path, **{"data.input": str(shards), "data.eval_input": str(fewer)})
    rows = load_data(cfg.model, cfg.data, cfg.train, tmp_path, given=cfg.given).eval_set.batch([0, 1, 2, 3])
    assert rows["masked_lm_positions"].shape == (4, 2) and rows["input_ids"].shape == (4, 16)
    # A second shard of another shape: refused when the stream opens the shards.
    second = write_records(shards / f"b.{fmt}", numbered_arrays(12, 6, predictions=5), fmt=fmt)
    cfg = records_config(tmp_path, **{"data.input": str(shards)})
    make_stream = load_data(cfg.model, cfg.data, cfg.train, tmp_path, given=cfg.given).make_stream
    with pytest.raises(DataError) as err:
        make_stream({"epoch": 0, "index": 0})
    assert str(err.value) == (f"{second}: records of seq_len 16, max_predictions 5, but {first} has seq_len 16, "
                              "max_predictions 3: the files of one data set must agree")


@pytest.mark.parametrize("fmt", ["native", "tfrecord"])
def test_token_ids_beyond_the_model_vocab_are_refused_naming_file_and_record(fmt, tmp_path):
    """numbered_arrays hold ids up to 1011: a 1000-token model refuses them, in training and eval files."""
    from bertforge.training.pretrain import load_data

    path = write_records(tmp_path / f"train.{fmt}", numbered_arrays(0, 12), fmt=fmt)
    offset = 64 if fmt == "native" else 0
    cfg = records_config(tmp_path, **{"data.input": str(path), "model.vocab_size": 1000})
    make_stream = load_data(cfg.model, cfg.data, cfg.train, tmp_path, given=cfg.given).make_stream
    with pytest.raises(DataError) as err:
        make_stream({"epoch": 0, "index": 0})
    assert str(err.value) == (f"{path}: record 0 (byte offset {offset}): input_ids[1] = 1000 is not a token id "
                              "in [0, 1000) (vocab_size)")
    good = write_records(tmp_path / f"small.{fmt}", small_vocab_arrays(12), fmt=fmt)
    cfg = records_config(tmp_path, **{"data.input": str(good), "data.eval_input": str(path),
                                      "model.vocab_size": 1000})
    with pytest.raises(DataError) as err:
        load_data(cfg.model, cfg.data, cfg.train, tmp_path, given=cfg.given)
    assert str(err.value).startswith(f"{path}: record 0 (byte offset {offset}): input_ids[1] = 1000 is not")


def test_a_native_header_of_another_vocab_is_refused(tmp_path, capsys):
    """A native file whose header says vocab 300 does not train a 30,522-token model: exit status 2,
    one line; it trains when model.vocab_size (or data.vocab) agrees."""
    from bertforge.cli import main
    from bertforge.training.pretrain import load_data

    path = write_records(tmp_path / "train.bfrec", small_vocab_arrays(12), "native", vocab_size=300)
    runs = tmp_path / "runs"
    argv = ["pretrain", "--config", "tiny", "--data.input", str(path), "--run-dir", str(runs),
            "--steps", "1", "--train.global_batch_size", "4", "--train.micro_batch_size", "4",
            "--checkpoint.every", "0", "--no-progress"]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: {path}: written for a vocab of 300 tokens (its header's vocab_size), but "
        "model.vocab_size=30522: give data.vocab the vocab the records were made with")
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("".join(f"t{i}\n" for i in range(200)))
    cfg = records_config(tmp_path, **{"data.input": str(path), "data.vocab": str(vocab)})
    with pytest.raises(ConfigError) as err:
        load_data(cfg.model, cfg.data, cfg.train, tmp_path, given=cfg.given)
    assert str(err.value) == (f"{path}: written for a vocab of 300 tokens (its header's vocab_size), but data.vocab "
                              f"{vocab} has 200 tokens: give data.vocab the vocab the records were made with")
    # Every shard is checked, not only the first (which declares no vocab here).
    plain = write_records(tmp_path / "plain.bfrec", small_vocab_arrays(12), "native")
    with pytest.raises(DataError) as err:
        RecordStream([plain, path], 4, 0, vocab_size=200)
    assert str(err.value) == (f"{path}: written for a vocab of 300 tokens (the header's vocab_size), "
                              "read with vocab_size 200")
    cfg = records_config(tmp_path, **{"data.input": str(path), "model.vocab_size": 300})
    make_stream = load_data(cfg.model, cfg.data, cfg.train, tmp_path, given=cfg.given).make_stream
    assert make_stream({"epoch": 0, "index": 0}).next()["input_ids"].shape == (4, 16)


def test_a_damaged_record_file_is_taken_for_records_not_text(tmp_path):
    """A .tfrecord or .bfrec whose first bytes are damaged is read as records (and reported as a
    damaged record file) rather than as text with "not valid UTF-8"."""
    from bertforge.training.pretrain import load_data

    for fmt, suffix in (("tfrecord", ".tfrecord"), ("native", ".bfrec")):
        path = write_records(tmp_path / f"train{suffix}", numbered_arrays(0, 12), fmt=fmt)
        data = bytearray(path.read_bytes())
        data[3] ^= 0x10
        path.write_bytes(bytes(data))
        assert is_records(str(path))
        cfg = records_config(tmp_path, **{"data.input": str(path)})
        with pytest.raises(DataError) as err:
            load_data(cfg.model, cfg.data, cfg.train, tmp_path, given=cfg.given)
        assert str(err.value) == {
            "tfrecord": f"{path}: record 0 (byte offset 0): corrupt record length (its checksum does not match); "
                        "the records after it cannot be located",
            "native": f"{path}: not a bertforge native record file (bad magic bytes)"}[fmt]


def test_records_with_fixed_masks_refuse_a_vocab_of_other_ids(tmp_path):
    """Records hold their [CLS] and [MASK] ids: a vocab that maps them to other tokens (one token
    missing before them shifts every id) or lacks them is refused, naming both (issue 21)."""
    from bertforge.training.pretrain import load_data

    records = shared_data("tfrecord/graphcore_sample_text.tfrecord")
    vocab = shared_data("vocab/bert-base-uncased-vocab.txt").read_text(encoding="utf-8").splitlines()
    fits = tmp_path / "vocab.txt"
    fits.write_text("\n".join(vocab) + "\n", encoding="utf-8")
    cfg = records_config(tmp_path, **{"data.input": str(records), "data.vocab": str(fits)})
    load_data(cfg.model, cfg.data, cfg.train, tmp_path, given=cfg.given)  # the vocab the records were made with
    shifted = tmp_path / "shifted.txt"
    shifted.write_text("\n".join(vocab[:1] + vocab[2:]) + "\n", encoding="utf-8")  # [unused0] left out
    cfg = records_config(tmp_path, **{"data.input": str(records), "data.vocab": str(shifted)})
    with pytest.raises(DataError) as err:
        load_data(cfg.model, cfg.data, cfg.train, tmp_path, given=cfg.given)
    assert str(err.value) == (f"{shifted} does not fit the records in {records}: [CLS] is id 100 in the vocab but "
                              f"101 in the records; [MASK] is id 102 in the vocab but 103 in the records (made "
                              f"with another vocab?): train with the vocab they were made with")
    no_mask = tmp_path / "no_mask.txt"
    no_mask.write_text("\n".join(t for t in vocab if t != "[MASK]") + "\n", encoding="utf-8")
    cfg = records_config(tmp_path, **{"data.input": str(records), "data.vocab": str(no_mask)})
    with pytest.raises(DataError, match=rf"^{no_mask}: no \[MASK\] token, which the records in {records} hold"):
        load_data(cfg.model, cfg.data, cfg.train, tmp_path, given=cfg.given)
