"""The model families (``model.family``): which model a config builds.

BERT lives in model.py, ModernBERT in modernbert.py; the jobs ask here for the
model of a config rather than naming a class.
"""

from __future__ import annotations

from torch import nn

from .config import ConfigError, ModelConfig, Objective
from .model import BertForMaskedLM, BertForPreTraining
from .modernbert import ModernBertForMaskedLM


def build_pretraining_model(cfg: ModelConfig, objective: Objective) -> nn.Module:
    """The model ``bertforge pretrain`` trains, with fresh weights: BERT with its next-sentence head
    (``mlm_nsp``) or without (``mlm``), or ModernBERT's masked LM (config.validate allows it ``mlm``
    only). Each returns ``(mlm_logits, nsp_logits or None)`` from the same arguments."""
    if cfg.pad_token_id >= cfg.vocab_size:  # the data's vocab may be smaller than the config's
        raise ConfigError(f"model.pad_token_id={cfg.pad_token_id} is not below model.vocab_size={cfg.vocab_size} "
                          f"(the vocab's size): set model.pad_token_id to the vocab's [PAD] id")
    if cfg.family == "modernbert":
        return ModernBertForMaskedLM(cfg)
    return (BertForMaskedLM if objective == "mlm" else BertForPreTraining)(cfg)
