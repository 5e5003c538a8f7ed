"""Metrics: a console progress bar, ``metrics.jsonl``, TensorBoard and Weights & Biases.

Every logged row goes to ``metrics.jsonl`` in the run directory, one JSON
object per line (training rows have ``step``, ``loss``, ``mlm_loss``,
``nsp_loss``, ``lr``, ``seq_per_s``; evaluation rows have ``split: "eval"``,
``mlm_accuracy`` and ``nsp_accuracy``). TensorBoard gets the same scalars when
the ``tensorboard`` package is installed, and wandb when ``--log.wandb`` is set.
Only the main process logs.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from .config import Config

console = Console(stderr=True, highlight=False)


class MetricsLogger:
    """Fans one row of metrics out to every enabled sink."""

    def __init__(self, run_dir: Path, cfg: Config, enabled: bool = True):
        self.enabled = enabled
        self.tensorboard = None
        self.wandb_run = None
        self.jsonl = None
        if not enabled:
            return
        # Appending keeps the history of a resumed run in one file.
        self.jsonl = open(run_dir / "metrics.jsonl", "a", encoding="utf-8")
        if cfg.log.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is optional
                pass
            else:
                self.tensorboard = SummaryWriter(str(run_dir / "tensorboard"))
        if cfg.log.wandb:
            try:
                import wandb
            except ImportError:
                raise SystemExit("error: --log.wandb needs the wandb package (pip install wandb)") from None
            self.wandb_run = wandb.init(project=cfg.log.wandb_project, name=run_dir.name,
                                        dir=str(run_dir), config=cfg.to_dict(), resume="allow")

    def log(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        row = {k: (round(v, 6) if isinstance(v, float) and math.isfinite(v) else v) for k, v in row.items()}
        self.jsonl.write(json.dumps(row) + "\n")
        self.jsonl.flush()
        step = row.get("step", 0)
        prefix = row.get("split", "train")
        scalars = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}
        if self.tensorboard is not None:
            for key, value in scalars.items():
                self.tensorboard.add_scalar(f"{prefix}/{key}", value, step)
        if self.wandb_run is not None:
            self.wandb_run.log({f"{prefix}/{k}": v for k, v in scalars.items()}, step=step)

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


class ProgressBar:
    """A rich progress bar over optimizer steps showing the latest loss and throughput.

    Messages are printed even without the bar, but only by the main process
    (``main=False`` silences both on the other ranks).
    """

    def __init__(self, total: int, start: int, enabled: bool, main: bool = True):
        self.progress = None
        self.main = main
        if not (enabled and main):
            return
        self.progress = Progress(
            TextColumn("[bold]pretrain"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"), TimeRemainingColumn(),
            console=console, transient=False)
        self.task = self.progress.add_task("steps", total=total, completed=start, status="")
        self.progress.start()

    def update(self, step: int, status: str | None = None) -> None:
        if self.progress is not None:
            fields = {"status": status} if status is not None else {}
            self.progress.update(self.task, completed=step, **fields)

    def print(self, message: str) -> None:
        if not self.main:
            return
        if self.progress is not None:
            self.progress.console.print(message)
        else:
            console.print(message)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


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
