"""The whole BERT: embeddings, encoder, pooler and the task heads.

Parameter names follow Hugging Face's ``modeling_bert.py`` (``bert.embeddings.
word_embeddings``, ``attention.self.query``, ``cls.predictions…``) so that
importing and exporting weights is a near-identity key map (see formats/hf.py).
The model is single-device and knows nothing of processes or files.

Shapes: B batch, T sequence length, H hidden size, P masked positions per
sequence, V vocab size, S sequences per packed row.

Packed rows (``bertforge.data.packing``) hold several sequences: given
``sequence_ids`` (B, T), each token's 1-based sequence index (0 = padding),
attention is block-diagonal (a token sees only its own sequence), positions
come from ``position_ids``, and the pooler and NSP head read each sequence's
own [CLS] at ``cls_positions`` (B, S). Without them nothing changes.

Masks reach attention in one of two forms (:func:`layers_mask`), both made
from one rule, a function of (row, head, query, key) (:func:`attention_rule`):
an additive bias for SDPA, the rule evaluated by broadcasting ((B, 1, 1, T)
for padding, (B, 1, T, T) for packed rows), or a FlexAttention ``BlockMask``
(``flex``): the rule evaluated per 128 × 128 block, so that blocks no query
may see (another sequence of a packed row, padding, beyond a sliding window)
are skipped and no (T × T) tensor is made. ModernBERT (models/modernbert.py) takes
its local layers' masks from the same builder, with a ``window``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, and_masks, create_block_mask, flex_attention

from bertforge.config import ConfigError, ModelConfig

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "relu": F.relu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
}


def bf16_autocast(device_type: str) -> bool:
    return torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) == torch.bfloat16


class LayerNorm(nn.LayerNorm):
    """LayerNorm that keeps the residual stream in bf16 under bf16 autocast.

    Autocast would run LayerNorm on an fp32 copy of its input and return fp32:
    the residual stream, and what the backward keeps of it, would then be
    fp32, and every following matmul would cast it again. Here a bf16 input is
    normalised as it is, with the weights cast to bf16 as autocast casts a
    matmul's (CUDA's kernel takes one dtype for input and weights; it
    accumulates in fp32), and the output is bf16; the embeddings' fp32 sum is
    normalised in fp32 and handed on in bf16. bf16 has fp32's range; fp16 has
    not, so under fp16 autocast (and without autocast) this is nn.LayerNorm.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        if not bf16_autocast(device):
            return super().forward(x)
        if x.dtype != torch.bfloat16:
            return super().forward(x).to(torch.bfloat16)
        bias = None if self.bias is None else self.bias.to(x.dtype)  # (ModernBERT's norms have none)
        with torch.autocast(device, enabled=False):
            return F.layer_norm(x, self.normalized_shape, self.weight.to(x.dtype), bias, self.eps)


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.pad_token_id)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            T = input_ids.shape[1]
            positions = self.position_embeddings.weight[:T]  # (T, H), broadcast over B
        else:  # packed rows: each sequence's positions start at 0
            positions = self.position_embeddings(position_ids)  # (B, T, H)
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids) + positions
        return self.dropout(self.LayerNorm(x))  # (B, T, H)


class EncoderLayer(nn.Module):
    """An encoder layer, of any model family: what FSDP shards as one unit and ``execution.recompute:
    layer`` recomputes in the backward pass. Both are applied from outside (parallel/dist.py)."""


class SelfAttention(nn.Module):
    """An encoder layer's self-attention (its projections and the kernel), of any model family: what
    ``execution.recompute: attention`` recomputes in the backward pass (parallel/dist.py)."""


class BertSelfAttention(SelfAttention):
    """Multi-head self-attention with Hugging Face's three projections, run as one.

    ``query``, ``key`` and ``value`` stay separate parameters (their names are
    Hugging Face's, and LAMB's trust ratio is per tensor, as the references
    compute it). Under autocast the forward concatenates them into one (3H, H)
    matmul, at no cost in memory (benchmarks/fast_path.py); in fp32 the copy
    would cost memory and, on the CPU, time, so it runs the three.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.query = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.value = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.dropout_p = cfg.attention_probs_dropout_prob
        self.backends: list[SDPBackend] | None = None  # see set_attention_backends; None = torch's order

    def forward(self, x: torch.Tensor, mask: Mask) -> torch.Tensor:
        B, T, H = x.shape
        # (Layers converted to FP8, execution.fp8, are not nn.Linear itself: they run their own matmuls.)
        if torch.is_autocast_enabled(x.device.type) and type(self.query) is nn.Linear:
            # Autocast copies the weights to bf16/fp16 anyway; concatenated, they make one copy.
            weight = torch.cat([self.query.weight, self.key.weight, self.value.weight])  # (3H, H)
            bias = torch.cat([self.query.bias, self.key.bias, self.value.bias])
            # (B, T, 3H) -> 3 × (B, heads, T, H/heads)
            q, k, v = F.linear(x, weight, bias).view(B, T, 3, self.num_heads, H // self.num_heads).permute(
                2, 0, 3, 1, 4).unbind(0)
        else:  # in fp32 the concatenation would be a copy of the weights kept for the backward
            q, k, v = (layer(x).view(B, T, self.num_heads, H // self.num_heads).transpose(1, 2)
                       for layer in (self.query, self.key, self.value))
        out = attend(q, k, v, mask, self.backends, self.dropout_p if self.training else 0.0)
        return out.transpose(1, 2).reshape(B, T, H)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, backends: list[SDPBackend] | None,
           dropout_p: float) -> torch.Tensor:
    """Scaled dot-product attention of (B, heads, T, head size) queries, keys and values under ``mask``:
    FlexAttention for a block mask, else SDPA with the ``backends`` (None: torch's order)."""
    if isinstance(mask, BlockMask):  # (no dropout: layers_mask makes block masks only without it)
        return flex_kernel(q.device, _flex_any_length)(q, k, v, block_mask=mask)
    # Called inside the attention's forward, which recomputation checkpoints as a whole,
    # so that a recomputation runs the kernel (and draws the dropout) the forward did.
    with sdpa_kernel(backends, set_priority=True) if backends else contextlib.nullcontext():
        if isinstance(mask, Documents):
            return mask.attend(q, k, v, dropout_p)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


class BertSelfOutput(nn.Module):
    """Projection, dropout, residual and LayerNorm after attention (HF: attention.output)."""

    def __init__(self, cfg: ModelConfig, in_features: int):
        super().__init__()
        self.dense = nn.Linear(in_features, cfg.hidden_size)
        self.LayerNorm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dropout(self.dense(x)) + residual)


class BertAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self = BertSelfAttention(cfg)
        self.output = BertSelfOutput(cfg, cfg.hidden_size)

    def forward(self, x: torch.Tensor, mask: Mask) -> torch.Tensor:
        return self.output(self.self(x, mask), x)


class BertIntermediate(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(EncoderLayer):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention = BertAttention(cfg)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertSelfOutput(cfg, cfg.intermediate_size)  # HF: layer.N.output

    def forward(self, x: torch.Tensor, mask: Mask) -> torch.Tensor:
        x = self.attention(x, mask)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers))

    def forward(self, x: torch.Tensor, mask: Mask,
                all_hidden_states: list[torch.Tensor] | None = None) -> torch.Tensor:
        for layer in self.layer:
            if all_hidden_states is not None:
                all_hidden_states.append(x)
            x = layer(x, mask)
        if all_hidden_states is not None:
            all_hidden_states.append(x)
        return x


class BertPooler(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, cls_positions: torch.Tensor | None = None) -> torch.Tensor:
        if cls_positions is None:
            return torch.tanh(self.dense(x[:, 0]))  # (B, H) from the [CLS] position
        cls = torch.gather(x, 1, cls_positions.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        return torch.tanh(self.dense(cls))  # (B, S, H): each packed sequence's own [CLS]


class Documents:
    """Packed rows' attention inside documents alone, the CPU's way (FlexAttention skips blocks only on
    CUDA): a row of three documents of about T/3 computes a third of the row's T² and no (T × T) bias.
    A document is a run of one sequence id (padding included: padding sees padding, as
    :func:`attention_rule` has it), or a sequence's tokens gathered where they are not a run
    (Graphcore's BERT packing puts each [CLS] at the row's end).

    With ``group_by_length`` (:func:`grouped_documents`), documents of the same or a near length (of
    any row) are attended in one SDPA call, padded to the group's longest with its padding keys
    masked (:func:`length_groups`): one SDPA per text is many small kernels, each a parallel region
    whose threads must all meet, which a busy machine makes wait (issue 40). The Embedder's packed
    batches take it (tasks/retrieval/model.py: a row of 32 texts and more); packed pre-training rows
    keep one call per document, the layout whose memory parallel/plan.py plans. A group's queries,
    keys and values are gathered from the tokens (a document alone that is a run: views of its
    row) and its outputs put back, laid out (T, heads, head size) so that the attention module's
    reshape after is a view. ``window`` (ModernBERT's local layers): keys at most that far, by the
    tokens' row positions. The masks are made once per batch and shared by the layers."""

    group_by_length = False

    def __init__(self, sequence_ids: torch.Tensor, window: int | None, dtype: torch.dtype):
        B, T = sequence_ids.shape
        self.shape = (B, T)
        documents: list[torch.Tensor] = []  # each document's token positions in the flattened (B × T) rows
        for b, row in enumerate(sequence_ids.cpu().long()):  # (packed files keep them as uint8)
            order = row.argsort(stable=True)  # each sequence's tokens together, in row order
            documents += [b * T + positions for positions in order.split(row.bincount()[row.unique()].tolist())]
        device = sequence_ids.device
        # Per group: the gather of its (documents, longest) slots (or, for a document alone that is a run,
        # its (row, first token, length), attended as a view of the row), its real slots among them (None: all)
        # and its additive mask (None: none; the window's of a run is shared by the runs of its length).
        self.groups: list[tuple[torch.Tensor | tuple[int, int, int], torch.Tensor | None, torch.Tensor | None]] = []
        windows: dict[int, torch.Tensor | None] = {}
        slots = []  # each group's real slots, in the order of the groups' outputs
        # (scalars are read with tolist(), which is no dispatched .item(): tests/training/test_host_syncs.py
        # counts those per step)
        for group in length_groups([len(d) for d in documents], self.group_by_length):
            n = len(documents[group[0]])
            first, last = documents[group[0]][[0, -1]].tolist()
            if len(group) == 1 and last == first + n - 1:
                if n not in windows:
                    windows[n] = group_bias(torch.arange(n)[None], torch.ones(1, n, dtype=torch.bool), window,
                                            dtype, device)
                self.groups.append(((first // T, first % T, n), None, windows[n]))
                slots.append(documents[group[0]])
                continue
            index = torch.stack([F.pad(documents[i], (0, n - len(documents[i])), value=documents[i][:1].tolist()[0])
                                 for i in group])  # (documents, longest); padding slots repeat a token
            real = torch.arange(n)[None] < torch.tensor([len(documents[i]) for i in group])[:, None]
            keep = None if real.all().tolist() else real.flatten().nonzero().flatten().to(device)
            self.groups.append((index.to(device), keep, group_bias(index % T, real, window, dtype, device)))
            slots.append(index[real])
        order = torch.cat(slots)  # the token of each real slot, groups in turn
        in_order = torch.equal(order, torch.arange(B * T))
        self.scatter = None if in_order else order.argsort().to(device)  # each token's real slot

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
        """(B, heads, T, head size) queries, keys and values to the output of the same shape."""
        B, heads, T, size = q.shape
        flat: list[torch.Tensor] = []  # (B × T, heads, head size) of each, made for the first gather
        outputs = []  # (tokens, heads, head size) of each group
        for index, keep, bias in self.groups:
            if isinstance(index, tuple):  # a run: views of its row, as a row of its own
                b, first, n = index
                qg, kg, vg = (x[b:b + 1, :, first:first + n] for x in (q, k, v))
                out = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=bias, dropout_p=dropout_p)
                outputs.append(out.transpose(1, 2)[0])
                continue
            flat = flat or [x.transpose(1, 2).reshape(B * T, heads, size) for x in (q, k, v)]
            n, longest = index.shape
            qg, kg, vg = (x.index_select(0, index.flatten()).view(n, longest, heads, size).transpose(1, 2)
                          for x in flat)
            out = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=bias, dropout_p=dropout_p)
            out = out.transpose(1, 2).reshape(n * longest, heads, size)
            outputs.append(out if keep is None else out.index_select(0, keep))
        out = torch.cat(outputs) if len(outputs) > 1 else outputs[0].contiguous()
        if self.scatter is not None:
            out = out.index_select(0, self.scatter)
        return out.view(B, T, heads, size).transpose(1, 2)


@contextlib.contextmanager
def grouped_documents(on: bool = True) -> Iterator[None]:
    """Packed rows made in the block are attended in groups of near lengths (``on``) or one SDPA per
    document (:class:`Documents`)."""
    before = Documents.group_by_length
    Documents.group_by_length = on
    try:
        yield
    finally:
        Documents.group_by_length = before


def group_bias(positions: torch.Tensor, real: torch.Tensor, window: int | None, dtype: torch.dtype,
               device: torch.device) -> torch.Tensor | None:
    """The additive mask of a group of documents padded to one length: ``positions`` (documents,
    longest) their tokens' row positions, ``real`` which slots are tokens. Padding keys are masked;
    with ``window``, a real query's keys further than it too (a padding query, whose output no one
    reads, keeps the real keys: no row is all masked). None where nothing is."""
    if window is None:
        if real.all().tolist():
            return None
        masked = ~real[:, None, None, :]  # (documents, 1, 1, longest)
    else:
        far = (positions[:, :, None] - positions[:, None, :]).abs() > window
        masked = (~real[:, None, :] | (far & real[:, :, None]))[:, None]  # (documents, 1, longest, longest)
        if not masked.any().tolist():
            return None
    return torch.zeros(masked.shape, dtype=dtype).masked_fill_(masked, torch.finfo(dtype).min).to(device)


def length_groups(lengths: Sequence[int], group: bool = True, waste: float = 0.25,
                  small: int = 64) -> list[list[int]]:
    """The documents of ``lengths`` (their indices) in groups attended together, each longest first:
    longest documents first, a document joins the group before it while the group's padded score
    area (documents × longest²) stays within ``1 + waste`` of its real one, or while the group's
    longest is at most ``small`` tokens (where a call's overhead is more than its padding's cost).
    ``group=False``: one group per document, in order."""
    if not group:  # (in order: each row's runs back in place by the concatenation alone)
        return [[i] for i in range(len(lengths))]
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    area = 0
    for i in order:
        if groups:
            longest = lengths[groups[-1][0]]
            joined = area + lengths[i] ** 2
            if longest <= small or (len(groups[-1]) + 1) * longest ** 2 <= (1 + waste) * joined:
                groups[-1].append(i)
                area = joined
                continue
        groups.append([i])
        area = lengths[i] ** 2
    return groups


# What attention takes: an additive bias, a block mask, a packed row's documents, or none.
Mask = torch.Tensor | BlockMask | Documents | None


MaskRule = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def attention_rule(attention_mask: torch.Tensor | None, sequence_ids: torch.Tensor | None,
                   window: int | None = None) -> MaskRule | None:
    """Which keys a query may see, as a function of (row, head, query, key) indices; None: all.

    With ``sequence_ids`` (B, T) (packed rows; 0 = padding) a token sees the tokens of its own
    sequence (padding sees padding, so that no row is empty: SDPA's softmax of an all-masked row
    is NaN); else with ``attention_mask`` (B, T) (1 = token, 0 = padding) every token sees the
    real tokens of its row. With ``window`` also only keys at most ``window`` positions away
    (ModernBERT's local layers; positions inside a packed row's sequence are row positions less
    the sequence's start, so the distance is the same).
    """
    rules: list[MaskRule] = []
    if sequence_ids is not None:
        rules.append(lambda b, h, q, k: sequence_ids[b, q] == sequence_ids[b, k])
    elif attention_mask is not None:
        rules.append(lambda b, h, q, k: attention_mask[b, k] != 0)
    if window is not None:
        rules.append(lambda b, h, q, k: (q - k).abs() <= window)
    if not rules:
        return None
    return rules[0] if len(rules) == 1 else and_masks(*rules)


def block_mask(rule: MaskRule, rows: int | None, T: int, device: torch.device) -> BlockMask:
    """``rule`` as a FlexAttention block mask over (T × T), for ``rows`` rows (None: one for every row)."""
    return create_block_mask(rule, rows, None, T, T, device=device)


def dense_bias(rule: MaskRule, rows: int, T: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``rule`` as an additive bias for SDPA, evaluated by broadcasting: its shape is what the rule
    depends on ((B, 1, 1, T) for padding, (B, 1, T, T) for packed rows, (1, 1, T, T) for a window
    alone). Built once per batch and shared by every layer and head that takes it."""
    positions = torch.arange(T, device=device)
    b = torch.arange(rows, device=device)[:, None, None]  # (B, 1, 1)
    allowed = rule(b, torch.zeros((), dtype=torch.long, device=device), positions[None, :, None],
                   positions[None, None, :])  # (B or 1, T or 1, T)
    bias = torch.zeros(allowed.shape, dtype=dtype, device=device)
    bias.masked_fill_(~allowed, torch.finfo(dtype).min)
    return bias[:, None]


def document_block_mask(sequence_ids: torch.Tensor, window: int | None = None) -> BlockMask:
    """Packed rows' attention as a block mask (the rule of :func:`attention_rule`)."""
    B, T = sequence_ids.shape
    rule = attention_rule(None, sequence_ids, window)
    assert rule is not None  # (there are sequence ids)
    return block_mask(rule, B, T, sequence_ids.device)


def padding_block_mask(attention_mask: torch.Tensor, window: int | None = None) -> BlockMask:
    """Padded rows' attention as a block mask: every token sees the real tokens of its row."""
    B, T = attention_mask.shape
    rule = attention_rule(attention_mask, None, window)
    assert rule is not None  # (there is an attention mask)
    return block_mask(rule, B, T, attention_mask.device)


@functools.cache
def flex_kernel(device: torch.device, any_length: bool = False) -> Callable[..., torch.Tensor]:
    """FlexAttention as it runs on ``device``: compiled into a fused kernel on CUDA (also when the
    model is not compiled; inside a compiled model the two compiles are one), for the shapes it
    meets or (``any_length``) with symbolic shapes; on the CPU torch's reference implementation,
    which materialises the scores (and has no backward there)."""
    if device.type == "cuda":
        return torch.compile(flex_attention, dynamic=any_length)
    return flex_attention


# Rows of many lengths (retrieval's batches of texts packed into one row) take one FlexAttention kernel
# of symbolic length: a kernel per length would meet Dynamo's recompile limit over a corpus, after which
# torch runs FlexAttention unfused (the whole score matrix).
_flex_any_length = False


@contextlib.contextmanager
def flex_any_length():
    """FlexAttention's kernel compiled for any length (see :func:`flex_kernel`) for the calls inside."""
    global _flex_any_length
    before, _flex_any_length = _flex_any_length, True
    try:
        yield
    finally:
        _flex_any_length = before


def layers_mask(x: torch.Tensor, attention_mask: torch.Tensor | None, sequence_ids: torch.Tensor | None,
                cfg: ModelConfig, flex: bool, training: bool, window: int | None = None) -> Mask:
    """The mask every encoder layer of a model of ``cfg`` takes, built once per batch from the
    embeddings ``x`` and ``sequence_ids`` (packed rows) or ``attention_mask`` (padding), and a
    sliding ``window`` (keys at most that far from the query; ModernBERT's local layers): None
    where nothing is masked; with ``flex`` a FlexAttention block mask, where it changes nothing
    (FlexAttention has no dropout: with attention dropout a training forward takes the bias);
    else an additive bias in the dtype SDPA runs in (under autocast, the autocast dtype)."""
    flex = flex and not (training and cfg.attention_probs_dropout_prob > 0)
    B, T = x.shape[:2]
    if window is not None and window >= T - 1:  # the window holds the whole row
        window = None
    rule = attention_rule(attention_mask, sequence_ids, window)
    if rule is None:
        return None
    rows = B if sequence_ids is not None or attention_mask is not None else None  # a window alone: one for all
    if flex:
        return block_mask(rule, rows, T, x.device)
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    if sequence_ids is not None and x.device.type == "cpu":
        return Documents(sequence_ids, window, dtype)
    return dense_bias(rule, rows or 1, T, dtype, x.device)


class BertModel(nn.Module):
    """The encoder: token ids in, hidden states (and pooled [CLS]) out."""

    def __init__(self, cfg: ModelConfig, add_pooler: bool = True):
        super().__init__()
        if cfg.family != "bert":  # (pre-training builds ModernBERT: families.build_pretraining_model)
            raise ConfigError(f"model.family={cfg.family}: only bertforge pretrain builds this family so far; "
                              f"this command builds BERT models")
        self.config = cfg
        self.flex = False  # masks as FlexAttention block masks (see set_attention_backends)
        self.embeddings = BertEmbeddings(cfg)
        self.encoder = BertEncoder(cfg)
        self.pooler = BertPooler(cfg) if add_pooler else None
        init_weights(self, cfg.initializer_range)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None,
                all_hidden_states: list[torch.Tensor] | None = None, *,
                position_ids: torch.Tensor | None = None, sequence_ids: torch.Tensor | None = None,
                cls_positions: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``sequence_ids`` (packed rows, replacing ``attention_mask``), ``position_ids`` and
        ``cls_positions``: see the module docstring; the pooled output is then (B, S, H)."""
        B, T = input_ids.shape
        if position_ids is None and T > self.config.max_position_embeddings:  # (a packed row's positions restart)
            raise ValueError(f"sequence length {T} exceeds "
                             f"max_position_embeddings={self.config.max_position_embeddings}")
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = self.embeddings(input_ids, token_type_ids, position_ids)
        mask = layers_mask(x, attention_mask, sequence_ids, self.config, self.flex, self.training)
        x = self.encoder(x, mask, all_hidden_states)
        pooled = self.pooler(x, cls_positions) if self.pooler is not None else None
        return x, pooled  # (B, T, H), (B, H)


class BertPredictionHeadTransform(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.LayerNorm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.act(self.dense(x)))


class BertLMPredictionHead(nn.Module):
    """Transform, then project onto the vocab with the (tied) word embeddings.

    With ``vocab_multiple`` > 1 (see set_vocab_multiple), under autocast, the
    projection runs on the vocab padded with zero rows to a multiple of it
    (30522 → 30528 for 64), whose matmul the GPU's tensor cores take without a
    ragged edge; the extra logits are cut off, so the output, the loss and the
    gradients are those of the true vocab. The weights keep their size.
    """

    def __init__(self, cfg: ModelConfig, word_embeddings: nn.Embedding):
        super().__init__()
        self.transform = BertPredictionHeadTransform(cfg)
        self.word_embeddings = [word_embeddings]  # a list, so the tied weight is not registered twice
        self.bias = nn.Parameter(torch.zeros(cfg.vocab_size))
        self.vocab_multiple = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight: torch.Tensor = self.word_embeddings[0].weight
        bias: torch.Tensor = self.bias
        vocab_size = bias.shape[0]
        # Only under autocast, which copies the weight anyway; in fp32 the padded copy would be
        # one more (V × H) tensor kept for the backward.
        extra = -vocab_size % self.vocab_multiple if torch.is_autocast_enabled(x.device.type) else 0
        if extra:
            weight, bias = F.pad(weight, (0, 0, 0, extra)), F.pad(bias, (0, extra))
        logits = F.linear(self.transform(x), weight, bias)
        return logits[..., :vocab_size] if extra else logits


class BertPreTrainingHeads(nn.Module):
    def __init__(self, cfg: ModelConfig, word_embeddings: nn.Embedding, next_sentence: bool = True):
        super().__init__()
        self.predictions = BertLMPredictionHead(cfg, word_embeddings)
        self.seq_relationship = nn.Linear(cfg.hidden_size, 2) if next_sentence else None


def init_weights(model: nn.Module, std: float) -> None:
    """BERT initialisation: normal(0, std) weights, zero biases, unit LayerNorm."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, nn.Embedding) and module.padding_idx is not None:
                nn.init.zeros_(module.weight[module.padding_idx])
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)


class BertForPreTraining(nn.Module):
    """Masked LM + next-sentence prediction.

    With ``masked_lm_positions`` (B, P) only those positions are gathered and
    projected onto the vocab: (B, P, V) logits instead of (B, T, V). With 20 of
    128 positions masked this skips ~84% of the largest matmul of the model.
    Packed rows (``sequence_ids`` …, see the module docstring) give (B, S, 2)
    NSP logits, one pair per sequence slot.
    """

    next_sentence = True  # False: no pooler, no NSP head (BertForMaskedLM)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.bert = BertModel(cfg, add_pooler=self.next_sentence)
        self.cls = BertPreTrainingHeads(cfg, self.bert.embeddings.word_embeddings, self.next_sentence)
        init_weights(self.cls, cfg.initializer_range)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None,
                masked_lm_positions: torch.Tensor | None = None, *,
                position_ids: torch.Tensor | None = None, sequence_ids: torch.Tensor | None = None,
                cls_positions: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        x, pooled = self.bert(input_ids, token_type_ids, attention_mask, position_ids=position_ids,
                              sequence_ids=sequence_ids, cls_positions=cls_positions)
        if masked_lm_positions is not None:
            H = x.shape[-1]
            x = torch.gather(x, 1, masked_lm_positions.unsqueeze(-1).expand(-1, -1, H))  # (B, P, H)
        mlm_logits = self.cls.predictions(x)  # (B, P, V), or (B, T, V) without positions
        if self.cls.seq_relationship is None:
            return mlm_logits, None
        nsp_logits = self.cls.seq_relationship(pooled)  # (B, 2), packed (B, S, 2)
        return mlm_logits, nsp_logits


class BertForMaskedLM(BertForPreTraining):
    """Masked LM alone (``train.objective: mlm``, RoBERTa's recipe): no pooler, no NSP head.

    The layers and names of Hugging Face's ``BertForMaskedLM``; ``forward`` gives
    ``(mlm_logits, None)``.
    """

    next_sentence = False


class BertForQuestionAnswering(nn.Module):
    """SQuAD span head: a start and an end logit per token."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.bert = BertModel(cfg, add_pooler=False)
        self.qa_outputs = nn.Linear(cfg.hidden_size, 2)
        init_weights(self.qa_outputs, cfg.initializer_range)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        x, _ = self.bert(input_ids, token_type_ids, attention_mask)
        start, end = self.qa_outputs(x).unbind(-1)
        return start, end  # (B, T) each



class _Classifier(nn.Module):
    """Dropout and a linear layer (``classifier``, (num_labels, H)) on the pooled [CLS] or on every token."""

    pooled = True

    def __init__(self, cfg: ModelConfig, num_labels: int):
        super().__init__()
        if num_labels < 1:
            raise ValueError(f"num_labels must be at least 1, got {num_labels}")
        self.config = cfg
        self.num_labels = num_labels
        self.bert = BertModel(cfg, add_pooler=self.pooled)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)
        self.classifier = nn.Linear(cfg.hidden_size, num_labels)
        init_weights(self.classifier, cfg.initializer_range)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        tokens, pooled = self.bert(input_ids, token_type_ids, attention_mask)
        if self.pooled:
            assert pooled is not None  # built with a pooler
            return self.classifier(self.dropout(pooled))  # (B, num_labels)
        return self.classifier(self.dropout(tokens))  # (B, T, num_labels)


class BertForSequenceClassification(_Classifier):
    """GLUE head: dropout and a linear layer on the pooled [CLS]; ``num_labels=1`` is regression (STS-B).

    The same layers and names as Hugging Face's ``BertForSequenceClassification``
    (``classifier.weight`` is (num_labels, H)) and google-research/bert's
    run_classifier.py (dropout 0.1 on the pooled output before ``output_weights``).
    """

    pooled = True


class BertForTokenClassification(_Classifier):
    """NER head: dropout and a linear layer on every token (Hugging Face's ``BertForTokenClassification``)."""

    pooled = False


def pretraining_loss(mlm_logits: torch.Tensor, nsp_logits: torch.Tensor | None,
                     batch: dict[str, torch.Tensor], accuracy: bool = True) -> dict[str, torch.Tensor]:
    """MLM cross-entropy averaged over real (weight 1) predictions, plus NSP cross-entropy
    averaged over real sequences.

    A packed batch's ``next_sentence_weights`` (B, S) marks the real sequences
    among the slots of the (B, S, 2) NSP logits; so a packed batch gives the
    losses of the same sequences unpacked. With ``accuracy`` (evaluation) also
    the counts of correct predictions (``mlm_correct``, ``nsp_correct``), for
    accuracy without a second pass; training leaves them out, and with them an
    argmax over the (B, P, V) logits. Without NSP logits (a masked-LM-only
    model) the loss is the MLM loss, ``nsp_loss`` and ``nsp_correct`` are 0 and
    ``nsp_count`` still counts the sequences.
    """
    weights = batch["masked_lm_weights"].float()  # (B, P); 0 marks padding predictions
    token_loss = F.cross_entropy(mlm_logits.float().flatten(0, 1), batch["masked_lm_ids"].flatten(),
                                 reduction="none")
    n_pred = weights.sum()
    mlm_loss = (token_loss * weights.flatten()).sum() / n_pred.clamp(min=1.0)
    nsp_labels = batch["next_sentence_labels"].flatten()
    # Packed rows: (B, S, 2) logits, of which only the real sequences count; else one per row.
    # (A fill on the device, not a tensor from a Python number: no host-to-device copy per micro-batch.)
    nsp_weights = (batch["next_sentence_weights"].flatten().float() if "next_sentence_weights" in batch
                   else torch.ones(nsp_labels.shape, device=mlm_logits.device))
    nsp_count = nsp_weights.sum()
    if nsp_logits is None:
        nsp_loss = torch.zeros((), device=mlm_logits.device)
    else:
        nsp_logits = nsp_logits.flatten(0, -2)
        nsp_loss = ((F.cross_entropy(nsp_logits.float(), nsp_labels, reduction="none") * nsp_weights).sum()
                    / nsp_count.clamp(min=1.0))
    out = {"loss": mlm_loss + nsp_loss, "mlm_loss": mlm_loss, "nsp_loss": nsp_loss,
           "mlm_count": n_pred, "nsp_count": nsp_count}
    if accuracy:
        with torch.no_grad():
            out["mlm_correct"] = ((mlm_logits.argmax(-1) == batch["masked_lm_ids"]).float() * weights).sum()
            out["nsp_correct"] = (torch.zeros((), device=mlm_logits.device) if nsp_logits is None
                                  else ((nsp_logits.argmax(-1) == nsp_labels).float() * nsp_weights).sum())
    return out


def eval_sums(out: dict[str, torch.Tensor]) -> list[float]:
    """One batch's ``pretraining_loss`` as sums to add up over an eval set: correct and counted
    predictions and sequences, and the losses weighted back by their counts (they are means)."""
    return [out["mlm_correct"].item(), out["mlm_count"].item(), out["nsp_correct"].item(),
            out["nsp_count"].item(), out["mlm_loss"].item() * out["mlm_count"].item(),
            out["nsp_loss"].item() * out["nsp_count"].item()]


def eval_result(sums: Sequence[float], next_sentence: bool = True) -> dict[str, float]:
    """Accuracies and mean losses from the added-up :func:`eval_sums` (NSP's only with its head)."""
    mlm_correct, mlm_count, nsp_correct, nsp_count, mlm_loss, nsp_loss = sums
    predictions, sequences = max(mlm_count, 1.0), max(nsp_count, 1.0)
    result = {"mlm_accuracy": mlm_correct / predictions, "nsp_accuracy": nsp_correct / sequences,
              "mlm_loss": mlm_loss / predictions, "nsp_loss": nsp_loss / sequences,
              "loss": mlm_loss / predictions + nsp_loss / sequences, "sequences": int(sequences),
              # real (weight 1) masked-LM predictions: the accuracy's denominator
              "predictions": int(mlm_count)}
    if not next_sentence:
        del result["nsp_accuracy"], result["nsp_loss"]
    return result


@functools.cache
def compiled_pretraining_loss(accuracy: bool = True) -> Callable[..., dict[str, torch.Tensor]]:
    """``pretraining_loss`` under torch.compile (made once per ``accuracy``, compiled at its first call)."""
    return torch.compile(functools.partial(pretraining_loss, accuracy=accuracy), dynamic=False)


def set_vocab_multiple(model: nn.Module, multiple: int) -> None:
    """Pad the masked-LM projection's vocab to a multiple of ``multiple`` (1 = none) while it runs."""
    if multiple < 1:
        raise ValueError(f"vocab multiple must be at least 1, got {multiple}")
    for module in model.modules():
        if isinstance(module, BertLMPredictionHead):
            module.vocab_multiple = multiple


ATTENTION_BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH,
}
FLEX = "flex"  # FlexAttention with block masks, for padded and packed batches


def set_attention_backends(model: nn.Module, names: list[str] | None) -> None:
    """The attention kernels ``model`` may use, most preferred first: ``flex`` (for batches with a
    mask; see :func:`attention_mask_of`) and the SDPA kernels of ``ATTENTION_BACKENDS``, of which
    each call takes the first that supports its inputs. None leaves torch's choice, without flex."""
    names = names or []
    sdpa = [ATTENTION_BACKENDS[name] for name in names if name != FLEX] or None
    for module in model.modules():
        if hasattr(module, "backends"):  # BertSelfAttention, ModernBertAttention
            module.backends = sdpa  # type: ignore[assignment]  # (as flex below)
        if hasattr(module, "flex"):  # BertModel, ModernBertModel, a pipeline stage
            module.flex = FLEX in names  # type: ignore[assignment]  # (mypy reads it as a submodule)


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
