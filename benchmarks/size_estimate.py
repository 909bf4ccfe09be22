"""trainer2/running/sizes.py's estimate against the peak resident memory of a short run, one config change per process.

    python -m benchmarks.size_estimate

Each row: a 2-window run on the built-in corpus (12 free + 6 nudged steps, one held-out batch) in a fresh process;
measured = peak RSS after the run minus before building the Trainer (MiB), estimated = sum of sizes.needs (MiB).
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
CHANGES = [
    {},
    {"batch_size": 20000},
    {"hidden_sizes": [8000]},
    {"memory_capacity": 100000},
    {"free_steps": 5000},
    {"rotor_k": 2000000},
    {"coord_dim_n": 1024},
    {"embed_dim": 4000},
]


def measure(change: dict, ckdir: str) -> dict:
    """In this process: peak RSS growth of one short run, and the estimate for its config."""
    from trainer2.running.sizes import needs
    from trainer2.running.trainer import Trainer
    from trainer2.train_config import TrainConfig

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cfg = TrainConfig(
        **{
            "max_windows": 2,
            "log_every_windows": 1,
            "eval_every_windows": 0,
            "eval_batches": 1,
            "checkpoint_dir": ckdir,
            "run_name": "size",
            "free_steps": 12,
            "nudge_steps": 6,
            **change,
        }
    )
    tr = Trainer(cfg, log=lambda m: None)
    estimate = sum(p.bytes for p in needs(cfg, tr.data.num_classes, tr.data.input_dim, tr.data.kind == "text"))
    tr.train()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"change": change, "measured_mib": round((peak - base) / 1024), "estimated_mib": round(estimate / 2**20)}


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("child", nargs="*", help=argparse.SUPPRESS)  # CHANGE_JSON CHECKPOINT_DIR: one measurement
    args = p.parse_args()
    if len(args.child) == 2:  # a child: one measurement
        print(json.dumps(measure(json.loads(args.child[0]), args.child[1])))
        return 0
    for change in CHANGES:
        with tempfile.TemporaryDirectory() as ck:
            out = subprocess.run(
                [sys.executable, __file__, json.dumps(change), ck],
                capture_output=True,
                text=True,
                env={"OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "PATH": "/usr/bin:/bin"},
            )
        print(out.stdout.strip() or out.stderr.strip().splitlines()[-1], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
