"""The tokenizer of fine-tuning's text: a ``vocab.txt``'s BERT tokenizer or a ``tokenizer.json``'s whole pipeline.

:func:`task_tokenizer` reads either file (told apart by content, as
:func:`.vocab.load_vocab`). A ``vocab.txt`` gives :func:`.tokenizer.load_tokenizer`'s
WordPiece, whose features equal google-research/bert's (the tasks' own code).
A ``tokenizer.json`` gives a :class:`FastTokenizer`: the file's pipeline as
``transformers``' ``PreTrainedTokenizerFast(tokenizer_file=...)`` runs it, so
that features equal those of transformers' example scripts (``run_glue``,
``run_ner``, ``run_qa``): its normalizer (the file, not ``data.lowercase``,
decides the case), its post-processor's special tokens and type ids,
``tokenizers``' truncation, the character offsets and word ids of each token.
Special tokens written in the text are the special tokens, as in transformers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Encoding, Tokenizer

from .errors import DataError
from .tokenizer import SpecialIds, load_tokenizer
from .vocab import is_tokenizer_json, load_vocab


@dataclass(frozen=True, eq=False)
class FastTokenizer:
    """A ``tokenizer.json`` as fine-tuning reads text with it (see the module docstring).

    ``words`` encodes text already split into words (NER): the same pipeline,
    except that a byte-level pre-tokenizer puts a space before each word
    (``add_prefix_space``), the convention transformers' ``run_ner`` applies to
    RoBERTa-like tokenizers, so that every word is the ``Ġword`` of running
    text, as pre-training showed it.
    """

    tokenizer: Tokenizer
    words: Tokenizer
    specials: SpecialIds
    tokens: tuple[str, ...]  # by id; "" where no token has the id
    path: Path

    @classmethod
    def load(cls, path: str | Path) -> FastTokenizer:
        vocab = load_vocab(path)
        assert vocab.spec is not None  # a tokenizer.json
        specials = vocab.special_ids(": fine-tuning places its classifier and separator tokens")
        text = json.dumps(vocab.spec)
        tokenizer, words = Tokenizer.from_str(text), Tokenizer.from_str(json.dumps(words_spec(vocab.spec)))
        tokenizer.encode_special_tokens = words.encode_special_tokens = False  # as transformers: "[MASK]" is the mask
        return cls(tokenizer, words, specials, vocab.tokens, Path(path))

    @property
    def pad_id(self) -> int:
        """The id padding takes: the [PAD] token's, else 0."""
        return self.specials.pad if self.specials.pad is not None else 0

    def encode(self, first: list[str], second: list[str] | None = None, max_length: int | None = None,
               strategy: str = "longest_first", stride: int = 0) -> list[Encoding]:
        """Each text (or pair) with the post-processor's special tokens, cut to ``max_length`` tokens by
        ``tokenizers``' ``strategy`` (what ``truncation=True`` / ``"only_second"`` ask of it); the
        windows past the first are each encoding's ``overflowing`` (``stride`` tokens overlapping)."""
        self.tokenizer.no_truncation()
        if second is not None and max_length is not None and stride and strategy == "only_second":
            self._check_room(first, second, max_length, stride)
        if max_length is not None:
            try:
                self.tokenizer.enable_truncation(max_length, stride=stride, strategy=strategy)
            except Exception as err:  # tokenizers: a stride too large for max_length
                raise DataError(f"{self.path}: max_length={max_length} with stride={stride}: {err}") from None
        inputs: list = first if second is None else list(zip(first, second, strict=True))
        try:
            return self.tokenizer.encode_batch(inputs, add_special_tokens=True)
        except Exception as err:  # tokenizers: a pair that cannot be cut so
            raise DataError(f"{self.path}: {str(err).splitlines()[0] if str(err) else type(err).__name__}") from None

    def _check_room(self, first: list[str], second: list[str], max_length: int, stride: int) -> None:
        """Refuse, in one line naming the pair, a first text that leaves the second ``stride`` tokens or
        fewer of ``max_length`` when the pair must be cut: ``tokenizers`` panics there (a Rust panic,
        past ``except Exception``)."""
        specials = self.tokenizer.num_special_tokens_to_add(True)
        for k, encoding in enumerate(self.tokenizer.encode_batch(first, add_special_tokens=False)):
            room = max_length - specials - len(encoding.ids)
            if room <= stride and len(self.tokenizer.encode(first[k], second[k]).ids) > max_length:
                raise DataError(f"{self.path}: pair {k}: its first text is {len(encoding.ids)} tokens, which with "
                                f"{specials} special tokens leave {room} of max_length={max_length} to the second, "
                                f"not more than stride={stride} (only the second is cut): give a larger max_length "
                                f"or a smaller stride")

    def encode_words(self, sentences: list[list[str]]) -> list[Encoding]:
        """Sentences given as words, without special tokens: each token's word in ``word_ids``."""
        return self.words.encode_batch(sentences, is_pretokenized=True, add_special_tokens=False)


def words_spec(spec: dict) -> dict:
    """A copy of a ``tokenizer.json``'s contents that encodes as ``FastTokenizer.words`` does: its
    byte-level pre-tokenizer puts a space before the text (``add_prefix_space``), so a text's first
    word is ``Ġword`` as the others are. A NER export carries it, so that transformers'
    token-classification pipeline encodes a sentence as typed as fine-tuning encoded its words."""
    spec = json.loads(json.dumps(spec))
    for pre in _byte_level(spec.get("pre_tokenizer")):
        pre["add_prefix_space"] = True
    return spec


def prefixes_words(spec: dict) -> bool:
    """Whether ``words_spec`` changes how ``spec`` encodes: it has a byte-level step without the prefix space."""
    return any(not pre.get("add_prefix_space") for pre in _byte_level(spec.get("pre_tokenizer")))


def _byte_level(pre: dict | None) -> list[dict]:
    """The byte-level steps of a pre-tokenizer (itself, or inside a Sequence)."""
    if not isinstance(pre, dict):
        return []
    steps = (pre.get("pretokenizers") or []) if pre.get("type") == "Sequence" else [pre]
    return [step for step in steps if isinstance(step, dict) and step.get("type") == "ByteLevel"]


def task_tokenizer(path: str | Path, lowercase: bool = True) -> Tokenizer | FastTokenizer:
    """Fine-tuning's tokenizer for a ``vocab.txt`` (BERT's, ``lowercase`` or not) or a ``tokenizer.json``."""
    return FastTokenizer.load(path) if is_tokenizer_json(path) else load_tokenizer(path, lowercase)
