"""Named benchmarks from a YAML spec, run with one command.

    bertforge bench --spec benchmarks.yml --list
    bertforge bench --spec benchmarks.yml --benchmark pretrain_base_128 --json
    bertforge bench --spec benchmarks.yml --quick              # every benchmark, small sizes
    bertforge bench --spec benchmarks.yml --benchmark data_create_fast --set data_create_fast.args.input=wiki.txt

A spec (``benchmarks.yml`` at the repository root is the shipped one)::

    defaults: {repeats: 3, warmup: 1}          # optional: for every benchmark
    benchmarks:
      NAME:
        description: one line
        command: pretrain                      # pretrain | squad | data-create | script
        config: pretrain_base_128              # pretrain, squad: their --config
        args: {batch_size: 32, seq_len: 128}   # the command's options: batch_size → --batch-size
        overrides: {execution.precision: bf16} # dotted config fields (pretrain, squad)
        repeats: 3                             # timed runs, each in a fresh process
        warmup: 1                              # untimed runs before them
        metric: seq_per_s                      # the result field reported (a dotted path)
        lower_is_better: false
        peer: {args: {worker: transformers}}   # the same benchmark run by a peer
        quick: {steps: 1}                      # args replaced under --quick (one run, no warm-up)

``pretrain`` and ``squad`` are ``bertforge bench pretrain|squad --json``;
``data-create`` is ``bertforge data create`` timed in its own process (its
options, ``--output`` a temporary file unless given); ``script`` runs a Python
script (``script:`` its path) that prints one JSON object, or text from which
``extract: {name: REGEX}`` takes numbers (the first group of each). A peer is
the benchmark with the keys it gives replaced (``args`` merged): runs of ours
and of the peer alternate, and ``ratio`` is ours / peer of the metric's
medians (peer / ours when lower is better), so above 1 means ours is better.
A script that measures its peer itself names the field with ``ratio:``.

Relative paths are relative to the spec's folder, where every command runs.
In strings, ``{data}`` is the shared data folder ($BERTFORGE_TEST_DATA, else
``../shared/data`` beside the spec's folder) and ``{tmp}`` a temporary folder
made for one run and removed after it.

Each benchmark gives one result: a JSON line with the medians, every run's
value, the median run's whole result, the peer's, the ratio, and the
environment (versions, device, threads, world size). A spec with an unknown
key, a value of the wrong type, or (before anything runs) a command, script,
config or override that does not exist is one error naming the file and key.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bertforge.config import ConfigError, load_yaml
from bertforge.host import cpu_name, package_version, peak_rss_mb

COMMANDS = ("pretrain", "squad", "data-create", "script")
DEFAULT_METRIC = {"pretrain": "seq_per_s", "squad": "train_seq_per_s", "data-create": "instances_per_s"}
# Keys a benchmark may have, with their types; a peer may have the first five.
RUN_KEYS: dict[str, type | tuple[type, ...]] = {
    "command": str, "script": str, "config": str, "args": dict, "overrides": dict}
KEYS: dict[str, type | tuple[type, ...]] = {
    **RUN_KEYS, "description": str, "repeats": int, "warmup": int, "metric": str,
    "lower_is_better": bool, "peer": dict, "quick": dict, "extract": dict, "ratio": str}
DEFAULT_KEYS = ("repeats", "warmup")
# Each run is started by a fresh, small Python process: a process's peak resident set
# (ru_maxrss, which scripts measure with) survives exec, so a run started from this one,
# which holds torch, would report our peak as its own.
LAUNCHER = ("-c", "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))")


class BenchmarkError(ConfigError):
    """A benchmark that failed to run, or a spec that is wrong; one line for the user."""


@dataclass
class Run:
    """One side of a benchmark: what to execute."""

    command: str
    script: str | None = None
    config: str | None = None
    args: dict[str, Any] = field(default_factory=dict)
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass
class Benchmark:
    """One named entry of a spec, its defaults applied and its peer merged."""

    name: str
    ours: Run
    peer: Run | None = None
    description: str = ""
    repeats: int = 1
    warmup: int = 0
    metric: str = ""
    lower_is_better: bool = False
    quick: dict[str, Any] = field(default_factory=dict)
    extract: dict[str, str] = field(default_factory=dict)
    ratio: str | None = None


@dataclass
class Spec:
    """A spec file's benchmarks, by name, in the file's order."""

    path: Path
    benchmarks: dict[str, Benchmark]

    @property
    def folder(self) -> Path:
        return self.path.resolve().parent


# ---------------------------------------------------------------- reading and checking

def load_spec(path: str | Path, parser: argparse.ArgumentParser | None = None, sets: Sequence[str] = ()) -> Spec:
    """The spec in ``path``, its keys and types checked; given ``parser`` (the ``bertforge``
    command's) also that every command's script, config, overrides and options exist (nothing is run).

    ``sets`` are ``NAME.KEY...=VALUE`` changes to benchmark NAME made first (the
    value read as YAML): ``data_create_fast.args.input=corpus.txt``.
    """
    path = Path(path)
    if not path.is_file():
        raise BenchmarkError(f"benchmark spec not found: {path}")
    data = load_yaml(path)

    def fail(key: str, problem: str) -> BenchmarkError:
        return BenchmarkError(f"{path}: {key}: {problem}")

    if not isinstance(data, dict):
        raise fail("top level", "expected a mapping with 'benchmarks'")
    for change in sets:
        _apply_set(data, change, path)
    _known(data, ("benchmarks", "defaults"), "top level", fail)
    defaults = data.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise fail("defaults", f"expected a mapping, got {defaults!r}")
    _known(defaults, DEFAULT_KEYS, "defaults", fail)
    entries = data.get("benchmarks")
    if not isinstance(entries, dict) or not entries:
        raise fail("benchmarks", "expected a mapping of benchmark names to benchmarks")
    spec = Spec(path, {})
    for name, entry in entries.items():
        where = f"benchmarks.{name}"
        if not isinstance(entry, dict):
            raise fail(where, f"expected a mapping, got {entry!r}")
        entry = {**defaults, **entry}
        _known(entry, KEYS, where, fail)
        for key, value in entry.items():
            _check_type(value, KEYS[key], f"{where}.{key}", fail)
        spec.benchmarks[str(name)] = _benchmark(str(name), entry, where, fail)
    if parser is not None:
        for benchmark in spec.benchmarks.values():
            check_benchmark(spec, benchmark, parser)
    return spec


def _apply_set(data: dict, change: str, path: Path) -> None:
    key, equals, text = change.partition("=")
    parts = key.split(".")
    benchmarks = data.get("benchmarks")
    if not equals or len(parts) < 2 or not all(parts):
        raise BenchmarkError(f"--set {change}: expected NAME.KEY=VALUE, e.g. data_create_fast.args.input=corpus.txt")
    if not isinstance(benchmarks, dict) or parts[0] not in benchmarks:
        names = ", ".join(benchmarks) if isinstance(benchmarks, dict) else "none"
        raise BenchmarkError(f"--set {change}: {path} has no benchmark {parts[0]!r} (benchmarks: {names})")
    target = benchmarks
    for part in parts[:-1]:
        if not isinstance(target.get(part), dict):
            target[part] = {}
        target = target[part]
    try:
        target[parts[-1]] = yaml.safe_load(text)
    except yaml.YAMLError:
        target[parts[-1]] = text


def _known(mapping: dict, keys: Any, where: str, fail: Callable[[str, str], BenchmarkError]) -> None:
    for key in mapping:
        if key not in keys:
            raise fail(f"{where}.{key}" if where != "top level" else str(key),
                       f"unknown key (known: {', '.join(keys)})")


def _check_type(value: Any, kind: type | tuple[type, ...], key: str,
                fail: Callable[[str, str], BenchmarkError]) -> None:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:  # YAML's true is no number
        ok = False
    else:
        ok = isinstance(value, kinds)
    if not ok:
        names = " or ".join("mapping" if k is dict else k.__name__ for k in kinds)
        raise fail(key, f"expected {names}, got {value!r}")


def _benchmark(name: str, entry: dict, where: str, fail: Callable[[str, str], BenchmarkError]) -> Benchmark:
    if "command" not in entry:
        raise fail(f"{where}.command", f"missing (one of {', '.join(COMMANDS)})")
    ours = _run(entry, where, fail)
    peer = None
    if "peer" in entry:
        _known(entry["peer"], RUN_KEYS, f"{where}.peer", fail)
        for key, value in entry["peer"].items():
            _check_type(value, RUN_KEYS[key], f"{where}.peer.{key}", fail)
        merged = {**{k: entry[k] for k in RUN_KEYS if k in entry}, **entry["peer"],
                  "args": {**entry.get("args", {}), **entry["peer"].get("args", {})}}
        peer = _run(merged, f"{where}.peer", fail)
    for key in ("repeats", "warmup"):
        if key in entry and entry[key] < (1 if key == "repeats" else 0):
            raise fail(f"{where}.{key}", f"must be at least {1 if key == 'repeats' else 0}, got {entry[key]}")
    extract = entry.get("extract", {})
    for key, pattern in extract.items():
        try:
            groups = re.compile(str(pattern)).groups
        except re.error as err:
            raise fail(f"{where}.extract.{key}", f"not a regular expression ({err})") from None
        if groups < 1:
            raise fail(f"{where}.extract.{key}", "the pattern needs a group around the number")
    metric = entry.get("metric") or DEFAULT_METRIC.get(ours.command, "")
    if not metric:
        raise fail(f"{where}.metric", "missing: a script's benchmark names the result field it reports")
    if extract and metric.split(".")[0] not in extract:
        raise fail(f"{where}.metric", f"{metric!r} is none of the extracted names ({', '.join(extract)})")
    return Benchmark(name, ours, peer, entry.get("description", ""), entry.get("repeats", 1),
                     entry.get("warmup", 0), metric, entry.get("lower_is_better", False),
                     entry.get("quick", {}), extract, entry.get("ratio"))


def _run(entry: dict, where: str, fail: Callable[[str, str], BenchmarkError]) -> Run:
    command = entry["command"]
    if command not in COMMANDS:
        raise fail(f"{where}.command", f"unknown command {command!r} (one of {', '.join(COMMANDS)})")
    if (command == "script") != ("script" in entry):
        raise fail(f"{where}.script", "required with command: script" if command == "script"
                   else f"only for command: script, not {command}")
    for key in ("config", "overrides"):
        if key in entry and command not in ("pretrain", "squad"):
            raise fail(f"{where}.{key}", f"only for pretrain and squad, not {command}")
    return Run(command, entry.get("script"), entry.get("config"), dict(entry.get("args", {})),
               dict(entry.get("overrides", {})))


def check_benchmark(spec: Spec, benchmark: Benchmark, parser: argparse.ArgumentParser) -> None:
    """That what the benchmark runs exists: script, config with its overrides, command options."""
    for side, run in (("", benchmark.ours), (".peer", benchmark.peer)):
        if run is None:
            continue
        where = f"{spec.path}: benchmarks.{benchmark.name}{side}"
        for args, what in ((run.args, "args"), ({**run.args, **benchmark.quick}, "quick")):
            _check_args(_options(parser, run.command), run, args, f"{where}.{what}")
        if run.script is not None and not (spec.folder / run.script).is_file():
            raise BenchmarkError(f"{where}.script: {run.script} not found in {spec.folder}")
        if run.command in ("pretrain", "squad"):
            config = _config_path(spec, run.config)
            overrides = [(str(k), _expand(v, spec, None)) for k, v in run.overrides.items()]
            try:
                if run.command == "pretrain":
                    from bertforge.config import load_config

                    load_config(config or "tiny", overrides)
                else:
                    from bertforge.tasks.squad.train import load_squad_config

                    load_squad_config(config, overrides)
            except ConfigError as err:
                raise BenchmarkError(f"{where}.{'overrides' if overrides else 'config'}: {err}") from None


def _options(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser | None:
    """The argument parser of a command, a subparser of ``bertforge``'s (None for scripts,
    whose options are theirs)."""
    if command == "script":
        return None
    path = {"pretrain": ("bench", "pretrain"), "squad": ("bench", "squad"),
            "data-create": ("data", "create")}[command]
    for name in path:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return parser


def _check_args(parser: argparse.ArgumentParser | None, run: Run, args: dict[str, Any], where: str) -> None:
    if parser is None:
        return
    for key, value in args.items():
        option = "--" + str(key).replace("_", "-")
        action = parser._option_string_actions.get(option)
        if action is None or option in ("--help", "--json", "--config"):
            known = sorted(a.option_strings[-1][2:].replace("-", "_") for a in parser._actions
                           if a.option_strings and a.option_strings[-1] not in ("--help", "--json", "--config"))
            raise BenchmarkError(f"{where}.{key}: not an option of {run.command} "
                                 f"(options: {', '.join(known)})")
        if action.nargs == 0:  # a flag
            if not isinstance(value, bool):
                raise BenchmarkError(f"{where}.{key}: expected true or false, got {value!r}")
            continue
        values = value if isinstance(value, list) else [value]
        for item in values:
            if action.type in (int, float) and not (isinstance(item, (int, float)) and not isinstance(item, bool)
                                                    and action.type(item) == item):
                raise BenchmarkError(f"{where}.{key}: expected {action.type.__name__}, got {item!r}")
            if action.choices is not None and item not in action.choices:
                raise BenchmarkError(f"{where}.{key}: {item!r} is not one of {', '.join(map(str, action.choices))}")


def _config_path(spec: Spec, config: str | None) -> str | None:
    """A config name as given, or a YAML path made relative to the spec's folder."""
    if config and config.endswith((".yaml", ".yml")) and not Path(config).is_absolute():
        return str(spec.folder / config)
    return config


def data_folder(spec: Spec) -> Path:
    return Path(os.environ.get("BERTFORGE_TEST_DATA") or spec.folder.parent / "shared" / "data")


def _expand(value: Any, spec: Spec, tmp: str | None) -> str:
    """A value as a command-line string, its placeholders filled in (``{tmp}`` by the system's
    temporary folder when checking, before any run has one)."""
    return (str(value).replace("{data}", str(data_folder(spec)))
            .replace("{tmp}", tmp if tmp is not None else tempfile.gettempdir()))


# ---------------------------------------------------------------- running

def command_line(spec: Spec, run: Run, args: dict[str, Any], tmp: str) -> list[str]:
    """The argv of one run, for a subprocess in the spec's folder."""
    argv = [sys.executable]
    if run.command == "script":
        assert run.script is not None
        argv.append(str(spec.folder / run.script))
    elif run.command == "data-create":
        argv += ["-m", "bertforge.bench.spec", "data-create"]
        if "output" not in args:
            args = {**args, "output": "{tmp}/records.tfrecord"}
    else:
        argv += ["-m", "bertforge", "bench", run.command, "--json"]
        if run.config:
            argv += ["--config", _expand(_config_path(spec, run.config), spec, tmp)]
    for key, value in args.items():
        if value is False or value is None:
            continue
        argv.append("--" + str(key).replace("_", "-"))
        if value is not True:
            argv += [_expand(v, spec, tmp) for v in (value if isinstance(value, list) else [value])]
    for key, value in run.overrides.items():
        argv += [f"--{key}", _expand(value, spec, tmp)]
    return argv


def run_once(spec: Spec, benchmark: Benchmark, run: Run, quick: bool) -> dict[str, Any]:
    """One run in a fresh process: its JSON result (or the numbers extracted from its output)."""
    args = {**run.args, **(benchmark.quick if quick else {})}
    with tempfile.TemporaryDirectory(prefix="bertforge-bench-") as tmp:
        argv = command_line(spec, run, args, tmp)
        start = time.perf_counter()
        done = subprocess.run([sys.executable, *LAUNCHER, *argv], cwd=spec.folder, capture_output=True,
                              text=True)
        seconds = time.perf_counter() - start
    if done.returncode != 0:
        last = next((line.strip() for line in reversed(done.stderr.splitlines()) if line.strip()), "")
        raise BenchmarkError(f"benchmark {benchmark.name}: `{' '.join(argv[1:])}` exited with status "
                             f"{done.returncode}: {last or 'no message'}")
    if benchmark.extract:
        result: dict[str, Any] = {}
        for name, pattern in benchmark.extract.items():
            found = re.findall(pattern, done.stdout)
            if not found:
                raise BenchmarkError(f"benchmark {benchmark.name}: extract.{name}: {pattern!r} matched "
                                     "nothing in the output")
            last_match = found[-1]
            result[name] = float(last_match[0] if isinstance(last_match, tuple) else last_match)
    else:
        result = _json_result(done.stdout, benchmark.name)
    result.setdefault("wall_s", round(seconds, 3))
    return result


def _json_result(stdout: str, name: str) -> dict[str, Any]:
    """The JSON object a run printed: all of its output, else its last line that is one."""
    candidates = [stdout.strip()] + [line for line in reversed(stdout.splitlines())
                                     if line.startswith("{")]
    for text in candidates:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            return value
    raise BenchmarkError(f"benchmark {name}: the run printed no JSON object")


def lookup(result: Any, path: str, name: str) -> float:
    """The number at a dotted path of a result: keys, list indices, and ``key=value`` for the
    first element of a list whose ``key`` is ``value`` (``rows.optimizer=lamb_bertforge.median_ms``)."""
    value = result
    for part in path.split("."):
        key, _, wanted = part.partition("=")
        chosen = [v for v in value if isinstance(v, dict) and str(v.get(key)) == wanted] \
            if isinstance(value, list) and wanted else []
        if chosen:
            value = chosen[0]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        elif isinstance(value, dict) and part in value:
            value = value[part]
        else:
            raise BenchmarkError(f"benchmark {name}: the result has no {path!r} "
                                 f"(fields: {', '.join(result) if isinstance(result, dict) else '-'})")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BenchmarkError(f"benchmark {name}: {path!r} is {value!r}, not a number")
    return float(value)


def run_benchmark(spec: Spec, benchmark: Benchmark, quick: bool = False,
                  environment_info: dict[str, Any] | None = None) -> dict[str, Any]:
    """Warm-up runs, then ``repeats`` runs of ours and the peer alternately; one result."""
    started = time.time()
    repeats, warmup = (1, 0) if quick else (benchmark.repeats, benchmark.warmup)
    sides = [("ours", benchmark.ours)] + ([("peer", benchmark.peer)] if benchmark.peer else [])
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side, _ in sides}
    for index in range(warmup + repeats):
        for side, run in sides:
            result = run_once(spec, benchmark, run, quick)
            if index >= warmup:
                runs[side].append(result)
    out: dict[str, Any] = {"benchmark": benchmark.name, "command": benchmark.ours.command,
                           "spec": str(spec.path), "quick": quick, "metric": benchmark.metric,
                           "lower_is_better": benchmark.lower_is_better, "repeats": repeats,
                           "warmup": warmup}
    medians = {}
    for side, results in runs.items():
        values = [lookup(r, benchmark.metric, benchmark.name) for r in results]
        medians[side] = statistics.median(values)
        median_run = min(results, key=lambda r: abs(lookup(r, benchmark.metric, benchmark.name) - medians[side]))
        part = {"value": medians[side], "values": values, "result": median_run}
        if side == "ours":
            out.update(part)
        else:
            out["peer"] = part
    if benchmark.peer is not None:
        ours, peer = medians["ours"], medians["peer"]
        better = peer / ours if benchmark.lower_is_better else ours / peer
        out["ratio"] = round(better, 4) if ours and peer else None
    elif benchmark.ratio:
        out["ratio"] = statistics.median(lookup(r, benchmark.ratio, benchmark.name) for r in runs["ours"])
    out["environment"] = environment_info if environment_info is not None else environment()
    out["started"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started))
    out["seconds"] = round(time.time() - started, 2)
    return out


def environment() -> dict[str, Any]:
    """What the numbers were measured with: versions, device, threads, world size."""
    import torch

    versions = {"bertforge": package_version("bertforge"), "torch": torch.__version__,
                "python": platform.python_version()}
    for name in ("transformers", "numpy"):
        versions[name] = package_version(name)
    if torch.cuda.is_available():
        device = f"cuda: {torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda})"
    else:
        device = f"cpu: {cpu_name()}"
    return {"versions": versions, "device": device, "threads": torch.get_num_threads(),
            "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "world_size": int(os.environ.get("WORLD_SIZE", "1")), "platform": platform.platform()}


def select(spec: Spec, names: list[str] | None) -> list[Benchmark]:
    if not names:
        return list(spec.benchmarks.values())
    unknown = [n for n in names if n not in spec.benchmarks]
    if unknown:
        raise BenchmarkError(f"{spec.path}: no benchmark {unknown[0]!r} (benchmarks: "
                             f"{', '.join(spec.benchmarks)})")
    return [spec.benchmarks[n] for n in names]


def run_spec(spec: Spec, names: list[str] | None = None, quick: bool = False) -> Iterator[dict[str, Any]]:
    """The results of the named benchmarks (all by default), as each finishes."""
    chosen = select(spec, names)
    info = environment()
    for benchmark in chosen:
        yield run_benchmark(spec, benchmark, quick, info)


def summary_line(result: dict[str, Any]) -> str:
    """A result for a person: the metric's median, and the peer's and the ratio when there are."""
    line = (f"{result['benchmark']}: {result['metric']} {result['value']:g} "
            f"(median of {result['repeats']})")
    if "peer" in result:
        line += f", peer {result['peer']['value']:g}"
    if result.get("ratio") is not None:
        line += f", ratio {result['ratio']:.2f}x"
    return line + f"; {result['seconds']:.1f}s"


def run_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``bertforge bench --spec FILE [--benchmark NAME ...] [--list] [--quick] [--json]``; ``parser``
    is the ``bertforge`` command's, which checks the options of the spec's commands."""
    spec = load_spec(args.spec, parser, sets=args.set or ())
    if args.list:
        chosen = select(spec, args.benchmark)
        width = max(len(b.name) for b in chosen)
        for b in chosen:
            peer = " (with a peer)" if b.peer or b.ratio else ""
            print(f"{b.name:<{width}}  {b.ours.command:<11} {b.description}{peer}")
        return 0
    for result in run_spec(spec, args.benchmark, quick=args.quick):
        print(json.dumps(result) if args.spec_json else summary_line(result), flush=True)
    return 0


# ---------------------------------------------------------------- the data-create run

def _data_create(argv: list[str]) -> dict[str, Any]:
    """``bertforge data create`` with these options, timed in this process."""
    from bertforge.data.create import add_arguments, create

    parser = argparse.ArgumentParser(prog="bertforge.bench.spec data-create")
    add_arguments(parser)
    a = parser.parse_args(argv)
    # Every option whose name is a parameter of create(), so that new options come along.
    parameters = inspect.signature(create).parameters
    options = {k: v for k, v in vars(a).items() if k in parameters and k not in ("vocab", "output")}
    start = time.perf_counter()
    stats = create(a.input, a.vocab, a.output, lowercase=not a.cased, **options)
    seconds = time.perf_counter() - start
    peak = max(peak_rss_mb(), resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)  # workers
    return {"mode": a.mode, "workers": a.workers, "format": a.fmt, "instances": stats.instances,
            "documents": stats.documents, "tokens": stats.tokens, "seconds": round(seconds, 4),
            "instances_per_s": round(stats.instances / seconds, 1),
            "tokens_per_s": round(stats.tokens / seconds, 1), "peak_rss_mb": round(peak, 1)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] != ["data-create"]:
        print("usage: python -m bertforge.bench.spec data-create OPTIONS (run by bertforge bench --spec)",
              file=sys.stderr)
        return 2
    try:
        print(json.dumps(_data_create(argv[1:])))
    except (ConfigError, ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
