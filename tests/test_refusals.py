"""Issue 27: a run that fails says so, and nothing outside a run is ever touched. Divergence of the loss, run
directories that hold only the run's own files, validation before allocation, and clear errors for bad inputs."""

from __future__ import annotations

import json
import math

import pytest

from test_checkpoint import config, flags, run_dir
from trainer2 import checkpoint as ck
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
