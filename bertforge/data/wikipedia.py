"""Wikipedia dumps: download one, and extract its articles as clean text.

* :func:`download` -- fetch a pages-articles dump over HTTP(S). Resumable: the
  bytes go to ``NAME.part`` and an interrupted transfer continues from that
  file's size with an HTTP Range request, within one call (``retries``) or in
  a later call; a server that ignores Range sends the whole file again and we
  start over. The file is renamed to ``NAME`` only after its checksum matched,
  either one given (``sha1``/``md5``) or one looked up in the dump's published
  checksum file (lines of ``<hex>  <file name>``, as ``sha1sum`` writes them).
  A mismatch keeps the bytes as ``NAME.bad`` and raises.
  The transfer itself is :mod:`bertforge.data.download`'s, shared with GLUE's downloader.
* :func:`extract` -- run ``wikiextractor`` (3.1.0) on a dump, then clean what
  it returns and write one JSON object per article to a ``.jsonl`` file:
  ``{"id": "12", "title": "Anarchism", "text": "paragraph\\nparagraph..."}``.

``wikiextractor`` runs as a separate process (``python -m
wikiextractor.WikiExtractor``), not imported: its command line is its stable
interface (its internal API changed completely between 3.0 and 3.1), its
worker processes, logging and module-level state stay out of ours, and its
AGPL licence stays on its side of a process boundary.

The functions ``add_*_arguments`` and ``cmd_*`` wire these into the
``bertforge data wikipedia download|extract`` commands.
"""

from __future__ import annotations

import argparse
import bz2
import dataclasses
import gzip
import html
import http.client
import importlib.util
import io
import json
import logging
import re
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from bertforge.fileio import atomic_file

from .download import HASH_BY_HEX_LENGTH, checked_digest, fetch_verified, is_hex
from .errors import DataError

log = logging.getLogger(__name__)

# The newest English dump of all articles (about 20 GB compressed). "latest"
# moves twice a month: for a reproducible corpus, name a dated dump instead,
# e.g. https://dumps.wikimedia.org/enwiki/20240601/enwiki-20240601-pages-articles.xml.bz2
# with https://dumps.wikimedia.org/enwiki/20240601/enwiki-20240601-sha1sums.txt.
DEFAULT_DUMP_URL = "https://dumps.wikimedia.org/enwiki/latest/enwiki-latest-pages-articles.xml.bz2"
DEFAULT_CHECKSUMS_URL = "https://dumps.wikimedia.org/enwiki/latest/enwiki-latest-sha1sums.txt"
WIKIEXTRACTOR_VERSION = "3.1.0"  # 3.0.4 and 3.0.6 fail to import on Python >= 3.11


# ================================================================ download

def download(url: str = DEFAULT_DUMP_URL, out_dir: str | Path = ".", *, sha1: str | None = None,
             md5: str | None = None, checksums_url: str | None = None, verify: bool = True,
             chunk_size: int = 1 << 20, retries: int = 5, retry_wait: float = 2.0,
             timeout: float = 60.0) -> Path:
    """Download ``url`` into ``out_dir`` and return the path of the verified file.

    The checksum is ``sha1`` or ``md5`` when given, else the line for this file
    in ``checksums_url`` (a URL or a local path); for :data:`DEFAULT_DUMP_URL`
    that defaults to :data:`DEFAULT_CHECKSUMS_URL`. Without any checksum the
    download is refused unless ``verify=False``. A file already in place is
    verified again and returned without downloading.

    ``retries`` bounds the attempts in a row that add no byte; an attempt that
    makes progress resets the count. When they run out, the ``.part`` file is
    kept and a later call resumes it.
    """
    name = urllib.parse.unquote(urllib.parse.urlsplit(url).path.rsplit("/", 1)[-1])
    if not name:
        raise DataError(f"{url}: the URL names no file")
    out_dir = Path(out_dir)
    if checksums_url is None and sha1 is None and md5 is None and url == DEFAULT_DUMP_URL:
        checksums_url = DEFAULT_CHECKSUMS_URL
    expected = _expected_checksum(name, sha1, md5, checksums_url, timeout)
    if expected is None and verify:
        raise DataError(f"{url}: no checksum to verify it against; give sha1, md5 or a "
                        "checksums URL (or turn verification off)")
    return fetch_verified(url, out_dir / name, expected, chunk_size=chunk_size, retries=retries,
                          retry_wait=retry_wait, timeout=timeout)


def _read_url(url: str, timeout: float) -> bytes:
    """The bytes of a URL or of a local file (a checksum list is small)."""
    if "://" not in url:
        try:
            return Path(url).read_bytes()
        except OSError as err:
            raise DataError(f"{url}: cannot read the checksum file ({err.strerror})") from None
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.read()
    except (OSError, http.client.HTTPException) as err:
        raise DataError(f"{url}: cannot fetch the checksum file ({err})") from None


def _expected_checksum(name: str, sha1: str | None, md5: str | None, checksums_url: str | None,
                       timeout: float) -> tuple[str, str] | None:
    """(hash algorithm, lower-case hex digest) to check ``name`` against, if any."""
    for algorithm, value in (("sha1", sha1), ("md5", md5)):
        if value is not None:
            return checked_digest(algorithm, value)
    if checksums_url is None:
        return None
    # Wikimedia's latest/ directory lists the dated names ("enwiki-20240601-...")
    # of the files it serves as "enwiki-latest-...": accept either.
    dated = re.compile(re.escape(name).replace("latest", r"\d{8}")) if "latest" in name else None
    found = []
    text = _read_url(checksums_url, timeout).decode("utf-8", errors="replace")
    for line in text.splitlines():
        fields = line.split()
        if len(fields) != 2:
            continue
        digest, file_name = fields[0].lower(), fields[1].lstrip("*")  # "*" marks binary mode
        if file_name == name or (dated and dated.fullmatch(file_name)):
            found.append((file_name, digest))
    exact = [f for f in found if f[0] == name]
    found = exact or found
    if len(found) != 1:
        what = "no line" if not found else f"{len(found)} lines ({', '.join(f[0] for f in found)})"
        raise DataError(f"{checksums_url}: {what} for {name}")
    digest = found[0][1]
    if len(digest) not in HASH_BY_HEX_LENGTH or not is_hex(digest):
        raise DataError(f"{checksums_url}: {digest!r} for {name} is not an md5, sha1 or sha256 digest")
    return HASH_BY_HEX_LENGTH[len(digest)], digest


# ================================================================ extract

@dataclass
class ExtractStats:
    """What :func:`extract` read and wrote."""

    pages: int = 0             # <page> elements in the dump
    redirects: int = 0         # pages that only redirect (wikiextractor skips them)
    other_namespaces: int = 0  # non-redirect pages outside the article namespace (0)
    extracted: int = 0         # articles wikiextractor returned
    disambiguation: int = 0    # of those, dropped as disambiguation pages
    too_short: int = 0         # of those, dropped as shorter than min_chars after cleaning
    articles: int = 0          # articles written
    paragraphs: int = 0        # paragraphs written
    headings: int = 0          # section headings removed
    characters: int = 0        # characters of article text written (titles not counted)
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _open_dump(dump: Path) -> io.BufferedIOBase:
    """The decompressed bytes of a dump, by its file name (.bz2, .gz or plain XML)."""
    if dump.suffix == ".bz2":
        return bz2.open(dump, "rb")
    if dump.suffix == ".gz":
        return gzip.open(dump, "rb")
    return open(dump, "rb")


def check_dump(dump: Path) -> None:
    """Fail early, in one line naming the file, on what is not a MediaWiki XML dump."""
    if not dump.is_file():
        raise DataError(f"dump not found: {dump}")
    try:
        with _open_dump(dump) as f:
            head = f.read(4096)
    except (OSError, EOFError) as err:  # bz2/gzip: "Invalid data stream", "Not a gzipped file"
        raise DataError(f"{dump}: not a readable {dump.suffix} file ({err})") from None
    text = head.decode("utf-8", errors="replace").lstrip("\ufeff \t\r\n")
    text = re.sub(r"^<\?xml[^>]*\?>\s*", "", text)
    if not text.startswith("<mediawiki"):
        raise DataError(f"{dump}: not a MediaWiki XML dump (it starts with {text[:40]!r})")


# A section heading line, as wikiextractor's compact() recognises it.
_HEADING = re.compile(r"^(==+)\s*(.*?)\s*\1", re.MULTILINE)
_LINK = re.compile(r"\[\[(?:[^\[\]|]*\|)*([^\[\]|]*)\]\]")  # [[target|label]] -> label
_TEMPLATE = re.compile(r"\{\{[^{}]*\}\}")                   # innermost {{...}}
_REF = re.compile(r"<ref\b[^>]*/>|<ref\b[^>]*>.*?</ref\s*>", re.IGNORECASE | re.DOTALL)
_TAG = re.compile(r"</?[A-Za-z][A-Za-z0-9]*\b[^<>]*>|<!--.*?-->", re.DOTALL)
_WIKI_TAG = re.compile(r"</?(?:onlyinclude|includeonly|noinclude|nowiki|ref|references|gallery|math|"
                       r"poem|timeline|score|chem|ce|syntaxhighlight|source|br|small|big|sup|sub|"
                       r"span|div|center|font|blockquote)\b[^<>]*>", re.IGNORECASE)
# English Wikipedia's disambiguation templates: such a page is a list of links, not prose.
_DISAMBIGUATION = re.compile(r"\{\{\s*(?:disambiguation|disambig|dab|hndis|geodis)\s*[|}]", re.IGNORECASE)


def _key(text: str) -> str:
    """Letters and digits only, case-folded: a heading's identity whatever markup surrounded it."""
    return "".join(c for c in text.casefold() if c.isalnum())


def _strip_markup(text: str) -> str:
    """Remove what wiki markup survives: references, tags, templates, link brackets, bold quotes."""
    text = _REF.sub("", text)
    text = _TAG.sub("", text)
    while True:  # innermost first, so nested templates and links come off layer by layer
        stripped = _LINK.sub(r"\1", _TEMPLATE.sub("", text))
        if stripped == text:
            break
        text = stripped
    return re.sub(r"'{2,}", "", text)


def _index_pages(dump: Path, index: Path, stats: ExtractStats) -> None:
    """Write a line per page of the dump, counting pages into ``stats``.

    A line is "id<TAB>D or -<TAB>heading key<TAB>...": D marks a disambiguation page.

    Streamed: memory stays flat whatever the dump's size.
    """
    root = None
    try:
        with _open_dump(dump) as f, open(index, "w", encoding="utf-8") as out:
            for event, element in ET.iterparse(f, events=("start", "end")):
                if root is None:
                    root = element
                if event != "end" or _local(element.tag) != "page":
                    continue
                stats.pages += 1
                fields = {_local(child.tag): (child.text or "").strip() for child in element}
                if "redirect" in fields:
                    stats.redirects += 1
                elif fields.get("ns", "0") != "0":
                    stats.other_namespaces += 1
                text = element.findtext("./{*}revision/{*}text") or ""
                keys = {_key(_strip_markup(m.group(2))) for m in _HEADING.finditer(text)}
                kind = "D" if _DISAMBIGUATION.search(text) else "-"
                out.write("\t".join([fields.get("id", ""), kind, *sorted(filter(None, keys))]) + "\n")
                root.clear()  # drop the pages already seen
    except ET.ParseError as err:
        raise DataError(f"{dump}: not valid XML ({err})") from None
    except (OSError, EOFError) as err:
        raise DataError(f"{dump}: cannot read the dump ({err})") from None


def _read_index(index: Path) -> Iterator[tuple[str, bool, frozenset[str]]]:
    """(page id, is a disambiguation page, heading keys) per page."""
    with open(index, encoding="utf-8") as f:
        for line in f:
            page_id, kind, *keys = line.rstrip("\n").split("\t")
            yield page_id, kind == "D", frozenset(keys)


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


_EMPTY_PARENS = re.compile(r"\(\s*[,;:]*\s*\)")  # "()" and "(;, )" left where a template was
_PARENS_LEAD = re.compile(r"\(\s*[,;:]+\s*")     # "(; February 12" -> "(February 12"
_PARENS_TRAIL = re.compile(r"\s*[,;:]+\s*\)")    # '"Akhilleus",)' -> '"Akhilleus")'
_SPACE_BEFORE = re.compile(r"\s+([,;:)])")


def clean_paragraph(text: str) -> str:
    """One paragraph of wikiextractor output as plain text on one line."""
    # Markup first, entities after: wikiextractor writes a literal "<" as "&lt;",
    # so only real leftover tags look like tags here. Some markup comes out
    # escaped ("&lt;onlyinclude&gt;"): wiki tag names are removed once more.
    text = _WIKI_TAG.sub("", html.unescape(_strip_markup(text)))
    text = _EMPTY_PARENS.sub("", text)
    text = _PARENS_TRAIL.sub(")", _PARENS_LEAD.sub("(", text))
    text = " ".join(text.split())  # every run of whitespace (tabs, no-break spaces) -> one space
    return _SPACE_BEFORE.sub(r"\1", text).replace("( ", "(")


def clean_article(text: str, headings: frozenset[str] = frozenset(), min_paragraph_words: int = 3,
                  ) -> tuple[list[str], int]:
    """(paragraphs, headings removed) of one article as wikiextractor wrote it.

    wikiextractor turns a section heading into a line of its own ending in "."
    ("Early life."); a line whose letters are those of one of the page's
    headings is dropped. So are list items wikiextractor left ("* item") and
    paragraphs of fewer than ``min_paragraph_words`` words: the remains of
    lists and tables ("coding.").
    """
    paragraphs: list[str] = []
    removed = 0
    for line in text.split("\n"):
        line = clean_paragraph(line)
        if line.endswith((".", "?", "!")) and _key(line) in headings:
            removed += 1
        elif len(line.split()) >= min_paragraph_words and not line.startswith(("*", "#")):
            paragraphs.append(line)
    return paragraphs, removed


def _wikiextractor_documents(out_dir: Path) -> Iterator[dict]:
    """wikiextractor's --json output, in the order it wrote it (AA/wiki_00, AA/wiki_01, ..., AB/...)."""
    for path in sorted(out_dir.glob("*/wiki_*")):
        with open(path, encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)


def _start_wikiextractor(dump: Path, out_dir: Path, stderr: IO[str], processes: int,
                         expand_templates: bool) -> subprocess.Popen:
    if importlib.util.find_spec("wikiextractor") is None:
        raise DataError(f"extracting needs wikiextractor: pip install wikiextractor=={WIKIEXTRACTOR_VERSION}")
    command = [sys.executable, "-m", "wikiextractor.WikiExtractor", str(dump), "--json",
               "--output", str(out_dir), "--bytes", "100M", "--processes", str(processes), "--quiet"]
    if not expand_templates:
        command.append("--no-templates")
    log.info("running %s", " ".join(command))
    # stderr goes to a file: a pipe nobody reads until the end could fill up and stall it.
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr)


def extract(dump: str | Path, out: str | Path, *, processes: int = 1, min_chars: int = 200,
            min_paragraph_words: int = 3, expand_templates: bool = True) -> ExtractStats:
    """Extract a dump's articles into ``out`` (JSON lines); return what was read and written.

    wikiextractor drops redirects and pages outside the article namespace and
    turns wiki markup into text; we then remove section headings and any markup
    left, unescape HTML entities, tidy the parentheses that removed templates
    leave ("Albedo () or..."), put each paragraph on one line with single
    spaces, drop list items and paragraphs under ``min_paragraph_words``
    words, and drop disambiguation pages (by their templates) and articles
    whose text is shorter than ``min_chars`` characters. Articles keep the
    dump's order. ``out`` is written atomically.

    While wikiextractor runs, this process reads the dump too (streamed, on
    another core) to count its pages and note each page's section headings.
    """
    dump, out = Path(dump), Path(out)
    if processes < 1:
        raise DataError(f"processes={processes} must be at least 1")
    check_dump(dump)
    start = time.perf_counter()
    stats = ExtractStats()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.extract-", dir=out.parent) as tmp:
        work, index = Path(tmp) / "wikiextractor", Path(tmp) / "pages.tsv"
        with open(Path(tmp) / "stderr.txt", "w+", encoding="utf-8") as stderr:
            process = _start_wikiextractor(dump, work, stderr, processes, expand_templates)
            try:
                _index_pages(dump, index, stats)
            except BaseException:
                process.kill()  # the dump is unreadable (or we were interrupted): stop it too
                raise
            finally:
                process.wait()
            if process.returncode != 0:
                stderr.seek(0)
                lines = [line.strip() for line in stderr if line.strip()]
                last = lines[-1] if lines else f"exit status {process.returncode}"
                raise DataError(f"{dump}: wikiextractor failed: {last}")

        pages = _read_index(index)
        with atomic_file(out) as tmp_out, open(tmp_out, "w", encoding="utf-8") as f:
            for document in _wikiextractor_documents(work):
                stats.extracted += 1
                # Both are in dump order: walk the pages to this article's.
                page = next((page for page in pages if page[0] == document["id"]), None)
                if page is None:
                    raise DataError(f"{dump}: wikiextractor returned page id {document['id']} out of "
                                    "the dump's order")
                _, disambiguation, headings = page
                if disambiguation:
                    stats.disambiguation += 1
                    continue
                paragraphs, removed = clean_article(document["text"], headings, min_paragraph_words)
                chars = sum(map(len, paragraphs))
                if chars < min_chars:
                    stats.too_short += 1
                    continue
                stats.articles += 1
                stats.paragraphs += len(paragraphs)
                stats.headings += removed
                stats.characters += chars
                record = {"id": document["id"], "title": document["title"], "text": "\n".join(paragraphs)}
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
            if stats.articles == 0:
                raise DataError(f"{dump}: no article of at least {min_chars} characters in this dump")
    stats.seconds = time.perf_counter() - start
    return stats


# ================================================================ command line

def add_download_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``bertforge data wikipedia download``."""
    parser.add_argument("out_dir", type=Path, help="directory to download into")
    parser.add_argument("--url", default=DEFAULT_DUMP_URL, help=f"dump URL (default: {DEFAULT_DUMP_URL})")
    parser.add_argument("--sha1", help="expected SHA-1 of the file")
    parser.add_argument("--md5", help="expected MD5 of the file")
    parser.add_argument("--checksums-url", help="URL or path of a '<hex>  <file name>' list "
                        "(default for the default URL: the dump's sha1sums file)")
    parser.add_argument("--no-verify", action="store_true", help="accept a file without a checksum")
    parser.add_argument("--retries", type=int, default=5,
                        help="attempts in a row without progress before giving up (default 5)")


def cmd_download(args: argparse.Namespace, extra: list[str] | None = None) -> int:
    path = download(args.url, args.out_dir, sha1=args.sha1, md5=args.md5,
                    checksums_url=args.checksums_url, verify=not args.no_verify, retries=args.retries)
    print(path)
    return 0


def add_extract_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``bertforge data wikipedia extract``."""
    parser.add_argument("dump", type=Path, help="pages-articles XML dump (.xml, .xml.bz2 or .xml.gz)")
    parser.add_argument("out", type=Path, help="output file, one JSON article per line (.jsonl)")
    parser.add_argument("--processes", type=int, default=1, help="wikiextractor processes (default 1)")
    parser.add_argument("--min-chars", type=int, default=200,
                        help="drop articles with less text than this (default 200)")
    parser.add_argument("--min-paragraph-words", type=int, default=3,
                        help="drop shorter paragraphs, the remains of tables (default 3)")
    parser.add_argument("--no-templates", action="store_true",
                        help="do not expand templates (faster; wikiextractor's --no-templates)")


def cmd_extract(args: argparse.Namespace, extra: list[str] | None = None) -> int:
    stats = extract(args.dump, args.out, processes=args.processes, min_chars=args.min_chars,
                    min_paragraph_words=args.min_paragraph_words,
                    expand_templates=not args.no_templates)
    print(f"{stats.articles} articles, {stats.paragraphs} paragraphs, {stats.characters} characters "
          f"-> {args.out} ({stats.pages} pages: {stats.redirects} redirects, {stats.disambiguation} "
          f"disambiguation pages, {stats.too_short} too short; {stats.seconds:.1f} s)")
    return 0
