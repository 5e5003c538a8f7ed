"""Hugging Face ``transformers``' BERT and ModernBERT, in and out; model ids in the local Hugging Face cache.

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

A model is named by its path or by a Hugging Face model id, which
:func:`find_model` downloads from the Hugging Face hub into the local Hugging
Face cache, or finds there offline; :mod:`bertforge.formats.load` reads a model
from any format.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import types
import typing
import warnings
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from bertforge.config import (
    LEFT_OUT,
    ClassifierPooling,
    Family,
    Head,
    ModelConfig,
    model_dict,
)
from bertforge.data.fast_tokenizer import prefixes_words, words_spec
from bertforge.data.vocab import load_vocab
from bertforge.fileio import atomic_directory
from bertforge.models.bert import ACTIVATIONS
from bertforge.models.families import ENCODER_PREFIX, MODELS, head_of
from bertforge.runs import CheckpointError, saved_data_settings, vocab_file_name, vocab_in

from . import tf1
from .weights import (
    HEADS,
    SAFETENSORS,
    ConversionError,
    assign_weights,
    check_export_target,
    load_safetensors,
    model_for_head,
    write_model_dir,
)

SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE = "pytorch_model.bin"
PICKLE_INDEX = "pytorch_model.bin.index.json"


# The attribute of a model that load_model / load_hf set to the directory read: where export_hf finds its vocab.
LOADED_FROM = "loaded_from"


class NewlyInitializedWarning(UserWarning):
    """Some head weights were not in the checkpoint and keep their fresh initialisation."""


# ---------------------------------------------------------------- where a model is: a path or a model id


# A Hugging Face model id: "bert-base-uncased" or "google/bert_uncased_L-4_H-256_A-4".
HF_MODEL_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
# What a BERT or ModernBERT needs from a Hub snapshot (not its TF, Flax or ONNX copies).
HF_MODEL_FILES = ["config.json", "vocab.txt", "tokenizer.json", "model.safetensors", "tokenizer_config.json",
                  SAFETENSORS_INDEX, "model-*-of-*.safetensors"]  # (a sharded upload's index and shards)


def resolve_model(path: str | Path) -> Path:
    """``path`` when it exists (or is a TF1 checkpoint prefix); else, when it reads as a Hugging
    Face model id, that model's snapshot directory in the local Hugging Face cache (``HF_HOME``,
    ``HF_HUB_CACHE``), downloaded from the hub first when the network is there (:func:`hub_snapshot`);
    anything else is returned as it is, for the caller's "not found" (:func:`find_model` says it)."""
    return _resolve(path)[0]


def _resolve(path: str | Path) -> tuple[Path, str]:
    """(:func:`resolve_model`'s path, and when it is not a model, why an id was not found: the end of
    :func:`find_model`'s message; "" when no hub was asked)."""
    local = Path(path).expanduser()
    if is_model(local) or not HF_MODEL_ID.match(str(path)):
        return local, ""
    from huggingface_hub import constants

    snapshot, why = hub_snapshot(str(path))
    return (snapshot, "") if snapshot is not None else (local, why or (
        f" (no such path, and no model {path} in the local Hugging Face cache {constants.HF_HUB_CACHE}: "
        f"`hf download {path}` puts it there)"))


# Downloads of this process, by (id, cache, hub): a run that looks a model up several times asks the hub once.
_SNAPSHOTS: dict[tuple[str, str, str], Path] = {}


def hub_snapshot(model_id: str) -> tuple[Path | None, str]:
    """(the snapshot directory of Hugging Face model ``model_id`` in the local cache, "") or (None, why).

    With the network there, the files a model is read from (``HF_MODEL_FILES``; never pickles)
    are downloaded from the hub (``HF_ENDPOINT``) into the cache with huggingface_hub's progress
    bar; an interrupted download resumes. Offline (``HF_HUB_OFFLINE=1``, or the hub unreachable)
    the cached snapshot is used; without one, why is "" (:func:`_resolve` says it is not cached).
    A hub that answers that it has no such model (or none we may read) gives its own why."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    key = (model_id, str(constants.HF_HUB_CACHE), constants.ENDPOINT)
    if key in _SNAPSHOTS and _SNAPSHOTS[key].is_dir():
        return _SNAPSHOTS[key], ""
    try:
        snapshot = Path(snapshot_download(model_id, allow_patterns=HF_MODEL_FILES))
    except (LocalEntryNotFoundError, ValueError):  # offline and not cached; or not a valid id after all
        return None, ""
    except (RepositoryNotFoundError, RevisionNotFoundError):  # (a gated or private one too)
        return None, (f" (no such path, no model {model_id} in the local Hugging Face cache {constants.HF_HUB_CACHE}, "
                      f"and none the Hugging Face hub {constants.ENDPOINT} lets us read)")
    except Exception as err:  # a download broken off: a new run resumes it
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return None, (f" (no such path; downloading it from the Hugging Face hub {constants.ENDPOINT} into "
                      f"{constants.HF_HUB_CACHE} failed: {type(err).__name__}: {first}; run again to resume)")
    _SNAPSHOTS[key] = snapshot
    return snapshot, ""


def is_model(path: Path) -> bool:
    """Whether ``path`` names something a model may be read from: a file or directory, or a TF1 prefix."""
    return path.exists() or tf1.find_prefix(path) is not None


def find_model(path: str | Path, error: type[ValueError] = CheckpointError) -> Path:
    """:func:`resolve_model`'s path, or ``error`` saying "model not found"; for what reads as a Hugging
    Face id, that neither the local Hugging Face cache nor the hub has it, and where the cache is."""
    found, why = _resolve(path)
    if is_model(found):
        return found
    raise error(f"model not found: {path}{why}")


# ---------------------------------------------------------------- config.json


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


# ModernBertConfig's keys for our fields where the names differ; hidden_act and hidden_dropout_prob
# are two of its keys each, which must then agree.
MODERNBERT_KEYS = {"layer_norm_eps": ("norm_eps",), "hidden_act": ("hidden_activation", "classifier_activation"),
                   "hidden_dropout_prob": ("embedding_dropout", "mlp_dropout"),
                   "attention_probs_dropout_prob": ("attention_dropout",)}
# ModernBertConfig's switches, with the one value our ModernBERT is built for (every published model's).
MODERNBERT_FIXED = {"attention_bias": False, "mlp_bias": False, "norm_bias": False, "classifier_bias": False,
                    "decoder_bias": True, "tie_word_embeddings": True, "is_encoder_decoder": False}
# BertConfig's switches we do not model: absolute positions, an encoder, the MLM decoder tied to the embeddings.
BERT_FIXED = {"position_embedding_type": "absolute", "is_decoder": False, "add_cross_attention": False,
              "is_encoder_decoder": False, "tie_word_embeddings": True}
MODERNBERT_LAYER_TYPES = {True: "full_attention", False: "sliding_attention"}  # transformers' name of a global layer

# What an import does with every key transformers' BertConfig and ModernBertConfig (5.24) read or write
# (tests/formats/test_hf_config_keys.py holds the lists to transformers' own):
# - modelled (HF_MODELLED_KEYS): read into ModelConfig and honoured by our model (a value we cannot honour
#   is refused in one line);
# - fixed (BERT_FIXED, MODERNBERT_FIXED): refused in one line when not the one value we model;
# - ignored (HF_IGNORED_KEYS): what does not change the model's outputs, with why.
# Any other key (an older transformers' or a tool's) is ignored, as transformers ignores what it does not read.
HF_MODELLED_KEYS = {
    "bert": {f.name for f in dataclasses.fields(ModelConfig) if f.name not in LEFT_OUT["bert"]}
    | {"classifier_dropout", "problem_type"},
    "modernbert": {key for f in dataclasses.fields(ModelConfig) if f.name not in (*LEFT_OUT["modernbert"], "family",
                                                                                  "rope_scaling_factor")
                   for key in MODERNBERT_KEYS.get(f.name, (f.name,))}
    | {"layer_types", "rope_parameters", "rope_scaling", "sliding_window", "problem_type"},
}
HF_IGNORED_KEYS = {
    "_name_or_path": "where transformers read it from", "transformers_version": "who wrote it",
    "model_type": "read first: which family", "architectures": "read by hf_head: which head",
    "id2label": "read by hf_labels: the label names", "label2id": "id2label reversed",
    "dtype": "the weights' own dtype is read, and they are cast to fp32",
    "output_attentions": "what forward returns, not what it computes", "output_hidden_states": "the same",
    "return_dict": "the same", "chunk_size_feed_forward": "the feed-forward in chunks: the same numbers",
    "bos_token_id": "the tokenizer's ids, which the model does not read", "eos_token_id": "the same",
    "cls_token_id": "the same", "sep_token_id": "the same",
    "use_cache": "a decoder's key/value cache (is_decoder is refused)",
    "sparse_prediction": "which positions reach the MLM head in training: the logits of those that do are the same",
    "sparse_pred_ignore_index": "the label of positions sparse_prediction leaves out",
    "deterministic_flash_attn": "whether flash-attn's backward is deterministic",
}


def model_config_from_hf(config_json: dict, source: str) -> ModelConfig:
    """Our ModelConfig from a parsed Hugging Face ``config.json`` of a BERT or a ModernBERT
    (``model_type`` bert or modernbert); unrelated keys are ignored."""
    model_type = config_json.get("model_type", "bert")
    if model_type == "modernbert":
        ours = modernbert_keys(config_json, source)
    elif model_type == "bert":
        refuse_unmodelled(config_json, BERT_FIXED, source)
        dropout = config_json.get("classifier_dropout")
        if dropout is not None and dropout != config_json.get("hidden_dropout_prob", ModelConfig.hidden_dropout_prob):
            raise ConversionError(f"{source}: classifier_dropout={dropout} is not supported (bertforge's BERT heads "
                                  "drop with hidden_dropout_prob; null or that value)")
        ours = {k: v for k, v in config_json.items() if k not in LEFT_OUT["bert"]}  # a BERT config.json is BERT's
    else:
        raise ConversionError(f"{source}: model_type={model_type!r} is not supported (only 'bert' and 'modernbert')")
    if config_json.get("problem_type") == "multi_label_classification":  # sigmoids, not our softmax
        raise ConversionError(f"{source}: problem_type='multi_label_classification' is not supported (bertforge's "
                              "classifiers are single-label, or regression with one output)")
    hints = typing.get_type_hints(ModelConfig)
    values = {}
    for f in dataclasses.fields(ModelConfig):
        value = ours.get(f.name)
        if value is None:  # absent, or null (e.g. pad_token_id): keep our default
            continue
        typ = hints[f.name]
        if typing.get_origin(typ) is types.UnionType:  # float | None: a value here is not None
            (typ,) = (arg for arg in typing.get_args(typ) if arg is not type(None))
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
    refuse_unmodelled(config_json, MODERNBERT_FIXED, source)
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
    # ModernBertConfig's sliding_window is half the window: transformers 5 sets local_attention = 2 * sliding_window,
    # over a local_attention also given.
    window = config_json.get("sliding_window")
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ConversionError(f"{source}: sliding_window={json.dumps(window)} is not supported (a positive "
                                  "integer: half the local layers' window, model.local_attention // 2)")
        ours["local_attention"] = 2 * window
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
    return {**ours, **modernbert_rope(config_json, source)}


def refuse_unmodelled(config_json: dict, fixed: dict, source: str) -> None:
    """Refuse, naming the key, a switch of ``fixed`` (BERT_FIXED, MODERNBERT_FIXED) that is not the one
    value we model."""
    model = "ModernBERT" if fixed is MODERNBERT_FIXED else "BERT"
    for key, want in fixed.items():
        if config_json.get(key, want) != want:
            raise ConversionError(f"{source}: {key}={json.dumps(config_json[key])} is not supported "
                                  f"(bertforge's {model} has {key}={json.dumps(want)}, as the published models)")


def modernbert_rope(config_json: dict, source: str) -> dict:
    """The rotary fields of a ModernBERT ``config.json``: the thetas of transformers 5's ``rope_parameters``
    (per kind of layer) and linear scaling, there (rope_type linear, its factor) or in ``rope_scaling``
    (the older key, for every layer); another rope type, or factors that differ, are refused."""
    ours: dict = {}
    factors: dict[str, float] = {}
    parameters = config_json.get("rope_parameters") or {}
    if not isinstance(parameters, dict) or set(parameters) - set(MODERNBERT_LAYER_TYPES.values()):
        raise ConversionError(f"{source}: rope_parameters={json.dumps(parameters)} is not supported (transformers 5's "
                              f"ModernBERT layout: one object for full_attention, one for sliding_attention)")
    for key, rope in [("rope_scaling", config_json.get("rope_scaling")),
                      *((f"rope_parameters.{kind}", parameters.get(kind)) for kind in MODERNBERT_LAYER_TYPES.values())]:
        if rope is None:
            continue
        kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else rope
        factor = rope.get("factor") if isinstance(rope, dict) else None
        if kind == "linear" and isinstance(factor, (int, float)) and not isinstance(factor, bool) and factor > 0:
            factors[key] = float(factor)
        elif kind == "default":
            factors[key] = 1.0
        else:
            raise ConversionError(f"{source}: {key}={json.dumps(rope)} is not supported (rope_type 'default', or "
                                  "'linear' with a positive factor)")
        if key != "rope_scaling" and rope.get("rope_theta") is not None:
            ours["global_rope_theta" if key.endswith("full_attention") else "local_rope_theta"] = rope["rope_theta"]
    if len(set(factors.values())) > 1:
        raise ConversionError(f"{source}: {', '.join(f'{k} factor {v}' for k, v in factors.items())} differ; "
                              "bertforge's ModernBERT scales every layer's positions alike (model.rope_scaling_factor)")
    if factors:
        ours["rope_scaling_factor"] = next(iter(factors.values()))
    return ours


def hf_config_from_model_config(cfg: ModelConfig, architectures: list[str]) -> dict:
    """The ``config.json`` contents transformers needs to rebuild this model."""
    if cfg.family == "modernbert":  # ModernBertConfig's names; the layers' pattern and thetas as the published
        values = model_dict(cfg)  # config.json's, which transformers 4 and 5 both read
        values.pop("family")
        factor = values.pop("rope_scaling_factor")
        scaling = {"rope_scaling": {"rope_type": "linear", "factor": factor}} if factor != 1.0 else {}
        return {
            "architectures": list(architectures),
            "model_type": "modernbert",
            **{key: value for name, value in values.items() for key in MODERNBERT_KEYS.get(name, (name,))},
            **MODERNBERT_FIXED,
            # The tokenizer's ids (not the model's): unknown here, so none rather than ModernBertConfig's.
            "bos_token_id": None, "eos_token_id": None, "cls_token_id": None, "sep_token_id": None,
            **scaling,
        }
    return {
        "architectures": list(architectures),
        "model_type": "bert",
        **model_dict(cfg),
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


def safetensors_files(path: Path) -> list[Path]:
    """The safetensors files of a Hugging Face directory: its model.safetensors, or the shards its
    index names; none when it has neither."""
    if (path / SAFETENSORS).is_file():
        return [path / SAFETENSORS]
    if (path / SAFETENSORS_INDEX).is_file():
        return _read_index(path / SAFETENSORS_INDEX)
    return []


def load_hf_state_dict(path: Path, allow_pickle: bool = False) -> dict[str, torch.Tensor]:
    """All tensors of a Hugging Face directory, by their names in the files, on the CPU."""
    path = Path(path)
    if not path.is_dir():
        raise ConversionError(f"{path}: no such directory")
    files = safetensors_files(path)
    if files:
        state: dict[str, torch.Tensor] = {}
        for file in files:
            state.update(load_safetensors(file, ConversionError))
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
    model = model_for_head(head, cfg, state, num_labels, path, ConversionError)
    missing = assign_weights(model, state, path, error=ConversionError)
    if missing:
        warnings.warn(f"{path}: not in the checkpoint, newly initialised: "
                      f"{', '.join(missing)}", NewlyInitializedWarning, stacklevel=2)
    setattr(model, LOADED_FROM, path)
    return model.eval()


# ---------------------------------------------------------------- export and import


def hf_architecture(model: nn.Module) -> str:
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


# transformers' names of the special tokens, by our roles (SpecialIds' fields).
HF_SPECIAL_TOKENS = {"cls": "cls_token", "sep": "sep_token", "pad": "pad_token", "unk": "unk_token",
                     "mask": "mask_token"}
# What ModernBERT's forward takes (no token types); a tokenizer that returned token_type_ids would break pipelines.
HF_MODEL_INPUTS = {"modernbert": ["input_ids", "attention_mask"]}


def hf_tokenizer_files(vocab_path: Path | str, cfg: ModelConfig, lowercase: bool) -> dict[str, dict]:
    """``tokenizer_config.json`` (:func:`hf_tokenizer_config`) and ``special_tokens_map.json`` of an export."""
    config = hf_tokenizer_config(vocab_path, cfg, lowercase)
    return {"tokenizer_config.json": config,
            "special_tokens_map.json": {name: config[name] for name in HF_SPECIAL_TOKENS.values() if name in config}}


def hf_tokenizer_config(vocab_path: Path | str, cfg: ModelConfig, lowercase: bool) -> dict:
    """The ``tokenizer_config.json`` that makes ``AutoTokenizer`` read an export's vocab as we do: a vocab.txt
    as ``BertTokenizer`` (``do_lower_case`` as the model was trained), a tokenizer.json as
    ``PreTrainedTokenizerFast``; the special tokens named, ``model_max_length`` the model's positions.
    A vocab larger than the model, or without [CLS], [SEP] or [MASK], is refused."""
    vocab = load_vocab(vocab_path)
    if vocab.size > cfg.vocab_size:
        raise ConversionError(f"{vocab_path}: {vocab.size} tokens, more than the model's "
                              f"vocab_size={cfg.vocab_size}: give the vocab the model was trained with")
    roles = vocab.special_ids(" (transformers' tokenizer must name them)")
    special = {name: vocab.tokens[token_id] for role, name in HF_SPECIAL_TOKENS.items()
               if (token_id := getattr(roles, role)) is not None}
    config: dict = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.max_position_embeddings,
                    **special}
    if vocab.tokenizer is None:  # BertTokenizer's normalizer is ours: strip accents when lowercasing
        config.update(tokenizer_class="BertTokenizer", do_lower_case=lowercase, tokenize_chinese_chars=True,
                      strip_accents=None)
    if cfg.family in HF_MODEL_INPUTS:
        config["model_input_names"] = HF_MODEL_INPUTS[cfg.family]
    return config


def saved_lowercase(directory: Path) -> bool:
    """Whether the model at ``directory`` was trained on lowercased text: a Hugging Face directory's
    ``tokenizer_config.json`` says (``do_lower_case``), ours its ``config.yaml`` (``data.lowercase``);
    True (BERT uncased) where neither does."""
    tokenizer_config = directory / "tokenizer_config.json"
    if is_hf_directory(directory) and tokenizer_config.is_file():
        try:
            return bool(json.loads(tokenizer_config.read_text(encoding="utf-8")).get("do_lower_case", True))
        except (OSError, ValueError, AttributeError):  # unreadable: the default, as transformers' BertTokenizer
            return True
    return saved_data_settings(directory)[0]


def export_hf(model: nn.Module, out_dir: Path | str, vocab_path: Path | str | None = None,
              overwrite: bool = False, labels: list[str] | None = None, lowercase: bool | None = None,
              without_tokenizer: bool = False) -> Path:
    """Write ``model`` as a Hugging Face directory that transformers' ``from_pretrained``, ``AutoTokenizer``
    and ``pipeline`` use as it is: config.json, model.safetensors, the vocab (vocab.txt or tokenizer.json),
    tokenizer_config.json and special_tokens_map.json. A classifier's ``labels`` name its outputs.

    ``vocab_path`` defaults to the vocab beside the checkpoint the model was loaded from
    (``load_model`` records it), ``lowercase`` to how that checkpoint was trained; a model with
    no vocab is refused (``AutoTokenizer`` would build a tokenizer of 5 tokens), unless
    ``without_tokenizer`` (the weights alone, for ``from_pretrained``).

    The files are written into a hidden sibling directory that is renamed to
    ``out_dir`` only when complete, so a crash never leaves a partial export
    under the final name. An existing ``out_dir`` that is not an empty
    directory is an error unless ``overwrite`` (then it is replaced as a whole).
    """
    model = getattr(model, "_orig_mod", model)  # torch.compile wrapper
    out_dir = Path(out_dir)
    check_export_target(out_dir, overwrite)
    cfg = typing.cast(ModelConfig, model.config)
    config = {**hf_config_from_model_config(cfg, [hf_architecture(model)]), **hf_head_config(model, labels)}
    source = getattr(model, LOADED_FROM, None)
    vocab = None if without_tokenizer else vocab_path or (vocab_in(source) if source is not None else None)
    if vocab is None and not without_tokenizer:
        where = f"none in {source}" if source is not None else "the model was not loaded from a checkpoint"
        raise ConversionError(f"{out_dir}: no vocab to export with the model ({where}): give the vocab it was "
                              "trained with (vocab_path=, or --vocab of `bertforge export`), or export the weights "
                              "alone (without_tokenizer=True, --without-tokenizer)")
    files = {} if vocab is None else hf_tokenizer_files(vocab, cfg, lowercase if lowercase is not None else
                                                         saved_lowercase(source) if source is not None else True)
    words = None if vocab is None else ner_tokenizer_spec(model, vocab)
    if words is not None:  # said where transformers' tokenizer reads its settings (it takes the pipeline's)
        files["tokenizer_config.json"]["add_prefix_space"] = True
    # Cloned, contiguous CPU tensors: safetensors refuses views and shared storage.
    state = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in model.state_dict().items()}
    # transformers reads the weights' dtype from here (it otherwise logs a notice and guesses).
    files["config.json"] = {**config, "dtype": str(next(iter(state.values())).dtype).removeprefix("torch.")}

    with atomic_directory(out_dir) as tmp:
        save_file(state, tmp / SAFETENSORS, metadata={"format": "pt"})  # transformers checks "format"
        for name, content in files.items():
            (tmp / name).write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
        if vocab is not None and words is not None:
            (tmp / vocab_file_name(vocab)).write_text(json.dumps(words, ensure_ascii=False), encoding="utf-8")
        elif vocab is not None:
            shutil.copyfile(vocab, tmp / vocab_file_name(vocab))
    return out_dir


def ner_tokenizer_spec(model: nn.Module, vocab: Path | str) -> dict | None:
    """The ``tokenizer.json`` of a NER export whose byte-level BPE adds no space before a text: its
    pre-tokenizer then does (``words_spec``), as our NER encodes every word (``Ġword``, the first
    too), so that ``pipeline("token-classification")`` on a sentence as typed sees the ids we
    trained on and labels its words as we do; None where the vocab is copied as it is."""
    if head_of(model) != "token_classification":
        return None
    spec = load_vocab(vocab).spec
    return words_spec(spec) if spec is not None and prefixes_words(spec) else None


def import_hf(path: str | Path, out_dir: Path | str, overwrite: bool = False) -> Path:
    """Write a Hugging Face BERT or ModernBERT directory (or a model id in the local Hugging Face
    cache) as our model directory, with the head its ``config.json``'s architecture names, its
    ``vocab.txt`` or ``tokenizer.json`` and its ``do_lower_case``; returns the directory."""
    source, out_dir = find_model(path, ConversionError), Path(out_dir)
    if not is_hf_directory(source):
        raise ConversionError(f"{path}: not a Hugging Face model directory (no config.json)")
    check_export_target(out_dir, overwrite)
    model = load_hf(source, head=hf_head(source))
    write_model_dir(model, typing.cast(ModelConfig, model.config), out_dir, vocab_in(source), saved_lowercase(source))
    return out_dir
