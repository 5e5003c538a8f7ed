"""The GLUE and NER heads: Hugging Face's BertFor{Sequence,Token}Classification in and out, equal logits."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"  # never reach the network; set before transformers is imported
transformers = pytest.importorskip("transformers")

from test_convert import SMALL, batch, randomize_  # noqa: E402

from bertforge.config import ModelConfig  # noqa: E402
from bertforge.formats.bert_tf1 import export_tf1  # noqa: E402
from bertforge.formats.hf import NewlyInitializedWarning, export_hf, hf_labels, load_hf  # noqa: E402
from bertforge.formats.load import load_model  # noqa: E402
from bertforge.formats.weights import ConversionError, save_weights  # noqa: E402
from bertforge.models.bert import BertForPreTraining, BertForSequenceClassification, BertForTokenClassification  # noqa: E402
from bertforge.runs import CheckpointError  # noqa: E402

HEADS = {"classification": (BertForSequenceClassification, "BertForSequenceClassification"),
         "token_classification": (BertForTokenClassification, "BertForTokenClassification")}


@pytest.mark.parametrize("head", sorted(HEADS))
@pytest.mark.parametrize("num_labels", [1, 3])
def test_export_gives_transformers_equal_logits_and_label_names(tmp_path, head, num_labels):
    ours_class, hf_name = HEADS[head]
    torch.manual_seed(0)
    ours = ours_class(ModelConfig(**SMALL), num_labels).eval()
    randomize_(ours, seed=1)
    labels = [f"tag{i}" for i in range(num_labels)]
    export_hf(ours, tmp_path / "hf", labels=labels, without_tokenizer=True)
    hf = getattr(transformers, hf_name).from_pretrained(tmp_path / "hf").eval()
    ids, types, mask = batch()
    with torch.no_grad():
        mine = ours(ids, types, mask)
        theirs = hf(input_ids=ids, token_type_ids=types, attention_mask=mask).logits
    torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)
    assert hf.config.id2label == dict(enumerate(labels)) and hf_labels(tmp_path / "hf") == labels
    if head == "classification":  # transformers takes an MSE loss for one output
        assert hf.config.problem_type == ("regression" if num_labels == 1 else "single_label_classification")


@pytest.mark.parametrize("head", sorted(HEADS))
def test_a_transformers_fine_tune_loads_for_prediction(tmp_path, head):
    _, hf_name = HEADS[head]
    torch.manual_seed(2)
    config = transformers.BertConfig(**SMALL, num_labels=5)
    hf = getattr(transformers, hf_name)(config).eval()
    randomize_(hf, seed=3)
    hf.save_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NewlyInitializedWarning)  # nothing may be left fresh
        ours = load_hf(tmp_path, head=head)
        again = load_model(tmp_path, head=head, num_labels=5)
    assert ours.num_labels == 5
    ids, types, mask = batch(seed=4)
    with torch.no_grad():
        theirs = hf(input_ids=ids, token_type_ids=types, attention_mask=mask).logits
        torch.testing.assert_close(ours(ids, types, mask), theirs, atol=1e-5, rtol=0)
        assert torch.equal(again(ids, types, mask), ours(ids, types, mask))
    with pytest.raises(ConversionError, match="classifier has 5 labels, not the 3 asked for"):
        load_model(tmp_path, head=head, num_labels=3)


def test_a_new_head_on_a_pretrained_encoder(tmp_path):
    """From a pre-training checkpoint: the encoder and pooler come along, the classifier is new."""
    torch.manual_seed(5)
    pretrained = BertForPreTraining(ModelConfig(**SMALL))
    export_hf(pretrained, tmp_path / "hf", without_tokenizer=True)
    with pytest.warns(NewlyInitializedWarning, match="classifier.weight"):
        model = load_model(tmp_path / "hf", head="classification", num_labels=2)
    assert torch.equal(model.bert.pooler.dense.weight, pretrained.bert.pooler.dense.weight)
    assert torch.equal(model.bert.encoder.layer[1].output.dense.weight,
                       pretrained.bert.encoder.layer[1].output.dense.weight)
    with pytest.raises(ConversionError, match="has no classifier; give num_labels"):
        load_model(tmp_path / "hf", head="token_classification")


def test_ours_round_trip_and_what_is_refused(tmp_path):
    from bertforge.config import Config

    torch.manual_seed(6)
    model = BertForTokenClassification(ModelConfig(**SMALL), 4).eval()
    out = tmp_path / "ours"
    out.mkdir()
    save_weights(model, out / "model.safetensors")
    config = Config(model=ModelConfig(**SMALL))
    config.data.seq_len = 64
    (out / "config.yaml").write_text(config.to_yaml(), encoding="utf-8")
    back = load_model(out, head="token_classification")
    ids, types, mask = batch()
    with torch.no_grad():
        assert torch.equal(back(ids, types, mask), model(ids, types, mask))
    with pytest.raises(CheckpointError, match="classifier has 4 labels, not the 2"):
        load_model(out, head="token_classification", num_labels=2)
    with pytest.raises(ConversionError, match="cannot export BertForTokenClassification as a TF1"):
        export_tf1(model, tmp_path / "tf1")
    with pytest.raises(ConversionError, match="2 label names for a classifier of 4 outputs"):
        export_hf(model, tmp_path / "hf", labels=["O", "B-X"])
    assert not (tmp_path / "hf").exists()
    exported = export_hf(model, tmp_path / "hf2", without_tokenizer=True)
    assert json.loads((exported / "config.json").read_text())["id2label"]["3"] == "LABEL_3"
