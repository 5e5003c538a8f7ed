"""The ``bertforge`` command: one subcommand per job.

    bertforge pretrain [--config NAME] [--steps N] [--resume RUN] [--section.key VALUE ...]
    bertforge bench pretrain --config tiny --batch-size 16 --seq-len 128 --steps 20 --json
    bertforge bench squad --model base --batch-size 8 --seq-len 384 --json   # train + infer
    bertforge bench --spec benchmarks.yml [--benchmark NAME ...] [--json] [--list] [--quick]
    bertforge export CHECKPOINT OUT_DIR [--overwrite] [--format hf|tf1|tf2]   # to Hugging Face, TF1 or TF2
    bertforge import tf1|tf2 PREFIX OUT_DIR [--bert-config FILE]   # a TF1 or TF2 checkpoint to our model directory
    bertforge import hf DIR_OR_ID OUT_DIR      # a Hugging Face BERT or ModernBERT to our model directory
    bertforge eval CKPT... --data.eval_input FILE [--batch-size N] [--json]   # masked-LM / NSP accuracy
    bertforge config [--config NAME] [--section.key VALUE ...]   # print the resolved config
    bertforge report RUN... --out DIR [--overwrite]   # figures and one HTML page (see observe/report.py)
    bertforge data …                           # Wikipedia / text → records (see data/cli.py)
    bertforge squad train|predict|evaluate|ask # SQuAD v1.1 and v2.0 (see squad/cli.py)
    bertforge finetune glue|ner|predict|download-glue  # GLUE and NER (see finetune/cli.py)

Every command handler takes ``(args, extra)`` and returns an exit status. ``main``
is the one place that turns errors into exits: a mistake a user can make (see
:func:`user_errors`) ends with one ``error: …`` line on stderr and exit status 2.
It also configures ``logging`` once: ``--log-level`` (default: the
``BERTFORGE_LOG_LEVEL`` environment variable, else INFO) for the ``bertforge.*``
loggers, on stderr.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
import typing
from pathlib import Path

from bertforge.data.cli import add_data_commands
from bertforge.observe.log import LOG_LEVELS, console_logging
from bertforge.parallel.plan import add_plan_command
from bertforge.tasks.finetune.cli import add_finetune_commands
from bertforge.tasks.squad.cli import add_squad_commands

from .config import (
    MODEL_PRESETS,
    PRETRAIN_CONFIG,
    ConfigError,
    Head,
    Precision,
    parse_overrides,
)
from .runs import config_from_args
from .version import __version__

LOG_LEVEL_ENV = "BERTFORGE_LOG_LEVEL"
DISK_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)

PROFILE_HELP = ("torch.profiler over steps START..END-1 (from 0): a trace, a TensorBoard profile and the "
                "top operators in RUN/profile/ (log.profile)")
OVERRIDES_HELP = ("Any config field can be set with a dotted flag, e.g. --train.lr 1e-4 "
                  "--data.input corpus.txt --execution.precision bf16 (see `bertforge config`).")


def cmd_pretrain(args: argparse.Namespace, extra: list[str]) -> int:
    from bertforge.training.pretrain import pretrain

    cfg = config_from_args(args, extra, default=PRETRAIN_CONFIG)
    if args.compile_only:
        from bertforge.training.pretrain import compile_only

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
        print(f"held-out masked-LM accuracy {first['mlm_accuracy']:.4f} → {last['mlm_accuracy']:.4f}{nsp}")
    print(f"run directory: {summary['run_dir']}")
    return 0


def print_result(result: dict, as_json: bool) -> None:
    """A benchmark's result: one JSON object, or one aligned line per key."""
    if as_json:
        print(json.dumps(result))
        return
    width = max(map(len, result))
    for key, value in result.items():
        print(f"{key:>{width}}: {value}")


def cmd_bench(args: argparse.Namespace, extra: list[str]) -> int:
    from bertforge.bench.pretrain import bench_pretrain

    cfg = config_from_args(args, extra, default="tiny")
    if args.max_predictions is not None:
        cfg.data.max_predictions = args.max_predictions
        cfg.given.add("data.max_predictions")  # with --data, the records' must agree
    for flag, section, key in (("precision", "execution", "precision"), ("device", "execution", "device")):
        if getattr(args, flag) is not None:
            setattr(getattr(cfg, section), key, getattr(args, flag))
    result = bench_pretrain(cfg, args.batch_size, args.seq_len, args.steps, warmup=args.warmup,
                            accumulation=args.accumulation, data=args.data, peak=args.peak_tflops)
    print_result(result, args.json)
    return 0


def cmd_bench_spec(args: argparse.Namespace, extra: list[str]) -> int:
    from bertforge.bench.spec import run_command

    if not args.spec:
        raise ConfigError("bench: name a benchmark (pretrain, squad) or a spec: --spec benchmarks.yml")
    return run_command(args, build_parser())


def cmd_bench_squad(args: argparse.Namespace, extra: list[str]) -> int:
    from bertforge.bench.squad import bench_squad
    from bertforge.tasks.squad.train import load_squad_config

    overrides = parse_overrides(extra)
    for flag, key in (("precision", "execution.precision"), ("device", "execution.device"),
                      ("threads", "execution.threads")):
        if getattr(args, flag) is not None:
            overrides.append((key, getattr(args, flag)))
    cfg, squad = load_squad_config(args.config, overrides)
    result = bench_squad(cfg, squad, args.model, args.batch_size, args.seq_len, args.steps,
                         warmup=args.warmup, mode=args.mode)
    print_result(result, args.json)
    return 0


def cmd_export(args: argparse.Namespace, extra: list[str]) -> int:
    from bertforge.formats.hf import export_hf, find_model, hf_head, hf_labels, is_hf_directory
    from bertforge.formats.load import load_model
    from bertforge.formats.weights import check_export_target

    from .runs import find_checkpoint, vocab_in

    source = find_model(args.checkpoint)  # a path, or a Hugging Face id in the local cache
    hf = is_hf_directory(source)
    checkpoint = source if hf else find_checkpoint(source, weights_only=True)  # a model directory will do
    out = Path(args.out).resolve()
    if args.overwrite and (out == checkpoint.resolve() or out in checkpoint.resolve().parents):
        raise ConfigError(f"{args.out}: --overwrite would delete the checkpoint being exported "
                          f"({checkpoint}); choose another output directory")
    check_export_target(args.out, args.overwrite)  # refused before the weights are loaded
    head, labels = args.head, None
    if hf:  # the head its config.json's architecture has, a classifier's label names from there too
        head, labels = head or hf_head(checkpoint), hf_labels(checkpoint)
    elif settings := [d for d in (checkpoint, checkpoint.parent.parent) if (d / "finetune.yaml").is_file()]:
        # a GLUE or NER model: its head and label names
        from bertforge.tasks.finetune.train import saved_task

        task = saved_task(settings[0])
        head, labels = head or task.head, task.labels or None
    elif head is None:
        head = "qa" if any((d / "squad.yaml").is_file() for d in (checkpoint, checkpoint.parent.parent)) \
            else "pretraining"
    model = load_model(checkpoint, head=head)
    vocab = vocab_in(checkpoint)
    if args.format == "tf1":
        from bertforge.formats.bert_tf1 import export_tf1
        from bertforge.training.checkpoint import read_trainer_state

        step = read_trainer_state(checkpoint)["step"] if (checkpoint / "trainer.pt").is_file() else 0
        export_tf1(model, args.out, vocab_path=vocab, overwrite=args.overwrite,
                   global_step=int(step))
    elif args.format == "tf2":
        from bertforge.formats.tf2 import export_tf2

        export_tf2(model, args.out, vocab_path=vocab, overwrite=args.overwrite,
                   layout=args.tf2_layout)
    else:
        export_hf(model, args.out, vocab_path=vocab, overwrite=args.overwrite,
                  labels=labels)
    print(f"exported {checkpoint} to {args.out}")
    return 0


def _import_prefix(args: argparse.Namespace) -> Path:
    """The TensorFlow checkpoint prefix an import names; an --overwrite that would delete it is refused."""
    from .formats import tf1
    from .runs import CheckpointError

    prefix = tf1.find_prefix(args.prefix)
    if prefix is None:
        raise CheckpointError(f"{args.prefix}: not a TensorFlow checkpoint ({args.prefix}.index is missing)")
    out = Path(args.out).resolve()
    if args.overwrite and (out == prefix.parent.resolve() or out in prefix.parent.resolve().parents):
        raise ConfigError(f"{args.out}: --overwrite would delete the checkpoint being imported ({prefix}); "
                          f"choose another output directory")
    return prefix


def cmd_import_tf1(args: argparse.Namespace, extra: list[str]) -> int:
    from bertforge.formats.bert_tf1 import import_tf1

    prefix = _import_prefix(args)
    out, skipped = import_tf1(prefix, args.out, args.bert_config, args.vocab, overwrite=args.overwrite)
    print(f"imported {prefix} to {out}; skipped {len(skipped)} variables that are not model weights "
          f"(optimizer slots, global_step, …)")
    return 0


def cmd_import_tf2(args: argparse.Namespace, extra: list[str]) -> int:
    from bertforge.formats.tf2 import import_tf2

    prefix = _import_prefix(args)
    out, skipped, fresh = import_tf2(prefix, args.out, args.bert_config, args.vocab, overwrite=args.overwrite)
    heads = sorted({name.rsplit(".", 1)[0] for name in fresh})
    print(f"imported {prefix} to {out}; skipped {len(skipped)} variables that are not model weights "
          f"(save_counter, …)" + (f"; not in the reference TF2 model, newly initialised: {', '.join(heads)}"
                                  if heads else ""))
    return 0


def cmd_import_hf(args: argparse.Namespace, extra: list[str]) -> int:
    from bertforge.formats.hf import find_model, import_hf

    source = find_model(args.source)
    out = Path(args.out).resolve()
    if args.overwrite and (out == source.resolve() or out in source.resolve().parents):
        raise ConfigError(f"{args.out}: --overwrite would delete the model being imported ({source}); "
                          f"choose another output directory")
    print(f"imported {source} to {import_hf(source, args.out, overwrite=args.overwrite)}")
    return 0


def cmd_report(args: argparse.Namespace, extra: list[str]) -> int:
    from bertforge.observe.report import write_report

    write_report(args.runs, args.out, overwrite=args.overwrite)
    return 0


def cmd_eval(args: argparse.Namespace, extra: list[str]) -> int:
    from bertforge.training.engine import set_threads
    from bertforge.training.evaluate import evaluate_checkpoints, format_result

    cfg = config_from_args(args, extra, default=None)
    if not cfg.data.eval_input:
        raise ConfigError("bertforge eval needs the eval records: --data.eval_input FILE")
    set_threads(cfg.execution.threads)
    batch_size = args.batch_size or cfg.train.eval_batch_size or cfg.train.micro_batch_size
    for result in evaluate_checkpoints(args.checkpoints, cfg.data.eval_input, batch_size,
                                       cfg.execution.device, cfg.execution.precision):
        print(format_result(result, args.json), flush=True)
    return 0


def cmd_config(args: argparse.Namespace, extra: list[str]) -> int:
    cfg = config_from_args(args, extra, default=PRETRAIN_CONFIG)
    print(cfg.to_yaml(), end="")
    return 0


def _log_level(text: str) -> str:
    level = text.strip().upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a log level ({', '.join(LOG_LEVELS)}); "
                                         f"it may come from ${LOG_LEVEL_ENV}")
    return level


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bertforge", description="BERT pre-training and fine-tuning.",
                                     epilog=OVERRIDES_HELP, allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"bertforge {__version__}")
    parser.add_argument("--log-level", type=_log_level, default=os.environ.get(LOG_LEVEL_ENV) or "INFO",
                        metavar="{" + ",".join(LOG_LEVELS) + "}",
                        help=f"messages shown on stderr (default: ${LOG_LEVEL_ENV}, else INFO)")
    sub = parser.add_subparsers(dest="command", required=True)

    config_help = (f"a config shipped in bertforge/configs (e.g. pretrain_base_128), a YAML path, "
                   f"or a model preset ({', '.join(MODEL_PRESETS)})")
    p = sub.add_parser("pretrain", help="pre-train BERT (masked LM, with next-sentence prediction or not)",
                       epilog=OVERRIDES_HELP,
                       description="Pre-train BERT. With no arguments: the tiny preset on the built-in "
                                   "corpus, offline, in a few minutes on a laptop CPU.")
    p.add_argument("--config", help=config_help + f" (default: {PRETRAIN_CONFIG})")
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

    bench = sub.add_parser("bench", help="benchmarks on synthetic data, or named ones from a spec",
                           description="bertforge bench pretrain|squad …, or bertforge bench --spec "
                                       "benchmarks.yml [--benchmark NAME ...] (see bertforge/bench/spec.py)")
    bench.add_argument("--spec", help="a YAML benchmark spec (e.g. benchmarks.yml): run its benchmarks")
    bench.add_argument("--benchmark", nargs="+", action="extend", metavar="NAME",
                       help="with --spec: only these benchmarks (default: all)")
    bench.add_argument("--list", action="store_true", help="with --spec: list the benchmarks, run nothing")
    bench.add_argument("--quick", action="store_true",
                       help="with --spec: each benchmark once with its small 'quick' sizes")
    bench.add_argument("--json", dest="spec_json", action="store_true",
                       help="with --spec: one JSON line per benchmark")
    bench.add_argument("--set", action="append", metavar="NAME.KEY=VALUE",
                       help="with --spec: change a benchmark first, e.g. data_create_fast.args.input=corpus.txt")
    bench.set_defaults(func=cmd_bench_spec)
    bench_sub = bench.add_subparsers(dest="bench")
    p = bench_sub.add_parser("pretrain", help="pre-training step throughput, MFU and peak memory",
                             epilog=OVERRIDES_HELP)
    p.add_argument("--config", help=config_help + " (default: tiny)")
    p.add_argument("--batch-size", type=int, default=16, help="rows per micro-batch")
    p.add_argument("--seq-len", type=int, help="default 128; with --data the records'")
    p.add_argument("--max-predictions", type=int,
                   help="masked positions per sequence (default 20; with --data the records')")
    p.add_argument("--accumulation", type=int, default=1, metavar="N",
                   help="micro-batches per optimizer step: a timed step is N forward+backward passes, "
                        "then one optimizer step")
    p.add_argument("--data", metavar="PATH",
                   help="time on these records (directory, glob or file; packed or not) instead of a "
                        "synthetic batch; read into memory before timing")
    p.add_argument("--peak-tflops", type=float, metavar="X",
                   help="the device's peak for MFU (default: known NVIDIA GPUs' dense peak for the precision; "
                        "none on the CPU)")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--precision", choices=typing.get_args(Precision))
    p.add_argument("--device", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_bench, takes_overrides=True)
    p = bench_sub.add_parser("squad", help="SQuAD training-step and inference throughput",
                             epilog=OVERRIDES_HELP)
    p.add_argument("--model", default="tiny",
                   help=f"a model preset ({', '.join(MODEL_PRESETS)}; random weights) or a model "
                        "directory: our checkpoint, a SQuAD fine-tune or a Hugging Face BERT (default: tiny)")
    p.add_argument("--config", help="the training recipe: squad_base (default), squad_large or a YAML path")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=384)
    p.add_argument("--steps", type=int, default=10, help="timed steps (training) and batches (inference)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--mode", choices=("train", "infer", "both"), default="both")
    p.add_argument("--precision", choices=typing.get_args(Precision))
    p.add_argument("--device", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--threads", type=int, help="torch CPU threads (execution.threads)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_bench_squad, takes_overrides=True)

    p = sub.add_parser("export", help="export a checkpoint to a Hugging Face BERT directory or a TF1 or TF2 checkpoint")
    p.add_argument("checkpoint", help="run, step or model directory, a Hugging Face directory, or a Hugging Face "
                                      "model id in the local Hugging Face cache")
    p.add_argument("out", type=Path, help="output directory: new or empty, unless --overwrite")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT_DIR if it exists and is not empty (never a live run's)")
    p.add_argument("--head", choices=typing.get_args(Head), default=None,
                   help="default: the run's (classification or token_classification for finetune runs, qa for "
                        "squad runs, a Hugging Face model's from its config.json's architectures, else pretraining)")
    p.add_argument("--format", choices=("hf", "tf1", "tf2"), default="hf",
                   help="hf: config.json + model.safetensors; tf1: model.ckpt.index/.data-00000-of-00001, "
                        "checkpoint and bert_config.json, as google-research/bert reads them; tf2: the same files "
                        "as an object-based checkpoint that TensorFlow Model Garden's BertEncoder / "
                        "BertPretrainerV2 restores (MLPerf's tf2_ckpt) (default: hf)")
    p.add_argument("--tf2-layout", choices=("pretrainer", "encoder"), default=None,
                   help="with --format tf2: pretrainer (the encoder and the masked-LM head under encoder/ and "
                        "masked_lm/) or encoder (BertEncoder alone, the converter's default) (default: pretrainer "
                        "when the model has a masked-LM head)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("import", help="convert another format's checkpoint to our model directory")
    import_sub = p.add_subparsers(dest="format", required=True)
    p = import_sub.add_parser("tf1", help="a TensorFlow 1 checkpoint (google-research/bert, MLPerf)",
                              description="Write a TF1 checkpoint (e.g. ckpt/model.ckpt-28252) as a directory "
                                          "that load_model, --init, eval and export read. Optimizer slots and "
                                          "global_step are skipped.")
    p.add_argument("prefix", help="checkpoint prefix (PREFIX.index and PREFIX.data-* exist), or its directory")
    p.add_argument("out", type=Path, help="output directory: new or empty, unless --overwrite")
    p.add_argument("--bert-config", help="bert_config.json (default: the one beside the checkpoint)")
    p.add_argument("--vocab", help="vocab.txt to copy (default: the one beside the checkpoint, if any)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT_DIR if it exists and is not empty (never a live run's)")
    p.set_defaults(func=cmd_import_tf1)
    p = import_sub.add_parser("tf2", help="a TensorFlow 2 object-based checkpoint (Model Garden's BertEncoder or "
                                          "BertPretrainerV2; MLPerf's tf2_ckpt)",
                              description="Write a TF2 checkpoint (e.g. tf2_ckpt/model.ckpt-28252) as a directory "
                                          "that load_model, --init, eval and export read. The heads the reference "
                                          "TF2 model lacks (NSP; the masked-LM head of an encoder checkpoint) are "
                                          "newly initialised, and named.")
    p.add_argument("prefix", help="checkpoint prefix (PREFIX.index and PREFIX.data-* exist), or its directory")
    p.add_argument("out", type=Path, help="output directory: new or empty, unless --overwrite")
    p.add_argument("--bert-config", help="bert_config.json (default: the one beside the checkpoint, or one "
                                         "directory up)")
    p.add_argument("--vocab", help="vocab.txt to copy (default: the one beside the checkpoint or one directory up, "
                                   "if any)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT_DIR if it exists and is not empty (never a live run's)")
    p.set_defaults(func=cmd_import_tf2)
    p = import_sub.add_parser("hf", help="a Hugging Face BERT or ModernBERT directory, or a model id in the local "
                                         "Hugging Face cache",
                              description="Write a transformers model directory (config.json with model_type bert "
                                          "or modernbert, model.safetensors) as our model directory, with the head "
                                          "its architecture names and its vocab.txt or tokenizer.json.")
    p.add_argument("source", help="the directory, or a model id in the local Hugging Face cache")
    p.add_argument("out", type=Path, help="output directory: new or empty, unless --overwrite")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT_DIR if it exists and is not empty (never a live run's)")
    p.set_defaults(func=cmd_import_hf)

    add_data_commands(sub)
    add_squad_commands(sub)
    add_finetune_commands(sub)

    p = sub.add_parser("report", help="figures and one HTML page for runs, from their metrics.jsonl and config.yaml",
                       description="Write DIR/index.html (figures embedded) and DIR/*.png for one or more run "
                                   "directories, overlaid, with a summary table and the config values they differ in.")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories (pretrain or squad train)")
    p.add_argument("--out", required=True, type=Path, help="output directory: new or empty, unless --overwrite")
    p.add_argument("--overwrite", action="store_true",
                   help="write into a non-empty OUT (other files stay; never a live run's)")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("eval", help="masked-LM and NSP accuracy of checkpoints on an eval file",
                       epilog=OVERRIDES_HELP,
                       description="Evaluate each checkpoint (our run, step or model directory, a Hugging Face "
                                   "BERT directory, a TF1 checkpoint prefix) on every record of "
                                   "--data.eval_input, as a training run's evaluations do.")
    p.add_argument("checkpoints", nargs="+", metavar="CKPT")
    p.add_argument("--config", help=config_help + " (for execution.* and train.eval_batch_size)")
    p.add_argument("--batch-size", type=int, default=0,
                   help="sequences per batch (default: train.eval_batch_size, else train.micro_batch_size)")
    p.add_argument("--json", action="store_true", help="one JSON object per checkpoint")
    p.set_defaults(func=cmd_eval, takes_overrides=True)

    p = sub.add_parser("config", help="print a resolved config as YAML", epilog=OVERRIDES_HELP)
    p.add_argument("--config", help=config_help + f" (default: {PRETRAIN_CONFIG}, what `bertforge pretrain` runs)")
    p.set_defaults(func=cmd_config, takes_overrides=True)
    add_plan_command(sub, config_help, OVERRIDES_HELP)
    return parser


def user_errors() -> tuple[type[Exception], ...]:
    """Exceptions that carry a message for the user rather than a bug."""
    from bertforge.tasks.finetune import FinetuneError
    from bertforge.tasks.squad import SquadError

    from .data import DataError
    from .fileio import WriteError

    # WriteError: a full disk or a read-only directory, raised by every command that writes
    # (through bertforge.fileio), after removing what it had written.
    errors: list[type[Exception]] = [ConfigError, DataError, SquadError, FinetuneError, FileNotFoundError, WriteError]
    # These modules import torch: only a command that loaded them can have raised their errors.
    for module, name in (("bertforge.runs", "CheckpointError"), ("bertforge.formats.weights", "ConversionError"),
                         ("bertforge.training.engine", "NonFiniteError"),
                         ("bertforge.training.engine", "DivergenceError")):
        if module in sys.modules:
            errors.append(getattr(sys.modules[module], name))
    return tuple(errors)


def error_line(err: BaseException) -> str:
    """The whole message of ``err`` on one line (a multi-line message has its lines joined)."""
    message = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
    return f"error: {message or type(err).__name__}"


def main(argv: list[str] | None = None) -> int:
    """Run one command; the exit status. The only error handler of every command."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "takes_overrides", False):  # only config-driven commands take --a.b flags
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    with console_logging(args.log_level):
        try:
            return args.func(args, extra)
        except user_errors() as err:
            print(error_line(err), file=sys.stderr)
            return 2
        except OSError as err:
            # A full disk or an unwritable directory met outside bertforge.fileio (which says more):
            # the user's problem, not a bug, so one line rather than a traceback.
            if err.errno not in DISK_ERRORS:
                raise
            print(error_line(err), file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130


if __name__ == "__main__":
    sys.exit(main())
