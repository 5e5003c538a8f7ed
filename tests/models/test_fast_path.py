"""The model's fast path changes speed, not results: fused QKV, the padded vocab, the bf16
residual stream, the attention kernels, the compiled loss, no host syncs."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import bertforge.models.bert as bert
from bertforge.bench.pretrain import LiveTensorBytes
from bertforge.config import MODEL_PRESETS, ExecutionConfig, ModelConfig
from bertforge.data import SyntheticDataset
from bertforge.models.bert import (
    BertForPreTraining,
    BertSelfAttention,
    compiled_pretraining_loss,
    pretraining_loss,
    set_attention_backends,
    set_vocab_multiple,
)
from bertforge.parallel.dist import attention_backends, compiles
from bertforge.training.pretrain import forward_loss, training_loss

CUDA = torch.device("cuda")


def tiny(**overrides) -> ModelConfig:
    return ModelConfig(**{**MODEL_PRESETS["tiny"], **overrides})


def batch_of(cfg: ModelConfig, size: int = 4, seq_len: int = 64, seed: int = 1) -> dict[str, torch.Tensor]:
    data = SyntheticDataset(size=size, vocab_size=cfg.vocab_size, seq_len=seq_len, max_predictions=10, seed=seed)
    batch = {k: v if v.is_floating_point() else v.long() for k, v in data.batch(list(range(size))).items()}
    batch["attention_mask"] = torch.ones(size, seq_len, dtype=torch.long)
    batch["attention_mask"][0, seq_len // 2:] = 0  # one padded row, so the mask matters
    return batch


class OpLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_fused_qkv_equals_three_separate_projections():
    torch.manual_seed(0)
    cfg = tiny()
    attention = BertSelfAttention(cfg).eval()
    x = torch.randn(3, 16, cfg.hidden_size)
    mask = torch.zeros(3, 1, 1, 16)
    mask[1, ..., 10:] = torch.finfo(torch.float32).min

    def heads(t: torch.Tensor) -> torch.Tensor:
        return t.view(3, 16, cfg.num_attention_heads, -1).transpose(1, 2)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        q, k, v = (heads(layer(x)) for layer in (attention.query, attention.key, attention.value))
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(3, 16, -1)
        with OpLog() as log:
            fused = attention(x, mask)
    assert log.ops.count("aten.addmm.default") == 1  # one matmul, where the three projections make three
    assert fused.dtype == torch.bfloat16
    # The same bf16 products, summed in another order: a bf16 rounding apart at most.
    torch.testing.assert_close(fused.float(), expected.float(), rtol=0, atol=2e-2)
    # The parameters are still Hugging Face's three, so LAMB's trust ratios stay per tensor.
    assert [name for name, _ in attention.named_parameters()] == [
        "query.weight", "query.bias", "key.weight", "key.bias", "value.weight", "value.bias"]


def test_a_padded_vocab_gives_the_same_logits_loss_and_gradients():
    torch.manual_seed(0)
    cfg = tiny(vocab_size=30522)  # BERT's vocab: 30522 = 64 × 476 + 58
    plain = BertForPreTraining(cfg).eval()
    padded = copy.deepcopy(plain)
    set_vocab_multiple(padded, 64)
    batch = batch_of(cfg)
    results = []
    for model in (plain, padded):
        with torch.autocast("cpu", dtype=torch.bfloat16), OpLog() as log:
            mlm_logits, nsp_logits = model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"],
                                           batch["masked_lm_positions"])
            loss = pretraining_loss(mlm_logits, nsp_logits, batch)["loss"]
        loss.backward()
        results.append((mlm_logits, loss, {n: p.grad for n, p in model.named_parameters()}, log.ops))
    (logits, loss, grads, ops), (logits64, loss64, grads64, ops64) = results
    assert ops64.count("aten.constant_pad_nd.default") == 2 and "aten.constant_pad_nd.default" not in ops
    assert logits64.shape == logits.shape == (4, 10, 30522)
    assert padded.cls.predictions.bias.shape == (30522,)  # the weights keep their size
    # The same bf16 products: the padding changes no logit, loss or gradient.
    assert torch.equal(logits64, logits) and torch.equal(loss64, loss)
    assert grads64.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(grads64[name], grads[name], rtol=1e-6, atol=0, msg=name)
    with pytest.raises(ValueError, match="at least 1"):
        set_vocab_multiple(padded, 0)


def encoder_activations(model: BertForPreTraining, batch: dict[str, torch.Tensor]) -> tuple[int, torch.Tensor]:
    """Bytes the encoder's forward leaves alive for the backward, and its output, under bf16 autocast."""
    live = LiveTensorBytes()
    with live, torch.autocast("cpu", dtype=torch.bfloat16):
        x, _ = model.bert(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
    return live.live, x


def test_the_residual_stream_is_bf16_under_bf16_autocast(monkeypatch):
    torch.manual_seed(0)
    cfg = ModelConfig(**MODEL_PRESETS["mini"])
    model = BertForPreTraining(cfg)
    batch = batch_of(cfg, size=8, seq_len=128)
    kept_bf16, hidden = encoder_activations(model, batch)
    assert hidden.dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_bf16 = forward_loss(model.eval(), batch)["loss"]
    with torch.no_grad():
        loss_fp32 = forward_loss(model, batch)["loss"]
    assert abs(loss_bf16.item() - loss_fp32.item()) < 0.02 * loss_fp32.item()

    monkeypatch.setattr(bert, "bf16_autocast", lambda device: False)  # autocast's own fp32 LayerNorm
    kept_fp32, hidden = encoder_activations(model.train(), batch)
    assert hidden.dtype == torch.float32
    # On the CPU most of what is kept is attention probabilities (math kernel) and the MLP;
    # the residual stream's share is what halves. Measured: 6.6 % less for BERT-mini at 16 × 128.
    assert kept_bf16 < 0.96 * kept_fp32


def test_bf16_layer_norm_is_the_fp32_one_with_bf16_weights_rounded():
    """CUDA's kernel takes input and weights in one dtype: the weights are cast to bf16, as autocast
    casts a matmul's, and the statistics are fp32."""
    torch.manual_seed(0)
    norm = bert.LayerNorm(64, eps=1e-12)
    torch.nn.init.normal_(norm.weight)
    torch.nn.init.normal_(norm.bias)
    x = torch.randn(32, 64).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = norm(x)
    assert out.dtype == torch.bfloat16
    weight, bias = norm.weight.bfloat16().float(), norm.bias.bfloat16().float()
    expected = F.layer_norm(x.float(), (64,), weight, bias, 1e-12)
    assert ((out.float() - expected).abs() <= expected.abs() * 2 ** -8).all()  # rounded to bf16: 1 ulp
    # Against the fp32 weights: the weights' rounding (2⁻⁹ each) on top, per element.
    x_hat = F.layer_norm(x.float(), (64,), eps=1e-12)
    exact = x_hat * norm.weight + norm.bias
    slack = (x_hat * norm.weight).abs() + norm.bias.abs()
    assert ((out.float() - exact).abs() <= (exact.abs() + slack) * 2 ** -8).all()
    with torch.autocast("cpu", dtype=torch.float16):  # fp16 keeps autocast's own LayerNorm
        assert not bert.bf16_autocast("cpu")
    assert not bert.bf16_autocast("cpu")


def test_the_loss_makes_no_tensor_from_a_python_number():
    """``torch.tensor(x, device=cuda)`` is a host-to-device copy, a sync per micro-batch; it
    shows up as ``lift_fresh``. The NSP count is a fill on the device instead."""
    cfg = tiny()
    batch = batch_of(cfg)
    mlm_logits, nsp_logits = torch.randn(4, 10, cfg.vocab_size), torch.randn(4, 2)
    with OpLog() as log:
        out = pretraining_loss(mlm_logits, nsp_logits, batch)
    assert "aten.lift_fresh.default" not in log.ops
    assert out["nsp_count"].item() == 4.0


def test_a_training_step_takes_no_argmax():
    """Accuracy counts are for evaluation: training's loss reads the (B, P, V) logits once, for the
    cross-entropy, not a second time for an argmax."""
    torch.manual_seed(0)
    model = BertForPreTraining(tiny())
    batch = batch_of(tiny())
    with OpLog() as log:
        training_loss(model, batch)["loss"].backward()
    assert not [op for op in log.ops if "argmax" in op or "max.dim" in op]
    with OpLog() as log:
        forward_loss(model, batch)
    assert log.ops.count("aten.argmax.default") == 2  # the masked LM's and NSP's, for evaluation


def test_the_compiled_loss_equals_the_eager_one():
    torch.manual_seed(0)
    cfg = tiny()
    batch = batch_of(cfg)
    logits = torch.randn(4, 10, cfg.vocab_size, requires_grad=True), torch.randn(4, 2, requires_grad=True)
    eager = pretraining_loss(*logits, batch)
    eager_grads = torch.autograd.grad(eager["loss"], logits)
    compiled = compiled_pretraining_loss()(*logits, batch)
    compiled_grads = torch.autograd.grad(compiled["loss"], logits)
    assert compiled.keys() == eager.keys()
    for key in eager:
        torch.testing.assert_close(compiled[key], eager[key], rtol=1e-6, atol=0, msg=key)
    for got, want in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-9)


def test_attention_kernels_by_name():
    torch.manual_seed(0)
    cfg = tiny()
    model = BertForPreTraining(cfg).eval()
    batch = batch_of(cfg)
    args = batch["input_ids"], batch["token_type_ids"], batch["attention_mask"]
    default, _ = model.bert(*args)
    set_attention_backends(model, ["math"])
    assert all(m.backends == [torch.nn.attention.SDPBackend.MATH]
               for m in model.modules() if isinstance(m, BertSelfAttention))
    torch.testing.assert_close(model.bert(*args)[0], default, rtol=0, atol=1e-5)
    set_attention_backends(model, None)
    assert torch.equal(model.bert(*args)[0], default)

    cpu = torch.device("cpu")
    assert attention_backends(ExecutionConfig(), cpu) is None
    assert attention_backends(ExecutionConfig(), CUDA) == ["flash", "cudnn", "efficient", "math"]
    assert attention_backends(ExecutionConfig(attention="efficient"), cpu) == ["efficient"]
    assert (compiles(ExecutionConfig(), cpu), compiles(ExecutionConfig(), CUDA)) == (False, True)
    assert compiles(ExecutionConfig(compile=True), cpu) and not compiles(ExecutionConfig(compile=False), CUDA)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kernel", ["flash", "cudnn", "efficient"])
def test_each_cuda_attention_kernel_equals_math(kernel):
    torch.manual_seed(0)
    cfg = tiny()
    model = BertForPreTraining(cfg).to(CUDA).eval()
    batch = {k: v.to(CUDA) for k, v in batch_of(cfg, size=8, seq_len=128).items()}
    mask = None if kernel == "flash" else batch["attention_mask"]  # flash takes no mask
    with torch.autocast("cuda", dtype=torch.bfloat16):
        set_attention_backends(model, ["math"])
        want, _ = model.bert(batch["input_ids"], batch["token_type_ids"], mask)
        set_attention_backends(model, [kernel])
        got, _ = model.bert(batch["input_ids"], batch["token_type_ids"], mask)
    # bf16 outputs: within two of bf16's units (2^-7 relative each) of math's, or 3e-2 near 0
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=3e-2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_micro_batch_does_not_sync_with_the_host():
    torch.manual_seed(0)
    cfg = tiny()
    model = BertForPreTraining(cfg).to(CUDA)
    set_vocab_multiple(model, 64)
    batch = {k: v.to(CUDA) for k, v in batch_of(cfg).items()}
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = forward_loss(model, batch)["loss"]
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss).item()


def test_the_compile_mode_reaches_torch_compile(monkeypatch):
    """execution.compile_mode: max-autotune-no-cudagraphs autotunes the GEMMs and fuses their epilogues
    (bias + GELU) on CUDA; what a GPU gains from it is measured by benchmarks/gpu.sh."""
    from bertforge.parallel.dist import DistContext, prepare_model

    seen = {}

    def compile_(model, **kwargs):
        seen.update(kwargs)
        return model

    monkeypatch.setattr(torch, "compile", compile_)
    for mode in ("default", "max-autotune-no-cudagraphs"):
        prepare_model(BertForPreTraining(tiny()), ExecutionConfig(compile=True, compile_mode=mode), DistContext())
        assert seen == {"dynamic": False, "mode": mode}
