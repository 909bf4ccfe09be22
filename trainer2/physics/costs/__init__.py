"""The costs a machine's output can be scored by: the `Cost` protocol and the built-in kinds (found by name through
trainer2.components): retrieval (the geometric readout), mse and cross_entropy."""

from __future__ import annotations

from trainer2.physics.costs.cost import Cost, CostFrame

__all__ = ["Cost", "CostFrame"]
