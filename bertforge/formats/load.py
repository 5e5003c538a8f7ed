"""A model, or its weights, from whatever a path holds: ours, a Hugging Face directory or a TF1 checkpoint.

:func:`load_model` builds a model from any of the three formats (or from a
Hugging Face model id in the local cache: :func:`bertforge.formats.hf.find_model`),
:func:`load_weights` loads one into a built model (``--init``), and
:func:`read_weights` gives the shape and tensors alone. Each format's reading
is its module's: :mod:`bertforge.formats.weights` (ours),
:mod:`bertforge.formats.hf`, :mod:`bertforge.formats.bert_tf1`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from bertforge.config import ModelConfig
from bertforge.models.bert import BertModel
from bertforge.models.families import ENCODER_PREFIX
from bertforge.models.modernbert import ModernBertModel
from bertforge.runs import WEIGHTS_FILES, CheckpointError, find_checkpoint, verify, vocab_in

from . import tf1
from .bert_tf1 import find_bert_config, model_config_from_bert_config, read_tf1
from .hf import (
    LOADED_FROM,
    find_model,
    hf_to_ours,
    is_hf_directory,
    load_hf,
    load_hf_state_dict,
    read_hf_config,
    safetensors_files,
)
from .weights import (
    HEADS,
    ConversionError,
    assign_weights,
    check_model_config,
    load_safetensors,
    model_for_head,
    read_config,
    weight_shapes,
)

logger = logging.getLogger(__name__)

def vocab_beside(model_path: str | Path, error: type[ValueError] = CheckpointError) -> Path | None:
    """The vocab beside a model's weights (``runs.VOCAB_FILES``: ``vocab.txt``, else ``tokenizer.json``):
    in the directory, a run's newest step or a TF1 prefix's directory (or the one above it, MLPerf's
    layout); None when it has none. ``error``: what a path that holds no model raises."""
    path = find_model(model_path, error)
    directories = [path]
    prefix = tf1.find_prefix(path)
    if prefix is not None:
        directories = [prefix.parent, prefix.parent.parent]
    elif not (path / "config.json").is_file() and not (path / "model.safetensors").is_file():
        try:
            directories.insert(0, find_checkpoint(path))
        except ValueError:
            pass
    return next((found for directory in directories if (found := vocab_in(directory)) is not None), None)


def read_weights(path: str | Path, bert_config: str | Path | None = None,
                 ) -> tuple[ModelConfig, dict[str, torch.Tensor], Path]:
    """(model shape, weights in our BertForPreTraining names, the directory or prefix read) of
    our checkpoint (run, step or model directory), a Hugging Face BERT directory, or a
    TensorFlow 1 checkpoint (a prefix such as ``ckpt/model.ckpt-28252``, or a directory with a
    ``checkpoint`` file; ``bert_config`` defaults to the ``bert_config.json`` beside it); or a
    Hugging Face model id (:func:`bertforge.formats.hf.find_model`)."""
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


def read_model_config(path: str | Path, bert_config: str | Path | None = None) -> ModelConfig:
    """The model config of the weights at ``path`` (as :func:`read_weights` reads them), without their
    tensors: a Hugging Face directory's ``config.json``, our checkpoint's ``config.yaml``, a TF1
    checkpoint's ``bert_config.json``."""
    path = find_model(path)
    prefix = tf1.find_prefix(path)
    if prefix is not None:
        return model_config_from_bert_config(find_bert_config(prefix, bert_config))
    if is_hf_directory(path):
        return read_hf_config(path)
    return read_config(find_checkpoint(path, weights_only=True)).model


def check_weights(path: str | Path) -> Path:
    """:func:`find_model`'s path, once the headers of its weights were read: a missing, truncated or
    edited weights file is named before a job spends minutes on its data (:func:`load_weights` reads
    the tensors later). A TF1 checkpoint is left to its reader."""
    path = find_model(path)
    if tf1.find_prefix(path) is not None:
        return path
    if is_hf_directory(path):
        read_hf_config(path)
        for file in safetensors_files(path):
            weight_shapes(file, ConversionError)
    else:
        read_config(find_checkpoint(path, weights_only=True))  # its config against its weights' header
    return path


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
    model = model_for_head(head, cfg, state, num_labels, checkpoint, CheckpointError)
    missing = assign_weights(model, state, checkpoint)
    if missing and head in ("pretraining", "encoder"):  # a task head is new when starting from an encoder
        raise CheckpointError(f"{checkpoint}: lacks {', '.join(missing)}")
    setattr(model, LOADED_FROM, checkpoint if prefix is None else prefix.parent)  # where export_hf finds its vocab
    return model.eval()
