"""Sizes before allocation: what a config will allocate, estimated from its fields and the data, checked against
the data and the memory free on the device, so a config that cannot fit is refused in a second, naming the field,
instead of after minutes of swapping or with an allocator's traceback."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from trainer2.components import resolve
from trainer2.io.memory import available_bytes
from trainer2.train_config import ConfigError, TrainConfig

GIB = 2**30
EVAL_ROWS = 512  # rows of a held-out batch (trainer2.running.evaluation)
PY_OBJECT = 100  # bytes a small Python tuple of ints costs (the rotor schedule is built as lists of them)


@dataclass(frozen=True)
class Need:
    """Bytes one part of a run allocates, and the field that sizes it most."""

    what: str
    field: str
    bytes: float


def needs(cfg: TrainConfig, num_classes: int, input_dim: int, text: bool) -> list[Need]:
    """Estimated bytes of the large allocations of a run (parameters and update state, relaxation workspaces, memory
    bank, rotor schedule): a lower bound to within a small factor, not an exact count."""
    s = torch.finfo(getattr(torch, cfg.dtype)).bits // 8
    n, k, v, b = cfg.coord_dim_n, cfg.rotor_k, num_classes, cfg.batch_size
    x_dim = input_dim * cfg.embed_dim if text else input_dim
    hidden = [
        math.prod(resolve("coupling", kind).spec_size(spec)) for ((kind, spec),) in (e.items() for e in cfg.layers)
    ]
    dims = [x_dim, *hidden, n]
    params = (v * cfg.embed_dim if text else 0) + sum(a * c + c for a, c in zip(dims, dims[1:])) + n + k + v * n + 1
    widest = max(range(len(dims) - 1), key=lambda i: dims[i] * dims[i + 1])
    cand = v + cfg.memory_capacity
    layers = math.ceil(k / max(n // 2, 1))

    # The relaxation workspaces (trainer2.physics.dynamics.Workspace): b free rows, b or 2b nudged rows, EVAL_ROWS
    # scored rows.
    nudged = 2 if cfg.symmetric_nudge else 1
    all_rows = (1 + nudged) * b + EVAL_ROWS
    width_field = "embed_dim" if text and widest == 0 and cfg.embed_dim * input_dim > max(hidden) else "layers"

    def by_rows(field: str) -> str:  # a per-row cost is the batch's to lower once the batch outweighs the fixed rows
        return "batch_size" if (1 + nudged) * b > EVAL_ROWS else field

    step = s * (3 * n + 3)  # (q, velocity, z) history per row and step
    return [
        Need("parameters and update state", width_field, 8 * params * s),
        Need(
            "the relaxation state (rows x layer widths)",
            by_rows(width_field),
            all_rows * s * (4 * sum(dims[1:]) + x_dim + 8 * n),
        ),
        Need(
            "the free phase's step history (rows x steps)",
            by_rows("free_steps"),
            (b + EVAL_ROWS) * cfg.free_steps * step,
        ),
        Need("the nudged phases' step history (rows x steps)", "nudge_steps", nudged * b * cfg.nudge_steps * step),
        Need("the memory bank", "memory_capacity", cfg.memory_capacity * n * s * 5),
        Need(
            "the retrieval scores (rows x candidates)",
            "memory_capacity" if cfg.memory_capacity > v else "batch_size",
            all_rows * cand * s * 22,
        ),  # about 22 (rows, candidates) buffers, measured with memory_capacity 1e5
        Need("the rotor frame", "rotor_k", 4 * layers * n * n * s + k * 3 * PY_OBJECT),
        Need("the rotor schedule", "coord_dim_n", n * n / 2 * PY_OBJECT),
    ]


def check_sizes(
    cfg: TrainConfig,
    num_classes: int,
    input_dim: int,
    text: bool,
    train_examples: int,
    world: int,
    device: torch.device,
) -> None:
    """Refuse a config that does not fit the data (a global batch larger than the training split) or the memory
    free on `device`, naming the field that needs the most and how much."""
    if cfg.batch_size * world > train_examples:
        raise ConfigError(
            f"batch_size: {cfg.batch_size} x {world} process(es) is more than the {train_examples} training "
            "examples of the data; lower batch_size"
        )
    parts = needs(cfg, num_classes, input_dim, text)
    total, free = sum(p.bytes for p in parts), available_bytes(device)
    if free is None or total <= free:
        return
    big = max(parts, key=lambda p: p.bytes)
    raise ConfigError(
        f"{big.field}: the run would need about {total / GIB:.1f} GiB ({big.what}: {big.bytes / GIB:.1f} GiB, "
        f"sized by {big.field} = {getattr(cfg, big.field)}), but {free / GIB:.1f} GiB is free on {device}; "
        f"lower {big.field}"
    )
