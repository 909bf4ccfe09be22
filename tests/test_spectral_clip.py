"""spectral_cap_mode clip: the cap takes an excess off the top singular direction instead of scaling the coupling."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import trainer2
from trainer2.physics.couplings.conv import Conv
from trainer2.physics.couplings.coupling import CLIP_SLACK
from trainer2.physics.couplings.dense import Dense
from trainer2.physics.machine import coupling_cap

F64 = torch.float64
CONVS = [
    ((2, 8, 8), {"channels": 3, "kernel": 3, "pool": 2}),
    ((3, 5, 5), {"channels": 4, "kernel": 3}),
    ((2, 8, 8), {"channels": 3, "kernel": 3, "pool": 2, "pooling": "max"}),
]


def dense_with(singular: list[float]) -> tuple[Dense, torch.Tensor, torch.Tensor]:
    """A dense coupling W (5, 4) = U diag(singular) V^T with random orthonormal U, V."""
    g = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(5, 4, generator=g, dtype=F64))
    v, _ = torch.linalg.qr(torch.randn(4, 4, generator=g, dtype=F64))
    c = Dense.init("2", (4,), 5, 1.0, g, F64)
    c.weight.copy_(u @ torch.diag(torch.tensor(singular, dtype=F64)) @ v.T)
    return c, u, v


@pytest.mark.parametrize(
    ("top", "after"),
    [
        (0.81, [0.8, 0.5, 0.3, 0.1]),  # within the slack: only the top singular value moves
        (1.0, [s * 0.8 * CLIP_SLACK for s in (0.8, 0.5, 0.3, 0.1)]),  # beyond it: clipped, then all x 1.02 cap / 1.0
    ],
)
def test_dense_clip_takes_the_excess_off_the_top_singular_value(top, after):
    c, u, v = dense_with([top, 0.5, 0.3, 0.1])
    vec = u[:, 0].clone()  # the power vector converged, as it is after a few updates
    c.cap_power(0.8, vec, clip=True)
    torch.testing.assert_close(torch.linalg.svdvals(c.weight), torch.tensor(after, dtype=F64))
    torch.testing.assert_close((u.T @ c.weight @ v).diagonal(), torch.tensor(after, dtype=F64))  # same directions
    scaled, _, _ = dense_with([top, 0.5, 0.3, 0.1])
    scaled.cap_power(0.8, u[:, 0].clone())  # the default scales every direction by cap / top
    torch.testing.assert_close(
        torch.linalg.svdvals(scaled.weight), torch.tensor([top, 0.5, 0.3, 0.1], dtype=F64) * 0.8 / top
    )


def conv_matrix(c: Conv) -> torch.Tensor:
    """L as an explicit matrix: its columns are L of the unit vectors."""
    return c.linear(torch.eye(math.prod(c.below_shape), dtype=F64)).T


@pytest.mark.parametrize(("below", "spec"), CONVS, ids=["pool2", "pool1", "max2"])
def test_conv_clip_moves_the_kernel_along_the_top_direction_only(below, spec):
    """One cap from a converged power vector: the norm falls by at least half the excess, and the kernel moves less
    than scaling would move it (the first-order projection is the smallest step that takes the excess off)."""
    c = Conv.init("2", below, spec, 1.0, torch.Generator().manual_seed(0), F64)
    norm = torch.linalg.matrix_norm(conv_matrix(c), ord=2)
    cap = float(norm) / 1.01  # within the slack: clipped, not scaled
    u = torch.ones(c.power_size, dtype=F64)
    for _ in range(500):
        c.power_step(u)
    k0 = c.weight.clone()
    c.cap_power(cap, u, clip=True)
    assert torch.linalg.matrix_norm(conv_matrix(c), ord=2) < norm - 0.5 * (norm - cap)
    scaled_change = 1 - cap / norm  # scaling moves every channel by this fraction of its kernel
    change = torch.linalg.vector_norm(c.weight - k0) / torch.linalg.vector_norm(k0)
    assert change < 0.9 * scaled_change, (change, scaled_change)


@pytest.mark.parametrize(("below", "spec"), CONVS, ids=["pool2", "pool1", "max2"])
def test_conv_clip_holds_the_cap_under_updates(below, spec):
    """Between caps the coupling moves, as training moves it; its exact norm stays at the cap (the persistent power
    vector finds each new top direction as the updates move the coupling)."""
    c = Conv.init("2", below, spec, 1.0, torch.Generator().manual_seed(0), F64)
    cap = float(torch.linalg.matrix_norm(conv_matrix(c), ord=2)) / 1.01
    u, noise = torch.ones(c.power_size, dtype=F64), torch.Generator().manual_seed(1)
    norms = []
    for _ in range(100):
        step = torch.randn(c.weight.shape, generator=noise, dtype=F64)
        c.weight.add_(step, alpha=0.003 * float(c.weight.abs().mean()))
        c.cap_power(cap, u, clip=True)
        norms.append(float(torch.linalg.matrix_norm(conv_matrix(c), ord=2)))
    assert max(norms[50:]) < cap * 1.005 and min(norms[50:]) > cap * 0.98, (cap, norms[50:])


def test_a_cap_too_close_to_one_for_the_slack_is_refused_by_name():
    assert trainer2.config(None, spectral_cap_mode="clip", spectral_cap=0.98).spectral_cap_mode == "clip"
    with pytest.raises(trainer2.ConfigError, match=r"spectral_cap_mode clip .* spectral_cap \(0.99\) must stay below"):
        trainer2.config(None, spectral_cap_mode="clip", spectral_cap=0.99)
    assert trainer2.config(None, spectral_cap=0.99).spectral_cap_mode == "scale"


OLD_CAP = '''
import trainer2


class OldCapDense(trainer2.Dense):
    """A coupling written before cap_power took `clip`."""

    def cap_power(self, cap, u):
        return trainer2.Dense.cap_power(self, cap, u)
'''

TINY = dict(
    layers=[{"dense": 12}, {"dense": 8}],
    coord_dim_n=4,
    rotor_k=3,
    batch_size=16,
    free_steps=8,
    nudge_steps=4,
    max_windows=6,
    log_every_windows=3,
    eval_every_windows=0,
    eval_batches=1,
    cpu_threads=1,
    spectral_cap=0.9,
    eta_update=0.05,  # large steps, so every update lifts a coupling over its cap
)


def tiny_data() -> trainer2.Dataset:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 10)).astype(np.float32)
    y = rng.integers(0, 3, 96)
    return trainer2.from_arrays(x[:64], y[:64], x[64:], y[64:])


def test_a_run_under_clip_keeps_every_coupling_near_its_cap_and_trains_otherwise_than_scaling(tmp_path):
    data = tiny_data()
    runs = {
        mode: trainer2.train(trainer2.config(None, **TINY, spectral_cap_mode=mode), data, run_dir=tmp_path / mode)
        for mode in ("scale", "clip")
    }
    cap = coupling_cap(runs["clip"].model.machine.spec)
    for mode, run in runs.items():
        assert run.summary["windows"] == 6
        for c in run.model.machine.energy.between_states:
            norm = float(torch.linalg.matrix_norm(c.weight.double(), ord=2))
            assert norm < cap * (CLIP_SLACK + 1e-3 if mode == "clip" else 1 + 1e-3), (mode, norm, cap)
    w = {mode: run.model.machine.energy.couplings[1].weight for mode, run in runs.items()}
    assert not torch.equal(w["scale"], w["clip"])


def test_a_coupling_whose_cap_power_takes_no_clip_is_refused_by_name_under_clip(tmp_path, monkeypatch):
    (tmp_path / "old_cap.py").write_text(OLD_CAP)
    monkeypatch.syspath_prepend(str(tmp_path))
    layers = [{"dense": 12}, {"old_cap.OldCapDense": 8}]
    cfg = trainer2.config(None, **{**TINY, "layers": layers})
    assert trainer2.train(cfg, tiny_data(), run_dir=tmp_path / "scale").summary["windows"] == 6  # scaling: never handed
    cfg = trainer2.config(None, **{**TINY, "layers": layers, "spectral_cap_mode": "clip"})
    with pytest.raises(trainer2.ConfigError, match=r"coupling old_cap.OldCapDense's cap_power takes no `clip`"):
        trainer2.train(cfg, tiny_data(), run_dir=tmp_path / "clip")
