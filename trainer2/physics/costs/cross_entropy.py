"""The cross-entropy cost: logits -1/2 |q - c_k|^2 (Euclidean: no metric, rotor or resistance), loss -log softmax_y in
nats, prototypes learned:

    dloss/dq = sum_k p_k c_k - c_y,        dloss/dc_k = p_k (q - c_k) - 1[k = y] (q - c_y)

Metric, rotor and resistance get zero gradient."""

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


class CrossEntropy:
    kind: ClassVar[str] = "cross_entropy"
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
        """dloss/dq = p C - c_y: logits, softmax and one product (four operators, no allocation)."""
        torch.addmm(f.half_sq, q, f.cand.coords.T, out=sc.w)
        torch.ops.aten._softmax.out(sc.w, 1, False, out=sc.pi)
        return torch.mm(sc.pi, f.cand.coords, out=out).sub_(target)

    target = staticmethod(prototype_target)

    @staticmethod
    def scores(q: Tensor, f: CostFrame, mask: Tensor, sc: ReadoutScratch) -> tuple[Tensor, Tensor]:
        return distance_scores(q, f, mask, sc)

    @staticmethod
    def loss_and_grads(q: Tensor, f: CostFrame, mask: Tensor, sc: ReadoutScratch) -> ReadoutResult:
        """dloss/dC (batch mean) = G^T Q - diag(G^T 1) C with G = (P - M) / B."""
        loss, probs = distance_scores(q, f, mask, sc)
        g = torch.sub(probs, mask).div_(q.shape[0])
        grads = zero_grads(f.params)
        grads.protos = torch.mm(g.T, q).sub_(f.cand.coords * g.sum(0)[:, None])
        return ReadoutResult(loss, probs, grads)
