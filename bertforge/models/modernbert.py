"""ModernBERT (Warner et al. 2024, "Smarter, Better, Faster, Longer"): the encoder and its masked LM.

``model.family: modernbert`` builds it (see models/families.py). Parameter names are
those of transformers' ``ModernBertModel`` / ``ModernBertForMaskedLM``
(``model.embeddings.tok_embeddings``, ``model.layers.N.attn.Wqkv``,
``head.dense``, ``decoder.bias``): our state dict is theirs less the tied
``decoder.weight``. Like models/bert.py, single-device, with no processes or files.

What differs from BERT (models/bert.py):

- no position or token-type embeddings: rotary positions turn each query and
  key, with base ``global_rope_theta`` in the global layers and
  ``local_rope_theta`` in the local ones (cos and sin of every position are
  computed once, in fp32);
- layers 0, N, 2N, … (N = ``global_attn_every_n_layers``) attend globally,
  the others within a sliding window: a token sees the keys at most
  ``local_attention // 2`` positions away (``local_attention`` is the whole
  window, as transformers reads it);
- pre-norm layers (x + attn(norm(x)), then x + mlp(norm(x))) whose first
  attention norm is the identity (the embeddings are normalised already), a
  final norm, and LayerNorms and projections without biases;
- one fused (3H, H) ``Wqkv``; a GeGLU MLP: ``Wi`` to 2 × intermediate, split
  into input and gate, act(input) × gate, ``Wo`` back;
- the masked-LM head: dense, activation, norm, and the decoder, whose weight
  is the token embedding's and which has a bias;
- weights start truncated-normal within ± ``initializer_cutoff_factor`` std
  (see :func:`init_weights`).

The forward takes BERT's pre-training arguments (token types and [CLS]
positions are ignored) and gives ``(mlm_logits, None)``, as
``BertForMaskedLM`` does, so that the training loop and ``pretraining_loss``
run it unchanged; with ``masked_lm_positions`` only those positions reach the
head. Packed rows (``sequence_ids``, ``position_ids``) attend within their
sequences, windowed in the local layers; the masks come from
``model.layers_mask`` (an SDPA bias, or FlexAttention block masks with
``flex``).

Shapes: B batch, T sequence length, H hidden size, P masked positions per
row, V vocab size, D head size.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn.attention import SDPBackend

from bertforge.config import ModelConfig

from .bert import ACTIVATIONS, EncoderLayer, LayerNorm, Mask, SelfAttention, attend, layers_mask


class ModernBertEmbeddings(nn.Module):
    """Token embeddings, normalised (there are no position or token-type embeddings)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.pad_token_id)
        self.norm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, bias=False)
        self.drop = nn.Dropout(cfg.hidden_dropout_prob)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.drop(self.norm(self.tok_embeddings(input_ids)))  # (B, T, H)


class RotaryEmbedding(nn.Module):
    """cos and sin of the rotary angles of every position for one base, (positions, D / 2) in fp32;
    with a ``scaling_factor``, of every position divided by it (linear scaling).

    Buffers, not parameters, and left out of the state dict (as transformers'): they follow the
    model's device and are computed, not trained.
    """

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, head_size: int, positions: int, theta: float, scaling_factor: float = 1.0):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_size, 2, dtype=torch.float) / head_size))  # (D / 2,)
        if scaling_factor != 1.0:  # linear scaling: every position divided by the factor, as transformers' "linear"
            inv_freq = inv_freq / scaling_factor
        angles = torch.arange(positions, dtype=torch.float)[:, None] * inv_freq
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, position_ids: torch.Tensor | None, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) to turn (B, T, ·, heads, D) queries and keys: (T, 1, 1, D / 2), or (B, T, 1, 1, D / 2)
        for ``position_ids`` (B, T) (packed rows: each sequence from 0)."""
        if position_ids is None:
            return self.cos[:T, None, None], self.sin[:T, None, None]
        return self.cos[position_ids][..., None, None, :], self.sin[position_ids][..., None, None, :]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions: the pairs (x_i, x_{i + D/2}) of each head turned by their angles, in fp32
    (as transformers does), back in ``x``'s dtype."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class ModernBertAttention(SelfAttention):
    """Self-attention: one fused ``Wqkv``, rotary queries and keys, the output projection ``Wo``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.Wqkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=False)
        self.Wo = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.dropout_p = cfg.attention_probs_dropout_prob  # on the attention weights
        output_dropout = cfg.attention_output_dropout_prob
        self.out_drop = nn.Dropout(cfg.attention_probs_dropout_prob if output_dropout is None else output_dropout)
        self.backends: list[SDPBackend] | None = None  # see model.set_attention_backends

    def forward(self, x: torch.Tensor, mask: Mask, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, H = x.shape
        qkv = self.Wqkv(x).view(B, T, 3, self.num_heads, H // self.num_heads)  # (B, T, 3, heads, D)
        # Split, not sliced: the backward of a split is one concatenation, that of two slices two
        # zero-filled (B, T, 3, heads, D) gradients and their sum.
        qk, v = qkv.split([2, 1], dim=2)
        q, k = rotate(qk, cos, sin).permute(2, 0, 3, 1, 4).unbind(0)  # 2 × (B, heads, T, D)
        v = v.squeeze(2).transpose(1, 2)
        out = attend(q, k, v, mask, self.backends, self.dropout_p if self.training else 0.0)
        return self.out_drop(self.Wo(out.transpose(1, 2).reshape(B, T, H)))


class ModernBertMLP(nn.Module):
    """GeGLU: ``Wo(act(input) × gate)``, input and gate the two halves of ``Wi(x)``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.Wi = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.drop = nn.Dropout(cfg.hidden_dropout_prob)
        self.Wo = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input, gate = self.Wi(x).chunk(2, dim=-1)
        return self.Wo(self.drop(self.act(input) * gate))


class ModernBertEncoderLayer(EncoderLayer):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        # Layer 0's input is the normalised embeddings: no second norm (as transformers).
        self.attn_norm = (nn.Identity() if index == 0
                          else LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, bias=False))
        self.attn = ModernBertAttention(cfg)
        self.mlp_norm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, bias=False)
        self.mlp = ModernBertMLP(cfg)

    def forward(self, x: torch.Tensor, mask: Mask, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), mask, cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class ModernBertModel(nn.Module):
    """The encoder: token ids in, final-normed hidden states (B, T, H) out."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.flex = False  # masks as FlexAttention block masks (see model.set_attention_backends)
        self.embeddings = ModernBertEmbeddings(cfg)
        self.layers = nn.ModuleList(ModernBertEncoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        # Layers 0, N, 2N, … attend globally, the others within the window.
        self.is_global = [i % cfg.global_attn_every_n_layers == 0 for i in range(cfg.num_hidden_layers)]
        self.final_norm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, bias=False)
        head_size = cfg.hidden_size // cfg.num_attention_heads
        self.global_rotary = RotaryEmbedding(head_size, cfg.max_position_embeddings, cfg.global_rope_theta,
                                             cfg.rope_scaling_factor)
        self.local_rotary = RotaryEmbedding(head_size, cfg.max_position_embeddings, cfg.local_rope_theta,
                                            cfg.rope_scaling_factor)
        init_weights(self, cfg)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                position_ids: torch.Tensor | None = None, sequence_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``attention_mask`` (B, T) for padded rows, or ``sequence_ids`` and ``position_ids`` for packed
        ones (models/bert.py's module docstring)."""
        cfg = self.config
        B, T = input_ids.shape
        if position_ids is None and T > cfg.max_position_embeddings:  # (a packed row's positions restart)
            raise ValueError(f"sequence length {T} exceeds max_position_embeddings={cfg.max_position_embeddings}")
        x = self.embeddings(input_ids)
        if sequence_ids is not None and position_ids is not None and x.device.type == "cpu" and not self.flex:
            real = sequence_ids > 0
            if not bool(real.all()):
                # Padding is no document: on the CPU, which attends one document at a time, the layers run
                # on the real tokens of every row as one row (each row's sequences numbered apart), and
                # the padding's states are zeros, which nothing reads (the head gathers real positions).
                apart = sequence_ids.long() + torch.arange(B, device=x.device)[:, None] * (int(sequence_ids.max()) + 1)
                states = self.layers_and_norm(x[real][None], None, apart[real][None], position_ids[real][None])
                return states.new_zeros((B, T, states.shape[-1])).index_put((real,), states[0])
        return self.layers_and_norm(x, attention_mask, sequence_ids, position_ids)  # (B, T, H)

    def layers_and_norm(self, x: torch.Tensor, attention_mask: torch.Tensor | None, sequence_ids: torch.Tensor | None,
                        position_ids: torch.Tensor | None) -> torch.Tensor:
        cfg, T = self.config, x.shape[1]
        # Per kind of layer (global or not): its mask and rotary angles, made once per batch.
        masks = {is_global: layers_mask(x, attention_mask, sequence_ids, cfg, self.flex, self.training,
                                        window=None if is_global else cfg.local_attention // 2)
                 for is_global in set(self.is_global)}
        angles = {True: self.global_rotary(position_ids, T), False: self.local_rotary(position_ids, T)}
        for layer, is_global in zip(self.layers, self.is_global):
            x = layer(x, masks[is_global], *angles[is_global])
        return self.final_norm(x)


class ModernBertPredictionHead(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.norm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.act(self.dense(x)))


class TiedDecoder(nn.Module):
    """The projection onto the vocab: the token embeddings' weight (tied, as transformers' ``decoder``)
    and a bias of its own, the only parameter registered here."""

    def __init__(self, cfg: ModelConfig, tok_embeddings: nn.Embedding):
        super().__init__()
        self.tok_embeddings = [tok_embeddings]  # a list, so the tied weight is not registered twice
        self.bias = nn.Parameter(torch.zeros(cfg.vocab_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.tok_embeddings[0].weight, self.bias)


class ModernBertForMaskedLM(nn.Module):
    """ModernBERT's masked LM, called as ``BertForMaskedLM``: ``(mlm_logits, None)``; (B, P, V) logits of
    the ``masked_lm_positions`` only (sparse prediction), (B, T, V) without them."""

    next_sentence = False  # no NSP head (train.has_nsp)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = ModernBertModel(cfg)
        self.head = ModernBertPredictionHead(cfg)
        self.decoder = TiedDecoder(cfg, self.model.embeddings.tok_embeddings)
        init_weights(self.head, cfg)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, masked_lm_positions: torch.Tensor | None = None, *,
                position_ids: torch.Tensor | None = None, sequence_ids: torch.Tensor | None = None,
                cls_positions: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
        """BERT's pre-training arguments; ``token_type_ids`` and ``cls_positions`` are not used."""
        x = self.model(input_ids, attention_mask, position_ids=position_ids, sequence_ids=sequence_ids)
        if masked_lm_positions is not None:
            x = torch.gather(x, 1, masked_lm_positions.unsqueeze(-1).expand(-1, -1, x.shape[-1]))  # (B, P, H)
        return self.decoder(self.head(x)), None


def init_weights(module: nn.Module, cfg: ModelConfig) -> None:
    """transformers' ModernBERT initialisation of the layers in ``module``: truncated normal within
    ± ``initializer_cutoff_factor`` std, std ``initializer_range`` for the token embeddings and the
    input projections (``Wqkv``, ``Wi``), ``initializer_range / sqrt(2 × layers)`` for the output
    projections (``Wo``) and the head's dense; norms start at 1, the decoder's bias at 0."""
    std = cfg.initializer_range
    out_std = std / math.sqrt(2.0 * cfg.num_hidden_layers)

    def normal(weight: torch.Tensor, std: float) -> None:
        cutoff = cfg.initializer_cutoff_factor * std
        nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-cutoff, b=cutoff)

    for m in module.modules():
        if isinstance(m, ModernBertEmbeddings):
            normal(m.tok_embeddings.weight, std)  # the padding row too, as transformers
        elif isinstance(m, ModernBertAttention):
            normal(m.Wqkv.weight, std)
            normal(m.Wo.weight, out_std)
        elif isinstance(m, ModernBertMLP):
            normal(m.Wi.weight, std)
            normal(m.Wo.weight, out_std)
        elif isinstance(m, ModernBertPredictionHead):
            normal(m.dense.weight, out_std)


class ModernBertTaskModel(nn.Module):
    """A fine-tuning head on the encoder, as transformers' ``ModernBertFor{SequenceClassification,
    TokenClassification,QuestionAnswering}``: the prediction head (dense, activation, norm) on each
    token or on the pooled row, dropout (``classifier_dropout``) and ``classifier`` (num_labels, H),
    whose weight starts truncated-normal with std H^-0.5 (as transformers'). Its ``head`` has the
    masked LM's names, so an MLM checkpoint starts it where the MLM head was (as transformers does)."""

    pooled = False

    def __init__(self, cfg: ModelConfig, num_labels: int):
        super().__init__()
        if num_labels < 1:
            raise ValueError(f"num_labels must be at least 1, got {num_labels}")
        self.config = cfg
        self.num_labels = num_labels
        self.model = ModernBertModel(cfg)
        self.head = ModernBertPredictionHead(cfg)
        self.drop = nn.Dropout(cfg.classifier_dropout)
        self.classifier = nn.Linear(cfg.hidden_size, num_labels)
        init_weights(self.head, cfg)
        std = cfg.hidden_size ** -0.5
        cutoff = cfg.initializer_cutoff_factor * std
        nn.init.trunc_normal_(self.classifier.weight, mean=0.0, std=std, a=-cutoff, b=cutoff)
        nn.init.zeros_(self.classifier.bias)

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """(B, num_labels) pooled, else (B, T, num_labels)."""
        x = self.model(input_ids, attention_mask)  # (B, T, H)
        if self.pooled:
            x = pool(x, attention_mask, self.config.classifier_pooling)  # (B, H)
        return self.classifier(self.drop(self.head(x)))


def pool(x: torch.Tensor, attention_mask: torch.Tensor | None, how: str) -> torch.Tensor:
    """A row's hidden state (B, H) for the classifier: its first token's (``cls``), or the mean of its
    real tokens' (``mean``)."""
    if how == "cls":
        return x[:, 0]
    if attention_mask is None:
        return x.mean(dim=1)
    weights = attention_mask.to(x.dtype).unsqueeze(-1)  # (B, T, 1)
    return (x * weights).sum(dim=1) / weights.sum(dim=1)


class ModernBertForSequenceClassification(ModernBertTaskModel):
    """GLUE: the head on the pooled row (``classifier_pooling``: [CLS], or the mean of the real tokens);
    ``num_labels=1`` is regression (STS-B). Called as ``BertForSequenceClassification`` (token types
    are ignored)."""

    pooled = True

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.logits(input_ids, attention_mask)  # (B, num_labels)


class ModernBertForTokenClassification(ModernBertTaskModel):
    """NER: the head on every token."""

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.logits(input_ids, attention_mask)  # (B, T, num_labels)


class ModernBertForQuestionAnswering(ModernBertTaskModel):
    """SQuAD: a start and an end logit per token, from a ``classifier`` of 2 outputs (transformers'
    name; BERT's is ``qa_outputs``)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, num_labels=2)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = self.logits(input_ids, attention_mask).unbind(-1)
        return start, end  # (B, T) each
