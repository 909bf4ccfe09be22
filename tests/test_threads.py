"""cpu_threads 0: the run reads the load other processes put on its cores and times windows at every core and at
one thread; it runs one thread while the machine is shared, keeps the faster count while it is not, and measures
again as the load changes (a fake clock and fake CPU counters stand in for a machine that is idle, then shared)."""

from __future__ import annotations

import os

import pytest

from trainer2.callbacks import LoopState
from trainer2.running import threads
from trainer2.running.threads import PROBE, RECHECK_S, SPAN_S, CpuReading, ThreadTuner, others_busy, read_cpu


class FakeMachine:
    """A clock whose windows take `seconds[threads]` each, CPU counters in which other processes keep `others` cores
    busy, and the thread count the tuner sets."""

    def __init__(self, seconds: dict[int, float], others: float = 0.0) -> None:
        self.seconds, self.others, self.now, self.threads, self.calls = seconds, others, 0.0, 2, []
        self.busy = self.own = 0.0
        self.timed_at: list[int] = []  # the thread count of every window run

    def clock(self) -> float:
        return self.now

    def cpu(self) -> CpuReading:
        return CpuReading(self.now, self.busy, self.own)

    def set_threads(self, n: int) -> None:
        self.threads = n
        self.calls.append(n)

    def window(self) -> None:
        took = self.seconds[self.threads]
        self.now += took
        self.own += self.threads * took
        self.busy += (self.threads + self.others) * took
        self.timed_at.append(self.threads)


def tuner_on(machine: FakeMachine, said: list[str]) -> tuple[ThreadTuner, LoopState]:
    tuner = ThreadTuner(2, machine.set_threads, said.append, machine.clock, machine.cpu)
    state = LoopState(0, 10**6)
    tuner.on_start(state)
    return tuner, state


def run(tuner: ThreadTuner, machine: FakeMachine, windows: int, state: LoopState) -> None:
    for _ in range(windows):
        machine.window()
        state.window += 1
        state.logged = state.window % 10 == 0  # log windows are not timed
        tuner.on_window_end(state)


def test_a_shared_machine_runs_one_thread_without_timing_the_stall_and_every_core_once_it_is_idle_again():
    said: list[str] = []
    machine = FakeMachine({2: 0.3, 1: 0.1}, others=1.0)  # another process keeps a core busy: two threads stall
    tuner, state = tuner_on(machine, said)
    run(tuner, machine, 3 * PROBE, state)
    assert machine.calls == [1] and machine.timed_at.count(2) == 1  # only the warm-up window ran on both cores
    assert said == [f"cpu threads: 1 (other processes keep 1.0 of 2 cores busy; measured again every {RECHECK_S:g} s)"]
    machine.seconds, machine.others = {2: 0.06, 1: 0.1}, 0.0  # the other job ended: every core is 1.6x one thread
    run(tuner, machine, 20, state)
    assert machine.threads == 1  # nothing is measured again before RECHECK_S
    run(tuner, machine, int(RECHECK_S / 0.1) + 4 * PROBE, state)
    assert machine.threads == 2 and said[-1].startswith("cpu threads: 2 (2 threads run at 1.67x") and len(said) == 2
    machine.seconds, machine.others = {2: 0.3, 1: 0.1}, 1.0  # shared again
    on_two = machine.timed_at.count(2)
    run(tuner, machine, int(3 * RECHECK_S / 0.1), state)  # three measurements
    assert machine.threads == 1 and said[-1].startswith("cpu threads: 1 (other processes") and len(said) == 3
    assert machine.timed_at.count(2) - on_two <= int(RECHECK_S / 0.3) + PROBE + 2  # left at the first measurement


def test_the_load_while_the_run_is_built_decides_before_the_first_window():
    said: list[str] = []
    machine = FakeMachine({2: 0.3, 1: 0.1}, others=1.0)
    tuner = ThreadTuner(2, machine.set_threads, said.append, machine.clock, machine.cpu)
    machine.now += 2.0  # building the run: one core ours, the other the other process's
    machine.own, machine.busy = machine.own + 2.0, machine.busy + 4.0
    tuner.on_start(LoopState(0, 10**6))
    assert machine.calls == [1] and "keep 1.0 of 2 cores busy" in said[0]


def test_on_an_idle_machine_the_faster_count_is_kept_and_said_once():
    said: list[str] = []
    machine = FakeMachine({2: 0.06, 1: 0.1})
    tuner, state = tuner_on(machine, said)
    run(tuner, machine, 3 * PROBE + int(3 * RECHECK_S / 0.06), state)
    assert machine.threads == 2 and len(said) == 1 and "2 threads run at 1.67x" in said[0]
    assert 3 * PROBE <= machine.timed_at.count(1) <= 3 * (PROBE + 1)  # each measurement timed one thread too


def test_a_machine_whose_load_cannot_be_read_is_timed():
    """No /proc/stat (not Linux): two threads that stall are measured and left."""
    said: list[str] = []
    machine = FakeMachine({2: 0.3, 1: 0.1}, others=1.0)
    tuner = ThreadTuner(2, machine.set_threads, said.append, machine.clock, lambda: None)
    state = LoopState(0, 10**6)
    tuner.on_start(state)
    run(tuner, machine, 3 * PROBE, state)
    assert machine.calls == [1] and machine.timed_at.count(2) == 1 + PROBE and "2 threads run at 0.33x" in said[0]


def test_the_load_is_judged_only_over_a_long_enough_span():
    before = CpuReading(wall=10.0, busy=100.0, own=50.0)
    assert others_busy(before, CpuReading(10.0 + SPAN_S / 2, 100.2, 50.0)) is None  # ticks too coarse to tell
    assert others_busy(before, CpuReading(12.0, 104.0, 52.0)) == pytest.approx(1.0)  # 4 CPU s, 2 of them ours
    assert others_busy(before, CpuReading(12.0, 101.9, 52.0)) == 0.0  # tick rounding never goes below zero


def test_read_cpu_counts_the_cores_this_process_may_use(tmp_path):
    stat = tmp_path / "stat"
    rows = [f"cpu{n} 100 10 50 9000 7 3 2 40 0 0" for n in range(300)]  # 165 ticks of work on each core
    stat.write_text("cpu  1 2 3 4 5 6 7 8 0 0\n" + "\n".join(rows) + "\nintr 12345\nctxt 99\n")
    reading = read_cpu(stat)
    mine = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 300
    assert reading is not None and reading.busy == pytest.approx(165 * mine / os.sysconf("SC_CLK_TCK"))
    assert read_cpu(tmp_path / "missing") is None
    stat.write_text("cpu  1 2 3\n\ncpu0 1 2 3\n")  # fields this reader does not know
    assert read_cpu(stat) is None


def test_only_cpu_threads_0_on_a_cpu_with_several_cores_is_tuned():
    assert threads.thread_tuners(0, 2, "cpu", print) and not threads.thread_tuners(1, 2, "cpu", print)
    assert not threads.thread_tuners(0, 1, "cpu", print) and not threads.thread_tuners(0, 2, "cuda", print)
