"""run_window: fused observables, the integrator's limits, and no allocation-dependent behaviour."""

from __future__ import annotations

import torch

from tiny import tiny_batch, tiny_config, tiny_machine
from trainer2.energy import energy, input_drive
from trainer2.relaxation import Relaxation
from trainer2.window import run_window


def primed_learner(**overrides):
    cfg = tiny_config(**overrides)
    m = tiny_machine(cfg)
    learner = Relaxation(m, cfg, cfg.batch_size)
    inputs, targets = tiny_batch(cfg)
    with torch.no_grad():
        frame = learner.free_phase(inputs, targets).frame
    return cfg, m, learner, frame, m.input_vectors(inputs)


def test_fused_lior_and_spd_equal_the_separate_computation():
    cfg, m, learner, frame, _ = primed_learner(dt=0.3, gamma=0.5, mass=2.0)
    ws = learner.ws
    ws.state.zero_()
    ws.obs.zero_()
    qs = [ws.state.s[-1].clone()]
    for _ in range(15):  # one step at a time, recording the trajectory of q
        run_window(ws, m.energy, frame, 0.05, 1, learner.integ, cfg.eps)
        qs.append(ws.state.s[-1].clone())
    fused = (ws.obs.lior.clone(), ws.obs.spd.clone(), ws.obs.spd_last.clone(), ws.obs.r_sum.clone())
    metric = frame.rot.T @ torch.diag(m.readout.g_diag) @ frame.rot
    spd = []
    for a, b in zip(qs[:-1], qs[1:]):
        v = (b - a) / cfg.dt
        spd.append(torch.sqrt(((v @ metric) * v).sum(1) + cfg.eps))
    spd = torch.stack(spd)
    assert torch.allclose(fused[0], (m.readout.r_sc * spd * cfg.dt).sum(0), rtol=1e-10)
    assert torch.allclose(fused[1], spd.sum(0), rtol=1e-10)
    assert torch.allclose(fused[2], spd[-1], rtol=1e-10)
    assert torch.allclose(fused[3], m.readout.r_sc * 15)


def test_unit_step_is_the_fixed_point_iteration():
    cfg, m, learner, frame, x = primed_learner(dt=1.0, gamma=1.0, mass=1.0)
    ws = learner.ws
    ws.state.zero_()
    gen = torch.Generator().manual_seed(0)
    h0 = torch.rand(ws.state.s[0].shape, generator=gen, dtype=torch.float64)
    q0 = torch.randn(ws.state.s[1].shape, generator=gen, dtype=torch.float64)
    ws.state.s[0].copy_(h0)
    ws.state.s[1].copy_(q0)
    (w1, wo), (b1, bo) = m.energy.weights, m.energy.biases
    run_window(ws, m.energy, frame, 0.0, 1, learner.integ, cfg.eps)
    assert torch.allclose(ws.state.s[0], (x @ w1.T + b1 + q0 @ wo).clamp(0, 1))
    assert torch.allclose(ws.state.s[1], h0 @ wo.T + bo)


def hamiltonian(m, x, state, mass):
    return energy(state.s, x, m.energy) + sum((p * p).sum(1) for p in state.p) / (2 * mass)


def test_stormer_verlet_energy_drift_stays_bounded_over_1000_steps():
    cfg, m, learner, frame, x = primed_learner(dt=0.02, gamma=0.0, mass=1.0)
    with torch.no_grad():  # an interior equilibrium, so the box never binds and E is a plain quadratic
        m.energy.biases[0].fill_(0.5)
        m.energy.weights[0].mul_(0.1)
    ws = learner.ws
    ws.state.zero_()
    ws.state.s[0].fill_(0.5)
    ws.state.s[1].copy_(ws.state.s[0] @ m.energy.weights[1].T + m.energy.biases[1])  # near rest: motion comes from p
    gen = torch.Generator().manual_seed(0)
    ws.state.p[0].copy_(torch.randn(ws.state.p[0].shape, generator=gen, dtype=torch.float64) * 0.03)
    ws.state.p[1].copy_(torch.randn(ws.state.p[1].shape, generator=gen, dtype=torch.float64) * 0.03)
    input_drive(x, m.energy, ws.drive)
    h0 = hamiltonian(m, x, ws.state, cfg.mass)
    kinetic0 = sum((p * p).sum(1) for p in ws.state.p) / (2 * cfg.mass)
    drift = []
    for _ in range(1000):
        run_window(ws, m.energy, frame, 0.0, 1, learner.integ, cfg.eps)
        assert ((ws.state.s[0] > 0) & (ws.state.s[0] < 1)).all()
        drift.append((hamiltonian(m, x, ws.state, cfg.mass) - h0).abs().max())
    drift = torch.stack(drift)
    # Symplectic Euler conserves a nearby Hamiltonian: the error oscillates at O(dt) of the motion's energy.
    assert drift.max() < 0.1 * kinetic0.min(), (drift.max(), kinetic0)
    assert drift[500:].max() < 1.5 * drift[:500].max() + 1e-12  # bounded: no secular growth


def test_damping_settles_and_converges():
    cfg, m, learner, frame, _ = primed_learner(tbptt_window_steps=200)
    assert float(learner.ws.obs.spd_last.max()) < 1e-2  # spd at the last step is ~sqrt(eps) at rest
