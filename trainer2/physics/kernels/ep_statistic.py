"""The EP statistic of a dense coupling in one Triton launch: dE/dW and dE/db at the two nudged states contracted over
the batch, scale (above- below-^T - above+ below+^T) and scale (above- - above+) summed, where torch's operators take
five (trainer2.physics.couplings.dense.Dense.ep_grads); for the coupling from the clamped input, both phases share x,
so one product of scale (above- - above+) with x, and that difference kept for the input's gradient.

Its torch reference is Dense.ep_grads and Dense.ep_grads_clamped (trainer2.physics.energy.ep_grads walks the
couplings); tests/test_ep_statistic.py compares the two: equal within rounding (the products add in another order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from trainer2.physics.couplings import Dense
from trainer2.physics.energy import Energy
from trainer2.physics.kernels.chain import mm, row_major, sized

BLOCK = 32  # rows of W (units above) and columns (units below) a program, and batch rows a step: tl.dot's >= 16


@triton.jit
def tile(ptr, rows, cols, n_rows, n_cols):
    """The (len(rows), len(cols)) tile of a contiguous (n_rows, n_cols) matrix, zero outside it."""
    inside = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    return tl.load(ptr + rows[:, None] * n_cols + cols[None, :], mask=inside, other=0.0)


@triton.jit
def ep_statistic_kernel(
    ap_ptr,  # (B, I) above at the + phase
    bp_ptr,  # (B, J) below at the + phase (the clamped input: never read)
    am_ptr,  # (B, I) above at the - phase
    bm_ptr,  # (B, J) below at the - phase (the clamped input x)
    gw_ptr,  # (I, J) out: the weight's statistic
    gb_ptr,  # (I,) out: the bias's
    d_ptr,  # (B, I) out, clamped only: scale (above- - above+), for the input's gradient
    scale_ptr,  # () float64: the statistic's scale
    rows,
    n_above,
    n_below,
    CLAMPED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (p, q): the statistic's rows [p BLOCK, (p + 1) BLOCK) and columns [q BLOCK, (q + 1) BLOCK), the
    batch added BLOCK rows a step; the programs of column block 0 write the bias (and d)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    dt = gw_ptr.dtype.element_ty
    scale = tl.load(scale_ptr).to(dt)
    acc = tl.zeros([BLOCK, BLOCK], dtype=dt)
    bias = tl.zeros([BLOCK], dtype=dt)
    first = tl.program_id(1) == 0
    for r0 in range(0, rows, BLOCK):
        r = r0 + tl.arange(0, BLOCK)
        a_minus = tile(am_ptr, r, i, rows, n_above)
        a_plus = tile(ap_ptr, r, i, rows, n_above)
        b_minus = tile(bm_ptr, r, j, rows, n_below)
        if CLAMPED:  # as ep_grads_clamped: d = (minus - plus) * scale, then d^T x and d's column sums
            d = (a_minus - a_plus) * scale
            acc += mm(tl.trans(d), b_minus)
            bias += tl.sum(d, axis=0)
            if first:
                keep = (r < rows)[:, None] & (i < n_above)[None, :]
                tl.store(d_ptr + r[:, None] * n_above + i[None, :], d, mask=keep)
        else:
            b_plus = tile(bp_ptr, r, j, rows, n_below)
            acc += mm(tl.trans(a_minus), b_minus) - mm(tl.trans(a_plus), b_plus)
            bias += tl.sum(a_minus - a_plus, axis=0)
    if not CLAMPED:
        acc = acc * scale
        bias = bias * scale
    inside = (i < n_above)[:, None] & (j < n_below)[None, :]
    tl.store(gw_ptr + i[:, None] * n_below + j[None, :], acc, mask=inside)
    if first:
        tl.store(gb_ptr + i, bias, mask=i < n_above)


def serves(energy: Energy) -> bool:
    """Every coupling is trainer2's Dense itself (a subclass may define its statistic otherwise)."""
    return all(type(c) is Dense for c in energy.couplings)


class EPStatistic:
    """`kernel(s_plus, s_minus, x, energy, scale, at, input_grad)`: trainer2.physics.energy.ep_grads for an energy of
    Dense couplings, one launch a coupling (the input's gradient, where asked for, one product more), at the scale it
    was built for (its device copy is made once; another scale is refused); `at` is not read (dense couplings are
    bilinear). `launches` counts the launches (a Python int)."""

    def __init__(self, scale: float, like: Tensor) -> None:
        self.scale = torch.tensor(scale, dtype=torch.float64, device=like.device)
        self.value = scale
        self.launches = 0

    def __call__(
        self,
        s_plus: list[Tensor],
        s_minus: list[Tensor],
        x: Tensor,
        e: Energy,
        scale: float,
        at: list[Tensor] | None,
        input_grad: bool = True,
    ) -> tuple[dict[str, Tensor], Tensor | None]:
        if scale != self.value:
            raise ValueError(f"EP statistic kernel: built for scale {self.value!r}, called with {scale!r}")
        grads: dict[str, Tensor] = {}
        gx = None
        for (b, a), c in zip(e.graph.edges, e.couplings):
            clamped = b < 0
            above_p, above_m = s_plus[a], s_minus[a]
            below_p, below_m = (x, x) if clamped else (s_plus[b], s_minus[b])
            row_major(above_p, above_m, below_p, below_m)
            (n_above, n_below), rows = c.weight.shape, above_p.shape[0]
            above, below = (above_p, (rows, n_above)), (below_p, (rows, n_below))
            sized(c.weight.dtype, above_plus=above, above_minus=(above_m, above[1]), below_plus=below)
            sized(c.weight.dtype, below_minus=(below_m, below[1]))
            gw = above_p.new_empty(n_above, n_below)
            gb = above_p.new_empty(n_above)
            d = above_p.new_empty(rows, n_above) if clamped else gb
            grid = (triton.cdiv(n_above, BLOCK), triton.cdiv(n_below, BLOCK))
            ep_statistic_kernel[grid](
                above_p, below_p, above_m, below_m, gw, gb, d, self.scale, rows, n_above, n_below,
                CLAMPED=clamped, BLOCK=BLOCK,
            )  # fmt: skip
            self.launches += 1
            grads[f"W_{c.name}"], grads[f"b_{c.name}"] = gw, gb
            if clamped and input_grad:
                gxk = torch.mm(d, c.weight)
                gx = gxk if gx is None else gx.add_(gxk)
        return grads, gx
