"""Typed configuration: the single source of truth for a run.

A config is built in three layers, each overriding the one before:

1. the dataclass defaults below,
2. a YAML file (``--config pretrain_base_128`` names one shipped in
   ``bertforge/configs/``; a path names your own; a bare model preset such as
   ``base`` means "defaults with that model"),
3. dotted command-line overrides such as ``--train.global_batch_size 256``.

Unknown keys and values of the wrong type are errors that name the key. The
resolved config is saved as ``config.yaml`` in every run and checkpoint.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import types
import typing
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

CONFIG_DIR = Path(__file__).parent / "configs"
# What `bertforge pretrain` runs without --config, and so what `config` and `plan` describe then.
PRETRAIN_CONFIG = "pretrain_tiny"

# The values a field may take: one definition each. The dataclass fields are
# typed with them, set_value checks against them, and the command-line flags
# take their ``choices=`` from them via ``typing.get_args``.
Precision = Literal["fp32", "bf16", "fp16"]  # fp16 only on GPU
Parallel = Literal["none", "ddp", "fsdp"]
Recompute = Literal["none", "layer", "attention"]
FsdpGradSync = Literal["auto", "step", "micro_batch"]  # when FSDP2 reduce-scatters accumulated gradients
PipelineSchedule = Literal["1f1b", "gpipe"]  # torch.distributed.pipelining schedules, see training/pipeline.py
# Where pipeline stages put the embeddings, as Graphcore's TF1 BERT names it: with the first layers, on
# a stage of their own, or the word embeddings and the rest (positions, segments, LayerNorm) on one each.
EmbeddingsPlacement = Literal["same_as_hidden_layers", "same_ipu", "two_ipus"]
EMBEDDING_STAGES: dict[str, int] = {"same_as_hidden_layers": 0, "same_ipu": 1, "two_ipus": 2}
Optimizer = Literal["lamb", "adamw", "sgd", "stableadamw"]
Objective = Literal["mlm_nsp", "mlm"]  # mlm: masked LM alone, no NSP head (BertForMaskedLM)
LambVariant = Literal["bertforge", "mlperf", "nvidia", "paper"]  # see bertforge/training/optim.py
# What weights (and, separately, optimizer moments) are stored as: bf16 halves their bytes; the update is
# computed in fp32 and rounded back (training/optim.py, "bf16 weights")
WeightsDtype = Literal["fp32", "bf16"]
Schedule = Literal["poly", "poly_tf", "exp", "exp_staircase", "table", "constant", "wsd"]
DecayShape = Literal["linear", "one_minus_sqrt"]  # wsd's decay: see training/optim.py lr_at
HiddenAct = Literal["gelu", "relu", "gelu_new"]
# The model's architecture: BERT (models/bert.py) or ModernBERT (models/modernbert.py)
Family = Literal["bert", "modernbert"]
ClassifierPooling = Literal["cls", "mean"]  # what a ModernBERT sequence classifier reads (transformers' name)
# SDPA kernels, or FlexAttention with block masks for masked batches; see dist.attention_backends
Attention = Literal["auto", "flash", "cudnn", "efficient", "math", "flex"]
# torch.compile's modes without CUDA graphs (the optimizer step runs outside the compiled model):
# max-autotune-no-cudagraphs benchmarks GEMM kernels and fuses their epilogues (bias, GELU) into them
CompileMode = Literal["default", "max-autotune-no-cudagraphs"]
# What torch.compile compiles: each encoder layer, all sharing one graph (regional compilation: a cold start
# traces and compiles one layer, not the whole unrolled model), or the whole model as one graph
CompileScope = Literal["layers", "model"]
# What a checkpoint is loaded or exported as.
Head = Literal["pretraining", "qa", "classification", "token_classification", "encoder"]


class ConfigError(ValueError):
    """A user-facing configuration mistake; the message names the key."""


class Freezable:
    """A config part whose assignments raise once :func:`freeze` marked the config resolved: a
    run reads one config from start to end, the one it saved."""

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_frozen"):
            raise dataclasses.FrozenInstanceError(
                f"the config is frozen once resolved: {type(self).__name__}.{name} cannot change (make a "
                f"changed copy with config.replaced)")
        super().__setattr__(name, value)


@dataclass
class ModelConfig(Freezable):
    """The model's family and shape. Field names follow Hugging Face's ``BertConfig`` so that
    ``config.json`` maps one to one; ModernBERT's own fields follow its ``ModernBertConfig``.

    Family ``modernbert`` reads the shared fields as ``ModernBertConfig`` does its own (its
    ``norm_eps`` is ``layer_norm_eps``, ``hidden_activation`` ``hidden_act``; ``hidden_dropout_prob``
    is its embedding and MLP dropout, ``attention_probs_dropout_prob`` its attention dropout) and
    has no token types; the fields after ``pad_token_id`` are its alone (``MODERNBERT_FIELDS``).
    """

    family: Family = "bert"
    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: HiddenAct = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    initializer_range: float = 0.02
    pad_token_id: int = 0
    global_attn_every_n_layers: int = 3  # layers 0, N, 2N, … attend globally, the others locally
    local_attention: int = 128  # a local layer's window: a token sees keys at most local_attention // 2 away
    global_rope_theta: float = 160000.0  # rotary base of the global layers
    local_rope_theta: float = 10000.0  # … and of the local ones
    rope_scaling_factor: float = 1.0  # linear rotary scaling (transformers' rope_type linear): positions / factor
    initializer_cutoff_factor: float = 2.0  # weights start truncated-normal within ± this × their std
    classifier_pooling: ClassifierPooling = "cls"  # a sequence classifier reads [CLS], or the mean of the tokens
    classifier_dropout: float = 0.0  # before a fine-tuning head's classifier
    # Dropout after the attention output (Wo) alone, as ModernBERT's own attn_out_dropout_prob; None:
    # attention_probs_dropout_prob, as transformers' one attention_dropout for the weights and the output
    attention_output_dropout_prob: float | None = None


# The fields only ModernBERT reads, and the one only BERT reads.
MODERNBERT_FIELDS = ("global_attn_every_n_layers", "local_attention", "global_rope_theta", "local_rope_theta",
                     "rope_scaling_factor",
                     "initializer_cutoff_factor", "classifier_pooling", "classifier_dropout",
                     "attention_output_dropout_prob")
BERT_FIELDS = ("type_vocab_size",)
# What each family's config.yaml leaves out: the other's fields (and BERT's the family itself, so
# that a BERT config reads as it always has).
LEFT_OUT: dict[str, tuple[str, ...]] = {"bert": ("family", *MODERNBERT_FIELDS), "modernbert": BERT_FIELDS}


def use_model(cfg: Config, model: ModelConfig) -> None:
    """Give ``cfg`` a loaded model's config (the saved config describes what runs). A ModernBERT has
    no next-sentence head: its ``train.objective`` is mlm (fine-tuning and imports do not read it)."""
    cfg.model = dataclasses.replace(model)
    if model.family == "modernbert":
        cfg.train.objective = "mlm"


def model_dict(model: ModelConfig) -> dict[str, Any]:
    """The fields of ``model`` its family reads, as config.yaml holds them."""
    return {k: v for k, v in dataclasses.asdict(model).items() if k not in LEFT_OUT[model.family]}


def _shape(layers: int, hidden: int, heads: int) -> dict[str, int]:
    return {"num_hidden_layers": layers, "hidden_size": hidden,
            "num_attention_heads": heads, "intermediate_size": 4 * hidden}


# The standard BERT shapes (Turc et al. 2019 for the small ones, Devlin et al. 2018).
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": _shape(2, 128, 2),
    "mini": _shape(4, 256, 4),
    "small": _shape(4, 512, 8),
    "medium": _shape(8, 512, 8),
    "base": _shape(12, 768, 12),
    "large": _shape(24, 1024, 16),
}


def _modernbert(layers: int, hidden: int, heads: int, intermediate: int) -> dict[str, Any]:
    """A whole ModernBERT config: the shape, and the rest as answerdotai/ModernBERT-base and -large's
    config.json (transformers' ModernBertConfig defaults): no dropout, GELU, LayerNorm eps 1e-5, the
    50368-token BPE vocab with [PAD] at 50283, 8192 positions, a global layer every 3rd, windows of 128;
    and their classifier_pooling, mean (transformers' default is cls)."""
    return {"family": "modernbert", "num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
            "intermediate_size": intermediate, "vocab_size": 50368, "max_position_embeddings": 8192,
            "hidden_act": "gelu", "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
            "layer_norm_eps": 1e-5, "initializer_range": 0.02, "pad_token_id": 50283,
            "global_attn_every_n_layers": 3, "local_attention": 128, "global_rope_theta": 160000.0,
            "local_rope_theta": 10000.0, "initializer_cutoff_factor": 2.0,
            "classifier_pooling": "mean", "classifier_dropout": 0.0}


# ModernBERT (Warner et al. 2024): base and large as published, and a tiny one of 4 layers (global,
# local, local, global) for tests and a first run on a laptop, with BERT's vocab size and [PAD] id 0
# (the data's vocab decides the size; a WordPiece vocab's [PAD] is 0).
MODEL_PRESETS.update({
    "modernbert-tiny": {**_modernbert(4, 128, 2, 192), "vocab_size": 30522, "pad_token_id": 0},
    "modernbert-base": _modernbert(22, 768, 12, 1152),
    "modernbert-large": _modernbert(28, 1024, 16, 2624),
})


@dataclass
class DataConfig(Freezable):
    """Where training sequences come from and how they are masked."""

    input: str = ""  # text file or directory, or record shards (dir or glob); "" = the built-in corpus
    eval_input: str = ""  # records of the eval set, when input is records
    vocab: str = ""  # WordPiece vocab.txt or tokenizer.json (data/vocab.py); "" = train a vocab.txt on the corpus
    vocab_size: int = 8192  # size of a vocab trained here
    lowercase: bool = True
    seq_len: int = 128
    max_predictions: int = 20
    masked_lm_prob: float = 0.15
    short_seq_prob: float = 0.1
    dupe_factor: int = 5
    eval_fraction: float = 0.1  # share of documents held out for evaluation
    synthetic: bool = False  # random tokens, for benchmarking without a corpus
    seed: int = 12345
    shuffle_buffer: int = 10000  # records: each window of this many records is shuffled; 0 or 1 = none
    dynamic_masking: bool = False  # records: mask anew every epoch instead of the stored masks
    whole_word_mask: bool = False  # mask all WordPieces of a word or none (text input; dynamic_masking)
    prefetch: int = 4  # records: batches read ahead (and pinned, on CUDA) in a background thread; 0 = none
    # records: threads reading and decoding batches at once, handed out in one thread's order (Graphcore's
    # parallel_io_threads, spelt parallell_io_threads in its older configs); more than 1 needs prefetch
    reader_threads: int = 1


@dataclass
class TrainConfig(Freezable):
    """Optimisation. global_batch_size = micro_batch_size × accumulation × world size."""

    # mlm_nsp: BERT's masked LM + next-sentence prediction. mlm: masked LM alone (RoBERTa); text
    # input is then packed as full sentences (records: `data create --mlm-only`).
    objective: Objective = "mlm_nsp"
    optimizer: Optimizer = "lamb"
    lamb: LambVariant = "bertforge"  # whose LAMB: which tensors adapt, clamp, decay (README)
    lr: float = 1e-3
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-6
    bias_correction: bool = True
    max_trust_ratio: float = 10.0  # LAMB trust-ratio clamp (lamb: bertforge only); 0 = no clamp
    momentum: float = 0.0  # sgd: torch.optim.SGD's momentum (0: plain SGD)
    nesterov: bool = False  # sgd: Nesterov momentum (needs momentum > 0)
    # stableadamw: weight decay scaled by lr / train.lr, not by the lr (ModernBERT's decoupled_stableadamw)
    decouple_lr: bool = True
    # bf16: parameters (and their gradients) stored in bf16, PopXL's `precision` for the weights; needs
    # execution.precision bf16 and one of our optimizers (lamb, stableadamw, adamw without bias correction)
    weights: WeightsDtype = "fp32"
    optimizer_state: WeightsDtype = "fp32"  # the moments' dtype; bf16 only with bf16 weights
    # bf16 weights: round each update stochastically (unbiased: P(up) = the distance to the lower neighbour),
    # PopXL's stochastic_rounding; false: to nearest, which loses every update under half a bf16 ulp
    stochastic_rounding: bool = False
    micro_batch_size: int = 32
    global_batch_size: int = 32
    # ModernBERT's batch-size warm-up (its sequence packer's BatchSizeWarmupScheduler): each rank starts at
    # this many sequences a step (a multiple of micro_batch_size; 0 = off) and grows a micro-batch at a time
    # to its share of global_batch_size over the first batch_size_warmup_tokens tokens read (all ranks')
    batch_size_warmup_min_size: int = 0
    batch_size_warmup_tokens: int = 0
    steps: int = 1000
    epochs: int = 0  # > 0: stop after this many passes over the data instead
    warmup_steps: int = 0
    warmup_proportion: float = 0.0  # used when warmup_steps is 0
    schedule: Schedule = "poly"
    start_warmup_step: int = 0  # poly_tf: warm-up lr × (step - this) / warmup_steps; <= 0
    decay_power: float = 1.0  # poly: 1.0 is linear decay
    end_lr: float = 0.0  # poly, poly_tf, wsd: the lr the decay heads to
    decay_steps: int = 0  # wsd: the last this many steps decay linearly to end_lr (0: no decay)
    decay_proportion: float = 0.0  # wsd: used when decay_steps is 0
    decay_shape: DecayShape = "linear"  # wsd: linear, or 1 - sqrt (ModernBERT's context extension)
    exp_decay_rate: float = 0.5  # exp: lr × exp(-rate × step / exp_decay_steps); exp_staircase: floor(...)
    exp_decay_steps: int = 1000
    lr_table: dict[int, float] = field(default_factory=dict)  # table: step → lr from that step
    grad_clip: float = 1.0  # global-norm clip; 0 = off
    # A static loss scale, PopXL's execution.loss_scaling: the loss × this before backward, the gradients
    # × 1/this (in fp32) before clipping and the update. 1 = none (fp16 then keeps torch's dynamic scaler)
    loss_scale: float = 1.0
    # PopART's Adam scaled_optimizer_state: the gradients stay scaled into the moments and eps is × loss_scale
    # instead, the same update up to rounding (lamb, adamw, stableadamw)
    scaled_optimizer_state: bool = False
    # Step each parameter in the backward as soon as its gradient is made, then free the gradient
    # (PopXL SQuAD's per-layer update; training/in_backward.py): the step never holds every gradient.
    optimizer_in_backward: bool = False
    # Stop a run whose loss explodes but stays finite: above divergence_factor × the median of the
    # last 100 normal steps' losses for divergence_steps steps in a row (engine.DivergenceGuard).
    # 0 = off. No checkpoint is written during a spike, so the newest one is from before it.
    divergence_factor: float = 0.0
    divergence_steps: int = 10
    eval_every: int = 0  # steps between evaluations; 0 = only at the end
    eval_batches: int = 0  # 0 = the whole eval set
    # Training sequences between evaluations; 0 = eval_every applies; mlperf = the MLPerf BERT
    # formula for the global batch (mlperf.eval_interval_samples: 225000 for 8192)
    eval_every_samples: int | Literal["mlperf"] = 0
    eval_at_start: bool = True  # evaluate before the first step (at 0 samples)
    eval_batch_size: int = 0  # sequences per eval batch; 0 = micro_batch_size
    target_mlm_accuracy: float = 0.0  # stop at the first evaluation that reaches it; 0 = none (MLPerf: 0.720)
    seed: int = 42


@dataclass
class ExecutionConfig(Freezable):
    """Where and how the model runs."""

    device: str = "auto"  # auto | cpu | cuda | cuda:N
    precision: Precision = "fp32"  # fp16 only on GPU
    parallel: Parallel = "none"  # fsdp: FSDP2, parameters, gradients and optimizer state sharded
    recompute: Recompute = "none"  # layer: checkpoint every encoder layer; attention: only attention
    offload: bool = False  # parameters and optimizer state in host memory, streamed to the device
    compile: bool | Literal["auto"] = "auto"  # torch.compile the model and the loss; auto = on CUDA
    # SDPA kernel; auto = flash, cudnn, efficient, math on CUDA; torch's on the CPU. flex: padded and packed
    # batches through FlexAttention's block masks (CUDA, no attention dropout), the rest through SDPA
    attention: Attention = "auto"
    compile_mode: CompileMode = "default"  # torch.compile's mode for the model (max-autotune: minutes more)
    compile_scope: CompileScope = "layers"  # layers: one graph all encoder layers share; model: the whole model
    compile_cache: str = ""  # persistent compile cache directory; "" = ~/.cache/bertforge/compile
    threads: int = 0  # CPU threads for torch; 0 = torch's default
    tf32: bool = True  # fp32 matmuls on CUDA in TF32 (10-bit mantissa, tensor cores); false = exact fp32
    # FP8 (torchao's float8 training) for the encoder layers' linear layers, under precision bf16; CUDA with
    # compute capability >= 8.9 (Ada, Hopper) and torchao installed
    fp8: bool = False
    dist_timeout: int = 1800  # seconds a rank waits for the others in a collective (torch's default)
    fsdp_grad_sync: FsdpGradSync = "auto"  # step: reduce-scatter once per step; auto = step, micro_batch with offload
    reshard_after_forward: bool = True  # fsdp: false keeps gathered layers from forward to backward (memory for speed)
    # Pipeline parallelism: the encoder layers split over this many ranks (1 = off); a step's micro-batches
    # flow through them under pipeline_schedule: 1f1b (at most pipeline_stages micro-batches in flight) or
    # gpipe (all forwards, then all backwards). With parallel ddp, world / stages pipelines are replicas.
    pipeline_stages: int = 1
    pipeline_schedule: PipelineSchedule = "1f1b"
    # Graphcore TF1 BERT's placement: encoder layers of each stage that holds layers ([] = as even as
    # possible), after the embeddings' own stages (embeddings_placement; see training/pipeline.py).
    hidden_layers_per_stage: list[int] = field(default_factory=list)
    embeddings_placement: EmbeddingsPlacement = "same_as_hidden_layers"

    @property
    def grad_sync(self) -> str:
        """fsdp_grad_sync with auto resolved: with offload, unsharded gradients on the device
        would defeat it, so each micro-batch's are reduce-scattered (and leave the device)."""
        if self.fsdp_grad_sync == "auto":
            return "micro_batch" if self.offload else "step"
        return self.fsdp_grad_sync


@dataclass
class CheckpointConfig(Freezable):
    every: int = 0  # steps between checkpoints; 0 = only at the end; not negative
    keep: int = 3  # newest step directories kept; 0 = keep all
    resume: str = ""  # a run or checkpoint directory to continue
    init: str = ""  # start from these weights (our checkpoint, a Hugging Face dir or a TF1 checkpoint prefix)
    resume_with_changes: bool = False  # resume although the config or the data differ from the checkpoint's


@dataclass
class LogConfig(Freezable):
    run_dir: str = "runs"
    name: str = ""  # "" = a timestamp
    every: int = 10  # steps between logged rows (and the first and last step); at least 1
    progress: bool = True
    # seconds between plain progress lines when the output is not a terminal (a log file, a pipe): training
    # steps, and the batches of every evaluation and prediction pass
    progress_every_s: float = 30.0
    tensorboard: bool = True  # when the tensorboard package is installed
    wandb: bool = False
    wandb_project: str = "bertforge"
    mlperf: str = ""  # write an MLPerf log (mllog) to this file; needs the [mlperf] extra (training/mlperf.py)
    mlperf_org: str = ""  # its submission_org; "" = bertforge
    mlperf_platform: str = ""  # its submission_platform; "" = ranks × device name
    profile: str = ""  # "START:END": torch.profiler over steps START..END-1, into RUN/profile/ (observe/profile.py)


@dataclass
class Config(Freezable):
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def __post_init__(self) -> None:
        # The keys a config file or an override set, even to their default value: where the data
        # decides a value too (the records' seq_len), one the user gave must agree with it.
        self.given: set[str] = set()
        # The model preset the user named (--config NAME, model.preset), "" for none: checkpoint.init's
        # model must be it (its fields are not given, so the init's would silently replace them).
        self.preset = ""

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "model": model_dict(self.model)}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @property
    def accumulation_steps(self) -> int:
        return accumulation_steps(self.train, world_size=1)


def accumulation_steps(train: TrainConfig, world_size: int) -> int:
    per_step = train.micro_batch_size * world_size
    if train.global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size={train.global_batch_size} is not a multiple of "
            f"train.micro_batch_size × world size = {per_step}")
    return train.global_batch_size // per_step


# ---------------------------------------------------------------- coercion

def _coerce(key: str, value: Any, typ: Any) -> Any:
    """Check (YAML) or convert (command-line strings) one value to a field's type."""
    origin = typing.get_origin(typ)
    if origin is Literal:
        choices = typing.get_args(typ)
        if value not in choices:
            raise ConfigError(f"{key}: {_short(value)} is not one of {', '.join(map(str, choices))}")
        return value
    if origin is dict:
        if isinstance(value, str):
            try:
                value = yaml.safe_load(value) or {}
            except yaml.YAMLError as err:
                raise ConfigError(f"{key}: {_short(value)} is not a YAML mapping ({_yaml_problem(err)})") from None
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {_short(value)}")
        ktyp, vtyp = typing.get_args(typ)
        return {_coerce(f"{key}[{k}]", k, ktyp): _coerce(f"{key}[{k}]", v, vtyp)
                for k, v in value.items()}
    if origin is list:  # a YAML list, or comma-separated on the command line
        if isinstance(value, str):
            value = value.split(",") if value else []
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {_short(value)}")
        (item,) = typing.get_args(typ)
        return [_coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if len(args) < len(typing.get_args(typ)) and (
                value is None or (isinstance(value, str) and value.lower() in ("none", "null"))):
            return None
        problems = []
        for arg in args:  # the first type that takes the value (int | Literal["mlperf"])
            try:
                return _coerce(key, value, arg)
            except ConfigError as err:
                problems.append(str(err).removeprefix(f"{key}: "))
        raise ConfigError(f"{key}: {' or '.join(problems)}")
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{key}: expected true or false, got {_short(value)}")
    if typ is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected an integer, got {_short(value)}")
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected an integer, got {_short(value)}")
    if typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {_short(value)}")
    if typ is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}: expected a string, got {_short(value)}")
    raise TypeError(f"unsupported config type {typ} for {key}")


def _section_types(section: Any) -> dict[str, Any]:
    hints = typing.get_type_hints(type(section))
    return {f.name: hints[f.name] for f in dataclasses.fields(section)}


def set_value(cfg: Config, dotted: str, value: Any) -> None:
    """Set ``section.field`` on cfg, converting and checking the value."""
    section_name, _, name = dotted.partition(".")
    sections = {f.name for f in dataclasses.fields(Config)}
    if section_name not in sections:
        raise ConfigError(f"unknown config section {section_name!r} in {dotted!r} "
                          f"(sections: {', '.join(sorted(sections))})")
    section = getattr(cfg, section_name)
    if section_name == "model" and name in ("", "preset"):
        apply_model_preset(cfg, value)
        return
    fields = _section_types(section)
    if name not in fields:
        raise ConfigError(f"unknown config key {dotted!r} "
                          f"(keys of {section_name}: {', '.join(fields)})")
    setattr(section, name, _coerce(dotted, value, fields[name]))
    cfg.given.add(dotted)


def apply_model_preset(cfg: Config, preset: Any) -> None:
    if not isinstance(preset, str) or preset not in MODEL_PRESETS:
        raise ConfigError(f"model: unknown preset {preset!r} "
                          f"(presets: {', '.join(MODEL_PRESETS)})")
    for key, value in MODEL_PRESETS[preset].items():
        setattr(cfg.model, key, value)
    cfg.preset = preset


def apply_dict(cfg: Config, data: dict[str, Any], source: str = "") -> None:
    """Apply a nested mapping (a parsed YAML file) to cfg."""
    where = f" in {source}" if source else ""
    if not isinstance(data, dict):
        raise ConfigError(f"config{where}: expected a mapping of sections, got {_short(data)}")
    for section_name, body in data.items():
        try:
            _apply_section(cfg, section_name, body)
        except ConfigError as err:
            raise ConfigError(f"{err}{where}") from None


def _apply_section(cfg: Config, section_name: Any, body: Any) -> None:
    if section_name == "model" and isinstance(body, str):
        apply_model_preset(cfg, body)
        return
    if not isinstance(body, dict):
        raise ConfigError(f"{section_name}: expected a mapping, got {_short(body)}")
    body = dict(body)
    if section_name == "model" and "preset" in body:  # the preset first, fields on top
        apply_model_preset(cfg, body.pop("preset"))
    for name, value in body.items():
        set_value(cfg, f"{section_name}.{name}", value)


def _short(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters (a whole mapping would make a long error line)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def resolve_config_path(name: str) -> Path | None:
    """A YAML (or JSON) path, or the name of a shipped config; None for a bare model preset."""
    path = Path(name)
    if path.suffix in (".yaml", ".yml", ".json") or path.exists():
        if not path.is_file():
            raise ConfigError(f"config file not found: {name}")
        return path
    shipped = CONFIG_DIR / f"{name}.yaml"
    if shipped.is_file():
        return shipped
    if name in MODEL_PRESETS:
        return None
    known = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")) + list(MODEL_PRESETS)
    raise ConfigError(f"unknown config {name!r} (a YAML or JSON path, or one of: {', '.join(known)})")


def _yaml_problem(err: yaml.YAMLError) -> str:
    """One line for a YAML parse error: what is wrong and where (PyYAML's own text is several)."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None)
    if problem and mark is not None:
        return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
    return " ".join(line.strip() for line in str(err).splitlines() if line.strip())


def load_yaml(path: Path) -> dict[str, Any]:
    """A config file's mapping: YAML, or JSON when its name ends in .json (read as JSON, strictly)."""
    try:
        text = path.read_text(encoding="utf-8")
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not valid JSON ({err.msg} at line {err.lineno}, column {err.colno})") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({_yaml_problem(err)})") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte offset {err.start})") from None
    except RecursionError:
        raise ConfigError(f"{path}: not valid YAML (nested too deeply)") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot be read ({err.strerror or err})") from None
    return data or {}


# The command line's words for configs, shared by every config-driven command's parser.
OVERRIDES_HELP = ("Any config field can be set with a dotted flag, e.g. --train.lr 1e-4 "
                  "--data.input corpus.txt --execution.precision bf16 (see `bertforge config`).")
CONFIG_HELP = (f"a config shipped in bertforge/configs (e.g. pretrain_base_128), a YAML path, "
               f"or a model preset ({', '.join(MODEL_PRESETS)})")


def positive_int(text: str) -> int:
    """An argparse ``type`` for counts such as ``--batch-size``: an integer of at least 1."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """``["--train.lr", "1e-4", "--data.synthetic"]`` → pairs. A flag with no value is true."""
    pairs: list[tuple[str, str]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(f"unexpected argument {arg!r} (overrides look like --train.lr 1e-4)")
        key = arg[2:]
        if "=" in key:
            key, value = key.split("=", 1)
            i += 1
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            value = args[i + 1]
            i += 2
        else:
            value = "true"
            i += 1
        pairs.append((key, value))
    return pairs


def given_length_wins(cfg: Config, overrides: Collection[str]) -> None:
    """Of ``train.steps`` and ``train.epochs``, the two ways to say how long a run goes (epochs
    win when both are set), the one the overrides give wins over the config file's other:
    ``--train.steps 100`` with a config that counts epochs trains 100 steps. So with the warm-up and
    ``wsd``'s decay: ``--train.warmup_steps 0`` (or ``--train.decay_steps N``) with a config that
    gives a share of the run (``warmup_proportion``) means those steps, none for 0, not the share."""
    if "train.steps" in overrides and "train.epochs" not in overrides:
        cfg.train.epochs = 0
    for length, share in (("warmup_steps", "warmup_proportion"), ("decay_steps", "decay_proportion")):
        if f"train.{length}" in overrides and f"train.{share}" not in overrides:
            setattr(cfg.train, share, 0.0)


def _mark(cfg: Config, frozen: bool) -> Config:
    for part in (cfg, *(getattr(cfg, f.name) for f in dataclasses.fields(cfg))):
        part.__dict__["_frozen"] = frozen
    return cfg


def freeze(cfg: Config) -> Config:
    """``cfg``, resolved, as a run reads it: a copy whose fields cannot be assigned."""
    return _mark(copy.deepcopy(cfg), True)


def replaced(cfg: Config, values: dict[str, Any]) -> Config:
    """A copy of ``cfg`` (frozen or not; the copy is not) with these dotted fields set to values the
    code decided (a resolved path, the records' shapes): no conversion, no ``given`` mark."""
    new = _mark(copy.deepcopy(cfg), False)
    for dotted, value in values.items():
        section, _, name = dotted.partition(".")
        if name not in _section_types(getattr(new, section)):
            raise KeyError(dotted)
        setattr(getattr(new, section), name, value)
    return new


def load_config(name: str | None = None, overrides: list[tuple[str, Any]] | None = None) -> Config:
    """Defaults, then the named YAML config or model preset, then dotted overrides."""
    cfg = Config()
    path: Path | None = None
    if name:
        path = resolve_config_path(name)
        if path is None:
            apply_model_preset(cfg, name)
        else:
            apply_dict(cfg, load_yaml(path), source=str(path))
    for key, value in overrides or []:
        set_value(cfg, key, value)
    given_length_wins(cfg, [key for key, _ in overrides or []])
    try:
        validate(cfg)
    except ConfigError as err:
        if path is None:
            raise
        # The values may come from the file or the command line: name both.
        raise ConfigError(f"{err} in {path}{' with the overrides' if overrides else ''}") from None
    return cfg


def config_from_dict(data: dict[str, Any]) -> Config:
    cfg = Config()
    apply_dict(cfg, data)
    validate(cfg)
    return cfg


# Ranges of single fields, checked by validate: (key, lowest, highest, what it means).
# A value outside its range would crash (ZeroDivisionError, an allocation, an
# index error) or silently do something else later, so it is refused at load.
_INT64_MAX = 2**63 - 1
_SEED_MAX = 2**32 - 1  # numpy's legacy seeding takes 32 bits
_INT_RANGES: dict[str, tuple[int, int]] = {
    "model.vocab_size": (1, _INT64_MAX),
    "model.hidden_size": (1, _INT64_MAX),
    "model.num_hidden_layers": (1, _INT64_MAX),
    "model.num_attention_heads": (1, _INT64_MAX),
    "model.intermediate_size": (1, _INT64_MAX),
    "model.max_position_embeddings": (1, _INT64_MAX),
    "model.type_vocab_size": (2, _INT64_MAX),  # every input uses segments 0 and 1
    "model.pad_token_id": (0, _INT64_MAX),
    "model.global_attn_every_n_layers": (1, _INT64_MAX),
    "model.local_attention": (1, _INT64_MAX),
    "data.vocab_size": (1, _INT64_MAX),
    "data.seq_len": (1, _INT64_MAX),
    "data.max_predictions": (1, _INT64_MAX),
    "data.dupe_factor": (1, _INT64_MAX),
    "data.seed": (0, _SEED_MAX),
    "data.shuffle_buffer": (0, _INT64_MAX),
    "data.prefetch": (0, _INT64_MAX),
    "data.reader_threads": (1, 1024),
    "train.micro_batch_size": (1, _INT64_MAX),
    "train.global_batch_size": (1, _INT64_MAX),
    "train.steps": (0, _INT64_MAX),
    "train.epochs": (0, _INT64_MAX),
    "train.warmup_steps": (0, _INT64_MAX),
    "train.exp_decay_steps": (1, _INT64_MAX),
    "train.decay_steps": (0, _INT64_MAX),
    "train.divergence_steps": (1, _INT64_MAX),
    "train.eval_every": (0, _INT64_MAX),
    "train.eval_batches": (0, _INT64_MAX),
    "train.eval_batch_size": (0, _INT64_MAX),
    "train.seed": (0, _SEED_MAX),
    "train.batch_size_warmup_min_size": (0, _INT64_MAX),
    "train.batch_size_warmup_tokens": (0, _INT64_MAX),
    "execution.threads": (0, 2**16),
    "execution.dist_timeout": (1, 2**31),
    "execution.pipeline_stages": (1, 2**16),
    "checkpoint.every": (0, _INT64_MAX),
    "checkpoint.keep": (0, _INT64_MAX),
    "log.every": (1, _INT64_MAX),
}
# (lowest, highest, whether the highest itself is allowed); every float must be finite.
_FLOAT_RANGES: dict[str, tuple[float, float, bool]] = {
    "model.hidden_dropout_prob": (0.0, 1.0, False),
    "model.attention_probs_dropout_prob": (0.0, 1.0, False),
    "model.classifier_dropout": (0.0, 1.0, False),
    "model.attention_output_dropout_prob": (0.0, 1.0, False),  # or None
    "model.initializer_range": (0.0, float("inf"), False),
    "data.masked_lm_prob": (0.0, 1.0, True),
    "data.short_seq_prob": (0.0, 1.0, True),
    "data.eval_fraction": (0.0, 1.0, False),
    "train.lr": (0.0, float("inf"), False),
    "train.weight_decay": (0.0, float("inf"), False),
    "train.beta1": (0.0, 1.0, False),
    "train.beta2": (0.0, 1.0, False),
    "train.max_trust_ratio": (0.0, float("inf"), False),
    "train.momentum": (0.0, 1.0, False),
    "train.warmup_proportion": (0.0, 1.0, True),
    "train.decay_power": (0.0, float("inf"), False),
    "train.end_lr": (0.0, float("inf"), False),
    "train.decay_proportion": (0.0, 1.0, True),
    "train.exp_decay_rate": (0.0, float("inf"), False),
    "train.grad_clip": (0.0, float("inf"), False),
    "train.loss_scale": (0.0, float("inf"), False),
    "train.divergence_factor": (0.0, float("inf"), False),
    "train.target_mlm_accuracy": (0.0, 1.0, True),
}
# Divided by, or a power's base (the rotary thetas), or a cutoff: 0 is not allowed.
_POSITIVE_FLOATS = ("model.layer_norm_eps", "model.global_rope_theta", "model.local_rope_theta",
                    "model.rope_scaling_factor",
                    "model.initializer_cutoff_factor", "train.eps", "train.loss_scale", "log.progress_every_s")


def _get(cfg: Config, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def _check_ranges(cfg: Config) -> None:
    """Each numeric field within its range (see _INT_RANGES and _FLOAT_RANGES)."""
    for key, (low, high) in _INT_RANGES.items():
        number = _get(cfg, key)
        if number < low:
            need = {0: "must not be negative", 1: "must be at least 1"}.get(low, f"must be at least {low}")
            raise ConfigError(f"{key}={number} {need}")
        if number > high:
            raise ConfigError(f"{key}={number} is too large (at most {high})")
    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(getattr(cfg, section.name)):
            key = f"{section.name}.{f.name}"
            value = _get(cfg, key)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{key}={value} is not a finite number")
    for key, (lowest, highest, highest_ok) in _FLOAT_RANGES.items():
        value = _get(cfg, key)
        if value is None:
            continue
        if value < lowest or value > highest or (value == highest and not highest_ok):
            raise ConfigError(f"{key}={value} must be in [{lowest:g}, {highest:g}{']' if highest_ok else ')'}")
    for key in _POSITIVE_FLOATS:
        if _get(cfg, key) <= 0:
            raise ConfigError(f"{key}={_get(cfg, key)} must be positive")
    for step, lr in cfg.train.lr_table.items():
        if step < 0 or not (math.isfinite(lr) and lr >= 0):
            raise ConfigError(f"train.lr_table[{step}]={lr}: steps must not be negative and "
                              "learning rates must be finite and not negative")


def profile_steps(text: str) -> tuple[int, int] | None:
    """``log.profile`` "START:END" as (START, END), the steps START..END-1 (from 0); None for ""."""
    if not text:
        return None
    begin, sep, end = text.partition(":")
    try:
        window = int(begin), int(end)
    except ValueError:
        window = (-1, -1)
    if not sep or window[0] < 0 or window[1] <= window[0]:
        raise ConfigError(f"log.profile={text!r}: expected START:END, steps from 0 with END > START, e.g. 20:25")
    return window


def validate(cfg: Config) -> None:
    """Single-field ranges, then cross-field checks, each naming the fields involved."""
    _check_ranges(cfg)
    profile_steps(cfg.log.profile)
    m = cfg.model
    if m.hidden_size % m.num_attention_heads:
        raise ConfigError(f"model.hidden_size={m.hidden_size} is not divisible by "
                          f"model.num_attention_heads={m.num_attention_heads}")
    if m.pad_token_id >= m.vocab_size:
        raise ConfigError(f"model.pad_token_id={m.pad_token_id} is not below model.vocab_size={m.vocab_size}")
    if cfg.data.seq_len > m.max_position_embeddings:
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} exceeds "
                          f"model.max_position_embeddings={m.max_position_embeddings}")
    if not 0 < cfg.data.max_predictions <= cfg.data.seq_len:
        raise ConfigError(f"data.max_predictions={cfg.data.max_predictions} must be in "
                          f"1..data.seq_len={cfg.data.seq_len}")
    if cfg.train.steps <= 0 and cfg.train.epochs <= 0:
        raise ConfigError("train.steps or train.epochs must be positive")
    if cfg.train.lr_table and cfg.train.schedule != "table":  # else the table would be silently unused
        raise ConfigError(f"train.lr_table is given but train.schedule={cfg.train.schedule}: the table is read only "
                          f"with train.schedule table")
    decay_fields = ("decay_steps", "decay_proportion") + (("decay_shape",) if cfg.train.decay_shape != "linear" else ())
    for key in decay_fields:
        if getattr(cfg.train, key) and cfg.train.schedule != "wsd":  # as the table: else silently unused
            raise ConfigError(f"train.{key} is given but train.schedule={cfg.train.schedule}: it is read only with "
                              f"train.schedule wsd (poly and poly_tf decay over the whole run)")
    if cfg.data.reader_threads > 1 and cfg.data.prefetch == 0:  # the readers read ahead: they would sit unused
        raise ConfigError(f"data.reader_threads={cfg.data.reader_threads} needs data.prefetch of at least 1 "
                          "(the reader threads read ahead; data.prefetch=0 reads in the training thread)")
    samples = cfg.train.eval_every_samples
    if samples != "mlperf" and samples < 0:
        raise ConfigError(f"train.eval_every_samples={samples} must not be negative (0 = off, or mlperf)")
    accumulation_steps(cfg.train, world_size=1)
    _check_batch_warmup(cfg)
    _check_family(cfg)
    _check_pipeline(cfg)
    _check_weights(cfg)
    _check_optimizer_in_backward(cfg)


def _check_batch_warmup(cfg: Config) -> None:
    """The batch-size warm-up needs both its fields, and refuses what counts samples as steps × the
    global batch (the world size's share is checked at launch, by training.engine.BatchWarmup)."""
    t = cfg.train
    if bool(t.batch_size_warmup_min_size) != bool(t.batch_size_warmup_tokens):
        raise ConfigError(f"train.batch_size_warmup_min_size={t.batch_size_warmup_min_size} and "
                          f"train.batch_size_warmup_tokens={t.batch_size_warmup_tokens}: set both, or neither")
    if not t.batch_size_warmup_min_size:
        return
    if t.batch_size_warmup_min_size % t.micro_batch_size:
        raise ConfigError(f"train.batch_size_warmup_min_size={t.batch_size_warmup_min_size} is not a multiple of "
                          f"train.micro_batch_size={t.micro_batch_size}")
    counted = {"train.epochs": t.epochs, "train.eval_every_samples": t.eval_every_samples, "log.mlperf": cfg.log.mlperf,
               "execution.pipeline_stages": cfg.execution.pipeline_stages > 1}
    for key, value in counted.items():
        if value:
            raise ConfigError(f"train.batch_size_warmup_min_size cannot be used with {key}={_get(cfg, key)} "
                              f"(its batches change size as the tokens read grow)")


def _check_family(cfg: Config) -> None:
    """The fields of the other family are refused where a file or an override gave them (they would
    be silently unused), and what ModernBERT does not have."""
    m = cfg.model
    for name in LEFT_OUT[m.family]:
        if f"model.{name}" in cfg.given and name != "family":
            raise ConfigError(f"model.{name} is not a field of model.family={m.family}")
    if m.family != "modernbert":
        return
    if cfg.train.objective != "mlm":
        raise ConfigError(f"model.family=modernbert has no next-sentence head: train.objective="
                          f"{cfg.train.objective} cannot be used; set train.objective mlm")
    if (m.hidden_size // m.num_attention_heads) % 2:
        raise ConfigError(f"model.family=modernbert: the head size model.hidden_size / model.num_attention_heads "
                          f"= {m.hidden_size // m.num_attention_heads} must be even (rotary embeddings turn pairs)")
    if cfg.execution.pipeline_stages > 1:
        raise ConfigError(f"execution.pipeline_stages={cfg.execution.pipeline_stages} cannot be used with "
                          f"model.family=modernbert (pipeline stages split BERT's encoder only); use 1")


def _check_optimizer_in_backward(cfg: Config) -> None:
    """What needs every gradient before the first update, or a reduced one, cannot step in the backward."""
    if not cfg.train.optimizer_in_backward:
        return
    ex, why = cfg.execution, ""
    if cfg.train.grad_clip > 0:
        why = (f"train.grad_clip={cfg.train.grad_clip:g} (global-norm clipping, as MLPerf's and NVIDIA's LAMB "
               f"do, needs every gradient before the first update); set train.grad_clip 0")
    elif ex.precision == "fp16":
        why = "execution.precision=fp16 (its loss scaler checks every gradient before the step); use bf16"
    elif ex.parallel != "none":
        why = (f"execution.parallel={ex.parallel} (the hook would step before the gradient is reduced); "
               f"use none")
    elif ex.pipeline_stages > 1:
        why = f"execution.pipeline_stages={ex.pipeline_stages} (stages step after the schedule's backward); use 1"
    elif cfg.train.loss_scale != 1.0:
        why = f"train.loss_scale={cfg.train.loss_scale:g} (the gradients are unscaled in the ordinary step); use 1"
    elif cfg.train.weights != "fp32":
        why = f"train.weights={cfg.train.weights} (not supported yet: the hooks step fp32 weights); use fp32"
    if why:
        raise ConfigError(f"train.optimizer_in_backward=true cannot be used with {why}")


def pipeline_layer_counts(ex: ExecutionConfig, num_layers: int) -> list[int]:
    """Encoder layers of each pipeline stage, the embeddings' own stages (0 layers) first: as
    ``hidden_layers_per_stage`` gives them, else as even as possible over the stages that hold layers,
    the first ``num_layers % stages`` of them one more. A ConfigError names what does not add up."""
    stages, placement, given = ex.pipeline_stages, ex.embeddings_placement, ex.hidden_layers_per_stage
    own = EMBEDDING_STAGES[placement]
    if given:
        if any(n < 1 for n in given) or sum(given) != num_layers:
            raise ConfigError(f"execution.hidden_layers_per_stage={given} must be counts of at least 1 that sum "
                              f"to model.num_hidden_layers={num_layers}")
        if own + len(given) != stages:
            extra = f" plus {own} of embeddings (execution.embeddings_placement={placement})" if own else ""
            raise ConfigError(f"execution.hidden_layers_per_stage={given} makes {len(given)} stages{extra}, "
                              f"but execution.pipeline_stages={stages}")
        return [0] * own + list(given)
    if own == 0 and stages > num_layers:
        raise ConfigError(f"execution.pipeline_stages={stages} exceeds model.num_hidden_layers={num_layers}: "
                          f"each stage needs at least one encoder layer")
    if not 1 <= stages - own <= num_layers:
        extra = f" after execution.embeddings_placement={placement}'s {own}" if own else ""
        raise ConfigError(f"execution.pipeline_stages={stages} leaves {stages - own} stages for "
                          f"model.num_hidden_layers={num_layers}{extra}: each needs at least one encoder layer")
    base, more = divmod(num_layers, stages - own)
    return [0] * own + [base + (1 if s < more else 0) for s in range(stages - own)]


def _check_pipeline(cfg: Config) -> None:
    """What execution.pipeline_stages cannot be combined with (the world size is checked at launch,
    by dist.check_execution)."""
    ex, stages = cfg.execution, cfg.execution.pipeline_stages
    if stages == 1:
        placed = {"hidden_layers_per_stage": ex.hidden_layers_per_stage,
                  "embeddings_placement": ex.embeddings_placement != "same_as_hidden_layers"}
        for key, value in placed.items():
            if value:  # else silently unused
                raise ConfigError(f"execution.{key}={getattr(ex, key)} needs execution.pipeline_stages > 1 "
                                  f"(it places pipeline stages)")
        return
    pipeline_layer_counts(ex, cfg.model.num_hidden_layers)
    if ex.parallel == "fsdp":
        raise ConfigError(f"execution.pipeline_stages={stages} cannot be used with execution.parallel=fsdp; "
                          f"use ddp (pipelines as data-parallel replicas) or none")
    if ex.precision == "fp16":
        raise ConfigError(f"execution.pipeline_stages={stages} cannot be used with execution.precision=fp16 "
                          f"(its loss scaler would need inf checks across stages); use bf16")
    if ex.compile is True:
        raise ConfigError(f"execution.pipeline_stages={stages} cannot be used with execution.compile=true "
                          f"(stages run eager; compile: auto does so)")
    if ex.fp8:
        raise ConfigError(f"execution.pipeline_stages={stages} cannot be used with execution.fp8=true "
                          f"(stages run eager bf16); use one of them")


def _check_weights(cfg: Config) -> None:
    """The combinations of train.weights, train.optimizer_state, stochastic rounding and the loss scale
    that make sense."""
    tr, ex = cfg.train, cfg.execution
    if tr.weights == "fp32":
        if tr.optimizer_state != "fp32":
            raise ConfigError(f"train.optimizer_state={tr.optimizer_state} needs train.weights bf16")
        if tr.stochastic_rounding:
            raise ConfigError("train.stochastic_rounding=true rounds bf16 weights: it needs train.weights bf16")
    else:
        if ex.precision != "bf16":
            raise ConfigError(f"train.weights=bf16 computes in bf16: execution.precision={ex.precision} "
                              f"cannot be used with it; set execution.precision bf16")
        for key, value, off in (("parallel", ex.parallel, "fsdp"), ("offload", ex.offload, True),
                                ("pipeline_stages", ex.pipeline_stages > 1, True)):
            if value == off:
                raise ConfigError(f"train.weights=bf16 cannot be used with execution.{key}={getattr(ex, key)} "
                                  f"(not supported: the optimizer rounds whole local tensors); use fp32 weights")
        if tr.optimizer == "sgd" or (tr.optimizer == "adamw" and tr.bias_correction):
            what = "sgd" if tr.optimizer == "sgd" else "adamw with train.bias_correction=true"
            raise ConfigError(f"train.weights=bf16 cannot be used with train.optimizer={what} (torch's, which "
                              f"rounds to nearest); use lamb, stableadamw or adamw without bias correction")
    if tr.scaled_optimizer_state and tr.optimizer == "sgd":
        raise ConfigError("train.scaled_optimizer_state=true needs an Adam-style optimizer (its eps absorbs "
                          "the scale); train.optimizer=sgd has none")
    if (tr.loss_scale != 1 or tr.scaled_optimizer_state) and ex.pipeline_stages > 1:
        raise ConfigError(f"train.loss_scale={tr.loss_scale:g} (or train.scaled_optimizer_state) cannot be used "
                          f"with execution.pipeline_stages={ex.pipeline_stages}; use 1")
