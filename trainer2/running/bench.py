"""Speed benchmark: eager vs CUDA graph vs torch.compile vs compile+graph (torch window and update), and the Triton
kernels (one launch per relaxation phase, the readout's loss (and its frame where asked for: `mode_readout`), the
fused update and the weight average) eager, in a graph, and compiled in a graph, in one run, on one config.

    python main.py bench [--preset NAME] [--FIELD VALUE ...] [--batch_sizes 8 64] [--modes ...] [--windows 20]

For each batch size and mode it builds a fresh machine (same seed) and runs warm-up windows (compile,
graph capture and one replay included; not timed); then it times `--windows` batch steps per mode in
interleaved rounds, so a drifting load hits every mode alike (CUDA events on a GPU, perf_counter on
CPU). It prints windows/s, examples/s, the ratio to eager, kernels (ops on CPU) and launch calls per relaxation step
and per batch step from torch.profiler over one batch step, and the Triton launches the step's code makes.
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from dataclasses import dataclass

import torch
import torch._dynamo
import torch._inductor.config
from torch._dynamo.utils import counters
from torch.profiler import ProfilerActivity, profile

from trainer2.data.dataset import Dataset
from trainer2.data.load import DataConfig, load_data
from trainer2.data.sampler import Sampler
from trainer2.flags import add_config_flags, resolve_config
from trainer2.io.parser import Parser
from trainer2.learning.rules.rule import rule_scheme
from trainer2.learning.step import BatchStep, build_step
from trainer2.learning.update import UpdateConfig
from trainer2.monitor.profiling import PhaseTimer, drop_kineto_markers
from trainer2.physics.relaxation import DynamicsConfig
from trainer2.running.parts import build_parts, resolve_device
from trainer2.running.step_runner import StepRunner
from trainer2.train_config import ConfigError, TrainConfig

MODES = (
    "eager",
    "graph",
    "compile",
    "compile+graph",
    "reduce-overhead",
    "triton",
    "triton+graph",
    "triton+compile+graph",
)
# Top-level CPU ops that launch no kernel: views and allocations.
NO_KERNEL = {
    "aten::" + n
    for n in (
        "numpy_T",
        "t",
        "transpose",
        "view",
        "reshape",
        "expand",
        "slice",
        "select",
        "unsqueeze",
        "squeeze",
        "squeeze_",
        "permute",
        "as_strided",
        "unbind",
        "flatten",
        "detach",
        "alias",
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "mT",
        "lift_fresh",
        "resolve_conj",
        "resolve_neg",
        "to",
    )
}


@dataclass
class Row:
    """One measured (batch, mode), or why it could not run."""

    batch: int
    mode: str
    windows_per_s: float | None = None
    kernels_per_step: float | None = None
    launches_per_step: float | None = None
    kernels_per_batch: int | None = None  # kernels (ops on CPU) of one whole batch step
    triton_per_batch: int = 0  # Triton launches one batch step's code makes (every kernel's counter added)
    setup_s: float = 0.0
    note: str = ""


def relax_steps(cfg: TrainConfig) -> int:
    """Relaxation steps in one batch step: the free window and the rule's nudged windows (recurrent backprop: its
    adjoint sweeps)."""
    return cfg.free_steps + max(1, rule_scheme(cfg.rule, cfg).phases) * cfg.nudge_steps


def phases_text(cfg: TrainConfig) -> str:
    """The second part of a window, e.g. "2x6 nudged" (centred EP), "6 nudged", "6 adjoint" (recurrent backprop)."""
    scheme = rule_scheme(cfg.rule, cfg)
    if scheme.kind == "adjoint":
        return f"{cfg.nudge_steps} adjoint"
    return f"{'2x' if scheme.phases == 2 else ''}{cfg.nudge_steps} {'clamped' if scheme.clamp else 'nudged'}"


def stacking_text(cfg: TrainConfig) -> str:
    phases = rule_scheme(cfg.rule, cfg).phases
    names = {0: "no nudged phase", 1: "one nudged phase", 2: "both nudged phases stacked in one batch"}
    return names.get(phases, f"{phases} nudged phases stacked in one batch")


def kernel_ops(events: list) -> list:
    """The CPU profile's kernel-running operators: aten ops that are not views (and inductor C++ kernels), each
    counted once, not inside another counted one."""

    def counted(e) -> bool:
        return (e.name.startswith("aten::") and e.name not in NO_KERNEL) or "cpp_fused" in e.name

    def has_counted_parent(e) -> bool:
        p = e.cpu_parent
        while p is not None:
            if counted(p):
                return True
            p = p.cpu_parent
        return False

    return [e for e in events if counted(e) and not has_counted_parent(e)]


def count_work(prof: profile, cuda: bool) -> tuple[int, int]:
    """(device kernels, host launch calls) on CUDA; (kernel-running top-level ops incl. inductor C++ kernels, same)
    on CPU."""
    events = prof.events()
    if cuda:
        kernels = sum(1 for e in events if e.device_type.name == "CUDA" and not e.name.startswith(("Memcpy", "Memset")))
        launches = sum(
            1 for e in events if e.device_type.name == "CPU" and ("LaunchKernel" in e.name or "GraphLaunch" in e.name)
        )
        return kernels, launches
    ops = len(kernel_ops(events))
    return ops, ops


def profile_call(fn, cuda: bool) -> tuple[int, int]:
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with drop_kineto_markers(), profile(activities=acts) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    return count_work(prof, cuda)


def host_batches(data: Dataset, batch: int, n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    sampler = Sampler(data.num_examples("train"), batch, seed)
    return [data.batch("train", sampler.next()) for _ in range(n)]


def triton_launches(step: BatchStep) -> int:
    """Triton launches the step's window, EP statistic, observables, readout (and its rotor's angle gradient), update,
    metrics and weight average have made so far (their counters; 0 for the torch backends)."""
    relax, average, updater = step.relax, step.average, step.updater
    kernels = [relax.steps_fn, relax.ep_statistic, relax.stats_kernel, relax.readout_kernel, relax.frame_kernel]
    kernels += [getattr(relax.readout_kernel, "rotor", None), updater.fused]
    kernels += [*updater.caps, updater.metrics_kernel]
    kernels += [average.kernel] if average is not None else []
    return sum(getattr(k, "launches", 0) for k in kernels if k is not None)


def make_step(cfg: TrainConfig, data: Dataset, batch: int, device: torch.device) -> BatchStep:
    """A fresh machine (same seed every time) and its batch step (the config's rule) for `batch` examples."""
    parts = build_parts(cfg, device, data, batch)
    dynamics, update = cfg.section(DynamicsConfig), cfg.section(UpdateConfig)
    return build_step(parts.machine, dynamics, update, batch, parts.memory, rule=cfg.rule)


def mode_readout(requested: str, backend: str, cuda: bool) -> str:
    """The readout backend of a mode whose window and update run on `backend`: the config's torch or triton as given
    (gpu_checks' rows with and without the readout's kernels), else the mode's. A triton mode on a GPU leaves it to
    `auto` (the loss kernel, and the frame kernel while AUTO_TAKES_TRITON_FRAME is on), as a run does; on the CPU,
    where `auto` takes no kernel, it asks for both by name."""
    keep = requested != "auto" or (backend == "triton" and cuda)
    return requested if keep else backend


def prepare(
    cfg: TrainConfig, data: Dataset, device: torch.device, batch: int, mode: str, warmup: list
) -> tuple[Row, StepRunner | None]:
    """A fresh machine (same seed for every mode) and its runner, warmed up (compile and capture included); or why
    not."""
    cuda = device.type == "cuda"
    # A triton mode is its torch mode with the Triton window, readout (its loss and, asked for by name, its frame) and
    # fused update; the torch modes pin the torch window and update (auto may pick triton).
    base = "eager" if mode == "triton" else mode.removeprefix("triton+")
    backend = "triton" if mode.startswith("triton") else "torch"
    readout = mode_readout(cfg.readout_backend, backend, cuda)
    cfg = cfg.model_copy(update={"window_backend": backend, "update_backend": backend, "readout_backend": readout})
    graphs, compiled = base in ("graph", "compile+graph", "reduce-overhead"), base not in ("eager", "graph")
    if graphs and not cuda:
        return Row(batch, mode, note="n/a (CUDA graphs need a CUDA device)"), None
    counters.clear()
    try:
        step = make_step(cfg, data, batch, device)
    except ConfigError as e:  # the Triton window cannot run here: say why in the row
        if not (str(e).startswith("readout_backend") and readout == "triton" and backend == "triton"):
            return Row(batch, mode, note=f"n/a ({e})"), None
        cfg = cfg.model_copy(update={"readout_backend": "torch"})  # the mode's readout kernel cannot run: torch's
        try:
            step = make_step(cfg, data, batch, device)
        except ConfigError as e2:
            return Row(batch, mode, note=f"n/a ({e2})"), None
    logs: list[str] = []
    runner = StepRunner(
        step,
        graphs=graphs,
        compile=compiled,
        warmup_steps=cfg.warmup_steps,
        compile_mode="reduce-overhead" if mode == "reduce-overhead" else cfg.compile_mode,
        log=logs.append,
    )
    start = time.perf_counter()
    before = triton_launches(step)
    runner.step(*warmup[0])  # runs (compiled: traces) the step's code, so its Triton launches are counted once
    launched = triton_launches(step) - before
    for x, y in warmup[1:]:
        runner.step(x, y)
    if cuda:
        torch.cuda.synchronize(device)
    row = Row(batch, mode, setup_s=time.perf_counter() - start, triton_per_batch=launched)
    if runner.mode != ("compile+graph" if base == "reduce-overhead" else base):
        row.note = f"n/a ({logs[-1] if logs else 'ran as ' + runner.mode})"
    elif counters["inductor"]["cudagraph_skips"]:
        row.note = "n/a (torch.compile skipped its CUDA graphs; rerun with TORCH_LOGS=perf_hints to see why)"
    return row, None if row.note else runner


def time_windows(runner: StepRunner, feed: list, cuda: bool) -> float:
    """Seconds for one batch step per batch in `feed`: CUDA events on a GPU, perf_counter on CPU."""
    if not cuda:
        t0 = time.perf_counter()
        for x, y in feed:
            runner.step(x, y)
        return time.perf_counter() - t0
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for x, y in feed:
        runner.step(x, y)
    t1.record()
    t1.synchronize()
    return t0.elapsed_time(t1) / 1e3


@torch.no_grad()
def measure(
    cfg: TrainConfig,
    data: Dataset,
    device: torch.device,
    batch: int,
    modes: list[str],
    windows: int,
    warmup: int,
    rounds: int,
) -> list[Row]:
    """Warm every mode up (untimed), then time them in interleaved rounds, so load drift hits all modes alike;
    then profile one more batch step per mode."""
    cuda = device.type == "cuda"
    torch._inductor.config.cpp.enable_kernel_profile = not cuda  # C++ kernels show in the CPU profile
    feed = host_batches(data, batch, warmup + windows + 1, cfg.seed)
    prepared = [prepare(cfg, data, device, batch, m, feed[:warmup]) for m in modes]
    live = [(row, runner) for row, runner in prepared if runner is not None]
    seconds = {id(row): 0.0 for row, _ in live}
    timed = feed[warmup : warmup + windows]
    per_round = -(-len(timed) // rounds)
    for r in range(0, len(timed), per_round):
        for row, runner in live:
            seconds[id(row)] += time_windows(runner, timed[r : r + per_round], cuda)
    steps = relax_steps(cfg)
    for row, runner in live:
        kernels, launches = profile_call(lambda: runner.step(*feed[-1]), cuda)
        row.windows_per_s, row.kernels_per_step, row.launches_per_step, row.kernels_per_batch = (
            windows / seconds[id(row)],
            kernels / steps,
            launches / steps,
            kernels,
        )
    return [row for row, _ in prepared]


@dataclass
class WindowCost:
    """Eager cost of one batch step, by part: kernels (ops on CPU) per relaxation step in the free and the
    nudged window (the nudged window relaxes every nudged phase at once), and milliseconds per phase; and each
    phase's convergence residual, its spd at the last step relative to the floor sqrt(eps), in the last window."""

    free_ops: float
    nudged_ops: float
    phase_ms: dict[str, float]
    free_residual: float
    nudged_residual: float


@torch.no_grad()
def window_only(cfg: TrainConfig, data: Dataset, device: torch.device, batch: int, windows: int) -> WindowCost:
    """Profile one free and one nudged window of an eager step, then time `windows` eager steps by phase (the torch
    window: its operator count is what this table is for; a triton mode's row counts the Triton window's kernels)."""
    pinned = {"window_backend": "torch", "update_backend": "torch", "readout_backend": "torch"}
    torch_cfg = cfg.model_copy(update=pinned)
    step = make_step(torch_cfg, data, batch, device)
    relax = step.relax
    feed = [(x.to(device), y.to(device)) for x, y in host_batches(data, batch, windows + 2, cfg.seed)]
    free = relax.free_phase(*feed[0])
    nudged = relax.ws_nudged is not None  # recurrent backprop has no nudged phase
    if nudged:
        relax.nudged_phases(free)  # fills the nudged workspace once, as a step does
    cuda = device.type == "cuda"
    k_free, _ = profile_call(lambda: relax.run(relax.ws, free, 0, cfg.free_steps, False), cuda)
    k_nudged = (
        profile_call(lambda: relax.run(relax.ws_nudged, free, 0, cfg.nudge_steps, True), cuda)[0] if nudged else 0
    )
    runner = StepRunner(step)  # eager, as the trainer runs it (in inference mode)
    runner.step(*feed[1])  # warm-up
    timer = PhaseTimer(device, timing=True)
    relax.phase = timer.phase
    for x, y in feed[2:]:
        runner.step(x, y)
    times = timer.collect(windows)
    floor = math.sqrt(cfg.eps)
    free_res, nudged_res = (
        float(ws.spd_rows[-1].mean()) / floor if ws is not None else math.nan for ws in (relax.ws, relax.ws_nudged)
    )
    return WindowCost(
        k_free / cfg.free_steps,
        k_nudged / cfg.nudge_steps,
        {k.removeprefix("time_").removesuffix("_ms"): v for k, v in times.items()},
        free_res,
        nudged_res,
    )


def fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def report(
    rows: list[Row],
    cfg: TrainConfig,
    device: torch.device,
    argv: list[str],
    windows: int,
    warmup: int,
    cost: WindowCost,
) -> str:
    cuda = device.type == "cuda"
    name = (
        torch.cuda.get_device_name(device)
        if cuda
        else f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    )
    unit = "kernels" if cuda else "ops"
    lines = [
        f"trainer2 bench: {name}, torch {torch.__version__}, {cfg.dtype}",
        f"command: python main.py bench {' '.join(argv)}".rstrip(),
        f"machine: layers {cfg.layers}, n {cfg.coord_dim_n}, context {cfg.context_len}x{cfg.embed_dim}, "
        f"memory {cfg.memory_capacity}; "
        f"window: {cfg.free_steps} free + {phases_text(cfg)} = "
        f"{relax_steps(cfg)} relaxation steps ({cfg.relaxation} order); rule {cfg.rule}, cost {cfg.cost}",
        f"timed: {windows} windows per mode in interleaved rounds, after {warmup} warm-up windows "
        f"(excluded; setup_s = warm-up incl. compile/capture); {'CUDA events' if cuda else 'perf_counter'}",
        "",
        f"{'batch':>5}  {'mode':<20} {'windows/s':>10} {'examples/s':>11} {'vs eager':>8} "
        f"{unit + '/step':>12} {'launches/step':>13} {unit + '/batch':>13} {'triton/batch':>12} {'setup_s':>8}",
    ]
    eager = {r.batch: r.windows_per_s for r in rows if r.mode == "eager"}
    for r in rows:
        if r.windows_per_s is None:
            lines.append(f"{r.batch:>5}  {r.mode:<20} {r.note}")
            continue
        base = eager.get(r.batch)
        ratio = f"{r.windows_per_s / base:.2f}x" if base else "-"
        lines.append(
            f"{r.batch:>5}  {r.mode:<20} {r.windows_per_s:>10.2f} {r.windows_per_s * r.batch:>11.1f} {ratio:>8} "
            f"{fmt(r.kernels_per_step, '.1f'):>12} "
            f"{fmt(r.launches_per_step if cuda else None, '.1f'):>13} {fmt(r.kernels_per_batch, 'd'):>13} "
            f"{r.triton_per_batch:>12} {r.setup_s:>8.1f}"
        )
    lines += [
        "",
        f"{unit}/step: one profiled batch step (free, nudged, update, memory write) / "
        f"{relax_steps(cfg)} relaxation steps ({unit}/batch: the whole batch step; triton/batch: the Triton launches "
        "its code makes, window and fused update); "
        f"eager windows alone: {cost.free_ops:.1f} {unit} per free relaxation step, "
        f"{cost.nudged_ops:.1f} per nudged step "
        f"({stacking_text(cfg)}).",
        f"eager phases, ms per window at batch {rows[0].batch if rows else '-'}: "
        + ", ".join(f"{k} {v:.3f}" for k, v in cost.phase_ms.items()),
        f"residual at the last step, spd / sqrt(eps) (the last of those windows, from the initial machine): "
        f"free {cost.free_residual:.3f}x, nudged {cost.nudged_residual:.3f}x (1x: settled)",
    ]
    if not cuda:
        lines.append(
            "ops = top-level aten ops that run a kernel, plus inductor C++ kernels; launches/step is a CUDA figure."
        )
    return "\n".join(lines)


def bench_parser() -> argparse.ArgumentParser:
    p = Parser(prog="trainer2 bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", help="Preset name in configs/ or a YAML path (the machine and window to time).")
    p.add_argument("--config", help="YAML file of config fields, applied over the preset.")
    p.add_argument(
        "--batch_sizes", type=int, nargs="+", help="Batch sizes to time (default: 8 and the config's batch_size)."
    )
    p.add_argument(
        "--modes", nargs="+", choices=MODES, default=list(MODES[:4]), help="Modes to time (default: the first four)."
    )
    p.add_argument("--windows", type=int, default=20, help="Timed windows per (batch, mode).")
    p.add_argument(
        "--rounds", type=int, default=5, help="The timed windows are split into this many rounds, modes interleaved."
    )
    p.add_argument("--warmup", type=int, default=None, help="Untimed warm-up windows (default: warmup_steps + 2).")
    add_config_flags(p)
    return p


def run(argv: list[str]) -> tuple[list[Row], str]:
    """Measure every (batch size, mode) the flags ask for; returns the rows and the printed report."""
    args = bench_parser().parse_args(argv)
    cfg = resolve_config(args)
    if args.windows < 1 or args.rounds < 1:
        raise ConfigError(f"--windows and --rounds must be >= 1, got {args.windows} and {args.rounds}")
    warmup = cfg.warmup_steps + 2 if args.warmup is None else args.warmup
    if warmup < max(cfg.warmup_steps, 1) + 1:
        raise ConfigError(
            f"--warmup ({warmup}) must exceed warmup_steps ({cfg.warmup_steps}) so the graph is captured before timing"
        )
    sizes = args.batch_sizes or sorted({8, cfg.batch_size})
    if any(b < 1 for b in sizes):
        raise ConfigError(f"--batch_sizes must be >= 1, got {sizes}")
    device = resolve_device(cfg)
    data = load_data(cfg.section(DataConfig))
    torch._dynamo.reset()
    rows = []
    for b in sizes:
        rows += measure(cfg, data, device, b, args.modes, args.windows, warmup, args.rounds)
        for r in rows[-len(args.modes) :]:
            print(
                f"  batch {b} {r.mode}: {fmt(r.windows_per_s, '.2f')} windows/s {r.note}".rstrip(),
                file=sys.stderr,
                flush=True,
            )
    return rows, report(
        rows, cfg, device, argv, args.windows, warmup, window_only(cfg, data, device, sizes[0], args.windows)
    )


def main(argv: list[str] | None = None) -> int:
    print(run(list(sys.argv[1:] if argv is None else argv))[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
