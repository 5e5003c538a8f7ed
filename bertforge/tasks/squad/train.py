"""SQuAD v1.1 and v2.0 fine-tuning and inference, as google-research/bert's ``run_squad.py`` does it.

    cfg, squad_cfg = load_squad_config("squad_base", [("train.lr", "5e-5")])
    summary = finetune(cfg, squad_cfg, init="minilm/", train_file="train-v1.1.json",
                       out_dir="runs/squad", predict_file="dev-v1.1.json")

The loss is the mean of the start and end cross-entropies; the optimizer is
AdamW (``train.bias_correction`` on or off) with warm-up then linear decay.
Steps run through the fine-tuning loop that GLUE and NER share (:mod:`bertforge.tasks.finetune.run`)
and the training engine (:mod:`bertforge.training.engine`), as
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
(:mod:`bertforge.tasks.squad.postprocess`). The dev set is then scored by the
official v2.0 script's rules (:func:`bertforge.tasks.squad.metric.evaluate_v2`)
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

import dataclasses
import logging
import math
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from bertforge.config import Config, ConfigError, DataConfig, ModelConfig, use_model, validate
from bertforge.data.fast_tokenizer import task_tokenizer
from bertforge.formats import weights
from bertforge.formats.hf import resolve_model
from bertforge.models.families import model_class
from bertforge.parallel.dist import DistContext, from_main
from bertforge.runs import saved_data_settings
from bertforge.tasks.finetune.run import (
    FeatureRows,
    Job,
    find_vocab,
    forward_in_batches,
    launch,
    load_checked,
    load_config,
    read_section,
    save_finetuned,
    write_run_files,
)
from bertforge.tasks.finetune.run import train as train_job

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

logger = logging.getLogger(__name__)

DEFAULT_CONFIG = "squad_base"
SKIPS_SHOWN = 3  # skipped training questions named in the warning, with why
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
                      resume: str | Path | None = None, out_dir: str | Path | None = None
                      ) -> tuple[Config, SquadConfig]:
    """Defaults, then a YAML config, then dotted overrides.

    The YAML is ``name``, else (with ``resume``, or ``resume: auto`` and a run to
    resume in ``out_dir``) the resumed run's own ``config.yaml`` and
    ``squad.yaml``, else ``squad_base``. ``squad.*`` keys go to the
    :class:`SquadConfig`; all others to the Config.
    """
    squad = SquadConfig()
    cfg = load_config(squad, "squad", DEFAULT_CONFIG, name, overrides, resume, out_dir)
    validate_squad(squad, cfg.data.seq_len)
    return cfg, squad


# ------------------------------------------------------------------ models and vocabs


def load_qa_model(path: str | Path, vocab: Path) -> nn.Module:
    """``load_model(path, head="qa")`` (its family's span model), checked against the vocab (CPU)."""
    return load_checked(path, vocab, "qa")


def saved_settings(model_path: str | Path) -> tuple[bool, SquadConfig, int | None]:
    """(lowercase, SquadConfig, seq_len) saved with a fine-tuned model; defaults otherwise."""
    lowercase, seq_len = saved_data_settings(model_path)
    return lowercase, read_section(SquadConfig(), "squad", Path(model_path)), seq_len


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


def predict_logits(model: nn.Module, features: SquadFeatures, batch_size: int = 32,
                   device: torch.device | str = "cpu", precision: str = "fp32",
                   trim_padding: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(start, end) logits, float32 arrays of shape (len(features), seq_len), in eval mode.

    With ``trim_padding`` the features are batched longest first, each batch
    is cut to its longest real sequence, and padding positions hold
    :data:`PADDING_LOGIT`; rows come back in the features' order either way.
    """
    count, full = features.input_ids.shape
    start_logits = np.full((count, full), PADDING_LOGIT, np.float32)
    end_logits = np.full((count, full), PADDING_LOGIT, np.float32)
    # Real tokens come first in every window (run_squad pads at the end).
    for rows, width, (start, end) in forward_in_batches(model, features, batch_size, device, precision,
                                                        trim_padding):
        start_logits[rows, :width] = start.float().cpu().numpy()
        end_logits[rows, :width] = end.float().cpu().numpy()
    if trim_padding:  # the padding of windows shorter than their batch's longest, too
        padding = features.input_mask == 0
        start_logits[padding] = end_logits[padding] = PADDING_LOGIT
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


def training_features(squad: SquadConfig, seq_len: int, train_file: str | Path, tokenizer: Any
                      ) -> tuple[SquadFeatures, int, int]:
    """(features, questions used, answers skipped) of the training file, in windows of ``seq_len``."""
    examples, skipped = read_examples(train_file, is_training=True,
                                      version_2_with_negative=squad.version_2_with_negative)
    if skipped:
        named = "; ".join(f"question {s.qas_id}: {s.reason}" for s in skipped[:SKIPS_SHOWN])
        more = f"; and {len(skipped) - SKIPS_SHOWN} more" if len(skipped) > SKIPS_SHOWN else ""
        logger.warning("%s: %d of %d training questions skipped, their answer text not at their answer_start (as "
                       "google-research/bert's run_squad.py skips them, \"Could not find answer\"): %s%s",
                       train_file, len(skipped), len(examples) + len(skipped), named, more)
    if squad.max_questions > 0:
        examples = examples[:squad.max_questions]
    if not examples:
        raise SquadError(f"{train_file}: no training questions")
    features = convert_examples_to_features(examples, tokenizer, seq_len, squad.doc_stride,
                                            squad.max_query_length, is_training=True)
    return features, len(examples), len(skipped)


def finetune(cfg: Config, squad: SquadConfig, init: str | Path | None, train_file: str | Path | None,
             out_dir: str | Path | None = None, predict_file: str | Path | None = None,
             vocab: str | Path | None = None, log: Callable[[str], None] = print,
             overwrite: bool = False) -> dict[str, Any]:
    """Fine-tune ``init`` on ``train_file`` into ``out_dir``; predict and score ``predict_file``.

    With ``cfg.checkpoint.resume`` (a run or step directory) the run goes on
    from that checkpoint exactly; ``init`` and the files default to the run's.
    With ``overwrite`` a new run replaces the one in ``out_dir`` (not a live one).
    Under torchrun every rank calls this (``execution.parallel`` ddp or fsdp).

    Returns a summary: out_dir, questions, features, steps, losses (one per
    optimizer step of this process), minutes, and when predicting the
    predictions path and exact_match / f1.

    The job's entry: the whole config is settled here (the model's config, the vocab, the
    weights and files it started from); the parts take its sections.
    """
    def body(dist: DistContext, run_dir: Path, resume_from: Path | None, started: float) -> dict[str, Any]:
        train_path = train_file or squad.train_file
        predict_path = predict_file or squad.predict_file or None
        if not train_path:
            raise ConfigError("squad train needs --train-file")
        torch.manual_seed(cfg.train.seed)  # every rank initialises the same QA head
        model, vocab_path = run_qa_model(init, vocab, run_dir, resume_from)
        if resume_from is None:
            cfg.checkpoint.init = str(resolve_model(typing.cast(str, init)).resolve())  # (checked)
        use_model(cfg, typing.cast(ModelConfig, model.config))
        cfg.data.vocab = str(Path(vocab_path).resolve())
        squad.train_file = str(Path(train_path).resolve())
        squad.predict_file = str(Path(predict_path).resolve()) if predict_path else ""
        validate(cfg)
        tokenizer = task_tokenizer(vocab_path, cfg.data.lowercase)
        features, questions, skipped = training_features(squad, cfg.data.seq_len, train_path, tokenizer)
        if resume_from is not None:
            from_main(dist, lambda: check_squad_resume(run_dir, squad, cfg.checkpoint.resume_with_changes))
        dev = DevScoring.of(predict_path, squad, tokenizer, cfg.data, dist.device, cfg.execution.precision)
        job = Job(kind="squad", model=model, rows=FeatureRows(features, ("start_positions", "end_positions")),
                  loss_fn=qa_forward_loss, data_files=[Path(train_path)],
                  description=f"{questions} questions ({len(features)} features, {skipped} answers skipped)",
                  rebuild=lambda: model_class(cfg.model, "qa")(cfg.model),
                  write_settings=lambda d: write_run_files(d, cfg.to_yaml(), squad, "squad", Path(vocab_path)),
                  save=lambda whole, d: save_finetuned(whole, d),
                  evaluate=dev.scores if dev is not None else None,
                  finish=dev.finish if dev is not None else None, describe=format_scores,
                  counts={"questions": questions, "features": len(features), "skipped": skipped})
        return train_job(cfg, job, dist, run_dir, resume_from, init, log if dist.is_main else (lambda _: None),
                         started)

    return launch(cfg.execution, cfg.log, cfg.checkpoint.resume, out_dir, "squad.yaml", "squad", body, overwrite,
                  (init, train_file, predict_file, vocab))


def run_qa_model(init: str | Path | None, vocab: str | Path | None, run_dir: Path, resume_from: Path | None
             ) -> tuple[nn.Module, Path]:
    """(the QA model, on the CPU, the vocab's path): ``init``'s weights for a new run (its vocab
    beside them unless ``vocab``), else the checkpoint's shape, whose weights the resume loads."""
    if resume_from is None:
        if not init:
            raise ConfigError("squad train needs --init (or --resume RUN)")
        vocab_path = find_vocab(init, vocab)
        return load_qa_model(init, vocab_path), vocab_path
    vocab_path = find_vocab(run_dir, vocab)
    saved = weights.read_config(resume_from).model
    return model_class(saved, "qa")(saved), vocab_path


@dataclass
class DevScoring:
    """Rank 0's predictions of the dev set, scored, during training and at its end."""

    dev_set: Any
    examples: list[SquadExample]
    tokenizer: Any
    squad: SquadConfig
    data: DataConfig  # seq_len and lowercase
    device: torch.device
    precision: str

    @classmethod
    def of(cls, predict_file: str | Path | None, squad: SquadConfig, tokenizer: Any, data: DataConfig,
           device: torch.device, precision: str) -> DevScoring | None:
        """The dev set of ``predict_file``, read now; None without one."""
        if not predict_file:
            return None
        from .data import load_json, parse_examples

        dev_set = load_json(predict_file)
        examples, _ = parse_examples(dev_set, source=str(predict_file),
                                     version_2_with_negative=squad.version_2_with_negative)
        return cls(dev_set, examples, tokenizer, squad, data, device, precision)

    def score(self, whole: nn.Module) -> tuple[dict[str, float], SquadPredictions]:
        """The predictions of the dev set and their scores (v1.1 EM / F1, or v2.0's)."""
        result = predict(whole, self.examples, self.tokenizer, self.data.seq_len, self.squad, self.data.lowercase,
                         self.device, self.precision)
        return score_predictions(self.dev_set, result, self.squad), result

    def scores(self, whole: nn.Module) -> dict[str, float]:
        return self.score(whole)[0]

    def finish(self, whole: nn.Module, run_dir: Path) -> dict[str, Any]:
        """The final predictions written into the run directory, and their scores."""
        scores, result = self.score(whole)
        write_predictions(result.predictions, run_dir / "predictions.json", result.nbest,
                          run_dir / "nbest_predictions.json", result.null_odds,
                          run_dir / "null_odds.json" if result.null_odds is not None else None)
        return {"predictions": str(run_dir / "predictions.json"), "scores": scores, **scores}


def check_squad_resume(run_dir: Path, squad: SquadConfig, with_changes: bool) -> None:
    """Refuse resuming with SQuAD settings that change the training (``_TRAINING_KEYS``:
    e.g. a v1.1 run resumed as v2.0) unless ``with_changes``; log every change.

    ``runs.check_resume`` compares the run config, which holds no SQuAD settings:
    they are in the run's ``squad.yaml``.
    """
    path = run_dir / "squad.yaml"
    if not path.is_file():
        return
    saved = read_section(SquadConfig(), "squad", run_dir)
    changes = [(key, getattr(saved, key), getattr(squad, key)) for key in
               (f.name for f in dataclasses.fields(SquadConfig)) if key not in ("train_file", "predict_file")
               and getattr(saved, key) != getattr(squad, key)]
    breaking = [f"squad.{key}: {old!r} → {new!r}" for key, old, new in changes if key in _TRAINING_KEYS]
    if breaking and not with_changes:
        raise ConfigError(f"resuming {run_dir} with changes that break continuing it exactly: "
                          f"{'; '.join(breaking)}; pass --resume-with-changes to go on with them")
    for key, old, new in changes:
        logger.warning("resuming with a change: squad.%s: %r → %r", key, old, new)
