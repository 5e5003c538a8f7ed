"""Model weights in every format, in and out: ours, Hugging Face directories, TensorFlow 1 checkpoints.

Ours is ``model.safetensors`` with ``config.yaml`` beside it, in a step
directory of a run (:mod:`bertforge.runs`), a SQuAD fine-tune's output or an
imported model; our parameter names are Hugging Face's. :func:`load_model`
builds a model from any of the three formats, :func:`load_weights` loads one
into a built model (``--init``), and :func:`read_weights` gives the shape and
tensors alone. A tensor whose shape differs from the model's, or a missing
encoder tensor, is an error that names it, wherever it is loaded
(:func:`assign_weights`). Training state (optimizer, schedule, RNG) is
:mod:`bertforge.training.checkpoint`'s, which builds on this module.

A Hugging Face BERT directory holds ``config.json`` and the weights, as
``model.safetensors`` (or a sharded ``model.safetensors.index.json``) or, in
older uploads, the pickle file ``pytorch_model.bin``. Since our names are
``BertForPreTraining`` / ``BertForQuestionAnswering`` / ``BertModel``'s, the
key map is small:

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

A TensorFlow 1 checkpoint (google-research/bert's and MLPerf's
``model.ckpt-28252``, read and written by :mod:`bertforge.formats.tf1`) names its
variables ``bert/encoder/layer_0/attention/self/query/kernel`` and so on, with
the shape in ``bert_config.json`` beside it. :func:`tf1_names` is the whole
map: dense ``kernel`` s are the transpose of our ``nn.Linear`` weights,
``gamma`` / ``beta`` are LayerNorm weight / bias, and the heads are
run_pretraining.py's ``cls/predictions/...`` and ``cls/seq_relationship/...``
and run_squad.py's ``cls/squad/...`` (``output_weights`` already [out, in]).
Optimizer slots (``adam_m``, ``adam_v``, any variable under a weight's name)
and ``global_step`` are skipped and reported. google-research/bert's ``gelu``
is the tanh approximation: a TF1 ``"hidden_act": "gelu"`` is our ``gelu_new``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import shutil
import typing
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from bertforge.config import (
    LEFT_OUT,
    ClassifierPooling,
    Config,
    ConfigError,
    Family,
    Head,
    ModelConfig,
    config_from_dict,
    load_yaml,
    model_dict,
    use_model,
    validate,
)
from bertforge.fileio import atomic_directory, refuse_live_runs
from bertforge.models.bert import (
    ACTIVATIONS,
    BertForMaskedLM,
    BertForPreTraining,
    BertForQuestionAnswering,
    BertModel,
    init_weights,
)
from bertforge.models.families import ENCODER_PREFIX, HEAD_PREFIXES, MODELS, head_of, model_class
from bertforge.models.modernbert import ModernBertModel
from bertforge.parallel.dist import is_sharded, unwrap
from bertforge.runs import (
    VOCAB_FILES,
    WEIGHTS_FILES,
    CheckpointError,
    find_checkpoint,
    verify,
    vocab_file_name,
    vocab_in,
    write_manifest,
)

from . import tf1

HEADS = typing.get_args(Head)
SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE = "pytorch_model.bin"
PICKLE_INDEX = "pytorch_model.bin.index.json"


logger = logging.getLogger(__name__)


class ConversionError(ValueError):
    """A checkpoint that cannot be read or converted; the message names the file and key."""


class NewlyInitializedWarning(UserWarning):
    """Some head weights were not in the checkpoint and keep their fresh initialisation."""


# ---------------------------------------------------------------- ours, and any format in

def load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """``load_file`` with a CheckpointError naming the file when it cannot be read."""
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        if isinstance(err, FileNotFoundError):
            raise CheckpointError(f"{path}: missing") from None
        raise CheckpointError(f"{path}: not a readable safetensors file (truncated or edited?): "
                              f"{str(err).splitlines()[0] if str(err) else type(err).__name__}") from None


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
    if cfg.family == "modernbert":  # (rotary positions: no position table to measure)
        layer_prefix = "model.layers."
        dims = {"vocab_size": ("model.embeddings.tok_embeddings.weight", 0),
                "hidden_size": ("model.embeddings.tok_embeddings.weight", 1),
                "intermediate_size": ("model.layers.0.mlp.Wo.weight", 1)}
    else:
        layer_prefix = "bert.encoder.layer."
        dims = {"vocab_size": ("bert.embeddings.word_embeddings.weight", 0),
                "hidden_size": ("bert.embeddings.word_embeddings.weight", 1),
                "max_position_embeddings": ("bert.embeddings.position_embeddings.weight", 0),
                "type_vocab_size": ("bert.embeddings.token_type_embeddings.weight", 0),
                "intermediate_size": ("bert.encoder.layer.0.intermediate.dense.weight", 0)}
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


# A Hugging Face model id: "bert-base-uncased" or "google/bert_uncased_L-4_H-256_A-4".
HF_MODEL_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
# What a BERT or ModernBERT needs from a Hub snapshot (not its TF, Flax or ONNX copies).
HF_MODEL_FILES = ["config.json", "vocab.txt", "tokenizer.json", "model.safetensors", "tokenizer_config.json"]


def resolve_model(path: str | Path) -> Path:
    """``path`` when it exists (or is a TF1 checkpoint prefix); else, when it reads as a Hugging
    Face model id and the local Hugging Face cache (``HF_HOME``, ``HF_HUB_CACHE``) holds that
    model, its snapshot directory. Nothing is downloaded (``hf download ID`` fetches a model into
    the cache); anything else is returned as it is, for the caller's "not found"
    (:func:`find_model` says it)."""
    local = Path(path).expanduser()
    if is_model(local) or not HF_MODEL_ID.match(str(path)):
        return local
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:  # (tokenizers brings it; without it an id is just a missing path)
        return local
    try:
        return Path(snapshot_download(str(path), allow_patterns=HF_MODEL_FILES, local_files_only=True))
    except (LocalEntryNotFoundError, ValueError):  # not cached; or not a valid id after all
        return local


def is_model(path: Path) -> bool:
    """Whether ``path`` names something a model may be read from: a file or directory, or a TF1 prefix."""
    return path.exists() or tf1.find_prefix(path) is not None


def find_model(path: str | Path, error: type[ValueError] = CheckpointError) -> Path:
    """:func:`resolve_model`'s path, or ``error`` saying "model not found"; for what reads as a Hugging
    Face id, that it is not in the local Hugging Face cache either, and where that cache is."""
    found = resolve_model(path)
    if is_model(found):
        return found
    where = ""
    if HF_MODEL_ID.match(str(path)):
        try:
            from huggingface_hub import constants
        except ImportError:  # no cache was looked in
            pass
        else:
            where = (f" (no such path, and no model {path} in the local Hugging Face cache {constants.HF_HUB_CACHE}: "
                     f"`hf download {path}` puts it there)")
    raise error(f"model not found: {path}{where}")


def is_hf_directory(path: Path) -> bool:
    """A Hugging Face model directory (``config.json``), not ours (``config.yaml``, perhaps beside one)."""
    return (path / "config.json").is_file() and not (path / "config.yaml").is_file()


# The head each of transformers' BERT and ModernBERT architectures has, as ``load_model`` names it
# (our classes carry their names).
HF_ARCHITECTURE_HEADS: dict[str, Head] = {
    "BertForMaskedLM": "pretraining",
    **{cls.__name__: head for models in MODELS.values() for head, cls in models.items()}}


def hf_head(path: Path) -> Head:
    """The head of a Hugging Face directory's model (its ``config.json``'s first architecture);
    ``pretraining`` when it names none we know."""
    try:
        config_json = json.loads((path / "config.json").read_text(encoding="utf-8"))
        return HF_ARCHITECTURE_HEADS[config_json["architectures"][0]]
    except (OSError, ValueError, LookupError, TypeError):  # the load that follows names what is amiss
        return "pretraining"


def read_weights(path: str | Path, bert_config: str | Path | None = None,
                 ) -> tuple[ModelConfig, dict[str, torch.Tensor], Path]:
    """(model shape, weights in our BertForPreTraining names, the directory or prefix read) of
    our checkpoint (run, step or model directory), a Hugging Face BERT directory, or a
    TensorFlow 1 checkpoint (a prefix such as ``ckpt/model.ckpt-28252``, or a directory with a
    ``checkpoint`` file; ``bert_config`` defaults to the ``bert_config.json`` beside it); or a
    Hugging Face model id (:func:`find_model`)."""
    path = find_model(path)
    prefix = tf1.find_prefix(path)
    if prefix is not None:  # every head it has comes along: the caller takes what its model needs
        cfg, state, _ = read_tf1(prefix, bert_config, head="encoder")
        return cfg, state, prefix
    if is_hf_directory(path):
        cfg = read_hf_config(path)
        return cfg, hf_to_ours(load_hf_state_dict(path), "pretraining", cfg.family), path
    checkpoint = find_checkpoint(path, weights_only=True)
    verify(checkpoint, WEIGHTS_FILES)
    return read_config(checkpoint).model, load_safetensors(checkpoint / "model.safetensors"), checkpoint


def load_weights(model: nn.Module, path: str | Path, bert_config: str | Path | None = None) -> list[str]:
    """Load the weights at ``path`` (see :func:`read_weights`) into a built model: ``--init``.

    The source must have the model's shape (the first differing field is
    named); returns the head weights left as initialised (a QA head when
    starting from a pre-trained encoder).
    """
    saved, state, source = read_weights(path, bert_config)
    wanted = model.config
    assert isinstance(wanted, ModelConfig)  # our models carry their shape
    check_model_config(saved, wanted, source)
    if saved.hidden_act != wanted.hidden_act:  # the weights load, but the function differs a little
        logger.warning("%s was trained with model.hidden_act=%s but this model uses %s (a TF1 checkpoint's "
                       "gelu is gelu_new)", source, saved.hidden_act, wanted.hidden_act)
    if isinstance(model, (BertModel, ModernBertModel)):  # the encoder alone: its keys have no "bert." prefix
        state = encoder_state(state, wanted)
    return assign_weights(model, state, source)


def encoder_state(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The encoder's weights of a task model's ``state``, named as the bare encoder names them."""
    prefix = ENCODER_PREFIX[cfg.family]
    return {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}


def load_model(path: str | Path, head: str = "pretraining", allow_pickle: bool = False,
               bert_config: str | Path | None = None, num_labels: int | None = None) -> nn.Module:
    """A model from our checkpoint, a Hugging Face BERT directory or a TensorFlow 1 checkpoint.

    Ours is a run directory (its newest complete step) or any directory with
    ``model.safetensors`` and ``config.yaml`` (a step, a SQuAD fine-tune); a
    directory with both ``config.yaml`` and ``config.json`` is read as ours.
    A TF1 checkpoint is a prefix (``ckpt/model.ckpt-28252``) or a directory
    with a ``checkpoint`` file, its shape from ``bert_config`` (default: the
    ``bert_config.json`` beside it).

    ``head`` is ``"pretraining"`` (MLM + NSP, or MLM alone for a source without the NSP head),
    ``"qa"`` (SQuAD span head),
    ``"classification"`` (GLUE: pooler and classifier), ``"token_classification"``
    (NER) or ``"encoder"`` (BertModel); a task head the source lacks is newly
    initialised, with ``num_labels`` outputs for the classifiers (taken from the
    source's classifier when it has one). The model is returned in eval mode on
    the CPU.
    """
    if head not in HEADS:
        raise ValueError(f"head must be one of {', '.join(HEADS)}, got {head!r}")
    path = find_model(path)
    prefix = tf1.find_prefix(path)
    checkpoint: Path
    if prefix is not None:
        cfg, state, _ = read_tf1(prefix, bert_config, head=head)
        checkpoint = prefix
    elif is_hf_directory(path):
        return load_hf(path, head=head, allow_pickle=allow_pickle, num_labels=num_labels).eval()
    else:
        checkpoint = find_checkpoint(path, weights_only=True)
        verify(checkpoint, WEIGHTS_FILES)
        cfg = read_config(checkpoint).model
        state = load_safetensors(checkpoint / "model.safetensors")
    if head == "encoder":
        state = encoder_state(state, cfg)
    model = _build(head, cfg, state, num_labels, checkpoint, CheckpointError)
    missing = assign_weights(model, state, checkpoint)
    if missing and head in ("pretraining", "encoder"):  # a task head is new when starting from an encoder
        raise CheckpointError(f"{checkpoint}: lacks {', '.join(missing)}")
    return model.eval()


# ---------------------------------------------------------------- Hugging Face: config.json


# ModernBertConfig's keys for our fields where the names differ; hidden_act and hidden_dropout_prob
# are two of its keys each, which must then agree.
MODERNBERT_KEYS = {"layer_norm_eps": ("norm_eps",), "hidden_act": ("hidden_activation", "classifier_activation"),
                   "hidden_dropout_prob": ("embedding_dropout", "mlp_dropout"),
                   "attention_probs_dropout_prob": ("attention_dropout",)}
# ModernBertConfig's switches, with the one value our ModernBERT is built for (every published model's).
MODERNBERT_FIXED = {"attention_bias": False, "mlp_bias": False, "norm_bias": False, "classifier_bias": False,
                    "decoder_bias": True, "tie_word_embeddings": True}
MODERNBERT_LAYER_TYPES = {True: "full_attention", False: "sliding_attention"}  # transformers' name of a global layer


def model_config_from_hf(config_json: dict, source: str) -> ModelConfig:
    """Our ModelConfig from a parsed Hugging Face ``config.json`` of a BERT or a ModernBERT
    (``model_type`` bert or modernbert); unrelated keys are ignored."""
    model_type = config_json.get("model_type", "bert")
    if model_type == "modernbert":
        ours = modernbert_keys(config_json, source)
    elif model_type == "bert":
        pos_type = config_json.get("position_embedding_type", "absolute")
        if pos_type != "absolute":
            raise ConversionError(f"{source}: position_embedding_type={pos_type!r} is not supported "
                                  "(only 'absolute')")
        if config_json.get("is_decoder"):  # causal attention, which our encoder does not do
            raise ConversionError(f"{source}: is_decoder=true is not supported (only encoders)")
        ours = {k: v for k, v in config_json.items() if k not in LEFT_OUT["bert"]}  # a BERT config.json is BERT's
    else:
        raise ConversionError(f"{source}: model_type={model_type!r} is not supported (only 'bert' and 'modernbert')")
    hints = typing.get_type_hints(ModelConfig)
    values = {}
    for f in dataclasses.fields(ModelConfig):
        value = ours.get(f.name)
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
    if cfg.classifier_pooling not in typing.get_args(ClassifierPooling):
        raise ConversionError(f"{source}: classifier_pooling={cfg.classifier_pooling!r} is not supported "
                              f"(one of {', '.join(typing.get_args(ClassifierPooling))})")
    if cfg.hidden_size % cfg.num_attention_heads:
        raise ConversionError(f"{source}: hidden_size={cfg.hidden_size} is not divisible by "
                              f"num_attention_heads={cfg.num_attention_heads}")
    return cfg


def modernbert_keys(config_json: dict, source: str) -> dict:
    """A ModernBERT ``config.json``'s values under our field names (``family`` modernbert); what we do
    not model (biases where the published models have none, another pattern of layers, scaled
    rotary positions) is refused, naming the key."""
    for key, want in MODERNBERT_FIXED.items():
        if config_json.get(key, want) != want:
            raise ConversionError(f"{source}: {key}={json.dumps(config_json[key])} is not supported "
                                  f"(bertforge's ModernBERT has {key}={json.dumps(want)}, as the published models)")
    ours: dict = {"family": "modernbert"}
    for f in dataclasses.fields(ModelConfig):
        if f.name in LEFT_OUT["modernbert"] or f.name == "family":
            continue
        keys = [k for k in MODERNBERT_KEYS.get(f.name, (f.name,)) if config_json.get(k) is not None]
        if len({json.dumps(config_json[k]) for k in keys}) > 1:
            raise ConversionError(f"{source}: {' and '.join(f'{k}={config_json[k]}' for k in keys)} differ; "
                                  f"bertforge's ModernBERT has one value for both (model.{f.name})")
        if keys:
            ours[f.name] = config_json[keys[0]]
    # transformers 5 writes the layers' pattern as layer_types and the thetas under rope_parameters.
    layer_types = config_json.get("layer_types")
    if layer_types is not None and "global_attn_every_n_layers" not in config_json:
        full = [i for i, kind in enumerate(layer_types) if kind == MODERNBERT_LAYER_TYPES[True]]
        ours["global_attn_every_n_layers"] = full[1] if len(full) > 1 else max(len(layer_types), 1)
    every = ours.get("global_attn_every_n_layers", ModelConfig.global_attn_every_n_layers)
    if layer_types is not None and layer_types != [MODERNBERT_LAYER_TYPES[i % every == 0]
                                                   for i in range(len(layer_types))]:
        raise ConversionError(f"{source}: layer_types={layer_types} is not supported (bertforge's ModernBERT has a "
                              f"full_attention layer every global_attn_every_n_layers, from the first)")
    for kind, field in (("full_attention", "global_rope_theta"), ("sliding_attention", "local_rope_theta")):
        rope = (config_json.get("rope_parameters") or {}).get(kind)
        if rope is None:
            continue
        if rope.get("rope_type", "default") != "default":
            raise ConversionError(f"{source}: rope_parameters.{kind}.rope_type={rope['rope_type']!r} is not "
                                  f"supported (only 'default')")
        if rope.get("rope_theta") is not None:
            ours[field] = rope["rope_theta"]
    return ours


def hf_config_from_model_config(cfg: ModelConfig, architectures: list[str]) -> dict:
    """The ``config.json`` contents transformers needs to rebuild this model."""
    if cfg.family == "modernbert":  # ModernBertConfig's names; the layers' pattern and thetas as the published
        values = model_dict(cfg)  # config.json's, which transformers 4 and 5 both read
        values.pop("family")
        return {
            "architectures": list(architectures),
            "model_type": "modernbert",
            **{key: value for name, value in values.items() for key in MODERNBERT_KEYS.get(name, (name,))},
            **MODERNBERT_FIXED,
            # The tokenizer's ids (not the model's): unknown here, so none rather than ModernBertConfig's.
            "bos_token_id": None, "eos_token_id": None, "cls_token_id": None, "sep_token_id": None,
        }
    return {
        "architectures": list(architectures),
        "model_type": "bert",
        **model_dict(cfg),
        "position_embedding_type": "absolute",
        "tie_word_embeddings": True,  # our MLM decoder always shares the word embeddings
    }


# ---------------------------------------------------------------- Hugging Face: weights


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


# The tied MLM decoder's weight (dropped: our decoder is the embeddings) and the embeddings, per family.
TIED_DECODER = {"bert": ("cls.predictions.decoder.weight", "bert.embeddings.word_embeddings.weight"),
                "modernbert": ("decoder.weight", "model.embeddings.tok_embeddings.weight")}
# The first parts of a bare encoder's keys (transformers' BertModel, ModernBertModel), which its task
# models have under ENCODER_PREFIX.
ENCODER_KEYS = {"bert": ("embeddings.", "encoder.", "pooler."), "modernbert": ("embeddings.", "layers.", "final_norm.")}


def hf_to_ours(state: dict, head: str, family: Family = "bert") -> dict:
    """Rename Hugging Face keys of a ``family`` model to ours for ``head``; drop buffers and tied copies.

    Keys this model family does not know are passed through, so that load_hf
    can report them.
    """
    if head not in HEADS:
        raise ConversionError(f"unknown head {head!r} (one of {', '.join(HEADS)})")
    canon: dict[str, torch.Tensor] = {}  # keys in the task models' form ("bert." or "model." prefix)
    for key, value in state.items():
        if key.startswith(ENCODER_KEYS[family]):
            key = ENCODER_PREFIX[family] + key
        if ".LayerNorm.gamma" in key or ".LayerNorm.beta" in key:  # TF-era names
            key = key.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
        canon[key] = value
    for buffer in ("bert.embeddings.position_ids", "bert.embeddings.token_type_ids"):
        canon.pop(buffer, None)

    decoder, embeddings = TIED_DECODER[family]
    decoder_weight = canon.pop(decoder, None)
    words = canon.get(embeddings)
    if decoder_weight is not None and words is not None and not torch.equal(decoder_weight, words):
        # Our MLM head always projects with the word embeddings; an untied
        # decoder cannot be represented, and dropping it would change the model.
        raise ConversionError(f"{decoder} differs from {embeddings} (untied MLM decoder)")
    decoder_bias = canon.pop("cls.predictions.decoder.bias", None)
    if decoder_bias is not None and "cls.predictions.bias" not in canon:
        canon["cls.predictions.bias"] = decoder_bias

    if head == "encoder":  # our bare encoders' keys have no prefix
        return {k.removeprefix(ENCODER_PREFIX[family]): v for k, v in canon.items()}
    return canon


def _build(head: str, cfg: ModelConfig, state: dict[str, torch.Tensor], num_labels: int | None,
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


def load_hf(path: Path | str, head: str = "pretraining", allow_pickle: bool = False,
            num_labels: int | None = None) -> nn.Module:
    """Build our model for ``head`` from a Hugging Face directory and load its weights.

    head: "pretraining" (BertForPreTraining; BertForMaskedLM when it has no NSP head), "qa" (BertForQuestionAnswering),
    "classification" / "token_classification" (BertFor{Sequence,Token}Classification,
    ``num_labels`` outputs when the checkpoint has no classifier) or
    "encoder" (BertModel, with a pooler when the checkpoint has one).
    Head weights the checkpoint lacks (cls.*, qa_outputs.*, classifier.*, the pooler) keep
    their fresh initialisation and are named in a NewlyInitializedWarning;
    missing encoder weights, unknown weights and wrong shapes are errors.
    Weights are cast to the model's float32. The model is returned in eval mode.
    """
    path = Path(path)
    if head not in HEADS:
        raise ConversionError(f"unknown head {head!r} (one of {', '.join(HEADS)})")
    cfg = read_hf_config(path)
    state = hf_to_ours(load_hf_state_dict(path, allow_pickle), head, cfg.family)
    model = _build(head, cfg, state, num_labels, path, ConversionError)
    missing = assign_weights(model, state, path, error=ConversionError)
    if missing:
        warnings.warn(f"{path}: not in the checkpoint, newly initialised: "
                      f"{', '.join(missing)}", NewlyInitializedWarning, stacklevel=2)
    return model.eval()


# ---------------------------------------------------------------- Hugging Face: export


def _architecture(model: nn.Module) -> str:
    """The transformers class of ``model``: our models carry their names."""
    if head_of(model) is not None:
        return type(model).__name__
    raise ConversionError(f"cannot export {type(model).__name__}: expected one of "
                          f"{', '.join(sorted(HF_ARCHITECTURE_HEADS))}")


def hf_head_config(model: nn.Module, labels: list[str] | None = None) -> dict:
    """A classifier's ``config.json`` keys: its labels (``id2label``/``label2id``, so pipelines name
    them) and, with one output, ``problem_type: regression`` (transformers then takes an MSE loss)."""
    head = head_of(model)
    if head not in ("classification", "token_classification"):
        return {}
    num_labels = int(typing.cast(int, model.num_labels))
    names = list(labels) if labels is not None else [f"LABEL_{i}" for i in range(num_labels)]
    if len(names) != num_labels:
        raise ConversionError(f"{len(names)} label names for a classifier of {num_labels} outputs")
    extra: dict = {"id2label": {str(i): name for i, name in enumerate(names)},
                   "label2id": {name: i for i, name in enumerate(names)}}
    if head == "classification":
        extra["problem_type"] = "regression" if num_labels == 1 else "single_label_classification"
    return extra


def hf_labels(path: Path | str) -> list[str] | None:
    """The label names of a Hugging Face classifier directory (``id2label`` in order), or None."""
    try:
        config_json = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    id2label = config_json.get("id2label") if isinstance(config_json, dict) else None
    if not isinstance(id2label, dict):
        return None
    try:
        ordered = sorted((int(k), str(v)) for k, v in id2label.items())
    except ValueError:
        return None
    return [name for _, name in ordered] if [i for i, _ in ordered] == list(range(len(ordered))) else None


def check_export_target(out_dir: Path | str, overwrite: bool = False) -> None:
    """Refuse to export into an existing file or non-empty directory unless ``overwrite``, and
    even then when a live run writes in it, below it or above it."""
    out_dir = Path(out_dir)
    if not (out_dir.exists() or out_dir.is_symlink()):
        return
    if overwrite:
        refuse_live_runs(out_dir)
        return
    if out_dir.is_dir() and not out_dir.is_symlink() and not any(out_dir.iterdir()):
        return  # an empty directory holds nothing to lose
    raise ConversionError(f"{out_dir}: already exists and is not an empty directory; pass --overwrite "
                          "(overwrite=True in Python) to replace it")


def export_hf(model: nn.Module, out_dir: Path | str, vocab_path: Path | str | None = None,
              overwrite: bool = False, labels: list[str] | None = None) -> Path:
    """Write ``model`` as a Hugging Face directory: config.json, model.safetensors
    (and vocab.txt when ``vocab_path`` is given). A classifier's ``labels`` name its outputs.

    The files are written into a hidden sibling directory that is renamed to
    ``out_dir`` only when complete, so a crash never leaves a partial export
    under the final name. An existing ``out_dir`` that is not an empty
    directory is an error unless ``overwrite`` (then it is replaced as a whole).
    """
    model = getattr(model, "_orig_mod", model)  # torch.compile wrapper
    out_dir = Path(out_dir)
    check_export_target(out_dir, overwrite)
    architecture = _architecture(model)
    # Cloned, contiguous CPU tensors: safetensors refuses views and shared storage.
    state = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in model.state_dict().items()}
    config = {**hf_config_from_model_config(typing.cast(ModelConfig, model.config), [architecture]),
              **hf_head_config(model, labels)}
    # transformers reads the weights' dtype from here (it otherwise logs a notice and guesses).
    config["dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")

    with atomic_directory(out_dir) as tmp:
        save_file(state, tmp / SAFETENSORS, metadata={"format": "pt"})  # transformers checks "format"
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        if vocab_path is not None:
            shutil.copyfile(vocab_path, tmp / vocab_file_name(vocab_path))
    return out_dir


# ---------------------------------------------------------------- TensorFlow 1 (google-research/bert)

BERT_CONFIG = "bert_config.json"
TF1_PREFIX = "model.ckpt"  # what export_tf1 writes: OUT/model.ckpt.index, OUT/model.ckpt.data-00000-of-00001
GLOBAL_STEP = "global_step"
# The keys of google-research/bert's BertConfig, in its order.
BERT_CONFIG_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "hidden_act",
                    "intermediate_size", "hidden_dropout_prob", "attention_probs_dropout_prob",
                    "max_position_embeddings", "type_vocab_size", "initializer_range")
TF1_GELU = "gelu_new"  # modeling.py's gelu: 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))


def tf1_names(num_layers: int) -> dict[str, tuple[str, bool]]:
    """Our parameter name -> (TF1 variable name, whether the TF1 tensor is our tensor transposed)."""
    names: dict[str, tuple[str, bool]] = {}

    def dense(ours: str, theirs: str) -> None:
        names[f"{ours}.weight"] = (f"{theirs}/kernel", True)
        names[f"{ours}.bias"] = (f"{theirs}/bias", False)

    def layer_norm(ours: str, theirs: str) -> None:
        names[f"{ours}.weight"] = (f"{theirs}/gamma", False)
        names[f"{ours}.bias"] = (f"{theirs}/beta", False)

    for table in ("word_embeddings", "position_embeddings", "token_type_embeddings"):
        names[f"bert.embeddings.{table}.weight"] = (f"bert/embeddings/{table}", False)
    layer_norm("bert.embeddings.LayerNorm", "bert/embeddings/LayerNorm")
    for i in range(num_layers):
        ours, theirs = f"bert.encoder.layer.{i}", f"bert/encoder/layer_{i}"
        for projection in ("query", "key", "value"):
            dense(f"{ours}.attention.self.{projection}", f"{theirs}/attention/self/{projection}")
        dense(f"{ours}.attention.output.dense", f"{theirs}/attention/output/dense")
        layer_norm(f"{ours}.attention.output.LayerNorm", f"{theirs}/attention/output/LayerNorm")
        dense(f"{ours}.intermediate.dense", f"{theirs}/intermediate/dense")
        dense(f"{ours}.output.dense", f"{theirs}/output/dense")
        layer_norm(f"{ours}.output.LayerNorm", f"{theirs}/output/LayerNorm")
    dense("bert.pooler.dense", "bert/pooler/dense")
    dense("cls.predictions.transform.dense", "cls/predictions/transform/dense")
    layer_norm("cls.predictions.transform.LayerNorm", "cls/predictions/transform/LayerNorm")
    names["cls.predictions.bias"] = ("cls/predictions/output_bias", False)
    names["cls.seq_relationship.weight"] = ("cls/seq_relationship/output_weights", False)  # [2, hidden]
    names["cls.seq_relationship.bias"] = ("cls/seq_relationship/output_bias", False)
    names["qa_outputs.weight"] = ("cls/squad/output_weights", False)  # run_squad.py: [2, hidden]
    names["qa_outputs.bias"] = ("cls/squad/output_bias", False)
    return names


def _shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our weights' shapes for ``cfg``, from models built without memory."""
    with torch.device("meta"):
        models = (BertForPreTraining(cfg), BertForQuestionAnswering(cfg))
    return {k: tuple(v.shape) for model in models for k, v in model.state_dict().items()}


def _required(name: str, head: str) -> bool:
    """Whether a TF1 checkpoint loaded for ``head`` must hold our weight ``name``."""
    if name.startswith("qa_outputs."):
        return False  # a QA head starts new when there is none
    if name.startswith(("cls.seq_relationship.", "bert.pooler.")):
        return False  # a masked LM alone has no NSP head (train.objective mlm)
    if name.startswith("cls."):
        return head == "pretraining"
    return True


def find_bert_config(prefix: Path, given: Path | str | None = None) -> Path:
    """``given``, else ``bert_config.json`` beside the checkpoint, else in the directory above it
    (MLPerf's download keeps the checkpoint in ``tf1_ckpt/`` under the config)."""
    if given is not None:
        if not Path(given).is_file():
            raise CheckpointError(f"{given}: no such file (the bert_config.json of {prefix})")
        return Path(given)
    for directory in (prefix.parent, prefix.parent.parent):
        if (directory / BERT_CONFIG).is_file():
            return directory / BERT_CONFIG
    raise CheckpointError(f"{prefix}: no {BERT_CONFIG} beside the checkpoint (or above it); "
                          f"pass it with --bert-config")


def model_config_from_bert_config(path: Path) -> ModelConfig:
    """Our ModelConfig from google-research/bert's ``bert_config.json`` (its ``gelu`` is our ``gelu_new``)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: not a readable JSON file ({err})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        if key not in data:
            raise CheckpointError(f"{path}: has no {key}")
    if data.get("hidden_act", "gelu") == "gelu":
        data = {**data, "hidden_act": TF1_GELU}
    try:
        return model_config_from_hf(data, str(path))
    except ConversionError as err:
        raise CheckpointError(str(err)) from None


def bert_config_from_model_config(cfg: ModelConfig) -> dict:
    """google-research/bert's ``bert_config.json`` for our shape."""
    values = dataclasses.asdict(cfg)
    act = cfg.hidden_act
    if act == "gelu":  # exact erf gelu: modeling.py has only the tanh approximation
        logger.warning("hidden_act gelu (erf) has no google-research/bert equivalent; bert_config.json says "
                       "gelu, which TensorFlow computes with the tanh approximation (at most 5e-4 apart)")
    if cfg.layer_norm_eps != 1e-12:
        logger.warning("layer_norm_eps=%g: google-research/bert always uses 1e-12", cfg.layer_norm_eps)
    values["hidden_act"] = "gelu" if act in ("gelu", TF1_GELU) else act
    return {key: values[key] for key in BERT_CONFIG_KEYS}


def read_tf1(prefix: Path | str, bert_config: Path | str | None = None,
             head: str = "pretraining") -> tuple[ModelConfig, dict[str, torch.Tensor], list[str]]:
    """(model shape, weights in our names as float32, the variables skipped) of a TF1 checkpoint.

    Every variable of the checkpoint is accounted for before any tensor is
    read: a weight of this shape (its shape must be the config's, else a
    CheckpointError names it), an optimizer slot or ``global_step`` (skipped),
    a variable of another model outside ``bert/`` (skipped), or an error (a
    ``bert/`` variable this config has no place for). Weights ``head`` needs
    must all be there: the first missing one is named. The skipped names are
    returned and summarised in a log line.
    """
    if head not in HEADS:
        raise ConversionError(f"unknown head {head!r} (one of {', '.join(HEADS)})")
    prefix = Path(prefix)
    config_file = find_bert_config(prefix, bert_config)
    cfg = model_config_from_bert_config(config_file)
    reader = tf1.BundleReader(prefix)
    source = tf1.index_file(prefix)
    if "_CHECKPOINTABLE_OBJECT_GRAPH" in reader.entries and not any(n.startswith("bert/") for n in reader.entries):
        raise CheckpointError(f"{source}: a TensorFlow 2 object-based checkpoint, not a TF1 one; "
                              f"import it with `bertforge import tf2` (bertforge.formats.tf2)")
    ours = {theirs: (name, transposed) for name, (theirs, transposed) in tf1_names(cfg.num_hidden_layers).items()}
    shapes = _shapes(cfg)
    found, skipped = {}, []
    for theirs, entry in reader.entries.items():
        if theirs in ours:
            name, transposed = ours[theirs]
            want = shapes[name][::-1] if transposed else shapes[name]
            if entry.shape != want:
                raise CheckpointError(f"{source}: variable {theirs} has shape {list(entry.shape)} but "
                                      f"{config_file} asks for {list(want)}")
            found[theirs] = name
        elif theirs == GLOBAL_STEP or _slot(theirs, ours) or not theirs.startswith("bert/"):
            skipped.append(theirs)  # optimizer state, or weights of another model (a classifier)
        else:
            raise CheckpointError(f"{source}: variable {theirs} has no place in the BERT of {config_file} "
                                  f"(num_hidden_layers={cfg.num_hidden_layers})")
    for theirs, (name, _) in ours.items():
        if theirs not in found and _required(name, head):
            raise CheckpointError(f"{source}: variable {theirs} is missing")
    state = {}
    for theirs, name in found.items():
        tensor = reader.read(theirs)
        if not tensor.is_floating_point():
            raise CheckpointError(f"{source}: variable {theirs} is {tensor.dtype}, not floating point")
        tensor = tensor.float()
        state[name] = tensor.t().contiguous() if ours[theirs][1] else tensor
    if skipped:
        slots = sorted({_slot(s, ours) for s in skipped} - {""})
        others = [s for s in skipped if not _slot(s, ours)]
        logger.info("%s: skipped %d variables that are not weights of this model: %s", prefix, len(skipped),
                    "; ".join(filter(None, [f"optimizer slots {', '.join(slots)}" if slots else "",
                                            ", ".join(others[:10]) + (", …" if len(others) > 10 else "")])))
    return cfg, state, skipped


def _slot(name: str, weights: dict[str, tuple[str, bool]]) -> str:
    """The slot name when ``name`` lies under a weight's name (``…/kernel/adam_m``: ``adam_m``), else ""."""
    parts = name.split("/")
    for i in range(len(parts) - 1, 0, -1):
        if "/".join(parts[:i]) in weights:
            return "/".join(parts[i:])
    return ""


def import_tf1(prefix: Path | str, out_dir: Path | str, bert_config: Path | str | None = None,
               vocab_path: Path | str | None = None, overwrite: bool = False) -> tuple[Path, list[str]]:
    """Write a TF1 checkpoint as our model directory (``model.safetensors``, ``config.yaml``,
    ``vocab.txt`` when there is one, ``manifest.json``), which ``load_model`` reads; returns it
    and the variables skipped. The heads the checkpoint has come along (none is required)."""
    prefix, out_dir = Path(prefix), Path(out_dir)
    check_export_target(out_dir, overwrite)
    cfg, state, skipped = read_tf1(prefix, bert_config, head="encoder")
    model = BertForQuestionAnswering(cfg) if "qa_outputs.weight" in state and "cls.predictions.bias" not in state \
        else BertForPreTraining(cfg)
    _copy_weights(model, state, prefix)
    if vocab_path is None and (prefix.parent / "vocab.txt").is_file():
        vocab_path = prefix.parent / "vocab.txt"
    write_model_dir(model, cfg, out_dir, vocab_path)
    return out_dir, skipped


def import_hf(path: str | Path, out_dir: Path | str, overwrite: bool = False) -> Path:
    """Write a Hugging Face BERT or ModernBERT directory (or a model id in the local Hugging Face
    cache) as our model directory, with the head its ``config.json``'s architecture names and its
    ``vocab.txt`` or ``tokenizer.json``; returns the directory."""
    source, out_dir = find_model(path, ConversionError), Path(out_dir)
    if not is_hf_directory(source):
        raise ConversionError(f"{path}: not a Hugging Face model directory (no config.json)")
    check_export_target(out_dir, overwrite)
    model = load_hf(source, head=hf_head(source))
    write_model_dir(model, typing.cast(ModelConfig, model.config), out_dir, vocab_in(source))
    return out_dir


def write_model_dir(model: nn.Module, cfg: ModelConfig, out_dir: Path, vocab_path: Path | str | None) -> None:
    """An imported model as our model directory (weights, a config that validates, the vocab under
    its name, ``vocab.txt`` or ``tokenizer.json``, the manifest), written whole or not at all."""
    vocab_name = vocab_file_name(vocab_path) if vocab_path is not None else VOCAB_FILES[0]
    config = Config()
    use_model(config, cfg)
    config.data.seq_len = min(config.data.seq_len, cfg.max_position_embeddings)  # a config that validates
    config.data.max_predictions = min(config.data.max_predictions, config.data.seq_len)
    if vocab_path is not None:
        config.data.vocab = str((out_dir / vocab_name).resolve())
    validate(config)
    with atomic_directory(out_dir) as tmp:
        save_weights(model, tmp / SAFETENSORS)
        (tmp / "config.yaml").write_text(config.to_yaml(), encoding="utf-8")
        if vocab_path is not None:
            shutil.copyfile(vocab_path, tmp / vocab_name)
        write_manifest(tmp)


def _copy_weights(model: nn.Module, state: dict[str, torch.Tensor], source: Path) -> None:
    """Load ``state`` into ``model``; the heads ``model`` has must all be in it."""
    missing = assign_weights(model, state, source)
    if missing:
        raise CheckpointError(f"{source}: lacks {', '.join(missing)}")


def export_tf1(model: nn.Module, out_dir: Path | str, vocab_path: Path | str | None = None,
               overwrite: bool = False, global_step: int = 0) -> Path:
    """Write ``model`` as a TF1 checkpoint directory google-research/bert reads:
    ``model.ckpt.index``, ``model.ckpt.data-00000-of-00001`` (the weights under TF1 names and
    ``global_step``), the ``checkpoint`` state file, ``bert_config.json`` and ``vocab.txt``
    when given. Written atomically, like :func:`export_hf`."""
    model, cfg = tf_exportable(model, out_dir, overwrite, "TF1")
    names = tf1_names(cfg.num_hidden_layers)
    prefix = "bert." if isinstance(model, BertModel) else ""
    tensors: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        theirs, transposed = names[prefix + key]
        value = value.detach().to("cpu", torch.float32)
        tensors[theirs] = value.t().contiguous() if transposed else value.contiguous()
    tensors[GLOBAL_STEP] = torch.tensor(global_step, dtype=torch.int64)
    return write_tf_directory(out_dir, TF1_PREFIX, lambda prefix: tf1.write_bundle(prefix, tensors), cfg, vocab_path)


def tf_exportable(model: nn.Module, out_dir: Path | str, overwrite: bool, kind: str) -> tuple[nn.Module, ModelConfig]:
    """(the model, its shape) that an export to a ``kind`` (TF1, TF2) checkpoint writes, once the
    target directory and the architecture are checked: classifier heads go to Hugging Face only."""
    model = getattr(model, "_orig_mod", model)
    check_export_target(out_dir, overwrite)
    _architecture(model)
    cfg = model.config
    assert isinstance(cfg, ModelConfig)  # our models carry their shape
    if cfg.family != "bert":
        raise ConversionError(f"cannot export a model.family={cfg.family} model as a {kind} checkpoint "
                              "(BERT's format; it goes to Hugging Face: --format hf)")
    if head_of(model) in ("classification", "token_classification"):
        raise ConversionError(f"cannot export {type(model).__name__} as a {kind} checkpoint (classifier heads go "
                              "to Hugging Face only: --format hf)")
    return model, cfg


def write_tf_directory(out_dir: Path | str, prefix: str, write_bundle: Callable[[Path], None], cfg: ModelConfig,
                       vocab_path: Path | str | None) -> Path:
    """A TensorFlow checkpoint directory, atomically: the bundle ``write_bundle`` writes at
    ``OUT/prefix``, the ``checkpoint`` state file, ``bert_config.json`` and ``vocab.txt`` when given."""
    out_dir = Path(out_dir)
    with atomic_directory(out_dir) as tmp:
        write_bundle(tmp / prefix)
        tf1.write_state(tmp, prefix)
        bert_config = bert_config_from_model_config(cfg)
        (tmp / BERT_CONFIG).write_text(json.dumps(bert_config, indent=2) + "\n", encoding="utf-8")
        if vocab_path is not None:
            shutil.copyfile(vocab_path, tmp / "vocab.txt")
    return out_dir
