"""The peer of ``bertforge bench pretrain``: transformers' BertForPreTraining trained as its users train it.

    python benchmarks/transformers_peer.py --preset large --seq-len 128 --batch-size 256 --compile --json

The recipe a transformers user runs on a GPU: ``BertForPreTraining`` with
``attn_implementation="sdpa"``, bf16 autocast (``--precision``), torch's fused
AdamW, gradient clipping at 1.0, and with ``--compile`` the model compiled
(static shapes). The batch is ``bench pretrain``'s synthetic one (the same
rows, 20 predictions of 128 by default, every token real); transformers
projects every position onto the vocab and its loss ignores the unmasked ones,
so its model FLOPs (for MFU) count the vocab projection at every position.
Reported as ``bench pretrain`` reports: sequences per second over the timed
steps, milliseconds per step, MFU against the device's bf16 peak, peak
memory (the CUDA allocator's, or the process's resident set on the CPU), the
cold start (``first_step_s``: from the process's start to the end of the
first step) and with ``--compile`` what compiling took (``compiled``: graphs,
recompiles, Dynamo's and AOT/Inductor's seconds).
``benchmarks/gpu.sh`` runs it beside ``bench pretrain`` in one session.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="large", help="a model preset (tiny … large)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--predictions", type=int, default=20)
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed steps first (compiling, on the first; at least 1: first_step_s)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if args.warmup < 1:
        parser.error(f"--warmup must be at least 1 (first_step_s is the first step's), got {args.warmup}")
    print(json.dumps(run(args)) if args.json else run(args))


def run(args: argparse.Namespace) -> dict:
    import transformers

    from bertforge.bench.pretrain import PeakMemory
    from bertforge.config import MODEL_PRESETS, ModelConfig
    from bertforge.data import SyntheticDataset
    from bertforge.host import device_name, process_age_s
    from bertforge.models.flops import peak_tflops, pretraining_flops
    from bertforge.parallel.dist import compile_counts

    device = torch.device(args.device)
    cfg = ModelConfig(**MODEL_PRESETS[args.preset])
    batch = SyntheticDataset(size=args.batch_size, vocab_size=cfg.vocab_size, seq_len=args.seq_len,
                             max_predictions=args.predictions, seed=12345).batch(list(range(args.batch_size)))
    labels = torch.full(batch["input_ids"].shape, -100, dtype=torch.long)
    labels.scatter_(1, batch["masked_lm_positions"].long(), batch["masked_lm_ids"].long())
    inputs = {"input_ids": batch["input_ids"].long(), "token_type_ids": batch["token_type_ids"].long(),
              "labels": labels, "next_sentence_label": batch["next_sentence_labels"].long()}
    inputs = {k: v.to(device) for k, v in inputs.items()}

    memory = PeakMemory(device)
    torch.manual_seed(0)
    hf_config = transformers.BertConfig(**vars(cfg), attn_implementation="sdpa")
    model = transformers.BertForPreTraining(hf_config).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    forward = torch.compile(model, dynamic=False) if args.compile else model
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32

    def step() -> torch.Tensor:
        with torch.autocast(device.type, dtype=dtype, enabled=args.precision != "fp32"):
            loss = forward(**inputs).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    compile_started = time.perf_counter()
    step()
    synchronize()
    first_step_s = process_age_s()  # the cold start, as bench pretrain's: process start to the first step's end
    for _ in range(args.warmup - 1):
        step()
    synchronize()
    warmup_s = time.perf_counter() - compile_started
    started = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    final_loss = loss.item()  # (waits for the device)
    elapsed = time.perf_counter() - started
    name = device_name(device)
    peak = peak_tflops(name, args.precision) if device.type == "cuda" else None
    # Every position reaches the vocab projection in transformers: P = T in the FLOP formula.
    flops = pretraining_flops(cfg, args.seq_len, args.seq_len) * args.batch_size * args.steps
    return {
        "model": "transformers", "transformers": transformers.__version__, "preset": args.preset,
        "device": str(device), "device_name": name, "precision": args.precision, "compile": args.compile,
        "batch_size": args.batch_size, "seq_len": args.seq_len, "steps": args.steps,
        "seq_per_s": args.batch_size * args.steps / elapsed, "rows_per_s": args.batch_size * args.steps / elapsed,
        "step_ms": 1000 * elapsed / args.steps,
        "mfu": flops / elapsed / 1e12 / peak if peak else None, "warmup_s": round(warmup_s, 1),
        "peak_mem_mb": round(memory.peak_mb(), 1), "loss": final_loss,
        "first_step_s": round(first_step_s, 2), "compiled": compile_counts() if args.compile else None,
    }


if __name__ == "__main__":
    main()
