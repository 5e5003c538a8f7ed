"""Token classification (CoNLL-2003 NER): reading the files, the features against transformers'
fast tokenizer (``is_split_into_words`` and ``word_ids``, as ``run_ner``), windows over long
sentences, predictions back to words and to conlleval files, and the entity scores against
seqeval on thousands of random tag sequences.

The CoNLL files are written here, small, in the exact format (no real CoNLL data).
"""

from __future__ import annotations

import inspect
import random
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from conftest import shared_data

from bertforge.data.tokenizer import SPECIAL_TOKENS, encode_texts, load_tokenizer
from bertforge.tasks.finetune import FinetuneError, ner
from bertforge.tasks.finetune.ner import NerError

VOCAB = "vocab/bert-base-uncased-vocab.txt"
# A vocab small enough to know every split by heart: "unbelievable" is un ##believ ##able.
TINY_WORDS = ["the", "cat", "john", "smith", "new", "york", "un", "##believ", "##able", "##s", ".", ",",
              "walk", "##ed", "in", "eu", "rejects", "german", "call"]

CONLL = """\
-DOCSTART- -X- -X- O

EU NNP B-NP B-ORG
rejects VBZ B-VP O
German JJ B-NP B-MISC
call NN I-NP O
. . O O

John NNP B-NP B-PER
Smith NNP I-NP I-PER

-DOCSTART- -X- -X- O

New NNP B-NP B-LOC
York NNP I-NP I-LOC
"""


def write(path: Path, text: str, encoding: str = "utf-8") -> Path:
    path.write_bytes(text.encode(encoding))
    return path


@pytest.fixture
def tiny(tmp_path):
    vocab = write(tmp_path / "vocab.txt", "\n".join(SPECIAL_TOKENS + TINY_WORDS) + "\n")
    return load_tokenizer(vocab, lowercase=True)


def examples_of(tmp_path: Path, sentences: list[list[tuple[str, str]]], name: str = "data.txt") -> ner.NerExamples:
    text = "\n\n".join("\n".join(f"{w} {t}" for w, t in s) for s in sentences) + "\n"
    return ner.read_conll(write(tmp_path / name, text))


# ------------------------------------------------------------------ reading


def test_read_conll_sentences_documents_and_lines(tmp_path):
    examples = ner.read_conll(write(tmp_path / "train.txt", CONLL))
    assert examples.words == [["EU", "rejects", "German", "call", "."], ["John", "Smith"], ["New", "York"]]
    assert examples.tags == [["B-ORG", "O", "B-MISC", "O", "O"], ["B-PER", "I-PER"], ["B-LOC", "I-LOC"]]
    assert examples.lines == [3, 9, 14]
    assert examples.where(0, 2) == f"{tmp_path / 'train.txt'}:5"  # German
    assert len(examples) == 3 and examples.labelled
    head = examples.head(2)
    assert head.words == examples.words[:2] and head.tags == examples.tags[:2] and head.lines == [3, 9]


def test_read_conll_accepts_word_tag_files_tabs_crlf_a_bom_and_blank_runs(tmp_path):
    # No final newline; a line of a space alone is blank.
    text = "\ufeffEU\tB-ORG\r\nrejects \t O\r\n\r\n \r\n\r\n-DOCSTART- O\r\nJohn B-PER\r\nSmith  I-PER"
    examples = ner.read_conll(write(tmp_path / "x.txt", text))
    assert examples.words == [["EU", "rejects"], ["John", "Smith"]]
    assert examples.tags == [["B-ORG", "O"], ["B-PER", "I-PER"]]
    # A DOCSTART line ends a sentence even without a blank line before it.
    assert examples.lines == [1, 7]


def test_unlabelled_reading_keeps_the_words_only(tmp_path):
    words_only = ner.read_conll(write(tmp_path / "test.txt", "EU\nrejects\n\nJohn\n"), labelled=False)
    assert words_only.words == [["EU", "rejects"], ["John"]] and words_only.tags == []
    assert not words_only.labelled and words_only.lines == [1, 4]
    full = ner.read_conll(write(tmp_path / "train.txt", CONLL), labelled=False)
    assert full.words == ner.read_conll(tmp_path / "train.txt").words and full.tags == []
    assert ner.is_labelled(tmp_path / "train.txt")
    assert not ner.is_labelled(tmp_path / "test.txt")
    assert not ner.is_labelled(write(tmp_path / "pos.txt", "-DOCSTART- -X- O\n\nEU NNP\n"))


@pytest.mark.parametrize("text, line, message", [
    ("EU B-ORG\nrejects\n", 2, "expected a word and its tag, got one column 'rejects'"),
    ("EU NNP B-NP B-ORG\n\nrejects VBZ O\n", 3, "3 columns where the file's first token line has 4"),
    ("EU PER\n", 1, "tag 'PER' is not O, B-X, I-X, E-X or S-X"),
    ("EU B-\n", 1, "tag 'B-' is not O"),
    ("EU b-ORG\n", 1, "tag 'b-ORG' is not O"),
    ("EU X-ORG\n", 1, "tag 'X-ORG' is not O"),
    ("EU B\n", 1, "tag 'B' is not O"),
    ("EU 0\n", 1, "tag '0' is not O"),
    ("EU O\nrejects B-ORG\n\xff\n", 3, "not valid UTF-8 (byte offset"),
])
def test_malformed_lines_name_the_file_and_line(tmp_path, text, line, message):
    path = tmp_path / "bad.txt"
    path.write_bytes(text.encode("utf-8") if "\xff" not in text else text.encode("latin-1"))
    with pytest.raises(NerError) as err:
        ner.read_conll(path)
    assert str(err.value).startswith(f"{path}:{line}: ") and message in str(err.value)
    assert "\n" not in str(err.value)
    assert isinstance(err.value, FinetuneError)


@pytest.mark.parametrize("make, message", [
    (lambda p: write(p / "empty.txt", "-DOCSTART- -X- -X- O\n\n\n"), "empty.txt: no sentences"),
    (lambda p: p / "missing.txt", "file not found: "),
    (lambda p: p, "is a directory, not a CoNLL file"),
])
def test_unreadable_files_are_one_line_errors(tmp_path, make, message):
    with pytest.raises(NerError, match="^[^\n]*$") as err:
        ner.read_conll(make(tmp_path))
    assert message in str(err.value)


def test_label_list_is_o_first_then_sorted_and_deterministic(tmp_path):
    examples = examples_of(tmp_path, [[("a", "I-PER"), ("b", "B-LOC"), ("c", "O")], [("d", "B-PER"), ("e", "I-LOC")]])
    assert ner.label_list(examples) == ["O", "B-LOC", "B-PER", "I-LOC", "I-PER"]
    # O even where the file has none: a model must be able to say "no entity".
    assert ner.label_list(examples_of(tmp_path, [[("a", "S-X")]])) == ["O", "S-X"]
    with pytest.raises(NerError, match="labelled file"):
        ner.label_list(ner.read_conll(tmp_path / "data.txt", labelled=False))


def test_find_files_by_their_usual_names(tmp_path):
    for name in ("eng.train", "valid.txt", "test.txt", "notes.txt"):
        write(tmp_path / name, "a O\n")
    assert ner.find_files(tmp_path) == {"train": tmp_path / "eng.train", "dev": tmp_path / "valid.txt",
                                        "test": tmp_path / "test.txt"}
    write(tmp_path / "dev.txt", "a O\n")
    with pytest.raises(NerError, match="both dev.txt and valid.txt hold the dev split"):
        ner.find_files(tmp_path)
    with pytest.raises(NerError, match="not a directory"):
        ner.find_files(tmp_path / "nope")


# ------------------------------------------------------------------ features


def test_first_subword_labelling(tmp_path, tiny):
    examples = examples_of(tmp_path, [[("John", "B-PER"), ("unbelievable", "O"), ("cats", "O"), (".", "O")],
                                      [("New", "B-LOC"), ("York", "I-LOC")]])
    labels = ner.label_list(examples)
    f = ner.convert_examples(examples, tiny, 10, labels)
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + TINY_WORDS)}
    ids = [vocab[t] for t in ["[CLS]", "john", "un", "##believ", "##able", "cat", "##s", ".", "[SEP]"]]
    assert f.input_ids[0].tolist() == ids + [0]
    assert f.input_mask[0].tolist() == [1] * 9 + [0]
    assert f.labels[0].tolist() == [-100, labels.index("B-PER"), labels.index("O"), -100, -100,
                                    labels.index("O"), -100, labels.index("O"), -100, -100]
    assert f.word_index[0].tolist() == [-1, 0, 1, -1, -1, 2, -1, 3, -1, -1]
    assert f.word_index[1].tolist() == [-1, 0, 1] + [-1] * 7
    assert f.sentence_index.tolist() == [0, 1]
    for name in ("input_ids", "segment_ids", "input_mask"):
        assert getattr(f, name).dtype == np.int32 and getattr(f, name).shape == (2, 10)
    assert f.labels.dtype == np.int64 and f.word_index.dtype == np.int32 and f.sentence_index.shape == (2,)
    assert not f.segment_ids.any()
    assert (f.split_sentences, f.truncated_words, f.empty_words) == (0, 0, 0) and len(f) == 2
    assert f.label_list == labels and "NerFeatures(2 × 10" in repr(f)


def test_an_unknown_tag_names_itself_the_file_and_line(tmp_path, tiny):
    train = examples_of(tmp_path, [[("john", "B-PER")]], "train.txt")
    dev = examples_of(tmp_path, [[("john", "B-PER")], [("the", "O"), ("cat", "B-ANIMAL")]], "dev.txt")
    with pytest.raises(NerError) as err:
        ner.convert_examples(dev, tiny, 16, ner.label_list(train))
    assert str(err.value) == f"{tmp_path / 'dev.txt'}:4: tag 'B-ANIMAL' is not one of the model's labels (O, B-PER)"


def test_unlabelled_examples_have_no_labels_but_word_positions(tmp_path, tiny):
    examples = ner.read_conll(write(tmp_path / "t.txt", "John\nwalked\n"), labelled=False)
    f = ner.convert_examples(examples, tiny, 8, ["O", "B-PER"])
    assert (f.labels == -100).all()
    assert f.word_index[0].tolist() == [-1, 0, 1, -1, -1, -1, -1, -1]


def test_long_sentences_are_split_at_word_boundaries_and_every_word_predicted_once(tmp_path, tiny):
    rng = random.Random(0)
    vocab = ["john", "unbelievable", "cats", "walked", ".", "the", "new"]  # 1, 3, 2, 2, 1, 1, 1 WordPieces
    pieces = {"john": 1, "unbelievable": 3, "cats": 2, "walked": 2, ".": 1, "the": 1, "new": 1}
    tags = ["O", "B-PER", "I-PER", "B-LOC"]
    long = [(rng.choice(vocab), rng.choice(tags)) for _ in range(40)]
    short = [("the", "O"), ("cat", "O")]
    examples = examples_of(tmp_path, [short, long, short])
    labels = ner.label_list(examples)
    seq_len = 8
    f = ner.convert_examples(examples, tiny, seq_len, labels)
    assert f.split_sentences == 1 and f.truncated_words == 0
    windows = np.flatnonzero(f.sentence_index == 1)
    assert len(windows) > 1 and f.sentence_index.tolist() == [0] + [1] * len(windows) + [2]
    total = sum(pieces[w] for w, _ in long)
    assert sum(int(f.input_mask[r].sum()) - 2 for r in windows) == total  # nothing lost, nothing repeated
    seen = []
    for r in windows:
        length = int(f.input_mask[r].sum())
        assert f.input_ids[r, 0] == tiny.token_to_id("[CLS]")
        assert f.input_ids[r, length - 1] == tiny.token_to_id("[SEP]")
        # A window ends at a word boundary: the next window's first word could not fit.
        seen += f.word_index[r][f.word_index[r] >= 0].tolist()
        if r != windows[-1]:
            next_word = int(f.word_index[r + 1][1])
            assert length - 2 + pieces[long[next_word][0]] > seq_len - 2
    assert seen == list(range(len(long)))
    # Gold label ids back to words: the tags, exactly.
    assert ner.word_predictions(f, f.labels.clip(0), examples) == examples.tags


def test_a_word_longer_than_a_window_keeps_its_first_pieces(tmp_path, tiny):
    examples = examples_of(tmp_path, [[("john", "B-PER"), ("unbelievable", "O"), ("cats", "O")]])
    f = ner.convert_examples(examples, tiny, 4, ner.label_list(examples))  # room for 2 WordPieces
    assert f.truncated_words == 1 and f.split_sentences == 1
    assert [tiny.id_to_token(i) for i in f.input_ids[1, 1:3]] == ["un", "##believ"]
    assert ner.word_predictions(f, f.labels.clip(0), examples) == examples.tags
    with pytest.raises(NerError, match="seq_len=2 leaves no room"):
        ner.convert_examples(examples, tiny, 2, ner.label_list(examples))


def test_a_word_that_tokenizes_to_nothing_becomes_unk(tmp_path, tiny):
    examples = examples_of(tmp_path, [[("john", "B-PER"), ("\u200b", "O"), ("\x07", "B-LOC"), ("cats", "O")]])
    f = ner.convert_examples(examples, tiny, 10, ner.label_list(examples))
    unk = tiny.token_to_id("[UNK]")
    assert f.empty_words == 2
    assert f.input_ids[0, :6].tolist()[2:4] == [unk, unk]
    assert f.word_index[0, :7].tolist() == [-1, 0, 1, 2, 3, -1, -1]
    assert ner.word_predictions(f, f.labels.clip(0), examples) == examples.tags


def _hf_features(hf, words: list[str], tags: list[str], labels: list[str], seq_len: int):
    """transformers' run_ner ``tokenize_and_align_labels`` with ``label_all_tokens=False``, padded."""
    encoding = hf(words, is_split_into_words=True, truncation=False)
    label_ids, previous = [], None
    for word in encoding.word_ids():
        label_ids.append(-100 if word is None or word == previous else labels.index(tags[word]))
        previous = word
    ids = encoding["input_ids"]
    pad = seq_len - len(ids)
    return ids + [0] * pad, label_ids + [-100] * pad, encoding["attention_mask"] + [0] * pad


# Words as CoNLL-2003 has them and some it does not: punctuation inside words, numbers, accents,
# a German sharp s, CJK, Greek, hyphens, apostrophes, rare long words.
HF_SENTENCES = [
    "EU rejects German call to boycott British lamb .",
    "Peter Blackburn BRUSSELS 1996-08-22",
    "S&P 500 's U.S.-based ( Müller ) naïve café Straße 3,000 don't e-mail @user #tag",
    "中国 北京 Zürich ... -- Ελλάδα Supercalifragilisticexpialidocious antidisestablishmentarianism",
    "Germany 's representative to the European Union 's veterinary committee Werner Zwingmann said on Wednesday",
    "CRICKET - LEICESTERSHIRE TAKE OVER AT TOP AFTER INNINGS VICTORY .",
]


def test_features_equal_transformers_fast_tokenizer_with_word_ids(tmp_path):
    transformers = pytest.importorskip("transformers")
    vocab = shared_data(VOCAB)
    # transformers 5 takes the vocab as `vocab` (and ignores `vocab_file`); 4 as `vocab_file`.
    key = "vocab" if "vocab" in inspect.signature(transformers.BertTokenizerFast.__init__).parameters else "vocab_file"
    hf = transformers.BertTokenizerFast(**{key: str(vocab)}, do_lower_case=True)
    assert hf.is_fast and hf.convert_tokens_to_ids("[CLS]") == 101
    rng = random.Random(1)
    types = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC", "B-MISC", "I-MISC", "B-ORG", "I-ORG"]
    sentences = [[(w, rng.choice(types)) for w in s.split()] for s in HF_SENTENCES]
    examples = examples_of(tmp_path, sentences)
    labels = ner.label_list(examples)
    seq_len = 64
    f = ner.convert_examples(examples, load_tokenizer(vocab, lowercase=True), seq_len, labels)
    assert f.split_sentences == 0 and len(f) == len(sentences)
    for i, (words, tags) in enumerate(zip(examples.words, examples.tags, strict=True)):
        ids, label_ids, mask = _hf_features(hf, words, tags, labels, seq_len)
        assert f.input_ids[i].tolist() == ids, words
        assert f.labels[i].tolist() == label_ids, words
        assert f.input_mask[i].tolist() == mask
        # word_index marks exactly HF's labelled positions, with their word.
        encoding = hf(words, is_split_into_words=True)
        firsts = [(p, w) for p, w in enumerate(encoding.word_ids())
                  if w is not None and (p == 0 or encoding.word_ids()[p - 1] != w)]
        assert [(p, int(f.word_index[i, p])) for p in np.flatnonzero(f.word_index[i] >= 0)] == firsts


def test_each_word_is_tokenized_as_the_reference_tokenizes_it_alone(tmp_path):
    """Word by word, the ids of ``encode_texts`` (google-research/bert's FullTokenizer): with a final
    capital sigma too, which transformers' fast tokenizer lowercases to σ, the reference to ς."""
    vocab = shared_data(VOCAB)
    tokenizer = load_tokenizer(vocab, lowercase=True)
    words = " ".join(HF_SENTENCES).split() + ["ΣΟΦΟΣ", "ΟΔΥΣΣΕΥΣ."]
    examples = examples_of(tmp_path, [[(w, "O") for w in words]])
    pieces, empty = ner.word_pieces(examples, tokenizer)
    assert empty == 0 and pieces[0] == encode_texts(tokenizer, words)


# ------------------------------------------------------------------ predictions


def test_word_predictions_from_logits_and_ids(tmp_path, tiny):
    examples = examples_of(tmp_path, [[("john", "B-PER"), ("smith", "I-PER"), ("walked", "O")], [("new", "B-LOC")]])
    labels = ner.label_list(examples)  # O, B-LOC, B-PER, I-PER
    f = ner.convert_examples(examples, tiny, 5, labels)  # the first sentence (4 WordPieces) needs two windows
    assert f.split_sentences == 1
    wanted = [["I-PER", "O", "B-LOC"], ["B-PER"]]
    ids = np.zeros(f.input_ids.shape, np.int64)
    for row, position in zip(*np.nonzero(f.word_index >= 0), strict=True):
        ids[row, position] = labels.index(wanted[f.sentence_index[row]][f.word_index[row, position]])
    logits = np.random.default_rng(0).normal(size=(*ids.shape, len(labels))).astype(np.float32)
    np.put_along_axis(logits, ids[..., None], 10.0, axis=-1)
    assert ner.word_predictions(f, ids, examples) == wanted
    assert ner.word_predictions(f, logits, examples, labels) == wanted
    with pytest.raises(NerError, match="logits have 3 labels, the label list 4"):
        ner.word_predictions(f, logits[..., :3], examples)
    with pytest.raises(NerError, match="predictions of shape"):
        ner.word_predictions(f, ids[:, :3], examples)
    with pytest.raises(NerError, match="outside the 4 labels"):
        ner.word_predictions(f, ids + 4, examples)
    with pytest.raises(NerError, match="not every word is predicted once"):
        ner.word_predictions(f, ids, examples_of(tmp_path, [[("a", "O")] * 4, [("b", "O")]], "other.txt"))
    with pytest.raises(NerError, match="they have more words"):
        ner.word_predictions(f, ids, examples_of(tmp_path, [[("a", "O")], [("b", "O")]], "other.txt"))


def test_write_predictions_as_conlleval_reads_them(tmp_path):
    examples = examples_of(tmp_path, [[("John", "B-PER"), ("Smith", "I-PER")], [("Paris", "B-LOC")]])
    predictions = [["B-PER", "O"], ["B-ORG"]]
    path = ner.write_predictions(tmp_path / "out" / "dev.txt", examples, predictions)
    assert path.read_text(encoding="utf-8") == "John B-PER B-PER\nSmith I-PER O\n\nParis B-LOC B-ORG\n\n"
    assert sorted(p.name for p in path.parent.iterdir()) == ["dev.txt"]  # no temporary left behind
    back = ner.read_conll(path)  # the last column is the prediction
    assert back.words == examples.words and back.tags == predictions
    unlabelled = ner.read_conll(tmp_path / "data.txt", labelled=False)
    ner.write_predictions(path, unlabelled, predictions)
    assert path.read_text(encoding="utf-8") == "John B-PER\nSmith O\n\nParis B-ORG\n\n"
    with pytest.raises(NerError, match="do not match the sentences"):
        ner.write_predictions(path, examples, [["O"], ["O"]])


# ------------------------------------------------------------------ scores against seqeval


def _seqeval(true, pred):
    from seqeval import metrics

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # UndefinedMetricWarning where nothing was predicted
        return {"precision": metrics.precision_score(true, pred), "recall": metrics.recall_score(true, pred),
                "f1": metrics.f1_score(true, pred), "accuracy": metrics.accuracy_score(true, pred),
                "report": metrics.classification_report(true, pred, output_dict=True)}


def assert_equal_to_seqeval(true, pred, tolerance=1e-12):
    ours = ner.entity_scores(true, pred)
    theirs = _seqeval(true, pred)
    for key in ("precision", "recall", "f1", "accuracy"):
        assert abs(ours[key] - theirs[key]) <= tolerance, (key, true, pred)
    report = theirs["report"]
    assert ours["support"] == report["micro avg"]["support"]
    types = {k: v for k, v in report.items() if not k.endswith(" avg")}
    assert list(ours["types"]) == list(types), (true, pred)
    for name, row in types.items():
        mine = ours["types"][name]
        assert mine["support"] == row["support"]
        for key, their_key in (("precision", "precision"), ("recall", "recall"), ("f1", "f1-score")):
            assert abs(mine[key] - row[their_key]) <= tolerance, (name, key, true, pred)
    return ours


# Types with a hyphen and "_" (seqeval's type of O) besides the usual ones.
TYPES = ["PER", "LOC", "MISC", "A-B", "_"]
PREFIXES = "BIES"


def _random_tags(rng: random.Random, length: int, types: list[str]) -> list[str]:
    return ["O" if rng.random() < 0.35 else f"{rng.choice(PREFIXES)}-{rng.choice(types)}" for _ in range(length)]


def _mutate(rng: random.Random, tags: list[str], types: list[str]) -> list[str]:
    out = list(tags)
    for i in range(len(out)):
        roll = rng.random()
        if roll < 0.1:
            out[i] = "O"
        elif roll < 0.2:
            out[i] = f"{rng.choice(PREFIXES)}-{rng.choice(types)}"
        elif roll < 0.25 and out[i] != "O":
            out[i] = f"{rng.choice(PREFIXES)}{out[i][1:]}"  # same type, another prefix
    return out


def test_entities_equal_seqeval_get_entities_on_random_sequences():
    from seqeval.metrics.sequence_labeling import get_entities

    rng = random.Random(0)
    for _ in range(3000):
        tags = _random_tags(rng, rng.randint(0, 12), TYPES[:rng.randint(1, len(TYPES))])
        assert ner.entities(tags) == get_entities(tags), tags


def test_entity_scores_equal_seqeval_on_random_tag_sequences():
    rng = random.Random(1)
    exact = 0
    for case in range(3000):
        types = TYPES[:rng.randint(1, len(TYPES))]
        true = [_random_tags(rng, rng.randint(0 if case % 7 else 1, 10), types) for _ in range(rng.randint(1, 6))]
        if not any(true):
            true[0] = ["O"]
        style = case % 4
        if style == 0:  # independent
            pred = [_random_tags(rng, len(t), types) for t in true]
        elif style == 1:  # close to the truth
            pred = [_mutate(rng, t, types) for t in true]
        elif style == 2:  # nothing predicted
            pred = [["O"] * len(t) for t in true]
        else:  # IOB1-like: entities by I- alone, B- only between two of a type
            true = [[t if t == "O" else "I" + t[1:] for t in s] for s in true]
            pred = [_mutate(rng, t, types) for t in true]
        ours = assert_equal_to_seqeval(true, pred)
        theirs = _seqeval(true, pred)
        exact += all(ours[k] == theirs[k] for k in ("precision", "recall", "f1", "accuracy"))
    assert exact == 3000  # not only within 1e-12: the same floats


@pytest.mark.parametrize("true, pred", [
    ([["O", "I-PER", "I-PER", "O"]], [["O", "B-PER", "I-PER", "O"]]),                  # IOB1 vs IOB2: equal
    ([["I-PER", "I-PER", "B-PER", "O"]], [["I-PER", "I-PER", "I-PER", "O"]]),          # IOB1: B- splits
    ([["B-PER", "I-LOC", "I-LOC"]], [["B-PER", "B-LOC", "I-LOC"]]),                     # type change starts one
    ([["S-PER", "B-LOC", "E-LOC", "O"]], [["S-PER", "B-LOC", "I-LOC", "E-LOC"]]),       # IOBES
    ([["E-PER", "E-PER", "I-PER", "S-PER"]], [["O", "E-PER", "I-PER", "S-PER"]]),       # stray E-, I- after E-
    ([["B-PER", "I-PER"], ["I-PER", "O"]], [["B-PER", "I-PER"], ["I-PER", "O"]]),       # no entity across sentences
    ([["B-PER", "O"]], [["O", "O"]]),                                                   # nothing predicted
    ([["O", "O"]], [["B-PER", "O"]]),                                                   # nothing true
    ([["O", "O"]], [["O", "O"]]),                                                       # nothing at all
    ([[], ["B-PER"]], [[], ["B-PER"]]),                                                 # an empty sentence
])
def test_entity_scores_edge_cases(true, pred):
    assert_equal_to_seqeval(true, pred)


def test_entity_scores_values_and_errors():
    scores = ner.entity_scores([["B-PER", "I-PER", "O", "B-LOC"]], [["B-PER", "I-PER", "O", "B-ORG"]])
    assert (scores["precision"], scores["recall"], scores["f1"], scores["accuracy"]) == (0.5, 0.5, 0.5, 0.75)
    assert (scores["support"], scores["predicted"], scores["correct"]) == (2, 2, 1)
    assert scores["types"]["LOC"] == {"precision": 0.0, "recall": 0.0, "f1": 0.0, "support": 1}
    assert scores["types"]["ORG"]["support"] == 0 and scores["types"]["PER"]["f1"] == 1.0
    assert ner.overall(scores) == {"precision": 0.5, "recall": 0.5, "f1": 0.5, "accuracy": 0.75}
    empty = ner.entity_scores([], [])  # seqeval divides by zero here
    assert ner.overall(empty) == {"precision": 0.0, "recall": 0.0, "f1": 0.0, "accuracy": 0.0}
    assert empty["types"] == {}
    with pytest.raises(NerError, match="1 true sentences but 2 predicted"):
        ner.entity_scores([["O"]], [["O"], ["O"]])
    with pytest.raises(NerError, match="sentence 0: 2 true tags but 1 predicted"):
        ner.entity_scores([["O", "O"]], [["O"]])
    with pytest.raises(NerError, match="tag 'PER' is not O"):
        ner.entity_scores([["O"]], [["PER"]])


def test_the_module_needs_neither_seqeval_nor_torch():
    code = ("import sys, bertforge.tasks.finetune.ner; "
            "print(sorted(m for m in ('seqeval', 'torch', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]"
