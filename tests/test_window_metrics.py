"""The window's metrics in two Triton launches (trainer2/physics/kernels/window_metrics.py) against the torch metrics
of Updater.apply, in Triton's interpreter on CPU tensors; proof that the kernels ran in a batch step.

Needs triton and numpy (pip install -e '.[kernels]') and TRITON_INTERPRET=1, which tests/conftest.py sets before
anything imports triton; skipped with the reason otherwise."""

from __future__ import annotations

import pytest
import torch
from interpreted import require_interpreted_triton

require_interpreted_triton("the metrics kernel")

from test_triton_window import Spy  # noqa: E402
from tiny import tiny_batch, tiny_config, tiny_machine  # noqa: E402

from trainer2.learning.step import build_step  # noqa: E402
from trainer2.learning.update import METRICS, MetricSums  # noqa: E402
from trainer2.physics.kernels import window_metrics  # noqa: E402
from trainer2.running.step_runner import StepRunner  # noqa: E402

COUNTS = ("windows", "examples", "correct_sum", "dropped", "nonfinite_params")  # whole numbers: equal exactly


def metrics_of_both(cfg, windows: int) -> tuple[dict[str, float], dict[str, float], int, int]:
    """The metric sums of `windows` batch steps of one machine with the kernel and of the same machine with the torch
    metrics (the fused update in both, so both trajectories are the same), the kernel's launches and programs."""
    sums = {}
    for kernel in (True, False):
        step = build_step(tiny_machine(cfg), cfg, cfg, cfg.batch_size)
        if not kernel:
            step.updater.metrics_kernel = None
        runner = StepRunner(step)
        for w in range(windows):
            runner.step(*tiny_batch(cfg, seed=w))
        sums[kernel], _ = step.updater.metrics.read()
        if kernel:
            launches, programs = step.updater.metrics_kernel.launches, step.updater.metrics_kernel.programs
    return sums[True], sums[False], launches, programs


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("block", [window_metrics.BLOCK, 16])
def test_the_metrics_kernel_equals_the_torch_metrics(dtype, block, monkeypatch):
    """Four windows: every count and flag equal, every sum within a few ulps (another order of addition); the sums
    are not zero, so a slot the kernel missed would show. At 16 elements a partial-sums program, the flat buffers
    split among several programs, whose sums the metrics program adds up."""
    monkeypatch.setattr(window_metrics, "BLOCK", block)
    cfg = tiny_config(dtype=dtype, update_backend="triton", free_steps=8, nudge_steps=4, batch_size=37)
    got, want, launches, programs = metrics_of_both(cfg, windows=4)
    assert launches == 8 and (programs > 4 if block == 16 else programs == 1), programs
    assert want["windows"] == 4 and want["examples"] == 4 * 37 and want["correct_sum"] > 0
    for k in METRICS:
        if k in COUNTS:
            assert got[k] == want[k], (k, got[k], want[k])
        else:
            assert got[k] == pytest.approx(want[k], rel=64 * torch.finfo(getattr(torch, dtype)).eps, abs=1e-30), k
    assert all(want[k] != 0 for k in ("loss_sum", "lior_mean", "spd_mean", "update_norm_energy", "update_norm_readout"))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_device_check_compares_the_metrics_and_can_fail(dtype, monkeypatch):
    """benchmarks/update_check.py's comparison (which the CUDA test runs compiled): equal here; with two of the
    kernel's slots swapped it reports the counts unequal."""
    from benchmarks.update_check import compare_metrics

    cfg = tiny_config(dtype=dtype)
    errors, facts = compare_metrics(cfg, torch.device("cpu"), steps=4)
    assert errors == {"metrics counts": 0.0, "metrics sums": errors["metrics sums"]} and facts["correct"] > 0
    assert errors["metrics sums"] <= 64 * torch.finfo(getattr(torch, dtype)).eps and facts["metrics launches"] == 8
    swapped = dict(MetricSums.slots(), windows=MetricSums.slots()["examples"], examples=MetricSums.slots()["windows"])
    monkeypatch.setattr(MetricSums, "slots", staticmethod(lambda: swapped))
    errors, _ = compare_metrics(cfg, torch.device("cpu"), steps=4)
    assert errors["metrics counts"] == float("inf")


def kernel_on(sums: torch.Tensor, probs: torch.Tensor, targets: torch.Tensor, flat: torch.Tensor, step: torch.Tensor):
    """The kernel once on hand-made tensors: the update's energy elements [0, 3), readout [3, 5), no embedding."""
    dt = flat.dtype
    stats = tuple(torch.tensor(v, dtype=dt) for v in (1.0, 2.0, 3.0, 4.0, 5.0, 6.0))
    kernel = window_metrics.WindowMetrics(flat, {"energy": slice(0, 3), "readout": slice(3, 5)}, MetricSums.slots(), 4)
    loss = torch.arange(probs.shape[0], dtype=dt)
    kernel(sums, loss, probs, targets, torch.tensor(0.0, dtype=dt), stats, step, flat)
    return dict(zip(METRICS, sums.tolist(), strict=True))


@pytest.mark.filterwarnings("ignore:invalid value encountered in multiply")  # inf * 0, on purpose
def test_the_metrics_kernel_on_known_values():
    """argmax as torch takes it (the first of equal maxima, a NaN wins), the norms of each group's own elements, the
    dropped flag from ok = 0, a non-finite parameter flagged, and the sums added to what was there."""
    probs = torch.tensor([[0.1, 0.4, 0.4, 0.1], [0.7, 0.1, 0.1, 0.1], [0.2, float("nan"), 0.5, 0.3]])
    assert probs.argmax(1).tolist() == [1, 0, 1]
    targets = torch.tensor([1, 1, 1])
    flat = torch.tensor([1.0, 2.0, float("inf"), 0.0, 0.0, 7.0])
    step = torch.tensor([3.0, 0.0, 4.0, 1.0, 0.0, 100.0])  # the last element is in no group
    sums = torch.ones(len(METRICS))
    got = kernel_on(sums, probs, targets, flat, step)
    want = dict.fromkeys(METRICS, 1.0)
    want.update(windows=2.0, examples=4.0, loss_sum=4.0, correct_sum=3.0, dropped=2.0)
    want.update(lior_mean=2.0, spd_mean=3.0, spd_last=4.0, R_mean=5.0, lior_nudge=6.0, spd_last_nudge=7.0)
    want.update(update_norm_energy=6.0, update_norm_readout=2.0, update_norm_embed=1.0, nonfinite_params=2.0)
    assert got == want
    finite = kernel_on(torch.zeros(len(METRICS)), probs, targets, flat.nan_to_num(posinf=0.0), step)
    assert finite["nonfinite_params"] == 0.0


def test_the_batch_step_runs_the_metrics_kernel(monkeypatch):
    parts, metrics = Spy(window_metrics.partial_sums_kernel), Spy(window_metrics.window_metrics_kernel)
    monkeypatch.setattr(window_metrics, "partial_sums_kernel", parts)
    monkeypatch.setattr(window_metrics, "window_metrics_kernel", metrics)
    cfg = tiny_config(update_backend="triton", free_steps=4, nudge_steps=2)
    step = build_step(tiny_machine(cfg), cfg, cfg, cfg.batch_size)
    assert isinstance(step.updater.metrics_kernel, window_metrics.WindowMetrics)
    StepRunner(step).step(*tiny_batch(cfg))
    assert parts.grids == [(1,)] and metrics.grids == [(1,)] and step.updater.metrics.values[0].item() == 1.0


def test_the_torch_update_keeps_the_torch_metrics():
    cfg = tiny_config(update_backend="torch")
    assert build_step(tiny_machine(cfg), cfg, cfg, cfg.batch_size).updater.metrics_kernel is None


def test_a_tensor_of_another_shape_is_refused_by_name():
    flat = torch.zeros(6, dtype=torch.float64)
    kernel = window_metrics.WindowMetrics(flat, {"energy": slice(0, 6)}, MetricSums.slots(), 4)
    stats = tuple(torch.zeros((), dtype=torch.float64) for _ in range(6))
    loss, probs = torch.zeros(3, dtype=torch.float64), torch.zeros(3, 5, dtype=torch.float64)
    sums = torch.zeros(len(METRICS), dtype=torch.float64)
    ok = torch.ones((), dtype=torch.float64)
    with pytest.raises(ValueError, match=r"probs has shape \(3, 5\)"):
        kernel(sums, loss, probs, torch.zeros(3, dtype=torch.int64), ok, stats, flat, flat)
    assert kernel.launches == 0
