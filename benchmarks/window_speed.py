"""Windows per second of whole training runs of several checkouts, in interleaved rounds, one thread each.

    python -m benchmarks.window_speed --repo /path/to/old --repo . --rounds 3 -- --preset dev --max_windows 1500 \\
        --eval_every_windows 0 --eval_batches 1 --log_every_windows 1500

Runs `python <repo>/main.py <flags>` for each --repo in turn (round 1: every repo, round 2: every repo in the reverse
order, and so on, because whichever runs first in a round tends to run a few percent faster), each in
a fresh temporary checkpoint directory with OMP_NUM_THREADS=1 and TQDM_DISABLE=1, and reads its summary.json's
windows_per_second (the training loop: batches drawn, steps, logging; start-up excluded). Prints every round and each
repo's median, and the ratio of each median to the first repo's. Run it on an idle machine: a helper or a test beside
it spoils the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def one_run(repo: Path, flags: list[str]) -> float:
    """windows/s of one run of `repo`'s main.py with `flags`."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "PYTHONPATH": str(repo)}
        cmd = [sys.executable, str(repo / "main.py"), *flags, "--checkpoint_dir", tmp, "--run_name", "speed"]
        done = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{repo}: exit {done.returncode}\n{done.stderr[-2000:]}")
        return float(json.loads((Path(tmp) / "speed" / "summary.json").read_text())["windows_per_second"])


def round_order(repos: list[Path], k: int) -> list[Path]:
    """The order of round k (from 0): as given, then reversed, and so on, so no checkout always runs first (whichever
    does tends to run a few percent faster: docs/performance.md)."""
    return repos if k % 2 == 0 else repos[::-1]


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--repo", action="append", required=True, help="a checkout whose main.py to run (repeat)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("flags", nargs=argparse.REMAINDER, help="after --: the flags every run takes")
    args = p.parse_args()
    flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    repos = [Path(r).resolve() for r in args.repo]
    rates: dict[Path, list[float]] = {r: [] for r in repos}
    for k in range(args.rounds):
        for repo in round_order(repos, k):
            rates[repo].append(one_run(repo, flags))
            print(f"round {k + 1}: {repo}: {rates[repo][-1]:.1f} windows/s", flush=True)
    base = statistics.median(rates[repos[0]])
    for repo in repos:
        median = statistics.median(rates[repo])
        print(f"{repo}: median {median:.1f} windows/s ({median / base:.3f}x the first)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
