"""The rotor's angle gradient (trainer2.physics.readout.rotor_angle_grad: d loss / d theta_j = K_l[b_j, a_j], K_l =
S_l^T (C - C^T) S_l) in one Triton launch where the torch operators take four: one program forms each plane's entry
S_l[:, b]^T (C - C^T) S_l[:, a] directly, a block of planes at a time, without the (L + 1, n, n) products.

Its torch reference is rotor_angle_grad; tests/test_rotor_angle_grad.py compares the two (within rounding: another
order of addition) and proves the kernel ran in a batch step beside the readout kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from trainer2.physics.kernels.chain import row_major, sized
from trainer2.physics.readout import RotorLayout

TILE = 4096  # planes x coordinates x coordinates a step of the program


@triton.jit
def rotor_angle_grad_kernel(
    out_ptr,  # (k,) d loss / d theta, written
    c_ptr,  # (n, n) C = (d loss / d R) R^T, row-major
    suffix_ptr,  # (L + 1, n, n) S_l, row-major
    index_ptr,  # (k,) int64: plane j's (b, a) entry, flat in (L, n, n)
    k,
    n,
    NP: tl.constexpr,
    PLANES: tl.constexpr,
):
    """One program: A = C - C^T once, then for PLANES planes at a time sum_i S[i, b] sum_j A[i, j] S[j, a]."""
    i = tl.arange(0, NP)
    inside = (i[:, None] < n) & (i[None, :] < n)
    c = tl.load(c_ptr + i[:, None] * n + i[None, :], mask=inside, other=0.0)
    c_t = tl.load(c_ptr + i[None, :] * n + i[:, None], mask=inside, other=0.0)
    a_mat = c - c_t  # (NP, NP)
    for p0 in range(0, k, PLANES):
        planes = p0 + tl.arange(0, PLANES)
        live = planes < k
        flat = tl.load(index_ptr + planes, mask=live, other=0)
        layer, entry = flat // (n * n), flat % (n * n)
        b, a = entry // n, entry % n
        rows = live[:, None] & (i[None, :] < n)
        base = suffix_ptr + layer[:, None] * (n * n) + i[None, :] * n  # (PLANES, NP): S_l[i, .] of each plane
        s_b = tl.load(base + b[:, None], mask=rows, other=0.0)  # S_l[i, b]
        s_a = tl.load(base + a[:, None], mask=rows, other=0.0)  # S_l[j, a]
        v = tl.sum(a_mat[None, :, :] * s_a[:, None, :], axis=2)  # (PLANES, NP): (A S_l[:, a])_i
        tl.store(out_ptr + planes, tl.sum(s_b * v, axis=1), mask=live)


class RotorAngleGrad:
    """`kernel(c, suffix, layout)`: d loss / d theta (k,) into a buffer made once (the same tensor every call,
    overwritten). Allocates nothing and reads nothing back, so a CUDA graph captures it; `launches` counts the
    launches (a Python int)."""

    def __init__(self, layout: RotorLayout, like: Tensor) -> None:
        self.n, self.k, self.layers = layout.n, layout.index.shape[1], layout.layers
        self.index = layout.index[3].contiguous()
        self.out = like.new_zeros(self.k)
        self.np = triton.next_power_of_2(max(self.n, 2))
        self.planes = max(1, min(triton.next_power_of_2(max(self.k, 1)), TILE // (self.np * self.np)))
        self.launches = 0

    def __call__(self, c: Tensor, suffix: Tensor, layout: RotorLayout) -> Tensor:
        n = self.n
        row_major(c, suffix)
        sized(self.out.dtype, c=(c, (n, n)), suffix=(suffix, (self.layers + 1, n, n)))
        if layout.index.shape[1] != self.k or layout.n != n:  # a layout is fixed by (n, k): the sizes say which
            raise ValueError(
                f"rotor angle kernel: built for {self.k} planes of {n} coordinates, given {layout.index.shape[1]} "
                f"of {layout.n}"
            )
        rotor_angle_grad_kernel[(1,)](self.out, c, suffix, self.index, self.k, n, NP=self.np, PLANES=self.planes)
        self.launches += 1
        return self.out
