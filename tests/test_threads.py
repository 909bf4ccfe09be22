"""cpu_threads 0: the run measures windows at every core and at one thread, keeps the faster and measures again as
the load changes (a fake clock stands in for a machine that is idle, then shared)."""

from __future__ import annotations

from trainer2.callbacks import LoopState
from trainer2.running import threads
from trainer2.running.threads import PROBE, RECHECK_S, ThreadTuner


class FakeMachine:
    """A clock whose windows take `seconds[threads]` each, and the thread count the tuner sets."""

    def __init__(self, seconds: dict[int, float]) -> None:
        self.seconds, self.now, self.threads, self.calls = seconds, 0.0, 2, []

    def clock(self) -> float:
        return self.now

    def set_threads(self, n: int) -> None:
        self.threads = n
        self.calls.append(n)

    def window(self) -> None:
        self.now += self.seconds[self.threads]


def run(tuner: ThreadTuner, machine: FakeMachine, windows: int, state: LoopState) -> None:
    for _ in range(windows):
        machine.window()
        state.window += 1
        state.logged = state.window % 10 == 0  # log windows are not timed
        tuner.on_window_end(state)


def test_one_thread_is_kept_while_the_machine_is_shared_and_every_core_once_it_is_idle_again(monkeypatch):
    said: list[str] = []
    machine = FakeMachine({2: 0.3, 1: 0.1})  # shared: two threads stall
    tuner = ThreadTuner(2, machine.set_threads, said.append, machine.clock)
    state = LoopState(0, 10**6)
    tuner.on_start(state)
    run(tuner, machine, 3 * PROBE, state)
    assert machine.threads == 1 and machine.calls == [1] and "cpu threads: 1" in said[-1]
    machine.seconds = {2: 0.06, 1: 0.1}  # the other job ended: every core is 1.6x one thread
    run(tuner, machine, 20, state)
    assert machine.threads == 1  # nothing is measured again before RECHECK_S
    run(tuner, machine, int(RECHECK_S / 0.1) + 4 * PROBE, state)
    assert machine.threads == 2 and "cpu threads: 2" in said[-1] and len(said) == 2


def test_an_idle_machine_keeps_every_core_and_says_so_once(monkeypatch):
    said: list[str] = []
    machine = FakeMachine({2: 0.06, 1: 0.1})
    tuner = ThreadTuner(2, machine.set_threads, said.append, machine.clock)
    state = LoopState(0, 10**6)
    tuner.on_start(state)
    run(tuner, machine, 3 * PROBE + int(3 * RECHECK_S / 0.06), state)
    assert machine.threads == 2 and len(said) == 1 and "2 threads run at 1.67x" in said[0]


def test_only_cpu_threads_0_on_a_cpu_with_several_cores_is_tuned():
    assert threads.thread_tuners(0, 2, "cpu", print) and not threads.thread_tuners(1, 2, "cpu", print)
    assert not threads.thread_tuners(0, 1, "cpu", print) and not threads.thread_tuners(0, 2, "cuda", print)
