"""The update half of a batch step: the hand-written update rule, the constraints, and the metric sums.

`foreach_update` steps every parameter at once with torch._foreach_* ops (heavy-ball or Adam); the
learning rate lives in a device tensor, so a schedule never breaks a captured graph. Metrics are
accumulated by name on the device and read back in one transfer per log interval.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from trainer2.config import TrainConfig
from trainer2.gradients import StepResult
from trainer2.machine import Machine, couplings, project_constraints
from trainer2.params import GROUPS, ParamTable


@dataclass
class UpdateState:
    """Momentum buffers (one per parameter), Adam's second moments, the applied-update count, the learning
    rate (0-dim, on the device so a schedule never breaks a captured graph), the dropped-update count, and
    the power-iteration vectors of the spectral caps."""

    bufs: list[Tensor]
    sq: list[Tensor]  # Adam's second moments (empty for heavy-ball)
    count: Tensor  # 0-dim, applied updates (Adam's bias correction)
    lr: Tensor
    dropped: Tensor
    power_vecs: list[Tensor]

    @staticmethod
    def allocate(params: list[Tensor], power_sizes: list[int], cfg: TrainConfig) -> "UpdateState":
        like = params[0]

        def scalar(v: float) -> Tensor:
            return torch.tensor(v, dtype=like.dtype, device=like.device)

        ones = [torch.ones(h, dtype=like.dtype, device=like.device) for h in power_sizes]
        return UpdateState(
            bufs=[torch.zeros_like(p) for p in params],
            sq=[torch.zeros_like(p) for p in params] if cfg.update_rule == "adam" else [],
            count=scalar(0.0), lr=scalar(cfg.eta_update), dropped=scalar(0.0),
            power_vecs=[torch.nn.functional.normalize(u, dim=0) for u in ones],
        )

    def tensors(self, names: tuple[str, ...]) -> dict[str, Tensor]:
        """The state by checkpoint key."""
        out = {f"momentum.{n}": b for n, b in zip(names, self.bufs, strict=True)}
        out.update({f"second_moment.{n}": b for n, b in zip(names, self.sq)})
        out.update({f"power.{i}": v for i, v in enumerate(self.power_vecs)})
        out.update({"update.lr": self.lr, "update.dropped": self.dropped, "update.count": self.count})
        return out


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


# Sums over a log interval; `MetricSums.read` turns them into the logged means.
METRICS = (
    "windows", "examples", "loss_sum", "correct_sum", "lior_mean", "spd_mean", "spd_last", "lior_nudge", "R_mean",
    "dropped", "update_norm_energy", "update_norm_readout", "update_norm_embed", "nonfinite_params",
)


class MetricSums:
    """Named per-window sums kept in one device tensor, so an interval's metrics come back in one transfer.
    The slot order is private to this class: callers add and read by name."""

    def __init__(self, like: Tensor) -> None:
        self.values = torch.zeros(len(METRICS), dtype=like.dtype, device=like.device)

    def add(self, named: dict[str, Tensor]) -> None:
        """Add one window's 0-dim tensors; every metric name must be given (no host sync)."""
        if named.keys() != set(METRICS):
            raise KeyError(f"metrics {sorted(named)} do not match {sorted(METRICS)}")
        self.values.add_(torch.stack([named[k] for k in METRICS]))

    def read(self, *extra: Tensor) -> tuple[dict[str, float], list[float]]:
        """(sums by name, values of the 0-dim `extra` tensors) in one device-to-host transfer; then reset."""
        flat = torch.cat([self.values, *(t.reshape(1).to(self.values.dtype) for t in extra)]).tolist()
        self.values.zero_()
        return dict(zip(METRICS, flat[:len(METRICS)], strict=True)), flat[len(METRICS):]


class Updater:
    """Update state, constraints and metric sums for one machine; `apply` is the update half of a batch step."""

    def __init__(self, machine: Machine, cfg: TrainConfig, table: ParamTable) -> None:
        self.m, self.cfg, self.table = machine, cfg, table
        self.state = UpdateState.allocate(list(table.tensors), [w.shape[0] for w in couplings(machine)], cfg)
        self.metrics = MetricSums(table.tensors[0])
        self.mults, self.decay = list(table.mults), list(table.decay)  # the lists the _foreach ops take, built once

    def apply(self, out: StepResult, targets: Tensor) -> None:
        """Update every parameter from its named gradient, project the constraints, add the window's metrics."""
        params = list(self.table.tensors)
        ok, norms = foreach_update(params, self.table.ordered(out.grads), self.state, self.mults, self.decay, self.cfg)
        project_constraints(self.m, self.cfg, self.state.power_vecs)
        zero = torch.zeros((), dtype=out.loss.dtype, device=out.loss.device)
        sq = dict.fromkeys(GROUPS, zero)
        for g, nrm in zip(self.table.groups, norms, strict=True):
            sq[g] = sq[g] + nrm * nrm
        st = out.stats
        self.metrics.add({
            "windows": zero + 1, "examples": zero + targets.shape[0], "loss_sum": out.loss.sum(),
            "correct_sum": (out.probs.argmax(1) == targets).to(zero.dtype).sum(),
            "lior_mean": st.lior_mean, "spd_mean": st.spd_mean, "spd_last": st.spd_last, "lior_nudge": st.lior_nudge,
            "R_mean": st.R_mean, "dropped": 1.0 - ok,
            **{f"update_norm_{g}": sq[g].sqrt() for g in GROUPS},
            # 1 when a parameter is not finite after this update: NaN and inf carry through the sums (so does a sum
            # past the float range, ~1e38: such a parameter has blown up anyway)
            "nonfinite_params": 1.0 - torch.isfinite(torch.stack([p.sum() for p in params]).sum()).to(zero.dtype),
        })

    def tensors(self) -> dict[str, Tensor]:
        """Update state and metric sums by checkpoint key."""
        return {**self.state.tensors(self.table.names), "metrics": self.metrics.values}
