"""Tests of the data pipeline on real text: corpus, vocab, instances, datasets."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from bertforge.config import DataConfig
from bertforge.data import DataError, PretrainingDataset, SyntheticDataset, build_datasets
from bertforge.data.corpus import builtin_corpus, read_text_corpus, split_sentences
from bertforge.data.dataset import split_documents
from bertforge.data.instances import create_instances, to_arrays
from bertforge.data.tokenizer import (
    SPECIAL_TOKENS,
    load_tokenizer,
    read_vocab,
    special_ids,
    tokenize_documents,
    train_wordpiece,
)
from bertforge.data.vocab import load_vocab, vocab_size_of

DATA = Path(os.environ.get("BERTFORGE_TEST_DATA",
                           Path(__file__).parents[2] / ".." / "shared" / "data"))
SAMPLE_TEXT = DATA / "text" / "sample_text.txt"
BERT_VOCAB = DATA / "vocab" / "bert-base-uncased-vocab.txt"


def need(path: Path) -> Path:
    if not path.is_file():
        pytest.skip(f"shared test data not found: {path} (set BERTFORGE_TEST_DATA)")
    return path


@pytest.fixture(scope="module")
def corpus() -> list[list[str]]:
    return builtin_corpus()


@pytest.fixture(scope="module")
def vocab(corpus, tmp_path_factory) -> Path:
    return train_wordpiece(corpus, 8192, tmp_path_factory.mktemp("vocab") / "vocab.txt")


# ---------------------------------------------------------------- corpus

def test_builtin_corpus_is_prose(corpus):
    sentences = [s for document in corpus for s in document]
    assert len(corpus) >= 100
    assert len(sentences) >= 2000
    assert sum(map(len, sentences)) >= 200_000
    assert all(document for document in corpus)
    for s in sentences:
        assert s and s == s.strip() and "\n" not in s
        assert not s.startswith((">>>", "***", "===")), s
    # The first help topic, "assert", starts with its first prose sentence, not its heading.
    assert corpus[0][0].startswith("Assert statements are a convenient way")
    assert builtin_corpus() == corpus  # deterministic


def test_split_sentences():
    text = ('Use e.g. "x" or i.e. a list, etc. in Python 3.11. Mr. Smith asked why? '
            '"Because," he said. It costs 2.50 dollars! (See also J. R. Tolkien.) Then stop.')
    assert split_sentences(text) == [
        'Use e.g. "x" or i.e. a list, etc. in Python 3.11.',
        "Mr. Smith asked why?",
        '"Because," he said.',
        "It costs 2.50 dollars!",
        "(See also J. R. Tolkien.)",
        "Then stop.",
    ]
    assert split_sentences("  no  end  ") == ["no end"]


def test_read_sample_text():
    documents = read_text_corpus(need(SAMPLE_TEXT))
    assert [len(d) for d in documents] == [3, 13, 15]
    assert documents[0][0].startswith("This text is included to make sure Unicode")
    assert documents[2][-1].endswith("on him.")


def test_read_directory_in_sorted_order(tmp_path):
    (tmp_path / "b.txt").write_text("Second file.\nStill second.\n", encoding="utf-8")
    (tmp_path / "a.txt").write_text("\nFirst.\n\n\nAnother doc.\r\nSame doc.", encoding="utf-8")
    (tmp_path / "ignored.md").write_text("Not text.\n", encoding="utf-8")
    assert read_text_corpus(tmp_path) == [
        ["First."], ["Another doc.", "Same doc."], ["Second file.", "Still second."]]


def test_bad_corpus_errors(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"Fine line.\nCaf" + b"\xe9 au lait.\n")
    with pytest.raises(DataError, match=r"bad\.txt: not valid UTF-8 at byte offset 14$"):
        read_text_corpus(bad)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"empty\.txt.*empty"):
        read_text_corpus(empty)
    with pytest.raises(DataError, match="missing.txt"):
        read_text_corpus(tmp_path / "missing.txt")
    (tmp_path / "sub").mkdir()
    with pytest.raises(DataError, match=r"sub: no \*\.txt files"):
        read_text_corpus(tmp_path / "sub")


def test_binary_files_where_text_is_expected_are_named_for_what_they_are(tmp_path):
    """A record file, a damaged record file or a compressed file given as a corpus or vocab is
    reported as such, not as "not valid UTF-8"."""
    import bz2

    from bertforge.data.record_writer import write_records
    from bertforge.data.rows import PretrainingArrays

    n, seq = 4, 16
    arrays = PretrainingArrays(
        input_ids=np.full((n, seq), 2000 + 7 * np.arange(seq), np.int32), segment_ids=np.zeros((n, seq), np.int8),
        input_mask=np.ones((n, seq), np.int8), masked_lm_positions=np.ones((n, 2), np.int32),
        masked_lm_ids=np.full((n, 2), 40000, np.int32), masked_lm_weights=np.ones((n, 2), np.float32),
        next_sentence_labels=np.zeros(n, np.int64))
    tfrecord = write_records(tmp_path / "a.tfrecord", arrays, "tfrecord")
    renamed = tmp_path / "a.txt"
    renamed.write_bytes(tfrecord.read_bytes())
    native = write_records(tmp_path / "b.bfrec", arrays, "native")
    damaged = tmp_path / "c.tfrecord"
    damaged.write_bytes(b"\xff" + tfrecord.read_bytes()[1:])
    packed = tmp_path / "d.txt.bz2"
    packed.write_bytes(bz2.compress(b"One sentence.\n" * 100))
    expected = {tfrecord: "a TFRecord file", renamed: "a TFRecord file", native: "a bertforge native record file",
                damaged: "a record file by its name (.tfrecord) but damaged at its first bytes",
                packed: "a bzip2-compressed file (decompress it first)"}
    for path, kind in expected.items():
        for read in (read_text_corpus, read_vocab):
            with pytest.raises(DataError) as err:
                read(path)
            assert str(err.value) == f"{path}: {kind}, not text (one sentence per line)", read


# ---------------------------------------------------------------- vocab and tokenizer

def test_trained_vocab(corpus, vocab):
    tokens = read_vocab(vocab)
    assert tokens[:5] == SPECIAL_TOKENS == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert 4000 <= len(tokens) <= 8192 == 8192  # the corpus runs out of merges before 8192
    assert len(set(tokens)) == len(tokens)
    assert vocab_size_of(vocab) == len(tokens)
    tokenizer = load_tokenizer(vocab)
    assert tokenizer.get_vocab_size() == len(tokens)
    assert all(tokenizer.token_to_id(t) == i for i, t in enumerate(tokens))
    assert dataclasses.astuple(special_ids(tokenizer)) == (0, 1, 2, 3, 4)
    encoding = tokenizer.encode("The \"assert\" statement: Assertions, e.g. ASSERT x!")
    assert encoding.tokens[:4] == ["the", '"', "assert", '"']  # lowercased, no [CLS]
    assert "[CLS]" not in encoding.tokens and "[UNK]" not in encoding.tokens
    # Every character of the corpus is in the vocab: no [UNK] on the training text.
    ids = tokenize_documents(tokenizer, corpus)
    assert not any(1 in sentence for document in ids for sentence in document)


def test_small_vocab_is_capped_and_training_is_deterministic(corpus, tmp_path):
    first = train_wordpiece(corpus, 300, tmp_path / "a" / "vocab.txt")
    second = train_wordpiece(corpus, 300, tmp_path / "b" / "vocab.txt")
    assert vocab_size_of(first) == 300
    assert first.read_bytes() == second.read_bytes()
    assert vocab_size_of(train_wordpiece(corpus[:5], 30, tmp_path / "tiny.txt")) <= 30
    # The temporary files were renamed away.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "tiny.txt"]


class _Document(list):
    """A document that counts how many of its kind are alive at once."""

    alive = most = 0

    def __init__(self, sentences):
        super().__init__(sentences)
        _Document.alive += 1
        _Document.most = max(_Document.most, _Document.alive)

    def __del__(self):
        _Document.alive -= 1


class _Streamed:
    """A corpus made afresh, document by document, at each iteration."""

    def __init__(self, corpus):
        self.corpus, self.passes = corpus, 0

    def __iter__(self):
        self.passes += 1
        for document in self.corpus:
            yield _Document(list(document))


def test_vocab_training_streams_the_documents(corpus, tmp_path):
    streamed = _Streamed(corpus)
    _Document.alive = _Document.most = 0
    path = train_wordpiece(streamed, 300, tmp_path / "streamed.txt")
    # Two passes (alphabet, training), holding one document at a time, not the corpus.
    assert streamed.passes == 2 and len(corpus) > 200
    assert _Document.most <= 2
    assert path.read_bytes() == train_wordpiece(corpus, 300, tmp_path / "list.txt").read_bytes()
    with pytest.raises(TypeError, match="reads the documents twice: .* not a one-shot generator"):
        train_wordpiece((d for d in corpus), 300, tmp_path / "once.txt")


def test_missing_vocab(tmp_path):
    with pytest.raises(DataError, match="nope.txt"):
        load_tokenizer(tmp_path / "nope.txt")
    with pytest.raises(DataError, match="nope.txt"):
        build_datasets(DataConfig(vocab=str(tmp_path / "nope.txt")), tmp_path)


def test_tokenize_documents_drops_empty(vocab):
    tokenizer = load_tokenizer(vocab)
    ids = tokenize_documents(tokenizer, [["", "The list."], [" ", "\t"], ["A tuple."]])
    assert ids == [[tokenizer.encode("The list.").ids], [tokenizer.encode("A tuple.").ids]]
    assert len(ids[0][0]) == 3


def reference_tokenizer(monkeypatch, vocab_file: Path):
    """google-research/bert's FullTokenizer, imported without TensorFlow."""
    pytest.importorskip("absl")
    pytest.importorskip("six")
    tf = types.ModuleType("tensorflow")  # tokenization.py only needs tf.gfile.GFile
    tf.compat = types.ModuleType("tensorflow.compat")
    tf.compat.v1 = types.ModuleType("tensorflow.compat.v1")
    tf.gfile = tf.compat.v1.gfile = types.SimpleNamespace(GFile=open)
    with monkeypatch.context() as patch:  # the stand-in is visible only while importing
        for module in (tf, tf.compat, tf.compat.v1):
            patch.setitem(sys.modules, module.__name__, module)
        tokenization = pytest.importorskip("bert.tokenization")
    # Its absl flags are never parsed here; the one it reads has this default.
    monkeypatch.setattr(tokenization, "FLAGS", types.SimpleNamespace(preserve_unused_tokens=False))
    return tokenization.FullTokenizer(vocab_file=str(vocab_file), do_lower_case=True)


def test_tokenizer_matches_bert_reference(monkeypatch, corpus):
    reference = reference_tokenizer(monkeypatch, need(BERT_VOCAB))
    ours = load_tokenizer(BERT_VOCAB)
    assert vocab_size_of(BERT_VOCAB) == len(reference.vocab) == 30522
    lines = [line for line in need(SAMPLE_TEXT).read_text(encoding="utf-8").split("\n")]
    sentences = [s for document in corpus for s in document][::5]  # varied punctuation
    texts = lines + sentences
    expected = [reference.convert_tokens_to_ids(reference.tokenize(t)) for t in texts]
    got = [e.ids for e in ours.encode_batch(texts, add_special_tokens=False)]
    assert len(texts) > 480
    for text, want, have in zip(texts, expected, got):
        assert have == want, text


# ---------------------------------------------------------------- instances

@pytest.fixture(scope="module")
def real_instances(corpus, vocab):
    tokenizer = load_tokenizer(vocab)
    documents = tokenize_documents(tokenizer, corpus)
    instances = create_instances(
        documents, seq_len=128, max_predictions=20, masked_lm_prob=0.15, short_seq_prob=0.1,
        dupe_factor=5, vocab=load_vocab(vocab), rng=random.Random(12345))
    return documents, instances, to_arrays(instances, 128, 20)


def test_instance_layout(real_instances):
    _, instances, arrays = real_instances
    n = len(instances)
    assert n > 2500
    cls, sep = 2, 3
    assert arrays.input_ids.shape == (n, 128) and arrays.input_ids.dtype == np.int32
    assert arrays.masked_lm_positions.shape == (n, 20)
    assert arrays.next_sentence_labels.dtype == np.int64
    for row, instance in enumerate(instances):
        length = len(instance.tokens)
        tokens = np.array(instance.tokens)
        assert 5 <= length <= 128
        assert tokens[0] == cls and (tokens == sep).sum() == 2
        assert tokens[instance.num_a + 1] == sep and tokens[-1] == sep
        assert (arrays.input_mask[row] == (np.arange(128) < length)).all()
        segments = arrays.segment_ids[row, :length]
        assert (segments == (np.arange(length) >= instance.num_a + 2)).all()
        assert not arrays.segment_ids[row, length:].any()
        assert not arrays.input_ids[row, length:].any()
        # Unmasked positions show the original tokens.
        shown = arrays.input_ids[row, :length]
        unmasked = np.ones(length, bool)
        unmasked[instance.masked_positions] = False
        assert (shown[unmasked] == tokens[unmasked]).all()
        assert arrays.next_sentence_labels[row] == int(instance.is_random_next)


def test_instance_text_comes_from_the_documents(real_instances):
    """A is a contiguous span of some document; an actual-next B continues it there."""
    documents, instances, _ = real_instances

    def text(ids):
        return " " + " ".join(map(str, ids)) + " "

    flat = [text(t for sentence in document for t in sentence) for document in documents]
    for instance in instances[:400]:
        a = instance.tokens[1:instance.num_a + 1]
        b = instance.tokens[instance.num_a + 2:-1]
        assert a and b
        homes = [d for d in flat if text(a) in d]
        assert homes, "segment A is not a span of any document"
        if not instance.is_random_next:
            # B followed A, maybe with truncation in between: both sit in the same document.
            assert any(text(b) in d for d in homes)


def test_masking(real_instances):
    _, instances, arrays = real_instances
    lengths = arrays.input_mask.sum(axis=1)
    counts = arrays.masked_lm_weights.sum(axis=1).astype(int)
    expected = np.minimum(20, np.maximum(1, np.round(lengths * 0.15))).astype(int)
    assert (counts == expected).all()
    kinds = {"mask": 0, "keep": 0, "random": 0}
    for row, instance in enumerate(instances):
        k = counts[row]
        positions = arrays.masked_lm_positions[row, :k]
        assert (np.diff(positions) > 0).all()  # sorted and unique
        assert (positions > 0).all() and (positions < lengths[row] - 1).all()
        assert instance.num_a + 1 not in positions  # never [CLS] or a [SEP]
        assert not arrays.masked_lm_positions[row, k:].any()
        assert not arrays.masked_lm_weights[row, k:].any()
        original = np.array(instance.tokens)[positions]
        assert (arrays.masked_lm_ids[row, :k] == original).all()
        shown = arrays.input_ids[row, positions]
        kinds["mask"] += int((shown == 4).sum())
        kinds["keep"] += int(((shown == original) & (original != 4)).sum())
        kinds["random"] += int(((shown != 4) & (shown != original)).sum())
    total = sum(kinds.values())
    assert total == counts.sum() > 30_000
    assert abs(kinds["mask"] / total - 0.8) < 0.01
    assert abs(kinds["keep"] / total - 0.1) < 0.01
    assert abs(kinds["random"] / total - 0.1) < 0.01


def test_next_sentence_fraction(real_instances):
    _, _, arrays = real_instances
    # BERT's algorithm must take a random B when a chunk holds a single sentence,
    # so the random share sits a little above one half.
    assert 0.4 <= arrays.next_sentence_labels.mean() <= 0.6


def test_short_sequences(real_instances):
    _, _, arrays = real_instances
    lengths = arrays.input_mask.sum(axis=1)
    assert (lengths <= 128).all()
    assert 0.6 < (lengths >= 110).mean() < 0.95  # most fill the sequence, some are short


# google-research/bert's create_training_instances, run in a child process: its
# module defines absl flags at import, which could clash with other tests' imports.
REFERENCE_INSTANCES = r"""
import json, random, sys, types
import absl.flags
tf = types.ModuleType("tensorflow")
tf.compat = types.ModuleType("tensorflow.compat")
tf.compat.v1 = types.ModuleType("tensorflow.compat.v1")
tf.compat.v1.gfile = types.SimpleNamespace(GFile=open)
tf.compat.v1.flags = absl.flags
for module in (tf, tf.compat, tf.compat.v1):
    sys.modules[module.__name__] = module
absl.flags.FLAGS.mark_as_parsed()
from bert import create_pretraining_data, tokenization
vocab, text, seq_len, dupe_factor, seed = sys.argv[1:]
tokenizer = tokenization.FullTokenizer(vocab, do_lower_case=True)
instances = create_pretraining_data.create_training_instances(
    [text], tokenizer, int(seq_len), int(dupe_factor), 0.1, 0.15, 20, random.Random(int(seed)))
json.dump([[tokenizer.convert_tokens_to_ids(i.tokens), i.segment_ids, i.is_random_next,
            i.masked_lm_positions, tokenizer.convert_tokens_to_ids(i.masked_lm_labels)]
           for i in instances], sys.stdout)
"""


@pytest.mark.parametrize("seq_len, dupe_factor, seed", [(128, 10, 12345), (64, 3, 1)])
def test_instances_equal_bert_reference(tmp_path, seq_len, dupe_factor, seed):
    """Same text, vocab and seed: the same instances, draw for draw, as BERT's own script."""
    for module in ("absl", "six", "bert"):
        pytest.importorskip(module)
    need(SAMPLE_TEXT)
    need(BERT_VOCAB)
    script = tmp_path / "reference.py"
    script.write_text(REFERENCE_INSTANCES, encoding="utf-8")
    result = subprocess.run([sys.executable, str(script), str(BERT_VOCAB), str(SAMPLE_TEXT),
                             str(seq_len), str(dupe_factor), str(seed)],
                            capture_output=True, text=True, timeout=120, check=True)
    reference = json.loads(result.stdout)

    tokenizer = load_tokenizer(BERT_VOCAB)
    instances = create_instances(
        tokenize_documents(tokenizer, read_text_corpus(SAMPLE_TEXT)), seq_len=seq_len,
        max_predictions=20, masked_lm_prob=0.15, short_seq_prob=0.1, dupe_factor=dupe_factor,
        vocab=load_vocab(BERT_VOCAB), rng=random.Random(seed))
    arrays = to_arrays(instances, seq_len, 20)
    assert len(arrays) == len(reference) > 10 * dupe_factor
    # The reference's padding, as in its write_instance_to_example_files.
    for row, (input_ids, segment_ids, is_random, positions, labels) in enumerate(reference):
        n, k = len(input_ids), len(positions)
        assert arrays.input_ids[row].tolist() == input_ids + [0] * (seq_len - n)
        assert arrays.segment_ids[row].tolist() == segment_ids + [0] * (seq_len - n)
        assert arrays.input_mask[row].tolist() == [1] * n + [0] * (seq_len - n)
        assert arrays.masked_lm_positions[row].tolist() == positions + [0] * (20 - k)
        assert arrays.masked_lm_ids[row].tolist() == labels + [0] * (20 - k)
        assert arrays.masked_lm_weights[row].tolist() == [1.0] * k + [0.0] * (20 - k)
        assert arrays.next_sentence_labels[row] == int(is_random)


# ---------------------------------------------------------------- datasets

def test_split_documents():
    documents = [[f"Document {i}."] for i in range(20)]
    train, held_out = split_documents(documents, 0.1)
    assert len(held_out) == 2 and len(train) == 18
    assert sorted(train + held_out) == sorted(documents)
    assert split_documents(documents[:2], 0.0) == ([documents[0]], [documents[1]])
    assert len(split_documents(documents, 0.9)[0]) >= 1
    with pytest.raises(DataError, match="1 document"):
        split_documents(documents[:1], 0.05)


def test_one_document_sets_are_warned_about(tmp_path, caplog):
    """Two documents: one for training and one held out, each its own "random next" source."""
    corpus = tmp_path / "two.txt"
    corpus.write_text("".join(f"Sentence {i} of the first document has words.\n" for i in range(30)) + "\n"
                      + "".join(f"Line {i} of the second one.\n" for i in range(5)), encoding="utf-8")
    with caplog.at_level("WARNING", logger="bertforge"):
        train, held_out, _ = build_datasets(DataConfig(input=str(corpus), vocab_size=120, dupe_factor=1),
                                            tmp_path)
    assert len(train) > 0 and len(held_out) > 0
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        f'{corpus}: only one document in the training set, so the NSP negatives ("random next" sentences) '
        "will come from the same document",
        f'{corpus}: only one document in the eval set, so the NSP negatives ("random next" sentences) '
        "will come from the same document"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="bertforge"):
        build_datasets(DataConfig(dupe_factor=1), tmp_path / "builtin")
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_build_datasets_default(tmp_path):
    train, held_out, vocab_path = build_datasets(DataConfig(), tmp_path / "one")
    assert vocab_path == tmp_path / "one" / "vocab.txt"
    assert 4000 <= vocab_size_of(vocab_path) <= 8192
    assert len(train) > 2500 and len(held_out) > 20
    batch = train.batch(np.arange(8))
    assert set(batch) == {"input_ids", "token_type_ids", "attention_mask", "masked_lm_positions",
                          "masked_lm_ids", "masked_lm_weights", "next_sentence_labels"}
    assert batch["input_ids"].shape == (8, 128) and batch["input_ids"].dtype == torch.int32  # widened on the device
    assert batch["attention_mask"].dtype == torch.uint8
    assert batch["masked_lm_ids"].shape == (8, 20)
    assert batch["masked_lm_weights"].dtype == torch.float32
    assert batch["next_sentence_labels"].shape == (8,)
    assert int(batch["input_ids"].max()) < vocab_size_of(vocab_path)
    item = train[3]
    for key, value in item.items():
        assert torch.equal(value, batch[key][3]), key
    # Same config, same arrays; another seed, other arrays.
    train2, held_out2, vocab2 = build_datasets(DataConfig(), tmp_path / "two")
    assert vocab2.read_bytes() == vocab_path.read_bytes()
    for ours, theirs in ((train, train2), (held_out, held_out2)):
        for field in dataclasses.fields(ours.arrays):
            name = field.name
            assert np.array_equal(getattr(ours.arrays, name), getattr(theirs.arrays, name)), name
    train3, _, _ = build_datasets(DataConfig(seed=7, vocab=str(vocab_path)), tmp_path / "three")
    assert not (tmp_path / "three" / "vocab.txt").exists()  # the given vocab is used
    assert not np.array_equal(train3.arrays.input_ids[:100], train.arrays.input_ids[:100])


def test_build_datasets_from_text_with_bert_vocab(tmp_path):
    data = DataConfig(input=str(need(SAMPLE_TEXT)), vocab=str(need(BERT_VOCAB)), dupe_factor=3,
                      eval_fraction=0.3)
    train, held_out, vocab_path = build_datasets(data, tmp_path)
    assert vocab_path == BERT_VOCAB and vocab_size_of(vocab_path) == 30522
    assert len(train) > 20 and len(held_out) > 3
    batch = train.batch(range(len(train)))
    assert (batch["input_ids"][:, 0] == 101).all()  # the uncased vocab's [CLS]
    assert ((batch["input_ids"] == 102).sum(dim=1) == 2).all()


def test_pretraining_dataset_batch_matches_arrays(real_instances):
    _, _, arrays = real_instances
    dataset = PretrainingDataset(arrays)
    padded = int(np.flatnonzero(arrays.input_mask.min(axis=1) == 0)[0])  # the batch then has a mask
    rows = np.array([5, 0, 5, 17, padded])
    batch = dataset.batch(rows)
    assert torch.equal(batch["input_ids"], torch.from_numpy(arrays.input_ids[rows]))
    assert torch.equal(batch["token_type_ids"], torch.from_numpy(arrays.segment_ids[rows]).int())
    assert torch.equal(batch["attention_mask"], torch.from_numpy(arrays.input_mask[rows]).to(torch.uint8))
    assert torch.equal(batch["masked_lm_weights"], torch.from_numpy(arrays.masked_lm_weights[rows]))


def test_synthetic_dataset():
    dataset = SyntheticDataset(10_000, vocab_size=1000, seed=3)
    assert len(dataset) == 10_000
    batch = dataset.batch(np.arange(64))
    assert batch["input_ids"].shape == (64, 128) and batch["input_ids"].dtype == torch.int32
    assert int(batch["input_ids"].min()) >= 0 and int(batch["input_ids"].max()) < 1000
    assert "attention_mask" not in batch  # every token is real: no mask (see PretrainingArrays.to_torch)
    assert (batch["masked_lm_weights"] == 1).all()
    assert batch["masked_lm_positions"].shape == (64, 20)
    positions = batch["masked_lm_positions"]
    assert (positions.diff(dim=1) > 0).all() and (positions >= 1).all() and (positions < 128).all()
    assert set(batch["next_sentence_labels"].tolist()) == {0, 1}
    again = SyntheticDataset(10_000, vocab_size=1000, seed=3).batch(np.arange(64))
    other = SyntheticDataset(10_000, vocab_size=1000, seed=4).batch(np.arange(64))
    assert all(torch.equal(batch[k], again[k]) for k in batch)
    assert not torch.equal(batch["input_ids"], other["input_ids"])
    assert torch.equal(dataset[7]["input_ids"], batch["input_ids"][7])
    with pytest.raises(IndexError):
        dataset.batch([10_000])
