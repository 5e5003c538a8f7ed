"""One spawned rank of a gloo process group, for tests that compare ranks with one process."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist


def run_rank(rank: int, world_size: int, store_path: str, body: Callable[[], None]) -> None:
    """Join a gloo group of ``world_size`` ranks through a FileStore at ``store_path``, run ``body``
    (which sends its results: a queue, a file), wait for every rank, and leave.

    The exit skips the interpreter's teardown: gloo's C++ threads aborted it about 1 run in 7
    ("terminate called without an active exception") after the results were already sent.
    """
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank,
                            world_size=world_size)
    try:
        body()
        dist.barrier()  # neither rank tears gloo down while another still uses it
    except BaseException:
        dist.destroy_process_group()
        raise
    dist.destroy_process_group()
    os._exit(0)
