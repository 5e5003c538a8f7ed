"""The pre-training loop, flat, top to bottom.

    bertforge pretrain                                   # tiny BERT on the built-in corpus
    bertforge pretrain --config pretrain_base_128 --data.input corpus/ --train.steps 10000
    bertforge pretrain --resume runs/NAME                # continue from its newest checkpoint

One optimizer step consumes ``accumulation`` micro-batches of
``train.micro_batch_size`` sequences. The data order is a seeded permutation
per epoch, so the data position is two integers (epoch, micro-batch) and a
resumed run continues exactly where it stopped without replaying anything.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from . import checkpoint as ckpt
from .config import Config, ConfigError, accumulation_steps
from .data import PretrainingDataset, SyntheticDataset, build_datasets, decode_sample, vocab_size_of
from .data.loader import Prefetcher, RecordStream, is_records, masking_spec, record_files
from .data.records import open_records, read_records
from .log import MetricsLogger, ProgressBar, Throughput, console
from .model import BertForPreTraining, num_parameters, pretraining_loss
from .optim import build_optimizer, build_scheduler


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"execution.device={name} but no CUDA device is available")
    return device


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision == "fp16" and device.type != "cuda":
        raise ConfigError("execution.precision=fp16 needs a CUDA device; use bf16 on the CPU")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device.type, dtype=dtype)


class BatchStream:
    """Micro-batches in a seeded random order per epoch; the last partial batch is dropped.

    The position (epoch, index) is all the state there is: a resumed stream
    computes the same permutation and starts at the same batch.
    """

    def __init__(self, dataset: PretrainingDataset | SyntheticDataset, batch_size: int, seed: int,
                 epoch: int = 0, index: int = 0):
        if len(dataset) < batch_size:
            raise ConfigError(f"the training set has {len(dataset)} sequences, fewer than "
                              f"train.micro_batch_size={batch_size}")
        self.dataset, self.batch_size, self.seed = dataset, batch_size, seed
        self.batches_per_epoch = len(dataset) // batch_size
        self.num_sequences = len(dataset)
        self.epoch, self.index = epoch, index
        self._order = self._permutation(epoch)

    def _permutation(self, epoch: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.dataset), generator=generator)

    def next(self) -> dict[str, torch.Tensor]:
        if self.index == self.batches_per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        start = self.index * self.batch_size
        self.index += 1
        return self.dataset.batch(self._order[start:start + self.batch_size].numpy())

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def close(self) -> None:
        pass


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    non_blocking = device.type == "cuda"
    return {k: v.to(device, non_blocking=non_blocking) for k, v in batch.items()}


def forward_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    mlm_logits, nsp_logits = model(batch["input_ids"], batch["token_type_ids"],
                                   batch["attention_mask"], batch["masked_lm_positions"])
    return pretraining_loss(mlm_logits, nsp_logits, batch)


@dataclass
class StepContext:
    """What one optimizer step needs besides the batches."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    device: torch.device
    precision: str
    grad_clip: float
    scaler: torch.amp.GradScaler | None = None


def train_step(ctx: StepContext, micro_batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Forward and backward over the micro-batches, then one optimizer step.

    Returns the step's mean losses and its gradient norm as tensors, so the
    caller decides when to pay for a device sync.
    """
    n = len(micro_batches)
    totals: dict[str, torch.Tensor] = {}
    for batch in micro_batches:
        with autocast(ctx.device, ctx.precision):
            out = forward_loss(ctx.model, batch)
        loss = out["loss"] / n
        if ctx.scaler is not None:
            loss = ctx.scaler.scale(loss)
        loss.backward()
        for key in ("loss", "mlm_loss", "nsp_loss"):
            totals[key] = totals.get(key, 0.0) + out[key].detach() / n
    if ctx.scaler is not None:
        ctx.scaler.unscale_(ctx.optimizer)
    params = [p for p in ctx.model.parameters() if p.grad is not None]
    if ctx.grad_clip > 0:
        totals["grad_norm"] = torch.nn.utils.clip_grad_norm_(params, ctx.grad_clip)
    else:
        totals["grad_norm"] = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
    if ctx.scaler is not None:
        ctx.scaler.step(ctx.optimizer)
        ctx.scaler.update()
    else:
        ctx.optimizer.step()
    ctx.scheduler.step()
    ctx.optimizer.zero_grad(set_to_none=True)
    return totals


@torch.no_grad()
def evaluate(model: nn.Module, dataset: PretrainingDataset, batch_size: int, device: torch.device,
             precision: str, max_batches: int = 0) -> dict[str, float]:
    """Masked-LM and NSP accuracy and loss over the eval set, in order, without dropout."""
    was_training = model.training
    model.eval()
    sums = {"mlm_correct": 0.0, "mlm_count": 0.0, "nsp_correct": 0.0, "nsp_count": 0.0,
            "mlm_loss": 0.0, "nsp_loss": 0.0}
    starts = range(0, len(dataset), batch_size)
    if max_batches > 0:
        starts = starts[:max_batches]
    for start in starts:
        indices = torch.arange(start, min(start + batch_size, len(dataset))).numpy()
        batch = to_device(dataset.batch(indices), device)
        with autocast(device, precision):
            out = forward_loss(model, batch)
        for key in ("mlm_correct", "mlm_count", "nsp_correct", "nsp_count"):
            sums[key] += out[key].item()
        # Losses are means; weight them back into sums.
        sums["mlm_loss"] += out["mlm_loss"].item() * out["mlm_count"].item()
        sums["nsp_loss"] += out["nsp_loss"].item() * out["nsp_count"].item()
    model.train(was_training)
    mlm_count, nsp_count = max(sums["mlm_count"], 1.0), max(sums["nsp_count"], 1.0)
    return {
        "mlm_accuracy": sums["mlm_correct"] / mlm_count,
        "nsp_accuracy": sums["nsp_correct"] / nsp_count,
        "mlm_loss": sums["mlm_loss"] / mlm_count,
        "nsp_loss": sums["nsp_loss"] / nsp_count,
        "loss": sums["mlm_loss"] / mlm_count + sums["nsp_loss"] / nsp_count,
        "sequences": int(nsp_count),
    }


def rng_state(device: torch.device) -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def make_run_dir(cfg: Config) -> Path:
    name = cfg.log.name or datetime.now().strftime("pretrain-%Y%m%d-%H%M%S")
    run_dir = Path(cfg.log.run_dir) / name
    suffix = 1
    while run_dir.exists():  # never mix two runs in one directory
        suffix += 1
        run_dir = Path(cfg.log.run_dir) / f"{name}-{suffix}"
    run_dir.mkdir(parents=True)
    return run_dir


def load_data(cfg: Config, run_dir: Path) -> tuple[Callable[[dict], Any], PretrainingDataset | None]:
    """(a function making the training stream from a data position, the eval set).

    Training data is synthetic, a corpus of text (built here, see data/), or a
    directory or glob of record shards (streamed). Fixes ``data.vocab`` and
    ``model.vocab_size`` in cfg where the data decides them.
    """
    d, batch_size, seed = cfg.data, cfg.train.micro_batch_size, cfg.train.seed
    if d.synthetic:
        train = SyntheticDataset(size=max(cfg.train.global_batch_size * 64, 1024),
                                 vocab_size=cfg.model.vocab_size, seq_len=d.seq_len,
                                 max_predictions=d.max_predictions, seed=d.seed)
        return lambda position: BatchStream(train, batch_size, seed, **position), None
    files = record_files(d.input) if d.input and is_records(d.input) else None
    if files is None:
        train, eval_set, vocab = build_datasets(d, run_dir)
        # The saved config names the vocab actually used, so a resume rebuilds the same data.
        d.vocab = str(Path(vocab).resolve())
        cfg.model.vocab_size = vocab_size_of(vocab)
        return lambda position: BatchStream(train, batch_size, seed, **position), eval_set

    with open_records(files[0], verify=False) as first:  # the records decide the shapes
        d.seq_len, d.max_predictions = first.seq_len, first.max_predictions
    if d.seq_len > cfg.model.max_position_embeddings:
        raise ConfigError(f"{files[0]}: sequences of {d.seq_len} exceed "
                          f"model.max_position_embeddings={cfg.model.max_position_embeddings}")
    masking = None
    if d.vocab:
        cfg.model.vocab_size = vocab_size_of(d.vocab)
        if d.dynamic_masking:
            masking = masking_spec(d.vocab, d.masked_lm_prob)
    elif d.dynamic_masking:
        raise ConfigError("data.dynamic_masking needs data.vocab (for the [CLS], [SEP] and [MASK] ids)")
    eval_set = PretrainingDataset(read_records(d.eval_input, vocab_size=cfg.model.vocab_size)) if d.eval_input else None

    def make_stream(position: dict) -> RecordStream | Prefetcher:
        stream = RecordStream(files, batch_size, seed, shuffle_buffer=d.shuffle_buffer, masking=masking,
                              vocab_size=cfg.model.vocab_size, **position)
        return Prefetcher(stream, d.prefetch) if d.prefetch > 0 else stream
    return make_stream, eval_set


def total_steps(cfg: Config, batches_per_epoch: int, accumulation: int) -> int:
    if cfg.train.epochs > 0:
        return max(1, cfg.train.epochs * batches_per_epoch // accumulation)
    return cfg.train.steps


def pretrain(cfg: Config) -> dict[str, Any]:
    """Run (or resume) pre-training; returns a summary with the run directory and results."""
    started = time.perf_counter()
    if cfg.execution.threads > 0:
        torch.set_num_threads(cfg.execution.threads)
    device = resolve_device(cfg.execution.device)
    resume_from = ckpt.find_checkpoint(cfg.checkpoint.resume) if cfg.checkpoint.resume else None
    run_dir = resume_from.parent.parent if resume_from else make_run_dir(cfg)

    make_stream, eval_set = load_data(cfg, run_dir)
    if resume_from is not None:
        ckpt.check_model_config(ckpt.read_config(resume_from).model, cfg.model, resume_from)
    (run_dir / "config.yaml").write_text(cfg.to_yaml(), encoding="utf-8")

    torch.manual_seed(cfg.train.seed)
    random.seed(cfg.train.seed)
    model = BertForPreTraining(cfg.model)
    if cfg.checkpoint.init and resume_from is None:
        init = ckpt.find_checkpoint(cfg.checkpoint.init)
        ckpt.check_model_config(ckpt.read_config(init).model, cfg.model, init)
        ckpt.load_weights(model, init)
    model.to(device).train()

    accumulation = accumulation_steps(cfg.train, world_size=1)
    optimizer_state, resumed = ckpt.load_trainer_state(resume_from) if resume_from else (None, None)
    stream = make_stream(resumed["data"] if resumed else {})
    steps = total_steps(cfg, stream.batches_per_epoch, accumulation)
    optimizer = build_optimizer(model, cfg.train)
    scheduler = build_scheduler(optimizer, cfg.train, steps)
    scaler = torch.amp.GradScaler(device.type) if cfg.execution.precision == "fp16" else None
    ctx = StepContext(model, optimizer, scheduler, device, cfg.execution.precision,
                      cfg.train.grad_clip, scaler)

    step = 0
    if resume_from is not None:
        ckpt.load_weights(model, resume_from)
        optimizer.load_state_dict(optimizer_state)
        scheduler.load_state_dict(resumed["scheduler"])
        if scaler is not None and "scaler" in resumed:
            scaler.load_state_dict(resumed["scaler"])
        set_rng_state(resumed["rng"], device)
        step = resumed["step"]

    logger = MetricsLogger(run_dir, cfg)
    bar = ProgressBar(steps, step, enabled=cfg.log.progress)
    bar.print(f"run directory: {run_dir}")
    bar.print(f"model: {num_parameters(model) / 1e6:.2f}M parameters, "
              f"{cfg.model.num_hidden_layers} layers, hidden {cfg.model.hidden_size}; "
              f"{stream.num_sequences} training sequences of {cfg.data.seq_len}; "
              f"global batch {cfg.train.global_batch_size} = {cfg.train.micro_batch_size} × {accumulation}")

    def run_eval() -> dict[str, float] | None:
        if eval_set is None:
            return None
        result = evaluate(model, eval_set, cfg.train.micro_batch_size, device,
                          cfg.execution.precision, cfg.train.eval_batches)
        logger.log({"step": step, "split": "eval", **result})
        bar.print(f"step {step}: eval mlm_accuracy {result['mlm_accuracy']:.4f} "
                  f"nsp_accuracy {result['nsp_accuracy']:.4f} loss {result['loss']:.4f}")
        return result

    def save() -> Path:
        state = {"step": step, "scheduler": scheduler.state_dict(), "data": stream.state(),
                 "rng": rng_state(device)}
        if scaler is not None:
            state["scaler"] = scaler.state_dict()
        return ckpt.save_checkpoint(run_dir, step, model, optimizer, state, cfg, keep=cfg.checkpoint.keep)

    first_eval = run_eval() if step == 0 else None
    first_loss = last_loss = None
    throughput = Throughput()
    last_eval = first_eval
    while step < steps:
        lr = scheduler.get_last_lr()[0]
        micro_batches = [stream.next() for _ in range(accumulation)]
        if step == 0 and cfg.data.vocab and not cfg.data.synthetic:  # what the model is fed, for a person
            bar.print(f"sample: {decode_sample(micro_batches[0], cfg.data.vocab)[:400]}")
        micro_batches = [to_device(b, device) for b in micro_batches]
        out = train_step(ctx, micro_batches)
        step += 1
        throughput.add(cfg.train.global_batch_size)
        if step % cfg.log.every == 0 or step == steps or step == 1:
            values = {k: v.item() for k, v in out.items()}
            if not math.isfinite(values["loss"]):
                raise FloatingPointError(f"loss is {values['loss']} at step {step}; "
                                         f"lower train.lr or use execution.precision=fp32")
            first_loss = values["loss"] if first_loss is None else first_loss
            last_loss = values["loss"]
            seq_per_s = throughput.rate()
            logger.log({"step": step, **values, "lr": lr, "seq_per_s": seq_per_s,
                        "epoch": stream.epoch})
            bar.update(step, f"loss {values['loss']:.3f} mlm {values['mlm_loss']:.3f} "
                             f"nsp {values['nsp_loss']:.3f} {seq_per_s:.0f} seq/s")
        else:
            bar.update(step)
        if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step < steps:
            last_eval = run_eval()
        if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step < steps:
            save()
    final_checkpoint = save()
    last_eval = run_eval() or last_eval
    stream.close()
    bar.close()
    logger.close()
    summary = {
        "run_dir": str(run_dir), "checkpoint": str(final_checkpoint), "steps": step,
        "first_loss": first_loss, "last_loss": last_loss,
        "first_eval": first_eval, "last_eval": last_eval,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    console.print(f"done in {summary['wall_s']} s; checkpoint: {final_checkpoint}")
    return summary

