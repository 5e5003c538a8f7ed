"""Config: presets, shipped YAML files, dotted overrides and the errors they raise."""

import argparse
import json
import math
import typing

import pytest
import yaml

from bertforge.config import (
    CONFIG_DIR,
    MODEL_PRESETS,
    Config,
    ConfigError,
    ExecutionConfig,
    HiddenAct,
    ModelConfig,
    Optimizer,
    Parallel,
    Precision,
    Recompute,
    Schedule,
    TrainConfig,
    config_from_dict,
    load_config,
    parse_overrides,
)
from bertforge.runs import config_from_args
from bertforge.training.engine import BatchWarmup

PRESETS = "(presets: tiny, mini, small, medium, base, large, modernbert-tiny, modernbert-base, modernbert-large)"
SHIPPED = sorted(p.stem for p in CONFIG_DIR.glob("pretrain_*.yaml"))  # squad_*: tests/tasks/test_squad_train.py


def test_presets_are_the_standard_bert_shapes():
    shapes = {name: (p["num_hidden_layers"], p["hidden_size"], p["num_attention_heads"], p["intermediate_size"])
              for name, p in MODEL_PRESETS.items()}
    assert shapes == {
        "tiny": (2, 128, 2, 512), "mini": (4, 256, 4, 1024), "small": (4, 512, 8, 2048),
        "medium": (8, 512, 8, 2048), "base": (12, 768, 12, 3072), "large": (24, 1024, 16, 4096),
        # ModernBERT's (the rest of their configs: tests/models/test_modernbert.py)
        "modernbert-tiny": (4, 128, 2, 192), "modernbert-base": (22, 768, 12, 1152),
        "modernbert-large": (28, 1024, 16, 2624),
    }


def test_shipped_configs_include_the_four_named_ones():
    assert {"pretrain_tiny", "pretrain_base_128", "pretrain_large_128_phase1",
            "pretrain_large_512_phase2"} <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
@pytest.mark.smoke
def test_every_shipped_config_parses_and_round_trips(name):
    cfg = load_config(name)
    assert config_from_dict(yaml.safe_load(cfg.to_yaml())) == cfg


def test_phase_configs_have_the_published_recipe():
    p1, p2 = load_config("pretrain_large_128_phase1"), load_config("pretrain_large_512_phase2")
    assert (p1.model.num_hidden_layers, p1.model.hidden_size) == (24, 1024)
    shape = (p1.data.seq_len, p1.data.max_predictions, p1.train.global_batch_size, p1.train.lr)
    assert shape == (128, 20, 65536, 0.006)
    shape = (p2.data.seq_len, p2.data.max_predictions, p2.train.global_batch_size, p2.train.lr)
    assert shape == (512, 76, 32768, 0.004)
    assert p1.accumulation_steps == 256 and p2.accumulation_steps == 2048  # micro-batches of 256 and 16


def test_overrides_convert_types_and_apply_last():
    cfg = load_config("base", parse_overrides([
        "--train.global_batch_size", "256", "--train.lr=1e-4", "--data.synthetic",
        "--execution.precision", "bf16", "--train.schedule", "table", "--train.lr_table", "{0: 1.0e-4, 100: 5.0e-5}"]))
    assert cfg.model.hidden_size == 768
    assert cfg.train.global_batch_size == 256 and cfg.train.lr == 1e-4
    assert cfg.data.synthetic is True and cfg.execution.precision == "bf16"
    assert cfg.train.lr_table == {0: 1e-4, 100: 5e-5}


def test_an_lr_table_without_the_table_schedule_is_refused_naming_both_keys(capsys):
    """train.lr_table is read only by schedule table: given with another, it would be silently unused."""
    from bertforge.cli import main

    with pytest.raises(ConfigError) as err:
        load_config(None, [("train.lr_table", "{0: 1.0e-4}")])
    assert str(err.value) == ("train.lr_table is given but train.schedule=poly: the table is read only with "
                              "train.schedule table")
    assert main(["config", "--train.schedule", "exp", "--train.lr_table", "{0: 1.0e-4}"]) == 2
    assert capsys.readouterr().err.startswith("error: train.lr_table is given but train.schedule=exp: ")
    cfg = load_config(None, [("train.lr_table", "{0: 1.0e-4}"), ("train.schedule", "table")])
    assert cfg.train.lr_table == {0: 1e-4}


def test_a_decay_length_without_the_wsd_schedule_is_refused_naming_both_keys():
    with pytest.raises(ConfigError) as err:
        load_config(None, [("train.decay_steps", "100")])
    assert str(err.value) == ("train.decay_steps is given but train.schedule=poly: it is read only with train.schedule "
                              "wsd (poly and poly_tf decay over the whole run)")
    with pytest.raises(ConfigError, match=r"^train\.decay_proportion is given but train\.schedule=exp: "):
        load_config(None, [("train.decay_proportion", "0.1"), ("train.schedule", "exp")])
    cfg = load_config(None, [("train.decay_steps", "100"), ("train.schedule", "wsd")])
    assert (cfg.train.schedule, cfg.train.decay_steps) == ("wsd", 100)


def test_the_length_the_command_line_gives_wins_over_the_files(tmp_path):
    """A config file counts epochs; ``--train.steps`` trains that many steps (it was ignored, since
    epochs win when both are set); given both, epochs still win; a file with both keeps its epochs."""
    (tmp_path / "epochs.yaml").write_text("model: tiny\ntrain: {epochs: 2, steps: 50}\n")
    config = str(tmp_path / "epochs.yaml")
    assert (load_config(config).train.epochs, load_config(config).train.steps) == (2, 50)
    steps = load_config(config, [("train.steps", "7")]).train
    assert (steps.epochs, steps.steps) == (0, 7)
    both = load_config(config, [("train.steps", "7"), ("train.epochs", "3")]).train
    assert (both.epochs, both.steps) == (3, 7)
    flag = config_from_args(argparse.Namespace(config=config, steps=9), [], default="base").train
    assert (flag.epochs, flag.steps) == (0, 9)


def test_model_preset_then_field_override():
    cfg = config_from_dict({"model": {"preset": "tiny", "vocab_size": 100}})
    assert (cfg.model.hidden_size, cfg.model.vocab_size) == (128, 100)


@pytest.mark.parametrize("overrides, message", [
    ([("train.lrr", "1")], "unknown config key 'train.lrr'"),
    ([("trian.lr", "1")], "unknown config section 'trian'"),
    ([("train.steps", "ten")], "train.steps: expected an integer, got 'ten'"),
    ([("data.synthetic", "maybe")], "data.synthetic: expected true or false"),
    ([("train.optimizer", "adagrad")], "train.optimizer: 'adagrad' is not one of lamb, adamw, sgd, stableadamw"),
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


# ------------------------------------------------------------ choices: Literal-typed fields


def literal_fields() -> dict[str, tuple]:
    """``section.field`` → choices, for every Literal-typed field of Config."""
    found = {}
    for section, section_type in typing.get_type_hints(Config).items():
        for name, typ in typing.get_type_hints(section_type).items():
            if typing.get_origin(typ) is typing.Literal:
                found[f"{section}.{name}"] = typing.get_args(typ)
    return found


def test_choices_are_the_literal_types_of_the_fields():
    assert typing.get_type_hints(ExecutionConfig)["precision"] is Precision
    assert typing.get_type_hints(ExecutionConfig)["parallel"] is Parallel
    assert typing.get_type_hints(ExecutionConfig)["recompute"] is Recompute
    assert typing.get_type_hints(TrainConfig)["optimizer"] is Optimizer
    assert typing.get_type_hints(TrainConfig)["schedule"] is Schedule
    assert typing.get_type_hints(ModelConfig)["hidden_act"] is HiddenAct
    assert literal_fields() == {
        "model.family": ("bert", "modernbert"),
        "model.hidden_act": ("gelu", "relu", "gelu_new"),
        "model.classifier_pooling": ("cls", "mean"),
        "train.objective": ("mlm_nsp", "mlm"),
        "train.optimizer": ("lamb", "adamw", "sgd", "stableadamw"),
        "train.lamb": ("bertforge", "mlperf", "nvidia", "paper"),
        "train.weights": ("fp32", "bf16"),
        "train.optimizer_state": ("fp32", "bf16"),
        "train.schedule": ("poly", "poly_tf", "exp", "exp_staircase", "table", "constant", "wsd"),
        "train.decay_shape": ("linear", "one_minus_sqrt"),
        "execution.precision": ("fp32", "bf16", "fp16"),
        "execution.parallel": ("none", "ddp", "fsdp"),
        "execution.recompute": ("none", "layer", "attention"),
        "execution.fsdp_grad_sync": ("auto", "step", "micro_batch"),
        "execution.attention": ("auto", "flash", "cudnn", "efficient", "math", "flex"),
        "execution.compile_mode": ("default", "max-autotune-no-cudagraphs"),
        "execution.compile_scope": ("layers", "model"),
        "execution.pipeline_schedule": ("1f1b", "gpipe"),
        "execution.embeddings_placement": ("same_as_hidden_layers", "same_ipu", "two_ipus"),
    }


def test_literal_defaults_are_among_their_choices():
    cfg = Config()
    for key, choices in literal_fields().items():
        section, name = key.split(".")
        assert getattr(getattr(cfg, section), name) == choices[0], key


@pytest.mark.parametrize("key, value, message", [
    ("execution.precision", "fp8", "execution.precision: 'fp8' is not one of fp32, bf16, fp16"),
    ("execution.parallel", "zero3", "execution.parallel: 'zero3' is not one of none, ddp, fsdp"),
    ("execution.recompute", "all", "execution.recompute: 'all' is not one of none, layer, attention"),
    ("train.schedule", "cosine",
     "train.schedule: 'cosine' is not one of poly, poly_tf, exp, exp_staircase, table, constant, wsd"),
    ("model.hidden_act", "silu", "model.hidden_act: 'silu' is not one of gelu, relu, gelu_new"),
    ("execution.precision", "BF16", "execution.precision: 'BF16' is not one of fp32, bf16, fp16"),
])
def test_a_bad_choice_names_the_key_and_the_choices(key, value, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, [(key, value)])
    assert str(info.value) == message


def test_a_bad_choice_in_yaml_names_the_key_the_choices_and_the_file(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("execution:\n  parallel: 2\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    assert str(info.value) == f"execution.parallel: 2 is not one of none, ddp, fsdp in {path}"


def test_good_choices_are_kept_and_round_trip():
    cfg = load_config("tiny", [("execution.precision", "bf16"), ("execution.parallel", "fsdp"),
                               ("execution.recompute", "attention"), ("train.optimizer", "adamw"),
                               ("train.schedule", "exp"), ("model.hidden_act", "relu")])
    assert (cfg.execution.precision, cfg.execution.parallel, cfg.execution.recompute,
            cfg.train.optimizer, cfg.train.schedule, cfg.model.hidden_act) == \
        ("bf16", "fsdp", "attention", "adamw", "exp", "relu")
    saved = cfg.to_yaml()
    assert "precision: bf16\n" in saved and "hidden_act: relu\n" in saved
    assert config_from_dict(yaml.safe_load(saved)) == cfg


def test_invalid_yaml_is_a_one_line_error_with_the_position(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("train:\n  lr: [1\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    assert str(info.value) == (f"{path}: not valid YAML (expected ',' or ']', but got '<stream end>' "
                               "at line 3, column 1)")


# ------------------------------------------------------------ config_from_args


def test_config_from_args_applies_the_overrides_then_the_flags():
    args = argparse.Namespace(config="tiny", steps=7, epochs=None, resume=None, init=None,
                              run_dir="/tmp/runs", name="mine", wandb=True, no_progress=True)
    cfg = config_from_args(args, ["--train.lr", "5e-4", "--train.steps", "9"], default="base")
    assert cfg.model.hidden_size == 128  # --config wins over the default
    assert (cfg.train.steps, cfg.train.lr) == (7, 5e-4)  # --steps beats --train.steps
    assert (cfg.log.run_dir, cfg.log.name, cfg.log.wandb, cfg.log.progress) == ("/tmp/runs", "mine", True, False)


def test_config_from_args_uses_the_default_and_skips_flags_a_command_lacks():
    cfg = config_from_args(argparse.Namespace(config=None), [], default="mini")
    assert (cfg.model.num_hidden_layers, cfg.model.hidden_size) == (4, 256)
    assert (cfg.train.steps, cfg.log.progress, cfg.log.wandb) == (1000, True, False)


def test_config_from_args_resumes_with_the_saved_config(tmp_path):
    step = tmp_path / "run" / "checkpoints" / "step_00000010"
    step.mkdir(parents=True)
    saved = load_config("tiny", [("train.lr", "2e-4"), ("execution.recompute", "layer")])
    (step / "config.yaml").write_text(saved.to_yaml())
    for name in ("model.safetensors", "trainer.pt", "optimizer.pt"):
        (step / name).write_bytes(b"")
    args = argparse.Namespace(config=None, steps=20, resume=str(step))
    cfg = config_from_args(args, [], default="pretrain_tiny")
    assert (cfg.model.hidden_size, cfg.train.lr, cfg.execution.recompute) == (128, 2e-4, "layer")
    assert (cfg.train.steps, cfg.checkpoint.resume) == (20, str(step))


# ------------------------------------------------------------ single-field ranges


@pytest.mark.parametrize("key, value, message", [
    ("log.every", "0", "log.every=0 must be at least 1"),
    ("checkpoint.every", "-1", "checkpoint.every=-1 must not be negative"),
    ("checkpoint.keep", "-2", "checkpoint.keep=-2 must not be negative"),
    ("train.steps", "-5", "train.steps=-5 must not be negative"),
    ("train.epochs", "-1", "train.epochs=-1 must not be negative"),
    ("train.micro_batch_size", "0", "train.micro_batch_size=0 must be at least 1"),
    ("train.global_batch_size", "-32", "train.global_batch_size=-32 must be at least 1"),
    ("train.warmup_steps", "-10", "train.warmup_steps=-10 must not be negative"),
    ("train.eval_every", "-1", "train.eval_every=-1 must not be negative"),
    ("train.eval_batches", "-1", "train.eval_batches=-1 must not be negative"),
    ("train.exp_decay_steps", "0", "train.exp_decay_steps=0 must be at least 1"),
    ("train.seed", "-1", "train.seed=-1 must not be negative"),
    ("data.seed", str(2**32), f"data.seed={2**32} is too large (at most {2**32 - 1})"),
    ("data.prefetch", "-1", "data.prefetch=-1 must not be negative"),
    ("data.shuffle_buffer", "-100", "data.shuffle_buffer=-100 must not be negative"),
    ("data.dupe_factor", "0", "data.dupe_factor=0 must be at least 1"),
    ("data.max_predictions", "0", "data.max_predictions=0 must be at least 1"),
    ("execution.threads", "-4", "execution.threads=-4 must not be negative"),
    ("model.num_attention_heads", "0", "model.num_attention_heads=0 must be at least 1"),
    ("model.num_hidden_layers", "0", "model.num_hidden_layers=0 must be at least 1"),
    ("model.type_vocab_size", "1", "model.type_vocab_size=1 must be at least 2"),
    ("model.pad_token_id", "30522", "model.pad_token_id=30522 is not below model.vocab_size=30522"),
    ("model.vocab_size", str(10**30), f"model.vocab_size={10**30} is too large (at most {2**63 - 1})"),
    ("train.lr", "inf", "train.lr=inf is not a finite number"),
    ("train.lr", "nan", "train.lr=nan is not a finite number"),
    ("train.lr", "-1e-3", "train.lr=-0.001 must be in [0, inf)"),
    ("train.beta2", "1", "train.beta2=1.0 must be in [0, 1)"),
    ("train.warmup_proportion", "1.5", "train.warmup_proportion=1.5 must be in [0, 1]"),
    ("train.decay_steps", "-3", "train.decay_steps=-3 must not be negative"),
    ("train.decay_proportion", "1.5", "train.decay_proportion=1.5 must be in [0, 1]"),
    ("model.hidden_dropout_prob", "1", "model.hidden_dropout_prob=1.0 must be in [0, 1)"),
    ("data.masked_lm_prob", "-0.1", "data.masked_lm_prob=-0.1 must be in [0, 1]"),
    ("train.eps", "0", "train.eps=0.0 must be positive"),
    ("train.lr_table", "{10: -1.0}", "train.lr_table[10]=-1.0: steps must not be negative"),
])
def test_a_value_out_of_its_range_is_one_line_naming_the_key(key, value, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [(key, value)])
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_log_every_zero_is_refused_through_the_command(capsys):
    from bertforge.cli import main
    from bertforge.config import CONFIG_DIR

    assert main(["pretrain", "--log.every", "0", "--data.synthetic"]) == 2
    assert capsys.readouterr().err == (f"error: log.every=0 must be at least 1 in {CONFIG_DIR / 'pretrain_tiny.yaml'} "
                                       "with the overrides\n")
    assert main(["config", "--config", "base", "--checkpoint.every", "-1"]) == 2  # a preset: no file to name
    assert capsys.readouterr().err == "error: checkpoint.every=-1 must not be negative\n"


def test_a_range_error_from_a_file_names_the_file(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("log:\n  every: 0\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    assert str(err.value) == f"log.every=0 must be at least 1 in {path}"
    with pytest.raises(ConfigError) as err:
        load_config(str(path), [("train.lr", "1")])
    assert str(err.value) == f"log.every=0 must be at least 1 in {path} with the overrides"


@pytest.mark.parametrize("text, message", [
    ("model: [1, 2]\n", "model: expected a mapping, got [1, 2] in {path}"),
    ("model: {preset: [1]}\n", f"model: unknown preset [1] {PRESETS} in {{path}}"),
    ("model: huge\n", f"model: unknown preset 'huge' {PRESETS} in {{path}}"),
    ("train: {lr_table: '[1'}\n", "train.lr_table: '[1' is not a YAML mapping ("),
    ("- 1\n- 2\n", "config in {path}: expected a mapping of sections, got [1, 2]"),
])
def test_malformed_sections_name_the_file(tmp_path, text, message):
    path = tmp_path / "mine.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    assert str(err.value).startswith(message.format(path=path)) and "\n" not in str(err.value)


def test_a_binary_config_file_is_one_line(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_bytes(b"train:\n  lr: \xff\xfe\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    assert str(err.value) == f"{path}: not UTF-8 text (byte offset 13)"


def test_a_json_config_is_read_as_its_yaml_twin(tmp_path):
    """--config x.json: the same Config as the YAML it was written from; bad JSON is one line naming
    the file, line and column."""
    from bertforge.config import load_yaml

    yaml_path = CONFIG_DIR / "pretrain_base_128.yaml"
    json_path = tmp_path / "pretrain_base_128.json"
    json_path.write_text(json.dumps(load_yaml(yaml_path), indent=2))
    assert load_config(str(json_path)).to_yaml() == load_config(str(yaml_path)).to_yaml()
    assert load_config(str(json_path), [("train.lr", "1e-4")]).train.lr == 1e-4
    bad = tmp_path / "bad.json"
    bad.write_text('{"train": {"lr": 1e-4,}}')
    with pytest.raises(ConfigError, match=r"bad\.json: not valid JSON \(Expecting property name enclosed in "
                                          r"double quotes at line 1, column 23\)$"):
        load_config(str(bad))


def test_modernbert_configs_have_the_published_recipe():
    """modernbert_base_1024 is AnswerDotAI/ModernBERT's modernbert-base-pretrain.yaml in our keys, its
    token budgets in steps of 4608 × 1024 tokens; _8192 the paper's context extension."""
    short, long = load_config("modernbert_base_1024"), load_config("modernbert_base_8192")
    for cfg in (short, long):
        m, t = cfg.model, cfg.train
        assert (m.family, m.num_hidden_layers, m.hidden_size, m.intermediate_size, m.vocab_size) == (
            "modernbert", 22, 768, 1152, 50368)
        assert (m.local_attention, m.global_attn_every_n_layers, m.local_rope_theta) == (128, 3, 10000.0)
        assert (t.objective, t.optimizer, t.decouple_lr, t.schedule) == ("mlm", "stableadamw", True, "wsd")
        assert (t.beta1, t.beta2, t.eps, t.weight_decay, t.grad_clip, t.end_lr, t.seed) == (
            0.9, 0.98, 1e-6, 1e-5, 0.0, 0.0, 17)
        assert cfg.data.masked_lm_prob == 0.3 and cfg.data.dynamic_masking
        assert cfg.data.max_predictions == math.ceil(0.3 * cfg.data.seq_len)
        assert cfg.execution.precision == "bf16"
        assert t.global_batch_size * cfg.data.seq_len == 4608 * 1024  # tokens a step
    assert (short.data.seq_len, short.model.global_rope_theta, short.train.lr) == (1024, 10000.0, 8e-4)
    # The batch-size warm-up: a GPU's first steps are one micro-batch (of 96 × 1024 tokens, rows nearly full)
    # on the recipe's 8 GPUs, the full 4608 after its 50B tokens. Its steps, and the lr warm-up's 3B tokens
    # (all at 768 × 1024 a step), follow from the schedule.
    t = short.train
    assert (t.micro_batch_size, t.batch_size_warmup_min_size, t.batch_size_warmup_tokens) == (96, 96, 50e9)
    warmup, rank_tokens, steps = BatchWarmup(1, 6, t.batch_size_warmup_tokens, 8), 0, 0
    while (size := warmup.micro_batches(rank_tokens)) < 6:
        rank_tokens, steps = rank_tokens + size * 96 * 1024, steps + 1
    assert (steps, t.warmup_steps, t.decay_steps) == (21194, math.ceil(3e9 / (768 * 1024)), 0)
    assert t.steps == steps + round((1.719e12 - 8 * rank_tokens) / (4608 * 1024))  # 1.719T tokens
    assert (long.data.seq_len, long.model.global_rope_theta, long.train.lr) == (8192, 160000.0, 3e-4)
    assert long.train.steps == round(300e9 / (4608 * 1024)) and long.train.decay_steps == round(50e9 / (4608 * 1024))
    # Both: the 0.1 dropout after the attention output alone (attn_out_dropout_prob); the extension's 1 - sqrt decay.
    assert [(c.model.attention_probs_dropout_prob, c.model.attention_output_dropout_prob) for c in (short, long)] == [
        (0.0, 0.1), (0.0, 0.1)]
    assert (short.train.decay_shape, long.train.decay_shape) == ("linear", "one_minus_sqrt")


# Graphcore's nlp/bert/tensorflow1/configs/pretrain_tiny_128_lamb.json (graphcore/examples), the values
# that have a counterpart here, as the file holds them.
GRAPHCORE_TINY_128_LAMB = {
    "attention_probs_dropout_prob": 0, "hidden_act": "gelu", "hidden_dropout_prob": 0.1, "hidden_size": 128,
    "intermediate_size": 512, "initializer_range": 0.02, "max_position_embeddings": 512,
    "num_attention_heads": 2, "num_hidden_layers": 2, "type_vocab_size": 2, "vocab_size": 30400,
    "seq_length": 128, "micro_batch_size": 1, "num_train_steps": 1000, "epsilon": 1e-6,
    "max_predictions_per_seq": 20, "lr_schedule": "polynomial_decay", "base_learning_rate": 0.001, "warmup": 10,
    "optimizer": "lamb", "weight_decay_rate": 0.01, "parallel_io_threads": 16, "gradient_accumulation_count": 12,
    "replicas": 1, "precision": "16", "seed": 1234, "enable_recomputation": True, "steps_per_ckpts": 100,
    "steps_per_logs": 1, "duplicate_factor": 5, "static_mask": True,
    "train_file": "data/tf_wikipedia/tokenised_128_dup5_mask20/*.tfrecord",
}


def test_graphcores_tiny_128_lamb_config_has_its_values():
    cfg = load_config("pretrain_tiny_128_lamb")
    m, d, t = cfg.model, cfg.data, cfg.train
    ref = GRAPHCORE_TINY_128_LAMB
    for key in ("attention_probs_dropout_prob", "hidden_act", "hidden_dropout_prob", "hidden_size",
                "intermediate_size", "initializer_range", "max_position_embeddings", "num_attention_heads",
                "num_hidden_layers", "type_vocab_size", "vocab_size"):
        assert getattr(m, key) == ref[key], key
    assert (d.seq_len, d.max_predictions, d.dupe_factor, d.reader_threads, d.input) == (
        ref["seq_length"], ref["max_predictions_per_seq"], ref["duplicate_factor"], ref["parallel_io_threads"],
        ref["train_file"])
    assert d.dynamic_masking is not ref["static_mask"]
    assert (t.optimizer, t.lr, t.eps, t.weight_decay, t.warmup_steps, t.steps, t.seed) == (
        ref["optimizer"], ref["base_learning_rate"], ref["epsilon"], ref["weight_decay_rate"], ref["warmup"],
        ref["num_train_steps"], ref["seed"])
    assert (t.schedule, t.decay_power, t.end_lr) == ("poly", 1.0, 0.0)  # polynomial_decay at its power 1
    assert t.micro_batch_size == ref["micro_batch_size"]
    assert t.global_batch_size == ref["micro_batch_size"] * ref["gradient_accumulation_count"] * ref["replicas"]
    assert cfg.accumulation_steps == ref["gradient_accumulation_count"]
    assert (cfg.execution.precision, cfg.execution.recompute) == ("fp" + ref["precision"], "layer")
    assert (cfg.checkpoint.every, cfg.log.every) == (ref["steps_per_ckpts"], ref["steps_per_logs"])


def test_a_warm_up_or_decay_length_on_the_command_line_wins_over_the_files_share(tmp_path):
    """pretrain_tiny's warmup_proportion 0.05 is 50 of 1000 steps; `--train.warmup_steps 0` means none
    (wsd trains at the full lr from step 0), and `--train.decay_steps 0` over a file's decay share none."""
    from bertforge.training.optim import lr_at, warmup_steps, wsd_steps

    assert warmup_steps(load_config("pretrain_tiny").train, 1000) == 50
    cfg = load_config("pretrain_tiny", [("train.schedule", "wsd"), ("train.warmup_steps", "0")])
    assert cfg.train.warmup_proportion == 0.0 and warmup_steps(cfg.train, 1000) == 0
    assert [lr_at(k, cfg.train, 1000) for k in (0, 1, 2)] == [cfg.train.lr] * 3
    both = load_config("pretrain_tiny", [("train.warmup_steps", "0"), ("train.warmup_proportion", "0.1")])
    assert warmup_steps(both.train, 1000) == 100  # both given: the share, as documented
    (tmp_path / "wsd.yaml").write_text("train:\n  schedule: wsd\n  decay_proportion: 0.5\n", encoding="utf-8")
    assert wsd_steps(load_config(str(tmp_path / "wsd.yaml")).train, 1000) == (0, 500)
    assert wsd_steps(load_config(str(tmp_path / "wsd.yaml"), [("train.decay_steps", "0")]).train, 1000) == (0, 0)
