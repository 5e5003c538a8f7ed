"""What this process runs on, without importing torch: package versions, the CPU's name, memory."""

from __future__ import annotations

import contextlib
import os
import platform
import resource
import sys
import time
from importlib import metadata
from typing import Any


def package_version(name: str) -> str | None:
    """The installed version of ``name``, or None when it is not installed."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


_IMPORTED = time.time()  # the process's start where /proc does not say


def process_age_s() -> float:
    """Seconds since this process started (Linux: its start time in /proc; elsewhere since this
    module's import), what a first step's time is counted from."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/self/stat") as f:  # field 22: start, clock ticks after boot (after the name's ")")
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - _IMPORTED


def cpu_name() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def device_name(device: Any) -> str:
    """The GPU's name for a CUDA device (torch is imported only then), else the CPU's."""
    if getattr(device, "type", "") == "cuda":
        import torch

        return torch.cuda.get_device_name(device)
    return cpu_name()


def current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def reset_peak_rss() -> bool:
    """Reset the high-water mark (``VmHWM``) to the current resident set (Linux ≥ 4.0), so that
    :func:`peak_rss_mb` gives the peak of what runs next; whether it could."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_mb() -> float:
    """The peak resident set of this process (since the last reset of ``VmHWM``), in MiB.

    Linux's ``VmHWM``, where there is one: ``ru_maxrss`` survives ``exec``, so in a
    process started by a larger one (``bertforge bench --spec`` runs each benchmark
    so) it would report the parent's peak.
    """
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes on macOS, kB elsewhere
