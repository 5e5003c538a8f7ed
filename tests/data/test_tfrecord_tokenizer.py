"""TFRecords say which tokenizer made them, as native files do (issue 31.5).

``data create --format tfrecord`` writes, beside each shard and renamed into place with it, a sidecar
naming the tokenizer (``Vocabulary.identity()``); pre-training with another tokenizer (``data.vocab``)
and ``data inspect --vocab`` refuse them in one line, as they refuse a native file. TFRecords with no
sidecar (Google's tools') are checked on their first records against the training vocab (ids within
it, its [CLS] first, its [SEP] in every row) and warned about in one line.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from conftest import shared_data
from test_loader import records_config

from bertforge.cli import main
from bertforge.config import ConfigError, load_config
from bertforge.data.errors import DataError
from bertforge.data.loader import check_tokenizer, record_files
from bertforge.data.record_reader import open_records
from bertforge.data.record_writer import write_records
from bertforge.data.vocab import load_vocab
from bertforge.training.pretrain import load_data


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    """Two BPE tokenizers of the shared sample text (600 and 500 tokens) and TFRecords of the first."""
    root = tmp_path_factory.mktemp("made")
    text = str(shared_data("text/sample_text.txt"))
    for name, size in (("tokenizer.json", "600"), ("other.json", "500")):
        assert main(["data", "vocab", text, str(root / name), "--kind", "bpe", "--vocab-size", size]) == 0
    assert main(["data", "create", "--input", text, "--vocab", str(root / "tokenizer.json"), "--output",
                 str(root / "records" / "train.tfrecord"), "--format", "tfrecord", "--num-output-files", "2",
                 "--seq-len", "64", "--max-predictions", "8", "--dupe-factor", "1"]) == 0
    return {"bpe": root / "tokenizer.json", "other": root / "other.json", "records": root / "records"}


def test_data_create_writes_a_sidecar_naming_the_tokenizer_beside_each_shard(made):
    shards = record_files(str(made["records"]))  # the sidecars are not read as records
    assert [p.name for p in shards] == ["train-00000-of-00002.tfrecord", "train-00001-of-00002.tfrecord"]
    assert sorted(p.name for p in made["records"].iterdir()) == sorted(
        [p.name for p in shards] + [f"{p.name}.made-with.json" for p in shards])  # nothing half-written left
    identity = load_vocab(made["bpe"]).identity()
    for shard in shards:
        assert json.loads((shard.parent / f"{shard.name}.made-with.json").read_text()) == {"tokenizer": identity}
        with open_records(shard) as records:
            assert records.header_tokenizer == identity


def test_pretraining_and_inspect_refuse_tfrecords_of_another_tokenizer_in_one_line(made, tmp_path, capsys):
    vocab, other = load_vocab(made["bpe"]), load_vocab(made["other"])
    first = record_files(str(made["records"]))[0]
    said = (f"{first}: made with the tokenizer tokenizer.json (bpe, 600 tokens, fingerprint {vocab.fingerprint}), "
            f"but {{setting}} {made['other']} is other.json (bpe, 500 tokens, fingerprint {other.fingerprint}): "
            f"use the tokenizer the records were made with")
    cfg = records_config(tmp_path, **{"data.input": str(made["records"]), "data.vocab": str(made["other"])})
    with pytest.raises(DataError) as refused:
        load_data(cfg.model, cfg.data, cfg.train, tmp_path, given=cfg.given)
    assert str(refused.value) == said.format(setting="data.vocab")
    capsys.readouterr()
    assert main(["data", "inspect", str(first), "--vocab", str(made["other"]), "--num", "0"]) == 2
    assert capsys.readouterr().err == "error: " + said.format(setting="--vocab") + "\n"
    cfg = records_config(tmp_path, **{"data.input": str(made["records"]), "data.vocab": str(made["bpe"])})
    assert load_data(cfg.model, cfg.data, cfg.train, tmp_path, given=cfg.given).decided["model.vocab_size"] == 600


def test_tfrecords_naming_no_tokenizer_are_checked_and_warned_about_in_one_line(made, tmp_path, caplog):
    """As Google's create_pretraining_data.py writes them: no sidecar."""
    with open_records(record_files(str(made["records"]))[0]) as records:
        rows = records.take(range(len(records)))
    bare = write_records(tmp_path / "google.tfrecord", rows, "tfrecord")
    assert not (tmp_path / "google.tfrecord.made-with.json").exists()
    with caplog.at_level(logging.WARNING, logger="bertforge.data.loader"):
        check_tokenizer([bare], made["bpe"])
        check_tokenizer([bare, bare], shared_data("vocab/bert-base-uncased-vocab.txt"))
    fits, wrong = (r.getMessage() for r in caplog.records)
    assert fits == (f"{bare} name no tokenizer (no .made-with.json beside them: not made by `data create`); the "
                    f"first 1024 records' ids were checked against {made['bpe']}: they fit")
    assert wrong.endswith(f"records' ids were checked against {shared_data('vocab/bert-base-uncased-vocab.txt')}: "
                          f"rows start with id 2, but [CLS] is id 101 in the vocab; {len(rows.input_ids)} rows hold "
                          f"no [SEP] (id 102 in the vocab) (made with another vocab?)")
    assert wrong.startswith(f"{bare} and 1 other TFRecord file(s) name no tokenizer") and "\n" not in wrong


def test_data_create_pack_keeps_the_sidecar_of_its_packed_tfrecords(made, tmp_path):
    out = tmp_path / "packed" / "train.tfrecord"
    assert main(["data", "create", "--input", str(shared_data("text/sample_text.txt")), "--vocab", str(made["bpe"]),
                 "--output", str(out), "--seq-len", "64", "--max-predictions", "8", "--dupe-factor", "1",
                 "--pack", "2"]) == 0
    assert sorted(p.name for p in out.parent.iterdir()) == ["train.tfrecord", "train.tfrecord.made-with.json"]
    with open_records(out) as records:
        assert records.max_sequences_per_pack == 2 and records.header_tokenizer == load_vocab(made["bpe"]).identity()


@pytest.mark.parametrize("source", ["records", "text"])
def test_a_set_model_vocab_size_must_agree_with_data_vocab(made, tmp_path, source):
    """data.vocab decides model.vocab_size: a model.vocab_size the config sets that differs is refused in
    one line rather than silently replaced (issue 33's bad-input review), on records and on text."""
    data = str(made["records"]) if source == "records" else str(shared_data("text/sample_text.txt"))
    cfg = records_config(tmp_path, **{"data.input": data, "data.vocab": str(made["bpe"]), "model.vocab_size": 100,
                                      "data.seq_len": 64, "data.max_predictions": 8, "data.dupe_factor": 1})
    with pytest.raises(ConfigError) as refused:
        load_data(cfg.model, cfg.data, cfg.train, tmp_path, given=cfg.given)
    assert str(refused.value) == (f"model.vocab_size=100, but data.vocab {made['bpe']} has 600 tokens: leave "
                                  "model.vocab_size out to take the vocab's size, or give a vocab of 100")
    cfg = records_config(tmp_path, **{"data.input": data, "data.vocab": str(made["bpe"]), "model.vocab_size": 600,
                                      "data.seq_len": 64, "data.max_predictions": 8, "data.dupe_factor": 1})
    assert load_data(cfg.model, cfg.data, cfg.train, tmp_path, given=cfg.given).decided["model.vocab_size"] == 600


@pytest.mark.parametrize("source", ["records", "text"])
def test_the_vocabs_pad_id_follows_unless_set(made, tmp_path, source):
    """ModernBERT-base's preset has [PAD] at 50283 (its tokenizer's): with a tokenizer of one's own
    (`data vocab --kind bpe`: [PAD] 0) the recipe's model takes the vocab's [PAD] id, as it takes its
    size (issue 40.7: refused before, for a [PAD] outside the vocab); a model.pad_token_id set is kept."""
    data = str(made["records"]) if source == "records" else str(shared_data("text/sample_text.txt"))
    pairs = {"log.run_dir": str(tmp_path / "runs"), "data.prefetch": 0, "data.input": data,
             "data.vocab": str(made["bpe"]), "data.seq_len": 64, "data.max_predictions": 8, "data.dupe_factor": 1}
    cfg = load_config("modernbert_base_1024", list(pairs.items()))
    assert cfg.model.pad_token_id == 50283
    decided = load_data(cfg.model, cfg.data, cfg.train, tmp_path, given=cfg.given).decided
    assert (decided["model.vocab_size"], decided["model.pad_token_id"]) == (600, 0)
    cfg = load_config("modernbert_base_1024", [*pairs.items(), ("model.pad_token_id", 3)])
    assert "model.pad_token_id" not in load_data(cfg.model, cfg.data, cfg.train, tmp_path, given=cfg.given).decided
