"""TensorFlow 2 object-based checkpoints of BERT, read and written without TensorFlow.

MLPerf training's BERT (https://github.com/mlcommons/training,
``language_model/tensorflow/bert/README.md``) ships, beside the TF1
``tf1_ckpt/model.ckpt-28252``, a ``tf2_ckpt/model.ckpt-28252`` and names the
tool that makes one from the other: TensorFlow Model Garden's
``official/nlp/bert/tf2_encoder_checkpoint_converter.py`` (now
``official/nlp/tools/tf2_bert_encoder_checkpoint_converter.py`` in
https://github.com/tensorflow/models). That converter loads the TF1 weights
into Model Garden's Keras ``networks.BertEncoder`` (a functional
``tf_keras.Model``) and saves ``tf.train.Checkpoint(encoder=model)``; with
``--converted_model=pretrainer`` the model is ``models.BertPretrainerV2``
(the encoder plus the masked-LM head, no NSP head) saved as
``tf.train.Checkpoint(encoder=pretrainer, masked_lm=pretrainer.masked_lm)``.
MLPerf's file is most likely the second kind: its 1,344,982,997 bytes are
BERT-large's encoder and masked-LM head in float32 (1,344,896,240 with
``save_counter``) and some 87 KB, about the size of such a model's object
graph; the encoder alone would leave 4.4 MB unexplained. Both are read and
written here, with the names the converter of tf-models 2.19 writes with
TensorFlow 2.21 (``tests/fixtures/tf2/make_fixtures.py`` runs it on
``tests/fixtures/tf1``), which are Keras' names for these models' objects:

* the encoder, ``E`` = ``encoder`` (layout ``encoder``) or
  ``encoder/encoder_network`` (layout ``pretrainer``): Keras numbers the layers
  that have weights, ``E/layer_with_weights-0/embeddings`` (word),
  ``-1/embeddings`` (position), ``-2/embeddings`` (token type), ``-3/gamma|beta``
  (the embeddings' LayerNorm), ``-{4+i}/…`` transformer layer i, ``-{4+L}/kernel|bias``
  the pooler (``pooler_transform``);
* in a transformer layer: ``_attention_layer/_query_dense|_key_dense|_value_dense``
  (kernel [hidden, heads, head size], bias [heads, head size]),
  ``_attention_layer/_output_dense`` (kernel [heads, head size, hidden]),
  ``_attention_layer_norm``, ``_intermediate_dense``, ``_output_dense``,
  ``_output_layer_norm``;
* the masked-LM head ``masked_lm/dense``, ``masked_lm/layer_norm``,
  ``masked_lm/output_bias/bias`` and ``masked_lm/embedding_table`` (the word
  embeddings again: one variable, reached by two paths).

Every variable is stored under ``<path>/.ATTRIBUTES/VARIABLE_VALUE``, the path
being the first one a breadth-first walk from the root finds (so the word
embeddings of a pretrainer are ``masked_lm/embedding_table/…``), each step's
name escaped (``.`` → ``..``, ``/`` → ``.S``). The bundle (:mod:`bertforge.formats.tf1`'s
format) also holds ``_CHECKPOINTABLE_OBJECT_GRAPH``, a DT_STRING scalar: the
serialized ``TrackableObjectGraph`` (nodes, each with named children and its
variables' checkpoint keys), which ``tf.train.Checkpoint.restore`` walks.
Reading follows that graph, so a variable is found by its object path whatever
key it was stored under; writing builds the graph of the reference model's
objects that hold variables (and ``save_counter``): TensorFlow restores it into
the real model with ``assert_existing_objects_matched()`` and ``assert_consumed()``
(``tests/formats/test_tf2.py``), and ``tf.train.load_checkpoint`` lists its names.

Model Garden's BERT ``gelu`` is the tanh approximation: our ``gelu_new``, as for
TF1. The reference TF2 models have no NSP head (and the encoder layout no
masked-LM head either): :func:`import_tf2` initialises what is missing afresh and
says so, and :func:`export_tf2` leaves the NSP head out, saying so.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import struct
from pathlib import Path

import torch

from bertforge.config import ModelConfig
from bertforge.fileio import fsync
from bertforge.models.bert import BertForPreTraining, BertModel
from bertforge.runs import CheckpointError

from . import tf1
from .bert_tf1 import find_bert_config, model_config_from_bert_config, tf_exportable, write_tf_directory
from .weights import ConversionError, assign_weights, check_export_target, write_model_dir

logger = logging.getLogger(__name__)

OBJECT_GRAPH = "_CHECKPOINTABLE_OBJECT_GRAPH"
ATTRIBUTES = ".ATTRIBUTES"
VARIABLE_VALUE = "VARIABLE_VALUE"
SAVE_COUNTER = "save_counter"
DT_STRING = 7  # tensorflow/core/framework/types.proto
LAYOUTS = ("pretrainer", "encoder")
TF2_PREFIX = "model.ckpt"  # what export_tf2 writes: OUT/model.ckpt.index, OUT/model.ckpt.data-00000-of-00001
# Where the encoder and the masked-LM head are, from the root, in each layout.
ENCODER_PATHS = {"encoder": ("encoder",), "pretrainer": ("encoder", "encoder_network")}
MASKED_LM_PATH = ("masked_lm",)


# ------------------------------------------------------------ the name map

@dataclasses.dataclass(frozen=True)
class Variable:
    """Where one of our weights is in the reference model and how its tensor differs from ours."""

    path: tuple[str, ...]  # object path from the root (local names, unescaped)
    kind: str  # "same", "kernel" ([in, out]), "heads_kernel", "heads_bias", "heads_output_kernel"
    full_name: str  # the Keras variable's name (the object graph records it)


def tf2_names(num_layers: int, layout: str) -> dict[str, Variable]:
    """Our parameter name -> its variable in the reference TF2 model (``layout``: see the module docstring)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    encoder = ENCODER_PATHS[layout]
    names: dict[str, Variable] = {}

    def layer(index: int) -> tuple[str, ...]:
        return (*encoder, f"layer_with_weights-{index}")

    def dense(ours: str, path: tuple[str, ...], theirs: str, kernel: str = "kernel", bias: str = "same") -> None:
        names[f"{ours}.weight"] = Variable((*path, "kernel"), kernel, f"{theirs}/kernel")
        names[f"{ours}.bias"] = Variable((*path, "bias"), bias, f"{theirs}/bias")

    def layer_norm(ours: str, path: tuple[str, ...], theirs: str) -> None:
        names[f"{ours}.weight"] = Variable((*path, "gamma"), "same", f"{theirs}/gamma")
        names[f"{ours}.bias"] = Variable((*path, "beta"), "same", f"{theirs}/beta")

    tables = (("word_embeddings", "word_embeddings"), ("position_embeddings", "position_embedding"),
              ("token_type_embeddings", "type_embeddings"))
    for index, (ours, theirs) in enumerate(tables):
        names[f"bert.embeddings.{ours}.weight"] = Variable((*layer(index), "embeddings"), "same",
                                                           f"{theirs}/embeddings")
    layer_norm("bert.embeddings.LayerNorm", layer(3), "embeddings/layer_norm")
    for i in range(num_layers):
        ours, path, theirs = f"bert.encoder.layer.{i}", layer(4 + i), f"transformer/layer_{i}"
        attention = (*path, "_attention_layer")
        for projection in ("query", "key", "value"):
            dense(f"{ours}.attention.self.{projection}", (*attention, f"_{projection}_dense"),
                  f"{theirs}/self_attention/{projection}", "heads_kernel", "heads_bias")
        dense(f"{ours}.attention.output.dense", (*attention, "_output_dense"),
              f"{theirs}/self_attention/attention_output", "heads_output_kernel")
        layer_norm(f"{ours}.attention.output.LayerNorm", (*path, "_attention_layer_norm"),
                   f"{theirs}/self_attention_layer_norm")
        dense(f"{ours}.intermediate.dense", (*path, "_intermediate_dense"), f"{theirs}/intermediate")
        dense(f"{ours}.output.dense", (*path, "_output_dense"), f"{theirs}/output")
        layer_norm(f"{ours}.output.LayerNorm", (*path, "_output_layer_norm"), f"{theirs}/output_layer_norm")
    dense("bert.pooler.dense", layer(4 + num_layers), "pooler_transform")
    if layout == "pretrainer":
        head = "bert/cls/predictions"
        dense("cls.predictions.transform.dense", (*MASKED_LM_PATH, "dense"), f"{head}/transform/dense")
        layer_norm("cls.predictions.transform.LayerNorm", (*MASKED_LM_PATH, "layer_norm"),
                   f"{head}/transform/LayerNorm")
        names["cls.predictions.bias"] = Variable((*MASKED_LM_PATH, "output_bias/bias"), "same",
                                                 f"{head}/output_bias/bias")
    return names


def to_tf(tensor: torch.Tensor, kind: str, heads: int) -> torch.Tensor:
    """Our tensor as the reference model holds it."""
    if kind == "same":
        return tensor
    if kind == "heads_bias":  # [hidden] -> [heads, head size]
        return tensor.reshape(heads, -1)
    kernel = tensor.t()  # nn.Linear's [out, in] -> Keras' [in, out]
    if kind == "heads_kernel":  # [hidden, heads, head size]
        return kernel.reshape(kernel.shape[0], heads, -1)
    if kind == "heads_output_kernel":  # [heads, head size, hidden]
        return kernel.reshape(heads, -1, kernel.shape[1])
    return kernel


def to_ours(tensor: torch.Tensor, kind: str) -> torch.Tensor:
    """The reference model's tensor in our layout (the inverse of :func:`to_tf`)."""
    if kind == "same":
        return tensor
    if kind == "heads_bias":
        return tensor.reshape(-1)
    if kind == "heads_kernel":
        tensor = tensor.reshape(tensor.shape[0], -1)
    elif kind == "heads_output_kernel":
        tensor = tensor.reshape(-1, tensor.shape[-1])
    return tensor.t()


def _tf_shape(shape: tuple[int, ...], kind: str, heads: int) -> tuple[int, ...]:
    return tuple(to_tf(torch.empty(shape, device="meta"), kind, heads).shape)


def _shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = BertForPreTraining(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


# ------------------------------------------------------------ the object graph

def escape(name: str) -> str:
    """A local name as a step of a checkpoint key (TensorFlow's escape_local_name)."""
    return name.replace(".", "..").replace("/", ".S")


def value_key(path: tuple[str, ...]) -> str:
    """The checkpoint key of the variable at object path ``path``."""
    return "/".join([*(escape(step) for step in path), ATTRIBUTES, escape(VARIABLE_VALUE)])


@dataclasses.dataclass
class Node:
    """A ``TrackableObjectGraph.TrackableObject``: its named children (in order) and, for a
    variable, its ``VARIABLE_VALUE`` attribute's full name and checkpoint key."""

    children: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    attributes: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)  # name, full_name, key

    def child(self, name: str) -> int | None:
        return next((node for local, node in self.children if local == name), None)

    def value_key(self) -> str | None:
        return next((key for name, _, key in self.attributes if name == VARIABLE_VALUE), None)


def parse_object_graph(data: bytes) -> list[Node]:
    """The nodes of a serialized ``TrackableObjectGraph`` (node 0 is the root); other fields
    (optimizer slot references, registered savers) are not needed and are passed over."""
    nodes = []
    for number, value in tf1._fields(data):
        if number != 1 or not isinstance(value, bytes):
            continue
        node = Node()
        for field, item in tf1._fields(value):
            if field == 1 and isinstance(item, bytes):  # ObjectReference {int32 node_id = 1; string local_name = 2}
                ref = dict(tf1._fields(item))
                target, local = ref.get(1, 0), ref.get(2, b"")
                if not isinstance(target, int) or not isinstance(local, bytes):
                    raise ValueError("a malformed child reference")
                node.children.append((local.decode("utf-8"), target))
            elif field == 2 and isinstance(item, bytes):  # SerializedTensor {name; full_name; checkpoint_key}
                tensor = dict(tf1._fields(item))
                texts = [t.decode("utf-8") for t in (tensor.get(i, b"") for i in (1, 2, 3)) if isinstance(t, bytes)]
                if len(texts) != 3:
                    raise ValueError("a malformed attribute")
                node.attributes.append((texts[0], texts[1], texts[2]))
        nodes.append(node)
    for node in nodes:
        for name, child in node.children:
            if not 0 <= child < len(nodes):
                raise ValueError(f"child {name!r} refers to node {child} of {len(nodes)}")
    if not nodes:
        raise ValueError("no nodes")
    return nodes


def serialize_object_graph(nodes: list[Node]) -> bytes:
    """A ``TrackableObjectGraph`` of ``nodes``; every node is marked as having checkpoint values."""
    def message(number: int, body: bytes) -> bytes:
        return tf1._put_varint(number << 3 | 2) + tf1._length(body)

    def text(number: int, value: str) -> bytes:
        return message(number, value.encode("utf-8")) if value else b""

    out = bytearray()
    for node in nodes:
        body = bytearray()
        for local, node_id in node.children:
            ref = (b"\x08" + tf1._put_varint(node_id) if node_id else b"") + text(2, local)
            body += message(1, ref)
        for name, full_name, key in node.attributes:
            body += message(2, text(1, name) + text(2, full_name) + text(3, key))
        body += message(5, b"\x08\x01")  # has_checkpoint_values: BoolValue {value: true}
        out += message(1, bytes(body))
    return bytes(out)


def resolve(nodes: list[Node], path: tuple[str, ...], start: int = 0) -> int | None:
    """The node at ``path`` (local names) from node ``start``, or None."""
    node: int | None = start
    for step in path:
        if node is None:
            return None
        node = nodes[node].child(step)
    return node


# ------------------------------------------------------------ DT_STRING tensors in a bundle

def _length_bytes(length: int) -> bytes:
    """A string's length as the bundle's checksums see it: uint32 (uint64 past 4 GiB), little-endian."""
    return struct.pack("<I" if length <= 0xFFFFFFFF else "<Q", length)


def string_bytes(value: bytes) -> tuple[bytes, int]:
    """A scalar string tensor as a bundle stores it, and its entry's masked crc32c.

    Stored: the length (varint), the masked crc32c of the length, then the bytes.
    The checksums take the length as a fixed-width integer, not its varint
    (TensorFlow's WriteStringTensor); the entry's covers that, the length
    checksum and the bytes.
    """
    length = _length_bytes(len(value))
    checksum = struct.pack("<I", tf1.masked_crc32c(length))
    return tf1._put_varint(len(value)) + checksum + value, tf1.masked_crc32c(length + checksum + value)


def read_string(reader: tf1.BundleReader, name: str) -> bytes:
    """The scalar DT_STRING tensor ``name`` of a bundle, both of its checksums verified."""
    entry = reader.entries[name]
    source = tf1.index_file(reader.prefix)
    if entry.dtype != DT_STRING or entry.shape != () or entry.sliced:
        raise CheckpointError(f"{source}: {name} is not a scalar string (dtype "
                              f"{tf1.DTYPE_NAMES.get(entry.dtype, entry.dtype)}, shape {list(entry.shape)})")
    shard, raw = reader.shard(name), reader.read_bytes(name)
    try:
        length, pos = tf1._varint(raw, 0)
    except (IndexError, ValueError):
        raise CheckpointError(f"{shard}: {name} is not a string tensor (damaged?)") from None
    value = raw[pos + 4:]
    if len(value) != length or string_bytes(value) != (raw, entry.crc32c):
        raise CheckpointError(f"{shard}: {name} fails its crc32c (damaged or edited)")
    return value


def write_bundle(prefix: Path | str, tensors: dict[str, torch.Tensor | bytes]) -> None:
    """:func:`bertforge.formats.tf1.write_bundle` with scalar strings too (``bytes`` values): one shard
    holding the tensors in the order given, the index in key order, as TensorFlow's BundleWriter
    writes them (``tf.train.Checkpoint`` adds the variables in its object graph's order, then the
    graph)."""
    prefix = Path(prefix)
    entries: list[tuple[bytes, bytes]] = [(b"", tf1.HEADER)]
    offset = 0
    with open(tf1.data_file(prefix, 0, 1), "wb") as f:
        for name, value in tensors.items():
            shape: tuple[int, ...] = ()
            if isinstance(value, bytes):
                (raw, crc), dtype = string_bytes(value), DT_STRING
            else:
                tensor = value.detach().cpu().contiguous()
                if tensor.dtype not in tf1.TF_DTYPES:
                    raise CheckpointError(f"{name}: dtype {tensor.dtype} has no TensorFlow checkpoint equivalent")
                raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
                dtype, shape, crc = tf1.TF_DTYPES[tensor.dtype], tuple(tensor.shape), tf1.masked_crc32c(raw)
            f.write(raw)
            entry = tf1.Entry(dtype, shape, 0, offset, len(raw), crc)
            entries.append((name.encode("utf-8"), entry.serialize()))
            offset += len(raw)
    entries.sort(key=lambda entry: entry[0])
    tf1.index_file(prefix).write_bytes(tf1.build_table(entries))
    fsync(tf1.data_file(prefix, 0, 1))
    fsync(tf1.index_file(prefix))


# ------------------------------------------------------------ reading

def is_tf2(prefix: Path | str) -> bool:
    """Whether the checkpoint at ``prefix`` is object-based (has an object graph)."""
    try:
        return OBJECT_GRAPH in tf1.BundleReader(prefix).entries
    except CheckpointError:
        return False


def _find_layout(nodes: list[Node], source: Path) -> tuple[str, int, int | None]:
    """(layout, encoder node, masked-LM node or None) of an object graph."""
    top = nodes[0].child("encoder")
    if top is None:
        top = nodes[0].child("model")
    if top is None:
        names = ", ".join(local for local, _ in nodes[0].children) or "none"
        raise CheckpointError(f"{source}: the object graph has no 'encoder' (its root's children: {names}); "
                              f"not a checkpoint of Model Garden's BertEncoder or BertPretrainerV2")
    network = nodes[top].child("encoder_network")
    masked_lm = nodes[0].child("masked_lm")
    if network is not None:  # a BertPretrainerV2
        if masked_lm is None:
            masked_lm = nodes[top].child("masked_lm")
        return ("pretrainer" if masked_lm is not None else "encoder"), network, masked_lm
    return ("pretrainer" if masked_lm is not None else "encoder"), top, masked_lm


def read_tf2(prefix: Path | str, bert_config: Path | str | None = None,
             ) -> tuple[ModelConfig, dict[str, torch.Tensor], list[str]]:
    """(model shape, weights in our names as float32, the variables skipped) of a TF2 checkpoint.

    The weights are found through the object graph: the encoder's (and, in a
    pretrainer checkpoint, the masked-LM head's) variables must all be there,
    with the shapes ``bert_config.json`` (default: beside the checkpoint or one
    directory up, as MLPerf keeps ``tf2_ckpt/``) gives; the first missing one is
    named by its object path. ``save_counter``, optimizer state and other
    objects' variables are skipped and named in a log line. ``prefix`` may
    also be a directory whose ``checkpoint`` file names one.
    """
    prefix = tf1.find_prefix(prefix) or Path(prefix)
    source = tf1.index_file(prefix)
    reader = tf1.BundleReader(prefix)
    if OBJECT_GRAPH not in reader.entries:
        if any(name.startswith(("bert/", "cls/")) for name in reader.entries):
            raise CheckpointError(f"{source}: a TensorFlow 1 name-based checkpoint (no {OBJECT_GRAPH}), "
                                  f"not a TF2 one; import it with `bertforge import tf1`")
        raise CheckpointError(f"{source}: no {OBJECT_GRAPH}: not a TensorFlow 2 object-based checkpoint")
    config_file = find_bert_config(prefix, bert_config)
    cfg = model_config_from_bert_config(config_file)
    try:
        nodes = parse_object_graph(read_string(reader, OBJECT_GRAPH))
    except (ValueError, IndexError, struct.error, UnicodeDecodeError) as err:
        raise CheckpointError(f"{source}: its {OBJECT_GRAPH} is not a readable object graph ({err})") from None
    layout, encoder, masked_lm = _find_layout(nodes, source)
    prefix_path = ENCODER_PATHS[layout]
    weighted = sum(1 for local, _ in nodes[encoder].children if local.startswith("layer_with_weights-"))
    if weighted - 5 != cfg.num_hidden_layers:  # 3 embeddings, their LayerNorm, the layers, the pooler
        raise CheckpointError(f"{source}: the encoder has {weighted - 5} transformer layers but {config_file} "
                              f"asks for num_hidden_layers={cfg.num_hidden_layers}")
    shapes = _shapes(cfg)
    state: dict[str, torch.Tensor] = {}
    used = {OBJECT_GRAPH}
    for ours, var in tf2_names(cfg.num_hidden_layers, layout).items():
        base, path = (masked_lm, var.path[1:]) if var.path[:1] == MASKED_LM_PATH else \
            (encoder, var.path[len(prefix_path):])
        node = resolve(nodes, path, base) if base is not None else None
        key = nodes[node].value_key() if node is not None else None
        if key is None or key not in reader.entries:
            raise CheckpointError(f"{source}: variable {'/'.join(map(escape, var.path))} is missing")
        want = _tf_shape(shapes[ours], var.kind, cfg.num_attention_heads)
        entry = reader.entries[key]
        if entry.shape != want:
            raise CheckpointError(f"{source}: variable {key} has shape {list(entry.shape)} but {config_file} "
                                  f"asks for {list(want)}")
        tensor = reader.read(key)
        if not tensor.is_floating_point():
            raise CheckpointError(f"{source}: variable {key} is {tensor.dtype}, not floating point")
        state[ours] = to_ours(tensor.float(), var.kind).contiguous()
        used.add(key)
    skipped = sorted(set(reader.entries) - used)
    if skipped:
        logger.info("%s: skipped %d variables that are not weights of this model: %s", prefix, len(skipped),
                    ", ".join(skipped[:10]) + (", …" if len(skipped) > 10 else ""))
    return cfg, state, skipped


def import_tf2(prefix: Path | str, out_dir: Path | str, bert_config: Path | str | None = None,
               vocab_path: Path | str | None = None, overwrite: bool = False,
               ) -> tuple[Path, list[str], list[str]]:
    """Write a TF2 checkpoint as our model directory (``model.safetensors``, ``config.yaml``,
    ``vocab.txt`` when there is one beside the checkpoint or one directory up, ``manifest.json``);
    returns it, the variables skipped and our weights newly initialised.

    The directory holds a whole ``BertForPreTraining``: the heads the reference
    model lacks (always NSP; the masked-LM transform and bias too for an
    encoder checkpoint) start as a fresh model's (seed 0), as they would when
    training started from this checkpoint, and are named in a warning.
    """
    prefix, out_dir = tf1.find_prefix(prefix) or Path(prefix), Path(out_dir)
    check_export_target(out_dir, overwrite)
    cfg, state, skipped = read_tf2(prefix, bert_config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = BertForPreTraining(cfg)
    fresh = assign_weights(model, state, prefix)
    if fresh:
        logger.warning("%s: the reference TF2 model has no %s; newly initialised: %s", prefix,
                       "NSP head" if "cls.predictions.bias" in state else "NSP or masked-LM head",
                       ", ".join(fresh))
    if vocab_path is None:
        vocab_path = next((d / "vocab.txt" for d in (prefix.parent, prefix.parent.parent)
                           if (d / "vocab.txt").is_file()), None)
    write_model_dir(model, cfg, out_dir, vocab_path)
    return out_dir, skipped, fresh


# ------------------------------------------------------------ writing

def build_graph(variables: dict[tuple[str, ...], str], aliases: dict[tuple[str, ...], tuple[str, ...]],
                ) -> tuple[list[Node], dict[tuple[str, ...], str]]:
    """The object graph of variables at object paths (path -> full name), ``aliases`` being
    further paths to objects already on a path (the pretrainer's ``masked_lm`` under its
    encoder, ``masked_lm/embedding_table``); and each variable's checkpoint key.

    Objects are created in the order the paths are given; node ids and keys
    follow TensorFlow's breadth-first walk from the root.
    """
    children: dict[tuple[str, ...], list[tuple[str, tuple[str, ...]]]] = collections.defaultdict(list)

    def add(path: tuple[str, ...], target: tuple[str, ...]) -> None:
        parent, name = path[:-1], path[-1]
        if parent and parent not in children:
            add(parent, parent)
        if all(local != name for local, _ in children[parent]):
            children[parent].append((name, target))

    for path in variables:
        add(path, path)
    for path, target in aliases.items():
        add(path, target)
    root: tuple[str, ...] = ()
    order, paths = [root], {root: root}  # objects (named by their first path) in breadth-first order
    queue = collections.deque([root])
    while queue:
        current = queue.popleft()
        for name, target in children.get(current, []):
            if target not in paths:
                paths[target] = (*paths[current], name)
                order.append(target)
                queue.append(target)
    ids = {obj: i for i, obj in enumerate(order)}
    keys = {obj: value_key(paths[obj]) for obj in variables}
    nodes = [Node(children=[(name, ids[target]) for name, target in children.get(obj, [])],
                  attributes=[(VARIABLE_VALUE, variables[obj], keys[obj])] if obj in variables else [])
             for obj in order]
    return nodes, keys


def export_tf2(model: torch.nn.Module, out_dir: Path | str, vocab_path: Path | str | None = None,
               overwrite: bool = False, layout: str | None = None) -> Path:
    """Write ``model`` as a TF2 checkpoint directory that Model Garden's reference model restores:
    ``model.ckpt.index``, ``model.ckpt.data-00000-of-00001`` (the weights under the object paths
    of ``layout`` — default ``pretrainer`` for a model with a masked-LM head, else ``encoder`` —
    the object graph and ``save_counter``), the ``checkpoint`` state file, ``bert_config.json``
    and ``vocab.txt`` when given. Weights the reference has no place for (the NSP head) are left
    out with a warning. Written atomically, like :func:`bertforge.formats.bert_tf1.export_tf1`."""
    model, cfg = tf_exportable(model, out_dir, overwrite, "TF2")
    key_prefix = "bert." if isinstance(model, BertModel) else ""
    state = {key_prefix + k: v.detach().to("cpu", torch.float32) for k, v in model.state_dict().items()}
    if layout is None:
        layout = "pretrainer" if "cls.predictions.bias" in state else "encoder"
    if layout not in LAYOUTS:
        raise ConversionError(f"unknown TF2 layout {layout!r} (one of {', '.join(LAYOUTS)})")
    if layout == "pretrainer" and "cls.predictions.bias" not in state:
        raise ConversionError(f"cannot export {type(model).__name__} in the pretrainer layout: it has no "
                              "masked-LM head (use the encoder layout)")
    if "bert.pooler.dense.weight" not in state:
        raise ConversionError(f"cannot export {type(model).__name__} as a TF2 checkpoint: it has no pooler, "
                              "which the reference's BertEncoder has (pooler_transform)")
    names = tf2_names(cfg.num_hidden_layers, layout)
    left_out = [k for k in state if k not in names]
    if left_out:
        logger.warning("not exported (the reference TF2 %s model has no place for them): %s", layout,
                       ", ".join(left_out))
    variables = {var.path: var.full_name for var in names.values()}
    variables[(SAVE_COUNTER,)] = SAVE_COUNTER
    aliases: dict[tuple[str, ...], tuple[str, ...]] = {}
    if layout == "pretrainer":
        word = names["bert.embeddings.word_embeddings.weight"].path
        aliases = {("encoder", "masked_lm"): MASKED_LM_PATH, (*MASKED_LM_PATH, "embedding_table"): word}
    nodes, keys = build_graph(variables, aliases)
    values: dict[str, torch.Tensor] = {
        keys[var.path]: to_tf(state[ours], var.kind, cfg.num_attention_heads).contiguous()
        for ours, var in names.items()}
    values[keys[(SAVE_COUNTER,)]] = torch.tensor(1, dtype=torch.int64)
    # The data in the object graph's order, then the graph, as tf.train.Checkpoint.save writes it.
    tensors: dict[str, torch.Tensor | bytes] = {key: values[key] for node in nodes for _, _, key in node.attributes}
    tensors[OBJECT_GRAPH] = serialize_object_graph(nodes)
    return write_tf_directory(out_dir, TF2_PREFIX, lambda prefix: write_bundle(prefix, tensors), cfg, vocab_path)
