"""bertforge: BERT pre-training and fine-tuning in PyTorch, on CPUs and GPUs.

The public API is small:

    import bertforge
    model = bertforge.load_model("runs/NAME", head="pretraining")   # or a Hugging Face BERT dir
    bertforge.export_hf(model, "exported/")                          # transformers can load it
    cfg = bertforge.load_config("pretrain_base_128", [("train.lr", 1e-4)])
    bertforge.pretrain(cfg)

Everything else is reached through the ``bertforge`` command.

Names that need torch are imported on first use, so that ``import bertforge``
(and the data commands, which never need torch) stays fast and small.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .config import (
    CheckpointConfig,
    Config,
    DataConfig,
    ExecutionConfig,
    LogConfig,
    ModelConfig,
    TrainConfig,
    load_config,
)
from .version import __version__ as __version__  # re-exported

if TYPE_CHECKING:
    from bertforge.formats.hf import export_hf
    from bertforge.formats.load import load_model
    from bertforge.models.bert import BertForMaskedLM, BertForPreTraining, BertForQuestionAnswering, BertModel
    from bertforge.training.pretrain import pretrain


_LAZY = {  # name -> the module that defines it (each imports torch)
    "load_model": "formats.load", "export_hf": "formats.hf", "pretrain": "training.pretrain",
    "BertForPreTraining": "models.bert", "BertForMaskedLM": "models.bert", "BertForQuestionAnswering": "models.bert",
    "BertModel": "models.bert",
}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "BertForMaskedLM", "BertForPreTraining", "BertForQuestionAnswering", "BertModel", "CheckpointConfig", "Config",
    "DataConfig", "ExecutionConfig", "LogConfig", "ModelConfig", "TrainConfig", "export_hf",
    "load_config", "load_model", "pretrain",
]
