"""Sequence packing without cross-contamination (Krell et al. 2021, arXiv 2107.02027).

Short sequences waste the compute of their padding. Packing puts up to
``max_sequences_per_pack`` (S) whole sequences into one row of ``seq_len``
tokens; the model keeps them apart (see ``bertforge.models.bert``): each token
attends only to the tokens of its own sequence (a block-diagonal attention
mask from the per-token sequence index), positions restart at 0 in every
sequence, and each sequence's next-sentence prediction comes from its own
[CLS]. The losses are normalised per real prediction and per real sequence, so
a packed batch gives the loss and gradients of the same sequences unpacked.

Which sequences go together is decided on the histogram of sequence lengths
alone, by the paper's shortest-pack-first histogram packing (SPFHP,
:func:`spfhp`): lengths from the longest down, each length's whole count at
once, into the open packs with the least room that still fits it (best fit),
splitting a group of identical packs where the count runs out. It costs
O(seq_len × packs kinds), whatever the number of sequences.

The row layout is Graphcore's (their BERT's ``pack_pretraining_data.py``), so
their packed TFRecords train here and ours train there: feature ``packed_X``
holds field ``X`` of :class:`PackedArrays`. Sequence k (1-based) of a row
has its tokens but its [CLS] one after the other from the row's start (after
sequence k-1's), its [CLS] at position ``seq_len - k``, and its
next-sentence label in slot ``S - k``; ``input_mask`` and
``masked_lm_mask`` hold k on its tokens and predictions (0 = padding);
masked-LM positions point into the row. A row holds at most
``max_predictions + S - 1`` predictions (``max_predictions`` per sequence,
as their script).
"""

from __future__ import annotations

import bisect
import contextlib
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .errors import DataError
from .rows import MAX_SEQUENCES_PER_PACK, PackedArrays, PretrainingArrays, Rows

if TYPE_CHECKING:
    pass

_WRITE_CHUNK = 4096  # packs built and written at a time: bounds memory


# ---------------------------------------------------------------- counting

@dataclass
class PackingStats:
    """Rows, the real sequences and tokens in them, and the tokens they could hold."""

    rows: int = 0
    sequences: int = 0
    tokens: int = 0
    slots: int = 0  # rows × seq_len

    def add(self, arrays: Rows) -> None:
        mask = np.asarray(arrays.input_mask)
        self.rows += len(mask)
        self.tokens += int(np.count_nonzero(mask))
        self.slots += mask.size
        if isinstance(arrays, PackedArrays):
            self.sequences += int(np.count_nonzero(arrays.next_sentence_mask))
        else:
            self.sequences += len(mask)

    @property
    def packing_factor(self) -> float:
        """Real sequences per row."""
        return self.sequences / max(self.rows, 1)

    @property
    def padding_fraction(self) -> float:
        return 1.0 - self.tokens / max(self.slots, 1)

    def summary(self) -> str:
        return (f"packing factor {self.packing_factor:.3f} sequences per row ({self.sequences} sequences "
                f"in {self.rows} rows), padding {100 * self.padding_fraction:.1f}% of tokens")


# ---------------------------------------------------------------- the packing algorithm

def spfhp(histogram: np.ndarray, seq_len: int, max_sequences_per_pack: int) -> list[tuple[tuple[int, ...], int]]:
    """Shortest-pack-first histogram packing: (lengths of a pack, how many such packs).

    ``histogram[l]`` is the number of sequences of length l (l in 1..seq_len).
    Every sequence is in exactly one pack; a pack's lengths sum to at most
    ``seq_len`` and number at most ``max_sequences_per_pack``.
    """
    # Open packs, grouped by the room they have left: room -> [[lengths, count], ...].
    open_packs: dict[int, list[list]] = {}
    rooms: list[int] = []  # the keys of open_packs, sorted
    done: list[tuple[tuple[int, ...], int]] = []

    def put(lengths: tuple[int, ...], count: int) -> None:
        room = seq_len - sum(lengths)
        if room == 0 or len(lengths) == max_sequences_per_pack:
            done.append((lengths, count))
            return
        if room not in open_packs:
            open_packs[room] = []
            bisect.insort(rooms, room)
        open_packs[room].append([lengths, count])

    for length in range(seq_len, 0, -1):
        left = int(histogram[length]) if length < len(histogram) else 0
        while left:
            at = bisect.bisect_left(rooms, length)  # the least room that fits
            if at == len(rooms):
                put((length,), left)
                break
            room = rooms[at]
            group = open_packs[room][-1]
            lengths, count = group
            used = min(left, count)
            if used == count:  # the whole group takes one more sequence
                open_packs[room].pop()
                if not open_packs[room]:
                    del open_packs[room]
                    rooms.pop(at)
            else:  # part of it: split the group
                group[1] = count - used
            put((*lengths, length), used)
            left -= used
    for groups in open_packs.values():
        done.extend((tuple(lengths), count) for lengths, count in groups)
    return done


def pack_indices(lengths: np.ndarray, predictions: np.ndarray, seq_len: int, max_sequences_per_pack: int,
                 max_predictions: int, seed: int = 0) -> np.ndarray:
    """Which sequences go into which row: (rows, S) indices into ``lengths``, -1 for none.

    ``lengths`` are the sequences' real tokens, ``predictions`` their real
    masked-LM predictions; a row holds at most ``max_predictions + S - 1`` of
    those (the rare pack over it is split). Sequences of a length are drawn in
    a seeded random order and the rows are shuffled, so rows mix the data.
    """
    lengths = np.asarray(lengths, np.int64)
    if len(lengths) and (lengths.min() < 1 or lengths.max() > seq_len):
        raise DataError(f"sequence lengths must be in 1..{seq_len}, got {int(lengths.min())}..{int(lengths.max())}")
    slots = max_sequences_per_pack
    rng = np.random.default_rng(seed)
    histogram = np.bincount(lengths, minlength=seq_len + 1)
    order = rng.permutation(len(lengths))
    by_length = order[np.argsort(lengths[order], kind="stable")]  # shuffled within each length
    taken = np.concatenate([[0], np.cumsum(histogram)])  # the next unused sequence of each length
    parts = []
    for pack_lengths, count in spfhp(histogram, seq_len, slots):
        rows = np.full((count, slots), -1, np.int64)
        for slot, length in enumerate(pack_lengths):
            rows[:, slot] = by_length[taken[length]:taken[length] + count]
            taken[length] += count
        parts.append(rows)
    packs = np.concatenate(parts) if parts else np.zeros((0, slots), np.int64)
    packs = _within_prediction_budget(packs, np.asarray(predictions, np.int64), max_predictions + slots - 1)
    return packs[rng.permutation(len(packs))]


def _within_prediction_budget(packs: np.ndarray, predictions: np.ndarray, budget: int) -> np.ndarray:
    """Split the packs whose sequences have more than ``budget`` predictions together."""
    counts = np.where(packs >= 0, predictions[np.maximum(packs, 0)], 0).sum(axis=1)
    over = counts > budget
    if not over.any():
        return packs
    extra = []
    for pack in packs[over]:
        row: list[int] = []
        for index in pack[pack >= 0].tolist():
            if row and sum(predictions[row].tolist()) + predictions[index] > budget:
                extra.append(row)
                row = []
            row.append(index)
        extra.append(row)
    split = np.full((len(extra), packs.shape[1]), -1, np.int64)
    for i, row in enumerate(extra):
        split[i, :len(row)] = row
    return np.concatenate([packs[~over], split])


# ---------------------------------------------------------------- building packed rows

def pack_rows(arrays: PretrainingArrays, packs: np.ndarray, max_predictions: int) -> PackedArrays:
    """Packed rows from unpacked ones: row i holds ``arrays`` rows ``packs[i]`` (-1: none), in order.

    ``max_predictions`` is per sequence (a row holds ``max_predictions + S - 1``);
    a row over that, or a real prediction outside its sequence, is a DataError.
    """
    n, slots = packs.shape
    seq_len = arrays.input_ids.shape[1]
    width = max_predictions + slots - 1
    out = PackedArrays(
        input_ids=np.zeros((n, seq_len), np.int32), input_mask=np.zeros((n, seq_len), np.int8),
        segment_ids=np.zeros((n, seq_len), np.int8), position_ids=np.zeros((n, seq_len), np.int32),
        masked_lm_positions=np.zeros((n, width), np.int32), masked_lm_ids=np.zeros((n, width), np.int32),
        masked_lm_mask=np.zeros((n, width), np.int8), next_sentence_labels=np.zeros((n, slots), np.int64),
        next_sentence_mask=np.zeros((n, slots), np.int8))
    token_end = np.zeros(n, np.int64)  # where the next sequence's tokens start
    prediction_end = np.zeros(n, np.int64)
    body = np.arange(1, seq_len)  # a sequence's positions but its [CLS]
    for slot in range(slots):
        rows = np.flatnonzero(packs[:, slot] >= 0)
        if not len(rows):
            continue
        source = arrays.take(packs[rows, slot])
        length = np.asarray(source.input_mask).sum(axis=1).astype(np.int64)
        k = slot + 1  # the sequence's index in its row
        cls_at = seq_len - k
        if (token_end[rows] + length > seq_len).any():
            raise DataError(f"a pack of more than {seq_len} tokens")
        # The tokens after [CLS], from the end of the previous sequence.
        real = body[None, :] < length[:, None]
        r = np.broadcast_to(rows[:, None], real.shape)[real]
        to = (token_end[rows, None] + body[None, :] - 1)[real]
        out.input_ids[r, to] = source.input_ids[:, 1:][real]
        out.input_mask[r, to] = k
        out.segment_ids[r, to] = source.segment_ids[:, 1:][real]
        out.position_ids[r, to] = np.broadcast_to(body, real.shape)[real]
        # The [CLS] at the end of the row, and the sequence's next-sentence label.
        out.input_ids[rows, cls_at] = source.input_ids[:, 0]
        out.input_mask[rows, cls_at] = k
        out.segment_ids[rows, cls_at] = source.segment_ids[:, 0]
        out.next_sentence_labels[rows, slots - k] = source.next_sentence_labels
        out.next_sentence_mask[rows, slots - k] = 1
        # The real predictions, their positions moved with their tokens.
        weights = np.asarray(source.masked_lm_weights) > 0
        positions = np.asarray(source.masked_lm_positions).astype(np.int64)
        if (weights & (positions >= length[:, None])).any():
            raise DataError("a masked-LM prediction at a padding position")
        count = weights.sum(axis=1)
        if (prediction_end[rows] + count > width).any():
            raise DataError(f"a pack of more than {width} masked-LM predictions")
        moved = np.where(positions == 0, cls_at, token_end[rows, None] + positions - 1)
        r = np.broadcast_to(rows[:, None], weights.shape)[weights]
        to = (prediction_end[rows, None] + np.cumsum(weights, axis=1) - 1)[weights]
        out.masked_lm_positions[r, to] = moved[weights]
        out.masked_lm_ids[r, to] = np.asarray(source.masked_lm_ids)[weights]
        out.masked_lm_mask[r, to] = k
        token_end[rows] += length - 1
        prediction_end[rows] += count
    return out


def unpack_rows(packed: PackedArrays) -> PretrainingArrays:
    """The sequences of packed rows, unpacked, in row order and then sequence order (for tests
    and ``data inspect``); masked-LM predictions come in the packed order."""
    seq_len = packed.input_ids.shape[1]
    slots = packed.max_sequences_per_pack
    max_predictions = packed.masked_lm_ids.shape[1] - slots + 1
    parts = []
    for row in range(len(packed)):
        for k in range(1, slots + 1):
            if not packed.next_sentence_mask[row, slots - k]:
                continue
            mine = np.flatnonzero(packed.input_mask[row] == k)
            at = packed.position_ids[row, mine]
            one = PretrainingArrays.zeros(1, seq_len, max_predictions)
            one.input_ids[0, at] = packed.input_ids[row, mine]
            one.segment_ids[0, at] = packed.segment_ids[row, mine]
            one.input_mask[0, at] = 1
            predicted = np.flatnonzero(packed.masked_lm_mask[row] == k)[:max_predictions]
            one.masked_lm_positions[0, :len(predicted)] = packed.position_ids[
                row, packed.masked_lm_positions[row, predicted]]
            one.masked_lm_ids[0, :len(predicted)] = packed.masked_lm_ids[row, predicted]
            one.masked_lm_weights[0, :len(predicted)] = 1
            one.next_sentence_labels[0] = packed.next_sentence_labels[row, slots - k]
            parts.append(one)
    return PretrainingArrays.concat(parts) if parts else PretrainingArrays.zeros(0, seq_len, max_predictions)


def pack_arrays(arrays: PretrainingArrays, max_sequences_per_pack: int, max_predictions: int | None = None,
                seed: int = 0) -> PackedArrays:
    """All rows of ``arrays`` packed (in memory; :func:`pack_files` for record files)."""
    check_max_sequences(max_sequences_per_pack)
    seq_len = arrays.input_ids.shape[1]
    max_predictions = max_predictions or arrays.masked_lm_ids.shape[1]
    packs = pack_indices(np.asarray(arrays.input_mask).sum(axis=1), (np.asarray(arrays.masked_lm_weights) > 0).sum(1),
                         seq_len, max_sequences_per_pack, max_predictions, seed)
    return pack_rows(arrays, packs, max_predictions)


def check_max_sequences(max_sequences_per_pack: int) -> None:
    if not 2 <= max_sequences_per_pack <= MAX_SEQUENCES_PER_PACK:
        raise DataError(f"max_sequences_per_pack={max_sequences_per_pack} must be in "
                        f"2..{MAX_SEQUENCES_PER_PACK}")


# ---------------------------------------------------------------- record files

def pack_files(inputs: Sequence[Path], outputs: Sequence[Path], max_sequences_per_pack: int, *,
               fmt: str | None = None, seed: int = 0) -> PackingStats:
    """Pack the records of ``inputs`` (unpacked, either format) into ``outputs`` (``fmt``:
    default the first input's), the packs spread evenly over the files in a seeded random
    order; returns the counts of what was written. Each file is written atomically.

    Two passes over the inputs: the lengths (for the packing), then the records
    themselves, ``_WRITE_CHUNK`` packs at a time, so memory holds the packing
    plan and one chunk whatever the input size.
    """
    from .loader import check_same_shape
    from .record_reader import open_records
    from .record_writer import RecordWriter

    check_max_sequences(max_sequences_per_pack)
    readers = []
    try:
        for path in inputs:
            readers.append(open_records(path))
        check_same_shape(readers)
        shaped = [r for r in readers if len(r)]
        if not shaped:
            raise DataError(f"no records to pack in {', '.join(map(str, inputs[:3]))}")
        packed = [r for r in shaped if r.max_sequences_per_pack]
        if packed:
            raise DataError(f"{packed[0].path}: already packed (up to {packed[0].max_sequences_per_pack} "
                            "sequences per row)")
        first = shaped[0]
        seq_len, max_predictions = first.seq_len, first.max_predictions
        sizes = np.array([len(r) for r in readers], np.int64)
        starts = np.concatenate([[0], np.cumsum(sizes)])
        lengths, predictions, max_id = [], [], -1
        for reader in readers:
            for start in range(0, len(reader), _WRITE_CHUNK):
                a = reader.take(np.arange(start, min(start + _WRITE_CHUNK, len(reader))))
                assert isinstance(a, PretrainingArrays)  # packed inputs were refused above
                lengths.append(a.input_mask.sum(axis=1, dtype=np.int64))
                predictions.append((a.masked_lm_weights > 0).sum(axis=1))
                max_id = max(max_id, int(a.input_ids.max(initial=-1)), int(a.masked_lm_ids.max(initial=-1)))
        packs = pack_indices(np.concatenate(lengths), np.concatenate(predictions), seq_len,
                             max_sequences_per_pack, max_predictions, seed)

        def read(indices: np.ndarray) -> PretrainingArrays:
            """Records by their index in the inputs' concatenation, in that order."""
            file_of = np.searchsorted(starts, indices, side="right") - 1
            parts: list[PretrainingArrays] = []
            where = []
            for f in np.unique(file_of):
                rows = np.flatnonzero(file_of == f)
                part = readers[f].take(indices[rows] - starts[f])
                assert isinstance(part, PretrainingArrays)  # packed inputs were refused above
                parts.append(part)
                where.append(rows)
            return PretrainingArrays.concat(parts).take(np.argsort(np.concatenate(where)))

        stats = PackingStats()
        vocab_size = first.header_vocab_size
        fmt = fmt or first.format
        for path, share in zip(outputs, np.array_split(packs, len(outputs))):
            with RecordWriter(path, fmt, seq_len, max_predictions, vocab_size, id_bound=max_id + 1,
                              max_sequences_per_pack=max_sequences_per_pack,
                              tokenizer=first.header_tokenizer) as writer:
                for start in range(0, len(share), _WRITE_CHUNK):
                    chunk = share[start:start + _WRITE_CHUNK]
                    used = chunk[chunk >= 0]
                    local = np.full(chunk.shape, -1, np.int64)
                    local[chunk >= 0] = np.arange(len(used))
                    rows = pack_rows(read(used), local, max_predictions)
                    stats.add(rows)
                    writer.write(rows)
        return stats
    finally:
        for reader in readers:
            reader.close()


@contextlib.contextmanager
def packing_to(output: str | Path, paths: Sequence[Path], max_sequences_per_pack: int, *,
               seed: int = 0, fmt: str = "tfrecord") -> Iterator[tuple[Path, PackingStats]]:
    """For ``data create --pack``: (where to write the unpacked records, the packing's counts).

    The unpacked records go under ``output``'s name into a hidden temporary
    directory next to it; when the block succeeds every file written there is
    packed into ``paths`` and the counts filled in. The packed files appear
    together, only when all are complete (:func:`..fileio.atomic_files`, whose
    hidden directory also holds the unpacked records); the temporaries are
    removed either way. TFRecords (``fmt``) come with their tokenizer's sidecars
    (:func:`.record_schema.tokenizer_sidecar`).
    """
    from bertforge.fileio import atomic_files

    from .record_schema import TOKENIZER_SIDECAR, tokenizer_sidecar

    check_max_sequences(max_sequences_per_pack)
    output = Path(output)
    stats = PackingStats()
    sidecars = [tokenizer_sidecar(path) for path in paths] if fmt == "tfrecord" else []
    with atomic_files([*paths, *sidecars], named=paths) as staged, \
            tempfile.TemporaryDirectory(prefix=f".{output.name}.tmp-", dir=staged[0].parent) as tmp:
        yield Path(tmp) / output.name, stats
        unpacked = sorted(p for p in Path(tmp).iterdir()
                          if not p.name.startswith(".") and not p.name.endswith(TOKENIZER_SIDECAR))
        vars(stats).update(vars(pack_files(unpacked, staged[:len(paths)], max_sequences_per_pack, seed=seed)))


def pack_command(inputs: str, output: Path, max_sequences_per_pack: int, *, fmt: str | None = None,
                 num_output_files: int = 0, seed: int = 0, overwrite: bool = False) -> tuple[PackingStats, list[Path]]:
    """``bertforge data pack IN OUT``: the record files of IN packed into the directory OUT.

    OUT must be new or empty unless ``overwrite`` (never a live run's); it is written under a
    temporary name and appears whole (replacing the old OUT) only when every
    shard is complete. Shards are ``part-0000i-of-0000N.EXT``, N the input's
    file count unless ``num_output_files``.
    """
    from bertforge.fileio import atomic_directory, refuse_live_runs

    from .loader import record_files
    from .record_schema import FORMATS, SUFFIXES, detect_format

    files = record_files(inputs)
    output = Path(output)
    if output.exists() and not output.is_dir():
        raise DataError(f"{output}: exists and is not a directory; give a new or empty directory")
    if output.is_dir() and any(output.iterdir()):
        if not overwrite:
            raise DataError(f"{output}: not empty; pass --overwrite to replace it, or give a new directory")
        inside = [f for f in files if output.resolve() in f.resolve().parents]
        if inside:
            raise DataError(f"{output}: --overwrite would delete the input {inside[0]}, which is in it")
        refuse_live_runs(output)
    if fmt is not None and fmt not in FORMATS:
        raise DataError(f"format={fmt!r} must be one of {', '.join(FORMATS)}")
    fmt = fmt or detect_format(files[0])
    count = num_output_files or len(files)
    if count < 1:
        raise DataError(f"num_output_files={count} must be at least 1")
    names = [f"part-{i:05d}-of-{count:05d}{SUFFIXES[fmt]}" for i in range(count)]
    with atomic_directory(output) as tmp:
        stats = pack_files(files, [tmp / name for name in names], max_sequences_per_pack, fmt=fmt, seed=seed)
    return stats, [output / name for name in names]


def add_pack_arguments(parser) -> None:
    parser.add_argument("input", help="unpacked record files: a directory, a glob or a file")
    parser.add_argument("output", type=Path, help="the directory of packed shards: new or empty, unless --overwrite")
    parser.add_argument("--max-sequences-per-pack", type=int, default=3, metavar="N",
                        help="at most N sequences per row (default 3)")
    parser.add_argument("--format", dest="fmt", choices=("tfrecord", "native"), default=None,
                        help="output format (default: the input's)")
    parser.add_argument("--num-output-files", type=int, default=0,
                        help="shards to write (default: as many as the input has)")
    parser.add_argument("--seed", type=int, default=0, help="seeds which sequences go together and the row order")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace OUT if it is not empty (never a live run's)")


def cmd_pack(args, extra: list[str]) -> int:
    stats, paths = pack_command(args.input, args.output, args.max_sequences_per_pack, fmt=args.fmt,
                                num_output_files=args.num_output_files, seed=args.seed,
                                overwrite=args.overwrite)
    print(f"{stats.summary()} → {args.output} ({len(paths)} file(s))")
    return 0
