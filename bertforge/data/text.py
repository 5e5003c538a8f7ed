"""Text input of the data commands: which files the arguments name, and the documents in them.

One implementation for every reader of text (and for finding record shards),
so that all of them agree on what a path, a line, a blank line and a bad byte are:

* :func:`expand_inputs` -- files, globs and directories → a list of files, in
  order; a one-line :class:`.errors.DataError` naming what matched nothing.
* :func:`read_documents` -- google-research/bert's text format, streamed: a line
  is split at ``\\n`` only and stripped with ``str.strip``, a blank line ends a
  document. Bytes that are not UTF-8 are an error naming the file and byte offset.
* :func:`chunk_ranges` and :func:`read_ranges` -- the same input cut after
  blank lines into byte ranges, and the documents of such ranges: how the
  parallel ``bertforge data create`` workers each read their own share.
* :func:`read_lines` -- numbered lines, for line-oriented formats (``.jsonl``).
"""

from __future__ import annotations

import fnmatch
import glob
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from .errors import DataError

BLOCK_BYTES = 1 << 22  # bytes read at a time
TEXT_PATTERNS = ("*.txt",)  # what a directory of text stands for

Range = tuple[str, int, int | None]  # (path, start, stop) of input bytes; stop None: to the end


# ---------------------------------------------------------------- which files

def expand_inputs(inputs: Iterable[str | Path], *, patterns: Sequence[str] = TEXT_PATTERNS,
                  skip: Sequence[str] = (), globs: bool = True, what: str = "input") -> list[Path]:
    """The files named by paths, directories and (with ``globs``) glob patterns, in the order given.

    A directory stands for its files (not its subdirectories) whose names match
    one of ``patterns`` and none of ``skip`` (``fnmatch`` patterns), sorted;
    with no ``patterns`` a directory is an error. A path that is neither a file
    nor a directory is, with ``globs``, a glob pattern whose matching files are
    taken in sorted order. The callers differ only in these parameters: text
    readers take ``*.txt`` (``preprocess`` also ``*.jsonl``; only ``create``
    globs), ``pick-eval`` names record files one by one, and the training
    loader takes every file of a directory but index and hidden files.

    Errors, each naming the path: a directory without such files, a path (or
    pattern) that matches nothing (``"{what} not found: PATH"``), no inputs at all.
    """
    files: list[Path] = []
    for item in inputs:
        text = str(item)
        path = Path(text)
        if path.is_dir():
            if not patterns:
                raise DataError(f"{path} is a directory; name the files")
            found = sorted(p for p in path.iterdir() if _matches(p.name, patterns, skip) and p.is_file())
            if not found:
                raise DataError(f"{path}: no {' or '.join(patterns)} files in this directory")
        elif path.is_file():
            found = [path]
        elif globs:
            found = [Path(p) for p in sorted(glob.glob(text)) if Path(p).is_file()]
            if not found:
                raise DataError(f"{what} not found: {text}")
        else:
            raise DataError(f"{what} not found: {path}")
        files.extend(found)
    if not files:
        raise DataError("no input files given")
    return files


def _matches(name: str, patterns: Sequence[str], skip: Sequence[str]) -> bool:
    return (any(fnmatch.fnmatch(name, p) for p in patterns)
            and not any(fnmatch.fnmatch(name, s) for s in skip))


# ---------------------------------------------------------------- documents

def read_documents(files: Iterable[str | Path], *, across_files: bool = True, strip_bom: bool = False,
                   block_bytes: int = BLOCK_BYTES) -> Iterator[list[str]]:
    """Documents (lists of stripped, non-blank lines) of text files, streamed.

    The defaults read as the reference ``create_pretraining_data.py`` does: a
    document runs on into the next file unless a blank line ends it, and a
    byte order mark is text like any other. ``across_files=False`` ends a
    document at the end of its file and ``strip_bom=True`` drops a file's
    leading U+FEFF, as the corpus readers of ``pretrain`` and ``preprocess`` do.
    """
    return read_ranges([(str(path), 0, None) for path in files], across_files=across_files,
                       strip_bom=strip_bom, block_bytes=block_bytes)


def read_ranges(ranges: Iterable[Range], *, across_files: bool = True, strip_bom: bool = False,
                block_bytes: int = BLOCK_BYTES) -> Iterator[list[str]]:
    """:func:`read_documents` of byte ranges ``(path, start, stop)`` (``stop`` None: to the end).

    Each range must start at a line start. With ``across_files`` a range's first
    document continues the previous range's last one, as across files; without,
    the end of a range ends its document. ``strip_bom`` applies to ranges that
    start a file.
    """
    current: list[str] = []
    for path, start, stop in ranges:
        for lines in _line_blocks(str(path), start, stop, block_bytes, strip_bom and start == 0):
            for line in lines:
                line = line.strip()
                if line:
                    current.append(line)
                elif current:
                    yield current
                    current = []
        if current and not across_files:
            yield current
            current = []
    if current:
        yield current


def read_lines(path: str | Path, *, strip_bom: bool = True,
               block_bytes: int = BLOCK_BYTES) -> Iterator[tuple[int, str]]:
    """(line number from 1, line without its ``\\n``) of a UTF-8 file, streamed."""
    number = 0
    for lines in _line_blocks(str(path), 0, None, block_bytes, strip_bom):
        for line in lines:
            number += 1
            yield number, line


def _line_blocks(path: str, start: int, stop: int | None, block_bytes: int,
                 strip_bom: bool) -> Iterator[list[str]]:
    """The lines of bytes ``start:stop`` of a file, split at ``\\n`` only, a block's worth at a time.

    Only whole lines are decoded, so a character is never cut. Bytes that are
    not UTF-8 are a DataError with their file offset, raised after the lines
    before theirs, as a line-by-line reader would.
    """
    with open(path, "rb") as handle:
        handle.seek(start)
        offset = start  # of the first byte not decoded yet
        left = None if stop is None else stop - start
        rest = b""
        first = True
        while True:
            block = handle.read(block_bytes if left is None else min(block_bytes, left))
            if left is not None:
                left -= len(block)
            data = rest + block
            if block:  # decode whole lines only: up to the last "\n"
                cut = data.rfind(b"\n") + 1
                if not cut:
                    rest = data
                    continue
            elif data:  # the end of the range: its last line may have no "\n"
                cut = len(data)
            else:
                break
            try:
                text = data[:cut].decode("utf-8")
            except UnicodeDecodeError as err:
                good = data.rfind(b"\n", 0, err.start) + 1  # the whole lines before the bad byte
                if good:
                    yield _split(data[:good].decode("utf-8"), first and strip_bom)
                raise not_utf8(path, offset + err.start) from None
            offset += cut
            rest = data[cut:]
            yield _split(text, first and strip_bom)
            first = False
            if not block:
                break


_COMPRESSED = ((b"\x1f\x8b", "gzip"), (b"BZh", "bzip2"), (b"\xfd7zXZ\x00", "xz"),
               (b"\x28\xb5\x2f\xfd", "zstd"), (b"PK\x03\x04", "zip"))


def binary_kind(path: str | Path) -> str | None:
    """What a file that should be text is instead, from its first bytes and name: a record
    file of either format (or one named so, whose start is damaged), a compressed file;
    None when it looks like neither."""
    from .native import MAGIC
    from .tfrecord import HEADER_BYTES, masked_crc

    try:
        with open(path, "rb") as file:
            head = file.read(HEADER_BYTES)
    except OSError:
        return None
    if head.startswith(MAGIC):
        return "a bertforge native record file"
    if len(head) == HEADER_BYTES and masked_crc(head[:8]) == int.from_bytes(head[8:], "little"):
        return "a TFRecord file"
    suffix = Path(path).suffix
    if suffix in (".tfrecord", ".tfrecords", ".bfrec"):
        return f"a record file by its name ({suffix}) but damaged at its first bytes"
    for magic, name in _COMPRESSED:
        if head.startswith(magic):
            return f"a {name}-compressed file (decompress it first)"
    return None


def not_utf8(path: str | Path, offset: int) -> DataError:
    """The error for bytes that are not UTF-8 where text is expected: what the file is, when
    that is known, else the offset of the bad byte."""
    kind = binary_kind(path)
    if kind:
        return DataError(f"{path}: {kind}, not text (one sentence per line)")
    return DataError(f"{path}: not valid UTF-8 at byte offset {offset}")


def _split(text: str, strip_bom: bool) -> list[str]:
    lines = text.split("\n")  # at "\n" only, as TensorFlow's GFile does
    if text.endswith("\n"):
        lines.pop()  # the empty string after the last "\n"
    if strip_bom:
        lines[0] = lines[0].lstrip("\ufeff")
    return lines


# ---------------------------------------------------------------- byte ranges

# A line break, then a blank line of ASCII whitespace only: str.strip() removes all of it,
# so a document ends there (a line of other Unicode spaces is blank too, but is no cut point).
# The leading "\n" gives the regex a literal to search for: ten times faster than "^".
_BLANK_LINE = re.compile(rb"\n[ \t\r\x0b\x0c]*\n")
_NOT_SPACE = re.compile(rb"[^ \t\r\x0b\x0c\n]")


def chunk_ranges(files: Sequence[str | Path], chunk_bytes: int, min_docs: int,
                 block_bytes: int = BLOCK_BYTES) -> Iterator[list[Range]]:
    """The input cut after blank lines into chunks of at least ``chunk_bytes`` bytes and
    ``min_docs`` documents each, as byte ranges for :func:`read_ranges`.

    Only bytes are scanned (a regex, no decoding, no Python per line), so a parent
    of worker processes stays nearly idle: each worker reads its own text. The
    document count is exact for ASCII blank lines; it only sizes chunks, and cuts
    are always at true document ends. A short remainder at the end joins the last
    chunk rather than stand alone, so that its documents still have others to draw
    random next sentences from; a remainder of blank lines only is dropped.
    """
    held: list[Range] | None = None  # a full chunk, kept until we know whether more follows
    done: list[Range] = []  # the current chunk's ranges in earlier files
    size = docs = 0  # bytes of the current chunk in earlier files; its documents so far
    in_document = False  # a non-blank line since the last document end
    for path in map(str, files):
        start = 0  # of the current chunk in this file
        with open(path, "rb") as handle:
            base = 0  # the file offset of data[0]
            rest = b""  # the last line break seen and the partial line after it
            while True:
                block = handle.read(block_bytes)
                data = rest + block
                if not block:  # the file's last line, when it has no "\n", may be blank
                    tail = data[data.rfind(b"\n") + 1:]
                    if _NOT_SPACE.search(tail):
                        in_document = True
                    elif tail and in_document:
                        in_document, docs = False, docs + 1
                    base += len(data)
                    break
                cut = data.rfind(b"\n") + 1  # whole lines only
                scanned = 0
                for blank in _BLANK_LINE.finditer(data, 0, cut):
                    if in_document or _NOT_SPACE.search(data, scanned, blank.start()):
                        in_document, docs = False, docs + 1
                        end = base + blank.end()
                        if size + end - start >= chunk_bytes and docs >= min_docs:
                            if held is not None:
                                yield held
                            held, done, size, docs, start = done + [(path, start, end)], [], 0, 0, end
                    scanned = blank.end()
                if _NOT_SPACE.search(data, scanned, cut):
                    in_document = True
                keep = max(cut - 1, 0)  # from the last "\n": a blank line may follow it
                base, rest = base + keep, data[keep:]
        if base > start:
            done.append((path, start, base))
            size += base - start
    docs += in_document
    if held is not None and docs and docs < min_docs:
        yield held + done
    else:
        if held is not None:
            yield held
        if docs:
            yield done
