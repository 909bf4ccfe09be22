"""Hyperparameter sweeps with Optuna: `trainer2 sweep --space FILE ...` and `trainer2.sweep(space, preset, ...)`.

Each trial is an ordinary run in <sweep_dir>/trial-<N>/ of the sweep's config (preset, --config, flags) with the
values the sampler (TPE) proposes for the space's fields; the first takes the base config's own values. It reports the
objective on the validation split at each evaluation (the pruner may stop it there, saved); its final figure is the
trial's value: the loss (for text bits per character), minimised, or the accuracy, maximised (--objective acc). Held-out
data is scored once, on the best trial, at the end.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from trainer2.callbacks import Callback, LoopState, Stop
from trainer2.data.dataset import DataError, Dataset
from trainer2.data.load import load_data
from trainer2.io.console import warnings_only
from trainer2.presets import plain, yaml_layers
from trainer2.running.checkpoint import CheckpointError, list_checkpoints
from trainer2.running.health import Diverged
from trainer2.running.model import load
from trainer2.running.run import train
from trainer2.running.rundir import RunDirError
from trainer2.running.signals import StopSignals
from trainer2.running.sweep_results import table, trial_rows, write_best, write_csv, write_plots
from trainer2.running.sweep_space import Param, check_space, read_space, start_values, trial_config
from trainer2.running.sweep_study import (
    ask_lock,
    fail_stale,
    heartbeat,
    import_optuna,
    open_storage,
    open_study,
    reap_dead,
    resume_point,
    retry,
    tally,
    worker_stamp,
)
from trainer2.section import ConfigError, short_repr
from trainer2.train_config import RunConfig, TrainConfig, build_config

Layers = list[tuple[str, dict[str, Any]]]
Log = Callable[[str], None]
DEFAULT_VALIDATION = 0.1  # the validation fraction a sweep takes when none is given
PRUNERS = ("median", "hyperband", "none")
# The loss by default: on a validation split of a few hundred examples, accuracy moves in steps of one example (0.25 %
# at 400) and ties or reorders trials that the loss, a mean of continuous values, still ranks (Hugging Face's
# hyperparameter_search also minimises the evaluation loss unless told otherwise).
OBJECTIVES = ("loss", "acc")


@dataclass(frozen=True)
class Plan:
    """A checked sweep: the trials' config layers and base config, the space, the objective, where it is stored."""

    layers: Layers
    base: TrainConfig
    params: list[Param]
    preset: str | None
    data: Dataset | None  # given in memory (Python); None: each trial reads base.data, as a run would
    objective: str  # the summary key: validation_loss, validation_bpc (text) or validation_acc
    direction: str  # maximize or minimize
    start: dict[str, Any]  # the first trial's values: the base config's own, where they lie in the space
    trials: int
    study: str
    sweep_dir: Path
    storage: str
    pruner: str
    trust_code: bool
    seed: int  # the sampler's: the config's seed plus the worker's index
    hint: str  # how a stopped trial is continued: the same sweep again


def plan(
    layers: Layers,
    preset: str | None,
    space: str | Path | dict[str, Any],
    *,
    trials: int,
    data: Dataset | None = None,
    storage: str | None = None,
    study: str | None = None,
    sweep_dir: str | Path | None = None,
    pruner: str = "median",
    objective: str = "loss",
    trust_code: bool = False,
    worker_index: int = 0,
    hint: str = "the same sweep again",
    log: Log = print,
) -> Plan:
    """Check everything a sweep needs before any trial starts; a mistake is a ConfigError (or DataError) by name."""
    given = {k for _, values in layers for k in values}
    if "run_name" in given:
        raise ConfigError(
            "a sweep names its trials' runs trial-<N> itself: drop run_name (name the sweep with --study)"
        )
    for name, value, least in (("trials", trials, 1), ("worker_index", worker_index, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ConfigError(f"--{name} must be an integer >= {least}, got {short_repr(value)}")
    if pruner not in PRUNERS:
        raise ConfigError(f"--pruner must be one of {', '.join(PRUNERS)}, got {short_repr(pruner)}")
    if objective not in OBJECTIVES:
        raise ConfigError(f"--objective must be one of {', '.join(OBJECTIVES)}, got {short_repr(objective)}")
    extra: dict[str, Any] = {}
    if "validation_fraction" not in given:
        extra["validation_fraction"] = DEFAULT_VALIDATION
        log(f"note: trials are scored on a validation split of {DEFAULT_VALIDATION:g} (--validation_fraction)")
    layers = [*layers, ("the sweep's defaults", extra)] if extra else list(layers)
    base = build_config(layers, trust_code)
    if base.validation_fraction == 0:
        raise ConfigError("a sweep is scored on a validation split, never on held-out data: --validation_fraction > 0")
    where = "space" if isinstance(space, dict) else f"space file {space}"
    params = read_space(space, base)
    check_space(params, layers, base, trust_code, where)
    text = load_data(base, data).tokens  # a bad data file is refused now, not in every trial
    name = (
        study
        or f"{Path(str(preset)).stem if preset else 'run'}-{'space' if isinstance(space, dict) else Path(space).stem}"
    )
    try:
        RunConfig.model_validate({"run_name": name})
    except ValueError:
        raise ConfigError(f"--study {short_repr(name)}: use letters, digits, '_', '-' or '.'") from None
    folder = Path(sweep_dir) if sweep_dir is not None else Path(base.checkpoint_dir) / "sweeps" / name
    key = "validation_acc" if objective == "acc" else "validation_bpc" if text else "validation_loss"
    return Plan(
        layers,
        base,
        params,
        preset,
        data,
        key,
        "maximize" if objective == "acc" else "minimize",
        start_values(params, base),
        trials,
        name,
        folder,
        storage or f"sqlite:///{(folder / 'study.db').absolute()}",
        pruner,
        trust_code,
        base.seed + worker_index,
        hint,
    )


class TrialReport(Callback):
    """Reports each evaluation's validation figure to the trial; stops the run (saved) when the pruner says so, or
    when the sweep got a stop signal outside the run's own handler."""

    def __init__(self, trial: Any, key: str, signals: StopSignals) -> None:
        self.trial, self.key, self.signals = trial, key, signals

    def on_log(self, state: LoopState, row: dict[str, Any]) -> None:
        value = row.get(self.key)
        if state.stop is not None or value is None or not math.isfinite(value):
            return
        self.trial.report(value, step=row["window"])
        if not state.done and self.trial.should_prune():
            state.stop = Stop(reason="pruned")

    def on_window_end(self, state: LoopState) -> None:
        if state.stop is None and self.signals.received is not None:
            state.stop = Stop(signal=self.signals.received.name)


def run_trial(p: Plan, study: Any, storage: Any, trial: Any, signals: StopSignals, log: Log) -> str | None:
    """Run one trial and tell the study how it ended; returns the stop signal's name when one stopped it."""
    from optuna.trial import TrialState

    values = {q.name: q.suggest(trial) for q in p.params}
    retry_of = trial.user_attrs.get("retry_of")
    start = resume_point(study, retry_of, p.sweep_dir) if isinstance(retry_of, int) else None
    shown = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items())
    after = (
        f", continuing trial {retry_of}" + (f" from {start.name}" if start else " afresh")
        if start or retry_of is not None
        else ""
    )
    log(f"trial {trial.number}: {shown}{after}")

    def fail(reason: str) -> None:
        trial.set_user_attr("reason", reason)
        study.tell(trial, state=TrialState.FAIL)
        log(f"trial {trial.number}: failed: {reason}")

    try:
        cfg = trial_config(p.layers, values, p.base, p.trust_code)
        with heartbeat(storage, study, trial.number):
            run = train(
                cfg,
                p.data,
                run_dir=p.sweep_dir / f"trial-{trial.number}",
                resume=start,
                log=warnings_only(log),
                resume_hint=p.hint,
                callbacks=(TrialReport(trial, p.objective, signals),),
            )
    except Diverged as e:
        fail(str(e))
        return None
    except (ConfigError, DataError, CheckpointError, RunDirError) as e:
        fail(str(e).replace("\n", " "))
        return None
    except BaseException as e:  # a bug or Ctrl-C outside a window: recorded, never left RUNNING, then raised
        fail(f"{type(e).__name__}: {e}")
        raise
    summary = run.summary
    trial.set_user_attr("windows", summary["windows"])
    for key in ("validation_loss", "validation_acc", "validation_bpc"):  # the figures beside the objective
        if isinstance(summary.get(key), float) and math.isfinite(summary[key]):
            trial.set_user_attr(key, summary[key])
    stopped = summary["interrupted"]
    if stopped == "pruned":
        study.tell(trial, state=TrialState.PRUNED)
        log(f"trial {trial.number}: pruned at window {summary['windows']}")
        return None
    if stopped:
        fail(f"stopped by {stopped} at window {summary['windows']} (its checkpoint saved)")
        retry(study, next(t for t in study.get_trials(deepcopy=False) if t.number == trial.number), crashed=False)
        return stopped
    value = summary.get(p.objective)
    if value is None:
        fail(f"its {p.objective} is not finite")
        return None
    study.tell(trial, value)
    log(f"trial {trial.number}: {p.objective} {value:.4f} after {summary['windows']} windows")
    return None


def work(p: Plan, study: Any, storage: Any, log: Log) -> str | None:
    """Take trials until the study has p.trials finished ones; the stop signal's name when one ended it early."""
    with ask_lock(p.sweep_dir):
        if p.start and not study.get_trials(deepcopy=False):  # a new study: its first trial, the base's values
            study.enqueue_trial(p.start, user_attrs={"start": True}, skip_if_exists=True)
    with StopSignals() as signals:
        while signals.received is None:
            with ask_lock(p.sweep_dir):
                reap_dead(study, storage)
                fail_stale(study)
                counts = tally(study)
                if signals.received is not None or (
                    not counts.waiting and counts.finished + counts.running >= p.trials
                ):
                    break
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # optuna would have the heartbeat go with study.optimize
                    trial = study.ask()  # a queued retry first
                trial.set_user_attr("worker", worker_stamp())
            stopped = run_trial(p, study, storage, trial, signals, log)
            if stopped:
                return stopped
        return None if signals.received is None else signals.received.name


def report(p: Plan, study: Any, wall: float, log: Log) -> dict[str, Any]:
    """Print the table, write trials.csv, best.yaml and plots/, score the best trial on held-out data once."""
    rows = trial_rows(study, [q.name for q in p.params])
    log(table(rows))
    write_csv(p.sweep_dir / "trials.csv", rows)
    summed = sum(r["seconds"] or 0.0 for r in rows)
    log(f"wall time {wall:.1f} s for this command; the study's {len(rows)} trials took {summed:.1f} s together")
    best = next((r for r in rows if r["state"] == "COMPLETE"), None)
    if best is None:
        log("no trial completed: no best config")
        return {"rows": rows}
    number = best["number"]
    values = {q.name: best[q.name] for q in p.params}
    cfg = trial_config(p.layers, values, p.base, p.trust_code)
    preset_base = build_config(yaml_layers(p.preset), p.trust_code) if p.preset else TrainConfig()
    write_best(p.sweep_dir / "best.yaml", cfg, preset_base, p.preset)
    write_plots(study, p.sweep_dir / "plots", log)
    checkpoint = list_checkpoints(p.sweep_dir / f"trial-{number}")[-1]
    model = load(checkpoint, trust_code=p.trust_code)
    heldout = model.evaluate(p.data)
    metrics = [p.objective.removeprefix("validation_"), *(["acc"] if p.objective != "validation_acc" else [])]
    attrs = next(t.user_attrs for t in study.get_trials(deepcopy=False) if t.number == number)
    validation = {p.objective: best["value"], **{m: v for m, v in attrs.items() if m.startswith("validation_")}}
    shown = ", ".join(
        f"{m} {validation.get('validation_' + m, math.nan):.4f} / {heldout['heldout_' + m]:.4f}" for m in metrics
    )
    log(
        f"best: trial {number}, validation / held-out {shown} (held-out scored once, now); "
        f"config {p.sweep_dir / 'best.yaml'}"
    )
    return {
        "rows": rows,
        "best_trial": number,
        "validation": best["value"],
        "heldout": heldout,
        "checkpoint": checkpoint,
    }


def sweep(
    space: str | Path | dict[str, Any],
    preset: str | Path | None = None,
    data: Dataset | None = None,
    *,
    trials: int = 20,
    storage: str | None = None,
    study: str | None = None,
    sweep_dir: str | Path | None = None,
    pruner: str = "median",
    objective: str = "loss",
    trust_code: bool = False,
    log: Log = print,
    **fields: Any,
) -> dict[str, Any]:
    """Sweep `space` (a YAML path, or a mapping of the same) over `preset` and `fields`, `trials` finished trials, in
    this process; returns {"rows": the table, best first, "best_trial", "validation", "heldout", "checkpoint"}.
    Run it again (same study) to resume; several processes on one storage share the study."""
    import_optuna()
    layers = [*(yaml_layers(str(preset)) if preset is not None else []), ("arguments", plain(fields))]
    name = None if preset is None else str(preset)
    p = plan(
        layers,
        name,
        space,
        trials=trials,
        data=data,
        storage=storage,
        study=study,
        sweep_dir=sweep_dir,
        pruner=pruner,
        objective=objective,
        trust_code=trust_code,
        hint="trainer2.sweep(...) again",
        log=log,
    )
    started = time.perf_counter()
    storage = open_storage(p.storage)
    study = open_study(storage, p.study, p.objective, p.direction, p.pruner, p.seed)
    stopped = work(p, study, storage, log)
    if stopped:
        log(f"sweep stopped by {stopped}; call trainer2.sweep with the same arguments to resume it")
        return {}
    return report(p, study, time.perf_counter() - started, log)
