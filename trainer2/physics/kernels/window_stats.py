"""A window's observables (trainer2.physics.relaxation.WindowStats: the free phase's LIoR path length, mean and last
spd, R_sc, the nudged phases' path length and last spd) in one Triton launch where the torch operators take nine:
one program sums the free and nudged spd histories and writes the six 0-dim figures into one buffer.

Its torch reference is Relaxation.free_stats and Relaxation.nudged_stats; tests/test_window_stats.py compares the two
(within rounding: another order of addition) and proves the kernel ran in a batch step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from trainer2.physics.kernels.chain import row_major, sized

BLOCK = 1024  # spd elements a step of the program
FIELDS = ("lior_mean", "spd_mean", "spd_last", "R_mean", "lior_nudge", "spd_last_nudge")  # the buffer's order


@triton.jit
def total(ptr, lo, hi, BLOCK: tl.constexpr):
    """The sum of ptr[lo:hi] (0-dim), in blocks of BLOCK."""
    acc = tl.zeros([BLOCK], dtype=ptr.dtype.element_ty)
    for k in range(lo, hi, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        acc += tl.load(ptr + offs, mask=offs < hi, other=0.0)
    return tl.sum(acc, axis=0)


@triton.jit
def window_stats_kernel(
    out_ptr,  # (6,) FIELDS, written
    r_ptr,  # () R_sc
    span_ptr,  # (2,) dt * free_steps, dt * nudge_steps
    free_ptr,  # (T, B) the free phase's spd, row-major
    nudged_ptr,  # (T_n, R) the nudged phases' spd (unread without NUDGED)
    free_n,
    free_rows,
    nudged_n,
    nudged_rows,
    NUDGED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program: the means of both histories and of their last rows, and the path lengths R_sc dt T mean(spd)."""
    r = tl.load(r_ptr)
    spd_mean = total(free_ptr, 0, free_n, BLOCK) / free_n
    tl.store(out_ptr + 0, r * tl.load(span_ptr + 0) * spd_mean)
    tl.store(out_ptr + 1, spd_mean)
    tl.store(out_ptr + 2, total(free_ptr, free_n - free_rows, free_n, BLOCK) / free_rows)
    tl.store(out_ptr + 3, r)
    if NUDGED:
        nudged_mean = total(nudged_ptr, 0, nudged_n, BLOCK) / nudged_n
        tl.store(out_ptr + 4, r * tl.load(span_ptr + 1) * nudged_mean)
        tl.store(out_ptr + 5, total(nudged_ptr, nudged_n - nudged_rows, nudged_n, BLOCK) / nudged_rows)
    else:  # recurrent backprop's adjoint: no nudged phase, both 0 (as nudged_stats)
        zero = tl.full([], 0.0, r.dtype)
        tl.store(out_ptr + 4, zero)
        tl.store(out_ptr + 5, zero)


class WindowStatsKernel:
    """`kernel(r_sc, free_spd, nudged_spd)`: the window's six observables, views of one buffer that the next call
    overwrites (a WindowStats' fields by name); nudged_spd None where no nudged phase runs. Allocates nothing and reads
    nothing back, so a CUDA graph captures it; `launches` counts the launches (a Python int)."""

    def __init__(self, free_shape: tuple[int, int], nudged_shape: tuple[int, int] | None, dt: float, like: Tensor):
        self.free_shape, self.nudged_shape, self.dtype = free_shape, nudged_shape, like.dtype
        steps_nudged = 0 if nudged_shape is None else nudged_shape[0]
        self.span = torch.tensor([dt * free_shape[0], dt * steps_nudged], dtype=like.dtype, device=like.device)
        self.out = like.new_zeros(len(FIELDS))
        self.views = dict(zip(FIELDS, self.out.unbind(0), strict=True))
        self.launches = 0

    def __call__(self, r_sc: Tensor, free_spd: Tensor, nudged_spd: Tensor | None) -> dict[str, Tensor]:
        if (nudged_spd is None) != (self.nudged_shape is None):
            raise ValueError(f"window stats kernel: built for nudged spd {self.nudged_shape}, given {nudged_spd}")
        # Without nudged phases the free history stands in for the nudged pointer, never read (NUDGED off)
        nudged, nudged_shape = (free_spd, self.free_shape) if nudged_spd is None else (nudged_spd, self.nudged_shape)
        sized(self.dtype, r_sc=(r_sc, ()), free_spd=(free_spd, self.free_shape), nudged_spd=(nudged, nudged_shape))
        row_major(free_spd, nudged)
        window_stats_kernel[(1,)](
            self.out,
            r_sc,
            self.span,
            free_spd,
            nudged,
            free_spd.numel(),
            self.free_shape[1],
            nudged.numel(),
            nudged_shape[1],
            NUDGED=nudged_spd is not None,
            BLOCK=BLOCK,
        )
        self.launches += 1
        return self.views
