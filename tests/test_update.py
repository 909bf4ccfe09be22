"""The hand-written update against torch.optim (the reference), and the whole-update drop."""

from __future__ import annotations

import math

import pytest
import torch
from tiny import tiny_config

from trainer2.learning.update import UpdateState, flat_update


def make_state(flat, rule: str) -> UpdateState:
    return UpdateState(
        bufs=torch.zeros_like(flat),
        sq=torch.zeros_like(flat) if rule == "adam" else flat.new_zeros(0),
        count=torch.zeros((), dtype=torch.float64),
        lr=torch.tensor(0.05, dtype=torch.float64),
        dropped=torch.zeros((), dtype=torch.float64),
        power_vecs=[],
    )


@pytest.mark.parametrize("rule", ["momentum", "nesterov", "adam"])
def test_update_matches_torch_optim(rule):
    cfg = tiny_config(update_rule=rule, momentum=0.8, adam_beta2=0.99, adam_eps=1e-8)
    gen = torch.Generator().manual_seed(0)
    flat = torch.randn(17, generator=gen, dtype=torch.float64)
    mine = [flat[:12].view(3, 4), flat[12:]]  # two parameters, views of one flat buffer as in the trainer
    ref = [p.clone().requires_grad_(True) for p in mine]
    mult = torch.tensor([1.0] * 12 + [3.0] * 5, dtype=torch.float64)
    decay = torch.tensor([0.01] * 12 + [0.0] * 5, dtype=torch.float64)
    groups = [
        {"params": [ref[0]], "lr": 0.05, "weight_decay": 0.01},
        {"params": [ref[1]], "lr": 0.15, "weight_decay": 0.0},
    ]
    opt = (
        torch.optim.SGD(groups, momentum=0.8, nesterov=rule == "nesterov")
        if rule != "adam"
        else torch.optim.Adam(groups, betas=(0.8, 0.99), eps=1e-8)
    )
    st = make_state(flat, rule)
    for _ in range(5):
        grads = [torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in mine]
        for r, g in zip(ref, grads):
            r.grad = g.clone()
        opt.step()
        flat_update(flat, torch.cat([g.reshape(-1) for g in grads]), st, mult, decay, cfg, torch.empty_like(flat))
    for a, b in zip(mine, ref):
        assert torch.allclose(a, b.detach(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("rule", ["momentum", "nesterov", "adam"])
def test_non_finite_gradient_drops_the_whole_update_and_counts_it(rule):
    cfg = tiny_config(update_rule=rule)
    flat = torch.ones(5, dtype=torch.float64)
    st = make_state(flat, rule)
    ones, step = torch.ones(5, dtype=torch.float64), torch.empty(5, dtype=torch.float64)
    flat_update(flat, ones.clone(), st, ones, None, cfg, step)
    before = [t.clone() for t in (flat, st.bufs, st.sq, st.count)]
    ok = flat_update(flat, torch.tensor([1.0, 1.0, 1.0, 1.0, math.nan], dtype=torch.float64), st, ones, None, cfg, step)
    assert float(ok) == 0.0 and float(st.dropped) == 1.0
    for a, b in zip((flat, st.bufs, st.sq, st.count), before):
        assert torch.equal(a, b)  # nothing half-applied: not even the finite elements moved
    assert not step.any()  # the reported step is zero


def test_adams_moments_are_two_buffers_not_views_of_one():
    """Adam's moments written in place through two rows of one buffer, then flushed through the base, compiled by
    Inductor on CUDA into a wrong step (seen on an H200, 8df7a94); the CPU compiles it right, so this guards it."""
    cfg = tiny_config(update_rule="adam")
    st = UpdateState.allocate(torch.zeros(37, dtype=torch.float64), [], cfg)
    assert st.bufs.shape == st.sq.shape == (37,)
    assert st.bufs.untyped_storage().data_ptr() != st.sq.untyped_storage().data_ptr()
    assert st.bufs._base is None and st.sq._base is None
