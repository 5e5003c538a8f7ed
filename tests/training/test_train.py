"""The training loop: loss falls, checkpoints are atomic, resume is bit-exact."""

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from bertforge.config import ConfigError, load_config
from bertforge.formats.load import load_model, read_model_config
from bertforge.runs import CheckpointError, config_from_args, find_checkpoint
from bertforge.training.engine import BatchStream
from bertforge.training.pretrain import pretrain, with_init_model


def small_config(tmp_path: Path, name: str, **overrides):
    """Tiny BERT on a slice of the built-in corpus; every step logged."""
    pairs = {
        "data.vocab_size": 2000, "data.dupe_factor": 1, "data.seq_len": 64, "data.max_predictions": 10,
        "train.micro_batch_size": 8, "train.global_batch_size": 16, "train.steps": 6,
        "train.warmup_steps": 2, "train.lr": 1e-3,
        "checkpoint.every": 3, "checkpoint.keep": 0, "execution.threads": 2,
        "log.every": 1, "log.progress": False,
        "log.run_dir": str(tmp_path), "log.name": name,
    }
    pairs.update(overrides)
    return load_config("pretrain_tiny", list(pairs.items()))


def read_metrics(run_dir: Path):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("split") != "eval"], [r for r in rows if r.get("split") == "eval"]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("runs")
    summary = pretrain(small_config(tmp, "full"))
    return tmp, Path(summary["run_dir"]), summary


@pytest.mark.slow
def test_run_directory_holds_config_metrics_and_checkpoints(full_run):
    _, run_dir, summary = full_run
    assert (run_dir / "config.yaml").is_file() and (run_dir / "vocab.txt").is_file()
    steps = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert steps == ["step_00000003", "step_00000006"]
    train_rows, eval_rows = read_metrics(run_dir)
    assert [r["step"] for r in train_rows] == [1, 2, 3, 4, 5, 6]
    for key in ("loss", "mlm_loss", "nsp_loss", "lr", "seq_per_s", "grad_norm"):
        assert all(isinstance(r[key], float) for r in train_rows), key
    assert train_rows[0]["loss"] == pytest.approx(train_rows[0]["mlm_loss"] + train_rows[0]["nsp_loss"], abs=1e-5)
    # warm-up over 2 steps, then linear decay to 0 at step 6: lr used at steps 0..5
    assert [r["lr"] for r in train_rows] == pytest.approx([5e-4, 1e-3, 1e-3, 7.5e-4, 5e-4, 2.5e-4])
    assert [r["step"] for r in eval_rows] == [0, 6]
    assert all(0.0 <= r["mlm_accuracy"] <= 1.0 and 0.0 <= r["nsp_accuracy"] <= 1.0 for r in eval_rows)
    assert summary["steps"] == 6


@pytest.mark.slow
def test_resume_is_bit_identical(full_run, tmp_path):
    _, run_dir, _ = full_run
    # The same run interrupted after step 3: a copy holding only what existed then.
    copy = tmp_path / "interrupted"
    shutil.copytree(run_dir, copy)
    shutil.rmtree(copy / "checkpoints" / "step_00000006")
    train_rows, _ = read_metrics(run_dir)
    with open(copy / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in train_rows[:3])
    cfg = small_config(tmp_path, "unused", **{"checkpoint.resume": str(copy)})
    summary = pretrain(cfg)
    assert Path(summary["run_dir"]) == copy
    resumed_rows, _ = read_metrics(copy)
    assert [r["loss"] for r in resumed_rows] == [r["loss"] for r in train_rows]
    assert [r["lr"] for r in resumed_rows] == [r["lr"] for r in train_rows]
    a = load_file(str(run_dir / "checkpoints/step_00000006/model.safetensors"))
    b = load_file(str(copy / "checkpoints/step_00000006/model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    oa = torch.load(run_dir / "checkpoints/step_00000006/optimizer.pt", weights_only=True)
    ob = torch.load(copy / "checkpoints/step_00000006/optimizer.pt", weights_only=True)
    for k, state in oa["state"].items():
        for name, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(ob["state"][k][name])), (k, name)


def test_incomplete_checkpoints_are_never_resumed(full_run, tmp_path):
    _, run_dir, _ = full_run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    ckpts = copy / "checkpoints"
    # A save that crashed before its rename, and a step directory missing a file.
    shutil.copytree(ckpts / "step_00000006", ckpts / ".step_00000009.tmp-4242")
    shutil.copytree(ckpts / "step_00000006", ckpts / "step_00000012")
    (ckpts / "step_00000012" / "optimizer.pt").unlink()
    assert find_checkpoint(copy).name == "step_00000006"
    with pytest.raises(CheckpointError, match=r"incomplete checkpoint .*step_00000012: missing optimizer.pt"):
        find_checkpoint(ckpts / "step_00000012")
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        find_checkpoint(tmp_path)


def test_shape_mismatch_names_the_field(full_run, tmp_path):
    _, run_dir, _ = full_run
    cfg = small_config(tmp_path, "wide", **{"model.hidden_size": 256, "model.intermediate_size": 1024,
                                             "checkpoint.init": str(run_dir)})
    with pytest.raises(CheckpointError, match=r"model.hidden_size=128 but the config asks for model.hidden_size=256"):
        pretrain(cfg)


def test_a_named_preset_must_be_the_inits_model(full_run, tmp_path):
    """checkpoint.init's model fills the fields not given (issue 31.4), but a preset the user named asks for
    a model too: one that is not the init's is refused, not trained as the init's in silence (issue 40.10)."""
    _, run_dir, _ = full_run  # BERT-tiny: 2 layers, hidden 128
    pairs = {"checkpoint.init": str(run_dir), "data.vocab": str(run_dir / "vocab.txt"), "log.run_dir": str(tmp_path),
             "log.name": "mini", "train.steps": 1}
    with pytest.raises(ConfigError) as refused:
        pretrain(load_config("mini", list(pairs.items())))
    assert str(refused.value) == (f"checkpoint.init {run_dir} is not the named model preset mini: it has "
                                  "model.num_hidden_layers=2 (the preset's 4), model.hidden_size=128 (the preset's "
                                  "256), model.num_attention_heads=2 (the preset's 4), model.intermediate_size=512 "
                                  "(the preset's 1024); leave the preset out to train the init's model")
    assert not (tmp_path / "mini").exists()
    given = [("model.num_hidden_layers", 2), ("model.hidden_size", 128), ("model.num_attention_heads", 2),
             ("model.intermediate_size", 512)]  # the preset's fields given as the init's: no conflict left
    cfg = load_config("mini", [*pairs.items(), *given])
    assert cfg.preset == "mini"
    assert with_init_model(cfg).model == read_model_config(run_dir)
    # The command's default config (pretrain_tiny: model tiny) names no preset; --model.preset and --config do.
    named = {(None, ()): "", (None, ("--model.preset", "mini")): "mini", ("mini", ()): "mini"}
    for (config, extra), preset in named.items():
        assert config_from_args(argparse.Namespace(config=config), list(extra), "pretrain_tiny").preset == preset


@pytest.mark.slow
def test_init_takes_a_hugging_face_model_id_from_the_local_cache(full_run, tmp_path, hf_cache, monkeypatch):
    """``checkpoint.init: ORG/NAME`` starts from that model's snapshot in the local Hugging Face
    cache, which the saved config names (it was made an absolute path first, and not found)."""
    from bertforge.cli import main

    _, run_dir, summary = full_run
    assert main(["export", str(run_dir), str(tmp_path / "hf")]) == 0
    snapshot = hf_cache(tmp_path / "hf", "org/tiny-bert")
    monkeypatch.chdir(tmp_path)  # where org/tiny-bert is no path
    cfg = small_config(tmp_path, "from-id", **{"checkpoint.init": "org/tiny-bert", "train.steps": 1,
                                                "data.vocab": str(run_dir / "vocab.txt")})
    started = pretrain(cfg)
    # its first evaluation is of the weights the full run ended with, on the same held-out data
    assert started["first_eval"] == summary["last_eval"]
    saved = load_config(str(tmp_path / "from-id" / "config.yaml"))
    assert saved.checkpoint.init == str(snapshot)


def test_loaded_model_reproduces_the_checkpoint_weights(full_run):
    _, run_dir, _ = full_run
    model = load_model(run_dir)
    saved = load_file(str(run_dir / "checkpoints/step_00000006/model.safetensors"))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    encoder = load_model(run_dir, head="encoder")
    assert torch.equal(encoder.embeddings.word_embeddings.weight, saved["bert.embeddings.word_embeddings.weight"])
    qa = load_model(run_dir, head="qa")
    assert torch.equal(qa.bert.encoder.layer[1].output.dense.weight,
                       saved["bert.encoder.layer.1.output.dense.weight"])


def test_batch_stream_position_is_the_whole_state():
    from bertforge.data import SyntheticDataset

    data = SyntheticDataset(size=10, vocab_size=50, seq_len=16, max_predictions=3, seed=1)
    stream = BatchStream(data, batch_size=3, seed=7)
    seen = [stream.next()["input_ids"] for _ in range(5)]  # 3 per epoch: crosses into epoch 1
    assert stream.state() == {"epoch": 1, "index": 2}
    again = BatchStream(data, batch_size=3, seed=7, epoch=1, index=0)
    assert torch.equal(again.next()["input_ids"], seen[3]) and torch.equal(again.next()["input_ids"], seen[4])
    # within one epoch every sequence appears at most once
    first_epoch = torch.cat(seen[:3])
    assert len({tuple(row.tolist()) for row in first_epoch}) == 9


@pytest.mark.slow
def test_loss_falls_and_accuracy_rises_on_the_builtin_corpus(tmp_path):
    cfg = small_config(tmp_path, "learn", **{
        "train.steps": 40, "train.lr": 2e-2, "train.warmup_steps": 5, "train.micro_batch_size": 32,
        "train.global_batch_size": 32, "checkpoint.every": 0, "log.every": 10, "data.dupe_factor": 2})
    summary = pretrain(cfg)
    # Measured (40 steps; 80 gave 6.66, 6.77 and 0.046, in twice the time): training loss 8.34 -> 7.05,
    # held-out loss 8.32 -> 6.99, held-out MLM accuracy 0.001 -> 0.043.
    assert summary["last_loss"] < summary["first_loss"] - 1.0
    assert summary["last_eval"]["loss"] < summary["first_eval"]["loss"] - 1.0
    assert summary["last_eval"]["mlm_accuracy"] > summary["first_eval"]["mlm_accuracy"] + 0.03


def test_export_cli_gives_a_directory_transformers_loads(full_run, tmp_path):
    transformers = pytest.importorskip("transformers")
    from bertforge.cli import main

    _, run_dir, _ = full_run
    out = tmp_path / "hf"
    assert main(["export", str(run_dir), str(out)]) == 0
    assert (out / "vocab.txt").read_text() == (run_dir / "vocab.txt").read_text()
    theirs = transformers.BertForPreTraining.from_pretrained(out).eval()
    ours = load_model(run_dir)
    ids = torch.randint(5, 100, (2, 16))
    types = torch.cat([torch.zeros(2, 8), torch.ones(2, 8)], 1).long()
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 12:] = 0
    with torch.no_grad():
        mlm, nsp = ours(ids, types, mask)
        ref = theirs(input_ids=ids, token_type_ids=types, attention_mask=mask)
    assert torch.allclose(mlm, ref.prediction_logits, atol=1e-5)
    assert torch.allclose(nsp, ref.seq_relationship_logits, atol=1e-5)


def test_synthetic_data_trains_without_a_corpus(tmp_path):
    from bertforge.cli import main

    assert main(["pretrain", "--config", "tiny", "--data.synthetic", "--steps", "2", "--no-progress",
                 "--run-dir", str(tmp_path), "--name", "synth", "--data.seq_len", "32",
                 "--train.micro_batch_size", "4", "--train.global_batch_size", "8",
                 "--log.every", "1", "--log.tensorboard", "false"]) == 0
    train_rows, eval_rows = read_metrics(tmp_path / "synth")
    assert [r["step"] for r in train_rows] == [1, 2] and eval_rows == []
    assert not (tmp_path / "synth" / "vocab.txt").exists()


def test_epochs_set_the_number_of_steps():
    from bertforge.training.pretrain import total_steps

    cfg = load_config("tiny", [("train.epochs", 3), ("train.micro_batch_size", 8), ("train.global_batch_size", 32)])
    assert total_steps(cfg.train, batches_per_epoch=100, accumulation=4) == 75
    cfg = load_config("tiny", [("train.steps", 7)])
    assert total_steps(cfg.train, batches_per_epoch=100, accumulation=4) == 7


def test_bf16_autocast_on_cpu_matches_fp32_closely():
    from bertforge.data import SyntheticDataset
    from bertforge.models.bert import BertForPreTraining
    from bertforge.training.engine import autocast
    from bertforge.training.pretrain import forward_loss

    cfg = load_config("tiny")
    torch.manual_seed(0)
    model = BertForPreTraining(cfg.model).eval()
    data = SyntheticDataset(size=4, vocab_size=cfg.model.vocab_size, seq_len=64, max_predictions=10)
    batch = data.batch([0, 1, 2, 3])
    fp32 = forward_loss(model, batch)["loss"].item()
    with autocast(torch.device("cpu"), "bf16"):
        bf16 = forward_loss(model, batch)["loss"].item()
    assert bf16 == pytest.approx(fp32, rel=2e-2) and bf16 != fp32
    from bertforge.config import ConfigError
    with pytest.raises(ConfigError, match="execution.precision=fp16 needs a CUDA device"):
        autocast(torch.device("cpu"), "fp16")


def test_tensorboard_gets_the_scalars(full_run):
    pytest.importorskip("tensorboard")
    _, run_dir, _ = full_run
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["native", "tfrecord"])
def test_pretrain_from_record_shards_resumes_exactly(fmt, full_run, tmp_path):
    from bertforge.config import DataConfig
    from bertforge.data import build_datasets
    from bertforge.data.record_writer import write_records

    _, run_dir, _ = full_run
    data = DataConfig(vocab=str(run_dir / "vocab.txt"), seq_len=64, max_predictions=10, dupe_factor=1)
    train, held_out, _ = build_datasets(data, tmp_path)
    half = len(train) // 2
    shards = tmp_path / "shards"
    for i, rows in enumerate((np.arange(half), np.arange(half, len(train)))):
        write_records(shards / f"train{i}.{fmt}", take(train.arrays, rows), fmt=fmt)
    write_records(tmp_path / f"eval.{fmt}", held_out.arrays, fmt=fmt)
    overrides = {"data.input": str(shards), "data.eval_input": str(tmp_path / f"eval.{fmt}"),
                 "data.vocab": str(run_dir / "vocab.txt"), "data.dynamic_masking": True,
                 "data.shuffle_buffer": 100}
    summary = pretrain(small_config(tmp_path, "records", **overrides))
    assert summary["steps"] == 6 and summary["last_eval"]["sequences"] == len(held_out)
    interrupted = tmp_path / "interrupted"
    shutil.copytree(summary["run_dir"], interrupted)
    shutil.rmtree(interrupted / "checkpoints" / "step_00000006")
    rows, _ = read_metrics(Path(summary["run_dir"]))
    with open(interrupted / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows[:3])
    pretrain(small_config(tmp_path, "unused", **{**overrides, "checkpoint.resume": str(interrupted)}))
    resumed, _ = read_metrics(interrupted)
    assert [r["loss"] for r in resumed] == [r["loss"] for r in rows]


def take(arrays, rows):
    import dataclasses

    return type(arrays)(**{f.name: getattr(arrays, f.name)[rows] for f in dataclasses.fields(arrays)})


def test_pretrain_into_a_file_prints_step_lines_before_the_end(tmp_path, capsys):
    """Under capsys stderr is no terminal (as under Slurm or ``| tee``): plain step lines, not a
    bar that shows only at the end."""
    from bertforge.cli import main

    assert main(["pretrain", "--config", "tiny", "--data.synthetic", "--steps", "3",
                 "--run-dir", str(tmp_path), "--name", "plain", "--data.seq_len", "32",
                 "--train.micro_batch_size", "4", "--train.global_batch_size", "8",
                 "--log.every", "1", "--log.tensorboard", "false", "--log.progress_every_s", "1e9"]) == 0
    lines = capsys.readouterr().err.splitlines()
    steps = [i for i, line in enumerate(lines) if line.startswith("pretrain step ")]
    done = next(i for i, line in enumerate(lines) if line.startswith("done in "))
    # the first logged step and the last (none between: the interval is longer than any load makes step 2)
    assert [lines[i].split()[2] for i in steps] == ["1/3", "3/3"] and steps[0] < done
    assert lines[steps[-1]].endswith("eta 0:00:00") and " seq/s " in lines[steps[0]]


def test_pretrain_evaluations_into_a_file_print_their_batches(tmp_path, capsys):
    """Off a terminal every evaluation prints a start line, a line per log.progress_every_s of its
    batches (here every batch) and an end line; the step lines follow the same interval."""
    import math
    import re

    from tiny_corpus import write_corpus

    from bertforge.cli import main
    from bertforge.data.record_reader import read_records

    write_corpus(tmp_path)
    assert main(["pretrain", "--config", "tiny", "--data.input", str(tmp_path / "train.tfrecord"),
                 "--data.eval_input", str(tmp_path / "eval.tfrecord"), "--data.vocab", str(tmp_path / "vocab.txt"),
                 "--data.seq_len", "32", "--data.max_predictions", "4", "--steps", "2",
                 "--train.micro_batch_size", "8", "--train.global_batch_size", "8", "--train.eval_every", "2",
                 "--train.eval_batch_size", "8", "--execution.threads", "2", "--log.every", "1",
                 "--log.progress_every_s", "1e-9", "--log.tensorboard", "false",
                 "--run-dir", str(tmp_path / "runs"), "--name", "evals"]) == 0
    lines = capsys.readouterr().err.splitlines()
    sequences = len(read_records(tmp_path / "eval.tfrecord"))
    batches = math.ceil(sequences / 8)
    assert [line.split()[2] for line in lines if line.startswith("pretrain step ")] == ["1/2", "2/2"]
    first = lines.index(f"step 2: eval: {sequences} sequences")
    done = [re.fullmatch(rf"step 2: eval: batch (\d+)/{batches} [\d.]+ batches/s eta \d+:\d\d:\d\d", line)
            for line in lines[first + 1:first + batches]]
    assert [int(match.group(1)) for match in done if match] == list(range(1, batches)) and batches > 2
    assert re.fullmatch(rf"step 2: eval: done {sequences} sequences in [\d.]+ s", lines[first + batches])


def test_pretrain_prints_its_result_on_stdout_and_its_progress_on_stderr(tmp_path, capsys):
    """Issue 41.7: ``bertforge pretrain > log.txt`` holds the run's result (README, "Quick start"):
    the held-out loss and accuracies from the first evaluation to the last, then the run directory;
    the progress, the evaluations and the run directory at its start are on stderr as they come."""
    import re

    from tiny_corpus import write_corpus

    from bertforge.cli import main

    write_corpus(tmp_path)
    run = tmp_path / "runs" / "result"
    assert main(["pretrain", "--config", "tiny", "--data.input", str(tmp_path / "train.tfrecord"),
                 "--data.eval_input", str(tmp_path / "eval.tfrecord"), "--data.vocab", str(tmp_path / "vocab.txt"),
                 "--data.seq_len", "32", "--data.max_predictions", "4", "--steps", "2",
                 "--train.micro_batch_size", "8", "--train.global_batch_size", "8", "--train.eval_every", "2",
                 "--train.eval_at_start", "true", "--train.eval_batch_size", "8", "--log.every", "1",
                 "--log.tensorboard", "false", "--run-dir", str(run.parent), "--name", run.name]) == 0
    out, err = capsys.readouterr()
    lines = err.splitlines()
    evals = [re.fullmatch(r"step (\d+): eval mlm_accuracy (\S+) nsp_accuracy (\S+) loss (\S+)", line)
             for line in lines if " eval mlm_accuracy " in line]
    assert [int(m.group(1)) for m in evals] == [r["step"] for r in read_metrics(run)[1]] == [0, 2]
    for m, row in zip(evals, read_metrics(run)[1], strict=True):  # the lines print what was logged
        assert [float(m.group(i)) for i in (2, 3, 4)] == pytest.approx(
            [row["mlm_accuracy"], row["nsp_accuracy"], row["loss"]], abs=1e-4)
    (_, acc0, nsp0, loss0), (_, acc2, nsp2, loss2) = (m.groups() for m in evals)
    assert out == (f"held-out loss {loss0} → {loss2}, masked-LM accuracy {acc0} → {acc2}, "
                   f"NSP accuracy {nsp0} → {nsp2}\nrun directory: {run}\n")
    assert lines[0] == f"run directory: {run}" and "held-out" not in err
    assert [line.split()[2] for line in lines if line.startswith("pretrain step ")] == ["1/2", "2/2"]
