"""``bertforge retrieval train``: contrastive fine-tuning of an embedding model on the fine-tuning engine.

    bertforge retrieval train --init MODEL --data pairs.jsonl --out DIR [--pooling mean|cls]
        [--query-prefix "search_query: "] [--negatives 1] [--symmetric] [--cache-chunk 32]
        [--matryoshka-dims 384 256 64] [--dev BEIR_DIR --train.eval_every 100 --best-metric ndcg@10]
        [--late-interaction --projection-dim 128] [--config glue_base] [--train.steps 100 …]

A sentence-transformers (or PyLate, or our fine-tuned) ``MODEL`` keeps its own pooling,
normalization, prompts and lengths (:func:`.model.directory_settings`); only the settings the
command gives replace them, and the first line says which (:func:`embedding_settings`).

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
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

import torch
from safetensors.torch import save_file
from torch import nn

from bertforge.config import (
    Config,
    ConfigError,
    ExecutionConfig,
    TrainConfig,
    accumulation_steps,
    load_yaml,
    resolve_config_path,
    use_model,
    validate,
)
from bertforge.fileio import LOCK, atomic_file
from bertforge.formats import weights
from bertforge.models.families import ENCODER_PREFIX
from bertforge.parallel.dist import DistContext
from bertforge.training.checkpoint import read_trainer_state

from ..finetune.run import Job, launch, load_config, step_counts, write_run_files
from ..finetune.run import train as train_job
from .beir import RetrievalSet, read_beir
from .dev import BEST_DIR, DevEvaluation
from .export import export_sentence_transformers
from .loss import RetrievalLoss
from .metrics import METRICS
from .model import (
    PROJECTION_FILE,
    Embedder,
    EmbeddingSettings,
    LateInteraction,
    directory_settings,
    load_embedder,
    pad,
)
from .pairs import Pairs
from .sampling import data_paths, read_datasets, sampled_rows

SECTION = "retrieval"  # its yaml beside the model is model.SETTINGS_FILE
EXPORT_DIR = "sentence-transformers"


@dataclass
class RetrievalConfig(EmbeddingSettings):
    """The ``retrieval:`` section: the model's settings, and the training's."""

    data: str | list[str] = ""  # the training rows (pairs.py); several files: one dataset each (sampling.py)
    negatives: int = 0          # hard negatives per row
    scale: float = 0.0          # the scores' scale: 0 is 20 for cosine, 1 for MaxSim (PyLate's)
    symmetric: bool = False     # also each positive against every query
    cache_chunk: int = 0        # GradCache: rows per forward with gradients (0: the whole batch)
    batch_sampler: Literal["batch_sampler", "no_duplicates"] = "batch_sampler"  # no_duplicates: no text twice a batch
    multi_dataset_batch_sampler: Literal["proportional", "round_robin"] = "proportional"  # several datasets
    # Matryoshka: the loss summed over the first N dimensions for each N (weights: 1 each by default)
    matryoshka_dims: list[int] = field(default_factory=list)
    matryoshka_weights: list[float] = field(default_factory=list)
    dev: str = ""               # a BEIR directory scored every train.eval_every steps and at the end (dev.py)
    dev_split: str = "dev"      # its qrels/SPLIT.tsv
    best_metric: str = "ndcg@10"  # the dev metric that picks RUN/best

    def sizes(self) -> list[tuple[int, float]]:
        """(dimension, weight) of the Matryoshka loss, largest first (sentence-transformers' order)."""
        weights = self.matryoshka_weights or [1.0] * len(self.matryoshka_dims)
        return sorted(zip(self.matryoshka_dims, weights), key=lambda pair: -pair[0])


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


def save_model(model: nn.Module, out_dir: Path, matryoshka_dims: Collection[int] = ()) -> None:
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
    export_sentence_transformers(embedder, out_dir / EXPORT_DIR, overwrite=True,
                                 matryoshka_dims=list(matryoshka_dims), own=out_dir / LOCK)


def check_training(train: TrainConfig, execution: ExecutionConfig, section: RetrievalConfig) -> RetrievalSet | None:
    """Refuse, in one line and before anything is written, what cannot train; the dev set, read."""
    if section.cache_chunk < 0:
        raise ConfigError(f"retrieval.cache_chunk={section.cache_chunk}: rows per forward must be positive "
                          f"(0: the whole batch at once)")
    if train.global_batch_size < 2 and section.negatives == 0:
        raise ConfigError(f"train.global_batch_size={train.global_batch_size} without hard negatives: a "
                          f"query's only candidate is its own positive, so the loss is 0 and nothing trains; "
                          f"use a batch of 2 or more, or --negatives N")
    if section.cache_chunk and execution.precision == "fp16":  # the loss scaler sees only the returned loss
        raise ConfigError("--cache-chunk cannot be used with execution.precision fp16 (the cached chunks' backward "
                          "is not loss-scaled); use bf16 or fp32")
    check_matryoshka(section)
    if section.best_metric not in METRICS:
        raise ConfigError(f"retrieval.best_metric={section.best_metric!r} is not a metric (one of "
                          f"{', '.join(METRICS)})")
    if not section.dev:
        if train.eval_every:
            raise ConfigError(f"train.eval_every={train.eval_every} needs a dev set to evaluate on: "
                              f"--dev BEIR_DIR (corpus.jsonl, queries.jsonl, qrels/SPLIT.tsv)")
        return None
    return read_beir(section.dev, section.dev_split)


def check_matryoshka(section: RetrievalConfig) -> None:
    dims, weights = section.matryoshka_dims, section.matryoshka_weights
    if not dims:
        if weights:
            raise ConfigError("retrieval.matryoshka_weights without retrieval.matryoshka_dims")
        return
    if section.late_interaction:
        raise ConfigError("--matryoshka-dims is for single-vector models, not --late-interaction")
    if min(dims) < 1 or len(set(dims)) != len(dims):
        raise ConfigError(f"retrieval.matryoshka_dims={dims}: distinct positive dimensions")
    if weights and len(weights) != len(dims):
        raise ConfigError(f"retrieval.matryoshka_weights has {len(weights)} weights for {len(dims)} dimensions "
                          f"({dims})")


def embedding_settings(source: str | Path, section: RetrievalConfig, given: Collection[str] | None
                       ) -> tuple[dict[str, Any], str]:
    """(the settings to load ``source`` with, a line saying where the settings come from).

    The directory's own settings stand unless given (``given``: the section's fields the user set;
    None: those that differ from the defaults)."""
    names = [f.name for f in dataclasses.fields(EmbeddingSettings)]
    if given is None:
        default = RetrievalConfig()
        given = [name for name in names if getattr(section, name) != getattr(default, name)]
    chosen = {name: getattr(section, name) for name in names if name in given}
    own = directory_settings(source)
    if not own:
        return chosen, ""
    kept = " ".join(f"{name}={own[name]!r}" for name in names if name in own and name not in chosen)
    over = " ".join(f"{name}={chosen[name]!r} (its {own[name]!r})" for name in names
                    if name in chosen and name in own and own[name] != chosen[name])
    return chosen, f"settings of {source}: {kept or 'none'} kept" + (f"; given over it: {over}" if over else "")


def finetune_retrieval(cfg: Config, section: RetrievalConfig, init: str | Path | None,
                       out_dir: str | Path | None = None, log: Any = print, overwrite: bool = False,
                       given: Collection[str] | None = None) -> dict[str, Any]:
    """Fine-tune ``init`` on ``section.data``'s rows into ``out_dir`` (or resume ``cfg.checkpoint.resume``).

    ``given``: the section's fields the user set, which replace the model directory's own settings
    (None: the fields that differ from :class:`RetrievalConfig`'s defaults)."""
    if not section.data:
        raise ConfigError("retrieval training needs --data (query/positive rows)")
    if cfg.execution.parallel not in ("none", "ddp"):
        raise ConfigError(f"execution.parallel={cfg.execution.parallel}: retrieval training runs alone or with ddp")
    dev = check_training(cfg.train, cfg.execution, section)

    def body(dist: DistContext, run_dir: Path, resume_from: Path | None, started: float) -> dict[str, Any]:
        torch.manual_seed(cfg.train.seed)  # every rank starts the same projection
        source = init or cfg.checkpoint.init
        if resume_from is None:
            chosen, said = embedding_settings(source, section, given)
        else:  # the run's own settings, as it saved them
            chosen, said = {f.name: getattr(section, f.name) for f in dataclasses.fields(EmbeddingSettings)}, ""
        model = load_embedder(source, **chosen)
        for name in (f.name for f in dataclasses.fields(EmbeddingSettings)):  # retrieval.yaml: what it trains with
            setattr(section, name, getattr(model.settings, name))
        if said and dist.is_main:
            log(said)
        if section.matryoshka_dims and max(section.matryoshka_dims) > model.dim:
            raise ConfigError(f"retrieval.matryoshka_dims={section.matryoshka_dims}: more than the model's "
                              f"{model.dim} dimensions")
        if accumulation_steps(cfg.train, world_size=dist.world_size) != 1:
            raise ConfigError("train.micro_batch_size × ranks must be train.global_batch_size: in-batch negatives "
                              "come from the whole batch (--cache-chunk saves memory instead)")
        if resume_from is None:
            cfg.checkpoint.init = str(Path(cast(str, source)).resolve())
        use_model(cfg, model.config)
        assert model.ids.file is not None
        cfg.data.vocab = str(model.ids.file.resolve())
        validate(cfg)
        files = [path.resolve() for path in data_paths(section.data)]
        pairs, sizes = read_datasets(files, section.negatives)
        rows = sampled_rows(PairRows(model, pairs), pairs, sizes, files, cfg.train.global_batch_size,
                            section.batch_sampler, section.multi_dataset_batch_sampler, cfg.train.seed)
        scale = section.scale or (1.0 if section.late_interaction else 20.0)

        def write_settings(directory: Path) -> None:
            write_run_files(directory, cfg.to_yaml(), section, SECTION, Path(cfg.data.vocab))

        def save(whole: nn.Module, directory: Path) -> None:
            save_model(whole, directory, section.matryoshka_dims)

        def save_best(whole: nn.Module, directory: Path) -> None:  # a model directory as the run's own
            write_settings(directory)
            save(whole, directory)

        evaluation = None
        if dev is not None:
            start = read_trainer_state(resume_from)["step"] if resume_from is not None else 0
            total = step_counts(cfg.train, len(rows), files, dist.world_size)[1]
            evaluation = DevEvaluation(dev, section.best_metric, cfg.train.eval_every, start, total, run_dir,
                                       save_best)
        job = Job(kind=SECTION, model=model, rows=rows,
                  loss_fn=RetrievalLoss(scale, section.symmetric, section.cache_chunk, section.sizes()),
                  data_files=files,
                  description=f"{len(pairs.queries)} rows of {', '.join(map(str, files))} "
                              f"({section.negatives} hard negatives each)",
                  rebuild=lambda: model, save=save, write_settings=write_settings,
                  evaluate=evaluation if evaluation is not None and cfg.train.eval_every else None,
                  finish=evaluation.finish if evaluation is not None else None,
                  counts={"rows": len(pairs.queries)})
        return train_job(cfg, job, dist, run_dir, resume_from, source, log if dist.is_main else (lambda _: None),
                         started)

    return launch(cfg.execution, cfg.log, cfg.checkpoint.resume, out_dir, f"{SECTION}.yaml", SECTION, body,
                  overwrite, (init, *data_paths(section.data)))


def run_command(args: argparse.Namespace, extra: list[str]) -> int:
    """``bertforge retrieval train``'s handler (its parser is in cli.py)."""
    from bertforge.config import parse_overrides

    overrides: list[tuple[str, Any]] = list(parse_overrides(extra))
    if args.cache_chunk is not None and args.cache_chunk < 1:
        raise ConfigError(f"--cache-chunk {args.cache_chunk}: rows per forward must be at least 1 (leave it out "
                          f"for the whole batch at once)")
    for flag in ("data", "pooling", "query_prefix", "document_prefix", "query_max_length", "document_max_length",
                 "negatives", "cache_chunk", "projection_dim", "matryoshka_dims", "matryoshka_weights", "dev",
                 "dev_split", "best_metric", "batch_sampler", "multi_dataset_batch_sampler"):
        if getattr(args, flag) is not None:
            overrides.append((f"{SECTION}.{flag}", getattr(args, flag)))
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
    given = {key[len(SECTION) + 1:] for key, _ in overrides if key.startswith(SECTION + ".")}
    if args.config:  # a config file's retrieval: keys are given too
        body = (load_yaml(resolve_config_path(args.config) or args.config) or {}).get(SECTION) or {}
        given |= set(body)
    summary = finetune_retrieval(cfg, section, args.init, args.out, overwrite=args.overwrite, given=given)
    if summary["rank"] == 0:
        losses = summary["losses"]
        print(f"{summary['steps']} steps, loss {losses[0]:.4f} → {losses[-1]:.4f}; model: {summary['out_dir']} "
              f"(sentence-transformers: {Path(summary['out_dir']) / EXPORT_DIR})" if losses else summary)
        scores = summary.get("scores")
        if scores:
            metric = section.best_metric
            print(f"dev {metric} {scores[metric]:.4f} at the end; best {scores['best_' + metric]:.4f} at step "
                  f"{scores['best_step']}: {Path(summary['out_dir']) / BEST_DIR}")
    return 0
