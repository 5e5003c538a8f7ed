"""Tests of bertforge.training.optim against numbers computed by hand or by small
independent numpy re-implementations of the published update rules."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from bertforge.config import ConfigError, ExecutionConfig, ModelConfig, TrainConfig, load_config
from bertforge.models.bert import BertForPreTraining
from bertforge.parallel.dist import compiles_optimizer
from bertforge.training.engine import Engine, skips_on_device
from bertforge.training.optim import (
    AdamWNoBiasCorrection,
    Lamb,
    StableAdamW,
    build_optimizer,
    build_scheduler,
    lr_at,
    param_groups,
)

SQRT_0_001 = math.sqrt(0.001)  # sqrt(1 - beta2) for beta2 = 0.999


def one_step(opt_cls, w, g, **kwargs) -> list[float]:
    """Apply one step of opt_cls to a parameter w with gradient g."""
    p = nn.Parameter(torch.tensor(w, dtype=torch.float32))
    opt = opt_cls([p], **kwargs)
    p.grad = torch.tensor(g, dtype=torch.float32)
    opt.step()
    return p.detach().tolist()


def run_steps(opt_cls, w, grads, **kwargs) -> np.ndarray:
    p = nn.Parameter(torch.tensor(w, dtype=torch.float32))
    opt = opt_cls([p], **kwargs)
    for g in grads:
        p.grad = torch.tensor(g, dtype=torch.float32)
        opt.step()
    return p.detach().double().numpy()


# ------------------------------------------------ numpy references (float64)

def lamb_reference(w, grads, lr, b1, b2, eps, wd, bias_correction, max_trust_ratio):
    """You et al. 2019, Algorithm 2, one tensor, with the trust-ratio clamp."""
    w = np.array(w, dtype=np.float32).astype(np.float64)
    m = np.zeros_like(w)
    v = np.zeros_like(w)
    for t, g in enumerate(grads, start=1):
        g = np.array(g, dtype=np.float32).astype(np.float64)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        if bias_correction:
            m_hat, v_hat = m / (1 - b1 ** t), v / (1 - b2 ** t)
        else:
            m_hat, v_hat = m, v
        u = m_hat / (np.sqrt(v_hat) + eps) + wd * w
        w_norm, u_norm = np.linalg.norm(w), np.linalg.norm(u)
        r = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
        if max_trust_ratio > 0:
            r = min(r, max_trust_ratio)
        w = w - lr * r * u
    return w


def adamw_reference(w, grads, lr, b1, b2, eps, wd):
    """Loshchilov & Hutter's AdamW with bias correction (torch.optim.AdamW's update)."""
    w = np.array(w, dtype=np.float32).astype(np.float64)
    m = np.zeros_like(w)
    v = np.zeros_like(w)
    for t, g in enumerate(grads, start=1):
        g = np.array(g, dtype=np.float32).astype(np.float64)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g ** 2
        w = w - lr * (m / (1 - b1 ** t) / (np.sqrt(v / (1 - b2 ** t)) + eps) + wd * w)
    return w


def google_adam_weight_decay(param, grads, learning_rate, beta_1, beta_2, epsilon,
                             weight_decay_rate, use_weight_decay=True):
    """google-research/bert AdamWeightDecayOptimizer.apply_gradients, line by line."""
    param = np.array(param, dtype=np.float32).astype(np.float64)
    m = np.zeros_like(param)
    v = np.zeros_like(param)
    for grad in grads:
        grad = np.array(grad, dtype=np.float32).astype(np.float64)
        next_m = beta_1 * m + (1.0 - beta_1) * grad
        next_v = beta_2 * v + (1.0 - beta_2) * np.square(grad)
        update = next_m / (np.sqrt(next_v) + epsilon)
        if use_weight_decay:
            update += weight_decay_rate * param
        update_with_lr = learning_rate * update
        param = param - update_with_lr
        m, v = next_m, next_v
    return param


W0 = [0.5, -1.5, 2.0, 0.25, -0.75]
G1 = [0.1, 0.4, -0.3, 0.05, -0.2]
G2 = [-0.2, 0.1, 0.3, -0.4, 0.02]


# ------------------------------------------------------------------ LAMB

@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.smoke
def test_lamb_first_step_by_hand(bias_correction):
    # Without weight decay the trust ratio cancels Adam's scale: the step has
    # norm lr·||w|| along sign(g) (first step), with or without bias correction.
    # ||w|| = 5, ||sign(g)|| = sqrt(2): w -= 0.1 · 5/sqrt(2) · sign(g).
    got = one_step(Lamb, [3.0, 4.0], [0.5, -2.0], lr=0.1, eps=1e-10,
                   bias_correction=bias_correction)
    assert got == pytest.approx([2.6464466094, 4.3535533906], rel=1e-6)


def test_lamb_weight_decay_by_hand():
    # u = sign(g) + 0.1·w = [1.3, -0.6]; r = 5/sqrt(2.05) = 3.4921514788
    got = one_step(Lamb, [3.0, 4.0], [0.5, -2.0], lr=0.1, eps=1e-10, weight_decay=0.1)
    assert got == pytest.approx([2.5460203077, 4.2095290887], rel=1e-6)
    # Without bias correction Adam's first step is sign(g)·0.1/sqrt(0.001):
    # u = [3.16227766 + 0.3, -3.16227766 + 0.4]; r = 5/||u|| = 1.1288797469
    got = one_step(Lamb, [3.0, 4.0], [0.5, -2.0], lr=0.1, eps=1e-10, weight_decay=0.1,
                   bias_correction=False)
    assert got == pytest.approx([2.6091504871, 4.3118279306], rel=1e-6)


def test_lamb_trust_ratio_clamp_by_hand():
    # ||w|| = 50, ||u|| = sqrt(2): r = 35.36, clamped to 10.
    got = one_step(Lamb, [30.0, 40.0], [0.5, -2.0], lr=0.1, eps=1e-10, max_trust_ratio=10.0)
    assert got == pytest.approx([29.0, 41.0], rel=1e-6)
    # max_trust_ratio = 0: no clamp, r = 50/sqrt(2) = 35.3553390593
    got = one_step(Lamb, [30.0, 40.0], [0.5, -2.0], lr=0.1, eps=1e-10, max_trust_ratio=0.0)
    assert got == pytest.approx([26.4644660941, 43.5355339059], rel=1e-6)
    # No bias correction: u = 3.16227766·sign(g), r = 11.18 → 10; w -= 0.1·10·u
    got = one_step(Lamb, [30.0, 40.0], [0.5, -2.0], lr=0.1, eps=1e-10, max_trust_ratio=10.0,
                   bias_correction=False)
    assert got == pytest.approx([26.8377223398, 43.1622776602], rel=1e-6)


def test_lamb_zero_weight_uses_ratio_one():
    # ||w|| = 0 → r = 1: w = 0 - 0.1 · sign(g)
    got = one_step(Lamb, [0.0, 0.0], [0.5, -2.0], lr=0.1, eps=1e-10, weight_decay=0.01)
    assert got == pytest.approx([-0.1, 0.1], rel=1e-6)


def test_lamb_zero_update_leaves_weight():
    # g = 0 and no weight decay → u = 0 → r = 1 and w unchanged.
    got = one_step(Lamb, [3.0, 4.0], [0.0, 0.0], lr=0.1)
    assert got == [3.0, 4.0]


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01, 0.3])
@pytest.mark.parametrize("max_trust_ratio, scale", [(10.0, 1.0), (0.0, 1.0), (10.0, 100.0), (0.5, 1.0)])
def test_lamb_two_steps_match_numpy(bias_correction, weight_decay, max_trust_ratio, scale):
    w = [x * scale for x in W0]  # scale 100: ratios above 10, the clamp acts
    kwargs = dict(lr=0.02, betas=(0.8, 0.95), eps=1e-6, weight_decay=weight_decay,
                  bias_correction=bias_correction, max_trust_ratio=max_trust_ratio)
    got = run_steps(Lamb, w, [G1, G2], **kwargs)
    want = lamb_reference(w, [G1, G2], lr=0.02, b1=0.8, b2=0.95, eps=1e-6, wd=weight_decay,
                          bias_correction=bias_correction, max_trust_ratio=max_trust_ratio)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)
    assert not np.allclose(got, np.array(w, dtype=np.float32), atol=1e-4)  # it did move


def test_lamb_bias_correction_matters_with_weight_decay():
    common = dict(lr=0.02, weight_decay=0.3, eps=1e-6)
    on = run_steps(Lamb, W0, [G1, G2], bias_correction=True, **common)
    off = run_steps(Lamb, W0, [G1, G2], bias_correction=False, **common)
    assert np.abs(on - off).max() > 1e-3


def test_lamb_per_tensor_ratio_and_state():
    # Two tensors in one group each get their own trust ratio and step count;
    # a parameter without a gradient is left alone and gets no state.
    a = nn.Parameter(torch.tensor([3.0, 4.0]))
    b = nn.Parameter(torch.tensor([30.0, 40.0]))
    c = nn.Parameter(torch.tensor([1.0, 1.0]))
    opt = Lamb([a, b, c], lr=0.1, eps=1e-10)
    a.grad = torch.tensor([0.5, -2.0])
    b.grad = torch.tensor([0.5, -2.0])
    opt.step()
    assert a.tolist() == pytest.approx([2.6464466094, 4.3535533906], rel=1e-6)
    assert b.tolist() == pytest.approx([29.0, 41.0], rel=1e-6)
    assert c.tolist() == [1.0, 1.0]
    assert c not in opt.state
    assert opt.state[a]["step"] == 1
    assert opt.state[a]["exp_avg"].tolist() == pytest.approx([0.05, -0.2], rel=1e-6)
    assert opt.state[a]["exp_avg_sq"].tolist() == pytest.approx([0.00025, 0.004], rel=1e-5)


def test_lamb_without_layer_adaptation_uses_ratio_one():
    # r = 1 → plain Adam-direction step: w -= 0.1 · sign(g); with adaptation r = 5 / 1.414
    got = one_step(Lamb, [3.0, 4.0], [0.5, -2.0], lr=0.1, eps=1e-10, layer_adaptation=False)
    assert got == pytest.approx([2.9, 4.1], rel=1e-6)


def test_lamb_tensors_at_different_steps():
    # b has no gradient on the first step, so a is at step 2 and b at step 1: the
    # bias corrections differ per tensor, each as in the single-tensor reference.
    w_a, w_b = [0.5, -1.5, 2.0], [0.25, -0.75]
    a, b = nn.Parameter(torch.tensor(w_a)), nn.Parameter(torch.tensor(w_b))
    opt = Lamb([a, b], lr=0.02, betas=(0.8, 0.95), weight_decay=0.1, max_trust_ratio=0.0)
    a.grad = torch.tensor(G1[:3])
    opt.step()
    a.grad, b.grad = torch.tensor(G2[:3]), torch.tensor(G2[3:])
    opt.step()
    common = dict(lr=0.02, b1=0.8, b2=0.95, eps=1e-6, wd=0.1, bias_correction=True, max_trust_ratio=0.0)
    np.testing.assert_allclose(a.detach().numpy(), lamb_reference(w_a, [G1[:3], G2[:3]], **common), rtol=2e-6)
    np.testing.assert_allclose(b.detach().numpy(), lamb_reference(w_b, [G2[3:]], **common), rtol=2e-6)
    assert (opt.state[a]["step"], opt.state[b]["step"]) == (2, 1)


# ------------------------------------------ LAMB variants against their references

FIXTURES = Path(__file__).parents[1] / "fixtures" / "optim"


@pytest.fixture(scope="module")
def real_gradients():
    """Initial weights and five steps of real BERT gradients (fixtures/optim/make_lamb_inputs.py)."""
    inputs = np.load(FIXTURES / "lamb_inputs.npz")
    return inputs, json.loads(str(inputs["meta"]))


def run_engine(train: TrainConfig, inputs, meta) -> list[tuple[float, dict[str, np.ndarray]]]:
    """Our optimizer, schedule and gradient clipping, as the training engine applies them to the
    fixture's gradients: (lr, weights after the step) per step. The loss sum(w · g) has gradient g."""
    model = BertForPreTraining(ModelConfig(**meta["model"]))
    model.load_state_dict({n: torch.from_numpy(inputs[f"init/{n}"]) for n in meta["names"]})
    optimizer = build_optimizer(model, train)
    engine = Engine(model, optimizer, build_scheduler(optimizer, train, train.steps),
                    lambda m, grads: {"loss": sum((p * grads[n]).sum() for n, p in m.named_parameters())},
                    "fp32", train.grad_clip)
    out = []
    for step in range(meta["steps"]):
        lr = engine.lr
        engine.step([{n: torch.from_numpy(inputs[f"grad/{step}/{n}"]) for n in meta["names"]}], 1, step)
        out.append((lr, {n: p.detach().double().numpy() for n, p in model.named_parameters()}))
    return out


def relative_errors(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> dict[str, float]:
    """max |got - want| / max |want| of each tensor."""
    return {n: float(np.abs(got[n] - want[n]).max() / np.abs(want[n]).max()) for n in want}


def mlperf_train(hyper: dict, **change) -> TrainConfig:
    return TrainConfig(**{**dict(
        lamb="mlperf", lr=hyper["learning_rate"], beta1=hyper["lamb_beta_1"], beta2=hyper["lamb_beta_2"],
        weight_decay=hyper["lamb_weight_decay_rate"], eps=10 ** hyper["log_epsilon"], grad_clip=1.0,
        schedule="poly_tf", steps=hyper["num_train_steps"], warmup_steps=hyper["num_warmup_steps"],
        start_warmup_step=hyper["start_warmup_step"], decay_power=hyper["poly_power"], end_lr=0.0), **change})


def test_mlperf_lamb_equals_the_tensorflow_reference(real_gradients):
    # fixtures/optim/make_lamb_fixture.py ran the MLPerf reference's create_optimizer (its
    # schedule, clip_by_global_norm and lamb_optimizer_v1) in TensorFlow on these gradients.
    inputs, meta = real_gradients
    ref = np.load(FIXTURES / "lamb_mlperf_reference.npz")
    hyper = json.loads(str(ref["meta"]))["hyperparameters"]
    steps = run_engine(mlperf_train(hyper), inputs, meta)
    for step, (lr, weights) in enumerate(steps):
        assert lr == pytest.approx(float(ref[f"lr/{step}"]), rel=1e-6), step
        want = {n: ref[f"after/{step}/{n}"].astype(np.float64) for n in meta["names"]}
        errors = relative_errors(weights, want)
        assert max(errors.values()) < 1e-5, (step, max(errors.items(), key=lambda kv: kv[1]))
    # The check can fail: the weights moved far beyond the tolerance, and our own LAMB
    # (trust ratio on LayerNorm and biases, clamp) or no clipping end elsewhere.
    moved = relative_errors({n: inputs[f"init/{n}"] for n in meta["names"]}, want)
    assert min(v for n, v in moved.items() if "bias" not in n) > 1e-4
    for other in (mlperf_train(hyper, lamb="bertforge"), mlperf_train(hyper, grad_clip=0.0)):
        assert max(relative_errors(run_engine(other, inputs, meta)[-1][1], want).values()) > 1e-2


def fused_lamb_reference(names, weights, decays, grads, lr, b1, b2, eps, max_grad_norm, use_nvlamb=False):
    """apex.optimizers.FusedLAMB.step (adam_w_mode, grad_averaging, bias correction) and its
    csrc/multi_tensor_lamb.cu, in float64: the global gradient norm clips inside the step."""
    w = {n: weights[n].astype(np.float64) for n in names}
    m = {n: np.zeros_like(w[n]) for n in names}
    v = {n: np.zeros_like(w[n]) for n in names}
    for t, g in enumerate(grads, start=1):
        g = {n: g[n].astype(np.float64) for n in names}
        global_norm = math.sqrt(sum(float((g[n] ** 2).sum()) for n in names))
        clipped = global_norm / max_grad_norm if global_norm > max_grad_norm else 1.0
        for n in names:
            scaled = g[n] / clipped
            m[n] = m[n] * b1 + (1 - b1) * scaled
            v[n] = v[n] * b2 + (1 - b2) * scaled * scaled
            update = (m[n] / (1 - b1 ** t)) / (np.sqrt(v[n] / (1 - b2 ** t)) + eps) + decays[n] * w[n]
            ratio = lr
            if use_nvlamb or decays[n] != 0:
                p_norm, u_norm = np.linalg.norm(w[n]), np.linalg.norm(update)
                ratio = lr * p_norm / u_norm if p_norm != 0 and u_norm != 0 else lr
            w[n] = w[n] - ratio * update
    return w


@pytest.mark.parametrize("weight_decay", [0.01, 0.0])
def test_nvidia_lamb_equals_fused_lamb(real_gradients, weight_decay):
    # DeepLearningExamples' BERT: FusedLAMB(groups, lr) with its defaults, decay 0.01 except
    # bias/LayerNorm. With weight decay 0 everywhere FusedLAMB adapts no tensor at all.
    inputs, meta = real_gradients
    names = meta["names"]
    train = TrainConfig(lamb="nvidia", lr=6e-3, weight_decay=weight_decay, grad_clip=1.0,
                        schedule="constant", steps=meta["steps"])
    got = run_engine(train, inputs, meta)[-1][1]
    model = BertForPreTraining(ModelConfig(**meta["model"]))
    decaying = {id(p) for p in param_groups(model, weight_decay)[0]["params"]}
    decays = {n: weight_decay if id(p) in decaying else 0.0 for n, p in model.named_parameters()}
    grads = [{n: inputs[f"grad/{k}/{n}"] for n in names} for k in range(meta["steps"])]
    args = (names, {n: inputs[f"init/{n}"] for n in names}, decays, grads, 6e-3, 0.9, 0.999, 1e-6, 1.0)
    assert max(relative_errors(got, fused_lamb_reference(*args)).values()) < 1e-5
    # use_nvlamb=True (adapt every tensor) is a different update: the comparison can fail.
    assert max(relative_errors(got, fused_lamb_reference(*args, use_nvlamb=True)).values()) > 1e-2


def paper_lamb_reference(names, weights, grads, lr, b1, b2, eps, wd):
    """You et al. 2019, Algorithm 2, per layer, float64, φ(z) = z and one λ for all layers."""
    x = {n: weights[n].astype(np.float64) for n in names}
    m = {n: np.zeros_like(x[n]) for n in names}
    v = {n: np.zeros_like(x[n]) for n in names}
    for t, g in enumerate(grads, start=1):
        for n in names:
            gt = g[n].astype(np.float64)
            m[n] = b1 * m[n] + (1 - b1) * gt
            v[n] = b2 * v[n] + (1 - b2) * gt ** 2
            r = (m[n] / (1 - b1 ** t)) / (np.sqrt(v[n] / (1 - b2 ** t)) + eps)
            step = r + wd * x[n]
            x[n] = x[n] - lr * np.linalg.norm(x[n]) / np.linalg.norm(step) * step
    return x


def test_paper_lamb_equals_algorithm_2(real_gradients):
    inputs, meta = real_gradients
    names = meta["names"]
    train = TrainConfig(lamb="paper", lr=0.01, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01,
                        grad_clip=0.0, schedule="constant", steps=meta["steps"])
    got = run_engine(train, inputs, meta)[-1][1]
    grads = [{n: inputs[f"grad/{k}/{n}"] for n in names} for k in range(meta["steps"])]
    want = paper_lamb_reference(names, {n: inputs[f"init/{n}"] for n in names}, grads, 0.01, 0.9, 0.999,
                                1e-6, 0.01)
    nonzero = [n for n in names if np.abs(want[n]).max() > 0]
    assert max(relative_errors({n: got[n] for n in nonzero}, {n: want[n] for n in nonzero}).values()) < 1e-5
    # Zero-initialised biases: φ(0) = 0, they stay exactly 0 (mlperf, nvidia, bertforge move them).
    assert "cls.predictions.bias" not in nonzero and not got["cls.predictions.bias"].any()
    assert run_engine(TrainConfig(**{**train.__dict__, "lamb": "mlperf"}), inputs, meta)[-1][1][
        "cls.predictions.bias"].any()


def test_lamb_variant_groups():
    groups = {v: build_optimizer(Tiny(), TrainConfig(lamb=v, weight_decay=0.1, max_trust_ratio=5.0)).param_groups
              for v in ("bertforge", "mlperf", "nvidia", "paper")}
    settings = {v: [(g["weight_decay"], g["layer_adaptation"], g["max_trust_ratio"], g["ratio_at_zero_norm"])
                    for g in gs] for v, gs in groups.items()}
    assert settings == {
        "bertforge": [(0.1, True, 5.0, 1.0), (0.0, True, 5.0, 1.0)],
        "mlperf": [(0.1, True, 0.0, 1.0), (0.0, False, 0.0, 1.0)],
        "nvidia": [(0.1, True, 0.0, 1.0), (0.0, False, 0.0, 1.0)],
        "paper": [(0.1, True, 0.0, 0.0), (0.1, True, 0.0, 0.0)],
    }
    nvidia_no_decay = build_optimizer(Tiny(), TrainConfig(lamb="nvidia", weight_decay=0.0)).param_groups
    mlperf_no_decay = build_optimizer(Tiny(), TrainConfig(lamb="mlperf", weight_decay=0.0)).param_groups
    assert [g["layer_adaptation"] for g in nvidia_no_decay] == [False, False]
    assert [g["layer_adaptation"] for g in mlperf_no_decay] == [True, False]


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("variant", ["bertforge", "mlperf", "nvidia", "paper"])
def test_lamb_step_has_no_per_tensor_loop(variant):
    # The operations one step dispatches do not grow with the number of tensors.
    def ops_of_a_step(tensors: int) -> list[str]:
        model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(tensors)])
        opt = build_optimizer(model, TrainConfig(lamb=variant, weight_decay=0.01))
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()  # creates the state
        with OpCounter() as counter:
            opt.step()
        return counter.ops

    few, many = ops_of_a_step(2), ops_of_a_step(40)
    assert len(few) == len(many) and few == many
    assert any("_foreach_norm" in op for op in few) and not any("linalg_vector_norm" in op for op in few)


def test_lamb_rejects_bad_arguments():
    p = [nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="max_trust_ratio"):
        Lamb(p, max_trust_ratio=-1.0)
    with pytest.raises(ValueError, match="betas"):
        Lamb(p, betas=(1.0, 0.999))


# ------------------------------------------------------------------ AdamW

def test_adamw_first_step_by_hand():
    # Bias-corrected first step: w -= lr · (sign(g) + wd · w)
    got = one_step(torch.optim.AdamW, [1.0, -2.0], [0.5, -0.25], lr=0.1, eps=1e-10,
                   weight_decay=0.01, foreach=True)
    assert got == pytest.approx([0.899, -1.898], rel=1e-6)
    # No bias correction: Adam direction sign(g) · 0.1 / sqrt(0.001) = 3.16227766 · sign(g)
    got = one_step(AdamWNoBiasCorrection, [1.0, -2.0], [0.5, -0.25], lr=0.1, eps=1e-10,
                   weight_decay=0.01)
    assert got == pytest.approx([1 - 0.1 * (0.1 / SQRT_0_001 + 0.01),
                                 -2 + 0.1 * (0.1 / SQRT_0_001 + 0.02)], rel=1e-6)
    assert got == pytest.approx([0.6827722340, -1.6817722340], rel=1e-6)


@pytest.mark.parametrize("weight_decay", [0.0, 0.01, 0.5])
def test_adamw_no_bias_correction_matches_google_bert(weight_decay):
    grads = [G1, G2, [0.3, -0.1, 0.2, 0.0, 0.6]]
    got = run_steps(AdamWNoBiasCorrection, W0, grads, lr=0.01, betas=(0.9, 0.999), eps=1e-6,
                    weight_decay=weight_decay)
    want = google_adam_weight_decay(W0, grads, learning_rate=0.01, beta_1=0.9, beta_2=0.999,
                                    epsilon=1e-6, weight_decay_rate=weight_decay)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    # and it differs from the bias-corrected AdamW
    corrected = adamw_reference(W0, grads, lr=0.01, b1=0.9, b2=0.999, eps=1e-6, wd=weight_decay)
    assert np.abs(got - corrected).max() > 1e-3


@pytest.mark.parametrize("bias_correction", [True, False])
def test_built_adamw_matches_numpy(bias_correction):
    train = TrainConfig(optimizer="adamw", lr=0.01, beta1=0.85, beta2=0.99, eps=1e-6,
                        weight_decay=0.1, bias_correction=bias_correction)
    model = nn.Linear(5, 1, bias=False)  # one parameter: "weight", decayed
    with torch.no_grad():
        model.weight.copy_(torch.tensor([W0]))
    opt = build_optimizer(model, train)
    for g in (G1, G2):
        model.weight.grad = torch.tensor([g])
        opt.step()
    got = model.weight.detach().double().numpy()[0]
    if bias_correction:
        want = adamw_reference(W0, [G1, G2], lr=0.01, b1=0.85, b2=0.99, eps=1e-6, wd=0.1)
    else:
        want = google_adam_weight_decay(W0, [G1, G2], learning_rate=0.01, beta_1=0.85, beta_2=0.99,
                                        epsilon=1e-6, weight_decay_rate=0.1)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


# ------------------------------------------------- groups and the builder

class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(3, 2)
        self.LayerNorm = nn.LayerNorm(2)
        self.frozen = nn.Linear(2, 2)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.frozen(self.LayerNorm(self.dense(x)))


def test_param_groups_split_by_name():
    model = Tiny()
    decay, no_decay = param_groups(model, 0.25)
    assert decay["weight_decay"] == 0.25 and no_decay["weight_decay"] == 0.0
    assert set(decay) == {"params", "weight_decay"} == set(no_decay)
    assert [id(p) for p in decay["params"]] == [id(model.dense.weight)]
    assert [id(p) for p in no_decay["params"]] == [
        id(model.dense.bias), id(model.LayerNorm.weight), id(model.LayerNorm.bias)]


def test_param_groups_on_bert():
    cfg = ModelConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                      intermediate_size=32, max_position_embeddings=16)
    model = BertForPreTraining(cfg)
    decay, no_decay = param_groups(model, 0.01)
    names = {id(p): n for n, p in model.named_parameters()}
    decay_names = {names[id(p)] for p in decay["params"]}
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    assert "bert.embeddings.word_embeddings.weight" in decay_names  # tied, listed once
    assert "bert.encoder.layer.0.attention.self.query.weight" in decay_names
    assert "cls.predictions.bias" in no_decay_names
    assert "bert.embeddings.LayerNorm.weight" in no_decay_names
    assert "bert.encoder.layer.0.output.LayerNorm.bias" in no_decay_names
    assert all(not n.endswith("bias") and "LayerNorm" not in n for n in decay_names)
    assert all(n.endswith("bias") or "LayerNorm" in n for n in no_decay_names)
    n_params = sum(p.numel() for p in model.parameters())
    assert sum(p.numel() for p in decay["params"] + no_decay["params"]) == n_params
    # 1 layer: 3 embeddings + q, k, v, attention out, intermediate, out, pooler,
    # head transform, NSP = 12 decayed matrices
    assert len(decay_names) == 12
    # The rule of at most one dimension changes nothing for BERT: its vectors are biases and LayerNorms.
    assert all(n.endswith("bias") or "LayerNorm" in n for n, p in model.named_parameters() if p.ndim <= 1)




@pytest.mark.parametrize("optimizer, bias_correction, factor", [
    ("lamb", True, 0.9),    # g = 0: u = wd·w, r = 1/wd = 2, w -= lr·2·wd·w = 0.1·w
    ("lamb", False, 0.9),
    ("adamw", True, 0.95),  # g = 0: w -= lr·wd·w = 0.05·w
    ("adamw", False, 0.95),
    ("stableadamw", True, 0.5),  # g = 0: rms 0, r = 1, w -= lr·(wd / max_lr)·w = wd·w
])
def test_built_optimizer_excludes_bias_and_layernorm_from_decay(optimizer, bias_correction, factor):
    torch.manual_seed(0)
    model = Tiny()
    with torch.no_grad():
        model.dense.bias.fill_(0.7)
        model.LayerNorm.weight.fill_(1.3)
        model.LayerNorm.bias.fill_(-0.4)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    train = TrainConfig(optimizer=optimizer, lr=0.1, weight_decay=0.5, bias_correction=bias_correction)
    opt = build_optimizer(model, train)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    opt.step()
    torch.testing.assert_close(model.dense.weight, factor * before["dense.weight"], rtol=1e-6, atol=0)
    for name in ("dense.bias", "LayerNorm.weight", "LayerNorm.bias", "frozen.weight", "frozen.bias"):
        assert torch.equal(dict(model.named_parameters())[name], before[name]), name


def test_build_optimizer_types_and_settings():
    model = Tiny()
    opt = build_optimizer(model, TrainConfig(optimizer="lamb", lr=2e-3, beta1=0.8, beta2=0.98, eps=1e-8,
                                             weight_decay=0.05, bias_correction=False,
                                             max_trust_ratio=3.0))
    assert type(opt) is Lamb
    g = opt.param_groups[0]
    assert (g["lr"], g["betas"], g["eps"], g["weight_decay"], g["bias_correction"],
            g["max_trust_ratio"]) == (2e-3, (0.8, 0.98), 1e-8, 0.05, False, 3.0)
    assert opt.param_groups[1]["weight_decay"] == 0.0
    adamw = build_optimizer(model, TrainConfig(optimizer="adamw"))
    assert type(adamw) is torch.optim.AdamW
    assert adamw.defaults["fused"] is True and not adamw.defaults["foreach"]  # on the CPU too
    assert type(build_optimizer(model, TrainConfig(optimizer="adamw", bias_correction=False))) \
        is AdamWNoBiasCorrection
    stable = build_optimizer(model, TrainConfig(optimizer="stableadamw", lr=8e-4, beta2=0.98, weight_decay=1e-5))
    assert type(stable) is StableAdamW
    g = stable.param_groups[0]
    assert (g["lr"], g["betas"], g["eps"], g["weight_decay"], g["decouple_lr"], g["max_lr"]) == (
        8e-4, (0.9, 0.98), 1e-6, 1e-5, True, 8e-4)
    assert stable.param_groups[1]["weight_decay"] == 0.0
    assert build_optimizer(model, TrainConfig(optimizer="stableadamw", decouple_lr=False)).defaults["decouple_lr"] \
        is False




@pytest.mark.parametrize("change, key", [
    (dict(optimizer="adagrad"), "train.optimizer"),
    (dict(beta1=1.0), "train.beta1"),
    (dict(beta2=-0.1), "train.beta2"),
    (dict(lr=-1.0), "train.lr"),
    (dict(eps=-1e-6), "train.eps"),
    (dict(weight_decay=-0.01), "train.weight_decay"),
    (dict(max_trust_ratio=-1.0), "train.max_trust_ratio"),
    (dict(lamb="apex"), "train.lamb"),
    (dict(lamb="mlperf", bias_correction=False), "train.bias_correction"),
    (dict(lamb="paper", bias_correction=False), "train.bias_correction"),
    (dict(optimizer="stableadamw", bias_correction=False), "train.bias_correction"),
    (dict(optimizer="stableadamw", lr=0.0), "train.lr"),
])
def test_build_optimizer_config_errors(change, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        build_optimizer(Tiny(), TrainConfig(**change))


# ------------------------------------------------------------- schedules

def test_poly_schedule_by_hand():
    train = TrainConfig(lr=1e-3, warmup_steps=10, schedule="poly", decay_power=1.0, end_lr=0.0)
    expected = {0: 1e-4, 4: 5e-4, 9: 1e-3, 10: 1e-3, 35: 7.5e-4, 60: 5e-4, 109: 1e-5, 110: 0.0, 500: 0.0}
    for step, lr in expected.items():
        assert lr_at(step, train, 110) == pytest.approx(lr, rel=1e-12, abs=1e-18), step


def test_poly_schedule_power_and_end_lr():
    # (1e-3 - 1e-4) · (1 - 0.5)² + 1e-4 = 3.25e-4
    train = TrainConfig(lr=1e-3, warmup_steps=10, schedule="poly", decay_power=2.0, end_lr=1e-4)
    assert lr_at(60, train, 110) == pytest.approx(3.25e-4, rel=1e-12)
    assert lr_at(110, train, 110) == pytest.approx(1e-4, rel=1e-12)
    assert lr_at(1000, train, 110) == pytest.approx(1e-4, rel=1e-12)


def test_warmup_proportion():
    # round(0.1 · 110) = 11 warm-up steps
    train = TrainConfig(lr=1e-3, warmup_proportion=0.1, schedule="poly")
    assert lr_at(0, train, 110) == pytest.approx(1e-3 / 11, rel=1e-12)
    assert lr_at(10, train, 110) == pytest.approx(1e-3, rel=1e-12)
    assert lr_at(60, train, 110) == pytest.approx(1e-3 * (1 - 49 / 99), rel=1e-12)
    # warmup_steps wins over warmup_proportion
    train.warmup_steps = 4
    assert lr_at(0, train, 110) == pytest.approx(2.5e-4, rel=1e-12)


def test_poly_warmup_longer_than_run():
    train = TrainConfig(lr=1e-3, warmup_steps=20, schedule="poly")
    assert lr_at(9, train, 10) == pytest.approx(5e-4, rel=1e-12)
    assert lr_at(20, train, 10) == 0.0


def test_exp_schedule_by_hand():
    train = TrainConfig(lr=1e-3, schedule="exp", exp_decay_rate=0.5, exp_decay_steps=100)
    assert lr_at(0, train, 1000) == pytest.approx(1e-3, rel=1e-12)
    assert lr_at(200, train, 1000) == pytest.approx(3.6787944117e-4, rel=1e-10)  # e^-1
    train.warmup_steps = 10
    assert lr_at(0, train, 1000) == pytest.approx(1e-4, rel=1e-12)
    assert lr_at(10, train, 1000) == pytest.approx(1e-3, rel=1e-12)
    assert lr_at(210, train, 1000) == pytest.approx(3.6787944117e-4, rel=1e-10)
    assert lr_at(110, train, 1000) == pytest.approx(6.0653065971e-4, rel=1e-10)  # e^-0.5


def test_table_schedule_by_hand():
    train = TrainConfig(lr=1e-3, schedule="table", warmup_steps=50,  # table ignores warm-up
                        lr_table={300: 1e-4, 0: 1e-3, 100: 5e-4})
    expected = {0: 1e-3, 1: 1e-3, 99: 1e-3, 100: 5e-4, 299: 5e-4, 300: 1e-4, 10_000: 1e-4}
    for step, lr in expected.items():
        assert lr_at(step, train, 1000) == lr, step


def test_constant_schedule_by_hand():
    train = TrainConfig(lr=1e-3, schedule="constant", warmup_steps=4)
    got = [lr_at(s, train, 100) for s in range(7)]
    assert got == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3, 1e-3], rel=1e-12)
    train.warmup_steps = 0
    assert lr_at(0, train, 100) == 1e-3


def test_poly_tf_schedule_by_hand():
    # The MLPerf reference: warm-up lr·(k - s)/W, then decay over the whole run (N = 10).
    train = TrainConfig(lr=1.0, warmup_steps=4, schedule="poly_tf", steps=10)
    got = [lr_at(k, train, 10) for k in range(12)]
    assert got == pytest.approx([0.0, 0.25, 0.5, 0.75, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0, 0.0], abs=1e-12)
    train.start_warmup_step = -2  # warm-up ends 2 steps early, at poly(2) = 0.8
    assert [lr_at(k, train, 10) for k in range(3)] == pytest.approx([0.5, 0.75, 0.8], abs=1e-12)
    # Our poly warms up to lr·(k + 1)/W and decays over the steps after warm-up.
    ours = TrainConfig(lr=1.0, warmup_steps=4, schedule="poly")
    assert [lr_at(k, ours, 10) for k in (0, 3, 4, 7)] == pytest.approx([0.25, 1.0, 1.0, 0.5], abs=1e-12)


def test_exp_staircase_schedule_by_hand():
    # Graphcore: lr·k/W up to k = W, then exp(-rate · floor((k - W) / decay_steps)).
    train = TrainConfig(lr=1.0, warmup_steps=4, schedule="exp_staircase", exp_decay_rate=0.5, exp_decay_steps=3)
    got = [lr_at(k, train, 100) for k in (0, 2, 4, 5, 6, 7, 9, 10)]
    e = math.exp
    assert got == pytest.approx([0.0, 0.5, 1.0, 1.0, 1.0, e(-0.5), e(-0.5), e(-1.0)], rel=1e-12)
    smooth = TrainConfig(lr=1.0, warmup_steps=4, schedule="exp", exp_decay_rate=0.5, exp_decay_steps=3)
    assert lr_at(5, smooth, 100) == pytest.approx(e(-0.5 / 3), rel=1e-12)
    train.warmup_steps = 0
    assert lr_at(0, train, 100) == 1.0


def test_wsd_schedule_by_hand():
    # W = 4, D = 4 of N = 10, E = 0.2·L; step k runs at the value for j = max(k - 1, 0) steps done.
    train = TrainConfig(lr=1.0, schedule="wsd", warmup_steps=4, decay_steps=4, end_lr=0.2)
    got = [lr_at(k, train, 10) for k in range(10)]
    start = 1e-10  # the warm-up is a + (j / W)(1 - a) from a = 1e-10
    warmup = [start + j / 4 * (1 - start) for j in (0, 0, 1, 2, 3)]
    assert got == pytest.approx(warmup + [1.0, 1.0, 1.0, 0.8, 0.6], rel=1e-12)
    # No decay (ModernBERT's pre-training): the peak to the end. No warm-up: the peak from the start.
    assert lr_at(9, TrainConfig(lr=1.0, schedule="wsd", warmup_steps=4), 10) == 1.0
    assert lr_at(0, TrainConfig(lr=1.0, schedule="wsd"), 10) == 1.0
    # Shares of the run are truncated, as Composer converts "0.25dur": W = int(2.5) = 2, D = int(3.0000000000000004).
    shares = TrainConfig(lr=1.0, schedule="wsd", warmup_proportion=0.25, decay_proportion=0.3)
    assert [lr_at(k, shares, 10) for k in (2, 3, 8, 9)] == pytest.approx([0.5, 1.0, 1.0, 2 / 3], rel=1e-9)


def composer_wsd(done: int, warmup: int, decay: int, total: int, alpha_f: float) -> float:
    """ModernBERT's WarmupStableDecayScheduler (src/scheduler.py) at a timestamp of ``done`` batches,
    transcribed: Composer's LinearScheduler(alpha_i=1e-10, alpha_f=1.0, t_max=t_warmup) while
    timestamp < t_warmup, 1.0 while timestamp < t_max - t_decay, then the linear decay, clipped at 0.
    Composer divides Time values as Python numbers (Time.__truediv__)."""
    if done < warmup:
        frac_of_total = min(1.0, done / warmup)
        return 1e-10 + frac_of_total * (1.0 - 1e-10)
    if done < total - decay:
        return 1.0
    current_decay_fraction = (done - (total - decay)) / decay
    return max(0.0, 1 - current_decay_fraction * (1 - alpha_f))


def composer_one_minus_sqrt(done: int, decay: int, total: int, alpha_f: float) -> float:
    """ModernBERT's OneMinusSqrtScheduler (src/scheduler.py, 8c57a0f) at a timestamp of ``done`` batches,
    transcribed: 1.0 while timestamp <= t_max - t_decay, then alpha_f + (1 - alpha_f)(1 - sqrt(the share of
    the decay done)), never below alpha_f."""
    if done <= total - decay:
        return 1.0
    relative_time = (done - (total - decay)) / decay
    return max(alpha_f, alpha_f + (1 - alpha_f) * (1 - math.sqrt(relative_time)))


def composer_lrs(lr: float, total: int, scheduler: Callable[[int], float]) -> list[float]:
    """The lr of each batch as Composer's trainer runs ``scheduler`` (of the batches done) through
    compile_composer_scheduler, a LambdaLR (Trainer._train_loop of mosaicml 0.24.1, which ModernBERT
    pins): the LambdaLR evaluates it once when made, at timestamp 0, then after each batch
    scheduler.step() evaluates it before timestamp.to_next_batch counts that batch."""
    timestamp, multiplier, lrs = 0, scheduler(0), []
    for _ in range(total):
        lrs.append(lr * multiplier)  # the batch trains
        multiplier = scheduler(timestamp)  # scheduler.step()
        timestamp += 1  # state.timestamp.to_next_batch()
    return lrs


@pytest.mark.parametrize("change, warmup, decay", [
    (dict(warmup_steps=5, decay_steps=6), 5, 6),
    (dict(warmup_steps=5), 5, 0),  # ModernBERT's pre-training: t_decay 0
    (dict(decay_steps=40), 0, 40),  # the whole run decays
    (dict(warmup_steps=1, decay_steps=39, end_lr=2e-4), 1, 39),
    (dict(warmup_proportion=0.25, decay_proportion=0.1, end_lr=8e-5), 10, 4),  # int(0.25 · 40), int(0.1 · 40)
    (dict(warmup_proportion=0.07, decay_proportion=0.3), 2, 12),  # int(2.8), int(12.000000000000002)
])
def test_wsd_equals_modernbert_warmup_stable_decay(change, warmup, decay):
    train = TrainConfig(lr=8e-4, schedule="wsd", **change)
    want = composer_lrs(8e-4, 40, lambda done: composer_wsd(done, warmup, decay, 40, train.end_lr / train.lr))
    assert [lr_at(k, train, 40) for k in range(40)] == pytest.approx(want, rel=1e-15, abs=0)


@pytest.mark.parametrize("change, decay", [
    (dict(decay_steps=10), 10),  # ModernBERT's context extension: stable, then the last steps decay
    (dict(decay_steps=40), 40),  # the whole run decays
    (dict(decay_steps=7, end_lr=8e-5), 7),
    (dict(decay_proportion=0.3, end_lr=2e-4), 12),  # int(12.000000000000002)
])
def test_one_minus_sqrt_decay_equals_modernbert_one_minus_sqrt(change, decay):
    train = TrainConfig(lr=8e-4, schedule="wsd", decay_shape="one_minus_sqrt", **change)
    want = composer_lrs(8e-4, 40, lambda done: composer_one_minus_sqrt(done, decay, 40, train.end_lr / train.lr))
    got = [lr_at(k, train, 40) for k in range(40)]
    assert got == pytest.approx(want, rel=1e-15, abs=0)
    linear = [lr_at(k, TrainConfig(lr=8e-4, schedule="wsd", **change), 40) for k in range(40)]
    assert got[-decay // 2] < linear[-decay // 2]  # 1 - sqrt falls fast, then slowly: below the line mid-decay


def test_a_decay_shape_is_read_only_by_wsd():
    with pytest.raises(ConfigError, match=r"^train.decay_shape is given but train.schedule=poly: it is read only "
                                          r"with train.schedule wsd"):
        load_config(None, [("train.decay_shape", "one_minus_sqrt")])


SCHEDULE_CASES = json.loads((FIXTURES / "schedule_reference.json").read_text())["cases"]


@pytest.mark.parametrize("case", SCHEDULE_CASES,
                         ids=[f"{c['schedule']}-{c['source']}-{i}" for i, c in enumerate(SCHEDULE_CASES)])
def test_schedule_equals_its_reference(case):
    # fixtures/optim/make_schedule_fixture.py: the MLPerf reference's lr tensor and
    # tf.compat.v1.train.polynomial_decay run by TensorFlow (float32, hence the
    # tolerance of 1e-6 of the peak lr), and Graphcore's natural_exponential schedule.
    train = TrainConfig(schedule=case["schedule"], **case["train"])
    got = [lr_at(k, train, train.steps) for k in case["steps"]]
    np.testing.assert_allclose(got, case["lr"], rtol=0, atol=1e-6 * max(case["lr"]))


def test_poly_tf_equals_tensorflow():
    tf = pytest.importorskip("tensorflow")
    for lr, steps, end_lr, power in [(0.001, 40, 1e-5, 1.0), (0.003, 25, 1e-4, 0.5), (0.02, 13, 0.0, 2.0)]:
        train = TrainConfig(lr=lr, steps=steps, end_lr=end_lr, decay_power=power, schedule="poly_tf")
        want = [float(tf.compat.v1.train.polynomial_decay(lr, k, steps, end_learning_rate=end_lr, power=power,
                                                          cycle=False)()) for k in range(steps + 2)]
        got = [lr_at(k, train, steps) for k in range(steps + 2)]
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * lr)


@pytest.mark.parametrize("change, key", [
    (dict(schedule="cosine"), "train.schedule"),
    (dict(schedule="table", lr_table={}), "train.lr_table"),
    (dict(schedule="table", lr_table={5: 1e-3}), "train.lr_table"),
    (dict(schedule="table", lr_table={0: 1e-3, 5: -1e-3}), "train.lr_table"),
    (dict(warmup_steps=-1), "train.warmup_steps"),
    (dict(warmup_proportion=1.5), "train.warmup_proportion"),
    (dict(warmup_proportion=-0.1), "train.warmup_proportion"),
    (dict(lr=-1e-3), "train.lr"),
    (dict(schedule="poly", decay_power=-1.0), "train.decay_power"),
    (dict(schedule="poly", end_lr=-1e-5), "train.end_lr"),
    (dict(schedule="exp", exp_decay_steps=0), "train.exp_decay_steps"),
    (dict(schedule="exp", exp_decay_rate=-0.5), "train.exp_decay_rate"),
    (dict(schedule="exp_staircase", exp_decay_steps=0), "train.exp_decay_steps"),
    (dict(schedule="poly_tf", end_lr=-1e-5), "train.end_lr"),
    (dict(schedule="poly_tf", start_warmup_step=3), "train.start_warmup_step"),
    (dict(schedule="wsd", end_lr=-1e-5), "train.end_lr"),
    (dict(schedule="wsd", decay_steps=-1), "train.decay_steps"),
    (dict(schedule="wsd", decay_steps=101), "train.decay_steps"),
    (dict(schedule="wsd", decay_proportion=1.5), "train.decay_proportion"),
    (dict(schedule="wsd", warmup_steps=50, decay_steps=51), "train.warmup_steps and train.decay_steps"),
    (dict(schedule="wsd", warmup_proportion=0.5, decay_proportion=0.6), "train.warmup_proportion and "
                                                                        "train.decay_proportion"),
])
def test_schedule_config_errors(change, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        lr_at(0, TrainConfig(**change), 100)


def test_schedule_rejects_bad_steps():
    with pytest.raises(ConfigError, match="total_steps"):
        lr_at(0, TrainConfig(), 0)
    with pytest.raises(ValueError, match="step"):
        lr_at(-1, TrainConfig(), 100)
    with pytest.raises(ConfigError, match=r"train\.lr"):
        build_scheduler(Lamb([nn.Parameter(torch.zeros(1))], lr=0.0), TrainConfig(lr=0.0), 100)


# ------------------------------------- optimizer + scheduler integration

def record_lrs(opt) -> list[float]:
    """The lr of group 0 at the moment each optimizer.step() runs."""
    lrs: list[float] = []
    opt.register_step_pre_hook(lambda o, args, kwargs: lrs.append(o.param_groups[0]["lr"]))
    return lrs


def make_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 3, generator=gen), torch.randn(8, 2, generator=gen)


def train_steps(model, opt, sched, steps) -> None:
    for step in steps:
        x, y = make_batch(step)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        sched.step()


@pytest.mark.parametrize("schedule", ["poly", "poly_tf", "exp", "exp_staircase", "table", "constant", "wsd"])
def test_scheduler_gives_lr_at_each_step(schedule):
    train = TrainConfig(lr=1e-3, warmup_steps=5, schedule=schedule, exp_decay_steps=10,
                        lr_table={0: 1e-3, 7: 4e-4, 12: 2e-4}, decay_steps=6)
    torch.manual_seed(0)
    model = Tiny()
    opt = build_optimizer(model, train)
    sched = build_scheduler(opt, train, total_steps=20)
    lrs = record_lrs(opt)
    train_steps(model, opt, sched, range(20))
    want = [lr_at(k, train, 20) for k in range(20)]
    assert lrs == pytest.approx(want, rel=1e-12, abs=1e-20)
    assert [g["lr"] for g in opt.param_groups][1] == opt.param_groups[0]["lr"]  # both groups follow
    if schedule == "poly":  # spot checks by hand: warm-up 5, linear decay over 15 steps
        assert lrs[0] == pytest.approx(2e-4, rel=1e-12)
        assert lrs[4] == pytest.approx(1e-3, rel=1e-12)
        assert lrs[8] == pytest.approx(8e-4, rel=1e-12)
        assert lrs[19] == pytest.approx(1e-3 / 15, rel=1e-12)
    if schedule == "table":
        assert lrs[6:8] == pytest.approx([1e-3, 4e-4], rel=1e-12)
    if schedule == "wsd":  # warm-up 5 a step late, stable, then 6 steps of decay to 0 from step 15
        assert lrs[:3] == pytest.approx([1e-13, 1e-13, 2e-4], rel=1e-9)
        assert lrs[6:15] == [1e-3] * 9 and lrs[19] == pytest.approx(1e-3 / 3, rel=1e-12)


def test_scheduler_ignores_later_config_edits():
    train = TrainConfig(lr=1e-3, schedule="constant")
    opt = Lamb([nn.Parameter(torch.zeros(1))], lr=1e-3)
    sched = build_scheduler(opt, train, 10)
    train.lr = 5.0
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3, rel=1e-12)


@pytest.mark.parametrize("optimizer, bias_correction, schedule", [
    ("lamb", True, "poly"), ("lamb", False, "poly"), ("adamw", True, "poly"), ("adamw", False, "poly"),
    ("stableadamw", True, "wsd")])
def test_resume_is_bit_identical(tmp_path, optimizer, bias_correction, schedule):
    train = TrainConfig(optimizer=optimizer, bias_correction=bias_correction, lr=1e-2,
                        weight_decay=0.01, warmup_steps=3, schedule=schedule, decay_steps=4)
    total, cut = 12, 5

    def fresh(seed):
        torch.manual_seed(seed)
        model = Tiny()
        opt = build_optimizer(model, train)
        return model, opt, build_scheduler(opt, train, total)

    # Uninterrupted run.
    model, opt, sched = fresh(0)
    lrs_full = record_lrs(opt)
    train_steps(model, opt, sched, range(total))

    # The same run, saved after `cut` steps and continued in fresh objects.
    model1, opt1, sched1 = fresh(0)
    lrs_resumed = record_lrs(opt1)
    train_steps(model1, opt1, sched1, range(cut))
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model1.state_dict(), "optimizer": opt1.state_dict(),
                "scheduler": sched1.state_dict()}, path)
    del model1, opt1, sched1

    ckpt = torch.load(path, weights_only=True)
    model2, opt2, sched2 = fresh(1)  # different init: everything must come from the file
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["optimizer"])
    sched2.load_state_dict(ckpt["scheduler"])
    lrs_after = record_lrs(opt2)
    train_steps(model2, opt2, sched2, range(cut, total))

    assert len(lrs_resumed) == cut
    assert lrs_resumed + lrs_after == lrs_full  # exact floats
    assert lrs_full == pytest.approx([lr_at(k, train, total) for k in range(total)], rel=1e-12)
    for (name, a), b in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(a, b), name
    steps = [int(s["step"]) for s in opt2.state_dict()["state"].values()]
    assert steps == [total] * 4  # the trainable dense and LayerNorm tensors


def test_lamb_mixed_dtypes_in_one_group():
    # float32 and float64 tensors go to separate _foreach calls; each still
    # gets the hand-computed first step w -= 0.1 · 5/sqrt(2) · sign(g).
    a = nn.Parameter(torch.tensor([3.0, 4.0]))
    b = nn.Parameter(torch.tensor([3.0, 4.0], dtype=torch.float64))
    opt = Lamb([a, b], lr=0.1, eps=1e-10)
    a.grad = torch.tensor([0.5, -2.0])
    b.grad = torch.tensor([0.5, -2.0], dtype=torch.float64)
    opt.step()
    assert a.dtype == torch.float32 and b.dtype == torch.float64
    assert a.tolist() == pytest.approx([2.6464466094, 4.3535533906], rel=1e-6)
    assert b.tolist() == pytest.approx([2.6464466094, 4.3535533906], rel=1e-9)


# ------------------------------------------------------------ the compiled step

class Adapted(nn.Module):
    """Tensors for the compiled step: a decayed matrix large enough for the clamp of r to bind,
    zero biases (||w|| = 0) and a LayerNorm weight that gets zero gradients (||u|| = 0)."""

    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(16, 8)
        self.LayerNorm = nn.LayerNorm(8)
        self.out = nn.Linear(8, 4)
        with torch.no_grad():
            self.dense.weight.mul_(50.0)
            self.out.bias.zero_()


COMPILED_CASES = {
    "bertforge": dict(lamb="bertforge", max_trust_ratio=2.0),
    "bertforge_no_bias_correction": dict(lamb="bertforge", max_trust_ratio=2.0, bias_correction=False),
    "mlperf": dict(lamb="mlperf"),
    "nvidia_no_bias_correction": dict(lamb="nvidia", bias_correction=False),
    "nvidia_no_decay": dict(lamb="nvidia", weight_decay=0.0),  # no tensor adapts: r = 1 everywhere
    "paper": dict(lamb="paper"),
    "adamw_no_bias_correction": dict(optimizer="adamw", bias_correction=False),
    "stableadamw": dict(optimizer="stableadamw"),  # λ = wd / lr = 1; rms 0 to 1.14: the clip binds here and there
}
# What the compiled step may differ from the eager one by, per tensor: max |difference| in units of
# float32's epsilon times the tensor's largest magnitude. Eager kernels fuse multiply and add where
# Inductor rounds twice, Inductor sums the norms in another order and the compiled step rounds
# v = b2 v + (1 - b2) g² as a lerp. Largest seen after 6 steps: weights 1.4, m 0.9, v 3.1.
BOUND = 8.0


def compiled_train(**change) -> TrainConfig:
    return TrainConfig(**{**dict(lr=1e-2, weight_decay=0.01, warmup_steps=3, schedule="poly"), **change})


def adapted_gradients(model: nn.Module, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    for p in model.parameters():
        p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(p.device)
    model.LayerNorm.weight.grad.zero_()


def adapted_run(train: TrainConfig, compiled: bool, steps: range, model=None, opt=None, sched=None,
                device: str = "cpu"):
    """``steps`` optimizer steps of Adapted with fixed gradients (a fresh model unless given).
    On CUDA the compiled steps after the first must not wait for the device."""
    if model is None:
        torch.manual_seed(0)
        model = Adapted().to(device)
        opt = build_optimizer(model, train, compiled=compiled)
        sched = build_scheduler(opt, train, 10)
    for step in steps:
        adapted_gradients(model, step)
        later, watch = step > steps[0], device == "cuda" and compiled
        if watch:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error" if later else "default")
        try:
            # Every step has its own lr and bias corrections: after the first, nothing compiles again.
            with torch.compiler.set_stance("fail_on_recompile" if later else "default"):
                opt.step()
        finally:
            if watch:
                torch.cuda.set_sync_debug_mode("default")
        sched.step()
    return model, opt, sched


def float32_units(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / (float32 eps · max |want|): 1 is one rounding at the tensor's scale."""
    scale = want.abs().max().clamp_min(torch.finfo(torch.float32).tiny)
    return ((got - want).abs().max() / (torch.finfo(torch.float32).eps * scale)).item()


def worst_units(model_a, opt_a, model_b, opt_b) -> float:
    """The largest float32_units over weights and moments."""
    units = []
    for a, b in zip(model_a.parameters(), model_b.parameters()):
        units.append(float32_units(b.detach(), a.detach()))
        units += [float32_units(opt_b.state[b][k], opt_a.state[a][k]) for k in ("exp_avg", "exp_avg_sq")]
    return max(units)


@pytest.mark.slow
@pytest.mark.parametrize("case", COMPILED_CASES)
def test_compiled_step_equals_the_eager_step(case):
    train = compiled_train(**COMPILED_CASES[case])
    eager, eager_opt, _ = adapted_run(train, False, range(6))
    model, opt, _ = adapted_run(train, True, range(6))
    assert type(opt) is type(eager_opt) and opt.compiled and not eager_opt.compiled
    assert worst_units(eager, eager_opt, model, opt) <= BOUND
    assert [s["step"] for s in opt.state.values()] == [6] * 6
    torch.manual_seed(0)
    start = Adapted()  # the weights before the first step
    moved = [float32_units(p.detach(), w.detach()) for p, w in zip(model.parameters(), start.parameters())]
    assert sorted(moved)[2] > 1e3  # the steps moved the weights far beyond the bound
    if case == "paper":  # r = 0 at a zero tensor: the zero biases never move
        assert not model.out.bias.any()
    if case == "bertforge":  # the clamp binds: without it the weights end elsewhere
        unclamped, *_ = adapted_run(compiled_train(**{**COMPILED_CASES[case], "max_trust_ratio": 0.0}), False,
                                    range(6))
        assert float32_units(unclamped.dense.weight.detach(), model.dense.weight.detach()) > 1e3


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", ["bertforge", "mlperf", "stableadamw"])
def test_compiled_step_on_cuda_equals_the_eager_step_without_host_syncs(case):
    train = compiled_train(**COMPILED_CASES[case])
    eager, eager_opt, _ = adapted_run(train, False, range(6), device="cuda")
    model, opt, _ = adapted_run(train, True, range(6), device="cuda")  # steps 2 to 6 under sync errors
    assert worst_units(eager, eager_opt, model, opt) <= BOUND
    assert all(p.is_cuda for p in model.parameters())


def test_the_optimizer_compiles_where_the_model_compiles_on_cuda():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert compiles_optimizer(ExecutionConfig(), cuda) and not compiles_optimizer(ExecutionConfig(), cpu)
    # On the CPU Inductor compiles a C++ loop per tensor: minutes for BERT-base, not worth it.
    assert not compiles_optimizer(ExecutionConfig(compile=True), cpu)
    assert not compiles_optimizer(ExecutionConfig(compile=False), cuda)
    assert not compiles_optimizer(ExecutionConfig(offload=True), cuda)  # the step runs on the host


@pytest.mark.parametrize("first, then", [(True, False), (False, True)])
def test_compiled_and_eager_steps_resume_each_other(tmp_path, first, then):
    train = compiled_train(lamb="bertforge", max_trust_ratio=2.0)
    model, opt, sched = adapted_run(train, first, range(3))
    torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "model": model.state_dict()},
               tmp_path / "ckpt.pt")
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert all(type(s["step"]) is int for s in saved["optimizer"]["state"].values())  # the eager format
    model2 = Adapted()
    opt2 = build_optimizer(model2, train, compiled=then)
    sched2 = build_scheduler(opt2, train, 10)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["optimizer"])
    sched2.load_state_dict(saved["scheduler"])
    adapted_run(train, then, range(3, 6), model2, opt2, sched2)
    whole, whole_opt, _ = adapted_run(train, False, range(6))
    assert worst_units(whole, whole_opt, model2, opt2) <= BOUND
    assert opt2.compiled == then and [s["step"] for s in opt2.state.values()] == [6] * 6


# ------------------------------------------------------------ skipping a step on the device

# (train changes, compiled): ours in both steps, torch's fused AdamW and SGD
SKIPPING_CASES = {
    **{f"{name}_{kind}": (COMPILED_CASES[name], kind == "compiled")
       for name in ("bertforge", "mlperf", "adamw_no_bias_correction", "stableadamw")
       for kind in ("eager", "compiled")},
    "torch_adamw": (dict(optimizer="adamw"), False),
    "torch_sgd": (dict(optimizer="sgd", momentum=0.9), False),
}


@pytest.mark.parametrize("case", SKIPPING_CASES)
def test_found_inf_skips_the_step_on_the_device(case):
    """The engine's way to skip a non-finite step without reading the flag on the host (found_inf, as
    torch's fused optimizers take it): clear, the step is the step without it, bit for bit; set, NaN
    gradients leave weights and moments exactly as they were."""
    change, compiled = SKIPPING_CASES[case]
    train = compiled_train(**change)
    model, opt, sched = adapted_run(train, compiled, range(2))
    assert skips_on_device(opt)
    opt.found_inf, opt.grad_scale = torch.zeros(()), None
    adapted_run(train, compiled, range(2, 3), model, opt, sched)
    plain, plain_opt, _ = adapted_run(train, compiled, range(3))

    def state(model, opt):
        return [t.detach().clone() for p in model.parameters() for t in (p, *opt.state[p].values())
                if isinstance(t, torch.Tensor) and t.dim() > 0]

    assert all(torch.equal(a, b) for a, b in zip(state(model, opt), state(plain, plain_opt), strict=True))
    before = state(model, opt)
    for p in model.parameters():
        p.grad = torch.full_like(p, float("nan"))
    opt.found_inf = torch.ones(())
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(state(model, opt), before, strict=True))


# ------------------------------------------------------------ StableAdamW (ModernBERT's optimizer)

@pytest.mark.parametrize("decouple_lr, factor", [(True, 0.5), (False, 0.95)])
def test_stableadamw_first_step_by_hand(decouple_lr, factor):
    # Step 1: m̂ = g, v̂ = g², so rms = 1 and lr_t = lr; the decay factor is 1 - (lr / max_lr)·wd = 0.5
    # decoupled from the lr, else 1 - lr·wd = 0.95.
    got = one_step(StableAdamW, W0, G1, lr=0.1, eps=1e-6, weight_decay=0.5, decouple_lr=decouple_lr)
    w, g = np.array(W0), np.array(G1)
    np.testing.assert_allclose(got, factor * w - 0.1 * g / (np.abs(g) + 1e-6), rtol=1e-6)


# What ours may differ from optimi's StableAdamW by after 10 steps, in float32_units of each tensor
# (weights, and the bias-corrected moments, which optimi keeps): optimi moves m̂ and v̂ by debiased
# betas, rounds w twice a step where it decays and divides the lr by rms in float64 (largest seen
# over the cases below: weights 2.9, moments 2.2).
OPTIMI_BOUND = 4.0
GRAD_SCALES = {
    "binds": [1e-3] * 4 + [1e-1] + [1e-3] * 5,  # a jump: g² / v̂ ≫ 1 at step 4, and after it
    "idle": [0.5 ** k for k in range(10)],  # shrinking gradients: g² / v̂ < 1, rms ≤ 1 throughout
}


def stable_run(train: TrainConfig, make_optimizer, grad_scales: list[float]):
    """Adapted trained for len(grad_scales) steps on fixed gradients, under build_scheduler's LambdaLR."""
    torch.manual_seed(0)
    model = Adapted()
    optimizer = make_optimizer(model)
    scheduler = build_scheduler(optimizer, train, len(grad_scales))
    for step, scale in enumerate(grad_scales):
        gen = torch.Generator().manual_seed(step)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen) * scale
        optimizer.step()
        scheduler.step()
    return model, optimizer


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")  # optimi's on foreach and high wd
@pytest.mark.parametrize("weight_decay", [0.0, 1e-5, 0.1])
@pytest.mark.parametrize("clipping", GRAD_SCALES)
@pytest.mark.parametrize("foreach", [False, True], ids=["optimi_loop", "optimi_foreach"])
def test_stableadamw_equals_optimi(weight_decay, clipping, foreach):
    """train.optimizer stableadamw against optimi's StableAdamW(decouple_lr=True) as ModernBERT builds it
    (main.py's decoupled_stableadamw, the yaml's lr, betas, eps): 10 steps under a wsd schedule that
    changes the lr every step, by optimi's for-loop and its multi-tensor step (which ModernBERT's
    src/optimizer.py, used for its runs, equals bit for bit). ``binds``: the clipping binds, so the
    weights end far from AdamW's; ``idle``: it never does, and the step is torch's AdamW with weight
    decay wd / max_lr."""
    import optimi

    train = TrainConfig(optimizer="stableadamw", lr=8e-4, beta1=0.9, beta2=0.98, eps=1e-6,
                        weight_decay=weight_decay, schedule="wsd", warmup_steps=3, decay_steps=5)
    ours, ours_opt = stable_run(train, lambda model: build_optimizer(model, train), GRAD_SCALES[clipping])
    theirs, theirs_opt = stable_run(train, lambda model: optimi.StableAdamW(
        param_groups(model, weight_decay), lr=8e-4, betas=(0.9, 0.98), eps=1e-6, weight_decay=weight_decay,
        decouple_lr=True, foreach=foreach, triton=False), GRAD_SCALES[clipping])
    units = []
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        state, theirs_state = ours_opt.state[a], theirs_opt.state[b]
        t = state["step"]
        units += [float32_units(a.detach(), b.detach()),
                  float32_units(state["exp_avg"] / (1 - 0.9 ** t), theirs_state["exp_avg"]),
                  float32_units(state["exp_avg_sq"] / (1 - 0.98 ** t), theirs_state["exp_avg_sq"])]
    assert max(units) <= OPTIMI_BOUND
    adamw, _ = stable_run(train, lambda model: torch.optim.AdamW(
        param_groups(model, weight_decay / train.lr), lr=8e-4, betas=(0.9, 0.98), eps=1e-6), GRAD_SCALES[clipping])
    apart = max(float32_units(a.detach(), b.detach()) for a, b in zip(ours.parameters(), adamw.parameters()))
    torch.manual_seed(0)
    assert min(float32_units(a.detach(), b.detach()) for a, b in zip(ours.parameters(), Adapted().parameters())) > 1e3
    if clipping == "binds":
        assert apart > 1e3
    else:
        assert apart <= OPTIMI_BOUND


# ------------------------------------------------------------ SGD and momentum

@pytest.mark.parametrize(("momentum", "nesterov"), [(0.0, False), (0.9, False), (0.9, True)])
def test_sgd_equals_torch_sgd_with_no_decay_on_biases_and_layernorms(momentum, nesterov):
    """train.optimizer sgd: torch.optim.SGD (L2 weight decay added to the gradient, as torch does),
    over the two parameter groups every optimizer here uses: biases and LayerNorms undecayed."""
    from bertforge.config import ModelConfig, TrainConfig
    from bertforge.models.bert import BertForPreTraining
    from bertforge.training.optim import build_optimizer

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                      max_position_embeddings=16)
    ours = BertForPreTraining(cfg).eval()  # eval: no dropout draws
    train = TrainConfig(optimizer="sgd", lr=0.1, weight_decay=0.01, momentum=momentum, nesterov=nesterov)
    optimizer = build_optimizer(ours, train)
    # torch's fused kernel (ours) compares bit for bit; its unfused loop within a few float32 units, since
    # the fused multiply-adds round differently on CPUs with FMA (AVX-512 EPYCs, for one).
    fused, loop = BertForPreTraining(cfg).eval(), BertForPreTraining(cfg).eval()

    def reference(model, **kernel):
        model.load_state_dict(ours.state_dict())
        named = list(model.named_parameters())
        plain = [p for n, p in named if n.endswith("bias") or "LayerNorm" in n]
        decayed = [p for n, p in named if not (n.endswith("bias") or "LayerNorm" in n)]
        assert plain and decayed
        return torch.optim.SGD([{"params": decayed, "weight_decay": 0.01}, {"params": plain, "weight_decay": 0.0}],
                               lr=0.1, momentum=momentum, nesterov=nesterov, **kernel)

    runs = ((ours, optimizer), (fused, reference(fused, fused=True)), (loop, reference(loop, foreach=False)))
    ids = torch.randint(0, 64, (2, 8))
    for _ in range(3):
        for model, opt in runs:
            opt.zero_grad()
            mlm, nsp = model(ids)
            (mlm.square().mean() + nsp.square().mean()).backward()
            opt.step()
    for (name, a), b, c in zip(ours.state_dict().items(), fused.state_dict().values(), loop.state_dict().values(),
                               strict=True):
        assert torch.equal(a, b), name
        torch.testing.assert_close(a, c, rtol=4 * 2.0**-23, atol=1e-7, msg=name)


def test_sgd_with_momentum_resumes_exactly(tmp_path):
    """A run with SGD and momentum, resumed from its step-2 checkpoint, continues with the losses
    and weights of an uninterrupted run: the momentum buffers are in the checkpoint."""
    from test_preemption import losses, run_args

    from bertforge.cli import main
    from bertforge.formats.load import load_model

    sgd = ["--train.optimizer", "sgd", "--train.momentum", "0.9", "--train.lr", "0.05", "--checkpoint.every", "2"]
    assert main(run_args(tmp_path, "whole", 4, *sgd)) == 0
    assert main(run_args(tmp_path, "cut", 2, *sgd)) == 0
    assert main(["pretrain", "--resume", str(tmp_path / "cut"), "--steps", "4", "--no-progress"]) == 0
    assert losses(tmp_path / "cut") == losses(tmp_path / "whole")
    assert losses(tmp_path / "whole")[-1] != losses(tmp_path / "whole")[0]
    resumed, whole = load_model(tmp_path / "cut").state_dict(), load_model(tmp_path / "whole").state_dict()
    assert all(torch.equal(v, whole[k]) for k, v in resumed.items())


@pytest.mark.parametrize("variant", ["sgd", "momentum", "nesterov"])
def test_sgd_and_momentum_equal_graphcore_tf1_application(variant):
    """Graphcore's TF1 BERT application: tf.train.GradientDescentOptimizer / MomentumOptimizer on the lr
    divided by the loss scale, fed loss-scaled gradients, no weight decay and no clipping. Ours with
    train.weight_decay 0 and train.grad_clip 0 on the true gradients, at the same lr each step:
    equal to real TensorFlow's weights at every step (tests/fixtures/optim/make_momentum_fixture.py)."""
    from bertforge.config import TrainConfig
    from bertforge.training.optim import build_optimizer

    ref = np.load(FIXTURES / "momentum_tf1_reference.npz")
    model = torch.nn.Module()
    for name in ("kernel", "bias"):
        model.register_parameter(name, torch.nn.Parameter(torch.from_numpy(ref[f"start/{name}"].copy())))
    momentum = float(ref["momentum"]) if variant != "sgd" else 0.0
    optimizer = build_optimizer(model, TrainConfig(optimizer="sgd", lr=0.01, weight_decay=0.0, momentum=momentum,
                                                   nesterov=variant == "nesterov"))
    for step, lr in enumerate(ref["lr"]):
        for group in optimizer.param_groups:
            group["lr"] = float(lr)
        for name, p in model.named_parameters():
            p.grad = torch.from_numpy(ref[f"grad/{name}"][step].copy())
        optimizer.step()
        for name, p in model.named_parameters():
            # TF multiplies by lr / loss scale and gradients × loss scale: roundings apart, 2 ulp of a
            # weight (a weight near 0 after a large update keeps the update's absolute rounding).
            np.testing.assert_allclose(p.detach().numpy(), ref[f"{variant}/{step}/{name}"], rtol=2.4e-7,
                                       atol=1.2e-7, err_msg=f"{variant} step {step} {name}")


def test_the_compiled_lamb_step_moves_40_bytes_a_parameter():
    """Inductor's count of the bytes the compiled step's kernels read and write, per fp32 parameter:
    pass 1 reads g, m, v, w and writes m, v (24), pass 2 reads m, v, w and writes w (16). A skip
    flag as a lerp weight once cost the fusion and doubled it to 80. About 10 s."""
    import logging

    import torch._inductor.metrics as metrics

    log = logging.getLogger("torch._inductor.compile_fx.__inductor_metrics")  # counts only while on
    log.setLevel(logging.INFO)
    log.propagate = False
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(64, 64)), nn.Parameter(torch.randn(64))]
    optimizer = Lamb([{"params": params, "weight_decay": 0.01}], lr=1e-3, compiled=True)
    for param in params:
        param.grad = torch.randn_like(param)
    torch._dynamo.reset()
    metrics.reset()
    optimizer.step()
    assert metrics.num_bytes_accessed / sum(p.numel() for p in params) == pytest.approx(40.0, abs=0.1)
