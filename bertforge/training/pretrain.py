"""The pre-training loop, flat, top to bottom.

    bertforge pretrain                                   # tiny BERT on the built-in corpus
    bertforge pretrain --config pretrain_base_128 --data.input corpus/ --train.steps 10000
    bertforge pretrain --resume runs/NAME                # continue from its newest checkpoint
    bertforge pretrain --name NAME --resume auto ...     # one command for the first start and every restart

    torchrun --nproc_per_node 8 -m bertforge pretrain --execution.parallel fsdp ...

One optimizer step consumes ``train.global_batch_size`` sequences: each of
the W ranks (1 without torchrun) runs ``accumulation`` micro-batches of
``train.micro_batch_size``. The data order is a seeded permutation per epoch,
so the data position is two integers (epoch, micro-batch) and a resumed run
continues exactly where it stopped without replaying anything. With W ranks,
rank r takes micro-batches r, r + W, … of that order and dropout is seeded
per micro-batch of the global batch, so a step sees the same sequences and
masks, and gives the same loss, at any world size.

Nothing is lost: SIGTERM or SIGUSR1 finishes the current step, writes a
checkpoint on every rank and returns (exit status 0); ``--resume auto``
resumes from the newest sound checkpoint of ``log.run_dir/log.name`` or
starts fresh there, so torchrun's ``--max-restarts`` continues a job whose
rank died. Every (re)start removes the temporaries of interrupted saves, and
a run directory made by a run that failed before its first step is removed, as is
one whose first step a second signal cut short.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import random
import shutil
import time
from collections.abc import Callable, Collection, Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bertforge import runs
from bertforge.config import (
    MODEL_PRESETS,
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    ExecutionConfig,
    LogConfig,
    ModelConfig,
    TrainConfig,
    accumulation_steps,
    freeze,
    replaced,
)
from bertforge.data import PretrainingDataset, SyntheticDataset, build_datasets, decode_sample
from bertforge.data.checksum import fingerprint
from bertforge.data.errors import warn_prediction_cap
from bertforge.data.feed import copied_ahead, widen
from bertforge.data.loader import (
    MaskingSpec,
    Prefetcher,
    RecordStream,
    check_tokenizer,
    check_vocab_fits,
    is_records,
    masking_spec,
    record_files,
)
from bertforge.data.vocab import load_vocab
from bertforge.fileio import atomic_file
from bertforge.formats import weights
from bertforge.formats.hf import HF_MODEL_ID, find_model, is_model, resolve_model
from bertforge.formats.load import check_weights, load_weights, read_model_config
from bertforge.models.bert import compiled_pretraining_loss, eval_result, eval_sums, num_parameters, pretraining_loss
from bertforge.models.families import build_pretraining_model
from bertforge.observe.log import MetricsLogger, ProgressBar, Throughput, pass_progress
from bertforge.observe.profile import RunMonitor
from bertforge.parallel.dist import (
    DEFAULT_COMPILE_CACHE,
    DistContext,
    barrier,
    check_execution,
    compiles,
    compiles_optimizer,
    destroy_distributed,
    from_main,
    init_distributed,
    is_compiled,
    prepare_model,
    resolve_device,
    unwrap,
    write_error,
)

from . import checkpoint as ckpt
from . import pipeline
from .engine import (
    BatchStream,
    BatchWarmup,
    DivergenceError,
    DivergenceGuard,
    Engine,
    Preemption,
    StepReport,
    autocast,
    due,
    real_tokens,
    set_threads,
    to_device,
)
from .mlperf import eval_due, eval_every_samples, open_log
from .optim import build_optimizer, build_scheduler, cast_weights


def forward_loss(model: nn.Module, batch: dict[str, torch.Tensor], accuracy: bool = True) -> dict[str, torch.Tensor]:
    """The pre-training losses of one batch, and with ``accuracy`` the counts of correct predictions
    (see ``pretraining_loss``).

    The batch may be compact (int32, as the loader makes it): it is widened
    here, on the device, where the loss needs int64. A batch without padding
    has no ``attention_mask``, and the model runs without one.
    """
    batch = widen(batch)
    # A compiled model comes with a compiled loss: fp32 cross-entropy over (B, P, V) logits
    # fused into a few kernels instead of materialising fp32 copies of the logits.
    loss_fn = (compiled_pretraining_loss(accuracy) if is_compiled(model)
               else functools.partial(pretraining_loss, accuracy=accuracy))
    if "sequence_ids" in batch:  # packed rows (see data/packing.py)
        mlm_logits, nsp_logits = model(batch["input_ids"], batch["token_type_ids"], None,
                                       batch["masked_lm_positions"], position_ids=batch["position_ids"],
                                       sequence_ids=batch["sequence_ids"], cls_positions=batch["cls_positions"])
        return loss_fn(mlm_logits, nsp_logits, batch)
    mlm_logits, nsp_logits = model(batch["input_ids"], batch["token_type_ids"],
                                   batch.get("attention_mask"), batch["masked_lm_positions"])
    return loss_fn(mlm_logits, nsp_logits, batch)


def training_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The engine's loss function: the losses a training step reports (and, for packed rows,
    ``sequences``: the real sequences of the batch, for a throughput in real sequences); no
    accuracy counts, whose argmax over the logits training does not need."""
    out = forward_loss(model, batch, accuracy=False)
    keys = ("loss", "mlm_loss", "nsp_loss") if has_nsp(model) else ("loss", "mlm_loss")
    losses = {key: out[key] for key in keys}
    if "sequence_ids" in batch:
        losses["sequences"] = out["nsp_count"]
    return losses


def has_nsp(model: nn.Module) -> bool:
    """Whether a (wrapped) pre-training model has the next-sentence head (not BertForMaskedLM)."""
    return unwrap(model).next_sentence  # type: ignore[return-value]


@torch.no_grad()
def evaluate(model: nn.Module, dataset: PretrainingDataset, batch_size: int, device: torch.device,
             precision: str, max_batches: int = 0) -> dict[str, float]:
    """Masked-LM and NSP accuracy and loss over the eval set, in order, without dropout
    (the masked LM's alone for a model without the NSP head)."""
    was_training = model.training
    model.eval()
    sums = [0.0] * 6
    starts = range(0, len(dataset), batch_size)
    if max_batches > 0:
        starts = starts[:max_batches]
    with pass_progress(len(starts)) as advance:  # shown when a Stage is around (the loop's, `bertforge eval`'s)
        for start in starts:
            indices = torch.arange(start, min(start + batch_size, len(dataset))).numpy()
            batch = to_device(dataset.batch(indices), device)
            with autocast(device, precision):
                out = forward_loss(model, batch)
            sums = [total + value for total, value in zip(sums, eval_sums(out))]
            advance(1)
    model.train(was_training)
    return eval_result(sums, has_nsp(model))




def make_run_dir(log: LogConfig) -> Path:
    """A new run directory under ``log.run_dir``: ``log.name``, or the first of ``NAME-2``, ``NAME-3`` …
    that no other run has made (never two runs in one directory, even when started at once)."""
    name = log.name or datetime.now().strftime("pretrain-%Y%m%d-%H%M%S")
    run_dir, suffix = Path(log.run_dir) / name, 1
    while True:
        try:
            run_dir.mkdir(parents=True)  # of two that start at once, one makes it
            return run_dir
        except FileExistsError:
            suffix += 1
            run_dir = Path(log.run_dir) / f"{name}-{suffix}"
        except OSError as err:  # a read-only or missing parent: the user's to fix
            raise ConfigError(f"cannot create the run directory {run_dir}: {err.strerror} (log.run_dir)") from None


def absolute_paths(data: DataConfig, log: LogConfig, checkpoint: CheckpointConfig) -> dict[str, str]:
    """The paths a run reads, made absolute (dotted keys, for ``config.replaced``), so that the saved
    config resumes from any directory.

    ``checkpoint.init`` may be a Hugging Face model id: it becomes the model's snapshot in the
    local Hugging Face cache. An id found nowhere stays as given, for the load of a new run to
    say where it was looked for (a resume does not read it)."""
    paths = {"data.input": data.input, "data.eval_input": data.eval_input, "data.vocab": data.vocab,
             "log.mlperf": log.mlperf}
    absolute = {key: os.path.abspath(os.path.expanduser(value)) for key, value in paths.items() if value}
    init = checkpoint.init
    found = resolve_model(init) if init else None
    if found is not None and (is_model(found) or not HF_MODEL_ID.match(init)):
        absolute["checkpoint.init"] = os.path.abspath(found)
    return absolute


def locate_run(resume: str, log: LogConfig, held: contextlib.ExitStack) -> tuple[Path | None, Path, bool]:
    """(the checkpoint to resume or None, the run directory, whether this run created it).

    On rank 0 only. ``resume`` is ``checkpoint.resume``: ``auto`` takes the newest checkpoint of
    ``log.run_dir/log.name`` that verifies (skipping damaged ones with a
    warning), or starts fresh there. The run directory's lock is taken into
    ``held`` first (another live run there is an error naming it); then the
    temporaries of interrupted saves are removed.
    """
    if resume == runs.AUTO:
        run_dir = runs.auto_run_dir(log.run_dir, log.name)
        lock = held.enter_context(runs.RunLock(run_dir, create=True))  # of runs started at once, one goes on
        try:
            return runs.checkpoint_to_resume(resume, run_dir), run_dir, lock.created
        except Exception:
            if lock.created:  # made and locked here, nothing of a run is in it: leave nothing behind
                runs.remove_run_dir(run_dir)
            raise
    if resume:
        run_dir = runs.find_checkpoint(resume).parent.parent
        held.enter_context(runs.RunLock(run_dir))
        resume_from = runs.checkpoint_to_resume(resume)
        assert resume_from is not None  # a named checkpoint, or an error
        return resume_from, run_dir, False
    run_dir = make_run_dir(log)
    held.enter_context(runs.RunLock(run_dir))
    return None, run_dir, True


def fingerprint_of(d: DataConfig) -> str | None:
    """The fingerprint of the files training reads, saved with every checkpoint, so that a resume
    notices data regenerated at the same path (None: synthetic data, the built-in corpus)."""
    if d.synthetic or not d.input:
        return None
    return fingerprint(record_files(d.input))


# What records_shape reads of record shards: (the file that decides, its seq_len, max_predictions,
# the vocab size its header declares or None).
RecordsShape = tuple[Path, int, int, int | None]


@dataclasses.dataclass
class TrainingData:
    """What :func:`load_data` makes: a function giving this rank's training stream from a data
    position, the eval set, and the config values the data decided (dotted keys: the vocab a
    corpus trained and its size, the records' shapes), for ``config.replaced``."""

    make_stream: Callable[[dict], Any]
    eval_set: PretrainingDataset | None
    decided: dict[str, Any]


def load_data(model: ModelConfig, data: DataConfig, train: TrainConfig, run_dir: Path, rank: int = 0,
              world_size: int = 1, *, given: Collection[str] = frozenset(), mlperf_log: bool = False,
              pin: bool = False, always_mask: bool = False) -> TrainingData:
    """This rank's training data and the eval set of ``data``; the sections themselves are left alone.

    ``given``: the dotted keys the user set (``Config.given``), which the records must agree with.
    ``mlperf_log``: the run writes an MLPerf log (``log.mlperf``), which counts samples.
    ``pin``: the record prefetcher puts batches in pinned memory (for a CUDA device).
    ``always_mask``: batches without padding keep their attention mask, so that a compiled
    model has one graph for all (synthetic rows, which never have padding, have none).

    Training data is synthetic, a corpus of text (built here, see data/, training a vocab
    into the run directory where none is given), or a directory or glob of record shards
    (streamed), whose shapes and vocab decide ``data.seq_len``, ``data.max_predictions`` and
    ``model.vocab_size``.
    """
    batch_size, seed = train.micro_batch_size, train.seed
    split: dict[str, Any] = {"rank": rank, "world_size": world_size}
    if data.synthetic:
        synthetic = SyntheticDataset(size=max(train.global_batch_size * 64, 1024), vocab_size=model.vocab_size,
                                     seq_len=data.seq_len, max_predictions=data.max_predictions, seed=data.seed)
        return TrainingData(lambda position: BatchStream(synthetic, batch_size, seed, **position, **split), None, {})
    files = record_files(data.input) if data.input and is_records(data.input) else None
    if files is None:
        built, eval_set, vocab = build_datasets(data, run_dir, mlm_only=train.objective == "mlm")
        built.always_mask = eval_set.always_mask = always_mask
        # The saved config names the vocab actually used, so a resume rebuilds the same data.
        return TrainingData(lambda position: BatchStream(built, batch_size, seed, **position, **split), eval_set,
                            {"data.vocab": str(Path(vocab).resolve()),
                             **vocab_decides(model, vocab, given, named=bool(data.vocab))})
    return load_records(files, model, data, train, given=given, mlperf_log=mlperf_log, split=split, pin=pin,
                        always_mask=always_mask)


def load_records(files: list[Path], model: ModelConfig, data: DataConfig, train: TrainConfig, *,
                 given: Collection[str], mlperf_log: bool, split: dict[str, Any], pin: bool,
                 always_mask: bool) -> TrainingData:
    """:func:`load_data` of record shards, streamed: their shapes decide ``data.seq_len`` and
    ``data.max_predictions``, their vocab ``model.vocab_size``."""
    from bertforge.data.loader import read_eval_records, records_shape

    shape = records_shape(files)
    first, seq_len, max_predictions, _ = shape
    check_records_shape(shape, model, data, train, given=given, mlperf_log=mlperf_log)
    decided = vocab_decides(model, data.vocab, given) if data.vocab else {"model.vocab_size": model.vocab_size}
    vocab_size = decided["model.vocab_size"]
    masking = records_masking(files, shape, data, vocab_size)
    # Token ids ≥ the vocab size are refused, naming the file and record, by the readers.
    eval_set = (PretrainingDataset(read_eval_records(data.eval_input, (first, seq_len, max_predictions), vocab_size),
                                   always_mask) if data.eval_input else None)

    def make_stream(position: dict) -> RecordStream | Prefetcher:
        # Every rank reads the same number of batches per epoch: none waits for another.
        stream = RecordStream(files, train.micro_batch_size, train.seed, shuffle_buffer=data.shuffle_buffer,
                              masking=masking, vocab_size=vocab_size, always_mask=always_mask, **position, **split)
        return (Prefetcher(stream, data.prefetch, pin=pin, threads=data.reader_threads) if data.prefetch > 0
                else stream)
    return TrainingData(make_stream, eval_set, {"data.seq_len": seq_len, "data.max_predictions": max_predictions,
                                                **decided})


def vocab_decides(model: ModelConfig, vocab: str | Path, given: Collection[str], named: bool = True) -> dict[str, Any]:
    """What the vocab decides: ``model.vocab_size`` (its size), and ``model.pad_token_id`` (its [PAD] id)
    unless the config sets it, so that a preset's [PAD] (ModernBERT-base's 50283) follows a vocab of
    one's own. A ``model.vocab_size`` the config sets must agree, or it would be silently replaced
    (``named``: the user named the vocab, rather than one trained into the run)."""
    vocab_info = load_vocab(vocab)
    if named and "model.vocab_size" in given and model.vocab_size != vocab_info.size:
        raise ConfigError(f"model.vocab_size={model.vocab_size}, but data.vocab {vocab} has {vocab_info.size} tokens: "
                          f"leave model.vocab_size out to take the vocab's size, or give a vocab of "
                          f"{model.vocab_size}")
    decided: dict[str, Any] = {"model.vocab_size": vocab_info.size}
    pad = vocab_info.roles.pad if vocab_info.roles else None
    if pad is not None and "model.pad_token_id" not in given:
        decided["model.pad_token_id"] = pad
    return decided


def check_records_shape(shape: RecordsShape, model: ModelConfig, data: DataConfig, train: TrainConfig, *,
                        given: Collection[str], mlperf_log: bool) -> None:
    """Refuse records whose shapes (``records_shape``: the file that decides, its seq_len,
    max_predictions, header vocab size) the run cannot train on as configured.

    The records decide the shapes. A value the config sets (on the command line or in a config
    file, even the default value: in ``given``) must agree with them, or it would be silently
    replaced; a resumed run's saved config holds the records' values."""
    from bertforge.data.record_reader import open_records

    first, seq_len, max_predictions, _ = shape
    with open_records(first, verify=False) as records:
        packed = records.max_sequences_per_pack > 0
    if packed and (mlperf_log or eval_every_samples(train) > 0):
        # A step's real sequences vary with packed rows; samples are counted per step from the batch size.
        raise ConfigError(f"{first}: packed records, but train.eval_every_samples and log.mlperf count samples "
                          f"as global_batch_size per step: train on unpacked records, or use train.eval_every")
    for key, value in (("seq_len", seq_len), ("max_predictions", max_predictions)):
        configured = getattr(data, key)
        if f"data.{key}" in given and configured != value:
            raise ConfigError(f"data.{key}={configured}, but the records have {key} {value} ({first}): leave "
                              f"data.{key} out to train on these records, or give records of {key} {configured}")
    if seq_len > model.max_position_embeddings:
        raise ConfigError(f"{first}: sequences of {seq_len} exceed "
                          f"model.max_position_embeddings={model.max_position_embeddings}")


def records_masking(files: list[Path], shape: RecordsShape, data: DataConfig, vocab_size: int) -> MaskingSpec | None:
    """How the records' batches are masked: anew each epoch (``data.dynamic_masking``: the masking
    spec) or as stored (None); first the records' vocab is checked against ``data.vocab``
    (``vocab_size``: its size, or ``model.vocab_size`` without one)."""
    from bertforge.data.record_reader import open_records

    first, seq_len, max_predictions, header_vocab = shape
    masking = None
    if data.dynamic_masking and not data.vocab:
        raise ConfigError("data.dynamic_masking needs data.vocab (for the [CLS], [SEP] and [MASK] ids)")
    if data.whole_word_mask and not data.dynamic_masking:
        raise ConfigError("data.whole_word_mask on records needs data.dynamic_masking (records keep the "
                          "masks they were made with: `data create --whole-word-mask` makes whole-word ones)")
    if data.vocab:  # native headers and TFRecords' sidecars name theirs
        check_tokenizer(files + ([Path(data.eval_input)] if data.eval_input else []), data.vocab)
    if data.vocab and data.dynamic_masking:
        masking = masking_spec(data.vocab, data.masked_lm_prob, data.whole_word_mask)
        warn_prediction_cap(seq_len, max_predictions, data.masked_lm_prob, f"{first} (data.dynamic_masking)")
    if header_vocab is not None and header_vocab != vocab_size:  # (TFRecords declare none)
        have = (f"data.vocab {data.vocab} has {vocab_size} tokens" if data.vocab
                else f"model.vocab_size={vocab_size}")
        raise ConfigError(f"{first}: written for a vocab of {header_vocab} tokens (its header's vocab_size), "
                          f"but {have}: give data.vocab the vocab the records were made with")
    if data.vocab and not data.dynamic_masking:  # the records' own masks: made with this vocab, or ids are shifted
        with open_records(first, verify=False) as records:
            check_vocab_fits(records, data.vocab)
    return masking


def total_steps(train: TrainConfig, batches_per_epoch: int, accumulation: int) -> int:
    if train.epochs > 0:
        return max(1, train.epochs * batches_per_epoch // accumulation)
    return train.steps


def check_resume(checkpoint: Path, saved: dict[str, Any], world_size: int, streamed: bool) -> None:
    """Refuse a resume whose data position would be silently wrong, naming both world sizes.

    Weights and optimizer state load into any world size and parallel mode
    (full files, or FSDP shards that torch.distributed.checkpoint reshards).
    The in-memory stream's position counts micro-batches of all ranks, so any
    world size continues it exactly (with the same global batch); the record
    streams' position is per rank and holds only for the same world size.
    """
    saved_world = saved.get("world_size", 1)
    if streamed and saved_world != world_size:
        raise runs.CheckpointError(
            f"{checkpoint} was saved by {saved_world} rank(s) and this run has {world_size}: the position "
            f"in record shards is per rank, so resume with {saved_world} rank(s)")


def pretrain(cfg: Config, compile_only: bool = False) -> dict[str, Any]:
    """Run (or resume) pre-training; returns a summary with the run directory and results.

    Under torchrun every rank calls this: rank 0 alone prints, logs and writes
    the run's shared files, and a rank that fails leaves its traceback in
    ``error_rank{N}.log`` in the run directory.
    """
    started = time.perf_counter()
    set_threads(cfg.execution.threads)
    cfg = replaced(cfg, absolute_paths(cfg.data, cfg.log, cfg.checkpoint))
    dist = init_distributed(cfg.execution.device, cfg.execution.dist_timeout)
    try:
        check_execution(cfg.execution, dist.world_size)
        with contextlib.ExitStack() as held:  # rank 0 holds the run directory's lock until the run ends
            # One directory, named by rank 0.
            resume_from, run_dir, created = from_main(dist, lambda: locate_run(cfg.checkpoint.resume, cfg.log, held))
            progress = {"steps": 0}

            def discard() -> bool:
                """Remove the run directory if this run made it and has nothing in it to keep (no step
                done, no checkpoint): on an error, whose console line says it all, and on a second
                signal during the first step. Under torchrun it stays, holding every rank's error log."""
                if (created and dist.world_size == 1 and progress["steps"] == 0
                        and not runs.complete_checkpoints(run_dir)):
                    runs.remove_run_dir(run_dir)
                    return True
                return False
            try:
                summary = train(cfg, dist, run_dir, resume_from, started, progress, compile_only, discard)
                barrier(dist)  # no rank leaves the group while another still talks to it
                return summary
            except Exception:
                if not discard():
                    write_error(run_dir, dist)
                raise
    finally:
        destroy_distributed()


def compile_only(cfg: Config) -> dict[str, Any]:
    """``pretrain --compile-only``: compile the model and the loss for this config into the compile
    cache and stop, so that the real run's first step (and first evaluation) start warm.

    What is compiled is what the run compiles, by the run's own code: one training step on the
    first batch of the configured data and the evaluation, in a hidden run directory under
    ``log.run_dir`` that is removed afterwards. One step covers every batch of the run: a
    compiled run's batches of padded data all carry their mask (``always_mask``), so a batch
    without padding takes the same graph. No weights or logs are kept; the cache is
    ``execution.compile_cache``. Under torchrun every rank compiles its own part (DDP, FSDP).
    """
    if not compiles(cfg.execution, resolve_device(cfg.execution.device)):
        raise ConfigError(f"execution.compile={cfg.execution.compile} does not compile on "
                          f"{resolve_device(cfg.execution.device).type} (auto: on CUDA only), so there is nothing "
                          "to compile: give the run and --compile-only --execution.compile true")
    cfg = replaced(cfg, {"train.steps": 1, "train.epochs": 0, "train.target_mlm_accuracy": 0.0,
                         "checkpoint.every": 0, "checkpoint.keep": 1, "checkpoint.resume": "",
                         "log.name": f".compile-only-{datetime.now():%Y%m%d-%H%M%S}", "log.tensorboard": False,
                         "log.wandb": False, "log.mlperf": ""})
    started = time.perf_counter()
    summary = pretrain(cfg, compile_only=True)
    if summary["rank"] == 0:
        shutil.rmtree(summary["run_dir"], ignore_errors=True)
    return {"rank": summary["rank"], "seconds": time.perf_counter() - started, "run_dir": summary["run_dir"],
            "compile_cache": str(Path(cfg.execution.compile_cache or DEFAULT_COMPILE_CACHE).expanduser())}


def train(cfg: Config, dist: DistContext, run_dir: Path, resume_from: Path | None,
          started: float, progress: dict[str, int] | None = None, compile_only: bool = False,
          on_hard_exit: Callable[[], object] | None = None) -> dict[str, Any]:
    """The body of ``pretrain`` on one rank, given the run directory (and the checkpoint to
    resume, already verified): the config resolved and frozen, the data, the model and its
    engine; then :class:`Pretraining`. ``progress["steps"]`` counts the steps this call completed;
    ``on_hard_exit`` runs when a second signal ends the run at once (:class:`Preemption`).

    The whole config: this is the job on one rank, which hands each part its sections."""
    progress = {"steps": 0} if progress is None else progress
    if cfg.checkpoint.init and resume_from is None:
        check_weights(cfg.checkpoint.init)  # one not found or unreadable is named before the data loads
        cfg = with_init_model(cfg)
    # (so is a checkpoint's config that does not fit its weights, or their unreadable header)
    saved_cfg = weights.read_config(resume_from) if resume_from is not None else None
    # The MLPerf log's init phase starts here (rank 0 writes; without log.mlperf it logs nothing).
    mlperf = open_log(cfg.log, cfg.train, cfg.data, dist, resumed=resume_from is not None)
    data, cfg = resolved_data(cfg, dist, run_dir)
    data_fingerprint = from_main(dist, lambda: fingerprint_of(cfg.data))
    saved = ckpt.read_trainer_state(resume_from) if resume_from else None
    if resume_from is not None:
        assert saved_cfg is not None  # read above
        saved_data = saved.get("data_fingerprint") if saved else None
        weights.check_model_config(saved_cfg.model, cfg.model, resume_from)
        from_main(dist, lambda: runs.check_resume(resume_from, saved_cfg, cfg, saved_data, data_fingerprint,
                                                  f"data.input {cfg.data.input}"))
    if dist.is_main:
        with atomic_file(run_dir / "config.yaml") as tmp:
            tmp.write_text(cfg.to_yaml(), encoding="utf-8")
    # checkpoint.init's weights on a fresh start; a resume loads the checkpoint's
    model = pretraining_model(cfg.model, cfg.train, init=cfg.checkpoint.init if resume_from is None else "")
    data_rank, data_world = pipeline.data_split(cfg.execution, dist)
    accumulation = accumulation_of(cfg.train, cfg.execution, data_world)
    stream = data.make_stream(saved["data"] if saved else {})
    if resume_from is not None:
        assert saved is not None  # read above
        check_resume(resume_from, saved, data_world, streamed=not isinstance(stream, BatchStream))
    steps = total_steps(cfg.train, stream.batches_per_epoch, accumulation)
    n_params = num_parameters(model)
    engine = build_engine(model, cfg.execution, cfg.train, dist, steps)
    step = ckpt.resume(resume_from, engine, verified=True)["step"] if resume_from is not None else 0
    with contextlib.ExitStack() as stack:
        stack.callback(stream.close)
        run = Pretraining(cfg, dist, run_dir, engine, stream, data.eval_set, steps, step, accumulation, mlperf,
                          data_fingerprint, saved.get("train_s", 0.0) if saved else 0.0, started, stack)
        run.preemption.on_hard_exit = on_hard_exit
        # Only now: a person (or a test) may signal once they see the run, and a second signal must
        # already find what to remove.
        run.bar.print(f"run directory: {run_dir}")
        if resume_from is not None and saved is not None and "guard" in saved:  # (older checkpoints: refilled)
            restore_guard(run.guard, saved["guard"], resume_from)
        if saved is not None:  # where the batch-size warm-up stands (runs without one: steps × the batch)
            run.tokens_read, run.samples = saved.get("tokens_read", 0), saved.get("samples", run.samples)
        ranks = f" × {dist.world_size} ranks ({cfg.execution.parallel})" if dist.world_size > 1 else ""
        if cfg.execution.pipeline_stages > 1:
            ranks = (f" × {data_world} pipeline(s) of {cfg.execution.pipeline_stages} stages "
                     f"({cfg.execution.pipeline_schedule})")
        run.bar.print(f"model: {n_params / 1e6:.2f}M parameters, "
                      f"{cfg.model.num_hidden_layers} layers, hidden {cfg.model.hidden_size}; "
                      f"{stream.num_sequences} training sequences of {cfg.data.seq_len}; "
                      f"global batch {cfg.train.global_batch_size} = {cfg.train.micro_batch_size} × "
                      f"{accumulation}{ranks}{warmup_note(cfg.train, dist.world_size)}")
        return run.train(progress, save=not compile_only)


def resolved_data(cfg: Config, dist: DistContext, run_dir: Path) -> tuple[TrainingData, Config]:
    """This rank's training data, and the config with what the data decided, frozen: what the
    run reads from here on (and saves). Rank 0 loads first: it may train the vocab into the run
    directory, which the other ranks then read.

    The whole config: what the data decides is written into it (a model section's vocab size)."""
    # The ranks that split the data: every rank, or with pipeline stages the pipelines (a
    # pipeline's stages read alike).
    data_rank, data_world = pipeline.data_split(cfg.execution, dist)
    load = functools.partial(load_data, run_dir=run_dir, rank=data_rank, world_size=data_world,
                             given=cfg.given, mlperf_log=bool(cfg.log.mlperf),
                             pin=dist.device.type == "cuda",  # pinned batches copy to the GPU without waiting
                             always_mask=compiles(cfg.execution, dist.device))  # one graph for every batch
    loaded: list[TrainingData] = []

    def load_on_main() -> dict[str, Any]:
        loaded.append(load(cfg.model, cfg.data, cfg.train))
        return init_vocab_size(cfg, loaded[0].decided)

    cfg = freeze(replaced(cfg, from_main(dist, load_on_main)))
    return (loaded[0] if loaded else load(cfg.model, cfg.data, cfg.train)), cfg


def with_init_model(cfg: Config) -> Config:
    """``cfg`` with the model of ``checkpoint.init`` (a fresh start): each model field not given (on
    the command line or in a config file) is the init's, so a published model trains as published,
    and ``data.vocab``, when not given, is the vocab beside its weights (a Hugging Face directory's
    ``tokenizer.json``, a run's vocab). Shape fields given must equal the init's (checked on load)."""
    init = read_model_config(cfg.checkpoint.init)
    check_named_preset(cfg.preset, cfg.given, cfg.checkpoint.init, init)
    values: dict[str, Any] = {f"model.{field.name}": getattr(init, field.name) for field in dataclasses.fields(init)
                              if f"model.{field.name}" not in cfg.given}
    if init.family == "modernbert" and "train.objective" not in cfg.given:
        values["train.objective"] = "mlm"  # (no next-sentence head)
    vocab = runs.vocab_in(find_model(cfg.checkpoint.init))
    if not cfg.data.vocab and vocab is not None:
        values["data.vocab"] = str(vocab.resolve())
    return replaced(cfg, values)


def check_named_preset(preset: str, given: Collection[str], init_path: str, init: ModelConfig) -> None:
    """A model ``preset`` the user named ("": none) is a model asked for: ``checkpoint.init``'s must be it
    (each field the preset sets and the user did not give), or the init's would replace it in silence.
    The vocab's fields (size, [PAD] id) are left out: the data decides them, not the preset."""
    if not preset:
        return
    fields = {"family": "bert", **MODEL_PRESETS[preset]}  # BERT's presets leave the default family
    differ = [f"model.{name}={getattr(init, name)} (the preset's {value})" for name, value in fields.items()
              if name not in ("vocab_size", "pad_token_id") and f"model.{name}" not in given
              and getattr(init, name) != value]
    if differ:
        raise ConfigError(f"checkpoint.init {init_path} is not the named model preset {preset}: it has "
                          f"{', '.join(differ)}; leave the preset out to train the init's model")


def init_vocab_size(cfg: Config, decided: dict[str, Any]) -> dict[str, Any]:
    """What the data decided, less ``model.vocab_size`` where ``checkpoint.init``'s embeddings set it:
    a published model's table may be larger than its tokenizer (rounded up, as ModernBERT's 50,368
    rows), never smaller."""
    tokens = decided.get("model.vocab_size")
    if not cfg.checkpoint.init or tokens is None:
        return decided
    if tokens > cfg.model.vocab_size:
        raise ConfigError(f"data.vocab {cfg.data.vocab or 'of the records'} has {tokens} tokens, more than the "
                          f"{cfg.model.vocab_size} embeddings of checkpoint.init {cfg.checkpoint.init}: use the "
                          f"tokenizer the model was trained with")
    return {key: value for key, value in decided.items() if key not in ("model.vocab_size", "model.pad_token_id")}


def pretraining_model(model: ModelConfig, train: TrainConfig, init: str = "") -> nn.Module:
    """The model to train, on every rank from the seed ``train.seed``, with the weights of ``init``
    (``checkpoint.init`` of a fresh start; "" = none); parallelism is applied to it afterwards (build_engine)."""
    torch.manual_seed(train.seed)
    random.seed(train.seed)
    built = build_pretraining_model(model, train.objective)
    if init:
        load_weights(built, init)
    return built.train()


def warmup_note(train: TrainConfig, world_size: int) -> str:
    if not train.batch_size_warmup_min_size:
        return ""
    return (f", from {train.batch_size_warmup_min_size * world_size} over the first "
            f"{train.batch_size_warmup_tokens:,} tokens (batch-size warm-up)")


def batch_warmup(train: TrainConfig, execution: ExecutionConfig, world_size: int,
                 accumulation: int) -> BatchWarmup | None:
    """The batch-size warm-up of ``train`` (None: off) on ``world_size`` ranks of ``accumulation``
    micro-batches a step. Ranks count their own tokens, so their micro-batches may differ at a step:
    FSDP's reduce-scatter after each micro-batch would then wait forever, and is refused."""
    if not train.batch_size_warmup_min_size:
        return None
    if execution.parallel == "fsdp" and execution.grad_sync == "micro_batch" and world_size > 1:
        raise ConfigError("train.batch_size_warmup_min_size cannot be used with execution.fsdp_grad_sync="
                          "micro_batch (ranks may train different numbers of micro-batches in a step); use step")
    return BatchWarmup(train.batch_size_warmup_min_size // train.micro_batch_size, accumulation,
                       train.batch_size_warmup_tokens, world_size)


def accumulation_of(train: TrainConfig, execution: ExecutionConfig, data_world: int) -> int:
    """Micro-batches per rank and step, for ``data_world`` ranks (or pipelines) that split the data."""
    try:
        accumulation = accumulation_steps(train, world_size=data_world)
    except ConfigError as err:
        what = "pipeline" if execution.pipeline_stages > 1 else "rank"
        raise ConfigError(f"{err} (micro-batch {train.micro_batch_size} × {data_world} {what}(s))") from None
    pipeline.check_micro_batches(execution, accumulation)
    return accumulation


def build_engine(model: nn.Module, execution: ExecutionConfig, train: TrainConfig, dist: DistContext,
                 steps: int) -> Engine:
    """The model as this rank trains it (parallelism applied from outside), its optimizer and
    schedule: with pipeline stages this rank's stage (training/pipeline.py)."""
    if execution.pipeline_stages > 1:
        return pipeline.build_engine(model, execution, train, dist, steps)
    model = prepare_model(cast_weights(model, train), execution, dist)
    # (In the backward each tensor steps alone: the compiled step would compile once per shape.)
    compiled = compiles_optimizer(execution, dist.device) and not train.optimizer_in_backward
    optimizer = build_optimizer(unwrap(model), train, compiled=compiled)
    return Engine(model, optimizer, build_scheduler(optimizer, train, steps), training_loss,
                  execution.precision, train.grad_clip, dist, seed=train.seed, grad_sync=execution.grad_sync,
                  loss_scale=train.loss_scale, scaled_state=train.scaled_optimizer_state,
                  optimizer_in_backward=train.optimizer_in_backward)


def lower_lr(checkpoint: Path, train: TrainConfig) -> str:
    """The flags that resume ``checkpoint`` at a tenth of the learning rate (the divergence guard's hint)."""
    if train.schedule == "table":
        table = ", ".join(f"{step}: {lr / 10:g}" for step, lr in sorted(train.lr_table.items()))
        change = f"--train.lr_table '{{{table}}}'"
    else:
        change = f"--train.lr {train.lr / 10:g}"
    return f"--resume {checkpoint} --resume-with-changes {change}"


def restore_guard(guard: DivergenceGuard, state: Any, checkpoint: Path) -> None:
    """The divergence guard's history and spikes as the checkpoint saved them."""
    try:
        guard.load_state_dict(state)
    except ValueError as err:
        raise runs.CheckpointError(f"{checkpoint / 'trainer.pt'}: {err}") from None


class Pretraining:
    """One rank's pre-training once its model, data and engine are set up: the steps, what their
    reports say (logs, the divergence guard), evaluations and checkpoints.

    Nothing here waits for the device between steps: a step's numbers arrive during the next
    (``engine.report``, see training/engine.py). A checkpoint waits for its own step's (``engine.flush``),
    and with the divergence guard on it counts only once the step after it is seen to be normal:
    the loss that reveals a bad update comes one step after the update (``ckpt.confirm``).

    The whole config: the loop reads five of its sections, and every checkpoint saves all of it.
    """

    def __init__(self, cfg: Config, dist: DistContext, run_dir: Path, engine: Engine, stream: Any,
                 eval_set: PretrainingDataset | None, steps: int, step: int, accumulation: int, mlperf: Any,
                 data_fingerprint: str | None, trained_s: float, started: float, stack: contextlib.ExitStack):
        self.cfg, self.dist, self.run_dir, self.engine, self.stream = cfg, dist, run_dir, engine, stream
        self.eval_set, self.steps, self.step, self.accumulation = eval_set, steps, step, accumulation
        self.mlperf, self.data_fingerprint, self.started = mlperf, data_fingerprint, started
        self.files = ckpt.RunFiles(cfg.to_yaml(), cfg.data.vocab)  # what every checkpoint holds of the run
        self.logger = stack.enter_context(MetricsLogger(run_dir, cfg.log, enabled=dist.is_main, start_step=step,
                                                        run_config=cfg.to_dict()))
        engine.preemption = self.preemption = stack.enter_context(Preemption())
        self.bar = stack.enter_context(ProgressBar(steps, step, enabled=cfg.log.progress, main=dist.is_main,
                                                   every_s=cfg.log.progress_every_s))
        self.monitor = stack.enter_context(RunMonitor(cfg.execution, cfg.log, run_dir, dist, self.logger,
                                                      self.bar.print, start_step=step, total_steps=steps,
                                                      started=started))
        # Time to train: the timed region from here to the stop, summed over a resumed run's parts.
        self.run_started, self.trained_s = time.perf_counter(), trained_s
        self.guard = DivergenceGuard(cfg.train.divergence_factor, cfg.train.divergence_steps)
        self.warmup = batch_warmup(cfg.train, cfg.execution, dist.world_size, accumulation)
        self.tokens_read = 0  # this rank's real tokens, which the batch-size warm-up follows
        self.samples = step * cfg.train.global_batch_size  # sequences trained, all ranks'
        self.step_batches: dict[int, int] = {}  # the global batch of the steps whose reports have not arrived
        self.unconfirmed: tuple[int, Path] | None = None  # (its step, the checkpoint awaiting the next loss)
        self.throughput = Throughput()
        self.learning_rates: dict[int, float] = {}  # of the steps whose reports have not arrived
        self.first_loss: float | None = None
        self.last_loss: float | None = None
        self.evaluated_at = -1  # the step of the newest evaluation

    # -------- the loop

    def train(self, progress: dict[str, int], save: bool = True) -> dict[str, Any]:
        """Train to the end, a target accuracy or a signal; the summary. ``save`` false (compile-only)
        writes no final checkpoint."""
        cfg, engine, target = self.cfg, self.engine, self.target
        self.mlperf.run_start(cfg.train, cfg.data, self.accumulation, self.steps,
                              len(self.eval_set) if self.eval_set else 0)
        first_eval = last_eval = self.evaluate() if self.step == 0 and cfg.train.eval_at_start else None
        final: Path | None = None  # the checkpoint a signal made the run write
        while self.step < self.steps and not self.reached(last_eval):  # (the target may be reached at 0)
            self.learning_rates[self.step + 1] = engine.lr
            self.mlperf.train(self.samples)
            accumulation = self.warmup.micro_batches(self.tokens_read) if self.warmup else self.accumulation
            with self.monitor.step(self.step):  # memory, step times and the --profile window
                # On CUDA each micro-batch's copy overlaps the compute of the one before.
                engine.step(copied_ahead(self.micro_batches(accumulation), self.dist.device), accumulation, self.step)
            self.step += 1
            self.step_batches[self.step] = cfg.train.micro_batch_size * accumulation * self.dist.world_size
            self.samples += self.step_batches[self.step]
            progress["steps"] += 1
            self.on_report(engine.report)  # the step before's numbers
            if eval_due(cfg.train, self.step) and self.step < self.steps:  # (the last step's comes after the loop)
                last_eval = self.evaluate()
                if self.reached(last_eval):
                    break
            if engine.stop_requested and self.step < self.steps:  # every rank stops after this same step
                final = self.save()
                self.bar.print(self.preemption.message(self.step, final, self.run_dir))
                break
            if due(cfg.checkpoint.every, self.step, self.steps):
                self.checkpoint()
        preempted = final is not None
        status = time_to_train = None
        if final is None:
            self.on_report(engine.flush())
            if self.evaluated_at != self.step:
                last_eval = self.evaluate() or last_eval
            time_to_train = round(self.trained_s + time.perf_counter() - self.run_started, 3)
            if target > 0:  # success: an evaluation reached the target; aborted: the steps ran out first
                status = "success" if self.reached(last_eval) else "aborted"
                self.logger.log({"step": self.step, "split": "result", "status": status,
                                 "time_to_train_s": time_to_train, "samples_to_train": self.samples})
                self.bar.print(f"{status}: masked-LM accuracy target {target} "
                               f"{'reached' if status == 'success' else 'not reached'} after {self.samples} "
                               f"samples ({self.step} steps); time to train {time_to_train} s")
            self.mlperf.run_stop(self.samples, status or "aborted")
            final = self.save() if save else None
        summary = {
            "run_dir": str(self.run_dir), "checkpoint": str(final) if final else None, "steps": self.step,
            "preempted": preempted,
            "status": status, "time_to_train_s": time_to_train, "samples_to_train": self.samples,
            "first_loss": self.first_loss, "last_loss": self.last_loss,
            "first_eval": first_eval, "last_eval": last_eval,
            "wall_s": round(time.perf_counter() - self.started, 1),
            "rank": self.dist.rank, "world_size": self.dist.world_size,
        }
        if final is not None and not preempted:
            self.bar.print(f"done in {summary['wall_s']} s; checkpoint: {final}")
        return summary

    def micro_batches(self, count: int) -> Iterable[dict[str, torch.Tensor]]:
        """This step's ``count`` micro-batches, read as the step reaches them (and their tokens counted
        for the batch-size warm-up); the first step shows the first one decoded (what the model is
        fed, for a person)."""
        stream, vocab = self.stream, self.cfg.data.vocab
        for i in range(count):
            batch = stream.next()
            if self.warmup:
                self.tokens_read += real_tokens(batch)
            if self.step == 0 and i == 0 and vocab and not self.cfg.data.synthetic:
                self.bar.print(f"sample: {decode_sample(batch, vocab)[:400]}")
            yield batch

    @property
    def target(self) -> float:
        return self.cfg.train.target_mlm_accuracy

    def reached(self, result: dict[str, float] | None) -> bool:
        return self.target > 0 and result is not None and result["mlm_accuracy"] >= self.target

    # -------- what a step's report says

    def on_report(self, report: StepReport | None) -> None:
        """Log a finished step's numbers, watch its loss, and confirm or reject the checkpoint
        written the step before it (whose weights made this loss)."""
        if report is None:
            return
        cfg, step, values = self.cfg, report.step, dict(report.values)
        sequences = values.pop("sequences", None)  # packed rows: real sequences per micro-batch, averaged
        batch = self.step_batches.pop(step)
        self.throughput.add(batch if sequences is None else round(sequences * batch / cfg.train.micro_batch_size))
        lr = self.learning_rates.pop(step)
        if self.warmup:
            values["global_batch"] = batch
        if step % cfg.log.every == 0 or step == self.steps or step == 1:
            self.first_loss = values["loss"] if self.first_loss is None else self.first_loss
            self.last_loss = values["loss"]
            seq_per_s = self.throughput.rate()
            self.logger.log({"step": step, **values, "lr": lr, "seq_per_s": seq_per_s, "epoch": self.stream.epoch,
                             **self.monitor.row()})
            nsp = f"nsp {values['nsp_loss']:.3f} " if "nsp_loss" in values else ""
            self.bar.update(step, f"loss {values['loss']:.3f} mlm {values['mlm_loss']:.3f} {nsp}"
                                  f"{seq_per_s:.0f} seq/s")
        else:
            self.bar.update(step)
        try:
            self.guard.update(step, values["loss"])
        except DivergenceError as err:
            self.settle_unconfirmed(spiked=True)
            # (one a signal or the end saved during an earlier spike is not: see ckpt.spiked)
            sound = from_main(self.dist, lambda: ckpt.newest_sound(runs.complete_checkpoints(self.run_dir)))
            where = (f"the newest checkpoint, {sound}, is from before the spike: resume from it with a lower "
                     f"learning rate, e.g. {lower_lr(sound, cfg.train)}" if sound
                     else "no checkpoint was written before the spike")
            raise DivergenceError(f"{err}; {where}") from None
        if self.unconfirmed is not None and self.unconfirmed[0] + 1 == step:
            self.settle_unconfirmed(spiked=self.guard.spiking)

    def settle_unconfirmed(self, spiked: bool) -> None:
        if self.unconfirmed is None:
            return
        (_, path), self.unconfirmed = self.unconfirmed, None
        if spiked:
            ckpt.reject(self.dist, path)
        else:
            ckpt.confirm(self.dist, self.run_dir, path, self.cfg.checkpoint.keep)

    # -------- evaluations and checkpoints

    def evaluate(self) -> dict[str, float] | None:
        if self.eval_set is None:
            return None
        self.on_report(self.engine.flush())  # (the last step's numbers first: they may stop the run)
        cfg, step, engine = self.cfg, self.step, self.engine
        self.mlperf.eval_start(step * cfg.train.global_batch_size)
        # Every rank evaluates the whole set: FSDP's forward needs all ranks.
        eval_batch = cfg.train.eval_batch_size or cfg.train.micro_batch_size
        count = len(self.eval_set) if cfg.train.eval_batches <= 0 else \
            min(len(self.eval_set), cfg.train.eval_batches * eval_batch)
        with self.monitor.phase("eval"), self.bar.stage(f"step {step}: eval", f"{count} sequences"):
            if isinstance(engine, pipeline.PipelineEngine):
                result = engine.evaluate(self.eval_set, eval_batch, cfg.train.eval_batches)
            else:
                result = evaluate(engine.model, self.eval_set, eval_batch, self.dist.device,
                                  cfg.execution.precision, cfg.train.eval_batches)
        self.mlperf.eval_stop(step * cfg.train.global_batch_size, result["mlm_accuracy"])
        self.evaluated_at = step
        self.logger.log({"step": step, "split": "eval", **result})
        nsp = f"nsp_accuracy {result['nsp_accuracy']:.4f} " if "nsp_accuracy" in result else ""
        self.bar.print(f"step {step}: eval mlm_accuracy {result['mlm_accuracy']:.4f} {nsp}loss {result['loss']:.4f}")
        return result

    def checkpoint(self) -> None:
        """The checkpoint every ``checkpoint.every`` steps; none during a spike of the loss, and with the
        divergence guard on, one that counts only once the next step's loss is seen (on_report)."""
        self.on_report(self.engine.flush())  # its own step must be finite, and its loss seen
        if self.guard.spiking:
            return  # (the newest checkpoint stays one from before the spike)
        self.settle_unconfirmed(spiked=False)  # (an older one waiting still: its next step was normal)
        path = self.save(confirmed=not self.guard.enabled)
        if self.guard.enabled:
            self.unconfirmed = (self.step, path)

    def save(self, confirmed: bool = True) -> Path:
        if confirmed:
            self.on_report(self.engine.flush())
            self.settle_unconfirmed(spiked=self.guard.spiking)
        state = {"data": self.stream.state(), "data_fingerprint": self.data_fingerprint,
                 "train_s": self.trained_s + time.perf_counter() - self.run_started,
                 "tokens_read": self.tokens_read, "samples": self.samples}
        if self.guard.enabled:  # its history, for a resumed run to see a spike in its first steps
            state["guard"] = self.guard.state_dict()
        return ckpt.save(self.run_dir, self.step, self.engine, self.files, state, keep=self.cfg.checkpoint.keep,
                         parallel=self.cfg.execution.parallel, confirmed=confirmed)
