"""Text from tables: JSON Lines, Parquet and ``datasets``' ``save_to_disk`` directories.

The rows are those of ``fixtures/saved_dataset/``, written by the real
``datasets`` library (``fixtures/make_saved_dataset.py``), which also wrote the
same text in google-research/bert's format (``saved_dataset.txt``) without
bertforge. Every table of those rows must give byte for byte the records the
text file gives, in reference and fast mode.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from conftest import shared_data

from bertforge.cli import main
from bertforge.data import DataError
from bertforge.data.corpus import iter_text_corpus
from bertforge.data.create import create
from bertforge.data.text import read_documents, read_rows, row_documents

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

FIXTURES = Path(__file__).parents[1] / "fixtures"
SAVED = FIXTURES / "saved_dataset"
SAVED_TEXT = FIXTURES / "saved_dataset.txt"
VOCAB = "vocab/bert-base-uncased-vocab.txt"
SMALL = dict(dupe_factor=2, seq_len=64, max_predictions=10)


@pytest.fixture(scope="module")
def vocab() -> Path:
    return shared_data(VOCAB)


@pytest.fixture(scope="module")
def table():
    """The fixture's rows, read with pyarrow alone (not with bertforge)."""
    files = sorted(SAVED.glob("data-*.arrow"))
    assert len(files) == 2
    return pa.concat_tables(pa.ipc.open_stream(pa.memory_map(str(f))).read_all() for f in files)


@pytest.fixture(scope="module")
def tables(table, tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """The same rows as every kind of table: name -> (path, text column)."""
    out = tmp_path_factory.mktemp("tables")
    rows = table.to_pylist()
    lines = [json.dumps(row, ensure_ascii=False) for row in rows]
    lines.insert(5, "")  # a blank line in JSON Lines is skipped
    (out / "c.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    with gzip.open(out / "c.jsonl.gz", "wt", encoding="utf-8") as file:
        file.write("\n".join(lines))
    body = table.rename_columns(["id", "body"])
    pq.write_table(body, out / "c.parquet", row_group_size=7)  # 8 row groups
    half = len(rows) // 2
    pq.write_table(body.slice(0, half), out / "part1.parquet")
    pq.write_table(body.slice(half), out / "part2.parquet")
    return {"jsonl": (out / "c.jsonl", "text"), "jsonl.gz": (out / "c.jsonl.gz", "text"),
            "parquet": (out / "c.parquet", "body"), "saved": (SAVED, "text"),
            "parquet glob": (out / "part*.parquet", "body")}


def test_saved_dataset_reads_as_datasets_wrote_it(table):
    rows = list(read_rows(SAVED))
    assert [r for r, _ in rows] == list(range(52))
    assert [t for _, t in rows] == table.column("text").to_pylist()
    documents = list(row_documents([SAVED]))
    assert len(documents) == 50  # two rows without text skipped
    assert documents == list(read_documents([SAVED_TEXT]))
    assert documents[-2] == ["Ünïcödé line — with “quotes”.", "second line after a blank one", "third."]


@pytest.mark.parametrize("mode,workers", [("reference", 1), ("fast", 1), ("fast", 2)])
def test_tables_give_the_records_of_the_same_text(tmp_path, vocab, tables, mode, workers):
    options = dict(mode=mode, workers=workers, chunk_chars=4000, **SMALL)
    expected = create([SAVED_TEXT], vocab, tmp_path / "text.tfrecord", **options)
    if mode == "fast":
        assert expected.chunks == 3  # 50 documents, at least 16 per chunk: several chunks
    reference_bytes = (tmp_path / "text.tfrecord").read_bytes()
    assert expected.instances > 100
    for name, (path, column) in tables.items():
        out = tmp_path / f"{name}.tfrecord"
        stats = create([path], vocab, out, text_column=column, **options)
        assert (stats.instances, stats.documents, stats.chunks) == (
            expected.instances, expected.documents, expected.chunks), name
        assert out.read_bytes() == reference_bytes, name


def test_command_line_and_the_pretrain_corpus(tmp_path, vocab, tables, capsys):
    path, column = tables["parquet"]
    text_out, table_out = tmp_path / "a.bfrec", tmp_path / "b.bfrec"
    common = ["--vocab", str(vocab), "--mode", "fast", "--format", "native", "--dupe-factor", "1"]
    assert main(["data", "create", "--input", str(SAVED_TEXT), "--output", str(text_out)] + common) == 0
    assert main(["data", "create", "--input", str(path), "--text-column", column,
                 "--output", str(table_out)] + common) == 0
    assert table_out.read_bytes() == text_out.read_bytes()
    assert main(["data", "create", "--input", str(path), "--output", str(tmp_path / "c.bfrec")] + common) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {path}: no column 'text' (columns present: id, body)"]
    # pretrain's data.input: a document per row, as a text file with a blank line per document
    assert list(iter_text_corpus([path], text_column="body")) == list(iter_text_corpus([SAVED_TEXT]))


def test_bad_tables_are_named(tmp_path, vocab, tables):
    def error(path: Path, column: str = "text") -> str:
        with pytest.raises(DataError) as info:
            list(read_rows(path, column))
        return str(info.value)

    jsonl = tmp_path / "bad.jsonl"
    jsonl.write_text('{"text": "fine"}\n{"text": 3}\n', encoding="utf-8")
    assert error(jsonl) == f"{jsonl}: line 2: 'text' holds int, not a string"
    jsonl.write_text('{"text": "fine"}\n\n{"body": "x", "id": 1}\n', encoding="utf-8")
    assert error(jsonl) == f"{jsonl}: line 3: no column 'text' (columns present: body, id)"
    jsonl.write_text('{"text": "fine"}\n{"text": null}\n', encoding="utf-8")
    assert error(jsonl) == f"{jsonl}: line 2: 'text' holds null, not a string"
    jsonl.write_text('{"text": "fine"}\n[1]\n{"text\n', encoding="utf-8")
    assert error(jsonl) == f"{jsonl}: line 2: not a JSON object"
    jsonl.write_text('{"text\n', encoding="utf-8")
    assert error(jsonl).startswith(f"{jsonl}: line 1: not JSON (")
    fake_gz = tmp_path / "plain.jsonl.gz"
    fake_gz.write_text('{"text": "x"}\n')
    assert error(fake_gz).startswith(f"{fake_gz}: not a readable gzip file (")

    parquet = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"text": ["a", "b", None], "n": [1, 2, 3]}), parquet)
    assert error(parquet) == f"{parquet}: row 2: 'text' is null, not a string"
    assert error(parquet, "body") == f"{parquet}: no column 'body' (columns present: text, n)"
    assert error(parquet, "n") == f"{parquet}: column 'n' holds int64 values, not strings"
    not_parquet = tmp_path / "x.parquet"
    not_parquet.write_text("hello")
    assert error(not_parquet).startswith(f"{not_parquet}: not a Parquet file (")

    assert error(SAVED, "body") == f"{SAVED / 'data-00000-of-00002.arrow'}: no column 'body' " \
                                   "(columns present: id, text)"
    escape = tmp_path / "escape"
    escape.mkdir()
    (escape / "state.json").write_text('{"_data_files": [{"filename": "../c.arrow"}]}')
    assert error(escape) == f"{escape / 'state.json'}: no \"_data_files\" list of {{\"filename\": NAME}} " \
                            "(not save_to_disk's)"
    splits = tmp_path / "dict"
    splits.mkdir()
    (splits / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    assert error(splits) == f"{splits}: a DatasetDict (splits: train, test); name one split's " \
                            f"directory, e.g. {splits / 'train'}"

    with pytest.raises(DataError, match=r"the inputs mix tables \(.*c\.jsonl\) and text files \(.*\.txt\)"):
        create([tables["jsonl"][0], SAVED_TEXT], vocab, tmp_path / "o.tfrecord")
    assert not (tmp_path / "o.tfrecord").exists()


def test_parquet_is_read_a_row_group_at_a_time(tmp_path, monkeypatch):
    """A Parquet file of 40 row groups of 1 MB of text: reading it never holds much more than one."""
    rows, groups, chars = 100, 40, 10_000
    path = tmp_path / "big.parquet"
    writer = pq.ParquetWriter(path, pa.schema([("text", pa.string())]), compression="none")
    for group in range(groups):  # distinct text per row: no dictionary encoding shortcut
        texts = [f"{group:03d} {row:05d} " + chr(65 + (row + group) % 26) * chars for row in range(rows)]
        writer.write_table(pa.table({"text": texts}))
    writer.close()
    assert pq.ParquetFile(path).metadata.num_row_groups == groups
    total = groups * rows * chars  # 40 MB of text

    pulled = []
    iter_batches = pq.ParquetFile.iter_batches

    def counting(self, *args, **kwargs):
        for batch in iter_batches(self, *args, **kwargs):
            pulled.append(len(batch))
            yield batch
    monkeypatch.setattr(pq.ParquetFile, "iter_batches", counting)

    base = pa.total_allocated_bytes()
    peak = 0
    count = 0
    for row, text in read_rows(path):
        if row == 0:
            assert pulled == [rows]  # the first row came with one batch: the first row group
        assert text.startswith(f"{row // rows:03d} {row % rows:05d} ")  # in order
        count += 1
        peak = max(peak, pa.total_allocated_bytes() - base)
    assert count == rows * groups and len(pulled) == groups
    base = pa.total_allocated_bytes()
    whole = pq.read_table(path)  # what reading it at once holds: about twice the text
    whole_bytes = pa.total_allocated_bytes() - base
    del whole
    assert whole_bytes > total
    # Streaming held a few row groups' worth (about 3 MiB here) of the 76 MiB a whole read holds.
    assert peak < whole_bytes / 8, f"pyarrow held {peak / 2**20:.1f} MiB at once, a whole read " \
                                   f"{whole_bytes / 2**20:.0f} MiB"
