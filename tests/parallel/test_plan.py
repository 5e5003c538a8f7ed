"""The memory planner against the model itself: parameter counts, and activation memory measured
tensor by tensor (saved-tensor hooks and live storages) on the CPU."""

from __future__ import annotations

import json
import math

import pytest
import torch

from bertforge.bench.pretrain import LiveTensorBytes
from bertforge.cli import main
from bertforge.config import ConfigError, load_config
from bertforge.data import SyntheticDataset
from bertforge.models.bert import BertForPreTraining, num_parameters
from bertforge.models.families import build_pretraining_model
from bertforge.parallel.dist import DistContext, apply_recompute, destroy_distributed, prepare_model, unwrap
from bertforge.parallel.plan import (
    count_parameters,
    decayed_parameters,
    format_plan,
    largest_micro_batch,
    parse_size,
    plan_memory,
)
from bertforge.training.engine import autocast
from bertforge.training.optim import build_optimizer, param_groups
from bertforge.training.pretrain import forward_loss


def make_config(preset: str, batch: int = 2, seq_len: int = 128, predictions: int = 20,
                recompute: str = "none", precision: str = "fp32", vocab_size: int | None = None, **execution):
    overrides = [("data.seq_len", seq_len), ("data.max_predictions", predictions),
                 ("train.micro_batch_size", batch), ("train.global_batch_size", batch),
                 ("execution.recompute", recompute), ("execution.precision", precision),
                 ("execution.device", "cpu")]
    if preset.startswith("modernbert"):
        overrides.append(("train.objective", "mlm"))  # (it has no NSP head)
    if vocab_size is not None:
        overrides.append(("model.vocab_size", vocab_size))
    overrides += [(f"execution.{key}", value) for key, value in execution.items()]
    return load_config(preset, overrides)


def synthetic_batch(cfg):
    """BERT's synthetic rows; for ModernBERT packed (two sequences a row, the plan's assumption)."""
    data = SyntheticDataset(size=cfg.train.micro_batch_size, vocab_size=cfg.model.vocab_size,
                            seq_len=cfg.data.seq_len, max_predictions=cfg.data.max_predictions)
    batch = data.batch(list(range(cfg.train.micro_batch_size)))
    if cfg.model.family != "modernbert":
        return batch
    B, T = batch["input_ids"].shape
    split = T // 2 + 7
    second = torch.arange(T) >= split
    return {**batch, "sequence_ids": (1 + second.int()).repeat(B, 1),
            "position_ids": (torch.arange(T) - split * second).int().repeat(B, 1),
            "cls_positions": torch.zeros(B, 2, dtype=torch.int32)}


def measure_step(cfg) -> dict[str, int]:
    """Bytes of live tensors made by the second training step (the first makes the optimizer
    state): after the forward, peak through the backward, peak in the optimizer step. The model
    is prepared as training prepares it (DDP on a one-rank group for execution.parallel=ddp)."""
    torch.manual_seed(0)
    model = build_pretraining_model(cfg.model, cfg.train.objective).train()
    model = prepare_model(model, cfg.execution, DistContext())
    try:
        return _measure_step(cfg, model)
    finally:
        destroy_distributed()


def _measure_step(cfg, model) -> dict[str, int]:
    optimizer = build_optimizer(unwrap(model), cfg.train)
    batch = synthetic_batch(cfg)
    device = torch.device("cpu")
    result: dict[str, int] = {}

    def step(tracker: LiveTensorBytes | None) -> None:
        with autocast(device, cfg.execution.precision):
            loss = forward_loss(model, batch)["loss"]
        if tracker:
            result["saved"] = tracker.live
        loss.backward()
        if tracker:
            result["backward_peak"] = tracker.peak
            tracker.reset_peak()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if tracker:
            result["optimizer_peak"] = tracker.peak

    step(None)
    if cfg.execution.parallel == "ddp":
        step(None)  # DDP remakes its buckets in the second step, in the order the first made gradients
    with LiveTensorBytes() as tracker:
        step(tracker)
    return result


# ------------------------------------------------------------ parameters and state

@pytest.mark.parametrize("preset", ["tiny", "base", "large"])
@pytest.mark.smoke
def test_parameter_and_state_bytes_are_exact(preset):
    cfg = load_config(preset)
    with torch.device("meta"):
        model = BertForPreTraining(cfg.model)
    n = num_parameters(model)
    decay = sum(p.numel() for p in param_groups(model, 0.01)[0]["params"])
    plan = plan_memory(cfg)
    assert count_parameters(cfg.model) == n == plan.num_parameters
    assert decayed_parameters(cfg.model) == decay
    assert plan.parameters == plan.gradients == 4 * n
    assert plan.optimizer_state == 8 * n  # two fp32 moments, LAMB or AdamW
    for optimizer in ("adamw", "stableadamw"):
        assert plan_memory(load_config(preset, [("train.optimizer", optimizer)])).optimizer_state == 8 * n


@pytest.mark.parametrize("preset", ["modernbert-tiny", "modernbert-base", "modernbert-large"])
def test_modernbert_parameter_and_state_bytes_are_exact(preset):
    cfg = make_config(preset)
    with torch.device("meta"):
        model = build_pretraining_model(cfg.model, "mlm")
    n = num_parameters(model)
    decay = sum(p.numel() for p in param_groups(model, 0.01)[0]["params"])
    plan = plan_memory(cfg)
    assert count_parameters(cfg.model) == n == plan.num_parameters
    assert decayed_parameters(cfg.model) == decay
    assert plan.parameters == plan.gradients == 4 * n and plan.optimizer_state == 8 * n


def test_modernbert_base_and_large_sizes():
    """ModernBERT-base and -large: 149M and 395M (the token embeddings counted once, tied)."""
    assert count_parameters(make_config("modernbert-base").model) == 149_655_232
    assert count_parameters(make_config("modernbert-large").model) == 395_881_664


def test_base_and_large_sizes():
    assert count_parameters(load_config("base").model) == 110_106_428
    assert count_parameters(load_config("large").model) == 336_226_108


def test_fsdp_divides_state_by_world_size():
    cfg = make_config("large", parallel="fsdp")
    n = count_parameters(cfg.model)
    single, sharded = plan_memory(make_config("large")), plan_memory(cfg, world_size=8)
    assert sharded.parameters == sharded.gradients == math.ceil(n / 8) * 4
    assert sharded.optimizer_state == 2 * math.ceil(n / 8) * 4
    assert sharded.activations == single.activations  # each rank still runs a whole micro-batch
    assert sharded.device_total < single.device_total


def test_fsdp_gathered_layers_are_root_plus_two_layers():
    cfg = make_config("tiny", parallel="fsdp")
    model = BertForPreTraining(cfg.model)
    layer = sum(p.numel() for p in model.bert.encoder.layer[0].parameters())
    root = num_parameters(model) - cfg.model.num_hidden_layers * layer
    plan = plan_memory(cfg, world_size=4)
    assert plan.details["fsdp_gathered_parameters"] == 4 * (root + 2 * layer)


def test_offload_moves_state_to_host():
    on_device = plan_memory(make_config("large", parallel="fsdp"), world_size=8)
    offloaded = plan_memory(make_config("large", parallel="fsdp", offload=True), world_size=8)
    state = offloaded.parameters + offloaded.gradients + offloaded.optimizer_state
    assert offloaded.location["parameters"] == offloaded.location["optimizer_state"] == "host"
    assert on_device.host_total == 0
    assert offloaded.host_total == state + offloaded.details["optimizer_workspace"]
    # What left the device is the sharded parameters, their optimizer state and the step's temporaries.
    assert on_device.device_total - offloaded.device_total >= state - offloaded.gradients


def test_offload_needs_fsdp():
    with pytest.raises(ConfigError, match="fsdp"):
        plan_memory(make_config("tiny", offload=True))


def test_ddp_gradients_are_its_buckets():
    plain = plan_memory(make_config("base"))
    ddp = plan_memory(make_config("base", parallel="ddp"), world_size=8)
    assert ddp.parameters == plain.parameters and ddp.workspace == plain.workspace
    assert ddp.details["ddp_buckets"] == plain.gradients  # gradient_as_bucket_view: no second copy
    assert ddp.phases["optimizer_step"] == plain.phases["optimizer_step"]
    # The buckets are there before the backward makes any gradient; besides them only the tied
    # word embedding's gradient waits, from the decoder's backward to the embedding's.
    held = plain.parameters + plain.optimizer_state + plain.gradients
    tied = 4 * 30522 * 768
    assert held + plain.activations < ddp.phases["forward_backward"] <= held + plain.activations + tied


def _units(cfg) -> tuple[int, int]:
    """Parameters of an encoder layer and of FSDP's root unit (embeddings and heads)."""
    layer = sum(p.numel() for p in BertForPreTraining(cfg.model).bert.encoder.layer[0].parameters())
    return layer, count_parameters(cfg.model) - cfg.model.num_hidden_layers * layer


def test_fsdp_bf16_gathers_bf16_parameters_and_casts_no_weights():
    fp32, bf16 = (make_config("tiny", parallel="fsdp", precision=p) for p in ("fp32", "bf16"))
    layer, root = _units(fp32)
    assert plan_memory(fp32, world_size=4).details["fsdp_gathered_parameters"] == 4 * (root + 2 * layer)
    sharded = plan_memory(bf16, world_size=4)
    assert sharded.details["fsdp_gathered_parameters"] == 2 * (root + 2 * layer)
    assert sharded.details["fsdp_unsharded_gradients"] == 2 * (root + layer)  # gradients of bf16 parameters
    assert sharded.parameters == 4 * math.ceil(count_parameters(bf16.model) / 4)  # the shards stay fp32
    # Autocast has no weights to cast: each layer's 4 H² + 2 H·I and the decoder's V·H bf16 copies are gone.
    m = bf16.model
    casts = m.num_hidden_layers * 2 * (4 * m.hidden_size**2 + 2 * m.hidden_size * m.intermediate_size)
    casts += 2 * m.vocab_size * m.hidden_size
    # And the embeddings' sum is bf16 (of bf16 tables), not fp32: 2 bytes less per element.
    casts += 2 * bf16.train.micro_batch_size * bf16.data.seq_len * m.hidden_size
    autocast_only = plan_memory(make_config("tiny", precision="bf16"))
    assert autocast_only.details["saved_activations"] - sharded.details["saved_activations"] == casts
    assert "fsdp: parameters gathered in bf16" in format_plan(sharded)


def test_keeping_gathered_layers_holds_every_layer():
    kept = make_config("base", parallel="fsdp", reshard_after_forward=False)
    layer, root = _units(kept)
    default = plan_memory(make_config("base", parallel="fsdp"), world_size=8)
    plan = plan_memory(kept, world_size=8)
    assert plan.details["fsdp_gathered_parameters"] == 4 * (root + 12 * layer)
    assert plan.phases["forward_backward"] - default.phases["forward_backward"] == 4 * 10 * layer
    assert "reshard after forward off" in format_plan(plan)


@pytest.mark.parametrize("sync,offload,accumulation,held,shown", [
    ("step", False, 4, True, "once per step"), ("auto", False, 4, True, "once per step"),
    ("step", False, 1, False, "once per step"), ("micro_batch", False, 4, False, "every micro-batch"),
    ("auto", True, 4, False, "every micro-batch")])
def test_step_grad_sync_holds_unsharded_gradients_through_accumulation(sync, offload, accumulation, held, shown):
    cfg = make_config("base", batch=8, parallel="fsdp", fsdp_grad_sync=sync, offload=offload)
    cfg.train.global_batch_size = 8 * 8 * accumulation
    n = count_parameters(cfg.model)
    plan = plan_memory(cfg, world_size=8)
    assert plan.config["accumulation"] == accumulation
    assert plan.details["fsdp_accumulated_gradients"] == (4 * n if held else 0)
    if held:  # the whole model's fp32 gradients with every micro-batch's activations
        resident = plan.parameters + plan.optimizer_state
        in_flight = plan.details["fsdp_unsharded_gradients"]
        assert plan.phases["forward_backward"] == (resident + plan.details["fsdp_gathered_parameters"]
                                                   + plan.activations + 4 * n + in_flight)
    assert f"reduce-scattered {shown} ({accumulation} micro-batches per step)" in format_plan(plan)


def test_step_grad_sync_with_offload_is_refused():
    with pytest.raises(ConfigError, match="execution.fsdp_grad_sync=step cannot be used with execution.offload"):
        plan_memory(make_config("tiny", parallel="fsdp", offload=True, fsdp_grad_sync="step"))


def test_recompute_lowers_planned_activations_at_512():
    none, layer, attention = (plan_memory(make_config("base", batch=8, seq_len=512, predictions=80,
                                                      recompute=policy)).activations
                              for policy in ("none", "layer", "attention"))
    assert layer < attention < none
    assert none / layer > 5


# ------------------------------------------------------------ activations, measured

def test_saved_tensors_match_the_plan():
    """Sum of the distinct non-parameter storages that autograd saves in the forward
    (saved-tensor hooks), against the planner's saved activations."""
    cfg = make_config("mini", batch=2, seq_len=128)
    torch.manual_seed(0)
    model = BertForPreTraining(cfg.model).train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    batch = synthetic_batch(cfg)
    inputs = {t.untyped_storage().data_ptr() for t in batch.values()}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params | inputs:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        forward_loss(model, batch)
    planned = plan_memory(cfg).details["saved_activations"]
    assert sum(saved.values()) == pytest.approx(planned, rel=0.01)


@pytest.mark.parametrize("preset,seq_len,policy,precision", [
    ("tiny", 256, "none", "fp32"),
    ("tiny", 256, "layer", "fp32"),
    ("tiny", 256, "attention", "fp32"),
    ("tiny", 128, "none", "bf16"),
    ("tiny", 128, "attention", "bf16"),
])
def test_step_memory_matches_the_plan(preset, seq_len, policy, precision):
    cfg = make_config(preset, batch=2, seq_len=seq_len, recompute=policy, precision=precision)
    measured = measure_step(cfg)
    plan = plan_memory(cfg)
    resident = plan.parameters + plan.optimizer_state  # made before the measured step
    assert measured["saved"] == pytest.approx(plan.details["saved_activations"], rel=0.03)
    assert measured["backward_peak"] == pytest.approx(plan.phases["forward_backward"] - resident, rel=0.05)
    assert measured["optimizer_peak"] == pytest.approx(plan.phases["optimizer_step"] - resident, rel=0.01)


def test_stableadamw_step_memory_matches_the_plan():
    """Its state (two moments) and the step's temporaries, as LAMB's: one buffer per tensor, which
    holds g / sqrt(max(v, eps'²)) for the clipping, then the update."""
    cfg = load_config("tiny", [("train.optimizer", "stableadamw"), ("data.seq_len", 128), ("train.micro_batch_size", 2),
                               ("train.global_batch_size", 2), ("execution.device", "cpu")])
    measured = measure_step(cfg)
    plan = plan_memory(cfg)
    resident = plan.parameters + plan.optimizer_state
    assert measured["optimizer_peak"] == pytest.approx(plan.phases["optimizer_step"] - resident, rel=0.01)


@pytest.mark.parametrize("vocab,seq_len,policy,precision", [
    (30522, 256, "none", "fp32"),  # the vocab's loss and gradients make the peak
    (1024, 512, "none", "fp32"),  # the layers make it
    (1024, 512, "layer", "fp32"),
    (1024, 512, "attention", "fp32"),
    (30522, 128, "none", "bf16"),
])
def test_modernbert_step_memory_matches_the_plan(vocab, seq_len, policy, precision):
    """ModernBERT-tiny (global, local, local, global; windows of 128) on packed rows of two sequences."""
    cfg = make_config("modernbert-tiny", batch=2, seq_len=seq_len, recompute=policy, precision=precision,
                      vocab_size=vocab)
    measured = measure_step(cfg)
    plan = plan_memory(cfg)
    resident = plan.parameters + plan.optimizer_state
    assert measured["saved"] == pytest.approx(plan.details["saved_activations"], rel=0.03)
    assert measured["backward_peak"] == pytest.approx(plan.phases["forward_backward"] - resident, rel=0.05)
    assert measured["optimizer_peak"] == pytest.approx(plan.phases["optimizer_step"] - resident, rel=0.01)


def test_modernbert_plan_command(capsys):
    assert main(["plan", "--config", "modernbert-base", "--train.objective", "mlm", "--data.seq_len", "1024",
                 "--train.micro_batch_size", "8", "--train.global_batch_size", "8", "--device-memory", "80GB"]) == 0
    out = capsys.readouterr().out
    assert "memory per rank: 149.7M parameters, 22 layers, hidden 768; micro-batch 8 × seq 1024" in out
    assert "\nfits in 74.51 GiB" in out


def test_ddp_step_memory_matches_the_plan():
    """DDP on a one-rank group: its gradients are views into the buckets it made with the model,
    so the measured step makes no gradient beyond the transient ones."""
    cfg = make_config("tiny", batch=2, seq_len=256, parallel="ddp")
    measured = measure_step(cfg)
    plan = plan_memory(cfg)
    held = plan.parameters + plan.optimizer_state + plan.details["ddp_buckets"]  # made before the measured step
    assert measured["backward_peak"] == pytest.approx(plan.phases["forward_backward"] - held, rel=0.05)
    # The step's temporaries alone: a second copy of the gradients would double this.
    assert measured["optimizer_peak"] == pytest.approx(plan.phases["optimizer_step"] - held, rel=0.01)
    assert plan.details["optimizer_workspace"] < plan.gradients


def test_recompute_lowers_saved_memory_at_512():
    """BERT-base layers (hidden 768, 12 heads) at sequence 512, four of them and a small vocab:
    what the forward leaves for the backward, measured, per recompute policy."""
    measured, planned = {}, {}
    for policy in ("none", "layer", "attention"):
        cfg = make_config("base", batch=1, seq_len=512, predictions=80, recompute=policy)
        cfg.model.num_hidden_layers, cfg.model.vocab_size = 4, 1024
        torch.manual_seed(0)
        model = BertForPreTraining(cfg.model).train()
        apply_recompute(model, policy)
        batch = synthetic_batch(cfg)
        with LiveTensorBytes() as tracker:
            loss = forward_loss(model, batch)["loss"]
            measured[policy] = tracker.live
        del loss
        planned[policy] = plan_memory(cfg).details["saved_activations"]
    assert measured["layer"] < measured["attention"] < measured["none"]
    assert measured["none"] > 10 * measured["layer"]
    for policy, saved in measured.items():
        assert saved == pytest.approx(planned[policy], rel=0.02)


# ------------------------------------------------------------ sizes and the command

@pytest.mark.parametrize("text,expected", [
    ("80GB", 80 * 10**9), ("80GiB", 80 * 2**30), ("80G", 80 * 2**30), ("81920MB", 81920 * 10**6),
    ("85899345920", 85899345920), ("1.5e9", 1_500_000_000), ("512 mib", 512 * 2**20),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["80XB", "lots", "", "-5GB", "0"])
def test_parse_size_rejects(text):
    with pytest.raises(ConfigError, match="--device-memory"):
        parse_size(text)


def test_plan_command_prints_a_table(capsys):
    assert main(["plan", "--config", "pretrain_large_512_phase2", "--device-memory", "80GB",
                 "--world-size", "8", "--execution.parallel", "fsdp",
                 "--execution.recompute", "layer"]) == 0
    out = capsys.readouterr().out
    for line in ("parameters (fp32)", "gradients (fp32)", "optimizer state", "activations (peak)",
                 "device total (peak)", "host total (peak)", "world size 8, parallel fsdp, recompute layer",
                 "fsdp: parameters gathered in bf16, gradients reduce-scattered once per step "
                 "(256 micro-batches per step), reshard after forward on"):
        assert line in out
    assert "\nfits in 74.51 GiB" in out


def test_plan_command_json_and_does_not_fit(capsys):
    assert main(["plan", "--config", "base", "--device-memory", "1GiB", "--json",
                 "--train.micro_batch_size", "64", "--train.global_batch_size", "64"]) == 1
    result = json.loads(capsys.readouterr().out)
    expected = plan_memory(load_config("base", [("train.micro_batch_size", 64),
                                                ("train.global_batch_size", 64)]))
    assert result["fits"] is False
    assert result["device_memory"] == 2**30
    assert result["device_total"] == expected.device_total
    assert result["parameters"] == 4 * 110_106_428


def test_plan_command_rejects_a_bad_device_memory(capsys):
    assert main(["plan", "--config", "base", "--device-memory", "eighty"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'eighty'" in err and "--device-memory" in err


# ------------------------------------------------------------ pipeline stages

def _pipeline_config(preset: str, stages: int, schedule: str, micro_batches: int, batch: int = 8, **execution):
    cfg = make_config(preset, batch=batch, pipeline_stages=stages, pipeline_schedule=schedule, **execution)
    cfg.train.global_batch_size = batch * micro_batches
    return cfg


def _stage_modules(cfg, stages: int):
    from bertforge.training.pipeline import BertStage

    with torch.device("meta"):
        model = BertForPreTraining(cfg.model)
    return model, [BertStage(model, s, stages) for s in range(stages)]


@pytest.mark.parametrize("preset,stages", [("tiny", 2), ("base", 4), ("base", 5), ("large", 3)])
def test_pipeline_stage_state_is_the_stage_modules(preset, stages):
    """Parameters, gradients, optimizer state and its workspace of each stage, from the stage modules."""
    cfg = _pipeline_config(preset, stages, "gpipe", micro_batches=8)
    model, modules = _stage_modules(cfg, stages)
    counts = [num_parameters(m) for m in modules]
    decayed = [sum(p.numel() for p in param_groups(m, 0.01)[0]["params"]) for m in modules]
    # Every parameter once, and the last stage's copy of the word embeddings (the decoder's tied weight).
    assert sum(counts) == num_parameters(model) + cfg.model.vocab_size * cfg.model.hidden_size
    plan = plan_memory(cfg, world_size=stages)
    assert [s["parameters"] for s in plan.stages] == counts
    assert [s["layers"] for s in plan.stages] == [len(m.layers) for m in modules]
    worst = plan.config["pipeline_stage"]
    assert plan.device_total == max(s["device_total"] for s in plan.stages) == plan.stages[worst]["device_total"]
    assert plan.parameters == plan.gradients == 4 * counts[worst]
    assert plan.optimizer_state == 8 * counts[worst]  # LAMB's two fp32 moments
    assert plan.details["optimizer_workspace"] == 4 * decayed[worst]
    assert plan.num_parameters == num_parameters(model)


def test_pipeline_buffers_and_optimizer_step_by_hand():
    """BERT-base over 4 stages, 8 micro-batches of 8 × 128 on CUDA: the schedule's receive buffers (hidden
    states and the 16-byte CUDA RNG state forward, gradients backward), and the optimizer step's bytes."""
    cfg = _pipeline_config("base", 4, "1f1b", micro_batches=8)
    cfg.execution.device = "cuda"
    _, modules = _stage_modules(cfg, 4)
    plan = plan_memory(cfg, world_size=4)
    stream = 8 * 128 * 768 * 4  # one micro-batch's hidden states, fp32
    for s, (stage, module) in enumerate(zip(plan.stages, modules)):
        received = 8 * (stream + 16) if s > 0 else 0
        sent_gradients = 8 * stream if s < 3 else 0
        assert stage["buffers"] == received + sent_gradients
        p = 4 * num_parameters(module)
        decayed = 4 * sum(q.numel() for q in param_groups(module, 0.01)[0]["params"])
        input_gradients = 8 * stream if s > 0 else 0  # each receive buffer's .grad, kept to the next step
        assert stage["optimizer_step"] == 3 * p + p + decayed + stage["buffers"] + input_gradients


def test_gpipe_holds_every_micro_batch_and_1f1b_at_most_the_stages():
    """BERT-base over 4 stages, 8 micro-batches: GPipe's stages all hold the 8 micro-batches' activations
    when their backward starts, 1F1B's stage s holds 4 - s. Stage 0 peaks at its first backward under
    both; a middle stage under 1F1B peaks at its last backward with 4 - s in flight, by then holding the
    input gradients of the 8 - (4 - s) backwards before (each receive buffer's .grad)."""
    gpipe, one_f_one_b = (plan_memory(_pipeline_config("base", 4, schedule, micro_batches=8), world_size=4)
                          for schedule in ("gpipe", "1f1b"))
    assert [s["in_flight"] for s in gpipe.stages] == [8, 8, 8, 8]
    assert [s["in_flight"] for s in one_f_one_b.stages] == [4, 3, 2, 1]
    stream = 8 * 128 * 768 * 4
    for g, o in zip(gpipe.stages[:3], one_f_one_b.stages[:3]):
        # What a micro-batch in flight holds, less its input where that is a receive buffer (counted once).
        held = g["saved_per_micro_batch"] - (stream if g["stage"] > 0 else 0)
        fewer = 8 - o["in_flight"]
        input_gradients = fewer * stream if g["stage"] > 0 else 0
        assert g["activations"] - o["activations"] == fewer * held - input_gradients
    for g, o in zip(gpipe.stages, one_f_one_b.stages):
        assert g["device_total"] > o["device_total"]


def test_pipeline_saved_activations_are_the_models():
    """Summed over the stages, a micro-batch saves what it saves in one process, plus what the schedule
    keeps between stages: hidden and RNG states of each boundary, the last stage's logits."""
    from bertforge.parallel.plan import RNG_STATE_BYTES

    for schedule, recompute in (("gpipe", "none"), ("1f1b", "layer")):
        cfg = _pipeline_config("base", 3, schedule, micro_batches=4, recompute=recompute)
        single = plan_memory(make_config("base", batch=8, recompute=recompute))
        staged = plan_memory(cfg, world_size=3)
        stream, logits = 8 * 128 * 768 * 4, 8 * 20 * 30522 * 4 + 8 * 2 * 4
        assert (sum(s["saved_per_micro_batch"] for s in staged.stages)
                == single.details["saved_activations"] + 2 * (stream + RNG_STATE_BYTES["cpu"]) + logits)


def test_pipelines_average_gradients_in_buckets():
    from bertforge.parallel.plan import PIPELINE_BUCKET_BYTES
    from bertforge.training.pipeline import BUCKET_BYTES

    assert PIPELINE_BUCKET_BYTES == BUCKET_BYTES
    one = plan_memory(_pipeline_config("base", 2, "1f1b", micro_batches=8), world_size=2)
    cfg = _pipeline_config("base", 2, "1f1b", micro_batches=8, parallel="ddp")
    cfg.train.global_batch_size *= 2  # the same 8 micro-batches per pipeline
    two = plan_memory(cfg, world_size=4)
    assert two.config["pipelines"] == 2 and two.config["parallel"] == "ddp"
    assert two.stages[0]["gradient_averaging"] == (two.stages[0]["optimizer_step"] - two.details["optimizer_workspace"]
                                                   + BUCKET_BYTES)
    for a, b in zip(one.stages, two.stages):
        assert a["forward_backward"] == b["forward_backward"] and a["optimizer_step"] == b["optimizer_step"]


def test_pipeline_plan_errors_and_table(capsys):
    with pytest.raises(ConfigError, match="world size 3 is not a multiple of execution.pipeline_stages=2"):
        plan_memory(_pipeline_config("tiny", 2, "gpipe", micro_batches=4), world_size=3)
    with pytest.raises(ConfigError, match="execution.pipeline_schedule=1f1b needs at least "
                                          "execution.pipeline_stages=2 micro-batches per step and pipeline, got 1"):
        plan_memory(_pipeline_config("tiny", 2, "1f1b", micro_batches=1), world_size=2)
    assert main(["plan", "--config", "base", "--world-size", "4", "--execution.pipeline_stages", "4",
                 "--train.micro_batch_size", "8", "--train.global_batch_size", "64"]) == 0
    out = capsys.readouterr().out
    assert "pipeline: 1 × 4 stages, 1f1b, 8 micro-batches per step; the lines below are stage 0's" in out
    assert "  stage 3: 3 layers, 45.9M parameters, 1 in flight" in out
    assert main(["plan", "--config", "base", "--world-size", "4", "--execution.pipeline_stages", "4", "--json",
                 "--train.micro_batch_size", "8", "--train.global_batch_size", "64"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [s["stage"] for s in result["stages"]] == [0, 1, 2, 3] and result["config"]["pipeline_stages"] == 4


def test_largest_micro_batch_is_the_last_that_fits():
    def plan_of(batch):
        return plan_memory(make_config("large", batch=batch, seq_len=128, precision="bf16"), device="cuda")

    total = {b: plan_of(b).device_total for b in (37, 38)}
    budget = (total[37] + total[38]) // 2  # 37 rows fit, 38 do not
    assert largest_micro_batch(plan_of, budget, 1000) == 37
    assert largest_micro_batch(plan_of, budget, 20) == 20  # at most `most`
    assert largest_micro_batch(plan_of, total[37] // 100, 1000) == 0  # not even one row
