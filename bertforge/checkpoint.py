"""Checkpoints: one directory per step, written atomically, resumed exactly.

A run directory looks like::

    runs/NAME/
      config.yaml          the resolved config of the run
      vocab.txt            the vocab the run trains with
      metrics.jsonl
      checkpoints/step_00000100/
        model.safetensors  weights, Hugging Face parameter names (tied decoder omitted)
        optimizer.pt       optimizer state (tensors and numbers only)
        trainer.pt         step, scheduler, RNG states, data position, loss scaler
        config.yaml, vocab.txt

A step directory is written under a hidden temporary name and renamed only
when every file is on disk, so a crash mid-save never leaves something that
looks complete. Everything is read back with safetensors or
``torch.load(weights_only=True)``: nothing is unpickled.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from .config import Config, ConfigError, ModelConfig, config_from_dict, load_yaml
from .fileio import atomic_directory

CHECKPOINTS = "checkpoints"
STEP_PREFIX = "step_"
REQUIRED_FILES = ("model.safetensors", "optimizer.pt", "trainer.pt", "config.yaml")
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
        torch.save(trainer_state, tmp / "trainer.pt")
        (tmp / "config.yaml").write_text(cfg.to_yaml(), encoding="utf-8")
        vocab = Path(cfg.data.vocab) if cfg.data.vocab else None
        if vocab is not None and vocab.is_file():
            shutil.copyfile(vocab, tmp / "vocab.txt")
    if keep > 0:
        for old in complete_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old)
    return final


def is_complete(path: Path) -> bool:
    return (path.is_dir() and path.name.startswith(STEP_PREFIX)
            and all((path / f).is_file() for f in REQUIRED_FILES))


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete step directories of a run, oldest first; temporary ones are ignored."""
    root = run_dir / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if is_complete(p))


def find_checkpoint(path: str | Path) -> Path:
    """A step directory, or the newest complete one of a run directory."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}")
    if path.name.startswith(STEP_PREFIX) or (path / "model.safetensors").exists():
        if not is_complete(path):
            missing = [f for f in REQUIRED_FILES if not (path / f).is_file()]
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


def load_trainer_state(checkpoint: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(optimizer state, trainer state), loaded without unpickling code."""
    optimizer_state = torch.load(checkpoint / "optimizer.pt", map_location="cpu", weights_only=True)
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
    """A model from our checkpoint (step or run directory) or a Hugging Face BERT directory.

    ``head`` is ``"pretraining"`` (MLM + NSP), ``"qa"`` (SQuAD span head, newly
    initialised when the source has none) or ``"encoder"`` (BertModel). The
    model is returned in eval mode on the CPU.
    """
    from . import convert
    from .model import BertForPreTraining, BertForQuestionAnswering, BertModel

    if head not in HEADS:
        raise ValueError(f"head must be one of {', '.join(HEADS)}, got {head!r}")
    path = Path(path)
    if (path / "config.json").is_file():
        return convert.load_hf(path, head=head, allow_pickle=allow_pickle).eval()
    checkpoint = find_checkpoint(path)
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
