"""FlexAttention with block masks (``execution.attention: flex``) equals the math path.

On the CPU torch runs FlexAttention as its reference implementation, the same function of the
same ``BlockMask`` that CUDA's fused kernel reads, so these check our masks and their wiring:
forward and backward, padded and packed rows, fp32 to 1e-5. torch refuses a CPU backward of
FlexAttention at its entry (``_validate_device``); the backward tests lift that check to run the
reference backward. The fused kernel itself is checked on CUDA (test_cuda.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.attention.flex_attention as flex_module
from test_packing import synthetic
from torch.nn.attention.flex_attention import BlockMask

from bertforge.config import ConfigError, ExecutionConfig, ModelConfig
from bertforge.data import PretrainingDataset
from bertforge.data.packing import pack_arrays
from bertforge.models.bert import (
    BertForPreTraining,
    Documents,
    attend,
    attention_rule,
    dense_bias,
    document_block_mask,
    layers_mask,
    length_groups,
    padding_block_mask,
    set_attention_backends,
)
from bertforge.parallel.dist import attention_backends
from bertforge.training.pretrain import forward_loss

# On the CPU FlexAttention runs uncompiled, which torch warns of each time.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

CFG = ModelConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                  max_position_embeddings=256, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def batch(packed: bool, seq_len: int = 256) -> dict[str, torch.Tensor]:
    arrays = synthetic(24, seq_len, 8, CFG.vocab_size, seed=5)
    rows = PretrainingDataset(pack_arrays(arrays, 3) if packed else arrays).batch(np.arange(4))
    return {k: v.long() if v.dtype == torch.int32 else v for k, v in rows.items()}


def twins() -> tuple[BertForPreTraining, BertForPreTraining]:
    torch.manual_seed(0)
    math = BertForPreTraining(CFG)
    set_attention_backends(math, ["math"])
    flex = BertForPreTraining(CFG)
    flex.load_state_dict(math.state_dict())
    set_attention_backends(flex, ["flex"])
    return math, flex


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_flex_forward_equals_the_math_path(packed):
    math, flex = twins()
    rows = batch(packed)
    with torch.no_grad():
        want, got = forward_loss(math.eval(), rows), forward_loss(flex.eval(), rows)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_flex_backward_equals_the_math_path(packed, monkeypatch):
    monkeypatch.setattr(flex_module, "_validate_device", lambda *tensors: None)  # torch's reference backward
    math, flex = twins()
    rows = batch(packed)
    for model in (math, flex):
        forward_loss(model.train(), rows)["loss"].backward()
    grads = dict(flex.named_parameters())
    for name, param in math.named_parameters():
        torch.testing.assert_close(grads[name].grad, param.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert grads["bert.encoder.layer.0.attention.self.query.weight"].grad.abs().max() > 1e-6  # not vacuous


def test_block_masks_are_the_bias_rules_and_skip_what_no_query_sees():
    ids = torch.zeros(2, 256, dtype=torch.long)
    ids[0, :100], ids[0, 100:200] = 1, 2  # two sequences, then 56 of padding
    ids[1, :] = 1  # one sequence filling the row
    mask = document_block_mask(ids)
    same = ids[:, :, None] == ids[:, None, :]
    assert torch.equal(mask.to_dense().bool(), torch.ones(2, 1, 2, 2, dtype=torch.bool))  # 128-blocks: all touched
    dense = torch.stack([mask.mask_mod(torch.tensor(b), torch.tensor(0), torch.arange(256)[:, None],
                                       torch.arange(256)[None]) for b in range(2)])
    assert torch.equal(dense, same)
    # At 512 tokens, a row of sequences of 128 skips the blocks between them: 12 of 16.
    ids = torch.arange(512).div(128, rounding_mode="floor")[None] + 1
    assert document_block_mask(ids).sparsity() == 100 * 12 / 16
    valid = torch.ones(1, 512, dtype=torch.long)
    valid[:, 256:] = 0  # half of the keys are padding: every query skips the last two key blocks
    assert padding_block_mask(valid).sparsity() == 100 * 8 / 16


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "per-document"])
@pytest.mark.parametrize("window", [None, 5, 40])
def test_attention_per_document_equals_the_rows_bias(window, grouped, monkeypatch):
    """The CPU's per-document attention equals SDPA over the whole row with the rule's bias, forward and
    backward: documents of consecutive tokens, one whose last token sits at the row's end (Graphcore's
    BERT packing), padding between and after, a row of one document, and documents of rows of 200
    tokens whose lengths make several groups (attended together padded to the group's longest: a
    group of two lengths, one alone, one of short documents), or one SDPA per document."""
    monkeypatch.setattr(Documents, "group_by_length", grouped)
    ids = torch.zeros(4, 200, dtype=torch.long)
    ids[0, :20], ids[0, 20:45], ids[0, 45:50] = 1, 2, 3  # then 150 of padding
    ids[1, :30], ids[1, 30:52], ids[1, 199] = 1, 2, 1  # sequence 1's [CLS] at the end; padding in between
    ids[2, :] = 1
    ids[3, :120], ids[3, 120:190], ids[3, 190:] = 1, 2, 3
    torch.manual_seed(0)
    q, k, v = (torch.randn(4, 2, 200, 8, requires_grad=True) for _ in range(3))
    rule = attention_rule(None, ids, window)
    want = attend(q, k, v, dense_bias(rule, 4, 200, torch.float32, q.device), None, 0.0)
    documents = Documents(ids, window, torch.float32)
    # 11 documents; grouped: 200 | 150, 147 (padding), 120 | 70 | 31, 25, 22, 20, 10, 5
    sizes = [1 if isinstance(index, tuple) else len(index) for index, _, _ in documents.groups]
    assert sizes == ([1, 3, 1, 6] if grouped else [1] * 11)
    got = attend(q, k, v, documents, None, 0.0)
    real = (ids > 0)[:, None, :, None]  # a padding query's output is what no real token reads
    torch.testing.assert_close(torch.where(real, got, 0.0), torch.where(real, want, 0.0), rtol=1e-6, atol=1e-6)
    grads = [torch.autograd.grad((out * real).square().sum(), (q, k, v)) for out in (want, got)]
    for theirs, ours in zip(*grads):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_documents_are_grouped_by_length_with_little_padding():
    """Longest first; a document joins the group before it while the padded score area stays within
    1.25 × the real one, or while the group's longest is at most 64 tokens (a call costs more)."""
    lengths = [256, 250, 120, 15, 30, 256]
    assert length_groups(lengths) == [[0, 5, 1], [2], [4, 3]]
    assert length_groups(lengths, group=False) == [[0], [1], [2], [3], [4], [5]]
    assert length_groups([100, 100, 100]) == [[0, 1, 2]]  # equal lengths: one call, no padding


def test_flex_is_used_only_where_it_changes_nothing():
    rows = batch(packed=True)
    x = torch.zeros(4, 256, CFG.hidden_size)
    assert isinstance(layers_mask(x, None, rows["sequence_ids"], CFG, flex=True, training=True), BlockMask)
    dropout = ModelConfig(**{**CFG.__dict__, "attention_probs_dropout_prob": 0.1})
    # FlexAttention has no dropout: a training forward with attention dropout takes SDPA's path (on the
    # CPU an attention per document; elsewhere the additive bias) ...
    documents = layers_mask(x, None, rows["sequence_ids"], dropout, flex=True, training=True)
    assert isinstance(documents, Documents) and documents.shape == (4, 256)
    # ... and an evaluation, which has none, the block mask.
    assert isinstance(layers_mask(x, None, rows["sequence_ids"], dropout, flex=True, training=False), BlockMask)
    assert layers_mask(x, None, None, CFG, flex=True, training=True) is None  # no padding: no mask at all

    flex = ExecutionConfig(attention="flex")
    assert attention_backends(flex, torch.device("cuda"), 0.0) == ["flex"]
    with pytest.raises(ConfigError, match=r"^execution.attention=flex trains on CUDA only"):
        attention_backends(flex, torch.device("cpu"), 0.0)
    with pytest.raises(ConfigError, match=r"model.attention_probs_dropout_prob=0.1: set it to 0, or use auto$"):
        attention_backends(flex, torch.device("cuda"), 0.1)
