"""A resume with --resume-with-changes goes on configured as changed (issue 43.1): the lr and the
weights after the resumed steps equal those of a fresh run given, step by step, the lr the changed
config gives (a ``table`` schedule of those values), from the same start.

BERT-tiny on synthetic sequences of 32 tokens, 2 + 2 steps: about 3 s a run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from bertforge.cli import main
from bertforge.config import ModelConfig, load_config
from bertforge.formats.hf import export_hf
from bertforge.models.bert import BertForQuestionAnswering
from bertforge.training.optim import lr_at


def pretrain_args(run_dir: Path, name: str, *extra: str) -> list[str]:
    return ["pretrain", "--config", "tiny", "--data.synthetic", "--no-progress", "--run-dir", str(run_dir),
            "--name", name, "--data.seq_len", "32", "--data.max_predictions", "5", "--train.micro_batch_size", "4",
            "--train.global_batch_size", "8", "--log.every", "1", "--log.tensorboard", "false",
            "--execution.threads", "1", "--checkpoint.keep", "0", "--train.eval_every", "0", *extra]


def logged_lrs(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["lr"] for r in rows if r.get("split") != "eval"]


def weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(run / "checkpoints" / f"step_{step:08d}" / "model.safetensors")


def train_config(*overrides: str):
    pairs = [(overrides[i].removeprefix("--"), overrides[i + 1]) for i in range(0, len(overrides), 2)]
    return load_config("tiny", pairs).train


SCHEDULES = {  # the run's schedule, and what the resume changes
    "constant": (["--train.schedule", "constant", "--train.lr", "1e-3"], ["--train.lr", "1e-4"]),
    "poly": (["--train.schedule", "poly", "--train.lr", "1e-3", "--train.warmup_steps", "1"],
             ["--train.lr", "1e-4", "--train.end_lr", "1e-5"]),
    "table": (["--train.schedule", "table", "--train.lr", "1e-3", "--train.lr_table", "{0: 0.001, 3: 0.002}"],
              ["--train.lr_table", "{0: 0.0001, 3: 0.0003}"]),
    "wsd": (["--train.schedule", "wsd", "--train.lr", "1e-3", "--train.warmup_steps", "1"],
            ["--train.lr", "1e-4", "--train.decay_steps", "2", "--train.end_lr", "1e-6"]),
}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_pretraining_resumed_with_a_changed_lr_goes_on_as_a_run_given_that_lr(tmp_path, schedule):
    """2 steps, resumed with the change for 2 more (the schedule then spans 4), against a fresh
    4-step run whose table gives steps 0-1 the first config's lrs and steps 2-3 the changed one's."""
    before, change = SCHEDULES[schedule]
    assert main([*pretrain_args(tmp_path, "a", *before), "--steps", "2"]) == 0
    assert main(["pretrain", "--resume", str(tmp_path / "a"), "--steps", "4", "--no-progress",
                 "--resume-with-changes", *change]) == 0
    first, changed = train_config(*before, "--train.steps", "2"), train_config(*before, *change, "--train.steps", "4")
    expected = [lr_at(0, first, 2), lr_at(1, first, 2), lr_at(2, changed, 4), lr_at(3, changed, 4)]
    table = "{" + ", ".join(f"{k}: {lr!r}" for k, lr in enumerate(expected)) + "}"
    assert main([*pretrain_args(tmp_path, "fresh", "--train.schedule", "table", "--train.lr_table", table),
                 "--steps", "4"]) == 0
    assert logged_lrs(tmp_path / "a") == pytest.approx(expected, rel=1e-12)
    assert logged_lrs(tmp_path / "fresh") == pytest.approx(expected, rel=1e-12)
    resumed, fresh = weights(tmp_path / "a", 4), weights(tmp_path / "fresh", 4)
    assert resumed.keys() == fresh.keys()
    for name in fresh:
        torch.testing.assert_close(resumed[name], fresh[name], rtol=1e-6, atol=1e-7, msg=name)


def test_the_optimizers_settings_changed_on_a_resume_are_those_it_goes_on_with(tmp_path):
    """train.weight_decay, beta2 and eps changed: the optimizer state saved after the resumed steps holds
    the new ones (torch's load_state_dict had put back the checkpoint's)."""
    assert main([*pretrain_args(tmp_path, "a", "--train.optimizer", "adamw"), "--steps", "2"]) == 0
    assert main(["pretrain", "--resume", str(tmp_path / "a"), "--steps", "3", "--no-progress", "--resume-with-changes",
                 "--train.weight_decay", "0.5", "--train.beta2", "0.95", "--train.eps", "1e-8"]) == 0
    state = torch.load(tmp_path / "a" / "checkpoints" / "step_00000003" / "optimizer.pt", weights_only=True)
    decays = [group["weight_decay"] for group in state["param_groups"]]
    assert decays == [0.5, 0.0]  # (the second group: biases and norms, never decayed)
    assert {(group["betas"], group["eps"]) for group in state["param_groups"]} == {((0.9, 0.95), 1e-8)}


@pytest.mark.parametrize(("run", "change", "refused"), [
    (["--train.schedule", "table", "--train.lr_table", "{0: 0.001}"], ["--train.lr", "1e-4"],
     "train.lr: 0.001 → 0.0001 changes nothing under the table schedule, whose train.lr_table sets every "
     "step's lr: change train.lr_table"),
    ([], ["--model.initializer_range", "0.5"],
     "model.initializer_range: 0.02 → 0.5 only sets the weights a run starts from, which a resume takes from "
     "its checkpoint"),
])
def test_a_change_a_resume_cannot_apply_is_refused_in_one_line(tmp_path, capsys, run, change, refused):
    assert main([*pretrain_args(tmp_path, "a", "--train.lr", "1e-3", *run), "--steps", "2"]) == 0
    capsys.readouterr()
    assert main(["pretrain", "--resume", str(tmp_path / "a"), "--steps", "3", "--no-progress",
                 "--resume-with-changes", *change]) == 2
    step_2 = tmp_path / "a" / "checkpoints" / "step_00000002"
    assert capsys.readouterr().err.splitlines()[-1] == f"error: resuming {step_2}: {refused}"
    assert sorted(p.name for p in (tmp_path / "a" / "checkpoints").iterdir()) == ["step_00000002"]


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "model.safetensors")


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in b:
        torch.testing.assert_close(a[name], b[name], rtol=1e-6, atol=1e-7, msg=name)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[str, list[str]]:
    """Each fine-tuning job's command on tiny data (finetune_data's, test_squad_cli's), less --out and the steps."""
    import finetune_data
    import test_squad_cli

    root = tmp_path_factory.mktemp("jobs")
    init = finetune_data.tiny_model(root / "init")
    common = ["--no-progress", "--data.seq_len", "32", "--train.epochs", "0", "--log.every", "1",
              "--log.tensorboard", "false", "--execution.threads", "1", "--checkpoint.keep", "0",
              "--train.warmup_steps", "0", "--train.warmup_proportion", "0"]
    qa = export_hf(BertForQuestionAnswering(ModelConfig(
        vocab_size=len(test_squad_cli.VOCAB), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=64)), root / "qa", without_tokenizer=True)
    (qa / "vocab.txt").write_text("\n".join(test_squad_cli.VOCAB) + "\n")
    (root / "dev.json").write_text(json.dumps(test_squad_cli.DEV))
    pairs = root / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"query": f"alice met {w}", "positive": f"{w} works in paris"}) + "\n"
                             for w in finetune_data.WORDS[:16]), encoding="utf-8")
    return {
        "retrieval": ["retrieval", "train", "--init", str(init), "--data", str(pairs), "--document-max-length", "16",
                      "--query-max-length", "16", "--train.micro_batch_size", "4", "--train.global_batch_size", "4",
                      *common],
        "glue": ["finetune", "glue", "--task", "sst-2", "--data", str(finetune_data.write_sst2(root / "sst2")),
                 "--init", str(init), "--train.micro_batch_size", "8", "--train.global_batch_size", "8", *common],
        "ner": ["finetune", "ner", "--data", str(finetune_data.write_conll(root / "conll")), "--init", str(init),
                "--train.micro_batch_size", "8", "--train.global_batch_size", "8", *common],
        "squad": ["squad", "train", "--init", str(qa), "--train-file", str(root / "dev.json"),
                  "--squad.max_query_length", "8", "--train.micro_batch_size", "1", "--train.global_batch_size", "2",
                  *common],
    }


@pytest.mark.parametrize("job", ["glue", "ner", "squad", "retrieval"])
def test_a_finetuning_resumed_with_a_changed_lr_goes_on_as_a_run_given_that_lr(tmp_path, jobs, job):
    """2 steps at a constant 1e-3, resumed at 1e-4 for 2 more, against a fresh 4-step run whose table
    gives steps 0-1 1e-3 and steps 2-3 1e-4."""
    args, out = jobs[job], tmp_path / "a"
    assert main([*args, "--out", str(out), "--train.steps", "2", "--train.schedule", "constant",
                 "--train.lr", "1e-3"]) == 0
    assert main([*args[:2], "--resume", str(out), "--no-progress", "--train.steps", "4", "--resume-with-changes",
                 "--train.lr", "1e-4"]) == 0
    assert main([*args, "--out", str(tmp_path / "fresh"), "--train.steps", "4", "--train.schedule", "table",
                 "--train.lr", "1e-3", "--train.lr_table", "{0: 0.001, 2: 0.0001}"]) == 0
    assert logged_lrs(out) == logged_lrs(tmp_path / "fresh") == pytest.approx([1e-3, 1e-3, 1e-4, 1e-4], rel=1e-12)
    same(final_weights(out), final_weights(tmp_path / "fresh"))
