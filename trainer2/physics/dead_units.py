"""Dead hidden units: units that sit at an edge of their box (0 or 1; a relu6 layer's 0 or 6) for every example of a
batch.

Such a unit gets exactly zero EP gradient (the same clamped value in the free and the nudged phases), so it
neither learns nor passes anything on; many of them mean wasted capacity. Counted at log time from the last
window's free equilibrium (outside the window, so the hot loop stays untouched).
"""

from __future__ import annotations

import torch
from torch import Tensor


def dead_units(
    hidden: list[Tensor], device: torch.device, boxes: tuple[tuple[float, float], ...] | None = None
) -> Tensor:
    """Units of hidden layers h_1..h_M (each (B, H_i), values in their box, [0, 1] unless `boxes` says) at the low
    face for every row or at the high face for every row; a 0-dim int64 count on `device` (no host sync)."""
    total = torch.zeros((), dtype=torch.int64, device=device)
    for h, (low, high) in zip(hidden, boxes or ((0.0, 1.0),) * len(hidden), strict=True):
        total += ((h == low).all(0) | (h == high).all(0)).sum()
    return total
