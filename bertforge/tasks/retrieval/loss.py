"""Contrastive training of embedding models: in-batch negatives, MaxSim, gradient caching and ranks.

The loss is sentence-transformers' MultipleNegativesRankingLoss: each query's scaled cosine
similarity to every document of the batch (the positives of all queries, then their hard
negatives), and the cross-entropy of its own positive; ``symmetric`` averages the softmax
denominator with the one of each positive over all queries (their MultipleNegativesSymmetric-
RankingLoss, now ``directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction"``).
Late interaction scores with PyLate's MaxSim instead (each query token's best document token,
summed; tokens left out count 0) at scale 1, as PyLate's Contrastive loss. Matryoshka (``sizes``):
the single-vector loss summed over (dimension, weight) pairs, each on the embeddings' first
``dimension`` entries (cosine renormalizes them), as sentence-transformers' MatryoshkaLoss wrapped
around MultipleNegativesRankingLoss.

:class:`RetrievalLoss` is the engine's loss function. Under torchrun the documents (and for the
symmetric loss the queries) of every rank are gathered (:func:`gather_rows`): each rank's loss is
its queries' mean over the global batch's documents, and the gradients that reach other ranks'
embeddings go back to them, so that the engine's mean over ranks is one process's loss and
gradient on the whole global batch. With ``cache_chunk`` it is GradCache (Gao et al. 2021): the
embeddings of the whole batch first, without a graph, chunk by chunk; the loss and its gradient
with respect to them; then each chunk again with a graph, backward from its cached gradient
(dropout replayed from the chunk's saved random state), so that only one chunk's activations
live at a time and the loss and gradients are those of the whole batch.
"""

from __future__ import annotations

import contextlib
import typing
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from bertforge.parallel.dist import unwrap


def cosine_scores(queries: torch.Tensor, documents: torch.Tensor) -> torch.Tensor:
    """(Q, D) cosine similarities of (Q, dim) and (D, dim) embeddings."""
    return F.normalize(queries, dim=-1) @ F.normalize(documents, dim=-1).T


def maxsim_scores(queries: torch.Tensor, documents: torch.Tensor, query_kept: torch.Tensor | None = None,
                  document_kept: torch.Tensor | None = None, chunk: int = 64) -> torch.Tensor:
    """(Q, D) MaxSim of (Q, S, dim) query and (D, T, dim) document token embeddings, as PyLate's
    ``colbert_scores``: the similarities of tokens left out (``*_kept`` False) count 0; each query
    token takes its best document token, and a query sums them. Queries go ``chunk`` at a time."""
    rows = []
    for first in range(0, queries.shape[0], chunk):
        scores = torch.einsum("ash,bth->abst", queries[first:first + chunk], documents)
        if query_kept is not None:
            scores = scores * query_kept[first:first + chunk, None, :, None]
        if document_kept is not None:
            scores = scores * document_kept[None, :, None, :]
        rows.append(scores.max(dim=-1).values.sum(dim=-1))
    return torch.cat(rows)


def in_batch_loss(scores: torch.Tensor, positives: torch.Tensor, reverse: torch.Tensor | None = None) -> torch.Tensor:
    """The mean over queries of ``-log softmax`` of each one's positive: ``scores`` (Q, D) of every
    query against every document, ``positives`` (Q,) each query's column; ``reverse`` (Q, Q'):
    each query's positive against every query, whose log-normalizer is averaged with the
    query's (the symmetric loss)."""
    log_z = torch.logsumexp(scores, dim=1)
    if reverse is not None:
        log_z = (log_z + torch.logsumexp(reverse, dim=1)) / 2
    rows = torch.arange(scores.shape[0], device=scores.device)
    return -(scores[rows, positives] - log_z).mean()


# ---------------------------------------------------------------- ranks


def world() -> tuple[int, int]:
    """(rank, world size) of the process group, (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _Gather(torch.autograd.Function):
    """Every rank's rows, concatenated in rank order; backward: the gradients of every rank's loss
    summed (an all-reduce), this rank's rows kept."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor) -> torch.Tensor:
        rank, world_size = world()
        parts = [torch.empty_like(rows) for _ in range(world_size)]
        dist.all_gather(parts, rows.contiguous())
        ctx.rank, ctx.count = rank, rows.shape[0]
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous()
        dist.all_reduce(grad)
        return grad[ctx.rank * ctx.count:(ctx.rank + 1) * ctx.count]


def gather_rows(rows: torch.Tensor, fill: float | bool = 0) -> torch.Tensor:
    """Every rank's ``rows`` (the same count on each) in rank order, the gradient flowing back to
    each rank's own; a second dimension of other lengths (token embeddings, their masks) is
    padded with ``fill`` to the longest. One process: ``rows`` itself."""
    _, world_size = world()
    if world_size == 1:
        return rows
    if rows.dim() > 1:
        longest = torch.tensor([rows.shape[1]], device=rows.device)
        dist.all_reduce(longest, op=dist.ReduceOp.MAX)
        if int(longest) > rows.shape[1]:
            pad = rows.new_full((rows.shape[0], int(longest) - rows.shape[1], *rows.shape[2:]), fill)
            rows = torch.cat([rows, pad], dim=1)
    if not rows.requires_grad:
        parts = [torch.empty_like(rows) for _ in range(world_size)]
        dist.all_gather(parts, rows.contiguous())
        return torch.cat(parts)
    return _Gather.apply(rows)


# ---------------------------------------------------------------- the engine's loss


class RandomState:
    """The random state (CPU and the device's) when a chunk was embedded, to draw its dropout again."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)


class RetrievalLoss:
    """The engine's loss for a batch of ``query_ids``/``query_mask`` rows and ``document_ids``/
    ``document_mask`` rows (the positives, then the hard negatives, each in query order); ``scale``
    multiplies the scores (20 for cosine, 1 for MaxSim), ``cache_chunk`` rows per forward with
    gradients (0: the whole batch at once), ``sizes`` Matryoshka's (dimension, weight) pairs
    (single vectors; none: the whole embedding, weight 1)."""

    def __init__(self, scale: float = 20.0, symmetric: bool = False, cache_chunk: int = 0,
                 sizes: Sequence[tuple[int, float]] = ()):
        self.scale, self.symmetric, self.cache_chunk = scale, symmetric, cache_chunk
        self.sizes: list[tuple[int | None, float]] = list(sizes) or [(None, 1.0)]  # (None: every dimension)

    def __call__(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        sides = [(batch["query_ids"], batch["query_mask"]), (batch["document_ids"], batch["document_mask"])]
        if not self.cache_chunk:
            queries, documents = (model(ids, mask) for ids, mask in sides)
            return {"loss": self.loss(model, batch, queries, documents)}
        return {"loss": self.cached(model, batch, sides)}

    def kept(self, model: nn.Module, batch: dict[str, torch.Tensor], kind: str) -> torch.Tensor | None:
        """Late interaction: the tokens scored; None for single vectors."""
        kept = getattr(unwrap(model), "kept", None)
        return None if kept is None else kept(batch[f"{kind}_ids"], batch[f"{kind}_mask"], kind)

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor], queries: torch.Tensor,
             documents: torch.Tensor) -> torch.Tensor:
        """The loss of this rank's queries against the documents of every rank."""
        rank, world_size = world()
        count = queries.shape[0]
        negatives = documents.shape[0] // count - 1
        # every rank's documents, positives before negatives: [pos of rank 0, pos of rank 1, …, neg of rank 0, …]
        groups = documents.view(negatives + 1, count, *documents.shape[1:]).unbind(0)
        everyone = torch.cat([gather_rows(group) for group in groups])
        positives = torch.arange(count, device=queries.device) + rank * count
        query_kept, document_kept = self.kept(model, batch, "query"), self.kept(model, batch, "document")
        all_queries = gather_rows(queries) if self.symmetric else None  # for this rank's positives against them
        if query_kept is not None:
            assert document_kept is not None
            kept_groups = document_kept.view(negatives + 1, count, -1).unbind(0)
            everyone_kept = torch.cat([gather_rows(group, False) for group in kept_groups])
            scores = maxsim_scores(queries, everyone, query_kept, everyone_kept)
            reverse = None if all_queries is None else maxsim_scores(
                all_queries, groups[0], gather_rows(query_kept, False), document_kept[:count]).T * self.scale
            return in_batch_loss(scores * self.scale, positives, reverse)
        total: torch.Tensor | float = 0.0
        for dim, weight in self.sizes:
            scores = cosine_scores(queries[:, :dim], everyone[:, :dim])
            reverse = None if all_queries is None else \
                cosine_scores(all_queries[:, :dim], groups[0][:, :dim]).T * self.scale
            total = total + weight * in_batch_loss(scores * self.scale, positives, reverse)
        return typing.cast(torch.Tensor, total)

    def cached(self, model: nn.Module, batch: dict[str, torch.Tensor],
               sides: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """GradCache: the loss, with the parameters' gradients of all chunks but the last already
        accumulated; the last chunk's come with the engine's backward of the returned loss."""
        device = sides[0][0].device
        chunks = [(side, slice(first, first + self.cache_chunk))
                  for side, (ids, _) in enumerate(sides) for first in range(0, ids.shape[0], self.cache_chunk)]
        states, outputs = [], [[], []]  # type: ignore[var-annotated]
        with torch.no_grad():
            for side, rows in chunks:
                states.append(RandomState(device))
                outputs[side].append(model(sides[side][0][rows], sides[side][1][rows]))
        after = RandomState(device)
        leaves = [torch.cat(out).detach().requires_grad_() for out in outputs]
        loss = self.loss(model, batch, *leaves)
        grads = torch.autograd.grad(loss, leaves)
        surrogate = loss.new_zeros(())
        for index, ((side, rows), state) in enumerate(zip(chunks, states)):
            last = index == len(chunks) - 1
            with contextlib.nullcontext() if last else no_sync(model):
                state.restore()
                embeddings = model(sides[side][0][rows], sides[side][1][rows])
                part = (embeddings * grads[side][rows]).sum()
                if last:
                    surrogate = part
                else:
                    part.backward()
        after.restore()
        # the loss's value, and the last chunk's gradient when the engine calls backward
        return loss.detach() + surrogate - surrogate.detach()


def no_sync(model: nn.Module) -> contextlib.AbstractContextManager:
    """DDP's ``no_sync`` (gradients reduced with the step's last backward only), else nothing."""
    inner = getattr(model, "_orig_mod", model)
    return inner.no_sync() if isinstance(inner, nn.parallel.DistributedDataParallel) else contextlib.nullcontext()
