"""The parameter table: every learned tensor by name, with its group, learning-rate multiplier and decay.

Built once at set-up from `Machine.named_params()`, which is the one place the parameter order is
written down. Gradients are produced and consumed by name; the update runs over the table's lists.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from trainer2.physics.machine import Machine, split_flat

GROUPS = ("energy", "readout", "embed")


@dataclass(frozen=True)
class ParamTable:
    """Parallel lists in `Machine.named_params()` order: name, live tensor (a view of the flat buffer), group; and
    each element's lr multiplier (its group's times its coupling's) and L2 decay over the flat buffer, for the
    whole-buffer update."""

    names: tuple[str, ...]
    tensors: tuple[Tensor, ...]
    groups: tuple[str, ...]
    flat: Tensor  # (P,) the machine's parameters
    mult: Tensor | None  # (P,) each element's lr multiplier; None when every group's is 1
    decay_flat: Tensor | None  # (P,) each element's decay; None when nothing decays
    spans: dict[str, slice]  # each group's elements (groups are contiguous in the parameter order)

    @staticmethod
    def build(machine: Machine, eta_scales: dict[str, float], weight_decay: float) -> "ParamTable":
        """The table of `machine`'s parameters; eta_scales: each group's lr multiplier (UpdateConfig.eta_scales);
        weight_decay: the L2 decay of the couplings' decayed tensors."""
        named = machine.named_params()
        scale = eta_scales
        group_of, decayed = machine.param_groups(), machine.energy.decayed()
        groups = tuple(group_of[n] for n in named)
        per_coupling = machine.energy.lr_scales()  # a graph's per-coupling `lr` (1 for a chain)
        mults = tuple(scale[g] * per_coupling.get(n, 1.0) for n, g in zip(named, groups))
        decay = tuple(weight_decay if n in decayed else 0.0 for n in named)
        flat, sizes = machine.flat, [t.numel() for t in named.values()]

        def per_element(values: tuple[float, ...]) -> Tensor:
            return torch.cat([torch.full((k,), v, dtype=flat.dtype) for k, v in zip(sizes, values, strict=True)]).to(
                flat.device
            )

        spans, at = {}, 0
        for g, k in zip(groups, sizes, strict=True):
            if g in spans and spans[g].stop != at:
                raise ValueError(f"parameter group {g!r} is not contiguous in {tuple(named)}")
            spans[g] = slice(spans[g].start if g in spans else at, at + k)
            at += k
        return ParamTable(
            names=tuple(named),
            tensors=tuple(named.values()),
            groups=groups,
            flat=flat,
            mult=per_element(mults) if any(v != 1.0 for v in mults) else None,
            decay_flat=per_element(decay) if any(decay) else None,
            spans=spans,
        )

    def ordered(self, grads: dict[str, Tensor]) -> list[Tensor]:
        """The gradients in table order; a missing or extra name is an error (Python-side, no tensor read)."""
        if grads.keys() != set(self.names):
            raise KeyError(f"gradients for {sorted(grads)} do not match the parameters {sorted(self.names)}")
        return [grads[n] for n in self.names]

    def span_of(self, name: str) -> slice:
        """The elements of parameter `name` in the flat buffer."""
        at = 0
        for n, t in zip(self.names, self.tensors, strict=True):
            if n == name:
                return slice(at, at + t.numel())
            at += t.numel()
        raise KeyError(f"no parameter {name!r} in {self.names}")

    def views(self, buf: Tensor) -> dict[str, Tensor]:
        """A flat (P,) buffer (gradient, momentum, ...) seen per parameter, by name, with each parameter's shape."""
        return split_flat(buf, {n: t.shape for n, t in zip(self.names, self.tensors, strict=True)})
