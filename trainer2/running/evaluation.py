"""Held-out scoring of a machine, and a machine loaded from a checkpoint for evaluation or sampling.

Both build only the relaxation part of a step (no update state): scoring is a free phase and the
readout's loss, with no gradient formed.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from trainer2.config import ConfigError, TrainConfig, build_config
from trainer2.io.data import Dataset, heldout_batches
from trainer2.physics.machine import Machine
from trainer2.physics.memory import MemoryBank
from trainer2.physics.relaxation import Relaxation
from trainer2.running.checkpoint import CheckpointError, load_checked, read_meta, saved_config
from trainer2.running.parts import build_parts, resolve_device

EVAL_BATCH = 512  # held-out examples per scoring batch


def relaxation_cache(machine: Machine, cfg: TrainConfig, memory: MemoryBank | None) -> Callable[[int], Relaxation]:
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
    return heldout_from_sums(heldout_sums(relaxation_for, data, device, max_batches), data.kind)


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


def heldout_from_sums(sums: Tensor, kind: str) -> dict[str, float]:
    """The held-out metrics from heldout_sums (one device-to-host transfer)."""
    loss_v, correct_v, count = sums.tolist()
    mean = loss_v / max(count, 1)
    out = {"heldout_loss": mean, "heldout_acc": correct_v / max(count, 1)}
    if kind == "text":
        out["heldout_bpc"] = mean / math.log(2)
    return out


@dataclass
class TrainedMachine:
    """A machine (and memory bank) restored from a checkpoint, with its config, data and window count."""

    cfg: TrainConfig
    data: Dataset
    machine: Machine
    memory: MemoryBank | None
    window: int
    device: torch.device

    def relaxation(self, batch: int) -> Relaxation:
        return Relaxation(self.machine, self.cfg, batch, self.memory)

    def evaluate(self, max_batches: int | None = None) -> dict[str, float]:
        return heldout_metrics(
            relaxation_cache(self.machine, self.cfg, self.memory),
            self.data,
            self.device,
            max_batches if max_batches is not None else self.cfg.eval_batches,
        )


def load_trained(
    path: str | Path, overrides: dict[str, Any] | None = None, log: Callable[[str], None] | None = None
) -> TrainedMachine:
    """The parameters and memory bank of checkpoint directory `path` (no update state); `overrides` may set
    run-steering fields such as device or eval_batches. Everything is checked before a tensor is copied."""
    log = log or (lambda msg: print(msg, file=sys.stderr))
    path = Path(path)
    meta = read_meta(path)
    try:
        cfg = build_config([(f"checkpoint {path}", saved_config(meta["config"])), ("command line", overrides or {})])
    except ConfigError as e:
        raise CheckpointError(f"{path}: its config cannot be used: {e}") from None
    parts = build_parts(cfg, resolve_device(cfg))
    live = {f"param.{k}": v for k, v in parts.machine.named_params().items()}
    if parts.memory is not None:
        live.update(parts.memory.tensors())
    loaded, meta = load_checked(path, cfg, parts.data, live, only=("param.", "memory."))
    for k, dst in live.items():
        dst.copy_(loaded[k])
    log(f"loaded {path} (window {meta['counters'].get('window')})")
    return TrainedMachine(cfg, parts.data, parts.machine, parts.memory, int(meta["step"]), parts.device)
