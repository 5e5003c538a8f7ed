"""What every fine-tuning job shares: its config, its run directory and its training loop.

A job (SQuAD, GLUE, NER) is a :class:`Job`: the model with its weights
loaded, the training rows, the loss, and what to evaluate and write at the
end. :func:`launch` starts one under torchrun or alone (one run per run
directory, resumed with ``--resume``), and :func:`train` runs its steps
through the training engine (:mod:`bertforge.training.engine`), as pre-training does:
one optimizer step consumes ``train.global_batch_size`` rows in
micro-batches, split over the ranks, from a seeded permutation per epoch (the
last partial micro-batch dropped), with dropout seeded per micro-batch so that
any world size gives the same losses. ``train.epochs`` epochs make
``epochs × (rows // global_batch_size)`` steps.

The task's own settings are a section of the YAML config (``squad:``,
``finetune:``), a dataclass read by :func:`load_config` and saved beside
``config.yaml`` in the run directory (``squad.yaml``, ``finetune.yaml``); that
file also marks the directory as a fine-tuning run of that kind.

The loop (:func:`train`, :class:`Finetuning`) is a short composition of the
pieces pre-training's loop (``training/pretrain.py``, :class:`Pretraining`)
is made of too: the engine's step, its ``report`` of the step before read
without waiting and its ``flush`` before a checkpoint or an evaluation,
``stop_requested`` after a signal (:class:`~bertforge.training.engine.Preemption`
and its message), :class:`~bertforge.training.engine.BatchStream`'s data
position, ``checkpoint.save`` and ``resume``, the metrics logger, progress bar,
run monitor and throughput of ``observe/``. The loop over them is not one
function that both call: pre-training's adds what fine-tuning has no use for
and what a shared loop would have to carry as options on every step,
checkpoints that count only once the next step's loss is seen (the divergence
guard), MLPerf's markers and its evaluation cadence in samples, a target
accuracy that ends the run, pipeline stages with their own evaluation,
micro-batches copied ahead to the GPU and throughput in real sequences of
packed rows; a change there would also change the numbers of pre-training's
tests and benchmarks. What fine-tuning adds, evaluating and predicting on rank
0 with the whole (gathered) model, pre-training has no use for.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import shutil
import time
import typing
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from torch import nn

from bertforge import runs
from bertforge.config import (
    Config,
    ConfigError,
    ExecutionConfig,
    LogConfig,
    ModelConfig,
    TrainConfig,
    _coerce,
    accumulation_steps,
    apply_dict,
    freeze,
    given_length_wins,
    load_yaml,
    resolve_config_path,
    set_value,
    validate,
)
from bertforge.data.checksum import fingerprint
from bertforge.data.errors import DataError
from bertforge.data.vocab import check_model_vocab
from bertforge.fileio import LOCK, atomic_file, atomic_files, refuse_live_runs, remove
from bertforge.formats import tf1, weights
from bertforge.formats.hf import find_model, hf_config_from_model_config, hf_head_config, resolve_model
from bertforge.formats.load import load_model, vocab_beside
from bertforge.observe.log import MetricsLogger, ProgressBar, Throughput, pass_progress
from bertforge.observe.profile import RunMonitor
from bertforge.parallel.dist import (
    DistContext,
    barrier,
    check_execution,
    destroy_distributed,
    from_main,
    init_distributed,
    is_sharded,
    prepare_model,
    unwrap,
    write_error,
)
from bertforge.training import checkpoint as ckpt
from bertforge.training.engine import (
    Batches,
    BatchStream,
    Engine,
    LossFn,
    Preemption,
    StepReport,
    autocast,
    due,
    set_threads,
)
from bertforge.training.optim import build_optimizer, build_scheduler, cast_weights

from . import FinetuneError

# ------------------------------------------------------------------ config


def set_section(section: Any, prefix: str, key: str, value: Any, source: str = "") -> None:
    """``section.key = value``, coerced to the field's type; an unknown key is named with the known ones."""
    cls = type(section)
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    where = f" in {source}" if source else ""
    if key not in names:
        raise ConfigError(f"unknown config key '{prefix}.{key}'{where} (keys of {prefix}: {', '.join(names)})")
    setattr(section, key, _coerce(f"{prefix}.{key}", value, hints[key]))


def load_config(section: Any, prefix: str, default: str, name: str | None = None,
                overrides: Sequence[tuple[str, Any]] = (), resume: str | Path | None = None,
                out_dir: str | Path | None = None) -> Config:
    """Defaults, then a YAML config, then dotted overrides; ``prefix.*`` keys go to ``section``.

    The YAML is ``name``, else (with ``resume``) the resumed run's own
    ``config.yaml`` and ``{prefix}.yaml``, else ``default``. ``resume: auto``
    resumes the run in ``out_dir`` when it is one of this kind with a checkpoint
    (:func:`locate_run`), so its files are read then too. ``section`` (a
    dataclass) is filled in place; the Config is returned, not yet validated
    against the section (the caller checks what depends on both).
    """
    cfg = Config()
    path: Path | None
    if name is None and resume == runs.AUTO and out_dir and (Path(out_dir) / f"{prefix}.yaml").is_file():
        resume = runs.find_resumable(Path(out_dir), only=["config.yaml"], warn=False)  # None: a fresh start
    if name is None and resume and resume != runs.AUTO:  # auto without a run to resume: the command's config
        checkpoint = runs.find_checkpoint(resume)
        path = checkpoint / "config.yaml"
        data = dict(load_yaml(path) or {})
        section_file = checkpoint.parent.parent / f"{prefix}.yaml"
        if section_file.is_file():
            data[prefix] = load_yaml(section_file)
    else:
        path = resolve_config_path(name or default)
        if path is None:
            raise ConfigError(f"config {name!r} is a model preset; a fine-tuning run takes its model from --init")
        data = load_yaml(path)
    if not isinstance(data, dict):
        raise ConfigError(f"config in {path}: expected a mapping of sections, got {data!r}")
    data = dict(data)
    body = data.pop(prefix, None) or {}
    if not isinstance(body, dict):
        raise ConfigError(f"{prefix} in {path}: expected a mapping, got {body!r}")
    apply_dict(cfg, data, source=str(path))
    for key, value in body.items():
        set_section(section, prefix, key, value, str(path))
    for key, value in overrides:
        if key.startswith(prefix + "."):
            set_section(section, prefix, key[len(prefix) + 1:], value)
        else:
            set_value(cfg, key, value)
    given_length_wins(cfg, [key for key, _ in overrides])
    validate(cfg)
    return cfg


def read_section(section: Any, prefix: str, run_dir: Path) -> Any:
    """``section`` updated from a fine-tuned model's ``{prefix}.yaml``, when it has one."""
    path = Path(run_dir) / f"{prefix}.yaml"
    if path.is_file():
        body = load_yaml(path) or {}
        if not isinstance(body, dict):
            raise ConfigError(f"{path}: expected a mapping, got {body!r}")
        for key, value in body.items():
            set_section(section, prefix, key, value, str(path))
    return section


def write_run_files(out_dir: Path, config_yaml: str, section: Any, prefix: str, vocab: Path) -> None:
    """The settings of a fine-tuning run, written when it starts: config.yaml (``config_yaml``, the
    run config's ``to_yaml()``), {prefix}.yaml, the vocab as vocab.txt or tokenizer.json (which
    prediction then finds beside the model)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with atomic_file(out_dir / "config.yaml") as tmp:
        tmp.write_text(config_yaml, encoding="utf-8")
    with atomic_file(out_dir / f"{prefix}.yaml") as tmp:
        tmp.write_text(yaml.safe_dump(dataclasses.asdict(section), sort_keys=False), encoding="utf-8")
    copy = out_dir / runs.vocab_file_name(vocab)
    if Path(vocab).resolve() != copy.resolve():
        with atomic_file(copy) as tmp:
            shutil.copyfile(vocab, tmp)


def find_vocab(model_path: str | Path, vocab: str | Path | None = None) -> Path:
    """``vocab`` if given (a vocab.txt or a tokenizer.json), else the one beside the weights: ``vocab.txt``,
    else ``tokenizer.json`` (a ModernBERT's); an error naming both when neither exists."""
    if vocab:
        vocab = Path(vocab)
        if not vocab.is_file():
            raise FinetuneError(f"vocab not found: {vocab}")
        return vocab
    found = vocab_beside(model_path, FinetuneError)
    if found is None:
        raise FinetuneError(f"{find_model(model_path, FinetuneError)}: no vocab.txt or tokenizer.json beside the "
                            f"model; pass --vocab")
    return found


def load_checked(path: str | Path, vocab: Path, head: str, num_labels: int | None = None) -> nn.Module:
    """The model at ``path`` with ``head`` (new when the source has none: a warning is expected and
    silenced), checked against the vocab; on the CPU."""
    path = find_model(path, FinetuneError)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a new head is expected when fine-tuning an encoder
        model = load_model(path, head=head, num_labels=num_labels)
    config = typing.cast(ModelConfig, model.config)
    try:
        check_model_vocab(vocab, config.vocab_size, vocab_beside(path), path)
    except DataError as err:  # (fine-tuning's errors are FinetuneErrors)
        raise FinetuneError(str(err)) from None
    return model


def save_finetuned(model: nn.Module, out_dir: Path, labels: list[str] | None = None) -> Path:
    """The fine-tuned weights beside the run files: ``model.safetensors`` and ``config.json`` (so
    that ``transformers``' ``BertFor….from_pretrained(dir)`` loads the directory as it is; a
    classifier's labels named), written together (:func:`atomic_files`): a directory holds a
    whole model or none (``load_model`` then reads its newest checkpoint), never a
    ``config.json`` without its weights; a full disk is a WriteError naming the space it needs.

    The weights are renamed into place first: ``load_model`` needs only them beside
    ``config.yaml``, and ``config.json``, last, marks the pair whole for other readers."""
    hf = {**hf_config_from_model_config(typing.cast(ModelConfig, model.config), [type(model).__name__]),
          **hf_head_config(model, labels), "dtype": "float32"}
    text = json.dumps(hf, indent=2) + "\n"
    finals = [out_dir / "model.safetensors", out_dir / "config.json"]
    with atomic_files(finals, ckpt.nbytes(model.state_dict()) + len(text.encode())) as (weights_tmp, json_tmp):
        weights.save_weights(model, weights_tmp)
        json_tmp.write_text(text, encoding="utf-8")
    return out_dir


def saved_line(summary: dict[str, Any]) -> str:
    """What a run's end left, for its summary: the model, or after a signal only the checkpoint
    (the model waits for the run to finish)."""
    if summary.get("preempted"):
        return (f"checkpoint: {summary['checkpoint']} (stopped early: no model yet; continue with "
                f"--resume {summary['out_dir']})")
    return f"model: {summary['out_dir']}"


# ------------------------------------------------------------------ run directories


def prepare_out_dir(log: LogConfig, out_dir: str | Path | None, overwrite: bool = False,
                    inputs: Sequence[str | Path | None] = (), kind: str = "finetune") -> Path:
    """The directory of a new run: a new (or empty) one, never someone's files; checked before
    anything is touched; without ``out_dir``, ``log.run_dir/log.name`` (a timestamp without a name).

    A non-empty one is refused unless ``overwrite`` (``--out DIR --overwrite``: the user named
    the directory), and then still when it holds one of ``inputs`` (the ``--init`` weights, the
    data files, the vocab) or the current directory. Its files are removed later, under the
    run's lock (:func:`new_run_dir`).
    """
    path = Path(out_dir) if out_dir else (
        Path(log.run_dir) / (log.name or datetime.now().strftime(f"{kind}-%Y%m%d-%H%M%S")))
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{path} exists and is not a directory: choose another --out")
    if not path.exists() or all(p.name == LOCK for p in path.iterdir()):  # a lock left by a killed run
        return path
    if not overwrite:
        raise ConfigError(f"{path} already exists and is not empty: pass --resume {path} to continue "
                          f"its run, --overwrite to replace it, or choose another --out")
    root = path.resolve()
    for kept in [Path.cwd(), *(Path(x) for x in inputs if x)]:
        kept = kept.resolve()
        if kept == root or root in kept.parents:
            raise ConfigError(f"--overwrite would delete {kept}, which is in {path}: choose another --out")
    return path


def clear_out_dir(path: Path, own: Path | None = None) -> None:
    """Remove the files of ``path`` but its lock, after refusing (a WriteError naming it) when a
    live run writes in it, below it or above it; ``own`` is this run's lock, held."""
    if not path.is_dir():
        return
    refuse_live_runs(path, own)
    for entry in sorted(path.iterdir()):
        if entry.name != LOCK:
            remove(entry)


def check_overwrite(out_dir: str | Path, inputs: dict[str, str | Path | None]) -> None:
    """``--overwrite``: every input (``{flag: path}``) must exist before ``out_dir`` is cleared, so
    that a mistyped path does not cost the old run."""
    for flag, value in inputs.items():
        if value and not (resolve_model(value) if flag == "--init" else Path(value)).exists() \
                and not (flag == "--init" and tf1.find_prefix(value)):
            raise FinetuneError(f"{flag} {value}: not found (nothing in {out_dir} was removed)")


def locate_run(resume: str, log: LogConfig, out_dir: str | Path | None, held: contextlib.ExitStack, marker: str,
               kind: str = "finetune", overwrite: bool = False,
               inputs: Sequence[str | Path | None] = ()) -> tuple[Path | None, Path]:
    """(the checkpoint to resume, verified, or None; the run directory), on rank 0.

    ``resume`` is ``checkpoint.resume``: ``auto`` resumes the newest sound checkpoint of ``--out``
    when it is a fine-tuning run directory of this kind (it has ``marker``, its
    settings file), skipping damaged ones with a warning, and starts fresh
    there otherwise. The run directory's lock is taken into ``held`` first
    (another live run there is an error naming it); then the temporaries of
    interrupted saves are removed, or with ``overwrite`` (a new run) the old
    run's files (:func:`prepare_out_dir` checks ``inputs`` first).
    """
    if resume == runs.AUTO:
        run_dir = Path(out_dir) if out_dir else runs.auto_run_dir(log.run_dir, log.name, "--out")
        if (run_dir / marker).is_file():  # ours: never take a pre-training run's checkpoints
            held.enter_context(runs.RunLock(run_dir))
            # None: it started before and failed before its first checkpoint; start again there.
            return runs.checkpoint_to_resume(resume, run_dir), run_dir
        return None, new_run_dir(prepare_out_dir(log, run_dir, kind=kind), held)
    if resume:
        run_dir = runs.find_checkpoint(resume).parent.parent
        held.enter_context(runs.RunLock(run_dir))
        resume_from = runs.checkpoint_to_resume(resume)
        assert resume_from is not None  # a named checkpoint, or an error
        return resume_from, run_dir
    return None, new_run_dir(prepare_out_dir(log, out_dir, overwrite, inputs, kind), held, overwrite)


def new_run_dir(run_dir: Path, held: contextlib.ExitStack, overwrite: bool = False) -> Path:
    """Take ``run_dir``'s lock into ``held``, making the directory first when it is missing (of runs
    started at once, one goes on); with ``overwrite``, then remove the old run's files. One made
    here goes again, when ``held`` closes, if the run wrote nothing into it (refused for bad
    input, say)."""
    lock = held.enter_context(runs.RunLock(run_dir, create=True))  # a live run there: refused, named
    if lock.created:
        held.callback(_remove_if_unused, run_dir)  # with the lock still held (an ExitStack unwinds backwards)
    if overwrite:
        clear_out_dir(run_dir, own=lock.path)
    return run_dir


def _remove_if_unused(run_dir: Path) -> None:
    """Remove a run directory that holds nothing but its lock: a run refused for bad input leaves nothing."""
    if run_dir.is_dir() and {p.name for p in run_dir.iterdir()} <= {LOCK}:
        runs.remove_run_dir(run_dir)


def launch(execution: ExecutionConfig, log: LogConfig, resume: str, out_dir: str | Path | None, marker: str,
           kind: str, body: Callable[[DistContext, Path, Path | None, float], dict[str, Any]],
           overwrite: bool = False, inputs: Sequence[str | Path | None] = ()) -> dict[str, Any]:
    """Run ``body(dist, run_dir, resume_from, started)`` on every rank, alone or under torchrun.

    Rank 0 finds the run directory (:func:`locate_run`, from ``resume``: ``checkpoint.resume``, and
    ``log``; with ``overwrite`` a new run replaces the one in ``out_dir``, which must not hold
    ``inputs``) and holds its lock until the run ends; a failing rank writes its traceback into
    the run directory when there are several. ``execution`` starts the processes.
    """
    started = time.perf_counter()
    set_threads(execution.threads)
    dist = init_distributed(execution.device, execution.dist_timeout)
    try:
        check_execution(execution, dist.world_size)
        with contextlib.ExitStack() as held:  # rank 0 holds the run directory's lock until the run ends
            resume_from, run_dir = from_main(dist, lambda: locate_run(resume, log, out_dir, held, marker, kind,
                                                                        overwrite, inputs))
            try:
                summary = body(dist, run_dir, resume_from, started)
                barrier(dist)
                return summary
            except Exception:
                if dist.world_size > 1:  # one process has its traceback on the console
                    write_error(run_dir, dist)
                raise
    finally:
        destroy_distributed()


def forward_in_batches(model: nn.Module, features: Any, batch_size: int, device: torch.device | str,
                       precision: str, trim_padding: bool = True) -> Iterator[tuple[np.ndarray, int, Any]]:
    """``(rows, width, output)`` of the model on every batch of fixed-length features, in eval mode
    without gradients (the model's mode is restored after).

    With ``trim_padding`` the features are batched longest first and each batch is cut to its
    longest real sequence (``width``): padding is masked out of attention and comes last, so the
    real positions' outputs are those of the padded batch, for less work. Else rows go in order
    at full width.
    """
    device = torch.device(device)
    was_training = model.training
    model.eval()
    count, full = features.input_ids.shape
    lengths = features.input_mask.sum(axis=1)
    order = np.argsort(-lengths, kind="stable") if trim_padding else np.arange(count)
    try:
        with pass_progress(math.ceil(count / batch_size)) as advance:  # shown when a Stage is around
            for first in range(0, count, batch_size):
                rows = order[first:first + batch_size]
                width = max(int(lengths[rows].max()), 1) if trim_padding else full
                with torch.inference_mode(), autocast(device, precision):
                    output = model(torch.from_numpy(features.input_ids[rows, :width]).to(device),
                                   torch.from_numpy(features.segment_ids[rows, :width]).to(device),
                                   torch.from_numpy(features.input_mask[rows, :width]).to(device))
                yield rows, width, output
                advance(1)
    finally:
        model.train(was_training)


# ------------------------------------------------------------------ the training loop


class FeatureRows:
    """Fixed-length features as the engine's batches: ``input_ids``, ``token_type_ids`` (the
    features' ``segment_ids``), ``attention_mask`` (``input_mask``) and the ``targets`` columns,
    the rows of a batch in file order."""

    def __init__(self, features: Any, targets: Sequence[str] = ("labels",)):
        self.features, self.targets = features, tuple(targets)

    def __len__(self) -> int:
        return len(self.features.input_ids)

    def batch(self, indices: Any) -> dict[str, torch.Tensor]:
        rows, f = np.sort(indices), self.features
        return {"input_ids": torch.from_numpy(f.input_ids[rows]),
                "token_type_ids": torch.from_numpy(f.segment_ids[rows]),
                "attention_mask": torch.from_numpy(f.input_mask[rows]),
                **{name: torch.from_numpy(getattr(f, name)[rows]) for name in self.targets}}


@dataclass
class Job:
    """One fine-tuning task as :func:`train` sees it."""

    kind: str                                    # "squad", "glue", "ner": the progress bar's label
    model: nn.Module                             # its weights loaded (from --init or the checkpoint), on the CPU
    rows: Batches                                # the training rows
    loss_fn: LossFn
    data_files: list[Path]                       # what the resume fingerprint covers
    description: str                             # what it trains on, for the first console line
    rebuild: Callable[[], nn.Module]             # an untrained model of the same shape (to gather FSDP shards)
    write_settings: Callable[[Path], None]       # rank 0, when a run starts: config and settings files
    save: Callable[[nn.Module, Path], Any]       # rank 0, at the end: the fine-tuned model's files
    evaluate: Callable[[nn.Module], dict[str, float]] | None = None  # rank 0, whole model: dev scores
    # rank 0 at the end, whole model: predictions written; its "scores" are logged, all of it summarised
    finish: Callable[[nn.Module, Path], dict[str, Any]] | None = None
    describe: Callable[[dict[str, float]], str] = lambda scores: " ".join(
        f"{k} {v:.4f}" for k, v in scores.items() if isinstance(v, float))
    counts: dict[str, int] = field(default_factory=dict)  # of the training data, for the summary


def full_model(model: nn.Module, job: Job, dist: DistContext) -> nn.Module | None:
    """The whole model for prediction and saving on rank 0; None on the others under FSDP.

    Under FSDP every rank must take part in gathering the shards, so every
    rank calls this; otherwise it is the model itself, unwrapped.
    """
    inner = unwrap(model)
    if not is_sharded(inner):
        return inner
    state = weights.full_state_dict(inner)
    if not dist.is_main:
        return None
    whole = job.rebuild()
    whole.load_state_dict(state)
    return whole.to(dist.device)


def train(cfg: Config, job: Job, dist: DistContext, out_dir: Path, resume_from: Path | None,
          source: str | Path | None, log: Callable[[str], None], started: float) -> dict[str, Any]:
    """Fine-tune ``job`` on one rank: its steps, checkpoints, evaluations and final files.

    Returns a summary: out_dir, checkpoint, steps, losses (one per optimizer
    step of this process), rank, world_size, preempted, minutes, and what
    ``job.finish`` returned (scores, prediction files). ``cfg`` is the resolved config, read
    frozen from here on; it enters here whole because the checkpoints, the metrics logger and
    the run monitor record it whole, and the parts below take its sections.
    """
    cfg = freeze(cfg)
    t = cfg.train
    accumulation, total = step_counts(t, len(job.rows), job.data_files, dist.world_size)
    saved = ckpt.read_trainer_state(resume_from) if resume_from else None
    data_fingerprint = fingerprint(job.data_files)
    if resume_from is not None:
        assert saved is not None  # read above
        saved_cfg, saved_data = weights.read_config(resume_from), saved.get("data_fingerprint")
        what = f"the training data {', '.join(map(str, job.data_files))}"
        from_main(dist, lambda: runs.check_resume(resume_from, saved_cfg, cfg, saved_data, data_fingerprint, what))
    stream = BatchStream(job.rows, t.micro_batch_size, t.seed, **(saved["data"] if saved else {}),
                         rank=dist.rank, world_size=dist.world_size)
    engine = finetuning_engine(job, t, cfg.execution, dist, total)
    step = ckpt.resume(resume_from, engine, verified=True)["step"] if resume_from is not None else 0
    if dist.is_main and resume_from is None:
        job.write_settings(out_dir)
    log(f"fine-tuning {source or resume_from} on {job.description} for {total} steps of "
        f"{t.global_batch_size} = {t.micro_batch_size} × {accumulation}{ranks_of(dist, cfg.execution)} "
        f"on {dist.device}; run directory {out_dir}")

    def checkpoint(at: int) -> Path:  # the engine's state, the data position and the data's fingerprint
        return ckpt.save(out_dir, at, engine, ckpt.RunFiles(cfg.to_yaml(), cfg.data.vocab),
                         {"data": stream.state(), "data_fingerprint": data_fingerprint},
                         keep=cfg.checkpoint.keep, parallel=cfg.execution.parallel)

    with contextlib.ExitStack() as stack:
        logger = stack.enter_context(MetricsLogger(out_dir, cfg.log, enabled=dist.is_main, start_step=step,
                                                   run_config=cfg.to_dict()))
        engine.preemption = preemption = stack.enter_context(Preemption())
        bar = stack.enter_context(ProgressBar(total, step, enabled=cfg.log.progress, main=dist.is_main,
                                              label=job.kind, every_s=cfg.log.progress_every_s))
        monitor = stack.enter_context(RunMonitor(cfg.execution, cfg.log, out_dir, dist, logger, bar.print,
                                                 start_step=step, total_steps=total, started=started))
        view = RunView(logger, bar, monitor, preemption, log)
        loop = Finetuning(job, dist, engine, stream, view, StepLog(view, cfg.log.every, total, t.global_batch_size),
                          accumulation, total, checkpoint)
        preempted = loop.run(step, t.eval_every, cfg.checkpoint.every, out_dir)
        summary = loop.finish(out_dir, preempted)
    summary["minutes"] = (time.perf_counter() - started) / 60
    return summary


def step_counts(t: TrainConfig, rows: int, data_files: Sequence[Path], world_size: int) -> tuple[int, int]:
    """(micro-batches per rank and step, optimizer steps in all): ``train.epochs`` epochs of whole
    global batches, or ``train.steps``."""
    accumulation = accumulation_steps(t, world_size=world_size)
    steps_per_epoch = rows // t.global_batch_size
    if steps_per_epoch == 0:
        raise ConfigError(f"{', '.join(map(str, data_files))} gives {rows} training rows, fewer "
                          f"than train.global_batch_size={t.global_batch_size}")
    return accumulation, t.epochs * steps_per_epoch if t.epochs > 0 else t.steps


def finetuning_engine(job: Job, t: TrainConfig, execution: ExecutionConfig, dist: DistContext,
                      total: int) -> Engine:
    """The job's model as this rank trains it (DDP or FSDP applied), its optimizer and schedule."""
    wrapped = prepare_model(cast_weights(job.model.train(), t), execution, dist)
    optimizer = build_optimizer(unwrap(wrapped), t)
    return Engine(wrapped, optimizer, build_scheduler(optimizer, t, total), job.loss_fn,
                  execution.precision, t.grad_clip, dist, seed=t.seed, grad_sync=execution.grad_sync,
                  loss_scale=t.loss_scale, scaled_state=t.scaled_optimizer_state,
                  optimizer_in_backward=t.optimizer_in_backward)


def ranks_of(dist: DistContext, execution: ExecutionConfig) -> str:
    """`` × W ranks (ddp)`` for the first console line; nothing for one process."""
    return f" × {dist.world_size} ranks ({execution.parallel})" if dist.world_size > 1 else ""


@dataclass
class RunView:
    """What a run shows and records as it goes: its metrics file, progress bar and run monitor,
    the signal that stops it, and the console line of rank 0."""

    logger: MetricsLogger
    bar: ProgressBar
    monitor: RunMonitor
    preemption: Preemption
    log: Callable[[str], None]


class StepLog:
    """A finished step's numbers, read without waiting (see training/engine.py), logged when due:
    every ``every`` steps, the first and the last."""

    def __init__(self, view: RunView, every: int, total: int, global_batch_size: int):
        self.view, self.every, self.total, self.global_batch_size = view, every, total, global_batch_size
        self.losses: list[float] = []  # of every step of this process
        self.throughput = Throughput()
        # The lr and epoch of the steps whose numbers have not arrived (they come a step later).
        self.started_at: dict[int, tuple[float, int]] = {}

    def begin(self, step: int, lr: float, epoch: int) -> None:
        """Step ``step + 1`` starts, at this lr in this epoch (the epoch it reads: the stream moves on after it)."""
        self.started_at[step + 1] = lr, epoch

    def __call__(self, report: StepReport | None) -> None:
        if report is None:
            return
        done, values, view = report.step, report.values, self.view
        lr, epoch = self.started_at.pop(done)
        self.losses.append(values["loss"])
        self.throughput.add(self.global_batch_size)
        if not (done % self.every == 0 or done == self.total or done == 1):
            view.bar.update(done)
            return
        seq_per_s = self.throughput.rate()
        view.logger.log({"step": done, **values, "lr": lr, "seq_per_s": seq_per_s, "epoch": epoch,
                         **view.monitor.row()})
        view.bar.update(done, f"loss {values['loss']:.4f} lr {lr:.3g} {seq_per_s:.1f} seq/s")
        if not view.bar.live:  # no bar: a line per logged step (--no-progress)
            view.log(f"step {done}/{self.total} epoch {epoch + 1} loss {values['loss']:.4f} lr {lr:.3g}")


class Finetuning:
    """One rank's fine-tuning once its engine, data and view are set up: the steps, evaluations,
    checkpoints (``checkpoint(step)`` writes one) and the end."""

    def __init__(self, job: Job, dist: DistContext, engine: Engine, stream: BatchStream, view: RunView,
                 step_log: StepLog, accumulation: int, total: int, checkpoint: Callable[[int], Path]):
        self.job, self.dist, self.engine, self.stream, self.view = job, dist, engine, stream, view
        self.step_log, self.accumulation, self.total, self.checkpoint = step_log, accumulation, total, checkpoint
        self.step = 0

    def run(self, step: int, eval_every: int, checkpoint_every: int, out_dir: Path) -> Path | None:
        """Train from ``step`` to the end or a signal; the checkpoint written for the signal, else None."""
        engine, stream, self.step = self.engine, self.stream, step
        while self.step < self.total:
            self.step_log.begin(self.step, engine.lr, stream.epoch)
            with self.view.monitor.step(self.step):  # memory, step times and the --profile window
                engine.step((stream.next() for _ in range(self.accumulation)), self.accumulation, self.step)
            self.step += 1
            self.step_log(engine.report)
            if due(eval_every, self.step, self.total):
                self.step_log(engine.flush())
                self.evaluate()
            if engine.stop_requested and self.step < self.total:  # every rank stops after this same step
                preempted = self.save()
                self.view.bar.print(self.view.preemption.message(self.step, preempted, out_dir))
                return preempted
            if due(checkpoint_every, self.step, self.total):
                self.save()
        return None

    def save(self) -> Path:
        self.step_log(self.engine.flush())  # its own step's numbers first: a non-finite step stops the run
        return self.checkpoint(self.step)

    def evaluate(self) -> None:
        """Dev scores by rank 0 alone with the whole model; the others wait."""
        evaluate, view = self.job.evaluate, self.view
        if evaluate is None:
            return
        whole = full_model(self.engine.model, self.job, self.dist)
        with view.monitor.phase("eval"), view.bar.stage(f"step {self.step}: dev eval", "dev set"):
            result = from_main(self.dist, lambda: evaluate(whole) if whole is not None else {})
        view.logger.log({"step": self.step, "split": "eval", **result})
        view.bar.print(f"step {self.step}: {self.job.describe(result)}")

    def finish(self, out_dir: Path, preempted: Path | None) -> dict[str, Any]:
        """The final checkpoint (unless a signal wrote one), then unless preempted the model's files
        and the job's predictions; the summary."""
        job, dist = self.job, self.dist
        final_checkpoint = preempted or self.save()
        summary: dict[str, Any] = {"out_dir": str(out_dir), "checkpoint": str(final_checkpoint), "steps": self.step,
                                   "losses": self.step_log.losses,
                                   "rank": dist.rank, "world_size": dist.world_size,
                                   "preempted": preempted is not None, **job.counts}
        if preempted is not None:  # the model and predictions wait for the run to finish
            return summary
        whole = full_model(self.engine.model, job, dist)
        if whole is not None and dist.is_main:
            job.save(whole, out_dir)
        finish = job.finish
        if finish is not None:
            with self.view.monitor.phase("eval"):
                result = from_main(dist, lambda: finish(whole, out_dir) if whole is not None else {})
            if result.get("scores"):
                self.view.logger.log({"step": self.step, "split": "eval", **result["scores"]})
            summary.update(result)
        return summary
