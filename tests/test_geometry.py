"""The readout's analytic gradients against autograd, and the rotor frame's structure."""

from __future__ import annotations

import math

import pytest
import torch

from trainer2.geometry import Candidates, ReadoutParams, readout_frame, readout_loss_and_grads, rotor_layout, rotor_matrix



@pytest.fixture(autouse=True)
def float64():
    """These comparisons are at 1e-8, so the module runs in float64 and restores the default after."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def reference_loss(q, targets, g, theta, protos, r_sc, bank, bank_labels, bank_bias, layout, beta_r, eps):
    """-log p_y with explicit differences: p_v sums the softmax weights of every candidate labelled v."""
    rot = rotor_matrix(theta, layout, q.shape[1])
    coords = torch.cat([protos, bank])
    labels = torch.cat([torch.arange(protos.shape[0]), bank_labels])
    bias = torch.cat([torch.zeros(protos.shape[0]), bank_bias])
    z = (q[:, None, :] - coords[None]) @ rot.T
    logits = -beta_r * r_sc * torch.sqrt((g * z * z).sum(-1) + eps) + bias
    logp = torch.log_softmax(logits, 1)
    mine = labels[None, :] == targets[:, None]
    return -torch.logsumexp(logp.masked_fill(~mine, -math.inf), 1)


@pytest.mark.parametrize("with_bank", [False, True])
def test_readout_gradients_match_autograd(with_bank):
    gen = torch.Generator().manual_seed(0)
    n, k, V, B = 6, 11, 5, 7
    layout = rotor_layout(n, k)
    theta, g = torch.randn(k, generator=gen), torch.rand(n, generator=gen) + 0.5
    protos, r_sc = torch.randn(V, n, generator=gen), torch.tensor(1.3)
    q, y = torch.randn(B, n, generator=gen), torch.randint(0, V, (B,), generator=gen)
    nb = 4 if with_bank else 0
    bank, bank_labels = torch.randn(nb, n, generator=gen), torch.randint(0, V, (nb,), generator=gen)
    bank_bias = torch.tensor([0.0, 0.0, 0.0, -math.inf][:nb])
    cand = Candidates(torch.cat([protos, bank]), torch.cat([torch.arange(V), bank_labels]), torch.cat([torch.zeros(V), bank_bias]))
    frame = readout_frame(ReadoutParams(g, theta, protos, r_sc), cand, layout, 2.0, 1e-6)
    res = readout_loss_and_grads(q, frame, cand, y, V, layout, theta)

    leaves = [t.clone().requires_grad_(True) for t in (q, g, theta, protos, r_sc)]
    loss = reference_loss(*leaves[:1], y, *leaves[1:], bank, bank_labels, bank_bias, layout, 2.0, 1e-6)
    assert torch.allclose(res.loss, loss.detach(), rtol=1e-10)
    grads = torch.autograd.grad(loss.mean(), leaves)
    mine = [res.grad_q / B, res.grads.g_diag, res.grads.theta, res.grads.protos, res.grads.r_sc]
    for name, a, b in zip(["q", "g_diag", "theta", "protos", "r_sc"], mine, grads):
        assert (a - b).norm() <= 1e-8 * b.norm(), name


def test_rotor_is_orthogonal_and_the_product_of_its_givens_rotations():
    n, k = 7, 17
    layout = rotor_layout(n, k)
    theta = torch.randn(k, generator=torch.Generator().manual_seed(1))
    rot = rotor_matrix(theta, layout, n)
    assert torch.allclose(rot @ rot.T, torch.eye(n), atol=1e-12)
    # Sequential reference: one full n x n Givens matrix per plane, applied in order.
    expected = torch.eye(n)
    planes = [(int(a), int(b)) for la, lb in zip(layout.a, layout.b) for a, b in zip(la, lb)]
    assert len(planes) == k
    for j, (a, b) in enumerate(planes):
        giv = torch.eye(n)
        c, s = math.cos(theta[j]), math.sin(theta[j])
        giv[a, a], giv[a, b], giv[b, a], giv[b, b] = c, -s, s, c
        expected = giv @ expected
    assert torch.allclose(rot, expected, atol=1e-12)


def test_rotor_layers_hold_disjoint_pairs():
    layout = rotor_layout(8, 40)
    for a, b in zip(layout.a, layout.b):
        coords = torch.cat([a, b]).tolist()
        assert len(coords) == len(set(coords))
        assert (a < b).all()
