"""The rows of pre-training records, as numpy columns with one row per record.

:class:`PretrainingArrays` holds unpacked rows (one sequence each, google-research/bert's
features) and :class:`PackedArrays` packed ones (up to ``max_sequences_per_pack`` sequences
each, Graphcore's layout: see :mod:`.packing`). Everything that makes, writes, reads or
feeds records passes these; this module needs numpy alone, and torch only in ``to_torch``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, TypeVar, cast

import numpy as np

if TYPE_CHECKING:
    import torch

MAX_SEQUENCES_PER_PACK = 255  # sequence indices are stored as uint8


C = TypeVar("C", bound="Columns")


class Columns:
    """A dataclass of arrays with one row per record along their first axis: rows are taken
    and joined the same way for every field."""

    input_ids: np.ndarray

    def __len__(self) -> int:
        return len(self.input_ids)

    def take(self: C, rows: slice | Sequence[int] | np.ndarray) -> C:
        """These rows of every field: a slice gives views, indices give copies.

        Fields may be any array-likes (a writer takes them so); the result's are arrays.
        """
        return type(self)(**{f.name: np.asarray(getattr(self, f.name))[rows]
                             for f in fields(self)})  # type: ignore[arg-type]

    @classmethod
    def concat(cls: type[C], parts: Iterable[C]) -> C:
        """The rows of several, one after the other."""
        parts = list(parts)
        return cls(**{f.name: np.concatenate([getattr(p, f.name) for p in parts])
                      for f in fields(cls)})  # type: ignore[arg-type]


@dataclass
class PretrainingArrays(Columns):
    """Padded instances, one row each; padding is 0 everywhere."""

    input_ids: np.ndarray  # (N, T) int32
    segment_ids: np.ndarray  # (N, T) int8: 0 for [CLS] A [SEP], 1 for B [SEP]
    input_mask: np.ndarray  # (N, T) int8: 1 on real tokens
    masked_lm_positions: np.ndarray  # (N, P) int32
    masked_lm_ids: np.ndarray  # (N, P) int32: the original tokens there
    masked_lm_weights: np.ndarray  # (N, P) float32: 1 for real predictions
    next_sentence_labels: np.ndarray  # (N,) int64: 0 = B follows A, 1 = B is random

    @classmethod
    def zeros(cls, n: int, seq_len: int, max_predictions: int) -> PretrainingArrays:
        """``n`` rows of padding, in the dtypes above, to be filled in."""
        return cls(input_ids=np.zeros((n, seq_len), np.int32), segment_ids=np.zeros((n, seq_len), np.int8),
                   input_mask=np.zeros((n, seq_len), np.int8),
                   masked_lm_positions=np.zeros((n, max_predictions), np.int32),
                   masked_lm_ids=np.zeros((n, max_predictions), np.int32),
                   masked_lm_weights=np.zeros((n, max_predictions), np.float32),
                   next_sentence_labels=np.zeros(n, np.int64))

    def to_torch(self, always_mask: bool = False) -> dict[str, torch.Tensor]:
        """The model's batch dict (see ``bertforge.models.bert.pretraining_loss``), compact for the copy
        to the device: ids, positions and labels int32, the mask uint8, weights float32
        (``bertforge.data.feed.widen`` makes the int32 fields int64 on the device).

        A batch without padding has no ``attention_mask``: the model then runs
        attention without a mask (Flash on CUDA), and knowing it costs no device sync.
        With ``always_mask`` it has one all the same: a compiled model then has one graph
        for every batch of data that has padding somewhere (a second would be compiled
        mid-run, at the first batch without padding).

        torch is imported here, not with the module: the ``bertforge data``
        commands use these arrays and never need torch.
        """
        batch = {"input_ids": host_tensor(self.input_ids, np.int32),
                 "token_type_ids": host_tensor(self.segment_ids, np.int32)}
        if always_mask or not np.all(self.input_mask):
            batch["attention_mask"] = host_tensor(self.input_mask, np.uint8)
        batch.update({
            "masked_lm_positions": host_tensor(self.masked_lm_positions, np.int32),
            "masked_lm_ids": host_tensor(self.masked_lm_ids, np.int32),
            "masked_lm_weights": host_tensor(self.masked_lm_weights, np.float32),
            "next_sentence_labels": host_tensor(self.next_sentence_labels, np.int32),
        })
        return batch


def host_tensor(x: np.ndarray, dtype: type[np.generic]) -> torch.Tensor:
    """A contiguous CPU tensor of ``dtype`` holding a copy of ``x`` (never a view of a record file)."""
    import torch

    return torch.from_numpy(np.array(x, dtype=dtype, order="C"))


@dataclass
class PackedArrays(Columns):
    """Packed rows in Graphcore's layout (see the module docstring); padding is 0 everywhere.

    T is the row length, S the most sequences per row, P = max_predictions + S - 1.
    """

    input_ids: np.ndarray  # (N, T) int32
    input_mask: np.ndarray  # (N, T) int8: the 1-based index of the token's sequence, 0 = padding
    segment_ids: np.ndarray  # (N, T) int8
    position_ids: np.ndarray  # (N, T) int32: the position within the token's own sequence
    masked_lm_positions: np.ndarray  # (N, P) int32: positions in the row
    masked_lm_ids: np.ndarray  # (N, P) int32
    masked_lm_mask: np.ndarray  # (N, P) int8: the index of the prediction's sequence, 0 = padding
    next_sentence_labels: np.ndarray  # (N, S) int64: slot S - k holds sequence k's label
    next_sentence_mask: np.ndarray  # (N, S) int8: 1 where that sequence is present

    @property
    def max_sequences_per_pack(self) -> int:
        return int(np.shape(self.next_sentence_labels)[1])

    def to_torch(self, always_mask: bool = False) -> dict[str, torch.Tensor]:
        """The model's packed batch (see ``bertforge.training.pretrain.forward_loss``); it always has its mask
        (``always_mask`` is for the signature :meth:`PretrainingArrays.to_torch` shares).

        ``sequence_ids`` (the per-token sequence index) makes the attention
        block-diagonal; ``cls_positions`` are the last S positions, where the
        [CLS] tokens are; ``next_sentence_weights`` marks the real sequences.
        Compact as :meth:`PretrainingArrays.to_torch`: int32, ``sequence_ids`` uint8.
        """
        n, seq_len = np.shape(self.input_ids)
        slots = self.max_sequences_per_pack
        cls_positions = np.broadcast_to(np.arange(seq_len - slots, seq_len), (n, slots))
        return {
            "input_ids": host_tensor(self.input_ids, np.int32),
            "token_type_ids": host_tensor(self.segment_ids, np.int32),
            "sequence_ids": host_tensor(self.input_mask, np.uint8),
            "position_ids": host_tensor(self.position_ids, np.int32),
            "masked_lm_positions": host_tensor(self.masked_lm_positions, np.int32),
            "masked_lm_ids": host_tensor(self.masked_lm_ids, np.int32),
            "masked_lm_weights": host_tensor(np.asarray(self.masked_lm_mask) > 0, np.float32),
            "cls_positions": host_tensor(cls_positions, np.int32),
            "next_sentence_labels": host_tensor(self.next_sentence_labels, np.int32),
            "next_sentence_weights": host_tensor(np.asarray(self.next_sentence_mask) > 0, np.float32),
        }


Rows = PretrainingArrays | PackedArrays


def arrays_class(max_sequences_per_pack: int) -> type[PretrainingArrays] | type[PackedArrays]:
    return PackedArrays if max_sequences_per_pack else PretrainingArrays


def concat_rows(parts: Sequence[Rows]) -> Rows:
    """The rows of several arrays of one kind (unpacked or packed), one after the other."""
    if all(isinstance(p, PackedArrays) for p in parts):
        return PackedArrays.concat(cast(list[PackedArrays], parts))
    return PretrainingArrays.concat(cast(list[PretrainingArrays], parts))
