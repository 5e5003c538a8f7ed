"""Checkpoints: one directory per step, written atomically, resumed exactly.

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
``optimizer.pt``; ``model.safetensors`` still holds the full weights.

A step directory is written under a hidden temporary name and renamed only
when every file is on disk, so a crash mid-save never leaves something that
looks complete. Everything is read back with safetensors,
``torch.load(weights_only=True)`` or torch.distributed.checkpoint.

Integrity: ``manifest.json`` is written last inside the temporary directory
and verified before anything is loaded (resume, ``load_model``,
``load_weights``): a file whose size or crc32c differs is named and refused.
Checkpoints written before manifests existed load without the check.
``--resume auto`` (:func:`find_resumable`) skips a damaged newest checkpoint
with a warning and takes the one before. A file that cannot be read (truncated,
edited) is a :class:`CheckpointError` naming it, never a traceback, and so is a
save that fails for a full disk or a read-only directory. Weights that are not
finite are never saved (:func:`first_nonfinite`).

Every command goes through three functions here: :func:`save` writes a step
directory of an :class:`~bertforge.engine.Engine`, :func:`resume` loads one
back into an engine (any world size, any parallel mode), and
:func:`load_weights` (``--init``) and :func:`load_model` load weights only, from
our checkpoints, a Hugging Face directory or a TensorFlow 1 checkpoint prefix. A tensor whose shape differs from
the model's, or a missing encoder tensor, is an error that names it, wherever
it is loaded (:func:`assign_weights`).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import pickle
import shutil
import typing
import warnings
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

import google_crc32c
import torch
import torch.distributed
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from .config import Config, ConfigError, Head, ModelConfig, config_from_dict, load_yaml
from .dist import DistContext, barrier, broadcast, from_main, unwrap
from .dist import is_sharded as is_sharded_model
from .fileio import WriteError, atomic_directory, remove_temporaries

if TYPE_CHECKING:
    from .engine import Engine

CHECKPOINTS = "checkpoints"
STEP_PREFIX = "step_"
SHARDED = "sharded"  # torch.distributed.checkpoint's directory in an FSDP step directory
REQUIRED_FILES = ("model.safetensors", "trainer.pt", "config.yaml")
# The optimizer state: one file (saved by one process), or every rank's shards (FSDP).
OPTIMIZER_FILES = ("optimizer.pt", f"{SHARDED}/.metadata")
WEIGHTS_FILES = ("model.safetensors", "config.yaml")  # all load_model needs
HEADS = typing.get_args(Head)
# Weights that belong to one task's head: absent from a source made for another task, they stay as initialised.
HEAD_PREFIXES = ("cls.", "qa_outputs.", "classifier.", "bert.pooler.", "pooler.")
MANIFEST = "manifest.json"
AUTO = "auto"  # checkpoint.resume: the newest sound checkpoint of the named run directory, if any
_CHUNK = 8 << 20
_MANIFEST_MAX = 16 << 20  # bytes: about 100 per file listed

logger = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A missing, incomplete, damaged or incompatible checkpoint; the message names it."""


# ------------------------------------------------------------ integrity

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


def load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """``load_file`` with a CheckpointError naming the file when it cannot be read."""
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        if isinstance(err, FileNotFoundError):
            raise CheckpointError(f"{path}: missing") from None
        raise CheckpointError(f"{path}: not a readable safetensors file (truncated or edited?): "
                              f"{str(err).splitlines()[0] if str(err) else type(err).__name__}") from None


def torch_load(path: Path) -> Any:
    """``torch.load(weights_only=True)`` with a CheckpointError naming the file when it cannot be read."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        first = str(err).splitlines()[0] if str(err) else ""
        if "Weights only load failed" in first or "Unsupported global" in str(err):
            raise CheckpointError(f"{path}: holds objects other than tensors and plain data, which a "
                                  f"checkpoint never needs; refusing to load it") from None
        raise CheckpointError(f"{path}: not a readable checkpoint file (truncated or edited?): {first}") from None
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (RuntimeError, EOFError, OSError, ValueError, KeyError, AttributeError, IndexError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CheckpointError(f"{path}: not a readable checkpoint file (truncated or edited?): {first}") from None


def first_nonfinite(model: nn.Module) -> str | None:
    """The name of the first floating tensor of ``model`` (this rank's shards) holding a NaN or
    infinity, else None: one pass over the weights and one host sync when all are finite."""
    tensors = [(name, getattr(t, "_local_tensor", t)) for name, t in model.state_dict().items()]
    tensors = [(name, t) for name, t in tensors if t.is_floating_point() and t.numel()]
    if not tensors:
        return None
    flags = torch.stack([torch.isfinite(t).all() for _, t in tensors])
    if bool(flags.all()):
        return None
    return next(name for (name, _), ok in zip(tensors, flags.tolist()) if not ok)


def check_finite(model: nn.Module, ctx: DistContext, step: int) -> None:
    """Refuse to save weights that are not finite, naming the first such tensor; every rank calls it."""
    bad = first_nonfinite(model)
    if ctx.world_size > 1 and torch.distributed.is_initialized():
        names: list[str | None] = [None] * ctx.world_size
        torch.distributed.all_gather_object(names, bad)  # shards differ under FSDP: all ranks decide together
        bad = next((n for n in names if n is not None), None)
    if bad is not None:
        raise CheckpointError(f"step {step}: weight {bad} is not finite (NaN or infinity); refusing to "
                              f"write a checkpoint of it (the newest checkpoint stays the newest finite one)")


def _nbytes(obj: Any) -> int:
    """The bytes of the tensors in a nested state: what a save will write, roughly."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


@contextlib.contextmanager
def _writing(final: Path, needed: int) -> Any:
    """``atomic_directory`` with a full disk or a read-only directory as a CheckpointError."""
    try:
        with atomic_directory(final, needed) as tmp:
            yield tmp
    except WriteError as err:
        raise CheckpointError(str(err)) from None


def save_weights(model: nn.Module, path: Path) -> None:
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(path), metadata={"format": "pt"})


def save_checkpoint(run_dir: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    trainer_state: dict[str, Any], cfg: Config, keep: int = 0) -> Path:
    """Write ``run_dir/checkpoints/step_N`` atomically; keep only the newest ``keep`` (0 = all)."""
    final = run_dir / CHECKPOINTS / f"{STEP_PREFIX}{step:08d}"
    optimizer_state = optimizer.state_dict()
    with _writing(final, _nbytes(model.state_dict()) + _nbytes(optimizer_state)) as tmp:
        save_weights(model, tmp / "model.safetensors")
        torch.save(optimizer_state, tmp / "optimizer.pt")
        _write_trainer_files(tmp, trainer_state, cfg)
        write_manifest(tmp)
    _keep_newest(run_dir, keep, final)
    return final


def save_sharded_checkpoint(run_dir: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                            trainer_state: dict[str, Any], cfg: Config, ctx: DistContext,
                            keep: int = 0) -> Path:
    """The FSDP counterpart of ``save_checkpoint``; every rank calls it.

    Each rank writes its shards of the weights and optimizer state with
    torch.distributed.checkpoint into ``sharded/`` of one temporary step
    directory; rank 0 adds the gathered full weights (``model.safetensors``,
    for export and ``load_model``), the trainer state and the config, and
    renames the directory once every rank's shards are on disk.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    final = run_dir / CHECKPOINTS / f"{STEP_PREFIX}{step:08d}"
    needed = 3 * _nbytes(model.state_dict()) * ctx.world_size  # weights twice, plus Adam/LAMB moments
    with _writing(final, needed) if ctx.is_main else contextlib.nullcontext() as tmp:
        tmp = Path(broadcast(ctx, str(tmp)))
        model_state, optimizer_state = get_state_dict(model, optimizer)
        # Returns on any rank only when all ranks' files and the metadata are written.
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=tmp / SHARDED)
        full = full_state_dict(model)
        if ctx.is_main:
            save_file({k: v.contiguous() for k, v in full.items()}, str(tmp / "model.safetensors"),
                      metadata={"format": "pt"})
            _write_trainer_files(tmp, trainer_state, cfg)
            write_manifest(tmp)  # every rank's shards are on disk: dcp.save returned
    if ctx.is_main:
        _keep_newest(run_dir, keep, final)
    barrier(ctx)  # no rank goes on before the checkpoint has its final name
    return final


def load_sharded_checkpoint(checkpoint: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load an FSDP checkpoint's shards into a sharded model and its optimizer; every rank calls it.

    torch.distributed.checkpoint reshards: the world size may differ from the saving run's.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state}
    single = not torch.distributed.is_initialized()  # parallel none: this process reads every shard
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # that is the intent
        dcp.load(state, storage_reader=_safe_reader(checkpoint / SHARDED), planner=_safe_planner(),
                 no_dist=single)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


# torch.distributed.checkpoint unpickles its ``.metadata`` file and every
# non-tensor value (the optimizer's step counts and hyperparameters) with no
# restriction. These two read the same files with an allowlist and with
# ``weights_only``, so a sharded checkpoint is as safe to resume as optimizer.pt.

_METADATA_MODULES = ("torch.distributed.checkpoint.metadata",)
_METADATA_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"),
                     ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                     ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = (module in _METADATA_MODULES or (module, name) in _METADATA_GLOBALS
                   or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)))
        if not allowed:
            raise CheckpointError(f"sharded checkpoint metadata refers to {module}.{name}, "
                                  f"which a checkpoint never needs; refusing to load it")
        return super().find_class(module, name)


def read_sharded_metadata(sharded: Path) -> Any:
    """The ``.metadata`` of a torch.distributed.checkpoint directory, read with the allowlist."""
    path = sharded / ".metadata"
    try:
        with open(path, "rb") as f:
            return _MetadataUnpickler(f).load()
    except CheckpointError:
        raise
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as err:
        raise CheckpointError(f"{path}: not a readable checkpoint metadata file ({err})") from None


def _safe_reader(sharded: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    read_sharded_metadata(sharded)  # refuse a bad file here, with our error, before DCP wraps it

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:  # as the base, but with the allowlist
            metadata = read_sharded_metadata(sharded)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(sharded)


def _safe_planner() -> Any:
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:  # as the base, but weights_only
            loaded = torch.load(value, weights_only=True)
            fqn = read_item.dest_index.fqn
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], loaded)
            else:
                self.state_dict[fqn] = loaded

    return SafePlanner()


def load_full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                              state: dict[str, Any]) -> None:
    """Load ``optimizer.pt`` (one process's state, by parameter index) into an optimizer of
    FSDP-sharded parameters; every rank calls it and keeps its shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    # Both optimizers list the parameters in model order: index i is the same parameter.
    names = {id(p): name for name, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    by_name: dict[str, Any] = {"state": {order[i]: s for i, s in state["state"].items()},
               "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in state["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))


def _write_trainer_files(directory: Path, trainer_state: dict[str, Any], cfg: Config) -> None:
    torch.save(trainer_state, directory / "trainer.pt")
    (directory / "config.yaml").write_text(cfg.to_yaml(), encoding="utf-8")
    vocab = Path(cfg.data.vocab) if cfg.data.vocab else None
    if vocab is not None and vocab.is_file():
        shutil.copyfile(vocab, directory / "vocab.txt")


def _keep_newest(run_dir: Path, keep: int, current: Path) -> None:
    """Keep ``current`` (just written, finite) and the ``keep - 1`` newest before it.

    Step directories after ``current`` (left by a run resumed from an earlier
    step) are not counted, so rotation never deletes the checkpoint just written.
    """
    if keep > 0:
        older = [p for p in complete_checkpoints(run_dir) if p.name < current.name]
        for old in older[:len(older) - (keep - 1)]:
            shutil.rmtree(old)


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
    for checkpoint in reversed(complete_checkpoints(run_dir)):
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
    verify(checkpoint)
    return checkpoint


def auto_run_dir(run_dir: str | Path, name: str, flag: str = "--name (log.name)") -> Path:
    """The run directory ``--resume auto`` works in: it must be named, so that a restart finds it."""
    if not name:
        raise ConfigError(f"--resume auto needs a named run directory: pass {flag}, so that every "
                          f"restart finds the same one")
    return Path(run_dir) / name


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


def read_config(checkpoint: Path) -> Config:
    verify(checkpoint, ["config.yaml"])
    try:
        cfg = config_from_dict(load_yaml(checkpoint / "config.yaml"))
    except ConfigError as err:
        raise CheckpointError(f"{checkpoint / 'config.yaml'}: {err}") from None
    check_config_fits(cfg.model, checkpoint)
    return cfg


def weight_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """The tensor shapes of a safetensors file, from its header alone."""
    try:
        with safe_open(str(path), "pt") as f:
            return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        if isinstance(err, FileNotFoundError):
            raise CheckpointError(f"{path}: missing") from None
        raise CheckpointError(f"{path}: not a readable safetensors file (truncated or edited?): "
                              f"{str(err).splitlines()[0] if str(err) else type(err).__name__}") from None


def check_config_fits(cfg: ModelConfig, checkpoint: Path) -> None:
    """A checkpoint's model config against the shapes of its weights (our names), before a model is
    built of it: an edited ``config.yaml`` (with no manifest to tell) would build a model of any size."""
    shapes = weight_shapes(checkpoint / "model.safetensors")
    layers = {key.split(".")[3] for key in shapes if key.startswith("bert.encoder.layer.")}
    dims = {"vocab_size": ("bert.embeddings.word_embeddings.weight", 0),
            "hidden_size": ("bert.embeddings.word_embeddings.weight", 1),
            "max_position_embeddings": ("bert.embeddings.position_embeddings.weight", 0),
            "type_vocab_size": ("bert.embeddings.token_type_embeddings.weight", 0),
            "intermediate_size": ("bert.encoder.layer.0.intermediate.dense.weight", 0)}
    for name, (key, dim) in dims.items():
        shape = shapes.get(key)
        if shape is None or len(shape) != 2 or shape[dim] != getattr(cfg, name):
            raise CheckpointError(f"{checkpoint / 'config.yaml'}: model.{name}={getattr(cfg, name)} does not fit "
                                  f"the weights in model.safetensors ({key}: {shape or 'missing'})")
    if len(layers) != cfg.num_hidden_layers:
        raise CheckpointError(f"{checkpoint / 'config.yaml'}: model.num_hidden_layers={cfg.num_hidden_layers} "
                              f"does not fit the weights in model.safetensors ({len(layers)} layers)")


def check_model_config(saved: ModelConfig, wanted: ModelConfig, source: Path) -> None:
    """Weights fit only a model of the same shape: name the first field that differs."""
    shape_fields = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "intermediate_size", "max_position_embeddings", "type_vocab_size")
    for name in shape_fields:
        have, want = getattr(saved, name), getattr(wanted, name)
        if have != want:
            raise CheckpointError(f"checkpoint {source} has model.{name}={have} "
                                  f"but the config asks for model.{name}={want}")


def read_trainer_state(checkpoint: Path) -> dict[str, Any]:
    """``trainer.pt``: step, data position, schedule, RNG, world size (no code is unpickled)."""
    state = torch_load(checkpoint / "trainer.pt")
    if not isinstance(state, dict) or "step" not in state:
        raise CheckpointError(f"{checkpoint / 'trainer.pt'}: not a trainer state (no step)")
    return state


def save(run_dir: Path, step: int, engine: Engine, cfg: Config, state: dict[str, Any]) -> Path:
    """Write step ``step`` of a run; every rank calls it, and all get the step directory back.

    ``state`` is what the job adds to the engine's (its data position, say).
    """
    ctx = engine.dist
    state = {"step": step, **engine.state_dict(), **state, "world_size": ctx.world_size,
             "parallel": cfg.execution.parallel}
    model, keep = unwrap(engine.model), cfg.checkpoint.keep
    check_finite(model, ctx, step)
    if is_sharded_model(model):
        return save_sharded_checkpoint(run_dir, step, model, engine.optimizer, state, cfg, ctx, keep=keep)
    return from_main(ctx, lambda: save_checkpoint(run_dir, step, model, engine.optimizer, state, cfg, keep=keep))


def resume(checkpoint: Path, engine: Engine, verified: bool = False) -> dict[str, Any]:
    """Load a step directory into a built engine: weights, optimizer, schedule, scaler, RNG.

    Every rank calls it, after ``prepare_model`` and the optimizer are built,
    whatever the world size and parallel mode of the run that saved it: FSDP
    shards are resharded, full files are sharded as they load. Rank 0 first
    checks every file against the manifest (unless ``verified``: the caller
    did). Returns the trainer state (``step``, the job's data position, ``world_size``, …).
    """
    if not verified:
        from_main(engine.dist, lambda: verify(checkpoint))
    model, optimizer = unwrap(engine.model), engine.optimizer
    trainer_state = read_trainer_state(checkpoint)
    if has_shards(checkpoint):
        load_sharded_checkpoint(checkpoint, model, optimizer)
    else:
        optimizer_state = torch_load(checkpoint / "optimizer.pt")
        if is_sharded_model(model):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            state = load_safetensors(checkpoint / "model.safetensors")
            _check_shapes(model_shapes(model), state, checkpoint)
            # torch's stub wants dict[str, ValueType], and dict is invariant: a dict of tensors is one
            set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))  # type: ignore[arg-type]
            load_full_optimizer_state(model, optimizer, optimizer_state)
        else:
            model.load_state_dict(_checked(model, load_safetensors(checkpoint / "model.safetensors"), checkpoint))
            try:
                optimizer.load_state_dict(optimizer_state)
            except (ValueError, KeyError, TypeError, IndexError) as err:
                raise CheckpointError(f"{checkpoint / 'optimizer.pt'}: does not fit this optimizer ({err})") from None
    engine.load_state_dict(trainer_state)
    return trainer_state


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights on the CPU: gathered from every rank's shards under FSDP
    (a collective: every rank calls it; rank 0 gets the weights, the others nothing)."""
    if not is_sharded_model(model):
        return {k: v.detach().cpu() for k, v in unwrap(model).state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return typing.cast(dict[str, torch.Tensor], state)  # a full state dict holds plain tensors


def model_shapes(model: nn.Module) -> dict[str, torch.Size]:
    """Parameter and buffer shapes by name; the whole tensor's for FSDP shards."""
    return {k: v.shape for k, v in model.state_dict().items()}


def _check_shapes(own: dict[str, torch.Size], state: dict[str, torch.Tensor], source: Path | str,
                  error: type[ValueError] = CheckpointError) -> None:
    for key, tensor in state.items():
        if key in own and own[key] != tensor.shape:
            raise error(f"{source}: weight {key} has shape {tuple(tensor.shape)} in the checkpoint but "
                        f"the model expects {tuple(own[key])}")


def _checked(model: nn.Module, state: dict[str, torch.Tensor], source: Path) -> dict[str, torch.Tensor]:
    """``state`` if it holds exactly the model's tensors with their shapes; an error naming the first that does not."""
    own = model_shapes(model)
    _check_shapes(own, state, source)
    missing, unknown = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
    if missing or unknown:
        what = f"lacks {', '.join(missing)}" if missing else f"has weights the model does not: {', '.join(unknown)}"
        raise CheckpointError(f"{source}: {what}")
    return state


def assign_weights(model: nn.Module, state: dict[str, torch.Tensor], source: Path | str,
                   error: type[ValueError] = CheckpointError) -> list[str]:
    """Load ``state`` (our names) into ``model``; returns the head weights it left as initialised.

    Shapes must match; encoder weights must all be there; another task's head
    weights (an MLM head loaded for QA) are ignored; any other weight the
    model does not have is an error. ``error`` is the exception raised.
    """
    own = model_shapes(model)
    _check_shapes(own, state, source, error)
    unknown = [k for k in state if k not in own and not k.startswith(HEAD_PREFIXES)]
    if unknown:
        raise error(f"{source}: weights unknown to this model: {', '.join(unknown)}")
    missing = [k for k in own if k not in state]
    missing_encoder = [k for k in missing if not k.startswith(HEAD_PREFIXES)]
    if missing_encoder:
        raise error(f"{source}: checkpoint lacks encoder weights: {', '.join(missing_encoder)}")
    model.load_state_dict({k: v for k, v in state.items() if k in own}, strict=False)
    return missing


def read_weights(path: str | Path, bert_config: str | Path | None = None,
                 ) -> tuple[ModelConfig, dict[str, torch.Tensor], Path]:
    """(model shape, weights in our BertForPreTraining names, the directory or prefix read) of
    our checkpoint (run, step or model directory), a Hugging Face BERT directory, or a
    TensorFlow 1 checkpoint (a prefix such as ``ckpt/model.ckpt-28252``, or a directory with a
    ``checkpoint`` file; ``bert_config`` defaults to the ``bert_config.json`` beside it)."""
    from . import convert, tf1

    path = Path(path)
    prefix = tf1.find_prefix(path)
    if prefix is not None:  # every head it has comes along: the caller takes what its model needs
        cfg, state, _ = convert.read_tf1(prefix, bert_config, head="encoder")
        return cfg, state, prefix
    if (path / "config.json").is_file() and not (path / "config.yaml").is_file():
        return convert.read_hf_config(path), convert.hf_to_ours(convert.load_hf_state_dict(path), "pretraining"), path
    checkpoint = find_checkpoint(path, weights_only=True)
    verify(checkpoint, WEIGHTS_FILES)
    return read_config(checkpoint).model, load_safetensors(checkpoint / "model.safetensors"), checkpoint


def load_weights(model: nn.Module, path: str | Path, bert_config: str | Path | None = None) -> list[str]:
    """Load the weights at ``path`` (see :func:`read_weights`) into a built model: ``--init``.

    The source must have the model's shape (the first differing field is
    named); returns the head weights left as initialised (a QA head when
    starting from a pre-trained encoder).
    """
    from .model import BertModel

    saved, state, source = read_weights(path, bert_config)
    wanted = model.config
    assert isinstance(wanted, ModelConfig)  # our models carry their shape
    check_model_config(saved, wanted, source)
    if saved.hidden_act != wanted.hidden_act:  # the weights load, but the function differs a little
        logger.warning("%s was trained with model.hidden_act=%s but this model uses %s (a TF1 checkpoint's "
                       "gelu is gelu_new)", source, saved.hidden_act, wanted.hidden_act)
    if isinstance(model, BertModel):  # the encoder alone: its keys have no "bert." prefix
        state = {k.removeprefix("bert."): v for k, v in state.items() if k.startswith("bert.")}
    return assign_weights(model, state, source)


def load_model(path: str | Path, head: str = "pretraining", allow_pickle: bool = False,
               bert_config: str | Path | None = None) -> nn.Module:
    """A model from our checkpoint, a Hugging Face BERT directory or a TensorFlow 1 checkpoint.

    Ours is a run directory (its newest complete step) or any directory with
    ``model.safetensors`` and ``config.yaml`` (a step, a SQuAD fine-tune); a
    directory with both ``config.yaml`` and ``config.json`` is read as ours.
    A TF1 checkpoint is a prefix (``ckpt/model.ckpt-28252``) or a directory
    with a ``checkpoint`` file, its shape from ``bert_config`` (default: the
    ``bert_config.json`` beside it).

    ``head`` is ``"pretraining"`` (MLM + NSP), ``"qa"`` (SQuAD span head, newly
    initialised when the source has none) or ``"encoder"`` (BertModel). The
    model is returned in eval mode on the CPU.
    """
    from . import convert, tf1
    from .model import BertForPreTraining, BertForQuestionAnswering, BertModel

    if head not in HEADS:
        raise ValueError(f"head must be one of {', '.join(HEADS)}, got {head!r}")
    path = Path(path)
    prefix = tf1.find_prefix(path)
    checkpoint: Path
    if prefix is not None:
        cfg, state, _ = convert.read_tf1(prefix, bert_config, head=head)
        checkpoint = prefix
    elif (path / "config.json").is_file() and not (path / "config.yaml").is_file():
        return convert.load_hf(path, head=head, allow_pickle=allow_pickle).eval()
    else:
        checkpoint = find_checkpoint(path, weights_only=True)
        verify(checkpoint, WEIGHTS_FILES)
        cfg = read_config(checkpoint).model
        state = load_safetensors(checkpoint / "model.safetensors")
    model: nn.Module
    if head == "encoder":  # with a pooler when the source has one (a QA model has none)
        state = {k.removeprefix("bert."): v for k, v in state.items() if k.startswith("bert.")}
        model = BertModel(cfg, add_pooler="pooler.dense.weight" in state)
    else:
        model = BertForPreTraining(cfg) if head == "pretraining" else BertForQuestionAnswering(cfg)
    missing = assign_weights(model, state, checkpoint)
    if missing and head != "qa":  # a QA head is new when starting from an encoder; nothing else is
        raise CheckpointError(f"{checkpoint}: lacks {', '.join(missing)}")
    return model.eval()
