"""google-research/bert's TensorFlow 1 checkpoints: the name map, ``bert_config.json``, import and export.

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
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from bertforge.config import ModelConfig
from bertforge.fileio import atomic_directory
from bertforge.models.bert import BertForPreTraining, BertForQuestionAnswering, BertModel
from bertforge.models.families import head_of
from bertforge.runs import CheckpointError

from . import tf1
from .hf import hf_architecture, model_config_from_hf
from .weights import HEADS, ConversionError, assign_weights, check_export_target, write_model_dir

logger = logging.getLogger(__name__)

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
    when given. Written atomically, like :func:`bertforge.formats.hf.export_hf`."""
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
    hf_architecture(model)
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
