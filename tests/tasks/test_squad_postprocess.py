"""SQuAD post-processing against google-research/bert's write_predictions, given the same logits."""

from __future__ import annotations

import collections
import json

import numpy as np
import pytest
from bert_reference import reference
from conftest import shared_data
from test_squad_features import DEV, VOCAB, reference_examples, reference_features, run_squad

from bertforge.data.tokenizer import load_tokenizer
from bertforge.tasks.squad import (
    SquadError,
    convert_examples_to_features,
    example_from_text,
    get_final_text,
    postprocess,
    read_examples,
    write_predictions,
)

RawResult = collections.namedtuple("RawResult", ["unique_id", "start_logits", "end_logits"])


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(shared_data(VOCAB))


@pytest.fixture(scope="module")
def dev_sample() -> tuple[list, list]:
    """Every 35th dev question: the reference's examples and ours."""
    dev = shared_data(DEV)
    return reference_examples(dev, is_training=False)[::35], read_examples(dev)[0][::35]


def random_logits(shape: tuple[int, int], kind: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """float32 logits like a model's. "ties" rounds them to halves so that equal logits and
    equal start+end sums are common; "peaked" raises a start and an end region per window
    so that many overlapping spans compete and map to the same text."""
    rng = np.random.default_rng(seed)
    start = rng.standard_normal(shape).astype(np.float32)
    end = rng.standard_normal(shape).astype(np.float32)
    if kind == "ties":
        start, end = np.round(start * 2) / 2, np.round(end * 2) / 2
    elif kind == "peaked":
        for row, at in enumerate(rng.integers(0, shape[1] - 10, size=shape[0])):
            start[row, at:at + 5] += 4
            end[row, at + 2:at + 9] += 4
    return start, end


@pytest.mark.parametrize("seq_len, stride, kind, full, placeholders", [
    (384, 128, "plain", 44, 8), (384, 128, "ties", 120, 1), (128, 32, "peaked", 290, 0),
    (128, 32, "ties", 298, 0)])
@pytest.mark.slow
def test_predictions_identical_to_reference(tmp_path, tokenizer, dev_sample, seq_len, stride, kind,
                                            full, placeholders):
    """300 dev questions (from every 35th): the same predictions and n-best lists.

    Window 128 with stride 32 splits every context, so the max-context choice
    across windows decides many answers.
    """
    theirs, ours = dev_sample
    assert len(ours) == len(theirs) == 302
    features = convert_examples_to_features(ours, tokenizer, seq_len, stride)
    expected_features = reference_features(theirs, shared_data(VOCAB), seq_len, stride)
    start, end = random_logits(features.input_ids.shape, kind, seed=seq_len)

    # The reference gets the logits as Python floats, as run_squad passes them.
    results = [RawResult(f.unique_id, [float(x) for x in start[i]], [float(x) for x in end[i]])
               for i, f in enumerate(expected_features)]
    files = [str(tmp_path / name) for name in ("predictions.json", "nbest.json", "null.json")]
    run_squad().write_predictions(theirs, expected_features, results, 20, 30, True, *files)
    want = json.loads((tmp_path / "predictions.json").read_text(encoding="utf-8"))
    want_nbest = json.loads((tmp_path / "nbest.json").read_text(encoding="utf-8"))

    predictions, nbest = postprocess(ours, features, start, end)
    assert predictions == want and list(predictions) == list(want)
    assert list(nbest) == list(want_nbest)
    for qas_id, entries in nbest.items():
        assert [e["text"] for e in entries] == [e["text"] for e in want_nbest[qas_id]], qas_id
        assert [(e["start_logit"], e["end_logit"]) for e in entries] == \
            [(e["start_logit"], e["end_logit"]) for e in want_nbest[qas_id]], qas_id
        assert np.allclose([e["probability"] for e in entries],
                           [e["probability"] for e in want_nbest[qas_id]], rtol=0, atol=1e-6)
    # What this covered: full and short n-best lists and, at 384 where few of the
    # random top starts and ends pair up, questions with no valid span ("empty").
    sizes = collections.Counter(len(entries) for entries in nbest.values())
    empty = sum(text == "empty" for text in predictions.values())
    assert (sizes[20], empty) == (full, placeholders)
    if seq_len == 128:
        assert len(features) > 3 * len(ours)


# Reference-only spellings: accents, a final sigma, a ligature, a dropped control
# character, punctuation glued to words, CJK, [UNK] pieces, an empty prediction.
FINAL_TEXT_CASES = [
    ("steve smith", "Steve Smith's"), ("smith", "Steve Smith's"), ("1895", "(1895-1943)."),
    ("cafe", "Café."), ("σας", "ΣΑΣ,"), ("istanbul", "İstanbul's"), ("final", "ﬁnal"),
    ("ab", "a\x07b"), ("東 京", "東京都"), ("[UNK]", "☃ snow"), ("", "anything"),
    ("japanese", "Japanese"), ("not here", "Some words"), ("b c", "a.b.c.d"),
    ("naive", "naïve"), ("x", "x\u00a0y"), ("x y", "x\u00a0y"), ("icon", "icon\ue001."),
    ("icon", "\ue000 icon"), ("[UNK]", "\ue000 icon"), ("a b", "a\tb"), ("x", "x\x7f"),
    ("x_y", "x_y"), ("x", "x_y"), ("y z", "x\x00y\rz"),
]


def test_get_final_text_identical_to_reference():
    """Hand-picked spellings, then spans of every dev context with predictions cut from
    the reference's own tokenization, cased and uncased."""
    run_squad_module = run_squad()
    tokenization = reference("tokenization")
    cases = list(FINAL_TEXT_CASES)
    rng = np.random.default_rng(0)
    examples = read_examples(shared_data(DEV))[0]
    contexts = {id(e.doc_tokens): e.doc_tokens for e in examples}
    for words in contexts.values():
        first = int(rng.integers(0, len(words)))
        orig_text = " ".join(words[first:first + int(rng.integers(1, 6))])
        pieces = tokenization.BasicTokenizer(do_lower_case=True).tokenize(orig_text)
        keep = int(rng.integers(0, len(pieces))) if pieces else 0
        cases.append((" ".join(pieces[keep:keep + int(rng.integers(1, 4))]), orig_text))
    assert len(cases) > 2000
    changed = 0
    for lower in (True, False):
        for pred_text, orig_text in cases:
            want = run_squad_module.get_final_text(pred_text, orig_text, lower)
            assert get_final_text(pred_text, orig_text, lower) == want, (pred_text, orig_text)
            changed += want != orig_text
    assert changed > 1000  # most predictions are a strict part of their words
    assert get_final_text("steve smith", "Steve Smith's") == "Steve Smith"
    assert get_final_text("final", "ﬁnal") == "ﬁnal"  # lengths differ: the whole words


def test_the_best_span_is_mapped_to_the_original_words(tmp_path, tokenizer):
    """A hand-built case: the highest start+end is the span "steve smith" of "Smith's"."""
    example = example_from_text("Who led?", "The leader was Steve Smith's brother.")
    features = convert_examples_to_features([example], tokenizer)
    tokens = features.tokens(0)
    steve, smith = tokens.index("steve"), tokens.index("smith")
    start, end = np.zeros((2, 1, 384), np.float32)
    start[0, steve], end[0, smith] = 5.0, 4.0
    start[0, 1], end[0, 2] = 9.0, 9.0  # in the question: never an answer
    end[0, 0] = 20.0                   # [CLS]: not in the context either
    predictions, nbest = postprocess([example], features, start, end)
    assert predictions == {"q0": "Steve Smith"}
    # Then the spans from "steve" (5 + 0) in end-rank order: "steve" itself, then
    # "steve smith '" (the apostrophe maps back into "Smith's"), and so on.
    best = nbest["q0"]
    assert [e["text"] for e in best[:4]] == ["Steve Smith", "Steve", "Steve Smith'", "Steve Smith's"]
    assert [e["start_logit"] + e["end_logit"] for e in best[:4]] == [9.0, 5.0, 5.0, 5.0]
    assert len(best) == 20
    total = sum(np.exp(e["start_logit"] + e["end_logit"]) for e in best)
    assert best[0]["probability"] == pytest.approx(np.exp(9) / total, rel=1e-12)
    assert sum(e["probability"] for e in best) == pytest.approx(1.0, rel=1e-12)

    write_predictions(predictions, tmp_path / "p.json", nbest, tmp_path / "n.json")
    assert json.loads((tmp_path / "p.json").read_text()) == predictions
    assert json.loads((tmp_path / "n.json").read_text()) == nbest


def test_bad_logits_are_refused(tokenizer):
    example = example_from_text("Who?", "Steve Smith.")
    features = convert_examples_to_features([example], tokenizer)
    good = np.zeros((1, 384))
    with pytest.raises(SquadError, match=r"start_logits has shape \(1, 128\); the features need \(1, 384\)"):
        postprocess([example], features, np.zeros((1, 128)), good)
    bad = good.copy()
    bad[0, 5] = np.nan
    with pytest.raises(SquadError, match="end_logits of feature 0 are not all finite"):
        postprocess([example], features, good, bad)
    with pytest.raises(SquadError, match="refer to example 0; only 0 examples"):
        postprocess([], features, good, good)
