"""Streaming batches from many record shards, split across ranks, exactly resumable.

The order of one epoch ``e`` is a pure function of (seed, e, rank):

1. the shards are put in a seeded random order;
2. rank ``r`` of ``W`` takes every W-th record of the concatenated shards
   (records ``r, r + W, r + 2W, …``), so every rank gets the same number of
   records, give or take one, and ranks never hang waiting for each other;
3. the rank's records are shuffled by a seeded buffer: each window of
   ``shuffle_buffer`` consecutive records is permuted;
4. they are cut into batches of ``batch_size``; every rank yields the same
   number of batches per epoch (the tail is dropped).

So the position in the data is two integers, (epoch, batch), and resuming
mid-epoch reads exactly the batches the uninterrupted run would have read
next, without reading what was consumed. Records are read by random access
(memory-mapped native shards, or TFRecords through their offsets), so memory
holds one window of indices and one batch, whatever the corpus size.

With ``dynamic_masking`` the static masks in the records are undone and each
sequence is masked anew (80/10/10) from a seed that depends on the epoch and
the batch, so every epoch sees different masks and resuming stays exact.

Packed records (``bertforge data pack``, or Graphcore's) are detected from
the files and come as packed batches (:meth:`.rows.PackedArrays.to_torch`);
a batch is then ``batch_size`` rows of up to S sequences each. The shards of
one data set must be all packed (alike) or all unpacked.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .errors import DataError
from .feed import pinned
from .instances import mask_candidates
from .record_reader import RecordFile, open_records, read_tokenizer_sidecar
from .record_schema import TOKENIZER_SIDECAR, detect_format
from .rows import PretrainingArrays, Rows, concat_rows
from .text import expand_inputs
from .vocab import Vocabulary, load_vocab

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MaskingSpec:
    """What dynamic masking needs: the vocab (its special ids, random replacements, words) and the ratio."""

    vocab: Vocabulary
    masked_lm_prob: float = 0.15
    whole_word: bool = False  # whole words are masked (data.whole_word_mask)


def remask(a: PretrainingArrays, spec: MaskingSpec, rng: np.random.Generator) -> PretrainingArrays:
    """Undo the records' masks and mask every sequence anew, as the reference would.

    Per sequence: n = min(P, max(1, round(len(tokens) × prob))) positions drawn
    uniformly among the non-special tokens (with ``spec.whole_word``, whole
    words while they fit n, as the reference's whole-word masking); of those
    80% become [MASK], 10% a random token, 10% stay.
    """
    ids = a.input_ids.astype(np.int64)  # a copy
    rows = np.arange(len(ids))[:, None]
    real = a.masked_lm_weights > 0
    # Restore the original tokens under the old masks.
    ids[np.broadcast_to(rows, real.shape)[real], a.masked_lm_positions[real]] = a.masked_lm_ids[real]
    fresh = PretrainingArrays(
        input_ids=ids.astype(a.input_ids.dtype), segment_ids=a.segment_ids, input_mask=a.input_mask,
        masked_lm_positions=np.zeros_like(a.masked_lm_positions), masked_lm_ids=np.zeros_like(a.masked_lm_ids),
        masked_lm_weights=np.zeros(a.masked_lm_weights.shape, np.float32),
        next_sentence_labels=a.next_sentence_labels)
    specials = spec.vocab.specials
    candidate = a.input_mask.astype(bool) & (ids != specials.cls) & (ids != specials.sep)
    mask_candidates(fresh, candidate, spec.masked_lm_prob, spec.vocab, rng, spec.whole_word)
    return fresh


@dataclass(frozen=True)
class BatchPlan:
    """One batch's place in the data: its epoch and number in the epoch (which seed its masks), and
    its records as (file index, record index in that file)."""

    epoch: int
    index: int
    files: np.ndarray
    local: np.ndarray


class RecordStream:
    """Batches of ``batch_size`` from record shards; see the module docstring for the order."""

    def __init__(self, files: list[Path], batch_size: int, seed: int, *, rank: int = 0, world_size: int = 1,
                 shuffle_buffer: int = 10000, masking: MaskingSpec | None = None, verify: bool = True,
                 vocab_size: int | None = None, epoch: int = 0, index: int = 0, always_mask: bool = False):
        if not files:
            raise DataError("no record files to read")
        self.files = [Path(f) for f in files]
        self.always_mask = always_mask  # batches without padding keep their mask (rows.to_torch)
        self.readers: list[RecordFile] = []
        try:
            for f in self.files:
                self.readers.append(open_records(f, verify=verify, vocab_size=vocab_size))
            check_same_shape(self.readers)
            packed = next((r for r in self.readers if r.max_sequences_per_pack), None)
            if masking is not None and packed is not None:
                raise DataError(f"{packed.path}: packed records cannot be masked anew: "
                                "turn data.dynamic_masking off, or pack records made with it")
        except BaseException:
            self.close()
            raise
        self.sizes = np.array([len(r) for r in self.readers], dtype=np.int64)
        total = int(self.sizes.sum())
        self.batch_size, self.seed, self.rank, self.world_size = batch_size, seed, rank, world_size
        self.shuffle_buffer = max(1, shuffle_buffer)
        self.masking = masking
        self.num_sequences = total
        self.records_per_rank = total // world_size  # the same for every rank
        self.batches_per_epoch = self.records_per_rank // batch_size
        if self.batches_per_epoch == 0:
            raise DataError(f"{total} records in {len(files)} file(s) make no batch of {batch_size} "
                            f"on each of {world_size} rank(s)")
        self.epoch, self.index = epoch, index
        self._plan_epoch(epoch)

    def __len__(self) -> int:
        return self.batches_per_epoch

    def _rng(self, *key: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, *key])

    def _plan_epoch(self, epoch: int) -> None:
        shard_order = self._rng(epoch, 0).permutation(len(self.files))
        self._shard_order = shard_order
        self._starts = np.concatenate([[0], np.cumsum(self.sizes[shard_order])])  # in epoch order
        self._window: tuple[int, np.ndarray | None] = (-1, None)  # (window, its records): one at a time

    def _global_to_file(self, sequence_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Positions in this epoch's concatenation → (file index, record index in file)."""
        slot = np.searchsorted(self._starts, sequence_ids, side="right") - 1
        return self._shard_order[slot], sequence_ids - self._starts[slot]

    def _rank_records(self, start: int, stop: int) -> np.ndarray:
        """This rank's records number start..stop-1, as positions in the epoch's concatenation."""
        return np.arange(start, stop, dtype=np.int64) * self.world_size + self.rank

    def _window_permutation(self, window: int) -> np.ndarray:
        if self._window[0] != window:
            start = window * self.shuffle_buffer
            stop = min(start + self.shuffle_buffer, self.records_per_rank)
            perm = self._rng(self.epoch, 1, self.rank, window).permutation(stop - start)
            self._window = (window, self._rank_records(start, stop)[perm])
        records = self._window[1]
        assert records is not None  # set for this window above
        return records

    def _batch_records(self, index: int) -> np.ndarray:
        """This epoch's batch ``index`` as positions in the concatenation (may span two windows)."""
        out = []
        first = index * self.batch_size
        window, offset = divmod(first, self.shuffle_buffer)
        needed = self.batch_size
        while needed:
            perm = self._window_permutation(window)
            part = perm[offset:offset + needed]
            out.append(part)
            needed -= len(part)
            window, offset = window + 1, 0
        return np.concatenate(out)

    def read(self, sequence_ids: np.ndarray) -> Rows:
        """Records by their positions in the epoch's concatenation, in the given order."""
        return self._take(*self._global_to_file(sequence_ids))

    def _take(self, files: np.ndarray, local: np.ndarray) -> Rows:
        """Records by (file index, record index in file), in the given order; reads the memory-mapped
        files only, so several threads may take at once."""
        shards = np.unique(files)
        if len(shards) == 1:
            return self.readers[shards[0]].take(local)
        # Read file by file, then put the rows back in the asked order.
        where = [np.flatnonzero(files == f) for f in shards]
        parts = [self.readers[f].take(local[rows]) for f, rows in zip(shards, where)]
        return concat_rows(parts).take(np.argsort(np.concatenate(where)))

    def plan(self) -> BatchPlan:
        """The next batch's place in the data, and the position moves past it: the cheap part of
        :meth:`next`, which must run in order (windows and epochs are planned one after another)."""
        if self.index == self.batches_per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
            self._plan_epoch(self.epoch)
        files, local = self._global_to_file(self._batch_records(self.index))
        planned = BatchPlan(self.epoch, self.index, files, local)
        self.index += 1
        return planned

    def load(self, planned: BatchPlan) -> dict[str, torch.Tensor]:
        """A planned batch read, masked and made tensors: the costly part of :meth:`next`, a function
        of the plan alone, so reader threads may load several batches at once in any order."""
        arrays = self._take(planned.files, planned.local)
        if self.masking is not None:
            assert isinstance(arrays, PretrainingArrays)  # packed records refuse masking (__init__)
            arrays = remask(arrays, self.masking, self._rng(planned.epoch, 2, self.rank, planned.index))
        return arrays.to_torch(self.always_mask)

    def next(self) -> dict[str, torch.Tensor]:
        return self.load(self.plan())

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def close(self) -> None:
        for reader in self.readers:
            reader.close()


def check_same_shape(readers: list[RecordFile]) -> None:
    """A DataError naming two files whose sequence length or prediction count differ, or of which
    one is packed and the other not (files without records have no shape and pass)."""
    shaped = [r for r in readers if len(r)]
    for reader in shaped[1:]:
        first = shaped[0]
        if reader.max_sequences_per_pack != first.max_sequences_per_pack:
            def packing(r: RecordFile) -> str:
                slots = r.max_sequences_per_pack
                return f"packed records (up to {slots} sequences per record)" if slots else "unpacked records"
            raise DataError(f"{reader.path}: {packing(reader)}, but {first.path} has {packing(first)}: "
                            "the files of one data set must agree")
        if (reader.seq_len, reader.max_predictions) != (first.seq_len, first.max_predictions):
            raise DataError(f"{reader.path}: records of seq_len {reader.seq_len}, max_predictions "
                            f"{reader.max_predictions}, but {first.path} has seq_len {first.seq_len}, "
                            f"max_predictions {first.max_predictions}: the files of one data set must agree")


def records_shape(files: list[Path]) -> tuple[Path, int, int, int | None]:
    """(the file that decides, its seq_len, max_predictions, and the vocab size its header
    declares, None for TFRecords) of the first file that has records; opened without verifying."""
    for path in files:
        with open_records(path, verify=False) as records:
            if len(records):
                return path, records.seq_len, records.max_predictions, records.header_vocab_size
    raise DataError(f"no records in {len(files)} file(s): {', '.join(map(str, files[:3]))}"
                    + (" …" if len(files) > 3 else ""))


def read_eval_records(path: str | Path, train: tuple[Path, int, int], vocab_size: int | None) -> Rows:
    """All records of the eval file, refused (naming both files) when its sequence length differs
    from the training records' ``train`` (file, seq_len, max_predictions), and checked against
    ``vocab_size`` as the training records are. Its prediction count may differ: eval rows are
    scored in batches of their own, with the masks they were made with (ModernBERT's recipe
    trains at 30 % and evaluates records masked at 15 %, with half the slots)."""
    with open_records(path, vocab_size=vocab_size) as records:
        train_file, seq_len, _ = train
        if len(records) and records.seq_len != seq_len:
            raise DataError(f"{path}: eval records of seq_len {records.seq_len}, but the training records "
                            f"({train_file}) have seq_len {seq_len}")
        return records.take(np.arange(len(records)))


def record_files(pattern: str) -> list[Path]:
    """A directory (its files but TFRecord indexes, tokenizer sidecars and hidden ones, sorted), a glob, or one file.

    Hidden files are writers' temporary files (see :class:`.record_writer.RecordWriter`).
    """
    try:
        return expand_inputs([pattern], patterns=("*",), skip=(".*", "*.index", f"*{TOKENIZER_SIDECAR}"))
    except DataError:
        raise DataError(f"no record files found at {pattern}") from None


def is_records(pattern: str) -> bool:
    """Whether ``data.input`` names record shards rather than text; a DataError when it names both
    (training on one kind would silently leave out the other)."""
    try:
        files = record_files(pattern)
    except DataError:
        return False
    records, other = [], []
    for file in files:
        try:
            detect_format(file)
            records.append(file)
        except DataError:
            other.append(file)
    if records and other:
        raise DataError(f"{pattern}: holds {len(records)} record file(s) ({records[0].name}, …) and "
                        f"{len(other)} other file(s) ({other[0].name}, …): point data.input at records "
                        f"or at text, not both")
    return bool(records)


def masking_spec(vocab_path: str | Path, masked_lm_prob: float, whole_word: bool = False) -> MaskingSpec:
    vocab = load_vocab(vocab_path)
    vocab.special_ids()  # a vocab without [CLS], [SEP] or [MASK] is named now, not at the first batch
    if whole_word:
        vocab.check_word_pieces("data.whole_word_mask")
    return MaskingSpec(vocab, masked_lm_prob, whole_word)


def check_vocab_fits(records: RecordFile, vocab_path: str | Path) -> None:
    """Refuse records made with another vocab: their fixed masks show another [MASK] id, their
    rows start with another [CLS] id, and training would learn shifted tokens without a word.

    Judged on the first rows of one file: the id most rows start with (unpacked rows) must be
    this vocab's [CLS], and at least half of the masked positions (80 % under 80/10/10
    masking) must show its [MASK], once there are enough of them (50) to tell.
    """
    vocab = load_vocab(vocab_path)
    specials = vocab.special_ids(f", which the records in {records.path} hold: train with the vocab they were "
                                 f"made with")
    index = {"[CLS]": specials.cls, "[MASK]": specials.mask}
    rows = records.take(np.arange(min(len(records), 1024)))
    ids = np.asarray(rows.input_ids)
    weights = rows.masked_lm_weights if isinstance(rows, PretrainingArrays) else rows.masked_lm_mask
    shown = np.take_along_axis(ids, np.asarray(rows.masked_lm_positions), axis=1)[np.asarray(weights) > 0]
    used = {}
    if isinstance(rows, PretrainingArrays) and len(ids):
        used["[CLS]"] = int(np.bincount(ids[:, 0]).argmax())
    if shown.size >= 50 and np.count_nonzero(shown == specials.mask) < shown.size / 2:
        used["[MASK]"] = int(np.bincount(shown).argmax())
    wrong = [f"{token} is id {index[token]} in the vocab but {used[token]} in the records"
             for token in used if index[token] != used[token]]
    if wrong:
        raise DataError(f"{vocab_path} does not fit the records in {records.path}: {'; '.join(wrong)} (made with "
                        f"another vocab?): train with the vocab they were made with")


def check_tokenizer(files: list[Path], vocab_path: str | Path, setting: str = "data.vocab") -> None:
    """Refuse record files made with another tokenizer than ``data.vocab`` (``setting``: where the vocab
    was given), as a native header or a
    TFRecord's sidecar names it (see :meth:`.vocab.Vocabulary.check_made`). TFRecords with no sidecar
    (other tools') are checked on their first records and warned about in one line
    (:func:`check_unnamed_records`); older native files name none and pass."""
    vocab = load_vocab(vocab_path)
    unnamed = []
    for path in files:
        if detect_format(path) == "native":
            with open_records(path, verify=False) as records:
                vocab.check_made(records.header_tokenizer, path, setting)
        elif (made_with := read_tokenizer_sidecar(path)) is not None:
            vocab.check_made(made_with, path, setting)
        else:
            unnamed.append(path)
    if unnamed:
        with open_records(unnamed[0], verify=False) as records:
            problems = check_unnamed_records(records, vocab)
        logger.warning("%s%s name no tokenizer (no %s beside them: not made by `data create`); the first %s "
                       "records' ids were checked against %s: %s", unnamed[0],
                       f" and {len(unnamed) - 1} other TFRecord file(s)" if len(unnamed) > 1 else "",
                       TOKENIZER_SIDECAR, UNNAMED_ROWS_CHECKED, vocab_path,
                       "; ".join(problems) + " (made with another vocab?)" if problems else "they fit")


UNNAMED_ROWS_CHECKED = 1024


def check_unnamed_records(records: RecordFile, vocab: Vocabulary) -> list[str]:
    """What in the first records of a file that names no tokenizer does not fit ``vocab``: ids beyond
    it, a first token other than its [CLS], rows without its [SEP]; empty when they fit."""
    rows = records.take(np.arange(min(len(records), UNNAMED_ROWS_CHECKED)))
    ids = np.asarray(rows.input_ids)
    problems = []
    if ids.size and int(ids.max()) >= vocab.size:
        problems.append(f"ids up to {int(ids.max())}, beyond the vocab's {vocab.size} tokens")
    if vocab.roles is not None and isinstance(rows, PretrainingArrays) and len(ids):
        first = np.bincount(ids[:, 0]).argmax()
        if first != vocab.roles.cls:
            problems.append(f"rows start with id {first}, but [CLS] is id {vocab.roles.cls} in the vocab")
        real = np.asarray(rows.input_mask) > 0
        without_sep = int(np.count_nonzero(~((ids == vocab.roles.sep) & real).any(axis=1)))
        if without_sep:
            problems.append(f"{without_sep} rows hold no [SEP] (id {vocab.roles.sep} in the vocab)")
    return problems


class Prefetcher:
    """Reads the next batches of a stream in background threads while the model trains.

    The stream's reading (file access, numpy) overlaps with the training step
    (torch releases the GIL). ``state()`` is the position after the last batch
    handed out, not after the last one read ahead, so checkpoints stay exact.
    With ``pin`` (training on CUDA) the threads also put each batch in pinned
    memory, from which :func:`bertforge.data.feed.copied_ahead` copies it to the GPU
    without the host waiting.

    ``threads`` (``data.reader_threads``) readers load that many batches at once:
    one thread plans the batches in order (:meth:`RecordStream.plan`), the readers
    load them (:meth:`RecordStream.load`, a function of the plan alone), and the
    batches are handed out in the planned order, so the batches and the saved
    positions are those of one thread whatever the number of readers.
    """

    def __init__(self, stream: RecordStream, depth: int = 4, *, pin: bool = False, threads: int = 1):
        import queue
        import threading

        self.stream, self.pin, self.threads = stream, pin, threads
        self.batches_per_epoch = stream.batches_per_epoch
        self.num_sequences = stream.num_sequences
        self._state = stream.state()
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, daemon=True, name="bertforge-prefetch")
        self._thread.start()

    def _load(self, planned: BatchPlan) -> dict[str, torch.Tensor]:
        batch = self.stream.load(planned)
        return pinned(batch) if self.pin else batch

    def _fill(self) -> None:
        from collections import deque
        from concurrent.futures import Future, ThreadPoolExecutor

        # Loads in flight, oldest first; the pool is shut down (its loads finished) before this
        # thread ends, so close() never unmaps a file a reader still reads.
        loading: deque[tuple[Future, dict[str, int]]] = deque()
        with ThreadPoolExecutor(self.threads, thread_name_prefix="bertforge-reader") as pool:
            try:
                while not self._stop.is_set():
                    while len(loading) < self.threads:
                        loading.append((pool.submit(self._load, self.stream.plan()), self.stream.state()))
                    future, state = loading.popleft()
                    self._queue.put((future.result(), state))
            except BaseException as err:  # handed to the consumer, which raises it
                self._queue.put((err, None))
            finally:
                for future, _ in loading:
                    future.cancel()

    def next(self) -> dict[str, torch.Tensor]:
        batch, state = self._queue.get()
        if state is None:
            raise batch
        self._state = state
        return batch

    def state(self) -> dict[str, int]:
        return dict(self._state)

    @property
    def epoch(self) -> int:
        return self._state["epoch"]

    def close(self) -> None:
        self._stop.set()
        while self._thread.is_alive():  # unblock a put() waiting on a full queue
            try:
                self._queue.get_nowait()
            except Exception:
                pass
            self._thread.join(timeout=0.05)
        self.stream.close()
