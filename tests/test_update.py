"""The hand-written update against torch.optim (the reference), and the whole-update drop."""

from __future__ import annotations

import math

import pytest
import torch

from tiny import tiny_config
from trainer2.update import UpdateState, foreach_update


def make_state(params, rule: str) -> UpdateState:
    return UpdateState(
        bufs=[torch.zeros_like(p) for p in params],
        sq=[torch.zeros_like(p) for p in params] if rule == "adam" else [],
        count=torch.zeros((), dtype=torch.float64), lr=torch.tensor(0.05, dtype=torch.float64),
        dropped=torch.zeros((), dtype=torch.float64), power_vecs=[],
    )


@pytest.mark.parametrize("rule", ["momentum", "adam"])
def test_update_matches_torch_optim(rule):
    cfg = tiny_config(update_rule=rule, momentum=0.8, adam_beta2=0.99, adam_eps=1e-8)
    gen = torch.Generator().manual_seed(0)
    mine = [torch.randn(3, 4, generator=gen, dtype=torch.float64), torch.randn(5, generator=gen, dtype=torch.float64)]
    ref = [p.clone().requires_grad_(True) for p in mine]
    mults, decay = [1.0, 3.0], [0.01, 0.0]
    groups = [{"params": [ref[0]], "lr": 0.05, "weight_decay": 0.01}, {"params": [ref[1]], "lr": 0.15, "weight_decay": 0.0}]
    opt = torch.optim.SGD(groups, momentum=0.8) if rule == "momentum" else torch.optim.Adam(groups, betas=(0.8, 0.99), eps=1e-8)
    st = make_state(mine, rule)
    for _ in range(5):
        grads = [torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in mine]
        for r, g in zip(ref, grads):
            r.grad = g.clone()
        opt.step()
        foreach_update(mine, grads, st, mults, decay, cfg)
    for a, b in zip(mine, ref):
        assert torch.allclose(a, b.detach(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("rule", ["momentum", "adam"])
def test_non_finite_gradient_drops_the_whole_update_and_counts_it(rule):
    cfg = tiny_config(update_rule=rule)
    params = [torch.ones(3, dtype=torch.float64), torch.ones(2, dtype=torch.float64)]
    st = make_state(params, rule)
    foreach_update(params, [torch.ones(3, dtype=torch.float64), torch.ones(2, dtype=torch.float64)], st, [1.0, 1.0], [0.0, 0.0], cfg)
    before = [p.clone() for p in params + st.bufs + st.sq]
    ok, _ = foreach_update(params, [torch.ones(3, dtype=torch.float64), torch.tensor([1.0, math.nan], dtype=torch.float64)], st, [1.0, 1.0], [0.0, 0.0], cfg)
    assert float(ok) == 0.0 and float(st.dropped) == 1.0
    for a, b in zip(params + st.bufs + st.sq, before):
        assert torch.equal(a, b)  # nothing half-applied: not even the finite tensor moved
