"""The model families (``model.family``): which model a config builds.

BERT lives in models/bert.py, ModernBERT in models/modernbert.py; the jobs ask here for the
model of a config and head rather than naming a class.
"""

from __future__ import annotations

from torch import nn

from bertforge.config import ConfigError, Family, Head, ModelConfig, Objective

from .bert import (
    BertForMaskedLM,
    BertForPreTraining,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertModel,
)
from .modernbert import (
    ModernBertForMaskedLM,
    ModernBertForQuestionAnswering,
    ModernBertForSequenceClassification,
    ModernBertForTokenClassification,
    ModernBertModel,
)

# Each family's model for each head (``load_model``'s names): their parameter names are those of the
# transformers class of the same name. BERT's "pretraining" is BertForMaskedLM when there is no NSP head.
MODELS: dict[Family, dict[Head, type[nn.Module]]] = {
    "bert": {"pretraining": BertForPreTraining, "qa": BertForQuestionAnswering,
             "classification": BertForSequenceClassification,
             "token_classification": BertForTokenClassification, "encoder": BertModel},
    "modernbert": {"pretraining": ModernBertForMaskedLM, "qa": ModernBertForQuestionAnswering,
                   "classification": ModernBertForSequenceClassification,
                   "token_classification": ModernBertForTokenClassification, "encoder": ModernBertModel},
}
# The prefix of the encoder's weights in the task models (what a bare encoder's names lack).
ENCODER_PREFIX: dict[Family, str] = {"bert": "bert.", "modernbert": "model."}
# The weights of a task's head, per family: absent from a source made for another task, they start new.
HEAD_PREFIXES: dict[Family, tuple[str, ...]] = {
    "bert": ("cls.", "qa_outputs.", "classifier.", "bert.pooler.", "pooler."),
    "modernbert": ("head.", "decoder.", "classifier."),
}


def model_class(cfg: ModelConfig, head: Head) -> type[nn.Module]:
    """The class of ``cfg``'s family that has ``head``."""
    return MODELS[cfg.family][head]


def head_of(model: nn.Module) -> Head | None:
    """The head of one of our models (BertForMaskedLM's is ``pretraining``); None for another module."""
    return next((head for models in MODELS.values() for head, cls in models.items() if isinstance(model, cls)), None)


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
