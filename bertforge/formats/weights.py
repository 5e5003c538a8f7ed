"""Our model weights, ``model.safetensors`` with ``config.yaml`` beside it, and what every format's import shares.

Ours is a step directory of a run (:mod:`bertforge.runs`), a SQuAD fine-tune's
output or an imported model; our parameter names are Hugging Face's. A tensor
whose shape differs from the model's, or a missing encoder tensor, is an error
that names it, wherever it is loaded (:func:`assign_weights`);
:func:`model_for_head` builds the model that a head and a source's weights ask
for; :func:`write_model_dir` writes an imported model as our model directory.
The other formats build on this module (:mod:`bertforge.formats.hf`,
:mod:`bertforge.formats.bert_tf1`, :mod:`bertforge.formats.tf2`), and
:mod:`bertforge.formats.load` reads a model from any of them. Training state
(optimizer, schedule, RNG) is :mod:`bertforge.training.checkpoint`'s, which
builds on this module.
"""

from __future__ import annotations

import shutil
import typing
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from bertforge.config import (
    Config,
    ConfigError,
    Head,
    ModelConfig,
    config_from_dict,
    load_yaml,
    use_model,
    validate,
)
from bertforge.fileio import atomic_directory, refuse_live_runs
from bertforge.models.bert import BertForMaskedLM, BertForPreTraining, BertModel, init_weights
from bertforge.models.families import HEAD_PREFIXES, model_class
from bertforge.parallel.dist import is_sharded, unwrap
from bertforge.runs import (
    VOCAB_FILES,
    CheckpointError,
    verify,
    vocab_file_name,
    write_manifest,
)

HEADS = typing.get_args(Head)
SAFETENSORS = "model.safetensors"


class ConversionError(ValueError):
    """A checkpoint that cannot be read or converted; the message names the file and key."""


# ---------------------------------------------------------------- our weights, config.yaml and model directory


def load_safetensors(path: Path, error: type[ValueError] = CheckpointError) -> dict[str, torch.Tensor]:
    """``load_file`` with an ``error`` naming the file when it cannot be read."""
    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise unreadable(path, err, error) from None


def weight_shapes(path: Path, error: type[ValueError] = CheckpointError) -> dict[str, tuple[int, ...]]:
    """The tensor shapes of a safetensors file, from its header alone."""
    try:
        with safe_open(str(path), "pt") as f:
            return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise unreadable(path, err, error) from None


def unreadable(path: Path, err: Exception, error: type[ValueError]) -> ValueError:
    """The one-line error for a safetensors file that cannot be read (missing, truncated, edited):
    safetensors' own is a traceback naming no file."""
    if isinstance(err, FileNotFoundError):
        return error(f"{path}: missing")
    first = str(err).splitlines()[0] if str(err) else type(err).__name__
    return error(f"{path}: not a readable safetensors file (truncated or edited?): {first}")


def save_weights(model: nn.Module, path: Path) -> None:
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(path), metadata={"format": "pt"})


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


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights on the CPU: gathered from every rank's shards under FSDP
    (a collective: every rank calls it; rank 0 gets the weights, the others nothing)."""
    if not is_sharded(model):
        return {k: v.detach().cpu() for k, v in unwrap(model).state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return typing.cast(dict[str, torch.Tensor], state)  # a full state dict holds plain tensors


def model_shapes(model: nn.Module) -> dict[str, torch.Size]:
    """Parameter and buffer shapes by name; the whole tensor's for FSDP shards."""
    return {k: v.shape for k, v in model.state_dict().items()}


def check_shapes(own: dict[str, torch.Size], state: dict[str, torch.Tensor], source: Path | str,
                  error: type[ValueError] = CheckpointError) -> None:
    for key, tensor in state.items():
        if key in own and own[key] != tensor.shape:
            raise error(f"{source}: weight {key} has shape {tuple(tensor.shape)} in the checkpoint but "
                        f"the model expects {tuple(own[key])}")


def checked_state(model: nn.Module, state: dict[str, torch.Tensor], source: Path) -> dict[str, torch.Tensor]:
    """``state`` if it holds exactly the model's tensors with their shapes; an error naming the first that does not."""
    own = model_shapes(model)
    check_shapes(own, state, source)
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
    check_shapes(own, state, source, error)
    heads = HEAD_PREFIXES[typing.cast(ModelConfig, model.config).family]  # (another task's head: not loaded)
    unknown = [k for k in state if k not in own and not k.startswith(heads)]
    if unknown:
        raise error(f"{source}: weights unknown to this model: {', '.join(unknown)}")
    missing = [k for k in own if k not in state]
    missing_encoder = [k for k in missing if not k.startswith(heads)]
    if missing_encoder:
        raise error(f"{source}: checkpoint lacks encoder weights: {', '.join(missing_encoder)}")
    model.load_state_dict({k: v for k, v in state.items() if k in own}, strict=False)
    return missing


def read_config(checkpoint: Path) -> Config:
    verify(checkpoint, ["config.yaml"])
    try:
        cfg = config_from_dict(load_yaml(checkpoint / "config.yaml"))
    except ConfigError as err:
        raise CheckpointError(f"{checkpoint / 'config.yaml'}: {err}") from None
    check_config_fits(cfg.model, checkpoint)
    return cfg


def check_config_fits(cfg: ModelConfig, checkpoint: Path) -> None:
    """A checkpoint's model config against the shapes of its weights (our names), before a model is
    built of it: an edited ``config.yaml`` (with no manifest to tell) would build a model of any size."""
    shapes = weight_shapes(checkpoint / "model.safetensors")
    p = "model." if cfg.family == "modernbert" else "bert."
    if not any(key.startswith(p) for key in shapes) and any(key.startswith("encoder.") for key in shapes):
        p = "encoder."  # an embedding model's training checkpoint (tasks/retrieval): its encoder under Embedder's name
    if cfg.family == "modernbert":  # (rotary positions: no position table to measure)
        layer_prefix = f"{p}layers."
        dims = {"vocab_size": (f"{p}embeddings.tok_embeddings.weight", 0),
                "hidden_size": (f"{p}embeddings.tok_embeddings.weight", 1),
                "intermediate_size": (f"{p}layers.0.mlp.Wo.weight", 1)}
    else:
        layer_prefix = f"{p}encoder.layer."
        dims = {"vocab_size": (f"{p}embeddings.word_embeddings.weight", 0),
                "hidden_size": (f"{p}embeddings.word_embeddings.weight", 1),
                "max_position_embeddings": (f"{p}embeddings.position_embeddings.weight", 0),
                "type_vocab_size": (f"{p}embeddings.token_type_embeddings.weight", 0),
                "intermediate_size": (f"{p}encoder.layer.0.intermediate.dense.weight", 0)}
    layers = {key[len(layer_prefix):].split(".")[0] for key in shapes if key.startswith(layer_prefix)}
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
    shape_fields = ("family", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "intermediate_size", "max_position_embeddings", "type_vocab_size")
    for name in shape_fields:
        have, want = getattr(saved, name), getattr(wanted, name)
        if have != want:
            raise CheckpointError(f"checkpoint {source} has model.{name}={have} "
                                  f"but the config asks for model.{name}={want}")


def write_model_dir(model: nn.Module, cfg: ModelConfig, out_dir: Path, vocab_path: Path | str | None,
                    lowercase: bool = True) -> None:
    """An imported model as our model directory (weights, a config that validates, the vocab under
    its name, ``vocab.txt`` or ``tokenizer.json``, whether its text is ``lowercase``d, the manifest),
    written whole or not at all."""
    vocab_name = vocab_file_name(vocab_path) if vocab_path is not None else VOCAB_FILES[0]
    config = Config()
    use_model(config, cfg)
    config.data.seq_len = min(config.data.seq_len, cfg.max_position_embeddings)  # a config that validates
    config.data.max_predictions = min(config.data.max_predictions, config.data.seq_len)
    config.data.lowercase = lowercase
    if vocab_path is not None:
        config.data.vocab = str((out_dir / vocab_name).resolve())
    validate(config)
    with atomic_directory(out_dir) as tmp:
        save_weights(model, tmp / SAFETENSORS)
        (tmp / "config.yaml").write_text(config.to_yaml(), encoding="utf-8")
        if vocab_path is not None:
            shutil.copyfile(vocab_path, tmp / vocab_name)
        write_manifest(tmp)


# ---------------------------------------------------------------- a model for a head; an export's target


def model_for_head(head: str, cfg: ModelConfig, state: dict[str, torch.Tensor], num_labels: int | None,
                   source: Path | str, error: type[ValueError]) -> nn.Module:
    """Our model for ``head``, shaped to take ``state`` (our names; the encoder's unprefixed).

    A classifier's size is its weights' when ``state`` has them (``num_labels``,
    when given, must agree), else ``num_labels``.
    """
    cls = model_class(cfg, typing.cast(Head, head))
    if cls is BertForPreTraining:  # a masked LM without the NSP head (train.objective mlm) stays one
        masked_lm_only = "cls.predictions.bias" in state and "cls.seq_relationship.weight" not in state
        return (BertForMaskedLM if masked_lm_only else BertForPreTraining)(cfg)
    if cls is BertModel:  # with a pooler when the source has one (a QA model has none)
        model = BertModel(cfg, add_pooler="pooler.dense.weight" in state)
        # BertModel alone is not initialised by its constructor; match the task models.
        init_weights(model, cfg.initializer_range)
        return model
    if head in ("pretraining", "qa", "encoder"):
        return cls(cfg)
    have = state.get("classifier.weight")
    if have is not None and num_labels is not None and have.shape[0] != num_labels:
        raise error(f"{source}: its classifier has {have.shape[0]} labels, not the {num_labels} asked for "
                    "(a model fine-tuned for another task?)")
    labels = int(have.shape[0]) if have is not None else num_labels
    if labels is None:
        raise error(f"{source}: has no classifier; give num_labels for a new {head} head")
    return cls(cfg, labels)


def check_export_target(out_dir: Path | str, overwrite: bool = False, own: Path | None = None) -> None:
    """Refuse to export into an existing file or non-empty directory unless ``overwrite``, and
    even then when a live run writes in it, below it or above it (but the run whose lock is
    ``own``: this process, exporting into its own run directory)."""
    out_dir = Path(out_dir)
    if not (out_dir.exists() or out_dir.is_symlink()):
        return
    if overwrite:
        refuse_live_runs(out_dir, own)
        return
    if out_dir.is_dir() and not out_dir.is_symlink() and not any(out_dir.iterdir()):
        return  # an empty directory holds nothing to lose
    raise ConversionError(f"{out_dir}: already exists and is not an empty directory; pass --overwrite "
                          "(overwrite=True in Python) to replace it")
