"""What a training run puts into its checkpoints and takes back out, and the `Checkpointer` callback that saves them.

The file format and its validation are trainer2.running.checkpoint's; this module says which tensors and which sidecar
fields make up a run's state (parameters, update state, metric sums, memory bank, sampler, RNGs; config, counters,
data fingerprint, history) and saves them on the loop's schedule.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from trainer2.callbacks import Callback, LoopState, Stop
from trainer2.data.dataset import DataError, Dataset
from trainer2.data.sampler import Sampler, sampler_state
from trainer2.running import checkpoint as ck
from trainer2.running.health import nonfinite
from trainer2.train_config import TrainConfig

HISTORY_ROWS = 200  # logged rows a checkpoint's meta.json keeps; telemetry.jsonl is the full record


@dataclass
class Progress:
    """Host-side counters of a run."""

    window: int = 0
    examples: int = 0
    wall_seconds: float = 0.0


class Checkpointer(Callback):
    """A callback that saves a checkpoint every `every` windows (0: none between) and at the window a stop was asked
    for; the final one is the trainer's. Parameters that are not finite are never saved: finding them stops the run
    as a divergence, naming the windows since the last log row."""

    def __init__(self, every: int, save: Callable[[], Path], finite: Callable[[], bool]) -> None:
        self.every, self.save, self.finite = every, save, finite
        self.since = 0  # the last logged window

    def on_start(self, state: LoopState) -> None:
        self.since = state.window

    def on_log(self, state: LoopState, row: dict[str, Any]) -> None:
        self.since = row["window"]

    def on_window_end(self, state: LoopState) -> None:
        stop = state.stop
        if stop is not None and stop.diverged is not None:
            return
        if not ((self.every and state.window % self.every == 0) or stop is not None or state.done):
            return
        if not self.finite():  # never save poisoned parameters, even between log intervals
            state.stop = Stop(diverged=(nonfinite(self.since, state.window), state.window))
        elif not state.done:  # the final checkpoint is the trainer's
            self.save()


def run_meta(
    cfg: TrainConfig,
    run_id: str,
    progress: Progress,
    sampler: Sampler,
    world_size: int,
    data: Dataset,
    history: list[dict[str, Any]],
) -> dict[str, Any]:
    """The sidecar of a checkpoint at the current window: config, counters, data fingerprint, history, versions."""
    return {
        "config": cfg.model_dump(mode="json"),
        "run_id": run_id,
        "counters": {
            "window": progress.window,
            "examples": progress.examples,
            "epoch": progress.window / sampler.batches_per_epoch,
            "sampler_epoch": sampler.epoch,
            "sampler_pos": int(sampler.state_dict()["pos"]),
            "global_batch": sampler.batch_size,
            "world_size": world_size,
            "wall_seconds": progress.wall_seconds,
        },
        "data": ck.data_fingerprint(data),
        "history": history[-HISTORY_ROWS:],
        "versions": ck.versions(),
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def restore_counters(progress: Progress, meta: dict[str, Any]) -> None:
    """The window, examples and wall time a checkpoint's sidecar records, into `progress`."""
    c = meta["counters"]
    progress.window, progress.examples, progress.wall_seconds = (
        int(c["window"]),
        int(c["examples"]),
        float(c["wall_seconds"]),
    )


def check_global_batch(meta: dict[str, Any], path: Path, batch_size: int, world_size: int) -> None:
    """A checkpoint resumes on any number of processes, as long as the global batch is the same."""
    saved = meta["counters"].get("global_batch", meta["config"].get("batch_size"))  # older ones: one process
    world = meta["counters"].get("world_size", 1)
    if saved != batch_size * world_size:
        raise ck.CheckpointError(
            f"checkpoint {path} was trained at a global batch of {saved} "
            f"(batch_size {meta['config'].get('batch_size')} x {world} process(es)); this run's is "
            f"{batch_size * world_size} (batch_size {batch_size} x {world_size}); "
            + (
                f"pass --batch_size {saved // world_size}"
                if saved % world_size == 0
                else f"use a number of processes that divides {saved}"
            )
        )


def resume_notes(meta: dict[str, Any], data: Dataset, path: Path, log: Callable[[str], None]) -> None:
    """What a resume should know but that does not stop it: the data read from another path (same contents), and a
    checkpoint written by another torch (the run may then not continue bitwise)."""
    if meta["data"].get("source") != data.source:
        log(
            f"note: the data is read from {data.source}, the checkpoint's from {meta['data'].get('source')}; "
            "its contents are the same (sha256), so the run goes on"
        )
    saved_torch = meta.get("versions", {}).get("torch")
    if saved_torch != torch.__version__:
        log(
            f"warning: checkpoint {path} was written with torch {saved_torch}, this is {torch.__version__}; "
            "the resumed run may not be bitwise identical"
        )


def rng_tensors(device: torch.device) -> dict[str, Tensor]:
    """The states of torch's CPU generator (and the CUDA one of `device`), by checkpoint key."""
    out = {"rng.cpu": torch.get_rng_state()}
    if device.type == "cuda":
        out["rng.cuda"] = torch.cuda.get_rng_state(device)
    return out


def restore_rng(loaded: dict[str, Tensor], device: torch.device) -> None:
    """Set torch's generators from a checkpoint's states (a checkpoint written on the CPU has no CUDA state)."""
    torch.set_rng_state(loaded["rng.cpu"])
    if device.type == "cuda" and "rng.cuda" in loaded:
        torch.cuda.set_rng_state(loaded["rng.cuda"], device)


def check_sampler(loaded: dict[str, Tensor], sampler: Sampler, path: Path) -> None:
    """Refuse a sampler state that `sampler` cannot take (it checks its own, in one of two formats), on a copy."""
    try:
        Sampler(sampler.num_examples, sampler.batch_size, 0).load_state_dict(sampler_state(loaded))
    except DataError as e:
        raise ck.CheckpointError(f"{path / ck.TENSORS_FILE}: {e}") from None
