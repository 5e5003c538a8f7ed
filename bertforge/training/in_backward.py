"""The optimizer step inside the backward (``train.optimizer_in_backward``).

PopXL's SQuAD fine-tuning updates a layer as soon as its gradients are reduced,
so no step holds the gradients of the whole model. Here each parameter gets a
post-accumulate-grad hook: when autograd has finished its gradient, the hook
steps that one parameter with the run's own optimizer and frees the gradient.
The gradients of the whole model then never exist at once; the peak memory of a
step falls by about their size (``bertforge plan`` says by how much).

Equal to the ordinary step: every optimizer bertforge builds updates each tensor
from its own gradient and state alone (AdamW elementwise, LAMB's trust ratio per
tensor, StableAdamW's clip per tensor), so stepping one tensor at a time gives
the same weights, bit for bit on the CPU (tests/training/test_in_backward.py).
The optimizer is the usual one, stepped through a one-tensor view of its groups,
so its state dict, checkpoints and resumes are the ordinary ones.

What needs every gradient before the first update is refused by the config
(``config.validate``): ``train.grad_clip`` (global-norm clipping, as MLPerf's and
NVIDIA's LAMB references do), fp16's loss scaler, DDP and FSDP (the hook would
run before the gradient is reduced) and pipeline stages. With several
micro-batches per step the hooks are armed for the last one only: the earlier
ones accumulate as usual (nothing is saved then, the gradients live across
micro-batches) and the last one's backward steps each tensor once its gradient is
whole.

Non-finite steps: the loss is known before the backward and each gradient's norm
in its hook; from the first non-finite one on, the updates are skipped on the
device (``found_inf``, as the ordinary step skips), so the tensors stepped
earlier in that backward keep their update and the rest do not. The engine then
stops the run as usual (:class:`~bertforge.training.engine.NonFiniteError`).
"""

from __future__ import annotations

import torch


class OptimizerInBackward:
    """Hooks that step each parameter of ``optimizer`` as its gradient is finished, while armed.

    ``arm(healthy)`` before the backward that should step (``healthy``: a 0-dim bool device
    tensor, false to skip every update); ``finish()`` after it returns the global gradient
    norm and the healthy flag with this backward's gradients folded in.
    """

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self._group_of: dict[torch.Tensor, int] = {}
        for index, group in enumerate(optimizer.param_groups):
            for param in group["params"]:
                self._group_of[param] = index
        self._handles = [p.register_post_accumulate_grad_hook(self._step_one) for p in self._group_of]
        self._healthy: torch.Tensor | None = None  # None: not armed
        self._norms: list[torch.Tensor] = []

    def arm(self, healthy: torch.Tensor) -> None:
        self._healthy, self._norms = healthy, []

    def finish(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the gradient norm of this backward, all parameters together; the healthy flag after it)."""
        if self._healthy is None:
            raise RuntimeError("finish() without arm()")
        healthy, norms = self._healthy, self._norms
        self._healthy, self._norms = None, []
        if not norms:  # (no parameter had a gradient)
            return torch.zeros((), device=healthy.device), healthy
        return torch.linalg.vector_norm(torch.stack(norms)), healthy

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    @torch.no_grad()
    def _step_one(self, param: torch.Tensor) -> None:
        if self._healthy is None or param.grad is None:
            return
        norm = torch.linalg.vector_norm(param.grad, dtype=torch.float32)
        self._norms.append(norm)
        self._healthy = self._healthy & torch.isfinite(norm)
        self.optimizer.found_inf = (~self._healthy).float()  # type: ignore[attr-defined]
        self.optimizer.grad_scale = None  # type: ignore[attr-defined]
        step_parameter(self.optimizer, param, self._group_of[param])
        param.grad = None  # the point of it: this gradient is gone before the next is made


def step_parameter(optimizer: torch.optim.Optimizer, param: torch.Tensor, group_index: int) -> None:
    """``optimizer.step()`` for ``param`` alone: its group's settings (the lr as scheduled now),
    its own state; every other parameter left as it is."""
    groups = optimizer.param_groups
    optimizer.param_groups = [{**groups[group_index], "params": [param]}]
    try:
        optimizer.step()
    finally:
        optimizer.param_groups = groups
