"""Weight averaging (ema_decay): the average follows the parameters' trajectory by its formula, training is unchanged,
evaluation, the summary, the run's model, `load` and `evaluate` score the average, and checkpoints keep it through a
resume."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import trainer2
from trainer2.cli import main
from trainer2.running.trainer import Trainer

TINY = dict(
    layers=[{"dense": 12}],
    coord_dim_n=4,
    rotor_k=3,
    batch_size=16,
    free_steps=8,
    nudge_steps=4,
    max_windows=20,
    log_every_windows=10,
    eval_every_windows=0,
    eta_update=0.02,
    heldout_fraction=0.2,
)


def quiet(msg: str) -> None:
    del msg


@pytest.fixture
def blobs(tmp_path) -> Path:
    """Three Gaussian blobs in six dimensions as an .npz file (the last fifth held out)."""
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, 300)
    x = (rng.normal(size=(3, 6))[y] * 2 + rng.normal(size=(300, 6)) * 0.5).astype(np.float32)
    np.savez(tmp_path / "blobs.npz", x=x, y=y)
    return tmp_path / "blobs.npz"


def tiny(data: Path, **overrides) -> trainer2.TrainConfig:
    return trainer2.config(None, **{**TINY, "data": str(data), **overrides})


def test_the_average_follows_the_parameters_by_its_formula_and_training_is_unchanged(blobs):
    plain = Trainer(tiny(blobs), log=quiet)
    averaged = Trainer(tiny(blobs, ema_decay=0.5), log=quiet)
    expected = averaged.params.flat.clone()  # the average starts at the initial parameters
    assert torch.equal(averaged.average.machine.flat, expected)
    for t in range(12):  # d = min(0.5, (1 + t) / (10 + t)): the warm-up's decay until t = 8, then 0.5
        for trainer in (plain, averaged):
            trainer.runner.step(*trainer.next_batch())
        d = min(0.5, (1 + t) / (10 + t))
        expected = d * expected + (1 - d) * averaged.params.flat
    assert torch.equal(plain.params.flat, averaged.params.flat)  # training never reads the average
    assert torch.allclose(averaged.average.machine.flat, expected, rtol=0, atol=1e-6)
    assert not torch.allclose(averaged.average.machine.flat, averaged.params.flat, atol=1e-4)  # it lags behind
    assert plain.average is None and plain.scored_machine is plain.machine
    assert averaged.scored_machine is averaged.average.machine


def test_evaluation_the_summary_the_model_and_load_score_the_average(blobs, tmp_path):
    lines: list[str] = []
    run = trainer2.train(tiny(blobs, ema_decay=0.9), run_dir=tmp_path / "a", log=lines.append)
    assert run.summary["scored_weights"] == "average" and run.model.weights == "average"
    assert any("weight average (ema_decay 0.9)" in line for line in lines)  # the run says what it scores
    auto, raw = trainer2.load(run.checkpoint), trainer2.load(run.checkpoint, weights="raw")
    assert auto.weights == "average" and raw.weights == "raw"
    assert torch.equal(auto.machine.flat, run.model.machine.flat)
    scored = auto.evaluate()
    assert scored["heldout_loss"] == pytest.approx(run.summary["heldout_loss"], rel=1e-6)
    assert raw.evaluate()["heldout_loss"] != pytest.approx(scored["heldout_loss"], rel=1e-6)
    plain = trainer2.train(tiny(blobs), run_dir=tmp_path / "b", log=quiet)
    assert plain.summary["scored_weights"] == "raw"
    assert torch.equal(trainer2.load(plain.checkpoint).machine.flat, raw.machine.flat)  # the same training
    with pytest.raises(trainer2.CheckpointError, match="holds no weight average.*ema_decay 0"):
        trainer2.load(plain.checkpoint, weights="average")
    with pytest.raises(trainer2.ConfigError, match="weights: expected one of auto, average, raw"):
        trainer2.load(plain.checkpoint, weights="ema")


def test_a_resume_keeps_the_average_and_one_without_an_average_begins_it_there(blobs, tmp_path):
    whole = trainer2.train(tiny(blobs, ema_decay=0.9), run_dir=tmp_path / "whole", log=quiet)
    trainer2.train(tiny(blobs, ema_decay=0.9, max_windows=10), run_dir=tmp_path / "split", log=quiet)
    resumed = trainer2.train(tiny(blobs, ema_decay=0.9), run_dir=tmp_path / "split", resume="latest", log=quiet)
    assert torch.equal(resumed.model.machine.flat, whole.model.machine.flat)  # the average came back bitwise

    trainer2.train(tiny(blobs, max_windows=10), run_dir=tmp_path / "late", log=quiet)
    lines: list[str] = []
    late = Trainer(tiny(blobs, ema_decay=0.9), log=lines.append)
    late.load_checkpoint(tmp_path / "late" / "step_00000010")
    assert torch.equal(late.average.machine.flat, late.params.flat)  # begun anew from the resumed parameters
    assert any("holds no weight average" in line for line in lines)
    dropped = Trainer(tiny(blobs), log=quiet)
    dropped.load_checkpoint(tmp_path / "split" / "step_00000010")  # ema_decay 0 now: the saved average is not read
    assert dropped.average is None and torch.equal(dropped.params.flat, late.params.flat)


def test_the_decay_is_checked_and_the_command_line_scores_either_weights(blobs, tmp_path, capsys):
    with pytest.raises(trainer2.ConfigError, match="ema_decay"):
        tiny(blobs, ema_decay=1.0)
    run = trainer2.train(tiny(blobs, ema_decay=0.5), run_dir=tmp_path / "c", log=quiet)
    capsys.readouterr()
    figures = {}
    for weights in ("auto", "raw"):
        assert main(["evaluate", "--checkpoint", str(run.checkpoint), "--weights", weights]) == 0
        figures[weights] = json.loads(capsys.readouterr().out)
    assert figures["auto"]["weights"] == "average" and figures["raw"]["weights"] == "raw"
    assert figures["auto"]["heldout_loss"] == pytest.approx(run.summary["heldout_loss"], rel=1e-6)
    assert figures["raw"]["heldout_loss"] != pytest.approx(figures["auto"]["heldout_loss"], rel=1e-6)


def test_the_rotor_angles_are_averaged_on_the_circle(blobs):
    averaged = Trainer(tiny(blobs, ema_decay=0.75), log=quiet)
    avg, theta = averaged.average.machine.readout.theta, averaged.machine.readout.theta
    averaged.average.count.fill_(1000.0)  # past the warm-up: each update moves the average by 1 - 0.75
    avg.fill_(math.pi - 0.05)
    theta.fill_(-math.pi + 0.05)  # 0.1 rad further round, past the wrap (a plain lerp would land near pi / 2)
    averaged.batch_step.average.update()
    assert torch.allclose(avg, torch.full_like(avg, math.pi - 0.025), atol=1e-6)
    theta.fill_(-math.pi + 0.3)  # the average steps past pi, to pi + 0.05625, and wraps as the parameters do
    averaged.batch_step.average.update()
    assert torch.allclose(avg, torch.full_like(avg, -math.pi + 0.05625), atol=1e-6)  # pi - 0.025 + 0.25 * 0.325
    for step in range(400):  # an angle that keeps winding: the average follows it round, and stays in [-pi, pi)
        theta.add_(0.05).add_(math.pi).remainder_(2 * math.pi).sub_(math.pi)
        averaged.batch_step.average.update()
        assert float(avg.min()) >= -math.pi - 1e-6 and float(avg.max()) < math.pi + 1e-6
    behind = torch.remainder(theta - avg + math.pi, 2 * math.pi) - math.pi  # 0.05 * 0.75 / 0.25 in the steady state
    assert torch.allclose(behind, torch.full_like(behind, 0.15), atol=1e-4)


def test_load_checks_the_averages_shapes_before_copying_them(blobs, tmp_path):
    run = trainer2.train(tiny(blobs, ema_decay=0.5), run_dir=tmp_path / "d", log=quiet)
    tensors = load_file(str(run.checkpoint / "tensors.safetensors"))
    tensors["average.g_diag"] = tensors["average.g_diag"][:1].clone()  # one value, which copy_ would broadcast
    save_file(tensors, str(run.checkpoint / "tensors.safetensors"))
    meta = json.loads((run.checkpoint / "meta.json").read_text())
    data = (run.checkpoint / "tensors.safetensors").read_bytes()
    meta["tensors"].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())  # intact but for the shape
    (run.checkpoint / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(trainer2.CheckpointError, match="average.g_diag.*expected"):
        trainer2.load(run.checkpoint)


def test_sample_says_which_weights_it_generates_with(small_text, tmp_path, capsys):
    cfg = trainer2.config(None, **{**TINY, "data": str(small_text), "heldout_fraction": 0.1, "ema_decay": 0.5})
    run = trainer2.train(cfg, run_dir=tmp_path / "t", log=quiet)
    capsys.readouterr()
    for weights, said in (("auto", "average weights"), ("raw", "raw weights")):
        argv = ["sample", "--checkpoint", str(run.checkpoint), "--length", "5", "--weights", weights]
        assert main(argv) == 0
        assert said in capsys.readouterr().err
