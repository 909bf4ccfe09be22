"""The trainer's EP update against the autograd gradient of the loss at the free equilibrium."""

from __future__ import annotations

import torch
from tiny import tiny_batch, tiny_config, tiny_machine

from benchmarks.autograd_reference import cosine, exact_grads
from trainer2.learning.gradients import embedding_grad, ep_gradients
from trainer2.learning.rules.rule import rule_scheme
from trainer2.physics.relaxation import Relaxation
from trainer2.train_config import TrainConfig


def ep_and_exact(**overrides):
    cfg = tiny_config(**overrides)
    m = tiny_machine(cfg)
    inputs, targets = tiny_batch(cfg)
    with torch.no_grad():  # the config's rule (symmetric_nudge false is ep_positive) says which phases run
        est = ep_gradients(Relaxation(m, cfg, cfg.batch_size, scheme=rule_scheme(cfg.rule, cfg)), inputs, targets)
    ref, _ = exact_grads(m, inputs, targets, cfg.free_steps, cfg.dt, cfg.gamma, cfg.mass, cfg.retrieval_beta, cfg.eps)
    assert list(est.grads) != [] and set(est.grads) == set(m.named_params())  # one gradient per named parameter
    return est.grads, ref


def test_symmetric_ep_matches_autograd_for_every_parameter_group():
    est, ref = ep_and_exact(beta_nudge=1e-2)
    for name, g in est.items():
        assert cosine(g, ref[name]) > 0.999, name


def test_symmetric_ep_matches_autograd_with_the_default_sharp_readout():
    defaults = {
        k: TrainConfig.model_fields[k].default for k in ("r_init", "proto_init_scale", "spectral_cap", "beta_nudge")
    }
    est, ref = ep_and_exact(**defaults)
    for name, g in est.items():
        assert cosine(g, ref[name]) > 0.999, name


def test_ep_matches_autograd_with_heavy_ball_integrator():
    est, ref = ep_and_exact(beta_nudge=1e-2, dt=0.5, gamma=1.2, free_steps=300, nudge_steps=300)
    for name, g in est.items():
        assert cosine(g, ref[name]) > 0.999, name


def energy_error(est, ref) -> float:
    """Relative error over the energy couplings and embedding (the readout is exact either way)."""
    keys = [k for k in est if k.startswith(("W_", "b_", "emb"))]
    a = torch.cat([est[k].flatten() for k in keys])
    b = torch.cat([ref[k].flatten() for k in keys])
    return float((a - b).norm() / b.norm())


def test_one_sided_bias_is_linear_and_symmetric_bias_quadratic_in_beta():
    betas = [0.2, 0.1]
    one = [energy_error(*ep_and_exact(beta_nudge=b, symmetric_nudge=False)) for b in betas]
    sym = [energy_error(*ep_and_exact(beta_nudge=b, symmetric_nudge=True)) for b in betas]
    # Halving beta halves the one-sided error (O(beta)) and quarters the symmetric one (O(beta^2)).
    assert 1.6 < one[0] / one[1] < 2.5, one
    assert 3.0 < sym[0] / sym[1] < 5.0, sym
    assert sym[1] < one[1] / 4


def test_symmetric_ep_matches_autograd_per_layer_at_depth():
    """Two and three hidden layers: every W_i, b_i (and the embedding, readout) agrees with autograd's gradient,
    so the reference's layer naming (W_1.., W_out) follows the machine's at any depth."""
    for hidden in ([8, 6], [8, 6, 5]):
        est, ref = ep_and_exact(beta_nudge=1e-2, hidden_sizes=hidden)
        assert {f"W_{i}" for i in range(1, len(hidden) + 1)} | {"W_out"} <= set(est)
        for name, g in est.items():
            assert ref[name].norm() > 0, name
            assert cosine(g, ref[name]) > 0.999, (hidden, name)


def test_embedding_grad_sums_rows_by_id_on_every_device():
    """Row v of the embedding gradient is the sum of gx over the positions holding v; on CUDA, repeated calls agree
    bitwise (no atomics), also above 3,072 ids, where aten's embedding-gradient kernel gave 20 different results in 20
    calls on an H100."""
    gen = torch.Generator().manual_seed(3)
    for n in (300, 5000):
        ids, gx = torch.randint(0, 7, (n,), generator=gen), torch.randn(n, 5, generator=gen, dtype=torch.float64)
        want = (ids[:, None] == torch.arange(9)).to(gx.dtype).T @ gx  # rows 7, 8: never used, zero
        torch.testing.assert_close(embedding_grad(gx, ids, 9), want, rtol=1e-12, atol=1e-12)
        if torch.cuda.is_available():
            first = embedding_grad(gx.float().cuda(), ids.cuda(), 9)
            assert all(torch.equal(embedding_grad(gx.float().cuda(), ids.cuda(), 9), first) for _ in range(10))
            torch.testing.assert_close(first.cpu().double(), want, rtol=1e-4, atol=1e-4)
