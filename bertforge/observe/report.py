"""``bertforge report RUN... --out DIR``: figures and one page for runs, from the files they wrote.

    bertforge report runs/A runs/B --out report/          # report/index.html and report/*.png

Reads each run directory's ``metrics.jsonl`` and ``config.yaml`` (and, where
present, ``squad.yaml`` and ``metadata.jsonl``); it needs matplotlib
(``pip install "bertforge[report]"``) and never imports torch, so it runs
beside a training job, on a run that is still going (a torn last line is
skipped) or on a laptop holding copies of the files.

The page holds a summary table (steps, wall time, best evaluation, final loss
and throughput, peak memory), the config values in which the runs differ
(these also label the runs in every legend), each run's environment (library
versions, device) and the figures, embedded, so that the page works wherever
DIR is copied: train and eval loss, masked-LM and NSP accuracy (with the
target of ``train.target_mlm_accuracy`` when a run has one) or SQuAD's exact
match and F1, learning rate, gradient norm, throughput and memory. Training
rows are lines, evaluations are markers; each run has one colour.
"""

from __future__ import annotations

import base64
import html
import json
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bertforge.config import ConfigError, load_yaml
from bertforge.fileio import refuse_live_runs

if TYPE_CHECKING:
    from matplotlib.figure import Figure as MplFigure

# Config keys that name a run rather than describe it: never a "difference".
IDENTITY_KEYS = ("log.name", "log.run_dir", "checkpoint.resume")


@dataclass
class Run:
    """What a run directory's files say."""

    path: Path
    label: str  # its directory name (its path where two runs share a name)
    train: list[dict[str, Any]]  # rows of training steps
    eval: list[dict[str, Any]]  # rows of evaluations
    config: dict[str, Any]  # flattened: "train.lr" -> 0.001
    metadata: list[dict[str, Any]] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return "squad" if "squad.doc_stride" in self.config or any("f1" in r for r in self.eval) else "pretrain"


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings as dotted keys; other values as they are."""
    if not isinstance(data, dict):
        return {prefix: data} if prefix else {}
    flat: dict[str, Any] = {}
    for key, value in data.items():
        flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSON Lines file; lines that are not (a torn last line) are skipped."""
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def load_run(path: Path) -> Run:
    """A run directory's metrics, config and metadata; a one-line error when it has no metrics.jsonl."""
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise ConfigError(f"{path}: no metrics.jsonl there; is it a bertforge run directory?")
    rows = read_rows(metrics)
    train = [r for r in rows if r.get("split", "train") == "train" and isinstance(r.get("step"), int)]
    evals = [r for r in rows if r.get("split") == "eval" and isinstance(r.get("step"), int)]
    config: dict[str, Any] = {}
    for name, prefix in (("config.yaml", ""), ("squad.yaml", "squad")):
        if (path / name).is_file():
            config.update(flatten(load_yaml(path / name), prefix))
    inside = str(path.resolve() / "_")[:-1]  # the run directory and a separator
    for key, value in config.items():  # paths inside the run differ between runs only by the run's name
        if isinstance(value, str) and value.startswith(inside):
            config[key] = "RUN/" + value[len(inside):]
    metadata = read_rows(path / "metadata.jsonl") if (path / "metadata.jsonl").is_file() else []
    return Run(path, path.name, train, evals, config, metadata)


def load_runs(paths: Sequence[str | Path]) -> list[Run]:
    runs = [load_run(Path(p)) for p in paths]
    names = [r.label for r in runs]
    for run, given in zip(runs, paths):
        if names.count(run.label) > 1:
            run.label = str(given)
    return runs


def differences(runs: Sequence[Run]) -> list[str]:
    """The config keys whose values are not the same in every run (a key one run lacks counts)."""
    keys = sorted({k for r in runs for k in r.config} - set(IDENTITY_KEYS))
    return [k for k in keys if len({json.dumps(r.config.get(k), sort_keys=True) for r in runs}) > 1]


def legend_labels(runs: Sequence[Run]) -> list[str]:
    """Each run's name and, with several runs, its values of the keys in which they differ."""
    keys = differences(runs) if len(runs) > 1 else []
    labels = []
    for run in runs:
        parts = [f"{k.split('.')[-1]}={_value(run.config.get(k))}" for k in keys[:4]]
        more = f", … ({len(keys) - 4} more)" if len(keys) > 4 else ""
        labels.append(f"{run.label}: {', '.join(parts)}{more}" if parts else run.label)
    return labels


def _value(value: Any) -> str:
    """A config value for a legend or table: "—" for a key the run lacks, "" shown as such."""
    if value is None:
        return "—"
    return f"{value:g}" if isinstance(value, float) else str(value) if value != "" else '""'


# ------------------------------------------------------------------ summary


def wall_time(run: Run) -> float | None:
    """Seconds of training: the last ``elapsed_s`` of each (re)start, added up."""
    total, last = 0.0, None
    for row in run.train:
        elapsed = row.get("elapsed_s")
        if not isinstance(elapsed, (int, float)):
            continue
        if last is not None and elapsed < last:  # a restart: elapsed counts from 0 again
            total += last
        last = elapsed
    if last is not None:
        return total + last
    ends = [m["wall_s"] for m in run.metadata if m.get("event") == "end" and "wall_s" in m]
    return sum(ends) if ends else None


def best_eval(run: Run) -> tuple[str, float, int] | None:
    """(metric, best value, its step): masked-LM accuracy, or F1 for SQuAD."""
    metric = "f1" if run.kind == "squad" else "mlm_accuracy"
    points = [(r[metric], r["step"]) for r in run.eval if isinstance(r.get(metric), (int, float))]
    if not points:
        return None
    value, step = max(points, key=lambda p: (p[0], -p[1]))
    return metric, value, step


def summary(run: Run) -> dict[str, Any]:
    """One row of the summary table (values, None where the run has none)."""
    throughput = [r["seq_per_s"] for r in run.train if isinstance(r.get("seq_per_s"), (int, float))]
    rows = [*run.train, *run.metadata]  # training rows, and the end rows that saw the evaluations too
    memory = [r["peak_rss_mb"] for r in rows if isinstance(r.get("peak_rss_mb"), (int, float))]
    gpu = [r["cuda_peak_mb"] for r in rows if isinstance(r.get("cuda_peak_mb"), (int, float))]
    best = best_eval(run)
    last_eval = run.eval[-1] if run.eval else {}
    return {
        "run": run.label, "kind": run.kind,
        "steps": run.train[-1]["step"] if run.train else None,
        "wall_s": wall_time(run),
        "final_loss": run.train[-1].get("loss") if run.train else None,
        "best_eval": best,
        "final_eval": {k: v for k, v in last_eval.items()
                       if k in ("mlm_accuracy", "nsp_accuracy", "exact_match", "f1", "loss")},
        # The median of the last five logged rows: one row's interval may hold an evaluation or a checkpoint.
        "final_seq_per_s": statistics.median(throughput[-5:]) if throughput else None,
        "peak_rss_mb": max(memory) if memory else None,
        "cuda_peak_mb": max(gpu) if gpu else None,
    }


# ------------------------------------------------------------------ figures


@dataclass
class Series:
    split: str  # "train" rows (a line) or "eval" rows (markers)
    key: str
    name: str = ""  # in the legend when a figure has several series


@dataclass
class Figure:
    file: str
    title: str
    ylabel: str
    series: list[Series]
    kinds: tuple[str, ...] = ("pretrain", "squad")
    log_y: bool = False  # when the values span more than a decade
    target: str = ""  # a config key holding a target value, drawn as a horizontal line


FIGURES = [
    Figure("loss.png", "Loss", "loss", [Series("train", "loss", "train"), Series("eval", "loss", "eval")]),
    Figure("mlm_loss.png", "Masked-LM and NSP loss (training)", "loss",
           [Series("train", "mlm_loss", "masked LM"), Series("train", "nsp_loss", "NSP")], kinds=("pretrain",)),
    Figure("mlm_accuracy.png", "Masked-LM accuracy (evaluation)", "accuracy",
           [Series("eval", "mlm_accuracy")], kinds=("pretrain",), target="train.target_mlm_accuracy"),
    Figure("nsp_accuracy.png", "Next-sentence accuracy (evaluation)", "accuracy",
           [Series("eval", "nsp_accuracy")], kinds=("pretrain",)),
    Figure("squad_scores.png", "SQuAD exact match and F1 (evaluation)", "score (%)",
           [Series("eval", "exact_match", "exact match"), Series("eval", "f1", "F1")], kinds=("squad",)),
    Figure("lr.png", "Learning rate", "learning rate", [Series("train", "lr")]),
    Figure("grad_norm.png", "Gradient norm (before clipping)", "global norm", [Series("train", "grad_norm")],
           log_y=True),
    Figure("throughput.png", "Throughput", "sequences / s", [Series("train", "seq_per_s")]),
    Figure("memory.png", "Peak memory (host resident set; CUDA allocated)", "MiB, peak so far",
           [Series("train", "peak_rss_mb", "host (resident)"), Series("train", "cuda_peak_mb", "CUDA (allocated)")]),
]
LINE_STYLES = ("-", "--", ":", "-.")  # one per series of a figure; the colour is the run's
MARKERS = ("o", "s", "^", "D")


def _points(run: Run, series: Series) -> tuple[list[int], list[float]]:
    rows = run.train if series.split == "train" else run.eval
    pairs = [(r["step"], float(r[series.key])) for r in rows
             if isinstance(r.get(series.key), (int, float)) and math.isfinite(r[series.key])]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def plot(spec: Figure, runs: Sequence[Run], labels: Sequence[str]) -> MplFigure | None:
    """One figure for ``runs`` (legend ``labels``); None when no run has its data."""
    from matplotlib.figure import Figure as MplFigure  # the Agg canvas, no pyplot state
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    chosen = [(run, label) for run, label in zip(runs, labels) if run.kind in spec.kinds]
    drawn = [(run, label, s, *_points(run, s)) for run, label in chosen for s in spec.series]
    drawn = [d for d in drawn if d[3]]
    if not drawn:
        return None
    fig = MplFigure(figsize=(8, 4.5), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    colours = {run.label: f"C{i % 10}" for i, (run, _) in enumerate(chosen)}
    several = len({(d[2].split, d[2].key) for d in drawn}) > 1
    for run, label, series, steps, values in drawn:
        index = spec.series.index(series)
        style, marker = LINE_STYLES[index % len(LINE_STYLES)], MARKERS[index % len(MARKERS)]
        name = f"{label} — {series.name}" if several and series.name else label
        if series.split == "eval":
            ax.plot(steps, values, linestyle=style, marker=marker, markersize=5, linewidth=1,
                    color=colours[run.label], label=name)
        else:
            ax.plot(steps, values, linestyle=style, linewidth=1.3, color=colours[run.label], label=name)
    targets = sorted({run.config[spec.target] for run, _ in chosen
                      if spec.target and isinstance(run.config.get(spec.target), (int, float))
                      and run.config[spec.target] > 0})
    for target in targets:
        ax.axhline(target, color="0.3", linestyle=(0, (4, 3)), linewidth=1, label=f"target {target:g}")
    values = [v for d in drawn for v in d[4]]
    if spec.log_y and min(values) > 0 and max(values) > 10 * min(values):  # a log scale helps over decades
        ax.set_yscale("log")
        # 0.5, not 5 × 10⁻¹; between powers of ten only 2 and 5 are labelled
        ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda value, _: f"{value:g}" if f"{value:.0e}"[0] in "25" else ""))
    ax.set_title(spec.title)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(spec.ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    return fig


def draw(spec: Figure, runs: Sequence[Run], labels: Sequence[str], path: Path) -> bool:
    """:func:`plot` into the PNG file ``path``; False (nothing written) when no run has the data."""
    fig = plot(spec, runs, labels)
    if fig is not None:
        fig.savefig(path)
    return fig is not None


# ------------------------------------------------------------------ the page


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min" if hours else f"{minutes} min {secs:02d} s" if minutes else f"{secs} s"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def summary_rows(runs: Sequence[Run]) -> list[list[str]]:
    rows = []
    for run in runs:
        s = summary(run)
        best = s["best_eval"]
        best_text = f"{best[0]} {best[1]:.4g} (step {best[2]})" if best else "—"
        final = ", ".join(f"{k} {v:.4g}" for k, v in s["final_eval"].items() if isinstance(v, (int, float)))
        memory = _fmt(s["peak_rss_mb"], 5) + (f" (CUDA {s['cuda_peak_mb']:.5g})" if s["cuda_peak_mb"] else "")
        rows.append([s["run"], s["kind"], _fmt(s["steps"]), _duration(s["wall_s"]), _fmt(s["final_loss"]),
                     best_text, final or "—", _fmt(s["final_seq_per_s"]), memory])
    return rows


STYLE = """body{font-family:system-ui,sans-serif;margin:2em;color:#222}
table{border-collapse:collapse;margin:0.5em 0 1.5em}td,th{border:1px solid #ccc;padding:0.3em 0.6em;text-align:left}
th{background:#f3f3f3}
figure{display:inline-block;vertical-align:top;width:min(800px,47%);margin:0 1em 1em 0}
img{max-width:100%;border:1px solid #eee}
code{background:#f6f6f6}"""


def render(runs: Sequence[Run], figures: Sequence[tuple[Figure, Path]]) -> str:
    """The HTML page, the figures embedded as data URIs."""
    parts = [f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>bertforge report: "
             f"{html.escape(', '.join(r.label for r in runs))}</title><style>{STYLE}</style></head><body>",
             f"<h1>bertforge report</h1><p>{len(runs)} run(s), made "
             f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC from <code>metrics.jsonl</code> and "
             f"<code>config.yaml</code>.</p>",
             "<h2>Summary</h2>",
             _table(["run", "kind", "steps", "wall time", "final loss", "best eval", "final eval",
                     "final seq/s", "peak memory MiB"], summary_rows(runs))]
    keys = differences(runs)
    if len(runs) > 1:
        parts.append("<h2>What differs</h2>")
        parts.append(_table(["config key", *[r.label for r in runs]],
                            [[k, *[_value(r.config.get(k)) for r in runs]] for k in keys])
                     if keys else "<p>The runs have the same config.</p>")
    environment = [(r, next((m for m in reversed(r.metadata) if m.get("event") == "start"), None)) for r in runs]
    fields = [k for k in ("bertforge", "torch", "python", "numpy", "transformers", "cuda", "cudnn", "device",
                          "device_name", "world_size", "threads", "precision", "parallel", "compile")
              if any(m and k in m for _, m in environment)]
    if fields:
        parts.append("<h2>Environment</h2>")
        parts.append(_table(["", *fields], [[r.label, *[_fmt((m or {}).get(k)) for k in fields]]
                                            for r, m in environment]))
    parts.append("<h2>Figures</h2>")
    for spec, path in figures:
        data = base64.b64encode(path.read_bytes()).decode("ascii")
        parts.append(f"<figure><img src=\"data:image/png;base64,{data}\" alt=\"{html.escape(spec.title)}\">"
                     f"<figcaption>{html.escape(spec.title)} ({html.escape(path.name)})</figcaption></figure>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def check_out_dir(out: Path, overwrite: bool) -> None:
    """Refuse a file, or a non-empty directory without ``overwrite`` (whose other files stay), and
    with it one that a live run writes in, below or above."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise ConfigError(f"--out {out}: not empty; pass --overwrite to write the report there")
        refuse_live_runs(out)


def write_report(paths: Sequence[str | Path], out: str | Path, overwrite: bool = False,
                 echo: Callable[[str], None] = print) -> Path:
    """Write ``out/index.html`` and the PNG figures for the run directories ``paths``; the page's path."""
    out = Path(out)
    check_out_dir(out, overwrite)
    runs = load_runs(paths)
    try:
        import matplotlib  # noqa: F401 - only to name the missing package
    except ImportError:
        raise ConfigError('bertforge report needs matplotlib: pip install "bertforge[report]"') from None
    out.mkdir(parents=True, exist_ok=True)
    labels = legend_labels(runs)
    figures = [(spec, out / spec.file) for spec in FIGURES if draw(spec, runs, labels, out / spec.file)]
    page = out / "index.html"
    page.write_text(render(runs, figures), encoding="utf-8")
    echo(f"report of {len(runs)} run(s): {page} ({len(figures)} figures)")
    return page
