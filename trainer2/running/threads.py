"""CPU threads chosen by measurement (cpu_threads 0): every core while that is faster than one thread, one thread while
the machine is shared.

On an idle 2-core CPU a conv window runs 1.6x faster on both cores; when another process keeps one core busy, the
intra-op thread that shares its core stalls every parallel region and two threads run at about a third of one. So the
run times a few windows at each count, keeps the faster, and measures again every RECHECK_S seconds (the load changes).
A run whose thread count changes is not bitwise reproducible (a reduction split over more threads rounds differently);
give cpu_threads a number for bitwise runs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from trainer2.callbacks import Callback, LoopState

PROBE = 5  # windows timed at each thread count
RECHECK_S = 120.0  # seconds between measurements


class ThreadTuner(Callback):
    """A callback that switches between `cores` threads and one by the windows' measured time. Windows that logged
    (and maybe evaluated) are not timed, nor the run's first (compiling, warming up)."""

    def __init__(
        self,
        cores: int,
        set_threads: Callable[[int], None],
        log: Callable[[str], None],
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.cores, self.set_threads, self.log, self.clock = cores, set_threads, log, clock
        self.current = cores
        self.times: dict[int, list[float]] = {}  # seconds per window at each count, in the measurement under way
        self.last = 0.0  # when the last window ended
        self.next_check = 0.0  # when the next measurement starts (0: after the first window)
        self.first = 0
        self.reported: int | None = None  # the count the last note named

    def on_start(self, state: LoopState) -> None:
        self.first, self.last = state.window, self.clock()

    def on_window_end(self, state: LoopState) -> None:
        now = self.clock()
        took, self.last = now - self.last, now
        if state.logged or state.window == self.first + 1:
            return
        if not self.times and now < self.next_check:
            return
        self.times.setdefault(self.current, []).append(took)  # a measurement starts with the count in use
        if len(self.times[self.current]) < PROBE:
            return
        other = 1 if self.current == self.cores else self.cores
        if other not in self.times:
            self.switch(other)
            return
        best = min(self.times, key=lambda n: statistics.median(self.times[n]))
        if best != self.current:
            self.switch(best)
        self.report(best)
        self.times, self.next_check = {}, now + RECHECK_S

    def switch(self, threads: int) -> None:
        self.current = threads
        self.set_threads(threads)

    def report(self, chosen: int) -> None:
        """One line when the choice changes from the last one reported."""
        ratio = statistics.median(self.times[self.cores]) / statistics.median(self.times[1])
        if self.reported != chosen:
            what = f"{self.cores} threads run at {1 / ratio:.2f}x the windows/s of one"
            self.log(f"cpu threads: {chosen} ({what}; measured again every {RECHECK_S:.0f} s)")
        self.reported = chosen


def thread_tuners(cpu_threads: int, cores: int, device_type: str, log: Callable[[str], None]) -> list[ThreadTuner]:
    """The tuner a run needs: one where cpu_threads is 0 (every core) on a CPU with more than one core, else none."""
    if cpu_threads != 0 or cores < 2 or device_type != "cpu":
        return []
    return [ThreadTuner(cores, torch.set_num_threads, log)]
