"""Distributed training on the CPU: torchrun with 2 gloo ranks against one process.

The runs are BERT-tiny on synthetic sequences of 32 tokens, a global batch of
16 in micro-batches of 4: one process accumulates 4 micro-batches per step,
two ranks accumulate 2 each. Dropout stays on: its masks are seeded per
micro-batch of the global batch, so every world size draws the same ones.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import shared_data
from gloo_worker import run_rank

from bertforge.config import ConfigError, ExecutionConfig
from bertforge.data.record_reader import open_records
from bertforge.formats.load import load_model
from bertforge.parallel.dist import check_execution
from bertforge.runs import CheckpointError, find_checkpoint
from bertforge.training.optim import Lamb

REPO = Path(__file__).resolve().parents[2]
STEPS = 4


# ------------------------------------------------------------ LAMB on shards

def _lamb_on_shards(rank: int, world_size: int, store_path: str, queue) -> None:
    def body() -> None:
        from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

        mesh = init_device_mesh("cpu", (world_size,))
        results = []
        for compiled in (False, True):  # the compiled step all-reduces the norms between its two passes
            weights, grads = _lamb_problem()
            params = [torch.nn.Parameter(distribute_tensor(w, mesh, [Shard(0)])) for w in weights]
            opt = Lamb(params, lr=0.1, weight_decay=0.01, max_trust_ratio=0.0, compiled=compiled)
            for step_grads in grads:
                for p, g in zip(params, step_grads):
                    p.grad = distribute_tensor(g, mesh, [Shard(0)])
                opt.step()
            results.append([p.detach().full_tensor().numpy() for p in params])
        if rank == 0:
            queue.put(results)

    run_rank(rank, world_size, store_path, body)


def _lamb_problem():
    """Weights of uneven shapes (one with fewer rows than ranks) and two steps of gradients."""
    gen = torch.Generator().manual_seed(3)
    shapes = [(5, 3), (1, 4), (7,), (2, 2)]
    weights = [torch.randn(s, generator=gen) * (i + 1) for i, s in enumerate(shapes)]
    # Rows of very different size: a trust ratio from one rank's part would be far off.
    weights[0][:3] *= 10.0
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(2)]
    return weights, grads


def test_lamb_trust_ratio_on_shards_is_the_whole_tensors(tmp_path):
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_lamb_on_shards, args=(2, str(tmp_path / "store"), queue), nprocs=2)
    sharded, sharded_compiled = ([torch.from_numpy(a) for a in run] for run in queue.get())

    weights, grads = _lamb_problem()
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = Lamb(params, lr=0.1, weight_decay=0.01, max_trust_ratio=0.0)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    for got, compiled, want, start in zip(sharded, sharded_compiled, params, weights):
        assert torch.allclose(got, want.detach(), rtol=1e-6, atol=1e-7)
        assert torch.allclose(compiled, want.detach(), rtol=1e-6, atol=1e-7)
        assert not torch.allclose(got, start, rtol=1e-3)  # the steps moved the weights

    # The same steps with the norms of rank 0's rows only end elsewhere: the check can fail.
    local = [torch.nn.Parameter(w[:3].clone()) for w in weights[:1]]
    opt = Lamb(local, lr=0.1, weight_decay=0.01, max_trust_ratio=0.0)
    for step_grads in grads:
        local[0].grad = step_grads[0][:3].clone()
        opt.step()
    assert not torch.allclose(local[0].detach(), sharded[0][:3], rtol=1e-3)


# ------------------------------------------------------------ whole runs

def run_args(run_dir: Path, name: str, parallel: str = "none", *extra: str) -> list[str]:
    return ["pretrain", "--config", "tiny", "--data.synthetic", "--steps", str(STEPS), "--no-progress",
            "--run-dir", str(run_dir), "--name", name, "--data.seq_len", "32", "--data.max_predictions", "5",
            "--train.micro_batch_size", "4", "--train.global_batch_size", "16", "--train.warmup_steps", "1",
            "--log.every", "1", "--log.tensorboard", "false", "--execution.threads", "1",
            "--execution.parallel", parallel, "--checkpoint.every", "2", "--checkpoint.keep", "0", *extra]


def torchrun(args: list[str], nproc: int = 2) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--standalone",
           "-m", "bertforge", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)


def run_here(args: list[str]) -> None:
    from bertforge.cli import main

    assert main(args) == 0


def train_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("split") != "eval"]


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in train_rows(run_dir)]


def interrupted_copy(run_dir: Path, to: Path, at_step: int) -> Path:
    """The run as it was when checkpoint ``at_step`` was its newest."""
    shutil.copytree(run_dir, to)
    for step_dir in (to / "checkpoints").iterdir():
        if int(step_dir.name.removeprefix("step_")) > at_step:
            shutil.rmtree(step_dir)
    rows = train_rows(run_dir)[:at_step]
    (to / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return to


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process (accumulating 4 micro-batches), and ddp and fsdp on 2 ranks (2 each)."""
    root = tmp_path_factory.mktemp("dist")
    run_here(run_args(root, "single"))
    for parallel in ("ddp", "fsdp"):
        result = torchrun(run_args(root, parallel, parallel))
        assert result.returncode == 0, result.stderr[-4000:]
    return root


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_ranks_give_the_losses_of_one_process(runs, parallel):
    single, parallel_rows = train_rows(runs / "single"), train_rows(runs / parallel)
    assert [r["step"] for r in parallel_rows] == list(range(1, STEPS + 1))  # rank 0 alone logs
    assert len({r["loss"] for r in single}) == STEPS  # the loss moves: the comparison means something
    assert [r["loss"] for r in parallel_rows] == pytest.approx([r["loss"] for r in single], rel=1e-5)
    # torch's fp32 norm of a 4M-element gradient is itself only good to ~1e-4.
    assert [r["grad_norm"] for r in parallel_rows] == pytest.approx([r["grad_norm"] for r in single], rel=1e-4)
    assert not list((runs / parallel).glob("error_rank*.log"))


def test_fsdp_trains_a_modernbert_as_one_process(tmp_path):
    """ModernBERT's layers are FSDP's units as BERT's are (model.EncoderLayer, applied from outside
    the model): 2 ranks give one process's losses."""
    extra = ("--model.preset", "modernbert-tiny", "--train.objective", "mlm")
    run_here(run_args(tmp_path, "single", "none", *extra))
    result = torchrun(run_args(tmp_path, "fsdp", "fsdp", *extra))
    assert result.returncode == 0, result.stderr[-4000:]
    single, sharded = losses(tmp_path / "single"), losses(tmp_path / "fsdp")
    assert len(set(single)) == STEPS  # the loss moves: the comparison means something
    assert sharded == pytest.approx(single, rel=1e-5)


def test_fsdp_checkpoint_holds_shards_and_full_weights(runs):
    step = find_checkpoint(runs / "fsdp")
    assert step.name == f"step_{STEPS:08d}" and not (step / "optimizer.pt").exists()
    assert sorted(p.name for p in (step / "sharded").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    fsdp, single = load_model(runs / "fsdp").state_dict(), load_model(runs / "single").state_dict()
    assert fsdp.keys() == single.keys()
    assert max((fsdp[k] - single[k]).abs().max().item() for k in fsdp) < 1e-5


def test_fsdp_resume_is_exact(runs, tmp_path):
    run = interrupted_copy(runs / "fsdp", tmp_path / "fsdp", at_step=2)
    result = torchrun(["pretrain", "--resume", str(run), "--no-progress"])
    assert result.returncode == 0, result.stderr[-4000:]
    assert losses(run) == losses(runs / "fsdp")
    resumed, uninterrupted = load_model(run).state_dict(), load_model(runs / "fsdp").state_dict()
    assert all(torch.equal(v, uninterrupted[k]) for k, v in resumed.items())


class _RunsCode:
    """Unpickling this would run a function: what a tampered checkpoint would carry."""

    def __reduce__(self):
        return (os.getcwd, ())


def test_sharded_checkpoint_metadata_is_not_blindly_unpickled(runs, tmp_path, capsys):
    import pickle

    from bertforge.cli import main

    run = interrupted_copy(runs / "fsdp", tmp_path / "fsdp", at_step=2)
    metadata = find_checkpoint(run) / "sharded" / ".metadata"
    metadata.write_bytes(pickle.dumps({"storage_data": _RunsCode()}))
    # The manifest would refuse the changed file first; without one (an older checkpoint, or a
    # tampered manifest) the allowlist is what stops it.
    (find_checkpoint(run) / "manifest.json").unlink()
    assert main(["pretrain", "--resume", str(run), "--no-progress"]) == 2
    assert "metadata refers to posix.getcwd, which a checkpoint never needs" in capsys.readouterr().err


@pytest.mark.parametrize("saved, resumed", [("ddp", "none"), ("ddp", "fsdp"), ("fsdp", "fsdp"), ("fsdp", "none")])
def test_resume_on_one_rank_continues_the_two_rank_run(runs, tmp_path, saved, resumed):
    # The in-memory data position counts micro-batches of all ranks; DCP reshards fsdp's
    # state, and a full optimizer.pt is sharded on load.
    run = interrupted_copy(runs / saved, tmp_path / saved, at_step=2)
    run_here(["pretrain", "--resume", str(run), "--no-progress", "--execution.parallel", resumed])
    assert losses(run) == pytest.approx(losses(runs / saved), rel=1e-5)
    # Optimizer moments lost on the way would move the weights by ~lr = 1e-3.
    after, uninterrupted = load_model(run).state_dict(), load_model(runs / saved).state_dict()
    assert max((after[k] - uninterrupted[k]).abs().max().item() for k in after) < 1e-5


def test_resume_with_record_shards_needs_the_same_world_size(runs):
    from bertforge.training.pretrain import check_resume

    step = find_checkpoint(runs / "fsdp")
    saved = torch.load(step / "trainer.pt", weights_only=True)
    assert saved["world_size"] == 2 and saved["parallel"] == "fsdp"
    with pytest.raises(CheckpointError, match=r"saved by 2 rank\(s\) and this run has 4: the position "
                                              r"in record shards is per rank"):
        check_resume(step, saved, 4, streamed=True)
    check_resume(step, saved, 2, streamed=True)
    check_resume(step, saved, 4, streamed=False)  # in memory: any world size


@pytest.mark.parametrize("extra", [("--execution.recompute", "layer"), ("--execution.recompute", "attention"),
                                   ("--execution.parallel", "fsdp", "--execution.offload", "true")],
                         ids=["recompute-layer", "recompute-attention", "offload"])
def test_recompute_and_offload_give_the_same_losses(runs, tmp_path, extra):
    run_here(run_args(tmp_path, "run", "none", *extra))
    assert losses(tmp_path / "run") == pytest.approx(losses(runs / "single"), rel=1e-6)


def test_a_failing_rank_leaves_its_traceback(tmp_path):
    # 16 sequences cannot be split into micro-batches of 16 on each of 2 ranks.
    result = torchrun(run_args(tmp_path, "bad", "ddp", "--train.micro_batch_size", "16"))
    assert result.returncode != 0
    message = ("train.global_batch_size=16 is not a multiple of train.micro_batch_size × world size = 32 "
               "(micro-batch 16 × 2 rank(s))")
    assert message in result.stderr
    for rank in (0, 1):
        assert message in (tmp_path / "bad" / f"error_rank{rank}.log").read_text()


# ------------------------------------------------------------ pieces

def test_each_start_of_a_group_agrees_on_fresh_keys_in_the_kept_store():
    """torchrun's store outlives the group's starts. A second start, in which ranks 1 and 2 read
    the first start's name before rank 0 writes a new one, still agrees on one new prefix: a name
    whose rank 0 is gone is never confirmed. About 2 s."""
    import threading
    from datetime import timedelta

    from bertforge.parallel.dist import _fresh_prefix

    store = dist.HashStore()  # stands in for the agent's TCPStore: the same calls

    def start(rank_0_delay: float) -> dict[int, str]:
        prefixes: dict[int, str] = {}

        def rank(r: int) -> None:
            prefixes[r] = _fresh_prefix(store, r, 3, timedelta(seconds=30))

        others = [threading.Thread(target=rank, args=(r,)) for r in (1, 2)]
        for thread in others:
            thread.start()
        threading.Event().wait(rank_0_delay)
        rank(0)
        for thread in others:
            thread.join()
        return prefixes

    first = start(0.0)
    assert len(set(first.values())) == 1
    second = start(0.3)  # ranks 1 and 2 find the first start's name and its confirmations
    assert len(set(second.values())) == 1 and second[0] != first[0]
    assert second[0].startswith("bertforge/") and second[0].endswith("/")


def test_execution_settings_that_cannot_work_are_config_errors():
    with pytest.raises(ConfigError, match="2 processes were launched but execution.parallel=none"):
        check_execution(ExecutionConfig(parallel="none"), world_size=2)
    with pytest.raises(ConfigError, match="execution.offload=true needs execution.parallel=fsdp, not ddp"):
        check_execution(ExecutionConfig(parallel="ddp", offload=True), world_size=2)
    with pytest.raises(ConfigError, match="execution.precision=fp16 is not supported with execution.parallel=fsdp"):
        check_execution(ExecutionConfig(parallel="fsdp", precision="fp16"), world_size=1)
    check_execution(ExecutionConfig(parallel="fsdp", offload=True), world_size=1)


def test_batch_stream_ranks_split_each_step_of_one_process():
    from bertforge.data import SyntheticDataset
    from bertforge.training.engine import BatchStream

    data = SyntheticDataset(size=40, vocab_size=50, seq_len=8, max_predictions=2, seed=1)
    one = BatchStream(data, batch_size=3, seed=7)  # 13 micro-batches per epoch: steps cross epochs
    ranks = [BatchStream(data, batch_size=3, seed=7, rank=r, world_size=2) for r in (0, 1)]
    for _ in range(9):  # steps of 4 micro-batches: 2 per rank
        expected = [one.next()["input_ids"] for _ in range(4)]
        got = [[s.next()["input_ids"] for _ in range(2)] for s in ranks]
        assert all(torch.equal(a, b) for a, b in zip(expected, [got[0][0], got[1][0], got[0][1], got[1][1]]))
        assert ranks[0].state() == ranks[1].state() == one.state()
    assert one.state() == {"epoch": 2, "index": 10}
    resumed = BatchStream(data, batch_size=3, seed=7, rank=1, world_size=2, **one.state())
    one.next()
    assert torch.equal(resumed.next()["input_ids"], one.next()["input_ids"])


def test_record_shards_give_every_rank_the_same_number_of_batches(tmp_path):
    from bertforge.data import SyntheticDataset
    from bertforge.data.loader import RecordStream
    from bertforge.data.record_writer import write_records

    arrays = SyntheticDataset(size=23, vocab_size=50, seq_len=8, max_predictions=2, seed=1).arrays
    files = [tmp_path / "a.native", tmp_path / "b.native"]
    write_records(files[0], arrays.take(slice(0, 10)), fmt="native")
    write_records(files[1], arrays.take(slice(10, 23)), fmt="native")  # 23 records: one left over for 2 ranks
    streams = [RecordStream(files, 3, seed=5, rank=r, world_size=2, shuffle_buffer=4) for r in (0, 1)]
    assert [s.batches_per_epoch for s in streams] == [3, 3]  # 11 records each, 3 batches of 3
    seen = [[], []]
    for _ in range(2 * 3):  # two epochs, batch by batch in step on both ranks
        for r, s in enumerate(streams):
            seen[r].append(s.next()["input_ids"])
    assert streams[0].state() == streams[1].state() == {"epoch": 1, "index": 3}
    first_epoch = [{tuple(row.tolist()) for b in seen[r][:3] for row in b} for r in (0, 1)]
    assert len(first_epoch[0]) == len(first_epoch[1]) == 9 and not first_epoch[0] & first_epoch[1]


# ------------------------------------------------------------ compilation

COMPILE_ONCE = """
import json, sys, torch
import torch._dynamo.utils
from bertforge.config import ExecutionConfig
from bertforge.parallel.dist import DistContext, prepare_model
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
model = prepare_model(model, ExecutionConfig(compile=True, compile_cache=sys.argv[1]), DistContext())
model(torch.randn(4, 8)).sum().backward()
print(json.dumps(dict(torch._dynamo.utils.counters["inductor"])))
"""


@pytest.mark.slow
def test_compile_cache_persists_across_processes(tmp_path):
    cache = tmp_path / "cache"

    def compile_in_a_new_process() -> dict:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        result = subprocess.run([sys.executable, "-c", COMPILE_ONCE, str(cache)], cwd=REPO, env=env,
                                capture_output=True, text=True, timeout=300, check=False)
        assert result.returncode == 0, result.stderr[-4000:]
        return json.loads(result.stdout.strip().splitlines()[-1])

    first = compile_in_a_new_process()
    assert first.get("fxgraph_cache_miss", 0) >= 2 and first.get("fxgraph_cache_hit", 0) == 0  # forward, backward
    assert any(cache.iterdir())
    second = compile_in_a_new_process()
    assert second.get("fxgraph_cache_hit", 0) >= 2 and second.get("fxgraph_cache_miss", 0) == 0


PRETRAIN_COUNTING = """
import json, sys
import torch._dynamo.utils
from bertforge.cli import main
rc = main(sys.argv[1:])
print(json.dumps({"rc": rc, **{key: dict(value) for key, value in torch._dynamo.utils.counters.items()}}))
"""


@pytest.mark.slow
def test_compile_only_leaves_the_runs_graphs_in_the_cache_and_no_run(tmp_path, capsys):
    """A one-layer BERT on the shared records (real padding; about 60 s of compiling on 2 cores):
    --compile-only compiles the training step's forward and backward graphs (model and loss) and the
    evaluation's, without a graph break; the run after it compiles nothing, although its 7th batch,
    unlike the first, has no padding (3397f00 compiled a second graph for it, 34 s)."""
    records = shared_data("tfrecord/graphcore_sample_text.tfrecord")
    vocab = shared_data("vocab/bert-base-uncased-vocab.txt")
    runs, cache = tmp_path / "runs", tmp_path / "cache"
    args = ["pretrain", "--config", "tiny", "--data.input", str(records), "--data.eval_input", str(records),
            "--data.vocab", str(vocab), "--data.shuffle_buffer", "0", "--model.num_hidden_layers", "1",
            "--model.hidden_size", "32", "--model.num_attention_heads", "2", "--model.intermediate_size", "64",
            "--train.micro_batch_size", "4", "--train.global_batch_size", "4", "--train.steps", "7",
            "--train.eval_batches", "2", "--execution.threads", "2", "--execution.compile", "true",
            "--execution.compile_cache", str(cache), "--log.run_dir", str(runs), "--no-progress",
            "--log.tensorboard", "false"]
    with open_records(records, verify=False) as file:  # in file order (shuffle_buffer 0), batches of 4
        padded = [not bool(file.take(np.arange(i, i + 4)).input_mask.all()) for i in range(0, 28, 4)]
    assert padded == [True] * 6 + [False]

    def run(*extra: str) -> dict:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        result = subprocess.run([sys.executable, "-c", PRETRAIN_COUNTING, *args, *extra], cwd=REPO, env=env,
                                capture_output=True, text=True, timeout=900, check=False)
        assert result.returncode == 0, result.stderr[-4000:]
        if extra:  # compile-only names no checkpoint (3397f00 named one, then removed it)
            assert "checkpoint:" not in result.stdout + result.stderr
        return json.loads(result.stdout.strip().splitlines()[-1])

    compiled = run("--compile-only")
    assert compiled["rc"] == 0 and compiled.get("graph_break", {}) == {}
    # The model and the loss, forward and backward, in training; the two forwards in evaluation.
    assert compiled["inductor"]["fxgraph_cache_miss"] >= 6
    assert list(runs.iterdir()) == [] and any(cache.iterdir())
    warm = run()
    assert warm["rc"] == 0 and warm.get("graph_break", {}) == {}, warm
    assert warm["inductor"].get("fxgraph_cache_miss", 0) == 0
    assert warm["inductor"]["fxgraph_cache_hit"] == compiled["inductor"]["fxgraph_cache_miss"]
    assert warm["frames"]["total"] == compiled["frames"]["total"]  # no graph recompiled for another variant
    # Where the config does not compile (auto on a CPU) there is nothing to do: one line, no run.
    from bertforge.cli import main

    assert main([*args, "--execution.compile", "auto", "--compile-only"]) == 2
    assert capsys.readouterr().err == ("error: execution.compile=auto does not compile on cpu (auto: on CUDA only), "
                                       "so there is nothing to compile: give the run and --compile-only "
                                       "--execution.compile true\n")
    assert len(list(runs.iterdir())) == 1  # the warm run's


@pytest.mark.skipif(not os.environ.get("BERTFORGE_SLOW_TESTS"),
                    reason="compiles BERT-tiny: 40-80 s on 2 CPU cores; set BERTFORGE_SLOW_TESTS=1")
def test_compiled_training_gives_the_same_losses(runs, tmp_path, monkeypatch):
    import torch._inductor.config

    # Inductor draws dropout masks with its own RNG unless told to use eager's.
    monkeypatch.setattr(torch._inductor.config, "fallback_random", True)
    run_here(run_args(tmp_path, "compiled", "none", "--execution.compile", "true",
                      "--execution.compile_cache", str(tmp_path / "cache")))
    assert losses(tmp_path / "compiled") == pytest.approx(losses(runs / "single"), rel=1e-4)
