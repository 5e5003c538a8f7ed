"""SQuAD v1.1 and v2.0 fine-tuning and inference, as google-research/bert's ``run_squad.py`` does it.

    cfg, squad_cfg = load_squad_config("squad_base", [("train.lr", "5e-5")])
    summary = finetune(cfg, squad_cfg, init="minilm/", train_file="train-v1.1.json",
                       out_dir="runs/squad", predict_file="dev-v1.1.json")

The loss is the mean of the start and end cross-entropies; the optimizer is
AdamW (``train.bias_correction`` on or off) with warm-up then linear decay.
Steps run through the training engine (:mod:`bertforge.engine`), as
pre-training does: one optimizer step consumes ``global_batch_size``
features in micro-batches, split over the ranks under torchrun, from a
seeded permutation of the features per epoch (the last partial micro-batch
dropped, as the reference's ``drop_remainder=True``), with dropout seeded per
micro-batch so that any world size gives the same losses. ``train.epochs``
epochs make ``epochs × (features // global_batch_size)`` steps.

The squad-specific knobs live in :class:`SquadConfig`, read from a ``squad:``
section of the YAML config and from ``--squad.*`` overrides; the sequence
length is ``data.seq_len`` and lower-casing ``data.lowercase``.

The run directory (``--out``) is the fine-tuned model directory too:
``config.yaml`` (the resolved run config, which ``load_model(dir, head="qa")``
reads), ``squad.yaml`` and ``vocab.txt`` from the start, ``metrics.jsonl``,
``checkpoints/step_N/`` (resumed with ``--resume``), and at the end
``model.safetensors`` (our parameter names, which are Hugging Face's),
``config.json`` (only so that
``transformers.BertForQuestionAnswering.from_pretrained(dir)`` loads it as it
is) and, with a predict file, ``predictions.json`` and ``nbest_predictions.json``.

SQuAD v2.0 (``squad.version_2_with_negative``, ``--version 2``): unanswerable
training questions point at [CLS]; prediction adds the null answer, writes
``null_odds.json`` too, and predicts no answer where the null score beats the
best span by more than ``squad.null_score_diff_threshold``
(:mod:`bertforge.squad.postprocess`). The dev set is then scored by the
official v2.0 script's rules (:func:`bertforge.squad.metric.evaluate_v2`)
with the null odds as its ``--na-prob-file`` and its default
``--na-prob-thresh`` 1.0 (the threshold itself when that is higher, so that
the scores are always those of ``predictions.json``): ``exact``, ``f1``,
``HasAns_*``, ``NoAns_*`` and ``best_*``; v1.1 runs log ``exact_match``
and ``f1``.

Prediction sorts the windows by length and cuts each batch to its longest
real sequence (``squad.trim_padding``, on by default): the logits at real
positions are those of the padded batch, since padding is masked out of
attention, and padding positions get :data:`PADDING_LOGIT` instead of a
computed logit. That differs from ``run_squad.py`` in one respect: there the
``n_best_size`` highest logits of a window are taken over all positions, so a
padding position with a high logit can take a place among them (and is then
discarded as outside the context). A fine-tuned model scores padding far below
real tokens (the training softmax includes it), so the answers are the same;
an untrained head does not. ``--squad.trim_padding false`` computes every
position, exactly as the reference.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import shutil
import time
import typing
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import yaml
from torch import nn

from .. import checkpoint as ckpt
from .. import runs, tf1, weights
from ..config import (
    Config,
    ConfigError,
    _coerce,
    accumulation_steps,
    apply_dict,
    load_yaml,
    resolve_config_path,
    set_value,
    validate,
)
from ..data.checksum import fingerprint
from ..data.tokenizer import load_tokenizer, vocab_size_of
from ..dist import (
    DistContext,
    barrier,
    check_execution,
    destroy_distributed,
    from_main,
    init_distributed,
    is_sharded,
    prepare_model,
    unwrap,
    write_error,
)
from ..engine import BatchStream, Engine, Preemption, autocast, set_threads
from ..fileio import atomic_file
from ..log import MetricsLogger, ProgressBar, Throughput
from ..model import BertForQuestionAnswering
from ..optim import build_optimizer, build_scheduler
from ..profile import RunMonitor
from .data import (
    SquadError,
    SquadExample,
    SquadFeatures,
    convert_examples_to_features,
    read_examples,
)
from .metric import format_scores
from .postprocess import (
    MAX_ANSWER_LENGTH,
    N_BEST_SIZE,
    SquadPredictions,
    postprocess,
    write_predictions,
)

DEFAULT_CONFIG = "squad_base"
# Logit of a padding position that was not computed: below any computed logit.
PADDING_LOGIT = float(np.finfo(np.float32).min)


@dataclass
class SquadConfig:
    """SQuAD knobs that have no place in :class:`bertforge.config.Config`."""

    doc_stride: int = 128
    max_query_length: int = 64
    n_best_size: int = N_BEST_SIZE
    max_answer_length: int = MAX_ANSWER_LENGTH
    predict_batch_size: int = 32
    max_questions: int = 0  # > 0: use only the first this many training questions
    trim_padding: bool = True  # predict only real positions (see the module docstring)
    train_file: str = ""  # the training JSON (saved, so that --resume needs no other argument)
    predict_file: str = ""  # the JSON to predict and score after training (and every train.eval_every steps)
    version_2_with_negative: bool = False  # SQuAD v2.0: unanswerable questions (run_squad's flag)
    null_score_diff_threshold: float = 0.0  # v2.0: predict no answer when null − best span > this


# What changes the training itself (resume refuses a change of these); the
# others only change prediction and are allowed. The training file is checked
# by its fingerprint.
_TRAINING_KEYS = ("doc_stride", "max_query_length", "max_questions", "version_2_with_negative")


def _set_squad(squad: SquadConfig, key: str, value: Any, source: str = "") -> None:
    hints = typing.get_type_hints(SquadConfig)
    names = [f.name for f in dataclasses.fields(SquadConfig)]
    where = f" in {source}" if source else ""
    if key not in names:
        raise ConfigError(f"unknown config key 'squad.{key}'{where} (keys of squad: {', '.join(names)})")
    setattr(squad, key, _coerce(f"squad.{key}", value, hints[key]))


def validate_squad(squad: SquadConfig, seq_len: int) -> None:
    for key in ("doc_stride", "n_best_size", "max_answer_length", "predict_batch_size"):
        if getattr(squad, key) < 1:
            raise ConfigError(f"squad.{key}={getattr(squad, key)} must be at least 1")
    if squad.max_query_length < 0 or squad.max_questions < 0:
        raise ConfigError("squad.max_query_length and squad.max_questions must not be negative")
    if not math.isfinite(squad.null_score_diff_threshold):
        raise ConfigError(f"squad.null_score_diff_threshold={squad.null_score_diff_threshold} "
                          "must be a finite number")
    if seq_len < squad.max_query_length + 4:
        raise ConfigError(f"data.seq_len={seq_len} leaves no room for the context after "
                          f"squad.max_query_length={squad.max_query_length}")


def load_squad_config(name: str | None = None, overrides: Sequence[tuple[str, Any]] = (),
                      resume: str | Path | None = None) -> tuple[Config, SquadConfig]:
    """Defaults, then a YAML config, then dotted overrides.

    The YAML is ``name``, else (with ``resume``) the resumed run's own
    ``config.yaml`` and ``squad.yaml``, else ``squad_base``. ``squad.*`` keys
    go to the :class:`SquadConfig`; all others to the Config.
    """
    cfg, squad = Config(), SquadConfig()
    path: Path | None
    if name is None and resume and resume != runs.AUTO:  # auto: the launch command's config
        checkpoint = runs.find_checkpoint(resume)
        path = checkpoint / "config.yaml"
        data = dict(load_yaml(path) or {})
        squad_file = checkpoint.parent.parent / "squad.yaml"
        if squad_file.is_file():
            data["squad"] = load_yaml(squad_file)
    else:
        path = resolve_config_path(name or DEFAULT_CONFIG)
        if path is None:
            raise ConfigError(f"config {name!r} is a model preset; a SQuAD run takes its model from --init")
        data = load_yaml(path)
    if not isinstance(data, dict):
        raise ConfigError(f"config in {path}: expected a mapping of sections, got {data!r}")
    data = dict(data)
    body = data.pop("squad", None) or {}
    if not isinstance(body, dict):
        raise ConfigError(f"squad in {path}: expected a mapping, got {body!r}")
    apply_dict(cfg, data, source=str(path))
    for key, value in body.items():
        _set_squad(squad, key, value, str(path))
    for key, value in overrides:
        if key.startswith("squad."):
            _set_squad(squad, key[len("squad."):], value)
        else:
            set_value(cfg, key, value)
    validate(cfg)
    validate_squad(squad, cfg.data.seq_len)
    return cfg, squad


# ------------------------------------------------------------------ models and vocabs


def find_vocab(model_path: str | Path, vocab: str | Path | None = None) -> Path:
    """``vocab`` if given, else ``vocab.txt`` beside the weights; an error naming both when neither exists."""
    if vocab:
        vocab = Path(vocab)
        if not vocab.is_file():
            raise SquadError(f"vocab not found: {vocab}")
        return vocab
    path = Path(model_path)
    candidates = [path / "vocab.txt"]
    prefix = tf1.find_prefix(path)
    if prefix is not None:  # a TF1 checkpoint: its vocab sits beside it, or one directory up (MLPerf's layout)
        candidates = [prefix.parent / "vocab.txt", prefix.parent.parent / "vocab.txt"]
    elif not (path / "config.json").is_file() and not (path / "model.safetensors").is_file():
        try:
            candidates.insert(0, runs.find_checkpoint(path) / "vocab.txt")
        except ValueError:
            pass
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise SquadError(f"{path}: no vocab.txt beside the model; pass --vocab")


def load_qa_model(path: str | Path, vocab: Path) -> BertForQuestionAnswering:
    """``load_model(path, head="qa")``, checked against the vocab (eval mode, CPU)."""
    if not Path(path).exists() and tf1.find_prefix(path) is None:
        raise SquadError(f"model not found: {path}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a new QA head is expected when fine-tuning an encoder
        model = weights.load_model(path, head="qa")
    assert isinstance(model, BertForQuestionAnswering)  # what head="qa" loads
    size = vocab_size_of(vocab)
    if size != model.config.vocab_size:
        raise SquadError(f"{vocab} has {size} tokens but the model at {path} has "
                         f"vocab_size={model.config.vocab_size}: not its vocab")
    return model


def saved_settings(model_path: str | Path) -> tuple[bool, SquadConfig, int | None]:
    """(lowercase, SquadConfig, seq_len) saved with a fine-tuned model; defaults otherwise."""
    path = Path(model_path)
    squad, lowercase, seq_len = SquadConfig(), True, None
    if (path / "squad.yaml").is_file():
        for key, value in (load_yaml(path / "squad.yaml") or {}).items():
            _set_squad(squad, key, value, str(path / "squad.yaml"))
    if (path / "config.yaml").is_file():
        data = load_yaml(path / "config.yaml") or {}
        section = data.get("data") if isinstance(data, dict) else None
        if isinstance(section, dict):
            lowercase = bool(section.get("lowercase", True))
            seq_len = section.get("seq_len")
    return lowercase, squad, seq_len if isinstance(seq_len, int) else None


def write_run_files(out_dir: Path, cfg: Config, squad: SquadConfig, vocab: Path) -> None:
    """The settings of a fine-tuning run, written when it starts: config.yaml, squad.yaml, vocab.txt."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with atomic_file(out_dir / "config.yaml") as tmp:
        tmp.write_text(cfg.to_yaml(), encoding="utf-8")
    with atomic_file(out_dir / "squad.yaml") as tmp:
        tmp.write_text(yaml.safe_dump(dataclasses.asdict(squad), sort_keys=False), encoding="utf-8")
    if Path(vocab).resolve() != (out_dir / "vocab.txt").resolve():
        with atomic_file(out_dir / "vocab.txt") as tmp:
            shutil.copyfile(vocab, tmp)


def save_model(model: BertForQuestionAnswering, out_dir: Path) -> Path:
    """The fine-tuned weights beside the run files (see the module docstring).

    ``model.safetensors`` is written last, each file atomically: a directory
    holds a whole model, or none (``load_model`` then reads its newest step).
    """
    from ..weights import hf_config_from_model_config

    hf = hf_config_from_model_config(model.config, ["BertForQuestionAnswering"])
    hf["dtype"] = "float32"
    with atomic_file(out_dir / "config.json") as tmp:
        tmp.write_text(json.dumps(hf, indent=2) + "\n", encoding="utf-8")
    with atomic_file(out_dir / "model.safetensors") as tmp:
        weights.save_weights(model, tmp)
    return out_dir


# ------------------------------------------------------------------ loss and inference


def qa_loss(start_logits: torch.Tensor, end_logits: torch.Tensor, start_positions: torch.Tensor,
            end_positions: torch.Tensor) -> torch.Tensor:
    """run_squad's loss: the mean of the start and end cross-entropies over the batch."""
    start = F.cross_entropy(start_logits.float(), start_positions)
    end = F.cross_entropy(end_logits.float(), end_positions)
    return (start + end) / 2


def qa_forward_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The engine's loss function for SQuAD: one batch of windows with their answer spans."""
    start, end = model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
    return {"loss": qa_loss(start, end, batch["start_positions"], batch["end_positions"])}


def _batch(features: SquadFeatures, rows: Any, device: torch.device, width: int | None = None
           ) -> dict[str, torch.Tensor]:
    """Rows of the features as tensors; only the first ``width`` positions when given."""
    columns = slice(None, width)
    batch = {"input_ids": torch.from_numpy(features.input_ids[rows, columns]),
             "token_type_ids": torch.from_numpy(features.segment_ids[rows, columns]),
             "attention_mask": torch.from_numpy(features.input_mask[rows, columns])}
    if features.start_positions is not None:
        assert features.end_positions is not None  # training features have both
        batch["start_positions"] = torch.from_numpy(features.start_positions[rows])
        batch["end_positions"] = torch.from_numpy(features.end_positions[rows])
    return {k: v.to(device) for k, v in batch.items()}


@torch.inference_mode()
def predict_logits(model: nn.Module, features: SquadFeatures, batch_size: int = 32,
                   device: torch.device | str = "cpu", precision: str = "fp32",
                   trim_padding: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(start, end) logits, float32 arrays of shape (len(features), seq_len), in eval mode.

    With ``trim_padding`` the features are batched longest first, each batch
    is cut to its longest real sequence, and padding positions hold
    :data:`PADDING_LOGIT`; rows come back in the features' order either way.
    """
    device = torch.device(device)
    was_training = model.training
    model.eval()
    count, width = features.input_ids.shape
    start_logits = np.full((count, width), PADDING_LOGIT, np.float32)
    end_logits = np.full((count, width), PADDING_LOGIT, np.float32)
    # Real tokens come first in every window (run_squad pads at the end).
    lengths = features.input_mask.sum(axis=1)
    order = np.argsort(-lengths, kind="stable") if trim_padding else np.arange(count)
    for first in range(0, count, batch_size):
        rows = order[first:first + batch_size]
        used = int(lengths[rows].max()) if trim_padding else width
        batch = _batch(features, rows, device, used)
        with autocast(device, precision):
            start, end = model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
        start_logits[rows, :used] = start.float().cpu().numpy()
        end_logits[rows, :used] = end.float().cpu().numpy()
    if trim_padding:  # the padding of windows shorter than their batch's longest, too
        padding = features.input_mask == 0
        start_logits[padding] = end_logits[padding] = PADDING_LOGIT
    model.train(was_training)
    return start_logits, end_logits


def predict(model: nn.Module, examples: list[SquadExample], tokenizer: Any, seq_len: int,
            squad: SquadConfig, lowercase: bool = True, device: torch.device | str = "cpu",
            precision: str = "fp32") -> SquadPredictions:
    """Predictions and n-best lists for ``examples`` (and with SQuAD v2.0 the null odds, as
    ``.null_odds``): features, logits, post-processing."""
    features = convert_examples_to_features(examples, tokenizer, seq_len, squad.doc_stride,
                                            squad.max_query_length)
    start, end = predict_logits(model, features, squad.predict_batch_size, device, precision,
                                squad.trim_padding)
    return postprocess(examples, features, start, end, squad.n_best_size, squad.max_answer_length,
                       do_lower_case=lowercase, version_2_with_negative=squad.version_2_with_negative,
                       null_score_diff_threshold=squad.null_score_diff_threshold)


def score_predictions(dev_set: Any, result: SquadPredictions, squad: SquadConfig) -> dict[str, float]:
    """The dev-set scores of a prediction: v1.1 ``exact_match``/``f1``, v2.0 the official
    v2.0 scores with the null odds (see the module docstring)."""
    from .metric import evaluate, evaluate_v2

    if not squad.version_2_with_negative:
        return evaluate(dev_set, result.predictions)
    return evaluate_v2(dev_set, result.predictions, result.null_odds,
                       max(1.0, squad.null_score_diff_threshold))


# ------------------------------------------------------------------ fine-tuning


def training_features(cfg: Config, squad: SquadConfig, train_file: str | Path, tokenizer: Any
                      ) -> tuple[SquadFeatures, int, int]:
    """(features, questions used, answers skipped) of the training file."""
    examples, skipped = read_examples(train_file, is_training=True,
                                      version_2_with_negative=squad.version_2_with_negative)
    if squad.max_questions > 0:
        examples = examples[:squad.max_questions]
    if not examples:
        raise SquadError(f"{train_file}: no training questions")
    features = convert_examples_to_features(examples, tokenizer, cfg.data.seq_len, squad.doc_stride,
                                            squad.max_query_length, is_training=True)
    return features, len(examples), len(skipped)


class FeatureBatches:
    """Training features as the engine's batches: rows in file order within a batch."""

    def __init__(self, features: SquadFeatures):
        self.features = features

    def __len__(self) -> int:
        return len(self.features.input_ids)

    def batch(self, indices: Any) -> dict[str, torch.Tensor]:
        return _batch(self.features, np.sort(indices), torch.device("cpu"))


def _out_dir(cfg: Config, out_dir: str | Path | None, overwrite: bool = False,
             inputs: Sequence[str | Path | None] = ()) -> Path:
    """The directory of a new run: a new (or empty) one, never someone's files.

    A new one that a run refused for bad input leaves empty is removed again
    (:func:`_new_run_dir`). With ``overwrite``
    (``squad train --out DIR --overwrite``: the user named the directory) the
    files of a non-empty one are removed first, unless it holds one of
    ``inputs`` (the ``--init`` weights, the SQuAD files, the vocab) or the
    current directory.
    """
    path = Path(out_dir) if out_dir else (
        Path(cfg.log.run_dir) / (cfg.log.name or datetime.now().strftime("squad-%Y%m%d-%H%M%S")))
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{path} exists and is not a directory: choose another --out")
    if not path.exists() or all(p.name == runs.LOCK for p in path.iterdir()):  # a lock left by a killed run
        return path
    if not overwrite:
        raise ConfigError(f"{path} already exists and is not empty: pass --resume {path} to continue "
                          f"its run, --overwrite to replace it, or choose another --out")
    root = path.resolve()
    for kept in [Path.cwd(), *(Path(x) for x in inputs if x)]:
        kept = kept.resolve()
        if kept == root or root in kept.parents:
            raise ConfigError(f"--overwrite would delete {kept}, which is in {path}: choose another --out")
    for entry in sorted(path.iterdir()):
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:  # a file, or a link (removed, not what it points to)
            entry.unlink()
    return path


def finetune(cfg: Config, squad: SquadConfig, init: str | Path | None, train_file: str | Path | None,
             out_dir: str | Path | None = None, predict_file: str | Path | None = None,
             vocab: str | Path | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Fine-tune ``init`` on ``train_file`` into ``out_dir``; predict and score ``predict_file``.

    With ``cfg.checkpoint.resume`` (a run or step directory) the run goes on
    from that checkpoint exactly; ``init`` and the files default to the run's.
    Under torchrun every rank calls this (``execution.parallel`` ddp or fsdp).

    Returns a summary: out_dir, questions, features, steps, losses (one per
    optimizer step of this process), minutes, and when predicting the
    predictions path and exact_match / f1.
    """
    started = time.perf_counter()
    set_threads(cfg.execution.threads)
    dist = init_distributed(cfg.execution.device, cfg.execution.dist_timeout)
    try:
        check_execution(cfg.execution, dist.world_size)
        with contextlib.ExitStack() as held:  # rank 0 holds the run directory's lock until the run ends
            resume_from, run_dir = from_main(dist, lambda: _locate_run(cfg, out_dir, held))
            try:
                summary = _finetune(cfg, squad, dist, run_dir, resume_from, init, train_file, predict_file,
                                    vocab, log if dist.is_main else (lambda _: None), started)
                barrier(dist)
                return summary
            except Exception:
                if dist.world_size > 1:  # one process has its traceback on the console
                    write_error(run_dir, dist)
                raise
    finally:
        destroy_distributed()


def _finetune(cfg: Config, squad: SquadConfig, dist: DistContext, out_dir: Path, resume_from: Path | None,
              init: str | Path | None, train_file: str | Path | None, predict_file: str | Path | None,
              vocab: str | Path | None, log: Callable[[str], None], started: float) -> dict[str, Any]:
    """The body of ``finetune`` on one rank, given the run directory."""
    t = cfg.train
    train_file = train_file or squad.train_file
    predict_file = predict_file or squad.predict_file or None
    if not train_file:
        raise ConfigError("squad train needs --train-file")
    torch.manual_seed(t.seed)  # every rank initialises the same QA head
    if resume_from is None:
        if not init:
            raise ConfigError("squad train needs --init (or --resume RUN)")
        vocab_path = find_vocab(init, vocab)
        model = load_qa_model(init, vocab_path)
        cfg.checkpoint.init = str(Path(init).resolve())
    else:  # the weights come from the checkpoint
        vocab_path = find_vocab(out_dir, vocab)
        model = BertForQuestionAnswering(weights.read_config(resume_from).model)
    # The saved config describes what actually runs.
    cfg.model = dataclasses.replace(model.config)
    cfg.data.vocab = str(Path(vocab_path).resolve())
    squad.train_file = str(Path(train_file).resolve())
    squad.predict_file = str(Path(predict_file).resolve()) if predict_file else ""
    validate(cfg)
    tokenizer = load_tokenizer(vocab_path, cfg.data.lowercase)
    features, questions, skipped = training_features(cfg, squad, train_file, tokenizer)

    accumulation = accumulation_steps(t, world_size=dist.world_size)
    steps_per_epoch = len(features) // t.global_batch_size
    if steps_per_epoch == 0:
        raise ConfigError(f"{train_file} gives {len(features)} training features, fewer than "
                          f"train.global_batch_size={t.global_batch_size}")
    total = t.epochs * steps_per_epoch if t.epochs > 0 else t.steps
    saved = ckpt.read_trainer_state(resume_from) if resume_from else None
    data_fingerprint = fingerprint([Path(train_file)])
    if resume_from is not None:
        assert saved is not None  # read above
        saved_cfg, saved_data = weights.read_config(resume_from), saved.get("data_fingerprint")
        from_main(dist, lambda: runs.check_resume(resume_from, saved_cfg, cfg, saved_data, data_fingerprint,
                                                  f"the training file {train_file}"))
        from_main(dist, lambda: check_squad_resume(out_dir, squad, cfg.checkpoint.resume_with_changes))
    stream = BatchStream(FeatureBatches(features), t.micro_batch_size, t.seed, **(saved["data"] if saved else {}),
                         rank=dist.rank, world_size=dist.world_size)
    wrapped = prepare_model(model.train(), cfg.execution, dist)
    optimizer = build_optimizer(unwrap(wrapped), t)
    engine = Engine(wrapped, optimizer, build_scheduler(optimizer, t, total), qa_forward_loss,
                    cfg.execution.precision, t.grad_clip, dist, seed=t.seed)
    step = ckpt.resume(resume_from, engine, verified=True)["step"] if resume_from is not None else 0

    def state() -> dict[str, Any]:  # what a checkpoint adds to the engine's: the data position and fingerprint
        return {"data": stream.state(), "data_fingerprint": data_fingerprint}

    if dist.is_main and resume_from is None:
        write_run_files(out_dir, cfg, squad, Path(vocab_path))
    examples = dev_set = None
    if predict_file:
        from .data import load_json, parse_examples

        dev_set = load_json(predict_file)
        examples, _ = parse_examples(dev_set, source=str(predict_file),
                                     version_2_with_negative=squad.version_2_with_negative)

    ranks = f" × {dist.world_size} ranks ({cfg.execution.parallel})" if dist.world_size > 1 else ""
    log(f"fine-tuning {init or resume_from} on {questions} questions ({len(features)} features, "
        f"{skipped} answers skipped) for {total} steps of {t.global_batch_size} = {t.micro_batch_size} × "
        f"{accumulation}{ranks} on {dist.device}; run directory {out_dir}")

    def score(model_for_eval: nn.Module | None) -> tuple[dict[str, float], SquadPredictions]:
        """Rank 0's predictions of the dev set and their scores (v1.1 EM / F1, or v2.0's)."""
        assert model_for_eval is not None and examples is not None and dev_set is not None  # rank 0, predicting
        result = predict(model_for_eval, examples, tokenizer, cfg.data.seq_len, squad,
                         cfg.data.lowercase, dist.device, cfg.execution.precision)
        return score_predictions(dev_set, result, squad), result

    losses: list[torch.Tensor] = []
    with contextlib.ExitStack() as stack:
        logger = stack.enter_context(MetricsLogger(out_dir, cfg, enabled=dist.is_main, start_step=step))
        engine.preemption = preemption = stack.enter_context(Preemption())
        bar = stack.enter_context(ProgressBar(total, step, enabled=cfg.log.progress, main=dist.is_main,
                                                  label="squad"))
        monitor = stack.enter_context(RunMonitor(cfg, out_dir, dist, logger, bar.print, start_step=step,
                                                 total_steps=total, started=started))

        def run_eval() -> dict[str, float] | None:
            """EM and F1 on the dev set, by rank 0 alone with the whole model; the others wait."""
            if examples is None:
                return None
            whole = full_model(engine.model, cfg, dist)
            with monitor.phase("eval"):
                result = from_main(dist, lambda: score(whole)[0])
            logger.log({"step": step, "split": "eval", **result})
            bar.print(f"step {step}: {format_scores(result)}")
            return result

        throughput = Throughput()
        preempted: Path | None = None  # the checkpoint written when a signal stopped the run
        while step < total:
            lr = engine.lr
            with monitor.step(step):  # memory, step times and the --profile window
                out = engine.step((stream.next() for _ in range(accumulation)), accumulation, step)
            step += 1
            losses.append(out["loss"])
            throughput.add(t.global_batch_size)
            if step % cfg.log.every == 0 or step == total or step == 1:
                values = {k: v.item() for k, v in out.items()}
                seq_per_s = throughput.rate()
                logger.log({"step": step, **values, "lr": lr, "seq_per_s": seq_per_s, "epoch": stream.epoch,
                            **monitor.row()})
                bar.update(step, f"loss {values['loss']:.4f} lr {lr:.3g} {seq_per_s:.1f} seq/s")
                if bar.progress is None:  # no bar: a line per logged step
                    log(f"step {step}/{total} epoch {stream.epoch + 1} loss {values['loss']:.4f} lr {lr:.3g}")
            else:
                bar.update(step)
            if t.eval_every and step % t.eval_every == 0 and step < total:
                run_eval()
            if engine.stop_requested and step < total:  # every rank stops after this same step
                preempted = ckpt.save(out_dir, step, engine, cfg, state())
                bar.print(preemption.message(step, preempted, out_dir))
                break
            if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step < total:
                ckpt.save(out_dir, step, engine, cfg, state())
        final_checkpoint = preempted or ckpt.save(out_dir, step, engine, cfg, state())
        summary: dict[str, Any] = {"out_dir": str(out_dir), "checkpoint": str(final_checkpoint),
                                   "questions": questions, "features": len(features), "skipped": skipped,
                                   "steps": step, "losses": torch.stack(losses).tolist() if losses else [],
                                   "rank": dist.rank, "world_size": dist.world_size,
                                   "preempted": preempted is not None}
        if preempted is not None:  # the model and predictions wait for the run to finish
            summary["minutes"] = (time.perf_counter() - started) / 60
            return summary
        whole = full_model(engine.model, cfg, dist)
        if whole is not None and dist.is_main:
            save_model(whole, out_dir)
        if examples is not None:
            def final_scores() -> dict[str, float]:
                scores, result = score(whole)
                write_predictions(result.predictions, out_dir / "predictions.json", result.nbest,
                                  out_dir / "nbest_predictions.json", result.null_odds,
                                  out_dir / "null_odds.json" if result.null_odds is not None else None)
                return scores

            with monitor.phase("eval"):
                scores = from_main(dist, final_scores)
            logger.log({"step": step, "split": "eval", **scores})
            summary["predictions"] = str(out_dir / "predictions.json")
            summary["scores"] = scores
            summary.update(scores)
    summary["minutes"] = (time.perf_counter() - started) / 60
    return summary


def check_squad_resume(run_dir: Path, squad: SquadConfig, with_changes: bool) -> None:
    """Refuse resuming with SQuAD settings that change the training (``_TRAINING_KEYS``:
    e.g. a v1.1 run resumed as v2.0) unless ``with_changes``; log every change.

    ``runs.check_resume`` compares the run config, which holds no SQuAD settings:
    they are in the run's ``squad.yaml``.
    """
    import logging

    path = run_dir / "squad.yaml"
    if not path.is_file():
        return
    saved = SquadConfig()
    for key, value in (load_yaml(path) or {}).items():
        _set_squad(saved, key, value, str(path))
    changes = [(key, getattr(saved, key), getattr(squad, key)) for key in
               (f.name for f in dataclasses.fields(SquadConfig)) if key not in ("train_file", "predict_file")
               and getattr(saved, key) != getattr(squad, key)]
    breaking = [f"squad.{key}: {old!r} → {new!r}" for key, old, new in changes if key in _TRAINING_KEYS]
    if breaking and not with_changes:
        raise ConfigError(f"resuming {run_dir} with changes that break continuing it exactly: "
                          f"{'; '.join(breaking)}; pass --resume-with-changes to go on with them")
    for key, old, new in changes:
        logging.getLogger(__name__).warning("resuming with a change: squad.%s: %r → %r", key, old, new)


def full_model(model: nn.Module, cfg: Config, dist: DistContext) -> BertForQuestionAnswering | None:
    """The whole model for prediction and saving on rank 0; None on the others under FSDP.

    Under FSDP every rank must take part in gathering the shards, so every
    rank calls this; otherwise it is the model itself, unwrapped.
    """
    inner = unwrap(model)
    if not is_sharded(inner):
        assert isinstance(inner, BertForQuestionAnswering)
        return inner
    state = weights.full_state_dict(inner)
    if not dist.is_main:
        return None
    whole = BertForQuestionAnswering(cfg.model)
    whole.load_state_dict(state)
    return whole.to(dist.device)


def _locate_run(cfg: Config, out_dir: str | Path | None, held: contextlib.ExitStack) -> tuple[Path | None, Path]:
    """(the checkpoint to resume, verified, or None; the run directory), on rank 0.

    ``checkpoint.resume: auto`` resumes the newest sound checkpoint of ``--out``
    when it is a fine-tuning run directory (it has ``squad.yaml``), skipping
    damaged ones with a warning, and starts fresh there otherwise. The run
    directory's lock is taken into ``held`` first (another live run there is an
    error naming it); then the temporaries of interrupted saves are removed.
    """
    resume = cfg.checkpoint.resume
    if resume == runs.AUTO:
        run_dir = Path(out_dir) if out_dir else runs.auto_run_dir(cfg.log.run_dir, cfg.log.name, "--out")
        if (run_dir / "squad.yaml").is_file():  # ours: never take a pre-training run's checkpoints
            held.enter_context(runs.RunLock(run_dir))
            # None: it started before and failed before its first checkpoint; start again there.
            return runs.checkpoint_to_resume(resume, run_dir), run_dir
        return None, _new_run_dir(_out_dir(cfg, run_dir), held)
    if resume:
        run_dir = runs.find_checkpoint(resume).parent.parent
        held.enter_context(runs.RunLock(run_dir))
        resume_from = runs.checkpoint_to_resume(resume)
        assert resume_from is not None  # a named checkpoint, or an error
        return resume_from, run_dir
    return None, _new_run_dir(_out_dir(cfg, out_dir), held)


def _new_run_dir(run_dir: Path, held: contextlib.ExitStack) -> Path:
    """Make ``run_dir`` and take its lock into ``held``. One made here goes again, when ``held``
    closes, if the run wrote nothing into it (refused for bad input, say)."""
    created = not run_dir.exists()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"cannot create the run directory {run_dir}: {err.strerror} (--out)") from None
    if created:
        held.callback(_remove_if_unused, run_dir)  # after the lock is released (an ExitStack unwinds backwards)
    held.enter_context(runs.RunLock(run_dir))
    return run_dir


def _remove_if_unused(run_dir: Path) -> None:
    """Remove a run directory that holds nothing but its lock: a run refused for bad input leaves nothing."""
    if run_dir.is_dir() and {p.name for p in run_dir.iterdir()} <= {runs.LOCK}:
        shutil.rmtree(run_dir, ignore_errors=True)
