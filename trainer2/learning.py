"""One learning step (free phase, nudged phases, EP update) and held-out scoring, with no autograd.

Energy couplings follow the EP estimate (dE/dtheta(s+) - dE/dtheta(s-)) / b; the readout gets the
exact gradient of the loss at the free equilibrium q0; everything is updated at once by a
hand-written heavy-ball rule over all tensors with torch._foreach_* ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from trainer2.config import TrainConfig
from trainer2.energy import coupling_grads, input_drive
from trainer2.geometry import Candidates, ReadoutFrame, class_onehot, readout_frame, readout_loss_and_grads
from trainer2.machine import Machine, couplings, project_constraints
from trainer2.memory import MemoryBank
from trainer2.window import Integrator, Phase, Workspace, run_window

# Per-window metrics, accumulated on the device and synced once per log interval.
METRICS = (
    "windows", "examples", "loss_sum", "correct_sum", "lior_free", "spd_free", "spd_last", "lior_nudge",
    "r_mean", "dropped", "update_norm_energy", "update_norm_readout", "update_norm_embed",
)


@dataclass
class StepResult:
    """What the phases of one batch give: a gradient per named parameter, per-example loss (B,) in nats,
    class probabilities (B, V) and the window observables [lior_free, spd_free, spd_last, r_mean, lior_nudge]."""

    grads: list[Tensor]
    loss: Tensor
    probs: Tensor
    obs: Tensor


@dataclass
class UpdateState:
    """Momentum buffers (one per parameter), the learning rate (0-dim, on the device so a schedule never
    breaks a captured graph), the count of dropped updates, and the power-iteration vectors of the caps."""

    bufs: list[Tensor]
    lr: Tensor
    dropped: Tensor
    power_vecs: list[Tensor]

    def tensors(self, names: list[str]) -> dict[str, Tensor]:
        out = {f"momentum.{n}": b for n, b in zip(names, self.bufs)}
        out.update({f"power.{i}": v for i, v in enumerate(self.power_vecs)})
        out.update({"update.lr": self.lr, "update.dropped": self.dropped})
        return out


def param_group(name: str) -> str:
    """'energy', 'readout' or 'embed': which learning rate (and decay) a parameter gets."""
    if name == "emb":
        return "embed"
    return "energy" if name[:2] in ("W_", "b_") else "readout"


def foreach_update(params: list[Tensor], grads: list[Tensor], st: UpdateState, mults: list[float], decay: list[float], momentum: float) -> tuple[Tensor, list[Tensor]]:
    """Heavy-ball step p -= lr * mult * buf, buf = momentum * buf + grad + decay * p, over all tensors at once.

    A non-finite gradient anywhere drops the whole update (buffers and parameters untouched) by a
    device-side mask, counted in st.dropped; nothing syncs with the host. Returns (mask (0-dim),
    norm of each parameter's step).
    """
    ok = torch.isfinite(torch.stack(torch._foreach_norm(grads)).sum()).to(params[0].dtype)
    grads = [torch.nan_to_num(g, nan=0.0, posinf=0.0, neginf=0.0) for g in grads]
    torch._foreach_add_(grads, torch._foreach_mul(params, decay))
    torch._foreach_mul_(grads, ok)
    torch._foreach_mul_(st.bufs, 1.0 + ok * (momentum - 1.0))  # momentum, or 1 (keep) when dropped
    torch._foreach_add_(st.bufs, grads)
    steps = torch._foreach_mul(st.bufs, mults)
    torch._foreach_mul_(steps, st.lr * ok)
    torch._foreach_sub_(params, steps)
    st.dropped.add_(1.0 - ok)
    return ok, list(torch._foreach_norm(steps))


class Learner:
    """Owns the workspace, the saved phases and the update state for one batch size; `step` is the whole
    batch step (the unit a CUDA graph captures) and `free_phase` serves evaluation."""

    def __init__(self, machine: Machine, cfg: TrainConfig, batch: int, memory: MemoryBank | None = None) -> None:
        self.m, self.cfg, self.batch, self.memory = machine, cfg, batch, memory
        like = machine.readout.protos
        sizes = machine.state_sizes()
        num_cand = machine.num_classes + (0 if memory is None else memory.coords.shape[0])
        self.ws = Workspace.allocate(batch, sizes, num_cand, like)
        self.s0, self.s_plus, self.s_minus = (Phase.zeros(batch, sizes, like) for _ in range(3))
        self.integ = Integrator(cfg.dt, cfg.gamma, cfg.mass)
        self.names = list(machine.named_params())
        groups = [param_group(n) for n in self.names]
        scale = {"energy": 1.0, "readout": cfg.eta_readout_scale, "embed": cfg.eta_embed_scale}
        self.mults = [scale[g] for g in groups]
        self.decay = [cfg.weight_decay if n.startswith("W_") else 0.0 for n in self.names]
        self.group_of = groups
        params = list(machine.named_params().values())
        self.update = UpdateState(
            bufs=[torch.zeros_like(p) for p in params],
            lr=torch.tensor(cfg.eta_update, dtype=like.dtype, device=like.device),
            dropped=torch.zeros((), dtype=like.dtype, device=like.device),
            power_vecs=[torch.nn.functional.normalize(torch.ones(w.shape[0], dtype=like.dtype, device=like.device), dim=0) for w in couplings(machine)],
        )
        self.metrics = torch.zeros(len(METRICS), dtype=like.dtype, device=like.device)

    # --- phases ---

    def candidates(self) -> Candidates:
        protos = self.m.prototype_candidates()
        return protos if self.memory is None else self.memory.candidates(protos)

    def free_phase(self, inputs: Tensor, targets: Tensor) -> tuple[Tensor, ReadoutFrame, Candidates]:
        """Clamp the input, relax T_free steps from rest; leaves s0 in self.s0. Returns (x, frame, candidates)."""
        m, ws, cfg = self.m, self.ws, self.cfg
        x = m.input_vectors(inputs)
        cand = self.candidates()
        frame = readout_frame(m.readout, cand, m.layout, cfg.retrieval_beta, cfg.eps)
        onehot = class_onehot(cand.labels, m.num_classes, x.dtype)  # (K, V)
        ws.target_mask.copy_(onehot[:, targets].T)
        input_drive(x, m.energy, ws.drive)
        ws.state.zero_()
        ws.obs.zero_()
        run_window(ws, m.energy, frame, 0.0, cfg.tbptt_window_steps, self.integ, cfg.eps)
        self.s0.copy_(ws.state)
        return x, frame, cand

    def nudged_phase(self, frame: ReadoutFrame, beta: float, out: Phase) -> None:
        """Relax T_nudge steps from s0 on E + beta * loss; the result goes to `out`."""
        self.ws.state.copy_(self.s0)
        run_window(self.ws, self.m.energy, frame, beta, self.cfg.nudge_steps, self.integ, self.cfg.eps)
        out.copy_(self.ws.state)

    # --- gradients and update ---

    def grads(self, inputs: Tensor, targets: Tensor) -> StepResult:
        """Run the free and nudged phases and form every parameter's gradient."""
        cfg, m, ws = self.cfg, self.m, self.ws
        x, frame, cand = self.free_phase(inputs, targets)
        obs = ws.obs
        free_obs = torch.stack([obs.lior.mean(), obs.spd.mean() / cfg.tbptt_window_steps, obs.spd_last.mean(), obs.r_sum / cfg.tbptt_window_steps])
        obs.zero_()
        self.nudged_phase(frame, cfg.beta_nudge, self.s_plus)
        if cfg.symmetric_nudge:
            self.nudged_phase(frame, -cfg.beta_nudge, self.s_minus)
            s_minus, b, phases = self.s_minus, 2 * cfg.beta_nudge, 2
        else:
            s_minus, b, phases = self.s0, cfg.beta_nudge, 1
        gw, gb, gx = coupling_grads(self.s_plus.s, s_minus.s, x, m.energy, 1.0 / (b * self.batch))
        res = readout_loss_and_grads(self.s0.s[-1], frame, cand, targets, m.num_classes, m.layout, m.readout.theta)
        r = res.grads
        grads: list[Tensor] = []
        if m.emb is not None:
            grads.append(torch.zeros_like(m.emb).index_add_(0, inputs.flatten(), gx.reshape(-1, m.emb.shape[1])))
        for w, bias in zip(gw, gb):
            grads += [w, bias]
        grads += [r.g_diag, r.theta, r.protos, r.r_sc]
        return StepResult(grads, res.loss, res.probs, torch.cat([free_obs, (obs.lior.mean() / phases)[None]]))

    def step(self, inputs: Tensor, targets: Tensor) -> None:
        """The whole batch step: free phase, nudged phase(s), update, constraints, memory write, metrics."""
        out = self.grads(inputs, targets)
        params = list(self.m.named_params().values())
        ok, norms = foreach_update(params, out.grads, self.update, self.mults, self.decay, self.cfg.momentum)
        project_constraints(self.m, self.cfg, self.update.power_vecs)
        if self.memory is not None:
            self.memory.write(self.s0.s[-1], targets)
        zero = torch.zeros((), dtype=out.loss.dtype, device=out.loss.device)
        sq = {g: zero for g in ("energy", "readout", "embed")}
        for g, nrm in zip(self.group_of, norms):
            sq[g] = sq[g] + nrm * nrm
        correct = (out.probs.argmax(1) == targets).to(out.loss.dtype).sum()
        lior_free, spd_free, spd_last, r_mean, lior_nudge = out.obs.unbind()
        self.metrics.add_(torch.stack([
            zero + 1, zero + self.batch, out.loss.sum(), correct, lior_free, spd_free, spd_last, lior_nudge,
            r_mean, 1.0 - ok, sq["energy"].sqrt(), sq["readout"].sqrt(), sq["embed"].sqrt(),
        ]))

    @torch.no_grad()
    def score(self, inputs: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        """Held-out scoring: (summed loss in nats, number correct), both 0-dim, after a free phase."""
        _, frame, cand = self.free_phase(inputs, targets)
        res = readout_loss_and_grads(self.s0.s[-1], frame, cand, targets, self.m.num_classes, self.m.layout, self.m.readout.theta)
        return res.loss.sum(), (res.probs.argmax(1) == targets).sum()
