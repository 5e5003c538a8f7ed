"""Pre-training data: corpus -> WordPiece vocab -> masked next-sentence instances -> datasets.

Modules, in pipeline order:

* ``corpus``     -- documents as lists of sentences (built-in corpus, text files)
* ``tokenizer``  -- train / load a WordPiece vocab, tokenize documents
* ``instances``  -- BERT's instance creation and masking, padded into numpy arrays
* ``dataset``    -- the datasets the trainer reads, and ``build_datasets``
"""

from .dataset import PretrainingDataset, SyntheticDataset, build_datasets, decode_sample
from .errors import DataError
from .tokenizer import vocab_size_of

__all__ = ["DataError", "PretrainingDataset", "SyntheticDataset", "build_datasets", "decode_sample",
           "vocab_size_of"]
