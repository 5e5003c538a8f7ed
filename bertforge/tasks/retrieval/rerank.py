"""Rerankers (cross-encoders): a (query, passage) pair read together, one relevance score out.

A :class:`Reranker` is our BERT or ModernBERT sequence classifier with one output
(``BertForSequenceClassification`` / ``ModernBertForSequenceClassification`` with ``num_labels=1``,
transformers' layers and names) and its tokenizer. A pair is ``[CLS] query [SEP] passage [SEP]``,
token types 0 then 1, cut to ``max_length`` tokens by ``tokenizers``' longest-first truncation:
what transformers' fast tokenizer, and so sentence-transformers' ``CrossEncoder``, makes of it. The
score is the classifier's logit; ``activation`` (sigmoid, as ``CrossEncoder`` has it for one
output, or identity) is what :meth:`Reranker.predict` and the export apply on top.

It reads from our reranker runs (``reranker.yaml`` beside the weights), a transformers
directory with a sequence-classification head of one output, or a sentence-transformers
``CrossEncoder`` directory (its ``modules.json`` names one Transformer; the maximum length is
its tokenizer's ``model_max_length``, the activation its ``config_sentence_transformers.json``'s);
training starts from any encoder we read (a new head). :func:`export_cross_encoder` writes the
directory ``CrossEncoder(dir)`` loads, scoring as ours.

The losses (:func:`binary_loss`, :func:`listwise_loss`) are sentence-transformers'
``BinaryCrossEntropyLoss`` on the labelled pairs (positive 1, each negative 0) and the softmax
cross-entropy of each positive among its own negatives (their ``ListNetLoss`` with the
positive's label 0 and the negatives' -inf, a one-hot target). :func:`rerank_run` reorders a
bi-encoder's run: each query's first ``k`` documents by the reranker's scores.
"""

from __future__ import annotations

import dataclasses
import json
import typing
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from bertforge.config import ModelConfig
from bertforge.fileio import atomic_directory
from bertforge.formats.hf import find_model, hf_head_config, is_hf_directory
from bertforge.formats.load import load_model
from bertforge.formats.weights import check_export_target
from bertforge.observe.log import ProgressBar

from ..finetune import FinetuneError
from .export import _write_json, write_hf_model
from .metrics import trec_ranking
from .model import ST_MODULES, TextIds, pad, text_ids

SETTINGS_FILE = "reranker.yaml"  # a trained reranker's settings, beside its weights (and its run's marker)
ACTIVATIONS = {"sigmoid": "torch.nn.modules.activation.Sigmoid", "identity": "torch.nn.modules.linear.Identity"}
LOSSES = ("bce", "listwise")
ST_CROSS_ENCODER_TRANSFORMER = "sentence_transformers.base.modules.transformer.Transformer"


@dataclass
class RerankerSettings:
    """How pairs become scores; the fields of ``reranker.yaml`` that the model needs."""

    max_length: int = 256          # tokens of a pair, [CLS] and both [SEP] included
    activation: str = "sigmoid"    # on the logit in predict and in the export: sigmoid | identity

    def check(self, source: str = "") -> None:
        where = f"{source}: " if source else ""
        if self.max_length < 5:
            raise FinetuneError(f"{where}max_length={self.max_length} leaves no room for a query and a passage "
                                f"(at least 5)")
        if self.activation not in ACTIVATIONS:
            raise FinetuneError(f"{where}activation={self.activation!r} is not supported (one of "
                                f"{', '.join(ACTIVATIONS)})")


class Reranker(nn.Module):
    """A sequence classifier of one output over (query, passage) pairs; ``forward`` gives (B,) logits."""

    def __init__(self, model: nn.Module, ids: TextIds, settings: RerankerSettings, source: str = "the model"):
        super().__init__()
        settings.check(source)
        if int(getattr(model, "num_labels", 0)) != 1:
            raise FinetuneError(f"{source}: a reranker has one output; this classifier has "
                                f"{getattr(model, 'num_labels', None)}")
        longest = typing.cast(ModelConfig, model.config).max_position_embeddings
        if settings.max_length > longest:
            raise FinetuneError(f"{source}: max_length={settings.max_length} is more than the model's "
                                f"max_position_embeddings={longest}")
        self.model, self.ids, self.settings = model, ids, settings

    @property
    def config(self) -> ModelConfig:
        return typing.cast(ModelConfig, self.model.config)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, attention_mask: torch.Tensor
                ) -> torch.Tensor:
        return self.model(input_ids, token_type_ids, attention_mask)[:, 0]

    def tokenize(self, queries: Sequence[str], passages: Sequence[str]) -> list[tuple[list[int], int]]:
        """Each pair's ids ``[CLS] q [SEP] p [SEP]`` and where its passage starts (its token types turn 1)."""
        ids, tokenizer = self.ids, self.ids.tokenizer
        # longest-first over the two texts, as the fast tokenizer cuts a pair before adding its 3 specials
        tokenizer.enable_truncation(self.settings.max_length - 3, strategy="longest_first")
        try:
            encodings = tokenizer.encode_batch(list(zip(queries, passages, strict=True)), add_special_tokens=False)
        finally:
            tokenizer.no_truncation()
        rows = []
        for encoding in encodings:
            sides = encoding.sequence_ids
            first = [t for t, side in zip(encoding.ids, sides) if side == 0]
            second = [t for t, side in zip(encoding.ids, sides) if side == 1]
            rows.append(([ids.cls_id, *first, ids.sep_id, *second, ids.sep_id], len(first) + 2))
        return rows

    def batch(self, rows: Sequence[tuple[list[int], int]]) -> dict[str, torch.Tensor]:
        """input_ids, token_type_ids and attention_mask of tokenized pairs, right-padded (on the CPU)."""
        input_ids, attention_mask = pad([r[0] for r in rows], self.ids.pad_id)
        columns = torch.arange(input_ids.shape[1])[None, :]
        token_type_ids = ((columns >= torch.tensor([r[1] for r in rows])[:, None]) & attention_mask.bool()).long()
        return {"input_ids": input_ids, "token_type_ids": token_type_ids, "attention_mask": attention_mask}

    @torch.no_grad()
    def score(self, queries: Sequence[str], passages: Sequence[str], batch_size: int = 32,
              activation: bool = False, progress: bool = False) -> torch.Tensor:
        """(n,) float32 logits of the pairs (with ``activation``: the settings' activation on them),
        in eval mode; longest pairs first in batches of ``batch_size``, given back in input order."""
        rows = self.tokenize(queries, passages)
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        out = torch.zeros(len(rows), dtype=torch.float32)
        was_training = self.training
        self.eval()
        try:
            with ProgressBar(len(rows), 0, enabled=progress, label="rerank") as bar:
                for first in range(0, len(order), batch_size):
                    chosen = order[first:first + batch_size]
                    batch = {k: v.to(self.device) for k, v in self.batch([rows[i] for i in chosen]).items()}
                    out[chosen] = self(**batch).float().cpu()
                    bar.update(first + len(chosen), "pairs")
        finally:
            self.train(was_training)
        return torch.sigmoid(out) if activation and self.settings.activation == "sigmoid" else out

    def predict(self, pairs: Sequence[tuple[str, str]], batch_size: int = 32) -> torch.Tensor:
        """``CrossEncoder.predict``'s scores: the activation on each pair's logit."""
        return self.score([q for q, _ in pairs], [p for _, p in pairs], batch_size, activation=True)


# ---------------------------------------------------------------- losses


def binary_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy of each pair's logit against its label (1 relevant, 0 not), the mean over pairs."""
    return F.binary_cross_entropy_with_logits(logits.float(), labels.float())


def listwise_loss(logits: torch.Tensor) -> torch.Tensor:
    """(rows, candidates) logits, each row's positive first: the mean over rows of ``-log softmax`` of it."""
    return F.cross_entropy(logits.float(), torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device))


class RerankLoss:
    """The engine's loss: a batch is whole rows of ``candidates`` pairs each (positive, then negatives);
    the model a :class:`Reranker` or its classifier ((B, 1) logits)."""

    def __init__(self, kind: str, candidates: int):
        if kind not in LOSSES:
            raise FinetuneError(f"loss={kind!r} is not a reranker loss (one of {', '.join(LOSSES)})")
        self.kind, self.candidates = kind, candidates

    def __call__(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        logits = model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"]).reshape(-1)
        if self.kind == "bce":
            return {"loss": binary_loss(logits, batch["labels"])}
        return {"loss": listwise_loss(logits.view(-1, self.candidates))}


# ---------------------------------------------------------------- loading


def _read_json(file: Path) -> Any:
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise FinetuneError(f"{file}: cannot be read as JSON ({err})") from None


def _directory_settings(path: Path, training: bool) -> tuple[Path, dict[str, Any]]:
    """(where the transformer is, the settings it gives) of a transformers or sentence-transformers
    directory. The maximum length is CrossEncoder's: the tokenizer's ``model_max_length`` (an older
    ``sentence_bert_config.json``'s ``max_seq_length`` first) capped at ``max_position_embeddings``.
    For training, any sentence-transformers model gives its transformer (an embedding model's
    pooling is left out)."""
    transformer, values = path, dict[str, Any]()
    if (path / ST_MODULES).is_file():
        for module in _read_json(path / ST_MODULES) or []:
            kind = str(module.get("type", ""))
            if kind.endswith("Transformer"):
                transformer = path / str(module.get("path", ""))
            elif not training:
                raise FinetuneError(f"{path / ST_MODULES}: module {kind!r}: not a CrossEncoder (a reranker is "
                                    f"one Transformer with a sequence-classification head)")
    if not is_hf_directory(transformer):
        return transformer, values
    lengths = [_read_json(transformer / "config.json").get("max_position_embeddings")]
    for name, key in (("sentence_bert_config.json", "max_seq_length"), ("tokenizer_config.json", "model_max_length")):
        found = _read_json(transformer / name).get(key) if (transformer / name).is_file() else None
        if found is not None:
            lengths.append(found)
            break
    lengths = [n for n in lengths if isinstance(n, int) and 0 < n < 1_000_000]  # 10**30 and such: unset
    if lengths:
        values["max_length"] = min(lengths)
    st_config = path / "config_sentence_transformers.json"
    config = _read_json(st_config) if st_config.is_file() else {}
    if config.get("prompts") and not training:
        raise FinetuneError(f"{st_config}: prompts {sorted(config['prompts'])} are not supported by rerankers")
    if config.get("activation_fn") and config.get("model_type", "CrossEncoder") == "CrossEncoder":
        names = {path: name for name, path in ACTIVATIONS.items()}
        if config["activation_fn"] not in names:
            raise FinetuneError(f"{st_config}: activation_fn {config['activation_fn']!r} is not supported "
                                f"({', '.join(ACTIVATIONS.values())})")
        values["activation"] = names[config["activation_fn"]]
    return transformer, values


def _check_trained(path: Path, transformer: Path) -> None:
    """Refuse to score with a head that would be new: a reranker is ours or has a classifier."""
    if (path / SETTINGS_FILE).is_file():
        return
    if not is_hf_directory(transformer):
        raise FinetuneError(f"{path}: not a reranker (no {SETTINGS_FILE}: train one with "
                            f"bertforge retrieval train --kind cross-encoder)")
    architectures = _read_json(transformer / "config.json").get("architectures") or []
    if not any(str(a).endswith("ForSequenceClassification") for a in architectures):
        raise FinetuneError(f"{transformer / 'config.json'}: architectures {architectures} is not a reranker "
                            f"(a ...ForSequenceClassification head of one output)")


def load_reranker(path: str | Path, training: bool = False, **overrides: Any) -> Reranker:
    """The reranker at ``path``: ours, a transformers directory or a CrossEncoder directory (or a
    model id in the local cache); ``overrides`` set :class:`RerankerSettings` fields. With
    ``training``, any encoder we read starts one (its classifier new when it has none)."""
    path = find_model(path, FinetuneError)
    transformer, values = _directory_settings(path, training) if path.is_dir() else (path, {})
    if path.is_dir() and (path / SETTINGS_FILE).is_file():
        import yaml

        names = {f.name for f in dataclasses.fields(RerankerSettings)}
        saved = yaml.safe_load((path / SETTINGS_FILE).read_text(encoding="utf-8")) or {}
        values.update({k: v for k, v in saved.items() if k in names})
    if not training:
        _check_trained(path, transformer)
    values.update({k: v for k, v in overrides.items() if v is not None})
    settings = RerankerSettings(**values)
    settings.check(str(path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a new head is expected when training starts from an encoder
        model = load_model(transformer, head="classification", num_labels=1).float()
    return Reranker(model, text_ids(transformer), settings, str(path))


# ---------------------------------------------------------------- export


def export_cross_encoder(model: Reranker, out_dir: str | Path, overwrite: bool = False) -> Path:
    """Write ``model`` as a sentence-transformers CrossEncoder directory, whole or not at all: the
    transformers sequence classifier (``num_labels`` 1) at its root with its tokenizer, one
    Transformer module of task ``sequence-classification``, the activation in
    ``config_sentence_transformers.json``."""
    out_dir = Path(out_dir)
    check_export_target(out_dir, overwrite)
    with atomic_directory(out_dir) as tmp:
        write_hf_model(model.model, model.ids, tmp, model.settings.max_length, hf_head_config(model.model))
        _write_json(tmp / ST_MODULES, [{"idx": 0, "name": "0", "path": "", "type": ST_CROSS_ENCODER_TRANSFORMER}])
        _write_json(tmp / "sentence_bert_config.json", {
            "transformer_task": "sequence-classification",
            "modality_config": {"text": {"method": "forward", "method_output_name": "logits"}},
            "module_output_name": "scores"})
        _write_json(tmp / "config_sentence_transformers.json", {
            "model_type": "CrossEncoder", "activation_fn": ACTIVATIONS[model.settings.activation],
            "prompts": {}, "default_prompt_name": None})
    return out_dir


# ---------------------------------------------------------------- reranking a run


def rerank_run(reranker: Reranker, run: dict[str, dict[str, float]], queries: dict[str, str],
               corpus: dict[str, str], k: int, batch_size: int = 32, progress: bool = False
               ) -> dict[str, dict[str, float]]:
    """Each query's first ``k`` documents of ``run`` (in trec_eval's order) with the reranker's
    logits as their scores; the documents past ``k`` are left out (BEIR's reranking)."""
    chosen = {q: trec_ranking(scores)[:k] for q, scores in run.items()}
    pairs = [(q, doc) for q, docs in chosen.items() for doc in docs]
    scores = reranker.score([queries[q] for q, _ in pairs], [corpus[d] for _, d in pairs], batch_size,
                            progress=progress).tolist()
    out: dict[str, dict[str, float]] = {q: {} for q in run}
    for (q, doc), score in zip(pairs, scores):
        out[q][doc] = score
    return out
