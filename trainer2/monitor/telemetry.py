"""A run's record: <run_dir>/telemetry.jsonl (one JSON line per log interval) and config.yaml; written by the
Monitor (trainer2/monitor/monitor.py), read back by plot and on resume."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from trainer2.io.safeio import link_refused, nofollow_open, open_regular, write_replace
from trainer2.train_config import TrainConfig, to_yaml

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
    refused. Only a regular file is opened (a FIFO would block plot forever)."""
    try:
        with open_regular(path) as f:
            text = f.read().decode("utf-8")
    except FileNotFoundError:
        raise TelemetryError(f"{path}: no such file; expected the telemetry.jsonl a training run writes") from None
    except OSError as e:
        raise TelemetryError(f"{path}: {e.strerror}; expected the telemetry.jsonl a training run writes") from None
    except UnicodeDecodeError as e:
        raise TelemetryError(f"{path}: not UTF-8 (bad byte at offset {e.start}); expected JSON lines") from None
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
