"""Model FLOPs of a pre-training step, and the device peaks MFU is measured against.

Training FLOPs of one row (one unpacked sequence, or one packed row) of T
tokens, P prediction slots and S [CLS] slots (1 unpacked), for L layers of
hidden size H, intermediate size I and vocab V. Only the matmuls count (2
FLOPs per multiply-add); the backward pass costs twice the forward (a
gradient for the input and one for the weight of every matmul)::

    training = 3 × forward
    forward  = T · 2·L·(4H² + 2·H·I)     Q, K, V, output projections and the MLP, per token
             + 2·2·L·T²·H                attention scores QKᵀ and their weighted sum of V
             + 2·P·(H² + H·V)            MLM head on the P gathered positions: transform, decoder
             + 2·S·(H² + 2H)             pooler and NSP classifier

Attention counts the whole T × T block, as CUDA's bias path computes it, also
for packed rows whose attention is block-diagonal (the CPU attends them one
document at a time and computes less: models.bert.Documents) and for
ModernBERT's windowed layers.
ModernBERT's GeGLU MLP is 3·H·I (``Wi`` to 2I, ``Wo`` back) in place of
2·H·I; masked LM alone (ModernBERT, ``train.objective mlm``) has S = 0. For BERT-large (L=24, H=1024,
I=4096, V=30522) at T=128, P=20 that is 240.6 GFLOP per sequence, so the
phase-1 goal of 2,180 seq/s on one H100 SXM is 524.5 TFLOP/s: 53 % of its
989.4 TFLOP/s of dense bf16.

MFU (model FLOPs utilisation) = the FLOPs of the executed batches per
second ÷ the device's peak for the precision the matmuls run in.
These are the model's FLOPs, not the kernels': recomputation
(``execution.recompute``) runs more, and so does the decoder's vocab padded
to a multiple of 64 on CUDA (``model.set_vocab_multiple``), as MFU means it to.
"""

from __future__ import annotations

import re

import torch

from bertforge.config import ModelConfig


def pretraining_flops(model: ModelConfig, seq_len: int, predictions: int, cls_slots: int = 1) -> int:
    """Training (forward + backward) FLOPs of one row: see the module docstring."""
    L, H, I, V, T = (model.num_hidden_layers, model.hidden_size,  # noqa: E741 (the formula's letters)
                     model.intermediate_size, model.vocab_size, seq_len)
    mlp = (3 if model.family == "modernbert" else 2) * H * I
    forward = (T * 2 * L * (4 * H * H + mlp)
               + 2 * 2 * L * T * T * H
               + 2 * predictions * (H * H + H * V)
               + 2 * cls_slots * (H * H + 2 * H))
    return 3 * forward


# Dense (no sparsity) peaks in TFLOP/s from NVIDIA's datasheets, by a pattern of
# torch.cuda.get_device_name: 16-bit tensor cores (bf16 = fp16), TF32 tensor cores, plain fp32.
PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    (r"H100.*(HBM3|SXM)", {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),  # "NVIDIA H100 80GB HBM3"
    (r"H100.*PCIe", {"bf16": 756.5, "tf32": 378.0, "fp32": 51.2}),
    (r"H200(?!.*NVL)", {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),  # H200 SXM: H100's compute
    (r"A100", {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5}),  # SXM and PCIe alike
)


def peak_tflops(device_name: str, precision: str, tf32: bool | None = None) -> float | None:
    """The device's dense peak for matmuls in ``precision`` (fp32, bf16, fp16), None when unknown.

    fp32 matmuls run on TF32 tensor cores only when torch allows it
    (``torch.set_float32_matmul_precision("high")``); ``tf32`` None asks torch.
    """
    for pattern, peaks in PEAK_TFLOPS:
        if re.search(pattern, device_name):
            if precision in ("bf16", "fp16"):
                return peaks["bf16"]
            if tf32 is None:
                tf32 = torch.get_float32_matmul_precision() != "highest"
            return peaks["tf32" if tf32 else "fp32"]
    return None
