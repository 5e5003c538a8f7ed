"""Runs survive preemption and restarts: SIGTERM, ``--resume auto``, torchrun --max-restarts.

The runs are BERT-tiny on synthetic sequences of 32 tokens with a constant
learning rate, so a run of N steps is the first N steps of any longer one and
a preempted run can be compared with an uninterrupted one of the same length.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import test_squad_cli
import torch
from conftest import HANG_GUARD_S, live_run, shared_data, wait_until

from bertforge.cli import main
from bertforge.config import ConfigError, load_config
from bertforge.data.record_reader import read_records
from bertforge.data.record_writer import write_records
from bertforge.formats.load import load_model
from bertforge.runs import write_manifest
from bertforge.training.checkpoint import read_trainer_state

REPO = Path(__file__).resolve().parents[2]


def run_args(run_dir: Path, name: str, steps: int, *extra: str) -> list[str]:
    return ["pretrain", "--config", "tiny", "--data.synthetic", "--steps", str(steps), "--no-progress",
            "--run-dir", str(run_dir), "--name", name, "--data.seq_len", "32", "--data.max_predictions", "5",
            "--train.micro_batch_size", "4", "--train.global_batch_size", "8", "--train.schedule", "constant",
            "--train.warmup_steps", "0", "--log.every", "1", "--log.tensorboard", "false",
            "--execution.threads", "1", "--checkpoint.keep", "0", *extra]


def env() -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    clean["PYTHONPATH"] = os.pathsep.join([str(REPO), clean.get("PYTHONPATH", "")])
    return clean


def train_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    return [r for r in rows if r.get("split") != "eval"]


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in train_rows(run_dir)]


def checkpoints(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def wait_for_rows(run_dir: Path, process: subprocess.Popen) -> None:
    """Until the run logs its first step; fails if ``process`` exits first."""
    wait_until(lambda: bool(train_rows(run_dir)), process, what="no step was logged")


def finish(process: subprocess.Popen, timeout: float = 300, stdout: list[str] | None = None) -> str:
    """The stderr of ``process`` once it exits (its stdout appended to ``stdout`` when given);
    killed (its whole group) if it outlives ``timeout``."""
    try:
        out, err = process.communicate(timeout=timeout)
        if stdout is not None:
            stdout.append(out)
        return err
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise


def worker_pids(launcher: int) -> dict[int, int]:
    """{rank: pid} of the worker processes torchrun started."""
    pids: dict[int, int] = {}
    for task in Path(f"/proc/{launcher}/task").iterdir():
        for child in (task / "children").read_text().split():
            environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            ranks = [e.split(b"=", 1)[1] for e in environ if e.startswith(b"RANK=")]
            if ranks:
                pids[int(ranks[0])] = int(child)
    return pids


def sigterm_after_first_rows(run: Path, argv: list[str], stdout: list[str] | None = None) -> int:
    """Run ``bertforge ARGV`` (of 100,000 steps) writing ``run``, SIGTERM it after its first logged step,
    check that it stopped cleanly (exit 0, one checkpoint of the step, the preemption line); that step
    (and what it printed, appended to ``stdout`` when given)."""
    process = subprocess.Popen([sys.executable, "-m", "bertforge", *argv], cwd=REPO, env=env(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    wait_for_rows(run, process)
    process.send_signal(signal.SIGTERM)
    stderr = finish(process, 120, stdout)
    assert process.returncode == 0, stderr[-3000:]
    stopped = train_rows(run)[-1]["step"]
    assert 1 <= stopped < 100_000
    assert checkpoints(run) == [f"step_{stopped:08d}"]
    assert (f"preempted by SIGTERM after step {stopped}: checkpoint {run}/checkpoints/step_{stopped:08d}; "
            f"continue with --resume {run}") in " ".join(stderr.split())
    return stopped


@pytest.mark.slow
def test_sigterm_checkpoints_the_step_and_resumes_exactly(tmp_path):
    """One process, SIGTERM after the first logged step: exit 0, a checkpoint of the step it
    stopped at, and resuming gives the losses of an uninterrupted run. About 15 s."""
    run = tmp_path / "pre"
    stopped = sigterm_after_first_rows(run, run_args(tmp_path, "pre", 100_000))
    assert [r["step"] for r in train_rows(run)] == list(range(1, stopped + 1))

    assert main(["pretrain", "--resume", str(run), "--steps", str(stopped + 3), "--no-progress"]) == 0
    assert main(run_args(tmp_path, "whole", stopped + 3)) == 0
    assert [r["step"] for r in train_rows(run)] == list(range(1, stopped + 4))  # each step once
    assert losses(run) == losses(tmp_path / "whole")
    resumed, whole = load_model(run).state_dict(), load_model(tmp_path / "whole").state_dict()
    assert all(torch.equal(v, whole[k]) for k, v in resumed.items())


SECOND_SIGNAL = """
import os, signal
from bertforge.training.engine import Preemption
with Preemption() as preemption:
    preemption.on_hard_exit = lambda: print("hard exit", flush=True)
    os.kill(os.getpid(), signal.SIGUSR1)
    assert preemption.requested and preemption.name == "SIGUSR1"
    print("after the first signal", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    print("after the second signal", flush=True)
"""


def test_a_second_signal_exits_at_once():
    """SIGUSR1 asks for a checkpoint; a second signal exits with 128 + SIGTERM at once: through
    on_hard_exit, before the next statement runs (issue 41.6: no clock, so no load can fail it)."""
    result = subprocess.run([sys.executable, "-c", SECOND_SIGNAL], cwd=REPO, env=env(), capture_output=True,
                            text=True, timeout=300, check=False)
    assert result.returncode == 128 + signal.SIGTERM, result.stderr
    assert result.stdout.splitlines() == ["after the first signal", "hard exit"]
    assert result.stderr.splitlines()[-2:] == [
        "SIGUSR1: finishing this step, then saving a checkpoint (send it again to exit at once)",
        "SIGTERM again: exiting now, without a checkpoint"]



@pytest.mark.slow
def test_a_second_signal_in_the_first_step_leaves_no_run_directory(tmp_path):
    """A run directory made by a run whose first step (BERT-base, seconds on a CPU) a second signal
    cuts short is removed with it, as one that failed before its first step: nothing in it to keep
    (docs/reliability.md). About 15 s."""
    run = tmp_path / "cut"
    argv = [*run_args(tmp_path, "cut", 100), "--config", "base", "--data.seq_len", "128",
            "--train.micro_batch_size", "8", "--train.global_batch_size", "8"]
    process = subprocess.Popen([sys.executable, "-m", "bertforge", *argv], cwd=REPO, env=env(),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    seen: list[str] = []
    try:
        assert process.stderr is not None
        for line in process.stderr:  # the console's lines
            seen.append(line)
            if line == f"run directory: {run}\n":  # the run is in its first step
                assert run.is_dir() and (run / "config.yaml").is_file() and not train_rows(run)
                process.send_signal(signal.SIGTERM)
            elif line.startswith("SIGTERM: finishing this step"):
                process.send_signal(signal.SIGTERM)
                break
        stderr = "".join(seen) + finish(process, 120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    assert process.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "SIGTERM again: exiting now, without a checkpoint" in stderr
    assert not run.exists() and sorted(p.name for p in tmp_path.iterdir()) == []


def test_resume_auto_starts_fresh_then_resumes(tmp_path, capsys):
    """``--resume auto``: the same command starts a run and continues it. About 6 s."""
    assert main(run_args(tmp_path, "auto", 4, "--checkpoint.every", "2", "--resume", "auto")) == 0
    assert checkpoints(tmp_path / "auto") == ["step_00000002", "step_00000004"]
    assert main(run_args(tmp_path, "auto", 6, "--checkpoint.every", "2", "--resume", "auto")) == 0
    assert checkpoints(tmp_path / "auto") == ["step_00000002", "step_00000004", "step_00000006"]
    assert main(run_args(tmp_path, "whole", 6)) == 0
    assert [r["step"] for r in train_rows(tmp_path / "auto")] == [1, 2, 3, 4, 5, 6]
    assert losses(tmp_path / "auto") == losses(tmp_path / "whole")
    # No --config: the saved config of the run, with the flags on top.
    assert main(["pretrain", "--resume", "auto", "--run-dir", str(tmp_path), "--name", "auto",
                 "--steps", "7", "--no-progress"]) == 0
    assert [r["step"] for r in train_rows(tmp_path / "auto")] == [1, 2, 3, 4, 5, 6, 7]
    capsys.readouterr()
    assert main(["pretrain", "--resume", "auto", "--run-dir", str(tmp_path), "--steps", "1"]) == 2
    assert capsys.readouterr().err == ("error: --resume auto needs a named run directory: pass --name "
                                       "(log.name), so that every restart finds the same one\n")


def test_resume_auto_needs_a_name_in_config_from_args():
    import argparse

    from bertforge.runs import config_from_args

    for config in (None, "tiny"):  # a config named too: refused before torch loads, not when the run starts
        args = argparse.Namespace(config=config, resume="auto", name=None, run_dir=None)
        with pytest.raises(ConfigError, match="--resume auto needs a named run directory"):
            config_from_args(args, [], default="tiny")
    cfg = load_config("tiny", [("checkpoint.resume", "auto")])
    with pytest.raises(ConfigError, match="--resume auto needs a named run directory"):
        import contextlib

        from bertforge.training.pretrain import locate_run

        locate_run(cfg.checkpoint.resume, cfg.log, contextlib.ExitStack())


def torchrun(args: list[str], *launcher: str, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", *launcher,
           "-m", "bertforge", *args]
    return subprocess.Popen(cmd, cwd=REPO, env={**env(), **(extra_env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


@pytest.mark.slow
@pytest.mark.dist
def test_sigterm_to_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    """torchrun, 2 gloo ranks (ddp): SIGTERM to rank 1 alone; both ranks finish the same step,
    checkpoint it and exit 0, and the run resumes. About 25 s."""
    run = tmp_path / "ddp"
    launcher = torchrun(run_args(tmp_path, "ddp", 100_000, "--execution.parallel", "ddp"), "--standalone")
    wait_for_rows(run, launcher)
    pids = worker_pids(launcher.pid)
    assert sorted(pids) == [0, 1]
    os.kill(pids[1], signal.SIGTERM)
    stderr = finish(launcher, 120)
    assert launcher.returncode == 0, stderr[-3000:]
    stopped = train_rows(run)[-1]["step"]
    assert checkpoints(run) == [f"step_{stopped:08d}"]
    assert f"preempted by a signal on another rank after step {stopped}" in " ".join(stderr.split())
    saved = torch.load(run / "checkpoints" / f"step_{stopped:08d}" / "trainer.pt", weights_only=True)
    assert saved["step"] == stopped and saved["world_size"] == 2
    assert not list(run.glob("error_rank*.log"))

    # The in-memory stream continues at any world size: resume in one process.
    assert main(["pretrain", "--resume", str(run), "--steps", str(stopped + 2), "--no-progress",
                 "--execution.parallel", "none"]) == 0
    assert main(run_args(tmp_path, "whole", stopped + 2)) == 0
    assert [r["step"] for r in train_rows(run)] == list(range(1, stopped + 3))
    assert losses(run) == pytest.approx(losses(tmp_path / "whole"), rel=1e-5)


@pytest.mark.slow
@pytest.mark.dist
def test_torchrun_restarts_a_killed_rank_and_continues_exactly(tmp_path):
    """torchrun --max-restarts 1, 2 gloo ranks: rank 1 exits hard after step 3 on the first
    attempt (tests/faults/sitecustomize.py); the group restarts with --resume auto from step 2 and ends with the weights
    and losses of an uninterrupted torchrun run. About 40 s."""
    args = ["--execution.parallel", "ddp", "--checkpoint.every", "2", "--resume", "auto"]
    launcher = torchrun(run_args(tmp_path, "restarted", 6, *args), "--standalone", "--max-restarts", "1",
                        extra_env={"BERTFORGE_TEST_FAIL_AT": "1:3", "PYTHONPATH": os.pathsep.join(
                            [str(REPO / "tests" / "faults"), env()["PYTHONPATH"]])})
    stderr = finish(launcher)
    assert launcher.returncode == 0, stderr[-3000:]
    metadata = (tmp_path / "restarted" / "metadata.jsonl").read_text().splitlines()
    starts = [row["step"] for row in map(json.loads, metadata) if row["event"] == "start"]
    assert starts == [0, 2]  # the fault struck: rank 1 died after step 3 and the group restarted from step 2
    whole = torchrun(run_args(tmp_path, "whole", 6, *args), "--standalone")
    stderr = finish(whole)
    assert whole.returncode == 0, stderr[-3000:]
    run = tmp_path / "restarted"
    assert [r["step"] for r in train_rows(run)] == [1, 2, 3, 4, 5, 6]  # step 3 once, though run twice
    assert losses(run) == losses(tmp_path / "whole")
    assert checkpoints(run) == ["step_00000002", "step_00000004", "step_00000006"]
    resumed, uninterrupted = load_model(run).state_dict(), load_model(tmp_path / "whole").state_dict()
    assert all(torch.equal(v, uninterrupted[k]) for k, v in resumed.items())


@pytest.mark.slow
@pytest.mark.dist
def test_sigterm_to_torchrun_checkpoints_on_every_rank(tmp_path):
    """SIGTERM to the launcher itself (what Slurm sends a job step): torchrun forwards it to every
    worker, which finish the same step, checkpoint it and exit 0 within torchrun's
    --shutdown-timeout; torchrun itself then exits 1 (it re-raises the signal). About 20 s."""
    run = tmp_path / "ddp"
    launcher = torchrun(run_args(tmp_path, "ddp", 100_000, "--execution.parallel", "ddp"), "--standalone")
    wait_for_rows(run, launcher)
    launcher.send_signal(signal.SIGTERM)
    stderr = finish(launcher, 120)
    assert launcher.returncode == 1, stderr[-3000:]
    assert "SignalException: Process" in stderr  # torchrun's own account of the signal
    stopped = train_rows(run)[-1]["step"]
    assert checkpoints(run) == [f"step_{stopped:08d}"]
    assert (f"preempted by SIGTERM after step {stopped}: checkpoint {run}/checkpoints/step_{stopped:08d}"
            in " ".join(stderr.split()))
    assert "Unable to shutdown process" not in stderr  # the workers exited themselves, not by SIGKILL
    saved = torch.load(run / "checkpoints" / f"step_{stopped:08d}" / "trainer.pt", weights_only=True)
    assert saved["step"] == stopped and saved["world_size"] == 2
    assert not list(run.glob("error_rank*.log"))
    # --resume auto takes it up: the checkpoint is complete (its manifest checks).
    assert main(["pretrain", "--resume", "auto", "--run-dir", str(tmp_path), "--name", "ddp",
                 "--steps", str(stopped + 1), "--no-progress", "--execution.parallel", "none"]) == 0
    assert [r["step"] for r in train_rows(run)] == list(range(1, stopped + 2))


# ------------------------------------------------------------ squad train

qa_model = test_squad_cli.tiny  # a tiny random QA model, two questions in dev.json beside it


def squad_args(model: Path, out: Path, steps: int, *extra: str) -> list[str]:
    """Fine-tuning ``model`` (qa_model) on its two questions, 2 per step."""
    return ["squad", "train", "--init", str(model), "--train-file", str(model.parent / "dev.json"), "--out", str(out),
            "--no-progress", "--data.seq_len", "32", "--squad.max_query_length", "8", "--train.epochs", "0",
            "--train.steps", str(steps), "--train.micro_batch_size", "1", "--train.global_batch_size", "2",
            "--train.schedule", "constant", "--train.warmup_proportion", "0", "--train.warmup_steps", "0",
            "--train.lr", "1e-3", "--log.every", "1", "--log.tensorboard", "false", "--execution.threads", "1",
            "--checkpoint.keep", "0", *extra]


def test_squad_train_sigterm_checkpoints_and_resume_auto_continues(qa_model, tmp_path):
    """squad train, SIGTERM after the first logged step: exit 0 and a checkpoint of that step; the
    same command with --resume auto then ends where an uninterrupted run does. About 10 s."""
    out = tmp_path / "ft"
    printed: list[str] = []
    stopped = sigterm_after_first_rows(out, squad_args(qa_model, out, 100_000, "--resume", "auto"), printed)
    assert not (out / "model.safetensors").exists()  # the finished model waits for the end of the run
    # what it printed names what exists: the checkpoint, not a model (issue 33.7)
    assert printed[0].splitlines()[-1] == (f"checkpoint: {out}/checkpoints/step_{stopped:08d} (stopped early: no "
                                           f"model yet; continue with --resume {out})")
    assert "model:" not in printed[0]

    assert main(squad_args(qa_model, out, stopped + 2, "--resume", "auto")) == 0
    assert main(squad_args(qa_model, tmp_path / "whole", stopped + 2)) == 0
    assert [r["step"] for r in train_rows(out)] == list(range(1, stopped + 3))  # each step once
    assert losses(out) == losses(tmp_path / "whole")
    resumed, whole = load_model(out, head="qa").state_dict(), load_model(tmp_path / "whole", head="qa").state_dict()
    assert all(torch.equal(v, whole[k]) for k, v in resumed.items())


def test_squad_train_resume_auto_starts_fresh_then_resumes(qa_model, tmp_path):
    """The first --resume auto start makes the run; the next continues it from its newest
    checkpoint (not from --init): the losses are those of one run of 4 steps. About 5 s."""
    out = tmp_path / "ft"
    assert main(squad_args(qa_model, out, 2, "--resume", "auto")) == 0
    assert checkpoints(out) == ["step_00000002"]
    assert main(squad_args(qa_model, out, 4, "--resume", "auto")) == 0
    assert checkpoints(out) == ["step_00000002", "step_00000004"]
    assert main(squad_args(qa_model, tmp_path / "whole", 4)) == 0
    assert [r["step"] for r in train_rows(out)] == [1, 2, 3, 4]
    assert losses(out) == losses(tmp_path / "whole")


# ------------------------------------------------------------ data create: nothing replaced unasked
# (issue 11's "never destroy what the user did not name", for the one command that writes record files)

WORDS = ["the", "cat", "sat", "on", "mat", ".", "it", "was", "a", "good", "dog", "ran", "far", "away"]


def test_data_create_refuses_existing_outputs_unless_overwrite(tmp_path, capsys):
    """An existing output file is refused (exit 2, nothing written) unless --overwrite; shards of
    another count of the same name are refused even then, and never deleted. About 1 s."""
    (tmp_path / "a.txt").write_text("the cat sat on the mat .\nit was a good cat .\n\nthe dog ran far away .\n"
                                    "it was a good dog .\n")
    (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    out = tmp_path / "out" / "train.tfrecord"
    out.parent.mkdir()
    out.write_text("the user's\n")

    def create(*extra: str) -> int:
        return main(["data", "create", "--input", str(tmp_path / "a.txt"), "--vocab", str(tmp_path / "vocab.txt"),
                     "--output", str(out), "--seq-len", "16", "--max-predictions", "2", *extra])

    capsys.readouterr()
    assert create() == 2
    assert capsys.readouterr().err == f"error: {out} exists; pass --overwrite to replace it\n"
    assert out.read_text() == "the user's\n"
    assert create("--overwrite") == 0
    assert "15 instances" in capsys.readouterr().out
    assert len(read_records(out).input_ids) == 15

    capsys.readouterr()
    assert create("--num-output-files", "2", "--overwrite") == 2  # train.tfrecord would be read with the 2 shards
    assert capsys.readouterr().err == (
        f"error: {out} has the name of --output {out} but is not one of the 2 file(s) this run writes "
        f"(1 such file(s)): a glob or directory would read them with the new ones; remove them or choose "
        f"another --output\n")
    out.unlink()
    assert create("--num-output-files", "2") == 0
    shards = sorted(p.name for p in out.parent.glob("*.tfrecord"))  # (beside each, its tokenizer's sidecar)
    assert shards == ["train-00000-of-00002.tfrecord", "train-00001-of-00002.tfrecord"]
    capsys.readouterr()
    assert create("--num-output-files", "2") == 2
    assert capsys.readouterr().err == (f"error: {out.parent / shards[0]} exists (2 of the 2 output files); "
                                       f"pass --overwrite to replace them\n")


# ------------------------------------------------------------ a shape given equal to the default
# (issue 11's "records of sequence 128 train under data.seq_len 512 with no word", for the value 128)

def test_a_seq_len_given_equal_to_the_default_must_agree_with_the_records(tmp_path):
    """``--data.seq_len 128`` (the default) or a config file's ``seq_len: 128`` is a value the user
    gave: records of 16 are refused, as for any other value; left out, the records decide."""
    from test_loader import numbered_arrays, records_config

    from bertforge.config import DataConfig
    from bertforge.data.record_writer import write_records
    from bertforge.training.pretrain import load_data

    path = write_records(tmp_path / "train.native", numbered_arrays(0, 12), fmt="native")
    default = DataConfig().seq_len
    cfg = records_config(tmp_path, **{"data.input": str(path), "data.seq_len": default})
    with pytest.raises(ConfigError, match=rf"^data.seq_len={default}, but the records have seq_len 16 "):
        load_data(cfg.model, cfg.data, cfg.train, tmp_path, given=cfg.given)
    # pretrain_tiny.yaml sets seq_len 128 and max_predictions 20, both the defaults.
    cfg = load_config("pretrain_tiny", [("data.input", str(path)), ("log.run_dir", str(tmp_path))])
    with pytest.raises(ConfigError, match=rf"^data.seq_len={default}, but the records have seq_len 16 "):
        load_data(cfg.model, cfg.data, cfg.train, tmp_path, given=cfg.given)
    cfg = records_config(tmp_path, **{"data.input": str(path)})
    decided = load_data(cfg.model, cfg.data, cfg.train, tmp_path, given=cfg.given).decided
    assert (decided["data.seq_len"], decided["data.max_predictions"]) == (16, 3)


# ------------------------------------------------------------ one run per run directory (issue 21)

def test_a_second_run_in_a_live_run_directory_is_refused_naming_the_holder(tmp_path, capsys):
    """``--resume auto`` started twice: the second is refused while the first lives, and takes the
    directory over once it is gone (its lock dies with it, whatever killed it). About 5 s."""
    assert main(run_args(tmp_path, "auto", 2, "--checkpoint.every", "2", "--resume", "auto")) == 0
    run = tmp_path / "auto"
    before = (sorted(p.name for p in run.rglob("*")), (run / "metrics.jsonl").read_bytes())
    with live_run(run) as holder:  # then killed, as a machine failure would: nothing released
        capsys.readouterr()
        for argv in (run_args(tmp_path, "auto", 4, "--resume", "auto"),
                     run_args(tmp_path, "auto", 4, "--resume", str(run))):
            assert main(argv) == 2
            err = capsys.readouterr().err
            assert err.startswith(f"error: {run} is in use by another run (pid {holder.pid} on ")
            assert err.count("\n") == 1 and "choose another directory" in err
        assert (sorted(p.name for p in run.rglob("*")), (run / "metrics.jsonl").read_bytes()) == before
    assert f"pid {holder.pid} on " in (run / ".lock").read_text()  # a stale lock file stays behind...
    assert main(run_args(tmp_path, "auto", 4, "--checkpoint.every", "2", "--resume", "auto")) == 0
    assert checkpoints(run) == ["step_00000002", "step_00000004"]  # ...and is taken over
    assert f"pid {os.getpid()} on " in (run / ".lock").read_text()


def _start_run(cfg, lined_up, results, release) -> None:
    """One of many runs started at once (a forked process): the directory it got or its error, then
    it holds on until released. All wait for each other before their first mkdir and again before
    their first lock: the worst case of starting at once, every check made and nothing taken yet."""
    from bertforge.training import pretrain

    def first_lined_up(call, applies):
        waited = False

        def lined_up_call(*args):
            nonlocal waited
            if applies(*args) and not waited:
                waited = True
                with contextlib.suppress(threading.BrokenBarrierError):
                    lined_up.wait(30)
            return call(*args)
        return lined_up_call

    os.mkdir = first_lined_up(os.mkdir, lambda *args: True)  # in this process only
    fcntl.flock = first_lined_up(fcntl.flock, lambda fd, operation: operation & fcntl.LOCK_EX)
    with contextlib.ExitStack() as held:
        try:
            run_dir = pretrain.locate_run(cfg.checkpoint.resume, cfg.log, held)[1]
        except ConfigError as err:
            results.put((os.getpid(), str(err)))
            return
        results.put((os.getpid(), str(run_dir)))
        release.wait(HANG_GUARD_S)  # the test sets it once every run has reported, however slowly


@pytest.mark.parametrize("resume", ["auto", ""])
def test_runs_of_one_name_started_at_once_leave_one_live_run_per_directory(tmp_path, resume):
    """8 runs of one name started at the same instant, 3 times over (issue 27): with ``--resume
    auto`` exactly one goes on and the others get the one-line error naming the directory, whose
    lock stays the winner's (a loser once removed the directory and the winner's lock); without
    it each run gets a directory of its own (NAME, NAME-2 …). About 4 s."""
    from bertforge.fileio import live_holder
    from bertforge.training import pretrain  # noqa: F401  # imported once, before the forks

    forked = multiprocessing.get_context("fork")
    for trial in range(3):
        run = tmp_path / f"run{trial}"
        cfg = load_config("tiny", [("log.run_dir", str(tmp_path)), ("log.name", run.name),
                                   ("checkpoint.resume", resume)])
        lined_up, release, results = forked.Barrier(8), forked.Event(), forked.Queue()
        starters = [forked.Process(target=_start_run, args=(cfg, lined_up, results, release)) for _ in range(8)]
        for starter in starters:
            starter.start()
        try:
            outcomes = dict(results.get(timeout=HANG_GUARD_S) for _ in starters)
            if resume:
                winners = [pid for pid, outcome in outcomes.items() if outcome == str(run)]
                assert len(winners) == 1, outcomes
                for pid, outcome in outcomes.items():
                    if pid != winners[0]:
                        assert outcome.startswith(f"{run} is in use by another run (") and outcome.endswith(
                            "wait for it to end, or choose another directory") and "\n" not in outcome
                assert (live_holder(run / ".lock") or "").startswith(f"pid {winners[0]} on ")
                assert [p.name for p in run.iterdir()] == [".lock"]
            else:
                names = [run.name] + [f"{run.name}-{i}" for i in range(2, 9)]
                assert sorted(outcomes.values()) == sorted(str(tmp_path / name) for name in names)
        finally:
            release.set()
            for starter in starters:
                starter.join(HANG_GUARD_S)
        assert [starter.exitcode for starter in starters] == [0] * 8


def test_run_lock_is_exclusive_and_released_on_exit(tmp_path):
    from bertforge.runs import RunLock

    with RunLock(tmp_path):
        with pytest.raises(ConfigError, match=f"pid {os.getpid()} on "):
            with RunLock(tmp_path):
                pass
    with RunLock(tmp_path):  # free again
        pass


def test_squad_train_resume_refuses_a_changed_config_unless_asked(qa_model, tmp_path, capsys):
    out = tmp_path / "ft"
    assert main(squad_args(qa_model, out, 2)) == 0
    capsys.readouterr()
    resume = ["squad", "train", "--resume", str(out), "--no-progress", "--train.steps", "3", "--train.lr", "0.5"]
    assert main(resume) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: resuming {out / 'checkpoints' / 'step_00000002'} with changes that break continuing it exactly: "
        f"train.lr: 0.001 → 0.5; pass --resume-with-changes to go on with them")
    assert main([*resume, "--resume-with-changes"]) == 0
    assert checkpoints(out) == ["step_00000002", "step_00000003"]


def test_squad_train_refuses_a_live_run_directory(qa_model, tmp_path, capsys):
    out = tmp_path / "ft"
    assert main(squad_args(qa_model, out, 2, "--resume", "auto")) == 0
    from bertforge.runs import RunLock

    with RunLock(out):
        capsys.readouterr()
        assert main(squad_args(qa_model, out, 4, "--resume", "auto")) == 2
        assert capsys.readouterr().err.startswith(f"error: {out} is in use by another run (pid {os.getpid()}")
    assert checkpoints(out) == ["step_00000002"]


# ------------------------------------------------------------ a resume continues the run, or says what differs

@pytest.mark.parametrize("change", [["--train.micro_batch_size", "2"], ["--train.lr", "0.01"],
                                    ["--execution.precision", "bf16"], ["--data.seed", "7"]])
def test_a_resume_that_would_not_continue_the_run_is_refused_then_allowed(tmp_path, capsys, caplog, change):
    """A changed field is named and refused, the run left as it was; --resume-with-changes goes on,
    logging the change; extending train.steps needs no flag (issue 21). About 4 s each."""
    assert main(run_args(tmp_path, "r", 2)) == 0
    run = tmp_path / "r"
    before = (run / "config.yaml").read_text()
    capsys.readouterr()
    assert main(["pretrain", "--resume", str(run), "--steps", "3", "--no-progress", *change]) == 2
    lines = capsys.readouterr().err.splitlines(keepends=True)
    assert lines[:-1] == ["INFO bertforge.runs: resuming with train.steps: 2 → 3\n"]  # allowed, and logged
    err = lines[-1]
    key, value = change[0][2:], change[1]
    assert err.startswith(f"error: resuming {run / 'checkpoints' / 'step_00000002'} with changes that break "
                          f"continuing it exactly: {key}: ")
    assert f" → {value!r}" in err or f" → {yaml_value(value)!r}" in err
    assert err.endswith("; pass --resume-with-changes to go on with them\n")
    assert (run / "config.yaml").read_text() == before and checkpoints(run) == ["step_00000002"]
    with caplog.at_level("WARNING", logger="bertforge.runs"):
        assert main(["pretrain", "--resume", str(run), "--steps", "3", "--no-progress", "--resume-with-changes",
                     *change]) == 0
    assert any(r.getMessage().startswith(f"resuming with a change: {key}: ") for r in caplog.records)
    assert checkpoints(run) == ["step_00000002", "step_00000003"]


def yaml_value(text: str):
    import yaml

    return yaml.safe_load(text)


def test_records_regenerated_before_a_resume_are_refused(tmp_path, capsys):
    records = tmp_path / "records"
    records.mkdir()
    (records / "part.tfrecord").write_bytes(shared_data("tfrecord/graphcore_sample_text.tfrecord").read_bytes())
    args = ["pretrain", "--config", "tiny", "--data.input", str(records), "--steps", "1", "--no-progress",
            "--run-dir", str(tmp_path), "--name", "r", "--train.micro_batch_size", "4",
            "--train.global_batch_size", "4", "--log.tensorboard", "false", "--train.eval_every", "0"]
    assert main(args) == 0
    run = tmp_path / "r"
    assert main(["pretrain", "--resume", str(run), "--steps", "2", "--no-progress"]) == 0  # the same files
    records = records.rename(tmp_path / "moved")  # the same files at another path: still the same run
    assert main(["pretrain", "--resume", str(run), "--steps", "3", "--no-progress", "--data.input", str(records)]) == 0
    regenerated = read_records(records / "part.tfrecord")
    write_records(records / "part.tfrecord", regenerated.take(range(len(regenerated) - 1)))  # one record fewer
    capsys.readouterr()
    assert main(["pretrain", "--resume", str(run), "--steps", "4", "--no-progress"]) == 2
    err = capsys.readouterr().err.splitlines(keepends=True)[-1]
    assert err.startswith(f"error: resuming {run / 'checkpoints' / 'step_00000003'} with changes that break "
                          f"continuing it exactly: the files of data.input {records} changed since the checkpoint "
                          f"(fingerprint ")
    assert main(["pretrain", "--resume", str(run), "--steps", "4", "--no-progress", "--resume-with-changes"]) == 0


# ------------------------------------------------------------ a loss that explodes but stays finite

def test_the_divergence_guard_counts_spikes_in_a_row_against_the_median_before():
    from bertforge.training.engine import DivergenceError, DivergenceGuard

    off = DivergenceGuard(0.0, 3)
    for step in range(50):
        off.update(step, 1e12)  # off: never raises, never spikes
    assert not off.spiking
    guard = DivergenceGuard(10.0, 3)
    for step in range(20):
        guard.update(step, 2.0 + 0.01 * step)
    guard.update(20, 1e6)
    guard.update(21, 7e10)
    assert guard.spiking
    guard.update(22, 2.0)  # back to normal: the count starts again
    assert not guard.spiking
    guard.update(23, 1e6)
    guard.update(24, 1e6)
    with pytest.raises(DivergenceError, match=r"^step 25: the loss \(1e\+06\) has been above 10 × its running "
                                              r"median \(2\.\d+\) for 3 steps: the run diverged"):
        guard.update(25, 1e6)


def test_the_divergence_guard_state_round_trips_and_a_bad_one_names_its_file(tmp_path):
    from bertforge.runs import CheckpointError
    from bertforge.training.engine import DivergenceGuard
    from bertforge.training.pretrain import restore_guard

    guard = DivergenceGuard(10.0, 3, window=4)
    for step, loss in enumerate([5.0, 4.0, 3.0, 2.0, 1.0]):
        guard.update(step, loss)
    guard.spikes = 2
    assert guard.state_dict() == {"history": [4.0, 3.0, 2.0, 1.0], "spikes": 2}
    again = DivergenceGuard(10.0, 3, window=2)  # a smaller window keeps the newest
    restore_guard(again, guard.state_dict(), tmp_path)
    assert list(again.history) == [2.0, 1.0] and again.spikes == 2
    with pytest.raises(CheckpointError, match=r"trainer.pt: guard.history is not a list of losses: abc$"):
        restore_guard(again, {"history": "abc"}, tmp_path)
    with pytest.raises(CheckpointError, match=r"trainer.pt: guard.spikes is not a count: -1$"):
        restore_guard(again, {"history": [], "spikes": -1}, tmp_path)
    assert list(again.history) == [2.0, 1.0]  # (unchanged by a refused state)


def test_a_diverged_run_stops_and_keeps_its_checkpoint_from_before_the_spike(tmp_path, monkeypatch, capsys):
    """The loss explodes from step 13 (×1e6, finite): the run stops when step 15's loss is read, with
    one line, exit 2. The loss of step 13 is that of the weights after step 12, so step_12 never
    counts (it is removed); rotation (keep 1) holds step 10, whose next loss was normal. About 4 s."""
    import bertforge.training.pretrain

    training_loss, calls = bertforge.training.pretrain.training_loss, []

    def exploding(model, batch):  # two micro-batches a step
        out = training_loss(model, batch)
        calls.append(None)
        return {**out, "loss": out["loss"] * 1e6} if len(calls) > 2 * 12 else out

    monkeypatch.setattr(bertforge.training.pretrain, "training_loss", exploding)
    argv = run_args(tmp_path, "d", 20, "--checkpoint.every", "2", "--checkpoint.keep", "1",
                    "--train.divergence_factor", "10", "--train.divergence_steps", "3")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [err.splitlines()[-1]]
    last = err.splitlines()[-1]
    assert last.startswith("error: step 15: the loss (") and " × its running median (" in last
    assert last.endswith(f"the run diverged (train.divergence_factor); the newest checkpoint, "
                         f"{tmp_path / 'd' / 'checkpoints' / 'step_00000010'}, is from before the spike: resume "
                         f"from it with a lower learning rate, e.g. --resume "
                         f"{tmp_path / 'd' / 'checkpoints' / 'step_00000010'} --resume-with-changes --train.lr 0.0001")
    assert checkpoints(tmp_path / "d") == ["step_00000010"]
    assert not list((tmp_path / "d" / "checkpoints").glob(".*"))  # step_12, unconfirmed, was removed
    assert [r["step"] for r in train_rows(tmp_path / "d")][-1] == 15
    # The guard is off by default: the same run trains on to the end and exits 0.
    monkeypatch.setattr(bertforge.training.pretrain, "training_loss", training_loss)
    assert main(run_args(tmp_path, "off", 20, "--checkpoint.every", "2", "--checkpoint.keep", "1")) == 0
    assert checkpoints(tmp_path / "off") == ["step_00000020"]


def test_a_learning_rate_spike_never_leaves_its_checkpoint_behind(tmp_path, capsys):
    """Issue 27's run: lr 30 from update 35 on, a checkpoint every 5 steps (keep 2). The update of
    step 35 ruins the weights, but only step 36's loss shows it: step_35 is removed and the error
    names step_30, whose weights are the sound ones (3397f00 kept step_35 and named it)."""
    argv = run_args(tmp_path, "lr", 60, "--checkpoint.every", "5", "--checkpoint.keep", "2",
                    "--train.schedule", "table", "--train.lr_table", "{0: 0.001, 34: 30.0}",
                    "--train.divergence_factor", "5", "--train.divergence_steps", "3")
    assert main(argv) == 2
    last = capsys.readouterr().err.splitlines()[-1]
    step_30 = tmp_path / "lr" / "checkpoints" / "step_00000030"
    assert last.endswith(f"the newest checkpoint, {step_30}, is from before the spike: resume from it with a lower "
                         f"learning rate, e.g. --resume {step_30} --resume-with-changes "
                         f"--train.lr_table '{{0: 0.0001, 34: 3}}'")
    assert checkpoints(tmp_path / "lr") == ["step_00000025", "step_00000030"]
    rows = {r["step"]: r["loss"] for r in train_rows(tmp_path / "lr")}
    assert rows[36] > 5 * rows[35]  # the first loss of the ruined weights
    assert max(p.abs().max().item() for p in load_model(step_30).parameters()) < 2.0


def test_a_resumed_run_catches_the_spike_its_checkpoint_was_saved_before(tmp_path, capsys):
    """Issue 33.5: the run of issue 27 stops naming step_30; the same command with --resume auto (a
    requeue loop) resumed with an empty loss history, took 10 steps to refill it, swallowed the spike
    into its median, confirmed the ruined step_35/40/... and, keep 3, rotated step_20/25/30 out (exit 0).
    Each checkpoint now holds the guard's history: the resumed run stops at the same step, same line."""
    argv = run_args(tmp_path, "lr", 60, "--checkpoint.every", "5", "--checkpoint.keep", "3",
                    "--train.schedule", "table", "--train.lr_table", "{0: 0.001, 34: 30}",
                    "--train.divergence_factor", "10", "--train.divergence_steps", "5")
    step_30 = tmp_path / "lr" / "checkpoints" / "step_00000030"
    assert main(argv) == 2
    first = capsys.readouterr().err.splitlines()[-1]
    assert first.startswith("error: step 40: the loss (") and f"the newest checkpoint, {step_30}, is" in first
    assert checkpoints(tmp_path / "lr") == ["step_00000020", "step_00000025", "step_00000030"]
    assert main([*argv, "--resume", "auto"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == first
    assert checkpoints(tmp_path / "lr") == ["step_00000020", "step_00000025", "step_00000030"]
    guard = read_trainer_state(step_30)["guard"]
    assert len(guard["history"]) == 30 and guard["spikes"] == 0
    # A checkpoint saved before the guard's history was kept still resumes, refilling it as before:
    # 10 steps that cannot see a spike, so this one is caught later, at step 45.
    state = read_trainer_state(step_30)
    del state["guard"]
    torch.save(state, step_30 / "trainer.pt")
    write_manifest(step_30)
    assert main([*argv, "--resume", "auto"]) == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith("error: step 45: the loss (")


def test_a_checkpoint_saved_during_a_spike_never_rotates_out_the_one_before_it(tmp_path, capsys):
    """A run that ends (or is preempted) while its loss spikes, fewer times than divergence_steps,
    saves that step's checkpoint: with keep 1, step_30 (the newest from before the spike) was
    rotated out and only the ruined step_38 was left. Now step_30 stays beside it; resumed, the
    run counts on from 3 spikes, stops at step 40 and names step_30."""
    argv = run_args(tmp_path, "lr", 38, "--checkpoint.every", "5", "--checkpoint.keep", "1",
                    "--train.schedule", "table", "--train.lr_table", "{0: 0.001, 34: 30}",
                    "--train.divergence_factor", "10", "--train.divergence_steps", "5")
    assert main(argv) == 0
    step_30, step_38 = (tmp_path / "lr" / "checkpoints" / f"step_000000{n}" for n in (30, 38))
    assert checkpoints(tmp_path / "lr") == ["step_00000030", "step_00000038"]
    assert read_trainer_state(step_38)["guard"]["spikes"] == 3
    capsys.readouterr()
    assert main([*argv, "--steps", "60", "--resume", "auto"]) == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith("error: step 40: the loss (") and f"the newest checkpoint, {step_30}, is" in last
    assert checkpoints(tmp_path / "lr") == ["step_00000030", "step_00000038"]


def test_a_refused_squad_run_leaves_no_directory_and_no_lock(qa_model, tmp_path, capsys):
    out = tmp_path / "ft"
    assert main(["squad", "train", "--init", str(qa_model), "--out", str(out), "--no-progress"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == "error: squad train needs --train-file"
    assert not out.exists()  # made for the run, with its lock, and removed with it
    out.mkdir()  # one the user made stays
    assert main(["squad", "train", "--init", str(qa_model), "--out", str(out), "--no-progress"]) == 2
    assert out.is_dir()
