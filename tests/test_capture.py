"""StepRunner: eager, graph, compile and compile+graph run the same step; fallbacks say so once.

CUDA tests are skipped without a GPU; `python -m benchmarks.gpu_checks` runs them with the benchmark.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
from tiny import tiny_config, tiny_machine
from torch.utils._python_dispatch import TorchDispatchMode

from trainer2.learning.gradients import GradientSource, ep_gradients
from trainer2.learning.step import BatchStep, build_step
from trainer2.physics.machine import move_machine
from trainer2.physics.memory import MemoryBank
from trainer2.running.step_runner import (
    KERNEL_FIELDS,
    StaticBatch,
    StepKernels,
    StepRunner,
    kernels_for_mode,
    step_tensors,
)
from trainer2.running.trainer import Trainer
from trainer2.section import ConfigError

CUDA = torch.cuda.is_available()


def needs_cuda(test):
    """Skipped without a GPU, and marked `cuda`: `pytest -m cuda` (benchmarks/gpu_checks.py) runs these there."""
    return pytest.mark.cuda(
        pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (python -m benchmarks.gpu_checks)")(test)
    )


def rerun_without_the_interpreter(test: str) -> bool:
    """On CUDA, inductor's kernels are Triton kernels, which this process (TRITON_INTERPRET=1, tests/conftest.py)
    would interpret on host copies: run `test` of this file in a child with the interpreter off, assert it passed,
    and say so (True); False in that child, which then runs the test itself."""
    if not CUDA or os.environ.get("TRITON_INTERPRET") == "0":
        return False
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:logging", f"{__file__}::{test}"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(cmd, env={**os.environ, "TRITON_INTERPRET": "0"}, capture_output=True, text=True, cwd=root)
    assert proc.returncode == 0 and re.search(r"^1 passed", proc.stdout, re.M), (
        proc.stdout[-6000:] + proc.stderr[-3000:]
    )
    return True


V = 7
SHORT = {"free_steps": 2, "nudge_steps": 1}  # compile time grows with the unrolled steps


def fresh_step(device: str = "cpu", gradients: GradientSource = ep_gradients, **overrides) -> BatchStep:
    """A batch step with a memory bank and a weight average, so the step also writes memory and moves the average;
    identical for identical arguments."""
    base = {"free_steps": 6, "nudge_steps": 3, "beta_nudge": 0.05, "memory_capacity": 12, "ema_decay": 0.9}
    cfg = tiny_config(**{**base, **overrides})
    m = move_machine(tiny_machine(cfg, V), torch.device(device))
    mem = MemoryBank.allocate(cfg.memory_capacity, cfg.coord_dim_n, cfg.batch_size, m.readout.protos)
    return build_step(m, cfg, cfg, cfg.batch_size, mem, gradients)


def batches(cfg, n: int, seed: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, V, (cfg.batch_size, cfg.context_len), generator=gen),
            torch.randint(0, V, (cfg.batch_size,), generator=gen),
        )
        for _ in range(n)
    ]


def run(step, batch_step: BatchStep, data, device: str = "cpu", first: int = 0) -> None:
    """Steps over `data` (batches first, first + 1, ...), changing the learning rate between them as a schedule does."""
    with torch.no_grad():
        for i, (x, y) in enumerate(data, start=first):
            batch_step.updater.state.lr.fill_(0.05 / (i + 1))
            step(x.to(device), y.to(device))


def assert_same_state(a: BatchStep, b: BatchStep, rtol: float = 0.0, atol: float = 0.0) -> None:
    ta, tb = step_tensors(a), step_tensors(b)
    assert len(ta) == len(tb)
    for x, y in zip(ta, tb):
        if rtol == 0.0 and atol == 0.0:
            assert torch.equal(x, y)
        else:
            torch.testing.assert_close(x, y, rtol=rtol, atol=atol)


class Spy(TorchDispatchMode):
    """Records every aten op that runs."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


# --- CPU: what makes the step capturable, and the fallbacks ---


@pytest.mark.parametrize("relaxation", ["jacobi", "even_odd"])
def test_step_reads_nothing_back_and_draws_no_random_numbers(relaxation):
    """A captured step may not sync with the host or use the RNG; on CPU this shows as dispatched ops."""
    step = fresh_step(relaxation=relaxation, **SHORT)
    x, y = batches(step.relax.cfg, 1)[0]
    with torch.no_grad(), Spy() as spy:
        step.step(x, y)
    assert "index_copy_" in spy.ops  # the memory write is inside the step the graph captures
    banned = {
        "_local_scalar_dense",
        "item",
        "nonzero",
        "is_nonzero",
        "equal",
        "_assert_async",
        "rand",
        "randn",
        "randint",
        "bernoulli",
        "normal",
        "uniform",
        "multinomial",
        "randperm",
        "exponential",
    }
    assert not spy.ops & banned, spy.ops & banned


def test_step_tensors_cover_everything_the_step_updates():
    step = fresh_step()
    found = step_tensors(step)
    storages = {t.untyped_storage().data_ptr() for t in found}
    relax, upd = step.relax, step.updater
    must = [
        *relax.m.named_params().values(),
        *upd.tensors().values(),
        *step.memory.tensors().values(),
        *step.average.tensors().values(),
        *relax.ws.state.s,
        *relax.s0.p,
        relax.ws.readout.pi,
        upd.grad,
    ]
    assert all(t.untyped_storage().data_ptr() in storages for t in must)  # the parameters are views of one flat buffer
    assert len({id(t) for t in found}) == len(found)


@pytest.mark.skipif(CUDA, reason="checks the fallback on a machine without CUDA")
@pytest.mark.parametrize("relaxation", ["jacobi", "even_odd"])
def test_graph_mode_without_cuda_warns_once_and_equals_eager_bitwise(relaxation):
    eager, graphed = fresh_step(relaxation=relaxation), fresh_step(relaxation=relaxation)
    data = batches(eager.relax.cfg, 5)
    logs: list[str] = []
    runner = StepRunner(graphed, graphs=True, warmup_steps=2, log=logs.append)
    run(eager.step, eager, data)
    run(runner.step, graphed, data)
    assert len(logs) == 1 and "--use_cudagraphs needs a CUDA device" in logs[0] and "eagerly" in logs[0]
    assert runner.mode == "eager" and runner.graph is None
    assert_same_state(eager, graphed)


def test_failed_compile_says_so_once_and_runs_eagerly():
    def broken_backend(gm, example_inputs):
        raise RuntimeError("no C++ compiler found")

    eager, compiled = fresh_step(**SHORT), fresh_step(**SHORT)
    data = batches(eager.relax.cfg, 3)
    logs: list[str] = []
    runner = StepRunner(compiled, compile=True, compile_backend=broken_backend, log=logs.append)
    run(eager.step, eager, data)
    run(runner.step, compiled, data)
    assert len(logs) == 1 and "torch.compile of the batch step failed" in logs[0] and "no C++ compiler found" in logs[0]
    assert runner.mode == "eager"
    assert_same_state(eager, compiled)


@pytest.mark.parametrize("relaxation", ["jacobi", "even_odd"])
def test_compiled_step_equals_eager(relaxation):
    """Dynamo traces the whole step as one graph (fullgraph) with its in-place updates; aot_eager keeps it fast on
    CPU."""
    eager, compiled = (fresh_step(dtype="float32", relaxation=relaxation, **SHORT) for _ in range(2))
    data = batches(eager.relax.cfg, 3)
    logs: list[str] = []
    runner = StepRunner(compiled, compile=True, compile_backend="aot_eager", log=logs.append)
    run(eager.step, eager, data)
    run(runner.step, compiled, data)
    assert logs == [] and runner.mode == "compile"
    assert_same_state(eager, compiled, rtol=1e-5, atol=1e-6)


def test_a_compiled_step_keeps_the_counts_it_adds_to():
    """Adam's update count and the memory bank's write pointer advance under torch.compile as they do eagerly: AOT
    (torch 2.13) drops the in-place update of a 0-dim CPU tensor, so both are (1,) tensors; before, a compiled run's
    count stayed 0 (Adam's bias correction frozen at its first step) and its bank wrote the same slots
    forever."""
    eager, compiled = (fresh_step(update_rule="adam", **SHORT) for _ in range(2))
    data = batches(eager.relax.cfg, 3)
    runner = StepRunner(compiled, compile=True, compile_backend="aot_eager")
    run(eager.step, eager, data)
    run(runner.step, compiled, data)
    assert runner.mode == "compile"
    for step in (eager, compiled):
        assert float(step.updater.state.count) == 3.0
        assert int(step.memory.ptr) == (3 * step.relax.cfg.batch_size) % step.relax.cfg.memory_capacity
    assert_same_state(eager, compiled, rtol=1e-7, atol=1e-10)  # float64; the frozen count was off by 1e-3


@pytest.mark.cuda
@pytest.mark.skipif(
    not CUDA and not os.environ.get("TRAINER2_SLOW_TESTS"),
    reason="inductor spends minutes compiling C++ kernels on CPU; set TRAINER2_SLOW_TESTS=1 to run",
)
def test_inductor_compiled_step_equals_eager_or_falls_back_with_its_message():
    """In float64: in float32, fused kernels sum in another order, and Adam turns that rounding into visible steps
    wherever a gradient is mathematically near zero (1e-4 relative seen on an H100), which says nothing of the math.
    On CUDA it must compile (Triton is there); on the CPU a missing C++ toolchain may fall back."""
    if rerun_without_the_interpreter("test_inductor_compiled_step_equals_eager_or_falls_back_with_its_message"):
        return
    device = "cuda" if CUDA else "cpu"
    eager, compiled = fresh_step(device, dtype="float64"), fresh_step(device, dtype="float64")
    data = batches(eager.relax.cfg, 3)
    logs: list[str] = []
    runner = StepRunner(compiled, compile=True, log=logs.append)
    run(eager.step, eager, data, device)
    run(runner.step, compiled, data, device)
    if logs and not CUDA:  # no toolchain: the fallback must say so and change nothing
        assert len(logs) == 1 and "torch.compile of the batch step failed" in logs[0] and runner.mode == "eager"
    else:
        assert logs == [] and runner.mode == "compile"
    assert_same_state(eager, compiled, rtol=1e-9, atol=1e-12)


def test_static_batch_refuses_a_batch_of_another_shape():
    x, y = torch.zeros(4, 3, dtype=torch.long), torch.zeros(4, dtype=torch.long)
    sb = StaticBatch.allocate(x, y, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"batch of shape \(3, 3\).*static buffers \(4, 3\)"):
        sb.load(x[:3], y[:3])


def test_trainer_runs_the_step_through_the_runner(small_text, tmp_path):
    """Graph flags on a CPU machine: one warning, and the same run as without them."""

    def train(**flags) -> tuple[Trainer, list[str]]:
        logs: list[str] = []
        cfg = tiny_config(
            data=str(small_text),
            dtype="float32",
            batch_size=8,
            max_windows=3,
            free_steps=5,
            nudge_steps=3,
            beta_nudge=0.05,
            eval_batches=1,
            log_every_windows=3,
            checkpoint_dir=str(tmp_path),
            device="cpu",
            **flags,
        )
        t = Trainer(cfg, log=logs.append)
        t.train()
        return t, [line for line in logs if "warning" in line]

    plain, plain_warn = train()
    graphed, graph_warn = train(use_cudagraphs=True, static_shapes=True, capture_batch_size=8)
    assert plain_warn == [] and plain.runner.mode == "eager"
    assert len(graph_warn) == 1 and "needs a CUDA device" in graph_warn[0]
    assert_same_state(plain.batch_step, graphed.batch_step)
    assert graphed.runner.steps == 3


def test_compile_with_graphs_on_cuda_takes_torch_for_auto_and_refuses_triton():
    """Compile + graphs (own or reduce-overhead's) on CUDA: auto takes torch, triton is refused by name, nothing else
    changes; without compile, without graphs, or off CUDA, the config is as given (64c1620's capture failures)."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    graphs = {"use_cudagraphs": True, "static_shapes": True, "capture_batch_size": 5}
    both = tiny_config(use_torch_compile=True, **graphs)
    assert [getattr(both, k) for k in KERNEL_FIELDS] == ["auto"] * 3
    fixed, note = kernels_for_mode(both, cuda)
    assert [getattr(fixed, k) for k in KERNEL_FIELDS] == ["torch"] * 3
    assert note is not None and all(k in note for k in KERNEL_FIELDS)
    assert fixed.model_copy(update=dict.fromkeys(KERNEL_FIELDS, "auto")) == both
    one = both.model_copy(update={"readout_backend": "torch"})
    fixed, note = kernels_for_mode(one, cuda)
    assert fixed.readout_backend == "torch" and fixed.window_backend == "torch" and "readout" not in note
    trees = tiny_config(use_torch_compile=True, compile_mode="reduce-overhead")  # torch.compile records the graphs
    assert kernels_for_mode(trees, cuda).cfg.window_backend == "torch"
    alone = (tiny_config(**graphs), cuda), (tiny_config(use_torch_compile=True), cuda), (both, cpu), (trees, cpu)
    for cfg, device in alone:
        assert kernels_for_mode(cfg, device) == (cfg, None)
    for name in KERNEL_FIELDS:
        with pytest.raises(ConfigError, match=f"^{name}: triton cannot run inside a torch.compile'd step"):
            kernels_for_mode(both.model_copy(update={name: "triton"}), cuda)


def test_the_trainer_builds_its_step_from_the_backends_its_mode_can_run(small_text, tmp_path, monkeypatch):
    """The Trainer builds its step (window, readout, update) from kernels_for_mode's config, keeps the user's config
    (checkpoints carry `auto`), scores with the user's backends, and logs the note after the run's header."""
    import trainer2.running.trainer as trainer_module

    def all_torch(cfg, device):
        return StepKernels(cfg.model_copy(update=dict.fromkeys(KERNEL_FIELDS, "torch")), "note: torch")

    monkeypatch.setattr(trainer_module, "kernels_for_mode", all_torch)
    logs: list[str] = []
    cfg = tiny_config(
        data=str(small_text), dtype="float32", batch_size=8, max_windows=1, checkpoint_dir=str(tmp_path), device="cpu"
    )
    t = Trainer(cfg, log=logs.append)
    assert [getattr(t.cfg, k) for k in KERNEL_FIELDS] == ["auto"] * 3
    reasons = t.relaxation.backend.reason, t.relaxation.readout_backend.reason, t.updater.backend.reason
    assert reasons == ("--window_backend torch", "--readout_backend torch", "--update_backend torch")
    assert t.scoring(8).backend.reason.startswith("auto")
    t.train()
    header = next(i for i, line in enumerate(logs) if "update backend: torch" in line)
    assert logs[header + 1] == "note: torch"


def test_bench_times_every_mode_in_one_run(small_text):
    from trainer2.running.bench import run as bench

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
            "graph",
            "--batch_sizes",
            "4",
            "--windows",
            "2",
        ]
    )
    eager, graph = rows
    assert (eager.batch, eager.mode) == (4, "eager") and eager.windows_per_s > 0
    assert eager.kernels_per_step > 10  # forces, leapfrog and observables are a dozen ops or more per step, eagerly
    if not CUDA:
        assert graph.windows_per_s is None and graph.note == "n/a (CUDA graphs need a CUDA device)"
    assert "3 free + 2x2 nudged = 7 relaxation steps (jacobi order)" in table and "n/a" in table and "1.00x" in table
    # 3 free / 2 nudged steps from rest are far from settled: both residuals are reported, well above the floor
    line = next(x for x in table.splitlines() if x.startswith("residual at the last step"))
    free, nudged = (float(x.split("x")[0]) for x in (line.split("free ")[1], line.split("nudged ")[1]))
    assert free > 1.1 and nudged > 1.1, line


# --- CUDA (skipped without a GPU) ---


@needs_cuda
@pytest.mark.parametrize("relaxation", ["jacobi", "even_odd"])
def test_graph_replay_equals_eager_on_cuda(relaxation):
    """Warm-up, capture, replays fed from host (pinned) batches, lr changing between them; then a recapture. Bitwise:
    a replay launches the kernels the eager step launched (seen on an H100: equal after 200 windows)."""
    eager, graphed = (fresh_step("cuda", dtype="float32", relaxation=relaxation) for _ in range(2))
    data = batches(eager.relax.cfg, 10)
    logs: list[str] = []
    runner = StepRunner(graphed, graphs=True, warmup_steps=2, log=logs.append)
    run(eager.step, eager, [(x.cuda(), y.cuda()) for x, y in data], "cuda")
    run(runner.step, graphed, data[:6])  # host tensors: staged through pinned memory
    first = runner.graph
    runner.invalidate()
    run(runner.step, graphed, data[6:], first=6)
    torch.cuda.synchronize()
    assert logs == [] and runner.mode == "graph" and first is not None and runner.graph not in (None, first)
    assert_same_state(eager, graphed)


@needs_cuda
@pytest.mark.parametrize("relaxation", ["jacobi", "even_odd"])
def test_replay_does_not_sync_with_the_host(relaxation):
    step = fresh_step("cuda", dtype="float32", relaxation=relaxation)
    data = [(x.cuda(), y.cuda()) for x, y in batches(step.relax.cfg, 6)]
    runner = StepRunner(step, graphs=True, warmup_steps=2)
    with torch.no_grad():
        for x, y in data[:3]:
            runner.step(x, y)
        assert runner.graph is not None
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for x, y in data[3:]:
                step.updater.state.lr.fill_(0.01)
                runner.step(x, y)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.isfinite(step.updater.metrics.values).all()


@needs_cuda
def test_failed_capture_says_so_once_and_runs_eagerly():
    def syncing_gradients(relax, x, y):
        float(x.sum())  # a host sync: fine eagerly, illegal while capturing
        return ep_gradients(relax, x, y)

    eager, graphed = fresh_step("cuda", dtype="float32"), fresh_step("cuda", syncing_gradients, dtype="float32")
    data = [(x.cuda(), y.cuda()) for x, y in batches(eager.relax.cfg, 5)]
    logs: list[str] = []
    runner = StepRunner(graphed, graphs=True, warmup_steps=1, log=logs.append)
    run(eager.step, eager, data, "cuda")
    run(runner.step, graphed, data, "cuda")
    torch.cuda.synchronize()
    assert len(logs) == 1 and "CUDA graph capture of the batch step failed" in logs[0]
    assert runner.mode == "eager" and runner.graph is None
    assert_same_state(eager, graphed, rtol=1e-5, atol=1e-6)


@needs_cuda
def test_a_run_with_compile_and_graphs_on_cuda_captures_its_step(small_text, tmp_path):
    """A user's run with both flags and the backends left to auto: its compiled step is captured (no fallback warning)
    and the note says which backends were set to torch. In a child without the interpreter, as above."""
    if rerun_without_the_interpreter("test_a_run_with_compile_and_graphs_on_cuda_captures_its_step"):
        return
    logs: list[str] = []
    graphs = {"use_torch_compile": True, "use_cudagraphs": True, "static_shapes": True, "capture_batch_size": 8}
    cfg = tiny_config(
        data=str(small_text), dtype="float32", batch_size=8, max_windows=6, free_steps=3, nudge_steps=2,
        checkpoint_dir=str(tmp_path), device="cuda", **graphs,
    )  # fmt: skip
    t = Trainer(cfg, log=logs.append)
    t.train()
    assert t.runner.mode == "compile+graph" and t.runner.graph is not None
    assert [line for line in logs if "warning" in line] == []
    assert any(line.startswith("torch.compile with CUDA graphs: window_backend") for line in logs)


@needs_cuda
def test_compiled_step_captured_as_a_graph_equals_eager_on_cuda():
    """In float64, for the reason the inductor test gives; torch's window, update and readout, as a run under compile
    and graphs takes them (kernels_for_mode: a Triton kernel inside the compiled step fails capture). Inductor's CUDA
    kernels are Triton kernels, which this process (TRITON_INTERPRET=1, tests/conftest.py) would interpret on host
    copies: so the test runs itself again in a child with it off."""
    if rerun_without_the_interpreter("test_compiled_step_captured_as_a_graph_equals_eager_on_cuda"):
        return
    pinned = {"window_backend": "torch", "update_backend": "torch", "readout_backend": "torch"}
    eager, both = fresh_step("cuda", dtype="float64", **pinned), fresh_step("cuda", dtype="float64", **pinned)
    data = [(x.cuda(), y.cuda()) for x, y in batches(eager.relax.cfg, 6)]
    logs: list[str] = []
    runner = StepRunner(both, graphs=True, compile=True, warmup_steps=2, log=logs.append)
    run(eager.step, eager, data, "cuda")
    run(runner.step, both, data, "cuda")
    torch.cuda.synchronize()
    assert logs == [] and runner.mode == "compile+graph" and runner.graph is not None
    assert_same_state(eager, both, rtol=1e-9, atol=1e-12)
