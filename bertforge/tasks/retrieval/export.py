"""Embedding models as the retrieval ecosystem loads them: sentence-transformers and PyLate directories.

A sentence-transformers directory is the transformers model at its root (``config.json``,
``model.safetensors``, the tokenizer files) and the modules that follow it, listed in
``modules.json``: ``1_Pooling`` (mean or CLS) and, when normalizing, ``2_Normalize``;
``sentence_bert_config.json`` holds the maximum lengths: ``query_length`` and ``document_length``
(sentence-transformers 6 cuts ``encode_query`` and ``encode_document`` texts at them) and
``max_seq_length``, the documents' (for a plain ``encode``); ``config_sentence_transformers.json``
the prefixes as the prompts ``query`` and ``document`` (``SentenceTransformer.encode_query`` /
``encode_document`` put them first), ``truncate_dim`` when the model truncates, and the
dimensions a Matryoshka loss trained (``matryoshka_dims``, also said in ``README.md``).

A :class:`~.model.LateInteraction` becomes PyLate's ColBERT directory: the transformer, then
``1_Dense`` (the projection as ``linear.weight``, no bias, identity activation), with the
markers, lengths, query expansion and skip-list in ``config_sentence_transformers.json``.
Both are read back by :func:`~.model.load_embedder`.
"""

from __future__ import annotations

import json
import shutil
import string
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from safetensors.torch import save_file
from torch import nn

from bertforge.config import ModelConfig
from bertforge.data.vocab import is_tokenizer_json
from bertforge.fileio import atomic_directory
from bertforge.formats.hf import hf_config_from_model_config
from bertforge.formats.weights import check_export_target, save_weights

from .model import (
    PYLATE_DENSE,
    ST_MODULES,
    ST_NORMALIZE,
    ST_POOLING,
    ST_TRANSFORMER,
    Embedder,
    LateInteraction,
    TextIds,
)

TOKEN_NAMES = {"cls_token": "cls_id", "sep_token": "sep_id", "pad_token": "pad_id", "mask_token": "mask_id"}


def _write_json(file: Path, value: Any) -> None:
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")


def _matryoshka_card(hidden: int, dims: Sequence[int]) -> str:
    sizes = ", ".join(map(str, dims))
    return (f"# Matryoshka embeddings\n\nTrained with a Matryoshka loss (bertforge retrieval train "
            f"--matryoshka-dims) at {sizes} dimensions: the first N of the {hidden} dimensions of an embedding, "
            f"for N one of {sizes}, are an embedding on their own (cosine similarity).\n\n"
            f"```python\nfrom sentence_transformers import SentenceTransformer\n\n"
            f"model = SentenceTransformer(\"path/to/this/directory\", truncate_dim={dims[-1]})\n```\n")


def write_transformer(model: Embedder | LateInteraction, directory: Path) -> None:
    """The encoder as a transformers directory: config.json, model.safetensors and the tokenizer
    (its tokenizer.json as it is, or its vocab.txt with a BertTokenizer config)."""
    write_hf_model(model.encoder, model.ids, directory,
                   max(model.settings.query_max_length, model.settings.document_max_length))


def write_hf_model(module: nn.Module, ids: TextIds, directory: Path, max_length: int,
                   extra: dict[str, Any] | None = None) -> None:
    """``module`` (an encoder, or a task model of ours with transformers' names) as a transformers
    directory: config.json (with ``extra``), model.safetensors and the tokenizer, whose
    ``model_max_length`` is ``max_length``."""
    config = hf_config_from_model_config(typing.cast(ModelConfig, module.config), [type(module).__name__])
    config.update(extra or {})
    tokens = {name: ids.tokenizer.id_to_token(getattr(ids, attribute)) for name, attribute in TOKEN_NAMES.items()}
    if config["model_type"] == "modernbert":  # ModernBertConfig's ids are the tokenizer's
        config.update({"cls_token_id": ids.cls_id, "sep_token_id": ids.sep_id, "pad_token_id": ids.pad_id,
                       "bos_token_id": ids.cls_id, "eos_token_id": ids.sep_id})
    config["dtype"] = "float32"
    save_weights(module, directory / "model.safetensors")
    _write_json(directory / "config.json", config)
    if ids.file is None:
        raise ValueError("the model's tokenizer has no file to export")
    if is_tokenizer_json(ids.file):
        shutil.copyfile(ids.file, directory / "tokenizer.json")
        tokenizer_config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", **tokens}
        if config["model_type"] == "bert":  # else PreTrainedTokenizerFast gives no token types (all 0 then)
            tokenizer_config["model_input_names"] = ["input_ids", "token_type_ids", "attention_mask"]
    else:
        shutil.copyfile(ids.file, directory / "vocab.txt")
        tokenizer_config = {"tokenizer_class": "BertTokenizer", "do_lower_case": ids.lowercase,
                            "unk_token": "[UNK]", **tokens}
    tokenizer_config["model_max_length"] = max_length
    _write_json(directory / "tokenizer_config.json", tokenizer_config)


def export_sentence_transformers(model: Embedder | LateInteraction, out_dir: str | Path,
                                 overwrite: bool = False, matryoshka_dims: Sequence[int] = (),
                                 own: Path | None = None) -> Path:
    """Write ``model`` as a sentence-transformers directory (a :class:`LateInteraction` as PyLate's),
    whole or not at all; returns it. ``matryoshka_dims``: the sizes its training made usable
    (SentenceTransformer(dir, truncate_dim=N) for one of them). ``own``: the lock of the run this
    process is, which may replace its own export (check_export_target)."""
    out_dir = Path(out_dir)
    check_export_target(out_dir, overwrite, own)
    settings = model.settings
    with atomic_directory(out_dir) as tmp:
        write_transformer(model, tmp)
        modules = [{"idx": 0, "name": "0", "path": "", "type": ST_TRANSFORMER}]
        if isinstance(model, LateInteraction):
            _write_json(tmp / "sentence_bert_config.json", {"max_seq_length": settings.document_max_length,
                                                            "do_lower_case": model.ids.lowercase_text})
            modules.append({"idx": 1, "name": "1", "path": "1_Dense", "type": PYLATE_DENSE})
            projection = model.projection
            (tmp / "1_Dense").mkdir()
            save_file({"linear.weight": projection.weight.detach().cpu().contiguous()},
                      str(tmp / "1_Dense" / "model.safetensors"), metadata={"format": "pt"})
            _write_json(tmp / "1_Dense" / "config.json", {
                "in_features": projection.in_features, "out_features": projection.out_features, "bias": False,
                "activation_function": "torch.nn.modules.linear.Identity"})
            _write_json(tmp / "config_sentence_transformers.json", {
                "model_type": "ColBERT", "prompts": {}, "default_prompt_name": None, "similarity_fn_name": "MaxSim",
                "query_prefix": settings.query_marker, "document_prefix": settings.document_marker,
                "query_length": settings.query_max_length, "document_length": settings.document_max_length,
                "attend_to_expansion_tokens": False, "do_query_expansion": settings.query_expansion,
                "skiplist_words": list(string.punctuation)})
        else:
            hidden = model.dim
            modules.append({"idx": 1, "name": "1", "path": "1_Pooling", "type": ST_POOLING})
            _write_json(tmp / "1_Pooling" / "config.json", {
                "word_embedding_dimension": hidden, "pooling_mode_cls_token": settings.pooling == "cls",
                "pooling_mode_mean_tokens": settings.pooling == "mean", "pooling_mode_max_tokens": False,
                "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
                "pooling_mode_lasttoken": False, "include_prompt": True})
            if settings.normalize:
                modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": ST_NORMALIZE})
                (tmp / "2_Normalize").mkdir()
            _write_json(tmp / "sentence_bert_config.json", {
                "max_seq_length": settings.document_max_length, "query_length": settings.query_max_length,
                "document_length": settings.document_max_length, "do_lower_case": model.ids.lowercase_text})
            prompts = {kind: settings.prefix(kind) for kind in ("query", "document") if settings.prefix(kind)}
            config: dict[str, Any] = {"model_type": "SentenceTransformer", "prompts": prompts,
                                      "default_prompt_name": None, "similarity_fn_name": "cosine"}
            if settings.truncate_dim:
                config["truncate_dim"] = settings.truncate_dim
            if matryoshka_dims:  # no key of sentence-transformers' (it ignores it): the card says it to people
                config["matryoshka_dims"] = sorted(matryoshka_dims, reverse=True)
                (tmp / "README.md").write_text(_matryoshka_card(hidden, config["matryoshka_dims"]), encoding="utf-8")
            _write_json(tmp / "config_sentence_transformers.json", config)
        _write_json(tmp / ST_MODULES, modules)
    return out_dir
