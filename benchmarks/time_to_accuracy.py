"""Time to accuracy: the presets of this checkout against an earlier one's, whole runs one after another on one
machine, each with the threads its preset asks for.

    python -m benchmarks.time_to_accuracy --base /path/to/62de6d8 --data mnist5000.npz [--only conv conv_deep dev]
        [--seed 0]
    python -m benchmarks.time_to_accuracy --data mnist5000.npz --only conv_deep conv_res --seed 0   # issue 59

Runs, in this order: the base's `conv` preset and this checkout's `conv` and `conv_deep` on the image file (`--data`,
`--heldout_fraction 0.2`: the last fifth held out), then the base's `dev` preset and this checkout's on the built-in
corpus. Each run is `python <repo>/main.py --preset P ...` in a fresh temporary checkpoint directory (no other flags:
the preset as it ships), and reads its summary.json: the training loop's wall seconds (start-up and the final
evaluation excluded) and its held-out accuracy or bits per character. Prints a table with each run's time as a
multiple of the base's run of the same family (conv_deep against the base's conv), and the goals of issue 37; the
residual `conv_res` (issue 59) runs after `conv_deep` and is timed against it (no --base needed then). Run it on an
otherwise idle machine: a test or a helper beside it spoils the times.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Job:
    name: str  # how the table names the run
    repo: Path
    preset: str
    family: str  # the base run its time is compared with
    images: bool  # trains on --data (else the built-in corpus)


@dataclass(frozen=True)
class Result:
    job: Job
    train_seconds: float  # summary.json's wall_seconds: the training loop
    command_seconds: float  # the whole command, start-up and final evaluation included
    windows: int
    score: float  # held-out accuracy (images) or bits per character (text)


def run(job: Job, data: Path, seed: int) -> Result:
    """One whole run of `job`; exits naming the run if it fails."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONPATH": str(job.repo)}
        env.pop("OMP_NUM_THREADS", None)  # each preset chooses its threads
        flags = ["--preset", job.preset, "--seed", str(seed), "--checkpoint_dir", tmp, "--run_name", "t"]
        if job.images:
            flags += ["--data", str(data), "--heldout_fraction", "0.2"]
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, str(job.repo / "main.py"), *flags], cwd=tmp, env=env, text=True, capture_output=True
        )
        took = time.perf_counter() - start
        if done.returncode != 0:
            raise SystemExit(f"{job.name}: exit {done.returncode}\n{done.stderr[-2000:]}")
        s = json.loads((Path(tmp) / "t" / "summary.json").read_text())
    score = s["heldout_acc"] if job.images else s["heldout_bpc"]
    return Result(job, float(s["wall_seconds"]), took, int(s["windows"]), float(score))


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--base", help="the earlier checkout (issue 37: 62de6d8); needed for conv, dev")
    p.add_argument("--data", required=True, help="the image .npz (the MNIST 5k sample of benchmarks/mnist.py)")
    p.add_argument(
        "--only", nargs="+", choices=["conv", "conv_deep", "conv_res", "dev"], default=["conv", "conv_deep", "dev"]
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.base is None and {"conv", "dev"} & set(args.only):
        p.error("--only conv or dev compares with an earlier checkout: give --base")
    base, data = Path(args.base or HERE).resolve(), Path(args.data).resolve()
    jobs = []
    if args.base and {"conv", "conv_deep"} & set(args.only):  # conv_deep's time is compared with the base's conv
        jobs += [Job("base conv", base, "conv", "conv", True)]
    jobs += [Job(name, HERE, name, "conv", True) for name in ("conv", "conv_deep") if name in args.only]
    if "conv_res" in args.only:  # the residual graph, timed against conv_deep run just before it
        jobs += [Job("conv_res", HERE, "conv_res", "conv_deep", True)]
    if "dev" in args.only:
        jobs += [Job("base dev", base, "dev", "dev", False), Job("dev", HERE, "dev", "dev", False)]
    results: list[Result] = []
    for job in jobs:
        results.append(run(job, data, args.seed))
        r = results[-1]
        print(
            f"{job.name}: {r.windows} windows, {r.train_seconds:.1f} s training ({r.command_seconds:.1f} s command), "
            f"held-out {r.score:.4f}",
            flush=True,
        )
    base_time = {r.job.family: r.train_seconds for r in results if r.job.repo == base and args.base}
    base_time.update({"conv_deep": r.train_seconds for r in results if r.job.name == "conv_deep"})
    print(f"\nbase {base.name}, seed {args.seed}; time: the training loop, and its multiple of the base run's")
    print(f"{'run':<10} {'windows':>8} {'train s':>8} {'x base':>7} {'command s':>10} {'held-out':>9}  goal")
    goals = {
        "conv": ("acc >= 0.974, time <= 0.5x", 0.974, 0.5),
        "conv_deep": ("acc >= 0.980, time <= 1.5x", 0.98, 1.5),
        "conv_res": ("acc >= 0.985, time <= 1.0x conv_deep's (the mean of seeds 0 and 1 is the issue's)", 0.985, 1.0),
    }
    dev_bpc = next((r.score for r in results if r.job.name == "base dev"), None)
    for r in results:
        family = r.job.family if r.job.family in base_time else None
        ratio = r.train_seconds / base_time[family] if family else float("nan")  # no base run of its family
        goal = ""
        if r.job.name in goals and family:
            text, acc, limit = goals[r.job.name]
            goal = f"{text}: {'met' if r.score >= acc and ratio <= limit else 'not met'}"
        elif r.job.name == "dev" and dev_bpc is not None:
            goal = f"bpc <= {dev_bpc:.4f}, time <= 0.6x: {'met' if r.score <= dev_bpc and ratio <= 0.6 else 'not met'}"
        print(
            f"{r.job.name:<10} {r.windows:>8} {r.train_seconds:>8.1f} {ratio:>6.3f}x {r.command_seconds:>10.1f} "
            f"{r.score:>9.4f}  {goal}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
