"""The cold start (issue 39.1): what compiling BERT costs before its first step, whole model against
regional compilation, in one go.

    python benchmarks/compile_start.py                       # BERT-large, 1 x 128, CPU (long)
    python benchmarks/compile_start.py --layers 4            # BERT-large's layers, 4 of them
    python benchmarks/compile_start.py --config base --device cuda --batch-size 256

Three fresh processes of ``bertforge bench pretrain`` (synthetic data, ``execution.compile true``,
one warm-up step and one timed step): ``execution.compile_scope model`` (the whole model as one
graph, the path before) and ``layers`` (every encoder layer's forward compiled, one graph all layers
share), each into an empty compile cache, then ``layers`` again into the cache the second one
filled (a second run of the same config). For each: ``first_step_s`` (process start to the end of
the first optimizer step) and ``compiled`` (Dynamo's graphs and recompiles, the graphs Inductor
found in the cache and compiled, Dynamo's tracing seconds and AOT autograd's and Inductor's, the
backward's included). The model's compiled loss is in both counts; on the CPU the optimizer step
runs eager (``dist.compiles_optimizer``: it compiles on CUDA only).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def bench(args: argparse.Namespace, scope: str, cache: Path) -> dict:
    command = [sys.executable, "-m", "bertforge", "bench", "pretrain", "--config", args.config,
               "--execution.device", args.device, "--execution.precision", args.precision,
               "--execution.compile", "true", "--execution.compile_scope", scope,
               "--execution.compile_cache", str(cache), "--batch-size", str(args.batch_size),
               "--seq-len", str(args.seq_len), "--steps", "1", "--warmup", "1", "--json",
               *(["--model.num_hidden_layers", str(args.layers)] if args.layers else [])]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    return {"first_step_s": result["first_step_s"], **result["compiled"], "step_ms": result["step_ms"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="large")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--layers", type=int, default=0, help="encoder layers (0: the config's)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        result = {"config": args.config, "layers": args.layers or None, "device": args.device,
                  "precision": args.precision, "batch_size": args.batch_size, "seq_len": args.seq_len,
                  "model_cold": bench(args, "model", root / "model"),
                  "layers_cold": bench(args, "layers", root / "layers")}
        result["layers_warm"] = bench(args, "layers", root / "layers")
    cold, after = result["model_cold"], result["layers_cold"]
    result["first_step_saved_s"] = round(cold["first_step_s"] - after["first_step_s"], 1)
    result["compile_s_ratio"] = round(cold["compile_s"] / after["compile_s"], 2) if after["compile_s"] else None
    print(json.dumps(result))


if __name__ == "__main__":
    main()
