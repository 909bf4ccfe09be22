"""The window: fused observables, the fixed point as the leapfrog's special case, stacked nudged phases,
the integrator's limits, and no allocation inside a window."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_batch, tiny_config, tiny_machine
from torch.utils._python_dispatch import TorchDispatchMode

from trainer2.physics.dynamics import (
    Integrator,
    PhaseRun,
    Workspace,
    fixed_point_steps,
    leapfrog_steps,
    set_nudge_scale,
)
from trainer2.physics.energy import energy, input_drive
from trainer2.physics.memory import MemoryBank
from trainer2.physics.relaxation import Relaxation
from trainer2.running.step_runner import step_tensors


def primed(memory_capacity: int = 0, **overrides):
    """A relaxation whose free phase ran once (frames, masks and drive in place)."""
    cfg = tiny_config(memory_capacity=memory_capacity, **overrides)
    m = tiny_machine(cfg)
    bank = None
    if memory_capacity:
        bank = MemoryBank.allocate(memory_capacity, cfg.coord_dim_n, cfg.batch_size, m.readout.protos)
        gen = torch.Generator().manual_seed(4)
        bank.write(
            torch.randn(cfg.batch_size, cfg.coord_dim_n, generator=gen, dtype=torch.float64),
            torch.arange(cfg.batch_size) % 7,
        )
    relax = Relaxation(m, cfg, cfg.batch_size, bank)
    inputs, targets = tiny_batch(cfg)
    with torch.no_grad():
        free = relax.free_phase(inputs, targets)
    return cfg, m, relax, free, m.input_vectors(inputs)


def test_spd_history_equals_the_separate_computation():
    cfg, m, relax, free, _ = primed(dt=0.3, gamma=0.5, mass=2.0)
    ws = relax.ws
    ws.state.zero_()
    qs = [ws.state.s[-1].clone()]
    for t in range(15):  # one step at a time, recording the trajectory of q
        relax.run(ws, free, t, 1, False)
        qs.append(ws.state.s[-1].clone())
    metric = free.frame.rot.T @ torch.diag(m.readout.g_diag) @ free.frame.rot
    spd = torch.stack(
        [torch.sqrt((((b - a) / cfg.dt @ metric) * (b - a) / cfg.dt).sum(1) + cfg.eps) for a, b in zip(qs[:-1], qs[1:])]
    )
    assert torch.allclose(ws.spd_hist[:15], spd, rtol=1e-10)


def test_free_stats_are_the_lior_path_length_and_spd_of_the_window():
    cfg, m, relax, free, _ = primed(free_steps=9)
    spd = relax.ws.spd_hist[:9]
    stats = relax.free_stats()
    assert torch.allclose(stats["lior_mean"], (m.readout.r_sc * cfg.dt * spd.sum(0)).mean())
    assert torch.allclose(stats["spd_mean"], spd.sum(0).mean() / 9) and torch.allclose(stats["spd_last"], spd[8].mean())
    assert torch.equal(stats["R_mean"], m.readout.r_sc)


def test_nudged_stats_are_the_path_length_and_last_spd_of_the_nudged_phases():
    """spd_last_nudge is the nudged phases' residual: the spd of their last step, the mean over every stacked row."""
    cfg, m, relax, free, _ = primed(nudge_steps=7, beta_nudge=0.05)
    with torch.no_grad():
        relax.nudged_phases(free)
    spd = relax.ws_nudged.spd_hist[:7]  # (T, 2B): +beta and -beta rows
    stats = relax.nudged_stats()
    assert spd.shape == (7, 2 * cfg.batch_size)
    assert torch.allclose(stats["spd_last_nudge"], spd[6].mean()) and float(spd[6].mean()) != float(spd[5].mean())
    assert torch.allclose(stats["lior_nudge"], (m.readout.r_sc * spd.sum(0)).mean())


def test_unit_step_is_the_fixed_point_iteration():
    cfg, m, relax, free, x = primed(dt=1.0, gamma=1.0, mass=1.0)
    assert relax.integ.fixed_point and relax.steps_fn is fixed_point_steps
    ws = relax.ws
    gen = torch.Generator().manual_seed(0)
    h0 = torch.rand(ws.state.s[0].shape, generator=gen, dtype=torch.float64)
    q0 = torch.randn(ws.state.s[1].shape, generator=gen, dtype=torch.float64)
    ws.state.s[0].copy_(h0)
    ws.state.s[1].copy_(q0)
    (w1, wo), (b1, bo) = m.energy.weights, m.energy.biases
    relax.run(ws, free, 0, 1, False)
    assert torch.allclose(ws.state.s[0], (x @ w1.T + b1 + q0 @ wo).clamp(0, 1))
    assert torch.allclose(ws.state.s[1], h0 @ wo.T + bo)


@pytest.mark.parametrize("memory_capacity", [0, 10])  # one-hot readout, and candidates sharing labels
@pytest.mark.parametrize("hidden", [[12], [9, 7, 6]])
def test_fixed_point_steps_is_the_leapfrog_at_unit_step(memory_capacity, hidden):
    """Free and stacked nudged windows: the fixed point and the general leapfrog at dt = gamma = mass = 1 agree."""
    cfg, m, relax, free, _ = primed(
        memory_capacity, hidden_sizes=hidden, free_steps=20, nudge_steps=20, beta_nudge=0.05
    )
    unit = Integrator(1.0, 1.0, 1.0)
    sizes, k = m.state_sizes(), free.cand.coords.shape[0]
    for src, nudged, steps in ((relax.ws, False, 20), (relax.ws_nudged, True, 20)):
        rows = src.drive.shape[0]
        betas = [cfg.beta_nudge, -cfg.beta_nudge] if nudged else [0.0]
        fixed, leap = (Workspace.allocate(rows, sizes, k, steps, betas, m.readout.protos, f) for f in (True, False))
        for ws in (fixed, leap):
            ws.drive.copy_(torch.cat([relax.ws.drive] * len(betas)))
            ws.target_mask.copy_(torch.cat([relax.ws.target_mask] * len(betas)))
            for s, s0 in zip(ws.state.s, relax.s0.s):
                s.copy_(torch.cat([s0] * len(betas)))
        set_nudge_scale(fixed, free.fold, unit)
        set_nudge_scale(leap, free.fold, Integrator(1.0, 1.0, 1.000001))  # the leapfrog's factor (-beta)
        fixed_point_steps(
            PhaseRun(fixed, m.energy, free.frame, free.fold, unit, 0, steps, nudged, memory_capacity == 0)
        )
        leapfrog_steps(PhaseRun(leap, m.energy, free.frame, free.fold, unit, 0, steps, nudged, memory_capacity == 0))
        for a, b in zip(fixed.state.s, leap.state.s):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
        torch.testing.assert_close(fixed.spd_hist, leap.spd_hist, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("dt", [1.0, 0.5])
def test_stacked_nudged_phases_equal_each_phase_run_alone(dt):
    cfg, m, relax, free, _ = primed(beta_nudge=0.02, nudge_steps=30, dt=dt)
    with torch.no_grad():
        relax.nudged_phases(free)
    alone = {}
    for beta in (cfg.beta_nudge, -cfg.beta_nudge):
        ws = Workspace.allocate(
            cfg.batch_size,
            m.state_sizes(),
            free.cand.coords.shape[0],
            30,
            [beta],
            m.readout.protos,
            relax.integ.fixed_point,
        )
        ws.drive.copy_(relax.ws.drive)
        ws.target_mask.copy_(relax.ws.target_mask)
        ws.state.copy_(relax.s0)
        set_nudge_scale(ws, free.fold, relax.integ)
        relax.run(ws, free, 0, 30, True)
        alone[beta] = ws.state.s
    for a, b, c, d in zip(relax.s_plus, alone[cfg.beta_nudge], relax.s_minus, alone[-cfg.beta_nudge]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(c, d, rtol=1e-12, atol=1e-14)
    assert not torch.allclose(relax.s_plus[-1], relax.s_minus[-1])  # the two halves really are nudged apart


class NewStorage(TorchDispatchMode):
    """Records every op whose output is not a view of a storage that existed before."""

    def __init__(self, known: set[int]) -> None:
        super().__init__()
        self.known, self.fresh = known, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (list, tuple)) else [out]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.known:
                self.fresh.append(func.__name__)
        return out


@pytest.mark.parametrize("memory_capacity", [0, 10])
@pytest.mark.parametrize("dt,relaxation", [(1.0, "jacobi"), (0.5, "jacobi"), (1.0, "even_odd")])
def test_a_window_allocates_nothing_after_warm_up(memory_capacity, dt, relaxation):
    cfg, m, relax, free, _ = primed(memory_capacity, dt=dt, relaxation=relaxation, hidden_sizes=[8, 6])
    with torch.no_grad():
        relax.nudged_phases(free)  # warm-up
    known = {
        t.untyped_storage().data_ptr()
        for t in step_tensors([relax.ws, relax.ws_nudged, m.energy, free.frame, free.fold])
    }
    for ws, nudged, steps in ((relax.ws, False, cfg.free_steps), (relax.ws_nudged, True, cfg.nudge_steps)):
        with torch.no_grad(), NewStorage(known) as spy:
            relax.run(ws, free, 0, steps, nudged)
        assert spy.fresh == [], set(spy.fresh)


def hamiltonian(m, x, state, mass):
    return energy(state.s, x, m.energy) + sum((p * p).sum(1) for p in state.p) / (2 * mass)


def test_stormer_verlet_energy_drift_stays_bounded_over_1000_steps():
    cfg, m, relax, free, x = primed(dt=0.02, gamma=0.0, mass=1.0)
    with torch.no_grad():  # an interior equilibrium, so the box never binds and E is a plain quadratic
        m.energy.biases[0].fill_(0.5)
        m.energy.weights[0].mul_(0.1)
    ws = relax.ws
    ws.state.zero_()
    ws.state.s[0].fill_(0.5)
    ws.state.s[1].copy_(ws.state.s[0] @ m.energy.weights[1].T + m.energy.biases[1])  # near rest: motion comes from p
    gen = torch.Generator().manual_seed(0)
    ws.state.p[0].copy_(torch.randn(ws.state.p[0].shape, generator=gen, dtype=torch.float64) * 0.03)
    ws.state.p[1].copy_(torch.randn(ws.state.p[1].shape, generator=gen, dtype=torch.float64) * 0.03)
    input_drive(x, m.energy, ws.drives)
    h0 = hamiltonian(m, x, ws.state, cfg.mass)
    kinetic0 = sum((p * p).sum(1) for p in ws.state.p) / (2 * cfg.mass)
    drift = []
    for _ in range(1000):
        relax.run(ws, free, 0, 1, False)
        assert ((ws.state.s[0] > 0) & (ws.state.s[0] < 1)).all()
        drift.append((hamiltonian(m, x, ws.state, cfg.mass) - h0).abs().max())
    drift = torch.stack(drift)
    # Symplectic Euler conserves a nearby Hamiltonian: the error oscillates at O(dt) of the motion's energy.
    assert drift.max() < 0.1 * kinetic0.min(), (drift.max(), kinetic0)
    assert drift[500:].max() < 1.5 * drift[:500].max() + 1e-12  # bounded: no secular growth


def test_damping_settles_and_converges():
    cfg, m, relax, free, _ = primed(free_steps=200)
    assert float(relax.ws.spd_hist[199].max()) < 1e-2  # spd at the last step is ~sqrt(eps) at rest


def test_config_stability_bound_is_the_integrators():
    # With zero couplings the energy is 1/2 |q - b_out|^2 in q: exactly the unit stiffness the config's
    # bound dt^2/mass + 2 gamma dt < 4 is derived for. Just inside it q settles; just outside it blows up,
    # and the config refuses that setting.
    from trainer2.train_config import ConfigError, build_config

    cfg, m, relax, free, _ = primed(dt=1.5, gamma=0.5)  # 2.25 + 1.5 = 3.75
    with pytest.raises(ConfigError, match="must be below 4"):
        build_config([("test", {"dt": 1.6, "gamma": 0.5})])  # 2.56 + 1.6 = 4.16
    with torch.no_grad():
        for w in m.energy.weights:
            w.zero_()
    ws = relax.ws
    rest = m.energy.biases[-1]
    distance = {}
    for dt in (1.5, 1.6):
        ws.state.zero_()
        ws.drive.copy_(m.energy.biases[0].expand_as(ws.drive))
        ws.state.s[-1].copy_(rest + 1.0)
        leapfrog_steps(
            PhaseRun(ws, m.energy, free.frame, free.fold, Integrator(dt, 0.5, 1.0), 0, 60, False, relax.one_hot)
        )
        distance[dt] = float((ws.state.s[-1] - rest).abs().max())
    assert distance[1.5] < 1e-3 and distance[1.6] > 1e3, distance
