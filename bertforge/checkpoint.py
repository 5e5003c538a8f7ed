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

With ``execution.parallel: fsdp`` the optimizer state (and a second copy of
the weights) is every rank's shards, written by torch.distributed.checkpoint
into ``sharded/`` (``.metadata`` plus one ``.distcp`` file per rank) instead of
``optimizer.pt``; ``model.safetensors`` still holds the full weights.

A step directory is written under a hidden temporary name and renamed only
when every file is on disk, so a crash mid-save never leaves something that
looks complete. Everything is read back with safetensors,
``torch.load(weights_only=True)`` or torch.distributed.checkpoint.

Every command goes through three functions here: :func:`save` writes a step
directory of an :class:`~bertforge.engine.Engine`, :func:`resume` loads one
back into an engine (any world size, any parallel mode), and
:func:`load_weights` (``--init``) and :func:`load_model` load weights only, from
our checkpoints or a Hugging Face directory. A tensor whose shape differs from
the model's, or a missing encoder tensor, is an error that names it, wherever
it is loaded (:func:`assign_weights`).
"""

from __future__ import annotations

import contextlib
import io
import pickle
import shutil
import typing
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from .config import Config, ConfigError, Head, ModelConfig, config_from_dict, load_yaml
from .dist import DistContext, barrier, broadcast, from_main, unwrap
from .dist import is_sharded as is_sharded_model
from .fileio import atomic_directory

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


class CheckpointError(ValueError):
    """A missing, incomplete or incompatible checkpoint; the message names it."""


def save_weights(model: nn.Module, path: Path) -> None:
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(path), metadata={"format": "pt"})


def save_checkpoint(run_dir: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    trainer_state: dict[str, Any], cfg: Config, keep: int = 0) -> Path:
    """Write ``run_dir/checkpoints/step_N`` atomically; keep only the newest ``keep`` (0 = all)."""
    final = run_dir / CHECKPOINTS / f"{STEP_PREFIX}{step:08d}"
    with atomic_directory(final) as tmp:
        save_weights(model, tmp / "model.safetensors")
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        _write_trainer_files(tmp, trainer_state, cfg)
    _keep_newest(run_dir, keep)
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
    with atomic_directory(final) if ctx.is_main else contextlib.nullcontext() as tmp:
        tmp = Path(broadcast(ctx, str(tmp)))
        model_state, optimizer_state = get_state_dict(model, optimizer)
        # Returns on any rank only when all ranks' files and the metadata are written.
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=tmp / SHARDED)
        full = full_state_dict(model)
        if ctx.is_main:
            save_file({k: v.contiguous() for k, v in full.items()}, str(tmp / "model.safetensors"),
                      metadata={"format": "pt"})
            _write_trainer_files(tmp, trainer_state, cfg)
    if ctx.is_main:
        _keep_newest(run_dir, keep)
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


def _keep_newest(run_dir: Path, keep: int) -> None:
    if keep > 0:
        for old in complete_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old)


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
    try:
        return config_from_dict(load_yaml(checkpoint / "config.yaml"))
    except ConfigError as err:
        raise CheckpointError(f"{checkpoint / 'config.yaml'}: {err}") from None


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
    return torch.load(checkpoint / "trainer.pt", map_location="cpu", weights_only=True)


def save(run_dir: Path, step: int, engine: Engine, cfg: Config, state: dict[str, Any]) -> Path:
    """Write step ``step`` of a run; every rank calls it, and all get the step directory back.

    ``state`` is what the job adds to the engine's (its data position, say).
    """
    ctx = engine.dist
    state = {"step": step, **engine.state_dict(), **state, "world_size": ctx.world_size,
             "parallel": cfg.execution.parallel}
    model, keep = unwrap(engine.model), cfg.checkpoint.keep
    if is_sharded_model(model):
        return save_sharded_checkpoint(run_dir, step, model, engine.optimizer, state, cfg, ctx, keep=keep)
    return from_main(ctx, lambda: save_checkpoint(run_dir, step, model, engine.optimizer, state, cfg, keep=keep))


def resume(checkpoint: Path, engine: Engine) -> dict[str, Any]:
    """Load a step directory into a built engine: weights, optimizer, schedule, scaler, RNG.

    Every rank calls it, after ``prepare_model`` and the optimizer are built,
    whatever the world size and parallel mode of the run that saved it: FSDP
    shards are resharded, full files are sharded as they load. Returns the
    trainer state (``step``, the job's data position, ``world_size``, …).
    """
    model, optimizer = unwrap(engine.model), engine.optimizer
    trainer_state = read_trainer_state(checkpoint)
    if has_shards(checkpoint):
        load_sharded_checkpoint(checkpoint, model, optimizer)
    else:
        optimizer_state = torch.load(checkpoint / "optimizer.pt", map_location="cpu", weights_only=True)
        if is_sharded_model(model):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            state = load_file(str(checkpoint / "model.safetensors"))
            _check_shapes(model_shapes(model), state, checkpoint)
            # torch's stub wants dict[str, ValueType], and dict is invariant: a dict of tensors is one
            set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))  # type: ignore[arg-type]
            load_full_optimizer_state(model, optimizer, optimizer_state)
        else:
            model.load_state_dict(_checked(model, load_file(str(checkpoint / "model.safetensors")), checkpoint))
            optimizer.load_state_dict(optimizer_state)
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


def read_weights(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Path]:
    """(model shape, weights in our BertForPreTraining names, the directory read) of our
    checkpoint (run, step or model directory) or a Hugging Face BERT directory."""
    from . import convert

    path = Path(path)
    if (path / "config.json").is_file() and not (path / "config.yaml").is_file():
        return convert.read_hf_config(path), convert.hf_to_ours(convert.load_hf_state_dict(path), "pretraining"), path
    checkpoint = find_checkpoint(path, weights_only=True)
    return read_config(checkpoint).model, load_file(str(checkpoint / "model.safetensors")), checkpoint


def load_weights(model: nn.Module, path: str | Path) -> list[str]:
    """Load the weights at ``path`` (see :func:`read_weights`) into a built model: ``--init``.

    The source must have the model's shape (the first differing field is
    named); returns the head weights left as initialised (a QA head when
    starting from a pre-trained encoder).
    """
    from .model import BertModel

    saved, state, source = read_weights(path)
    wanted = model.config
    assert isinstance(wanted, ModelConfig)  # our models carry their shape
    check_model_config(saved, wanted, source)
    if isinstance(model, BertModel):  # the encoder alone: its keys have no "bert." prefix
        state = {k.removeprefix("bert."): v for k, v in state.items() if k.startswith("bert.")}
    return assign_weights(model, state, source)


def load_model(path: str | Path, head: str = "pretraining", allow_pickle: bool = False) -> nn.Module:
    """A model from our checkpoint or a Hugging Face BERT directory.

    Ours is a run directory (its newest complete step) or any directory with
    ``model.safetensors`` and ``config.yaml`` (a step, a SQuAD fine-tune); a
    directory with both ``config.yaml`` and ``config.json`` is read as ours.

    ``head`` is ``"pretraining"`` (MLM + NSP), ``"qa"`` (SQuAD span head, newly
    initialised when the source has none) or ``"encoder"`` (BertModel). The
    model is returned in eval mode on the CPU.
    """
    from . import convert
    from .model import BertForPreTraining, BertForQuestionAnswering, BertModel

    if head not in HEADS:
        raise ValueError(f"head must be one of {', '.join(HEADS)}, got {head!r}")
    path = Path(path)
    if (path / "config.json").is_file() and not (path / "config.yaml").is_file():
        return convert.load_hf(path, head=head, allow_pickle=allow_pickle).eval()
    checkpoint = find_checkpoint(path, weights_only=True)
    cfg = read_config(checkpoint).model
    state = load_file(str(checkpoint / "model.safetensors"))
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
