"""Retrieval sets in the BEIR layout, and SQuAD turned into one.

A BEIR directory holds

    corpus.jsonl          {"_id": "d1", "title": "…", "text": "…"}   one document a line (title optional)
    queries.jsonl         {"_id": "q1", "text": "…"}
    qrels/<split>.tsv     query-id <TAB> corpus-id <TAB> score, after a header line

A document is read as ``title + " " + text`` (BEIR's own models join them so), or its text
alone when it has no title. Scores are graded relevance (0 = judged not relevant).

Bad input is a :class:`~bertforge.data.DataError` naming the file and line: malformed JSON or
TSV, a missing or empty field, a duplicate id, a qrels line whose query or document is not in
``queries.jsonl`` / ``corpus.jsonl``, a score that is not an integer.

SQuAD as retrieval (:func:`squad_to_beir`): each question is a query whose one relevant
document is its paragraph. A paragraph's id is ``a{article}-p{paragraph}`` (indices in the file,
so ids are the same every time); a paragraph whose text an earlier one already has is not a
second document: its questions point at the first (two equal documents would make ranking them
a coin toss). SQuAD v2.0's unanswerable questions are left out (their paragraph does not answer
them). The question/paragraph pairs are also written as training rows, ``{"query", "positive"}``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bertforge.data import DataError
from bertforge.data.text import json_objects
from bertforge.fileio import atomic_directory


@dataclass
class RetrievalSet:
    """Documents and queries by id (their texts, as encoded) and the relevance judgements:
    ``qrels[query_id][doc_id] = grade``, only for judged pairs."""

    corpus: dict[str, str]
    queries: dict[str, str]
    qrels: dict[str, dict[str, int]]


def _json_lines(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) of each non-blank line of a JSON Lines file (data.text's reader), a missing one
    named as part of a BEIR directory."""
    try:
        yield from json_objects(path)
    except FileNotFoundError:
        raise DataError(f"{path}: no such file (a BEIR directory has corpus.jsonl, queries.jsonl and qrels/)"
                        ) from None
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not valid UTF-8 at byte offset {err.start}") from None


def _text_field(row: dict[str, Any], key: str, where: str, required: bool = True) -> str:
    value = row.get(key, None if required else "")
    if value is None:
        raise DataError(f"{where}: missing field {key!r}")
    if not isinstance(value, str):
        raise DataError(f"{where}: field {key!r} is {type(value).__name__}, not a string")
    return value.strip()


def _read_texts(path: Path, with_title: bool) -> dict[str, str]:
    """id → text of a corpus.jsonl (title and text joined) or a queries.jsonl."""
    texts: dict[str, str] = {}
    lines: dict[str, int] = {}
    for number, row in _json_lines(path):
        where = f"{path}:{number}"
        raw_id = row.get("_id")
        if isinstance(raw_id, int) and not isinstance(raw_id, bool):
            raw_id = str(raw_id)  # some BEIR sets write numeric ids
        if not isinstance(raw_id, str) or not raw_id or raw_id.split() != [raw_id]:
            # a TREC run file separates its fields by whitespace
            raise DataError(f"{where}: field '_id' must be a non-empty string without spaces, got {raw_id!r}")
        if raw_id in texts:
            raise DataError(f"{where}: duplicate _id {raw_id!r} (first on line {lines[raw_id]})")
        text = _text_field(row, "text", where)
        title = _text_field(row, "title", where, required=False) if with_title else ""
        joined = f"{title} {text}" if title and text else title or text
        if not joined:
            raise DataError(f"{where}: _id {raw_id!r} has an empty text")
        texts[raw_id], lines[raw_id] = joined, number
    if not texts:
        raise DataError(f"{path}: no rows")
    return texts


def read_qrels(path: Path, queries: dict[str, str], corpus: dict[str, str]) -> dict[str, dict[str, int]]:
    """``qrels[query][doc] = grade`` from a BEIR qrels TSV (a header line, then
    query-id, corpus-id, score); every id must be in ``queries`` and ``corpus``."""
    qrels: dict[str, dict[str, int]] = {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise DataError(f"{path}: no such file (the qrels of that split)") from None
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not valid UTF-8 at byte offset {err.start}") from None
    for number, line in enumerate(lines, start=1):
        fields = line.rstrip("\r").split("\t")
        if number == 1 and fields[:2] == ["query-id", "corpus-id"]:
            continue  # the header
        if not line.strip():
            continue
        where = f"{path}:{number}"
        if len(fields) != 3:
            raise DataError(f"{where}: expected 3 tab-separated fields (query-id, corpus-id, score), "
                            f"got {len(fields)}: {line[:80]!r}")
        query, doc, score = (field.strip() for field in fields)
        try:
            grade = int(score)
        except ValueError:
            raise DataError(f"{where}: score {score!r} is not an integer") from None
        if query not in queries:
            raise DataError(f"{where}: query-id {query!r} is not in queries.jsonl")
        if doc not in corpus:
            raise DataError(f"{where}: corpus-id {doc!r} is not in corpus.jsonl")
        if doc in qrels.get(query, {}):
            raise DataError(f"{where}: the pair ({query!r}, {doc!r}) is judged twice")
        qrels.setdefault(query, {})[doc] = grade
    if not qrels:
        raise DataError(f"{path}: no judgements")
    return qrels


def read_beir(directory: str | Path, split: str = "test") -> RetrievalSet:
    """A BEIR directory's corpus, queries and the qrels of ``split``; only the queries that
    the qrels judge are kept (BEIR evaluates those)."""
    root = Path(directory)
    if not root.is_dir():
        raise DataError(f"{root}: not a directory (a BEIR directory has corpus.jsonl, queries.jsonl and qrels/)")
    corpus = _read_texts(root / "corpus.jsonl", with_title=True)
    queries = _read_texts(root / "queries.jsonl", with_title=False)
    qrels = read_qrels(root / "qrels" / f"{split}.tsv", queries, corpus)
    return RetrievalSet(corpus, {q: queries[q] for q in queries if q in qrels}, qrels)


def read_corpus(path: str | Path) -> list[str]:
    """The documents of a corpus.jsonl (or of a BEIR directory's), as ``read_beir`` reads them."""
    path = Path(path)
    return list(_read_texts(path / "corpus.jsonl" if path.is_dir() else path, with_title=True).values())


def _squad_pairs(path: Path) -> tuple[dict[str, str], list[tuple[str, str, str]]]:
    """The paragraphs (id → text, repeated texts once) and (question id, question, paragraph id)
    of each answerable question of a SQuAD file."""
    from bertforge.tasks.squad.data import SquadError, get_field, load_json, location

    source = str(path)
    articles = get_field(load_json(path), "data", list, source)
    paragraphs: dict[str, str] = {}
    id_of_text: dict[str, str] = {}
    questions: list[tuple[str, str, str]] = []
    seen: set[str] = set()
    for a, article in enumerate(articles):
        for p, paragraph in enumerate(get_field(article, "paragraphs", list, source, f"data[{a}]")):
            where = f"data[{a}].paragraphs[{p}]"
            context = get_field(paragraph, "context", str, source, where).strip()
            if not context:
                raise SquadError(f"{location(source, where)}: the context is empty")
            doc_id = id_of_text.setdefault(context, f"a{a}-p{p}")
            paragraphs.setdefault(doc_id, context)
            for q, qa in enumerate(get_field(paragraph, "qas", list, source, where)):
                at = f"{where}.qas[{q}]"
                qid = get_field(qa, "id", str, source, at)
                question = get_field(qa, "question", str, source, at, qid).strip()
                if qid in seen:
                    raise SquadError(f"{location(source, at, qid)}: the question id is used twice")
                if not question:
                    raise SquadError(f"{location(source, at, qid)}: the question is empty")
                seen.add(qid)
                if qa.get("is_impossible") is not True:
                    questions.append((qid, question, doc_id))
    if not questions:
        raise SquadError(f"{source}: no answerable questions")
    return paragraphs, questions


def squad_to_beir(squad_file: str | Path, out: str | Path, split: str = "test") -> dict[str, int]:
    """Write a SQuAD file as a BEIR directory (corpus, queries, ``qrels/<split>.tsv``) plus
    ``pairs.jsonl`` (one ``{"query", "positive"}`` training row per question), all at once
    (nothing is left half-written); the counts written."""
    if Path(out).exists() and (not Path(out).is_dir() or any(Path(out).iterdir())):
        raise DataError(f"{out}: exists and is not an empty directory; choose a new output directory")
    paragraphs, questions = _squad_pairs(Path(squad_file))

    def jsonl(rows: Iterator[dict[str, str]]) -> str:
        return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)

    with atomic_directory(Path(out)) as tmp:
        (tmp / "corpus.jsonl").write_text(
            jsonl({"_id": i, "title": "", "text": t} for i, t in paragraphs.items()), encoding="utf-8")
        (tmp / "queries.jsonl").write_text(
            jsonl({"_id": q, "text": text} for q, text, _ in questions), encoding="utf-8")
        (tmp / "qrels").mkdir()
        (tmp / "qrels" / f"{split}.tsv").write_text(
            "query-id\tcorpus-id\tscore\n" + "".join(f"{q}\t{d}\t1\n" for q, _, d in questions), encoding="utf-8")
        (tmp / "pairs.jsonl").write_text(
            jsonl({"query": text, "positive": paragraphs[d]} for _, text, d in questions), encoding="utf-8")
    return {"documents": len(paragraphs), "queries": len(questions)}
