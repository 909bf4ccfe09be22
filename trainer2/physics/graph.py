"""The energy's topology: its state layers (each with a box), and which two layers each coupling joins.

A chain (`layers: [{dense: 256}, ...]`) is the graph input -> h_1 -> ... -> h_M -> q. The graph form names its layers
and joins any two, lower to higher, so residual machines (skip couplings, Hopfield-ResNets) can be written:

    layers:    [{name: h1, box: relu6}, {name: h2, box: relu6}]
    couplings: [{conv: {channels: 8, kernel: 3}, from: input, to: h1, gain: 0.6},
                {conv: {channels: 8, kernel: 3, stride: 2, padding: 1}, from: h1, to: h2},
                {conv: {channels: 8, kernel: 1, stride: 2, padding: 0}, from: input, to: h2, lr: 2.0},
                {from: h2, to: output}]                # the dense head into q (optional: from the last layer)

This module is the one place that says which layer touches which: the forces, the EP statistic, the adjoint, the
relaxation order, the spectral cap and the size checks all read a `Graph`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

INPUT, OUTPUT = "input", "output"  # the clamped data and the output coordinates q, named by every graph
BOXES: dict[str, tuple[float, float]] = {"unit": (0.0, 1.0), "relu6": (0.0, 6.0)}  # a state layer's [low, high]
LAYER_KEYS = {"name", "box"}
EDGE_KEYS = {"from", "to", "gain", "lr"}
MAX_GAIN = 1e3  # far above any useful initial scale; the spectral cap brings the couplings down anyway
MAX_LR_SCALE = 1e3


@dataclass(frozen=True)
class Graph:
    """State layers s[0..L-1] (q last) and couplings k = 0..K-1, each joining edges[k] = (below, above); below -1 is the
    clamped input. Couplings run lower to higher (below < above), and the one into q is the last (the head)."""

    names: tuple[str, ...]  # the state layers' names, q ("output") last
    boxes: tuple[tuple[float, float], ...]  # the box of each hidden layer (q is not boxed)
    edges: tuple[tuple[int, int], ...]
    lr_scales: tuple[float, ...]  # each coupling's learning-rate multiplier
    into: tuple[tuple[int, ...], ...] = field(init=False, repr=False)  # per layer: the couplings whose above it is
    out_of: tuple[tuple[int, ...], ...] = field(init=False, repr=False)  # per layer: the couplings whose below it is
    colouring: tuple[tuple[int, ...], ...] = field(init=False, repr=False)  # `colours()`, found once
    is_chain: bool = field(init=False, repr=False)  # coupling k joins layer k - 1 to layer k, every box [0, 1]

    def __post_init__(self) -> None:
        layers = range(len(self.names))
        into = tuple(tuple(k for k, (_, a) in enumerate(self.edges) if a == j) for j in layers)
        out_of = tuple(tuple(k for k, (b, _) in enumerate(self.edges) if b == j) for j in layers)
        chain = self.edges == tuple((j - 1, j) for j in layers) and all(b == BOXES["unit"] for b in self.boxes)
        for name, value in (("into", into), ("out_of", out_of), ("colouring", self.colours()), ("is_chain", chain)):
            object.__setattr__(self, name, value)

    @staticmethod
    def chain(depth: int) -> "Graph":
        """input -> h_1 -> ... -> h_depth -> q, boxes [0, 1], every learning rate as given."""
        names = (*(f"h{i + 1}" for i in range(depth)), OUTPUT)
        return Graph(names, (BOXES["unit"],) * depth, tuple((i - 1, i) for i in range(depth + 1)), (1.0,) * (depth + 1))

    @property
    def last(self) -> int:
        """The index of q."""
        return len(self.names) - 1

    @property
    def head(self) -> int:
        """The coupling into q (dense; the readout folds its bias)."""
        return len(self.edges) - 1

    @property
    def driven(self) -> tuple[int, ...]:
        """The layers the clamped input pulls (their drive is fixed for a window), lowest first."""
        return tuple(sorted({a for b, a in self.edges if b < 0}))

    def between_states(self) -> tuple[int, ...]:
        """The couplings between two state layers (not from the input): the ones the spectral cap bounds."""
        return tuple(k for k, (b, _) in enumerate(self.edges) if b >= 0)

    def neighbours(self, j: int) -> set[int]:
        return {b for b, a in self.edges if a == j and b >= 0} | {a for b, a in self.edges if b == j}

    def colours(self) -> tuple[tuple[int, ...], ...]:
        """The state layers in groups no two of which are coupled (greedy colouring, lowest layer first): a group moves
        at once from the latest values of the others. A chain's are its odd layers h_1, h_3, ... then its even ones."""
        colour: dict[int, int] = {}
        for j in range(len(self.names)):
            taken = {colour[i] for i in self.neighbours(j) if i in colour}
            colour[j] = next(c for c in range(len(self.names)) if c not in taken)
        return tuple(tuple(j for j in colour if colour[j] == c) for c in range(max(colour.values()) + 1))

    def adjacency_norm(self) -> float:
        """The largest eigenvalue of the state layers' adjacency (1 per coupled pair): a coupling block each of whose
        couplings has norm <= c has norm <= c times it (the chain's is 2 cos(pi / (M + 2)))."""
        n = len(self.names)
        pairs = {tuple(sorted((b, a))) for b, a in self.edges if b >= 0}
        v = [1.0] * n
        norm = 0.0
        for _ in range(2000):  # power iteration on a nonnegative symmetric matrix: the Perron root
            w = [v[j] + sum(v[i] for p in pairs if j in p for i in p if i != j) for j in range(n)]  # (A + I) v
            top = max(w)
            v = [x / top for x in w]
            if abs(top - 1.0 - norm) < 1e-13:
                break
            norm = top - 1.0
        return norm

    def describe(self) -> list[str]:
        """One line per coupling: `k: below -> above` by name (for --print_config and errors)."""
        named = (INPUT, *self.names)
        return [f"{k}: {named[b + 1]} -> {named[a + 1]}" for k, (b, a) in enumerate(self.edges)]


@dataclass(frozen=True)
class CouplingEntry:
    """One coupling of a config: its kind and spec, its initial scale (gain) and learning-rate multiplier."""

    kind: str
    spec: object
    gain: float
    lr: float


@dataclass(frozen=True)
class Plan:
    """A config's energy before any tensor: its graph and its couplings in graph order."""

    graph: Graph
    entries: tuple[CouplingEntry, ...]


def plan(layers: list[dict[str, Any]], couplings: list[dict[str, Any]], n: int, out_scale: float) -> Plan:
    """The energy a config's `layers` and `couplings` describe (couplings empty: the chain of `layers`), its head into
    q a dense coupling of n outputs; a malformed graph is a ValueError naming the layer or coupling."""
    if not couplings:
        entries = [CouplingEntry(*only_item(e, f"layer {i}"), 1.0, 1.0) for i, e in enumerate(layers)]
        return Plan(Graph.chain(len(layers)), (*entries, CouplingEntry("dense", n, out_scale, 1.0)))
    names, boxes = graph_layers(layers)
    index = {name: j for j, name in enumerate(names)}
    index.update({INPUT: -1, OUTPUT: len(names)})
    edges, entries, head = [], [], None
    for k, entry in enumerate(couplings):
        where = f"coupling {k}"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: expected a mapping {{KIND: SPEC, from: LAYER, to: LAYER}}, got {entry!r}")
        ends = [entry.get("from"), entry.get("to")]
        for end, key in zip(ends, ("from", "to")):
            if end is None:
                raise ValueError(f"{where}: needs `{key}` (a layer's name, `{INPUT}` or `{OUTPUT}`)")
            if end not in index:
                raise ValueError(f"{where}: {key} {end!r} is no layer; the layers are {[INPUT, *names, OUTPUT]}")
        below, above = index[ends[0]], index[ends[1]]
        where = f"coupling {k} ({ends[0]} -> {ends[1]})"
        if not below < above:
            raise ValueError(
                f"{where}: a coupling runs from a lower layer to a higher one ({INPUT} first, the layers in their "
                f"listed order, {OUTPUT} last)"
            )
        gain = scalar(entry, "gain", where, MAX_GAIN, unset_value(entry, "gain", out_scale))
        lr = scalar(entry, "lr", where, MAX_LR_SCALE, unset_value(entry, "lr", out_scale))
        rest = {key: v for key, v in entry.items() if key not in EDGE_KEYS}
        if above == len(names):  # the head: dense into q
            if rest or head is not None or below < 0:
                why = "only one coupling reaches output" if head is not None else "it is the dense head into q"
                why = "output is reached from a state layer, not the input" if below < 0 else why
                raise ValueError(f"{where}: {why}; write it as {{from: LAYER, to: {OUTPUT}, gain: G, lr: R}}")
            head = (below, gain, lr)
            continue
        kind, spec = only_item(rest, where)
        edges.append((below, above))
        entries.append(CouplingEntry(kind, spec, gain, lr))
    below, gain, lr = head if head is not None else (len(names) - 1, out_scale, 1.0)
    edges.append((below, len(names)))
    entries.append(CouplingEntry("dense", n, gain, lr))
    reached = {a for _, a in edges}
    lonely = [name for j, name in enumerate(names) if j not in reached]
    if lonely:
        raise ValueError(f"layer {lonely[0]}: no coupling reaches it (each layer needs one coupling `to:` it)")
    graph = Graph((*names, OUTPUT), tuple(boxes), tuple(edges), tuple(e.lr for e in entries))
    return Plan(graph, tuple(entries))


def graph_layers(layers: list[dict[str, Any]]) -> tuple[list[str], list[tuple[float, float]]]:
    """The names and boxes of a graph's `layers` entries ({name: NAME, box: unit|relu6})."""
    names, boxes = [], []
    for i, entry in enumerate(layers):
        if not isinstance(entry, dict) or "name" not in entry or set(entry) - LAYER_KEYS:
            raise ValueError(
                f"layer {i}: with `couplings`, each layer is {{name: NAME, box: {'|'.join(BOXES)}}}, got {entry!r} "
                "(the couplings carry the kinds)"
            )
        name, box = entry["name"], entry.get("box", "unit")
        if not isinstance(name, str) or not name.isidentifier() or name in (INPUT, OUTPUT) or name in names:
            why = "is used twice" if name in names else f"must be an identifier other than {INPUT} and {OUTPUT}"
            raise ValueError(f"layer {i}: name {name!r} {why}")
        if box not in BOXES:
            raise ValueError(f"layer {name}: box {box!r} is not one of {list(BOXES)}")
        names.append(name)
        boxes.append(BOXES[box])
    return names, boxes


def only_item(entry: dict[str, Any], where: str) -> tuple[str, object]:
    """The one {KIND: SPEC} item of a layer or coupling entry."""
    if not isinstance(entry, dict) or len(entry) != 1:
        raise ValueError(f"{where}: expected one {{KIND: SPEC}} entry (dense, conv or module.Class), got {entry!r}")
    ((kind, spec),) = entry.items()
    return kind, spec


def unset_value(entry: dict[str, Any], key: str, out_scale: float) -> float | None:
    """What a coupling entry's `gain` or `lr` is when the entry does not set it (the head's gain: the config's
    out_init_scale; otherwise 1); None for any other key."""
    if key == "gain" and entry.get("to") == OUTPUT:
        return out_scale
    return 1.0 if key in ("gain", "lr") else None


def scalar(entry: dict[str, Any], key: str, where: str, high: float, default: float | None) -> float:
    """A coupling's gain or lr: the entry's, a number in (0, high], or `default` when it gives none (unset_value)."""
    if key not in entry:
        return float(default if default is not None else 1.0)
    v = entry[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= high or not math.isfinite(v):
        raise ValueError(f"{where}: {key} must be a number in (0, {high:g}], got {v!r}")
    return float(v)
