"""Memory bank: a ring buffer of recent free-phase equilibria that join the prototypes as retrieval candidates."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from trainer2.physics.readout import Candidates


@dataclass
class MemoryBank:
    """coords (C, n) and labels (C,) of recent equilibria; filled (C,) marks written slots; ptr (1,) is
    the next slot. The pointer lives on the device so a write can be captured in a CUDA graph, and is (1,), not 0-dim:
    torch.compile (AOT, torch 2.13) drops an in-place update of a 0-dim CPU tensor. A checkpoint holds it 0-dim."""

    coords: Tensor
    labels: Tensor
    filled: Tensor
    ptr: Tensor
    offsets: Tensor  # (B,) arange, the slots of one write relative to ptr

    @staticmethod
    def allocate(capacity: int, n: int, batch: int, like: Tensor) -> "MemoryBank":
        if capacity < batch:
            raise ValueError(f"memory_capacity ({capacity}) must be at least the batch size ({batch})")
        dev = like.device
        return MemoryBank(
            torch.zeros(capacity, n, dtype=like.dtype, device=dev),
            torch.zeros(capacity, dtype=torch.long, device=dev),
            torch.zeros(capacity, dtype=torch.bool, device=dev),
            torch.zeros(1, dtype=torch.long, device=dev),
            torch.arange(batch, device=dev),
        )

    def candidates(self, protos: Candidates) -> Candidates:
        """Prototypes first, then every slot; an empty slot has bias -inf, so it never wins a retrieval."""
        bias = torch.where(self.filled, 0.0, -math.inf).to(self.coords.dtype)
        return Candidates(
            torch.cat([protos.coords, self.coords]),
            torch.cat([protos.labels, self.labels]),
            torch.cat([protos.bias, bias]),
        )

    def write(self, q: Tensor, labels: Tensor) -> None:
        """Store q (B, n) with labels (B,) at the next B slots, wrapping around.

        A row of q that is not finite leaves its slot empty (and zeroed): one diverged relaxation must
        not poison every later retrieval with NaN, and checking per row needs no host sync."""
        idx = (self.offsets + self.ptr).remainder_(self.coords.shape[0])
        self.coords.index_copy_(0, idx, torch.nan_to_num(q, nan=0.0, posinf=0.0, neginf=0.0))
        self.labels.index_copy_(0, idx, labels)
        self.filled.index_copy_(0, idx, torch.isfinite(q).all(1))
        self.ptr.add_(q.shape[0]).remainder_(self.coords.shape[0])

    def tensors(self) -> dict[str, Tensor]:
        """The bank's state for a checkpoint, by key; `offsets` is derived from the batch size and not saved."""
        return {
            "memory.coords": self.coords,
            "memory.labels": self.labels,
            "memory.filled": self.filled,
            "memory.ptr": self.ptr.view(()),
        }
