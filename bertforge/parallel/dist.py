"""Processes, devices and model wrapping: one code path from one process to many nodes.

    python -m bertforge pretrain ...                                  # one process
    torchrun --nproc_per_node 8 -m bertforge pretrain --execution.parallel fsdp ...

``init_distributed`` reads RANK, WORLD_SIZE and LOCAL_RANK (set by torchrun)
and joins the process group: gloo on the CPU, NCCL (plus gloo for host
tensors) on CUDA, each rank on ``cuda:LOCAL_RANK``. ``prepare_model`` applies
``execution``: recomputation, then ``ddp`` (DistributedDataParallel),
``fsdp`` (FSDP2: ``fully_shard`` per encoder layer, then the root; with
``offload`` parameters, gradients and optimizer state live in host memory and
are streamed to the device layer by layer), then ``torch.compile``.

Under FSDP2 with ``precision: bf16`` the gathered parameters are bf16 and
gradients are reduced in fp32 (``MixedPrecisionPolicy``); the sharded
parameters and the optimizer state stay fp32. ``fsdp_grad_sync: step`` lets
gradients accumulate unsharded over a step's micro-batches and reduce-scatters
them once, after the last; ``reshard_after_forward: false`` keeps each layer's
gathered parameters from its forward to its backward (one all-gather less per
layer, at the cost of memory). DDP's gradients are views into its all-reduce
buckets (one gradient copy less).

``offload`` needs ``parallel: fsdp``: FSDP2 is what streams the host-held
shards to the device. In a single process ``ddp`` and ``fsdp`` run on a
one-rank process group, so the same config works with and without torchrun.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import time
import traceback
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from bertforge.config import ConfigError, ExecutionConfig, ModelConfig
from bertforge.fileio import atomic_file
from bertforge.models.bert import EncoderLayer, SelfAttention, set_attention_backends, set_vocab_multiple

DEFAULT_COMPILE_CACHE = "~/.cache/bertforge/compile"

_owns_group = False  # whether this module made the process group (and so destroys it)


@dataclass(frozen=True)
class DistContext:
    """Where this process stands: its rank among ``world_size`` and its device."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} is not an integer") from None


def resolve_device(name: str, local_rank: int = 0, world_size: int = 1) -> torch.device:
    """The device ``execution.device`` names for local rank ``local_rank`` (cuda → cuda:LOCAL_RANK)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"execution.device={name} but no CUDA device is available")
        if device.index is not None and world_size > 1:
            raise ConfigError(f"execution.device={name} names one GPU for {world_size} processes; "
                              f"use cuda or auto (rank r of a node takes cuda:LOCAL_RANK)")
        device = torch.device("cuda", local_rank if device.index is None else device.index)
    return device


def _backend(device: torch.device) -> str:
    # NCCL for device tensors; gloo beside it for host tensors (offloaded shards, objects).
    return "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"


def init_distributed(device: str = "auto", timeout_s: float = 1800) -> DistContext:
    """This process's rank, world size and device; joins the process group under torchrun.

    ``device`` is ``execution.device`` (auto | cpu | cuda | cuda:N) and
    ``timeout_s`` is ``execution.dist_timeout``: how long a rank waits for the
    others in a collective before it fails (and torchrun restarts the group).
    Under torchrun (WORLD_SIZE set) the default process group is initialised
    from the environment unless the caller already did; a single process gets
    no group until ``prepare_model`` needs one.
    """
    global _owns_group
    world_size = _env_int("WORLD_SIZE", 1)
    rank, local_rank = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    if not 0 <= rank < world_size:
        raise ConfigError(f"RANK={rank} is not in 0..WORLD_SIZE-1={world_size - 1}")
    target = resolve_device(device, local_rank, world_size)
    if target.type == "cuda":
        torch.cuda.set_device(target)
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # torchrun's agents keep one store for all the group's starts, holding the keys of
            # the starts before: a restarted group would read a dead rank's address. Each start
            # works under a prefix of its own.
            store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
            store = dist.PrefixStore(_fresh_prefix(store, rank, world_size, timeout), store)
            dist.init_process_group(_backend(target), store=store, rank=rank, world_size=world_size,
                                    timeout=timeout)
        else:
            dist.init_process_group(_backend(target), timeout=timeout)
        _owns_group = True
    if dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
    return DistContext(rank, world_size, local_rank, target)


def _fresh_prefix(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> str:
    """A key prefix that every rank of this start of the group agrees on, and no earlier start used.

    The agents' restart counts cannot name the start: they differ between nodes (a replacement
    node counts from 0; an agent that restarts for a new node does not count it). Rank 0 draws
    a new name; each other rank answers the name it reads with a new token of its own, and
    rank 0 confirms the tokens it receives: a name left by a dead rank 0 is never confirmed,
    so that rank reads the name again.
    """
    if rank == 0:
        name = uuid.uuid4().hex
        store.set("bertforge/start", name)
        for other in range(1, world_size):
            token = store.get(f"bertforge/{name}/answer/{other}").decode()
            store.set(f"bertforge/{name}/confirmed/{token}", "")
        return f"bertforge/{name}/"
    token, deadline = uuid.uuid4().hex, time.monotonic() + timeout.total_seconds()
    while True:
        name = store.get("bertforge/start").decode()
        store.set(f"bertforge/{name}/answer/{rank}", token)
        try:
            store.wait([f"bertforge/{name}/confirmed/{token}"], timedelta(seconds=1))
            return f"bertforge/{name}/"
        except dist.DistStoreError:
            if time.monotonic() > deadline:
                raise


def _ensure_process_group(ctx: DistContext) -> None:
    """DDP and FSDP need a process group; a single process gets one of its own."""
    global _owns_group
    if dist.is_initialized():
        return
    if ctx.world_size != 1:
        raise RuntimeError(f"world size {ctx.world_size} but no process group; call init_distributed first")
    dist.init_process_group(_backend(ctx.device), store=dist.HashStore(), rank=0, world_size=1)
    _owns_group = True


def destroy_distributed() -> None:
    """Leave the process group if this module joined it (a caller's own group is left alone)."""
    global _owns_group
    if _owns_group and dist.is_initialized():
        # DDP and FSDP objects hold the group; free them now, while the
        # interpreter is whole, not in its teardown, where destroying the
        # group's threads can abort the process.
        gc.collect()
        dist.destroy_process_group()
    _owns_group = False


# ------------------------------------------------------------ collectives
# Each is a no-op in a single process, so the training loop calls them unconditionally.

def broadcast(ctx: DistContext, obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (any picklable object)."""
    if ctx.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def from_main(ctx: DistContext, make: Any) -> Any:
    """``make()`` run on rank 0 only; its result, or its exception, reaches every rank.

    For what exactly one process must do (make the run directory, read a
    checkpoint's name): the others never wait forever for a rank that failed.
    """
    result, error = None, None
    if ctx.is_main:
        try:
            result = make()
        except Exception as err:  # noqa: BLE001 - handed to every rank below
            error = err
    result, error = broadcast(ctx, (result, error))
    if error is not None:
        raise error
    return result


def barrier(ctx: DistContext) -> None:
    if ctx.world_size > 1:
        dist.barrier()


def mean_over_ranks(ctx: DistContext, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The mean of each 0-dim tensor over the ranks, in one all-reduce."""
    return mean_and_any(ctx, values, False)[0]


def mean_and_any(ctx: DistContext, values: dict[str, torch.Tensor],
                 flag: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(the mean of each 0-dim tensor over the ranks, whether ``flag`` is set on any rank),
    in the one all-reduce a step makes anyway: the flag rides along as one more number
    (summed, so non-zero when any rank set it). The flag is a 0-dim tensor: reading it
    is the caller's host sync."""
    if ctx.world_size == 1:
        return values, torch.tensor(flag)
    device = next(iter(values.values())).device
    stacked = torch.stack([*(v.float() for v in values.values()), torch.tensor(float(flag), device=device)])
    dist.all_reduce(stacked)
    means, total = stacked[:-1] / ctx.world_size, stacked[-1]
    return dict(zip(values, means.unbind())), total > 0


def write_error(run_dir: Path, ctx: DistContext) -> Path | None:
    """The current exception's traceback in ``run_dir/error_rank{N}.log``: one file per rank.

    None when it cannot be written (a read-only run directory, a full disk): the
    error being handled still reaches the console, and no half-written log is left.
    """
    path = Path(run_dir) / f"error_rank{ctx.rank}.log"
    text = traceback.format_exc()
    try:
        with atomic_file(path) as tmp:  # makes the directory: a run may fail before it wrote anything
            tmp.write_text(text, encoding="utf-8")
    except OSError:
        return None
    return path


# ------------------------------------------------------------ model wrapping

def check_pipeline(execution: ExecutionConfig, world_size: int) -> None:
    """The world-size rules of ``execution.pipeline_stages``, as ConfigErrors (for check_execution)."""
    stages = execution.pipeline_stages
    if stages <= 1:
        return
    if world_size % stages:
        raise ConfigError(f"execution.pipeline_stages={stages} needs a multiple of {stages} ranks (one per stage "
                          f"and pipeline), but {world_size} were launched")
    if execution.parallel == "none" and world_size != stages:
        raise ConfigError(f"{world_size} ranks for execution.pipeline_stages={stages} make "
                          f"{world_size // stages} pipelines, but execution.parallel=none; use "
                          f"--execution.parallel ddp to run them as data-parallel replicas")


def check_execution(execution: ExecutionConfig, world_size: int) -> None:
    """Combinations of execution settings and world size that cannot work, as ConfigErrors."""
    if execution.pipeline_stages > 1:  # the ranks are pipelines' stages (training/pipeline.py)
        check_pipeline(execution, world_size)
    elif execution.parallel == "none" and world_size > 1:
        raise ConfigError(f"{world_size} processes were launched but execution.parallel=none; "
                          f"use --execution.parallel ddp or fsdp")
    if execution.offload and execution.parallel != "fsdp":
        raise ConfigError(f"execution.offload=true needs execution.parallel=fsdp, not "
                          f"{execution.parallel} (FSDP2 streams the host-held shards to the device; "
                          f"it also runs in a single process)")
    if execution.parallel == "fsdp" and execution.precision == "fp16":
        raise ConfigError("execution.precision=fp16 is not supported with execution.parallel=fsdp "
                          "(its loss scaler would need sharded inf checks); use bf16")
    if execution.offload and execution.fsdp_grad_sync == "step":
        raise ConfigError("execution.fsdp_grad_sync=step cannot be used with execution.offload=true: the "
                          "unsharded gradients it accumulates would stay on the device for the whole step; "
                          "use auto or micro_batch")


def prepare_model(model: nn.Module, execution: ExecutionConfig, ctx: DistContext) -> nn.Module:
    """The model as training runs it: recomputation, then DDP or FSDP2, then torch.compile.

    Weights to start from must be loaded before (every rank builds the same
    model from the same seed). Build the optimizer afterwards, over
    ``unwrap(result).parameters()``: under FSDP those are the sharded
    parameters. The result's ``forward`` is the model's.
    """
    check_execution(execution, ctx.world_size)
    if execution.pipeline_stages > 1:  # pre-training splits the model itself (pipeline_parallel.build_engine)
        raise ConfigError(f"execution.pipeline_stages={execution.pipeline_stages} is supported by "
                          f"bertforge pretrain only; use 1 here")
    use_fp32_matmul_precision(fp32_matmul_precision(execution, ctx.device))
    if execution.fp8:
        convert_to_fp8(model, execution, ctx.device)
    apply_recompute(model, execution.recompute)
    config: ModelConfig | None = getattr(model, "config", None)  # (any module will do: one without attention)
    dropout = config.attention_probs_dropout_prob if config is not None else 0.0
    set_attention_backends(model, attention_backends(execution, ctx.device, dropout))
    # Tensor cores take a vocab of a multiple of 64 without a ragged edge (30522 → 30528).
    set_vocab_multiple(model, 64 if ctx.device.type == "cuda" else 1)
    if execution.parallel == "fsdp":
        _ensure_process_group(ctx)
        model = _fully_shard(model, ctx, execution)
    elif execution.parallel == "ddp":
        _ensure_process_group(ctx)
        # Gradients as views into the all-reduce buckets: no separate copy of them.
        model = nn.parallel.DistributedDataParallel(
            model.to(ctx.device), device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
            gradient_as_bucket_view=True)
    else:
        model = model.to(ctx.device)
    if compiles(execution, ctx.device):
        use_compile_cache(execution.compile_cache)
        # Each encoder layer; a model without any (or compile_scope model) is compiled whole.
        if execution.compile_scope == "model" or not compile_layers(model, execution.compile_mode):
            # Static shapes: a batch shape compiles once, and is not traced again as a dynamic one.
            # torch's stub says a callable; compiling a module gives a module (an OptimizedModule)
            model = torch.compile(model, dynamic=False, mode=execution.compile_mode)  # type: ignore[assignment]
    return model


def compile_layers(model: nn.Module, mode: str = "default") -> int:
    """Regional compilation: every encoder layer's forward under torch.compile; how many.

    The layers run one code object (their class's ``forward``, or ``_recomputed``
    under recomputation), so Dynamo traces one layer and every other layer reuses
    that graph: a cold start compiles one layer's forward and backward instead of
    the whole model unrolled (``benchmarks/compile_start.py`` counts both). The
    embeddings and heads run eager, the loss compiled (``is_compiled``). The
    forward is replaced in place: parameter names, and the hooks of DDP, FSDP2
    and recomputation around each layer, stay outside the graph.
    """
    layers = [module for module in model.modules() if isinstance(module, EncoderLayer)]
    for layer in layers:
        forward = layer.forward
        if isinstance(forward, functools.partial):  # recomputation's: its function compiled, one for every layer
            # (Dynamo would guard on each layer's own partial object, and compile again for the next.)
            function = torch.compile(forward.func, dynamic=False, mode=mode)
            layer.forward = functools.partial(function, *forward.args, **forward.keywords)
        else:  # static shapes, as for the whole model
            layer.forward = torch.compile(forward, dynamic=False, mode=mode)
    return len(layers)


def fp32_matmul_precision(execution: ExecutionConfig, device: torch.device) -> str | None:
    """What fp32 matmuls on ``device`` run as (torch's ``fp32_precision``): on CUDA ``tf32`` (tensor cores,
    a 10-bit mantissa, as bf16 autocast's fp32 parts and fp32 runs are trained elsewhere) unless
    ``execution.tf32`` is false: ``ieee``, exact fp32. None on the CPU, which has no TF32."""
    if device.type != "cuda":
        return None
    return "tf32" if execution.tf32 else "ieee"


def use_fp32_matmul_precision(precision: str | None) -> str:
    """Set CUDA's fp32 matmul precision (``fp32_matmul_precision``; None leaves it); the one before, to
    restore. Through torch's per-backend setting where it has one (torch >= 2.9: mixing it with the old
    flags is an error)."""
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        before = str(matmul.fp32_precision)
        if precision is not None:
            matmul.fp32_precision = precision
    else:
        before = "tf32" if matmul.allow_tf32 else "ieee"
        if precision is not None:
            matmul.allow_tf32 = precision == "tf32"
    return before


FP8_MULTIPLE = 16  # FP8 matmuls (torch._scaled_mm) take dimensions that are multiples of 16


def fp8_layers(model: nn.Module) -> list[str]:
    """The linear layers ``execution.fp8`` converts: those inside the encoder layers (the bulk of the
    FLOPs) whose in- and out-features are multiples of 16; not the embeddings, nor the heads (the
    masked-LM transform and projection, the pooler, NSP, classifiers), whose outputs feed the loss."""
    return [f"{layer_name}.{name}" if name else layer_name
            for layer_name, layer in model.named_modules() if isinstance(layer, EncoderLayer)
            for name, module in layer.named_modules()
            if isinstance(module, nn.Linear)
            and module.in_features % FP8_MULTIPLE == 0 and module.out_features % FP8_MULTIPLE == 0]


def check_fp8(execution: ExecutionConfig, device: torch.device) -> None:
    """Refuse ``execution.fp8`` in one line where it cannot run: not bf16, not CUDA with FP8 tensor
    cores (compute capability 8.9: Ada, Hopper and later), torchao not installed."""
    import importlib.util

    if execution.precision != "bf16":
        raise ConfigError(f"execution.fp8=true runs under execution.precision=bf16, not {execution.precision}")
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if capability is None or tuple(capability) < (8, 9):
        where = "a CPU" if capability is None else f"compute capability {capability[0]}.{capability[1]}"
        raise ConfigError(f"execution.fp8=true needs a GPU with FP8 tensor cores (compute capability 8.9 or "
                          f"later: Ada, Hopper), not {where}; use execution.fp8 false")
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError("execution.fp8=true needs torchao (pip install torchao), which is not installed")


def convert_to_fp8(model: nn.Module, execution: ExecutionConfig, device: torch.device) -> list[str]:
    """torchao's float8 training (dynamic scaling per tensor) on ``fp8_layers(model)``, in place; their
    names. Refused by ``check_fp8`` where it cannot run. Before compile and sharding, as torchao asks."""
    check_fp8(execution, device)
    from torchao.float8 import convert_to_float8_training

    names = set(fp8_layers(model))
    convert_to_float8_training(model, module_filter_fn=lambda _module, name: name in names)
    return sorted(names)


RECOMPUTE_UNITS = {"layer": EncoderLayer, "attention": SelfAttention}  # execution.recompute → what it checkpoints


def apply_recompute(model: nn.Module, policy: str) -> None:
    """Activation recomputation, applied from outside the model: trade compute in the backward
    pass for memory.

    ``layer`` keeps only each encoder layer's input and recomputes the layer in the backward
    pass; ``attention`` recomputes only self-attention (the projections and the (T × T) scores,
    the largest activation at long sequences); ``none`` keeps everything. Each such module's
    forward is replaced by a checkpointed call of itself (its names, and so its weights'
    names, stay); the RNG state is restored for the recomputation, so dropout draws the
    same masks.
    """
    if policy != "none" and policy not in RECOMPUTE_UNITS:
        raise ValueError(f"recompute policy must be one of none, {', '.join(RECOMPUTE_UNITS)}, got {policy!r}")
    for module in model.modules():
        if policy != "none" and isinstance(module, RECOMPUTE_UNITS[policy]):
            module.forward = functools.partial(_recomputed, module.forward)


def _recomputed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():  # evaluation: nothing to keep for a backward
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def compiles(execution: ExecutionConfig, device: torch.device) -> bool:
    """``execution.compile`` resolved: ``auto`` compiles on CUDA only, where the fused kernels
    pay for the minutes of compiling; on the CPU they gain little."""
    return device.type == "cuda" if execution.compile == "auto" else bool(execution.compile)


def compiles_optimizer(execution: ExecutionConfig, device: torch.device) -> bool:
    """Whether our optimizers take their compiled step (``training/optim.py``): where the model compiles
    on CUDA. Not on the CPU, where Inductor writes a C++ loop per tensor (BERT-base's take about
    ten minutes to compile), nor with ``offload``, which steps on the host."""
    return compiles(execution, device) and device.type == "cuda" and not execution.offload


def attention_backends(execution: ExecutionConfig, device: torch.device,
                       attention_dropout: float = 0.0) -> list[str] | None:
    """The attention kernels in order of preference (``model.set_attention_backends``) for
    training on ``device`` a model of that attention dropout.

    ``auto`` on CUDA prefers Flash (no mask: unpadded batches) and cuDNN (which takes the
    additive masks of padded and packed batches) over the memory-efficient kernel, which
    torch would otherwise choose for every masked batch; on the CPU it leaves torch's order.
    ``flex`` gives masked batches FlexAttention's block masks (and the rest torch's SDPA
    order): on CUDA only, where it is a fused kernel with a backward, and without attention
    dropout, which it lacks.
    """
    if execution.attention == "flex":
        if device.type != "cuda":
            raise ConfigError(f"execution.attention=flex trains on CUDA only (torch's FlexAttention has no "
                              f"backward on {device.type}); use auto")
        if attention_dropout > 0:
            raise ConfigError(f"execution.attention=flex has no attention dropout, but "
                              f"model.attention_probs_dropout_prob={attention_dropout}: set it to 0, or use auto")
    if execution.attention != "auto":
        return [execution.attention]
    return ["flash", "cudnn", "efficient", "math"] if device.type == "cuda" else None


def _fully_shard(model: nn.Module, ctx: DistContext, execution: ExecutionConfig) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    offload = execution.offload
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    # Pinned host memory speeds up host-device copies; there is none to pin without a GPU.
    policy = CPUOffloadPolicy(pin_memory=ctx.device.type == "cuda") if offload else OffloadPolicy()
    # bf16: gather (and compute with) bf16 copies of the fp32 shards, reduce gradients in fp32.
    mixed = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
             if execution.precision == "bf16" else MixedPrecisionPolicy())
    if not offload:
        model.to(ctx.device)
    # One unit per encoder layer: a layer's full weights exist only while it runs,
    # or from its forward to its backward with reshard_after_forward false.
    for layer in [m for m in model.modules() if isinstance(m, EncoderLayer)]:
        fully_shard(layer, mesh=mesh, offload_policy=policy, mp_policy=mixed,
                    reshard_after_forward=execution.reshard_after_forward)
    # The root unit holds the embeddings and the heads, so the MLM decoder's
    # tied weight is the word embedding's, gathered once per forward.
    fully_shard(model, mesh=mesh, offload_policy=policy, mp_policy=mixed)
    # Our outputs (logits) are views; nothing modifies them in place, which is what this warns of.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The model itself under torch.compile and DDP (FSDP2 shards in place: nothing to strip)."""
    model = getattr(model, "_orig_mod", model)
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
    return model


def is_compiled(model: nn.Module) -> bool:
    """Whether the model runs compiled: whole (torch.compile's OptimizedModule) or layer by layer
    (``compile_layers``: a forward torch.compile wrapped)."""
    if hasattr(model, "_orig_mod"):
        return True
    return any(hasattr(getattr(module.forward, "func", module.forward), "_torchdynamo_orig_callable")
               for module in model.modules() if isinstance(module, EncoderLayer))


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(unwrap(model), FSDPModule)


def gradient_sync(model: nn.Module, enabled: bool, grad_sync: str = "step") -> contextlib.AbstractContextManager:
    """Reduce gradients over the ranks in the backward inside only when ``enabled`` (the last
    micro-batch of a step).

    DDP all-reduces then. FSDP2 with ``grad_sync`` ``step`` (``execution.grad_sync``, resolved)
    accumulates unsharded gradients and reduce-scatters them then; with ``micro_batch`` it
    reduce-scatters every micro-batch's, so that only sharded gradients outlive a backward
    (what offload needs).
    """
    inner = getattr(model, "_orig_mod", model)
    if not enabled and isinstance(inner, nn.parallel.DistributedDataParallel):
        return inner.no_sync()
    if grad_sync == "step" and is_sharded(inner):
        return _fsdp_requires_sync(inner, enabled)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp_requires_sync(model: Any, enabled: bool) -> Iterator[None]:
    model.set_requires_gradient_sync(enabled)  # on every FSDP unit of the model
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)  # a backward outside a step reduces as usual


def compile_counts() -> dict[str, int | float]:
    """What torch.compile did in this process so far: the graphs it compiled (``graphs``), how many of
    them were recompilations of code already compiled (a guard failed: ``recompiles``), the graphs
    Inductor loaded from the compile cache and those it compiled (``cache_hits``, ``cache_misses``),
    and its seconds: all (``compile_s``), Dynamo's tracing (``dynamo_s``), AOT autograd and Inductor's
    (``aot_inductor_s``: the forward's and the backward's, which compiles at its first call)."""
    from torch._dynamo.utils import calculate_time_spent, counters, guard_failures

    seconds = calculate_time_spent()
    frame, backend, backward = (seconds.get(key, 0.0) for key in
                                ("entire_frame_compile", "backend_compile", "entire_backward_compile"))
    return {"graphs": counters["stats"]["unique_graphs"],
            "recompiles": sum(len(reasons) for reasons in guard_failures.values()),
            # Graphs Inductor found in the persistent cache (execution.compile_cache) and compiled.
            "cache_hits": counters["inductor"]["fxgraph_cache_hit"],
            "cache_misses": counters["inductor"]["fxgraph_cache_miss"],
            "compile_s": round(frame + backward, 2), "dynamo_s": round(frame - backend, 2),
            "aot_inductor_s": round(backend + backward, 2)}


def use_compile_cache(path: str) -> Path:
    """Point Inductor's caches (FX graphs, AOT autograd, kernels) at a persistent directory.

    A second run with the same model and shapes then loads the compiled
    graphs instead of compiling them again.
    """
    cache = Path(path or DEFAULT_COMPILE_CACHE).expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
    functorch_config.enable_autograd_cache = True
    return cache
