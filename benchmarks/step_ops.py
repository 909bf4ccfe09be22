"""Where a batch step's operators come from: one profiled batch step (after warm-up) of a preset, its kernel-running
operators (what `bench` counts) grouped by the trainer2 function that issued them, so fusing them (issue 38: at most
30 kernels a batch step with the Triton window) knows where to start. Counts only, no timing; on the CPU, with the
torch window and update unless told otherwise.

    python -m benchmarks.step_ops --preset dev --batch_size 8 [--window_backend torch] [--update_backend torch]
        [--readout_backend torch]
    TRITON_INTERPRET=1 python -m benchmarks.step_ops --preset dev --batch_size 8 --window_backend triton \
        --update_backend triton --readout_backend triton --count dispatch

`--count dispatch` counts the same operators as torch dispatches them (a TorchDispatchMode), leaving out those the
Triton interpreter runs for its kernels (on a GPU each kernel is one launch, which the kernels' counters add), for the
interpreter, whose host work makes the profile's stacks too large to walk.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Callable

import torch
from torch.profiler import profile
from torch.utils._python_dispatch import TorchDispatchMode

import trainer2
from trainer2.data.load import DataConfig, load_data
from trainer2.learning.step import BatchStep
from trainer2.running.bench import NO_KERNEL, host_batches, kernel_ops, make_step, triton_launches
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


def warmed_up(cfg: trainer2.TrainConfig, batch: int) -> tuple[BatchStep, Callable[[], None]]:
    """A fresh batch step of the config's machine after three warm-up steps, and a call that runs one more."""
    data = load_data(cfg.section(DataConfig))
    step = make_step(cfg, data, batch, torch.device("cpu"))
    runner = StepRunner(step, log=print)
    feed = host_batches(data, batch, 4, 0)
    with torch.no_grad():
        for x, y in feed[:3]:
            runner.step(x, y)
    return step, lambda: runner.step(*feed[3])


def step_ops(cfg: trainer2.TrainConfig, batch: int) -> Counter:
    """Kernel-running top-level operators of one batch step by issuing function."""
    _, one_more = warmed_up(cfg, batch)
    with torch.no_grad(), profile(with_stack=True) as prof:
        one_more()

    return Counter(issuer(e) for e in kernel_ops(prof.events()))


class Dispatched(TorchDispatchMode):
    """Counts the kernel-running aten operators dispatched outside Triton's interpreter, by issuing function."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = "aten::" + func.__name__.split(".")[0]
        frame, where = sys._getframe(1), "?"
        while frame is not None:
            path = frame.f_code.co_filename
            if "triton/runtime/interpreter" in path or "triton/language" in path:  # the interpreter's own host work
                return func(*args, **(kwargs or {}))
            if where == "?" and "trainer2/" in path and "step_runner.py" not in path:
                where = f"{path.split('trainer2/')[-1]}:{frame.f_code.co_name}"
            frame = frame.f_back
        if name not in NO_KERNEL:
            self.ops[where] += 1
        return func(*args, **(kwargs or {}))


def dispatched_ops(cfg: trainer2.TrainConfig, batch: int) -> tuple[Counter, int]:
    """Kernel-running operators of one batch step outside the Triton kernels, by issuing function, and the Triton
    launches it made."""
    step, one_more = warmed_up(cfg, batch)
    before, counter = triton_launches(step), Dispatched()
    with torch.no_grad(), counter:
        one_more()
    return counter.ops, triton_launches(step) - before


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="dev")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--window_backend", default="torch")
    p.add_argument("--update_backend", default="torch")
    p.add_argument("--readout_backend", default="torch")
    p.add_argument("--count", choices=("profile", "dispatch"), default="profile", help="How to count (see above).")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    backends = {"window_backend": args.window_backend, "update_backend": args.update_backend}
    cfg = trainer2.config(args.preset, **backends, readout_backend=args.readout_backend)
    if args.count == "profile":
        ops, launches = step_ops(cfg, args.batch_size), None
    else:
        ops, launches = dispatched_ops(cfg, args.batch_size)
    by_file = Counter()
    for where, n in ops.items():
        by_file[where.partition(":")[0]] += n
    print(f"{args.preset} preset, batch {args.batch_size}: {sum(ops.values())} kernel-running operators a batch step")
    if launches is not None:
        print(f"and {launches} Triton launches: {sum(ops.values()) + launches} kernels a batch step on a GPU")
    print("\nby file:")
    for where, n in by_file.most_common():
        print(f"{n:5d}  {where}")
    print("\nby function:")
    for where, n in ops.most_common():
        print(f"{n:5d}  {where}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
