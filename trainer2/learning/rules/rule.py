"""What a learning rule provides, and the rule's config section (`RuleConfig`).

A rule is a class with two members: `scheme(dynamics)`, the nudge scheme (trainer2.physics.nudge) that tells the
relaxation which phases follow the free phase (row blocks of the nudged workspace, each a force with a signed strength
or a clamp; or the adjoint system), and `gradients`, the gradient source (trainer2.learning.gradients) that runs them
and forms the gradient. Built-in rules have short names; a rule of your own is named by its dotted path
(`rule: my_rules.Hebbian`), and the name as written goes into config.yaml and the checkpoint.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

from pydantic import Field, field_validator
from torch import Tensor

from trainer2.components import ComponentError, resolve
from trainer2.learning.gradients import StepResult
from trainer2.physics.nudge import NudgeScheme
from trainer2.physics.relaxation import DynamicsConfig, Relaxation
from trainer2.section import Section, short_repr


class Rule(Protocol):
    kind: ClassVar[str]  # the name the config's `rule` and the registry use

    @staticmethod
    def scheme(dynamics: DynamicsConfig) -> NudgeScheme:
        """The phases after the free phase, from the dynamics section (beta_nudge)."""

    @staticmethod
    def gradients(relax: Relaxation, inputs: Tensor, targets: Tensor) -> StepResult:
        """The gradient source: every phase of the batch and a gradient (batch mean) per parameter name."""


class RuleConfig(Section):
    """The learning rule."""

    rule: str = Field(
        "ep",
        description="How the gradient is formed: 'ep' (nudged at +beta and -beta, the centred estimate), 'ep_positive' "
        "/ 'ep_negative' (one nudged phase at +beta / -beta), 'chl' (contrastive Hebbian: q clamped to the target), "
        "'coupled' (coupled learning: q clamped to q0 +- beta_nudge (target - q0)), 'rbp' (recurrent backprop: the "
        "exact gradient from the adjoint system); or a dotted path module.Class to your own (docs/rules.md). "
        "--symmetric_nudge / --no-symmetric_nudge are the old spellings of ep / ep_positive.",
    )

    @field_validator("rule")
    @classmethod
    def _rule(cls, v: str) -> str:
        resolve("rule", v)  # a ComponentError (a ValueError) names the built-ins, or what is wrong with a dotted path
        return v


def rule_scheme(rule: str, dynamics: DynamicsConfig) -> NudgeScheme:
    """The nudge scheme of the rule named `rule` for this dynamics section; anything else its scheme() returns is a
    ComponentError naming the rule (a relaxation handed None would run the default rule's phases instead)."""
    scheme = resolve("rule", rule).scheme(dynamics)
    if not isinstance(scheme, NudgeScheme):
        raise ComponentError(
            f"rule {rule!r}: scheme(dynamics) returned {short_repr(scheme)} ({type(scheme).__name__}); it must return "
            "a trainer2.physics.nudge.NudgeScheme, e.g. NudgeScheme.centred(dynamics.beta_nudge, "
            "own_argmax=dynamics.own_argmax) (docs/rules.md)"
        )
    return scheme
