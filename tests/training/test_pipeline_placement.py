"""Pipeline stages placed as Graphcore's TF1 BERT places them (execution.hidden_layers_per_stage,
execution.embeddings_placement), against one process.

Each case spawns one gloo rank per stage (BERT-tiny with 4 layers, dropout on) and trains 3 steps
of 4 micro-batches of 2 sequences; the losses, the gradient norms and the first step's gradients
must be those of one process (Engine), as the even split's are (test_pipeline_parallel.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from gloo_worker import run_rank

from bertforge.config import ConfigError, load_config, pipeline_layer_counts

STEPS, MICRO_BATCHES, ROWS, LAYERS = 3, 4, 2, 4
# name: (stages, hidden_layers_per_stage, embeddings_placement, schedule)
CASES: dict[str, tuple[int, str, str, str]] = {
    "uneven": (2, "1,3", "same_as_hidden_layers", "1f1b"),
    "same_ipu": (3, "3,1", "same_ipu", "gpipe"),
    "two_ipus": (4, "1,3", "two_ipus", "1f1b"),
}


def _config(name: str | None = None):
    overrides: list[tuple[str, Any]] = [
        ("data.seq_len", 64), ("data.max_predictions", 8), ("train.micro_batch_size", ROWS),
        ("train.global_batch_size", ROWS * MICRO_BATCHES), ("train.warmup_steps", 1),
        ("model.num_hidden_layers", LAYERS), ("execution.device", "cpu")]
    if name is not None:
        stages, per_stage, placement, schedule = CASES[name]
        overrides += [("execution.pipeline_stages", stages), ("execution.hidden_layers_per_stage", per_stage),
                      ("execution.embeddings_placement", placement), ("execution.pipeline_schedule", schedule)]
    return load_config("tiny", overrides)


def _train(engine, cfg) -> dict[str, Any]:
    from bertforge.data import SyntheticDataset
    from bertforge.parallel.dist import unwrap
    from bertforge.training.engine import BatchStream

    data = SyntheticDataset(size=64, vocab_size=cfg.model.vocab_size, seq_len=cfg.data.seq_len,
                            max_predictions=cfg.data.max_predictions, seed=12345)
    stream = BatchStream(data, ROWS, seed=cfg.train.seed)
    result: dict[str, Any] = {"losses": [], "grad_norms": []}

    def before_update(optimizer, args, kwargs) -> None:
        if "grads" not in result:
            result["grads"] = {n: p.grad.detach().clone() for n, p in unwrap(engine.model).named_parameters()
                               if p.grad is not None}

    engine.optimizer.register_step_pre_hook(before_update)
    for step in range(STEPS):
        out = engine.step([stream.next() for _ in range(MICRO_BATCHES)], MICRO_BATCHES, step)
        result["losses"].append(out["loss"].item())
        result["grad_norms"].append(out["grad_norm"].item())
    return result


def _worker(rank: int, name: str, directory: str) -> None:
    def body() -> None:
        from bertforge.models.bert import BertForPreTraining
        from bertforge.parallel.dist import DistContext
        from bertforge.training import pipeline

        cfg = _config(name)
        torch.manual_seed(cfg.train.seed)
        engine = pipeline.build_engine(BertForPreTraining(cfg.model).train(), cfg.execution, cfg.train,
                                       DistContext(rank, cfg.execution.pipeline_stages), STEPS)
        result = _train(engine, cfg)
        result["layers"] = list(engine.stage_module.layers)
        result["names"] = sorted(n for n, _ in engine.stage_module.named_parameters())
        torch.save(result, f"{directory}/rank{rank}.pt")

    run_rank(rank, CASES[name][0], f"{directory}/store", body)


@pytest.fixture(scope="module")
def one_process() -> dict[str, Any]:
    from bertforge.models.bert import BertForPreTraining
    from bertforge.parallel.dist import DistContext
    from bertforge.training.engine import Engine
    from bertforge.training.optim import build_optimizer, build_scheduler
    from bertforge.training.pretrain import training_loss

    torch.set_num_threads(1)
    cfg = _config()
    torch.manual_seed(cfg.train.seed)
    model = BertForPreTraining(cfg.model).train()
    optimizer = build_optimizer(model, cfg.train)
    engine = Engine(model, optimizer, build_scheduler(optimizer, cfg.train, STEPS), training_loss, "fp32",
                    cfg.train.grad_clip, DistContext(), seed=cfg.train.seed)
    return _train(engine, cfg)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("name", list(CASES))
def test_placed_stages_equal_one_process(one_process, name, tmp_path):
    stages = CASES[name][0]
    mp.spawn(_worker, args=(name, str(tmp_path)), nprocs=stages)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(stages)]
    expected_layers = {"uneven": [[0], [1, 2, 3]], "same_ipu": [[], [0, 1, 2], [3]],
                       "two_ipus": [[], [], [0], [1, 2, 3]]}[name]
    assert [r["layers"] for r in ranks] == expected_layers
    if name == "two_ipus":  # the word embeddings alone, then the rest of the embeddings
        assert ranks[0]["names"] == ["bert.embeddings.word_embeddings.weight"]
        assert ranks[1]["names"] == ["bert.embeddings.LayerNorm.bias", "bert.embeddings.LayerNorm.weight",
                                     "bert.embeddings.position_embeddings.weight",
                                     "bert.embeddings.token_type_embeddings.weight"]
    assert all(r["losses"] == ranks[0]["losses"] for r in ranks)
    assert ranks[0]["losses"] == pytest.approx(one_process["losses"], rel=1e-6, abs=0)
    assert ranks[0]["grad_norms"] == pytest.approx(one_process["grad_norms"], rel=1e-6, abs=0)
    grads: dict[str, torch.Tensor] = {}
    for r in ranks:
        for key, grad in r["grads"].items():
            if key in grads:  # the tied word embedding: both copies hold the summed gradient
                assert torch.equal(grads[key], grad), key
            grads[key] = grad
    want = one_process["grads"]
    assert grads.keys() == want.keys()
    worst = max(((grads[k] - want[k]).norm() / want[k].norm()).item() for k in want if want[k].norm() > 1e-6)
    assert worst < 1e-6


@pytest.mark.parametrize("overrides,message", [
    ([("execution.pipeline_stages", 2), ("execution.hidden_layers_per_stage", "1,2")],
     "execution.hidden_layers_per_stage=[1, 2] must be counts of at least 1 that sum to model.num_hidden_layers=4"),
    ([("execution.pipeline_stages", 2), ("execution.hidden_layers_per_stage", "0,4")],
     "execution.hidden_layers_per_stage=[0, 4] must be counts of at least 1"),
    ([("execution.pipeline_stages", 3), ("execution.hidden_layers_per_stage", "1,3")],
     "execution.hidden_layers_per_stage=[1, 3] makes 2 stages, but execution.pipeline_stages=3"),
    ([("execution.pipeline_stages", 2), ("execution.hidden_layers_per_stage", "1,3"),
      ("execution.embeddings_placement", "same_ipu")],
     "execution.hidden_layers_per_stage=[1, 3] makes 2 stages plus 1 of embeddings "
     "(execution.embeddings_placement=same_ipu), but execution.pipeline_stages=2"),
    ([("execution.pipeline_stages", 2), ("execution.embeddings_placement", "two_ipus")],
     "execution.pipeline_stages=2 leaves 0 stages for model.num_hidden_layers=4 after "
     "execution.embeddings_placement=two_ipus's 2"),
    ([("execution.pipeline_stages", 2), ("execution.embeddings_placement", "same_host")],
     "execution.embeddings_placement: 'same_host' is not one of same_as_hidden_layers, same_ipu, two_ipus"),
    ([("execution.hidden_layers_per_stage", "2,2")],
     "execution.hidden_layers_per_stage=[2, 2] needs execution.pipeline_stages > 1"),
    ([("execution.embeddings_placement", "same_ipu")],
     "execution.embeddings_placement=same_ipu needs execution.pipeline_stages > 1"),
])
def test_placement_errors_name_the_field(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config("tiny", [("model.num_hidden_layers", 4)] + overrides)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_layer_counts_and_the_plan_place_the_embeddings():
    """Graphcore's placements: the embeddings' own stages hold no layers; the plan puts the word
    embeddings on stage 0, the rest of the embeddings beside them or (two_ipus) on stage 1."""
    from bertforge.parallel.plan import embedding_parameters, layer_parameters, plan_memory

    cfg = load_config("tiny", [("model.num_hidden_layers", 4), ("execution.pipeline_stages", 4),
                               ("execution.embeddings_placement", "two_ipus"),
                               ("execution.hidden_layers_per_stage", "1,3"),
                               ("train.global_batch_size", 64), ("train.micro_batch_size", 16)])
    assert pipeline_layer_counts(cfg.execution, 4) == [0, 0, 1, 3]
    m = cfg.model
    word = m.vocab_size * m.hidden_size
    held = [st["parameters"] for st in plan_memory(cfg, world_size=4).stages]
    assert [st["layers"] for st in plan_memory(cfg, world_size=4).stages] == [0, 0, 1, 3]
    assert held[:3] == [word, embedding_parameters(m) - word, layer_parameters(m)]
    even = load_config("tiny", [("model.num_hidden_layers", 4), ("execution.pipeline_stages", 3),
                                ("execution.embeddings_placement", "same_ipu")])
    assert pipeline_layer_counts(even.execution, 4) == [0, 2, 2]
