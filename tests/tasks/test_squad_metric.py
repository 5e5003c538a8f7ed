"""The official SQuAD v1.1 metric: a hand-checked set, and the real dev set against a
second implementation written here from the official definition."""

from __future__ import annotations

import json
import logging
import re
import string

import numpy as np
import pytest
from conftest import shared_data

from bertforge.tasks.squad import SquadError, evaluate, exact_match_score, f1_score, normalize_answer


def dataset(questions: list[tuple[str, list[str]]]) -> dict:
    qas = [{"id": qas_id, "question": "?", "answers": [{"text": t, "answer_start": 0} for t in truths]}
           for qas_id, truths in questions]
    return {"version": "1.1", "data": [{"title": "t", "paragraphs": [{"context": "c", "qas": qas}]}]}


HAND = dataset([
    ("q1", ["the Eiffel Tower", "Eiffel Tower"]),
    ("q2", ["Barack Obama"]),
    ("q3", ["1895", "in 1895"]),
    ("q4", ["a cat"]),
    ("q5", ["blue"]),
    ("q6", ["never answered"]),
    ("q7", ["the the the"]),
    ("q8", ["red red blue"]),
])
HAND_PREDICTIONS = {
    "q1": "eiffel tower!",           # "eiffel tower" = "eiffel tower": EM 1, F1 1
    "q2": "President Barack Obama",  # 2 of 3 shared: P 2/3, R 1, F1 0.8; EM 0
    "q3": "1895 and 1943",           # vs "1895": P 1/3, R 1, F1 0.5; vs "in 1895": 0.4; EM 0
    "q4": "An Cat.",                 # "cat" = "cat" (an/a are articles): EM 1, F1 1
    "q5": "",                        # nothing shared: EM 0, F1 0
    # q6 unanswered: EM 0, F1 0
    "q7": "a",                       # both normalize to "": EM 1, but no shared token: F1 0
    "q8": "red blue blue",           # red 1 + blue 1 shared: P 2/3, R 2/3, F1 2/3; EM 0
}
# EM = 100 × 3/8 = 37.5; F1 = 100 × (1 + 0.8 + 0.5 + 1 + 0 + 0 + 0 + 2/3)/8 = 100 × (119/30)/8.


@pytest.mark.smoke
def test_hand_checked_scores(caplog):
    with caplog.at_level(logging.WARNING, logger="bertforge.tasks.squad.metric"):
        scores = evaluate(HAND, HAND_PREDICTIONS)
    assert scores["exact_match"] == 37.5
    assert scores["f1"] == pytest.approx(11900 / 240, rel=1e-12)  # 49.583...
    assert "1 of 8 questions have no prediction and score 0" in caplog.text
    assert evaluate(HAND["data"], HAND_PREDICTIONS) == scores  # the "data" list alone
    assert normalize_answer("  The  Cat's  (an) HAT!!") == "cats hat"
    assert exact_match_score("The cat.", "cat") and not exact_match_score("cats", "cat")
    assert f1_score("President Barack Obama", "Barack Obama") == pytest.approx(0.8, rel=1e-15)


# ------------------------------------------------ a second implementation, from the definition


def official_normalize(text: str) -> str:
    text = text.lower()
    text = "".join(char for char in text if char not in string.punctuation)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def official_f1(prediction: str, truth: str) -> float:
    predicted, expected = official_normalize(prediction).split(), official_normalize(truth).split()
    unmatched = list(expected)
    shared = 0
    for token in predicted:  # each truth token can match one predicted token
        if token in unmatched:
            unmatched.remove(token)
            shared += 1
    if shared == 0:
        return 0
    precision, recall = 1.0 * shared / len(predicted), 1.0 * shared / len(expected)
    return (2 * precision * recall) / (precision + recall)


def official_evaluate(articles: list, predictions: dict[str, str]) -> dict[str, float]:
    exact = f1 = total = 0
    for article in articles:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                total += 1
                if qa["id"] in predictions:
                    truths = [answer["text"] for answer in qa["answers"]]
                    prediction = predictions[qa["id"]]
                    exact += max(official_normalize(prediction) == official_normalize(t) for t in truths)
                    f1 += max(official_f1(prediction, t) for t in truths)
    return {"exact_match": 100.0 * exact / total, "f1": 100.0 * f1 / total}


def noisy_predictions(articles: list, seed: int) -> dict[str, str]:
    """Per question one of: a ground truth, the same shouted with an article and
    punctuation, a ground truth with a word more or less, a random run of context
    words, the empty string, or no prediction."""
    rng = np.random.default_rng(seed)
    predictions = {}
    for article in articles:
        for paragraph in article["paragraphs"]:
            words = paragraph["context"].split()
            for qa in paragraph["qas"]:
                truth = qa["answers"][int(rng.integers(len(qa["answers"])))]["text"]
                kind = int(rng.integers(7))
                if kind == 0:
                    predictions[qa["id"]] = truth
                elif kind == 1:
                    predictions[qa["id"]] = f"THE {truth.upper()}!?"
                elif kind == 2:
                    predictions[qa["id"]] = f"{truth} {words[int(rng.integers(len(words)))]}"
                elif kind == 3:
                    predictions[qa["id"]] = " ".join(truth.split()[1:])
                elif kind == 4:
                    first = int(rng.integers(len(words)))
                    predictions[qa["id"]] = " ".join(words[first:first + int(rng.integers(1, 6))])
                elif kind == 5:
                    predictions[qa["id"]] = ""
    return predictions


def test_real_dev_set_matches_the_official_definition(tmp_path):
    path = shared_data("squad/dev-v1.1.json")
    data = json.loads(path.read_text(encoding="utf-8"))
    predictions = noisy_predictions(data["data"], seed=0)
    assert 8900 < len(predictions) < 9200  # about 6/7 of the 10570 questions answered
    scores = evaluate(data, predictions)
    assert scores == official_evaluate(data["data"], predictions)
    assert 30 < scores["exact_match"] < scores["f1"] < 70
    # From the file too, with the same result.
    assert evaluate(path, predictions) == scores
    # All questions answered with a ground truth: 100 / 100.
    perfect = {qa["id"]: qa["answers"][0]["text"] for article in data["data"]
               for paragraph in article["paragraphs"] for qa in paragraph["qas"]}
    assert evaluate(data, perfect) == {"exact_match": 100.0, "f1": 100.0}


def test_bad_input_is_named(tmp_path):
    with pytest.raises(SquadError, match="^predictions: question q1: expected a string answer, got an integer$"):
        evaluate(HAND, {"q1": 3})
    broken = dataset([("q1", ["x"])])
    del broken["data"][0]["paragraphs"][0]["qas"][0]["answers"]
    with pytest.raises(SquadError, match=r"^<dataset>: data\[0\].paragraphs\[0\].qas\[0\] \(question q1\): "
                                         "missing field 'answers'$"):
        evaluate(broken, {"q1": "x"})
    with pytest.raises(SquadError, match="the dataset has no questions"):
        evaluate({"data": []}, {})
    with pytest.raises(SquadError, match="expected a SQuAD dataset with a 'data' list"):
        evaluate({"version": "1.1"}, {})
    with pytest.raises(SquadError, match="file not found: .*missing.json"):
        evaluate(tmp_path / "missing.json", {})
