"""train.optimizer_in_backward: each parameter steps in the backward, equal to the ordinary step."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from test_engine import TINY, batch_of

from bertforge.bench.pretrain import LiveTensorBytes
from bertforge.config import ConfigError, ModelConfig, TrainConfig, load_config
from bertforge.models.bert import BertForPreTraining
from bertforge.parallel.plan import FP32, count_parameters, plan_memory
from bertforge.training.engine import Engine, NonFiniteError
from bertforge.training.optim import build_optimizer, build_scheduler
from bertforge.training.pretrain import pretrain, training_loss

DROPOUT = ModelConfig(**{**TINY.__dict__, "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1})


def engines(model_config: ModelConfig, loss_fn=training_loss, **train) -> tuple[Engine, Engine]:
    """(the ordinary engine, the in-backward one) on twin models, grad_clip 0, a poly schedule."""
    torch.manual_seed(0)
    model = BertForPreTraining(model_config).train()
    twin = copy.deepcopy(model)
    tr = TrainConfig(**{"lr": 1e-2, "warmup_steps": 2, "schedule": "poly", "grad_clip": 0.0, **train})
    made = []
    for m, in_backward in ((model, False), (twin, True)):
        optimizer = build_optimizer(m, tr)
        made.append(Engine(m, optimizer, build_scheduler(optimizer, tr, 10), loss_fn, "fp32", 0.0, seed=3,
                           optimizer_in_backward=in_backward))
    return made[0], made[1]


def assert_same_state(a: Engine, b: Engine) -> None:
    for (name, x), y in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.equal(x, y), name
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert sa["state"].keys() == sb["state"].keys()
    for index, state in sa["state"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(sb["state"][index][key])), (index, key)


@pytest.mark.parametrize("train", [
    {"optimizer": "lamb", "lamb": "bertforge"}, {"optimizer": "lamb", "lamb": "mlperf"},
    {"optimizer": "adamw"}, {"optimizer": "adamw", "bias_correction": False}, {"optimizer": "stableadamw"},
], ids=lambda t: "-".join(str(v) for v in t.values()))
def test_in_backward_equals_the_ordinary_step_bit_for_bit(train):
    """Three steps with dropout: the same weights and optimizer state, bit for bit (each optimizer updates
    a tensor from its own gradient and state alone, and the per-tensor kernels are the same on one
    tensor as on a list), the same losses and the gradient norm within float rounding."""
    ordinary, in_backward = engines(DROPOUT, **train)
    for step in range(3):
        a = ordinary.step([batch_of(range(4))], 1, step)
        b = in_backward.step([batch_of(range(4))], 1, step)
        assert a["loss"].item() == b["loss"].item()
        assert b["grad_norm"].item() == pytest.approx(a["grad_norm"].item(), rel=1e-6)
    assert_same_state(ordinary, in_backward)
    assert all(p.grad is None for p in in_backward.model.parameters())


def test_in_backward_with_accumulation_steps_on_the_last_micro_batch():
    """Two micro-batches a step: the first accumulates as usual, the last one's backward steps."""
    ordinary, in_backward = engines(DROPOUT, optimizer="lamb")
    for step in range(3):
        ordinary.step([batch_of(range(2)), batch_of(range(2, 4))], 2, step)
        in_backward.step([batch_of(range(2)), batch_of(range(2, 4))], 2, step)
    assert_same_state(ordinary, in_backward)


def test_in_backward_skips_a_non_finite_step_and_names_it():
    """A NaN loss at the third step: no parameter moves from then on, and the step after raises."""
    calls = []

    def nan_at_3(model, batch):
        out = training_loss(model, batch)
        calls.append(None)
        return {**out, "loss": out["loss"] * float("nan")} if len(calls) == 3 else out

    _, engine = engines(TINY, nan_at_3, optimizer="lamb")
    for step in range(2):
        engine.step([batch_of(range(4))], 1, step)
    engine.flush()
    before = copy.deepcopy(engine.model.state_dict())
    engine.step([batch_of(range(4))], 1, 2)
    with pytest.raises(NonFiniteError, match="^step 3: the loss is nan"):
        engine.step([batch_of(range(4))], 1, 3)
    assert all(torch.equal(v, before[k]) for k, v in engine.model.state_dict().items())


@pytest.mark.parametrize("override,named", [
    ({"train.grad_clip": 1.0}, "train.grad_clip=1 (global-norm clipping"),
    ({"execution.precision": "fp16"}, "execution.precision=fp16"),
    ({"execution.parallel": "ddp"}, "execution.parallel=ddp (the hook would step before the gradient is reduced)"),
    ({"execution.parallel": "fsdp"}, "execution.parallel=fsdp"),
    ({"execution.pipeline_stages": 2}, "execution.pipeline_stages=2"),
    ({"train.loss_scale": 1024.0}, "train.loss_scale=1024 (the gradients are unscaled in the ordinary step)"),
    ({"train.weights": "bf16", "execution.precision": "bf16"}, "train.weights=bf16 (not supported yet"),
])
def test_pairings_that_need_every_gradient_are_refused_in_one_line(override, named):
    overrides = {"train.optimizer_in_backward": True, "train.grad_clip": 0.0, **override}
    with pytest.raises(ConfigError) as err:
        load_config("pretrain_tiny", list(overrides.items()))
    message = str(err.value)
    assert message.startswith(f"train.optimizer_in_backward=true cannot be used with {named}")
    assert "\n" not in message


def test_the_engine_refuses_clipping_itself():
    model = BertForPreTraining(TINY)
    optimizer = build_optimizer(model, TrainConfig())
    with pytest.raises(ConfigError, match="^train.optimizer_in_backward needs train.grad_clip 0 .got 1."):
        Engine(model, optimizer, build_scheduler(optimizer, TrainConfig(), 10), training_loss, "fp32", 1.0,
               optimizer_in_backward=True)


# ------------------------------------------------------------ memory

MINI = [("model.vocab_size", 4096), ("data.seq_len", 64), ("data.max_predictions", 10),
        ("train.micro_batch_size", 2), ("train.global_batch_size", 2), ("train.grad_clip", 0.0),
        ("execution.device", "cpu"), ("train.schedule", "constant")]


def measured_peak(in_backward: bool) -> int:
    """Peak bytes of live tensors made by the second step of mini (the first makes the
    optimizer state), measured op by op on the CPU through forward, backward and step."""
    cfg = load_config("mini", MINI + [("train.optimizer_in_backward", in_backward)])
    torch.manual_seed(0)
    model = BertForPreTraining(cfg.model).train()
    optimizer = build_optimizer(model, cfg.train)
    engine = Engine(model, optimizer, build_scheduler(optimizer, cfg.train, 4), training_loss, "fp32", 0.0,
                    optimizer_in_backward=in_backward)
    batch = batch_of_size(cfg)
    engine.step([batch], 1, 0)
    engine.flush()
    with LiveTensorBytes() as tracker:
        engine.step([batch], 1, 1)
        engine.flush()
    return tracker.peak


def batch_of_size(cfg) -> dict[str, torch.Tensor]:
    from bertforge.data import SyntheticDataset

    data = SyntheticDataset(size=cfg.train.micro_batch_size, vocab_size=cfg.model.vocab_size,
                            seq_len=cfg.data.seq_len, max_predictions=cfg.data.max_predictions)
    return data.batch(list(range(cfg.train.micro_batch_size)))


@pytest.mark.slow
def test_in_backward_lowers_the_measured_peak_by_the_gradients_and_plan_says_it():
    """mini (4 layers, hidden 256; vocab 4096, seq 64, micro-batch 2), LAMB: the measured peak of the
    tensors a step makes falls by about the gradients' bytes (the ordinary peak is the step's:
    every gradient and LAMB's update buffers; in the backward only the word embeddings' gradient
    is held, from the decoder's backward to the embedding's), and the plan's falls by as much,
    within 10%."""
    ordinary, in_backward = measured_peak(False), measured_peak(True)
    cfg = load_config("mini", MINI)
    gradients = count_parameters(cfg.model) * FP32
    saved = ordinary - in_backward
    assert saved == pytest.approx(gradients, rel=0.1)
    planned = [plan_memory(load_config("mini", MINI + [("train.optimizer_in_backward", flag)]), device="cpu")
               for flag in (False, True)]
    assert planned[1].gradients == cfg.model.vocab_size * cfg.model.hidden_size * FP32  # the largest, held
    assert planned[1].details["gradients_dropped"] == gradients - planned[1].gradients
    assert planned[0].combined_peak - planned[1].combined_peak == pytest.approx(saved, rel=0.1)


# ------------------------------------------------------------ resume

@pytest.mark.slow
def test_resume_with_optimizer_in_backward_is_bit_identical(tmp_path):
    """Four steps in one go, or two, a checkpoint and a resume for two more: the same losses and
    weights, bit for bit (the optimizer state is the ordinary optimizer's)."""
    from test_train import read_metrics, small_config

    on = {"train.optimizer_in_backward": True, "train.grad_clip": 0.0, "train.steps": 4, "checkpoint.every": 2,
          "train.eval_at_start": False, "train.eval_batches": 1}
    run_dir = Path(pretrain(small_config(tmp_path, "full", **on))["run_dir"])
    copy_dir = tmp_path / "interrupted"
    shutil.copytree(run_dir, copy_dir)
    shutil.rmtree(copy_dir / "checkpoints" / "step_00000004")
    rows, _ = read_metrics(run_dir)
    with open(copy_dir / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows[:2])
    pretrain(small_config(tmp_path, "unused", **on, **{"checkpoint.resume": str(copy_dir)}))
    resumed, _ = read_metrics(copy_dir)
    assert [r["loss"] for r in resumed] == [r["loss"] for r in rows]
    from safetensors.torch import load_file

    a = load_file(str(run_dir / "checkpoints/step_00000004/model.safetensors"))
    b = load_file(str(copy_dir / "checkpoints/step_00000004/model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
