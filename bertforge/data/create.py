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
  Each chunk is also encoded where it is made (:class:`.records.RecordEncoder`):
  with ``workers`` > 1 each worker process reads its chunk's byte ranges itself and
  leaves finished record bytes in a spool file, and the parent, one of the
  workers itself, scans the input for cut points and appends those bytes to the files.

Tokenization gives the ids of :func:`.tokenizer.encode_texts` (the reference
``FullTokenizer``'s), found with numpy and a cache (:class:`FastWordPiece`).

Output: ``num_output_files`` files in ``fmt`` (``tfrecord`` with the reference
feature schema, or ``native``), filled round-robin as the reference does. One
file is ``output`` itself; several are ``NAME-00000-of-00004.EXT`` next to it.
Every file is written under a temporary name and renamed when complete.

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
import glob
import mmap
import multiprocessing
import os
import random
import re
import string
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import DataError
from .instances import PretrainingArrays, create_arrays_fast, create_instances, to_arrays
from .records import FORMATS, EncodedRecords, RecordEncoder, RecordWriter
from .tokenizer import MAX_WORD_CHARS, encode_texts, read_vocab, special_ids, tokenizer_for_vocab

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


# ---------------------------------------------------------------- reading text

def expand_inputs(inputs: Iterable[str | Path],
                  directory_pattern: str | None = "*.txt") -> list[Path]:
    """Files named by paths, globs or directories (their ``directory_pattern`` files), in order.

    A glob's matches and a directory's files are sorted. Nothing matched is an error.
    """
    files: list[Path] = []
    for item in inputs:
        text = str(item)
        path = Path(text)
        if path.is_dir():
            if directory_pattern is None:
                raise DataError(f"{path} is a directory; name the files")
            found = sorted(path.glob(directory_pattern))
            if not found:
                raise DataError(f"{path}: no {directory_pattern} files in this directory")
        elif path.is_file():
            found = [path]
        else:
            found = [Path(p) for p in sorted(glob.glob(text)) if Path(p).is_file()]
            if not found:
                raise DataError(f"input not found: {text}")
        files.extend(found)
    if not files:
        raise DataError("no input files given")
    return files


def read_documents(files: Sequence[Path], block_bytes: int = 1 << 22) -> Iterator[list[str]]:
    """Documents (lists of stripped, non-blank lines) as the reference reads them, streaming.

    A document continues across files unless a blank line ends it. Bytes that
    are not UTF-8 are an error naming the file and byte offset.
    """
    return _read_ranges([(str(path), 0, None) for path in files], block_bytes)


def _read_ranges(ranges: Sequence[tuple[str, int, int | None]],
                 block_bytes: int = 1 << 22) -> Iterator[list[str]]:
    """:func:`read_documents` of byte ranges ``(path, start, stop)`` (``stop`` None: to the end).

    Each range must start at a line start, and its first document continues the
    previous range's last one as across files.
    """
    current: list[str] = []
    for path, start, stop in ranges:
        with open(path, "rb") as handle:
            handle.seek(start)
            offset = start  # of the first byte not decoded yet
            left = None if stop is None else stop - start
            rest = b""
            while True:
                block = handle.read(block_bytes if left is None else min(block_bytes, left))
                if left is not None:
                    left -= len(block)
                data = rest + block
                if block:  # decode whole lines only: up to the last "\n"
                    cut = data.rfind(b"\n") + 1
                    if not cut:
                        rest = data
                        continue
                elif data:  # the end of the range: its last line may have no "\n"
                    cut = len(data)
                else:
                    break
                try:
                    text = data[:cut].decode("utf-8")
                except UnicodeDecodeError as err:
                    raise DataError(f"{path}: not valid UTF-8 at byte offset "
                                    f"{offset + err.start}") from None
                offset += cut
                rest = data[cut:]
                lines = text.split("\n")  # at "\n" only, as TensorFlow's GFile does
                if text.endswith("\n"):
                    lines.pop()  # the empty string after the last "\n"
                for line in lines:
                    line = line.strip()
                    if line:
                        current.append(line)
                    elif current:
                        yield current
                        current = []
                if not block:
                    break
    if current:
        yield current


# A line break, then a blank line of ASCII whitespace only: str.strip() removes all of it,
# so a document ends there (a line of other Unicode spaces is blank too, but is no cut point).
# The leading "\n" gives the regex a literal to search for: ten times faster than "^".
_BLANK_LINE = re.compile(rb"\n[ \t\r\x0b\x0c]*\n")
_NOT_SPACE = re.compile(rb"[^ \t\r\x0b\x0c\n]")

Range = tuple[str, int, int | None]  # (path, start, stop) of input bytes; stop None: to the end


def chunk_ranges(files: Sequence[Path], chunk_bytes: int = CHUNK_CHARS,
                 min_docs: int = MIN_CHUNK_DOCS, block_bytes: int = 1 << 22) -> Iterator[list[Range]]:
    """The input cut after blank lines into chunks of at least ``chunk_bytes`` bytes and
    ``min_docs`` documents each, as byte ranges for :func:`_read_ranges`.

    Only bytes are scanned (a regex, no decoding, no Python per line), so a parent
    of worker processes stays nearly idle: each worker reads its own text. The
    document count is exact for ASCII blank lines; it only sizes chunks, and cuts
    are always at true document ends. A short remainder at the end joins the last
    chunk rather than stand alone, so that its documents still have others to draw
    random next sentences from; a remainder of blank lines only is dropped.
    """
    held: list[Range] | None = None  # a full chunk, kept until we know whether more follows
    done: list[Range] = []  # the current chunk's ranges in earlier files
    size = docs = 0  # bytes of the current chunk in earlier files; its documents so far
    in_document = False  # a non-blank line since the last document end
    for path in map(str, files):
        start = 0  # of the current chunk in this file
        with open(path, "rb") as handle:
            base = 0  # the file offset of data[0]
            rest = b""  # the last line break seen and the partial line after it
            while True:
                block = handle.read(block_bytes)
                data = rest + block
                if not block:  # the file's last line, when it has no "\n", may be blank
                    tail = data[data.rfind(b"\n") + 1:]
                    if _NOT_SPACE.search(tail):
                        in_document = True
                    elif tail and in_document:
                        in_document, docs = False, docs + 1
                    base += len(data)
                    break
                cut = data.rfind(b"\n") + 1  # whole lines only
                scanned = 0
                for blank in _BLANK_LINE.finditer(data, 0, cut):
                    if in_document or _NOT_SPACE.search(data, scanned, blank.start()):
                        in_document, docs = False, docs + 1
                        end = base + blank.end()
                        if size + end - start >= chunk_bytes and docs >= min_docs:
                            if held is not None:
                                yield held
                            held, done, size, docs, start = done + [(path, start, end)], [], 0, 0, end
                    scanned = blank.end()
                if _NOT_SPACE.search(data, scanned, cut):
                    in_document = True
                keep = max(cut - 1, 0)  # from the last "\n": a blank line may follow it
                base, rest = base + keep, data[keep:]
        if base > start:
            done.append((path, start, base))
            size += base - start
    docs += in_document
    if held is not None and docs and docs < min_docs:
        yield held + done
    else:
        if held is not None:
            yield held
        if docs:
            yield done


# ---------------------------------------------------------------- tokenizing

_SPACE, _ALNUM, _PUNCT, _OTHER = 0, 1, 2, 3  # byte classes
# Python whitespace beyond ASCII that BERT also splits at (category Zs, and the
# line and paragraph separators, which its str.split() splits at).
_UNICODE_SPACES = ("\u00a0\u1680" + "".join(map(chr, range(0x2000, 0x200b)))
                   + "\u2028\u2029\u202f\u205f\u3000")
_LOW_BYTES = np.array([(1 << (8 * k)) - 1 for k in range(8)] + [(1 << 64) - 1], np.uint64)
_MIX = np.uint64(0x9E3779B97F4A7C15)
_MIX2 = np.uint64(0xC2B2AE3D27D4EB4F)
MAX_CACHED_UNITS = 1 << 18  # about 40 MB of cache at most


def _whole_words(tokens: Iterable[str], lowercase: bool) -> list[str]:
    """The vocab tokens that are one whole unit of an ASCII piece (as lower-cased, if so), once each.

    That is a run of up to 16 letters and digits (no capital for uncased
    vocabs), or one punctuation character: every printable non-alphanumeric
    ASCII character. One regex over all the tokens: a vocab is ~30,000 lines.
    """
    letters = "a-z0-9" if lowercase else "A-Za-z0-9"
    word = re.compile(rf"^(?:[{letters}]{{1,16}}|[{re.escape(string.punctuation)}])$", re.MULTILINE)
    return list(dict.fromkeys(word.findall("\n".join(tokens))))


def _mark_unicode_spaces(byte: np.ndarray, classes: np.ndarray) -> None:
    """Class the UTF-8 bytes of the characters of _UNICODE_SPACES as spaces."""
    padded = np.concatenate([byte, np.zeros(2, np.uint8)])
    leads = np.flatnonzero((byte == 0xC2) | ((byte >= 0xE1) & (byte <= 0xE3)))
    for pattern in _UNICODE_SPACE_BYTES:
        at = leads
        for k, value in enumerate(pattern):
            at = at[padded[at + k] == value]
        for k in range(len(pattern)):
            classes[at + k] = _SPACE


def _byte_classes() -> np.ndarray:
    classes = np.full(256, _OTHER, np.uint8)  # non-ASCII bytes and control characters
    classes[[9, 10, 13, 32]] = _SPACE
    classes[33:127] = _PUNCT  # BERT counts every printable non-alphanumeric ASCII as punctuation
    for first, last in ("09", "az", "AZ"):
        classes[ord(first):ord(last) + 1] = _ALNUM
    return classes


_CLASSES = _byte_classes()
_CLASS_BYTES = _CLASSES.tobytes()  # for bytes.translate
_LOWER_BYTES = bytes(range(65)) + bytes(range(97, 123)) + bytes(range(91, 256))
_UNICODE_SPACE_BYTES = [c.encode("utf-8") for c in _UNICODE_SPACES]


class _UnitTable:
    """Open-addressing hash table from packed unit bytes (two uint64) to entry numbers, in numpy.

    Each slot is one row (key1, key2, entry + 1; 0 = empty), so a probe is one
    memory access. Every operation handles a whole array of keys at once;
    linear probing, at most half full.
    """

    def __init__(self, bits: int = 16):
        self.bits = bits
        self.slots = np.zeros((1 << bits, 3), np.uint64)
        self.count = 0

    def _home(self, key1: np.ndarray, key2: np.ndarray) -> np.ndarray:
        mixed = (key1 ^ (key2 * _MIX)) * _MIX2
        return (mixed >> np.uint64(64 - self.bits)).astype(np.int64)

    def lookup(self, key1: np.ndarray, key2: np.ndarray) -> np.ndarray:
        """The entry of each key, -1 where absent."""
        slot = self._home(key1, key2)
        row = self.slots[slot]
        # Most keys sit in their home slot: settle those without index lists.
        found = (row[:, 0] == key1) & (row[:, 1] == key2)
        result = np.where(found, row[:, 2].view(np.int64) - 1, -1)
        todo = np.flatnonzero(~found & (row[:, 2] > 0))  # another key sits there: probe on
        mask = (1 << self.bits) - 1
        while len(todo):
            slot[todo] = (slot[todo] + 1) & mask
            row = self.slots[slot[todo]]
            filled = row[:, 2] > 0
            match = filled & (row[:, 0] == key1[todo]) & (row[:, 1] == key2[todo])
            result[todo[match]] = row[match, 2].view(np.int64) - 1
            todo = todo[filled & ~match]
        return result

    def insert(self, key1: np.ndarray, key2: np.ndarray,
               first_entry: int) -> tuple[np.ndarray, np.ndarray]:
        """Add absent keys, repeats allowed: (the entry of each key, the indices of the new ones).

        New keys get entries first_entry, first_entry + 1, … in the order of the
        second array.
        """
        if 2 * (self.count + len(key1)) > len(self.slots):
            self._grow(self.count + len(key1))
        result = np.full(len(key1), -1, np.int64)
        slot = self._home(key1, key2)
        todo = np.arange(len(key1))
        mask = (1 << self.bits) - 1
        claim = np.full(len(self.slots), -1, np.int64)
        added: list[np.ndarray] = []
        next_entry = first_entry
        while len(todo):
            s = slot[todo]
            row = self.slots[s]
            filled = row[:, 2] > 0
            match = filled & (row[:, 0] == key1[todo]) & (row[:, 1] == key2[todo])
            result[todo[match]] = row[match, 2].astype(np.int64) - 1
            # Keys that meet an empty slot claim it; of several, the last one written wins.
            wanting, at = todo[~filled], s[~filled]
            claim[at] = wanting
            won = claim[at] == wanting
            winners, won_at = wanting[won], at[won]
            new = np.arange(next_entry, next_entry + len(winners))
            next_entry += len(winners)
            self.slots[won_at] = np.stack([key1[winners], key2[winners],
                                           (new + 1).astype(np.uint64)], axis=1)
            result[winners] = new
            added.append(winners)
            probing = todo[filled & ~match]
            slot[probing] = (slot[probing] + 1) & mask
            todo = np.concatenate([probing, wanting[~won]])  # losers meet the winner's key next
        self.count += next_entry - first_entry
        return result, np.concatenate(added) if added else np.zeros(0, np.int64)

    def _grow(self, count: int) -> None:
        old = self.slots[self.slots[:, 2] > 0]
        self.__init__(max(self.bits + 1, (4 * count - 1).bit_length()))  # a quarter full
        self.insert(old[:, 0], old[:, 1], 0)  # distinct keys: they land in a free slot each
        self.slots[self._positions(old[:, 0], old[:, 1]), 2] = old[:, 2]  # their own entries

    def _positions(self, key1: np.ndarray, key2: np.ndarray) -> np.ndarray:
        """The slots of keys that are present."""
        slot = self._home(key1, key2)
        todo = np.arange(len(key1))
        mask = (1 << self.bits) - 1
        while len(todo):
            row = self.slots[slot[todo]]
            todo = todo[(row[:, 0] != key1[todo]) | (row[:, 1] != key2[todo])]
            slot[todo] = (slot[todo] + 1) & mask
        return slot


class FastWordPiece:
    """BERT WordPiece ids of many lines at once, with numpy and a cache of units.

    BERT's tokenizer works within whitespace-separated pieces: cleaning,
    lower-casing, accent stripping, punctuation and CJK splitting and WordPiece
    are all local to a piece. So a line's ids are the ids of its units in order,
    where a unit is

    * in a piece of printable ASCII: a run of letters and digits, or one
      punctuation character (BERT's words there), lower-cased for uncased
      vocabs, and looked up in the vocab or split by the WordPiece model;
    * any other piece whole (non-ASCII, control characters), through
      :func:`.tokenizer.encode_texts` (the reference's cleaning and lower-casing,
      then the full ``tokenizers`` pipeline).

    Units are found with array operations on the UTF-8 bytes and looked up in a
    cache by their bytes: up to 16 bytes packed exactly into two integers (a
    numpy hash table, seeded with the vocab's words), longer ones as ``bytes``
    in a dict. Only units never seen before reach Python. The cache is cleared
    when it holds ``max_units`` entries, which bounds memory; the ids never
    depend on it. Tests compare the result with
    :func:`.tokenizer.tokenize_documents` and the reference ``FullTokenizer``,
    on the shared Wikipedia dump (raw and as text), SQuAD and odd characters.
    """

    def __init__(self, vocab_path: str | Path, lowercase: bool = True,
                 max_units: int = MAX_CACHED_UNITS):
        tokens = read_vocab(vocab_path)
        self.vocab_size = len(tokens)  # lines of vocab.txt: the model's vocab_size
        # A duplicated token keeps its last id, as in BERT's load_vocab and load_tokenizer.
        self.vocab = {token: i for i, token in enumerate(tokens)}
        self.tokenizer = tokenizer_for_vocab(self.vocab, lowercase, vocab_path)
        self.specials = special_ids(self.tokenizer)
        self.lowercase = lowercase
        self.max_units = max_units
        # Whole words of the vocab are units with one id each: known without asking WordPiece.
        self._seed = _whole_words(self.vocab, lowercase)
        self._clear()

    def _clear(self) -> None:
        self._table = _UnitTable(max(16, (4 * len(self._seed)).bit_length()))  # units ≤ 16 bytes
        self._long: dict[bytes, int] = {}  # longer units
        # Entry e's ids are _ids[_start[e]:_start[e] + _len[e]].
        self._ids = np.zeros(1 << 16, np.int32)
        self._start = np.zeros(1 << 12, np.int64)
        self._len = np.zeros(1 << 12, np.int64)
        self._entries = 0
        self._used_ids = 0
        if self._seed:
            units = _Units("\n".join(self._seed), lowercase=False)
            assert len(units.starts) == len(self._seed)
            key1, key2 = units.keys(np.arange(len(self._seed)))
            _, new = self._table.insert(key1, key2, 0)  # entries in the order of `new`
            ids = np.array([self.vocab[self._seed[k]] for k in new.tolist()], np.int32)
            self._store(np.ones(len(ids), np.int64), ids)

    def _new_entries(self, ids: list[list[int]]) -> None:
        """Store the ids of new units, as the next entries."""
        lengths = np.fromiter(map(len, ids), np.int64, len(ids))
        self._store(lengths, np.fromiter((i for unit in ids for i in unit), np.int32,
                                         int(lengths.sum())))

    def _store(self, lengths: np.ndarray, flat: np.ndarray) -> None:
        first, count = self._entries, len(lengths)
        if first + count > len(self._start):
            size = max(first + count, 2 * len(self._start))
            self._start, self._len = np.resize(self._start, size), np.resize(self._len, size)
        end = self._used_ids + len(flat)
        if end > len(self._ids):
            self._ids = np.resize(self._ids, max(end, 2 * len(self._ids)))
        self._ids[self._used_ids:end] = flat
        self._start[first:first + count] = self._used_ids + np.cumsum(lengths) - lengths
        self._len[first:first + count] = lengths
        self._entries, self._used_ids = first + count, end

    def _unit_ids(self, texts: list[str], whole: list[bool]) -> list[list[int]]:
        """Ids of new units: words of ASCII pieces, or whole other pieces."""
        result: list[list[int]] = []
        others: list[int] = []
        vocab, model = self.vocab, self.tokenizer.model
        for k, (word, is_whole) in enumerate(zip(texts, whole)):
            if is_whole:
                others.append(k)
                result.append([])
                continue
            found = vocab.get(word) if len(word) <= MAX_WORD_CHARS else None
            result.append([found] if found is not None else [t.id for t in model.tokenize(word)])
        # Python's cleaning and lower-casing first, as the reference (a final capital sigma,
        # private-use characters): whitespace bounds their context, so a piece is enough.
        for k, ids in zip(others, encode_texts(self.tokenizer, [texts[k] for k in others])):
            result[k] = ids
        return result

    def encode_lines(self, lines: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(all token ids of the lines, concatenated; the number of ids of each line).

        Lines must not contain "\\n".
        """
        units = _Units("\n".join(lines), self.lowercase)
        if self._entries > self.max_units:
            self._clear()  # bound memory; the ids do not depend on what is cached
        entry = np.full(len(units.starts), -1, np.int64)
        short = np.flatnonzero(units.length <= 16)
        if len(short):
            key1, key2 = units.keys(short)
            entry[short] = self._table.lookup(key1, key2)
            missing = np.flatnonzero(entry[short] < 0)
            if len(missing):
                found, new = self._table.insert(key1[missing], key2[missing], self._entries)
                entry[short[missing]] = found
                first = short[missing[new]]
                self._new_entries(self._unit_ids(units.texts(first), units.whole[first].tolist()))
        long = np.flatnonzero(units.length > 16)
        if len(long):
            raws = units.raw(long)
            new_raws = {raw: bool(w) for raw, w in zip(raws, units.whole[long].tolist())
                        if raw not in self._long}
            if new_raws:
                texts = [raw.decode("utf-8") for raw in new_raws]
                self._long.update(zip(new_raws, range(self._entries, self._entries + len(texts))))
                self._new_entries(self._unit_ids(texts, list(new_raws.values())))
            entry[long] = [self._long[raw] for raw in raws]

        counts, first_id = self._len[entry], self._start[entry]
        total = int(counts.sum())
        # Gather every unit's ids: id t of unit k is _ids[first_id[k] + t].
        ids = self._ids[np.repeat(first_id - np.cumsum(counts) + counts, counts) + np.arange(total)]
        line_lengths = np.bincount(units.line, weights=counts, minlength=len(lines))
        return ids, line_lengths.astype(np.int64)

    def encode_documents(self, documents: list[list[str]]) -> TokenizedChunk:
        """Documents as flat arrays; lines without tokens and documents without lines dropped."""
        lines = [line for document in documents for line in document]
        ids, line_lengths = self.encode_lines(lines)
        kept = line_lengths > 0
        doc_of_line = np.repeat(np.arange(len(documents)), [len(d) for d in documents])
        lines_per_doc = np.bincount(doc_of_line[kept], minlength=len(documents))
        lines_per_doc_kept = lines_per_doc[lines_per_doc > 0]
        return TokenizedChunk(
            tokens=ids,
            sentence_offsets=np.concatenate([[0], np.cumsum(line_lengths[kept])]).astype(np.int64),
            document_offsets=np.concatenate([[0], np.cumsum(lines_per_doc_kept)]).astype(np.int64),
            empty_documents=int((lines_per_doc == 0).sum()))


class _Units:
    """The units of a text (see :class:`FastWordPiece`), found by array operations on its bytes."""

    def __init__(self, text: str, lowercase: bool):
        data = text.encode("utf-8")
        if lowercase:  # ASCII only; the full pipeline lower-cases the rest
            data = data.translate(_LOWER_BYTES)
        n = len(data)
        self.buffer = buffer = np.zeros(n + 16, np.uint8)  # zero padding: 8-byte reads past the end
        buffer[:n] = np.frombuffer(data, np.uint8)
        classes = np.frombuffer(data.translate(_CLASS_BYTES), np.uint8).copy()
        if not text.isascii():
            _mark_unicode_spaces(buffer[:n], classes)
        previous = np.empty_like(classes)
        previous[:1], previous[1:] = _SPACE, classes[:-1]
        solid = classes != _SPACE
        piece_start = solid & (previous == _SPACE)
        word_start = (classes == _PUNCT) | ((classes == _ALNUM) & (previous != _ALNUM))
        other = np.flatnonzero(classes == _OTHER)
        in_whole = None
        if len(other):  # pieces with a non-ASCII or control byte are units whole
            piece_of_byte = np.cumsum(piece_start, dtype=np.int32) - 1
            whole_piece = np.zeros(int(piece_of_byte[-1]) + 2, bool)  # [-1]: before any piece
            whole_piece[piece_of_byte[other]] = True
            in_whole = whole_piece[piece_of_byte]
            word_start &= ~in_whole
        unit_start = piece_start | word_start
        self.starts = np.flatnonzero(unit_start)
        last = solid.copy()  # the last byte of a unit: the next one starts a unit or is a space
        last[:-1] &= unit_start[1:] | ~solid[1:]
        self.length = np.flatnonzero(last) - self.starts + 1
        self.whole = (in_whole[self.starts] if in_whole is not None
                      else np.zeros(len(self.starts), bool))
        # The line of each unit: how many newlines come before it (every line has a unit).
        after_newline = np.searchsorted(self.starts, np.flatnonzero(buffer[:n] == 10))
        self.line = np.cumsum(np.bincount(after_newline, minlength=len(self.starts) + 1)[:-1])

    def keys(self, units: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Units of up to 16 bytes packed exactly into two integers (the padding is zeros)."""
        n = len(self.buffer) - 16
        eight = np.ndarray((n,), "<u8", self.buffer, strides=(1,))  # 8 bytes from each offset
        s, m = self.starts[units], self.length[units]
        key1 = eight[s] & _LOW_BYTES[np.minimum(m, 8)]
        key2 = eight[np.minimum(s + 8, n - 1)] & _LOW_BYTES[np.clip(m - 8, 0, 8)]
        return key1, key2

    def raw(self, units: np.ndarray) -> list[bytes]:
        return [self.buffer[s:s + m].tobytes()
                for s, m in zip(self.starts[units].tolist(), self.length[units].tolist())]

    def texts(self, units: np.ndarray) -> list[str]:
        """The units as strings, decoded in one go."""
        if not len(units):
            return []
        starts, lengths = self.starts[units], self.length[units]
        # Gather the units' bytes with a "\\n" after each (no unit holds one), then split.
        within = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        target = np.repeat(np.cumsum(lengths + 1) - (lengths + 1), lengths) + within
        joined = np.full(int((lengths + 1).sum()) - 1, 10, np.uint8)
        joined[target] = self.buffer[np.repeat(starts, lengths) + within]
        return joined.tobytes().decode("utf-8").split("\n")


@dataclass
class TokenizedChunk:
    """Documents as flat arrays: see :func:`.instances.create_arrays_fast`."""

    tokens: np.ndarray
    sentence_offsets: np.ndarray
    document_offsets: np.ndarray
    empty_documents: int

    def as_lists(self) -> list[list[list[int]]]:
        """Token ids per sentence per document (the reference's layout)."""
        tokens, sentences = self.tokens.tolist(), self.sentence_offsets.tolist()
        bounds = self.document_offsets.tolist()
        return [[tokens[sentences[s]:sentences[s + 1]] for s in range(bounds[d], bounds[d + 1])]
                for d in range(len(bounds) - 1)]


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
                file.write(group.data)
        return cls(path, [len(g.data) for g in groups], [len(g) for g in groups],
                   [int(g.max_ids.max(initial=-1)) for g in groups])


class _ChunkMaker:
    """Tokenizes, draws and (given an encoder) encodes the instances of one chunk; one per process."""

    def __init__(self, vocab: Path, options: CreateOptions, encoder: RecordEncoder | None):
        self.options = options
        self.encoder = encoder
        self.key = _maker_key(options, encoder)
        self.tokenizer = FastWordPiece(vocab, options.lowercase)

    def __call__(self, index: int, ranges: list[Range]) -> ChunkResult:
        o = self.options
        chunk = self.tokenizer.encode_documents(list(_read_ranges(ranges)))
        rng = np.random.default_rng([o.seed, index])  # depends on the chunk, not the process
        arrays = create_arrays_fast(
            chunk.tokens, chunk.sentence_offsets, chunk.document_offsets, seq_len=o.seq_len,
            max_predictions=o.max_predictions, masked_lm_prob=o.masked_lm_prob,
            short_seq_prob=o.short_seq_prob, dupe_factor=o.dupe_factor,
            vocab_size=self.tokenizer.vocab_size, specials=self.tokenizer.specials, rng=rng)
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


def _run_chunk(index: int, ranges: list[Range], spool: str | None,
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


def _fast_chunks(chunks: Iterator[list[Range]], vocab: Path, options: CreateOptions,
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

def output_paths(output: str | Path, num_output_files: int = 1) -> list[Path]:
    """``output`` itself, or ``NAME-00000-of-0000N.EXT`` … next to it."""
    output = Path(output)
    if output.is_dir():
        raise DataError(f"output {output} is a directory; give a file name")
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
            writer.write(_rows(arrays, rows))

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


def _rows(arrays: PretrainingArrays, rows: slice) -> PretrainingArrays:
    if rows == slice(0, None, 1):
        return arrays
    return PretrainingArrays(**{name: value[rows] for name, value in vars(arrays).items()})


# ---------------------------------------------------------------- the command

def create(inputs: Sequence[str | Path], vocab: str | Path, output: str | Path, *,
           seq_len: int = 128, max_predictions: int = 20, masked_lm_prob: float = 0.15,
           short_seq_prob: float = 0.1, dupe_factor: int = 5, seed: int = 12345,
           lowercase: bool = True, mode: str = "reference", workers: int = 1,
           fmt: str = "tfrecord", num_output_files: int = 1, chunk_chars: int = CHUNK_CHARS,
           start_method: str | None = None) -> CreateStats:
    """Write pre-training records made from text files; see the module docstring.

    ``inputs`` are files, globs or directories, read in the order given.
    ``workers`` (fast mode) is the number of processes; ``start_method`` the
    multiprocessing start method (default: fork on Linux, else spawn).
    """
    start = time.perf_counter()
    options = CreateOptions(seq_len, max_predictions, masked_lm_prob, short_seq_prob,
                            dupe_factor, seed, lowercase)
    if mode not in MODES:
        raise DataError(f"mode={mode!r} must be one of {', '.join(MODES)}")
    if fmt not in FORMATS:
        raise DataError(f"format={fmt!r} must be one of {', '.join(FORMATS)}")
    if mode == "reference" and workers > 1:
        raise DataError(f"workers={workers}: reference mode runs in one process (use mode fast)")
    _check(options, mode, workers, chunk_chars)
    vocab = Path(vocab)
    vocab_size = len(read_vocab(vocab))  # a missing or empty vocab fails here, before any work
    files = expand_inputs(inputs)
    paths = output_paths(output, num_output_files)
    stats = CreateStats(mode=mode, files=paths)

    with contextlib.ExitStack() as stack:
        writers = [stack.enter_context(RecordWriter(path, fmt, seq_len, max_predictions,
                                                    vocab_size=vocab_size)) for path in paths]
        out = _RoundRobin(writers)
        if mode == "reference":
            _create_reference(files, vocab, options, out, stats)
        else:
            spool = None
            if workers > 1:  # workers leave their records here for us to append
                spool = stack.enter_context(tempfile.TemporaryDirectory(
                    prefix=f".{paths[0].name}.spool-", dir=paths[0].parent))
            encoder = writers[0].encoder
            # Closed before the spool goes: no worker writes into it any more.
            results = stack.enter_context(contextlib.closing(_generate(
                files, vocab, options, encoder, workers, chunk_chars, start_method, stats,
                spool, len(paths))))
            for result in results:
                if result.spooled is not None:
                    out.write_spooled(result.spooled, encoder.layout)
                else:
                    out.write_encoded(result.records)
        stats.instances = out.count
        if stats.instances == 0:
            # Leaving the block by an exception discards the temporary files.
            names = ", ".join(map(str, files[:3])) + (" …" if len(files) > 3 else "")
            raise DataError(f"{names}: the corpus is empty (no line with any token)")
    stats.seconds = time.perf_counter() - start
    return stats


def generate(inputs: Sequence[str | Path], vocab: str | Path, *, seq_len: int = 128,
             max_predictions: int = 20, masked_lm_prob: float = 0.15,
             short_seq_prob: float = 0.1, dupe_factor: int = 5, seed: int = 12345,
             lowercase: bool = True, workers: int = 1, chunk_chars: int = CHUNK_CHARS,
             start_method: str | None = None,
             stats: CreateStats | None = None) -> Iterator[PretrainingArrays]:
    """Fast mode without files: each chunk's instances, in order, as :func:`create` writes them.

    ``stats``, when given, is updated as chunks come.
    """
    options = CreateOptions(seq_len, max_predictions, masked_lm_prob, short_seq_prob,
                            dupe_factor, seed, lowercase)
    _check(options, "fast", workers, chunk_chars)
    read_vocab(vocab)  # a missing or empty vocab fails here, before any work
    stats = stats if stats is not None else CreateStats(mode="fast", files=[])
    results = _generate(expand_inputs(inputs), Path(vocab), options, None, workers, chunk_chars,
                        start_method, stats)
    return (result.arrays for result in results)


def _check(options: CreateOptions, mode: str, workers: int, chunk_chars: int) -> None:
    options.check()
    if workers < 1:
        raise DataError(f"workers={workers} must be at least 1")
    if mode == "fast" and options.seed < 0:
        raise DataError(f"seed={options.seed} must be at least 0 in fast mode")
    if chunk_chars < 1:
        raise DataError(f"chunk_chars={chunk_chars} must be at least 1")


def _generate(files: list[Path], vocab: Path, options: CreateOptions,
              encoder: RecordEncoder | None, workers: int, chunk_chars: int,
              start_method: str | None, stats: CreateStats, spool: str | None = None,
              num_files: int = 1) -> Iterator[ChunkResult]:
    chunks = chunk_ranges(files, chunk_chars)
    for result in _fast_chunks(chunks, vocab, options, encoder, workers, start_method, spool,
                               num_files):
        stats.chunks += 1
        stats.documents += result.documents
        stats.sentences += result.sentences
        stats.tokens += result.tokens
        stats.empty_documents += result.empty_documents
        stats.instances += result.instances
        stats.next_sentence_random += result.next_sentence_random
        yield result


def _create_reference(files: list[Path], vocab: Path, options: CreateOptions, out: _RoundRobin,
                      stats: CreateStats) -> None:
    """The whole corpus at once, as google-research/bert's create_pretraining_data.py."""
    tokenizer = FastWordPiece(vocab, options.lowercase)
    documents = list(read_documents(files))
    chunk = tokenizer.encode_documents(documents)
    del documents
    stats.documents = len(chunk.document_offsets) - 1
    stats.sentences = len(chunk.sentence_offsets) - 1
    stats.tokens = len(chunk.tokens)
    stats.empty_documents = chunk.empty_documents
    instances = create_instances(
        chunk.as_lists(), seq_len=options.seq_len, max_predictions=options.max_predictions,
        masked_lm_prob=options.masked_lm_prob, short_seq_prob=options.short_seq_prob,
        dupe_factor=options.dupe_factor, vocab_size=tokenizer.vocab_size,
        specials=tokenizer.specials, rng=random.Random(options.seed))
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
                        help="text files, globs or directories of *.txt (read in this order)")
    parser.add_argument("--vocab", required=True, help="vocab.txt, one token per line")
    parser.add_argument("--output", required=True,
                        help="output file (with --num-output-files N: NAME-0000i-of-0000N.EXT)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--max-predictions", type=int, default=20)
    parser.add_argument("--masked-lm-prob", type=float, default=0.15)
    parser.add_argument("--short-seq-prob", type=float, default=0.1)
    parser.add_argument("--dupe-factor", type=int, default=5)
    parser.add_argument("--seed", type=int, default=12345)
    parser.add_argument("--cased", action="store_true", help="do not lower-case (cased vocabs)")
    parser.add_argument("--mode", choices=MODES, default="reference",
                        help="reference: google-research/bert's records exactly; "
                             "fast: same distributions, streaming, parallel")
    parser.add_argument("--workers", type=int, default=1, help="processes (fast mode)")
    parser.add_argument("--format", dest="fmt", choices=("tfrecord", "native"), default="tfrecord")
    parser.add_argument("--num-output-files", type=int, default=1)
    parser.add_argument("--chunk-chars", type=int, default=CHUNK_CHARS,
                        help="fast mode: bytes of text per chunk")


def run(args: argparse.Namespace) -> int:
    """Run ``bertforge data create`` from parsed arguments; print a one-line summary."""
    stats = create(args.input, args.vocab, args.output, seq_len=args.seq_len,
                   max_predictions=args.max_predictions, masked_lm_prob=args.masked_lm_prob,
                   short_seq_prob=args.short_seq_prob, dupe_factor=args.dupe_factor,
                   seed=args.seed, lowercase=not args.cased, mode=args.mode,
                   workers=args.workers, fmt=args.fmt, num_output_files=args.num_output_files,
                   chunk_chars=args.chunk_chars)
    print(stats.summary())
    return 0

