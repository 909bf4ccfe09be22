"""Where the time goes: per-phase timing of each window (`PhaseTimer`) and a torch.profiler trace of a few
windows after warm-up (`WindowProfiler`)."""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from trainer2.io.safeio import refuse_links

PHASES = (
    "data",
    "free",
    "nudged",
    "update",
    "logging",
)  # "step" replaces free/nudged/update when the step is one replay
TOP_OPS_ROWS = 30


@contextmanager
def drop_kineto_markers() -> Iterator[None]:
    """Around a profiler's start or stop: drop the `USDT:... profiler_start|profiler_stop` lines that the profiler's
    backend (kineto) writes to stderr. They carry kineto's highest log level, so only KINETO_LOG_LEVEL=6 hides them,
    and it would hide kineto's errors too; here every other line written to fd 2 meanwhile is passed on."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no stderr to filter
        yield
        return
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = b"".join(line for line in tmp.read().splitlines(keepends=True) if not line.startswith(b"USDT:"))
            if kept:
                os.write(2, kept)


class PhaseTimer:
    """Times named phases: CUDA events on a GPU (read once, at `collect`), perf_counter on the CPU.

    `phase(name)` also opens a profiler range `phase/<name>` while `label` is on (set during profiling)."""

    def __init__(self, device: torch.device, timing: bool) -> None:
        self.cuda = device.type == "cuda"
        self.timing = timing
        self.label = False
        self.totals_ms: dict[str, float] = {}  # by phase, in the order first seen
        self.pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        with torch.profiler.record_function(f"phase/{name}") if self.label else nullcontext():
            if not self.timing:
                yield
            elif self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                yield
                end.record()
                self.pending.append((name, start, end))
            else:
                t0 = time.perf_counter()
                yield
                self.totals_ms[name] = self.totals_ms.get(name, 0.0) + 1e3 * (time.perf_counter() - t0)

    def collect(self, windows: int) -> dict[str, float]:
        """Mean ms per window of each phase since the last collect, as time_<phase>_ms; then reset.

        On CUDA this waits for the last recorded event: call it where the host syncs anyway (log time)."""
        if self.pending:
            self.pending[-1][2].synchronize()
        for name, start, end in self.pending:
            self.totals_ms[name] = self.totals_ms.get(name, 0.0) + start.elapsed_time(end)
        self.pending.clear()
        out = {f"time_{k}_ms": v / max(windows, 1) for k, v in self.totals_ms.items()}
        self.totals_ms = dict.fromkeys(self.totals_ms, 0.0)
        return out


def timing_table(window: int, times: dict[str, float]) -> str:
    """Three aligned lines: phase names, ms per window, share of the total in percent."""
    names = [k.removeprefix("time_").removesuffix("_ms") for k in times]
    ms = list(times.values())
    total = sum(ms)
    cols = [(n, f"{v:.3f}", f"{100 * v / total:.1f}" if total > 0 else "-") for n, v in zip(names, ms)]
    cols.append(("total", f"{total:.3f}", "100.0" if total > 0 else "-"))
    width = [max(len(c) for c in col) for col in cols]
    lines = [f"timing @ window {window}"]
    for i, label in enumerate(("phase", "ms/window", "%")):
        lines.append(label.ljust(10) + "  ".join(col[i].rjust(w) for col, w in zip(cols, width)))
    return "\n".join(lines)


class WindowProfiler:
    """A torch.profiler trace of windows [start, start + windows), with every phase labelled by the timer.

    Writes <run_dir>/profile_trace.json (Chrome trace: chrome://tracing or ui.perfetto.dev) and
    <run_dir>/profile_top_ops.txt (operators by self device time on CUDA, and by self CPU time)."""

    def __init__(self, run_dir: Path, start: int, windows: int, device: torch.device, timer: PhaseTimer) -> None:
        self.run_dir, self.start, self.stop = run_dir, start, start + windows
        self.cuda = device.type == "cuda"
        self.timer = timer
        self.prof: torch.profiler.profile | None = None
        self.done = windows == 0

    def before_window(self, window: int) -> None:
        """Called before window `window` (0-based) runs."""
        if self.done or self.prof is not None or window < self.start:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(activities=activities)
        with drop_kineto_markers():
            self.prof.__enter__()
        self.timer.label = True

    def after_window(self, windows_done: int) -> list[Path]:
        """Called after a window and its logging; ends the trace once `windows` windows are in it."""
        if self.prof is None or windows_done < self.stop:
            return []
        return self.finish()

    def finish(self) -> list[Path]:
        """Stop (also when the run ends early) and write the trace and the operator table; returns their paths."""
        if self.prof is None:
            return []
        if self.cuda:
            torch.cuda.synchronize()
        with drop_kineto_markers():
            self.prof.__exit__(None, None, None)
        self.timer.label = False
        self.run_dir.mkdir(parents=True, exist_ok=True)
        trace, table = self.run_dir / "profile_trace.json", self.run_dir / "profile_top_ops.txt"
        refuse_links(trace, table)  # both are written in place: a planted link would carry them elsewhere
        self.prof.export_chrome_trace(str(trace))
        avg = self.prof.key_averages()
        parts = []
        if self.cuda:
            parts.append(
                "top operators by self device time\n"
                + avg.table(sort_by="self_device_time_total", row_limit=TOP_OPS_ROWS)
            )
        parts.append(
            "top operators by self CPU time\n" + avg.table(sort_by="self_cpu_time_total", row_limit=TOP_OPS_ROWS)
        )
        table.write_text("\n\n".join(parts) + "\n")
        self.prof, self.done = None, True
        return [trace, table]
