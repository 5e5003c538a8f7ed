"""SQuAD training-step and inference throughput on synthetic SQuAD-shaped batches.

    bertforge bench squad --model base --batch-size 8 --seq-len 384 --steps 10 --json

``--model`` is a preset (tiny … large, random weights) or a model directory
(our checkpoint, a SQuAD fine-tune, a Hugging Face BERT), loaded with a QA
head. Every synthetic sequence is ``seq_len`` real tokens: a question of
``squad.max_query_length`` tokens (segment 0) and a context (segment 1),
answer spans inside the context, no padding. So the numbers are those of the
longest windows; real SQuAD windows are shorter on average, and prediction
(``predict_logits``) trims each batch to its longest real window.

Training times whole optimizer steps (forward, backward, clip, AdamW as
configured by ``--config``, squad_base by default) after ``warmup`` steps;
inference times forward passes under ``torch.inference_mode``. Peak memory
is counted from before the model is built (see :class:`bertforge.bench.pretrain.PeakMemory`);
inference runs first, so training's peak includes it.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bertforge.config import MODEL_PRESETS, Config, ConfigError, ModelConfig, apply_model_preset
from bertforge.models.bert import num_parameters
from bertforge.models.families import model_class
from bertforge.parallel.dist import DistContext, resolve_device
from bertforge.tasks.squad.postprocess import MAX_ANSWER_LENGTH
from bertforge.tasks.squad.train import SquadConfig, qa_forward_loss
from bertforge.training.engine import Engine, autocast, set_threads
from bertforge.training.optim import build_optimizer, build_scheduler

from .pretrain import PeakMemory, synchronize

MODES = ("train", "infer", "both")


def synthetic_batch(batch_size: int, seq_len: int, vocab_size: int, query_len: int, seed: int
                    ) -> dict[str, torch.Tensor]:
    """Random token ids shaped like SQuAD windows: question, context, an answer span in the context."""
    generator = torch.Generator().manual_seed(seed)
    context_start = min(query_len + 2, seq_len - 2)  # [CLS] question [SEP]
    context_len = seq_len - 1 - context_start        # context [SEP]
    segments = torch.zeros(batch_size, seq_len, dtype=torch.long)
    segments[:, context_start:] = 1
    start = context_start + torch.randint(0, context_len, (batch_size,), generator=generator)
    length = torch.randint(0, MAX_ANSWER_LENGTH, (batch_size,), generator=generator)
    end = torch.minimum(start + length, torch.tensor(seq_len - 2))
    return {"input_ids": torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator),
            "token_type_ids": segments,
            "attention_mask": torch.ones(batch_size, seq_len, dtype=torch.long),
            "start_positions": start, "end_positions": end}


def build_model(model: str | Path, m: ModelConfig, seed: int) -> nn.Module:
    """A preset with random weights, of the shape ``m`` has (the caller has applied the preset to it),
    or a model directory with a QA head, of either family (its own config is the model's ``config``)."""
    if str(model) in MODEL_PRESETS:
        torch.manual_seed(seed)
        return model_class(m, "qa")(m)
    from bertforge.formats.load import load_model

    if not Path(model).is_dir():
        raise ConfigError(f"--model {model}: neither a preset ({', '.join(MODEL_PRESETS)}) "
                          "nor a model directory")
    torch.manual_seed(seed)  # a QA head the directory lacks is initialised from the seed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a new QA head is expected for an encoder
        return load_model(model, head="qa")


def _timed(run: Callable[[], Any], steps: int, warmup: int, device: torch.device) -> tuple[float, Any]:
    """Seconds for ``steps`` calls after ``warmup`` untimed ones, and the last result."""
    out = None
    for _ in range(warmup):
        out = run()
    synchronize(device)
    started = time.perf_counter()
    for _ in range(steps):
        out = run()
    synchronize(device)
    return time.perf_counter() - started, out


def _rates(prefix: str, elapsed: float, steps: int, batch_size: int, seq_len: int) -> dict[str, float]:
    seq_per_s = steps * batch_size / elapsed
    return {f"{prefix}_step_ms": round(1000 * elapsed / steps, 2),
            f"{prefix}_seq_per_s": round(seq_per_s, 2),
            f"{prefix}_tokens_per_s": round(seq_per_s * seq_len, 1)}


def bench_squad(cfg: Config, squad: SquadConfig, model: str | Path = "tiny", batch_size: int = 8,
                seq_len: int = 384, steps: int = 10, warmup: int = 2, mode: str = "both"
                ) -> dict[str, Any]:
    """Training-step and/or inference throughput and peak memory; one flat dict.

    Keys with ``train_`` / ``infer_`` prefixes are present for the modes run.
    """
    if mode not in MODES:
        raise ConfigError(f"--mode {mode!r}: one of {', '.join(MODES)}")
    for name, value, least in (("--batch-size", batch_size, 1), ("--steps", steps, 1),
                               ("--warmup", warmup, 0), ("--seq-len", seq_len, 8)):
        if value < least:
            raise ConfigError(f"{name} {value}: must be at least {least}")
    set_threads(cfg.execution.threads)
    device = resolve_device(cfg.execution.device)
    precision = cfg.execution.precision
    memory = PeakMemory(device)
    preset = str(model) in MODEL_PRESETS
    if preset:
        apply_model_preset(cfg, str(model))  # cfg.model takes the preset's shape
    qa = build_model(model, cfg.model, cfg.train.seed)
    if not preset:
        cfg.model = qa.config  # type: ignore[assignment]  # (mypy reads it as a submodule)
    if seq_len > cfg.model.max_position_embeddings:
        raise ConfigError(f"--seq-len {seq_len} exceeds the model's "
                          f"max_position_embeddings={cfg.model.max_position_embeddings}")
    qa.to(device)
    batch = {k: v.to(device) for k, v in synthetic_batch(
        batch_size, seq_len, cfg.model.vocab_size, min(squad.max_query_length, seq_len // 2),
        cfg.train.seed).items()}
    inputs = (batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
    result: dict[str, Any] = {
        "model": "bertforge", "task": "squad", "mode": mode, "source": str(model),
        "layers": cfg.model.num_hidden_layers, "hidden": cfg.model.hidden_size,
        "params_m": round(num_parameters(qa) / 1e6, 2),
        "device": str(device), "precision": precision, "threads": torch.get_num_threads(),
        "batch_size": batch_size, "seq_len": seq_len, "steps": steps, "warmup": warmup,
    }
    if mode in ("infer", "both"):
        qa.eval()

        @torch.inference_mode()
        def infer() -> None:
            with autocast(device, precision):
                qa(*inputs)

        elapsed, _ = _timed(infer, steps, warmup, device)
        result.update(_rates("infer", elapsed, steps, batch_size, seq_len))
        result["infer_peak_mem_mb"] = round(memory.peak_mb(), 1)
    if mode in ("train", "both"):
        qa.train()
        cfg.train.schedule, cfg.train.warmup_steps = "constant", 0  # the lr does not change the cost
        optimizer = build_optimizer(qa, cfg.train)
        engine = Engine(qa, optimizer, build_scheduler(optimizer, cfg.train, steps + warmup), qa_forward_loss,
                        precision, cfg.train.grad_clip, DistContext(device=device))
        elapsed, out = _timed(lambda: engine.step([batch], 1), steps, warmup, device)
        result["optimizer"] = cfg.train.optimizer
        result.update(_rates("train", elapsed, steps, batch_size, seq_len))
        result["train_peak_mem_mb"] = round(memory.peak_mb(), 1)
        result["final_loss"] = round(out["loss"].item(), 4)
    return result
