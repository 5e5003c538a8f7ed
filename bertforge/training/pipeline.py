"""Pipeline parallelism: BERT's encoder layers split over ranks, run by ``torch.distributed.pipelining``.

    torchrun --nproc-per-node 2 -m bertforge pretrain --execution.pipeline_stages 2
    torchrun --nproc-per-node 4 -m bertforge pretrain --execution.pipeline_stages 2 --execution.parallel ddp

``execution.pipeline_stages`` S > 1 splits ``BertForPreTraining`` into S
stages of consecutive encoder layers (:func:`stage_layers`: as even as
possible, the first stages take one layer more when S does not divide the
layers); stage 0 also holds the embeddings, the last stage the pooler, the
heads and its own copy of the word embeddings (the MLM decoder's tied
weight). Graphcore's TF1 BERT placement (``config.pipeline_layer_counts``):
``execution.hidden_layers_per_stage`` gives the layers of each stage that holds
layers, and ``execution.embeddings_placement`` puts the embeddings with the
first layers (``same_as_hidden_layers``), on a stage of their own
(``same_ipu``) or the word lookup on stage 0 and the rest of the embeddings
on stage 1 (``two_ipus``, :class:`EmbeddingsAfterLookup`). The W ranks
form W / S pipelines (data-parallel replicas): rank r runs stage r mod S of
replica r // S (a ``DeviceMesh`` of dims dp × pp).
With ``execution.parallel: ddp`` the replicas average each stage's gradients
over its dp group after the schedule's backward, in all-reduces of 25 MiB
buckets (DDP itself is not used: torch's pipelining runs a metadata forward
through the stage module that leaves DDP's reducer expecting a backward);
``none`` needs W = S; ``fsdp`` is refused.

One step: each replica's ``accumulation`` micro-batches are the schedule's
micro-batches, run by ``ScheduleGPipe`` (every forward, then every backward)
or ``Schedule1F1B`` (``execution.pipeline_schedule``), built on a
``PipelineStage`` per rank. Only the hidden states travel between stages
(with the RNG state, below); every rank of a pipeline reads the same
micro-batches and hands its stage what it needs of them (masks, positions)
as keyword arguments, which the schedule chunks with the inputs. The labels
reach the schedule's ``loss_fn`` as one float64 tensor (:func:`pack_targets`:
exact for ids below 2⁵³ and fp32 weights).

Equality with one process: ``loss_fn`` is ``pretraining_loss``'s per-micro-
batch mean; the schedule sums the micro-batches' gradients and divides them
by their number (``scale_grads``), which is the engine's ``loss /
accumulation``. Dropout: stage 0 seeds each micro-batch as the engine does
(``micro_batch_seed``) and every stage hands the generator's state on to the
next with the hidden states, so the masks are those of the unsplit model.
The tied word embedding's two gradients are summed over the first and last
stage before the step, so both copies take the same update; the global
gradient norm sums every stage's squares (the copy counted once).

Checkpoints are those of one process: the stages' weights and optimizer
states are gathered on rank 0 by name and written as one model and one
optimizer state (:meth:`PipelineEngine.full_state`), so a pipeline run
resumes in any mode and any mode's full checkpoint (not FSDP's shards)
resumes here. Evaluation runs forward only through the pipeline
(:meth:`PipelineEngine.evaluate`). Packed rows and the masked-LM-only model
work as without stages. Refused with stages (config.py): FSDP, fp16 (its loss
scaler would need inf checks across stages), ``compile: true`` (the stages
run eager; ``auto`` does so).
"""

from __future__ import annotations

import math
import typing
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bertforge.config import ConfigError, ExecutionConfig, PipelineSchedule, TrainConfig, pipeline_layer_counts
from bertforge.data.feed import widen
from bertforge.models.bert import (
    BertEmbeddings,
    BertForPreTraining,
    BertPooler,
    BertPreTrainingHeads,
    Mask,
    eval_result,
    eval_sums,
    layers_mask,
    pretraining_loss,
    set_attention_backends,
    set_vocab_multiple,
)
from bertforge.observe.log import pass_progress
from bertforge.parallel.dist import DistContext, apply_recompute, attention_backends

from .engine import Engine, autocast, micro_batch_seed, to_device
from .optim import param_groups

SCHEDULES: tuple[str, ...] = typing.get_args(PipelineSchedule)  # 1f1b, gpipe
BUCKET_BYTES = 25 << 20  # gradients averaged over the pipelines per all-reduce (parallel/plan.py plans one such bucket)
TIED = "bert.embeddings.word_embeddings.weight"  # the weight stage 0 and the last stage both hold
# The batch fields each kind of stage takes as keyword arguments (those a batch has).
_FIRST_INPUTS = ("token_type_ids", "position_ids")
_EVERY_INPUTS = ("attention_mask", "sequence_ids")
_LAST_INPUTS = ("masked_lm_positions", "cls_positions")
# What pretraining_loss reads besides the logits: packed into the schedule's target.
TARGET_KEYS = ("masked_lm_ids", "masked_lm_weights", "next_sentence_labels", "next_sentence_weights")
TargetLayout = tuple[tuple[str, torch.Size, torch.dtype], ...]  # (field, shape after the rows, dtype)


def stage_layers(num_layers: int, stages: int) -> list[range]:
    """The encoder layers of each stage: consecutive, as even as possible, the first
    ``num_layers % stages`` stages one layer more (the last stage also runs the heads)."""
    if not 1 <= stages <= num_layers:
        raise ConfigError(f"model.num_hidden_layers={num_layers} cannot be split over "
                          f"execution.pipeline_stages={stages}: each stage needs at least one layer")
    base, extra = divmod(num_layers, stages)
    bounds = [0]
    for s in range(stages):
        bounds.append(bounds[-1] + base + (1 if s < extra else 0))
    return [range(bounds[s], bounds[s + 1]) for s in range(stages)]


def check_micro_batches(execution: ExecutionConfig, micro_batches: int) -> None:
    """1F1B starts a backward only after every stage ran a forward: it needs ≥ stages micro-batches."""
    stages = execution.pipeline_stages
    if stages > 1 and execution.pipeline_schedule == "1f1b" and micro_batches < stages:
        raise ConfigError(f"execution.pipeline_schedule=1f1b needs at least execution.pipeline_stages={stages} "
                          f"micro-batches per step and pipeline, got {micro_batches} (train.global_batch_size / "
                          f"(train.micro_batch_size × pipelines)); raise train.global_batch_size or use gpipe")


def data_split(execution: ExecutionConfig, ctx: DistContext) -> tuple[int, int]:
    """(this rank's index among the ranks that split the data, their number): every rank without
    stages; with them the pipelines, whose stages all read the same micro-batches."""
    stages = max(execution.pipeline_stages, 1)
    return ctx.rank // stages, max(ctx.world_size // stages, 1)


# ------------------------------------------------------------ layout

@dataclass
class PipelineLayout:
    """This rank's place in the dp × pp mesh and the process groups it talks over.

    ``stage`` of ``stages`` in pipeline ``replica`` of ``replicas``; ``pp_group`` is the ranks
    of this pipeline, ``dp_group`` the ranks of this stage in every pipeline (None for one
    pipeline), ``tied_group`` the first and last rank of this pipeline (the tied embedding).
    """

    stages: int
    stage: int
    replicas: int
    replica: int
    pp_group: Any = None
    dp_group: Any = None
    tied_group: Any = None

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1


def make_layout(ctx: DistContext, stages: int) -> PipelineLayout:
    """The mesh of ``ctx.world_size`` ranks as ``world / stages`` pipelines of ``stages`` ranks;
    a collective: every rank calls it."""
    from torch.distributed.device_mesh import init_device_mesh

    if stages < 2 or ctx.world_size % stages:
        raise ConfigError(f"execution.pipeline_stages={stages} needs a multiple of {stages} ranks, "
                          f"got {ctx.world_size}")
    replicas = ctx.world_size // stages
    mesh = init_device_mesh(ctx.device.type, (replicas, stages), mesh_dim_names=("dp", "pp"))
    tied_group = None
    for replica in range(replicas):  # every rank makes every group, in the same order
        ends = [replica * stages, replica * stages + stages - 1]
        group = dist.new_group(ends)
        if ctx.rank in ends:
            tied_group = group
    return PipelineLayout(stages=stages, stage=ctx.rank % stages, replicas=replicas, replica=ctx.rank // stages,
                          pp_group=mesh.get_group("pp"), dp_group=mesh.get_group("dp") if replicas > 1 else None,
                          tied_group=tied_group)


# ------------------------------------------------------------ the stage module

class StageEncoder(nn.Module):
    """A stage's encoder layers, under their indices in the whole model (``layer.5`` stays ``layer.5``)."""

    def __init__(self, layers: dict[int, nn.Module]):
        super().__init__()
        self.layer = nn.ModuleDict({str(i): layer for i, layer in layers.items()})

    def forward(self, x: torch.Tensor, mask: Mask) -> torch.Tensor:
        for layer in self.layer.values():
            x = layer(x, mask)
        return x


class WordEmbeddings(nn.Module):
    """The last stage's copy of the word embeddings (the MLM decoder's tied weight), named as in the model."""

    def __init__(self, word_embeddings: nn.Embedding):
        super().__init__()
        self.word_embeddings = word_embeddings


class EmbeddingsAfterLookup(nn.Module):
    """What ``BertEmbeddings`` does after the word lookup (two_ipus' second stage), named as in the model:
    the same sum in the same order, LayerNorm and dropout."""

    def __init__(self, embeddings: BertEmbeddings):
        super().__init__()
        self.position_embeddings = embeddings.position_embeddings
        self.token_type_embeddings = embeddings.token_type_embeddings
        self.LayerNorm = embeddings.LayerNorm
        self.dropout = embeddings.dropout

    def forward(self, words: torch.Tensor, token_type_ids: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            positions = self.position_embeddings.weight[:words.shape[1]]
        else:
            positions = self.position_embeddings(position_ids)
        x = words + self.token_type_embeddings(token_type_ids) + positions
        return self.dropout(self.LayerNorm(x))


class StageTrunk(nn.Module):
    """What a stage holds of ``BertModel``, under the same names."""

    def __init__(self, embeddings: nn.Module | None, encoder: StageEncoder, pooler: BertPooler | None):
        super().__init__()
        self.embeddings = embeddings
        self.encoder = encoder
        self.pooler = pooler


def _rng_state(device: torch.device) -> torch.Tensor:
    """The state of the generator that dropout draws from on ``device``, as a tensor on it."""
    state = torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()
    return state.to(device)


def _set_rng_state(state: torch.Tensor, device: torch.device) -> None:
    try:
        if device.type == "cuda":
            torch.cuda.set_rng_state(state.cpu(), device)
        else:
            torch.set_rng_state(state.cpu())
    except RuntimeError:
        # Only torch.distributed.pipelining's metadata pass hands over bytes that are no generator state:
        # it runs each stage once, under a forked RNG, on uninitialised tensors of the right shapes.
        # The micro-batches always carry the state the stage before left.
        pass


class BertStage(nn.Module):
    """Stage ``index`` of ``stages`` of a ``BertForPreTraining``, its modules taken from ``model``.

    Parameter names are the whole model's (``bert.encoder.layer.7.…``), so a stage loads its part
    of a full state dict by name. ``forward(x, rng, **batch_fields)``: stage 0 takes the input ids;
    the others take the hidden states and the RNG state the stage before returned. Stages before the
    last return ``(hidden states, RNG state)``, the last ``(mlm_logits, nsp_logits)`` as the model does.
    """

    def __init__(self, model: BertForPreTraining, index: int, stages: int, layer_counts: list[int] | None = None,
                 placement: str = "same_as_hidden_layers"):
        super().__init__()
        if not 0 <= index < stages:
            raise ValueError(f"stage {index} of {stages}")
        self.config = model.config
        self.model_class = type(model)  # (whose parameter order a full optimizer state follows)
        self.next_sentence: bool = getattr(model, "next_sentence", True)  # False: BertForMaskedLM
        self.index, self.stages = index, stages
        self.is_first, self.is_last = index == 0, index == stages - 1
        counts = layer_counts or [len(r) for r in stage_layers(model.config.num_hidden_layers, stages)]
        start = sum(counts[:index])
        self.layers = range(start, start + counts[index])
        # two_ipus: the word embeddings alone on stage 0, the positions, segments and LayerNorm on stage 1.
        self.finishes_embeddings = index == (1 if placement == "two_ipus" else 0)
        bert = model.bert
        embeddings: nn.Module | None = bert.embeddings if self.is_first and self.finishes_embeddings else None
        if (self.is_last or self.is_first) and embeddings is None:
            embeddings = WordEmbeddings(bert.embeddings.word_embeddings)
        elif self.finishes_embeddings and not self.is_first:
            embeddings = EmbeddingsAfterLookup(bert.embeddings)
        encoder = StageEncoder({i: bert.encoder.layer[i] for i in self.layers})
        self.bert = StageTrunk(embeddings, encoder, bert.pooler if self.is_last else None)
        # The heads keep their tie: cls.predictions reads the word embeddings module held above.
        self.cls: BertPreTrainingHeads | None = model.cls if self.is_last else None
        # execution.precision: the forward runs under autocast, as Engine.step runs the model's; the
        # schedule's backward, outside it, as Engine's (a backward under autocast rounds otherwise).
        self.precision = "fp32"
        self.flex = False  # masks as FlexAttention block masks, as BertModel's (set_attention_backends)

    @property
    def inputs(self) -> tuple[str, ...]:
        """The batch fields this stage takes as keyword arguments."""
        return ((_FIRST_INPUTS if self.finishes_embeddings else ()) + (_EVERY_INPUTS if self.layers else ())
                + (_LAST_INPUTS if self.is_last else ()))

    def forward(self, x: torch.Tensor, rng: torch.Tensor | None = None, *,
                token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, sequence_ids: torch.Tensor | None = None,
                masked_lm_positions: torch.Tensor | None = None, cls_positions: torch.Tensor | None = None,
                seeds: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        with autocast(x.device, self.precision):
            return self._forward(x, rng, token_type_ids, position_ids, attention_mask, sequence_ids,
                                 masked_lm_positions, cls_positions, seeds)

    def _forward(self, x: torch.Tensor, rng: torch.Tensor | None, token_type_ids: torch.Tensor | None,
                 position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
                 sequence_ids: torch.Tensor | None, masked_lm_positions: torch.Tensor | None,
                 cls_positions: torch.Tensor | None,
                 seeds: torch.Tensor | None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.is_first:
            if seeds is not None:  # this micro-batch's dropout seed, as Engine.step sets it
                torch.manual_seed(int(seeds[0]))
            input_ids = x
            if not self.finishes_embeddings:  # two_ipus: the lookup alone
                assert isinstance(self.bert.embeddings, WordEmbeddings)
                x = self.bert.embeddings.word_embeddings(x)
        elif rng is not None:
            _set_rng_state(rng, x.device)
        if self.finishes_embeddings:
            token_types = torch.zeros_like(x if self.is_first else x[..., 0], dtype=torch.long) \
                if token_type_ids is None else token_type_ids
            if self.is_first:
                assert isinstance(self.bert.embeddings, BertEmbeddings)
                x = self.bert.embeddings(input_ids, token_types, position_ids)
            else:
                assert isinstance(self.bert.embeddings, EmbeddingsAfterLookup)
                x = self.bert.embeddings(x, token_types, position_ids)
        if self.layers:
            x = self.bert.encoder(x, layers_mask(x, attention_mask, sequence_ids, self.config, self.flex,
                                                 self.training))
        if not self.is_last:
            return x, _rng_state(x.device)
        assert self.cls is not None
        pooled = self.bert.pooler(x, cls_positions) if self.bert.pooler is not None else None
        if masked_lm_positions is not None:
            x = torch.gather(x, 1, masked_lm_positions.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        mlm_logits = self.cls.predictions(x)
        if self.cls.seq_relationship is None or pooled is None:  # masked LM alone: one output
            return mlm_logits
        return mlm_logits, self.cls.seq_relationship(pooled)


def tied_weight(stage: nn.Module) -> nn.Parameter | None:
    """The word embedding weight of a first or last stage (the tied one), else None."""
    return dict(stage.named_parameters()).get(TIED)


def prepare_stage(stage: BertStage, execution: ExecutionConfig, ctx: DistContext) -> BertStage:
    """The stage as training runs it (dist.prepare_model's counterpart): recomputation, attention
    kernels, autocast, on the device."""
    apply_recompute(stage, execution.recompute)
    set_attention_backends(stage, attention_backends(execution, ctx.device,
                                                     stage.config.attention_probs_dropout_prob))
    set_vocab_multiple(stage, 64 if ctx.device.type == "cuda" else 1)
    stage.precision = execution.precision
    return stage.to(ctx.device)


# ------------------------------------------------------------ targets

def pack_targets(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, TargetLayout]:
    """The labels pretraining_loss reads, as one (B, K) float64 tensor (the schedule's ``target``,
    which it splits by rows like the inputs), and the layout that :func:`unpack_targets` reads back."""
    rows = batch["masked_lm_ids"].shape[0]
    keys = [k for k in TARGET_KEYS if k in batch]
    layout = tuple((k, batch[k].shape[1:], batch[k].dtype) for k in keys)
    packed = torch.cat([batch[k].reshape(rows, -1).to(torch.float64) for k in keys], dim=1)
    return packed, layout


def unpack_targets(packed: torch.Tensor,
                   layout: TargetLayout) -> dict[str, torch.Tensor]:
    out, start = {}, 0
    for key, shape, dtype in layout:
        width = math.prod(shape)
        out[key] = packed[:, start:start + width].reshape(-1, *shape).to(dtype)
        start += width
    return out


# ------------------------------------------------------------ the engine

def _unused_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    raise NotImplementedError("a pipeline computes its loss in the schedule (PipelineEngine.step)")


class PipelineEngine(Engine):
    """:class:`~bertforge.training.engine.Engine` for one stage of a pipeline: ``step`` runs the
    schedule over a replica's micro-batches and returns what Engine.step returns (the
    losses, means over micro-batches and replicas, and the global gradient norm) on every
    rank. ``model`` is this rank's stage (``prepare_stage``); ``optimizer`` covers its
    parameters."""

    def __init__(self, model: BertStage, layout: PipelineLayout, schedule: str,
                 optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
                 precision: str, grad_clip: float, dist_ctx: DistContext, seed: int | None = None):
        if precision == "fp16":
            raise ConfigError("execution.precision=fp16 is not supported with execution.pipeline_stages > 1 "
                              "(its loss scaler would need inf checks across stages); use bf16")
        if schedule not in SCHEDULES:
            raise ConfigError(f"execution.pipeline_schedule: {schedule!r} is not one of {', '.join(SCHEDULES)}")
        super().__init__(model, optimizer, scheduler, _unused_loss, precision, grad_clip, dist_ctx, seed)
        self.layout, self.schedule_name = layout, schedule
        self.stage_module = model
        self._schedule: Any = None
        self._micro_batches = 0
        self._records: list[dict[str, torch.Tensor]] = []
        self._target_layout: TargetLayout = ()
        self._eval_schedules: dict[tuple[int, ...], Any] = {}
        tied = tied_weight(model)
        self._tied = tied if layout.tied_group is not None else None

    # -------- the schedule

    def _build_schedule(self, micro_batches: int) -> Any:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        stage = PipelineStage(self.model, self.layout.stage, self.layout.stages, self.device,
                              group=self.layout.pp_group)
        kind = Schedule1F1B if self.schedule_name == "1f1b" else ScheduleGPipe
        # scale_grads: the micro-batches' summed gradients are divided by their number.
        return kind(stage, micro_batches, loss_fn=self._loss, scale_grads=True)

    def _loss(self, outputs: torch.Tensor | tuple[torch.Tensor, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss_fn on the last stage: one micro-batch's mean loss; the rest of
        pretraining_loss's results are kept for the step's metrics."""
        mlm_logits, nsp_logits = _logits(outputs)
        with autocast(self.device, self.precision):  # as Engine.step computes it (not the backward)
            out = pretraining_loss(mlm_logits, nsp_logits, unpack_targets(target, self._target_layout))
        self._records.append({k: v.detach() for k, v in out.items()})
        return out["loss"]

    def _stage_inputs(self, batches: list[dict[str, torch.Tensor]]) -> tuple[tuple[torch.Tensor, ...],
                                                                              dict[str, torch.Tensor]]:
        """(positional inputs, keyword inputs) of the whole step, which the schedule chunks back
        into the micro-batches (equal rows: ``tensor_split`` gives each one exactly)."""
        kwargs = {}
        for key in self.stage_module.inputs:
            have = [key in b for b in batches]
            if not any(have):
                continue
            if not all(have) and key != "attention_mask":
                raise ValueError(f"batch field {key} is in some micro-batches of a step and not in others")
            # A micro-batch without padding comes without a mask; beside masked ones it gets one of ones
            # (the schedule chunks one set of keyword arguments): a zero bias, the same attention.
            kwargs[key] = torch.cat([b[key] if key in b else torch.ones_like(b["input_ids"], dtype=torch.uint8)
                                     for b in batches])
        args = (torch.cat([b["input_ids"] for b in batches]),) if self.layout.is_first else ()
        return args, kwargs

    def step(self, micro_batches: Iterable[dict[str, torch.Tensor]], accumulation: int,
             step: int = 0) -> dict[str, torch.Tensor]:
        """Forward and backward over this replica's ``accumulation`` micro-batches through the
        schedule, then one optimizer step of this stage; the losses and the gradient norm as
        Engine.step returns them, on every rank."""
        totals = self.forward_backward(micro_batches, accumulation, step)
        stop = totals.pop("stop")
        totals["grad_norm"] = self._apply_gradients(totals, step, stop)
        return totals

    def forward_backward(self, micro_batches: Iterable[dict[str, torch.Tensor]], accumulation: int,
                         step: int = 0) -> dict[str, torch.Tensor]:
        """The schedule's forward and backward, leaving this stage's gradients (summed over the
        tied copies, averaged over the pipelines) in ``.grad``; the losses and the preemption
        flag (``stop``) on every rank."""
        batches = [widen(to_device(b, self.device)) for b in micro_batches]
        if len(batches) != accumulation:
            raise ValueError(f"step {step}: got {len(batches)} micro-batches, expected {accumulation}")
        if self._schedule is None or self._micro_batches != accumulation:
            self._schedule, self._micro_batches = self._build_schedule(accumulation), accumulation
        layout = self.layout
        args, kwargs = self._stage_inputs(batches)
        if layout.is_first and self.seed is not None:
            seed = self.seed
            kwargs["seeds"] = torch.tensor([micro_batch_seed(seed, step, layout.replica + i * layout.replicas)
                                            for i in range(accumulation)])
        target = None
        if layout.is_last:
            target, self._target_layout = pack_targets({k: torch.cat([b[k] for b in batches])
                                                        for k in TARGET_KEYS if k in batches[0]})
        self._records.clear()
        self._schedule.step(*args, target=target, return_outputs=False, **kwargs)
        self._sum_tied_gradient()
        self._average_over_pipelines()
        keys = ["loss", "mlm_loss"] + (["nsp_loss"] if self.stage_module.next_sentence else [])
        keys += ["sequences"] if "sequence_ids" in batches[0] else []
        # The metadata pass of the first step calls loss_fn once more, before the micro-batches.
        records = self._records[-accumulation:] if layout.is_last else []
        return self._mean_over_pipelines(keys, records, accumulation)

    def _mean_over_pipelines(self, keys: list[str], records: list[dict[str, torch.Tensor]],
                             accumulation: int) -> dict[str, torch.Tensor]:
        """Each key's mean over the micro-batches (on the last stage) and the pipelines, on every
        rank, with the preemption flag (``stop``: summed), in one all-reduce over the world."""
        values = torch.zeros(len(keys) + 1, device=self.device)
        source = {"sequences": "nsp_count"}
        for record in records:
            values[:-1] += torch.stack([record[source.get(k, k)].float() for k in keys]) / accumulation
        values[-1] = float(self.preemption is not None and self.preemption.requested)
        dist.all_reduce(values)  # the last stage of each pipeline holds the losses; the others add zeros
        means = values[:-1] / self.layout.replicas
        return {**dict(zip(keys, means.unbind())), "stop": values[-1]}

    def _sum_tied_gradient(self) -> None:
        """The tied word embedding: stage 0's gradient (embedding lookup) plus the last stage's (MLM
        decoder), on both, as one process accumulates them into the one weight."""
        tied = self._tied
        if tied is None:
            return
        if tied.grad is None:
            tied.grad = torch.zeros_like(tied)
        dist.all_reduce(tied.grad, group=self.layout.tied_group)

    def _average_over_pipelines(self) -> None:
        """Data parallelism: each gradient of this stage averaged over the pipelines (its dp group),
        in all-reduces of flat buckets of at most ``BUCKET_BYTES``."""
        if self.layout.dp_group is None:
            return
        buckets: list[list[torch.Tensor]] = []
        size = 0
        for grad in (p.grad for p in self.stage_module.parameters() if p.grad is not None):
            nbytes = grad.numel() * grad.element_size()
            if not buckets or buckets[-1][0].dtype != grad.dtype or size + nbytes > BUCKET_BYTES:
                buckets.append([])
                size = 0
            buckets[-1].append(grad)
            size += nbytes
        for bucket in buckets:
            if len(bucket) == 1:  # (a gradient larger than a bucket is reduced in place)
                flat = bucket[0]
            else:
                flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat, group=self.layout.dp_group)
            flat /= self.layout.replicas
            if len(bucket) > 1:
                for grad, part in zip(bucket, flat.split([g.numel() for g in bucket])):
                    grad.copy_(part.view_as(grad))

    def _total_norm(self, params: list[nn.Parameter]) -> torch.Tensor:
        """The norm of every stage's gradients together, the tied weight's once (stage 0's)."""
        skip = self._tied if self.layout.is_last else None
        grads = [p.grad for p in params if p.grad is not None and p is not skip]
        squares = torch.nn.utils.get_total_norm(grads).square() if grads else torch.zeros((), device=self.device)
        squares = squares.float()
        dist.all_reduce(squares, group=self.layout.pp_group)
        return squares.sqrt()

    # -------- evaluation

    @torch.no_grad()
    def evaluate(self, dataset: Any, batch_size: int, max_batches: int = 0) -> dict[str, float]:
        """``train.evaluate`` through the pipeline, forward only: every pipeline evaluates the
        whole set (as every rank does without stages); each batch shape gets a forward-only
        schedule of one micro-batch."""
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        model, layout = self.model, self.layout
        was_training = model.training
        model.eval()
        sums = torch.zeros(6, dtype=torch.float64)  # mlm_correct, mlm_count, nsp_correct, nsp_count, losses
        starts = range(0, len(dataset), batch_size)
        if max_batches > 0:
            starts = starts[:max_batches]
        try:
            with pass_progress(len(starts)) as advance:  # shown when a Stage is around
                for start in starts:
                    indices = torch.arange(start, min(start + batch_size, len(dataset))).numpy()
                    batch = widen(to_device(dataset.batch(indices), self.device))
                    shape = tuple(batch["input_ids"].shape)
                    schedule: Any = self._eval_schedules.get(shape)
                    if schedule is None:
                        stage = PipelineStage(model, layout.stage, layout.stages, self.device, group=layout.pp_group)
                        schedule = self._eval_schedules[shape] = ScheduleGPipe(stage, 1)
                    args = (batch["input_ids"],) if layout.is_first else ()
                    kwargs = {k: batch[k] for k in self.stage_module.inputs if k in batch}
                    outputs = schedule.step(*args, **kwargs)
                    if layout.is_last:
                        with autocast(self.device, self.precision):
                            out = pretraining_loss(*_logits(outputs), batch)
                        sums += torch.tensor(eval_sums(out), dtype=torch.float64)
                    advance(1)
        finally:
            model.train(was_training)
        sums = sums.to(self.device)
        dist.all_reduce(sums)  # the last stages' sums; every pipeline evaluated the whole set
        return eval_result((sums / layout.replicas).tolist(), self.stage_module.next_sentence)

    # -------- checkpoints: the whole model's state, by name

    def _named_optimizer_state(self) -> dict[str, Any]:
        """This stage's optimizer state keyed by parameter name (groups: their settings and names)."""
        names = {id(p): n for n, p in self.stage_module.named_parameters()}
        order = [names[id(p)] for group in self.optimizer.param_groups for p in group["params"]]
        state = self.optimizer.state_dict()
        return {"state": {order[i]: s for i, s in state["state"].items()},
                "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in state["param_groups"]]}

    def full_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
        """(the whole model's state dict, the optimizer state one process would have) on rank 0,
        None on the others; a collective. The first pipeline's stages hand theirs to rank 0."""
        mine = None
        if self.layout.replica == 0:
            model_state = {k: v.detach().cpu() for k, v in self.stage_module.state_dict().items()}
            optimizer_state = _to_cpu(self._named_optimizer_state())
            mine = (model_state, optimizer_state)
        gathered: list[Any] | None = [None] * self.dist.world_size if self.dist.is_main else None
        dist.gather_object(mine, gathered, dst=0)
        if gathered is None:
            return None
        parts = gathered[:self.layout.stages]  # the first pipeline's stages
        model_state = {}
        by_name: dict[str, Any] = {}
        groups: list[dict[str, Any]] = []
        for part in parts:  # stage order: the tied weight and its state come from stage 0
            for key, value in part[0].items():
                model_state.setdefault(key, value)
            for name, value in part[1]["state"].items():
                by_name.setdefault(name, value)
            groups = groups or [{k: v for k, v in g.items() if k != "params"} for g in part[1]["param_groups"]]
        order = full_parameter_order(self.stage_module, groups)
        index = {name: i for i, name in enumerate(n for names in order for n in names)}
        optimizer_state = {"state": {index[name]: value for name, value in by_name.items()},
                           "param_groups": [{**settings, "params": [index[n] for n in names]}
                                            for settings, names in zip(groups, order)]}
        return model_state, optimizer_state

    def load_full_state(self, model_state: dict[str, torch.Tensor], optimizer_state: dict[str, Any],
                        source: str) -> None:
        """Load a full checkpoint (one process's model and optimizer state) into this stage."""
        from bertforge.runs import CheckpointError

        own = self.stage_module.state_dict()
        missing = [k for k in own if k not in model_state]
        if missing:
            raise CheckpointError(f"{source}: lacks {', '.join(missing[:5])}")
        for key, value in own.items():
            if value.shape != model_state[key].shape:
                raise CheckpointError(f"{source}: weight {key} has shape {tuple(model_state[key].shape)} in the "
                                      f"checkpoint but the model expects {tuple(value.shape)}")
        self.stage_module.load_state_dict({k: model_state[k] for k in own})
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer_state["param_groups"]]
        order = full_parameter_order(self.stage_module, groups)
        names = [n for group_names in order for n in group_names]
        if len(names) != sum(len(g["params"]) for g in optimizer_state["param_groups"]):
            raise CheckpointError(f"{source}: its optimizer state does not fit this model")
        by_name = {names[i]: s for i, s in optimizer_state["state"].items()}
        own_names = {id(p): n for n, p in self.stage_module.named_parameters()}
        stage_order = [own_names[id(p)] for group in self.optimizer.param_groups for p in group["params"]]
        position = {n: i for i, n in enumerate(stage_order)}
        stage_groups = []
        for settings, group in zip(groups, self.optimizer.param_groups):
            stage_groups.append({**settings, "params": [position[own_names[id(p)]] for p in group["params"]]})
        state = {"state": {position[n]: by_name[n] for n in stage_order if n in by_name},
                 "param_groups": stage_groups}
        try:
            self.optimizer.load_state_dict(state)
        except (ValueError, KeyError, TypeError, IndexError) as err:
            raise CheckpointError(f"{source}: its optimizer state does not fit this optimizer ({err})") from None


def _logits(outputs: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(mlm_logits, nsp_logits or None) from the last stage's outputs."""
    if isinstance(outputs, torch.Tensor):
        return outputs, None
    return outputs[0], outputs[1]


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj


def full_parameter_order(stage: BertStage, groups: list[dict[str, Any]]) -> list[list[str]]:
    """The parameter names of each optimizer group of the whole model ``stage`` was taken from, in
    the order one process's optimizer lists them (``optim.param_groups``: decay, then no decay, in
    model order)."""
    with torch.device("meta"):
        model = stage.model_class(stage.config)
    names = {id(p): n for n, p in model.named_parameters()}
    order = [[names[id(p)] for p in group["params"]] for group in param_groups(model, 0.0)]
    if len(order) != len(groups):
        raise ValueError(f"{len(groups)} optimizer groups, expected {len(order)}")
    return order


def build_engine(model: nn.Module, execution: ExecutionConfig, train: TrainConfig,
                 ctx: DistContext, total_steps: int) -> PipelineEngine:
    """This rank's stage of ``model`` (a BertForPreTraining, built alike on every rank), prepared,
    with its optimizer and schedule: training/pretrain.py's counterpart of prepare_model + Engine."""
    from .optim import build_optimizer, build_scheduler

    if not isinstance(model, BertForPreTraining):
        raise TypeError(f"pipeline stages are made of a BertForPreTraining, not a {type(model).__name__}")

    layout = make_layout(ctx, execution.pipeline_stages)
    counts = pipeline_layer_counts(execution, model.config.num_hidden_layers)
    stage = prepare_stage(BertStage(model, layout.stage, layout.stages, counts, execution.embeddings_placement),
                          execution, ctx)
    optimizer = build_optimizer(stage, train)
    return PipelineEngine(stage, layout, execution.pipeline_schedule, optimizer,
                          build_scheduler(optimizer, train, total_steps), execution.precision,
                          train.grad_clip, ctx, seed=train.seed)
