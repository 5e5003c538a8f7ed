"""Training-step throughput, model FLOPs utilisation and peak memory.

    bertforge bench pretrain --config tiny --batch-size 16 --seq-len 128 --steps 20 --json
    bertforge bench pretrain --config large --seq-len 128 --batch-size 256 --accumulation 4 --json
    bertforge bench pretrain --config large --batch-size 64 --data packed_records/ --json

Times whole optimizer steps after a few warm-up steps: ``accumulation``
micro-batches of ``batch_size`` rows, forward and backward each, then one
optimizer step (clip, optimizer, schedule), as training runs them. The data
is one synthetic batch, or ``data``: record shards (packed or not) of which
``(warmup + steps) × accumulation`` micro-batches are read and put on the
device before the clock starts, so that the benchmark times the step and not
the disk. Throughput is in real sequences (a packed row holds several, counted
on the host before timing), rows, row tokens and non-padding tokens; MFU is
the model FLOPs of the executed batches per second over the device's peak
(see :mod:`bertforge.models.flops`). Peak memory is the device's peak allocation on
CUDA, and on the CPU the growth of the process's peak resident set over what
it held before the model was built.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from bertforge.config import (
    Config,
    ConfigError,
    DataConfig,
    ExecutionConfig,
    ModelConfig,
    TrainConfig,
    freeze,
    replaced,
)
from bertforge.data import SyntheticDataset
from bertforge.data.loader import RecordStream, record_files, records_shape
from bertforge.host import current_rss_mb, device_name, peak_rss_mb, process_age_s, reset_peak_rss
from bertforge.models.bert import num_parameters
from bertforge.models.families import build_pretraining_model
from bertforge.models.flops import peak_tflops, pretraining_flops
from bertforge.parallel.dist import (
    DistContext,
    compile_counts,
    compiles,
    compiles_optimizer,
    destroy_distributed,
    prepare_model,
    resolve_device,
    unwrap,
)
from bertforge.training.engine import Engine, set_threads, to_device
from bertforge.training.optim import build_optimizer, build_scheduler, cast_weights
from bertforge.training.pretrain import training_loss


class PeakMemory:
    """Peak memory in MiB of what runs after construction."""

    def __init__(self, device: torch.device):
        self.device = device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            self.base = torch.cuda.memory_allocated(device) / 2**20
        else:  # the process's earlier peak (another job, another test) is not this one's
            reset_peak_rss()
            self.base = current_rss_mb()

    def peak_mb(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**20 - self.base
        return peak_rss_mb() - self.base


class LiveTensorBytes(TorchDispatchMode):
    """Bytes of live tensor storages created while active, and their peak.

    The CPU counterpart of ``torch.cuda.max_memory_allocated``: every op's new
    outputs are counted once per storage (views and in-place results share
    their input's storage and are not), and subtracted when the storage is
    freed. Tensors that existed before (the parameters, say) are not counted.
    Works through the backward pass, which runs on the calling thread on the CPU.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}

    def reset_peak(self) -> None:
        self.peak = self.live

    def _freed(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr()
                  for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if size == 0 or key in inputs or key in self._sizes:
                continue
            self._sizes[key] = size
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, key)
        return out


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def read_micro_batches(m: ModelConfig, d: DataConfig, seed: int, pattern: str, batch_size: int, seq_len: int | None,
                       count: int, always_mask: bool = False, predictions_given: bool = False
                       ) -> tuple[list[dict[str, torch.Tensor]], int, int]:
    """``count`` micro-batches of the records at ``pattern`` (a directory, glob or file, as
    ``data.input``), in training's order, their sequence length and predictions. ``always_mask``:
    as training's, for a compiled model (one graph for batches with and without padding).

    The records decide the sequence length and the predictions; a ``seq_len`` or an explicit
    ``d.max_predictions`` (``predictions_given``) that differs is refused.
    """
    files = record_files(pattern)
    first, records_len, records_predictions, _ = records_shape(files)
    if seq_len is not None and seq_len != records_len:
        raise ConfigError(f"--seq-len {seq_len}, but the records at {pattern} have {records_len}: "
                          "leave --seq-len out")
    if predictions_given and d.max_predictions != records_predictions:
        raise ConfigError(f"data.max_predictions={d.max_predictions} (given, or the config's), but the "
                          f"records at {pattern} have {records_predictions}: pass --max-predictions "
                          f"{records_predictions}")
    if records_len > m.max_position_embeddings:
        raise ConfigError(f"{first}: sequences of {records_len} exceed "
                          f"model.max_position_embeddings={m.max_position_embeddings}")
    # Token ids the model's vocab does not have are refused, naming the file and record.
    stream = RecordStream(files, batch_size, seed, shuffle_buffer=d.shuffle_buffer,
                          vocab_size=m.vocab_size, always_mask=always_mask)
    try:
        return [stream.next() for _ in range(count)], records_len, records_predictions
    finally:
        stream.close()


def real_counts(batch: dict[str, torch.Tensor]) -> tuple[int, int]:
    """(real sequences, non-padding tokens) of a batch: a packed row holds several sequences
    (``next_sentence_weights``), and a batch without ``attention_mask`` has no padding."""
    if "sequence_ids" in batch:  # packed rows
        return int(batch["next_sentence_weights"].sum()), int((batch["sequence_ids"] > 0).sum())
    tokens = int((batch["attention_mask"] > 0).sum()) if "attention_mask" in batch else batch["input_ids"].numel()
    return batch["input_ids"].shape[0], tokens


def row_flops(m: ModelConfig, objective: str, batch: dict[str, torch.Tensor]) -> int:
    """Training FLOPs of one row of the batch as executed: its length, prediction and [CLS] slots."""
    seq_len, predictions = batch["input_ids"].shape[1], batch["masked_lm_positions"].shape[1]
    cls_slots = batch["cls_positions"].shape[1] if "cls_positions" in batch else 1
    return pretraining_flops(m, seq_len, predictions, cls_slots if objective == "mlm_nsp" else 0)


def _check_arguments(batch_size: int, steps: int, warmup: int, accumulation: int, peak: float | None) -> None:
    for name, value, least in (("--batch-size", batch_size, 1), ("--steps", steps, 1),
                               ("--warmup", warmup, 0), ("--accumulation", accumulation, 1)):
        if value < least:
            raise ConfigError(f"{name} must be at least {least}, got {value}")
    if peak is not None and not peak > 0:
        raise ConfigError(f"--peak-tflops must be positive, got {peak}")


def _synthetic_micro_batches(m: ModelConfig, d: DataConfig, batch_size: int, seq_len: int | None
                             ) -> tuple[list[dict[str, torch.Tensor]], int, int]:
    """One synthetic micro-batch (every step's the same), its sequence length and predictions."""
    seq_len, max_predictions = 128 if seq_len is None else seq_len, d.max_predictions
    if not 0 < max_predictions < seq_len:
        raise ConfigError(f"data.max_predictions={max_predictions} must be below the sequence length {seq_len} "
                          f"(--seq-len): give --data.max_predictions for rows of {seq_len}")
    synthetic = SyntheticDataset(size=batch_size, vocab_size=m.vocab_size, seq_len=seq_len,
                                 max_predictions=max_predictions, seed=d.seed)
    return [synthetic.batch(list(range(batch_size)))], seq_len, max_predictions


def _time_steps(m: ModelConfig, tr: TrainConfig, ex: ExecutionConfig, device: torch.device,
                micro_batches: list[dict[str, torch.Tensor]], order: list[list[int]], warmup: int,
                accumulation: int) -> tuple[int, float, float, float]:
    """(the model's parameters, the last step's loss, seconds of the steps after ``warmup``, seconds from
    the process's start to the end of the first step): each step runs the micro-batches ``order`` names."""
    torch.manual_seed(tr.seed)
    dist = DistContext(device=device)
    try:
        # The execution settings (recompute, fsdp, offload, compile) as pretrain applies them.
        model = prepare_model(cast_weights(build_pretraining_model(m, tr.objective).train(), tr), ex, dist)
        compiled = compiles_optimizer(ex, device) and not tr.optimizer_in_backward
        optimizer = build_optimizer(unwrap(model), tr, compiled=compiled)
        engine = Engine(model, optimizer, build_scheduler(optimizer, tr, len(order)), training_loss,
                        ex.precision, tr.grad_clip, dist, grad_sync=ex.grad_sync,
                        loss_scale=tr.loss_scale, scaled_state=tr.scaled_optimizer_state,
                        optimizer_in_backward=tr.optimizer_in_backward)
        first_step_s, start = 0.0, 0.0
        for step, indices in enumerate(order):
            if step == warmup:
                synchronize(device)
                start = time.perf_counter()
            out = engine.step([micro_batches[i] for i in indices], accumulation)
            if step == 0:  # the cold start: the model built, compiled (or its cache read), one step done
                synchronize(device)
                first_step_s = process_age_s()
        loss = out["loss"].item()  # also waits for the device
        elapsed = time.perf_counter() - start
    finally:
        destroy_distributed()
    return num_parameters(unwrap(model)), loss, elapsed, first_step_s


def bench_pretrain(cfg: Config, batch_size: int, seq_len: int | None, steps: int, warmup: int = 3,
                   accumulation: int = 1, data: str | None = None,
                   peak: float | None = None) -> dict[str, Any]:
    """Throughput and MFU of our pre-training step (see the module docstring).

    ``seq_len`` None is 128, or the records' with ``data`` (which must agree
    when it is given, as must an explicit ``data.max_predictions``). ``peak``
    (TFLOP/s) replaces the device's peak; MFU is None without either.
    """
    _check_arguments(batch_size, steps, warmup, accumulation, peak)
    set_threads(cfg.execution.threads)
    device = resolve_device(cfg.execution.device)
    if data:
        micro_batches, seq_len, max_predictions = read_micro_batches(
            cfg.model, cfg.data, cfg.train.seed, data, batch_size, seq_len, (warmup + steps) * accumulation,
            always_mask=compiles(cfg.execution, device), predictions_given="data.max_predictions" in cfg.given)
    else:
        micro_batches, seq_len, max_predictions = _synthetic_micro_batches(cfg.model, cfg.data, batch_size, seq_len)
    # What is measured, as the run's config: the batch shape, a constant lr (it costs the same).
    cfg = freeze(replaced(cfg, {
        "train.micro_batch_size": batch_size, "train.global_batch_size": batch_size * accumulation,
        "data.seq_len": seq_len, "data.max_predictions": max_predictions,
        "train.schedule": "constant", "train.warmup_steps": 0}))
    # On the host, before the clock starts: counting during the steps would wait for the device.
    counts = [real_counts(b) for b in micro_batches]
    flops = [row_flops(cfg.model, cfg.train.objective, b) * b["input_ids"].shape[0] for b in micro_batches]
    micro_batches = [to_device(b, device) for b in micro_batches]
    # Each step's micro-batches, as indices into micro_batches (warm-up steps first).
    order = [[(step * accumulation + i) % len(micro_batches) for i in range(accumulation)]
             for step in range(warmup + steps)]
    memory = PeakMemory(device)
    n_params, loss, elapsed, first_step_s = _time_steps(cfg.model, cfg.train, cfg.execution, device, micro_batches,
                                                        order, warmup, accumulation)
    timed = [i for indices in order[warmup:] for i in indices]
    sequences = sum(counts[i][0] for i in timed)
    model_flops = sum(flops[i] for i in timed)
    name = device_name(device)
    if peak is None and device.type == "cuda":
        peak = peak_tflops(name, cfg.execution.precision)
    achieved = model_flops / elapsed / 1e12
    seq_per_s, rows_per_s = sequences / elapsed, steps * accumulation * batch_size / elapsed
    ex = cfg.execution
    return {
        "model": "bertforge", "layers": cfg.model.num_hidden_layers, "hidden": cfg.model.hidden_size,
        "params_m": round(n_params / 1e6, 2), "device": str(device), "device_name": name,
        "precision": ex.precision, "parallel": ex.parallel, "recompute": ex.recompute, "offload": ex.offload,
        "compile": compiles(ex, device), "compile_scope": ex.compile_scope if compiles(ex, device) else None,
        "threads": torch.get_num_threads(),
        "batch_size": batch_size, "seq_len": seq_len, "max_predictions": cfg.data.max_predictions,
        "accumulation": accumulation, "global_batch": batch_size * accumulation,
        "data": data or "synthetic", "packed": "sequence_ids" in micro_batches[0],
        "optimizer": cfg.train.optimizer, "steps": steps, "step_ms": round(1000 * elapsed / steps, 2),
        # Significant digits: large models on a CPU run < 0.01/s.
        "seq_per_s": float(f"{seq_per_s:.4g}"),  # real sequences
        "rows_per_s": float(f"{rows_per_s:.4g}"),
        "tokens_per_s": round(rows_per_s * seq_len, 1),  # row slots, padding included
        "real_tokens_per_s": round(sum(counts[i][1] for i in timed) / elapsed, 1),
        "sequences": sequences,  # real sequences in the timed steps
        "flops_per_seq": round(model_flops / sequences),  # per row when unpacked
        "model_tflops": float(f"{achieved:.4g}"), "peak_tflops": peak,
        "mfu": float(f"{achieved / peak:.4g}") if peak else None,
        "peak_mem_mb": round(memory.peak_mb(), 1),
        "final_loss": round(loss, 4),
        # The cold start: from the process's start to the end of the first step, and what compiling took
        # (graphs, recompiles, seconds: parallel.dist.compile_counts).
        "first_step_s": round(first_step_s, 2),
        "compiled": compile_counts() if compiles(ex, device) else None,
    }
