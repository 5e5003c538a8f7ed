"""Checkpoints that are damaged, interrupted or cannot be written are named, never taken for whole.

Each test uses one BERT-tiny run on synthetic sequences of 32 tokens (4 steps,
a checkpoint every 2), copied where a test damages it.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tmpfs

from bertforge import runs
from bertforge.cli import main
from bertforge.config import ConfigError, load_config, replaced
from bertforge.fileio import atomic_directory, remove_temporaries
from bertforge.formats import load, weights
from bertforge.formats.load import load_model, load_weights
from bertforge.observe.log import truncate_metrics
from bertforge.training import checkpoint as ckpt

REPO = Path(__file__).resolve().parents[1]


def run_args(run_dir: Path, name: str, steps: int = 4, *extra: str) -> list[str]:
    return ["pretrain", "--config", "tiny", "--data.synthetic", "--steps", str(steps), "--no-progress",
            "--run-dir", str(run_dir), "--name", name, "--data.seq_len", "32", "--data.max_predictions", "5",
            "--train.micro_batch_size", "4", "--train.global_batch_size", "8", "--log.every", "1",
            "--log.tensorboard", "false", "--execution.threads", "1", "--checkpoint.every", "2",
            "--checkpoint.keep", "0", *extra]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("integrity")
    assert main(run_args(root, "run")) == 0
    return root / "run"


def copy_of(run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run, tmp_path / "run"))


def step_dir(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step_{step:08d}"


def test_every_checkpoint_has_a_manifest_of_its_files(run):
    manifest = json.loads((step_dir(run, 4) / "manifest.json").read_text())
    names = sorted(e["path"] for e in manifest["files"])
    assert names == ["config.yaml", "model.safetensors", "optimizer.pt", "trainer.pt"]
    for entry in manifest["files"]:
        file = step_dir(run, 4) / entry["path"]
        assert entry["size"] == file.stat().st_size and entry["crc32c"] == runs.crc32c(file)
    assert runs.verify(step_dir(run, 4)) is True


def test_a_flipped_bit_is_named_and_refused(run, tmp_path, capsys):
    copy = copy_of(run, tmp_path)
    safetensors = step_dir(copy, 4) / "model.safetensors"
    data = bytearray(safetensors.read_bytes())
    data[len(data) // 2] ^= 0x10
    safetensors.write_bytes(bytes(data))
    expected = (f"error: {safetensors}: its crc32c differs from manifest.json: damaged or edited; "
                f"refusing this checkpoint")
    assert main(["export", str(copy), str(tmp_path / "hf")]) == 2
    assert capsys.readouterr().err == expected + "\n"
    # a resume also names the checkpoint to resume instead (issue 43.4), whichever it was given
    for resume in (copy, step_dir(copy, 4)):
        assert main(["pretrain", "--resume", str(resume), "--steps", "6", "--no-progress"]) == 2
        assert capsys.readouterr().err == (f"{expected}; the newest whole checkpoint before it is "
                                           f"{step_dir(copy, 2)}: resume with --resume {step_dir(copy, 2)}\n")
    (step_dir(copy, 2) / "trainer.pt").write_bytes(b"")  # none whole before it
    assert main(["pretrain", "--resume", str(copy), "--steps", "6", "--no-progress"]) == 2
    assert capsys.readouterr().err == f"{expected}; no checkpoint before it is whole\n"
    with pytest.raises(runs.CheckpointError, match="crc32c differs"):
        load_model(copy)
    with pytest.raises(runs.CheckpointError, match="crc32c differs"):
        load_weights(load_model(run), copy)
    assert not (tmp_path / "hf").exists()


def test_resume_auto_skips_a_damaged_newest_checkpoint(run, tmp_path, caplog):
    copy = copy_of(run, tmp_path)
    optimizer = step_dir(copy, 4) / "optimizer.pt"
    optimizer.write_bytes(optimizer.read_bytes()[:1000])  # truncated
    with caplog.at_level(logging.WARNING, logger="bertforge"):
        assert main(run_args(tmp_path, "run", 4, "--resume", "auto")) == 0
    assert (f"skipping damaged checkpoint {step_dir(copy, 4)}: {optimizer}: 1000 bytes, but manifest.json "
            f"says") in caplog.text
    rows = [json.loads(line) for line in (copy / "metrics.jsonl").read_text().splitlines()]
    original = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # resumed at 2; 3 and 4 once each
    assert [r["loss"] for r in rows] == [r["loss"] for r in original]
    assert runs.verify(step_dir(copy, 4))  # rewritten whole


def test_truncated_files_without_a_manifest_are_one_line_errors(run, tmp_path, capsys, monkeypatch):
    """Checkpoints from before manifests load; their damaged files are named, not tracebacks."""
    copy = copy_of(run, tmp_path)
    for step in (2, 4):
        (step_dir(copy, step) / "manifest.json").unlink()
    assert runs.verify(step_dir(copy, 4)) is False
    assert all(torch.equal(a, b) for a, b in zip(load_model(copy).state_dict().values(),
                                         load_model(run).state_dict().values()))
    safetensors = step_dir(copy, 4) / "model.safetensors"
    safetensors.write_bytes(safetensors.read_bytes()[:5000])
    # Each reader names it in one line; pretrain before its data loads (minutes, and log lines, on a real corpus).
    with monkeypatch.context() as patch:
        patch.setattr(sys.modules["bertforge.training.pretrain"], "resolved_data",
                      lambda *args: pytest.fail("the data loaded before the weights were read"))
        for argv in (["export", str(copy), str(tmp_path / "hf")],
                     ["pretrain", "--resume", str(step_dir(copy, 4)), "--steps", "6", "--no-progress"],
                     run_args(tmp_path, "init", 2, "--init", str(copy))):
            assert main(argv) == 2
            err = capsys.readouterr().err
            assert err.startswith(f"error: {safetensors}: not a readable safetensors file (truncated or edited?)"), err
            assert err.count("\n") == 1, err
    for name in ("trainer.pt", "optimizer.pt"):
        target = step_dir(copy, 2) / name
        target.write_bytes(target.read_bytes()[:300])
        assert main(["pretrain", "--resume", str(step_dir(copy, 2)), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {target}: not a readable checkpoint file (truncated or edited?)"), err
        shutil.copyfile(step_dir(run, 2) / name, target)


def test_temporaries_of_interrupted_saves_are_removed_at_the_next_start(run, tmp_path):
    copy = copy_of(run, tmp_path)
    checkpoints = copy / "checkpoints"
    shutil.copytree(step_dir(copy, 4), checkpoints / ".step_00000006.tmp-abc123")
    (checkpoints / ".step_00000008.old-x_y").mkdir()
    # Killed between the two renames of a replacement: the old copy is put back.
    (checkpoints / ".step_00000004.old-k9").mkdir()
    os.replace(step_dir(copy, 4), checkpoints / ".step_00000004.old-k9" / "step_00000004")
    assert [p.name for p in runs.complete_checkpoints(copy)] == ["step_00000002"]
    assert main(["pretrain", "--resume", str(copy), "--steps", "5", "--no-progress"]) == 0
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_00000002", "step_00000004", "step_00000005"]


def test_non_finite_weights_are_never_saved(run, tmp_path):
    model = load_model(run)
    assert weights.first_nonfinite(model) is None
    with torch.no_grad():
        model.bert.encoder.layer[1].output.dense.weight[3, 7] = float("nan")
    assert weights.first_nonfinite(model) == "bert.encoder.layer.1.output.dense.weight"
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    from bertforge.training.engine import Engine
    from bertforge.training.pretrain import training_loss

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    engine = Engine(model, optimizer, scheduler, training_loss, "fp32", 0.0)
    with pytest.raises(runs.CheckpointError, match=r"step 7: weight bert.encoder.layer.1.output.dense.weight "
                                                   r"is not finite \(NaN or infinity\); refusing to write"):
        ckpt.save(tmp_path, 7, engine, ckpt.RunFiles(load_config("tiny").to_yaml()), {}, keep=0, parallel="none")
    assert not (tmp_path / "checkpoints").exists() or not list((tmp_path / "checkpoints").iterdir())


def test_rotation_keeps_the_checkpoint_just_written(tmp_path):
    """A run resumed from step 2 of a run that went to 8 keeps its own new step 4 with keep=1."""
    checkpoints = tmp_path / "checkpoints"
    for step in (2, 8):
        with atomic_directory(checkpoints / f"step_{step:08d}") as tmp:
            for name in ("model.safetensors", "trainer.pt", "config.yaml", "optimizer.pt"):
                (tmp / name).write_text("x")
    with atomic_directory(checkpoints / "step_00000004") as tmp:
        for name in ("model.safetensors", "trainer.pt", "config.yaml", "optimizer.pt"):
            (tmp / name).write_text("x")
    ckpt._keep_newest(tmp_path, 1, checkpoints / "step_00000004")
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_00000004", "step_00000008"]


def test_metrics_after_the_resumed_step_are_dropped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 0, "split": "eval"}, {"step": 1}, {"step": 2}, {"step": 2, "split": "eval"}, {"step": 3}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "lo')  # torn by a kill
    assert truncate_metrics(path, 2) == 2
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows[:4]
    assert truncate_metrics(path, -1) == 4 and path.read_text() == ""


def test_saved_config_has_absolute_paths_and_resumes_from_elsewhere(run, tmp_path, monkeypatch):
    vocab = tmp_path / "vocab.txt"
    monkeypatch.chdir(tmp_path)
    cfg = load_config("tiny", [("data.vocab", "vocab.txt"), ("data.input", "corpus/*.txt"),
                               ("checkpoint.init", "../x")])
    from bertforge.training.pretrain import absolute_paths

    cfg = replaced(cfg, absolute_paths(cfg.data, cfg.log, cfg.checkpoint))
    assert cfg.data.vocab == str(vocab) and cfg.data.input == str(tmp_path / "corpus" / "*.txt")
    assert cfg.checkpoint.init == str(tmp_path.parent / "x") and cfg.data.eval_input == ""


def test_a_run_that_fails_before_its_first_step_leaves_no_directory(tmp_path, capsys):
    assert main(run_args(tmp_path, "bad", 4, "--train.micro_batch_size", "3")) == 2
    assert capsys.readouterr().err.startswith("error: train.global_batch_size=8 is not a multiple")
    assert list(tmp_path.iterdir()) == []


def needs_root(reason: str):
    return pytest.mark.skipif(os.geteuid() != 0, reason=f"{reason} needs root (mount)")


@pytest.fixture
def small_tmpfs(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    with tmpfs(mount, "8m"):
        yield mount


@needs_root("a small tmpfs")
def test_a_full_disk_during_a_checkpoint_is_one_line(small_tmpfs, capsys):
    """An 8 MiB tmpfs: BERT-tiny's first checkpoint (50.7 MiB) does not fit. About 3 s."""
    assert main(run_args(small_tmpfs, "full", 2)) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    final = small_tmpfs / "full" / "checkpoints" / "step_00000002"
    assert err == (f"error: cannot write {final}: the disk is full (it needs 50.7 MiB, 8.0 MiB free on "
                   f"{final.parent} after removing the partial write)")
    assert list((final.parent).iterdir()) == []  # the temporary is gone


@needs_root("a read-only bind mount")
def test_a_read_only_output_directory_is_one_line(run, tmp_path, capsys):
    copy = copy_of(run, tmp_path)
    checkpoints = copy / "checkpoints"
    assert subprocess.run(["mount", "--bind", str(checkpoints), str(checkpoints)], check=False).returncode == 0
    try:
        assert subprocess.run(["mount", "-o", "remount,bind,ro", str(checkpoints)], check=False).returncode == 0
        assert main(["pretrain", "--resume", str(copy), "--steps", "5", "--no-progress"]) == 2
    finally:
        subprocess.run(["umount", "-l", str(checkpoints)], check=False)
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: cannot write {checkpoints / 'step_00000005'}: {checkpoints} is not writable (read-only file system)")


KILL_DURING_SAVE = """
import os, random, signal, sys, time
import torch
torch.set_num_threads(1)
from bertforge.cli import main
root, trials, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = random.Random(seed)
args = ["pretrain", "--config", "tiny", "--data.synthetic", "--steps", "100000", "--no-progress",
        "--run-dir", root, "--name", "run", "--data.seq_len", "16", "--data.max_predictions", "2",
        "--train.micro_batch_size", "2", "--train.global_batch_size", "2", "--train.schedule", "constant",
        "--log.every", "1", "--log.tensorboard", "false", "--execution.threads", "1",
        "--checkpoint.every", "1", "--checkpoint.keep", "2", "--resume", "auto"]
ckpts = os.path.join(root, "run", "checkpoints")


def saved():
    return sorted(os.listdir(ckpts)) if os.path.isdir(ckpts) else []


for trial in range(trials):
    pid = os.fork()
    if pid == 0:
        os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
        os._exit(main(args))
    if trial == 0:  # the first run lives until its first checkpoint, however loaded the machine, and then a bit
        deadline = time.monotonic() + 900  # a hang guard (conftest.HANG_GUARD_S), not a verdict on speed
        while not any(name.startswith("step_") for name in saved()) and time.monotonic() < deadline:
            time.sleep(0.02)
    time.sleep(rng.uniform(0.0, 1.0) if trial == 0 else rng.uniform(1.0, 2.5))
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    print(trial, saved(), flush=True)
"""


@pytest.mark.slow
def test_kill_during_save_never_leaves_a_false_checkpoint(tmp_path):
    """10 trials: a run saving every step is killed (SIGKILL) at a random moment (seeded: the first run
    0-1 s after its first checkpoint, each later one, resuming the last, 1-2.5 s after it starts); every
    step directory that looks complete verifies and loads, and the next start removes the temporaries.
    About 20 s."""
    result = subprocess.run([sys.executable, "-c", KILL_DURING_SAVE, str(tmp_path), "10", "11"], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert len(lines) == 10
    run = tmp_path / "run"
    complete = runs.complete_checkpoints(run)
    assert complete, result.stdout
    for step in complete:
        assert runs.verify(step) is True
        load_model(step)
        assert ckpt.read_trainer_state(step)["step"] == int(step.name.removeprefix("step_"))
    newest = int(complete[-1].name.removeprefix("step_"))
    assert main(run_args(tmp_path, "run", newest + 1, "--data.seq_len", "16", "--data.max_predictions", "2",
                         "--train.micro_batch_size", "2", "--train.global_batch_size", "2",
                         "--train.schedule", "constant", "--checkpoint.keep", "2", "--resume", "auto")) == 0
    left = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert not [name for name in left if name.startswith(".")], left
    assert left[-1] == f"step_{newest + 1:08d}"
    print("\n".join(lines))  # which trials left temporaries, for a person reading -s


def test_remove_temporaries_leaves_everything_else(tmp_path):
    for name in (".a.tmp-1", ".b.old-2", "step_1", ".hidden", "x.tmp-3"):
        (tmp_path / name).mkdir()
    assert sorted(p.name for p in remove_temporaries(tmp_path)) == [".a.tmp-1", ".b.old-2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hidden", "step_1", "x.tmp-3"]



# ------------------------------------------------------------ fuzz of the checkpoint reader

FUZZ_CASES = 200
CHECKPOINT_FILES = ("model.safetensors", "optimizer.pt", "trainer.pt", "config.yaml")
ODD_VALUES = [None, True, 0, -1, 7, 2**40, 10**30, 1.5, float("inf"), float("nan"), "", "x", "12", [], [1], {},
              {"a": 1}]
HUGE_MODEL_VALUES = [10**5, 10**7, 2**31, 2**40, 2**62]  # shapes that would allocate without bound


def _replace(path: Path, data: bytes) -> None:
    path.unlink(missing_ok=True)  # the copy's files are hard links to the original: never write through one
    path.write_bytes(data)


def _mutate_bytes(path: Path, original: Path, rng) -> str:
    kind = rng.choice(["delete", "truncate", "flip", "random", "other"])
    data = path.read_bytes()
    if kind == "delete":
        path.unlink()
    elif kind == "truncate":
        cut = rng.choice([0, 1, 8, rng.randrange(len(data)), rng.randrange(len(data)), len(data) - 1])
        _replace(path, data[:cut])
    elif kind == "flip":
        flipped = bytearray(data)
        window = rng.choice([64, 4096, len(data)])  # the headers of the files, or anywhere
        for _ in range(rng.randint(1, 8)):
            flipped[rng.randrange(min(window, len(data)))] ^= rng.randrange(1, 256)
        _replace(path, bytes(flipped))
    elif kind == "random":
        _replace(path, rng.randbytes(rng.choice([0, 8, 100, 5000])))
    else:
        other = rng.choice([name for name in (*CHECKPOINT_FILES, "manifest.json") if name != path.name])
        path.unlink()
        os.link(original / other, path)
        kind = f"other={other}"
    return f"{kind} {path.name}"


def _mutate_config(path: Path, rng) -> str:
    import yaml

    kind = min(rng.randrange(8), 5)
    if kind == 0:
        _replace(path, rng.choice([b"model: [1", b"- a\n- b\n", b"7\n", b"\xff\xfe", b"{{{", b"model: &a [*a]\n",
                                   b"model:\n  vocab_size: !!python/name:os.system\n"]))
        return "config garbage"
    data = yaml.safe_load(path.read_text())
    section = rng.choice(sorted(data))
    key = rng.choice(sorted(data[section]))
    if kind == 1:
        data[section][key] = rng.choice(ODD_VALUES)
    elif kind == 2:
        del data[section][key]
    elif kind == 3:
        data[section]["unknown_key"] = 1
    elif kind == 4:
        data[section] = rng.choice(ODD_VALUES)
    else:
        key = rng.choice(["vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size",
                          "max_position_embeddings", "type_vocab_size", "num_attention_heads"])
        section, data["model"][key] = "model", rng.choice(HUGE_MODEL_VALUES)
    _replace(path, yaml.safe_dump(data).encode())
    return f"config {kind} {section}.{key}"


def _mutate_manifest(path: Path, original: Path, rng) -> str:
    text = path.read_text()
    doc = json.loads(text)
    entries = doc["files"]
    kind = min(rng.randrange(12), 9)  # paths outside more often
    entry = rng.choice(entries)
    if kind == 0:
        _replace(path, text[:rng.randrange(len(text))].encode())
        return "manifest truncated"
    if kind == 1:
        _replace(path, rng.choice([b"[" * 100_000, b"{\"files\": " + b"[" * 100_000, b"\xff", b"null"]))
        return "manifest garbage"
    if kind == 2:
        doc[rng.choice(["files", "root"])] = rng.choice(ODD_VALUES)
        doc = doc["root"] if "root" in doc else doc
    elif kind == 3:
        entries[entries.index(entry)] = rng.choice(ODD_VALUES)
    elif kind == 4:
        field = rng.choice(["path", "size", "crc32c"])
        if rng.random() < 0.2:
            del entry[field]
        else:
            entry[field] = rng.choice(ODD_VALUES)
    elif kind == 5:
        entry["size"] += rng.choice([-1, 1, 2**40, -(2**40)])
    elif kind == 6:
        entry["crc32c"] = rng.choice(["00000000", entry["crc32c"][::-1], entry["crc32c"].upper(), ""])
    elif kind == 7:
        entries.remove(entry)
    elif kind == 8:  # the same file listed under many names: reading it again and again
        target = rng.choice(CHECKPOINT_FILES)
        entries += [{**next(e for e in entries if e["path"] == target), "path": "./" * k + target}
                    for k in range(1, 200)]
    else:  # paths outside the step directory, with the right size and checksum of what they name
        target = rng.choice(CHECKPOINT_FILES)
        name = rng.choice([os.path.relpath(original / target, path.parent), str(original / target),
                           f"../{original.name}/{target}", "..", ".", "", "/dev/zero", "/proc/self/mem",
                           f"./{target}", f"sub/../{target}", "a\x00b", target, "extra.bin"])
        entries.append({**next(e for e in entries if e["path"] == target), "path": name})
        kind = f"entry {name!r}"
    _replace(path, json.dumps(doc).encode())
    return f"manifest {kind}"


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _check_loads(failures: list[str], what: str, copy: Path, may_differ: bool, stage: str, load) -> None:
    """Run ``load`` (True when it loaded the original); note in ``failures`` what it should not have done."""
    try:
        same = load()
    except (runs.CheckpointError, ConfigError) as err:
        message = str(err)
        if "\n" in message or str(copy) not in message:
            failures.append(f"{what}: {stage}: message {message!r}")
    except Exception as err:  # any other exception is a bug
        failures.append(f"{what}: {stage}: {type(err).__name__}: {str(err)[:300]}")
    else:
        if not same and not may_differ:
            failures.append(f"{what}: {stage}: loaded something other than the original")


@pytest.mark.slow
def test_fuzzed_checkpoints_load_whole_or_are_one_line_errors(run, tmp_path, capsys, monkeypatch):
    """200 seeded cases, about 12 s on 2 cores: a copy (hard links) of a real step directory with one
    mutation (a file deleted, truncated, with bytes flipped, replaced by random bytes or another file;
    manifest.json edited: bad JSON, wrong types and sizes, entries dropped or added, paths with ``..``,
    absolute or repeated; config.yaml edited: garbage, wrong types, huge model shapes), with its
    manifest or without (an old checkpoint: the loaders' own checks must hold), loaded by
    ``load_model`` and by what ``--resume`` runs (every 10th also by ``export``). Each either loads
    exactly the original weights (and optimizer and trainer state) or raises a one-line
    CheckpointError / ConfigError naming a path in the copy; any other exception is a bug. Without a
    manifest, flipped bytes inside tensors cannot be told from training and may load. The verifier
    reads nothing outside the copy and no file twice."""
    import random

    from bertforge.models.bert import BertForPreTraining
    from bertforge.training.engine import Engine
    from bertforge.training.optim import build_optimizer, build_scheduler
    from bertforge.training.pretrain import training_loss

    original = step_dir(run, 4)
    cfg = weights.read_config(original)
    saved = load_model(original).state_dict()
    model = BertForPreTraining(cfg.model)
    optimizer = build_optimizer(model, cfg.train)
    engine = Engine(model, optimizer, build_scheduler(optimizer, cfg.train, cfg.train.steps), training_loss,
                    "fp32", 0.0)
    python_rng = random.getstate()
    with torch.random.fork_rng():
        ckpt.resume(original, engine)
        trainer = ckpt.read_trainer_state(original)
        optimizer_state = optimizer.state_dict()
        case_dir = tmp_path

        crc32c = runs.crc32c

        read: set[Path] = set()  # by one call of the verifier
        verify = runs.verify

        def verify_once(*args, **kwargs) -> bool:
            read.clear()
            return verify(*args, **kwargs)

        def crc32c_inside(path: Path) -> str:
            resolved = Path(path).resolve()
            assert resolved.is_relative_to(case_dir.resolve()), f"verify read {path}"
            assert resolved not in read, f"verify read {path} twice"
            read.add(resolved)
            return crc32c(path)

        monkeypatch.setattr(runs, "crc32c", crc32c_inside)
        for module in (runs, weights, load, ckpt):  # each calls the verifier by its own name
            monkeypatch.setattr(module, "verify", verify_once)
        # Every load overwrites the initial weights (a weight left as initialised is a failure either way):
        # skipping their random init halves the time of a case.
        monkeypatch.setattr(torch.nn.init, "normal_", lambda tensor, *args, **kwargs: tensor)

        failures: list[str] = []
        for case in range(FUZZ_CASES):
            rng = random.Random(case)
            case_dir = tmp_path / f"case{case}"
            copy = case_dir / original.name
            copy.mkdir(parents=True)
            for file in original.iterdir():
                os.link(file, copy / file.name)
            target = rng.choice([*CHECKPOINT_FILES, "manifest.json"])
            # A config edit with the manifest is always its checksum: test the config's own checks more.
            keep_manifest = target == "manifest.json" or rng.random() < (0.2 if target == "config.yaml" else 0.6)
            if not keep_manifest:
                (copy / "manifest.json").unlink()
            if target == "manifest.json" and rng.random() < 0.8:
                what = _mutate_manifest(copy / target, original, rng)
            elif target == "config.yaml" and rng.random() < 0.5:
                what = _mutate_config(copy / target, rng)
            else:
                what = _mutate_bytes(copy / target, original, rng)
            what = f"case {case}: {what}{'' if keep_manifest else ' (no manifest)'}"
            may_differ = not keep_manifest and what.split()[2] == "flip"  # no checksum to tell

            check = functools.partial(_check_loads, failures, what, copy, may_differ)
            check("load_model", lambda copy=copy: _same(load_model(copy).state_dict(), saved))

            def resume(copy: Path = copy) -> bool:
                step = runs.find_checkpoint(copy)
                runs.verify(step)
                weights.check_model_config(weights.read_config(step).model, cfg.model, step)
                state = ckpt.resume(step, engine, verified=True)
                return (_same(model.state_dict(), saved) and _same(optimizer.state_dict(), optimizer_state)
                        and _same(state, trainer))

            check("resume", resume)
            if case % 10 == 0:
                out = case_dir / "hf"
                status = main(["export", str(copy), str(out)])
                err = capsys.readouterr().err
                if status == 2:
                    if not (err.startswith("error: ") and err.count("\n") == 1 and str(copy) in err):
                        failures.append(f"{what}: export: {err!r}")
                elif status != 0:
                    failures.append(f"{what}: export: status {status}")
            shutil.rmtree(case_dir)
    random.setstate(python_rng)
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures)
