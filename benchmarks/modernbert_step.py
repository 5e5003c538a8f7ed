"""One ModernBERT training step, bertforge against transformers' ModernBertForMaskedLM, in one process.

    python benchmarks/modernbert_step.py                       # CPU: 4 layers, hidden 256, vocab 50368
    python benchmarks/modernbert_step.py --device cuda --precision bf16 --attention flex --layers 22 \
        --hidden 768 --heads 12 --intermediate 1152 --json    # ModernBERT-base, rows that fill the GPU

Both sides train the same model (the same weights, copied from ours into
theirs; ModernBERT's 50368-token vocab, so that the vocab projection costs
what it costs) on the same sequences (lengths drawn from 64 to 512, 30 % of
each one's tokens masked, as ModernBERT's recipe), with torch's AdamW:

* bertforge: the sequences packed in order into ``--rows`` rows of
  ``--seq-len`` tokens (``sequence_ids``, ``position_ids`` from 0 in each
  sequence; the rest of a row is padding), only the masked positions reach
  the head (``masked_lm_positions``); its attention as ``model.layers_mask``
  gives it (reported as ``ours_attention_path``): on the CPU one SDPA per
  document of the row (``models.bert.Documents``), on CUDA SDPA with an
  additive (B, 1, T, T) mask, or FlexAttention block masks (``--attention
  flex``, CUDA);
* transformers: the sequences as it runs them without flash-attn, a padded
  batch (to the longest) with ``attention_mask``, ``attn_implementation``
  ``--their-attention`` (sdpa by default, as transformers picks), twice: as
  configured by default (every position reaches the head, the loss ignores
  the unmasked ones) and with ``sparse_prediction=True`` (the masked
  positions gathered before the head).

Rows: one on the CPU; on CUDA, unless ``--rows`` is given, as many as the
memory planner (``parallel.plan.largest_micro_batch``) fits in half the GPU's
memory, at most 64 (``default_rows``): the other half is for transformers'
two models and their padded batch, whose dense head projects every position
onto the vocab; 64 when the planner cannot say.

Each side's MFU: the model FLOPs of its step as executed
(``models.flops.pretraining_flops``: its rows and their length, the
positions that reach the head; ours counts the whole row's T × T attention, as
bench pretrain does) per second, over the device's peak for the precision
(``models.flops.peak_tflops``, or ``--peak-tflops``); the achieved TFLOP/s are
reported always, MFU only where the peak is known (not on a CPU).

The three alternate step by step (warm-up steps first), so that a slower
stretch of a shared machine hits all of them; each reports the median of its
timed steps. Sequences per second count the real sequences of a step; the
start losses (no dropout: the same weights and masks) must agree.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch

SIDES = ("bertforge", "transformers", "transformers_sparse")


def make_sequences(count: int, vocab_size: int, mask_prob: float, seed: int,
                   longest: int = 512) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` (token ids, sorted masked positions) pairs, 64 to ``longest`` tokens each."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        n = int(torch.randint(64, longest + 1, (1,), generator=gen))
        ids = torch.randint(5, vocab_size, (n,), generator=gen)
        masked = torch.randperm(n, generator=gen)[:round(mask_prob * n)].sort().values
        out.append((ids, masked))
    return out


def pack(sequences: list[tuple[torch.Tensor, torch.Tensor]], rows: int, seq_len: int,
         pad_id: int) -> tuple[dict[str, torch.Tensor], int]:
    """As many of ``sequences`` as fill ``rows`` rows of ``seq_len`` in order (a sequence that does not fit
    starts the next row), as our packed batch; and how many went in."""
    placed: list[list[int]] = [[]]
    used = 0
    for i, (ids, _) in enumerate(sequences):
        if used + len(ids) > seq_len:
            if len(placed) == rows:
                break
            placed.append([])
            used = 0
        placed[-1].append(i)
        used += len(ids)
    P = max(sum(len(sequences[i][1]) for i in row) for row in placed)
    B = len(placed)
    batch = {"input_ids": torch.full((B, seq_len), pad_id), "sequence_ids": torch.zeros(B, seq_len, dtype=torch.long),
             "position_ids": torch.zeros(B, seq_len, dtype=torch.long),
             "masked_lm_positions": torch.zeros(B, P, dtype=torch.long),
             "masked_lm_ids": torch.zeros(B, P, dtype=torch.long), "masked_lm_weights": torch.zeros(B, P),
             "next_sentence_labels": torch.zeros(B, dtype=torch.long)}
    for r, row in enumerate(placed):
        start = predicted = 0
        for slot, i in enumerate(row, 1):
            ids, masked = sequences[i]
            n, m = len(ids), len(masked)
            batch["input_ids"][r, start:start + n] = ids
            batch["sequence_ids"][r, start:start + n] = slot
            batch["position_ids"][r, start:start + n] = torch.arange(n)
            batch["masked_lm_positions"][r, predicted:predicted + m] = start + masked
            batch["masked_lm_ids"][r, predicted:predicted + m] = ids[masked]
            batch["masked_lm_weights"][r, predicted:predicted + m] = 1
            start, predicted = start + n, predicted + m
    return batch, sum(map(len, placed))


def pad(sequences: list[tuple[torch.Tensor, torch.Tensor]], pad_id: int) -> dict[str, torch.Tensor]:
    """The sequences as transformers' padded batch: ids, ``attention_mask`` and labels (-100: not predicted)."""
    T = max(len(ids) for ids, _ in sequences)
    B = len(sequences)
    batch = {"input_ids": torch.full((B, T), pad_id), "attention_mask": torch.zeros(B, T, dtype=torch.long),
             "labels": torch.full((B, T), -100)}
    for b, (ids, masked) in enumerate(sequences):
        batch["input_ids"][b, :len(ids)] = ids
        batch["attention_mask"][b, :len(ids)] = 1
        batch["labels"][b, masked] = ids[masked]
    return batch


DEFAULT_ROWS = 64  # on CUDA when the planner cannot say, and the most it may choose


def default_rows(model, device_memory: int | None, seq_len: int, mask_prob: float, precision: str,
                 attention: str) -> tuple[int, str]:
    """Our packed rows a step on CUDA, and who chose them: the planner's largest micro-batch in half of
    ``device_memory`` bytes, at most 64 (see the module docstring), or 64 ("default") when the
    memory is unknown or the planner refuses the config."""
    from bertforge.config import Config, ConfigError, replaced, use_model
    from bertforge.parallel.plan import largest_micro_batch, plan_memory

    if device_memory is None:
        return DEFAULT_ROWS, "default"
    cfg = replaced(Config(), {"data.seq_len": seq_len, "data.max_predictions": math.ceil(mask_prob * seq_len),
                              "execution.precision": precision, "execution.attention": attention,
                              "execution.device": "cuda", "train.optimizer": "adamw"})
    use_model(cfg, model)
    try:
        rows = largest_micro_batch(
            lambda batch: plan_memory(replaced(cfg, {"train.micro_batch_size": batch,
                                                     "train.global_batch_size": batch}), device="cuda"),
            device_memory // 2, DEFAULT_ROWS)
    except ConfigError:
        return DEFAULT_ROWS, "default"
    return max(rows, 1), "planner"


def step_flops(model, rows: int, seq_len: int, predicted: int) -> int:
    """Training FLOPs of one step as executed: ``rows`` rows of ``seq_len`` tokens through the encoder,
    ``predicted`` positions in all through the masked-LM head (no [CLS] head: masked LM alone)."""
    from bertforge.models.flops import pretraining_flops

    encoder = pretraining_flops(model, seq_len, 0, cls_slots=0)
    head = pretraining_flops(model, seq_len, 1, cls_slots=0) - encoder  # one position through the head
    return rows * encoder + predicted * head


def utilisation(flops: int, seconds: float, peak_tflops: float | None) -> dict[str, float | None]:
    """Achieved TFLOP/s and, where the peak is known, MFU (their ratio to the peak)."""
    achieved = flops / seconds / 1e12
    return {"model_tflops": float(f"{achieved:.4g}"),
            "mfu": float(f"{achieved / peak_tflops:.4g}") if peak_tflops else None}


def run(args: argparse.Namespace) -> dict:
    import transformers
    from torch.nn.attention.flex_attention import BlockMask

    from bertforge.config import MODEL_PRESETS, ModelConfig
    from bertforge.formats.hf import hf_config_from_model_config
    from bertforge.host import device_name
    from bertforge.models.bert import Documents, layers_mask, pretraining_loss, set_attention_backends
    from bertforge.models.flops import peak_tflops
    from bertforge.models.modernbert import ModernBertForMaskedLM

    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = ModelConfig(**{**MODEL_PRESETS["modernbert-base"], "num_hidden_layers": args.layers,
                         "hidden_size": args.hidden, "num_attention_heads": args.heads,
                         "intermediate_size": args.intermediate, "vocab_size": args.vocab,
                         "pad_token_id": 50283 if args.vocab > 50283 else 0})  # ModernBERT's [PAD], or 0
    rows_by = "given"
    if args.rows is None and device.type == "cuda":
        memory = torch.cuda.get_device_properties(device).total_memory
        args.rows, rows_by = default_rows(cfg, memory, args.seq_len, args.mask_prob, args.precision, args.attention)
    elif args.rows is None:
        args.rows, rows_by = 1, "default"
    # Enough sequences to fill the rows (none is longer than 512, so two a row at least).
    sequences = make_sequences(args.rows * args.seq_len // 64, cfg.vocab_size, args.mask_prob, args.seed,
                               longest=min(512, args.seq_len))
    ours_batch, count = pack(sequences, args.rows, args.seq_len, cfg.pad_token_id)
    sequences = sequences[:count]
    their_batch = pad(sequences, cfg.pad_token_id)
    ours_batch = {k: v.to(device) for k, v in ours_batch.items()}
    their_batch = {k: v.to(device) for k, v in their_batch.items()}

    torch.manual_seed(0)
    ours = ModernBertForMaskedLM(cfg).to(device).train()
    set_attention_backends(ours, [args.attention] if args.attention == "flex" else None)
    models: dict[str, torch.nn.Module] = {"bertforge": ours}
    for side, sparse in (("transformers", False), ("transformers_sparse", True)):
        hf = transformers.ModernBertConfig(**hf_config_from_model_config(cfg, ["ModernBertForMaskedLM"]),
                                           attn_implementation=args.their_attention, sparse_prediction=sparse)
        theirs = transformers.ModernBertForMaskedLM(hf).to(device).train()
        theirs.load_state_dict(ours.state_dict(), strict=False)  # decoder.weight: tied to the embeddings
        theirs.tie_weights()
        models[side] = theirs
    attention = models["transformers"].config._attn_implementation
    mask = layers_mask(torch.empty(*ours_batch["input_ids"].shape, 1, device=device), None,
                       ours_batch["sequence_ids"], cfg, ours.model.flex, training=True)
    ours_path = ("one SDPA per document (models.bert.Documents)" if isinstance(mask, Documents) else
                 "FlexAttention block masks" if isinstance(mask, BlockMask) else "SDPA, an additive (B, 1, T, T) mask")
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32

    def loss_of(side: str) -> torch.Tensor:
        with torch.autocast(device.type, dtype=dtype, enabled=args.precision != "fp32"):
            if side == "bertforge":
                b = ours_batch
                logits, _ = ours(b["input_ids"], None, None, b["masked_lm_positions"],
                                 position_ids=b["position_ids"], sequence_ids=b["sequence_ids"])
                return pretraining_loss(logits, None, b, accuracy=False)["loss"]
            return models[side](**their_batch).loss

    start_loss = {}
    with torch.no_grad():
        for side in SIDES:
            start_loss[side] = loss_of(side).item()
    optimizers = {side: torch.optim.AdamW(m.parameters(), lr=1e-4, weight_decay=0.01) for side, m in models.items()}

    def step(side: str) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        loss_of(side).backward()
        optimizers[side].step()
        optimizers[side].zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - started

    times: dict[str, list[float]] = {side: [] for side in SIDES}
    for i in range(args.warmup + args.steps):
        for side in SIDES:  # interleaved: a slower stretch of the machine hits every side
            seconds = step(side)
            if i >= args.warmup:
                times[side].append(seconds)
    name = device_name(device)
    peak = args.peak_tflops or (peak_tflops(name, args.precision) if device.type == "cuda" else None)
    B, T = their_batch["input_ids"].shape
    flops = {"bertforge": step_flops(cfg, ours_batch["input_ids"].shape[0], args.seq_len,
                                     ours_batch["masked_lm_positions"].numel()),
             "transformers": step_flops(cfg, B, T, B * T),  # every position reaches the head
             "transformers_sparse": step_flops(cfg, B, T, int((their_batch["labels"] != -100).sum()))}
    result = {"device": str(device), "device_name": name, "peak_tflops": peak, "torch": torch.__version__,
              "transformers_version": transformers.__version__,
              "threads": torch.get_num_threads(), "precision": args.precision,
              "model": {"layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size, "heads": cfg.num_attention_heads,
                        "intermediate": cfg.intermediate_size, "vocab": cfg.vocab_size},
              "sequences": count, "tokens": sum(len(ids) for ids, _ in sequences),
              "masked": sum(len(m) for _, m in sequences),
              "ours_rows": f"{args.rows} x {args.seq_len}", "rows_chosen_by": rows_by,
              "their_batch": list(their_batch["input_ids"].shape),
              "ours_attention": args.attention, "ours_attention_path": ours_path, "their_attention": attention,
              "steps": args.steps,
              "warmup": args.warmup}
    medians = {side: statistics.median(times[side]) for side in SIDES}
    for side in SIDES:
        result[side] = {"step_ms": round(1000 * medians[side], 1), "seq_per_s": round(count / medians[side], 2),
                        "start_loss": round(start_loss[side], 5), "flops": flops[side],
                        **utilisation(flops[side], medians[side], peak)}
    return {**result, **ratios(medians)}


def ratios(medians: dict[str, float]) -> dict[str, float]:
    """Ours (``bertforge``) against each other side: their median step time over ours (both steps
    train the same sequences), from the times themselves, not from the rounded seq/s printed."""
    return {f"ratio_vs_{side}": round(medians[side] / medians["bertforge"], 3) for side in medians
            if side != "bertforge"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=384)
    parser.add_argument("--vocab", type=int, default=50368)
    parser.add_argument("--rows", type=int, default=None,
                        help="our packed rows a step (default: 1 on the CPU; on CUDA the planner's, see above)")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens of a packed row")
    parser.add_argument("--mask-prob", type=float, default=0.3)
    parser.add_argument("--steps", type=int, default=10, help="timed steps of each side (the median is reported)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--attention", choices=("sdpa", "flex"), default="sdpa", help="ours: SDPA or FlexAttention")
    parser.add_argument("--their-attention", choices=("sdpa", "eager"), default="sdpa")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the device's peak TFLOP/s for MFU (default: models.flops' table on CUDA)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    result = run(args)
    if args.json:
        print(json.dumps(result))
        return
    print(f"torch {result['torch']}, transformers {result['transformers_version']}, {result['device']}, "
          f"{result['threads']} threads, {result['precision']}; {result['sequences']} sequences "
          f"({result['tokens']} tokens, {result['masked']} masked) a step: ours {result['ours_rows']} packed "
          f"({result['ours_attention_path']}; rows: {result['rows_chosen_by']}), "
          f"theirs padded {result['their_batch']} ({result['their_attention']}); "
          f"median of {args.steps} steps")
    for side in SIDES:
        row = result[side]
        ratio = f"{result[f'ratio_vs_{side}']:.2f}x" if side != "bertforge" else ""
        mfu = f"  MFU {row['mfu']:.3f}" if row["mfu"] is not None else ""
        print(f"{side:<22}{row['step_ms']:>10} ms{row['seq_per_s']:>10} seq/s{row['model_tflops']:>10.4g} TFLOP/s{mfu}"
              f"  start loss {row['start_loss']}  {ratio}")


if __name__ == "__main__":
    main()
