"""Evaluation on a BEIR dev set while ``bertforge retrieval train`` trains, and the best model kept.

``--dev DIR`` names the set (``corpus.jsonl``, ``queries.jsonl``, ``qrels/SPLIT.tsv``: what
``retrieval eval`` reads, scored by its code, evaluate.py); it is scored every
``train.eval_every`` steps and at the end. Each score is a row of ``metrics.jsonl`` (``split:
eval``, every metric, and the best so far of ``--best-metric``); when the named metric beats
every earlier score, the model goes to ``RUN/best/`` as the end writes a model (our format and
its ``sentence-transformers/`` export) with ``best.json`` (metric, value, step): the best
checkpoint. A resumed run reads ``best.json`` back, so a later score must beat the earlier ones.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from bertforge.fileio import atomic_directory

from .beir import RetrievalSet
from .evaluate import evaluate_retrieval
from .metrics import METRICS

BEST_DIR = "best"
BEST_FILE = "best.json"


class DevEvaluation:
    """The engine's ``evaluate`` (every ``every`` steps) and ``finish`` (the end, step ``total``) for
    a dev set: scores, and ``save(model, directory)`` of the best model into ``run_dir/best``.

    The engine calls ``evaluate`` after the steps that are multiples of ``every`` below ``total``
    (training/engine.py's ``due``), in order from the step the run starts at (``start``): that is
    how a call knows its step."""

    def __init__(self, data: RetrievalSet, metric: str, every: int, start: int, total: int, run_dir: Path,
                 save: Callable[[nn.Module, Path], None], batch_size: int = 64):
        self.data, self.metric, self.every, self.total = data, metric, every, total
        self.run_dir, self.save, self.batch_size = run_dir, save, batch_size
        self.next_step = (start // every + 1) * every if every else total
        saved = run_dir / BEST_DIR / BEST_FILE
        self.best: dict[str, Any] | None = json.loads(saved.read_text(encoding="utf-8")) if saved.is_file() \
            else None
        if self.best is not None and self.best.get("metric") != metric:  # another metric: start over
            self.best = None

    def __call__(self, model: nn.Module) -> dict[str, float]:
        step, self.next_step = self.next_step, self.next_step + self.every
        return self.score(model, step)

    def finish(self, model: nn.Module, out_dir: Path) -> dict[str, Any]:
        return {"scores": self.score(model, self.total)}

    def score(self, model: nn.Module, step: int) -> dict[str, Any]:
        result = evaluate_retrieval(model, self.data, batch_size=self.batch_size)  # type: ignore[arg-type]
        scores: dict[str, Any] = {name: result[name] for name in METRICS}
        if self.best is None or scores[self.metric] > self.best["value"]:
            self.best = {"metric": self.metric, "value": scores[self.metric], "step": step}
            with atomic_directory(self.run_dir / BEST_DIR) as tmp:
                self.save(model, tmp)
                (tmp / BEST_FILE).write_text(json.dumps(self.best, indent=2) + "\n", encoding="utf-8")
        scores[f"best_{self.metric}"], scores["best_step"] = self.best["value"], self.best["step"]
        return scores
