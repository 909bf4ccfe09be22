"""The kinds of coupling an energy is built from, by the name the config's `layers` entries use."""

from __future__ import annotations

from trainer2.physics.couplings.conv import Conv
from trainer2.physics.couplings.coupling import Coupling
from trainer2.physics.couplings.dense import Dense

KINDS: dict[str, type] = {Dense.kind: Dense, Conv.kind: Conv}

__all__ = ["KINDS", "Conv", "Coupling", "Dense"]
