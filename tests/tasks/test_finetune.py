"""``bertforge finetune glue|ner|predict`` end to end: each task kind learns, predicts, resumes
exactly, runs under torchrun with 2 ranks equal to one process, sweeps seeds and learning rates,
and its model loads in transformers with equal logits.

The tasks are generated in their official formats (``finetune_data``: SST-2, STS-B, MNLI with
matched and mismatched sets, CoNLL-2003 NER), small enough that a random 2-layer BERT (hidden 32,
a vocab of the generated words) learns each in a second or two: sequence 32, a global batch of 16
in micro-batches of 8, lr 3e-3.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import statistics
from pathlib import Path

import finetune_data
import numpy as np
import pytest
import torch
import yaml
from conftest import live_run, tmpfs
from test_dist import torchrun
from test_preemption import checkpoints, sigterm_after_first_rows
from test_squad_dist import cut_copy

from bertforge.cli import main
from bertforge.formats.load import load_model
from bertforge.observe.log import rounded
from bertforge.runs import verify
from bertforge.tasks.finetune import FinetuneError, glue, ner
from bertforge.tasks.finetune.train import TaskConfig, require_main_dev

os.environ["HF_HUB_OFFLINE"] = "1"  # never reach the network

TASKS = {  # name: (command, --task, writer, the dev scores it must reach after 8 epochs)
    "sst-2": ("glue", "sst-2", finetune_data.write_sst2, {"accuracy": 0.95}),
    "sts-b": ("glue", "sts-b", finetune_data.write_stsb, {"pearson": 0.9, "spearman": 0.9}),
    "mnli": ("glue", "mnli", finetune_data.write_mnli, {"accuracy": 0.95, "accuracy_dev_mismatched": 0.95}),
    "ner": ("ner", None, finetune_data.write_conll, {"f1": 0.95}),
}
HEAD = {"glue": "classification", "ner": "token_classification"}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("finetune")
    finetune_data.tiny_model(root / "init")
    for name, (_, _, writer, _) in TASKS.items():
        writer(root / "data" / name)
    return root


def ft_args(root: Path, name: str, out: Path, *extra: str, epochs: int = 8) -> list[str]:
    command, task, _, _ = TASKS[name]
    return ["finetune", command, *(["--task", task] if task else []), "--data", str(root / "data" / name),
            "--init", str(root / "init"), "--out", str(out), "--no-progress", "--data.seq_len", "32",
            "--train.lr", "3e-3", "--train.micro_batch_size", "8", "--train.global_batch_size", "16",
            "--train.epochs", str(epochs), "--log.every", "1", "--log.tensorboard", "false",
            "--execution.threads", "1", "--checkpoint.keep", "0", *extra]


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in rows(out) if r.get("split") != "eval"]


def evals(out: Path) -> list[dict]:
    return [r for r in rows(out) if r.get("split") == "eval"]


def same_weights(a: Path, b: Path, head: str, atol: float = 0.0) -> None:
    ours, theirs = load_model(a, head=head).state_dict(), load_model(b, head=head).state_dict()
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        if atol:
            assert torch.allclose(ours[key], value, atol=atol), key
        else:
            assert torch.equal(ours[key], value), key


@pytest.fixture(scope="module")
def learned(root) -> dict[str, Path]:
    """Each task fine-tuned for 8 epochs (64 steps; MNLI 96), dev scores every 16 steps."""
    runs = {}
    for name in TASKS:
        runs[name] = root / "learned" / name
        assert main(ft_args(root, name, runs[name], "--train.eval_every", "16")) == 0
    return runs


@pytest.mark.parametrize("name", list(TASKS))
def test_each_task_learns_and_writes_its_files(root, learned, name):
    out, (command, _, _, floors) = learned[name], TASKS[name]
    scores = json.loads((out / "scores.json").read_text())
    for key, floor in floors.items():
        assert scores[key] >= floor, scores
    loss = losses(out)
    assert len(loss) == (96 if name == "mnli" else 64)
    assert np.mean(loss[-8:]) < 0.5 * np.mean(loss[:8])
    # The dev scores during training and at the end go to metrics.jsonl, the last equal to scores.json.
    assert [r["step"] for r in evals(out)] == ([16, 32, 48, 64, 80, 96] if name == "mnli" else [16, 32, 48, 64])
    assert {k: rounded(v) for k, v in scores.items()} == {
        k: v for k, v in evals(out)[-1].items() if k in scores}
    assert {p.name for p in out.iterdir()} >= {"config.yaml", "finetune.yaml", "vocab.txt", "config.json",
                                                "model.safetensors", "scores.json", "metrics.jsonl"}
    config = json.loads((out / "config.json").read_text())
    test_file = root / "data" / name / ("test.txt" if name == "ner" else "test.tsv")
    if command == "glue":
        spec = glue.get_task(name)
        assert config["architectures"] == ["BertForSequenceClassification"]
        assert list(config["id2label"].values()) == list(spec.labels or ["score"])
        files = sorted((out / "submission").iterdir())
        assert [f.name for f in files] == (["MNLI-m.tsv", "MNLI-mm.tsv"] if name == "mnli" else [f"{spec.name}.tsv"])
        for path in files:  # the leaderboard's format: a header, then index and prediction per test row
            lines = path.read_text().splitlines()
            assert lines[0] == "index\tprediction" and len(lines) == 1 + (12 if name == "mnli" else 20)
            predictions = [line.split("\t") for line in lines[1:]]
            assert [int(i) for i, _ in predictions] == list(range(len(predictions)))
            if spec.labels:
                assert {p for _, p in predictions} <= set(spec.labels)
            else:
                assert all(0.0 <= float(p) <= 5.0 for _, p in predictions)
    else:
        assert config["architectures"] == ["BertForTokenClassification"]
        assert sorted(config["id2label"].values()) == ["B-LOC", "B-ORG", "B-PER", "I-PER", "O"]
        # word, gold, prediction for every word of the test file (conlleval's input); all of them right
        written = [line.split() for line in (out / "predictions" / "test.txt").read_text().splitlines()]
        source = [line.split() for line in test_file.read_text().splitlines()]
        assert [w[0] for w in written if w] == [s[0] for s in source if s and s[0] != "-DOCSTART-"]
        assert written.count([]) == 16  # a blank line after each sentence
        words = [w for w in written if w]
        assert words and all(gold == predicted for _, gold, predicted in words)


@pytest.mark.parametrize("name", ["mnli", "ner"])
def test_predict_scores_dev_and_writes_test_as_training_did(root, learned, name, capsys, tmp_path):
    out = learned[name]
    scores = json.loads((out / "scores.json").read_text())
    split = "dev_mismatched" if name == "mnli" else "dev"
    capsys.readouterr()
    assert main(["finetune", "predict", "--model", str(out), "--split", split]) == 0
    predicted = json.loads(capsys.readouterr().out)
    suffix = "_dev_mismatched" if name == "mnli" else ""
    assert predicted == {k: scores[k + suffix] for k in predicted}
    test_split, written = (("test_matched", "submission/MNLI-m.tsv") if name == "mnli"
                           else ("test", "predictions/test.txt"))
    assert main(["finetune", "predict", "--model", str(out), "--split", test_split, "--out", str(tmp_path)]) == 0
    assert capsys.readouterr().out == f"predictions: {tmp_path / written}\n"
    assert (tmp_path / written).read_text() == (out / written).read_text()


def test_predict_off_a_terminal_shows_its_batches(learned, capsys):
    """A start line, a line per --log.progress_every_s of batches (here every batch), an end line, on
    stderr; stdout keeps the scores alone."""
    capsys.readouterr()
    assert main(["finetune", "predict", "--model", str(learned["ner"]), "--split", "dev", "--batch-size", "2",
                 "--log.progress_every_s", "1e-9"]) == 0
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert lines[0] == "predict ner dev: dev set" and json.loads(out)
    done = [re.fullmatch(r"predict ner dev: batch (\d+)/(\d+) [\d.]+ batches/s eta \d+:\d\d:\d\d", line)
            for line in lines[1:-1]]
    total = int(done[0].group(2))
    assert [int(match.group(1)) for match in done] == list(range(1, total)) and total > 2
    assert re.fullmatch(r"predict ner dev: done dev set in [\d.]+ s", lines[-1])
    assert main(["finetune", "predict", "--model", str(learned["ner"]), "--split", "dev", "--no-progress"]) == 0
    assert capsys.readouterr().err == ""


def test_an_mnli_model_predicts_the_diagnostic_set_as_the_leaderboard_takes_it(root, learned, capsys, tmp_path):
    """AX: GLUE's diagnostic pairs (``index sentence1 sentence2``, in ``diagnostic/``), predicted
    with the MNLI model and its labels; here the dev pairs, which the learned model gets right."""
    dev = glue.read_task(root / "data" / "mnli", "mnli", "dev_matched")
    (tmp_path / "diagnostic").mkdir()
    (tmp_path / "diagnostic" / "diagnostic.tsv").write_text("index\tsentence1\tsentence2\n" + "".join(
        f"{i}\t{a}\t{b}\n" for i, (a, b) in enumerate(zip(dev.text_a, dev.text_b or [], strict=True))))
    capsys.readouterr()
    assert main(["finetune", "predict", "--model", str(learned["mnli"]), "--task", "ax", "--data", str(tmp_path),
                 "--split", "test", "--out", str(tmp_path / "out")]) == 0
    written = tmp_path / "out" / "submission" / "AX.tsv"
    assert capsys.readouterr().out == f"predictions: {written}\n"
    lines = written.read_text().splitlines()
    assert lines[0] == "index\tprediction"
    assert [line.split("\t") for line in lines[1:]] == [[str(i), label] for i, label in enumerate(dev.labels or [])]


@pytest.mark.parametrize("name", ["sts-b", "ner"])
def test_transformers_loads_the_model_with_equal_logits_and_its_copy_predicts(root, learned, name, capsys,
                                                                               tmp_path):
    transformers = pytest.importorskip("transformers")
    out, kind = learned[name], TASKS[name][0]
    cls = transformers.BertForSequenceClassification if kind == "glue" else transformers.BertForTokenClassification
    theirs = cls.from_pretrained(out).eval()
    ours = load_model(out, head=HEAD[kind]).eval()
    from bertforge.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(out / "vocab.txt", True)
    if kind == "glue":
        examples = glue.read_task(root / "data" / name, name, "dev")
        features = glue.convert_examples(examples, tokenizer, 32, glue.get_task(name).labels)
    else:
        examples = ner.read_conll(root / "data" / name / "dev.txt")
        features = ner.convert_examples(examples, tokenizer, 32, json.loads((out / "config.json").read_text())[
            "label2id"].keys())
    ids, segments, mask = (torch.from_numpy(getattr(features, k)) for k in ("input_ids", "segment_ids", "input_mask"))
    with torch.no_grad():
        expected = theirs(input_ids=ids, token_type_ids=segments, attention_mask=mask).logits
        got = ours(ids, segments, mask)
    assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()
    # A model saved by transformers (no finetune.yaml: the task is named) predicts the same scores.
    copy = tmp_path / "hf"
    theirs.save_pretrained(copy)
    shutil.copyfile(out / "vocab.txt", copy / "vocab.txt")
    task = ["--task", name] if kind == "glue" else ["--task", "ner"]
    capsys.readouterr()
    assert main(["finetune", "predict", "--model", str(copy), *task, "--data", str(root / "data" / name),
                 "--split", "dev"]) == 0
    scores = json.loads((out / "scores.json").read_text())
    for key, value in json.loads(capsys.readouterr().out).items():
        assert abs(value - scores[key]) < 1e-6, key


# ------------------------------------------------------------------ exact resume, torchrun


SHORT = ["--checkpoint.every", "8", "--train.eval_every", "16"]


@pytest.fixture(scope="module")
def short(root) -> dict[str, Path]:
    """SST-2 and NER for 4 epochs (32 steps), a checkpoint every 8 and dev scores every 16."""
    runs = {}
    for name in ("sst-2", "ner"):
        runs[name] = root / "short" / name
        assert main(ft_args(root, name, runs[name], *SHORT, epochs=4)) == 0
    return runs


@pytest.mark.parametrize("name", ["sst-2", "ner"])
def test_resume_from_a_cut_copy_continues_bit_identically(root, short, name):
    single = short[name]
    assert checkpoints(single) == [f"step_{s:08d}" for s in (8, 16, 24, 32)]
    cut = cut_copy(single, root / "cut" / name, 8)
    assert main(["finetune", TASKS[name][0], "--resume", str(cut), "--no-progress", "--execution.threads", "1"]) == 0
    assert losses(cut) == losses(single)[8:]
    assert evals(cut) == evals(single)
    assert (cut / "scores.json").read_text() == (single / "scores.json").read_text()
    same_weights(cut, single, HEAD[TASKS[name][0]])


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize(("name", "parallel"), [("sst-2", "ddp"), ("ner", "fsdp")])
def test_two_ranks_give_the_losses_weights_and_scores_of_one_process(root, short, name, parallel):
    single, out = short[name], root / "dist" / name
    result = torchrun(ft_args(root, name, out, *SHORT, "--execution.parallel", parallel, epochs=4))
    assert result.returncode == 0, result.stderr[-3000:]
    one, two = losses(single), losses(out)
    assert len(one) == len(two) == 32
    # The weights move (lr 3e-3): the comparison is of a trained model, not of the initial one.
    init, tuned = load_model(root / "init").state_dict(), load_model(single, head=HEAD[TASKS[name][0]]).state_dict()
    assert min((tuned[k] - v).abs().max() for k, v in init.items() if k in tuned and v.dim() == 2) > 1e-3
    for a, b in zip(one, two):
        assert abs(a - b) < 1e-5, (one, two)
    same_weights(out, single, HEAD[TASKS[name][0]], atol=1e-5)
    for a, b in zip(evals(single), evals(out), strict=True):  # rank 0 scores the dev set with the whole model
        assert a.keys() == b.keys() and a["step"] == b["step"]
        assert all(abs(a[k] - b[k]) < 1e-6 for k in a if k not in ("step", "split")), (a, b)
    written = "submission/SST-2.tsv" if name == "sst-2" else "predictions/test.txt"
    assert (out / written).read_text() == (single / written).read_text()


@pytest.mark.parametrize("name", ["sst-2", "ner"])
def test_sigterm_checkpoints_and_the_same_command_with_resume_auto_continues(root, tmp_path, name):
    """SIGTERM after the first logged step: exit 0 and a checkpoint of that step, no model yet; the
    same command with ``--resume auto`` ends where an uninterrupted run does."""
    out = tmp_path / "ft"
    constant = ["--train.epochs", "0", "--train.schedule", "constant", "--train.warmup_proportion", "0",
                "--train.warmup_steps", "0", "--resume", "auto"]
    printed: list[str] = []
    stopped = sigterm_after_first_rows(out, [*ft_args(root, name, out, *constant), "--train.steps", "100000"],
                                       printed)
    assert not (out / "model.safetensors").exists()  # the finished model waits for the end of the run
    assert printed[0].splitlines()[-1] == (f"checkpoint: {out}/checkpoints/step_{stopped:08d} (stopped early: no "
                                           f"model yet; continue with --resume {out})")  # not "model: OUT"
    assert main([*ft_args(root, name, out, *constant), "--train.steps", str(stopped + 3)]) == 0
    whole = tmp_path / "whole"
    assert main([*ft_args(root, name, whole, *constant), "--train.steps", str(stopped + 3)]) == 0
    assert [r["step"] for r in rows(out) if r.get("split") != "eval"] == list(range(1, stopped + 4))
    assert losses(out) == losses(whole)
    same_weights(out, whole, HEAD[TASKS[name][0]])
    assert (out / "scores.json").read_text() == (whole / "scores.json").read_text()


# ------------------------------------------------------------------ sweeps


def test_a_sweep_reports_the_median_per_lr_and_continues_where_it_stopped(root, tmp_path, capsys):
    out = tmp_path / "sweep"
    argv = [*ft_args(root, "sst-2", out, "--checkpoint.every", "4", epochs=1), "--seeds", "1", "2", "3",
            "--lr", "1e-3", "3e-3"]
    assert main(argv) == 0
    report = json.loads((out / "sweep.json").read_text())
    runs = {(r["lr"], r["seed"]): r for r in report["runs"]}
    assert sorted(runs) == [(lr, seed) for lr in (1e-3, 3e-3) for seed in (1, 2, 3)]
    for (lr, seed), r in runs.items():
        assert r["run"] == str(out / f"lr{lr:g}-seed{seed}")
        assert r["scores"] == json.loads((Path(r["run"]) / "scores.json").read_text())
        assert r["main"] == r["scores"]["accuracy"]
        assert yaml.safe_load((Path(r["run"]) / "finetune.yaml").read_text())["task"] == "SST-2"
    # The seeds differ: the head and the dropout are seeded from train.seed.
    assert len({tuple(losses(Path(r["run"]))) for r in runs.values()}) == 6
    medians = {lr: statistics.median(runs[lr, s]["main"] for s in (1, 2, 3)) for lr in (1e-3, 3e-3)}
    assert report["median_by_lr"] == {f"{lr:g}": m for lr, m in medians.items()}
    best = max(medians, key=lambda lr: medians[lr])
    assert (report["best_lr"], report["best_median"]) == (best, medians[best])

    # A run cut off after its step-4 checkpoint resumes from it; the finished ones are not trained again.
    lost = out / "lr0.003-seed2"
    expected, expected_losses = (lost / "scores.json").read_text(), losses(lost)
    for path in lost.iterdir():
        if path.name not in ("config.yaml", "finetune.yaml", "vocab.txt", "checkpoints", "metrics.jsonl"):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    shutil.rmtree(lost / "checkpoints" / "step_00000008")
    finished = {p: p.stat().st_mtime_ns for p in out.glob("*/model.safetensors")}
    assert len(finished) == 5
    assert main(argv) == 0
    assert {p: p.stat().st_mtime_ns for p in finished} == finished
    assert (lost / "scores.json").read_text() == expected
    assert losses(lost) == expected_losses
    assert json.loads((out / "sweep.json").read_text()) == report


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file of a run but its lock (which names the process holding it)."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file() and p.name != ".lock"}


def test_overwrite_refuses_a_live_run_and_removes_nothing_of_it(root, tmp_path, capsys):
    """``--overwrite`` takes the run's lock before it removes anything (issue 27: it emptied a run
    still training): a live run's directory, or a sweep's directory with a live run in it, is
    refused in one line naming the run and its process, every file left; once that process is
    gone, the old run is replaced. About 4 s."""
    out = tmp_path / "sweep" / "lr0.003-seed1"
    assert main(ft_args(root, "sst-2", out, "--checkpoint.every", "4", epochs=1)) == 0
    before = snapshot(out)
    with live_run(out) as holder:
        capsys.readouterr()
        assert main(ft_args(root, "sst-2", out, "--overwrite", epochs=1)) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {out} is in use by another run (pid {holder.pid} on ")
        assert err.endswith("wait for it to end, or choose another directory\n") and err.count("\n") == 1
        sweep = [*ft_args(root, "sst-2", out.parent, "--overwrite", epochs=1), "--seeds", "1", "2"]
        assert main(sweep) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {out.parent}: {out} is the directory of a live run (pid {holder.pid} on ")
        assert err.endswith("; --overwrite would replace its files: wait for it to end, or choose another "
                            "output\n") and err.count("\n") == 1
        assert snapshot(out) == before and f"pid {holder.pid} on " in (out / ".lock").read_text()
    assert main(ft_args(root, "sst-2", out, "--overwrite", epochs=1)) == 0
    assert checkpoints(out) == ["step_00000008"]  # step 4's went with the old run


# ------------------------------------------------------------------ errors


def test_bad_input_is_one_line_naming_it(root, tmp_path, capsys):
    cases = [
        (["finetune", "glue", "--task", "sst3", "--data", str(root / "data" / "sst-2"), "--init", str(root / "init"),
          "--out", str(tmp_path / "out")],
         "error: finetune.task='sst3' is not a GLUE task (one of CoLA, SST-2, MRPC, STS-B, QQP, MNLI, QNLI, RTE, "
         "WNLI, AX)\n"),
        (["finetune", "glue", "--task", "sst-2", "--data", str(tmp_path), "--init", str(root / "init"),
          "--out", str(tmp_path / "out")], f"error: {tmp_path}: no train.tsv in it or in its SST-2/ (SST-2's train "
                                           "split)\n"),
        (["finetune", "ner", "--data", str(tmp_path), "--init", str(root / "init"), "--out", str(tmp_path / "out")],
         f"error: {tmp_path}: no training file (train.txt or eng.train)\n"),
        (["finetune", "glue", "--task", "sst-2", "--data", str(root / "data" / "sst-2"), "--init",
          str(tmp_path / "missing"), "--out", str(tmp_path / "out")],
         f"error: model not found: {tmp_path / 'missing'}\n"),
    ]
    for argv, expected in cases:
        capsys.readouterr()
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err == expected
        assert not (tmp_path / "out").exists()  # a refused run leaves no directory behind


@pytest.mark.parametrize("flag, values, message", [
    ("--seeds", ["1", "2", "1"], "error: --seeds 1 is given twice: each value is one run, and a run counts once\n"),
    ("--lr", ["1e-4", "3e-4", "0.0001"],
     "error: --lr 0.0001 is given twice: each value is one run, and a run counts once\n"),
])
def test_a_sweep_value_given_twice_is_refused(root, tmp_path, capsys, flag, values, message):
    """``--seeds 1 1`` would train one run and report it as a median over two."""
    out = tmp_path / "sweep"
    assert main([*ft_args(root, "sst-2", out, epochs=1), flag, *values]) == 2
    assert capsys.readouterr().err == message
    assert not out.exists()


def test_a_task_without_its_dev_file_says_so(root, tmp_path, capsys):
    """A run without dev.tsv trains and warns that it has no dev scores; a sweep, which ranks its runs
    by them, is refused before it trains. MNLI without dev_matched.tsv keeps the mismatched scores'
    names (they are not taken for the matched ones)."""
    sst2 = shutil.copytree(root / "data" / "sst-2", tmp_path / "sst-2")
    (sst2 / "dev.tsv").unlink()
    out = tmp_path / "run"
    argv = ft_args(root, "sst-2", out, epochs=1)
    argv[argv.index("--data") + 1] = str(sst2)
    assert main(argv) == 0
    assert capsys.readouterr().err.splitlines()[0] == (  # then the leaderboard's warning of a short test set
        f"WARNING bertforge.tasks.finetune.train: {sst2}: no dev.tsv in it or in its SST-2/ (SST-2's dev split): "
        f"this run has no dev scores")
    assert json.loads((out / "scores.json").read_text()) == {}
    argv[argv.index("--out") + 1] = str(tmp_path / "sweep")
    assert main([*argv, "--seeds", "1", "2"]) == 2
    assert capsys.readouterr().err == (f"error: a sweep ranks its runs by their dev accuracy: {sst2}: no dev.tsv in "
                                       f"it or in its SST-2/ (SST-2's dev split)\n")
    assert not (tmp_path / "sweep").exists()

    mnli = shutil.copytree(root / "data" / "mnli", tmp_path / "mnli")
    (mnli / "dev_matched.tsv").unlink()
    argv = ft_args(root, "mnli", tmp_path / "mnli-run", epochs=1)
    argv[argv.index("--data") + 1] = str(mnli)
    assert main(argv) == 0
    assert capsys.readouterr().err.splitlines()[0] == (
        f"WARNING bertforge.tasks.finetune.train: {mnli}: no dev_matched.tsv in it or in its MNLI/ (MNLI's dev_matched "
        f"split): this run has no dev_matched scores")
    assert set(json.loads((tmp_path / "mnli-run" / "scores.json").read_text())) == {
        "accuracy_dev_mismatched", "score_dev_mismatched"}

    conll = shutil.copytree(root / "data" / "ner", tmp_path / "ner")
    (conll / "dev.txt").unlink()
    with pytest.raises(FinetuneError) as err:
        require_main_dev(TaskConfig(task="ner", data=str(conll)))
    assert str(err.value) == (f"a sweep ranks its runs by their dev f1: {conll}: no dev file (dev.txt, valid.txt or "
                              f"eng.testa)")


@pytest.mark.parametrize("size, what", [("200k", "checkpoints/step_00000008"), ("360k", "model.safetensors")])
def test_a_full_disk_while_saving_is_one_line_and_leaves_nothing_partial(root, tmp_path, capsys, size, what):
    """A real full disk (a small tmpfs) at the last checkpoint (200 KiB: the 263 KiB of weights and
    optimizer state do not fit), or at the fine-tuned model after it (360 KiB): one line naming
    the file and the space, no temporary left, the checkpoint whole (issue 27: tracebacks from
    torch.save and safetensors). About 3 s each."""
    mount = tmp_path / "disk"
    mount.mkdir()
    with tmpfs(mount, size):
        out = mount / "run"
        assert main(ft_args(root, "sst-2", out, epochs=1)) == 2
        err = capsys.readouterr().err
        named = f"{out / what}" + (" … config.json (2 files)" if what == "model.safetensors" else "")  # the pair
        match = re.fullmatch(rf"error: cannot write {re.escape(named)}: the disk is full \(it needs "
                             rf"([0-9.]+) KiB, ([0-9.]+) KiB free on {re.escape(str((out / what).parent))} after "
                             rf"removing the partial write\)\n", err)
        assert match is not None, err
        assert float(match[2]) < float(match[1])
        assert sorted(p.name for p in out.rglob(".*")) == [".lock"]  # no temporary
        if what == "model.safetensors":
            assert checkpoints(out) == ["step_00000008"] and verify(out / "checkpoints" / "step_00000008")
            assert not (out / what).exists() and not (out / "config.json").exists()  # no config.json without weights
        else:
            assert checkpoints(out) == []


def test_a_failed_model_save_leaves_no_config_json_without_its_weights(tmp_path, monkeypatch):
    """Issue 33.7 without a tmpfs: the weights' write fails (ENOSPC, half written) and the run
    directory is as it was, with no config.json that transformers would take for a model."""
    import errno

    from bertforge.config import ModelConfig
    from bertforge.fileio import WriteError
    from bertforge.formats import weights
    from bertforge.models.bert import BertForQuestionAnswering
    from bertforge.tasks.finetune import run

    model = BertForQuestionAnswering(ModelConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1,
                                                 num_attention_heads=2, intermediate_size=32,
                                                 max_position_embeddings=64))
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text("the run's config\n")

    def full(model, path):
        path.write_bytes(b"x" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(weights, "save_weights", full)
    with pytest.raises(WriteError) as err:
        run.save_finetuned(model, out)
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml"]
    assert str(err.value).startswith(f"cannot write {out / 'model.safetensors'} … config.json (2 files): the disk "
                                     f"is full (it needs more than the ")  # ENOSPC on a disk with room: "more than"
    monkeypatch.undo()
    run.save_finetuned(model, out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "config.yaml", "model.safetensors"]
    assert json.loads((out / "config.json").read_text())["architectures"] == ["BertForQuestionAnswering"]


def test_a_sweep_ranks_a_nan_score_below_every_number():
    """A constant prediction has no correlation (NaN, as scipy and GLUE's scorer give): it is the
    lowest of a sweep's seeds, and a learning rate whose median is NaN is never the best."""
    from bertforge.tasks.finetune.cli import _median, _rank

    nan = float("nan")
    assert _median([nan, 0.5, 0.7]) == 0.5
    assert _median([0.2, 0.9, 0.4, nan]) == pytest.approx(0.3)
    assert math.isnan(_median([nan, nan, 0.2]))
    medians = {2e-5: nan, 3e-5: -0.1}
    assert max(medians, key=lambda lr: _rank(medians[lr])) == 3e-5


def test_init_takes_a_hugging_face_model_id_from_the_local_cache(root, tmp_path, hf_cache, capsys):
    """``--init org/name`` is read from the Hugging Face cache (a snapshot as the hub lays it out,
    written here): weights and vocab, with nothing downloaded; an id the cache lacks is "not found"
    there, and the error says where that cache is."""
    snapshot = hf_cache(root / "init", "bertforge/tiny-test")
    from_id, from_dir = load_model("bertforge/tiny-test").state_dict(), load_model(root / "init").state_dict()
    assert from_id.keys() == from_dir.keys() and all(torch.equal(from_id[k], v) for k, v in from_dir.items())
    out = tmp_path / "run"
    argv = ft_args(root, "sst-2", out, epochs=1)
    argv[argv.index("--init") + 1] = "bertforge/tiny-test"
    assert main(argv) == 0
    assert (out / "vocab.txt").read_text() == (snapshot / "vocab.txt").read_text()
    assert yaml.safe_load((out / "config.yaml").read_text())["checkpoint"]["init"] == str(snapshot)
    argv[argv.index("--init") + 1] = "bertforge/not-cached"
    argv[argv.index("--out") + 1] = str(tmp_path / "run2")
    capsys.readouterr()
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        "error: model not found: bertforge/not-cached (no such path, and no model bertforge/not-cached in the "
        f"local Hugging Face cache {tmp_path / 'hf-cache'}: `hf download bertforge/not-cached` puts it there)\n")
