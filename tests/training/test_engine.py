"""The training engine (one step for every job) and weight loading (one place for every command)."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file, save_file

from bertforge.config import ModelConfig, TrainConfig
from bertforge.data import SyntheticDataset
from bertforge.formats.hf import export_hf
from bertforge.formats.load import load_model, load_weights
from bertforge.models.bert import BertForPreTraining, BertForQuestionAnswering
from bertforge.runs import CheckpointError
from bertforge.training.engine import BatchStream, Engine, NonFiniteError, epoch_order
from bertforge.training.optim import build_optimizer, build_scheduler
from bertforge.training.pretrain import training_loss

TINY = ModelConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                   intermediate_size=32, max_position_embeddings=32,
                   hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def engine_for(model: torch.nn.Module, loss_fn=training_loss, precision: str = "fp32",
               name: str = "lamb") -> Engine:
    train = TrainConfig(optimizer=name, lr=1e-2, warmup_steps=0, schedule="constant")
    optimizer = build_optimizer(model, train)
    return Engine(model, optimizer, build_scheduler(optimizer, train, 10), loss_fn, precision, 1.0)


def batch_of(rows: range) -> dict[str, torch.Tensor]:
    data = SyntheticDataset(size=8, vocab_size=64, seq_len=16, max_predictions=3, seed=1)
    return data.batch(list(rows))


def test_accumulated_micro_batches_equal_one_batch():
    """4 micro-batches of 2 make the step of 1 batch of 8: dropout off, every row 3 real predictions."""
    torch.manual_seed(0)
    model = BertForPreTraining(TINY)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    twin = copy.deepcopy(model)
    one = engine_for(model).step([batch_of(range(8))], 1)
    four = engine_for(twin).step((batch_of(range(i, i + 2)) for i in range(0, 8, 2)), 4)
    for key in ("loss", "mlm_loss", "nsp_loss", "grad_norm"):
        assert abs(one[key].item() - four[key].item()) < 1e-5, key
    for (name, a), b in zip(model.state_dict().items(), twin.state_dict().values()):
        assert torch.allclose(a, b, rtol=0, atol=1e-6), name
    assert max((a - start[k]).abs().max().item() for k, a in model.state_dict().items()) > 1e-3  # it moved


def test_a_step_with_the_wrong_number_of_micro_batches_is_refused():
    model = BertForPreTraining(TINY)
    with pytest.raises(ValueError, match="step 0: got 1 micro-batches, expected 2"):
        engine_for(model).step([batch_of(range(2))], 2)


@pytest.mark.parametrize("optimizer", ["lamb", "adamw", "sgd"])
def test_a_non_finite_step_is_skipped_on_the_device_and_named_a_step_later(optimizer):
    """Step 7's loss is NaN: its update is skipped on the device (found_inf), and so is step 8's, the
    first read of step 7's numbers; step 8 raises, naming step 7; the weights and the optimizer state
    are the last finite step's (step 6's), bit for bit. No step before waited for its flag."""
    torch.manual_seed(0)
    model = BertForPreTraining(TINY)
    calls = []

    def nan_at_step_7(model, batch):
        out = training_loss(model, batch)
        calls.append(None)
        return {**out, "loss": out["loss"] * float("nan")} if len(calls) == 7 else out

    engine = engine_for(model, nan_at_step_7, name=optimizer)
    for step in range(6):
        engine.step([batch_of(range(4))], 1, step=step)
    assert engine.report is not None and engine.report.step == 5  # (step 6's comes with step 7)
    engine.flush()
    last_finite = copy.deepcopy((model.state_dict(), engine.optimizer.state_dict()["state"]))
    engine.step([batch_of(range(4))], 1, step=6)  # NaN: skipped on the device, nothing raised yet
    with pytest.raises(NonFiniteError) as err:
        engine.step([batch_of(range(4))], 1, step=7)
    assert str(err.value) == ("step 7: the loss is nan; the weights were not updated. "
                              "Lower train.lr or raise train.warmup_steps")
    for key, value in model.state_dict().items():
        assert torch.equal(value, last_finite[0][key]), key
    for index, state in engine.optimizer.state_dict()["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                assert torch.equal(value, last_finite[1][index][key]), (index, key)


def test_non_finite_gradient_is_named_and_bf16_is_told_about_fp32():
    model = BertForPreTraining(TINY)

    def inf_gradient(model, batch):
        out = training_loss(model, batch)
        # Finite value, infinite gradient: sqrt'(0) = inf.
        return {**out, "loss": out["loss"] + torch.sqrt(model.bert.embeddings.word_embeddings.weight[0, 0] * 0)}

    engine = engine_for(model, inf_gradient, precision="bf16")
    engine.step([batch_of(range(4))], 1)
    with pytest.raises(NonFiniteError, match=r"^step 1: the gradient norm is (inf|nan); .*; or use "
                                             r"execution.precision=fp32$"):
        engine.flush()


def test_batch_stream_and_epoch_order_are_one_seeded_permutation():
    data = SyntheticDataset(size=12, vocab_size=64, seq_len=16, max_predictions=3, seed=1)
    stream = BatchStream(data, batch_size=4, seed=5)
    order = epoch_order(5, 0, 12)
    assert torch.equal(stream.next()["input_ids"], data.batch(order[:4].numpy())["input_ids"])
    assert stream.state() == {"epoch": 0, "index": 1}
    assert not torch.equal(epoch_order(5, 1, 12), order)


# ------------------------------------------------------------ weights

def test_init_from_a_hugging_face_directory_and_our_checkpoint(tmp_path):
    torch.manual_seed(1)
    source = BertForPreTraining(TINY)
    export_hf(source, tmp_path / "hf", without_tokenizer=True)
    model = BertForPreTraining(TINY)
    assert load_weights(model, tmp_path / "hf") == []
    for key, value in source.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    # A QA model from pre-trained weights: only the new span head is left as initialised.
    qa = BertForQuestionAnswering(TINY)
    assert load_weights(qa, tmp_path / "hf") == ["qa_outputs.weight", "qa_outputs.bias"]


def test_weights_of_another_shape_are_errors_naming_the_tensor(tmp_path):
    torch.manual_seed(1)
    export_hf(BertForPreTraining(TINY), tmp_path / "hf", without_tokenizer=True)
    wider = ModelConfig(**{**TINY.__dict__, "intermediate_size": 48})
    with pytest.raises(CheckpointError, match=r"hf has model.intermediate_size=32 but the config asks for "
                                              r"model.intermediate_size=48"):
        load_weights(BertForPreTraining(wider), tmp_path / "hf")

    # Our own directory: a tensor edited to another shape, or missing, is named on load.
    from bertforge.formats.weights import save_weights

    out = tmp_path / "ours"
    out.mkdir()
    save_weights(BertForPreTraining(TINY), out / "model.safetensors")
    from bertforge.config import Config

    cfg = Config()
    cfg.model, cfg.data.seq_len = TINY, 32
    (out / "config.yaml").write_text(cfg.to_yaml())
    state = load_file(str(out / "model.safetensors"))
    key = "bert.encoder.layer.1.output.dense.weight"
    save_file({**state, key: state[key][:, :8].contiguous()}, str(out / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"ours: weight {key} has shape \(16, 8\) in the checkpoint "
                                              rf"but the model expects \(16, 32\)"):
        load_model(out)
    del state[key]
    save_file(state, str(out / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"ours: checkpoint lacks encoder weights: {key}$"):
        load_model(out)
    del state["cls.predictions.bias"]
    state[key] = BertForPreTraining(TINY).state_dict()[key]
    save_file(state, str(out / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"ours: lacks cls.predictions.bias$"):
        load_model(out)
    assert load_model(out, head="qa").config == TINY  # a QA model needs no MLM head


def test_a_diverging_run_stops_with_one_line_and_keeps_its_finite_checkpoint(tmp_path, capsys):
    from bertforge.cli import main

    assert main(["pretrain", "--config", "tiny", "--data.synthetic", "--steps", "5", "--no-progress",
                 "--run-dir", str(tmp_path), "--name", "run", "--data.seq_len", "32", "--train.lr", "1e30",
                 "--train.optimizer", "adamw", "--train.grad_clip", "0", "--log.tensorboard", "false",
                 "--checkpoint.every", "1", "--checkpoint.keep", "0"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == ("error: step 2: the loss is nan; the weights were not "
                                                        "updated. Lower train.lr or raise train.warmup_steps")
    steps = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert steps == ["step_00000001"]
    weights = load_file(str(tmp_path / "run" / "checkpoints" / "step_00000001" / "model.safetensors"))
    assert all(torch.isfinite(w).all() for w in weights.values())
