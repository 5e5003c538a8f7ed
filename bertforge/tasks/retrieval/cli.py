"""``bertforge retrieval …``: retrieval data, evaluation and training (the help is :data:`DESCRIPTION`)."""
# Handlers raise; bertforge.cli.main turns a user's mistake into one ``error: …`` line and exit status 2.

from __future__ import annotations

import argparse
from pathlib import Path

from bertforge.config import ConfigError

# The help of ``bertforge retrieval``: plain text (argparse prints it as written), every subcommand.
DESCRIPTION = """\
Retrieval data, evaluation and training.

    bertforge retrieval from-squad dev-v1.1.json squad-ir/      # BEIR layout + pairs.jsonl
    bertforge retrieval eval MODEL squad-ir/ --out eval/         # metrics.json and run.trec
                        (--rerank 20 --reranker RR/: the top 20 reranked by a cross-encoder)
    bertforge retrieval mine MODEL squad-ir/pairs.jsonl mined.jsonl   # hard negatives by the model
    bertforge retrieval train --init MODEL --data squad-ir/pairs.jsonl --out run/  # contrastive fine-tuning
                        (--kind cross-encoder --negatives 3: a reranker)

(bertforge eval is the masked-LM evaluation of checkpoints, bertforge eval CKPT...: a
word "retrieval" there would read as a checkpoint, so retrieval's evaluation lives here.)
"""


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

    if (args.rerank is None) != (args.reranker is None):
        raise ConfigError("--rerank K and --reranker MODEL go together")
    if args.rerank is not None and args.rerank < 1:
        raise ConfigError(f"--rerank {args.rerank}: rerank at least 1 document per query")
    data = read_beir(args.beir_dir, args.split)  # bad data is refused before the model loads
    overrides = {"pooling": args.pooling, "query_prefix": args.query_prefix,
                 "document_prefix": args.document_prefix, "query_max_length": args.query_max_length,
                 "document_max_length": args.document_max_length,
                 "late_interaction": True if args.late_interaction else None, "truncate_dim": args.dim}
    model = load_embedder(args.model, **overrides)
    cache = args.cache or (args.out / "cache" if args.out else None)
    key = None
    if cache is not None:  # the model's files and the settings given here decide its embeddings
        key = f"{directory_fingerprint(find_model(args.model))}\0{json.dumps(overrides, sort_keys=True)}"
    reranking = None
    if args.reranker is not None:
        from .rerank import load_reranker

        reranking = (load_reranker(args.reranker), args.rerank)
    result = evaluate_retrieval(model, data, args.out, top_k=args.top_k, batch_size=args.batch_size,
                                cache_dir=cache, model_key=key, progress=not args.no_progress, rerank=reranking)
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
    p.add_argument("--rerank", type=int, metavar="K", help="rerank each query's first K documents with --reranker")
    p.add_argument("--reranker", help="a cross-encoder: ours, a transformers or sentence-transformers CrossEncoder "
                                      "directory")
    p.add_argument("--dim", type=int, help="the first N dimensions of each embedding (a Matryoshka model's "
                                           "smaller size; sentence-transformers' truncate_dim)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_retrieval_commands(sub: argparse._SubParsersAction) -> None:
    group = sub.add_parser("retrieval", help="retrieval data (BEIR, SQuAD as retrieval) and evaluation",
                           description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    add_mine_command(group_sub)


def cmd_train(args: argparse.Namespace, extra: list[str]) -> int:
    from .rerank_train import is_reranker_run

    if args.data and len(args.data) == 1:  # one dataset: retrieval.data stays a path, as before several
        args.data = args.data[0]
    resumed = args.out if args.resume == "auto" else args.resume  # a reranker's run is resumed as one
    if args.kind == "cross-encoder" or (args.kind is None and resumed and is_reranker_run(resumed)):
        from .rerank_train import run_command as train_reranker

        if isinstance(args.data, list):
            raise ConfigError(f"--data: a cross-encoder trains on one dataset, not {len(args.data)}")
        return train_reranker(args, extra)
    given = [flag for flag in ("loss", "max_length") if getattr(args, flag) is not None]
    if given:
        raise ConfigError(f"--{given[0].replace('_', '-')} is a cross-encoder setting (--kind cross-encoder)")
    from .train import run_command

    return run_command(args, extra)


def add_train_command(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("train", help="contrastive fine-tuning of an embedding model (in-batch negatives)",
                            epilog="Config fields are set with dotted flags, e.g. --train.lr 2e-5 --train.steps 100.")
    p.add_argument("--kind", choices=["bi-encoder", "cross-encoder"],
                   help="bi-encoder (an embedding model, the default) or cross-encoder (a reranker)")
    p.add_argument("--init", help="our checkpoint, a transformers or sentence-transformers directory")
    p.add_argument("--data", nargs="+", help="query/positive[/negatives] rows: JSON Lines, Parquet or a save_to_disk "
                                             "directory; several: one dataset each, a batch from one of them")
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
    p.add_argument("--batch-sampler", choices=("batch_sampler", "no_duplicates"),
                   help="no_duplicates: no text twice in a batch (default batch_sampler: a random order)")
    p.add_argument("--multi-dataset-batch-sampler", choices=("proportional", "round_robin"),
                   help="with several --data: every batch of each (proportional, the default) or one of each in turn")
    p.add_argument("--matryoshka-dims", type=int, nargs="+", metavar="N",
                   help="Matryoshka: the loss also at the first N dimensions, for each N (e.g. 384 256 64)")
    p.add_argument("--matryoshka-weights", type=float, nargs="+", metavar="W", help="a weight per dimension (1s)")
    p.add_argument("--dev", help="a BEIR directory scored every --train.eval_every steps and at the end; the best "
                                 "model is kept in OUT/best")
    p.add_argument("--dev-split", help="the dev set's qrels/SPLIT.tsv (default dev)")
    p.add_argument("--best-metric", help="the dev metric that picks OUT/best (default ndcg@10)")
    p.add_argument("--late-interaction", action="store_true", help="ColBERT: token embeddings and MaxSim")
    p.add_argument("--projection-dim", type=int)
    p.add_argument("--loss", choices=["bce", "listwise"], help="cross-encoder: each pair against its label "
                                                                "(bce, default) or each positive among its negatives")
    p.add_argument("--max-length", type=int, help="cross-encoder: tokens of a (query, passage) pair")
    p.add_argument("--resume", help="a run or step directory to continue exactly")
    p.add_argument("--resume-with-changes", action="store_true",
                   help="resume although the config or the data differ from the checkpoint's (each change is logged)")
    p.add_argument("--overwrite", action="store_true", help="replace the run in --out")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_train, takes_overrides=True)


def cmd_mine(args: argparse.Namespace, extra: list[str]) -> int:
    import json

    from bertforge.config import ConfigError

    from .beir import read_corpus
    from .mine import MiningSettings, mine_negatives, write_rows
    from .model import load_embedder
    from .pairs import read_pairs

    if args.out.is_dir() or (args.out.exists() and not args.overwrite):
        raise ConfigError(f"{args.out} exists: choose another output file"
                          + ("" if args.out.is_dir() else ", or pass --overwrite"))
    settings = MiningSettings(num_negatives=args.num_negatives, range_min=args.range_min, range_max=args.range_max,
                              max_score=args.max_score, min_score=args.min_score,
                              absolute_margin=args.absolute_margin, relative_margin=args.relative_margin,
                              sampling_strategy=args.sampling_strategy, seed=args.seed)
    pairs = read_pairs(args.pairs)  # bad input is refused before the model loads
    corpus = read_corpus(args.corpus) if args.corpus else []
    settings.window(1)
    model = load_embedder(args.model, pooling=args.pooling, query_prefix=args.query_prefix,
                          document_prefix=args.document_prefix, query_max_length=args.query_max_length,
                          document_max_length=args.document_max_length)
    mined = mine_negatives(model, pairs, corpus, settings, args.batch_size, progress=not args.no_progress)
    write_rows(mined.rows, args.out)
    print(json.dumps({"out": str(args.out), "rows": len(mined.rows), "queries": mined.queries,
                      "left_out": mined.left_out, "skipped": mined.skipped}))
    return 0


def add_mine_command(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("mine", help="hard negatives mined by an embedding model (sentence-transformers' "
                                         "mine_hard_negatives), written as training rows")
    p.add_argument("model", help="the embedding model: ours, a transformers or sentence-transformers directory")
    p.add_argument("pairs", type=Path, metavar="PAIRS", help="query/positive rows (JSON Lines, Parquet, save_to_disk)")
    p.add_argument("out", type=Path, metavar="OUT_JSONL", help="the rows with their negatives, for retrieval train")
    p.add_argument("--corpus", type=Path, help="more candidates: a BEIR corpus.jsonl or directory "
                                               "(default: the positives alone)")
    p.add_argument("--num-negatives", type=int, default=3, help="negatives per row (default 3)")
    p.add_argument("--range-min", type=int, default=0, help="candidates skipped first, best first (default 0)")
    p.add_argument("--range-max", type=int, help="the last candidate rank considered (default: enough for "
                                                 "--num-negatives, ten times that with a margin or --max-score)")
    p.add_argument("--max-score", type=float, help="drop candidates scoring above this")
    p.add_argument("--min-score", type=float, help="drop candidates scoring below this")
    p.add_argument("--absolute-margin", type=float, help="drop candidates within this of the query's positive")
    p.add_argument("--relative-margin", type=float, help="drop candidates above positive - |positive| × this")
    p.add_argument("--sampling-strategy", choices=("top", "random"), default="top",
                   help="the best candidates, or a random draw among those left (default top)")
    p.add_argument("--seed", type=int, default=0, help="of --sampling-strategy random (default 0)")
    p.add_argument("--batch-size", type=int, default=32, help="texts per encoder call (default 32)")
    p.add_argument("--pooling", choices=("mean", "cls"), help="over the model's own setting")
    p.add_argument("--query-prefix")
    p.add_argument("--document-prefix")
    p.add_argument("--query-max-length", type=int)
    p.add_argument("--document-max-length", type=int)
    p.add_argument("--overwrite", action="store_true", help="replace OUT_JSONL")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_mine)
