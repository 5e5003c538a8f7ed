"""Datasets the training loop reads, and :func:`build_datasets`, which makes them from a config.

A dataset hands out batches as dicts of tensors with the keys of
``bertforge.models.bert.pretraining_loss``: ``input_ids``, ``token_type_ids``,
``attention_mask`` (left out when no row has padding), ``masked_lm_positions``,
``masked_lm_ids``, ``masked_lm_weights`` and ``next_sentence_labels``, in the
compact dtypes of :meth:`.rows.PretrainingArrays.to_torch`; packed rows
give the keys of :meth:`.rows.PackedArrays.to_torch` instead.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bertforge.config import DataConfig

from .corpus import builtin_corpus, read_text_corpus
from .errors import DataError, warn_one_document, warn_prediction_cap
from .instances import create_arrays_mlm, create_instances, to_arrays
from .rows import PretrainingArrays, Rows
from .tokenizer import train_wordpiece
from .vocab import load_vocab

log = logging.getLogger(__name__)

EVAL_SEED_OFFSET = 1  # the eval set's instances use data.seed + this


class PretrainingDataset(torch.utils.data.Dataset):
    """Pre-training instances (or packed rows) held as numpy arrays.

    ``batch(indices)`` gathers many rows at once; it is much faster than a
    DataLoader collating ``__getitem__`` results one by one.
    """

    def __init__(self, arrays: Rows, always_mask: bool = False):
        self.arrays = arrays
        self.always_mask = always_mask  # batches without padding keep their mask (rows.to_torch)

    def __len__(self) -> int:
        return len(self.arrays)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {key: value[0] for key, value in self.batch([index]).items()}

    def batch(self, indices: Sequence[int] | np.ndarray) -> dict[str, torch.Tensor]:
        return self.arrays.take(np.asarray(indices, dtype=np.int64)).to_torch(self.always_mask)


class SyntheticDataset(PretrainingDataset):
    """Random tokens of the right shapes, for benchmarks without a corpus.

    Deterministic for a seed. Every position is a real token and
    ``max_predictions`` positions (never [CLS]) are predicted. Only ``pool``
    distinct rows are made; index i returns row ``i % pool``, which keeps memory
    small for any ``size`` and costs a benchmark nothing.
    """

    def __init__(self, size: int, vocab_size: int, seq_len: int = 128,
                 max_predictions: int = 20, seed: int = 0, pool: int = 4096):
        if not 0 < max_predictions < seq_len:
            raise ValueError(f"max_predictions={max_predictions} must be in 1..seq_len-1")
        self.size = size
        rng = np.random.default_rng(seed)
        n = min(size, pool)
        # Distinct positions per row: the first max_predictions of a random
        # permutation of 1..seq_len-1 (position 0 stands for [CLS]).
        order = np.argsort(rng.random((n, seq_len - 1)), axis=1)
        positions = np.sort(order[:, :max_predictions] + 1, axis=1)
        segment_ids = np.zeros((n, seq_len), np.int8)
        segment_ids[:, seq_len // 2:] = 1
        super().__init__(PretrainingArrays(
            input_ids=rng.integers(0, vocab_size, (n, seq_len), dtype=np.int32),
            segment_ids=segment_ids,
            input_mask=np.ones((n, seq_len), np.int8),
            masked_lm_positions=positions.astype(np.int32),
            masked_lm_ids=rng.integers(0, vocab_size, (n, max_predictions), dtype=np.int32),
            masked_lm_weights=np.ones((n, max_predictions), np.float32),
            next_sentence_labels=rng.integers(0, 2, n, dtype=np.int64),
        ))

    def __len__(self) -> int:
        return self.size

    def batch(self, indices: Sequence[int] | np.ndarray) -> dict[str, torch.Tensor]:
        rows = np.asarray(indices, dtype=np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= self.size):
            raise IndexError(f"index out of range for a dataset of {self.size}")
        return super().batch(rows % len(self.arrays))


# ---------------------------------------------------------------- building from a config

def split_documents(documents: list, eval_fraction: float) -> tuple[list, list]:
    """(train, eval): every k-th document, evenly spread, goes to eval.

    At least one document each; independent of the seed, so runs with different
    seeds evaluate on the same text.
    """
    n = len(documents)
    if n < 2:
        raise DataError(f"the corpus has {n} document(s); at least 2 are needed "
                        "to hold one out for evaluation")
    n_eval = min(n - 1, max(1, round(n * eval_fraction)))
    eval_index = {int((j + 0.5) * n / n_eval) for j in range(n_eval)}
    train = [d for i, d in enumerate(documents) if i not in eval_index]
    held_out = [d for i, d in enumerate(documents) if i in eval_index]
    return train, held_out


def build_datasets(data: DataConfig, work_dir: Path, mlm_only: bool = False,
                   ) -> tuple[PretrainingDataset, PretrainingDataset, Path]:
    """(train, eval, vocab path) for a data config; the same config gives the same arrays.

    Sentence pairs for masked LM + NSP, as google-research/bert makes them; with
    ``mlm_only``, rows of whole sentences of contiguous text (:func:`.instances.create_arrays_mlm`).

    The corpus is ``data.input`` (a file or directory of text) or, if empty,
    the built-in corpus. A WordPiece vocab is trained on the train documents and
    written to ``work_dir/vocab.txt`` unless ``data.vocab`` names one (a vocab.txt
    or a tokenizer.json, see :mod:`.vocab`). ``data.synthetic`` is not looked at
    here: the caller builds a :class:`SyntheticDataset` instead.
    """
    start = time.perf_counter()
    documents = read_text_corpus(data.input) if data.input else builtin_corpus()
    train_docs, eval_docs = split_documents(documents, data.eval_fraction)
    for docs, where in ((train_docs, " in the training set"), (eval_docs, " in the eval set")):
        if len(docs) == 1 and not mlm_only:
            warn_one_document(data.input or "the built-in corpus", where)

    if data.vocab:
        vocab_path = Path(data.vocab)
    else:
        vocab_path = train_wordpiece(train_docs, data.vocab_size, Path(work_dir) / "vocab.txt",
                                     lowercase=data.lowercase)
    vocab = load_vocab(vocab_path)
    vocab.special_ids()  # a vocab without [CLS], [SEP] or [MASK] is named before any work
    encoder = vocab.encoder(data.lowercase)
    if data.whole_word_mask:
        vocab.check_word_pieces("data.whole_word_mask")
    options: dict[str, Any] = dict(seq_len=data.seq_len, max_predictions=data.max_predictions,
                                   masked_lm_prob=data.masked_lm_prob, vocab=vocab, whole_word=data.whole_word_mask)
    warn_prediction_cap(data.seq_len, data.max_predictions, data.masked_lm_prob, "data")

    datasets = []
    for docs, dupe_factor, seed in ((train_docs, data.dupe_factor, data.seed),
                                    # eval: the same text masked dupe_factor ways, a steadier estimate
                                    (eval_docs, data.dupe_factor, data.seed + EVAL_SEED_OFFSET)):
        chunk = encoder.encode_documents(docs)
        if mlm_only:
            arrays = create_arrays_mlm(chunk.tokens, chunk.sentence_offsets, chunk.document_offsets,
                                       dupe_factor=dupe_factor, rng=np.random.default_rng(seed), **options)
        else:
            instances = create_instances(chunk.as_lists(), short_seq_prob=data.short_seq_prob,
                                         dupe_factor=dupe_factor, rng=random.Random(seed), **options)
            arrays = to_arrays(instances, data.seq_len, data.max_predictions)
        if not len(arrays):
            raise DataError(f"{data.input or 'the built-in corpus'}: no text left after tokenizing")
        datasets.append(PretrainingDataset(arrays))
    train, held_out = datasets
    log.info("data: %d train / %d eval documents -> %d / %d instances, vocab %s (%d tokens), %.1fs",
             len(train_docs), len(eval_docs), len(train), len(held_out), vocab_path,
             vocab.size, time.perf_counter() - start)
    return train, held_out, vocab_path


def decode_sample(batch: dict[str, torch.Tensor], vocab_path: str | Path, row: int = 0) -> str:
    """One sequence (or packed row) of a batch as the model sees it (masks included), for a person to read."""
    mask = batch.get("sequence_ids", batch.get("attention_mask"))  # neither: no padding
    ids = batch["input_ids"][row] if mask is None else batch["input_ids"][row][mask[row].bool()]
    return load_vocab(vocab_path).decode(ids.tolist())
