"""Tiny float64 machines and configs for fast CPU tests."""

from __future__ import annotations

import numpy as np
import torch

from trainer2.physics.machine import Machine, build_machine
from trainer2.train_config import TrainConfig


def tiny_config(**overrides) -> TrainConfig:
    base = dict(
        dtype="float64",
        hidden_sizes=[12],
        coord_dim_n=4,
        rotor_k=5,
        context_len=3,
        embed_dim=3,
        batch_size=5,
        free_steps=200,
        nudge_steps=200,
        beta_nudge=1e-3,
        # a gentle readout (R_sc 1, spread prototypes), so the beta-scaling tests can use large beta
        r_init=1.0,
        proto_init_scale=1.0,
        spectral_cap=0.5,
    )
    if "layers" in overrides:  # layers in place of the shorthand
        del base["hidden_sizes"]
    base.update(overrides)
    return TrainConfig(**base)


def tiny_machine(cfg: TrainConfig, num_classes: int = 7) -> Machine:
    """A machine with non-trivial biases, rotor angles and metric, so every gradient is exercised."""
    m = build_machine(cfg, num_classes, cfg.context_len, True, torch.device("cpu"), seed=cfg.seed)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for b in m.energy.biases:
            b.copy_(torch.randn(b.shape, generator=gen, dtype=b.dtype) * 0.3)
        m.readout.theta.copy_(torch.randn(m.readout.theta.shape, generator=gen, dtype=torch.float64))
        m.readout.g_diag.copy_(torch.rand(m.readout.g_diag.shape, generator=gen, dtype=torch.float64) * 1.5 + 0.5)
    return m


def tiny_batch(cfg: TrainConfig, num_classes: int = 7, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    inputs = torch.randint(0, num_classes, (cfg.batch_size, cfg.context_len), generator=gen)
    return inputs, torch.randint(0, num_classes, (cfg.batch_size,), generator=gen)


def clustered(n: int, dim: int = 6, spread: float = 1.0, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Feature rows [n, dim] (float32) around 3 random centres scaled by `spread`, unit noise, and their labels [n]."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, size=n)
    x = (rng.normal(size=(3, dim))[y] * spread + rng.normal(size=(n, dim))).astype(np.float32)
    return x, y
