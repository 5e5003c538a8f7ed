"""Time of one optimizer step on BERT-base parameter shapes: our LAMB (each variant)
against ``torch.optim.AdamW(foreach=True)``, in the same process.

    python benchmarks/optimizer.py                      # CPU, 1 thread, 3 rounds of 5 timed steps
    taskset -c 1 python benchmarks/optimizer.py --rounds 5 --json

The parameters are those of ``BertForPreTraining`` at the base shape (110M), in
the decay / no-decay groups that ``build_optimizer`` makes, with fixed random
gradients. Each round builds every optimizer afresh, runs one untimed step (it
allocates the state), then times ``--steps`` steps; rounds interleave the
optimizers so that a busy machine slows them alike. The table gives the median
step time over all rounds and its ratio to AdamW's median.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bertforge.config import ModelConfig, TrainConfig  # noqa: E402
from bertforge.model import BertForPreTraining  # noqa: E402
from bertforge.optim import LAMB_VARIANTS, build_optimizer, param_groups  # noqa: E402

MakeOptimizer = Callable[[torch.nn.Module], torch.optim.Optimizer]


def optimizers(device: torch.device) -> dict[str, MakeOptimizer]:
    """The optimizers to time, by row name; AdamW is the baseline the ratios refer to."""
    train = TrainConfig(lr=1e-3, weight_decay=0.01)

    def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(param_groups(model, train.weight_decay), lr=train.lr, eps=train.eps,
                                 weight_decay=train.weight_decay, foreach=True)

    rows: dict[str, MakeOptimizer] = {"adamw_foreach": adamw}
    if device.type == "cuda":
        def adamw_fused(model: torch.nn.Module) -> torch.optim.Optimizer:
            return torch.optim.AdamW(param_groups(model, train.weight_decay), lr=train.lr, eps=train.eps,
                                     weight_decay=train.weight_decay, fused=True)
        rows["adamw_fused"] = adamw_fused
    for variant in LAMB_VARIANTS:
        rows[f"lamb_{variant}"] = (lambda v: lambda model: build_optimizer(
            model, TrainConfig(lr=train.lr, weight_decay=train.weight_decay, lamb=v)))(variant)
    return rows


def time_steps(optimizer: torch.optim.Optimizer, steps: int, device: torch.device) -> list[float]:
    """Seconds of each of ``steps`` optimizer steps after one untimed step."""
    optimizer.step()
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def run(rows: dict[str, MakeOptimizer], model: torch.nn.Module, rounds: int, steps: int,
        device: torch.device) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(rounds):
        for name, make in rows.items():
            optimizer = make(model)
            times[name] += time_steps(optimizer, steps, device)
            del optimizer
            gc.collect()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per optimizer and round")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    model = BertForPreTraining(ModelConfig()).to(device)  # BERT-base: 110M parameters
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    rows = optimizers(device)
    times = run(rows, model, args.rounds, args.steps, device)

    medians = {name: statistics.median(ts) for name, ts in times.items()}
    base = medians["adamw_foreach"]
    result = {
        "device": str(device), "threads": args.threads, "torch": torch.__version__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "tensors": sum(1 for _ in model.parameters()), "rounds": args.rounds, "steps": args.steps,
        "rows": [{"optimizer": name, "median_ms": round(1000 * m, 2),
                  "min_ms": round(1000 * min(times[name]), 2), "vs_adamw_foreach": round(m / base, 3)}
                 for name, m in medians.items()],
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{result['parameters'] / 1e6:.1f}M parameters in {result['tensors']} tensors, {device}, "
          f"{args.threads} thread(s), torch {torch.__version__}; median of {args.rounds} x {args.steps} steps")
    print(f"{'optimizer':<16} {'median ms':>10} {'min ms':>10} {'x AdamW':>8}")
    for row in result["rows"]:
        print(f"{row['optimizer']:<16} {row['median_ms']:>10.1f} {row['min_ms']:>10.1f} "
              f"{row['vs_adamw_foreach']:>8.2f}")


if __name__ == "__main__":
    main()
