"""benchmarks/modernbert_step.py: its ratios come from the median step times, not from the seq/s it prints
rounded to two decimals (issue 40.9: loaded, its own step times gave 1.23x, the rounded seq/s 1.63x); each
side's FLOPs and MFU (issue 39.4); its rows on CUDA, chosen by the memory planner from the GPU's memory."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from bertforge.config import MODEL_PRESETS, Config, ModelConfig, replaced, use_model
from bertforge.models.flops import peak_tflops, pretraining_flops
from bertforge.parallel.plan import plan_memory

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
from modernbert_step import default_rows, parse_args, ratios, run, step_flops, utilisation  # noqa: E402

BASE = ModelConfig(**MODEL_PRESETS["modernbert-base"])
GiB = 1 << 30


def test_ratios_are_their_step_time_over_ours():
    # Slow steps (a base-size model on a loaded CPU): 1 sequence in 123 s and in 150 s is 0.01 seq/s both
    # when rounded, which made 1.00x of 150 / 123 = 1.22x.
    got = ratios({"bertforge": 123.0, "transformers": 150.0, "transformers_sparse": 200.0})
    assert got == {"ratio_vs_transformers": pytest.approx(1.220, abs=1e-3),
                   "ratio_vs_transformers_sparse": pytest.approx(1.626, abs=1e-3)}


def test_step_flops_are_the_flops_modules_rows():
    # Ours: 16 packed rows of 1,024 with 310 prediction slots each; the flops module's rows, summed.
    assert step_flops(BASE, 16, 1024, 16 * 310) == 16 * pretraining_flops(BASE, 1024, 310, cls_slots=0)
    # Transformers' sparse head: 1,000 masked positions over 57 padded rows of 512 (not a multiple of 57).
    per_row = pretraining_flops(BASE, 512, 0, cls_slots=0)
    head = 3 * 2 * (768 * 768 + 768 * 50368)  # one position: transform and vocab projection, 3x for training
    assert step_flops(BASE, 57, 512, 1000) == 57 * per_row + 1000 * head
    # ModernBERT-base, one row of 1,024 with every position predicted, by the module docstring's formula.
    L, H, I, V, T = 22, 768, 1152, 50368, 1024  # noqa: E741
    forward = T * 2 * L * (4 * H * H + 3 * H * I) + 4 * L * T * T * H + 2 * T * (H * H + H * V)
    assert step_flops(BASE, 1, 1024, 1024) == 3 * forward == 1_131_556_110_336


def test_mfu_is_achieved_over_the_devices_peak():
    peak = peak_tflops("NVIDIA H200", "bf16")
    assert peak == 989.4
    # Half of the peak's FLOPs in half a second: the peak achieved.
    assert utilisation(int(989.4e12 / 2), 0.5, peak) == {"model_tflops": 989.4, "mfu": 1.0}
    assert utilisation(int(123.44e12), 1.0, peak) == {"model_tflops": 123.4, "mfu": pytest.approx(0.1248, abs=1e-4)}
    assert utilisation(int(2e9), 4.0, None) == {"model_tflops": 0.0005, "mfu": None}  # a CPU: no peak known


def planned(rows: int) -> int:
    cfg = replaced(Config(), {"data.seq_len": 1024, "data.max_predictions": 308, "execution.precision": "bf16",
                              "execution.attention": "flex", "execution.device": "cuda", "train.optimizer": "adamw",
                              "train.micro_batch_size": rows, "train.global_batch_size": rows})
    use_model(cfg, BASE)
    return plan_memory(cfg, device="cuda").device_total


@pytest.mark.parametrize("memory_gib", [24, 80])
def test_cuda_rows_are_the_planners_largest_in_half_the_memory(memory_gib):
    rows, by = default_rows(BASE, memory_gib * GiB, 1024, 0.3, "bf16", "flex")
    assert by == "planner" and 1 < rows < 64
    assert planned(rows) <= memory_gib * GiB // 2 < planned(rows + 1)


def test_cuda_rows_at_most_64_and_64_when_the_planner_cannot_say():
    assert default_rows(BASE, 141 * 10**9, 1024, 0.3, "bf16", "flex") == (64, "planner")  # an H200 holds more
    assert planned(64) <= 141 * 10**9 // 2
    assert default_rows(BASE, None, 1024, 0.3, "bf16", "flex") == (64, "default")


def test_json_reports_each_sides_flops_and_mfu():
    args = parse_args(["--layers", "1", "--hidden", "64", "--heads", "2", "--intermediate", "96", "--vocab", "1000",
                       "--seq-len", "256", "--steps", "1", "--warmup", "0", "--peak-tflops", "0.5"])
    result = run(args)
    assert result["rows_chosen_by"] == "default" and result["ours_rows"] == "1 x 256"  # the CPU's default
    assert result["peak_tflops"] == 0.5
    model = ModelConfig(**{**MODEL_PRESETS["modernbert-base"], "num_hidden_layers": 1, "hidden_size": 64,
                           "num_attention_heads": 2, "intermediate_size": 96, "vocab_size": 1000})
    B, T = result["their_batch"]
    assert result["transformers"]["flops"] == step_flops(model, B, T, B * T)
    assert result["transformers_sparse"]["flops"] == step_flops(model, B, T, result["masked"])
    assert result["bertforge"]["flops"] == step_flops(model, 1, 256, result["masked"])  # one row: all its slots
    for side in ("bertforge", "transformers", "transformers_sparse"):
        row = result[side]
        seconds = row["step_ms"] / 1000
        # step_ms is rounded to 0.1 ms and the TFLOP/s to 4 digits: the bound of those roundings, on any load
        rounding = 0.06 / row["step_ms"] + 6e-4
        assert row["model_tflops"] == pytest.approx(row["flops"] / seconds / 1e12, rel=rounding)
        assert row["mfu"] == pytest.approx(row["model_tflops"] / 0.5, rel=1.2e-3)  # both rounded to 4 digits
    # Without --peak-tflops a CPU has no peak: the achieved FLOP/s and no MFU.
    result = run(parse_args(["--layers", "1", "--hidden", "64", "--heads", "2", "--intermediate", "96",
                             "--vocab", "1000", "--seq-len", "256", "--steps", "1", "--warmup", "0"]))
    assert result["peak_tflops"] is None and result["bertforge"]["mfu"] is None
    assert result["bertforge"]["model_tflops"] > 0
