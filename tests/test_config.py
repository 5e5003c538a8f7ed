"""Config: presets, shipped YAML files, dotted overrides and the errors they raise."""

import pytest
import yaml

from bertforge.config import (CONFIG_DIR, MODEL_PRESETS, Config, ConfigError, config_from_dict,
                              load_config, parse_overrides)

SHIPPED = sorted(p.stem for p in CONFIG_DIR.glob("pretrain_*.yaml"))  # squad_*: tests/test_squad_train.py


def test_presets_are_the_standard_bert_shapes():
    shapes = {name: (p["num_hidden_layers"], p["hidden_size"], p["num_attention_heads"], p["intermediate_size"])
              for name, p in MODEL_PRESETS.items()}
    assert shapes == {
        "tiny": (2, 128, 2, 512), "mini": (4, 256, 4, 1024), "small": (4, 512, 8, 2048),
        "medium": (8, 512, 8, 2048), "base": (12, 768, 12, 3072), "large": (24, 1024, 16, 4096),
    }


def test_shipped_configs_include_the_four_named_ones():
    assert {"pretrain_tiny", "pretrain_base_128", "pretrain_large_128_phase1",
            "pretrain_large_512_phase2"} <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_config_parses_and_round_trips(name):
    cfg = load_config(name)
    assert config_from_dict(yaml.safe_load(cfg.to_yaml())) == cfg


def test_phase_configs_have_the_published_recipe():
    p1, p2 = load_config("pretrain_large_128_phase1"), load_config("pretrain_large_512_phase2")
    assert (p1.model.num_hidden_layers, p1.model.hidden_size) == (24, 1024)
    assert (p1.data.seq_len, p1.data.max_predictions, p1.train.global_batch_size, p1.train.lr) == (128, 20, 65536, 0.006)
    assert (p2.data.seq_len, p2.data.max_predictions, p2.train.global_batch_size, p2.train.lr) == (512, 80, 32768, 0.004)
    assert p1.accumulation_steps == 1024 and p2.accumulation_steps == 2048


def test_overrides_convert_types_and_apply_last():
    cfg = load_config("base", parse_overrides([
        "--train.global_batch_size", "256", "--train.lr=1e-4", "--data.synthetic",
        "--execution.precision", "bf16", "--train.lr_table", "{0: 1.0e-4, 100: 5.0e-5}"]))
    assert cfg.model.hidden_size == 768
    assert cfg.train.global_batch_size == 256 and cfg.train.lr == 1e-4
    assert cfg.data.synthetic is True and cfg.execution.precision == "bf16"
    assert cfg.train.lr_table == {0: 1e-4, 100: 5e-5}


def test_model_preset_then_field_override():
    cfg = config_from_dict({"model": {"preset": "tiny", "vocab_size": 100}})
    assert (cfg.model.hidden_size, cfg.model.vocab_size) == (128, 100)


@pytest.mark.parametrize("overrides, message", [
    ([("train.lrr", "1")], "unknown config key 'train.lrr'"),
    ([("trian.lr", "1")], "unknown config section 'trian'"),
    ([("train.steps", "ten")], "train.steps: expected an integer, got 'ten'"),
    ([("data.synthetic", "maybe")], "data.synthetic: expected true or false"),
    ([("train.optimizer", "sgd")], "train.optimizer: 'sgd' is not one of lamb, adamw"),
    ([("model", "huge")], "unknown preset 'huge'"),
    ([("train.global_batch_size", "100"), ("train.micro_batch_size", "32")],
     "train.global_batch_size=100 is not a multiple"),
    ([("data.seq_len", "1024")], "data.seq_len=1024 exceeds model.max_position_embeddings=512"),
    ([("model.num_attention_heads", "5")], "model.hidden_size=768 is not divisible"),
])
def test_bad_values_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        load_config(None, overrides)


def test_yaml_errors_name_the_file(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("train:\n  lr: fast\n")
    with pytest.raises(ConfigError, match=r"train.lr: expected a number, got 'fast' in .*mine.yaml"):
        load_config(str(path))
    with pytest.raises(ConfigError, match="unknown config 'nope'"):
        load_config("nope")
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(str(tmp_path / "absent.yaml"))


def test_yaml_int_for_float_accepted_but_bool_for_int_rejected():
    assert config_from_dict({"train": {"lr": 1}}).train.lr == 1.0
    with pytest.raises(ConfigError, match="train.steps: expected an integer, got True"):
        config_from_dict({"train": {"steps": True}})


def test_parse_overrides_rejects_positional_junk():
    with pytest.raises(ConfigError, match="unexpected argument 'oops'"):
        parse_overrides(["oops"])


def test_defaults_are_bert_base():
    cfg = Config()
    assert (cfg.model.num_hidden_layers, cfg.model.hidden_size, cfg.model.vocab_size) == (12, 768, 30522)
