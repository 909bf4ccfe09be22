"""Contrastive Hebbian learning (Movellan 1991; O'Reilly 1996): a second phase with the output clamped to the target
(the cost's target point, c_y) while the hidden layers relax, and the estimate dE/dtheta(clamped) - dE/dtheta(free).
It is not a small perturbation, so it follows the gradient of E(clamped) - E(free) rather than of the loss; beta_nudge
is not used."""

from __future__ import annotations

from typing import ClassVar

from trainer2.learning.gradients import ep_gradients
from trainer2.physics.nudge import NudgeScheme
from trainer2.physics.relaxation import DynamicsConfig


class CHL:
    """One clamped phase at strength 1 (q = q0 + 1 (target - q0)); s- is the free equilibrium, divisor 1."""

    kind: ClassVar[str] = "chl"
    gradients = staticmethod(ep_gradients)

    @staticmethod
    def scheme(dynamics: DynamicsConfig) -> NudgeScheme:
        return NudgeScheme((1.0,), "clamp", CHL.kind, own_argmax=True)
