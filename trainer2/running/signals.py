"""A graceful stop on SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1 or SIGUSR2 (Ctrl-C, a scheduler's preemption, a
closed terminal, Ctrl-backslash, a cluster's warning before it preempts): the first signal asks the training loop to
stop after the current window, which then saves a checkpoint and the summary (with the command that continues the
run); a second one ends the process at once. `SignalStop` is the loop's callback; under torchrun the ranks agree on the
window to stop at."""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any, Protocol

import torch
from torch import Tensor

from trainer2.callbacks import Callback, LoopState, Stop

# SIGHUP: the terminal closed; SIGQUIT: Ctrl-backslash, whose default (a core dump) would lose the work since the last
# checkpoint; SIGUSR1 / SIGUSR2: what SLURM (--signal=USR1@90) and other schedulers send ahead of a preemption, whose
# default ends the process unsaved.
STOP_SIGNALS = tuple(
    getattr(signal, name)
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
    if hasattr(signal, name)
)


class StopSignals:
    """While active (in the main thread only), the first of STOP_SIGNALS sets `received` and nothing else:
    the handler prints nothing, since it may run in the middle of a print. The handlers then revert to the
    system default, so a second signal ends the process at once like an unhandled one: no traceback, and
    no torn checkpoint (saves are atomic; a killed save's temporary directory is removed at the next start).
    Signals the process ignores (SIG_IGN, as for a background job) stay ignored; on exit the previous
    handlers come back."""

    def __init__(self) -> None:
        self.received: signal.Signals | None = (
            None  # under torchrun, another rank's may be set here (Trainer.stop_asked)
        )
        self.previous: dict[signal.Signals, Any] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    previous = signal.signal(sig, self.handle)
                    self.previous[sig] = signal.SIG_DFL if previous is None else previous  # None: not set from Python
        return self

    def handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signal.Signals(signum)
        for sig in self.previous:
            signal.signal(sig, signal.SIG_DFL)

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}


def exit_code(sig: signal.Signals) -> int:
    """The shell's status for a process ended by `sig`: 128 + its number (130 for SIGINT, 143 for SIGTERM, 138 for
    SIGUSR1 on Linux)."""
    return 128 + int(sig)


class Ranks(Protocol):
    """The processes of a run, as the stop agreement sees them (trainer2.running.distributed.Distributed)."""

    launched: bool

    def all_reduce_sum(self, t: Tensor, what: str) -> None: ...


class SignalStop(Callback):
    """A callback that stops the loop after the window in which a stop signal arrived (`signals` is entered around
    the whole run by its owner). Under torchrun the ranks must stop at the same window: they agree at log intervals
    (one all-reduce), and a rank that got no signal takes another's."""

    def __init__(self, signals: StopSignals, ranks: Ranks, device: torch.device) -> None:
        self.signals, self.ranks, self.device = signals, ranks, device

    def on_window_end(self, state: LoopState) -> None:
        if state.stop is None and self.asked(state.logged):
            state.stop = Stop(signal=self.signals.received.name)

    def asked(self, logged: bool) -> bool:
        """Whether a stop signal ends the run after this window (the agreement runs at log intervals only)."""
        signals = self.signals
        if not self.ranks.launched:
            return signals.received is not None
        if not logged:
            return False
        got = torch.tensor([float(signals.received == sig) for sig in STOP_SIGNALS], device=self.device)
        self.ranks.all_reduce_sum(got, "the stop-signal exchange")
        agreed = bool(got.any())  # not this rank's flag: a signal may land here during the exchange (next interval's)
        if agreed and signals.received is None:
            signals.received = STOP_SIGNALS[int(got.argmax())]
        return agreed
