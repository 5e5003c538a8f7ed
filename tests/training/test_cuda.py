"""On a CUDA device: the attention kernels' gradients against math, dropout in training, an engine
step without a host sync (eager and compiled), bf16 and fp16 training against fp32, and pipeline
stages in eager bf16.

These run where a GPU is (``pytest -m cuda``; ``benchmarks/gpu.sh`` runs them first) and skip
elsewhere. Their CPU counterparts: test_cuda_rules.py (dtype rules), test_host_syncs.py (syncs
per step), test_flex_attention.py (block masks against math).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from test_packing import synthetic

from bertforge.config import ModelConfig, TrainConfig
from bertforge.data import PretrainingDataset
from bertforge.data.packing import pack_arrays
from bertforge.models.bert import BertForPreTraining, set_attention_backends, set_vocab_multiple
from bertforge.parallel.dist import DistContext, use_fp32_matmul_precision
from bertforge.training.engine import Engine
from bertforge.training.optim import build_optimizer, build_scheduler
from bertforge.training.pipeline import BertStage
from bertforge.training.pretrain import forward_loss, training_loss

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CUDA = torch.device("cuda")
CFG = ModelConfig(vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                  intermediate_size=256, max_position_embeddings=256)
NO_DROPOUT = ModelConfig(**{**CFG.__dict__, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0})


def rows(kind: str, size: int = 8) -> dict[str, torch.Tensor]:
    """A batch of 128-token rows on the GPU: every token real, padded, or packed."""
    arrays = synthetic(48, 128, 12, CFG.vocab_size, seed=7)
    if kind == "unpadded":
        arrays.input_mask[:] = 1
    batch = PretrainingDataset(pack_arrays(arrays, 3) if kind == "packed" else arrays).batch(np.arange(size))
    if kind == "unpadded":
        batch.pop("attention_mask", None)
    return {k: v.to(CUDA) for k, v in batch.items()}


KERNELS = {"unpadded": ["flash", "cudnn", "efficient"], "padded": ["cudnn", "efficient", "flex"],
           "packed": ["cudnn", "efficient", "flex"]}


@pytest.mark.parametrize("kind, kernel", [(kind, kernel) for kind, kernels in KERNELS.items() for kernel in kernels])
def test_each_attention_kernels_gradients_equal_math(kind, kernel):
    """Loss and every gradient of a bf16 step through one kernel against the math kernel (same
    weights, no dropout): within bf16's rounding."""
    torch.manual_seed(0)
    math = BertForPreTraining(NO_DROPOUT).to(CUDA).train()
    other = copy.deepcopy(math)
    set_attention_backends(math, ["math"])
    set_attention_backends(other, [kernel])
    batch = rows(kind)
    losses = []
    for model in (math, other):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = forward_loss(model, batch)["loss"]
        loss.backward()
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=2e-2)
    got = dict(other.named_parameters())
    for name, param in math.named_parameters():
        scale = param.grad.abs().max().item()
        assert (got[name].grad - param.grad).abs().max().item() <= 5e-2 * scale + 1e-6, name


@pytest.mark.parametrize("kernel", ["flash", "cudnn", "efficient"])
def test_training_with_dropout_runs_each_kernel(kernel):
    """Attention and hidden dropout on, in training mode: each SDPA kernel runs forward and backward,
    the same seed draws the same masks (equal losses) and another seed other masks."""
    model = BertForPreTraining(CFG).to(CUDA).train()
    set_attention_backends(model, [kernel])
    batch = rows("unpadded" if kernel == "flash" else "padded")

    def loss_at(seed: int) -> float:
        torch.manual_seed(seed)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = forward_loss(model, batch)["loss"]
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss.item()

    first, again, other = loss_at(1), loss_at(1), loss_at(2)
    assert np.isfinite(first) and first == again and other != first


def engine_step_without_sync(compiled: bool) -> None:
    torch.manual_seed(0)
    model = BertForPreTraining(CFG).to(CUDA).train()
    set_vocab_multiple(model, 64)
    if compiled:
        model = torch.compile(model, dynamic=False)
    train = TrainConfig(optimizer="lamb", lamb="mlperf", lr=1e-3, schedule="poly", warmup_steps=2, grad_clip=1.0)
    optimizer = build_optimizer(model, train)
    engine = Engine(model, optimizer, build_scheduler(optimizer, train, 10), training_loss, "bf16", 1.0,
                    dist=DistContext(device=CUDA), seed=3)
    batches = [rows("padded", 4) for _ in range(2)]
    for step in range(2):  # compiled: the graphs are made here, outside the check
        engine.step(batches, 2, step)
    engine.flush()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(2, 6):
            engine.step(batches, 2, step)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    report = engine.flush()
    assert report is not None and report.step == 6 and np.isfinite(report.values["loss"])


def test_an_engine_step_makes_no_host_sync_eager():
    """Accumulation 2, LAMB (mlperf), clipping, bf16: no step synchronises with the device."""
    engine_step_without_sync(compiled=False)


def test_an_engine_step_makes_no_host_sync_compiled():
    engine_step_without_sync(compiled=True)


@pytest.fixture
def exact_fp32():
    """fp32 matmuls in exact fp32 for the test (training's default on CUDA is TF32: dist.fp32_matmul_precision)."""
    before = use_fp32_matmul_precision("ieee")
    yield
    use_fp32_matmul_precision(before)


@pytest.mark.parametrize("precision, tolerance", [("bf16", 0.03), ("fp16", 0.01)])
def test_half_precision_losses_follow_fp32(precision, tolerance, exact_fp32):
    """20 steps of the same model, data and LAMB in exact fp32 and in bf16 or fp16 (with the loss scaler):
    every step's loss within ``tolerance`` (relative) of fp32's. At lr 5e-3 fp32 learns (6.96 to 5.76 on
    the CPU); at 2e-3 it went to 6.45 only (the H200 run of fb4a0b0), short of the 10 % asked."""
    batches = [rows("padded", 8) for _ in range(2)]

    def losses(precision: str) -> list[float]:
        torch.manual_seed(0)
        model = BertForPreTraining(NO_DROPOUT).to(CUDA).train()
        train = TrainConfig(optimizer="lamb", lr=5e-3, schedule="constant")
        optimizer = build_optimizer(model, train)
        engine = Engine(model, optimizer, build_scheduler(optimizer, train, 20), training_loss, precision, 1.0,
                        dist=DistContext(device=CUDA))
        values = []
        for step in range(20):
            engine.step([batches[step % 2]], 1, step)
            if engine.report is not None:
                values.append(engine.report.values["loss"])
        report = engine.flush()
        assert report is not None
        return [*values, report.values["loss"]]

    reference, half = losses("fp32"), losses(precision)
    assert reference[-1] < 0.9 * reference[0]  # it learns
    for step, (want, got) in enumerate(zip(reference, half)):
        assert got == pytest.approx(want, rel=tolerance), step


def stages_against_the_whole_model(device: torch.device) -> None:
    """Both stages of a two-stage split, eager bf16 (the path the first GPU run crashed on), against the
    whole model under the same autocast: the same logits, and a backward with finite gradients."""
    torch.manual_seed(0)
    model = BertForPreTraining(NO_DROPOUT).to(device).train()
    first, last = BertStage(model, 0, 2), BertStage(model, 1, 2)
    for stage in (first, last):
        stage.precision = "bf16"
    fields = {k: v.to(device).long() if v.dtype == torch.int32 else v.to(device) for k, v in rows("packed").items()}
    packing = {name: fields[name] for name in ("position_ids", "sequence_ids")}
    hidden, rng = first(fields["input_ids"], token_type_ids=fields["token_type_ids"], **packing)
    mlm_logits, nsp_logits = last(hidden, rng, sequence_ids=fields["sequence_ids"],
                                  masked_lm_positions=fields["masked_lm_positions"],
                                  cls_positions=fields["cls_positions"])
    with torch.no_grad(), torch.autocast(device.type, torch.bfloat16):
        want_mlm, want_nsp = model(fields["input_ids"], fields["token_type_ids"], None, fields["masked_lm_positions"],
                                   cls_positions=fields["cls_positions"], **packing)
    torch.testing.assert_close(mlm_logits.float(), want_mlm.float(), rtol=0.02, atol=0.02)
    torch.testing.assert_close(nsp_logits.float(), want_nsp.float(), rtol=0.02, atol=0.02)
    (mlm_logits.float().sum() + nsp_logits.float().sum()).backward()
    assert all(p.grad is not None and p.grad.isfinite().all() for p in first.parameters())


def test_pipeline_stages_run_eager_bf16():
    stages_against_the_whole_model(CUDA)


@pytest.mark.parametrize("optimizer", ["lamb", "stableadamw"])
def test_the_compiled_optimizer_step_follows_eager_on_bert_large(optimizer):
    """Two layers of BERT-large on CUDA (its 31M-element word embeddings make the norms split reductions,
    where torch 2.11's loop reordering crashed every compiled LAMB run): three compiled steps equal the
    eager ones within a few float32 units. (All 24 layers take over 110 s to compile on an H200.)"""
    from bertforge.config import MODEL_PRESETS

    torch.manual_seed(0)
    large = ModelConfig(**{**CFG.__dict__, **MODEL_PRESETS["large"], "num_hidden_layers": 2, "vocab_size": 30522,
                           "max_position_embeddings": 512})
    models = [BertForPreTraining(large).to(CUDA) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    train = TrainConfig(optimizer=optimizer, lr=1e-3, weight_decay=0.01)
    optimizers = [build_optimizer(model, train, compiled=compiled) for model, compiled in zip(models, (False, True))]
    for step in range(3):
        torch.manual_seed(step)
        grads = [torch.randn_like(p) * 1e-3 for p in models[0].parameters()]
        for model, opt in zip(models, optimizers):
            for p, g in zip(model.parameters(), grads):
                p.grad = g.clone()
            opt.step()
    for (name, eager), compiled in zip(models[0].state_dict().items(), models[1].state_dict().values()):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6, msg=name)
