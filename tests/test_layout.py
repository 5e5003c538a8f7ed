"""The package's import graph has no cycles (docs/layout.md draws it).

Every ``import`` statement in ``bertforge/`` counts: at module level, inside
functions (the lazy imports that keep torch out of the data commands) and under
``if TYPE_CHECKING:``. A cycle means two modules that cannot be understood, or
changed, one without the other.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "bertforge"


def module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """{module: the package's modules it imports}, from the source alone."""
    files = {module_name(p, package): p for p in sorted(package.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        parent = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(parent[:len(parent) - node.level + 1] + ([node.module] if node.module else []))
                # `from . import engine` imports the module training.engine; `from .config import X` the module
                targets.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base
                               for alias in node.names)
        edges = set()
        for target in targets:
            while target and target not in files:  # bertforge.data.loader.Prefetcher -> bertforge.data.loader
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.add(target)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    # The walk sees what it must: module-level, relative-package and function-level imports.
    assert "bertforge.runs" in graph["bertforge.formats.weights"]
    assert "bertforge.formats.weights" in graph["bertforge.training.checkpoint"]
    assert "bertforge.data.record_reader" in graph["bertforge.data.loader"]
    assert "bertforge.training.pretrain" in graph["bertforge.training.cli"]  # imported inside cmd_pretrain
    assert cycles(graph) == []


def test_the_cycle_finder_finds_cycles(tmp_path):
    package = tmp_path / "bertforge"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from .b import x\n")
    (package / "b.py").write_text("def f():\n    from . import c\n")
    (package / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import y\n")
    (package / "sub" / "__init__.py").write_text("from ..a import x\n")
    (package / "sub" / "d.py").write_text("from .. import sub\n")
    graph = import_graph(package)
    assert graph["bertforge.sub.d"] == {"bertforge.sub"}
    assert cycles(graph) == [["bertforge.a", "bertforge.b", "bertforge.c"]]


def test_run_directories_are_resolved_without_torch():
    """``--resume`` is resolved before anything heavy is imported: runs.py needs no torch."""
    assert import_graph()["bertforge.runs"] == {"bertforge.config", "bertforge.fileio"}
    code = "import sys, bertforge.runs; print(sorted(m for m in ('torch', 'safetensors') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]"


def test_the_module_list_names_every_module():
    """docs/layout.md's module list (its tree under "## The modules") names every module of the package
    (a subpackage's __init__.py aside) and no module that is gone."""
    text = (PACKAGE.parent / "docs" / "layout.md").read_text(encoding="utf-8")
    tree = text.split("## The modules", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    listed: set[str] = set()
    folders: list[str] = []  # the directories the current line is in, from the root of the tree
    for line in tree.splitlines():
        entry = re.match(r"( *)([\w.]+\.py|\w+/)(\s|$)", line)
        depth = len(entry.group(1)) // 2 if entry else -1
        if not entry or depth > len(folders):  # not an entry: a description's second line
            continue
        del folders[depth:]
        if entry.group(2).endswith("/"):
            folders.append(entry.group(2))
        else:
            listed.add("".join(folders) + entry.group(2))
    modules = {str(p.relative_to(PACKAGE.parent)) for p in PACKAGE.rglob("*.py")
               if p.name != "__init__.py" or p.parent == PACKAGE}
    assert sorted(modules - listed) == [] and sorted(listed - modules) == []


# The package's folders from the bottom up: a module imports modules of its own folder or of lower ones.
# The base is the top-level modules that everything needs (the config, files, run directories, the
# machine); the entry points (the command line, the package's lazy API) stand above everything.
LAYERS = ("base", "data", "models", "parallel", "observe", "formats", "training", "tasks", "bench", "entry")
BASE = {"config", "fileio", "host", "runs", "version"}


def layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in ("cli", "__main__"):
        return "entry"
    if len(parts) == 2 and parts[1] in BASE:
        return "base"
    assert parts[1] in LAYERS, f"{module}: a folder that LAYERS does not place"
    return parts[1]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    return sorted(f"{module} ({layer_of(module)}) imports {target} ({layer_of(target)})"
                  for module, targets in graph.items() for target in targets
                  if rank[layer_of(target)] > rank[layer_of(module)])


def test_no_folder_imports_one_above_it():
    graph = import_graph()
    assert {layer_of(module) for module in graph} == set(LAYERS)  # every layer has modules, each module a layer
    assert upward_imports(graph) == []


def test_an_upward_import_is_found(tmp_path):
    package = tmp_path / "bertforge"
    for folder in ("models", "training"):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "config.py").write_text("")
    (package / "training" / "engine.py").write_text("from ..config import x\n")
    (package / "models" / "bert.py").write_text("def f():\n    from ..training import engine\n")
    assert upward_imports(import_graph(package)) == [
        "bertforge.models.bert (models) imports bertforge.training.engine (training)"]


def functions(package: Path = PACKAGE) -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """(module, function) for every function and method of the package."""
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((module_name(path, package), node))
    return found


def takes_the_whole_config(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    arguments = function.args.posonlyargs + function.args.args + function.args.kwonlyargs
    return any(arg.annotation is not None and ast.unparse(arg.annotation).strip("'\"") in ("Config", "Config | None")
               for arg in arguments)


# The jobs' entry points take the whole Config; every component below them takes its own section
# (ModelConfig, TrainConfig, DataConfig, ...), so a reader sees what it depends on and a test builds
# only that. config.py's own functions (load, override, freeze the Config) are not counted.
WHOLE_CONFIG_SIGNATURES = 16
LONGEST_FUNCTION = 80  # lines, decorators and docstring included


def test_only_the_jobs_take_the_whole_config():
    taking = sorted(f"{module}.{function.name}" for module, function in functions()
                    if module != "bertforge.config" and takes_the_whole_config(function))
    print(f"{len(taking)} functions take the whole Config:", *taking, sep="\n  ")
    assert len(taking) <= WHOLE_CONFIG_SIGNATURES, taking


def test_no_function_runs_past_a_screen():
    lengths = sorted(((function.end_lineno or 0) - function.lineno + 1, f"{module}.{function.name}")
                     for module, function in functions())
    print("the longest functions:", *(f"{n} {name}" for n, name in lengths[-5:]), sep="\n  ")
    assert [entry for entry in lengths if entry[0] > LONGEST_FUNCTION] == []


def test_the_counters_count(tmp_path):
    package = tmp_path / "bertforge"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "job.py").write_text(
        "def entry(cfg: Config, n: int):\n    pass\n\n\n"
        "def part(model: ModelConfig, cfg: 'Config | None' = None):\n" + "    x = 1\n" * 90)
    found = dict((function.name, function) for _, function in functions(package))
    assert takes_the_whole_config(found["entry"]) and takes_the_whole_config(found["part"])
    assert found["part"].end_lineno - found["part"].lineno + 1 == 91


def test_the_test_folders_mirror_the_package():
    """tests/NAME/ holds the tests of bertforge/NAME/, and pytest's pythonpath lists each folder (the
    test modules import each other by bare name)."""
    import tomllib

    tests = PACKAGE.parent / "tests"
    folders = sorted(p.name for p in tests.iterdir() if p.is_dir() and any(p.glob("test_*.py")))
    assert folders and all((PACKAGE / name).is_dir() for name in folders), folders
    settings = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text(encoding="utf-8"))
    assert sorted(settings["tool"]["pytest"]["ini_options"]["pythonpath"]) == sorted(
        ["tests", *(f"tests/{name}" for name in folders)])
