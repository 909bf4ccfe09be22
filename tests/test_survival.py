"""Issue 39: a run survives losing its terminal. Output that goes away, SIGUSR1 / SIGUSR2 preemption, symlinked run
directories, non-finite checkpoints, files that are no regular files; each either finishes its work or is refused
with one line naming the cause."""

from __future__ import annotations

import errno
import io
import json
import math
import os
import shlex
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from test_checkpoint import assert_same_checkpoint, config, flags, quiet, run_dir

from trainer2.cli import main
from trainer2.io import console
from trainer2.io.safeio import write_replace
from trainer2.learning.gradients import ep_gradients
from trainer2.monitor.telemetry import Telemetry
from trainer2.running import checkpoint as ck
from trainer2.running.model import load as load_trained
from trainer2.running.rundir import LOCK_FILE
from trainer2.running.trainer import Trainer
from trainer2.train_config import TrainConfig

REPO = Path(__file__).resolve().parent.parent


def finished(tmp_path: Path, name: str, windows: int) -> dict:
    """The summary of a run that did all its windows and saved its final checkpoint."""
    rd = run_dir(tmp_path, name)
    assert ck.find_latest(rd).name == ck.step_name(windows)
    summary = json.loads((rd / "summary.json").read_text())
    assert summary["windows"] == windows and summary["interrupted"] is None
    return summary


# --- 1. output that goes away is never fatal ---


class Failing(io.StringIO):
    """A terminal that goes away after `lines` writes: every later write and flush raises `error`."""

    def __init__(self, lines: int, error: OSError | ValueError) -> None:
        super().__init__()
        self.lines, self.error = lines, error

    def write(self, text: str) -> int:
        if self.lines <= 0:
            raise self.error
        self.lines -= 1
        return super().write(text)

    def flush(self) -> None:
        if self.lines <= 0:
            raise self.error


@pytest.mark.parametrize(
    "error",
    [BrokenPipeError(errno.EPIPE, "Broken pipe"), OSError(errno.ENOSPC, "No space left"), ValueError("closed file")],
)
@pytest.mark.parametrize("lines", [0, 3])  # at start, and mid-run
def test_stdout_and_stderr_that_fail_never_end_the_run(tmp_path, small_text, monkeypatch, error, lines):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)  # the progress bar writes to stderr
    monkeypatch.setattr(sys, "stdout", Failing(lines, error))
    monkeypatch.setattr(sys, "stderr", Failing(lines, error))
    assert main([*flags(tmp_path, small_text, run_name="gone", max_windows=6, log_every_windows=2)]) == 0
    finished(tmp_path, "gone", 6)
    assert not isinstance(sys.stdout, console.Dropping)  # the streams are put back


def test_a_refusal_with_stderr_gone_still_exits_2(tmp_path, small_text, monkeypatch):
    monkeypatch.setattr(sys, "stderr", Failing(0, BrokenPipeError(errno.EPIPE, "Broken pipe")))
    assert main(flags(tmp_path, small_text, run_name="bad", max_windows=-1)) == 2


@pytest.mark.parametrize("how", ["closed from the start", "one pipe closed mid-run"])
def test_a_terminal_that_goes_away_loses_no_work(tmp_path, small_text, how):
    """Real descriptors: stdout and stderr closed before the start (`>&- 2>&-`: no file the run opens may take
    their numbers), or both on one pipe whose reader goes away after the first line (`2>&1 | head -1`)."""
    argv = [sys.executable, "main.py", *flags(tmp_path, small_text, run_name="t", max_windows=30)]
    env = {k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"}
    if how == "closed from the start":
        proc = subprocess.Popen(argv, cwd=REPO, env=env, preexec_fn=lambda: (os.close(1), os.close(2)))
    else:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        proc.stdout.readline()
        proc.stdout.close()
    assert proc.wait(timeout=300) == 0
    finished(tmp_path, "t", 30)
    for line in (run_dir(tmp_path, "t") / "telemetry.jsonl").read_text().splitlines():
        json.loads(line)  # nothing meant for the terminal landed in a file of the run


# --- 2. SIGUSR1 and SIGUSR2 save and stop like SIGTERM ---


@pytest.mark.parametrize("sig", ["SIGUSR1", "SIGUSR2"])
def test_sigusr_saves_writes_the_resume_command_and_the_run_resumes_bitwise(tmp_path, small_text, sig):
    assert main(flags(tmp_path, small_text, run_name="whole", max_windows=12)) == 0
    calls = []

    def preempted_at_window_5(relax, inputs, targets):
        calls.append(1)
        if len(calls) == 5:
            signal.raise_signal(getattr(signal, sig))
        return ep_gradients(relax, inputs, targets)

    cut = Trainer(config(tmp_path, small_text, run_name="cut", max_windows=12), preempted_at_window_5, lambda m: None)
    summary = cut.train()
    assert summary["interrupted"] == sig and summary["windows"] == 5
    assert ck.find_latest(run_dir(tmp_path, "cut")).name == "step_00000005"
    saved = json.loads((run_dir(tmp_path, "cut") / "summary.json").read_text())
    command = shlex.split(saved["resume_command"])  # the terminal that printed it may be gone
    assert command[command.index("--run_name") + 1] == "cut"
    assert main(command[command.index("--resume") :]) == 0
    assert_same_checkpoint(run_dir(tmp_path, "whole") / "step_00000012", run_dir(tmp_path, "cut") / "step_00000012")


def test_sigusr1_to_a_real_process_exits_138_after_saving(tmp_path, small_text):
    argv = [sys.executable, "main.py", *flags(tmp_path, small_text, run_name="u", max_windows=10**9)]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    telemetry = run_dir(tmp_path, "u") / "telemetry.jsonl"
    while proc.poll() is None and not (telemetry.is_file() and telemetry.stat().st_size):
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    err = proc.communicate(timeout=300)[1]
    assert proc.returncode == 128 + signal.SIGUSR1, err
    summary = json.loads((run_dir(tmp_path, "u") / "summary.json").read_text())
    assert summary["interrupted"] == "SIGUSR1" and ck.find_latest(run_dir(tmp_path, "u"))
    assert err.strip().splitlines()[-1].endswith(f"resume with: {summary['resume_command']}")


# --- 3. a run never writes through a symbolic link, its run directory included ---


def outside(tmp_path: Path) -> Path:
    """A directory of the user's outside every run, with a file that must never change."""
    d = tmp_path / "elsewhere"
    d.mkdir(exist_ok=True)
    (d / "precious.txt").write_text("precious")
    return d


def untouched(d: Path) -> bool:
    return [p.name for p in d.iterdir()] == ["precious.txt"] and (d / "precious.txt").read_text() == "precious"


@pytest.mark.parametrize("resume", [False, True])
def test_a_run_directory_that_is_a_symlink_is_refused(tmp_path, small_text, capsys, resume):
    target = outside(tmp_path)
    (tmp_path / "ck").mkdir()
    if resume:  # a run whose directory was swapped for a link to elsewhere after its first checkpoint
        assert main(flags(tmp_path, small_text, run_name="real", max_windows=3)) == 0
        os.symlink(tmp_path / "ck" / "real", tmp_path / "ck" / "x")
        argv = ["--resume", "latest", "--run_name", "x", "--checkpoint_dir", str(tmp_path / "ck"), "--max_windows", "5"]
        target = tmp_path / "ck" / "real"
        before = sorted(p.name for p in target.iterdir())
    else:
        os.symlink(target, tmp_path / "ck" / "x")
        argv = flags(tmp_path, small_text, run_name="x", max_windows=3)
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"run directory {tmp_path / 'ck' / 'x'} is a symbolic link" in err and len(err.splitlines()) == 1, err
    assert sorted(p.name for p in target.iterdir()) == before if resume else untouched(target)


@pytest.mark.parametrize("name", ["config.yaml", "summary.json", ".run", "step_00000003", "tb"])
def test_a_symlink_where_a_run_writes_is_refused(tmp_path, small_text, capsys, name):
    target = outside(tmp_path)
    rd = run_dir(tmp_path, "r")
    rd.mkdir(parents=True)
    os.symlink(target, rd / name)
    assert main(flags(tmp_path, small_text, run_name="r", max_windows=3)) == 2
    err = capsys.readouterr().err
    assert f"{rd / name} is a symbolic link" in err and "Traceback" not in err, err
    assert untouched(target) and sorted(p.name for p in rd.iterdir()) == [name]  # no .lock left behind either


def test_a_write_through_a_link_planted_mid_run_is_refused(tmp_path, small_text):
    target = outside(tmp_path)
    os.symlink(target / "precious.txt", tmp_path / "link")
    with pytest.raises(OSError, match="is a symbolic link"):
        write_replace(tmp_path / "link", b"overwritten")
    os.symlink(target, tmp_path / "run")
    (tmp_path / "own").mkdir()
    os.symlink(target, tmp_path / "own" / ck.step_name(1))
    for rd in (tmp_path / "run", tmp_path / "own"):
        with pytest.raises(OSError, match="is a symbolic link"):
            ck.save(rd, 1, {}, {})
    assert untouched(target)


def test_a_refused_start_leaves_no_lock_file(tmp_path, small_text):
    rd = run_dir(tmp_path, "r")
    assert main(flags(tmp_path, small_text, run_name="r", max_windows=3)) == 0
    (rd / LOCK_FILE).unlink()  # as a run of a version that did not write one
    assert main(flags(tmp_path, small_text, run_name="r", max_windows=3)) == 2  # refused: the run has files
    assert not os.path.lexists(rd / LOCK_FILE)
    assert main(flags(tmp_path, small_text, run_name="fresh", max_windows=-3)) == 2  # refused before the lock
    assert main([*flags(tmp_path, small_text, run_name="new"), "--batch_size", "100000"]) == 2  # refused under it
    assert not run_dir(tmp_path, "new").exists()


# --- 4. non-finite tensors in a checkpoint whose checksum matches are refused at load ---


def poison(step: Path, key: str, value: float) -> None:
    """Write `value` into one element of tensor `key` and make the sidecar's size and sha256 match again."""
    tensors = load_file(str(step / ck.TENSORS_FILE))
    tensors[key].view(-1)[0] = value
    save_file(tensors, str(step / ck.TENSORS_FILE))
    meta = json.loads((step / ck.META_FILE).read_text())
    meta["tensors"].update(bytes=(step / ck.TENSORS_FILE).stat().st_size, sha256=ck._sha256(step / ck.TENSORS_FILE))
    (step / ck.META_FILE).write_text(json.dumps(meta))


@pytest.mark.parametrize("value", [math.nan, -math.inf])
def test_non_finite_parameters_are_refused_by_every_loader_naming_the_last_finite_checkpoint(
    tmp_path, small_text, capsys, value
):
    quiet(config(tmp_path, small_text, run_name="r", max_windows=10, save_every_windows=5)).train()
    rd = run_dir(tmp_path, "r")
    bad, good = rd / "step_00000010", rd / "step_00000005"
    poison(bad, "param.W_1", value)
    says = f"{bad / ck.TENSORS_FILE}: tensor 'param.W_1' holds 1 non-finite value(s)"
    resume = ["--resume", "latest", "--run_name", "r", "--checkpoint_dir", str(tmp_path / "ck"), "--max_windows", "12"]
    for argv in (resume, ["evaluate", "--checkpoint", str(bad)], ["sample", "--checkpoint", str(bad), "--length", "3"]):
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert says in err and f"last checkpoint with finite tensors is {good}" in err and len(err.splitlines()) == 1
    with pytest.raises(ck.CheckpointError, match="non-finite"):
        load_trained(bad)
    assert not (rd / "step_00000012").exists()
    # the named one resumes, into a new run
    assert main(["--resume", str(good), "--run_name", "branch", "--max_windows", "7"]) == 0


def test_a_non_finite_update_state_is_refused_on_resume(tmp_path, small_text, capsys):
    quiet(config(tmp_path, small_text, run_name="r", max_windows=4)).train()
    poison(run_dir(tmp_path, "r") / "step_00000004", "second_moment.W_out", math.inf)
    assert main(["--resume", "latest", "--run_name", "r", "--checkpoint_dir", str(tmp_path / "ck")]) == 2
    assert "tensor 'second_moment.W_out'" in capsys.readouterr().err


# --- 6, 7. a file a user names is opened only if it is a regular file; every message names the file ---


@contextmanager
def unblocking(fifo: Path) -> Iterator[None]:
    """If a reader blocks on `fifo` for 30 s (the bug), end its read with EOF: the test fails instead of hanging."""

    def release() -> None:
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # a waiting reader gets EOF
        except OSError:
            pass  # nobody is reading

    timer = threading.Timer(30.0, release)
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


@pytest.mark.parametrize("where", ["plot's telemetry.jsonl", "a resumed run's telemetry.jsonl", ".run", "meta.json"])
def test_a_fifo_where_a_file_is_read_is_refused_naming_it(tmp_path, small_text, capsys, where):
    quiet(config(tmp_path, small_text, run_name="r", max_windows=3)).train()
    rd = run_dir(tmp_path, "r")
    fifo = {".run": rd / ".run", "meta.json": rd / "step_00000003" / ck.META_FILE}.get(where, rd / "telemetry.jsonl")
    fifo.unlink()
    os.mkfifo(fifo)
    resume = ["--resume", "latest", "--run_name", "r", "--checkpoint_dir", str(tmp_path / "ck"), "--max_windows", "5"]
    argv = {
        "plot's telemetry.jsonl": ["plot", str(rd)],
        "meta.json": ["evaluate", "--checkpoint", str(rd / "step_00000003")],
    }.get(where, resume)
    capsys.readouterr()
    with unblocking(fifo):
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert str(fifo) in err and "FIFO" in err and len(err.splitlines()) == 1, err


def cifar_dir(tmp_path: Path, batch: bytes | None) -> Path:
    """A CIFAR-10 directory whose data_batch_1 holds `batch`, or is a FIFO (None)."""
    d = tmp_path / "cifar"
    d.mkdir()
    if batch is None:
        os.mkfifo(d / "data_batch_1")
    else:
        (d / "data_batch_1").write_bytes(batch)
    return d


@pytest.mark.parametrize(
    "batch, says",
    [
        (None, "is not a regular file (a FIFO)"),
        (b"\x80\x04\x8e" + struct.pack("<Q", 2**60) + b"xx", "declares an object too large to allocate"),  # BINBYTES8
    ],
)
def test_a_cifar_batch_that_is_a_fifo_or_declares_a_huge_length_is_refused_naming_it(tmp_path, capsys, batch, says):
    d = cifar_dir(tmp_path, batch)
    with unblocking(d / "data_batch_1"):
        assert main(["--data", str(d), "--checkpoint_dir", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err
    assert f"{d / 'data_batch_1'}: cannot read as a CIFAR-10 python batch" in err and says in err, err


def test_empty_data_and_a_missing_checkpoint_directory_say_so(tmp_path, capsys):
    assert main(["--data", "", "--checkpoint_dir", str(tmp_path / "ck")]) == 2
    assert "data (from command line): empty" in capsys.readouterr().err
    assert main(["evaluate", "--checkpoint", str(tmp_path / "nowhere")]) == 2
    assert f"checkpoint {tmp_path / 'nowhere'}: no such directory" in capsys.readouterr().err


def test_telemetry_is_never_appended_to_a_fifo(tmp_path):
    """Under the command line refuse_planted stops this at the start; a Trainer used as a library must not hang."""
    os.mkfifo(tmp_path / "telemetry.jsonl")
    with unblocking(tmp_path / "telemetry.jsonl"), pytest.raises(OSError, match=r"is not a regular file \(a FIFO\)"):
        Telemetry(tmp_path, TrainConfig(), None)
