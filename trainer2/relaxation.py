"""The relaxation of one batch: workspace, free and nudged phases, window statistics and held-out scoring.

This is everything evaluation and sampling need; it holds no update state. `Relaxation` owns the
preallocated workspace for one batch size, so its phases allocate nothing inside `run_window`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor

from trainer2.config import TrainConfig
from trainer2.energy import input_drive
from trainer2.geometry import Candidates, ReadoutFrame, class_onehot, readout_frame, readout_weights
from trainer2.machine import Machine
from trainer2.memory import MemoryBank
from trainer2.window import Integrator, Phase, Workspace, run_window


@dataclass
class WindowStats:
    """Window observables, each a 0-dim tensor: free-phase LIoR path length, mean and last spd, mean R_sc
    (batch means), and the nudged phases' path length (0 when a gradient source runs no nudged phase)."""

    lior_mean: Tensor
    spd_mean: Tensor
    spd_last: Tensor
    R_mean: Tensor
    lior_nudge: Tensor


@dataclass
class FreeState:
    """What the free phase fixes for the rest of the batch: the clamped input x (B, D), the readout frame
    and the retrieval candidates. The equilibrium itself is in `Relaxation.s0`."""

    x: Tensor
    frame: ReadoutFrame
    cand: Candidates


class Relaxation:
    """Workspace and saved phases (s0, s_plus, s_minus) for one batch size; phases run through `run_window`."""

    def __init__(self, machine: Machine, cfg: TrainConfig, batch: int, memory: MemoryBank | None = None) -> None:
        self.m, self.cfg, self.batch, self.memory = machine, cfg, batch, memory
        like = machine.readout.protos
        sizes = machine.state_sizes()
        num_cand = machine.num_classes + (0 if memory is None else memory.coords.shape[0])
        self.ws = Workspace.allocate(batch, sizes, num_cand, like)
        self.s0, self.s_plus, self.s_minus = (Phase.zeros(batch, sizes, like) for _ in range(3))
        self.integ = Integrator(cfg.dt, cfg.gamma, cfg.mass)
        # Observability hooks (trainer2.telemetry): a timed/labelled context per phase, and progress
        # inside a window, on_steps(phase, step, steps, spd_last, lior), every progress_every steps.
        self.phase: Callable[[str], AbstractContextManager[None]] = lambda name: nullcontext()
        self.progress_every = 0
        self.on_steps: Callable[[str, int, int, float, float], None] | None = None

    @property
    def device(self) -> torch.device:
        return self.ws.drive.device

    def candidates(self) -> Candidates:
        protos = self.m.prototype_candidates()
        return protos if self.memory is None else self.memory.candidates(protos)

    def free_phase(self, inputs: Tensor, targets: Tensor) -> FreeState:
        """Clamp the input, relax T_free steps from rest; leaves s0 in self.s0 and the window's sums in ws.obs."""
        m, ws, cfg = self.m, self.ws, self.cfg
        x = m.input_vectors(inputs)
        cand = self.candidates()
        frame = readout_frame(m.readout, cand, m.layout, cfg.retrieval_beta, cfg.eps)
        onehot = class_onehot(cand.labels, m.num_classes, x.dtype)  # (K, V)
        ws.target_mask.copy_(onehot[:, targets].T)
        input_drive(x, m.energy, ws.drive)
        ws.state.zero_()
        ws.obs.zero_()
        self.relax(frame, 0.0, cfg.tbptt_window_steps, "free")
        self.s0.copy_(ws.state)
        return FreeState(x, frame, cand)

    def free_stats(self) -> dict[str, Tensor]:
        """The free window's observables from ws.obs (call right after free_phase): batch means, 0-dim."""
        obs, steps = self.ws.obs, self.cfg.tbptt_window_steps
        return {"lior_mean": obs.lior.mean(), "spd_mean": obs.spd.mean() / steps, "spd_last": obs.spd_last.mean(),
                "R_mean": obs.r_sum / steps}

    def nudged_phase(self, frame: ReadoutFrame, beta: float, out: Phase) -> None:
        """Relax T_nudge steps from s0 on E + beta * loss; the result goes to `out`, the path length adds to ws.obs."""
        self.ws.state.copy_(self.s0)
        self.relax(frame, beta, self.cfg.nudge_steps, "nudged")
        out.copy_(self.ws.state)

    def relax(self, frame: ReadoutFrame, beta: float, steps: int, name: str) -> None:
        """run_window for `steps` steps; with on_steps set, in chunks of progress_every steps, each followed
        by one transfer of [spd_last mean, lior mean] (the chunks give the same result as one window)."""
        ws, every = self.ws, self.progress_every
        if self.on_steps is None or every < 1:
            run_window(ws, self.m.energy, frame, beta, steps, self.integ, self.cfg.eps)
            return
        for done in range(0, steps, every):
            n = min(every, steps - done)
            run_window(ws, self.m.energy, frame, beta, n, self.integ, self.cfg.eps)
            spd_last, lior = torch.stack([ws.obs.spd_last.mean(), ws.obs.lior.mean()]).tolist()
            self.on_steps(name, done + n, steps, spd_last, lior)

    def readout_scores(self, free: FreeState) -> tuple[Tensor, Tensor]:
        """Per-example loss (B,) in nats and class probabilities (B, V) at s0, without any gradient."""
        sc = self.ws.readout
        readout_weights(self.s0.s[-1], free.frame, self.ws.target_mask, sc)
        probs = torch.zeros(self.batch, self.m.num_classes, dtype=sc.pi.dtype, device=sc.pi.device)
        probs.index_add_(1, free.cand.labels, sc.pi)  # p_v sums the weights of every candidate labelled v
        return -torch.log(sc.py.squeeze(1)), probs

    @torch.no_grad()
    def score(self, inputs: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        """Held-out scoring: (summed loss in nats, number correct), both 0-dim, after a free phase."""
        loss, probs = self.readout_scores(self.free_phase(inputs, targets))
        return loss.sum(), (probs.argmax(1) == targets).sum()
