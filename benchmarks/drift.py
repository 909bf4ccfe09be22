"""Throughput drift over a long run: windows/s over the first and the last tenth of a run, and their ratio.

    python -m benchmarks.drift [--repo PATH ...] [--threads 1] -- --preset deep --lr_schedule constant \\
        --max_windows 14000 --log_every_windows 200 --eval_every_windows 0

Trains `python <repo>/main.py <flags>` in a subprocess (OMP_NUM_THREADS=--threads) for each --repo (default: this
checkout; give another checkout, e.g. an older commit, to compare), all of them at once so a changing load on the
machine hits each alike, into a temporary checkpoint directory. From each run's telemetry.jsonl it prints windows/s
over the first and the last tenth of the windows (evaluation excluded), last / first (the goal: >= 0.9), the dead
hidden units of the last logged row (if that code logs them) and the subnormal floats in the final checkpoint,
largest tensors first. `--telemetry FILE` instead reports on an existing run's telemetry.jsonl.

    python -m benchmarks.drift --resume CHECKPOINT --windows 300 --rounds 2 --repo A --repo B

instead resumes step directory CHECKPOINT (e.g. one holding many subnormals) for --windows windows with each
repo's main.py in turn, --rounds interleaved rounds, and prints each process's wall time and windows/s.

    python -m benchmarks.drift --dead CHECKPOINT [CHECKPOINT ...]

counts, with this checkout's code, the dead hidden units of each checkpoint (also of one written by code that does
not log them): units at 0 or 1 for every example of one training batch (the sampler's first) at the free
equilibrium, as the telemetry's dead_units.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

HERE = Path(__file__).resolve().parent.parent


def tenth_rates(rows: list[dict]) -> tuple[float, float, int]:
    """(windows/s over the first tenth, over the last tenth, total windows) from logged rows, each row covering the
    windows since the previous one at its windows_per_second."""
    spans, prev = [], 0
    for r in rows:
        if r.get("windows_per_second"):
            spans.append((prev, r["window"], (r["window"] - prev) / r["windows_per_second"]))
        prev = r["window"]
    total = prev
    tenth = max(total // 10, 1)

    def rate(lo: int, hi: int) -> float:
        inside = [(a, b, s) for a, b, s in spans if a >= lo and b <= hi]
        return sum(b - a for a, b, _ in inside) / max(sum(s for *_, s in inside), 1e-12)

    return rate(0, tenth), rate(total - tenth, total), total


def subnormals(step_dir: Path) -> dict[str, int]:
    """Subnormal floats per tensor of a checkpoint's tensors.safetensors, nonzero counts only."""
    out = {}
    for k, v in load_file(str(step_dir / "tensors.safetensors")).items():
        if v.dtype.kind == "f":
            a = np.abs(v)
            n = int(((a > 0) & (a < np.finfo(v.dtype).tiny)).sum())
            if n:
                out[k] = n
    return out


GOAL = 0.9  # the last tenth's windows/s at least this share of the first tenth's


def report(label: str, telemetry: Path) -> bool:
    """Print a run's drift figures; True when it holds: last / first >= GOAL and no subnormal in its final checkpoint
    (the cause of the CPU slowdown this benchmark was written for: a machine whose subnormal arithmetic is fast shows
    them without the slowdown, so they count as a failure by themselves)."""
    rows = [json.loads(line) for line in telemetry.read_text().splitlines() if line.strip()]
    first, last, total = tenth_rates(rows)
    print(
        f"{label}: {total} windows; first tenth {first:.1f} win/s, last tenth {last:.1f} win/s, "
        f"last/first {last / first:.3f}"
    )
    dead = rows[-1].get("dead_units") if rows else None
    print(f"  dead hidden units at the end: {'not logged by this code' if dead is None else int(dead)}")
    steps = sorted(telemetry.parent.glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    sub: dict[str, int] = {}
    if steps:
        sub = subnormals(steps[-1])
        top = ", ".join(f"{k} {n}" for k, n in sorted(sub.items(), key=lambda kv: -kv[1])[:4])
        print(f"  subnormal floats in {steps[-1].name}: {sum(sub.values())}" + (f" ({top})" if top else ""))
    print(
        "  windows/s per logged interval:",
        " ".join(f"{r['windows_per_second']:.0f}" for r in rows if r.get("windows_per_second")),
    )
    held = last / first >= GOAL and not sub
    print(f"  {'holds' if held else 'FAILS'}: last/first >= {GOAL} and no subnormal in the final checkpoint")
    return held


def resume_rounds(args: argparse.Namespace) -> int:
    """Interleaved A/B: resume args.resume for args.windows windows with each repo, args.rounds times."""
    step = int(json.loads((args.resume / "meta.json").read_text())["counters"]["window"])
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": ""}
    flags = [f for f in args.flags if f != "--"]
    for r in range(args.rounds):
        for i, repo in enumerate(Path(x).resolve() for x in (args.repo or [HERE])):
            with tempfile.TemporaryDirectory(prefix="drift_resume_") as tmp:
                cmd = [
                    sys.executable,
                    str(repo / "main.py"),
                    "--resume",
                    str(args.resume.resolve()),
                    "--checkpoint_dir",
                    tmp,
                    "--run_name",
                    "ab",
                    "--max_windows",
                    str(step + args.windows),
                    "--eval_every_windows",
                    "0",
                    "--log_every_windows",
                    str(args.windows),
                    "--eval_batches",
                    "1",
                    *flags,
                ]
                t0 = time.perf_counter()
                out = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
                wall = time.perf_counter() - t0
                if out.returncode:
                    print(f"{repo} failed ({out.returncode}):\n{out.stderr[-3000:]}")
                    return 1
                rows = [json.loads(x) for x in (Path(tmp) / "ab" / "telemetry.jsonl").read_text().splitlines()]
                print(
                    f"round {r + 1} repo{i} ({repo}): process {wall:.2f} s, "
                    f"{rows[-1]['windows_per_second']:.1f} windows/s",
                    flush=True,
                )
    return 0


def dead_at(step_dir: Path) -> tuple[int, int]:
    """(dead hidden units, hidden units) of a checkpoint on one training batch, with this checkout's code."""
    import torch

    from trainer2.data.sampler import Sampler
    from trainer2.physics.dead_units import dead_units
    from trainer2.physics.relaxation import Relaxation
    from trainer2.running.model import load as load_trained

    t = load_trained(step_dir, {"device": "cpu"}, log=lambda msg: None)
    relax = Relaxation(t.machine, t.cfg, t.cfg.batch_size, t.memory)
    inputs, targets = t.data.batch("train", Sampler(t.data.num_examples("train"), t.cfg.batch_size, 0).next())
    with torch.no_grad():
        relax.free_phase(inputs, targets)
    return int(dead_units(relax.s0.s[:-1], torch.device("cpu"))), sum(t.machine.state_sizes()[:-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repo", action="append", help="checkout whose main.py to run (repeatable; default: this one)")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each run")
    p.add_argument("--telemetry", type=Path, help="report on this telemetry.jsonl instead of training")
    p.add_argument("--resume", type=Path, help="a step_<N>/ directory to resume with each repo in turn")
    p.add_argument("--windows", type=int, default=300, help="windows past the checkpoint's (with --resume)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (with --resume)")
    p.add_argument("--dead", type=Path, nargs="+", help="count the dead hidden units of these step directories")
    p.add_argument("flags", nargs=argparse.REMAINDER, help="-- then the training flags")
    args = p.parse_args()
    if args.dead:
        for step in args.dead:
            dead, total = dead_at(step)
            print(f"{step}: {dead} of {total} hidden units dead on one training batch")
        return 0
    if args.telemetry:
        report(str(args.telemetry), args.telemetry)
        return 0
    if args.resume:
        return resume_rounds(args)
    flags = [f for f in args.flags if f != "--"]
    repos = [Path(r).resolve() for r in (args.repo or [HERE])]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": ""}
    with tempfile.TemporaryDirectory(prefix="drift_") as tmp:
        procs = []
        for i, repo in enumerate(repos):
            cmd = [sys.executable, str(repo / "main.py"), *flags, "--checkpoint_dir", tmp, "--run_name", f"run{i}"]
            print(f"run{i}: {' '.join(cmd)}  (cwd {repo})", flush=True)
            log = open(Path(tmp) / f"run{i}.log", "w")
            procs.append((subprocess.Popen(cmd, cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT), log))
        for i, (proc, log) in enumerate(procs):
            rc = proc.wait()
            log.close()
            if rc:
                print(f"run{i} failed ({rc}):\n" + (Path(tmp) / f"run{i}.log").read_text()[-3000:])
                return 1
        held = [report(f"run{i} ({repo})", Path(tmp) / f"run{i}" / "telemetry.jsonl") for i, repo in enumerate(repos)]
    return 0 if all(held) else 2  # 2: some run drifted or left subnormals behind


if __name__ == "__main__":
    sys.exit(main())
