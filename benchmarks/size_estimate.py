"""trainer2/running/sizes.py's estimate against the peak resident memory of a short run, one config change per process.

    python -m benchmarks.size_estimate

Each row: a 2-window run (12 free + 6 nudged steps, one held-out batch) in a fresh process, on the built-in corpus or,
for the rows with conv layers, on random 28x28 (or 8x8) images; measured = peak RSS after the run minus before
building the Trainer (MiB; the high-water mark is reset there, on Linux), estimated = sum of sizes.needs (MiB).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONV = {"data": "img28.npz", "batch_size": 64}
CHANGES = [
    {},
    {"batch_size": 20000},
    {"hidden_sizes": [8000]},
    {"memory_capacity": 100000},
    {"free_steps": 5000},
    {"rotor_k": 2000000},
    {"coord_dim_n": 1024},
    {"embed_dim": 4000},
    {**CONV, "layers": [{"conv": {"channels": 16, "kernel": 5, "pool": 2}}, {"conv": {"channels": 32, "pool": 2}}]},
    {**CONV, "layers": [{"conv": {"channels": 256, "kernel": 5, "pool": 2}}]},
    {**CONV, "layers": [{"conv": {"channels": 64, "kernel": 3, "pool": 2, "pooling": "max"}}]},
    {**CONV, "layers": [{"conv": {"channels": 8, "kernel": 3}}, {"conv": {"channels": 8, "kernel": 27}}]},
    {**CONV, "data": "img8.npz", "layers": [{"conv": {"channels": 8192}}]},
]


def images(path: Path, side: int, count: int) -> None:
    """Random images [count, side, side] with 10 labels."""
    import numpy as np

    rng = np.random.default_rng(0)
    np.savez(path, x=rng.random((count, side, side), dtype=np.float32), y=rng.integers(0, 10, count))


def status_kib(key: str) -> int | None:
    """A "VmRSS" / "VmHWM" line of /proc/self/status, in KiB; None where there is none."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))
    except (OSError, StopIteration, ValueError):
        return None


def reset_peak() -> int:
    """Reset the resident high-water mark to the current resident size (Linux: clear_refs 5), and return it in KiB,
    so that an earlier peak (imports, a Triton interpreter) cannot hide the run's; else the peak so far."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return status_kib("VmRSS") or 0
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def peak_kib() -> int:
    return status_kib("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def measure(change: dict, workdir: str) -> dict:
    """In this process: peak RSS growth of one short run, and the estimate for its config."""
    from trainer2.data.dataset import InputSpec
    from trainer2.running.sizes import needs
    from trainer2.running.trainer import Trainer
    from trainer2.train_config import TrainConfig

    cfg = {
        "max_windows": 2,
        "log_every_windows": 1,
        "eval_every_windows": 0,
        "eval_batches": 1,
        "checkpoint_dir": workdir,
        "run_name": "size",
        "free_steps": 12,
        "nudge_steps": 6,
        **change,
    }
    if "data" in cfg:
        cfg["data"] = str(Path(workdir) / cfg["data"])
    cfg = TrainConfig(**cfg)
    base = reset_peak()
    tr = Trainer(cfg, log=lambda m: None)
    estimate = sum(p.bytes for p in needs(cfg, InputSpec.of(tr.data), tr.data.num_examples("heldout")))
    tr.train()
    peak = peak_kib()
    return {"change": change, "measured_mib": round((peak - base) / 1024), "estimated_mib": round(estimate / 2**20)}


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("child", nargs="*", help=argparse.SUPPRESS)  # CHANGE_JSON WORKDIR: one measurement
    p.add_argument("--only", default="", help="Only the rows whose change (as JSON) contains this.")
    args = p.parse_args()
    if len(args.child) == 2:  # a child: one measurement
        print(json.dumps(measure(json.loads(args.child[0]), args.child[1])))
        return 0
    for change in CHANGES:
        if args.only not in json.dumps(change):
            continue
        with tempfile.TemporaryDirectory() as work:
            images(Path(work) / "img28.npz", 28, 600)
            images(Path(work) / "img8.npz", 8, 600)
            out = subprocess.run(
                [sys.executable, __file__, json.dumps(change), work],
                capture_output=True,
                text=True,
                env={"OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "PATH": "/usr/bin:/bin"},
            )
        print(out.stdout.strip() or out.stderr.strip().splitlines()[-1], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
