"""Tests of ``bertforge data create`` and ``pick-eval`` on real text.

Reference mode is compared record for record with google-research/bert's
create_pretraining_data.py run in-process; fast mode's statistics are compared
with reference mode's on Wikipedia text; worker counts, bad input and MLPerf's
eval picking are checked on the same data. The Wikipedia text is a crude
extraction from the shared dump (benchmarks/data_prep.py): both sides read the
same text, so its quality does not matter.
"""

from __future__ import annotations

import bz2
import dataclasses
import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import shared_data, tmpfs

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
from data_prep import wiki_sample_text

from bertforge.data import DataError
from bertforge.data.create import CreateStats, create, generate
from bertforge.data.instances import truncated_lengths
from bertforge.data.pick_eval import make_eval, pick_eval, pick_indices
from bertforge.data.record_reader import read_records
from bertforge.data.rows import PretrainingArrays
from bertforge.data.text import chunk_ranges, expand_inputs, read_documents, read_lines, read_ranges
from bertforge.data.tokenizer import load_tokenizer, tokenize_documents
from bertforge.data.wordpiece import FastWordPiece

VOCAB = "vocab/bert-base-uncased-vocab.txt"
SAMPLE = "text/sample_text.txt"
FIXTURES = Path(__file__).parents[1] / "fixtures"
DUMP = "wiki/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
CLS, SEP, MASK = 101, 102, 103  # in the uncased vocab


@pytest.fixture(scope="module")
def vocab() -> Path:
    return shared_data(VOCAB)


@pytest.fixture(scope="module")
def wiki_text() -> str:
    """All the articles of the shared dump, about 2.5 MB of text."""
    return wiki_sample_text(shared_data(DUMP))


@pytest.fixture(scope="module")
def wiki_path(wiki_text, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("wiki_all") / "wiki.txt"
    path.write_text(wiki_text, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def wiki_files(wiki_text, tmp_path_factory) -> list[Path]:
    """About 200 KB of the articles in two files, split inside an article.

    The first file ends without a newline, in the middle of a document: the
    reference reads that document on into the second file.
    """
    text = wiki_text[:wiki_text.index("\n\n", 200_000)]
    cut = text.index("\n", text.index("\n\n", 100_000) + 2000)  # mid-article, at a line end
    assert "\n\n" not in text[cut - 300:cut + 300]
    folder = tmp_path_factory.mktemp("wiki")
    first, second = folder / "part1.txt", folder / "part2.txt"
    first.write_text(text[:cut], encoding="utf-8")
    second.write_text(text[cut + 1:] + "\n", encoding="utf-8")
    return [first, second]


def read_all(paths: list[Path]) -> PretrainingArrays:
    """The records of files written round-robin, back in their original order."""
    parts = [read_records(p) for p in paths]
    n = sum(len(p) for p in parts)
    merged = {}
    for name in vars(parts[0]):
        first = getattr(parts[0], name)
        merged[name] = np.zeros((n, *first.shape[1:]), first.dtype)
        for k, part in enumerate(parts):
            merged[name][k::len(parts)] = getattr(part, name)
    return PretrainingArrays(**merged)


# ---------------------------------------------------------------- tokenizing

EDGE_LINES = [
    "Tab\there and\x0bvertical\x0cform feed\x1cfs \x85nel end",
    "NUL\x00inside and café Ünïcode 中文字 ＡＢＣ",
    "\u2028 line sep \u00a0nbsp \u3000 ideographic\u2029para",
    "\x1f",
    "x" * 250 + " ok " + "y" * 199,
    "Ｈｅｌｌｏ!!! ...(a)[b]{c}",
    "\u0301accent \ufeffbom zero\u200bwidth",
    "İstanbul ΑΘΗΝΑ Москва naïve façade",
    "emoji 😀 and ☃ snow",
    "[SEP] [CLS] ##ing un##able",
    "exactly16bytesab abcdefgh abcdefghi supercalifragilisticexpialidocious",
    "1,234.56 $7 50% a-b_c d/e",
    "carriage\rreturn",
    "ß straße ﬁ ligature \x7fdel\x7f \u00adsoft",
    "ΟΔΟΣ ΣΑΣ ΑΣ.Α ΑΣ\u00adΑ Σ \ue000private use\U000f0000",
]


@pytest.mark.slow
@pytest.mark.parametrize("lowercase", [True, False])
def test_fast_wordpiece_equals_the_tokenizer(vocab, wiki_path, lowercase):
    """FastWordPiece gives tokenize_documents' ids (the reference's, see test_data)."""
    squad = json.loads(shared_data("squad/dev-v1.1.json").read_text(encoding="utf-8"))
    contexts = [[line.strip() for line in paragraph["context"].split("\n") if line.strip()]
                for article in squad["data"] for paragraph in article["paragraphs"]]
    wiki = list(read_documents([wiki_path]))
    with bz2.open(shared_data(DUMP), "rt", encoding="utf-8") as dump:  # raw XML and wikitext
        raw = [line.strip() for line in dump if line.strip()]
    corpora = {"wiki": wiki, "squad": contexts,
               "raw dump": [raw[i:i + 50] for i in range(0, len(raw), 50)],
               "edge": [EDGE_LINES, ["only", "x"]],
               "sample": list(read_documents([shared_data(SAMPLE)]))}
    expected = {name: tokenize_documents(load_tokenizer(vocab, lowercase), docs)
                for name, docs in corpora.items()}
    assert sum(len(s) for d in expected["wiki"] for s in d) > 500_000
    assert sum(len(s) for d in expected["squad"] for s in d) > 300_000
    ours = FastWordPiece(vocab, lowercase)
    for name, docs in corpora.items():  # one tokenizer, so later corpora hit the cache
        assert ours.encode_documents(docs).as_lists() == expected[name], name
    # A tiny cache is cleared between calls and grows within one: the ids stay the same.
    small = FastWordPiece(vocab, lowercase, max_units=40_000)
    for start in range(0, 60, 20):
        docs = wiki[start:start + 20]
        assert small.encode_documents(docs).as_lists() == tokenize_documents(
            load_tokenizer(vocab, lowercase), docs)


def test_fast_wordpiece_edge_lines_equal_bert_reference(vocab):
    from bert_reference import reference

    tokenization = reference("tokenization")
    for lowercase in (True, False):
        full = tokenization.FullTokenizer(str(vocab), do_lower_case=lowercase)
        ids, lengths = FastWordPiece(vocab, lowercase).encode_lines(EDGE_LINES)
        bounds = np.concatenate([[0], np.cumsum(lengths)])
        for k, line in enumerate(EDGE_LINES):
            want = full.convert_tokens_to_ids(full.tokenize(line))
            assert ids[bounds[k]:bounds[k + 1]].tolist() == want, (lowercase, line)
        assert lengths[3] == 0  # "\x1f" alone is no token


# ---------------------------------------------------------------- reading

def test_read_documents_like_the_reference(tmp_path):
    one, two = tmp_path / "1.txt", tmp_path / "2.txt"
    one.write_bytes(b"\xef\xbb\xbfFirst doc.\r\nStill first.\n \n\n\nSecond\xc2\xa0doc.\n  Runs on")
    two.write_bytes(b"into the next file.\n\x0c\nThird.\n")
    docs = list(read_documents([one, two]))
    # str.strip() takes the \r and the form feed (a blank line); the BOM stays.
    assert docs == [["\ufeffFirst doc.", "Still first."], ["Second\xa0doc.", "Runs on",
                                                           "into the next file."], ["Third."]]
    for block in (1, 3, 7, 64):  # lines cut by the read blocks come out whole
        assert list(read_documents([one, two], block_bytes=block)) == docs
    # As the corpus readers of pretrain and preprocess read: each file on its own, no BOM.
    assert list(read_documents([one, two], across_files=False, strip_bom=True)) == [
        ["First doc.", "Still first."], ["Second\xa0doc.", "Runs on"], ["into the next file."],
        ["Third."]]
    assert list(read_lines(two)) == [(1, "into the next file."), (2, "\x0c"), (3, "Third.")]


def test_not_utf8_names_file_and_offset(tmp_path, vocab):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"Fine line one.\nFine line two.\n\nCaf\xe9 au lait.\n")
    for block in (5, 1 << 20):
        with pytest.raises(DataError, match=r"bad\.txt: not valid UTF-8 at byte offset 34$"):
            list(read_documents([bad], block_bytes=block))
        # The documents before the bad line come first, as from a line-by-line reader.
        documents = read_documents([bad], block_bytes=block)
        assert next(documents) == ["Fine line one.", "Fine line two."]
        with pytest.raises(DataError, match="byte offset 34"):
            next(documents)
    out = tmp_path / "out" / "records.tfrecord"
    for mode in ("reference", "fast"):
        with pytest.raises(DataError, match="byte offset 34"):
            create([bad], vocab, out, mode=mode)
    assert not out.parent.exists() or list(out.parent.iterdir()) == []  # no output, no temporary


def test_chunks_are_bounded_and_cover_the_input(wiki_path, tmp_path):
    docs = list(read_documents([wiki_path]))
    chunks = list(chunk_ranges([wiki_path], chunk_bytes=50_000, min_docs=4))
    per_chunk = [list(read_ranges(chunk)) for chunk in chunks]
    assert [d for chunk in per_chunk for d in chunk] == docs
    assert len(chunks) > 10
    for ranges, chunk_docs in zip(chunks[:-1], per_chunk):
        assert len(chunk_docs) >= 4 and sum(stop - start for _, start, stop in ranges) >= 50_000
    assert len(per_chunk[-1]) >= 4
    assert len(list(chunk_ranges([wiki_path], 1 << 40, min_docs=16))) == 1  # short corpus: one chunk
    # Cuts fall only after blank lines (of spaces too), also across files and read blocks;
    # a document runs on into the next file, and a remainder of blank lines is dropped.
    rng = random.Random(0)
    pieces = ["a b\n", "\n", " \n", "\t\r\n", "\u3000\n", "x\n", "Caf\u00e9\n", " y ", "\x0c\n"]
    for trial in range(100):
        files = []
        for k in range(rng.randint(1, 3)):
            files.append(tmp_path / f"{trial}-{k}.txt")
            files[-1].write_text("".join(rng.choice(pieces) for _ in range(rng.randint(0, 40))))
        docs = list(read_documents(files))
        for chunk_bytes, min_docs, block in ((1, 1, 3), (10, 2, 7), (30, 3, 1 << 20)):
            chunks = list(chunk_ranges(files, chunk_bytes, min_docs, block_bytes=block))
            assert [d for c in chunks for d in read_ranges(c)] == docs


def test_expand_inputs(tmp_path):
    for name in ("b.txt", "a.txt", "c.md"):
        (tmp_path / name).write_text("x\n", encoding="utf-8")
    assert expand_inputs([tmp_path]) == [tmp_path / "a.txt", tmp_path / "b.txt"]
    assert expand_inputs([str(tmp_path / "*.txt"), tmp_path / "c.md"]) == [
        tmp_path / "a.txt", tmp_path / "b.txt", tmp_path / "c.md"]
    with pytest.raises(DataError, match="input not found: .*nothing"):
        expand_inputs([tmp_path / "nothing*.txt"])
    # The other callers' rules: no globs, other patterns, no directories, skipped names.
    (tmp_path / "sub.txt").mkdir()  # a directory is never one of a directory's files
    (tmp_path / "d.jsonl").write_text("{}\n", encoding="utf-8")
    (tmp_path / ".hidden.txt").write_text("x\n", encoding="utf-8")
    assert expand_inputs([tmp_path], patterns=("*.jsonl", "*.txt"), skip=(".*",)) == [
        tmp_path / "a.txt", tmp_path / "b.txt", tmp_path / "d.jsonl"]
    with pytest.raises(DataError, match=r"corpus not found: .*\*\.txt$"):
        expand_inputs([tmp_path / "*.txt"], globs=False, what="corpus")
    with pytest.raises(DataError, match=r"sub\.txt: no \*\.jsonl or \*\.md files in this directory"):
        expand_inputs([tmp_path / "sub.txt"], patterns=("*.jsonl", "*.md"))
    with pytest.raises(DataError, match=r"is a directory; name the files"):
        expand_inputs([tmp_path], patterns=())
    with pytest.raises(DataError, match="no input files given"):
        expand_inputs([])


# ---------------------------------------------------------------- reference mode

def reference_records(monkeypatch, inputs: list[Path], vocab: Path, seq_len: int,
                      max_predictions: int, dupe_factor: int, seed: int, num_files: int):
    """Run the reference script's main() in-process; return the padded features of each output file.

    Its writer is replaced by one that pads exactly as write_instance_to_example_files
    does and deals the instances round-robin over the output files.
    """
    from bert_reference import reference

    script = reference("create_pretraining_data")
    outputs: list[list[dict]] = [[] for _ in range(num_files)]

    def collect(instances, tokenizer, max_seq_length, max_predictions_per_seq, output_files):
        assert len(output_files) == num_files
        for index, instance in enumerate(instances):
            input_ids = tokenizer.convert_tokens_to_ids(instance.tokens)
            n = len(input_ids)
            assert n <= max_seq_length
            positions = list(instance.masked_lm_positions)
            labels = tokenizer.convert_tokens_to_ids(instance.masked_lm_labels)
            k = len(positions)
            pad, pad_p = [0] * (max_seq_length - n), [0] * (max_predictions_per_seq - k)
            outputs[index % num_files].append({
                "input_ids": input_ids + pad, "input_mask": [1] * n + pad,
                "segment_ids": list(instance.segment_ids) + pad,
                "masked_lm_positions": positions + pad_p, "masked_lm_ids": labels + pad_p,
                "masked_lm_weights": [1.0] * k + [0.0] * len(pad_p),
                "next_sentence_labels": [1 if instance.is_random_next else 0]})

    monkeypatch.setattr(script, "write_instance_to_example_files", collect)
    flags = {"input_file": ",".join(map(str, inputs)),
             "output_file": ",".join(f"unused{k}" for k in range(num_files)),
             "vocab_file": str(vocab), "do_lower_case": True, "max_seq_length": seq_len,
             "max_predictions_per_seq": max_predictions, "random_seed": seed,
             "dupe_factor": dupe_factor, "masked_lm_prob": 0.15, "short_seq_prob": 0.1}
    for name, value in flags.items():
        monkeypatch.setattr(script.FLAGS, name, value, raising=False)
    script.main(None)
    return outputs


@pytest.mark.parametrize(("corpus", "seq_len", "max_predictions", "dupe_factor", "seed",
                          "num_files", "fmt", "least"), [
    ("sample", 128, 20, 10, 12345, 1, "tfrecord", 100),
    ("sample", 512, 76, 5, 7, 2, "native", 30),
    ("wiki", 128, 20, 3, 12345, 3, "tfrecord", 1200),
    ("wiki", 512, 76, 2, 12345, 1, "native", 200),
])
def test_reference_mode_equals_the_reference(monkeypatch, tmp_path, vocab, wiki_files, corpus,
                                             seq_len, max_predictions, dupe_factor, seed,
                                             num_files, fmt, least):
    inputs = [shared_data(SAMPLE)] if corpus == "sample" else wiki_files
    expected = reference_records(monkeypatch, inputs, vocab, seq_len, max_predictions,
                                 dupe_factor, seed, num_files)
    stats = create(inputs, vocab, tmp_path / f"out.{fmt}", seq_len=seq_len,
                   max_predictions=max_predictions, dupe_factor=dupe_factor, seed=seed,
                   mode="reference", fmt=fmt, num_output_files=num_files)
    assert len(stats.files) == num_files
    if num_files > 1:
        assert stats.files[1].name == f"out-00001-of-{num_files:05d}.{fmt}"
    total = sum(map(len, expected))
    assert stats.instances == total > least
    for path, records in zip(stats.files, expected):
        arrays = read_records(path)
        assert len(arrays) == len(records)
        for name in records[0]:
            want = np.array([r[name] for r in records])
            have = getattr(arrays, name).reshape(len(arrays), -1)
            assert np.array_equal(have, want), name
    if corpus == "wiki":
        # The article cut between the two files is one document, as in the reference.
        assert stats.documents == len(list(read_documents(wiki_files)))
        assert stats.documents == sum(1 for _ in read_documents([wiki_files[0]])) + sum(
            1 for _ in read_documents([wiki_files[1]])) - 1


# ---------------------------------------------------------------- fast mode

@pytest.fixture(scope="module")
def regrouped(wiki_path, tmp_path_factory) -> Path:
    """1.6 MB of the articles' sentences regrouped into 1,847 documents of 1 to 12 sentences.

    Many short documents make each run's statistics steady (a long article with
    a short target length alone can move the mean length of a run of a few
    long articles by a token), so one run per mode can be compared closely.
    """
    sentences = [s for d in read_documents([wiki_path]) for s in d][:12_000]
    documents, start, k = [], 0, 0
    while start < len(sentences):
        documents.append(sentences[start:start + 1 + k % 12])
        start += 1 + k % 12
        k += 1
    path = tmp_path_factory.mktemp("regrouped") / "regrouped.txt"
    path.write_text("\n\n".join("\n".join(d) for d in documents) + "\n", encoding="utf-8")
    return path


def statistics(arrays: PretrainingArrays) -> dict[str, float]:
    length = arrays.input_mask.sum(axis=1)
    used = arrays.masked_lm_weights > 0
    shown = np.take_along_axis(arrays.input_ids, arrays.masked_lm_positions, axis=1)[used]
    original = arrays.masked_lm_ids[used]
    return {
        "random_next": arrays.next_sentence_labels.mean(),
        "mean_length": length.mean(),
        "short": (length < 100).mean(),
        "full": (length == arrays.input_ids.shape[1]).mean(),
        "masked": (shown == MASK).mean(),
        "kept": ((shown == original) & (original != MASK)).mean(),
        "replaced": ((shown != MASK) & (shown != original)).mean(),
        "a_share": ((arrays.segment_ids == 0) & (arrays.input_mask == 1)).sum(axis=1).mean()
        / length.mean(),
    }


def test_fast_mode_statistics_match_reference_mode(tmp_path, vocab, regrouped):
    """Same distributions: NSP, lengths and short sequences, 80/10/10 masking, A/B split.

    Tolerances come from 20 fast-mode and 6 reference-mode runs with other seeds
    on this text (standard deviation of one run): random next 0.0034 / 0.0050,
    mean length 0.26 / 0.31 tokens, share under 100 tokens 0.0044 / 0.0046,
    share at full length 0.0042 / 0.0040; means agreed within one deviation.
    Each bound is about 3.5 deviations of the difference of two runs. The
    masking shares are over ~370,000 predictions: one deviation is 0.0007.
    """
    ref = read_records(create([regrouped], vocab, tmp_path / "ref.native", fmt="native",
                              mode="reference").files[0])
    fast = read_records(create([regrouped], vocab, tmp_path / "fast.native", fmt="native",
                               mode="fast").files[0])
    assert abs(len(fast) - len(ref)) < 600  # ~24,500 each; one run's deviation is 80-120
    a, b = statistics(fast), statistics(ref)
    assert 0.58 < b["random_next"] < 0.65  # single-sentence chunks force a random next
    bounds = {"random_next": 0.02, "mean_length": 1.5, "short": 0.025, "full": 0.02,
              "masked": 0.005, "kept": 0.004, "replaced": 0.004, "a_share": 0.01}
    for name, bound in bounds.items():
        assert abs(a[name] - b[name]) < bound, (name, a[name], b[name])
    for s in (a, b):
        assert abs(s["masked"] - 0.8) < 0.005 and abs(s["kept"] - 0.1) < 0.004
        assert abs(s["replaced"] - 0.1) < 0.004


def test_fast_mode_without_short_sequences_matches_closely(tmp_path, vocab, wiki_path):
    """short_seq_prob=0 removes the noisiest draw: whole articles, tighter bounds.

    Measured over 20 / 4 runs on this text: random next 0.5068 ± 0.0026 (fast)
    and 0.5062 ± 0.0024 (reference), mean length 126.05 ± 0.06 and 125.91 ±
    0.03, full length 0.954 ± 0.0014 and 0.952 ± 0.0009. Fast mode draws a
    random next sentence from the chunk's documents (16 or more nearby
    articles), which lengthens random B a little: 0.14 tokens on average here.
    """
    text = wiki_path
    options = {"short_seq_prob": 0.0, "fmt": "native", "dupe_factor": 3}
    ref = read_records(create([text], vocab, tmp_path / "r.native", mode="reference",
                              **options).files[0])
    fast = read_records(create([text], vocab, tmp_path / "f.native", mode="fast",
                               **options).files[0])
    a, b = statistics(fast), statistics(ref)
    assert abs(a["random_next"] - b["random_next"]) < 0.012
    assert abs(a["mean_length"] - b["mean_length"]) < 0.5
    assert abs(a["full"] - b["full"]) < 0.008
    assert (fast.input_mask.sum(axis=1) >= 64).mean() > 0.98  # nothing aims short


@pytest.mark.parametrize("seq_len, max_predictions", [(128, 20), (512, 76)])
def test_fast_mode_rows_and_document_boundaries(tmp_path, vocab, regrouped, seq_len,
                                                max_predictions):
    """Every row is well formed; A and B are text of the documents, B's document as labelled."""
    stats = create([regrouped], vocab, tmp_path / "fast.tfrecord", seq_len=seq_len,
                   max_predictions=max_predictions, mode="fast", seed=3, dupe_factor=2)
    arrays = read_records(stats.files[0])
    n = len(arrays)
    assert n == stats.instances > (9_000 if seq_len == 128 else 2_000)
    length = arrays.input_mask.sum(axis=1)
    col = np.arange(seq_len)
    assert (arrays.input_mask == (col < length[:, None])).all()
    a_len = (arrays.segment_ids == 0).sum(axis=1) - (seq_len - length) - 2
    assert (a_len >= 1).all() and (length - a_len - 3 >= 1).all()  # A and B never empty
    assert (arrays.segment_ids == ((col >= a_len[:, None] + 2) & (col < length[:, None]))).all()
    rows = np.arange(n)
    assert (arrays.input_ids[:, 0] == CLS).all()
    assert (arrays.input_ids[rows, a_len + 1] == SEP).all()
    assert (arrays.input_ids[rows, length - 1] == SEP).all()
    assert (arrays.input_ids[col >= length[:, None]] == 0).all()
    # Predictions: the reference's count, sorted distinct positions, never [CLS] or [SEP].
    count = np.minimum(max_predictions, np.maximum(1, np.round(length * 0.15))).astype(int)
    weights = arrays.masked_lm_weights
    assert (weights.sum(axis=1) == count).all()
    assert (weights == (np.arange(max_predictions) < count[:, None])).all()
    positions = np.where(weights > 0, arrays.masked_lm_positions, -1)
    for row in range(n):
        p = positions[row, :count[row]]
        assert (np.diff(p) > 0).all() and p[0] >= 1 and p[-1] < length[row] - 1
        assert a_len[row] + 1 not in p
    assert (arrays.masked_lm_positions[weights == 0] == 0).all()
    assert (arrays.masked_lm_ids[weights == 0] == 0).all()

    # Undo the masks, then find A and B in the documents.
    original = arrays.input_ids.copy()
    np.put_along_axis(original, arrays.masked_lm_positions,
                      np.where(weights > 0, arrays.masked_lm_ids,
                               np.take_along_axis(original, arrays.masked_lm_positions, 1)), 1)
    # Two [SEP]s before masking (a random replacement may draw one: any id, as in the reference).
    assert ((original == SEP).sum(axis=1) == 2).all()
    documents = FastWordPiece(vocab).encode_documents(list(read_documents([regrouped]))).as_lists()
    texts = [" " + " ".join(str(t) for s in d for t in s) + " " for d in documents]
    labels = arrays.next_sentence_labels
    checked = {0: 0, 1: 0}
    for row in range(0, n, max(1, n // 300)):
        a = " " + " ".join(map(str, original[row, 1:a_len[row] + 1])) + " "
        b = " " + " ".join(map(str, original[row, a_len[row] + 2:length[row] - 1])) + " "
        homes_a = {k for k, t in enumerate(texts) if a in t}
        homes_b = {k for k, t in enumerate(texts) if b in t}
        assert homes_a and homes_b, row  # contiguous text of some document (masks undone)
        if labels[row] == 0:  # B follows A in A's document (truncation may cut between)
            assert any(texts[k].index(b) >= texts[k].index(a) + len(a) - 1
                       for k in homes_a & homes_b), row
        else:  # B is another document's
            assert homes_b - homes_a, row
        checked[int(labels[row])] += 1
    assert min(checked.values()) > 80  # about 300 rows checked, a third of them label 0


def test_single_sentence_documents_always_take_a_random_next(tmp_path, vocab, wiki_path):
    """A one-sentence document still makes instances, all with a random B (as the reference)."""
    sentences = [s for d in read_documents([wiki_path]) for s in d][:600]
    path = tmp_path / "singles.txt"
    path.write_text("\n\n".join(sentences) + "\n", encoding="utf-8")
    for mode in ("reference", "fast"):
        stats = create([path], vocab, tmp_path / f"{mode}.native", fmt="native", mode=mode,
                       dupe_factor=2)
        arrays = read_records(stats.files[0])
        assert stats.documents == 600 and len(arrays) == 1200  # one pair per document and pass
        assert (arrays.next_sentence_labels == 1).all(), mode


def test_truncated_lengths_match_the_reference_loop():
    for max_tokens in (5, 125, 509):
        for a_len in list(range(1, 40)) + [124, 125, 126, 300, 700]:
            for b_len in list(range(1, 40)) + [124, 125, 126, 300, 700]:
                a, b = a_len, b_len
                while a + b > max_tokens:  # truncate_seq_pair, counting only
                    if a > b:
                        a -= 1
                    else:
                        b -= 1
                got = truncated_lengths(np.array([a_len]), np.array([b_len]), max_tokens)
                assert (int(got[0][0]), int(got[1][0])) == (a, b), (max_tokens, a_len, b_len)


@pytest.mark.parametrize("fmt", ["native", "tfrecord"])
def test_output_does_not_depend_on_workers(tmp_path, vocab, regrouped, fmt):
    common = {"mode": "fast", "chunk_chars": 100_000, "dupe_factor": 2, "fmt": fmt}

    def make(name: str, **options) -> CreateStats:
        return create([regrouped], vocab, tmp_path / f"{name}.{fmt}", **{**common, **options})

    one = make("one")
    assert one.chunks >= 10
    # Workers encode the records; the parent appends their bytes, split round-robin over files.
    for workers, files in ((2, 1), (3, 3)):
        parallel = make(f"workers{workers}", workers=workers, num_output_files=files)
        single = one if files == 1 else make(f"single{files}", num_output_files=files)
        assert (parallel.instances, parallel.next_sentence_random) == (one.instances,
                                                                        one.next_sentence_random)
        for a, b in zip(parallel.files, single.files, strict=True):
            assert a.read_bytes() == b.read_bytes(), a.name
    merged, whole = read_all(parallel.files), read_records(one.files[0])
    for name in vars(whole):
        assert np.array_equal(getattr(merged, name), getattr(whole, name)), name
    assert make("again").files[0].read_bytes() == one.files[0].read_bytes()
    assert make("seed", seed=1).files[0].read_bytes() != one.files[0].read_bytes()


def test_spawned_workers_and_generate_give_the_same_instances(tmp_path, vocab, regrouped):
    common = {"chunk_chars": 100_000, "dupe_factor": 2}
    # spawn starts fresh interpreters (macOS, Windows): the same bytes.
    spawned = create([regrouped], vocab, tmp_path / "spawn.tfrecord", mode="fast", workers=2,
                     start_method="spawn", num_output_files=2, **common)
    single = create([regrouped], vocab, tmp_path / "single.tfrecord", mode="fast",
                    num_output_files=2, **common)
    for a, b in zip(spawned.files, single.files, strict=True):
        assert a.read_bytes() == b.read_bytes()
    merged = read_all(single.files)
    # generate() hands out what create() writes, chunk by chunk, with or without workers.
    for workers in (1, 2):
        stats = CreateStats(mode="fast", files=[])
        chunks = list(generate([regrouped], vocab, stats=stats, workers=workers, **common))
        assert len(chunks) == stats.chunks == single.chunks
        assert stats.instances == single.instances == len(merged.input_ids)
        for name in vars(merged):
            assert np.array_equal(np.concatenate([getattr(c, name) for c in chunks]),
                                  getattr(merged, name)), name


# ---------------------------------------------------------------- bad input

def test_bad_input(tmp_path, vocab):
    out = tmp_path / "out" / "x.tfrecord"
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n\t\n", encoding="utf-8")
    controls = tmp_path / "controls.txt"  # lines, but no tokens
    controls.write_text("\x01\x02\n\u200b\n", encoding="utf-8")
    for mode in ("reference", "fast"):
        for corpus in (empty, controls):
            with pytest.raises(DataError, match=rf"{corpus.name}: the corpus is empty"):
                create([corpus], vocab, out, mode=mode)
    assert not out.parent.exists() or list(out.parent.iterdir()) == []
    text = tmp_path / "ok.txt"
    text.write_text("One sentence.\nAnother one.\n", encoding="utf-8")
    with pytest.raises(DataError, match="vocab not found: .*nope.txt"):
        create([text], tmp_path / "nope.txt", out)
    with pytest.raises(DataError, match="input not found: .*missing.txt"):
        create([tmp_path / "missing.txt"], vocab, out)
    with pytest.raises(DataError, match="is a directory"):
        create([text], vocab, tmp_path)
    for option, message in (({"seq_len": 4}, "seq_len=4"), ({"max_predictions": 128}, "max_pre"),
                            ({"masked_lm_prob": 0.0}, "masked_lm_prob"),
                            ({"dupe_factor": 0}, "dupe"), ({"mode": "slow"}, "mode='slow'"),
                            ({"fmt": "csv"}, "format='csv'"),
                            ({"mode": "fast", "workers": 0}, "workers=0"),
                            ({"workers": 2}, "reference mode runs in one process")):
        with pytest.raises(DataError, match=message):
            create([text], vocab, out, **option)
    # Empty documents between real ones are counted and skipped.
    mixed = tmp_path / "mixed.txt"
    mixed.write_text("\x01\n\nA real sentence here.\nAnd one more.\n\n\u200b\n\nLast one.\n",
                     encoding="utf-8")
    for mode in ("reference", "fast"):
        stats = create([mixed], vocab, tmp_path / f"mixed-{mode}.tfrecord", mode=mode)
        assert (stats.documents, stats.empty_documents, stats.sentences) == (2, 2, 3)
        assert stats.instances >= 5 * 2


def test_one_document_corpus_is_warned_about(tmp_path, caplog):
    """Both modes warn, naming the corpus, when all pairs draw their "random next" from one document;
    two documents give no warning. A small vocab of the corpus' words: no shared data needed."""
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far"]
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("".join(f"{t}\n" for t in ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]))
    rng = random.Random(0)

    def sentence() -> str:
        return " ".join(rng.choice(words) for _ in range(12)) + "\n"

    one = tmp_path / "one.txt"
    one.write_text("".join(sentence() for _ in range(40)), encoding="utf-8")
    two = tmp_path / "two.txt"
    two.write_text(one.read_text() + "\n" + "".join(sentence() for _ in range(40)), encoding="utf-8")
    message = (f'{one}: only one document, so the NSP negatives ("random next" sentences) will come from '
               "the same document")
    for mode in ("reference", "fast"):
        caplog.clear()
        with caplog.at_level("WARNING", logger="bertforge"):
            stats = create([one], vocab, tmp_path / f"{mode}.tfrecord", mode=mode, seq_len=32,
                           max_predictions=5, dupe_factor=2)
        assert stats.documents == 1 and stats.next_sentence_random > 0
        assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [message], mode
        caplog.clear()
        with caplog.at_level("WARNING", logger="bertforge"):
            assert create([two], vocab, tmp_path / f"{mode}2.tfrecord", mode=mode, seq_len=32,
                          max_predictions=5, dupe_factor=2).documents == 2
        assert not [r for r in caplog.records if r.levelname == "WARNING"], mode


def test_record_files_as_input_text_are_named(tmp_path, vocab, capsys):
    """A TFRecord given to ``data create --input`` is reported as one, not as "not valid UTF-8"."""
    from bertforge.cli import main

    records = tmp_path / "records.tfrecord"
    text = tmp_path / "t.txt"
    text.write_text("One sentence here.\nAnother one.\n\nA second document.\nWith two lines.\n")
    create([text], vocab, records, dupe_factor=1)
    out = tmp_path / "out.tfrecord"
    for mode in ("reference", "fast"):
        with pytest.raises(DataError) as err:
            create([records], vocab, out, mode=mode)
        assert str(err.value) == f"{records}: a TFRecord file, not text (one sentence per line)"
    assert main(["data", "create", "--input", str(records), "--vocab", str(vocab), "--output", str(out)]) == 2
    assert capsys.readouterr().err == f"error: {records}: a TFRecord file, not text (one sentence per line)\n"
    assert not out.exists()


def test_command_line(tmp_path, vocab, wiki_files, capsys):
    from bertforge.cli import main

    out = tmp_path / "cli.native"
    pattern = str(wiki_files[0].parent / "part*.txt")
    assert main(["data", "create", "--input", pattern, "--vocab", str(vocab), "--output", str(out), "--mode",
                 "fast", "--format", "native", "--dupe-factor", "1", "--workers", "2"]) == 0
    assert "instances from" in capsys.readouterr().out
    assert len(read_records(out)) > 350  # ~470 per pass over the text
    assert main(["data", "create", "--input", pattern, "--vocab", str(tmp_path / "no.txt"), "--output",
                 str(out)]) == 2
    assert "error: vocab not found" in capsys.readouterr().err


# ---------------------------------------------------------------- MLPerf eval picking

def test_pick_eval_follows_mlperf(tmp_path, vocab, wiki_files):
    """Record int(i * N / num) for i < num, unchanged, in order (repeats when N < num)."""
    intermediate = create(wiki_files, vocab, tmp_path / "eval_intermediate.tfrecord",
                          mode="reference", seq_len=512, max_predictions=76, dupe_factor=10)
    records = read_records(intermediate.files[0])
    available = len(records)
    assert available > 1000
    for num in (100, available + 7):
        stats = pick_eval(intermediate.files, tmp_path / f"eval_{num}.tfrecord", num)
        picked = read_records(stats.output)
        # MLPerf's loop, written out: records[int(i * pick_ratio)].
        ratio = available / num
        expected = [int(i * ratio) for i in range(num)]
        assert pick_indices(available, num).tolist() == expected
        assert len(picked) == stats.picked == num
        for name in vars(records):
            assert np.array_equal(getattr(picked, name), getattr(records, name)[expected]), name
    # Several inputs are read as one, in order; either format.
    halves = create(wiki_files, vocab, tmp_path / "halves.native", mode="reference", seq_len=512,
                    max_predictions=76, dupe_factor=10, fmt="native", num_output_files=2)
    first, second = (read_records(p) for p in halves.files)
    joined = pick_eval(halves.files, tmp_path / "joined.tfrecord", 50)
    both = np.concatenate([first.input_ids, second.input_ids])
    assert np.array_equal(read_records(joined.output).input_ids,
                          both[pick_indices(len(both), 50)])
    # From text, MLPerf's two steps in one: the same records.
    direct = make_eval(wiki_files, vocab, tmp_path / "eval_direct.tfrecord", 100)
    assert direct.output.read_bytes() == (tmp_path / "eval_100.tfrecord").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    with pytest.raises(DataError, match="num=0"):
        pick_eval(intermediate.files, tmp_path / "none.tfrecord", 0)


# ---------------------------------------------------------------- a full disk, a read-only directory

def small_corpus(root: Path, documents: int = 40) -> tuple[Path, Path]:
    """(a text of ``documents`` documents of 10 sentences, its vocab): no shared data needed."""
    words = [f"w{i}" for i in range(16)]
    rng = random.Random(0)
    text = "\n\n".join("\n".join(" ".join(rng.choice(words) for _ in range(10)) for _ in range(10))
                       for _ in range(documents))
    (root / "corpus.txt").write_text(text + "\n", encoding="utf-8")
    (root / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    return root / "corpus.txt", root / "vocab.txt"


def create_argv(corpus: Path, vocab: Path, output: Path, *extra: str) -> list[str]:
    return ["data", "create", "--input", str(corpus), "--vocab", str(vocab), "--output", str(output),
            "--num-output-files", "8", "--seq-len", "32", "--max-predictions", "4", *extra]


def assert_no_shard(out: Path, capsys) -> None:
    """No file of the 8 shards of ``out/train.tfrecord`` exists, and none is taken for records."""
    from bertforge.cli import main
    from bertforge.data.create import output_paths
    from bertforge.data.record_reader import open_records

    for path in output_paths(out / "train.tfrecord", 8):
        assert not path.exists()
        with pytest.raises(DataError):
            open_records(path)
    capsys.readouterr()
    assert main(["data", "inspect", str(out / "train-00005-of-00008.tfrecord")]) == 2
    capsys.readouterr()


@pytest.mark.parametrize("pack", [[], ["--pack", "2"]], ids=["records", "packed"])
def test_a_full_disk_at_the_fifth_shard_leaves_no_shard(tmp_path, monkeypatch, capsys, pack):
    """The disk fills when shard 4 of 8 is completed, after shards 5-7 were (they close last to first;
    packed shards are written 0 to 7): exit 2, one line naming the shards and the space, and no shard
    left, neither in place nor hidden; the user's file beside them stays."""
    import errno

    from bertforge import fileio
    from bertforge.cli import main

    corpus, vocab = small_corpus(tmp_path)
    out = tmp_path / "records"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    fsync = fileio.fsync
    failed = []

    def full(path: Path) -> None:
        # Shard 4 as it is completed; with --pack the packed one, not the unpacked (under ".train.tfrecord.tmp-").
        if path.name.startswith(".train-00004-of-00008.tfrecord.tmp-") and "/.train.tfrecord.tmp-" not in str(path):
            failed.append(path)
            raise OSError(errno.ENOSPC, "No space left on device")
        fsync(path)

    monkeypatch.setattr(fileio, "fsync", full)
    assert main(create_argv(corpus, vocab, out / "train.tfrecord", *pack)) == 2
    assert len(failed) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot write {out / 'train-00000-of-00008.tfrecord'} … "
                          f"train-00007-of-00008.tfrecord (8 files): the disk is full (it needs more than the ")
    assert err.endswith(f" free on {out} after removing the partial write)\n") and err.count("\n") == 1
    assert "Traceback" not in err and " 0.0 MB" not in err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert_no_shard(out, capsys)
    monkeypatch.undo()
    assert main(create_argv(corpus, vocab, out / "train.tfrecord", *pack)) == 0  # with room: all 8
    assert len(list(out.glob("train-*-of-00008.tfrecord"))) == 8


def test_a_small_disk_leaves_no_shard(tmp_path, capsys):
    """The same on a real full disk: a 256 KiB tmpfs for about 1 MB of records (root only)."""
    import os

    from bertforge.cli import main

    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    corpus, vocab = small_corpus(tmp_path, documents=200)
    out = tmp_path / "records"
    out.mkdir()
    with tmpfs(out, "256k"):
        assert main(create_argv(corpus, vocab, out / "train.tfrecord")) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: cannot write {out / 'train-00000-of-00008.tfrecord'} … ")
        assert "the disk is full (it needs more than the " in err and err.count("\n") == 1
        assert list(out.iterdir()) == []
        assert_no_shard(out, capsys)


@pytest.mark.parametrize("pack", [[], ["--pack", "2"]], ids=["records", "packed"])
def test_a_read_only_output_directory_is_one_line(tmp_path, capsys, make_read_only, pack):
    from bertforge.cli import main

    corpus, vocab = small_corpus(tmp_path, documents=4)
    out = tmp_path / "records"
    out.mkdir()
    make_read_only(out)
    assert main(create_argv(corpus, vocab, out / "train.tfrecord", *pack)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot write {out / 'train-00000-of-00008.tfrecord'} … "
                          f"train-00007-of-00008.tfrecord (8 files): {out} is not writable (")
    assert err.count("\n") == 1 and list(out.iterdir()) == []


@pytest.mark.parametrize("pack", [[], ["--pack", "2"]], ids=["records", "packed"])
def test_an_output_named_as_a_directory_is_refused(tmp_path, capsys, pack):
    """``--output records/`` (a directory that does not exist yet) is refused in one line rather than
    written as a file named ``records``."""
    from bertforge.cli import main

    corpus, vocab = small_corpus(tmp_path, documents=4)
    argv = ["data", "create", "--input", str(corpus), "--vocab", str(vocab), "--output", f"{tmp_path / 'records'}/",
            "--seq-len", "32", "--max-predictions", "4", *pack]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == (f"error: output {tmp_path / 'records'}/ is a directory; give a file name "
                   f"(e.g. {tmp_path / 'records' / 'train.tfrecord'})\n")
    assert not (tmp_path / "records").exists()


# ---------------------------------------------------------------- whole-word masking

def split_words(arrays: PretrainingArrays, subword: np.ndarray) -> list[list[list[int]]]:
    """Per row, its predictable positions grouped into words as the reference groups them: a ##
    piece joins the group before it (across the middle [SEP] too)."""
    rows = []
    for ids, mask, segments in zip(arrays.input_ids, arrays.input_mask, arrays.segment_ids, strict=True):
        length, a_len = int(mask.sum()), int((segments[:int(mask.sum())] == 0).sum()) - 2
        groups: list[list[int]] = []
        for i in range(1, length - 1):
            if i == a_len + 1:
                continue
            if groups and subword[ids[i]]:
                groups[-1].append(i)
            else:
                groups.append([i])
        rows.append(groups)
    return rows


def assert_whole_words(arrays: PretrainingArrays, original_ids: np.ndarray, subword: np.ndarray,
                       masked_lm_prob: float = 0.15) -> float:
    """Every row predicts whole words only, at least one position and no more than the reference's
    count, with the original ids as labels; returns the share of predictions that are ## pieces."""
    unmasked = dataclasses.replace(arrays, input_ids=original_ids)
    pieces = chosen = 0
    for r, groups in enumerate(split_words(unmasked, subword)):
        used = arrays.masked_lm_weights[r] > 0
        positions = set(arrays.masked_lm_positions[r][used].tolist())
        for group in groups:
            assert set(group) <= positions or not set(group) & positions, (r, group, positions)
        length = int(arrays.input_mask[r].sum())
        assert 1 <= len(positions) <= min(arrays.masked_lm_positions.shape[1], max(1, round(length * masked_lm_prob)))
        assert np.array_equal(arrays.masked_lm_ids[r][used], original_ids[r][sorted(positions)])
        pieces += int(subword[original_ids[r][sorted(positions)]].sum())
        chosen += len(positions)
    return pieces / chosen


def originals(arrays: PretrainingArrays) -> np.ndarray:
    ids = arrays.input_ids.copy()
    for r in range(len(ids)):
        used = arrays.masked_lm_weights[r] > 0
        ids[r, arrays.masked_lm_positions[r][used]] = arrays.masked_lm_ids[r][used]
    return ids


def test_reference_mode_whole_word_masking_equals_the_reference(tmp_path, vocab):
    """--whole-word-mask in reference mode: the records of google-research/bert's
    create_pretraining_data.py --do_whole_word_mask (its GitHub version: the PyPI one predates the
    flag), written by tests/fixtures/wwm/make_wwm_records.py with the same flags."""
    expected = np.load(FIXTURES / "wwm" / "sample_text_wwm.npz")
    from bertforge.cli import main

    assert main(["data", "create", "--input", str(shared_data(SAMPLE)), "--vocab", str(vocab), "--output",
                 str(tmp_path / "wwm.tfrecord"), "--dupe-factor", "10", "--whole-word-mask"]) == 0
    arrays = read_records(tmp_path / "wwm.tfrecord")
    assert len(arrays) == len(expected["input_ids"]) == 122
    for name in expected.files:
        have, want = (a.reshape(len(arrays), -1) for a in (getattr(arrays, name), expected[name]))
        assert np.array_equal(have, want), name
    # Some words of several pieces were masked whole: the fixture tests the grouping, not only the draw.
    from bertforge.data.tokenizer import read_vocab, subword_flags

    subword = subword_flags(read_vocab(vocab))
    assert assert_whole_words(arrays, originals(arrays), subword) > 0.02


def test_fast_mode_masks_whole_words(tmp_path, vocab, regrouped):
    """Fast mode with --whole-word-mask: every row's predictions are whole words (a word's ## pieces
    with it), as many as fit the reference's count; without it, pieces are chosen alone."""
    from bertforge.data.tokenizer import read_vocab, subword_flags

    subword = subword_flags(read_vocab(vocab))
    share = {}
    for whole_word in (True, False):
        stats = create([regrouped], vocab, tmp_path / f"wwm{whole_word}.native", seq_len=128, max_predictions=20,
                       dupe_factor=1, mode="fast", fmt="native", whole_word_mask=whole_word)
        arrays = read_records(stats.files[0])
        assert len(arrays) > 1000
        if whole_word:
            share[whole_word] = assert_whole_words(arrays, originals(arrays), subword)
        else:
            with pytest.raises(AssertionError):
                assert_whole_words(arrays, originals(arrays), subword)
    assert share[True] > 0.05  # words of several pieces are chosen, whole


def test_dynamic_masking_masks_whole_words(tmp_path, vocab, regrouped):
    from bertforge.data.loader import masking_spec, remask

    stats = create([regrouped], vocab, tmp_path / "static.native", seq_len=128, max_predictions=20, dupe_factor=1,
                   mode="fast", fmt="native")
    arrays = read_records(stats.files[0]).take(slice(0, 500))
    spec = masking_spec(vocab, 0.15, whole_word=True)
    assert spec.whole_word
    again = remask(arrays, spec, np.random.default_rng(0))
    assert np.array_equal(originals(again), originals(arrays))
    assert assert_whole_words(again, originals(again), spec.vocab.continues) > 0.05
    assert not np.array_equal(again.masked_lm_positions, arrays.masked_lm_positions)


def test_pretraining_on_text_masks_whole_words_and_records_need_dynamic_masking(tmp_path, vocab, capsys):
    """data.whole_word_mask: text input is masked by whole words when its instances are made; records
    keep their masks, so there it needs data.dynamic_masking (else one line naming both keys)."""
    from bertforge.cli import main
    from bertforge.config import DataConfig
    from bertforge.data.dataset import build_datasets
    from bertforge.data.tokenizer import read_vocab, subword_flags

    data = DataConfig(input=str(shared_data(SAMPLE)), vocab=str(vocab), whole_word_mask=True, dupe_factor=2)
    train, _, _ = build_datasets(data, tmp_path)
    assert assert_whole_words(train.arrays, originals(train.arrays), subword_flags(read_vocab(vocab))) > 0.02

    records = shared_data("tfrecord/graphcore_sample_text.tfrecord")
    capsys.readouterr()
    assert main(["pretrain", "--config", "tiny", "--data.input", str(records), "--data.vocab", str(vocab),
                 "--data.whole_word_mask", "true", "--steps", "1", "--run-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        "error: data.whole_word_mask on records needs data.dynamic_masking (records keep the masks they were "
        "made with: `data create --whole-word-mask` makes whole-word ones)\n")


def test_whole_word_masking_with_a_vocab_without_word_pieces_is_warned_about(tmp_path, caplog, capsys):
    """A vocab with no ## piece makes every word one token: whole-word masking then masks single tokens,
    as masking without it does. `data create`, text input and dynamic masking each say so once (not
    once per worker); a vocab with a ## piece is not warned about."""
    from bertforge.cli import main
    from bertforge.config import DataConfig
    from bertforge.data.dataset import build_datasets
    from bertforge.data.loader import masking_spec

    words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far"]
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("".join(f"{t}\n" for t in ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]))
    rng = random.Random(0)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join("".join(" ".join(rng.choice(words) for _ in range(12)) + "\n" for _ in range(20))
                                for _ in range(8)), encoding="utf-8")
    said = ("{where}: {vocab} has no ## pieces (the continuations of a word), so every word is one token and "
            "whole-word masking masks single tokens, as masking without it does")

    def warnings() -> list[str]:
        found = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        caplog.clear()
        return found

    with caplog.at_level("WARNING", logger="bertforge"):
        for mode, workers in (("reference", 1), ("fast", 2)):
            create([corpus], vocab, tmp_path / f"{mode}.tfrecord", mode=mode, workers=workers, chunk_chars=200,
                   seq_len=32, max_predictions=5, dupe_factor=1, whole_word_mask=True)
            assert warnings() == [said.format(where="data create --whole-word-mask", vocab=vocab)], mode
        masking_spec(vocab, 0.15, whole_word=True)
        assert warnings() == [said.format(where="data.whole_word_mask", vocab=vocab)]
        build_datasets(DataConfig(input=str(corpus), vocab=str(vocab), seq_len=32, max_predictions=5, dupe_factor=1,
                                  eval_fraction=0.25, whole_word_mask=True), tmp_path / "work")
        assert warnings() == [said.format(where="data.whole_word_mask", vocab=vocab)]
        pieces = tmp_path / "pieces.txt"
        pieces.write_text(vocab.read_text() + "##s\n")
        create([corpus], pieces, tmp_path / "pieces.tfrecord", seq_len=32, max_predictions=5, dupe_factor=1,
               whole_word_mask=True)
        masking_spec(pieces, 0.15, whole_word=True)
        assert warnings() == []
    capsys.readouterr()
    assert main(["data", "create", "--input", str(corpus), "--vocab", str(vocab), "--output",
                 str(tmp_path / "cli.tfrecord"), "--seq-len", "32", "--max-predictions", "5", "--whole-word-mask"]) == 0
    assert capsys.readouterr().err == "WARNING bertforge.data.errors: " + said.format(
        where="data create --whole-word-mask", vocab=vocab) + "\n"
