"""Training-step throughput and peak memory on synthetic data.

    bertforge bench pretrain --config tiny --batch-size 16 --seq-len 128 --steps 20 --json

Times whole optimizer steps (forward, backward, clip, optimizer) after a few
warm-up steps. Peak memory is the device's peak allocation on CUDA, and on the
CPU the growth of the process's peak resident set over what it held before
the model was built.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .config import Config
from .data import SyntheticDataset
from .dist import (
    DistContext,
    destroy_distributed,
    prepare_model,
    resolve_device,
    unwrap,
)
from .engine import Engine, set_threads, to_device
from .host import current_rss_mb, peak_rss_mb
from .model import BertForPreTraining, num_parameters
from .optim import build_optimizer, build_scheduler
from .train import training_loss


class PeakMemory:
    """Peak memory in MiB of what runs after construction."""

    def __init__(self, device: torch.device):
        self.device = device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            self.base = torch.cuda.memory_allocated(device) / 2**20
        else:
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


def bench_pretrain(cfg: Config, batch_size: int, seq_len: int, steps: int,
                   warmup: int = 3) -> dict[str, Any]:
    """Sequences and tokens per second of our pre-training step on synthetic batches."""
    set_threads(cfg.execution.threads)
    device = resolve_device(cfg.execution.device)
    cfg.train.micro_batch_size = cfg.train.global_batch_size = batch_size
    cfg.data.seq_len = seq_len
    cfg.train.schedule, cfg.train.warmup_steps = "constant", 0
    data = SyntheticDataset(size=batch_size, vocab_size=cfg.model.vocab_size, seq_len=seq_len,
                            max_predictions=cfg.data.max_predictions, seed=cfg.data.seed)
    batch = to_device(data.batch(list(range(batch_size))), device)
    memory = PeakMemory(device)
    torch.manual_seed(cfg.train.seed)
    dist = DistContext(device=device)
    try:
        # The execution settings (recompute, fsdp, offload, compile) as pretrain applies them.
        model = prepare_model(BertForPreTraining(cfg.model).train(), cfg.execution, dist)
        optimizer = build_optimizer(unwrap(model), cfg.train)
        engine = Engine(model, optimizer, build_scheduler(optimizer, cfg.train, steps + warmup), training_loss,
                        cfg.execution.precision, cfg.train.grad_clip, dist)
        for _ in range(warmup):
            engine.step([batch], 1)
        synchronize(device)
        start = time.perf_counter()
        for _ in range(steps):
            out = engine.step([batch], 1)
        loss = out["loss"].item()  # also waits for the device
        elapsed = time.perf_counter() - start
    finally:
        destroy_distributed()
    seq_per_s = steps * batch_size / elapsed
    return {
        "model": "bertforge",
        "layers": cfg.model.num_hidden_layers, "hidden": cfg.model.hidden_size,
        "params_m": round(num_parameters(unwrap(model)) / 1e6, 2),
        "device": str(device), "precision": cfg.execution.precision,
        "parallel": cfg.execution.parallel, "recompute": cfg.execution.recompute,
        "offload": cfg.execution.offload, "compile": cfg.execution.compile,
        "threads": torch.get_num_threads(),
        "batch_size": batch_size, "seq_len": seq_len, "max_predictions": cfg.data.max_predictions,
        "optimizer": cfg.train.optimizer, "steps": steps,
        "step_ms": round(1000 * elapsed / steps, 2),
        "seq_per_s": float(f"{seq_per_s:.4g}"),  # significant digits: large models on a CPU run < 0.01/s
        "tokens_per_s": round(seq_per_s * seq_len, 1),
        "peak_mem_mb": round(memory.peak_mb(), 1),
        "final_loss": round(loss, 4),
    }
