"""benchmarks/rules.py on a tiny sample: every rule trains, the cosines are measured against recurrent backprop's
converged gradient (so rbp itself sits at 1 and centred EP close to it), and the costs' runs report accuracy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from benchmarks import rules as bench


@pytest.fixture
def tiny(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    rng = np.random.default_rng(0)
    y = rng.integers(0, 10, size=300)
    x = rng.random((300, 784), dtype=np.float32) * 0.2 + np.eye(10, 784, dtype=np.float32)[y]
    np.savez(tmp_path / "mnist5000_flat.npz", x=x, y=y)
    monkeypatch.setattr(bench, "MACHINES", {"dense": bench.Bench("dev", "mnist5000_flat.npz", (6, 6))})
    return tmp_path


def test_every_rule_is_measured_against_the_exact_gradient(tiny):
    res = bench.run_machine("dense", ["ep", "ep_positive", "chl", "rbp"], True, tiny, bench.Steps(None, 12, 6))
    assert set(res) == {"ep", "ep_positive", "chl", "rbp"}
    for r in res.values():
        assert 0.0 <= r["heldout_acc"] <= 1.0 and r["seconds_per_window"] > 0 and -1 <= r["cosine_to_exact"] <= 1
    assert res["rbp"]["cosine_to_exact"] > 0.999  # the preset's sweeps against 200: the same gradient
    assert res["ep"]["cosine_to_exact"] > 0.99  # centred EP estimates it
    assert res["chl"]["cosine_to_exact"] < res["ep"]["cosine_to_exact"]  # a clamp follows another gradient


def test_the_costs_runs_report_held_out_accuracy(tiny):
    out = bench.run_costs(["mse", "cross_entropy"], True, tiny, bench.Steps())
    assert set(out) == {"mse", "cross_entropy"} and all(0.0 <= a <= 1.0 for a in out.values())
