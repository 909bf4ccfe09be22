"""CPU threads chosen by measurement (cpu_threads 0): every core while that is faster than one thread, one thread while
the machine is shared.

On an idle 2-core CPU a conv window runs 1.6x faster on both cores; when another process keeps one core busy, the
intra-op thread that shares its core stalls every parallel region and two threads run at about a third of one. So the
run reads how busy other processes keep its cores (Linux's /proc/stat, less this process's own CPU time): while
they keep a quarter of a core or more busy it runs one thread, without timing the stall. Otherwise it times a few
windows at each count and keeps the faster. It measures again every RECHECK_S seconds (the load changes). A run whose
thread count changes is not bitwise reproducible (a reduction split over more threads rounds differently); give
cpu_threads a number for bitwise runs.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer2.callbacks import Callback, LoopState

PROBE = 5  # windows timed at each thread count
RECHECK_S = 120.0  # seconds between measurements
SHARED = 0.25  # cores kept busy by other processes from which the machine counts as shared
SPAN_S = 0.25  # the shortest time a load reading is judged over (/proc/stat counts in 10 ms ticks)


@dataclass(frozen=True)
class CpuReading:
    """Cumulative seconds at one moment: wall clock, CPU time on the cores this process may use (all processes), and
    this process's own CPU time (all its threads)."""

    wall: float
    busy: float
    own: float


def read_cpu(stat: Path = Path("/proc/stat")) -> CpuReading | None:
    """The CPU counters now, or None where the kernel does not expose them (not Linux)."""
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return None
    mine = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    ticks = 0
    for line in lines:
        name, *fields = line.split() or [""]
        if not (name.startswith("cpu") and name[3:].isdigit()) or (mine is not None and int(name[3:]) not in mine):
            continue
        if len(fields) < 7 or not all(f.isdigit() for f in fields[:7]):
            return None  # a layout this reader does not know: the run falls back to timing
        user, nice, system, _idle, _iowait, irq, softirq = (int(f) for f in fields[:7])
        ticks += user + nice + system + irq + softirq  # steal and idle are nobody's work on these cores
    return CpuReading(time.perf_counter(), ticks / os.sysconf("SC_CLK_TCK"), time.process_time())


def others_busy(before: CpuReading, after: CpuReading) -> float | None:
    """Cores other processes kept busy between two readings; None when they are under SPAN_S apart."""
    wall = after.wall - before.wall
    if wall < SPAN_S:
        return None
    return max(0.0, (after.busy - before.busy) - (after.own - before.own)) / wall


class ThreadTuner(Callback):
    """A callback that switches between `cores` threads and one by the load other processes put on the cores and
    the windows' measured time. Windows that logged (and maybe evaluated) are not timed, nor the run's first."""

    def __init__(
        self,
        cores: int,
        set_threads: Callable[[int], None],
        log: Callable[[str], None],
        clock: Callable[[], float] = time.perf_counter,
        cpu: Callable[[], CpuReading | None] = read_cpu,
    ) -> None:
        self.cores, self.set_threads, self.log, self.clock, self.cpu = cores, set_threads, log, clock, cpu
        self.current = cores
        self.times: dict[int, list[float]] = {}  # seconds per window at each count, in the measurement under way
        self.measuring = True  # the first measurement starts as the run is built
        self.since = cpu()  # the CPU counters where the measurement under way started
        self.last = 0.0  # when the last window ended
        self.next_check = 0.0  # when the next measurement starts
        self.first = 0
        self.reported: int | None = None  # the count the last note named

    def on_start(self, state: LoopState) -> None:
        """The load while the run was built decides before any window runs on a shared machine."""
        self.first, self.last = state.window, self.clock()
        self.settle_if_shared(self.last)

    def on_window_end(self, state: LoopState) -> None:
        now = self.clock()
        took, self.last = now - self.last, now
        if not self.measuring:
            if now >= self.next_check:  # the measurement starts with the next window
                self.measuring, self.since = True, self.cpu()
            return
        if state.window == self.first + 1:  # warming up: not timed, but the load beside it tells
            self.settle_if_shared(now)
            return
        if state.logged:
            return
        self.times.setdefault(self.current, []).append(took)  # a measurement starts with the count in use
        if len(self.times[self.current]) < PROBE:
            return
        if self.settle_if_shared(now):
            return
        other = 1 if self.current == self.cores else self.cores
        if other not in self.times:
            self.switch(other)
            return
        self.settle(min(self.times, key=lambda n: statistics.median(self.times[n])), now)

    def settle_if_shared(self, now: float) -> bool:
        """One thread until the next measurement when other processes kept SHARED cores or more busy since the
        measurement began; whether they did."""
        reading = self.cpu()
        busy = None if reading is None or self.since is None else others_busy(self.since, reading)
        if busy is None or busy < SHARED:
            return False
        self.settle(1, now, busy)
        return True

    def settle(self, threads: int, now: float, busy: float | None = None) -> None:
        """Run at `threads` until the next measurement, and say why when the choice changes (`busy`: the cores
        other processes kept busy, when that decided)."""
        if busy is not None:
            why = f"other processes keep {busy:.1f} of {self.cores} cores busy"
        else:
            ratio = statistics.median(self.times[1]) / statistics.median(self.times[self.cores])
            why = f"{self.cores} threads run at {ratio:.2f}x the windows/s of one"
        if threads != self.current:
            self.switch(threads)
        if self.reported != threads:
            self.log(f"cpu threads: {threads} ({why}; measured again every {RECHECK_S:.0f} s)")
        self.reported = threads
        self.times, self.measuring, self.next_check = {}, False, now + RECHECK_S

    def switch(self, threads: int) -> None:
        self.current = threads
        self.set_threads(threads)


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity; all of them where the OS does not say)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def warn_oversubscribed(cpu_threads: int, log: Callable[[str], None], cores: int | None = None) -> None:
    """Warn (once per run: the run calls this as it is built) when cpu_threads asks for more threads than the cores
    this process may use: the extra threads share cores and stall each other's parallel regions."""
    cores = usable_cores() if cores is None else cores
    if cpu_threads > cores:
        log(
            f"warning: cpu_threads {cpu_threads} is more than the {cores} core(s) this process may use: the threads "
            f"oversubscribe them and stall one another; give cpu_threads {cores} or less, or 0 (measured: every core "
            "while that is faster than one thread, one while the machine is shared)"
        )


def thread_tuners(cpu_threads: int, cores: int, device_type: str, log: Callable[[str], None]) -> list[ThreadTuner]:
    """The tuner a run needs: one where cpu_threads is 0 (every core) on a CPU with more than one core, else none;
    a cpu_threads above the cores this process may use is warned about here."""
    warn_oversubscribed(cpu_threads, log)
    if cpu_threads != 0 or cores < 2 or device_type != "cpu":
        return []
    return [ThreadTuner(cores, torch.set_num_threads, log)]
