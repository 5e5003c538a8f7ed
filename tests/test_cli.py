"""The ``bertforge`` command: help of every subcommand, config printing, errors, bench."""

import argparse
import errno
import json
import os
import subprocess
import sys

import pytest
import yaml
from conftest import SteadyClock, live_run

from bertforge.bench import pretrain as bench_pretrain
from bertforge.cli import build_parser, main
from bertforge.config import CONFIG_DIR
from bertforge.tasks.finetune import glue

SUBCOMMANDS = [["pretrain"], ["bench"], ["bench", "pretrain"], ["bench", "squad"], ["plan"], ["export"],
               ["config"], ["data"],
               ["data", "wikipedia"], ["data", "wikipedia", "download"], ["data", "wikipedia", "extract"],
               ["data", "preprocess"], ["data", "vocab"], ["data", "create"], ["data", "pick-eval"],
               ["data", "index"], ["data", "inspect"], ["squad"], ["squad", "train"], ["squad", "predict"],
               ["squad", "evaluate"], ["squad", "ask"], ["eval"], ["report"], ["data", "checksum"], ["data", "pack"],
               ["import"], ["import", "tf1"], ["import", "tf2"], ["import", "hf"], ["finetune"], ["finetune", "glue"],
               ["finetune", "ner"], ["finetune", "predict"], ["finetune", "download-glue"],
               ["retrieval"], ["retrieval", "from-squad"], ["retrieval", "eval"], ["retrieval", "mine"],
               ["retrieval", "train"]]


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
@pytest.mark.smoke
def test_help(words, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*words, "--help"])
    assert exit_info.value.code == 0
    assert f"usage: bertforge {' '.join(words)}" in capsys.readouterr().out


def test_console_script_runs_as_a_module():
    out = subprocess.run([sys.executable, "-m", "bertforge", "--version"], capture_output=True, text=True,
                         check=False)
    assert out.returncode == 0 and out.stdout.startswith("bertforge ")


def test_config_prints_the_resolved_yaml(capsys):
    assert main(["config", "--config", "base", "--train.global_batch_size", "256", "--data.synthetic"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["model"]["hidden_size"] == 768
    assert cfg["train"]["global_batch_size"] == 256 and cfg["data"]["synthetic"] is True


@pytest.mark.parametrize("name", sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
def test_every_shipped_config_prints_what_it_sets_and_reads_back(name, capsys, tmp_path):
    """Issue 33.4a: `bertforge config --config NAME` for every shipped config, the fine-tuning ones
    (their squad: or finetune: section) included; each key the file sets is printed as it set it,
    and the printed YAML, given back as --config, resolves to itself."""
    assert main(["config", "--config", name]) == 0
    printed = capsys.readouterr().out
    resolved, shipped = yaml.safe_load(printed), yaml.safe_load((CONFIG_DIR / f"{name}.yaml").read_text())
    set_here = {(section, key): value for section, values in shipped.items() if isinstance(values, dict)
                for key, value in values.items() if key != "preset"}  # a model preset is printed as its fields
    assert {where: resolved[where[0]][where[1]] for where in set_here} == set_here
    (tmp_path / "again.yaml").write_text(printed)
    assert main(["config", "--config", str(tmp_path / "again.yaml")]) == 0
    assert capsys.readouterr().out == printed


def test_config_of_a_fine_tuning_recipe_takes_its_sections_overrides(capsys):
    assert main(["config", "--config", "squad_base", "--squad.doc_stride", "64", "--train.lr", "1e-5"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert (cfg["squad"]["doc_stride"], cfg["train"]["lr"], cfg["data"]["seq_len"]) == (64, 1e-5, 384)
    assert main(["config", "--config", "glue_base", "--finetune.task", "mrpc"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["finetune"]["task"] == "MRPC"  # as glue.TASKS names it
    assert main(["config", "--config", "squad_base", "--squad.nope", "1"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert main(["config", "--config", "glue_base", "--finetune.task", "nope"]) == 2
    assert capsys.readouterr().err == ("error: finetune.task='nope' is not a GLUE task (one of "
                                       f"{', '.join(glue.TASKS)})\n")


def test_config_and_plan_without_arguments_describe_what_pretrain_runs(capsys, monkeypatch):
    """Look before you run: `config` and `plan` with no --config resolve the config that a bare
    `bertforge pretrain` trains (BERT-tiny), not the dataclass defaults (BERT-base)."""
    import bertforge.training.pretrain
    from bertforge.parallel.plan import plan_memory

    runs = []
    monkeypatch.setattr(bertforge.training.pretrain, "pretrain", lambda cfg: runs.append(cfg) or {"rank": 1})
    assert main(["pretrain", "--train.lr", "0.02"]) == 0
    assert main(["config", "--train.lr", "0.02"]) == 0
    (ran,) = runs
    assert capsys.readouterr().out == ran.to_yaml()
    assert (ran.model.num_hidden_layers, ran.model.hidden_size, ran.train.lr) == (2, 128, 0.02)
    assert main(["plan", "--json", "--train.lr", "0.02"]) == 0
    assert json.loads(capsys.readouterr().out)["config"] == plan_memory(ran).to_dict()["config"]


@pytest.mark.parametrize("argv, message", [
    (["config", "--train.nope", "1"], "error: unknown config key 'train.nope'"),
    (["config", "--config", "gigantic"], "error: unknown config 'gigantic'"),
    (["pretrain", "--resume", "/no/such/run"], "error: checkpoint not found: /no/such/run"),
    (["export", "/no/such/run", "/tmp/out"], "error: model not found: /no/such/run"),
])
def test_user_errors_are_one_line_and_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.strip() == message or err.startswith(message)
    assert err.count("\n") == 1


def test_bench_pretrain_json(capsys, monkeypatch):
    monkeypatch.setattr(bench_pretrain, "time", SteadyClock(0.5))  # the 2 timed steps last 0.5 s
    assert main(["bench", "pretrain", "--config", "tiny", "--batch-size", "4", "--seq-len", "32",
                 "--steps", "2", "--warmup", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["batch_size"], result["seq_len"], result["max_predictions"], result["layers"]) == (4, 32, 20, 2)
    assert (result["seq_per_s"], result["tokens_per_s"]) == (16.0, 16.0 * 32) and result["peak_mem_mb"] >= 0


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


# ------------------------------------------------------------ one error handler: cli.main


def test_a_squad_error_is_one_line_and_exit_2_through_main(tmp_path, capsys):
    missing = tmp_path / "missing.json"
    assert main(["squad", "evaluate", str(missing), str(missing)]) == 2
    assert capsys.readouterr().err == f"error: file not found: {missing}\n"


def test_a_multi_line_message_is_printed_whole_on_one_line(tmp_path, capsys, monkeypatch):
    import bertforge.tasks.squad.metric
    from bertforge.tasks.squad import SquadError

    def evaluate(dataset, predictions, predictions_source):
        raise SquadError("predictions.json: 2 questions unknown:\n  q1\n  q2\n")

    monkeypatch.setattr(bertforge.tasks.squad.metric, "evaluate", evaluate)
    (tmp_path / "dev.json").write_text('{"data": []}')
    (tmp_path / "p.json").write_text('{"q1": "a"}')
    assert main(["squad", "evaluate", str(tmp_path / "dev.json"), str(tmp_path / "p.json")]) == 2
    assert capsys.readouterr().err == "error: predictions.json: 2 questions unknown: q1 q2\n"


def test_squad_handlers_raise_and_leave_the_exit_to_main(tmp_path):
    import bertforge.tasks.squad.cli as squad_cli
    from bertforge.tasks.squad import SquadError

    assert not hasattr(squad_cli, "_handler") and not hasattr(squad_cli, "_user_errors")
    args = argparse.Namespace(dataset=str(tmp_path / "none.json"), predictions=str(tmp_path / "none.json"))
    with pytest.raises(SquadError, match="file not found"):
        squad_cli.cmd_evaluate(args, [])


def test_an_empty_message_names_the_error(capsys, monkeypatch):
    from bertforge.data import DataError

    def fail(args, extra):
        raise DataError()

    monkeypatch.setattr(sys.modules["bertforge.runs"], "cmd_config", fail)
    assert main(["config"]) == 2
    assert capsys.readouterr().err == "error: DataError\n"


# ------------------------------------------------------------ choices come from the config's types


def find_action(parser, words, dest):
    for word in words:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[word]
    return next(a for a in parser._actions if a.dest == dest)


def test_flag_choices_are_the_config_literals():
    import typing

    from bertforge.config import Head, Precision

    parser = build_parser()
    assert typing.get_args(Precision) == ("fp32", "bf16", "fp16")
    assert tuple(find_action(parser, ["bench", "pretrain"], "precision").choices) == ("fp32", "bf16", "fp16")
    assert tuple(find_action(parser, ["bench", "squad"], "precision").choices) == ("fp32", "bf16", "fp16")
    assert tuple(find_action(parser, ["squad", "predict"], "precision").choices) == ("fp32", "bf16")
    heads = ("pretraining", "qa", "classification", "token_classification", "encoder")
    assert typing.get_args(Head) == heads
    assert tuple(find_action(parser, ["export"], "head").choices) == heads


def test_checkpoint_heads_are_the_config_literal():
    from bertforge.formats.weights import HEADS

    assert HEADS == ("pretraining", "qa", "classification", "token_classification", "encoder")


# ------------------------------------------------------------ logging, configured in main


@pytest.fixture
def downloaded(tmp_path):
    """A dump already in place: ``data wikipedia download`` logs that it is and does nothing else."""
    (tmp_path / "dump.xml.bz2").write_bytes(b"BZh9")
    return ["data", "wikipedia", "download", str(tmp_path), "--url", "http://127.0.0.1:9/dump.xml.bz2",
            "--no-verify"], tmp_path / "dump.xml.bz2"


def test_library_info_lines_are_shown_by_default(downloaded, capsys, monkeypatch):
    monkeypatch.delenv("BERTFORGE_LOG_LEVEL", raising=False)
    argv, path = downloaded
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert out == f"{path}\n"
    assert err == f"INFO bertforge.data.download: {path} is already here\n"


@pytest.mark.parametrize("level, shown", [("DEBUG", True), ("debug", True), ("INFO", True),
                                          ("WARNING", False), ("ERROR", False)])
def test_log_level_flag(level, shown, downloaded, capsys):
    argv, path = downloaded
    assert main(["--log-level", level, *argv]) == 0
    expected = f"INFO bertforge.data.download: {path} is already here\n" if shown else ""
    assert capsys.readouterr().err == expected


def test_log_level_from_the_environment_and_the_flag_wins(downloaded, capsys, monkeypatch):
    argv, path = downloaded
    monkeypatch.setenv("BERTFORGE_LOG_LEVEL", "warning")
    assert main(argv) == 0
    assert capsys.readouterr().err == ""
    assert main(["--log-level", "INFO", *argv]) == 0
    assert capsys.readouterr().err == f"INFO bertforge.data.download: {path} is already here\n"


def test_a_bad_log_level_is_a_usage_error(capsys, monkeypatch):
    with pytest.raises(SystemExit) as exit_info:
        main(["--log-level", "loud", "config"])
    assert exit_info.value.code == 2
    assert "argument --log-level: 'loud' is not a log level (DEBUG, INFO, WARNING, ERROR, CRITICAL)" in \
        capsys.readouterr().err
    monkeypatch.setenv("BERTFORGE_LOG_LEVEL", "verbose")
    with pytest.raises(SystemExit) as exit_info:
        main(["config"])
    assert exit_info.value.code == 2
    assert "'verbose' is not a log level" in capsys.readouterr().err


def test_main_leaves_the_logging_setup_as_it_found_it(downloaded):
    import logging

    logger = logging.getLogger("bertforge")
    before = (list(logger.handlers), logger.level)
    assert main(["--log-level", "DEBUG", *downloaded[0]]) == 0
    assert (list(logger.handlers), logger.level) == before


# ------------------------------------------------------------ no import circle


def test_plan_does_not_import_the_command_line():
    code = ("import sys, bertforge.parallel.plan, bertforge.config; "
            "print(sorted(m for m in ('bertforge.cli', 'bertforge.tasks.squad.cli', 'torch') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_plan_command_still_runs_through_main(capsys):
    assert main(["plan", "--config", "tiny", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["fits"] is None and result["device_memory"] is None


# ------------------------------------------------------------ export: --overwrite names the flag


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A one-step tiny pre-training run on synthetic data (about 3 s)."""
    runs = tmp_path_factory.mktemp("runs")
    assert main(["pretrain", "--config", "tiny", "--data.synthetic", "--steps", "1", "--train.global_batch_size", "2",
                 "--train.micro_batch_size", "2", "--data.seq_len", "16", "--data.max_predictions", "2",
                 "--model.vocab_size", "50", "--run-dir", str(runs), "--name", "r", "--no-progress",
                 "--log.tensorboard", "false"]) == 0
    return runs / "r"


def test_export_refuses_a_non_empty_directory_unless_overwrite(tiny_run, tmp_path, capsys):
    out = tmp_path / "hf"
    out.mkdir()
    assert main(["export", str(tiny_run), str(out), "--without-tokenizer"]) == 0  # an empty directory is filled
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    weights = (out / "model.safetensors").read_bytes()
    (out / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert main(["export", str(tiny_run), str(out)]) == 2
    assert capsys.readouterr().err == (f"error: {out}: already exists and is not an empty directory; "
                                       "pass --overwrite (overwrite=True in Python) to replace it\n")
    assert (out / "notes.txt").read_text() == "mine"
    assert main(["export", str(tiny_run), str(out), "--overwrite", "--without-tokenizer"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert (out / "model.safetensors").read_bytes() == weights
    # never into the checkpoint being exported, even with --overwrite
    assert main(["export", str(tiny_run), str(tiny_run.parent), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tiny_run.parent}: --overwrite would delete the checkpoint being exported")
    assert err.count("\n") == 1 and (tiny_run / "config.yaml").is_file()


def test_export_reads_a_hugging_face_directory_or_a_model_id_in_the_cache(tmp_path, hf_cache, monkeypatch, capsys):
    """A Hugging Face directory, or its id in the local Hugging Face cache, exports with the head its
    config.json names (a QA model stays one); an id the cache lacks says where it was looked for."""
    import torch

    from bertforge.config import ModelConfig
    from bertforge.formats.hf import export_hf
    from bertforge.formats.load import load_model
    from bertforge.models.bert import BertForQuestionAnswering

    torch.manual_seed(0)
    qa = BertForQuestionAnswering(ModelConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1,
                                              num_attention_heads=2, intermediate_size=32,
                                              max_position_embeddings=32))
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(35)]) + "\n")
    export_hf(qa, tmp_path / "qa-hf", vocab_path=vocab)
    hf_cache(tmp_path / "qa-hf", "org/qa-bert")
    monkeypatch.chdir(tmp_path)  # where org/qa-bert is no path
    assert main(["export", "org/qa-bert", "from-id"]) == 0
    assert main(["export", "qa-hf", "from-dir", "--format", "tf1"]) == 0
    assert json.loads((tmp_path / "from-id" / "config.json").read_text())["architectures"] == [
        "BertForQuestionAnswering"]
    for out in ("from-id", "from-dir"):
        theirs = load_model(tmp_path / out, head="qa").state_dict()
        assert theirs.keys() == qa.state_dict().keys(), out
        assert all(torch.equal(theirs[k], v) for k, v in qa.state_dict().items()), out
    capsys.readouterr()
    assert main(["export", "org/missing", "out"]) == 2
    assert capsys.readouterr().err == (
        f"error: model not found: org/missing (no such path, and no model org/missing in the local Hugging Face "
        f"cache {tmp_path / 'hf-cache'}: `hf download org/missing` puts it there)\n")
    assert not (tmp_path / "out").exists()


def test_overwrite_never_replaces_a_live_runs_files(tiny_run, tmp_path, capsys):
    """Every --overwrite that writes outside a run directory (export, import, report, data create,
    pack, checksum) refuses, in one line naming the run and its process, a target a live run writes
    in: its directory, one inside it, one holding it, or a file in it; nothing of it changes
    (issue 27). About 3 s."""
    import shutil

    live = shutil.copytree(tiny_run, tmp_path / "runs" / "live")
    (live / "train.tfrecord").write_bytes(b"a run's file of an output's name")
    (live / "records.md5").write_text("a run's file of a manifest's name\n")
    vocab, text = tmp_path / "vocab.txt", tmp_path / "corpus.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat"]) + "\n")
    text.write_text("the cat sat.\nthe cat.\n\nsat the cat.\nthe sat.\n")
    records = tmp_path / "records"
    assert main(["data", "create", "--input", str(text), "--vocab", str(vocab), "--output",
                 str(records / "train.tfrecord"), "--seq-len", "16", "--max-predictions", "2"]) == 0
    assert main(["export", str(tiny_run), str(tmp_path / "tf1"), "--format", "tf1"]) == 0
    prefix = next((tmp_path / "tf1").glob("*.index")).with_suffix("")
    before = snapshot(live)
    before.pop(".lock")
    with live_run(live) as holder:
        for argv, target in [
            (["export", str(tiny_run), str(live), "--overwrite"], live),
            (["export", str(tiny_run), str(live / "checkpoints"), "--format", "tf2", "--overwrite"],
             live / "checkpoints"),
            (["export", str(tiny_run), str(live.parent), "--overwrite"], live.parent),
            (["import", "tf1", str(prefix), str(live), "--overwrite"], live),
            (["report", str(tiny_run), "--out", str(live), "--overwrite"], live),
            (["data", "create", "--input", str(text), "--vocab", str(vocab), "--output", str(live / "train.tfrecord"),
              "--seq-len", "16", "--max-predictions", "2", "--overwrite"], live / "train.tfrecord"),
            (["data", "pack", str(records), str(live / "checkpoints"), "--overwrite"], live / "checkpoints"),
            (["data", "checksum", str(records), "--manifest", str(live / "records.md5"), "--overwrite"],
             live / "records.md5"),
        ]:
            capsys.readouterr()
            assert main(argv) == 2, argv
            err = capsys.readouterr().err
            assert err.startswith(f"error: {target}: {live} is the directory of a live run (pid {holder.pid} on "), argv
            assert err.endswith("; --overwrite would replace its files: wait for it to end, or choose another "
                                "output\n") and err.count("\n") == 1, argv
        after = snapshot(live)
        assert after.pop(".lock").startswith(f"pid {holder.pid} on ".encode()) and after == before
    # Once the run is gone, its directory is anyone's to replace.
    assert main(["export", str(tiny_run), str(live), "--overwrite", "--without-tokenizer"]) == 0
    assert sorted(p.name for p in live.iterdir()) == ["config.json", "model.safetensors"]


# ------------------------------------------------------------ a read-only directory: one line, nothing written


def snapshot(directory):
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_write_errors_are_user_errors():
    from bertforge.cli import user_errors
    from bertforge.fileio import WriteError

    assert WriteError in user_errors()


@pytest.mark.parametrize("fmt", ["hf", "tf1"])
def test_export_into_a_read_only_directory_is_one_line(tiny_run, tmp_path, capsys, make_read_only, fmt):
    (tmp_path / "ro").mkdir()
    read_only = make_read_only(tmp_path / "ro")
    out = read_only / "export"
    capsys.readouterr()
    assert main(["--log-level", "ERROR", "export", str(tiny_run), str(out), "--format", fmt,
                 "--without-tokenizer"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot write {out}: {read_only} is not writable (") and err.count("\n") == 1
    assert list(read_only.iterdir()) == []


def test_data_index_in_a_read_only_directory_is_one_line(tmp_path, capsys, make_read_only):
    from bertforge.data.create import create

    records = tmp_path / "records"
    records.mkdir()
    (tmp_path / "t.txt").write_text("one two three four\nfive six seven\n\neight nine ten\neleven twelve\n")
    (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "one", "two"]) + "\n")
    create([tmp_path / "t.txt"], tmp_path / "vocab.txt", records / "a.tfrecord", seq_len=16, max_predictions=2,
           dupe_factor=1)
    before = snapshot(make_read_only(records))
    assert main(["data", "index", str(records / "a.tfrecord")]) == 2
    assert capsys.readouterr().err.startswith(f"error: cannot write {records / 'a.index'}: {records} is not writable (")
    assert snapshot(records) == before


def test_resuming_a_read_only_run_is_one_line_and_writes_nothing_into_it(tiny_run, tmp_path, capsys, make_read_only):
    """The run directory's lock (or, where the fixture can only refuse temporary files, its
    config.yaml) cannot be written: one line, and no error_rank0.log either."""
    import shutil

    run = make_read_only(shutil.copytree(tiny_run, tmp_path / "run"))
    before = snapshot(run)
    capsys.readouterr()
    assert main(["pretrain", "--resume", str(run), "--steps", "2", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert any(err.startswith(f"error: cannot write {run / name}: {run} is not writable (")
               for name in (".lock", "config.yaml"))
    assert err.count("\n") == 1 and "Traceback" not in err
    after = snapshot(run)
    for files in (before, after):
        files.pop(".lock", None)  # the lock of the run copied, or (the fallback fixture) one made now
    assert after == before and not (run / "error_rank0.log").exists()


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EACCES])
def test_a_disk_error_outside_fileio_is_one_line(tmp_path, monkeypatch, capsys, code):
    """A command that writes without bertforge.fileio (a report, say) still ends in one line, exit 2."""
    import bertforge.observe.report

    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code), str(tmp_path / "out" / "index.html"))

    monkeypatch.setattr(bertforge.observe.report, "write_report", fail)
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == f"error: [Errno {code}] {os.strerror(code)}: '{tmp_path / 'out' / 'index.html'}'\n"


def test_other_os_errors_are_not_hidden(tmp_path, monkeypatch):
    import bertforge.observe.report

    def fail(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(bertforge.observe.report, "write_report", fail)
    with pytest.raises(OSError, match="Input/output error"):
        main(["report", str(tmp_path), "--out", str(tmp_path / "out")])


@pytest.mark.parametrize(("argv", "value", "said"), [
    (["eval", "ckpt"], "0", "0 is not a positive integer"),
    (["squad", "predict", "--model", "m", "--predict-file", "dev.json", "--out", "p.json"], "-1",
     "-1 is not a positive integer"),
    (["finetune", "predict", "--model", "m"], "abc", "expected an integer, got 'abc'"),
])
def test_a_batch_size_below_one_is_refused_in_one_line(argv, value, said, capsys):
    """``--batch-size 0`` was taken as "the default" by eval and squad predict (issue 33's bad-input
    review): every predicting command refuses a count below 1 before it loads anything."""
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--batch-size", value])
    assert exit_info.value.code == 2
    prog = " ".join(argv[:2]) if argv[0] != "eval" else "eval"
    assert capsys.readouterr().err.splitlines()[-1] == f"bertforge {prog}: error: argument --batch-size: {said}"


@pytest.mark.smoke
def test_retrieval_help_shows_every_subcommand_in_plain_text(capsys):
    """Issue 41.7: the group's description named from-squad and eval only, in the docstring's
    reST markup (``…``); it is plain text with a command line for each subcommand."""
    with pytest.raises(SystemExit):
        main(["retrieval", "--help"])
    description = capsys.readouterr().out.split("positional arguments:")[0]
    assert "``" not in description and ":data:" not in description
    commands = [line.split()[2] for line in description.splitlines() if line.strip().startswith("bertforge retrieval ")]
    assert commands == [name for path, name in ((p[:-1], p[-1]) for p in SUBCOMMANDS) if path == ["retrieval"]]
