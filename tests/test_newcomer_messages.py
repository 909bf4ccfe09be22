"""Messages a newcomer meets (issue 61): labels that leave classes empty, evaluating a run trained from Python, a
missing --data path, resuming a run that is still going, and plots of a run without bits per character."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import trainer2
from trainer2.cli import main
from trainer2.data.dataset import DataError, LabelWarning
from trainer2.data.load import load_dataset
from trainer2.running.rundir import LOCK_FILE

TINY = dict(hidden_sizes=[8], coord_dim_n=4, rotor_k=4, batch_size=10, free_steps=8, nudge_steps=4)
TINY_FLAGS = ["--hidden_sizes", "8", "--coord_dim_n", "4", "--rotor_k", "4", "--batch_size", "10"]
TINY_FLAGS += ["--free_steps", "8", "--nudge_steps", "4"]


def blobs(n: int = 60, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """n feature rows x [n, 4] of three classes 0..2, each present in both splits."""
    rng = np.random.default_rng(seed)
    y = np.arange(n) % 3
    return (rng.normal(size=(3, 4))[y] * 2 + rng.normal(size=(n, 4)) * 0.3).astype(np.float32), y


# --- 1. labels with gaps, a stray large label, held-out classes training never shows ---


def test_labels_with_gaps_warn_naming_present_and_missing_classes() -> None:
    x = np.zeros((30, 3), np.float32)
    with pytest.warns(LabelWarning, match=r"labels 0, 2, 5: classes 1, 3, 4 have no example; the machine gets 6 "):
        data = trainer2.from_arrays(x, np.array([0, 2, 5] * 10))
    assert data.num_classes == 6  # still loads, one class per index: the warning says so rather than refusing


def test_a_stray_large_label_warns_and_names_the_heldout_class_training_lacks() -> None:
    y = np.array([0, 1, 2, 3] * 7 + [10, 0])  # the 10 falls in the held-out rows only
    with pytest.warns(LabelWarning) as caught:
        data = trainer2.from_arrays(np.zeros((30, 3), np.float32), y)
    (msg,) = [str(w.message) for w in caught]
    assert "labels 0..3, 10: classes 4..9 have no example; the machine gets 11 classes" in msg
    assert "held-out label 10 has no training example" in msg
    assert caught[0].filename == __file__  # points at the caller's line, not inside trainer2
    assert data.num_classes == 11


def test_heldout_classes_absent_from_training_are_named() -> None:
    x = np.zeros((12, 2), np.float32)
    with pytest.warns(LabelWarning, match=r"held-out labels 2, 3 have no training example") as caught:
        trainer2.from_arrays(x, np.array([0, 1] * 6), x[:4], np.array([0, 1, 2, 3]))
    assert "have no example" not in str(caught[0].message)  # every class 0..3 has an example somewhere


def test_labels_zero_to_k_minus_one_do_not_warn() -> None:
    x, y = blobs()
    with warnings.catch_warnings():
        warnings.simplefilter("error", LabelWarning)
        assert trainer2.from_arrays(x, y).num_classes == 3
        assert trainer2.from_arrays(x.reshape(60, 2, 2), y).num_classes == 3  # images


@pytest.mark.parametrize("kind", ["npz", "csv", "image_npz", "image_arrays"])
def test_every_data_path_warns_about_label_gaps(tmp_path: Path, kind: str) -> None:
    rng = np.random.default_rng(1)
    y = np.array([0, 2, 5] * 10)
    x = rng.normal(size=(30, 4)).astype(np.float32)
    if kind == "npz":
        np.savez(path := tmp_path / "f.npz", x=x, y=y)
    elif kind == "csv":
        path = tmp_path / "f.csv"
        path.write_text("a,b,c,d,label\n" + "".join(f"{','.join(map(str, r))},{c}\n" for r, c in zip(x, y)))
    elif kind == "image_npz":
        np.savez(path := tmp_path / "i.npz", x=x.reshape(30, 1, 2, 2), y=y)
    with pytest.warns(LabelWarning, match=r"classes 1, 3, 4 have no example") as caught:
        data = (
            trainer2.from_arrays(x.reshape(30, 2, 2), y, source="my images")
            if kind == "image_arrays"
            else load_dataset(str(path))
        )
    assert data.num_classes == 6 and data.kind == ("features" if kind in ("npz", "csv") else "images")
    assert str(caught[0].message).startswith("my images: " if kind == "image_arrays" else f"{path}: ")


def test_cli_shows_the_label_warning_as_a_note(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    x, _ = blobs(30)
    np.savez(path := tmp_path / "gaps.npz", x=x, y=np.array([0, 2, 5] * 10))
    rc = main(["--data", str(path), "--max_windows", "1", "--checkpoint_dir", str(tmp_path / "ck"), *TINY_FLAGS])
    err = capsys.readouterr().err
    assert rc == 0
    assert f"trainer2: note: {path}: labels 0, 2, 5: classes 1, 3, 4 have no example" in err


# --- 2. evaluating at the command line a run trained on arrays from Python ---


@pytest.fixture(scope="module")
def arrays_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, np.ndarray, np.ndarray]]:
    """(run directory, x, y) of a two-window run trained from Python on arrays."""
    root = tmp_path_factory.mktemp("arrays_run")
    x, y = blobs()
    cfg = trainer2.TrainConfig(**TINY, max_windows=2, checkpoint_dir=str(root), run_name="arr")
    trainer2.train(cfg, trainer2.from_arrays(x, y), log=lambda _: None)
    yield root / "arr", x, y


def test_cli_evaluate_of_an_arrays_run_says_how_to_score_it(arrays_run, capsys: pytest.CaptureFixture[str]) -> None:
    run, _, _ = arrays_run
    assert main(["evaluate", "--checkpoint", str(run)]) == 2
    err = capsys.readouterr().err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("trainer2: error")]
    assert "trained on data given in memory (from Python)" in line
    assert ".evaluate(trainer2.from_arrays(...))" in line and "pass --data FILE.npz" in line
    assert "Traceback" not in err and "'text'" not in err  # not the built-in corpus's mismatch


def test_cli_evaluate_with_data_scores_the_same_arrays_saved_to_a_file(
    arrays_run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run, x, y = arrays_run
    np.savez(path := tmp_path / "same.npz", x=x, y=y)
    capsys.readouterr()
    assert main(["evaluate", "--checkpoint", str(run), "--data", str(path)]) == 0
    out = json.loads(capsys.readouterr().out)
    expected = trainer2.load(run).evaluate(trainer2.from_arrays(x, y))
    assert out["heldout_loss"] == pytest.approx(expected["heldout_loss"], rel=1e-6)
    assert out["heldout_acc"] == expected["heldout_acc"]
    x2, y2 = blobs(seed=5)  # other data: the fingerprint still guards
    np.savez(other := tmp_path / "other.npz", x=x2, y=y2)
    assert main(["evaluate", "--checkpoint", str(run), "--data", str(other)]) == 2
    assert "the data differs from the checkpoint's" in capsys.readouterr().err


# --- 3. a missing --data path names every format ---


def test_missing_data_path_lists_every_format(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = str(tmp_path / "nope.dat")
    with pytest.raises(DataError, match="does not exist") as err:
        load_dataset(path)
    for fmt in ("text file", ".npz", ".csv", "MNIST IDX", "CIFAR-10", "torchvision:NAME:ROOT"):
        assert fmt in str(err.value), fmt
    assert main(["--data", path, "--max_windows", "1", "--checkpoint_dir", str(tmp_path / "ck")]) == 2
    assert f"trainer2: error: {path}: file does not exist; expected" in capsys.readouterr().err


# --- 4. resuming a run that is still going, before its first checkpoint ---


def hold_lock(run_dir: Path) -> int:
    """Hold run_dir's lock the way RunLock does (flock on .lock, the holder's JSON record); returns the fd."""
    run_dir.mkdir(parents=True)
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": "2024-05-01T10:00:00+0000", "job": None}
    os.write(fd, json.dumps(holder).encode() + b"\n")
    return fd


def test_resume_of_a_running_run_without_checkpoint_says_in_use(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ck = tmp_path / "ck"
    fd = hold_lock(ck / "busy")
    holder = f"pid {os.getpid()} on host {socket.gethostname()}, since 2024-05-01T10:00:00+0000"
    try:
        assert main(["--resume", "latest", "--run_name", "busy", "--checkpoint_dir", str(ck)]) == 2
        err = capsys.readouterr().err
        assert f"in use by {holder}" in err and "wait for it to save a checkpoint, or stop it" in err
        assert "no checkpoint to resume" not in err
        assert main(["--resume", str(ck / "busy")]) == 2  # the run folder by its path
        assert f"in use by {holder}" in capsys.readouterr().err
        assert main(["--resume", "latest", "--checkpoint_dir", str(ck)]) == 2  # no run named: the one going is
        err = capsys.readouterr().err
        assert f"no run with a checkpoint under {ck}" in err and f"busy ({holder}) is still running" in err
        assert main(["evaluate", "--checkpoint", "latest", "--run_name", "busy", "--checkpoint_dir", str(ck)]) == 2
        assert f"in use by {holder}" in capsys.readouterr().err
    finally:
        os.close(fd)
    # released (the run ended without saving): nothing to resume, said as before
    assert main(["--resume", "latest", "--run_name", "busy", "--checkpoint_dir", str(ck)]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint to resume" in err and "in use" not in err


# --- 5. plots of a feature run ---


def test_plot_of_a_feature_run_draws_loss_and_accuracy_and_no_empty_bpc(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    x, y = blobs()
    cfg = trainer2.TrainConfig(
        **TINY, max_windows=4, log_every_windows=1, eval_every_windows=2, checkpoint_dir=str(tmp_path), run_name="f"
    )
    trainer2.train(cfg, trainer2.from_arrays(x, y), log=lambda _: None)
    assert main(["plot", str(tmp_path / "f")]) == 0
    pngs = sorted(p.name for p in (tmp_path / "f" / "plots").glob("*.png"))
    assert pngs == ["accuracy.png", "error.png", "lior_spd.png", "loss.png", "speed.png"]
    assert "bpc.png" not in capsys.readouterr().out


def test_plot_of_a_text_run_draws_its_loss_once_as_bits_per_character(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    rows = [{"window": w, "train_loss": 3.0, "train_bpc": 4.3, "train_acc": 0.2} for w in (1, 2)]
    (tmp_path / "telemetry.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["plot", str(tmp_path)]) == 0
    assert sorted(p.name for p in (tmp_path / "plots").glob("*.png")) == ["accuracy.png", "bpc.png", "error.png"]
