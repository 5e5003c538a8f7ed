"""Optimisers and learning-rate schedules for BERT pre-training and fine-tuning.

* ``param_groups``: splits a model's parameters into a weight-decay group and
  a no-decay group (biases and norms), as google-research/bert and ModernBERT do.
* ``Lamb``: LAMB (You et al. 2019, "Large Batch Optimization for Deep
  Learning", Algorithm 2) with per-group layer adaptation and an optional
  clamp of the trust ratio; ``build_optimizer`` sets these per
  ``train.lamb`` so that each named variant equals its reference:

  =========  ===================  ============  ==========  ======  ===============
  lamb       trust ratio on       decay on      clamp of r  r at 0  bias correction
  =========  ===================  ============  ==========  ======  ===============
  bertforge  every tensor         decay group   yes         1       as configured
  mlperf     decay group only     decay group   no          1       always
  nvidia     tensors with wd > 0  decay group   no          1       as configured
  paper      every tensor         every tensor  no          0       always
  =========  ===================  ============  ==========  ======  ===============

  ``mlperf`` is MLCommons' BERT reference (``lamb_optimizer_v1.LAMBOptimizer``
  as ``optimization.create_optimizer`` builds it: LayerNorm and bias excluded
  from decay and from layer adaptation); ``nvidia`` is apex's ``FusedLAMB``
  as NVIDIA's DeepLearningExamples BERT uses it (``use_nvlamb=False``: no
  adaptation where a group's weight decay is 0, so none at all when
  ``train.weight_decay`` is 0); ``paper`` is Algorithm 2 as written, with
  φ the identity: r = ||w|| / ||u|| is 0 for a zero tensor, so zero-initialised
  tensors (BERT's biases) never move. "r at 0" is the ratio where a norm is 0.
  All use u = m̂ / (sqrt(v̂) + eps) + wd · w. Both references clip the
  gradients by global norm before the update (``tf.clip_by_global_norm``,
  FusedLAMB's ``max_grad_norm``); here the training engine does that, with
  ``train.grad_clip`` (1.0 in both references).
* ``AdamWNoBiasCorrection``: Adam with decoupled weight decay and no bias
  correction, the update of google-research/bert's AdamWeightDecayOptimizer.
  With bias correction we use ``torch.optim.AdamW`` (fused on CUDA).
* ``StableAdamW``: AdamW with each tensor's step clipped by the RMS of its
  gradient over the second moment, and weight decay that does not scale with
  the lr (``decouple_lr``): ModernBERT's ``decoupled_stableadamw``.
* ``build_optimizer``: one of the above from a ``TrainConfig``.
* ``lr_at`` / ``build_scheduler``: polynomial decay after a warm-up
  (``poly``), the MLPerf reference's TensorFlow polynomial decay over the
  whole run (``poly_tf``), natural exponential decay, smooth (``exp``) or as
  Graphcore's TF1 BERT application steps it (``exp_staircase``), a step → lr
  table, a constant, and ModernBERT's warm-up, stable, decay (``wsd``); see
  ``lr_at``.

Our optimisers update all tensors of a device and dtype with multi-tensor
(``torch._foreach_*``) operations: no Python loop over tensors does arithmetic.
That chain of operations is a pass over memory each, about 104 bytes per fp32
parameter for a LAMB step. With ``compiled=True`` (``build_optimizer``'s
``compiled``, which training sets where the model compiles on CUDA) the same
update runs as a few functions that torch.compile fuses instead (see "the
compiled step" below): LAMB in two passes over memory, 40 bytes per
parameter. Optimiser state holds only tensors and Python numbers, the same
either way, so ``state_dict()`` survives ``torch.save`` /
``torch.load(weights_only=True)`` and a run resumes with either step.
"""

from __future__ import annotations

import bisect
import copy
import functools
import math
import typing
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import TypeGuard

import torch
from torch import nn

from bertforge.config import ConfigError, LambVariant, Optimizer, Schedule, TrainConfig
from bertforge.parallel.plan import ROUNDED_CHUNK_ELEMENTS  # (what the memory planner counts)

try:  # the parameters of a model sharded by FSDP2
    from torch.distributed.tensor import DTensor, Shard
    _HAVE_DTENSOR = True
except ImportError:  # a torch built without distributed support
    _HAVE_DTENSOR = False

# google-research/bert excludes these (by regex search) from weight decay;
# "layer_norm" covers models whose LayerNorm modules are named in snake case.
_NO_DECAY_SUBSTRINGS = ("LayerNorm", "layer_norm")


def _decays(name: str, param: nn.Parameter) -> bool:
    # ModernBERT (main.py's param_groups_weight_decay) excludes every tensor of at most one
    # dimension, whatever its name: its norms (norm, attn_norm, mlp_norm, final_norm, head.norm)
    # have weights only.
    return not (param.ndim <= 1 or name.endswith("bias") or any(s in name for s in _NO_DECAY_SUBSTRINGS))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """``[decay group, no-decay group]`` of the trainable parameters of ``model``.

    Biases, LayerNorm parameters and every other tensor of at most one dimension
    (a norm's weight) get no weight decay. Both groups are always present
    (possibly empty) so that the group order of a saved optimizer state does not
    depend on the model.
    """
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, param in model.named_parameters():  # tied weights are listed once
        if not param.requires_grad:
            continue
        (decay if _decays(name, param) else no_decay).append(param)
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

    Per group (with its ``betas``, ``eps``, ``weight_decay`` and optional
    ``bias_correction``), the moments and the Adam direction plus decoupled
    weight decay of every tensor::

        m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g²
        u = m̂ / (sqrt(v̂) + eps) + weight_decay · w

    Subclasses implement ``_apply(group, params, updates, scale, shard_group)``,
    which moves the weights along u = ``scale`` × ``updates`` (see ``_step_bucket``).

    Parameters sharded across ranks (FSDP2's DTensors) are updated through
    their local shards: the state stays sharded like the parameter (which is
    what torch.distributed.checkpoint saves) and ``shard_group`` names the
    ranks that hold the other parts, for updates that need whole-tensor norms.

    With ``compiled`` a bucket whose tensors are all at one step runs
    ``_step_compiled`` instead: the same update in torch.compile'd passes (a
    bucket with tensors at different steps, rare, takes the eager path).

    A step whose gradients are not finite is skipped on the device, as torch's
    fused optimizers skip one: the training engine sets ``found_inf`` (a 0-dim
    device tensor, non-zero to skip) before ``step()``, and the step then leaves
    weights and moments as they were without the host reading the flag: the
    gradients are zeroed where they would be read, and the moments' and weights'
    coefficients multiplied by ``keep`` (0 or 1). The step count still rises;
    the engine stops the run after such a step. Without ``found_inf`` the step
    is the plain one.
    """

    skips_found_inf = True  # (engine.skips_on_device)

    def __init__(self, params: Iterable, defaults: dict, compiled: bool):
        super().__init__(params, defaults)
        # Not a group setting: a state dict saved by either step loads into either.
        self.compiled = compiled
        self.found_inf: torch.Tensor | None = None  # set by the engine before a step (see above)
        self.rounding: Bf16Rounding | None = None  # bf16 weights: how updates round back (build_optimizer)

    def _apply(self, group: dict, params: list[torch.Tensor], updates: list[torch.Tensor],
               scale: Scalars, shard_group, keep: torch.Tensor | None) -> None:
        raise NotImplementedError

    def _step_compiled(self, group: dict, lists: _Lists, scale: float, eps: float, shard_group,
                       keep: torch.Tensor) -> None:
        """The compiled update of one bucket, ``scale`` (c) and ``eps`` (eps') as in ``_step_bucket``:
        here with r = 1 (AdamW's update), in one pass over memory."""
        coefficient = _coefficients(lists.params[0].dtype)
        _compiled(_fused_adam)(*lists, *group["betas"], coefficient(eps),
                               coefficient(self._decay(group) / scale), coefficient(scale * -group["lr"]), keep)

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
                keep = None if self.found_inf is None else (self.found_inf == 0).to(bucket[0].device)
                if self.rounding is not None and bucket[0].dtype == torch.bfloat16:
                    self._step_rounded(group, bucket, keep, self.rounding)
                else:
                    self._step_bucket(group, bucket, keep)
        return loss

    def _step_rounded(self, group: dict, params: list[torch.Tensor], keep: torch.Tensor | None,
                      rounding: Bf16Rounding) -> None:
        """bf16 weights: the update of fp32 copies of a few tensors at a time (weights, gradients, moments),
        each rounded back by ``rounding``; the same step as fp32 weights would take from these values."""
        for chunk in _chunks(params, ROUNDED_CHUNK_ELEMENTS):
            masters = [p.detach().float() for p in chunk]
            for p, master in zip(chunk, masters):
                master.grad = typing.cast(torch.Tensor, p.grad).float()
                self.state[master] = {k: v.float() if _is_moment(k, v) else v for k, v in self.state[p].items()}
            self._step_bucket(group, masters, keep)
            for p, master in zip(chunk, masters):
                work, stored = self.state.pop(master), self.state[p]
                for key, value in work.items():
                    if not _is_moment(key, value):
                        stored[key] = value
                    elif rounding.state_dtype == torch.float32:
                        stored[key] = value
                    else:
                        if key not in stored:
                            stored[key] = torch.empty_like(value, dtype=torch.bfloat16)
                        rounding.round_(stored[key], value)
                rounding.round_(p.data, master)

    def state_dict(self) -> dict[str, typing.Any]:
        state = super().state_dict()
        if self.rounding is not None:
            state["rounding"] = self.rounding.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, typing.Any]) -> None:
        state_dict = dict(state_dict)
        rounding = state_dict.pop("rounding", None)
        super().load_state_dict(state_dict)
        if self.rounding is None:
            return
        # torch casts floating-point state to its parameter's dtype: fp32 moments of bf16 weights stay fp32.
        params = [p for group in self.param_groups for p in group["params"]]
        for index, saved in state_dict["state"].items():
            for key, value in saved.items():
                if _is_moment(key, value):
                    self.state[params[index]][key] = value.to(params[index].device, self.rounding.state_dtype)
        if rounding is not None:
            self.rounding.load_state_dict(rounding)

    def _state_lists(self, params: list[torch.Tensor]) -> tuple[list[torch.Tensor], ...]:
        """Gradients, first and second moments (local shards) of ``params``; counts this step."""
        grads, exp_avgs, exp_avg_sqs = [], [], []
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
        return grads, exp_avgs, exp_avg_sqs

    def _decay(self, group: dict) -> float:
        """The λ of u = m̂ / (sqrt(v̂) + eps) + λ · w: the group's weight decay."""
        return group["weight_decay"]

    def _corrections(self, group: dict, params: list[torch.Tensor]) -> tuple[list[float], list[float]]:
        """Per tensor, c and eps' of ``_step_bucket`` (1 and eps without bias correction)."""
        beta1, beta2 = group["betas"]
        # Steps may differ between tensors (one without a gradient on some step), so the scalars are per tensor.
        steps = [self.state[p]["step"] for p in params]
        if not group.get("bias_correction", False):
            return [1.0] * len(steps), [group["eps"]] * len(steps)
        root2 = [math.sqrt(1.0 - beta2 ** t) for t in steps]
        return [r / (1.0 - beta1 ** t) for r, t in zip(root2, steps)], [group["eps"] * r for r in root2]

    def _step_bucket(self, group: dict, params: list[torch.Tensor], keep: torch.Tensor | None = None) -> None:
        """One bucket's update; ``keep`` (a 0-dim bool device tensor, false: skip) from ``found_inf``."""
        grads, exp_avgs, exp_avg_sqs = self._state_lists(params)

        # With c = sqrt(1 - b2^t) / (1 - b1^t) and eps' = eps · sqrt(1 - b2^t),
        #   u = m̂ / (sqrt(v̂) + eps) + wd · w = c · (m / (sqrt(v) + eps') + (wd / c) · w):
        # the bias corrections are scalars, and the bracket is built in place in
        # one new buffer per tensor (on the CPU a fresh buffer costs as much as
        # several passes over it).
        scales, eps = self._corrections(group, params)
        local = [_local(p) for p in params]
        scale, eps_ = _scalars(scales), _scalars(eps)
        if self.compiled and isinstance(scale, float) and isinstance(eps_, float):
            keep = _always(local[0].device) if keep is None else keep
            self._step_compiled(group, _Lists(grads, exp_avgs, exp_avg_sqs, local), scale, eps_,
                                _shard_group(params[0]), keep)
            return
        _update_moments(grads, exp_avgs, exp_avg_sqs, group["betas"], keep)
        updates = list(torch._foreach_sqrt(exp_avg_sqs))
        _directions_from_roots(updates, exp_avgs, local, eps_, self._decay(group), scales)
        self._apply(group, local, updates, scale, _shard_group(params[0]), keep)


def _update_moments(grads: list[torch.Tensor], exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor],
                    betas: tuple[float, float], keep: torch.Tensor | None) -> None:
    """m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g²; where ``keep`` is false m and v stay as they are."""
    beta1, beta2 = betas
    if keep is None:
        torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)  # m += (1 - b1)(g - m)
        torch._foreach_mul_(exp_avg_sqs, beta2)
    else:  # a skipped step: g zeroed (no NaN reaches the moments), m and v kept by their coefficients
        for grad in grads:
            grad.masked_fill_(~keep, 0.0)
        torch._foreach_lerp_(exp_avgs, grads, [(1.0 - beta1) * keep] * len(grads))
        torch._foreach_mul_(exp_avg_sqs, torch.where(keep, beta2, 1.0))
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)


def _directions_from_roots(updates: list[torch.Tensor], exp_avgs: list[torch.Tensor], params: list[torch.Tensor],
                           eps: Scalars, decay: float, scales: list[float]) -> None:
    """``updates`` holds sqrt(v); makes it u / c = m / (sqrt(v) + eps') + (λ / c) · w, in place."""
    torch._foreach_add_(updates, eps)
    torch._foreach_reciprocal_(updates)
    torch._foreach_mul_(updates, exp_avgs)
    if decay != 0:
        decays = _scalars([decay / c for c in scales])
        if isinstance(decays, float):
            torch._foreach_add_(updates, params, alpha=decays)
        else:
            torch._foreach_add_(updates, torch._foreach_mul(params, decays))


Scalars = float | list[float]  # one number for every tensor of a foreach call, or one each


@functools.cache
def _always(device: torch.device) -> torch.Tensor:
    """``keep`` of a step that nothing skips, for the compiled functions (which take one always)."""
    return torch.ones((), dtype=torch.bool, device=device)


def _scalars(values: list[float]) -> Scalars:
    """One scalar for a foreach op when all tensors share it (the usual case), else the list."""
    return values[0] if all(v == values[0] for v in values) else values


def _add_scaled(params: list[torch.Tensor], updates: list[torch.Tensor], coeff: Scalars,
                keep: torch.Tensor | None = None) -> None:
    """``params[i] += coeff[i] · updates[i]``, nothing where ``keep`` is false (``updates`` may be overwritten)."""
    if keep is not None:
        torch._foreach_mul_(updates, keep.to(updates[0].dtype))
    if isinstance(coeff, float):
        torch._foreach_add_(params, updates, alpha=coeff)
    else:
        torch._foreach_mul_(updates, coeff)
        torch._foreach_add_(params, updates)


class Lamb(_AdamMoments):
    """LAMB: Adam's direction plus decoupled weight decay, scaled per tensor by
    the trust ratio ``||w|| / ||update||``.

    Per parameter tensor w with gradient g at step t::

        m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g²
        m̂, v̂ = m / (1 - b1^t), v / (1 - b2^t)     (m, v without bias_correction)
        u = m̂ / (sqrt(v̂) + eps) + weight_decay · w
        r = ||w|| / ||u||  (ratio_at_zero_norm when either norm is 0), at most max_trust_ratio if > 0
        w -= lr · r · u

    A group with ``layer_adaptation=False`` uses r = 1 (plain AdamW there).
    ``build_optimizer`` sets these per group for each ``train.lamb`` variant.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0, bias_correction: bool = True,
                 max_trust_ratio: float = 10.0, layer_adaptation: bool = True, ratio_at_zero_norm: float = 1.0,
                 compiled: bool = False):
        _check_hyperparameters(lr, betas, eps, weight_decay)
        if max_trust_ratio < 0:
            raise ValueError(f"invalid max_trust_ratio {max_trust_ratio}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, max_trust_ratio=max_trust_ratio,
                        layer_adaptation=layer_adaptation, ratio_at_zero_norm=ratio_at_zero_norm)
        super().__init__(params, defaults, compiled)

    def _apply(self, group: dict, params: list[torch.Tensor], updates: list[torch.Tensor],
               scale: Scalars, shard_group, keep: torch.Tensor | None) -> None:
        lr = group["lr"]
        # (Optimizer states saved before these options existed adapt every tensor, 1 at zero norms.)
        if not group.get("layer_adaptation", True):
            _add_scaled(params, updates, _times(scale, -lr), keep)
            return
        # All ratios use the weights before this step, as in the paper.
        dtype = _norm_dtype(params)
        norms = torch.stack([torch.stack(torch._foreach_norm(ts, 2, dtype=dtype)) for ts in (params, updates)])
        scales = scale if isinstance(scale, float) else torch.tensor(scale, dtype=dtype).to(norms.device)
        coeffs = _trust_coefficients(_whole_norms(norms, shard_group), scales, -lr,
                                     group.get("ratio_at_zero_norm", 1.0), group["max_trust_ratio"])
        if keep is not None:
            coeffs = coeffs * keep
        # w -= lr · r · u, every tensor with its own r.
        torch._foreach_addcmul_(params, updates, coeffs.to(params[0].dtype).unbind())

    def _step_compiled(self, group: dict, lists: _Lists, scale: float, eps: float, shard_group,
                       keep: torch.Tensor) -> None:
        if not group.get("layer_adaptation", True):
            super()._step_compiled(group, lists, scale, eps, shard_group, keep)
            return
        coefficient = _coefficients(lists.params[0].dtype)
        eps_, decay = coefficient(eps), coefficient(self._decay(group) / scale)
        norms = _compiled(_fused_lamb_norms)(*lists, *group["betas"], eps_, decay, keep)
        _compiled(_fused_lamb_update)(lists.params, lists.exp_avgs, lists.exp_avg_sqs,
                                      _whole_norms(norms, shard_group), eps_, decay, coefficient(scale),
                                      coefficient(-group["lr"]), group.get("ratio_at_zero_norm", 1.0),
                                      group["max_trust_ratio"], keep)


def _times(scale: Scalars, factor: float) -> Scalars:
    return scale * factor if isinstance(scale, float) else [c * factor for c in scale]


def _norm_dtype(params: list[torch.Tensor]) -> torch.dtype:
    return torch.promote_types(params[0].dtype, torch.float32)


def _whole_norms(norms: torch.Tensor, shard_group) -> torch.Tensor:
    """``norms`` (``(||w||, ||u||)`` of every tensor, ``(2, tensors)``) of the whole tensors.

    Of tensors sharded over ``shard_group`` this rank holds one part each: the
    squared norms of the parts are summed over the ranks, all in one all-reduce.
    """
    if shard_group is None:
        return norms
    import torch.distributed as dist

    squares = norms.square()
    dist.all_reduce(squares, group=shard_group)
    return squares.sqrt()


def _trust_coefficients(norms: torch.Tensor, scale: float | torch.Tensor, neg_lr: float | torch.Tensor,
                        ratio_at_zero_norm: float, max_trust_ratio: float) -> torch.Tensor:
    """-lr · r · c of every tensor, from ``norms`` = (||w||, ||u / c||) (``_whole_norms``).
    Eager and compiled steps share it."""
    w_norms, u_norms = norms.unbind()
    u_norms = u_norms * scale
    # torch.where instead of a Python ``if``: no device → host sync per tensor.
    ratios = torch.where((w_norms > 0) & (u_norms > 0), w_norms / u_norms, ratio_at_zero_norm)
    if max_trust_ratio > 0:
        ratios = ratios.clamp(max=max_trust_ratio)
    return ratios * scale * neg_lr


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
                 eps: float = 1e-6, weight_decay: float = 0.0, compiled: bool = False):
        _check_hyperparameters(lr, betas, eps, weight_decay)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay), compiled)

    def _apply(self, group: dict, params: list[torch.Tensor], updates: list[torch.Tensor],
               scale: Scalars, shard_group, keep: torch.Tensor | None) -> None:
        # Elementwise: each rank updates its own shard, no communication needed.
        _add_scaled(params, updates, _times(scale, -group["lr"]), keep)


class StableAdamW(_AdamMoments):
    """AdamW whose step size each tensor clips by the RMS of its gradient over the second
    moment (StableAdamW: Wortsman et al. 2023, "Stable and low-precision training for
    large-scale vision-language models", Algorithm 2), with weight decay optionally decoupled
    from the learning rate: optimi's ``StableAdamW``, which ModernBERT trains with
    (``decoupled_stableadamw``: ``decouple_lr=True``).

    Per tensor w of n elements with gradient g at step t (always bias-corrected)::

        m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g²;   m̂, v̂ = m / (1 - b1^t), v / (1 - b2^t)
        rms = sqrt(sum(g² / max(v̂, eps²)) / n)     (v̂ of this step)
        lr_t = lr / max(1, rms)
        w = w · (1 - (lr_t / max_lr) · weight_decay)  (decouple_lr; else w · (1 - lr_t · weight_decay))
        w -= lr_t · m̂ / (sqrt(v̂) + eps)

    ``max_lr`` (default: the ``lr`` it is made with, the schedule's peak) keeps the decay
    following the schedule's shape but not the size of the lr. optimi moves m and v with
    "debiased" betas, b(1 - b^(t-1)) / (1 - b^t), which keeps m̂ and v̂ themselves; here
    the moments are Adam's, as in our other optimizers, and the corrections scalars. The
    whole step stays on the device: optimi reads each tensor's rms on the host.

    This is u = m̂ / (sqrt(v̂) + eps) + λ · w with λ = weight_decay / max_lr (or
    weight_decay), w -= lr · r · u with r = 1 / max(1, rms): LAMB's form with another r.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.99),
                 eps: float = 1e-6, weight_decay: float = 1e-2, decouple_lr: bool = False,
                 max_lr: float | None = None, compiled: bool = False):
        _check_hyperparameters(lr, betas, eps, weight_decay)
        max_lr = lr if max_lr is None else max_lr
        if decouple_lr and not max_lr > 0:
            raise ValueError(f"invalid max_lr {max_lr}: decouple_lr divides the lr by it")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, bias_correction=True,
                        decouple_lr=decouple_lr, max_lr=max_lr)
        super().__init__(params, defaults, compiled)

    def _decay(self, group: dict) -> float:
        return group["weight_decay"] / group["max_lr"] if group["decouple_lr"] else group["weight_decay"]

    def _step_bucket(self, group: dict, params: list[torch.Tensor], keep: torch.Tensor | None = None) -> None:
        grads, exp_avgs, exp_avg_sqs = self._state_lists(params)
        scales, eps = self._corrections(group, params)  # c and eps', as for the other optimizers
        local, shard_group = [_local(p) for p in params], _shard_group(params[0])
        # sum(g² / max(v̂, eps²)) / n = ||q||² · (1 - b2^t) / n with q = g / sqrt(max(v, eps'²)):
        # rms = ||q|| · spread, n the whole tensor's (a DTensor's numel).
        beta2 = group["betas"][1]
        corrections = [1.0 - beta2 ** self.state[p]["step"] for p in params]
        numels = [max(p.numel(), 1) for p in params]
        scale, eps_, correction = _scalars(scales), _scalars(eps), _scalars(corrections)
        if self.compiled and isinstance(scale, float) and isinstance(eps_, float) and isinstance(correction, float):
            coefficient = _coefficients(local[0].dtype)
            decay = coefficient(self._decay(group) / scale)
            lists = _Lists(grads, exp_avgs, exp_avg_sqs, local)
            keep = _always(local[0].device) if keep is None else keep
            norms = _compiled(_fused_stable_norms)(*lists, *group["betas"], coefficient(eps_ * eps_), keep)
            _compiled(_fused_stable_update)(local, exp_avgs, exp_avg_sqs, _whole_norms(norms, shard_group),
                                            coefficient(eps_), decay, coefficient(correction), numels,
                                            coefficient(-group["lr"] * scale), keep)
            return
        spreads = [math.sqrt(c / n) for c, n in zip(corrections, numels)]
        _update_moments(grads, exp_avgs, exp_avg_sqs, group["betas"], keep)
        work = list(torch._foreach_maximum(exp_avg_sqs, _scalars([e * e for e in eps])))
        torch._foreach_sqrt_(work)
        torch._foreach_reciprocal_(work)
        torch._foreach_mul_(work, grads)
        norms = torch._foreach_norm(work, 2, dtype=_norm_dtype(local))
        if shard_group is not None:
            norms = list(_whole_norms(torch.stack(norms), shard_group).unbind())
        ratios = torch.stack(torch._foreach_mul(norms, spreads)).clamp(min=1.0).reciprocal()  # 1 / max(1, rms)
        if keep is not None:
            ratios = ratios * keep
        # The same buffers, now for u / c; then w += (-lr · c · r) · u / c, each tensor with its own r.
        torch._foreach_copy_(work, exp_avg_sqs)
        torch._foreach_sqrt_(work)
        _directions_from_roots(work, exp_avgs, local, eps_, self._decay(group), scales)
        coeffs = torch._foreach_mul(ratios.to(local[0].dtype).unbind(), [-group["lr"] * c for c in scales])
        torch._foreach_addcmul_(local, work, coeffs)


# ------------------------------------------------------------ the compiled step
#
# The eager step is a chain of multi-tensor ops, each a pass over memory. These pure functions
# over lists of tensors are the same update for torch.compile, which fuses them into a few
# kernels per bucket (Triton on CUDA, C++ on the CPU). LAMB takes two passes:
#   1. ``_fused_lamb_norms``: read g, m, v, w; write m, v; reduce ||w|| and ||u|| of each tensor
#      without storing u (16 + 8 bytes per fp32 parameter);
#   2. ``_fused_lamb_update``: read m, v, w and write w, u computed again (12 + 4 bytes);
# with the all-reduce of sharded tensors' norms between them. Where r = 1 (AdamW's update) one
# pass, ``_fused_adam``, does it all (16 + 12 bytes). Inductor's count of its CPU code is that;
# on CUDA it stores the outputs of multi-tensor kernels that a reduction reads, so pass 1 may
# store u there (``benchmarks/optimizer.py --traffic --device cuda`` says). What changes from
# step to step (lr, bias corrections) comes in as 0-dim CPU tensors, which Inductor passes to
# its kernels as scalar arguments: a bucket's functions compile once, and never wait for the device.


_TRACED_TOGETHER = 16  # tensors per group of ops in _fused_lamb_norms


class _Lists(typing.NamedTuple):
    """The local tensors of one bucket, in the order the compiled functions take them."""

    grads: list[torch.Tensor]
    exp_avgs: list[torch.Tensor]
    exp_avg_sqs: list[torch.Tensor]
    params: list[torch.Tensor]


@functools.cache
def _compiled(fn: Callable) -> Callable:
    # Static shapes: a bucket's tensors never change shape. fullgraph: a graph break would
    # split the passes (and their bytes) without a word.
    import torch._inductor.config as inductor

    # torch 2.11's Inductor fails an assertion (reorder_loops_by_dep_pair) when it reorders the loops
    # of LAMB's first pass on CUDA, where a word embedding's norm is a split reduction. It never
    # reorders CPU loops, so the CPU code is unchanged. Options a release lacks are left out.
    names = ("loop_ordering_after_fusion", "loop_reindexing_after_fusion")
    options: dict[str, str | int | bool | Callable] = {name: False for name in names if hasattr(inductor, name)}
    return torch.compile(fn, dynamic=False, fullgraph=True, options=options)


def _coefficients(dtype: torch.dtype) -> Callable[[float], torch.Tensor]:
    """Makes a step's scalars 0-dim CPU tensors of the precision that eager foreach ops use for them."""
    dtype = torch.promote_types(dtype, torch.float32)
    return lambda value: torch.tensor(value, dtype=dtype)


def _fused_moments_(grads: list[torch.Tensor], exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor],
                    beta1: float, beta2: float, keep: torch.Tensor) -> None:
    """The moments, left as they are where ``keep`` is false (a skipped step: its g may be NaN)."""
    # Each moment moves towards its target, which a skipped step makes the moment itself: the
    # lerps keep float weights (a tensor weight costs Inductor its fusion, doubling the bytes).
    torch._foreach_lerp_(exp_avgs, [torch.where(keep, g, m) for g, m in zip(grads, exp_avgs)], 1.0 - beta1)
    # v = b2 v + (1 - b2) g² as a lerp towards g², like m: Inductor then stores both moments
    # in the loop that reduces the norms (with mul and addcmul it stores v in a pass of its own).
    torch._foreach_lerp_(exp_avg_sqs, [torch.where(keep, g * g, v) for g, v in zip(grads, exp_avg_sqs)],
                         1.0 - beta2)


def _fused_directions(exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor], params: list[torch.Tensor],
                      eps: torch.Tensor, decay: torch.Tensor) -> list[torch.Tensor]:
    """u / c = m / (sqrt(v) + eps') + (wd / c) · w of every tensor (see ``_step_bucket``)."""
    updates = list(torch._foreach_sqrt(exp_avg_sqs))
    torch._foreach_add_(updates, [eps] * len(updates))  # the overload for one tensor reads it on the host
    torch._foreach_reciprocal_(updates)
    torch._foreach_mul_(updates, exp_avgs)
    torch._foreach_add_(updates, torch._foreach_mul(params, decay))
    return updates


def _fused_lamb_norms(grads: list[torch.Tensor], exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor],
                      params: list[torch.Tensor], beta1: float, beta2: float, eps: torch.Tensor,
                      decay: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """LAMB's first pass: the moments, and (||w||, ||u / c||) of every tensor, ``(2, tensors)``."""
    dtype = _norm_dtype(params)
    norms = []
    # Inductor fuses two reductions of one tensor only where the graph has them close together (at
    # most 64 nodes apart): the ops of a few tensors at a time keep them so.
    for part in (slice(i, i + _TRACED_TOGETHER) for i in range(0, len(params), _TRACED_TOGETHER)):
        _fused_moments_(grads[part], exp_avgs[part], exp_avg_sqs[part], beta1, beta2, keep)
        updates = _fused_directions(exp_avgs[part], exp_avg_sqs[part], params[part], eps, decay)
        # One reduction per tensor, which Inductor fuses with what it reads (its _foreach_norm
        # would be a library call on u stored in full).
        norms.append(torch.stack([torch.stack([torch.linalg.vector_norm(t, dtype=dtype) for t in ts])
                                  for ts in (params[part], updates)]))
    return torch.cat(norms, dim=1)


def _fused_lamb_update(params: list[torch.Tensor], exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor],
                       norms: torch.Tensor, eps: torch.Tensor, decay: torch.Tensor, scale: torch.Tensor,
                       neg_lr: torch.Tensor, ratio_at_zero_norm: float, max_trust_ratio: float,
                       keep: torch.Tensor) -> None:
    """LAMB's second pass: w -= lr · r · u, the ratios from the (whole tensors') ``norms``."""
    updates = _fused_directions(exp_avgs, exp_avg_sqs, params, eps, decay)
    coeffs = _trust_coefficients(norms, scale, neg_lr, ratio_at_zero_norm, max_trust_ratio) * keep
    torch._foreach_addcmul_(params, updates, coeffs.to(params[0].dtype).unbind())


def _fused_stable_norms(grads: list[torch.Tensor], exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor],
                        params: list[torch.Tensor], beta1: float, beta2: float, eps_sq: torch.Tensor,
                        keep: torch.Tensor) -> torch.Tensor:
    """StableAdamW's first pass: the moments, and ||g / sqrt(max(v, eps'²))|| of every tensor, ``(tensors,)``."""
    dtype = _norm_dtype(params)
    norms = []
    for part in (slice(i, i + _TRACED_TOGETHER) for i in range(0, len(params), _TRACED_TOGETHER)):
        _fused_moments_(grads[part], exp_avgs[part], exp_avg_sqs[part], beta1, beta2, keep)
        norms += [torch.linalg.vector_norm(torch.where(keep, g, 0.0) / torch.clamp(v, min=eps_sq).sqrt(), dtype=dtype)
                  for g, v in zip(grads[part], exp_avg_sqs[part])]
    return torch.stack(norms)


def _fused_stable_update(params: list[torch.Tensor], exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor],
                         norms: torch.Tensor, eps: torch.Tensor, decay: torch.Tensor, correction: torch.Tensor,
                         numels: list[int], coeff: torch.Tensor, keep: torch.Tensor) -> None:
    """StableAdamW's second pass: w += coeff · r · u / c with r = 1 / max(1, rms) from the (whole tensors')
    ``norms``, rms = norm · sqrt((1 - b2^t) / n), coeff = -lr · c."""
    updates = _fused_directions(exp_avgs, exp_avg_sqs, params, eps, decay)
    rms = norms * (correction / torch.tensor(numels, dtype=norms.dtype, device=norms.device)).sqrt()
    coeffs = coeff / rms.clamp(min=1.0) * keep
    torch._foreach_addcmul_(params, updates, coeffs.to(params[0].dtype).unbind())


def _fused_adam(grads: list[torch.Tensor], exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor],
                params: list[torch.Tensor], beta1: float, beta2: float, eps: torch.Tensor, decay: torch.Tensor,
                coeff: torch.Tensor, keep: torch.Tensor) -> None:
    """The whole update with r = 1 in one pass: w += coeff · u / c, with coeff = -lr · c."""
    _fused_moments_(grads, exp_avgs, exp_avg_sqs, beta1, beta2, keep)
    updates = _fused_directions(exp_avgs, exp_avg_sqs, params, eps, decay)
    torch._foreach_add_(params, torch._foreach_mul(updates, coeff * keep))


# ------------------------------------------------------------ bf16 weights
#
# PopXL's half-precision weights with stochastic rounding, on any device: parameters, gradients and
# (optionally) the moments stored in bf16, each update computed in fp32 and rounded back. Rounding to
# nearest drops every update smaller than half a bf16 ulp (2^-8 of the weight), so small learning rates
# stall; stochastic rounding rounds up with probability equal to the distance from the lower
# neighbour, so the rounded weight equals the fp32 one in expectation.



def stochastic_round_(target: torch.Tensor, value: torch.Tensor, generator: torch.Generator | None = None) -> None:
    """``target`` (bf16) = ``value`` (fp32) rounded stochastically: uniform random bits added to the 16 bits
    bf16 drops, then truncated. For x between neighbours a < b, P(b) = (x - a) / (b - a): E[round(x)] = x."""
    noise = torch.randint(0, 1 << 16, value.shape, dtype=torch.int32, device=value.device, generator=generator)
    # -65536 is 0xFFFF0000: the sign, exponent and the 7 bits of mantissa that bf16 keeps. A carry from the
    # low bits raises the magnitude by one bf16 ulp; the sign bit never changes (the pattern is sign-magnitude).
    truncated = (value.view(torch.int32) + noise).bitwise_and_(-65536).view(torch.float32)
    target.copy_(truncated)  # exact: nothing below bf16's bits is left


class Bf16Rounding:
    """How an optimizer writes bf16 weights (and bf16 moments) back: stochastically, from a generator per
    device seeded with ``seed`` (its state is in the optimizer's ``state_dict``, so a resumed run draws the
    same bits), or to nearest."""

    def __init__(self, stochastic: bool, seed: int, state_dtype: torch.dtype = torch.float32):
        self.stochastic, self.seed, self.state_dtype = stochastic, seed, state_dtype
        self._generators: dict[str, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        if key not in self._generators:
            self._generators[key] = torch.Generator(device).manual_seed(self.seed)
        return self._generators[key]

    def round_(self, target: torch.Tensor, value: torch.Tensor) -> None:
        if self.stochastic:
            stochastic_round_(target, value, self._generator(value.device))
        else:
            target.copy_(value)  # round to nearest, ties to even

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {device: generator.get_state() for device, generator in self._generators.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for device, generator_state in state.items():
            self._generator(torch.device(device)).set_state(generator_state)


def _is_moment(key: str, value: typing.Any) -> bool:
    return key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point()


def _chunks(params: list[torch.Tensor], elements: int) -> Iterable[list[torch.Tensor]]:
    """``params`` in runs of at most ``elements`` elements (or one larger tensor)."""
    chunk: list[torch.Tensor] = []
    size = 0
    for p in params:
        if chunk and size + p.numel() > elements:
            yield chunk
            chunk, size = [], 0
        chunk.append(p)
        size += p.numel()
    if chunk:
        yield chunk


def cast_weights(model: nn.Module, train: TrainConfig) -> nn.Module:
    """The model with ``train.weights``' dtype (before DDP wraps it and the optimizer is built)."""
    return model.to(torch.bfloat16) if train.weights == "bf16" else model


OPTIMIZERS: tuple[str, ...] = typing.get_args(Optimizer)
LAMB_VARIANTS: tuple[LambVariant, ...] = typing.get_args(LambVariant)
_ALWAYS_BIAS_CORRECTED = ("mlperf", "paper")


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
    if train.scaled_optimizer_state and train.optimizer == "sgd":
        raise ConfigError("train.scaled_optimizer_state=true needs an Adam-style optimizer (its eps absorbs "
                          "the scale); train.optimizer=sgd has none")
    if train.optimizer == "stableadamw":
        if not train.bias_correction:
            raise ConfigError("train.bias_correction=false: train.optimizer=stableadamw always corrects the bias")
        if train.decouple_lr and train.lr <= 0:
            raise ConfigError(f"train.lr={train.lr} must be positive for train.optimizer=stableadamw with "
                              "train.decouple_lr (its weight decay is scaled by lr / train.lr)")
    if train.optimizer == "lamb":
        if train.lamb not in LAMB_VARIANTS:
            raise ConfigError(f"train.lamb: {train.lamb!r} is not one of {', '.join(LAMB_VARIANTS)}")
        if train.lamb in _ALWAYS_BIAS_CORRECTED and not train.bias_correction:
            raise ConfigError(f"train.bias_correction=false: train.lamb={train.lamb} always corrects the bias "
                              "(use lamb bertforge or nvidia without it)")


def lamb_groups(model: nn.Module, train: TrainConfig) -> list[dict]:
    """``param_groups`` with the per-group LAMB settings of ``train.lamb`` (see the module doc)."""
    decay, no_decay = param_groups(model, train.weight_decay)
    groups = (decay, no_decay)
    for group in groups:
        group.update(layer_adaptation=True, max_trust_ratio=0.0, ratio_at_zero_norm=1.0)
    if train.lamb == "bertforge":
        for group in groups:
            group["max_trust_ratio"] = train.max_trust_ratio
    elif train.lamb == "mlperf":  # exclude_from_layer_adaptation = exclude_from_weight_decay
        no_decay["layer_adaptation"] = False
    elif train.lamb == "nvidia":  # use_nvlamb=False: adapt only where the group decays
        for group in groups:
            group["layer_adaptation"] = group["weight_decay"] != 0
    else:  # paper: one λ for every layer, r = φ(||w||) / ||u|| with φ(z) = z, so 0 where ||w|| = 0
        no_decay["weight_decay"] = train.weight_decay
        for group in groups:
            group["ratio_at_zero_norm"] = 0.0
    return [decay, no_decay]


def build_optimizer(model: nn.Module, train: TrainConfig, compiled: bool = False) -> torch.optim.Optimizer:
    """The optimizer named by ``train.optimizer`` over ``param_groups(model, ...)``.

    ``compiled``: our LAMB, AdamW without bias correction and StableAdamW take the compiled step (training
    passes ``dist.compiles_optimizer``: where the model compiles on CUDA); torch's AdamW and
    SGD are as torch makes them. ``train.scaled_optimizer_state``: eps × ``train.loss_scale``, for
    gradients that stay scaled (PopART's Adam: m / (sqrt(v) + eps) is then the same). ``train.weights``
    bf16: our optimizers round their updates back as ``train.stochastic_rounding`` says (``Bf16Rounding``).
    """
    _check_train_optimizer(train)
    eps = train.eps * train.loss_scale if train.scaled_optimizer_state else train.eps
    optimizer = _build(model, train, compiled, eps)
    if train.weights == "bf16":
        if not isinstance(optimizer, _AdamMoments):
            raise ConfigError(f"train.weights=bf16 needs one of our optimizers (lamb, stableadamw, adamw with "
                              f"train.bias_correction=false), not torch's {type(optimizer).__name__}")
        state_dtype = torch.bfloat16 if train.optimizer_state == "bf16" else torch.float32
        optimizer.rounding = Bf16Rounding(train.stochastic_rounding, train.seed, state_dtype)
    return optimizer


def _build(model: nn.Module, train: TrainConfig, compiled: bool, eps: float) -> torch.optim.Optimizer:
    betas = (train.beta1, train.beta2)
    if train.optimizer == "lamb":
        return Lamb(lamb_groups(model, train), lr=train.lr, betas=betas, eps=eps,
                    weight_decay=train.weight_decay, bias_correction=train.bias_correction, compiled=compiled)
    groups = param_groups(model, train.weight_decay)
    # torch's fused kernels (CUDA and CPU): one pass over the state, and a step that a non-finite
    # gradient skips on the device (found_inf, see engine.skips_on_device) without a host sync.
    if train.optimizer == "adamw":
        if train.bias_correction:
            return torch.optim.AdamW(groups, lr=train.lr, betas=betas, eps=eps,
                                     weight_decay=train.weight_decay, fused=True)
        return AdamWNoBiasCorrection(groups, lr=train.lr, betas=betas, eps=eps,
                                     weight_decay=train.weight_decay, compiled=compiled)
    if train.optimizer == "sgd":
        if train.nesterov and train.momentum <= 0:
            raise ConfigError("train.nesterov=true needs train.momentum > 0")
        return torch.optim.SGD(groups, lr=train.lr, momentum=train.momentum, nesterov=train.nesterov,
                               weight_decay=train.weight_decay, fused=True)
    if train.optimizer == "stableadamw":  # max_lr: train.lr, the peak the schedules scale
        return StableAdamW(groups, lr=train.lr, betas=betas, eps=eps, weight_decay=train.weight_decay,
                           decouple_lr=train.decouple_lr, compiled=compiled)
    raise ConfigError(f"train.optimizer: {train.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")


# ------------------------------------------------------------ lr schedules

SCHEDULES: tuple[str, ...] = typing.get_args(Schedule)


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
    if train.schedule in ("poly", "poly_tf", "wsd") and train.end_lr < 0:
        raise ConfigError(f"train.end_lr={train.end_lr} must not be negative")
    if train.schedule in ("poly", "poly_tf"):
        if train.decay_power < 0:
            raise ConfigError(f"train.decay_power={train.decay_power} must not be negative")
        if train.schedule == "poly_tf" and train.start_warmup_step > 0:
            # The reference's formula would give negative learning rates before that step.
            raise ConfigError(f"train.start_warmup_step={train.start_warmup_step} must not be positive "
                              "(0, or negative: the run starts that many steps into the warm-up)")
    elif train.schedule in ("exp", "exp_staircase"):
        if train.exp_decay_rate < 0:
            raise ConfigError(f"train.exp_decay_rate={train.exp_decay_rate} must not be negative")
        if train.exp_decay_steps <= 0:
            raise ConfigError(f"train.exp_decay_steps={train.exp_decay_steps} must be positive")
    elif train.schedule == "wsd":
        _check_wsd(train, total_steps)
    elif train.schedule == "table":
        table = train.lr_table
        if 0 not in table:
            raise ConfigError(f"train.lr_table must have an entry for step 0, got {table!r}")
        if any(step < 0 or lr < 0 for step, lr in table.items()):
            raise ConfigError(f"train.lr_table: steps and learning rates must not be negative, got {table!r}")


def wsd_steps(train: TrainConfig, total_steps: int) -> tuple[int, int]:
    """``wsd``'s warm-up and decay lengths: ``train.warmup_steps`` and ``train.decay_steps``, else those
    shares of ``total_steps``, truncated as Composer converts a duration ("0.1dur") to steps."""
    warmup = train.warmup_steps or int(train.warmup_proportion * total_steps)
    return warmup, train.decay_steps or int(train.decay_proportion * total_steps)


def _check_wsd(train: TrainConfig, total_steps: int) -> None:
    if train.decay_steps < 0:
        raise ConfigError(f"train.decay_steps={train.decay_steps} must not be negative")
    if not 0.0 <= train.decay_proportion <= 1.0:
        raise ConfigError(f"train.decay_proportion={train.decay_proportion} must be in [0, 1]")
    warmup, decay = wsd_steps(train, total_steps)
    decay_key = "train.decay_steps" if train.decay_steps else "train.decay_proportion"
    if decay > total_steps:
        raise ConfigError(f"{decay_key} gives a decay of {decay} steps, longer than the run's {total_steps}")
    if warmup + decay > total_steps:
        warmup_key = "train.warmup_steps" if train.warmup_steps else "train.warmup_proportion"
        raise ConfigError(f"{warmup_key} and {decay_key}: a warm-up of {warmup} steps and a decay of {decay} "
                          f"do not fit in the run's {total_steps} steps")


# Composer's LinearScheduler, which ModernBERT's warm-up runs, starts at this multiplier, not 0.
WSD_WARMUP_START = 1e-10


def _wsd_multiplier(step: int, train: TrainConfig, total_steps: int) -> float:
    """ModernBERT's ``WarmupStableDecayScheduler`` (src/scheduler.py) at optimizer step ``step``."""
    # Composer steps its schedulers after a batch but before counting it, so step k runs at the
    # value for k - 1 batches done (and step 0, as step 1, at the value for none).
    done = max(step - 1, 0)
    warmup, decay = wsd_steps(train, total_steps)
    if done < warmup:
        return WSD_WARMUP_START + min(1.0, done / warmup) * (1.0 - WSD_WARMUP_START)
    if done < total_steps - decay:
        return 1.0
    into_decay = (done - (total_steps - decay)) / decay
    alpha_f = train.end_lr / train.lr
    if train.decay_shape == "one_minus_sqrt":  # ModernBERT's OneMinusSqrtScheduler, clipped at alpha_f as it is
        return max(alpha_f, alpha_f + (1 - alpha_f) * (1 - math.sqrt(into_decay)))
    return max(0.0, 1 - into_decay * (1 - alpha_f))


def lr_at(step: int, train: TrainConfig, total_steps: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based) of a ``total_steps`` run.

    With W warm-up steps, peak lr L, end lr E and power p:

    * ``poly`` (ours): lr · (k + 1) / W for k < W (the first step is not
      wasted at lr 0 and the last warm-up step reaches L), then
      (L - E)(1 - (k - W) / (N - W))^p + E: the decay spans the steps after
      warm-up.
    * ``poly_tf``: the MLPerf BERT reference (``optimization.create_optimizer``):
      ``tf.compat.v1.train.polynomial_decay(L, k, N, E, p, cycle=False)`` =
      (L - E)(1 - min(k, N) / N)^p + E over the whole run, replaced during
      warm-up by L · (k - s) / W while k - s < W, with s =
      ``train.start_warmup_step`` (≤ 0; the first step has lr 0 when s = 0).
    * ``exp``: L · exp(-rate · (k - W) / decay_steps) after our warm-up.
    * ``exp_staircase``: Graphcore's TF1 BERT application
      (``lr_schedules/natural_exponential.py``): L · k / W for k ≤ W, then
      L · exp(-rate · floor((k - W) / decay_steps)). Graphcore's host loop
      updates the lr once per ``device_iterations`` steps; this is its value
      at every step (``device_iterations`` 1).
    * ``table``: the entry of the largest step ≤ k; ``constant``: L after warm-up.
    * ``wsd`` (warm-up, stable, decay: "trapezoidal"): ModernBERT's
      ``warmup_stable_decay`` (AnswerDotAI/ModernBERT ``src/scheduler.py``, run
      by Composer), with D decay steps (``train.decay_steps``, else
      ``int(decay_proportion · N)``; W likewise, truncated as Composer
      converts durations): L · f(j) at j = max(k - 1, 0), f(j) = a + (j / W)(1 - a)
      with a = 1e-10 for j < W, 1 for j < N - D, then
      max(0, 1 - (j - (N - D)) / D · (1 - E / L)), or with ``train.decay_shape``
      one_minus_sqrt a + (1 - a)(1 - sqrt((j - (N - D)) / D)), a = E / L, at least a:
      with W = 0 that is ModernBERT's ``one_minus_sqrt`` (``OneMinusSqrtScheduler``), the
      decay of its context extension. j lags k by one because
      Composer's trainer steps the scheduler before it counts the finished
      batch: steps 0 and 1 both run at 1e-10 · L. With D = 0 (ModernBERT's
      pre-training, whose decay was a run of its own) the lr stays at L.
    """
    _check_schedule(train, total_steps)
    if step < 0:
        raise ValueError(f"step={step} must not be negative")

    if train.schedule == "table":  # absolute values; no warm-up
        keys = sorted(train.lr_table)
        return float(train.lr_table[keys[bisect.bisect_right(keys, step) - 1]])
    if train.schedule == "wsd":
        return train.lr * _wsd_multiplier(step, train, total_steps)

    warmup = warmup_steps(train, total_steps)
    if train.schedule == "poly_tf":
        if warmup > 0 and step - train.start_warmup_step < warmup:
            return train.lr * (step - train.start_warmup_step) / warmup
        progress = min(step, total_steps) / total_steps
        return (train.lr - train.end_lr) * (1.0 - progress) ** train.decay_power + train.end_lr
    if train.schedule == "exp_staircase":
        if train.warmup_steps == 0:  # Graphcore truncates the share of the run; we round it elsewhere
            warmup = int(total_steps * train.warmup_proportion)
        if warmup > 0 and step <= warmup:
            return train.lr * step / warmup
        drops = (step - warmup) // train.exp_decay_steps
        return train.lr * math.exp(-train.exp_decay_rate * drops)

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


def group_settings(optimizer: torch.optim.Optimizer) -> list[dict[str, typing.Any]]:
    """Each param group's settings (lr, initial_lr, weight_decay, betas, …), without its parameters."""
    return [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]


def keep_settings(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
                  settings: list[dict[str, typing.Any]]) -> None:
    """After a resume loaded a checkpoint's optimizer and schedule into ones built from this run's
    config: this run's ``settings`` (``group_settings`` of the optimizer as built) again, and the lr
    of the step the schedule stands at, from them.

    torch's ``load_state_dict`` puts back the saved groups' settings and the schedule's saved base
    lrs, so a resume that changes train.lr, weight_decay, betas, … would go on with the old ones (or,
    LambdaLR multiplying the old base lr by the new schedule's factor, with neither). The moments and
    the step counts stay the checkpoint's: the run goes on from its state, configured as now."""
    if len(settings) != len(optimizer.param_groups):  # load_state_dict refuses this before
        raise ValueError(f"{len(settings)} groups of settings for {len(optimizer.param_groups)} param groups")
    for group, own in zip(optimizer.param_groups, settings):
        group.update(own)
    if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        raise TypeError(f"{type(scheduler).__name__}: a resume sets the lr of LambdaLR schedules (build_scheduler)")
    scheduler.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
    for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # what get_last_lr() reads
