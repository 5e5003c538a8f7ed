"""What ``bertforge pretrain --compile-only`` saves: the first step of a run, cold and warm, in one go.

    python benchmarks/compile_only.py                                  # BERT-tiny, batch 32 × 128, CPU
    python benchmarks/compile_only.py --config base --device cuda --batch-size 32

Three runs of the same config (synthetic data, ``execution.compile true``),
each a fresh process: a run with an empty compile cache (cold), then
``--compile-only`` into a second empty cache, then the run again with that
cache (warm). The figure for a run is ``elapsed_s`` at its first step (its
monitor's clock: model built, first batch read, the step done), from
``metrics.jsonl``; for ``--compile-only``, the command's wall time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def pretrain(args: argparse.Namespace, cache: Path, runs: Path, *extra: str) -> float:
    command = [sys.executable, "-m", "bertforge", "pretrain", "--config", args.config, "--data.synthetic", "true",
               "--data.seq_len", str(args.seq_len), "--train.micro_batch_size", str(args.batch_size),
               "--train.global_batch_size", str(args.batch_size), "--train.steps", "2",
               "--execution.device", args.device, "--execution.compile", "true",
               "--execution.compile_cache", str(cache), "--log.run_dir", str(runs), "--no-progress",
               "--log.tensorboard", "false", *extra]
    started = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def first_step_s(runs: Path) -> float:
    (run,) = [p for p in runs.iterdir() if not p.name.startswith(".")]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return next(r["elapsed_s"] for r in rows if r.get("step") == 1 and "loss" in r)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        pretrain(args, root / "cold-cache", root / "cold")
        compile_only_s = pretrain(args, root / "cache", root / "warm", "--compile-only")
        pretrain(args, root / "cache", root / "warm")
        result = {"config": args.config, "device": args.device, "batch_size": args.batch_size,
                  "seq_len": args.seq_len, "cold_first_step_s": first_step_s(root / "cold"),
                  "compile_only_s": round(compile_only_s, 1), "warm_first_step_s": first_step_s(root / "warm")}
    result["saved_s"] = round(result["cold_first_step_s"] - result["warm_first_step_s"], 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
