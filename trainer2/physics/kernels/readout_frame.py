"""The readout's frame and its fold for the fixed-point step in one Triton launch: what `readout_frame` and
`fold_frame` do once a batch in about 30 torch operators (the rotor's Givens layers and their suffix products, the
candidates rotated into the metric's frame, and the folded matrices the nudged step reads). One program holds the
(n, n) rotor and the (K, n) candidates; every output lands in a buffer made once, so a call allocates nothing.

Its torch references are trainer2.physics.readout.readout_frame and trainer2.physics.dynamics.fold_frame;
tests/test_readout_frame.py compares every field. The products sum in another order than torch's, and cos and sin
may round differently, so the two agree to rounding, not bitwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from trainer2.physics.dynamics import FoldBlocks, FoldedFrame
from trainer2.physics.kernels.chain import load_tile, load_vec, mm, padded, row_major, sized, sqrt_ieee
from trainer2.physics.readout import Candidates, ReadoutFrame, ReadoutParams, RotorLayout

MAX_BYTES = 32 * 1024  # of the largest padded tile, the (planes, n) one-hots or the (n, n) rotor: the Givens products
# stage them in shared memory (compiled ahead of time for sm_90: 16 x 1,024 float32 planes asked for 192 KiB, 32 x
# 1,024 for 384 KiB, past an H100's 227)


def fits(planes: int, coordinates: int, itemsize: int) -> bool:
    """Whether one program holds a rotor of `planes` Givens planes in `coordinates` dimensions of `itemsize` bytes."""
    return max(padded(planes), padded(coordinates)) * padded(coordinates) * itemsize <= MAX_BYTES


@triton.jit
def givens_layer(a, b, c, s, on, NP: tl.constexpr):
    """G (NP, NP) of one layer of disjoint planes: G[a, a] = G[b, b] = cos, G[b, a] = -G[a, b] = sin for the planes
    where `on`, the identity elsewhere. a, b (PL,) plane coordinates, c, s (PL,) their cos and sin."""
    nn = tl.arange(0, NP)
    ea = tl.where(on[:, None] & (a[:, None] == nn[None, :]), 1.0, 0.0).to(c.dtype)  # (PL, NP) one-hot rows
    eb = tl.where(on[:, None] & (b[:, None] == nn[None, :]), 1.0, 0.0).to(c.dtype)
    outside = 1.0 - tl.sum(ea + eb, axis=0)  # 1 on the coordinates no plane of the layer turns
    eye = tl.where(nn[:, None] == nn[None, :], outside[None, :], 0.0)
    turn = mm(tl.trans(ea * c[:, None]), ea) + mm(tl.trans(eb * c[:, None]), eb)
    return eye + turn - mm(tl.trans(ea * s[:, None]), eb) + mm(tl.trans(eb * s[:, None]), ea)


@triton.jit
def readout_frame_kernel(
    theta_ptr,  # (k,) rotor angles
    index_ptr,  # (4, k) RotorLayout.index: flat positions of (a, a) and (b, b) in (L, n, n)
    g_ptr,  # (n,) the metric's diagonal
    coords_ptr,  # (K, n) candidates
    r_sc_ptr,  # 0-dim R_sc
    obias_ptr,  # (n,) the output coupling's bias
    consts_ptr,  # (2,) float64: eps, -retrieval_beta
    suffix_ptr,  # (L + 1, n, n) out: S_l = G_{L-1} ... G_l
    zc_ptr,  # (K, n) out: R c_k
    gzc_t_ptr,  # (n, K) out: (g * zc)^T
    cc_ptr,  # (K,) out: g(c_k, c_k) + eps
    neg_scale_ptr,  # 0-dim out: -retrieval_beta R_sc
    mq_ptr,  # (n, 3n + 2) out: [-I | 0 | L^T | 0 | A], the L^T and A blocks written here
    bn_ptr,  # (3n + 2,) out: [b | 0 | 0 | 1 | 0], b written here
    lt_ptr,  # (n, n + 1) out: [L^T | 0], L^T written here
    yc2_ptr,  # (n + 1, K) out: [-2 yc^T ; cc]
    caug_ptr,  # (K, n + 1) out: [(g * zc) R | -1], (g * zc) R written here
    N,
    PLANES,
    K,
    LAYERS,
    NP: tl.constexpr,
    PP: tl.constexpr,
    KP: tl.constexpr,
):
    """readout_frame then fold_frame for one batch's candidates; the fold's constant blocks (-I, the zeros, the 1, the
    -1 column and C) are in the buffers from the start (FrameKernel), so only what the parameters move is written."""
    nn, jj, kk = tl.arange(0, NP), tl.arange(0, PP), tl.arange(0, KP)
    dt = g_ptr.dtype.element_ty
    live = jj < PLANES
    th = tl.load(theta_ptr + jj, mask=live, other=0.0)
    at_aa = tl.load(index_ptr + jj, mask=live, other=0)
    layer, a = at_aa // (N * N), (at_aa // N) % N
    b = tl.load(index_ptr + PLANES + jj, mask=live, other=0) % N
    c, s = tl.cos(th), tl.sin(th)
    nxn = nn[:, None] * N + nn[None, :]
    square = (nn[:, None] < N) & (nn[None, :] < N)
    rot = tl.where(nn[:, None] == nn[None, :], 1.0, 0.0).to(dt)  # S_L = I
    tl.store(suffix_ptr + LAYERS * N * N + nxn, rot, mask=square)
    for i in range(0, LAYERS):  # S_l = S_{l+1} G_l, from the last layer down
        at = LAYERS - 1 - i
        rot = mm(rot, givens_layer(a, b, c, s, live & (layer == at), NP))
        tl.store(suffix_ptr + at * N * N + nxn, rot, mask=square)

    # The candidates in the metric's frame (readout_frame)
    g = load_vec(g_ptr, N, NP)
    eps, neg_beta = tl.load(consts_ptr).to(dt), tl.load(consts_ptr + 1).to(dt)
    kn = (kk[:, None] < K) & (nn[None, :] < N)
    zc = mm(load_tile(coords_ptr, N, K, N, KP, NP), tl.trans(rot))  # (KP, NP) R c_k
    gzc = zc * g[None, :]
    cc = tl.sum(gzc * zc, axis=1) + eps
    tl.store(zc_ptr + kk[:, None] * N + nn[None, :], zc, mask=kn)
    tl.store(gzc_t_ptr + nn[None, :] * K + kk[:, None], gzc, mask=kn)
    tl.store(cc_ptr + kk, cc, mask=kk < K)
    r_sc = tl.load(r_sc_ptr)
    tl.store(neg_scale_ptr, neg_beta * r_sc)

    # The fold for the fixed-point step (fold_frame)
    sg = sqrt_ieee(g)
    l_t = tl.trans(rot) * sg[None, :]  # L^T = R^T diag(sqrt g)
    amat = mm(l_t, tl.trans(l_t))  # A = L^T L
    width = 3 * N + 2
    tl.store(mq_ptr + nn[:, None] * width + (N + 1) + nn[None, :], l_t, mask=square)
    tl.store(mq_ptr + nn[:, None] * width + (2 * N + 2) + nn[None, :], amat, mask=square)
    tl.store(lt_ptr + nn[:, None] * (N + 1) + nn[None, :], l_t, mask=square)
    tl.store(bn_ptr + nn, load_vec(obias_ptr, N, NP), mask=nn < N)
    yc = zc * sg[None, :]  # (KP, NP) the candidates in the Euclidean coordinates
    tl.store(yc2_ptr + nn[None, :] * K + kk[:, None], yc * -2.0, mask=kn)
    tl.store(yc2_ptr + N * K + kk, cc, mask=kk < K)
    cmat = mm(gzc, rot)  # C = (g * zc) R
    tl.store(caug_ptr + kk[:, None] * (N + 1) + nn[None, :], cmat, mask=kn)


class FrameKernel:
    """`kernel(params, cand, bias)` -> (ReadoutFrame, FoldedFrame): readout_frame and fold_frame in one launch for n
    coordinates, k planes and K candidates. Its outputs live in buffers made once: each call returns views of the same
    tensors, overwritten. `launches` counts the launches (a Python int)."""

    def __init__(
        self, layout: RotorLayout, candidates: int, beta_r: float, eps: float, blocks: FoldBlocks, like: Tensor
    ) -> None:
        def new(*shape: int) -> Tensor:
            return torch.zeros(shape, dtype=like.dtype, device=like.device)

        n, k, self.layout, self.blocks, self.beta_r = layout.n, layout.index.shape[1], layout, blocks, beta_r
        self.sizes, self.tiles = (n, k, candidates, layout.layers), (padded(n), padded(k), padded(candidates))
        self.consts = torch.tensor([eps, -beta_r], dtype=torch.float64, device=like.device)
        self.suffix, self.zc = new(layout.layers + 1, n, n), new(candidates, n)
        self.gzc_t, self.cc = new(n, candidates), new(candidates)
        self.neg_scale, self.mq, self.bn = new(), new(n, 3 * n + 2), new(3 * n + 2)
        self.lt, self.yc2, self.caug = new(n, n + 1), new(n + 1, candidates), new(candidates, n + 1)
        # The fold's constant blocks, once: the kernel writes only the blocks the parameters move (fold_frame's cats)
        self.mq[:, : n + 1], self.bn[n:], self.caug[:, n:] = blocks.neg_eye, blocks.b_tail, blocks.minus_one
        np_, pp, kp = self.tiles  # the largest tile sets the warps
        self.warps = 4 if max(np_ * kp, np_ * np_, pp * np_) <= 2048 else 8
        self.launches = 0

    def __call__(self, p: ReadoutParams, cand: Candidates, bias: Tensor) -> tuple[ReadoutFrame, FoldedFrame]:
        """The frame (suffix, rotated candidates, ...) and its fold from the readout's parameters, the batch's
        candidates and the output coupling's bias (n,)."""
        (n, k, kc, layers), (np_, pp, kp) = self.sizes, self.tiles
        row_major(p.theta, p.g_diag, cand.coords, bias)
        sized(self.zc.dtype, theta=(p.theta, (k,)), g_diag=(p.g_diag, (n,)), coords=(cand.coords, (kc, n)),
              bias=(bias, (n,)), r_sc=(p.r_sc, ()))  # fmt: skip
        readout_frame_kernel[(1,)](
            p.theta, self.layout.index, p.g_diag, cand.coords, p.r_sc, bias, self.consts,
            self.suffix, self.zc, self.gzc_t, self.cc, self.neg_scale,
            self.mq, self.bn, self.lt, self.yc2, self.caug,
            n, k, kc, layers, NP=np_, PP=pp, KP=kp, num_warps=self.warps,
        )  # fmt: skip
        self.launches += 1
        frame = ReadoutFrame(
            self.suffix, self.suffix[0], p.g_diag, self.zc, self.gzc_t, self.cc, cand.bias, self.neg_scale,
            p.r_sc, self.beta_r,
        )  # fmt: skip
        fold = FoldedFrame(
            mq_nudge=self.mq, b_nudge=self.bn, lt=self.lt, c=self.blocks.c, yc2=self.yc2, caug=self.caug,
            bias=cand.bias, neg_scale=self.neg_scale,
        )  # fmt: skip
        return frame, fold
