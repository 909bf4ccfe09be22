"""Callbacks: what runs beside the training loop at a few fixed points (Lightning's callbacks, in miniature).

Per run the loop calls `on_start`; per window `on_window_start`, then at a log interval `on_metrics` (the synced
metrics, before any evaluation) and `on_log` (the full row), then `on_window_end`; and `on_end` once, also when a
window fails. A callback asks the loop to stop by setting `state.stop`. Each callback is built once, with the parts it
works on, and the list never changes during a run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Stop:
    """Why a run ends before its last window: a stop signal's name, a divergence (what happened, and the last
    window whose checkpoint is still good), or a callback's own reason (a sweep's pruner: "pruned"). A stop for a
    signal or a reason saves a checkpoint and ends the run with summary["interrupted"] naming it."""

    signal: str | None = None
    diverged: tuple[str, int] | None = None
    reason: str | None = None


@dataclass
class LoopState:
    """What the loop tells its callbacks: windows done, the run's length, whether this window logged metrics, whether
    the step is compiled or captured (its first window then includes compiling), and the stop asked for, if any."""

    window: int
    total: int
    eager: bool = True
    logged: bool = False
    stop: Stop | None = None

    @property
    def done(self) -> bool:
        return self.window >= self.total


class Callback:
    """The hooks, each doing nothing here: a callback overrides the ones it needs."""

    def on_start(self, state: LoopState) -> None:
        """Before the first window of this run (or of this resumed run)."""

    def on_window_start(self, state: LoopState) -> None:
        """Before window state.window + 1 runs."""

    def on_metrics(self, state: LoopState, row: dict[str, Any]) -> None:
        """At a log interval: the synced training metrics, before any evaluation."""

    def on_log(self, state: LoopState, row: dict[str, Any]) -> None:
        """At a log interval: the whole row (with held-out figures at an evaluation), as telemetry records it."""

    def on_window_end(self, state: LoopState) -> None:
        """After window state.window has run (and logged, when state.logged)."""

    def on_end(self, state: LoopState) -> None:
        """Once, after the last window, also when a window failed."""


@dataclass(frozen=True)
class Callbacks:
    """The run's callbacks, called in their order at every hook."""

    members: tuple[Callback, ...]

    def start(self, state: LoopState) -> None:
        for c in self.members:
            c.on_start(state)

    def window_start(self, state: LoopState) -> None:
        for c in self.members:
            c.on_window_start(state)

    def metrics(self, state: LoopState, row: dict[str, Any]) -> None:
        for c in self.members:
            c.on_metrics(state, row)

    def log(self, state: LoopState, row: dict[str, Any]) -> None:
        for c in self.members:
            c.on_log(state, row)

    def window_end(self, state: LoopState) -> None:
        for c in self.members:
            c.on_window_end(state)

    def end(self, state: LoopState) -> None:
        """Every callback's on_end, even when one of them fails (the first failure is raised after the rest ran)."""
        failure: BaseException | None = None
        for c in self.members:
            try:
                c.on_end(state)
            except BaseException as e:  # noqa: BLE001 - re-raised below, after the others have closed
                failure = failure or e
        if failure is not None:
            raise failure
