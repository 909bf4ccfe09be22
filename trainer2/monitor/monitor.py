"""`Monitor`, the callback that observes a run: phase timing and the profiler's trace, CUDA cache cleanup, progress
inside a window, and the record of every log row in telemetry.jsonl (and TensorBoard)."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from trainer2.callbacks import Callback, LoopState
from trainer2.monitor.profiling import PhaseTimer, WindowProfiler, timing_table
from trainer2.monitor.progress import ProgressBar
from trainer2.monitor.telemetry import Telemetry, residual_line
from trainer2.monitor.tensorboard import TensorBoardLog
from trainer2.physics.relaxation import Relaxation
from trainer2.train_config import TrainConfig

MIB = 2**20


def memory_mib(device: torch.device) -> tuple[float | None, float | None]:
    """(allocated, reserved) CUDA memory in MiB from the allocator's host-side counters (no sync); None on CPU."""
    if device.type != "cuda":
        return None, None
    return torch.cuda.memory_allocated(device) / MIB, torch.cuda.memory_reserved(device) / MIB


def should_cleanup(allocated: float, reserved: float, threshold: float) -> bool:
    """The cache-cleanup rule: empty the cache when allocated / reserved exceeds `threshold`."""
    return reserved > 0 and allocated / reserved > threshold


@dataclass
class CacheCleaner:
    """Every `every` windows, checks the rule and empties the cache when it holds; counts how often it fired."""

    every: int
    threshold: float
    stats: Callable[[], tuple[float, float]]  # (allocated, reserved), any common unit
    empty: Callable[[], None]
    fired: int = 0

    @staticmethod
    def for_device(cfg: TrainConfig, device: torch.device) -> "CacheCleaner | None":
        """A cleaner for the CUDA caching allocator, or None on CPU (nothing to clean)."""
        if device.type != "cuda":
            return None
        return CacheCleaner(
            cfg.cleanup_every,
            cfg.cleanup_threshold,
            lambda: (torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)),
            torch.cuda.empty_cache,
        )

    def after_window(self, windows_done: int) -> bool:
        if windows_done % self.every or not should_cleanup(*self.stats(), self.threshold):
            return False
        self.empty()
        self.fired += 1
        return True


@dataclass
class StepReporter:
    """Progress inside a window on the bar's description, refreshed at most once per bar.mininterval."""

    bar: tqdm
    desc: str
    last: float = field(default_factory=time.monotonic)

    def __call__(self, phase: str, step: int, steps: int, spd_last: float, lior: float) -> None:
        self.bar.set_description_str(
            f"{self.desc} [{phase} {step}/{steps} spd {spd_last:.2g} lior {lior:.3g}]", refresh=False
        )
        now = time.monotonic()
        if now - self.last >= self.bar.mininterval:
            self.bar.refresh()
            self.last = now


class Monitor(Callback):
    """Observability of one run, a callback of the training loop: phase timing, profiler, cache cleanup, step progress
    (on the bar), and the telemetry file and TensorBoard. The loop also times its phases through `phase(name)`.
    writes=False (ranks other than 0 under torchrun): no telemetry file, config file, timing table or trace."""

    def __init__(
        self,
        cfg: TrainConfig,
        device: torch.device,
        run_dir: Path,
        eager: bool,
        relax: Relaxation,
        bar: ProgressBar,
        log: Callable[[str], None] = print,
        writes: bool = True,
    ) -> None:
        self.cfg, self.device, self.run_dir, self.eager, self.log, self.writes = (
            cfg,
            device,
            run_dir,
            eager,
            log,
            writes,
        )
        self.relax, self.bar = relax, bar
        self.timer = PhaseTimer(device, cfg.timing_debug)
        self.profiler = WindowProfiler(run_dir, 0, 0, device, self.timer)  # armed by on_start
        self.cleaner = CacheCleaner.for_device(cfg, device)
        self.telemetry: Telemetry | None = None
        self.board: TensorBoardLog | None = None  # --tensorboard
        self.last_window = 0  # window of the last record: timings are averaged over the windows since

    def on_start(self, state: LoopState) -> None:
        """Hook the timer and step progress into the relaxation (after the bar's on_start), write config.yaml and
        open telemetry.jsonl for appending at state.window (a resume first cuts the rows past it, see `trim`)."""
        self.attach(self.relax, self.bar.bar, self.cfg.run_name)
        window = state.window
        self.board = (
            TensorBoardLog(self.run_dir, window) if self.cfg.tensorboard and self.writes else None
        )  # first: a missing package writes nothing
        self.telemetry = Telemetry(self.run_dir, self.cfg, window if window > 0 else None) if self.writes else None
        self.last_window = window
        skip = self.cfg.warmup_steps + 2  # past warm-up (and graph capture), so the trace shows steady windows
        count = self.cfg.profile_windows if self.writes else 0
        self.profiler = WindowProfiler(self.run_dir, window + skip, count, self.device, self.timer)

    def attach(self, relax: Relaxation, bar: tqdm, desc: str) -> None:
        """Hook the timer's phases and step progress into the relaxation when the step runs eagerly; a captured
        or compiled step is timed as a whole ("step") instead, since events and host reads cannot go inside.
        A disabled bar (TQDM_DISABLE=1) shows nothing, so no step progress is read back for it."""
        if self.eager and (self.cfg.timing_debug or self.cfg.profile_windows):
            relax.phase = self.timer.phase
        if self.cfg.step_progress_every and not bar.disable:
            if self.eager:
                relax.progress_every, relax.on_steps = self.cfg.step_progress_every, StepReporter(bar, desc)
            else:
                self.log(
                    "note: step_progress_every: graph-compiled windows run whole, "
                    "so progress is reported at window boundaries only"
                )

    def phase(self, name: str) -> AbstractContextManager[None]:
        return self.timer.phase(name)

    def step_phase(self) -> AbstractContextManager[None]:
        """Around the whole batch step: the "step" phase when it is one replay, else nothing (the learner's phases
        time it)."""
        return nullcontext() if self.eager else self.timer.phase("step")

    def on_window_start(self, state: LoopState) -> None:
        self.profiler.before_window(state.window)

    def on_log(self, state: LoopState, row: dict[str, Any]) -> None:
        """Add memory, cleanup count and phase timings to a log row, write it, print the timing table."""
        row["mem_allocated_mib"], row["mem_reserved_mib"] = memory_mib(self.device)
        row["cache_cleanups"] = self.cleaner.fired if self.cleaner is not None else 0
        window = int(row["window"])
        if self.cfg.timing_debug:
            row.update(self.timer.collect(window - self.last_window))
        self.last_window = window
        with self.phase("logging"):  # the write and print count towards the next interval's logging
            if self.telemetry is not None:
                self.telemetry.write(row)
            if self.board is not None:
                self.board.write(row)
            if self.cfg.timing_debug and self.writes:
                tqdm.write(timing_table(window, {k: v for k, v in row.items() if k.startswith("time_")}))
                tqdm.write(residual_line(row, self.cfg.eps))

    def on_window_end(self, state: LoopState) -> None:
        if self.cleaner is not None:
            self.cleaner.after_window(state.window)
        for path in self.profiler.after_window(state.window):
            tqdm.write(f"profile: wrote {path}")

    def on_end(self, state: LoopState) -> None:
        for path in self.profiler.finish():
            tqdm.write(f"profile: wrote {path}")
        if not self.profiler.done:
            self.log(
                f"note: profile_windows: the run ended before window {self.profiler.start + 1}, where the "
                "profiler starts (after warm-up); no trace was written"
            )
        if self.telemetry is not None:
            self.telemetry.close()
            self.telemetry = None
        if self.board is not None:
            self.board.close()
            self.board = None
