"""Hugging Face ``tokenizer.json`` vocabs (a byte-level BPE, as ModernBERT's): training, special
tokens, word boundaries, and :class:`FastBPE`, their ids for many lines at once.

A ``tokenizer.json`` holds ``tokenizers``' whole pipeline (normalizer,
pre-tokenizer, model, added tokens, post-processor). Nothing about it is
assumed to be BERT's: the roles of the special tokens are read from the file
(:func:`special_roles`), and so is what marks the start of a word
(:func:`word_continuations`). :func:`train_bpe` trains one (``bertforge data
vocab --kind bpe``).

Text is encoded as ``tokenizers`` encodes it, with one difference: special
tokens written in the text (a literal "[MASK]" or "<s>") are encoded as the
text they are, never as the special ids, which only the pipeline places.
"""

from __future__ import annotations

import itertools
import json
import operator
import os
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from .errors import DataError
from .tokenizer import CLS, MASK, SEP, SPECIAL_TOKENS, SpecialIds
from .wordpiece import IdStore, TokenizedChunk


def _byte_chars() -> list[str]:
    """The character byte-level BPE writes for each byte (GPT-2's table): the printable Latin-1
    bytes stand for themselves, every other byte for chr(256 + its rank among those others)."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    chars, others = [], 0
    for byte in range(256):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(256 + others))
            others += 1
    return chars


BYTE_CHARS = _byte_chars()  # BYTE_CHARS[ord(" ")] is "Ġ", the space marker
_BYTE_OF = {char: byte for byte, char in enumerate(BYTE_CHARS)}
_SPACE_BYTES = frozenset(b" \t\n\r\x0b\x0c")

# Roles of special tokens by name, where the post-processor does not say (the names of
# BERT, ModernBERT and RoBERTa).
ROLE_NAMES = {"cls": ("[CLS]", "<s>", "<cls>"), "sep": ("[SEP]", "</s>", "<sep>"), "mask": ("[MASK]", "<mask>"),
              "pad": ("[PAD]", "<pad>", "<|padding|>"), "unk": ("[UNK]", "<unk>")}
_ROLE_WORDS = {"cls": "classifier", "sep": "separator", "mask": "mask"}  # the roles records need

# Where a line may be cut (see FastBPE): before a space between a non-space and an ASCII letter
# or digit. Python's whitespace includes all of the byte-level regex's (Unicode White_Space), so it
# never cuts where that regex would see whitespace before the space.
_CUTS = re.compile(r"(?<=\S)(?= [A-Za-z0-9])")
# Normalizers that leave ASCII as it is.
_ASCII_IDENTITY = ("NFC", "NFD", "NFKC", "NFKD")
MAX_CACHED_WORDS = 1 << 18


def read_tokenizer_json(path: str | Path) -> tuple[Tokenizer, dict]:
    """(the tokenizer, its JSON) of a ``tokenizer.json``; a DataError naming the file otherwise.

    The tokenizer encodes special tokens written in the text as text (``encode_special_tokens``).
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
        spec = json.loads(text)
        tokenizer = Tokenizer.from_str(text)
    except FileNotFoundError:
        raise DataError(f"vocab not found: {path}") from None
    except IsADirectoryError:
        raise DataError(f"{path}: is a directory, not a vocab file") from None
    except Exception as err:  # not UTF-8, not JSON, or what tokenizers refuses (a bare Exception)
        first_line = (str(err).splitlines() or [type(err).__name__])[0]
        raise DataError(f"{path}: not a tokenizer.json that tokenizers reads ({first_line})") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("model"), dict):
        raise DataError(f"{path}: not a tokenizer.json (no model)")
    tokenizer.encode_special_tokens = True
    return tokenizer, spec


def _processor_ends(processor: dict | None) -> tuple[int | None, int | None]:
    """(classifier, separator) ids of a post-processor: the special tokens before and after the
    single sequence of its template (BERT's and RoBERTa's processors name them)."""
    if not isinstance(processor, dict):
        return None, None
    kind = processor.get("type")
    if kind == "Sequence":
        for inner in processor.get("processors") or []:
            found = _processor_ends(inner)
            if found != (None, None):
                return found
        return None, None
    if kind in ("BertProcessing", "RobertaProcessing"):
        return processor["cls"][1], processor["sep"][1]
    if kind == "TemplateProcessing":
        ids = {name: entry["ids"][0] for name, entry in (processor.get("special_tokens") or {}).items()
               if entry.get("ids")}
        before: list[int] = []
        after: list[int] = []
        seen = False  # the sequence, yet
        for piece in processor.get("single") or []:
            seen = seen or "Sequence" in piece
            name = piece.get("SpecialToken", {}).get("id")
            if name in ids:
                (after if seen else before).append(ids[name])
        return (before[0] if before else None), (after[0] if after else None)
    return None, None


def special_roles(tokenizer: Tokenizer, spec: dict) -> tuple[SpecialIds | None, str]:
    """(the ids of the classifier, separator, mask, padding and unknown tokens; what is missing).

    Classifier and separator are what the post-processor puts before and after
    one sequence (its template, or BERT's and RoBERTa's processors); without
    one, the special tokens named as in ``ROLE_NAMES``. The others are special
    tokens of those names (unknown: the model's ``unk_token`` first). Without
    a classifier, separator or mask token there are no ids (None) and the
    message names the first missing role; padding and unknown may be None.
    """
    specials = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    found = {role: next((specials[n] for n in names if n in specials), None) for role, names in ROLE_NAMES.items()}
    cls, sep = _processor_ends(spec.get("post_processor"))
    found["cls"] = cls if cls is not None else found["cls"]
    found["sep"] = sep if sep is not None else found["sep"]
    unk = spec["model"].get("unk_token")
    if isinstance(unk, str) and tokenizer.token_to_id(unk) is not None:
        found["unk"] = tokenizer.token_to_id(unk)
    cls, sep, mask = found["cls"], found["sep"], found["mask"]
    if cls is None or sep is None or mask is None:
        role = "cls" if cls is None else "sep" if sep is None else "mask"
        where = {"cls": "first in the post-processor's template, or ",
                 "sep": "after the sequence in the post-processor's template, or ", "mask": ""}[role]
        return None, (f"the tokenizer has no {_ROLE_WORDS[role]} token ({where}a special token "
                      f"{' or '.join(ROLE_NAMES[role])})")
    return SpecialIds(pad=found["pad"], unk=found["unk"], cls=cls, sep=sep, mask=mask), ""


def _pre_tokenizers(spec: dict) -> list[dict]:
    pre = spec.get("pre_tokenizer")
    if not isinstance(pre, dict):
        return []
    return list(pre.get("pretokenizers") or []) if pre.get("type") == "Sequence" else [pre]


def word_continuations(spec: dict, tokens: list[str], added: dict[int, bool]) -> tuple[np.ndarray, str]:
    """(per id, whether the token continues the word before it; what such tokens are, for messages).

    A word starts where the text had whitespace before it, which each model
    marks its own way: byte-level BPE (ModernBERT, RoBERTa, GPT-2) by a first
    byte that is whitespace (the space marker "Ġ"), SentencePiece-style
    Metaspace by "▁"; WordPiece continues a word with "##". ``added`` maps
    the ids of added tokens to whether they are special: a special token is a
    word of its own, another added token is its own text (not byte-mapped) and
    starts a word when whitespace leads it. With none of these markers there
    is no word information: every token starts a word.
    """
    pre = {p.get("type"): p for p in _pre_tokenizers(spec)}
    model = spec["model"]
    if model.get("type") == "WordPiece":
        prefix = model.get("continuing_subword_prefix") or "##"
        rule = f"{prefix} pieces"

        def continues(token: str) -> bool:
            return token.startswith(prefix)
    elif "ByteLevel" in pre:
        rule = "tokens without the space marker Ġ"

        def continues(token: str) -> bool:
            return _BYTE_OF.get(token[0], 0x20) not in _SPACE_BYTES
    elif "Metaspace" in pre:
        marker = pre["Metaspace"].get("replacement") or "▁"
        rule = f"tokens without the word marker {marker}"

        def continues(token: str) -> bool:
            return not token.startswith(marker)
    else:
        return np.zeros(len(tokens), bool), "tokens that continue a word"
    flags = np.zeros(len(tokens), bool)
    for i, token in enumerate(tokens):
        if token and i not in added:
            flags[i] = continues(token)
        elif token and not added[i]:
            flags[i] = not token[0].isspace()
    return flags, rule


# ---------------------------------------------------------------- training

def train_bpe(documents: Iterable[list[str]], vocab_size: int, out_path: str | Path) -> Path:
    """Train a byte-level BPE of at most ``vocab_size`` tokens; write its ``tokenizer.json`` to ``out_path``.

    ModernBERT's pipeline: NFC normalization, the byte-level pre-tokenizer
    (GPT-2's split, no prefix space; case kept), BPE over the 256 bytes, and a
    post-processor writing ``[CLS] A [SEP]`` (``[CLS] A [SEP] B [SEP]`` for
    pairs). The special tokens are ModernBERT's names at ids 0-4: [PAD] 0 (the
    records' padding id), [UNK] 1, [CLS] 2, [SEP] 3, [MASK] 4, with the flags
    of its published ``tokenizer.json`` (:func:`modernbert_special_tokens`: the
    mask takes the space before it, so "is [MASK]." is ``is [MASK] .``, as
    training shows a masked ``Ġword``). Each document
    is trained on as running text, its lines joined by spaces, as
    :meth:`FastBPE.encode_documents` encodes it. The file is written under a
    temporary name and renamed.
    """
    least = len(SPECIAL_TOKENS) + 256
    if vocab_size <= least:
        raise DataError(f"vocab_size={vocab_size} leaves no room beyond the {len(SPECIAL_TOKENS)} special "
                        f"tokens and the 256 bytes (give more than {least})")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=modernbert_special_tokens(),
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_running_texts(documents), trainer)
    cls, sep = tokenizer.token_to_id(CLS), tokenizer.token_to_id(SEP)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{CLS} $A {SEP}", pair=f"{CLS} $A {SEP} $B:1 {SEP}:1", special_tokens=[(CLS, cls), (SEP, sep)])
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.{os.getpid()}.tmp")
    tmp.write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    os.replace(tmp, out_path)
    return out_path


def modernbert_special_tokens() -> list[AddedToken]:
    """[PAD] [UNK] [CLS] [SEP] [MASK] as answerdotai/ModernBERT-base's ``tokenizer.json`` declares them:
    special, not normalized, not single words, no right strip; [MASK] alone strips the whitespace on
    its left (``lstrip``), which becomes part of the mask."""
    return [AddedToken(token, single_word=False, lstrip=token == MASK, rstrip=False, normalized=False, special=True)
            for token in SPECIAL_TOKENS]


def _running_texts(documents: Iterable[list[str]], size: int = 1000) -> Iterator[list[str]]:
    """Batches of documents, each as its running text."""
    batch: list[str] = []
    for document in documents:
        batch.append(" ".join(document))
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


# ---------------------------------------------------------------- fast ids

def _prefix_space(spec: dict) -> bool | None:
    """Whether the pre-tokenizer puts a space before a line, where the pipeline is one whose ids
    :class:`FastBPE` may cache (NFC-like normalization, or none, which leaves ASCII as it is; the
    byte-level split alone; BPE without dropout); None for any other pipeline."""
    normalizer = spec.get("normalizer")
    steps = ([] if normalizer is None else normalizer.get("normalizers") or []
             if normalizer.get("type") == "Sequence" else [normalizer])
    pre = _pre_tokenizers(spec)
    model = spec["model"]
    if (not all(step.get("type") in _ASCII_IDENTITY for step in steps) or len(pre) != 1
            or pre[0].get("type") != "ByteLevel" or not pre[0].get("use_regex", True)
            or model.get("type") != "BPE" or model.get("dropout")):
        return None
    return bool(pre[0].get("add_prefix_space"))


def _least_contents(contents: Iterable[str]) -> list[str]:
    """The added tokens' texts that contain no other one: a line holds one of them exactly when it
    holds any."""
    kept: list[str] = []
    for text in sorted(set(contents), key=len):
        if text and not any(k in text for k in kept):
            kept.append(text)
    return kept


def _plain(text: str) -> bool:
    """Whether the cache may encode ``text`` word by word: printable ASCII with single spaces (a tab,
    a control character or a double space sends it through tokenizers)."""
    return text.isascii() and text.isprintable() and "  " not in text


def _word_text(key: str) -> str:
    """The text of a plain word's cache key (see FastBPE._plain_ids)."""
    return key[1:] if key[:1] == "\0" else " " + key


def _segment_text(key: str) -> str:
    """The text of another segment's cache key: "\\x01" and the segment."""
    return key[1:]


class FastBPE:
    """Ids of a ``tokenizer.json`` for many lines at once, as ``tokenizers`` gives them, with a cache
    of words.

    Byte-level BPE works within pre-tokens: its regex cuts a line into pieces
    (" word", " 123", " ,.", whitespace) and BPE merges bytes within each; a
    piece never spans a point where a space follows a non-space (the space
    opens the next piece). So where a stretch of ASCII has single spaces and
    no tab, its ids are those of its words, each with the space before it
    (" word"; the first without), which ``str.split`` finds and a dict looks
    up; only words never seen go to ``tokenizers``, in one batch. A line is cut
    into such stretches and others (non-ASCII, control characters, double
    spaces, tabs) before each space that follows a non-space and precedes an
    ASCII letter or digit, where NFC cannot join characters either; the
    others and every line that holds an added token's text go through
    ``tokenizers`` whole, and are cached whole too (" café," recurs); every
    line of a pipeline :func:`_prefix_space` does not cover goes through
    ``tokenizers``. The cache is cleared when it holds ``max_words`` entries;
    the ids never depend on it. Tests compare the result with ``tokenizers``' own
    encoding on the shared Wikipedia text, raw wikitext, SQuAD and odd lines.
    """

    def __init__(self, tokenizer: Tokenizer, spec: dict, max_words: int = MAX_CACHED_WORDS):
        self.tokenizer = tokenizer
        self.max_words = max_words
        self._prefix_space = _prefix_space(spec)
        self._added = _least_contents(t.content for t in tokenizer.get_added_tokens_decoder().values())
        self._word_tokenizer = tokenizer  # encodes new words as they are: without a space put before them
        if self._prefix_space:
            words = json.loads(tokenizer.to_str())
            words["pre_tokenizer"]["add_prefix_space"] = False
            self._word_tokenizer = Tokenizer.from_str(json.dumps(words))
            self._word_tokenizer.encode_special_tokens = True
        self._clear()

    def _clear(self) -> None:
        self._entry: dict[str, int] = {}
        self._store = IdStore()

    def _with_added(self, texts: list[str]) -> np.ndarray:
        """Which texts hold an added token's text (tokenizers then encodes them whole)."""
        found = np.zeros(len(texts), bool)
        if self._added:
            text = "\n".join(texts)
            ends = np.cumsum([len(t) + 1 for t in texts])
            for content in self._added:
                at = text.find(content)
                while at >= 0:
                    found[np.searchsorted(ends, at, "right")] = True
                    at = text.find(content, at + 1)
        return found

    def _segments(self, lines: list[str]) -> tuple[list[str], np.ndarray, np.ndarray]:
        """(the lines cut into segments that encode on their own; the line of each; which are plain:
        ASCII stretches for the cache, see the class docstring)."""
        if self._prefix_space:  # as ByteLevel(add_prefix_space=True): a space before a line without one
            lines = [line if line.startswith(" ") else " " + line for line in lines]
        whole = self._with_added(lines).tolist()
        segments: list[str] = []
        line_of: list[int] = []
        plain: list[bool] = []
        for k, line in enumerate(lines):
            if whole[k] or _plain(line):
                segments.append(line)
                line_of.append(k)
                plain.append(not whole[k])
            else:
                parts = _CUTS.split(line)
                segments.extend(parts)
                line_of.extend([k] * len(parts))
                plain.extend(map(_plain, parts))
        return segments, np.array(line_of, np.int64), np.array(plain, bool)

    def _lookup(self, keys: list[str], text_of: Callable[[str], str],
                tokenizer: Tokenizer) -> tuple[np.ndarray, np.ndarray]:
        """(the ids of the keys, concatenated; the number of each): new keys' texts (``text_of(key)``)
        are encoded by ``tokenizer`` in one batch and cached."""
        if not keys:
            return np.zeros(0, np.int32), np.zeros(0, np.int64)
        new = list(set(keys).difference(self._entry))
        if new:
            self._entry.update(zip(new, range(len(self._store), len(self._store) + len(new))))
            self._store.add([e.ids for e in tokenizer.encode_batch_fast(list(map(text_of, new)),
                                                                        add_special_tokens=False)])
        entries = np.fromiter(operator.itemgetter(*keys)(self._entry) if len(keys) > 1 else
                              [self._entry[key] for key in keys], np.int64, len(keys))
        return self._store.gather(entries)

    def _plain_ids(self, segments: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(the ids of plain segments, concatenated; the number of each), word by word.

        A word's key is itself where a space comes before it, else it after
        "\\x00" (a segment's first word; no plain segment holds "\\x00"):
        joining the segments with " \\x00" marks every first word at once.
        """
        if not segments:
            return np.zeros(0, np.int32), np.zeros(0, np.int64)
        keys = ("\0" + " \0".join(segments)).split(" ")
        words = np.fromiter(map(str.count, segments, itertools.repeat(" ")), np.int64, len(segments)) + 1
        ids, counts = self._lookup(keys, _word_text, self._word_tokenizer)
        return ids, np.bincount(np.repeat(np.arange(len(segments)), words), weights=counts,
                                minlength=len(segments)).astype(np.int64)

    def encode_lines(self, lines: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(all token ids of the lines, concatenated; the number of ids of each line)."""
        if len(self._store) > self.max_words:
            self._clear()  # bound memory; the ids do not depend on what is cached
        if self._prefix_space is None:
            segments, line_of, plain = lines, np.arange(len(lines)), np.zeros(len(lines), bool)
        else:
            segments, line_of, plain = self._segments(lines)
        fast, slow = np.flatnonzero(plain), np.flatnonzero(~plain)
        parts = [(fast, *self._plain_ids([segments[k] for k in fast.tolist()])),  # other segments: cached whole
                 (slow, *self._lookup(["\1" + segments[k] for k in slow.tolist()], _segment_text, self.tokenizer))]
        lengths = np.zeros(len(segments), np.int64)
        for which, _, counts in parts:
            lengths[which] = counts
        ids = np.zeros(int(lengths.sum()), np.int32)
        starts = np.cumsum(lengths) - lengths
        for which, part_ids, counts in parts:  # each part's ids to their places, in one scatter
            within = np.arange(len(part_ids)) - np.repeat(np.cumsum(counts) - counts, counts)
            ids[np.repeat(starts[which], counts) + within] = part_ids
        return ids, np.bincount(line_of, weights=lengths, minlength=len(lines)).astype(np.int64)

    def encode_documents(self, documents: list[list[str]]) -> TokenizedChunk:
        """Documents as flat arrays, each encoded as its running text: every line but a document's
        first after the space that joined it to the one before ("ĠThe", as mid-text), so that
        a line's first word is marked as a word. Lines without tokens and documents without
        lines are dropped."""
        lines = [line if k == 0 or not line else " " + line for document in documents
                 for k, line in enumerate(document)]
        return TokenizedChunk.of(documents, *self.encode_lines(lines))
