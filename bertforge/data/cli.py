"""``bertforge data …``: from a Wikipedia dump (or any text) to pre-training records.

    bertforge data wikipedia download DIR
    bertforge data wikipedia extract DUMP OUT.jsonl
    bertforge data preprocess OUT.jsonl TEXT_DIR --shards 64
    bertforge data vocab TEXT_DIR/train vocab.txt
    bertforge data vocab TEXT_DIR/train tokenizer.json --kind bpe --vocab-size 50368   # or a BPE, as ModernBERT's
    bertforge data create --input 'TEXT_DIR/train/*.txt' --vocab vocab.txt --output records/train.tfrecord \\
        --mode fast --workers 8 --num-output-files 64
    bertforge data create --input corpus.parquet --text-column text --vocab vocab.txt --output records/train.tfrecord
    bertforge data pick-eval TEXT_DIR/eval/eval.txt records/eval.tfrecord --vocab vocab.txt --num 10000
    bertforge data pack records/ packed/ --max-sequences-per-pack 3
    bertforge data index records/*.tfrecord
    bertforge data inspect records/train-00000-of-00064.tfrecord --vocab vocab.txt
    bertforge data checksum records/ [--verify]   # md5 and size of every file, written once, verified later
"""
# (The docstring is the help of ``bertforge data``.) The handlers raise; bertforge.cli.main
# turns a user's mistake into one ``error: …`` line and exit status 2, as for every command.

from __future__ import annotations

import argparse
from pathlib import Path


def cmd_index(args: argparse.Namespace, extra: list[str]) -> int:
    from .record_reader import write_index

    for path in args.files:
        print(write_index(path))
    return 0


def cmd_inspect(args: argparse.Namespace, extra: list[str]) -> int:
    """Print the file's description; status 1 when its validation failed (2, from main, when
    it cannot be read at all)."""
    from .record_inspect import inspect_records

    text, ok = inspect_records(args.file, num=args.num, vocab_path=args.vocab)
    print(text)
    return 0 if ok else 1


def _command(run):
    """A command handler, (args, extra) -> status, from a function of args alone.
    It only adapts the signature; errors are main's."""
    def command(args: argparse.Namespace, extra: list[str]) -> int:
        return run(args)
    return command


def add_data_commands(sub: argparse._SubParsersAction) -> None:
    from . import checksum, create, packing, pick_eval, preprocess, wikipedia

    data = sub.add_parser("data", help="make pre-training data: Wikipedia, text, records",
                          description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    data_sub = data.add_subparsers(dest="data_command", required=True)

    wiki = data_sub.add_parser("wikipedia", help="download and extract a Wikipedia dump")
    wiki_sub = wiki.add_subparsers(dest="wikipedia_command", required=True)
    p = wiki_sub.add_parser("download", help="fetch a pages-articles dump (resumable, checksum-verified)")
    wikipedia.add_download_arguments(p)
    p.set_defaults(func=wikipedia.cmd_download)
    p = wiki_sub.add_parser("extract", help="dump → cleaned articles, one JSON object per line")
    wikipedia.add_extract_arguments(p)
    p.set_defaults(func=wikipedia.cmd_extract)

    p = data_sub.add_parser("preprocess", help="articles or text → one sentence per line, shards + eval")
    preprocess.add_preprocess_arguments(p)
    p.set_defaults(func=preprocess.cmd_preprocess)
    p = data_sub.add_parser("vocab", help="train a WordPiece vocab.txt or a BPE tokenizer.json on text")
    preprocess.add_vocab_arguments(p)
    p.set_defaults(func=preprocess.cmd_vocab)

    p = data_sub.add_parser("create", help="text → masked next-sentence records (reference or fast)")
    create.add_arguments(p)
    p.set_defaults(func=_command(create.run))
    p = data_sub.add_parser("pick-eval", help="MLPerf's eval-set picking")
    pick_eval.add_arguments(p)
    p.set_defaults(func=_command(pick_eval.run))

    p = data_sub.add_parser("pack", help="pack up to N sequences per record (SPFHP, Graphcore's packed schema)")
    packing.add_pack_arguments(p)
    p.set_defaults(func=packing.cmd_pack)
    p = data_sub.add_parser("checksum", help="write (or --verify) a manifest of md5 sums and sizes of a directory")
    checksum.add_arguments(p)
    p.set_defaults(func=_command(checksum.run))
    p = data_sub.add_parser("index", help="write .index files (offset and length per record) for TFRecords")
    p.add_argument("files", nargs="+", type=Path)
    p.set_defaults(func=cmd_index)
    p = data_sub.add_parser("inspect", help="count, validate and decode a few records")
    p.add_argument("file", type=Path)
    p.add_argument("--num", type=int, default=3, help="records to decode (default 3)")
    p.add_argument("--vocab", help="vocab.txt or tokenizer.json, to show tokens instead of ids")
    p.set_defaults(func=cmd_inspect)
