"""The whole batch step, wired once: relaxation + gradient source + update + memory write.

`build_step` is the one place these parts are put together; the Trainer calls it at set-up and the
StepRunner runs the result eagerly, compiled, or as a replayed CUDA graph. Nothing swaps a part later:
the learning rule (or a different gradient source) is chosen at construction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from trainer2.components import resolve
from trainer2.learning.averaging import WeightAverage
from trainer2.learning.gradients import GradientSource
from trainer2.learning.params import ParamTable
from trainer2.learning.update import UpdateConfig, Updater
from trainer2.physics.machine import Machine
from trainer2.physics.memory import MemoryBank
from trainer2.physics.relaxation import DynamicsConfig, Relaxation


class Collectives(Protocol):
    """The processes of a run, as the batch step sees them (trainer2.running.distributed.Distributed under torchrun)."""

    world_size: int
    launched: bool  # started by torchrun: a process group exists

    def all_reduce_sum(self, t: Tensor, what: str) -> None: ...


@dataclass(frozen=True)
class GradReducer:
    """Averages the flat gradient buffer (every parameter's gradient, gathered by the update) over the ranks with one
    all-reduce, in place. A non-finite gradient on any rank makes the sum non-finite everywhere, so every rank drops
    the same update."""

    flat: Tensor
    dist: Collectives

    def __call__(self) -> None:
        # Nothing reads a value back, so a CUDA graph can capture it (NCCL collectives are capturable). The update
        # needs the result at once, so there is nothing to overlap.
        self.dist.all_reduce_sum(self.flat, "the gradient all-reduce")
        self.flat.div_(self.dist.world_size)


@dataclass(frozen=True)
class BatchStep:
    """`step(inputs, targets)`: free phase, nudged phase(s), update, constraints, memory write, metrics —
    the unit a CUDA graph captures. Frozen: its parts are fixed once built."""

    relax: Relaxation
    gradients: GradientSource
    updater: Updater
    memory: MemoryBank | None
    reducer: GradReducer | None = None  # under torchrun: averages the gathered gradient over the ranks
    average: WeightAverage | None = None  # ema_decay > 0: the parameters' moving average, moved after each update

    @property
    def device(self) -> torch.device:
        return self.relax.device

    def step(self, inputs: Tensor, targets: Tensor) -> None:
        out = self.gradients(self.relax, inputs, targets)
        with self.relax.phase("update"):
            self.updater.gather(out.grads)
        if self.reducer is not None:
            with self.relax.phase("allreduce"):  # includes waiting for the slowest rank
                self.reducer()
        with self.relax.phase("update"):
            self.updater.apply(out, targets)
            if self.average is not None:
                self.average.update()
            if self.memory is not None:
                self.memory.write(self.relax.s0.s[-1], targets)


def build_step(
    machine: Machine,
    dynamics: DynamicsConfig,
    update: UpdateConfig,
    batch: int,
    memory: MemoryBank | None = None,
    gradients: GradientSource | None = None,
    table: ParamTable | None = None,
    dist: Collectives | None = None,
    rule: str = "ep",
) -> BatchStep:
    """A batch step for `batch` examples over `machine`. The learning rule `rule` (a name, trainer2.components: ep,
    ep_positive, ep_negative, chl, coupled, rbp, or a dotted path) says which phases follow the free phase and forms
    the gradient, unless another gradient source is given (it then runs the rule's phases' workspaces); under
    torchrun (`dist.launched`) the gradients are averaged over the ranks before the update; with update.ema_decay > 0
    the step also keeps the parameters' moving average (trainer2.learning.averaging)."""
    found = resolve("rule", rule)
    table = ParamTable.build(machine, update.eta_scales, update.weight_decay) if table is None else table
    updater = Updater(machine, update, table)
    reducer = GradReducer(updater.grad, dist) if dist is not None and dist.launched else None
    relax = Relaxation(machine, dynamics, batch, memory, found.scheme(dynamics))
    # beside the fused update, the average moves in one Triton launch too (its angles at the table's theta)
    theta = table.span_of("theta") if updater.fused is not None else None
    average = WeightAverage.of(machine, update.ema_decay, theta) if update.ema_decay else None
    source = found.gradients if gradients is None else gradients
    return BatchStep(relax, source, updater, memory, reducer=reducer, average=average)
