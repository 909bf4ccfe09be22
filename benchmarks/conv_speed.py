"""The conv coupling's pulls and EP statistic on the CPU, at the conv preset's layer sizes: the adjoint (transposed
convolution) with its input contiguous (NCHW) against channels-last (what trainer2/physics/couplings/conv.py uses),
the upward pull, and the statistic as unfold and a product (the code before 2026-11-25) against one convolution with
rows as channels (Conv.correlation).

    python -m benchmarks.conv_speed [--rows 64] [--rounds 15] [--threads 1]

Interleaved rounds in one run; prints the median milliseconds of each and the ratios NCHW / channels-last and
unfold / convolution.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
import torch.nn.functional as F

from trainer2.physics.couplings import Conv
from trainer2.physics.couplings.conv import pooled_kernel

# (below shape, spec) of the conv preset's two couplings on 28x28 digits
LAYERS = [
    ((1, 28, 28), {"channels": 16, "kernel": 5, "pool": 2}),
    ((16, 14, 14), {"channels": 32, "kernel": 3, "pool": 2}),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=64, help="rows of the workspace (2 x batch for the nudged phases)")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    for below, spec in LAYERS:
        c = Conv.init("1", below, spec, 1.0, gen, torch.float32)
        above = torch.rand(args.rows, math.prod(c.above_shape), generator=gen)
        lower = torch.rand(args.rows, below[0] * below[1] * below[2], generator=gen)
        out = torch.empty_like(lower)

        def nchw() -> None:
            a = above.view(args.rows, *c.above_shape)
            y = F.conv_transpose2d(
                a, pooled_kernel(c.weight, c.pool), stride=c.pool, padding=c.padding, output_padding=c.output_padding
            )
            out.copy_(y.view(out.shape))

        def channels_last() -> None:
            c.down(above, lower, lower, out)

        def up() -> None:
            c.up(lower, above)

        both = torch.rand(2 * args.rows, math.prod(c.above_shape), generator=gen)  # the statistic sees both phases
        lower2 = torch.rand(2 * args.rows, lower.shape[1], generator=gen)

        def unfold() -> None:
            ke = c.weight.shape[-1] + c.pool - 1
            cols = F.unfold(c.image(lower2), ke, padding=c.padding, stride=c.pool)
            g = torch.einsum("rol,rdl->od", both.view(2 * args.rows, c.above_shape[0], -1), cols)
            F.avg_pool2d(g.view(c.weight.shape[0], -1, ke, ke), c.pool, stride=1)

        def convolution() -> None:
            c.correlation(both, lower2)

        runs = {
            "adjoint NCHW": nchw,
            "adjoint channels-last": channels_last,
            "up": up,
            "statistic unfold": unfold,
            "statistic convolution": convolution,
        }
        times: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(args.rounds):
            for name, fn in runs.items():
                start = time.perf_counter()
                for _ in range(5):
                    fn()
                times[name].append((time.perf_counter() - start) / 5 * 1e3)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(
            f"{below} -> {c.above_shape}: "
            + ", ".join(f"{k} {v:.2f} ms" for k, v in med.items())
            + f"; NCHW / channels-last {med['adjoint NCHW'] / med['adjoint channels-last']:.2f}x"
            + f"; unfold / convolution {med['statistic unfold'] / med['statistic convolution']:.2f}x"
        )


if __name__ == "__main__":
    main()
