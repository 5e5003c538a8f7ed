"""``bertforge bench --spec``: the shipped benchmarks.yml is valid, a spec really runs, bad specs are named."""

from __future__ import annotations

import json
import platform
import statistics
from pathlib import Path

import pytest
import torch

from bertforge.bench.spec import BenchmarkError, load_spec, lookup
from bertforge.cli import build_parser, main

ROOT = Path(__file__).parents[2]
SHIPPED = ROOT / "benchmarks.yml"


def test_shipped_spec_is_valid_and_complete():
    spec = load_spec(SHIPPED, build_parser())  # every script, config, override and option exists
    names = set(spec.benchmarks)
    for size in ("tiny", "base", "large"):
        for seq in (128, 512):
            benchmark = spec.benchmarks[f"pretrain_{size}_{seq}"]
            assert benchmark.ours.args["seq_len"] == seq
            assert benchmark.ours.args["max_predictions"] == {128: 20, 512: 80}[seq]
    assert {"squad_train_base", "squad_infer_base", "data_create_reference", "data_create_fast"} <= names
    assert spec.benchmarks["squad_infer_base"].ours.args["mode"] == "infer"
    goal = spec.benchmarks["pretrain_large_128_goal"].ours  # issue 10: 2,180 seq/s in 4 × 256-row steps
    assert (goal.args["batch_size"], goal.args["accumulation"], goal.args["seq_len"]) == (256, 4, 128)
    scripts = {b.ours.script for b in spec.benchmarks.values() if b.ours.command == "script"}
    assert scripts == {f"benchmarks/{p.name}" for p in (ROOT / "benchmarks").glob("*.py")}
    peer = spec.benchmarks["vs_transformers_base_128"].peer
    assert peer is not None and peer.args["worker"] == "transformers" and peer.args["preset"] == "base"
    assert all(b.quick for b in spec.benchmarks.values() if b.ours.command in ("pretrain", "squad"))


def write_spec(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "spec.yml"
    path.write_text(text, encoding="utf-8")
    return path


TINY = """
benchmarks:
  create:
    command: data-create
    args: {input: corpus.txt, vocab: vocab.txt, mode: fast, seq_len: 16, max_predictions: 2, dupe_factor: 2}
    peer: {args: {mode: reference}}
    metric: seconds
    lower_is_better: true
    repeats: 2
    warmup: 1
  step:
    command: pretrain
    config: tiny
    args: {batch_size: 2, seq_len: 16, max_predictions: 2, steps: 1, warmup: 0}
    overrides: {execution.threads: 1, execution.device: cpu}
"""


def test_a_spec_runs_and_gives_json_lines(tmp_path, capsys):
    words = "the cat sat on a mat and dog ran far away".split()
    (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + words) + "\n")
    documents = [" ".join(words[i:] + words[:i]) + " .\n" + " ".join(words[:i + 2]) for i in range(6)]
    (tmp_path / "corpus.txt").write_text("\n\n".join(documents) + "\n")
    spec = write_spec(tmp_path, TINY)

    assert main(["bench", "--spec", str(spec), "--list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in listed] == [["create", "data-create"], ["step", "pretrain"]]

    assert main(["bench", "--spec", str(spec), "--json", "--set", "step.args.batch_size=3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    create, step = map(json.loads, lines)
    assert create["benchmark"] == "create" and create["metric"] == "seconds"
    assert len(create["values"]) == len(create["peer"]["values"]) == 2  # the warm-up run is not counted
    assert create["value"] == statistics.median(create["values"])
    assert create["ratio"] == round(create["peer"]["value"] / create["value"], 4)  # lower is better
    assert create["result"]["mode"] == "fast" and create["peer"]["result"]["mode"] == "reference"
    assert create["result"]["instances"] > 0
    assert step["benchmark"] == "step" and "peer" not in step and "ratio" not in step
    assert step["value"] == step["result"]["seq_per_s"] > 0
    assert (step["result"]["batch_size"], step["result"]["seq_len"], step["result"]["threads"]) == (3, 16, 1)
    env = step["environment"]
    assert env["versions"]["torch"] == torch.__version__
    assert env["versions"]["python"] == platform.python_version()
    assert env["world_size"] == 1 and env["threads"] == torch.get_num_threads()
    assert env["device"].startswith("cuda: " if torch.cuda.is_available() else "cpu: ")
    assert not list(tmp_path.glob("*.tfrecord"))  # data-create wrote only into its temporary folder


@pytest.mark.parametrize("text,message", [
    ("benchmarks: {a: {command: pretrain}}\nother: 1\n",
     "{spec}: other: unknown key (known: benchmarks, defaults)"),
    ("benchmarks: {a: {command: pretrain, repeat: 3}}\n",
     "{spec}: benchmarks.a.repeat: unknown key (known: command, script, config, args, overrides, "
     "description, repeats, warmup, metric, lower_is_better, peer, quick, extract, ratio)"),
    ("benchmarks: {a: {command: pretrain, repeats: '3'}}\n", "{spec}: benchmarks.a.repeats: expected int, got '3'"),
    ("benchmarks: {a: {command: pretrain, repeats: 0}}\n", "{spec}: benchmarks.a.repeats: must be at least 1, got 0"),
    ("benchmarks: {a: {command: train}}\n",
     "{spec}: benchmarks.a.command: unknown command 'train' (one of pretrain, squad, data-create, script)"),
    ("benchmarks: {a: {command: script, script: x.py}}\n",
     "{spec}: benchmarks.a.metric: missing: a script's benchmark names the result field it reports"),
    ("benchmarks: {a: {command: script, script: nope.py, metric: x}}\n",
     "{spec}: benchmarks.a.script: nope.py not found in {dir}"),
    ("benchmarks: {a: {command: pretrain, args: {batch: 2}}}\n",
     "{spec}: benchmarks.a.args.batch: not an option of pretrain (options: accumulation, batch_size, data, "),
    ("benchmarks: {a: {command: pretrain, args: {batch_size: two}}}\n",
     "{spec}: benchmarks.a.args.batch_size: expected int, got 'two'"),
    ("benchmarks: {a: {command: squad, args: {mode: fly}}}\n",
     "{spec}: benchmarks.a.args.mode: 'fly' is not one of train, infer, both"),
    ("benchmarks: {a: {command: pretrain, quick: {stepz: 1}}}\n",
     "{spec}: benchmarks.a.quick.stepz: not an option of pretrain"),
    ("benchmarks: {a: {command: pretrain, config: huge}}\n", "{spec}: benchmarks.a.config: unknown config 'huge'"),
    ("benchmarks: {a: {command: pretrain, overrides: {train.lrr: 1}}}\n",
     "{spec}: benchmarks.a.overrides: unknown config key 'train.lrr'"),
    ("benchmarks: {a: {command: data-create, config: tiny}}\n",
     "{spec}: benchmarks.a.config: only for pretrain and squad, not data-create"),
    ("benchmarks: {a: {command: pretrain, peer: {repeats: 2}}}\n",
     "{spec}: benchmarks.a.peer.repeats: unknown key (known: command, script, config, args, overrides)"),
    ("benchmarks: [a]\n", "{spec}: benchmarks: expected a mapping of benchmark names to benchmarks"),
    ("benchmarks: {a: {command: pretrain}\n", "{spec}: not valid YAML ("),
])
def test_bad_specs_are_one_line_naming_file_and_key(tmp_path, capsys, text, message):
    spec = write_spec(tmp_path, text)
    assert main(["bench", "--spec", str(spec), "--list"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1
    assert err[0].startswith("error: " + message.format(spec=spec, dir=tmp_path)), err[0]


def test_unknown_benchmark_names_and_result_paths(tmp_path, capsys):
    spec = write_spec(tmp_path, "benchmarks: {a: {command: pretrain}, b: {command: squad}}\n")
    assert main(["bench", "--spec", str(spec), "--benchmark", "a", "c"]) == 2
    assert capsys.readouterr().err == f"error: {spec}: no benchmark 'c' (benchmarks: a, b)\n"
    assert main(["bench", "--spec", str(spec), "--list", "--set", "c.repeats=2"]) == 2
    assert capsys.readouterr().err == f"error: --set c.repeats=2: {spec} has no benchmark 'c' (benchmarks: a, b)\n"
    assert main(["bench", "--spec", str(spec), "--list", "--set", "a.repeats=two"]) == 2
    assert capsys.readouterr().err == f"error: {spec}: benchmarks.a.repeats: expected int, got 'two'\n"
    result = {"rows": [{"name": "x", "ms": 2.5}, {"name": "y", "ms": 4}], "n": 3}
    assert lookup(result, "rows.name=y.ms", "t") == 4.0
    assert lookup(result, "rows.0.ms", "t") == 2.5
    with pytest.raises(BenchmarkError, match="the result has no 'rows.name=z.ms'"):
        lookup(result, "rows.name=z.ms", "t")
    with pytest.raises(BenchmarkError, match="'rows' is .*, not a number"):
        lookup(result, "rows", "t")
