"""A run's summary: its held-out figures (validation figures, for a run with a validation split), length, speed and
how it ended, as <run_dir>/summary.json (strict JSON: a non-finite number is null) and as the one line the command
line prints."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from trainer2.data.dataset import Dataset
from trainer2.io.safeio import write_replace
from trainer2.learning.averaging import WeightAverage
from trainer2.running.checkpointing import Progress

SUMMARY_FILE = "summary.json"


def last_evaluation(history: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The newest logged row with evaluation figures (held-out or validation), or None."""
    return next((r for r in reversed(history) if "heldout_loss" in r or "validation_loss" in r), None)


def summary(last_eval: dict[str, Any] | None, data_kind: str, progress: Progress, **ending: Any) -> dict[str, Any]:
    """The summary of a run at `progress` whose last held-out evaluation is `last_eval` (a log row, or None); `ending`
    adds the dropped-update count, device, window backend, interrupted and diverged fields (and an error)."""
    figures = [f"{split}_{m}" for split in ("heldout", "validation") for m in ("bpc", "acc", "loss")]
    held = {k: last_eval[k] for k in figures if k in (last_eval or {})}
    wall = progress.wall_seconds
    out = {
        **held,
        **({"heldout_window": last_eval["window"]} if last_eval else {}),
        "data_kind": data_kind,
        "windows": progress.window,
        "examples_seen": progress.examples,
        "wall_seconds": wall,
        "windows_per_second": progress.window / wall if wall > 0 else 0.0,
        **ending,
    }
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in out.items()}


def write_summary(run_dir: Path, values: dict[str, Any]) -> None:
    """<run_dir>/summary.json, replaced whole."""
    run_dir.mkdir(parents=True, exist_ok=True)
    write_replace(run_dir / SUMMARY_FILE, (json.dumps(values, indent=2, allow_nan=False) + "\n").encode())


def done_line(values: dict[str, Any]) -> str:
    """The one-line result of a finished run; a non-finite figure (null in summary.json) says so."""

    def fmt(key: str) -> str:
        return "non-finite" if values.get(key) is None else f"{values[key]:.3f}"

    # a run with a validation split scored it, never the held-out split (trainer2.running.evaluation.scored_split)
    split, what, left = ("heldout", "held-out", "")
    if "validation_loss" in values:
        split, what, left = ("validation", "validation", " (held-out split not scored: `evaluate` scores it)")
    score = f"bpc {fmt(split + '_bpc')}" if f"{split}_bpc" in values else f"loss {fmt(split + '_loss')} nats/example"
    return (
        f"done: {values['windows']} windows, {values['examples_seen']} examples in {values['wall_seconds']:.1f}s "
        f"({values['windows_per_second']:.2f} win/s); {what} {score}, acc {fmt(split + '_acc')}{left}"
    )


def run_header(data: Dataset, device: object, average: WeightAverage | None = None, **backends: Any) -> str:
    """What a run says it trains on, where, with which backends (each with a `name` and a `reason`) and what its
    evaluation scores (the weight average, when it keeps one), before its first window."""
    lines = [
        f"data: {data.source} ({data.kind}, {data.num_examples('train')} train / {data.num_examples('heldout')} "
        f"held-out examples, {data.num_classes} classes); device: {device}"
    ]
    lines += [f"{what} backend: {b.name} ({b.reason})" for what, b in backends.items()]
    if average is not None:
        lines.append(f"evaluation scores the weight average (ema_decay {average.decay}), not the parameters")
    return "\n".join(lines)
