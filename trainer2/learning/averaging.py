"""Weight averaging: an exponential moving average of the parameters, kept as a second machine that evaluation reads.

After every update, `average <- decay * average + (1 - decay) * parameters` (one `lerp_` over the flat buffer, inside
the batch step, so a captured graph or a compiled step runs it too). Training never reads the average: the run's
arithmetic is the same with or without it. The constraints hold for the average as well (a spectral norm below a cap
and the readout's clamps are convex), so it is a machine like any other. Polyak & Juditsky 1992; timm's ModelEmaV2.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from trainer2.physics.machine import Machine, move_machine

PREFIX = "average."  # checkpoint keys of the averaged parameters: average.<parameter name>


@dataclass(frozen=True)
class WeightAverage:
    """The averaged parameters as a machine of their own (`machine.flat` is the average, (P,)), and the decay per
    window."""

    machine: Machine
    decay: float

    @staticmethod
    def of(machine: Machine, decay: float) -> "WeightAverage":
        """An average of `machine`'s parameters that starts at their current values."""
        return WeightAverage(move_machine(machine, machine.flat.device), decay)

    def update(self, flat: Tensor) -> None:
        """Move the average toward the parameters `flat` (P,) by 1 - decay; no allocation, no host sync."""
        self.machine.flat.lerp_(flat, 1.0 - self.decay)

    def begun_anew(self, loaded: dict[str, Tensor], flat: Tensor) -> bool:
        """After a resume from the tensors `loaded`: when they hold no average (a run with ema_decay 0, or older),
        start it at the resumed parameters `flat` and return True."""
        if set(self.tensors()) <= loaded.keys():
            return False
        self.machine.flat.copy_(flat)
        return True

    def tensors(self) -> dict[str, Tensor]:
        """The averaged parameters by checkpoint key (views that loading copies into)."""
        return {PREFIX + n: v for n, v in self.machine.named_params().items()}


def average_keys(machine: Machine) -> frozenset[str]:
    """The checkpoint keys an average of `machine` would have: optional on load, as checkpoints written without
    averaging (or before it existed) hold none."""
    return frozenset(PREFIX + n for n in machine.named_params())
