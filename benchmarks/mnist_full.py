"""The full MNIST (60,000 / 10,000): a preset tuned on validation, then scored on the test set once.

    python -m benchmarks.mnist_full --preset benchmarks/mnist_mlp_probe.yaml --split validation [--set F=V ...]
    python -m benchmarks.mnist_full --preset PRESET --split test --seed 0      # once per preset and seed
    python -m benchmarks.mnist_full --npz /tmp/mnist_train.npz   # the 60,000 training images, for benchmarks.quality

--split validation trains on the first 50,000 training images and scores the last 10,000 of them (the test files are
never read), evaluating every --eval_every windows for a time-to-accuracy curve (`trainer2 plot RUN_DIR ...`).
--split test trains on all 60,000 and scores the 10,000 test images once, at the end: what `python main.py --preset
PRESET --data DIR --seed S` does. Prints one JSON line: error in %, the training loop's wall seconds (wall_s) and the
whole run's (total_s: loading, set-up and the final evaluation too), windows/s, examples/s and the process's peak
resident memory. --npz writes the training file's 60,000 images and labels as an image .npz and exits:
`benchmarks.quality --data /tmp/mnist_train.npz --heldout_fraction 0.1666667` then holds out the same last 10,000
(validation), never the test files.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import numpy as np
import yaml

import trainer2
from benchmarks.provenance import commit_of
from trainer2.data.images import find, read_idx

MNIST = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "mnist"
VALIDATION = 10_000  # the last 10,000 of the 60,000 training images


def read_split(root: Path, split: str) -> tuple:
    """(x uint8 [N, 28, 28], y [N]) of MNIST's 'train' or 't10k' IDX files in `root`."""
    paths = find(root, f"{split}-images", "idx3-ubyte"), find(root, f"{split}-labels", "idx1-ubyte")
    if None in paths:
        raise SystemExit(f"{root}: no {split}-images / {split}-labels IDX files; --data names the MNIST directory")
    return read_idx(paths[0]), read_idx(paths[1])


def dataset(root: Path, split: str) -> trainer2.Dataset:
    """validation: the first 50,000 training images, the last 10,000 held out; test: all 60,000, the test files."""
    x, y = read_split(root, "train")
    if split == "validation":
        return trainer2.from_arrays(x[:-VALIDATION], y[:-VALIDATION], x[-VALIDATION:], y[-VALIDATION:])
    return trainer2.from_arrays(x, y, *read_split(root, "t10k"), source=str(root))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="benchmarks/mnist_mlp_probe.yaml", help="preset name or YAML path")
    p.add_argument("--split", choices=("validation", "test"), default="validation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", type=Path, default=MNIST, help="directory of the MNIST IDX files")
    p.add_argument("--run_dir", type=Path, default=None, help="where the run writes (default: a fresh one in /tmp)")
    p.add_argument("--eval_every", type=int, default=None, help="validation: windows between evaluations")
    p.add_argument("--npz", type=Path, default=None, help="write the training images as an .npz here, and exit")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="a config override (YAML value)")
    args = p.parse_args()
    if args.npz is not None:
        x, y = read_split(args.data, "train")
        np.savez(args.npz, x=x, y=y)
        print(f"wrote {args.npz}: {len(y)} training images; --heldout_fraction 0.1666667 holds out the last 10,000")
        return
    overrides = {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in args.set)}
    if args.split == "test":
        overrides["eval_every_windows"] = 0  # the test set is scored once, at the end
    elif args.eval_every is not None:
        overrides["eval_every_windows"] = args.eval_every
    cfg = trainer2.config(args.preset, seed=args.seed, save_every_windows=0, **overrides)
    commit = commit_of()  # the code this process runs: read now, not after a run that outlasts a commit
    started = time.perf_counter()
    data = dataset(args.data, args.split)
    load_s = time.perf_counter() - started
    run_dir = args.run_dir or Path(
        f"/tmp/mnist_full/{Path(args.preset).stem}-{args.split}-s{args.seed}-{time.time_ns()}"
    )
    run = trainer2.train(cfg, data, run_dir=run_dir)
    total = time.perf_counter() - started  # the whole run: loading, set-up, the loop and the final evaluation
    s = run.summary
    wall = s["wall_seconds"]
    row = {
        "preset": args.preset,
        "split": args.split,
        "seed": args.seed,
        "error_pct": round(100 * (1 - s["heldout_acc"]), 2),
        "loss": round(s["heldout_loss"], 4),
        "windows": s["windows"],
        "epochs": round(s["windows"] * cfg.batch_size / data.num_examples("train"), 2),
        "wall_s": round(wall, 1),
        "total_s": round(total, 1),
        "windows_per_s": round(s["windows"] / wall, 1),
        "examples_per_s": round(s["windows"] * cfg.batch_size / wall),
        "data_load_s": round(load_s, 2),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "commit": commit,
        "run_dir": str(run_dir),
        **overrides,
    }
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
