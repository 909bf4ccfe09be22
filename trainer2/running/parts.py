"""The parts a run computes with, built in one place for training, evaluation, sampling and bench.

`build_parts` loads the data and builds the machine (and the memory bank) from a config, deterministically from
its seed; the batch step around them is `trainer2.learning.step.build_step`. Nothing else constructs these parts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from trainer2.data.dataset import Dataset, InputSpec
from trainer2.data.load import DataConfig, load_data
from trainer2.learning.subnormals import flush_denormal
from trainer2.physics.machine import Machine, MachineConfig, build_machine
from trainer2.physics.memory import MemoryBank
from trainer2.running.sizes import check_sizes
from trainer2.running.threads import usable_cores
from trainer2.train_config import ConfigError, TrainConfig


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
    return usable_cores()


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


def set_library_switches(cfg: TrainConfig) -> None:
    """torch's process-wide switches a run sets: cuDNN's autotuner and determinism, TF32 matmuls."""
    torch.backends.cudnn.benchmark = cfg.cudnn_benchmark
    torch.backends.cudnn.deterministic = cfg.cudnn_deterministic
    torch.backends.cuda.matmul.allow_tf32 = cfg.allow_tf32


def build_parts(
    cfg: TrainConfig, device: torch.device, data: Dataset | None = None, batch: int | None = None, world: int = 1
) -> RunParts:
    """Load the data (unless given), check that what the config implies fits the data and the memory of `device` (for
    `world` processes), then build a fresh machine on it and its memory bank for `batch` rows per write
    (cfg.batch_size unless given); the same config and seed always give the same parts."""
    if world > 1 and cfg.memory_capacity:
        raise ConfigError(
            "memory_capacity: the memory bank is per process and would differ between ranks; "
            "multi-process runs need --memory_capacity 0"
        )
    flush_denormal()  # this thread's CPU arithmetic skips the slow subnormals (trainer2.learning.subnormals)
    data = load_data(cfg.section(DataConfig), data)
    check_image_data(cfg, data)
    examples = (data.num_examples("train"), data.num_examples("heldout"))
    machine, memory = build_machine_for(cfg, InputSpec.of(data), device, examples, batch, world)
    return RunParts(data, device, machine, memory)


IMAGE_DATA = (
    "pass --data an MNIST IDX directory, a CIFAR-10 directory, an .npz of images ([N, H, W] or [N, C, H, W]) or "
    "torchvision:NAME:ROOT"
)


def check_image_data(cfg: TrainConfig, data: Dataset) -> None:
    """Refuse conv layers or augment_shift on data that is no images, naming image data as the fix (dropping
    augment_shift alone would only lead to the conv layers' own error)."""
    convs = [str(i) for i, layer in enumerate(cfg.layers) if "conv" in layer]
    if data.input_shape is not None or not (convs or cfg.augment_shift):
        return
    if convs:
        layers = f"conv layer {convs[0]} needs" if len(convs) == 1 else f"conv layers {', '.join(convs)} need"
        also = f" (and so does augment_shift {cfg.augment_shift})" if cfg.augment_shift else ""
        what, fix = f"layers: {layers} image data{also}", IMAGE_DATA
    else:
        what, fix = f"augment_shift: {cfg.augment_shift} moves images", f"{IMAGE_DATA}, or use --augment_shift 0"
    raise ConfigError(f"{what}, but the data ({data.source}) is {data.kind}, not images; {fix}")


def build_machine_for(
    cfg: TrainConfig,
    spec: InputSpec,
    device: torch.device,
    examples: tuple[int, int],
    batch: int | None = None,
    world: int = 1,
) -> tuple[Machine, MemoryBank | None]:
    """A fresh machine for inputs like `spec` on `device`, and its memory bank for `batch` rows per write (cfg's
    batch_size unless given), after checking that they fit the data (`examples`: its train and held-out split sizes)
    and the device's memory."""
    check_sizes(cfg, spec, examples, world, device)
    machine = build_machine(
        cfg.section(MachineConfig),
        spec.num_classes,
        spec.input_dim,
        spec.tokens,
        device,
        spec.input_shape,
        seed=cfg.seed,
    )
    rows = cfg.batch_size if batch is None else batch
    memory = (
        MemoryBank.allocate(cfg.memory_capacity, cfg.coord_dim_n, rows, machine.readout.protos)
        if cfg.memory_capacity
        else None
    )
    return machine, memory
