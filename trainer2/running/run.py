"""A training run from Python or the command line: `train(cfg, data) -> Run`, with the run directory's safety rules
(an exclusive lock, another run's files never touched, a resume only from this run's newest checkpoint)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from trainer2.callbacks import Callback
from trainer2.data.dataset import DataError, Dataset, InputSpec
from trainer2.io.console import LogChoice, RunLog
from trainer2.learning.gradients import GradientSource
from trainer2.monitor.tensorboard import check_tracking
from trainer2.running.checkpoint import CheckpointError, data_fingerprint, resolve_checkpoint, step_name
from trainer2.running.distributed import Distributed
from trainer2.running.model import Model
from trainer2.running.resume import check_resume, fresh_run_guard
from trainer2.running.rundir import RunDirError, RunLock, check_location, fresh_name, refuse_planted, remove_orphans
from trainer2.running.summary import done_line
from trainer2.running.trainer import Trainer
from trainer2.section import ConfigError, short_repr
from trainer2.train_config import RunConfig, TrainConfig


@dataclass(frozen=True)
class Run:
    """What `train` returns: the trained model, the run's summary (as in summary.json), its final checkpoint and its
    directory."""

    model: Model
    summary: dict[str, Any]
    checkpoint: Path
    run_dir: Path


def located(cfg: TrainConfig, run_dir: str | Path | None) -> TrainConfig:
    """cfg writing into `run_dir` (its checkpoint_dir and run_name, held to the command line's rules for them);
    without one, a run that names none gets a fresh name run-<N> under checkpoint_dir, as on the command line."""
    if run_dir is not None:
        if not isinstance(run_dir, (str, os.PathLike)):
            raise RunDirError(f"run_dir must be a path (a str or pathlib.Path), got {type(run_dir).__name__}")
        path = Path(run_dir)
        try:  # RunConfig's own validators: run_dir's last part is the run name --run_name would be
            where = RunConfig.model_validate({"checkpoint_dir": str(path.parent), "run_name": path.name})
        except ValidationError as e:
            why = "; ".join(err["msg"].removeprefix("Value error, ") for err in e.errors())
            raise RunDirError(
                f"run_dir {short_repr(str(run_dir))}: its last part names the run and obeys --run_name's rules: {why}. "
                f"Pass a run_dir ending in such a name, e.g. {str(path.parent / 'run-1')!r}"
            ) from None
        return cfg.model_copy(update={"checkpoint_dir": where.checkpoint_dir, "run_name": where.run_name})
    if "run_name" in cfg.model_fields_set:
        return cfg
    return cfg.model_copy(update={"run_name": fresh_name(Path(cfg.checkpoint_dir), "run")})


def check_arguments(cfg: Any, data: Any, resume: Any) -> None:
    """Refuse arguments of the wrong kind with the fix, before anything is read or made."""
    if not isinstance(cfg, TrainConfig):
        raise ConfigError(
            f"cfg must be a trainer2.TrainConfig, got {type(cfg).__name__}; build one with trainer2.config(...), e.g. "
            "trainer2.config(None, **settings) for a dict of settings"
        )
    if data is not None and not isinstance(data, Dataset):
        raise DataError(
            f"data must be a trainer2.Dataset, got {type(data).__name__}; build one from arrays with "
            "trainer2.from_arrays(x_train, y_train, x_test, y_test), or name a data file in the config "
            "(trainer2.config(..., data='path'), cfg.data) and pass no data"
        )
    if resume is not None and not isinstance(resume, (str, os.PathLike)):
        raise CheckpointError(
            f"resume must be 'latest' or a checkpoint directory (a str or pathlib.Path), got {type(resume).__name__}"
        )


def train(
    cfg: TrainConfig,
    data: Dataset | None = None,
    *,
    run_dir: str | Path | None = None,
    resume: str | Path | None = None,
    gradients: GradientSource | None = None,
    log: LogChoice = "quiet",
    dist: Distributed | None = None,
    resume_hint: str | None = None,
    callbacks: Sequence[Callback] = (),
) -> Run:
    """Train a machine on `data` and return the Run.

    cfg: the run's TrainConfig (trainer2.config(...)). data: a Dataset (trainer2.from_arrays(...)); None reads the
    data cfg.data names. run_dir: where it writes (default: <checkpoint_dir>/<run_name>, or a fresh run-<N> there).
    resume: "latest" or a checkpoint directory to continue from. gradients: a gradient source in place of the config's
    rule's (trainer2.learning.gradients). log: "quiet" (default) prints a one-line start (run directory, windows,
    device), the one-line result at the end and any warnings; "verbose" also the resolved config, the data and
    backends, checkpoints and notes; a function (print, a_list.append) is given every line but the start and end
    ones. dist: the torchrun process group (default: one process). resume_hint: how a stopped run is continued, as
    run.summary["resume_command"] says it (default: this Python call). callbacks: trainer2.callbacks.Callback objects
    called after the trainer's own at every hook (on_log sees each log row, validation_* and heldout_* at
    evaluations); one that sets state.stop = Stop(reason=...) ends the run saved, with summary["interrupted"] = reason.

    A stop signal (Ctrl-C) saves and returns (run.summary["interrupted"] names it, run.summary["resume_command"] says
    how to continue, and that is also logged unless resume_hint is given); a divergence raises
    trainer2.running.health.Diverged; a bad config, data or checkpoint a ValueError (ConfigError, DataError,
    CheckpointError, RunDirError) naming it, as a `log` that is none of the above does."""
    check_arguments(cfg, data, resume)
    out = RunLog.of(log)
    cfg = located(cfg, run_dir)
    dist = Distributed() if dist is None else dist
    headline = out.headline if dist.is_main else None  # under torchrun, one start and end line: rank 0's
    target = Path(cfg.checkpoint_dir) / cfg.run_name
    hint = resume_hint or f"trainer2.train(cfg, data, run_dir={str(target)!r}, resume='latest')"
    if dist.is_main:
        check_location(target)  # no run inside another (whose pruning would delete it): refused before anything is made
    with RunLock(target) if dist.is_main else nullcontext():  # held until the run ends: a second run here is refused
        if dist.is_main:
            refuse_planted(target)  # a link, FIFO or device where the run writes: refused before anything is read
        path = None if resume is None else resolve_checkpoint(str(resume), target)
        if path is not None:
            check_resume(path, target)
        elif dist.is_main:
            fresh_run_guard(target)
        if dist.is_main:
            remove_orphans(target, out.notes)
        check_tracking(cfg)
        trainer = Trainer(
            cfg, gradients, out.notes, dist, data=data, resume_hint=hint, headline=headline, callbacks=tuple(callbacks)
        )
        if path is not None:
            trainer.load_checkpoint(path)
        summary = trainer.train()
    window = trainer.progress.window
    checkpoint = target / step_name(window)
    if summary["interrupted"] and resume_hint is None:  # the command line says it its own way
        (headline or out.notes)(f"stopped by {summary['interrupted']} after window {window}; continue with {hint}")
    elif headline is not None and not summary["interrupted"]:
        headline(done_line(summary))
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
