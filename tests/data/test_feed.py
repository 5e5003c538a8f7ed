"""The input pipeline (bertforge/data/feed.py and the batches of the data package): compact host
dtypes that train exactly as int64 batches did, no mask for batches without padding, and on
CUDA pinned copies on a side stream, one micro-batch ahead."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import shared_data

from bertforge.config import MODEL_PRESETS, ModelConfig
from bertforge.data import feed
from bertforge.data.dataset import SyntheticDataset, decode_sample
from bertforge.data.packing import pack_arrays
from bertforge.data.record_reader import read_records
from bertforge.models.bert import BertForPreTraining
from bertforge.training.engine import to_device
from bertforge.training.pretrain import forward_loss

SAMPLE_RECORDS = "tfrecord/graphcore_sample_text.tfrecord"  # 45 real records of seq 128, padded

COMPACT = {"input_ids": torch.int32, "token_type_ids": torch.int32, "attention_mask": torch.uint8,
           "sequence_ids": torch.uint8, "position_ids": torch.int32, "masked_lm_positions": torch.int32,
           "masked_lm_ids": torch.int32, "masked_lm_weights": torch.float32, "cls_positions": torch.int32,
           "next_sentence_labels": torch.int32, "next_sentence_weights": torch.float32}


def tiny_model(vocab_size: int) -> BertForPreTraining:
    torch.manual_seed(0)
    cfg = ModelConfig(**MODEL_PRESETS["tiny"], vocab_size=vocab_size, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0)
    return BertForPreTraining(cfg)


def as_int64(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch as the loader made it before: every integer field int64."""
    return {k: v if v.is_floating_point() else v.long() for k, v in batch.items()}


def step_of(model: torch.nn.Module, batch: dict[str, torch.Tensor]):
    """A training step's losses and gradients for one batch (as the engine feeds it: through to_device)."""
    model.zero_grad()
    out = forward_loss(model, to_device(batch, torch.device("cpu")))
    out["loss"].backward()
    return ({k: v.detach() for k, v in out.items()},
            {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})


def nbytes(batch: dict[str, torch.Tensor]) -> int:
    return sum(v.numel() * v.element_size() for v in batch.values())


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_compact_batches_train_exactly_as_int64_batches(packed):
    arrays = read_records(shared_data(SAMPLE_RECORDS))
    if packed:
        arrays = pack_arrays(arrays, 3, seed=1)
    compact = arrays.take(np.arange(16)).to_torch()
    assert {k: v.dtype for k, v in compact.items()} == {k: COMPACT[k] for k in compact}
    assert ("sequence_ids" in compact) == packed and ("attention_mask" in compact) != packed  # records are padded
    np.testing.assert_array_equal(compact["input_ids"].numpy(), arrays.input_ids[:16])
    # Two fifths of the int64 batch's bytes cross the bus: per row of 128 tokens and 20 predictions
    # 1396 bytes of 3480; packed (3 sequences, 22 predictions), 1964 of 4596.
    assert (nbytes(compact), nbytes(as_int64(compact))) == ((16 * 1964, 16 * 4596) if packed else
                                                            (16 * 1396, 16 * 3480))

    model = tiny_model(30522)
    ours, our_grads = step_of(model, compact)
    theirs, their_grads = step_of(model, as_int64(compact))
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key
    assert our_grads.keys() == their_grads.keys() and len(our_grads) > 30
    for name, grad in their_grads.items():
        assert torch.equal(our_grads[name], grad), name


def test_widen_makes_int32_int64_on_the_device_and_leaves_the_rest():
    batch = {"ids": torch.tensor([1, 2], dtype=torch.int32), "mask": torch.tensor([1, 0], dtype=torch.uint8),
             "weights": torch.tensor([0.5, 1.0]), "labels": torch.tensor([3, 4])}
    wide = feed.widen(batch)
    assert {k: v.dtype for k, v in wide.items()} == {"ids": torch.int64, "mask": torch.uint8,
                                                     "weights": torch.float32, "labels": torch.int64}
    assert wide["ids"].tolist() == [1, 2] and wide["labels"] is batch["labels"]  # int64 stays as it is, no copy


def test_a_batch_without_padding_has_no_mask_and_the_model_gets_none(tmp_path):
    data = SyntheticDataset(64, vocab_size=500, seq_len=32, max_predictions=5, seed=3)  # every token real
    batch = data.batch(np.arange(8))
    assert "attention_mask" not in batch and sorted(batch) == sorted(
        ["input_ids", "token_type_ids", "masked_lm_positions", "masked_lm_ids", "masked_lm_weights",
         "next_sentence_labels"])
    model = tiny_model(500).eval()
    masks = []
    model.register_forward_pre_hook(lambda module, args: masks.append(args[2]))
    with torch.no_grad():
        unmasked = forward_loss(model, batch)
        masked = forward_loss(model, {**batch, "attention_mask": torch.ones(8, 32, dtype=torch.uint8)})
    assert masks[0] is None and masks[1] is not None
    for key in ("loss", "mlm_loss", "nsp_loss"):
        assert float(unmasked[key]) == pytest.approx(float(masked[key]), abs=1e-6), key
    assert float(unmasked["mlm_count"]) == 8 * 5

    # One padded row anywhere in the batch: the mask stays, with that row's zeros.
    arrays = data.arrays.take(np.arange(8))
    arrays.input_mask[5, 30:] = 0
    padded = arrays.to_torch()
    assert padded["attention_mask"].dtype == torch.uint8 and int(padded["attention_mask"].sum()) == 8 * 32 - 2
    # A person reads the whole row of an unpadded batch, and the real tokens of a padded one.
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("".join(f"t{i}\n" for i in range(500)))
    assert len(decode_sample(batch, vocab, row=5).split()) == 32
    assert len(decode_sample(padded, vocab, row=5).split()) == 30


def test_host_batches_are_copies_not_views_of_the_records():
    arrays = SyntheticDataset(16, vocab_size=500, seq_len=32, max_predictions=5, seed=3).arrays
    batch = arrays.take(slice(0, 4)).to_torch()  # a slice of the arrays: views, made into copies
    batch["input_ids"][0, 0] = -7
    assert int(arrays.input_ids[0, 0]) != -7 and batch["input_ids"].is_contiguous()


def test_copied_ahead_on_the_cpu_passes_batches_through_as_they_come():
    pulled = []

    def micro_batches():
        for i in range(3):
            pulled.append(i)
            yield {"input_ids": torch.full((2, 4), i, dtype=torch.int32)}

    out = feed.copied_ahead(micro_batches(), torch.device("cpu"))
    first = next(out)
    assert pulled == [0] and first["input_ids"].dtype == torch.int32  # nothing read ahead, nothing copied
    assert [int(b["input_ids"][0, 0]) for b in out] == [1, 2] and pulled == [0, 1, 2]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_copied_ahead_on_cuda_copies_pinned_batches_on_the_side_stream_one_ahead(monkeypatch):
    device = torch.device("cuda", torch.cuda.current_device())
    data = SyntheticDataset(64, vocab_size=500, seq_len=32, max_predictions=5, seed=3)
    host = [feed.pinned(data.batch(np.arange(i * 8, i * 8 + 8))) for i in range(3)]
    assert all(v.is_pinned() for b in host for v in b.values())
    streams, pulled = [], []
    plain = feed.to_device

    def spy(batch, where):
        streams.append(torch.cuda.current_stream(where))
        return plain(batch, where)

    monkeypatch.setattr(feed, "to_device", spy)

    def micro_batches():
        for i, batch in enumerate(host):
            pulled.append(i)
            yield batch

    out = feed.copied_ahead(micro_batches(), device)
    first = next(out)
    assert pulled == [0, 1]  # the copy of micro-batch 1 was issued before micro-batch 0 is handed out
    got = [first, *out]
    assert streams == [feed.copy_stream(device)] * 3 and streams[0] != torch.cuda.current_stream(device)
    torch.cuda.synchronize(device)
    for ours, theirs in zip(got, host):
        assert ours.keys() == theirs.keys()
        for key, value in theirs.items():
            assert ours[key].device == device and ours[key].dtype == value.dtype
            assert torch.equal(ours[key].cpu(), value), key
    # Through the model the batch gives the CPU's losses (fp32, no dropout).
    model = tiny_model(500).eval()
    with torch.no_grad():
        on_cpu = forward_loss(model, host[0])
        on_gpu = forward_loss(model.to(device), got[0])
    assert float(on_gpu["loss"]) == pytest.approx(float(on_cpu["loss"]), abs=1e-3)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_prefetcher_pins_batches_for_cuda(tmp_path):
    from bertforge.data.loader import Prefetcher, RecordStream

    src = shared_data(SAMPLE_RECORDS)
    plain = RecordStream([src], batch_size=8, seed=1).next()
    prefetcher = Prefetcher(RecordStream([src], batch_size=8, seed=1), depth=4, pin=True)
    try:
        batch = prefetcher.next()
    finally:
        prefetcher.close()
    assert batch.keys() == plain.keys() and all(v.is_pinned() for v in batch.values())
    assert all(torch.equal(batch[k], plain[k]) for k in plain)
