"""The Triton window (trainer2/kernels) against the torch window it replaces, in Triton's interpreter on CPU tensors:
every phase's states, q history and spd, a short training run, the EP gradient, and proof that the kernels ran.

Needs triton and numpy (pip install -e '.[kernels]') and TRITON_INTERPRET=1, which tests/conftest.py sets before
anything imports triton; skipped with the reason otherwise."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from interpreted import require_interpreted_triton

require_interpreted_triton("the Triton window")

from tiny import tiny_batch, tiny_config, tiny_machine  # noqa: E402

from benchmarks.autograd_reference import cosine  # noqa: E402
from benchmarks.exact_gradient_reference import exact_gradients  # noqa: E402
from trainer2.learning.gradients import ep_gradients  # noqa: E402
from trainer2.physics.dynamics import even_odd_steps, fixed_point_steps  # noqa: E402
from trainer2.physics.kernels import free_phase, nudged_phase  # noqa: E402
from trainer2.physics.kernels.backend import TritonWindow  # noqa: E402
from trainer2.physics.memory import MemoryBank  # noqa: E402
from trainer2.physics.relaxation import Relaxation  # noqa: E402
from trainer2.running.trainer import Trainer  # noqa: E402
from trainer2.train_config import build_config  # noqa: E402

TOL = {"float32": 1e-5, "float64": 1e-10}  # largest |triton - torch| relative to the largest |torch|, per tensor


def relaxations(backends: tuple[str, ...], memory: int, **overrides) -> list[Relaxation]:
    """One Relaxation per backend over identical tiny machines (a memory bank of `memory` slots, filled)."""
    cfg = tiny_config(memory_capacity=memory, free_steps=12, nudge_steps=8, beta_nudge=0.05, **overrides)
    out = []
    for backend in backends:
        m = tiny_machine(cfg.model_copy(update={"window_backend": backend}))
        bank = None
        if memory:
            bank = MemoryBank.allocate(memory, cfg.coord_dim_n, cfg.batch_size, m.readout.protos)
            gen = torch.Generator().manual_seed(4)
            coords = torch.randn(cfg.batch_size, cfg.coord_dim_n, generator=gen, dtype=torch.float64)
            bank.write(coords.to(m.readout.protos.dtype), torch.arange(cfg.batch_size) % 7)
        out.append(Relaxation(m, cfg.model_copy(update={"window_backend": backend}), cfg.batch_size, bank))
    return out


def assert_near(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:g}"


def compare(tri: Relaxation, ref: Relaxation, nudged: bool, tol: float) -> None:
    """States, q history and spd of the last window of each workspace."""
    a, b = (r.ws_nudged if nudged else r.ws for r in (tri, ref))
    for i, (x, y) in enumerate(zip(a.state.s, b.state.s, strict=True)):
        assert_near(x, y, tol, f"layer {i}")
    assert_near(a.q_hist, b.q_hist, tol, "q history")
    assert_near(a.spd_hist, b.spd_hist, tol, "spd")


CASES = [
    (dtype, hidden, memory, batch)
    for hidden in ([12], [9, 7], [9, 7, 6])
    for memory in (0, 16)
    for dtype, batches in (("float32", (1, 8, 13, 64)), ("float64", (13,)))
    for batch in batches
]


@pytest.mark.parametrize(
    "dtype,hidden,memory,batch",
    CASES,
    ids=[f"{d}-h{'x'.join(map(str, h))}-{'bank' if m else 'onehot'}-b{b}" for d, h, m, b in CASES],
)
def test_each_phase_equals_the_torch_window(dtype, hidden, memory, batch):
    """Free phase, then the stacked +beta/-beta nudged phase (one-hot readout, or a memory bank sharing labels)."""
    slots = max(memory, batch) if memory else 0  # a bank holds at least a batch
    tri, ref = relaxations(("triton", "torch"), slots, dtype=dtype, hidden_sizes=hidden, batch_size=batch)
    assert isinstance(tri.steps_fn, TritonWindow) and ref.steps_fn is fixed_point_steps
    inputs, targets = tiny_batch(tri.cfg)
    with torch.no_grad():
        frees = [r.free_phase(inputs, targets) for r in (tri, ref)]
        compare(tri, ref, False, TOL[dtype])
        for r, free in zip((tri, ref), frees):
            r.nudged_phases(free)
        compare(tri, ref, True, TOL[dtype])
    assert tri.steps_fn.launches == 2  # one launch per phase
    # the readout's pull really acts inside the loop: the +beta and -beta halves end far apart
    assert float((tri.s_plus[-1] - tri.s_minus[-1]).abs().max()) > 1e3 * TOL[dtype]


def stale_nudged_start(r: Relaxation) -> list[torch.Tensor]:
    """What torch's nudged phases copy in or set before they run: the stacked workspace's state, drive, target mask
    and row factors."""
    ws = r.ws_nudged
    return [*ws.state.s, ws.drive, ws.target_mask, ws.beta_col, ws.mask_beta, ws.neg_beta]


@pytest.mark.parametrize("hidden", [[12], [9, 7, 6]])
def test_the_kernels_set_their_phases_up_themselves(hidden):
    """The Triton free phase neither needs its state zeroed nor copies it out (free_phase does both only for torch's
    steps): over a state left at 1 (a previous window's), it ends where the torch window ends from rest and s0 equals
    its last state. The nudged kernel reads s0, the drive and the target mask from the free rows, and forms the rows'
    factors itself: over a stacked workspace left at 1 it gives torch's nudged states, and leaves those buffers be."""
    tri, ref = relaxations(("triton", "torch"), 0, hidden_sizes=hidden, batch_size=8)
    assert tri.kernels_set_up and not ref.kernels_set_up
    inputs, targets = tiny_batch(tri.cfg)
    with torch.no_grad():
        for r in (tri, ref):
            for t in [*r.ws.state.s, *r.s0.s, *stale_nudged_start(r)]:
                t.fill_(1.0)  # stale values: a kernel that read them would move elsewhere
        frees = [r.free_phase(inputs, targets) for r in (tri, ref)]
        compare(tri, ref, False, TOL["float64"])
        for a, b in zip(tri.s0.s, tri.ws.state.s, strict=True):
            assert torch.equal(a, b) and float(a.abs().max()) > 0
        for r, free in zip((tri, ref), frees):
            r.nudged_phases(free)
        compare(tri, ref, True, TOL["float64"])
    ws = tri.ws_nudged
    for t in (ws.drive, ws.target_mask, ws.beta_col):  # neither copied in nor set (set_nudge_scale did not run)
        assert float(t.min()) == float(t.max()) == 1.0


EVEN_ODD = [
    (hidden, memory, dtype) for hidden in ([12], [9, 7], [9, 7, 6]) for memory in (0, 16) for dtype in ("float32",)
]
EVEN_ODD += [([9, 7, 6], 16, "float64"), ([9, 7], 0, "float64")]


@pytest.mark.parametrize(
    "hidden,memory,dtype",
    EVEN_ODD,
    ids=[f"{d}-h{'x'.join(map(str, h))}-{'bank' if m else 'onehot'}" for h, m, d in EVEN_ODD],
)
def test_each_even_odd_phase_equals_the_torch_window(hidden, memory, dtype):
    """--relaxation even_odd: the kernels' odd / q / even halves against even_odd_steps, free and nudged, batch 13."""
    tri, ref = relaxations(
        ("triton", "torch"), 16 if memory else 0, dtype=dtype, hidden_sizes=hidden, batch_size=13, relaxation="even_odd"
    )
    assert isinstance(tri.steps_fn, TritonWindow) and ref.steps_fn is even_odd_steps
    (jac,) = relaxations(("torch",), 16 if memory else 0, dtype=dtype, hidden_sizes=hidden, batch_size=13)
    inputs, targets = tiny_batch(tri.cfg)
    with torch.no_grad():
        frees = [r.free_phase(inputs, targets) for r in (tri, ref, jac)]
        compare(tri, ref, False, TOL[dtype])
        for r, free in zip((tri, ref, jac), frees):
            r.nudged_phases(free)
        compare(tri, ref, True, TOL[dtype])
    assert tri.steps_fn.launches == 2
    # 12 / 8 steps from rest are short of the fixed point, so the orders really differ: the kernels ran even/odd
    assert float((tri.ws.q_hist - jac.ws.q_hist).abs().max()) > 1e3 * TOL[dtype]


@pytest.mark.parametrize("relaxation", ["jacobi", "even_odd"])
def test_chunked_windows_equal_one_window(relaxation):
    """relax() with progress reporting runs a window in chunks (start > 0): the same result as the torch window, from a
    stale state (only the first chunk starts from rest)."""
    tri, ref = relaxations(("triton", "torch"), 0, hidden_sizes=[9, 7], relaxation=relaxation)
    inputs, targets = tiny_batch(tri.cfg)
    for r in (tri, ref):
        r.progress_every, r.on_steps = 5, lambda *_: None
    with torch.no_grad():
        for r in (tri, ref):
            for t in [*r.ws.state.s, *r.s0.s]:
                t.fill_(1.0)
            r.nudged_phases(r.free_phase(inputs, targets))
    compare(tri, ref, False, TOL["float64"])
    compare(tri, ref, True, TOL["float64"])
    assert tri.steps_fn.launches == 3 + 2  # 12 free steps in chunks of 5, 8 nudged steps


class Spy:
    """Stands in for a Triton kernel: records each launch's grid, then launches the real kernel."""

    def __init__(self, kernel) -> None:
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.grids.append(grid)
            return self.kernel[grid](*args, **kwargs)

        return launch


def test_the_triton_backend_really_launches_the_kernels(monkeypatch):
    free_spy, nudged_spy = Spy(free_phase.free_phase_kernel), Spy(nudged_phase.nudged_phase_kernel)
    monkeypatch.setattr(free_phase, "free_phase_kernel", free_spy)
    monkeypatch.setattr(nudged_phase, "nudged_phase_kernel", nudged_spy)
    (tri,) = relaxations(("triton",), 0, batch_size=40)
    assert tri.backend.name == "triton"
    with torch.no_grad():
        ep_gradients(tri, *tiny_batch(tri.cfg))
    assert free_spy.grids == [(3,)] and nudged_spy.grids == [(5,)]  # 40 rows, 80 stacked: blocks of 16


def test_a_training_run_with_triton_matches_torch(tmp_path, small_text):
    """100 windows of EP training (float64) on each backend: the same parameters and held-out loss; summary.json names
    the backend."""
    base = dict(
        hidden_sizes=[10, 8],
        coord_dim_n=4,
        rotor_k=4,
        context_len=3,
        embed_dim=3,
        batch_size=8,
        free_steps=10,
        nudge_steps=6,
        beta_nudge=0.003,
        r_init=4.0,
        proto_init_scale=0.3,
        eta_update=0.01,
        max_windows=100,
        log_every_windows=50,
        eval_every_windows=0,
        eval_batches=1,
        dtype="float64",
        data=str(small_text),
        device="cpu",
    )
    runs = {}
    for backend in ("triton", "torch"):
        flags = {"window_backend": backend, "readout_backend": backend, "checkpoint_dir": str(tmp_path / backend)}
        cfg = build_config([("test", {**base, **flags})])
        trainer = Trainer(cfg, log=lambda *_: None)
        start = trainer.machine.flat.clone()
        summary = trainer.train()
        assert float((trainer.machine.flat - start).abs().max()) > 1e-3  # it really trained
        runs[backend] = trainer, summary
    (tri, tri_summary), (ref, ref_summary) = runs["triton"], runs["torch"]
    assert tri_summary["window_backend"] == "triton" and ref_summary["window_backend"] == "torch"
    assert tri.relaxation.steps_fn.launches == 2 * 100
    assert tri.relaxation.readout_kernel.launches == 100 and ref.relaxation.readout_kernel is None  # readout_grads.py
    # Each window agrees to rounding (1e-16); 100 Adam steps magnify that where a gradient is near zero (Adam divides by
    # its size), to about 1e-6 of the largest parameter here. A wrong window is off by about the learning rate (1e-2).
    assert_near(tri.machine.flat, ref.machine.flat, 1e-5, "parameters after 100 windows")
    assert abs(tri_summary["heldout_loss"] - ref_summary["heldout_loss"]) <= 1e-6 * ref_summary["heldout_loss"]


def test_the_triton_ep_gradient_is_the_exact_gradient():
    """EP through the Triton window estimates autograd's gradient of the loss (cosine >= 0.999 for every parameter)."""
    cfg = tiny_config(hidden_sizes=[9, 7], beta_nudge=1e-3, free_steps=60, nudge_steps=60)
    m = tiny_machine(cfg)
    inputs, targets = tiny_batch(cfg)
    triton = cfg.model_copy(update={"window_backend": "triton", "readout_backend": "triton"})
    tri = Relaxation(m, triton, cfg.batch_size)
    with torch.no_grad():
        ep = ep_gradients(tri, inputs, targets)
        ex = exact_gradients(Relaxation(m, cfg, cfg.batch_size), inputs, targets)
    assert tri.steps_fn.launches == 2 and tri.readout_kernel.launches == 1
    for name, g in ex.grads.items():
        assert cosine(g, ep.grads[name]) > 0.999, name


def test_the_device_check_script_passes_in_the_interpreter(capsys):
    """benchmarks/triton_window_check.py, which a GPU session runs at the presets' shapes, on tiny CPU shapes."""
    from benchmarks import triton_window_check

    code = triton_window_check.main(
        [
            "--device",
            "cpu",
            "--hidden_sizes",
            "12",
            "10",
            "--coord_dim_n",
            "4",
            "--free_steps",
            "6",
            "--nudge_steps",
            "4",
            "--batch_sizes",
            "3",
            "--memory_capacity",
            "8",
            "--batch_size",
            "8",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and "nudged spd" in out and "readout grad protos" in out and "PASS" in out


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (python -m benchmarks.gpu_checks on one)")
def test_the_compiled_kernels_equal_the_torch_window_on_cuda():
    """The real (compiled, not interpreted) kernels at the dev preset's shapes, and their CUDA-graph replay; in a
    subprocess, since this process interprets Triton."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0"}
    deep_bank = ["--hidden_sizes", "128", "64", "32", "--memory_capacity", "256", "--batch_size", "200"]
    for extra in ([], ["--dtype", "float64"], deep_bank):
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.triton_window_check",
            "--preset",
            "dev",
            "--device",
            "cuda",
            "--batch_sizes",
            "1",
            "8",
            "13",
            "64",
            "128",  # the dev preset's batch: two readout programs and their sum
            "200",  # four, the last one ragged
            *extra,
        ]
        proc = subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parent.parent
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_bench_times_the_triton_window_as_a_mode(small_text, monkeypatch):
    """bench's triton modes run the Triton window and its torch modes the torch window (here interpreted: no speed
    and no op count is claimed, the interpreter's numpy copies show up as ops)."""
    from trainer2.running.bench import run as bench

    spy = Spy(free_phase.free_phase_kernel)
    monkeypatch.setattr(free_phase, "free_phase_kernel", spy)
    rows, table = bench(
        [
            "--data",
            str(small_text),
            "--hidden_sizes",
            "8",
            "--free_steps",
            "3",
            "--nudge_steps",
            "2",
            "--device",
            "cpu",
            "--modes",
            "eager",
            "triton",
            "triton+graph",
            "--batch_sizes",
            "4",
            "--windows",
            "2",
        ]
    )
    eager, tri, graph = rows
    assert eager.windows_per_s > 0 and tri.mode == "triton" and tri.windows_per_s > 0 and tri.note == ""
    # the triton mode's 5 warm-up (warmup_steps 3 + 2), 2 timed and 1 profiled windows; none from eager or the
    # phase table
    assert len(spy.grids) == 5 + 2 + 1
    # the window's 2 launches, the EP statistic of its 2 couplings, the observables, the readout's frame, its loss and
    # gradients and its rotor's angles, the fused update's 2, the cap of the one dense coupling between state layers
    # and the window metrics' 2
    assert tri.triton_per_batch == 13 and eager.triton_per_batch == 0
    assert graph.note == "n/a (CUDA graphs need a CUDA device)" and "triton+graph" in table


def test_bench_modes_take_the_readout_by_name_on_the_cpu_and_leave_it_to_auto_on_a_gpu():
    """On a GPU a triton mode's readout is `auto` (the loss kernel, and the frame kernel while AUTO_TAKES_TRITON_FRAME
    is on); the torch modes keep it in torch; a readout the config names is kept (gpu_checks' readout and frame
    rows)."""
    from trainer2.running.bench import mode_readout

    assert mode_readout("auto", "triton", True) == "auto" and mode_readout("auto", "triton", False) == "triton"
    assert mode_readout("auto", "torch", True) == "torch" and mode_readout("auto", "torch", False) == "torch"
    assert mode_readout("triton", "triton", True) == "triton" and mode_readout("torch", "triton", True) == "torch"


def test_a_tensor_in_another_layout_is_refused_not_misread():
    (tri,) = relaxations(("triton",), 0)
    inputs, targets = tiny_batch(tri.cfg)
    with torch.no_grad():
        free = tri.free_phase(inputs, targets)
        tri.ws.state.s[0] = tri.ws.state.s[0].T.contiguous().T  # the same values, column-major
        with pytest.raises(ValueError, match="not contiguous"):
            tri.run(tri.ws, free, 0, 3, False)


def test_wide_layers_beyond_what_auto_takes_still_match():
    """300 hidden units and 33 coordinates: tiles padded to 512 and 64, and 8 warps (what triton runs when asked)."""
    tri, ref = relaxations(("triton", "torch"), 0, dtype="float32", hidden_sizes=[300], coord_dim_n=33, batch_size=5)
    inputs, targets = tiny_batch(tri.cfg)
    with torch.no_grad():
        frees = [r.free_phase(inputs, targets) for r in (tri, ref)]
        compare(tri, ref, False, TOL["float32"])
        for r, free in zip((tri, ref), frees):
            r.nudged_phases(free)
        compare(tri, ref, True, TOL["float32"])
