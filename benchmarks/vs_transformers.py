"""Pre-training step: bertforge against transformers.BertForPreTraining, in one run.

    python benchmarks/vs_transformers.py                       # tiny and base, batch 16, seq 128
    python benchmarks/vs_transformers.py --presets base --batch-size 32 --steps 10

Both sides get the same config, the same weights (copied from ours into
transformers'), the same synthetic batch (20 masked positions of 128, every
token real), the same optimizer (our LAMB) and the same thread count, and each
runs in a fresh subprocess so that peak memory is measured alike: the growth of
the peak resident set over what the process held before the model was built.
transformers computes the MLM logits at every position and its loss ignores
the unmasked ones; ours gathers the masked positions first.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch


def make_batch(vocab_size: int, batch_size: int, seq_len: int, predictions: int, seed: int = 0):
    from bertforge.data import SyntheticDataset

    data = SyntheticDataset(size=batch_size, vocab_size=vocab_size, seq_len=seq_len,
                            max_predictions=predictions, seed=seed)
    return data.batch(list(range(batch_size)))


def worker(args: argparse.Namespace) -> dict:
    from bertforge.bench.pretrain import PeakMemory
    from bertforge.config import load_config
    from bertforge.models.bert import BertForPreTraining, pretraining_loss
    from bertforge.training.optim import build_optimizer

    torch.set_num_threads(args.threads)
    cfg = load_config(args.preset)
    batch = make_batch(cfg.model.vocab_size, args.batch_size, args.seq_len, args.predictions)
    if args.side == "transformers":
        import transformers

        labels = torch.full_like(batch["input_ids"], -100)
        labels.scatter_(1, batch["masked_lm_positions"], batch["masked_lm_ids"])
        hf_config = transformers.BertConfig(**vars(cfg.model))
    memory = PeakMemory(torch.device("cpu"))
    torch.manual_seed(0)
    model = BertForPreTraining(cfg.model)
    if args.side == "transformers":
        ours = model
        model = transformers.BertForPreTraining(hf_config)
        model.load_state_dict(ours.state_dict(), strict=False)  # decoder weight and bias are tied
        model.tie_weights()
        del ours

        def step_loss():
            out = model(input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"],
                        attention_mask=batch["attention_mask"], labels=labels,
                        next_sentence_label=batch["next_sentence_labels"])
            return out.loss
    else:
        def step_loss():
            mlm, nsp = model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"],
                             batch["masked_lm_positions"])
            return pretraining_loss(mlm, nsp, batch)["loss"]
    model.eval()  # without dropout both sides must give the same loss: same weights, same batch
    with torch.no_grad():
        start_loss = step_loss().item()
    model.train()
    optimizer = build_optimizer(model, cfg.train)
    times = []
    for i in range(args.warmup + args.steps):
        start = time.perf_counter()
        loss = step_loss()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    times.sort()
    median = times[len(times) // 2]
    return {"side": args.side, "preset": args.preset, "start_loss": round(start_loss, 5),
            "step_ms": round(1000 * median, 2), "seq_per_s": round(args.batch_size / median, 2),
            "peak_mem_mb": round(memory.peak_mb(), 1)}


def run_side(side: str, preset: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--worker", side, "--preset", preset,
           "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
           "--predictions", str(args.predictions), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--threads", str(args.threads)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["tiny", "base"])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--predictions", type=int, default=20)
    parser.add_argument("--steps", type=int, default=20, help="timed steps (the median is reported)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--worker", choices=("bertforge", "transformers"), help=argparse.SUPPRESS)
    parser.add_argument("--preset", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.side = args.worker
        print(json.dumps(worker(args)))
        return

    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {args.threads} threads, "
          f"batch {args.batch_size}, seq {args.seq_len}, {args.predictions} predictions, "
          f"median of {args.steps} steps")
    header = f"{'preset':<8}{'side':<14}{'step ms':>10}{'seq/s':>10}{'peak MB':>10}{'start loss':>12}"
    print(header)
    print("-" * len(header))
    for preset in args.presets:
        ours, theirs = run_side("bertforge", preset, args), run_side("transformers", preset, args)
        for row in (ours, theirs):
            print(f"{preset:<8}{row['side']:<14}{row['step_ms']:>10}{row['seq_per_s']:>10}"
                  f"{row['peak_mem_mb']:>10}{row['start_loss']:>12}")
        print(f"{preset:<8}{'ratio':<14}{'':>10}{ours['seq_per_s'] / theirs['seq_per_s']:>9.2f}x"
              f"{ours['peak_mem_mb'] / max(theirs['peak_mem_mb'], 1e-9):>9.2f}x")


if __name__ == "__main__":
    main()
