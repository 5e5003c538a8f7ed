"""Bad input on the command line: does each mistake end with one line, a traceback, or nothing?

Issue 33's review: runs a list of bad-input cases (and a few valid ones), each a ``bertforge``
command line in a subprocess with a timeout, on toy sizes (a tiny config, 1 step), and sorts
each result into

- ``one line``: a non-zero exit whose stderr ends with an ``error:`` line (ours, or argparse's
  ``bertforge …: error:``) and holds no traceback;
- ``traceback``: a Python traceback in the output;
- ``silent``: exit 0 on bad input, or a non-zero exit that says nothing (no ``error:`` line);
- ``ok``: a case of valid input that must succeed, and did (exit 0);
- ``failed``: a valid case that did not succeed.

    python benchmarks/bad_inputs.py [--json OUT.json] [--only SUBSTRING ...] [--timeout S]

It prints one row per case and the counts. Fixtures (a 1-step BERT-tiny run on the real
``sample_text.txt``, its Hugging Face export, a BPE tokenizer.json and TFRecords made with it,
a 1-step ModernBERT-tiny export) are made once in a temporary directory first. Needs the data
of ``../shared/data`` (or ``$BERTFORGE_TEST_DATA``). Offline: ``HF_HUB_OFFLINE=1`` and an empty
``HF_HOME``. About 4 s a case on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(os.environ.get("BERTFORGE_TEST_DATA", ROOT.parent / "shared" / "data"))
SAMPLE = DATA / "text" / "sample_text.txt"
VOCAB = DATA / "vocab" / "bert-base-uncased-vocab.txt"
TFRECORD = DATA / "tfrecord" / "graphcore_sample_text.tfrecord"
MRPC = DATA / "glue" / "MRPC"

QUIET = ["--train.eval_at_start", "false", "--log.tensorboard", "false", "--execution.compile", "false"]
TINY = ["--train.steps", "1", "--train.micro_batch_size", "2", "--train.global_batch_size", "2",
        "--data.seq_len", "32", "--data.max_predictions", "4", *QUIET]
SYNTH = ["pretrain", "--data.synthetic", "true", *TINY]
MODERN = ["pretrain", "--config", "modernbert-tiny", "--train.objective", "mlm", "--data.synthetic", "true", *TINY]
FT = ["--train.steps", "1", "--train.epochs", "0", "--train.micro_batch_size", "2", "--train.global_batch_size", "2",
      "--data.seq_len", "32", "--finetune.max_examples", "4", *QUIET]
SQ = ["--train.steps", "1", "--train.epochs", "0", "--train.micro_batch_size", "2", "--train.global_batch_size", "2",
      "--data.seq_len", "64", "--squad.max_query_length", "16", "--squad.max_questions", "2", *QUIET]

Prep = Callable[[Path, Path], None]  # (fixtures dir, case dir)


@dataclass
class Case:
    name: str
    argv: list[str]  # after "bertforge"; {T} the fixtures dir, {C} the case's own dir
    prep: Prep | None = None
    valid: bool = False
    timeout: float = 120.0
    env: dict[str, str] = field(default_factory=dict)


def write(rel: str, text: str | bytes) -> Prep:
    def prep(t: Path, c: Path) -> None:
        path = c / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return prep


def copy(src: str, rel: str) -> Prep:
    """Copy fixture ``src`` (a file or directory under {T}) to ``rel`` under {C}."""
    def prep(t: Path, c: Path) -> None:
        source = t / src
        dest = c / rel
        if source.is_dir():
            shutil.copytree(source, dest)
        else:
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(source, dest)
    return prep


def chain(*preps: Prep) -> Prep:
    def prep(t: Path, c: Path) -> None:
        for p in preps:
            p(t, c)
    return prep


def truncate(rel: str, keep: float = 0.5) -> Prep:
    def prep(t: Path, c: Path) -> None:
        path = c / rel
        data = path.read_bytes()
        path.write_bytes(data[: int(len(data) * keep)])
    return prep


def edit_json(rel: str, change: Callable[[dict], None]) -> Prep:
    def prep(t: Path, c: Path) -> None:
        path = c / rel
        obj = json.loads(path.read_text())
        change(obj)
        path.write_text(json.dumps(obj))
    return prep


def remove(rel: str) -> Prep:
    def prep(t: Path, c: Path) -> None:
        path = c / rel
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    return prep


def flip(rel: str) -> Prep:
    """Flip one bit in the middle of file ``rel`` under {C}: damaged, its size unchanged."""
    def prep(t: Path, c: Path) -> None:
        path = c / rel
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x10
        path.write_bytes(bytes(data))
    return prep


def conll(rel: str) -> Prep:
    """A CoNLL-2003 directory (train.txt, dev.txt) of two sentences under {C}/``rel``."""
    text = "-DOCSTART- -X- -X- O\n\nJohn NNP B-NP B-PER\nlives VBZ B-VP O\nin IN B-PP O\nParis NNP B-NP B-LOC\n\n" * 2
    return chain(write(f"{rel}/train.txt", text), write(f"{rel}/dev.txt", text))


def drop_mask(obj: dict) -> None:
    obj["added_tokens"] = [tok for tok in obj.get("added_tokens", []) if tok["content"] != "[MASK]"]
    vocab = obj["model"]["vocab"]
    vocab.pop("[MASK]", None)


def set_key(key: str, value: object) -> Callable[[dict], None]:
    def change(obj: dict) -> None:
        obj[key] = value
    return change


def squad_json(n: int = 2) -> str:
    context = "The quick brown fox jumps over the lazy dog near the river bank in the morning."
    qas = [{"id": f"q{i}", "question": "What does the fox jump over?",
            "answers": [{"text": "the lazy dog", "answer_start": context.index("the lazy dog")}]} for i in range(n)]
    return json.dumps({"version": "1.1", "data": [{"title": "t", "paragraphs": [{"context": context, "qas": qas}]}]})


def cases() -> list[Case]:
    run = "{T}/runs/base"
    ckpt = f"{run}/checkpoints/step_00000001"
    hf_run = ["--init", "{T}/hf"]
    sq_files = ["--train-file", "{C}/train.json", "--predict-file", "{C}/train.json", "--out", "{C}/out"]
    glue = ["finetune", "glue", "--task", "mrpc", "--data", str(MRPC), "--out", "{C}/out", "--seeds", "1"]
    fast = ["--seq-len", "32", "--max-predictions", "4", "--dupe-factor", "1"]
    offline = {"HF_HUB_OFFLINE": "1"}
    c: list[Case] = [
        # ---- valid input: must succeed
        Case("valid: pretrain synthetic 1 step", [*SYNTH, "--log.run_dir", "{C}/runs"], valid=True),
        Case("valid: export with its vocab", ["export", run, "{C}/hf"], valid=True),
        Case("valid: import hf of an export", ["import", "hf", "{T}/hf", "{C}/model"], valid=True),
        Case("valid: pretrain on BPE TFRecords with their tokenizer",
             ["pretrain", "--data.input", "{T}/bpe", "--data.vocab", "{T}/bpe.json", *TINY,
              "--log.run_dir", "{C}/runs"], valid=True),
        Case("valid: eval of a checkpoint", ["eval", ckpt, "--data.eval_input", str(TFRECORD),
                                             "--batch-size", "8", "--data.seq_len", "128",
                                             "--data.max_predictions", "20", "--train.eval_batches", "1"], valid=True),
        # ---- bf16 weights, stochastic rounding, loss scale
        Case("train.weights fp64", [*SYNTH, "--train.weights", "fp64"]),
        Case("train.weights bf16 with execution.precision fp32", [*SYNTH, "--train.weights", "bf16"]),
        Case("train.stochastic_rounding 'maybe'", [*SYNTH, "--train.stochastic_rounding", "maybe"]),
        Case("train.stochastic_rounding with fp32 weights", [*SYNTH, "--train.stochastic_rounding", "true"]),
        Case("train.loss_scale -1", [*SYNTH, "--train.loss_scale", "-1"]),
        Case("train.loss_scale 'abc'", [*SYNTH, "--train.loss_scale", "abc"]),
        Case("train.loss_scale inf", [*SYNTH, "--train.loss_scale", "inf"]),
        Case("train.loss_scale nan", [*SYNTH, "--train.loss_scale", "nan"]),
        # scale 1: the same update, a no-op rather than a mistake
        Case("valid: train.scaled_optimizer_state with loss scale 1",
             [*SYNTH, "--train.scaled_optimizer_state", "true"], valid=True),
        Case("train.optimizer_state fp8", [*SYNTH, "--train.optimizer_state", "fp8"]),
        # ---- optimizer in the backward
        Case("optimizer_in_backward with grad_clip 1", [*SYNTH, "--train.optimizer_in_backward", "true"]),
        Case("optimizer_in_backward 'yes please'", [*SYNTH, "--train.optimizer_in_backward", "yes please"]),
        Case("valid: optimizer_in_backward with accumulation",
             [*SYNTH, "--train.optimizer_in_backward", "true", "--train.grad_clip", "0",
              "--train.global_batch_size", "4"], valid=True),
        Case("optimizer_in_backward with a static loss scale",
             [*SYNTH, "--train.optimizer_in_backward", "true", "--train.grad_clip", "0", "--train.loss_scale", "128"]),
        Case("optimizer_in_backward with bf16 weights",
             [*SYNTH, "--train.optimizer_in_backward", "true", "--train.grad_clip", "0", "--train.weights", "bf16",
              "--execution.precision", "bf16"]),
        # ---- pipeline placement
        Case("hidden_layers_per_stage not summing", [*SYNTH, "--execution.pipeline_stages", "2",
                                                     "--execution.hidden_layers_per_stage", "1,3"]),
        Case("hidden_layers_per_stage with 1 stage", [*SYNTH, "--execution.hidden_layers_per_stage", "1,1"]),
        Case("hidden_layers_per_stage 'abc'", [*SYNTH, "--execution.hidden_layers_per_stage", "abc"]),
        Case("hidden_layers_per_stage negative", [*SYNTH, "--execution.pipeline_stages", "2",
                                                  "--execution.hidden_layers_per_stage", "-1,3"]),
        Case("hidden_layers_per_stage wrong length", [*SYNTH, "--execution.pipeline_stages", "2",
                                                      "--execution.hidden_layers_per_stage", "1,1,0"]),
        Case("embeddings_placement 'nowhere'", [*SYNTH, "--execution.embeddings_placement", "nowhere"]),
        Case("embeddings_placement two_ipus with 1 stage", [*SYNTH, "--execution.embeddings_placement", "two_ipus"]),
        # ---- reader threads
        Case("data.reader_threads 0", ["pretrain", "--data.input", str(TFRECORD), "--data.vocab", str(VOCAB),
                                       "--data.reader_threads", "0", *TINY]),
        Case("data.reader_threads -2", [*SYNTH, "--data.reader_threads", "-2"]),
        Case("data.reader_threads 'two'", [*SYNTH, "--data.reader_threads", "two"]),
        # ---- batch-size warm-up, decay shape, dropout, rope
        Case("batch_size_warmup_min_size without tokens", [*SYNTH, "--train.batch_size_warmup_min_size", "1"]),
        Case("batch_size_warmup_tokens without min size", [*SYNTH, "--train.batch_size_warmup_tokens", "1000"]),
        Case("batch_size_warmup_min_size above the batch",
             [*SYNTH, "--train.batch_size_warmup_min_size", "64", "--train.batch_size_warmup_tokens", "1000"]),
        Case("batch_size_warmup_min_size -1", [*SYNTH, "--train.batch_size_warmup_min_size", "-1"]),
        Case("batch_size_warmup_tokens 1.5", [*SYNTH, "--train.batch_size_warmup_min_size", "1",
                                              "--train.batch_size_warmup_tokens", "1.5"]),
        Case("train.decay_shape 'cubic'", [*SYNTH, "--train.decay_shape", "cubic"]),
        Case("train.decay_shape one_minus_sqrt on schedule poly", [*SYNTH, "--train.decay_shape", "one_minus_sqrt"]),
        Case("attention_output_dropout_prob 1.5", [*MODERN, "--model.attention_output_dropout_prob", "1.5"]),
        Case("attention_output_dropout_prob 'abc'", [*MODERN, "--model.attention_output_dropout_prob", "abc"]),
        Case("attention_output_dropout_prob on BERT", [*SYNTH, "--model.attention_output_dropout_prob", "0.1"]),
        Case("rope_scaling_factor 0", [*MODERN, "--model.rope_scaling_factor", "0"]),
        Case("rope_scaling_factor on BERT", [*SYNTH, "--model.rope_scaling_factor", "2"]),
        Case("unknown config key train.lrr", [*SYNTH, "--train.lrr", "1e-3"]),
        Case("config file with an unknown key", ["pretrain", "--config", "{C}/c.yaml", *TINY],
             prep=write("c.yaml", "train:\n  lr: 0.001\n  decay_shapes: linear\n")),
        Case("config file not a mapping", ["pretrain", "--config", "{C}/c.yaml", *TINY], prep=write("c.yaml", "- 1\n")),
        # ---- progress lines
        Case("log.progress_every_s -1", [*SYNTH, "--log.progress_every_s", "-1"]),
        Case("log.progress_every_s 'often'", [*SYNTH, "--log.progress_every_s", "often"]),
        Case("finetune predict --log.progress_every_s -5",
             ["finetune", "predict", "--model", "{C}/none", "--log.progress_every_s", "-5"]),
        # ---- --init from the hub, offline
        Case("squad train --init of a missing id offline", ["squad", "train", "--init", "no-such-org/no-such-bert",
                                                            *sq_files, *SQ],
             prep=write("train.json", squad_json()), env=offline),
        Case("finetune glue --init of a missing id offline", [*glue, "--init", "no-such-org/no-such-bert", *FT],
             env=offline),
        Case("pretrain checkpoint.init of a missing id offline",
             [*SYNTH, "--checkpoint.init", "no-such-org/no-such-bert"], env=offline),
        Case("import hf of a missing id offline", ["import", "hf", "no-such-org/no-such-bert", "{C}/m"], env=offline),
        # ---- tokenizer.json for fine-tuning
        Case("finetune glue with an empty tokenizer.json", [*glue, *hf_run, "--vocab", "{C}/tokenizer.json", *FT],
             prep=write("tokenizer.json", "")),
        Case("finetune glue with a truncated tokenizer.json", [*glue, *hf_run, "--vocab", "{C}/tokenizer.json", *FT],
             prep=chain(copy("bpe.json", "tokenizer.json"), truncate("tokenizer.json"))),
        Case("finetune glue with a tokenizer.json of another vocab size",
             [*glue, *hf_run, "--vocab", "{C}/tokenizer.json", *FT], prep=copy("bpe.json", "tokenizer.json")),
        Case("squad train with an empty tokenizer.json",
             ["squad", "train", *hf_run, "--vocab", "{C}/tokenizer.json", *sq_files, *SQ],
             prep=chain(write("tokenizer.json", "{}"), write("train.json", squad_json()))),
        Case("finetune glue with a tokenizer.json without [MASK]",
             [*glue, *hf_run, "--vocab", "{C}/tokenizer.json", *FT],
             prep=chain(copy("bpe.json", "tokenizer.json"), edit_json("tokenizer.json", drop_mask))),
        # ---- export and its tokenizer
        Case("export without a vocab", ["export", "{C}/run", "{C}/hf"],
             prep=chain(copy("runs/base", "run"), remove("run/checkpoints/step_00000001/vocab.txt"),
                        remove("run/vocab.txt"))),
        Case("export of a synthetic run (no vocab)", ["export", "{C}/runs/s", "{C}/hf"],
             prep=lambda t, c: shutil.copytree(t / "runs" / "synth", c / "runs" / "s")),
        Case("export --vocab of a missing file", ["export", run, "{C}/hf", "--vocab", "{C}/nope.txt"]),
        Case("export --vocab an empty tokenizer.json", ["export", run, "{C}/hf", "--vocab", "{C}/tokenizer.json"],
             prep=write("tokenizer.json", "")),
        Case("export --vocab of another vocab size", ["export", run, "{C}/hf", "--vocab", "{T}/bpe.json"]),
        Case("export into a non-empty directory", ["export", run, "{C}/hf"], prep=write("hf/x.txt", "x")),
        Case("export --format tf2 of a ModernBERT", ["export", "{T}/runs/modern", "{C}/tf2", "--format", "tf2"]),
        # ---- issue 43: a change on resume takes effect or is refused; eval's tokenizer; a vocab not the model's
        Case("pretrain --resume-with-changes --train.lr under the table schedule",
             ["pretrain", "--resume", "{C}/t", "--train.steps", "2", "--resume-with-changes", "--train.lr", "1e-4"],
             prep=copy("runs/table", "t")),
        Case("pretrain --resume-with-changes --model.initializer_range",
             ["pretrain", "--resume", "{C}/s", "--train.steps", "2", "--resume-with-changes",
              "--model.initializer_range", "0.5"], prep=copy("runs/synth", "s")),
        Case("pretrain --resume RUN whose newest checkpoint is damaged",
             ["pretrain", "--resume", "{C}/two", "--train.steps", "3"],
             prep=chain(copy("runs/two", "two"), flip("two/checkpoints/step_00000002/model.safetensors"))),
        Case("eval of records made with another tokenizer",
             ["eval", ckpt, "--data.eval_input", "{T}/bpe/train.tfrecord"]),
        Case("eval --data.vocab of another tokenizer", ["eval", ckpt, "--data.eval_input", str(TFRECORD),
                                                         "--data.vocab", "{T}/bpe.json"]),
        Case("valid: eval --train.eval_batches 1", ["eval", ckpt, "--data.eval_input", str(TFRECORD),
                                                    "--batch-size", "8", "--train.eval_batches", "1"], valid=True),
        Case("finetune ner with a tokenizer.json of another tokenizer",
             ["finetune", "ner", "--data", "{C}/c", *hf_run, "--out", "{C}/out", "--vocab", "{T}/bpe.json", *FT],
             prep=conll("c")),
        Case("squad train with a tokenizer.json of another tokenizer",
             ["squad", "train", *hf_run, "--vocab", "{T}/bpe.json", *sq_files, *SQ, "--squad.doc_stride", "16"],
             prep=write("train.json", squad_json())),
        Case("finetune glue with another tokenizer.json smaller than the table",
             [*glue, "--init", "{T}/padded", "--vocab", "{T}/bpe400.json", *FT]),
        Case("valid: export --vocab its own tokenizer.json, smaller than its table",
             ["export", "{T}/padded", "{C}/hf", "--vocab", "{T}/padded/tokenizer.json"], valid=True),
        Case("export --vocab another tokenizer.json smaller than the table",
             ["export", "{T}/padded", "{C}/hf", "--vocab", "{T}/bpe400.json"]),
        # ---- import hf
        Case("import hf rope_type yarn", ["import", "hf", "{C}/m", "{C}/out"],
             prep=chain(copy("modern_hf", "m"),
                        edit_json("m/config.json", set_key("rope_scaling", {"rope_type": "yarn", "factor": 2.0})))),
        Case("import hf rope_scaling factor -1", ["import", "hf", "{C}/m", "{C}/out"],
             prep=chain(copy("modern_hf", "m"),
                        edit_json("m/config.json", set_key("rope_scaling", {"rope_type": "linear", "factor": -1})))),
        Case("import hf rope_scaling a string", ["import", "hf", "{C}/m", "{C}/out"],
             prep=chain(copy("modern_hf", "m"), edit_json("m/config.json", set_key("rope_scaling", "yarn")))),
        Case("import hf truncated model.safetensors", ["import", "hf", "{C}/m", "{C}/out"],
             prep=chain(copy("hf", "m"), truncate("m/model.safetensors"))),
        Case("import hf model.safetensors of 0 bytes", ["import", "hf", "{C}/m", "{C}/out"],
             prep=chain(copy("hf", "m"), truncate("m/model.safetensors", 0))),
        Case("import hf config.json not JSON", ["import", "hf", "{C}/m", "{C}/out"],
             prep=chain(copy("hf", "m"), write("m/config.json", "{not json"))),
        # no model_type: BERT, as transformers read the old BERT configs
        Case("valid: import hf config.json without model_type", ["import", "hf", "{C}/m", "{C}/out"],
             prep=chain(copy("hf", "m"), edit_json("m/config.json", lambda o: o.pop("model_type", None))), valid=True),
        Case("import hf hidden_size a string", ["import", "hf", "{C}/m", "{C}/out"],
             prep=chain(copy("hf", "m"), edit_json("m/config.json", set_key("hidden_size", "big")))),
        Case("import hf of a missing directory", ["import", "hf", "{C}/nope", "{C}/out"]),
        # ---- data create / vocab with tokenizer.json
        Case("data create with a tokenizer.json without [MASK]",
             ["data", "create", "--input", str(SAMPLE), "--vocab", "{C}/tokenizer.json", "--output", "{C}/o.tfrecord",
              *fast], prep=chain(copy("bpe.json", "tokenizer.json"), edit_json("tokenizer.json", drop_mask))),
        Case("data create with an empty tokenizer.json",
             ["data", "create", "--input", str(SAMPLE), "--vocab", "{C}/tokenizer.json", "--output", "{C}/o.tfrecord",
              *fast], prep=write("tokenizer.json", "")),
        Case("data create with a tokenizer.json '{}'",
             ["data", "create", "--input", str(SAMPLE), "--vocab", "{C}/tokenizer.json", "--output", "{C}/o.tfrecord",
              *fast], prep=write("tokenizer.json", "{}")),
        Case("data create --mode fast with a truncated tokenizer.json",
             ["data", "create", "--input", str(SAMPLE), "--vocab", "{C}/tokenizer.json", "--output", "{C}/o.tfrecord",
              "--mode", "fast", *fast], prep=chain(copy("bpe.json", "tokenizer.json"), truncate("tokenizer.json"))),
        Case("data vocab --vocab-size 0", ["data", "vocab", "--vocab-size", "0", str(SAMPLE), "{C}/v.txt"]),
        Case("data vocab --kind bpe of a missing corpus", ["data", "vocab", "--kind", "bpe", "{C}/nope.txt",
                                                           "{C}/t.json"]),
        # ---- TFRecords and their tokenizer
        Case("pretrain on TFRecords from another tokenizer",
             ["pretrain", "--data.input", "{T}/bpe", "--data.vocab", str(VOCAB), *TINY]),
        Case("pretrain on TFRecords with a corrupt sidecar",
             ["pretrain", "--data.input", "{C}/bpe", "--data.vocab", "{T}/bpe.json", *TINY],
             prep=chain(copy("bpe", "bpe"), write("bpe/train.tfrecord.made-with.json", "{trunc"))),
        Case("pretrain on a truncated TFRecord",
             ["pretrain", "--data.input", "{C}/r.tfrecord", "--data.vocab", str(VOCAB), *TINY, "--train.steps", "30"],
             prep=lambda t, c: (c / "r.tfrecord").write_bytes(TFRECORD.read_bytes()[:5000])),
        Case("pretrain on an empty TFRecord",
             ["pretrain", "--data.input", "{C}/r.tfrecord", "--data.vocab", str(VOCAB), *TINY],
             prep=write("r.tfrecord", b"")),
        Case("pretrain vocab larger than model.vocab_size",
             ["pretrain", "--data.input", str(SAMPLE), "--data.vocab", str(VOCAB), "--model.vocab_size", "100",
              *TINY]),
        # ---- squad
        Case("squad predict on a missing model", ["squad", "predict", "--model", "{C}/nope",
                                                  "--predict-file", "{C}/dev.json", "--out", "{C}/p.json"],
             prep=write("dev.json", squad_json())),
        Case("squad predict on a truncated model", ["squad", "predict", "--model", "{C}/m",
                                                    "--predict-file", "{C}/dev.json", "--out", "{C}/p.json"],
             prep=chain(copy("hf", "m"), truncate("m/model.safetensors"), write("dev.json", squad_json()))),
        Case("squad predict --batch-size 0", ["squad", "predict", "--model", "{T}/hf", "--batch-size", "0",
                                              "--predict-file", "{C}/dev.json", "--out", "{C}/p.json"],
             prep=write("dev.json", squad_json())),
        Case("squad train with a truncated train file", ["squad", "train", *hf_run, *sq_files, *SQ],
             prep=write("train.json", squad_json()[:40])),
        Case("squad train with no questions", ["squad", "train", *hf_run, *sq_files, *SQ],
             prep=write("train.json", json.dumps({"version": "1.1", "data": []}))),
        Case("squad evaluate of a missing predictions file",
             ["squad", "evaluate", str(DATA / "squad" / "dev-v1.1.json"), "{C}/nope.json"]),
        Case("squad train squad.doc_stride 0", ["squad", "train", *hf_run, *sq_files, *SQ, "--squad.doc_stride", "0"],
             prep=write("train.json", squad_json())),
        # ---- finetune
        Case("finetune glue on a missing data dir", ["finetune", "glue", "--task", "mrpc", "--data", "{C}/nope",
                                                     *hf_run, "--out", "{C}/out", *FT]),
        Case("finetune glue on an empty train.tsv", ["finetune", "glue", "--task", "mrpc", "--data", "{C}/g",
                                                     *hf_run, "--out", "{C}/out", *FT],
             prep=chain(write("g/train.tsv", ""), write("g/dev.tsv", ""))),
        Case("finetune glue unknown task", ["finetune", "glue", "--task", "mrpx", "--data", str(MRPC),
                                            *hf_run, "--out", "{C}/out", *FT]),
        Case("finetune glue --init of a truncated model", [*glue, "--init", "{C}/m", *FT],
             prep=chain(copy("hf", "m"), truncate("m/model.safetensors"))),
        Case("finetune predict on a missing model", ["finetune", "predict", "--model", "{C}/nope"]),
        Case("finetune ner on a missing data dir", ["finetune", "ner", "--data", "{C}/nope", *hf_run,
                                                    "--out", "{C}/out", *FT]),
        # ---- eval
        Case("eval on a truncated checkpoint", ["eval", "{C}/ck", "--data.eval_input", str(TFRECORD)],
             prep=chain(copy("runs/base/checkpoints/step_00000001", "ck"), truncate("ck/model.safetensors"))),
        Case("eval on a checkpoint without weights", ["eval", "{C}/ck", "--data.eval_input", str(TFRECORD)],
             prep=chain(copy("runs/base/checkpoints/step_00000001", "ck"), remove("ck/model.safetensors"))),
        Case("eval with a missing eval_input", ["eval", ckpt, "--data.eval_input", "{C}/nope.tfrecord"]),
        Case("eval without eval_input", ["eval", ckpt]),
        Case("eval --batch-size 0", ["eval", ckpt, "--data.eval_input", str(TFRECORD), "--batch-size", "0"]),
        # ---- older paths
        Case("pretrain --data.input missing", ["pretrain", "--data.input", "{C}/nope.txt", *TINY]),
        Case("pretrain --train.lr 'abc'", [*SYNTH, "--train.lr", "abc"]),
        Case("pretrain --config of a missing name", ["pretrain", "--config", "no_such_config"]),
        Case("pretrain --resume of a missing run", [*SYNTH, "--resume", "{C}/nope"]),
        Case("pretrain --data.seq_len 0", [*SYNTH, "--data.seq_len", "0"]),
        Case("pretrain global batch not a multiple", [*SYNTH, "--train.global_batch_size", "3"]),
        Case("pretrain --resume of a run with a truncated checkpoint", [*SYNTH, "--resume", "{C}/run"],
             prep=chain(copy("runs/synth", "run"),
                        truncate("run/checkpoints/step_00000001/model.safetensors"))),
        Case("data create --input missing", ["data", "create", "--input", "{C}/nope.txt", "--vocab", str(VOCAB),
                                             "--output", "{C}/o.tfrecord", *fast]),
        Case("data create --vocab missing", ["data", "create", "--input", str(SAMPLE), "--vocab", "{C}/nope.txt",
                                             "--output", "{C}/o.tfrecord", *fast]),
        Case("data create --seq-len 5", ["data", "create", "--input", str(SAMPLE), "--vocab", str(VOCAB),
                                         "--output", "{C}/o.tfrecord", "--seq-len", "5"]),
        Case("import tf1 of a missing prefix", ["import", "tf1", "{C}/nope/model.ckpt", "{C}/out"]),
        Case("eval of a directory without a checkpoint", ["eval", "{C}", "--data.eval_input", str(TFRECORD)]),
        # ---- a second round: more of the new options, and paths the first round missed
        Case("plan with hidden_layers_per_stage not summing",
             ["plan", "--execution.pipeline_stages", "2", "--execution.hidden_layers_per_stage", "1,3"]),
        Case("pipeline_stages 2 without torchrun", [*SYNTH, "--execution.pipeline_stages", "2"]),
        Case("reader_threads 2 with prefetch 0", ["pretrain", "--data.input", str(TFRECORD), "--data.vocab", str(VOCAB),
                                                  "--data.reader_threads", "2", "--data.prefetch", "0", *TINY]),
        Case("batch-size warm-up with optimizer_in_backward",
             [*SYNTH, "--train.batch_size_warmup_min_size", "2", "--train.batch_size_warmup_tokens", "100",
              "--train.optimizer_in_backward", "true", "--train.grad_clip", "0", "--train.global_batch_size", "4"],
             valid=True),
        Case("bf16 weights with sgd", [*SYNTH, "--train.weights", "bf16", "--execution.precision", "bf16",
                                       "--train.optimizer", "sgd"]),
        Case("train.lr_table not a table", [*SYNTH, "--train.schedule", "table", "--train.lr_table", "abc"]),
        Case("export --format tf1 of a ModernBERT", ["export", "{T}/runs/modern", "{C}/tf1", "--format", "tf1"]),
        Case("import hf num_attention_heads not dividing hidden_size", ["import", "hf", "{C}/m", "{C}/out"],
             prep=chain(copy("hf", "m"), edit_json("m/config.json", set_key("num_attention_heads", 3)))),
        Case("eval of an hf dir with rope_type yarn", ["eval", "{C}/m", "--data.eval_input", str(TFRECORD)],
             prep=chain(copy("modern_hf", "m"),
                        edit_json("m/config.json", set_key("rope_scaling", {"rope_type": "yarn", "factor": 2.0})))),
        Case("squad train with a tokenizer.json without [MASK]",
             ["squad", "train", *hf_run, "--vocab", "{C}/tokenizer.json", *sq_files, *SQ],
             prep=chain(copy("bpe.json", "tokenizer.json"), edit_json("tokenizer.json", drop_mask),
                        write("train.json", squad_json()))),
        Case("pretrain checkpoint.init of a truncated hf dir", [*SYNTH, "--checkpoint.init", "{C}/m"],
             prep=chain(copy("hf", "m"), truncate("m/model.safetensors"))),
        Case("pretrain --data.input a directory without records", ["pretrain", "--data.input", "{C}/empty",
                                                                   "--data.vocab", str(VOCAB), *TINY],
             prep=lambda t, c: (c / "empty").mkdir()),
        Case("report of a missing run", ["report", "{C}/nope", "--out", "{C}/rep"]),
        Case("bench pretrain --batch-size 0", ["bench", "pretrain", "--config", "tiny", "--batch-size", "0",
                                               "--steps", "1"]),
        Case("finetune glue --lr abc", [*glue, *hf_run, "--lr", "abc", *FT]),
        Case("squad predict --null-threshold abc", ["squad", "predict", "--model", "{T}/hf", "--null-threshold", "x",
                                                    "--predict-file", "{C}/dev.json", "--out", "{C}/p.json"],
             prep=write("dev.json", squad_json())),
    ]
    return c


# A BERT-tiny whose embedding table is 3 rows larger than its tokenizer.json (bpe.json), as tables are
# rounded up: our model directory, the tokenizer beside the weights.
PADDED = """
import sys
from pathlib import Path
from bertforge.config import MODEL_PRESETS, ModelConfig
from bertforge.data.vocab import load_vocab
from bertforge.formats.weights import write_model_dir
from bertforge.models.bert import BertForPreTraining
t = Path(sys.argv[1])
cfg = ModelConfig(**{**MODEL_PRESETS["tiny"], "vocab_size": load_vocab(t / "bpe.json").size + 3})
write_model_dir(BertForPreTraining(cfg), cfg, t / "padded", t / "bpe.json")
"""


def setup(t: Path, env: dict[str, str], timeout: float) -> None:
    """The fixtures the cases copy or read; made once."""
    steps = [
        ["pretrain", "--data.input", str(SAMPLE), "--data.vocab", str(VOCAB), "--data.dupe_factor", "1", *TINY,
         "--log.run_dir", f"{t}/runs", "--log.name", "base"],
        [*SYNTH, "--log.run_dir", f"{t}/runs", "--log.name", "synth"],
        [*MODERN, "--log.run_dir", f"{t}/runs", "--log.name", "modern"],
        ["export", f"{t}/runs/base", f"{t}/hf"],
        ["export", f"{t}/runs/modern", f"{t}/modern_hf", "--vocab", str(VOCAB)],
        ["data", "vocab", "--kind", "bpe", "--vocab-size", "500", str(SAMPLE), f"{t}/bpe.json"],
        ["data", "create", "--input", str(SAMPLE), "--vocab", f"{t}/bpe.json", "--output", f"{t}/bpe/train.tfrecord",
         "--seq-len", "32", "--max-predictions", "4", "--dupe-factor", "1"],
        [*SYNTH, "--log.run_dir", f"{t}/runs", "--log.name", "table", "--train.schedule", "table",
         "--train.lr_table", "{0: 0.001}"],
        [*SYNTH, "--log.run_dir", f"{t}/runs", "--log.name", "two", "--train.steps", "2", "--checkpoint.every", "1"],
        ["data", "vocab", "--kind", "bpe", "--vocab-size", "400", str(SAMPLE), f"{t}/bpe400.json"],
        ["-c", PADDED, str(t)],
    ]
    for argv in steps:
        command = argv if argv[0] == "-c" else ["-m", "bertforge", *argv]
        proc = subprocess.run([sys.executable, *command], env=env, capture_output=True, text=True,
                              timeout=timeout, cwd=t)
        if proc.returncode != 0:
            raise SystemExit(f"setup failed: bertforge {' '.join(argv)}\n{proc.stderr[-3000:]}")


def classify(case: Case, rc: int | None, out: str, err: str) -> str:
    text = out + err
    if rc is None:
        return "timeout"
    if "Traceback (most recent call last)" in text:
        return "traceback"
    if case.valid:
        return "ok" if rc == 0 else "failed"
    if rc == 0:
        return "silent"
    lines = [line for line in err.splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    if re.match(r"^(bertforge[\w -]*: )?error: ", last):
        return "one line"
    return "silent"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the counts and the rows as one JSON object last")
    parser.add_argument("--only", nargs="*", default=[], help="run only the cases whose name holds one of these")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds a case may take")
    parser.add_argument("--keep", help="make the fixtures and case directories here and keep them")
    parser.add_argument("--start", type=int, default=0, help="skip the first N cases")
    parser.add_argument("--code", default=str(ROOT), help="the bertforge tree to run (default: this one)")
    args = parser.parse_args()
    if not DATA.is_dir():
        raise SystemExit(f"no data at {DATA} (set BERTFORGE_TEST_DATA)")
    tmp = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bad-inputs-"))
    tmp.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp / "hf_home"), PYTHONPATH=args.code,
               BERTFORGE_LOG_LEVEL="WARNING")
    fixtures = tmp / "fixtures"
    try:
        if not (fixtures / "bpe" / "train.tfrecord").exists():
            fixtures.mkdir(exist_ok=True)
            started = time.perf_counter()
            setup(fixtures, env, args.timeout)
            print(f"fixtures in {time.perf_counter() - started:.0f} s", file=sys.stderr)
        rows = []
        selected = [c for c in cases() if not args.only or any(s in c.name for s in args.only)]
        for i, case in enumerate(selected):
            if i < args.start:
                continue
            cdir = tmp / f"case{i:03d}"
            shutil.rmtree(cdir, ignore_errors=True)
            cdir.mkdir()
            try:
                if case.prep:
                    case.prep(fixtures, cdir)
            except Exception as e:  # a mistake of this script's, not of bertforge's
                rows.append({"name": case.name, "result": "prep failed", "last_line": repr(e)})
                print(f"prep failed {case.name}: {e!r}", flush=True)
                continue
            argv = [a.replace("{T}", str(fixtures)).replace("{C}", str(cdir)) for a in case.argv]
            if not any(a.startswith("--log.run_dir") for a in argv) and argv[0] == "pretrain":
                argv += ["--log.run_dir", str(cdir / "runs")]
            started = time.perf_counter()
            try:
                proc = subprocess.run([sys.executable, "-m", "bertforge", *argv], env={**env, **case.env},
                                      capture_output=True, text=True, timeout=case.timeout, cwd=cdir)
                rc, out, err = proc.returncode, proc.stdout, proc.stderr
            except subprocess.TimeoutExpired as e:
                rc, out, err = None, str(e.stdout or ""), str(e.stderr or "")
            seconds = time.perf_counter() - started
            kind = classify(case, rc, out, err)
            said = [line for line in err.splitlines() if line.strip()]
            row = {"name": case.name, "result": kind, "rc": rc, "seconds": round(seconds, 1),
                   "last_line": said[-1] if said else "", "argv": ["bertforge", *argv]}
            rows.append(row)
            print(f"{kind:10s} {seconds:5.1f}s  {case.name}  | {row['last_line'][:160]}", flush=True)
        counts = Counter(r["result"] for r in rows)
        kinds = ("one line", "traceback", "silent", "ok", "failed", "timeout", "prep failed")
        print("counts: " + ", ".join(f"{k} {counts[k]}" for k in kinds if counts[k]))
        if args.json:
            print(json.dumps({"counts": {k: counts[k] for k in kinds}, "cases": rows}))
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
