"""Batches from the host to the device, and a step's numbers back: the one place each crosses over.

Batches leave the loader compact (int32 ids, positions and labels, uint8
masks; see ``PretrainingArrays.to_torch``), so a quarter of the bytes cross
the bus; :func:`widen` makes the int32 fields int64 on the device, after the
copy, where the loss needs them (``cross_entropy`` takes only int64 targets).

On CUDA, :func:`copied_ahead` issues each micro-batch's copy on a side stream
one micro-batch ahead, from pinned memory (the :class:`.data.loader.Prefetcher`
thread pins it), so the copy of micro-batch i + 1 runs while the model
computes micro-batch i and the host never waits for a copy. On the CPU the
batches pass through as they are.

The other way, :class:`HostCopy` takes a step's losses and flags to the host
without waiting for them: its copy is queued behind the work that computes
them, into pinned memory, and read a step later, when that work is done while
the next step's is queued, so the GPU never idles for the host to read.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Sequence

import torch

Batch = dict[str, torch.Tensor]


def to_device(batch: Batch, device: torch.device) -> Batch:
    """The batch on ``device`` (non-blocking on CUDA); tensors already there are returned as they are."""
    non_blocking = device.type == "cuda"
    return {k: v.to(device, non_blocking=non_blocking) for k, v in batch.items()}


def widen(batch: Batch) -> Batch:
    """int32 fields as int64, the rest as they are (masks stay uint8, weights float32)."""
    return {k: v.long() if v.dtype == torch.int32 else v for k, v in batch.items()}


def pinned(batch: Batch) -> Batch:
    """The batch in page-locked host memory, from which a copy to a CUDA device is asynchronous."""
    return {k: v if v.is_pinned() else v.pin_memory() for k, v in batch.items()}


@functools.cache
def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream that host-to-device copies run on, one per device."""
    return torch.cuda.Stream(device)


def copied_ahead(batches: Iterable[Batch], device: torch.device) -> Iterator[Batch]:
    """The batches, on CUDA already on ``device``, each one's copy issued before the previous is handed out.

    The copy runs on :func:`copy_stream`; before a batch is handed out, the
    current (compute) stream waits for its copy (an event: the host does not
    wait), and ``record_stream`` tells the caching allocator that the compute
    stream uses its memory, so it is not reused before the compute is done.
    (The pinned source may be dropped at once: torch's pinned-memory allocator
    does not reuse it before the copy is done.) Batches are read from
    ``batches`` one ahead of the consumer. On other devices the batches pass
    through unchanged, one at a time.
    """
    if device.type != "cuda":
        yield from batches
        return
    stream = copy_stream(device)
    pending: tuple[Batch, torch.cuda.Event] | None = None
    for batch in batches:
        with torch.cuda.stream(stream):
            copied = to_device(pinned(batch), device)
            issued = (copied, stream.record_event())
        if pending is not None:
            yield _ready(*pending, device)
        pending = issued
    if pending is not None:
        yield _ready(*pending, device)


def _ready(batch: Batch, copied: torch.cuda.Event, device: torch.device) -> Batch:
    compute = torch.cuda.current_stream(device)
    compute.wait_event(copied)
    for tensor in batch.values():
        tensor.record_stream(compute)
    return batch


class HostCopy:
    """0-dim device tensors on their way to the host: the copy is issued here, without waiting.

    On CUDA it is queued on the current stream, into pinned memory, behind the work that
    computes the values; :meth:`values` waits for it (an event, not a stream synchronisation).
    On the CPU the values are already there.
    """

    def __init__(self, values: Sequence[torch.Tensor]):
        stacked = torch.stack([v.detach().float() for v in values])
        self._event: torch.cuda.Event | None = None
        if stacked.is_cuda:
            self._host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
            self._host.copy_(stacked, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = stacked

    def values(self) -> list[float]:
        """The values, once the device has computed and copied them (reading memory, not the device)."""
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()
