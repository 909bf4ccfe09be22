"""The hot loop: `run_window`, T steps of damped leapfrog on E + beta * loss over a preallocated workspace.

    p <- (1 - gamma dt) p + dt F(s),   F = -dE/ds - beta dloss/dq
    s <- box(s + dt p / mass)

Every tensor a step touches lives in `Workspace`; a step allocates nothing, never syncs with the
host and never branches on a tensor value, so a window can be captured as a CUDA graph and replayed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from trainer2.energy import EnergyParams, forces
from trainer2.geometry import ReadoutFrame, ReadoutScratch, readout_force


@dataclass(frozen=True)
class Integrator:
    """Step size dt, damping gamma (0 = Stormer-Verlet, conserves energy) and mass; dt = gamma = mass = 1
    is the fixed-point iteration s <- box(argmin of the local quadratic)."""

    dt: float
    gamma: float
    mass: float


@dataclass
class Phase:
    """A state of the machine: positions s = (h_1..h_M, q) and momenta p, each (B, H_i)."""

    s: list[Tensor]
    p: list[Tensor]

    @staticmethod
    def zeros(batch: int, sizes: list[int], like: Tensor) -> "Phase":
        def new() -> list[Tensor]:
            return [torch.zeros(batch, h, dtype=like.dtype, device=like.device) for h in sizes]

        return Phase(new(), new())

    def copy_(self, other: "Phase") -> None:
        for a, b in zip(self.s + self.p, other.s + other.p):
            a.copy_(b)

    def zero_(self) -> None:
        for t in self.s + self.p:
            t.zero_()


@dataclass
class Observables:
    """Per-window LIoR accumulators (B,): path length sum R_sc spd dt, sum of spd, last spd; and sum of R_sc."""

    lior: Tensor
    spd: Tensor
    spd_last: Tensor
    r_sum: Tensor  # 0-dim

    def zero_(self) -> None:
        for t in (self.lior, self.spd, self.spd_last, self.r_sum):
            t.zero_()


@dataclass
class Workspace:
    """Everything run_window touches, allocated once for a fixed batch size."""

    state: Phase  # the running state
    force: list[Tensor]  # (B, H_i) -dE/ds_i
    drive: Tensor  # (B, H_1) W_1 x + b_1, filled before the window
    target_mask: Tensor  # (B, K) 1 where candidate k carries the example's label
    nudge: Tensor  # (B, n) dloss/dq
    zv: Tensor  # (B, n) velocity of q in the metric's frame
    spd_step: Tensor  # (B,) spd of this step
    readout: ReadoutScratch
    obs: Observables

    @staticmethod
    def allocate(batch: int, sizes: list[int], num_candidates: int, like: Tensor) -> "Workspace":
        """sizes = [H_1, ..., H_M, n]."""
        n = sizes[-1]

        def new(*shape: int) -> Tensor:
            return torch.zeros(shape, dtype=like.dtype, device=like.device)

        obs = Observables(new(batch), new(batch), new(batch), new())
        return Workspace(
            Phase.zeros(batch, sizes, like), [new(batch, h) for h in sizes], new(batch, sizes[0]),
            new(batch, num_candidates), new(batch, n), new(batch, n), new(batch),
            ReadoutScratch.allocate(batch, n, num_candidates, like), obs,
        )


def run_window(ws: Workspace, params: EnergyParams, frame: ReadoutFrame, beta: float, steps: int, integ: Integrator, eps: float) -> None:
    """Advance ws.state by `steps` leapfrog steps with nudging strength beta, accumulating ws.obs."""
    s, p, f = ws.state.s, ws.state.p, ws.force
    decay, kick, drift = 1.0 - integ.gamma * integ.dt, integ.dt, integ.dt / integ.mass
    last = len(s) - 1
    for _ in range(steps):
        forces(s, ws.drive, params, f)
        if beta != 0.0:
            readout_force(s[last], frame, ws.target_mask, ws.readout, ws.nudge)
            f[last].sub_(ws.nudge, alpha=beta)
        for i in range(len(s)):
            p[i].mul_(decay).add_(f[i], alpha=kick)
            s[i].add_(p[i], alpha=drift)
            if i < last:
                s[i].clamp_(0.0, 1.0)
        # Fused LIoR observables of v = (q_t - q_{t-1}) / dt = p_q / mass (q is never clamped).
        torch.mm(p[last], frame.rot.T, out=ws.zv)
        torch.mv(ws.zv.mul_(ws.zv), frame.g, out=ws.spd_step)
        ws.spd_step.div_(integ.mass**2).add_(eps).sqrt_()
        ws.obs.lior.addcmul_(ws.spd_step, frame.r_sc, value=integ.dt)
        ws.obs.spd.add_(ws.spd_step)
        ws.obs.r_sum.add_(frame.r_sc)
        ws.obs.spd_last.copy_(ws.spd_step)
