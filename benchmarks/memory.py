"""Peak memory of pre-training steps with and without recomputation, offload and the optimizer
step in the backward, beside the planner's prediction (bertforge/parallel/plan.py).

    python benchmarks/memory.py                          # base, seq 512, batch 4, 80 predictions
    python benchmarks/memory.py --preset mini --batch-size 4 --rows none layer
    python benchmarks/memory.py --rows none in_backward layer layer_in_backward  # the step in the backward
    python benchmarks/memory.py --json

Each row runs in a fresh subprocess (peak RSS is per process) on the CPU with
one thread by default: a few LAMB steps in fp32 on one synthetic batch. The
measurement is the growth of the process's peak resident set over what it held
before the model was built, as in bertforge/bench/pretrain.py, with glibc's mmap
threshold fixed at 128 KiB (MALLOC_MMAP_THRESHOLD_) so that freed tensors go
back to the operating system: by default glibc raises the threshold up to
32 MiB after the first free, and tensors below it then come from a heap whose
freed, fragmented blocks stay resident, which measures glibc rather than the
training step (``--default-malloc`` adds that measurement as a column; it is
larger by up to ~60% with recomputation). The planner's number is
its device total for the CPU, which includes its calibrated CPU runtime
overhead. The offload row runs FSDP2 with CPU offload on a one-rank process
group through bertforge.parallel.dist (as pretrain does); on a CPU machine the device
and the host are the same memory, so it is compared with the planner's joint
peak of device and host memory (``combined_peak``). The ``in_backward`` rows step each
tensor in the backward (``train.optimizer_in_backward``, which needs ``train.grad_clip 0``;
the other rows clip, which makes no tensor larger than a gradient's norm), without and with
layer recomputation.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROWS = ("none", "layer", "attention", "offload", "in_backward", "layer_in_backward")


def make_config(args: argparse.Namespace, row: str):
    from bertforge.config import load_config

    overrides = [("data.seq_len", args.seq_len), ("data.max_predictions", args.predictions),
                 ("train.micro_batch_size", args.batch_size), ("train.global_batch_size", args.batch_size),
                 ("train.optimizer", "lamb"), ("train.schedule", "constant"),
                 ("execution.device", "cpu"), ("execution.precision", "fp32"),
                 ("execution.recompute", "layer" if row == "layer_in_backward" else
                  "none" if row in ("offload", "in_backward") else row)]
    if row.endswith("in_backward"):
        overrides += [("train.optimizer_in_backward", True), ("train.grad_clip", 0.0)]
    if row == "offload":
        overrides += [("execution.parallel", "fsdp"), ("execution.offload", True)]
    return load_config(args.preset, overrides)


def worker(args: argparse.Namespace) -> dict:
    from bertforge.bench.pretrain import bench_pretrain

    cfg = make_config(args, args.worker)
    cfg.execution.threads = args.threads
    # The first step also allocates the optimizer state: it runs untimed, the later ones are timed.
    timed = max(args.steps - 1, 1)
    result = bench_pretrain(cfg, args.batch_size, args.seq_len, timed, warmup=args.steps - timed)
    return {"row": args.worker, "peak_mb": result["peak_mem_mb"],
            "step_s": round(result["step_ms"] / 1000, 2), "loss": result["final_loss"]}


FIXED_MMAP_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}


def run_row(args: argparse.Namespace, row: str, env: dict[str, str] | None = None) -> dict:
    command = [sys.executable, __file__, "--worker", row, "--preset", args.preset,
               "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size),
               "--predictions", str(args.predictions), "--steps", str(args.steps),
               "--threads", str(args.threads)]
    done = subprocess.run(command, capture_output=True, text=True, check=False, env={**os.environ, **(env or {})})
    if done.returncode != 0:
        raise RuntimeError(f"{row} worker failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="base", help="model preset (default base)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=4,
                        help="micro-batch (default 4: large enough that the activations, not the "
                             "optimizer step, set the peak without recomputation)")
    parser.add_argument("--predictions", type=int, default=80, help="masked positions per sequence")
    parser.add_argument("--steps", type=int, default=2,
                        help="optimizer steps per row (default 2: the second is the first with "
                             "optimizer state, and is timed)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    parser.add_argument("--json", action="store_true", help="one JSON object per row")
    parser.add_argument("--default-malloc", action="store_true",
                        help="also measure each row with glibc's default (dynamic) mmap threshold")
    parser.add_argument("--worker", choices=ROWS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return

    from bertforge.parallel.plan import plan_memory

    MiB = 2**20
    print(f"{args.preset}, seq {args.seq_len}, micro-batch {args.batch_size}, {args.predictions} "
          f"predictions, LAMB, fp32, CPU, {args.threads} thread(s), {args.steps} steps per row")
    extra = f"{'default malloc MB':>19}" if args.default_malloc else ""
    print(f"{'row':<18}{'measured MB':>12}{'planned MB':>12}{'ratio':>8}{'step s':>9}"
          f"{'plan: fwd/bwd':>15}{'optimizer':>11}{extra}  compared")
    results = []
    for row in args.rows:
        plan = plan_memory(make_config(args, row), world_size=1, device="cpu")
        # On the CPU the device and the host are one memory: their joint peak.
        planned = plan.combined_peak
        measured = run_row(args, row, FIXED_MMAP_THRESHOLD)
        ratio = planned / MiB / measured["peak_mb"]
        phases = {name: round(value / MiB, 1) for name, value in plan.phases.items()}
        result = {**measured, "planned_mb": round(planned / MiB, 1), "ratio": round(ratio, 3),
                  "planned_phases_mb": phases,
                  "within_20pct": abs(ratio - 1) <= 0.2}
        if args.default_malloc:
            result["default_malloc_peak_mb"] = run_row(args, row)["peak_mb"]
        results.append(result)
        compared = "device + host, joint peak" if row == "offload" else "device total"
        if args.json:
            print(json.dumps(result))
        else:
            print(f"{row:<18}{measured['peak_mb']:>12.1f}{planned / MiB:>12.1f}{ratio:>8.3f}"
                  f"{measured['step_s']:>9.2f}{phases['forward_backward']:>15.1f}{phases['optimizer_step']:>11.1f}"
                  + (f"{result['default_malloc_peak_mb']:>19.1f}" if args.default_malloc else "")
                  + f"  {compared}", flush=True)
    if results and not args.json:
        worst = max(abs(r["ratio"] - 1) for r in results)
        print(f"largest deviation of planned from measured: {100 * worst:.1f}% (target: within 20%)")
        print("plan columns: the planner's peaks of the forward/backward and of the optimizer step "
              "(without the runtime overhead; for offload, the device's forward/backward); planned is the "
              "larger plus the overhead, for offload the joint peak of device and host")


if __name__ == "__main__":
    main()
