"""BEIR directories read back, their bad rows refused by file and line, and SQuAD as retrieval."""

import json

import pytest
from conftest import shared_data

from bertforge.cli import main
from bertforge.data import DataError
from bertforge.tasks.retrieval.beir import read_beir, squad_to_beir


def write_beir(root, corpus, queries, qrels, split="test"):
    root.mkdir(parents=True, exist_ok=True)
    (root / "corpus.jsonl").write_text("".join(json.dumps(r) + "\n" for r in corpus), encoding="utf-8")
    (root / "queries.jsonl").write_text("".join(json.dumps(r) + "\n" for r in queries), encoding="utf-8")
    (root / "qrels").mkdir(exist_ok=True)
    (root / "qrels" / f"{split}.tsv").write_text("query-id\tcorpus-id\tscore\n" + qrels, encoding="utf-8")
    return root


CORPUS = [{"_id": "d1", "title": "Paris", "text": "The capital of France."},
          {"_id": "d2", "text": "Berlin is in Germany."}, {"_id": 3, "title": "Rome", "text": ""}]
QUERIES = [{"_id": "q1", "text": "capital of France"}, {"_id": "q2", "text": "where is Berlin"},
           {"_id": "q3", "text": "not judged"}]


def test_a_beir_directory_reads_back_with_titles_grades_and_judged_queries(tmp_path):
    data = read_beir(write_beir(tmp_path / "b", CORPUS, QUERIES, "q1\td1\t2\nq1\t3\t0\nq2\td2\t1\n"))
    assert data.corpus == {"d1": "Paris The capital of France.", "d2": "Berlin is in Germany.", "3": "Rome"}
    assert data.queries == {"q1": "capital of France", "q2": "where is Berlin"}  # q3 has no judgement
    assert data.qrels == {"q1": {"d1": 2, "3": 0}, "q2": {"d2": 1}}


@pytest.mark.parametrize("where, corpus, queries, qrels, message", [
    ("corpus.jsonl:2", [CORPUS[0], CORPUS[0]], QUERIES, "q1\td1\t1\n", "duplicate _id 'd1' (first on line 1)"),
    ("corpus.jsonl:1", [{"_id": "d1", "title": "", "text": "  "}], QUERIES, "q1\td1\t1\n", "empty text"),
    ("corpus.jsonl:1", [{"_id": "d 1", "text": "x"}], QUERIES, "q1\td 1\t1\n", "without spaces"),
    ("queries.jsonl:2", CORPUS, [QUERIES[0], {"_id": "q2"}], "q1\td1\t1\n", "missing field 'text'"),
    ("qrels/test.tsv:2", CORPUS, QUERIES, "q1\td9\t1\n", "corpus-id 'd9' is not in corpus.jsonl"),
    ("qrels/test.tsv:3", CORPUS, QUERIES, "q1\td1\t1\nq7\td1\t1\n", "query-id 'q7' is not in queries.jsonl"),
    ("qrels/test.tsv:2", CORPUS, QUERIES, "q1 d1 1\n", "expected 3 tab-separated fields"),
    ("qrels/test.tsv:2", CORPUS, QUERIES, "q1\td1\thigh\n", "score 'high' is not an integer"),
    ("qrels/test.tsv:3", CORPUS, QUERIES, "q1\td1\t1\nq1\td1\t2\n", "judged twice"),
])
def test_bad_rows_are_one_line_errors_naming_file_and_line(tmp_path, where, corpus, queries, qrels, message):
    root = write_beir(tmp_path / "b", corpus, queries, qrels)
    with pytest.raises(DataError) as err:
        read_beir(root)
    assert str(err.value).startswith(f"{root / where}: ") and message in str(err.value)
    assert "\n" not in str(err.value)


def test_malformed_json_names_its_line(tmp_path):
    root = write_beir(tmp_path / "b", CORPUS, QUERIES, "q1\td1\t1\n")
    (root / "queries.jsonl").write_text('{"_id": "q1", "text": "a"}\n{"_id": "q2",\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"queries\.jsonl: line 2: not JSON"):
        read_beir(root)


def test_squad_to_beir_on_a_small_file_with_a_repeated_paragraph(tmp_path):
    qa = lambda i, q: {"id": i, "question": q, "answers": [{"text": "x", "answer_start": 0}]}  # noqa: E731
    squad = {"data": [{"title": "A", "paragraphs": [{"context": "First text.", "qas": [qa("1", "one?")]},
                                                    {"context": "Second text.", "qas": [qa("2", "two?")]}]},
                      {"title": "B", "paragraphs": [{"context": "First text.", "qas": [qa("3", "three?")]},
                                                    {"context": "Other.", "qas": [{"id": "4", "question": "?",
                                                     "answers": [], "is_impossible": True}]}]}]}
    (tmp_path / "s.json").write_text(json.dumps(squad), encoding="utf-8")
    assert main(["retrieval", "from-squad", str(tmp_path / "s.json"), str(tmp_path / "ir")]) == 0
    data = read_beir(tmp_path / "ir")
    assert data.corpus == {"a0-p0": "First text.", "a0-p1": "Second text.", "a1-p1": "Other."}
    assert data.qrels == {"1": {"a0-p0": 1}, "2": {"a0-p1": 1}, "3": {"a0-p0": 1}}  # 3: the first copy; 4 left out
    pairs = [json.loads(line) for line in (tmp_path / "ir" / "pairs.jsonl").read_text().splitlines()]
    assert pairs[2] == {"query": "three?", "positive": "First text."} and len(pairs) == 3
    # an existing output is refused, and a bad file leaves nothing behind
    assert main(["retrieval", "from-squad", str(tmp_path / "s.json"), str(tmp_path / "ir")]) == 2
    (tmp_path / "bad.json").write_text(json.dumps({"data": [{"paragraphs": [{"context": "c", "qas": [
        {"id": "1", "question": "q"}, {"id": "1", "question": "q"}]}]}]}), encoding="utf-8")
    twice = r"data\[0\]\.paragraphs\[0\]\.qas\[1\] \(question 1\): the question id is used twice"
    with pytest.raises(ValueError, match=twice):
        squad_to_beir(tmp_path / "bad.json", tmp_path / "out")
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.shared_data
def test_squad_dev_as_retrieval_has_every_question_and_paragraph(tmp_path):
    counts = squad_to_beir(shared_data("squad/dev-v1.1.json"), tmp_path / "dev")
    assert counts == {"documents": 2067, "queries": 10570}
    data = read_beir(tmp_path / "dev")
    assert (len(data.corpus), len(data.queries)) == (2067, 10570)
    assert data.qrels["56be4db0acb8001400a502ec"] == {"a0-p0": 1}  # the first question: Super Bowl 50's first paragraph
    assert data.corpus["a0-p0"].startswith("Super Bowl 50 was an American football game")
