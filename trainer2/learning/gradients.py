"""Where a batch's gradients come from: the seam a `Trainer` is built with, and the contrastive estimate.

A gradient source is a function (relaxation, inputs, targets) -> StepResult that runs whatever phases
it needs on the relaxation and returns a gradient per named parameter; each learning rule (trainer2.learning.rules)
names one. `ep_gradients` is the contrastive estimate of every rule whose second phases are nudged or clamped (EP,
CHL, coupled learning): energy couplings get (dE/dtheta(s+) - dE/dtheta(s-)) / divisor from the relaxation's nudge
scheme (2 beta for centred EP); the readout gets the exact gradient of the loss at the free equilibrium from its cost.
No autograd: every gradient is written out analytically.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from trainer2.physics.readout import indicator
from trainer2.physics.relaxation import FreeState, Relaxation, WindowStats


@dataclass
class StepResult:
    """A gradient (batch mean) per parameter name, per-example loss (B,) in nats, class probabilities (B, V)
    and the window statistics."""

    grads: dict[str, Tensor]
    loss: Tensor
    probs: Tensor
    stats: WindowStats


class GradientSource(Protocol):
    def __call__(self, relax: Relaxation, inputs: Tensor, targets: Tensor) -> StepResult: ...


def embedding_grad(gx: Tensor, ids: Tensor, rows: int) -> Tensor:
    """(rows, E): row v sums the rows of gx (N, E) at the positions where ids (N,) is v, in a fixed order. On the CPU
    index_add_ (sequential). On CUDA index_add_'s atomics, and aten's embedding-gradient kernel above 3,072 ids (seen
    on an H100), add in a varying order and would break bitwise resume, so there it is a product with the (rows, N)
    indicator of ids, which also stays a product under torch.compile."""
    if gx.is_cuda:
        return torch.mm(indicator(torch.arange(rows, device=ids.device), ids, gx.dtype), gx)
    return gx.new_zeros(rows, gx.shape[1]).index_add_(0, ids, gx)


def ep_gradients(relax: Relaxation, inputs: Tensor, targets: Tensor) -> StepResult:
    """Free phase, the nudge scheme's phases (+beta and -beta for centred EP), then the contrastive estimate for the
    energy and the embedding."""
    m = relax.m
    with relax.phase("free"):
        free = relax.free_phase(inputs, targets)
    with relax.phase("nudged"):
        relax.nudged_phases(free)
    with relax.phase("update"):  # forming the gradients counts as part of the update
        scale = 1.0 / (relax.nudge.divisor * relax.batch)
        # Only a learned embedding needs the input's gradient (on images it is a transposed convolution per window).
        at = relax.s0.s if relax.nudge.on_free_piece else None  # both phases on s0's piece of E, or each on its own
        stat = relax.ep_statistic  # energy.ep_grads, or its Triton kernel beside the Triton window
        grads, gx = stat(relax.s_plus, relax.s_minus, free.x, m.energy, scale, at, input_grad=m.emb is not None)
        return step_result(relax, free, inputs, grads, gx)


def step_result(
    relax: Relaxation, free: FreeState, inputs: Tensor, grads: dict[str, Tensor], gx: Tensor | None
) -> StepResult:
    """The batch's StepResult from the energy's gradients and the input's (gx, or None): the readout's exact gradients
    at s0 from its cost, and the embedding's gathered from gx (text)."""
    m = relax.m
    res = relax.readout_grads(free)
    grads.update(g_diag=res.grads.g_diag, theta=res.grads.theta, protos=res.grads.protos, r_sc=res.grads.r_sc)
    if gx is not None:
        grads["emb"] = embedding_grad(gx.reshape(-1, m.emb.shape[1]), inputs.flatten(), m.emb.shape[0])
    return StepResult(grads, res.loss, res.probs, relax.window_stats())
