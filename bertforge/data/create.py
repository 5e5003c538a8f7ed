"""``bertforge data create``: text files → masked next-sentence pre-training records.

Input is google-research/bert's text format: one sentence per line, a blank
line between documents. Lines are read as its ``create_pretraining_data.py``
reads them: split at ``\\n`` only, stripped with ``str.strip``, a blank line
ends a document, and a file's last document runs on into the next file when
no blank line separates them. Lines that tokenize to nothing are dropped,
then documents left empty.

Two modes:

* ``reference`` -- the reference script's records, in its order, for the same
  input, vocab, flags and seed: documents shuffled and instances drawn with one
  ``random.Random(seed)`` (:func:`.instances.create_instances`), all instances
  shuffled, then written round-robin over the output files. Like the reference
  it holds the whole corpus in memory, and its pairing and masking are as slow
  (tokenizing is fast, see below).
* ``fast`` -- the same distributions (next-sentence pairs, short sequences,
  80/10/10 masking; see :func:`.instances.create_arrays_fast`), drawn with
  numpy, streaming: the input is cut after blank lines into chunks of at least
  ``chunk_chars`` bytes and ``MIN_CHUNK_DOCS`` documents, each chunk is
  tokenized, paired, masked and shuffled with its own generator seeded by
  ``(seed, chunk index)``, and the chunks are written in order, so the output
  bytes do not depend on ``workers``. A random next sentence comes from
  another document of the same chunk; instances are shuffled only within
  their chunk (the loader shuffles across chunks). Memory is bounded by a few chunks,
  the tokenizer's cache and the longest document, whatever the corpus size.
  Each chunk is also encoded where it is made (:class:`.record_writer.RecordEncoder`):
  with ``workers`` > 1 each worker process reads its chunk's byte ranges itself and
  leaves finished record bytes in a spool file, and the parent, one of the
  workers itself, scans the input for cut points and appends those bytes to the files.
  With ``mlm_only`` a chunk gives masked-LM-only rows instead: whole sentences of
  contiguous text, across documents (:func:`.instances.create_arrays_mlm`).

Input is read by :mod:`.text` (files, globs and directories of ``*.txt``;
chunks as byte ranges), or from tables (JSON Lines, Parquet, ``save_to_disk``
directories: one document per row of ``text_column``, its lines the sentences,
read by the parent process and sent to the workers as documents; the same text
as a text file gives the same records in both modes). The vocab is a WordPiece
``vocab.txt`` or a ``tokenizer.json`` (:mod:`.vocab`): tokenization gives the ids of
:func:`.tokenizer.encode_texts` (the reference ``FullTokenizer``'s) for the one,
of ``tokenizers`` itself for the other (each document as its running text, see
:meth:`.bpe.FastBPE.encode_documents`), found with numpy and a cache
(:class:`.wordpiece.FastWordPiece`, :class:`.bpe.FastBPE`). The special tokens
and their ids come from the vocab, and a native file's header names it
(:meth:`.vocab.Vocabulary.identity`).

Output: ``num_output_files`` files in ``fmt`` (``tfrecord`` with the reference
feature schema, or ``native``), filled round-robin as the reference does. One
file is ``output`` itself; several are ``NAME-00000-of-00004.EXT`` next to it.
Every file is written under a temporary name and renamed when complete. The
command refuses to replace existing files unless ``--overwrite`` (:func:`check_outputs`), and
even then in the directory of a live run.

Bad input is a :class:`.errors.DataError` naming the file or value, and no
output: a missing input or vocab, bytes that are not UTF-8 (with the byte
offset), a corpus with no token at all, an option out of range. Documents
whose lines all tokenize to nothing are skipped and counted
(``CreateStats.empty_documents``); a document of one sentence is kept, as in
the reference: each of its pairs takes a random next sentence.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import mmap
import multiprocessing
import os
import random
import re
import sys
import tempfile
import time
from collections import deque
from collections.abc import Generator, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bertforge.fileio import atomic_files, refuse_live_runs

from .errors import DataError, warn_one_document, warn_prediction_cap
from .instances import create_arrays_fast, create_arrays_mlm, create_instances, to_arrays
from .record_schema import FORMATS, tokenizer_sidecar
from .record_writer import EncodedRecords, RecordEncoder, RecordWriter
from .rows import PretrainingArrays
from .text import Chunk, expand_inputs, input_chunks, input_documents, read_chunk
from .vocab import Vocabulary, load_vocab

MODES = ("reference", "fast")
CHUNK_CHARS = 1 << 18  # fast mode: bytes of text per chunk (characters, for ASCII)
MIN_CHUNK_DOCS = 16  # ... and at least this many documents, so random next sentences vary
REFERENCE_WRITE_BATCH = 4096  # reference mode pads and writes this many instances at a time
IN_FLIGHT_PER_WORKER = 2  # fast mode: chunks queued or running per other worker process


@dataclass(frozen=True)
class CreateOptions:
    """What an instance looks like; the same fields as the reference script's flags."""

    seq_len: int = 128
    max_predictions: int = 20
    masked_lm_prob: float = 0.15
    short_seq_prob: float = 0.1
    dupe_factor: int = 5
    seed: int = 12345
    lowercase: bool = True
    whole_word_mask: bool = False  # the reference's --do_whole_word_mask
    mlm_only: bool = False  # full-sentence rows without next-sentence pairs (instances.create_arrays_mlm)

    def check(self) -> None:
        """A DataError naming the first option out of range."""
        problems = [
            ("seq_len", self.seq_len >= 5, "at least 5 ([CLS] A [SEP] B [SEP])"),
            ("max_predictions", 1 <= self.max_predictions < self.seq_len, "in 1..seq_len-1"),
            ("masked_lm_prob", 0 < self.masked_lm_prob <= 1, "in (0, 1]"),
            ("short_seq_prob", 0 <= self.short_seq_prob <= 1, "in [0, 1]"),
            ("dupe_factor", self.dupe_factor >= 1, "at least 1"),
        ]
        for name, ok, rule in problems:
            if not ok:
                raise DataError(f"{name}={getattr(self, name)} must be {rule}")


@dataclass
class CreateStats:
    """What :func:`create` read and wrote."""

    mode: str
    files: list[Path]
    instances: int = 0
    documents: int = 0  # documents with at least one token
    sentences: int = 0  # lines with at least one token
    tokens: int = 0
    empty_documents: int = 0  # documents whose lines all tokenized to nothing (skipped)
    chunks: int = 0  # fast mode
    seconds: float = 0.0
    next_sentence_random: int = 0  # instances whose B is random (label 1)

    def summary(self) -> str:
        rate = self.instances / self.seconds if self.seconds > 0 else 0.0
        return (f"{self.instances} instances from {self.documents} documents, {self.sentences} "
                f"sentences, {self.tokens} tokens ({self.empty_documents} empty documents skipped) "
                f"in {self.seconds:.2f}s ({rate:,.0f} instances/s), {self.mode} mode → "
                + ", ".join(map(str, self.files)))


# ---------------------------------------------------------------- fast mode, one chunk

@dataclass
class ChunkResult:
    """One chunk's instances: as arrays, or as encoded records when an encoder was given."""

    arrays: PretrainingArrays | None
    records: EncodedRecords | None
    instances: int
    next_sentence_random: int  # instances whose B is random (label 1)
    documents: int
    sentences: int
    tokens: int
    empty_documents: int
    spooled: _Spooled | None = None  # records left in a spool file by a worker (then no records)


@dataclass
class _Spooled:
    """A chunk's records in a file of the spool directory, grouped for round-robin output.

    Group r holds rows r, r + N, r + 2N, … of the chunk (N output files), so
    that whichever file each row lands in, a file's share is one contiguous run.
    Files rather than pipes: the bytes cross from worker to parent with one
    copy each way and no pickling, and the parent, which shares the cores with
    the workers, does almost nothing but append them.
    """

    path: str
    group_bytes: list[int]
    group_counts: list[int]
    group_max_ids: list[int]

    @classmethod
    def write(cls, records: EncodedRecords, path: str, num_files: int) -> _Spooled:
        groups = [records.take(slice(r, None, num_files)) for r in range(num_files)]
        with open(path, "wb") as file:
            for group in groups:
                # numpy's stubs give ndarray its __buffer__ only for Python >= 3.12; it is a buffer on every version
                file.write(group.data)  # type: ignore[arg-type]
        return cls(path, [len(g.data) for g in groups], [len(g) for g in groups],
                   [int(g.max_ids.max(initial=-1)) for g in groups])


class _ChunkMaker:
    """Tokenizes, draws and (given an encoder) encodes the instances of one chunk; one per process."""

    def __init__(self, vocab: Path, options: CreateOptions, encoder: RecordEncoder | None):
        self.options = options
        self.encoder = encoder
        self.key = _maker_key(options, encoder)
        self.vocab = load_vocab(vocab)
        self.tokenizer = self.vocab.encoder(options.lowercase)

    def __call__(self, index: int, ranges: Chunk) -> ChunkResult:
        o = self.options
        chunk = self.tokenizer.encode_documents(read_chunk(ranges))
        rng = np.random.default_rng([o.seed, index])  # depends on the chunk, not the process
        make = create_arrays_mlm if o.mlm_only else functools.partial(create_arrays_fast,
                                                                      short_seq_prob=o.short_seq_prob)
        arrays = make(
            chunk.tokens, chunk.sentence_offsets, chunk.document_offsets, seq_len=o.seq_len,
            max_predictions=o.max_predictions, masked_lm_prob=o.masked_lm_prob, dupe_factor=o.dupe_factor,
            vocab=self.vocab, rng=rng, whole_word=o.whole_word_mask)
        records = None
        if self.encoder is not None:  # the writer then only appends bytes
            records = self.encoder.encode(arrays, where=f"chunk {index}")
        return ChunkResult(arrays if records is None else None, records, len(arrays),
                           int(arrays.next_sentence_labels.sum()), len(chunk.document_offsets) - 1,
                           len(chunk.sentence_offsets) - 1, len(chunk.tokens),
                           chunk.empty_documents)


def _maker_key(options: CreateOptions, encoder: RecordEncoder | None) -> tuple:
    return options, None if encoder is None else encoder.layout


_WORKER: _ChunkMaker | None = None  # the chunk maker of a worker process


def _start_worker(vocab: Path, options: CreateOptions, encoder: RecordEncoder | None) -> None:
    global _WORKER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    if _WORKER is None or _WORKER.key != _maker_key(options, encoder):  # forked: the parent's
        _WORKER = _ChunkMaker(vocab, options, encoder)


def _run_chunk(index: int, ranges: Chunk, spool: str | None,
               num_files: int) -> ChunkResult:
    assert _WORKER is not None, "worker not initialised"
    result = _WORKER(index, ranges)
    if result.arrays is not None:
        result.arrays = _Compact.of(result.arrays)  # type: ignore[assignment]
    if result.records is not None and spool is not None:
        result.spooled = _Spooled.write(result.records, os.path.join(spool, f"{index}.part"),
                                        num_files)
        result.records = None
    return result


@dataclass
class _Compact:
    """Rows as a worker sends them back when not encoded: a third of the bytes to pickle and pipe.

    Token ids in 16 bits when they fit; the masks and weights follow from the
    lengths and the prediction counts, so only those travel.
    """

    input_ids: np.ndarray
    length: np.ndarray  # of [CLS] A [SEP] B [SEP]
    b_start: np.ndarray  # the first column of segment 1
    masked_lm_positions: np.ndarray
    masked_lm_ids: np.ndarray
    count: np.ndarray  # predictions per row
    next_sentence_labels: np.ndarray

    @classmethod
    def of(cls, arrays: PretrainingArrays) -> _Compact:
        ids = np.dtype(np.uint16 if int(arrays.input_ids.max(initial=0)) < 1 << 16 else np.int32)
        length = arrays.input_mask.sum(axis=1, dtype=np.int32)
        return cls(arrays.input_ids.astype(ids), length,
                   length - arrays.segment_ids.sum(axis=1, dtype=np.int32),
                   arrays.masked_lm_positions.astype(np.uint16), arrays.masked_lm_ids.astype(ids),
                   arrays.masked_lm_weights.sum(axis=1, dtype=np.int32).astype(np.uint8),
                   arrays.next_sentence_labels.astype(np.uint8))

    def arrays(self) -> PretrainingArrays:
        col = np.arange(self.input_ids.shape[1], dtype=np.int32)
        input_mask = col < self.length[:, None]
        used = np.arange(self.masked_lm_positions.shape[1]) < self.count[:, None]
        return PretrainingArrays(
            input_ids=self.input_ids.astype(np.int32),
            segment_ids=((col >= self.b_start[:, None]) & input_mask).view(np.int8),
            input_mask=input_mask.view(np.int8),
            masked_lm_positions=self.masked_lm_positions.astype(np.int32),
            masked_lm_ids=self.masked_lm_ids.astype(np.int32),
            masked_lm_weights=used.astype(np.float32),
            next_sentence_labels=self.next_sentence_labels.astype(np.int64))


def _default_start_method() -> str:
    # fork starts workers at once; spawn (elsewhere) re-imports bertforge in each.
    return "fork" if sys.platform == "linux" else "spawn"


def _fast_chunks(chunks: Iterator[Chunk], vocab: Path, options: CreateOptions,
                 encoder: RecordEncoder | None, workers: int, start_method: str | None,
                 spool: str | None = None, num_files: int = 1) -> Iterator[ChunkResult]:
    """Results in chunk order, made by ``workers`` processes: this one and workers - 1 others.

    This process is one of the workers rather than a dispatcher beside them:
    with as many workers as cores, a third busy process would take turns with
    them. Its own share of the work fills the time it would spend waiting: it
    makes a chunk itself whenever the others have IN_FLIGHT_PER_WORKER queued
    each and the next result is not ready. The others leave encoded records in
    ``spool`` (a directory), when given, grouped for ``num_files`` output files.
    """
    global _WORKER
    maker = _ChunkMaker(vocab, options, encoder)
    if workers <= 1:
        for index, ranges in enumerate(chunks):
            yield maker(index, ranges)
        return
    method = start_method or _default_start_method()
    if method == "fork":  # the workers get a copy of the tokenizer when forked
        _WORKER = maker
    queued_per_pool = IN_FLIGHT_PER_WORKER * (workers - 1)
    try:
        with ProcessPoolExecutor(workers - 1, mp_context=multiprocessing.get_context(method),
                                 initializer=_start_worker,
                                 initargs=(vocab, options, encoder)) as pool:
            # In chunk order: the pool's futures, and results (or errors) made here.
            pending: deque[Future[ChunkResult] | ChunkResult | Exception] = deque()
            try:
                for index, ranges in enumerate(chunks):
                    while pending and _is_ready(pending[0]):
                        yield _result(pending.popleft())
                    running = sum(isinstance(p, Future) and not p.done() for p in pending)
                    if running < queued_per_pool:
                        pending.append(pool.submit(_run_chunk, index, ranges, spool, num_files))
                    else:
                        try:
                            pending.append(maker(index, ranges))
                        except Exception as error:  # raised in order, as with one process
                            pending.append(error)
                            break
                    if len(pending) >= 2 * IN_FLIGHT_PER_WORKER * workers:  # bounds memory
                        yield _result(pending.popleft())
                while pending:
                    yield _result(pending.popleft())
            finally:
                for future in pending:
                    if isinstance(future, Future):
                        future.cancel()
    finally:
        _WORKER = None


def _is_ready(pending: Future[ChunkResult] | ChunkResult | Exception) -> bool:
    return not isinstance(pending, Future) or pending.done()


def _result(pending: Future[ChunkResult] | ChunkResult | Exception) -> ChunkResult:
    if isinstance(pending, Exception):
        raise pending
    return _unpack(pending.result()) if isinstance(pending, Future) else pending


def _unpack(result: ChunkResult) -> ChunkResult:
    if result.arrays is not None:
        result.arrays = result.arrays.arrays()  # type: ignore[attr-defined]
    return result


# ---------------------------------------------------------------- writing

def check_outputs(output: str | Path, num_output_files: int, overwrite: bool) -> list[Path]:
    """The output files, after refusing to replace existing ones unless ``overwrite``.

    Files of the output's name that this run would not write (``NAME.EXT`` or
    ``NAME-0000i-of-0000M.EXT`` of another count) are refused even so: they would
    be read with the new ones by a glob or directory, and they are not ours to delete.
    """
    paths = output_paths(output, num_output_files)
    output = Path(output)
    ours = re.compile(rf"{re.escape(output.stem)}(-\d{{5,}}-of-\d{{5,}})?{re.escape(output.suffix)}")
    existing = sorted(p for p in output.parent.glob("*") if ours.fullmatch(p.name)) if output.parent.is_dir() else []
    others = [p for p in existing if p not in paths]
    if others:
        raise DataError(f"{others[0]} has the name of --output {output} but is not one of the {len(paths)} "
                        f"file(s) this run writes ({len(others)} such file(s)): a glob or directory would read "
                        f"them with the new ones; remove them or choose another --output")
    if existing and not overwrite:
        which = "" if len(paths) == 1 else f" ({len(existing)} of the {len(paths)} output files)"
        raise DataError(f"{existing[0]} exists{which}; pass --overwrite to replace "
                        f"{'it' if len(existing) == 1 else 'them'}")
    if existing:
        refuse_live_runs(existing[0])  # all in one directory
    return paths


def output_paths(output: str | Path, num_output_files: int = 1) -> list[Path]:
    """``output`` itself, or ``NAME-00000-of-0000N.EXT`` … next to it."""
    named_as_directory = str(output).endswith(("/", os.sep))  # Path() drops the slash: dir/ would write a file dir
    output = Path(output)
    if output.is_dir() or named_as_directory:
        raise DataError(f"output {output}{os.sep if named_as_directory else ''} is a directory; give a file name "
                        f"(e.g. {output / 'train.tfrecord'})")
    if num_output_files < 1:
        raise DataError(f"num_output_files={num_output_files} must be at least 1")
    if num_output_files == 1:
        return [output]
    return [output.with_name(f"{output.stem}-{i:05d}-of-{num_output_files:05d}{output.suffix}")
            for i in range(num_output_files)]


class _RoundRobin:
    """Instance i of the whole run goes to file i mod N, as in the reference."""

    def __init__(self, writers: list[RecordWriter]):
        self.writers = writers
        self.count = 0

    def _first_rows(self, rows: int) -> Iterator[tuple[RecordWriter, slice]]:
        n = len(self.writers)
        for k, writer in enumerate(self.writers):
            first = (k - self.count) % n  # the first row of this batch that goes to file k
            if first < rows:
                yield writer, slice(first, None, n)
        self.count += rows

    def write(self, arrays: PretrainingArrays) -> None:
        for writer, rows in self._first_rows(len(arrays)):
            writer.write(arrays.take(rows))

    def write_encoded(self, records: EncodedRecords) -> None:
        for writer, rows in self._first_rows(len(records)):
            writer.write_encoded(records.take(rows))

    def write_spooled(self, spooled: _Spooled, layout: tuple) -> None:
        # Mapped, not read: the bytes are copied once, from the spool's pages to the output's.
        with open(spooled.path, "rb") as file, contextlib.ExitStack() as stack:
            os.unlink(spooled.path)  # before its pages are written back: disk sees only the output
            size = sum(spooled.group_bytes)
            data = (np.frombuffer(stack.enter_context(mmap.mmap(file.fileno(), size,
                                                                access=mmap.ACCESS_READ)), np.uint8)
                    if size else np.zeros(0, np.uint8))
            ends = np.cumsum(spooled.group_bytes)
            for writer, rows in self._first_rows(sum(spooled.group_counts)):
                group = rows.start  # the rows of the chunk that go to this file
                writer.write_encoded_bytes(layout, data[ends[group] - spooled.group_bytes[group]:
                                                        ends[group]],
                                           spooled.group_counts[group],
                                           spooled.group_max_ids[group])
            del data  # the map closes only when no array views it


# ---------------------------------------------------------------- the command

def create(inputs: Sequence[str | Path], vocab: str | Path, output: str | Path, *,
           seq_len: int = 128, max_predictions: int = 20, masked_lm_prob: float = 0.15,
           short_seq_prob: float = 0.1, dupe_factor: int = 5, seed: int = 12345,
           lowercase: bool = True, mode: str = "reference", workers: int = 1,
           fmt: str = "tfrecord", num_output_files: int = 1, chunk_chars: int = CHUNK_CHARS,
           start_method: str | None = None, text_column: str = "text",
           whole_word_mask: bool = False, mlm_only: bool = False) -> CreateStats:
    """Write pre-training records made from text files; see the module docstring.

    ``inputs`` are files, globs or directories, read in the order given, or
    tables (JSON Lines, Parquet, saved datasets) whose ``text_column`` holds a
    document per row (see :mod:`.text`).
    ``workers`` (fast mode) is the number of processes; ``start_method`` the
    multiprocessing start method (default: fork on Linux, else spawn).
    ``mlm_only``: full-sentence rows for masked LM alone (fast mode).
    """
    start = time.perf_counter()
    options = CreateOptions(seq_len, max_predictions, masked_lm_prob, short_seq_prob,
                            dupe_factor, seed, lowercase, whole_word_mask, mlm_only)
    if mode not in MODES:
        raise DataError(f"mode={mode!r} must be one of {', '.join(MODES)}")
    if mode == "reference" and mlm_only:
        raise DataError("mlm_only: google-research/bert's script makes sentence pairs only, so there is "
                        "no reference to match: use mode fast")
    if fmt not in FORMATS:
        raise DataError(f"format={fmt!r} must be one of {', '.join(FORMATS)}")
    if mode == "reference" and workers > 1:
        raise DataError(f"workers={workers}: reference mode runs in one process (use mode fast)")
    _check(options, mode, workers, chunk_chars)
    vocab = Path(vocab)
    made_with = _checked_vocab(vocab, options)  # a missing or empty vocab fails here, before any work
    files = expand_inputs(inputs, saved_datasets=True)
    paths = output_paths(output, num_output_files)
    stats = CreateStats(mode=mode, files=paths)

    with contextlib.ExitStack() as stack:
        # All files in a hidden directory first, renamed into place together when every one is
        # complete: a failure (a full disk at the fifth of eight) leaves none that looks whole.
        # A TFRecord's tokenizer goes into a sidecar beside it (RecordWriter), renamed into place with it.
        sidecars = [tokenizer_sidecar(path) for path in paths] if fmt == "tfrecord" else []
        staged = stack.enter_context(atomic_files(paths + sidecars, named=paths))[:len(paths)]
        writers = [stack.enter_context(RecordWriter(path, fmt, seq_len, max_predictions, vocab_size=made_with.size,
                                                    tokenizer=made_with.identity())) for path in staged]
        out = _RoundRobin(writers)
        if mode == "reference":
            _create_reference(files, vocab, options, out, stats, text_column)
        else:
            spool = None
            if workers > 1:  # workers leave their records here for us to append
                spool = stack.enter_context(tempfile.TemporaryDirectory(
                    prefix=f".{paths[0].name}.spool-", dir=staged[0].parent))
            encoder = writers[0].encoder
            # Closed before the spool goes: no worker writes into it any more.
            results = stack.enter_context(contextlib.closing(_generate(
                files, vocab, options, encoder, workers, chunk_chars, start_method, stats,
                spool, len(paths), text_column)))
            for result in results:
                if result.spooled is not None:
                    out.write_spooled(result.spooled, encoder.layout)
                else:
                    assert result.records is not None  # an encoder was given
                    out.write_encoded(result.records)
        stats.instances = out.count
        if stats.instances == 0:
            # Leaving the block by an exception discards the temporary files.
            raise DataError(f"{_names(files)}: the corpus is empty (no line with any token)")
    stats.seconds = time.perf_counter() - start
    return stats


def generate(inputs: Sequence[str | Path], vocab: str | Path, *, seq_len: int = 128,
             max_predictions: int = 20, masked_lm_prob: float = 0.15,
             short_seq_prob: float = 0.1, dupe_factor: int = 5, seed: int = 12345,
             lowercase: bool = True, workers: int = 1, chunk_chars: int = CHUNK_CHARS,
             start_method: str | None = None, stats: CreateStats | None = None,
             text_column: str = "text", whole_word_mask: bool = False,
             mlm_only: bool = False) -> Iterator[PretrainingArrays]:
    """Fast mode without files: each chunk's instances, in order, as :func:`create` writes them.

    ``stats``, when given, is updated as chunks come.
    """
    options = CreateOptions(seq_len, max_predictions, masked_lm_prob, short_seq_prob,
                            dupe_factor, seed, lowercase, whole_word_mask, mlm_only)
    _check(options, "fast", workers, chunk_chars)
    _checked_vocab(vocab, options)  # a missing or empty vocab fails here, before any work
    stats = stats if stats is not None else CreateStats(mode="fast", files=[])
    results = _generate(expand_inputs(inputs, saved_datasets=True), Path(vocab), options, None,
                        workers, chunk_chars, start_method, stats, text_column=text_column)

    def arrays() -> Iterator[PretrainingArrays]:
        for result in results:
            assert result.arrays is not None  # no encoder: chunks come as arrays
            yield result.arrays
    return arrays()


def _check(options: CreateOptions, mode: str, workers: int, chunk_chars: int) -> None:
    options.check()
    warn_prediction_cap(options.seq_len, options.max_predictions, options.masked_lm_prob, "data create")
    if workers < 1:
        raise DataError(f"workers={workers} must be at least 1")
    if mode == "fast" and options.seed < 0:
        raise DataError(f"seed={options.seed} must be at least 0 in fast mode")
    if chunk_chars < 1:
        raise DataError(f"chunk_chars={chunk_chars} must be at least 1")


def _checked_vocab(vocab: str | Path, options: CreateOptions) -> Vocabulary:
    """The vocab, read once in the parent (the workers read it again) and checked: it has the
    special tokens the records need."""
    vocabulary = load_vocab(vocab)
    vocabulary.special_ids()  # raises, naming the file and the missing token
    if options.whole_word_mask:
        vocabulary.check_word_pieces("data create --whole-word-mask")
    return vocabulary


def _generate(files: list[Path], vocab: Path, options: CreateOptions,
              encoder: RecordEncoder | None, workers: int, chunk_chars: int,
              start_method: str | None, stats: CreateStats, spool: str | None = None,
              num_files: int = 1, text_column: str = "text",
              ) -> Generator[ChunkResult, None, None]:  # closed by create()
    chunks = input_chunks(files, chunk_chars, MIN_CHUNK_DOCS, text_column)
    single = 0  # chunks of one document (only when the corpus has fewer than MIN_CHUNK_DOCS)
    for result in _fast_chunks(chunks, vocab, options, encoder, workers, start_method, spool,
                               num_files):
        single += result.documents == 1
        stats.chunks += 1
        stats.documents += result.documents
        stats.sentences += result.sentences
        stats.tokens += result.tokens
        stats.empty_documents += result.empty_documents
        stats.instances += result.instances
        stats.next_sentence_random += result.next_sentence_random
        yield result
    if single:
        warn_one_document(_names(files), "" if stats.chunks == 1 else
                          f" in {single} of its {stats.chunks} chunks (fast mode pairs within a chunk)")


def _names(files: Sequence[Path]) -> str:
    """The input files, for a message: the first three."""
    return ", ".join(map(str, files[:3])) + (" …" if len(files) > 3 else "")


def _create_reference(files: list[Path], vocab: Path, options: CreateOptions, out: _RoundRobin,
                      stats: CreateStats, text_column: str = "text") -> None:
    """The whole corpus at once, as google-research/bert's create_pretraining_data.py."""
    vocabulary = load_vocab(vocab)
    documents = list(input_documents(files, text_column))
    chunk = vocabulary.encode_documents(documents, options.lowercase)
    del documents
    stats.documents = len(chunk.document_offsets) - 1
    stats.sentences = len(chunk.sentence_offsets) - 1
    stats.tokens = len(chunk.tokens)
    stats.empty_documents = chunk.empty_documents
    if stats.documents == 1:
        warn_one_document(_names(files))
    instances = create_instances(
        chunk.as_lists(), seq_len=options.seq_len, max_predictions=options.max_predictions,
        masked_lm_prob=options.masked_lm_prob, short_seq_prob=options.short_seq_prob,
        dupe_factor=options.dupe_factor, vocab=vocabulary, rng=random.Random(options.seed),
        whole_word=options.whole_word_mask)
    del chunk
    for first in range(0, len(instances), REFERENCE_WRITE_BATCH):
        batch = instances[first:first + REFERENCE_WRITE_BATCH]
        arrays = to_arrays(batch, options.seq_len, options.max_predictions)
        stats.next_sentence_random += int(arrays.next_sentence_labels.sum())
        out.write(arrays)


# ---------------------------------------------------------------- command line

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``bertforge data create``."""
    parser.add_argument("--input", nargs="+", required=True, metavar="PATH",
                        help="text files, globs or directories of *.txt (read in this order); or "
                             "tables, one document per row: .jsonl, .jsonl.gz, .parquet, or a "
                             "directory written by datasets' save_to_disk")
    parser.add_argument("--text-column", default="text",
                        help="the column of tables that holds the text (default: text)")
    parser.add_argument("--vocab", required=True,
                        help="vocab.txt (WordPiece, one token per line) or tokenizer.json (Hugging Face "
                             "tokenizers, e.g. a byte-level BPE as ModernBERT's)")
    parser.add_argument("--output", required=True,
                        help="output file (with --num-output-files N: NAME-0000i-of-0000N.EXT)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--max-predictions", type=int, default=20)
    parser.add_argument("--masked-lm-prob", type=float, default=0.15)
    parser.add_argument("--short-seq-prob", type=float, default=0.1)
    parser.add_argument("--dupe-factor", type=int, default=5)
    parser.add_argument("--seed", type=int, default=12345)
    parser.add_argument("--cased", action="store_true",
                        help="do not lower-case (cased vocab.txt; a tokenizer.json's own normalizer decides)")
    parser.add_argument("--whole-word-mask", action="store_true",
                        help="mask all pieces of a word or none (the reference's --do_whole_word_mask; "
                             "for a tokenizer.json, a word starts at a token with the space marker Ġ)")
    parser.add_argument("--mlm-only", action="store_true",
                        help="masked LM alone (train.objective mlm): rows of whole sentences of "
                             "contiguous text, across documents, no sentence pairs (needs --mode fast)")
    parser.add_argument("--mode", choices=MODES, default="reference",
                        help="reference: google-research/bert's records exactly; "
                             "fast: same distributions, streaming, parallel")
    parser.add_argument("--workers", type=int, default=1, help="processes (fast mode)")
    parser.add_argument("--format", dest="fmt", choices=("tfrecord", "native"), default="tfrecord")
    parser.add_argument("--num-output-files", type=int, default=1)
    parser.add_argument("--overwrite", action="store_true",
                        help="replace output files that exist (refused otherwise, and in a live run's directory)")
    parser.add_argument("--pack", type=int, default=0, metavar="N",
                        help="pack up to N sequences per record (see `bertforge data pack`)")
    parser.add_argument("--chunk-chars", type=int, default=CHUNK_CHARS,
                        help="fast mode: bytes of text per chunk")


def run(args: argparse.Namespace) -> int:
    """Run ``bertforge data create`` from parsed arguments; print a one-line summary
    (and, with ``--pack N``, one for the packing: see :mod:`.packing`)."""
    from .packing import packing_to

    load_vocab(args.vocab)  # a missing vocab is named before an existing output
    final = check_outputs(args.output, args.num_output_files, args.overwrite)
    with (packing_to(args.output, final, args.pack, seed=args.seed, fmt=args.fmt) if args.pack
          else contextlib.nullcontext((args.output, None))) as (output, packed):
        stats = create(args.input, args.vocab, output, seq_len=args.seq_len,
                       max_predictions=args.max_predictions, masked_lm_prob=args.masked_lm_prob,
                       short_seq_prob=args.short_seq_prob, dupe_factor=args.dupe_factor,
                       seed=args.seed, lowercase=not args.cased, mode=args.mode,
                       workers=args.workers, fmt=args.fmt, num_output_files=args.num_output_files,
                       chunk_chars=args.chunk_chars, text_column=args.text_column,
                       whole_word_mask=args.whole_word_mask, mlm_only=args.mlm_only)
    stats.files = final
    print(stats.summary())
    if packed is not None:
        print(f"packed: {packed.summary()}")
    return 0

