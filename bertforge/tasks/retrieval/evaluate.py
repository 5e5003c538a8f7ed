"""Retrieval evaluation: encode a corpus, search it exactly, score the run as trec_eval does.

The model is anything with ``encode(texts, kind, batch_size)``: a bi-encoder returns one
float32 tensor ``[n, dim]`` (:class:`Embedder`), a late-interaction model one ``[tokens_i, dim]``
tensor per text (:class:`LateInteraction`). Queries are encoded with ``kind="query"``,
documents with ``kind="document"`` (the model adds its prefixes and lengths).

Encoding. The corpus is encoded shortest first (batches of similar lengths pad little), a
batch per call, under a progress bar, into one preallocated ``[n, dim]`` tensor (dense) or one
flat ``[all tokens, dim]`` tensor with offsets (late interaction). With a cache directory the
corpus embeddings are kept in ``corpus-<key>.safetensors``, written atomically; the key hashes
the model's identity (``model_key``: for a model directory, the content of every file in it,
weights, config, tokenizer and pooling settings alike, since each changes the embeddings) and
the corpus (its ids and texts, in order).

Search. Exact: queries in chunks of ``query_chunk`` against documents in chunks of
``doc_chunk``, a running top-k per query merged after each chunk. Besides the corpus
embeddings themselves (n × dim × 4 bytes for a bi-encoder, tokens × dim × 4 for late
interaction: the floor of any exact search) and the queries', the search holds one score block,
``query_chunk × doc_chunk`` floats (late interaction: ``query_chunk × query tokens × doc_chunk ×
longest document of the chunk``), and the running top-k, ``query_chunk × 2k`` (score, index)
pairs: its memory does not grow with the corpus. Bi-encoder scores are cosine similarities (the
scaled cosine the contrastive loss trains); late interaction's are MaxSim: for each query token
the largest dot product with a document token, summed over the query's tokens.

Output: ``run.trec`` (``qid Q0 docid rank score tag``, the first ``top_k`` per query in
trec_eval's order) and ``metrics.json`` beside it, written together or not at all.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from bertforge.fileio import atomic_file, atomic_files
from bertforge.observe.log import ProgressBar

from .beir import RetrievalSet
from .metrics import DEPTH, METRICS, evaluate_run, trec_ranking

log = logging.getLogger(__name__)

QUERY_CHUNK = 256
DOC_CHUNK = 16384           # documents per score block of a bi-encoder
LATE_BLOCK = 1 << 24        # floats per score block of MaxSim (64 MiB)


class Encoder(Protocol):
    def encode(self, texts: list[str], kind: str = ..., batch_size: int = ...) -> Any: ...


def corpus_fingerprint(ids: Sequence[str], texts: Sequence[str]) -> str:
    digest = hashlib.sha256()
    for doc_id, text in zip(ids, texts):
        digest.update(doc_id.encode("utf-8") + b"\0" + text.encode("utf-8") + b"\0")
    return digest.hexdigest()


SKIPPED_STATE = ("optimizer.pt", "trainer.pt")  # a checkpoint's training state: no part of the embeddings


def directory_fingerprint(path: str | Path) -> str:
    """A model's identity: the sha256 of every file of its directory (relative path and content:
    weights, config, tokenizer, pooling and prefixes), a checkpoint's optimizer and trainer state
    and hidden files left out; of the file itself for a file."""
    root = Path(path)
    files = sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")
                   and p.name not in SKIPPED_STATE) if root.is_dir() else [root]
    digest = hashlib.sha256()
    for file in files:
        digest.update(str(file.relative_to(root) if root.is_dir() else file.name).encode("utf-8") + b"\0")
        with open(file, "rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
    return digest.hexdigest()


# ---------------------------------------------------------------- encoding

def encode_texts(model: Encoder, texts: Sequence[str], kind: str, batch_size: int = 64,
                 progress: bool = False, label: str = "encode") -> torch.Tensor | list[torch.Tensor]:
    """``model.encode`` of every text, shortest first in batches, returned in the input order:
    one ``[n, dim]`` tensor, or a list of ``[tokens, dim]`` tensors for a late-interaction model."""
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    dense: torch.Tensor | None = None
    tokens: list[torch.Tensor | None] = [None] * len(texts)
    with ProgressBar(len(texts), 0, enabled=progress, label=label) as bar:
        for start in range(0, len(texts), batch_size):
            batch = order[start:start + batch_size]
            out = model.encode([texts[i] for i in batch], kind=kind, batch_size=batch_size)
            if isinstance(out, torch.Tensor):
                if dense is None:  # the whole output at once: no list to concatenate (twice the memory)
                    dense = torch.empty(len(texts), out.shape[1], dtype=torch.float32)
                dense[torch.tensor(batch)] = out.float()
            else:
                for i, t in zip(batch, out):
                    tokens[i] = t.float()
            bar.update(start + len(batch), f"{kind}s")
    if dense is not None:
        return dense
    return [t for t in tokens if t is not None]


def _cached(cache: Path | None, encode: Callable[[], torch.Tensor | list[torch.Tensor]]
            ) -> torch.Tensor | list[torch.Tensor]:
    """The corpus embeddings from ``cache`` when it exists, else ``encode()``'s, saved there."""
    from safetensors.torch import load_file, save_file

    if cache is not None and cache.is_file():
        log.info("corpus embeddings from the cache %s", cache)
        saved = load_file(str(cache))
        if "embeddings" in saved:
            return saved["embeddings"]
        return list(torch.tensor_split(saved["tokens"], saved["offsets"][1:-1].tolist()))
    embeddings = encode()
    if cache is not None:
        if isinstance(embeddings, torch.Tensor):
            tensors = {"embeddings": embeddings.contiguous()}
        else:
            lengths = torch.tensor([0] + [len(t) for t in embeddings])
            tensors = {"tokens": torch.cat(embeddings), "offsets": torch.cumsum(lengths, 0)}
        with atomic_file(cache) as tmp:
            save_file(tensors, str(tmp))
    return embeddings


# ---------------------------------------------------------------- search

def _merge_top_k(best: tuple[torch.Tensor, torch.Tensor] | None, scores: torch.Tensor, columns: torch.Tensor,
                 k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The running top-k (scores, document indices) of a query chunk, with a new block of scores
    whose columns are the documents ``columns``."""
    top, where = scores.topk(min(k, scores.shape[1]), dim=1)
    where = columns[where]
    if best is not None:
        top, pick = torch.cat([best[0], top], dim=1).topk(min(k, best[0].shape[1] + top.shape[1]), dim=1)
        where = torch.cat([best[1], where], dim=1).gather(1, pick)
    return top, where


def dense_search(queries: torch.Tensor, docs: torch.Tensor, k: int, query_chunk: int = QUERY_CHUNK,
                 doc_chunk: int = DOC_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k by cosine similarity: (scores, document indices), each ``[queries, k]``."""
    queries = torch.nn.functional.normalize(queries.float(), dim=1)
    scores_out, index_out = [], []
    for q in range(0, len(queries), query_chunk):
        best = None
        for d in range(0, len(docs), doc_chunk):
            block = torch.nn.functional.normalize(docs[d:d + doc_chunk].float(), dim=1)
            best = _merge_top_k(best, queries[q:q + query_chunk] @ block.T, torch.arange(d, d + len(block)), k)
        assert best is not None
        scores_out.append(best[0])
        index_out.append(best[1])
    return torch.cat(scores_out), torch.cat(index_out)


def _padded(tokens: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``[n, longest, dim]`` zero-padded and the ``[n, longest]`` mask of real tokens."""
    padded = torch.nn.utils.rnn.pad_sequence(list(tokens), batch_first=True)
    lengths = torch.tensor([len(t) for t in tokens])
    return padded, torch.arange(padded.shape[1])[None, :] < lengths[:, None]


def maxsim(queries: torch.Tensor, query_mask: torch.Tensor, docs: torch.Tensor, doc_mask: torch.Tensor
           ) -> torch.Tensor:
    """ColBERT's late-interaction score ``[q, d]`` of padded queries and documents."""
    sims = torch.einsum("qid,cjd->qcij", queries, docs)
    sims = sims.masked_fill(~doc_mask[None, :, None, :], float("-inf")).amax(dim=3)
    return (sims * query_mask[:, None, :]).sum(dim=2)


def late_search(queries: Sequence[torch.Tensor], docs: Sequence[torch.Tensor], k: int,
                query_chunk: int = 32, block: int = LATE_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k by MaxSim: documents longest first in chunks sized so that one score block
    (query chunk × its longest query × documents × their longest) holds about ``block`` floats."""
    order = sorted(range(len(docs)), key=lambda i: -len(docs[i]))
    scores_out, index_out = [], []
    for q in range(0, len(queries), query_chunk):
        q_pad, q_mask = _padded(queries[q:q + query_chunk])
        best, d = None, 0
        while d < len(order):
            longest = max(len(docs[order[d]]), 1)
            size = max(1, block // (q_pad.shape[0] * q_pad.shape[1] * longest))
            chunk = order[d:d + size]
            d_pad, d_mask = _padded([docs[i] for i in chunk])
            best = _merge_top_k(best, maxsim(q_pad, q_mask, d_pad, d_mask), torch.tensor(chunk), k)
            d += len(chunk)
        assert best is not None
        scores_out.append(best[0])
        index_out.append(best[1])
    return torch.cat(scores_out), torch.cat(index_out)


# ---------------------------------------------------------------- the evaluation

def search_run(model: Encoder, data: RetrievalSet, top_k: int = DEPTH, batch_size: int = 64,
               cache_dir: str | Path | None = None, model_key: str | None = None,
               progress: bool = False) -> dict[str, dict[str, float]]:
    """The run: for each query, its ``top_k`` documents and their scores (float32 values)."""
    doc_ids, doc_texts = list(data.corpus), list(data.corpus.values())
    cache = None
    if cache_dir is not None and model_key is not None:
        key = hashlib.sha256(f"{model_key}\0{corpus_fingerprint(doc_ids, doc_texts)}".encode()).hexdigest()
        cache = Path(cache_dir) / f"corpus-{key[:24]}.safetensors"
    docs = _cached(cache, lambda: encode_texts(model, doc_texts, "document", batch_size, progress, "corpus"))
    query_ids = list(data.queries)
    queries = encode_texts(model, [data.queries[q] for q in query_ids], "query", batch_size, progress, "queries")
    k = min(top_k, len(doc_ids))
    if isinstance(docs, torch.Tensor) and isinstance(queries, torch.Tensor):
        scores, indices = dense_search(queries, docs, k)
    elif isinstance(docs, list) and isinstance(queries, list):
        scores, indices = late_search(queries, docs, k)
    else:
        raise TypeError("the model encoded queries and documents differently (one tensor and a list of tensors)")
    return {q: {doc_ids[i]: s for i, s in zip(row_indices.tolist(), row_scores.tolist())}
            for q, row_scores, row_indices in zip(query_ids, scores, indices)}


def trec_lines(run: dict[str, dict[str, float]], tag: str) -> str:
    """The run in TREC's format, ``qid Q0 docid rank score tag``, each query in trec_eval's order;
    scores printed with 9 significant digits, which read back as the same float32."""
    lines = []
    for q, scores in run.items():
        for rank, doc in enumerate(trec_ranking(scores), start=1):
            lines.append(f"{q} Q0 {doc} {rank} {scores[doc]:.9g} {tag}\n")
    return "".join(lines)


def evaluate_retrieval(model: Encoder, data: RetrievalSet, out: str | Path | None = None, *,
                       top_k: int = DEPTH, batch_size: int = 64, cache_dir: str | Path | None = None,
                       model_key: str | None = None, tag: str = "bertforge", progress: bool = False,
                       rerank: tuple[Any, int] | None = None) -> dict[str, Any]:
    """Search ``data`` with ``model`` and score the run: the mean of each metric (METRICS), the
    number of queries and documents; written to ``out/metrics.json`` with ``out/run.trec``.
    ``rerank``, (a reranker, k): the run is each query's first k documents by the reranker's scores
    (rerank.py's ``rerank_run``)."""
    run = search_run(model, data, max(top_k, rerank[1]) if rerank else top_k, batch_size, cache_dir, model_key,
                     progress)
    if rerank is not None:
        from .rerank import rerank_run

        run = rerank_run(rerank[0], run, data.queries, data.corpus, rerank[1], batch_size, progress)
    means, _ = evaluate_run(data.qrels, run)
    result: dict[str, Any] = {name: means[name] for name in METRICS}
    result.update(queries=len(run), documents=len(data.corpus), top_k=min(top_k, len(data.corpus)))
    if rerank is not None:
        result.update(top_k=min(rerank[1], len(data.corpus)), reranked=rerank[1])
    if out is not None:
        out = Path(out)
        with atomic_files([out / "run.trec", out / "metrics.json"]) as (run_file, metrics_file):
            run_file.write_text(trec_lines(run, tag), encoding="utf-8")
            metrics_file.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result
