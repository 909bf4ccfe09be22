"""A sweep's study in its storage: opening it (an SQLite file by default, any URL optuna's RDB storage takes), the
liveness of trials whose worker died, the one retry such a trial gets, and which trials count as finished.

Finished: COMPLETE, PRUNED and FAIL trials, except a FAIL trial that was retried (its retry counts instead). A trial
stopped by a signal is failed with its checkpoint saved and continued by a retry (every time: a stop is deliberate); a
trial whose worker died (kill -9, a lost machine) is failed and retried once, from its newest checkpoint, in a new
trial folder: a retry that dies too is not retried again (it may be what kills its worker).
"""

from __future__ import annotations

import os
import socket
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer2.running.checkpoint import list_checkpoints
from trainer2.running.rundir import pid_alive
from trainer2.section import ConfigError

try:
    import fcntl
except ImportError:  # Windows: workers of one sweep on one machine are then not serialised at the ask
    fcntl = None  # type: ignore[assignment]

HEARTBEAT_SECONDS = 60  # a running trial's heartbeat into the storage
GRACE_SECONDS = 600  # a trial of another machine with no heartbeat this long is taken for dead (clocks must agree)
LOCK_NAME = ".sweep-lock"  # in the sweep folder: this machine's workers ask for trials one at a time
SQLITE_WAIT_SECONDS = 120  # how long a worker waits for another's write to an SQLite study


def missing_optuna() -> ConfigError:
    return ConfigError('trainer2 sweep needs optuna: pip install -e ".[sweep]" (or pip install optuna)')


def import_optuna() -> Any:
    """optuna, quiet (trainer2 prints its own line per trial); refused with the install hint when missing."""
    try:
        import optuna
    except ImportError:
        raise missing_optuna() from None
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    return optuna


def shown(url: str) -> str:
    """A storage URL with its password hidden."""
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - not a URL sqlalchemy parses: the open below says so
        return url


def open_storage(url: str) -> Any:
    """optuna's RDBStorage on `url`, its tables made; an unreachable or unusable store is a ConfigError naming it."""
    optuna = import_optuna()
    kwargs: dict[str, Any] = {"connect_args": {"timeout": SQLITE_WAIT_SECONDS}} if url.startswith("sqlite") else {}
    if url.startswith("sqlite:///") and url != "sqlite:///:memory:":  # the file's folder (the sweep's, by default)
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # optuna calls the heartbeat experimental
            return optuna.storages.RDBStorage(
                url,
                engine_kwargs=kwargs,
                heartbeat_interval=HEARTBEAT_SECONDS,
                grace_period=GRACE_SECONDS,
                heartbeat_stale_trial_callback=lambda study, trial: retry(study, trial, crashed=True),
            )
    except ImportError as e:  # the database's driver
        hint = ' (pip install -e ".[sweep]" installs psycopg2 for postgresql://)' if url.startswith("postgres") else ""
        raise ConfigError(f"--storage {shown(url)}: its driver is not installed: {e}{hint}") from None
    except Exception as e:  # noqa: BLE001 - sqlalchemy's and the drivers' errors have no common base worth naming
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"--storage {shown(url)} cannot be used: {first[:300]}") from None


def open_study(storage: Any, name: str, objective: str, direction: str, pruner: str, seed: int) -> Any:
    """The study `name` in `storage`, made if new (recording its objective, a summary key); one made for another
    objective is refused."""
    optuna = import_optuna()
    pruners = {
        "median": lambda: optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0),
        "hyperband": lambda: optuna.pruners.HyperbandPruner(),
        "none": lambda: optuna.pruners.NopPruner(),
    }
    study = optuna.create_study(
        storage=storage,
        study_name=name,
        direction=direction,
        load_if_exists=True,
        sampler=optuna.samplers.TPESampler(seed=seed),
        pruner=pruners[pruner](),
    )
    made = study.direction.name.lower()
    if not study.get_trials(deepcopy=False) and "objective" not in study.user_attrs and made == direction:
        study.set_user_attr("objective", objective)
    # A study of a trainer2 before --objective has no record of it: it maximised accuracy, or minimised text's bpc.
    had = study.user_attrs.get("objective", "validation_acc" if made == "maximize" else "validation_bpc")
    if had != objective:
        flag = "acc" if had == "validation_acc" else "loss"
        raise ConfigError(
            f"study {name!r} in this storage ranks its trials by {had}, this sweep by {objective}: pass "
            f"--objective {flag} to continue it (or another --study)"
        )
    return study


@dataclass(frozen=True)
class Tally:
    """The study's trials by what they mean to a sweep: finished (counted), running, waiting (retries to run)."""

    finished: int
    running: int
    waiting: int


def fail_stale(study: Any) -> None:
    """Fail, and retry once, the running trials of other hosts whose heartbeat stopped GRACE_SECONDS ago."""
    optuna = import_optuna()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # experimental in optuna
        optuna.storages.fail_stale_trials(study)


def retries(trials: list[Any]) -> dict[int, int]:
    """Trial number -> the number of the trial that retries it."""
    return {t.user_attrs["retry_of"]: t.number for t in trials if isinstance(t.user_attrs.get("retry_of"), int)}


def tally(study: Any) -> Tally:
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    retried = retries(trials)
    done = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
    return Tally(
        sum(t.state in done and t.number not in retried for t in trials),
        sum(t.state == TrialState.RUNNING for t in trials),
        sum(t.state == TrialState.WAITING for t in trials),
    )


def retry(study: Any, trial: Any, crashed: bool) -> None:
    """Queue a retry of a failed trial, with its values (it continues from the trial's newest checkpoint); a trial
    that was itself the retry of a crash is not retried after crashing again."""
    if crashed and trial.user_attrs.get("retry_for") == "crash":
        return
    cause = "crash" if crashed else "stop"
    study.enqueue_trial(trial.params, user_attrs={"retry_of": trial.number, "retry_for": cause})


def worker_stamp() -> dict[str, Any]:
    """Which process runs a trial (its host and pid), so another worker on this host can tell when it died."""
    return {"host": socket.gethostname(), "pid": os.getpid()}


def reap_dead(study: Any, storage: Any) -> None:
    """Fail and retry the running trials whose worker on this host is gone (killed); another host's are failed by the
    storage's heartbeat after GRACE_SECONDS. Of two workers reaping one trial, only the one whose FAIL lands retries."""
    from optuna.exceptions import UpdateFinishedTrialError
    from optuna.trial import TrialState

    study_id = storage.get_study_id_from_name(study.study_name)
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        who = t.user_attrs.get("worker")
        if not isinstance(who, dict) or who.get("host") != socket.gethostname() or pid_alive(int(who["pid"])):
            continue
        trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, t.number)
        try:
            storage.set_trial_user_attr(trial_id, "reason", f"its worker (pid {who['pid']}) died mid-trial")
            if storage.set_trial_state_values(trial_id, TrialState.FAIL):
                retry(study, storage.get_trial(trial_id), crashed=True)
        except UpdateFinishedTrialError:  # another worker failed it first, and retried it
            continue


def resume_point(study: Any, number: int, sweep_dir: Path) -> Path | None:
    """The newest checkpoint a retry of trial `number` continues from: that trial's, else (it saved none) the one its
    own predecessor left, and so on; None: start afresh."""
    by_number = {t.number: t for t in study.get_trials(deepcopy=False)}
    seen: set[int] = set()
    while number in by_number and number not in seen:
        seen.add(number)
        found = list_checkpoints(sweep_dir / f"trial-{number}")
        if found:
            return found[-1]
        number = by_number[number].user_attrs.get("retry_of", -1)
    return None


@contextmanager
def ask_lock(sweep_dir: Path) -> Iterator[None]:
    """This machine's workers count and ask one at a time, so together they start no more trials than asked."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    if fcntl is None:
        yield
        return
    fd = os.open(sweep_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


@contextmanager
def heartbeat(storage: Any, study: Any, number: int) -> Iterator[None]:
    """Record the trial's heartbeat every HEARTBEAT_SECONDS while it runs (what tells other hosts it is alive)."""
    trial_id = storage.get_trial_id_from_study_id_trial_number(storage.get_study_id_from_name(study.study_name), number)
    done = threading.Event()

    def beat() -> None:
        while True:
            try:
                storage.record_heartbeat(trial_id)
            except Exception:  # noqa: BLE001 - a missed beat is retried; the trial itself reports real failures
                pass
            if done.wait(HEARTBEAT_SECONDS):
                return

    thread = threading.Thread(target=beat, name=f"trial-{number}-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
