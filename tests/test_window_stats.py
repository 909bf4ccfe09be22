"""The window's observables in one Triton launch (trainer2/physics/kernels/window_stats.py) against
Relaxation.free_stats and nudged_stats (the torch operators), in Triton's interpreter on CPU tensors; proof that a
batch step with the Triton window runs it, for EP and for recurrent backprop (no nudged phase).

Needs triton and numpy (pip install -e '.[kernels]') and TRITON_INTERPRET=1, which tests/conftest.py sets before
anything imports triton; skipped with the reason otherwise."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from interpreted import require_interpreted_triton

require_interpreted_triton("the window stats kernel")

from test_triton_window import Spy  # noqa: E402
from tiny import tiny_batch, tiny_config, tiny_machine  # noqa: E402

from trainer2.learning.step import build_step  # noqa: E402
from trainer2.physics.kernels import window_stats  # noqa: E402
from trainer2.physics.relaxation import WindowStats  # noqa: E402
from trainer2.running.step_runner import StepRunner  # noqa: E402


def stats_of_both(cfg, rule: str = "ep") -> tuple[WindowStats, WindowStats, int]:
    """The gradients of one batch with the Triton window (no update, so R_sc stays); its observables from the kernel
    and from the torch reference on the same workspaces, and the kernel's launches."""
    step = build_step(tiny_machine(cfg), cfg, cfg, cfg.batch_size, rule=rule)
    relax = step.relax
    with torch.no_grad():
        out = step.gradients(relax, *tiny_batch(cfg))
    want = WindowStats(**relax.free_stats(), **relax.nudged_stats())
    return out.stats, want, relax.stats_kernel.launches


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("block", [window_stats.BLOCK, 16])
def test_the_kernel_equals_the_torch_observables(dtype, block, monkeypatch):
    """Every observable within a few ulps (another order of addition) and none zero, so a field the kernel misses or
    swaps would show; at 16 elements a block the sums take several blocks, the last row one block's tail."""
    monkeypatch.setattr(window_stats, "BLOCK", block)
    cfg = tiny_config(dtype=dtype, window_backend="triton", free_steps=9, nudge_steps=5, batch_size=7, dt=1.0)
    got, want, launches = stats_of_both(cfg)
    assert launches == 1
    eps = torch.finfo(getattr(torch, dtype)).eps
    values = {f.name: (float(getattr(got, f.name)), float(getattr(want, f.name))) for f in dataclasses.fields(got)}
    for name, (g, w) in values.items():
        assert w != 0 and g == pytest.approx(w, rel=16 * eps), (name, g, w)
    assert len(set(values.values())) == len(values)  # six different figures: a swap would not pass


def test_recurrent_backprop_gets_zeros_for_the_nudged_phases():
    cfg = tiny_config(window_backend="triton", rule="rbp", free_steps=6, nudge_steps=3)
    got, want, launches = stats_of_both(cfg, rule="rbp")
    assert launches == 1 and float(got.lior_nudge) == float(got.spd_last_nudge) == 0.0
    assert float(got.spd_mean) == pytest.approx(float(want.spd_mean), rel=1e-14) and float(want.spd_mean) > 0


def test_the_batch_step_launches_it_once_before_the_update(monkeypatch):
    """One launch a batch step, and its R_sc is the one the window relaxed with: the update moves R_sc afterwards."""
    spy = Spy(window_stats.window_stats_kernel)
    monkeypatch.setattr(window_stats, "window_stats_kernel", spy)
    cfg = tiny_config(window_backend="triton", free_steps=4, nudge_steps=2, eta_update=0.05)
    step = build_step(tiny_machine(cfg), cfg, cfg, cfg.batch_size)
    runner, r_sc = StepRunner(step), step.relax.m.readout.r_sc
    runner.step(*tiny_batch(cfg, seed=0))
    before = float(r_sc)
    runner.step(*tiny_batch(cfg, seed=1))
    assert spy.grids == [(1,), (1,)] and step.relax.stats_kernel.launches == 2
    assert float(step.relax.stats_kernel.views["R_mean"]) == before != float(r_sc)


def test_a_history_of_another_shape_is_refused_by_name():
    like = torch.zeros((), dtype=torch.float64)
    kernel = window_stats.WindowStatsKernel((4, 3), (2, 6), 1.0, like)
    r = torch.ones((), dtype=torch.float64)
    with pytest.raises(ValueError, match=r"free_spd has shape \(4, 2\)"):
        kernel(r, torch.ones(4, 2, dtype=torch.float64), torch.ones(2, 6, dtype=torch.float64))
    with pytest.raises(ValueError, match="built for nudged spd"):
        kernel(r, torch.ones(4, 3, dtype=torch.float64), None)
    assert kernel.launches == 0


def test_the_torch_window_keeps_the_torch_observables():
    cfg = tiny_config(window_backend="torch")
    assert build_step(tiny_machine(cfg), cfg, cfg, cfg.batch_size).relax.stats_kernel is None
