"""The retrieval cost: the geometric readout (metric, rotor, resistance, softmax over distances to the prototypes and
the memory bank), trainer2.physics.readout. -log p_y in nats; every readout parameter learns. In the fixed-point
window its nudge is the folded step (trainer2.physics.dynamics.readout_nudge), and the Triton nudged kernel runs it."""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor

from trainer2.physics.costs.cost import CostFrame, make_frame, prototype_target
from trainer2.physics.readout import (
    Candidates,
    ReadoutFrame,
    ReadoutParams,
    ReadoutResult,
    ReadoutScratch,
    RotorLayout,
    readout_force,
    readout_loss_and_grads,
    readout_scores,
)


class Retrieval:
    kind: ClassVar[str] = "retrieval"
    folded: ClassVar[bool] = True
    memory_bank: ClassVar[bool] = True
    uses_target: ClassVar[bool] = False

    @staticmethod
    def frame(
        params: ReadoutParams,
        readout: ReadoutFrame,
        cand: Candidates,
        num_classes: int,
        layout: RotorLayout,
        one_hot: bool,
    ) -> CostFrame:
        return make_frame(params, readout, cand, num_classes, layout, one_hot)

    @staticmethod
    def force(q: Tensor, f: CostFrame, mask: Tensor, target: Tensor, sc: ReadoutScratch, out: Tensor) -> Tensor:
        """dloss/dq through the metric (readout_force); the target rows are not read."""
        return readout_force(q, f.readout, mask, sc, out)

    target = staticmethod(prototype_target)

    @staticmethod
    def scores(q: Tensor, f: CostFrame, mask: Tensor, sc: ReadoutScratch) -> tuple[Tensor, Tensor]:
        return readout_scores(q, f.readout, f.cand, mask, f.num_classes, sc, f.one_hot)

    @staticmethod
    def loss_and_grads(q: Tensor, f: CostFrame, mask: Tensor, sc: ReadoutScratch) -> ReadoutResult:
        return readout_loss_and_grads(q, f.readout, f.cand, mask, f.num_classes, f.layout, sc, f.one_hot)
