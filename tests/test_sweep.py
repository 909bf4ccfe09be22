"""`trainer2 sweep` and `trainer2.sweep` (issue 60): trials are ordinary runs, results a person can read, a study that
resumes, refusals by name before any trial, failed and pruned trials recorded, several workers on one study, and a
worker killed mid-trial accounted for. Tiny feature data and 9-12 windows a trial."""

from __future__ import annotations

import csv
import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from pg import postgres_server, postgres_url  # noqa: F401
from tiny import clustered

import trainer2
from trainer2.cli import main
from trainer2.running.rundir import pid_alive

optuna = pytest.importorskip("optuna", reason='the sweep extra is not installed (pip install -e ".[sweep]")')

TRIAL_FLAGS = [
    "--preset", "dev", "--data", "f.npz", "--batch_size", "16", "--eval_batches", "1", "--coord_dim_n", "4",
    "--layers", "dense:8", "--max_windows", "9", "--eval_every_windows", "3", "--log_every_windows", "3",
    "--validation_fraction", "0.2", "--lr_warmup_windows", "0", "--ema_decay", "0", "--update_rule", "momentum",
]  # fmt: skip
SPACE = "eta_update: {low: 1.0e-3, high: 1.0e-1, log: true}\nfree_steps: {low: 3, high: 8}\n"


@pytest.fixture()
def here(tmp_path, monkeypatch):
    """tmp_path as the working directory, holding f.npz (3 classes of 6 features) and space.yaml."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TQDM_DISABLE", "1")
    x, y = clustered(200, spread=2)
    np.savez(tmp_path / "f.npz", x=x, y=y)
    (tmp_path / "space.yaml").write_text(SPACE)
    return tmp_path


def sweep_args(*extra: str, space: str = "space.yaml", trials: int = 4) -> list[str]:
    return ["sweep", "--space", space, "--trials", str(trials), *TRIAL_FLAGS, *extra]


def study_of(folder: Path, storage: str | None = None):
    url = storage or f"sqlite:///{folder / 'study.db'}"
    return optuna.load_study(study_name=optuna.get_all_study_names(url)[0], storage=url)


def counted(study) -> int:
    """Finished trials as the docs count them: COMPLETE, PRUNED, and FAIL unless retried."""
    trials = study.get_trials()
    retried = {t.user_attrs.get("retry_of") for t in trials}
    return sum(t.state.is_finished() and t.number not in retried for t in trials)


def test_a_sweep_runs_ordinary_trials_writes_its_results_and_resumes(here, capsys):
    assert main(sweep_args("--pruner", "none")) == 0
    out = capsys.readouterr().out
    folder = here / "checkpoints/sweeps/dev-space"
    for n in range(4):  # each trial is a run folder that every tool reads
        assert {"config.yaml", "summary.json", "telemetry.jsonl"} <= {p.name for p in (folder / f"trial-{n}").iterdir()}
    rows = list(csv.DictReader(open(folder / "trials.csv")))
    assert [r["state"] for r in rows] == ["COMPLETE"] * 4
    values = [float(r["value"]) for r in rows]
    assert values == sorted(values)  # the validation loss: best (lowest) first
    assert set(rows[0]) >= {"number", "value", "state", "eta_update", "free_steps", "windows", "seconds"}
    study = study_of(folder)
    assert study.direction.name == "MINIMIZE" and study.user_attrs["objective"] == "validation_loss"
    assert study.best_value == values[0] and rows[0]["windows"] == "9"
    best_summary = yaml.safe_load((folder / f"trial-{rows[0]['number']}/summary.json").read_text())
    assert study.best_value == best_summary["validation_loss"]  # the value is the trial's own validation loss
    first = study.trials[0]  # the sweep starts from the config it was given: the dev preset's own values
    assert first.params == {"eta_update": 0.0025, "free_steps": 6} and first.user_attrs["start"] is True
    assert len({t.params["eta_update"] for t in study.trials}) == 4
    assert "validation / held-out loss" in out and ", acc " in out and "wall time" in out
    best = yaml.safe_load((folder / "best.yaml").read_text())
    assert best["base"] == "dev" and best["eta_update"] == study.best_params["eta_update"] and "run_name" not in best
    assert main(["--preset", str(folder / "best.yaml"), "--print_config"]) == 0  # a preset that runs as is
    if importlib.util.find_spec("matplotlib") is not None:  # the plot extra
        assert {"history.png", "slice.png"} <= {p.name for p in (folder / "plots").iterdir()}
    capsys.readouterr()
    assert main(sweep_args("--pruner", "none")) == 0  # the same command again: the study has its 4 finished trials
    assert len(study_of(folder).trials) == 4 and "trial 4" not in capsys.readouterr().out
    assert main(sweep_args("--pruner", "none", trials=6)) == 0  # --trials counts finished trials
    assert len(study_of(folder).trials) == 6 and (folder / "trial-5/summary.json").is_file()


@pytest.mark.parametrize(
    "space, extra, named",
    [
        ("eta_updte: {low: 0.001, high: 0.1}\n", [], "'eta_updte' is not a config field"),
        ("free_steps: {low: 8, high: 8}\n", [], "free_steps: empty range"),
        ("eta_update: {low: 1.0e-6, high: 10.0, log: true}\n", [], "eta_update: the config refuses 10.0"),
        ("relaxation: {choices: [jacobi, diagonal]}\n", [], "relaxation: the config refuses 'diagonal'"),
        ("validation_fraction: {low: 0.1, high: 0.3}\n", [], "validation_fraction cannot be swept"),
        (SPACE, ["--storage", "postgresql://x@127.0.0.1:1/db"], "--storage postgresql://x@127.0.0.1:1/db"),
        (SPACE, ["--validation_fraction", "0"], "--validation_fraction > 0"),
    ],
)
def test_bad_input_is_refused_by_name_before_any_trial(here, capsys, space, extra, named):
    (here / "bad.yaml").write_text(space)
    assert main(sweep_args(*extra, space="bad.yaml")) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not list(here.glob("checkpoints/**/trial-*"))


def test_a_space_naming_code_needs_consent_and_imports_nothing(here, capsys, monkeypatch):
    """The space file (and the study holding its values) may have been handed over: a dotted name among its choices is
    data, refused before any trial unless --trust_code, and its module is never imported."""
    (here / "evil_space.py").write_text("from pathlib import Path\nPath('imported.txt').write_text('imported')\n")
    monkeypatch.syspath_prepend(str(here))  # importable: only the trust boundary stands between it and the import
    (here / "coded.yaml").write_text("rule: {choices: [ep, evil_space.Rule]}\n")
    assert main(sweep_args(space="coded.yaml")) == 2
    err = capsys.readouterr().err
    assert "evil_space.Rule" in err and "--trust_code" in err and "Traceback" not in err
    assert not (here / "imported.txt").exists() and not list(here.glob("checkpoints/**/trial-*"))


def test_a_diverging_trial_is_failed_with_its_reason_and_the_sweep_goes_on(here, capsys):
    (here / "wild.yaml").write_text("eta_update: {choices: [1.0, 0.05]}\n")
    assert main(sweep_args("--pruner", "none", space="wild.yaml", trials=5)) == 0
    trials = study_of(here / "checkpoints/sweeps/dev-wild").trials
    failed = [t for t in trials if t.state.name == "FAIL"]
    assert failed and all(t.params["eta_update"] == 1.0 and "diverged" in t.user_attrs["reason"] for t in failed)
    assert any(t.state.name == "COMPLETE" for t in trials) and len(trials) == 5
    rows = list(csv.DictReader(open(here / "checkpoints/sweeps/dev-wild/trials.csv")))
    assert rows[0]["state"] == "COMPLETE" and "diverged" in rows[-1]["reason"]


def test_the_pruner_stops_hopeless_trials_at_an_evaluation(here, capsys):
    (here / "poor.yaml").write_text("eta_update: {choices: [0.05, 1.0e-6]}\n")
    args = sweep_args("--max_windows", "12", space="poor.yaml", trials=6)
    assert main(args) == 0
    trials = study_of(here / "checkpoints/sweeps/dev-poor").trials
    pruned = [t for t in trials if t.state.name == "PRUNED"]
    assert pruned and all(t.user_attrs["windows"] < 12 for t in pruned)
    for t in pruned:  # stopped saved, as a run stopped by a signal is
        summary = yaml.safe_load((here / f"checkpoints/sweeps/dev-poor/trial-{t.number}/summary.json").read_text())
        assert summary["interrupted"] == "pruned"
    assert "best: trial" in capsys.readouterr().out


def test_objective_acc_ranks_by_accuracy_and_a_study_keeps_its_objective(here, capsys):
    """--objective acc maximises validation accuracy; a study made by a trainer2 before --objective (it maximised
    accuracy, and recorded nothing) is refused under the default loss with the flag that continues it."""
    optuna.create_study(study_name="dev-space", storage=f"sqlite:///{here / 'old.db'}", direction="maximize")
    assert main(sweep_args("--storage", f"sqlite:///{here / 'old.db'}", trials=2)) == 2
    err = capsys.readouterr().err
    assert "ranks its trials by validation_acc" in err and "--objective acc" in err and "Traceback" not in err
    assert main(sweep_args("--storage", f"sqlite:///{here / 'old.db'}", "--objective", "acc", "--pruner", "none",
                           trials=3)) == 0  # fmt: skip
    folder = here / "checkpoints/sweeps/dev-space"
    rows = list(csv.DictReader(open(folder / "trials.csv")))
    values = [float(r["value"]) for r in rows]
    assert len(rows) == 3 and values == sorted(values, reverse=True)  # accuracy: best (highest) first
    summary = yaml.safe_load((folder / f"trial-{rows[0]['number']}/summary.json").read_text())
    assert values[0] == summary["validation_acc"]
    assert "validation / held-out acc" in capsys.readouterr().out


GRAPH = """layers: [{name: h}]
couplings:
  - {dense: 8, from: input, to: h}
"""


def test_a_coupling_key_the_config_does_not_set_can_be_swept(here, capsys):
    """couplings.0.gain names a key the graph's first coupling takes but does not set: each trial's config sets it to
    the trial's value; a key the coupling does not take is refused by the config's own message before any trial."""
    (here / "graph.yaml").write_text(GRAPH)
    (here / "gains.yaml").write_text("couplings.0.gain: {low: 0.5, high: 2.0}\ncouplings.0.lr: {choices: [0.5, 2.0]}\n")
    args = [a for a in sweep_args("--config", "graph.yaml", "--pruner", "none", space="gains.yaml", trials=2)]
    drop = args.index("--layers")
    args = args[:drop] + args[drop + 2 :]  # the graph's layers come from graph.yaml
    assert main(args) == 0
    folder = here / "checkpoints/sweeps/dev-gains"
    study = study_of(folder)
    first = study.trials[0]  # the base's gain (unset: 1) lies in the space, its lr (1) is no choice: proposed
    assert first.user_attrs["start"] is True and first.params["couplings.0.gain"] == 1.0
    for t in study.trials:
        cfg = yaml.safe_load((folder / f"trial-{t.number}/config.yaml").read_text())
        entry = cfg["couplings"][0]
        assert entry["gain"] == t.params["couplings.0.gain"] and entry["lr"] == t.params["couplings.0.lr"]
        assert entry["dense"] == 8 and entry["to"] == "h"
    (here / "typo.yaml").write_text("couplings.0.gian: {low: 0.5, high: 2.0}\n")
    assert main([*args[:2], "typo.yaml", *args[3:]]) == 2
    err = capsys.readouterr().err
    assert "couplings.0.gian: the config refuses" in err and "gian" in err and "Traceback" not in err


def test_sweep_from_python(here):
    data = trainer2.from_arrays(*clustered(150, dim=5, spread=2, seed=1))
    fields = dict(batch_size=16, eval_batches=1, coord_dim_n=4, layers=[{"dense": 8}], max_windows=6)
    space = {"eta_update": {"low": 0.01, "high": 0.1, "log": True}}
    lines: list[str] = []
    result = trainer2.sweep(space, "dev", data, trials=2, sweep_dir=here / "s", log=lines.append, **fields)
    assert result["best_trial"] in (0, 1) and set(result["heldout"]) >= {"heldout_acc", "heldout_loss"}
    assert any("validation_fraction" in line for line in lines)  # the default split is said
    assert (here / "s/trial-1/summary.json").is_file()


def run_workers(here: Path, storage: str | None, trials: int = 4) -> Path:
    extra = ["--storage", storage] if storage else []
    args = sweep_args("--workers", "2", "--max_windows", "30", "--pruner", "none", *extra, trials=trials)
    done = subprocess.run([sys.executable, "-m", "trainer2", *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return here / "checkpoints/sweeps/dev-space"


def assert_distinct_trials(folder: Path, study, trials: int) -> None:
    finished = study.get_trials()
    assert sorted(t.number for t in finished) == list(range(trials)) and counted(study) == trials
    for t in finished:  # each trial ran once, in its own folder, with its own values
        assert t.state.name == "COMPLETE"
        cfg = yaml.safe_load((folder / f"trial-{t.number}/config.yaml").read_text())
        assert cfg["eta_update"] == t.params["eta_update"]
        assert sum(1 for _ in open(folder / f"trial-{t.number}/telemetry.jsonl")) == 10  # windows 3..30, once each
    assert len({t.params["eta_update"] for t in finished}) == trials


def test_two_workers_share_one_sqlite_study(here):
    folder = run_workers(here, None)
    assert_distinct_trials(folder, study_of(folder), 4)


def test_two_workers_share_one_postgresql_study(here, postgres_url):  # noqa: F811
    folder = run_workers(here, postgres_url)
    assert_distinct_trials(folder, study_of(folder, postgres_url), 4)


def test_a_worker_killed_mid_trial_is_retried_once_from_its_checkpoint(here):
    args = [sys.executable, "-m", "trainer2", *sweep_args("--max_windows", "300", "--save_every_windows", "5",
            "--eval_every_windows", "100", "--pruner", "none", trials=3)]  # fmt: skip
    worker = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    folder = here / "checkpoints/sweeps/dev-space"
    killed = None
    while killed is None:  # freeze the worker; kill it only inside a trial that has saved a checkpoint
        assert worker.poll() is None, "the sweep ended before it could be killed mid-trial"
        time.sleep(0.05)
        os.kill(worker.pid, signal.SIGSTOP)
        going = [p for p in folder.glob("trial-*") if list(p.glob("step_*")) and not (p / "summary.json").exists()]
        if going:
            killed = int(going[0].name.removeprefix("trial-"))
            saved = sorted(p.name for p in going[0].glob("step_*"))
            worker.kill()
        else:
            os.kill(worker.pid, signal.SIGCONT)
    worker.wait()
    again = subprocess.run(args, capture_output=True, text=True, timeout=600)  # the same command again
    assert again.returncode == 0, again.stderr
    study = study_of(folder)
    assert counted(study) == 3
    dead = study.trials[killed]
    assert dead.state.name == "FAIL" and "died mid-trial" in dead.user_attrs["reason"]
    (retry,) = [t for t in study.trials if t.user_attrs.get("retry_of") == killed]
    assert retry.state.name == "COMPLETE" and retry.params == dead.params and retry.user_attrs["windows"] == 300
    assert sorted(p.name for p in (folder / f"trial-{killed}").glob("step_*")) == saved  # left as it was
    telemetry = (folder / f"trial-{retry.number}/telemetry.jsonl").read_text().splitlines()
    first = int(saved[-1].removeprefix("step_"))
    assert yaml.safe_load(telemetry[0])["window"] > first  # it continued from the killed trial's checkpoint
    assert f"retried as trial {retry.number}" in (folder / "trials.csv").read_text()


def test_sigterm_stops_a_worker_saved_and_the_same_command_continues_its_trial(here):
    """SIGTERM mid-trial: the worker saves the trial's checkpoint at the window it stopped, records the trial as failed
    ("stopped by SIGTERM"), queues it again and exits 128 + 15; the same command continues it from that checkpoint."""
    args = [sys.executable, "-m", "trainer2", *sweep_args("--max_windows", "300", "--save_every_windows", "50",
            "--eval_every_windows", "100", "--pruner", "none", trials=2)]  # fmt: skip
    worker = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    folder = here / "checkpoints/sweeps/dev-space"
    while not list(folder.glob("trial-*/step_*")):  # inside a trial that has begun saving
        assert worker.poll() is None, "the sweep ended before it could be stopped mid-trial"
        time.sleep(0.05)
    worker.send_signal(signal.SIGTERM)
    _, err = worker.communicate(timeout=300)
    assert worker.returncode == 128 + signal.SIGTERM, err
    study = study_of(folder)
    (stopped,) = [t for t in study.trials if t.state.name == "FAIL"]
    assert "stopped by SIGTERM" in stopped.user_attrs["reason"]
    summary = yaml.safe_load((folder / f"trial-{stopped.number}/summary.json").read_text())
    assert summary["interrupted"] == "SIGTERM" and summary["windows"] < 300
    last = sorted((folder / f"trial-{stopped.number}").glob("step_*"))[-1]
    assert int(last.name.removeprefix("step_")) == summary["windows"]  # saved where it stopped
    (queued,) = [t for t in study.trials if t.state.name == "WAITING"]
    assert queued.user_attrs["retry_of"] == stopped.number
    again = subprocess.run(args, capture_output=True, text=True, timeout=600)  # the same command again
    assert again.returncode == 0, again.stderr
    study = study_of(folder)
    assert counted(study) == 2
    (retry,) = [t for t in study.trials if t.user_attrs.get("retry_of") == stopped.number]
    assert retry.state.name == "COMPLETE" and retry.user_attrs["windows"] == 300 and retry.params == stopped.params
    telemetry = (folder / f"trial-{retry.number}/telemetry.jsonl").read_text().splitlines()
    first = yaml.safe_load(telemetry[0])["window"]  # a row every 3 windows: the first after the stop's checkpoint
    assert summary["windows"] < first <= summary["windows"] + 3


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="no /proc: a zombie looks like a live process")
def test_a_worker_killed_under_the_worker_that_started_it_counts_as_dead():
    """`--workers 2`: the first worker started the second, so a `kill -9` of the second leaves a zombie until the first
    collects it, after its own trials; the dead worker's trial must be retried now, not left running to the end."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert pid_alive(child.pid)
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while pid_alive(child.pid):
            assert time.monotonic() < deadline, "a killed child, not yet collected, still counts as alive"
            time.sleep(0.05)
        assert child.returncode is None  # never collected: what was seen as dead was the zombie
    finally:
        child.kill()
        child.wait()
