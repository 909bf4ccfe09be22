"""Everywhere a checkpoint is taken (evaluate, sample, --resume, trainer2.load) it is named the same ways: a step_<N>/
directory, a run folder (its newest checkpoint, said in one line) or 'latest' (of --run_name, or the run saved most
recently)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tiny import clustered

import trainer2
from trainer2.cli import main

FLAGS = [
    "--preset",
    "dev",
    "--batch_size",
    "16",
    "--eval_batches",
    "1",
    "--eval_every_windows",
    "0",
    "--coord_dim_n",
    "4",
    "--layers",
    "dense:8",
]


@pytest.fixture()
def runs(tmp_path, monkeypatch):
    """Two runs of feature data under tmp_path/checkpoints: a (windows 2 and 4) and then b (window 2)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TQDM_DISABLE", "1")
    x, y = clustered(96)
    np.savez(tmp_path / "f.npz", x=x, y=y)
    for name, windows in (("a", "4"), ("b", "2")):
        args = [*FLAGS, "--data", "f.npz", "--run_name", name, "--max_windows", windows, "--save_every_windows", "2"]
        assert main(args) == 0
    return tmp_path / "checkpoints"


def evaluated(capsys, *args: str) -> tuple[dict, str]:
    capsys.readouterr()
    assert main(["evaluate", *args]) == 0
    out = capsys.readouterr()
    return json.loads(out.out), out.err


def test_evaluate_takes_a_run_folder_latest_or_a_step_directory(runs, capsys):
    out, err = evaluated(capsys, "--checkpoint", "checkpoints/a")
    assert out["checkpoint"] == "checkpoints/a/step_00000004" and out["window"] == 4
    assert "checkpoints/a/step_00000004 (the newest of checkpoints/a)" in err
    out, _ = evaluated(capsys, "--checkpoint", "latest")  # the run saved most recently
    assert out["checkpoint"].endswith("b/step_00000002")
    out, _ = evaluated(capsys, "--checkpoint", "latest", "--run_name", "a")
    assert out["checkpoint"].endswith("a/step_00000004")
    out, err = evaluated(capsys, "--checkpoint", "checkpoints/a/step_00000002")
    assert out["window"] == 2 and "the newest" not in err


def test_a_folder_holding_no_checkpoint_and_misplaced_flags_are_refused_by_name(runs, capsys):
    (runs / "empty").mkdir()
    assert main(["evaluate", "--checkpoint", "checkpoints/empty"]) == 2
    err = capsys.readouterr().err
    assert "neither a checkpoint" in err and "run folder" in err and "Traceback" not in err
    assert main(["evaluate", "--checkpoint", "checkpoints/a", "--run_name", "b"]) == 2
    assert "go with --checkpoint latest" in capsys.readouterr().err
    assert main(["evaluate", "--checkpoint", "latest", "--checkpoint_dir", "nowhere"]) == 2
    assert "no run with a checkpoint under nowhere" in capsys.readouterr().err


def test_sample_says_what_the_checkpoint_was_trained_on(runs, capsys):
    assert main(["sample", "--checkpoint", "checkpoints/b"]) == 2
    err = capsys.readouterr().err
    assert "trained on features, not text" in err and "evaluate" in err


def test_resume_and_load_take_a_run_folder(runs, capsys):
    assert trainer2.load(runs / "a").window == 4
    assert main([*FLAGS, "--data", "f.npz", "--resume", "checkpoints/a", "--max_windows", "6"]) == 0
    assert (runs / "a" / "step_00000006").is_dir()
