"""The validation split: the end of the training data set apart (validation_fraction), evaluated and logged beside the
held-out split, which it never touches, so settings are tuned without looking at the held-out figure."""

from __future__ import annotations

import json

import numpy as np
import pytest

import trainer2
from trainer2.cli import main
from trainer2.data.load import load_dataset
from trainer2.monitor.telemetry import read_telemetry

TINY = dict(
    layers=[{"dense": 10}],
    coord_dim_n=4,
    rotor_k=3,
    batch_size=16,
    free_steps=10,
    nudge_steps=5,
    max_windows=20,
    log_every_windows=10,
    eval_every_windows=10,
)


def test_the_validation_split_is_the_end_of_the_training_split(small_text):
    plain = load_dataset(str(small_text), 3)
    cut = plain.with_validation(0.25)
    assert len(cut.train) + len(cut.validation) == len(plain.train)
    assert (cut.train == plain.train[: len(cut.train)]).all() and (
        cut.validation == plain.train[len(cut.train) :]
    ).all()
    assert (cut.heldout == plain.heldout).all()  # the held-out split is never touched
    assert cut.num_examples("validation") == len(cut.validation) - 3
    x, y = np.random.default_rng(0).normal(size=(50, 4)).astype(np.float32), np.arange(50) % 3
    rows = trainer2.from_arrays(x, y, heldout_fraction=0.2).with_validation(0.25)
    assert (rows.num_examples("train"), rows.num_examples("validation"), rows.num_examples("heldout")) == (30, 10, 10)
    assert (rows.validation_y.numpy() == y[30:40]).all()
    with pytest.raises(trainer2.DataError, match="validation_fraction 0.999"):
        load_dataset(str(small_text), 3, heldout_fraction=0.5).with_validation(0.999)


def test_a_run_logs_validation_beside_held_out_and_both_reach_the_summary(tmp_path, small_text):
    cfg = trainer2.config(None, **TINY, data=str(small_text), context_len=3, validation_fraction=0.2)
    run = trainer2.train(cfg, run_dir=tmp_path / "v", log=lambda *_: None)
    rows = read_telemetry(tmp_path / "v" / "telemetry.jsonl")
    assert all({"validation_bpc", "heldout_bpc", "validation_acc"} <= r.keys() for r in rows)
    summary = json.loads((tmp_path / "v" / "summary.json").read_text())
    assert summary["validation_bpc"] == rows[-1]["validation_bpc"] and summary["heldout_bpc"] == rows[-1]["heldout_bpc"]
    assert run.model.evaluate(split="validation")["validation_bpc"] == pytest.approx(summary["validation_bpc"])
    # The machine trained on the shorter training split only: the sampler counts the examples before the cut.
    plain = load_dataset(str(small_text), 3)
    assert run.model.data.num_examples("train") < plain.num_examples("train")


def test_the_validation_fraction_defines_the_run_and_cannot_change_on_resume(tmp_path, small_text, capsys):
    flags = ["--data", str(small_text), "--context_len", "3", "--hidden_sizes", "8", "--coord_dim_n", "4"]
    flags += ["--rotor_k", "3", "--batch_size", "8", "--free_steps", "6", "--nudge_steps", "3", "--eval_batches", "1"]
    flags += ["--checkpoint_dir", str(tmp_path), "--run_name", "r", "--validation_fraction", "0.2"]
    assert main([*flags, "--max_windows", "2"]) == 0
    assert main([*flags, "--max_windows", "4", "--resume", "latest", "--validation_fraction", "0.3"]) == 2
    assert "validation_fraction: checkpoint has 0.2, requested 0.3" in capsys.readouterr().err
    assert main(["evaluate", "--checkpoint", str(tmp_path / "r" / "step_00000002")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"heldout_loss", "validation_loss"} <= out.keys()
