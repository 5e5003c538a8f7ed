"""``bertforge retrieval train --kind cross-encoder``: a reranker fine-tuned on the fine-tuning engine.

    bertforge retrieval train --kind cross-encoder --init MODEL --data rows.jsonl --negatives 3 --out DIR
        [--loss bce|listwise] [--max-length 256] [--train.steps 100 …]

The rows are the bi-encoder's (tasks/retrieval/pairs.py: query, positive, hard negatives); each
becomes ``1 + negatives`` pairs, the positive first, tokenized once. A step is
``train.global_batch_size`` rows: ``bce`` scores every pair against its label (1, 0…), ``listwise``
each positive against its own negatives (softmax cross-entropy); see rerank.py. Rows are
independent, so accumulation and ranks split them as any fine-tuning. The run is GLUE's and
retrieval's (``launch``, ``train``: checkpoints, ``--resume``, SIGTERM, the run lock, metrics.jsonl),
marked by ``reranker.yaml``; the end writes the classifier beside it (``model.safetensors`` and
``config.json``, a transformers ``…ForSequenceClassification``), which ``load_reranker`` and
``retrieval eval --reranker`` read, and ``DIR/cross-encoder`` (sentence-transformers' CrossEncoder).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from bertforge.config import Config, ConfigError, use_model, validate
from bertforge.parallel.dist import DistContext

from ..finetune.run import Job, launch, load_config, save_finetuned, write_run_files
from ..finetune.run import train as train_job
from .pairs import Pairs, read_pairs
from .rerank import (
    LOSSES,
    SETTINGS_FILE,
    Reranker,
    RerankerSettings,
    RerankLoss,
    export_cross_encoder,
    load_reranker,
)

SECTION = SETTINGS_FILE.removesuffix(".yaml")  # "reranker"
EXPORT_DIR = "cross-encoder"
BI_ENCODER_FLAGS = ("pooling", "query_prefix", "document_prefix", "query_max_length", "document_max_length",
                    "cache_chunk", "projection_dim")


@dataclass
class RerankerConfig:
    """The ``reranker:`` section: the model's settings (RerankerSettings'; unset, the ``--init``
    directory's own), and the training's. A run's ``reranker.yaml`` holds the settings it trained with."""

    max_length: int = 0   # tokens of a pair; 0: the init's (a CrossEncoder's, else 256)
    activation: str = ""  # sigmoid | identity; "": the init's (sigmoid)
    data: str = ""        # the training rows (pairs.py)
    negatives: int = 1    # hard negatives per row: each row is 1 + negatives pairs
    loss: str = "bce"     # bce (each pair against its label) | listwise (each positive among its negatives)

    def check(self) -> None:
        RerankerSettings(self.max_length or 256, self.activation or "sigmoid").check(SECTION)
        if self.loss not in LOSSES:
            raise ConfigError(f"{SECTION}.loss={self.loss!r} is not one of {', '.join(LOSSES)}")


class PairRows:
    """The rows as the engine's batches: each row's pairs (positive, then its negatives) in turn,
    tokenized once, padded per batch, with their labels (1, 0, …)."""

    def __init__(self, model: Reranker, pairs: Pairs):
        self.model = model
        self.candidates = 1 + len(pairs.negatives)
        columns = [pairs.positives, *pairs.negatives]
        flat = [(query, column[i]) for i, query in enumerate(pairs.queries) for column in columns]
        self.pairs = model.tokenize([q for q, _ in flat], [p for _, p in flat])
        self.labels = torch.tensor([1.0] + [0.0] * len(pairs.negatives)).repeat(len(pairs.queries))

    def __len__(self) -> int:
        return len(self.pairs) // self.candidates

    def batch(self, indices: Any) -> dict[str, torch.Tensor]:
        chosen = [int(i) * self.candidates + j for i in indices for j in range(self.candidates)]
        return {**self.model.batch([self.pairs[k] for k in chosen]), "labels": self.labels[chosen]}


def save_model(reranker: Reranker, classifier: nn.Module, out_dir: Path) -> None:
    """The trained classifier beside the run files (a transformers directory too), then its CrossEncoder export."""
    save_finetuned(classifier, out_dir)
    export_cross_encoder(Reranker(classifier, reranker.ids, reranker.settings), out_dir / EXPORT_DIR, overwrite=True)


def finetune_reranker(cfg: Config, section: RerankerConfig, init: str | Path | None,
                      out_dir: str | Path | None = None, log: Any = print, overwrite: bool = False) -> dict[str, Any]:
    """Fine-tune a reranker from ``init`` on ``section.data``'s rows into ``out_dir`` (or resume
    ``cfg.checkpoint.resume``)."""
    if not section.data:
        raise ConfigError("reranker training needs --data (query/positive/negatives rows)")
    if section.negatives < 1:
        raise ConfigError(f"--negatives {section.negatives}: a reranker learns from hard negatives (at least 1 "
                          f"per row; `bertforge retrieval from-squad` rows have none)")
    if cfg.execution.parallel not in ("none", "ddp"):
        raise ConfigError(f"execution.parallel={cfg.execution.parallel}: reranker training runs alone or with ddp")
    data = Path(section.data).resolve()
    pairs = read_pairs(data, section.negatives)  # bad rows are refused before anything is written
    loss = RerankLoss(section.loss, 1 + section.negatives)

    def body(dist: DistContext, run_dir: Path, resume_from: Path | None, started: float) -> dict[str, Any]:
        torch.manual_seed(cfg.train.seed)  # every rank starts the same new head
        source = init or cfg.checkpoint.init
        model = load_reranker(cast(str, source), training=True, max_length=section.max_length or None,
                              activation=section.activation or None)
        section.max_length, section.activation = model.settings.max_length, model.settings.activation
        if resume_from is None:
            cfg.checkpoint.init = str(Path(cast(str, source)).resolve())
        use_model(cfg, model.config)
        assert model.ids.file is not None
        cfg.data.vocab = str(model.ids.file.resolve())
        validate(cfg)
        # the engine trains the classifier itself: its checkpoints hold our task model's names ("bert.", "model.")
        job = Job(kind=SECTION, model=model.model, rows=PairRows(model, pairs), loss_fn=loss, data_files=[data],
                  description=f"{len(pairs.queries)} rows of {data} (1 positive and {section.negatives} negatives "
                              f"each, {section.loss} loss)",
                  rebuild=lambda: model.model, save=lambda classifier, d: save_model(model, classifier, d),
                  write_settings=lambda d: write_run_files(d, cfg.to_yaml(), section, SECTION, Path(cfg.data.vocab)),
                  counts={"rows": len(pairs.queries)})
        return train_job(cfg, job, dist, run_dir, resume_from, source, log if dist.is_main else (lambda _: None),
                         started)

    return launch(cfg.execution, cfg.log, cfg.checkpoint.resume, out_dir, f"{SECTION}.yaml", SECTION, body,
                  overwrite, (init, section.data))


def is_reranker_run(path: str | Path | None) -> bool:
    """Whether ``path`` (a ``--resume`` run or step directory) is a reranker's run."""
    if not path or not Path(path).is_dir():
        return False
    path = Path(path)
    return any((d / f"{SECTION}.yaml").is_file() for d in (path, path.parent, path.parent.parent))


def run_command(args: argparse.Namespace, extra: list[str]) -> int:
    """``bertforge retrieval train --kind cross-encoder``'s handler (its parser is in cli.py)."""
    from bertforge.config import parse_overrides

    given = [f"--{flag.replace('_', '-')}" for flag in BI_ENCODER_FLAGS if getattr(args, flag, None) is not None]
    given += [f"--{flag.replace('_', '-')}" for flag in ("symmetric", "late_interaction") if getattr(args, flag)]
    if given:
        raise ConfigError(f"{', '.join(given)}: a bi-encoder setting; a cross-encoder takes --max-length and --loss")
    overrides = parse_overrides(extra)
    for flag in ("data", "negatives", "loss", "max_length"):
        if getattr(args, flag) is not None:
            overrides.append((f"{SECTION}.{flag}", getattr(args, flag)))
    if args.no_progress:
        overrides.append(("log.progress", "false"))
    if args.resume:
        overrides.append(("checkpoint.resume", args.resume))
    section = RerankerConfig()
    cfg = load_config(section, SECTION, "retrieval_base", args.config, overrides, resume=args.resume, out_dir=args.out)
    section.check()
    summary = finetune_reranker(cfg, section, args.init, args.out, overwrite=args.overwrite)
    if summary["rank"] == 0:
        losses = summary["losses"]
        print(f"{summary['steps']} steps, loss {losses[0]:.4f} → {losses[-1]:.4f}; model: {summary['out_dir']} "
              f"(CrossEncoder: {Path(summary['out_dir']) / EXPORT_DIR})" if losses else summary)
    return 0
