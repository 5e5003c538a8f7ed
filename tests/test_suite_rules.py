"""Rules of the suite itself (issue 41.6): no load can break it, a smoke subset touches every folder,
the README's test count is measured.

**A wall-clock assertion** is an ordering comparison (``<``, ``<=``, ``>``, ``>=``) inside an
``assert`` statement, or in the condition of an ``if`` whose body calls ``pytest.fail`` or raises
``AssertionError``, that puts a value the test read from a clock against a number or against another
reading of the test's clock (a deadline). A value read from a clock is a call of ``time.time``,
``time.monotonic``, ``time.perf_counter`` or ``time.process_time`` (or their ``_ns`` forms, also
imported by name), or a name assigned in the same function an expression that holds one (``started
= time.monotonic()``, ``elapsed = time.monotonic() - started``, ``deadline = time.monotonic() + 60``).
Such an assertion's verdict depends on the machine's speed alone. Not one: comparing a value the code
under test reported with the test's own measurement (``time_to_train_s < wall``: the run's clock lies
inside the test's, on any machine), and a hang guard that stops a stuck wait (``conftest.wait_until``
raises TimeoutError, no verdict on speed).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
PACKAGE = REPO / "bertforge"
CLOCKS = {"time", "monotonic", "perf_counter", "process_time"}
CLOCKS |= {f"{name}_ns" for name in CLOCKS}
ORDERINGS = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)


def suite_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "fixtures" not in p.relative_to(TESTS).parts)


def is_number(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, int | float) and not isinstance(node.value, bool)
    if isinstance(node, ast.UnaryOp):
        return is_number(node.operand)
    return isinstance(node, ast.BinOp) and is_number(node.left) and is_number(node.right)


def nodes(scope: ast.AST) -> list[ast.AST]:
    """The nodes of a scope: a function's, its closures' included; the module's, without its functions'."""
    if not isinstance(scope, ast.Module):
        return list(ast.walk(scope))
    found, todo = [], list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            found.append(node)
            todo.extend(ast.iter_child_nodes(node))
    return found


class ClockReads:
    """Which expressions of one scope read the clock: clock calls and the names bound to them."""

    def __init__(self, names: set[str], scope: ast.AST):
        self.names = names  # the clocks imported by name (from time import perf_counter)
        self.derived: set[str] = set()
        bindings = [(t, n.value) for n in nodes(scope) if isinstance(n, ast.Assign) for t in n.targets]
        bindings += [(n.target, n.value) for n in nodes(scope)
                     if isinstance(n, ast.AnnAssign | ast.AugAssign | ast.NamedExpr) and n.value is not None]
        while True:  # to a fixed point: elapsed = now - started, with started a clock read
            found = {name.id for target, value in bindings if self.reads(value)
                     for name in ast.walk(target) if isinstance(name, ast.Name)} - self.derived
            if not found:
                return
            self.derived |= found

    def reads(self, node: ast.AST) -> bool:
        for n in ast.walk(node):
            if isinstance(n, ast.Call):
                f = n.func
                if (isinstance(f, ast.Attribute) and f.attr in CLOCKS and isinstance(f.value, ast.Name)
                        and f.value.id == "time") or (isinstance(f, ast.Name) and f.id in self.names):
                    return True
            if isinstance(n, ast.Name) and n.id in self.derived:
                return True
        return False

    def judges_speed(self, condition: ast.expr) -> bool:
        """Whether an ordering in ``condition`` puts a clock read against a number or a clock read."""
        for compare in (n for n in ast.walk(condition) if isinstance(n, ast.Compare)):
            operands = [compare.left, *compare.comparators]
            for op, a, b in zip(compare.ops, operands[:-1], operands[1:], strict=True):
                if isinstance(op, ORDERINGS) and (self.reads(a) or self.reads(b)) \
                        and (self.reads(a) or is_number(a)) and (self.reads(b) or is_number(b)):
                    return True
        return False


def fails(body: list[ast.stmt]) -> bool:
    """Whether ``body`` fails the test: pytest.fail(...) or raise AssertionError."""
    for n in (n for stmt in body for n in ast.walk(stmt)):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "fail":
            return True
        if isinstance(n, ast.Raise) and n.exc is not None and "AssertionError" in ast.unparse(n.exc):
            return True
    return False


def wall_clock_assertions(source: str, filename: str = "<source>") -> list[str]:
    """``file:line`` of every wall-clock assertion (module docstring) in ``source``."""
    if not re.search(r"\btime\.\w+\(|from time import", source):  # no clock to read
        return []
    tree = ast.parse(source, filename)
    names = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
             and node.module == "time" for a in node.names if a.name in CLOCKS}
    functions = (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef))
    scopes: list[ast.AST] = [tree, *functions]
    found = set()
    for scope in scopes:
        clock = ClockReads(names, scope)
        if not clock.reads(scope):  # no clock in this scope: nothing to judge
            continue
        for node in nodes(scope):
            if isinstance(node, ast.Assert) and clock.judges_speed(node.test) \
                    or isinstance(node, ast.If) and fails(node.body) and clock.judges_speed(node.test):
                found.add(f"{filename}:{node.lineno}")
    return sorted(found, key=lambda where: int(where.rpartition(":")[2]))


@pytest.mark.smoke
def test_the_rule_finds_what_a_load_breaks_and_nothing_else():
    flagged = '''
import time
from time import perf_counter as clock

def second_signal():
    started = time.monotonic()
    run()
    assert time.monotonic() - started < 20

def deadline_loop(timeout):
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "no step was logged"

def imported_by_name():
    t0 = clock()
    run()
    elapsed = clock() - t0
    assert 0 < elapsed <= 1.5

def failed_by_hand():
    deadline = time.perf_counter() + 60
    if time.perf_counter() > deadline:
        pytest.fail("too slow")
'''
    assert wall_clock_assertions(flagged) == ["<source>:8", "<source>:13", "<source>:19", "<source>:23"]
    allowed = '''
import time

def run_lies_inside_the_test(summary):
    started = time.perf_counter()
    summary = run()
    wall = time.perf_counter() - started
    assert 0 < summary["time_to_train_s"] < wall

def a_hang_guard():
    guard = time.monotonic() + 900
    if time.monotonic() > guard:
        raise TimeoutError("a hang")

def counts(result):
    assert result["steps"] < 20 and result["seq_per_s"] > 0
'''
    assert wall_clock_assertions(allowed) == []


@pytest.mark.smoke
def test_no_test_asserts_a_wall_clock_time():
    found = [where for path in suite_files()
             for where in wall_clock_assertions(path.read_text(encoding="utf-8"), str(path.relative_to(REPO)))]
    assert found == []


def smoke_tests(path: Path) -> list[str]:
    """The tests of ``path`` marked smoke (each function, or all of them by ``pytestmark``)."""
    source = path.read_text(encoding="utf-8")
    if "mark.smoke" not in source:
        return []
    tree = ast.parse(source, str(path))
    tests = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]
    marks_module = any(isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark"
                                                         for t in n.targets) and "mark.smoke" in ast.unparse(n.value)
                       for n in tree.body)
    return [t.name for t in tests if marks_module or any("mark.smoke" in ast.unparse(d) for d in t.decorator_list)]


def suite_folders() -> list[Path]:
    return sorted({p.parent for p in TESTS.rglob("test_*.py") if "fixtures" not in p.relative_to(TESTS).parts})


@pytest.mark.smoke
def test_every_test_folder_has_smoke_tests():
    """``pytest -m smoke`` (README, "Tests") runs a few tests of every folder of tests/."""
    assert [folder.relative_to(REPO).as_posix() for folder in suite_folders()
            if not any(smoke_tests(p) for p in folder.glob("test_*.py"))] == []


def package_folder(module: str) -> str | None:
    """The folder of bertforge holding ``module`` (dotted), "bertforge" for the top level."""
    parts = module.split(".")
    if parts[0] != "bertforge":
        return None
    for end in range(len(parts), 0, -1):
        if (REPO.joinpath(*parts[:end])).is_dir():
            return "/".join(parts[:end])
    return None


@pytest.mark.smoke
def test_the_smoke_tests_import_every_package_folder():
    """The files holding smoke tests import (at the top or in a test) from every folder of bertforge/
    that holds modules: the subset touches the whole package, not one corner of it."""
    imported = set()
    for path in suite_files():
        if path.name.startswith("test_") and smoke_tests(path):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ImportFrom) and node.module:
                    imported |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
                elif isinstance(node, ast.Import):
                    imported |= {a.name for a in node.names}
    folders = {folder for module in imported if (folder := package_folder(module))}
    folders |= {"/".join(folder.split("/")[:end]) for folder in folders for end in range(1, folder.count("/") + 1)}
    expected = {p.parent.relative_to(REPO).as_posix() for p in PACKAGE.rglob("*.py")}
    assert sorted(expected - folders) == []


README_COUNT = re.compile(r"about ([\d,]+) tests \(`pytest --collect-only -q` counts them; a test keeps this "
                          r"number within (\d+) % of that count\)")


@pytest.mark.slow
def test_the_readmes_test_count_is_the_collected_count():
    """The README's count of tests is measured: within the margin it states of what pytest collects.
    About 40 s (the collection imports every test module)."""
    readme = " ".join((REPO / "README.md").read_text(encoding="utf-8").split())
    match = README_COUNT.search(readme)
    assert match, "README.md, Tests: the count of tests and its margin"
    stated, margin = int(match.group(1).replace(",", "")), int(match.group(2))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    collected = int(re.search(r"^(\d+) tests? collected", done.stdout, flags=re.M).group(1))
    assert abs(stated - collected) <= collected * margin / 100, (stated, collected)
