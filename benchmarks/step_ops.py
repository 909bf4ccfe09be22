"""Where a batch step's operators come from: one profiled batch step (after warm-up) of a preset, its kernel-running
operators (what `bench` counts) grouped by the trainer2 function that issued them, so fusing them (issue 38: at most
30 kernels a batch step with the Triton window) knows where to start. Counts only, no timing; on the CPU, with the
torch window and update unless told otherwise.

    python -m benchmarks.step_ops --preset dev --batch_size 8 [--window_backend torch] [--update_backend torch]
        [--readout_backend torch]
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch
from torch.profiler import profile

import trainer2
from trainer2.data.load import DataConfig, load_data
from trainer2.running.bench import host_batches, kernel_ops, make_step
from trainer2.running.step_runner import StepRunner


def issuer(event) -> str:
    """'file.py:function' of the innermost trainer2 function above a profiled operator ('?' if none)."""
    p = event.cpu_parent
    while p is not None:
        if "trainer2/" in p.name and "step_runner.py" not in p.name:
            path, _, rest = p.name.split("trainer2/")[-1].partition("(")
            return f"{path}:{rest.partition(': ')[2] or rest}"
        p = p.cpu_parent
    return "?"


def step_ops(cfg: trainer2.TrainConfig, batch: int) -> Counter:
    """Kernel-running top-level operators of one batch step by issuing function."""
    data = load_data(cfg.section(DataConfig))
    step = make_step(cfg, data, batch, torch.device("cpu"))
    runner = StepRunner(step, log=print)
    feed = host_batches(data, batch, 4, 0)
    with torch.no_grad():
        for x, y in feed[:3]:
            runner.step(x, y)
        with profile(with_stack=True) as prof:
            runner.step(*feed[3])

    return Counter(issuer(e) for e in kernel_ops(prof.events()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="dev")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--window_backend", default="torch")
    p.add_argument("--update_backend", default="torch")
    p.add_argument("--readout_backend", default="torch")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    backends = {"window_backend": args.window_backend, "update_backend": args.update_backend}
    cfg = trainer2.config(args.preset, **backends, readout_backend=args.readout_backend)
    ops = step_ops(cfg, args.batch_size)
    by_file = Counter()
    for where, n in ops.items():
        by_file[where.partition(":")[0]] += n
    print(f"{args.preset} preset, batch {args.batch_size}: {sum(ops.values())} kernel-running operators a batch step")
    print("\nby file:")
    for where, n in by_file.most_common():
        print(f"{n:5d}  {where}")
    print("\nby function:")
    for where, n in ops.most_common():
        print(f"{n:5d}  {where}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
