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
"""

from __future__ import annotations

import contextlib
import io
import pickle
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from .config import Config, ConfigError, ModelConfig, config_from_dict, load_yaml
from .dist import DistContext, barrier, broadcast
from .fileio import atomic_directory

CHECKPOINTS = "checkpoints"
STEP_PREFIX = "step_"
SHARDED = "sharded"  # torch.distributed.checkpoint's directory in an FSDP step directory
REQUIRED_FILES = ("model.safetensors", "trainer.pt", "config.yaml")
# The optimizer state: one file (saved by one process), or every rank's shards (FSDP).
OPTIMIZER_FILES = ("optimizer.pt", f"{SHARDED}/.metadata")
WEIGHTS_FILES = ("model.safetensors", "config.yaml")  # all load_model needs
HEADS = ("pretraining", "qa", "encoder")


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
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

    final = run_dir / CHECKPOINTS / f"{STEP_PREFIX}{step:08d}"
    with atomic_directory(final) if ctx.is_main else contextlib.nullcontext() as tmp:
        tmp = Path(broadcast(ctx, str(tmp)))
        model_state, optimizer_state = get_state_dict(model, optimizer)
        # Returns on any rank only when all ranks' files and the metadata are written.
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=tmp / SHARDED)
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
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
    state = {"model": model_state, "optimizer": optimizer_state}
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
    by_name = {"state": {order[i]: s for i, s in state["state"].items()},
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


def is_sharded(checkpoint: Path) -> bool:
    """Whether the optimizer state is FSDP shards (resumed only with execution.parallel=fsdp)."""
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
    fine-tune's output); resuming needs the optimizer and trainer state too.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}")
    if path.name.startswith(STEP_PREFIX) or (path / "model.safetensors").exists():
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


def load_trainer_state(checkpoint: Path) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(optimizer state, trainer state), loaded without unpickling code.

    The optimizer state is None for a sharded checkpoint: ``load_sharded_checkpoint`` reads it.
    """
    optimizer_state = None if is_sharded(checkpoint) else torch.load(
        checkpoint / "optimizer.pt", map_location="cpu", weights_only=True)
    trainer_state = torch.load(checkpoint / "trainer.pt", map_location="cpu", weights_only=True)
    return optimizer_state, trainer_state


def load_weights(model: nn.Module, checkpoint: Path, strict: bool = True) -> list[str]:
    """Load ``model.safetensors`` into model; returns the keys it had to leave as initialised."""
    state = load_file(str(checkpoint / "model.safetensors"))
    own = model.state_dict()
    for key, tensor in state.items():
        if key in own and own[key].shape != tensor.shape:
            raise CheckpointError(f"{checkpoint}: weight {key} has shape {tuple(tensor.shape)}, "
                                  f"the model expects {tuple(own[key].shape)}")
    result = model.load_state_dict(state, strict=strict)
    return list(result.missing_keys)


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
    if head == "pretraining":
        model = BertForPreTraining(cfg)
        load_weights(model, checkpoint)
        return model.eval()
    # Other heads take the encoder (and a QA head if the checkpoint has one);
    # layers the checkpoint lacks stay as initialised.
    model = BertForQuestionAnswering(cfg) if head == "qa" else BertModel(cfg)
    state = load_file(str(checkpoint / "model.safetensors"))
    if head == "encoder":
        state = {k[len("bert."):]: v for k, v in state.items() if k.startswith("bert.")}
    own = model.state_dict()
    model.load_state_dict({k: v for k, v in state.items() if k in own}, strict=False)
    return model.eval()
