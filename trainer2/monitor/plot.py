"""`trainer2 plot RUN_DIR`: PNG curves of a run from its telemetry.jsonl (matplotlib, the optional `plot` extra)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from trainer2.io.parser import Parser
from trainer2.io.safeio import refuse_links
from trainer2.monitor.telemetry import TELEMETRY_FILE, TelemetryError, read_telemetry

# One figure per entry: file name, title, y label, log scale, the telemetry keys drawn. A figure none of whose keys
# the run logged (bits per character of a feature or image run) is not written.
PANELS = (
    ("bpc.png", "bits per character", "bpc", False, ("train_bpc", "heldout_bpc", "validation_bpc")),
    ("loss.png", "loss", "nats / example", False, ("train_loss", "heldout_loss", "validation_loss")),
    ("accuracy.png", "accuracy", "accuracy", False, ("train_acc", "heldout_acc", "validation_acc")),
    ("lior_spd.png", "relaxation observables (free phase)", "value", True, ("lior_mean", "spd_mean", "spd_last")),
    ("speed.png", "throughput", "windows / s", False, ("windows_per_second",)),
)
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


def series(rows: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(windows, values) of the rows that carry a finite number under `key`."""
    pts = [(r["window"], r[key]) for r in rows if number(r.get(key)) and number(r.get("window"))]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_run(run_dir: Path, out_dir: Path | None = None) -> list[Path]:
    """Write one PNG per panel the telemetry holds data for (and timing.png when the run had timing_debug) into
    out_dir (default RUN_DIR/plots); text's loss is drawn as its bits per character only, the same curve."""
    Figure = figure_class()
    rows = read_telemetry(run_dir / TELEMETRY_FILE)
    if not rows:
        raise TelemetryError(f"{run_dir / TELEMETRY_FILE}: no rows yet; a run writes one per log interval")
    out_dir = out_dir or run_dir / "plots"
    refuse_links(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise PlotError(f"{out_dir}: is a file; --out must be a directory (one that does not exist yet is made)")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file on its path, or a folder this user may not write
        raise PlotError(
            f"{out_dir}: cannot make it ({e.strerror}); --out must be a directory this user may write"
        ) from None
    timing = tuple(k for k in rows[-1] if k.startswith("time_") and k.endswith("_ms"))
    panels = PANELS + ((("timing.png", "time per window by phase", "ms / window", False, timing),) if timing else ())
    written = []
    for name, title, ylabel, log, keys in panels:
        drawn = [(key, *series(rows, key)) for key in keys]
        drawn = [(key, x, y) for key, x, y in drawn if x]
        if not drawn or (name == "loss.png" and out_dir / "bpc.png" in written):
            continue  # nothing logged under these keys (an empty figure says nothing), or text's loss, already in bits
        fig = Figure(figsize=(7, 4), layout="constrained")
        ax = fig.add_subplot()
        for key, x, y in drawn:
            ax.plot(x, y, marker="o" if len(x) < 30 else None, markersize=3, label=key)
        if log and ax.lines and all(v > 0 for line in ax.lines for v in line.get_ydata()):
            ax.set_yscale("log")
        ax.set(title=f"{run_dir.name}: {title}", xlabel="window", ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
        path = out_dir / name
        refuse_links(path)  # savefig would write through a link to wherever it points
        fig.savefig(path, dpi=100)
        written.append(path)
    if not written:
        raise TelemetryError(f"{run_dir / TELEMETRY_FILE}: its rows hold no metric to plot")
    return written


def cmd_plot(argv: list[str]) -> int:
    p = Parser(prog="trainer2 plot", description="PNG curves of a run from its telemetry.jsonl.")
    p.add_argument("run_dir", type=Path, help="Run directory, e.g. checkpoints/dev (holds telemetry.jsonl).")
    p.add_argument("--out", type=Path, default=None, help="Where to write the PNGs (default: RUN_DIR/plots).")
    args = p.parse_args(argv)
    if not args.run_dir.is_dir():
        print(
            f"trainer2 plot: error: {args.run_dir}: not a directory; expected a run directory holding {TELEMETRY_FILE}",
            file=sys.stderr,
        )
        return 2
    try:
        paths = plot_run(args.run_dir, args.out)
    except (PlotError, TelemetryError) as e:
        print(f"trainer2 plot: error: {e}", file=sys.stderr)
        return 2
    for path in paths:
        print(f"wrote {path}")
    return 0
