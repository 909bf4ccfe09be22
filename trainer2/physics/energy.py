"""The energy: a chain of couplings over box-constrained layers, with its exact forces (no autograd).

State layers s = (h_1, ..., h_M, q) with h_0 = x clamped; couplings[i] joins layer i - 1 (the input for i = 0)
to layer i, and the last one reaches the output coordinates q:

    E(s) = sum_i 1/2 |s_i|^2 + sum_i E_i(s_{i-1}, s_i)          (a dense E_i is -s_i . (W_i s_{i-1} + b_i))

Every layer is a (B, size) block of rows; the couplings own the arithmetic, this module only walks the chain.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from trainer2.components import resolve
from trainer2.physics.couplings import Conv, Coupling, Dense


@dataclass(frozen=True)
class Energy:
    """The couplings in chain order; couplings[0] is driven by the clamped input, couplings[-1] drives q."""

    couplings: tuple[Coupling, ...]

    @property
    def depth(self) -> int:
        """M, the number of hidden layers."""
        return len(self.couplings) - 1

    @property
    def output(self) -> Coupling:
        """The coupling into the output coordinates q (its bias is folded into the readout's step)."""
        return self.couplings[-1]

    @property
    def between_states(self) -> tuple[Coupling, ...]:
        """The couplings between state layers (all but the first, which only touches the clamped input): the
        ones the spectral cap bounds."""
        return self.couplings[1:]

    def state_sizes(self) -> list[int]:
        """[H_1, ..., H_M, n]: the width of every state layer's row block."""
        return [math.prod(c.above_shape) for c in self.couplings]

    def parameters(self) -> dict[str, Tensor]:
        """Every coupling's tensors by name, in chain order: W_1, b_1, ..., W_out, b_out for a dense chain."""
        return {k: v for c in self.couplings for k, v in c.parameters().items()}

    def decayed(self) -> frozenset[str]:
        return frozenset().union(*(c.decayed() for c in self.couplings))

    def rebind(self, named: dict[str, Tensor]) -> "Energy":
        return replace(self, couplings=tuple(c.rebind(named) for c in self.couplings))

    def for_window(self) -> "Energy":
        """The energy as one window sees it (its parameters fixed until the update): a conv coupling's pooled kernel
        derived once, not at every pull; the same arithmetic. Call it again after the parameters change."""
        if not any(isinstance(c, Conv) for c in self.couplings):
            return self
        return replace(self, couplings=tuple(c.with_kernel() if isinstance(c, Conv) else c for c in self.couplings))

    def kinds(self) -> list[str]:
        """Each coupling's kind: a built-in's short name for the built-in class itself, else its class's dotted path
        (a subclass of Dense may change what its pulls compute, so it is not "dense" to the Triton kernels)."""
        builtin = {Dense: Dense.kind, Conv: Conv.kind}
        return [builtin.get(type(c), f"{type(c).__module__}.{type(c).__qualname__}") for c in self.couplings]

    @property
    def weights(self) -> list[Tensor]:
        """W_1 .. W_out of a dense chain (tests and the autograd references read them)."""
        return [c.weight for c in self.couplings]

    @property
    def biases(self) -> list[Tensor]:
        return [c.bias for c in self.couplings]


def layer_shapes(
    input_shape: tuple[int, ...], layers: list[dict[str, Any]]
) -> list[tuple[str, object, tuple[int, ...]]]:
    """(kind, spec, shape) of every hidden layer of a config's `layers` list ([{dense: 256}, ...]) above an input of
    `input_shape` ((D,) flat, (C, H, W) an image); a layer that cannot sit on the one below is a ValueError naming
    it."""
    out, below = [], input_shape
    for i, entry in enumerate(layers):
        ((kind, spec),) = entry.items()
        try:
            below = resolve("coupling", kind).spec_size(spec, below)
        except ValueError as e:
            raise ValueError(f"layer {i} ({kind}): {e}") from None
        out.append((kind, spec, below))
    return out


def init_energy(
    input_shape: tuple[int, ...],
    layers: list[dict[str, Any]],
    n: int,
    out_scale: float,
    gen: torch.Generator,
    dtype: torch.dtype,
) -> Energy:
    """The chain input -> hidden layers -> q, each coupling initialised by its kind from `gen` in chain order; the
    coupling into q is dense and shrunk by out_scale, so the energy starts convex."""
    hidden = layer_shapes(input_shape, layers)
    belows = [input_shape, *(shape for _, _, shape in hidden)]
    entries = [(kind, spec) for kind, spec, _ in hidden] + [("dense", n)]
    couplings = []
    for i, ((kind, spec), below) in enumerate(zip(entries, belows)):
        last = i == len(entries) - 1
        name = "out" if last else str(i + 1)
        couplings.append(resolve("coupling", kind).init(name, below, spec, out_scale if last else 1.0, gen, dtype))
    return Energy(tuple(couplings))


def energy(s: list[Tensor], x: Tensor, e: Energy) -> Tensor:
    """E(s) per example (B,); for tests and diagnostics, not the hot loop."""
    total = torch.zeros(x.shape[0], dtype=x.dtype, device=x.device)
    for si, below, c in zip(s, [x, *s[:-1]], e.couplings):
        total = total + 0.5 * (si * si).sum(1) + c.energy(below, si)
    return total


def input_drive(x: Tensor, e: Energy, out: Tensor) -> Tensor:
    """out (B, H_1): the clamped input's pull on the first layer (W_1 x + b_1), fixed for a whole window."""
    return e.couplings[0].up(x, out)


def forces(s: list[Tensor], drive: Tensor, e: Energy, out: list[Tensor]) -> None:
    """out[i] = -dE/ds_i = -s_i + (pull from below) + (pull from above), in place (allocation-free)."""
    last = len(s) - 1
    for i, si in enumerate(s):
        if i == 0:
            out[i].copy_(drive)
        else:
            e.couplings[i].up(s[i - 1], out[i])
        if i < last:
            e.couplings[i + 1].add_down(s[i + 1], si, out[i])
        out[i].sub_(si)


def ep_grads(
    s_plus: list[Tensor],
    s_minus: list[Tensor],
    x: Tensor,
    e: Energy,
    scale: float,
    at: list[Tensor] | None,
    input_grad: bool = True,
) -> tuple[dict[str, Tensor], Tensor | None]:
    """The EP statistic (dE/dtheta(s+) - dE/dtheta(s-)) * scale of every coupling parameter, by name, and the
    per-example gradient with respect to the clamped input x (B, D), or None without input_grad (data that is not
    a learned embedding); summed over the batch (callers fold 1/(divisor B) into scale). `at`: the free equilibrium,
    whose max-pooling argmax both phases take (Coupling.ep_grads), or None for each phase's own."""
    grads, gx = e.couplings[0].ep_grads_clamped(x, s_plus[0], s_minus[0], scale, input_grad)
    for i, c in enumerate(e.couplings[1:], start=1):
        # only a piecewise coupling is handed `at` (a bilinear one may keep the three arguments of before it)
        piece = {"at": at[i - 1]} if at is not None and c.down_reads_below else {}
        grads.update(c.ep_grads((s_plus[i - 1], s_plus[i]), (s_minus[i - 1], s_minus[i]), scale, **piece))
    return grads, gx
