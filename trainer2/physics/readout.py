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
    """Givens planes (a_j, b_j) grouped into layers of disjoint pairs, and where each plane's four entries sit in
    the stacked layer matrices; computed once per shape."""

    a: list[Tensor]  # per layer, LongTensor (P,) of first coordinates
    b: list[Tensor]  # per layer, LongTensor (P,) of second coordinates
    index: Tensor  # (4, k) flat positions in (L, n, n) of entries (a, a), (b, b), (a, b), (b, a) of each plane
    eye: Tensor  # (L * n * n,) L stacked identities, the layers at theta = 0
    n: int

    @property
    def layers(self) -> int:
        return len(self.a)

    def to(self, device: torch.device) -> "RotorLayout":
        return RotorLayout(
            [t.to(device) for t in self.a],
            [t.to(device) for t in self.b],
            self.index.to(device),
            self.eye.to(device),
            self.n,
        )


def rotor_layout(n: int, k: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> RotorLayout:
    """Round-robin (circle method) schedule: n-1 rounds of n//2 disjoint pairs, cycled until k planes."""
    players = list(range(n if n % 2 == 0 else n + 1))  # odd n: a dummy player sits out each round
    m = len(players)
    rounds: list[list[tuple[int, int]]] = []
    for _ in range(m - 1):
        pairs = [(players[i], players[m - 1 - i]) for i in range(m // 2)]
        rounds.append([(min(p), max(p)) for p in pairs if max(p) < n])
        players = [players[0], players[-1], *players[1:-1]]
    layers: list[list[tuple[int, int]]] = []
    used = 0
    while used < k:
        layers.append(rounds[len(layers) % len(rounds)][: k - used])
        used += len(layers[-1])
    planes = [(layer, a, b) for layer, pairs in enumerate(layers) for a, b in pairs]
    index = torch.tensor(
        [
            [(layer * n + a) * n + a for layer, a, b in planes],
            [(layer * n + b) * n + b for layer, a, b in planes],
            [(layer * n + a) * n + b for layer, a, b in planes],
            [(layer * n + b) * n + a for layer, a, b in planes],
        ],
        dtype=torch.long,
        device=device,
    ).reshape(4, k)
    return RotorLayout(
        [torch.tensor([p[0] for p in pairs], dtype=torch.long, device=device) for pairs in layers],
        [torch.tensor([p[1] for p in pairs], dtype=torch.long, device=device) for pairs in layers],
        index,
        torch.eye(n, dtype=dtype, device=device).repeat(len(layers), 1, 1).reshape(-1),
        n,
    )


def rotor_layers(theta: Tensor, layout: RotorLayout) -> Tensor:
    """The Givens layers G (L, n, n), R = G_{L-1} ... G_0: in plane (a, b), G[a, a] = G[b, b] = cos,
    G[b, a] = -G[a, b] = sin."""
    c, s = torch.cos(theta), torch.sin(theta)
    vals = torch.cat([c, c, -s, s])  # the entries (a, a), (b, b), (a, b), (b, a) of every plane, as in layout.index
    eye = layout.eye.to(theta.dtype)
    return eye.index_put((layout.index.reshape(-1),), vals).view(layout.layers, layout.n, layout.n)


def rotor_suffixes(layers: Tensor) -> Tensor:
    """S (L + 1, n, n), S_l = G_{L-1} ... G_l: the rotor from layer l on, from the layers (L, n, n);
    S_0 = R, S_L = I."""
    out = [torch.eye(layers.shape[1], dtype=layers.dtype, device=layers.device)]
    for g in reversed(layers.unbind(0)):  # G_{L-1} first, without flip's copy
        out.append(out[-1] @ g)
    return torch.stack(out[::-1])


def rotor_matrix(layers: Tensor) -> Tensor:
    """R (n, n) = G_{L-1} ... G_0 from the layers (L, n, n), so that z = R u rotates a column vector u."""
    return rotor_suffixes(layers)[0]


def rotor_angle_grad(c: Tensor, suffix: Tensor, layout: RotorLayout) -> Tensor:
    """d loss / d theta (k,) from C = (d loss / d R) R^T (n, n) and the suffixes S (L + 1, n, n) of `rotor_suffixes`.

    Turning plane (a, b) of layer l multiplies G_l by exp(theta J), J = e_b e_a^T - e_a e_b^T, so d loss / d theta
    = <d loss / d R, S_l J S_l^T R> = K_l[b, a] with K_l = S_l^T (C - C^T) S_l: two products for all planes.
    """
    k = suffix.mT @ (c - c.T) @ suffix  # (L + 1, n, n); K_L (no planes) is never read
    return torch.take(k, layout.index[3])  # the (b, a) entry of every plane (k seen flat)


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

    suffix: Tensor  # (L + 1, n, n) S_l = G_{L-1} ... G_l, the rotor from layer l on (rotor_suffixes)
    rot: Tensor  # (n, n) R = S_0
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
    suffix = rotor_suffixes(rotor_layers(p.theta, layout))
    rot = suffix[0]
    zc = cand.coords @ rot.T
    gzc = zc * p.g_diag
    cc = (gzc * zc).sum(-1) + eps
    return ReadoutFrame(suffix, rot, p.g_diag, zc, gzc.T.contiguous(), cc, cand.bias, -beta_r * p.r_sc, p.r_sc, beta_r)


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

        return ReadoutScratch(
            new(batch, n), new(batch, n), new(batch, k), new(batch, k), new(batch, k), new(batch, 1), new(batch, 1)
        )


def readout_weights(q: Tensor, f: ReadoutFrame, target_mask: Tensor, sc: ReadoutScratch, one_hot: bool = False) -> None:
    """Fill sc.zq, sc.spd, sc.pi, sc.py and sc.w = (dloss/dcost) / spd for q (B, n), in place.

    dloss/dcost_k = beta_r * pi_k * (mask_k / p_y - 1): the target term minus the model's
    expectation. target_mask (B, K) is 1 where candidate k carries the example's label; one_hot: every
    label has exactly one candidate, so mask * pi / p_y is the mask itself.
    """
    torch.mm(q, f.rot.T, out=sc.zq)
    torch.addmm(f.cc, sc.zq, f.gzc_t, alpha=-2.0, out=sc.spd)  # g(c, c) + eps - 2 g(zq, zc)
    torch.mul(sc.zq, f.g, out=sc.tmp).mul_(sc.zq)
    torch.sum(sc.tmp, dim=1, keepdim=True, out=sc.col)
    sc.spd.add_(sc.col).clamp_(min=0.0).sqrt_()  # cc carries +eps, so spd >= sqrt(eps); the clamp guards rounding
    # pi = softmax(bias - scale * spd); empty slots (bias -inf) get 0. The logits pass through sc.w.
    torch.addcmul(f.bias, sc.spd, f.neg_scale, out=sc.w)
    torch._softmax(sc.w, 1, False, out=sc.pi)
    torch.mul(sc.pi, target_mask, out=sc.w)
    torch.sum(sc.w, dim=1, keepdim=True, out=sc.py)
    if one_hot:
        torch.sub(target_mask, sc.pi, out=sc.w)
    else:
        sc.w.div_(sc.py).sub_(sc.pi)
    sc.w.mul_(f.beta_r).div_(sc.spd)


def readout_force(q: Tensor, f: ReadoutFrame, target_mask: Tensor, sc: ReadoutScratch, out: Tensor) -> Tensor:
    """out (B, n) = dloss_b/dq_b = R_sc R^T g (sum_k w_k (zq - zc_k)); allocation-free given the scratch."""
    readout_weights(q, f, target_mask, sc)
    torch.sum(sc.w, dim=1, keepdim=True, out=sc.col)
    torch.mm(sc.w, f.zc, out=sc.tmp)
    sc.tmp.neg_().addcmul_(sc.zq, sc.col).mul_(f.g).mul_(f.r_sc)
    return torch.mm(sc.tmp, f.rot, out=out)


def indicator(rows: Tensor, cols: Tensor, dtype: torch.dtype) -> Tensor:
    """(R, C) 1 where rows[r] == cols[c], else 0, for ids rows (R,) and cols (C,); no host read (capturable). A product
    with it sums by id in a fixed order, where index_add_'s CUDA atomics would not."""
    return (rows[:, None] == cols[None, :]).to(dtype)


def target_mask(labels: Tensor, targets: Tensor, dtype: torch.dtype) -> Tensor:
    """(B, K) 1 where candidate k (labels (K,)) carries example b's label (targets (B,))."""
    return indicator(targets, labels, dtype)


def readout_scores(
    q: Tensor,
    f: ReadoutFrame,
    cand: Candidates,
    target_mask: Tensor,
    num_classes: int,
    sc: ReadoutScratch,
    one_hot: bool = False,
) -> tuple[Tensor, Tensor]:
    """Per-example loss (B,) in nats and class probabilities (B, V) at q (B, n), filling the scratch sc. one_hot: the
    candidates are the V prototypes in label order, so the probabilities are the softmax weights themselves."""
    readout_weights(q, f, target_mask, sc, one_hot)
    loss = torch.log(sc.py.squeeze(1)).neg_()
    if one_hot:
        return loss, sc.pi.clone()  # sc is overwritten by the next readout
    # p_v sums the weights of every candidate labelled v (in a fixed order: sampling with a fixed seed repeats on CUDA)
    return loss, torch.mm(sc.pi, indicator(cand.labels, torch.arange(num_classes, device=q.device), q.dtype))


@dataclass
class ReadoutResult:
    """Per-example loss (B,) in nats, class probabilities (B, V) and the readout gradients (batch means)."""

    loss: Tensor
    probs: Tensor
    grads: ReadoutParams


def readout_loss_and_grads(
    q: Tensor,
    f: ReadoutFrame,
    cand: Candidates,
    target_mask: Tensor,
    num_classes: int,
    layout: RotorLayout,
    sc: ReadoutScratch,
    one_hot: bool = False,
) -> ReadoutResult:
    """Exact loss and analytic gradients of the batch-mean loss w.r.t. every readout parameter at q (B, n), using
    (and overwriting) the scratch sc. target_mask (B, K) is 1 where candidate k carries the example's label;
    one_hot as in `readout_scores`.

    With z_bk = zq_b - zc_k and w_bk = dloss/dcost_bk / spd_bk: dloss/dz_bk = R_sc w_bk g z_bk, so everything
    follows from U = sum_k w_bk z_bk (B, n), V = -sum_b w_bk z_bk (K, n) and cov = sum_bk w_bk z_bk z_bk^T (n, n).
    Only the first V candidates are prototypes (parameters); the rest (memory bank) are data.
    """
    loss, probs = readout_scores(q, f, cand, target_mask, num_classes, sc, one_hot)
    zq, w = sc.zq, sc.w.div_(q.shape[0])  # batch mean from here on
    u = torch.mul(zq, w.sum(1, keepdim=True)).sub_(w @ f.zc)
    v = torch.mul(f.zc, w.sum(0)[:, None]).sub_(w.T @ zq)
    cov = torch.addmm(zq.T @ u, f.zc.T, v)
    gr = f.g * f.r_sc
    grad_protos = (v[:num_classes] * gr) @ f.rot  # dloss/dc_k = -R^T (R_sc g sum_b w_bk z_bk)
    grad_g = cov.diagonal().mul(f.r_sc).mul_(0.5)  # dcost/dg_i = R_sc z_i^2 / (2 spd)
    grad_r = torch.dot(torch.mul(w, sc.spd).view(-1), sc.spd.view(-1))  # dcost/dR_sc = spd
    # (dloss/dR) R^T: the sum of dloss/dz z^T at the rotor's output.
    grad_theta = rotor_angle_grad(gr[:, None] * cov, f.suffix, layout)
    return ReadoutResult(loss, probs, ReadoutParams(grad_g, grad_theta, grad_protos, grad_r))
