"""The cross-entropy cost: logits -R/2 |q - c_k|^2 (Euclidean: no metric or rotor; R the readout's learned scale
r_sc, starting at r_init like retrieval's), loss -log softmax_y in nats, prototypes and scale learned:

    dloss/dq = R (sum_k p_k c_k - c_y),   dloss/dc_k = R (p_k (q - c_k) - 1[k = y] (q - c_y)),
    dloss/dR = -1/2 sum_k (p_k - 1[k = y]) |q - c_k|^2

At unit scale, prototypes 0.1 apart (the presets' proto_init_scale) gave logits too alike to learn from in a few
hundred windows (89-91% on the MNIST sample at 400 dev windows; docs/rules.md). Metric and rotor get zero gradient."""

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
        """dloss/dq = R (p C - c_y): logits, softmax and one product (six operators, no allocation)."""
        torch.addmm(f.half_sq, q, f.cand.coords.T, out=sc.w).mul_(f.params.r_sc)
        torch._softmax(sc.w, 1, False, out=sc.pi)
        return torch.mm(sc.pi, f.cand.coords, out=out).sub_(target).mul_(f.params.r_sc)

    target = staticmethod(prototype_target)

    @staticmethod
    def scores(q: Tensor, f: CostFrame, mask: Tensor, sc: ReadoutScratch) -> tuple[Tensor, Tensor]:
        return distance_scores(q, f, mask, sc, f.params.r_sc)

    @staticmethod
    def loss_and_grads(q: Tensor, f: CostFrame, mask: Tensor, sc: ReadoutScratch) -> ReadoutResult:
        """With G = (P - M) / B (batch mean): dloss/dC = R (G^T Q - diag(G^T 1) C), and dloss/dR = sum G * logits / R
        (each row of G sums to 0, so the -1/2 |q|^2 the logits leave out cancels)."""
        loss, probs = distance_scores(q, f, mask, sc, f.params.r_sc)
        g = torch.sub(probs, mask).div_(q.shape[0])
        grads = zero_grads(f.params)
        grads.protos = torch.mm(g.T, q).sub_(f.cand.coords * g.sum(0)[:, None]).mul_(f.params.r_sc)
        grads.r_sc = torch.mul(g, sc.w).sum().div_(f.params.r_sc)
        return ReadoutResult(loss, probs, grads)
