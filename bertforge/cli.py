"""The ``bertforge`` command: one subcommand per job.

    bertforge pretrain [--config NAME] [--steps N] [--resume RUN] [--section.key VALUE ...]
    bertforge bench pretrain --config tiny --batch-size 16 --seq-len 128 --steps 20 --json
    bertforge bench squad --model base --batch-size 8 --seq-len 384 --json   # train + infer
    bertforge bench --spec benchmarks.yml [--benchmark NAME ...] [--json] [--list] [--quick]
    bertforge export CHECKPOINT OUT_DIR [--overwrite] [--format hf|tf1|tf2] [--vocab FILE]   # to HF, TF1 or TF2
    bertforge import tf1|tf2 PREFIX OUT_DIR [--bert-config FILE]   # a TF1 or TF2 checkpoint to our model directory
    bertforge import hf DIR_OR_ID OUT_DIR      # a Hugging Face BERT or ModernBERT to our model directory
    bertforge eval CKPT... --data.eval_input FILE [--batch-size N] [--json]   # masked-LM / NSP accuracy
    bertforge config [--config NAME] [--section.key VALUE ...]   # print the resolved config
    bertforge report RUN... --out DIR [--overwrite]   # figures and one HTML page (see observe/report.py)
    bertforge data …                           # Wikipedia / text → records (see data/cli.py)
    bertforge squad train|predict|evaluate|ask # SQuAD v1.1 and v2.0 (see squad/cli.py)
    bertforge finetune glue|ner|predict|download-glue  # GLUE and NER (see finetune/cli.py)
    bertforge retrieval from-squad|eval|train  # retrieval data, evaluation, training (see retrieval/cli.py)

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
import os
import sys
import typing
from pathlib import Path

from bertforge.bench.cli import add_bench_command
from bertforge.data.cli import add_data_commands
from bertforge.formats.cli import add_import_command
from bertforge.observe.cli import add_report_command
from bertforge.observe.log import LOG_LEVELS, console_logging
from bertforge.parallel.plan import add_plan_command
from bertforge.tasks.finetune import cli as finetune_cli
from bertforge.tasks.finetune.cli import add_finetune_commands
from bertforge.tasks.retrieval.cli import add_retrieval_commands
from bertforge.tasks.squad import cli as squad_cli
from bertforge.tasks.squad.cli import add_squad_commands
from bertforge.training.cli import add_eval_command, add_pretrain_command

from .config import OVERRIDES_HELP, ConfigError, Head
from .runs import add_config_command
from .version import __version__

LOG_LEVEL_ENV = "BERTFORGE_LOG_LEVEL"
DISK_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)


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
    vocab = args.vocab or vocab_in(checkpoint)
    if args.vocab is not None:  # another model's vocab would export a tokenizer whose ids miss the embeddings
        from bertforge.data.vocab import check_model_vocab
        from bertforge.formats.load import vocab_beside

        check_model_vocab(args.vocab, typing.cast(typing.Any, model.config).vocab_size, vocab_beside(checkpoint),
                          checkpoint, "--vocab")  # fine-tuning's rule (load_checked)
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
        export_hf(model, args.out, vocab_path=vocab, overwrite=args.overwrite, labels=labels,
                  without_tokenizer=args.without_tokenizer)
    print(f"exported {checkpoint} to {args.out}")
    return 0


def add_export_command(sub: typing.Any) -> None:
    p = sub.add_parser("export", help="export a checkpoint to a Hugging Face BERT directory or a TF1 or TF2 checkpoint")
    p.add_argument("checkpoint", help="run, step or model directory, a Hugging Face directory, or a Hugging Face "
                                      "model id in the local Hugging Face cache")
    p.add_argument("out", type=Path, help="output directory: new or empty, unless --overwrite")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT_DIR if it exists and is not empty (never a live run's)")
    p.add_argument("--head", choices=typing.get_args(Head), default=None,
                   help="default: the run's (classification or token_classification for finetune runs, qa for "
                        "squad runs, a Hugging Face model's from its config.json's architectures, else pretraining)")
    p.add_argument("--vocab", type=Path, default=None,
                   help="the vocab.txt or tokenizer.json the model was trained with (default: the one in the "
                        "checkpoint's directory; an hf export without one is refused)")
    p.add_argument("--without-tokenizer", action="store_true",
                   help="hf: write the weights alone (config.json, model.safetensors), no tokenizer files")
    p.add_argument("--format", choices=("hf", "tf1", "tf2"), default="hf",
                   help="hf: config.json + model.safetensors and the tokenizer's files; tf1: "
                        "model.ckpt.index/.data-00000-of-00001, "
                        "checkpoint and bert_config.json, as google-research/bert reads them; tf2: the same files "
                        "as an object-based checkpoint that TensorFlow Model Garden's BertEncoder / "
                        "BertPretrainerV2 restores (MLPerf's tf2_ckpt) (default: hf)")
    p.add_argument("--tf2-layout", choices=("pretrainer", "encoder"), default=None,
                   help="with --format tf2: pretrainer (the encoder and the masked-LM head under encoder/ and "
                        "masked_lm/) or encoder (BertEncoder alone, the converter's default) (default: pretrainer "
                        "when the model has a masked-LM head)")
    p.set_defaults(func=cmd_export)


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
    # Each job builds its own parser beside its code; the order is the order of `bertforge --help`.
    add_pretrain_command(sub)
    add_bench_command(sub, parser)
    add_export_command(sub)
    add_import_command(sub)
    add_data_commands(sub)
    add_squad_commands(sub)
    add_finetune_commands(sub)
    add_retrieval_commands(sub)
    add_report_command(sub)
    add_eval_command(sub)
    add_config_command(sub, {"squad": squad_cli.resolved_config, "finetune": finetune_cli.resolved_config})
    add_plan_command(sub)
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
