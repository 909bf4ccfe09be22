"""Issue 27: a run that fails says so, and nothing outside a run is ever touched. Divergence of the loss, run
directories that hold only the run's own files, validation before allocation, and clear errors for bad inputs."""

from __future__ import annotations

import io
import json
import math
import os
import runpy
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from test_checkpoint import config, fixture_saved, flags, run_dir  # noqa: F401 (fixture_saved: the fixture `saved`)

from trainer2.cli import main
from trainer2.data import npz as npz_module
from trainer2.data import text as text_module
from trainer2.learning.gradients import ep_gradients
from trainer2.running import checkpoint as ck
from trainer2.running import parts as parts_module
from trainer2.running import sizes
from trainer2.running.health import LOSS_STREAK, UNIFORM_FACTOR, Diverged, Health
from trainer2.running.trainer import Trainer


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
    cfg = config(
        tmp_path,
        small_text,
        run_name="nanloss",
        max_windows=40,
        save_every_windows=4,
        keep_last=10,
        log_every_windows=5,
        eval_every_windows=0,
    )
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
    with pytest.raises(
        Diverged, match=f"between windows 11 and 15; the last checkpoint before it is {rd}/step_00000008"
    ):
        tr.train()
    summary = strict((rd / "summary.json").read_text())
    assert summary["diverged"] is True and summary["windows"] == 15
    for p in ck.list_checkpoints(rd):
        assert strict((p / ck.META_FILE).read_text())["history"][0]["train_loss"] is None


def test_a_diverging_loss_exits_3(tmp_path, small_text, capsys):
    argv = flags(
        tmp_path,
        small_text,
        run_name="mom",
        max_windows=2000,
        update_rule="momentum",
        eta_update=1.0,
        momentum=0.99,
        log_every_windows=10,
        eval_every_windows=0,
        lr_warmup_windows=0,
    )
    assert main(argv) == 3  # it exited 0 before (issue 27); the loss criteria themselves are tested above
    err = capsys.readouterr().err
    # Which criterion fires first (the loss above the uniform prediction, or every update dropped) depends on the
    # data order; either way the run stops as diverged.
    assert "the run diverged: " in err and "Traceback" not in err
    assert strict((run_dir(tmp_path, "mom") / "summary.json").read_text())["diverged"] is True


# --- 2. a run directory's contents are the run's own ---


@pytest.mark.parametrize(
    "flag, value, says",
    [
        ("run_name", "step_00000001", "shaped like a checkpoint directory"),
        ("run_name", ".lock", "not first"),
        ("checkpoint_dir", "", "checkpoint_dir (from command line): must name a directory"),
    ],
)
def test_run_names_shaped_like_checkpoints_and_an_empty_checkpoint_dir_are_refused(
    tmp_path, small_text, capsys, flag, value, says
):
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
    Trainer(
        config(tmp_path, small_text, run_name="own", max_windows=6, save_every_windows=2, keep_last=1),
        log=lambda m: None,
    ).train()
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


def test_tensorboard_and_plots_are_not_written_through_a_planted_symlink(tmp_path, small_text, capsys):
    pytest.importorskip("tensorboard")
    pytest.importorskip("matplotlib")
    victim = tmp_path / "victim"
    victim.mkdir()
    rd = run_dir(tmp_path, "tbl")
    rd.mkdir(parents=True)
    os.symlink(victim, rd / "tb")
    assert main([*flags(tmp_path, small_text, run_name="tbl", max_windows=2), "--tensorboard"]) == 2  # at start
    assert "is a symbolic link" in capsys.readouterr().err and list(victim.iterdir()) == []
    assert main(flags(tmp_path, small_text, run_name="plotl", max_windows=2)) == 0
    os.symlink(victim, run_dir(tmp_path, "plotl") / "plots")
    assert main(["plot", str(run_dir(tmp_path, "plotl"))]) == 74
    err = capsys.readouterr().err
    assert "is a symbolic link" in err and "Traceback" not in err and list(victim.iterdir()) == []


def test_the_profiler_trace_is_not_written_through_a_planted_symlink(tmp_path, small_text, capsys):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    rd = run_dir(tmp_path, "prof")
    rd.mkdir(parents=True)
    os.symlink(victim, rd / "profile_trace.json")
    argv = [*flags(tmp_path, small_text, run_name="prof", max_windows=10), "--profile_windows", "2"]
    assert main(argv) == 2  # refused at the start, before any window
    err = capsys.readouterr().err
    assert "is a symbolic link" in err and "Traceback" not in err and victim.read_text() == "precious"


# --- 3. validation before allocation ---


@pytest.mark.parametrize(
    "field, value, says",
    [
        ("batch_size", 10**6, "batch_size: 1000000 x 1 process(es) is more than the"),
        ("hidden_sizes", [2**19, 2**19], "layers: the run would need about"),
        ("memory_capacity", 2**30, "memory_capacity: the run would need about"),
        ("rotor_k", 2**24, "rotor_k: the run would need about"),
        ("nudge_steps", 10**6, "nudge_steps: the run would need about"),
        ("coord_dim_n", 10**6, "coord_dim_n (from command line): Input should be less than or equal to 2048"),
        ("free_steps", 10**11, "free_steps (from command line): Input should be less than or equal to"),
        ("max_epochs", 1e308, "max_epochs (from command line): Input should be less than or equal to"),
        ("embed_dim", 10**7, "embed_dim (from command line): Input should be less than or equal to"),
    ],
)
def test_sizes_that_cannot_fit_are_refused_before_allocation(
    tmp_path, small_text, capsys, monkeypatch, field, value, says
):
    monkeypatch.setattr(sizes, "available_bytes", lambda device: 0.5 * 2**30)  # the same answer on any machine
    monkeypatch.setattr(parts_module, "build_machine", lambda *a: pytest.fail("allocated before the check"))
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
    for reader in (text_module, npz_module):
        monkeypatch.setattr(reader, "available_bytes", lambda device: 2.0 * 2**30)
    if kind == "fifo":
        path, says = tmp_path / "pipe.txt", "is not a regular file"
        os.mkfifo(path)
    elif kind == "/dev/zero":
        path, says = "/dev/zero", "is not a regular file"
    elif kind == "zeros":
        path, says = tmp_path / "zeros.txt", "holds NUL bytes"
        path.write_bytes(b"\0" * 100_000)
    elif kind == "lying npz":
        path, says = (
            make_npz(tmp_path / "lie.npz", (10**12, 4), b"\0" * 64),
            "its header says float32 (1000000000000, 4)",
        )
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
            return ((4, 3 * 2**26), False, np.dtype("<f4")) if len(calls) == 1 else got  # ...and x's header agrees

        monkeypatch.setattr(zipfile.ZipFile, "getinfo", inflated)
        monkeypatch.setattr(np.lib.format, "read_array_header_1_0", header)
    assert main(flags(tmp_path, Path(path), run_name="d", max_windows=2)) == 2
    err = capsys.readouterr().err
    assert says in err and str(path) in err and "Traceback" not in err, err


# --- 4. every traceback class becomes a clear error naming the input ---


def edit_meta(step: Path, edit) -> None:
    meta = json.loads((step / ck.META_FILE).read_text())
    edit(meta)
    (step / ck.META_FILE).write_text(json.dumps(meta))


@pytest.mark.parametrize(
    "edit, says",
    [
        (lambda m: m["counters"].update(window=10**300), "counters.window"),
        (lambda m: m["counters"].update(window=-5), "counters.window must be an integer >= 0, got -5"),
        (lambda m: m["counters"].update(global_batch="x"), "counters.global_batch must be an integer >= 1, got 'x'"),
        (lambda m: m["counters"].update(world_size=0), "counters.world_size"),
        (lambda m: m["counters"].update(wall_seconds=1e400), "counters.wall_seconds must be a finite number"),
        (lambda m: m.update(history=["a", 1]), "history[0] must be a JSON object"),
        (lambda m: m.update(versions="x"), "'versions' must be a JSON object"),
        (lambda m: m.update(run_id=[1]), "'run_id' must be a JSON string"),
    ],
)
def test_a_corrupt_sidecar_field_is_refused_before_training(saved, capsys, edit, says):
    edit_meta(saved, edit)
    assert main(["--resume", str(saved), "--max_windows", "12"]) == 2
    err = capsys.readouterr().err
    assert says in err and str(saved / ck.META_FILE) in err and "Traceback" not in err, err
    assert not (saved.parent / "step_00000012").exists()


def test_invalid_random_generator_bytes_are_refused(saved, capsys):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(saved / ck.TENSORS_FILE))
    tensors["rng.cpu"] = torch.zeros_like(tensors["rng.cpu"])
    save_file(tensors, str(saved / ck.TENSORS_FILE))
    edit_meta(
        saved,
        lambda m: m["tensors"].update(
            bytes=(saved / ck.TENSORS_FILE).stat().st_size, sha256=ck._sha256(saved / ck.TENSORS_FILE)
        ),
    )
    assert main(["--resume", str(saved), "--max_windows", "12"]) == 2
    assert "tensor 'rng.cpu' is no valid random-generator state" in capsys.readouterr().err


@pytest.mark.parametrize(
    "env, says",
    [
        ({"RANK": "x", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "RANK, WORLD_SIZE and LOCAL_RANK must be integers"),
        ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}, "the process group cannot start"),  # no MASTER_ADDR
    ],
)
def test_bad_torchrun_environments_are_clear_errors(tmp_path, small_text, capsys, monkeypatch, env, says):
    for k in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main(flags(tmp_path, small_text, run_name="env", max_windows=2)) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err


def test_plot_skips_odd_telemetry_values(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    rd = tmp_path / "odd"
    rd.mkdir()
    rows = [
        {"window": "x", "train_loss": 1.0},
        {"window": 1, "train_loss": True},
        {"window": 2, "train_loss": 1e308},
        {"window": 3, "train_loss": [1]},
        {"window": 4, "train_loss": 2.0, "lr": {"a": 1}},
        {"window": None},
    ]
    (rd / "telemetry.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows) + '{"window": 5, "train_loss": NaN}\n'
    )
    assert main(["plot", str(rd)]) == 0
    assert "Traceback" not in capsys.readouterr().err


def test_sampling_at_a_vanishing_temperature_is_greedy(saved, capsys):
    assert (
        main(["sample", "--checkpoint", str(saved), "--temperature", "1e-320", "--length", "8", "--prompt", "the"]) == 0
    )
    hot = capsys.readouterr().out
    assert main(["sample", "--checkpoint", str(saved), "--temperature", "0", "--length", "8", "--prompt", "the"]) == 0
    assert capsys.readouterr().out == hot


def test_ctrl_c_while_starting_up_is_no_traceback(monkeypatch, capsys):
    class Interrupting:
        def find_spec(self, name, path=None, target=None):
            if name == "trainer2.cli":
                raise KeyboardInterrupt
            return None

    monkeypatch.delitem(sys.modules, "trainer2.cli")
    monkeypatch.setattr(sys, "meta_path", [Interrupting(), *sys.meta_path])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(Path(__file__).resolve().parent.parent / "main.py"), run_name="__main__")
    assert stop.value.code == 130 and capsys.readouterr().err == "trainer2: interrupted\n"


@pytest.mark.parametrize("sig", ["SIGHUP", "SIGQUIT"])
def test_sighup_and_sigquit_save_like_sigterm(tmp_path, small_text, sig):
    calls = []

    def hangs_up_at_window_4(relax, inputs, targets):
        calls.append(1)
        if len(calls) == 4:
            signal.raise_signal(getattr(signal, sig))
        return ep_gradients(relax, inputs, targets)

    tr = Trainer(
        config(tmp_path, small_text, run_name="hup", max_windows=40), gradients=hangs_up_at_window_4, log=lambda m: None
    )
    summary = tr.train()
    assert summary["interrupted"] == sig and summary["windows"] == 4
    assert ck.find_latest(run_dir(tmp_path, "hup")).name == "step_00000004"


def test_a_moved_data_file_with_the_same_contents_resumes_with_a_note(tmp_path, small_text, saved, capsys):
    moved = tmp_path / "elsewhere.txt"
    os.rename(small_text, moved)
    assert main(["--resume", str(saved), "--max_windows", "12", "--data", str(moved)]) == 0
    assert f"note: the data is read from {moved}, the checkpoint's from {small_text}" in capsys.readouterr().out
    moved.write_text(moved.read_text().replace("cat", "cow"))
    assert (
        main(
            [
                "--resume",
                "latest",
                "--run_name",
                "r",
                "--checkpoint_dir",
                str(tmp_path / "ck"),
                "--max_windows",
                "14",
                "--data",
                str(moved),
            ]
        )
        == 2
    )
    assert "the data differs from the checkpoint's" in capsys.readouterr().err


def test_summary_json_is_written_when_stdout_is_gone(tmp_path, small_text):
    argv = flags(tmp_path, small_text, run_name="pipe", max_windows=6, log_every_windows=2)
    proc = subprocess.Popen(
        [sys.executable, "main.py", *argv],
        cwd=Path(__file__).resolve().parent.parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "TQDM_DISABLE": "1"},
    )
    proc.stdout.close()  # the reader went away (`| head`): every write to stdout is a broken pipe
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 0, err
    assert "Traceback" not in err and "Exception ignored" not in err
    assert strict((run_dir(tmp_path, "pipe") / "summary.json").read_text())["windows"] == 6


@pytest.mark.parametrize("flag", ["--resume", "--preset", "--config"])
def test_empty_resume_preset_and_config_are_refused(tmp_path, capsys, flag):
    assert main([flag, "", "--checkpoint_dir", str(tmp_path / "ck")]) == 2
    assert f"{flag}: empty" in capsys.readouterr().err
    assert not (tmp_path / "ck").exists()


def test_yaml_duplicate_keys_are_refused(tmp_path, capsys):
    cfg = tmp_path / "dup.yaml"
    cfg.write_text("eta_update: 0.001\nbatch_size: 8\neta_update: 0.01\n")
    assert main(["--config", str(cfg), "--checkpoint_dir", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err
    assert "duplicate key 'eta_update'" in err and str(cfg) in err and "line 3" in err


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero"])
def test_a_config_that_is_no_regular_file_is_refused_without_reading_it(tmp_path, capsys, kind):
    path = tmp_path / "pipe.yaml" if kind == "fifo" else Path(kind)
    if kind == "fifo":
        os.mkfifo(path)
    assert main(["--config", str(path), "--checkpoint_dir", str(tmp_path / "ck")]) == 2
    assert f"config file {path} is not a regular file" in capsys.readouterr().err


def test_evaluate_checks_sizes_before_building_the_machine(saved, capsys, monkeypatch):
    monkeypatch.setattr(sizes, "available_bytes", lambda device: 2.0**20)  # 1 MiB free
    assert main(["evaluate", "--checkpoint", str(saved)]) == 2
    assert "the run would need about" in capsys.readouterr().err
