"""No run is lost: signals, a second run on the same directory, resuming into another run, full disks, killed
saves, divergence. Signals and the lock are exercised on real processes."""

from __future__ import annotations

import errno
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from test_checkpoint import (
    TINY,
    assert_same_checkpoint,
    config,
    fixture_saved,  # noqa: F401 (the fixture `saved`)
    flags,
    quiet,
    run_dir,
    strip_wall,
)

from trainer2.cli import main
from trainer2.learning.gradients import ep_gradients
from trainer2.monitor import telemetry as telemetry_module
from trainer2.monitor.telemetry import TELEMETRY_FILE, read_telemetry
from trainer2.presets import preset_dir, read_yaml
from trainer2.running import checkpoint as ck
from trainer2.running.checkpointing import HISTORY_ROWS
from trainer2.running.health import Diverged
from trainer2.running.rundir import LOCK_FILE, RunLock, fresh_name
from trainer2.running.signals import StopSignals
from trainer2.running.trainer import Trainer

REPO = Path(__file__).resolve().parent.parent
PATIENCE = 180.0  # seconds to wait for a subprocess on a loaded machine; polling ends as soon as it is there


def start_run(argv: list[str], out: Path) -> subprocess.Popen:
    """`python main.py ARGV` in a child process, its output in files; SIGINT reset to the default, so Python
    installs its handler even where the test runner's shell ignores SIGINT (a background job)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    return subprocess.Popen(
        [sys.executable, "main.py", *argv],
        cwd=REPO,
        env=env,
        stdout=open(out / "stdout", "w"),
        stderr=open(out / "stderr", "w"),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def wait_for(what, proc: subprocess.Popen | None = None, timeout: float = PATIENCE):
    """Poll until what() is truthy; fail early if `proc` exits first."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = what()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run exited with {proc.returncode} before the condition held")
        time.sleep(0.05)
    raise AssertionError("timed out")


def telemetry_rows(path: Path) -> int:
    return len(read_telemetry(path)) if path.is_file() else 0


# --- 1. SIGINT / SIGTERM: finish the window, save, say how to resume, exit 130 / 143; resume is bitwise exact ---


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_saves_and_the_run_resumes_bitwise_identical(tmp_path, small_text, sig):
    out = tmp_path / "out"
    out.mkdir()
    endless = flags(tmp_path, small_text, run_name="cut", max_windows=10**9, log_every_windows=5, eval_every_windows=10)
    proc = start_run(endless, out)
    rd = run_dir(tmp_path, "cut")
    wait_for(lambda: telemetry_rows(rd / TELEMETRY_FILE) >= 2, proc)
    proc.send_signal(sig)
    assert proc.wait(timeout=PATIENCE) == 128 + sig
    err = (out / "stderr").read_text()
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "resume with:" in line]
    assert len(lines) == 1 and sig.name in lines[0], err
    cut = ck.find_latest(rd)
    w = ck.step_of(cut)
    summary = json.loads((rd / "summary.json").read_text())
    assert summary["interrupted"] == sig.name and summary["windows"] == w and summary["diverged"] is False
    # the printed command continues the run (to a fixed end, so an uninterrupted run can be compared)
    command = shlex.split(lines[0].split("resume with:", 1)[1])
    assert command[:2] == ["python", "main.py"] and command[2:6] == ["--resume", "latest", "--run_name", "cut"]
    assert main([*command[2:], "--max_windows", str(w + 12)]) == 0
    assert (
        main(
            flags(
                tmp_path, small_text, run_name="whole", max_windows=w + 12, log_every_windows=5, eval_every_windows=10
            )
        )
        == 0
    )
    name = ck.step_name(w + 12)
    assert_same_checkpoint(run_dir(tmp_path, "whole") / name, rd / name)
    whole_rows, cut_rows = (read_telemetry(run_dir(tmp_path, r) / TELEMETRY_FILE) for r in ("whole", "cut"))
    assert strip_wall(cut_rows) == strip_wall(whole_rows)  # one record, windows in order, nothing lost or repeated


def test_a_second_signal_ends_the_process_at_once_without_a_traceback():
    script = (
        "import os, signal, time\n"
        "from trainer2.running.signals import StopSignals\n"
        "with StopSignals() as s:\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    while s.received is None: time.sleep(0.01)\n"
        "    print('first', s.received.name, flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(600)\n"
        "print('not reached')\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=PATIENCE)
    assert proc.returncode == -signal.SIGTERM  # ended by the signal itself: the shell reports 143
    assert proc.stdout == "first SIGTERM\n" and proc.stderr == ""


def test_the_first_signal_stops_after_the_current_window_and_handlers_are_restored(tmp_path, small_text):
    before = signal.getsignal(signal.SIGTERM)
    seen = []

    def signalled_at_window_7(relax, inputs, targets):
        seen.append(signal.getsignal(signal.SIGTERM))
        if len(seen) == 7:
            signal.raise_signal(signal.SIGTERM)  # in the middle of window 7; the handler has run when this returns
            seen.append(signal.getsignal(signal.SIGTERM))
        return ep_gradients(relax, inputs, targets)

    tr = Trainer(
        config(tmp_path, small_text, run_name="s", max_windows=40), gradients=signalled_at_window_7, log=lambda m: None
    )
    summary = tr.train()
    assert summary["interrupted"] == "SIGTERM" and summary["windows"] == 7 and len(seen) == 8
    assert [p.name for p in ck.list_checkpoints(run_dir(tmp_path, "s"))] == ["step_00000007"]
    assert seen[0] != before and seen[-1] == signal.SIG_DFL  # ours during the run, the default after the first signal
    assert signal.getsignal(signal.SIGTERM) is before


def test_handlers_are_left_alone_outside_the_main_thread_and_when_ignored(tmp_path, small_text):
    seen = []

    def record(relax, inputs, targets):
        seen.append(signal.getsignal(signal.SIGTERM))
        return ep_gradients(relax, inputs, targets)

    before = signal.getsignal(signal.SIGTERM)
    tr = Trainer(config(tmp_path, small_text, run_name="t", max_windows=2), gradients=record, log=lambda m: None)
    worker = threading.Thread(target=tr.train)
    worker.start()
    worker.join()
    assert seen == [before, before]
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a background job ignores SIGINT: it must stay ignored
    try:
        with StopSignals():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, old)


def test_ctrl_c_before_training_starts_is_not_a_traceback_and_leaves_no_directory(
    tmp_path, small_text, capsys, monkeypatch
):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("trainer2.running.parts.load_data", interrupted)
    assert main(flags(tmp_path, small_text, run_name="early")) == 130
    assert "interrupted" in capsys.readouterr().err
    assert not run_dir(tmp_path, "early").exists()  # the directory the lock created held nothing: removed


# --- 2. a run directory is locked while a run uses it ---


def test_a_second_run_on_a_run_directory_is_refused_naming_the_holder_until_it_dies(tmp_path, small_text, capsys):
    out = tmp_path / "out"
    out.mkdir()
    holder = start_run(
        flags(
            tmp_path,
            small_text,
            run_name="L",
            max_windows=10**9,
            log_every_windows=5,
            save_every_windows=5,
            keep_last=1000,
            eval_every_windows=0,
        ),
        out,
    )
    rd = run_dir(tmp_path, "L")
    try:
        wait_for(lambda: ck.list_checkpoints(rd), holder)
        names = f"pid {holder.pid} on host {socket.gethostname()}"
        for argv in (
            ["--resume", "latest", "--checkpoint_dir", str(tmp_path / "ck"), "--run_name", "L", "--max_windows", "10"],
            flags(tmp_path, small_text, run_name="L"),
        ):
            assert main(argv) == 2
            err = capsys.readouterr().err
            assert "is in use by another run" in err and names in err, err
    finally:
        holder.kill()  # SIGKILL: no chance to clean up; the kernel drops its lock
        holder.wait(timeout=PATIENCE)
    newest = ck.step_of(ck.find_latest(rd))
    assert (
        main(
            [
                "--resume",
                "latest",
                "--checkpoint_dir",
                str(tmp_path / "ck"),
                "--run_name",
                "L",
                "--max_windows",
                str(newest + 2),
            ]
        )
        == 0
    )
    assert ck.find_latest(rd).name == ck.step_name(newest + 2)
    assert json.loads((rd / LOCK_FILE).read_text())["pid"] == os.getpid()  # the stale holder was replaced


def test_the_lock_is_exclusive_between_two_holders_and_released(tmp_path):
    rd = tmp_path / "ck" / "x"
    with RunLock(rd):
        (rd / "config.yaml").write_text("x")
        with pytest.raises(ValueError, match=f"pid {os.getpid()} on host"):
            RunLock(rd).__enter__()
    with RunLock(rd):  # released on exit
        pass
    assert (rd / "config.yaml").exists()


# --- 3, 4. never into another run's directory ---


def test_resuming_into_another_existing_run_is_refused_naming_both(tmp_path, small_text, capsys):
    quiet(config(tmp_path, small_text, run_name="base", max_windows=10, save_every_windows=5, keep_last=5)).train()
    quiet(config(tmp_path, small_text, run_name="d8", max_windows=8)).train()
    d8 = run_dir(tmp_path, "d8")
    before = {p.name: p.read_bytes() for p in d8.rglob("*") if p.is_file()}  # a library run: no lock file
    base5 = run_dir(tmp_path, "base") / "step_00000005"
    assert main(["--resume", str(base5), "--run_name", "d8", "--max_windows", "12", "--keep_last", "1"]) == 2
    err = capsys.readouterr().err
    assert "run 'base'" in err and "into run 'd8'" in err and "Traceback" not in err
    assert {p.name: p.read_bytes() for p in d8.rglob("*") if p.is_file() and p.name != LOCK_FILE} == before
    assert main(["--resume", str(base5), "--run_name", "branch", "--max_windows", "7"]) == 0  # a new name branches off
    assert ck.find_latest(run_dir(tmp_path, "branch")).name == "step_00000007"


@pytest.mark.parametrize("left", [TELEMETRY_FILE, "config.yaml", "summary.json"])
def test_a_fresh_run_never_writes_into_a_directory_holding_another_runs_files(tmp_path, small_text, capsys, left):
    rd = run_dir(tmp_path, "old")
    rd.mkdir(parents=True)
    (rd / left).write_text('{"window": 50}\n')  # what a run killed before its first checkpoint leaves
    assert main(flags(tmp_path, small_text, run_name="old", max_windows=3)) == 2
    assert f"already has files ({left}" in capsys.readouterr().err
    assert (
        sorted(p.name for p in rd.iterdir()) == [left]  # and no lock file left behind
        and (rd / left).read_text() == '{"window": 50}\n'
    )


# --- 5. fresh names; --resume latest takes the newest run ---


def test_runs_without_a_name_get_fresh_ones_and_resume_latest_takes_the_newest(tmp_path, small_text, capsys):
    for preset in ("dev", "production", "deep", "profiling", "conv"):
        assert "run_name" not in read_yaml(preset_dir() / f"{preset}.yaml")
    preset = tmp_path / "tinyp.yaml"
    preset.write_text(
        "".join(f"{k}: {json.dumps(v)}\n" for k, v in {**TINY, "data": str(small_text), "max_windows": 3}.items())
    )
    ckdir = ["--checkpoint_dir", str(tmp_path / "ck")]
    for _ in range(2):
        assert main(["--preset", str(preset), *ckdir]) == 0
    assert main(["--preset", str(preset), *ckdir, "--run_name", "mine"]) == 0  # an explicit name always wins
    assert main(flags(tmp_path, small_text, max_windows=3)) == 0  # no preset, no name
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["mine", "run-1", "tinyp-1", "tinyp-2"]
    assert fresh_name(tmp_path / "ck", "tinyp") == "tinyp-3"
    # the newest run is the one whose newest checkpoint was written last, whatever its name
    for age, run in enumerate(("tinyp-2", "mine", "run-1", "tinyp-1")):
        meta = ck.find_latest(run_dir(tmp_path, run)) / ck.META_FILE
        os.utime(meta, ns=(10**18 + age * 10**9,) * 2)
    capsys.readouterr()
    assert main(["--resume", "latest", *ckdir, "--max_windows", "5"]) == 0
    assert ck.find_latest(run_dir(tmp_path, "tinyp-1")).name == "step_00000005"
    assert "resumed from" in capsys.readouterr().out


def test_ranks_of_one_torchrun_job_arrive_at_the_same_fresh_name(tmp_path, monkeypatch):
    ckdir = tmp_path / "ck"
    (ckdir / "dev-1").mkdir(parents=True)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    with RunLock(ckdir / "dev-2"):  # rank 0 of job-a has taken dev-2 before rank 1 looks
        assert fresh_name(ckdir, "dev") == "dev-2"
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")
        assert fresh_name(ckdir, "dev") == "dev-3"  # another job's directory is taken
        monkeypatch.delenv("TORCHELASTIC_RUN_ID")
        assert fresh_name(ckdir, "dev") == "dev-3"


# --- 6. a checkpoint never decides where a resumed run writes ---


def test_paths_stored_in_a_checkpoint_do_not_steer_where_the_resumed_run_writes(tmp_path, small_text):
    quiet(config(tmp_path, small_text, run_name="src", max_windows=5)).train()
    step = run_dir(tmp_path, "src") / "step_00000005"
    meta = json.loads((step / ck.META_FILE).read_text())
    meta["config"].update(checkpoint_dir=str(tmp_path / "victims"), run_name="victim")
    (step / ck.META_FILE).write_text(json.dumps(meta))
    assert main(["--resume", str(step), "--max_windows", "7"]) == 0
    assert not (tmp_path / "victims").exists()
    assert ck.find_latest(run_dir(tmp_path, "src")).name == "step_00000007"
    copied = tmp_path / "elsewhere" / "copy" / "step_00000005"  # a checkpoint brought from another machine
    copied.parent.mkdir(parents=True)
    os.rename(step, copied)
    assert main(["--resume", str(copied), "--max_windows", "6"]) == 0
    assert ck.find_latest(copied.parent).name == "step_00000006" and not (tmp_path / "victims").exists()


def test_resuming_a_directory_that_is_no_checkpoint_writes_nothing(tmp_path, capsys):
    (tmp_path / "data" / "stuff").mkdir(parents=True)
    assert main(["--resume", str(tmp_path / "data" / "stuff")]) == 2
    assert "neither a checkpoint" in capsys.readouterr().err  # not "missing meta.json": it reads as corruption
    assert [p.name for p in tmp_path.rglob("*")] == ["data", "stuff"]  # no lock file, no run directory


# --- 7. a full disk or a read-only directory ---


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),  # on a full tmpfs
        SafetensorError(
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
        ),
    ],
)
def test_a_full_disk_during_a_save_is_a_clear_error_and_loses_no_checkpoint(
    tmp_path, small_text, capsys, monkeypatch, error
):
    real, calls = ck.save_file, []

    def full_after_one(tensors, filename):
        calls.append(filename)
        if len(calls) > 1:
            Path(filename).write_bytes(b"the first bytes of a file")
            raise error
        real(tensors, filename)

    monkeypatch.setattr(ck, "save_file", full_after_one)
    assert main(flags(tmp_path, small_text, run_name="r", max_windows=20, save_every_windows=5)) == 74
    err = capsys.readouterr().err
    rd = run_dir(tmp_path, "r")
    assert f"{rd / 'step_00000010'}: No space left on device; checkpoints saved before it are intact" in err
    assert "Traceback" not in err
    assert sorted(p.name for p in rd.iterdir() if p.name.startswith(".tmp")) == []  # the temporary directory is gone
    first = rd / "step_00000005"
    assert ck.list_checkpoints(rd) == [first]
    ck.load_tensors(first, ck.read_meta(first))  # whole: size and sha256 match the sidecar
    monkeypatch.setattr(ck, "save_file", real)  # space is freed: the run continues
    assert main(["--resume", "latest", "--checkpoint_dir", str(tmp_path / "ck"), "--run_name", "r"]) == 0
    assert ck.find_latest(rd).name == "step_00000020"


def test_a_full_disk_during_a_telemetry_write_tears_no_record(tmp_path, small_text, capsys, monkeypatch):
    real_open, lines = open, []

    class FillsUp:
        """A telemetry file on a disk that fills up in the middle of the third line."""

        def __init__(self, f):
            self.f = f

        def write(self, data):
            lines.append(bytes(data))
            if len(lines) == 3:
                self.f.write(bytes(data)[:17])
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

    def fake_open(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        return FillsUp(f) if mode == "ab" else f

    monkeypatch.setattr(telemetry_module, "open", fake_open, raising=False)
    argv = flags(
        tmp_path,
        small_text,
        run_name="t",
        max_windows=20,
        log_every_windows=2,
        save_every_windows=4,
        eval_every_windows=0,
    )
    assert main(argv) == 74
    err = capsys.readouterr().err
    path = run_dir(tmp_path, "t") / TELEMETRY_FILE
    assert f"{path}: No space left on device" in err and "Traceback" not in err
    assert not path.read_bytes().endswith(b"\n")  # the torn line is there...
    assert [r["window"] for r in read_telemetry(path)] == [2, 4]  # ...and a reader drops it
    monkeypatch.undo()
    assert main(["--resume", "latest", "--checkpoint_dir", str(tmp_path / "ck"), "--run_name", "t"]) == 0
    text = path.read_text()
    assert text.endswith("\n") and [json.loads(line)["window"] for line in text.splitlines()] == list(range(2, 21, 2))


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_checkpoint_directory_is_a_clear_error(tmp_path, small_text, capsys):
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck").chmod(0o500)
    try:
        assert main(flags(tmp_path, small_text, run_name="ro", max_windows=3)) == 74
    finally:
        (tmp_path / "ck").chmod(0o700)
    err = capsys.readouterr().err
    assert "Permission denied" in err and str(tmp_path / "ck") in err and "Traceback" not in err


# --- 8. killed saves leave temporary directories; the next start removes those of dead processes ---


def test_temporary_directories_of_dead_processes_are_removed_at_start(tmp_path, small_text, saved, capsys):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout.strip()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    rd = saved.parent
    try:
        orphans = [rd / f".tmp-step_00000020-{dead}", rd / f".tmp-old-step_00000010-{dead}"]
        busy = rd / f".tmp-step_00000030-{alive.pid}"  # a save still running (of a process that ignores the lock)
        for d in (*orphans, busy):
            d.mkdir()
            (d / ck.TENSORS_FILE).write_bytes(b"\0" * 100_000)
        assert (
            main(
                [
                    "--resume",
                    "latest",
                    "--checkpoint_dir",
                    str(tmp_path / "ck"),
                    "--run_name",
                    "r",
                    "--max_windows",
                    "11",
                ]
            )
            == 0
        )
        assert "removed 2 temporary checkpoint directories" in capsys.readouterr().out
        assert not any(d.exists() for d in orphans) and busy.exists()
    finally:
        alive.kill()
        alive.wait()


# --- 9. divergence stops the run; an unsettled free phase is warned about; summary.json is strict JSON ---


def strict_json(text: str) -> dict:
    def refuse(name):
        raise AssertionError(f"summary.json holds {name}, which is not JSON")

    return json.loads(text, parse_constant=refuse)


def poisoned_from(window: int, what: str):
    """EP gradients, but from `window` on: what="parameter" sets a bias entry to inf during the step, as an
    overflow would; what="gradients" returns NaN gradients, so every update is dropped."""
    calls = []

    def source(relax, inputs, targets):
        calls.append(1)
        if len(calls) >= window and what == "parameter":
            relax.m.energy.biases[0][0] = float("inf")
        out = ep_gradients(relax, inputs, targets)
        if len(calls) >= window and what == "gradients":
            out.grads = {k: torch.full_like(g, float("nan")) for k, g in out.grads.items()}
        return out

    return source


@pytest.mark.parametrize(
    "log_every, message",
    [
        (
            5,
            "the parameters became non-finite between windows 6 and 10; "
            "the last checkpoint before it is {rd}/step_00000008",
        ),
        (
            50,
            "the parameters became non-finite between windows 1 and 12; "
            "the last checkpoint before it is {rd}/step_00000008",
        ),  # at a save
    ],
)
def test_non_finite_parameters_stop_the_run_naming_the_windows_and_the_last_good_checkpoint(
    tmp_path, small_text, log_every, message
):
    cfg = config(
        tmp_path,
        small_text,
        run_name="nan",
        max_windows=40,
        save_every_windows=4,
        keep_last=10,
        log_every_windows=log_every,
        eval_every_windows=0,
    )
    tr = Trainer(cfg, gradients=poisoned_from(9, "parameter"), log=lambda m: None)
    rd = run_dir(tmp_path, "nan")
    with pytest.raises(Diverged, match=re.escape(message.format(rd=rd))):
        tr.train()
    assert [p.name for p in ck.list_checkpoints(rd)] == ["step_00000004", "step_00000008"]  # nothing poisoned was saved
    summary = strict_json((rd / "summary.json").read_text())
    assert (
        summary["diverged"] is True
        and message.format(rd=rd) in summary["error"]
        and summary["windows"] == int(re.search(r"and (\d+);", message).group(1))
    )


def test_updates_dropped_for_50_windows_in_a_row_stop_the_run(tmp_path, small_text):
    cfg = config(
        tmp_path,
        small_text,
        run_name="drop",
        max_windows=400,
        save_every_windows=4,
        keep_last=100,
        log_every_windows=5,
        eval_every_windows=0,
    )
    with pytest.raises(
        Diverged,
        match=re.escape(
            "every update from window 11 to 60 was dropped (non-finite gradients: "
            f"learning has stopped); the last checkpoint before it is {run_dir(tmp_path, 'drop')}/step_00000008"
        ),
    ):
        Trainer(cfg, gradients=poisoned_from(9, "gradients"), log=lambda m: None).train()


def test_a_diverging_run_exits_3_and_says_so(tmp_path, small_text, capsys):
    argv = flags(
        tmp_path,
        small_text,
        run_name="wd",
        max_windows=300,
        update_rule="momentum",
        eta_update=1.0,
        weight_decay=10.0,
        log_every_windows=5,
        eval_every_windows=0,
    )
    assert main(argv) == 3
    err = capsys.readouterr().err
    assert "the run diverged:" in err and "Traceback" not in err
    summary = strict_json((run_dir(tmp_path, "wd") / "summary.json").read_text())
    assert summary["diverged"] is True and summary["windows"] < 300


def test_a_free_phase_that_does_not_settle_is_warned_about_once(tmp_path, small_text):
    said = []
    quiet_but = lambda m: said.append(m)  # noqa: E731
    Trainer(
        config(tmp_path, small_text, run_name="osc", dt=1.9, gamma=0.0, max_windows=20, log_every_windows=2),
        log=quiet_but,
    ).train()
    warnings = [m for m in said if "does not settle" in m]
    assert len(warnings) == 1
    for field in ("free_steps", "dt", "gamma", "spectral_cap"):
        assert field in warnings[0]
    said.clear()
    Trainer(config(tmp_path, small_text, run_name="calm", max_windows=20, log_every_windows=2), log=quiet_but).train()
    assert not [m for m in said if "does not settle" in m]


def test_summary_is_strict_json_with_non_finite_figures_as_null(tmp_path, small_text, monkeypatch):
    tr = quiet(config(tmp_path, small_text, run_name="inf", max_windows=2))
    monkeypatch.setattr(
        tr,
        "evaluate",
        lambda max_batches=None: {"heldout_loss": float("inf"), "heldout_bpc": float("nan"), "heldout_acc": 0.0},
    )
    summary = tr.train()
    written = strict_json((run_dir(tmp_path, "inf") / "summary.json").read_text())
    assert written == summary and written["heldout_loss"] is None and written["heldout_bpc"] is None
    assert written["diverged"] is False and written["interrupted"] is None


# --- 10. bounded history in meta.json ---


def test_meta_json_keeps_a_bounded_history_and_resumed_runs_agree(tmp_path, small_text):
    n = HISTORY_ROWS + 30
    whole = quiet(
        config(tmp_path, small_text, run_name="long", max_windows=n, log_every_windows=1, eval_every_windows=5)
    )
    whole.train()
    meta = ck.read_meta(ck.find_latest(run_dir(tmp_path, "long")))
    rows = read_telemetry(run_dir(tmp_path, "long") / TELEMETRY_FILE)
    assert len(rows) == n and len(meta["history"]) == HISTORY_ROWS
    assert strip_wall(meta["history"]) == strip_wall(rows[-HISTORY_ROWS:])
    cut = quiet(
        config(tmp_path, small_text, run_name="cut", max_windows=n - 25, log_every_windows=1, eval_every_windows=5)
    )
    cut.train()
    resumed = quiet(
        config(tmp_path, small_text, run_name="cut", max_windows=n, log_every_windows=1, eval_every_windows=5)
    )
    resumed.load_checkpoint(ck.find_latest(run_dir(tmp_path, "cut")))
    resumed.train()
    assert_same_checkpoint(run_dir(tmp_path, "long") / ck.step_name(n), run_dir(tmp_path, "cut") / ck.step_name(n))
    for k, t in whole.state_tensors().items():
        assert torch.equal(t, resumed.state_tensors()[k]), k
