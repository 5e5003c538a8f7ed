"""``--profile START:END`` traces exactly those steps; every run logs its metadata and peak memory."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bertforge.cli import main
from bertforge.observe.profile import check_window, gpu_summary

TINY_RUN = ["pretrain", "--config", "tiny", "--data.synthetic", "--steps", "5", "--no-progress",
            "--data.seq_len", "32", "--train.micro_batch_size", "4", "--train.global_batch_size", "8",
            "--log.every", "1", "--execution.threads", "2"]


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def profiled(tmp_path_factory) -> Path:
    """A 5-step tiny run on the CPU, steps 2 and 3 profiled (about 5 s)."""
    tmp = tmp_path_factory.mktemp("profiled")
    assert main([*TINY_RUN, "--run-dir", str(tmp), "--name", "run", "--profile", "2:4"]) == 0
    return tmp / "run"


def test_the_trace_holds_exactly_the_profiled_steps(profiled):
    profile = profiled / "profile"
    trace = json.loads((profile / "trace.json").read_text())
    events = trace["traceEvents"]
    steps = sorted(e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#"))
    assert steps == ["ProfilerStep#2", "ProfilerStep#3"]
    # The operators ran inside the two steps, but for the loop's logging between them (.item()).
    windows = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name", "").startswith("ProfilerStep#")]
    ops = [e for e in events if e.get("cat") == "cpu_op" and e.get("name", "").startswith("aten::")]
    outside = {op["name"] for op in ops if not any(a <= op["ts"] <= b for a, b in windows)}
    assert len(ops) > 1000 and outside <= {"aten::item", "aten::_local_scalar_dense"}
    # The TensorBoard profiler plugin's copy, under the layout it reads.
    (board,) = (profile / "tensorboard").glob("rank0.*.pt.trace.json")
    assert board.read_bytes() == (profile / "trace.json").read_bytes()


def test_the_table_names_the_top_operators_by_self_time(profiled):
    table = (profiled / "profile" / "top_ops.txt").read_text()
    assert table.startswith("steps 2..3: operators by self CPU time")
    names = [line.split()[0] for line in table.splitlines()[4:9]]  # the five rows after the header
    assert "aten::mm" in names or "aten::addmm" in names, names
    assert "self CUDA time" not in table  # CPU only here


def test_memory_per_phase_and_metadata_rows(profiled):
    start, end = rows(profiled / "metadata.jsonl")
    assert start["event"] == "start" and start["step"] == 0
    assert (start["torch"], start["numpy"], start["python"]) == (torch.__version__, np.__version__,
                                                                  platform.python_version())
    assert (start["device"], start["world_size"], start["threads"], start["compile"]) == ("cpu", 1, 2, False)
    assert "cuda" not in start  # only on CUDA
    assert end["event"] == "end" and end["step"] == 5 and end["first_step_s"] > 0
    assert "compile_s" not in end  # only under execution.compile
    phases = end["peak_rss_mb_by_phase"]
    assert set(phases) == {"setup", "train", "profile"}
    assert end["peak_rss_mb"] == max(phases.values()) > 100
    assert json.loads((profiled / "profile" / "memory.json").read_text()) == end

    # TensorBoard has both rows as text.
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(profiled / "tensorboard"), size_guidance={"tensors": 0})
    board.Reload()
    text = {tag: board.Tensors(tag)[0].tensor_proto.string_val[0].decode() for tag in board.Tags()["tensors"]}
    assert sorted(text) == ["run/end/text_summary", "run/start/text_summary"]
    assert f"| torch | {torch.__version__} |" in text["run/start/text_summary"]
    assert f"| peak_rss_mb | {end['peak_rss_mb']} |" in text["run/end/text_summary"]

    train = rows(profiled / "metrics.jsonl")
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5]  # no other rows: its readers take every row for a step
    elapsed = [r["elapsed_s"] for r in train]
    assert elapsed == sorted(elapsed) and elapsed[-1] <= end["wall_s"]
    peaks = [r["peak_rss_mb"] for r in train]
    assert peaks == sorted(peaks) and peaks[-1] <= end["peak_rss_mb"]


@pytest.mark.parametrize("window, message", [
    ("4:2", "log.profile='4:2': expected START:END, steps from 0 with END > START, e.g. 20:25"),
    ("3:3", "log.profile='3:3': expected START:END"),
    ("3", "log.profile='3': expected START:END"),
    ("a:b", "log.profile='a:b': expected START:END"),
    ("3:9", "log.profile='3:9': the run has steps 0..4, so END must be at most 5"),
])
def test_bad_windows_are_one_line_errors(window, message, tmp_path, capsys):
    assert main([*TINY_RUN, "--run-dir", str(tmp_path), "--name", "bad", "--profile", window]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1
    assert not (tmp_path / "bad").exists()  # nothing ran: the run directory is gone


PHASES = """
import json
import numpy as np
import torch
from bertforge.observe.profile import PhaseMemory

memory = PhaseMemory(torch.device("cpu"))
memory.switch("big")
block = np.ones(300 * 2**20 // 8)  # 300 MiB, touched
del block
memory.switch("small")
np.ones(2**20).sum()
memory.close()
print(json.dumps({**memory.by_phase(), "peak_rss_mb": memory.peaks()["peak_rss_mb"]}))
"""


def test_phases_have_their_own_peaks():
    """In a fresh process: in this one, memory that earlier tests freed may still be resident, and
    the 300 MiB would reuse it without the resident set growing (both phases then read the same)."""
    done = subprocess.run([sys.executable, "-c", PHASES], capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if "peak_rss_note" in result:
        pytest.skip(result["peak_rss_note"])
    big, small = result["peak_rss_mb_by_phase"]["big"], result["peak_rss_mb_by_phase"]["small"]
    assert big - small > 250, (big, small)
    assert result["peak_rss_mb"] >= big


def test_a_run_resumed_after_the_window_is_not_profiled_again(caplog):
    assert check_window("2:4", start_step=2, total_steps=10) == (2, 4)
    with caplog.at_level("WARNING", logger="bertforge"):
        assert check_window("2:4", start_step=3, total_steps=10) is None
    assert "log.profile='2:4': this run resumes at step 3, after START; not profiling" in caplog.text


def test_the_gpu_summary_counts_busy_idle_and_optimizer_time():
    """Two steps of a made-up CUDA trace (µs): kernels at 0-40, 30-60 (overlapping: 60 busy), a copy at
    80-90, and the optimizer's two kernels at 100-120 and 130-150 under its annotation; the window spans
    0-150. Per step: span 75 µs, busy 55, optimizer 20 (its annotation's gaps are not busy)."""
    def kernel(name, ts, dur, cat="kernel"):
        return {"cat": cat, "name": name, "ts": ts, "dur": dur}

    trace = {"traceEvents": [
        kernel("gemm", 0, 40), kernel("gemm", 30, 30), kernel("Memcpy HtoD", 80, 10, "gpu_memcpy"),
        {"cat": "gpu_user_annotation", "name": "Optimizer.step#Lamb.step", "ts": 95, "dur": 60},
        kernel("lamb_update", 100, 20), kernel("lamb_update", 130, 20),
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500},  # host work is not GPU time
    ]}
    summary = gpu_summary(trace, steps=2)
    assert (summary["span_ms"], summary["busy_ms"], summary["optimizer_ms"]) == (0.075, 0.055, 0.02)
    assert summary["idle_fraction"] == pytest.approx(1 - 110 / 150)
    assert (summary["kernels_per_step"], summary["optimizer_kernels_per_step"]) == (2.5, 1.0)
    assert [k["name"] for k in summary["top_kernels"]] == ["gemm", "lamb_update", "Memcpy HtoD"]
    assert summary["top_kernels"][0] == {"name": "gemm", "ms": 0.035, "share": pytest.approx(70 / 110)}
    with pytest.raises(ValueError, match="no GPU work"):
        gpu_summary({"traceEvents": [trace["traceEvents"][-1]]}, steps=1)
