"""Recurrent backprop (Almeida 1987; Pineda 1987): the exact gradient of the loss at the free equilibrium, by relaxing
the linear adjoint system with the couplings' analytic transposes and the box's masks (trainer2.physics.adjoint), then
each coupling's bilinear statistic of the equilibrium and the adjoint. No nudged phase; the adjoint takes nudge_steps
sweeps in the relaxation's order and is timed as the nudged phase. No autograd."""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor

from trainer2.learning.gradients import StepResult, step_result
from trainer2.physics.adjoint import adjoint_grads
from trainer2.physics.nudge import NudgeScheme
from trainer2.physics.relaxation import DynamicsConfig, Relaxation


def rbp_gradients(relax: Relaxation, inputs: Tensor, targets: Tensor) -> StepResult:
    """Free phase, the adjoint at s0, then dloss/dtheta for the energy and the embedding, and the readout's exact
    gradient from its cost."""
    m = relax.m
    with relax.phase("free"):
        free = relax.free_phase(inputs, targets)
    with relax.phase("nudged"):
        mu = relax.adjoint_phase(free)
    with relax.phase("update"):
        grads, gx = adjoint_grads(relax.s0.s, mu, free.x, m.energy, relax.batch, input_grad=m.emb is not None)
        return step_result(relax, free, inputs, grads, gx)


class RBP:
    """The adjoint scheme: no nudged workspace, the adjoint's instead."""

    kind: ClassVar[str] = "rbp"
    gradients = staticmethod(rbp_gradients)

    @staticmethod
    def scheme(dynamics: DynamicsConfig) -> NudgeScheme:
        return NudgeScheme((), "adjoint", RBP.kind)
