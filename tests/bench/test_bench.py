"""``bertforge bench pretrain``: model FLOPs (checked against torch's FLOP counter), device peaks,
MFU, gradient accumulation, and timing on records, packed or not."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import SteadyClock
from test_packing import synthetic
from torch.utils.flop_counter import FlopCounterMode

from bertforge.bench import pretrain as bench
from bertforge.cli import main
from bertforge.config import MODEL_PRESETS, ConfigError, ModelConfig, load_config
from bertforge.data.packing import pack_arrays, pack_command
from bertforge.data.record_reader import read_records
from bertforge.data.record_writer import write_records
from bertforge.host import process_age_s
from bertforge.models.bert import BertForPreTraining
from bertforge.models.flops import peak_tflops, pretraining_flops
from bertforge.training.pretrain import forward_loss

H100_SXM = "NVIDIA H100 80GB HBM3"  # what torch.cuda.get_device_name says


def test_bert_large_phase1_is_the_issues_240_6_gflop_per_sequence():
    large = ModelConfig(**MODEL_PRESETS["large"])
    assert large.vocab_size == 30522
    flops = pretraining_flops(large, seq_len=128, predictions=20)
    # 3 × (encoder 77,309,411,328 + attention 1,610,612,736 + MLM head 1,292,124,160 + pooler/NSP 2,101,248)
    assert flops == 3 * 80_214_249_472 == 240_642_748_416
    assert round(flops / 1e9, 1) == 240.6
    # The phase-1 goal: 2,180 seq/s on one H100 SXM is 53 % of its 989.4 TFLOP/s of dense bf16.
    peak = peak_tflops(H100_SXM, "bf16")
    assert peak == 989.4
    assert round(2180 * flops / (peak * 1e12), 3) == 0.530


def counted_flops(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> int:
    """Forward + backward FLOPs of one batch by torch.utils.flop_counter."""
    with FlopCounterMode(display=False) as counter:
        forward_loss(model, batch)["loss"].backward()
    return counter.get_total_flops()


def test_the_formula_is_what_torchs_flop_counter_counts():
    """Training mode runs attention with dropout, which SDPA on the CPU computes with
    bmm's (2 forward, 4 backward), all counted: the formula is exact. Without dropout
    (eval) the CPU runs its fused flash kernel, which FlopCounterMode's registry
    lacks (it has the CUDA flash, efficient and cuDNN kernels), so it counts no
    attention at all: exactly 3 · 2·2·L·T²·H per row less."""
    cfg = ModelConfig(**{**MODEL_PRESETS["tiny"], "vocab_size": 1000})
    torch.manual_seed(0)
    model = BertForPreTraining(cfg)
    rows, T, P = 3, 24, 5
    batch = {"input_ids": torch.randint(1, 1000, (rows, T)), "token_type_ids": torch.zeros(rows, T, dtype=torch.long),
             "attention_mask": torch.ones(rows, T, dtype=torch.long),
             "masked_lm_positions": torch.randint(1, T, (rows, P)), "masked_lm_ids": torch.randint(1, 1000, (rows, P)),
             "masked_lm_weights": torch.ones(rows, P), "next_sentence_labels": torch.randint(0, 2, (rows,))}
    per_row = pretraining_flops(cfg, T, P)
    assert counted_flops(model.train(), batch) == rows * per_row
    L, H = cfg.num_hidden_layers, cfg.hidden_size
    assert counted_flops(model.eval(), batch) == rows * (per_row - 3 * 2 * 2 * L * T * T * H)


def test_the_formula_counts_modernbert_and_masked_lm_alone():
    """ModernBERT's GeGLU MLP (3·H·I) and no [CLS] slot, and BERT's masked LM alone (no pooler or NSP
    head), as torch's counter counts them (attention dropout, so that the CPU's SDPA runs bmm's)."""
    from bertforge.models.families import build_pretraining_model

    rows, T, P = 3, 24, 5
    batch = {"input_ids": torch.randint(1, 1000, (rows, T)), "token_type_ids": torch.zeros(rows, T, dtype=torch.long),
             "attention_mask": torch.ones(rows, T, dtype=torch.long),
             "masked_lm_positions": torch.randint(1, T, (rows, P)), "masked_lm_ids": torch.randint(1, 1000, (rows, P)),
             "masked_lm_weights": torch.ones(rows, P), "next_sentence_labels": torch.zeros(rows, dtype=torch.long)}
    for preset in ("modernbert-tiny", "tiny"):
        cfg = ModelConfig(**{**MODEL_PRESETS[preset], "vocab_size": 1000, "attention_probs_dropout_prob": 0.1})
        torch.manual_seed(0)
        model = build_pretraining_model(cfg, "mlm").train()
        assert counted_flops(model, batch) == rows * pretraining_flops(cfg, T, P, cls_slots=0), preset


def test_the_formula_counts_a_packed_rows_cls_slots():
    cfg = ModelConfig(**{**MODEL_PRESETS["tiny"], "vocab_size": 500})
    packed = pack_arrays(synthetic(12, 32, 5, 500, seed=3), 3, seed=0)
    batch = packed.to_torch()
    rows, T = batch["input_ids"].shape
    P, S = batch["masked_lm_positions"].shape[1], batch["cls_positions"].shape[1]
    assert (S, rows < 12) == (3, True)
    torch.manual_seed(0)
    # The formula counts a row's whole T² of scores (the model's FLOPs, as CUDA's bias path computes them); the CPU
    # attends one document at a time (padding one too): the scores between documents are not computed.
    skipped = sum(T * T - int(row.bincount().square().sum()) for row in batch["sequence_ids"].long())
    assert skipped > 0
    attention = 3 * 2 * 2 * cfg.num_hidden_layers * cfg.hidden_size  # per score: QKᵀ and PV, forward and backward
    assert counted_flops(BertForPreTraining(cfg).train(), batch) == \
        rows * pretraining_flops(cfg, T, P, S) - attention * skipped


@pytest.mark.smoke
def test_peaks_by_device_name_and_precision():
    assert peak_tflops(H100_SXM, "fp16") == 989.4
    assert peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.5
    assert peak_tflops("NVIDIA H200", "bf16") == 989.4
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "bf16") == 312.0
    assert peak_tflops("NVIDIA A100 80GB PCIe", "fp32", tf32=True) == 156.0
    assert peak_tflops(H100_SXM, "fp32", tf32=False) == 66.9
    assert peak_tflops(H100_SXM, "fp32") == 66.9  # torch's default: fp32 matmuls without TF32
    assert peak_tflops("NVIDIA H200 NVL", "bf16") is None
    assert peak_tflops("AMD EPYC 7B13", "bf16") is None


class Counting:
    """Counts the engine's forward passes and optimizer steps in bertforge.bench.pretrain, whose clock
    it steadies."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.forwards = self.optimizer_steps = 0
        loss, build = bench.training_loss, bench.build_optimizer

        def counted_loss(model, batch):
            self.forwards += 1
            return loss(model, batch)

        def counted_optimizer(*args, **kwargs):
            optimizer = build(*args, **kwargs)
            optimizer.register_step_post_hook(lambda *_: setattr(self, "optimizer_steps", self.optimizer_steps + 1))
            return optimizer

        monkeypatch.setattr(bench, "training_loss", counted_loss)
        monkeypatch.setattr(bench, "build_optimizer", counted_optimizer)
        # The timed stretch lasts exactly 0.8 s: the rates are exact, whatever the machine's load.
        monkeypatch.setattr(bench, "time", SteadyClock(0.8))


def test_accumulation_times_n_micro_batches_per_optimizer_step(monkeypatch, capsys):
    counting = Counting(monkeypatch)
    before = process_age_s()
    assert main(["bench", "pretrain", "--config", "tiny", "--batch-size", "3", "--seq-len", "32",
                 "--max-predictions", "5", "--accumulation", "2", "--steps", "2", "--warmup", "1",
                 "--peak-tflops", "0.5", "--json"]) == 0
    after = process_age_s()
    result = json.loads(capsys.readouterr().out)
    # The cold start: the process's age at the end of the first step (of three), and nothing compiled.
    assert before < result["first_step_s"] < after
    assert result["compiled"] is None and result["compile_scope"] is None
    assert (counting.forwards, counting.optimizer_steps) == (3 * 2, 3)
    assert (result["accumulation"], result["global_batch"], result["sequences"]) == (2, 6, 2 * 2 * 3)
    assert (result["data"], result["packed"], result["peak_tflops"]) == ("synthetic", False, 0.5)
    assert result["flops_per_seq"] == pretraining_flops(ModelConfig(**MODEL_PRESETS["tiny"]), 32, 5)
    # The timed steps last 0.8 s on the steady clock: 12 sequences of 32 tokens.
    assert (result["step_ms"], result["seq_per_s"], result["rows_per_s"]) == (400.0, 15.0, 15.0)
    assert result["tokens_per_s"] == result["real_tokens_per_s"] == 15.0 * 32
    assert result["model_tflops"] == pytest.approx(15.0 * result["flops_per_seq"] / 1e12, rel=1e-3)
    assert result["mfu"] == pytest.approx(result["model_tflops"] / 0.5, rel=1e-3)


def test_bench_on_packed_records_counts_real_sequences(tmp_path, monkeypatch):
    plain = synthetic(48, 64, 10, 500, seed=9)
    write_records(tmp_path / "plain" / "train.bfrec", plain, "native", vocab_size=500)
    stats, _ = pack_command(str(tmp_path / "plain"), tmp_path / "packed", 3)
    rows = stats.rows
    assert stats.sequences == 48 and rows < 48
    counting = Counting(monkeypatch)
    # Each micro-batch is every packed row: every step sees the 48 sequences twice.
    cfg = load_config("tiny", [("model.vocab_size", 500)])  # the records' vocab
    result = bench.bench_pretrain(cfg, rows, None, steps=2, warmup=1, accumulation=2, data=str(tmp_path / "packed"))
    assert (counting.forwards, counting.optimizer_steps) == (6, 3)
    assert (result["packed"], result["seq_len"], result["max_predictions"]) == (True, 64, 10)
    assert (result["sequences"], result["global_batch"]) == (2 * 2 * 48, 2 * rows)
    assert result["seq_per_s"] / result["rows_per_s"] == pytest.approx(48 / rows, rel=1e-3)
    tokens = int(plain.input_mask.sum())  # the real tokens of the sequences, packed or not
    assert result["real_tokens_per_s"] / result["tokens_per_s"] == pytest.approx(tokens / (rows * 64), rel=1e-3)
    packed = read_records(next((tmp_path / "packed").iterdir()))
    P, S = packed.masked_lm_positions.shape[1], packed.next_sentence_mask.shape[1]
    per_row = pretraining_flops(cfg.model, 64, P, S)
    assert result["flops_per_seq"] == round(per_row * rows / 48)

    # The same sequences unpacked: every row is a sequence, with padding.
    cfg = load_config("tiny", [("model.vocab_size", 500)])
    result = bench.bench_pretrain(cfg, 48, None, steps=1, warmup=0, data=str(tmp_path / "plain"))
    assert (result["packed"], result["sequences"], result["rows_per_s"]) == (False, 48, result["seq_per_s"])
    assert result["real_tokens_per_s"] / result["tokens_per_s"] == pytest.approx(tokens / (48 * 64), rel=1e-3)
    assert np.isfinite(result["final_loss"])


def test_records_decide_the_shape_and_a_different_one_is_refused(tmp_path):
    write_records(tmp_path / "r.bfrec", synthetic(8, 64, 10, 500), "native", vocab_size=500)
    with pytest.raises(ConfigError) as err:
        bench.bench_pretrain(load_config("tiny"), 4, 128, steps=1, data=str(tmp_path / "r.bfrec"))
    assert str(err.value) == f"--seq-len 128, but the records at {tmp_path / 'r.bfrec'} have 64: leave --seq-len out"
    with pytest.raises(ConfigError) as err:  # the phase-1 recipe says 20 predictions
        bench.bench_pretrain(load_config("pretrain_large_128_phase1"), 4, None, steps=1, data=str(tmp_path))
    assert str(err.value) == (f"data.max_predictions=20 (given, or the config's), but the records at {tmp_path} "
                              "have 10: pass --max-predictions 10")
    with pytest.raises(ConfigError, match="^--accumulation must be at least 1, got 0$"):
        bench.bench_pretrain(load_config("tiny"), 4, 128, steps=1, accumulation=0)


def test_real_counts_read_any_dtype_and_a_missing_mask_as_no_padding():
    ids = torch.ones(2, 5, dtype=torch.int32)
    assert bench.real_counts({"input_ids": ids}) == (2, 10)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.uint8)
    assert bench.real_counts({"input_ids": ids, "attention_mask": mask}) == (2, 8)
    packed = {"input_ids": ids, "sequence_ids": torch.tensor([[1, 1, 2, 2, 0], [1, 1, 1, 1, 1]], dtype=torch.uint8),
              "next_sentence_weights": torch.tensor([[0.0, 1, 1], [0, 0, 1]])}
    assert bench.real_counts(packed) == (3, 9)


def test_rows_too_short_for_the_configs_predictions_are_one_line(capsys):
    """ModernBERT's recipe predicts 308 of 1,024 tokens: bench's synthetic rows of 256 leave no room
    (a traceback from the dataset before); a ModernBERT config benches once they fit."""
    args = ["bench", "pretrain", "--config", "modernbert_base_1024", "--data.vocab", "", "--model.num_hidden_layers",
            "1", "--model.vocab_size", "1000", "--model.pad_token_id", "0", "--execution.precision", "fp32",
            "--batch-size", "1", "--seq-len", "256", "--steps", "1", "--warmup", "0"]
    assert main(args) == 2
    assert capsys.readouterr().err == ("error: data.max_predictions=308 must be below the sequence length 256 "
                                       "(--seq-len): give --data.max_predictions for rows of 256\n")
    assert main([*args, "--data.max_predictions", "77", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    cfg = load_config("modernbert_base_1024", [("model.num_hidden_layers", 1), ("model.vocab_size", 1000),
                                               ("model.pad_token_id", 0)]).model
    assert result["flops_per_seq"] == pretraining_flops(cfg, 256, 77, cls_slots=0)
