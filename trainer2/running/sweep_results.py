"""What a sweep leaves for a person: the table of trials (printed, and trials.csv, best first), the best config as a
preset (best.yaml: `base:` the swept preset, then only the fields that differ) and plots (the `plot` extra)."""

from __future__ import annotations

import csv
import importlib.util
import io
import math
import warnings
from pathlib import Path
from typing import Any, Callable

import yaml

from trainer2.io.safeio import write_replace
from trainer2.running.sweep_study import retries
from trainer2.train_config import TrainConfig

LOCATION = ("run_name", "checkpoint_dir")  # where a run writes: never part of a preset
STATE_ORDER = {"COMPLETE": 0, "PRUNED": 1, "FAIL": 2, "RUNNING": 3, "WAITING": 4}


def trial_rows(study: Any, names: list[str]) -> list[dict[str, Any]]:
    """One row per trial, best first: COMPLETE by value (the study's direction), then PRUNED (by their last reported
    value), FAIL, RUNNING, WAITING; number, value, state, the swept values, windows, seconds and the reason."""
    trials = study.get_trials(deepcopy=False)
    retried = retries(trials)
    sign = -1.0 if study.direction.name == "MAXIMIZE" else 1.0
    rows = []
    for t in trials:
        value = t.value if t.value is not None else last_report(t)
        reason = t.user_attrs.get("reason", "")
        if t.state.name == "FAIL" and not reason:
            reason = "its worker stopped sending heartbeats"
        if t.number in retried:
            reason = f"{reason}; retried as trial {retried[t.number]}".lstrip("; ")
        seconds = t.duration.total_seconds() if t.duration is not None else None
        rows.append(
            {
                "number": t.number,
                "value": value,
                "state": t.state.name,
                **{n: t.params.get(n) for n in names},
                "windows": t.user_attrs.get("windows"),
                "seconds": None if seconds is None else round(seconds, 1),
                "reason": reason,
            }
        )

    def rank(row: dict[str, Any]) -> tuple[int, float, int]:
        v = row["value"]
        return (
            STATE_ORDER.get(row["state"], 5),
            sign * v if v is not None and math.isfinite(v) else math.inf,
            row["number"],
        )

    return sorted(rows, key=rank)


def last_report(trial: Any) -> float | None:
    steps = trial.intermediate_values
    return steps[max(steps)] if steps else None


def shown(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as aligned text columns (the reason last, unpadded)."""
    if not rows:
        return "(no trials)"
    keys = list(rows[0])
    cells = [keys, *([shown(r[k]) for k in keys] for r in rows)]
    widths = [max(len(c[i]) for c in cells) for i in range(len(keys) - 1)]
    return "\n".join("  ".join([*(c.ljust(w) for c, w in zip(line[:-1], widths)), line[-1]]).rstrip() for line in cells)


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    out = io.StringIO()
    if rows:
        writer = csv.DictWriter(out, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows({k: "" if v is None else v for k, v in r.items()} for r in rows)
    write_replace(path, out.getvalue().encode())


def write_best(path: Path, best: TrainConfig, base: TrainConfig, preset: str | None) -> None:
    """best.yaml: `base: <preset>` (a name, or the file's absolute path), then every field the best trial's config
    sets otherwise (the swept values and the sweep's flags), so `--preset best.yaml` trains it as it was trained."""
    ours, theirs = best.model_dump(mode="json"), base.model_dump(mode="json")
    differ = {k: v for k, v in ours.items() if k not in LOCATION and v != theirs[k]}
    head = {}
    if preset is not None:
        head["base"] = preset if not preset.endswith((".yaml", ".yml")) else str(Path(preset).resolve())
    text = yaml.safe_dump({**head, **differ}, sort_keys=False, default_flow_style=None)
    write_replace(path, text.encode())


def write_plots(study: Any, out: Path, say: Callable[[str], None]) -> None:
    """plots/history.png (the objective by trial), importances.png (of each swept field) and slice.png (the objective
    against each swept field); a plot optuna cannot draw (too few finished trials) is skipped with a note."""
    if importlib.util.find_spec("matplotlib") is None:
        say(f'note: no plots in {out}: they need matplotlib (pip install -e ".[plot]")')
        return
    import matplotlib

    matplotlib.use("Agg")  # files only, whatever display there is
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as draw

    out.mkdir(parents=True, exist_ok=True)
    plots = {
        "history": draw.plot_optimization_history,
        "importances": draw.plot_param_importances,
        "slice": draw.plot_slice,
    }
    for name, plot in plots.items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # optuna marks its matplotlib plots experimental
                axes = plot(study)
        except Exception as e:  # noqa: BLE001 - optuna refuses a plot it has too little for in several ways
            say(f"note: {out / name}.png not drawn: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
            continue
        figure = (axes.flat[0] if hasattr(axes, "flat") else axes).figure
        figure.savefig(out / f"{name}.png", dpi=100, bbox_inches="tight")
        plt.close(figure)
