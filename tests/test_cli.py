"""The ``bertforge`` command: help of every subcommand, config printing, errors, bench."""

import argparse
import json
import subprocess
import sys

import pytest
import yaml

from bertforge.cli import build_parser, main

SUBCOMMANDS = [["pretrain"], ["bench"], ["bench", "pretrain"], ["bench", "squad"], ["plan"], ["export"],
               ["config"], ["data"],
               ["data", "wikipedia"], ["data", "wikipedia", "download"], ["data", "wikipedia", "extract"],
               ["data", "preprocess"], ["data", "vocab"], ["data", "create"], ["data", "pick-eval"],
               ["data", "index"], ["data", "inspect"], ["squad"], ["squad", "train"], ["squad", "predict"],
               ["squad", "evaluate"], ["squad", "ask"]]


def all_commands(parser, prefix=()):
    """Every command path of a parser, found by walking its subparsers."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.append([*prefix, name])
                found += all_commands(sub, (*prefix, name))
    return found


def test_every_subcommand_is_covered():
    assert sorted(all_commands(build_parser())) == sorted(SUBCOMMANDS)


@pytest.mark.parametrize("words", SUBCOMMANDS, ids=" ".join)
def test_help(words, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*words, "--help"])
    assert exit_info.value.code == 0
    assert f"usage: bertforge {' '.join(words)}" in capsys.readouterr().out


def test_console_script_runs_as_a_module():
    out = subprocess.run([sys.executable, "-m", "bertforge", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("bertforge ")


def test_config_prints_the_resolved_yaml(capsys):
    assert main(["config", "--config", "base", "--train.global_batch_size", "256", "--data.synthetic"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["model"]["hidden_size"] == 768
    assert cfg["train"]["global_batch_size"] == 256 and cfg["data"]["synthetic"] is True


@pytest.mark.parametrize("argv, message", [
    (["config", "--train.nope", "1"], "error: unknown config key 'train.nope'"),
    (["config", "--config", "gigantic"], "error: unknown config 'gigantic'"),
    (["pretrain", "--resume", "/no/such/run"], "error: checkpoint not found: /no/such/run"),
    (["export", "/no/such/run", "/tmp/out"], "error: checkpoint not found: /no/such/run"),
])
def test_user_errors_are_one_line_and_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.strip() == message or err.startswith(message)
    assert err.count("\n") == 1


def test_bench_pretrain_json(capsys):
    assert main(["bench", "pretrain", "--config", "tiny", "--batch-size", "4", "--seq-len", "32",
                 "--steps", "2", "--warmup", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["batch_size"], result["seq_len"], result["max_predictions"], result["layers"]) == (4, 32, 20, 2)
    assert result["seq_per_s"] > 0 and result["peak_mem_mb"] >= 0
    assert result["tokens_per_s"] == pytest.approx(result["seq_per_s"] * 32, rel=1e-2)


def test_bench_pretrain_applies_the_execution_settings(capsys):
    results = []
    for recompute in ("none", "layer"):
        assert main(["bench", "pretrain", "--config", "tiny", "--batch-size", "4", "--seq-len", "32",
                     "--steps", "2", "--warmup", "1", "--json", "--execution.recompute", recompute]) == 0
        results.append(json.loads(capsys.readouterr().out))
    assert [r["recompute"] for r in results] == ["none", "layer"]
    assert results[0]["final_loss"] == results[1]["final_loss"]  # recomputation changes memory, not results


def test_leftover_flags_are_rejected_unless_the_command_takes_overrides(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["export", "/no/such/run", "/tmp/out", "--train.lr", "1"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --train.lr 1" in capsys.readouterr().err
