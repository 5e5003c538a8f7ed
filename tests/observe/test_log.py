"""observe/log.py: MetricsLogger and ProgressBar close on every exit path; errors are ConfigErrors."""

from __future__ import annotations

import io
import json
import sys
import warnings

import pytest
from conftest import wait_until
from rich.console import Console

import bertforge.observe.log
from bertforge.config import ConfigError, LogConfig
from bertforge.observe.log import MetricsLogger, ProgressBar, Stage, console_logging, pass_progress, rounded


def config(wandb: bool = False) -> LogConfig:
    return LogConfig(tensorboard=False, wandb=wandb)


def test_metrics_logger_without_wandb_raises_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(ConfigError) as info:
        MetricsLogger(tmp_path, config(wandb=True))
    assert str(info.value) == "--log.wandb needs the wandb package (pip install wandb)"
    assert not isinstance(info.value, SystemExit)


def test_metrics_logger_closes_what_it_opened_when_init_fails(tmp_path, monkeypatch):
    opened = []
    real_open = open

    def recording_open(*args, **kwargs):
        f = real_open(*args, **kwargs)
        opened.append(f)
        return f

    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.setattr(bertforge.observe.log, "open", recording_open, raising=False)  # observe/log.py's `open` only
    with pytest.raises(ConfigError):
        MetricsLogger(tmp_path, config(wandb=True))
    assert [f.name for f in opened] == [str(tmp_path / "metrics.jsonl")]
    assert opened[0].closed


def test_metrics_logger_is_a_context_manager(tmp_path):
    with MetricsLogger(tmp_path, config()) as logger:
        logger.log({"step": 1, "loss": 0.25, "lr": 1.0e-4})
        logger.log({"step": 1, "split": "eval", "mlm_accuracy": 0.5})
    assert logger.jsonl is None
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "loss": 0.25, "lr": 1.0e-4}, {"step": 1, "split": "eval", "mlm_accuracy": 0.5}]
    logger.close()  # idempotent
    logger.log({"step": 2, "loss": 0.1})  # after close: dropped, not an error
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


def test_metrics_keep_significant_digits_and_tensorboard_gets_every_digit(tmp_path):
    """metrics.jsonl keeps 7 significant digits: a learning rate of 4.87e-7 is 4.87e-7 (6 decimal
    places wrote 0.0, for TensorBoard and wandb too); TensorBoard gets the values as logged."""
    pytest.importorskip("tensorboard")
    import numpy as np
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = config()
    cfg.tensorboard = True
    row = {"step": 1, "loss": 8.123456789, "lr": 4.87e-7, "seq_per_s": 12345.678901, "grad_norm": 1.234567891e-9}
    with MetricsLogger(tmp_path, cfg) as logger:
        logger.log(row)
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {
        "step": 1, "loss": 8.123457, "lr": 4.87e-7, "seq_per_s": 12345.68, "grad_norm": 1.234568e-9}
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    for key in ("loss", "lr", "seq_per_s", "grad_norm"):  # TensorBoard keeps float32
        assert [(e.step, e.value) for e in events.Scalars(f"train/{key}")] == [(1, np.float32(row[key]))], key


def test_metrics_logger_closes_when_the_block_raises(tmp_path):
    with pytest.raises(RuntimeError, match="boom"), MetricsLogger(tmp_path, config()) as logger:
        jsonl = logger.jsonl
        logger.log({"step": 3, "loss": 1.5})
        raise RuntimeError("boom")
    assert jsonl.closed and logger.jsonl is None
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 3, "loss": 1.5}


def test_disabled_metrics_logger_writes_nothing(tmp_path):
    with MetricsLogger(tmp_path, config(wandb=True), enabled=False) as logger:
        logger.log({"step": 1, "loss": 0.5})
    assert list(tmp_path.iterdir()) == []


def terminal() -> Console:
    return Console(file=io.StringIO(), force_terminal=True, width=100)


def plain() -> Console:
    """A console on a file, as under Slurm, nohup or ``| tee``."""
    return Console(file=io.StringIO(), force_terminal=False, width=40)


def test_progress_bar_is_a_context_manager():
    out = terminal()
    with ProgressBar(total=10, start=2, enabled=True, out=out) as bar:
        progress = bar.progress
        assert progress is not None and progress.live.is_started
        bar.update(5, "loss 1.0")
        assert progress.tasks[0].completed == 5
    assert bar.progress is None and not progress.live.is_started
    bar.close()  # idempotent
    bar.update(6)  # after close: nothing to update
    bar.print("after the bar")
    assert "after the bar" in out.file.getvalue()


def test_progress_bar_stops_when_the_block_raises():
    with pytest.raises(KeyboardInterrupt), ProgressBar(total=4, start=0, enabled=True, out=terminal()) as bar:
        progress = bar.progress
        raise KeyboardInterrupt
    assert not progress.live.is_started and bar.progress is None


def test_progress_bar_off_the_main_rank_shows_nothing(capsys):
    with ProgressBar(total=4, start=0, enabled=True, main=False) as bar:
        assert bar.progress is None
        bar.print("hidden")
    assert capsys.readouterr().err == ""


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.smoke
def test_off_a_terminal_steps_are_plain_lines_at_most_every_interval():
    out, clock = plain(), FakeClock()
    with ProgressBar(total=100, start=0, enabled=True, label="pretrain", every_s=30, clock=clock, out=out) as bar:
        assert bar.progress is None and bar.live
        for step in range(1, 101):
            clock.now += 2.0  # 2 s a step, a status every 5: a line every 15 steps
            bar.update(step, f"loss {1 / step:.3f} 8 seq/s " if step % 5 == 0 or step == 1 else None)
    assert out.file.getvalue().splitlines() == [
        "pretrain step 1/100 loss 1.000 8 seq/s eta -:--:--",  # the first logged step at once, not yet paced
        "pretrain step 20/100 loss 0.050 8 seq/s eta 0:02:40",  # 38 s later: the first logged step past 30 s
        "pretrain step 35/100 loss 0.029 8 seq/s eta 0:02:10",  # 30 s after the one before
        "pretrain step 50/100 loss 0.020 8 seq/s eta 0:01:40",
        "pretrain step 65/100 loss 0.015 8 seq/s eta 0:01:10",
        "pretrain step 80/100 loss 0.013 8 seq/s eta 0:00:40",
        "pretrain step 95/100 loss 0.011 8 seq/s eta 0:00:10",
        "pretrain step 100/100 loss 0.010 8 seq/s eta 0:00:00",  # the last, 10 s after the one before
    ]


@pytest.mark.smoke
def test_the_eta_is_paced_by_the_steps_after_the_first():
    """Issue 41.7: a first step of 10 minutes (compilation, warm-up) and then 2 s a step read
    "eta 1:50:46"-like hours; the pace is timed from the first step's end."""
    out, clock = plain(), FakeClock()
    with ProgressBar(total=100, start=0, enabled=True, every_s=30, clock=clock, out=out) as bar:
        clock.now += 600.0
        bar.update(1, "loss 1.000")
        for step in range(2, 101):
            clock.now += 2.0
            bar.update(step, "loss 0.500" if step in (20, 100) else None)
    assert [line.split(" eta ")[1] for line in out.file.getvalue().splitlines()] == [
        "-:--:--",  # no pace yet
        "0:02:40",  # 19 steps in 38 s, 80 left (from the start: 638 s for 20 steps, 0:42:32)
        "0:00:00"]


def test_off_a_terminal_a_pass_has_a_start_and_an_end_line():
    out, clock = plain(), FakeClock()
    bar = ProgressBar(total=10, start=4, enabled=True, clock=clock, out=out)
    with bar.stage("step 4: eval", "512 sequences"):
        clock.now += 12.25
    assert out.file.getvalue().splitlines() == [
        "step 4: eval: 512 sequences", "step 4: eval: done 512 sequences in 12.2 s"]


def test_on_a_terminal_or_without_progress_a_pass_prints_nothing():
    for bar in (ProgressBar(total=10, start=0, enabled=True, out=terminal()),
                ProgressBar(total=10, start=0, enabled=False, out=plain())):
        with bar.stage("eval", "8 sequences"):
            bar.update(10, "loss 1.0")
        bar.close()
        assert "eval" not in bar.console.file.getvalue() and "step 10" not in bar.console.file.getvalue()
        assert bar.live == (bar.progress is not None)


def test_off_a_terminal_a_pass_prints_its_batches_at_most_every_interval():
    out, clock = plain(), FakeClock()
    with Stage("eval ckpt", "80 sequences", every_s=30, clock=clock, out=out):
        with pass_progress(10) as advance:
            for _ in range(10):
                clock.now += 8.0  # 8 s a batch: a line every 4 batches
                advance(1)
    assert out.file.getvalue().splitlines() == [
        "eval ckpt: 80 sequences",
        "eval ckpt: batch 4/10 0.1 batches/s eta 0:00:48",  # 32 s in
        "eval ckpt: batch 8/10 0.1 batches/s eta 0:00:16",
        "eval ckpt: done 80 sequences in 80.0 s",  # the last batch: the end line says it
    ]


def test_a_pass_outside_a_stage_or_off_the_main_rank_or_disabled_shows_nothing(capsys):
    out, clock = plain(), FakeClock()
    with pass_progress(3) as advance:
        clock.now += 100
        advance(3)
    for stage in (Stage("eval", "3", main=False, every_s=1, clock=clock, out=out),
                  Stage("eval", "3", enabled=False, every_s=1, clock=clock, out=out)):
        with stage, pass_progress(3) as advance:
            clock.now += 100
            advance(1)
    assert out.file.getvalue() == "" and capsys.readouterr().err == ""


def test_the_training_bars_interval_and_console_reach_its_passes():
    out, clock = plain(), FakeClock()
    bar = ProgressBar(total=10, start=4, enabled=True, every_s=5, clock=clock, out=out)
    with bar.stage("step 4: dev eval", "dev set"), pass_progress(4) as advance:
        for _ in range(4):
            clock.now += 3.0
            advance(1)
    assert out.file.getvalue().splitlines() == [
        "step 4: dev eval: dev set", "step 4: dev eval: batch 2/4 0.3 batches/s eta 0:00:06",
        "step 4: dev eval: done dev set in 12.0 s"]


def test_on_a_terminal_a_pass_is_a_task_of_the_training_bar_while_it_runs():
    with ProgressBar(total=10, start=0, enabled=True, out=terminal()) as bar:
        progress = bar.progress
        with bar.stage("step 0: eval", "8 sequences"), pass_progress(4) as advance:
            advance(3)
            assert [(t.description, t.total, t.completed) for t in progress.tasks[1:]] == [("step 0: eval", 4, 3)]
        assert len(progress.tasks) == 1  # gone with the pass


def test_on_a_terminal_without_a_training_bar_a_pass_has_its_own_bar():
    out = terminal()
    with Stage("squad predict", "3 questions", out=out), pass_progress(5) as advance:
        advance(2)
    shown = out.file.getvalue()
    assert "squad predict" in shown and "0/5" in shown and "\x1b[?25h" in shown  # drawn, then the cursor back


# ------------------------------------------------------------ Weights & Biases, run offline

def wandb_records(path) -> list:
    """The records of a run's ``.wandb`` file, parsed with wandb's own protobuf schema. The file is
    a LevelDB-style log (a 7-byte ``:W&B`` header, 32 KiB blocks, records of a crc32, a length and a
    type: whole, first, middle, last); wandb 0.31 no longer ships a Python reader for it."""
    import struct
    import zlib

    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        left = block - pos % block
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (length, kind) == (0, 0):  # the padding at a block's end
            pos += left
            continue
        payload = data[pos + 7:pos + 7 + length]
        assert zlib.crc32(bytes([kind]) + payload) == crc
        pos += 7 + length
        pending = payload if kind in (1, 2) else pending + payload
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def test_wandb_offline_run_holds_the_metrics_config_and_summary(tmp_path, monkeypatch):
    """--wandb with WANDB_MODE=offline: the run wandb writes under the run directory holds every
    logged step's metrics (unrounded: metrics.jsonl's to 7 digits), the resolved config, and the run's
    end summary."""
    pytest.importorskip("wandb")
    from bertforge.cli import main

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "r"
    assert main(["pretrain", "--config", "tiny", "--data.synthetic", "--steps", "3", "--no-progress", "--run-dir",
                 str(tmp_path), "--name", "r", "--data.seq_len", "32", "--data.max_predictions", "5",
                 "--train.micro_batch_size", "4", "--train.global_batch_size", "4", "--log.every", "1",
                 "--log.tensorboard", "false", "--wandb"]) == 0
    [path] = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    # wandb's service process writes the file; on a loaded machine its last records may land after
    # finish() returned (the test once read an empty file).
    def exited() -> bool:
        records = wandb_records(path)
        return bool(records) and records[-1].WhichOneof("record_type") == "exit"

    wait_until(exited, what="wandb's exit record")
    records = wandb_records(path)
    kinds = [r.WhichOneof("record_type") for r in records]
    assert kinds[0] == "header" and kinds[-1] == "exit"
    [header] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (header.display_name, header.project) == ("r", "bertforge")
    config = {item.key: json.loads(item.value_json) for item in header.config.update}
    assert config["train"]["lr"] == 1e-3 and config["model"]["hidden_size"] == 128
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [h["_step"] for h in history] == [row["step"] for row in logged] == [1, 2, 3]
    for h, row in zip(history, logged, strict=True):
        assert (rounded(h["train/loss"]), rounded(h["train/lr"])) == (row["loss"], row["lr"])
    assert any(h["train/loss"] != row["loss"] for h, row in zip(history, logged, strict=True))  # every digit
    summary = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
               for r in records if r.WhichOneof("record_type") == "summary" for i in r.summary.update}
    assert (summary["run/event"], summary["run/step"]) == ("end", 3)


ONLINE_SOFTMAX = ("\nOnline softmax is disabled on the fly since Inductor decides to\nsplit the reduction. Cut an "
                  "issue to PyTorch if this is an\nimportant use case and you want to speed it up with online\n"
                  "softmax.\n")


def test_a_command_shows_each_warning_once():
    """Inductor's online-softmax warning, as torch 2.11 words it, warned once per graph compiled, with the
    filters changed in between as torch's compiler changes them (Python then forgets it showed it):
    a command's console shows it once (the main job showed it four times), and another warning still."""
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("default")
        with console_logging("INFO"):
            for _ in range(4):
                warnings.warn(ONLINE_SOFTMAX, UserWarning, stacklevel=1)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DeprecationWarning)
            warnings.warn("a second warning", UserWarning, stacklevel=1)
        warnings.warn(ONLINE_SOFTMAX, UserWarning, stacklevel=1)  # after the command: Python's rules again
    assert [str(w.message) for w in shown] == [ONLINE_SOFTMAX, "a second warning", ONLINE_SOFTMAX]
