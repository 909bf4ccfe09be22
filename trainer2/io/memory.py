"""Memory free for this process, on the CPU or a CUDA device: what the size checks compare a run's needs with."""

from __future__ import annotations

import math
import os
import resource

import torch


def available_bytes(device: torch.device) -> float | None:
    """Memory free for this process: the GPU's free memory, or on the CPU the smaller of MemAvailable and the
    address-space limit (ulimit -v) left; None when it cannot be told."""
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    free = None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            free = next(float(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        pass
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit != resource.RLIM_INFINITY:
        try:
            with open("/proc/self/statm", encoding="ascii") as f:
                used = float(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            used = 0.0
        free = min(free if free is not None else math.inf, limit - used)
    return free
