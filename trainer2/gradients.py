"""Where a batch's gradients come from: the seam a `Trainer` is built with, and its default, the EP estimate.

A gradient source is a function (relaxation, inputs, targets) -> StepResult that runs whatever phases
it needs on the relaxation and returns a gradient per named parameter. Energy couplings get the
symmetric EP estimate (dE/dtheta(s+) - dE/dtheta(s-)) / 2 beta; the readout gets the exact gradient
of the loss at the free equilibrium. No autograd: every gradient is written out analytically.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from trainer2.energy import coupling_grads
from trainer2.geometry import readout_loss_and_grads
from trainer2.relaxation import Relaxation, WindowStats


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


def ep_gradients(relax: Relaxation, inputs: Tensor, targets: Tensor) -> StepResult:
    """Free phase, nudged phase(s) at +beta (and -beta), then the EP estimate for the energy and the embedding."""
    cfg, m, ws = relax.cfg, relax.m, relax.ws
    with relax.phase("free"):
        free = relax.free_phase(inputs, targets)
        stats = relax.free_stats()
        ws.obs.zero_()
    with relax.phase("nudged"):
        relax.nudged_phase(free.frame, cfg.beta_nudge, relax.s_plus)
        if cfg.symmetric_nudge:
            relax.nudged_phase(free.frame, -cfg.beta_nudge, relax.s_minus)
            s_minus, b, phases = relax.s_minus, 2 * cfg.beta_nudge, 2
        else:
            s_minus, b, phases = relax.s0, cfg.beta_nudge, 1
    with relax.phase("update"):  # forming the gradients counts as part of the update
        gw, gb, gx = coupling_grads(relax.s_plus.s, s_minus.s, free.x, m.energy, 1.0 / (b * relax.batch))
        res = readout_loss_and_grads(relax.s0.s[-1], free.frame, free.cand, targets, m.num_classes, m.layout, m.readout.theta)
        grads = {**m.energy_names(gw, gb), "g_diag": res.grads.g_diag, "theta": res.grads.theta,
                 "protos": res.grads.protos, "r_sc": res.grads.r_sc}
        if m.emb is not None:
            grads["emb"] = torch.zeros_like(m.emb).index_add_(0, inputs.flatten(), gx.reshape(-1, m.emb.shape[1]))
        return StepResult(grads, res.loss, res.probs, WindowStats(**stats, lior_nudge=ws.obs.lior.mean() / phases))
