"""The fused Triton update (trainer2/physics/kernels/fused_update.py) against the torch update it replaces (flat_update
then clamp_readout), in Triton's interpreter on CPU tensors; a training run with it; proof that its kernels ran.

Needs triton and numpy (pip install -e '.[kernels]') and TRITON_INTERPRET=1, which tests/conftest.py sets before
anything imports triton; skipped with the reason otherwise."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from interpreted import require_interpreted_triton

require_interpreted_triton("the fused update")

from test_triton_window import Spy  # noqa: E402
from tiny import tiny_batch, tiny_config, tiny_machine  # noqa: E402

from benchmarks.update_check import VARIANTS, compare, tolerance  # noqa: E402
from trainer2.learning.step import build_step  # noqa: E402
from trainer2.physics.kernels import fused_update  # noqa: E402
from trainer2.running.step_runner import StepRunner  # noqa: E402
from trainer2.running.trainer import Trainer  # noqa: E402
from trainer2.train_config import TrainConfig, build_config  # noqa: E402

CASES = [(d, r, v) for d in ("float32", "float64") for r in ("momentum", "nesterov", "adam") for v in VARIANTS]


@pytest.mark.parametrize("dtype,rule,variant", CASES, ids=["-".join(c) for c in CASES])
def test_the_fused_update_equals_the_torch_update(dtype, rule, variant):
    """Six updates (the fourth gradient non-finite, in the last block) of a 4,800-parameter machine whose readout sits
    outside its bounds and whose zero-gradient moments are subnormal. Heavy-ball and Nesterov momentum: bitwise (the
    same operations in the same order). Adam: the count and drops bitwise, the moments too without decay (with it they
    see the parameters); the rest within 6 ulps relative to the largest entry (b^t is exp2(t log2 b) in the kernel, pow
    in torch; torch's vectorised CPU sqrt is not correctly rounded and the kernel's is), where a wrong coefficient is
    off by about the learning rate."""
    cfg = TrainConfig(
        hidden_sizes=[128],
        embed_dim=8,
        context_len=4,
        coord_dim_n=4,
        dtype=dtype,
        update_rule=rule,
        device="cpu",
        update_backend="triton",
        **VARIANTS[variant],
    )
    errors, facts = compare(cfg, torch.device("cpu"), steps=6, drop_at=3)
    moments = () if variant == "plain" else ("momentum", "second moment")
    near = () if rule != "adam" else ("param", "step", *moments)
    assert all(v == 0.0 for k, v in errors.items() if k not in near), errors
    assert all(errors[k] <= tolerance(cfg, 6) for k in near), errors
    # what the run exercised: the drop, the flush, every clamp, several programs and partial sums, 2 launches a step
    assert facts["oks"] == [1.0, 1.0, 1.0, 0.0, 1.0, 1.0] and facts["flushed"] and facts["clamped"], facts
    assert facts["programs"] >= 4 and facts["sums"] == 2 and facts["launches"] == 12, facts


def test_a_wrong_constant_is_far_outside_the_tolerance(monkeypatch):
    """The comparison can fail: the kernel given Adam's epsilon 1e-8 while torch uses 1e-3 is off by far more."""
    cfg = TrainConfig(hidden_sizes=[12], dtype="float32", device="cpu", update_backend="triton", adam_eps=1e-3)
    wrong = fused_update.constants(0.9, 0.999, 1e-8, cfg.g_min, cfg.g_max, cfg.r_min, torch.float32)
    monkeypatch.setattr(fused_update, "constants", lambda *a: wrong)
    errors, _ = compare(cfg, torch.device("cpu"), steps=2, drop_at=5)
    assert errors["step"] > 1e5 * tolerance(cfg, 2) and errors["param"] > 100 * tolerance(cfg, 2), errors


def test_the_updater_runs_the_kernels_in_a_batch_step(monkeypatch):
    sums, update = Spy(fused_update.grad_sums_kernel), Spy(fused_update.fused_update_kernel)
    monkeypatch.setattr(fused_update, "grad_sums_kernel", sums)
    monkeypatch.setattr(fused_update, "fused_update_kernel", update)
    cfg = tiny_config(update_backend="triton", free_steps=4, nudge_steps=2)
    step = build_step(tiny_machine(cfg), cfg, cfg, cfg.batch_size)
    assert step.updater.backend.name == "triton" and isinstance(step.updater.fused, fused_update.FusedUpdate)
    before = step.updater.table.flat.clone()
    StepRunner(step).step(*tiny_batch(cfg))
    assert sums.grids == [(1,)] and update.grids == [(1,)] and step.updater.fused.launches == 2
    assert not torch.equal(step.updater.table.flat, before)  # it updated


def test_a_training_run_with_the_fused_update_matches_torch(tmp_path, small_text):
    """60 windows of EP training (float64) with each update backend: the same parameters, weight average and held-out
    loss; summary.json names the backend; 2 launches a window, and one for the average (kernels/weight_average.py)."""
    base = dict(
        hidden_sizes=[10, 8],
        coord_dim_n=4,
        rotor_k=4,
        context_len=3,
        embed_dim=3,
        batch_size=8,
        free_steps=10,
        nudge_steps=6,
        r_init=4.0,
        proto_init_scale=0.3,
        eta_update=0.01,
        max_windows=60,
        log_every_windows=30,
        eval_every_windows=0,
        eval_batches=1,
        dtype="float64",
        data=str(small_text),
        device="cpu",
        weight_decay=1e-3,
        eta_readout_scale=2.0,
        ema_decay=0.9,
    )
    runs = {}
    for backend in ("triton", "torch"):
        cfg = build_config([("test", {**base, "update_backend": backend, "checkpoint_dir": str(tmp_path / backend)})])
        trainer = Trainer(cfg, log=lambda *_: None)
        start = trainer.machine.flat.clone()
        summary = trainer.train()
        assert float((trainer.machine.flat - start).abs().max()) > 1e-2  # it really trained
        runs[backend] = trainer, summary
    (tri, tri_summary), (ref, ref_summary) = runs["triton"], runs["torch"]
    assert tri_summary["update_backend"] == "triton" and ref_summary["update_backend"] == "torch"
    assert tri.updater.fused.launches == 2 * 60 and ref.updater.fused is None
    assert tri.average.kernel.launches == 60 and ref.average.kernel is None
    err = float(
        (tri.average.machine.flat - ref.average.machine.flat).abs().max() / ref.average.machine.flat.abs().max()
    )
    assert err <= 1e-9, err
    err = float((tri.machine.flat - ref.machine.flat).abs().max() / ref.machine.flat.abs().max())
    assert err <= 1e-9, err  # each update agrees to an ulp; a wrong one is off by about the learning rate (1e-2)
    assert abs(tri_summary["heldout_loss"] - ref_summary["heldout_loss"]) <= 1e-9 * ref_summary["heldout_loss"]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_average_kernel_equals_the_torch_average(dtype):
    """The weight average moved by kernels/weight_average.py against WeightAverage's torch operators, six moves with
    the angles winding past +-pi: bitwise off the angles, within a few ulps on them (the short way round's products
    may round in another order), the count alike, one launch a move."""
    from benchmarks.update_check import compare_average

    cfg = tiny_config(dtype=dtype, update_backend="triton")
    errors, facts = compare_average(cfg, torch.device("cpu"), steps=6)
    assert facts["turns"] > 0 and facts["average launches"] == 6, facts  # the wrap was crossed, the kernel ran
    assert errors["average count"] == 0.0 and errors["average"] <= 4 * torch.finfo(getattr(torch, dtype)).eps, errors


def test_the_average_kernel_moves_the_angles_the_short_way_round():
    """An angle at 3.1 averaged toward -3.1 (0.08 apart across the wrap) moves across pi, not through 0, and is
    wrapped; the other entries move by the plain lerp; the count steps on."""
    from trainer2.physics.kernels.weight_average import AverageKernel

    avg = torch.tensor([3.1, 1.0, 2.0], dtype=torch.float64)
    param = torch.tensor([-3.1, 3.0, -2.0], dtype=torch.float64)
    count = torch.tensor([100.0], dtype=torch.float64)
    kernel = AverageKernel(avg, slice(0, 1), decay=0.99)
    kernel(avg, param, count)
    w = 9 / 110  # max(9 / (10 + t), 1 - decay)
    short = 3.1 + w * (2 * math.pi - 6.2)  # the turn toward -3.1 + 2 pi, then wrapped
    assert avg[0].item() == pytest.approx(short - 2 * math.pi if short >= math.pi else short, abs=1e-12)
    assert avg[1:].tolist() == pytest.approx([1.0 + w * 2.0, 2.0 - w * 4.0], abs=1e-15)
    assert count.item() == 101.0 and kernel.launches == 1


def test_the_average_kernel_refuses_buffers_of_another_size_by_name():
    from trainer2.physics.kernels.weight_average import AverageKernel

    avg, param = torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    kernel = AverageKernel(avg, slice(0, 1), decay=0.99)
    with pytest.raises(ValueError, match=r"count has shape \(\)"):
        kernel(avg, param, torch.zeros((), dtype=torch.float64))  # 0-dim: the checkpoint's shape, not the buffer's
    with pytest.raises(ValueError, match="param has shape .* dtype torch.float32"):
        kernel(avg, param.float(), torch.zeros(1, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"avg has shape \(2,\)"):
        kernel(avg[:2].contiguous(), param, torch.zeros(1, dtype=torch.float64))
    assert kernel.launches == 0


def test_a_buffer_in_another_layout_is_refused_not_misread():
    cfg = tiny_config(update_backend="triton")
    step = build_step(tiny_machine(cfg), cfg, cfg, cfg.batch_size)
    u, s = step.updater, step.updater.state
    strided = torch.zeros(2 * u.grad.numel(), dtype=u.grad.dtype)[::2]
    with pytest.raises(ValueError, match="contiguous"):
        u.fused(u.table.flat, strided, s.bufs, s.sq, s.count, s.lr, s.dropped, None, None, u.step)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (python -m benchmarks.gpu_checks on one)")
def test_the_compiled_update_equals_the_torch_update_on_cuda():
    """The real (compiled, not interpreted) kernels at the dev preset's shapes, float32 and float64; in a subprocess,
    since this process interprets Triton."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0"}
    for dtype in ("float32", "float64"):
        cmd = [sys.executable, "-m", "benchmarks.update_check", "--preset", "dev", "--device", "cuda", "--dtype", dtype]
        proc = subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parent.parent
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_device_check_script_passes_in_the_interpreter(capsys):
    """benchmarks/update_check.py, which the CUDA test runs at the dev preset's shapes, on tiny CPU shapes."""
    from benchmarks import update_check

    assert update_check.main(["--device", "cpu", "--hidden_sizes", "8", "--steps", "3", "--dtype", "float64"]) == 0
    out = capsys.readouterr().out
    assert out.count("'oks': [1.0, 0.0, 1.0]") == 6 and "nesterov decay+mult" in out and "PASS" in out
