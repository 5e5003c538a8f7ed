"""bf16 weights with stochastic rounding (train.weights, train.stochastic_rounding, train.optimizer_state)
and the static loss scale (train.loss_scale, train.scaled_optimizer_state): PopXL's memory saving."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_engine import TINY, batch_of
from test_train import read_metrics, small_config

from bertforge.config import ConfigError, TrainConfig, load_config
from bertforge.formats.load import load_model
from bertforge.models.bert import BertForPreTraining
from bertforge.parallel.plan import plan_memory
from bertforge.training.engine import Engine
from bertforge.training.optim import (
    AdamWNoBiasCorrection,
    Bf16Rounding,
    build_optimizer,
    build_scheduler,
    cast_weights,
    stochastic_round_,
)
from bertforge.training.pretrain import pretrain, training_loss


def bf16_neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values a <= x < b around each fp32 x > 0 (by truncation and one bf16 ulp up)."""
    low = (x.view(torch.int32) & -65536).view(torch.float32)
    high = (low.view(torch.int32) + 65536).view(torch.float32)
    return low, high


def test_stochastic_rounding_is_unbiased_and_rounds_up_with_the_fractional_position():
    """For 200 x of both signs over many binades, 20000 roundings each: the mean is x and P(up) is
    (|x| - a) / (b - a), both within 5 standard deviations (var of one rounding: (b - a)² p (1 - p))."""
    gen = torch.Generator().manual_seed(0)
    magnitudes = torch.exp(torch.empty(200).uniform_(-20, 20, generator=gen))
    signs = torch.where(torch.rand(200, generator=gen) < 0.5, -1.0, 1.0)
    x = (magnitudes * signs).float()
    draws = 20000
    values = x[:, None].expand(-1, draws).contiguous()
    rounded = torch.empty_like(values, dtype=torch.bfloat16)
    stochastic_round_(rounded, values, torch.Generator().manual_seed(1))
    low, high = bf16_neighbours(x.abs())
    p = ((x.abs() - low) / (high - low)).double()
    up = (rounded.float().abs() == high[:, None]).double().mean(1)
    assert ((rounded.float().abs() == low[:, None]) | (rounded.float().abs() == high[:, None])).all()
    assert (rounded.float().sign() == x.sign()[:, None]).all()
    sigma_p = (p * (1 - p) / draws).sqrt()
    assert ((up - p).abs() <= 5 * sigma_p + 1e-12).all()
    # E[round(x)] = x: the mean's error, in units of the gap, bounded as P(up)'s.
    error = (rounded.double().mean(1) - x.double()).abs() / (high - low).double()
    assert (error <= 5 * sigma_p + 1e-9).all()
    assert p.min() < 0.1 and p.max() > 0.9  # the x cover the whole gap
    exact = torch.tensor([1.0, -2.5, 0.0, 3.140625])  # bf16 values stay as they are
    out = torch.empty(4, dtype=torch.bfloat16)
    stochastic_round_(out, exact, torch.Generator().manual_seed(2))
    assert torch.equal(out.float(), exact)


def adam_steps(dtype: torch.dtype, rounding: Bf16Rounding | None, steps: int = 100) -> torch.Tensor:
    """AdamW (no bias correction) at lr 1e-4 on 1024 weights at 1.0 with a constant gradient of -1:
    each update (about 1e-4) is under half a bf16 ulp at 1.0 (2^-8)."""
    p = torch.nn.Parameter(torch.ones(1024, dtype=dtype))
    opt = AdamWNoBiasCorrection([p], lr=1e-4)
    opt.rounding = rounding
    for _ in range(steps):
        p.grad = torch.full_like(p, -1.0)
        opt.step()
    return p.detach().float()


def test_round_to_nearest_stalls_where_stochastic_rounding_follows_fp32():
    reference = adam_steps(torch.float32, None)
    assert reference[0].item() > 1.02  # fp32 weights moved by about 4 bf16 ulps
    nearest = adam_steps(torch.bfloat16, Bf16Rounding(stochastic=False, seed=0))
    assert torch.equal(nearest, torch.ones(1024))  # every update lost
    stochastic = adam_steps(torch.bfloat16, Bf16Rounding(stochastic=True, seed=0))
    # Each step's rounding error has mean 0 and variance at most ulp² / 4 (ulp 2^-7 in [1, 2)), so the
    # mean of 1024 weights after 100 steps is within 5 · ulp · sqrt(100 / 4) / sqrt(1024) of the fp32 weight.
    assert abs(stochastic.mean().item() - reference[0].item()) < 5 * 2**-7 * (100 / 4) ** 0.5 / 32
    assert stochastic.mean().item() - 1.0 > 0.02
    assert stochastic.std().item() > 0  # each weight its own rounding


def train_config(**kwargs) -> TrainConfig:
    return TrainConfig(optimizer="lamb", lr=1e-3, warmup_steps=0, schedule="constant", **kwargs)


def bf16_model_and_optimizer(state: str):
    torch.manual_seed(0)
    train = train_config(weights="bf16", optimizer_state=state, stochastic_rounding=True)
    model = cast_weights(BertForPreTraining(TINY), train)
    return model, build_optimizer(model, train)


def take_steps(model, optimizer, steps: range) -> None:
    for step in steps:
        generator = torch.Generator().manual_seed(step)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=generator).to(p.dtype)
        optimizer.step()


@pytest.mark.parametrize("state", ["fp32", "bf16"])
def test_bf16_optimizer_resumes_exactly_with_its_moments_and_random_stream(state):
    """3 steps, a state_dict through torch.save / load(weights_only), 3 more steps == 6 steps at once:
    the rounding's random stream is saved, fp32 moments stay fp32 (torch would cast them to bf16)."""
    model, optimizer = bf16_model_and_optimizer(state)
    take_steps(model, optimizer, range(6))
    model2, optimizer2 = bf16_model_and_optimizer(state)
    take_steps(model2, optimizer2, range(3))
    buffer = io.BytesIO()
    torch.save({"model": model2.state_dict(), "optimizer": optimizer2.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    model3, optimizer3 = bf16_model_and_optimizer(state)
    model3.load_state_dict(saved["model"])
    optimizer3.load_state_dict(saved["optimizer"])
    take_steps(model3, optimizer3, range(3, 6))
    dtype = torch.float32 if state == "fp32" else torch.bfloat16
    for a, b in zip(model.parameters(), model3.parameters()):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)
        for key in ("exp_avg", "exp_avg_sq"):
            assert optimizer3.state[b][key].dtype == dtype
            assert torch.equal(optimizer.state[a][key], optimizer3.state[b][key])
    # Without the saved random stream the resumed weights differ.
    model4, optimizer4 = bf16_model_and_optimizer(state)
    model4.load_state_dict(saved["model"])
    optimizer4.load_state_dict({k: v for k, v in saved["optimizer"].items() if k != "rounding"})
    take_steps(model4, optimizer4, range(3, 6))
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), model4.parameters()))


def test_plan_counts_the_measured_bytes_of_parameters_and_optimizer_state():
    """plan's parameters + optimizer state equal the nbytes of a tiny model's tensors after a step:
    fp32 weights and moments, bf16 weights with fp32 moments, all bf16."""
    measured = {}
    for weights, state in (("fp32", "fp32"), ("bf16", "fp32"), ("bf16", "bf16")):
        overrides = [("train.weights", weights), ("train.optimizer_state", state),
                     ("execution.precision", "bf16" if weights == "bf16" else "fp32"),
                     ("train.stochastic_rounding", weights == "bf16")]
        cfg = load_config("tiny", overrides)
        torch.manual_seed(0)
        model = cast_weights(BertForPreTraining(cfg.model), cfg.train)
        optimizer = build_optimizer(model, cfg.train)
        take_steps(model, optimizer, range(1))
        params = sum(p.nbytes for p in model.parameters())
        moments = sum(v.nbytes for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
        plan = plan_memory(cfg)
        assert (plan.parameters, plan.gradients, plan.optimizer_state) == (params, params, moments)
        measured[weights, state] = params + moments
    n = sum(p.numel() for p in BertForPreTraining(load_config("tiny").model).parameters())
    assert measured["fp32", "fp32"] - measured["bf16", "fp32"] == 2 * n  # 12 → 10 bytes per parameter
    assert measured["fp32", "fp32"] == 2 * measured["bf16", "bf16"]  # 12 → 6


def scaled_run(loss_scale: float, scaled_state: bool, steps: int = 3, optimizer: str = "lamb",
               eps: float = 1e-6):
    """The weights and gradient norms of ``steps`` engine steps of TINY (fp32), ``optimizer`` one of
    lamb, adamw, adamw_nobias (no bias correction: ours), stableadamw."""
    torch.manual_seed(0)
    model = BertForPreTraining(TINY)
    train = TrainConfig(optimizer=optimizer.removesuffix("_nobias"), lr=1e-2, warmup_steps=0,  # type: ignore[arg-type]
                        schedule="constant", eps=eps, bias_correction=not optimizer.endswith("_nobias"),
                        loss_scale=loss_scale, scaled_optimizer_state=scaled_state)
    opt = build_optimizer(model, train)
    engine = Engine(model, opt, build_scheduler(opt, train, 10), training_loss, "fp32", 1.0,
                    loss_scale=loss_scale, scaled_state=scaled_state)
    norms = [engine.step([batch_of(range(8))], 1, step)["grad_norm"].item() for step in range(steps)]
    return model, norms


def test_a_power_of_two_loss_scale_unscaled_in_fp32_is_bit_identical_to_none():
    plain, plain_norms = scaled_run(1.0, False)
    scaled, scaled_norms = scaled_run(1024.0, False)
    assert scaled_norms == plain_norms
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), scaled.parameters()))


@pytest.mark.parametrize("optimizer", ["lamb", "adamw", "adamw_nobias", "stableadamw"])
def test_scaled_optimizer_state_with_scaled_eps_equals_plain_adam(optimizer):
    """PopART's scaled_optimizer_state: moments of gradients × S and eps × S give the update of plain
    Adam on unscaled gradients, up to float rounding; with eps left as it was they do not (eps 1e-3
    matters for these gradients)."""
    plain, plain_norms = scaled_run(1.0, False, optimizer=optimizer, eps=1e-3)
    scaled, scaled_norms = scaled_run(3000.0, True, optimizer=optimizer, eps=1e-3)
    assert scaled_norms == pytest.approx(plain_norms, rel=1e-5)
    for a, b in zip(plain.parameters(), scaled.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # eps given as 1e-3 / S is built as 1e-3: the scaled moments with an unscaled eps, another update.
    unscaled_eps, _ = scaled_run(3000.0, True, optimizer=optimizer, eps=1e-3 / 3000)
    assert max((a - b).abs().max().item() for a, b in zip(plain.parameters(), unscaled_eps.parameters())) > 1e-4


@pytest.mark.parametrize("change,message", [
    ({"train.optimizer_state": "bf16"}, "train.optimizer_state=bf16 needs train.weights bf16"),
    ({"train.stochastic_rounding": True}, "train.stochastic_rounding=true rounds bf16 weights"),
    ({"train.weights": "bf16"}, "execution.precision=fp32 cannot be used"),
    ({"train.weights": "bf16", "execution.precision": "fp16"}, "execution.precision=fp16 cannot be used"),
    ({"train.weights": "bf16", "execution.precision": "bf16", "train.optimizer": "sgd"}, "optimizer=sgd"),
    ({"train.weights": "bf16", "execution.precision": "bf16", "train.optimizer": "adamw"},
     "adamw with train.bias_correction=true"),
    ({"train.weights": "bf16", "execution.precision": "bf16", "execution.parallel": "fsdp"},
     "execution.parallel=fsdp"),
    ({"train.loss_scale": 0.0}, "train.loss_scale=0.0 must"),
    ({"train.scaled_optimizer_state": True, "train.optimizer": "sgd"}, "needs an Adam-style optimizer"),
])
def test_combinations_that_make_no_sense_are_refused_in_one_line(change, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")) as err:
        load_config("tiny", list(change.items()))
    assert "\n" not in str(err.value)


BF16 = {"train.weights": "bf16", "train.stochastic_rounding": True, "execution.precision": "bf16"}


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bf16")
    cfg = small_config(tmp, "bf16", **BF16)
    summary = pretrain(cfg)
    return tmp, Path(summary["run_dir"])


@pytest.mark.slow
def test_bf16_pretraining_resumes_bit_identically(bf16_run, tmp_path):
    _, run_dir = bf16_run
    copy_dir = tmp_path / "interrupted"
    shutil.copytree(run_dir, copy_dir)
    shutil.rmtree(copy_dir / "checkpoints" / "step_00000006")
    train_rows, _ = read_metrics(run_dir)
    with open(copy_dir / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in train_rows[:3])
    pretrain(small_config(tmp_path, "unused", **{"checkpoint.resume": str(copy_dir), **BF16}))
    resumed_rows, _ = read_metrics(copy_dir)
    assert [r["loss"] for r in resumed_rows] == [r["loss"] for r in train_rows]
    a = load_file(str(run_dir / "checkpoints/step_00000006/model.safetensors"))
    b = load_file(str(copy_dir / "checkpoints/step_00000006/model.safetensors"))
    assert {v.dtype for v in a.values()} == {torch.bfloat16}
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    oa = torch.load(run_dir / "checkpoints/step_00000006/optimizer.pt", weights_only=True)
    ob = torch.load(copy_dir / "checkpoints/step_00000006/optimizer.pt", weights_only=True)
    assert all(torch.equal(oa["rounding"][k], ob["rounding"][k]) for k in oa["rounding"])
    for k, state in oa["state"].items():
        for name, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(ob["state"][k][name])), (k, name)


@pytest.mark.slow
def test_export_of_a_bf16_run_gives_its_weights(bf16_run, tmp_path):
    from bertforge.cli import main

    _, run_dir = bf16_run
    saved = load_file(str(run_dir / "checkpoints/step_00000006/model.safetensors"))
    loaded = load_model(run_dir).state_dict()
    assert all(torch.equal(loaded[k].float(), v.float()) for k, v in saved.items())
    out = tmp_path / "hf"
    assert main(["export", str(run_dir), str(out)]) == 0
    exported = load_file(str(out / "model.safetensors"))
    word = "bert.embeddings.word_embeddings.weight"
    assert torch.equal(exported[word].float(), saved[word].float())
    assert (saved[word].float() != 0).any()
