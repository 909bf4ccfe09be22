"""The nudge scheme: the betas of the nudged phases, which rows hold s+ and s-, and the EP divisor.

Symmetric nudging (the default) relaxes +beta and -beta phases from the free equilibrium, stacked as one
workspace of 2B rows, and estimates the gradient as (dE/dtheta(s+) - dE/dtheta(s-)) / 2 beta (bias O(beta^2));
one-sided nudging relaxes +beta only and uses the free equilibrium as s- (divisor beta, bias O(beta)).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class NudgeScheme:
    """beta > 0 and whether the -beta phase runs."""

    beta: float
    symmetric: bool

    @property
    def betas(self) -> list[float]:
        """The nudging strength of each block of B rows of the stacked nudged workspace, in row order."""
        return [self.beta, -self.beta] if self.symmetric else [self.beta]

    @property
    def phases(self) -> int:
        """Nudged phases per batch (row blocks of the nudged workspace)."""
        return len(self.betas)

    @property
    def divisor(self) -> float:
        """The EP estimate is (dE/dtheta(s+) - dE/dtheta(s-)) / divisor."""
        return (2 if self.symmetric else 1) * self.beta

    def plus(self, nudged: list[Tensor], batch: int) -> list[Tensor]:
        """s+, as views of the stacked nudged state: rows [0, B)."""
        return [t[:batch] for t in nudged]

    def minus(self, nudged: list[Tensor], free: list[Tensor], batch: int) -> list[Tensor]:
        """s-: rows [B, 2B) of the stacked nudged state, or the free equilibrium with one-sided nudging."""
        return [t[batch:] for t in nudged] if self.symmetric else free
