"""SQuAD examples and features against google-research/bert's run_squad.py, and bad input."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest
from bert_reference import reference
from conftest import shared_data

from bertforge.data.tokenizer import load_tokenizer
from bertforge.tasks.squad import (
    SquadError,
    SquadFeatures,
    convert_examples_to_features,
    example_from_text,
    parse_examples,
    read_examples,
)

VOCAB = "vocab/bert-base-uncased-vocab.txt"
DEV = "squad/dev-v1.1.json"
TRAIN = "squad/train-v1.1-first44.json"


def run_squad():
    pytest.importorskip("absl")
    pytest.importorskip("six")
    return reference("run_squad")


def reference_examples(path: Path, is_training: bool) -> list:
    return run_squad().read_squad_examples(str(path), is_training)


def reference_features(examples: list, vocab: Path, max_seq_length: int = 384, doc_stride: int = 128,
                       max_query_length: int = 64, is_training: bool = False) -> list:
    """run_squad.convert_examples_to_features, collecting what its callback receives.

    Its FullTokenizer re-tokenizes each context once per question; remembering
    the tokens of strings already seen (it is a pure function, and the
    reference only reads the lists) makes the whole dev set 3× quicker.
    """
    tokenizer = reference("tokenization").FullTokenizer(str(vocab), do_lower_case=True)
    tokenizer.tokenize = functools.lru_cache(maxsize=None)(tokenizer.tokenize)
    features: list = []
    run_squad().convert_examples_to_features(examples, tokenizer, max_seq_length, doc_stride,
                                             max_query_length, is_training, features.append)
    return features


def assert_same_examples(ours: list, theirs: list) -> None:
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        assert (a.qas_id, a.question, a.doc_tokens, a.answer_text, a.start_word, a.end_word) == (
            b.qas_id, b.question_text, b.doc_tokens, b.orig_answer_text, b.start_position,
            b.end_position), b.qas_id


def assert_same_features(ours: SquadFeatures, theirs: list, is_training: bool) -> None:
    """Every field of every feature equal (unique_id is 1000000000 + the row)."""
    assert len(ours) == len(theirs)
    assert [f.unique_id for f in theirs] == list(range(1000000000, 1000000000 + len(ours)))
    assert ours.example_index.tolist() == [f.example_index for f in theirs]
    assert ours.doc_span_index.tolist() == [f.doc_span_index for f in theirs]
    assert np.array_equal(ours.input_ids, np.array([f.input_ids for f in theirs]))
    assert np.array_equal(ours.input_mask, np.array([f.input_mask for f in theirs]))
    assert np.array_equal(ours.segment_ids, np.array([f.segment_ids for f in theirs]))
    for row, f in enumerate(theirs):
        assert ours.tokens(row) == f.tokens, row
        in_context = np.nonzero(ours.token_to_orig[row] >= 0)[0].tolist()
        assert {j: int(ours.token_to_orig[row, j]) for j in in_context} == f.token_to_orig_map, row
        assert {j: bool(ours.token_is_max_context[row, j]) for j in in_context} == \
            f.token_is_max_context, row
        # Outside the context no token is anyone's max context.
        assert int(ours.token_is_max_context[row].sum()) == sum(f.token_is_max_context.values())
    if is_training:
        assert ours.start_positions.tolist() == [f.start_position for f in theirs]
        assert ours.end_positions.tolist() == [f.end_position for f in theirs]
    else:
        assert ours.start_positions is None and ours.end_positions is None


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(shared_data(VOCAB))


# ------------------------------------------------------------ against the reference


@pytest.mark.slow
def test_dev_examples_and_features_identical_to_reference(tokenizer):
    """All 10570 dev questions: the same examples and every field of every feature."""
    dev = shared_data(DEV)
    theirs = reference_examples(dev, is_training=False)
    ours, skipped = read_examples(dev)
    assert len(ours) == 10570 and skipped == []
    assert_same_examples(ours, theirs)

    features = convert_examples_to_features(ours, tokenizer)
    expected = reference_features(theirs, shared_data(VOCAB))
    assert len(features) == 10833  # 263 more than questions: long contexts take 2+ windows
    assert_same_features(features, expected, is_training=False)
    assert features.truncated_questions == 0
    assert features.input_ids.dtype == np.int32 and features.input_ids.shape == (10833, 384)


@pytest.mark.slow
@pytest.mark.parametrize("seq_len, stride, query_len", [(384, 128, 64), (96, 24, 12)])
def test_train_features_identical_to_reference(tokenizer, seq_len, stride, query_len):
    """Every 8th question of train-v1.1-first44 (all 44 articles), with answer positions.

    The small window truncates questions and splits most contexts, so answers
    fall outside many windows (0, 0) and tokens sit in several windows.
    """
    train = shared_data(TRAIN)
    theirs = reference_examples(train, is_training=True)[::8]
    ours, skipped = read_examples(train, is_training=True)
    ours = ours[::8]
    assert skipped == [] and len(ours) == 1485
    assert_same_examples(ours, theirs)

    features = convert_examples_to_features(ours, tokenizer, seq_len, stride, query_len,
                                            is_training=True)
    expected = reference_features(theirs, shared_data(VOCAB), seq_len, stride, query_len,
                                  is_training=True)
    assert_same_features(features, expected, is_training=True)
    outside = int((features.start_positions == 0).sum())
    if seq_len == 384:
        assert len(features) == 1503 and outside == 14 and features.truncated_questions == 0
    else:
        assert len(features) == 6231 and outside == 3481 and features.truncated_questions == 657


def test_tricky_text_identical_to_reference(tmp_path, tokenizer):
    """Unicode the fast tokenizer would handle differently without Python's cleaning and
    lowercasing (a final capital sigma, private-use characters), words that lose all
    their characters, accents, CJK, no-break spaces."""
    context = ("ΟΔΥΣΣΕΥΣ and ΣΑΣ met İstanbul\u200b  cafe\u0301 \u200b \x07 "
               "東京 in 1895\u00a0–1943 (Steve Smith's) naïve\u202fthing ﬁnal \ue000 icon\ue001.")
    qas = [("q1", "Who met ΣΑΣ?", "ΟΔΥΣΣΕΥΣ"), ("q2", "Where?", "İstanbul"),
           ("q3", "When?", "1895"), ("q4", "Who?", "Steve Smith"), ("q5", "What?", "東京"),
           ("q6", "Which?", "ﬁnal")]
    data = {"version": "1.1", "data": [{"title": "t", "paragraphs": [{"context": context, "qas": [
        {"id": i, "question": q, "answers": [{"text": a, "answer_start": context.index(a)}]}
        for i, q, a in qas]}]}]}
    path = tmp_path / "tricky.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    theirs = reference_examples(path, is_training=True)
    ours, skipped = read_examples(path, is_training=True)
    assert skipped == [] and len(ours) == 6
    assert_same_examples(ours, theirs)
    features = convert_examples_to_features(ours, tokenizer, 48, 8, 6, is_training=True)
    assert_same_features(features, reference_features(theirs, shared_data(VOCAB), 48, 8, 6, True),
                         is_training=True)
    assert "σας" in " ".join(features.tokens(0)).replace(" ##", "")  # final sigma kept
    # "Steve Smith's": the answer is the WordPieces of "steve smith", not the whole words.
    row = int(np.nonzero((features.example_index == 3) & (features.start_positions > 0))[0][0])
    tokens = features.tokens(row)
    assert tokens[features.start_positions[row]:features.end_positions[row] + 1] == ["steve", "smith"]


# ------------------------------------------------------------ layout and options


def test_long_question_is_truncated(tokenizer):
    question = " ".join(["why"] * 100)
    context = "The answer is forty two . " * 10
    features = convert_examples_to_features([example_from_text(question, context)], tokenizer,
                                            max_seq_length=96, doc_stride=16, max_query_length=20)
    assert features.truncated_questions == 1
    why, cls, sep = (tokenizer.token_to_id(t) for t in ("why", "[CLS]", "[SEP]"))
    # 60 context WordPieces, 96 - 20 - 3 = 73 per window: one window.
    assert len(features) == 1
    ids = features.input_ids[0]
    assert ids[0] == cls and (ids[1:21] == why).all() and ids[21] == sep
    assert features.segment_ids[0, :22].sum() == 0 and features.segment_ids[0, 22:83].sum() == 61
    assert ids[82] == sep and features.input_mask[0].sum() == 83 and (ids[83:] == 0).all()
    assert features.token_to_orig[0, 22] == 0 and features.token_to_orig[0, 81] == 59
    assert features.token_is_max_context[0].sum() == 60


@pytest.mark.smoke
def test_windows_overlap_by_the_stride(tokenizer):
    # 200 one-WordPiece words, 64 - 2 - 3 = 59 per window, advancing by 20.
    features = convert_examples_to_features(
        [example_from_text("why ?", "word " * 200)], tokenizer, max_seq_length=64, doc_stride=20,
        max_query_length=2)
    # Windows start at 0, 20, ..., 160: the one at 140 ends at 198, the one at 160 at 199.
    assert len(features) == 9
    assert features.token_to_orig[:, 4].tolist() == [0, 20, 40, 60, 80, 100, 120, 140, 160]
    assert features.input_mask[:, :].sum(axis=1).tolist() == [64] * 8 + [2 + 3 + 40]
    assert features.doc_span_index.tolist() == list(range(9))
    # Word 50 is in windows 1 (left 30, right 28) and 2 (left 10): window 1 scores it.
    assert features.token_is_max_context[1, 4 + 30] and not features.token_is_max_context[2, 4 + 10]
    # Each word is scored in exactly one window.
    assert features.token_is_max_context.sum() == 200


def test_bad_lengths_are_refused(tokenizer):
    example = example_from_text("q", "c")
    with pytest.raises(SquadError, match="max_seq_length=67 leaves no room"):
        convert_examples_to_features([example], tokenizer, max_seq_length=67, max_query_length=64)
    with pytest.raises(SquadError, match="doc_stride=0"):
        convert_examples_to_features([example], tokenizer, doc_stride=0)
    with pytest.raises(SquadError, match="training needs an answer"):
        convert_examples_to_features([example], tokenizer, is_training=True)


# ------------------------------------------------------------ malformed files


def squad(context: object = "Paris is in France .", qa: object = None, **paragraph) -> dict:
    if qa is None:
        qa = {"id": "q1", "question": "Where is Paris?", "answers": [{"text": "France",
                                                                      "answer_start": 12}]}
    return {"data": [{"title": "t", "paragraphs": [{"context": context, "qas": [qa], **paragraph}]}]}


def test_a_good_file_reads(tmp_path):
    path = tmp_path / "ok.json"
    path.write_text(json.dumps(squad()), encoding="utf-8")
    (example,), skipped = read_examples(path, is_training=True)
    assert skipped == []
    assert example.doc_tokens == ["Paris", "is", "in", "France", "."]
    assert (example.answer_text, example.start_word, example.end_word) == ("France", 3, 3)


@pytest.mark.parametrize("dataset, is_training, message", [
    ({"version": "1.1"}, False, r"x.json: missing field 'data'"),
    ({"data": [{"title": "t"}]}, False, r"data\[0\]: missing field 'paragraphs'"),
    (squad(context=None), False, r"/x\.json: data\[0\].paragraphs\[0\].context: expected a string, got null$"),
    (squad(qa={"question": "?"}), False, r"/x\.json: data\[0\].paragraphs\[0\].qas\[0\]: missing field 'id'$"),
    (squad(qa={"id": "q9"}), False, r"qas\[0\] \(question q9\): missing field 'question'$"),
    (squad(qa={"id": 9, "question": "?"}), False, r"qas\[0\].id: expected a string, got an integer$"),
    (squad(qa={"id": "q1", "question": "?", "answers": "France"}), False,
     r"/x\.json: data\[0\].paragraphs\[0\].qas\[0\].answers \(question q1\): expected a list, got a string$"),
    (squad(qa={"id": "q1", "question": "?", "answers": [{"text": 3}]}), False,
     r"qas\[0\].answers\[0\].text \(question q1\): expected a string, got an integer$"),
    ({"data": {"paragraphs": []}}, False, r"/x\.json: data: expected a list, got an object$"),
    ({"data": [[]]}, False, r"/x\.json: data\[0\]: expected an object, got a list$"),
    ([], False, r"/x\.json: expected an object, got a list$"),
    (squad(context=" \n\t"), False, r"paragraphs\[0\]: the context is empty"),
    (squad(qa={"id": "q1", "question": "?"}), True, r"qas\[0\] \(question q1\): missing field 'answers'$"),
    (squad(qa={"id": "q1", "question": "?", "answers": []}), True,
     r"\(question q1\): a training question needs exactly 1 answer, has 0"),
    (squad(qa={"id": "q1", "question": "?", "answers": [{"text": "France"}]}), True,
     r"qas\[0\].answers\[0\] \(question q1\): missing field 'answer_start'$"),
    (squad(qa={"id": "q1", "question": "?", "answers": [{"text": "France", "answer_start": "12"}]}),
     True, r"qas\[0\].answers\[0\].answer_start \(question q1\): expected an integer, got a string$"),
    (squad(qa={"id": "q1", "question": "?", "answers": [{"text": "France", "answer_start": 16}]}),
     True, r"\(question q1\): answer_start 16 \+ 6 characters of answer is outside the context \(20"),
    (squad(qa={"id": "q1", "question": "?", "answers": [{"text": " ", "answer_start": 5}]}),
     True, r"\(question q1\): the answer text is empty$"),
])
def test_malformed_files_name_the_problem(tmp_path, dataset, is_training, message):
    path = tmp_path / "x.json"
    path.write_text(json.dumps(dataset), encoding="utf-8")
    with pytest.raises(SquadError, match=message):
        read_examples(path, is_training=is_training)


def test_unreadable_files_and_duplicate_ids(tmp_path):
    with pytest.raises(SquadError, match="file not found: .*nope.json"):
        read_examples(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"data": [', encoding="utf-8")
    with pytest.raises(SquadError, match=r"bad.json: not valid JSON: .*line 1 column 11"):
        read_examples(bad)
    twice = squad()
    twice["data"].append(twice["data"][0])
    with pytest.raises(SquadError, match=r"data\[1\].paragraphs\[0\].qas\[0\] \(question q1\): "
                                         r"the question id is used twice$"):
        parse_examples(twice)
    with pytest.raises(SquadError, match="the context is empty"):
        example_from_text("why?", "   ")


def test_answers_not_at_their_offset_are_skipped_and_counted():
    """As the reference does: the answer must be found in the words at answer_start."""
    qas = [{"id": "ok", "question": "?", "answers": [{"text": "France", "answer_start": 12}]},
           # at "Paris": those words hold no "France"
           {"id": "moved", "question": "?", "answers": [{"text": "France", "answer_start": 0}]},
           # inside the right word: "France" is still found there, so kept
           {"id": "inside", "question": "?", "answers": [{"text": "France", "answer_start": 13}]}]
    dataset = {"data": [{"paragraphs": [{"context": "Paris is in France .", "qas": qas}]}]}
    examples, skipped = parse_examples(dataset, is_training=True)
    assert [e.qas_id for e in examples] == ["ok", "inside"]
    assert [(s.qas_id, s.reason) for s in skipped] == [
        ("moved", "answer 'France' not found at answer_start 0 (words there: 'Paris')")]
    # Without training the answers are not read, so nothing is skipped.
    examples, skipped = parse_examples(dataset, is_training=False)
    assert len(examples) == 3 and skipped == []
