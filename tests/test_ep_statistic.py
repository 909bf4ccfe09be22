"""The EP statistic of dense couplings in one Triton launch each (trainer2/physics/kernels/ep_statistic.py) against
trainer2.physics.energy.ep_grads (the couplings' torch operators), in Triton's interpreter on CPU tensors; proof that
a batch step with the Triton window runs it, and that a coupling it does not know keeps its own statistic.

Needs triton and numpy (pip install -e '.[kernels]') and TRITON_INTERPRET=1, which tests/conftest.py sets before
anything imports triton; skipped with the reason otherwise."""

from __future__ import annotations

import pytest
import torch
from interpreted import require_interpreted_triton

require_interpreted_triton("the EP statistic kernel")

from test_triton_window import Spy  # noqa: E402
from tiny import tiny_batch, tiny_config, tiny_machine  # noqa: E402

from trainer2.learning.step import build_step  # noqa: E402
from trainer2.physics.couplings import Dense  # noqa: E402
from trainer2.physics.energy import ep_grads  # noqa: E402
from trainer2.physics.kernels import ep_statistic  # noqa: E402
from trainer2.physics.kernels.backend import Backend, ep_kernel  # noqa: E402
from trainer2.running.step_runner import StepRunner  # noqa: E402


def states(m, rows: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Random + and - states of every layer, and an input x, for `rows` examples."""
    gen = torch.Generator().manual_seed(seed)
    dtype = m.flat.dtype
    sizes = m.state_sizes()
    plus = [torch.rand(rows, h, generator=gen, dtype=torch.float64).to(dtype) for h in sizes]
    minus = [p + 1e-3 * torch.randn(p.shape, generator=gen, dtype=torch.float64).to(dtype) for p in plus]
    x = torch.randn(rows, m.energy.couplings[0].weight.shape[1], generator=gen, dtype=torch.float64).to(dtype)
    return plus, minus, x


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("rows", [5, 70])
def test_the_kernel_equals_the_couplings_statistic(dtype, rows):
    """Three dense couplings (input 40 -> 40 -> 33 -> q 4; none a multiple of the 32-wide tiles, two column blocks on
    the clamped one), a batch smaller than a tile and one over two: every weight, bias and the input's gradient within
    rounding of torch's, none zero."""
    cfg = tiny_config(dtype=dtype, hidden_sizes=[40, 33], coord_dim_n=4, context_len=5, embed_dim=8)
    m = tiny_machine(cfg)
    plus, minus, x = states(m, rows, seed=rows)
    scale = 1.0 / (2e-3 * rows)
    want, want_gx = ep_grads(plus, minus, x, m.energy, scale, None, input_grad=True)
    kernel = ep_statistic.EPStatistic(scale, m.flat)
    got, got_gx = kernel(plus, minus, x, m.energy, scale, None, input_grad=True)
    assert kernel.launches == 3 and got.keys() == want.keys()
    # The statistic is a difference of two nearly equal products, so both sides round at the size of the products:
    # the tolerance is relative to those (the statistic of |s+| against zero), not to the difference itself.
    sizes, _ = ep_grads([p.abs() for p in plus], [0 * p for p in plus], x.abs(), m.energy, scale, None)
    eps = torch.finfo(getattr(torch, dtype)).eps
    for k, w in [*want.items(), ("input", want_gx)]:
        g = got_gx if k == "input" else got[k]
        size = float(w.abs().max()) if k == "input" else float(sizes[k].abs().max())
        assert float(w.abs().max()) > 0, k
        assert float((g - w).abs().max()) <= 16 * eps * size, (k, float((g - w).abs().max()), size)
    _, no_gx = kernel(plus, minus, x, m.energy, scale, None, input_grad=False)
    assert no_gx is None


def test_states_of_another_width_are_refused_by_name():
    cfg = tiny_config(hidden_sizes=[40])
    m = tiny_machine(cfg)
    plus, minus, x = states(m, 7, seed=0)
    kernel = ep_statistic.EPStatistic(1.0, m.flat)
    with pytest.raises(ValueError, match=r"below_plus has shape \(7, 8\)"):
        kernel(plus, minus, x[:, :8].contiguous(), m.energy, 1.0, None)
    with pytest.raises(ValueError, match="built for scale 1.0"):
        kernel(plus, minus, x, m.energy, 0.5, None)
    assert kernel.launches == 0


def test_a_wrong_statistic_is_far_outside_the_tolerance():
    """The comparison can fail: the + and - phases swapped give the statistic's negative."""
    cfg = tiny_config(hidden_sizes=[40])
    m = tiny_machine(cfg)
    plus, minus, x = states(m, 7, seed=0)
    want, _ = ep_grads(plus, minus, x, m.energy, 1.0, None)
    got, _ = ep_statistic.EPStatistic(1.0, m.flat)(minus, plus, x, m.energy, 1.0, None)
    assert all(torch.allclose(got[k], -w, rtol=1e-12, atol=1e-15) and w.abs().max() > 0 for k, w in want.items())


def test_the_batch_step_with_the_triton_window_runs_the_kernel(monkeypatch):
    spy = Spy(ep_statistic.ep_statistic_kernel)
    monkeypatch.setattr(ep_statistic, "ep_statistic_kernel", spy)
    cfg = tiny_config(window_backend="triton", hidden_sizes=[12], free_steps=4, nudge_steps=2)
    step = build_step(tiny_machine(cfg), cfg, cfg, cfg.batch_size)
    assert isinstance(step.relax.ep_statistic, ep_statistic.EPStatistic)
    StepRunner(step).step(*tiny_batch(cfg))
    assert spy.grids == [(1, 1), (1, 1)] and step.relax.ep_statistic.launches == 2  # input -> h1, h1 -> q


class OwnDense(Dense):
    """A user's subclass of Dense: it may define its statistic otherwise, so the kernel must not stand in for it."""


def test_a_subclass_of_dense_keeps_its_own_statistic():
    """The kernel serves trainer2's Dense only (the Triton window refuses other couplings anyway, by name)."""
    cfg = tiny_config(hidden_sizes=[12])
    m = tiny_machine(cfg)
    window = Backend("triton", "--window_backend triton")
    assert isinstance(ep_kernel(window, m.energy, 1.0, m.flat), ep_statistic.EPStatistic)
    object.__setattr__(m.energy.couplings[1], "__class__", OwnDense)  # frozen: as a user's coupling would be built
    assert not ep_statistic.serves(m.energy) and ep_kernel(window, m.energy, 1.0, m.flat) is None


def test_recurrent_backprop_with_the_triton_window_forms_no_statistic():
    """rbp's adjoint has no nudged phases (divisor 0): no kernel is built for it, and its batch step runs."""
    cfg = tiny_config(window_backend="triton", rule="rbp", hidden_sizes=[12], free_steps=4, nudge_steps=2)
    step = build_step(tiny_machine(cfg), cfg, cfg, cfg.batch_size, rule="rbp")
    assert step.relax.ep_statistic is ep_grads
    StepRunner(step).step(*tiny_batch(cfg))


def test_the_torch_window_keeps_the_torch_statistic():
    cfg = tiny_config(window_backend="torch")
    assert build_step(tiny_machine(cfg), cfg, cfg, cfg.batch_size).relax.ep_statistic is ep_grads
