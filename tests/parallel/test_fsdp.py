"""FSDP2's execution settings on 2 gloo ranks: bf16 mixed precision, when gradients are
reduce-scattered (fsdp_grad_sync) and reshard_after_forward, against DDP, each other and
the memory planner. (DDP's bucket-view gradients are measured in test_plan.py.)

One spawn of two ranks (about 15 s) trains BERT-tiny with 4 layers through ``prepare_model``
and ``Engine.step`` for 3 steps of 2 micro-batches per rank under each setting, counting the
collectives FSDP2 calls (``dist.reduce_scatter_single`` and ``dist.all_gather_single``, what
its default communication calls once per unit), measuring memory, and hands back losses,
counts, memory and full weights.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bertforge.config import ConfigError, ExecutionConfig, load_config
from bertforge.parallel.dist import check_execution

STEPS, ACCUMULATION, WORLD, LAYERS = 3, 2, 2, 4
UNITS = LAYERS + 1  # FSDP units: the encoder layers and the root

CASES: dict[str, dict[str, Any]] = {
    "ddp_bf16": {"parallel": "ddp", "precision": "bf16"},
    "fsdp_bf16": {"parallel": "fsdp", "precision": "bf16"},
    "step": {"parallel": "fsdp", "fsdp_grad_sync": "step"},
    "micro_batch": {"parallel": "fsdp", "fsdp_grad_sync": "micro_batch"},
    "keep_gathered": {"parallel": "fsdp", "reshard_after_forward": False},
}


def _config(**execution: Any):
    overrides = [("data.seq_len", 32), ("data.max_predictions", 5), ("train.micro_batch_size", 4),
                 ("train.global_batch_size", 4 * WORLD * ACCUMULATION), ("train.warmup_steps", 1),
                 ("model.num_hidden_layers", LAYERS), ("execution.device", "cpu")]
    return load_config("tiny", overrides + [(f"execution.{k}", v) for k, v in execution.items()])


def _train(rank: int, counts: dict[str, int], **execution: Any) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    from bertforge.data import SyntheticDataset
    from bertforge.models.bert import BertForPreTraining
    from bertforge.parallel.dist import DistContext, prepare_model, unwrap
    from bertforge.training.engine import BatchStream, Engine
    from bertforge.training.optim import build_optimizer, build_scheduler
    from bertforge.training.pretrain import training_loss

    cfg = _config(**execution)
    ctx = DistContext(rank, WORLD)
    torch.manual_seed(cfg.train.seed)
    model = prepare_model(BertForPreTraining(cfg.model).train(), cfg.execution, ctx)
    inner = unwrap(model)
    seen: dict[str, torch.dtype] = {}

    def see_weights(module: torch.nn.Module, args: Any) -> None:
        seen.setdefault("compute", module.query.weight.dtype)

    inner.bert.encoder.layer[0].attention.self.register_forward_pre_hook(see_weights)
    # Memory, as the planner counts it: the peak bytes of gathered parameters (those FSDP has
    # swapped in unsharded), sampled at every tensor autograd saves or unpacks; and the bytes of
    # tensors the first micro-batch of a step leaves to the second.
    measured = {"gathered_peak": 0}

    def sample(tensor: torch.Tensor) -> torch.Tensor:
        unsharded = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                     for p in inner.parameters() if not isinstance(p, DTensor)}
        measured["gathered_peak"] = max(measured["gathered_peak"], sum(unsharded.values()))
        return tensor

    def live_bytes() -> int:
        """Bytes of the storages of every live tensor (a DTensor's are its local tensor's)."""
        gc.collect()
        tensors = [t for t in gc.get_objects() if isinstance(t, torch.Tensor)]
        # Gradients that autograd made have no Python object until asked for.
        tensors += [t.grad for t in tensors if isinstance(t, torch.nn.Parameter) and t.grad is not None]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in tensors if not isinstance(t, DTensor)}
        return sum(storages.values())

    calls: list[int] = []

    def loss_fn(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if len(calls) < 2:  # at the first and second micro-batch of the first step
            calls.append(live_bytes())
            measured["between_micro_batches"] = calls[-1] - calls[0]
        with torch.autograd.graph.saved_tensors_hooks(sample, sample):
            return training_loss(model, batch)

    optimizer = build_optimizer(inner, cfg.train)
    engine = Engine(model, optimizer, build_scheduler(optimizer, cfg.train, STEPS), loss_fn,
                    cfg.execution.precision, cfg.train.grad_clip, ctx, seed=cfg.train.seed,
                    grad_sync=cfg.execution.grad_sync)
    data = SyntheticDataset(size=64, vocab_size=cfg.model.vocab_size, seq_len=32, max_predictions=5)
    stream = BatchStream(data, 4, seed=cfg.train.seed, rank=rank, world_size=WORLD)
    losses, per_step = [], []
    for step in range(STEPS):
        counts.update(reduce_scatter=0, all_gather=0)
        losses.append(engine.step((stream.next() for _ in range(ACCUMULATION)), ACCUMULATION, step)["loss"].item())
        per_step.append(dict(counts))
    state = inner.state_dict()
    weights = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach() for k, v in state.items()}
    return {"losses": losses, "collectives": per_step, "weights": weights, "compute_dtype": str(seen["compute"]),
            "stored_dtypes": sorted({str(p.dtype) for p in inner.parameters()}), **measured}


def _worker(rank: int, directory: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(f"{directory}/store", WORLD), rank=rank,
                            world_size=WORLD)
    counts: dict[str, int] = {}

    def counting(name: str, collective):
        def call(*args, **kwargs):
            counts[name] += 1
            return collective(*args, **kwargs)
        return call

    # FSDP2's default communication looks these up on torch.distributed at each call.
    dist.reduce_scatter_single = counting("reduce_scatter", dist.reduce_scatter_single)
    dist.all_gather_single = counting("all_gather", dist.all_gather_single)
    try:
        results = {name: _train(rank, counts, **execution) for name, execution in CASES.items()}
        if rank == 0:  # a file: the weights are too large for a pipe that is read only after the join
            torch.save(results, f"{directory}/results.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fsdp")
    mp.spawn(_worker, args=(str(directory),), nprocs=WORLD)
    return torch.load(directory / "results.pt", weights_only=True)


def _max_difference(a: dict[str, Any], b: dict[str, Any]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.slow
def test_bf16_computes_with_bf16_weights_and_keeps_fp32_shards(runs):
    fsdp, ddp = runs["fsdp_bf16"], runs["ddp_bf16"]
    assert fsdp["compute_dtype"] == "torch.bfloat16"  # the gathered weights the layer computes with
    assert fsdp["stored_dtypes"] == ["torch.float32"]  # the shards the optimizer steps
    assert ddp["compute_dtype"] == runs["step"]["compute_dtype"] == "torch.float32"  # autocast casts inside ops
    assert fsdp["weights"]["bert.embeddings.word_embeddings.weight"].dtype == torch.float32
    assert len(set(fsdp["losses"])) == STEPS
    # bf16 weights (and so a bf16 residual stream) against autocast over fp32 weights: measured
    # 7.2e-5 relative at most (the fp32 run is 1e-5 from DDP bf16).
    assert fsdp["losses"] == pytest.approx(ddp["losses"], rel=2e-4)


def test_step_sync_reduce_scatters_once_per_step_and_gives_the_same_weights(runs):
    step, micro_batch = runs["step"], runs["micro_batch"]
    assert [c["reduce_scatter"] for c in step["collectives"]] == [UNITS] * STEPS
    assert [c["reduce_scatter"] for c in micro_batch["collectives"]] == [UNITS * ACCUMULATION] * STEPS
    assert runs["fsdp_bf16"]["collectives"] == step["collectives"]  # auto is step without offload
    assert step["losses"] == micro_batch["losses"]  # the first step's weights differ in the last bits only
    # The same gradients summed in another order (micro-batches, then ranks): measured 1.2e-7.
    assert _max_difference(step["weights"], micro_batch["weights"]) < 1e-6


def test_keeping_gathered_layers_saves_the_backward_all_gathers(runs):
    kept, default = runs["keep_gathered"], runs["step"]
    # Per micro-batch: the root and each layer in the forward, each layer again in the backward.
    assert [c["all_gather"] for c in default["collectives"]] == [(UNITS + LAYERS) * ACCUMULATION] * STEPS
    assert [c["all_gather"] for c in kept["collectives"]] == [UNITS * ACCUMULATION] * STEPS
    assert kept["losses"] == default["losses"]
    assert _max_difference(kept["weights"], default["weights"]) == 0.0


def test_grad_sync_step_with_offload_is_a_config_error():
    with pytest.raises(ConfigError, match="execution.fsdp_grad_sync=step cannot be used with execution.offload"):
        check_execution(ExecutionConfig(parallel="fsdp", offload=True, fsdp_grad_sync="step"), world_size=2)
    assert ExecutionConfig(parallel="fsdp", offload=True).grad_sync == "micro_batch"
    assert ExecutionConfig(parallel="fsdp").grad_sync == "step"
    assert ExecutionConfig(offload=True, fsdp_grad_sync="micro_batch").grad_sync == "micro_batch"
    with pytest.raises(ConfigError, match="execution.fsdp_grad_sync: 'never' is not one of auto, step, micro_batch"):
        load_config("tiny", [("execution.fsdp_grad_sync", "never")])


# ------------------------------------------------------------ the planner against the runs

def _plan(name: str):
    from bertforge.parallel.plan import layer_parameters, plan_memory

    cfg = _config(**CASES[name])
    return plan_memory(cfg, world_size=WORLD), layer_parameters(cfg.model)


def test_gathered_parameters_match_the_plan(runs):
    """Bytes of the parameters FSDP holds unsharded (swapped into the model), at their peak."""
    kept, _ = _plan("keep_gathered")
    default, layer = _plan("step")
    bf16, _ = _plan("fsdp_bf16")
    # Every layer stays gathered from its forward to its backward: the root and 4 layers.
    assert runs["keep_gathered"]["gathered_peak"] == kept.details["fsdp_gathered_parameters"]
    # The plan also holds the layer prefetched for the backward, whose all-gather is not yet
    # swapped into the model where these samples see it.
    assert runs["step"]["gathered_peak"] == default.details["fsdp_gathered_parameters"] - 4 * layer
    assert 2 * runs["fsdp_bf16"]["gathered_peak"] == runs["step"]["gathered_peak"]
    assert 2 * bf16.details["fsdp_gathered_parameters"] == default.details["fsdp_gathered_parameters"]


def test_gradients_held_between_micro_batches_match_the_plan(runs):
    """The bytes of live tensors the first micro-batch of a step leaves to the second: unsharded
    fp32 gradients of the whole model with step sync (bf16 parameters too: FSDP2 accumulates in
    the fp32 reduce dtype), this rank's shard of them with micro_batch sync."""
    losses = 64  # and the first micro-batch's losses, a few scalars (measured 28 bytes)
    for name in ("step", "fsdp_bf16", "keep_gathered"):
        plan, _ = _plan(name)
        assert plan.details["fsdp_accumulated_gradients"] == 4 * plan.num_parameters
        assert runs[name]["between_micro_batches"] == pytest.approx(4 * plan.num_parameters, abs=losses)
    plan, _ = _plan("micro_batch")
    assert plan.details["fsdp_accumulated_gradients"] == 0
    assert runs["micro_batch"]["between_micro_batches"] == pytest.approx(plan.gradients, abs=losses)
