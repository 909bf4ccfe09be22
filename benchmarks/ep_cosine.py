"""Cosine between the trainer's EP update and the true gradient, on real batches, with a preset's own settings.

    python -m benchmarks.ep_cosine --preset dev [--train_windows 500] [--batches 4] [--per_param]
        [--hidden_sizes 256 256] [--FIELD VALUE ...]

Any TrainConfig flag after the options overrides the preset (a conv machine on an image file, for example:
`--preset conv_deep --data mnist5000.npz --heldout_fraction 0.2 --true_steps 8`; with --true_steps at the preset's
free steps the reference is the same window's exact gradient, as benchmarks/quality.py measures it).

The true gradient is autograd through a long (converged) relaxation in float64; the EP estimate is the
trainer's own gradient source (`Trainer.gradients`, EP) with the preset's window lengths and dtype. Printed per
parameter group and for all parameters together, at initialisation and after some training; with --per_param also
per parameter (W_1, b_1, ..., W_out, b_out, the readout tensors, emb), which shows the estimate layer by layer in a
deep machine.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

import trainer2
from benchmarks.autograd_reference import cosine, exact_grads
from trainer2.data.dataset import DataError
from trainer2.flags import flag_overrides
from trainer2.physics.machine import move_machine
from trainer2.running.trainer import Trainer
from trainer2.train_config import ConfigError


def to_float64(machine):
    m = copy.deepcopy(machine)
    for t in m.named_params().values():
        t.data = t.data.double()
    return move_machine(m, torch.device("cpu"))


def measure(trainer: Trainer, batches: int, true_steps: int, per_param: bool = False) -> dict[str, float]:
    """Mean over `batches` training batches of the cosine per group and overall (and per parameter name)."""
    cfg = trainer.cfg
    sums: dict[str, float] = {}
    for _ in range(batches):
        inputs, targets = trainer.next_batch()
        with torch.no_grad():
            est = trainer.gradients(trainer.relaxation, inputs.to(trainer.device), targets.to(trainer.device)).grads
        ref, _ = exact_grads(
            to_float64(trainer.machine),
            inputs.cpu(),
            targets.cpu(),
            true_steps,
            cfg.dt,
            cfg.gamma,
            cfg.mass,
            cfg.retrieval_beta,
            cfg.eps,
            cfg.relaxation,
        )
        groups: dict[str, tuple[list, list]] = {}
        for n, g in est.items():
            a, b = groups.setdefault(trainer.machine.param_groups()[n], ([], []))
            a.append(g.double().cpu().flatten())
            b.append(ref[n].flatten())
        groups["all"] = ([x for v in groups.values() for x in v[0]], [x for v in groups.values() for x in v[1]])
        if per_param:
            groups.update({n: ([g.double().cpu().flatten()], [ref[n].flatten()]) for n, g in est.items()})
        for k, (a, b) in groups.items():
            sums[k] = sums.get(k, 0.0) + cosine(torch.cat(a), torch.cat(b)) / batches
    return sums


def main() -> None:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__.split("\n")[0], epilog="Unknown arguments are TrainConfig flags."
    )
    p.add_argument("--preset", default="dev")
    p.add_argument("--train_windows", type=int, default=500, help="windows of training before the second measurement")
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--true_steps", type=int, default=400, help="relaxation steps of the converged reference")
    p.add_argument("--per_param", action="store_true", help="also print the cosine of every parameter tensor")
    p.add_argument("--hidden_sizes", type=int, nargs="+", help="override the preset's hidden layers (e.g. 256 256 256)")
    args, flags = p.parse_known_args()
    hidden = {} if args.hidden_sizes is None else {"hidden_sizes": args.hidden_sizes}
    values = {
        "device": "cpu",
        "run_name": f"ep_cosine_{args.preset}",
        "max_windows": max(1, args.train_windows),
        "eval_batches": 2,
        **hidden,
        **flag_overrides(flags),
    }
    cfg = trainer2.config(args.preset, **values)
    trainer = Trainer(cfg, log=lambda *_: None)
    print(
        f"preset {args.preset}, layers {cfg.layers}: "
        f"T_free={cfg.free_steps}, T_nudge={cfg.nudge_steps}, beta={cfg.beta_nudge}, "
        f"rule={cfg.rule}, dtype={cfg.dtype}; reference: {args.true_steps} steps, float64"
    )
    rows = [("init", measure(trainer, args.batches, args.true_steps, args.per_param))]
    if args.train_windows:
        trainer.train()
        rows.append(
            (f"after {args.train_windows} windows", measure(trainer, args.batches, args.true_steps, args.per_param))
        )
    keys = list(rows[0][1])
    width = max(9, *map(len, keys))
    print(f"{'':>{width}} " + " ".join(f"{label:>22}" for label, _ in rows))  # one line per group or parameter
    for k in keys:
        print(f"{k:>{width}} " + " ".join(f"{vals[k]:22.5f}" for _, vals in rows))


if __name__ == "__main__":
    try:
        main()
    except (ConfigError, DataError) as e:
        print(f"{Path(__file__).name}: error: {e}", file=sys.stderr)
        sys.exit(2)  # as the trainer's command line does
