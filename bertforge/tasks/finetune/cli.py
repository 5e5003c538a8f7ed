"""``bertforge finetune glue | ner | predict | download-glue``.

    bertforge finetune glue --task mrpc --data glue/MRPC --init MODEL [--out DIR]
        [--seeds 1 2 3] [--lr 2e-5 3e-5 5e-5] [--config glue_base] [--train.epochs 3 …]
    bertforge finetune ner --data conll2003/ --init MODEL [--out DIR] [--config ner_base]
    bertforge finetune predict --model RUN [--split test] [--data DIR] [--out DIR]
    bertforge finetune download-glue --out glue/ [--tasks mrpc rte]

With several seeds or learning rates, each (lr, seed) trains in its own run
directory under ``--out`` (``lr2e-05-seed1/`` …); a run that finished is not
trained again and one that was stopped resumes, so the same command continues
an interrupted sweep. ``--out/sweep.json`` then holds every run's dev scores,
the median over seeds per learning rate (as papers report GLUE) and the best
learning rate by that median.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from pathlib import Path
from typing import Any

from bertforge.config import positive_int

OVERRIDES_HELP = ("Config fields are set with dotted flags, e.g. --train.lr 3e-5 --train.epochs 3 "
                  "--data.seq_len 128 --finetune.max_examples 1000.")


def _overrides(args: argparse.Namespace, extra: list[str]) -> list[tuple[str, Any]]:
    from bertforge.config import ConfigError, parse_overrides

    overrides = parse_overrides(extra)
    if getattr(args, "task", None):
        overrides.append(("finetune.task", args.task))
    if args.data:
        overrides.append(("finetune.data", args.data))
    if args.no_progress:
        overrides.append(("log.progress", "false"))
    if args.resume:
        overrides.append(("checkpoint.resume", args.resume))
    if args.resume_with_changes:
        overrides.append(("checkpoint.resume_with_changes", "true"))
    if args.overwrite and args.resume:
        raise ConfigError("--overwrite starts a new run; it cannot be used with --resume")
    if args.overwrite and not args.out:
        raise ConfigError("--overwrite needs --out DIR, the directory to replace")
    return overrides


def resolved_config(name: str, overrides: list[tuple[str, str]]) -> str:
    """``bertforge config --config glue_base``: the Config and its ``finetune:`` section as
    ``finetune glue|ner`` resolves them, as YAML that ``--config`` reads back. The task is
    checked when the config names one (``glue_base`` leaves it to ``--task``)."""
    import dataclasses

    import yaml

    from .run import load_config
    from .train import DEFAULT_CONFIGS, SECTION, TaskConfig, check_task

    task = TaskConfig()
    cfg = load_config(task, SECTION, DEFAULT_CONFIGS["glue"], name, overrides)
    if task.task:
        check_task(task, "ner" if task.task == "ner" else "glue")
    return cfg.to_yaml() + yaml.safe_dump({SECTION: dataclasses.asdict(task)}, sort_keys=False)


def cmd_train(args: argparse.Namespace, extra: list[str]) -> int:
    from bertforge.config import ConfigError

    from .run import check_overwrite, clear_out_dir, prepare_out_dir
    from .train import finetune, load_task_config, require_main_dev

    _refuse_repeats("--seeds", args.seeds)
    _refuse_repeats("--lr", args.lr)
    overrides = _overrides(args, extra)
    sweep = len(args.seeds or []) > 1 or len(args.lr or []) > 1
    if sweep and args.resume:
        raise ConfigError("a sweep resumes by running the same command again (without --resume)")
    cfg, task = load_task_config(args.kind, args.config, overrides, resume=args.resume, out_dir=args.out)
    if sweep:  # refused before --overwrite removes anything
        if not args.out:
            raise ConfigError("a sweep (several --seeds or --lr) needs --out DIR, the directory of its runs")
        require_main_dev(task)
    if args.overwrite:
        inputs = {"--init": args.init, "--data": task.data, "--vocab": args.vocab}
        check_overwrite(args.out, inputs)
        if sweep and int(os.environ.get("RANK", "0")) == 0:  # not a run's directory: its runs are in it
            clear_out_dir(prepare_out_dir(cfg.log, args.out, overwrite=True, inputs=list(inputs.values())))
    if not sweep:
        if args.seeds:
            cfg.train.seed = args.seeds[0]
        if args.lr:
            cfg.train.lr = args.lr[0]
        summary = finetune(cfg, task, args.init, args.out, args.vocab, overwrite=args.overwrite)
        if summary["rank"] == 0:
            _print_summary(summary)
        return 0
    return _sweep(args, overrides)


def _refuse_repeats(flag: str, values: list[int] | list[float] | None) -> None:
    """A value given twice is one run (one directory, ``lr{lr:g}-seed{seed}``) that a sweep would
    report as two: the median over ``--seeds 1 1`` is over one run. Values are compared as the run
    directories spell them."""
    from bertforge.config import ConfigError

    seen: set[str] = set()
    for value in values or []:
        name = f"{value:g}"
        if name in seen:
            raise ConfigError(f"{flag} {name} is given twice: each value is one run, and a run counts once")
        seen.add(name)


def _print_summary(summary: dict[str, Any]) -> None:
    from .run import saved_line

    losses = summary["losses"]
    trained = f"; loss {losses[0]:.4f} → {losses[-1]:.4f}" if losses else ""
    print(f"{summary['steps']} steps in {summary['minutes']:.1f} min{trained}")
    print(saved_line(summary))
    for path in summary.get("prediction_files", []):
        print(f"predictions: {path}")
    if summary.get("scores"):
        print(json.dumps(summary["scores"]))


def _sweep(args: argparse.Namespace, overrides: list[tuple[str, Any]]) -> int:
    """Every (lr, seed) in its own run under --out, skipped when finished; then sweep.json."""
    from bertforge.config import set_value
    from bertforge.fileio import atomic_file

    from .train import finetune, load_task_config

    out = Path(args.out)
    rank = int(os.environ.get("RANK", "0"))
    results: list[dict[str, Any]] = []
    for lr in args.lr or [None]:
        for seed in args.seeds or [None]:
            cfg, task = load_task_config(args.kind, args.config, overrides)
            if lr is not None:
                cfg.train.lr = lr
            if seed is not None:
                cfg.train.seed = seed
            run = out / f"lr{cfg.train.lr:g}-seed{cfg.train.seed}"
            scores_file = run / "scores.json"
            if not scores_file.is_file():  # new, or stopped: auto starts it or resumes its newest checkpoint
                set_value(cfg, "checkpoint.resume", "auto")
                summary = finetune(cfg, task, args.init, run, args.vocab)
                if summary.get("preempted"):
                    return 0  # the sweep goes on when the command runs again
            scores = json.loads(scores_file.read_text(encoding="utf-8"))
            main = scores[task.main_metric]
            results.append({"lr": cfg.train.lr, "seed": cfg.train.seed, "run": str(run), "main": main,
                            "scores": scores})
            if rank == 0:
                print(f"lr {cfg.train.lr:g} seed {cfg.train.seed}: {json.dumps(scores)}")
    by_lr: dict[float, list[float]] = {}
    for r in results:
        by_lr.setdefault(r["lr"], []).append(r["main"])
    medians = {lr: _median(values) for lr, values in by_lr.items()}
    best = max(medians, key=lambda lr: _rank(medians[lr]))
    report = {"task": task.task, "runs": results,
              "median_by_lr": {f"{lr:g}": m for lr, m in medians.items()}, "best_lr": best,
              "best_median": medians[best]}
    if rank == 0:
        with atomic_file(out / "sweep.json") as tmp:
            tmp.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        for lr, m in medians.items():
            seeds = ", ".join(f"{v:.4f}" for v in by_lr[lr])
            print(f"lr {lr:g}: median {m:.4f} over {len(by_lr[lr])} seeds ({seeds})")
        print(f"best lr {best:g}: median {medians[best]:.4f}; {out / 'sweep.json'}")
    return 0


def _rank(score: float) -> float:
    """A score's place in an order: NaN (a correlation of constant predictions) below every number."""
    return -math.inf if math.isnan(score) else score


def _median(values: list[float]) -> float:
    """The median with NaN ranked lowest (``statistics.median`` leaves NaN's place undefined)."""
    ordered = sorted(values, key=_rank)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return statistics.mean(ordered[middle - 1:middle + 1])


def cmd_predict(args: argparse.Namespace, extra: list[str]) -> int:
    from bertforge.config import ConfigError

    from .train import predict

    if not args.progress_every_s > 0:
        raise ConfigError(f"log.progress_every_s={args.progress_every_s} must be positive")
    result = predict(args.model, args.data, args.task, args.split, args.out, args.vocab,
                     batch_size=args.batch_size, progress=not args.no_progress,
                     progress_every_s=args.progress_every_s)
    if "scores" in result:
        print(json.dumps(result["scores"]))
    else:
        print(f"predictions: {result['file']}")
    return 0


def cmd_download_glue(args: argparse.Namespace, extra: list[str]) -> int:
    from .glue import download_glue

    for path in download_glue(args.out, args.tasks or None):
        print(path)
    return 0


def add_finetune_commands(sub: Any) -> None:
    """Add ``finetune`` with its subcommands to an argparse subparsers object."""
    from bertforge.config import LogConfig

    from .glue import TASKS

    finetune = sub.add_parser("finetune", help="GLUE and NER fine-tuning, prediction and the GLUE download")
    commands = finetune.add_subparsers(dest="finetune_command", required=True)
    for kind, helptext in (("glue", "fine-tune on a GLUE task (dev scores, leaderboard test files)"),
                           ("ner", "fine-tune on CoNLL-2003-format token classification (entity F1)")):
        p = commands.add_parser(kind, help=helptext, epilog=OVERRIDES_HELP)
        if kind == "glue":
            p.add_argument("--task", help=f"the GLUE task, any case: {', '.join(TASKS)} (default with --resume: "
                                          "the run's)")
        p.add_argument("--data", help="the task's directory (GLUE: train.tsv, dev.tsv, test.tsv; NER: train.txt, "
                                      "dev.txt, test.txt); default with --resume: the run's")
        p.add_argument("--init", help="our checkpoint, a Hugging Face BERT directory or a TF1 checkpoint")
        p.add_argument("--config", default=None, help=f"{kind}_base (default) or a YAML path")
        p.add_argument("--out", help="run directory (a sweep's: one run per lr and seed under it)")
        p.add_argument("--seeds", type=int, nargs="+", help="train.seed values: several make a sweep")
        p.add_argument("--lr", type=float, nargs="+", help="train.lr values: several make a sweep")
        p.add_argument("--resume", help="a run or step directory to continue exactly")
        p.add_argument("--resume-with-changes", action="store_true",
                       help="resume although the config or the data differ from the checkpoint's")
        p.add_argument("--overwrite", action="store_true",
                       help="--out may be a non-empty directory: the old run's files are removed first, "
                            "under its lock (a live run's directory is refused)")
        p.add_argument("--vocab", "--tokenizer", dest="vocab",
                       help="vocab.txt or tokenizer.json (default: the one beside --init)")
        p.add_argument("--no-progress", action="store_true")
        p.set_defaults(func=cmd_train, kind=kind, takes_overrides=True)

    p = commands.add_parser("predict", help="score a dev split or write a test split's predictions")
    p.add_argument("--model", required=True, help="a fine-tuned run directory, or a Hugging Face classifier")
    p.add_argument("--task", help="the task (default: the model's finetune.yaml)")
    p.add_argument("--data", help="the task's directory (default: the one it was trained on)")
    p.add_argument("--split", default="test", help="dev, test (MNLI: dev_matched, test_mismatched, …; ax)")
    p.add_argument("--out", help="where test predictions go (default: the model's directory)")
    p.add_argument("--vocab", "--tokenizer", dest="vocab",
                       help="vocab.txt or tokenizer.json (default: the one beside --model)")
    p.add_argument("--batch-size", type=positive_int, default=None)
    p.add_argument("--no-progress", action="store_true", help="no progress bar or lines (log.progress)")
    p.add_argument("--log.progress_every_s", dest="progress_every_s", type=float, default=LogConfig.progress_every_s,
                   metavar="S", help="seconds between progress lines when the output is not a terminal")
    p.set_defaults(func=cmd_predict)

    p = commands.add_parser("download-glue", help="download the GLUE task archives (checksummed, resumable)")
    p.add_argument("--out", required=True, help="directory of the GLUE layout (CoLA/, MRPC/, …)")
    p.add_argument("--tasks", nargs="+", help="tasks to fetch (default: all)")
    p.set_defaults(func=cmd_download_glue)
