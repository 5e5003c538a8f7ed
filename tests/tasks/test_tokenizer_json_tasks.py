"""Fine-tuning on a ``tokenizer.json`` (a ModernBERT's): GLUE, NER and SQuAD features against
``transformers``' own example preprocessing, then end-to-end runs of a ModernBERT whose only
tokenizer is a byte-level BPE ``tokenizer.json``.

The oracles are written here from reading transformers' example scripts
(``examples/pytorch/text-classification/run_glue.py``'s ``preprocess_function``,
``token-classification/run_ner.py``'s ``tokenize_and_align_labels``,
``question-answering/run_qa.py``'s ``prepare_train_features`` /
``prepare_validation_features`` and ``utils_qa.py``'s post-processing), run with
``PreTrainedTokenizerFast(tokenizer_file=...)``. Two tokenizer.json files: a
byte-level BPE made by ``bertforge data vocab --kind bpe`` (no prefix space: a
word inside text carries its space, "Ġword") and a WordPiece one that
``tokenizers``' ``BertWordPieceTokenizer`` builds from the shared
bert-base-uncased vocab.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import shared_data

from bertforge.cli import main
from bertforge.data.fast_tokenizer import FastTokenizer, task_tokenizer
from bertforge.tasks.finetune import glue

pytestmark = pytest.mark.shared_data


def hf_tokenizer(path: Path, prefix_space: bool = False):
    """transformers' fast tokenizer of a tokenizer.json, its special tokens named as the file's."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    names = dict(cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]", mask_token="[MASK]", unk_token="[UNK]")
    if not prefix_space:
        return PreTrainedTokenizerFast(tokenizer_file=str(path), **names)
    # run_ner's add_prefix_space=True for a byte-level BPE (what RobertaTokenizerFast does with it)
    from tokenizers import pre_tokenizers
    backend = Tokenizer.from_file(str(path))
    if isinstance(backend.pre_tokenizer, pre_tokenizers.ByteLevel):
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **names)


@pytest.fixture(scope="module")
def bpe_json(tmp_path_factory) -> Path:
    """A byte-level BPE made by `bertforge data vocab --kind bpe` from the shared sample text and
    MRPC's training sentences."""
    folder = tmp_path_factory.mktemp("bpe")
    text = shared_data("text/sample_text.txt").read_text(encoding="utf-8")
    pairs = glue.read_task(shared_data("glue/MRPC"), "mrpc", "train")
    (folder / "corpus.txt").write_text(text + "\n" + "\n".join(pairs.text_a + pairs.text_b) + "\n", encoding="utf-8")
    out = folder / "tokenizer.json"
    assert main(["data", "vocab", str(folder / "corpus.txt"), str(out), "--kind", "bpe", "--vocab-size", "4000"]) == 0
    return out


@pytest.fixture(scope="module")
def wordpiece_json(tmp_path_factory) -> Path:
    """bert-base-uncased's vocab as a tokenizer.json (tokenizers' BertWordPieceTokenizer)."""
    from tokenizers import BertWordPieceTokenizer

    out = tmp_path_factory.mktemp("wp") / "tokenizer.json"
    BertWordPieceTokenizer(str(shared_data("vocab/bert-base-uncased-vocab.txt")), lowercase=True).save(str(out))
    return out


@pytest.fixture(params=["bpe", "wordpiece"])
def tokenizer_json(request, bpe_json, wordpiece_json) -> Path:
    return bpe_json if request.param == "bpe" else wordpiece_json


# ------------------------------------------------------------------ GLUE


def run_glue_features(tokenizer, examples: glue.GlueExamples, max_length: int) -> dict[str, list[list[int]]]:
    """run_glue's preprocess_function: tokenizer(s1, s2, truncation=True, max_length=...), unpadded."""
    args = (examples.text_a,) if examples.text_b is None else (examples.text_a, examples.text_b)
    return dict(tokenizer(*args, truncation=True, max_length=max_length, return_token_type_ids=True))


def mrpc(split: str, first: int) -> glue.GlueExamples:
    """The first examples of a split of the shared MRPC."""
    x = glue.read_task(shared_data("glue/MRPC"), "mrpc", split)
    return glue.GlueExamples("mrpc", split, x.source, x.ids[:first], x.text_a[:first], (x.text_b or [])[:first],
                             (x.labels or [])[:first], x.lines[:first])


def test_glue_features_equal_run_glues(tokenizer_json):
    """MRPC's dev pairs and the first 400 training pairs (808), and their first sentences alone (as a single-text
    task): our ids, masks and type ids equal run_glue's, id for id, padded with [PAD]; at 24 tokens
    most are cut by tokenizers' longest-first rule; the count of cut ones is the number longer
    than seq_len untruncated."""
    tokenizer = task_tokenizer(tokenizer_json)
    assert isinstance(tokenizer, FastTokenizer)
    theirs = hf_tokenizer(tokenizer_json)
    for seq_len, split in ((128, "train"), (128, "dev"), (24, "train"), (24, "dev")):
        pairs = mrpc(split, 400 if split == "train" else 408)
        singles = glue.GlueExamples("sst-2", split, pairs.source, pairs.ids, pairs.text_a, None, None, pairs.lines)
        for examples in (pairs, singles):
            ours = glue.convert_examples(examples, tokenizer, seq_len, ["0", "1"] if examples.labels else None)
            expected = run_glue_features(theirs, examples, seq_len)
            lengths = ours.input_mask.sum(1)
            assert [row[:n].tolist() for row, n in zip(ours.input_ids, lengths)] == expected["input_ids"]
            assert [row[:n].tolist() for row, n in zip(ours.segment_ids, lengths)] == expected["token_type_ids"]
            assert (ours.input_ids[ours.input_mask == 0] == tokenizer.pad_id).all()
            whole = theirs(*([examples.text_a] if examples.text_b is None else [examples.text_a, examples.text_b]))
            assert ours.truncated == sum(len(ids) > seq_len for ids in whole["input_ids"])
            assert (ours.truncated > len(examples) / 2) == (seq_len == 24)


# ------------------------------------------------------------------ NER


def conll_from_mrpc(path: Path, sentences: int) -> Path:
    """A CoNLL-2003 file (``word POS chunk tag``, blank lines between sentences, -DOCSTART-) of
    MRPC's real sentences; capitalised words after the first are tagged as entities (B-ORG, then
    I-ORG while capitalised), numbers B-MISC."""
    lines = ["-DOCSTART- -X- -X- O", ""]
    for sentence in mrpc("dev", sentences).text_a:
        previous = "O"
        for k, word in enumerate(sentence.split()):
            tag = ("I-ORG" if previous != "O" and previous != "B-MISC" else "B-ORG") if k and word[0].isupper() \
                else "B-MISC" if word[0].isdigit() else "O"
            lines.append(f"{word} NN I-NP {tag}")
            previous = tag
        lines.append("")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def run_ner_features(tokenizer, words: list[list[str]], tags: list[list[str]], label_to_id: dict[str, int],
                     max_length: int) -> tuple[list[list[int]], list[list[int]]]:
    """run_ner's tokenize_and_align_labels (label_all_tokens False): ids, and labels on each word's
    first token, -100 elsewhere."""
    tokenized = tokenizer(words, truncation=True, max_length=max_length, is_split_into_words=True)
    all_labels = []
    for i, sentence_tags in enumerate(tags):
        labels, previous = [], None
        for word in tokenized.word_ids(batch_index=i):
            labels.append(-100 if word is None or word == previous else label_to_id[sentence_tags[word]])
            previous = word
        all_labels.append(labels)
    return tokenized["input_ids"], all_labels


def test_ner_features_equal_run_ners(tokenizer_json, tmp_path):
    """A CoNLL file of 408 real sentences (9k words): ids and labels on each word's first token equal
    run_ner's tokenize_and_align_labels, with the add-prefix-space convention it uses for
    RoBERTa-like tokenizers on the byte-level BPE (every word is its "Ġword"), row for row; at a
    sequence of 32 the sentences that do not fit are windowed (every word labelled once) where
    run_ner truncates, and the rows of the others still equal its features."""
    from bertforge.tasks.finetune import ner

    examples = ner.read_conll(conll_from_mrpc(tmp_path / "train.txt", 408))
    labels = ner.label_list(examples)
    tokenizer = task_tokenizer(tokenizer_json)
    theirs = hf_tokenizer(tokenizer_json, prefix_space=True)
    for seq_len in (128, 32):
        ours = ner.convert_examples(examples, tokenizer, seq_len, labels)
        ids, expected = run_ner_features(theirs, examples.words, examples.tags, {t: i for i, t in enumerate(labels)},
                                         seq_len)
        single = [s for s in range(len(examples)) if (ours.sentence_index == s).sum() == 1]
        assert (len(single) == len(examples)) == (seq_len == 128) and len(single) > 80
        rows = {int(s): r for r, s in enumerate(ours.sentence_index)}
        for s in single:
            n = int(ours.input_mask[rows[s]].sum())
            assert ours.input_ids[rows[s], :n].tolist() == ids[s]
            assert ours.labels[rows[s], :n].tolist() == expected[s]
        assert (ours.input_ids[ours.input_mask == 0] == tokenizer.pad_id).all()
        first = (ours.labels != -100).sum()
        assert first == sum(len(w) for w in examples.words)
    if "bpe" in tokenizer_json.parent.name:
        # "Ġword" for every word: each is encoded as it is in running text
        running = tokenizer.tokenizer.encode(" " + " ".join(examples.words[0]), add_special_tokens=False).ids
        assert [i for w in ner.word_pieces(examples, tokenizer)[0][0] for i in w] == running
