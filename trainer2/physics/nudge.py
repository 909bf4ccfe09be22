"""The nudge scheme: what a learning rule asks the relaxation to run after the free phase; which rows hold s+ and s-.

A scheme is a list of row blocks of the nudged workspace, one block of B rows per nudged phase, each with a signed
strength b, all of one kind:

    force    q is pulled by -b dloss/dq (EP: b = +beta and -beta, or one of them)
    clamp    q is held at q0 + b (target - q0) while the hidden layers relax (CHL: b = 1; coupled learning: +-eta)
    adjoint  no nudged phase: the rule relaxes the linear adjoint system at s0 instead (recurrent backprop)

The blocks never interact, so they run as one stacked workspace with a per-row strength: one set of operators for all.
The contrastive estimate is (dE/dtheta(s+) - dE/dtheta(s-)) / (b+ - b-), where s+ is the block of the largest strength
and s- the one of the smallest, the free equilibrium counting as strength 0: (+beta, -beta) is centred EP (bias
O(beta^2)), (+beta) alone takes s0 as s- and (-beta) alone s0 as s+ (divisor beta, bias O(beta)).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

KINDS = ("force", "clamp", "adjoint")


@dataclass(frozen=True)
class NudgeScheme:
    """betas: the signed strength of each block of B rows of the stacked nudged workspace, in row order; kind: "force",
    "clamp" or "adjoint" (no blocks); rule: the name of the rule that asked for it (messages only); own_argmax: a
    piecewise energy term (max pooling) is differentiated on each phase's own piece (CHL's finite contrast; the small
    nudges by default, `maxpool_argmax: own`) rather than on the free equilibrium's (`free`)."""

    betas: tuple[float, ...]
    kind: str = "force"
    rule: str = "ep"
    own_argmax: bool = True  # what every rule did before maxpool_argmax; a rule of the user's that omits it keeps it

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"nudge kind must be one of {list(KINDS)}, got {self.kind!r}")
        if (self.kind == "adjoint") != (not self.betas):
            raise ValueError(f"{self.kind} scheme: {'no' if self.kind == 'adjoint' else 'at least one'} nudged phase")

    @staticmethod
    def centred(beta: float, rule: str = "ep", own_argmax: bool = True) -> "NudgeScheme":
        """+beta and -beta, the centred EP estimate (the default rule's)."""
        return NudgeScheme((beta, -beta), "force", rule, own_argmax)

    @property
    def on_free_piece(self) -> bool:
        """A piecewise term's statistic is taken on the free equilibrium's piece (ep_grads is handed `at`): recurrent
        backprop's s0 always, the nudged phases with `maxpool_argmax: free`."""
        return self.kind == "adjoint" or not self.own_argmax

    @property
    def phases(self) -> int:
        """Nudged phases per batch (row blocks of the nudged workspace); 0 for the adjoint."""
        return len(self.betas)

    @property
    def clamp(self) -> bool:
        return self.kind == "clamp"

    def sides(self) -> tuple[int | None, int | None]:
        """The blocks of s+ (largest strength) and s- (smallest); None is the free equilibrium, strength 0."""
        strengths = [(0.0, None), *((b, i) for i, b in enumerate(self.betas))]
        return max(strengths, key=lambda p: p[0])[1], min(strengths, key=lambda p: p[0])[1]

    def strength(self, block: int | None) -> float:
        return 0.0 if block is None else self.betas[block]

    @property
    def divisor(self) -> float:
        """The contrastive estimate is (dE/dtheta(s+) - dE/dtheta(s-)) / divisor: b+ - b- (2 beta centred)."""
        plus, minus = self.sides()
        return self.strength(plus) - self.strength(minus)

    def side(self, block: int | None, nudged: list[Tensor], free: list[Tensor], batch: int) -> list[Tensor]:
        """A block's states as views of the stacked nudged state (rows [block B, (block + 1) B)), or the free state."""
        return free if block is None else [t[block * batch : (block + 1) * batch] for t in nudged]

    def plus(self, nudged: list[Tensor], free: list[Tensor], batch: int) -> list[Tensor]:
        """s+: rows [0, B) of the stacked nudged state for centred EP."""
        return self.side(self.sides()[0], nudged, free, batch)

    def minus(self, nudged: list[Tensor], free: list[Tensor], batch: int) -> list[Tensor]:
        """s-: rows [B, 2B) for centred EP, the free equilibrium with one +beta phase."""
        return self.side(self.sides()[1], nudged, free, batch)
