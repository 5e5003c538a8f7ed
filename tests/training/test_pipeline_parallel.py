"""Pipeline parallelism (training/pipeline.py) on 2 gloo ranks against one process.

One spawn of two ranks (2 stages of BERT-tiny with 4 layers) trains 3 steps of 4 micro-batches of
2 sequences under each case (GPipe, 1F1B, and 1F1B under bf16 with layer recomputation), dropout
on, and hands back, per rank: the losses and gradient norms of the steps, the gradients the
optimizer received at the first step, the bytes of live tensors in the third step (LiveTensorBytes),
the full model and optimizer state gathered on rank 0, and an evaluation. The test process runs
the same micro-batches through one process (Engine) and compares. A torchrun test trains through
``bertforge pretrain`` and resumes the pipeline's checkpoint in one process.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gloo_worker import run_rank

from bertforge.config import ConfigError, ExecutionConfig, load_config
from bertforge.parallel.dist import check_execution

STEPS, MICRO_BATCHES, ROWS, LAYERS, WORLD = 3, 4, 2, 4, 2
CASES: dict[str, dict[str, Any]] = {
    "gpipe": {"pipeline_schedule": "gpipe"},
    "1f1b": {"pipeline_schedule": "1f1b"},
    "1f1b_bf16_recompute": {"pipeline_schedule": "1f1b", "precision": "bf16", "recompute": "layer"},
}
EVAL_SIZE, EVAL_BATCH = 7, 3  # batches of 3, 3 and 1: a forward-only schedule per shape


def _config(**execution: Any):
    overrides = [("data.seq_len", 64), ("data.max_predictions", 8), ("train.micro_batch_size", ROWS),
                 ("train.global_batch_size", ROWS * MICRO_BATCHES), ("train.warmup_steps", 1),
                 ("model.num_hidden_layers", LAYERS), ("execution.device", "cpu"),
                 ("execution.pipeline_stages", 2)]
    return load_config("tiny", overrides + [(f"execution.{k}", v) for k, v in execution.items()])


def _data(cfg, size: int = 64, seed: int = 12345):
    from bertforge.data import SyntheticDataset

    return SyntheticDataset(size=size, vocab_size=cfg.model.vocab_size, seq_len=cfg.data.seq_len,
                            max_predictions=cfg.data.max_predictions, seed=seed)


def _train(engine, cfg, tracker_factory=None) -> dict[str, Any]:
    """STEPS steps of the engine on the same micro-batches in any process; the optimizer's inputs
    at the first step; live-tensor bytes through the last step (forward/backward, then optimizer)."""
    from bertforge.parallel.dist import unwrap
    from bertforge.training.engine import BatchStream

    stream = BatchStream(_data(cfg), ROWS, seed=cfg.train.seed)
    result: dict[str, Any] = {"losses": [], "grad_norms": []}
    tracker = None

    def before_update(optimizer, args, kwargs) -> None:
        if "grads" not in result:
            result["grads"] = {n: p.grad.detach().clone() for n, p in unwrap(engine.model).named_parameters()
                               if p.grad is not None}
        if tracker is not None:
            result["forward_backward_peak"] = tracker.peak
            tracker.reset_peak()

    engine.optimizer.register_step_pre_hook(before_update)
    for step in range(STEPS):
        batches = [stream.next() for _ in range(MICRO_BATCHES)]
        if step == STEPS - 1 and tracker_factory is not None:
            with tracker_factory() as tracker:
                out = engine.step(batches, MICRO_BATCHES, step)
            result["optimizer_peak"] = tracker.peak
        else:
            out = engine.step(batches, MICRO_BATCHES, step)
        result["losses"].append(out["loss"].item())
        result["grad_norms"].append(out["grad_norm"].item())
        result["mlm_loss"] = out["mlm_loss"].item()
    return result


def _pipeline_case(rank: int, execution: dict[str, Any]) -> dict[str, Any]:
    from bertforge.bench.pretrain import LiveTensorBytes
    from bertforge.models.bert import BertForPreTraining
    from bertforge.parallel.dist import DistContext
    from bertforge.training import pipeline

    cfg = _config(**execution)
    ctx = DistContext(rank, WORLD)
    torch.manual_seed(cfg.train.seed)
    engine = pipeline.build_engine(BertForPreTraining(cfg.model).train(), cfg.execution, cfg.train,
                                            ctx, STEPS)
    result = _train(engine, cfg, LiveTensorBytes)
    result["stage"] = engine.layout.stage
    result["eval"] = engine.evaluate(_data(cfg, EVAL_SIZE, seed=7), EVAL_BATCH)
    result["full_state"] = engine.full_state()  # rank 0: the whole model's; the others: None
    if execution == CASES["gpipe"]:  # loaded back into the stages of a model initialised otherwise
        box = [result["full_state"]]
        dist.broadcast_object_list(box, src=0)
        torch.manual_seed(1)
        fresh = pipeline.build_engine(BertForPreTraining(cfg.model).train(), cfg.execution, cfg.train,
                                               ctx, STEPS)
        fresh.load_full_state(*box[0], "the gathered state")
        result["reloaded"] = (fresh.stage_module.state_dict(), fresh.optimizer.state_dict(),
                              engine.stage_module.state_dict(), engine.optimizer.state_dict())
    return result


def _worker(rank: int, directory: str) -> None:
    def body() -> None:
        results = {name: _pipeline_case(rank, execution) for name, execution in CASES.items()}
        torch.save(results, f"{directory}/rank{rank}.pt")

    run_rank(rank, WORLD, f"{directory}/store", body)


@pytest.fixture(scope="module")
def pipeline_runs(tmp_path_factory) -> dict[str, list[dict[str, Any]]]:
    directory = tmp_path_factory.mktemp("pipeline")
    mp.spawn(_worker, args=(str(directory),), nprocs=WORLD)
    ranks = [torch.load(directory / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    return {name: [ranks[r][name] for r in range(WORLD)] for name in CASES}


def _single_process(name: str) -> tuple[dict[str, Any], Any]:
    """The same steps in one process: the whole model, Engine.step, accumulation over the micro-batches."""
    from bertforge.models.bert import BertForPreTraining
    from bertforge.parallel.dist import DistContext, apply_recompute
    from bertforge.training.engine import Engine
    from bertforge.training.optim import build_optimizer, build_scheduler
    from bertforge.training.pretrain import evaluate, training_loss

    cfg = _config(**CASES[name])
    torch.manual_seed(cfg.train.seed)
    model = BertForPreTraining(cfg.model).train()
    apply_recompute(model, cfg.execution.recompute)
    optimizer = build_optimizer(model, cfg.train)
    engine = Engine(model, optimizer, build_scheduler(optimizer, cfg.train, STEPS), training_loss,
                    cfg.execution.precision, cfg.train.grad_clip, DistContext(), seed=cfg.train.seed)
    result = _train(engine, cfg)
    result["eval"] = evaluate(model, _data(cfg, EVAL_SIZE, seed=7), EVAL_BATCH, torch.device("cpu"),
                              cfg.execution.precision)
    return result, engine


@pytest.fixture(scope="module")
def single_runs() -> dict[str, tuple[dict[str, Any], Any]]:
    torch.set_num_threads(1)
    return {name: _single_process(name) for name in CASES}


def _relative_difference(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """max over tensors of ||got - want|| / ||want||, over tensors whose gradient is not ~0
    (the attention keys' biases have none: softmax does not see a constant)."""
    assert got.keys() == want.keys()
    return max(((got[k].float() - want[k].float()).norm() / want[k].float().norm()).item()
               for k in want if want[k].float().norm() > 1e-6)


def _gathered_grads(ranks: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The gradients of both stages by name; the tied word embedding's must agree on both."""
    grads = dict(ranks[0]["grads"])
    for name, grad in ranks[1]["grads"].items():
        if name in grads:  # the tied weight: each stage's copy holds the sum of both gradients
            assert torch.equal(grads[name], grad), name
        grads[name] = grad
    return grads


FP32_CASES = ["gpipe", "1f1b"]


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("name", FP32_CASES)
def test_losses_and_gradients_equal_one_process(pipeline_runs, single_runs, name):
    ranks, (single, _) = pipeline_runs[name], single_runs[name]
    assert [r["stage"] for r in ranks] == [0, 1]
    assert ranks[0]["losses"] == ranks[1]["losses"]  # all-reduced from the last stage to every rank
    assert len(set(single["losses"])) == STEPS  # the loss moves: the comparison means something
    # Per-micro-batch means, averaged (measured: equal to 2.4e-7 relative at most).
    assert ranks[0]["losses"] == pytest.approx(single["losses"], rel=1e-6, abs=0)
    assert ranks[0]["grad_norms"] == pytest.approx(single["grad_norms"], rel=1e-6, abs=0)
    grads = _gathered_grads(ranks)
    assert grads.keys() == single["grads"].keys()
    # The first step's gradients, clipped by the global norm (measured: 3e-7 at most).
    assert _relative_difference(grads, single["grads"]) < 1e-6


@pytest.mark.dist
def test_bf16_with_recomputation_follows_one_process(pipeline_runs, single_runs):
    """The stages compute under autocast and run the backward outside it, as Engine.step does (a
    backward under autocast rounds differently: 0.7% apart in the gradients), and recompute each
    layer with the dropout masks of its forward (measured: losses equal, gradients 1e-7 apart)."""
    ranks, (single, _) = pipeline_runs["1f1b_bf16_recompute"], single_runs["1f1b_bf16_recompute"]
    assert ranks[0]["losses"] == pytest.approx(single["losses"], rel=1e-6, abs=0)
    assert _relative_difference(_gathered_grads(ranks), single["grads"]) < 1e-6


@pytest.mark.dist
@pytest.mark.parametrize("name", FP32_CASES)
def test_full_state_is_one_processs(pipeline_runs, single_runs, name):
    """The state gathered on rank 0 is the one-process checkpoint's: the same names, the same
    weights after the steps, and the optimizer state in the one-process optimizer's order."""
    gathered, (_, engine) = pipeline_runs[name][0]["full_state"], single_runs[name]
    assert pipeline_runs[name][1]["full_state"] is None
    model_state, optimizer_state = gathered
    want = engine.model.state_dict()
    assert model_state.keys() == want.keys()
    assert max((model_state[k] - want[k]).abs().max().item() for k in want) < 1e-6
    want_optimizer = engine.optimizer.state_dict()
    assert ([g["params"] for g in optimizer_state["param_groups"]]
            == [g["params"] for g in want_optimizer["param_groups"]])
    assert optimizer_state["state"].keys() == want_optimizer["state"].keys()
    for index, state in want_optimizer["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(optimizer_state["state"][index][key], state[key], rtol=1e-5, atol=1e-9)


@pytest.mark.dist
def test_full_state_loads_back_into_the_stages(pipeline_runs):
    for rank in pipeline_runs["gpipe"]:
        weights, optimizer, want_weights, want_optimizer = rank["reloaded"]
        assert weights.keys() == want_weights.keys()
        assert all(torch.equal(weights[k], want_weights[k]) for k in weights)
        assert optimizer["param_groups"] == want_optimizer["param_groups"]
        assert optimizer["state"].keys() == want_optimizer["state"].keys()
        for index, state in want_optimizer["state"].items():
            assert all(torch.equal(torch.as_tensor(optimizer["state"][index][k]), torch.as_tensor(v))
                       for k, v in state.items())


@pytest.mark.dist
def test_evaluation_through_the_pipeline(pipeline_runs, single_runs):
    for name in FP32_CASES:
        for rank in pipeline_runs[name]:
            got, want = rank["eval"], single_runs[name][0]["eval"]
            assert got.keys() == want.keys()
            assert got["sequences"] == want["sequences"] == EVAL_SIZE
            assert got == pytest.approx(want, rel=1e-5)


@pytest.mark.dist
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_step_memory_matches_the_plan(pipeline_runs, name):
    """Bytes of live tensors made in the third step of each stage against the stage's plan: all but
    what was allocated before it (parameters, optimizer state, the schedule's receive buffers)."""
    from bertforge.parallel.plan import plan_memory

    plan = plan_memory(_config(**CASES[name]), world_size=WORLD, device="cpu")
    for rank in pipeline_runs[name]:
        stage = plan.stages[rank["stage"]]
        before = 3 * 4 * stage["parameters"] + stage["buffers"]  # fp32 weights and LAMB's two moments
        # Measured: 0.3% apart at most (forward/backward), 0.75% (optimizer step).
        assert rank["forward_backward_peak"] == pytest.approx(stage["forward_backward"] - before, rel=0.02)
        assert rank["optimizer_peak"] == pytest.approx(stage["optimizer_step"] - before, rel=0.02)


# ------------------------------------------------------------ bertforge pretrain under torchrun

REPO = Path(__file__).resolve().parents[2]


def _run_args(run_dir: Path, name: str, *extra: str) -> list[str]:
    return ["pretrain", "--config", "tiny", "--data.synthetic", "--steps", "4", "--no-progress",
            "--run-dir", str(run_dir), "--name", name, "--data.seq_len", "32", "--data.max_predictions", "5",
            "--train.micro_batch_size", "4", "--train.global_batch_size", "16", "--train.warmup_steps", "1",
            "--log.every", "1", "--log.tensorboard", "false", "--execution.threads", "1",
            "--checkpoint.every", "2", "--checkpoint.keep", "0", *extra]


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("split") != "eval" and "loss" in r]


@pytest.fixture(scope="module")
def pretrain_runs(tmp_path_factory) -> Path:
    """One process; 2 ranks as one pipeline of 2 stages (1F1B); 4 ranks as 2 pipelines of 2 stages
    (GPipe, gradients averaged over the pipelines): the same global batch of 16."""
    from test_dist import run_here, torchrun

    root = tmp_path_factory.mktemp("pretrain")
    run_here(_run_args(root, "single"))
    for name, ranks, extra in (("pipeline", 2, ["--execution.pipeline_stages", "2"]),
                               ("pipelines", 4, ["--execution.pipeline_stages", "2", "--execution.parallel", "ddp",
                                                 "--execution.pipeline_schedule", "gpipe"])):
        result = torchrun(_run_args(root, name, *extra), nproc=ranks)
        assert result.returncode == 0, result.stderr[-4000:]
    return root


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("name", ["pipeline", "pipelines"])
def test_pretrain_with_stages_equals_one_process(pretrain_runs, name):
    from bertforge.formats.load import load_model

    single, staged = _rows(pretrain_runs / "single"), _rows(pretrain_runs / name)
    assert [r["step"] for r in staged] == [1, 2, 3, 4]  # rank 0 (stage 0) logs the last stage's losses
    assert len({r["loss"] for r in single}) == 4
    # Measured: 1e-7 relative at most.
    assert [r["loss"] for r in staged] == pytest.approx([r["loss"] for r in single], rel=1e-6)
    assert [r["grad_norm"] for r in staged] == pytest.approx([r["grad_norm"] for r in single], rel=1e-5)
    # The checkpoint is one process's: the whole model, loadable anywhere.
    got, want = load_model(pretrain_runs / name).state_dict(), load_model(pretrain_runs / "single").state_dict()
    assert got.keys() == want.keys()
    assert max((got[k] - want[k]).abs().max().item() for k in want) < 1e-6
    assert not list((pretrain_runs / name).glob("error_rank*.log"))


@pytest.mark.dist
def test_pipeline_checkpoint_resumes_in_one_process(pretrain_runs, tmp_path):
    import shutil

    from test_dist import run_here

    resumed = tmp_path / "resumed"
    shutil.copytree(pretrain_runs / "pipeline", resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000004")
    rows = _rows(pretrain_runs / "pipeline")[:2]
    (resumed / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_here(["pretrain", "--resume", str(resumed), "--no-progress", "--execution.pipeline_stages", "1"])
    single = _rows(pretrain_runs / "single")
    assert [r["loss"] for r in _rows(resumed)] == pytest.approx([r["loss"] for r in single], rel=1e-6)


# ------------------------------------------------------------ the stages in one process

def _stages_in_sequence(packed: bool, device: torch.device, precision: str) -> None:
    from test_packing import synthetic

    from bertforge.config import MODEL_PRESETS, ModelConfig
    from bertforge.data.feed import to_device, widen
    from bertforge.data.packing import pack_arrays
    from bertforge.models.bert import BertForPreTraining, pretraining_loss
    from bertforge.training.engine import autocast
    from bertforge.training.pipeline import BertStage, pack_targets, unpack_targets
    from bertforge.training.pretrain import forward_loss

    rows = synthetic(12, 64, 10, 500)
    batch = widen(to_device((pack_arrays(rows, 3, seed=2) if packed else rows).to_torch(), device))
    assert ("sequence_ids" in batch) == packed and ("attention_mask" in batch) != packed
    torch.manual_seed(0)
    model = BertForPreTraining(ModelConfig(**{**MODEL_PRESETS["tiny"], "num_hidden_layers": 3},
                                           vocab_size=500)).to(device).train()
    torch.manual_seed(5)
    with autocast(device, precision):
        want = forward_loss(model, batch)
    x, rng = batch["input_ids"], None
    for stage in [BertStage(model, s, 3) for s in range(3)]:
        stage.precision = precision
        inputs = {k: batch[k] for k in stage.inputs if k in batch}
        out = stage(x, seeds=torch.tensor([5]), **inputs) if stage.is_first else stage(x, rng, **inputs)
        if not stage.is_last:
            x, rng = out
    with autocast(device, precision):
        got = pretraining_loss(*out, unpack_targets(*pack_targets(batch)))
    for key in ("loss", "mlm_loss", "nsp_loss", "nsp_count"):
        assert torch.equal(got[key], want[key]), key


@pytest.mark.parametrize("packed", [False, True])
def test_stages_in_sequence_are_the_model(packed):
    """Three stages run one after the other, each handed the hidden and RNG states of the one before,
    give the whole model's losses: padded rows and packed rows, dropout on."""
    _stages_in_sequence(packed, torch.device("cpu"), "fp32")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_stages_in_sequence_are_the_model_on_cuda():
    """The same on CUDA under bf16: the stages hand on the CUDA generator's state (seed and offset)."""
    _stages_in_sequence(False, torch.device("cuda"), "bf16")


def test_other_jobs_refuse_stages():
    from bertforge.parallel.dist import DistContext, prepare_model

    with pytest.raises(ConfigError, match="execution.pipeline_stages=2 is supported by bertforge pretrain only"):
        prepare_model(torch.nn.Linear(1, 1), ExecutionConfig(pipeline_stages=2), DistContext(0, 2))


# ------------------------------------------------------------ configuration

@pytest.mark.parametrize("overrides,message", [
    ([("execution.pipeline_stages", 3), ("model.num_hidden_layers", 2)],
     "execution.pipeline_stages=3 exceeds model.num_hidden_layers=2: each stage needs at least one encoder layer"),
    ([("execution.pipeline_stages", 2), ("execution.parallel", "fsdp")],
     "execution.pipeline_stages=2 cannot be used with execution.parallel=fsdp"),
    ([("execution.pipeline_stages", 2), ("execution.precision", "fp16")],
     "execution.pipeline_stages=2 cannot be used with execution.precision=fp16"),
    ([("execution.pipeline_stages", 2), ("execution.compile", "true")],
     "execution.pipeline_stages=2 cannot be used with execution.compile=true"),
    ([("execution.pipeline_stages", 0)], "execution.pipeline_stages=0 must be at least 1"),
    ([("execution.pipeline_schedule", "zb")], "execution.pipeline_schedule: 'zb' is not one of 1f1b, gpipe"),
])
def test_config_errors_name_the_field(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config("tiny", overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("world_size,parallel,message", [
    (3, "none", "execution.pipeline_stages=2 needs a multiple of 2 ranks (one per stage and pipeline), "
                "but 3 were launched"),
    (1, "none", "but 1 were launched"),
    (4, "none", "4 ranks for execution.pipeline_stages=2 make 2 pipelines, but execution.parallel=none; "
                "use --execution.parallel ddp"),
])
def test_world_size_errors(world_size, parallel, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_execution(ExecutionConfig(pipeline_stages=2, parallel=parallel), world_size)
    check_execution(ExecutionConfig(pipeline_stages=2), 2)  # one pipeline of two stages
    check_execution(ExecutionConfig(pipeline_stages=2, parallel="ddp"), 4)  # two pipelines as replicas


def test_1f1b_needs_a_micro_batch_per_stage():
    from bertforge.training.pipeline import check_micro_batches

    with pytest.raises(ConfigError, match="execution.pipeline_schedule=1f1b needs at least "
                                          "execution.pipeline_stages=4 micro-batches per step and pipeline, got 3"):
        check_micro_batches(ExecutionConfig(pipeline_stages=4), 3)
    check_micro_batches(ExecutionConfig(pipeline_stages=4, pipeline_schedule="gpipe"), 3)


def test_stage_layers_split_rule():
    from bertforge.parallel.plan import stage_layer_counts
    from bertforge.training.pipeline import stage_layers

    assert stage_layers(12, 4) == [range(0, 3), range(3, 6), range(6, 9), range(9, 12)]
    assert stage_layers(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    for layers, stages in ((12, 4), (10, 4), (24, 5), (3, 3)):
        assert stage_layer_counts(layers, stages) == [len(r) for r in stage_layers(layers, stages)]
    with pytest.raises(ConfigError, match="model.num_hidden_layers=2 cannot be split over execution.pipeline_stages=3"):
        stage_layers(2, 3)


def test_targets_pack_exactly():
    from bertforge.training.pipeline import pack_targets, unpack_targets

    batch = {"masked_lm_ids": torch.tensor([[30521, 0], [7, 2**40]]),
             "masked_lm_weights": torch.tensor([[1.0, 0.0], [0.25, 1.0]]),
             "next_sentence_labels": torch.tensor([1, 0]),
             "next_sentence_weights": torch.tensor([[1.0, 0.0], [1.0, 1.0]])}
    packed, layout = pack_targets(batch)
    assert packed.shape == (2, 7) and packed.dtype == torch.float64
    rows = unpack_targets(packed[1:], layout)
    for key, value in batch.items():
        assert rows[key].dtype == value.dtype and torch.equal(rows[key], value[1:])
