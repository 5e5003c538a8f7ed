"""Resumable, checksummed downloads over HTTP(S), for every data set we fetch.

:func:`download_file` brings one URL to one path. The bytes go to
``NAME.part`` and an interrupted transfer continues from that file's size with
an HTTP Range request, within one call (``retries``) or in a later call; a
server that ignores Range sends the whole file again and we start over. The
file is renamed to ``NAME`` only after its size and checksum matched; a
mismatch keeps the bytes as ``NAME.bad`` (then ``NAME.bad2`` ...) and raises,
so that a later call neither resumes nor trusts a corrupt file. A file already
at ``NAME`` is verified again and returned without downloading.

Errors are :class:`bertforge.data.errors.DataError`, in one line naming the URL.
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import os
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

from bertforge.fileio import fsync

from .errors import DataError

log = logging.getLogger(__name__)

# (hash algorithm as hashlib names it, lower-case hex digest)
Checksum = tuple[str, str]

HASH_BY_HEX_LENGTH = {32: "md5", 40: "sha1", 64: "sha256"}


def download_file(url: str, dest: str | Path, *, sha256: str | None = None, sha1: str | None = None,
                  md5: str | None = None, size: int | None = None, verify: bool = True,
                  chunk_size: int = 1 << 20, retries: int = 5, retry_wait: float = 2.0,
                  timeout: float = 60.0) -> Path:
    """Download ``url`` to the file ``dest`` and return ``dest`` once verified.

    At most one of ``sha256``, ``sha1`` and ``md5`` is the expected digest;
    ``size`` the expected number of bytes. Without a digest the download is
    refused unless ``verify=False`` (``size`` alone is then still checked).
    ``retries`` bounds the attempts in a row that add no byte; an attempt that
    makes progress resets the count. When they run out, ``dest.part`` is kept
    and a later call resumes it.
    """
    given = [(name, value) for name, value in (("sha256", sha256), ("sha1", sha1), ("md5", md5))
             if value is not None]
    if len(given) > 1:
        raise DataError(f"{url}: give one checksum, not {' and '.join(name for name, _ in given)}")
    expected = checked_digest(*given[0], flag=False) if given else None
    if expected is None and verify:
        raise DataError(f"{url}: no checksum to verify it against; give sha256, sha1 or md5 "
                        "(or turn verification off)")
    return fetch_verified(url, Path(dest), expected, size=size, chunk_size=chunk_size, retries=retries,
                          retry_wait=retry_wait, timeout=timeout)


def checked_digest(algorithm: str, value: str, flag: bool = True) -> Checksum:
    """(algorithm, digest) for a user-given hex digest, or a DataError naming it (as ``--sha1``
    when ``flag``, the command-line option, else as ``sha1=``)."""
    value = value.strip().lower()
    if len(value) != hashlib.new(algorithm).digest_size * 2 or not is_hex(value):
        name = f"--{algorithm} {value!r}" if flag else f"{algorithm}={value!r}"
        raise DataError(f"{name} is not a {algorithm} hex digest")
    return algorithm, value


def fetch_verified(url: str, final: Path, expected: Checksum | None, *, size: int | None = None,
                   chunk_size: int = 1 << 20, retries: int = 5, retry_wait: float = 2.0,
                   timeout: float = 60.0) -> Path:
    """:func:`download_file` for a checksum already parsed (None: check ``size`` only, if given)."""
    if final.exists():
        verify_file(final, expected, url, bad_name=None, size=size)
        log.info("%s is already here", final)
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    part = final.with_name(f"{final.name}.part")
    fetch(url, part, chunk_size, retries, retry_wait, timeout)
    verify_file(part, expected, url, bad_name=f"{final.name}.bad", size=size)
    os.replace(part, final)
    fsync(final.parent)
    return final


def is_hex(text: str) -> bool:
    return bool(re.fullmatch(r"[0-9a-f]+", text))


def hash_file(path: Path, algorithm: str) -> str:
    digest = hashlib.new(algorithm)
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def set_aside(path: Path, name: str) -> Path:
    """Rename ``path`` to ``name`` (then ``name2``, ``name3``...: never over an earlier one)."""
    target, n = path.with_name(name), 1
    while target.exists():
        n += 1
        target = path.with_name(f"{name}{n}")
    os.replace(path, target)
    return target


def verify_file(path: Path, expected: Checksum | None, url: str, bad_name: str | None,
                size: int | None = None) -> None:
    """Raise when ``path`` has not ``size`` bytes or does not hash to ``expected``; the bytes are
    moved to ``bad_name`` (a fresh download), or left in place (a file found there), never deleted."""
    problem = None
    actual_size = path.stat().st_size
    if size is not None and actual_size != size:
        problem = f"size mismatch: expected {size} bytes, got {actual_size}"
    elif expected is not None:
        algorithm, digest = expected
        actual = hash_file(path, algorithm)
        if actual != digest:
            problem = f"{algorithm} mismatch: expected {digest}, got {actual}"
    if problem is None:
        return
    where = f"{path} is left as it is; delete it to download again"
    if bad_name is not None:  # a later call must not resume a corrupt .part
        kept = set_aside(path, bad_name)
        where = f"the downloaded bytes are kept in {kept}; delete it and run again to download afresh"
    raise DataError(f"{url}: {problem}; {where}")


def content_range(value: str | None) -> tuple[int | None, int | None]:
    """(first byte, total size) from a Content-Range header; None where absent or '*'."""
    match = re.fullmatch(r"\s*bytes\s+(?:(\d+)-\d+|\*)/(\d+|\*)\s*", value or "")
    if not match:
        return None, None
    first, total = match.groups()
    return (int(first) if first else None), (int(total) if total and total != "*" else None)


def fetch(url: str, part: Path, chunk_size: int, retries: int, retry_wait: float, timeout: float) -> None:
    """Bring ``part`` to the full content of ``url``, resuming from its current size."""
    failures = 0
    while True:
        offset = part.stat().st_size if part.exists() else 0
        request = urllib.request.Request(url, headers={"User-Agent": "bertforge"})
        if offset:
            request.add_header("Range", f"bytes={offset}-")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                first, total = content_range(response.headers.get("Content-Range"))
                if offset and response.status == 206 and first == offset:
                    mode = "ab"
                else:
                    if offset:
                        log.warning("%s: the server did not resume at byte %d; starting over",
                                    url, offset)
                    mode, offset = "wb", 0
                    length = response.headers.get("Content-Length")
                    total = int(length) if length and length.isdigit() else None
                log.info("downloading %s from byte %d of %s", url, offset, total or "?")
                with open(part, mode) as f:
                    while chunk := response.read(chunk_size):
                        f.write(chunk)
                    size = f.tell()
                if total is not None and size != total:
                    raise http.client.IncompleteRead(b"", total - size)
                return
        except urllib.error.HTTPError as err:
            _, total = content_range(err.headers.get("Content-Range") if err.headers else None)
            if err.code == 416 and offset and total == offset:
                return  # the .part file already holds every byte
            if err.code == 416 and offset:
                # The .part is longer than the file: it is not this file's prefix.
                bad = set_aside(part, part.name[:-len(".part")] + ".bad")
                log.warning("%s is longer than %s; moved it to %s and starting over", part, url, bad)
                continue
            raise DataError(f"{url}: HTTP error {err.code} {err.reason}") from None
        except (OSError, http.client.HTTPException) as err:
            grown = (part.stat().st_size if part.exists() else 0) > offset
            failures = 0 if grown else failures + 1
            if failures > retries:
                kept = part.stat().st_size if part.exists() else 0
                raise DataError(f"{url}: download failed ({type(err).__name__}: {err}); {part} keeps "
                                f"{kept} bytes, run again to resume") from None
            log.warning("%s: %s: %s; retrying", url, type(err).__name__, err)
            time.sleep(retry_wait * failures)
