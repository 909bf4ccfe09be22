"""The layered, box-constrained Hopfield energy and its exact forces (no autograd).

State layers s = (h_1, ..., h_M, q) with h_0 = x clamped; layer i is driven by layer i-1 through
weights[i] (H_i, H_{i-1}) and bias[i] (H_i,); the last layer is the output coordinates q.

    E(s) = sum_i 1/2 |s_i|^2 - sum_i s_i . (W_i s_{i-1} + b_i)

Rows are examples: a layer is (B, H_i) and W_i s_{i-1} is s_{i-1} @ W_i^T.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class EnergyParams:
    """Couplings weights[i] (H_i, H_{i-1}) and biases[i] (H_i,) for i = 0..M; the last pair is (W_out, b_out)."""

    weights: list[Tensor]
    biases: list[Tensor]


def init_energy(sizes: list[int], out_scale: float, gen: torch.Generator, dtype: torch.dtype) -> EnergyParams:
    """Uniform(+-1/sqrt(fan_in)) couplings, W_out shrunk by out_scale so the energy starts convex; zero biases.

    sizes = [input_dim, H_1, ..., H_M, n].
    """
    weights, biases = [], []
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        bound = 1.0 / math.sqrt(fan_in) * (out_scale if i == len(sizes) - 2 else 1.0)
        weights.append((torch.rand(fan_out, fan_in, generator=gen, dtype=dtype) * 2 - 1) * bound)
        biases.append(torch.zeros(fan_out, dtype=dtype))
    return EnergyParams(weights, biases)


def energy(s: list[Tensor], x: Tensor, p: EnergyParams) -> Tensor:
    """E(s) per example (B,); for tests and diagnostics, not the hot loop."""
    inputs = [x, *s[:-1]]
    e = torch.zeros(x.shape[0], dtype=x.dtype, device=x.device)
    for si, below, w, b in zip(s, inputs, p.weights, p.biases):
        e = e + 0.5 * (si * si).sum(1) - (si * (below @ w.T + b)).sum(1)
    return e


def input_drive(x: Tensor, p: EnergyParams, out: Tensor) -> Tensor:
    """out (B, H_1) = W_1 x + b_1: the clamped input's pull on the first layer, fixed for a whole window."""
    return torch.addmm(p.biases[0], x, p.weights[0].T, out=out)


def forces(s: list[Tensor], drive: Tensor, p: EnergyParams, out: list[Tensor]) -> None:
    """out[i] = -dE/ds_i = -s_i + W_i s_{i-1} + b_i + W_{i+1}^T s_{i+1}, in place (allocation-free)."""
    last = len(s) - 1
    for i, si in enumerate(s):
        if i == 0:
            out[i].copy_(drive)
        else:
            torch.addmm(p.biases[i], s[i - 1], p.weights[i].T, out=out[i])
        if i < last:
            out[i].addmm_(s[i + 1], p.weights[i + 1])
        out[i].sub_(si)


def coupling_grads(
    s_plus: list[Tensor], s_minus: list[Tensor], x: Tensor, p: EnergyParams, scale: float
) -> tuple[list[Tensor], list[Tensor], Tensor]:
    """EP estimate (dE/dtheta(s+) - dE/dtheta(s-)) * scale for every weight, bias, and the input x.

    -dE/dW_i = s_i s_{i-1}^T, -dE/db_i = s_i, -dE/dx = W_1^T s_1; summed over the batch (callers
    fold 1/(beta B) into scale). Returns (weight grads, bias grads, per-example x grad (B, D)).
    """
    d1 = torch.sub(s_minus[0], s_plus[0]).mul_(scale)  # both phases share the clamped input x below the first layer
    gw, gb = [torch.mm(d1.T, x)], [d1.sum(0)]
    for sp, sm, bp, bm in zip(s_plus[1:], s_minus[1:], s_plus, s_minus):
        gw.append(torch.addmm(torch.mm(sm.T, bm), sp.T, bp, beta=scale, alpha=-scale))
        gb.append(torch.sub(sm, sp).sum(0).mul_(scale))
    return gw, gb, torch.mm(d1, p.weights[0])
