"""Which rows make each batch of a retrieval fine-tune: several datasets in one run, batches without
duplicate texts. The rules are sentence-transformers' batch samplers (``sentence_transformers/base/
sampler.py``), tested against their classes (tests/tasks/test_retrieval_sampling.py):

- ``batch_sampler`` (the default): a dataset's rows in a seeded random order, cut into whole batches;
  for one dataset the engine's own order (``training.engine.epoch_order``), as before.
- ``no_duplicates``: their ``NoDuplicatesBatchSampler``: rows are taken in a seeded random order, and a
  row sharing a text (query, positive or negative) with the batch being filled waits, in its place,
  for a later batch; a batch that cannot be filled ends the pass. In-batch negatives then never hold
  a copy of a query's own positive (SQuAD's paragraphs are the positive of ~5 questions each). A
  dataset gives ``rows // batch`` batches an epoch, as their ``__len__`` promises: when a pass gives
  fewer, further seeded passes add batches (theirs stop after two more passes, short; ours goes on
  until the count is reached, or refuses in one line when a pass fills none).
- Several datasets (``--data a.jsonl b.jsonl``): each batch comes from one dataset.
  ``proportional`` (their default, ``ProportionalBatchSampler``): every batch of every dataset once
  an epoch, the datasets in a seeded random order, so a dataset is drawn in proportion to its size.
  ``round_robin`` (``RoundRobinBatchSampler``): one batch of each dataset in turn, until the dataset
  with the fewest batches runs out.

A batch here is the global batch (all ranks' micro-batches of a step): the engine's
:class:`~bertforge.training.engine.BatchStream` cuts the epoch's plan into micro-batches, rank r
reading the r-th of each step's, so a step's rows come from one dataset and hold no duplicate in
all. The plan of an epoch is a function of (seed, epoch): a resumed run reads the same batches.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from bertforge.config import ConfigError
from bertforge.data import DataError
from bertforge.training.engine import Batches

from .pairs import Pairs, read_pairs

BATCH_SAMPLERS = ("batch_sampler", "no_duplicates")
MULTI_DATASET_SAMPLERS = ("proportional", "round_robin")


def data_paths(data: str | Sequence[str]) -> list[Path]:
    """The training files of ``retrieval.data``: one path, or a list of them (one dataset each)."""
    return [Path(data)] if isinstance(data, str) else [Path(p) for p in data]


def read_datasets(paths: Sequence[Path], negatives: int) -> tuple[Pairs, list[int]]:
    """Every file's rows, one after another, and how many each has."""
    whole = Pairs(negatives=[[] for _ in range(negatives)])
    sizes = []
    for path in paths:
        pairs = read_pairs(path, negatives)
        whole.queries += pairs.queries
        whole.positives += pairs.positives
        for column, more in zip(whole.negatives, pairs.negatives):
            column += more
        sizes.append(len(pairs.queries))
    return whole, sizes


def generator(seed: int, epoch: int, stream: int = 0) -> torch.Generator:
    """The seeded generator of one stream of draws of an epoch; stream 0's is epoch_order's."""
    return torch.Generator().manual_seed((seed * 1_000_003 + epoch) ^ (stream << 40))


def _one_pass(order: list[int], texts: Sequence[frozenset[str]], batch_size: int) -> Iterator[list[int]]:
    """Full batches without a shared text from the rows in ``order``: each batch takes the rows that
    fit, in order; those that do not keep their place for the next batch; a batch left short ends it."""
    waiting: list[int] = []   # rows passed over, in order, ahead of the rest
    rest = 0                  # where the rows not yet looked at begin in ``order``
    while True:
        batch: list[int] = []
        seen: set[str] = set()
        kept: list[int] = []
        candidates = iter(waiting)
        position = rest
        for row in candidates:
            if texts[row].isdisjoint(seen) and len(batch) < batch_size:
                batch.append(row)
                seen |= texts[row]
            else:
                kept.append(row)
        while len(batch) < batch_size and position < len(order):
            row = order[position]
            position += 1
            if texts[row].isdisjoint(seen):
                batch.append(row)
                seen |= texts[row]
            else:
                kept.append(row)
        if len(batch) < batch_size:
            return
        waiting, rest = kept, position
        yield batch


def no_duplicate_batches(texts: Sequence[frozenset[str]], count: int, batch_size: int, draws: torch.Generator,
                         name: str = "the data") -> list[list[int]]:
    """``count`` batches of ``batch_size`` rows, no text twice in a batch, from passes over random orders."""
    batches: list[list[int]] = []
    while len(batches) < count:
        before = len(batches)
        batches += _one_pass(torch.randperm(len(texts), generator=draws).tolist(), texts, batch_size)
        if len(batches) == before:
            raise DataError(f"{name}: too few distinct texts to fill a batch of {batch_size} rows without a "
                            f"duplicate; lower train.global_batch_size or use --batch-sampler batch_sampler")
    return batches[:count]


class SampledRows:
    """The rows of several datasets (one after another) as the engine's batches, in the batches each
    epoch's plan makes: ``len`` is the rows an epoch reads, ``epoch_order`` the plan flattened."""

    def __init__(self, rows: Batches, pairs: Pairs, sizes: Sequence[int], names: Sequence[str], batch_size: int,
                 batch_sampler: str = "batch_sampler", multi_dataset: str = "proportional"):
        if batch_sampler not in BATCH_SAMPLERS or multi_dataset not in MULTI_DATASET_SAMPLERS:
            raise ConfigError(f"batch_sampler={batch_sampler!r}, multi_dataset_batch_sampler={multi_dataset!r}: "
                              f"one of {', '.join(BATCH_SAMPLERS)} and one of {', '.join(MULTI_DATASET_SAMPLERS)}")
        for name, size in zip(names, sizes):
            if size < batch_size:
                raise ConfigError(f"{name} gives {size} training rows, fewer than train.global_batch_size="
                                  f"{batch_size} (each batch comes from one dataset)")
        self.rows, self.sizes, self.names, self.batch_size = rows, list(sizes), list(names), batch_size
        self.batch_sampler, self.multi_dataset = batch_sampler, multi_dataset
        self.texts = [frozenset(row) for row in zip(pairs.queries, pairs.positives, *pairs.negatives)] \
            if batch_sampler == "no_duplicates" else []
        counts = [size // batch_size for size in self.sizes]
        self.batches = sum(counts) if multi_dataset == "proportional" else min(counts) * len(counts)
        self._planned: tuple[tuple[int, int], list[list[int]]] | None = None

    def __len__(self) -> int:
        return self.batches * self.batch_size

    def batch(self, indices: Any) -> dict[str, torch.Tensor]:
        return self.rows.batch(indices)

    def dataset_batches(self, seed: int, epoch: int, which: int) -> list[list[int]]:
        """Dataset ``which``'s batches of the epoch, as row indices of all the rows."""
        size, first, count = self.sizes[which], sum(self.sizes[:which]), self.sizes[which] // self.batch_size
        draws = generator(seed, epoch, which)
        if self.batch_sampler == "no_duplicates":
            local = no_duplicate_batches(self.texts[first:first + size], count, self.batch_size, draws,
                                         self.names[which])
        else:
            order = torch.randperm(size, generator=draws).tolist()
            local = [order[b * self.batch_size:(b + 1) * self.batch_size] for b in range(count)]
        return [[first + i for i in batch] for batch in local]

    def plan(self, seed: int, epoch: int) -> list[list[int]]:
        """The epoch's batches in order, each of one dataset."""
        if self._planned is not None and self._planned[0] == (seed, epoch):
            return self._planned[1]
        each = [self.dataset_batches(seed, epoch, d) for d in range(len(self.sizes))]
        if self.multi_dataset == "round_robin":
            turns = min(len(batches) for batches in each)
            batches = [each[d][t] for t in range(turns) for d in range(len(each))]
        else:  # every batch once, the datasets drawn in a random order
            owners = torch.tensor([d for d, batches in enumerate(each) for _ in batches])
            owners = owners[torch.randperm(len(owners), generator=generator(seed, epoch, len(each)))]
            taken = [iter(batches) for batches in each]
            batches = [next(taken[d]) for d in owners.tolist()]
        self._planned = (seed, epoch), batches
        return batches

    def epoch_order(self, seed: int, epoch: int) -> torch.Tensor:
        """The row indices of the epoch, batch after batch (what BatchStream cuts into micro-batches)."""
        return torch.tensor([i for batch in self.plan(seed, epoch) for i in batch], dtype=torch.long)


def sampled_rows(rows: Batches, pairs: Pairs, sizes: Sequence[int], paths: Sequence[Path], batch_size: int,
                 batch_sampler: str, multi_dataset: str, seed: int) -> Batches:
    """``rows`` as they are for one dataset and the default sampler (the engine's order); else planned by
    :class:`SampledRows`, whose first epoch is planned here so that data it cannot batch fails before the run."""
    if len(sizes) == 1 and batch_sampler == "batch_sampler":
        return rows
    sampled = SampledRows(rows, pairs, sizes, [str(p) for p in paths], batch_size, batch_sampler, multi_dataset)
    sampled.plan(seed, 0)
    return sampled
