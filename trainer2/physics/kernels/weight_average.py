"""The weight average's move (trainer2.learning.averaging.WeightAverage.update) in one Triton launch over the flat
buffers: the weight 1 - d from the update count, the lerp toward the parameters, and the rotor's angles moved the
short way round and wrapped to [-pi, pi); the count's increment follows in torch (every program reads the count, so
none may write it). Two launches where the torch operators take 13. It runs beside the fused update
(--update_backend triton).

Its torch reference is WeightAverage.update without a kernel; tests/test_fused_update.py compares the two:
the same operations in the same order, so equal bits but where an angle crosses the wrap (torch's addcmul may round
its products in another order).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from trainer2.physics.kernels.chain import div_ieee, row_major, sized
from trainer2.physics.kernels.fused_update import BLOCK, lerp


@triton.jit
def round_half_even(x):
    """torch.round: to the nearest integer, halves to the even one."""
    f = tl.floor(x)
    d = x - f  # exact for |x| < 2^23 (float32), and larger numbers are whole already
    even = (f - 2.0 * tl.floor(f * 0.5)) == 0.0
    return tl.where(d > 0.5, f + 1.0, tl.where(d < 0.5, f, tl.where(even, f, f + 1.0)))


@triton.jit
def weight_average_kernel(
    avg_ptr,  # (P,) the average, moved in place
    param_ptr,  # (P,) the parameters
    count_ptr,  # (1,) the updates averaged so far, t
    c_ptr,  # (5,) float64: 1 - decay, 1 / (2 pi), -2 pi, pi, 2 pi
    n,
    th_lo,
    th_hi,
    BLOCK: tl.constexpr,
):
    """The average moved toward the parameters by 1 - d over BLOCK elements a program; the angles at [th_lo, th_hi)
    the short way round, wrapped. Reads the count, never writes it."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    dt = avg_ptr.dtype.element_ty
    t = tl.load(count_ptr)
    w = tl.maximum(div_ieee(tl.full([], 1.0, dt), t + 10.0) * 9.0, tl.load(c_ptr).to(dt))  # 1 - d
    a = tl.load(avg_ptr + offs, mask=inside, other=0.0)
    p = tl.load(param_ptr + offs, mask=inside, other=0.0)
    turn = round_half_even((p - a) * tl.load(c_ptr + 1).to(dt))  # whole turns between an angle and its average
    moved = lerp(a, p, w)
    pi, two_pi = tl.load(c_ptr + 3).to(dt), tl.load(c_ptr + 4).to(dt)
    back = moved + tl.load(c_ptr + 2).to(dt) * turn * w  # addcmul_(turn, w, value=-2 pi)
    r = (back + pi) % two_pi  # fmod, then torch.remainder's sign fix for a positive divisor
    angle = (offs >= th_lo) & (offs < th_hi)
    tl.store(avg_ptr + offs, tl.where(angle, tl.where(r < 0.0, r + two_pi, r) - pi, moved), mask=inside)


class AverageKernel:
    """`kernel(avg, param, count)`: the average's move over the flat (P,) buffers, the rotor's angles at `theta`, then
    count += 1. Allocates nothing and reads nothing back, so a CUDA graph captures it; `launches` counts the launches
    (a Python int)."""

    def __init__(self, flat: Tensor, theta: slice, decay: float) -> None:
        self.n, self.theta, self.dtype = flat.numel(), (theta.start, theta.stop), flat.dtype
        self.programs = triton.cdiv(self.n, BLOCK)
        consts = [1.0 - decay, 1.0 / (2 * math.pi), -2 * math.pi, math.pi, 2 * math.pi]
        self.consts = torch.tensor(consts, dtype=torch.float64, device=flat.device)
        self.launches = 0

    def __call__(self, avg: Tensor, param: Tensor, count: Tensor) -> None:
        row_major(avg, param)
        sized(self.dtype, avg=(avg, (self.n,)), param=(param, (self.n,)), count=(count, (1,)))
        weight_average_kernel[(self.programs,)](avg, param, count, self.consts, self.n, *self.theta, BLOCK=BLOCK)
        count.add_(1.0)
        self.launches += 1
