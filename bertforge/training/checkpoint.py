"""Training state: one step directory per checkpoint, written atomically, resumed exactly.

The layout of a run directory and its step directories, the manifests that
prove a step directory whole, and finding one are :mod:`bertforge.runs`; the
weights inside one are read and written by :mod:`bertforge.formats.weights`. This
module adds what a resume needs besides the weights: the optimizer state
(``optimizer.pt``, or every rank's FSDP shards under ``sharded/``) and
``trainer.pt`` (step, schedule, RNG states, data position, loss scaler,
world size).

A step directory is written under a hidden temporary name and renamed only
when every file is on disk, so a crash mid-save never leaves something that
looks complete. Everything is read back with safetensors,
``torch.load(weights_only=True)`` or torch.distributed.checkpoint through an
allowlist. A file that cannot be read (truncated, edited) is a
:class:`~bertforge.runs.CheckpointError` naming it, never a traceback, and so
is a save that fails for a full disk or a read-only directory. Weights that
are not finite are never saved.

Every job goes through two functions here: :func:`save` writes a step
directory of an :class:`~bertforge.training.engine.Engine`, and :func:`resume` loads
one back into an engine (any world size, any parallel mode).

A checkpoint saved ``confirmed=False`` (a run whose divergence guard is on)
stays under a hidden temporary name until the job has seen the loss of the
step after it, the first that its weights produce: :func:`confirm` then gives
it its name (and rotates the older ones out), :func:`reject` removes it. A
crash before either leaves a temporary, removed at the next start.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import pickle
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed
from safetensors.torch import save_file
from torch import nn

from bertforge.fileio import WriteError, atomic_directory, fsync
from bertforge.formats.weights import (
    check_shapes,
    checked_state,
    first_nonfinite,
    full_state_dict,
    load_safetensors,
    model_shapes,
)
from bertforge.parallel.dist import DistContext, barrier, broadcast, from_main, unwrap
from bertforge.parallel.dist import is_sharded as is_sharded_model
from bertforge.runs import (
    CHECKPOINTS,
    SHARDED,
    STEP_PREFIX,
    CheckpointError,
    complete_checkpoints,
    has_shards,
    verify,
    vocab_file_name,
    write_manifest,
)

from .optim import group_settings, keep_settings

if TYPE_CHECKING:
    from .engine import Engine


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


def nbytes(obj: Any) -> int:
    """The bytes of the tensors in a nested state: what a save will write, roughly."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(v) for v in obj)
    return 0


@contextlib.contextmanager
def _writing(final: Path, needed: int) -> Any:
    """``atomic_directory`` with a full disk or a read-only directory as a CheckpointError."""
    try:
        with atomic_directory(final, needed) as tmp:
            yield tmp
    except WriteError as err:
        raise CheckpointError(str(err)) from None


UNCONFIRMED = ".tmp-unconfirmed"  # the suffix of a checkpoint awaiting confirm (a fileio temporary's name)


@dataclasses.dataclass(frozen=True)
class RunFiles:
    """What every checkpoint of a run holds besides its state: the run's ``config.yaml`` (its text)
    and a copy of its vocab (``data.vocab``; "" = none), so that a checkpoint loads on its own."""

    config_yaml: str
    vocab: str = ""


def step_directory(run_dir: Path, step: int, confirmed: bool = True) -> Path:
    """Where step ``step``'s checkpoint goes: ``checkpoints/step_N``, or its hidden unconfirmed name."""
    name = f"{STEP_PREFIX}{step:08d}"
    return run_dir / CHECKPOINTS / (name if confirmed else f".{name}{UNCONFIRMED}")


def save_checkpoint(run_dir: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    trainer_state: dict[str, Any], files: RunFiles, keep: int = 0, confirmed: bool = True) -> Path:
    """Write ``run_dir/checkpoints/step_N`` atomically; keep only the newest ``keep`` (0 = all)."""
    return save_full_state(run_dir, step, model.state_dict(), optimizer.state_dict(), trainer_state, files, keep,
                           confirmed)


def save_full_state(run_dir: Path, step: int, model_state: dict[str, torch.Tensor], optimizer_state: dict[str, Any],
                    trainer_state: dict[str, Any], files: RunFiles, keep: int = 0, confirmed: bool = True) -> Path:
    """``save_checkpoint`` from the state dicts: the whole model's weights and one process's optimizer
    state (a pipeline's stages gather theirs into these, see training/pipeline.py)."""
    final = step_directory(run_dir, step, confirmed)
    with _writing(final, nbytes(model_state) + nbytes(optimizer_state)) as tmp:
        save_file({k: v.detach().cpu().contiguous() for k, v in model_state.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        torch.save(optimizer_state, tmp / "optimizer.pt")
        _write_trainer_files(tmp, trainer_state, files)
        write_manifest(tmp)
    if confirmed:
        _keep_newest(run_dir, keep, final)
    return final


def save_sharded_checkpoint(run_dir: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                            trainer_state: dict[str, Any], files: RunFiles, ctx: DistContext,
                            keep: int = 0, confirmed: bool = True) -> Path:
    """The FSDP counterpart of ``save_checkpoint``; every rank calls it.

    Each rank writes its shards of the weights and optimizer state with
    torch.distributed.checkpoint into ``sharded/`` of one temporary step
    directory; rank 0 adds the gathered full weights (``model.safetensors``,
    for export and ``load_model``), the trainer state and the config, and
    renames the directory once every rank's shards are on disk.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    final = step_directory(run_dir, step, confirmed)
    needed = 3 * nbytes(model.state_dict()) * ctx.world_size  # weights twice, plus Adam/LAMB moments
    with _writing(final, needed) if ctx.is_main else contextlib.nullcontext() as tmp:
        tmp = Path(broadcast(ctx, str(tmp)))
        model_state, optimizer_state = get_state_dict(model, optimizer)
        # Returns on any rank only when all ranks' files and the metadata are written.
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=tmp / SHARDED)
        full = full_state_dict(model)
        if ctx.is_main:
            save_file({k: v.contiguous() for k, v in full.items()}, str(tmp / "model.safetensors"),
                      metadata={"format": "pt"})
            _write_trainer_files(tmp, trainer_state, files)
            write_manifest(tmp)  # every rank's shards are on disk: dcp.save returned
    if ctx.is_main and confirmed:
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


def _write_trainer_files(directory: Path, trainer_state: dict[str, Any], files: RunFiles) -> None:
    torch.save(trainer_state, directory / "trainer.pt")
    (directory / "config.yaml").write_text(files.config_yaml, encoding="utf-8")
    vocab = Path(files.vocab) if files.vocab else None
    if vocab is not None and vocab.is_file():
        shutil.copyfile(vocab, directory / vocab_file_name(vocab))


def _keep_newest(run_dir: Path, keep: int, current: Path) -> None:
    """Keep ``current`` (just written, finite) and the ``keep - 1`` newest before it.

    Step directories after ``current`` (left by a run resumed from an earlier
    step) are not counted, so rotation never deletes the checkpoint just written.
    Nor does it delete the newest one from before a spike of the loss (:func:`spiked`)
    while those after it are all from during one (saved at a signal or at the end).
    """
    if keep > 0:
        older = [p for p in complete_checkpoints(run_dir) if p.name < current.name]
        removed = older[:len(older) - (keep - 1)]
        sound = newest_sound([*older, current])
        for old in removed:
            if old != sound:
                shutil.rmtree(old)


def spiked(checkpoint: Path) -> bool:
    """Whether a checkpoint was saved during a spike of the loss (its divergence guard counting
    spikes), so its weights may be the ruined ones; one whose trainer state cannot be read counts
    as spiked too (it is no checkpoint to fall back on)."""
    try:
        guard = read_trainer_state(checkpoint).get("guard")
    except CheckpointError:
        return True
    return isinstance(guard, dict) and bool(guard.get("spikes"))


def newest_sound(checkpoints: list[Path]) -> Path | None:
    """The newest of ``checkpoints`` (oldest first) not saved during a spike of the loss."""
    return next((p for p in reversed(checkpoints) if not spiked(p)), None)


def read_trainer_state(checkpoint: Path) -> dict[str, Any]:
    """``trainer.pt``: step, data position, schedule, RNG, world size (no code is unpickled)."""
    state = torch_load(checkpoint / "trainer.pt")
    if not isinstance(state, dict) or "step" not in state:
        raise CheckpointError(f"{checkpoint / 'trainer.pt'}: not a trainer state (no step)")
    return state


def save(run_dir: Path, step: int, engine: Engine, files: RunFiles, state: dict[str, Any], *, keep: int,
         parallel: str, confirmed: bool = True) -> Path:
    """Write step ``step`` of a run; every rank calls it, and all get the step directory back.

    ``state`` is what the job adds to the engine's (its data position, say); ``parallel`` (the
    run's ``execution.parallel``) is recorded with it. The newest ``keep`` step directories are
    kept (``checkpoint.keep``; 0 = all). ``confirmed=False`` writes it under its hidden name, for
    :func:`confirm` or :func:`reject` to decide.
    """
    from .pipeline import PipelineEngine

    ctx = engine.dist
    state = {"step": step, **engine.state_dict(), **state, "world_size": ctx.world_size, "parallel": parallel}
    model = unwrap(engine.model)
    check_finite(model, ctx, step)
    if isinstance(engine, PipelineEngine):
        # The stages' states, gathered on rank 0 into one process's. The data position is per
        # pipeline: its world is the pipelines (data-parallel replicas), not the ranks.
        state.update(world_size=engine.layout.replicas, pipeline_stages=engine.layout.stages)
        full = engine.full_state()  # a collective; rank 0 gets the state

        def write() -> Path:
            assert full is not None
            return save_full_state(run_dir, step, full[0], full[1], state, files, keep, confirmed)
        return from_main(ctx, write)
    if is_sharded_model(model):
        return save_sharded_checkpoint(run_dir, step, model, engine.optimizer, state, files, ctx, keep, confirmed)
    return from_main(ctx, lambda: save_checkpoint(run_dir, step, model, engine.optimizer, state, files, keep,
                                                  confirmed))


def confirm(ctx: DistContext, run_dir: Path, unconfirmed: Path, keep: int) -> Path:
    """Give a checkpoint saved ``confirmed=False`` its name (and rotate the older ones out): the
    loss its weights gave was seen to be normal. Every rank calls it; all get the new path."""
    final = unconfirmed.with_name(unconfirmed.name.removeprefix(".").removesuffix(UNCONFIRMED))

    def rename() -> Path:
        unconfirmed.replace(final)
        fsync(final.parent)
        _keep_newest(run_dir, keep, final)
        return final
    return from_main(ctx, rename)


def reject(ctx: DistContext, unconfirmed: Path) -> None:
    """Remove a checkpoint saved ``confirmed=False`` whose weights gave a spike of the loss."""
    from_main(ctx, lambda: shutil.rmtree(unconfirmed))


def resume(checkpoint: Path, engine: Engine, verified: bool = False) -> dict[str, Any]:
    """Load a step directory into a built engine: weights, optimizer, schedule, scaler, RNG.
    The optimizer's settings and the schedule's lr are the engine's, as this run's config built
    them: a resume with a changed train.lr (or weight decay, schedule, …) goes on with the change.

    Every rank calls it, after ``prepare_model`` and the optimizer are built,
    whatever the world size and parallel mode of the run that saved it: FSDP
    shards are resharded, full files are sharded as they load. Rank 0 first
    checks every file against the manifest (unless ``verified``: the caller
    did). Returns the trainer state (``step``, the job's data position, ``world_size``, …).
    """
    from .pipeline import PipelineEngine

    if not verified:
        from_main(engine.dist, lambda: verify(checkpoint))
    model, optimizer = unwrap(engine.model), engine.optimizer
    trainer_state = read_trainer_state(checkpoint)
    settings = group_settings(optimizer)  # this run's lr, weight decay, betas, …: they win over the saved ones
    if isinstance(engine, PipelineEngine):
        if has_shards(checkpoint):
            raise CheckpointError(f"{checkpoint}: holds FSDP shards of the optimizer state, which pipeline stages "
                                  f"cannot load; resume it with execution.parallel=fsdp")
        engine.load_full_state(load_safetensors(checkpoint / "model.safetensors"),
                               torch_load(checkpoint / "optimizer.pt"), str(checkpoint))
    elif has_shards(checkpoint):
        load_sharded_checkpoint(checkpoint, model, optimizer)
    else:
        optimizer_state = torch_load(checkpoint / "optimizer.pt")
        if is_sharded_model(model):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            state = load_safetensors(checkpoint / "model.safetensors")
            check_shapes(model_shapes(model), state, checkpoint)
            # torch's stub wants dict[str, ValueType], and dict is invariant: a dict of tensors is one
            set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))  # type: ignore[arg-type]
            load_full_optimizer_state(model, optimizer, optimizer_state)
        else:
            model.load_state_dict(checked_state(model, load_safetensors(checkpoint / "model.safetensors"), checkpoint))
            try:
                optimizer.load_state_dict(optimizer_state)
            except (ValueError, KeyError, TypeError, IndexError) as err:
                raise CheckpointError(f"{checkpoint / 'optimizer.pt'}: does not fit this optimizer ({err})") from None
    engine.load_state_dict(trainer_state)
    keep_settings(optimizer, engine.scheduler, settings)
    return trainer_state
