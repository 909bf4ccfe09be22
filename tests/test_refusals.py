"""Issue 27: a run that fails says so, and nothing outside a run is ever touched. Divergence of the loss, run
directories that hold only the run's own files, validation before allocation, and clear errors for bad inputs."""

from __future__ import annotations

import io
import json
import math
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest

from test_checkpoint import config, flags, run_dir
from trainer2 import checkpoint as ck
from trainer2 import data as data_module
from trainer2 import sizes
from trainer2 import trainer as trainer_module
from trainer2.cli import main
from trainer2.health import LOSS_STREAK, UNIFORM_FACTOR, Diverged, Health
from trainer2.trainer import Trainer


def strict(text: str):
    def refuse(name):
        raise AssertionError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def row(window: int, loss: float) -> dict:
    return {"window": window, "train_loss": loss, "dropped": 0.0, "nonfinite_params": 0.0}


# --- 1. divergence of the loss ---


def test_a_loss_above_the_uniform_prediction_for_a_sustained_stretch_is_a_divergence():
    h = Health(1e-6, print, uniform_loss=math.log(100))
    high = UNIFORM_FACTOR * math.log(100) + 0.5
    assert h.diverged(row(10, high), 0) is None
    assert h.diverged(row(20, 1.0), 10) is None  # a dip below the bound ends the stretch
    since = 20
    for w in range(30, 20 + LOSS_STREAK, 10):
        assert h.diverged(row(w, high), since) is None
        since = w
    what, good = h.diverged(row(20 + LOSS_STREAK, high), since)
    assert good == 20 and f"from window 21 to {20 + LOSS_STREAK}" in what and "uniform prediction" in what


@pytest.mark.parametrize("loss", [math.nan, math.inf])
def test_a_non_finite_loss_is_a_divergence_at_once(loss):
    what, good = Health(1e-6, print, uniform_loss=math.log(10)).diverged(row(50, loss), 40)
    assert good == 40 and "between windows 41 and 50" in what and "non-finite" in what


def test_a_non_finite_loss_stops_the_run_with_strict_json_everywhere(tmp_path, small_text, monkeypatch):
    cfg = config(tmp_path, small_text, run_name="nanloss", max_windows=40, save_every_windows=4, keep_last=10,
                 log_every_windows=5, eval_every_windows=0)
    tr = Trainer(cfg, log=lambda m: None)
    real = tr.sync_metrics
    calls = []

    def poisoned():
        out = real()
        calls.append(1)
        if len(calls) >= 3:
            out["train_loss"] = math.inf
        return out

    monkeypatch.setattr(tr, "sync_metrics", poisoned)
    tr.history.append({"window": 0, "train_loss": math.nan})  # a NaN already in the history reaches meta.json
    rd = run_dir(tmp_path, "nanloss")
    with pytest.raises(Diverged, match=f"between windows 11 and 15; the last checkpoint before it is {rd}/step_00000008"):
        tr.train()
    summary = strict((rd / "summary.json").read_text())
    assert summary["diverged"] is True and summary["windows"] == 15
    for p in ck.list_checkpoints(rd):
        assert strict((p / ck.META_FILE).read_text())["history"][0]["train_loss"] is None


def test_a_diverging_loss_exits_3(tmp_path, small_text, capsys):
    argv = flags(tmp_path, small_text, run_name="mom", max_windows=2000, update_rule="momentum", eta_update=1.0,
                 momentum=0.99, log_every_windows=10, eval_every_windows=0, lr_warmup_windows=0)
    assert main(argv) == 3
    err = capsys.readouterr().err
    assert "the run diverged: the training loss" in err and "Traceback" not in err
    assert strict((run_dir(tmp_path, "mom") / "summary.json").read_text())["diverged"] is True


# --- 2. a run directory's contents are the run's own ---


@pytest.mark.parametrize("flag, value, says", [
    ("run_name", "step_00000001", "shaped like a checkpoint directory"),
    ("run_name", ".lock", "not first"),
    ("checkpoint_dir", "", "checkpoint_dir (from command line): must name a directory"),
])
def test_run_names_shaped_like_checkpoints_and_an_empty_checkpoint_dir_are_refused(tmp_path, small_text, capsys, flag, value, says):
    argv = flags(tmp_path, small_text, max_windows=2) + [f"--{flag}", value]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and err.count(repr(value)) <= 1  # the value is named once, not repeated
    assert not (tmp_path / "ck").exists() and not (tmp_path / ".lock").exists()


def test_pruning_removes_only_the_runs_own_checkpoints(tmp_path, small_text):
    rd = run_dir(tmp_path, "own")
    other = rd / "step_00000001"  # another run's directory (made by hand), named like a checkpoint
    other.mkdir(parents=True)
    (other / "notes.txt").write_text("keep me")
    (rd / ".run").write_text('{"run_id": "x"}')  # ...so the fresh run is refused: the directory is not new
    assert main(flags(tmp_path, small_text, run_name="own", max_windows=6, save_every_windows=2, keep_last=1)) == 2
    (rd / ".run").unlink()
    Trainer(config(tmp_path, small_text, run_name="own", max_windows=6, save_every_windows=2, keep_last=1), log=lambda m: None).train()
    assert [p.name for p in ck.list_checkpoints(rd)] == ["step_00000001", "step_00000006"]
    assert (other / "notes.txt").read_text() == "keep me"


def test_a_resume_into_a_directory_holding_another_runs_files_is_refused(tmp_path, small_text, capsys):
    Trainer(config(tmp_path, small_text, run_name="src", max_windows=4), log=lambda m: None).train()
    elsewhere = tmp_path / "ck" / "busy"
    elsewhere.mkdir()
    files = {"config.yaml": "seed: 5\n", "summary.json": "{}\n", "telemetry.jsonl": '{"window": 9}\n'}
    for name, text in files.items():
        (elsewhere / name).write_text(text)
    os.rename(run_dir(tmp_path, "src") / "step_00000004", elsewhere / "step_00000004")
    assert main(["--resume", str(elsewhere / "step_00000004"), "--max_windows", "6"]) == 2
    assert "holds files of another run" in capsys.readouterr().err
    assert {n: (elsewhere / n).read_text() for n in files} == files
    assert not (elsewhere / "step_00000006").exists()


@pytest.mark.parametrize("planted", [".lock", ".summary.json.tmp", ".config.yaml.tmp", "telemetry.jsonl"])
def test_nothing_is_written_through_a_planted_symlink(tmp_path, small_text, capsys, planted):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    rd = run_dir(tmp_path, "linked")
    rd.mkdir(parents=True)
    os.symlink(victim, rd / planted)
    rc = main(flags(tmp_path, small_text, run_name="linked", max_windows=3))
    assert victim.read_text() == "precious"
    assert "Traceback" not in capsys.readouterr().err
    assert rc in (0, 2, 74) and (rc == 0) == planted.endswith(".tmp")  # a leftover tmp link is removed, not followed


# --- 3. validation before allocation ---


@pytest.mark.parametrize("field, value, says", [
    ("batch_size", 10**6, "batch_size: 1000000 x 1 process(es) is more than the"),
    ("hidden_sizes", [2**19, 2**19], "hidden_sizes: the run would need about"),
    ("memory_capacity", 2**30, "memory_capacity: the run would need about"),
    ("rotor_k", 2**24, "rotor_k: the run would need about"),
    ("nudge_steps", 10**6, "nudge_steps: the run would need about"),
    ("coord_dim_n", 10**6, "coord_dim_n (from command line): Input should be less than or equal to 2048"),
    ("tbptt_window_steps", 10**11, "tbptt_window_steps (from command line): Input should be less than or equal to"),
    ("max_epochs", 1e308, "max_epochs (from command line): Input should be less than or equal to"),
    ("embed_dim", 10**7, "embed_dim (from command line): Input should be less than or equal to"),
])
def test_sizes_that_cannot_fit_are_refused_before_allocation(tmp_path, small_text, capsys, monkeypatch, field, value, says):
    monkeypatch.setattr(sizes, "available_bytes", lambda device: 0.5 * 2**30)  # the same answer on any machine
    monkeypatch.setattr(trainer_module, "build_machine", lambda *a: pytest.fail("allocated before the check"))
    kw = {"max_windows": 2, field: value}
    if field == "batch_size":
        kw["memory_capacity"] = 0
    assert main(flags(tmp_path, small_text, run_name="big", **kw)) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err


def npy_header(shape) -> bytes:
    hdr = io.BytesIO()
    np.lib.format.write_array_header_1_0(hdr, {"descr": "<f4", "fortran_order": False, "shape": shape})
    return hdr.getvalue()


def make_npz(path, x_header_shape, x_bytes: bytes):
    y = io.BytesIO()
    np.save(y, np.arange(4) % 2)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("x.npy", npy_header(x_header_shape) + x_bytes)
        z.writestr("y.npy", y.getvalue())
    return path


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "zeros", "lying npz", "npz bomb"])
def test_data_files_are_checked_before_they_are_read_to_the_end(tmp_path, capsys, monkeypatch, kind):
    monkeypatch.setattr(data_module, "available_bytes", lambda device: 2.0 * 2**30)
    if kind == "fifo":
        path, says = tmp_path / "pipe.txt", "is not a regular file"
        os.mkfifo(path)
    elif kind == "/dev/zero":
        path, says = "/dev/zero", "is not a regular file"
    elif kind == "zeros":
        path, says = tmp_path / "zeros.txt", "holds NUL bytes"
        path.write_bytes(b"\0" * 100_000)
    elif kind == "lying npz":
        path, says = make_npz(tmp_path / "lie.npz", (10**12, 4), b"\0" * 64), "its header says float32 (1000000000000, 4)"
    else:  # 3 GiB of zeros compress to a few MB; the check reads only the zip directory and the header
        path, says = make_npz(tmp_path / "bomb.npz", (4, 4), b"\0" * 64), "once decompressed"
        real = zipfile.ZipFile.getinfo

        def inflated(self, name):
            info = real(self, name)
            if name == "x.npy":
                info.file_size = len(npy_header((4, 4))) + 3 * 2**30  # what a bomb's directory says...
            return info

        def header(f, real=np.lib.format.read_array_header_1_0, calls=[]):
            calls.append(1)
            got = real(f)
            return ((3 * 2**28, 1), False, np.dtype("<f4")) if len(calls) == 1 else got  # ...and x's header agrees

        monkeypatch.setattr(zipfile.ZipFile, "getinfo", inflated)
        monkeypatch.setattr(np.lib.format, "read_array_header_1_0", header)
    assert main(flags(tmp_path, Path(path), run_name="d", max_windows=2)) == 2
    err = capsys.readouterr().err
    assert says in err and str(path) in err and "Traceback" not in err, err
