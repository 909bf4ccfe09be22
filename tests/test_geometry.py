"""The readout's analytic gradients against autograd, and the rotor frame's structure."""

from __future__ import annotations

import math

import pytest
import torch

from trainer2.physics.readout import (
    Candidates,
    ReadoutParams,
    ReadoutScratch,
    readout_force,
    readout_frame,
    readout_loss_and_grads,
    rotor_layers,
    rotor_layout,
    rotor_matrix,
    target_mask,
)


@pytest.fixture(autouse=True)
def float64():
    """These comparisons are at 1e-8, so the module runs in float64 and restores the default after."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def givens_product(theta, layout, n):
    """R as the product of one full n x n Givens matrix per plane, applied in order (independent of the trainer's code)."""
    planes = [(int(a), int(b)) for la, lb in zip(layout.a, layout.b) for a, b in zip(la, lb)]
    assert len(planes) == theta.shape[0]
    rot = torch.eye(n)
    for j, (a, b) in enumerate(planes):
        c, s = torch.cos(theta[j]), torch.sin(theta[j])
        giv = torch.eye(n).index_put(
            (torch.tensor([a, a, b, b]), torch.tensor([a, b, a, b])), torch.stack([c, -s, s, c])
        )
        rot = giv @ rot
    return rot


def reference_loss(q, targets, g, theta, protos, r_sc, bank, bank_labels, bank_bias, layout, beta_r, eps):
    """-log p_y with explicit differences: p_v sums the softmax weights of every candidate labelled v."""
    rot = givens_product(theta, layout, q.shape[1])
    coords = torch.cat([protos, bank])
    labels = torch.cat([torch.arange(protos.shape[0]), bank_labels])
    bias = torch.cat([torch.zeros(protos.shape[0]), bank_bias])
    z = (q[:, None, :] - coords[None]) @ rot.T
    logits = -beta_r * r_sc * torch.sqrt((g * z * z).sum(-1) + eps) + bias
    logp = torch.log_softmax(logits, 1)
    mine = labels[None, :] == targets[:, None]
    return -torch.logsumexp(logp.masked_fill(~mine, -math.inf), 1)


@pytest.mark.parametrize("with_bank", [False, True])
@pytest.mark.parametrize("k", [11, 3, 0])  # four rotor layers (the last one partial), one, none
def test_readout_gradients_match_autograd(with_bank, k):
    gen = torch.Generator().manual_seed(0)
    n, V, B = 6, 5, 7
    layout = rotor_layout(n, k)
    theta, g = torch.randn(k, generator=gen), torch.rand(n, generator=gen) + 0.5
    protos, r_sc = torch.randn(V, n, generator=gen), torch.tensor(1.3)
    q, y = torch.randn(B, n, generator=gen), torch.randint(0, V, (B,), generator=gen)
    nb = 4 if with_bank else 0
    bank, bank_labels = torch.randn(nb, n, generator=gen), torch.randint(0, V, (nb,), generator=gen)
    bank_bias = torch.tensor([0.0, 0.0, 0.0, -math.inf][:nb])
    cand = Candidates(
        torch.cat([protos, bank]), torch.cat([torch.arange(V), bank_labels]), torch.cat([torch.zeros(V), bank_bias])
    )
    frame = readout_frame(ReadoutParams(g, theta, protos, r_sc), cand, layout, 2.0, 1e-6)
    mask = target_mask(cand.labels, y, q.dtype)
    sc = ReadoutScratch.allocate(B, n, V + nb, q)
    grad_q = readout_force(q, frame, mask, sc, torch.empty_like(q))
    res = readout_loss_and_grads(q, frame, cand, mask, V, layout, sc)
    if not with_bank:  # prototypes only, in label order: the one-hot shortcut gives the same probabilities
        assert torch.equal(readout_loss_and_grads(q, frame, cand, mask, V, layout, sc, one_hot=True).probs, res.probs)

    leaves = [t.clone().requires_grad_(True) for t in (q, g, theta, protos, r_sc)]
    loss = reference_loss(*leaves[:1], y, *leaves[1:], bank, bank_labels, bank_bias, layout, 2.0, 1e-6)
    assert torch.allclose(res.loss, loss.detach(), rtol=1e-10)
    grads = torch.autograd.grad(loss.mean(), leaves, allow_unused=True, materialize_grads=True)  # k = 0: no angles
    mine = [grad_q / B, res.grads.g_diag, res.grads.theta, res.grads.protos, res.grads.r_sc]
    for name, a, b in zip(["q", "g_diag", "theta", "protos", "r_sc"], mine, grads):
        assert (a - b).norm() <= 1e-8 * b.norm(), name


def test_rotor_is_orthogonal_and_the_product_of_its_givens_rotations():
    n, k = 7, 17
    layout = rotor_layout(n, k)
    theta = torch.randn(k, generator=torch.Generator().manual_seed(1))
    rot = rotor_matrix(rotor_layers(theta, layout))
    assert torch.allclose(rot @ rot.T, torch.eye(n), atol=1e-12)
    assert torch.allclose(rot, givens_product(theta, layout, n), atol=1e-12)


def test_rotor_layers_hold_disjoint_pairs():
    layout = rotor_layout(8, 40)
    for a, b in zip(layout.a, layout.b):
        coords = torch.cat([a, b]).tolist()
        assert len(coords) == len(set(coords))
        assert (a < b).all()
