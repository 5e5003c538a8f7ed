"""Writing files so that nothing half-written is ever taken for whole.

A directory (a checkpoint, an export) or a file (a shard) is written under a
hidden temporary name next to its final one, flushed to disk, and renamed
only when complete; a crash leaves at most a hidden temporary behind, which
:func:`remove_temporaries` clears at the next start.

A write that fails because the disk is full or the directory is read-only
raises :class:`WriteError` with one line naming the path (and, for a full
disk, the space the write needed), after removing what it had written.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

# What atomic_directory and atomic_file leave behind when killed: ".NAME.tmp-XXXX", ".NAME.old-XXXX".
TEMPORARY = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-[A-Za-z0-9_]+$")


class WriteError(OSError):
    """A write the user can fix: a full disk or a read-only directory; the message names the path."""


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def _megabytes(size: int) -> str:
    return f"{size / 2**20:.1f} MB"


def write_failure(err: BaseException, final: Path, needed: int, written: int = 0) -> str | None:
    """One line explaining a failed write of ``final`` when the disk is full or read-only, else None.

    torch.save and safetensors do not raise OSError on a full disk (``basic_ios::clear``,
    ``IoError``), so the free space decides when the error carries no errno: a
    write that needed more than was left failed for want of space.
    """
    code = getattr(err, "errno", None)
    parent = final.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    try:
        free = shutil.disk_usage(parent).free
    except OSError:
        free = None
    if code == errno.ENOSPC or (code is None and free is not None and free < max(needed - written, 1)):
        return (f"cannot write {final}: the disk is full (it needs {_megabytes(needed)}, "
                f"{_megabytes(free or 0)} free on {parent} after removing the partial write)")
    if code in (errno.EROFS, errno.EACCES, errno.EPERM) or not os.access(parent, os.W_OK):
        reason = "read-only file system" if code == errno.EROFS else "permission denied"
        return f"cannot write {final}: {parent} is not writable ({reason})"
    return None


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
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
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
        message = write_failure(err, final, needed)
        if message is None:
            raise
        raise WriteError(message) from None
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
        written = _size(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        message = None if isinstance(err, WriteError) else write_failure(err, final, needed, written)
        if message is None:
            raise
        raise WriteError(message) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def atomic_file(final: Path) -> Iterator[Path]:
    """Yield a temporary path that becomes ``final`` when the block succeeds.

    Write the file at the yielded path; on an error it is removed and ``final``
    is left as it was.
    """
    final = Path(final)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{final.name}.tmp-", dir=final.parent)
    except OSError as err:
        message = write_failure(err, final, 0)
        if message is None:
            raise
        raise WriteError(message) from None
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        tmp.chmod(0o644)  # mkstemp makes it private; outputs are shared data
        fsync(tmp)
        os.replace(tmp, final)
        fsync(final.parent)
    except OSError as err:
        written = _size(tmp)
        tmp.unlink(missing_ok=True)
        message = None if isinstance(err, WriteError) else write_failure(err, final, written, written)
        if message is None:
            raise
        raise WriteError(message) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
