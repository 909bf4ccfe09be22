"""The spectral cap in one Triton launch (trainer2/physics/kernels/cap_power.py) against its torch reference,
Dense.cap_power, in Triton's interpreter on CPU tensors; and proof that the Triton update takes it.

Needs triton and numpy (pip install -e '.[kernels]') and TRITON_INTERPRET=1, which tests/conftest.py sets before
anything imports triton; skipped with the reason otherwise."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from interpreted import require_interpreted_triton

require_interpreted_triton("the cap kernel")

from test_triton_window import Spy  # noqa: E402
from tiny import tiny_batch, tiny_config, tiny_machine  # noqa: E402

from trainer2.learning.step import build_step  # noqa: E402
from trainer2.physics.couplings import Dense  # noqa: E402
from trainer2.physics.kernels import cap_power  # noqa: E402
from trainer2.running.step_runner import StepRunner  # noqa: E402

SHAPES = [(16, 256), (32, 1024), (5, 7), (1, 3)]  # the dev and deep presets' W_out, odd sizes, one row
TOL = {torch.float32: 2e-6, torch.float64: 1e-14}


def pair(shape: tuple[int, int], dtype: torch.dtype, norm: float) -> tuple[Dense, torch.Tensor]:
    """A dense coupling with W (R, C) of spectral norm about `norm`, and a unit power vector u (R,)."""
    gen = torch.Generator().manual_seed(sum(shape))
    w = torch.randn(shape, generator=gen, dtype=torch.float64)
    w *= norm / torch.linalg.matrix_norm(w, ord=2)
    u = torch.randn(shape[0], generator=gen, dtype=torch.float64)
    c = Dense("1", w.to(dtype), torch.zeros(shape[0], dtype=dtype))
    return c, (u / u.norm()).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{r}x{c}" for r, c in SHAPES])
def test_the_kernel_caps_as_dense_cap_power(shape, dtype):
    """Twice in a row (the persistent vector carries over), over the cap (W scaled down) and under it (W unchanged):
    W and u as the torch operators leave them, to rounding; W under the cap keeps its bits."""
    for norm, cap in ((3.0, 0.7), (0.5, 0.7)):
        ref, u_ref = pair(shape, dtype, norm)
        tri, u_tri = pair(shape, dtype, norm)
        before = tri.weight.clone()
        kernel = cap_power.CapPower(tri.weight, cap)
        for _ in range(2):
            ref.cap_power(cap, u_ref)
            kernel(u_tri)
        scale = float(ref.weight.abs().max())
        assert float((tri.weight - ref.weight).abs().max()) <= TOL[dtype] * scale, (norm, shape)
        torch.testing.assert_close(u_tri, u_ref, rtol=TOL[dtype] * 10, atol=TOL[dtype] * 10)
        if norm < cap and shape[0] > 1:
            assert torch.equal(tri.weight, before)
        elif norm > cap:  # it scaled W down (towards the cap: two power steps from a random u underestimate the norm)
            assert float(torch.linalg.matrix_norm(tri.weight.double(), ord=2)) < 0.5 * norm


def test_a_zero_coupling_stays_zero_without_nans():
    c, u = pair((4, 6), torch.float32, 1.0)
    c.weight.zero_()
    cap_power.CapPower(c.weight, 0.7)(u)
    assert torch.equal(c.weight, torch.zeros_like(c.weight)) and torch.equal(u, torch.zeros_like(u))


def test_what_one_program_cannot_hold_keeps_the_torch_cap():
    assert cap_power.fits(torch.zeros(32, 1024)) and not cap_power.fits(torch.zeros(32, 1025))
    assert cap_power.fits(torch.zeros(16, 1024, dtype=torch.float64)) and not cap_power.fits(torch.zeros(33, 1024))
    assert not cap_power.fits(torch.zeros(8, 16).T)  # not contiguous


def test_the_triton_update_caps_each_dense_coupling_in_one_launch(monkeypatch):
    """Two dense couplings between state layers: one launch each per batch step, none of Dense.cap_power's operators."""
    spy = Spy(cap_power.cap_power_kernel)
    monkeypatch.setattr(cap_power, "cap_power_kernel", spy)
    cfg = tiny_config(update_backend="triton", hidden_sizes=[9, 7], free_steps=4, nudge_steps=2)
    step = build_step(tiny_machine(cfg), cfg, cfg, cfg.batch_size)
    assert [type(c) for c in step.updater.caps] == [cap_power.CapPower] * 2
    monkeypatch.setattr(Dense, "cap_power", lambda *a: pytest.fail("the torch cap ran"))
    StepRunner(step).step(*tiny_batch(cfg))
    assert spy.grids == [(1,), (1,)]


CUDA_CHECK = """
import torch
from trainer2.physics.couplings import Dense
from trainer2.physics.kernels.cap_power import CapPower

for dtype, tol in ((torch.float32, 1e-5), (torch.float64, 1e-13)):
    for shape in ((16, 256), (32, 1024), (5, 7)):
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(shape, generator=gen, dtype=torch.float64)
        w *= 3.0 / torch.linalg.matrix_norm(w, ord=2)
        u = torch.randn(shape[0], generator=gen, dtype=torch.float64)
        ref, tri = (Dense("1", w.to("cuda", dtype), torch.zeros(shape[0], dtype=dtype, device="cuda")) for _ in "ab")
        u_ref, u_tri = u.div(u.norm()).to("cuda", dtype), u.div(u.norm()).to("cuda", dtype)
        kernel = CapPower(tri.weight, 0.7)
        for _ in range(2):
            ref.cap_power(0.7, u_ref)
            kernel(u_tri)
        err = float((tri.weight - ref.weight).abs().max() / ref.weight.abs().max())
        assert err <= tol and float((u_tri - u_ref).abs().max()) <= 10 * tol, (dtype, shape, err)
        assert kernel.launches == 2
print("PASS")
"""


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (python -m benchmarks.gpu_checks on one)")
def test_the_compiled_kernel_caps_as_dense_cap_power_on_cuda():
    """The real (compiled, not interpreted) kernel at the presets' shapes, float32 and float64, against Dense.cap_power
    on the GPU; in a subprocess, since this process interprets Triton."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-c", CUDA_CHECK], env=env, capture_output=True, text=True, cwd=root)
    assert proc.returncode == 0 and "PASS" in proc.stdout, proc.stdout[-4000:] + proc.stderr[-4000:]
