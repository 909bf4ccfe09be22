"""The update of every parameter over the flat parameter buffer in one Triton launch (after grad_sums_kernel, which sums
the gradient for the drop decision): heavy-ball or Nesterov momentum or Adam, the dropped-update mask, weight decay,
per-element learning-rate multipliers, the subnormal flush of the moments, and the readout's clamps (g_diag to [g_min,
g_max], r_sc >= r_min, theta wrapped to [-pi, pi)). The spectral cap's power iterations, products of the weight matrices
rather than elementwise work, follow in launches of their own (kernels/cap_power.py, one per dense coupling that fits
one program; the couplings' own `cap_power` otherwise).

Its torch reference is trainer2.learning.update.flat_update followed by trainer2.physics.machine.clamp_readout, the
torch update this replaces; tests/test_fused_update.py compares the two. The kernel repeats their operations in their
order and rounding (torch's lerp and addcmul round once on the CPU, so they are FMAs here), except where the last bit
can differ: Adam's bias corrections b^t are exp2(t log2 b) in float64 rounded to the parameters' dtype, where torch
calls pow (Triton has pow only in CUDA's libdevice, which its interpreter cannot run); Adam's sqrt is correctly rounded
here (as CUDA's), torch's vectorised CPU sqrt is not always; and on the GPU Triton fuses a multiply and an add that
torch's separate kernels round twice (momentum's buf * mu + grad, and Nesterov's step). Heavy-ball and Nesterov momentum
are bitwise equal in Triton's interpreter; docs/triton.md has the figures.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from trainer2.physics.kernels.chain import div_ieee, sqrt_ieee
from trainer2.physics.kernels.grad_sums import grad_sums_kernel

BLOCK = 1024  # parameters per program of the update
SUM_BLOCK = 4096  # gradient elements per step of a grad_sums program
MAX_SUMS = 1024  # at most this many partial sums, which every update program adds up
# The constants, in this order, in one float64 tensor (Triton passes a Python float as float32); the kernel rounds each
# to the parameters' dtype, as torch rounds a Python number in a tensor-scalar operation.
CONSTS = ("1-mu", "mu-1", "1-b2", "eps", "log2 mu", "log2 b2", "g_min", "g_max", "r_min", "pi", "2pi", "tiny", "mu")


@triton.jit
def lerp(a, b, w):
    """torch.lerp(a, b, w) for a scalar weight, as torch computes it: a + w (b - a) for |w| < 0.5, else
    b - (b - a)(1 - w), each a fused multiply-add (as torch's CPU kernel)."""
    d = b - a
    return tl.where(tl.abs(w) < 0.5, tl.fma(w, d, a), tl.fma(w - 1.0, d, b))


@triton.jit
def power(t, log2_b):
    """b^t for the applied-update count t (the parameters' dtype): exp2(t log2 b) in float64, rounded back."""
    return tl.exp2(t.to(tl.float64) * log2_b).to(t.dtype)


@triton.jit
def flushed(x, tiny):
    """torch.hardshrink(x, tiny): |x| <= tiny (subnormals and zeros) becomes +0; NaN and inf keep their bits."""
    return tl.where((x >= -tiny) & (x <= tiny), 0.0, x)


@triton.jit
def fused_update_kernel(
    param_ptr,
    grad_ptr,
    bufs_ptr,
    sq_ptr,
    step_ptr,
    mult_ptr,
    decay_ptr,
    sums_ptr,
    n_sums,
    snap_ptr,
    lr_ptr,
    count_ptr,
    dropped_ptr,
    ok_ptr,
    c_ptr,
    n,
    gd_lo,
    gd_hi,
    th_lo,
    th_hi,
    rs_lo,
    rs_hi,
    ADAM: tl.constexpr,
    NESTEROV: tl.constexpr,
    HAS_MULT: tl.constexpr,
    HAS_DECAY: tl.constexpr,
    BLOCK: tl.constexpr,
    SUMS: tl.constexpr,
):
    pid = tl.program_id(0)
    dt = param_ptr.dtype.element_ty
    # ok = 1 unless the gradient has a non-finite entry (its sum is then NaN or inf, as torch's isfinite(grad.sum()))
    total = tl.zeros([SUMS], dtype=dt)
    for k in range(0, n_sums, SUMS):
        i = k + tl.arange(0, SUMS)
        total += tl.load(sums_ptr + i, mask=i < n_sums, other=0.0)
    s = tl.sum(total, axis=0)
    ok = tl.where(s - s == 0.0, 1.0, 0.0).to(dt)
    lr = tl.load(lr_ptr)

    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    p = tl.load(param_ptr + offs, mask=inside, other=0.0)
    g = tl.load(grad_ptr + offs, mask=inside, other=0.0)
    if HAS_DECAY:
        g = tl.fma(tl.load(decay_ptr + offs, mask=inside, other=0.0), p, g)  # addcmul_(decay, param)
    g = tl.where(g - g == 0.0, g, 0.0) * ok  # nan_to_num_ then mul_(ok): all zeros when dropped
    m = tl.load(bufs_ptr + offs, mask=inside, other=0.0)
    if ADAM:
        v = lerp(tl.load(sq_ptr + offs, mask=inside, other=0.0), g * g, ok * tl.load(c_ptr + 2).to(dt))
        m = lerp(m, g, ok * tl.load(c_ptr + 0).to(dt))
        count = tl.load(snap_ptr) + ok
        t = tl.maximum(count, 1.0)
        root_bc2 = sqrt_ieee(1.0 - power(t, tl.load(c_ptr + 5)))
        step = div_ieee(m, sqrt_ieee(v) + root_bc2 * tl.load(c_ptr + 3).to(dt))
        step = step * div_ieee(lr * ok * root_bc2, 1.0 - power(t, tl.load(c_ptr + 4)))
    else:
        m = m * (1.0 + ok * tl.load(c_ptr + 1).to(dt)) + g  # decay by momentum, or keep when dropped (g is 0 then)
        if NESTEROV:
            step = (m * tl.load(c_ptr + 12).to(dt) + g) * (lr * ok)  # the step looks ahead along the new buf
        else:
            step = m * (lr * ok)
    if HAS_MULT:
        step = step * tl.load(mult_ptr + offs, mask=inside, other=0.0)
    p = p - step

    # The readout's clamps (project_constraints' first half), on its elements of the flat buffer; NaN stays NaN
    lo, hi = tl.load(c_ptr + 6).to(dt), tl.load(c_ptr + 7).to(dt)
    p = tl.where((offs >= gd_lo) & (offs < gd_hi) & (p == p), tl.minimum(tl.maximum(p, lo), hi), p)
    p = tl.where((offs >= rs_lo) & (offs < rs_hi) & (p == p), tl.maximum(p, tl.load(c_ptr + 8).to(dt)), p)
    pi, two_pi = tl.load(c_ptr + 9).to(dt), tl.load(c_ptr + 10).to(dt)
    r = (p + pi) % two_pi  # fmod, then torch.remainder's sign fix for a positive divisor
    p = tl.where((offs >= th_lo) & (offs < th_hi), tl.where(r < 0.0, r + two_pi, r) - pi, p)

    tiny = tl.load(c_ptr + 11).to(dt)
    tl.store(param_ptr + offs, p, mask=inside)
    tl.store(bufs_ptr + offs, flushed(m, tiny), mask=inside)
    tl.store(step_ptr + offs, step, mask=inside)
    if ADAM:
        tl.store(sq_ptr + offs, flushed(v, tiny), mask=inside)
    if pid == 0:
        tl.store(ok_ptr, ok)
        tl.store(dropped_ptr, tl.load(dropped_ptr) + (1.0 - ok))
        if ADAM:
            tl.store(count_ptr, count)


def constants(
    momentum: float, beta2: float, eps: float, g_min: float, g_max: float, r_min: float, dtype: torch.dtype
) -> list[float]:
    """The kernel's constants in CONSTS order; the logarithms are of mu and b2 as rounded to `dtype` (torch raises those
    roundings to the power t), in float64, so b^t keeps the dtype's precision."""

    def log2(b: float) -> float:
        b = torch.tensor(b, dtype=dtype).item()
        return math.log2(b) if b > 0 else -math.inf  # 0^t = 0 for t >= 1: exp2(-inf)

    return [
        1.0 - momentum,
        momentum - 1.0,
        1.0 - beta2,
        eps,
        log2(momentum),
        log2(beta2),
        g_min,
        g_max,
        r_min,
        math.pi,
        2 * math.pi,
        torch.finfo(dtype).tiny,
        momentum,
    ]


class FusedUpdate:
    """`update(param, grad, bufs, sq, count, lr, dropped, mult, decay, step)` -> ok: one step of every parameter over
    the flat (P,) buffers in two launches, the same arguments and effect as flat_update followed by clamp_readout (grad
    is only read here; step receives the applied step; ok, a 0-dim tensor this object owns, is 1 when applied, 0 when
    dropped). Scratch is allocated once, so a call allocates nothing, reads nothing back and can be captured in a CUDA
    graph. `launches` counts the launches (a Python int), so a test can prove the kernels ran."""

    def __init__(
        self,
        flat: Tensor,
        adam: bool,
        nesterov: bool,
        momentum: float,
        beta2: float,
        eps: float,
        g_diag: slice,
        theta: slice,
        r_sc: slice,
        g_min: float,
        g_max: float,
        r_min: float,
    ) -> None:
        self.n, self.adam, self.nesterov = flat.numel(), adam, nesterov
        self.per_program = SUM_BLOCK * triton.cdiv(triton.cdiv(self.n, MAX_SUMS), SUM_BLOCK)
        self.n_sums = triton.cdiv(self.n, self.per_program)
        self.programs = triton.cdiv(self.n, BLOCK)  # of the update's launch
        self.sums = flat.new_zeros(self.n_sums)
        self.snap, self.ok = flat.new_zeros(()), flat.new_ones(())
        consts = constants(momentum, beta2, eps, g_min, g_max, r_min, flat.dtype)
        self.consts = torch.tensor(consts, dtype=torch.float64, device=flat.device)
        self.spans = (g_diag.start, g_diag.stop, theta.start, theta.stop, r_sc.start, r_sc.stop)
        self.launches = 0

    def __call__(
        self,
        param: Tensor,
        grad: Tensor,
        bufs: Tensor,
        sq: Tensor,
        count: Tensor,
        lr: Tensor,
        dropped: Tensor,
        mult: Tensor | None,
        decay: Tensor | None,
        step: Tensor,
    ) -> Tensor:
        flat = [t for t in (param, grad, bufs, step, mult, decay, *((sq,) if self.adam else ())) if t is not None]
        if any(t.shape != (self.n,) or not t.is_contiguous() or t.dtype != param.dtype for t in flat):
            raise ValueError(f"fused update: every flat buffer must be a contiguous ({self.n},) {param.dtype} tensor")
        grad_sums_kernel[(self.n_sums,)](grad, self.sums, count, self.snap, self.n, self.per_program, BLOCK=SUM_BLOCK)
        fused_update_kernel[(self.programs,)](
            param,
            grad,
            bufs,
            sq if self.adam else bufs,  # never read without Adam
            step,
            param if mult is None else mult,  # never read without multipliers
            param if decay is None else decay,
            self.sums,
            self.n_sums,
            self.snap,
            lr,
            count,
            dropped,
            self.ok,
            self.consts,
            self.n,
            *self.spans,
            ADAM=self.adam,
            NESTEROV=self.nesterov,
            HAS_MULT=mult is not None,
            HAS_DECAY=decay is not None,
            BLOCK=BLOCK,
            SUMS=MAX_SUMS,
        )
        self.launches += 2
        return self.ok
