"""Coupled learning (Stern et al. 2021): the output clamped a little way toward the target, to (1 - eta) q0 + eta
target, while the hidden layers relax; centred here: phases clamped at q0 + eta (target - q0) and q0 - eta (target -
q0), estimate (dE/dtheta(s+) - dE/dtheta(s-)) / 2 eta. eta is beta_nudge."""

from __future__ import annotations

from typing import ClassVar

from trainer2.learning.gradients import ep_gradients
from trainer2.physics.nudge import NudgeScheme
from trainer2.physics.relaxation import DynamicsConfig


class Coupled:
    """Two clamped phases at +eta and -eta stacked in one workspace of 2B rows."""

    kind: ClassVar[str] = "coupled"
    gradients = staticmethod(ep_gradients)

    @staticmethod
    def scheme(dynamics: DynamicsConfig) -> NudgeScheme:
        eta = dynamics.beta_nudge
        return NudgeScheme((eta, -eta), "clamp", Coupled.kind, dynamics.own_argmax)
