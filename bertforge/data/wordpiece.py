"""BERT WordPiece ids of many lines at once, with numpy and a cache: :class:`FastWordPiece`.

The ids are those of :func:`.tokenizer.encode_texts` (the reference
``FullTokenizer``'s), found an order of magnitude faster: ``bertforge data
create`` tokenizes whole corpora with it. It lives beside :mod:`.tokenizer`,
which it builds on (vocab reading, the ``tokenizers`` pipeline for whatever
is not plain ASCII), and returns documents as flat arrays
(:class:`TokenizedChunk`) for :func:`.instances.create_arrays_fast`.
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .tokenizer import MAX_WORD_CHARS, encode_texts, read_vocab, special_ids, tokenizer_for_vocab

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
        self._empty(bits)

    def _empty(self, bits: int) -> None:
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
        self._empty(max(self.bits + 1, (4 * count - 1).bit_length()))  # a quarter full
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
        self._store = IdStore()
        if self._seed:
            units = _Units("\n".join(self._seed), lowercase=False)
            assert len(units.starts) == len(self._seed)
            key1, key2 = units.keys(np.arange(len(self._seed)))
            _, new = self._table.insert(key1, key2, 0)  # entries in the order of `new`
            self._store.add([[self.vocab[self._seed[k]]] for k in new.tolist()])

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
        if len(self._store) > self.max_units:
            self._clear()  # bound memory; the ids do not depend on what is cached
        entry = np.full(len(units.starts), -1, np.int64)
        short = np.flatnonzero(units.length <= 16)
        if len(short):
            key1, key2 = units.keys(short)
            entry[short] = self._table.lookup(key1, key2)
            missing = np.flatnonzero(entry[short] < 0)
            if len(missing):
                found, new = self._table.insert(key1[missing], key2[missing], len(self._store))
                entry[short[missing]] = found
                first = short[missing[new]]
                self._store.add(self._unit_ids(units.texts(first), units.whole[first].tolist()))
        long = np.flatnonzero(units.length > 16)
        if len(long):
            raws = units.raw(long)
            new_raws = {raw: bool(w) for raw, w in zip(raws, units.whole[long].tolist())
                        if raw not in self._long}
            if new_raws:
                texts = [raw.decode("utf-8") for raw in new_raws]
                self._long.update(zip(new_raws, range(len(self._store), len(self._store) + len(texts))))
                self._store.add(self._unit_ids(texts, list(new_raws.values())))
            entry[long] = [self._long[raw] for raw in raws]

        ids, counts = self._store.gather(entry)
        line_lengths = np.bincount(units.line, weights=counts, minlength=len(lines))
        return ids, line_lengths.astype(np.int64)

    def encode_documents(self, documents: list[list[str]]) -> TokenizedChunk:
        """Documents as flat arrays; lines without tokens and documents without lines dropped."""
        return TokenizedChunk.of(documents, *self.encode_lines([line for document in documents for line in document]))


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


class IdStore:
    """The token ids of cached entries (units, pieces), numbered 0, 1, … as they are added, in
    growing numpy arrays: the ids of many entries are gathered with one fancy index."""

    def __init__(self) -> None:
        # Entry e's ids are _ids[_start[e]:_start[e] + _len[e]].
        self._ids = np.zeros(1 << 16, np.int32)
        self._start = np.zeros(1 << 12, np.int64)
        self._len = np.zeros(1 << 12, np.int64)
        self._entries = 0
        self._used_ids = 0

    def __len__(self) -> int:
        return self._entries

    def add(self, ids: list[list[int]]) -> None:
        """Store the ids of new entries, as the next entries."""
        lengths = np.fromiter(map(len, ids), np.int64, len(ids))
        flat = np.fromiter((i for unit in ids for i in unit), np.int32, int(lengths.sum()))
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

    def gather(self, entries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the ids of the entries, concatenated; the number of ids of each)."""
        counts, first_id = self._len[entries], self._start[entries]
        total = int(counts.sum())
        # Id t of entry k is _ids[first_id[k] + t].
        return self._ids[np.repeat(first_id - np.cumsum(counts) + counts, counts) + np.arange(total)], counts


@dataclass
class TokenizedChunk:
    """Documents as flat arrays: see :func:`.instances.create_arrays_fast`."""

    tokens: np.ndarray
    sentence_offsets: np.ndarray
    document_offsets: np.ndarray
    empty_documents: int

    @classmethod
    def of(cls, documents: list[list[str]], ids: np.ndarray, line_lengths: np.ndarray) -> TokenizedChunk:
        """The chunk of ``documents`` whose lines, in order, have ``ids`` (``line_lengths`` of them
        each); lines without tokens and documents without lines are dropped."""
        kept = line_lengths > 0
        doc_of_line = np.repeat(np.arange(len(documents)), [len(d) for d in documents])
        lines_per_doc = np.bincount(doc_of_line[kept], minlength=len(documents))
        lines_per_doc_kept = lines_per_doc[lines_per_doc > 0]
        return cls(
            tokens=ids,
            sentence_offsets=np.concatenate([[0], np.cumsum(line_lengths[kept])]).astype(np.int64),
            document_offsets=np.concatenate([[0], np.cumsum(lines_per_doc_kept)]).astype(np.int64),
            empty_documents=int((lines_per_doc == 0).sum()))

    def as_lists(self) -> list[list[list[int]]]:
        """Token ids per sentence per document (the reference's layout)."""
        tokens, sentences = self.tokens.tolist(), self.sentence_offsets.tolist()
        bounds = self.document_offsets.tolist()
        return [[tokens[sentences[s]:sentences[s + 1]] for s in range(bounds[d], bounds[d + 1])]
                for d in range(len(bounds) - 1)]
