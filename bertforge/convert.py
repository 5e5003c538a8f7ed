"""Checkpoint formats: Hugging Face BERT directories in and out.

A Hugging Face BERT directory holds ``config.json`` and the weights, as
``model.safetensors`` (or a sharded ``model.safetensors.index.json``) or, in
older uploads, the pickle file ``pytorch_model.bin``. Our parameter names are
Hugging Face's ``BertForPreTraining`` / ``BertForQuestionAnswering`` /
``BertModel`` names, so the key map is small:

* a bare ``BertModel`` checkpoint has no ``bert.`` prefix; task models have it;
* ``embeddings.position_ids`` (a buffer of 0..max_pos-1) is dropped;
* ``cls.predictions.decoder.weight`` is the word embedding matrix (tied) and
  ``cls.predictions.decoder.bias`` is ``cls.predictions.bias``; our model keeps
  one copy of each, so the decoder entries are dropped on import and not
  written on export (transformers ties them again when it loads);
* TensorFlow-era names ``LayerNorm.gamma`` / ``LayerNorm.beta`` become
  ``weight`` / ``bias``.

Pickle weights can run code when loaded, so ``pytorch_model.bin`` is read only
when asked for (``allow_pickle=True``), and then with ``weights_only=True``.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import typing
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from .config import Head, ModelConfig
from .fileio import atomic_directory
from .model import ACTIVATIONS, BertForPreTraining, BertForQuestionAnswering, BertModel, init_weights

HEADS = typing.get_args(Head)
SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE = "pytorch_model.bin"
PICKLE_INDEX = "pytorch_model.bin.index.json"


class ConversionError(ValueError):
    """A checkpoint that cannot be read or converted; the message names the file and key."""


class NewlyInitializedWarning(UserWarning):
    """Some head weights were not in the checkpoint and keep their fresh initialisation."""


# ---------------------------------------------------------------- config.json

def model_config_from_hf(config_json: dict, source: str) -> ModelConfig:
    """Our ModelConfig from a parsed Hugging Face ``config.json``; unrelated keys are ignored."""
    model_type = config_json.get("model_type", "bert")
    if model_type != "bert":
        raise ConversionError(f"{source}: model_type={model_type!r} is not supported (only 'bert')")
    pos_type = config_json.get("position_embedding_type", "absolute")
    if pos_type != "absolute":
        raise ConversionError(f"{source}: position_embedding_type={pos_type!r} is not supported "
                              "(only 'absolute')")
    if config_json.get("is_decoder"):  # causal attention, which our encoder does not do
        raise ConversionError(f"{source}: is_decoder=true is not supported (only encoders)")
    hints = typing.get_type_hints(ModelConfig)
    values = {}
    for f in dataclasses.fields(ModelConfig):
        value = config_json.get(f.name)
        if value is None:  # absent, or null (e.g. pad_token_id): keep our default
            continue
        typ = hints[f.name]
        if typing.get_origin(typ) is typing.Literal:  # hidden_act: a string, its value checked below
            typ = str
        allowed = (int, float) if typ is float else typ  # JSON may write 1.0 as 1
        if isinstance(value, bool) or not isinstance(value, allowed):
            raise ConversionError(f"{source}: {f.name}={value!r} is not of type {typ.__name__}")
        values[f.name] = typ(value)
    cfg = ModelConfig(**values)
    if cfg.hidden_act not in ACTIVATIONS:
        raise ConversionError(f"{source}: hidden_act={cfg.hidden_act!r} is not supported "
                              f"(one of {', '.join(ACTIVATIONS)})")
    if cfg.hidden_size % cfg.num_attention_heads:
        raise ConversionError(f"{source}: hidden_size={cfg.hidden_size} is not divisible by "
                              f"num_attention_heads={cfg.num_attention_heads}")
    return cfg


def hf_config_from_model_config(cfg: ModelConfig, architectures: list[str]) -> dict:
    """The ``config.json`` contents transformers needs to rebuild this model."""
    return {
        "architectures": list(architectures),
        "model_type": "bert",
        **dataclasses.asdict(cfg),
        "position_embedding_type": "absolute",
        "tie_word_embeddings": True,  # our MLM decoder always shares the word embeddings
    }


# ---------------------------------------------------------------- weights

def _read_index(index: Path) -> list[Path]:
    """The shard files named by a ``*.index.json``, in a stable order."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ConversionError(f"{index}: not a valid shard index ({err})") from None
    shards = [index.parent / name for name in sorted(set(weight_map.values()))]
    for shard in shards:
        if not shard.is_file():
            raise ConversionError(f"{index}: names shard {shard.name}, which is missing")
    return shards


def _load_pickle(file: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(file, weights_only=True, map_location="cpu")
    except Exception as err:  # weights_only refuses anything but tensors and containers
        raise ConversionError(f"{file}: cannot be loaded with weights_only=True ({err})") from None
    if not isinstance(state, dict):
        raise ConversionError(f"{file}: expected a state dict, got {type(state).__name__}")
    return state


def load_hf_state_dict(path: Path, allow_pickle: bool = False) -> dict[str, torch.Tensor]:
    """All tensors of a Hugging Face directory, by their names in the files, on the CPU."""
    path = Path(path)
    if not path.is_dir():
        raise ConversionError(f"{path}: no such directory")
    if (path / SAFETENSORS).is_file():
        return load_file(path / SAFETENSORS, device="cpu")
    if (path / SAFETENSORS_INDEX).is_file():
        state: dict[str, torch.Tensor] = {}
        for shard in _read_index(path / SAFETENSORS_INDEX):
            state.update(load_file(shard, device="cpu"))
        return state
    pickles = [p for p in (path / PICKLE, path / PICKLE_INDEX) if p.is_file()]
    if pickles and not allow_pickle:
        # No command loads pickles (they can run code): converting once to safetensors serves them all.
        pickle = path / PICKLE
        how = (f"python -c \"import torch; from safetensors.torch import save_file; "
               f"s = torch.load('{pickle}', weights_only=True); "
               f"save_file({{k: v.clone().contiguous() for k, v in s.items()}}, '{path / SAFETENSORS}')\""
               if pickle.is_file() else "transformers' save_pretrained(DIR), which writes safetensors")
        raise ConversionError(
            f"{path} holds only pickle weights ({pickles[0].name}), which bertforge commands do not load; "
            f"convert them once to {SAFETENSORS}: {how} "
            "(in Python, load_model(DIR, allow_pickle=True) reads them with weights_only=True)")
    if (path / PICKLE).is_file():
        return _load_pickle(path / PICKLE)
    if (path / PICKLE_INDEX).is_file():
        state = {}
        for shard in _read_index(path / PICKLE_INDEX):
            state.update(_load_pickle(shard))
        return state
    raise ConversionError(f"{path}: no weights found (looked for {SAFETENSORS}, "
                          f"{SAFETENSORS_INDEX}, {PICKLE}, {PICKLE_INDEX})")


def hf_to_ours(state: dict, head: str) -> dict:
    """Rename Hugging Face keys to ours for ``head``; drop buffers and tied copies.

    Keys this model family does not know are passed through, so that load_hf
    can report them.
    """
    if head not in HEADS:
        raise ConversionError(f"unknown head {head!r} (one of {', '.join(HEADS)})")
    canon: dict[str, torch.Tensor] = {}  # keys in BertForPreTraining form ("bert." prefix)
    for key, value in state.items():
        if key.startswith(("embeddings.", "encoder.", "pooler.")):
            key = "bert." + key
        if ".LayerNorm.gamma" in key or ".LayerNorm.beta" in key:  # TF-era names
            key = key.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
        canon[key] = value
    for buffer in ("bert.embeddings.position_ids", "bert.embeddings.token_type_ids"):
        canon.pop(buffer, None)

    decoder_weight = canon.pop("cls.predictions.decoder.weight", None)
    words = canon.get("bert.embeddings.word_embeddings.weight")
    if decoder_weight is not None and words is not None and not torch.equal(decoder_weight, words):
        # Our MLM head always projects with the word embeddings; an untied
        # decoder cannot be represented, and dropping it would change the model.
        raise ConversionError("cls.predictions.decoder.weight differs from "
                              "bert.embeddings.word_embeddings.weight (untied MLM decoder)")
    decoder_bias = canon.pop("cls.predictions.decoder.bias", None)
    if decoder_bias is not None and "cls.predictions.bias" not in canon:
        canon["cls.predictions.bias"] = decoder_bias

    if head == "encoder":  # our BertModel's keys have no prefix
        return {k.removeprefix("bert."): v for k, v in canon.items()}
    return canon


def _build(head: str, cfg: ModelConfig, with_pooler: bool) -> nn.Module:
    if head == "pretraining":
        return BertForPreTraining(cfg)
    if head == "qa":
        return BertForQuestionAnswering(cfg)
    model = BertModel(cfg, add_pooler=with_pooler)
    # BertModel alone is not initialised by its constructor; match the task models.
    init_weights(model, cfg.initializer_range)
    return model


def read_hf_config(path: Path | str) -> ModelConfig:
    """Our model shape from a Hugging Face directory's ``config.json``."""
    path = Path(path)
    if not path.is_dir():
        raise ConversionError(f"{path}: no such directory")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ConversionError(f"{config_file}: missing (not a Hugging Face model directory?)")
    try:
        config_json = json.loads(config_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ConversionError(f"{config_file}: not valid JSON ({err})") from None
    return model_config_from_hf(config_json, str(config_file))


def load_hf(path: Path | str, head: str = "pretraining", allow_pickle: bool = False) -> nn.Module:
    """Build our model for ``head`` from a Hugging Face directory and load its weights.

    head: "pretraining" (BertForPreTraining), "qa" (BertForQuestionAnswering) or
    "encoder" (BertModel, with a pooler when the checkpoint has one).
    Head weights the checkpoint lacks (cls.*, qa_outputs.*, the pooler) keep
    their fresh initialisation and are named in a NewlyInitializedWarning;
    missing encoder weights, unknown weights and wrong shapes are errors.
    Weights are cast to the model's float32. The model is returned in eval mode.
    """
    from .checkpoint import assign_weights

    path = Path(path)
    if head not in HEADS:
        raise ConversionError(f"unknown head {head!r} (one of {', '.join(HEADS)})")
    cfg = read_hf_config(path)
    state = hf_to_ours(load_hf_state_dict(path, allow_pickle), head)
    model = _build(head, cfg, with_pooler="pooler.dense.weight" in state)
    missing = assign_weights(model, state, path, error=ConversionError)
    if missing:
        warnings.warn(f"{path}: not in the checkpoint, newly initialised: "
                      f"{', '.join(missing)}", NewlyInitializedWarning, stacklevel=2)
    return model.eval()


# ---------------------------------------------------------------- export

def _architecture(model: nn.Module) -> str:
    for cls in (BertForPreTraining, BertForQuestionAnswering, BertModel):
        if isinstance(model, cls):
            return cls.__name__
    raise ConversionError(f"cannot export {type(model).__name__}: expected BertForPreTraining, "
                          "BertForQuestionAnswering or BertModel")


def check_export_target(out_dir: Path | str, overwrite: bool = False) -> None:
    """Refuse to export into an existing file or non-empty directory unless ``overwrite``."""
    out_dir = Path(out_dir)
    if overwrite or not (out_dir.exists() or out_dir.is_symlink()):
        return
    if out_dir.is_dir() and not out_dir.is_symlink() and not any(out_dir.iterdir()):
        return  # an empty directory holds nothing to lose
    raise ConversionError(f"{out_dir}: already exists and is not an empty directory; pass --overwrite "
                          "(overwrite=True in Python) to replace it")


def export_hf(model: nn.Module, out_dir: Path | str, vocab_path: Path | str | None = None,
              overwrite: bool = False) -> Path:
    """Write ``model`` as a Hugging Face directory: config.json, model.safetensors
    (and vocab.txt when ``vocab_path`` is given).

    The files are written into a hidden sibling directory that is renamed to
    ``out_dir`` only when complete, so a crash never leaves a partial export
    under the final name. An existing ``out_dir`` that is not an empty
    directory is an error unless ``overwrite`` (then it is replaced as a whole).
    """
    model = getattr(model, "_orig_mod", model)  # torch.compile wrapper
    out_dir = Path(out_dir)
    check_export_target(out_dir, overwrite)
    architecture = _architecture(model)
    assert isinstance(model, (BertForPreTraining, BertForQuestionAnswering, BertModel))  # _architecture checked
    # Cloned, contiguous CPU tensors: safetensors refuses views and shared storage.
    state = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in model.state_dict().items()}
    config = hf_config_from_model_config(model.config, [architecture])
    # transformers reads the weights' dtype from here (it otherwise logs a notice and guesses).
    config["dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")

    with atomic_directory(out_dir) as tmp:
        save_file(state, tmp / SAFETENSORS, metadata={"format": "pt"})  # transformers checks "format"
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        if vocab_path is not None:
            shutil.copyfile(vocab_path, tmp / "vocab.txt")
    return out_dir
