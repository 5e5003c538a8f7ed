"""MLPerf BERT: the eval cadence formula, the stopping rule, the MLPerf config, and a rehearsal
whose MLPerf log passes mlperf-logging's own compliance checker (training ruleset 5.0.0)."""

import json
import math
import shutil
import subprocess
import sys
import time
from importlib import resources
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
from tiny_corpus import write_corpus

from bertforge.config import ConfigError, load_config
from bertforge.training.mlperf import eval_due, eval_every_samples, eval_interval_samples
from bertforge.training.pretrain import pretrain

needs_mlperf = pytest.mark.skipif(find_spec("mlperf_logging") is None,
                                  reason="the [mlperf] extra (mlperf-logging) is not installed")


def rehearsal_config(root: Path, name: str, **overrides):
    """The shipped mlperf_bert config (LAMB and schedule as MLPerf's, eval at 0 samples, the
    stopping rule, the MLPerf log) with a model, batch and cadence a CPU runs in seconds."""
    pairs = {
        "data.input": str(root / "train.tfrecord"), "data.eval_input": str(root / "eval.tfrecord"),
        "data.vocab": str(root / "vocab.txt"), "data.seq_len": 32, "data.max_predictions": 4,
        "model": "tiny", "model.hidden_size": 64, "model.intermediate_size": 256,
        "train.global_batch_size": 32, "train.micro_batch_size": 16, "train.steps": 300,
        "train.lr": 0.02, "train.beta1": 0.9, "train.beta2": 0.999, "train.weight_decay": 0.01,
        "train.warmup_steps": 10, "train.start_warmup_step": 0,
        "train.eval_every_samples": 800, "train.eval_batch_size": 64,
        "execution.precision": "fp32", "execution.threads": 1,  # 1: no thread spinning on a busy CPU
        "log.mlperf": str(root / f"{name}.txt"), "log.progress": False, "log.tensorboard": False,
        "log.run_dir": str(root / "runs"), "log.name": name,
    }
    pairs.update(overrides)
    return load_config("mlperf_bert", list(pairs.items()))


def read_log(path: Path) -> list[dict]:
    return [json.loads(line.removeprefix(":::MLLOG ")) for line in path.read_text().splitlines()]


def check_compliance(log: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlperf_logging.compliance_checker", "--usage", "training",
                           "--ruleset", "5.0.0", "--log_output", str(log.with_suffix(".checker.log")), str(log)],
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlperf")
    write_corpus(root)
    started = time.perf_counter()
    summary = pretrain(rehearsal_config(root, "result_0"))
    return root, summary, time.perf_counter() - started


def test_eval_interval_is_the_mlperf_formula():
    # The formula as the rules write it, in floats, for every batch up to 70,000.
    for batch in range(1, 70_001):
        assert eval_interval_samples(batch) == math.floor(0.05 * (230.23 * batch + 3_000_000) / 25_000) * 25_000
    # The reference README's table of examples (its 8192 row said 175,000 before mlcommons/training#483).
    table = {256: 150_000, 1024: 150_000, 1536: 150_000, 2048: 150_000, 3072: 175_000, 4096: 175_000,
             8192: 225_000}
    assert {batch: eval_interval_samples(batch) for batch in table} == table
    # The switch to 175,000 (issue 21: the docs once said 2,810).
    assert (eval_interval_samples(2171), eval_interval_samples(2172)) == (150_000, 175_000)


def test_cadence_in_samples_and_in_steps():
    cfg = load_config("pretrain_tiny", [("train.global_batch_size", 64), ("train.eval_every_samples", 100)])
    # Samples after step k: 64k; an evaluation each time they pass a multiple of 100.
    assert [k for k in range(1, 20) if eval_due(cfg.train, k)] == [2, 4, 5, 7, 8, 10, 11, 13, 15, 16, 18, 19]
    cfg = load_config("pretrain_tiny", [("train.global_batch_size", 64), ("train.eval_every_samples", "mlperf")])
    assert eval_every_samples(cfg.train) == 150_000
    assert [k for k in range(1, 5000) if eval_due(cfg.train, k)] == [2344, 4688]  # 150,016 and 300,032 samples
    cfg = load_config("pretrain_tiny", [("train.eval_every", 7)])
    assert [k for k in range(1, 30) if eval_due(cfg.train, k)] == [7, 14, 21, 28]


@needs_mlperf
def test_mlperf_config_is_the_reference_convergence_point_8192():
    cfg = load_config("mlperf_bert")
    # mlperf-logging's reference convergence points: the hyperparameters every 8192 submission is checked against.
    rcps = json.loads(resources.files("mlperf_logging").joinpath(
        "rcp_checker/training_5.0.0/rcps_bert.json").read_text())
    ref = rcps["bert_ref_8192"]["Hyperparams"]
    t = cfg.train
    assert (t.global_batch_size, t.lr, t.eps, t.steps, t.warmup_steps, t.start_warmup_step, t.beta1, t.beta2,
            t.weight_decay) == (rcps["bert_ref_8192"]["BS"], ref["opt_base_learning_rate"], ref["opt_epsilon"],
                                ref["opt_learning_rate_training_steps"], ref["num_warmup_steps"],
                                ref["start_warmup_step"], ref["opt_lamb_beta_1"], ref["opt_lamb_beta_2"],
                                ref["opt_lamb_weight_decay_rate"])
    assert (t.lamb, t.schedule, t.decay_power, t.end_lr, t.target_mlm_accuracy) == ("mlperf", "poly_tf", 1.0, 0.0, 0.72)
    assert (cfg.model.num_hidden_layers, cfg.model.hidden_size, cfg.data.seq_len, cfg.data.max_predictions) \
        == (24, 1024, 512, 76)
    assert eval_every_samples(cfg.train) == 225_000 and t.eval_at_start
    p2 = load_config("pretrain_large_384_phase2")
    assert (p2.data.seq_len, p2.data.max_predictions, p2.train.global_batch_size, p2.train.lr,
            p2.train.warmup_steps, p2.train.steps) == (384, 58, 16400, 0.002828, 274, 2099)


@pytest.mark.slow
@needs_mlperf
def test_rehearsal_reaches_the_target_and_its_log_passes_the_compliance_checker(rehearsal):
    root, summary, wall = rehearsal
    assert summary["status"] == "success"
    assert summary["last_eval"]["mlm_accuracy"] >= 0.72
    steps = summary["steps"]
    assert steps < 300 and summary["samples_to_train"] == 32 * steps and steps * 32 % 800 == 0
    assert 0 < summary["time_to_train_s"] < wall
    rows = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r.get("split") == "eval"]
    assert [r["step"] for r in evals] == list(range(0, steps + 1, 25))  # at 0 samples, then every 800
    assert rows[-1] == {"step": steps, "split": "result", "status": "success",
                        "time_to_train_s": summary["time_to_train_s"], "samples_to_train": 32 * steps}
    log = read_log(root / "result_0.txt")
    keys = [e["key"] for e in log]
    assert keys[:2] == ["cache_clear", "init_start"] and log[0]["value"] is True
    assert keys.index("init_stop") + 1 == keys.index("run_start") and keys[-1] == "run_stop"
    assert log[-1]["metadata"]["status"] == "success"
    accuracy = [(e["metadata"]["epoch_num"], e["value"]) for e in log if e["key"] == "eval_accuracy"]
    assert accuracy == [(r["step"] * 32, pytest.approx(r["mlm_accuracy"], abs=1e-6)) for r in evals]
    values = {e["key"]: e["value"] for e in log if e["event_type"] == "POINT_IN_TIME"}
    assert (values["global_batch_size"], values["gradient_accumulation_steps"], values["train_samples"],
            values["eval_samples"], values["opt_learning_rate_training_steps"], values["start_warmup_step"],
            values["max_sequence_length"], values["submission_benchmark"], values["submission_division"]) \
        == (32, 2, 32 * steps, summary["last_eval"]["sequences"], 300, 0, 32, "bert", "closed")
    checked = check_compliance(root / "result_0.txt")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS" in checked.stdout + checked.stderr


@needs_mlperf
def test_a_run_that_misses_the_target_is_aborted_and_fails_the_checker(rehearsal, tmp_path):
    root, _, _ = rehearsal
    summary = pretrain(rehearsal_config(root, "missed", **{"train.steps": 3, "log.mlperf": str(tmp_path / "m.txt")}))
    assert (summary["status"], summary["steps"], summary["samples_to_train"]) == ("aborted", 3, 96)
    log = read_log(tmp_path / "m.txt")
    assert log[-1]["key"] == "run_stop" and log[-1]["metadata"]["status"] == "aborted"
    # Evaluations at 0 samples and after the last step (96 samples: no multiple of 800 in between).
    assert [e["metadata"]["epoch_num"] for e in log if e["key"] == "eval_accuracy"] == [0, 96]
    checked = check_compliance(tmp_path / "m.txt")
    assert checked.returncode == 1 and "FAILED" in checked.stdout + checked.stderr


@needs_mlperf
def test_mlperf_log_needs_the_package_and_lamb(rehearsal, monkeypatch):
    root, _, _ = rehearsal
    with pytest.raises(ConfigError, match=r"log.mlperf: the MLPerf BERT rules train with LAMB, not "
                                          r"train.optimizer=adamw"):
        pretrain(rehearsal_config(root, "adamw", **{"train.optimizer": "adamw"}))
    monkeypatch.setitem(sys.modules, "mlperf_logging", None)  # as if the extra were not installed
    monkeypatch.setitem(sys.modules, "mlperf_logging.mllog", None)
    with pytest.raises(ConfigError, match=r"log.mlperf needs the mlperf-logging package: "
                                          r"pip install 'bertforge\[mlperf\]'"):
        pretrain(rehearsal_config(root, "nopackage"))
    assert not (root / "runs" / "adamw").exists() and not (root / "runs" / "nopackage").exists()


def test_eval_every_samples_takes_a_count_or_mlperf():
    with pytest.raises(ConfigError, match=r"train.eval_every_samples: expected an integer, got 'often' or "
                                          r"'often' is not one of mlperf"):
        load_config("pretrain_tiny", [("train.eval_every_samples", "often")])
    with pytest.raises(ConfigError, match=r"train.eval_every_samples=-5 must not be negative"):
        load_config("pretrain_tiny", [("train.eval_every_samples", "-5")])


def test_resume_keeps_the_cadence_and_sums_the_time_to_train(tmp_path):
    write_corpus(tmp_path)
    pairs = {"data.input": str(tmp_path / "train.tfrecord"), "data.eval_input": str(tmp_path / "eval.tfrecord"),
             "data.vocab": str(tmp_path / "vocab.txt"), "data.seq_len": 32, "data.max_predictions": 4,
             "model.hidden_size": 64, "model.intermediate_size": 256,
             "train.global_batch_size": 16, "train.micro_batch_size": 16, "train.steps": 6,
             "train.eval_every_samples": 40, "train.target_mlm_accuracy": 0.99, "checkpoint.every": 2,
             "checkpoint.keep": 0, "execution.threads": 1, "log.progress": False, "log.tensorboard": False,
             "log.run_dir": str(tmp_path / "runs")}
    whole = pretrain(load_config("pretrain_tiny", [*pairs.items(), ("log.name", "whole")]))
    # The same run as it was after step 4 (as test_train does it), resumed.
    cut = tmp_path / "cut"
    shutil.copytree(whole["run_dir"], cut)
    shutil.rmtree(cut / "checkpoints" / "step_00000006")
    rows = (cut / "metrics.jsonl").read_text().splitlines()
    (cut / "metrics.jsonl").write_text("".join(r + "\n" for r in rows if json.loads(r)["step"] <= 4))
    resumed = pretrain(load_config("pretrain_tiny", [*pairs.items(), ("checkpoint.resume", str(cut))]))

    def evals(summary):
        rows = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r["mlm_accuracy"], r["loss"]) for r in rows if r.get("split") == "eval"]

    # Evaluations when 40, 80 samples are passed (steps 3 and 5) and at the end, in both runs.
    assert [e[0] for e in evals(whole)] == [0, 3, 5, 6]
    assert evals(resumed) == evals(whole)
    assert (resumed["status"], resumed["samples_to_train"]) == (whole["status"], whole["samples_to_train"]) \
        == ("aborted", 96)
    saved = torch.load(cut / "checkpoints" / "step_00000004" / "trainer.pt", weights_only=True)
    assert 0 < saved["train_s"] < resumed["time_to_train_s"]
