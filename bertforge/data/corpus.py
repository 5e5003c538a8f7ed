"""Corpora as documents: a document is a list of sentences (plain strings).

Two sources:

* :func:`builtin_corpus` -- English prose that ships inside CPython (the help
  topics of ``pydoc_data`` and the module docstrings of the standard library),
  so that ``bertforge pretrain`` runs offline with no download.
* :func:`read_text_corpus` (and :func:`iter_text_corpus`, streamed) --
  google-research/bert's input format: one sentence per line, a blank line
  between documents; or tables (JSON Lines, Parquet, a ``save_to_disk``
  directory) with a document per row (both read by :mod:`.text`).

Document boundaries matter: next-sentence pairs never cross them.
"""

from __future__ import annotations

import ast
import functools
import re
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path

from .errors import DataError
from .text import expand_inputs, read_documents, row_documents, table_inputs

Document = list[str]

# ------------------------------------------------------------ sentence splitting

# A sentence ends at . ? or ! (plus any closing quotes/brackets), then whitespace,
# then an uppercase letter or an opening quote, maybe after a bracket. Requiring
# whitespace after the period already keeps decimal numbers such as 3.14 whole.
_SENTENCE_END = re.compile(r"""([.?!]["'\u201d\u2019)\]]*)\s+(?=[(\[]?[A-Z"'\u201c\u2018])""")
# Initials and dotted abbreviations: "A.", "e.g.", "i.e.", "U.S.".
_DOTTED = re.compile(r"(?:[A-Za-z]\.)+")
_ABBREVIATIONS = frozenset(
    "etc. mr. mrs. ms. dr. prof. st. jr. sr. vs. cf. fig. approx. resp. al.".split())


def _is_abbreviation(text_before: str) -> bool:
    """Whether the word that ends with this period is an abbreviation, not a sentence end."""
    word = text_before.rsplit(None, 1)[-1].lstrip("\"'([\u201c\u2018")
    return bool(_DOTTED.fullmatch(word)) or word.lower() in _ABBREVIATIONS


def split_sentences(text: str) -> list[str]:
    """Split running text into sentences with a small regex; good enough for prose.

    A proper splitter can replace this later: nothing else depends on how it works.
    """
    text = " ".join(text.split())
    sentences: list[str] = []
    start = 0
    for match in _SENTENCE_END.finditer(text):
        end = match.end(1)
        if match.group(1)[0] == "." and _is_abbreviation(text[start:match.start(1) + 1]):
            continue
        sentences.append(text[start:end])
        start = match.end()
    if start < len(text):
        sentences.append(text[start:])
    return sentences


# ------------------------------------------------------------ built-in corpus

# A heading underline in pydoc topics and reStructuredText docstrings.
_UNDERLINE = re.compile(r"[*=\-~^#]{3,}")
# A prose paragraph ends like a sentence (possibly inside quotes or brackets).
_PROSE_END = re.compile(r"""[.?!:]["'\u201d\u2019)\]]*$""")
_BULLET = re.compile(r"^(?:[-*\u2022]|\d{1,2}\.)\s+")  # "- item", "* item", "2. item"
_MIN_PARAGRAPH_WORDS = 4  # shorter "paragraphs" are labels and signatures: "Usage:", "f(x)."
_MIN_DOCSTRING_SENTENCES = 3


def prose_paragraphs(text: str) -> list[str]:
    """The prose of reStructuredText-like text, one string per paragraph.

    Indented lines are code, grammar or nested blocks and are dropped, as are
    interactive examples (">>>" and their output), headings with their
    underlines, and short lines that do not end like a sentence (signatures,
    labels, program output).
    """
    paragraphs: list[str] = []
    current: list[str] = []

    def flush() -> None:
        paragraph = " ".join(" ".join(current).split())
        current.clear()
        if len(paragraph.split()) >= _MIN_PARAGRAPH_WORDS and _PROSE_END.search(paragraph):
            paragraphs.append(paragraph)

    in_example = False  # inside an interactive session: its output runs to the next blank line
    for line in text.splitlines():
        if not line.strip():
            in_example = False
            flush()
        elif in_example or line[0].isspace() or line.startswith(">>>"):
            in_example = in_example or line.startswith(">>>")
            flush()
        elif _UNDERLINE.fullmatch(line.strip()):
            current[-1:] = []  # the line above was a heading
            flush()
        else:
            current.append(_BULLET.sub("", line))  # a bullet is not part of the sentence
    flush()
    return paragraphs


def _document(text: str) -> Document:
    return [s for paragraph in prose_paragraphs(text) for s in split_sentences(paragraph)]


def _module_docstrings(path: Path) -> list[str]:
    """The docstrings of a module, its classes and functions, in source order.

    The file is parsed, never imported.
    """
    try:
        tree = ast.parse(path.read_bytes())
    except (SyntaxError, ValueError):
        return []
    nodes = [tree] + sorted((n for n in ast.walk(tree)
                             if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))),
                            key=lambda n: n.lineno)
    return [doc for doc in map(ast.get_docstring, nodes) if doc]


@functools.lru_cache(maxsize=1)
def _builtin_corpus() -> tuple[tuple[str, ...], ...]:
    from pydoc_data.topics import topics

    documents = [_document(topics[name]) for name in sorted(topics)]
    stdlib = Path(sysconfig.get_path("stdlib"))
    for path in sorted(stdlib.glob("*.py")):
        document = [s for doc in _module_docstrings(path) for s in _document(doc)]
        if len(document) >= _MIN_DOCSTRING_SENTENCES:
            documents.append(document)
    return tuple(tuple(d) for d in documents if d)


def builtin_corpus() -> list[Document]:
    """English prose shipped with CPython: one document per help topic and per module.

    The help topics are ``pydoc_data.topics.topics`` (the language reference
    sections that ``help("assert")`` shows); a module's document is the
    docstrings of the module and of its classes and functions in source order,
    from the standard library's top-level ``*.py`` files, kept when it holds at
    least three sentences. Both are taken in sorted order, so the corpus is the
    same on every run of a given Python version. Parsing takes a few seconds,
    so the result is cached for the process.
    """
    return [list(d) for d in _builtin_corpus()]


# ------------------------------------------------------------ text files

def iter_text_corpus(inputs: Iterable[str | Path], text_column: str = "text") -> Iterator[Document]:
    """The documents of files, or of every ``*.txt`` file of directories in sorted order, streamed.

    Format (google-research/bert's): one sentence per line, a blank line between
    documents. Unlike ``bertforge data create`` (the reference's reading), the
    end of a file also ends its last document and a leading byte order mark is
    dropped. Empty documents are skipped. No globs: a path names a corpus.
    Tables (``.jsonl``, ``.jsonl.gz``, ``.parquet``, a ``save_to_disk``
    directory) give one document per row of ``text_column``, its lines the sentences.
    """
    files = expand_inputs(inputs, globs=False, what="corpus", saved_datasets=True)
    if table_inputs(files):
        yield from row_documents(files, text_column)
    else:
        yield from read_documents(files, across_files=False, strip_bom=True)


def read_text_corpus(path: str | Path) -> list[Document]:
    """Read one file (or table), or every ``*.txt`` file of a directory in sorted order
    (:func:`iter_text_corpus`).

    A corpus with no document is an error.
    """
    path = Path(path)
    documents = list(iter_text_corpus([path]))
    if not documents:
        raise DataError(f"{path}: the corpus is empty (no non-blank lines)")
    return documents
