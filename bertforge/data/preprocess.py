"""Pre-training text: articles -> one sentence per line, in balanced shards, plus held-out articles.

:func:`preprocess` reads documents, splits their paragraphs into sentences and
writes google-research/bert's input format (one sentence per line, a blank
line after each document) to::

    OUT/train/train_00000.txt ... train_{N-1}.txt
    OUT/eval/eval.txt          (the held-out articles)

The two splits live in separate directories so that a reader globbing
``*.txt`` never mixes them. :func:`train_vocab` trains a vocab on such files:
a WordPiece ``vocab.txt`` or a byte-level BPE ``tokenizer.json``.

Input documents come from ``.jsonl`` files (one JSON object per line with a
``"text"`` of paragraphs separated by newlines: what
:func:`bertforge.data.wikipedia.extract` writes) or from text files (one
paragraph per line, a blank line between documents).

Sentence splitting uses ``sentencex`` (Wikimedia's segmenter: MIT licence,
rules compiled into the wheel, nothing downloaded at run time, wheels for
CPython 3.10-3.12 on Linux x86-64 and aarch64, macOS arm64 and Windows). On
this project's Wikipedia text it keeps abbreviations ("Brown v. Board",
"St. Imier", "U.S.") and decimals ("0.96") whole, where ``blingfire`` split
"v." and "St." (and ships an x86-64-only library), ``pysbd`` ran 300 times
slower and ``nltk``'s punkt model is not in its wheel. One trait to know: it
does not split inside quotation marks, so a quoted passage of several
sentences stays one line.

A document of one sentence is kept, as the reference ``create_pretraining_data.py``
keeps it (it then yields only random-next pairs); such documents are counted.
Documents with no text are skipped and counted.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import random
import time
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from bertforge.fileio import atomic_directory, fsync

from .bpe import train_bpe
from .corpus import iter_text_corpus
from .errors import DataError
from .text import expand_inputs, read_rows
from .text import read_documents as read_text_documents
from .tokenizer import train_wordpiece
from .vocab import load_vocab

SENTENCEX_VERSION = "1.0.32"
TRAIN_DIR, EVAL_DIR, EVAL_FILE = "train", "eval", "eval.txt"
_INPUT_PATTERNS = ("*.jsonl", "*.txt")


# ---------------------------------------------------------------- sentences

def split_sentences(paragraph: str, language: str = "en") -> list[str]:
    """The sentences of one paragraph, whitespace normalised, none empty."""
    try:
        import sentencex
    except ImportError:
        raise DataError("sentence splitting needs sentencex: "
                        f"pip install sentencex=={SENTENCEX_VERSION}") from None
    paragraph = " ".join(paragraph.split())
    if not paragraph:
        return []
    return [s for s in (s.strip() for s in sentencex.segment(language, paragraph)) if s]


# ---------------------------------------------------------------- reading documents

def read_documents(inputs: Iterable[str | Path]) -> Iterator[list[str]]:
    """Every document of the inputs as its paragraphs, whitespace normalised, in file order.

    Inputs are files or directories (their ``*.jsonl`` and ``*.txt`` files,
    sorted by name). A ``.jsonl`` file holds one JSON object per line with a
    ``"text"`` field; any other file is text with a blank line between documents.
    """
    for path in expand_inputs(inputs, patterns=_INPUT_PATTERNS, globs=False, what="corpus"):
        # Text: a blank line ends a document, each line is a paragraph (or a sentence).
        documents = ((text.split("\n") for _, text in read_rows(path)) if path.suffix == ".jsonl"
                     else read_text_documents([path], across_files=False, strip_bom=True))
        for paragraphs in documents:
            yield [p for p in (" ".join(p.split()) for p in paragraphs) if p]


# ---------------------------------------------------------------- preprocess

@dataclass
class PreprocessStats:
    """What :func:`preprocess` read and wrote."""

    documents: int = 0                  # documents with text
    empty_documents: int = 0            # documents without any text, skipped
    train_documents: int = 0
    eval_documents: int = 0
    single_sentence_documents: int = 0  # kept, counted
    sentences: int = 0
    characters: int = 0                 # of the sentences written (newlines not counted)
    shard_characters: list[int] = field(default_factory=list)
    eval_characters: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class _Shards:
    """The training shards, filled in order with one file open at a time."""

    def __init__(self, paths: list[Path]):
        self.paths = paths
        self.index = -1
        self.file: IO[str] | None = None

    def write(self, index: int, text: str) -> None:
        while self.index < index:
            self._next()
        assert self.file is not None  # _next opened shard ``index``
        self.file.write(text)

    def close(self) -> None:
        while self.index < len(self.paths) - 1:  # a shard no document reached is still written, empty
            self._next()
        assert self.file is not None  # there is at least one shard
        self.file.close()

    def _next(self) -> None:
        if self.file is not None:
            self.file.close()
        self.index += 1
        self.file = open(self.paths[self.index], "w", encoding="utf-8")  # noqa: SIM115 (closed by close())


def _eval_count(eval_articles: int | float, documents: int) -> int:
    if isinstance(eval_articles, float):
        if not 0.0 <= eval_articles < 1.0:
            raise DataError(f"eval_articles={eval_articles}: a fraction must be in [0, 1)")
        return max(1, round(documents * eval_articles)) if eval_articles > 0 else 0
    if eval_articles < 0:
        raise DataError(f"eval_articles={eval_articles} must not be negative")
    return int(eval_articles)


def _check_out_dir(out_dir: Path) -> None:
    """Refuse to replace a directory that holds anything but an earlier run's output."""
    if out_dir.exists():
        if not out_dir.is_dir():
            raise DataError(f"{out_dir}: exists and is not a directory")
        other = sorted(p.name for p in out_dir.iterdir() if p.name not in (TRAIN_DIR, EVAL_DIR))
        if other:
            raise DataError(f"{out_dir}: holds other files ({', '.join(other[:3])}); "
                            "give a new or empty directory")


def preprocess(inputs: str | Path | Iterable[str | Path], out_dir: str | Path, *, shards: int = 1,
               eval_articles: int | float = 0.01, seed: int = 12345,
               language: str = "en") -> PreprocessStats:
    """Split documents into sentences; write ``shards`` training files and the held-out articles.

    ``eval_articles`` is a count (int) or a fraction of the documents (float
    in [0, 1), at least one when above 0); which ones is drawn with ``seed``.
    Training documents keep their input order and are cut into ``shards``
    consecutive runs of about equal characters: a shard boundary falls between
    documents, so shards differ by at most about one document. The same
    inputs and arguments give the same bytes.

    Memory stays bounded: the input is read twice, streamed (first to count
    documents and their lengths, 8 bytes each, then to write), and only one
    document is held at a time. ``out_dir`` is replaced atomically as a whole.
    """
    start = time.perf_counter()
    inputs = [inputs] if isinstance(inputs, (str, Path)) else list(inputs)
    out_dir = Path(out_dir)
    if shards < 1:
        raise DataError(f"shards={shards} must be at least 1")
    _check_out_dir(out_dir)
    split_sentences("Fail now, not after reading the corpus, if the splitter is missing.", language)

    stats = PreprocessStats()
    lengths = _document_lengths(inputs, stats)
    n_eval = _eval_count(eval_articles, len(lengths))
    if len(lengths) - n_eval < shards:
        raise DataError(f"{len(lengths)} documents, {n_eval} of them held out, cannot fill "
                        f"{shards} training shards")
    held_out = set(random.Random(seed).sample(range(len(lengths)), n_eval))

    stats.shard_characters = [0] * shards
    with atomic_directory(out_dir) as tmp:
        written, index = _write_split(tmp, inputs, lengths, held_out, shards, language, stats)
        if index != len(lengths):
            raise DataError(f"{', '.join(map(str, inputs))}: the input changed while it was read")
        for path in written:
            fsync(path)  # atomic_directory flushes only its top level
    stats.seconds = time.perf_counter() - start
    return stats


def _document_lengths(inputs: list[str | Path], stats: PreprocessStats) -> array:
    """Pass 1: the length of every document with text (the documents without are counted in ``stats``)."""
    lengths = array("q")
    for paragraphs in read_documents(inputs):
        if paragraphs:
            lengths.append(sum(map(len, paragraphs)))
        else:
            stats.empty_documents += 1
    stats.documents = len(lengths)
    if not lengths:
        raise DataError(f"{', '.join(map(str, inputs))}: the corpus is empty (no document with text)")
    return lengths


def _write_split(tmp: Path, inputs: list[str | Path], lengths: array, held_out: set[int], shards: int,
                 language: str, stats: PreprocessStats) -> tuple[list[Path], int]:
    """Pass 2: split and write into ``tmp``; (the files written, the documents with text read).
    A document goes to the shard where its middle character falls when the training text is cut
    into equal parts."""
    train_total = sum(lengths) - sum(lengths[i] for i in held_out)
    (tmp / TRAIN_DIR).mkdir()
    train = _Shards([tmp / TRAIN_DIR / f"train_{i:05d}.txt" for i in range(shards)])
    eval_path = tmp / EVAL_DIR / EVAL_FILE
    written = train.paths.copy()
    with contextlib.ExitStack() as stack:
        stack.callback(train.close)
        if held_out:
            eval_path.parent.mkdir()
            eval_file = stack.enter_context(open(eval_path, "w", encoding="utf-8"))
            written.append(eval_path)
        index, done = 0, 0
        for paragraphs in read_documents(inputs):
            if not paragraphs:
                continue
            sentences = [s for p in paragraphs for s in split_sentences(p, language)]
            chars = sum(map(len, sentences))
            text = "\n".join(sentences) + "\n\n"
            stats.sentences += len(sentences)
            stats.characters += chars
            stats.single_sentence_documents += len(sentences) == 1
            if index in held_out:
                eval_file.write(text)
                stats.eval_documents += 1
                stats.eval_characters += chars
            else:
                shard = min(shards - 1, (done + lengths[index] // 2) * shards // train_total)
                train.write(shard, text)
                done += lengths[index]
                stats.train_documents += 1
                stats.shard_characters[shard] += chars
            index += 1
    return written, index


# ---------------------------------------------------------------- vocab

VOCAB_KINDS = ("wordpiece", "bpe")


def train_vocab(corpus: str | Path | Iterable[str | Path], out: str | Path, vocab_size: int = 30522,
                lowercase: bool = True, kind: str = "wordpiece") -> Path:
    """Train a vocab on pre-training text files (or directories of ``*.txt``); write ``out``.

    ``kind`` ``wordpiece``: a ``vocab.txt`` (:func:`bertforge.data.tokenizer.train_wordpiece`,
    which reads the files twice as a stream: memory does not grow with the
    corpus); ``bpe``: a byte-level BPE ``tokenizer.json`` (:func:`bertforge.data.bpe.train_bpe`,
    cased whatever ``lowercase`` says, as ModernBERT's).
    """
    if kind not in VOCAB_KINDS:
        raise DataError(f"kind={kind!r} must be one of {', '.join(VOCAB_KINDS)}")
    paths = [corpus] if isinstance(corpus, (str, Path)) else list(corpus)
    if kind == "bpe":
        return train_bpe(_TextDocuments(paths), vocab_size, out)
    return train_wordpiece(_TextDocuments(paths), vocab_size, out, lowercase=lowercase)


class _TextDocuments:
    """The documents of text files, read afresh by each iteration."""

    def __init__(self, paths: list[str | Path]):
        self.paths = paths

    def __iter__(self) -> Iterator[list[str]]:
        count = 0
        for document in iter_text_corpus(self.paths):
            count += 1
            yield document
        if count == 0:
            raise DataError(f"{', '.join(map(str, self.paths))}: the corpus is empty (no non-blank lines)")


# ---------------------------------------------------------------- command line

def _count_or_fraction(text: str) -> int | float:
    try:
        return float(text) if any(c in text for c in ".eE") else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a count nor a fraction") from None


def add_preprocess_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``bertforge data preprocess``."""
    parser.add_argument("inputs", nargs="+", type=Path,
                        help="extracted articles (.jsonl) or text files, or directories of them")
    parser.add_argument("out_dir", type=Path, help="output directory (new, or an earlier output)")
    parser.add_argument("--shards", type=int, default=1, help="training shards (default 1)")
    parser.add_argument("--eval-articles", type=_count_or_fraction, default=0.01,
                        help="held-out articles: a count (500) or a fraction (0.01, the default)")
    parser.add_argument("--seed", type=int, default=12345, help="picks the held-out articles")
    parser.add_argument("--language", default="en", help="sentence-splitting language (default en)")


def cmd_preprocess(args: argparse.Namespace, extra: list[str] | None = None) -> int:
    stats = preprocess(args.inputs, args.out_dir, shards=args.shards, eval_articles=args.eval_articles,
                       seed=args.seed, language=args.language)
    print(f"{stats.documents} documents ({stats.train_documents} train in {args.shards} shards, "
          f"{stats.eval_documents} eval), {stats.sentences} sentences, {stats.characters} characters, "
          f"{stats.single_sentence_documents} single-sentence and {stats.empty_documents} empty "
          f"documents -> {args.out_dir} ({stats.seconds:.1f} s)")
    return 0


def add_vocab_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``bertforge data vocab``."""
    parser.add_argument("corpus", nargs="+", type=Path,
                        help="pre-training text files, or directories of *.txt (e.g. OUT/train)")
    parser.add_argument("out", type=Path, help="vocab file to write (vocab.txt; tokenizer.json with --kind bpe)")
    parser.add_argument("--kind", choices=VOCAB_KINDS, default="wordpiece",
                        help="wordpiece: BERT's vocab.txt (default); bpe: a byte-level BPE tokenizer.json with "
                             "ModernBERT's special tokens")
    parser.add_argument("--vocab-size", type=int, default=30522,
                        help="at most this many tokens (default 30522)")
    parser.add_argument("--cased", action="store_true",
                        help="keep case and accents (default: lower-case; a BPE keeps them always)")


def cmd_vocab(args: argparse.Namespace, extra: list[str] | None = None) -> int:
    start = time.perf_counter()
    path = train_vocab(args.corpus, args.out, args.vocab_size, lowercase=not args.cased, kind=args.kind)
    vocab = load_vocab(path)
    seconds = time.perf_counter() - start
    short = (f" (of --vocab-size {args.vocab_size}: the corpus gave no more)" if vocab.size < args.vocab_size
             else "")
    specials = ""
    if args.kind == "bpe":
        roles = vocab.specials
        specials = "; special tokens " + ", ".join(
            f"{vocab.tokens[i]} {i}" for i in (roles.pad, roles.unk, roles.cls, roles.sep, roles.mask) if i is not None)
    print(f"{vocab.size} tokens{short} -> {path} ({seconds:.1f} s){specials}")
    return 0
