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
    relaxation_for: Callable[[int], Relaxation],
    data: Dataset,
    device: torch.device,
    max_batches: int | None,
    split: str = "heldout",
) -> dict[str, float]:
    """Loss (nats per example), accuracy and, for text, bits per character of a split (held-out, or validation), keyed
    `<split>_loss` and so on; one host sync at the end. relaxation_for(batch) gives the (cached) relaxation for a batch
    size."""
    return split_metrics(heldout_sums(relaxation_for, data, device, max_batches, split=split), data.tokens, split)


@torch.no_grad()
def heldout_sums(
    relaxation_for: Callable[[int], Relaxation],
    data: Dataset,
    device: torch.device,
    max_batches: int | None,
    shard: tuple[int, int] = (0, 1),
    split: str = "heldout",
) -> Tensor:
    """float64 (3,) on `device`: summed loss (nats), number correct, number scored, over the batches k of `split` (the
    held-out one unless named) with k % shard[1] == shard[0] (rank, world size): adding every shard's sums gives the
    whole split's."""
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    count, (rank, world) = 0, shard
    for k, idx in enumerate(heldout_batches(data.num_examples(split), EVAL_BATCH, max_batches)):
        if k % world != rank:
            continue
        inputs, targets = data.batch(split, idx)
        loss, correct = relaxation_for(len(idx)).score(inputs.to(device), targets.to(device))
        sums += torch.stack([loss.to(sums.dtype), correct.to(sums.dtype)])
        count += len(idx)
    return torch.cat([sums, sums.new_tensor([count])])


def split_metrics(sums: Tensor, tokens: bool, split: str = "heldout") -> dict[str, float]:
    """A split's metrics from heldout_sums (one device-to-host transfer), keyed `<split>_loss`, `<split>_acc` and, for
    text (tokens), `<split>_bpc`."""
    loss_v, correct_v, count = sums.tolist()
    mean = loss_v / max(count, 1)
    out = {f"{split}_loss": mean, f"{split}_acc": correct_v / max(count, 1)}
    if tokens:
        out[f"{split}_bpc"] = mean / math.log(2)
    return out


def scored_split(data: Dataset) -> str:
    """The split a run scores while it trains: its validation split when it has one, so a setting tuned on a run's
    figures never saw the held-out split (that is scored once, when asked: `trainer2 evaluate`), else the held-out."""
    return "validation" if data.validation is not None else "heldout"


def evaluate_split(
    relaxation_for: Callable[[int], Relaxation],
    data: Dataset,
    device: torch.device,
    max_batches: int | None,
    shard: tuple[int, int],
    reduce: Callable[[Tensor, str], None],
) -> dict[str, float]:
    """The metrics of the split a run scores (scored_split), this process scoring its `shard` of the batches and
    `reduce` (an all-reduce sum under torchrun) adding up every process's sums."""
    split = scored_split(data)
    sums = heldout_sums(relaxation_for, data, device, max_batches, shard, split)
    reduce(sums, f"the {split} evaluation")
    return split_metrics(sums, data.tokens, split)
