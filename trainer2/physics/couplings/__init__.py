"""The couplings an energy is built from: the `Coupling` protocol and the built-in kinds (found by name through
trainer2.components)."""

from __future__ import annotations

from trainer2.physics.couplings.conv import Conv
from trainer2.physics.couplings.conv1d import Conv1d
from trainer2.physics.couplings.coupling import Coupling
from trainer2.physics.couplings.dense import Dense

__all__ = ["Conv", "Conv1d", "Coupling", "Dense"]
