"""bertforge: BERT pre-training and fine-tuning in PyTorch, on CPUs and GPUs.

The public API is small:

    import bertforge
    model = bertforge.load_model("runs/NAME", head="pretraining")   # or a Hugging Face BERT dir
    bertforge.export_hf(model, "exported/")                          # transformers can load it
    cfg = bertforge.load_config("pretrain_base_128", [("train.lr", 1e-4)])
    bertforge.pretrain(cfg)

Everything else is reached through the ``bertforge`` command.
"""

from .checkpoint import load_model
from .config import (CheckpointConfig, Config, DataConfig, ExecutionConfig, LogConfig, ModelConfig,
                     TrainConfig, load_config)
from .convert import export_hf
from .model import BertForPreTraining, BertForQuestionAnswering, BertModel
from .train import pretrain

__version__ = "0.1.0"

__all__ = [
    "BertForPreTraining", "BertForQuestionAnswering", "BertModel", "CheckpointConfig", "Config",
    "DataConfig", "ExecutionConfig", "LogConfig", "ModelConfig", "TrainConfig", "export_hf",
    "load_config", "load_model", "pretrain",
]
