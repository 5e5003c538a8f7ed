"""Pre-training data: corpus -> vocab (WordPiece or BPE) -> masked instances -> datasets.

Modules, in pipeline order:

* ``text``       -- text input: files, globs and directories; blank-line documents; byte ranges
* ``corpus``     -- documents as lists of sentences (built-in corpus, text files)
* ``tokenizer``  -- train / load a WordPiece vocab, tokenize documents
* ``wordpiece``  -- the same ids, fast, for whole corpora (``bertforge data create``)
* ``bpe``        -- tokenizer.json vocabs (byte-level BPE, as ModernBERT's): train, read, fast ids
* ``vocab``      -- ``Vocabulary``: either kind as every step sees it (special ids, words, size)
* ``instances``  -- BERT's instance creation and masking, padded into numpy arrays
* ``dataset``    -- the datasets the trainer reads, and ``build_datasets``

The dataset names need torch and are imported on first use: the ``bertforge
data`` commands import this package and never need torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import DataError
from .vocab import vocab_size_of

if TYPE_CHECKING:
    from .dataset import PretrainingDataset, SyntheticDataset, build_datasets, decode_sample

_FROM_DATASET = ("PretrainingDataset", "SyntheticDataset", "build_datasets", "decode_sample")


def __getattr__(name: str):
    if name in _FROM_DATASET:
        from . import dataset

        value = getattr(dataset, name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_FROM_DATASET))


__all__ = ["DataError", "PretrainingDataset", "SyntheticDataset", "build_datasets", "decode_sample",
           "vocab_size_of"]
