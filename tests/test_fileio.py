"""Atomic writes: the final name appears only when the content is complete."""

import os
import re
from pathlib import Path

import pytest

from bertforge.fileio import WriteError, atomic_directory, atomic_file, atomic_files, live_holder, refuse_live_runs


def test_atomic_file_appears_only_on_success(tmp_path):
    final = tmp_path / "shard.bin"
    with atomic_file(final) as tmp:
        tmp.write_bytes(b"abc")
        assert not final.exists() and tmp.name.startswith(".shard.bin.tmp-")
    assert final.read_bytes() == b"abc"
    with pytest.raises(RuntimeError):
        with atomic_file(final) as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("crash")
    assert final.read_bytes() == b"abc"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard.bin"]


def test_atomic_directory_replaces_whole_or_not_at_all(tmp_path):
    final = tmp_path / "step"
    with atomic_directory(final) as tmp:
        (tmp / "a").write_text("1")
    with pytest.raises(RuntimeError):
        with atomic_directory(final) as tmp:
            (tmp / "a").write_text("2")
            raise RuntimeError("crash")
    assert (final / "a").read_text() == "1"
    with atomic_directory(final) as tmp:
        (tmp / "b").write_text("3")
    assert sorted(p.name for p in final.iterdir()) == ["b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step"]


def test_sizes_in_messages_have_units():
    from bertforge.fileio import format_size

    assert [format_size(n) for n in (0, 1, 1023, 1024, 1536, 2**20 - 1, int(50.7 * 2**20), 3 * 2**30, 5 * 2**40)] \
        == ["0 bytes", "1 byte", "1023 bytes", "1.0 KiB", "1.5 KiB", "1.0 MiB", "50.7 MiB", "3.0 GiB", "5.0 TiB"]


@pytest.mark.smoke
def test_atomic_files_appear_together_or_not_at_all(tmp_path, monkeypatch):
    """A failure at the last file, in its block or when it is renamed into place, leaves none of them."""
    import errno
    import os

    from bertforge import fileio

    finals = [tmp_path / f"part-{i}" for i in range(3)]
    (tmp_path / "mine.txt").write_text("the user's")

    def write_all(staged):
        assert all(p.parent.name.startswith(".part-0.tmp-") for p in staged) and not any(f.exists() for f in finals)
        for path, final in zip(staged, finals):
            with atomic_file(path) as tmp:
                tmp.write_text(final.name)

    with pytest.raises(RuntimeError), atomic_files(finals) as staged:
        write_all(staged)
        raise RuntimeError("crash")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.txt"]

    replace = os.replace

    def third_fails(src, dst):
        if dst == finals[2]:
            raise OSError(errno.ENOSPC, "No space left on device")
        replace(src, dst)

    monkeypatch.setattr(fileio.os, "replace", third_fails)
    with pytest.raises(WriteError) as err, atomic_files(finals) as staged:
        write_all(staged)
    monkeypatch.undo()
    assert str(err.value).startswith(f"cannot write {finals[0]} … part-2 (3 files): the disk is full (it needs "
                                     f"more than the ")
    assert str(err.value).endswith(f" free on {tmp_path} after removing the partial write)")
    assert "\n" not in str(err.value) and sorted(p.name for p in tmp_path.iterdir()) == ["mine.txt"]

    with atomic_files(finals) as staged:
        write_all(staged)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.txt", "part-0", "part-1", "part-2"]
    assert [f.read_text() for f in finals] == ["part-0", "part-1", "part-2"]


def test_a_full_disk_or_read_only_directory_under_atomic_files_names_the_final_paths(tmp_path, monkeypatch,
                                                                                     make_read_only):
    import errno

    from bertforge import fileio

    finals = [tmp_path / "out" / f"s-{i}.bin" for i in range(2)]
    fsync = fileio.fsync

    def full(path):
        if path.name.startswith(".s-1.bin.tmp-"):  # the second file, when atomic_file completes it
            raise OSError(errno.ENOSPC, "No space left on device")
        fsync(path)

    monkeypatch.setattr(fileio, "fsync", full)
    with pytest.raises(WriteError) as err, atomic_files(finals) as staged:
        for path in staged:
            with atomic_file(path) as tmp:
                tmp.write_bytes(b"x" * 1000)
    monkeypatch.undo()
    where = re.escape(f"cannot write {finals[0]} … s-1.bin (2 files): the disk is full (it needs more than the ")
    assert re.fullmatch(rf"{where}[0-9.]+ (bytes|KiB|MiB|GiB|TiB) free on {re.escape(str(tmp_path / 'out'))} after "
                        r"removing the partial write\)", str(err.value)), str(err.value)
    assert list((tmp_path / "out").iterdir()) == []

    read_only = make_read_only(tmp_path / "out")
    where = re.escape(f"cannot write {finals[0]} … s-1.bin (2 files): {read_only} is not writable")
    with pytest.raises(WriteError, match=rf"^{where} \((read-only file system|permission denied)\)$"):
        with atomic_files(finals):
            pass


# ------------------------------------------------------------ a live run's directory is never replaced (issue 27)


def test_refuse_live_runs_names_a_live_run_in_around_or_below_a_path(tmp_path, monkeypatch):
    from bertforge.runs import RunLock

    run, stale = tmp_path / "runs" / "live", tmp_path / "runs" / "stale"
    run.mkdir(parents=True)
    stale.mkdir()
    (stale / ".lock").write_text("pid 1 on a machine that failed\n")  # a lock file no process holds
    refuse_live_runs(tmp_path)
    with RunLock(run):
        for path in (run, run / "checkpoints" / "new", tmp_path):  # the run's, inside it, holding it
            with pytest.raises(WriteError) as err:
                refuse_live_runs(path)
            assert re.fullmatch(rf"{re.escape(str(path))}: {re.escape(str(run))} is the directory of a live run "
                                rf"\(pid {os.getpid()} on .+\); --overwrite would replace its files: wait for it to "
                                rf"end, or choose another output", str(err.value))
        refuse_live_runs(stale)
        monkeypatch.chdir(run.parent)
        refuse_live_runs(Path("live"), own=Path("live/.lock"))  # the run that clears its own directory
    refuse_live_runs(tmp_path)  # released


def test_a_lock_taken_on_a_run_directory_removed_meanwhile_is_taken_again(tmp_path, monkeypatch):
    """A run that opens the lock file just before the run holding it removes its directory (having
    nothing to keep) and ends gets the lock of a removed file: that is no lock of the directory,
    which it makes again and locks."""
    import fcntl

    from bertforge import runs

    run = tmp_path / "run"
    first = runs.RunLock(run, create=True).__enter__()
    assert first.created
    flock, removed = fcntl.flock, []

    def removed_before_locked(fd, operation):
        if not removed:  # the first run, between our open and our lock
            removed.append(run)
            runs.remove_run_dir(run)
            first.__exit__()
        flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", removed_before_locked)
    with runs.RunLock(run, create=True) as second:
        monkeypatch.undo()
        assert removed == [run] and second.created
        assert (live_holder(run / ".lock") or "").startswith(f"pid {os.getpid()} on ")
