"""The commands of README.md and docs/*.md, run as a reader would run them; and their links.

Every fenced ```bash (or ```python) block of those pages says its scale on the line right
before its fence, in one of these HTML comments (invisible on the rendered page):

    <!-- run: cpu -->                 run here, as written: seconds to a minute on a 2-core CPU
    <!-- run: no, gpu -->             a CUDA GPU, or GPU-days at the sizes it gives
    <!-- run: no, multi-node -->      several machines (torchrun --nnodes)
    <!-- run: no, network -->         it downloads (pip, the Wikipedia dump, a model)
    <!-- run: no, long -->            more than a minute of CPU even as written
    <!-- run: no, cluster -->         a Docker daemon or a Slurm cluster
    <!-- run: no, ci -->              the README's test command, which .ci/run runs (compared here)

A block with none fails test_every_block_says_its_scale, whose message says how to mark it.
A block not run still has its `bertforge` commands parsed by the real parser (and where
they take a config, the config and its overrides resolved) and the other programs it
names checked (a script, Dockerfile or module it names must exist); and the prose around
it must say its scale (a `gpu` block's paragraphs name the GPU, a `long` one the minutes).

How the `cpu` blocks run. Each page runs in its own directory of one temporary workspace,
blocks in page order and pages in the order of the fixtures below (the data page first: its
Wikipedia text is the README's "own text"). Each command line of a block (continued lines
joined) runs as written with `bash -o pipefail -c`, in that directory, with `bertforge` and
`python` of this interpreter first on PATH and this checkout on PYTHONPATH, offline; a
```python block runs with `python -c`. A page stops at its first failing command. What a
page's commands read but do not make stands at the path the page names: the real files of
../shared/data (linked: the Wikipedia sample dump as dumps/enwiki-latest-pages-articles.xml.bz2,
the uncased vocab), the sample dump's sentence shards (made by the data page) as the corpus/
of "your own text", SQuAD files cut down to a few questions as train-v1.1.json and
dev-v1.1.json (the official files take GPU-hours to train on), GLUE and CoNLL tasks generated
in their official formats (none can be downloaded here), and what an earlier page made (linked).
No option is added to any command: the pages' runnable commands are small as written.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import finetune_data
import pytest
from conftest import DATA, shared_data

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
SHELL_LANGUAGES = {"sh", "shell", "console", "zsh", "shell-session"}
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"  # torch's CPU-only wheels (PyPI's Linux ones carry CUDA)

# What a block not run here needs, by the kind in its `<!-- run: no, KIND -->`, and what the prose
# around it must say (a pattern) so that a reader knows its scale too.
NOT_RUN = {
    "gpu": ("a CUDA GPU, or GPU-days at the sizes it gives", r"GPU"),
    "multi-node": ("several machines", r"machines|nodes"),
    "network": ("a download", r"download|PyPI|install|network"),
    "long": ("more than a minute of CPU as written", r"minute|\bmin\b|hour"),
    "cluster": ("a Docker daemon or a Slurm cluster", r"Docker|Slurm"),
    "ci": ("the test suite itself (compared with .ci/run)", r"\.ci/run"),
}
HOW_TO_MARK = ("on the line right before its opening fence put `<!-- run: cpu -->` when the block runs as "
               "written in seconds on a CPU (tests/test_docs.py then runs it, in page order), or "
               "`<!-- run: no, KIND -->` with KIND one of " + ", ".join(NOT_RUN) + " (" +
               "; ".join(f"{k}: {v[0]}" for k, v in NOT_RUN.items()) + "), and say its scale in the prose "
               "around it; see the docstring of tests/test_docs.py")


# ---------------------------------------------------------------- reading the pages

@dataclass(frozen=True)
class Block:
    page: str
    line: int  # of the opening fence, from 1
    language: str
    text: str
    marker: str | None  # "cpu", a key of NOT_RUN, or None (unmarked)

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


FENCE = re.compile(r"^\s*(```+|~~~+)\s*([^\s`]*)\s*$")
RUN_MARK = re.compile(r"^<!--\s*run:\s*(cpu|no,\s*([a-z-]+))\s*-->$")


def read_blocks(page: str) -> list[Block]:
    """The fenced blocks of a page, each with the kind its `<!-- run: … -->` comment on the line
    before it gives: "cpu" (run here), the KIND of `run: no, KIND`, or None."""
    lines = (ROOT / page).read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == opening.group(1)), None)
        assert end is not None, f"{page}:{i + 1}: a code fence that is never closed"
        before = lines[i - 1].strip() if i else ""
        marker = RUN_MARK.match(before)
        blocks.append(Block(page, i + 1, opening.group(2), "\n".join(lines[i + 1:end]),
                            (marker.group(2) or marker.group(1)) if marker else None))
        i = end + 1
    return blocks


@functools.cache
def all_blocks() -> tuple[Block, ...]:
    return tuple(block for page in PAGES for block in read_blocks(page))


def logical_lines(text: str) -> list[str]:
    """Command lines, continued lines joined (with their backslash-newline, which bash removes),
    blank and comment-only lines left out."""
    out, pending = [], ""
    for line in text.splitlines():
        pending = f"{pending}\n{line}" if pending else line
        if line.endswith("\\"):
            continue
        if pending.strip() and not pending.lstrip().startswith("#"):
            out.append(pending)
        pending = ""
    return out


def split_and(line: str) -> list[str]:
    """A line's commands joined by `&&`; quotes respected, an unquoted `#` ends the line. Anything
    else a shell would treat specially (pipes, `;`, redirections, substitutions) is refused: the
    runner below runs simple commands only."""
    parts, current, quote, i = [], [], "", 0
    while i < len(line):
        char = line[i]
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (not current or current[-1] in " \t\n"):
            break
        elif line.startswith("&&", i):
            parts.append("".join(current))
            current, i = [], i + 2
            continue
        elif char in "|;<>`" or line.startswith("$(", i):
            raise AssertionError(f"not a simple command: {line!r}")
        current.append(char)
        i += 1
    parts.append("".join(current))
    return [part.strip() for part in parts if part.strip()]


def commands(block: Block) -> list[str]:
    return [command for line in logical_lines(block.text) for command in split_and(line)]


def loop_body_commands(block: Block) -> list[str]:
    """commands() of a block that is not run, the lines of a `for` loop's head and end left out
    (its body is checked with the loop variable `i` set to 00000)."""
    lines = [line for line in logical_lines(block.text) if not line.startswith(("for ", "done"))]
    return [command for line in lines for command in split_and(line)]


def words(command: str, cwd: Path, env: dict[str, str] | None = None) -> list[str]:
    """The argv bash passes for this command line in cwd."""
    script = "_words() { printf '%s\\0' \"$@\"; }\n_words " + command + "\n"
    result = subprocess.run(["bash", "-c", script], cwd=cwd, capture_output=True, text=True,
                            env={**os.environ, **(env or {})}, check=True)
    return result.stdout.split("\0")[:-1]


def extras_defined() -> set[str]:
    """The keys of pyproject.toml's [project.optional-dependencies]."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^([A-Za-z0-9_-]+)\s*=", section, flags=re.MULTILINE))


def ci_commands() -> list[str]:
    """What .ci/run runs after activating its fresh environment, pip's -q left out."""
    lines = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if "/bin/activate" in line) + 1
    kept = [line.strip() for line in lines[start:] if line.strip() and not line.strip().startswith("#")]
    return [re.sub(r"^pip install -q ", "pip install ", line) for line in kept]


# ---------------------------------------------------------------- running commands

@dataclass
class Result:
    command: str  # as the page writes it, and as it ran
    status: int
    output: str
    seconds: float


@dataclass
class PageRun:
    page: str
    folder: Path
    results: list[Result] = field(default_factory=list)

    def result(self, piece: str) -> Result:
        """The one result whose command contains piece."""
        found = [r for r in self.results if piece in r.command]
        assert len(found) == 1, f"{len(found)} commands of {self.page} contain {piece!r}"
        return found[0]

    def run_dir(self, piece: str) -> Path:
        """The run directory a pre-training command printed."""
        printed = re.findall(r"^run directory: (\S+)$", self.result(piece).output, flags=re.MULTILINE)
        assert printed, self.result(piece).output[-2000:]
        return self.folder / printed[-1]


def doc_env() -> dict[str, str]:
    """A reader's shell: this interpreter's `bertforge` and `python` first on PATH, this checkout
    imported, offline, one process (no torchrun variables)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", COLUMNS="200")
    env["BERTFORGE_TEST_DATA"] = str(DATA.resolve())  # where the docs' ../shared/data is from a page's folder
    return env


@contextlib.contextmanager
def output_to(path: Path, cwd: Path) -> Iterator[None]:
    """stdout and stderr, Python's and the file descriptors' (child processes too), into path,
    with the warnings a command line would show; the working directory cwd."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    streams = sys.stdout, sys.stderr
    before = os.getcwd()
    with open(path, "a", encoding="utf-8", buffering=1) as stream, warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        os.dup2(stream.fileno(), 1)
        os.dup2(stream.fileno(), 2)
        sys.stdout = sys.stderr = stream
        os.chdir(cwd)
        try:
            yield
        finally:
            for warning in seen:
                stream.write(warnings.formatwarning(warning.message, warning.category, warning.filename,
                                                    warning.lineno))
            stream.flush()
            sys.stdout, sys.stderr = streams
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            os.chdir(before)


def run_bertforge(argv: list[str], cwd: Path, log: Path) -> int:
    from bertforge.cli import main

    with output_to(log, cwd):
        try:
            return main(argv)
        except SystemExit as stop:  # argparse
            return stop.code if isinstance(stop.code, int) else 1
        except Exception:  # noqa: BLE001 - a traceback is a failure to report, with the others
            traceback.print_exc()
            return 99


def run_page(page: str, folder: Path) -> PageRun:
    """Every `<!-- run: cpu -->` block of page, in order, in folder, each command line as written with
    bash (a python block with python); stops at the first command that fails."""
    run = PageRun(page, folder)
    for block in read_blocks(page):
        if block.marker != "cpu":
            continue
        python = block.language == "python"
        for command in [block.text] if python else logical_lines(block.text):
            argv = ["python", "-c", command] if python else ["bash", "-o", "pipefail", "-c", command]
            started = time.perf_counter()
            done = subprocess.run(argv, cwd=folder, env=doc_env(), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, timeout=900, check=False)
            run.results.append(Result(command, done.returncode, done.stdout, time.perf_counter() - started))
            if done.returncode != 0:
                return run
    return run


def assert_all_ran(run: PageRun) -> None:
    assert run.results, f"{run.page}: nothing ran"
    for result in run.results:  # shown with pytest -s (or -rP), or on a failure
        print(f"{run.page}: {result.seconds:5.1f} s, status {result.status}: {result.command[:300]}")
    for result in run.results:
        assert result.status == 0, (f"{run.page}: exit status {result.status} from\n  {result.command}\n"
                                    f"{result.output[-3000:]}")


def link(folder: Path, name: str, target: Path) -> None:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    assert target.exists(), target
    path.symlink_to(target.resolve())


def json_lines(output: str) -> list[dict]:
    return [json.loads(line) for line in output.splitlines() if line.startswith("{")]


# ---------------------------------------------------------------- checks without running anything

def prose_around(page: str, block: Block, lines: int = 12) -> str:
    """The page's text (code blocks left out) from `lines` lines before the block to as many after it."""
    text = (ROOT / page).read_text(encoding="utf-8").splitlines()
    end = block.line + block.text.count("\n") + 1
    window = "\n".join(text[max(0, block.line - 1 - lines):block.line - 1] + text[end:end + lines])
    return re.sub(r"^```.*?^```", "", window, flags=re.S | re.M)


def test_every_block_says_its_scale():
    assert all_blocks(), "no code blocks found"
    for page in PAGES:  # a marker stands right before a fence, or it marks nothing
        lines = (ROOT / page).read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines[:-1], start=1):
            if re.match(r"^<!--\s*run\b", line.strip()):
                assert RUN_MARK.match(line.strip()), f"{page}:{number}: {line.strip()!r}: {HOW_TO_MARK}"
                assert FENCE.match(lines[number]), f"{page}:{number}: a run marker not followed by a code fence"
    for block in all_blocks():
        assert block.language, f"{block}: give the code fence a language (bash, python, text, …)"
        assert block.language not in SHELL_LANGUAGES, f"{block}: shell commands go in ```bash blocks"
        if block.language not in ("bash", "python"):
            assert block.marker is None, f"{block}: a run marker on a ```{block.language} block"
            continue
        where = f"{block}: a ```{block.language} block"
        assert block.marker is not None, f"{where} that does not say its scale: {HOW_TO_MARK}"
        assert block.marker == "cpu" or block.marker in NOT_RUN, f"{where} of kind {block.marker!r}: {HOW_TO_MARK}"
        if block.marker != "cpu":
            assert re.search(NOT_RUN[block.marker][1], prose_around(block.page, block)), (
                f"{block} (run: no, {block.marker}): the prose around it does not say its scale "
                f"(/{NOT_RUN[block.marker][1]}/)")


def test_every_page_with_commands_to_run_is_run_here():
    pages = {block.page for block in all_blocks() if block.marker == "cpu"}
    assert pages == set(PAGE_FIXTURES), f"pages to add to PAGE_FIXTURES: {pages - set(PAGE_FIXTURES)}"


def test_install_commands_name_only_defined_extras():
    defined = extras_defined()
    seen = 0
    for block in all_blocks():
        if block.language != "bash":
            continue
        for command in loop_body_commands(block):
            argv = words(command, ROOT, env={"i": "00000"})
            if argv[:2] != ["pip", "install"]:
                continue
            for target in (word for word in argv[2:] if not word.startswith("-")):
                seen += 1
                if block.marker == "ci" and not target.startswith("."):
                    continue  # torch's pin: the ci block equals .ci/run (next test)
                if argv == ["pip", "install", "torch", "--index-url", TORCH_CPU_INDEX]:
                    continue  # torch's CPU build, before the project (test_install_names_torch_for_a_cpu_first)
                match = re.fullmatch(r"\.(?:\[([a-z0-9_,-]+)\])?", target)
                assert match, f"{block}: pip install {target!r}: only the project itself, with extras"
                unknown = set((match.group(1) or "").split(",")) - {""} - defined
                assert not unknown, f"{block}: extras {sorted(unknown)} are not in pyproject.toml ({sorted(defined)})"
    assert seen >= 4


def test_install_names_torch_for_a_cpu_first():
    """Where people install: PyPI's Linux torch brings CUDA (GBs), so the CPU build comes first."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    first = text.index("## Install") + 1
    block = next(b for b in read_blocks("README.md") if b.line > text[:first].count("\n"))  # the section's
    commands = [words(command, ROOT) for command in logical_lines(block.text)]
    assert commands[:2] == [["pip", "install", "torch", "--index-url", TORCH_CPU_INDEX], ["pip", "install", "."]]


def test_readme_test_command_is_what_ci_runs():
    ci = [block for block in all_blocks() if block.marker == "ci"]
    assert [block.page for block in ci] == ["README.md"]
    assert commands(ci[0]) == ci_commands()
    assert ci_commands()[-3:] == ["ruff check", "mypy", "pytest -q -n 2"]


def check_bertforge_words(argv: list[str], where: str, log: Path) -> None:
    """A command of a block that is not run: the real parser takes it, and its config with the
    dotted overrides resolves."""
    from bertforge.cli import build_parser

    try:
        args, extra = build_parser().parse_known_args(argv)
    except SystemExit as stop:
        raise AssertionError(f"{where}: bertforge {' '.join(argv)}: the parser refuses it") from stop
    assert not extra or getattr(args, "takes_overrides", False), f"{where}: unknown options {extra}"
    if argv[0] == "pretrain" or argv[:2] == ["bench", "pretrain"]:
        config = getattr(args, "config", None) or "pretrain_tiny"
        log.unlink(missing_ok=True)
        status = run_bertforge(["config", "--config", config, *extra], ROOT, log)
        assert status == 0, f"{where}: {' '.join(argv)}: {log.read_text(encoding='utf-8')[-1000:]}"


def test_commands_that_are_not_run_parse(tmp_path):
    markers = re.search(r"markers = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(encoding="utf-8"), re.S)
    assert markers
    checked = 0
    for block in all_blocks():
        if block.marker in (None, "cpu", "ci"):
            continue
        for command in loop_body_commands(block):
            argv = words(command, ROOT, env={"i": "00000"})
            where = f"{block} ({block.marker})"
            checked += 1
            if argv[0] == "torchrun":
                assert argv.count("-m") and argv[argv.index("-m") + 1] == "bertforge", where
                argv = ["bertforge", *argv[argv.index("-m") + 2:]]
            if argv[0] == "bertforge":
                check_bertforge_words(argv[1:], where, tmp_path / "config.log")
            elif argv[:3] == ["python", "-m", "pytest"]:
                marker = argv[argv.index("-m", 3) + 1]
                assert f'"{marker}:' in markers.group(1), f"{where}: pytest marker {marker!r} is not defined"
                assert (ROOT / argv[-1]).is_dir(), where
            elif argv[:2] == ["python", "-m"]:
                assert importlib.util.find_spec(argv[2]) is not None, f"{where}: no module {argv[2]}"
            elif argv[0] == "python":
                assert (ROOT / argv[1]).is_file(), f"{where}: no script {argv[1]}"
            elif argv[0].endswith(".sh"):
                assert (ROOT / argv[0]).is_file(), f"{where}: no script {argv[0]}"
            elif argv[:2] == ["docker", "build"]:
                assert (ROOT / argv[argv.index("-f") + 1]).is_file(), f"{where}: no Dockerfile"
            elif argv[0] == "sbatch":
                script = next(a for a in argv[1:] if a.endswith(".sbatch"))
                assert (ROOT / script).is_file(), f"{where}: no batch script {script}"
            else:
                assert argv[:2] == ["pip", "install"], f"{where}: what is {argv[0]!r}?"
    assert checked >= 20


def github_anchor(heading: str) -> str:
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)
    return {github_anchor(m) for m in re.findall(r"^#{1,6}\s+(.*)$", text, flags=re.M)}


def test_relative_links_point_to_files_that_exist():
    checked = 0
    for page in PAGES:
        source = ROOT / page
        text = re.sub(r"^```.*?^```", "", source.read_text(encoding="utf-8"), flags=re.S | re.M)
        text = re.sub(r"`[^`\n]*`", "", text)
        for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue  # a URL
            path, _, anchor = target.partition("#")
            resolved = (source.parent / path).resolve() if path else source
            assert resolved.exists(), f"{page}: the link ({target}) points to {resolved}, which does not exist"
            if anchor and resolved.suffix == ".md":
                assert anchor in anchors(resolved), f"{page}: the link ({target}): no heading #{anchor}"
            checked += 1
    assert checked >= 20


def test_mlperf_cadence_in_the_docs_is_the_codes():
    from bertforge.training.mlperf import eval_interval_samples

    text = " ".join((ROOT / "docs" / "mlperf.md").read_text(encoding="utf-8").split())
    switch = next(batch for batch in range(1, 10_000) if eval_interval_samples(batch) > 150_000)
    assert (switch, eval_interval_samples(switch)) == (2172, 175_000)
    assert f"150,000 up to a batch of {switch - 1:,} and 175,000 from {switch:,} on" in text
    assert "(23023 × global batch + 300,000,000) // 50,000,000 × 25,000" in text  # the code's integers
    for batch, samples in ((3072, 175_000), (4096, 175_000), (8192, 225_000)):
        assert eval_interval_samples(batch) == samples
        assert f"{samples:,} for" in text and f"{batch}" in text
    assert "2,810" not in text  # the switch the docs once gave
    # the reference README's table agrees since mlcommons/training#483 (issue 33.4b: the docs said it gave 175,000)
    assert "225,000 for 8192, as the reference README's table" in text and "says 175,000" not in text


# ---------------------------------------------------------------- the pages, run

def cut_squad(source: Path, target: Path, questions: int) -> None:
    """The first questions of a SQuAD file, with their paragraphs, as a SQuAD file."""
    data = json.loads(source.read_text(encoding="utf-8"))
    paragraphs, left = [], questions
    for paragraph in data["data"][0]["paragraphs"]:
        if left <= 0:
            break
        paragraphs.append({**paragraph, "qas": paragraph["qas"][:left]})
        left -= len(paragraphs[-1]["qas"])
    article = {**data["data"][0], "paragraphs": paragraphs}
    target.write_text(json.dumps({"version": data["version"], "data": [article]}), encoding="utf-8")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("docs")
    squad = root / "squad"
    squad.mkdir()
    # 40 questions: a batch of squad_base's 32 rows an epoch, 2 steps in all
    cut_squad(shared_data("squad/train-v1.1-first44.json"), squad / "train-v1.1.json", 40)
    cut_squad(shared_data("squad/dev-v1.1.json"), squad / "dev-v1.1.json", 8)
    return root


def page_folder(workspace: Path, page: str) -> Path:
    folder = workspace / Path(page).stem
    folder.mkdir()
    return folder


def with_squad(workspace: Path, folder: Path) -> None:
    for name in ("train-v1.1.json", "dev-v1.1.json"):
        link(folder, name, workspace / "squad" / name)


@pytest.fixture(scope="module")
def readme(workspace, data_page) -> PageRun:
    folder = page_folder(workspace, "README.md")
    link(folder, "corpus", data_page.folder / "text" / "train")  # "your own text": the Wikipedia sample's
    with_squad(workspace, folder)
    return run_page("README.md", folder)


@pytest.fixture(scope="module")
def data_page(workspace) -> PageRun:
    folder = page_folder(workspace, "docs/data.md")
    dump = "wiki/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
    link(folder, "dumps/enwiki-latest-pages-articles.xml.bz2", shared_data(dump))
    return run_page("docs/data.md", folder)


@pytest.fixture(scope="module")
def tf1_checkpoint(workspace, data_page) -> Path:
    """A TF1 checkpoint named as MLPerf's (model.ckpt-28252), standing in for it: the data page's
    BERT-tiny exported with `bertforge export --format tf1`, so that its vocab is the records'."""
    exported, folder = workspace / "tf1-export", workspace / "ckpt"
    run = data_page.run_dir("--data.input records/")
    assert run_bertforge(["export", str(run), str(exported), "--format", "tf1"], workspace,
                         workspace / "export.log") == 0, (workspace / "export.log").read_text()
    folder.mkdir()
    for file in exported.glob("model.ckpt.*"):
        shutil.copy(file, folder / file.name.replace("model.ckpt.", "model.ckpt-28252."))
    shutil.copy(exported / "bert_config.json", folder / "bert_config.json")
    return folder


@pytest.fixture(scope="module")
def training(workspace, readme, data_page) -> PageRun:
    folder = page_folder(workspace, "docs/training.md")
    link(folder, "corpus", data_page.folder / "text" / "train")
    link(folder, "vocab.txt", shared_data("vocab/bert-base-uncased-vocab.txt"))
    link(folder, "runs/NAME", readme.folder / "runs" / "mine")
    link(folder, "runs/A", readme.folder / "runs" / "mine")
    link(folder, "runs/B", data_page.run_dir("--data.input records/"))
    with_squad(workspace, folder)
    return run_page("docs/training.md", folder)


@pytest.fixture(scope="module")
def scale(tmp_path_factory) -> PageRun:  # needs nothing from ../shared/data
    return run_page("docs/scale.md", page_folder(tmp_path_factory.mktemp("docs-scale"), "docs/scale.md"))


@pytest.fixture(scope="module")
def finetuning(workspace, readme) -> PageRun:
    folder = page_folder(workspace, "docs/finetuning.md")
    link(folder, "runs/NAME", readme.folder / "runs" / "mine")
    with_squad(workspace, folder)
    # GLUE and CoNLL cannot be downloaded here: tasks generated in their official formats.
    finetune_data.write_sst2(folder / "glue" / "SST-2")
    # small (the page shows the commands, test_finetune.py that they learn): the sweep's 4 runs in seconds
    finetune_data.write_mnli(folder / "glue" / "MNLI", train=48, dev=12, test=4)
    finetune_data.write_conll(folder / "conll", train=48, dev=16, test=8)
    return run_page("docs/finetuning.md", folder)


@pytest.fixture(scope="module")
def interop(workspace, data_page, tf1_checkpoint) -> PageRun:
    folder = page_folder(workspace, "docs/interop.md")
    run = data_page.run_dir("--data.input records/")
    link(folder, "runs/NAME", run)
    link(folder, "ckpt", tf1_checkpoint)
    link(folder, "records", data_page.folder / "records")
    link(folder, "vocab.txt", data_page.folder / "vocab.txt")
    (folder / "path" / "to").mkdir(parents=True)
    assert run_bertforge(["export", str(run), "path/to/hf-bert"], folder, workspace / "export-hf.log") == 0
    return run_page("docs/interop.md", folder)


@pytest.fixture(scope="module")
def mlperf(workspace, data_page, tf1_checkpoint) -> PageRun:
    folder = page_folder(workspace, "docs/mlperf.md")
    link(folder, "results/eval.txt", data_page.folder / "text" / "eval" / "eval.txt")
    link(folder, "vocab.txt", data_page.folder / "vocab.txt")
    for shard in sorted((data_page.folder / "records").glob("train-0000*.tfrecord")):
        link(folder, f"records/{shard.name}", shard)  # a directory of its own: its manifest is beside it
    link(folder, "ckpt", tf1_checkpoint)
    return run_page("docs/mlperf.md", folder)


@pytest.fixture(scope="module")
def benchmarks(workspace, data_page) -> PageRun:
    folder = page_folder(workspace, "docs/benchmarks.md")
    link(folder, "packed", data_page.folder / "packed")
    link(folder, "benchmarks.yml", ROOT / "benchmarks.yml")
    return run_page("docs/benchmarks.md", folder)


@pytest.fixture(scope="module")
def modernbert_page(workspace, data_page) -> PageRun:
    folder = page_folder(workspace, "docs/modernbert.md")
    link(folder, "text", data_page.folder / "text")  # the Wikipedia sample's sentences, held-out articles apart
    return run_page("docs/modernbert.md", folder)


PAGE_FIXTURES = {"README.md": readme, "docs/data.md": data_page, "docs/training.md": training,
                 "docs/scale.md": scale, "docs/finetuning.md": finetuning, "docs/interop.md": interop,
                 "docs/mlperf.md": mlperf, "docs/benchmarks.md": benchmarks, "docs/modernbert.md": modernbert_page}


@pytest.mark.slow
@pytest.mark.shared_data
def test_readme_main_job(readme):
    assert_all_ran(readme)
    run = readme.folder / "runs" / "mine"
    for name in ("config.yaml", "metrics.jsonl", "metadata.jsonl", "tensorboard", ".lock"):
        assert (run / name).exists(), name
    assert [s.name for s in (run / "checkpoints").iterdir()] == ["step_00000005"]  # --train.steps 5
    scores = json_lines(readme.result("bertforge squad train").output)
    assert set(scores[-1]) == {"exact_match", "f1"}


def readme_listing() -> tuple[set[str], list[str], set[str]]:
    """(the names, the checkpoint step directories, the files of a step directory) that the README's
    quick start lists in a run directory."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    listing = text.split("It prints where the run directory is:", 1)[1].split("```text\n", 1)[1].split("```")[0]
    lines = listing.splitlines()[1:]  # under runs/pretrain-YYYYmmdd-HHMMSS/
    names = {line.split()[0].rstrip("/") for line in lines if re.match(r"^  \S", line)}
    steps = [name.split("/")[1] for name in sorted(names) if name.startswith("checkpoints/")]
    files = set(re.findall(r"\b[a-z_]+\.(?:safetensors|pt|yaml|txt|json)\b",
                           "\n".join(line for line in lines if "checkpoints/" in line or line.startswith("    "))))
    return {name for name in names if not name.startswith("checkpoints/")} | {"checkpoints"}, steps, files


@pytest.mark.slow
@pytest.mark.shared_data
def test_readme_run_directory_listing_is_what_a_run_keeps(modernbert_page):
    """The quick start's listing against a run of its config (the ModernBERT page's first run: the
    default config, built-in corpus, 5 steps) and the checkpoints its 400 steps keep."""
    from bertforge.config import load_config

    names, steps, files = readme_listing()
    run = modernbert_page.run_dir("--train.steps 5")
    assert names == {p.name for p in run.iterdir()}
    assert files == {p.name for p in (run / "checkpoints" / "step_00000005").iterdir()}
    cfg = load_config("pretrain_tiny")  # what `bertforge pretrain` runs
    every, keep, total = cfg.checkpoint.every, cfg.checkpoint.keep, cfg.train.steps
    assert (every, keep, total) == (100, 3, 400)
    assert steps == [f"step_{step:08d}" for step in range(every, total + 1, every)][-keep:]


@pytest.mark.slow
@pytest.mark.shared_data
def test_data_page(data_page):
    assert_all_ran(data_page)
    folder = data_page.folder
    assert (folder / "wiki.jsonl").stat().st_size > 0
    assert (folder / "text" / "eval" / "eval.txt").is_file()
    assert len(list((folder / "text" / "train").glob("*.txt"))) == 8  # --shards 8
    shards = sorted((folder / "records").glob("train-*-of-00008.tfrecord"))
    assert len(shards) == 8
    assert all(shard.with_suffix(".index").is_file() for shard in shards)  # data index
    assert (folder / "records.md5").is_file()  # beside records/
    assert re.search(r"all \d+ files match", data_page.result("checksum records/ --verify").output)
    assert (folder / "eval" / "eval_10k.tfrecord").is_file()
    packed = data_page.result("data inspect packed/part-00000-of-00008.tfrecord").output.strip().splitlines()
    assert "packing factor" in packed[-1] and "padding" in packed[-1]
    assert len(list((folder / "packed").glob("part-*-of-00008.tfrecord"))) == 8
    assert len(list((folder / "packed-512").glob("train-*-of-00008.tfrecord"))) == 8


@pytest.mark.slow
@pytest.mark.shared_data
def test_training_page(training):
    import yaml

    assert_all_ran(training)
    resolved = yaml.safe_load(training.result("bertforge config").output)
    assert set(resolved) == {"model", "data", "train", "execution", "checkpoint", "log"}
    assert resolved["model"]["num_hidden_layers"] == 24
    profiled = training.run_dir("--profile 3:5") / "profile"
    rows = [json.loads(line) for line in (profiled.parent / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [row["sequences"] for row in rows if row.get("split") == "eval"] == [256, 256]  # --train.eval_batches 4
    squad_profiled = training.folder / "squad-profiled" / "profile"
    for folder in (profiled, squad_profiled):
        for name in ("trace.json", "tensorboard", "top_ops.txt", "memory.json"):
            assert (folder / name).exists(), folder / name
    for folder, window in ((profiled, range(3, 5)), (squad_profiled, range(1, 2))):  # one span per step
        spans = re.findall(r'"ProfilerStep#(\d+)"', (folder / "trace.json").read_text(encoding="utf-8"))
        assert sorted(map(int, spans)) == list(window), folder
    assert (training.folder / "report" / "index.html").is_file()
    assert list((training.folder / "report").glob("*.png"))


@pytest.mark.slow
@pytest.mark.shared_data
def test_modernbert_page(modernbert_page):
    import yaml

    assert_all_ran(modernbert_page)
    resolved = yaml.safe_load(modernbert_page.result("bertforge config").output)["model"]
    assert (resolved["family"], resolved["num_hidden_layers"], resolved["local_attention"]) == ("modernbert", 22, 128)
    run = modernbert_page.run_dir("--train.steps 5")
    assert yaml.safe_load((run / "config.yaml").read_text(encoding="utf-8"))["model"]["family"] == "modernbert"
    assert (run / "checkpoints" / "step_00000005" / "model.safetensors").is_file()
    plan = modernbert_page.result("bertforge plan").output  # the planner knows the family
    assert "149.7M parameters, 22 layers, hidden 768; micro-batch 8 × seq 1024" in plan and "\nfits in" in plan
    # the recipe at toy size: training rows of 39 slots, eval rows of 20, evaluated at steps 0, 2 and 4
    toy = modernbert_page.run_dir("--name mb-toy")
    rows = [json.loads(line) for line in (toy / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    evals = [row for row in rows if row.get("split") == "eval"]
    assert [row["step"] for row in evals] == [0, 2, 4] and all(row["predictions"] > 0 for row in evals)
    saved = yaml.safe_load((toy / "config.yaml").read_text(encoding="utf-8"))
    assert (saved["data"]["max_predictions"], saved["train"]["optimizer"], saved["train"]["schedule"]) == (
        39, "stableadamw", "wsd")
    assert [p.name for p in (toy / "checkpoints").iterdir()] == ["step_00000004"]


def test_scale_page(scale):
    assert_all_ran(scale)
    assert "fits in" in scale.result("bertforge plan").output


@pytest.mark.slow
@pytest.mark.shared_data
def test_finetuning_page(finetuning):
    assert_all_ran(finetuning)
    out = finetuning.folder / "squad-out"
    for name in ("config.yaml", "squad.yaml", "vocab.txt", "metrics.jsonl", "checkpoints", "model.safetensors",
                 "config.json"):
        assert (out / name).exists(), name
    # squad predict writes only the files it is given
    assert sorted(p.name for p in finetuning.folder.iterdir() if not p.name.startswith(".")) == [
        "conll", "dev-v1.1.json", "glue", "mnli-sweep", "nbest_predictions.json", "ner-out", "ner-test",
        "predictions.json", "runs", "squad-out", "sst2-hf", "sst2-out", "train-v1.1.json"]
    scores = json_lines(finetuning.result("squad evaluate").output)
    assert set(scores[-1]) == {"exact_match", "f1"}
    sst2 = finetuning.folder / "sst2-out"
    assert (sst2 / "submission" / "SST-2.tsv").read_text().startswith("index\tprediction\n0\t")
    dev = json.loads((sst2 / "scores.json").read_text())
    assert json_lines(finetuning.result("finetune predict --model sst2-out/").output)[-1] == dev
    sweep = json.loads((finetuning.folder / "mnli-sweep" / "sweep.json").read_text())
    assert [(r["lr"], r["seed"]) for r in sweep["runs"]] == [(3e-5, 1), (3e-5, 2), (5e-5, 1), (5e-5, 2)]
    assert json.loads((finetuning.folder / "sst2-hf" / "config.json").read_text())["architectures"] == [
        "BertForSequenceClassification"]
    assert set(json.loads((finetuning.folder / "ner-out" / "scores.json").read_text())) == {
        "precision", "recall", "f1", "accuracy"}
    assert (finetuning.folder / "ner-test" / "predictions" / "test.txt").is_file()
    answer = finetuning.result("squad ask").output
    assert "answer:" in answer and "transformers.BertForQuestionAnswering" in answer


@pytest.mark.slow
@pytest.mark.shared_data
def test_interop_page(interop):
    from transformers import BertForPreTraining

    assert_all_ran(interop)
    # heads the source lacks are initialised and reported; the export loads as the comment says
    assert "newly initialised: qa_outputs.weight, qa_outputs.bias" in interop.result("import bertforge").output
    BertForPreTraining.from_pretrained(interop.folder / "exported")
    assert (interop.folder / "hf-out" / "config.json").is_file()
    assert (interop.folder / "init" / "model.safetensors").is_file()
    tf1 = {p.name for p in (interop.folder / "tf1-out").iterdir()}
    assert {"checkpoint", "bert_config.json", "model.ckpt.index"} <= tf1
    assert any(name.startswith("model.ckpt.data-") for name in tf1)


@pytest.mark.slow
@pytest.mark.shared_data
def test_mlperf_page(mlperf):
    """The eval set, its checksums and the checkpoint read into our format. Its evaluation (`bertforge
    eval`, minutes even for the BERT-tiny stand-in) is marked long: tests/training/test_eval_cmd.py
    runs `bertforge eval` on our checkpoints, their Hugging Face and TF1 exports, on a record file."""
    assert_all_ran(mlperf)
    assert (mlperf.folder / "records.md5").is_file() and (mlperf.folder / "eval.md5").is_file()
    assert (mlperf.folder / "init" / "model.safetensors").is_file()
    from bertforge.data.record_reader import open_records

    picked = mlperf.folder / "eval" / "eval_10k.tfrecord"
    with open_records(picked) as records:  # --num 10000: all the text gives
        assert len(records) > 0
    # the data page's command on the same text: pick-eval picks the same records
    assert picked.read_bytes() == (mlperf.folder.parent / "data" / "eval" / "eval_10k.tfrecord").read_bytes()


@pytest.mark.slow
@pytest.mark.shared_data
def test_benchmarks_page(benchmarks):
    assert_all_ran(benchmarks)
    keys = {"seq_per_s", "rows_per_s", "tokens_per_s", "real_tokens_per_s", "global_batch", "flops_per_seq",
            "model_tflops", "peak_tflops", "mfu", "device_name"}
    for piece in ("--seq-len 128 --steps 5", "--data packed/"):
        result = json_lines(benchmarks.result(piece).output)[-1]
        assert keys <= set(result), piece
        assert result["mfu"] is None  # on the CPU, without --peak-tflops
    assert json_lines(benchmarks.result("--data packed/").output)[-1]["packed"] is True
    squad = json_lines(benchmarks.result("bench squad").output)[-1]
    assert "infer_seq_per_s" in squad and "train_seq_per_s" in squad  # training and inference
    listed = benchmarks.result("--list").output
    assert "pretrain_base_128" in listed and "squad_infer_base" in listed
    assert re.search(r"^pretrain_tiny_128: seq_per_s", benchmarks.result("--quick").output, flags=re.M)
