"""``bertforge retrieval …``: retrieval data and evaluation.

    bertforge retrieval from-squad dev-v1.1.json squad-ir/      # BEIR layout + pairs.jsonl
    bertforge retrieval eval MODEL squad-ir/ --out eval/         # metrics.json and run.trec

(``bertforge eval`` is the masked-LM evaluation of checkpoints, ``bertforge eval CKPT…``: a
``retrieval`` word there would read as a checkpoint, so retrieval's evaluation lives here.)
"""
# (The docstring is the help of ``bertforge retrieval``.) Handlers raise; bertforge.cli.main
# turns a user's mistake into one ``error: …`` line and exit status 2.

from __future__ import annotations

import argparse
from pathlib import Path


def cmd_from_squad(args: argparse.Namespace, extra: list[str]) -> int:
    from .beir import squad_to_beir

    counts = squad_to_beir(args.squad_file, args.out, split=args.split)
    print(f"{args.out}: {counts['documents']} documents, {counts['queries']} queries "
          f"(corpus.jsonl, queries.jsonl, qrels/{args.split}.tsv, pairs.jsonl)")
    return 0


def add_retrieval_commands(sub: argparse._SubParsersAction) -> None:
    group = sub.add_parser("retrieval", help="retrieval data (BEIR, SQuAD as retrieval) and evaluation",
                           description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    group_sub = group.add_subparsers(dest="retrieval_command", required=True)
    p = group_sub.add_parser("from-squad", help="a SQuAD file → a BEIR directory (each question → its "
                                                "paragraph) and training pairs")
    p.add_argument("squad_file", type=Path, metavar="SQUAD_JSON")
    p.add_argument("out", type=Path, metavar="OUT_DIR", help="a new (or empty) directory")
    p.add_argument("--split", default="test", help="the qrels file's name, qrels/SPLIT.tsv (default test)")
    p.set_defaults(func=cmd_from_squad)
