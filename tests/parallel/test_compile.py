"""What a cold start compiles (issue 39.1), counted on the CPU with BERT-tiny: regional compilation (one
graph every encoder layer shares) against the whole model, the compiled optimizer step's graphs, and
``compile_counts``. Counted by Dynamo's CompileCounter on the eager backend (no AOT, no Inductor: fast);
``benchmarks/compile_start.py`` measures the seconds with Inductor at BERT-large's size."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from bertforge.config import MODEL_PRESETS, ExecutionConfig, ModelConfig, TrainConfig
from bertforge.data import SyntheticDataset
from bertforge.models.bert import BertForPreTraining, compiled_pretraining_loss
from bertforge.parallel.dist import DistContext, compile_counts, is_compiled, prepare_model
from bertforge.training import optim
from bertforge.training.pretrain import forward_loss


class GraphCounter(CompileCounterWithBackend):
    """Dynamo's counter, also keeping each graph's count of calls (``graph_ops``), in compile order."""

    def __init__(self, backend: str):
        super().__init__(backend)
        self.graph_ops: list[int] = []

    def __call__(self, gm, example_inputs):
        before = self.op_count
        compiled = super().__call__(gm, example_inputs)
        self.graph_ops.append(self.op_count - before)
        return compiled

    def clear(self) -> None:
        super().clear()
        self.graph_ops = []


@pytest.fixture
def counted(monkeypatch):
    """torch.compile on a counting eager backend; Dynamo's caches and counters empty before and after."""
    counter = GraphCounter("eager")
    real = torch.compile

    def compile_(fn, **kwargs):
        kwargs.pop("mode", None), kwargs.pop("options", None)
        return real(fn, **{**kwargs, "backend": counter})

    def forget() -> None:  # (the compiled loss and optimizer passes are made once, by the torch.compile of then)
        torch._dynamo.reset()
        counters.clear()
        optim._compiled.cache_clear()
        compiled_pretraining_loss.cache_clear()

    forget()
    monkeypatch.setattr(torch, "compile", compile_)
    yield counter
    forget()


def tiny(layers: int) -> ModelConfig:
    return dataclasses.replace(ModelConfig(**MODEL_PRESETS["tiny"]), num_hidden_layers=layers,
                               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def batch(size: int = 2) -> dict[str, torch.Tensor]:
    return SyntheticDataset(size=size, vocab_size=30522, seq_len=32, max_predictions=5, seed=3).batch(list(range(size)))


def train_step(model: torch.nn.Module) -> tuple[float, list[torch.Tensor]]:
    loss = forward_loss(model, batch())["loss"]
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


@pytest.mark.parametrize("recompute", ["none", "layer"])
def test_every_layer_runs_one_graph_and_equals_eager(counted, recompute):
    """compile_scope layers: four encoder layers compile one graph (forward, and its backward), which the
    second step reuses; evaluation (no grad, eval mode) one more; the losses and gradients equal eager's."""
    torch.manual_seed(0)
    eager = BertForPreTraining(tiny(4)).train()
    model = BertForPreTraining(tiny(4)).train()
    model.load_state_dict(eager.state_dict())
    model = prepare_model(model, ExecutionConfig(compile=True, compile_scope="layers", recompute=recompute),
                          DistContext())
    assert isinstance(model, BertForPreTraining) and is_compiled(model) and not is_compiled(eager)
    assert list(model.state_dict()) == list(eager.state_dict())  # the names a checkpoint saves
    reference_loss, reference_grads = train_step(eager)
    loss, grads = train_step(model)
    # One frame for the layers; the loss (compiled because the model is) is the other.
    assert counted.frame_count == 2
    assert compile_counts()["recompiles"] == 0
    assert loss == pytest.approx(reference_loss, rel=1e-6)
    for ours, theirs in zip(grads, reference_grads):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    train_step(model)
    assert counted.frame_count == 2 and compile_counts()["recompiles"] == 0
    model.eval()
    with torch.no_grad():
        forward_loss(model, batch())
    # Evaluation: the layer and the loss once more each (grad mode and training are guarded).
    assert counted.frame_count == 4 and compile_counts()["graphs"] == 4


def test_the_whole_model_is_one_graph_holding_every_layer(counted):
    """compile_scope model (the path before): one graph holds the four layers unrolled, so what Dynamo
    traces and Inductor compiles grows with the depth; a layer's region is a quarter of that and less."""
    sizes = {}
    for scope in ("model", "layers"):
        torch._dynamo.reset()
        compiled_pretraining_loss.cache_clear()
        counted.clear()
        torch.manual_seed(0)
        model = prepare_model(BertForPreTraining(tiny(4)).train(), ExecutionConfig(compile=True, compile_scope=scope),
                              DistContext())
        train_step(model)
        sizes[scope] = counted.graph_ops  # the model's (or a layer's) forward graph, then the loss's
    assert len(sizes["model"]) == len(sizes["layers"]) == 2
    assert sizes["model"][1] == sizes["layers"][1]  # the same compiled loss
    # Four layers' ops and the embeddings' and heads'.
    assert sizes["model"][0] > 4 * sizes["layers"][0] > 0


def test_the_compiled_optimizer_step_compiles_two_graphs_a_group_not_one_a_shape(counted):
    """LAMB's compiled step (training's, where the model compiles on CUDA): its two passes, one graph each
    per parameter group (decay, no decay), over tensors of 9 shapes; the next step compiles nothing.
    (Its equality to the eager step: tests/training/test_optim.py.)"""
    torch.manual_seed(0)
    model = BertForPreTraining(tiny(1))
    optimizer = optim.build_optimizer(model, TrainConfig(optimizer="lamb", lr=1e-3, weight_decay=0.01),
                                      compiled=True)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    assert counted.frame_count == 4 and len({tuple(p.shape) for p in model.parameters()}) == 9
    # Each pass is one function, compiled for the decay group, then again for the other's tensors.
    assert compile_counts()["recompiles"] == 2
    with torch.compiler.set_stance("fail_on_recompile"):
        optimizer.step()
    assert counted.frame_count == 4 and compile_counts()["recompiles"] == 2
