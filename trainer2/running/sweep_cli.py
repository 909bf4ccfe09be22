"""`trainer2 sweep --space FILE [--trials N] [--workers N] [--storage URL] [--study NAME] [--sweep_dir DIR]
[--pruner median|hyperband|none] [--objective loss|acc] [--preset ...] [--FIELD VALUE ...]`: the sweep's flags, then
any trainer flags, which every trial takes. `--workers N` starts N - 1 more processes of the same command on the same
storage."""

from __future__ import annotations

import argparse
import shlex
import signal
import subprocess
import sys
import time

from trainer2.flags import add_config_flags, add_trust_flag, config_layers, user_modules_from_cwd
from trainer2.io.console import say
from trainer2.io.parser import Parser
from trainer2.running.signals import StopSignals, exit_code
from trainer2.running.sweep import OBJECTIVES, PRUNERS, plan, report, work
from trainer2.running.sweep_study import import_optuna, open_storage, open_study, tally
from trainer2.section import ConfigError

SWEEP_FLAGS = (
    "space", "trials", "workers", "storage", "study", "sweep_dir", "pruner", "objective", "worker_index", "report"
)  # fmt: skip


def sweep_parser() -> Parser:
    p = Parser(
        prog="trainer2 sweep",
        usage="trainer2 sweep --space FILE [--trials N] [--workers N] [--storage URL] [--study NAME] "
        "[--sweep_dir DIR] [--pruner median|hyperband|none] [--objective loss|acc] [--preset NAME] [--FIELD VALUE ...]",
        description="Search config fields with Optuna (TPE): each trial is a run in <sweep_dir>/trial-<N>/, scored on "
        "the validation split; the same command again resumes the study.",
    )
    p.add_argument("--space", required=True, metavar="FILE", help="YAML: FIELD: {low, high[, log, step]} or {choices}.")
    p.add_argument("--trials", type=int, default=20, help="Finished trials the study should have (default 20).")
    p.add_argument("--workers", type=int, default=1, help="Worker processes on this machine (default 1).")
    p.add_argument("--storage", metavar="URL", help="Study storage (default sqlite:///<sweep_dir>/study.db).")
    p.add_argument("--study", metavar="NAME", help="Study name (default <preset>-<space file name>).")
    p.add_argument(
        "--sweep_dir", metavar="DIR", help="Folder of the trials and results (default <checkpoint_dir>/sweeps/<study>)."
    )
    p.add_argument("--pruner", choices=PRUNERS, default="median", help="Stops hopeless trials at an evaluation.")
    p.add_argument(
        "--objective",
        choices=OBJECTIVES,
        default="loss",
        help="What trials are ranked by on the validation split: the loss (bits per character for text), minimised "
        "(default), or the accuracy, maximised.",
    )
    p.add_argument(
        "--worker_index",
        type=int,
        default=0,
        metavar="K",
        help="This worker's index among several started by hand on one study (seeds its sampler).",
    )
    p.add_argument(
        "--report",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Print the table and write the results when done (--no-report: workers started by --workers).",
    )
    p.add_argument("--preset", help="Preset name or YAML path, as for training.")
    p.add_argument("--config", help="YAML file of config fields, applied over the preset.")
    add_trust_flag(p)
    add_config_flags(p)
    return p


def cmd_sweep(argv: list[str]) -> int:
    args = sweep_parser().parse_args(argv)
    import_optuna()  # the install hint before anything else
    if args.workers < 1:
        raise ConfigError(f"--workers must be at least 1, got {args.workers}")
    user_modules_from_cwd(args)
    hint = "python -m trainer2 sweep " + shlex.join(argv)
    p = plan(
        config_layers(args),
        args.preset,
        args.space,
        trials=args.trials,
        storage=args.storage,
        study=args.study,
        sweep_dir=args.sweep_dir,
        pruner=args.pruner,
        objective=args.objective,
        trust_code=args.trust_code,
        worker_index=args.worker_index,
        hint=hint,
        log=say,
    )
    started = time.perf_counter()
    storage = open_storage(p.storage)
    study = open_study(storage, p.study, p.objective, p.direction, p.pruner, p.seed)  # before other workers start
    children = [
        subprocess.Popen(worker_command(argv, args.worker_index + k, p.storage)) for k in range(1, args.workers)
    ]
    try:
        stopped = work(p, study, storage, say)
    except BaseException:
        stop_all(children, signal.SIGTERM)
        raise
    stopped = wait_for(children, stopped)
    if stopped:
        say(f"sweep stopped by {stopped}; run the same command again to resume it")
        return exit_code(signal.Signals[stopped])
    codes = [child.returncode for child in children]
    if any(codes):
        finished = tally(study).finished >= p.trials  # this worker retried a dead one's trial, or the study is short
        say(f"note: worker exit statuses {codes}" + ("" if finished else "; run the same command again to finish"))
    if args.report:
        report(p, study, time.perf_counter() - started, say)
    return 0


def stop_all(children: list[subprocess.Popen[bytes]], sig: signal.Signals) -> None:
    for child in children:
        if child.poll() is None:
            child.send_signal(sig)


def wait_for(children: list[subprocess.Popen[bytes]], stopped: str | None) -> str | None:
    """Wait for the other workers; a stop signal (this worker's, or one arriving now) is passed on to them, and each
    stops after saving its trial. Returns the stop signal's name, if any."""
    with StopSignals() as signals:
        if stopped:
            stop_all(children, signal.Signals[stopped])
        for child in children:
            while child.poll() is None:
                if signals.received is not None and stopped is None:
                    stopped = signals.received.name
                    stop_all(children, signals.received)
                try:
                    child.wait(timeout=0.5)
                except subprocess.TimeoutExpired:
                    continue
    return stopped


def worker_command(argv: list[str], index: int, storage: str) -> list[str]:
    """The same sweep as one more worker: --workers 1, its own sampler seed, the shared storage, no report."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        flag = arg.split("=", 1)[0]
        if flag in ("--workers", "--worker_index", "--storage"):
            skip = "=" not in arg
            continue
        if flag in ("--report", "--no-report"):
            continue
        kept.append(arg)
    extra = ["--workers", "1", "--worker_index", str(index), "--storage", storage, "--no-report"]
    return [sys.executable, "-m", "trainer2", "sweep", *kept, *extra]
