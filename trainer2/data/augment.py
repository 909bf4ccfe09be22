"""Random translations of training images: each image of a batch moves by up to `shift` pixels in each direction,
the border it uncovers filled with its own edge pixels (MNIST's background stays background).

The shifts of window w come from a generator seeded by (seed, w, rank) alone, so a resumed run draws the same ones
and nothing about them is saved. One gather per batch on the batch's device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def window_generator(seed: int, window: int, rank: int) -> torch.Generator:
    """A CPU generator for one window's draws, a function of (seed, window, rank) only."""
    return torch.Generator().manual_seed(((seed * 1_000_003 + window) * 1_009 + rank) % (1 << 63))


def shift_images(rows: Tensor, shape: tuple[int, ...], shift: int, gen: torch.Generator) -> Tensor:
    """rows (B, C*H*W) of (C, H, W) images, each translated by (dy, dx) uniform in [-shift, shift]^2 (edge-padded);
    returns a new (B, C*H*W) tensor."""
    b, (c, h, w) = rows.shape[0], shape
    padded = F.pad(rows.view(b, c, h, w), (shift,) * 4, mode="replicate")
    dy, dx = torch.randint(0, 2 * shift + 1, (2, b, 1), generator=gen).to(rows.device)
    ys = (dy + torch.arange(h, device=rows.device))[:, None, :, None]  # (B, 1, H, 1) rows of the padded image
    xs = (dx + torch.arange(w, device=rows.device))[:, None, None, :]  # (B, 1, 1, W)
    batch = torch.arange(b, device=rows.device)[:, None, None, None]
    chan = torch.arange(c, device=rows.device)[None, :, None, None]
    return padded[batch, chan, ys, xs].reshape(b, -1)
