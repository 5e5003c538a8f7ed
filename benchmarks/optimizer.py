"""One optimizer step on BERT's parameter shapes, ours against AdamW: time and memory traffic per step.

Ours: each LAMB variant and StableAdamW, eager and compiled; AdamW: ``torch.optim.AdamW(foreach=True)``.

    python benchmarks/optimizer.py                      # CPU, 1 thread, 3 rounds of 5 timed steps
    taskset -c 1 python benchmarks/optimizer.py --rounds 5 --json
    python benchmarks/optimizer.py --compiled --layers 2 # also the compiled steps (compiling takes minutes)
    python benchmarks/optimizer.py --traffic            # bytes per parameter and ops/kernels per step

Timing: the parameters are those of ``BertForPreTraining`` at the base shape (110M; ``--layers``
sets the encoder layers), in the decay / no-decay groups that ``build_optimizer`` makes, with
fixed random gradients. Each round builds every optimizer afresh, runs one untimed step (it
allocates the state; for ``_compiled`` rows it compiles, once per process), then times
``--steps`` steps; rounds interleave the optimizers so that a busy machine slows them alike.
The table gives the median step time over all rounds and its ratio to AdamW's median.

Traffic (``--traffic``), for each LAMB variant and StableAdamW on BERT-large's shapes:

* eager: every aten op of one step is counted (a TorchDispatchMode) with the bytes of each
  tensor argument read, of each argument it writes in place and of each new output written
  (views move nothing), on the meta device: the whole 336M-parameter model, nothing allocated;
* compiled: Inductor's own count (``torch._inductor.metrics.num_bytes_accessed``, the buffers
  each generated kernel reads and writes) and the kernels it generated, for one step compiled
  from scratch on ``--device`` with BERT-large's widths and ``--traffic-layers`` layers (bytes
  per parameter do not depend on the count; the kernels grow with the tensors).

On CUDA the traffic rows also give the GPU kernels one step launches and their summed time
(torch.profiler, the mean over ``--steps`` steps), eager and compiled.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bertforge.config import ModelConfig, TrainConfig  # noqa: E402
from bertforge.models.bert import BertForPreTraining  # noqa: E402
from bertforge.training.optim import LAMB_VARIANTS, build_optimizer, param_groups  # noqa: E402

MakeOptimizer = Callable[[torch.nn.Module], torch.optim.Optimizer]
LARGE = dict(hidden_size=1024, num_attention_heads=16, intermediate_size=4096)  # BERT-large's widths


# Ours by row name: the TrainConfig changes that build each.
OURS = {**{f"lamb_{variant}": {"lamb": variant} for variant in LAMB_VARIANTS},
        "stableadamw": {"optimizer": "stableadamw"}}


def ours(name: str, compiled: bool) -> MakeOptimizer:
    train = TrainConfig(lr=1e-3, weight_decay=0.01, **OURS[name])
    return lambda model: build_optimizer(model, train, compiled=compiled)


def optimizers(device: torch.device, compiled: bool) -> dict[str, MakeOptimizer]:
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
    for name in OURS:
        rows[name] = ours(name, False)
        if compiled:
            rows[f"{name}_compiled"] = ours(name, True)
    return rows


def bert(layers: int, device: torch.device | str, **widths: int) -> torch.nn.Module:
    """BertForPreTraining with fixed random gradients (BERT-base unless ``widths`` say otherwise)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = BertForPreTraining(ModelConfig(num_hidden_layers=layers, **widths))
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
    return model


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(optimizer: torch.optim.Optimizer, steps: int, device: torch.device) -> list[float]:
    """Seconds of each of ``steps`` optimizer steps after one untimed step."""
    optimizer.step()
    times = []
    for _ in range(steps):
        synchronize(device)
        start = time.perf_counter()
        optimizer.step()
        synchronize(device)
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


# ------------------------------------------------------------ traffic

class Traffic(TorchDispatchMode):
    """Counts the aten ops dispatched and the bytes they read and write (see the module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace != "aten":  # the profiler's markers
            return out
        self.ops += 1
        if not func.is_view:
            for i, argument in enumerate(func._schema.arguments):
                value = args[i] if i < len(args) else kwargs.get(argument.name)
                written = argument.alias_info is not None and argument.alias_info.is_write
                self.bytes += (1 + written) * tensor_bytes(value)
            for ret, value in zip(func._schema.returns, out if isinstance(out, tuple) else (out,)):
                if ret.alias_info is None:  # a new tensor (an in-place op returns its argument)
                    self.bytes += tensor_bytes(value)
        return out


def tensor_bytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(value) if isinstance(t, torch.Tensor))


def eager_traffic(make: MakeOptimizer, model: torch.nn.Module) -> dict[str, float]:
    """Bytes per parameter and aten ops of one eager step (the state exists: a step ran before)."""
    optimizer = make(model)
    optimizer.step()
    with Traffic() as traffic:
        optimizer.step()
    params = sum(p.numel() for p in model.parameters())
    return {"bytes_per_param": round(traffic.bytes / params, 2), "ops": traffic.ops}


def compiled_traffic(make: MakeOptimizer, model: torch.nn.Module) -> dict[str, float]:
    """Inductor's bytes per parameter and kernel count of one compiled step, compiled afresh."""
    import torch._inductor.config as inductor_config
    import torch._inductor.metrics as metrics

    # Inductor counts bytes only while its metrics log is on; a handler-less logger keeps it quiet.
    log = logging.getLogger("torch._inductor.compile_fx.__inductor_metrics")
    log.setLevel(logging.INFO)
    log.propagate = False
    torch._dynamo.reset()  # a graph compiled before (another variant) would not be counted
    metrics.reset()
    with inductor_config.patch(force_disable_caches=True), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="dynamo_pgo force disabled")
        make(model).step()  # the first step compiles, and makes the state
    params = sum(p.numel() for p in model.parameters())
    return {"bytes_per_param": round(metrics.num_bytes_accessed / params, 2),
            "kernels": metrics.generated_kernel_count}


def gpu_kernels(make: MakeOptimizer, model: torch.nn.Module, steps: int) -> dict[str, float]:
    """The CUDA kernels one step launches and their summed time (means over ``steps``)."""
    from torch.profiler import ProfilerActivity, profile

    optimizer = make(model)
    optimizer.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            optimizer.step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return {"gpu_kernels": round(len(kernels) / steps, 1),
            "gpu_ms": round(sum(e.time_range.elapsed_us() for e in kernels) / steps / 1000, 3)}


def traffic_rows(device: torch.device, layers: int, steps: int) -> dict[str, Any]:
    large = bert(24, "meta", **LARGE)
    small = bert(layers, device, **LARGE)
    rows = []
    for name in OURS:
        eager, compiled = ours(name, False), ours(name, True)
        rows.append({"optimizer": name, **eager_traffic(eager, large)})
        rows.append({"optimizer": f"{name}_compiled", **compiled_traffic(compiled, small)})
        if device.type == "cuda":
            rows[-2].update(gpu_kernels(eager, small, steps))
            rows[-1].update(gpu_kernels(compiled, small, steps))
    return {"eager_model": {"layers": 24, "parameters": sum(p.numel() for p in large.parameters()),
                            "tensors": sum(1 for _ in large.parameters())},
            "compiled_model": {"layers": layers, "parameters": sum(p.numel() for p in small.parameters()),
                               "tensors": sum(1 for _ in small.parameters())},
            "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per optimizer and round")
    parser.add_argument("--layers", type=int, default=12, help="encoder layers of the timed BERT-base (12)")
    parser.add_argument("--compiled", action="store_true", help="also time our optimizers' compiled steps")
    parser.add_argument("--traffic", action="store_true",
                        help="bytes per parameter and ops or kernels per step instead of times")
    parser.add_argument("--traffic-layers", type=int, default=0,
                        help="encoder layers of the compiled BERT-large (default: 24 on CUDA, 1 elsewhere)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.traffic:
        layers = args.traffic_layers or (24 if device.type == "cuda" else 1)
        result = {"device": str(device), "threads": args.threads, "torch": torch.__version__,
                  **traffic_rows(device, layers, args.steps)}
        if args.json:
            print(json.dumps(result, indent=2))
            return
        eager, compiled = result["eager_model"], result["compiled_model"]
        print(f"eager: BERT-large on meta, {eager['parameters'] / 1e6:.1f}M parameters in {eager['tensors']} "
              f"tensors; compiled: {compiled['layers']} layer(s), {compiled['parameters'] / 1e6:.1f}M in "
              f"{compiled['tensors']} tensors, {device}, torch {torch.__version__}")
        print(f"{'optimizer':<24} {'bytes/param':>11} {'ops':>5} {'kernels':>8} {'GPU kernels':>12} {'GPU ms':>8}")
        for row in result["rows"]:
            print(f"{row['optimizer']:<24} {row['bytes_per_param']:>11.2f} {row.get('ops', ''):>5} "
                  f"{row.get('kernels', ''):>8} {row.get('gpu_kernels', ''):>12} {row.get('gpu_ms', ''):>8}")
        return

    model = bert(args.layers, device)
    rows = optimizers(device, args.compiled)
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
    print(f"{'optimizer':<24} {'median ms':>10} {'min ms':>10} {'x AdamW':>8}")
    for row in result["rows"]:
        print(f"{row['optimizer']:<24} {row['median_ms']:>10.1f} {row['min_ms']:>10.1f} "
              f"{row['vs_adamw_foreach']:>8.2f}")


if __name__ == "__main__":
    main()
