"""A run's record: <run_dir>/telemetry.jsonl (one JSON line per log interval) and config.yaml; CUDA cache
cleanup; progress inside a window; and `Monitor`, which the trainer calls at a few fixed points of its loop."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from trainer2.config import TrainConfig, to_yaml
from trainer2.io.profiling import PhaseTimer, WindowProfiler, timing_table
from trainer2.io.safeio import link_refused, nofollow_open, write_replace
from trainer2.io.tensorboard import TensorBoardLog
from trainer2.physics.relaxation import Relaxation

TELEMETRY_FILE = "telemetry.jsonl"
CONFIG_FILE = "config.yaml"
MIB = 2**20


class TelemetryError(ValueError):
    """A telemetry file that cannot be read; the message names the file and line."""


def _finite(v: Any) -> Any:
    """NaN and inf are not JSON; they become null."""
    return None if isinstance(v, float) and not math.isfinite(v) else v


def residual_line(row: dict[str, Any], eps: float) -> str:
    """Each phase's convergence residual over a log interval: its spd at the last step relative to the floor
    sqrt(eps) (1.00x when settled)."""
    floor = math.sqrt(eps)
    free, nudged = row["spd_last"] / floor, row["spd_last_nudge"] / floor
    return f"residual at the last step, spd / sqrt(eps): free {free:.3f}x, nudged {nudged:.3f}x"


class Telemetry:
    """Appends one JSON object per line to <run_dir>/telemetry.jsonl (append: a resumed run continues the file).

    Each line goes out in one unbuffered write, then fsync, so a killed run leaves whole lines only; a full disk
    may still tear the last one, which `trim` (on resume) and `read_telemetry` drop."""

    def __init__(self, run_dir: Path, cfg: TrainConfig, resume_window: int | None = None) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_replace(run_dir / CONFIG_FILE, to_yaml(cfg).encode("utf-8"))
        self.path = run_dir / TELEMETRY_FILE
        trim(self.path, resume_window)
        self.file = open(self.path, "ab", buffering=0, opener=nofollow_open)

    def write(self, row: dict[str, Any]) -> None:
        data = (json.dumps({k: _finite(v) for k, v in row.items()}, allow_nan=False) + "\n").encode()
        view = memoryview(data)
        try:
            while view:  # a raw write may be short in principle; the loop finishes the line
                view = view[self.file.write(view) :]
            os.fsync(self.file.fileno())
        except OSError as e:  # disk full, quota: name the file, which a raw write's error does not
            raise OSError(e.errno, e.strerror, str(self.path)) from None

    def close(self) -> None:
        self.file.close()


def trim(path: Path, resume_window: int | None) -> int:
    """Cut a telemetry file back before appending: drop a torn last line, and on resume at `resume_window` the
    rows past it (a killed run logged them after its last checkpoint; the resumed run logs them again).
    Returns the bytes cut."""
    if path.is_symlink():
        raise link_refused(path)
    if not path.is_file():
        return 0
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1  # whole lines only
    if resume_window is not None:
        pos = 0
        while pos < keep:
            end = data.index(b"\n", pos) + 1
            try:
                row = json.loads(data[pos:end])
            except (json.JSONDecodeError, UnicodeDecodeError):
                row = None  # not ours to judge: read_telemetry names it
            if isinstance(row, dict) and isinstance(row.get("window"), int) and row["window"] > resume_window:
                keep = pos
                break
            pos = end
    if keep < len(data):
        with open(path, "r+b", opener=nofollow_open) as f:
            f.truncate(keep)
            os.fsync(f.fileno())
    return len(data) - keep


def read_telemetry(path: Path) -> list[dict[str, Any]]:
    """Every row of a telemetry.jsonl; an unterminated last line (a torn write) is skipped, any other bad line
    refused."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TelemetryError(f"{path}: no such file; expected the telemetry.jsonl a training run writes") from None
    lines = text.split("\n")
    rows = []
    for i, line in enumerate(lines[:-1], 1):  # lines[-1] is "" after a final newline, else a torn line
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise TelemetryError(
                f"{path}: line {i} is not valid JSON ({e.msg}); expected one JSON object per line"
            ) from None
        if not isinstance(row, dict):
            raise TelemetryError(f"{path}: line {i} is a {type(row).__name__}, expected a JSON object")
        rows.append(row)
    return rows


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


class Monitor:
    """Observability of one run: phase timing, profiler, cache cleanup, step progress and the telemetry file.

    The trainer calls: start, before_window, phase(name), record(row) at each log interval, after_window, close.
    writes=False (ranks other than 0 under torchrun): no telemetry file, config file, timing table or trace."""

    def __init__(
        self,
        cfg: TrainConfig,
        device: torch.device,
        run_dir: Path,
        eager: bool,
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
        self.timer = PhaseTimer(device, cfg.timing_debug)
        self.profiler = WindowProfiler(run_dir, 0, 0, device, self.timer)  # armed by start()
        self.cleaner = CacheCleaner.for_device(cfg, device)
        self.telemetry: Telemetry | None = None
        self.board: TensorBoardLog | None = None  # --tensorboard
        self.last_window = 0  # window of the last record: timings are averaged over the windows since

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

    def start(self, window: int) -> None:
        """Write config.yaml and open telemetry.jsonl for appending; `window` is where the run starts (a resume
        first cuts the rows past it, see `trim`)."""
        self.board = (
            TensorBoardLog(self.run_dir, window) if self.cfg.tensorboard and self.writes else None
        )  # first: a missing package writes nothing
        self.telemetry = Telemetry(self.run_dir, self.cfg, window if window > 0 else None) if self.writes else None
        self.last_window = window
        skip = self.cfg.warmup_steps + 2  # past warm-up (and graph capture), so the trace shows steady windows
        count = self.cfg.profile_windows if self.writes else 0
        self.profiler = WindowProfiler(self.run_dir, window + skip, count, self.device, self.timer)

    def phase(self, name: str) -> AbstractContextManager[None]:
        return self.timer.phase(name)

    def step_phase(self) -> AbstractContextManager[None]:
        """Around the whole batch step: the "step" phase when it is one replay, else nothing (the learner's phases
        time it)."""
        return nullcontext() if self.eager else self.timer.phase("step")

    def before_window(self, window: int) -> None:
        self.profiler.before_window(window)

    def after_window(self, windows_done: int) -> None:
        if self.cleaner is not None:
            self.cleaner.after_window(windows_done)
        for path in self.profiler.after_window(windows_done):
            tqdm.write(f"profile: wrote {path}")

    def record(self, row: dict[str, Any]) -> None:
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

    def close(self) -> None:
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
