"""WordPiece vocabularies and the BERT tokenizer, built on Hugging Face ``tokenizers``.

A vocab is a ``vocab.txt``: one token per line, the line number is the id
(google-research/bert's format). The tokenizer splits text the way BERT's
``FullTokenizer`` does: clean and (for uncased) lowercase and strip accents,
split on whitespace and punctuation and around CJK characters, then greedy
longest-match WordPiece with ``##`` marking a word's continuation.
"""

from __future__ import annotations

import os
import re
import unicodedata
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from .errors import DataError
from .text import not_utf8

PAD, UNK, CLS, SEP, MASK = "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"
SPECIAL_TOKENS = [PAD, UNK, CLS, SEP, MASK]  # ids 0-4 in a vocab trained here
CONTINUATION = "##"
MAX_WORD_CHARS = 200  # longer words become [UNK], as in BERT's WordpieceTokenizer


@dataclass(frozen=True)
class SpecialIds:
    """Ids of the special tokens in one vocab (they differ between vocabs); a tokenizer.json may
    have no padding or unknown token (None)."""

    pad: int | None
    unk: int | None
    cls: int
    sep: int
    mask: int


def _bert_pipeline(tokenizer: Tokenizer, lowercase: bool) -> Tokenizer:
    # BERT uncased lowercases and strips accents; cased does neither.
    tokenizer.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=lowercase, lowercase=lowercase)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(prefix=CONTINUATION)
    return tokenizer


def _batches(documents: Iterable[list[str]], size: int = 1000) -> Iterator[list[str]]:
    batch: list[str] = []
    for document in documents:
        batch.extend(document)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def _alphabet(tokenizer: Tokenizer, documents: Iterable[list[str]],
              limit: int) -> tuple[list[str], list[str]]:
    """The ``limit`` most frequent characters of the words, and those of them seen inside a word.

    Ties are broken by code point, so the choice does not depend on hash order.
    """
    counts: Counter[str] = Counter()
    inside: set[str] = set()
    for batch in _batches(documents):
        text = tokenizer.normalizer.normalize_str("\n".join(batch))
        words = [word for word, _ in tokenizer.pre_tokenizer.pre_tokenize_str(text)]
        counts.update("".join(words))
        inside.update("".join(word[1:] for word in words))
    ranked = sorted(counts, key=lambda c: (-counts[c], c))[:limit]
    return sorted(ranked), sorted(c for c in ranked if c in inside)


def train_wordpiece(documents: Iterable[list[str]], vocab_size: int, out_path: str | Path,
                    lowercase: bool = True) -> Path:
    """Train a WordPiece vocab of at most ``vocab_size`` tokens; write it to ``out_path``.

    A small corpus may yield fewer tokens than asked for. The special tokens
    take ids 0-4 ([PAD] first, so padding is id 0), then come the characters,
    their ``##`` forms and the learned pieces. The file is written under a
    temporary name and renamed, so a reader never sees half a vocab.

    ``documents`` is read twice, streaming (the alphabet first, then the
    training), so memory does not grow with the corpus: pass a list, or an
    object whose ``__iter__`` reads its files afresh, not a one-shot iterator.
    """
    if vocab_size <= len(SPECIAL_TOKENS):
        raise DataError(f"vocab_size={vocab_size} leaves no room beyond the special tokens")
    if iter(documents) is documents:
        raise TypeError("train_wordpiece reads the documents twice: give a list or a re-iterable "
                        f"object, not a one-shot {type(documents).__name__}")
    tokenizer = _bert_pipeline(
        Tokenizer(models.WordPiece(unk_token=UNK, continuing_subword_prefix=CONTINUATION,
                                   max_input_chars_per_word=MAX_WORD_CHARS)), lowercase)
    # Every kept character can cost two entries ("x" and "##x"): cap the alphabet
    # so that a small vocab stays within vocab_size (rare characters become [UNK]).
    alphabet, inside = _alphabet(tokenizer, documents, (vocab_size - len(SPECIAL_TOKENS)) // 2)
    # tokenizers (0.23) numbers the "##x" tokens in hash-map order, which changes
    # from run to run and, through tie-breaking, changes the learned vocab
    # (huggingface/tokenizers#1794). Declaring them up front, in sorted order,
    # makes training deterministic; the initial alphabet does the same for the
    # choice of characters.
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS + [CONTINUATION + c for c in inside],
        initial_alphabet=alphabet, limit_alphabet=len(alphabet),
        continuing_subword_prefix=CONTINUATION, show_progress=False)
    tokenizer.train_from_iterator(_batches(documents), trainer)

    vocab = tokenizer.get_vocab()
    if sorted(vocab.values()) != list(range(len(vocab))):
        raise AssertionError("tokenizers returned a vocab with gaps in its ids")
    # BERT's layout: special tokens, characters, "##" characters, learned pieces.
    def rank(token: str) -> tuple[int, int]:
        group = (0 if token in SPECIAL_TOKENS else 1 if len(token) == 1
                 else 2 if token.startswith(CONTINUATION) and len(token) == 3 else 3)
        return group, vocab[token]

    tokens = sorted(vocab, key=rank)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.{os.getpid()}.tmp")
    tmp.write_text("".join(f"{t}\n" for t in tokens), encoding="utf-8")
    os.replace(tmp, out_path)
    return out_path


def subword_flags(vocab: Iterable[str] | dict[str, int]) -> np.ndarray:
    """Per token id: is it a ``##`` continuation piece (what whole-word masking joins to the word
    before it). ``vocab``: the tokens in id order, or a token → id mapping."""
    ids = vocab if isinstance(vocab, dict) else {t: i for i, t in enumerate(vocab)}
    flags = np.zeros(max(ids.values(), default=-1) + 1, bool)
    for token, i in ids.items():
        flags[i] = token.startswith("##")
    return flags


def read_vocab(vocab_path: str | Path) -> list[str]:
    """The tokens of a vocab.txt in id order."""
    path = Path(vocab_path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"vocab not found: {path}") from None
    except UnicodeDecodeError as err:
        raise not_utf8(path, err.start) from None  # names a record or compressed file as such
    except IsADirectoryError:
        raise DataError(f"{path}: is a directory, not a vocab file") from None
    if looks_like_json(text[:64].encode("utf-8")):
        raise DataError(f"{path}: a tokenizer.json, where a WordPiece vocab.txt (one token per line) is needed")
    # Split on "\n" only (not str.splitlines) to count lines exactly as tokenizers does.
    tokens = [line.strip() for line in text.split("\n")]
    if tokens and tokens[-1] == "":
        tokens.pop()
    if not tokens:
        raise DataError(f"{path}: the vocab is empty")
    return tokens


def looks_like_json(head: bytes) -> bool:
    """Whether a file's first bytes open a JSON object (a tokenizer.json), not vocab lines."""
    return re.match(rb'\s*\{\s*("|\}|$)', head) is not None


def load_tokenizer(vocab_path: str | Path, lowercase: bool = True) -> Tokenizer:
    """BERT's WordPiece tokenizer for a vocab.txt.

    It adds no [CLS]/[SEP]: instance creation places those itself.
    """
    # A duplicated token keeps its last id, as in BERT's load_vocab.
    vocab = {token: i for i, token in enumerate(read_vocab(vocab_path))}
    return tokenizer_for_vocab(vocab, lowercase, vocab_path)


def tokenizer_for_vocab(vocab: dict[str, int], lowercase: bool = True,
                        source: str | Path = "the vocab") -> Tokenizer:
    """:func:`load_tokenizer` for a vocab already read (token → id); ``source`` names it in errors."""
    if UNK not in vocab:
        raise DataError(f"{source}: the vocab has no {UNK} token")
    model = models.WordPiece(vocab, unk_token=UNK, continuing_subword_prefix=CONTINUATION,
                             max_input_chars_per_word=MAX_WORD_CHARS)
    return _bert_pipeline(Tokenizer(model), lowercase)


def special_ids(tokenizer: Tokenizer) -> SpecialIds:
    """Look up the special tokens; a vocab missing one of them is an error."""
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    found = {token: i for token, i in ids.items() if i is not None}
    missing = [token for token in ids if token not in found]
    if missing:
        raise DataError(f"the vocab lacks the special tokens {', '.join(missing)}")
    return SpecialIds(*(found[token] for token in SPECIAL_TOKENS))


# An unassigned code point: kept by both tokenizers, it makes its word [UNK].
_UNKNOWN_CHAR = "\u0378"


class _CleanTable(dict):
    """str.translate table of the reference's text cleaning: drop control characters,
    NUL and U+FFFD; turn whitespace into a space. The fast tokenizer also drops
    private-use characters, which the reference keeps (so their word becomes
    [UNK]); replacing them by an unassigned character gives the same [UNK].

    Filled in as characters are met, which is quicker than all 1.1M up front.
    """

    def __missing__(self, code: int) -> str | None:
        category = unicodedata.category(chr(code))
        if code in (9, 10, 13) or category == "Zs":
            value: str | None = " "
        elif code in (0, 0xFFFD) or category in ("Cc", "Cf"):
            value = None
        elif category == "Co":
            value = _UNKNOWN_CHAR
        else:
            value = chr(code)
        self[code] = value
        return value


_CLEAN = _CleanTable()


def reference_clean(text: str, lowercase: bool) -> str:
    """Clean (and lowercase) ``text`` in Python, as the reference does, before the
    fast tokenizer sees it.

    The fast tokenizer lowercases character by character, so a capital sigma
    ending a word becomes "σ" where Python's ``str.lower`` (the reference) gives
    "ς"; cleaning first matters, as a removed control character can decide
    whether a sigma ends a word. ASCII text is cleaned and lowercased alike by
    both, so it is returned as it is.
    """
    if text.isascii():
        return text
    text = text.translate(_CLEAN)
    return text.lower() if lowercase else text


def encode_texts(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, exactly as the reference FullTokenizer gives them."""
    lowercase = bool(getattr(tokenizer.normalizer, "lowercase", False))
    texts = [reference_clean(text, lowercase) for text in texts]
    return [e.ids for e in tokenizer.encode_batch_fast(texts, add_special_tokens=False)]


def tokenize_documents(tokenizer: Tokenizer, documents: list[list[str]]) -> list[list[list[int]]]:
    """Token ids per sentence per document; empty sentences and documents are dropped."""
    encodings = encode_texts(tokenizer, [s for document in documents for s in document])
    result: list[list[list[int]]] = []
    start = 0
    for document in documents:
        ids = encodings[start:start + len(document)]
        start += len(document)
        ids = [sentence for sentence in ids if sentence]
        if ids:
            result.append(ids)
    return result
