"""Every config field transformers reads is modelled or refused in one line (issue 31.5).

The keys of transformers' own ``BertConfig`` and ``ModernBertConfig`` (their ``__init__`` and what
``to_dict`` writes) must each be modelled, fixed (refused when not the one value we model) or listed
as ignored with why. Linear rotary scaling (``rope_parameters`` of transformers 5 and the older
``rope_scaling``) is modelled: our logits equal ``ModernBertForMaskedLM``'s with it, both ways; what
we do not model is refused in one line naming the key and value.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os

import pytest
import torch
from test_modernbert import CFG, hf_config
from test_modernbert_interop import perturbed

os.environ["HF_HUB_OFFLINE"] = "1"  # never reach the network; set before transformers is imported
transformers = pytest.importorskip("transformers")

from bertforge.cli import main  # noqa: E402
from bertforge.formats.hf import (  # noqa: E402
    BERT_FIXED,
    HF_IGNORED_KEYS,
    HF_MODELLED_KEYS,
    MODERNBERT_FIXED,
    export_hf,
    model_config_from_hf,
)
from bertforge.formats.load import load_model  # noqa: E402
from bertforge.formats.weights import ConversionError  # noqa: E402

FAMILIES = {"bert": (transformers.BertConfig, BERT_FIXED), "modernbert": (transformers.ModernBertConfig,
                                                                          MODERNBERT_FIXED)}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_key_transformers_reads_is_modelled_fixed_or_ignored(family):
    config_class, fixed = FAMILIES[family]
    keys = set(inspect.signature(config_class.__init__).parameters) - {"self", "kwargs"}
    keys |= set(config_class().to_dict())
    unaccounted = keys - HF_MODELLED_KEYS[family] - set(fixed) - set(HF_IGNORED_KEYS)
    assert unaccounted == set(), f"transformers' {config_class.__name__} keys with no decision: {unaccounted}"
    assert not HF_MODELLED_KEYS[family] & set(HF_IGNORED_KEYS)  # one decision each


def ids_and_mask() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    ids, mask = torch.randint(1, CFG.vocab_size, (2, 200), generator=gen), torch.ones(2, 200, dtype=torch.long)
    mask[1, 120:] = 0
    return ids, mask


def logits_gap(ours: torch.nn.Module, theirs: torch.nn.Module) -> float:
    ids, mask = ids_and_mask()
    with torch.no_grad():
        mine = ours(ids, None, mask)[0]
        other = theirs(input_ids=ids, attention_mask=mask).logits
    return float((mine - other)[mask.bool()].abs().max())


@pytest.mark.parametrize("layout", ["rope_parameters", "rope_scaling"])
def test_linear_rope_scaling_equals_transformers_both_ways(tmp_path, layout):
    torch.manual_seed(0)
    theirs = perturbed(transformers.ModernBertForMaskedLM(hf_config(
        CFG, attn_implementation="eager", rope_scaling={"rope_type": "linear", "factor": 2.0})))
    assert theirs.config.rope_parameters["full_attention"]["factor"] == 2.0
    theirs.save_pretrained(tmp_path / "hf")
    if layout == "rope_scaling":  # the older key, with the published thetas (transformers 5 reads both)
        config = json.loads((tmp_path / "hf" / "config.json").read_text())
        del config["rope_parameters"]
        config.update(rope_scaling={"rope_type": "linear", "factor": 2.0}, global_rope_theta=CFG.global_rope_theta,
                      local_rope_theta=CFG.local_rope_theta)
        (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    ours = load_model(tmp_path / "hf")
    assert ours.config.rope_scaling_factor == 2.0
    gap = logits_gap(ours, theirs)
    print(f"{layout} linear factor 2: max |logit difference| {gap:.2e}")
    assert gap < 1e-5
    unscaled = load_model(tmp_path / "hf")
    unscaled.model.global_rotary.__init__(CFG.hidden_size // CFG.num_attention_heads, CFG.max_position_embeddings,
                                          CFG.global_rope_theta)
    assert logits_gap(unscaled, theirs) > 1e-3  # the scaling matters: dropping it changes the logits
    export_hf(ours, tmp_path / "back", without_tokenizer=True)
    back = transformers.ModernBertForMaskedLM.from_pretrained(tmp_path / "back", attn_implementation="eager").eval()
    assert back.config.rope_parameters["sliding_attention"] == {"rope_type": "linear", "factor": 2.0,
                                                               "rope_theta": CFG.local_rope_theta}
    assert logits_gap(ours, back) < 1e-5


def test_sliding_window_sets_the_window_as_transformers_does(tmp_path):
    """transformers 5 reads a config.json's ``sliding_window`` as half the window (local_attention =
    2 * sliding_window, over the local_attention written beside it): our import, the same (issue 40.6)."""
    torch.manual_seed(0)
    perturbed(transformers.ModernBertForMaskedLM(hf_config(CFG))).save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["sliding_window"] = 16  # a window of 32 where local_attention says 128
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    theirs = transformers.ModernBertForMaskedLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    assert (config["local_attention"], theirs.config.local_attention) == (128, 32)
    assert main(["import", "hf", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 0
    ours = load_model(tmp_path / "ours")
    assert ours.config.local_attention == 32
    assert logits_gap(ours, theirs) < 1e-5


REFUSED = [  # (family, key, value, the message's end)
    ("modernbert", "sliding_window", 0, "sliding_window=0 is not supported (a positive integer: half the local "
     "layers' window, model.local_attention // 2)"),
    ("modernbert", "rope_scaling", {"rope_type": "dynamic", "factor": 2.0},
     "rope_scaling={\"rope_type\": \"dynamic\", \"factor\": 2.0} is not supported (rope_type 'default', or 'linear' "
     "with a positive factor)"),
    ("modernbert", "rope_parameters", {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e5},
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
     "rope_parameters.full_attention factor 2.0, rope_parameters.sliding_attention factor 1.0 differ; bertforge's "
     "ModernBERT scales every layer's positions alike (model.rope_scaling_factor)"),
    ("modernbert", "rope_parameters", {"rope_type": "linear", "factor": 2.0},
     "rope_parameters={\"rope_type\": \"linear\", \"factor\": 2.0} is not supported (transformers 5's ModernBERT "
     "layout: one object for full_attention, one for sliding_attention)"),
    ("modernbert", "is_encoder_decoder", True, "is_encoder_decoder=true is not supported (bertforge's ModernBERT has "
     "is_encoder_decoder=false, as the published models)"),
    ("bert", "add_cross_attention", True, "add_cross_attention=true is not supported (bertforge's BERT has "
     "add_cross_attention=false, as the published models)"),
    ("bert", "tie_word_embeddings", False, "tie_word_embeddings=false is not supported (bertforge's BERT has "
     "tie_word_embeddings=true, as the published models)"),
    ("bert", "classifier_dropout", 0.3, "classifier_dropout=0.3 is not supported (bertforge's BERT heads drop with "
     "hidden_dropout_prob; null or that value)"),
    ("bert", "problem_type", "multi_label_classification", "problem_type='multi_label_classification' is not "
     "supported (bertforge's classifiers are single-label, or regression with one output)"),
]


@pytest.mark.parametrize(("family", "key", "value", "message"), REFUSED,
                         ids=[f"{r[1]}-{i}" for i, r in enumerate(REFUSED)])
def test_what_we_do_not_model_is_refused_in_one_line(family, key, value, message):
    config = {**(CFG_JSON if family == "modernbert" else {"model_type": "bert"}), key: value}
    with pytest.raises(ConversionError) as refused:
        model_config_from_hf(config, "x/config.json")
    assert str(refused.value) == f"x/config.json: {message}"


CFG_JSON = {"model_type": "modernbert", **{k: v for k, v in dataclasses.asdict(CFG).items() if k != "family"}}


def test_import_hf_refuses_a_dynamic_rope_in_one_line(tmp_path, capsys):
    torch.manual_seed(0)
    transformers.ModernBertForMaskedLM(hf_config(CFG)).save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["rope_parameters"]["full_attention"].update(rope_type="yarn", factor=4.0)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert main(["import", "hf", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'hf' / 'config.json'}: rope_parameters.full_attention=")
    assert err.count("\n") == 1 and "'linear' with a positive factor" in err and not (tmp_path / "ours").exists()
