"""The squared-error cost: loss 1/2 |q - c_y|^2 with the prototypes held fixed as class codes (learning them would let
every code and every output collapse to one point), prediction the nearest code, class scores softmax(-1/2 |q - c|^2).
Its reported loss is the log loss of those scores (nats); no readout parameter learns (metric, rotor and resistance
are retrieval's)."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from trainer2.physics.costs.cost import CostFrame, distance_scores, make_frame, prototype_target, zero_grads
from trainer2.physics.readout import (
    Candidates,
    ReadoutFrame,
    ReadoutParams,
    ReadoutResult,
    ReadoutScratch,
    RotorLayout,
)


class MSE:
    kind: ClassVar[str] = "mse"
    folded: ClassVar[bool] = False
    memory_bank: ClassVar[bool] = False
    uses_target: ClassVar[bool] = True

    @staticmethod
    def frame(
        params: ReadoutParams,
        readout: ReadoutFrame,
        cand: Candidates,
        num_classes: int,
        layout: RotorLayout,
        one_hot: bool,
    ) -> CostFrame:
        return make_frame(params, readout, cand, num_classes, layout, one_hot, euclidean=True)

    @staticmethod
    def force(q: Tensor, f: CostFrame, mask: Tensor, target: Tensor, sc: ReadoutScratch, out: Tensor) -> Tensor:
        """dloss/dq = q - c_y (one operator)."""
        return torch.sub(q, target, out=out)

    target = staticmethod(prototype_target)

    @staticmethod
    def scores(q: Tensor, f: CostFrame, mask: Tensor, sc: ReadoutScratch) -> tuple[Tensor, Tensor]:
        return distance_scores(q, f, mask, sc)

    @staticmethod
    def loss_and_grads(q: Tensor, f: CostFrame, mask: Tensor, sc: ReadoutScratch) -> ReadoutResult:
        loss, probs = distance_scores(q, f, mask, sc)
        return ReadoutResult(loss, probs, zero_grads(f.params))
