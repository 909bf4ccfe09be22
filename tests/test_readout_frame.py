"""The readout's frame and fold in one Triton launch (trainer2/physics/kernels/readout_frame.py) against readout_frame
and fold_frame, in Triton's interpreter on CPU tensors; and proof that a run with --readout_backend triton takes it.

Needs triton and numpy (pip install -e '.[kernels]') and TRITON_INTERPRET=1, which tests/conftest.py sets before
anything imports triton; skipped with the reason otherwise."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from interpreted import require_interpreted_triton

require_interpreted_triton("the readout frame kernel")

from tiny import tiny_config, tiny_machine  # noqa: E402

from trainer2.physics.dynamics import FoldBlocks, fold_frame  # noqa: E402
from trainer2.physics.kernels import readout_frame as frame_kernel  # noqa: E402
from trainer2.physics.memory import MemoryBank  # noqa: E402
from trainer2.physics.readout import readout_frame  # noqa: E402

TOL = {torch.float32: 2e-6, torch.float64: 1e-13}
# (coordinates, rotor planes, classes, memory slots): the dev preset's 16 / 32, an odd n (a dummy sits out each round),
# no rotor at all, more planes than one round (layers repeat their pairs), a memory bank's candidates, and 24
# coordinates (two 16-wide tiles padded to 32)
CASES = [(16, 32, 10, 0), (5, 7, 7, 0), (4, 0, 3, 0), (6, 40, 5, 0), (8, 12, 6, 24), (24, 30, 12, 0)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("case", CASES, ids=[f"n{n}-k{k}-V{v}-mem{s}" for n, k, v, s in CASES])
def test_the_kernel_equals_readout_frame_and_fold_frame(case, dtype):
    """Every field of the frame and the fold as the torch functions give them, to rounding; twice in a row (the
    kernel's buffers are reused), the second time at other parameters, candidates and output bias."""
    n, k, classes, slots = case
    cfg = tiny_config(coord_dim_n=n, rotor_k=k, memory_capacity=slots, dtype=str(dtype).split(".")[1])
    m = tiny_machine(cfg, classes)
    cand = m.prototype_candidates()
    if slots:
        bank = MemoryBank.allocate(slots, n, cfg.batch_size, m.readout.protos)
        gen = torch.Generator().manual_seed(2)
        for start in range(0, slots - 5, cfg.batch_size):
            bank.offsets = torch.arange(cfg.batch_size)
            bank.write(torch.randn(cfg.batch_size, n, generator=gen, dtype=dtype), torch.arange(cfg.batch_size) % 3)
        cand = bank.candidates(cand)
    blocks = FoldBlocks.make(n, cand.coords.shape[0], cfg.eps, m.readout.protos)
    kernel = frame_kernel.FrameKernel(m.layout, cand.coords.shape[0], cfg.retrieval_beta, cfg.eps, blocks, cand.coords)
    for turn in range(2):
        if turn:
            with torch.no_grad():
                m.readout.theta.mul_(-1.7).add_(0.3)
                m.readout.g_diag.mul_(0.6)
                m.readout.r_sc.fill_(3.0)
                m.energy.output.bias.add_(torch.linspace(-0.5, 0.5, n, dtype=dtype))
                cand = replace(cand, coords=cand.coords.flip(0).mul(0.8).contiguous())
        ref_frame = readout_frame(m.readout, cand, m.layout, cfg.retrieval_beta, cfg.eps)
        ref_fold = fold_frame(m.energy, ref_frame, blocks)
        frame, fold = kernel(m.readout, cand, m.energy.output.bias)
        pairs = {
            name: (getattr(frame, name), getattr(ref_frame, name)) for name in ("suffix", "rot", "zc", "gzc_t", "cc")
        }
        pairs["neg_scale"] = (frame.neg_scale, ref_frame.neg_scale)
        for name in ("mq_nudge", "b_nudge", "lt", "yc2", "caug"):
            pairs[name] = (getattr(fold, name), getattr(ref_fold, name))
        for name, (a, b) in pairs.items():
            assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, b.shape)
            scale = max(float(b.abs().max()), 1.0)
            assert float((a - b).abs().max()) <= TOL[dtype] * scale, (name, float((a - b).abs().max()))
        assert torch.equal(fold.c, ref_fold.c) and fold.bias is cand.bias and frame.beta_r == ref_frame.beta_r
        if k:  # not vacuous: the rotor turns the candidates
            assert float((frame.zc - cand.coords).abs().max()) > 1e-3
    assert kernel.launches == 2


def test_fits_bounds_the_planes_and_the_rotor_by_their_padded_tiles_in_bytes():
    assert frame_kernel.fits(32, 16, 4) and frame_kernel.fits(512, 16, 4) and frame_kernel.fits(256, 16, 8)
    assert (
        not frame_kernel.fits(1024, 16, 4) and not frame_kernel.fits(512, 32, 4) and not frame_kernel.fits(512, 16, 8)
    )
    assert frame_kernel.fits(32, 64, 8) and not frame_kernel.fits(32, 128, 4)  # the (n, n) rotor: 64 KiB at 128


def test_candidates_of_another_size_are_refused_by_name_not_read_past():
    """Built for 7 candidates, called with 5: without the check the kernel reads two rows past their end."""
    cfg = tiny_config(coord_dim_n=4, rotor_k=5)
    m = tiny_machine(cfg, 7)
    cand = m.prototype_candidates()
    blocks = FoldBlocks.make(4, 7, cfg.eps, m.readout.protos)
    kernel = frame_kernel.FrameKernel(m.layout, 7, cfg.retrieval_beta, cfg.eps, blocks, cand.coords)
    with pytest.raises(ValueError, match=r"coords has shape \(5, 4\)"):
        kernel(m.readout, replace(cand, coords=cand.coords[:5].contiguous()), m.energy.output.bias)
    with pytest.raises(ValueError, match=r"bias has shape \(3,\)"):
        kernel(m.readout, cand, m.energy.output.bias[:3].contiguous())
    assert kernel.launches == 0


def test_the_frame_kernel_runs_beside_the_readout_kernel_and_auto_takes_it_where_the_switch_is_on(monkeypatch):
    """Beside the readout kernel: taken when --readout_backend triton asks for the kernels, and when auto chose them
    while AUTO_TAKES_TRITON_FRAME is on (since a GPU ran it compiled); never beside the torch readout, and not for a
    rotor past one program."""
    from trainer2.physics.kernels import backend

    cfg = tiny_config(coord_dim_n=4, rotor_k=5)
    m = tiny_machine(cfg, 7)
    blocks = FoldBlocks.make(4, 7, cfg.eps, m.readout.protos)
    tri, torch_ = backend.Backend("triton", "test"), backend.Backend("torch", "test")

    def made(readout: backend.Backend, requested: str, layout=m.layout) -> bool:
        kernel = backend.frame_kernel(readout, requested, layout, 7, 1.0, cfg.eps, blocks, m.readout.protos)
        return isinstance(kernel, frame_kernel.FrameKernel)

    assert made(tri, "triton") and made(tri, "auto") and not made(torch_, "torch") and not made(torch_, "auto")
    monkeypatch.setattr(backend, "AUTO_TAKES_TRITON_FRAME", False)
    assert made(tri, "triton") and not made(tri, "auto")
    monkeypatch.setattr(frame_kernel, "MAX_BYTES", 16 * 16 * 8 - 1)
    assert not made(tri, "triton")  # 5 planes and 4 coordinates, each padded to 16, in float64: one byte past
