"""One learning step (free phase, nudged phases, EP update) and held-out scoring, with no autograd.

Energy couplings follow the EP estimate (dE/dtheta(s+) - dE/dtheta(s-)) / b; the readout gets the
exact gradient of the loss at the free equilibrium q0; everything is updated at once by a
hand-written heavy-ball rule over all tensors with torch._foreach_* ops.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
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
    "windows", "examples", "loss_sum", "correct_sum", "lior_mean", "spd_mean", "spd_last", "lior_nudge",
    "R_mean", "dropped", "update_norm_energy", "update_norm_readout", "update_norm_embed",
)


@dataclass
class StepResult:
    """What the phases of one batch give: a gradient per named parameter, per-example loss (B,) in nats,
    class probabilities (B, V) and the window observables [lior_mean, spd_mean, spd_last, R_mean, lior_nudge] (free phase but lior_nudge)."""

    grads: list[Tensor]
    loss: Tensor
    probs: Tensor
    obs: Tensor


@dataclass
class UpdateState:
    """Momentum buffers (one per parameter), the learning rate (0-dim, on the device so a schedule never
    breaks a captured graph), the count of dropped updates, and the power-iteration vectors of the caps."""

    bufs: list[Tensor]
    sq: list[Tensor]  # Adam's second moments (empty for heavy-ball)
    count: Tensor  # 0-dim, applied updates (Adam's bias correction)
    lr: Tensor
    dropped: Tensor
    power_vecs: list[Tensor]

    def tensors(self, names: list[str]) -> dict[str, Tensor]:
        out = {f"momentum.{n}": b for n, b in zip(names, self.bufs)}
        out.update({f"second_moment.{n}": b for n, b in zip(names, self.sq)})
        out.update({f"power.{i}": v for i, v in enumerate(self.power_vecs)})
        out.update({"update.lr": self.lr, "update.dropped": self.dropped, "update.count": self.count})
        return out


def param_group(name: str) -> str:
    """'energy', 'readout' or 'embed': which learning rate (and decay) a parameter gets."""
    if name == "emb":
        return "embed"
    return "energy" if name[:2] in ("W_", "b_") else "readout"


def foreach_update(params: list[Tensor], grads: list[Tensor], st: UpdateState, mults: list[float], decay: list[float], cfg: TrainConfig) -> tuple[Tensor, list[Tensor]]:
    """One step over all tensors at once: heavy-ball (buf = momentum * buf + grad, p -= lr * mult * buf) or
    Adam (momentum as beta1, bias-corrected); grad includes decay * p.

    A non-finite gradient anywhere drops the whole update (buffers and parameters untouched) by a
    device-side mask, counted in st.dropped; nothing syncs with the host. Returns (mask (0-dim),
    norm of each parameter's step).
    """
    ok = torch.isfinite(torch.stack(torch._foreach_norm(grads)).sum()).to(params[0].dtype)
    grads = [torch.nan_to_num(g, nan=0.0, posinf=0.0, neginf=0.0) for g in grads]
    torch._foreach_add_(grads, torch._foreach_mul(params, decay))
    torch._foreach_mul_(grads, ok)
    mu = cfg.momentum
    torch._foreach_mul_(st.bufs, 1.0 + ok * (mu - 1.0))  # decay by momentum, or keep when dropped
    if cfg.update_rule == "momentum":
        torch._foreach_add_(st.bufs, grads)
        steps = torch._foreach_mul(st.bufs, mults)
    else:
        b2 = cfg.adam_beta2
        st.count.add_(ok)
        torch._foreach_add_(st.bufs, grads, alpha=1.0 - mu)
        torch._foreach_mul_(st.sq, 1.0 + ok * (b2 - 1.0))
        torch._foreach_addcmul_(st.sq, grads, grads, value=1.0 - b2)
        t = st.count.clamp(min=1.0)
        denom = torch._foreach_div(st.sq, 1.0 - b2**t)
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, cfg.adam_eps)
        steps = torch._foreach_div(st.bufs, denom)
        torch._foreach_mul_(steps, mults)
        torch._foreach_div_(steps, 1.0 - mu**t)
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
            sq=[torch.zeros_like(p) for p in params] if cfg.update_rule == "adam" else [],
            count=torch.zeros((), dtype=like.dtype, device=like.device),
            lr=torch.tensor(cfg.eta_update, dtype=like.dtype, device=like.device),
            dropped=torch.zeros((), dtype=like.dtype, device=like.device),
            power_vecs=[torch.nn.functional.normalize(torch.ones(w.shape[0], dtype=like.dtype, device=like.device), dim=0) for w in couplings(machine)],
        )
        self.metrics = torch.zeros(len(METRICS), dtype=like.dtype, device=like.device)
        # Observability hooks (trainer2.telemetry): a timed/labelled context per phase, and progress
        # inside a window, on_steps(phase, step, steps, spd_last, lior), every progress_every steps.
        self.phase: Callable[[str], AbstractContextManager[None]] = lambda name: nullcontext()
        self.progress_every = 0
        self.on_steps: Callable[[str, int, int, float, float], None] | None = None

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
        self.relax(frame, 0.0, cfg.tbptt_window_steps, "free")
        self.s0.copy_(ws.state)
        return x, frame, cand

    def nudged_phase(self, frame: ReadoutFrame, beta: float, out: Phase) -> None:
        """Relax T_nudge steps from s0 on E + beta * loss; the result goes to `out`."""
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

    # --- gradients and update ---

    def grads(self, inputs: Tensor, targets: Tensor) -> StepResult:
        """Run the free and nudged phases and form every parameter's gradient."""
        cfg, m, ws = self.cfg, self.m, self.ws
        with self.phase("free"):
            x, frame, cand = self.free_phase(inputs, targets)
            obs = ws.obs
            free_obs = torch.stack([obs.lior.mean(), obs.spd.mean() / cfg.tbptt_window_steps, obs.spd_last.mean(), obs.r_sum / cfg.tbptt_window_steps])
            obs.zero_()
        with self.phase("nudged"):
            self.nudged_phase(frame, cfg.beta_nudge, self.s_plus)
            if cfg.symmetric_nudge:
                self.nudged_phase(frame, -cfg.beta_nudge, self.s_minus)
                s_minus, b, phases = self.s_minus, 2 * cfg.beta_nudge, 2
            else:
                s_minus, b, phases = self.s0, cfg.beta_nudge, 1
        with self.phase("update"):  # forming the gradients counts as part of the update
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
        with self.phase("update"):
            self.apply_update(out, targets)

    def apply_update(self, out: StepResult, targets: Tensor) -> None:
        """The update, constraints, memory write and metric accumulation of one batch step."""
        params = list(self.m.named_params().values())
        ok, norms = foreach_update(params, out.grads, self.update, self.mults, self.decay, self.cfg)
        project_constraints(self.m, self.cfg, self.update.power_vecs)
        if self.memory is not None:
            self.memory.write(self.s0.s[-1], targets)
        zero = torch.zeros((), dtype=out.loss.dtype, device=out.loss.device)
        sq = {g: zero for g in ("energy", "readout", "embed")}
        for g, nrm in zip(self.group_of, norms):
            sq[g] = sq[g] + nrm * nrm
        correct = (out.probs.argmax(1) == targets).to(out.loss.dtype).sum()
        lior_mean, spd_mean, spd_last, r_mean, lior_nudge = out.obs.unbind()
        self.metrics.add_(torch.stack([
            zero + 1, zero + self.batch, out.loss.sum(), correct, lior_mean, spd_mean, spd_last, lior_nudge,
            r_mean, 1.0 - ok, sq["energy"].sqrt(), sq["readout"].sqrt(), sq["embed"].sqrt(),
        ]))

    @torch.no_grad()
    def score(self, inputs: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        """Held-out scoring: (summed loss in nats, number correct), both 0-dim, after a free phase."""
        _, frame, cand = self.free_phase(inputs, targets)
        res = readout_loss_and_grads(self.s0.s[-1], frame, cand, targets, self.m.num_classes, self.m.layout, self.m.readout.theta)
        return res.loss.sum(), (res.probs.argmax(1) == targets).sum()
