"""SQuAD fine-tuning through the training engine: torchrun with 2 gloo ranks against one
process, periodic checkpoints and an exact resume.

A BERT-tiny with the real BERT vocab (random weights, exported as a Hugging
Face directory) is fine-tuned on 40 real training questions at sequence 64,
a global batch of 8 in micro-batches of 2: one process accumulates 4, each of
two ranks 2. Dropout stays on; the engine seeds it per micro-batch of the
global batch, so every world size draws the same masks.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import shared_data
from test_dist import run_here, torchrun
from test_squad_v2 import to_v2

from bertforge.config import ModelConfig
from bertforge.formats.hf import export_hf
from bertforge.formats.load import load_model
from bertforge.models.bert import BertForPreTraining
from bertforge.runs import find_checkpoint

pytestmark = [pytest.mark.dist, pytest.mark.shared_data]

STEPS = 6


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("squad_dist")
    vocab = shared_data("vocab/bert-base-uncased-vocab.txt")
    train = json.loads(shared_data("squad/train-v1.1-first44.json").read_text(encoding="utf-8"))
    # The first 5 questions of the first paragraph of 8 articles.
    train = {"version": "1.1", "data": [
        dict(a, paragraphs=[dict(a["paragraphs"][0], qas=a["paragraphs"][0]["qas"][:5])])
        for a in train["data"][:8]]}
    (root / "train.json").write_text(json.dumps(train), encoding="utf-8")
    dev = json.loads(shared_data("squad/dev-v1.1.json").read_text(encoding="utf-8"))
    dev = {"version": "1.1", "data": [
        dict(a, paragraphs=[dict(a["paragraphs"][0], qas=a["paragraphs"][0]["qas"][:3])])
        for a in dev["data"][:4]]}
    (root / "dev.json").write_text(json.dumps(dev), encoding="utf-8")
    torch.manual_seed(0)
    cfg = ModelConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                      max_position_embeddings=64)
    export_hf(BertForPreTraining(cfg), root / "init", vocab_path=vocab)
    # SQuAD v2.0: the same questions, every third unanswerable.
    (root / "train-v2.json").write_text(json.dumps(to_v2(train)), encoding="utf-8")
    (root / "dev-v2.json").write_text(json.dumps(to_v2(dev)), encoding="utf-8")
    return {"root": root, "train": root / "train.json", "dev": root / "dev.json", "init": root / "init",
            "train-v2": root / "train-v2.json", "dev-v2": root / "dev-v2.json"}


def squad_args(setup: dict[str, Path], out: Path, parallel: str = "none", *extra: str, v2: bool = False) -> list[str]:
    files = ["--train-file", str(setup["train-v2"]), "--predict-file", str(setup["dev-v2"]), "--version", "2"] if v2 \
        else ["--train-file", str(setup["train"]), "--predict-file", str(setup["dev"])]
    return ["squad", "train", "--init", str(setup["init"]), *files,
            "--out", str(out), "--no-progress", "--data.seq_len", "64", "--squad.doc_stride", "32",
            "--squad.max_query_length", "16", "--train.steps", str(STEPS), "--train.epochs", "0", "--train.lr", "1e-3",
            "--train.micro_batch_size", "2", "--train.global_batch_size", "8", "--train.warmup_steps", "1",
            "--log.every", "1", "--log.tensorboard", "false", "--execution.threads", "1",
            "--execution.parallel", parallel, "--checkpoint.every", "2", "--checkpoint.keep", "0",
            "--train.eval_every", "4", *extra]


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in rows(out) if r.get("split") != "eval"]


def scores(out: Path) -> list[tuple[int, float, float]]:
    return [(r["step"], r["exact_match"], r["f1"]) for r in rows(out) if r.get("split") == "eval"]


def cut_copy(run: Path, to: Path, step: int) -> Path:
    """A fine-tuning run as it stood after its step-``step`` checkpoint: its settings files, vocab and
    that checkpoint only, as if the later steps never happened."""
    (to / "checkpoints").mkdir(parents=True)
    for name in ("config.yaml", "squad.yaml", "finetune.yaml", "retrieval.yaml", "vocab.txt"):
        if (run / name).is_file():
            shutil.copyfile(run / name, to / name)
    name = f"step_{step:08d}"
    shutil.copytree(run / "checkpoints" / name, to / "checkpoints" / name)
    return to


@pytest.fixture(scope="module")
def single(setup) -> Path:
    out = setup["root"] / "single"
    run_here(squad_args(setup, out))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_ranks_give_the_losses_and_weights_of_one_process(setup, single, parallel):
    out = setup["root"] / parallel
    result = torchrun(squad_args(setup, out, parallel))
    assert result.returncode == 0, result.stderr[-3000:]
    one, two = losses(single), losses(out)
    assert len(one) == len(two) == STEPS
    assert one[-1] < one[0] - 0.1  # it learns: the comparison is of moving weights
    for a, b in zip(one, two):
        assert abs(a - b) < 1e-5, (one, two)
    # The fine-tuned model (gathered from the shards under FSDP) is the single process's.
    for key, value in load_model(single, head="qa").state_dict().items():
        assert torch.allclose(load_model(out, head="qa").state_dict()[key], value, atol=1e-5), key
    assert find_checkpoint(out).name == f"step_{STEPS:08d}"
    # Dev scores every 4 steps and at the end, predicted by rank 0 with the whole model.
    assert [step for step, _, _ in scores(out)] == [4, STEPS]
    for (_, em_one, f1_one), (_, em_two, f1_two) in zip(scores(single), scores(out)):
        assert em_one == em_two and abs(f1_one - f1_two) < 1e-6
    assert json.loads((out / "predictions.json").read_text()) == json.loads((single / "predictions.json").read_text())


def test_resume_continues_bit_identically(setup, single):
    cut = cut_copy(single, setup["root"] / "cut", 2)
    run_here(["squad", "train", "--resume", str(cut), "--no-progress", "--execution.threads", "1"])
    assert losses(cut) == losses(single)[2:]
    assert scores(cut) == scores(single)
    resumed, uninterrupted = load_model(cut, head="qa").state_dict(), load_model(single, head="qa").state_dict()
    for key, value in uninterrupted.items():
        assert torch.equal(resumed[key], value), key


def test_an_existing_run_directory_is_not_overwritten(setup, single, capsys):
    from bertforge.cli import main

    before = sorted(p.name for p in single.iterdir())
    assert main(squad_args(setup, single)) == 2
    err = capsys.readouterr().err
    assert err == (f"error: {single} already exists and is not empty: pass --resume {single} to continue "
                   f"its run, --overwrite to replace it, or choose another --out\n")
    assert sorted(p.name for p in single.iterdir()) == before


@pytest.mark.slow
def test_version_2_two_ranks_equal_one_process_and_resume_exactly(setup):
    """SQuAD v2.0 (null answers, null odds) through the same engine: torchrun with 2 ddp ranks gives
    the single process's losses, scores and files; a cut copy of the single run resumes bit-identically."""
    single, two = setup["root"] / "v2-single", setup["root"] / "v2-ddp"
    run_here(squad_args(setup, single, v2=True))
    result = torchrun(squad_args(setup, two, "ddp", v2=True))
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(losses(single)) == STEPS
    for a, b in zip(losses(single), losses(two), strict=True):
        assert abs(a - b) < 1e-5
    eval_rows = [[r for r in rows(out) if r.get("split") == "eval"] for out in (single, two)]
    assert [r["step"] for r in eval_rows[0]] == [4, STEPS] and "best_f1_thresh" in eval_rows[0][-1]
    for a, b in zip(*eval_rows, strict=True):
        assert a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-6 for k in a if k != "split"), (a, b)
    for name in ("predictions.json", "null_odds.json"):
        ours, theirs = json.loads((single / name).read_text()), json.loads((two / name).read_text())
        assert ours.keys() == theirs.keys()
        assert all(ours[k] == theirs[k] if isinstance(ours[k], str) else abs(ours[k] - theirs[k]) < 1e-4
                   for k in ours)

    cut = cut_copy(single, setup["root"] / "v2-cut", 2)
    run_here(["squad", "train", "--resume", str(cut), "--no-progress", "--execution.threads", "1"])
    assert losses(cut) == losses(single)[2:]
    assert [r for r in rows(cut) if r.get("split") == "eval"] == eval_rows[0]
    for name in ("predictions.json", "null_odds.json"):
        assert (cut / name).read_text() == (single / name).read_text()
