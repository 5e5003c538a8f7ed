"""Sequence packing: padding saved, and training throughput packed vs unpacked, in one run.

    python benchmarks/packing.py                      # the shared Wikipedia sample, BERT-tiny, CPU
    python benchmarks/packing.py --model mini --steps 30 --json

1. The text of the shared Wikipedia dump (benchmarks/data_prep.py's crude
   extraction) becomes records as ``bertforge data create --mode fast`` makes
   them (uncased vocab, dupe factor 5, seed 12345) at seq 128 (20 predictions)
   and 512 (76), and is packed as ``bertforge data pack
   --max-sequences-per-pack 3`` packs it; for each, the packing factor (real
   sequences per row) and the padding fraction before and after.
2. The same model (same initial weights, fp32, LAMB, dropout on) trains on
   the seq-128 (``--seq-len``) records unpacked and packed, ``--batch-size``
   rows a step, the two taking turns a step each in this process (so that the
   load of a shared machine slows both alike): after ``--warmup`` steps,
   ``--steps`` timed steps each, on consecutive batches of the data. Reported:
   rows/s, real sequences/s, tokens/s as ``bench pretrain`` counts them (rows
   × seq_len) and real (non-padding) tokens/s, from the total time; and the
   real sequences/s again from the median step time, which a load spike on a
   shared machine moves less.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from data_prep import DUMP, VOCAB, wiki_sample_text  # noqa: E402

from bertforge.config import MODEL_PRESETS, ModelConfig, TrainConfig  # noqa: E402
from bertforge.data.create import create  # noqa: E402
from bertforge.data.packing import PackingStats, pack_files  # noqa: E402
from bertforge.data.record_reader import open_records  # noqa: E402
from bertforge.models.bert import BertForPreTraining  # noqa: E402
from bertforge.training.engine import Engine, set_threads  # noqa: E402
from bertforge.training.optim import build_optimizer, build_scheduler  # noqa: E402
from bertforge.training.pretrain import training_loss  # noqa: E402


def file_stats(path: Path) -> PackingStats:
    stats = PackingStats()
    with open_records(path, verify=False) as records:
        for start in range(0, len(records), 4096):
            stats.add(records.take(np.arange(start, min(start + 4096, len(records)))))
    return stats


def make_records(text: Path, folder: Path, seq_len: int, max_predictions: int,
                 max_sequences_per_pack: int) -> tuple[Path, Path, dict]:
    unpacked = folder / f"wiki-{seq_len}.bfrec"
    started = time.perf_counter()
    create([text], VOCAB, unpacked, seq_len=seq_len, max_predictions=max_predictions, dupe_factor=5,
           seed=12345, mode="fast", fmt="native")
    created = time.perf_counter() - started
    packed = folder / f"wiki-{seq_len}-packed.bfrec"
    started = time.perf_counter()
    pack_files([unpacked], [packed], max_sequences_per_pack)
    packing_s = time.perf_counter() - started
    before, after = file_stats(unpacked), file_stats(packed)
    return unpacked, packed, {
        "seq_len": seq_len, "max_predictions": max_predictions, "max_sequences_per_pack": max_sequences_per_pack,
        "sequences": before.sequences, "unpacked_rows": before.rows, "packed_rows": after.rows,
        "packing_factor": round(after.packing_factor, 4),
        "padding_unpacked": round(before.padding_fraction, 4), "padding_packed": round(after.padding_fraction, 4),
        "padding_removed": round(1 - (after.slots - after.tokens) / (before.slots - before.tokens), 4),
        "create_s": round(created, 2), "pack_s": round(packing_s, 2),
    }


@dataclass
class Run:
    """One side of the comparison: its engine, its batches, what they hold, its timed seconds."""

    engine: Engine
    batches: list[dict[str, torch.Tensor]]
    counted: PackingStats  # the timed batches
    seq_len: int
    step_seconds: list[float] = field(default_factory=list)  # the timed steps


def make_engine(model_name: str, seed: int, steps: int) -> Engine:
    torch.manual_seed(seed)  # the same initial weights for both
    model = BertForPreTraining(ModelConfig(**MODEL_PRESETS[model_name], vocab_size=30522)).train()
    train = TrainConfig(optimizer="lamb", lr=1e-3, schedule="constant", warmup_steps=0)
    optimizer = build_optimizer(model, train)
    return Engine(model, optimizer, build_scheduler(optimizer, train, steps), training_loss, "fp32",
                  train.grad_clip, seed=seed)


def throughput(paths: dict[str, Path], model_name: str, batch_size: int, steps: int, warmup: int,
               seed: int = 0) -> dict[str, dict]:
    """Rows, real sequences and tokens per second of training steps on consecutive batches of each file.

    The runs take turns, a step each, so that a machine whose load changes
    (a shared one) slows them alike; each step is timed on its own.
    """
    runs = {}
    for name, path in paths.items():
        with open_records(path, verify=False) as records:
            if len(records) < (steps + warmup) * batch_size:
                raise SystemExit(f"{path}: {len(records)} records, too few for the steps asked")
            arrays = [records.take(np.arange(i * batch_size, (i + 1) * batch_size)) for i in range(steps + warmup)]
            counted = PackingStats()
            for a in arrays[warmup:]:
                counted.add(a)
            runs[name] = Run(make_engine(model_name, seed, steps + warmup), [a.to_torch() for a in arrays],
                             counted, records.seq_len)
    for i in range(steps + warmup):
        for run in runs.values():
            started = time.perf_counter()
            run.engine.step([run.batches[i]], 1, i)["loss"].item()
            if i >= warmup:
                run.step_seconds.append(time.perf_counter() - started)
    results = {}
    for name, run in runs.items():
        elapsed, timed = sum(run.step_seconds), run.counted
        median = float(np.median(run.step_seconds))
        results[name] = {
            "rows_per_s": _digits(timed.rows / elapsed), "seq_per_s": _digits(timed.sequences / elapsed),
            "tokens_per_s": _digits(timed.rows * run.seq_len / elapsed),
            "real_tokens_per_s": _digits(timed.tokens / elapsed),
            "sequences_per_row": round(timed.packing_factor, 3), "step_ms": round(1000 * elapsed / steps, 1),
            "median_step_ms": round(1000 * median, 1),
            # the same rate from the median step: less moved by a load spike on a shared machine
            "seq_per_s_at_median_step": _digits(timed.sequences / (median * steps))}
    return results


def _digits(rate: float) -> float:
    """Four significant digits: small models on a loaded CPU run below one sequence a second."""
    return float(f"{rate:.4g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", choices=sorted(MODEL_PRESETS))
    parser.add_argument("--batch-size", type=int, default=32, help="rows per step, packed or not")
    parser.add_argument("--seq-len", type=int, default=128, choices=(128, 512), help="the records to train on")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-sequences-per-pack", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    set_threads(args.threads)
    result: dict = {"model": args.model, "batch_size": args.batch_size, "seq_len": args.seq_len,
                    "threads": torch.get_num_threads()}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        text = folder / "wiki.txt"
        text.write_text(wiki_sample_text(DUMP), encoding="utf-8")
        data = {}
        for seq_len, max_predictions in ((128, 20), (512, 76)):
            data[seq_len] = make_records(text, folder, seq_len, max_predictions, args.max_sequences_per_pack)
        result["data"] = [info for _, _, info in data.values()]
        unpacked, packed, _ = data[args.seq_len]
        result.update(throughput({"unpacked": unpacked, "packed": packed}, args.model, args.batch_size,
                                 args.steps, args.warmup))
    for key in ("seq_per_s", "seq_per_s_at_median_step"):
        result[f"speedup_{key}"] = round(result["packed"][key] / result["unpacked"][key], 3)
    if args.json:
        print(json.dumps(result))
        return
    for info in result["data"]:
        print(f"seq {info['seq_len']}: {info['sequences']} sequences; unpacked padding "
              f"{100 * info['padding_unpacked']:.1f}%, packed ({info['max_sequences_per_pack']} per row) "
              f"{info['packed_rows']} rows, packing factor {info['packing_factor']:.3f}, padding "
              f"{100 * info['padding_packed']:.1f}% ({100 * info['padding_removed']:.1f}% of the padding removed)")
    for name in ("unpacked", "packed"):
        r = result[name]
        print(f"{args.model} seq {args.seq_len}, {args.batch_size} rows/step, {name}: {r['seq_per_s']:.1f} real seq/s, "
              f"{r['tokens_per_s']:.0f} tokens/s ({r['real_tokens_per_s']:.0f} real), {r['step_ms']:.0f} ms/step")
    print(f"packed / unpacked real sequences per second: {result['speedup_seq_per_s']:.3f} "
          f"({result['speedup_seq_per_s_at_median_step']:.3f} from the median steps)")


if __name__ == "__main__":
    main()
