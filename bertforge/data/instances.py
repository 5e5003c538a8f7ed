"""Pre-training instances: next-sentence pairs with masked-LM predictions.

This follows google-research/bert's ``create_pretraining_data.py``: the same
sequence packing, next-sentence sampling, truncation and 80/10/10 masking, and
the same order of draws from one ``random.Random``, so the same documents and
seed give the very same instances (tests/data/test_data.py checks this against the
reference). It works on token ids instead of strings, and takes the special
ids, the random replacements and the word boundaries from a
:class:`.vocab.Vocabulary` (for a ``vocab.txt``, the reference's). Whole-word
masking (``whole_word``) is the reference's ``--do_whole_word_mask``: a
word's pieces (``vocab.continues``) are predicted together or not at all.

:func:`create_arrays_fast` is the same algorithm with the same distributions
drawn differently: with numpy, for many documents at once, straight into
padded arrays (``bertforge data create --mode fast``).

An instance is ``[CLS] A [SEP] B [SEP]``; B is the text that follows A in the
same document or, half of the time, a span of another document
(``is_random_next``; next_sentence_label 1).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from .rows import PretrainingArrays
from .tokenizer import SpecialIds
from .vocab import Vocabulary

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


@dataclass(frozen=True)
class _MaskRules:
    """What :func:`_mask` takes from the vocab, as Python lists (it draws one position at a time)."""

    mask_id: int
    random_ids: list[int]
    continues: list[bool] | None  # None: single positions, not whole words
    words_span_specials: bool

    @classmethod
    def of(cls, vocab: Vocabulary, whole_word: bool) -> _MaskRules:
        return cls(vocab.specials.mask, vocab.random_ids.tolist(), vocab.continues.tolist() if whole_word else None,
                   vocab.reference_rules)


def create_instances(documents: list[TokenDocument], *, seq_len: int, max_predictions: int,
                     masked_lm_prob: float, short_seq_prob: float, dupe_factor: int,
                     vocab: Vocabulary, rng: random.Random, whole_word: bool = False) -> list[Instance]:
    """All instances of ``dupe_factor`` passes over the documents, shuffled.

    Each pass packs and masks every document anew, so the passes differ. With
    ``whole_word`` whole words are masked.
    """
    documents = [d for d in documents if d]
    rng.shuffle(documents)
    rules = _MaskRules.of(vocab, whole_word)
    instances: list[Instance] = []
    for _ in range(dupe_factor):
        for index in range(len(documents)):
            instances.extend(_document_instances(
                documents, index, seq_len, short_seq_prob, masked_lm_prob, max_predictions,
                vocab.specials, rules, rng))
    rng.shuffle(instances)
    return instances


def _document_instances(documents: list[TokenDocument], index: int, seq_len: int,
                        short_seq_prob: float, masked_lm_prob: float, max_predictions: int,
                        specials: SpecialIds, rules: _MaskRules, rng: random.Random) -> list[Instance]:
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
            positions, replacements = _mask(tokens, len(tokens_a), masked_lm_prob, max_predictions, rules, rng)
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
          rules: _MaskRules, rng: random.Random) -> tuple[list[int], list[int]]:
    """Positions to predict (sorted) and what the input shows there.

    The reference's draws in its order: the candidates ([CLS] and [SEP] are
    not) in groups, shuffled; groups are taken whole while they fit the
    number to predict; each taken position shows [MASK] 80%, its own token
    10%, a random token 10% (of the vocab; of ``rules.random_ids``). A group is
    one position, or with ``rules.continues`` a word: a continuing piece joins
    the group before it (the group before the middle [SEP] too, as in the
    reference, where ``rules.words_span_specials``).
    """
    special = {0, num_a + 1, len(tokens) - 1}  # [CLS], [SEP], [SEP]
    continues, random_ids = rules.continues, rules.random_ids
    groups: list[list[int]] = []
    for i in range(len(tokens)):
        if i in special:
            continue
        if (continues is not None and groups and continues[tokens[i]]
                and (rules.words_span_specials or i - 1 not in special)):
            groups[-1].append(i)
        else:
            groups.append([i])
    rng.shuffle(groups)
    num_to_predict = min(max_predictions, max(1, round(len(tokens) * masked_lm_prob)))
    chosen: dict[int, int] = {}
    for group in groups:
        if len(chosen) >= num_to_predict:
            break
        if len(chosen) + len(group) > num_to_predict:
            continue
        for position in group:
            if rng.random() < 0.8:
                chosen[position] = rules.mask_id
            elif rng.random() < 0.5:
                chosen[position] = tokens[position]
            else:
                chosen[position] = random_ids[rng.randint(0, len(random_ids) - 1)]
    positions = sorted(chosen)
    return positions, [chosen[p] for p in positions]


def to_arrays(instances: list[Instance], seq_len: int, max_predictions: int) -> PretrainingArrays:
    """Pad instances into fixed-shape arrays (the layout of BERT's TFRecords)."""
    n = len(instances)
    arrays = PretrainingArrays.zeros(n, seq_len, max_predictions)
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


# ---------------------------------------------------------------- fast, vectorised generation

def create_arrays_fast(tokens: np.ndarray, sentence_offsets: np.ndarray,
                       document_offsets: np.ndarray, *, seq_len: int, max_predictions: int,
                       masked_lm_prob: float, short_seq_prob: float, dupe_factor: int,
                       vocab: Vocabulary, rng: np.random.Generator, whole_word: bool = False) -> PretrainingArrays:
    """BERT's instances for a block of documents, drawn with numpy, already padded and shuffled.

    The documents are given flat: ``tokens`` holds every token id; sentence s is
    ``tokens[sentence_offsets[s]:sentence_offsets[s + 1]]`` and document d is
    sentences ``document_offsets[d]`` to ``document_offsets[d + 1]`` (no empty
    sentence or document). The algorithm is :func:`create_instances`' with the
    same distributions, not the same draws:

    * per document and pass, the target length is ``seq_len - 3``, or with
      probability ``short_seq_prob`` uniform in ``2..seq_len - 3``;
    * sentences are gathered until the target is reached or the document ends;
      A is the first 1..n-1 of them (uniform), B the rest, or with probability
      1/2 (always when n == 1) whole sentences of another document from a
      uniform random start, and then the unused sentences start the next pair;
    * the longer side is trimmed, a token at a time from a random end; the
      lengths this ends at are computed in closed form and the number trimmed
      from the front is Binomial(trimmed, 1/2), which is the same law;
    * ``min(max_predictions, max(1, round(len * masked_lm_prob)))`` distinct
      positions (never [CLS] or [SEP]), uniform (with ``whole_word``, whole
      words as :func:`whole_word_positions` draws them); 80% [MASK], 10% kept,
      10% a uniform random id of ``vocab.random_ids``.

    The one difference: a random B comes from another document of this block,
    and the reference's 10 tries to avoid the same document become one exact
    draw among the others (a single document is its own random next, as there).
    The instances of all passes are shuffled together. The same inputs and
    generator state give the same arrays (numpy does not promise the same
    streams across its versions).
    """
    max_num_tokens = seq_len - 3
    a_start, a_len, b_start, b_len, random_next = _pair_spans(
        np.asarray(sentence_offsets, np.int64), np.asarray(document_offsets, np.int64),
        max_num_tokens, short_seq_prob, dupe_factor, rng)
    a_keep, b_keep = truncated_lengths(a_len, b_len, max_num_tokens)
    # Tokens trimmed from the front: each trimmed token was a fair coin flip.
    a_start = a_start + rng.binomial(a_len - a_keep, 0.5)
    b_start = b_start + rng.binomial(b_len - b_keep, 0.5)
    order = rng.permutation(len(a_start))
    arrays = _pack(np.asarray(tokens), a_start[order], a_keep[order], b_start[order],
                   b_keep[order], random_next[order], seq_len, max_predictions, vocab.specials)
    _mask_arrays(arrays, a_keep[order], masked_lm_prob, vocab, rng, whole_word)
    return arrays


def truncated_lengths(a_len: np.ndarray, b_len: np.ndarray,
                      max_num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """The lengths :func:`_truncate_pair` ends at, for arrays of pairs.

    Trimming always shortens the longer side (B on a tie), so the longer one
    comes down to the other's length and then they alternate: A keeps
    ``max(ceil(max/2), max - len_b)`` tokens at most, B the rest.
    """
    a_keep = np.minimum(a_len, np.maximum((max_num_tokens + 1) // 2, max_num_tokens - b_len))
    b_keep = np.minimum(b_len, max_num_tokens - a_keep)
    return a_keep, b_keep


def _pair_spans(cum: np.ndarray, doc_offsets: np.ndarray, max_num_tokens: int,
                short_seq_prob: float, dupe_factor: int, rng: np.random.Generator):
    """Token spans of A and B for every pair of every pass over every document.

    Each (pass, document) is a stream that walks its document pair by pair:
    from sentence s it gathers sentences to the target length, splits them
    into A and B and continues at the next unused sentence. A walk visits each
    sentence at most once, going forward, so the draws of the step that starts
    at sentence s can be made in advance for every (stream, s): the steps are
    then fixed "next" pointers, and the sentences each walk visits are found
    for all streams at once by binary lifting (doubling the pointers). No
    Python loop per pair; uniform integers are floor(u * n) from 53-bit floats.
    """
    first, end = doc_offsets[:-1], doc_offsets[1:]
    num_docs, sizes = len(first), end - first
    doc = np.tile(np.arange(num_docs), dupe_factor)  # the document of each stream
    streams = len(doc)
    target = np.full(streams, max_num_tokens, np.int64)
    short = rng.random(streams) < short_seq_prob
    target[short] = rng.integers(2, max_num_tokens + 1, int(short.sum()))
    # Positions: every (stream, sentence of its document), stream by stream.
    count = sizes[doc]
    base = np.cumsum(count) - count  # each stream's first position
    total = int(count.sum())
    stream = np.repeat(np.arange(streams), count)
    position = np.arange(total)
    sentence = first[doc][stream] + position - base[stream]
    goal, stop = target[stream], end[doc][stream]
    # The step from each sentence: the chunk runs to `last` (the target length or
    # the document's end); A takes its first a_end sentences.
    last = np.minimum(np.searchsorted(cum, cum[sentence] + goal, "left") - 1, stop - 1)
    n = last - sentence + 1
    u = rng.random((4, total))
    a_end = 1 + (u[0] * np.maximum(n - 1, 1)).astype(np.int64)  # 1..n-1, or 1 when n == 1
    random_next = (n == 1) | (u[1] < 0.5)
    # A random B leaves the chunk's unused sentences for the next pair.
    following = np.where(random_next, sentence + a_end, last + 1)
    sink = total  # past the end of every walk
    jump = np.append(np.where(following < stop, position + following - sentence, sink), sink)
    jumps = [jump]  # jumps[k][p]: the position 2**k steps after p
    while (1 << len(jumps)) <= int(sizes.max(initial=1)):
        jumps.append(jumps[-1][jumps[-1]])
    # Each position's walk from its stream's start, as far as it can go without passing it.
    reached = base[stream]
    for jump in reversed(jumps):
        ahead = jump[reached]
        reached = np.where(ahead <= position, ahead, reached)
    visited = np.flatnonzero(reached == position)

    s, a_end, last = sentence[visited], a_end[visited], last[visited]
    random_next, own = random_next[visited], doc[stream[visited]]
    a_start, a_stop = cum[s], cum[s + a_end]
    # A random B: whole sentences of another document (uniform), from a uniform start.
    if num_docs > 1:
        other = (u[2, visited] * (num_docs - 1)).astype(np.int64)
        other += other >= own
    else:
        other = own
    start = first[other] + (u[3, visited] * sizes[other]).astype(np.int64)
    wanted = cum[start] + goal[visited] - (a_stop - a_start)
    stop_b = np.clip(np.searchsorted(cum, wanted, "left") - 1, start, end[other] - 1)
    b_start = np.where(random_next, cum[start], a_stop)
    b_stop = np.where(random_next, cum[stop_b + 1], cum[last + 1])
    return a_start, a_stop - a_start, b_start, b_stop - b_start, random_next


def _pack(tokens: np.ndarray, a_start: np.ndarray, a_len: np.ndarray, b_start: np.ndarray,
          b_len: np.ndarray, random_next: np.ndarray, seq_len: int, max_predictions: int,
          specials: SpecialIds) -> PretrainingArrays:
    """[CLS] A [SEP] B [SEP] rows, zero-padded, without masks yet."""
    n = len(a_start)
    # Zeros around the tokens, so that every column reads inside the array.
    pad = seq_len + 2
    padded = np.zeros(len(tokens) + 2 * pad, np.int32)
    padded[pad:pad + len(tokens)] = tokens
    col = np.arange(seq_len, dtype=np.int32)[None, :]
    a_len_ = a_len.astype(np.int32)[:, None]
    length = (a_len + b_len + 3).astype(np.int32)[:, None]
    # Column c shows tokens[a_start + c - 1] in A, tokens[b_start + c - a_len - 2] in B.
    source = col + np.where(col <= a_len_, (a_start + pad - 1).astype(np.int32)[:, None],
                            (b_start + pad - a_len - 2).astype(np.int32)[:, None])
    input_mask = col < length
    input_ids = np.where(input_mask, padded[source], 0)
    rows = np.arange(n)
    input_ids[:, 0] = specials.cls
    input_ids[rows, a_len + 1] = specials.sep
    input_ids[rows, a_len + b_len + 2] = specials.sep
    return PretrainingArrays(
        input_ids=input_ids,
        segment_ids=((col > a_len_ + 1) & input_mask).view(np.int8),
        input_mask=input_mask.view(np.int8),
        masked_lm_positions=np.zeros((n, max_predictions), np.int32),
        masked_lm_ids=np.zeros((n, max_predictions), np.int32),
        masked_lm_weights=np.zeros((n, max_predictions), np.float32),
        next_sentence_labels=random_next.astype(np.int64),
    )


def word_starts(ids: np.ndarray, positions: np.ndarray, vocab: Vocabulary) -> np.ndarray:
    """Which of a row's candidate tokens (``ids`` at ``positions``, increasing) start a word.

    The first does, and every token that does not continue the word before it
    (``vocab.continues``); unless ``vocab.reference_rules``, also every token
    after a gap in the positions (a special token there): no word spans one.
    """
    starts = ~vocab.continues[ids]
    if len(starts):
        starts[0] = True
    if not vocab.reference_rules:
        starts[1:] |= np.diff(positions) > 1
    return starts


def whole_word_positions(ids: np.ndarray, candidate: np.ndarray, vocab: Vocabulary, count: np.ndarray,
                         max_predictions: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Whole-word choices of every row: ((N, P) positions sorted, 0 where unused; (N, P) used).

    Row r's candidate positions (``candidate[r]``) in groups as :func:`_mask`
    makes them (a continuing piece, ``vocab.continues[id]``, joins the group
    before it; unless ``vocab.reference_rules``, not across a position that
    is no candidate: a special token), in a uniformly random order; groups
    are taken whole while they fit ``count[r]``. One row at a time: slower
    than the one-position draw.
    """
    n = len(ids)
    positions = np.zeros((n, max_predictions), np.int64)
    used = np.zeros((n, max_predictions), bool)
    for r in range(n):
        where = np.flatnonzero(candidate[r])
        if not len(where):
            continue
        group = np.cumsum(word_starts(ids[r, where], where, vocab)) - 1
        sizes = np.bincount(group)
        taken, total = np.zeros(len(sizes), bool), 0
        for g in rng.permutation(len(sizes)):
            if total >= count[r]:
                break
            if total + sizes[g] <= count[r]:
                taken[g], total = True, total + sizes[g]
        picked = where[taken[group]]
        positions[r, :total], used[r, :total] = picked, True
    return positions, used


def mask_candidates(arrays: PretrainingArrays, candidate: np.ndarray, masked_lm_prob: float,
                    vocab: Vocabulary, rng: np.random.Generator, whole_word: bool = False) -> None:
    """Mask every row of unmasked ``arrays`` in place, choosing among ``candidate`` (N, T) positions.

    Per row ``min(P, max(1, round(tokens × masked_lm_prob)))`` positions (no
    more than the candidates), uniform (with ``whole_word``, whole words as
    :func:`whole_word_positions` draws them); 80% [MASK], 10% kept, 10% a
    uniform random id of ``vocab.random_ids``.
    """
    n, t = candidate.shape
    max_predictions = arrays.masked_lm_positions.shape[1]
    length = arrays.input_mask.sum(axis=1, dtype=np.int64)
    # np.round rounds half to even, like Python's round() in the reference.
    count = np.minimum(max_predictions, np.maximum(1, np.round(length * masked_lm_prob)).astype(np.int64))
    count = np.minimum(count, candidate.sum(axis=1))
    if whole_word:
        positions, used = whole_word_positions(arrays.input_ids, candidate, vocab, count, max_predictions, rng)
    else:
        # A random key per candidate; the count smallest keys of each row are its picks.
        keys = np.where(candidate, rng.random((n, t)), np.inf)
        order = np.argsort(keys, axis=1)[:, :max_predictions]
        positions = np.where(np.arange(max_predictions)[None, :] < count[:, None], order, t)
        positions.sort(axis=1)  # t sorts after every real position
        used = positions < t
        positions = np.where(used, positions, 0)
    _apply_masks(arrays, positions, used, vocab, rng)


# ---------------------------------------------------------------- masked LM alone: full sentences

def pack_full_sentences(tokens: np.ndarray, sentence_offsets: np.ndarray, document_offsets: np.ndarray,
                        seq_len: int, max_predictions: int, specials: SpecialIds) -> PretrainingArrays:
    """Unmasked rows of contiguous text, as RoBERTa's FULL-SENTENCES inputs (Liu et al. 2019, 4.2).

    A row is ``[CLS] text [SEP]``: whole sentences, in order, added while they
    fit ``seq_len - 2`` tokens; a row runs on into the next document, with a
    [SEP] between the two. A sentence that does not fit starts the next row,
    and one longer than a row is cut into row-sized pieces, so every token of
    the corpus is in exactly one row. One segment (all 0); next-sentence labels 0.
    """
    room = seq_len - 2
    rows: list[list[np.ndarray]] = []
    row: list[np.ndarray] = []
    used = 0
    sep = np.array([specials.sep], tokens.dtype)
    for d in range(len(document_offsets) - 1):
        new_document = True
        for s in range(document_offsets[d], document_offsets[d + 1]):
            sentence = tokens[sentence_offsets[s]:sentence_offsets[s + 1]]
            for start in range(0, len(sentence), room):
                piece = sentence[start:start + room]
                joiner = new_document and used > 0  # the [SEP] between two documents
                if used + joiner + len(piece) > room:
                    rows.append(row)
                    row, used, joiner = [], 0, False
                if joiner:
                    row.append(sep)
                row.append(piece)
                used += joiner + len(piece)
                new_document = False
    if used:
        rows.append(row)
    n = len(rows)
    arrays = PretrainingArrays.zeros(n, seq_len, max_predictions)
    for r, pieces in enumerate(rows):
        text = np.concatenate(pieces)
        arrays.input_ids[r, 0] = specials.cls
        arrays.input_ids[r, 1:len(text) + 1] = text
        arrays.input_ids[r, len(text) + 1] = specials.sep
        arrays.input_mask[r, :len(text) + 2] = 1
    return arrays


def create_arrays_mlm(tokens: np.ndarray, sentence_offsets: np.ndarray, document_offsets: np.ndarray, *,
                      seq_len: int, max_predictions: int, masked_lm_prob: float, dupe_factor: int,
                      vocab: Vocabulary, rng: np.random.Generator, whole_word: bool = False) -> PretrainingArrays:
    """Masked-LM-only rows (:func:`pack_full_sentences`), masked ``dupe_factor`` ways and shuffled.

    The documents come flat, as for :func:`create_arrays_fast`. Each copy of a
    row is masked on its own (:func:`mask_candidates`: any real token but
    [CLS] and [SEP]); the copies of all rows are shuffled together.
    """
    specials = vocab.specials
    rows = pack_full_sentences(np.asarray(tokens), np.asarray(sentence_offsets, np.int64),
                               np.asarray(document_offsets, np.int64), seq_len, max_predictions, specials)
    arrays = rows.take(np.tile(np.arange(len(rows)), dupe_factor))
    ids = arrays.input_ids
    candidate = arrays.input_mask.astype(bool) & (ids != specials.cls) & (ids != specials.sep)
    mask_candidates(arrays, candidate, masked_lm_prob, vocab, rng, whole_word)
    return arrays.take(rng.permutation(len(arrays)))


def _mask_arrays(arrays: PretrainingArrays, a_len: np.ndarray, masked_lm_prob: float,
                 vocab: Vocabulary, rng: np.random.Generator, whole_word: bool = False) -> None:
    """Choose and apply the masked-LM predictions of every row, in place."""
    n, _ = arrays.input_ids.shape
    max_predictions = arrays.masked_lm_positions.shape[1]
    if n == 0:
        return
    length = arrays.input_mask.sum(axis=1, dtype=np.int64)
    candidates = length - 3  # every position but [CLS] and the two [SEP]s
    # np.round rounds half to even, like Python's round() in the reference.
    count = np.minimum(max_predictions, np.maximum(1, np.round(length * masked_lm_prob)))
    count = np.minimum(count, candidates).astype(np.int64)
    if whole_word:
        positions, used = whole_word_positions(
            arrays.input_ids, _candidates(arrays.input_mask, a_len), vocab, count, max_predictions, rng)
        _apply_masks(arrays, positions, used, vocab, rng)
        return
    # A uniform random count-subset of 0..candidates-1 per row, by Floyd's algorithm,
    # all rows at once: for j = c-k .. c-1, draw t in 0..j and take t, or j if t is taken.
    # (Kept as predictions × rows, so that each step compares contiguous rows.)
    none = np.iinfo(np.int32).max
    chosen = np.full((max_predictions, n), none, np.int32)
    top = (candidates - count).astype(np.int32)
    draws = rng.random((max_predictions, n))
    for i in range(max_predictions):
        pick = (draws[i] * (top + 1)).astype(np.int32)
        taken = (chosen[:i] == pick).any(axis=0)
        chosen[i] = np.where(i < count, np.where(taken, top, pick), none)
        top += 1
    chosen = np.sort(chosen.T, axis=1)
    used = np.arange(max_predictions) < count[:, None]
    # Candidate v is column v + 1 in A, v + 2 in B (past the middle [SEP]).
    positions = np.where(used, chosen + 1 + (chosen >= a_len[:, None]), 0).astype(np.int32)
    _apply_masks(arrays, positions, used, vocab, rng)


def _candidates(input_mask: np.ndarray, a_len: np.ndarray) -> np.ndarray:
    """(N, T): the positions that may be predicted, all real ones but [CLS] and the two [SEP]s."""
    n, t = input_mask.shape
    length = input_mask.sum(axis=1, dtype=np.int64)
    column = np.arange(t)[None, :]
    return (column > 0) & (column < length[:, None] - 1) & (column != a_len[:, None] + 1)


def _apply_masks(arrays: PretrainingArrays, positions: np.ndarray, used: np.ndarray, vocab: Vocabulary,
                 rng: np.random.Generator) -> None:
    """Write the chosen predictions into ``arrays``: 80% [MASK], 10% kept, 10% a random id."""
    max_predictions = positions.shape[1]
    n = len(positions)
    original = np.take_along_axis(arrays.input_ids, positions, axis=1)
    draw = rng.random((n, max_predictions))
    random_ids = vocab.random_ids[rng.integers(0, len(vocab.random_ids), (n, max_predictions))]
    shown = np.where(draw < 0.8, vocab.specials.mask, np.where(draw < 0.9, original, random_ids))
    # Unused slots write column 0 with what it holds ([CLS]).
    np.put_along_axis(arrays.input_ids, positions, np.where(used, shown, original), axis=1)
    arrays.masked_lm_positions[:] = positions
    arrays.masked_lm_ids[:] = np.where(used, original, 0)
    arrays.masked_lm_weights[:] = used
