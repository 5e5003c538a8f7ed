"""GLUE and token classification (NER) fine-tuning and prediction.

    cfg, task = load_task_config("glue", "glue_base", [("finetune.task", "mrpc"), ("finetune.data", "glue/MRPC")])
    summary = finetune(cfg, task, init="minilm/", out_dir="runs/mrpc")

A GLUE task trains BertForSequenceClassification (cross-entropy; STS-B:
regression, one output and a mean squared error, as Hugging Face's
``run_glue``), a NER task BertForTokenClassification (cross-entropy over the
first WordPiece of each word). Both run through the shared fine-tuning loop
(:mod:`bertforge.tasks.finetune.run`): torchrun, checkpoints and exact resume,
SIGTERM, the metrics log and the run report.

The run directory (``--out``) is the fine-tuned model too: ``config.yaml``,
``finetune.yaml`` (the task, its data and its labels) and ``vocab.txt`` from
the start, ``checkpoints/step_N/`` while it trains, and at the end
``model.safetensors`` and ``config.json`` (``transformers``'
``BertFor{Sequence,Token}Classification.from_pretrained(dir)`` loads it, labels
named), ``scores.json`` (the dev scores) and the predictions: GLUE's test
sets as the leaderboard's files in ``submission/``, NER's as CoNLL files
(``word gold prediction``) in ``predictions/``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from bertforge.config import Config, ConfigError, Head, ModelConfig, use_model, validate
from bertforge.data.fast_tokenizer import task_tokenizer
from bertforge.fileio import atomic_file
from bertforge.formats import weights
from bertforge.formats.hf import hf_labels, resolve_model
from bertforge.models.families import model_class
from bertforge.parallel.dist import DistContext
from bertforge.runs import saved_data_settings

from . import FinetuneError, glue, ner
from .metrics import glue_metrics
from .run import (
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
from .run import train as train_job

logger = logging.getLogger(__name__)

SECTION = "finetune"  # the config section and the settings file (finetune.yaml) that marks a run
KINDS = ("glue", "ner")
DEFAULT_CONFIGS = {"glue": "glue_base", "ner": "ner_base"}


@dataclass
class TaskConfig:
    """The task of a GLUE or NER run: the ``finetune:`` section of its config."""

    task: str = ""  # a GLUE task (cola, sst-2, mrpc, sts-b, qqp, mnli, qnli, rte, wnli), or ner
    data: str = ""  # the task's directory: GLUE's layout (train.tsv, dev.tsv, test.tsv) or CoNLL files
    labels: list[str] = field(default_factory=list)  # from the training data; saved with the model
    predict_batch_size: int = 64
    max_examples: int = 0  # > 0: train on the first this many examples only

    @property
    def kind(self) -> str:
        return "ner" if self.task == "ner" else "glue"

    @property
    def main_metric(self) -> str:
        """The score a sweep ranks by: entity F1 for NER, the GLUE task's own (BERT's paper's)."""
        return "f1" if self.kind == "ner" else glue.get_task(self.task).main_metric

    @property
    def head(self) -> Head:  # what load_model builds for it
        return "token_classification" if self.kind == "ner" else "classification"


def load_task_config(kind: str, name: str | None = None, overrides: Sequence[tuple[str, Any]] = (),
                     resume: str | Path | None = None, out_dir: str | Path | None = None
                     ) -> tuple[Config, TaskConfig]:
    """(Config, TaskConfig): defaults, the YAML config (``name``, else the resumed run's, with
    ``resume: auto`` the run's in ``out_dir`` when it has a checkpoint, else the kind's recipe),
    then dotted overrides (``finetune.*`` to the task)."""
    task = TaskConfig()
    cfg = load_config(task, SECTION, DEFAULT_CONFIGS[kind], name, overrides, resume, out_dir)
    if kind == "ner" and not task.task:
        task.task = "ner"
    check_task(task, kind)
    return cfg, task


def check_task(task: TaskConfig, kind: str) -> None:
    if kind == "ner":
        if task.task != "ner":
            raise ConfigError(f"finetune.task={task.task!r}: a NER run's task is ner")
    else:
        try:
            task.task = glue.get_task(task.task).name
        except ValueError:
            raise ConfigError(f"finetune.task={task.task!r} is not a GLUE task "
                              f"(one of {', '.join(glue.TASKS)})") from None
    if task.predict_batch_size < 1 or task.max_examples < 0:
        raise ConfigError("finetune.predict_batch_size must be at least 1 and finetune.max_examples not negative")


# ------------------------------------------------------------------ loss and prediction


def classifier_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Cross-entropy over the labelled rows (or tokens: label -100 is not scored); one output: MSE."""
    logits = model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"]).float()
    labels = batch["labels"]
    if logits.shape[-1] == 1:  # STS-B: regression on the score, as transformers' run_glue
        return {"loss": F.mse_loss(logits.squeeze(-1), labels.float())}
    return {"loss": F.cross_entropy(logits.flatten(0, -2), labels.flatten().long(), ignore_index=-100)}


def predict_logits(model: nn.Module, features: Any, batch_size: int = 64, device: torch.device | str = "cpu",
                   precision: str = "fp32") -> np.ndarray:
    """float32 logits of every feature, (N, labels) or per token (N, T, labels), in eval mode;
    batches cut to their longest real sequence (:func:`~bertforge.tasks.finetune.run.forward_in_batches`)."""
    count, full = features.input_ids.shape
    out: np.ndarray | None = None
    for rows, width, logits in forward_in_batches(model, features, batch_size, device, precision):
        logits = logits.float().cpu().numpy()
        if out is None:
            shape = (count, logits.shape[1]) if logits.ndim == 2 else (count, full, logits.shape[2])
            out = np.zeros(shape, np.float32)
        if logits.ndim == 2:
            out[rows] = logits
        else:  # per token: the trimmed positions stay 0 (padding, never read)
            out[rows, :width] = logits
    assert out is not None, "no features to predict"
    return out


# ------------------------------------------------------------------ the tasks


class Task:
    """What a GLUE or NER task reads, predicts, scores and writes."""

    def __init__(self, task: TaskConfig, tokenizer: Any, seq_len: int):
        self.config, self.tokenizer, self.seq_len = task, tokenizer, seq_len

    @staticmethod
    def of(task: TaskConfig, tokenizer: Any, seq_len: int) -> Task:
        return NerTask(task, tokenizer, seq_len) if task.kind == "ner" else GlueTask(task, tokenizer, seq_len)

    # Every labelled split the task has, whether its data has it or not; the first one's scores are
    # the unprefixed keys (a sweep ranks by its main metric), the others' carry the split's name.
    dev_names: tuple[str, ...] = ("dev",)

    def training_data(self) -> tuple[Any, list[Path], str]:
        """(features, files read, a description) of the training split; sets the labels when new."""
        raise NotImplementedError

    def dev_splits(self) -> list[str]:
        """The splits of ``dev_names`` that the data has."""
        raise NotImplementedError

    def missing(self, split: str) -> str:
        """What to say of a split that the data lacks."""
        raise NotImplementedError

    def test_splits(self) -> list[str]:
        raise NotImplementedError

    def score(self, model: nn.Module, split: str, device: torch.device | str, precision: str
              ) -> tuple[dict[str, float], Any]:
        """(scores, predictions) of a labelled split."""
        raise NotImplementedError

    def write_test(self, model: nn.Module, split: str, out_dir: Path, device: torch.device | str,
                   precision: str) -> Path:
        """Predict a test split and write its file; returns the path."""
        raise NotImplementedError


class GlueTask(Task):
    def __init__(self, task: TaskConfig, tokenizer: Any, seq_len: int):
        super().__init__(task, tokenizer, seq_len)
        self.spec = glue.get_task(task.task)
        self.data_dir = Path(task.data)
        self.dev_names = self.spec.dev_splits

    def training_data(self) -> tuple[Any, list[Path], str]:
        examples = glue.read_task(self.data_dir, self.config.task, "train")
        if self.config.max_examples:
            n = self.config.max_examples
            examples = dataclasses.replace(examples, ids=examples.ids[:n], text_a=examples.text_a[:n],
                                           text_b=examples.text_b[:n] if examples.text_b is not None else None,
                                           labels=examples.labels[:n] if examples.labels is not None else None,
                                           lines=examples.lines[:n])
        if not self.config.labels:
            self.config.labels = list(self.spec.labels) if self.spec.labels else ["score"]
        features = glue.convert_examples(examples, self.tokenizer, self.seq_len, self.spec.labels)
        return features, [examples.source], f"{len(features.input_ids)} {self.config.task} examples"

    def dev_splits(self) -> list[str]:
        return [s for s in self.spec.dev_splits if glue.task_file(self.data_dir, self.config.task, s).is_file()]

    def missing(self, split: str) -> str:
        return glue.missing_file(self.data_dir, self.spec, split)

    def test_splits(self) -> list[str]:
        return [s for s in self.spec.test_splits if glue.task_file(self.data_dir, self.config.task, s).is_file()]

    def _predict(self, model: nn.Module, split: str, device: torch.device | str, precision: str
                 ) -> tuple[Any, np.ndarray]:
        examples = glue.read_task(self.data_dir, self.config.task, split)
        features = glue.convert_examples(examples, self.tokenizer, self.seq_len, self.spec.labels)
        logits = predict_logits(model, features, self.config.predict_batch_size, device, precision)
        predictions = logits[:, 0] if logits.shape[1] == 1 else logits.argmax(-1)
        return features, predictions

    def score(self, model: nn.Module, split: str, device: torch.device | str, precision: str
              ) -> tuple[dict[str, float], Any]:
        features, predictions = self._predict(model, split, device, precision)
        return glue_metrics(self.spec.name, predictions, features.labels), predictions

    def write_test(self, model: nn.Module, split: str, out_dir: Path, device: torch.device | str,
                   precision: str) -> Path:
        features, predictions = self._predict(model, split, device, precision)
        return glue.write_test_predictions(out_dir / "submission", self.config.task, features.ids, predictions,
                                           split=split)


class NerTask(Task):
    def __init__(self, task: TaskConfig, tokenizer: Any, seq_len: int):
        super().__init__(task, tokenizer, seq_len)
        self.files = ner.find_files(task.data)

    def training_data(self) -> tuple[Any, list[Path], str]:
        path = self.files.get("train")
        if path is None:
            raise FinetuneError(f"{self.config.data}: no training file (train.txt or eng.train)")
        examples = ner.read_conll(path)
        if self.config.max_examples:
            examples = examples.head(self.config.max_examples)
        if not self.config.labels:
            self.config.labels = ner.label_list(examples)
        features = ner.convert_examples(examples, self.tokenizer, self.seq_len, self.config.labels)
        return features, [path], f"{len(examples)} sentences ({len(features.input_ids)} windows)"

    def dev_splits(self) -> list[str]:
        return ["dev"] if "dev" in self.files else []

    def missing(self, split: str) -> str:
        *names, last = ner.FILE_NAMES[split]
        return f"{self.config.data}: no {split} file ({', '.join(names)} or {last})"

    def test_splits(self) -> list[str]:
        return ["test"] if "test" in self.files else []

    def _predict(self, model: nn.Module, split: str, device: torch.device | str, precision: str,
                 labelled: bool = True) -> tuple[Any, list[list[str]]]:
        examples = ner.read_conll(self.files[split], labelled=labelled)
        features = ner.convert_examples(examples, self.tokenizer, self.seq_len, self.config.labels)
        logits = predict_logits(model, features, self.config.predict_batch_size, device, precision)
        return examples, ner.word_predictions(features, logits, examples, self.config.labels)

    def score(self, model: nn.Module, split: str, device: torch.device | str, precision: str
              ) -> tuple[dict[str, float], Any]:
        examples, predictions = self._predict(model, split, device, precision)
        return ner.overall(ner.entity_scores(examples.tags, predictions)), predictions

    def write_test(self, model: nn.Module, split: str, out_dir: Path, device: torch.device | str,
                   precision: str) -> Path:
        examples, predictions = self._predict(model, split, device, precision, labelled=ner.is_labelled(
            self.files[split]))
        path = out_dir / "predictions" / f"{split}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        ner.write_predictions(path, examples, predictions)
        return path


def split_scores(task: Task, model: nn.Module, device: torch.device | str, precision: str) -> dict[str, float]:
    """Every dev split's scores; a second split's keys carry its name (MNLI: ``accuracy_dev_mismatched``),
    also when the first split is missing."""
    scores: dict[str, float] = {}
    for split in task.dev_splits():
        result, _ = task.score(model, split, device, precision)
        scores.update({(k if split == task.dev_names[0] else f"{k}_{split}"): float(v) for k, v in result.items()})
    return scores


def require_main_dev(task_cfg: TaskConfig) -> None:
    """Refuse a sweep whose data lacks the split it ranks its runs by (else its runs train and
    then cannot be ranked)."""
    task = Task.of(task_cfg, None, 0)  # only the files are looked at
    main = task.dev_names[0]
    if main not in task.dev_splits():
        raise FinetuneError(f"a sweep ranks its runs by their {main} {task_cfg.main_metric}: {task.missing(main)}")


# ------------------------------------------------------------------ models


def load_classifier(path: str | Path, task: Task, vocab: Path) -> nn.Module:
    """The model at ``path`` with ``task``'s head (new when the source has none), checked against the vocab."""
    return load_checked(path, vocab, task.config.head, len(task.config.labels))


# ------------------------------------------------------------------ fine-tuning


def finetune(cfg: Config, task_cfg: TaskConfig, init: str | Path | None, out_dir: str | Path | None = None,
             vocab: str | Path | None = None, log: Callable[[str], None] = print,
             overwrite: bool = False) -> dict[str, Any]:
    """Fine-tune ``init`` on the task's training split into ``out_dir``; score its dev splits and
    predict its test splits. With ``cfg.checkpoint.resume`` the run goes on from that checkpoint
    exactly; with ``overwrite`` a new run replaces the one in ``out_dir`` (not a live one). Under
    torchrun every rank calls this. Returns the summary of :func:`bertforge.tasks.finetune.run.train`
    with the dev scores.

    The job's entry: the whole config is settled here (the model's config, the vocab, the
    weights it started from); the parts take its sections."""
    def body(dist: DistContext, run_dir: Path, resume_from: Path | None, started: float) -> dict[str, Any]:
        torch.manual_seed(cfg.train.seed)  # every rank initialises the same head
        vocab_path = run_vocab(init, vocab, run_dir, resume_from)
        if resume_from is None:
            cfg.checkpoint.init = str(resolve_model(cast(str, init)).resolve())  # (checked)
        task_cfg.data = str(Path(task_cfg.data).resolve())
        task = Task.of(task_cfg, task_tokenizer(vocab_path, cfg.data.lowercase), cfg.data.seq_len)
        features, files, description = training_split(task)
        num_labels = len(task_cfg.labels)
        model = run_classifier(init, task, vocab_path, resume_from)
        use_model(cfg, cast(ModelConfig, model.config))
        cfg.data.vocab = str(Path(vocab_path).resolve())
        validate(cfg)
        scoring = TaskScoring(task, dist.device, cfg.execution.precision)
        job = Job(kind=task_cfg.task, model=model, rows=FeatureRows(features), loss_fn=classifier_loss,
                  data_files=files, description=description,
                  rebuild=lambda: model_class(cfg.model, task_cfg.head)(cfg.model, num_labels),
                  write_settings=lambda d: write_run_files(d, cfg.to_yaml(), task_cfg, SECTION, Path(vocab_path)),
                  save=lambda whole, d: save_finetuned(whole, d, task_cfg.labels),
                  evaluate=scoring.scores if task.dev_splits() else None, finish=scoring.finish)
        return train_job(cfg, job, dist, run_dir, resume_from, init, log if dist.is_main else (lambda _: None),
                         started)

    return launch(cfg.execution, cfg.log, cfg.checkpoint.resume, out_dir, f"{SECTION}.yaml", task_cfg.task.lower(),
                  body, overwrite, (init, task_cfg.data, vocab))


def run_vocab(init: str | Path | None, vocab: str | Path | None, run_dir: Path, resume_from: Path | None) -> Path:
    """The vocab of a run: ``vocab``, else the one beside ``init`` (a new run, which needs it), else the run's."""
    if resume_from is None:
        if not init:
            raise ConfigError("fine-tuning needs --init (or --resume RUN)")
        return find_vocab(init, vocab)
    return find_vocab(run_dir, vocab)


def training_split(task: Task) -> tuple[Any, list[Path], str]:
    """The task's training data (:meth:`Task.training_data`), then a warning for each dev split
    the data lacks (after the training file, whose absence is an error)."""
    features, files, description = task.training_data()  # sets the labels of a new run
    for split in task.dev_names:
        if split not in task.dev_splits():
            logger.warning("%s: this run has no %s scores", task.missing(split), split)
    return features, files, description


def run_classifier(init: str | Path | None, task: Task, vocab: Path, resume_from: Path | None) -> nn.Module:
    """The classifier a run trains, on the CPU: ``init``'s weights for a new run, else the checkpoint's
    shape, whose weights the resume loads."""
    if resume_from is None:
        return load_classifier(cast(str, init), task, vocab)  # (run_vocab checked init)
    saved = weights.read_config(resume_from).model
    return model_class(saved, task.config.head)(saved, len(task.config.labels))


@dataclass
class TaskScoring:
    """Rank 0's dev scores during training, and at the end scores.json and the test predictions."""

    task: Task
    device: torch.device
    precision: str

    def scores(self, whole: nn.Module) -> dict[str, float]:
        return split_scores(self.task, whole, self.device, self.precision)

    def finish(self, whole: nn.Module, run_dir: Path) -> dict[str, Any]:
        scores = self.scores(whole)
        with atomic_file(run_dir / "scores.json") as tmp:
            tmp.write_text(json.dumps(scores, indent=2) + "\n", encoding="utf-8")
        files = [str(self.task.write_test(whole, split, run_dir, self.device, self.precision))
                 for split in self.task.test_splits()]
        return {**scores, "scores": scores, "prediction_files": files,
                "main_score": scores.get(self.task.config.main_metric)}


# ------------------------------------------------------------------ prediction


def saved_task(model_dir: str | Path) -> TaskConfig:
    """The task settings saved with a fine-tuned model (its ``finetune.yaml``)."""
    return read_section(TaskConfig(), SECTION, Path(model_dir))



def predict(model_path: str | Path, data: str | Path | None = None, task_name: str | None = None,
            split: str = "test", out_dir: str | Path | None = None, vocab: str | Path | None = None,
            device: str = "cpu", precision: str = "fp32", batch_size: int | None = None) -> dict[str, Any]:
    """Predict ``split`` of a task with a fine-tuned model (ours, or a Hugging Face classifier).

    A labelled split is scored; a test split is written as the leaderboard's
    file (GLUE) or a CoNLL file (NER) into ``out_dir`` (default: the model's
    directory). Returns the scores and the files written.
    """
    model_path = resolve_model(model_path)  # a directory, or a Hugging Face id in the cache
    task_cfg = saved_task(model_path)
    if task_name:
        task_cfg.task = task_name
    if data:
        task_cfg.data = str(data)
    if not task_cfg.labels:
        task_cfg.labels = hf_labels(model_path) or []
    if not task_cfg.task:
        raise ConfigError(f"{model_path} has no finetune.yaml: name the task with --task")
    check_task(task_cfg, task_cfg.kind)
    if batch_size:
        task_cfg.predict_batch_size = batch_size
    lowercase, seq_len = saved_data_settings(model_path)
    vocab_path = find_vocab(model_path, vocab)
    task = Task.of(task_cfg, task_tokenizer(vocab_path, lowercase), seq_len or 128)
    if not task_cfg.labels:
        task_cfg.labels = list(glue.get_task(task_cfg.task).labels or ["score"]) if task_cfg.kind == "glue" else []
    if not task_cfg.labels:
        raise FinetuneError(f"{model_path}: no label names (finetune.yaml or config.json's id2label)")
    model = load_classifier(model_path, task, vocab_path).to(device)
    result: dict[str, Any] = {"task": task_cfg.task, "split": split}
    if split in task.dev_splits():
        scores, _ = task.score(model, split, device, precision)
        result["scores"] = {k: float(v) for k, v in scores.items()}
    elif split in task.test_splits():
        result["file"] = str(task.write_test(model, split, Path(out_dir or model_path), device, precision))
    else:
        raise FinetuneError(f"{task_cfg.data}: no {split} split for {task_cfg.task}")
    return result
