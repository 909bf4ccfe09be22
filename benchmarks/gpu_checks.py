"""Every GPU check of trainer2 in one run, for a session that has a CUDA GPU; ends with one summary table.

    python -m benchmarks.gpu_checks [bench flags, e.g. --preset production]

1. the whole test suite with CUDA (the CUDA-only tests in tests/test_capture.py run instead of skipping,
   and TRAINER2_SLOW_TESTS=1 adds the inductor test);
2. the benchmark (`python main.py bench`) over eager, graph, compile, compile+graph and reduce-overhead, and the
   Triton window (issue 24): triton, triton+graph, triton+compile+graph, with an empty Triton cache (so the
   triton rows' setup_s includes compiling the kernels: the time to the first replayed window);
3. the goals: graph >= 5x eager windows/s at batch 8, fewer kernels per relaxation step with compile, triton+graph
   >= 5x compile+graph at batch 8, at most 30 kernels per batch step with triton+graph, and (at the largest batch)
   the share of the GPU's fp32 peak the Triton window's arithmetic reaches.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GOAL_SPEEDUP = 5.0
GOAL_TRITON_SPEEDUP = 5.0  # triton+graph over compile+graph at batch 8 (issue 24)
GOAL_KERNELS = 30  # kernels per whole batch step with triton+graph (issue 24)
# Non-tensor-core fp32 peaks, first match wins: the kernels' dots are "ieee" (FMA), not TF32.
FP32_PEAK_TFLOPS = {"H100 PCIe": 51.2, "H100": 66.9, "H200": 66.9, "A100": 19.5}


def window_flops(cfg, candidates: int) -> float:
    """Multiply-adds x 2 of one batch step's relaxation per example: every step runs each coupling between state layers
    both ways (W s and W^T s), q's spd (n^2), and on nudged steps the readout (y, qA: 2 n^2; distances, pull: 2 n K)."""
    hidden = [int(spec) for layer in cfg.layers for spec in layer.values()]  # dense layers: {dense: width}
    sizes, n = [*hidden, cfg.coord_dim_n], cfg.coord_dim_n
    chain = sum(2 * a * b for a, b in zip(sizes[:-1], sizes[1:])) + n * hidden[-1] + n * n
    nudged = chain + 2 * n * n + 2 * n * candidates
    return 2.0 * (cfg.free_steps * chain + (2 if cfg.symmetric_nudge else 1) * cfg.nudge_steps * nudged)


def run_tests() -> list[tuple[str, str]]:
    """(test id, PASSED/FAILED/SKIPPED/ERROR) for every test, from pytest's -rA summary."""
    env = {**os.environ, "TRAINER2_SLOW_TESTS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "tests"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    print(proc.stdout[-20000:], proc.stderr[-4000:], sep="\n")
    found = re.findall(r"^(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS) (\S+)", proc.stdout, re.M)
    return [(test, result) for result, test in found] or [("pytest", f"exit {proc.returncode}, no summary")]


def main(argv: list[str] | None = None) -> int:
    import torch

    from trainer2.running.bench import MODES, run

    if not torch.cuda.is_available():
        print("gpu_checks: torch sees no CUDA GPU here; nothing to check", file=sys.stderr)
        return 1
    argv = list(sys.argv[1:] if argv is None else argv)
    tests = run_tests()
    if "--modes" not in argv:
        argv += ["--modes", *MODES]
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="trainer2-triton-")  # cold: setup_s includes compiling
    rows, table = run(argv)
    print(table)

    by = {(r.batch, r.mode): r for r in rows}
    summary: list[tuple[str, str]] = [(t, r) for t, r in tests if "capture" in t or r not in ("PASSED", "SKIPPED")]
    passed = sum(r == "PASSED" for _, r in tests)
    summary.append(
        (
            "all tests",
            f"{passed} passed, {sum(r in ('FAILED', 'ERROR') for _, r in tests)} failed, "
            f"{sum(r == 'SKIPPED' for _, r in tests)} skipped",
        )
    )
    eager, graph = by.get((8, "eager")), by.get((8, "graph"))
    if eager and graph and eager.windows_per_s and graph.windows_per_s:
        ratio = graph.windows_per_s / eager.windows_per_s
        summary.append(
            (
                "graph vs eager, batch 8",
                f"{ratio:.2f}x ({'meets' if ratio >= GOAL_SPEEDUP else 'BELOW'} the {GOAL_SPEEDUP:g}x goal)",
            )
        )
    comp = by.get((8, "compile"))
    if eager and comp and comp.kernels_per_step:
        summary.append(
            (
                "kernels/relax step, batch 8",
                f"eager {eager.kernels_per_step:.1f} -> compile {comp.kernels_per_step:.1f}",
            )
        )
    best = max(
        (r for r in rows if r.batch == 8 and r.windows_per_s and r.mode in ("compile+graph", "reduce-overhead")),
        key=lambda r: r.windows_per_s,
        default=None,
    )
    if best:
        summary.append(("faster compile+graph variant, batch 8", f"{best.mode} ({best.windows_per_s:.1f} windows/s)"))
    summary += triton_goals(by, argv, torch.cuda.get_device_name())
    width = max(len(k) for k, _ in summary)
    print("\n== gpu_checks summary: " + torch.cuda.get_device_name() + " ==")
    for k, v in summary:
        print(f"{k:<{width}}  {v}")
    return 0 if all(r not in ("FAILED", "ERROR") for _, r in tests) else 1


def triton_goals(by: dict, argv: list[str], device_name: str) -> list[tuple[str, str]]:
    """Issue 24's figures from the bench rows: speed against compile+graph, kernels per batch step, compile time, and
    the share of the fp32 peak at the largest batch (from whole-step time, so a lower bound on the window's own)."""
    from trainer2.data.load import load_dataset
    from trainer2.flags import resolve_config
    from trainer2.running.bench import bench_parser, relax_steps

    cfg = resolve_config(bench_parser().parse_args(argv))
    out = []
    tri, comp = by.get((8, "triton+graph")), by.get((8, "compile+graph"))
    if tri and tri.windows_per_s:
        if comp and comp.windows_per_s:
            ratio = tri.windows_per_s / comp.windows_per_s
            verdict = "meets" if ratio >= GOAL_TRITON_SPEEDUP else "BELOW"
            out.append(
                (
                    "triton+graph vs compile+graph, batch 8",
                    f"{ratio:.2f}x ({verdict} the {GOAL_TRITON_SPEEDUP:g}x goal)",
                )
            )
        if tri.kernels_per_step:
            k = tri.kernels_per_step * relax_steps(cfg)
            verdict = "meets" if k <= GOAL_KERNELS else "ABOVE"
            out.append(
                ("kernels per batch step, triton+graph, batch 8", f"{k:.0f} ({verdict} the {GOAL_KERNELS} goal)")
            )
        out.append(
            (
                "first replayed window, triton+graph, batch 8",
                f"{tri.setup_s:.1f} s (cold Triton cache, warm-up and capture included)",
            )
        )
    rows = [r for r in by.values() if r.mode == "triton+graph" and r.windows_per_s]
    big = max(rows, key=lambda r: r.batch, default=None)
    peak = next((v for k, v in FP32_PEAK_TFLOPS.items() if k in device_name), None)
    if big and peak:
        classes = load_dataset(cfg.data, cfg.context_len, cfg.heldout_fraction).num_classes  # the prototypes
        tflops = window_flops(cfg, classes + cfg.memory_capacity) * big.batch * big.windows_per_s / 1e12
        out.append(
            (
                f"fp32 peak share, triton+graph, batch {big.batch}",
                f"{tflops:.2f} TFLOP/s = {100 * tflops / peak:.1f}% of {peak:g} (whole-step time: a lower bound)",
            )
        )
    return [] if tri is None else out


if __name__ == "__main__":
    sys.exit(main())
