"""TensorBoard logging (`--tensorboard`): every number of each telemetry row as a scalar in <run_dir>/tb/,
with the window as the step, through torch.utils.tensorboard (the optional `tensorboard` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainer2.io.safeio import refuse_links
from trainer2.train_config import ConfigError, TrainConfig

TB_DIR = "tb"
MISSING_TENSORBOARD = (
    "tensorboard: --tensorboard needs the tensorboard package, which is not installed: "
    "pip install 'trainer2[tensorboard]' (or pip install tensorboard), or drop --tensorboard"
)

# Telemetry key -> TensorBoard tag; the part before '/' is the section TensorBoard groups the curves in.
TAGS = {
    "epoch": "progress/epoch",
    "examples": "progress/examples",
    "wall_seconds": "progress/wall_seconds",
    "R_mean": "lior/R_mean",
    "spd_mean": "lior/spd_mean",
    "spd_last": "lior/spd_last",
    "spd_last_nudge": "lior/spd_last_nudge",
    "lr": "update/lr",
    "dropped": "update/dropped",
    "dropped_total": "update/dropped_total",
    "windows_per_second": "speed/windows_per_second",
    "cache_cleanups": "memory/cache_cleanups",
}
PREFIXES = (
    ("train_", "train/"),
    ("heldout_", "heldout/"),
    ("validation_", "validation/"),
    ("lior_", "lior/"),
    ("update_norm_", "update/norm_"),
    ("mem_", "memory/"),
    ("time_", "time/"),
)


def tag(key: str) -> str:
    """The tag of a telemetry key: train_bpc -> train/bpc, time_free_ms -> time/free_ms; unknown keys go to other/."""
    if key in TAGS:
        return TAGS[key]
    for prefix, section in PREFIXES:
        if key.startswith(prefix):
            return section + key.removeprefix(prefix)
    return f"other/{key}"


def summary_writer_class() -> type:
    """torch.utils.tensorboard.SummaryWriter, or a ConfigError that says what to install."""
    try:
        import tensorboard  # noqa: F401  (asked first: a cached torch.utils.tensorboard would hide its absence)
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError(MISSING_TENSORBOARD) from None
    return SummaryWriter


def check_tracking(cfg: TrainConfig) -> None:
    """Refuse, before anything is loaded or written, a run that asks for a tracker whose package is missing."""
    if cfg.tensorboard:
        summary_writer_class()


class TensorBoardLog:
    """Appends the scalars of each telemetry row to the event files in <run_dir>/tb/.

    A resumed run adds a new event file to the same directory, so TensorBoard shows one run. It opens with
    purge_step = (window it starts at) + 1: points an interrupted run logged after its last checkpoint are
    dropped from the view, since the resumed run logs those windows again."""

    def __init__(self, run_dir: Path, start_window: int) -> None:
        writer = summary_writer_class()
        refuse_links(run_dir / TB_DIR)  # its event files would land wherever a planted link points
        self.writer = writer(log_dir=str(run_dir / TB_DIR), purge_step=start_window + 1)

    def write(self, row: dict[str, Any]) -> None:
        """Every int or float of `row` but the window itself (the step); None (e.g. CUDA memory on a CPU) is skipped."""
        step = int(row["window"])
        for key, value in row.items():
            if key != "window" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(tag(key), value, step)
        self.writer.flush()  # once per log interval, so a killed run's curves reach its last row

    def close(self) -> None:
        self.writer.close()
