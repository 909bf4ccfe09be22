"""The kinds of coupling an energy is built from, by the name the config's `layers` entries use."""

from __future__ import annotations

from trainer2.physics.couplings.coupling import Coupling
from trainer2.physics.couplings.dense import Dense

KINDS: dict[str, type] = {Dense.kind: Dense}

__all__ = ["KINDS", "Coupling", "Dense"]
