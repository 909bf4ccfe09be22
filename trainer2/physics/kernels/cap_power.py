"""The spectral cap of a dense coupling in one Triton launch: the two normalised power-iteration steps from the
persistent vector u and the scaling of W that `Dense.cap_power` does in 19 torch operators. One program holds all of
W (R, C) in registers, which serves the presets' couplings between state layers (W_out: 16 x 256 to 32 x 1,024); a
larger W keeps the torch operators (`fits`).

Its torch reference is trainer2.physics.couplings.dense.Dense.cap_power; tests/test_cap_power.py compares the two.
The sums run in another order than torch's matrix-vector products, so the two agree to rounding, not bitwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from trainer2.physics.kernels.chain import div_ieee, sqrt_ieee

MAX_BYTES = 128 * 1024  # of W's power-of-two block: 32,768 float32 numbers, 64 a thread at 16 warps


def fits(weight: Tensor) -> bool:
    """Whether one program can hold `weight` (a contiguous 2-d float matrix) in its power-of-two block."""
    if weight.dim() != 2 or not weight.is_contiguous():
        return False
    rows, cols = (triton.next_power_of_2(n) for n in weight.shape)
    return rows * cols * weight.element_size() <= MAX_BYTES


@triton.jit
def cap_power_kernel(w_ptr, u_ptr, cap_ptr, R, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Two steps v = W^T u / |W^T u|, u = W v / |W v| (each norm at least 1e-12), then W *= min(cap / |W v|, 1)."""
    rows, cols = tl.arange(0, BLOCK_R), tl.arange(0, BLOCK_C)
    inside = (rows < R)[:, None] & (cols < C)[None, :]
    at = rows[:, None] * C + cols[None, :]
    w = tl.load(w_ptr + at, mask=inside, other=0.0)
    u = tl.load(u_ptr + rows, mask=rows < R, other=0.0)
    cap = tl.load(cap_ptr)
    sigma = cap  # a scalar of W's dtype; the steps set it
    for _ in tl.static_range(2):  # IEEE-rounded sqrt and division, as torch's (float32's default may approximate)
        v = tl.sum(w * u[:, None], axis=0)
        v = div_ieee(v, tl.maximum(sqrt_ieee(tl.sum(v * v, axis=0)), 1e-12))
        u = tl.sum(w * v[None, :], axis=1)
        sigma = tl.maximum(sqrt_ieee(tl.sum(u * u, axis=0)), 1e-12)
        u = div_ieee(u, sigma)
    tl.store(u_ptr + rows, u, mask=rows < R)
    tl.store(w_ptr + at, w * tl.minimum(div_ieee(cap, sigma), 1.0), mask=inside)


class CapPower:
    """The cap of one dense coupling's W (R, C) (a view of the flat parameters) at `cap`: call with its power vector
    u (R,), updated in place; one launch, no host sync. `launches` counts them (a Python int), as FusedUpdate's."""

    def __init__(self, weight: Tensor, cap: float) -> None:
        self.weight = weight
        self.cap = torch.tensor([cap], dtype=weight.dtype, device=weight.device)  # cap in W's dtype, as torch rounds it
        self.block = (triton.next_power_of_2(weight.shape[0]), triton.next_power_of_2(weight.shape[1]))
        held = self.block[0] * self.block[1]  # W's block and its products take a register each per thread: 64 at most
        self.warps = 4 if held <= 4096 else 8 if held <= 16384 else 16
        self.launches = 0

    def __call__(self, u: Tensor) -> None:
        (r, c), (br, bc) = self.weight.shape, self.block
        cap_power_kernel[(1,)](self.weight, u, self.cap, r, c, BLOCK_R=br, BLOCK_C=bc, num_warps=self.warps)
        self.launches += 1
