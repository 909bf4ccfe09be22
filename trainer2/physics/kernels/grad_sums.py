"""The first of the fused update's two launches: partial sums of the flat gradient, from which every program of the
update (kernels/fused_update.py) decides whether the whole update is dropped. Its torch reference is the
`torch.isfinite(grad.sum())` of trainer2.learning.update.flat_update.

A launch has no grid-wide barrier, so the drop decision (a reduction over every gradient element, which every element's
update waits for) cannot sit inside the update's own launch without each program re-reading the whole gradient."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def grad_sums_kernel(grad_ptr, sums_ptr, count_ptr, snap_ptr, n, per_program, BLOCK: tl.constexpr):
    """sums[pid] = the sum of the gradient's elements [pid * per_program, (pid + 1) * per_program) (NaN and inf carry
    through, as in torch's sum); program 0 also copies Adam's applied-update count to snap, which every program of the
    update reads while its program 0 rewrites the count."""
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=grad_ptr.dtype.element_ty)
    for k in range(0, per_program, BLOCK):
        offs = pid * per_program + k + tl.arange(0, BLOCK)
        acc += tl.load(grad_ptr + offs, mask=offs < n, other=0.0)
    tl.store(sums_ptr + pid, tl.sum(acc, axis=0))
    if pid == 0:
        tl.store(snap_ptr, tl.load(count_ptr))
