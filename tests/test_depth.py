"""The convexity rule at depth: every coupling capped at spectral_cap / (2 cos(pi/(M+2))) keeps the smallest
curvature of E at least 1 - spectral_cap for any number M of hidden layers (docs/design.md section 1)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.tiny import tiny_config
from trainer2.physics.energy import energy
from trainer2.physics.machine import Machine, build_machine, coupling_cap, project_constraints


def coupling_weights(m: Machine) -> list[torch.Tensor]:
    """The weights of the couplings between state layers (W_2 .. W_out), the ones the spectral cap bounds."""
    return [c.weight for c in m.energy.between_states]


def hessian(m: Machine) -> torch.Tensor:
    """E's Hessian in the state (h_1..h_M, q), written out: I minus the couplings between state layers, W_{i+1}
    (H_{i+1}, H_i) in block (i+1, i) and its transpose in (i, i+1). E is quadratic, so it holds everywhere."""
    sizes = m.state_sizes()
    starts = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    h = torch.eye(starts[-1], dtype=torch.float64)
    for i, w in enumerate(coupling_weights(m)):  # couples state layer i and i + 1
        lo, hi = slice(starts[i], starts[i + 1]), slice(starts[i + 1], starts[i + 2])
        h[hi, lo] -= w.double()
        h[lo, hi] -= w.double().T
    return h


def smallest_curvature(m: Machine) -> float:
    return float(torch.linalg.eigvalsh(hessian(m))[0])


def deep(hidden: list[int], cap: float = 0.7, coord: int = 6) -> tuple:
    cfg = tiny_config(hidden_sizes=hidden, coord_dim_n=coord, spectral_cap=cap)
    return cfg, build_machine(cfg, 7, cfg.context_len, True, torch.device("cpu"), seed=cfg.seed)


def test_explicit_hessian_is_the_energy_hessian():
    """The matrix the other tests read eigenvalues from is autograd's Hessian of trainer2.physics.energy.energy."""
    cfg, m = deep([5, 4, 3])
    sizes = m.state_sizes()
    x = torch.randn(1, m.energy.weights[0].shape[1], dtype=torch.float64)

    def e(flat: torch.Tensor) -> torch.Tensor:
        return energy(list(flat[None].split(sizes, dim=1)), x, m.energy).sum()

    auto = torch.autograd.functional.hessian(e, torch.rand(sum(sizes), dtype=torch.float64))
    assert torch.allclose(auto, hessian(m), atol=1e-12)


def test_cap_matches_path_norm():
    """rho / (2 cos(pi / (M + 2))): exactly rho for one hidden layer (every preset is unchanged), rho/sqrt(2) for
    two."""
    assert coupling_cap(tiny_config(hidden_sizes=[12], spectral_cap=0.7)) == 0.7
    assert coupling_cap(tiny_config(hidden_sizes=[12, 12], spectral_cap=0.7)) == pytest.approx(
        0.7 / math.sqrt(2), rel=1e-14
    )
    assert coupling_cap(tiny_config(hidden_sizes=[12] * 4, spectral_cap=0.7)) == pytest.approx(
        0.7 / math.sqrt(3), rel=1e-14
    )


def aligned(hidden: list[int], c: float) -> Machine:
    """The worst case: equal widths, every coupling c e e^T with one unit vector e, so K = c A_path (x) e e^T."""
    _, m = deep(hidden, coord=hidden[0])
    e = torch.nn.functional.normalize(torch.arange(1.0, hidden[0] + 1, dtype=torch.float64), dim=0)
    for w in coupling_weights(m):
        w.copy_(c * torch.outer(e, e))
    return m


@pytest.mark.parametrize("depth", [3, 4])
def test_per_coupling_cap_alone_loses_convexity_at_depth(depth):
    """Every coupling at norm 0.7 (the one-hidden-layer rule) leaves E non-convex from three hidden layers on:
    the smallest curvature is 1 - 0.7 * 2 cos(pi/(M+2)) < 0."""
    m = aligned([6] * depth, 0.7)
    assert smallest_curvature(m) == pytest.approx(1 - 0.7 * 2 * math.cos(math.pi / (depth + 2)), abs=1e-12)
    assert smallest_curvature(m) < -0.1


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_aligned_machine_after_projection_has_curvature_one_minus_cap(depth):
    """The bound is tight: the aligned worst case, projected, sits exactly at 1 - spectral_cap."""
    cfg, _ = deep([6] * depth, coord=6)
    m = aligned([6] * depth, 2.0)
    vecs = [
        torch.nn.functional.normalize(torch.ones(w.shape[0], dtype=torch.float64), dim=0) for w in coupling_weights(m)
    ]
    project_constraints(m, vecs)  # rank one: two power steps find sigma exactly
    assert smallest_curvature(m) == pytest.approx(1 - cfg.spectral_cap, abs=1e-9)


@pytest.mark.parametrize("hidden", [[10, 8], [9, 9, 7], [8, 10, 6, 9]])
def test_random_deep_machine_stays_convex_after_projection(hidden):
    """Random couplings far above the cap, with a shared aligned part so they reinforce along the chain,
    projected by the trainer's own constraint step until the persistent power vectors settle: the smallest
    curvature is at least 1 - spectral_cap (with the old per-coupling rule it is below 0.3 - 0.1)."""
    cfg, m = deep(hidden)
    gen = torch.Generator().manual_seed(len(hidden))
    for w in coupling_weights(m):
        top = torch.zeros(w.shape, dtype=torch.float64)
        top[0, 0] = 1.0
        w.copy_(5.0 * top + torch.randn(w.shape, generator=gen, dtype=torch.float64) / math.sqrt(w.shape[1]))
    assert smallest_curvature(m) < -1
    vecs = [
        torch.nn.functional.normalize(torch.ones(w.shape[0], dtype=torch.float64), dim=0) for w in coupling_weights(m)
    ]
    for _ in range(30):  # two power steps per call, as after every update
        project_constraints(m, vecs)
    norms = [float(torch.linalg.matrix_norm(w, ord=2)) for w in coupling_weights(m)]
    assert max(norms) <= coupling_cap(cfg) * (1 + 1e-9)
    assert smallest_curvature(m) >= 1 - cfg.spectral_cap - 1e-9


@pytest.mark.parametrize("hidden", [[256, 256], [256, 256, 256], [256] * 4])
def test_deep_initialisation_starts_convex(hidden):
    """A uniform(1/sqrt(fan_in)) 256 x 256 coupling has spectral norm about 1.15; the build scales it to the cap."""
    cfg = tiny_config(hidden_sizes=hidden, coord_dim_n=16, spectral_cap=0.7, dtype="float32")
    m = build_machine(cfg, 7, cfg.context_len, True, torch.device("cpu"), seed=cfg.seed)
    norms = [float(torch.linalg.matrix_norm(w.double(), ord=2)) for w in coupling_weights(m)]
    assert max(norms) <= coupling_cap(cfg) * (1 + 1e-6)
    assert smallest_curvature(m) >= 1 - cfg.spectral_cap - 1e-6
