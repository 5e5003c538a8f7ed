"""``bertforge retrieval train``: contrastive fine-tuning of an embedding model on the fine-tuning engine.

    bertforge retrieval train --init MODEL --data pairs.jsonl --out DIR [--pooling mean|cls]
        [--query-prefix "search_query: "] [--negatives 1] [--symmetric] [--cache-chunk 32]
        [--late-interaction --projection-dim 128] [--config glue_base] [--train.steps 100 …]

The run is GLUE's and NER's (tasks/finetune/run.py): ``launch`` (torchrun or one process, the run
lock, ``--resume``, SIGTERM), ``train`` (the engine, checkpoints, metrics, progress). A step is one
in-batch-negatives batch of ``train.global_batch_size`` rows: each rank embeds its
``micro_batch_size`` rows and the loss gathers the documents of every rank (tasks/retrieval/loss.py),
so accumulation is refused (negatives would be per micro-batch); ``--cache-chunk`` is the way to a
large batch on small memory. The end writes the model in our format (the encoder, ``retrieval.yaml``,
for late interaction ``projection.safetensors``), which ``load_embedder`` and ``bertforge retrieval
eval`` read, and ``DIR/sentence-transformers`` (tasks/retrieval/export.py).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import save_file
from torch import nn

from bertforge.config import Config, ConfigError, accumulation_steps, use_model, validate
from bertforge.fileio import LOCK, atomic_file
from bertforge.formats import weights
from bertforge.models.families import ENCODER_PREFIX
from bertforge.parallel.dist import DistContext

from ..finetune.run import Job, launch, load_config, write_run_files
from ..finetune.run import train as train_job
from .export import export_sentence_transformers
from .loss import RetrievalLoss
from .model import PROJECTION_FILE, Embedder, EmbeddingSettings, LateInteraction, load_embedder, pad
from .pairs import Pairs, read_pairs

SECTION = "retrieval"  # its yaml beside the model is model.SETTINGS_FILE
EXPORT_DIR = "sentence-transformers"


@dataclass
class RetrievalConfig(EmbeddingSettings):
    """The ``retrieval:`` section: the model's settings, and the training's."""

    data: str = ""              # the training rows (pairs.py)
    negatives: int = 0          # hard negatives per row
    scale: float = 0.0          # the scores' scale: 0 is 20 for cosine, 1 for MaxSim (PyLate's)
    symmetric: bool = False     # also each positive against every query
    cache_chunk: int = 0        # GradCache: rows per forward with gradients (0: the whole batch)


class PairRows:
    """The rows as the engine's batches: queries and documents (positives, then each negative in turn)
    tokenized once, padded per batch."""

    def __init__(self, model: Embedder | LateInteraction, pairs: Pairs):
        self.model = model
        self.queries = model.tokenize(pairs.queries, "query")
        self.documents = [model.tokenize(texts, "document") for texts in [pairs.positives, *pairs.negatives]]

    def __len__(self) -> int:
        return len(self.queries)

    def batch(self, indices: Any) -> dict[str, torch.Tensor]:
        rows = [int(i) for i in indices]
        query_ids, query_mask = self.model.batch([self.queries[i] for i in rows], "query")
        document_ids, document_mask = pad([side[i] for side in self.documents for i in rows], self.model.ids.pad_id)
        return {"query_ids": query_ids.cpu(), "query_mask": query_mask.cpu(),
                "document_ids": document_ids, "document_mask": document_mask}


def save_model(model: nn.Module, out_dir: Path) -> None:
    """The fine-tuned model in our format beside the run files, then its sentence-transformers export."""
    embedder = cast(Embedder | LateInteraction, model)
    named = nn.Module()  # the encoder under its task models' prefix ("bert.", "model."), as our checkpoints hold it
    named.add_module(ENCODER_PREFIX[embedder.config.family].rstrip("."), embedder.encoder)
    with atomic_file(out_dir / "model.safetensors") as tmp:
        weights.save_weights(named, tmp)
    if isinstance(embedder, LateInteraction):
        with atomic_file(out_dir / PROJECTION_FILE) as tmp:
            save_file({"linear.weight": embedder.projection.weight.detach().cpu().contiguous()}, str(tmp),
                      metadata={"format": "pt"})
    # a resumed run that had finished replaces the export it wrote then, under its own lock
    export_sentence_transformers(embedder, out_dir / EXPORT_DIR, overwrite=True, own=out_dir / LOCK)


def finetune_retrieval(cfg: Config, section: RetrievalConfig, init: str | Path | None,
                       out_dir: str | Path | None = None, log: Any = print, overwrite: bool = False) -> dict[str, Any]:
    """Fine-tune ``init`` on ``section.data``'s rows into ``out_dir`` (or resume ``cfg.checkpoint.resume``)."""
    if not section.data:
        raise ConfigError("retrieval training needs --data (query/positive rows)")
    if cfg.execution.parallel not in ("none", "ddp"):
        raise ConfigError(f"execution.parallel={cfg.execution.parallel}: retrieval training runs alone or with ddp")
    if section.cache_chunk and cfg.execution.precision == "fp16":  # the loss scaler sees only the returned loss
        raise ConfigError("--cache-chunk cannot be used with execution.precision fp16 (the cached chunks' backward "
                          "is not loss-scaled); use bf16 or fp32")

    def body(dist: DistContext, run_dir: Path, resume_from: Path | None, started: float) -> dict[str, Any]:
        torch.manual_seed(cfg.train.seed)  # every rank starts the same projection
        source = init or cfg.checkpoint.init
        model = load_embedder(cast(str, source), **{f.name: getattr(section, f.name)
                                                    for f in dataclasses.fields(EmbeddingSettings)})
        if accumulation_steps(cfg.train, world_size=dist.world_size) != 1:
            raise ConfigError("train.micro_batch_size × ranks must be train.global_batch_size: in-batch negatives "
                              "come from the whole batch (--cache-chunk saves memory instead)")
        if resume_from is None:
            cfg.checkpoint.init = str(Path(cast(str, source)).resolve())
        use_model(cfg, model.config)
        assert model.ids.file is not None
        cfg.data.vocab = str(model.ids.file.resolve())
        validate(cfg)
        data = Path(section.data).resolve()
        pairs = read_pairs(data, section.negatives)
        scale = section.scale or (1.0 if section.late_interaction else 20.0)
        job = Job(kind=SECTION, model=model, rows=PairRows(model, pairs),
                  loss_fn=RetrievalLoss(scale, section.symmetric, section.cache_chunk), data_files=[data],
                  description=f"{len(pairs.queries)} rows of {data} ({section.negatives} hard negatives each)",
                  rebuild=lambda: model, save=save_model,
                  write_settings=lambda d: write_run_files(d, cfg.to_yaml(), section, SECTION, Path(cfg.data.vocab)),
                  counts={"rows": len(pairs.queries)})
        return train_job(cfg, job, dist, run_dir, resume_from, source, log if dist.is_main else (lambda _: None),
                         started)

    return launch(cfg.execution, cfg.log, cfg.checkpoint.resume, out_dir, f"{SECTION}.yaml", SECTION, body,
                  overwrite, (init, section.data))


def run_command(args: argparse.Namespace, extra: list[str]) -> int:
    """``bertforge retrieval train``'s handler (its parser is in cli.py)."""
    from bertforge.config import parse_overrides

    overrides = parse_overrides(extra)
    for flag, key in (("data", "data"), ("pooling", "pooling"), ("query_prefix", "query_prefix"),
                      ("document_prefix", "document_prefix"), ("query_max_length", "query_max_length"),
                      ("document_max_length", "document_max_length"), ("negatives", "negatives"),
                      ("cache_chunk", "cache_chunk"), ("projection_dim", "projection_dim")):
        if getattr(args, flag) is not None:
            overrides.append((f"{SECTION}.{key}", getattr(args, flag)))
    for flag in ("symmetric", "late_interaction"):
        if getattr(args, flag):
            overrides.append((f"{SECTION}.{flag}", "true"))
    if args.no_progress:
        overrides.append(("log.progress", "false"))
    if args.resume:
        overrides.append(("checkpoint.resume", args.resume))
    if args.resume_with_changes:
        overrides.append(("checkpoint.resume_with_changes", "true"))
    section = RetrievalConfig()
    cfg = load_config(section, SECTION, "retrieval_base", args.config, overrides, resume=args.resume, out_dir=args.out)
    section.check()
    summary = finetune_retrieval(cfg, section, args.init, args.out, overwrite=args.overwrite)
    if summary["rank"] == 0:
        losses = summary["losses"]
        print(f"{summary['steps']} steps, loss {losses[0]:.4f} → {losses[-1]:.4f}; model: {summary['out_dir']} "
              f"(sentence-transformers: {Path(summary['out_dir']) / EXPORT_DIR})" if losses else summary)
    return 0
