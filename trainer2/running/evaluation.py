"""Held-out scoring of a machine: a free phase and the readout's loss per batch, with no gradient formed and no update
state (only the relaxation part of a step is built)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from trainer2.data.dataset import Dataset, heldout_batches
from trainer2.physics.machine import Machine
from trainer2.physics.memory import MemoryBank
from trainer2.physics.relaxation import DynamicsConfig, Relaxation

EVAL_BATCH = 512  # held-out examples per scoring batch


def relaxation_cache(machine: Machine, cfg: DynamicsConfig, memory: MemoryBank | None) -> Callable[[int], Relaxation]:
    """relaxation_for(batch): a scoring relaxation (no update state) for each batch size, built once per size."""
    cache: dict[int, Relaxation] = {}

    def relaxation_for(batch: int) -> Relaxation:
        if batch not in cache:
            cache[batch] = Relaxation(machine, cfg, batch, memory)
        return cache[batch]

    return relaxation_for


@torch.no_grad()
def heldout_metrics(
    relaxation_for: Callable[[int], Relaxation], data: Dataset, device: torch.device, max_batches: int | None
) -> dict[str, float]:
    """Held-out loss (nats per example), accuracy and, for text, bits per character; one host sync at the end.

    relaxation_for(batch) gives the (cached) relaxation for a batch size."""
    return heldout_from_sums(heldout_sums(relaxation_for, data, device, max_batches), data.tokens)


@torch.no_grad()
def heldout_sums(
    relaxation_for: Callable[[int], Relaxation],
    data: Dataset,
    device: torch.device,
    max_batches: int | None,
    shard: tuple[int, int] = (0, 1),
) -> Tensor:
    """float64 (3,) on `device`: summed loss (nats), number correct, number scored, over the held-out batches
    k with k % shard[1] == shard[0] (rank, world size): adding every shard's sums gives the whole split's."""
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    count, (rank, world) = 0, shard
    for k, idx in enumerate(heldout_batches(data.num_examples("heldout"), EVAL_BATCH, max_batches)):
        if k % world != rank:
            continue
        inputs, targets = data.batch("heldout", idx)
        loss, correct = relaxation_for(len(idx)).score(inputs.to(device), targets.to(device))
        sums += torch.stack([loss.to(sums.dtype), correct.to(sums.dtype)])
        count += len(idx)
    return torch.cat([sums, sums.new_tensor([count])])


def heldout_from_sums(sums: Tensor, tokens: bool) -> dict[str, float]:
    """The held-out metrics from heldout_sums (one device-to-host transfer); bits per character for text (tokens)."""
    loss_v, correct_v, count = sums.tolist()
    mean = loss_v / max(count, 1)
    out = {"heldout_loss": mean, "heldout_acc": correct_v / max(count, 1)}
    if tokens:
        out["heldout_bpc"] = mean / math.log(2)
    return out
