"""Memory planner: how much memory one rank needs to pre-train a config.

    bertforge plan --config pretrain_large_512_phase2 --device-memory 80GB --world-size 8 \
        --execution.parallel fsdp --execution.recompute layer

The counterpart of the IPU applications' compile-only memory report, computed
from the config alone (nothing is allocated). Per rank, in bytes:

* parameters: fp32 master weights (autocast keeps fp32 weights), or bf16 with
  ``train.weights: bf16``;
* gradients: one per parameter, of the parameters' dtype;
* optimizer state: LAMB, AdamW and StableAdamW keep two moments per
  parameter, fp32 or (``train.optimizer_state: bf16``) bf16;
* activations: the peak of what autograd keeps for the backward pass of one
  micro-batch, counted op by op from models/bert.py or models/modernbert.py (see
  ``_layer_activations`` and ``_modernbert_layer_activations``), plus the
  layer being recomputed and the gradients in flight in the backward;
* workspace: optimizer temporaries (training/optim.py's LAMB makes three
  parameter-sized lists per step; with bf16 weights, fp32 copies of the weights,
  gradients, bf16 moments and the update of ``ROUNDED_CHUNK_ELEMENTS`` elements
  or of the largest tensor), FSDP's gathered layers (DDP's buckets are the
  gradients themselves);
* overhead: what the runtime holds besides tensors (CUDA context and library
  workspaces on a GPU; interpreter and kernel libraries on the CPU).

The device total is the peak over the step, not the sum of the lines: the
activations are gone before the optimizer step and most gradients appear only
as the activations are freed. ``phases`` gives both peaks.

Parallel modes: ``ddp`` replicates everything; its gradients are views into
its all-reduce buckets, allocated when the model is wrapped and held through the
whole step. ``fsdp`` (FSDP2, ``fully_shard`` per encoder layer, then the root)
divides parameters, gradients and optimizer state by the world size and adds
the gathered (unsharded) parameters of the root and of two layers (the current
one and the one prefetched), or of every layer with ``reshard_after_forward:
false`` (each is kept from its forward to its backward); under bf16 those are
bf16 copies (FSDP2's ``MixedPrecisionPolicy``), which autocast then has no need
to cast. With ``fsdp_grad_sync: step`` and more than one micro-batch per step,
unsharded fp32 gradients of the whole model are held from the first
micro-batch's backward to the reduce-scatter after the last. ``offload`` moves
the sharded parameters, gradients, optimizer state and the optimizer step to
the host.

Attention: on CUDA (with a padding mask and dropout) SDPA runs the
memory-efficient kernel, which keeps q, k, v, its output and a logsumexp,
O(B·T·H); on the CPU with dropout SDPA takes the math path and keeps the
(T × T) probabilities, its dropout mask and the dropped probabilities, in fp32.
Dropout masks are bool on CUDA (fused kernel) and of the dropped tensor's
dtype on the CPU.

ModernBERT (``model.family: modernbert``) is planned as its pre-training
feeds it: packed rows (its recipe) of two sequences, so on CUDA each kind of
layer (global, and local when the window is shorter than the row) keeps an
additive (B, 1, T, T) mask (none with ``execution.attention: flex``: block
masks are a few bytes a block), and on the CPU, which attends one document at
a time, the local layers keep a window bias per document length and every
layer the concatenation of its documents' outputs; and its rotary angles of
the packed positions. Without attention
dropout SDPA runs a flash kernel on the CPU too (q, k, v, output and a
logsumexp, no (T × T) probabilities). Its rotary tables (buffers, a few MB)
are made with the model and not counted, as none of its other fixed state.

``bench.LiveTensorBytes`` measures the same quantity on the CPU: the bytes of
live tensor storages, op by op, with its peak. The tests and
benchmarks/memory.py hold the planner to it. This module imports no torch, so
planning is instant.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from bertforge.config import (
    CONFIG_HELP,
    OVERRIDES_HELP,
    PRETRAIN_CONFIG,
    Config,
    ConfigError,
    DataConfig,
    ExecutionConfig,
    ModelConfig,
    TrainConfig,
    pipeline_layer_counts,
)
from bertforge.runs import config_from_args

FP32 = 4
# What the runtime holds besides tensors. CUDA: context, cuBLAS/cuDNN and NCCL
# workspaces and allocator slack, about 1 GiB on current GPUs. CPU: kernel
# libraries and autograd machinery loaded on the first step, calibrated against
# the peak resident set of a training step (benchmarks/memory.py).
RUNTIME_OVERHEAD = {"cuda": 1 << 30, "cpu": 64 << 20}
DTYPE_BYTES = {"fp32": FP32, "bf16": 2}
# bf16 weights (training/optim.py): the update is computed on fp32 copies of this many elements at a
# time (a larger tensor is a chunk of its own).
ROUNDED_CHUNK_ELEMENTS = 1 << 22


# ------------------------------------------------------------ parameter counts

def layer_parameters(m: ModelConfig) -> int:
    """One encoder layer. BERT: q, k, v, attention output, intermediate, output, two LayerNorms.
    ModernBERT: Wqkv, Wo, the GeGLU's Wi (to twice the intermediate size) and Wo, two norms, no
    biases (layer 0's attention norm is the identity: :func:`count_parameters` takes it off)."""
    H, I = m.hidden_size, m.intermediate_size
    if m.family == "modernbert":
        return 4 * H * H + 3 * H * I + 2 * H
    return 4 * (H * H + H) + 2 * H + (H * I + I) + (I * H + H) + 2 * H


def embedding_parameters(m: ModelConfig) -> int:
    H = m.hidden_size
    if m.family == "modernbert":  # token embeddings and their norm
        return m.vocab_size * H + H
    return (m.vocab_size + m.max_position_embeddings + m.type_vocab_size) * H + 2 * H


def head_parameters(m: ModelConfig) -> int:
    """BERT: pooler, MLM transform and bias (the decoder is tied to the word embeddings), NSP.
    ModernBERT: the final norm, the head's dense and norm, the decoder's bias (its weight tied)."""
    H = m.hidden_size
    if m.family == "modernbert":
        return H + (H * H + H) + m.vocab_size
    return (H * H + H) + (H * H + H + 2 * H + m.vocab_size) + (2 * H + 2)


def count_parameters(m: ModelConfig) -> int:
    """Parameters of the model ``bertforge pretrain`` builds (BertForPreTraining, or
    ModernBertForMaskedLM), equal to ``num_parameters(model)``."""
    first_norm = m.hidden_size if m.family == "modernbert" else 0  # layer 0's: the identity
    return (embedding_parameters(m) + m.num_hidden_layers * layer_parameters(m) + head_parameters(m)
            - first_norm)


def decayed_parameters(m: ModelConfig) -> int:
    """Parameters in the weight-decay group (weights; not biases nor LayerNorm): the largest
    bucket that one optimizer step works on at a time."""
    H, I = m.hidden_size, m.intermediate_size
    if m.family == "modernbert":  # token embeddings, the layers' projections, the head's dense
        return m.vocab_size * H + m.num_hidden_layers * (4 * H * H + 3 * H * I) + H * H
    layer = 4 * H * H + 2 * H * I
    return ((m.vocab_size + m.max_position_embeddings + m.type_vocab_size) * H
            + m.num_hidden_layers * layer + 2 * H * H + 2 * H)


# ------------------------------------------------------------ activations

@dataclass
class _Shapes:
    B: int  # micro-batch
    T: int  # sequence length
    P: int  # masked positions per sequence
    H: int
    I: int
    V: int
    heads: int
    e: int  # bytes of an autocast (matmul) element: 4 fp32, 2 bf16/fp16
    r: int  # bytes of a residual-stream element: 2 under bf16 (model.LayerNorm), else 4
    mixed: bool
    cuda: bool
    weight_casts: bool = True  # under autocast: whether weights are cast (not when FSDP2 gathers bf16 ones)
    modernbert: bool = False
    L: int = 1  # encoder layers
    window: int | None = None  # ModernBERT's local layers: keys at most this far (None: no local layers' mask)
    dropout: bool = True  # ModernBERT: whether it has dropout (BERT's plan assumes it)
    flex: bool = False  # FlexAttention block masks (CUDA, no attention dropout)

    @property
    def N(self) -> int:  # tokens
        return self.B * self.T

    @property
    def S(self) -> int:  # attention score elements
        return self.B * self.heads * self.T * self.T

    @property
    def documents(self) -> bool:
        """ModernBERT's packed rows attended one document at a time (models.bert.Documents: the CPU,
        where FlexAttention skips no block); the plan's rows hold two sequences of about T/2."""
        return self.modernbert and not self.cuda and not self.flex

    @property
    def S_document(self) -> int:  # attention score elements of one document
        return self.heads * (self.T // 2) ** 2

    @property
    def M(self) -> int:  # predicted positions
        return self.B * self.P

    @property
    def D(self) -> int:  # head size
        return self.H // self.heads

    @property
    def mask_kinds(self) -> int:
        """ModernBERT's kinds of layer with a mask of their own: global, and local (layers 1, 2, … when
        there are any, with a window shorter than the row)."""
        return 1 + (self.L > 1 and self.window is not None)

    def dropout_mask(self, elem_bytes: int) -> int:
        """Bytes per element of a dropout mask: bool from CUDA's fused kernel; on the CPU a
        scaled noise tensor of the input's dtype."""
        return 1 if self.cuda else elem_bytes


def _optimizer_states(tr: TrainConfig) -> int:
    """fp32 tensors of optimizer state per parameter: two moments for LAMB, AdamW and StableAdamW;
    SGD one momentum buffer, or none without momentum."""
    return (1 if tr.momentum > 0 else 0) if tr.optimizer == "sgd" else 2


def _layer_memory(s: _Shapes, recompute: str) -> tuple[dict[str, int], int, int]:
    """(an encoder layer's saved activations by part, all of them, what ``execution.recompute``
    keeps of them until the backward)."""
    act = (_modernbert_layer_activations if s.modernbert else _layer_activations)(s)
    full = act["attention"] + act["attention_output"] + act["ffn"]
    stored = {"none": full, "attention": act["input"] + act["attention_output"] + act["ffn"],
              "layer": act["input"]}[recompute]
    return act, full, stored


def _layer_activations(s: _Shapes) -> dict[str, int]:
    """Bytes autograd keeps for one encoder layer, by block.

    ``attention``: the self-attention internals and its inputs (dropped by
    recompute=attention); ``attention_output``: projection, dropout, residual
    LayerNorm; ``ffn``: intermediate, GELU, output, dropout, LayerNorm;
    ``input``: the layer's input, all that a checkpointed region keeps.
    """
    N, H, I, e = s.N, s.H, s.I, s.e
    nh = N * H
    # The input of the q, k, v projections: the layer input itself (fp32, or the bf16
    # stream); under fp16 autocast its cast, made once for the one fused matmul.
    qkv_inputs = nh * e
    if s.cuda:
        # Memory-efficient SDPA: q, k, v, logsumexp per head and row. Its output's
        # layout makes the reshape a view, kept once, by the dense layer.
        internals = 3 * nh * e + s.B * s.heads * math.ceil(s.T / 32) * 32 * FP32
    else:
        # Math SDPA, computed in fp32 on the CPU: scaled q, scaled k, v; softmax
        # output, dropout noise, dropped probabilities.
        internals = 3 * nh * FP32 + 3 * s.S * FP32
    layer_norm = nh * s.r + 2 * N * FP32  # input (the residual sum), mean and rstd
    dropout = nh * s.dropout_mask(e)
    # Under autocast the weights' bf16/fp16 casts are cached and kept for the backward.
    casts = (lambda n: n * e) if s.mixed and s.weight_casts else (lambda n: 0)
    return {
        "attention": qkv_inputs + internals + casts(3 * H * H),
        # the reshaped attention output kept by the dense layer, then dropout, LayerNorm
        "attention_output": nh * e + dropout + layer_norm + casts(H * H),
        # the dense input (LayerNorm output or its cast), GELU input and output
        "ffn": nh * e + 2 * N * I * e + dropout + layer_norm + casts(2 * H * I),
        "input": nh * s.r,
    }


def _modernbert_layer_activations(s: _Shapes) -> dict[str, int]:
    """Bytes autograd keeps for one ModernBERT layer, by block, in ``_layer_activations``' terms.

    ``attention``: the layer's input (the residual stream, kept by the attention norm) and the
    attention module's internals: Wqkv's output (v is a view of it), the rotated q and k, the
    kernel's output (the reshape is a view of it, kept by Wo) and logsumexp, Wo's dropout mask;
    ``attention_output``: the attention norm's statistics and output (the attention module's
    input, which ``execution.recompute: attention`` keeps); ``ffn``: the MLP norm's input (the
    residual sum), statistics and output, Wi's output (GELU's input and the gate are its halves),
    GELU's output, the product (Wo's input) and its dropout mask; ``input``: the layer's input.
    Layer 0 has no attention norm: see :func:`_modernbert_embedding_activations`.
    """
    N, H, I, e, r = s.N, s.H, s.I, s.e, s.r
    nh = N * H
    norm = 2 * N * FP32 + nh * e  # a pre-norm's statistics and output (the next matmul's input)
    if s.dropout and not s.cuda:  # math SDPA, as BERT's: scaled q, k, v; probabilities, noise, dropped
        kernel = 3 * nh * FP32 + 3 * (2 * s.B * s.S_document if s.documents else s.S) * FP32
    else:  # flash or memory-efficient SDPA, or FlexAttention: output and logsumexp
        rows = math.ceil(s.T / 32) * 32 if s.cuda else s.T
        kernel = nh * e + s.B * s.heads * rows * FP32
    if s.documents:  # the documents' outputs concatenated: Wo keeps the concatenation
        kernel += nh * e
    casts = (lambda n: n * e) if s.mixed and s.weight_casts else (lambda n: 0)
    dropout = (lambda n: n * s.dropout_mask(e)) if s.dropout else (lambda n: 0)
    return {
        "attention": nh * r + 3 * nh * e + 2 * nh * e + kernel + dropout(nh) + casts(4 * H * H),
        "attention_output": norm,
        "ffn": nh * r + norm + 4 * N * I * e + dropout(N * I) + casts(3 * H * I),
        "input": nh * r,
    }


def _backward_transients(s: _Shapes) -> tuple[int, int]:
    """Gradients alive inside one layer's backward on top of what it saved, (feed-forward
    block, attention block): in the first the GELU gradient and the incoming gradient; in the
    second, where the feed-forward activations are already freed, on the math path two
    (T × T) gradients at a time (dropped probabilities, probabilities, scores), else the
    q, k, v gradients. ModernBERT's: see the comments."""
    nh = s.N * s.H * FP32
    if s.modernbert:
        # GeGLU: at the product's backward, the incoming gradient, the product's and the two it makes
        # (GELU output's and the gate's); flash attention: the incoming gradient, the output's, q, k, v's.
        ffn = nh + 3 * s.N * s.I * FP32
        # (One document's at a time when attending per document.)
        scores = s.S_document if s.documents else s.S
        attention = 2 * scores * FP32 + 2 * nh if s.dropout and not s.cuda else 5 * nh
        return ffn, attention
    ffn = s.N * s.I * FP32 + nh
    attention = 2 * s.S * FP32 + 2 * nh if not s.cuda else 4 * nh
    return ffn, attention


def _embedding_activations(s: _Shapes) -> int:
    """LayerNorm input and statistics, dropout mask: kept to the end of the backward."""
    nh = s.N * s.H
    # The embeddings' sum is fp32, or bf16 where FSDP2 gathers bf16 tables.
    summed = s.e if s.mixed and not s.weight_casts else FP32
    return nh * summed + 2 * s.N * FP32 + nh * s.dropout_mask(s.r)


def _head_activations(s: _Shapes) -> int:
    """The last hidden state, the MLM and NSP heads and the loss: freed first in the backward."""
    nh = s.N * s.H
    # The pooler's Linear keeps a view of the last hidden state ([CLS] rows),
    # which keeps all of it; under fp16 autocast (an fp32 stream) a cast of the rows.
    last_hidden = 0 if s.e < s.r else nh * s.r
    mh = s.M * s.H
    # gathered rows, GELU in and out (in autocast: casts), LayerNorm output (the
    # stream's dtype), its statistics; log-softmax output in fp32.
    mlm_head = mh * (3 * s.e + s.r) + 2 * s.M * FP32
    loss = s.M * s.V * FP32
    decoder_weight_cast = s.V * s.H * s.e if s.mixed and s.weight_casts else 0
    return last_hidden + mlm_head + loss + decoder_weight_cast


def _modernbert_embedding_activations(s: _Shapes, recompute: str) -> int:
    """What ModernBERT keeps to the end of the backward besides the layers: the token ids (widened
    to int64), the embedding norm's input and statistics, its dropout mask; each kind of layer's
    mask and rotary angles (cos and sin of the packed positions); less layer 0's attention norm
    (the identity), counted with every layer unless whole layers are recomputed."""
    N, nh = s.N, s.N * s.H
    summed = s.e if s.mixed and not s.weight_casts else FP32  # (as BERT's embeddings)
    dropout = nh * s.dropout_mask(s.r) if s.dropout else 0
    if s.documents:  # the local layers' window, a bias per document length (two about T/2)
        masks = 2 * (s.T // 2) ** 2 * s.e if s.window is not None and s.T // 2 > s.window + 1 else 0
    else:
        masks = 0 if s.flex else s.mask_kinds * s.B * s.T * s.T * s.e
    angles = s.mask_kinds * 2 * N * (s.D // 2) * FP32
    first_norm = 0 if recompute == "layer" else 2 * N * FP32 + nh * s.e
    return N * 8 + nh * summed + 2 * N * FP32 + dropout + masks + angles - first_norm


def _modernbert_head_activations(s: _Shapes) -> int:
    """The final norm (input, statistics, output: kept whole by the gather of the masked positions),
    the positions, the head (dense input, GELU input and output, norm statistics and output), the
    log-softmax output in fp32 and the labels: freed first in the backward."""
    nh, mh = s.N * s.H, s.M * s.H
    final_norm = nh * s.r + 2 * s.N * FP32 + nh * s.e
    head = 4 * mh * s.e + 2 * s.M * FP32
    decoder_weight_cast = s.V * s.H * s.e if s.mixed and s.weight_casts else 0
    return final_norm + s.M * 8 + head + s.M * s.V * FP32 + s.M * 8 + decoder_weight_cast


@dataclass
class MemoryPlan:
    """Per-rank memory of one training step, in bytes. ``device_total`` and ``host_total`` are
    peaks over the step; the lines above them are what each kind of tensor occupies at its own
    peak. Where a line lives (device or host) is in ``location``. ``combined_peak`` is the peak
    of device and host memory together, the number to compare where they are one memory (a
    CPU run)."""

    config: dict[str, Any]
    num_parameters: int
    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    workspace: int
    overhead: int
    device_total: int
    host_total: int
    combined_peak: int
    location: dict[str, str] = field(default_factory=dict)
    phases: dict[str, int] = field(default_factory=dict)
    details: dict[str, int] = field(default_factory=dict)
    # Pipeline stages (execution.pipeline_stages > 1): each stage's plan; the lines above are the
    # largest stage's (config["pipeline_stage"]).
    stages: list[dict[str, int]] = field(default_factory=list)

    def fits(self, device_memory: int) -> bool:
        return self.device_total <= device_memory

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _resolve_device(ex: ExecutionConfig, device: str | None) -> str:
    """``device``, checked; plans are for the GPU unless the config names the CPU."""
    device = device or ("cpu" if ex.device == "cpu" else "cuda")
    if device not in ("cuda", "cpu"):
        raise ConfigError(f"device must be cuda or cpu, got {device!r}")
    return device


def _shapes(m: ModelConfig, data: DataConfig, tr: TrainConfig, ex: ExecutionConfig, device: str,
            weight_casts: bool = True) -> _Shapes:
    mixed = ex.precision in ("bf16", "fp16")
    T, window = data.seq_len, m.local_attention // 2
    return _Shapes(B=tr.micro_batch_size, T=T, P=data.max_predictions,
                   H=m.hidden_size, I=m.intermediate_size, V=m.vocab_size, heads=m.num_attention_heads,
                   e=2 if mixed else FP32, r=2 if ex.precision == "bf16" else FP32, mixed=mixed,
                   cuda=device == "cuda", weight_casts=weight_casts, modernbert=m.family == "modernbert",
                   L=m.num_hidden_layers, window=window if window < T - 1 else None,  # (as model.layers_mask)
                   dropout=m.family == "bert" or m.hidden_dropout_prob > 0 or m.attention_probs_dropout_prob > 0
                   or bool(m.attention_output_dropout_prob),
                   flex=ex.attention == "flex" and device == "cuda" and m.attention_probs_dropout_prob == 0)


def plan_memory(cfg: Config, world_size: int = 1, device: str | None = None) -> MemoryPlan:
    """Predict the per-rank memory of pre-training ``cfg`` on ``world_size`` ranks.

    ``device`` is ``"cuda"`` or ``"cpu"``; by default the CPU when
    ``execution.device`` is ``cpu``, else CUDA.
    """
    if world_size < 1:
        raise ConfigError(f"world size must be at least 1, got {world_size}")
    ex, m, tr = cfg.execution, cfg.model, cfg.train
    if ex.pipeline_stages > 1:
        return _plan_pipeline(m, cfg.data, tr, ex, world_size, device)
    parallel, note = ex.parallel, ""
    if parallel == "none" and world_size > 1:
        # Several ranks need a parallel mode; replication is what "none" becomes.
        parallel = "ddp"
        note = f"execution.parallel=none with {world_size} ranks: planned as ddp"
    device = _resolve_device(ex, device)
    if ex.offload and parallel != "fsdp":
        raise ConfigError("execution.offload needs execution.parallel=fsdp (FSDP2's CPU offload)")
    if ex.offload and ex.fsdp_grad_sync == "step":
        raise ConfigError("execution.fsdp_grad_sync=step cannot be used with execution.offload=true "
                          "(unsharded gradients on the device for the whole step); use auto or micro_batch")
    # FSDP2's MixedPrecisionPolicy under bf16: it gathers bf16 copies of the fp32 shards.
    gathered_bytes = 2 if parallel == "fsdp" and ex.precision == "bf16" else FP32
    s = _shapes(m, cfg.data, tr, ex, device, weight_casts=gathered_bytes == FP32)
    accumulation = max(1, tr.global_batch_size // (tr.micro_batch_size * world_size))
    dp = _data_parallel_memory(m, tr, ex, parallel, world_size, accumulation, gathered_bytes)
    moments, saved = _backward_moments(s, m, ex.recompute, dp)
    config = {"world_size": world_size, "parallel": parallel, "note": note, "recompute": ex.recompute,
              "offload": ex.offload, "precision": ex.precision, "device": device,
              "micro_batch_size": s.B, "seq_len": s.T, "max_predictions": s.P, "accumulation": accumulation,
              "optimizer": tr.optimizer, "layers": m.num_hidden_layers, "hidden_size": s.H,
              "weights": tr.weights, "optimizer_state_dtype": tr.optimizer_state,
              "fsdp_grad_sync": dp.grad_sync, "optimizer_in_backward": tr.optimizer_in_backward,
              "reshard_after_forward": ex.reshard_after_forward if dp.fsdp else None,
              "gathered_dtype": ("bf16" if gathered_bytes == 2 else "fp32") if dp.fsdp else ""}
    return _data_parallel_plan(config, dp, moments, saved, ex.offload, RUNTIME_OVERHEAD[device])


def largest_micro_batch(plan_of: Callable[[int], MemoryPlan], device_memory: int, most: int) -> int:
    """The largest micro-batch up to ``most`` whose plan (``plan_of(micro_batch)``, e.g. :func:`plan_memory`
    of the config at that ``train.micro_batch_size``) fits ``device_memory`` bytes, 0 when not even one
    row fits. A plan grows with the micro-batch, so a binary search finds it."""
    low, high = 0, most  # 0 rows always fit; more than `most` are not asked
    while low < high:
        middle = (low + high + 1) // 2
        if plan_of(middle).fits(device_memory):
            low = middle
        else:
            high = middle - 1
    return low


@dataclass
class _DataParallelMemory:
    """What one rank holds besides activations under no parallelism, DDP or FSDP2, in bytes (but
    ``n_params`` and ``shard``, the ranks that parameters, gradients and optimizer state are divided over)."""

    n_params: int
    shard: int
    fsdp: bool
    params: int  # parameters (train.weights' dtype); the gradients take as much
    optimizer_state: int
    optimizer_workspace: int
    ddp_buckets: int
    gathered: int
    grads_in_flight: int
    accumulated: int
    grad_sync: str
    tied_grad: int  # the word embeddings' gradient
    grad_bytes: int = FP32  # of one gradient element
    in_backward: bool = False  # train.optimizer_in_backward: each gradient freed once its tensor steps

    def grads_live(self, n_grad_params: int) -> int:
        """Gradients on this rank while activations are live, once ``n_grad_params`` have one."""
        if self.ddp_buckets or self.in_backward:
            # DDP: all are in the buckets already; in the backward: each tensor steps and drops its
            # gradient as it is made. Either way the tied word embedding's waits: autograd holds it
            # from the decoder's backward to the embedding's (then DDP copies it in).
            return self.tied_grad if n_grad_params else 0
        if self.accumulated:  # all of them held already
            return self.accumulated + self.grads_in_flight
        return math.ceil(n_grad_params / self.shard) * self.grad_bytes + self.grads_in_flight


def _data_parallel_memory(m: ModelConfig, tr: TrainConfig, ex: ExecutionConfig, parallel: str, world_size: int,
                          accumulation: int, gathered_bytes: int) -> _DataParallelMemory:
    fsdp = parallel == "fsdp"
    n_params = count_parameters(m)
    per_layer = layer_parameters(m) * gathered_bytes
    root = (embedding_parameters(m) + head_parameters(m)) * gathered_bytes  # embeddings and heads: FSDP's root unit
    shard = world_size if fsdp else 1
    weight_bytes = DTYPE_BYTES[tr.weights]
    params = math.ceil(n_params / shard) * weight_bytes
    # Optimizer temporaries, per bucket (the decay group is by far the largest): one
    # list of tensors, the update that training/optim.py builds in place, or torch AdamW's sqrt(v).
    optimizer_workspace = math.ceil(decayed_parameters(m) / shard) * FP32
    if tr.weights == "bf16":  # fp32 copies of a chunk: weights, gradients, the update (and bf16 moments)
        chunk = min(n_params, max(ROUNDED_CHUNK_ELEMENTS, m.vocab_size * m.hidden_size))
        optimizer_workspace = chunk * FP32 * (3 + (2 if tr.optimizer_state == "bf16" else 0))
    # DDP's all-reduce buckets, made with the model and held through the step: the
    # gradients are views into them (gradient_as_bucket_view), not a second copy.
    ddp_buckets = n_params * weight_bytes if parallel == "ddp" else 0
    # FSDP2: the root stays unsharded from forward to backward; encoder layers are
    # gathered one at a time with the next one prefetched, or all kept from their
    # forward to their backward (reshard_after_forward false); in the backward the
    # unsharded gradients of a layer (and of the root) wait for the reduce-scatter.
    gathered_layers = min(2, m.num_hidden_layers) if ex.reshard_after_forward else m.num_hidden_layers
    gathered = root + gathered_layers * per_layer if fsdp else 0
    grads_in_flight = root + per_layer if fsdp else 0
    # fsdp_grad_sync step: micro-batches accumulate unsharded fp32 (reduce dtype) gradients of
    # the whole model, reduce-scattered after the last one.
    grad_sync = ex.grad_sync if fsdp else ""
    accumulated = n_params * FP32 if grad_sync == "step" and accumulation > 1 else 0
    return _DataParallelMemory(
        n_params=n_params, shard=shard, fsdp=fsdp, params=params,
        optimizer_state=_optimizer_states(tr) * math.ceil(n_params / shard) * DTYPE_BYTES[tr.optimizer_state],
        optimizer_workspace=optimizer_workspace,
        ddp_buckets=ddp_buckets, gathered=gathered, grads_in_flight=grads_in_flight, accumulated=accumulated,
        grad_sync=grad_sync, tied_grad=m.vocab_size * m.hidden_size * weight_bytes, grad_bytes=weight_bytes,
        # (several micro-batches: the gradients are held across them)
        in_backward=tr.optimizer_in_backward and accumulation == 1)


def _backward_moments(s: _Shapes, m: ModelConfig, recompute: str, dp: _DataParallelMemory
                      ) -> tuple[list[tuple[int, int, int]], dict[str, int]]:
    """(activations, gradients, transient) at the peaks of the backward pass, and the saved
    activations' details (all of them, one layer's as stored and in full)."""
    act, full_layer, stored_layer = _layer_memory(s, recompute)
    ffn_transient, attention_transient = _backward_transients(s)
    if s.modernbert:
        embeddings, head = _modernbert_embedding_activations(s, recompute), _modernbert_head_activations(s)
    else:
        embeddings, head = _embedding_activations(s), _head_activations(s)
    # The heads' gradients, with the tied decoder's: the word embeddings' gradient.
    head_grad = head_parameters(m) + m.vocab_size * m.hidden_size
    L = s.L
    moments = []
    stored_all = embeddings + head + L * stored_layer
    # Start of the backward: everything saved and the loss's two M × V gradients;
    # then the log-softmax output is freed and the tied decoder weight's gradient made.
    moments.append((stored_all, dp.grads_live(0), 2 * s.M * s.V * FP32))
    moments.append((stored_all, dp.grads_live(head_grad), 0))
    for i in reversed(range(L)):  # layer i's backward, recomputed if needed
        below = embeddings + i * stored_layer
        done = dp.grads_live(head_grad + (L - 1 - i) * layer_parameters(m))
        # recompute=attention: the feed-forward block's backward runs before the attention is recomputed
        ffn_alive = stored_layer if recompute == "attention" else full_layer
        moments.append((below + ffn_alive, done, ffn_transient))
        moments.append((below + full_layer - act["ffn"], done, attention_transient))
    # End: the embedding's dense gradient and the sum with the decoder's, for the tied weight.
    moments.append((embeddings, dp.grads_live(dp.n_params), 2 * m.vocab_size * m.hidden_size * FP32))
    return moments, {"saved_activations": stored_all, "layer_saved": stored_layer, "layer_full": full_layer}


def _data_parallel_plan(config: dict[str, Any], dp: _DataParallelMemory, moments: list[tuple[int, int, int]],
                        saved: dict[str, int], offload: bool, overhead: int) -> MemoryPlan:
    """The plan's totals: the peaks of the forward/backward and of the optimizer step, on the device and host."""
    activations = max(a + t for a, _, t in moments)
    backward_peak = max(a + g + t for a, g, t in moments)
    resident = dp.params + dp.optimizer_state  # through the whole step
    device_fb = (0 if offload else resident + dp.ddp_buckets) + dp.gathered + (
        max(a + t + dp.grads_in_flight for a, _, t in moments) if offload else backward_peak)
    optimizer_peak = resident + dp.params + dp.optimizer_workspace  # DDP's gradients are its buckets
    if dp.in_backward:  # no step of its own: the last, the word embeddings', has its gradient and update
        optimizer_peak = resident + 2 * dp.tied_grad
    if offload:
        device_total = device_fb + overhead
        # The sharded state, its gradients (copied out after each reduce-scatter)
        # and the optimizer step live on the host.
        host_total = optimizer_peak
    else:
        device_total = max(device_fb, optimizer_peak) + overhead
        host_total = 0
    # Device and host together, peak over the step: what one memory holds when the
    # device is the CPU (the two totals above peak at different times under offload).
    combined_peak = max(resident + dp.ddp_buckets + dp.gathered + backward_peak, optimizer_peak) + overhead
    where = "host" if offload else "device"
    return MemoryPlan(
        config=config,
        num_parameters=dp.n_params,
        parameters=dp.params, gradients=dp.tied_grad if dp.in_backward else dp.params,
        optimizer_state=dp.optimizer_state, activations=activations,
        workspace=(dp.tied_grad if dp.in_backward else dp.optimizer_workspace) + dp.gathered,
        overhead=overhead, device_total=device_total, host_total=host_total,
        combined_peak=combined_peak,
        location={"parameters": where, "gradients": where, "optimizer_state": where,
                  "activations": "device", "workspace": "device" if not offload else "device+host"},
        phases={"forward_backward": device_fb, "optimizer_step": optimizer_peak},
        details={"optimizer_workspace": dp.optimizer_workspace, "ddp_buckets": dp.ddp_buckets,
                 "fsdp_gathered_parameters": dp.gathered, "fsdp_unsharded_gradients": dp.grads_in_flight,
                 "fsdp_accumulated_gradients": dp.accumulated,
                 "gradients_dropped": dp.params - dp.tied_grad if dp.in_backward else 0,
                 "saved_activations": saved["saved_activations"],
                 "layer_saved": saved["layer_saved"], "layer_full": saved["layer_full"]},
    )


# ------------------------------------------------------------ pipeline stages

# Bytes of the generator state a stage hands on with each micro-batch's hidden states
# (training/pipeline.py): the CPU's mt19937 state; CUDA's Philox seed and offset.
RNG_STATE_BYTES = {"cpu": 5056, "cuda": 16}
PIPELINE_BUCKET_BYTES = 25 << 20  # the flat buckets pipelines average their gradients in


def stage_layer_counts(num_layers: int, stages: int) -> list[int]:
    """Encoder layers per pipeline stage, by ``pipeline_parallel.stage_layers``' rule: as even as
    possible, the first ``num_layers % stages`` stages one more."""
    if not 1 <= stages <= num_layers:
        raise ConfigError(f"execution.pipeline_stages={stages} needs 1..model.num_hidden_layers={num_layers}")
    base, extra = divmod(num_layers, stages)
    return [base + (1 if s < extra else 0) for s in range(stages)]


def stage_parameters(m: ModelConfig, stages: int, layer_counts: list[int] | None = None,
                     placement: str = "same_as_hidden_layers") -> list[int]:
    """Parameters each pipeline stage holds: its encoder layers (``layer_counts``, by default the even
    split); the word embeddings on the first, the rest of the embeddings there too or, with
    ``placement`` two_ipus, on the second; the pooler, the heads and a copy of the word embeddings
    (the decoder's tied weight) on the last."""
    layer_counts = layer_counts or stage_layer_counts(m.num_hidden_layers, stages)
    counts = [n * layer_parameters(m) for n in layer_counts]
    word = m.vocab_size * m.hidden_size
    counts[0] += word
    counts[1 if placement == "two_ipus" else 0] += embedding_parameters(m) - word
    counts[-1] += head_parameters(m) + (word if stages > 1 else 0)
    return counts


def stage_decayed_parameters(m: ModelConfig, stages: int, layer_counts: list[int] | None = None,
                             placement: str = "same_as_hidden_layers") -> list[int]:
    """``decayed_parameters`` of each stage (the word embeddings' copy on the last is decayed too)."""
    H, I = m.hidden_size, m.intermediate_size
    layer_counts = layer_counts or stage_layer_counts(m.num_hidden_layers, stages)
    counts = [n * (4 * H * H + 2 * H * I) for n in layer_counts]
    counts[0] += m.vocab_size * H
    counts[1 if placement == "two_ipus" else 0] += (m.max_position_embeddings + m.type_vocab_size) * H
    counts[-1] += 2 * H * H + 2 * H + (m.vocab_size * H if stages > 1 else 0)
    return counts


def in_flight(schedule: str, stage: int, stages: int, micro_batches: int, backward: int) -> int:
    """Micro-batches whose activations stage ``stage`` holds when it starts backward number
    ``backward`` (from 0) of a step: GPipe ran every forward first; 1F1B runs ``stages - stage``
    forwards before its first backward, then alternates, so it never holds more."""
    left = micro_batches - backward
    return left if schedule == "gpipe" else min(stages - stage, left)


@dataclass
class _PipelineStep:
    """What each stage's plan needs of one pipeline step: one micro-batch's shapes and saved bytes,
    the schedule and its sizes."""

    s: _Shapes
    m: ModelConfig
    schedule: str
    stages: int
    micro_batches: int
    act: dict[str, int]
    full_layer: int
    stored_layer: int
    ffn_transient: int
    attention_transient: int
    embeddings: int
    head: int
    stream: int  # one micro-batch's hidden states between two stages
    rng: int  # the generator state sent with them
    tied: int  # the word embeddings' parameters (the decoder's tied copy on the last stage)
    states: int  # fp32 optimizer states per parameter
    averaged: bool  # several pipelines average their gradients
    overhead: int


def _plan_pipeline(m: ModelConfig, data: DataConfig, tr: TrainConfig, ex: ExecutionConfig, world_size: int,
                   device: str | None) -> MemoryPlan:
    """``plan_memory`` for ``execution.pipeline_stages`` > 1: every stage planned, the largest returned.

    A stage holds its share of the parameters (:func:`stage_parameters`), their gradients and
    optimizer state; the activations of the micro-batches in flight (:func:`in_flight`), each of
    them what one micro-batch saves in the stage's layers (and embeddings or heads) plus the
    outputs the schedule keeps until the backward (hidden and RNG states; logits); and the
    schedule's buffers, made once for every micro-batch of the step: received hidden states
    (and RNG states) before the first stage, received gradients before the last. A stage other
    than the first also keeps each micro-batch's input gradient (the ``.grad`` of its receive
    buffer) until the next step. Several pipelines average each stage's gradients after the
    backward through flat buckets of ``PIPELINE_BUCKET_BYTES`` (pipeline_parallel.BUCKET_BYTES).
    """
    stages, schedule = ex.pipeline_stages, ex.pipeline_schedule
    device = _resolve_device(ex, device)
    if world_size % stages:
        raise ConfigError(f"world size {world_size} is not a multiple of execution.pipeline_stages={stages}")
    if ex.parallel == "fsdp" or ex.offload:
        raise ConfigError(f"execution.pipeline_stages={stages} cannot be used with execution.parallel=fsdp")
    replicas = world_size // stages
    note = ""
    if ex.parallel == "none" and replicas > 1:
        note = f"execution.parallel=none with {replicas} pipelines: planned as ddp"
    micro_batches = max(1, tr.global_batch_size // (tr.micro_batch_size * replicas))
    if schedule == "1f1b" and micro_batches < stages:
        raise ConfigError(f"execution.pipeline_schedule=1f1b needs at least execution.pipeline_stages={stages} "
                          f"micro-batches per step and pipeline, got {micro_batches}")
    step = _pipeline_step(m, data, tr, ex, device, micro_batches, averaged=replicas > 1)
    layer_counts, placement = pipeline_layer_counts(ex, m.num_hidden_layers), ex.embeddings_placement
    decayed = stage_decayed_parameters(m, stages, layer_counts, placement)
    held = stage_parameters(m, stages, layer_counts, placement)
    # (The embeddings' activations are planned on the first stage, under two_ipus too.)
    plans = [_plan_stage(step, stage, n_params, layers, decayed[stage])
             for stage, (n_params, layers) in enumerate(zip(held, layer_counts))]
    worst = max(plans, key=lambda p: p["device_total"])
    s = step.s
    config = {"world_size": world_size, "parallel": "ddp" if step.averaged else ex.parallel, "note": note,
              "recompute": ex.recompute, "offload": False, "precision": ex.precision, "device": device,
              "micro_batch_size": s.B, "seq_len": s.T, "max_predictions": s.P, "accumulation": micro_batches,
              "optimizer": tr.optimizer, "layers": m.num_hidden_layers, "hidden_size": s.H,
              "fsdp_grad_sync": "", "reshard_after_forward": None, "gathered_dtype": "",
              "pipeline_stages": stages, "pipeline_schedule": schedule, "pipelines": replicas,
              "pipeline_stage": worst["stage"]}
    return _pipeline_plan(config, step, plans, worst)


def _pipeline_step(m: ModelConfig, data: DataConfig, tr: TrainConfig, ex: ExecutionConfig, device: str,
                   micro_batches: int, averaged: bool) -> _PipelineStep:
    s = _shapes(m, data, tr, ex, device)
    act, full_layer, stored_layer = _layer_memory(s, ex.recompute)
    ffn_transient, attention_transient = _backward_transients(s)
    return _PipelineStep(
        s=s, m=m, schedule=ex.pipeline_schedule, stages=ex.pipeline_stages, micro_batches=micro_batches,
        act=act, full_layer=full_layer, stored_layer=stored_layer,
        ffn_transient=ffn_transient, attention_transient=attention_transient,
        embeddings=_embedding_activations(s), head=_head_activations(s),
        stream=s.N * s.H * s.r, rng=RNG_STATE_BYTES[device], tied=m.vocab_size * m.hidden_size,
        states=_optimizer_states(tr), averaged=averaged, overhead=RUNTIME_OVERHEAD[device])


def _plan_stage(p: _PipelineStep, stage: int, n_params: int, layers: int, decayed: int) -> dict[str, int]:
    """One stage's memory through the step (its peaks, what it saves per micro-batch, its buffers)."""
    s, micro_batches = p.s, p.micro_batches
    first, last = stage == 0, stage == p.stages - 1
    params = n_params * FP32
    resident = params + p.states * params
    workspace = decayed * FP32
    # The schedule's receive buffers, one per micro-batch of the step, made with the stage.
    buffers = (0 if first else micro_batches * (p.stream + p.rng)) + (0 if last else micro_batches * p.stream)
    input_grad = 0 if first else p.stream  # each backward leaves one (the receive buffer's .grad)
    # The outputs the schedule keeps from the forward to the backward: the hidden and RNG states
    # sent on; on the last stage the logits (which one process frees once the loss is computed).
    kept = s.M * s.V * s.e + s.B * 2 * s.e if last else p.stream + p.rng
    received = 0 if first else p.stream  # layer 0's input is a receive buffer (counted in buffers)
    per_micro_batch = ((p.embeddings if first else 0) + layers * p.stored_layer + (p.head if last else 0)
                       + kept - received)
    moments = _stage_moments(p, first, last, layers, n_params, per_micro_batch, kept - received)
    peak_activations, peak = 0, 0
    for backward in range(micro_batches):  # each backward of the step, with what is in flight then
        others = (in_flight(p.schedule, stage, p.stages, micro_batches, backward) - 1) * per_micro_batch
        others += backward * input_grad
        for a, g, t, t_added in moments:
            # The first backward makes every gradient; the later ones add theirs to them.
            live = (n_params if backward else g) * FP32
            t += t_added if backward else 0
            peak_activations = max(peak_activations, others + a + t)
            peak = max(peak, others + a + t + live)
    forward_backward = resident + buffers + peak
    after_backward = resident + params + buffers + micro_batches * input_grad  # with every gradient
    averaging = after_backward + min(PIPELINE_BUCKET_BYTES, params) if p.averaged else 0
    optimizer_step = after_backward + workspace
    return {
        "stage": stage, "layers": layers, "parameters": n_params,
        "in_flight": in_flight(p.schedule, stage, p.stages, micro_batches, 0),
        "saved_per_micro_batch": per_micro_batch + received, "activations": peak_activations,
        "buffers": buffers, "forward_backward": forward_backward, "gradient_averaging": averaging,
        "optimizer_step": optimizer_step,
        "device_total": max(forward_backward, averaging, optimizer_step) + p.overhead,
        "params_bytes": params, "states_bytes": p.states * params, "workspace": workspace}


def _stage_moments(p: _PipelineStep, first: bool, last: bool, layers: int, n_params: int, per_micro_batch: int,
                   outputs: int) -> list[tuple[int, int, int, int]]:
    """One micro-batch's backward through a stage: (activations, gradient parameters, transient,
    transient once gradients exist: a new gradient of the tied weight before it is added to them).
    ``outputs``: what the schedule keeps of the stage's outputs, less its received input."""
    s = p.s
    head_grads = head_parameters(p.m) + p.tied if last else 0
    moments: list[tuple[int, int, int, int]] = []
    if last:  # the loss's two M × V gradients; then the decoder's gradient of the tied weight
        moments += [(per_micro_batch, 0, 2 * s.M * s.V * FP32, 0), (per_micro_batch, head_grads, 0, p.tied * FP32)]
    else:  # the output's gradient waits in a receive buffer
        moments.append((per_micro_batch, 0, 0, 0))
    for i in reversed(range(layers)):
        below = (p.embeddings if first else 0) + i * p.stored_layer + outputs
        done = head_grads + (layers - 1 - i) * layer_parameters(p.m)
        moments.append((below + p.full_layer, done, p.ffn_transient, 0))
        moments.append((below + p.full_layer - p.act["ffn"], done, p.attention_transient, 0))
    if first:  # the embedding's dense gradient of the word embeddings
        moments.append((p.embeddings + outputs, n_params, 0, p.tied * FP32))
    return moments


def _pipeline_plan(config: dict[str, Any], p: _PipelineStep, plans: list[dict[str, int]],
                   worst: dict[str, int]) -> MemoryPlan:
    """The largest stage's plan as the rank's, every stage's in ``stages``."""
    return MemoryPlan(
        config=config,
        num_parameters=count_parameters(p.m),
        parameters=worst["params_bytes"], gradients=worst["params_bytes"], optimizer_state=worst["states_bytes"],
        activations=worst["activations"], workspace=worst["workspace"] + worst["buffers"],
        overhead=p.overhead, device_total=worst["device_total"], host_total=0,
        combined_peak=worst["device_total"],
        location={"parameters": "device", "gradients": "device", "optimizer_state": "device",
                  "activations": "device", "workspace": "device"},
        phases={"forward_backward": worst["forward_backward"], "optimizer_step": worst["optimizer_step"],
                **({"gradient_averaging": worst["gradient_averaging"]} if p.averaged else {})},
        details={"optimizer_workspace": worst["workspace"], "pipeline_buffers": worst["buffers"],
                 "layer_saved": p.stored_layer, "layer_full": p.full_layer},
        stages=[{k: v for k, v in plan.items() if not k.endswith("_bytes")} for plan in plans],
    )


# ------------------------------------------------------------ sizes and the table

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_size(text: str) -> int:
    """``80GB`` (10⁹), ``80GiB`` or ``80G`` (2³⁰), ``81920MB``, ``1.5e9``, plain bytes → bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", str(text), re.IGNORECASE)
    if not match or match.group(2).lower() not in _UNITS:
        raise ConfigError(f"--device-memory: cannot read {text!r} as a size "
                          f"(examples: 80GB, 80GiB, 81920MB, 85899345920)")
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if value <= 0:
        raise ConfigError(f"--device-memory: {text!r} must be positive")
    return int(value)


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _in_backward_line(plan: MemoryPlan) -> str:
    dropped = plan.details["gradients_dropped"]
    if not dropped:
        return ("optimizer in backward: steps in the last micro-batch's backward; the gradients are held "
                f"across the {plan.config['accumulation']} micro-batches, so none are dropped")
    return (f"optimizer in backward: each tensor steps as its gradient is made; gradients held "
            f"{format_bytes(plan.gradients)} (the word embeddings', the largest) instead of "
            f"{format_bytes(plan.parameters)}: {format_bytes(dropped)} less")


def format_plan(plan: MemoryPlan, device_memory: int | None = None) -> str:
    c = plan.config
    lines = [(f"memory per rank: {plan.num_parameters / 1e6:.1f}M parameters, {c['layers']} layers, "
              f"hidden {c['hidden_size']}; micro-batch {c['micro_batch_size']} × seq {c['seq_len']} "
              f"({c['max_predictions']} predictions), {c['precision']}, {c['optimizer']}"),
             (f"world size {c['world_size']}, parallel {c['parallel']}, recompute {c['recompute']}, "
              f"offload {'on' if c['offload'] else 'off'}, device {c['device']}")]
    if c["parallel"] == "fsdp":
        sync = "once per step" if c["fsdp_grad_sync"] == "step" else "every micro-batch"
        lines.append(f"fsdp: parameters gathered in {c['gathered_dtype']}, gradients reduce-scattered {sync} "
                     f"({c['accumulation']} micro-batches per step), reshard after forward "
                     f"{'on' if c['reshard_after_forward'] else 'off'}")
    elif c["parallel"] == "ddp":
        lines.append("ddp: gradients are views into the all-reduce buckets, held through the step")
    if plan.stages:
        lines.append(f"pipeline: {c['pipelines']} × {c['pipeline_stages']} stages, {c['pipeline_schedule']}, "
                     f"{c['accumulation']} micro-batches per step; the lines below are stage {c['pipeline_stage']}'s")
        for st in plan.stages:
            lines.append(f"  stage {st['stage']}: {st['layers']} layers, {st['parameters'] / 1e6:.1f}M parameters, "
                         f"{st['in_flight']} in flight, activations {format_bytes(st['activations'])}, "
                         f"total {format_bytes(st['device_total'])}")
    if c.get("optimizer_in_backward"):
        lines.append(_in_backward_line(plan))
    if c["note"]:
        lines.append(f"note: {c['note']}")
    lines.append("")
    weights, state = c.get("weights", "fp32"), c.get("optimizer_state_dtype", "fp32")
    rows = [(f"parameters ({weights})", plan.parameters, plan.location["parameters"]),
            (f"gradients ({weights})", plan.gradients, plan.location["gradients"]),
            (f"optimizer state ({state})", plan.optimizer_state, plan.location["optimizer_state"]),
            ("activations (peak)", plan.activations, "device"),
            ("workspace", plan.workspace, plan.location["workspace"]),
            ("runtime overhead", plan.overhead, "device")]
    for name, value, where in rows:
        lines.append(f"  {name:<22}{format_bytes(value):>14}   {where}")
    lines.append(f"  {'':<22}{'-' * 14}")
    lines.append(f"  {'device total (peak)':<22}{format_bytes(plan.device_total):>14}")
    lines.append(f"  {'host total (peak)':<22}{format_bytes(plan.host_total):>14}")
    lines.append("  (totals are peaks over the step: forward/backward "
                 f"{format_bytes(plan.phases['forward_backward'])}, optimizer step "
                 f"{format_bytes(plan.phases['optimizer_step'])}; not the sum of the lines)")
    if device_memory is not None:
        verdict = "fits" if plan.fits(device_memory) else "does not fit"
        lines.append("")
        lines.append(f"{verdict} in {format_bytes(device_memory)} of device memory "
                     f"({100 * plan.device_total / device_memory:.0f}% used)")
    return "\n".join(lines)


# ------------------------------------------------------------ the command

def add_plan_command(sub: Any) -> None:
    """``bertforge plan``: registered by cli.py next to the other commands."""
    p = sub.add_parser(
        "plan", help="memory per rank of a pre-training config, and whether it fits",
        epilog=OVERRIDES_HELP + " Exit status: 0, or 1 when --device-memory is given and the plan does "
                        "not fit; 2 for a mistake in the arguments.",
        description="Predict per-rank memory (parameters, gradients, optimizer state, "
                    "activations) of pre-training a config, from the config alone.")
    p.add_argument("--config", help=CONFIG_HELP + f" (default: {PRETRAIN_CONFIG}, what `bertforge pretrain` runs)")
    p.add_argument("--world-size", type=int, default=1, help="ranks (processes), default 1")
    p.add_argument("--device-memory", help="memory of one device: 80GB, 80GiB, 81920MB or bytes")
    p.add_argument("--device", choices=("cuda", "cpu"),
                   help="what runs the step (default: cpu if execution.device is cpu, else cuda)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_plan, takes_overrides=True)


def cmd_plan(args: Any, extra: list[str]) -> int:
    import json

    device_memory = parse_size(args.device_memory) if args.device_memory is not None else None
    cfg = config_from_args(args, extra, default=PRETRAIN_CONFIG)
    plan = plan_memory(cfg, world_size=args.world_size, device=args.device)
    fits = plan.fits(device_memory) if device_memory is not None else None
    if args.json:
        print(json.dumps({**plan.to_dict(), "device_memory": device_memory, "fits": fits}))
    else:
        print(format_plan(plan, device_memory))
    return 1 if fits is False else 0
