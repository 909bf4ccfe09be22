"""The update half of a batch step: its settings (`UpdateConfig`), the hand-written update rule and learning-rate
schedule, the constraints, and the metric sums.

`flat_update` steps every parameter at once over the flat parameter buffer (heavy-ball or Adam); the
learning rate lives in a device tensor, so a schedule never breaks a captured graph. Metrics are
accumulated by name on the device and read back in one transfer per log interval.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch
from pydantic import Field, model_validator
from torch import Tensor

from trainer2.learning.gradients import StepResult
from trainer2.learning.params import GROUPS, ParamTable
from trainer2.learning.subnormals import flush_subnormals_
from trainer2.physics.couplings import Dense
from trainer2.physics.kernels.backend import choose_update_backend, metrics_kernel_wanted
from trainer2.physics.machine import Machine, MachineConfig, coupling_cap, project_constraints
from trainer2.section import Section

MAX_LR = 1.0  # largest learning rate of any parameter group (see UpdateConfig._rates)


class UpdateConfig(Section):
    """The update rule, the learning rates of the parameter groups and their schedule."""

    eta_update: float = Field(
        0.003, gt=0.0, description="Base learning rate (energy couplings; other groups scale it)."
    )
    eta_readout_scale: float = Field(1.0, gt=0.0, description="Readout learning rate as a multiple of eta_update.")
    eta_embed_scale: float = Field(1.0, gt=0.0, description="Embedding learning rate as a multiple of eta_update.")
    update_rule: Literal["momentum", "nesterov", "adam"] = Field(
        "adam",
        description="Hand-written update: heavy-ball momentum, Nesterov momentum (the step of PyTorch's SGD with "
        "nesterov=True, the field's SGD recipe) or Adam.",
    )
    momentum: float = Field(0.9, ge=0.0, lt=1.0, description="Heavy-ball or Nesterov momentum, or Adam's beta1.")
    adam_beta2: float = Field(0.999, ge=0.0, lt=1.0, description="Adam's second-moment decay.")
    adam_eps: float = Field(1e-8, gt=0.0, description="Adam's denominator epsilon.")
    weight_decay: float = Field(0.0, ge=0.0, description="L2 weight decay on the energy couplings.")
    lr_warmup_windows: int = Field(0, ge=0, description="Windows of linear learning-rate warm-up.")
    lr_schedule: Literal["constant", "cosine"] = Field("constant", description="Learning-rate decay after warm-up.")
    lr_min_ratio: float = Field(
        0.1, ge=0.0, le=1.0, description="Final learning rate as a fraction of the peak (cosine)."
    )
    ema_decay: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Weight averaging: evaluation, the summary and trainer2.load score a moving average of the "
        "parameters, moved toward them by 1 - d after the t-th window with d = min(ema_decay, (1 + t) / (10 + t)) "
        "(a warm-up; then about the last 1 / (1 - ema_decay) windows); training itself is unchanged. 0 = off (the "
        "parameters themselves).",
    )
    update_backend: Literal["auto", "torch", "triton"] = Field(
        "auto",
        description="Parameter update: 'torch' operators, or 'triton' (the fused update: two kernel launches over the "
        "flat buffer; needs the kernels extra and a CUDA device); 'auto' takes triton on CUDA where it can run, "
        "torch otherwise.",
    )

    @property
    def eta_scales(self) -> dict[str, float]:
        """Each parameter group's learning rate as a multiple of eta_update."""
        return {"energy": 1.0, "readout": self.eta_readout_scale, "embed": self.eta_embed_scale}

    @model_validator(mode="after")
    def _rates(self) -> "UpdateConfig":
        for group, scale in self.eta_scales.items():
            lr = self.eta_update * scale
            if lr > MAX_LR:
                what = "eta_update" if group == "energy" else f"eta_update * eta_{group}_scale"
                raise ValueError(
                    f"the {group} learning rate {what} = {lr:g} must be at most {MAX_LR:g}: an Adam step moves every "
                    "parameter by about the learning rate, and the couplings live below spectral_cap < 1, so a larger "
                    "rate wrecks the model in one update (useful rates are around 1e-3 to 1e-2)"
                )
        return self


def lr_at(cfg: UpdateConfig, window: int, total: int) -> float:
    """Learning rate for window `window` of `total`: linear warm-up, then constant or cosine to lr_min_ratio."""
    if window < cfg.lr_warmup_windows:
        return cfg.eta_update * (window + 1) / cfg.lr_warmup_windows
    if cfg.lr_schedule == "constant":
        return cfg.eta_update
    frac = min(1.0, (window - cfg.lr_warmup_windows) / max(1, total - cfg.lr_warmup_windows))
    return cfg.eta_update * (cfg.lr_min_ratio + (1 - cfg.lr_min_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


@dataclass
class UpdateState:
    """Momentum buffer and Adam's second moments over the flat parameter buffer (P,), the applied-update count, the
    learning rate (0-dim, on the device so a schedule never breaks a captured graph), the dropped-update count, and
    the power-iteration vectors of the spectral caps."""

    # Two buffers, not two rows of one: Inductor on CUDA (torch 2.11, an H200) compiled in-place writes through both
    # rows and then a flush of their base into a wrong step (second moments lost); separate buffers compile right
    bufs: Tensor  # (P,) the momentum buffer, Adam's first moment
    sq: Tensor  # (P,) Adam's second moments; (0,) for heavy-ball
    # The counts the step adds to are (1,), not 0-dim: torch.compile (AOT, torch 2.13) drops an in-place update of a
    # 0-dim CPU tensor, so a compiled run's count stayed 0 (Adam's bias correction frozen at its first step).
    # Checkpoints keep them 0-dim (tensors() gives 0-dim views), as before.
    count: Tensor  # (1,), applied updates (Adam's bias correction)
    lr: Tensor  # 0-dim; only read inside the step
    dropped: Tensor  # (1,)
    power_vecs: list[Tensor]

    @staticmethod
    def allocate(flat: Tensor, power_sizes: list[int], cfg: UpdateConfig) -> "UpdateState":
        def scalar(v: float, shape: tuple[int, ...] = ()) -> Tensor:
            return torch.full(shape, v, dtype=flat.dtype, device=flat.device)

        ones = [torch.ones(h, dtype=flat.dtype, device=flat.device) for h in power_sizes]
        return UpdateState(
            bufs=torch.zeros_like(flat),
            sq=torch.zeros_like(flat) if cfg.update_rule == "adam" else flat.new_zeros(0),
            count=scalar(0.0, (1,)),
            lr=scalar(cfg.eta_update),
            dropped=scalar(0.0, (1,)),
            power_vecs=[torch.nn.functional.normalize(u, dim=0) for u in ones],
        )

    def tensors(self, table: ParamTable) -> dict[str, Tensor]:
        """The state by checkpoint key (the flat buffers seen per parameter)."""
        out = {f"momentum.{n}": v for n, v in table.views(self.bufs).items()}
        if self.sq.numel():
            out.update({f"second_moment.{n}": v for n, v in table.views(self.sq).items()})
        out.update({f"power.{i}": v for i, v in enumerate(self.power_vecs)})
        out.update({"update.lr": self.lr, "update.dropped": self.dropped.view(()), "update.count": self.count.view(())})
        return out


def flat_update(
    param: Tensor,
    grad: Tensor,
    st: UpdateState,
    mult: Tensor | None,
    decay: Tensor | None,
    cfg: UpdateConfig,
    step: Tensor,
) -> Tensor:
    """One step of every parameter at once, over flat (P,) buffers: heavy-ball (buf = momentum * buf + grad,
    p -= lr * mult * buf), Nesterov (the same buf, p -= lr * mult * (momentum * buf + grad)) or Adam (momentum as
    beta1, bias-corrected); grad includes decay * p; mult None is 1.
    Subnormal entries of the moments end as 0 (trainer2.learning.subnormals).

    A non-finite gradient anywhere drops the whole update (buffers and parameters untouched) by a
    device-side mask, counted in st.dropped; nothing syncs with the host. grad is used as scratch; step
    receives the applied step. Returns the mask (0-dim, 1 = applied).
    """
    ok = torch.isfinite(grad.sum()).to(param.dtype)
    if decay is not None:
        grad.addcmul_(decay, param)
    # All zeros when dropped (NaN and inf too), else unchanged but for entries that decay of a non-finite parameter made
    # non-finite; two passes cost a third of masked_fill_ with a 0-dim mask
    grad.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0).mul_(ok)
    mu = cfg.momentum
    if cfg.update_rule != "adam":
        st.bufs.mul_(1.0 + ok * (mu - 1.0)).add_(grad)  # decay by momentum, or keep when dropped (grad is 0 then)
        if cfg.update_rule == "nesterov":
            torch.mul(st.bufs, mu, out=step).add_(grad).mul_(st.lr * ok)  # the step looks ahead along the new buf
        else:
            torch.mul(st.bufs, st.lr * ok, out=step)
    else:
        b2 = cfg.adam_beta2
        st.count.add_(ok)
        st.bufs.lerp_(grad, ok * (1.0 - mu))  # mu * buf + (1 - mu) * grad, or buf itself when dropped
        st.sq.lerp_(torch.mul(grad, grad, out=step), ok * (1.0 - b2))  # the same for grad^2
        t = st.count.clamp(min=1.0)
        # torch.rsub(x, 1.0) and torch.pow(b, x) are 1 - x and b ** x, the same operators without the Python wrappers
        # of Tensor.__rsub__ and __rpow__ (about 1 us each, every window)
        root_bc2 = torch.sqrt(torch.rsub(torch.pow(b2, t), 1.0))
        # lr * mult * (buf / bc1) / (sqrt(sq / bc2) + eps), with the bias corrections moved onto scalars
        torch.sqrt(st.sq, out=step).add_(root_bc2 * cfg.adam_eps)
        torch.div(st.bufs, step, out=step).mul_(st.lr * ok * root_bc2 / torch.rsub(torch.pow(mu, t), 1.0))
    if mult is not None:
        step.mul_(mult)
    param.sub_(step)
    # Snap subnormals to 0: a zero-gradient entry's moments decay into them and stick there, slowing every later window
    flush_subnormals_([st.bufs, st.sq] if st.sq.numel() else [st.bufs])
    st.dropped.add_(torch.rsub(ok, 1.0))
    return ok


def fused_update(table: ParamTable, cfg: UpdateConfig, spec: MachineConfig):
    """The fused Triton update (trainer2.physics.kernels.fused_update.FusedUpdate) for this table, update section and
    machine (its readout's clamps): what flat_update and clamp_readout do, in two launches. Imports triton, so call it
    only once triton is chosen."""
    from trainer2.physics.kernels.fused_update import FusedUpdate

    return FusedUpdate(
        table.flat,
        cfg.update_rule == "adam",
        cfg.update_rule == "nesterov",
        cfg.momentum,
        cfg.adam_beta2,
        cfg.adam_eps,
        *(table.span_of(n) for n in ("g_diag", "theta", "r_sc")),
        spec.g_min,
        spec.g_max,
        spec.r_min,
    )


def fused_caps(machine: Machine) -> list[Callable[[Tensor], None]]:
    """The spectral cap of each coupling between state layers for the Triton update, called with its power vector:
    one launch (trainer2.physics.kernels.cap_power) for a dense coupling whose W one program holds, else the coupling's
    own cap_power (always under spectral_cap_mode clip: the kernel scales). Imports triton, so call it only once
    triton is chosen."""
    from trainer2.physics.kernels.cap_power import CapPower, fits

    cap = coupling_cap(machine.spec)  # a subclass of Dense may cap otherwise: only Dense itself takes the kernel
    if machine.spec.spectral_cap_mode == "clip":
        return [partial(c.cap_power, cap, clip=True) for c in machine.energy.between_states]
    return [
        CapPower(c.weight, cap) if type(c) is Dense and fits(c.weight) else partial(c.cap_power, cap)
        for c in machine.energy.between_states
    ]


def metrics_kernel(table: ParamTable, machine: Machine):
    """The window's metrics in two Triton launches (trainer2.physics.kernels.window_metrics) where
    `metrics_kernel_wanted` takes them for this device and the class probabilities fit one program, else None (the
    torch operators). Imports triton, so call it only once the fused update is chosen."""
    from trainer2.physics.kernels.window_metrics import WindowMetrics, fits

    if not metrics_kernel_wanted(table.flat.device) or not fits(machine.num_classes):
        return None
    spans = {g: table.spans[g] for g in GROUPS if g in table.spans}
    return WindowMetrics(table.flat, spans, MetricSums.slots(), machine.num_classes)


# Sums over a log interval; `MetricSums.read` turns them into the logged means. Checkpoints keep them (one tensor for
# the first ones, one for each added later, so checkpoints written before an addition still load).
METRICS = (
    "windows",
    "examples",
    "loss_sum",
    "correct_sum",
    "lior_mean",
    "spd_mean",
    "spd_last",
    "lior_nudge",
    "R_mean",
    "dropped",
    "update_norm_energy",
    "update_norm_readout",
    "update_norm_embed",
    "nonfinite_params",
    "spd_last_nudge",
)
ADDED_METRICS = ("spd_last_nudge",)  # the last ones of METRICS, added after checkpoints held the others


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

    @staticmethod
    def slots() -> dict[str, int]:
        """Each metric's index in the sums tensor (for a kernel that adds to them in place)."""
        return {k: i for i, k in enumerate(METRICS)}

    def tensors(self) -> dict[str, Tensor]:
        """The sums by checkpoint key, views that loading copies into: "metrics" (the metrics checkpoints have always
        held) and "metrics.<name>" for each added later (absent from older checkpoints, where it restarts at 0)."""
        first = len(METRICS) - len(ADDED_METRICS)
        return {
            "metrics": self.values[:first],
            **{f"metrics.{k}": self.values[first + i : first + i + 1] for i, k in enumerate(ADDED_METRICS)},
        }

    def read(self, *extra: Tensor) -> tuple[dict[str, float], list[float]]:
        """(sums by name, values of the 0-dim `extra` tensors) in one device-to-host transfer; then reset."""
        flat = torch.cat([self.values, *(t.reshape(1).to(self.values.dtype) for t in extra)]).tolist()
        self.values.zero_()
        return dict(zip(METRICS, flat[: len(METRICS)], strict=True)), flat[len(METRICS) :]


class Updater:
    """Update state, constraints and metric sums for one machine; `gather` then `apply` is the update half of a batch
    step. The flat gradient buffer `grad` is where a gradient all-reduce (under torchrun) works in place."""

    def __init__(self, machine: Machine, cfg: UpdateConfig, table: ParamTable) -> None:
        self.m, self.cfg, self.table = machine, cfg, table
        self.state = UpdateState.allocate(table.flat, [c.power_size for c in machine.energy.between_states], cfg)
        self.metrics = MetricSums(table.flat)
        self.grad, self.step = torch.zeros_like(table.flat), torch.zeros_like(table.flat)
        self.step_parts = {g: self.step[table.spans[g]] for g in GROUPS if g in table.spans}  # views, made once
        self.counts: dict[int, Tensor] = {}  # 0-dim constants for the per-window counts, by value
        # The update's backend, chosen once: torch's operators, or the fused Triton update (readout clamps included)
        self.backend = choose_update_backend(cfg.update_backend, table.flat.device, table.flat.dtype)
        self.fused = fused_update(table, cfg, machine.spec) if self.backend.name == "triton" else None
        self.caps = fused_caps(machine) if self.fused is not None else []
        # Beside the fused update, the window's metrics in two launches (kernels/window_metrics.py) where
        # metrics_kernel_wanted says so
        self.metrics_kernel = metrics_kernel(table, machine) if self.fused is not None else None

    def gather(self, grads: dict[str, Tensor]) -> Tensor:
        """Copy the named gradients into the flat buffer (one copy); returns it."""
        return torch.cat([g.reshape(-1) for g in self.table.ordered(grads)], out=self.grad)

    def apply(self, out: StepResult, targets: Tensor) -> None:
        """Update every parameter from the gathered gradient, project the constraints, add the window's metrics."""
        t = self.table
        if self.fused is None:
            ok = flat_update(t.flat, self.grad, self.state, t.mult, t.decay_flat, self.cfg, self.step)
            project_constraints(self.m, self.state.power_vecs)
        else:  # the fused kernel clamps the readout too
            s = self.state
            ok = self.fused(t.flat, self.grad, s.bufs, s.sq, s.count, s.lr, s.dropped, t.mult, t.decay_flat, self.step)
            for cap, u in zip(self.caps, s.power_vecs):  # no vectors, no caps (as cap_spectral)
                cap(u)
        if self.metrics_kernel is None:
            self.metrics.add(self.window_metrics(out, targets, ok))
        else:
            st = out.stats
            stats = (st.lior_mean, st.spd_mean, st.spd_last, st.R_mean, st.lior_nudge, st.spd_last_nudge)
            self.metrics_kernel(self.metrics.values, out.loss, out.probs, targets, ok, stats, self.step, t.flat)

    def window_metrics(self, out: StepResult, targets: Tensor, ok: Tensor) -> dict[str, Tensor]:
        """One window's metrics by name, 0-dim tensors (the torch operators; the metrics kernel adds the same)."""
        st, flat = out.stats, self.table.flat
        return {
            "windows": self.count(1),
            "examples": self.count(targets.shape[0]),
            "loss_sum": out.loss.sum(),
            "correct_sum": (out.probs.argmax(1) == targets).sum(dtype=flat.dtype),
            "lior_mean": st.lior_mean,
            "spd_mean": st.spd_mean,
            "spd_last": st.spd_last,
            "lior_nudge": st.lior_nudge,
            "spd_last_nudge": st.spd_last_nudge,
            "R_mean": st.R_mean,
            "dropped": torch.rsub(ok, 1.0),
            **{
                f"update_norm_{g}": torch.linalg.vector_norm(self.step_parts[g])  # Tensor.norm's kernel
                if g in self.step_parts
                else self.count(0)
                for g in GROUPS
            },
            # 1 when a parameter is not finite after this update: NaN and inf carry through the sum (so does a sum
            # past the float range, ~1e38: such a parameter has blown up anyway), and sum * 0 is NaN exactly then
            "nonfinite_params": flat.sum().mul_(0.0).nan_to_num_(nan=1.0),
        }

    def count(self, value: int) -> Tensor:
        """A 0-dim constant on the device, made on first use (before any graph capture) and then reused; made inside the
        step, it is an inference tensor, which is fine because nothing ever writes to it."""
        if value not in self.counts:
            self.counts[value] = torch.tensor(float(value), dtype=self.table.flat.dtype, device=self.table.flat.device)
        return self.counts[value]

    def tensors(self) -> dict[str, Tensor]:
        """Update state and metric sums by checkpoint key."""
        return {**self.state.tensors(self.table), **self.metrics.tensors()}
