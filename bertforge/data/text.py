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
* :func:`read_rows` and :func:`row_documents` -- tables of text: JSON Lines
  (``.jsonl``, ``.jsonl.gz``), Parquet (``.parquet``, via ``pyarrow``) and
  directories written by ``datasets.Dataset.save_to_disk`` (Arrow files, read
  with ``pyarrow``: ``datasets`` itself is not needed). One row is one document:
  its text column is split at ``\\n`` into lines, each stripped with
  ``str.strip``, blank ones dropped, so a row holds what a blank-line-separated
  block of a text file holds (one sentence per line). Rows are streamed: JSON
  Lines a line at a time, Parquet a batch of one row group at a time, Arrow
  files memory-mapped a record batch at a time.
* :func:`input_documents` and :func:`input_chunks` -- the documents, or fast
  mode's chunks, of either kind of input; a table's chunks are cut exactly where
  :func:`chunk_ranges` cuts the same rows written as a text file (each row's
  lines, then a blank line), so both give the same records.
"""

from __future__ import annotations

import fnmatch
import glob
import gzip
import itertools
import json
import re
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import DataError

BLOCK_BYTES = 1 << 22  # bytes read at a time
TEXT_PATTERNS = ("*.txt",)  # what a directory of text stands for

Range = tuple[str, int, int | None]  # (path, start, stop) of input bytes; stop None: to the end


# ---------------------------------------------------------------- which files

def expand_inputs(inputs: Iterable[str | Path], *, patterns: Sequence[str] = TEXT_PATTERNS,
                  skip: Sequence[str] = (), globs: bool = True, what: str = "input",
                  saved_datasets: bool = False) -> list[Path]:
    """The files named by paths, directories and (with ``globs``) glob patterns, in the order given.

    A directory stands for its files (not its subdirectories) whose names match
    one of ``patterns`` and none of ``skip`` (``fnmatch`` patterns), sorted;
    with no ``patterns`` a directory is an error. A path that is neither a file
    nor a directory is, with ``globs``, a glob pattern whose matching files are
    taken in sorted order. The callers differ only in these parameters: text
    readers take ``*.txt`` (``preprocess`` also ``*.jsonl``; only ``create``
    globs), ``pick-eval`` names record files one by one, and the training
    loader takes every file of a directory but index and hidden files.

    With ``saved_datasets`` a directory written by ``save_to_disk`` stands for
    itself (the text readers take it as one table).

    Errors, each naming the path: a directory without such files, a path (or
    pattern) that matches nothing (``"{what} not found: PATH"``), no inputs at all.
    """
    files: list[Path] = []
    for item in inputs:
        text = str(item)
        path = Path(text)
        if saved_datasets and path.is_dir() and _is_saved_dataset(path):
            found = [path]
        elif path.is_dir():
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


# ---------------------------------------------------------------- tables of text

TABLE_SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")
ROWS_PER_BATCH = 1024  # Parquet rows turned into Python strings at a time (within one row group)
PYARROW_HINT = 'pip install "bertforge[parquet]"'


def _is_saved_dataset(path: Path) -> bool:
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def is_table(path: str | Path) -> bool:
    """Whether an input (as :func:`expand_inputs` returns it) is a table rather than text."""
    path = Path(path)
    return path.is_dir() or path.name.endswith(TABLE_SUFFIXES)


def table_inputs(files: Sequence[str | Path]) -> bool:
    """Whether the inputs are tables (else text files); a mix of both is an error."""
    tables = [path for path in files if is_table(path)]
    if tables and len(tables) < len(files):
        text = next(path for path in files if not is_table(path))
        raise DataError(f"the inputs mix tables ({tables[0]}) and text files ({text}); give one kind")
    return bool(tables)


def read_rows(path: str | Path, column: str = "text") -> Iterator[tuple[int, str]]:
    """(row, the text of ``column``) of one table, streamed.

    The row is the line number (from 1) in a JSON Lines file, where blank lines
    are skipped, and the index (from 0) in a Parquet file or a saved dataset.
    Errors name the file: a missing column (listing the columns present), a value
    that is not a string (naming the row), a file that is not of its kind.
    """
    path = Path(path)
    if path.is_dir():
        return _dataset_rows(path, column)
    if path.name.endswith(".parquet"):
        return _parquet_rows(path, column)
    return _jsonl_rows(path, column)


def row_documents(files: Iterable[str | Path], column: str = "text") -> Iterator[list[str]]:
    """The documents of tables, one per row: its text split at ``\\n``, lines stripped, blank
    lines dropped; a row with no line left is skipped."""
    for path in files:
        for _, text in read_rows(path, column):
            document = [line for line in (line.strip() for line in text.split("\n")) if line]
            if document:
                yield document


def _no_column(path: Path, column: str, present: Sequence[str], where: str = "") -> DataError:
    return DataError(f"{path}: {where}no column {column!r} (columns present: "
                     f"{', '.join(map(str, present)) or 'none'})")


def json_objects(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) of each non-blank line of a JSON Lines file (gzipped too); a line that is
    not a JSON object is a one-line error naming the file and line."""
    for number, line in _jsonl_lines(path):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}: line {number}: not JSON ({err.msg})") from None
        if not isinstance(row, dict):
            raise DataError(f"{path}: line {number}: not a JSON object")
        yield number, row


def _jsonl_rows(path: Path, column: str) -> Iterator[tuple[int, str]]:
    for number, row in json_objects(path):
        if column not in row:
            raise _no_column(path, column, list(row), f"line {number}: ")
        value = row[column]
        if not isinstance(value, str):
            kind = "null" if value is None else type(value).__name__
            raise DataError(f"{path}: line {number}: {column!r} holds {kind}, not a string")
        yield number, value


def _jsonl_lines(path: Path) -> Iterator[tuple[int, str]]:
    if not path.name.endswith(".gz"):
        yield from read_lines(path)
        return
    try:
        with gzip.open(path, "rb") as handle:
            for number, raw in enumerate(handle, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError:
                    raise DataError(f"{path}: line {number}: not valid UTF-8") from None
                line = line[:-1] if line.endswith("\n") else line
                yield number, line.lstrip("\ufeff") if number == 1 else line
    except (OSError, EOFError, zlib.error) as err:  # not gzip, truncated, corrupt
        raise DataError(f"{path}: not a readable gzip file ({err})") from None


def _pyarrow(path: Path) -> Any:
    try:
        import pyarrow
    except ImportError:
        raise DataError(f"{path}: reading Parquet and saved datasets needs pyarrow: {PYARROW_HINT}") from None
    return pyarrow


def _check_column(pa: Any, path: Path, column: str, schema: Any) -> None:
    if column not in schema.names:
        raise _no_column(path, column, schema.names)
    kind = schema.field(column).type
    values = kind.value_type if pa.types.is_dictionary(kind) else kind
    is_view = getattr(pa.types, "is_string_view", lambda _: False)
    if not (pa.types.is_string(values) or pa.types.is_large_string(values) or is_view(values)):
        raise DataError(f"{path}: column {column!r} holds {kind} values, not strings")


def _batch_rows(pa: Any, path: Path, column: str, batches: Iterator[Any],
                rows: Iterator[int]) -> Iterator[tuple[int, str]]:
    """The rows of record batches pulled one at a time; ``rows`` numbers them."""
    while True:
        try:
            batch = next(batches, None)
        except (pa.ArrowException, OSError) as err:
            raise DataError(f"{path}: unreadable record batch ({err})") from None
        if batch is None:
            return
        for text in batch.column(column).to_pylist():
            row = next(rows)
            if text is None:
                raise DataError(f"{path}: row {row}: {column!r} is null, not a string")
            yield row, text


def _parquet_rows(path: Path, column: str) -> Iterator[tuple[int, str]]:
    pa = _pyarrow(path)
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"{path}: not a Parquet file ({err})") from None
    with parquet:
        _check_column(pa, path, column, parquet.schema_arrow)
        # One row group is read (and decompressed) at a time, and only the text column of it.
        batches = (batch for group in range(parquet.num_row_groups)
                   for batch in parquet.iter_batches(batch_size=ROWS_PER_BATCH, row_groups=[group],
                                                     columns=[column]))
        yield from _batch_rows(pa, path, column, batches, iter(range(parquet.metadata.num_rows)))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DataError(f"{path}: not readable as JSON ({err})") from None
    if not isinstance(value, dict):
        raise DataError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _dataset_rows(path: Path, column: str) -> Iterator[tuple[int, str]]:
    """The rows of a directory written by ``datasets.Dataset.save_to_disk``: ``state.json`` lists
    its Arrow files (IPC streams) in order."""
    pa = _pyarrow(path)
    if (path / "dataset_dict.json").is_file():
        splits = _read_json(path / "dataset_dict.json").get("splits") or ["SPLIT"]
        raise DataError(f"{path}: a DatasetDict (splits: {', '.join(map(str, splits))}); "
                        f"name one split's directory, e.g. {path / str(splits[0])}")
    state = path / "state.json"
    files = _read_json(state).get("_data_files")
    # Plain names only: the files are the directory's own.
    if not isinstance(files, list) or not all(isinstance(f, dict) and isinstance(f.get("filename"), str)
                                              and Path(f["filename"]).name == f["filename"] for f in files):
        raise DataError(f"{state}: no \"_data_files\" list of {{\"filename\": NAME}} (not save_to_disk's)")
    rows = itertools.count()
    for entry in files:
        file = path / entry["filename"]
        if not file.is_file():
            raise DataError(f"{file}: listed in {state} but missing")
        with pa.memory_map(str(file)) as source:  # mapped: batches are views of the file's pages
            try:
                reader = pa.ipc.open_stream(source)
            except (pa.ArrowException, OSError) as err:
                raise DataError(f"{file}: not an Arrow stream ({err})") from None
            _check_column(pa, file, column, reader.schema)
            yield from _batch_rows(pa, file, column, iter(reader), rows)


# ---------------------------------------------------------------- either kind of input

@dataclass
class DocumentChunk:
    """A chunk of fast mode given as its documents (read from tables) rather than as byte ranges."""

    documents: list[list[str]]


Chunk = list[Range] | DocumentChunk


def chunk_documents(documents: Iterable[list[str]], chunk_bytes: int,
                    min_docs: int) -> Iterator[DocumentChunk]:
    """:func:`chunk_ranges`'s cuts for documents given as lines: a document counts the bytes it
    would take in a text file, each line and its ``\\n``, then a blank line."""
    held: DocumentChunk | None = None
    current: list[list[str]] = []
    size = 0
    for document in documents:
        current.append(document)
        size += sum(len(line.encode("utf-8")) + 1 for line in document) + 1
        if size >= chunk_bytes and len(current) >= min_docs:
            if held is not None:
                yield held
            held, current, size = DocumentChunk(current), [], 0
    if held is not None and current and len(current) < min_docs:
        yield DocumentChunk(held.documents + current)  # a short remainder joins the last chunk
        return
    if held is not None:
        yield held
    if current:
        yield DocumentChunk(current)


def input_documents(files: Sequence[Path], text_column: str = "text") -> Iterator[list[str]]:
    """The documents of text files (read as the reference does: across files) or of tables."""
    if table_inputs(files):
        return row_documents(files, text_column)
    return read_documents(files)


def input_chunks(files: Sequence[Path], chunk_bytes: int, min_docs: int,
                 text_column: str = "text") -> Iterator[Chunk]:
    """Fast mode's chunks of text files (byte ranges each worker reads) or of tables (documents
    read here): the same cuts for the same text."""
    if table_inputs(files):
        return chunk_documents(row_documents(files, text_column), chunk_bytes, min_docs)
    return chunk_ranges(files, chunk_bytes, min_docs)


def read_chunk(chunk: Chunk) -> list[list[str]]:
    """The documents of a chunk from :func:`input_chunks`."""
    return chunk.documents if isinstance(chunk, DocumentChunk) else list(read_ranges(chunk))
