"""Shared test helpers: where the real data in ../shared/data lives, a small real disk, a live run, and
waits and clocks that no load can break (issue 41.6)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests import bert_reference
# No test reaches the Hugging Face hub (a model id is looked up in a test's own cache, or on a local
# stand-in: tests/hub_server.py); huggingface_hub reads this when first imported, and subprocesses inherit it.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("BERTFORGE_TEST_DATA", Path(__file__).parents[1] / ".." / "shared" / "data"))


@contextlib.contextmanager
def tmpfs(directory: Path, size: str) -> Iterator[Path]:
    """A small tmpfs mounted on ``directory`` (a real full disk), or a skip where it cannot be
    mounted (not root, a container without the right); unmounted afterwards."""
    import subprocess

    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=False)


def shared_data(relative: str) -> Path:
    """A file under ../shared/data, or a skip naming it when absent."""
    path = DATA / relative
    if not path.exists():
        pytest.skip(f"shared test data not found: {path} (set BERTFORGE_TEST_DATA)")
    return path


@pytest.fixture
def make_read_only(monkeypatch):
    """A function that makes a directory unwritable until the test ends, and returns it.

    For a user: chmod 0o555. Root ignores permissions, so for root: a read-only bind
    mount ("read-only file system"); where root cannot mount (a container without
    the right), creating a file or directory in it fails with EACCES, as chmod would
    make it: tempfile's mkstemp and mkdtemp, through which bertforge.fileio makes
    every file and directory it writes.
    """
    import errno
    import subprocess
    import tempfile

    undo = []
    unwritable: list[Path] = []

    def refuse(make):
        def made(*args, **kwargs):
            where = kwargs.get("dir", args[2] if len(args) > 2 else None)
            if where is not None and Path(where).resolve() in unwritable:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(where))
            return make(*args, **kwargs)
        return made

    def make(directory: Path) -> Path:
        directory = Path(directory)
        if os.geteuid() != 0:
            directory.chmod(0o555)
            undo.append(lambda: directory.chmod(0o755))
            return directory
        mounted = subprocess.run(["mount", "--bind", str(directory), str(directory)], capture_output=True,
                                 check=False).returncode == 0
        if mounted:
            undo.append(lambda: subprocess.run(["umount", "-l", str(directory)], check=False))
            if subprocess.run(["mount", "-o", "remount,bind,ro", str(directory)], capture_output=True,
                              check=False).returncode == 0:
                return directory
        if not unwritable:
            monkeypatch.setattr(tempfile, "mkstemp", refuse(tempfile.mkstemp))
            monkeypatch.setattr(tempfile, "mkdtemp", refuse(tempfile.mkdtemp))
        unwritable.append(directory.resolve())
        return directory

    yield make
    for step in reversed(undo):
        step()


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """A function that puts a model directory into a local Hugging Face cache under ``tmp_path`` as
    huggingface_hub lays one out (``models--ORG--NAME/snapshots/REVISION``, ``refs/main`` naming
    it) and returns the snapshot; the cache is this test's (``HF_HUB_CACHE``), offline."""
    import shutil

    import huggingface_hub.constants

    cache = tmp_path / "hf-cache"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))  # read when a lookup runs
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))  # for commands run in a subprocess
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def put(model_dir: Path, model_id: str) -> Path:
        repo = cache / f"models--{model_id.replace('/', '--')}"
        revision = "0" * 40
        snapshot = repo / "snapshots" / revision
        shutil.copytree(model_dir, snapshot)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(revision)
        return snapshot

    return put


HOLD_LOCK = """
import sys, time
from pathlib import Path
from bertforge.runs import RunLock
with RunLock(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(120)
"""


@contextlib.contextmanager
def live_run(run_dir: Path) -> Iterator[subprocess.Popen]:
    """Another process holding ``run_dir``'s lock, as a live run does, until the block ends; then it
    is killed, as a machine failure would kill it, with no chance to release anything. About 0.2 s."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(run_dir)], env=env, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        yield holder
    finally:
        holder.kill()
        holder.wait()


# What ends a wait that never ends (a hung process), far beyond the slowest wait on a loaded machine. It
# stops the test; it does not judge its speed: the waits below end on an event (tests/test_suite_rules.py).
HANG_GUARD_S = 900.0


def wait_until(done: Callable[[], bool], *processes: subprocess.Popen, what: str) -> None:
    """Poll ``done`` until it holds. Fails as soon as one of ``processes`` exits first, with its
    status and the end of its stderr (when piped); a hang ends at :data:`HANG_GUARD_S`."""
    guard = time.monotonic() + HANG_GUARD_S
    while not done():
        for process in processes:
            if process.poll() is not None:
                err = process.communicate()[1] if process.stderr is not None else ""
                raise AssertionError(f"{what}: a process exited first (status {process.returncode}): "
                                     f"{(err or '')[-3000:]}")
        if time.monotonic() > guard:
            raise TimeoutError(f"{what}: still waiting after {HANG_GUARD_S:.0f} s, a hang")
        time.sleep(0.02)


class SteadyClock:
    """A stand-in for the ``time`` module of a module under test: each ``perf_counter()`` reads
    ``tick`` seconds after the one before, so every timed stretch lasts exactly ``tick`` and the
    rates made from it are exact numbers, however loaded the machine (the rest is ``time``'s)."""

    def __init__(self, tick: float):
        self.tick, self.reads = tick, 0

    def perf_counter(self) -> float:
        self.reads += 1
        return self.reads * self.tick

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)
