"""The parameter table: every learned tensor by name, with its group, learning-rate multiplier and decay.

Built once at set-up from `Machine.named_params()`, which is the one place the parameter order is
written down. Gradients are produced and consumed by name; the update runs over the table's lists.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from trainer2.config import TrainConfig
from trainer2.machine import Machine

GROUPS = ("energy", "readout", "embed")


def param_group(name: str) -> str:
    """'energy', 'readout' or 'embed': which learning rate (and decay) a parameter gets."""
    if name == "emb":
        return "embed"
    return "energy" if name[:2] in ("W_", "b_") else "readout"


@dataclass(frozen=True)
class ParamTable:
    """Parallel lists in `Machine.named_params()` order: name, live tensor, group, lr multiplier, L2 decay."""

    names: tuple[str, ...]
    tensors: tuple[Tensor, ...]
    groups: tuple[str, ...]
    mults: tuple[float, ...]
    decay: tuple[float, ...]

    @staticmethod
    def build(machine: Machine, cfg: TrainConfig) -> "ParamTable":
        named = machine.named_params()
        scale = {"energy": 1.0, "readout": cfg.eta_readout_scale, "embed": cfg.eta_embed_scale}
        groups = tuple(param_group(n) for n in named)
        return ParamTable(
            names=tuple(named), tensors=tuple(named.values()), groups=groups,
            mults=tuple(scale[g] for g in groups),
            decay=tuple(cfg.weight_decay if n.startswith("W_") else 0.0 for n in named),
        )

    def ordered(self, grads: dict[str, Tensor]) -> list[Tensor]:
        """The gradients in table order; a missing or extra name is an error (Python-side, no tensor read)."""
        if grads.keys() != set(self.names):
            raise KeyError(f"gradients for {sorted(grads)} do not match the parameters {sorted(self.names)}")
        return [grads[n] for n in self.names]
