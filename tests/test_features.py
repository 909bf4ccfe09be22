"""Feature data sets (.npz): the whole training path as a classifier, and refusal of malformed files at the command
line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from trainer2.cli import main
from trainer2.running.trainer import Trainer
from trainer2.train_config import TrainConfig

TINY = [
    "--hidden_sizes",
    "16",
    "--coord_dim_n",
    "4",
    "--rotor_k",
    "4",
    "--batch_size",
    "20",
    "--free_steps",
    "24",
    "--nudge_steps",
    "12",
    "--log_every_windows",
    "20",
]


def blobs(path, seed: int = 0) -> str:
    """Three Gaussian blobs in D = 4, 600 rows in random order (the split is by position)."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(3, 4)) * 2.0
    y = rng.integers(0, 3, 600)
    x = centers[y] + rng.normal(size=(600, 4)) * 0.5
    np.savez(path, x=x.astype(np.float32), y=y)
    return str(path)


def test_separable_blobs_reach_high_heldout_accuracy(tmp_path) -> None:
    cfg = TrainConfig(
        data=blobs(tmp_path / "blobs.npz"),
        dtype="float64",
        hidden_sizes=[16],
        coord_dim_n=4,
        rotor_k=4,
        batch_size=20,
        free_steps=24,
        nudge_steps=12,
        max_windows=60,
        eta_update=0.02,
        checkpoint_dir=str(tmp_path),
    )
    t = Trainer(cfg, log=lambda *_: None)
    assert t.machine.emb is None and t.machine.energy.weights[0].shape == (16, 4)  # x is clamped directly
    before = t.evaluate()["heldout_acc"]
    summary = t.train()
    assert before < 0.8 and summary["heldout_acc"] > 0.9, (before, summary)
    assert summary["data_kind"] == "features" and "heldout_bpc" not in summary and summary["heldout_loss"] < 0.5
    assert all("train_bpc" not in row for row in t.history)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["heldout_acc"] == summary["heldout_acc"]


def test_cli_trains_features_and_reports_accuracy(tmp_path, capsys) -> None:
    rc = main(["--data", blobs(tmp_path / "b.npz"), "--max_windows", "20", "--checkpoint_dir", str(tmp_path), *TINY])
    out = capsys.readouterr().out
    assert rc == 0 and "nats/example, acc" in out and "bpc" not in out.splitlines()[-1]


@pytest.mark.parametrize(
    "arrays,pattern",
    [
        ({"x": np.zeros((10, 2), dtype=np.float32), "y": np.zeros(10)}, "y must be an integer array"),
        ({"x": np.zeros((10, 2), dtype=np.float32)}, "missing array 'y'"),
        ({"x": np.zeros((10, 2), dtype=np.float32), "y": np.arange(10) * 1000}, "class indices 0..K-1"),
    ],
    ids=["float_labels", "missing_y", "sparse_labels"],
)
def test_cli_refuses_malformed_npz(tmp_path, capsys, arrays, pattern) -> None:
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    assert main(["--data", str(path), "--checkpoint_dir", str(tmp_path), *TINY]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and pattern in err
