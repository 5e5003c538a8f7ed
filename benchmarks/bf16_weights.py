"""bf16 weights: stochastic rounding against round-to-nearest and fp32 weights, on real Wikipedia.

    python benchmarks/bf16_weights.py                       # 3 modes × 2 seeds, a few minutes on a CPU
    python benchmarks/bf16_weights.py --seeds 1 2 3 --steps 300 --every 25

The shared Wikipedia dump (../shared/data/wiki/…bz2, 97 articles) becomes sentences, a 4096-token
WordPiece vocab and records once (cached in the temp directory), as docs/data.md describes. BERT-tiny
then pre-trains on them with LAMB at a small constant learning rate (``--lr``, 1e-3: most of LAMB's
per-element updates, lr · ||w|| / ||u|| · u, are under half a bf16 ulp of their weight), three ways:

* ``fp32``: fp32 weights and moments (autocast bf16, as the others);
* ``bf16-sr``: bf16 weights and gradients, fp32 moments, each update rounded stochastically;
* ``bf16-rtn``: the same, rounded to nearest: updates under half an ulp are lost.

It prints the training loss (the mean of each ``--every`` steps) of every run, the held-out loss at
the end, the spread between seeds, and the bytes of parameters + optimizer state measured on the
model and optimizer (sum of nbytes) next to what ``bertforge plan`` counts for BERT-base.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DUMP = ROOT.parent / "shared/data/wiki/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
MODES = {
    "fp32": {},
    "bf16-sr": {"train.weights": "bf16", "train.stochastic_rounding": True},
    "bf16-rtn": {"train.weights": "bf16", "train.stochastic_rounding": False},
}


def records(cache: Path) -> tuple[Path, Path, Path]:
    """Train records, eval records and the vocab made from the dump, once."""
    from bertforge.cli import main
    from bertforge.data import preprocess as prep
    from bertforge.data import wikipedia as wiki

    train, held_out, vocab = cache / "records/train", cache / "records/eval", cache / "vocab.txt"
    if (cache / "done").exists():
        return train, held_out, vocab
    shutil.rmtree(cache, ignore_errors=True)  # what an interrupted run left
    cache.mkdir(parents=True)
    articles = cache / "articles.jsonl"
    wiki.extract(DUMP, articles)
    text = cache / "text"
    prep.preprocess(articles, text, shards=1, eval_articles=10, seed=12345)  # text/train/*.txt, text/eval/eval.txt
    train_text, eval_text = sorted((text / "train").glob("*.txt")), [text / "eval/eval.txt"]
    prep.train_vocab(train_text, vocab, vocab_size=4096)
    quiet = contextlib.redirect_stdout(io.StringIO())
    for files, out in ((train_text, train), (eval_text, held_out)):
        out.mkdir(parents=True, exist_ok=True)
        with quiet:
            status = main(["data", "create", "--input", *map(str, files), "--vocab", str(vocab), "--output",
                           str(out / "part.tfrecord"), "--mode", "fast", "--seq-len", "64",
                           "--max-predictions", "10", "--dupe-factor", "2"])
        if status != 0:
            raise SystemExit(f"data create failed for {out}")
    (cache / "done").write_text("")
    return train, held_out, vocab


def run(mode: str, seed: int, args: argparse.Namespace, data: tuple[Path, Path, Path], out: Path) -> dict:
    from bertforge.config import load_config
    from bertforge.training.pretrain import pretrain

    train, held_out, vocab = data
    pairs = {"data.input": str(train), "data.eval_input": str(held_out / "part.tfrecord"), "data.vocab": str(vocab),
             "data.seq_len": 64, "data.max_predictions": 10,
             "train.optimizer": "lamb", "train.lr": args.lr, "train.schedule": "constant", "train.warmup_steps": 0,
             "train.micro_batch_size": args.batch, "train.global_batch_size": args.batch, "train.steps": args.steps,
             "train.seed": seed, "train.eval_at_start": False, "train.eval_batches": args.eval_batches,
             "execution.precision": "bf16",
             "execution.threads": args.threads, "checkpoint.every": 0, "log.every": 1, "log.progress": False,
             "log.tensorboard": False, "log.run_dir": str(out), "log.name": f"{mode}-{seed}", **MODES[mode]}
    started = time.perf_counter()
    summary = pretrain(load_config("tiny", list(pairs.items())))
    rows = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if r.get("split") != "eval" and "loss" in r and "step" in r]
    evals = [r for r in rows if r.get("split") == "eval"]
    curve = [statistics.fmean(losses[i:i + args.every]) for i in range(0, len(losses), args.every)]
    return {"mode": mode, "seed": seed, "curve": curve, "eval_loss": evals[-1]["loss"],
            "eval_mlm_accuracy": evals[-1]["mlm_accuracy"], "seconds": time.perf_counter() - started}


def state_bytes() -> list[str]:
    """Parameters + optimizer state: measured on BERT-tiny after a step, planned for BERT-base."""
    import torch

    from bertforge.config import load_config
    from bertforge.models.bert import BertForPreTraining
    from bertforge.parallel.plan import plan_memory
    from bertforge.training.optim import build_optimizer, cast_weights

    lines = []
    for weights, state in (("fp32", "fp32"), ("bf16", "fp32"), ("bf16", "bf16")):
        overrides = [("train.weights", weights), ("train.optimizer_state", state), ("execution.precision", "bf16"),
                     ("train.stochastic_rounding", weights == "bf16")]
        tiny, base = load_config("tiny", overrides), load_config("base", overrides)
        model = cast_weights(BertForPreTraining(tiny.model), tiny.train)
        optimizer = build_optimizer(model, tiny.train)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        optimizer.step()
        measured = sum(p.nbytes for p in model.parameters()) + sum(
            v.nbytes for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
        plan = plan_memory(base)
        lines.append(f"weights {weights}, moments {state}: tiny measured {measured / 2**20:.2f} MiB; base planned "
                     f"{(plan.parameters + plan.optimizer_state) / 2**20:.0f} MiB (+ gradients "
                     f"{plan.gradients / 2**20:.0f} MiB)")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=25, help="steps per point of the printed curves")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--eval-batches", type=int, default=16, help="held-out batches at the end")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--json", action="store_true", help="also print the results as one JSON object, last")
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "bertforge-bf16-weights")
    args = parser.parse_args()
    if not DUMP.exists():
        print(f"needs the shared Wikipedia dump at {DUMP}", file=sys.stderr)
        return 1
    import logging

    logging.disable(logging.INFO)
    data = records(args.cache)
    results = []
    with tempfile.TemporaryDirectory() as out:
        for seed in args.seeds:
            for mode in args.modes:
                results.append(run(mode, seed, args, data, Path(out)))
                r = results[-1]
                print(f"{mode:9} seed {seed}: train loss every {args.every} steps "
                      f"{' '.join(f'{x:.3f}' for x in r['curve'])}; eval loss {r['eval_loss']:.4f}, "
                      f"mlm acc {r['eval_mlm_accuracy']:.4f} ({r['seconds']:.0f} s)", flush=True)
    print()
    modes = {}
    for mode in args.modes:
        runs = [r for r in results if r["mode"] == mode]
        finals = [r["curve"][-1] for r in runs]
        evals = [r["eval_loss"] for r in runs]
        modes[mode] = {"train_loss_last": statistics.fmean(finals), "eval_loss": statistics.fmean(evals),
                       "eval_loss_seeds": evals, "runs": runs}
        print(f"{mode:9} first {statistics.fmean(r['curve'][0] for r in runs):.3f} → last "
              f"{statistics.fmean(finals):.3f} (seeds {min(finals):.3f}..{max(finals):.3f}); eval loss "
              f"{statistics.fmean(evals):.4f} (seeds {min(evals):.4f}..{max(evals):.4f})")
    print()
    print("\n".join(state_bytes()))
    if args.json:
        print(json.dumps({"modes": modes, "steps": args.steps, "lr": args.lr, "seeds": args.seeds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
