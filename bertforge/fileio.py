"""Writing files so that nothing half-written is ever taken for whole.

A directory (a checkpoint, an export) or a file (a shard) is written under a
hidden temporary name next to its final one, flushed to disk, and renamed
only when complete; a crash leaves at most a hidden temporary behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


def fsync(path: Path) -> None:
    """Flush a file, or a directory's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Yield an empty temporary directory that becomes ``final`` when the block succeeds.

    An existing ``final`` is replaced only then; on an error the temporary is removed.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        tmp.chmod(0o755)  # mkdtemp makes it private; outputs are shared data
        for file in tmp.iterdir():
            fsync(file)
        if final.exists():  # move the old one aside, delete it once the new one is in place
            old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
            os.replace(final, old / final.name)
            os.replace(tmp, final)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final)
        fsync(final.parent)
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
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{final.name}.tmp-", dir=final.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        tmp.chmod(0o644)  # mkstemp makes it private; outputs are shared data
        fsync(tmp)
        os.replace(tmp, final)
        fsync(final.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
