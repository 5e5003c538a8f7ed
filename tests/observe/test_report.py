"""``bertforge report``: figures and one self-contained page from real runs' metrics.jsonl and config.yaml."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import yaml

from bertforge.cli import main
from bertforge.config import load_config

pytest.importorskip("matplotlib")

from bertforge.observe.report import FIGURES, differences, legend_labels, load_runs, plot, summary  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PRETRAIN_FIGURES = ["loss.png", "mlm_loss.png", "mlm_accuracy.png", "nsp_accuracy.png", "lr.png", "grad_norm.png",
                    "throughput.png", "memory.png"]


def pretrain_run(tmp: Path, name: str, lr: float) -> Path:
    """Tiny BERT on a slice of the built-in corpus: 4 steps, evaluated at steps 0, 2 and 4."""
    from bertforge.training.pretrain import pretrain

    pairs = {"data.vocab_size": 2000, "data.dupe_factor": 1, "data.seq_len": 64, "data.max_predictions": 10,
             "train.micro_batch_size": 8, "train.global_batch_size": 16, "train.steps": 4, "train.lr": lr,
             "train.eval_every": 2, "train.eval_batches": 2, "execution.threads": 2, "checkpoint.keep": 1,
             "log.every": 1, "log.progress": False, "log.tensorboard": False, "log.run_dir": str(tmp),
             "log.name": name}
    return Path(pretrain(load_config("pretrain_tiny", list(pairs.items())))["run_dir"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("runs")
    return pretrain_run(tmp, "a", 1e-3), pretrain_run(tmp, "b", 2e-3)


@pytest.fixture(scope="module")
def report(runs, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("report") / "out"
    assert main(["report", *map(str, runs), "--out", str(out)]) == 0
    return out


def metrics(run: Path) -> tuple[list[dict], list[dict]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "split" not in r], [r for r in rows if r.get("split") == "eval"]


@pytest.mark.slow
def test_figures_are_pngs_of_the_pretraining_curves(report):
    import matplotlib.image

    assert sorted(p.name for p in report.glob("*.png")) == sorted(PRETRAIN_FIGURES)  # no SQuAD scores
    for name in PRETRAIN_FIGURES:
        assert matplotlib.image.imread(report / name).shape == (450, 800, 4), name


def test_the_page_holds_the_summary_and_what_differs(runs, report):
    page = (report / "index.html").read_text()
    for run in runs:
        train, evals = metrics(run)
        best = max(evals, key=lambda r: (r["mlm_accuracy"], -r["step"]))
        assert f"mlm_accuracy {best['mlm_accuracy']:.4g} (step {best['step']})" in page
        assert f"<td>{train[-1]['loss']:.4g}</td>" in page  # final loss
        assert f"<td>{np.median([r['seq_per_s'] for r in train[-5:]]):.4g}</td>" in page
    assert "<td>train.lr</td><td>0.001</td><td>0.002</td>" in page
    assert page.count("data:image/png;base64,") == len(PRETRAIN_FIGURES)
    assert "src=\"loss.png\"" not in page  # embedded: the page works wherever it is copied


def test_the_legend_names_what_differs(runs):
    loaded = load_runs(runs)
    # The vocab each run trained is inside its own directory: the same file as far as a reader is concerned.
    assert loaded[0].config["data.vocab"] == loaded[1].config["data.vocab"] == "RUN/vocab.txt"
    assert differences(loaded) == ["train.lr"]
    assert legend_labels(loaded) == ["a: lr=0.001", "b: lr=0.002"]
    assert [summary(r)["steps"] for r in loaded] == [4, 4]


def test_a_target_line_when_the_config_has_one_and_a_torn_line_is_skipped(runs, tmp_path):
    copy = tmp_path / "a"
    shutil.copytree(runs[0], copy)
    config = yaml.safe_load((copy / "config.yaml").read_text())
    config["train"]["target_mlm_accuracy"] = 0.42
    (copy / "config.yaml").write_text(yaml.safe_dump(config))
    with open(copy / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "lo')  # a run still writing: its torn last line is left out
    loaded = load_runs([copy])
    assert [r["step"] for r in loaded[0].train] == [1, 2, 3, 4]
    spec = next(f for f in FIGURES if f.file == "mlm_accuracy.png")
    figure = plot(spec, loaded, legend_labels(loaded))
    assert figure is not None
    (axes,) = figure.axes
    lines = {line.get_label(): line for line in axes.get_lines()}
    assert list(lines) == ["a", "target 0.42"]
    assert list(lines["target 0.42"].get_ydata()) == [0.42, 0.42]
    _, evals = metrics(runs[0])
    assert list(lines["a"].get_xdata()) == [r["step"] for r in evals] == [0, 2, 4]  # markers at the evaluations


def test_a_squad_run_gets_its_loss_scores_and_profile(tmp_path):
    from bertforge.config import ModelConfig
    from bertforge.formats.hf import export_hf
    from bertforge.models.bert import BertForQuestionAnswering

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "paris", "is", "the", "capital", "of", "france", ".",
             "what", "?"]
    cfg = ModelConfig(vocab_size=len(words), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                      intermediate_size=32, max_position_embeddings=64)
    model = export_hf(BertForQuestionAnswering(cfg), tmp_path / "tiny", without_tokenizer=True)
    (model / "vocab.txt").write_text("\n".join(words) + "\n")
    context = "Paris is the capital of France ."
    dev = {"version": "1.1", "data": [{"title": "t", "paragraphs": [{"context": context, "qas": [
        {"id": "q1", "question": "What is the capital of France?", "answers": [{"text": "Paris", "answer_start": 0}]},
        {"id": "q2", "question": "Paris is the capital of what?", "answers": [{"text": "France", "answer_start": 24}]},
    ]}]}]}
    (tmp_path / "dev.json").write_text(json.dumps(dev))
    run = tmp_path / "squad"
    assert main(["squad", "train", "--init", str(model), "--train-file", str(tmp_path / "dev.json"),
                 "--predict-file", str(tmp_path / "dev.json"), "--out", str(run), "--data.seq_len", "32",
                 "--squad.max_query_length", "8", "--train.global_batch_size", "2", "--train.micro_batch_size", "2",
                 "--train.steps", "4", "--train.epochs", "0", "--train.eval_every", "2", "--log.every", "1",
                 "--no-progress", "--log.tensorboard", "false", "--profile", "1:3"]) == 0
    trace = json.loads((run / "profile" / "trace.json").read_text())
    assert sorted(e.get("name") for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")) == [
        "ProfilerStep#1", "ProfilerStep#2"]
    assert main(["report", str(run), "--out", str(tmp_path / "report")]) == 0
    assert sorted(p.name for p in (tmp_path / "report").glob("*.png")) == [
        "grad_norm.png", "loss.png", "lr.png", "memory.png", "squad_scores.png", "throughput.png"]
    (loaded,) = load_runs([run])
    evals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "split" in line]
    assert loaded.kind == "squad" and [r["step"] for r in loaded.eval] == [r["step"] for r in evals] == [2, 4]
    best = max(evals, key=lambda r: (r["f1"], -r["step"]))
    assert f"f1 {best['f1']:.4g} (step {best['step']})" in (tmp_path / "report" / "index.html").read_text()


def test_a_non_empty_out_is_refused_without_overwrite(runs, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["report", str(runs[0]), "--out", str(out)]) == 2
    assert capsys.readouterr().err == f"error: --out {out}: not empty; pass --overwrite to write the report there\n"
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    assert main(["report", str(runs[0]), "--out", str(out), "--overwrite"]) == 0
    assert (out / "index.html").is_file() and (out / "notes.txt").read_text() == "mine"


def test_a_directory_without_metrics_is_a_one_line_error(runs, tmp_path, capsys):
    assert main(["report", str(runs[0]), str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == (f"error: {tmp_path}: no metrics.jsonl there; is it a bertforge run "
                                       "directory?\n")
    assert not (tmp_path / "out").exists()


def test_the_report_command_does_not_import_torch(runs, tmp_path):
    code = f"""
        import sys
        from bertforge.cli import main
        assert main(["report", {str(runs[0])!r}, "--out", {str(tmp_path / "out")!r}]) == 0
        assert "torch" not in sys.modules, "torch was imported"
    """
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "index.html").is_file()


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    pytest.skip("no chromium to render the page (apt-get install chromium)")


def test_the_page_renders_in_a_headless_browser(report, tmp_path):
    """The page copied elsewhere without its PNG files: Chromium still shows every figure."""
    import matplotlib.image

    page = tmp_path / "copied" / "index.html"
    page.parent.mkdir()
    shutil.copyfile(report / "index.html", page)
    browser = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--user-data-dir=" + str(tmp_path / "p")]
    dom = subprocess.run([*browser, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr
    assert dom.stdout.count("<img ") == len(PRETRAIN_FIGURES) and "<td>train.lr</td>" in dom.stdout
    shot = tmp_path / "shot.png"
    done = subprocess.run([*browser, "--window-size=1400,4000", f"--screenshot={shot}", page.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and shot.is_file(), done.stderr
    pixels = (matplotlib.image.imread(shot)[..., :3] * 255).round()
    # matplotlib's first two colours (C0 blue, C1 orange: the two runs' curves) are on the screen.
    for colour in ((31, 119, 180), (255, 127, 14)):
        assert (np.abs(pixels - colour).sum(axis=-1) < 12).sum() > 200, colour
