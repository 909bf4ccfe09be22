"""How much of each layer a trained machine uses. From a checkpoint of a machine trained on images or feature vectors:
the free equilibrium of the first N training inputs (each hidden layer's mean activity, and its dead units: at 0, or
at 1, for every input, so the EP statistic of their couplings is zero and they never learn), and each coupling's
output channels (conv) or units (dense): how many are live (a kernel norm over 1% of the largest), and the share of
the largest singular value in the squared norm of their weight matrix (rows: channels; 1/rows for orthogonal
channels of equal norm, 1 where every live channel computes the same feature), and for each coupling between state
layers its operator norm over the spectral cap (coupling_cap; power iteration to convergence).

    python -m benchmarks.layer_use CHECKPOINT [--examples 500] [--weights raw|average]
"""

from __future__ import annotations

import argparse

import torch
from torch import Tensor

import trainer2
from trainer2.data.load import DataConfig, load_data
from trainer2.physics.machine import coupling_cap

LIVE = 0.01  # a channel is live where its kernel's norm is over this share of the largest


def unit_use(h: Tensor) -> dict[str, float]:
    """Mean activity and the share of dead units (at 0 for every row, or at 1 for every row) of a layer h (R, H)."""
    dead = (h == 0).all(0) | (h == 1).all(0)
    return {"mean": float(h.mean()), "dead": float(dead.float().mean())}


def channel_use(weight: Tensor) -> dict[str, float]:
    """Live output channels of a weight (C_out, ...) and the top singular value's share of their squared norm."""
    rows = weight.detach().double().flatten(1)
    norms = torch.linalg.vector_norm(rows, dim=1)
    live = rows[norms > LIVE * norms.max()]
    s = torch.linalg.svdvals(live)
    return {"channels": rows.shape[0], "live": live.shape[0], "top_share": float(s[0] ** 2 / (s**2).sum())}


def norm_over_cap(c: object, cap: float) -> float:
    """A coupling's operator norm (L's, for a conv) over the cap: exact for a dense coupling, 300 power-iteration
    steps from a fixed start for one with `power_step` (a conv), NaN for others."""
    if isinstance(c, trainer2.Dense):
        return float(torch.linalg.matrix_norm(c.weight.double(), ord=2)) / cap
    if not hasattr(c, "power_step"):
        return float("nan")
    steady = c.with_kernel()
    u = torch.randn(c.power_size, generator=torch.Generator().manual_seed(0), dtype=c.weight.dtype)
    for _ in range(300):
        sigma, _ = steady.power_step(u)
    return float(sigma) / cap


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("--examples", type=int, default=500, help="training inputs relaxed (default 500)")
    p.add_argument("--weights", choices=("raw", "average"), default="raw", help="which parameters (default raw)")
    args = p.parse_args(argv)
    model = trainer2.load(args.checkpoint, weights=args.weights)
    data = load_data(model.cfg.section(DataConfig))
    if data.tokens:
        p.error("layer_use reads images or feature vectors; this checkpoint's data is text")
    rows = data.train[: args.examples].to(model.device)
    relax = model.relaxation(len(rows))
    relax.free_phase(rows, torch.zeros(len(rows), dtype=torch.long, device=model.device))
    energy = model.machine.energy
    print(f"{args.checkpoint} ({args.weights} parameters), free equilibrium of {len(rows)} training inputs")
    cap = coupling_cap(model.machine.spec)
    print("layer  units    mean   dead  | coupling into it: channels  live  top share  norm / cap")
    for i, (h, c) in enumerate(zip(relax.s0.s, energy.couplings)):
        u = unit_use(h[: len(rows)])
        w = channel_use(next(iter(c.parameters().values())))  # W_<name>, the first of its parameters
        name = "q" if i == len(energy.couplings) - 1 else f"h_{i + 1}"
        capped = f"{norm_over_cap(c, cap):10.4f}" if i else f"{'-':>10}"  # the input's coupling is not capped
        print(
            f"{name:<6} {h.shape[1]:>6} {u['mean']:7.3f} {u['dead']:6.3f}  | W_{c.name:<22} {w['channels']:>8} "
            f"{w['live']:>5}  {w['top_share']:9.3f}  {capped}"
        )


if __name__ == "__main__":
    main()
