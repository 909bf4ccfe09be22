"""Relaxation step counts by convergence: per order and window length, each phase's residual at its last step, how far
the free phase ends from its fixed point, and the EP update's cosine to the exact gradient. Counts only, no timing.

    python -m benchmarks.step_counts --preset dev [--train_windows 3000] [--batches 4] [--free_steps 3 4 6 8 12]
        [--nudge_steps 2 3 4] [--orders jacobi even_odd] [--true_steps 200] [--rows N] [--FIELD VALUE ...]

Trains the preset as configured (its own order and window; the schedule squeezed into --train_windows windows), then,
on that machine and the same --batches training batches, runs the trainer's EP gradient source at every order and
free_steps (with each --nudge_steps, or free_steps scaled by the preset's nudge / free ratio, rounded up) and prints
means over the batches of:
- res free / res nudged: the spd at the last step / sqrt(eps), the residual `bench` and telemetry report (1.00 when
  settled to the floor; Jacobi's alternates between odd and even step counts, its two interleaved sequences);
- err free: |s - s*| / |s*| over every state layer of the free phase's end state against the fixed point s* (float64,
  --true_steps even/odd steps: the honest distance, comparable between the orders);
- cos window: cosine of the EP update (energy couplings and embedding; the readout's gradient is exact either way) to
  autograd's gradient through the same unrolled free window (float64), what benchmarks/quality.py's cosine measures;
- cos fixed: the same against the gradient at the fixed point (the converged reference of benchmarks/ep_cosine.py).
"""

from __future__ import annotations

import argparse
import math
import tempfile

import torch

from benchmarks.autograd_reference import cosine, exact_grads
from benchmarks.ep_cosine import to_float64
from trainer2.cli import train_parser
from trainer2.flags import resolve_config
from trainer2.learning.gradients import ep_gradients
from trainer2.physics.machine import Machine
from trainer2.physics.relaxation import Relaxation
from trainer2.running.trainer import Trainer
from trainer2.train_config import TrainConfig


def estimated(grads: dict[str, torch.Tensor], groups: dict[str, str]) -> torch.Tensor:
    """The EP-estimated part of a gradient (energy couplings and embedding) as one float64 vector."""
    return torch.cat([grads[k].double().flatten() for k, g in groups.items() if g != "readout"])


def fixed_point(m64: Machine, cfg: TrainConfig, x: torch.Tensor, y: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The free phase's fixed point in float64 (even/odd, `steps` steps)."""
    c = cfg.model_copy(update={"dtype": "float64", "relaxation": "even_odd", "free_steps": steps})
    r = Relaxation(m64, c, x.shape[0])
    with torch.no_grad():
        r.free_phase(x, y)
    return [t.clone() for t in r.s0.s]


def measure(
    trainer: Trainer, batches: list, orders: list[str], windows: list[tuple[int, int]], true_steps: int
) -> dict[tuple[str, int, int], dict[str, float]]:
    """(order, free_steps, nudge_steps) -> the means over `batches` of every figure in the module docstring, for every
    order and (free_steps, nudge_steps) in `windows`."""
    cfg, m = trainer.cfg, trainer.machine
    groups, floor = m.param_groups(), math.sqrt(cfg.eps)
    m64 = to_float64(m)
    out: dict[tuple[str, int, int], dict[str, float]] = {}
    for x, y in batches:
        star = fixed_point(m64, cfg, x, y, true_steps)
        truth, _ = exact_grads(m64, x, y, true_steps, 1.0, 1.0, 1.0, cfg.retrieval_beta, cfg.eps, "even_odd")
        for order in orders:
            for t, tn in windows:
                c = cfg.model_copy(update={"relaxation": order, "free_steps": t, "nudge_steps": tn})
                r = Relaxation(m, c, x.shape[0])
                with torch.no_grad():
                    est = estimated(ep_gradients(r, x, y).grads, groups)
                window, _ = exact_grads(m64, x, y, t, 1.0, 1.0, 1.0, cfg.retrieval_beta, cfg.eps, order)
                s = [a.double() for a in r.s0.s]
                err = math.sqrt(sum(float((a - b).square().sum()) for a, b in zip(s, star)))
                row = {
                    "res free": float(r.ws.spd_rows[-1].mean()) / floor,
                    "res nudged": float(r.ws_nudged.spd_rows[-1].mean()) / floor,
                    "err free": err / math.sqrt(sum(float(b.square().sum()) for b in star)),
                    "cos window": cosine(est, estimated(window, groups)),
                    "cos fixed": cosine(est, estimated(truth, groups)),
                }
                acc = out.setdefault((order, t, tn), {})
                for k, v in row.items():
                    acc[k] = acc.get(k, 0.0) + v / len(batches)
    return out


def main() -> None:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__.split("\n")[0], epilog="Unknown arguments are TrainConfig flags."
    )
    p.add_argument("--preset", default="dev")
    p.add_argument("--train_windows", type=int, default=3000, help="windows of training before measuring (0: none)")
    p.add_argument("--batches", type=int, default=4, help="training batches the figures are averaged over")
    p.add_argument("--free_steps", type=int, nargs="+", default=[2, 3, 4, 5, 6, 8, 10, 12, 16])
    p.add_argument(
        "--nudge_steps",
        type=int,
        nargs="+",
        help="nudged steps to pair with every free_steps (default: free_steps times the preset's nudge / free, up)",
    )
    p.add_argument("--orders", nargs="+", choices=["jacobi", "even_odd"], default=["jacobi", "even_odd"])
    p.add_argument("--true_steps", type=int, default=200, help="even/odd steps of the float64 fixed point")
    p.add_argument(
        "--rows", type=int, help="measure on the first ROWS examples of each batch (autograd's memory grows with them)"
    )
    args, flags = p.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = resolve_config(
            train_parser().parse_args(
                ["--preset", args.preset, "--device", "cpu", "--run_name", "step_counts", "--checkpoint_dir", tmp]
                + ["--max_windows", str(max(1, args.train_windows)), "--eval_every_windows", "0", "--eval_batches", "1"]
                + flags
            )
        )
        trainer = Trainer(cfg, log=lambda *_: None)
        if args.train_windows:
            trainer.train()
        batches = [tuple(t[: args.rows] for t in trainer.next_batch()) for _ in range(args.batches)]
        ratio = cfg.nudge_steps / cfg.free_steps
        nudges = lambda t: args.nudge_steps or [math.ceil(t * ratio)]  # noqa: E731
        windows = [(t, tn) for t in args.free_steps for tn in nudges(t)]
        rows = measure(trainer, batches, args.orders, windows, args.true_steps)
    print(
        f"preset {args.preset} ({' '.join(flags) or 'as shipped'}), layers {cfg.layers}, trained {args.train_windows} "
        f"windows with {cfg.relaxation} {cfg.free_steps} / {cfg.nudge_steps}; means over {args.batches} batches of "
        f"{len(batches[0][1])}; fixed point: {args.true_steps} even/odd steps, float64"
    )
    keys = ["res free", "res nudged", "err free", "cos window", "cos fixed"]
    print(f"{'order':<9} {'free':>4} {'nudge':>5} " + " ".join(f"{k:>11}" for k in keys))
    for (order, t, tn), row in rows.items():
        cells = [f"{row[k]:11.3f}" if k.startswith("res") else f"{row[k]:11.2e}" for k in keys[:3]]
        cells += [f"{row[k]:11.5f}" for k in keys[3:]]
        print(f"{order:<9} {t:>4} {tn:>5} " + " ".join(cells))


if __name__ == "__main__":
    main()
