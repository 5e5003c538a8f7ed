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
a run directory made by a run that failed before its first step is removed.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import os
import random
import shutil
import time
from collections.abc import Callable, Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import checkpoint as ckpt
from . import pipeline_parallel, runs, weights
from .config import Config, ConfigError, DataConfig, accumulation_steps
from .data import PretrainingDataset, SyntheticDataset, build_datasets, decode_sample, vocab_size_of
from .data.checksum import fingerprint
from .data.errors import warn_prediction_cap
from .data.loader import Prefetcher, RecordStream, check_vocab_fits, is_records, masking_spec, record_files
from .dist import (
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
from .engine import BatchStream, DivergenceGuard, Engine, Preemption, autocast, set_threads, to_device
from .feed import copied_ahead, widen
from .fileio import atomic_file
from .log import MetricsLogger, ProgressBar, Throughput
from .mlperf import eval_due, eval_every_samples, open_log
from .model import (
    BertForMaskedLM,
    BertForPreTraining,
    compiled_pretraining_loss,
    eval_result,
    eval_sums,
    num_parameters,
    pretraining_loss,
)
from .optim import build_optimizer, build_scheduler
from .profile import RunMonitor


def forward_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The pre-training losses and accuracy counts of one batch (see ``pretraining_loss``).

    The batch may be compact (int32, as the loader makes it): it is widened
    here, on the device, where the loss needs int64. A batch without padding
    has no ``attention_mask``, and the model runs without one.
    """
    batch = widen(batch)
    # A compiled model comes with a compiled loss: fp32 cross-entropy over (B, P, V) logits
    # fused into a few kernels instead of materialising fp32 copies of the logits.
    loss_fn = compiled_pretraining_loss() if is_compiled(model) else pretraining_loss
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
    ``sequences``: the real sequences of the batch, for a throughput in real sequences)."""
    out = forward_loss(model, batch)
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
    for start in starts:
        indices = torch.arange(start, min(start + batch_size, len(dataset))).numpy()
        batch = to_device(dataset.batch(indices), device)
        with autocast(device, precision):
            out = forward_loss(model, batch)
        sums = [total + value for total, value in zip(sums, eval_sums(out))]
    model.train(was_training)
    return eval_result(sums, has_nsp(model))


# A test-only fault: "RANK:STEP" makes that rank exit hard after that step on a job's first
# attempt (torchrun's TORCHELASTIC_RESTART_COUNT 0), as a machine failure would.
FAULT_ENV = "BERTFORGE_TEST_FAIL_AT"


def make_run_dir(cfg: Config) -> Path:
    name = cfg.log.name or datetime.now().strftime("pretrain-%Y%m%d-%H%M%S")
    run_dir = Path(cfg.log.run_dir) / name
    suffix = 1
    while run_dir.exists():  # never mix two runs in one directory
        suffix += 1
        run_dir = Path(cfg.log.run_dir) / f"{name}-{suffix}"
    _make_dir(run_dir)
    return run_dir


def _make_dir(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # a read-only or missing parent: the user's to fix
        raise ConfigError(f"cannot create the run directory {path}: {err.strerror} (log.run_dir)") from None


def absolute_paths(cfg: Config) -> None:
    """Make the paths a run reads absolute, so that the saved config resumes from any directory."""
    for section, key in (("data", "input"), ("data", "eval_input"), ("data", "vocab"), ("checkpoint", "init"),
                         ("log", "mlperf")):
        part = getattr(cfg, section)
        value = getattr(part, key)
        if value:
            setattr(part, key, os.path.abspath(os.path.expanduser(value)))


def locate_run(cfg: Config, held: contextlib.ExitStack) -> tuple[Path | None, Path, bool]:
    """(the checkpoint to resume or None, the run directory, whether this run created it).

    On rank 0 only. ``checkpoint.resume: auto`` takes the newest checkpoint of
    ``log.run_dir/log.name`` that verifies (skipping damaged ones with a
    warning), or starts fresh there. The run directory's lock is taken into
    ``held`` first (another live run there is an error naming it); then the
    temporaries of interrupted saves are removed.
    """
    resume = cfg.checkpoint.resume
    if resume == runs.AUTO:
        run_dir = runs.auto_run_dir(cfg.log.run_dir, cfg.log.name)
        created = not run_dir.exists()
        _make_dir(run_dir)
        try:
            held.enter_context(runs.RunLock(run_dir))
            return runs.checkpoint_to_resume(resume, run_dir), run_dir, created
        except Exception:
            if created:  # nothing of a run is in it: leave nothing behind
                shutil.rmtree(run_dir, ignore_errors=True)
            raise
    if resume:
        run_dir = runs.find_checkpoint(resume).parent.parent
        held.enter_context(runs.RunLock(run_dir))
        resume_from = runs.checkpoint_to_resume(resume)
        assert resume_from is not None  # a named checkpoint, or an error
        return resume_from, run_dir, False
    run_dir = make_run_dir(cfg)
    held.enter_context(runs.RunLock(run_dir))
    return None, run_dir, True


def fingerprint_of(d: DataConfig) -> str | None:
    """The fingerprint of the files training reads, saved with every checkpoint, so that a resume
    notices data regenerated at the same path (None: synthetic data, the built-in corpus)."""
    if d.synthetic or not d.input:
        return None
    return fingerprint(record_files(d.input))


def _fail_here(rank: int, step: int) -> bool:
    fault = os.environ.get(FAULT_ENV, "")
    return (fault == f"{rank}:{step}" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0")


def load_data(cfg: Config, run_dir: Path, rank: int = 0, world_size: int = 1, *,
              pin: bool = False) -> tuple[Callable[[dict], Any], PretrainingDataset | None]:
    """(a function making this rank's training stream from a data position, the eval set).

    ``pin``: the record prefetcher puts batches in pinned memory (for a CUDA device).

    Training data is synthetic, a corpus of text (built here, see data/), or a
    directory or glob of record shards (streamed). Fixes ``data.vocab`` and
    ``model.vocab_size`` in cfg where the data decides them.
    """
    d, batch_size, seed = cfg.data, cfg.train.micro_batch_size, cfg.train.seed
    split: dict[str, Any] = {"rank": rank, "world_size": world_size}
    train: SyntheticDataset | PretrainingDataset
    eval_set: PretrainingDataset | None
    if d.synthetic:
        train = SyntheticDataset(size=max(cfg.train.global_batch_size * 64, 1024),
                                 vocab_size=cfg.model.vocab_size, seq_len=d.seq_len,
                                 max_predictions=d.max_predictions, seed=d.seed)
        return lambda position: BatchStream(train, batch_size, seed, **position, **split), None
    files = record_files(d.input) if d.input and is_records(d.input) else None
    if files is None:
        train, eval_set, vocab = build_datasets(d, run_dir, mlm_only=cfg.train.objective == "mlm")
        # The saved config names the vocab actually used, so a resume rebuilds the same data.
        d.vocab = str(Path(vocab).resolve())
        cfg.model.vocab_size = vocab_size_of(vocab)
        return lambda position: BatchStream(train, batch_size, seed, **position, **split), eval_set

    from .data.loader import read_eval_records, records_shape
    from .data.record_reader import open_records

    # The records decide the shapes. A value the config sets (on the command line or in a config
    # file, even the default value) must agree with them, or it would be silently replaced; a
    # resumed run's saved config holds the records' values.
    first, seq_len, max_predictions, header_vocab = records_shape(files)
    with open_records(first, verify=False) as records:
        packed = records.max_sequences_per_pack > 0
    if packed and (cfg.log.mlperf or eval_every_samples(cfg) > 0):
        # A step's real sequences vary with packed rows; samples are counted per step from the batch size.
        raise ConfigError(f"{first}: packed records, but train.eval_every_samples and log.mlperf count samples "
                          f"as global_batch_size per step: train on unpacked records, or use train.eval_every")
    for key, value in (("seq_len", seq_len), ("max_predictions", max_predictions)):
        given = getattr(d, key)
        if f"data.{key}" in cfg.given and given != value:
            raise ConfigError(f"data.{key}={given}, but the records have {key} {value} ({first}): leave "
                              f"data.{key} out to train on these records, or give records of {key} {given}")
        setattr(d, key, value)
    if d.seq_len > cfg.model.max_position_embeddings:
        raise ConfigError(f"{first}: sequences of {d.seq_len} exceed "
                          f"model.max_position_embeddings={cfg.model.max_position_embeddings}")
    masking = None
    if d.vocab:
        cfg.model.vocab_size = vocab_size_of(d.vocab)
        if d.dynamic_masking:
            masking = masking_spec(d.vocab, d.masked_lm_prob, d.whole_word_mask)
            warn_prediction_cap(d.seq_len, d.max_predictions, d.masked_lm_prob, f"{first} (data.dynamic_masking)")
    elif d.dynamic_masking:
        raise ConfigError("data.dynamic_masking needs data.vocab (for the [CLS], [SEP] and [MASK] ids)")
    if d.whole_word_mask and not d.dynamic_masking:
        raise ConfigError("data.whole_word_mask on records needs data.dynamic_masking (records keep the "
                          "masks they were made with: `data create --whole-word-mask` makes whole-word ones)")
    if header_vocab is not None and header_vocab != cfg.model.vocab_size:  # (TFRecords declare none)
        have = (f"data.vocab {d.vocab} has {cfg.model.vocab_size} tokens" if d.vocab
                else f"model.vocab_size={cfg.model.vocab_size}")
        raise ConfigError(f"{first}: written for a vocab of {header_vocab} tokens (its header's vocab_size), "
                          f"but {have}: give data.vocab the vocab the records were made with")
    if d.vocab and not d.dynamic_masking:  # the records' own masks: made with this vocab, or ids are shifted
        with open_records(first, verify=False) as records:
            check_vocab_fits(records, d.vocab)
    # Token ids ≥ the vocab size are refused, naming the file and record, by the readers.
    eval_set = (PretrainingDataset(read_eval_records(d.eval_input, (first, d.seq_len, d.max_predictions),
                                                     cfg.model.vocab_size)) if d.eval_input else None)

    def make_stream(position: dict) -> RecordStream | Prefetcher:
        # Every rank reads the same number of batches per epoch: none waits for another.
        stream = RecordStream(files, batch_size, seed, shuffle_buffer=d.shuffle_buffer, masking=masking,
                              vocab_size=cfg.model.vocab_size, **position, **split)
        return Prefetcher(stream, d.prefetch, pin=pin) if d.prefetch > 0 else stream
    return make_stream, eval_set


def total_steps(cfg: Config, batches_per_epoch: int, accumulation: int) -> int:
    if cfg.train.epochs > 0:
        return max(1, cfg.train.epochs * batches_per_epoch // accumulation)
    return cfg.train.steps


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


def pretrain(cfg: Config) -> dict[str, Any]:
    """Run (or resume) pre-training; returns a summary with the run directory and results.

    Under torchrun every rank calls this: rank 0 alone prints, logs and writes
    the run's shared files, and a rank that fails leaves its traceback in
    ``error_rank{N}.log`` in the run directory.
    """
    started = time.perf_counter()
    set_threads(cfg.execution.threads)
    absolute_paths(cfg)
    dist = init_distributed(cfg.execution.device, cfg.execution.dist_timeout)
    try:
        check_execution(cfg.execution, dist.world_size)
        with contextlib.ExitStack() as held:  # rank 0 holds the run directory's lock until the run ends
            # One directory, named by rank 0.
            resume_from, run_dir, created = from_main(dist, lambda: locate_run(cfg, held))
            progress = {"steps": 0}
            try:
                summary = train(cfg, dist, run_dir, resume_from, started, progress)
                barrier(dist)  # no rank leaves the group while another still talks to it
                return summary
            except Exception:
                if (created and dist.world_size == 1 and progress["steps"] == 0
                        and not runs.complete_checkpoints(run_dir)):
                    # Nothing to keep: the error on the console says it all. Under torchrun the
                    # directory stays, holding every rank's error log.
                    shutil.rmtree(run_dir, ignore_errors=True)
                else:
                    write_error(run_dir, dist)
                raise
    finally:
        destroy_distributed()


def compile_only(cfg: Config) -> dict[str, Any]:
    """``pretrain --compile-only``: compile the model and the loss for this config into the compile
    cache and stop, so that the real run's first step (and first evaluation) start warm.

    What is compiled is what the run compiles, by the run's own code: one training step on the
    first batch of the configured data and the evaluation, in a hidden run directory under
    ``log.run_dir`` that is removed afterwards. No weights or logs are kept; the cache is
    ``execution.compile_cache``. Under torchrun every rank compiles its own part (DDP, FSDP).
    """
    if not compiles(cfg.execution, resolve_device(cfg.execution.device)):
        raise ConfigError(f"execution.compile={cfg.execution.compile} does not compile on "
                          f"{resolve_device(cfg.execution.device).type} (auto: on CUDA only), so there is nothing "
                          "to compile: give the run and --compile-only --execution.compile true")
    cfg = copy.deepcopy(cfg)
    cfg.train.steps, cfg.train.epochs, cfg.train.target_mlm_accuracy = 1, 0, 0.0
    cfg.checkpoint.every, cfg.checkpoint.keep, cfg.checkpoint.resume = 0, 1, ""
    cfg.log.name = f".compile-only-{datetime.now():%Y%m%d-%H%M%S}"
    cfg.log.tensorboard = cfg.log.wandb = False
    cfg.log.mlperf = ""
    started = time.perf_counter()
    summary = pretrain(cfg)
    if summary["rank"] == 0:
        shutil.rmtree(summary["run_dir"], ignore_errors=True)
    return {"rank": summary["rank"], "seconds": time.perf_counter() - started, "run_dir": summary["run_dir"],
            "compile_cache": str(Path(cfg.execution.compile_cache or DEFAULT_COMPILE_CACHE).expanduser())}


def train(cfg: Config, dist: DistContext, run_dir: Path, resume_from: Path | None,
          started: float, progress: dict[str, int] | None = None) -> dict[str, Any]:
    """The body of ``pretrain`` on one rank, given the run directory (and the checkpoint to
    resume, already verified). ``progress["steps"]`` counts the steps this call completed."""
    progress = {"steps": 0} if progress is None else progress
    # The MLPerf log's init phase starts here (rank 0 writes; without log.mlperf it logs nothing).
    mlperf = open_log(cfg, dist, resumed=resume_from is not None)
    loaded = []
    pin = dist.device.type == "cuda"  # pinned batches copy to the GPU without the host waiting
    # The ranks that split the data: every rank, or with pipeline stages the pipelines (a pipeline's stages read alike).
    data_rank, data_world = pipeline_parallel.data_split(cfg.execution, dist)
    pipelined = cfg.execution.pipeline_stages > 1

    def load_on_main() -> tuple[str, int]:
        loaded.append(load_data(cfg, run_dir, data_rank, data_world, pin=pin))
        return cfg.data.vocab, cfg.model.vocab_size

    # Rank 0 loads first: it may train the vocab into the run directory, which the others then read.
    cfg.data.vocab, cfg.model.vocab_size = from_main(dist, load_on_main)
    make_stream, eval_set = loaded[0] if loaded else load_data(cfg, run_dir, data_rank, data_world, pin=pin)
    data_fingerprint = from_main(dist, lambda: fingerprint_of(cfg.data))
    saved = ckpt.read_trainer_state(resume_from) if resume_from else None
    if resume_from is not None:
        assert saved is not None  # read above
        saved_cfg, saved_data = weights.read_config(resume_from), saved.get("data_fingerprint")
        weights.check_model_config(saved_cfg.model, cfg.model, resume_from)
        from_main(dist, lambda: runs.check_resume(resume_from, saved_cfg, cfg, saved_data, data_fingerprint,
                                                  f"data.input {cfg.data.input}"))
    if dist.is_main:
        with atomic_file(run_dir / "config.yaml") as tmp:
            tmp.write_text(cfg.to_yaml(), encoding="utf-8")

    torch.manual_seed(cfg.train.seed)  # every rank builds the same initial weights
    random.seed(cfg.train.seed)
    # then wrapped by prepare_model
    model: nn.Module = (BertForMaskedLM if cfg.train.objective == "mlm" else BertForPreTraining)(cfg.model)
    if cfg.checkpoint.init and resume_from is None:
        weights.load_weights(model, cfg.checkpoint.init)
    try:
        accumulation = accumulation_steps(cfg.train, world_size=data_world)
    except ConfigError as err:
        raise ConfigError(f"{err} (micro-batch {cfg.train.micro_batch_size} × {data_world} "
                          f"{'pipeline' if pipelined else 'rank'}(s))") from None
    pipeline_parallel.check_micro_batches(cfg.execution, accumulation)
    stream = make_stream(saved["data"] if saved else {})
    if resume_from is not None:
        assert saved is not None  # read above
        check_resume(resume_from, saved, data_world, streamed=not isinstance(stream, BatchStream))
    steps = total_steps(cfg, stream.batches_per_epoch, accumulation)
    n_params = num_parameters(model)
    engine: Engine
    if pipelined:  # this rank's stage of the model, with its optimizer (pipeline_parallel.py)
        engine = pipeline_parallel.build_engine(model.train(), cfg.execution, cfg.train, dist, steps)
        model = engine.model
    else:
        model = prepare_model(model.train(), cfg.execution, dist)
        optimizer = build_optimizer(unwrap(model), cfg.train,
                                    compiled=compiles_optimizer(cfg.execution, dist.device))
        engine = Engine(model, optimizer, build_scheduler(optimizer, cfg.train, steps), training_loss,
                        cfg.execution.precision, cfg.train.grad_clip, dist, seed=cfg.train.seed)
    step = ckpt.resume(resume_from, engine, verified=True)["step"] if resume_from is not None else 0

    with contextlib.ExitStack() as stack:
        stack.callback(stream.close)
        logger = stack.enter_context(MetricsLogger(run_dir, cfg, enabled=dist.is_main, start_step=step))
        engine.preemption = preemption = stack.enter_context(Preemption())
        bar = stack.enter_context(ProgressBar(steps, step, enabled=cfg.log.progress, main=dist.is_main))
        monitor = stack.enter_context(RunMonitor(cfg, run_dir, dist, logger, bar.print, start_step=step,
                                                 total_steps=steps, started=started))
        bar.print(f"run directory: {run_dir}")
        ranks = f" × {dist.world_size} ranks ({cfg.execution.parallel})" if dist.world_size > 1 else ""
        if pipelined:
            ranks = (f" × {data_world} pipeline(s) of {cfg.execution.pipeline_stages} stages "
                     f"({cfg.execution.pipeline_schedule})")
        bar.print(f"model: {n_params / 1e6:.2f}M parameters, "
                  f"{cfg.model.num_hidden_layers} layers, hidden {cfg.model.hidden_size}; "
                  f"{stream.num_sequences} training sequences of {cfg.data.seq_len}; "
                  f"global batch {cfg.train.global_batch_size} = {cfg.train.micro_batch_size} × "
                  f"{accumulation}{ranks}")
        batch, target = cfg.train.global_batch_size, cfg.train.target_mlm_accuracy
        mlperf.run_start(cfg, accumulation, steps, len(eval_set) if eval_set is not None else 0)
        # Time to train: the timed region from here to the stop, summed over a resumed run's parts.
        run_started, trained_s = time.perf_counter(), saved.get("train_s", 0.0) if saved else 0.0
        evaluated_at = -1  # the step of the newest evaluation

        def run_eval() -> dict[str, float] | None:
            nonlocal evaluated_at
            if eval_set is None:
                return None
            mlperf.eval_start(step * batch)
            # Every rank evaluates the whole set: FSDP's forward needs all ranks.
            with monitor.phase("eval"):
                eval_batch = cfg.train.eval_batch_size or cfg.train.micro_batch_size
                if isinstance(engine, pipeline_parallel.PipelineEngine):
                    result = engine.evaluate(eval_set, eval_batch, cfg.train.eval_batches)
                else:
                    result = evaluate(model, eval_set, eval_batch, dist.device, cfg.execution.precision,
                                      cfg.train.eval_batches)
            mlperf.eval_stop(step * batch, result["mlm_accuracy"])
            evaluated_at = step
            logger.log({"step": step, "split": "eval", **result})
            nsp = f"nsp_accuracy {result['nsp_accuracy']:.4f} " if "nsp_accuracy" in result else ""
            bar.print(f"step {step}: eval mlm_accuracy {result['mlm_accuracy']:.4f} {nsp}loss {result['loss']:.4f}")
            return result

        def reached(result: dict[str, float] | None) -> bool:
            return target > 0 and result is not None and result["mlm_accuracy"] >= target

        def save() -> Path:
            return ckpt.save(run_dir, step, engine, cfg, {"data": stream.state(), "data_fingerprint": data_fingerprint,
                                                          "train_s": trained_s + time.perf_counter() - run_started})

        first_eval = last_eval = run_eval() if step == 0 and cfg.train.eval_at_start else None
        first_loss = last_loss = None
        throughput = Throughput()
        guard = DivergenceGuard(cfg.train.divergence_factor, cfg.train.divergence_steps)
        final_checkpoint: Path | None = None
        micro_batches: Iterable[dict[str, torch.Tensor]]
        while step < steps and not reached(last_eval):  # (the target may be reached at 0 samples)
            lr = engine.lr
            mlperf.train(step * batch)
            if step == 0 and cfg.data.vocab and not cfg.data.synthetic:  # what the model is fed, for a person
                first = stream.next()
                bar.print(f"sample: {decode_sample(first, cfg.data.vocab)[:400]}")
                micro_batches = itertools.chain([first], (stream.next() for _ in range(accumulation - 1)))
            else:
                micro_batches = (stream.next() for _ in range(accumulation))
            with monitor.step(step):  # memory, step times and the --profile window
                # On CUDA each micro-batch's copy overlaps the compute of the one before.
                out = engine.step(copied_ahead(micro_batches, dist.device), accumulation, step)
            step += 1
            progress["steps"] += 1
            if _fail_here(dist.rank, step):
                os._exit(1)
            sequences = out.pop("sequences", None)  # packed rows: real sequences per micro-batch, averaged
            throughput.add(cfg.train.global_batch_size if sequences is None else
                           round(sequences.item() * cfg.train.global_batch_size / cfg.train.micro_batch_size))
            if step % cfg.log.every == 0 or step == steps or step == 1:
                values = {k: v.item() for k, v in out.items()}
                first_loss = values["loss"] if first_loss is None else first_loss
                last_loss = values["loss"]
                seq_per_s = throughput.rate()
                logger.log({"step": step, **values, "lr": lr, "seq_per_s": seq_per_s, "epoch": stream.epoch,
                            **monitor.row()})
                nsp = f"nsp {values['nsp_loss']:.3f} " if "nsp_loss" in values else ""
                bar.update(step, f"loss {values['loss']:.3f} mlm {values['mlm_loss']:.3f} {nsp}{seq_per_s:.0f} seq/s")
            else:
                bar.update(step)
            if guard.enabled:  # one more host sync per step, only when asked for
                guard.update(step, out["loss"].item())
            if eval_due(cfg, step) and step < steps:  # (the last step's evaluation comes after the loop)
                last_eval = run_eval()
                if reached(last_eval):
                    break
            if engine.stop_requested and step < steps:  # every rank stops after this same step
                final_checkpoint = save()
                bar.print(preemption.message(step, final_checkpoint, run_dir))
                break
            if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step < steps and not guard.spiking:
                save()  # (none during a spike: the newest checkpoint stays one from before it)
        preempted = final_checkpoint is not None
        status = time_to_train = None
        if final_checkpoint is None:
            if evaluated_at != step:
                last_eval = run_eval() or last_eval
            time_to_train = round(trained_s + time.perf_counter() - run_started, 3)
            if target > 0:  # success: an evaluation reached the target; aborted: the steps ran out first
                status = "success" if reached(last_eval) else "aborted"
                logger.log({"step": step, "split": "result", "status": status, "time_to_train_s": time_to_train,
                            "samples_to_train": step * batch})
                bar.print(f"{status}: masked-LM accuracy target {target} "
                          f"{'reached' if status == 'success' else 'not reached'} after {step * batch} samples "
                          f"({step} steps); time to train {time_to_train} s")
            mlperf.run_stop(step * batch, status or "aborted")
            final_checkpoint = save()
        summary = {
            "run_dir": str(run_dir), "checkpoint": str(final_checkpoint), "steps": step, "preempted": preempted,
            "status": status, "time_to_train_s": time_to_train, "samples_to_train": step * batch,
            "first_loss": first_loss, "last_loss": last_loss,
            "first_eval": first_eval, "last_eval": last_eval,
            "wall_s": round(time.perf_counter() - started, 1),
            "rank": dist.rank, "world_size": dist.world_size,
        }
        if not preempted:
            bar.print(f"done in {summary['wall_s']} s; checkpoint: {final_checkpoint}")
    return summary
