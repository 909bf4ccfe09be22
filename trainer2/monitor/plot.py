"""`trainer2 plot RUN_DIR [RUN_DIR ...]`: PNG curves of runs from their telemetry.jsonl (matplotlib, the optional `plot`
extra). One run: its curves against windows. Several: one curve per run on each figure, e.g. held-out error against
wall seconds (`--x wall_seconds`), the time-to-accuracy plot of docs/mnist.md."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer2.io.parser import Parser
from trainer2.io.safeio import refuse_links
from trainer2.monitor.telemetry import TELEMETRY_FILE, TelemetryError, read_telemetry


def same(v: float) -> float:
    """The value itself (a panel that draws its keys as logged)."""
    return v


def error_pct(acc: float) -> float:
    """Classification error in % from an accuracy in [0, 1]."""
    return 100.0 * (1.0 - acc)


@dataclass(frozen=True)
class Panel:
    """One figure: its file name, title, y label and scale, the telemetry keys drawn and what is drawn of each."""

    file: str
    title: str
    ylabel: str
    log: bool
    keys: tuple[str, ...]
    value: Callable[[float], float] = same


ACC = ("train_acc", "heldout_acc", "validation_acc")
# A figure none of whose keys the runs logged (bits per character of a feature or image run) is not written.
PANELS = (
    Panel("bpc.png", "bits per character", "bpc", False, ("train_bpc", "heldout_bpc", "validation_bpc")),
    Panel("loss.png", "loss", "nats / example", False, ("train_loss", "heldout_loss", "validation_loss")),
    Panel("accuracy.png", "accuracy", "accuracy", False, ACC),
    Panel("error.png", "classification error", "error (%)", True, ACC, error_pct),
    Panel("lior_spd.png", "relaxation observables (free phase)", "value", True, ("lior_mean", "spd_mean", "spd_last")),
    Panel("speed.png", "throughput", "windows / s", False, ("windows_per_second",)),
)
X_AXES = {"window": "window", "wall_seconds": "wall seconds"}
MISSING_MATPLOTLIB = (
    "plot needs matplotlib, which is not installed: pip install 'trainer2[plot]' (or pip install matplotlib)"
)


class PlotError(RuntimeError):
    """The plot cannot be made (matplotlib missing, or --out no directory); the message says what to do."""


def figure_class() -> type:
    """matplotlib's Figure, imported only when plotting (matplotlib is optional; Figure needs no pyplot or display)."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise PlotError(MISSING_MATPLOTLIB) from e
    return Figure


def number(v: Any) -> bool:
    """Whether v can be plotted: a finite int or float within a float's range, not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) < 1e300


def series(rows: list[dict[str, Any]], key: str, x: str = "window") -> tuple[list[float], list[float]]:
    """(x, values) of the rows that carry a finite number under `key` and under `x` (window or wall_seconds)."""
    pts = [(r[x], r[key]) for r in rows if number(r.get(key)) and number(r.get(x))]
    return [p[0] for p in pts], [p[1] for p in pts]


def make_out_dir(out_dir: Path) -> None:
    """Make --out (a directory, not through a link), or say why it cannot be."""
    refuse_links(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise PlotError(f"{out_dir}: is a file; --out must be a directory (one that does not exist yet is made)")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file on its path, or a folder this user may not write
        raise PlotError(
            f"{out_dir}: cannot make it ({e.strerror}); --out must be a directory this user may write"
        ) from None


def plot_runs(run_dirs: list[Path], out_dir: Path | None = None, x: str = "window") -> list[Path]:
    """Write one PNG per panel the telemetry holds data for (and timing.png when a single run had timing_debug) into
    out_dir (default RUN_DIR/plots for one run); text's loss is drawn as its bits per character only, the same curve.
    With several runs each figure has a curve per run and key, the per-batch train_* keys left out where a panel has
    evaluated ones (their noise would bury the comparison)."""
    Figure = figure_class()
    runs = []
    for run_dir in run_dirs:
        rows = read_telemetry(run_dir / TELEMETRY_FILE)
        if not rows:
            raise TelemetryError(f"{run_dir / TELEMETRY_FILE}: no rows yet; a run writes one per log interval")
        runs.append((run_dir, rows))
    several = len(runs) > 1
    if out_dir is None:
        if several:
            raise PlotError("several runs go on one set of figures: name where with --out DIR")
        out_dir = run_dirs[0] / "plots"
    make_out_dir(out_dir)
    panels = PANELS
    timing = tuple(k for k in runs[0][1][-1] if k.startswith("time_") and k.endswith("_ms"))
    if timing and not several:
        panels += (Panel("timing.png", "time per window by phase", "ms / window", False, timing),)
    written = []
    for panel in panels:
        keys = panel.keys
        if several and any(not k.startswith("train_") for k in keys):
            keys = tuple(k for k in keys if not k.startswith("train_"))
        named = {k: k.replace("_acc", "_error") if panel.value is error_pct else k for k in keys}  # what is drawn
        drawn = [
            (f"{run_dir.name} {named[key]}" if several else named[key], *series(rows, key, x))
            for run_dir, rows in runs
            for key in keys
        ]
        drawn = [(label, xs, ys) for label, xs, ys in drawn if xs]
        if not drawn or (panel.file == "loss.png" and out_dir / "bpc.png" in written):
            continue  # nothing logged under these keys (an empty figure says nothing), or text's loss, already in bits
        fig = Figure(figsize=(7, 4), layout="constrained")
        ax = fig.add_subplot()
        for label, xs, ys in drawn:
            ax.plot(xs, [panel.value(v) for v in ys], marker="o" if len(xs) < 30 else None, markersize=3, label=label)
        if panel.log and ax.lines and all(v > 0 for line in ax.lines for v in line.get_ydata()):
            ax.set_yscale("log")
        title = panel.title if several else f"{run_dirs[0].name}: {panel.title}"
        ax.set(title=title, xlabel=X_AXES[x], ylabel=panel.ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
        path = out_dir / panel.file
        refuse_links(path)  # savefig would write through a link to wherever it points
        fig.savefig(path, dpi=100)
        written.append(path)
    if not written:
        names = ", ".join(str(d / TELEMETRY_FILE) for d in run_dirs)
        raise TelemetryError(f"{names}: its rows hold no metric to plot against {x}")
    return written


def cmd_plot(argv: list[str]) -> int:
    p = Parser(prog="trainer2 plot", description="PNG curves of runs from their telemetry.jsonl.")
    p.add_argument(
        "run_dirs",
        type=Path,
        nargs="+",
        metavar="RUN_DIR",
        help="Run directory, e.g. checkpoints/dev (holds telemetry.jsonl); several: one curve per run on each figure.",
    )
    p.add_argument(
        "--out", type=Path, default=None, help="Where to write the PNGs (default: RUN_DIR/plots; several runs: needed)."
    )
    p.add_argument(
        "--x", choices=tuple(X_AXES), default="window", help="The horizontal axis: windows trained or wall seconds."
    )
    args = p.parse_args(argv)
    for run_dir in args.run_dirs:
        if not run_dir.is_dir():
            print(
                f"trainer2 plot: error: {run_dir}: not a directory; expected a run directory holding {TELEMETRY_FILE}",
                file=sys.stderr,
            )
            return 2
    try:
        paths = plot_runs(args.run_dirs, args.out, args.x)
    except (PlotError, TelemetryError) as e:
        print(f"trainer2 plot: error: {e}", file=sys.stderr)
        return 2
    for path in paths:
        print(f"wrote {path}")
    return 0
