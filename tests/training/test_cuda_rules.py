"""Every path that runs eager on CUDA keeps CUDA's dtype rules, checked on the CPU (dtype_rules.py).

The first GPU run crashed with ``--execution.compile false`` in bf16 (LayerNorm's bf16 input with
fp32 weights); compiled, Inductor had hidden it. These run each eager path under bf16 autocast:
a training step (unpadded, padded and packed rows, recomputation), evaluation, fine-tuning
prediction and pipeline stages.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from dtype_rules import CudaDtypeRules
from test_packing import synthetic

from bertforge.config import ModelConfig, TrainConfig
from bertforge.data import PretrainingDataset
from bertforge.data.packing import pack_arrays
from bertforge.models.bert import (
    BertForMaskedLM,
    BertForPreTraining,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
)
from bertforge.parallel.dist import apply_recompute
from bertforge.tasks.finetune.run import forward_in_batches
from bertforge.training.engine import Engine, autocast
from bertforge.training.optim import build_optimizer, build_scheduler
from bertforge.training.pipeline import BertStage
from bertforge.training.pretrain import evaluate, forward_loss, training_loss

CPU = torch.device("cpu")
TINY = ModelConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                   intermediate_size=64, max_position_embeddings=64)


def rows(packed: bool) -> PretrainingDataset:
    arrays = synthetic(24, 64, 8, TINY.vocab_size, seed=3)  # varied lengths: padded rows
    return PretrainingDataset(pack_arrays(arrays, 3) if packed else arrays)


def unpadded() -> dict[str, torch.Tensor]:
    batch = rows(packed=False).batch(np.arange(8))
    batch["input_ids"][:, :] = 5  # every token real: the batch carries no mask
    del batch["attention_mask"]
    return batch


BATCHES = {"unpadded": unpadded, "padded": lambda: rows(False).batch(np.arange(8)),
           "packed": lambda: rows(True).batch(np.arange(8))}


def checked(run) -> CudaDtypeRules:
    with CudaDtypeRules() as rules:
        run()
    assert rules.violations == []
    assert rules.layer_norms() > 0  # the rule that broke was in reach
    return rules


@pytest.mark.parametrize("recompute", ["none", "layer", "attention"])
@pytest.mark.parametrize("kind", BATCHES)
def test_an_eager_bf16_training_step_keeps_cudas_dtype_rules(kind, recompute):
    torch.manual_seed(0)
    model = BertForPreTraining(TINY)
    apply_recompute(model, recompute)
    train = TrainConfig(lr=1e-3, schedule="constant")
    optimizer = build_optimizer(model, train)
    engine = Engine(model, optimizer, build_scheduler(optimizer, train, 4), training_loss, "bf16", 1.0, seed=1)
    batch = BATCHES[kind]()
    rules = checked(lambda: engine.step([batch, batch], 2))
    assert rules.checked["aten.native_layer_norm_backward.default"] > 0  # the backward ran under the check


def test_bf16_evaluation_keeps_cudas_dtype_rules():
    model = BertForMaskedLM(TINY)
    for packed in (False, True):
        checked(lambda packed=packed: evaluate(model, rows(packed), 8, CPU, "bf16"))


@pytest.mark.parametrize("head", [BertForQuestionAnswering, BertForSequenceClassification,
                                  BertForTokenClassification])
def test_bf16_fine_tuning_prediction_keeps_cudas_dtype_rules(head):
    model = head(TINY) if head is BertForQuestionAnswering else head(TINY, 3)
    arrays = rows(packed=False).arrays
    features = types.SimpleNamespace(**{name: getattr(arrays, name).astype(np.int32)  # as features hold them
                                         for name in ("input_ids", "segment_ids", "input_mask")})
    checked(lambda: list(forward_in_batches(model, features, 8, CPU, "bf16")))


def test_bf16_pipeline_stages_keep_cudas_dtype_rules():
    """Both stages of a two-stage split, in one process: the modules and forward the ranks run."""
    torch.manual_seed(0)
    model = BertForPreTraining(TINY)
    first, last = BertStage(model, 0, 2), BertStage(model, 1, 2)
    for stage in (first, last):
        stage.precision = "bf16"
    batch = rows(packed=True).batch(np.arange(4))
    fields = {k: v.long() if v.dtype == torch.int32 else v for k, v in batch.items()}

    def run() -> None:
        hidden, rng = first(fields["input_ids"], token_type_ids=fields["token_type_ids"],
                            position_ids=fields["position_ids"], sequence_ids=fields["sequence_ids"])
        mlm_logits, nsp_logits = last(hidden, rng, sequence_ids=fields["sequence_ids"],
                                      masked_lm_positions=fields["masked_lm_positions"],
                                      cls_positions=fields["cls_positions"])
        (mlm_logits.float().sum() + nsp_logits.float().sum()).backward()

    checked(run)


def test_the_rules_catch_the_layer_norm_that_crashed_on_cuda():
    """The check itself: LayerNorm on a bf16 input with fp32 weights (what 3397f00 ran) is named."""
    norm = torch.nn.LayerNorm(8)
    with CudaDtypeRules() as rules:
        torch.nn.functional.layer_norm(torch.randn(2, 8).bfloat16(), (8,), norm.weight, norm.bias)
    assert rules.violations == ["aten.native_layer_norm.default: ['torch.bfloat16', 'torch.float32']"]
    model = BertForPreTraining(TINY).eval()
    with CudaDtypeRules() as rules, autocast(CPU, "bf16"):
        forward_loss(model, unpadded())
    assert rules.violations == []
