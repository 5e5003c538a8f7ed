"""CUDA's dtype rules, checked on the CPU: a dispatch mode that records every op whose operands
CUDA's kernel would refuse although the CPU's accepts them.

The first GPU run crashed in eager bf16 (``expected scalar type BFloat16 but found Float``):
CUDA's LayerNorm takes its input and weights in one dtype, the CPU's takes a bf16 input with
fp32 weights. The rules below are those of the ops a BERT step runs: CUDA's LayerNorm, matmul
and attention kernels each read all their floating operands as one type (an attention mask may
be boolean).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# op → the positions of the floating operands that must share one dtype. Under inference_mode the
# composite ops (layer_norm, linear, matmul, scaled_dot_product_attention) arrive undecomposed.
ONE_DTYPE = {
    aten.layer_norm.default: (0, 2, 3),
    aten.linear.default: (0, 1, 2),
    aten.matmul.default: (0, 1),
    aten.scaled_dot_product_attention.default: (0, 1, 2),
    aten.native_layer_norm.default: (0, 2, 3),  # input, weight, bias
    aten.native_layer_norm_backward.default: (0, 1, 5, 6),  # grad_out, input, weight, bias
    aten.mm.default: (0, 1),
    aten.addmm.default: (0, 1, 2),
    aten.bmm.default: (0, 1),
    aten.baddbmm.default: (0, 1, 2),
    aten._scaled_dot_product_flash_attention_for_cpu.default: (0, 1, 2),
    aten._scaled_dot_product_attention_math.default: (0, 1, 2),
    aten._scaled_dot_product_efficient_attention.default: (0, 1, 2, 3),
    aten._scaled_dot_product_cudnn_attention.default: (0, 1, 2, 3),
    aten._scaled_dot_product_flash_attention.default: (0, 1, 2),
}
# the attention mask, where it is positional (else the keyword attn_mask): boolean, or the query's dtype
POSITIONAL_MASK = {aten._scaled_dot_product_attention_math.default: 3,
                   aten.scaled_dot_product_attention.default: 3}


class CudaDtypeRules(TorchDispatchMode):
    """Records ``"op: dtypes"`` for every call that breaks :data:`ONE_DTYPE` (in ``violations``),
    and counts the checked calls per op (``checked``), so a test can tell that an op ran at all."""

    def layer_norms(self) -> int:
        """The LayerNorms checked (decomposed or not)."""
        return self.checked.get("aten.native_layer_norm.default", 0) + self.checked.get("aten.layer_norm.default", 0)

    def __init__(self) -> None:
        super().__init__()
        self.violations: list[str] = []
        self.checked: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        positions = ONE_DTYPE.get(func)
        if positions is not None:
            name = str(func)
            self.checked[name] = self.checked.get(name, 0) + 1
            operands = [args[i] for i in positions if i < len(args)]
            dtypes = {t.dtype for t in operands if isinstance(t, torch.Tensor) and t.is_floating_point()}
            at = POSITIONAL_MASK.get(func)
            mask = args[at] if at is not None and at < len(args) else kwargs.get("attn_mask")
            if isinstance(mask, torch.Tensor) and mask.dtype != torch.bool:
                dtypes.add(mask.dtype)
            if len(dtypes) > 1:
                self.violations.append(f"{name}: {sorted(str(d) for d in dtypes)}")
        return func(*args, **kwargs)
