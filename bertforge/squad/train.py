"""SQuAD v1.1 fine-tuning and inference, as google-research/bert's ``run_squad.py`` does it.

    cfg, squad_cfg = load_squad_config("squad_base", [("train.lr", "5e-5")])
    summary = finetune(cfg, squad_cfg, init="minilm/", train_file="train-v1.1.json",
                       out_dir="runs/squad", predict_file="dev-v1.1.json")

The loss is the mean of the start and end cross-entropies; the optimizer is
AdamW (``train.bias_correction`` on or off) with warm-up then linear decay;
one optimizer step consumes ``global_batch_size / micro_batch_size``
micro-batches of features, and each epoch is a seeded permutation of the
features with the last partial global batch dropped (the reference's
``drop_remainder=True``).

The squad-specific knobs live in :class:`SquadConfig`, read from a ``squad:``
section of the YAML config and from ``--squad.*`` overrides; the sequence
length is ``data.seq_len`` and lower-casing ``data.lowercase``.

A fine-tuned model directory holds ``model.safetensors`` (our parameter names,
which are Hugging Face's), ``config.yaml`` (the resolved run config, which
``load_model(dir, head="qa")`` reads), ``config.json`` (only so that
``transformers.BertForQuestionAnswering.from_pretrained(dir)`` loads it as it
is), ``squad.yaml`` and ``vocab.txt``.

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
from ..data.tokenizer import load_tokenizer, vocab_size_of
from ..dist import resolve_device
from ..fileio import atomic_directory
from ..model import BertForQuestionAnswering
from ..train import StepContext, apply_gradients, autocast
from .data import (
    SquadError,
    SquadExample,
    SquadFeatures,
    convert_examples_to_features,
    read_examples,
)
from .postprocess import MAX_ANSWER_LENGTH, N_BEST_SIZE, postprocess, write_predictions

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
    if seq_len < squad.max_query_length + 4:
        raise ConfigError(f"data.seq_len={seq_len} leaves no room for the context after "
                          f"squad.max_query_length={squad.max_query_length}")


def load_squad_config(name: str | None = None, overrides: Sequence[tuple[str, Any]] = ()
                      ) -> tuple[Config, SquadConfig]:
    """Defaults, then a YAML config (``squad_base`` when None), then dotted overrides.

    ``squad.*`` keys go to the :class:`SquadConfig`; all others to the Config.
    """
    cfg, squad = Config(), SquadConfig()
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
    if not (path / "config.json").is_file() and not (path / "model.safetensors").is_file():
        from ..checkpoint import find_checkpoint  # a run directory: its newest step
        try:
            candidates.insert(0, find_checkpoint(path) / "vocab.txt")
        except ValueError:
            pass
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise SquadError(f"{path}: no vocab.txt beside the model; pass --vocab")


def load_qa_model(path: str | Path, vocab: Path) -> BertForQuestionAnswering:
    """``load_model(path, head="qa")``, checked against the vocab (eval mode, CPU)."""
    from ..checkpoint import load_model

    if not Path(path).exists():
        raise SquadError(f"model not found: {path}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a new QA head is expected when fine-tuning an encoder
        model = load_model(path, head="qa")
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


def save_model(model: BertForQuestionAnswering, out_dir: Path, cfg: Config, squad: SquadConfig,
               vocab: Path) -> Path:
    """A fine-tuned model directory, written atomically (see the module docstring)."""
    from ..checkpoint import save_weights
    from ..convert import hf_config_from_model_config

    with atomic_directory(out_dir) as tmp:
        save_weights(model, tmp / "model.safetensors")
        hf = hf_config_from_model_config(model.config, ["BertForQuestionAnswering"])
        hf["dtype"] = "float32"
        (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n", encoding="utf-8")
        (tmp / "config.yaml").write_text(cfg.to_yaml(), encoding="utf-8")
        (tmp / "squad.yaml").write_text(yaml.safe_dump(dataclasses.asdict(squad), sort_keys=False),
                                        encoding="utf-8")
        shutil.copyfile(vocab, tmp / "vocab.txt")
    return out_dir


# ------------------------------------------------------------------ loss and inference


def qa_loss(start_logits: torch.Tensor, end_logits: torch.Tensor, start_positions: torch.Tensor,
            end_positions: torch.Tensor) -> torch.Tensor:
    """run_squad's loss: the mean of the start and end cross-entropies over the batch."""
    start = F.cross_entropy(start_logits.float(), start_positions)
    end = F.cross_entropy(end_logits.float(), end_positions)
    return (start + end) / 2


def qa_train_step(ctx: StepContext, micro_batches: Sequence[dict[str, torch.Tensor]]) -> torch.Tensor:
    """Forward and backward over the micro-batches, then one optimizer step.

    Returns the step's loss (the mean over the micro-batches) as a tensor, so
    the caller decides when to wait for the device.
    """
    step_loss = torch.zeros((), device=ctx.device)
    for batch in micro_batches:
        with autocast(ctx.device, ctx.precision):
            start, end = ctx.model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
        loss = qa_loss(start, end, batch["start_positions"], batch["end_positions"]) / len(micro_batches)
        (ctx.scaler.scale(loss) if ctx.scaler is not None else loss).backward()
        step_loss += loss.detach()
    apply_gradients(ctx)
    return step_loss


def _batch(features: SquadFeatures, rows: Any, device: torch.device, width: int | None = None
           ) -> dict[str, torch.Tensor]:
    """Rows of the features as tensors; only the first ``width`` positions when given."""
    columns = slice(None, width)
    batch = {"input_ids": torch.from_numpy(features.input_ids[rows, columns]),
             "token_type_ids": torch.from_numpy(features.segment_ids[rows, columns]),
             "attention_mask": torch.from_numpy(features.input_mask[rows, columns])}
    if features.start_positions is not None:
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
            precision: str = "fp32") -> tuple[dict[str, str], dict[str, list[dict[str, Any]]]]:
    """Predictions and n-best lists for ``examples``: features, logits, post-processing."""
    features = convert_examples_to_features(examples, tokenizer, seq_len, squad.doc_stride,
                                            squad.max_query_length)
    start, end = predict_logits(model, features, squad.predict_batch_size, device, precision,
                                squad.trim_padding)
    return postprocess(examples, features, start, end, squad.n_best_size, squad.max_answer_length,
                       do_lower_case=lowercase)


# ------------------------------------------------------------------ fine-tuning


def training_features(cfg: Config, squad: SquadConfig, train_file: str | Path, tokenizer: Any
                      ) -> tuple[SquadFeatures, int, int]:
    """(features, questions used, answers skipped) of the training file."""
    examples, skipped = read_examples(train_file, is_training=True)
    if squad.max_questions > 0:
        examples = examples[:squad.max_questions]
    if not examples:
        raise SquadError(f"{train_file}: no training questions")
    features = convert_examples_to_features(examples, tokenizer, cfg.data.seq_len, squad.doc_stride,
                                            squad.max_query_length, is_training=True)
    return features, len(examples), len(skipped)


def finetune(cfg: Config, squad: SquadConfig, init: str | Path, train_file: str | Path,
             out_dir: str | Path | None = None, predict_file: str | Path | None = None,
             vocab: str | Path | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Fine-tune ``init`` on ``train_file``; save to ``out_dir``; predict and score ``predict_file``.

    Returns a summary: out_dir, questions, features, steps, losses (one per
    optimizer step), minutes, and when predicting the predictions path and
    exact_match / f1.
    """
    started = time.perf_counter()
    if cfg.execution.threads > 0:
        torch.set_num_threads(cfg.execution.threads)
    device = resolve_device(cfg.execution.device)
    vocab_path = find_vocab(init, vocab)
    model = load_qa_model(init, vocab_path)
    # The saved config describes what actually ran.
    cfg.model = dataclasses.replace(model.config)
    cfg.data.vocab = str(Path(vocab_path).resolve())
    cfg.checkpoint.init = str(init)
    validate(cfg)
    tokenizer = load_tokenizer(vocab_path, cfg.data.lowercase)
    features, questions, skipped = training_features(cfg, squad, train_file, tokenizer)

    t = cfg.train
    accumulation = accumulation_steps(t, world_size=1)
    steps_per_epoch = len(features) // t.global_batch_size
    if steps_per_epoch == 0:
        raise ConfigError(f"{train_file} gives {len(features)} training features, fewer than "
                          f"train.global_batch_size={t.global_batch_size}")
    epochs = t.epochs if t.epochs > 0 else math.ceil(t.steps / steps_per_epoch)
    total = epochs * steps_per_epoch if t.epochs > 0 else t.steps

    from ..optim import build_optimizer, build_scheduler

    torch.manual_seed(t.seed)
    model.to(device).train()
    optimizer = build_optimizer(model, t)
    scheduler = build_scheduler(optimizer, t, total)
    scaler = torch.amp.GradScaler(device.type) if cfg.execution.precision == "fp16" else None
    ctx = StepContext(model, optimizer, scheduler, device, cfg.execution.precision, t.grad_clip, scaler)
    out_dir = Path(out_dir) if out_dir else (
        Path(cfg.log.run_dir) / (cfg.log.name or datetime.now().strftime("squad-%Y%m%d-%H%M%S")))
    log(f"fine-tuning {init} on {questions} questions ({len(features)} features, {skipped} answers "
        f"skipped) for {total} steps of {t.global_batch_size} (accumulation {accumulation}) on {device}")

    losses: list[float] = []
    step = 0
    for epoch in range(epochs):
        generator = torch.Generator().manual_seed(t.seed * 1_000_003 + epoch)
        order = torch.randperm(len(features), generator=generator).numpy()
        for k in range(steps_per_epoch):
            if step == total:
                break
            rows = order[k * t.global_batch_size:(k + 1) * t.global_batch_size]
            micro_batches = [_batch(features, np.sort(micro), device) for micro in np.split(rows, accumulation)]
            step_loss = qa_train_step(ctx, micro_batches)
            step += 1
            losses.append(step_loss.item())
            if cfg.log.every > 0 and (step % cfg.log.every == 0 or step == total):
                log(f"step {step}/{total} epoch {epoch + 1} loss {losses[-1]:.4f} "
                    f"lr {scheduler.get_last_lr()[0]:.3g}")
        if step == total:
            break

    model.eval().cpu()
    save_model(model, out_dir, cfg, squad, Path(vocab_path))
    summary: dict[str, Any] = {"out_dir": str(out_dir), "questions": questions,
                               "features": len(features), "skipped": skipped, "steps": step,
                               "losses": losses}
    if predict_file:
        from .data import load_json, parse_examples
        from .metric import evaluate

        dataset = load_json(predict_file)
        examples, _ = parse_examples(dataset, source=str(predict_file))
        predictions, nbest = predict(model.to(device), examples, tokenizer, cfg.data.seq_len, squad,
                                     cfg.data.lowercase, device, cfg.execution.precision)
        write_predictions(predictions, out_dir / "predictions.json", nbest,
                          out_dir / "nbest_predictions.json")
        summary["predictions"] = str(out_dir / "predictions.json")
        summary.update(evaluate(dataset, predictions))
    summary["minutes"] = (time.perf_counter() - started) / 60
    return summary
