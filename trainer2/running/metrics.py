"""The log row of an interval: the metric sums the batch steps accumulated on the device, turned into means."""

from __future__ import annotations

import math
from typing import Any

# Per-window sums of the update's MetricSums that the row reports as means over the interval's windows.
WINDOW_MEANS = (
    "lior_mean",
    "spd_mean",
    "spd_last",
    "lior_nudge",
    "spd_last_nudge",
    "R_mean",
    "dropped",
    "update_norm_energy",
    "update_norm_readout",
    "update_norm_embed",
)


def metric_row(
    sums: dict[str, float],
    window: int,
    examples: int,
    epoch: float,
    lr: float,
    dropped_total: float,
    dead: int,
    windows_per_second: float,
    tokens: bool,
) -> dict[str, Any]:
    """The row logged at `window`: training loss and accuracy (and bits per character for text, `tokens`), the
    window observables, update norms, dropped updates, dead units, non-finite parameters and speed."""
    wins, ex = max(sums["windows"], 1.0), max(sums["examples"], 1.0)
    loss = sums["loss_sum"] / ex
    row: dict[str, Any] = {
        "window": window,
        "examples": examples,
        "epoch": epoch,
        "train_loss": loss,
        "train_acc": sums["correct_sum"] / ex,
        "lr": lr,
        "dropped_total": dropped_total,
    }
    if tokens:
        row["train_bpc"] = loss / math.log(2)
    row.update({k: sums[k] / wins for k in WINDOW_MEANS})
    row["dead_units"] = dead  # hidden units at 0 or 1 for the whole last batch (trainer2.physics.dead_units)
    row["nonfinite_params"] = sums["nonfinite_params"]  # windows of the interval that left a parameter non-finite
    row["lior_diff"] = row["lior_nudge"] - row["lior_mean"]  # the nudge's extra path length
    row["windows_per_second"] = windows_per_second
    return row
