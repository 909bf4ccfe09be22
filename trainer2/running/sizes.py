"""Sizes before allocation: what a config will allocate, estimated from its fields and the data, checked against
the data and the memory free on the device, so a config that cannot fit is refused in a second, naming the field,
instead of after minutes of swapping or with an allocator's traceback."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from trainer2.components import resolve
from trainer2.data.dataset import InputSpec
from trainer2.io.memory import available_bytes
from trainer2.learning.rules.rule import rule_scheme
from trainer2.physics.energy import coupling_shapes
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


def chain(cfg: TrainConfig, input_shape: tuple[int, ...]) -> list[tuple[type, object, tuple[int, ...]]]:
    """(coupling kind, spec, shape of the layer below) of every coupling of the energy's graph (a chain's in order),
    the dense one into q last; a coupling that cannot sit on its layer below, or couplings whose shapes do not meet,
    are a ConfigError naming them."""
    p = cfg.plan()
    try:
        belows = coupling_shapes(input_shape, p)
    except ValueError as e:
        raise ConfigError(f"{'couplings' if cfg.couplings else 'layers'}: {e}") from None
    return [(resolve("coupling", e.kind), e.spec, below) for e, below in zip(p.entries, belows)]


def needs(cfg: TrainConfig, spec: InputSpec, heldout: int) -> list[Need]:
    """Estimated bytes of the large allocations of a run on inputs like `spec` with `heldout` held-out examples
    (parameters and update state, the relaxation
    workspaces of training and scoring, the couplings' own buffers, memory bank, rotor frame and schedule): within a
    small factor of the peak, not an exact count. Each coupling kind estimates its own part (param_count,
    workspace_bytes), so this stays generic over the kinds."""
    s = torch.finfo(getattr(torch, cfg.dtype)).bits // 8
    n, k, v, b = cfg.coord_dim_n, cfg.rotor_k, spec.num_classes, cfg.batch_size
    text = spec.tokens
    x_shape = spec.input_shape or ((spec.input_dim, cfg.embed_dim) if text else (spec.input_dim,))
    couplings = chain(cfg, x_shape)
    sizes = [math.prod(kind.spec_size(spec, below)) for kind, spec, below in couplings]
    params = (v * cfg.embed_dim if text else 0) + sum(kind.param_count(below, spec) for kind, spec, below in couplings)
    params += n + k + v * n + 1  # the readout
    cand = v + cfg.memory_capacity
    layers = math.ceil(k / max(n // 2, 1))

    # A Relaxation of R rows (trainer2.physics.relaxation) holds a free workspace of R rows, a nudged one of `phases` R
    # rows and the free equilibrium s0 (R rows); training has one of batch_size rows, scoring one per held-out batch
    # size (EVAL_ROWS, and the last, smaller batch when every batch is scored).
    # the rule's nudged phases (recurrent backprop's adjoint workspace is about one phase's rows)
    phases = max(1, rule_scheme(cfg.rule, cfg).phases)
    every = cfg.eval_batches is None or cfg.eval_batches * EVAL_ROWS >= heldout
    scored = min(EVAL_ROWS, heldout) + (heldout % EVAL_ROWS if every and heldout > EVAL_ROWS else 0)
    rows = b + scored
    fixed = cfg.dt == cfg.gamma == cfg.mass == 1.0
    extra = sum(sizes[:-2]) if fixed else 2 * sum(sizes)  # the fixed point's new lower layers, or momenta and forces
    workspace_row = sum(sizes) + extra + sizes[0] + 8 * n  # state, drive, the readout's (R, n) buffers
    per_row = s * ((1 + phases) * workspace_row + (1 if fixed else 2) * sum(sizes))
    width_field = "embed_dim" if text and math.prod(x_shape) > max(sizes[:-1]) else "layers"

    def by_rows(field: str) -> str:  # a per-row cost is the batch's to lower once the batch outweighs a scored batch
        return "batch_size" if b > EVAL_ROWS else field

    op_rows = max(phases * b, scored)
    ops = max(kind.workspace_bytes(below, spec, op_rows, s) for kind, spec, below in couplings)
    step = s * (3 * n + 3)  # (q, velocity, z) history per row and step
    return [
        Need("parameters and update state", width_field, (9 if cfg.ema_decay else 8) * params * s),  # + the average
        Need("the relaxation state (rows x layer widths)", by_rows(width_field), rows * per_row),
        Need("the couplings' own buffers (rows x their outputs)", by_rows("layers"), ops),
        Need("the free phase's step history (rows x steps)", by_rows("free_steps"), rows * cfg.free_steps * step),
        Need("the nudged phases' step history (rows x steps)", "nudge_steps", phases * rows * cfg.nudge_steps * step),
        Need("the memory bank", "memory_capacity", cfg.memory_capacity * n * s * 5),
        Need(
            "the retrieval scores (rows x candidates)",
            "memory_capacity" if cfg.memory_capacity > v else "batch_size",
            (1 + phases) * rows * cand * s * 10,  # ten (rows, candidates) buffers per workspace row
        ),
        Need("the rotor frame", "rotor_k", 4 * layers * n * n * s + k * 3 * PY_OBJECT),
        Need("the rotor schedule", "coord_dim_n", n * n / 2 * PY_OBJECT),
    ]


def check_sizes(cfg: TrainConfig, spec: InputSpec, examples: tuple[int, int], world: int, device: torch.device) -> None:
    """Refuse a config that does not fit the data (`examples`: its train and held-out split sizes; a global batch
    larger than the training split) or the memory free on `device`, naming the field that needs the most and how
    much."""
    train_examples, heldout = examples
    if cfg.batch_size * world > train_examples:
        raise ConfigError(
            f"batch_size: {cfg.batch_size} x {world} process(es) is more than the {train_examples} training "
            "examples of the data; lower batch_size"
        )
    parts = needs(cfg, spec, heldout)
    total, free = sum(p.bytes for p in parts), available_bytes(device)
    if free is None or total <= free:
        return
    big = max(parts, key=lambda p: p.bytes)
    raise ConfigError(
        f"{big.field}: the run would need about {total / GIB:.1f} GiB ({big.what}: {big.bytes / GIB:.1f} GiB, "
        f"sized by {big.field} = {getattr(cfg, big.field)}), but {free / GIB:.1f} GiB is free on {device}; "
        f"lower {big.field}"
    )
