"""Data-parallel scaling: examples per second at 1 process (`python main.py`) and N processes (torchrun), side by side.

    OMP_NUM_THREADS=1 python -m benchmarks.scaling [--procs 1 2] [--repeats 3] [--windows 600] [--FIELD VALUE ...]

Weak scaling, as the PyTorch convention for --batch_size has it: every process keeps the preset's per-process
batch, so N processes train N x the examples per window. The process counts are run in turn, repeated
(interleaved, so a change in the machine's load hits all of them alike), one thread each. A run's speed is
the median windows/s of its telemetry rows after the first (which holds start-up and warm-up), times the
global batch. Runs time their phases (--timing_debug): for N > 1 the table shows the `allreduce` phase per
window, which holds the all-reduce itself and the wait for the slowest rank; the last line times the bare
all-reduce of a buffer the size of the preset's parameters between the same number of processes (the best of
a few rounds: its floor on this machine). Unknown arguments are TrainConfig flags for every run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def command(procs: int, flags: list[str]) -> list[str]:
    """A plain `python main.py` for one process (no process group), torchrun for more."""
    if procs == 1:
        return [sys.executable, "main.py", *flags]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(procs),
        "--standalone",
        "main.py",
        *flags,
    ]


def measure(run_dir: Path, global_batch: int) -> tuple[float, float, float]:
    """(examples/s, all-reduce ms per window, step ms per window): medians over the telemetry rows after the first."""
    rows = [json.loads(line) for line in (run_dir / "telemetry.jsonl").read_text().splitlines()]
    steady = rows[1:] or rows[-1:]
    step = [
        sum(v for k, v in r.items() if k.startswith("time_") and k not in ("time_data_ms", "time_logging_ms"))
        for r in steady
    ]
    return (
        statistics.median(r["windows_per_second"] for r in steady) * global_batch,
        statistics.median(r.get("time_allreduce_ms", 0.0) for r in steady),
        statistics.median(step),
    )


def _allreduce_worker(rank: int, world: int, init: str, numel: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    buf, best = torch.ones(numel), float("inf")
    for _ in range(6):  # the first round warms up
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(100):
            dist.all_reduce(buf)
        best = min(best, (time.perf_counter() - t0) / 100)
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(str(best))


def bare_allreduce_ms(world: int, numel: int, tmp: str) -> float:
    """Best-of-rounds time of one gloo all-reduce of `numel` float32 between `world` spawned processes, in ms."""
    import torch.multiprocessing as mp

    out = Path(tmp) / "allreduce.txt"
    mp.spawn(_allreduce_worker, args=(world, f"file://{tmp}/rendezvous", numel, str(out)), nprocs=world, join=True)
    return 1e3 * float(out.read_text())


def parameter_count(preset: str, extra: list[str]) -> int:
    import trainer2
    from trainer2.flags import flag_overrides
    from trainer2.running.trainer import Trainer

    cfg = trainer2.config(preset, **{"device": "cpu", **flag_overrides(extra)})
    return sum(t.numel() for t in Trainer(cfg, log=lambda msg: None).params.tensors)


def main() -> int:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__.split("\n")[0], epilog="Unknown arguments are TrainConfig flags."
    )
    p.add_argument("--procs", type=int, nargs="+", default=[1, 2], help="process counts to compare (default: 1 2)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repetitions of every process count")
    p.add_argument("--windows", type=int, default=600, help="windows per run")
    p.add_argument("--preset", default="dev", help="preset every run starts from (default: dev)")
    p.add_argument("--batch_size", type=int, default=64, help="examples per window and process (default: 64)")
    args, extra = p.parse_known_args()
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    speeds: dict[int, list[float]] = {n: [] for n in args.procs}
    reduce_ms: dict[int, list[tuple[float, float]]] = {n: [] for n in args.procs}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for n in args.procs:
                name = f"p{n}-r{rep}"
                flags = [
                    "--preset",
                    args.preset,
                    "--run_name",
                    name,
                    "--checkpoint_dir",
                    tmp,
                    "--batch_size",
                    str(args.batch_size),
                    "--max_windows",
                    str(args.windows),
                    "--log_every_windows",
                    str(max(args.windows // 10, 1)),
                    "--eval_every_windows",
                    "0",
                    "--eval_batches",
                    "1",
                    "--lr_warmup_windows",
                    "0",
                    "--device",
                    "cpu",
                    "--timing_debug",
                    *extra,
                ]
                done = subprocess.run(command(n, flags), cwd=ROOT, env=env, capture_output=True, text=True)
                if done.returncode != 0:
                    print(done.stdout[-2000:] + done.stderr[-4000:], file=sys.stderr)
                    return done.returncode
                ex, red, step = measure(Path(tmp) / name, args.batch_size * n)
                speeds[n].append(ex)
                reduce_ms[n].append((red, step))
                print(
                    f"repeat {rep + 1}/{args.repeats}: {n} process(es): {ex:,.0f} examples/s, step {step:.2f} ms, "
                    f"all-reduce {red:.2f} ms per window",
                    flush=True,
                )
    base = statistics.median(speeds[args.procs[0]])
    print(
        f"\nOMP_NUM_THREADS={env['OMP_NUM_THREADS']}, preset {args.preset}, batch {args.batch_size} per process, "
        f"{args.windows} windows per run, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}"
    )
    print(
        "| processes | examples/s (median) | each repeat | speed-up | "
        "all-reduce ms / step ms per window (rank 0, median) |"
    )
    print("| --- | --- | --- | --- | --- |")
    for n in args.procs:
        med = statistics.median(speeds[n])
        each = ", ".join(f"{s:,.0f}" for s in speeds[n])
        red, step = (statistics.median(x[i] for x in reduce_ms[n]) for i in (0, 1))
        print(f"| {n} | {med:,.0f} | {each} | {med / base:.2f}x | {red:.2f} / {step:.2f} |")
    numel = parameter_count(args.preset, extra)
    with tempfile.TemporaryDirectory() as tmp:
        for n in (n for n in args.procs if n > 1):
            print(
                f"bare gloo all-reduce of {numel:,} float32 ({numel * 4 / 1024:.0f} KiB) between {n} processes: "
                f"{bare_allreduce_ms(n, numel, tmp):.2f} ms (best of 5 rounds of 100)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
