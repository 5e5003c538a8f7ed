"""Pre-training instances: next-sentence pairs with masked-LM predictions.

This follows google-research/bert's ``create_pretraining_data.py``: the same
sequence packing, next-sentence sampling, truncation and 80/10/10 masking, and
the same order of draws from one ``random.Random``, so the same documents and
seed give the very same instances (tests/test_data.py checks this against the
reference). It works on token ids instead of strings. Whole-word masking is
not implemented.

An instance is ``[CLS] A [SEP] B [SEP]``; B is the text that follows A in the
same document or, half of the time, a span of another document
(``is_random_next``; next_sentence_label 1).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from .tokenizer import SpecialIds

TokenDocument = list[list[int]]  # token ids per sentence


@dataclass(slots=True)
class Instance:
    """One training sequence before padding.

    ``tokens`` is the original text; ``masked_positions`` (sorted) are the
    positions to predict and ``replacements`` what the input shows there
    ([MASK], the original token or a random one).
    """

    tokens: list[int]  # [CLS] A [SEP] B [SEP]
    num_a: int  # tokens in A: segment 0 is the first num_a + 2 positions
    is_random_next: bool
    masked_positions: list[int]
    replacements: list[int]

    def input_ids(self) -> list[int]:
        ids = list(self.tokens)
        for position, token in zip(self.masked_positions, self.replacements):
            ids[position] = token
        return ids


@dataclass
class PretrainingArrays:
    """Padded instances, one row each; padding is 0 everywhere."""

    input_ids: np.ndarray  # (N, T) int32
    segment_ids: np.ndarray  # (N, T) int8: 0 for [CLS] A [SEP], 1 for B [SEP]
    input_mask: np.ndarray  # (N, T) int8: 1 on real tokens
    masked_lm_positions: np.ndarray  # (N, P) int32
    masked_lm_ids: np.ndarray  # (N, P) int32: the original tokens there
    masked_lm_weights: np.ndarray  # (N, P) float32: 1 for real predictions
    next_sentence_labels: np.ndarray  # (N,) int64: 0 = B follows A, 1 = B is random

    def __len__(self) -> int:
        return len(self.input_ids)


def create_instances(documents: list[TokenDocument], *, seq_len: int, max_predictions: int,
                     masked_lm_prob: float, short_seq_prob: float, dupe_factor: int,
                     vocab_size: int, specials: SpecialIds, rng: random.Random) -> list[Instance]:
    """All instances of ``dupe_factor`` passes over the documents, shuffled.

    Each pass packs and masks every document anew, so the passes differ.
    """
    documents = [d for d in documents if d]
    rng.shuffle(documents)
    instances: list[Instance] = []
    for _ in range(dupe_factor):
        for index in range(len(documents)):
            instances.extend(_document_instances(
                documents, index, seq_len, short_seq_prob, masked_lm_prob, max_predictions,
                vocab_size, specials, rng))
    rng.shuffle(instances)
    return instances


def _document_instances(documents: list[TokenDocument], index: int, seq_len: int,
                        short_seq_prob: float, masked_lm_prob: float, max_predictions: int,
                        vocab_size: int, specials: SpecialIds,
                        rng: random.Random) -> list[Instance]:
    document = documents[index]
    max_num_tokens = seq_len - 3  # room for [CLS], [SEP], [SEP]
    # Mostly fill the sequence (padding is wasted compute), but sometimes aim
    # shorter so that pre-training also sees the short inputs of fine-tuning.
    target_len = max_num_tokens
    if rng.random() < short_seq_prob:
        target_len = rng.randint(2, max_num_tokens)

    # A and B are cut at sentence boundaries, not at arbitrary tokens, so that
    # next-sentence prediction is about sentences.
    instances: list[Instance] = []
    chunk: list[list[int]] = []
    chunk_len = 0
    i = 0
    while i < len(document):
        chunk.append(document[i])
        chunk_len += len(document[i])
        if i == len(document) - 1 or chunk_len >= target_len:
            a_end = rng.randint(1, len(chunk) - 1) if len(chunk) >= 2 else 1
            tokens_a = [t for sentence in chunk[:a_end] for t in sentence]
            if len(chunk) == 1 or rng.random() < 0.5:
                is_random_next = True
                tokens_b = _random_span(documents, index, target_len - len(tokens_a), rng)
                i -= len(chunk) - a_end  # the unused sentences start the next chunk
            else:
                is_random_next = False
                tokens_b = [t for sentence in chunk[a_end:] for t in sentence]
            _truncate_pair(tokens_a, tokens_b, max_num_tokens, rng)
            tokens = [specials.cls, *tokens_a, specials.sep, *tokens_b, specials.sep]
            positions, replacements = _mask(tokens, len(tokens_a), masked_lm_prob,
                                            max_predictions, vocab_size, specials.mask, rng)
            instances.append(Instance(tokens, len(tokens_a), is_random_next,
                                      positions, replacements))
            chunk = []
            chunk_len = 0
        i += 1
    return instances


def _random_span(documents: list[TokenDocument], index: int, target_len: int,
                 rng: random.Random) -> list[int]:
    """Whole sentences of another document, from a random start, about target_len tokens."""
    # A few tries to avoid the current document; with one document it is reused.
    for _ in range(10):
        other = rng.randint(0, len(documents) - 1)
        if other != index:
            break
    document = documents[other]
    tokens: list[int] = []
    for sentence in document[rng.randint(0, len(document) - 1):]:
        tokens.extend(sentence)
        if len(tokens) >= target_len:
            break
    return tokens


def _truncate_pair(tokens_a: list[int], tokens_b: list[int], max_num_tokens: int,
                   rng: random.Random) -> None:
    """Trim the longer side, one token at a time from a random end, until both fit."""
    while len(tokens_a) + len(tokens_b) > max_num_tokens:
        longer = tokens_a if len(tokens_a) > len(tokens_b) else tokens_b
        if rng.random() < 0.5:
            del longer[0]
        else:
            longer.pop()


def _mask(tokens: list[int], num_a: int, masked_lm_prob: float, max_predictions: int,
          vocab_size: int, mask_id: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """Positions to predict (sorted) and what the input shows there.

    80% [MASK], 10% the original token, 10% a random token of the vocab.
    """
    special = {0, num_a + 1, len(tokens) - 1}  # [CLS], [SEP], [SEP]
    candidates = [i for i in range(len(tokens)) if i not in special]
    rng.shuffle(candidates)
    num_to_predict = min(max_predictions, max(1, round(len(tokens) * masked_lm_prob)))
    chosen: dict[int, int] = {}
    for position in candidates[:num_to_predict]:
        if rng.random() < 0.8:
            chosen[position] = mask_id
        elif rng.random() < 0.5:
            chosen[position] = tokens[position]
        else:
            chosen[position] = rng.randint(0, vocab_size - 1)
    positions = sorted(chosen)
    return positions, [chosen[p] for p in positions]


def to_arrays(instances: list[Instance], seq_len: int, max_predictions: int) -> PretrainingArrays:
    """Pad instances into fixed-shape arrays (the layout of BERT's TFRecords)."""
    n = len(instances)
    arrays = PretrainingArrays(
        input_ids=np.zeros((n, seq_len), np.int32),
        segment_ids=np.zeros((n, seq_len), np.int8),
        input_mask=np.zeros((n, seq_len), np.int8),
        masked_lm_positions=np.zeros((n, max_predictions), np.int32),
        masked_lm_ids=np.zeros((n, max_predictions), np.int32),
        masked_lm_weights=np.zeros((n, max_predictions), np.float32),
        next_sentence_labels=np.zeros(n, np.int64),
    )
    for row, instance in enumerate(instances):
        length = len(instance.tokens)
        if length > seq_len or len(instance.masked_positions) > max_predictions:
            raise ValueError(f"instance {row} does not fit seq_len={seq_len}, "
                             f"max_predictions={max_predictions}")
        arrays.input_ids[row, :length] = instance.input_ids()
        arrays.segment_ids[row, instance.num_a + 2:length] = 1
        arrays.input_mask[row, :length] = 1
        k = len(instance.masked_positions)
        arrays.masked_lm_positions[row, :k] = instance.masked_positions
        arrays.masked_lm_ids[row, :k] = [instance.tokens[p] for p in instance.masked_positions]
        arrays.masked_lm_weights[row, :k] = 1.0
        arrays.next_sentence_labels[row] = int(instance.is_random_next)
    return arrays
