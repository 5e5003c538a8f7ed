"""``bertforge pretrain`` and ``bertforge eval``: their parsers and handlers.

No torch at import (``import bertforge.cli`` stays light): the handlers import the
training code when they run.
"""

from __future__ import annotations

import argparse
from typing import Any

from bertforge.config import CONFIG_HELP, OVERRIDES_HELP, PRETRAIN_CONFIG, ConfigError, positive_int
from bertforge.runs import config_from_args

PROFILE_HELP = ("torch.profiler over steps START..END-1 (from 0): a trace, a TensorBoard profile and the "
                "top operators in RUN/profile/ (log.profile)")


def cmd_pretrain(args: argparse.Namespace, extra: list[str]) -> int:
    from .pretrain import pretrain

    cfg = config_from_args(args, extra, default=PRETRAIN_CONFIG)
    if args.compile_only:
        from .pretrain import compile_only

        done = compile_only(cfg)
        if done["rank"] == 0:
            print(f"compiled in {done['seconds']:.1f} s into {done['compile_cache']} ({done['run_dir']}, the "
                  "one-step run that compiled it, is removed): a run of this config starts warm")
        return 0
    summary = pretrain(cfg)
    if summary["rank"] != 0:  # under torchrun, rank 0 speaks for the run
        return 0
    if summary["first_eval"] and summary["last_eval"]:
        first, last = summary["first_eval"], summary["last_eval"]
        nsp = (f", NSP accuracy {first['nsp_accuracy']:.4f} → {last['nsp_accuracy']:.4f}"
               if "nsp_accuracy" in last else "")
        print(f"held-out loss {first['loss']:.4f} → {last['loss']:.4f}, "
              f"masked-LM accuracy {first['mlm_accuracy']:.4f} → {last['mlm_accuracy']:.4f}{nsp}")
    # stdout is the run's result, printed at its end (progress and evaluations go to stderr as they come)
    print(f"run directory: {summary['run_dir']}")
    return 0


def cmd_eval(args: argparse.Namespace, extra: list[str]) -> int:
    from .engine import set_threads
    from .evaluate import evaluate_checkpoints, format_result

    cfg = config_from_args(args, extra, default=None)
    if not cfg.data.eval_input:
        raise ConfigError("bertforge eval needs the eval records: --data.eval_input FILE")
    set_threads(cfg.execution.threads)
    batch_size = args.batch_size or cfg.train.eval_batch_size or cfg.train.micro_batch_size
    for result in evaluate_checkpoints(args.checkpoints, cfg.data.eval_input, batch_size,
                                       cfg.execution.device, cfg.execution.precision, vocab=cfg.data.vocab or None,
                                       max_batches=cfg.train.eval_batches, progress=cfg.log.progress,
                                       every_s=cfg.log.progress_every_s):
        print(format_result(result, args.json), flush=True)
    return 0


def add_pretrain_command(sub: Any) -> None:
    """``bertforge pretrain``: registered by cli.py."""
    p = sub.add_parser("pretrain", help="pre-train BERT (masked LM, with next-sentence prediction or not)",
                       epilog=OVERRIDES_HELP,
                       description="Pre-train BERT. With no arguments: the tiny preset on the built-in "
                                   "corpus, offline, in a few minutes on a laptop CPU.")
    p.add_argument("--config", help=CONFIG_HELP + f" (default: {PRETRAIN_CONFIG})")
    p.add_argument("--steps", type=int, help="optimizer steps (train.steps)")
    p.add_argument("--epochs", type=int, help="passes over the data instead of --steps (train.epochs)")
    p.add_argument("--resume", help="run or checkpoint directory to continue exactly")
    p.add_argument("--compile-only", action="store_true",
                   help="compile the model and loss for this config into execution.compile_cache and exit "
                        "(one step and an evaluation in a hidden run directory, removed after)")
    p.add_argument("--resume-with-changes", action="store_true",
                   help="resume although the config or the data differ from the checkpoint's (each change is "
                        "logged; checkpoint.resume_with_changes)")
    p.add_argument("--init", help="start from these weights: our checkpoint, a Hugging Face directory or a "
                                  "TF1 checkpoint prefix with bert_config.json beside it (checkpoint.init)")
    p.add_argument("--run-dir", help="parent directory of run directories (log.run_dir)")
    p.add_argument("--name", help="run directory name (log.name)")
    p.add_argument("--wandb", action="store_true", help="log to Weights & Biases (log.wandb)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (log.progress)")
    p.add_argument("--profile", metavar="START:END", help=PROFILE_HELP)
    p.set_defaults(func=cmd_pretrain, takes_overrides=True)


def add_eval_command(sub: Any) -> None:
    """``bertforge eval``: registered by cli.py."""
    p = sub.add_parser("eval", help="masked-LM and NSP accuracy of checkpoints on an eval file",
                       epilog=OVERRIDES_HELP,
                       description="Evaluate each checkpoint (our run, step or model directory, a Hugging Face "
                                   "BERT directory, a TF1 checkpoint prefix) on every record of "
                                   "--data.eval_input, as a training run's evaluations do.")
    p.add_argument("checkpoints", nargs="+", metavar="CKPT")
    p.add_argument("--config", help=CONFIG_HELP + " (for execution.*, train.eval_batch_size, train.eval_batches "
                                                  "and data.vocab)")
    p.add_argument("--batch-size", type=positive_int, default=0,
                   help="sequences per batch (default: train.eval_batch_size, else train.micro_batch_size)")
    p.add_argument("--json", action="store_true", help="one JSON object per checkpoint")
    p.set_defaults(func=cmd_eval, takes_overrides=True)
