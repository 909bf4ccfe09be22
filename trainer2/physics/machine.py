"""The learning machine: its settings (`MachineConfig`), parameters (embedding, energy couplings, geometric readout),
initialisation and constraints."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import Field, field_validator, model_validator
from torch import Tensor

from trainer2.components import BUILTIN, resolve, takes_keyword
from trainer2.physics.couplings.coupling import CLIP_SLACK
from trainer2.physics.energy import Energy, init_energy
from trainer2.physics.graph import Plan, plan
from trainer2.physics.readout import Candidates, ReadoutParams, RotorLayout, rotor_layout
from trainer2.section import ConfigError, Section, short_repr

MAX_WIDTH, MAX_DEPTH = 2**20, 1024  # hidden layers: sane bounds; what fits in memory is trainer2.running.sizes' to say


class MachineConfig(Section):
    """The machine's shape, initialisation, readout and constraints."""

    dtype: Literal["float32", "float64"] = Field("float32", description="Floating-point type of every tensor.")
    layers: list[dict[str, Any]] = Field(
        [{"dense": 256}],
        min_length=1,
        description="The hidden layers h_1..h_M, lowest first, each {kind: spec} with the kind of coupling that "
        "drives it from below: [{dense: 256}] is one dense layer of 256 units (on the command line: --layers "
        "dense:256); a kind is a built-in (dense, conv) or a dotted path module.Class to your own coupling. "
        "--hidden_sizes 256 128 is shorthand for dense layers of those sizes. With `couplings`, the layers are a "
        "graph's named state layers instead: [{name: h1, box: relu6}, ...] (box unit [0, 1], the default, or relu6 "
        "[0, 6]; docs/design.md#the-energy-as-a-graph).",
    )
    couplings: list[dict[str, Any]] = Field(
        [],
        description="Empty: the layers are a chain. Else the energy's graph (YAML only): each coupling "
        "{KIND: SPEC, from: LAYER, to: LAYER, gain: G, lr: R} joins two layers, lower to higher (`input` is the "
        "clamped data, `output` is q); gain scales its initial weights, lr its learning rate (both default 1); "
        "{from: LAYER, to: output} sets the dense head's source (default the last layer).",
    )
    cost: str = Field(
        "retrieval",
        description="How the output q is scored and nudged: 'retrieval' (the geometric readout: metric, rotor, softmax "
        "over distances to the prototypes), 'mse' (1/2 |q - c_y|^2 to fixed class codes) or 'cross_entropy' (softmax "
        "over -1/2 |q - c_k|^2, prototypes learned); or a dotted path module.Class to your own (docs/rules.md).",
    )
    embed_dim: int = Field(16, ge=1, le=2**16, description="Embedding size per context character (text data).")
    coord_dim_n: int = Field(16, ge=2, le=2048, description="Dimension n of the output coordinates q.")
    rotor_k: int = Field(32, ge=0, le=2**24, description="Number of Givens rotations in the readout's rotor frame.")
    retrieval_beta: float = Field(
        1.0, gt=0.0, description="Inverse temperature of retrieval: p = softmax(-beta * cost)."
    )
    eps: float = Field(1e-6, gt=0.0, description="Added under the square root of the quadratic form spd.")
    g_min: float = Field(0.05, gt=0.0, description="Lower clamp of the metric diagonal g_diag.")
    g_max: float = Field(20.0, gt=0.0, description="Upper clamp of the metric diagonal g_diag.")
    r_init: float = Field(16.0, gt=0.0, description="Initial resistance R_sc.")
    r_min: float = Field(0.05, gt=0.0, description="Lower clamp of the resistance R_sc.")
    out_init_scale: float = Field(0.5, gt=0.0, description="W_out starts at this multiple of the 1/sqrt(fan_in) scale.")
    proto_init_scale: float = Field(0.1, gt=0.0, description="Standard deviation of the initial prototypes.")
    spectral_cap: float = Field(
        0.7,
        gt=0.0,
        lt=1.0,
        description="Cap kappa on the couplings' part of E's Hessian, so its smallest "
        "curvature is >= 1 - kappa at any depth: "
        "each coupling between state layers is capped at kappa / (2 cos(pi/(M+2))) "
        "for M hidden layers (kappa itself for one).",
    )
    spectral_cap_mode: Literal["scale", "clip"] = Field(
        "scale",
        description="How an update that lifts a coupling's norm over its cap is undone: 'scale' multiplies the "
        "coupling by cap / norm (every direction shrinks, also the channels or units the gradient no longer reaches, "
        "which decay toward zero over a run); 'clip' takes the excess off the top singular direction only (the "
        "first-order projection onto the cap), and scales the coupling as well only where an update lifted its norm "
        "over 1.02 x the cap, by 1.02 x cap / norm (docs/images.md#the-spectral-cap-clipped-not-scaled).",
    )
    memory_capacity: int = Field(
        0, ge=0, le=2**31, description="Slots of the memory bank of recent equilibria; 0 = off."
    )

    @field_validator("layers")
    @classmethod
    def _layers(cls, v: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if len(v) > MAX_DEPTH:
            raise ValueError(f"at most {MAX_DEPTH} hidden layers, got {len(v)}")
        if all(isinstance(entry, dict) and "name" in entry for entry in v):
            return v  # a graph's named layers: checked with its couplings (_graph)
        for i, entry in enumerate(v):
            kind = next(iter(entry), None)
            if len(entry) != 1 or not isinstance(kind, str) or ("." not in kind and kind not in BUILTIN["coupling"]):
                raise ValueError(
                    f"layer {i}: expected one {{kind: spec}} entry with a kind in {sorted(BUILTIN['coupling'])} or a "
                    f"dotted path module.Class to your own coupling, got {short_repr(entry)}"
                )
            spec = entry[kind]
            try:
                size = math.prod(resolve("coupling", kind).spec_size(spec))
            except ValueError as e:  # a ComponentError too: the kind names nothing usable
                hint = ""
                size_given = isinstance(spec, int) and not isinstance(spec, bool) and spec >= 1
                if size_given and not isinstance(e, ConfigError):  # the kind resolved, but takes a spec, not a size
                    examples = {"conv": "kernel: 5, pool: 2", "conv1d": "kernel: 4, stride: 4"}
                    example = f"{{channels: {spec}, {examples[kind]}}}" if kind in examples else "{...}"
                    hint = (
                        f"; a {kind} layer is written in YAML (a --config FILE), e.g. layers: [{{{kind}: {example}}}], "
                        "since the --layers flag's KIND:SIZE gives only a size"
                    )
                raise ValueError(f"layer {i} ({kind}): {e}{hint}") from None
            if size > MAX_WIDTH:
                raise ValueError(f"layer {i} ({kind}): at most {MAX_WIDTH} units a layer, got {size}")
        return v

    @model_validator(mode="after")
    def _graph(self) -> "MachineConfig":
        named = all("name" in entry for entry in self.layers)
        if named and not self.couplings:
            raise ValueError(
                "layers name a graph's state layers ({name: ...}), but couplings is empty: give the couplings that "
                "join them, or write a chain as layers: [{dense: 256}, ...]"
            )
        if self.couplings and not named:
            raise ValueError(
                "couplings make the energy a graph, whose layers are named state layers [{name: h1, box: relu6}, "
                "...]; these layers are a chain's {kind: spec} entries (drop couplings, or name the layers)"
            )
        if not self.couplings:
            return self
        p = self.plan()
        for k, entry in enumerate(p.entries[:-1]):
            ends = p.graph.describe()[k].partition(": ")[2]
            try:
                size = math.prod(resolve("coupling", entry.kind).spec_size(entry.spec))
            except ValueError as e:  # a ComponentError too: the kind names nothing usable
                raise ValueError(f"coupling {k} ({ends}, {entry.kind}): {e}") from None
            if size > MAX_WIDTH:
                raise ValueError(f"coupling {k} ({ends}): at most {MAX_WIDTH} units a layer, got {size}")
        return self

    def plan(self) -> Plan:
        """The energy's graph and couplings before any tensor (trainer2.physics.graph.plan)."""
        return plan(self.layers, self.couplings, self.coord_dim_n, self.out_init_scale)

    @field_validator("cost")
    @classmethod
    def _cost(cls, v: str) -> str:
        resolve("cost", v)  # a ComponentError (a ValueError) names the built-ins, or what is wrong with a dotted path
        return v

    @model_validator(mode="after")
    def _clamps(self) -> "MachineConfig":
        if self.spectral_cap_mode == "clip" and self.spectral_cap * CLIP_SLACK >= 1.0:
            raise ValueError(
                f"spectral_cap_mode clip lets a coupling sit up to {CLIP_SLACK} x its cap, so spectral_cap "
                f"({self.spectral_cap}) must stay below {1 / CLIP_SLACK:.4f}, where E is still convex"
            )
        if self.g_min >= self.g_max:
            raise ValueError(f"g_min ({self.g_min}) must be below g_max ({self.g_max})")
        if self.memory_capacity and not resolve("cost", self.cost).memory_bank:
            raise ValueError(
                f"memory_capacity ({self.memory_capacity}) needs cost retrieval, whose candidates the memory bank "
                f"joins; cost {self.cost} scores the prototypes only: set memory_capacity 0 or cost retrieval"
            )
        return self


@dataclass
class Machine:
    """All learned tensors plus the static rotor layout. emb is None for feature data. Every learned tensor is
    a view of `flat`, one buffer in `named_params` order, so the update is a few whole-buffer operations."""

    emb: Tensor | None  # (V, embed_dim)
    energy: Energy
    readout: ReadoutParams
    layout: RotorLayout
    num_classes: int
    flat: Tensor  # (P,) every learned tensor, in named_params order
    spec: MachineConfig  # the settings it was built from: its readout's beta and eps, its constraints

    def named_params(self) -> dict[str, Tensor]:
        """Every learned tensor by a stable name. This order is the one order of the parameters (update lists,
        checkpoint keys): emb (text only), the couplings' in chain order (W_1, b_1, ..., W_out, b_out), g_diag,
        theta, protos, r_sc."""
        out: dict[str, Tensor] = {} if self.emb is None else {"emb": self.emb}
        out.update(self.energy.parameters())
        r = self.readout
        out.update(g_diag=r.g_diag, theta=r.theta, protos=r.protos, r_sc=r.r_sc)
        return out

    def param_groups(self) -> dict[str, str]:
        """Each parameter's group by name: 'embed', 'energy' (the couplings) or 'readout'."""
        energy = self.energy.parameters()
        return {n: "embed" if n == "emb" else "energy" if n in energy else "readout" for n in self.named_params()}

    def state_sizes(self) -> list[int]:
        """[H_1, ..., H_M, n]."""
        return self.energy.state_sizes()

    @property
    def context_len(self) -> int:
        """Tokens per example of a text machine (emb is set): its input is that many embeddings side by side."""
        e = self.energy
        first = next(c for c, (below, _) in zip(e.couplings, e.graph.edges) if below < 0)  # a coupling from x
        return math.prod(first.below_shape) // self.emb.shape[1]

    def input_vectors(self, inputs: Tensor) -> Tensor:
        """The clamped input x (B, D): concatenated context embeddings, or the features themselves."""
        if self.emb is None:
            return inputs.to(self.readout.protos.dtype)  # feature files load as float32; the machine may be float64
        # index_select, not emb[inputs]: the same rows without advanced indexing's overhead (half the time a window)
        return torch.index_select(self.emb, 0, inputs.reshape(-1)).view(inputs.shape[0], -1)

    def prototype_candidates(self) -> Candidates:
        """The prototypes as retrieval candidates, one per class."""
        protos = self.readout.protos
        labels = torch.arange(self.num_classes, device=protos.device)
        return Candidates(protos, labels, torch.zeros(self.num_classes, dtype=protos.dtype, device=protos.device))


def build_machine(
    spec: MachineConfig,
    num_classes: int,
    input_dim: int,
    tokens: bool,
    device: torch.device,
    input_shape: tuple[int, ...] | None = None,
    *,
    seed: int,
) -> Machine:
    """Initialise a machine, deterministically from `seed`. input_dim = context_len (tokens: an embedding is learned)
    or D; input_shape: the clamped input's (C, H, W) for image data (None: (context_len, embed_dim) text, or flat)."""
    dtype = getattr(torch, spec.dtype)
    gen = torch.Generator().manual_seed(seed)
    emb = torch.randn(num_classes, spec.embed_dim, generator=gen, dtype=dtype) if tokens else None
    # text: context_len embeddings side by side, token-major (L, E), the sequence a conv1d coupling reads (dense: flat)
    x_shape = (input_dim, spec.embed_dim) if tokens else (input_dim,)
    try:
        energy = init_energy(input_shape or x_shape, spec.plan(), gen, dtype)
    except ValueError as e:  # a layer that cannot sit on the one below it (a conv above flat data)
        raise ConfigError(f"{'couplings' if spec.couplings else 'layers'}: {e}") from None
    n = spec.coord_dim_n
    readout = ReadoutParams(
        g_diag=torch.ones(n, dtype=dtype),
        theta=torch.zeros(spec.rotor_k, dtype=dtype),
        protos=torch.randn(num_classes, n, generator=gen, dtype=dtype) * spec.proto_init_scale,
        r_sc=torch.tensor(spec.r_init, dtype=dtype),
    )
    m = assemble(emb, energy, readout, rotor_layout(n, spec.rotor_k, dtype=dtype), num_classes, device, spec)
    cap_couplings(m)  # a deep machine's uniform init is above its per-coupling cap; start convex
    refuse_caps_without_clip(m)
    return m


def assemble(
    emb: Tensor | None,
    energy: Energy,
    readout: ReadoutParams,
    layout: RotorLayout,
    num_classes: int,
    device: torch.device,
    spec: MachineConfig,
) -> Machine:
    """A machine on `device` holding copies of the given tensors as views of one flat buffer (named_params order)."""
    loose = Machine(emb, energy, readout, layout, num_classes, torch.empty(0), spec)
    named = loose.named_params()
    flat = torch.cat([t.detach().reshape(-1) for t in named.values()]).to(device)
    views = split_flat(flat, {name: t.shape for name, t in named.items()})
    r = {k: views[k] for k in ("g_diag", "theta", "protos", "r_sc")}
    return Machine(
        views.get("emb"),
        energy.rebind(views),
        ReadoutParams(**r),
        layout.to(device),
        num_classes,
        flat,
        spec,
    )


def split_flat(buf: Tensor, shapes: dict[str, torch.Size]) -> dict[str, Tensor]:
    """A flat (P,) buffer seen as consecutive views, one per name, with the given shapes (in order)."""
    views, at = {}, 0
    for name, shape in shapes.items():
        size = math.prod(shape)
        views[name] = buf[at : at + size].view(shape)
        at += size
    return views


def move_machine(m: Machine, device: torch.device) -> Machine:
    """A copy of m on `device` (its tensors re-gathered into a new flat buffer)."""
    return assemble(m.emb, m.energy, m.readout, m.layout, m.num_classes, device, m.spec)


def coupling_cap(spec: MachineConfig) -> float:
    """The largest spectral norm each coupling between state layers may have: spectral_cap / (2 cos(pi/(M+2))) for a
    chain, spectral_cap / |A| for a graph whose state layers' adjacency is A.

    A chain's couplings form a path over the M+1 state layers, whose adjacency has norm 2 cos(pi/(M+2)), so this
    keeps the coupling block of E's Hessian at most spectral_cap at any depth (docs/design.md section 1); a block
    matrix whose blocks have norms <= c has norm <= c |A| for any graph. For one hidden layer the path norm is exactly
    1 (written so, the cosine rounds to 1 + 2^-52)."""
    graph = spec.plan().graph if spec.couplings else None
    if graph is not None and not graph.is_chain:
        return spec.spectral_cap / graph.adjacency_norm()
    depth = len(spec.layers)
    return spec.spectral_cap / (1.0 if depth == 1 else 2 * math.cos(math.pi / (depth + 2)))


def cap_couplings(m: Machine) -> None:
    """Scale every coupling whose exact operator norm exceeds coupling_cap down to it (at build, once; SVD)."""
    cap = coupling_cap(m.spec)
    for c in m.energy.between_states:
        c.cap_exact(cap)


def refuse_caps_without_clip(m: Machine) -> None:
    """Under spectral_cap_mode clip each coupling between state layers is handed `clip`: one whose cap_power takes
    none (written to the protocol before it) is refused by name here, not with a TypeError in the first update."""
    if m.spec.spectral_cap_mode != "clip":
        return
    kind_of = {id(c): kind for c, kind in zip(m.energy.couplings, m.energy.kinds())}
    for c in m.energy.between_states:
        kind = kind_of[id(c)]
        if not takes_keyword(c.cap_power, "clip"):
            raise ConfigError(
                f"coupling {kind}'s cap_power takes no `clip`, which spectral_cap_mode clip hands it: add "
                "`clip: bool = False` (trainer2.Coupling.cap_power), or use spectral_cap_mode scale"
            )


def project_constraints(m: Machine, power_vecs: list[Tensor]) -> None:
    """After every update: clamp the readout (clamp_readout), then cap each coupling's operator norm (cap_spectral)."""
    clamp_readout(m)
    cap_spectral(m, power_vecs)


def clamp_readout(m: Machine) -> None:
    """Clamp g_diag to [g_min, g_max] and R_sc to >= r_min, wrap angles to [-pi, pi) (the fused update's kernel does
    the same inside its launch)."""
    r, spec = m.readout, m.spec
    r.g_diag.clamp_(spec.g_min, spec.g_max)
    r.r_sc.clamp_(min=spec.r_min)
    r.theta.add_(math.pi).remainder_(2 * math.pi).sub_(math.pi)


def cap_spectral(m: Machine, power_vecs: list[Tensor]) -> None:
    """Cap each coupling's operator norm at coupling_cap, which keeps E's smallest curvature >= 1 - spectral_cap at
    any depth.

    Each cap uses two power-iteration steps with a persistent vector per coupling (power_vecs[i] has the
    coupling's power_size), all on the device with no host sync.
    """
    cap = coupling_cap(m.spec)
    clip = {"clip": True} if m.spec.spectral_cap_mode == "clip" else {}  # handed only where asked for (the protocol)
    for c, u in zip(m.energy.between_states, power_vecs):  # no vectors, no caps (the feed-forward baseline's choice)
        c.cap_power(cap, u, **clip)
