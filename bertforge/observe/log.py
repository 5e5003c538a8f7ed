"""Metrics: a console progress bar, ``metrics.jsonl``, TensorBoard and Weights & Biases.

Every logged row goes to ``metrics.jsonl`` in the run directory, one JSON
object per line (training rows have ``step``, ``loss``, ``mlm_loss``,
``nsp_loss``, ``lr``, ``seq_per_s``; evaluation rows have ``split: "eval"``,
``mlm_accuracy`` and ``nsp_accuracy``), its numbers to 7 significant digits
(:func:`rounded`). TensorBoard gets the same scalars, unrounded, when the
``tensorboard`` package is installed, and wandb when ``--log.wandb`` is set.
Run metadata (versions, device, peak memory) goes to ``metadata.jsonl``
(:meth:`MetricsLogger.log_metadata`).
Only the main process logs. A resumed run first drops the rows after the step
it resumes from (:func:`truncate_metrics`), so every step appears once.

Python ``logging`` records of the ``bertforge`` loggers go to stderr through
:func:`console_logging`, which the command line enters once; they share the
progress bar's console, so a log line never tears the bar.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import math
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any, TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
)

from bertforge.config import ConfigError, LogConfig
from bertforge.fileio import atomic_file

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter
    from typing_extensions import Self

console = Console(stderr=True, highlight=False)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class ConsoleHandler(logging.Handler):
    """Log records as plain lines on :data:`console` (stderr), above a live progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            console.print(self.format(record), markup=False, highlight=False, emoji=False,
                          soft_wrap=True)
        except Exception:  # noqa: BLE001 - logging must not raise
            self.handleError(record)


@contextlib.contextmanager
def console_logging(level: str | int = "INFO") -> Iterator[None]:
    """Show the ``bertforge.*`` loggers' records at ``level`` and above on stderr for the length
    of a ``with`` block (one command); then the ``bertforge`` logger is as it was, so that
    calling ``main`` in a process leaves nothing behind."""
    logger = logging.getLogger("bertforge")
    before = logger.level
    handler = ConsoleHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level.upper() if isinstance(level, str) else level)
    try:
        with each_warning_once():
            yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(before)


@contextlib.contextmanager
def each_warning_once() -> Iterator[None]:
    """Show each warning (its category and text) at most once for the length of a ``with`` block.

    Python's filters show a warning once per place, but forget what they showed whenever a filter
    changes, which torch's compiler does around its work: a run showed Inductor's "Online softmax
    is disabled on the fly" block once per graph compiled.
    """
    show = warnings.showwarning
    shown: set[tuple[type[Warning], str]] = set()

    def show_once(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  file: TextIO | None = None, line: str | None = None) -> None:
        key = (category, str(message).strip())
        if key not in shown:
            shown.add(key)
            show(message, category, filename, lineno, file, line)

    warnings.showwarning = show_once
    try:
        yield
    finally:
        if warnings.showwarning is show_once:  # (unless someone replaced it since)
            warnings.showwarning = show


class _Closing:
    """``with obj:`` closes it on every exit path; ``close`` may be called more than once."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def truncate_metrics(path: Path, last_step: int) -> int:
    """Keep only the rows of ``path`` up to step ``last_step`` (none for -1); the rows dropped.

    What a run did after its last checkpoint is done again when it resumes:
    its rows would appear twice. A torn last line (a kill mid-write) goes too.
    The file is replaced atomically, so a kill here loses nothing.
    """
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
            keep = isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= last_step
        except ValueError:
            keep = False
        if keep:
            kept.append(line + "\n")
        else:
            dropped += 1
    if dropped:
        with atomic_file(path) as tmp:
            tmp.write_text("".join(kept), encoding="utf-8")
    return dropped


def rounded(value: Any) -> Any:
    """A finite float to 7 significant digits, as ``metrics.jsonl`` writes it (float32 holds about as
    many; decimal places would write a learning rate of 4.87e-7 as 0.0); anything else as it is."""
    return float(f"{value:.7g}") if isinstance(value, float) and math.isfinite(value) else value


class MetricsLogger(_Closing):
    """Fans one row of metrics out to every enabled sink. A context manager: leaving the
    ``with`` block closes the sinks.

    ``start_step`` is the step the run starts from (that of the checkpoint it
    resumes, 0 for a fresh start): rows after it in an existing ``metrics.jsonl``
    are dropped first. None appends to the file as it is. ``run_config`` is the run's whole
    config as a dict, for wandb's record of the run.
    """

    def __init__(self, run_dir: Path, log: LogConfig, enabled: bool = True, start_step: int | None = None,
                 run_config: dict[str, Any] | None = None):
        self.enabled = enabled
        self.run_dir = run_dir
        self.tensorboard: SummaryWriter | None = None
        self.wandb_run: Any = None  # a wandb Run; wandb is optional
        self.jsonl: IO[str] | None = None
        if not enabled:
            return
        try:
            if start_step is not None:  # a fresh start keeps nothing: its step-0 rows come again
                truncate_metrics(run_dir / "metrics.jsonl", start_step if start_step > 0 else -1)
            self._open(run_dir, log, run_config)
        except BaseException:
            self.close()  # what was opened before the failure
            raise

    def _open(self, run_dir: Path, log: LogConfig, run_config: dict[str, Any] | None) -> None:
        # Appending keeps the history of a resumed run in one file.
        self.jsonl = open(run_dir / "metrics.jsonl", "a", encoding="utf-8")  # closed by close()
        if log.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is optional
                pass
            else:
                self.tensorboard = SummaryWriter(str(run_dir / "tensorboard"))
        if log.wandb:
            try:
                import wandb
            except ImportError:
                raise ConfigError("--log.wandb needs the wandb package (pip install wandb)") from None
            self.wandb_run = wandb.init(project=log.wandb_project, name=run_dir.name,
                                        dir=str(run_dir), config=run_config, resume="allow")

    def log(self, row: dict[str, Any]) -> None:
        if not self.enabled or self.jsonl is None:
            return
        self.jsonl.write(json.dumps({k: rounded(v) for k, v in row.items()}) + "\n")
        self.jsonl.flush()
        step = row.get("step", 0)
        prefix = row.get("split", "train")
        scalars = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}
        if self.tensorboard is not None:
            for key, value in scalars.items():
                self.tensorboard.add_scalar(f"{prefix}/{key}", value, step)
        if self.wandb_run is not None:
            self.wandb_run.log({f"{prefix}/{k}": v for k, v in scalars.items()}, step=step)

    def log_metadata(self, row: dict[str, Any]) -> None:
        """One row of run metadata (``event`` "start": versions, device, …; "end": peak memory, …;
        see observe/profile.py): appended to ``metadata.jsonl`` (metrics.jsonl holds only steps and
        evaluations, which is what its readers expect), a text summary in TensorBoard, wandb's
        config at the start and its summary at the end."""
        if not self.enabled or self.jsonl is None:
            return
        with open(self.run_dir / "metadata.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        event, step = row.get("event", "start"), row.get("step", 0)
        if self.tensorboard is not None:
            table = "\n".join(["| key | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in row.items()])
            self.tensorboard.add_text(f"run/{event}", table, step)
        if self.wandb_run is not None:
            if event == "start":
                self.wandb_run.config.update({"run": row}, allow_val_change=True)
            else:
                self.wandb_run.summary.update({f"run/{k}": v for k, v in row.items()})

    def close(self) -> None:
        """Flush and close every sink; later calls do nothing."""
        jsonl, tensorboard, wandb_run = self.jsonl, self.tensorboard, self.wandb_run
        self.jsonl = self.tensorboard = self.wandb_run = None
        try:
            if jsonl is not None:
                jsonl.close()
        finally:
            try:
                if tensorboard is not None:
                    tensorboard.close()
            finally:
                if wandb_run is not None:
                    wandb_run.finish()


class ProgressBar(_Closing):
    """A rich progress bar over optimizer steps showing the latest loss and throughput.

    Messages are printed even without the bar, but only by the main process
    (``main=False`` silences both on the other ranks). A context manager: leaving
    the ``with`` block stops the bar.

    When the console is not a terminal (Slurm, nohup, ``| tee``) a live bar shows nothing until
    its end, so the bar prints plain lines instead: ``<label> step S/T <status> eta H:MM:SS`` for
    the first logged step (one ``update`` with a status), the last, and otherwise at most one every
    ``every_s`` seconds of ``clock`` (``log.progress_every_s``); :meth:`stage` shows the progress of
    an evaluation or prediction stage (:class:`Stage`). ``enabled=False`` (``--no-progress``) shows
    neither.
    """

    def __init__(self, total: int, start: int, enabled: bool, main: bool = True, label: str = "pretrain",
                 every_s: float = 30.0, clock: Callable[[], float] = time.monotonic,
                 out: Console | None = None):
        self.progress: Progress | None = None
        self.main, self.total, self.start, self.label = main, total, start, label
        self.every_s, self.clock, self.console = every_s, clock, out or console
        # The pace is timed from the first step's end: that step also compiles and warms up, and a run of
        # minutes read an ETA of hours from it. (step, clock) there; None before.
        self.paced_from: tuple[int, float] | None = None
        self.printed_at: float | None = None  # the clock at the last plain line
        # Plain lines where a live bar would show nothing until its end.
        self.plain = enabled and main and not self.console.is_terminal
        if not (enabled and main) or self.plain:
            return
        self.progress = Progress(
            TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"), TimeRemainingColumn(),
            console=self.console, transient=False)
        self.task = self.progress.add_task("steps", total=total, completed=start, status="")
        self.progress.start()

    @property
    def live(self) -> bool:
        """Whether steps show, as a bar or as plain lines."""
        return self.progress is not None or self.plain

    def update(self, step: int, status: str | None = None) -> None:
        if self.progress is not None:
            fields: dict[str, Any] = {"status": status} if status is not None else {}
            self.progress.update(self.task, completed=step, **fields)
        elif self.plain:
            now = self.clock()
            if self.paced_from is None:
                self.paced_from = (step, now)
            if status is None:
                return
            if self.printed_at is None or step >= self.total or now - self.printed_at >= self.every_s:
                self.printed_at = now
                self.print(f"{self.label} step {step}/{self.total} {status.strip()} eta {self.eta(step, now)}")

    def eta(self, step: int, now: float) -> str:
        """The time left at the mean pace of the steps after the first one, as H:MM:SS; -:--:-- until
        one is done (the first step's time is mostly warm-up: compilation, allocation, caches)."""
        if step >= self.total:
            return "0:00:00"
        if self.paced_from is None or step <= self.paced_from[0]:
            return "-:--:--"
        first, then = self.paced_from
        return eta(step - first, self.total - step, now - then)

    def stage(self, name: str, count: str) -> Stage:
        """An evaluation or prediction :class:`Stage` (``name``: "step 4: eval"; ``count``: what it
        reads, "512 sequences") shown as this bar is: plain lines, or its passes on this bar."""
        return Stage(name, count, enabled=self.live, main=self.main, every_s=self.every_s, clock=self.clock,
                     out=self.console, progress=self.progress)

    def print(self, message: str) -> None:
        if not self.main:
            return
        # One line per message however long (paths are), and no markup read in a path.
        target = self.progress.console if self.progress is not None else self.console
        target.print(message, soft_wrap=True, markup=False, highlight=False)

    def close(self) -> None:
        """Stop the bar (it stays on screen); later calls do nothing."""
        progress, self.progress = self.progress, None
        if progress is not None:
            progress.stop()


def eta(done: int, left: int, elapsed: float) -> str:
    """The time ``left`` units take at the mean pace of the ``done`` ones (in ``elapsed`` s), as H:MM:SS."""
    seconds = max(round(elapsed / done * left), 0) if done > 0 else 0
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


# The stage that the passes run in this context report to (pass_progress); None: they show nothing.
_STAGE: contextvars.ContextVar[Stage | None] = contextvars.ContextVar("bertforge_stage", default=None)


class Stage:
    """An evaluation or prediction stage (``name``: "step 4: dev eval"; ``count``: what it reads,
    "dev set"), a context manager; the passes over batches inside it (:func:`pass_progress`) show
    their progress as it says.

    Off a terminal (Slurm, nohup, ``| tee``), plain lines: ``<name>: <count>`` at the start,
    ``<name>: batch B/T R batches/s eta H:MM:SS`` at most one every ``every_s`` seconds of ``clock``
    while a pass runs, and ``<name>: done <count> in S s`` at the end. On a terminal a bar of the
    pass's batches, added to ``progress`` (the training bar: two live displays cannot share a
    console) or else its own, gone when the pass ends. Nothing when not ``enabled`` (``--no-progress``)
    or not on the ``main`` rank.
    """

    def __init__(self, name: str, count: str, *, enabled: bool = True, main: bool = True, every_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic, out: Console | None = None,
                 progress: Progress | None = None):
        self.name, self.count, self.every_s, self.clock, self.progress = name, count, every_s, clock, progress
        self.console = out or console
        self.shown = enabled and main
        self.plain = self.shown and not self.console.is_terminal
        self.began = clock()
        self._token: contextvars.Token | None = None

    def __enter__(self) -> Self:
        self._token = _STAGE.set(self)
        self.began = self.clock()
        if self.plain:
            self.print(f"{self.name}: {self.count}")
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if self._token is not None:
            _STAGE.reset(self._token)
        if self.plain and kind is None:
            self.print(f"{self.name}: done {self.count} in {self.clock() - self.began:.1f} s")

    def print(self, message: str) -> None:
        self.console.print(message, soft_wrap=True, markup=False, highlight=False)

    @contextlib.contextmanager
    def track(self, total: int) -> Iterator[Callable[[int], None]]:
        """``advance(batches)`` for a pass of ``total`` batches in this stage."""
        if not self.shown:
            yield lambda batches: None
        elif self.plain:
            yield self._lines(total)
        else:
            progress = self.progress or Progress(
                TextColumn(f"[bold]{self.name}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                console=self.console, transient=True)
            own = self.progress is None
            if own:
                progress.start()
            task = progress.add_task(self.name, total=total, status=self.name)  # (the training bar shows status)
            try:
                yield lambda batches: progress.advance(task, batches)
            finally:
                progress.remove_task(task)
                if own:
                    progress.stop()

    def _lines(self, total: int) -> Callable[[int], None]:
        started = printed = self.clock()
        done = 0

        def advance(batches: int) -> None:
            nonlocal done, printed
            done += batches
            now = self.clock()
            if now - printed >= self.every_s and done < total:  # (the end line says the last)
                printed = now
                rate = done / max(now - started, 1e-9)
                self.print(f"{self.name}: batch {done}/{total} {rate:.1f} batches/s "
                           f"eta {eta(done, total - done, now - started)}")
        return advance


@contextlib.contextmanager
def pass_progress(total: int) -> Iterator[Callable[[int], None]]:
    """``advance(batches)`` for a pass of ``total`` batches (an evaluation, a prediction), shown as the
    :class:`Stage` around it says; outside a stage it shows nothing."""
    stage = _STAGE.get()
    if stage is None:
        yield lambda batches: None
        return
    with stage.track(total) as advance:
        yield advance


class Throughput:
    """Sequences per second between two calls of ``rate``."""

    def __init__(self):
        self.last_time = time.perf_counter()
        self.sequences = 0

    def add(self, sequences: int) -> None:
        self.sequences += sequences

    def rate(self) -> float:
        now = time.perf_counter()
        rate = self.sequences / max(now - self.last_time, 1e-9)
        self.last_time, self.sequences = now, 0
        return rate
