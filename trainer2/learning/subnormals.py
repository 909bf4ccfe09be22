"""Keeping subnormal floats out of a run: CPU arithmetic on them is 10-100x slower than on normal floats.

Where they come from: a hidden unit that sits at 0 or 1 (the edge of its box) for every example of a batch gets
exactly zero EP gradient, so its couplings' optimizer moments decay geometrically (Adam's first moment by 0.9 a
window). Rounded to nearest, m - 0.1 m never reaches 0: it sticks at the smallest subnormals, forever. A long
run collects tens of thousands of them and slows down seven- to ten-fold (issue 26).

Two measures: `flush_subnormals_` snaps the optimizer moments below the normal range to exactly zero after each
update (the fix: deterministic, on every thread and device, ~1% of a deep window on one CPU thread), and
`flush_denormal` asks the CPU to flush subnormal results of this thread to zero (FTZ/DAZ; process setup only, never
at import; it covers everything a one-thread run computes, cpu_threads' default, but not the other threads of the
intra-op pool, which is why it cannot be the fix on its own).
"""

from __future__ import annotations

import torch
from torch import Tensor


def flush_subnormals_(tensors: list[Tensor]) -> None:
    """In place: entries with |x| <= the smallest normal float become 0, all others (NaN and inf too) keep their
    bits; one pass per tensor (hardshrink writing into its input), no allocation, no host sync, capturable."""
    for t in tensors:
        torch.hardshrink(t, torch.finfo(t.dtype).tiny, out=t)


def flush_denormal() -> bool:
    """Make this thread's CPU arithmetic flush subnormal inputs and results to zero; False where unsupported.
    Process-global state: call it in an entry point's setup (train, evaluate, sample, bench), never at import."""
    return torch.set_flush_denormal(True)


def count_subnormals(t: Tensor) -> int:
    """Number of nonzero entries of float tensor `t` below the smallest normal number (host sync: diagnostics only)."""
    a = t.abs()
    return int(((a > 0) & (a < torch.finfo(t.dtype).tiny)).sum())
