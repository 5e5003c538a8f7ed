"""The squad commands never touch what they were not given: predict writes only the files
named, train --out refuses a non-empty directory unless --overwrite, and evaluate names
the question of a mistyped prediction. Small hand-made files and a tiny random model; each
test takes under 10 s."""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
from pathlib import Path

import pytest
from conftest import live_run, tmpfs

from bertforge.cli import main
from bertforge.config import ConfigError, ModelConfig, load_config
from bertforge.formats.hf import export_hf
from bertforge.models.bert import BertForQuestionAnswering
from bertforge.tasks.finetune.run import new_run_dir, prepare_out_dir
from bertforge.tasks.squad.metric import check_predictions

CONTEXT = "Paris is the capital of France ."
DEV = {"version": "1.1", "data": [{"title": "t", "paragraphs": [{"context": CONTEXT, "qas": [
    {"id": "q1", "question": "What is the capital of France?", "answers": [{"text": "Paris", "answer_start": 0}]},
    {"id": "q2", "question": "Paris is the capital of what?", "answers": [{"text": "France", "answer_start": 24}]},
]}]}]}
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "paris", "is", "the", "capital", "of", "france", ".",
         "what", "?"]


@pytest.fixture
def tiny(tmp_path) -> Path:
    """A tiny random QA model as a Hugging Face directory with its vocab."""
    cfg = ModelConfig(vocab_size=len(VOCAB), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                      intermediate_size=32, max_position_embeddings=64)
    path = export_hf(BertForQuestionAnswering(cfg), tmp_path / "tiny", without_tokenizer=True)
    (path / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    (tmp_path / "dev.json").write_text(json.dumps(DEV))
    return path


def files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------ predict


def test_predict_writes_only_the_files_named(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "nbest_predictions.json").write_text("the user's\n")
    argv = ["squad", "predict", "--model", str(tiny), "--predict-file", str(tmp_path / "dev.json"),
            "--data.seq_len", "32", "--squad.max_query_length", "8"]
    assert main([*argv, "--out", str(out / "a.json")]) == 0
    assert files(out).keys() == {"a.json", "nbest_predictions.json"}
    assert (out / "nbest_predictions.json").read_text() == "the user's\n"
    assert sorted(json.loads((out / "a.json").read_text())) == ["q1", "q2"]
    assert capsys.readouterr().out == f"2 predictions: {out / 'a.json'}\n"

    assert main([*argv, "--out", str(out / "b.json"), "--nbest-out", str(out / "b-nbest.json")]) == 0
    assert files(out).keys() == {"a.json", "b.json", "b-nbest.json", "nbest_predictions.json"}
    nbest = json.loads((out / "b-nbest.json").read_text())
    predictions = json.loads((out / "b.json").read_text())
    assert sorted(nbest) == ["q1", "q2"] and all(nbest[q][0]["text"] == predictions[q] for q in nbest)
    assert capsys.readouterr().out == f"2 predictions: {out / 'b.json'} (n-best: {out / 'b-nbest.json'})\n"

    assert main([*argv, "--out", str(out / "c.json"), "--nbest-out", str(out / "c.json")]) == 2
    assert capsys.readouterr().err == f"error: --out and --nbest-out are the same file: {out / 'c.json'}\n"
    assert not (out / "c.json").exists()


def test_predict_of_a_file_without_questions_is_one_line(tiny, tmp_path, capsys):
    (tmp_path / "empty.json").write_text(json.dumps({"data": []}))
    assert main(["squad", "predict", "--model", str(tiny), "--predict-file", str(tmp_path / "empty.json"),
                 "--out", str(tmp_path / "p.json")]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'empty.json'}: no questions to predict\n"
    assert not (tmp_path / "p.json").exists()


def test_predict_into_a_read_only_directory_is_one_line(tiny, tmp_path, capsys, make_read_only):
    out = tmp_path / "out"
    out.mkdir()
    make_read_only(out)
    assert main(["squad", "predict", "--model", str(tiny), "--predict-file", str(tmp_path / "dev.json"),
                 "--data.seq_len", "32", "--squad.max_query_length", "8", "--out", str(out / "p.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot write {out / 'p.json'}: {out} is not writable (") and err.count("\n") == 1
    assert list(out.iterdir()) == []


# ------------------------------------------------------------------ evaluate


@pytest.mark.parametrize("predictions, message", [
    ({"q1": 3}, "question q1: expected a string answer, got an integer"),
    ({"q1": "Paris", "q2": ["France"]}, "question q2: expected a string answer, got a list"),
    ({"q2": None}, "question q2: expected a string answer, got null"),
    ({"q1": {"text": "Paris"}}, "question q1: expected a string answer, got an object"),
    ({"unknown": True}, "question unknown: expected a string answer, got a boolean"),
    (["Paris", "France"], "expected an object of question id → answer text, got a list"),
    ("Paris", "expected an object of question id → answer text, got a string"),
])
def test_evaluate_names_the_question_of_a_mistyped_prediction(tmp_path, capsys, predictions, message):
    (tmp_path / "dev.json").write_text(json.dumps(DEV))
    (tmp_path / "p.json").write_text(json.dumps(predictions))
    assert main(["squad", "evaluate", str(tmp_path / "dev.json"), str(tmp_path / "p.json")]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'p.json'}: {message}\n"


def test_evaluate_of_good_predictions(tmp_path, capsys):
    (tmp_path / "dev.json").write_text(json.dumps(DEV))
    (tmp_path / "p.json").write_text(json.dumps({"q1": "Paris", "q2": "Lyon"}))
    assert main(["squad", "evaluate", str(tmp_path / "dev.json"), str(tmp_path / "p.json")]) == 0
    assert json.loads(capsys.readouterr().out) == {"exact_match": 50.0, "f1": 50.0}
    assert check_predictions({"q": "a"}) == {"q": "a"}


# ------------------------------------------------------------------ train --out / --overwrite


def test_a_non_empty_out_dir_is_refused_and_names_overwrite(tmp_path):
    cfg = load_config()
    run = tmp_path / "run"
    run.mkdir()
    assert prepare_out_dir(cfg.log, run) == run  # empty: used as it is
    (run / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(ConfigError) as err:
        prepare_out_dir(cfg.log, run)
    assert str(err.value) == (f"{run} already exists and is not empty: pass --resume {run} to continue its run, "
                              "--overwrite to replace it, or choose another --out")
    assert files(run) == {"model.safetensors": b"weights"}
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="exists and is not a directory"):
        prepare_out_dir(cfg.log, tmp_path / "file", overwrite=True)


def test_overwrite_removes_the_old_run_only_inside_the_directory_named(tmp_path, monkeypatch):
    cfg = load_config()
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    (run / "checkpoints" / "step_00000001").mkdir(parents=True)
    (run / "checkpoints" / "step_00000001" / "model.safetensors").write_bytes(b"w")
    (run / "metrics.jsonl").write_text("{}\n")
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("mine")
    (run / "link").symlink_to(elsewhere)  # a link is removed, not what it points to
    monkeypatch.chdir(tmp_path)
    with contextlib.ExitStack() as held:  # removed under the run's lock, which stays
        assert new_run_dir(prepare_out_dir(cfg.log, run, True, [tmp_path / "train.json", None]), held, True) == run
        assert [p.name for p in run.iterdir()] == [".lock"]
    assert files(elsewhere) == {"keep.txt": b"mine"}

    # A directory that holds an input, or the current directory, is never cleared.
    (run / "init").mkdir()
    (run / "init" / "model.safetensors").write_bytes(b"w")
    with pytest.raises(ConfigError) as err:
        prepare_out_dir(cfg.log, run, overwrite=True, inputs=[run / "init"])
    assert str(err.value) == (f"--overwrite would delete {run / 'init'}, which is in {run}: "
                              "choose another --out")
    monkeypatch.chdir(run / "init")
    with pytest.raises(ConfigError, match="--overwrite would delete"):
        prepare_out_dir(cfg.log, run, overwrite=True)
    assert files(run) == {".lock": (run / ".lock").read_bytes(), "init/model.safetensors": b"w"}


@pytest.mark.parametrize("extra, message", [
    (["--resume", "RUN"], "error: --overwrite starts a new run; it cannot be used with --resume\n"),
    ([], "error: --overwrite needs --out DIR, the directory to replace\n"),
])
def test_overwrite_flag_misuse_is_one_line(tmp_path, capsys, extra, message, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "RUN"
    (run / "checkpoints" / "step_00000001").mkdir(parents=True)
    before = files(run)
    assert main(["squad", "train", "--train-file", "t.json", "--overwrite", *extra]) == 2
    assert capsys.readouterr().err == message
    assert files(run) == before


def test_overwrite_with_a_missing_input_removes_nothing(tiny, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "old.txt").write_text("old run")
    assert main(["squad", "train", "--init", str(tiny), "--train-file", str(tmp_path / "typo.json"),
                 "--out", str(run), "--overwrite"]) == 2
    assert capsys.readouterr().err == (f"error: --train-file {tmp_path / 'typo.json'}: not found "
                                       f"(nothing in {run} was removed)\n")
    assert files(run) == {"old.txt": b"old run"}


def test_squad_train_refuses_a_non_empty_out_then_overwrites_it(tiny, tmp_path, capsys):
    """End to end, with the tiny model: 2 steps (about 3 s)."""
    train = tmp_path / "train.json"
    train.write_text(json.dumps({"data": DEV["data"] * 1}))
    run = tmp_path / "run"
    run.mkdir()
    (run / "old.txt").write_text("old run")
    argv = ["squad", "train", "--init", str(tiny), "--train-file", str(train), "--out", str(run),
            "--data.seq_len", "32", "--squad.max_query_length", "8",
            "--train.global_batch_size", "2", "--train.micro_batch_size", "2",
            "--train.steps", "2", "--train.epochs", "0", "--no-progress", "--log.tensorboard", "false"]
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith(f"error: {run} already exists and is not empty: ")
    assert files(run) == {"old.txt": b"old run"}
    with live_run(run) as holder:  # a live run's directory: refused before anything is removed (issue 27)
        assert main([*argv, "--overwrite"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {run} is in use by another run (pid {holder.pid} on ") and err.count("\n") == 1
        assert files(run)["old.txt"] == b"old run"
    assert main([*argv, "--overwrite"]) == 0
    assert not (run / "old.txt").exists()
    assert (run / "model.safetensors").is_file() and (run / "config.yaml").is_file()
    assert os.path.isfile(tiny / "model.safetensors")  # the --init directory is untouched


@pytest.mark.parametrize("size, what", [("48k", "checkpoints/step_00000002"), ("128k", "model.safetensors")])
def test_a_full_disk_while_saving_is_one_line(tiny, tmp_path, capsys, size, what):
    """A real full disk (a small tmpfs) at the checkpoint, or at the fine-tuned model after it: one
    line naming the file and the space it needs, no temporary left (issue 27: tracebacks from
    torch.save and safetensors). About 2 s each."""
    train = tmp_path / "train.json"
    train.write_text(json.dumps(DEV))
    mount = tmp_path / "disk"
    mount.mkdir()
    with tmpfs(mount, size):
        run = mount / "run"
        assert main(["squad", "train", "--init", str(tiny), "--train-file", str(train), "--out", str(run),
                     "--data.seq_len", "32", "--squad.max_query_length", "8", "--train.global_batch_size", "2",
                     "--train.micro_batch_size", "2", "--train.steps", "2", "--train.epochs", "0", "--no-progress",
                     "--log.tensorboard", "false"]) == 2
        err = capsys.readouterr().err.splitlines()
        named = f"{run / what}" + (" … config.json (2 files)" if what == "model.safetensors" else "")  # the pair
        match = re.fullmatch(rf"error: cannot write {re.escape(named)}: the disk is full \(it needs "
                             rf"([0-9.]+) KiB, ([0-9.]+) KiB free on {re.escape(str((run / what).parent))} after "
                             rf"removing the partial write\)", err[-1])
        assert match is not None and float(match[2]) < float(match[1]), err[-1]
        assert sorted(p.name for p in run.rglob(".*")) == [".lock"] and not (run / "model.safetensors").exists()
        assert not (run / "config.json").exists()  # the model is whole or absent: no config.json without its weights
        assert [p.name for p in (run / "checkpoints").iterdir()] == ([] if what.startswith("checkpoints") else
                                                                   ["step_00000002"])


def test_a_binary_questions_file_is_one_line(tiny, tmp_path, capsys):
    (tmp_path / "q.txt").write_bytes(b"What is it?\n\xff\xfe\n")
    assert main(["squad", "ask", "--model", str(tiny), "--context", CONTEXT, "--questions-file",
                 str(tmp_path / "q.txt")]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'q.txt'}: not UTF-8 text (byte offset 12)\n"


def test_compare_hf_without_transformers_is_one_line_naming_the_extra(tiny, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers: ModuleNotFoundError
    assert main(["squad", "ask", "--model", str(tiny), "--context", CONTEXT, "--question", "What is the capital?",
                 "--compare-hf"]) == 2
    assert capsys.readouterr().err == ('error: --compare-hf needs transformers, which is not installed: '
                                       'pip install "bertforge[hf]"\n')


def test_training_answers_not_at_their_answer_start_are_skipped_and_named(tiny, tmp_path, capsys):
    """As run_squad.py ("Could not find answer"), and said once: the count and the first ids, why."""
    moved = [{"id": f"m{i}", "question": "Where?", "answers": [{"text": "France", "answer_start": 0}]}
             for i in range(1, 5)]  # in range, but the words at offset 0 are "Paris"
    train = tmp_path / "train.json"
    train.write_text(json.dumps({"data": [{"title": "t", "paragraphs": [
        {"context": CONTEXT, "qas": DEV["data"][0]["paragraphs"][0]["qas"] + moved}]}]}))
    argv = ["squad", "train", "--init", str(tiny), "--train-file", str(train), "--out", str(tmp_path / "run"),
            "--data.seq_len", "32", "--squad.max_query_length", "8", "--train.global_batch_size", "2",
            "--train.micro_batch_size", "2", "--train.steps", "1", "--train.epochs", "0", "--no-progress",
            "--log.tensorboard", "false"]
    assert main(argv) == 0
    why = "answer 'France' not found at answer_start 0 (words there: 'Paris')"
    out, err = capsys.readouterr()
    assert err == (f"WARNING bertforge.tasks.squad.train: {train}: 4 of 6 training questions skipped, their answer "
                   f"text not at their answer_start (as google-research/bert's run_squad.py skips them, \"Could not "
                   f"find answer\"): question m1: {why}; question m2: {why}; question m3: {why}; and 1 more\n")
    assert "2 questions (2 features, 4 answers skipped)" in out


def test_squad_train_resume_auto_goes_on_with_the_runs_files_for_the_steps_given(tiny, tmp_path, capsys):
    """``--train.steps 3`` over squad_base's 2 epochs (of 1 step each here) trains 3 steps; then
    ``--resume auto --out RUN`` with neither --init nor --train-file continues that run (its
    config, training file and version) to the 4 steps now given (about 5 s)."""
    train = tmp_path / "train.json"
    train.write_text(json.dumps({"data": DEV["data"]}))
    run = tmp_path / "run"
    common = ["--out", str(run), "--data.seq_len", "32", "--squad.max_query_length", "8",
              "--train.global_batch_size", "2", "--train.micro_batch_size", "2", "--no-progress",
              "--log.tensorboard", "false", "--log.every", "1"]
    assert main(["squad", "train", "--init", str(tiny), "--train-file", str(train), "--train.steps", "3",
                 *common]) == 0
    assert "\n3 steps on 2 questions" in capsys.readouterr().out
    assert main(["squad", "train", "--resume", "auto", "--train.steps", "4", *common]) == 0
    assert "\n4 steps on 2 questions" in capsys.readouterr().out
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r and r.get("split") != "eval"] == [1, 2, 3, 4]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000003", "step_00000004"]
    saved = load_config(str(run / "checkpoints" / "step_00000004" / "config.yaml"))
    assert (saved.train.steps, saved.train.epochs) == (4, 0)
