"""The memory bank: ring-buffer writes, empty slots that never win a retrieval, and a checkpoint round trip."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import tiny_batch, tiny_config, tiny_machine

from trainer2.learning.gradients import ep_gradients
from trainer2.learning.step import build_step
from trainer2.physics.memory import MemoryBank
from trainer2.physics.readout import ReadoutScratch, readout_frame, readout_loss_and_grads, target_mask
from trainer2.physics.relaxation import Relaxation
from trainer2.train_config import ConfigError, build_config


def bank(capacity: int, batch: int, n: int = 2) -> MemoryBank:
    return MemoryBank.allocate(capacity, n, batch, torch.zeros((), dtype=torch.float64))


def write_numbered(b: MemoryBank, first: int, batch: int) -> None:
    """Write examples first..first+batch-1, each with coordinates (k, -k) and label k."""
    k = torch.arange(first, first + batch, dtype=torch.float64)
    b.write(torch.stack([k, -k], 1), k.long())


def test_writes_fill_in_order_then_wrap_around() -> None:
    b = bank(capacity=7, batch=3)
    write_numbered(b, 0, 3)
    assert b.filled.tolist() == [True] * 3 + [False] * 4 and int(b.ptr) == 3
    write_numbered(b, 3, 3)
    write_numbered(b, 6, 3)  # slots 6, 0, 1: the oldest two entries are overwritten
    assert b.labels.tolist() == [7, 8, 2, 3, 4, 5, 6]
    assert b.coords[:, 0].tolist() == [7, 8, 2, 3, 4, 5, 6] and b.coords[:, 1].tolist() == [-7, -8, -2, -3, -4, -5, -6]
    assert b.filled.all() and int(b.ptr) == 2
    for first in (9, 12):
        write_numbered(b, first, 3)
    assert b.labels.tolist() == [14, 8, 9, 10, 11, 12, 13] and int(b.ptr) == 1


def test_non_finite_rows_leave_their_slot_empty() -> None:
    b = bank(capacity=4, batch=2)
    b.write(torch.tensor([[1.0, 2.0], [float("nan"), 0.0]], dtype=torch.float64), torch.tensor([3, 4]))
    assert b.filled.tolist() == [True, False, False, False]
    assert torch.isfinite(b.coords).all() and b.coords[0].tolist() == [1.0, 2.0]


def test_memory_capacity_must_hold_a_batch() -> None:
    with pytest.raises(ConfigError, match=r"memory_capacity \(10\) must be 0 \(off\) or at least batch_size \(64\)"):
        build_config([("command line", {"memory_capacity": 10, "batch_size": 64})])
    assert build_config([("t", {"memory_capacity": 0, "batch_size": 64})]).memory_capacity == 0
    assert build_config([("t", {"memory_capacity": 64, "batch_size": 64})]).memory_capacity == 64


def test_empty_slot_at_the_query_never_wins() -> None:
    cfg = tiny_config()
    m = tiny_machine(cfg)
    _, targets = tiny_batch(cfg)
    q = torch.randn(cfg.batch_size, cfg.coord_dim_n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    protos = m.prototype_candidates()

    def retrieve(cand):
        frame = readout_frame(m.readout, cand, m.layout, cfg.retrieval_beta, cfg.eps)
        sc = ReadoutScratch.allocate(q.shape[0], q.shape[1], cand.coords.shape[0], q)
        return readout_loss_and_grads(
            q, frame, cand, target_mask(cand.labels, targets, q.dtype), m.num_classes, m.layout, sc
        )

    b = bank(capacity=cfg.batch_size, batch=cfg.batch_size, n=cfg.coord_dim_n)
    wrong = (targets + 1) % m.num_classes
    b.coords.copy_(q)  # every slot sits exactly on its query (cost ~ 0) with a wrong label, but none is filled
    b.labels.copy_(wrong)
    ref, got = retrieve(protos), retrieve(b.candidates(protos))
    assert torch.allclose(got.probs, ref.probs) and torch.allclose(got.loss, ref.loss)
    for f in dataclasses.fields(ref.grads):
        assert torch.allclose(getattr(got.grads, f.name), getattr(ref.grads, f.name)), f.name
    # The same slots, once filled, dominate the retrieval: the check above is not vacuous.
    b.filled.fill_(True)
    won = retrieve(b.candidates(protos)).probs.gather(1, wrong[:, None])
    assert (won > ref.probs.gather(1, wrong[:, None]) + 0.1).all()


def test_empty_bank_trains_exactly_like_no_bank() -> None:
    cfg = tiny_config(free_steps=40, nudge_steps=40, beta_nudge=1e-2)
    inputs, targets = tiny_batch(cfg)
    with torch.no_grad():
        plain = ep_gradients(Relaxation(tiny_machine(cfg), cfg, cfg.batch_size), inputs, targets)
        b = bank(capacity=2 * cfg.batch_size, batch=cfg.batch_size, n=cfg.coord_dim_n)
        with_bank = ep_gradients(Relaxation(tiny_machine(cfg), cfg, cfg.batch_size, b), inputs, targets)
    assert plain.grads.keys() == with_bank.grads.keys()
    for name, g in plain.grads.items():
        assert torch.allclose(g, with_bank.grads[name]), name
    assert torch.allclose(plain.probs, with_bank.probs)


def test_step_writes_the_free_equilibrium_after_the_update() -> None:
    cfg = tiny_config(free_steps=20, nudge_steps=10, memory_capacity=12)
    m = tiny_machine(cfg)
    b = bank(capacity=12, batch=cfg.batch_size, n=cfg.coord_dim_n)
    step = build_step(m, cfg, cfg, cfg.batch_size, b)
    inputs, targets = tiny_batch(cfg)
    with torch.no_grad():
        step.step(inputs, targets)
    assert torch.equal(b.coords[: cfg.batch_size], step.relax.s0.s[-1]) and torch.equal(
        b.labels[: cfg.batch_size], targets
    )
    assert int(b.ptr) == cfg.batch_size and int(b.filled.sum()) == cfg.batch_size


def test_bank_round_trips_through_safetensors(tmp_path) -> None:
    # The checkpoint module (another branch) saves MemoryBank.tensors() with safetensors and copies them back in place.
    cfg = tiny_config(free_steps=20, nudge_steps=10, memory_capacity=13)
    b = bank(capacity=13, batch=cfg.batch_size, n=cfg.coord_dim_n)
    step = build_step(tiny_machine(cfg), cfg, cfg, cfg.batch_size, b)
    with torch.no_grad():
        for seed in range(3):
            step.step(*tiny_batch(cfg, seed=seed))  # 15 writes into 13 slots: wrapped, ptr = 2
    assert int(b.ptr) == 2
    save_file(b.tensors(), str(tmp_path / "memory.safetensors"))
    loaded = load_file(str(tmp_path / "memory.safetensors"))
    fresh = bank(capacity=13, batch=cfg.batch_size, n=cfg.coord_dim_n)
    assert loaded.keys() == fresh.tensors().keys()
    for key, t in fresh.tensors().items():
        assert loaded[key].dtype == t.dtype and loaded[key].shape == t.shape, key
        t.copy_(loaded[key])
    for key, t in b.tensors().items():
        assert torch.equal(fresh.tensors()[key], t), key
    # Both continue identically: the next write lands in the same slots.
    q = torch.ones(cfg.batch_size, cfg.coord_dim_n, dtype=torch.float64)
    for x in (b, fresh):
        x.write(q, torch.arange(cfg.batch_size))
    for key, t in b.tensors().items():
        assert torch.equal(fresh.tensors()[key], t), key
