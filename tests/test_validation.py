"""The validation split: the end of the training data set apart (validation_fraction). A run with one scores it, and
not the held-out split, which it never touches: settings are tuned without looking at the held-out figure, and the
held-out split is scored once, when asked (`trainer2 evaluate`)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import trainer2
from trainer2.cli import main
from trainer2.data.load import load_dataset
from trainer2.monitor.telemetry import read_telemetry
from trainer2.running.summary import done_line

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


def test_a_run_with_a_validation_split_scores_validation_only_and_leaves_held_out_to_evaluate(tmp_path, small_text):
    cfg = trainer2.config(None, **TINY, data=str(small_text), context_len=3, validation_fraction=0.2)
    lines: list[str] = []
    run = trainer2.train(cfg, run_dir=tmp_path / "v", log=lines.append)
    rows = [r for r in read_telemetry(tmp_path / "v" / "telemetry.jsonl") if "validation_loss" in r]
    assert [r["window"] for r in rows] == [10, 20]  # every evaluation scored the validation split...
    assert all({"validation_bpc", "validation_acc"} <= r.keys() for r in rows)
    assert not any(k.startswith("heldout_") for r in rows for k in r)  # ...and never the held-out one
    summary = json.loads((tmp_path / "v" / "summary.json").read_text())
    assert summary["validation_bpc"] == rows[-1]["validation_bpc"] and "heldout_bpc" not in summary
    assert summary["heldout_window"] == 20
    assert run.model.evaluate(split="validation")["validation_bpc"] == pytest.approx(summary["validation_bpc"])
    assert "heldout_bpc" in run.model.evaluate()  # the held-out split is scored when asked
    # The machine trained on the shorter training split only: the sampler counts the examples before the cut.
    plain = load_dataset(str(small_text), 3)
    assert run.model.data.num_examples("train") < plain.num_examples("train")


def test_the_done_line_names_the_split_it_scored():
    base = {"windows": 2, "examples_seen": 16, "wall_seconds": 1.0, "windows_per_second": 2.0}
    line = done_line({**base, "validation_bpc": 2.5, "validation_acc": 0.5, "validation_loss": 1.7})
    assert "validation bpc 2.500, acc 0.500" in line and "held-out split not scored" in line
    line = done_line({**base, "heldout_loss": 0.25, "heldout_acc": 0.9})
    assert "held-out loss 0.250 nats/example, acc 0.900" in line and "not scored" not in line


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
