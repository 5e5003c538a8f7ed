"""TensorFlow 2 object-based checkpoints without TensorFlow: read, import, export.

The oracle is real TensorFlow with TensorFlow Model Garden. ``fixtures/tf2/small``
was written by ``fixtures/tf2/make_fixtures.py`` (TensorFlow 2.21, tf-keras 2.21,
tf-models 2.19): Model Garden's own TF1 → TF2 converter, the one MLPerf's BERT
README names, run on the TF1 fixture in both of its modes (``encoder/``: a
``BertEncoder``; ``pretrainer/``: a ``BertPretrainerV2``, as MLPerf's
``tf2_ckpt``), with TensorFlow's outputs for a fixed batch; so these tests need
no TensorFlow. The test marked for live TensorFlow restores our export into the
reference models; it runs when a Python with tensorflow and Model Garden is
found (this one, or ``$BERTFORGE_TF_PYTHON``) and skips otherwise.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bertforge.cli import main
from bertforge.formats import tf1, tf2
from bertforge.formats.bert_tf1 import model_config_from_bert_config, read_tf1
from bertforge.formats.load import load_model
from bertforge.formats.weights import ConversionError
from bertforge.models.bert import BertForPreTraining, BertForQuestionAnswering, BertForSequenceClassification, BertModel
from bertforge.runs import CheckpointError

FIXTURES = Path(__file__).parents[1] / "fixtures" / "tf2"
SMALL = FIXTURES / "small"
PREFIXES = {layout: SMALL / layout / "model.ckpt-1" for layout in tf2.LAYOUTS}
TF1_PREFIX = Path(__file__).parents[1] / "fixtures" / "tf1" / "small" / "model.ckpt-2"
MAKE = FIXTURES / "make_fixtures.py"
TOLERANCE = 1e-5  # relative to the largest value


def our_outputs(model: BertForPreTraining, batch) -> dict[str, np.ndarray]:
    """The outputs the fixture recorded: sequence (B, T, H), pooled (B, H), masked-LM logits (B, P, V)."""
    def long(name: str) -> torch.Tensor:
        return torch.from_numpy(np.asarray(batch[name])).long()

    ids, types, mask = long("input_ids"), long("token_type_ids"), long("input_mask")
    with torch.no_grad():
        sequence, pooled = model.bert(ids, types, mask)
        mlm, _ = model(ids, types, mask, long("masked_lm_positions"))
    assert pooled is not None
    return {"sequence_output": sequence.numpy(), "pooled_output": pooled.numpy(), "mlm_logits": mlm.numpy()}


def relative_error(ours: np.ndarray, theirs: np.ndarray) -> float:
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


def rewrite(prefix: Path, out: Path, change) -> Path:
    """A copy of a fixture checkpoint (its object graph as it is) after ``change(tensors)``."""
    reader = tf1.BundleReader(prefix)
    tensors: dict[str, torch.Tensor | bytes] = {
        name: tf2.read_string(reader, name) if name == tf2.OBJECT_GRAPH else reader.read(name)
        for name in reader.entries}
    change(tensors)
    out.mkdir(parents=True)
    tf2.write_bundle(out / "model.ckpt-1", tensors)
    return out / "model.ckpt-1"


# ------------------------------------------------------------ reading what TensorFlow wrote

@pytest.mark.parametrize("layout", tf2.LAYOUTS)
def test_imported_outputs_equal_tensorflows(tmp_path, capsys, caplog, layout):
    expected = np.load(SMALL / "outputs.npz")
    with caplog.at_level(logging.WARNING, logger="bertforge.formats.tf2"):
        assert main(["import", "tf2", str(PREFIXES[layout]), str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert "skipped 1 variables" in printed  # save_counter
    # The reference TF2 models have no NSP head; the encoder alone has no masked-LM head either.
    fresh = "cls.seq_relationship" if layout == "pretrainer" else \
        "cls.predictions, cls.predictions.transform.LayerNorm, cls.predictions.transform.dense, cls.seq_relationship"
    assert printed.rstrip().endswith(f"newly initialised: {fresh}")
    assert "newly initialised: " in caplog.text
    model = load_model(tmp_path / "out", head="pretraining")
    assert model.config.hidden_act == "gelu_new"  # Model Garden's gelu is the tanh approximation
    ours = our_outputs(model, expected)
    keys = ("sequence_output", "pooled_output") + (("mlm_logits",) if layout == "pretrainer" else ())
    for key in keys:
        assert ours[key].shape == expected[key].shape
        assert relative_error(ours[key], expected[key]) < TOLERANCE, key
    print(f"{layout}: " + ", ".join(f"{key} max abs difference {np.abs(ours[key] - expected[key]).max():.3e}"
                                    for key in keys))
    assert expected["mlm_logits"].shape == (4, 5, 128)


@pytest.mark.parametrize("layout", tf2.LAYOUTS)
def test_the_converted_weights_are_the_tf1_checkpoints(layout):
    """Model Garden's converter only renames and reshapes: read back, they are the TF1 fixture's bit for bit."""
    _, tf1_state, _ = read_tf1(TF1_PREFIX)
    cfg, state, skipped = tf2.read_tf2(PREFIXES[layout])
    assert skipped == ["save_counter/.ATTRIBUTES/VARIABLE_VALUE"]
    heads = {"cls.seq_relationship.weight", "cls.seq_relationship.bias"}
    if layout == "encoder":
        heads |= {k for k in tf1_state if k.startswith("cls.predictions.")}
    assert set(state) == set(tf1_state) - heads
    assert all(torch.equal(v, tf1_state[k]) for k, v in state.items())
    assert cfg == model_config_from_bert_config(SMALL / "bert_config.json")


def test_the_object_graph_is_followed_not_the_key_names():
    """The pretrainer's word embeddings are stored under masked_lm/embedding_table (the first path a
    breadth-first walk finds); the graph leads there from the encoder's layer_with_weights-0."""
    reader = tf1.BundleReader(PREFIXES["pretrainer"])
    nodes = tf2.parse_object_graph(tf2.read_string(reader, tf2.OBJECT_GRAPH))
    word = tf2.resolve(nodes, ("encoder", "encoder_network", "layer_with_weights-0", "embeddings"))
    assert word is not None and word == tf2.resolve(nodes, ("masked_lm", "embedding_table"))
    assert nodes[word].value_key() == "masked_lm/embedding_table/.ATTRIBUTES/VARIABLE_VALUE"
    assert not any(name.startswith("encoder/encoder_network/layer_with_weights-0/") for name in reader.entries)
    names = tf2.tf2_names(2, "pretrainer")
    bias = nodes[tf2.resolve(nodes, names["cls.predictions.bias"].path) or 0].value_key()
    assert bias == "masked_lm/output_bias.Sbias/.ATTRIBUTES/VARIABLE_VALUE"  # "/" in a local name is escaped


def test_the_name_map_covers_the_encoder_and_masked_lm():
    cfg = model_config_from_bert_config(SMALL / "bert_config.json")
    ours = set(BertForPreTraining(cfg).state_dict())
    for layout, absent in (("pretrainer", "cls.seq_relationship."), ("encoder", "cls.")):
        names = tf2.tf2_names(cfg.num_hidden_layers, layout)
        assert set(names) == {k for k in ours if not k.startswith(absent)}
        assert len({var.path for var in names.values()}) == len(names)  # one to one
    with pytest.raises(ValueError, match="layout must be one of"):
        tf2.tf2_names(2, "classifier")


# ------------------------------------------------------------ writing what TensorFlow writes

@pytest.mark.parametrize("layout", tf2.LAYOUTS)
def test_writer_output_is_byte_identical_to_tensorflows(tmp_path, layout):
    """The same tensors, strings included, in TensorFlow's order give TensorFlow's files."""
    reader = tf1.BundleReader(PREFIXES[layout])
    order = sorted(reader.entries, key=lambda name: reader.entries[name].offset)
    assert order[-1] == tf2.OBJECT_GRAPH  # tf.train.Checkpoint writes the graph last
    tensors = {name: tf2.read_string(reader, name) if name == tf2.OBJECT_GRAPH else reader.read(name)
               for name in order}
    tf2.write_bundle(tmp_path / "ours", tensors)
    assert tf1.index_file(tmp_path / "ours").read_bytes() == tf1.index_file(PREFIXES[layout]).read_bytes()
    assert tf1.data_file(tmp_path / "ours", 0, 1).read_bytes() == \
        tf1.data_file(PREFIXES[layout], 0, 1).read_bytes()


@pytest.mark.parametrize("layout", tf2.LAYOUTS)
def test_export_reads_back_with_the_converters_names(tmp_path, layout):
    model = load_model(TF1_PREFIX)
    tf2.export_tf2(model, tmp_path / "out", layout=layout)
    prefix = tmp_path / "out" / "model.ckpt"
    # Every key the converter writes, no other; save_counter is 1, as after one save.
    assert set(tf1.BundleReader(prefix).entries) == set(tf1.BundleReader(PREFIXES[layout]).entries)
    assert int(tf1.BundleReader(prefix).read("save_counter/.ATTRIBUTES/VARIABLE_VALUE")) == 1
    cfg, state, _ = tf2.read_tf2(prefix)
    assert cfg == model.config
    own = model.state_dict()
    assert set(state) == set(tf2.tf2_names(cfg.num_hidden_layers, layout))
    assert all(torch.equal(v, own[k]) for k, v in state.items())
    # The graph: every node leads to a variable; each variable's key is its first breadth-first path.
    reader = tf1.BundleReader(prefix)
    nodes = tf2.parse_object_graph(tf2.read_string(reader, tf2.OBJECT_GRAPH))
    assert sorted(key for node in nodes for _, _, key in node.attributes) == sorted(set(reader.entries) -
                                                                                    {tf2.OBJECT_GRAPH})
    assert json.loads((tmp_path / "out" / "bert_config.json").read_text()) == \
        json.loads((SMALL / "bert_config.json").read_text())


def test_import_and_export_commands(tmp_path, capsys, caplog):
    out = tmp_path / "imported"
    assert main(["import", "tf2", str(SMALL / "pretrainer"), str(out)]) == 0  # the directory: its checkpoint file
    assert main(["import", "tf2", str(PREFIXES["pretrainer"]), str(out)]) == 2  # not empty
    assert "already exists" in capsys.readouterr().err
    assert main(["import", "tf2", str(PREFIXES["pretrainer"]), str(out), "--overwrite"]) == 0
    imported = load_model(out)
    exported = tmp_path / "exported"
    with caplog.at_level(logging.WARNING, logger="bertforge.formats.tf2"):
        assert main(["export", str(out), str(exported), "--format", "tf2"]) == 0
    assert "cls.seq_relationship.weight, cls.seq_relationship.bias" in caplog.text  # no NSP head in TF2
    assert sorted(p.name for p in exported.iterdir()) == [
        "bert_config.json", "checkpoint", "model.ckpt.data-00000-of-00001", "model.ckpt.index"]
    assert tf1.find_prefix(exported) == exported / "model.ckpt"
    _, state, _ = tf2.read_tf2(exported)
    assert "cls.predictions.bias" in state
    assert all(torch.equal(v, imported.state_dict()[k]) for k, v in state.items())
    assert main(["export", str(out), str(tmp_path / "encoder"), "--format", "tf2", "--tf2-layout", "encoder"]) == 0
    assert "cls.predictions.bias" not in tf2.read_tf2(tmp_path / "encoder" / "model.ckpt")[1]


def test_exports_the_reference_has_no_place_for_are_refused(tmp_path):
    cfg = model_config_from_bert_config(SMALL / "bert_config.json")
    with pytest.raises(ConversionError, match="it has no pooler, which the reference's BertEncoder has"):
        tf2.export_tf2(BertForQuestionAnswering(cfg), tmp_path / "qa")
    with pytest.raises(ConversionError, match="classifier heads go to Hugging Face only"):
        tf2.export_tf2(BertForSequenceClassification(cfg, 3), tmp_path / "glue")
    with pytest.raises(ConversionError, match="no masked-LM head"):
        tf2.export_tf2(BertModel(cfg), tmp_path / "encoder", layout="pretrainer")
    assert not any(tmp_path.iterdir())
    tf2.export_tf2(BertModel(cfg), tmp_path / "encoder")  # the encoder layout, its keys without "bert."
    assert len(tf2.read_tf2(tmp_path / "encoder" / "model.ckpt")[1]) == 16 * 2 + 7


# ------------------------------------------------------------ refusals, each one line naming what is wrong

def refused(argv: list[str], capsys, message: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert message in err, err


def test_a_missing_prefix_and_the_wrong_kind_of_checkpoint_are_refused(tmp_path, capsys):
    out = str(tmp_path / "out")
    refused(["import", "tf2", str(tmp_path / "nothing"), out], capsys, "not a TensorFlow checkpoint")
    refused(["import", "tf2", str(TF1_PREFIX), out], capsys,
            "a TensorFlow 1 name-based checkpoint (no _CHECKPOINTABLE_OBJECT_GRAPH), not a TF2 one; "
            "import it with `bertforge import tf1`")
    refused(["import", "tf1", str(PREFIXES["encoder"]), out], capsys,
            "a TensorFlow 2 object-based checkpoint, not a TF1 one; import it with `bertforge import tf2`")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("layout, dropped, message", [
    ("encoder", "encoder/layer_with_weights-5/_attention_layer/_query_dense/kernel/.ATTRIBUTES/VARIABLE_VALUE",
     "variable encoder/layer_with_weights-5/_attention_layer/_query_dense/kernel is missing"),
    ("pretrainer", "masked_lm/embedding_table/.ATTRIBUTES/VARIABLE_VALUE",
     "variable encoder/encoder_network/layer_with_weights-0/embeddings is missing"),
    ("pretrainer", "masked_lm/output_bias.Sbias/.ATTRIBUTES/VARIABLE_VALUE",
     "variable masked_lm/output_bias.Sbias is missing"),
])
def test_a_missing_variable_is_named(tmp_path, capsys, layout, dropped, message):
    def drop(tensors):
        del tensors[dropped]

    prefix = rewrite(PREFIXES[layout], tmp_path / "ckpt", drop)
    shutil.copyfile(SMALL / "bert_config.json", tmp_path / "bert_config.json")
    refused(["import", "tf2", str(prefix), str(tmp_path / "out")], capsys, message)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("field, value, message", [
    ("intermediate_size", 128, "variable encoder/layer_with_weights-4/_intermediate_dense/kernel/.ATTRIBUTES/"
                               "VARIABLE_VALUE has shape [32, 64] but"),
    ("num_attention_heads", 4, "_query_dense/kernel/.ATTRIBUTES/VARIABLE_VALUE has shape [32, 2, 16] but"),
    ("num_hidden_layers", 3, "the encoder has 2 transformer layers but"),
])
def test_a_config_that_does_not_fit_is_refused(tmp_path, capsys, field, value, message):
    config = json.loads((SMALL / "bert_config.json").read_text())
    config[field] = value
    (tmp_path / "bert_config.json").write_text(json.dumps(config))
    refused(["import", "tf2", str(PREFIXES["encoder"]), str(tmp_path / "out"), "--bert-config",
             str(tmp_path / "bert_config.json")], capsys, message)


def test_a_damaged_object_graph_is_refused(tmp_path):
    shutil.copytree(SMALL, tmp_path / "small")
    prefix = tmp_path / "small" / "encoder" / "model.ckpt-1"
    entry = tf1.BundleReader(prefix).entries[tf2.OBJECT_GRAPH]
    data = tf1.data_file(prefix, 0, 1)
    raw = bytearray(data.read_bytes())
    raw[entry.offset + 100] ^= 0x01
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="_CHECKPOINTABLE_OBJECT_GRAPH fails its crc32c"):
        tf2.read_tf2(prefix)
    with pytest.raises(ValueError):
        tf2.parse_object_graph(b"\x0a\x05\x0a\x03\x08\x07")  # a child of node 7 of 1


# ------------------------------------------------------------ live TensorFlow

def tf_python() -> str | None:
    """A Python that imports tensorflow and Model Garden: $BERTFORGE_TF_PYTHON, or this one."""
    if os.environ.get("BERTFORGE_TF_PYTHON"):
        return os.environ["BERTFORGE_TF_PYTHON"]
    if importlib.util.find_spec("tensorflow") and importlib.util.find_spec("official"):
        return sys.executable
    return None


def random_batch(vocab: int, seq_len: int, predictions: int, batch_size: int = 4) -> dict[str, np.ndarray]:
    """Random ids, two segments, right padding of different lengths, masked positions in the text."""
    rng = np.random.default_rng(0)
    ids = rng.integers(1, vocab, (batch_size, seq_len), dtype=np.int32)
    mask, types = np.zeros_like(ids), np.zeros_like(ids)
    positions = np.zeros((batch_size, predictions), np.int32)
    for b in range(batch_size):
        length = seq_len - b * seq_len // (2 * batch_size)
        mask[b, :length], ids[b, length:], types[b, length // 2:length] = 1, 0, 1
        positions[b] = np.sort(rng.choice(np.arange(1, length), predictions, replace=False))
    return {"input_ids": ids, "input_mask": mask, "token_type_ids": types, "masked_lm_positions": positions}


def moved_model(cfg) -> BertForPreTraining:
    """A model whose every weight is off its initial value (biases, LayerNorm too), so that each is tested."""
    torch.manual_seed(0)
    model = BertForPreTraining(cfg).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return model


@pytest.mark.skipif(tf_python() is None, reason="needs tensorflow and tf-models (or $BERTFORGE_TF_PYTHON)")
@pytest.mark.parametrize("shape", ["small", "tiny"])
@pytest.mark.parametrize("layout", tf2.LAYOUTS)
def test_tensorflow_restores_our_export_into_the_reference_model(tmp_path, layout, shape):
    """Ours, exported, restored by tf.train.Checkpoint into Model Garden's model (every variable
    matched, every value consumed), gives our outputs, and tf.train.load_checkpoint lists its names;
    the same model saved again by TensorFlow reads back as our weights, bit for bit. ``small`` is the
    fixture; ``tiny`` is BERT-tiny's shape with the real 30522 vocab and 512 positions."""
    python = tf_python()
    assert python is not None
    if shape == "small":
        model, batch = load_model(TF1_PREFIX), dict(np.load(SMALL / "outputs.npz"))
    else:
        cfg = model_config_from_bert_config(SMALL / "bert_config.json")
        cfg = dataclasses.replace(cfg, vocab_size=30522, hidden_size=128, num_attention_heads=2,
                                  intermediate_size=512, max_position_embeddings=512)
        model, batch = moved_model(cfg), random_batch(30522, 128, 20)
    np.savez(tmp_path / "batch.npz", **batch)
    ours = our_outputs(model, batch)
    np.savez(tmp_path / "ours.npz", **ours)
    tf2.export_tf2(model, tmp_path / "export", layout=layout)
    result = subprocess.run(
        [python, str(MAKE), "check", str(tmp_path / "export" / "model.ckpt"), "--bert-config",
         str(tmp_path / "export" / "bert_config.json"), "--batch", str(tmp_path / "batch.npz"),
         "--out", str(tmp_path / "tf.npz"), "--expect", str(tmp_path / "ours.npz"),
         "--resave", str(tmp_path / "resaved" / "model.ckpt")],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    print(result.stdout)
    theirs = np.load(tmp_path / "tf.npz")
    assert sorted(theirs["names"]) == sorted(tf1.BundleReader(tmp_path / "export" / "model.ckpt").entries)
    keys = ("sequence_output", "pooled_output") + (("mlm_logits",) if layout == "pretrainer" else ())
    for key in keys:
        assert relative_error(ours[key], theirs[key]) < TOLERANCE, key
    # TensorFlow's own checkpoint of the restored model (its whole Keras object graph) reads back as ours.
    shutil.copyfile(tmp_path / "export" / "bert_config.json", tmp_path / "resaved" / "bert_config.json")
    _, state, _ = tf2.read_tf2(tmp_path / "resaved")
    own = model.state_dict()
    assert set(state) == set(tf2.tf2_names(model.config.num_hidden_layers, layout))
    assert all(torch.equal(v, own[k]) for k, v in state.items())
