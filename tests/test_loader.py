"""The record stream: even split across ranks, seeded shuffling, exact resume, dynamic masking."""

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import shared_data

from bertforge.data.errors import DataError
from bertforge.data.instances import PretrainingArrays
from bertforge.data.loader import MaskingSpec, RecordStream, is_records, record_files, remask
from bertforge.data.records import read_records, write_records

BERT_SPECIALS = MaskingSpec(vocab_size=30522, cls_id=101, sep_id=102, mask_id=103)


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
