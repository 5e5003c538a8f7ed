"""Many machines: two torchrun node launchers on this machine train, resume and survive a lost node
exactly as one launcher with the same world size.

Each launcher is one "node" (``--nnodes 2 --nproc-per-node 1``); they meet by c10d rendezvous on
127.0.0.1. The reference is one launcher with ``--nproc-per-node 2``: the same two ranks, the same
data split and the same reductions, so the results must be equal, not close. The runs are those of
test_preemption (BERT-tiny, synthetic, constant learning rate, DDP on gloo).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import wait_until
from test_preemption import REPO, checkpoints, env, finish, losses, run_args, torchrun, train_rows, worker_pids

from bertforge.formats.load import load_model

pytestmark = pytest.mark.dist

STEPS = 10
# --resume auto: one command for the first start and every restart. A short collective timeout,
# so that a rank that waits for a lost one fails in seconds, not in torch's 30 minutes.
ARGS = ("--execution.parallel", "ddp", "--checkpoint.every", "2", "--resume", "auto",
        "--execution.dist_timeout", "30")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def node(run_root: Path, name: str, steps: int, port: int, host: bool,
         extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    """One node's launcher; ``host``: it holds the rendezvous store (the others connect to it)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", name,
           "--rdzv-conf", f"is_host={int(host)}", "--max-restarts", "1",
           "-m", "bertforge", *run_args(run_root, name, steps, *ARGS)]
    return subprocess.Popen(cmd, cwd=REPO, env={**env(), **(extra_env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def finish_ok(*launchers: subprocess.Popen) -> None:
    for launcher in launchers:
        stderr = finish(launcher, 240)
        assert launcher.returncode == 0, stderr[-3000:]


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_model(path).state_dict()


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    assert all(torch.equal(v, wb[k]) for k, v in wa.items())


@pytest.fixture(scope="module")
def one_launcher(tmp_path_factory) -> Path:
    """The reference: one launcher, 2 ranks, STEPS steps, a checkpoint every 2."""
    root = tmp_path_factory.mktemp("one_launcher")
    launcher = torchrun(run_args(root, "one", STEPS, *ARGS), "--standalone")
    finish_ok(launcher)
    return root / "one"


@pytest.mark.slow
def test_two_node_launchers_train_and_resume_as_one_launcher(one_launcher, tmp_path):
    """4 steps on two nodes, then the same command for STEPS steps resumes from step 4: each part
    equals the one-launcher run. About 30 s."""
    port, run = free_port(), tmp_path / "two"
    finish_ok(node(tmp_path, "two", 4, port, host=True), node(tmp_path, "two", 4, port, host=False))
    assert losses(run) == losses(one_launcher)[:4]
    assert_same_weights(run / "checkpoints" / "step_00000004", one_launcher / "checkpoints" / "step_00000004")

    port = free_port()
    finish_ok(node(tmp_path, "two", STEPS, port, host=True), node(tmp_path, "two", STEPS, port, host=False))
    assert [r["step"] for r in train_rows(run)] == list(range(1, STEPS + 1))
    assert losses(run) == losses(one_launcher)
    assert_same_weights(run, one_launcher)


@pytest.mark.slow
def test_a_lost_node_is_replaced_and_the_run_continues_exactly(one_launcher, tmp_path):
    """Node b (launcher and worker) is killed after step 3, as when its machine fails; node a's
    worker fails on the lost connection, its launcher restarts the group (--max-restarts 1) with
    a replacement launcher for b, and --resume auto continues from the last checkpoint to the
    weights of the uninterrupted run. About 40 s."""
    port, run = free_port(), tmp_path / "lost"
    # torch 2.13's agents share a store that a new node cannot join while rank 0's node lives on:
    # see README, "Many machines".
    fresh_store = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    a = node(tmp_path, "lost", STEPS, port, host=True, extra_env=fresh_store)
    b = node(tmp_path, "lost", STEPS, port, host=False, extra_env=fresh_store)
    wait_until(lambda: len(train_rows(run)) >= 3, a, b, what="no third step")
    workers = worker_pids(b.pid)
    os.killpg(b.pid, signal.SIGKILL)
    for pid in workers.values():  # torchrun starts each worker in a session of its own
        os.kill(pid, signal.SIGKILL)
    killed_after = train_rows(run)[-1]["step"]
    b.communicate()
    assert 3 <= killed_after < STEPS and "step_00000002" in checkpoints(run)

    replacement = node(tmp_path, "lost", STEPS, port, host=False, extra_env=fresh_store)
    finish_ok(a, replacement)
    survivor_errors = [p.read_text() for p in run.glob("error_rank*.log")]
    assert len(survivor_errors) == 1 and "Connection" in survivor_errors[0]  # it did lose its peer
    assert [r["step"] for r in train_rows(run)] == list(range(1, STEPS + 1))  # each step once
    assert losses(run) == losses(one_launcher)
    assert_same_weights(run, one_launcher)
