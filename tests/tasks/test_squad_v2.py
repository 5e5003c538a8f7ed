"""SQuAD v2.0 (unanswerable questions) against google-research/bert's run_squad.py with
``version_2_with_negative``, and the official v2.0 evaluation.

The data is the real SQuAD v1.1 dev and training files rewritten to v2.0's format:
every third question becomes unanswerable (``is_impossible: true``, ``answers: []``,
its old answers kept as ``plausible_answers``, which nothing reads), the rest get
``is_impossible: false``.
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import re
import string
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import shared_data
from test_squad_cli import VOCAB as TINY_VOCAB
from test_squad_features import (
    DEV,
    TRAIN,
    VOCAB,
    assert_same_examples,
    assert_same_features,
    reference_features,
    run_squad,
)
from test_squad_postprocess import RawResult, random_logits

from bertforge.cli import main
from bertforge.config import ConfigError, ModelConfig
from bertforge.data.tokenizer import load_tokenizer
from bertforge.formats.hf import export_hf
from bertforge.models.bert import BertForQuestionAnswering
from bertforge.observe.log import rounded
from bertforge.tasks.squad import (
    SquadError,
    convert_examples_to_features,
    evaluate_v2,
    example_from_text,
    format_scores,
    parse_examples,
    postprocess,
    read_examples,
    write_predictions,
)
from bertforge.tasks.squad.train import load_squad_config


def to_v2(dataset: dict, articles: int | None = None, every: int = 3) -> dict:
    """``dataset`` (its first ``articles``) in SQuAD v2.0's format; every ``every``-th
    question (counting from the first, over the whole file) unanswerable."""
    count = 0
    data = []
    for article in dataset["data"][:articles]:
        paragraphs = []
        for paragraph in article["paragraphs"]:
            qas = []
            for qa in paragraph["qas"]:
                impossible = count % every == 0
                count += 1
                qas.append({**qa, "is_impossible": impossible, **(
                    {"answers": [], "plausible_answers": qa["answers"]} if impossible else {})})
            paragraphs.append({**paragraph, "qas": qas})
        data.append({**article, "paragraphs": paragraphs})
    return {"version": "v2.0", "data": data}


@contextlib.contextmanager
def v2_flags(module, threshold: float = 0.0) -> Iterator[None]:
    """The reference's FLAGS.version_2_with_negative (and threshold) for the block."""
    flags = module.FLAGS
    saved = (flags.version_2_with_negative, flags.null_score_diff_threshold)
    flags.version_2_with_negative, flags.null_score_diff_threshold = True, threshold
    try:
        yield
    finally:
        flags.version_2_with_negative, flags.null_score_diff_threshold = saved


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(shared_data(VOCAB))


@pytest.fixture(scope="module")
def v2_files(tmp_path_factory) -> tuple[Path, Path]:
    """(dev, train): the first 4 dev articles (1680 questions, 2/3 answerable) and the
    first 6 training articles (2180 questions) in v2.0's format."""
    directory = tmp_path_factory.mktemp("v2")
    dev, train = directory / "dev-v2.json", directory / "train-v2.json"
    dev.write_text(json.dumps(to_v2(json.loads(shared_data(DEV).read_text()), articles=4)))
    train.write_text(json.dumps(to_v2(json.loads(shared_data(TRAIN).read_text()), articles=6)))
    return dev, train


# ------------------------------------------------------------------ examples and features


@pytest.mark.parametrize("seq_len, stride, query_len", [(384, 128, 64), (128, 32, 16)])
def test_training_examples_and_features_equal_reference(v2_files, tokenizer, seq_len, stride, query_len):
    """Every field of every training feature, impossible questions pointing at [CLS]."""
    module = run_squad()
    train = v2_files[1]
    with v2_flags(module):
        theirs = module.read_squad_examples(str(train), True)
    ours, skipped = read_examples(train, is_training=True, version_2_with_negative=True)
    assert skipped == [] and len(ours) == len(theirs) == 2180
    assert_same_examples(ours, theirs)
    assert [e.is_impossible for e in ours] == [e.is_impossible for e in theirs]
    impossible = sum(e.is_impossible for e in ours)
    assert impossible == 727 and all((e.answer_text, e.start_word, e.end_word) == ("", -1, -1)
                                     for e in ours if e.is_impossible)

    features = convert_examples_to_features(ours, tokenizer, seq_len, stride, query_len, is_training=True)
    with v2_flags(module):
        expected = reference_features(theirs, shared_data(VOCAB), seq_len, stride, query_len, is_training=True)
    assert_same_features(features, expected, is_training=True)
    of_impossible = np.array([ours[i].is_impossible for i in features.example_index])
    assert (features.start_positions[of_impossible] == 0).all() and (features.end_positions[of_impossible] == 0).all()
    # Possible questions' windows without the answer point at [CLS] too (as in v1.1); the others do not.
    outside = int((features.start_positions[~of_impossible] == 0).sum())
    assert 0 < outside < (~of_impossible).sum()


def test_dev_examples_and_features_equal_reference(v2_files, tokenizer):
    """Not training, the v2.0 flag changes nothing: the same examples and features."""
    module = run_squad()
    dev = v2_files[0]
    with v2_flags(module):
        theirs = module.read_squad_examples(str(dev), False)
        expected = reference_features(theirs, shared_data(VOCAB), 128, 32, 64)
    ours, _ = read_examples(dev, version_2_with_negative=True)
    assert len(ours) == 1680
    assert_same_examples(ours, theirs)
    assert_same_features(convert_examples_to_features(ours, tokenizer, 128, 32), expected, is_training=False)


def test_v1_training_on_a_v2_file_is_refused_as_the_reference_does(v2_files):
    """run_squad without the flag raises on the first unanswerable question (no answer);
    ours names it and says what to do."""
    module = run_squad()
    with pytest.raises(ValueError, match="exactly 1 answer"):
        module.read_squad_examples(str(v2_files[1]), True)
    with pytest.raises(SquadError, match=r"qas\[0\] \(question [0-9a-f]+\): a training question needs exactly 1 "
                                         r"answer, has 0 \(it is marked is_impossible: SQuAD v2.0 training needs "
                                         r"--version 2\)$"):
        read_examples(v2_files[1], is_training=True)


# ------------------------------------------------------------------ post-processing


def v2_logits(shape: tuple[int, int], input_mask: np.ndarray, kind: str, seed: int
              ) -> tuple[np.ndarray, np.ndarray]:
    """random_logits with padding far below (as a trained model scores it, so that every
    question has a valid span: run_squad fails on one without) and [CLS] raised by 0 to 3
    per window, so that the null answer wins about as often as a span."""
    start, end = random_logits(shape, kind, seed)
    start[input_mask == 0] = end[input_mask == 0] = -10000.0
    boost = np.random.default_rng(seed + 1).choice([0.0, 1.0, 2.0, 3.0], size=shape[0]).astype(np.float32)
    start[:, 0] += boost
    end[:, 0] += boost
    return start, end


@pytest.mark.parametrize("seq_len, stride, kind, threshold", [
    (384, 128, "plain", 0.0), (384, 128, "ties", 0.0), (128, 32, "ties", 1.5), (128, 32, "peaked", -2.0)])
@pytest.mark.slow
def test_predictions_nbest_and_null_odds_equal_reference(tmp_path, v2_files, tokenizer, seq_len, stride, kind,
                                                         threshold):
    """Every 3rd question of the 4 dev articles (560), random logits: predictions, n-best
    lists with their probabilities, and null odds equal to write_predictions' files.

    "ties" rounds logits to halves, so null scores often equal span scores (the null
    entry then ranks after them) and score differences equal the threshold 0.0 (not
    above it: an answer).
    """
    module = run_squad()
    dev = v2_files[0]
    with v2_flags(module):
        theirs = module.read_squad_examples(str(dev), False)[::3]
        expected_features = reference_features(theirs, shared_data(VOCAB), seq_len, stride)
    ours = read_examples(dev, version_2_with_negative=True)[0][::3]
    features = convert_examples_to_features(ours, tokenizer, seq_len, stride)
    start, end = v2_logits(features.input_ids.shape, features.input_mask, kind, seed=seq_len)
    results = [RawResult(f.unique_id, [float(x) for x in start[i]], [float(x) for x in end[i]])
               for i, f in enumerate(expected_features)]
    files = [tmp_path / name for name in ("predictions.json", "nbest.json", "null_odds.json")]
    with v2_flags(module, threshold):
        module.write_predictions(theirs, expected_features, results, 20, 30, True, *map(str, files))
    want, want_nbest, want_odds = (json.loads(f.read_text(encoding="utf-8")) for f in files)

    result = postprocess(ours, features, start, end, version_2_with_negative=True,
                         null_score_diff_threshold=threshold)
    predictions, nbest = result  # unpacks as in v1.1
    assert predictions == want and list(predictions) == list(want)
    assert result.null_odds == want_odds and list(result.null_odds) == list(want_odds)
    assert list(nbest) == list(want_nbest)
    for qas_id, entries in nbest.items():
        assert [(e["text"], e["start_logit"], e["end_logit"]) for e in entries] == \
            [(e["text"], e["start_logit"], e["end_logit"]) for e in want_nbest[qas_id]], qas_id
        assert np.allclose([e["probability"] for e in entries],
                           [e["probability"] for e in want_nbest[qas_id]], rtol=0, atol=1e-12)
    # What this covered: both kinds of prediction, the null inside and appended after a full n-best.
    no_answer = sum(text == "" for text in predictions.values())
    assert 0 < no_answer < len(predictions)
    assert any(len(entries) == 21 for entries in nbest.values())  # 20 spans, then the null appended
    assert any(any(e["text"] == "" for e in entries[:20]) for entries in nbest.values())
    assert not any(entries[0]["text"] == "empty" for entries in nbest.values())  # where the reference fails
    if kind == "ties" and threshold == 0.0:
        assert any(odds == 0.0 and predictions[q] != "" for q, odds in result.null_odds.items())

    # write_predictions writes the same bytes as the reference, null_odds.json included
    ours_files = [tmp_path / f"ours-{f.name}" for f in files]
    write_predictions(predictions, ours_files[0], nbest, ours_files[1], result.null_odds, ours_files[2])
    assert ours_files[0].read_bytes() == files[0].read_bytes()
    assert ours_files[2].read_bytes() == files[2].read_bytes()


def test_no_valid_span_gets_transformers_placeholder(tokenizer):
    """Where run_squad fails (no non-null entry), transformers' port puts "empty" (logits 0)
    first: the null odds are the null score, and the prediction is "" above the threshold."""
    example = example_from_text("Who?", "Steve Smith.")
    features = convert_examples_to_features([example], tokenizer)
    start, end = np.zeros((2, 1, 384))
    start[0, 0], end[0, 0] = 0.25, 0.5  # the null score 0.75; no span is valid: end before start
    start[0, 5], end[0, 4] = 9.0, 9.0
    result = postprocess([example], features, start, end, n_best_size=1, version_2_with_negative=True)
    entries = result.nbest["q0"]
    assert [(e["text"], e["start_logit"], e["end_logit"]) for e in entries] == [("empty", 0.0, 0.0),
                                                                               ("", 0.25, 0.5)]
    assert result.null_odds == {"q0": 0.75} and result.predictions == {"q0": ""}
    high = postprocess([example], features, start, end, n_best_size=1, version_2_with_negative=True,
                       null_score_diff_threshold=1.0)
    assert high.predictions == {"q0": "empty"}
    # v1.1 is unchanged: the placeholder alone, and no null odds
    v1 = postprocess([example], features, start, end, n_best_size=1)
    assert v1.predictions == {"q0": "empty"} and v1.null_odds is None


# ------------------------------------------------------------------ the official v2.0 evaluation


def official_v2(data: list, preds: dict, na_probs: dict | None = None, thresh: float = 1.0) -> dict:
    """A second implementation of evaluate-v2.0.py's ``main``, written here from its definition:
    gold = answers that normalize to something, else [""]; the v2 F1 of empty answers; odds
    above the threshold make a prediction empty; HasAns/NoAns groups; and the threshold search
    over the odds in (stable) rising order, only with an odds file."""
    def norm(s: str) -> str:
        s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
        return " ".join(re.sub(r"\b(a|an|the)\b", " ", s).split())

    def f1(gold: str, pred: str) -> float:
        g, p = norm(gold).split(), norm(pred).split()
        if not g or not p:
            return float(g == p)
        same = sum((collections.Counter(g) & collections.Counter(p)).values())
        return 0.0 if same == 0 else 2 * (same / len(p)) * (same / len(g)) / (same / len(p) + same / len(g))

    has, em_raw, f1_raw = {}, {}, {}
    for article in data:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                has[qa["id"]] = len(qa["answers"]) > 0
                golds = [a["text"] for a in qa["answers"] if norm(a["text"])] or [""]
                em_raw[qa["id"]] = max(float(norm(g) == norm(preds[qa["id"]])) for g in golds)
                f1_raw[qa["id"]] = max(f1(g, preds[qa["id"]]) for g in golds)
    odds = na_probs if na_probs is not None else dict.fromkeys(preds, 0.0)
    em = {k: (float(not has[k]) if odds[k] > thresh else v) for k, v in em_raw.items()}
    f1s = {k: (float(not has[k]) if odds[k] > thresh else v) for k, v in f1_raw.items()}

    def group(ids: list) -> tuple:
        return 100.0 * sum(em[k] for k in ids) / len(ids), 100.0 * sum(f1s[k] for k in ids) / len(ids), len(ids)

    out = dict(zip(("exact", "f1", "total"), group(list(em)), strict=True))
    for name, ids in (("HasAns", [k for k in has if has[k]]), ("NoAns", [k for k in has if not has[k]])):
        if ids:
            out.update(zip((f"{name}_exact", f"{name}_f1", f"{name}_total"), group(ids), strict=True))
    if na_probs is not None:
        for name, raw in (("exact", em_raw), ("f1", f1_raw)):
            running = best = float(sum(not v for v in has.values()))
            best_at = 0.0
            for k in sorted(odds, key=odds.__getitem__):
                if k in raw:
                    running += raw[k] if has[k] else (-1.0 if preds[k] else 0.0)
                    if running > best:
                        best, best_at = running, odds[k]
            out[f"best_{name}"], out[f"best_{name}_thresh"] = 100.0 * best / len(raw), best_at
    return out


def test_hand_checked_v2_scores():
    data = [{"paragraphs": [{"context": "c", "qas": [
        {"id": "a", "question": "?", "answers": [{"text": "the cat", "answer_start": 0}]},
        {"id": "b", "question": "?", "answers": [{"text": "red blue", "answer_start": 0}]},
        {"id": "c", "question": "?", "answers": []},
        {"id": "d", "question": "?", "answers": []},
        {"id": "e", "question": "?", "answers": [{"text": "The", "answer_start": 0}]},  # normalizes to ""
    ]}]}]
    predictions = {"a": "Cat!", "b": "red", "c": "", "d": "dog", "e": ""}
    # a: EM 1 F1 1; b: EM 0, F1 2/3; c: both empty: 1, 1; d: 0, 0; e: gold [""], "": 1, 1 (but has an answer)
    scores = evaluate_v2(data, predictions)
    assert scores == pytest.approx({"exact": 60.0, "f1": 100 * (1 + 2 / 3 + 1 + 0 + 1) / 5, "total": 5,
                                    "HasAns_exact": 200 / 3, "HasAns_f1": 100 * (1 + 2 / 3 + 1) / 3,
                                    "HasAns_total": 3, "NoAns_exact": 50.0, "NoAns_f1": 50.0, "NoAns_total": 2},
                                   rel=1e-15)
    assert list(scores) == ["exact", "f1", "total", "HasAns_exact", "HasAns_f1", "HasAns_total", "NoAns_exact",
                            "NoAns_f1", "NoAns_total"]  # no best_* without null odds, as the official script
    # Odds above the threshold (1.0) turn a prediction into no answer: d right, a wrong.
    odds = {"a": 2.0, "b": -1.0, "c": 0.5, "d": 3.0, "e": 0.0}
    scores = evaluate_v2(data, predictions, odds)
    assert (scores["exact"], scores["NoAns_exact"], scores["HasAns_exact"]) == (60.0, 100.0, pytest.approx(100 / 3))
    # The search, by rising odds b, e, c, a, d from 2 (c, d unanswerable): b +2/3 (F1), e +1, c 0,
    # a +1 (best: 4 2/3 at 2.0), d −1.
    assert scores["best_f1"] == pytest.approx(100 * (2 + 2 / 3 + 1 + 1) / 5) and scores["best_f1_thresh"] == 2.0
    assert scores["best_exact"] == 80.0 and scores["best_exact_thresh"] == 2.0
    assert format_scores(scores).startswith("exact 60.00 f1 ") and "best_f1 93.33 (null threshold 2.000)" in \
        format_scores(scores)
    assert format_scores({"exact_match": 1.0, "f1": 2.0}) == "exact_match 1.00 f1 2.00"


def test_v2_scores_equal_the_official_definition(v2_files, tokenizer):
    """The 1680 v2 dev questions, predictions from random logits at several null thresholds
    (ties of null odds included): every key equal to the second implementation, and to
    transformers' port of evaluate-v2.0.py where it is installed (transformers < 5)."""
    dev = json.loads(v2_files[0].read_text())
    examples, _ = parse_examples(dev, version_2_with_negative=True)
    features = convert_examples_to_features(examples, tokenizer, 128, 32)
    start, end = v2_logits(features.input_ids.shape, features.input_mask, "ties", seed=7)
    result = postprocess(examples, features, start, end, version_2_with_negative=True)
    odds = result.null_odds
    assert odds is not None and len(set(odds.values())) < len(odds) / 2  # many ties
    # Right answers too: every 4th answerable question predicted as its first gold answer.
    gold = {qa["id"]: qa["answers"] for a in dev["data"] for p in a["paragraphs"] for qa in p["qas"]}
    predictions = {k: (gold[k][0]["text"] if gold[k] and i % 4 == 0 else v)
                   for i, (k, v) in enumerate(result.predictions.items())}
    port = None
    with contextlib.suppress(ImportError):
        from transformers.data.metrics import squad_metrics as port  # removed in transformers 5
    checked = 0
    for na_probs, thresh in ((None, 1.0), (odds, 1.0), (odds, 0.0), (odds, -3.0), (odds, 100.0)):
        ours = evaluate_v2(dev, predictions, na_probs, thresh)
        want = official_v2(dev["data"], predictions, na_probs, thresh)
        assert list(ours) == list(want)
        for key, value in want.items():
            assert ours[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key
        if port is not None:
            has = {k: bool(v) for k, v in gold.items()}
            exact, f1 = port.get_raw_scores(
                [collections.namedtuple("E", "qas_id answers")(k, v) for k, v in gold.items()], predictions)
            probs = na_probs if na_probs is not None else dict.fromkeys(predictions, 0.0)
            e_t, f_t = (port.apply_no_ans_threshold(s, probs, has, thresh) for s in (exact, f1))
            expected = port.make_eval_dict(e_t, f_t)
            for name, ids in (("HasAns", [k for k in has if has[k]]), ("NoAns", [k for k in has if not has[k]])):
                port.merge_eval(expected, port.make_eval_dict(e_t, f_t, qid_list=ids), name)
            if na_probs is not None:
                port.find_all_best_thresh(expected, predictions, exact, f1, probs, has)
            assert ours == dict(expected)
        checked += 1
    assert checked == 5
    assert 20 < ours["best_f1"] and math.isfinite(ours["best_f1_thresh"])


def test_bad_v2_evaluation_input_names_the_problem():
    data = [{"paragraphs": [{"context": "c", "qas": [{"id": "q1", "question": "?", "answers": []},
                                                    {"id": "q2", "question": "?", "answers": []}]}]}]
    with pytest.raises(SquadError, match=r"qas\[1\] \(question q2\): no prediction in p.json "):
        evaluate_v2(data, {"q1": ""}, predictions_source="p.json")
    with pytest.raises(SquadError, match=r"^odds.json: no value for question q2$"):
        evaluate_v2(data, {"q1": "", "q2": ""}, {"q1": 0.5}, na_probs_source="odds.json")
    with pytest.raises(SquadError, match=r"^odds.json: question q1: expected a finite number, got a string$"):
        evaluate_v2(data, {"q1": "", "q2": ""}, {"q1": "x", "q2": 0.0}, na_probs_source="odds.json")


# ------------------------------------------------------------------ reading: bad input


def squad_v2(qa: dict) -> dict:
    return {"data": [{"title": "t", "paragraphs": [{"context": "Paris is in France .", "qas": [qa]}]}]}


@pytest.mark.parametrize("qa, is_training, message", [
    ({"id": "q1", "question": "?", "answers": [], "is_impossible": "true"}, True,
     r"/x\.json: data\[0\]\.paragraphs\[0\]\.qas\[0\]\.is_impossible \(question q1\): expected a boolean, "
     r"got a string$"),
    ({"id": "q1", "question": "?", "answers": [], "is_impossible": 1}, False,
     r"qas\[0\]\.is_impossible \(question q1\): expected a boolean, got an integer$"),
    ({"id": "q1", "question": "?", "answers": [{"text": "France", "answer_start": 12}]}, True,
     r"qas\[0\] \(question q1\): missing field 'is_impossible'$"),
    ({"id": "q1", "question": "?", "is_impossible": True}, True,
     r"qas\[0\] \(question q1\): missing field 'answers'$"),
    ({"id": "q1", "question": "?", "answers": [], "is_impossible": False}, True,
     r"\(question q1\): a training question needs exactly 1 answer, has 0$"),
    # Training would ignore the answer (as run_squad.py does) and scoring would count it: refused in both.
    ({"id": "q1", "question": "?", "answers": [{"text": "France", "answer_start": 12}], "is_impossible": True}, True,
     r"/x\.json: data\[0\]\.paragraphs\[0\]\.qas\[0\] \(question q1\): is_impossible is true but it has 1 "
     r"answer; an unanswerable question has none \(SQuAD v2.0 keeps guesses in plausible_answers\)$"),
    ({"id": "q1", "question": "?", "answers": [{"text": "Paris"}, {"text": "France"}], "is_impossible": True}, False,
     r"qas\[0\] \(question q1\): is_impossible is true but it has 2 answers; "),
])
def test_malformed_v2_questions_are_named(tmp_path, qa, is_training, message):
    path = tmp_path / "x.json"
    path.write_text(json.dumps(squad_v2(qa)), encoding="utf-8")
    with pytest.raises(SquadError, match=message):
        read_examples(path, is_training=is_training, version_2_with_negative=True)


def test_v1_reading_ignores_is_impossible():
    """As the reference: without the flag the field is not read (an answer is trained on)."""
    qa = {"id": "q1", "question": "?", "answers": [{"text": "France", "answer_start": 12}], "is_impossible": "x"}
    (example,), _ = parse_examples(squad_v2(qa), is_training=True)
    assert (example.answer_text, example.start_word, example.is_impossible) == ("France", 3, False)


# ------------------------------------------------------------------ config and commands


TRAIN_QAS = [("q1", "What is the capital of France?", "Paris", 0, False),
             ("q2", "Paris is the capital of what?", "France", 24, False),
             ("q3", "What is the capital of Paris?", "", 0, True),
             ("q4", "Is Paris the capital?", "", 0, True)]


def tiny_v2(tmp_path: Path) -> tuple[Path, Path]:
    """A tiny random QA model (the vocab of test_squad_cli) and a v2.0 train/dev file."""
    cfg = ModelConfig(vocab_size=len(TINY_VOCAB), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                      intermediate_size=32, max_position_embeddings=64)
    torch.manual_seed(0)  # the same model every run: the scores below are exact
    model = export_hf(BertForQuestionAnswering(cfg), tmp_path / "tiny", without_tokenizer=True)
    (model / "vocab.txt").write_text("\n".join(TINY_VOCAB) + "\n")
    qas = [{"id": i, "question": q, "is_impossible": imp,
            "answers": [] if imp else [{"text": a, "answer_start": s}]} for i, q, a, s, imp in TRAIN_QAS]
    data = tmp_path / "v2.json"
    data.write_text(json.dumps({"version": "v2.0", "data": [{"title": "t", "paragraphs": [
        {"context": "Paris is the capital of France .", "qas": qas}]}]}))
    return model, data


def test_train_version_2_end_to_end(tmp_path, capsys):
    model, data = tiny_v2(tmp_path)
    run = tmp_path / "run"
    argv = ["squad", "train", "--init", str(model), "--train-file", str(data), "--predict-file", str(data),
            "--out", str(run), "--data.seq_len", "32", "--squad.max_query_length", "8",
            "--train.global_batch_size", "2", "--train.micro_batch_size", "2", "--train.epochs", "1",
            "--no-progress", "--log.tensorboard", "false"]
    assert main([*argv, "--version", "2"]) == 0
    scores = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(scores) == ["exact", "f1", "total", "HasAns_exact", "HasAns_f1", "HasAns_total", "NoAns_exact",
                            "NoAns_f1", "NoAns_total", "best_exact", "best_exact_thresh", "best_f1",
                            "best_f1_thresh"]
    assert (scores["total"], scores["HasAns_total"], scores["NoAns_total"]) == (4, 2, 2)
    predictions = json.loads((run / "predictions.json").read_text())
    odds = json.loads((run / "null_odds.json").read_text())
    assert list(predictions) == list(odds) == ["q1", "q2", "q3", "q4"]
    assert all((predictions[k] == "") == (odds[k] > 0.0) for k in odds)  # the threshold 0.0
    assert scores == evaluate_v2(json.loads(data.read_text()), predictions, odds)
    saved = yaml.safe_load((run / "squad.yaml").read_text())
    assert (saved["version_2_with_negative"], saved["null_score_diff_threshold"]) == (True, 0.0)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r for r in rows if r.get("split") == "eval"][-1]["best_f1"] == rounded(scores["best_f1"])  # logged

    # predict with the saved v2 setting (null_odds.json beside --out), and a threshold of our own
    out = tmp_path / "pred"
    out.mkdir()
    assert main(["squad", "predict", "--model", str(run), "--predict-file", str(data), "--out",
                 str(out / "p.json"), "--null-threshold", "1e9"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["null_odds.json", "p.json"]
    assert json.loads((out / "null_odds.json").read_text()) == odds
    assert "" not in json.loads((out / "p.json").read_text()).values()  # nothing beats a threshold of 1e9
    capsys.readouterr()
    assert main(["squad", "evaluate", "--version", "2", str(data), str(run / "predictions.json"),
                 "--na-prob-file", str(run / "null_odds.json")]) == 0
    assert json.loads(capsys.readouterr().out) == scores
    assert main(["squad", "evaluate", str(data), str(run / "predictions.json"), "--null-threshold", "1"]) == 2
    assert "need SQuAD v2.0 (--version 2)" in capsys.readouterr().err


def test_a_v1_run_resumed_as_v2_is_refused(tmp_path, capsys):
    model, data = tiny_v2(tmp_path)
    v1 = tmp_path / "v1.json"  # the answerable questions only: a v1.1 training file
    dataset = json.loads(data.read_text())
    dataset["data"][0]["paragraphs"][0]["qas"] = dataset["data"][0]["paragraphs"][0]["qas"][:2]
    v1.write_text(json.dumps(dataset))
    run = tmp_path / "run"
    assert main(["squad", "train", "--init", str(model), "--train-file", str(v1), "--out", str(run),
                 "--data.seq_len", "32", "--squad.max_query_length", "8", "--train.global_batch_size", "1",
                 "--train.micro_batch_size", "1", "--train.epochs", "0", "--train.steps", "2",
                 "--checkpoint.every", "1", "--no-progress", "--log.tensorboard", "false"]) == 0
    capsys.readouterr()
    assert main(["squad", "train", "--resume", str(run), "--version", "2"]) == 2
    error = capsys.readouterr().err.splitlines()[-1]  # after the log lines of the resume check
    assert error.startswith(f"error: resuming {run}") and error.endswith(
        "squad.version_2_with_negative: False → True; pass --resume-with-changes to go on with them")


def test_config_keys_are_validated():
    cfg, squad = load_squad_config(None, [("squad.version_2_with_negative", "true"),
                                          ("squad.null_score_diff_threshold", "-1.5")])
    assert (squad.version_2_with_negative, squad.null_score_diff_threshold) == (True, -1.5)
    with pytest.raises(ConfigError, match="squad.null_score_diff_threshold=nan must be a finite number"):
        load_squad_config(None, [("squad.null_score_diff_threshold", "nan")])
    with pytest.raises(ConfigError, match="squad.version_2_with_negative"):
        load_squad_config(None, [("squad.version_2_with_negative", "maybe")])
