"""Bounded fuzz tests of the readers of files a user writes by hand: SQuAD datasets,
prediction files and config YAML.

Each test mutates real files (a small subset of ``dev-v1.1.json``; the shipped configs) with
a seeded generator: type changes, deletions, truncations, wrong nesting, unknown keys, huge
numbers, byte damage. Every case must either work or raise the reader's one user error
(SquadError, ConfigError) with a one-line message naming the file; any other exception is a
bug. The counts and times are in each test's docstring.
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from conftest import shared_data

from bertforge.cli import main
from bertforge.config import CONFIG_DIR, ConfigError, load_config
from bertforge.tasks.squad import SquadError, convert_examples_to_features, evaluate, load_json, read_examples
from bertforge.tasks.squad.metric import check_predictions

# Values of every JSON / YAML type, a few of them extreme.
ODD_VALUES: list[Any] = [None, True, False, 0, -1, 7, 10**30, -(10**30), 1.5, 1e308, float("nan"), "", "x",
                         "12", [], [1], ["a", "b"], {}, {"a": 1}, {"text": 3}, [[{"id": "q"}]]]


def paths_of(node: Any, prefix: tuple = ()) -> Iterator[tuple]:
    """Every path (keys and indices) into a parsed JSON / YAML tree, the root included."""
    yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from paths_of(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from paths_of(value, (*prefix, i))


def mutate_tree(tree: Any, rng: random.Random) -> tuple[Any, tuple]:
    """One structural mutation at a random place: (the new tree, the path mutated)."""
    tree = copy.deepcopy(tree)
    path = rng.choice(list(paths_of(tree)))
    if not path:
        return rng.choice(ODD_VALUES + [[tree], {"data": tree}]), path
    parent = tree
    for step in path[:-1]:
        parent = parent[step]
    last = path[-1]
    kind = rng.randrange(6)
    if kind == 0:  # delete
        del parent[last]
    elif kind == 1:  # another type
        parent[last] = copy.deepcopy(rng.choice(ODD_VALUES))
    elif kind == 2:  # wrapped in a list (wrong nesting)
        parent[last] = [parent[last]]
    elif kind == 3:  # a list replaced by its first element, an object by one of its values
        value = parent[last]
        if isinstance(value, list) and value:
            parent[last] = value[0]
        elif isinstance(value, dict) and value:
            parent[last] = rng.choice(list(value.values()))
        else:
            parent[last] = {"x": value}
    elif kind == 4 and isinstance(parent, dict):  # an unknown key beside it
        parent[f"{last}_extra"] = rng.choice(ODD_VALUES)
    else:  # the value of another place of the tree
        other = tree
        for step in rng.choice(list(paths_of(tree))):
            other = other[step]
        parent[last] = copy.deepcopy(other)
    return tree, path


def mutate_text(data: bytes, rng: random.Random) -> bytes:
    """A truncation, a damaged byte, or junk inserted at a random place."""
    at = rng.randrange(len(data))
    kind = rng.randrange(3)
    if kind == 0:
        return data[:at]
    if kind == 1:
        return data[:at] + bytes([rng.randrange(256)]) + data[at + 1:]
    junk = rng.choice([b"{", b"]", b",", b":", b'"', b"\t", b"\n- ", b"&a *a", b"\xff\xfe", b"\\u12", b"1e999",
                       b"[" * 50, b"9" * 5000])
    return data[:at] + junk + data[at:]


def one_line_naming(err: Exception, name: str) -> None:
    message = str(err)
    assert "\n" not in message, message
    assert name in message, message


# ------------------------------------------------------------------ SQuAD


@pytest.fixture(scope="module")
def dev_subset() -> dict:
    """The first 3 questions of the first 2 paragraphs of the first 3 dev articles (18 questions)."""
    dev = load_json(shared_data("squad/dev-v1.1.json"))
    return {"version": "1.1", "data": [
        {"title": a["title"], "paragraphs": [dict(p, qas=p["qas"][:3]) for p in a["paragraphs"][:2]]}
        for a in dev["data"][:3]]}


@pytest.fixture(scope="module")
def tokenizer():
    from bertforge.data.tokenizer import load_tokenizer

    return load_tokenizer(shared_data("vocab/bert-base-uncased-vocab.txt"))


@pytest.mark.shared_data
def test_fuzzed_squad_files_work_or_are_one_line_errors(dev_subset, tokenizer, tmp_path, capsys):
    """300 mutated datasets (200 structural, 100 byte-level), each read for prediction and for
    training (with features when it reads), scored, and 1 in 10 through ``bertforge squad
    evaluate``; about 4 s on 2 cores."""
    rng = random.Random(11)
    path = tmp_path / "dev.json"
    truth = {qa["id"]: qa["answers"][0]["text"] for a in dev_subset["data"] for p in a["paragraphs"]
             for qa in p["qas"]}
    (tmp_path / "predictions.json").write_text(json.dumps(truth))
    original = json.dumps(dev_subset).encode()
    outcomes = {"read": 0, "error": 0}
    for case in range(300):
        if case < 200:
            tree, _ = mutate_tree(dev_subset, rng)
            path.write_text(json.dumps(tree))
        else:
            path.write_bytes(mutate_text(original, rng))
        for is_training in (False, True):
            try:
                examples, _ = read_examples(path, is_training=is_training)
                if examples:
                    convert_examples_to_features(examples[:6], tokenizer, 128, 64, 32, is_training=is_training)
                outcomes["read"] += 1
            except SquadError as err:
                one_line_naming(err, str(path))
                outcomes["error"] += 1
        try:
            evaluate(path, truth)
        except SquadError as err:
            one_line_naming(err, str(path))
        if case % 10 == 0:
            status = main(["squad", "evaluate", str(path), str(tmp_path / "predictions.json")])
            err_text = capsys.readouterr().err
            assert status in (0, 2)
            if status == 2:
                assert err_text.startswith("error: ") and err_text.count("\n") == 1, err_text
    # Both outcomes happen: the mutations are neither all harmless nor all fatal.
    assert outcomes["read"] > 50 and outcomes["error"] > 200, outcomes


@pytest.mark.shared_data
def test_fuzzed_prediction_files_work_or_name_the_question(dev_subset, tmp_path, capsys):
    """200 mutated prediction files (150 structural, 50 byte-level), checked and scored, 1 in 5
    through ``bertforge squad evaluate``; about 1 s."""
    rng = random.Random(12)
    truth = {qa["id"]: qa["answers"][0]["text"] for a in dev_subset["data"] for p in a["paragraphs"]
             for qa in p["qas"]}
    (tmp_path / "dev.json").write_text(json.dumps(dev_subset))
    path = tmp_path / "predictions.json"
    original = json.dumps(truth).encode()
    errors = 0
    for case in range(200):
        if case < 150:
            tree, where = mutate_tree(truth, rng)
            path.write_text(json.dumps(tree))
        else:
            path.write_bytes(mutate_text(original, rng))
        try:
            evaluate(dev_subset, check_predictions(load_json(path), str(path)), str(path))
        except SquadError as err:
            errors += 1
            one_line_naming(err, str(path))
            if case < 150 and isinstance(tree, dict) and where and not isinstance(tree.get(where[0]), str) \
                    and where[0] in tree:
                one_line_naming(err, f"question {where[0]}")  # a mistyped answer names its question
        if case % 5 == 0:
            status = main(["squad", "evaluate", str(tmp_path / "dev.json"), str(path)])
            err_text = capsys.readouterr().err
            assert status in (0, 2) and (status == 0 or err_text.count("\n") == 1), err_text
    assert 50 < errors < 200, errors


# ------------------------------------------------------------------ config YAML


def dotted_key(path: tuple) -> str:
    return ".".join(str(p) for p in path[:2])


def test_fuzzed_config_files_load_or_name_the_file_and_key(tmp_path):
    """400 mutated copies of the shipped pre-training configs through ``load_config``
    (300 structural: wrong types, unknown keys, deletions, lists where mappings are, huge
    numbers; 100 byte-level: bad YAML, truncation, binary); about 2.5 s."""
    rng = random.Random(13)
    sources = sorted(p for p in CONFIG_DIR.glob("*.yaml") if p.name.startswith(("pretrain_", "mlperf_")))
    assert [p.stem for p in sources] == ["mlperf_bert", "pretrain_base_128", "pretrain_large_128_phase1",
                                         "pretrain_large_384_phase2", "pretrain_large_512_phase2", "pretrain_tiny",
                                         "pretrain_tiny_128_lamb"]
    path = tmp_path / "mine.yaml"
    loaded = refused = 0
    for case in range(400):
        source = rng.choice(sources)
        where: tuple = ()
        if case < 300:
            tree, where = mutate_tree(yaml.safe_load(source.read_text()), rng)
            path.write_text(yaml.safe_dump(tree))
        else:
            path.write_bytes(mutate_text(source.read_bytes(), rng))
        try:
            load_config(str(path))
            loaded += 1
        except ConfigError as err:
            refused += 1
            one_line_naming(err, str(path))
            if len(where) >= 1 and isinstance(where[0], str):
                one_line_naming(err, str(where[0]))  # names the section (and usually the key) mutated
    assert loaded > 30 and refused > 200, (loaded, refused)


def test_fuzzed_squad_configs_load_or_are_one_line_errors(tmp_path):
    """100 mutated copies of the shipped SQuAD configs through ``load_squad_config``; about 3 s."""
    from bertforge.tasks.squad.train import load_squad_config

    rng = random.Random(14)
    sources = sorted(CONFIG_DIR.glob("squad_*.yaml"))
    path = tmp_path / "squad.yaml"
    refused = 0
    for case in range(100):
        source = rng.choice(sources)
        if case < 70:
            path.write_text(yaml.safe_dump(mutate_tree(yaml.safe_load(source.read_text()), rng)[0]))
        else:
            path.write_bytes(mutate_text(source.read_bytes(), rng))
        try:
            load_squad_config(str(path))
        except ConfigError as err:
            refused += 1
            assert "\n" not in str(err), str(err)
    assert refused > 30, refused
