"""What a cost provides: the interface the relaxation, the learning rules and scoring use.

A cost scores the output coordinates q (R, n) against the classes. It gives the per-example loss and class scores,
its pull on q in a nudged phase (dloss/dq, allocation-free given the workspace's scratch), the readout's gradient at
the free equilibrium, and the point in q-space the clamping rules (CHL, coupled learning) move q toward: the target
class's prototype c_y for every built-in cost. The reported loss is always in nats (-log of the target's class score),
so held-out figures compare across costs; mse trains 1/2 |q - c_y|^2 and reports the log loss of its scores.

A cost of your own is a class with these members, named in the config by its dotted path (`cost: my_costs.Hinge`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch
from torch import Tensor

from trainer2.physics.readout import Candidates, ReadoutFrame, ReadoutParams, ReadoutResult, ReadoutScratch, RotorLayout


@dataclass
class CostFrame:
    """A batch's readout as a cost reads it, made once per batch: the live readout parameters, the retrieval frame
    (metric, rotor, rotated candidates: the spd observables use its metric whatever the cost), the candidates (K, n),
    the class count V, the rotor layout, whether every label has exactly one candidate, and -1/2 |c_k|^2 (K,) for the
    Euclidean costs."""

    params: ReadoutParams
    readout: ReadoutFrame
    cand: Candidates
    num_classes: int
    layout: RotorLayout
    one_hot: bool
    half_sq: Tensor | None = None


class Cost(Protocol):
    """A cost on q; every method reads a CostFrame and, per row, the target mask (R, K) (1 where candidate k carries
    the example's label) and the readout scratch of the workspace's R rows."""

    kind: ClassVar[str]  # the name the config's `cost` and the registry use
    folded: ClassVar[
        bool
    ]  # its fixed-point nudge is the folded retrieval step (dynamics.readout_nudge, Triton's kernel)
    memory_bank: ClassVar[bool]  # scores candidates beyond the prototypes (memory_capacity > 0)
    uses_target: ClassVar[bool]  # its force reads the target rows (R, n) (then each batch forms them)

    @staticmethod
    def frame(
        params: ReadoutParams,
        readout: ReadoutFrame,
        cand: Candidates,
        num_classes: int,
        layout: RotorLayout,
        one_hot: bool,
    ) -> CostFrame:
        """The batch's CostFrame (once per batch, outside the window)."""

    @staticmethod
    def force(q: Tensor, f: CostFrame, mask: Tensor, target: Tensor, sc: ReadoutScratch, out: Tensor) -> Tensor:
        """out (R, n) = dloss_r/dq_r, the gradient of each row's loss in its q; no allocation (the hot loop)."""

    @staticmethod
    def target(f: CostFrame, mask: Tensor, out: Tensor) -> Tensor:
        """out (R, n): the point each row's output is clamped toward (c_y)."""

    @staticmethod
    def scores(q: Tensor, f: CostFrame, mask: Tensor, sc: ReadoutScratch) -> tuple[Tensor, Tensor]:
        """Per-example loss (R,) in nats and class probabilities (R, V) at q."""

    @staticmethod
    def loss_and_grads(q: Tensor, f: CostFrame, mask: Tensor, sc: ReadoutScratch) -> ReadoutResult:
        """Loss, probabilities and the exact gradient of the batch-mean loss in every readout parameter at q."""


def make_frame(
    params: ReadoutParams,
    readout: ReadoutFrame,
    cand: Candidates,
    num_classes: int,
    layout: RotorLayout,
    one_hot: bool,
    euclidean: bool = False,
) -> CostFrame:
    """A CostFrame; euclidean: also -1/2 |c_k|^2 of the candidates."""
    half_sq = torch.mul(cand.coords, cand.coords).sum(1).mul_(-0.5) if euclidean else None
    return CostFrame(params, readout, cand, num_classes, layout, one_hot, half_sq)


def prototype_target(f: CostFrame, mask: Tensor, out: Tensor) -> Tensor:
    """out (R, n) = c_y, the target class's prototype (the first V candidates are the prototypes in label order)."""
    v = f.num_classes
    return torch.mm(mask[:, :v], f.cand.coords[:v], out=out)


def zero_grads(p: ReadoutParams) -> ReadoutParams:
    """A zero gradient for every readout parameter (what a cost does not learn)."""
    return ReadoutParams(*(torch.zeros_like(t) for t in (p.g_diag, p.theta, p.protos, p.r_sc)))


def distance_scores(
    q: Tensor, f: CostFrame, mask: Tensor, sc: ReadoutScratch, scale: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The Euclidean costs' scores: logits -scale/2 |q - c_k|^2 (as scale (q . c_k - 1/2 |c_k|^2), the same up to a
    per-row constant; scale 1 when None), per-example loss logsumexp - logit_y (R,) in nats and probabilities
    softmax(logits) (R, V); the logits are left in sc.w and the probabilities in sc.pi."""
    torch.addmm(f.half_sq, q, f.cand.coords.T, out=sc.w)
    if scale is not None:
        sc.w.mul_(scale)
    torch._softmax(sc.w, 1, False, out=sc.pi)
    loss = torch.logsumexp(sc.w, 1).sub_(torch.mul(sc.w, mask).sum(1))
    return loss, sc.pi.clone()  # sc is overwritten by the next readout
