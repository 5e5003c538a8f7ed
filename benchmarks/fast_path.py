"""The model's fast path against what it replaced, in one run: time and kept memory.

    python benchmarks/fast_path.py                           # BERT-base layers, 8 × 128, CPU
    python benchmarks/fast_path.py --model large --layers 2 --batch-size 8 --json

Two changes of bertforge/models/bert.py, each against its predecessor, written out
here as it was, taking turns a repetition each (so that the load of a shared
machine slows both alike), on an encoder of ``--layers`` layers:

- ``qkv``: under bf16 autocast, one (3H × H) matmul for query, key and
  value, against three (H × H) ones (in fp32 the model runs the three).
- ``residual``: under bf16 autocast, LayerNorm taking and handing on bf16,
  against autocast's own fp32 LayerNorm (an fp32 residual stream).

Reported for each: the median time of forward + backward, and the bytes the
forward leaves for the backward (``bench.LiveTensorBytes``). On CUDA the
tensors are the device's and times are synchronised.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bertforge.models.bert as bert  # noqa: E402
from bertforge.bench.pretrain import LiveTensorBytes, synchronize  # noqa: E402
from bertforge.config import MODEL_PRESETS, ModelConfig  # noqa: E402
from bertforge.models.bert import BertEncoder, BertSelfAttention  # noqa: E402


def three_projections(self: BertSelfAttention, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Self-attention as it was before the fused projection: query, key and value apart."""
    B, T, H = x.shape

    def heads(t: torch.Tensor) -> torch.Tensor:
        return t.view(B, T, self.num_heads, H // self.num_heads).transpose(1, 2)

    out = F.scaled_dot_product_attention(
        heads(self.query(x)), heads(self.key(x)), heads(self.value(x)),
        attn_mask=mask, dropout_p=self.dropout_p if self.training else 0.0)
    return out.transpose(1, 2).reshape(B, T, H)


@contextlib.contextmanager
def previous(change: str) -> Iterator[None]:
    """The model as it was before ``change``."""
    if change == "qkv":
        saved, BertSelfAttention._attend = BertSelfAttention._attend, three_projections  # type: ignore[method-assign]
        try:
            yield
        finally:
            BertSelfAttention._attend = saved  # type: ignore[method-assign]
    else:
        saved_check, bert.bf16_autocast = bert.bf16_autocast, lambda device: False
        try:
            yield
        finally:
            bert.bf16_autocast = saved_check


def measure(encoder: BertEncoder, x: torch.Tensor, precision: str) -> tuple[float, int]:
    """(seconds of forward + backward, bytes the forward keeps for the backward)."""
    amp = (torch.autocast(x.device.type, dtype=torch.bfloat16) if precision == "bf16"
           else contextlib.nullcontext())
    live = LiveTensorBytes()
    synchronize(x.device)
    start = time.perf_counter()
    with live, amp:
        out = encoder(x, None)
    kept = live.live
    out.float().sum().backward()
    synchronize(x.device)
    return time.perf_counter() - start, kept


def compare(encoder: BertEncoder, x: torch.Tensor, change: str, precision: str, repeats: int) -> dict:
    times: dict[str, list[float]] = {"before": [], "after": []}
    kept: dict[str, int] = {}
    runs: list[tuple[str, Callable[[], contextlib.AbstractContextManager]]] = [
        ("before", lambda: previous(change)), ("after", contextlib.nullcontext)]
    for repeat in range(repeats + 1):  # the first round warms up
        for name, context in runs:
            with context():
                seconds, kept[name] = measure(encoder, x, precision)
            if repeat:
                times[name].append(seconds)
            encoder.zero_grad(set_to_none=True)
    before, after = (statistics.median(times[k]) for k in ("before", "after"))
    return {
        "change": change, "precision": precision,
        "before_ms": round(1000 * before, 2), "after_ms": round(1000 * after, 2),
        "speedup": round(before / after, 3),
        "kept_before_mb": round(kept["before"] / 2**20, 2), "kept_after_mb": round(kept["after"] / 2**20, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="base", choices=sorted(MODEL_PRESETS))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    cfg = ModelConfig(**{**MODEL_PRESETS[args.model], "num_hidden_layers": args.layers})
    device = torch.device(args.device)
    encoder = BertEncoder(cfg).to(device).train()
    x = torch.randn(args.batch_size, args.seq_len, cfg.hidden_size, device=device, requires_grad=True)
    results = [compare(encoder, x, "qkv", "bf16", args.repeats),
               compare(encoder, x, "residual", "bf16", args.repeats)]
    setting = {"model": args.model, "layers": args.layers, "batch_size": args.batch_size,
               "seq_len": args.seq_len, "device": str(device), "threads": torch.get_num_threads()}
    if args.json:
        print(json.dumps({**setting, "results": results}))
        return
    print(" ".join(f"{k}={v}" for k, v in setting.items()))
    for r in results:
        print(f"{r['change']:>8} {r['precision']}: {r['before_ms']} → {r['after_ms']} ms "
              f"({r['speedup']}×), kept {r['kept_before_mb']} → {r['kept_after_mb']} MiB")


if __name__ == "__main__":
    main()
