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


def cmd_eval(args: argparse.Namespace, extra: list[str]) -> int:
    import json

    from bertforge.formats.hf import find_model

    from .beir import read_beir
    from .evaluate import directory_fingerprint, evaluate_retrieval
    from .model import load_embedder

    data = read_beir(args.beir_dir, args.split)  # bad data is refused before the model loads
    overrides = {"pooling": args.pooling, "query_prefix": args.query_prefix,
                 "document_prefix": args.document_prefix, "query_max_length": args.query_max_length,
                 "document_max_length": args.document_max_length,
                 "late_interaction": True if args.late_interaction else None}
    model = load_embedder(args.model, **overrides)
    cache = args.cache or (args.out / "cache" if args.out else None)
    key = None
    if cache is not None:  # the model's files and the settings given here decide its embeddings
        key = f"{directory_fingerprint(find_model(args.model))}\0{json.dumps(overrides, sort_keys=True)}"
    result = evaluate_retrieval(model, data, args.out, top_k=args.top_k, batch_size=args.batch_size,
                                cache_dir=cache, model_key=key, progress=not args.no_progress)
    print(json.dumps(result))
    return 0


def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="an embedding model: ours (fine-tuned for retrieval or not), a transformers or "
                                 "sentence-transformers directory, a PyLate directory, or a cached model id")
    p.add_argument("beir_dir", type=Path, metavar="BEIR_DIR", help="corpus.jsonl, queries.jsonl, qrels/SPLIT.tsv")
    p.add_argument("--split", default="test", help="the qrels to score, qrels/SPLIT.tsv (default test)")
    p.add_argument("--out", type=Path, help="write metrics.json and run.trec here (and the corpus cache, "
                                            "out/cache, unless --cache)")
    p.add_argument("--cache", type=Path, help="keep corpus embeddings here, by model and corpus")
    p.add_argument("--top-k", type=int, default=100, help="documents per query in the run (default 100, "
                                                          "the deepest any metric reads)")
    p.add_argument("--batch-size", type=int, default=64, help="texts per encoder call (default 64)")
    p.add_argument("--pooling", choices=("mean", "cls"), help="over the model's own setting")
    p.add_argument("--query-prefix", help='put before every query, e.g. "search_query: "')
    p.add_argument("--document-prefix", help='put before every document, e.g. "search_document: "')
    p.add_argument("--query-max-length", type=int, help="tokens per query")
    p.add_argument("--document-max-length", type=int, help="tokens per document")
    p.add_argument("--late-interaction", action="store_true", help="score by MaxSim of token embeddings (ColBERT)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


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
    p = group_sub.add_parser("eval", help="nDCG@10, MRR@10, MAP@100, Recall@1/10/100 of an embedding model on a "
                                          "BEIR directory, and its TREC run")
    add_eval_arguments(p)
    p.set_defaults(func=cmd_eval)
    add_train_command(group_sub)


def cmd_train(args: argparse.Namespace, extra: list[str]) -> int:
    from .train import run_command

    return run_command(args, extra)


def add_train_command(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("train", help="contrastive fine-tuning of an embedding model (in-batch negatives)",
                            epilog="Config fields are set with dotted flags, e.g. --train.lr 2e-5 --train.steps 100.")
    p.add_argument("--init", help="our checkpoint, a transformers or sentence-transformers directory")
    p.add_argument("--data", help="query/positive[/negatives] rows: JSON Lines, Parquet or a save_to_disk directory")
    p.add_argument("--out", help="the run directory")
    p.add_argument("--config", default=None, help="retrieval_base (default) or a YAML path")
    p.add_argument("--pooling", choices=["mean", "cls"])
    p.add_argument("--query-prefix")
    p.add_argument("--document-prefix")
    p.add_argument("--query-max-length", type=int)
    p.add_argument("--document-max-length", type=int)
    p.add_argument("--negatives", type=int, help="hard negatives per row (default 0)")
    p.add_argument("--symmetric", action="store_true", help="also each positive against every query")
    p.add_argument("--cache-chunk", type=int, help="GradCache: rows per forward with gradients")
    p.add_argument("--late-interaction", action="store_true", help="ColBERT: token embeddings and MaxSim")
    p.add_argument("--projection-dim", type=int)
    p.add_argument("--resume", help="a run or step directory to continue exactly")
    p.add_argument("--resume-with-changes", action="store_true",
                   help="resume although the config or the data differ from the checkpoint's (each change is logged)")
    p.add_argument("--overwrite", action="store_true", help="replace the run in --out")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_train, takes_overrides=True)
