"""trainer2/running/sizes.py: the estimate of what a run allocates covers every coupling kind (each kind estimates its
own parameters and buffers), agrees with the measured peak memory, and refuses what cannot fit before allocating it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import trainer2
from trainer2.cli import main
from trainer2.components import resolve
from trainer2.data.dataset import InputSpec
from trainer2.data.load import load_dataset
from trainer2.running import parts as parts_module
from trainer2.running import sizes

REPO = Path(__file__).resolve().parent.parent


def images(path: Path, side: int, count: int = 600) -> Path:
    rng = np.random.default_rng(0)
    np.savez(path, x=rng.random((count, side, side), dtype=np.float32), y=rng.integers(0, 10, count))
    return path


def features(path: Path, dim: int, count: int) -> Path:
    rng = np.random.default_rng(0)
    np.savez(path, x=rng.random((count, dim), dtype=np.float32), y=rng.integers(0, 10, count))
    return path


def test_every_coupling_kind_estimates_its_parameters_exactly():
    image = (1, 8, 8)
    for kind, spec in (("dense", 12), ("conv", {"channels": 3, "kernel": 5, "pool": 2}), ("conv", {"channels": 2})):
        built = resolve("coupling", kind).init("1", image, spec, 1.0, torch.Generator().manual_seed(0), torch.float32)
        assert resolve("coupling", kind).param_count(image, spec) == sum(t.numel() for t in built.parameters().values())


# One config per coupling kind (and pooling), each large enough that what it allocates outweighs the interpreter's
# own memory; measured in a fresh process by benchmarks/size_estimate.py (peak RSS growth over a 2-window run).
MEASURED = {
    "dense": {"data": "feat.npz", "hidden_sizes": [3000], "batch_size": 1000},
    "conv, average pooling": {"data": "img28.npz", "layers": [{"conv": {"channels": 256, "kernel": 5, "pool": 2}}]},
    "conv, max pooling": {"data": "img28.npz", "layers": [{"conv": {"channels": 64, "pool": 2, "pooling": "max"}}]},
}


@pytest.mark.parametrize("kind", list(MEASURED))
def test_the_estimate_is_within_a_factor_of_2_of_the_measured_peak(tmp_path, kind):
    features(tmp_path / "feat.npz", 1000, 1200)
    images(tmp_path / "img28.npz", 28)
    images(tmp_path / "img8.npz", 8)
    change = json.dumps({"batch_size": 64, **MEASURED[kind]})
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.size_estimate", change, str(tmp_path)],
        cwd=REPO,
        env={**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    row = json.loads(out.stdout.strip().splitlines()[-1] if out.stdout.strip() else "{}") or pytest.fail(out.stderr)
    assert row["measured_mib"] > 100, row  # the run's own allocations dominate what is measured
    assert 0.5 <= row["measured_mib"] / row["estimated_mib"] <= 2.0, row


@pytest.mark.parametrize(
    "layers, says",
    [
        ([{"conv": {"channels": 65536}}], "layers: the run would need about"),  # 4.2M units a row: the 7.7 GB
        ([{"conv": {"channels": 1000000}}], "layers: the run would need about"),
        ([{"conv": {"channels": 4, "kernel": 2**20 - 1}}], "(parameters and update state: 131071.8 GiB"),
        ([{"conv": {"channels": 4, "pool": 9}}], "layers: layer 0 (conv): pool 9 is larger than the 8x8 image"),
    ],
)
def test_conv_sizes_that_cannot_fit_are_refused_before_allocation(tmp_path, capsys, monkeypatch, layers, says):
    monkeypatch.setattr(sizes, "available_bytes", lambda device: 4.0 * 2**30)  # the same answer on any machine
    monkeypatch.setattr(parts_module, "build_machine", lambda *a, **k: pytest.fail("allocated before the check"))
    (tmp_path / "big.yaml").write_text(json.dumps({"layers": layers}))
    argv = ["--config", str(tmp_path / "big.yaml"), "--data", str(images(tmp_path / "img8.npz", 8))]
    assert main([*argv, "--checkpoint_dir", str(tmp_path / "ck"), "--max_windows", "2"]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())


def test_the_conv_preset_is_no_false_alarm(tmp_path):
    """The conv preset on MNIST-sized images needs some tens of MiB, not more."""
    cfg = trainer2.config("conv")
    data = load_dataset(str(images(tmp_path / "img28.npz", 28)), cfg.context_len)
    assert 10 * 2**20 < sum(p.bytes for p in sizes.needs(cfg, InputSpec.of(data), data.num_examples("heldout"))) < 2**30
