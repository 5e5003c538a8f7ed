"""Seeing a run from the inside: its metadata, its peak memory per phase, and ``--profile START:END``.

    with RunMonitor(cfg.execution, cfg.log, run_dir, dist, logger, bar.print, start_step=step,
                    total_steps=steps) as monitor:
        while step < steps:
            with monitor.step(step):
                out = engine.step(...)
            step += 1
            logger.log({"step": step, ..., **monitor.row()})   # elapsed_s, peak_rss_mb (, cuda_peak_mb)
            with monitor.phase("eval"):
                ...

Every run writes two rows of metadata (library versions, device, world size,
threads; at the end peak memory per phase, the first step's time and, under
``execution.compile``, the compile time) through ``MetricsLogger.log_metadata``
to ``metadata.jsonl``, TensorBoard and wandb.

``log.profile: "START:END"`` runs ``torch.profiler`` over the steps START..END-1
(0-based, as ``Engine.step`` counts them; one step before START is the
profiler's warm-up, untraced) and writes under ``RUN/profile/``:
``trace.json`` (Chrome / Perfetto: ui.perfetto.dev), ``tensorboard/`` (the
TensorBoard profiler plugin's layout), ``top_ops.txt`` (the operators with the
most self time, CPU and on CUDA device time; also printed), ``memory.json``
(peak memory per phase) and, on CUDA, ``memory_snapshot.pickle``
(pytorch.org/memory_viz) and ``gpu_summary.json`` (per step: the GPU's span,
busy time, optimizer time and top kernels; :func:`gpu_summary`). Only the
window's last step waits for the device, as an unprofiled run never does.
Under torchrun every rank writes its own files, named ``trace.rankN.json`` and
so on.

Peak host memory per phase (setup before the first step, training steps,
profiled steps, evaluation) is the Linux high-water mark of the resident set,
reset at each change of phase by writing 5 to ``/proc/self/clear_refs``; where
that is not allowed the numbers are the peaks so far. On CUDA the allocator's
peak is reset the same way (``torch.cuda.reset_peak_memory_stats``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import platform
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from bertforge.config import ConfigError, ExecutionConfig, LogConfig, profile_steps
from bertforge.host import device_name, package_version, peak_rss_mb, reset_peak_rss
from bertforge.parallel.dist import DistContext, compiles

if TYPE_CHECKING:
    from .log import MetricsLogger

logger = logging.getLogger(__name__)
MB = 2**20
TOP_OPS = 20  # rows of the printed operator table


def check_window(text: str, start_step: int, total_steps: int) -> tuple[int, int] | None:
    """``log.profile`` as (START, END), checked against the steps of the run; None when unset, or when
    a resumed run starts after START (it was profiled before it stopped, or cannot be now)."""
    window = profile_steps(text)
    if window is None:
        return None
    begin, end = window
    if end > total_steps:
        raise ConfigError(f"log.profile={text!r}: the run has steps 0..{total_steps - 1}, so END must be at "
                          f"most {total_steps}")
    if begin < start_step:
        logger.warning("log.profile=%r: this run resumes at step %d, after START; not profiling", text, start_step)
        return None
    return window


# ------------------------------------------------------------------ metadata


def run_metadata(execution: ExecutionConfig, dist: DistContext) -> dict[str, Any]:
    """What a run ran on: library versions, device, world size, threads and the execution settings."""
    from bertforge.version import __version__

    device = dist.device
    meta: dict[str, Any] = {
        "bertforge": __version__, "python": platform.python_version(), "torch": torch.__version__,
        "numpy": package_version("numpy"), "transformers": package_version("transformers"),
        "device": str(device),
        "device_name": device_name(device),
        "world_size": dist.world_size, "threads": torch.get_num_threads(),
        "precision": execution.precision, "parallel": execution.parallel,
        "compile": compiles(execution, device),
    }
    if device.type == "cuda":
        meta["cuda"] = torch.version.cuda
        meta["cudnn"] = torch.backends.cudnn.version()
    return {k: v for k, v in meta.items() if v is not None}


# ------------------------------------------------------------------ memory


class PhaseMemory:
    """Peak host (and CUDA) memory per phase of a run; the current phase is ``setup`` at first."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.current = "setup"
        self.host: dict[str, float] = {}  # phase -> peak resident set, MiB
        self.gpu: dict[str, float] = {}  # phase -> peak allocated, MiB
        self.exact = True  # the host peaks are per phase (else: peaks so far)

    def switch(self, phase: str) -> str:
        """Close the current phase and start ``phase``; the phase that was current."""
        self.close()
        previous, self.current = self.current, phase
        return previous

    def close(self) -> None:
        """Record the current phase's peaks so far (it stays current)."""
        self.host[self.current] = max(self.host.get(self.current, 0.0), peak_rss_mb())
        self.exact = reset_peak_rss() and self.exact
        if self.cuda:
            gpu = torch.cuda.max_memory_allocated(self.device) / MB
            self.gpu[self.current] = max(self.gpu.get(self.current, 0.0), gpu)
            torch.cuda.reset_peak_memory_stats(self.device)

    def peaks(self, closed: bool = False) -> dict[str, float]:
        """The peaks of the whole run so far; ``closed``: of the recorded phases only (after
        ``close``), so that what other threads allocate afterwards cannot exceed them all."""
        if not closed:  # what a row reports stays a peak of its phase, so the end's peak is never below it
            self.host[self.current] = max(self.host.get(self.current, 0.0), peak_rss_mb())
        row = {"peak_rss_mb": round(max(self.host.values()), 1)}
        if self.cuda:
            gpu = [*([] if closed else [torch.cuda.max_memory_allocated(self.device) / MB]), *self.gpu.values()]
            row["cuda_peak_mb"] = round(max(gpu), 1)
        return row

    def by_phase(self) -> dict[str, Any]:
        """Peaks per phase, the current one included (call after ``switch`` for a final answer)."""
        result: dict[str, Any] = {"peak_rss_mb_by_phase": {k: round(v, 1) for k, v in self.host.items()}}
        if self.cuda:
            result["cuda_peak_mb_by_phase"] = {k: round(v, 1) for k, v in self.gpu.items()}
        if not self.exact:
            result["peak_rss_note"] = "peaks so far: /proc/self/clear_refs could not reset the high-water mark"
        return result


# ------------------------------------------------------------------ profiler


class ProfileWindow:
    """``torch.profiler`` over steps ``begin``..``end``-1, each step in a ``ProfilerStep#N`` marker
    (N our step number). The step before ``begin``, when there is one, is the profiler's warm-up:
    it starts up there (untraced), so that its start-up cost stays out of the first traced step."""

    def __init__(self, begin: int, end: int, first_step: int, out_dir: Path, device: torch.device, rank: int,
                 world_size: int, echo: Callable[[str], None]):
        self.begin, self.end = begin, end
        self.warmup = 1 if begin > first_step else 0
        self.out_dir, self.device, self.echo = out_dir, device, echo
        self.tag = f".rank{rank}" if world_size > 1 else ""
        self.worker = f"rank{rank}"
        self.profiler: torch.profiler.profile | None = None
        self.marker: torch.profiler.record_function | None = None
        self.files: list[Path] = []

    def before(self, step: int) -> None:
        if step == self.begin - self.warmup:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True)
            self.profiler.prepare_trace()
        if step == self.begin and self.profiler is not None:
            if self.device.type == "cuda":
                torch.cuda.memory._record_memory_history(max_entries=200_000)
            self.profiler.start_trace()
        if self.begin <= step < self.end and self.profiler is not None:
            self.marker = torch.profiler.record_function(f"ProfilerStep#{step}")
            self.marker.__enter__()

    def after(self, step: int) -> None:
        if self.marker is not None:
            # Only the window's last step waits for the device: a wait after every step would leave
            # the GPU idle while the host queues the next one, which an unprofiled run never does.
            if self.device.type == "cuda" and step == self.end - 1:
                torch.cuda.synchronize(self.device)
            self.marker.__exit__(None, None, None)
            self.marker = None
        if step == self.end - 1 and self.profiler is not None:
            self.profiler.stop_trace()
            self._save(self.profiler)
            self.close()

    def close(self) -> None:
        """Let go of the profiler (after the window, or when the run fails inside it)."""
        profiler, self.profiler = self.profiler, None
        if profiler is None:
            return
        if self.marker is not None:
            self.marker.__exit__(None, None, None)
            self.marker = None
        if not self.files:  # a failure inside the window: nothing to save
            with contextlib.suppress(RuntimeError):
                profiler.stop_trace()
        if self.device.type == "cuda":
            torch.cuda.memory._record_memory_history(enabled=None)

    def _save(self, profiler: torch.profiler.profile) -> None:
        # A trace can be exported once: the TensorBoard plugin's file, copied to a plain name.
        board = self.out_dir / "tensorboard"
        before = set(board.glob(f"{self.worker}.*")) if board.is_dir() else set()
        torch.profiler.tensorboard_trace_handler(str(board), worker_name=self.worker)(profiler)
        trace = self.out_dir / f"trace{self.tag}.json"
        (written,) = set(board.glob(f"{self.worker}.*")) - before
        shutil.copyfile(written, trace)
        self.files = [trace, written]
        averages = profiler.key_averages()
        tables = [f"steps {self.begin}..{self.end - 1}: operators by self CPU time\n"
                  + averages.table(sort_by="self_cpu_time_total", row_limit=TOP_OPS)]
        if self.device.type == "cuda":
            tables.append(f"steps {self.begin}..{self.end - 1}: operators by self CUDA time\n"
                          + averages.table(sort_by="self_device_time_total", row_limit=TOP_OPS))
            snapshot = self.out_dir / f"memory_snapshot{self.tag}.pickle"
            torch.cuda.memory._dump_snapshot(str(snapshot))
            summary = gpu_summary(json.loads(trace.read_text(encoding="utf-8")), self.end - self.begin)
            summary_file = self.out_dir / f"gpu_summary{self.tag}.json"
            summary_file.write_text(json.dumps(summary, indent=1), encoding="utf-8")
            self.files += [snapshot, summary_file]
            self.echo(f"GPU per step: {summary['span_ms']:.1f} ms, busy {summary['busy_ms']:.1f} ms "
                      f"({1 - summary['idle_fraction']:.0%}), optimizer {summary['optimizer_ms']:.1f} ms")
        table_file = self.out_dir / f"top_ops{self.tag}.txt"
        table_file.write_text("\n\n".join(tables), encoding="utf-8")
        self.files.append(table_file)
        for table in tables:
            self.echo(table)
        self.echo("profile: " + ", ".join(str(f) for f in self.files)
                  + (" (open the trace in ui.perfetto.dev, the snapshot in pytorch.org/memory_viz)"
                     if self.device.type == "cuda" else " (open the trace in ui.perfetto.dev)"))


GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")  # the trace's categories of work on the GPU
TOP_KERNELS = 15


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals in µs, in ms."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total / 1000


def gpu_summary(trace: dict[str, Any], steps: int) -> dict[str, Any]:
    """Where the GPU's time went over ``steps`` profiled steps of a Chrome trace (``trace.json``):
    per step the span from its first to its last work, the time the GPU was busy (the union of its
    kernels and copies), the optimizer's share (the kernels under torch's ``Optimizer.step#…``
    annotations) and the kernels with the most time."""
    events = trace.get("traceEvents", [])
    work = [e for e in events if e.get("cat") in GPU_WORK and "dur" in e]
    if not work:
        raise ValueError("the trace holds no GPU work (was it profiled on CUDA?)")
    spans = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in work]
    optimizer = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
                 if e.get("cat") == "gpu_user_annotation" and str(e.get("name", "")).startswith("Optimizer.step#")]
    in_optimizer = [(a, b) for a, b in spans if any(start <= a and b <= end for start, end in optimizer)]
    by_name: dict[str, float] = {}
    for e in work:
        by_name[e["name"]] = by_name.get(e["name"], 0.0) + float(e["dur"]) / 1000
    span = (max(b for _, b in spans) - min(a for a, _ in spans)) / 1000
    busy = _union_ms(spans)
    return {
        "steps": steps, "span_ms": span / steps, "busy_ms": busy / steps, "idle_fraction": 1 - busy / span,
        "optimizer_ms": _union_ms(in_optimizer) / steps,
        "kernels_per_step": len(work) / steps, "optimizer_kernels_per_step": len(in_optimizer) / steps,
        "top_kernels": [{"name": name, "ms": ms / steps, "share": ms / busy}
                        for name, ms in sorted(by_name.items(), key=lambda item: -item[1])[:TOP_KERNELS]],
    }


# ------------------------------------------------------------------ the monitor


class RunMonitor:
    """Metadata, memory per phase, step times and the profile window of one run, on one rank.

    A context manager: entering logs the start metadata, leaving stops the
    profiler if it still runs and logs the end metadata (peak memory, step
    times), on the main rank through ``logger``.
    """

    def __init__(self, execution: ExecutionConfig, log: LogConfig, run_dir: Path, dist: DistContext,
                 logger: MetricsLogger, echo: Callable[[str], None], start_step: int, total_steps: int,
                 started: float | None = None):
        self.execution, self.dist, self.logger, self.echo = execution, dist, logger, echo
        self.started = time.perf_counter() if started is None else started
        self.memory = PhaseMemory(dist.device)
        self.step_times: list[float] = []  # of the first two steps of this (re)start
        self.last_step = start_step
        self.profile_dir = run_dir / "profile"
        window = check_window(log.profile, start_step, total_steps)
        self.window = (ProfileWindow(*window, start_step, self.profile_dir, dist.device, dist.rank,
                                     dist.world_size, echo) if window else None)

    def __enter__(self) -> RunMonitor:
        self.logger.log_metadata({"event": "start", "step": self.last_step, **run_metadata(self.execution, self.dist)})
        return self

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Around one optimizer step (``step`` counts the steps before it, from 0)."""
        window = self.window
        if self.memory.current == "setup":
            self.memory.switch("train")
        if window is not None:
            window.before(step)
            if step == window.begin:
                self.memory.switch("profile")
        started = time.perf_counter()
        yield
        if len(self.step_times) < 2:
            self.step_times.append(time.perf_counter() - started)
        self.last_step = step + 1
        if window is not None:
            window.after(step)
            if step == window.end - 1:
                self.memory.switch("train")

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Memory of the block counts toward phase ``name`` (e.g. ``eval``)."""
        previous = self.memory.switch(name)
        try:
            yield
        finally:
            self.memory.switch(previous)

    def row(self) -> dict[str, float]:
        """Fields for a logged training row: seconds since the (re)start and peak memory so far."""
        return {"elapsed_s": round(time.perf_counter() - self.started, 3), **self.memory.peaks()}

    def __exit__(self, *exc_info: object) -> None:
        if self.window is not None:
            self.window.close()
        self.memory.close()
        end: dict[str, Any] = {"event": "end", "step": self.last_step,
                               "wall_s": round(time.perf_counter() - self.started, 3),
                               **self.memory.peaks(closed=True), **self.memory.by_phase()}
        if self.step_times:
            end["first_step_s"] = round(self.step_times[0], 4)
        if compiles(self.execution, self.dist.device) and len(self.step_times) == 2:
            # torch.compile compiles in the first step: what it took beyond a compiled step
            end["compile_s"] = round(max(self.step_times[0] - self.step_times[1], 0.0), 4)
        failing = exc_info[0] is not None
        with contextlib.suppress(OSError) if failing else contextlib.nullcontext():  # keep the run's own error
            if self.window is not None and self.window.files:
                memory_file = self.profile_dir / f"memory{self.window.tag}.json"
                memory_file.write_text(json.dumps(end, indent=2) + "\n", encoding="utf-8")
                phases = ", ".join(f"{k} {v:.0f} MiB" for k, v in end["peak_rss_mb_by_phase"].items())
                self.echo(f"peak resident memory by phase: {phases} ({memory_file})")
            self.logger.log_metadata(end)
