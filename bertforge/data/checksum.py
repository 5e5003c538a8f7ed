"""``bertforge data checksum``: a manifest of a data directory, written once and verified later.

    bertforge data checksum records/              # writes records.md5 beside the directory
    bertforge data checksum records/ --verify     # exit status 1, naming each file, if anything changed
    bertforge data checksum results4/ --verify --manifest bert_reference_results_text_md5.txt   # MLPerf's list

The manifest holds the md5 (the digest MLPerf publishes for its 500 training
parts and its eval set) and the size in bytes of every file under the
directory, sorted by path. It is written beside the directory, not in it (a
training run reads every file of a records directory), in ``md5sum``'s
format with the sizes on comment lines, so ``md5sum -c ../records.md5`` run
in the directory checks it too. Hidden files (writers' temporaries) and the
manifest itself are left out.
"""

from __future__ import annotations

import argparse
import hashlib
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from bertforge.fileio import refuse_live_runs

from .errors import DataError

_CHUNK = 8 << 20  # bytes read at a time: hashlib releases the GIL on large updates, so threads hash in parallel


@dataclass(frozen=True)
class Entry:
    name: str  # the path relative to the directory, with "/"
    size: int | None  # None in a plain md5sum list (MLPerf's): not compared
    md5: str


def fingerprint(files: list[Path], edge: int = 1 << 16) -> str:
    """A quick fingerprint of a data set's files, to tell whether they changed since a run
    saved it: each file's name, size and first and last ``edge`` bytes (regenerated records
    differ there; 64 KiB × 2 per file, so 500 shards cost 64 MB of reading), as 8 hex digits."""
    checksum = 0
    for path in files:
        size = path.stat().st_size
        with open(path, "rb") as file:
            head = file.read(edge)
            file.seek(max(size - edge, len(head)))
            tail = file.read(edge)
        for part in (path.name.encode(), size.to_bytes(8, "little"), head, tail):
            checksum = zlib.crc32(part, checksum)
    return f"{checksum:08x}"


def default_manifest(directory: Path) -> Path:
    """``records/`` → ``records.md5`` in the directory's parent."""
    directory = directory.resolve()
    return directory.parent / f"{directory.name or 'root'}.md5"


def md5_of(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def data_files(directory: Path, manifest: Path) -> list[str]:
    """Every file under ``directory`` but hidden ones and the manifest, as sorted relative paths."""
    names = []
    for path in directory.rglob("*"):
        relative = path.relative_to(directory)
        if path.is_file() and not any(part.startswith(".") for part in relative.parts) \
                and path.resolve() != manifest.resolve():
            names.append(relative.as_posix())
    return sorted(names)


def measure(directory: Path, names: list[str], workers: int = 1) -> list[Entry]:
    def entry(name: str) -> Entry:
        path = directory / name
        return Entry(name, path.stat().st_size, md5_of(path))

    with ThreadPoolExecutor(max(1, workers)) as pool:
        return list(pool.map(entry, names))


def format_manifest(entries: list[Entry]) -> str:
    lines = ["# bertforge data checksum: md5 and size in bytes of every file (md5sum -c reads it too)"]
    for e in entries:
        lines += [f"# {e.size} bytes", f"{e.md5}  {e.name}"]
    return "\n".join(lines) + "\n"


def parse_manifest(path: Path) -> list[Entry]:
    """The entries of a manifest written by :func:`write_manifest`, or of a plain ``md5sum``
    list (``MD5  NAME`` or ``MD5 *NAME`` lines, no sizes: MLPerf publishes its text parts' so);
    a malformed line is an error naming the file and line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise DataError(f"{path}: no manifest to verify (write one first: bertforge data checksum DIR)") from None
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: cannot be read ({err})") from None
    entries: list[Entry] = []
    size: int | None = None
    for number, line in enumerate(lines, 1):
        if line.startswith("# ") and line.endswith(" bytes") and line[2:-6].isdigit():
            size = int(line[2:-6])
            continue
        if not line.strip() or line.startswith("#"):
            continue
        md5, name = line[:32].lower(), line[34:] if line[32:34] in ("  ", " *") else ""
        if len(md5) != 32 or any(c not in "0123456789abcdef" for c in md5) or not name:
            raise DataError(f"{path}:{number}: not a manifest line (MD5  NAME, after # SIZE bytes in ours): "
                            f"{line[:80]!r}")
        entries.append(Entry(name, size, md5))
        size = None
    return entries


def write_manifest(directory: Path, manifest: Path, workers: int = 1, overwrite: bool = False) -> list[Entry]:
    if manifest.exists() and not overwrite:
        raise DataError(f"{manifest} exists: --verify checks the directory against it, --overwrite replaces it")
    if manifest.exists():
        refuse_live_runs(manifest)
    names = data_files(directory, manifest)
    if not names:
        raise DataError(f"{directory}: no files to checksum")
    entries = measure(directory, names, workers)
    tmp = manifest.with_name(f".{manifest.name}.tmp")
    tmp.write_text(format_manifest(entries), encoding="utf-8")
    tmp.replace(manifest)  # complete or absent, never half-written
    return entries


def verify(directory: Path, manifest: Path, workers: int = 1) -> list[str]:
    """One line per difference between the directory and its manifest: a file missing, of
    another size or md5, or not in the manifest; empty when the data is what was written.
    A plain md5sum list (no sizes) checks the files it names, as ``md5sum -c`` does: others
    in the directory are not differences."""
    entries = parse_manifest(manifest)
    expected = {e.name: e for e in entries}
    ours = all(e.size is not None for e in entries)
    present = data_files(directory, manifest)
    problems = [f"{name}: missing" for name in sorted(expected.keys() - set(present))]
    if ours:
        problems += [f"{name}: not in the manifest" for name in present if name not in expected]
    sized = []
    for name in present:
        if name in expected:
            size, wanted = (directory / name).stat().st_size, expected[name].size
            if wanted is not None and size != wanted:
                problems.append(f"{name}: {size} bytes, the manifest says {wanted}")
            else:
                sized.append(name)
    for entry in measure(directory, sized, workers):  # only files of the right size are read
        if entry.md5 != expected[entry.name].md5:
            problems.append(f"{entry.name}: md5 {entry.md5}, the manifest says {expected[entry.name].md5}")
    return sorted(problems)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", type=Path)
    parser.add_argument("--verify", action="store_true", help="check the directory against its manifest")
    parser.add_argument("--manifest", type=Path, help="the manifest file (default: DIRECTORY.md5 beside it)")
    parser.add_argument("--workers", type=int, default=1, help="files hashed in parallel (threads)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing manifest (never in a live run's directory)")


def run(args: argparse.Namespace) -> int:
    """Write the manifest (status 0), or verify it: status 1 when anything differs."""
    directory: Path = args.directory
    if not directory.is_dir():
        raise DataError(f"{directory}: not a directory")
    manifest = args.manifest or default_manifest(directory)
    if args.verify:
        problems = verify(directory, manifest, args.workers)
        for line in problems:
            print(line)
        count = len(parse_manifest(manifest))
        print(f"{directory}: {len(problems)} difference(s) from {manifest}" if problems
              else f"{directory}: all {count} files match {manifest}")
        return 1 if problems else 0
    entries = write_manifest(directory, manifest, args.workers, args.overwrite)
    print(f"{manifest}: md5 and size of {len(entries)} files, {sum(e.size or 0 for e in entries):,} bytes")
    return 0
