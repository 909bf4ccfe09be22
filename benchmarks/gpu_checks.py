"""Every GPU check of trainer2 in one run, for a session that has a CUDA GPU; ends with one summary table.

    python -m benchmarks.gpu_checks [bench flags, e.g. --preset production]

1. the whole test suite with CUDA (the CUDA-only tests in tests/test_capture.py run instead of skipping,
   and TRAINER2_SLOW_TESTS=1 adds the inductor test);
2. the benchmark (`python main.py bench`) over eager, graph, compile, compile+graph and reduce-overhead;
3. the goals: graph >= 5x eager windows/s at batch 8, and fewer kernels per relaxation step with compile.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GOAL_SPEEDUP = 5.0


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
    sys.path.insert(0, str(ROOT))
    import torch

    from trainer2.running.bench import MODES, run

    if not torch.cuda.is_available():
        print("gpu_checks: torch sees no CUDA GPU here; nothing to check", file=sys.stderr)
        return 1
    argv = list(sys.argv[1:] if argv is None else argv)
    tests = run_tests()
    if "--modes" not in argv:
        argv += ["--modes", *MODES]
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
    width = max(len(k) for k, _ in summary)
    print("\n== gpu_checks summary: " + torch.cuda.get_device_name() + " ==")
    for k, v in summary:
        print(f"{k:<{width}}  {v}")
    return 0 if all(r not in ("FAILED", "ERROR") for _, r in tests) else 1


if __name__ == "__main__":
    sys.exit(main())
