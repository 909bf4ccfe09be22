"""The parts a run computes with, built in one place for training, evaluation, sampling and bench.

`build_parts` loads the data and builds the machine (and the memory bank) from a config, deterministically from
its seed; the batch step around them is `trainer2.learning.step.build_step`. Nothing else constructs these parts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from trainer2.config import ConfigError, TrainConfig
from trainer2.io.data import Dataset
from trainer2.io.sizes import check_sizes
from trainer2.io.token_cache import load_text_or_features
from trainer2.learning.subnormals import flush_denormal
from trainer2.physics.machine import Machine, build_machine
from trainer2.physics.memory import MemoryBank


@dataclass(frozen=True)
class RunParts:
    """The data, the device, the machine on it, and the memory bank (None when memory_capacity is 0)."""

    data: Dataset
    device: torch.device
    machine: Machine
    memory: MemoryBank | None


def all_cpu_threads() -> int:
    """What cpu_threads 0 means: OMP_NUM_THREADS when set (torchrun sets it to 1 per process), else the cores this
    process may run on. Computed, not left to torch, so an earlier run in the same process cannot change it."""
    omp = os.environ.get("OMP_NUM_THREADS", "")
    if omp.isdigit() and int(omp) > 0:
        return int(omp)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def resolve_device(cfg: TrainConfig) -> torch.device:
    """The device a run computes on: 'auto' -> CUDA when present, else CPU; an explicit CUDA device without CUDA is
    an error. Also sets this process's CPU math threads (cfg.cpu_threads; 0 = every core, see `all_cpu_threads`)."""
    torch.set_num_threads(cfg.cpu_threads or all_cpu_threads())
    name = cfg.device
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device: {name!r} asked for, but CUDA is not available on this machine; use --device cpu")
    return torch.device(name)


def build_parts(
    cfg: TrainConfig, device: torch.device, data: Dataset | None = None, batch: int | None = None, world: int = 1
) -> RunParts:
    """Load the data (unless given), check that what the config implies fits the data and the memory of `device` (for
    `world` processes), then build a fresh machine on it and its memory bank for `batch` rows per write
    (cfg.batch_size unless given); the same config and seed always give the same parts."""
    flush_denormal()  # this thread's CPU arithmetic skips the slow subnormals (trainer2.learning.subnormals)
    if data is None:
        data = load_text_or_features(cfg.data, cfg.context_len, cfg.heldout_fraction, cfg.token_cache)
    text = data.kind == "text"
    if cfg.augment_shift and data.input_shape is None:
        raise ConfigError(
            f"augment_shift: {cfg.augment_shift} moves images, but the data ({data.source}) is {data.kind}, not "
            "images; use --augment_shift 0"
        )
    check_sizes(cfg, data, world, device)
    machine = build_machine(cfg, data.num_classes, data.input_dim, text, device, data.input_shape)
    rows = cfg.batch_size if batch is None else batch
    memory = (
        MemoryBank.allocate(cfg.memory_capacity, cfg.coord_dim_n, rows, machine.readout.protos)
        if cfg.memory_capacity
        else None
    )
    return RunParts(data, device, machine, memory)
