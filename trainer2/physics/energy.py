"""The energy: couplings over box-constrained layers, joined as its graph says, with its exact forces (no autograd).

State layers s = (h_1, ..., h_M, q) with x clamped; coupling k joins the layers graph.edges[k] = (below, above) (the
input for below -1), and the last one, the head, reaches the output coordinates q:

    E(s) = sum_j 1/2 |s_j|^2 + sum_k E_k(s_below(k), s_above(k))      (a dense E_k is -above . (W_k below + b_k))

A chain (the default graph) has couplings[i] from layer i - 1 to layer i. Every layer is a (B, size) block of rows;
the couplings own the arithmetic, the graph (trainer2.physics.graph) says which layers they join, and this module
walks it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from trainer2.components import resolve
from trainer2.physics.couplings import Conv, Conv1d, Coupling, Dense
from trainer2.physics.graph import Graph, Plan


@dataclass(frozen=True)
class Energy:
    """The couplings in graph order (a chain's: couplings[0] is driven by the clamped input), couplings[-1] drives q;
    `graph` says which layers each joins (None: the chain)."""

    couplings: tuple[Coupling, ...]
    graph: Graph = None  # type: ignore[assignment]  # set to the chain of the couplings when not given
    # per state layer, the biases of its couplings beyond the first, summed once for a window (`for_window`), for the
    # layers of a graph that more than one coupling from a state layer reaches; None elsewhere
    rest_bias: tuple[Tensor | None, ...] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.graph is None:
            object.__setattr__(self, "graph", Graph.chain(len(self.couplings) - 1))

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
        """The couplings between state layers (a chain's all but the first, which only touches the clamped input):
        the ones the spectral cap bounds."""
        if self.graph.is_chain:
            return self.couplings[1:]
        return tuple(self.couplings[k] for k in self.graph.between_states())

    def lr_scales(self) -> dict[str, float]:
        """Each coupling parameter's learning-rate multiplier by name (the graph's per-coupling `lr`)."""
        return {k: lr for c, lr in zip(self.couplings, self.graph.lr_scales) for k in c.parameters()}

    def state_sizes(self) -> list[int]:
        """[H_1, ..., H_M, n]: the width of every state layer's row block (a graph's in its layers' order)."""
        if self.graph.is_chain:
            return [math.prod(c.above_shape) for c in self.couplings]
        return [math.prod(self.couplings[into[0]].above_shape) for into in self.graph.into]

    def parameters(self) -> dict[str, Tensor]:
        """Every coupling's tensors by name, in chain order: W_1, b_1, ..., W_out, b_out for a dense chain."""
        return {k: v for c in self.couplings for k, v in c.parameters().items()}

    def decayed(self) -> frozenset[str]:
        return frozenset().union(*(c.decayed() for c in self.couplings))

    def rebind(self, named: dict[str, Tensor]) -> "Energy":
        return replace(self, couplings=tuple(c.rebind(named) for c in self.couplings), rest_bias=None)

    def for_window(self) -> "Energy":
        """The energy as one window sees it (its parameters fixed until the update): a conv coupling's pooled kernel
        derived once, not at every pull, and a graph's summed biases (`rest_bias`); the same arithmetic. Call it
        again after the parameters change."""
        e = self if self.graph.is_chain else replace(self, rest_bias=rest_biases(self))
        if not any(isinstance(c, Conv) for c in self.couplings):
            return e
        return replace(e, couplings=tuple(c.with_kernel() if isinstance(c, Conv) else c for c in self.couplings))

    def kinds(self) -> list[str]:
        """Each coupling's kind: a built-in's short name for the built-in class itself, else its class's dotted path
        (a subclass of Dense may change what its pulls compute, so it is not "dense" to the Triton kernels)."""
        builtin = {Dense: Dense.kind, Conv: Conv.kind, Conv1d: Conv1d.kind}
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
    """(kind, spec, shape) of every hidden layer of a chain config's `layers` list ([{dense: 256}, ...]) above an input
    of `input_shape` ((D,) flat, (C, H, W) an image); a layer that cannot sit on the one below is a ValueError naming
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


def coupling_shapes(input_shape: tuple[int, ...], p: Plan) -> list[tuple[int, ...]]:
    """The shape of the layer below every coupling of a plan, in graph order (the input's for one from the input),
    before anything is allocated; a coupling that cannot sit on its layer below, or two couplings into one layer that
    make different shapes, are a ValueError naming them."""
    g = p.graph
    if g.is_chain:
        hidden = layer_shapes(input_shape, [{e.kind: e.spec} for e in p.entries[:-1]])
        return [input_shape, *(shape for _, _, shape in hidden)]
    named = ("input", *g.names)
    shapes: list[tuple[int, ...] | None] = [None] * len(g.names)
    for k, ((b, a), entry) in enumerate(zip(g.edges, p.entries)):
        below = input_shape if b < 0 else shapes[b]
        where = f"coupling {k} ({named[b + 1]} -> {named[a + 1]}, {entry.kind})"
        try:
            made = resolve("coupling", entry.kind).spec_size(entry.spec, below)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        if shapes[a] is not None and tuple(shapes[a]) != tuple(made):
            raise ValueError(
                f"{where} makes layer {named[a + 1]} {tuple(made)}, but the coupling before it into that layer makes "
                f"{tuple(shapes[a])}: the shapes do not meet"
            )
        shapes[a] = tuple(made)
    return [input_shape if b < 0 else shapes[b] for b, _ in g.edges]


def init_energy(input_shape: tuple[int, ...], p: Plan, gen: torch.Generator, dtype: torch.dtype) -> Energy:
    """The energy of a plan (trainer2.physics.graph.plan) above an input of `input_shape`, each coupling initialised by
    its kind from `gen` in graph order and scaled by its gain (the head, dense into q, by out_init_scale unless given:
    the energy starts convex). Every shape is checked before the first tensor is made."""
    belows = coupling_shapes(input_shape, p)
    couplings = []
    for k, (entry, below) in enumerate(zip(p.entries, belows)):
        name = "out" if k == len(p.entries) - 1 else str(k + 1)
        couplings.append(resolve("coupling", entry.kind).init(name, below, entry.spec, entry.gain, gen, dtype))
    return Energy(tuple(couplings), None if p.graph.is_chain else p.graph)


def rest_biases(e: Energy) -> tuple[Tensor | None, ...]:
    """Per state layer that is not driven by the input and that more than one coupling reaches: the biases of all but
    the first of those couplings, summed (the first's `up` adds its own); None for every other layer."""
    g, driven = e.graph, set(e.graph.driven)
    out: list[Tensor | None] = []
    for j, into in enumerate(g.into):
        if j in driven or len(into) < 2:
            out.append(None)
            continue
        out.append(torch.stack([e.couplings[k].bias for k in into[1:]]).sum(0))
    return tuple(out)


def energy(s: list[Tensor], x: Tensor, e: Energy) -> Tensor:
    """E(s) per example (B,); for tests and diagnostics, not the hot loop."""
    total = torch.zeros(x.shape[0], dtype=x.dtype, device=x.device)
    for si in s:
        total = total + 0.5 * (si * si).sum(1)
    for (b, a), c in zip(e.graph.edges, e.couplings):
        total = total + c.energy(x if b < 0 else s[b], s[a])
    return total


def input_drive(x: Tensor, e: Energy, out: list[Tensor]) -> None:
    """out[i] (B, H_j) for the i-th layer j the input drives (a chain's: h_1 alone): the clamped input's pulls on it
    and, in a graph, the biases of the other couplings into it (W_1 x + b_1 for a chain), fixed for a whole window."""
    if e.graph.is_chain:
        e.couplings[0].up(x, out[0])
        return
    for j, drive in zip(e.graph.driven, out, strict=True):
        into = e.graph.into[j]
        for n, k in enumerate(into):
            b = e.graph.edges[k][0]
            if n == 0:
                e.couplings[k].up(x, drive) if b < 0 else drive.copy_(e.couplings[k].bias)
            elif b < 0:
                e.couplings[k].add_up(x, drive).add_(e.couplings[k].bias)
            else:
                drive.add_(e.couplings[k].bias)


def graph_pulls(
    e: Energy, s: list[Tensor], drives: dict[int, Tensor], j: int, value: Callable[[int], Tensor], out: Tensor
) -> None:
    """out = -dE/ds_j + s_j of a graph's hidden layer j: its drive (if the input reaches it) or its first coupling's
    pull with bias, the other couplings' from below, and the pulls of the couplings from it to the layers above (at
    layer j's current value s[j], which a max-pooled coupling reads). value(i): the value layer i is read at (the q
    a step holds, for q)."""
    g, c = e.graph, e.couplings
    into = [k for k in g.into[j] if g.edges[k][0] >= 0]  # from state layers (the input's are in the drive)
    if j in drives:
        out.copy_(drives[j])
        rest = into
    else:
        c[into[0]].up(value(g.edges[into[0]][0]), out)
        rest = into[1:]
    for k in rest:
        c[k].add_up(value(g.edges[k][0]), out)
    if rest and j not in drives:
        out.add_(e.rest_bias[j])
    for k in g.out_of[j]:
        c[k].add_down(value(g.edges[k][1]), s[j], out)


def forces(s: list[Tensor], drive: Tensor | list[Tensor], e: Energy, out: list[Tensor]) -> None:
    """out[i] = -dE/ds_i = -s_i + (pull from below) + (pull from above), in place (allocation-free); drive: a chain's
    (B, H_1), or a graph's list (input_drive)."""
    if not e.graph.is_chain:
        e = e if e.rest_bias is not None else replace(e, rest_bias=rest_biases(e))
        drives = dict(zip(e.graph.driven, drive, strict=True))
        for j, si in enumerate(s):
            graph_pulls(e, s, drives, j, s.__getitem__, out[j])
            out[j].sub_(si)
        return
    drive = drive[0] if isinstance(drive, list) else drive
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
    grads: dict[str, Tensor] = {}
    gx = None
    for (b, a), c in zip(e.graph.edges, e.couplings):
        if b < 0:  # from the clamped input: the same x in both phases
            g, gxk = c.ep_grads_clamped(x, s_plus[a], s_minus[a], scale, input_grad)
            grads.update(g)
            gx = gxk if gx is None else gx.add_(gxk)
            continue
        # only a piecewise coupling is handed `at` (a bilinear one may keep the three arguments of before it)
        piece = {"at": at[b]} if at is not None and c.down_reads_below else {}
        grads.update(c.ep_grads((s_plus[b], s_plus[a]), (s_minus[b], s_minus[a]), scale, **piece))
    return grads, gx
