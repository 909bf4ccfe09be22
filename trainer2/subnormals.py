"""Keeping subnormal floats out of a run: CPU arithmetic on them is 10-100x slower than on normal floats.

Where they come from: a hidden unit that sits at 0 or 1 (the edge of its box) for every example of a batch gets
exactly zero EP gradient, so its couplings' optimizer moments decay geometrically (Adam's first moment by 0.9 a
window). Rounded to nearest, m - 0.1 m never reaches 0: it sticks at the smallest subnormals, forever. A long
run collects tens of thousands of them and slows down seven- to ten-fold (issue 26).

Two measures: `flush_tiny_` snaps every moment below the normal range to exactly zero after each update (the
fix: deterministic, on every thread and device), and `flush_denormal` asks the CPU to flush subnormal results of
this thread to zero (FTZ/DAZ; process setup only, never at import; other threads of the intra-op pool keep the
default, which is why it cannot be the fix on its own).
"""

from __future__ import annotations

import torch
from torch import Tensor


def tiny_offset(dtype: torch.dtype) -> float:
    """c = 4 * tiny / eps of `dtype`: the floats near c are 2 or 4 * tiny apart, so (x + c) - c is 0 for every
    subnormal x, never subnormal for any x, and exactly x for |x| >= c / eps (~3e-24 in float32)."""
    info = torch.finfo(dtype)
    return 4.0 * info.tiny / info.eps


def flush_tiny_(tensors: list[Tensor], offset: float) -> None:
    """In place: subnormal entries become exactly 0, none is subnormal afterwards, and entries below offset / eps move
    by at most 4 * tiny (~5e-38 in float32); no allocation, no host sync, capturable. offset = tiny_offset(dtype)."""
    torch._foreach_add_(tensors, offset)
    torch._foreach_sub_(tensors, offset)


def flush_denormal() -> bool:
    """Make this thread's CPU arithmetic flush subnormal inputs and results to zero; False where unsupported.
    Process-global state: call it in an entry point's setup (train, evaluate, sample, bench), never at import."""
    return torch.set_flush_denormal(True)


def count_subnormals(t: Tensor) -> int:
    """Number of nonzero entries of float tensor `t` below the smallest normal number (host sync: diagnostics only)."""
    a = t.abs()
    return int(((a > 0) & (a < torch.finfo(t.dtype).tiny)).sum())
