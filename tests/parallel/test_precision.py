"""CUDA's precision settings as the code would apply them, checked on the CPU (issue 39.3, 39.6): TF32 for fp32
matmuls unless execution.tf32 is false, and execution.fp8's refusals and choice of layers (without torchao)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bertforge.cli import main
from bertforge.config import MODEL_PRESETS, ConfigError, ExecutionConfig, ModelConfig
from bertforge.models.bert import BertForPreTraining, BertForSequenceClassification
from bertforge.models.modernbert import ModernBertForMaskedLM
from bertforge.parallel.dist import (
    DistContext,
    check_fp8,
    fp8_layers,
    fp32_matmul_precision,
    prepare_model,
    use_fp32_matmul_precision,
)

CUDA = torch.device("cuda")


@pytest.fixture
def matmul_precision():
    """CUDA's fp32 matmul setting, as it was after the test."""
    before = use_fp32_matmul_precision(None)
    yield
    use_fp32_matmul_precision(before)


def test_fp32_matmuls_on_cuda_run_tf32_unless_exact_fp32_is_asked(matmul_precision):
    assert fp32_matmul_precision(ExecutionConfig(), CUDA) == "tf32"
    assert fp32_matmul_precision(ExecutionConfig(tf32=False), CUDA) == "ieee"
    assert fp32_matmul_precision(ExecutionConfig(), torch.device("cpu")) is None
    torch.backends.cuda.matmul.fp32_precision = "none"
    assert use_fp32_matmul_precision("tf32") == "none"
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    assert use_fp32_matmul_precision("ieee") == "tf32"
    assert torch.backends.cuda.matmul.fp32_precision == "ieee"
    # The model's device decides: on the CPU prepare_model leaves torch's setting as it was.
    prepare_model(BertForPreTraining(ModelConfig(**MODEL_PRESETS["tiny"])), ExecutionConfig(), DistContext())
    assert torch.backends.cuda.matmul.fp32_precision == "ieee"


def layer_names(layers: int, *suffixes: str) -> list[str]:
    return [f"bert.encoder.layer.{i}.{suffix}" for i in range(layers) for suffix in suffixes]


BERT_LINEARS = ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
                "intermediate.dense", "output.dense")


def test_fp8_converts_the_encoder_layers_linear_layers_only():
    """Every linear layer of every encoder layer (BERT's six, ModernBERT's three); not the embeddings, the
    pooler, the masked-LM transform and projection or a classifier; none whose dimensions are not
    multiples of 16."""
    tiny = ModelConfig(**MODEL_PRESETS["tiny"])  # hidden 128, intermediate 512
    model = BertForPreTraining(tiny)
    assert fp8_layers(model) == layer_names(2, *BERT_LINEARS)
    linears = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    assert set(linears) - set(fp8_layers(model)) == {"bert.pooler.dense", "cls.predictions.transform.dense",
                                                     "cls.seq_relationship"}
    classifier = BertForSequenceClassification(tiny, num_labels=3)
    assert fp8_layers(classifier) == layer_names(2, *BERT_LINEARS)
    # hidden 72 (not a multiple of 16): every linear layer reads or writes 72 features, none is converted;
    # hidden 64 with intermediate 200: the attention's four are, the feed-forward's two are not.
    assert fp8_layers(BertForPreTraining(dataclasses.replace(tiny, hidden_size=72, intermediate_size=144))) == []
    odd_ffn = BertForPreTraining(dataclasses.replace(tiny, hidden_size=64, intermediate_size=200))
    assert fp8_layers(odd_ffn) == layer_names(2, *BERT_LINEARS[:4])
    modern = ModernBertForMaskedLM(ModelConfig(**MODEL_PRESETS["modernbert-tiny"]))
    assert fp8_layers(modern) == [f"model.layers.{i}.{name}" for i in range(4)
                                  for name in ("attn.Wqkv", "attn.Wo", "mlp.Wi", "mlp.Wo")]


@pytest.mark.parametrize("execution, device, capability, message", [
    (ExecutionConfig(fp8=True, precision="fp32"), CUDA, (9, 0),
     "execution.fp8=true runs under execution.precision=bf16, not fp32"),
    (ExecutionConfig(fp8=True, precision="bf16"), torch.device("cpu"), None,
     "execution.fp8=true needs a GPU with FP8 tensor cores (compute capability 8.9 or later: Ada, Hopper), "
     "not a CPU; use execution.fp8 false"),
    (ExecutionConfig(fp8=True, precision="bf16"), CUDA, (8, 0),
     "execution.fp8=true needs a GPU with FP8 tensor cores (compute capability 8.9 or later: Ada, Hopper), "
     "not compute capability 8.0; use execution.fp8 false"),
    (ExecutionConfig(fp8=True, precision="bf16"), CUDA, (9, 0),
     "execution.fp8=true needs torchao (pip install torchao), which is not installed"),
])
def test_fp8_is_refused_in_one_line_where_it_cannot_run(monkeypatch, execution, device, capability, message):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _device=None: capability)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *args: None if name == "torchao" else object())
    with pytest.raises(ConfigError) as refused:
        check_fp8(execution, device)
    assert str(refused.value) == message


def test_fp8_on_the_cpu_is_refused_by_the_command(capsys):
    assert main(["bench", "pretrain", "--config", "tiny", "--execution.device", "cpu", "--execution.precision",
                 "bf16", "--execution.fp8", "true", "--batch-size", "2", "--seq-len", "16", "--max-predictions", "2",
                 "--steps", "1", "--warmup", "0"]) == 2
    assert capsys.readouterr().err == (
        "error: execution.fp8=true needs a GPU with FP8 tensor cores (compute capability 8.9 or later: Ada, "
        "Hopper), not a CPU; use execution.fp8 false\n")
