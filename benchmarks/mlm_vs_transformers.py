"""Masked-LM-only pre-training, bertforge against Hugging Face transformers: two loss curves, one report.

    pip install ".[bench,wikipedia]"
    python benchmarks/mlm_vs_transformers.py                                # BERT-mini, 200 steps, seeds 1 2 3
    python benchmarks/mlm_vs_transformers.py --steps 40 --seeds 1 2 --out /tmp/mlm-quick
    python benchmarks/mlm_vs_transformers.py --seeds 1    # one seed: the two sides and their times, no noise
    python benchmarks/mlm_vs_transformers.py --family modernbert --seeds 1 --out bench-mlm-modernbert

The shared Wikipedia dump (``../shared/data/wiki``) goes through bertforge's own
pipeline (``data wikipedia extract``, ``data preprocess``) and then
``data create --mlm-only --dupe-factor 1`` with the BERT uncased vocab: rows of
whole sentences, sequence 128. Both sides then train BERT-mini (4 layers,
hidden 256) on exactly those rows, in the same order (the file's, no shuffle),
from the same initial weights (a seeded ``BertForMaskedLM``, exported to a
Hugging Face directory that both load), with the same AdamW (lr, betas, eps,
weight decay 0.01 except biases and LayerNorm, clip 1.0) and learning rate at
every step. ``--family modernbert`` trains a ModernBERT of the same size
instead (4 layers: global, local, local, global; hidden 256, 4 heads,
intermediate 384, windows of 128, no dropout; the same WordPiece rows and 15 %
masking): ours ``--model.family modernbert`` from a seeded
``ModernBertForMaskedLM`` saved as our checkpoint, theirs
``ModernBertForMaskedLM`` (SDPA, ``sparse_prediction`` off, its default) from
the same weights saved by ``save_pretrained``:

* bertforge: ``bertforge pretrain --train.objective mlm`` on the records with
  ``data.dynamic_masking`` (per row, round(0.15 × its tokens) positions, at
  most 20, never [CLS]/[SEP]; 80/10/10), ``data.shuffle_buffer 0``;
* transformers: ``BertForMaskedLM`` (or ``ModernBertForMaskedLM``) under ``Trainer`` with
  ``DataCollatorForLanguageModeling(mlm_probability=0.15)`` (each non-special
  token masked with probability 0.15; 80/10/10), as ``run_mlm.py`` trains, but
  with a sequential sampler (the same order) and a ``LambdaLR`` giving our
  schedule's lr (``poly``: linear warm-up from lr/W, then linear decay to 0).

What differs is what a seed draws: the masks and the dropout. So each side runs
with several training seeds, and the report sets the gap between the two
sides' curves beside the gap between two seeds of one side (the noise; with
one seed there is none to measure, and ``gap_between_seeds`` is null). Each
run is a fresh subprocess with the same thread count; the times are each
side's own training-loop time (no data preparation, no start-up). Writes
``report.json``, ``report.md`` and ``curves.png`` (with matplotlib) to ``--out``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("BERTFORGE_TEST_DATA", ROOT.parent / "shared" / "data"))
DUMP = SHARED / "wiki" / "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
VOCAB = SHARED / "vocab" / "bert-base-uncased-vocab.txt"
SEQ_LEN, MAX_PREDICTIONS, MASK_PROB = 128, 20, 0.15
INIT_SEED = 0  # the initial weights, the same for every run
SIDES = ("ours", "transformers")
# Each family's model: our preset and the fields changed from it (BERT-mini, and a ModernBERT of its size).
FAMILIES = {"bert": ("mini", {}),
            "modernbert": ("modernbert-tiny", {"hidden_size": 256, "num_attention_heads": 4, "intermediate_size": 384})}


def bertforge(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "bertforge", *map(str, args)], check=True, cwd=ROOT)


def model_config(family: str):
    from bertforge.config import MODEL_PRESETS, ModelConfig

    preset, changes = FAMILIES[family]
    return ModelConfig(**{**MODEL_PRESETS[preset], "vocab_size": 30522, **changes})


def prepare(work: Path, family: str) -> tuple[Path, Path]:
    """(the records, the initial weights), made once per ``work``: a Hugging Face directory ``init`` that
    both sides load (BERT), or our checkpoint ``init`` and theirs ``init-hf`` of the same weights (ModernBERT,
    which ``--init`` does not read from a Hugging Face directory yet)."""
    records, init = work / "rows.tfrecord", work / "init"
    if not (work / "wiki.jsonl").exists():
        bertforge("data", "wikipedia", "extract", DUMP, work / "wiki.jsonl")
    if not (work / "text").exists():
        bertforge("data", "preprocess", work / "wiki.jsonl", work / "text", "--eval-articles", "0")
    if not records.exists():
        bertforge("data", "create", "--input", work / "text" / "train", "--vocab", VOCAB, "--output", records,
                  "--mlm-only", "--mode", "fast", "--dupe-factor", "1", "--seq-len", SEQ_LEN,
                  "--max-predictions", MAX_PREDICTIONS, "--masked-lm-prob", MASK_PROB)
    if not init.exists() and family == "bert":
        import torch

        from bertforge.formats.hf import export_hf
        from bertforge.models.bert import BertForMaskedLM

        torch.manual_seed(INIT_SEED)
        export_hf(BertForMaskedLM(model_config(family)), init, VOCAB)
    elif not init.exists():
        save_modernbert(init, work / "init-hf")
    return records, init


def save_modernbert(ours_dir: Path, their_dir: Path) -> None:
    """A seeded ModernBERT as our checkpoint (weights, config, manifest) and as transformers'
    ``save_pretrained`` directory of the same weights."""
    import torch
    import transformers
    from modernbert_step import hf_config_kwargs

    from bertforge.config import Config
    from bertforge.fileio import atomic_directory
    from bertforge.formats.weights import SAFETENSORS, save_weights
    from bertforge.models.modernbert import ModernBertForMaskedLM
    from bertforge.runs import write_manifest

    torch.manual_seed(INIT_SEED)
    cfg = model_config("modernbert")
    ours = ModernBertForMaskedLM(cfg)
    theirs = transformers.ModernBertForMaskedLM(transformers.ModernBertConfig(**hf_config_kwargs(cfg)))
    theirs.load_state_dict(ours.state_dict(), strict=False)  # decoder.weight: tied to the embeddings
    theirs.tie_weights()
    theirs.save_pretrained(their_dir)
    config = Config(model=cfg)
    config.train.objective = "mlm"
    with atomic_directory(ours_dir) as tmp:
        save_weights(ours, tmp / SAFETENSORS)
        (tmp / "config.yaml").write_text(config.to_yaml(), encoding="utf-8")
        write_manifest(tmp)


def train_config(args: argparse.Namespace) -> dict:
    """The settings both sides share, as our config keys."""
    return {"train.objective": "mlm", "train.optimizer": "adamw", "train.lr": args.lr, "train.weight_decay": 0.01,
            "train.beta1": 0.9, "train.beta2": 0.999, "train.eps": 1e-6, "train.grad_clip": 1.0,
            "train.schedule": "poly", "train.warmup_steps": args.warmup, "train.steps": args.steps,
            "train.micro_batch_size": args.batch_size, "train.global_batch_size": args.batch_size}


# ---------------------------------------------------------------- one run (a subprocess)

def run_ours(args: argparse.Namespace, records: Path, init: Path, out: Path) -> dict:
    name = f"ours-{args.seed}"
    pairs = {**train_config(args), "train.seed": args.seed, "checkpoint.init": init, "data.input": records,
             "data.vocab": VOCAB, "data.dynamic_masking": True, "data.shuffle_buffer": 0,
             "data.masked_lm_prob": MASK_PROB, "train.eval_at_start": False, "train.eval_every": 0,
             "log.every": 1, "log.progress": False, "log.tensorboard": False, "log.run_dir": out / "runs",
             "log.name": name, "execution.threads": args.threads}
    preset, changes = FAMILIES[args.family]
    pairs.update({f"model.{key}": value for key, value in changes.items()})
    flags = [item for key, value in pairs.items() for item in (f"--{key}", str(value))]
    shutil.rmtree(out / "runs" / name, ignore_errors=True)  # this script's own run of an earlier call
    bertforge("pretrain", "--config", preset, *flags)
    rows = [json.loads(line) for line in (out / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r and r.get("split") != "eval"]
    assert [r["step"] for r in steps] == list(range(1, args.steps + 1)), "one row per step expected"
    # elapsed_s at step 1 includes the first step; the loop's time is from its start to the last step.
    return {"losses": [r["loss"] for r in steps], "train_s": steps[-1]["elapsed_s"]}


def run_transformers(args: argparse.Namespace, records: Path, init: Path, out: Path) -> dict:
    import numpy as np
    import torch
    import transformers
    from torch.utils.data import SequentialSampler

    from bertforge.config import load_config
    from bertforge.data.record_reader import read_records
    from bertforge.training.optim import lr_at

    torch.set_num_threads(args.threads)
    rows = read_records(records)
    ids = rows.input_ids.copy()  # unmasked: the records' own masks are not used by either side
    real = rows.masked_lm_weights > 0
    ids[np.nonzero(real)[0], rows.masked_lm_positions[real]] = rows.masked_lm_ids[real]
    length = rows.input_mask.sum(1)
    examples = [{"input_ids": ids[r, :length[r]].tolist()} for r in range(len(ids))]
    # The vocab positionally: transformers 5 names the keyword vocab and ignores vocab_file, leaving
    # a 5-token vocab whose "[MASK]" and random tokens are not BERT's.
    tokenizer = transformers.BertTokenizerFast(str(VOCAB), do_lower_case=True)
    assert len(tokenizer) == 30522 and tokenizer.mask_token_id == 103 and tokenizer.cls_token_id == 101, \
        "the collator must mask with the uncased vocab's [MASK] and draw random tokens from all of it"
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm_probability=MASK_PROB)
    if args.family == "bert":
        model = transformers.BertForMaskedLM.from_pretrained(init)
    else:
        model = transformers.ModernBertForMaskedLM.from_pretrained(init.parent / "init-hf", attn_implementation="sdpa")
    ours = load_config("mini", list(train_config(args).items())).train

    class InOrder(transformers.Trainer):
        def _get_train_sampler(self, train_dataset=None):
            return SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)

        def create_scheduler(self, num_training_steps, optimizer=None):
            optimizer = optimizer if optimizer is not None else self.optimizer
            self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
                optimizer, lambda k: lr_at(k, ours, args.steps) / ours.lr)
            return self.lr_scheduler

    losses: dict[int, float] = {}

    class Record(transformers.TrainerCallback):
        def on_log(self, _args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses[state.global_step] = logs["loss"]

    training = transformers.TrainingArguments(
        output_dir=str(out / "runs" / f"transformers-{args.seed}"), max_steps=args.steps,
        per_device_train_batch_size=args.batch_size, learning_rate=args.lr, weight_decay=0.01,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-6, max_grad_norm=1.0, optim="adamw_torch",
        logging_steps=1, save_strategy="no", report_to=[], seed=args.seed, dataloader_drop_last=True,
        use_cpu=True, disable_tqdm=True)
    trainer = InOrder(model=model, args=training, train_dataset=examples, data_collator=collator,
                      callbacks=[Record()])
    result = trainer.train()
    assert sorted(losses) == list(range(1, args.steps + 1)), "one logged loss per step expected"
    return {"losses": [losses[k] for k in sorted(losses)], "train_s": result.metrics["train_runtime"]}


def worker(args: argparse.Namespace) -> None:
    out = Path(args.out)
    records, init = out / "rows.tfrecord", out / "init"
    result = (run_ours if args.worker == "ours" else run_transformers)(args, records, init, out)
    (out / f"{args.worker}-{args.seed}.json").write_text(json.dumps(result))


# ---------------------------------------------------------------- the report

def smooth(values: list[float], window: int) -> list[float]:
    """Trailing means over ``window`` steps (fewer at the start)."""
    sums = list(itertools.accumulate(values, initial=0.0))
    return [(sums[i + 1] - sums[max(0, i + 1 - window)]) / min(i + 1, window) for i in range(len(values))]


def mean_gap(a: list[float], b: list[float], start: int) -> float:
    return statistics.fmean(abs(x - y) for x, y in zip(a[start:], b[start:]))


def report(args: argparse.Namespace, runs: dict[tuple[str, int], dict]) -> dict:
    window, start = args.smooth, args.steps // 5  # compare after the first fifth: warm-up is alike by construction
    curves = {key: smooth(run["losses"], window) for key, run in runs.items()}
    pairs_between = [(("ours", s), ("transformers", s)) for s in args.seeds]
    pairs_within = [((side, a), (side, b)) for side in SIDES
                    for a, b in itertools.combinations(args.seeds, 2)]
    tail = max(1, args.steps // 10)
    final = {key: statistics.fmean(run["losses"][-tail:]) for key, run in runs.items()}
    summary = {
        "family": args.family, "steps": args.steps, "batch_size": args.batch_size, "seq_len": SEQ_LEN, "lr": args.lr,
        "warmup": args.warmup,
        "seeds": args.seeds, "threads": args.threads, "smoothing_window": window, "compared_from_step": start + 1,
        "gap_between_sides": statistics.fmean(mean_gap(curves[a], curves[b], start) for a, b in pairs_between),
        "gap_between_seeds": (statistics.fmean(mean_gap(curves[a], curves[b], start) for a, b in pairs_within)
                              if pairs_within else None),
        "final_loss": {side: {str(s): final[(side, s)] for s in args.seeds} for side in SIDES},
        "final_loss_median": {side: statistics.median(final[(side, s)] for s in args.seeds)
                              for side in SIDES},
        "train_s": {side: {str(s): runs[(side, s)]["train_s"] for s in args.seeds}
                    for side in SIDES},
        "train_s_median": {side: statistics.median(runs[(side, s)]["train_s"] for s in args.seeds)
                           for side in SIDES},
    }
    noise = summary["gap_between_seeds"]
    summary["within_noise"] = None if noise is None else summary["gap_between_sides"] <= noise * 1.5
    out = Path(args.out)
    (out / "report.json").write_text(json.dumps({**summary, "losses": {f"{k[0]}-{k[1]}": r["losses"]
                                                                      for k, r in runs.items()}}, indent=1))
    lines = [
        f"# Masked LM alone, {'BERT-mini' if args.family == 'bert' else 'a ModernBERT of its size'}, "
        f"{args.steps} steps of {args.batch_size} × {SEQ_LEN}: "
        "bertforge and transformers",
        "",
        f"Seeds {', '.join(map(str, args.seeds))}; losses smoothed over {window} steps and compared from step "
        f"{start + 1}.",
        "",
        "| | bertforge | transformers |",
        "|---|---|---|",
        f"| final loss (mean of the last {tail} steps), median of seeds | {summary['final_loss_median']['ours']:.4f} "
        f"| {summary['final_loss_median']['transformers']:.4f} |",
        f"| training loop, median of seeds | {summary['train_s_median']['ours']:.1f} s "
        f"| {summary['train_s_median']['transformers']:.1f} s |",
        "",
        f"Mean gap between the two sides' curves (same seed): {summary['gap_between_sides']:.4f}; between two seeds "
        f"of one side: {'(one seed)' if noise is None else f'{noise:.4f}'}.",
    ]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return summary
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for (side, seed), curve in sorted(curves.items()):
        ax.plot(range(1, len(curve) + 1), curve, color="tab:blue" if side == "ours" else "tab:orange",
                alpha=0.8, lw=1, label=f"{'bertforge' if side == 'ours' else 'transformers'} seed {seed}")
    ax.set_xlabel("step")
    ax.set_ylabel(f"masked-LM loss ({window}-step mean)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=120)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench-mlm", help="work and report directory (the data is kept for reruns)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--family", choices=tuple(FAMILIES), default="bert",
                        help="BERT-mini, or a ModernBERT of its size (the data and training are the same)")
    parser.add_argument("--smooth", type=int, default=20, help="steps per point of the compared curves")
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES),
                        help="the sides to run; the other's runs are read from an earlier call's --out")
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    args.out = str(out)
    prepare(out, args.family)
    runs = {}
    for seed in args.seeds:  # the sides alternate, so that a slower stretch of the machine hits both
        for side in SIDES:
            if side not in args.sides:
                runs[(side, seed)] = json.loads((out / f"{side}-{seed}.json").read_text())
                continue
            started = time.perf_counter()
            subprocess.run([sys.executable, __file__, "--worker", side, "--seed", str(seed),
                            *(f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                              if k in ("out", "steps", "batch_size", "lr", "warmup", "threads", "family"))], check=True)
            runs[(side, seed)] = json.loads((out / f"{side}-{seed}.json").read_text())
            print(f"{side} seed {seed}: final loss {runs[(side, seed)]['losses'][-1]:.4f}, "
                  f"{runs[(side, seed)]['train_s']:.1f} s in the loop, {time.perf_counter() - started:.0f} s in all",
                  flush=True)
    summary = report(args, runs)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
