"""The rotor's angle gradient in one Triton launch (trainer2/physics/kernels/rotor_angle_grad.py) against
trainer2.physics.readout.rotor_angle_grad (the torch operators), in Triton's interpreter on CPU tensors; proof that a
batch step with the Triton readout runs it.

Needs triton and numpy (pip install -e '.[kernels]') and TRITON_INTERPRET=1, which tests/conftest.py sets before
anything imports triton; skipped with the reason otherwise."""

from __future__ import annotations

import pytest
import torch
from interpreted import require_interpreted_triton

require_interpreted_triton("the rotor angle kernel")

from test_triton_window import Spy  # noqa: E402
from tiny import tiny_batch, tiny_config, tiny_machine  # noqa: E402

from trainer2.learning.step import build_step  # noqa: E402
from trainer2.physics.kernels import rotor_angle_grad as kernel_module  # noqa: E402
from trainer2.physics.kernels.rotor_angle_grad import RotorAngleGrad  # noqa: E402
from trainer2.physics.readout import rotor_angle_grad, rotor_layers, rotor_layout, rotor_suffixes  # noqa: E402
from trainer2.running.step_runner import StepRunner  # noqa: E402


def rotor(n: int, k: int, dtype: torch.dtype, seed: int):
    """A random C (n, n), the suffixes of random angles, and the layout of k planes on n coordinates."""
    gen = torch.Generator().manual_seed(seed)
    layout = rotor_layout(n, k, dtype=dtype)
    theta = torch.randn(k, generator=gen, dtype=torch.float64).to(dtype)
    suffix = rotor_suffixes(rotor_layers(theta, layout)).contiguous()
    c = torch.randn(n, n, generator=gen, dtype=torch.float64).to(dtype)
    return c, suffix, layout


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize(("n", "k"), [(4, 5), (5, 9), (16, 32), (16, 120), (33, 40), (64, 7)])
def test_the_kernel_equals_rotor_angle_grad(n, k, dtype):
    """Even and odd coordinate counts (an odd n pads a dummy coordinate in the schedule), a block of planes and many,
    one plane a step at 64 coordinates: every angle's gradient within rounding of torch's products, none zero."""
    c, suffix, layout = rotor(n, k, dtype, seed=n * 1000 + k)
    want = rotor_angle_grad(c, suffix, layout)
    kernel = RotorAngleGrad(layout, c)
    got = kernel(c, suffix, layout)
    assert got.shape == want.shape == (k,) and kernel.launches == 1
    eps = torch.finfo(dtype).eps
    assert float(want.abs().min()) > 0  # up to 1.7 ulps of the largest measured (both dtypes, these cases)
    assert float((got - want).abs().max()) <= 16 * eps * float(want.abs().max()), float((got - want).abs().max())
    assert kernel(c.T.contiguous(), suffix, layout).neg().allclose(want, rtol=1e-4 if dtype == torch.float32 else 1e-10)


def test_a_c_of_another_size_is_refused_by_name():
    c, suffix, layout = rotor(8, 6, torch.float64, seed=0)
    kernel = RotorAngleGrad(layout, c)
    with pytest.raises(ValueError, match=r"c has shape \(7, 7\)"):
        kernel(c[:7, :7].contiguous(), suffix, layout)
    with pytest.raises(ValueError, match="built for 6 planes of 8 coordinates"):
        kernel(c, suffix, rotor_layout(8, 5, dtype=torch.float64))
    assert kernel.launches == 0


def test_the_batch_step_with_the_triton_readout_runs_it(monkeypatch):
    spy = Spy(kernel_module.rotor_angle_grad_kernel)
    monkeypatch.setattr(kernel_module, "rotor_angle_grad_kernel", spy)
    cfg = tiny_config(readout_backend="triton", free_steps=4, nudge_steps=2)
    step = build_step(tiny_machine(cfg), cfg, cfg, cfg.batch_size)
    assert isinstance(step.relax.readout_kernel.rotor, RotorAngleGrad)
    StepRunner(step).step(*tiny_batch(cfg))
    assert spy.grids == [(1,)] and step.relax.readout_kernel.rotor.launches == 1
