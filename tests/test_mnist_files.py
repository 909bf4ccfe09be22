"""The full MNIST of ../shared/data/mnist as benchmarks.mnist_full reads it (issue 72): the splits it trains and
scores on, and a few hundred of its images learned; skipped where the files are not on the machine."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import trainer2
from benchmarks import mnist_full

PROBE = Path(mnist_full.__file__).with_name("mnist_mlp_probe.yaml")  # the dense full-MNIST setting
pytestmark = pytest.mark.skipif(
    mnist_full.find(mnist_full.MNIST, "t10k-images", "idx3-ubyte") is None,
    reason=f"the full MNIST is not at {mnist_full.MNIST} on this machine",
)


def test_validation_holds_out_the_last_10000_training_images_and_never_reads_the_test_files(monkeypatch):
    read = []
    real = mnist_full.read_idx

    def recording(path: Path) -> np.ndarray:
        read.append(path.name)
        return real(path)

    monkeypatch.setattr(mnist_full, "read_idx", recording)
    data = mnist_full.dataset(mnist_full.MNIST, "validation")
    assert read == ["train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"]
    assert (data.num_examples("train"), data.num_examples("heldout")) == (50_000, 10_000)
    x, y = real(mnist_full.MNIST / read[0]), real(mnist_full.MNIST / read[1])
    # the held-out split is the training file's last 10,000 rows, in order, scaled as the trainer scales images
    held = data.heldout.reshape(10_000, -1).float()
    last = x[-10_000:].reshape(10_000, -1).astype(np.float32)
    assert np.corrcoef(held[0].numpy(), last[0])[0, 1] > 0.999 and np.corrcoef(held[-1].numpy(), last[-1])[0, 1] > 0.999
    assert data.heldout_y.tolist() == y[-10_000:].tolist()


def test_a_few_hundred_test_file_images_are_learned_well_above_chance(tmp_path):
    x, y = mnist_full.read_split(mnist_full.MNIST, "t10k")
    assert x.shape == (10_000, 28, 28) and x.dtype == np.uint8 and sorted(set(y.tolist())) == list(range(10))
    cfg = trainer2.config(
        PROBE, layers=[{"dense": 128}], max_epochs=None, max_windows=150, cpu_threads=1, lr_warmup_windows=20
    )
    run = trainer2.train(cfg, trainer2.from_arrays(x[:400], y[:400], x[400:600], y[400:600]), run_dir=tmp_path / "r")
    assert run.summary["heldout_acc"] > 0.7  # chance is 0.1; 150 windows of 64 on these 400 reach about 0.87
