"""The vocab as every part of the pipeline sees it: :class:`Vocabulary`, from a ``vocab.txt`` or a ``tokenizer.json``.

Wherever a vocab goes (``data create --vocab``, ``data.vocab``, ``data
inspect --vocab``, ``pick-eval --vocab``) either file works:

* ``vocab.txt`` -- google-research/bert's WordPiece vocab, one token per line
  (:mod:`.tokenizer`); encoded by :class:`.wordpiece.FastWordPiece`; masking
  keeps the reference's rules, so records equal its script's.
* ``tokenizer.json`` -- a Hugging Face ``tokenizers`` pipeline, such as
  ModernBERT's byte-level BPE (:mod:`.bpe`); encoded by :class:`.bpe.FastBPE`.
  The special tokens and their ids are read from it, and masking follows
  the natural rules (see :class:`Vocabulary`).

The file's kind is told from its content (a JSON object, or lines).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from .bpe import FastBPE, read_tokenizer_json, special_roles, word_continuations
from .errors import DataError, warn_no_word_pieces
from .tokenizer import CLS, MASK, PAD, SEP, UNK, SpecialIds, looks_like_json, read_vocab, subword_flags
from .wordpiece import FastWordPiece, TokenizedChunk


@dataclass(frozen=True, eq=False)
class Vocabulary:
    """A vocab's tokens, the roles of its special tokens, and what masking needs to know of it.

    ``continues[id]``: the token continues the word before it (whole-word
    masking groups it with that word). ``random_ids``: the ids a masked
    position shown as a random token draws from (uniformly). With
    ``reference_rules`` (a ``vocab.txt``) both are google-research/bert's:
    random tokens from the whole vocab, special and unused tokens included, and
    a ``##`` piece just after the middle [SEP] joins the last word before it.
    Without (a ``tokenizer.json``): random tokens from the non-special ones,
    and a word never spans a special token (as transformers'
    ``DataCollatorForLanguageModeling`` with ``whole_word_mask``).
    """

    tokens: tuple[str, ...]  # by id; "" where no token has the id
    roles: SpecialIds | None  # None: a role records need is missing (``missing`` says which)
    continues: np.ndarray
    random_ids: np.ndarray
    reference_rules: bool = True
    kind: str = "wordpiece"  # the model: wordpiece, bpe, unigram, wordlevel
    path: Path | None = None
    continuation: str = "## pieces"  # what continues a word, for messages
    missing: str = ""
    tokenizer: Tokenizer | None = None  # a tokenizer.json's pipeline
    spec: dict | None = None  # ... and its JSON

    @classmethod
    def wordpiece(cls, tokens: list[str], path: str | Path | None = None) -> Vocabulary:
        """A ``vocab.txt``'s tokens, in id order."""
        index = {token: i for i, token in enumerate(tokens)}  # a duplicate keeps its last id, as BERT's load_vocab
        absent = [token for token in (CLS, SEP, MASK) if token not in index]
        roles = None if absent else SpecialIds(index.get(PAD), index.get(UNK), index[CLS], index[SEP], index[MASK])
        return cls(tuple(tokens), roles, subword_flags(tokens), np.arange(len(tokens)),
                   path=None if path is None else Path(path), missing=f"no {', '.join(absent)} token")

    @classmethod
    def from_tokenizer_json(cls, path: str | Path) -> Vocabulary:
        """A ``tokenizer.json``'s vocab."""
        tokenizer, spec = read_tokenizer_json(path)
        ids = tokenizer.get_vocab(with_added_tokens=True)
        tokens = [""] * (max(ids.values(), default=-1) + 1)
        for token, i in ids.items():
            tokens[i] = token
        added = {i: t.special for i, t in tokenizer.get_added_tokens_decoder().items()}
        continues, rule = word_continuations(spec, tokens, added)
        special = np.array([added.get(i, False) or not token for i, token in enumerate(tokens)], bool)
        roles, missing = special_roles(tokenizer, spec)
        return cls(tuple(tokens), roles, continues, np.flatnonzero(~special), reference_rules=False,
                   kind=str(spec["model"].get("type", "")).lower(), path=Path(path), continuation=rule,
                   missing=missing, tokenizer=tokenizer, spec=spec)

    @property
    def specials(self) -> SpecialIds:
        """The ids of the special tokens; a DataError naming the file and the missing role when it lacks one."""
        return self.special_ids()

    def special_ids(self, consequence: str = "") -> SpecialIds:
        """:attr:`specials`, with ``consequence`` ending the error message."""
        if self.roles is None:
            raise DataError(f"{self.path or 'the vocab'}: {self.missing}{consequence}")
        return self.roles

    @property
    def size(self) -> int:
        """The model's ``vocab_size``: one more than the largest id."""
        return len(self.tokens)

    @functools.cached_property
    def fingerprint(self) -> str:
        """What ids mean: the sha256 of the tokens in id order (so the same vocab as a vocab.txt and
        as a tokenizer.json has the same one), 16 hex digits."""
        return hashlib.sha256("\n".join(self.tokens).encode("utf-8")).hexdigest()[:16]

    def identity(self) -> dict:
        """What a record file's header says of the tokenizer that made it."""
        return {"kind": self.kind, "name": self.path.name if self.path else "", "vocab_size": self.size,
                "fingerprint": self.fingerprint}

    def check_made(self, made_with: dict | None, records: str | Path, setting: str,
                   made: str = "the records were made with") -> None:
        """Refuse ``records`` when ``made_with`` (their header's tokenizer, None when it names none)
        is another vocab: the fingerprints differ. ``setting`` names where this vocab was given.
        The one check of "the same tokenizer": of records, and of a model (``made``: "the model
        was trained with", ``made_with``: the identity of the vocab beside its weights)."""
        if made_with is not None and made_with["fingerprint"] != self.fingerprint:
            raise DataError(f"{records}: made with the tokenizer {_describe(made_with)}, but {setting} {self.path} "
                            f"is {_describe(self.identity())}: use the tokenizer {made}")

    def encoder(self, lowercase: bool = True) -> FastWordPiece | FastBPE:
        """The fast encoder of documents (``lowercase``: for a vocab.txt; a tokenizer.json's own
        normalizer decides)."""
        if self.tokenizer is None:
            if self.path is None:
                raise ValueError("a vocab made from tokens alone has no encoder")
            return FastWordPiece(self.path, lowercase)
        assert self.spec is not None  # read with the tokenizer
        return FastBPE(self.tokenizer, self.spec)

    def encode_documents(self, documents: list[list[str]], lowercase: bool = True) -> TokenizedChunk:
        return self.encoder(lowercase).encode_documents(documents)

    def check_word_pieces(self, where: str) -> None:
        """Warn (naming ``where``) when no token continues a word: whole-word masking would then mask
        single tokens."""
        if not self.continues.any():
            warn_no_word_pieces(self.path or "the vocab", self.continuation, where)

    def token(self, token_id: int) -> str:
        """A token for a person to read; an id beyond the vocab as <id?>."""
        return self.tokens[token_id] if 0 <= token_id < len(self.tokens) and self.tokens[token_id] else f"<{token_id}?>"

    def decode(self, ids) -> str:
        """Ids as their tokens, separated by spaces."""
        return " ".join(map(self.token, ids))


def _describe(identity: dict) -> str:
    return (f"{identity['name'] or 'a vocab'} ({identity['kind']}, {identity['vocab_size']} tokens, "
            f"fingerprint {identity['fingerprint']})")


def is_tokenizer_json(path: str | Path) -> bool:
    """Whether ``path`` holds a JSON object (a tokenizer.json) rather than vocab lines."""
    try:
        with open(path, "rb") as file:
            return looks_like_json(file.read(64))
    except OSError:
        return False  # read_vocab names what is wrong


@functools.lru_cache(maxsize=8)
def _load(path: Path, resolved: Path, mtime_ns: int, size: int) -> Vocabulary:
    if is_tokenizer_json(resolved):
        return Vocabulary.from_tokenizer_json(path)
    return Vocabulary.wordpiece(read_vocab(path), path)


def load_vocab(path: str | Path) -> Vocabulary:
    """The vocab of a ``vocab.txt`` or ``tokenizer.json`` (read once while the file is unchanged)."""
    path = Path(path)
    try:
        stat = path.stat()
    except OSError:
        read_vocab(path)  # names the file: not found, or not readable
        raise
    return _load(path, path.resolve(), stat.st_mtime_ns, stat.st_size)


def check_model_vocab(vocab: str | Path, rows: int, own: str | Path | None, model: str | Path,
                      setting: str = "the vocab") -> None:
    """Refuse ``vocab`` (given as ``setting``) for the model at ``model``, of ``rows`` embedding rows,
    whose own vocab (beside its weights; None: it has none) is ``own``: another tokenizer by its
    fingerprint (``Vocabulary.check_made``), even one that fits the rows; then by size: a vocab.txt
    has a token per row, a tokenizer.json at most as many (tables are rounded up, as the published
    ModernBERTs' 50,368 rows for 50,280 tokens; rows past the tokenizer are never read).

    The rule of every job that takes a model and a vocab: fine-tuning, SQuAD, export."""
    given = load_vocab(vocab)
    if own is not None and Path(own).resolve() != Path(vocab).resolve():
        given.check_made(load_vocab(own).identity(), f"the model at {model}", setting,
                         "the model was trained with")
    if given.size > rows or (given.size != rows and not is_tokenizer_json(vocab)):
        raise DataError(f"{setting} {vocab} has {given.size} tokens but the model at {model} has "
                        f"vocab_size={rows}: not its vocab")


def vocab_size_of(vocab_path: str | Path) -> int:
    """The model's ``vocab_size`` for a vocab.txt (its lines) or a tokenizer.json (its largest id + 1)."""
    return load_vocab(vocab_path).size
