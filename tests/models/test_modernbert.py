"""ModernBERT (``model.family: modernbert``) against transformers' ModernBertForMaskedLM as the oracle.

The same weights (transformers' state dict less its tied ``decoder.weight``) give the same logits
and loss (fp32, 1e-5) and gradients (1e-4 of the largest, per tensor) for padded, unpadded and
packed batches of sequences longer than the window (local layers matter); the FlexAttention path
equals the math path on the CPU; the block masks skip what they should; presets and config are
transformers' and the published models'; a run on the built-in corpus learns.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os

import pytest
import torch
import torch.nn.attention.flex_attention as flex_module
import yaml
from safetensors.torch import load_file

os.environ["HF_HUB_OFFLINE"] = "1"  # never reach the network; set before transformers is imported
transformers = pytest.importorskip("transformers")

from bertforge.cli import main  # noqa: E402
from bertforge.config import (  # noqa: E402
    ConfigError,
    ModelConfig,
    config_from_dict,
    load_config,
)
from bertforge.formats.load import load_weights  # noqa: E402
from bertforge.models.bert import (  # noqa: E402
    BertForPreTraining,
    layers_mask,
    pretraining_loss,
    set_attention_backends,
)
from bertforge.models.families import build_pretraining_model  # noqa: E402
from bertforge.models.modernbert import ModernBertAttention, ModernBertEncoderLayer, ModernBertForMaskedLM  # noqa: E402
from bertforge.parallel.dist import apply_recompute  # noqa: E402
from bertforge.training.optim import param_groups  # noqa: E402

# On the CPU FlexAttention runs uncompiled, which torch warns of each time.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

# Four layers: global, local, local, global; windows of 128 (64 each side) in rows of 300.
CFG = ModelConfig(family="modernbert", vocab_size=128, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                  intermediate_size=48, max_position_embeddings=512, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0, layer_norm_eps=1e-5, pad_token_id=0)
T = 300
LENGTHS = (300, 170, 90, 40)  # as a padded batch of 4 rows, or packed: [300] and [170 + 90 + 40]


def hf_config(cfg: ModelConfig, **overrides) -> transformers.ModernBertConfig:
    """transformers' config of the same model (our field names read as theirs)."""
    return transformers.ModernBertConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, intermediate_size=cfg.intermediate_size,
        hidden_activation=cfg.hidden_act, classifier_activation=cfg.hidden_act,
        max_position_embeddings=cfg.max_position_embeddings, norm_eps=cfg.layer_norm_eps,
        initializer_range=cfg.initializer_range, initializer_cutoff_factor=cfg.initializer_cutoff_factor,
        pad_token_id=cfg.pad_token_id, bos_token_id=None, eos_token_id=None, cls_token_id=None, sep_token_id=None,
        global_attn_every_n_layers=cfg.global_attn_every_n_layers, local_attention=cfg.local_attention,
        global_rope_theta=cfg.global_rope_theta, local_rope_theta=cfg.local_rope_theta,
        embedding_dropout=cfg.hidden_dropout_prob, mlp_dropout=cfg.hidden_dropout_prob,
        attention_dropout=cfg.attention_probs_dropout_prob, **overrides)


@pytest.fixture(scope="module")
def twins() -> tuple[ModernBertForMaskedLM, torch.nn.Module]:
    """Ours and transformers' (eager attention) with the same weights, every one perturbed (unit norms
    and the zero decoder bias too)."""
    torch.manual_seed(0)
    theirs = transformers.ModernBertForMaskedLM(hf_config(CFG, attn_implementation="eager")).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    ours = ModernBertForMaskedLM(CFG).eval()
    state = theirs.state_dict()
    assert torch.equal(state["decoder.weight"], state["model.embeddings.tok_embeddings.weight"])  # tied
    ours.load_state_dict({k: v for k, v in state.items() if k != "decoder.weight"}, strict=True)
    return ours, theirs


def sequences() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Token ids of LENGTHS and, for each, 15 % of its positions to predict."""
    gen = torch.Generator().manual_seed(2)
    tokens = [torch.randint(1, CFG.vocab_size, (n,), generator=gen) for n in LENGTHS]
    masked = [torch.randperm(n, generator=gen)[:max(1, int(0.15 * n))].sort().values for n in LENGTHS]
    return tokens, masked


def padded_batch() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The sequences as right-padded rows (our batch), and transformers' labels (-100: not predicted)."""
    tokens, masked = sequences()
    B, P = len(tokens), max(len(m) for m in masked)
    batch = {"input_ids": torch.zeros(B, T, dtype=torch.long), "attention_mask": torch.zeros(B, T, dtype=torch.long),
             "masked_lm_positions": torch.zeros(B, P, dtype=torch.long),
             "masked_lm_ids": torch.zeros(B, P, dtype=torch.long), "masked_lm_weights": torch.zeros(B, P),
             "next_sentence_labels": torch.zeros(B, dtype=torch.long)}
    labels = torch.full((B, T), -100)
    for b, (ids, positions) in enumerate(zip(tokens, masked)):
        batch["input_ids"][b, :len(ids)] = ids
        batch["attention_mask"][b, :len(ids)] = 1
        batch["masked_lm_positions"][b, :len(positions)] = positions
        batch["masked_lm_ids"][b, :len(positions)] = ids[positions]
        batch["masked_lm_weights"][b, :len(positions)] = 1
        labels[b, positions] = ids[positions]
    return batch, labels


def packed_batch() -> tuple[dict[str, torch.Tensor], list[tuple[int, int, int]]]:
    """The same sequences packed into two rows (per-sequence positions), and where each lies:
    (row, start, length)."""
    tokens, masked = sequences()
    rows = [[0], [1, 2, 3]]
    P = max(sum(len(masked[i]) for i in row) for row in rows)
    batch = {"input_ids": torch.zeros(2, T, dtype=torch.long), "sequence_ids": torch.zeros(2, T, dtype=torch.long),
             "position_ids": torch.zeros(2, T, dtype=torch.long),
             "masked_lm_positions": torch.zeros(2, P, dtype=torch.long),
             "masked_lm_ids": torch.zeros(2, P, dtype=torch.long), "masked_lm_weights": torch.zeros(2, P),
             "next_sentence_labels": torch.zeros(2, 3, dtype=torch.long)}
    where = []
    for r, row in enumerate(rows):
        start = predicted = 0
        for slot, i in enumerate(row, 1):
            n, positions = len(tokens[i]), masked[i]
            batch["input_ids"][r, start:start + n] = tokens[i]
            batch["sequence_ids"][r, start:start + n] = slot
            batch["position_ids"][r, start:start + n] = torch.arange(n)
            batch["masked_lm_positions"][r, predicted:predicted + len(positions)] = start + positions
            batch["masked_lm_ids"][r, predicted:predicted + len(positions)] = tokens[i][positions]
            batch["masked_lm_weights"][r, predicted:predicted + len(positions)] = 1
            where.append((r, start, n))
            start, predicted = start + n, predicted + len(positions)
    return batch, where


def our_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The training loop's loss (train.forward_loss's call of the model, then pretraining_loss)."""
    logits, nsp = model(batch["input_ids"], None, batch.get("attention_mask"), batch["masked_lm_positions"],
                        position_ids=batch.get("position_ids"), sequence_ids=batch.get("sequence_ids"))
    assert nsp is None
    return pretraining_loss(logits, None, batch, accuracy=False)["loss"]


def gradients(model: torch.nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def relative_gap(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> float:
    """The largest, over tensors, of max |ours - theirs| / max |theirs|, for the same names."""
    assert ours.keys() == theirs.keys()
    return max(((ours[k] - theirs[k]).abs().max() / theirs[k].abs().max()).item() for k in theirs)


def test_padded_and_unpadded_batches_equal_transformers(twins):
    ours, theirs = twins
    batch, labels = padded_batch()
    mask = batch["attention_mask"].bool()
    want = theirs(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels)
    got, _ = ours(batch["input_ids"], None, batch["attention_mask"])  # (B, T, V): every position
    torch.testing.assert_close(got[mask], want.logits[mask], rtol=0, atol=1e-5)  # padding's logits: no one's
    loss = our_loss(ours, batch)  # sparse: only the masked positions reach the head
    torch.testing.assert_close(loss, want.loss, rtol=0, atol=1e-5)
    assert relative_gap(gradients(ours, loss), gradients(theirs, want.loss)) < 1e-4

    full = {k: v[:1] for k, v in batch.items()}  # the 300-token row alone: no mask at all
    del full["attention_mask"]
    want = theirs(input_ids=full["input_ids"], labels=labels[:1])
    got, _ = ours(full["input_ids"])
    torch.testing.assert_close(got, want.logits, rtol=0, atol=1e-5)
    loss = our_loss(ours, full)
    torch.testing.assert_close(loss, want.loss, rtol=0, atol=1e-5)
    assert relative_gap(gradients(ours, loss), gradients(theirs, want.loss)) < 1e-4


def test_packed_rows_equal_transformers_padded_batch_of_the_same_sequences(twins):
    ours, theirs = twins
    padded, labels = padded_batch()
    packed, where = packed_batch()
    want = theirs(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"], labels=labels)
    got, _ = ours(packed["input_ids"], None, None, position_ids=packed["position_ids"],
                  sequence_ids=packed["sequence_ids"])
    for i, (row, start, n) in enumerate(where):
        torch.testing.assert_close(got[row, start:start + n], want.logits[i, :n], rtol=0, atol=1e-5)
    loss = our_loss(ours, packed)
    torch.testing.assert_close(loss, want.loss, rtol=0, atol=1e-5)
    assert relative_gap(gradients(ours, loss), gradients(theirs, want.loss)) < 1e-4


def test_padding_after_packed_rows_changes_nothing_and_is_not_computed(twins):
    """Rows with padding after their sequences (sequence id 0): the real tokens' logits, the loss and the
    gradients are those of the rows without it; on the CPU the layers skip the padding (its states zero)."""
    ours, _ = twins
    packed, where = packed_batch()
    padded = dict(packed)
    for key in ("input_ids", "sequence_ids", "position_ids"):
        padded[key] = torch.cat([packed[key], torch.zeros(2, 24, dtype=packed[key].dtype)], dim=1)
    padded["input_ids"][:, T:] = CFG.pad_token_id
    with torch.no_grad():
        states = ours.model(padded["input_ids"], position_ids=padded["position_ids"],
                            sequence_ids=padded["sequence_ids"])
        want = ours.model(packed["input_ids"], position_ids=packed["position_ids"],
                          sequence_ids=packed["sequence_ids"])
    assert states.shape == (2, T + 24, CFG.hidden_size) and states[:, T:].abs().max().item() == 0
    torch.testing.assert_close(states[:, :T], want, rtol=0, atol=1e-5)
    loss, reference = our_loss(ours, padded), our_loss(ours, packed)
    torch.testing.assert_close(loss, reference, rtol=0, atol=1e-6)
    assert relative_gap(gradients(ours, loss), gradients(ours, reference)) < 1e-5


def test_local_layers_see_a_window_of_local_attention_tokens(twins):
    """The window matters in rows of 300 (so the equalities above test it), and is transformers' exactly:
    keys at most local_attention // 2 = 64 away."""
    ours, theirs = twins
    batch, _ = padded_batch()
    ids = batch["input_ids"][:1]
    wide = ModernBertForMaskedLM(dataclasses.replace(CFG, local_attention=1024)).eval()
    wide.load_state_dict(ours.state_dict())
    with torch.no_grad():
        assert (wide(ids)[0] - ours(ids)[0]).abs().max() > 1e-2
    x = torch.zeros(1, T, CFG.hidden_size)
    bias = layers_mask(x, None, None, CFG, flex=False, training=False, window=CFG.local_attention // 2)
    distance = (torch.arange(T)[:, None] - torch.arange(T)[None]).abs()
    assert torch.equal(bias[0, 0] == 0, distance <= 64)
    assert layers_mask(x[:, :65], None, None, CFG, flex=False, training=False, window=64) is None  # all within


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_flex_path_equals_the_math_path(packed, monkeypatch):
    """Block masks of the window combined with padding or the document mask (the reference FlexAttention
    on the CPU) against the dense bias: forward and backward, fp32, 1e-5."""
    monkeypatch.setattr(flex_module, "_validate_device", lambda *tensors: None)  # torch's reference backward
    torch.manual_seed(0)
    math = ModernBertForMaskedLM(CFG)
    flex = ModernBertForMaskedLM(CFG)
    flex.load_state_dict(math.state_dict())
    set_attention_backends(math, ["math"])
    set_attention_backends(flex, ["flex"])
    batch = packed_batch()[0] if packed else padded_batch()[0]
    losses = [our_loss(model, batch) for model in (math, flex)]
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=1e-5)
    want, got = (gradients(model, loss) for model, loss in zip((math, flex), losses))
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)
    assert want["model.layers.1.attn.Wqkv.weight"].abs().max() > 1e-6  # not vacuous


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fused_flex_kernel_equals_math_on_cuda():
    """CUDA's compiled FlexAttention against the math kernel on packed rows with windows, a bf16 step:
    loss and gradients within bf16's rounding (BERT's kernels: tests/training/test_cuda.py)."""
    cfg = dataclasses.replace(CFG, hidden_size=128, intermediate_size=192)  # heads of 64
    torch.manual_seed(0)
    math = ModernBertForMaskedLM(cfg).cuda()
    flex = copy.deepcopy(math)
    set_attention_backends(math, ["math"])
    set_attention_backends(flex, ["flex"])
    batch = {k: v.cuda() for k, v in packed_batch()[0].items()}
    losses = []
    for model in (math, flex):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = our_loss(model, batch)
        loss.backward()
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=2e-2)
    got = dict(flex.named_parameters())
    for name, param in math.named_parameters():
        assert (got[name].grad - param.grad).abs().max() <= 5e-2 * param.grad.abs().max() + 1e-6, name


def row_of(lengths: list[int]) -> torch.Tensor:
    """sequence_ids (1, T) of a row packed with sequences of ``lengths``."""
    return torch.repeat_interleave(torch.arange(1, len(lengths) + 1), torch.tensor(lengths))[None]


def blocks_seen(lengths: list[int], window: int | None, block: int = 128) -> int:
    """The (query block, key block) pairs in which some query sees some key, counted from the
    sequences' spans: for each sequence, the block pairs its own square (cut to the window's band) covers."""
    seen = set()
    start = 0
    for n in lengths:
        first, last = start // block, (start + n - 1) // block
        for i in range(first, last + 1):
            for j in range(first, last + 1):
                # The nearest query of block i and key of block j inside the sequence.
                gap = max(0, max(i, j) * block - (min(i, j) + 1) * block + 1)
                if window is None or gap <= window:
                    seen.add((i, j))
        start += n
    return len(seen)


@pytest.mark.parametrize(("T", "lengths"), [
    (1024, [1024]),  # one sequence filling the row
    (1024, [128] * 8),  # packed, on block boundaries
    (1024, [300, 200, 400, 124]),  # packed, across them
    (2048, [700, 50, 900, 398]),
    (8192, [8192]),
])
def test_block_masks_skip_the_blocks_no_query_sees(T, lengths):
    """The fraction of 128 × 128 blocks skipped by the global (document) and local (document and
    window of 128) masks is what the layout says."""
    ids = row_of(lengths)
    assert ids.shape == (1, T)
    n = (T // 128) ** 2
    x = torch.zeros(1, T, CFG.hidden_size)
    for window in ((None, 64) if T < 8192 else (64,)):
        mask = layers_mask(x, None, ids, CFG, flex=True, training=True, window=window)  # as the model makes it
        assert mask.sparsity() == pytest.approx(100 * (1 - blocks_seen(lengths, window) / n)), window
    if lengths == [1024]:  # a window of 64 each side sees the block and its two neighbours: 22 of 64
        assert blocks_seen(lengths, 64) == 8 + 2 * 7
    if T == 8192:
        assert mask.sparsity() == pytest.approx(100 * (1 - (64 + 2 * 63) / 4096))  # 95.4 % skipped


@pytest.mark.smoke
def test_presets_are_the_published_models():
    """modernbert-base is transformers' ModernBertConfig defaults (answerdotai/ModernBERT-base);
    -large is answerdotai/ModernBERT-large's config.json (28 layers, 1024 wide, 16 heads, 2624)."""
    base = load_config("modernbert-base", [("train.objective", "mlm")]).model
    hf = transformers.ModernBertConfig()
    # The tokenizer's ids, not the model's; and the pattern of layers, which layer_types holds.
    specials = ("bos_token_id", "eos_token_id", "cls_token_id", "sep_token_id", "global_attn_every_n_layers")
    assert ({k: v for k, v in hf_config(base).to_dict().items() if k not in specials}
            == {k: v for k, v in hf.to_dict().items() if k not in specials})
    assert (hf.layer_types[:4], hf.sliding_window) == (
        ["full_attention", "sliding_attention", "sliding_attention", "full_attention"], 64)
    large = load_config("modernbert-large", [("train.objective", "mlm")]).model
    assert dataclasses.replace(base, num_hidden_layers=28, hidden_size=1024, num_attention_heads=16,
                               intermediate_size=2624) == large
    assert load_config("modernbert-tiny", [("train.objective", "mlm")]).model.family == "modernbert"


def test_config_shows_the_family_fields_and_bert_configs_are_unchanged(capsys):
    assert main(["config", "--model.family", "modernbert", "--train.objective", "mlm"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["model"]["family"] == "modernbert" and shown["model"]["local_attention"] == 128
    assert "type_vocab_size" not in shown["model"]
    assert config_from_dict(shown).to_dict() == shown  # config.yaml reads back as it was
    bert = load_config("pretrain_tiny").to_dict()["model"]
    assert list(bert) == ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                          "intermediate_size", "hidden_act", "hidden_dropout_prob", "attention_probs_dropout_prob",
                          "max_position_embeddings", "type_vocab_size", "layer_norm_eps", "initializer_range",
                          "pad_token_id"]


@pytest.mark.parametrize(("overrides", "message"), [
    ([("model.family", "modernbert")], r"model.family=modernbert has no next-sentence head: train.objective=mlm_nsp "
                                       r"cannot be used; set train.objective mlm$"),
    ([("model.local_attention", "64")], r"^model.local_attention is not a field of model.family=bert$"),
    ([("model.family", "modernbert"), ("train.objective", "mlm"), ("model.num_attention_heads", "256")],
     r"head size .* = 3 must be even"),
    ([("model.family", "modernbert"), ("train.objective", "mlm"), ("execution.pipeline_stages", "2")],
     r"pipeline_stages=2 cannot be used with model.family=modernbert"),
])
def test_what_modernbert_cannot_do_is_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_config(None, overrides)
    assert "\n" not in str(err.value)


def test_attention_output_dropout_drops_after_wo_alone():
    """model.attention_output_dropout_prob is ModernBERT's own attn_out_dropout_prob (its recipe: 0.1, with
    attention_probs_dropout_prob 0): in training every Wo output is dropped or scaled by 1 / (1 - p) while
    the attention weights keep no dropout; unset, the output dropout is attention_probs_dropout_prob, as
    transformers' one attention_dropout."""
    torch.manual_seed(0)
    model = build_pretraining_model(dataclasses.replace(CFG, attention_output_dropout_prob=0.5), "mlm").train()
    seen = []
    for layer in model.model.layers:
        assert layer.attn.dropout_p == 0.0
        layer.attn.out_drop.register_forward_hook(lambda module, args, out: seen.append((args[0], out)))
    our_loss(model, padded_batch()[0])
    assert len(seen) == CFG.num_hidden_layers
    for wo, dropped in seen:
        kept = dropped != 0
        assert torch.equal(dropped[kept], wo[kept] * 2)
        assert 0.45 < kept.float().mean().item() < 0.55
    unset = ModernBertAttention(dataclasses.replace(CFG, attention_probs_dropout_prob=0.1))
    assert (unset.dropout_p, unset.out_drop.p) == (0.1, 0.1)
    recipe = load_config("modernbert_base_1024").model
    assert (recipe.attention_probs_dropout_prob, recipe.attention_output_dropout_prob) == (0.0, 0.1)
    with pytest.raises(ConfigError, match=r"^model.attention_output_dropout_prob=1.0 must be in \[0, 1\) in "):
        load_config("modernbert_base_1024", [("model.attention_output_dropout_prob", "1")])


def test_families_build_their_models_and_bert_classes_refuse_modernbert():
    assert type(build_pretraining_model(CFG, "mlm")) is ModernBertForMaskedLM
    with pytest.raises(ConfigError, match=r"^model.family=modernbert: only bertforge pretrain builds"):
        BertForPreTraining(CFG)
    with pytest.raises(ConfigError, match=r"model.pad_token_id=200 is not below model.vocab_size=128"):
        build_pretraining_model(dataclasses.replace(CFG, pad_token_id=200), "mlm")


@pytest.mark.smoke
def test_initialisation_is_transformers(twins):
    """Truncated normal within ± 2 std, with transformers' std per tensor: each tensor's spread and
    bound equal those of transformers' fresh model to a few percent."""
    torch.manual_seed(3)
    theirs = transformers.ModernBertForMaskedLM(hf_config(dataclasses.replace(CFG, vocab_size=4096)))
    ours = ModernBertForMaskedLM(dataclasses.replace(CFG, vocab_size=4096))
    want = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        w = want[name]
        if name.endswith("norm.weight") or name == "decoder.bias":
            assert torch.equal(p, w), name  # ones, zeros
            continue
        assert p.abs().max().item() == pytest.approx(w.abs().max().item(), rel=0.01), name  # the cutoff
        assert p.std().item() == pytest.approx(w.std().item(), rel=0.08), name
    out = 0.02 / (2 * CFG.num_hidden_layers) ** 0.5  # the output projections' std (a normal cut at ±2σ: 0.88σ)
    assert ours.model.layers[1].mlp.Wo.weight.std().item() == pytest.approx(0.8796 * out, rel=0.08)
    assert ours.model.layers[1].mlp.Wo.weight.abs().max().item() == pytest.approx(2 * out, rel=0.01)
    assert type(ours.model.layers[0].attn_norm) is torch.nn.Identity  # as transformers' first layer


def test_norms_and_biases_are_not_decayed_and_recompute_reaches_modernbert():
    model = ModernBertForMaskedLM(CFG)
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay = sorted(names[id(p)] for p in param_groups(model, 0.01)[1]["params"])
    assert no_decay == sorted(n for n in names.values() if "norm" in n or n == "decoder.bias")
    for policy, unit in (("layer", ModernBertEncoderLayer), ("attention", ModernBertAttention)):
        recomputed = copy.deepcopy(model)
        apply_recompute(recomputed, policy)
        wrapped = [m for m in recomputed.modules() if isinstance(m.forward, functools.partial)]
        assert len(wrapped) == CFG.num_hidden_layers and all(isinstance(m, unit) for m in wrapped)


@pytest.mark.slow
def test_pretrain_command_trains_a_tiny_modernbert_on_the_built_in_corpus(tmp_path, capsys):
    assert main(["pretrain", "--config", "modernbert-tiny", "--train.objective", "mlm", "--train.steps", "40",
                 "--data.seq_len", "64", "--data.max_predictions", "10", "--data.dupe_factor", "1",
                 "--train.micro_batch_size", "16", "--train.global_batch_size", "16", "--train.optimizer", "adamw",
                 "--train.lr", "0.003", "--train.warmup_steps", "5", "--train.eval_every", "40",
                 "--train.eval_batches", "10", "--log.every", "5", "--log.progress", "false",
                 "--log.tensorboard", "false", "--log.run_dir", str(tmp_path), "--log.name", "run",
                 "--execution.threads", "1"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r["loss"] for r in rows if r.get("split") != "eval" and "loss" in r]
    evals = [r for r in rows if r.get("split") == "eval"]
    assert train[0] > 8.5 and train[-1] < train[0] - 2.0  # from ln(8192) = 9.0 down
    assert evals[-1]["mlm_loss"] < evals[0]["mlm_loss"] - 2.0
    cfg = config_from_dict(yaml.safe_load((tmp_path / "run" / "config.yaml").read_text()))
    assert (cfg.model.family, cfg.model.pad_token_id, cfg.model.vocab_size) == ("modernbert", 0, 8192)
    saved = load_file(tmp_path / "run" / "checkpoints" / "step_00000040" / "model.safetensors")
    assert "model.layers.1.attn.Wqkv.weight" in saved and "decoder.bias" in saved  # transformers' names
    model = ModernBertForMaskedLM(cfg.model)
    load_weights(model, tmp_path / "run")  # --init
    assert all(torch.equal(value, saved[name]) for name, value in model.state_dict().items())
    capsys.readouterr()
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "out"), "--format", "tf1"]) == 2  # BERT's format
    assert capsys.readouterr().err.count("\n") == 1
    assert not (tmp_path / "out").exists()
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "out")]) == 0  # to Hugging Face, as interop tests
    assert transformers.ModernBertForMaskedLM.from_pretrained(tmp_path / "out").config.vocab_size == 8192
