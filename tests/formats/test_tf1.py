"""TensorFlow 1 checkpoints without TensorFlow: read, import, export, --init.

The oracle is real TensorFlow. ``fixtures/tf1/small`` was written by
``fixtures/tf1/make_fixtures.py`` (TensorFlow 2.21 as ``compat.v1``,
bert-tensorflow's ``modeling.py`` and ``AdamWeightDecayOptimizer``,
``tf.train.Saver``) with TensorFlow's logits for a fixed batch, so these tests
need no TensorFlow. The tests marked ``tensorflow`` build BERT-tiny and
BERT-mini shapes with the real 30522 vocab at test time and run TensorFlow on
our export; they run when a Python with tensorflow and bert-tensorflow is
found (this one, or ``$BERTFORGE_TF_PYTHON``) and skip otherwise.
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
from bertforge.formats import tf1
from bertforge.formats.bert_tf1 import export_tf1, read_tf1, tf1_names
from bertforge.formats.hf import export_hf
from bertforge.formats.load import load_model, load_weights, read_weights
from bertforge.models.bert import BertForPreTraining, BertForQuestionAnswering
from bertforge.runs import CheckpointError

FIXTURES = Path(__file__).parents[1] / "fixtures" / "tf1"
SMALL = FIXTURES / "small"
PREFIX = SMALL / "model.ckpt-2"
MAKE = FIXTURES / "make_fixtures.py"
TOLERANCE = 1e-5  # relative to the largest logit


def our_logits(model: torch.nn.Module, batch) -> tuple[np.ndarray, np.ndarray]:
    """Masked-LM logits at the masked positions, flattened as TensorFlow gathers them (B*P, V), and NSP."""
    def long(name: str) -> torch.Tensor:
        return torch.from_numpy(np.asarray(batch[name])).long()

    with torch.no_grad():
        mlm, nsp = model(long("input_ids"), long("token_type_ids"), long("input_mask"), long("masked_lm_positions"))
    return mlm.reshape(-1, mlm.shape[-1]).numpy(), nsp.numpy()


def relative_error(ours: np.ndarray, theirs: np.ndarray) -> float:
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


def copy_checkpoint(tmp_path: Path) -> Path:
    """The small fixture in a scratch directory, for tests that damage or edit it."""
    shutil.copytree(SMALL, tmp_path / "small")
    return tmp_path / "small" / PREFIX.name


def rewrite(prefix: Path, out: Path, change) -> Path:
    """A checkpoint with the fixture's tensors after ``change(tensors)``, written by our writer."""
    reader = tf1.BundleReader(prefix)
    tensors = {name: reader.read(name) for name in reader.entries}
    change(tensors)
    out.mkdir(parents=True, exist_ok=True)
    tf1.write_bundle(out / "model.ckpt", tensors)
    shutil.copyfile(SMALL / "bert_config.json", out / "bert_config.json")
    return out / "model.ckpt"


# ------------------------------------------------------------ reading what TensorFlow wrote

def test_logits_equal_tensorflows():
    batch = np.load(SMALL / "logits.npz")
    model = load_model(PREFIX, head="pretraining")
    assert model.config.hidden_act == "gelu_new"  # google-research/bert's gelu is the tanh approximation
    mlm, nsp = our_logits(model, batch)
    assert mlm.shape == batch["mlm_logits"].shape == (4 * 5, 128)
    assert relative_error(mlm, batch["mlm_logits"]) < TOLERANCE
    assert relative_error(nsp, batch["nsp_logits"]) < TOLERANCE


def test_every_variable_is_a_weight_or_skipped(caplog):
    reader = tf1.BundleReader(PREFIX)
    assert reader.num_shards == 1 and len(reader.entries) == 139
    with caplog.at_level(logging.INFO, logger="bertforge.formats.bert_tf1"):
        cfg, state, skipped = read_tf1(PREFIX)
    weights = [n for n in reader.entries if not n.endswith(("/adam_m", "/adam_v")) and n != "global_step"]
    assert len(state) == len(weights) == 46
    assert sorted(skipped) == sorted(set(reader.entries) - set(weights))
    assert len(skipped) == 2 * 46 + 1 and "global_step" in skipped
    assert "skipped 93 variables" in caplog.text and "optimizer slots adam_m, adam_v" in caplog.text
    # The kernels are transposed for nn.Linear, seq_relationship's [2, hidden] is not.
    query = reader.read("bert/encoder/layer_1/attention/self/query/kernel")
    assert torch.equal(state["bert.encoder.layer.1.attention.self.query.weight"], query.t())
    nsp = reader.read("cls/seq_relationship/output_weights")
    assert nsp.shape == (2, 32) and torch.equal(state["cls.seq_relationship.weight"], nsp)
    assert int(reader.read("global_step")) == 2


def test_the_name_map_covers_every_weight_of_our_models():
    from bertforge.formats.bert_tf1 import model_config_from_bert_config

    cfg = model_config_from_bert_config(SMALL / "bert_config.json")
    names = tf1_names(cfg.num_hidden_layers)
    ours = {*BertForPreTraining(cfg).state_dict(), *BertForQuestionAnswering(cfg).state_dict()}
    assert ours == set(names)
    assert len({theirs for theirs, _ in names.values()}) == len(names)  # one to one


def test_init_loads_a_tf1_checkpoint_and_a_hugging_face_directory(tmp_path):
    cfg, state, source = read_weights(PREFIX)
    assert source == PREFIX
    model = BertForPreTraining(cfg)
    assert load_weights(model, PREFIX) == []
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    # pretrain --init, end to end, from the prefix and from the same weights as a Hugging Face
    # directory: after one step at lr 1e-9 the run's weights are TensorFlow's (fresh ones differ by ~0.05).
    shape = [f"--model.{k}={v}" for k, v in json.loads((SMALL / "bert_config.json").read_text()).items()
             if k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                      "intermediate_size", "max_position_embeddings")]
    export_hf(model, tmp_path / "hf", without_tokenizer=True)
    for name, init in {"tf1": PREFIX, "hf": tmp_path / "hf"}.items():
        argv = ["pretrain", "--config", "tiny", "--data.synthetic", "--steps", "1", "--no-progress",
                "--run-dir", str(tmp_path), "--name", name, "--init", str(init), "--data.seq_len", "32",
                "--data.max_predictions", "5", "--train.micro_batch_size", "2", "--train.global_batch_size",
                "2", "--train.lr", "1e-9", "--model.hidden_act", "gelu_new", "--log.tensorboard", "false", *shape]
        assert main(argv) == 0
        trained = load_model(tmp_path / name)
        assert max(float((trained.state_dict()[k] - v).abs().max()) for k, v in state.items()) < 1e-6, name


def test_init_warns_when_the_activation_differs(caplog):
    cfg = dataclasses.replace(read_weights(PREFIX)[0], hidden_act="gelu")
    with caplog.at_level(logging.WARNING, logger="bertforge.formats.load"):
        load_weights(BertForPreTraining(cfg), PREFIX)
    assert "trained with model.hidden_act=gelu_new but this model uses gelu" in caplog.text


def test_qa_and_encoder_heads_load_from_tf1():
    state = read_tf1(PREFIX)[1]
    qa = load_model(PREFIX, head="qa")
    assert isinstance(qa, BertForQuestionAnswering)
    assert torch.equal(qa.bert.encoder.layer[0].output.dense.weight, state["bert.encoder.layer.0.output.dense.weight"])
    encoder = load_model(PREFIX, head="encoder")
    assert torch.equal(encoder.pooler.dense.bias, state["bert.pooler.dense.bias"])


def test_squad_finds_the_vocab_beside_a_tf1_prefix_or_one_directory_up(tmp_path):
    from bertforge.tasks.squad.train import find_vocab, load_qa_model

    ckpt_dir = tmp_path / "ckpt"
    shutil.copytree(SMALL, ckpt_dir)
    prefix = ckpt_dir / PREFIX.name
    vocab_size = json.loads((SMALL / "bert_config.json").read_text())["vocab_size"]
    (tmp_path / "vocab.txt").write_text("".join(f"t{i}\n" for i in range(vocab_size)))  # MLPerf's layout
    assert find_vocab(prefix) == tmp_path / "vocab.txt"
    (ckpt_dir / "vocab.txt").write_text((tmp_path / "vocab.txt").read_text())
    assert find_vocab(prefix) == ckpt_dir / "vocab.txt"
    qa = load_qa_model(prefix, find_vocab(prefix))
    embeddings = read_tf1(prefix)[1]["bert.embeddings.word_embeddings.weight"]
    assert torch.equal(qa.bert.embeddings.word_embeddings.weight, embeddings)


# ------------------------------------------------------------ writing what TensorFlow writes

def test_writer_output_is_byte_identical_to_tensorflows(tmp_path):
    """TensorFlow's table format is deterministic: the same tensors give the same files."""
    reader = tf1.BundleReader(PREFIX)
    tensors = {name: reader.read(name) for name in reader.entries}
    tf1.write_bundle(tmp_path / "ours", tensors)
    assert (tmp_path / "ours.index").read_bytes() == tf1.index_file(PREFIX).read_bytes()
    assert (tmp_path / "ours.data-00000-of-00001").read_bytes() == tf1.data_file(PREFIX, 0, 1).read_bytes()
    # Our export of the same model (weights and global_step, no slots) against TensorFlow's Saver(var_list=...).
    export_tf1(load_model(PREFIX), tmp_path / "export", global_step=2)
    assert (tmp_path / "export/model.ckpt.index").read_bytes() == (SMALL / "model_only/model.ckpt.index").read_bytes()


def test_tables_of_many_blocks_read_back(tmp_path):
    """Past 256 KiB of index entries the table splits into blocks indexed by shortened keys."""
    tensors = {f"v/{i:05d}/{'x' * 60}": torch.tensor([float(i)]) for i in range(5000)}
    tf1.write_bundle(tmp_path / "many", tensors)
    table = tf1.read_table(tmp_path / "many.index")
    assert [k.decode() for k, _ in table[1:]] == sorted(tensors)
    reader = tf1.BundleReader(tmp_path / "many")
    assert float(reader.read("v/04321/" + "x" * 60)) == 4321.0
    assert (tmp_path / "many.index").stat().st_size > tf1.BLOCK_SIZE + 1000  # so at least two data blocks


def test_import_and_export_commands(tmp_path, capsys):
    out = tmp_path / "imported"
    assert main(["import", "tf1", str(PREFIX), str(out), "--bert-config", str(SMALL / "bert_config.json")]) == 0
    assert "skipped 93 variables" in capsys.readouterr().out
    imported = load_model(out, head="pretraining")
    direct = load_model(PREFIX)
    assert imported.config == direct.config
    assert all(torch.equal(v, direct.state_dict()[k]) for k, v in imported.state_dict().items())
    # A non-empty output is refused unless --overwrite.
    assert main(["import", "tf1", str(PREFIX), str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["import", "tf1", str(PREFIX), str(out), "--overwrite"]) == 0

    exported = tmp_path / "exported"
    assert main(["export", str(out), str(exported), "--format", "tf1"]) == 0
    assert sorted(p.name for p in exported.iterdir()) == [
        "bert_config.json", "checkpoint", "model.ckpt.data-00000-of-00001", "model.ckpt.index"]
    assert (exported / "checkpoint").read_text() == ('model_checkpoint_path: "model.ckpt"\n'
                                                    'all_model_checkpoint_paths: "model.ckpt"\n')
    assert json.loads((exported / "bert_config.json").read_text()) == json.loads(
        (SMALL / "bert_config.json").read_text())
    back = load_model(exported)  # the directory: its checkpoint file names the prefix
    assert all(torch.equal(v, direct.state_dict()[k]) for k, v in back.state_dict().items())
    assert tf1.BundleReader(exported / "model.ckpt").read("global_step").dtype == torch.int64


def test_exporting_erf_gelu_warns_that_tensorflow_computes_tanh_gelu(tmp_path, caplog):
    cfg = dataclasses.replace(load_model(PREFIX).config, hidden_act="gelu")
    with caplog.at_level(logging.WARNING, logger="bertforge.formats.bert_tf1"):
        export_tf1(BertForPreTraining(cfg), tmp_path / "out")
    assert "TensorFlow computes with the tanh approximation" in caplog.text
    assert json.loads((tmp_path / "out/bert_config.json").read_text())["hidden_act"] == "gelu"


# ------------------------------------------------------------ refusals, each naming what is wrong

@pytest.mark.parametrize("field, value, message", [
    ("intermediate_size", 128, r"variable bert/encoder/layer_0/intermediate/dense/bias has shape \[64\] "
                               r"but .*bert_config.json asks for \[128\]"),
    ("num_hidden_layers", 1, r"variable bert/encoder/layer_1/\S+ has no place in the BERT of .*num_hidden_layers=1"),
    ("num_hidden_layers", 3, r"variable bert/encoder/layer_2/attention/self/query/kernel is missing"),
    ("vocab_size", 30522, r"variable bert/embeddings/word_embeddings has shape \[128, 32\] but .* asks for "
                          r"\[30522, 32\]"),
])
def test_a_config_that_does_not_fit_is_refused(tmp_path, field, value, message):
    config = json.loads((SMALL / "bert_config.json").read_text())
    config[field] = value
    (tmp_path / "bert_config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message):
        load_model(PREFIX, bert_config=tmp_path / "bert_config.json")
    assert main(["import", "tf1", str(PREFIX), str(tmp_path / "out"), "--bert-config",
                 str(tmp_path / "bert_config.json")]) == 2
    assert not (tmp_path / "out").exists()


def test_a_missing_weight_is_named_and_other_slots_are_skipped(tmp_path, caplog):
    def drop(tensors):
        del tensors["cls/predictions/output_bias"]

    prefix = rewrite(PREFIX, tmp_path / "dropped", drop)
    with pytest.raises(CheckpointError, match=r"variable cls/predictions/output_bias is missing"):
        load_model(prefix, head="pretraining")
    assert load_model(prefix, head="encoder").pooler is not None  # the encoder does not need the MLM head

    def lamb(tensors):  # NVIDIA-style slot names, a loss scale, a classifier of another task
        for name in list(tensors):
            if name.endswith("/adam_m"):
                tensors[name.replace("/adam_m", "/LAMB")] = tensors.pop(name)
        tensors["loss_scale"] = torch.tensor(1024.0)
        tensors["output_weights"] = torch.zeros(3, 32)

    prefix = rewrite(PREFIX, tmp_path / "lamb", lamb)
    with caplog.at_level(logging.INFO, logger="bertforge.formats.bert_tf1"):
        _, state, skipped = read_tf1(prefix)
    assert len(state) == 46 and len(skipped) == 2 * 46 + 3
    assert "optimizer slots LAMB, adam_v; global_step, loss_scale, output_weights" in caplog.text


def test_damaged_files_are_refused_naming_them(tmp_path):
    prefix = copy_checkpoint(tmp_path)
    data = tf1.data_file(prefix, 0, 1)
    offset = tf1.BundleReader(prefix).entries["bert/pooler/dense/bias"].offset
    raw = bytearray(data.read_bytes())
    raw[offset + 3] ^= 0x10
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"data-00000-of-00001: variable bert/pooler/dense/bias fails its crc32c"):
        load_model(prefix)
    index = tf1.index_file(prefix)
    raw = bytearray(index.read_bytes())
    raw[100] ^= 0x01
    index.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"model.ckpt-2.index: the block at byte 0 fails its crc32c"):
        load_model(prefix)
    index.write_bytes(bytes(raw[:1000]))
    with pytest.raises(CheckpointError, match=r"not a TensorFlow checkpoint index"):
        load_model(prefix)
    data.unlink()
    index.write_bytes(tf1.index_file(PREFIX).read_bytes())
    with pytest.raises(CheckpointError, match=r"data-00000-of-00001: missing"):
        load_model(prefix)


def test_a_missing_bert_config_is_named(tmp_path):
    prefix = copy_checkpoint(tmp_path)
    (prefix.parent / "bert_config.json").unlink()
    with pytest.raises(CheckpointError, match=r"no bert_config.json beside the checkpoint .*--bert-config"):
        load_model(prefix)
    assert main(["import", "tf1", str(tmp_path / "nothing"), str(tmp_path / "out")]) == 2


# ------------------------------------------------------------ live TensorFlow

def tf_python() -> str | None:
    """A Python that imports tensorflow and bert-tensorflow: $BERTFORGE_TF_PYTHON, or this one."""
    if os.environ.get("BERTFORGE_TF_PYTHON"):
        return os.environ["BERTFORGE_TF_PYTHON"]
    if importlib.util.find_spec("tensorflow") and importlib.util.find_spec("bert"):
        return sys.executable
    return None


def run_tf(*args: str) -> None:
    python = tf_python()
    assert python is not None
    result = subprocess.run([python, str(MAKE), *args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.skipif(tf_python() is None, reason="needs tensorflow and bert-tensorflow (or $BERTFORGE_TF_PYTHON)")
@pytest.mark.parametrize("name, layers, hidden, heads", [("tiny", 2, 128, 2), ("mini", 4, 256, 4)])
def test_real_shapes_against_live_tensorflow(tmp_path, name, layers, hidden, heads):
    run_tf("make", str(tmp_path / "tf"), "--vocab", "30522", "--layers", str(layers), "--hidden", str(hidden),
           "--heads", str(heads), "--intermediate", str(4 * hidden), "--max-positions", "512",
           "--seq-len", "128", "--predictions", "20")
    batch = np.load(tmp_path / "tf" / "logits.npz")
    model = load_model(tmp_path / "tf")  # the directory: its checkpoint file names model.ckpt-2
    mlm, nsp = our_logits(model, batch)
    errors = {"import_mlm": relative_error(mlm, batch["mlm_logits"]),
              "import_nsp": relative_error(nsp, batch["nsp_logits"])}

    # Our export, read by TensorFlow's Saver and tf.train.load_checkpoint, gives the same logits.
    export_tf1(model, tmp_path / "export")
    np.savez(tmp_path / "batch.npz", **{k: batch[k] for k in ("input_ids", "input_mask", "token_type_ids",
                                                               "masked_lm_positions")})
    run_tf("logits", str(tmp_path / "export" / "model.ckpt"), "--bert-config",
           str(tmp_path / "export" / "bert_config.json"), "--batch", str(tmp_path / "batch.npz"),
           "--out", str(tmp_path / "exported.npz"))
    exported = np.load(tmp_path / "exported.npz")
    assert len(exported["names"]) == 16 * layers + 15  # every weight and global_step
    errors["export_mlm"] = relative_error(exported["mlm_logits"], batch["mlm_logits"])
    errors["export_nsp"] = relative_error(exported["nsp_logits"], batch["nsp_logits"])
    print(f"{name}: " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))
    assert max(errors.values()) < TOLERANCE, errors


@pytest.mark.skipif(tf_python() is None, reason="needs tensorflow and bert-tensorflow (or $BERTFORGE_TF_PYTHON)")
def test_tables_of_many_blocks_equal_tensorflows(tmp_path):
    run_tf("many", str(tmp_path / "tf"), "--count", "3500")
    reader = tf1.BundleReader(tmp_path / "tf" / "model.ckpt")
    tensors = {name: reader.read(name) for name in reader.entries}
    assert len(tensors) == 3500 and float(tensors["v/03210/" + "x" * 60]) == 3210.0
    tf1.write_bundle(tmp_path / "ours", tensors)
    theirs = (tmp_path / "tf" / "model.ckpt.index").read_bytes()
    assert len(theirs) > tf1.BLOCK_SIZE + 1000 and (tmp_path / "ours.index").read_bytes() == theirs


# ------------------------------------------------------------ snappy-compressed tables (older TensorFlow)

def test_snappy_blocks_decode_as_the_reference_encoder_wrote_them():
    """Our decoder against cramjam's snappy (the format's C++ library, bound to Python) on what it
    emits: literals short and long (tags 60..63), 1- and 2-byte offsets, copies that overlap."""
    cramjam = pytest.importorskip("cramjam")
    rng = np.random.default_rng(0)
    samples = [b"", b"a", b"ab" * 5000, bytes(rng.integers(0, 256, 70000, dtype=np.uint8)),
               b"".join(bytes(rng.integers(0, 4, int(n), dtype=np.uint8)) * int(k)
                        for n, k in zip(rng.integers(1, 300, 200), rng.integers(1, 9, 200)))]
    samples += [(PREFIX.parent / f"{PREFIX.name}.index").read_bytes()]
    for raw in samples:
        packed = bytes(cramjam.snappy.compress_raw(raw))
        assert tf1.snappy_decompress(packed) == raw
    with pytest.raises(ValueError, match="a copy from"):
        tf1.snappy_decompress(b"\x05\x01\x05")  # a copy before anything is written


def test_a_checkpoint_with_a_snappy_index_reads_the_same_tensors(tmp_path):
    """TensorFlow's tables compressed their blocks with snappy (leveldb's default) in older
    builds; the same entries in snappy blocks give the same tensors, and damage is named."""
    cramjam = pytest.importorskip("cramjam")
    copy = copy_checkpoint(tmp_path)
    index = copy.parent / f"{copy.name}.index"
    entries = tf1.read_table(index)
    compressed = tf1.build_table(entries, compress=lambda raw: bytes(cramjam.snappy.compress_raw(raw)))
    assert len(compressed) < 0.8 * index.stat().st_size
    index.write_bytes(compressed)
    assert tf1.read_table(index) == entries
    ours, theirs = tf1.BundleReader(copy), tf1.BundleReader(PREFIX)
    assert ours.entries.keys() == theirs.entries.keys()
    for name in theirs.entries:
        assert torch.equal(ours.read(name), theirs.read(name)), name
    # A damaged snappy block (its crc32c intact, so that the decoder meets it) is one error line.
    index.write_bytes(tf1.build_table(entries, compress=lambda raw: b"\x05\x01\x05"))
    with pytest.raises(CheckpointError, match=r"^\S+/model.ckpt-2.index: the snappy block at byte \d+ is damaged "
                                              r"\(a copy from 5 bytes back, with 0 written\)$"):
        tf1.read_table(index)
