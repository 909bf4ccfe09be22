"""Dead hidden units: units that sit at an edge of their box, 0 or 1, for every example of a batch.

Such a unit gets exactly zero EP gradient (the same clamped value in the free and the nudged phases), so it
neither learns nor passes anything on; many of them mean wasted capacity. Counted at log time from the last
window's free equilibrium (outside the window, so the hot loop stays untouched).
"""

from __future__ import annotations

import torch
from torch import Tensor


def dead_units(hidden: list[Tensor], device: torch.device) -> Tensor:
    """Units of hidden layers h_1..h_M (each (B, H_i), values in [0, 1]) at 0 for every row or at 1 for every row;
    a 0-dim int64 count on `device` (no host sync)."""
    total = torch.zeros((), dtype=torch.int64, device=device)
    for h in hidden:
        total += ((h == 0).all(0) | (h == 1).all(0)).sum()
    return total
