"""Weight averaging: an exponential moving average of the parameters, kept as a second machine that evaluation reads.

After the t-th update (t = 0, 1, ...), `average <- d * average + (1 - d) * parameters` with
`d = min(decay, (1 + t) / (10 + t))`: early on the average spans about the last tenth of the windows so far, so a short
run's average is not held near the initial parameters, and from t = 9 / (1 - decay) - 10 on it is the plain exponential
average (TensorFlow's ExponentialMovingAverage with num_updates; timm's ModelEma). One `lerp_` over the flat buffer
and a few 1-element operators, inside the batch step, so a captured graph or a compiled step runs it too; the rotor's
angles, which the update wraps to [-pi, pi), are averaged on the circle (the turn toward each angle taken the short
way round, and wrapped to [-pi, pi) as the parameters are). Beside the fused update (--update_backend triton) one
Triton launch and the count's increment do the same (trainer2.physics.kernels.weight_average). Training never reads
the average: the run's arithmetic is the same with or without it. The average keeps the constraints (a spectral norm
below a cap and the readout's clamps are convex sets), so it is a machine like any other. Polyak & Juditsky 1992;
timm's ModelEmaV2.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from trainer2.physics.machine import Machine, move_machine

PREFIX = "average."  # checkpoint keys of the averaged parameters: average.<parameter name>
COUNT = "averaging.updates"  # checkpoint key of the number of updates averaged (t), (1,)


@dataclass(frozen=True)
class WeightAverage:
    """The average of `source`'s parameters as a machine of its own (`machine.flat` is the average, (P,)), the decay
    per window, the updates averaged so far t (1,), scratch buffers for this update's weight 1 - d (1,) and the
    angles' turns (rotor_k,), and the Triton kernel that moves it instead of the torch operators, if any."""

    machine: Machine
    source: Machine
    decay: float
    count: Tensor
    weight: Tensor
    turn: Tensor
    kernel: Callable[[Tensor, Tensor, Tensor], None] | None = None

    @staticmethod
    def of(machine: Machine, decay: float, theta: slice | None = None) -> "WeightAverage":
        """An average of `machine`'s parameters that starts at their current values; with `theta` (the angles'
        elements of the flat buffer) moved by the Triton kernel, which imports triton."""
        average, zero = move_machine(machine, machine.flat.device), machine.flat.new_zeros(1)
        kernel = None
        if theta is not None:
            from trainer2.physics.kernels.weight_average import AverageKernel

            kernel = AverageKernel(machine.flat, theta, decay)
        return WeightAverage(average, machine, decay, zero, zero.clone(), machine.readout.theta.clone(), kernel)

    def update(self) -> None:
        """Move the average toward the parameters by 1 - d (module docstring); no allocation, no host sync."""
        if self.kernel is not None:
            self.kernel(self.machine.flat, self.source.flat, self.count)
            return
        w, avg = self.weight, self.machine.readout.theta
        torch.add(self.count, 10.0, out=w).reciprocal_().mul_(9.0).clamp_(min=1.0 - self.decay)  # 1 - d
        self.count.add_(1.0)
        # The angles move by w times the turn to theta the short way round, theta - avg - 2 pi k: k (the whole turns
        # in theta - avg) before the lerp, then 2 pi k w taken back off, and the result wrapped (else an angle that
        # keeps winding would take its average ever further from 0, losing precision)
        if self.turn.numel():
            torch.sub(self.source.readout.theta, avg, out=self.turn).mul_(1.0 / (2 * math.pi)).round_()
        self.machine.flat.lerp_(self.source.flat, w)
        if self.turn.numel():
            avg.addcmul_(self.turn, w, value=-2 * math.pi).add_(math.pi).remainder_(2 * math.pi).sub_(math.pi)

    def begun_anew(self, loaded: dict[str, Tensor]) -> bool:
        """After a resume from the tensors `loaded`: when they hold no average (a run with ema_decay 0, or older),
        start it at the resumed parameters, from t = 0, and return True."""
        if set(self.tensors()) <= loaded.keys():
            return False
        self.machine.flat.copy_(self.source.flat)
        self.count.zero_()
        return True

    def tensors(self) -> dict[str, Tensor]:
        """The averaged parameters and the update count by checkpoint key (views that loading copies into)."""
        return {**{PREFIX + n: v for n, v in self.machine.named_params().items()}, COUNT: self.count}


def average_keys(machine: Machine) -> frozenset[str]:
    """The checkpoint keys an average of `machine` would have: optional on load, as checkpoints written without
    averaging (or before it existed) hold none."""
    return frozenset(PREFIX + n for n in machine.named_params()) | {COUNT}
