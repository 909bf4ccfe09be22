"""A training run from Python or the command line: `train(cfg, data) -> Run`, with the run directory's safety rules
(an exclusive lock, another run's files never touched, a resume only from this run's newest checkpoint)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer2.data.dataset import Dataset, InputSpec
from trainer2.learning.gradients import GradientSource
from trainer2.monitor.tensorboard import check_tracking
from trainer2.running.checkpoint import data_fingerprint, resolve_checkpoint, step_name
from trainer2.running.distributed import Distributed
from trainer2.running.model import Model
from trainer2.running.resume import check_resume, fresh_run_guard
from trainer2.running.rundir import RunLock, fresh_name, refuse_planted, remove_orphans
from trainer2.running.trainer import Trainer
from trainer2.train_config import TrainConfig


@dataclass(frozen=True)
class Run:
    """What `train` returns: the trained model, the run's summary (as in summary.json), its final checkpoint and its
    directory."""

    model: Model
    summary: dict[str, Any]
    checkpoint: Path
    run_dir: Path


def located(cfg: TrainConfig, run_dir: str | Path | None) -> TrainConfig:
    """cfg writing into `run_dir` (its checkpoint_dir and run_name); without one, a run that names none gets a fresh
    name run-<N> under checkpoint_dir, as on the command line."""
    if run_dir is not None:
        path = Path(run_dir)
        return cfg.model_copy(update={"checkpoint_dir": str(path.parent), "run_name": path.name})
    if "run_name" in cfg.model_fields_set:
        return cfg
    return cfg.model_copy(update={"run_name": fresh_name(Path(cfg.checkpoint_dir), "run")})


def train(
    cfg: TrainConfig,
    data: Dataset | None = None,
    *,
    run_dir: str | Path | None = None,
    resume: str | Path | None = None,
    gradients: GradientSource | None = None,
    log: Callable[[str], None] = print,
    dist: Distributed | None = None,
    resume_hint: str | None = None,
) -> Run:
    """Train a machine on `data` (default: the data cfg.data names) and return the Run. run_dir: where it writes
    (default: <checkpoint_dir>/<run_name>); resume: "latest" or a checkpoint directory to continue from; gradients:
    a gradient source in place of the config's rule's (trainer2.learning.gradients). A stop signal (Ctrl-C) saves and
    returns (run.summary["interrupted"] names it, and run.summary["resume_command"] says how to continue:
    resume_hint, the command line's own, or else the Python call, which is also logged); a divergence raises
    trainer2.running.health.Diverged; a bad config, data or checkpoint a ValueError (ConfigError, DataError,
    CheckpointError, RunDirError) naming it."""
    cfg = located(cfg, run_dir)
    dist = Distributed() if dist is None else dist
    target = Path(cfg.checkpoint_dir) / cfg.run_name
    hint = resume_hint or f"trainer2.train(cfg, data, run_dir={str(target)!r}, resume='latest')"
    with RunLock(target) if dist.is_main else nullcontext():  # held until the run ends: a second run here is refused
        if dist.is_main:
            refuse_planted(target)  # a link, FIFO or device where the run writes: refused before anything is read
        path = None if resume is None else resolve_checkpoint(str(resume), target)
        if path is not None:
            check_resume(path, target)
        elif dist.is_main:
            fresh_run_guard(target)
        if dist.is_main:
            remove_orphans(target, log)
        check_tracking(cfg)
        trainer = Trainer(cfg, gradients, log, dist, data=data, resume_hint=hint)
        if path is not None:
            trainer.load_checkpoint(path)
        summary = trainer.train()
    window = trainer.progress.window
    checkpoint = target / step_name(window)
    if summary["interrupted"] and resume_hint is None:  # the command line says it its own way
        log(f"stopped by {summary['interrupted']} after window {window}; continue with {hint}")
    data = trainer.data
    model = Model(
        cfg,
        trainer.scored_machine,
        trainer.memory,
        InputSpec.of(data),
        trainer.device,
        window,
        data_fingerprint(data),
        checkpoint,
        data,
        weights="raw" if trainer.average is None else "average",
    )
    return Run(model, summary, checkpoint, target)
