"""EP / exact over many seeds: one ratio scatters by a few percent (each pair of runs is its own trajectory), so a
claim about 1 % needs the mean of many pairs and its standard error.

    python -m benchmarks.quality_seeds --seeds 0-15 --jobs 2 --out runs/quality_conv -- \\
        --preset conv --data mnist5000.npz --heldout_fraction 0.2 --examples 64000 --cpu_threads 1 --skip ff

Runs `benchmarks.quality` once per seed (`--jobs` at a time, each its own process, log, JSON and checkpoint folder
under `--out`; a seed whose JSON is there already is not run again, so a stopped sweep resumes), then prints each
seed's ratio and cosine, and the ratios' mean, standard deviation, standard error and mean +- 2 standard errors.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path


def parse_seeds(text: str) -> list[int]:
    """'0-3,7' -> [0, 1, 2, 3, 7]."""
    seeds: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        seeds.extend(range(int(lo), int(hi or lo) + 1))
    return seeds


def run_seeds(seeds: list[int], jobs: int, out: Path, flags: list[str]) -> list[int]:
    """Runs benchmarks.quality for each seed without a JSON under `out`, `jobs` at a time; returns the failed seeds."""
    root = str(Path(__file__).resolve().parents[1])  # `benchmarks` importable from any working folder
    env = {
        **os.environ,
        "TQDM_DISABLE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
    }
    todo = [s for s in seeds if not (out / f"quality-s{s}.json").exists()]
    running: dict[int, subprocess.Popen] = {}
    failed: list[int] = []
    while todo or running:
        while todo and len(running) < jobs:
            s = todo.pop(0)
            cmd = [sys.executable, "-m", "benchmarks.quality", *flags, "--seed", str(s)]
            cmd += ["--json", str(out / f"quality-s{s}.json"), "--checkpoint_dir", str(out / f"checkpoints-s{s}")]
            with open(out / f"quality-s{s}.log", "w") as log:
                running[s] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            print(f"seed {s}: started", flush=True)
        time.sleep(1.0)
        for s, proc in list(running.items()):
            if proc.poll() is None:
                continue
            del running[s]
            print(f"seed {s}: {'done' if proc.returncode == 0 else f'failed (exit {proc.returncode})'}", flush=True)
            if proc.returncode:
                failed.append(s)
    return failed


def summarize(ratios: list[float]) -> dict[str, float]:
    """Mean, sample standard deviation and standard error of the ratios (sd and se 0 for one ratio)."""
    n = len(ratios)
    mean = sum(ratios) / n
    sd = math.sqrt(sum((r - mean) ** 2 for r in ratios) / (n - 1)) if n > 1 else 0.0
    return {"n": n, "mean": mean, "sd": sd, "se": sd / math.sqrt(n)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--seeds", type=parse_seeds, required=True, help="seeds, as 0-15 or 0,3,5-7")
    p.add_argument("--jobs", type=int, default=1, help="runs side by side (each takes --cpu_threads threads)")
    p.add_argument("--out", type=Path, required=True, help="folder of each seed's log, JSON and checkpoints")
    p.add_argument("--report_only", action="store_true", help="run nothing; summarize the JSONs there")
    p.add_argument("flags", nargs=argparse.REMAINDER, help="after --: benchmarks.quality's options and flags")
    args = p.parse_args(argv)
    flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    if "--seed" in flags or "--json" in flags or "--checkpoint_dir" in flags:
        p.error("--seed, --json and --checkpoint_dir are set per seed; leave them out of the quality flags")
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        failed = [] if args.report_only else run_seeds(args.seeds, args.jobs, args.out, flags)
    except KeyboardInterrupt:  # the runs got the same Ctrl-C and stop; each finished seed's JSON stays
        print(f"stopped; the same command runs the seeds without a JSON under {args.out}", file=sys.stderr)
        return 130

    rows = []
    for s in args.seeds:
        path = args.out / f"quality-s{s}.json"
        if path.exists():
            res = json.loads(path.read_text())
            if "ratio" in res:
                rows.append((s, res["ep"], res["exact"], res["ratio"], res["cosine"]["all"]))
    if not rows:
        print(f"no seed has an EP / exact ratio under {args.out}", file=sys.stderr)
        return 1
    metric = "heldout_bpc" if "heldout_bpc" in rows[0][1] else "heldout_loss"
    print(f"\n{'seed':>4} {'EP ' + metric:>20} {'exact ' + metric:>23} {'ratio':>7} {'cosine':>7}")
    for s, ep, exact, ratio, cos in rows:
        print(f"{s:4d} {ep[metric]:20.4f} {exact[metric]:23.4f} {ratio:7.4f} {cos:7.4f}")
    st = summarize([r[3] for r in rows])
    lo, hi = st["mean"] - 2 * st["se"], st["mean"] + 2 * st["se"]
    print(
        f"\n{st['n']} seeds: EP / exact mean {st['mean']:.4f}, sd {st['sd']:.4f}, standard error {st['se']:.4f}; "
        f"mean +- 2 se [{lo:.4f}, {hi:.4f}]"
    )
    if failed:
        print(f"failed seeds (see their logs): {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
