"""Optimisers and learning-rate schedules for BERT pre-training and fine-tuning.

* ``param_groups``: splits a model's parameters into a weight-decay group and
  a no-decay group (biases and LayerNorm), as google-research/bert does.
* ``Lamb``: LAMB (You et al. 2019, "Large Batch Optimization for Deep
  Learning", Algorithm 2) with an optional clamp of the trust ratio.
* ``AdamWNoBiasCorrection``: Adam with decoupled weight decay and no bias
  correction, the update of google-research/bert's AdamWeightDecayOptimizer.
  With bias correction we use ``torch.optim.AdamW``.
* ``build_optimizer``: one of the above from a ``TrainConfig``.
* ``lr_at`` / ``build_scheduler``: the learning-rate schedules of Graphcore's
  TF1 BERT application (polynomial decay, natural exponential decay, a
  step → lr table) plus a constant one, all with linear warm-up except the
  table.

Optimiser state holds only tensors and Python numbers, so ``state_dict()``
survives ``torch.save`` / ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import bisect
import copy
import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import TypeGuard

import torch
from torch import nn

from .config import ConfigError, TrainConfig

try:  # the parameters of a model sharded by FSDP2
    from torch.distributed.tensor import DTensor, Shard
    _HAVE_DTENSOR = True
except ImportError:  # a torch built without distributed support
    _HAVE_DTENSOR = False

# google-research/bert excludes these (by regex search) from weight decay;
# "layer_norm" covers models whose LayerNorm modules are named in snake case.
_NO_DECAY_SUBSTRINGS = ("LayerNorm", "layer_norm")


def _decays(name: str) -> bool:
    return not (name.endswith("bias") or any(s in name for s in _NO_DECAY_SUBSTRINGS))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """``[decay group, no-decay group]`` of the trainable parameters of ``model``.

    Biases and LayerNorm parameters get no weight decay. Both groups are always
    present (possibly empty) so that the group order of a saved optimizer state
    does not depend on the model.
    """
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, param in model.named_parameters():  # tied weights are listed once
        if not param.requires_grad:
            continue
        (decay if _decays(name) else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def _check_hyperparameters(lr: float, betas: tuple[float, float], eps: float,
                           weight_decay: float) -> None:
    if lr < 0:
        raise ValueError(f"invalid learning rate {lr}")
    if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
        raise ValueError(f"invalid betas {betas}")
    if eps < 0:
        raise ValueError(f"invalid eps {eps}")
    if weight_decay < 0:
        raise ValueError(f"invalid weight_decay {weight_decay}")


def _by_device_and_dtype(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Split a list so that each ``torch._foreach`` call sees one device and dtype
    (and one process group, for tensors sharded across ranks)."""
    buckets: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        buckets[(p.device, p.dtype, _shard_group(p))].append(p)
    return list(buckets.values())


def _shard_group(t: torch.Tensor):
    """The process group over which ``t`` is split (an FSDP2 parameter), else None."""
    if not _is_dtensor(t):
        return None
    if not any(isinstance(p, Shard) for p in t.placements):
        return None  # replicated: every rank holds the whole tensor
    if t.device_mesh.ndim != 1:
        raise NotImplementedError("our optimizers support tensors sharded over a 1-D device mesh only")
    return t.device_mesh.get_group()


def _is_dtensor(t: torch.Tensor) -> TypeGuard[DTensor]:
    return _HAVE_DTENSOR and isinstance(t, DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (sharded) tensor; in-place changes to it change the tensor."""
    return t.to_local() if _is_dtensor(t) else t


class _AdamMoments(torch.optim.Optimizer):
    """Shared part of our Adam-style optimisers: state, moments, the step loop.

    Subclasses implement ``_apply(group, params, updates, shard_group)`` given
    the Adam direction ``m̂ / (sqrt(v̂) + eps)`` of each parameter.

    Parameters sharded across ranks (FSDP2's DTensors) are updated through
    their local shards: the state stays sharded like the parameter (which is
    what torch.distributed.checkpoint saves) and ``shard_group`` names the
    ranks that hold the other parts, for updates that need whole-tensor norms.
    """

    def _apply(self, group: dict, params: list[torch.Tensor], updates: tuple[torch.Tensor, ...],
               shard_group) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def step(  # type: ignore[override]  # torch's stub says closures return a float; they return the loss tensor
            self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            with_grad = [p for p in group["params"] if p.grad is not None]
            for bucket in _by_device_and_dtype(with_grad):
                self._step_bucket(group, bucket)
        return loss

    def _step_bucket(self, group: dict, params: list[torch.Tensor]) -> None:
        beta1, beta2 = group["betas"]
        grads, exp_avgs, exp_avg_sqs, steps = [], [], [], []
        for p in params:
            grad = p.grad
            assert grad is not None  # step() passes only parameters with a gradient
            if grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            state = self.state[p]
            if not state:
                # A plain int step: exact, and untouched by load_state_dict's casting.
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            grads.append(_local(grad))
            exp_avgs.append(_local(state["exp_avg"]))
            exp_avg_sqs.append(_local(state["exp_avg_sq"]))
            steps.append(state["step"])

        # m = b1 m + (1 - b1) g ;  v = b2 v + (1 - b2) g²
        torch._foreach_mul_(exp_avgs, beta1)
        torch._foreach_add_(exp_avgs, grads, alpha=1.0 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)

        m_hat: list[torch.Tensor] | tuple[torch.Tensor, ...]
        if group.get("bias_correction", False):
            # Steps may differ between parameters (one without a gradient on
            # some step), so the corrections are per tensor.
            m_hat = torch._foreach_div(exp_avgs, [1.0 - beta1 ** t for t in steps])
            denom = torch._foreach_div(exp_avg_sqs, [1.0 - beta2 ** t for t in steps])
            torch._foreach_sqrt_(denom)
        else:
            m_hat = exp_avgs
            denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_add_(denom, group["eps"])
        updates = torch._foreach_div(m_hat, denom)  # new tensors: the moments stay intact
        self._apply(group, [_local(p) for p in params], updates, _shard_group(params[0]))


class Lamb(_AdamMoments):
    """LAMB: Adam's direction plus decoupled weight decay, scaled per tensor by
    the trust ratio ``||w|| / ||update||``.

    Per parameter tensor w with gradient g at step t::

        m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g²
        m̂, v̂ = m / (1 - b1^t), v / (1 - b2^t)     (m, v without bias_correction)
        u = m̂ / (sqrt(v̂) + eps) + weight_decay · w
        r = ||w|| / ||u||  (1 when either norm is 0), at most max_trust_ratio if > 0
        w -= lr · r · u
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0, bias_correction: bool = True,
                 max_trust_ratio: float = 10.0):
        _check_hyperparameters(lr, betas, eps, weight_decay)
        if max_trust_ratio < 0:
            raise ValueError(f"invalid max_trust_ratio {max_trust_ratio}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, max_trust_ratio=max_trust_ratio)
        super().__init__(params, defaults)

    def _trust_ratio(self, w: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
        """``||w|| / ||update||`` of a whole tensor as a 0-dim tensor on w's device."""
        return _ratio(torch.linalg.vector_norm(w), torch.linalg.vector_norm(update))

    def _sharded_trust_ratios(self, params: list[torch.Tensor], updates: tuple[torch.Tensor, ...],
                              shard_group) -> list[torch.Tensor]:
        """The trust ratios of tensors of which this rank holds one part each.

        The norms must be of the whole tensors: each rank's squared norms of
        its parts are summed over the ranks, all tensors in one all-reduce.
        """
        import torch.distributed as dist

        norms = [torch.stack(torch._foreach_norm(ts)).float() for ts in (params, updates)]
        squares = torch.stack(norms).square()  # (2, tensors)
        dist.all_reduce(squares, group=shard_group)
        w_norms, u_norms = squares.sqrt().unbind()
        return [r.to(p.dtype) for r, p in zip(_ratio(w_norms, u_norms).unbind(), params)]

    def _apply(self, group: dict, params: list[torch.Tensor], updates: tuple[torch.Tensor, ...],
               shard_group) -> None:
        if group["weight_decay"] != 0:
            torch._foreach_add_(updates, params, alpha=group["weight_decay"])
        # All ratios use the weights before this step, as in the paper.
        if shard_group is None:
            ratios = [self._trust_ratio(w, u) for w, u in zip(params, updates)]
        else:
            ratios = self._sharded_trust_ratios(params, updates, shard_group)
        if group["max_trust_ratio"] > 0:
            torch._foreach_clamp_max_(ratios, group["max_trust_ratio"])
        torch._foreach_mul_(updates, ratios)
        torch._foreach_add_(params, updates, alpha=-group["lr"])


def _ratio(w_norm: torch.Tensor, u_norm: torch.Tensor) -> torch.Tensor:
    """``w_norm / u_norm``, 1 where either is 0 (elementwise).

    torch.where instead of a Python ``if``: no device → host sync per tensor.
    """
    return torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))


class AdamWNoBiasCorrection(_AdamMoments):
    """Adam with decoupled weight decay and *no* bias correction.

    The update of google-research/bert's ``AdamWeightDecayOptimizer`` (and of
    the PopXL SQuAD option ``bias_correction=False``)::

        m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g²
        w -= lr · (m / (sqrt(v) + eps) + weight_decay · w)

    With bias correction use ``torch.optim.AdamW``, which is the same update
    applied to m̂ and v̂.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0):
        _check_hyperparameters(lr, betas, eps, weight_decay)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    def _apply(self, group: dict, params: list[torch.Tensor], updates: tuple[torch.Tensor, ...],
               shard_group) -> None:
        # Elementwise: each rank updates its own shard, no communication needed.
        if group["weight_decay"] != 0:
            torch._foreach_add_(updates, params, alpha=group["weight_decay"])
        torch._foreach_add_(params, updates, alpha=-group["lr"])


def _check_train_optimizer(train: TrainConfig) -> None:
    if train.lr < 0:
        raise ConfigError(f"train.lr={train.lr} must not be negative")
    for key in ("beta1", "beta2"):
        value = getattr(train, key)
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"train.{key}={value} must be in [0, 1)")
    for key in ("eps", "weight_decay", "max_trust_ratio"):
        value = getattr(train, key)
        if value < 0:
            raise ConfigError(f"train.{key}={value} must not be negative")


def build_optimizer(model: nn.Module, train: TrainConfig) -> torch.optim.Optimizer:
    """The optimizer named by ``train.optimizer`` over ``param_groups(model, ...)``."""
    _check_train_optimizer(train)
    groups = param_groups(model, train.weight_decay)
    betas = (train.beta1, train.beta2)
    if train.optimizer == "lamb":
        return Lamb(groups, lr=train.lr, betas=betas, eps=train.eps, weight_decay=train.weight_decay,
                    bias_correction=train.bias_correction, max_trust_ratio=train.max_trust_ratio)
    if train.optimizer == "adamw":
        if train.bias_correction:
            return torch.optim.AdamW(groups, lr=train.lr, betas=betas, eps=train.eps,
                                     weight_decay=train.weight_decay, foreach=True)
        return AdamWNoBiasCorrection(groups, lr=train.lr, betas=betas, eps=train.eps,
                                     weight_decay=train.weight_decay)
    raise ConfigError(f"train.optimizer: {train.optimizer!r} is not one of lamb, adamw")


# ------------------------------------------------------------ lr schedules

SCHEDULES = ("poly", "exp", "table", "constant")


def warmup_steps(train: TrainConfig, total_steps: int) -> int:
    """Warm-up length: ``train.warmup_steps``, else that share of ``total_steps``."""
    if train.warmup_steps > 0:
        return train.warmup_steps
    return round(train.warmup_proportion * total_steps)


def _check_schedule(train: TrainConfig, total_steps: int) -> None:
    if train.schedule not in SCHEDULES:
        raise ConfigError(f"train.schedule: {train.schedule!r} is not one of {', '.join(SCHEDULES)}")
    if total_steps <= 0:
        raise ConfigError(f"total_steps={total_steps} (from train.steps or train.epochs) must be positive")
    if train.warmup_steps < 0:
        raise ConfigError(f"train.warmup_steps={train.warmup_steps} must not be negative")
    if not 0.0 <= train.warmup_proportion <= 1.0:
        raise ConfigError(f"train.warmup_proportion={train.warmup_proportion} must be in [0, 1]")
    if train.lr < 0:
        raise ConfigError(f"train.lr={train.lr} must not be negative")
    if train.schedule == "poly":
        if train.decay_power < 0:
            raise ConfigError(f"train.decay_power={train.decay_power} must not be negative")
        if train.end_lr < 0:
            raise ConfigError(f"train.end_lr={train.end_lr} must not be negative")
    elif train.schedule == "exp":
        if train.exp_decay_rate < 0:
            raise ConfigError(f"train.exp_decay_rate={train.exp_decay_rate} must not be negative")
        if train.exp_decay_steps <= 0:
            raise ConfigError(f"train.exp_decay_steps={train.exp_decay_steps} must be positive")
    elif train.schedule == "table":
        table = train.lr_table
        if 0 not in table:
            raise ConfigError(f"train.lr_table must have an entry for step 0, got {table!r}")
        if any(step < 0 or lr < 0 for step, lr in table.items()):
            raise ConfigError(f"train.lr_table: steps and learning rates must not be negative, got {table!r}")


def lr_at(step: int, train: TrainConfig, total_steps: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based) of a ``total_steps`` run."""
    _check_schedule(train, total_steps)
    if step < 0:
        raise ValueError(f"step={step} must not be negative")

    if train.schedule == "table":  # absolute values; no warm-up
        keys = sorted(train.lr_table)
        return float(train.lr_table[keys[bisect.bisect_right(keys, step) - 1]])

    warmup = warmup_steps(train, total_steps)
    if step < warmup:
        # google-research/bert uses lr · step / warmup, which makes step 0 a
        # wasted step with lr 0. We use (step + 1): the first step is non-zero
        # and the last warm-up step reaches the full lr.
        return train.lr * (step + 1) / warmup

    after = step - warmup  # steps since the end of warm-up
    if train.schedule == "poly":
        span = total_steps - warmup
        # A warm-up as long as the run leaves nothing to decay over: end_lr.
        progress = min(max(after / span, 0.0), 1.0) if span > 0 else 1.0
        return (train.lr - train.end_lr) * (1.0 - progress) ** train.decay_power + train.end_lr
    if train.schedule == "exp":  # tf.train.natural_exp_decay, started after warm-up
        return train.lr * math.exp(-train.exp_decay_rate * after / train.exp_decay_steps)
    return train.lr  # constant


def build_scheduler(optimizer: torch.optim.Optimizer, train: TrainConfig,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` giving each group ``initial lr × lr_at(k) / train.lr`` at step k.

    The optimizer's groups must start at ``train.lr`` (as ``build_optimizer``
    makes them); then optimizer step k runs at ``lr_at(k)`` when the loop calls
    ``optimizer.step()`` then ``scheduler.step()``: LambdaLR evaluates the
    multiplier for its epoch 0 on construction and epoch k after k steps.

    To resume, build the optimizer and the scheduler first, then load both
    state dicts. The multiplier is a closure, which LambdaLR does not save;
    it is rebuilt from the config.
    """
    _check_schedule(train, total_steps)
    if train.lr <= 0:
        raise ConfigError(f"train.lr={train.lr} must be positive for a learning-rate schedule")
    train = copy.deepcopy(train)  # later edits of the caller's config must not change the schedule

    def multiplier(step: int) -> float:
        return lr_at(step, train, total_steps) / train.lr

    return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)
