"""``bertforge bench``: pretrain, squad, and ``--spec``'s named benchmarks; parsers and handlers.

No torch at import (``import bertforge.cli`` stays light): the handlers import the
benchmarks when they run.
"""

from __future__ import annotations

import argparse
import functools
import json
import typing
from typing import Any

from bertforge.config import CONFIG_HELP, MODEL_PRESETS, OVERRIDES_HELP, ConfigError, Precision, parse_overrides
from bertforge.runs import config_from_args


def print_result(result: dict, as_json: bool) -> None:
    """A benchmark's result: one JSON object, or one aligned line per key."""
    if as_json:
        print(json.dumps(result))
        return
    width = max(map(len, result))
    for key, value in result.items():
        print(f"{key:>{width}}: {value}")


def cmd_bench(args: argparse.Namespace, extra: list[str]) -> int:
    from .pretrain import bench_pretrain

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


def cmd_bench_spec(args: argparse.Namespace, extra: list[str], root: argparse.ArgumentParser) -> int:
    """``root`` is the ``bertforge`` command's parser, which checks the options of the spec's commands."""
    from .spec import run_command

    if not args.spec:
        raise ConfigError("bench: name a benchmark (pretrain, squad) or a spec: --spec benchmarks.yml")
    return run_command(args, root)


def cmd_bench_squad(args: argparse.Namespace, extra: list[str]) -> int:
    from bertforge.tasks.squad.train import load_squad_config

    from .squad import bench_squad

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


def add_bench_command(sub: Any, root: argparse.ArgumentParser) -> None:
    """``bertforge bench`` and its subcommands: registered by cli.py, which gives its own parser
    (``root``) for ``--spec`` to check the spec's commands against."""
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
    bench.set_defaults(func=functools.partial(cmd_bench_spec, root=root))
    bench_sub = bench.add_subparsers(dest="bench")
    _add_bench_pretrain(bench_sub)
    _add_bench_squad(bench_sub)


def _add_bench_pretrain(bench_sub: Any) -> None:
    p = bench_sub.add_parser("pretrain", help="pre-training step throughput, MFU and peak memory",
                             epilog=OVERRIDES_HELP)
    p.add_argument("--config", help=CONFIG_HELP + " (default: tiny)")
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


def _add_bench_squad(bench_sub: Any) -> None:
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
