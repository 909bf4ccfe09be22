"""The geometric readout: retrieval over candidates in a learned metric, with analytic gradients.

Coordinates q (B, n) are scored against K candidates c_k (K, n) with labels in [0, V):

    g = R^T diag(g_diag) R,  spd(u) = sqrt(g(u, u) + eps),  cost_k = R_sc * spd(q - c_k)
    pi = softmax(-retrieval_beta * cost + bias),  p_v = sum of pi_k over candidates labelled v,
    loss = -log p_y.

Everything is computed in the rotated frame z = R u, where g(u, u) = sum_i g_diag_i z_i^2, and
squared distances are expanded into matrix products so no (B, K, n) tensor is ever formed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class RotorLayout:
    """Givens planes (a_j, b_j) grouped into layers of disjoint pairs; computed once per shape."""

    a: list[Tensor]  # per layer, LongTensor (P,) of first coordinates
    b: list[Tensor]  # per layer, LongTensor (P,) of second coordinates
    slices: list[slice]  # per layer, which angles of theta (k,) it uses


def rotor_layout(n: int, k: int, device: torch.device | str = "cpu") -> RotorLayout:
    """Round-robin (circle method) schedule: n-1 rounds of n//2 disjoint pairs, cycled until k planes."""
    players = list(range(n if n % 2 == 0 else n + 1))  # odd n: a dummy player sits out each round
    m = len(players)
    rounds: list[list[tuple[int, int]]] = []
    for _ in range(m - 1):
        pairs = [(players[i], players[m - 1 - i]) for i in range(m // 2)]
        rounds.append([(min(p), max(p)) for p in pairs if max(p) < n])
        players = [players[0], players[-1], *players[1:-1]]
    a, b, slices, used, r = [], [], [], 0, 0
    while used < k:
        pairs = rounds[r % len(rounds)][: k - used]
        a.append(torch.tensor([p[0] for p in pairs], dtype=torch.long, device=device))
        b.append(torch.tensor([p[1] for p in pairs], dtype=torch.long, device=device))
        slices.append(slice(used, used + len(pairs)))
        used += len(pairs)
        r += 1
    return RotorLayout(a, b, slices)


def givens_layer(z: Tensor, a: Tensor, b: Tensor, theta: Tensor) -> Tensor:
    """Rotate the last dim of z (..., n) by one layer of disjoint Givens rotations; out of place."""
    za, zb = z[..., a], z[..., b]
    c, s = torch.cos(theta), torch.sin(theta)
    out = z.clone()
    out[..., a] = c * za - s * zb
    out[..., b] = s * za + c * zb
    return out


def rotor_matrix(theta: Tensor, layout: RotorLayout, n: int) -> Tensor:
    """R(theta) (n, n) = G_L ... G_1, so that z = R u rotates a column vector u."""
    rows = torch.eye(n, dtype=theta.dtype, device=theta.device)
    for a, b, sl in zip(layout.a, layout.b, layout.slices):
        rows = givens_layer(rows, a, b, theta[sl])  # rows of I rotated = I R^T
    return rows.T.contiguous()


def rotor_angle_grad(s_final: Tensor, theta: Tensor, layout: RotorLayout) -> Tensor:
    """d loss / d theta (k,) from S = sum delta z^T (n, n) taken at the output of the last layer.

    For z' = G z in plane (a, b): dz'_a/dtheta = -z'_b, dz'_b/dtheta = z'_a, so the angle's
    gradient is S'[b, a] - S'[a, b]; S moves to the previous layer as G^T S' G.
    """
    grad = torch.zeros_like(theta)
    s = s_final
    for a, b, sl in reversed(list(zip(layout.a, layout.b, layout.slices))):
        grad[sl] = s[b, a] - s[a, b]
        neg = -theta[sl]
        s = givens_layer(givens_layer(s, a, b, neg).T, a, b, neg).T  # G^T S G
    return grad


@dataclass
class ReadoutParams:
    """Learned readout: metric diagonal (n,), rotor angles (k,), prototypes (V, n), resistance (0-dim)."""

    g_diag: Tensor
    theta: Tensor
    protos: Tensor
    r_sc: Tensor


@dataclass
class Candidates:
    """Retrieval candidates: coordinates (K, n), labels (K,) and additive logit bias (K,), -inf = empty."""

    coords: Tensor
    labels: Tensor
    bias: Tensor


@dataclass
class ReadoutFrame:
    """Everything the readout needs that is fixed while the coordinates relax (derived once per batch)."""

    rot: Tensor  # (n, n) R
    g: Tensor  # (n,) g_diag
    zc: Tensor  # (K, n) rotated candidates R c_k
    gzc_t: Tensor  # (n, K) (g * zc)^T, for the cross term
    cc: Tensor  # (K,) g(c_k, c_k) + eps
    bias: Tensor  # (K,) logit bias (0 or -inf)
    neg_scale: Tensor  # 0-dim -retrieval_beta * R_sc, the logit per unit of spd
    r_sc: Tensor  # 0-dim
    beta_r: float


def readout_frame(p: ReadoutParams, cand: Candidates, layout: RotorLayout, beta_r: float, eps: float) -> ReadoutFrame:
    """Rotate the candidates into the metric's frame once, for all steps of a window."""
    rot = rotor_matrix(p.theta, layout, p.g_diag.shape[0])
    zc = cand.coords @ rot.T
    gzc = zc * p.g_diag
    cc = (gzc * zc).sum(-1) + eps
    return ReadoutFrame(rot, p.g_diag, zc, gzc.T.contiguous(), cc, cand.bias, -beta_r * p.r_sc, p.r_sc, beta_r)


@dataclass
class ReadoutScratch:
    """Preallocated buffers for the readout in the hot loop, so a nudged step allocates nothing."""

    zq: Tensor  # (B, n) R q
    tmp: Tensor  # (B, n)
    spd: Tensor  # (B, K) spd(q - c_k)
    pi: Tensor  # (B, K) softmax weights
    w: Tensor  # (B, K) dloss/dcost_k / spd_k
    col: Tensor  # (B, 1)
    py: Tensor  # (B, 1) p_y

    @staticmethod
    def allocate(batch: int, n: int, k: int, like: Tensor) -> "ReadoutScratch":
        def new(*shape: int) -> Tensor:
            return torch.zeros(shape, dtype=like.dtype, device=like.device)

        return ReadoutScratch(new(batch, n), new(batch, n), new(batch, k), new(batch, k), new(batch, k), new(batch, 1), new(batch, 1))


def readout_weights(q: Tensor, f: ReadoutFrame, target_mask: Tensor, sc: ReadoutScratch) -> None:
    """Fill sc.zq, sc.spd, sc.pi, sc.py and sc.w = (dloss/dcost) / spd for q (B, n), in place.

    dloss/dcost_k = beta_r * pi_k * (mask_k / p_y - 1): the target term minus the model's
    expectation (for prototypes only, beta_r * (1[k = y] - p_k)). target_mask (B, K) is 1 where
    candidate k carries the example's label.
    """
    torch.mm(q, f.rot.T, out=sc.zq)
    torch.mm(sc.zq, f.gzc_t, out=sc.spd).mul_(-2.0)  # -2 g(zq, zc)
    torch.mul(sc.zq, f.g, out=sc.tmp).mul_(sc.zq)
    torch.sum(sc.tmp, dim=1, keepdim=True, out=sc.col)
    sc.spd.add_(sc.col).add_(f.cc).clamp_(min=0.0).sqrt_()  # cc carries +eps, so spd >= sqrt(eps)
    # pi = softmax(-scale * spd + bias), stabilised by the row max; empty slots (bias -inf) get 0.
    torch.mul(sc.spd, f.neg_scale, out=sc.pi).add_(f.bias)
    torch.amax(sc.pi, dim=1, keepdim=True, out=sc.col)
    sc.pi.sub_(sc.col).exp_()
    torch.sum(sc.pi, dim=1, keepdim=True, out=sc.col)
    sc.pi.div_(sc.col)
    torch.mul(sc.pi, target_mask, out=sc.w)
    torch.sum(sc.w, dim=1, keepdim=True, out=sc.py)
    sc.w.div_(sc.py).sub_(sc.pi).mul_(f.beta_r).div_(sc.spd)


def readout_force(q: Tensor, f: ReadoutFrame, target_mask: Tensor, sc: ReadoutScratch, out: Tensor) -> Tensor:
    """out (B, n) = dloss_b/dq_b = R_sc R^T g (sum_k w_k (zq - zc_k)); allocation-free given the scratch."""
    readout_weights(q, f, target_mask, sc)
    torch.sum(sc.w, dim=1, keepdim=True, out=sc.col)
    torch.mm(sc.w, f.zc, out=sc.tmp)
    sc.tmp.neg_().addcmul_(sc.zq, sc.col).mul_(f.g).mul_(f.r_sc)
    return torch.mm(sc.tmp, f.rot, out=out)


def class_onehot(labels: Tensor, num_classes: int, dtype: torch.dtype) -> Tensor:
    """(K, V) one-hot of labels (K,); unlike F.one_hot it never reads values back to the host (capturable, compilable)."""
    return (labels[:, None] == torch.arange(num_classes, device=labels.device)).to(dtype)


@dataclass
class ReadoutResult:
    """Per-example loss (B,) in nats, class probabilities (B, V) and the readout gradients (batch means)."""

    loss: Tensor
    probs: Tensor
    grad_q: Tensor  # (B, n) per example, not averaged
    grads: ReadoutParams


def readout_loss_and_grads(
    q: Tensor, f: ReadoutFrame, cand: Candidates, targets: Tensor, num_classes: int, layout: RotorLayout, theta: Tensor
) -> ReadoutResult:
    """Exact loss and analytic gradients of the batch-mean loss w.r.t. every readout parameter at q (B, n).

    Only the first V candidates are prototypes (parameters); the rest (memory bank) are data.
    """
    batch = q.shape[0]
    onehot = class_onehot(cand.labels, num_classes, q.dtype)  # (K, V)
    target_mask = onehot[:, targets].T  # (B, K)
    sc = ReadoutScratch.allocate(batch, q.shape[1], cand.coords.shape[0], q)
    grad_q = readout_force(q, f, target_mask, sc, torch.empty_like(q))
    probs = sc.pi @ onehot
    loss = -torch.log(sc.py.squeeze(1))
    zq, w = sc.zq, sc.w / batch  # batch mean from here on
    a = w * sc.spd  # dloss/dcost
    w_b, w_k = w.sum(1, keepdim=True), w.sum(0)  # (B, 1), (K,)
    wzc, wtzq = w @ f.zc, w.T @ zq  # (B, n), (K, n)
    # d/dc_k: -R_sc R^T g (sum_b w_bk (zq_b - zc_k)).
    m_k = (wtzq - w_k[:, None] * f.zc) * f.g * f.r_sc
    grad_protos = -(m_k[:num_classes] @ f.rot)
    # d/dg_i: R_sc / 2 * sum_bk w_bk z_bki^2 with z_bk = zq_b - zc_k.
    zz = (w_b * zq * zq).sum(0) - 2 * (zq * wzc).sum(0) + (w_k[:, None] * f.zc * f.zc).sum(0)
    grad_g = 0.5 * f.r_sc * zz
    grad_r = (a * sc.spd).sum()  # cost = R_sc * spd
    # d/dtheta: S = sum_bk delta_bk z_bk^T with delta = R_sc w g z (gradient w.r.t. z).
    cov = zq.T @ (w_b * zq) - zq.T @ wzc - f.zc.T @ wtzq + f.zc.T @ (w_k[:, None] * f.zc)
    grad_theta = rotor_angle_grad(f.r_sc * f.g[:, None] * cov, theta, layout)
    return ReadoutResult(loss, probs, grad_q, ReadoutParams(grad_g, grad_theta, grad_protos, grad_r))
