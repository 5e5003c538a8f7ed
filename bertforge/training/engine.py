"""One training step for every job: pre-training, SQuAD fine-tuning and both benchmarks.

    engine = Engine(model, optimizer, scheduler, loss_fn, cfg.execution.precision,
                    cfg.train.grad_clip, dist, seed=cfg.train.seed)
    for step in range(start, total):
        metrics = engine.step(stream.next() for _ in range(accumulation), accumulation, step)

A job differs from another only in its model, its ``loss_fn`` (the model and
one batch in, a dict of 0-dim tensors with ``"loss"`` out) and its data. The
engine runs each micro-batch forward and backward under autocast (scaled when
fp16), lets DDP synchronise gradients only on the last one, averages the
losses over micro-batches and ranks, then unscales, checks that the step is
finite, clips by global norm, steps the optimizer and the schedule. With
``optimizer_in_backward`` (``train.optimizer_in_backward``) the last
micro-batch's backward steps each parameter as its gradient is made
(``in_backward.py``); the step then only reports and schedules.

No step waits for the device. A step's losses, gradient norm and flags go to
the host in a copy that is read during the next step (``engine.report``):
then the job logs them, and a step that was not finite raises
:class:`NonFiniteError`. The optimizer does not wait for that: it skips the
update on the device (the ``found_inf`` of torch's fused optimizers, which
ours take too) from the first non-finite step on, so the weights stay those
of the last finite step. ``engine.flush()`` reads the newest step at once
(before a checkpoint, an evaluation, the end).

Data order and dropout do not depend on the world size: :class:`BatchStream`
splits one seeded order of micro-batches over the ranks, and each micro-batch
of a step seeds dropout from (seed, step, its index in the global batch), so
one process, DDP and FSDP see the same sequences and masks and give the same
losses, and a resumed run draws the same masks without any saved RNG state.

Preemption: inside ``with Preemption() as preemption`` (``engine.preemption =
preemption``), SIGTERM or SIGUSR1 (what Slurm sends before it kills a job)
only sets a flag. Each step all-reduces the flag with its losses, so every
rank learns in the same step, the one after it was raised (one process: at
once), that one of them was signalled (``engine.stop_requested``); the job
then saves a checkpoint and returns. A second signal exits at once.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import dataclasses
import itertools
import math
import os
import random
import signal
import statistics
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, Protocol, cast

import torch
from torch import nn

from bertforge.config import ConfigError
from bertforge.data.feed import HostCopy, to_device  # (to_device also imported from here by the jobs)
from bertforge.parallel.dist import DistContext, gradient_sync, mean_and_any

from .in_backward import OptimizerInBackward

LossFn = Callable[[nn.Module, dict[str, torch.Tensor]], dict[str, torch.Tensor]]


class NonFiniteError(FloatingPointError):
    """A step whose loss or gradient norm is not finite; the weights were left as they were."""


class DivergenceError(FloatingPointError):
    """A loss that exploded and stayed high (:class:`DivergenceGuard`)."""


class DivergenceGuard:
    """Stops a run whose loss explodes but stays finite, as large runs guard against.

    A step's loss is a spike when it is above ``factor`` × the median of the last
    ``window`` normal losses (spikes are kept out of that median, so a long spike does
    not raise its own bar); ``steps`` spikes in a row are a divergence, raised as
    :class:`DivergenceError`. The first ``min_history`` steps only fill the history.
    The loss of step k is that of the weights after step k - 1: the training loop
    keeps a checkpoint only once the loss after it is normal, and writes none while
    :attr:`spiking`, so the newest one is from before the spike. ``factor`` 0 is off.

    Each checkpoint saves :meth:`state_dict` (the history and the spikes so far), so that a
    resumed run judges its first steps as the run would have without the stop; a checkpoint
    without it (saved before it was kept) resumes with an empty history, refilled.
    """

    def __init__(self, factor: float, steps: int, window: int = 100, min_history: int = 10):
        self.factor, self.steps, self.min_history = factor, steps, min_history
        self.history: collections.deque[float] = collections.deque(maxlen=window)
        self.spikes = 0

    @property
    def enabled(self) -> bool:
        return self.factor > 0

    @property
    def spiking(self) -> bool:
        return self.spikes > 0

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history), "spikes": self.spikes}

    def load_state_dict(self, state: Any) -> None:
        """Restore :meth:`state_dict`; a ValueError says what is wrong with it."""
        if not isinstance(state, dict):
            raise ValueError(f"guard is not a mapping: {str(state)[:80]}")
        history, spikes = state.get("history"), state.get("spikes", 0)
        if not isinstance(history, list) or not all(isinstance(x, (int, float)) for x in history):
            raise ValueError(f"guard.history is not a list of losses: {str(history)[:80]}")
        if not isinstance(spikes, int) or spikes < 0:
            raise ValueError(f"guard.spikes is not a count: {spikes!r}")
        self.history.clear()
        self.history.extend(float(x) for x in history)  # (the newest ``window`` of them)
        self.spikes = spikes

    def update(self, step: int, loss: float) -> None:
        if not self.enabled:
            return
        median = statistics.median(self.history) if len(self.history) >= self.min_history else None
        if median is None or loss <= self.factor * median:
            self.spikes = 0
            self.history.append(loss)
            return
        self.spikes += 1
        if self.spikes >= self.steps:
            raise DivergenceError(
                f"step {step}: the loss ({loss:.4g}) has been above {self.factor:g} × its running median "
                f"({median:.4g}) for {self.spikes} steps: the run diverged (train.divergence_factor)")


PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preemption:
    """While entered, SIGTERM and SIGUSR1 ask the training loop to checkpoint and stop.

    The first signal sets :attr:`signum`; a second one exits at once (status
    128 + the signal), for a person or a scheduler that will not wait, after
    :attr:`on_hard_exit` (when set: what must not be left behind, such as a run
    directory with nothing in it to keep). Outside the main thread (where Python
    cannot install handlers) it does nothing. The handlers that were installed
    before are put back on exit.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self.on_hard_exit: Callable[[], object] | None = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def message(self, step: int, checkpoint: Path, run_dir: Path) -> str:
        """The line a job prints when it stopped for a signal (here or on another rank)."""
        return (f"preempted by {self.name or 'a signal on another rank'} after step {step}: "
                f"checkpoint {checkpoint}; continue with --resume {run_dir}")

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            os.write(2, f"{signal.Signals(signum).name} again: exiting now, without a checkpoint\n".encode())
            if self.on_hard_exit is not None:
                with contextlib.suppress(Exception):  # exiting at once matters more than what is left
                    self.on_hard_exit()
            os._exit(128 + signum)
        self.signum = signum
        os.write(2, f"{signal.Signals(signum).name}: finishing this step, then saving a checkpoint "
                    f"(send it again to exit at once)\n".encode())

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():
            for signum in PREEMPTION_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()


def set_threads(threads: int) -> None:
    """``execution.threads``: torch's CPU threads; 0 leaves torch's default."""
    if threads > 0:
        torch.set_num_threads(threads)


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision == "fp16" and device.type != "cuda":
        raise ConfigError("execution.precision=fp16 needs a CUDA device; use bf16 on the CPU")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device.type, dtype=dtype)


def grad_scaler(device: torch.device, precision: str, loss_scale: float = 1.0) -> torch.amp.GradScaler | None:
    """A loss scaler for fp16 (whose gradients underflow without one) unless a static ``loss_scale``
    (``train.loss_scale``) is given; None otherwise."""
    return torch.amp.GradScaler(device.type) if precision == "fp16" and loss_scale == 1 else None


def micro_batch_seed(seed: int, step: int, index: int) -> int:
    """The RNG seed of micro-batch ``index`` of the global batch of step ``step``.

    Dropout masks then depend on nothing else: not on the world size, nor on
    what ran before, so a resumed run needs no RNG state to draw the same ones.
    """
    return (seed * 1_000_003 + step) * 65_537 + index


def epoch_order(seed: int, epoch: int, size: int) -> torch.Tensor:
    """The seeded permutation of ``size`` examples for one epoch."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(size, generator=generator)


class Batches(Protocol):
    """What :class:`BatchStream` reads: a length and a batch of given rows. Rows with an
    ``epoch_order(seed, epoch)`` give the epoch's order themselves (``len`` rows, batch after batch)."""

    def __len__(self) -> int: ...

    def batch(self, indices: Any) -> dict[str, torch.Tensor]: ...


class BatchStream:
    """Micro-batches in a seeded random order per epoch; the last partial batch is dropped.

    The position (epoch, index) is all the state there is: a resumed stream
    computes the same permutation and starts at the same batch.

    Split over ``world_size`` ranks, rank r reads the micro-batches r, r + W,
    r + 2W, … of that one order. The position counts the micro-batches of all
    ranks together, so it is the same on every rank and means the same at any
    world size: after one step it has moved by the whole global batch.
    """

    def __init__(self, dataset: Batches, batch_size: int, seed: int, epoch: int = 0, index: int = 0,
                 rank: int = 0, world_size: int = 1):
        if len(dataset) < batch_size * world_size:
            ranks = f" × world size {world_size}" if world_size > 1 else ""
            raise ConfigError(f"the training set has {len(dataset)} sequences, fewer than "
                              f"train.micro_batch_size={batch_size}{ranks}")
        self.dataset, self.batch_size, self.seed = dataset, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.batches_in_order = len(dataset) // batch_size  # per epoch, all ranks together
        self.batches_per_epoch = self.batches_in_order // world_size  # what each rank reads, as RecordStream
        self.num_sequences = len(dataset)
        self._consumed = epoch * self.batches_in_order + index  # micro-batches, all ranks together
        self._order_epoch, self._order = -1, torch.empty(0, dtype=torch.long)

    @property
    def epoch(self) -> int:
        return self._consumed // self.batches_in_order

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._order_epoch:
            planned = getattr(self.dataset, "epoch_order", None)  # rows that plan their own batches (retrieval's)
            self._order_epoch = epoch
            self._order = planned(self.seed, epoch) if planned else epoch_order(self.seed, epoch, len(self.dataset))
        return self._order

    def next(self) -> dict[str, torch.Tensor]:
        epoch, index = divmod(self._consumed + self.rank, self.batches_in_order)
        self._consumed += self.world_size
        start = index * self.batch_size
        return self.dataset.batch(self._permutation(epoch)[start:start + self.batch_size].numpy())

    def state(self) -> dict[str, int]:
        epoch, index = divmod(self._consumed, self.batches_in_order)
        return {"epoch": epoch, "index": index}

    def close(self) -> None:
        pass


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


@dataclasses.dataclass(frozen=True)
class StepReport:
    """A finished step's numbers on the host: ``step`` counts the steps done (1 after the first),
    ``values`` are its losses and gradient norm (means over micro-batches and ranks)."""

    step: int
    values: dict[str, float]


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` reads ``found_inf`` (a 0-dim device tensor, non-zero: leave the
    weights and state as they are): torch's fused optimizers and ours (``training/optim.py``) do."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False) or getattr(optimizer, "skips_found_inf", False))


def due(every: int, step: int, total: int) -> bool:
    """Whether a periodic action (every ``every`` steps, 0: never) falls after ``step``: never
    after the last step, whose own comes after the loop."""
    return bool(every) and step % every == 0 and step < total


class BatchWarmup:
    """ModernBERT's batch-size warm-up (``BatchSizeWarmupScheduler``, src/sequence_packer.py of
    AnswerDotAI/ModernBERT): this rank's micro-batches a step, from ``first`` to ``full``, by the
    tokens this rank has read before the step.

    As there, the warm-up's tokens are all ranks' and each rank counts its own real tokens (padding
    left out): W = ceil(tokens / world size). Sizes first, …, full - 1 hold until thresholds
    t_b = ceil(W / S · (first + … + b)), S = first + … + (full - 1): a rank trains b micro-batches
    while its tokens are below t_b and at or above the one before; full from W on (each size lasts
    about the same number of steps)."""

    def __init__(self, first: int, full: int, tokens: int, world_size: int):
        if not 0 < first <= full:
            raise ConfigError(f"train.batch_size_warmup_min_size: {first} micro-batch(es) a rank, not in 1..{full} "
                              f"(this run's micro-batches a rank and step)")
        self.first, self.full = first, full
        self.tokens = math.ceil(tokens / world_size)
        sizes = range(first, full)
        per_unit = self.tokens / sum(sizes) if sizes else 0.0
        self.thresholds = [math.ceil(per_unit * total) for total in itertools.accumulate(sizes)]

    def micro_batches(self, tokens_read: int) -> int:
        """Micro-batches of the step that follows ``tokens_read`` tokens (this rank's)."""
        if tokens_read >= self.tokens:
            return self.full
        return self.first + bisect.bisect_right(self.thresholds, tokens_read)


def real_tokens(batch: dict[str, torch.Tensor]) -> int:
    """The tokens of a host batch that are not padding (what ModernBERT's packer counts)."""
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    if "sequence_ids" in batch:  # packed rows: 0 marks the padding after the last sequence
        return int((batch["sequence_ids"] > 0).sum())
    return batch["input_ids"].numel()


def _in_backward(optimizer: torch.optim.Optimizer, precision: str, grad_clip: float,
                 dist: DistContext) -> OptimizerInBackward:
    """The hooks of train.optimizer_in_backward, where the step allows them (config.validate says
    why in a job's terms; this guards the engine's other callers)."""
    if grad_clip > 0 or precision == "fp16" or dist.world_size > 1 or not skips_on_device(optimizer):
        raise ConfigError(f"train.optimizer_in_backward needs train.grad_clip 0 (got {grad_clip:g}), no fp16 "
                          f"(got {precision}), one process (got {dist.world_size}) and an optimizer that "
                          f"skips on the device (got {type(optimizer).__name__})")
    return OptimizerInBackward(optimizer)


class Engine:
    """The model as training runs it (wrapped by ``dist.prepare_model``), its optimizer,
    schedule and loss scaler, and the step that uses them."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, loss_fn: LossFn, precision: str,
                 grad_clip: float, dist: DistContext | None = None, seed: int | None = None,
                 grad_sync: str = "step", loss_scale: float = 1.0, scaled_state: bool = False,
                 optimizer_in_backward: bool = False):
        self.model, self.optimizer, self.scheduler, self.loss_fn = model, optimizer, scheduler, loss_fn
        self.precision, self.grad_clip = precision, grad_clip
        # train.loss_scale and train.scaled_optimizer_state (see _unscale)
        self.loss_scale, self.scaled_state = loss_scale, scaled_state
        self.grad_sync = grad_sync  # execution.grad_sync: when FSDP2 reduce-scatters (dist.gradient_sync)
        self.dist = dist or DistContext()
        self.device = self.dist.device
        self.seed = seed  # seed dropout per micro-batch; None leaves the RNG alone (benchmarks)
        self.scaler = grad_scaler(self.device, precision, loss_scale)
        self.preemption: Preemption | None = None  # set by a job that stops cleanly on SIGTERM
        self.stop_requested = False  # some rank was signalled; all ranks agree, after the same step
        self.report: StepReport | None = None  # the step before the newest, read during the newest
        self._healthy: torch.Tensor | None = None  # on the device: no step so far was non-finite
        self._pending: tuple[int, list[str], HostCopy] | None = None  # the newest step, on its way
        # train.optimizer_in_backward: each parameter steps in the last micro-batch's backward (in_backward.py)
        self.in_backward = _in_backward(optimizer, precision, grad_clip, self.dist) if optimizer_in_backward else None

    @property
    def lr(self) -> float:
        return cast(float, self.scheduler.get_last_lr()[0])  # a tensor only for a tensor lr, which we never set

    def step(self, micro_batches: Iterable[dict[str, torch.Tensor]], accumulation: int,
             step: int = 0) -> dict[str, torch.Tensor]:
        """Forward and backward over this rank's ``accumulation`` micro-batches, then one optimizer step.

        Micro-batches are taken from the iterable as the step reaches them.
        Returns the step's losses (means over micro-batches and ranks) and its
        global gradient norm before clipping, as device tensors, and waits for
        none of them. Then :attr:`report` holds the step before's, read from the
        host copy of them, which raises :class:`NonFiniteError` if that step was
        not finite (its update, and this one's, were skipped on the device; under
        fp16 the loss scaler skips such steps and the run goes on).
        """
        rank, world_size = self.dist.rank, self.dist.world_size
        totals: dict[str, torch.Tensor] = {}
        count = 0
        for i, batch in enumerate(micro_batches):
            if self.seed is not None:
                torch.manual_seed(micro_batch_seed(self.seed, step, rank + i * world_size))
            # DDP all-reduces the accumulated gradients once, after the last micro-batch.
            with gradient_sync(self.model, enabled=i == accumulation - 1, grad_sync=self.grad_sync):
                with autocast(self.device, self.precision):
                    out = self.loss_fn(self.model, to_device(batch, self.device))
                for key, value in out.items():
                    totals[key] = totals.get(key, 0.0) + value.detach().float() / accumulation
                if self.in_backward is not None and i == accumulation - 1:
                    self._arm_in_backward(totals["loss"])
                loss = out["loss"] / accumulation
                (self.scaler.scale(loss) if self.scaler is not None else loss * self.loss_scale).backward()
            count += 1
        if count != accumulation:
            raise ValueError(f"step {step}: got {count} micro-batches, expected {accumulation}")
        signalled = self.preemption is not None and self.preemption.requested
        totals, stop = mean_and_any(self.dist, totals, signalled)
        if world_size == 1:
            self.stop_requested = signalled  # this process's own flag: nothing to wait for
        if self.in_backward is not None:
            totals["grad_norm"] = self._finish_in_backward(totals, step)
        else:
            totals["grad_norm"] = self._apply_gradients(totals, step, stop if world_size > 1 else None)
        return totals

    def _arm_in_backward(self, loss: torch.Tensor) -> None:
        """Before the last backward of a step: the hooks step each parameter unless this step's
        loss so far, or any step before, was not finite."""
        assert self.in_backward is not None
        finite = torch.isfinite(loss)
        self.in_backward.arm(finite if self._healthy is None else self._healthy & finite)

    def _finish_in_backward(self, totals: dict[str, torch.Tensor], step: int) -> torch.Tensor:
        """After the backward that stepped every parameter: report, schedule, clear (as
        :meth:`_apply_gradients` does after its step); the gradient norm."""
        assert self.in_backward is not None
        grad_norm, healthy = self.in_backward.finish()
        finite = torch.isfinite(totals["loss"]) & torch.isfinite(grad_norm)
        self._send(step, {**totals, "grad_norm": grad_norm}, finite, None)
        self._healthy = healthy & finite
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def _apply_gradients(self, totals: dict[str, torch.Tensor], step: int,
                         stop: torch.Tensor | None = None) -> torch.Tensor:
        """Unscale, check, clip by global norm, step, schedule, clear; the norm before clipping.

        ``stop`` is the all-reduced preemption flag (several ranks), sent to the host with the
        losses; it and the finiteness are read a step later (:meth:`_settle`)."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm, kept_norm, clip = self._unscale(params)
        finite = torch.isfinite(totals["loss"]) & torch.isfinite(grad_norm)
        self._send(step, {**totals, "grad_norm": grad_norm}, finite, stop)
        if self.grad_clip > 0:
            torch.nn.utils.clip_grads_with_norm_(params, clip, kept_norm)
        if self.scaler is not None:  # fp16: the scaler skips non-finite steps itself and lowers its scale
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            if not skips_on_device(self.optimizer):  # it cannot skip a step by itself: read the flag now
                try:
                    self.flush()
                except NonFiniteError:
                    self.optimizer.zero_grad(set_to_none=True)
                    raise
            # From the first non-finite step on, no update is applied: the weights stay the last finite ones.
            self._healthy = finite if self._healthy is None else self._healthy & finite
            self.optimizer.found_inf = (~self._healthy).float()  # type: ignore[attr-defined]
            self.optimizer.grad_scale = None  # type: ignore[attr-defined]  # (the gradients are unscaled)
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def _unscale(self, params: list[nn.Parameter]) -> tuple[torch.Tensor, torch.Tensor, float]:
        """The global norm of the unscaled gradients; the norm and the clip threshold of the gradients as
        they stay.

        A static loss scale S (``train.loss_scale``, PopXL's ``loss_scaling``) is undone as PopXL's BERT does
        (popxl_addons' AdamOptimizerStep): gradients × 1/S, in fp32, before clipping and the update. With
        ``scaled_state`` (PopART's ``scaled_optimizer_state``) they stay scaled: the clip threshold is × S and
        the optimizer's eps × S (build_optimizer), which gives the same update."""
        if self.scaled_state and self.loss_scale != 1:
            kept = self._total_norm(params)
            return kept / self.loss_scale, kept, self.grad_clip * self.loss_scale
        if self.loss_scale != 1:  # (foreach ops compute in fp32 for bf16 tensors)
            torch._foreach_mul_([cast(torch.Tensor, p.grad) for p in params], 1.0 / self.loss_scale)
        grad_norm = self._total_norm(params)
        return grad_norm, grad_norm, self.grad_clip

    def _total_norm(self, params: list[nn.Parameter]) -> torch.Tensor:
        """The global norm of the gradients of ``params`` (all of the model's on this rank)."""
        # Under FSDP the gradients are shards (DTensors) and this is the norm of the whole.
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        return grad_norm

    def _send(self, step: int, values: dict[str, torch.Tensor], finite: torch.Tensor,
              stop: torch.Tensor | None) -> None:
        """Start the host copy of this step's numbers; read the step before's (:attr:`report`)."""
        previous = self._pending
        flags = {"finite": finite} if stop is None else {"finite": finite, "stop": stop}
        named = {**values, **flags}
        self._pending = (step, list(named), HostCopy(list(named.values())))
        self.report = self._settle(previous) if previous is not None else None

    def flush(self) -> StepReport | None:
        """The newest step's report, read now (waiting for the device); None if it was read already."""
        pending, self._pending = self._pending, None
        self.report = self._settle(pending) if pending is not None else None
        return self.report

    def _settle(self, pending: tuple[int, list[str], HostCopy]) -> StepReport:
        step, names, copy = pending
        values = dict(zip(names, copy.values()))
        finite = values.pop("finite") > 0
        if "stop" in values:  # the same on every rank (all-reduced): all stop after the same step
            self.stop_requested = values.pop("stop") > 0
        if not finite and self.scaler is None:  # (fp16's scaler skipped it and goes on)
            what = (f"the loss is {values['loss']}" if not math.isfinite(values["loss"])
                    else f"the gradient norm is {values['grad_norm']}")
            hint = "; or use execution.precision=fp32" if self.precision != "fp32" else ""
            raise NonFiniteError(f"step {step + 1}: {what}; the weights were not updated. "
                                 f"Lower train.lr or raise train.warmup_steps{hint}")
        return StepReport(step + 1, values)

    def state_dict(self) -> dict[str, Any]:
        """The schedule, the loss scaler and the RNG states (the optimizer is saved on its own)."""
        state = {"scheduler": self.scheduler.state_dict(), "rng": rng_state(self.device)}
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
        set_rng_state(state["rng"], self.device)
