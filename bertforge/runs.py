"""Run directories: their layout, the integrity of what is in them, and finding a checkpoint.

A run directory looks like::

    runs/NAME/
      config.yaml          the resolved config of the run
      vocab.txt            the vocab the run trains with
      metrics.jsonl
      checkpoints/step_00000100/
        model.safetensors  weights, Hugging Face parameter names (tied decoder omitted)
        optimizer.pt       optimizer state (tensors and numbers only)
        trainer.pt         step, scheduler, RNG states, data position, loss scaler, world size
        config.yaml, vocab.txt
        manifest.json      every other file's relative path, size and crc32c, written last

With ``execution.parallel: fsdp`` the optimizer state (and a second copy of
the weights) is every rank's shards, written by torch.distributed.checkpoint
into ``sharded/`` (``.metadata`` plus one ``.distcp`` file per rank) instead of
``optimizer.pt``.

Integrity: ``manifest.json`` is written last inside the temporary directory
of a save and verified before anything is loaded: a file whose size or crc32c
differs is named and refused. Checkpoints written before manifests existed load
without the check. ``--resume auto`` (:func:`find_resumable`) skips a damaged
newest checkpoint with a warning and takes the one before.

This module needs no torch: the CLI resolves ``--resume`` with it before
anything heavy is imported. Weights are read and written by
:mod:`bertforge.formats.weights`, training state by :mod:`bertforge.training.checkpoint`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, TextIO

import google_crc32c

from .config import (
    CONFIG_HELP,
    OVERRIDES_HELP,
    PRETRAIN_CONFIG,
    Config,
    ConfigError,
    load_config,
    load_yaml,
    parse_overrides,
    resolve_config_path,
)
from .fileio import LOCK, holder, remove, remove_temporaries, write_failure

if TYPE_CHECKING:
    import argparse

CHECKPOINTS = "checkpoints"
STEP_PREFIX = "step_"
SHARDED = "sharded"  # torch.distributed.checkpoint's directory in an FSDP step directory
REQUIRED_FILES = ("model.safetensors", "trainer.pt", "config.yaml")
OPTIMIZER_FILES = ("optimizer.pt", f"{SHARDED}/.metadata")
WEIGHTS_FILES = ("model.safetensors", "config.yaml")  # all load_model needs
MANIFEST = "manifest.json"
VOCAB_FILES = ("vocab.txt", "tokenizer.json")  # the names of a vocab copied into a checkpoint or export
AUTO = "auto"  # checkpoint.resume: the newest sound checkpoint of the named run directory, if any
_CHUNK = 8 << 20


def vocab_file_name(vocab: str | Path) -> str:
    """The name a copy of ``vocab`` takes: ``tokenizer.json`` for a JSON file, else ``vocab.txt``."""
    return VOCAB_FILES[1] if Path(vocab).suffix == ".json" else VOCAB_FILES[0]


def vocab_in(directory: Path) -> Path | None:
    """The vocab a checkpoint or model directory holds under one of ``VOCAB_FILES``, or None."""
    return next((directory / name for name in VOCAB_FILES if (directory / name).is_file()), None)


def saved_data_settings(model_path: str | Path) -> tuple[bool, int | None]:
    """(lowercase, seq_len) saved with a model in its ``config.yaml`` (a run's step, a fine-tuned or an
    imported model); (True, None) otherwise."""
    path = Path(model_path) / "config.yaml"
    lowercase, seq_len = True, None
    if path.is_file():
        data = load_yaml(path) or {}
        section = data.get("data") if isinstance(data, dict) else None
        if isinstance(section, dict):
            lowercase = bool(section.get("lowercase", True))
            seq_len = section.get("seq_len")
    return lowercase, seq_len if isinstance(seq_len, int) else None


_MANIFEST_MAX = 16 << 20  # bytes: about 100 per file listed

logger = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A missing, incomplete, damaged or incompatible checkpoint; the message names it."""


def crc32c(path: Path) -> str:
    """The crc32c of a file, as 8 hex digits, read in chunks (GB/s with the C extension)."""
    checksum = google_crc32c.Checksum()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            checksum.update(chunk)
    return checksum.hexdigest().decode()


def write_manifest(directory: Path) -> Path:
    """``manifest.json`` of every file under ``directory``: the last file a save writes."""
    files = {p.relative_to(directory).as_posix(): p for p in sorted(directory.rglob("*"))
             if p.is_file() and p.name != MANIFEST}
    entries = [{"path": name, "size": p.stat().st_size, "crc32c": crc32c(p)} for name, p in files.items()]
    path = directory / MANIFEST
    path.write_text(json.dumps({"format": 1, "files": entries}, indent=1) + "\n", encoding="utf-8")
    return path


def verify(checkpoint: Path, only: Iterable[str] | None = None) -> bool:
    """Check ``checkpoint``'s files against its manifest (``only`` these, when given).

    False when there is no manifest (a checkpoint written before they existed);
    a CheckpointError naming the first file that is missing, of another size,
    or of another checksum, or the manifest when it is not one we write: its
    paths must name files inside ``checkpoint``, once each, so that no edit of
    it makes this read anything else, or anything twice.
    """
    path = checkpoint / MANIFEST
    if not path.is_file():
        return False
    listed = read_manifest(path)
    # Every file a save writes is listed: one the readers use that is not was dropped by an edit.
    wanted = set(only) if only is not None else {*listed, *REQUIRED_FILES, *OPTIMIZER_FILES}
    for name in sorted(wanted - listed.keys()):
        if (checkpoint / name).exists():
            raise CheckpointError(f"{checkpoint / name}: not listed in {MANIFEST}, which lists every file of "
                                  f"a checkpoint: edited or damaged; refusing this checkpoint")
    root = checkpoint.resolve()
    for name in sorted(wanted & listed.keys()):
        size, checksum = listed[name]
        file = checkpoint / name
        if not file.is_file():
            raise CheckpointError(f"{file}: listed in {MANIFEST} but missing; refusing this checkpoint")
        if not file.resolve().is_relative_to(root):
            raise CheckpointError(f"{file}: a link to {file.resolve()}, outside the checkpoint; refusing it")
        if file.stat().st_size != size:
            raise CheckpointError(f"{file}: {file.stat().st_size} bytes, but {MANIFEST} says {size}: "
                                  f"truncated or changed; refusing this checkpoint")
        if crc32c(file) != checksum:
            raise CheckpointError(f"{file}: its crc32c differs from {MANIFEST}: damaged or edited; "
                                  f"refusing this checkpoint")
    return True


def read_manifest(path: Path) -> dict[str, tuple[int, str]]:
    """``manifest.json``'s entries: {relative path: (size, crc32c)}; a CheckpointError naming it
    when it is not one we write (too big, not JSON, wrong types, a path outside, a path twice)."""
    def refuse(why: str) -> CheckpointError:
        return CheckpointError(f"{path}: not a readable manifest ({why}); refusing this checkpoint")

    if path.stat().st_size > _MANIFEST_MAX:
        raise refuse(f"{path.stat().st_size} bytes, more than a manifest ever has")
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError, TypeError, IndexError, RecursionError) as err:
        raise refuse(str(err).splitlines()[0] if str(err) else type(err).__name__) from None
    if not isinstance(entries, list):
        raise refuse("files is not a list")
    listed: dict[str, tuple[int, str]] = {}
    for entry in entries:
        if not isinstance(entry, dict):
            raise refuse(f"an entry is {type(entry).__name__}, not an object")
        name, size, checksum = entry.get("path"), entry.get("size"), entry.get("crc32c")
        if not isinstance(name, str) or not isinstance(checksum, str):
            raise refuse(f"entry {name!r}: path and crc32c must be strings")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise refuse(f"entry {name!r}: size {size!r} is not a number of bytes")
        relative = PurePosixPath(name)
        if (not name or "\0" in name or relative.is_absolute() or ".." in relative.parts
                or relative.as_posix() == "."):
            raise refuse(f"entry {name!r} is not a path inside the checkpoint")
        if relative.as_posix() in listed:
            raise refuse(f"{relative.as_posix()} is listed twice")
        listed[relative.as_posix()] = (size, checksum)
    return listed


def missing_files(path: Path, weights_only: bool = False) -> list[str]:
    """What a step directory lacks to be resumed (or, ``weights_only``, to be loaded)."""
    required = WEIGHTS_FILES if weights_only else REQUIRED_FILES
    missing = [f for f in required if not (path / f).is_file()]
    if not weights_only and not any((path / f).is_file() for f in OPTIMIZER_FILES):
        missing.append(" or ".join(OPTIMIZER_FILES))
    return missing


def is_complete(path: Path) -> bool:
    return path.is_dir() and path.name.startswith(STEP_PREFIX) and not missing_files(path)


def has_shards(checkpoint: Path) -> bool:
    """Whether the optimizer state is FSDP shards (torch.distributed.checkpoint) rather than optimizer.pt."""
    return (checkpoint / SHARDED / ".metadata").is_file()


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete step directories of a run, oldest first; temporary ones are ignored."""
    root = run_dir / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if is_complete(p))


def find_checkpoint(path: str | Path, weights_only: bool = False) -> Path:
    """A step directory, or the newest complete one of a run directory.

    With ``weights_only`` a directory needs only ``model.safetensors`` and
    ``config.yaml`` (enough to build and load the model, e.g. a SQuAD
    fine-tune's output) and is taken as it is; resuming needs the optimizer
    and trainer state too, so a run directory that also holds a final model
    (a SQuAD run) resumes from its newest step.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}")
    is_step = path.name.startswith(STEP_PREFIX)
    if is_step or ((path / "model.safetensors").exists() and (weights_only or not (path / CHECKPOINTS).is_dir())):
        missing = missing_files(path, weights_only)
        if missing:
            raise CheckpointError(f"incomplete checkpoint {path}: missing {', '.join(missing)}")
        return path
    found = complete_checkpoints(path)
    if not found:
        raise CheckpointError(f"no complete checkpoint in {path / CHECKPOINTS}")
    return found[-1]


def remove_temporaries_of(run_dir: Path) -> list[Path]:
    """Remove the temporary directories of interrupted saves in ``run_dir/checkpoints``; at a run's start."""
    removed = remove_temporaries(run_dir / CHECKPOINTS)
    for path in removed:
        logger.info("removed %s, left by a save that was interrupted", path)
    return removed


def find_resumable(run_dir: Path, only: Iterable[str] | None = None, warn: bool = True) -> Path | None:
    """The newest complete checkpoint of ``run_dir`` that verifies against its manifest, or None.

    A damaged one is skipped with a warning naming it (``--resume auto``).
    ``only`` limits the check to these files (config.yaml, to read the config).
    """
    return newest_verified(complete_checkpoints(run_dir), only, warn)


def newest_verified(checkpoints: list[Path], only: Iterable[str] | None = None, warn: bool = False) -> Path | None:
    """The newest of ``checkpoints`` (oldest first) that verifies against its manifest, or None;
    each damaged one skipped (with a warning naming it, if ``warn``)."""
    for checkpoint in reversed(checkpoints):
        try:
            verify(checkpoint, only)
        except CheckpointError as err:
            if warn:
                logger.warning("skipping damaged checkpoint %s: %s", checkpoint, err)
            continue
        return checkpoint
    return None


def checkpoint_to_resume(resume: str, run_dir: Path | None = None) -> Path | None:
    """On rank 0, at a run's start: the checkpoint ``checkpoint.resume`` names, verified, after
    the temporaries of interrupted saves in its run are removed. With ``auto`` it is the newest
    sound checkpoint of ``run_dir``, or None for a fresh start."""
    if resume == AUTO:
        assert run_dir is not None  # auto works in a named run directory
        remove_temporaries_of(run_dir)
        return find_resumable(run_dir)
    checkpoint = find_checkpoint(resume)
    remove_temporaries_of(checkpoint.parent.parent)
    try:
        verify(checkpoint)
    except CheckpointError as err:
        raise CheckpointError(f"{err}; {_sound_instead(checkpoint)}") from None
    return checkpoint


def _sound_instead(damaged: Path) -> str:
    """What to resume instead of the damaged step directory ``damaged``: its run's newest sound one."""
    sound = newest_verified([c for c in complete_checkpoints(damaged.parent.parent) if c.name < damaged.name])
    if sound is None:
        return "no checkpoint before it is whole"
    return f"the newest whole checkpoint before it is {sound}: resume with --resume {sound}"


def auto_run_dir(run_dir: str | Path, name: str, flag: str = "--name (log.name)") -> Path:
    """The run directory ``--resume auto`` works in: it must be named, so that a restart finds it."""
    if not name:
        raise ConfigError(f"--resume auto needs a named run directory: pass {flag}, so that every "
                          f"restart finds the same one")
    return Path(run_dir) / name


class RunLock:
    """The one run that writes into a run directory: two would overwrite each other's checkpoints
    and metrics. Held by rank 0 for the life of the run (a ``with`` block).

    An ``flock`` on ``RUN/.lock``, which the kernel releases when the process ends, however it
    ends: the lock of a killed run is free for the next (a torchrun restart, ``--resume auto``
    after a crash) with nothing to clean up. The file names the holder, for the error a second
    run gets. (On NFS, Linux maps flock to the server's byte-range locks.)

    With ``create`` a missing directory is made first (``created`` says whether by this
    process), so that of many runs started at once in one new directory exactly one goes on.
    Only the holder ever removes the lock file (:func:`remove_run_dir`), and a lock taken on a
    file that was removed meanwhile does not count: it is taken again on the file now there.
    """

    def __init__(self, run_dir: Path, create: bool = False):
        self.path = Path(run_dir) / LOCK
        self.create = create
        self.created = False
        self._file: TextIO | None = None

    def __enter__(self) -> RunLock:
        while True:  # again when the run that held it removed its directory between our open and our lock
            file = self._open()
            if file is None:
                continue
            try:
                fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                name = holder(file)
                file.close()
                raise ConfigError(f"{self.path.parent} is in use by another run ({name}): two runs in one "
                                  f"directory would overwrite each other's checkpoints; wait for it to end, "
                                  f"or choose another directory") from None
            if _names(self.path, file):
                break
            file.close()
        file.seek(0)
        file.truncate()
        file.write(f"pid {os.getpid()} on {socket.gethostname()}, since "
                   f"{datetime.now().isoformat(sep=' ', timespec='seconds')}\n")
        file.flush()
        self._file = file
        return self

    def _open(self) -> TextIO | None:
        """The lock file, opened (made when missing); None when its directory is gone and is to be
        made again."""
        run_dir = self.path.parent
        if self.create:
            try:
                run_dir.mkdir(parents=True)  # of two that start at once, one makes it
                self.created = True
            except FileExistsError:
                self.created = False
            except OSError as err:  # a read-only or missing parent: the user's to fix
                raise ConfigError(f"cannot create the run directory {run_dir}: {err.strerror}") from None
        try:
            return open(self.path, "a+", encoding="utf-8")  # held until __exit__
        except FileNotFoundError:
            if self.create:
                return None
            raise ConfigError(f"{run_dir}: no such run directory (its run removed it)") from None
        except OSError as err:  # a read-only run directory: say so as every other write does
            error = write_failure(err, self.path, 0)
            if error is None:
                raise
            raise error from None

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            self._file.close()  # closing releases the flock
            self._file = None


def _names(path: Path, file: TextIO) -> bool:
    """Whether ``path`` still names the open ``file`` (its run may have removed it meanwhile)."""
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    opened = os.fstat(file.fileno())
    return (now.st_dev, now.st_ino) == (opened.st_dev, opened.st_ino)


def remove_run_dir(run_dir: Path) -> None:
    """Remove a run directory whose lock this process holds (a run that made it and has nothing to
    keep): its files, then its lock, then the directory, unless another run has taken it over
    since the lock was gone (its new lock is in it). As much as can go, after an error: what
    cannot stays, with its lock."""
    with contextlib.suppress(OSError):
        for entry in run_dir.iterdir():
            if entry.name != LOCK:
                remove(entry)
        (run_dir / LOCK).unlink(missing_ok=True)
        run_dir.rmdir()  # not empty: another run's now


# What a resume may change and still continue the run it resumes: what is logged, saved and
# evaluated, how far the run goes, and where and how fast it runs. Any other change (the model,
# the data, the optimizer, its schedule, the batch, the precision) makes another run, which
# --resume-with-changes (checkpoint.resume_with_changes) asks for knowingly.
RESUMABLE_CHANGES = ("log.", "checkpoint.", "train.steps", "train.epochs", "train.eval_", "train.target_mlm_accuracy",
                     "train.divergence_", "data.prefetch", "data.reader_threads",
                     "data.eval_input", "execution.")
BREAKING_CHANGES = ("execution.precision",)  # among the above: the arithmetic of every step
_THE_RESUME_ITSELF = ("checkpoint.resume", "checkpoint.init")  # not worth a line in the log


def _flat(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict) and key != "lr_table":
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def config_changes(saved: dict[str, Any], new: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(the changes from ``saved`` to ``new``, two configs as ``Config.to_dict`` gives them, that
    break "continue exactly", those that do not), each as ``key: old → new``."""
    old, now = _flat(saved), _flat(new)
    breaking: list[str] = []
    allowed: list[str] = []
    for key in now:
        if old.get(key) != now[key] and not key.startswith(_THE_RESUME_ITSELF):
            harmless = key.startswith(RESUMABLE_CHANGES) and not key.startswith(BREAKING_CHANGES)
            (allowed if harmless else breaking).append(f"{key}: {old.get(key)!r} → {now[key]!r}")
    return breaking, allowed


# Fields read only where a run starts: a resume, whose weights are the checkpoint's, cannot apply them.
STARTING_ONLY = ("model.initializer_range", "model.initializer_cutoff_factor")


def ineffective_changes(saved: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The changes from ``saved`` to ``new`` (two configs as ``Config.to_dict`` gives them) that a
    resume could not make take effect, each with why."""
    old, now = _flat(saved), _flat(new)
    found = [f"{key}: {old.get(key)!r} → {now.get(key)!r} only sets the weights a run starts from, which a "
             f"resume takes from its checkpoint" for key in STARTING_ONLY if old.get(key) != now.get(key)]
    # (stableadamw's decoupled weight decay is scaled by lr / train.lr: there train.lr counts)
    sets_decay = now["train.optimizer"] == "stableadamw" and now["train.decouple_lr"]
    if old["train.lr"] != now["train.lr"] and now["train.schedule"] == "table" and not sets_decay:
        found.append(f"train.lr: {old['train.lr']!r} → {now['train.lr']!r} changes nothing under the table schedule, "
                     f"whose train.lr_table sets every step's lr: change train.lr_table")
    return found


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.read_bytes() == b.read_bytes()
    except OSError:
        return False


def check_resume(checkpoint: Path, saved: Config, cfg: Config, saved_data: str | None, data: str | None,
                 data_name: str) -> None:
    """Refuse a resume that would not continue the run of ``checkpoint``: a config that differs
    in what the run computes, or data (``data_name``; ``data``: its fingerprint) other than it
    trained on, each named; unless ``checkpoint.resume_with_changes``. Every change is logged.

    A change that a resume cannot make take effect (``ineffective_changes``) is refused, with or
    without ``checkpoint.resume_with_changes``.

    Two whole configs: what the run computes is in every section of them."""
    if ineffective := ineffective_changes(saved.to_dict(), cfg.to_dict()):
        raise ConfigError(f"resuming {checkpoint}: {'; '.join(ineffective)}")
    breaking, allowed = config_changes(saved.to_dict(), cfg.to_dict())
    # The vocab and the data are named by paths, which move with their directories: what is in
    # them is what counts (the vocab's tokens, the data's fingerprint).
    for key, same in (("data.vocab:", _same_file(vocab_in(checkpoint) or checkpoint / VOCAB_FILES[0],
                                                  Path(cfg.data.vocab))),
                      ("data.input:", saved_data is not None and saved_data == data)):
        moved = [c for c in breaking if c.startswith(key)]
        if moved and same:
            breaking.remove(moved[0])
            allowed.append(f"{moved[0]} (the same {'tokens' if key == 'data.vocab:' else 'files'})")
    if saved_data is None and data is not None:
        logger.warning("%s was saved without a fingerprint of its data: not checked", checkpoint)
    elif saved_data != data:
        breaking.append(f"the files of {data_name} changed since the checkpoint (fingerprint {saved_data} → {data})")
    for change in allowed:
        logger.info("resuming with %s", change)
    if breaking and not cfg.checkpoint.resume_with_changes:
        raise ConfigError(f"resuming {checkpoint} with changes that break continuing it exactly: "
                          f"{'; '.join(breaking)}; pass --resume-with-changes to go on with them")
    for change in breaking:
        logger.warning("resuming with a change: %s", change)


def config_from_args(args: argparse.Namespace, extra: list[str], default: str | None) -> Config:
    """The config of a command: ``--config`` (else the config saved with the run being
    resumed, else ``default``), then the dotted overrides in ``extra``, then the command's own
    flags (``--steps``, ``--resume``, …; one that the command does not define is skipped).

    Used by the ``bertforge`` commands (training/cli.py, bench/cli.py, parallel/plan.py, `config` below)."""
    overrides: list[tuple[str, Any]] = parse_overrides(extra)  # flags add non-string values
    for flag, key in (("steps", "train.steps"), ("epochs", "train.epochs"),
                      ("resume", "checkpoint.resume"), ("init", "checkpoint.init"),
                      ("run_dir", "log.run_dir"), ("name", "log.name"), ("profile", "log.profile")):
        value = getattr(args, flag, None)
        if value is not None:
            overrides.append((key, value))
    if getattr(args, "wandb", False):
        overrides.append(("log.wandb", True))
    if getattr(args, "no_progress", False):
        overrides.append(("log.progress", False))
    if getattr(args, "resume_with_changes", False):
        overrides.append(("checkpoint.resume_with_changes", True))
    name = getattr(args, "config", None)
    resume = getattr(args, "resume", None)
    if name is None and resume == "auto":
        # The run directory (log.run_dir/log.name) comes from the defaults and the flags; its
        # newest sound checkpoint's config, if it has one, else a fresh start with `default`.
        fresh = load_config(default, overrides)
        found = find_resumable(auto_run_dir(fresh.log.run_dir, fresh.log.name), only=["config.yaml"], warn=False)
        if found is None:
            return fresh
        name = str(found / "config.yaml")
    elif name is None and resume:
        # A resumed run continues with the config it was saved with, plus the overrides.
        name = str(find_checkpoint(resume) / "config.yaml")
    cfg = load_config(name or default, overrides)
    if name is None:  # the default config's preset is not one the user named (checkpoint.init's model replaces it)
        cfg.preset = next((str(value) for key, value in reversed(overrides) if key in ("model", "model.preset")), "")
    if cfg.checkpoint.resume == AUTO:  # unnamed, refused here: before torch loads, on every rank torchrun starts
        auto_run_dir(cfg.log.run_dir, cfg.log.name)
    return cfg


# A job that adds its own section to a config (``squad:``, ``finetune:``) resolves such a config
# itself: (the config's name, the overrides) to the YAML of the whole, its section included.
SectionResolver = Callable[[str, list[tuple[str, str]]], str]


def job_section(name: str | None, resolvers: Mapping[str, SectionResolver]) -> str | None:
    """The job's section (one of ``resolvers``) that the config ``name`` holds, or None."""
    path = resolve_config_path(name) if name else None
    if path is None:
        return None
    data = load_yaml(path)
    return next((section for section in resolvers if isinstance(data, dict) and section in data), None)


def cmd_config(args: argparse.Namespace, extra: list[str]) -> int:
    resolvers: Mapping[str, SectionResolver] = getattr(args, "section_resolvers", {})
    section = job_section(args.config, resolvers)
    if section is not None:  # a fine-tuning config: its job reads the section the Config has not
        print(resolvers[section](args.config, parse_overrides(extra)), end="")
        return 0
    cfg = config_from_args(args, extra, default=PRETRAIN_CONFIG)
    print(cfg.to_yaml(), end="")
    return 0


def add_config_command(sub: Any, section_resolvers: Mapping[str, SectionResolver] | None = None) -> None:
    """``bertforge config``, beside :func:`config_from_args`, which resolves it: registered by cli.py,
    which passes the jobs' resolvers of the sections they add (``squad:`` …)."""
    p = sub.add_parser("config", help="print a resolved config as YAML", epilog=OVERRIDES_HELP)
    p.add_argument("--config", help=CONFIG_HELP + f" (default: {PRETRAIN_CONFIG}, what `bertforge pretrain` runs)")
    p.set_defaults(func=cmd_config, takes_overrides=True, section_resolvers=dict(section_resolvers or {}))
