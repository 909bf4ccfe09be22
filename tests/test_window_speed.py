"""benchmarks/window_speed.py runs each checkout's main.py in interleaved rounds and reads each run's windows/s."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_two_rounds_of_one_checkout_print_each_round_and_the_median():
    flags = ["--hidden_sizes", "8", "--coord_dim_n", "4", "--rotor_k", "3", "--batch_size", "8", "--free_steps", "4"]
    flags += ["--nudge_steps", "2", "--max_windows", "3", "--eval_batches", "1", "--log_every_windows", "3"]
    cmd = [sys.executable, "-m", "benchmarks.window_speed", "--repo", str(REPO), "--rounds", "2", "--", *flags]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [line.split(":")[0] for line in lines[:2]] == ["round 1", "round 2"]
    assert lines[-1].endswith("(1.000x the first)") and "windows/s" in lines[-1]


def test_rounds_alternate_the_order_so_no_checkout_always_runs_first():
    from benchmarks.window_speed import round_order

    a, b, c = Path("a"), Path("b"), Path("c")
    assert [round_order([a, b, c], k) for k in range(3)] == [[a, b, c], [c, b, a], [a, b, c]]
