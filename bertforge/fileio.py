"""Writing files so that nothing half-written is ever taken for whole.

A directory (a checkpoint, an export) or a file (a shard) is written under a
hidden temporary name next to its final one, flushed to disk, and renamed
only when complete; a crash leaves at most a hidden temporary behind, which
:func:`remove_temporaries` clears at the next start. A set of files that is
whole only when all are (the shards of a data set) is written into a hidden
temporary directory and renamed into place together (:func:`atomic_files`).

A write that fails because the disk is full or the directory is read-only
raises :class:`WriteError` with one line naming the path (and, for a full
disk, the space the write needed), after removing what it had written.

Nothing of a live run is replaced: a run holds an ``flock`` on ``RUN/.lock``
while it writes there (``runs.RunLock``), and :func:`refuse_live_runs` refuses
an output that would replace or clear a directory such a run is in, or holds.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TextIO

LOCK = ".lock"  # a run directory's lock: flock'd by the run that writes there (runs.RunLock)
# What atomic_directory and atomic_file leave behind when killed: ".NAME.tmp-XXXX", ".NAME.old-XXXX".
TEMPORARY = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-[A-Za-z0-9_]+$")
_NEARLY_FULL = 1 << 20  # bytes: what a write that failed without an errno left free on a full disk, at most


class WriteError(OSError):
    """A write the user can fix: a full disk, a read-only directory or a live run's directory in
    the way; the message names the path."""


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def format_size(size: int) -> str:
    """``size`` bytes for a message: in bytes below 1 KiB, else in KiB, MiB, GiB or TiB (one decimal)."""
    if size < 1024:
        return f"{size} byte{'' if size == 1 else 's'}"
    value = float(size)
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if round(value, 1) < 1024:
            return f"{value:.1f} {unit}"
    return f"{value / 1024:.1f} TiB"


def write_failure(err: BaseException, final: Path, needed: int, written: int = 0,
                  what: str | None = None) -> WriteError | None:
    """The WriteError for a failed write of ``final`` when the disk is full or read-only, else None.

    Its message is one line naming ``what`` (default: ``final``); its ``errno`` is
    ENOSPC for a full disk, else the read-only or permission error, so that an
    outer writer can name the error again for its own path. ``needed`` is what
    the write needed in all, when known (else 0); ``written`` what it had written
    when it failed, still on disk: the caller removes it after this call (the failing
    writer may hold its file open until the error is gone, so that its space is not
    free before), and what is free now and ``written`` are what is free then.

    torch.save and safetensors raise no OSError on a full disk (``basic_ios::clear``,
    ``inline_container.cc``, ``SafetensorError``), so the free space decides when the error
    carries no errno: a write that left less free than it still needed, or less than
    ``_NEARLY_FULL`` (``needed`` is an estimate, or unknown), failed for want of space.
    """
    code = getattr(err, "errno", None)
    what = str(final) if what is None else what
    parent = final.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    try:
        free: int | None = shutil.disk_usage(parent).free
    except OSError:
        free = None
    if code == errno.ENOSPC or (code is None and free is not None and free < max(needed - written, _NEARLY_FULL)):
        after = (free or 0) + written  # once the partial write is removed
        left = f"{format_size(after)} free on {parent}"
        # A stream's size is not known beforehand (nor is a write's overhead): only that what was free did not do.
        space = f"it needs {format_size(needed)}, {left}" if after < needed else f"it needs more than the {left}"
        error = WriteError(f"cannot write {what}: the disk is full ({space} after removing the partial write)")
        error.errno = errno.ENOSPC
        return error
    if code in (errno.EROFS, errno.EACCES, errno.EPERM) or not os.access(parent, os.W_OK):
        reason = "read-only file system" if code == errno.EROFS else "permission denied"
        error = WriteError(f"cannot write {what}: {parent} is not writable ({reason})")
        error.errno = code if code in (errno.EROFS, errno.EPERM) else errno.EACCES
        return error
    return None


def holder(lock: TextIO) -> str:
    """The name a run wrote into its lock file (pid, host, since when), for an error naming it."""
    lock.seek(0)
    return lock.read().strip() or "a process that has not written its name yet"


def live_holder(lock: Path) -> str | None:
    """The name of the live process that holds the lock file ``lock``, or None when none does.

    Tested by taking a shared lock for an instant: a run holds it exclusively.
    """
    try:
        file = open(lock, encoding="utf-8")
    except OSError:  # gone, or not a file we can read: no run of ours holds it
        return None
    with file:
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return holder(file)
        return None  # closing releases it


def refuse_live_runs(path: Path, own: Path | None = None) -> None:
    """Refuse, with a WriteError naming the run and its process, to replace or clear ``path`` while
    a live run writes there: one whose lock is in ``path`` (a directory), below it or in a
    directory above it. ``own`` is a lock this process holds (the run that clears its directory).
    """
    path, own = Path(path).absolute(), Path(own).absolute() if own else None
    locks = [parent / LOCK for parent in (path, *path.parents)]
    if path.is_dir() and not path.is_symlink():
        locks += [Path(root) / LOCK for root, _, names in os.walk(path) if LOCK in names]
    for lock in dict.fromkeys(locks):  # path's own once
        if lock != own and (name := live_holder(lock)) is not None:
            error = WriteError(f"{path}: {lock.parent} is the directory of a live run ({name}); --overwrite "
                               f"would replace its files: wait for it to end, or choose another output")
            error.errno = errno.EBUSY
            raise error


def remove(path: Path) -> None:
    """Remove a file, a link (not what it points to) or a directory and all it holds."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def remove_temporaries(directory: Path) -> list[Path]:
    """Remove what interrupted atomic writes left in ``directory``; the paths removed.

    A ``.NAME.old-*`` directory holding ``NAME`` while ``NAME`` itself is
    missing was killed between its two renames: the old copy goes back in place.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    removed = []
    for entry in sorted(directory.iterdir()):
        match = TEMPORARY.match(entry.name)
        if match is None:
            continue
        name = match.group("name")
        if match.group("kind") == "old" and (entry / name).exists() and not (directory / name).exists():
            os.replace(entry / name, directory / name)
        remove(entry)
        removed.append(entry)
    if removed:
        fsync(directory)
    return removed


def fsync(path: Path) -> None:
    """Flush a file, or a directory's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_directory(final: Path, needed: int = 0) -> Iterator[Path]:
    """Yield an empty temporary directory that becomes ``final`` when the block succeeds.

    An existing ``final`` is replaced only then; on an error the temporary is
    removed. ``needed`` (bytes, an estimate of what the block writes) is named
    in the :class:`WriteError` raised when the disk fills up.
    """
    final = Path(final)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    except OSError as err:
        error = write_failure(err, final, needed)
        if error is None:
            raise
        raise error from None
    try:
        yield tmp
        tmp.chmod(0o755)  # mkdtemp makes it private; outputs are shared data
        for file in tmp.rglob("*"):
            fsync(file)
        fsync(tmp)
        if final.exists():  # move the old one aside, delete it once the new one is in place
            old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
            os.replace(final, old / final.name)
            os.replace(tmp, final)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final)
        fsync(final.parent)
    except Exception as err:
        error = None if isinstance(err, WriteError) else write_failure(err, final, needed, _size(tmp))
        shutil.rmtree(tmp, ignore_errors=True)
        if error is None:
            raise
        raise error from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def atomic_file(final: Path, needed: int = 0) -> Iterator[Path]:
    """Yield a temporary path that becomes ``final`` when the block succeeds.

    Write the file at the yielded path; on an error it is removed and ``final``
    is left as it was. ``needed`` (bytes, when known) is named in the
    :class:`WriteError` raised when the disk fills up.
    """
    final = Path(final)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{final.name}.tmp-", dir=final.parent)
    except OSError as err:
        error = write_failure(err, final, needed)
        if error is None:
            raise
        raise error from None
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        tmp.chmod(0o644)  # mkstemp makes it private; outputs are shared data
        fsync(tmp)
        os.replace(tmp, final)
        fsync(final.parent)
    except Exception as err:  # safetensors and torch.save raise no OSError on a full disk
        error = None if isinstance(err, WriteError) else write_failure(err, final, needed, _size(tmp))
        tmp.unlink(missing_ok=True)
        if error is None:
            raise
        raise error from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_files(finals: Sequence[Path], needed: int = 0, *, named: Sequence[Path] = ()) -> Iterator[list[Path]]:
    """Yield one temporary path per file of ``finals``; they become ``finals`` together, when the block succeeds.

    For a set of files that is only whole when all are, such as the shards of
    one data set: the block writes every file at its temporary path (with
    :func:`atomic_file` or any other way), in a hidden directory next to the
    first final path (``finals`` share its directory), and only then are all
    renamed into place. On an error the hidden directory and all it holds go,
    and no final path is touched; a full disk or a read-only directory is a
    :class:`WriteError` naming the final paths, or ``named`` (the ones a user asked for, when others
    come with them), and ``needed`` (bytes, when known).
    """
    finals = [Path(f) for f in finals]
    shown = [Path(f) for f in named] or finals
    parent = finals[0].parent
    if any(final.parent != parent for final in finals):
        raise ValueError(f"atomic_files: {finals} are not all in {parent}")
    what = str(shown[0]) if len(shown) == 1 else f"{shown[0]} … {shown[-1].name} ({len(shown)} files)"
    try:
        parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{finals[0].name}.tmp-", dir=parent))
    except OSError as err:
        error = write_failure(err, finals[0], needed, what=what)
        if error is None:
            raise
        raise error from None
    staged = [staging / final.name for final in finals]
    moved: list[tuple[Path, Path]] = []
    try:
        yield staged
        for path in staged:
            fsync(path)
        for path, final in zip(staged, finals):
            os.replace(path, final)
            moved.append((final, path))
        fsync(parent)
    except BaseException as err:
        for final, path in reversed(moved):  # a rename that failed: the others go back, nothing is half there
            with contextlib.suppress(OSError):
                os.replace(final, path)
        # As atomic_file: safetensors and torch.save raise no OSError on a full disk.
        error = write_failure(err, finals[0], needed, _size(staging), what) if isinstance(err, Exception) else None
        shutil.rmtree(staging, ignore_errors=True)
        if error is None:
            raise
        raise error from None
    shutil.rmtree(staging, ignore_errors=True)  # empty: every file is in place
