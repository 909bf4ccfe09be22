"""benchmarks/layer_use.py: dead units, live channels and the top singular share of a trained machine's layers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import trainer2
from benchmarks.layer_use import channel_use, main, unit_use


def test_a_unit_at_zero_or_one_for_every_input_is_dead():
    h = torch.tensor([[0.0, 1.0, 0.2, 0.0], [0.0, 1.0, 0.0, 0.5], [0.0, 1.0, 1.0, 0.0]])
    assert unit_use(h) == pytest.approx({"mean": h.mean().item(), "dead": 0.5})  # units 0 and 1 of 4


def test_channels_that_compute_one_feature_share_one_singular_value():
    k = torch.randn(2, 3, 3, generator=torch.Generator().manual_seed(0))
    same = torch.stack([k, 2 * k, -k, 1e-4 * k])  # the last is below 1% of the largest: not live
    assert channel_use(same) == pytest.approx({"channels": 4, "live": 3, "top_share": 1.0})
    orthogonal = torch.eye(3).view(3, 3, 1, 1)
    assert channel_use(orthogonal) == pytest.approx({"channels": 3, "live": 3, "top_share": 1 / 3})


def test_it_reads_a_trained_conv_checkpoint_and_refuses_text(tmp_path, capsys):
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 255, size=(48, 8, 8)).astype(np.uint8), rng.integers(0, 2, 48)
    cfg = trainer2.config(
        None,
        layers=[{"conv": {"channels": 3, "pool": 2}}, {"dense": 6}],
        coord_dim_n=4,
        rotor_k=3,
        batch_size=8,
        max_windows=2,
        eval_every_windows=0,
        eval_batches=1,
        cpu_threads=1,
        data=str(tmp_path / "d.npz"),
    )
    np.savez(tmp_path / "d.npz", x=x, y=y)
    run = trainer2.train(cfg, trainer2.from_arrays(x[:40], y[:40], x[40:], y[40:]), run_dir=tmp_path / "r")
    capsys.readouterr()  # the run's own output
    main([str(run.checkpoint), "--examples", "16"])
    out = capsys.readouterr().out.splitlines()
    assert "free equilibrium of 16 training inputs" in out[0]
    rows = {line.split()[0]: line.split() for line in out[2:]}
    assert set(rows) == {"h_1", "h_2", "q"} and rows["h_1"][1] == "48" and rows["h_2"][1] == "6"  # 3 x 4 x 4 units
    assert rows["h_1"][5:7] == ["W_1", "3"] and rows["q"][5] == "W_out"
    assert rows["h_1"][-1] == "-" and 0.5 < float(rows["h_2"][-1]) < 1.001  # capped at build and after each update
    text = trainer2.train(
        trainer2.config("dev", max_windows=1, eval_every_windows=0, eval_batches=1), run_dir=tmp_path / "t"
    )
    with pytest.raises(SystemExit):
        main([str(text.checkpoint)])
    assert "this checkpoint's data is text" in capsys.readouterr().err
