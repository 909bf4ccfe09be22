"""Equilibrium propagation (Scellier & Bengio 2017): the output nudged toward lower loss by a force -beta dloss/dq,
the gradient estimated from the change of dE/dtheta. Centred (Laborieux et al. 2021): phases at +beta and -beta,
(dE/dtheta(s+) - dE/dtheta(s-)) / 2 beta, bias O(beta^2); positive / negative: one phase at +beta (or -beta), the free
equilibrium on the other side, divisor beta, bias O(beta)."""

from __future__ import annotations

from typing import ClassVar

from trainer2.learning.gradients import ep_gradients
from trainer2.physics.nudge import NudgeScheme
from trainer2.physics.relaxation import DynamicsConfig


class EP:
    """Centred EP, the default rule: +beta and -beta stacked in one workspace of 2B rows."""

    kind: ClassVar[str] = "ep"
    gradients = staticmethod(ep_gradients)

    @staticmethod
    def scheme(dynamics: DynamicsConfig) -> NudgeScheme:
        return NudgeScheme.centred(dynamics.beta_nudge, EP.kind, dynamics.own_argmax)


class EPPositive:
    """One nudged phase at +beta; s- is the free equilibrium."""

    kind: ClassVar[str] = "ep_positive"
    gradients = staticmethod(ep_gradients)

    @staticmethod
    def scheme(dynamics: DynamicsConfig) -> NudgeScheme:
        return NudgeScheme((dynamics.beta_nudge,), "force", EPPositive.kind, dynamics.own_argmax)


class EPNegative:
    """One nudged phase at -beta; s+ is the free equilibrium."""

    kind: ClassVar[str] = "ep_negative"
    gradients = staticmethod(ep_gradients)

    @staticmethod
    def scheme(dynamics: DynamicsConfig) -> NudgeScheme:
        return NudgeScheme((-dynamics.beta_nudge,), "force", EPNegative.kind, dynamics.own_argmax)
