"""A training step never waits for the device: counted per step of a real pre-training run.

The first GPU profile showed the CPU waiting each step, three times: for the finiteness and
stop flags between the backward and the optimizer (``both.tolist()``), for a packed batch's
sequence count (``sequences.item()``) and for the divergence guard's loss. Here a dispatch mode
counts, per step, every ``aten._local_scalar_dense`` (``.item()``, ``bool(tensor)``) and every
blocking copy from a device to the host, and the reads of a step's numbers (``HostCopy``) that
come before the next step has been queued. The run: packed records, accumulation 2, the
divergence guard on, a log row every 5 steps, no checkpoint and no evaluation before the end.
"""

from __future__ import annotations

import collections
import json

import numpy as np
import pytest
import torch
from test_packing import synthetic
from torch.utils._python_dispatch import TorchDispatchMode

from bertforge.config import load_config
from bertforge.data import feed
from bertforge.data.packing import pack_arrays
from bertforge.data.record_writer import write_records
from bertforge.training.engine import Engine
from bertforge.training.pretrain import pretrain

STEPS, LOG_EVERY = 10, 5


class Syncs(TorchDispatchMode):
    """``aten._local_scalar_dense`` calls and blocking device-to-host copies, by the step they fall in."""

    def __init__(self) -> None:
        super().__init__()
        self.step = 0  # the step being run (1-based), 0 before the first
        self.counts: collections.Counter[int] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            self.counts[self.step] += 1
        elif func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            source = args[1] if func is torch.ops.aten.copy_.default else args[0]
            target = args[0].device if func is torch.ops.aten.copy_.default else kwargs.get("device")
            blocking = not kwargs.get("non_blocking", False) and not (len(args) > 2 and args[2])
            if source.device.type != "cpu" and target is not None and torch.device(target).type == "cpu" and blocking:
                self.counts[self.step] += 1
        return func(*args, **kwargs)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_steps_that_do_not_log_never_wait_for_the_device(tmp_path, monkeypatch, device):
    records = write_records(tmp_path / "packed.bfrec", pack_arrays(synthetic(400, 64, 10, 128, seed=2), 3),
                            fmt="native", vocab_size=128)
    cfg = load_config("tiny", [
        ("data.input", str(records)), ("model.vocab_size", 128), ("model.max_position_embeddings", 128),
        ("train.micro_batch_size", 4), ("train.global_batch_size", 8), ("train.steps", STEPS),
        ("train.divergence_factor", 10.0), ("train.divergence_steps", 3), ("log.every", LOG_EVERY),
        ("log.run_dir", str(tmp_path)), ("log.name", "run"), ("log.progress", False), ("log.tensorboard", False),
        ("execution.device", device), ("execution.threads", 1), ("train.eval_at_start", False)])

    syncs = Syncs()
    early_reads: list[tuple[int, int]] = []  # (the step a HostCopy was made in, the step it was read in)
    step_of, copy_init, copy_values = Engine.step, feed.HostCopy.__init__, feed.HostCopy.values

    def counted_step(self, *args, **kwargs):
        syncs.step += 1
        return step_of(self, *args, **kwargs)

    def made(self, values):
        self.made_in = syncs.step
        copy_init(self, values)

    def read(self):
        if self.made_in == syncs.step:
            early_reads.append((self.made_in, syncs.step))
        return copy_values(self)

    monkeypatch.setattr(Engine, "step", counted_step)
    monkeypatch.setattr(feed.HostCopy, "__init__", made)
    monkeypatch.setattr(feed.HostCopy, "values", read)
    with syncs:
        summary = pretrain(cfg)
    assert summary["steps"] == STEPS
    # A step's numbers arrive during the next step: none is read in the step that made it, but
    # the last one, read after the loop (for the final checkpoint and evaluation).
    assert early_reads == [(STEPS, STEPS)]
    # No step waits, logging or not: the log rows are the step before's numbers, already on the host.
    assert {step: n for step, n in syncs.counts.items() if 1 <= step < STEPS} == {}
    rows = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
            if "split" not in r]  # (the training rows)
    assert [r["step"] for r in rows] == [1, 5, 10]
    assert all(np.isfinite(r["loss"]) for r in rows)
