"""Embedding models on our encoders: a vector per text (:class:`Embedder`) or per token (:class:`LateInteraction`).

Both wrap our BERT or ModernBERT encoder (:func:`bertforge.formats.load.load_model`'s ``encoder``
head) with the tokenizer it was trained with, and read from any model directory we read: ours
(a run, a step, a fine-tuned model), a ``transformers`` directory, or a sentence-transformers
directory, whose ``modules.json``, ``1_Pooling/config.json``, ``2_Normalize``,
``sentence_bert_config.json`` and ``config_sentence_transformers.json`` (prompts) give the
pooling, normalization, maximum length and prefixes. Our fine-tuned models keep theirs in
``retrieval.yaml`` (:data:`SETTINGS_FILE`).

Texts become ``[CLS] prefix+text [SEP]`` cut to the kind's maximum length, as transformers' fast
tokenizer does for sentence-transformers: the same ids, so the same embeddings.

:class:`LateInteraction` is ColBERT as PyLate builds it: the token states through a linear
projection without bias (128 dimensions by default), L2-normalized per token; a marker token
(``[unused0]`` for queries, ``[unused1]`` for documents) right after ``[CLS]``; queries padded
to their full length with ``[MASK]`` (query expansion: the padding is not attended to, but its
outputs are kept); documents without padding and without punctuation tokens (PyLate's
skip-list, ``string.punctuation``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import string
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch import nn

from bertforge.config import ModelConfig
from bertforge.data.bpe import read_tokenizer_json, special_roles
from bertforge.data.tokenizer import load_tokenizer, special_ids
from bertforge.data.vocab import is_tokenizer_json
from bertforge.formats.hf import find_model, is_hf_directory
from bertforge.formats.load import load_model
from bertforge.models.bert import flex_any_length, grouped_documents
from bertforge.models.modernbert import ModernBertModel, pool
from bertforge.runs import saved_data_settings

from ..finetune import FinetuneError
from ..finetune.run import find_vocab

Kind = Literal["query", "document"]
KINDS = ("query", "document")
POOLINGS = ("mean", "cls")
SETTINGS_FILE = "retrieval.yaml"  # a fine-tuned model's embedding settings, beside its weights
ST_MODULES = "modules.json"
ST_TRANSFORMER = "sentence_transformers.models.Transformer"
ST_POOLING = "sentence_transformers.models.Pooling"
ST_NORMALIZE = "sentence_transformers.models.Normalize"
PYLATE_DENSE = "pylate.models.Dense.Dense"  # PyLate's projection module, as its own saves name it
QUERY_MARKER, DOCUMENT_MARKER = "[unused0]", "[unused1]"  # ColBERT's markers in BERT vocabularies


@dataclass
class EmbeddingSettings:
    """How texts become embeddings; the fields of ``retrieval.yaml`` that the model needs."""

    pooling: str = "mean"           # mean | cls (single vector)
    normalize: bool = True          # L2-normalize the embedding (cosine = dot product)
    query_prefix: str = ""          # put before every query, e.g. "search_query: "
    document_prefix: str = ""       # ... and every document, e.g. "search_document: "
    query_max_length: int = 64      # tokens, [CLS] and [SEP] (and a late-interaction marker) included
    document_max_length: int = 256
    late_interaction: bool = False  # ColBERT: token embeddings and MaxSim
    projection_dim: int = 128       # late interaction: the projection's output size
    query_marker: str = QUERY_MARKER        # late interaction: the token after [CLS]; "" for none
    document_marker: str = DOCUMENT_MARKER
    query_expansion: bool = True    # late interaction: queries padded to query_max_length with [MASK]
    truncate_dim: int = 0           # single vector: encode keeps the first N dimensions (0: all), as
                                    # sentence-transformers' truncate_dim (a Matryoshka model's smaller sizes)

    def check(self, source: str = "") -> None:
        where = f"{source}: " if source else ""
        if self.pooling not in POOLINGS:
            raise FinetuneError(f"{where}pooling={self.pooling!r} is not supported (one of {', '.join(POOLINGS)})")
        for kind in KINDS:
            least = 4 if self.late_interaction else 3
            if self.max_length(kind) < least:
                raise FinetuneError(f"{where}{kind}_max_length={self.max_length(kind)} leaves no room for text "
                                    f"(at least {least})")
        if self.projection_dim < 1:
            raise FinetuneError(f"{where}projection_dim={self.projection_dim} must be positive")
        if self.truncate_dim < 0 or (self.truncate_dim and self.late_interaction):
            raise FinetuneError(f"{where}truncate_dim={self.truncate_dim}: a positive number of dimensions of a "
                                f"single-vector model (0: all)")

    def prefix(self, kind: str) -> str:
        return self.query_prefix if kind == "query" else self.document_prefix

    def max_length(self, kind: str) -> int:
        return self.query_max_length if kind == "query" else self.document_max_length


def settings_from(values: dict[str, Any], source: str) -> EmbeddingSettings:
    """The settings among ``values`` (a ``retrieval.yaml``, which may hold training keys too)."""
    names = {f.name for f in dataclasses.fields(EmbeddingSettings)}
    settings = EmbeddingSettings(**{k: v for k, v in values.items() if k in names})
    settings.check(source)
    return settings


# ---------------------------------------------------------------- text to ids


class TextIds:
    """Texts as ``[CLS] … [SEP]`` ids, as transformers' fast tokenizer makes them for one sequence."""

    def __init__(self, tokenizer: Tokenizer, cls_id: int, sep_id: int, pad_id: int, mask_id: int,
                 lowercase_text: bool = False, file: Path | None = None, lowercase: bool = True):
        self.tokenizer = tokenizer
        self.file, self.lowercase = file, lowercase  # its vocab.txt (lowercasing) or tokenizer.json, for exports
        self.tokenizer.no_padding()
        self.cls_id, self.sep_id, self.pad_id, self.mask_id = cls_id, sep_id, pad_id, mask_id
        self.lowercase_text = lowercase_text  # sentence-transformers' do_lower_case: before the tokenizer

    def __call__(self, texts: Sequence[str], max_length: int, marker: int | None = None) -> list[list[int]]:
        """Each text's ids, at most ``max_length`` of them; ``marker`` (an id) goes right after [CLS]."""
        room = max_length - 2 - (marker is not None)
        self.tokenizer.enable_truncation(room)
        texts = [t.lower() for t in texts] if self.lowercase_text else list(texts)
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        first = [self.cls_id] if marker is None else [self.cls_id, marker]
        return [first + e.ids + [self.sep_id] for e in encodings]

    def token_id(self, token: str, source: str) -> int:
        found = self.tokenizer.token_to_id(token)
        if found is None:
            raise FinetuneError(f"{source}: the vocab has no token {token!r} (set another marker, or '' for none)")
        return found


def pad(rows: Sequence[Sequence[int]], value: int, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask), right-padded with ``value`` to the longest row (or ``width``)."""
    width = width or max(len(r) for r in rows)
    ids = torch.full((len(rows), width), value, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, :len(row)] = 1
    return ids, mask


def _hf_lowercase(path: Path) -> bool:
    try:
        config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
        return bool(config.get("do_lower_case", True))
    except (OSError, ValueError, AttributeError):
        return True


def text_ids(path: Path, vocab: str | Path | None = None, lowercase_text: bool = False) -> TextIds:
    """The tokenizer of the model at ``path``: ``vocab`` when given, else its ``tokenizer.json``
    (transformers' definition, exactly) or its ``vocab.txt`` (BERT's WordPiece, lowercasing as
    the model was trained: ``data.lowercase`` of ours, ``do_lower_case`` of a transformers one)."""
    file = Path(vocab) if vocab else path / "tokenizer.json"
    if not vocab and not file.is_file():
        file = find_vocab(path)
    if is_tokenizer_json(file):  # (a run keeps its tokenizer.json under the name vocab.txt)
        tokenizer, spec = read_tokenizer_json(file)
        tokenizer.encode_special_tokens = False  # "[SEP]" written in a text is the token, as transformers has it
        roles, missing = special_roles(tokenizer, spec)
        if roles is None:
            raise FinetuneError(f"{file}: {missing}")
        pad_id = roles.pad if roles.pad is not None else roles.sep
        return TextIds(tokenizer, roles.cls, roles.sep, pad_id, roles.mask, lowercase_text, file)
    lowercase = _hf_lowercase(path) if is_hf_directory(path) else saved_data_settings(path)[0]
    tokenizer = load_tokenizer(file, lowercase)
    ids = special_ids(tokenizer)
    return TextIds(tokenizer, ids.cls, ids.sep, ids.pad if ids.pad is not None else ids.sep, ids.mask,
                   lowercase_text, file, lowercase)


# ---------------------------------------------------------------- sentence-transformers directories


@dataclass
class STLayout:
    """What a sentence-transformers directory says: where the transformer is, and its settings."""

    transformer: Path
    values: dict[str, Any]   # EmbeddingSettings' fields it sets
    lowercase_text: bool = False
    dense: Path | None = None  # a Dense module (PyLate's projection)


def _read_json(file: Path) -> Any:
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise FinetuneError(f"{file}: cannot be read as JSON ({err})") from None


def read_st_layout(path: Path) -> STLayout | None:
    """The modules of a sentence-transformers directory; None when ``path`` is not one."""
    if not (path / ST_MODULES).is_file():
        return None
    modules = _read_json(path / ST_MODULES)
    layout = STLayout(path, {})
    for module in modules if isinstance(modules, list) else []:
        kind, where = str(module.get("type", "")), path / str(module.get("path", ""))
        if kind.endswith("Transformer"):
            layout.transformer = where
        elif kind.endswith("Pooling"):
            layout.values.update(_read_pooling(where / "config.json"))
        elif kind.endswith("Normalize"):
            layout.values["normalize"] = True
        elif kind.endswith("Dense"):
            layout.dense = where
        else:
            raise FinetuneError(f"{path / ST_MODULES}: module {kind!r} is not supported (Transformer, Pooling, "
                                f"Normalize, Dense)")
    if layout.dense is None:  # without a Normalize module the embeddings are raw (tokens are always normalized)
        layout.values.setdefault("normalize", False)
    st_config = layout.transformer / "sentence_bert_config.json"
    config = _read_json(st_config) if st_config.is_file() else {}
    longest = config.get("max_seq_length")
    if not longest and (layout.transformer / "tokenizer_config.json").is_file():
        # sentence-transformers 6 keeps it as the tokenizer's model_max_length (10**30 and such: unset)
        longest = _read_json(layout.transformer / "tokenizer_config.json").get("model_max_length")
        longest = longest if isinstance(longest, int) and longest < 1_000_000 else None
    if longest:
        layout.values["query_max_length"] = layout.values["document_max_length"] = int(longest)
    for kind in KINDS:  # sentence-transformers 6's per-task lengths (encode_query, encode_document) win
        if config.get(f"{kind}_length"):
            layout.values[f"{kind}_max_length"] = int(config[f"{kind}_length"])
    layout.lowercase_text = bool(config.get("do_lower_case", False))
    layout.values.update(_read_prompts(path / "config_sentence_transformers.json"))
    return layout


def _read_pooling(file: Path) -> dict[str, Any]:
    config = _read_json(file)
    if isinstance(config.get("pooling_mode"), str):  # sentence-transformers 6 names the mode
        modes = [f"pooling_mode_{config['pooling_mode']}"]
    else:  # earlier ones set a flag per mode
        modes = [name for name, on in config.items() if name.startswith("pooling_mode_") and on]
    names = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_mean": "mean",
             "pooling_mode_cls": "cls"}
    if len(modes) != 1 or modes[0] not in names:
        raise FinetuneError(f"{file}: pooling {', '.join(modes) or 'none'} is not supported (mean or cls: "
                            f"pooling_mode_mean_tokens, pooling_mode_cls_token, or pooling_mode mean, cls)")
    if config.get("include_prompt", True) is False:
        raise FinetuneError(f"{file}: include_prompt=false is not supported (the prefix is pooled with the text)")
    return {"pooling": names[modes[0]]}


def _read_prompts(file: Path) -> dict[str, Any]:
    """Prefixes from ``prompts`` (``query``/``document``, or PyLate's ``query_prefix``...)."""
    if not file.is_file():
        return {}
    config = _read_json(file)
    values: dict[str, Any] = {}
    prompts = config.get("prompts") or {}
    for kind in KINDS:
        if prompts.get(kind):
            values[f"{kind}_prefix"] = prompts[kind]
    for kind in KINDS:  # PyLate's ColBERT: marker tokens and lengths of its own
        if isinstance(config.get(f"{kind}_prefix"), str):
            values[f"{kind}_marker"] = config[f"{kind}_prefix"]
        if config.get(f"{kind}_length"):
            values[f"{kind}_max_length"] = int(config[f"{kind}_length"])
    if "do_query_expansion" in config:
        values["query_expansion"] = bool(config["do_query_expansion"])
    if config.get("truncate_dim"):  # what SentenceTransformer(dir) truncates to
        values["truncate_dim"] = int(config["truncate_dim"])
    return values


# ---------------------------------------------------------------- the models


PackedPath = Literal["documents", "flex"]
FLEX_BLOCK = 128  # FlexAttention's block of queries and keys


def packing_path(device: torch.device, cfg: ModelConfig, training: bool) -> PackedPath | None:
    """How a batch of texts runs on ``device``: as one packed row attended one text at a time by
    SDPA ("documents": the CPU), as one packed row under a FlexAttention block mask ("flex": CUDA,
    torch's fused kernel, which skips the blocks between texts), or padded (None). FlexAttention has
    no dropout, so a training batch of a model with attention dropout runs padded on CUDA: a packed
    row's dense (N × N) mask would cost more than the padding it saves."""
    if device.type == "cpu":
        return "documents"
    if device.type == "cuda" and not (training and cfg.attention_probs_dropout_prob > 0):
        return "flex"
    return None


def flex_row_length(tokens: int) -> int:
    """The length a packed row of ``tokens`` is padded to for FlexAttention: a multiple of its block,
    from a geometric series of about 2^(1/4) (at most a third more past 512 tokens, 23 % past 2,048), so
    that a compiled model (its layers compiled per shape) meets a few shapes per kind of text."""
    length = FLEX_BLOCK
    while length < tokens:
        length = -(-int(length * 2 ** 0.25) // FLEX_BLOCK) * FLEX_BLOCK
    return length


@contextlib.contextmanager
def block_masks(encoder: nn.Module, on: bool):
    """The encoder's masks as FlexAttention block masks (``on``: its kernel for any length) or not, for the
    calls inside."""
    before = encoder.flex
    encoder.flex = on  # type: ignore[assignment]  # (mypy reads it as a submodule)
    try:
        with flex_any_length() if on else contextlib.nullcontext():
            yield
    finally:
        encoder.flex = before


def token_states(encoder: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 packed: bool | PackedPath = False, grouped: bool = True) -> torch.Tensor:
    """The encoder's last hidden states (B, T, H), of either family (BERT's token types all 0).

    ``packed``: the padded batch's tokens run as one packed row (each text a sequence of it, at
    its padded positions), so that no layer computes padding and each text attends to itself
    alone: one attention per text ("documents", or True: models.bert.Documents on the CPU, texts of
    near lengths in one SDPA call, or with ``grouped=False`` one call per text), or a FlexAttention
    block mask ("flex": the row padded to :func:`flex_row_length`, the padding a sequence of its own
    that no text sees; the kernel compiled for any length on CUDA: models.bert.flex_any_length); the
    states are then put back at their places, zeros at
    the padding, which what reads them (pooling) ignores."""
    if packed and not bool(attention_mask.all()):
        keep = attention_mask.bool()
        B, T = input_ids.shape
        columns = torch.arange(T, device=input_ids.device).expand(B, T)
        rows = torch.arange(1, B + 1, device=input_ids.device)[:, None].expand(B, T)
        ids, row = input_ids[keep][None], {"position_ids": columns[keep][None], "sequence_ids": rows[keep][None]}
        tokens = ids.shape[1]
        if packed == "flex":  # padding: token 0, position 0, sequence 0
            extra = flex_row_length(tokens) - tokens
            ids, row = F.pad(ids, (0, extra)), {name: F.pad(value, (0, extra)) for name, value in row.items()}
        with block_masks(encoder, packed == "flex"), grouped_documents(grouped):
            states = encoder(ids, **row) if isinstance(encoder, ModernBertModel) else encoder(ids, **row)[0]
        return states.new_zeros((B, T, states.shape[-1])).index_put((keep,), states[0, :tokens])
    if isinstance(encoder, ModernBertModel):
        return encoder(input_ids, attention_mask)
    return encoder(input_ids, None, attention_mask)[0]


class TextModel(nn.Module):
    """What both kinds of embedding model share: the encoder, its tokenizer, the settings, and
    batches of texts (longest first, for less padding; given back in input order)."""

    def __init__(self, encoder: nn.Module, ids: TextIds, settings: EmbeddingSettings):
        super().__init__()
        settings.check()
        self.encoder, self.ids, self.settings = encoder, ids, settings
        pooler = getattr(encoder, "pooler", None)
        if pooler is not None:  # BERT's pooler is no part of an embedding: kept (exports carry it), not trained
            pooler.requires_grad_(False)

    @property
    def config(self) -> ModelConfig:
        return typing.cast(ModelConfig, self.encoder.config)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def marker(self, kind: str) -> int | None:
        return None

    def tokenize(self, texts: Sequence[str], kind: str) -> list[list[int]]:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
        prefix = self.settings.prefix(kind)
        return self.ids([prefix + t for t in texts], self.settings.max_length(kind), self.marker(kind))

    def batch(self, rows: Sequence[Sequence[int]], kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, attention mask) of tokenized rows, on the model's device."""
        ids, mask = pad(rows, self.ids.pad_id)
        return ids.to(self.device), mask.to(self.device)

    def embed(self, texts: Sequence[str], kind: str) -> torch.Tensor:
        """The embeddings of ``texts`` as the model's forward gives them (with grad when training)."""
        return self(*self.batch(self.tokenize(texts, kind), kind))

    def sorted_batches(self, texts: Sequence[str], kind: str, batch_size: int):
        """(positions, ids, mask) per batch, longest texts first."""
        rows = self.tokenize(texts, kind)
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
        for first in range(0, len(order), batch_size):
            chosen = order[first:first + batch_size]
            yield chosen, *self.batch([rows[i] for i in chosen], kind)


class Embedder(TextModel):
    """One vector per text: the encoder's token states pooled (mean of the real tokens, or [CLS])
    and, with ``settings.normalize``, L2-normalized. A batch runs packed where :func:`packing_path`
    says (see :func:`token_states`): the same embeddings (to float rounding) without computing padding.
    ``packed = False`` runs it padded, ``grouped = False`` packed with one SDPA per text on the CPU
    (benchmarks/retrieval_step.py compares the three)."""

    packed = True
    grouped = True

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        path = packing_path(input_ids.device, self.config, self.training) if self.packed else None
        states = token_states(self.encoder, input_ids, attention_mask, packed=path or False, grouped=self.grouped)
        embeddings = pool(states, attention_mask, self.settings.pooling)
        return F.normalize(embeddings, dim=-1) if self.settings.normalize else embeddings

    @property
    def dim(self) -> int:
        return self.config.hidden_size

    @torch.no_grad()
    def encode(self, texts: Sequence[str], kind: str = "query", batch_size: int = 64) -> torch.Tensor:
        """(n, dim) float32 on the CPU, in the order of ``texts``; in eval mode, without gradients. With
        ``settings.truncate_dim`` the first that many dimensions, as they are (sentence-transformers'
        truncate_dim: not normalized again; cosine scores renormalize)."""
        width = self.settings.truncate_dim or self.dim
        out = torch.zeros((len(texts), width), dtype=torch.float32)
        was_training = self.training
        self.eval()
        try:
            for positions, ids, mask in self.sorted_batches(texts, kind, batch_size):
                out[positions] = self(ids, mask)[:, :width].float().cpu()
        finally:
            self.train(was_training)
        return out


class LateInteraction(TextModel):
    """ColBERT: one L2-normalized vector per token, through a linear projection (PyLate's model)."""

    def __init__(self, encoder: nn.Module, ids: TextIds, settings: EmbeddingSettings,
                 projection: nn.Linear | None = None, source: str = "the model"):
        super().__init__(encoder, ids, settings)
        hidden = typing.cast(ModelConfig, encoder.config).hidden_size
        self.projection = projection or nn.Linear(hidden, settings.projection_dim, bias=False)
        if self.projection.in_features != hidden or self.projection.bias is not None:
            raise FinetuneError(f"{source}: the projection must map the hidden size {hidden} without a bias")
        markers = {"query": settings.query_marker, "document": settings.document_marker}
        self.markers: dict[str, int | None] = {kind: ids.token_id(token, source) if token else None
                                               for kind, token in markers.items()}
        # PyLate's skip-list: the punctuation characters that are tokens of the vocab
        found = map(ids.tokenizer.token_to_id, string.punctuation)
        self.skiplist: list[int] = sorted({i for i in found if i is not None})

    @property
    def dim(self) -> int:
        return self.projection.out_features

    def marker(self, kind: str) -> int | None:
        return self.markers[kind]

    def batch(self, rows: Sequence[Sequence[int]], kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        if kind == "query" and self.settings.query_expansion:  # [MASK] up to the full length, not attended to
            ids, mask = pad(rows, self.ids.mask_id, self.settings.query_max_length)
        else:
            ids, mask = pad(rows, self.ids.pad_id)
        return ids.to(self.device), mask.to(self.device)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B, T, dim) normalized token embeddings, padding included (:meth:`kept` says which count)."""
        states = token_states(self.encoder, input_ids, attention_mask)
        return F.normalize(self.projection(states), dim=-1)

    def kept(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, kind: str) -> torch.Tensor:
        """(B, T) bool: the tokens that are scored. Queries with expansion: all of them; documents:
        the attended ones but punctuation."""
        if kind == "query":
            return torch.ones_like(attention_mask, dtype=torch.bool) if self.settings.query_expansion \
                else attention_mask.bool()
        skip = torch.isin(input_ids, torch.tensor(self.skiplist, dtype=input_ids.dtype, device=input_ids.device))
        return attention_mask.bool() & ~skip

    @torch.no_grad()
    def encode(self, texts: Sequence[str], kind: str = "query", batch_size: int = 64) -> list[torch.Tensor]:
        """One (tokens_i, dim) float32 CPU tensor per text, in the order of ``texts``: the scored tokens."""
        out: list[torch.Tensor] = [torch.empty(0)] * len(texts)
        was_training = self.training
        self.eval()
        try:
            for positions, ids, mask in self.sorted_batches(texts, kind, batch_size):
                embeddings, kept = self(ids, mask).float().cpu(), self.kept(ids, mask, kind).cpu()
                for row, position in enumerate(positions):
                    out[position] = embeddings[row][kept[row]]
        finally:
            self.train(was_training)
        return out


# ---------------------------------------------------------------- loading


def load_embedder(path: str | Path, vocab: str | Path | None = None, **overrides: Any) -> Embedder | LateInteraction:
    """The embedding model at ``path``: ours (with its ``retrieval.yaml`` when fine-tuned for
    retrieval), a transformers directory or a model id in the local cache, or a
    sentence-transformers (or PyLate) directory. ``overrides`` set :class:`EmbeddingSettings`
    fields over what the directory says; ``late_interaction=True`` (or a PyLate directory, or a
    fine-tuned late-interaction model) gives a :class:`LateInteraction`."""
    path = find_model(path, FinetuneError)
    layout = read_st_layout(path) if path.is_dir() else None
    transformer = layout.transformer if layout else path
    values = directory_settings(path, layout)
    values.update({k: v for k, v in overrides.items() if v is not None})
    settings = settings_from(values, str(path))
    encoder = load_model(transformer, head="encoder").float()
    ids = text_ids(transformer, vocab, layout.lowercase_text if layout else False)
    if not settings.late_interaction:
        hidden = typing.cast(ModelConfig, encoder.config).hidden_size
        if settings.truncate_dim > hidden:
            raise FinetuneError(f"{path}: truncate_dim={settings.truncate_dim} is more than the model's {hidden} "
                                f"dimensions")
        return Embedder(encoder, ids, settings)
    projection = _load_projection(layout.dense, str(path)) if layout and layout.dense else None
    if projection is None and path.is_dir() and (path / PROJECTION_FILE).is_file():
        projection = _load_projection(path, str(path), PROJECTION_FILE)
    if projection is not None:  # its size is the weights'
        settings.projection_dim = projection.out_features
    return LateInteraction(encoder, ids, settings, projection, str(path))


def directory_settings(path: str | Path, layout: STLayout | None = None) -> dict[str, Any]:
    """The :class:`EmbeddingSettings` fields that the model directory at ``path`` sets itself: a
    sentence-transformers (or PyLate) directory's modules and configs, our ``retrieval.yaml``;
    ``{}`` for a plain encoder (ours or a transformers one), whose settings are the defaults."""
    path = find_model(path, FinetuneError)
    if not path.is_dir():
        return {}
    layout = layout or read_st_layout(path)
    values: dict[str, Any] = {}
    if layout is not None:
        values.update(layout.values)
        if layout.dense is not None:
            values["late_interaction"] = True
    if (path / SETTINGS_FILE).is_file():
        import yaml

        names = {f.name for f in dataclasses.fields(EmbeddingSettings)}
        saved = yaml.safe_load((path / SETTINGS_FILE).read_text(encoding="utf-8")) or {}
        values.update({k: v for k, v in saved.items() if k in names})
    return values


PROJECTION_FILE = "projection.safetensors"  # our late-interaction model's projection, beside its encoder


def _load_projection(directory: Path, source: str, name: str = "model.safetensors") -> nn.Linear:
    """A projection ``linear.weight`` (sentence-transformers' and PyLate's Dense) from ``directory``."""
    from safetensors.torch import load_file

    file = directory / name
    if not file.is_file():
        raise FinetuneError(f"{source}: {file} is missing (the projection's weights)")
    state = load_file(file)
    weight = state.get("linear.weight")
    if weight is None or weight.dim() != 2 or "linear.bias" in state:
        raise FinetuneError(f"{file}: expected one linear.weight (out, in) without a bias")
    projection = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        projection.weight.copy_(weight.float())
    return projection
