"""ModernBERT's batch-size warm-up (train.batch_size_warmup_min_size / _tokens): the schedule against a
transcription of its BatchSizeWarmupScheduler, the loop's micro-batches a step from the tokens it read,
and a resume in the middle of the warm-up."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

import bertforge.training.pretrain as pretrain_module
from bertforge.config import ConfigError, load_config
from bertforge.formats.load import load_model
from bertforge.training.engine import BatchWarmup, real_tokens
from bertforge.training.pretrain import pretrain


def modernbert_batch_size(min_batch_size: int, max_batch_size: int, warmup_tokens: int, world_size: int,
                          current_step: int) -> int:
    """AnswerDotAI/ModernBERT's BatchSizeWarmupScheduler (src/sequence_packer.py, 8c57a0f), transcribed:
    made with the micro-batches a device trains at the start and at the end, the warm-up's tokens and the
    world size, and called with the tokens this rank's packer has emitted (its ``_token_count``)."""
    warmup = math.ceil(warmup_tokens / world_size)
    total_batch_sizes = sum(range(min_batch_size, max_batch_size))
    steps_per_unit = warmup / total_batch_sizes if total_batch_sizes else 0.0
    thresholds, cumsum = [], 0
    for batch_size in range(min_batch_size, max_batch_size):
        cumsum += batch_size
        thresholds.append(math.ceil(steps_per_unit * cumsum))
    if current_step >= warmup:
        return max_batch_size
    for i, threshold in enumerate(thresholds):
        if current_step < threshold:
            return min_batch_size + i
    return max_batch_size


@pytest.mark.parametrize("first, full, tokens, world", [
    (1, 6, 50_000_000_000, 8),  # ModernBERT-base: 96 of 576 sequences a device on 8 GPUs, over 50B tokens
    (1, 6, 50_000_000_000, 3),  # a world size that does not divide the tokens
    (2, 9, 12_345, 1),
    (3, 4, 1_000, 2),
    (4, 4, 1_000, 1),  # nothing to warm up
])
def test_the_schedule_is_modernberts(first, full, tokens, world):
    ours = BatchWarmup(first, full, tokens, world)
    per_rank = math.ceil(tokens / world)
    probes = {0, 1, per_rank - 1, per_rank, per_rank + 1}
    probes |= {t + d for t in ours.thresholds for d in (-1, 0, 1)}
    probes |= {per_rank * k // 97 for k in range(98)}
    for read in sorted(p for p in probes if p >= 0):
        assert ours.micro_batches(read) == modernbert_batch_size(first, full, tokens, world, read), read
    if full > first:  # sizes first .. full - 1, each for about the same number of steps, then full
        assert [ours.micro_batches(t - 1) for t in ours.thresholds[:-1]] == list(range(first, full - 1))
        assert abs(ours.thresholds[-1] - per_rank) <= 1  # (the float product may round the last one past W)


def test_real_tokens_leave_the_padding_out():
    padded = {"input_ids": torch.ones(2, 5, dtype=torch.long),
              "attention_mask": torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])}
    packed = {"input_ids": torch.ones(1, 6, dtype=torch.long), "sequence_ids": torch.tensor([[1, 1, 2, 2, 2, 0]])}
    assert (real_tokens(padded), real_tokens(packed), real_tokens({"input_ids": torch.ones(3, 4)})) == (8, 5, 12)


@pytest.mark.parametrize("overrides, message", [
    ([("train.batch_size_warmup_min_size", "8")], r"batch_size_warmup_min_size=8 and .*_tokens=0: set both"),
    ([("train.batch_size_warmup_min_size", "3"), ("train.batch_size_warmup_tokens", "100")],
     r"batch_size_warmup_min_size=3 is not a multiple of train.micro_batch_size=2 in "),
    ([("train.batch_size_warmup_min_size", "2"), ("train.batch_size_warmup_tokens", "100"),
      ("train.eval_every_samples", "mlperf")], r"cannot be used with train.eval_every_samples=mlperf"),
])
def test_what_the_warmup_cannot_be_is_one_line(overrides, message):
    base = [("train.micro_batch_size", "2"), ("train.global_batch_size", "8")]
    with pytest.raises(ConfigError, match=message) as err:
        load_config("pretrain_tiny", base + overrides)
    assert "\n" not in str(err.value)


def warmup_run(tmp_path: Path, name: str, **more: object) -> dict:
    pairs = {"train.micro_batch_size": 2, "train.global_batch_size": 8, "train.steps": 8, "train.warmup_steps": 2,
             "train.batch_size_warmup_min_size": 2, "train.batch_size_warmup_tokens": 1200,
             "train.eval_every": 0, "train.eval_at_start": False, "checkpoint.every": 4, "log.every": 1,
             "model.num_hidden_layers": 1, "execution.threads": 1, "log.progress": False, "log.tensorboard": False,
             "log.run_dir": str(tmp_path / "runs"), "log.name": name, **more}
    return pretrain(load_config("pretrain_tiny", [(k, str(v)) for k, v in pairs.items()]))


@pytest.mark.slow
def test_the_loop_follows_the_tokens_it_read_and_resumes_in_the_warmup(tmp_path, monkeypatch):
    read: list[int] = []

    def counted(batch):
        read.append(real_tokens(batch))
        return read[-1]

    monkeypatch.setattr(pretrain_module, "real_tokens", counted)
    summary = warmup_run(tmp_path, "whole")
    rows = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    batches = [row["global_batch"] for row in rows if "global_batch" in row]
    # The same schedule over the tokens of the micro-batches the loop read, a step at a time.
    schedule, want, done = BatchWarmup(1, 4, 1200, 1), [], 0
    for _ in range(8):
        count = schedule.micro_batches(sum(read[:done]))
        want.append(2 * count)
        done += count
    assert done == len(read) and batches == want
    assert want[0] == 2 and want[-1] == 8 and len(set(want)) >= 3  # the warm-up ran, and ended
    assert summary["samples_to_train"] == sum(want)

    # Resumed from step 4 (in the warm-up), the rest equals the run that went through.
    monkeypatch.undo()
    run_dir = Path(summary["run_dir"])
    resumed_dir = tmp_path / "runs" / "resumed"
    shutil.copytree(run_dir, resumed_dir)
    shutil.rmtree(resumed_dir / "checkpoints" / "step_00000008")
    resumed = warmup_run(tmp_path, "resumed", **{"checkpoint.resume": str(resumed_dir)})
    again = [json.loads(line) for line in (resumed_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row.get("global_batch") for row in again] == [row.get("global_batch") for row in rows]
    assert [row.get("loss") for row in again] == [row.get("loss") for row in rows]
    assert resumed["samples_to_train"] == summary["samples_to_train"]
    a, b = load_model(run_dir).state_dict(), load_model(resumed_dir).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
