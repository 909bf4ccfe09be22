"""The learning machine's parameters: embedding, energy couplings, geometric readout; and its constraints."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from trainer2.config import ConfigError, TrainConfig
from trainer2.physics.energy import Energy, init_energy
from trainer2.physics.readout import Candidates, ReadoutParams, RotorLayout, rotor_layout


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

    def input_vectors(self, inputs: Tensor) -> Tensor:
        """The clamped input x (B, D): concatenated context embeddings, or the features themselves."""
        if self.emb is None:
            return inputs.to(self.readout.protos.dtype)  # feature files load as float32; the machine may be float64
        return self.emb[inputs].flatten(1)

    def prototype_candidates(self) -> Candidates:
        """The prototypes as retrieval candidates, one per class."""
        protos = self.readout.protos
        labels = torch.arange(self.num_classes, device=protos.device)
        return Candidates(protos, labels, torch.zeros(self.num_classes, dtype=protos.dtype, device=protos.device))


def build_machine(
    cfg: TrainConfig,
    num_classes: int,
    input_dim: int,
    text: bool,
    device: torch.device,
    input_shape: tuple[int, ...] | None = None,
) -> Machine:
    """Initialise a machine from the config, deterministically from cfg.seed. input_dim = context_len (text) or D;
    input_shape: the clamped input's (C, H, W) for image data (None: flat)."""
    dtype = getattr(torch, cfg.dtype)
    gen = torch.Generator().manual_seed(cfg.seed)
    emb = torch.randn(num_classes, cfg.embed_dim, generator=gen, dtype=dtype) if text else None
    x_dim = input_dim * cfg.embed_dim if text else input_dim
    try:
        energy = init_energy(input_shape or (x_dim,), cfg.layers, cfg.coord_dim_n, cfg.out_init_scale, gen, dtype)
    except ValueError as e:  # a layer that cannot sit on the one below it (a conv above flat data)
        raise ConfigError(f"layers: {e}") from None
    n = cfg.coord_dim_n
    readout = ReadoutParams(
        g_diag=torch.ones(n, dtype=dtype),
        theta=torch.zeros(cfg.rotor_k, dtype=dtype),
        protos=torch.randn(num_classes, n, generator=gen, dtype=dtype) * cfg.proto_init_scale,
        r_sc=torch.tensor(cfg.r_init, dtype=dtype),
    )
    m = assemble(emb, energy, readout, rotor_layout(n, cfg.rotor_k, dtype=dtype), num_classes, device)
    cap_couplings(m, cfg)  # a deep machine's uniform init is above its per-coupling cap; start convex
    return m


def assemble(
    emb: Tensor | None,
    energy: Energy,
    readout: ReadoutParams,
    layout: RotorLayout,
    num_classes: int,
    device: torch.device,
) -> Machine:
    """A machine on `device` holding copies of the given tensors as views of one flat buffer (named_params order)."""
    loose = Machine(emb, energy, readout, layout, num_classes, torch.empty(0))
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
    return assemble(m.emb, m.energy, m.readout, m.layout, m.num_classes, device)


def coupling_cap(cfg: TrainConfig) -> float:
    """The largest spectral norm each coupling between state layers may have: spectral_cap / (2 cos(pi/(M+2))).

    The couplings form a path over the M+1 state layers, whose adjacency has norm 2 cos(pi/(M+2)), so this
    keeps the coupling block of E's Hessian at most spectral_cap at any depth (docs/design.md section 1).
    For one hidden layer the path norm is exactly 1 (written so, the cosine rounds to 1 + 2^-52)."""
    depth = len(cfg.layers)
    return cfg.spectral_cap / (1.0 if depth == 1 else 2 * math.cos(math.pi / (depth + 2)))


def cap_couplings(m: Machine, cfg: TrainConfig) -> None:
    """Scale every coupling whose exact operator norm exceeds coupling_cap down to it (at build, once; SVD)."""
    cap = coupling_cap(cfg)
    for c in m.energy.between_states:
        c.cap_exact(cap)


def project_constraints(m: Machine, cfg: TrainConfig, power_vecs: list[Tensor]) -> None:
    """After every update: clamp the readout (clamp_readout), then cap each coupling's operator norm (cap_spectral)."""
    clamp_readout(m, cfg)
    cap_spectral(m, cfg, power_vecs)


def clamp_readout(m: Machine, cfg: TrainConfig) -> None:
    """Clamp g_diag to [g_min, g_max] and R_sc to >= r_min, wrap angles to [-pi, pi) (the fused update's kernel does
    the same inside its launch)."""
    r = m.readout
    r.g_diag.clamp_(cfg.g_min, cfg.g_max)
    r.r_sc.clamp_(min=cfg.r_min)
    r.theta.add_(math.pi).remainder_(2 * math.pi).sub_(math.pi)


def cap_spectral(m: Machine, cfg: TrainConfig, power_vecs: list[Tensor]) -> None:
    """Cap each coupling's operator norm at coupling_cap(cfg), which keeps E's smallest curvature >= 1 - spectral_cap
    at any depth.

    Each cap uses two power-iteration steps with a persistent vector per coupling (power_vecs[i] has the
    coupling's power_size), all on the device with no host sync.
    """
    cap = coupling_cap(cfg)
    for c, u in zip(m.energy.between_states, power_vecs):  # no vectors, no caps (the feed-forward baseline's choice)
        c.cap_power(cap, u)
