"""The retrieval readout's loss, class probabilities and exact gradients at the free equilibrium in one Triton launch
(two past 64 rows): what `readout_loss_and_grads` does in about 40 torch operators (distances under the metric, the
softmax over the candidates, p_y, the weights w, and the sums U, V and cov every gradient follows from). A program
walks its rows in blocks of 16 and keeps the candidates (K, n) and the sums in registers, which serves readouts of up
to 32 KiB of padded candidates x coordinates and of the (n, n) rotor (`fits`: 16 coordinates and 512 candidates in
float32, 256 in float64; at most 64 coordinates). A
batch of more than 64 rows is shared among programs, and a second launch adds their sums in a fixed order (no atomics:
the same numbers every call). The rotor's angle gradient, a few products over its planes, is one launch more
(kernels/rotor_angle_grad.py) or torch's `rotor_angle_grad`.

Its torch reference is trainer2.physics.readout.readout_loss_and_grads; tests/test_readout_grads.py compares the two.
The sums run in another order than torch's products, so the two agree to rounding, not bitwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from trainer2.physics.costs.cost import CostFrame
from trainer2.physics.kernels.chain import (
    div_ieee,
    load_rows,
    load_tile,
    load_vec,
    mm,
    padded,
    row_major,
    sized,
    sqrt_ieee,
)
from trainer2.physics.kernels.rotor_angle_grad import RotorAngleGrad
from trainer2.physics.readout import ReadoutParams, ReadoutResult, rotor_angle_grad

MAX_BYTES = 32 * 1024  # of the largest padded tile, the candidates' (K, n) or the rotor's (n, n): they and the sum V
# stay in registers, and the products that read them stage copies in shared memory (compiled ahead of time for sm_90,
# triton 3.9: at most 129 KiB of an H100's 227, at 16 coordinates and 512 candidates in float32)
BLOCK_B = 16  # batch rows a block: tl.dot's smallest
BLOCK_V = 16  # classes a block of the memory bank's class probabilities
ROWS_PER_PROGRAM = 64  # a larger batch is split among programs, whose partial sums a second launch adds: one program
# walking 4,096 rows took about 3 ms on an H200 (dev batch 4096 triton+graph: 261 windows/s with it, 1,431 with the
# readout in torch, 1,522 split; docs/performance.md)


def fits(coordinates: int, candidates: int, itemsize: int) -> bool:
    """Whether one program holds the readout of `candidates` (K) points in `coordinates` (n) dimensions of
    `itemsize` bytes: the (K, n) candidates and the (n, n) rotor and sums each within MAX_BYTES."""
    return max(padded(candidates), padded(coordinates)) * padded(coordinates) * itemsize <= MAX_BYTES


@triton.jit
def batch_sums(
    q_ptr, rot, g, zc, cc, bias, labels, mask_ptr, r_sc, beta_r, batch, loss_ptr, probs_ptr, lo, hi, B, K, V, N,
    ONE_HOT: tl.constexpr, BB: tl.constexpr, NP: tl.constexpr, KP: tl.constexpr, VB: tl.constexpr,
):  # fmt: skip
    """Rows [lo, hi) in blocks of BB: their loss and probabilities stored, and their shares of the batch-mean sums
    returned: sum_b w_bk (KP,), V without zc's share (KP, NP), sum_b zq_b^T U_b (NP, NP) and R_sc's gradient."""
    kk = tl.arange(0, KP)
    neg_scale = -beta_r * r_sc  # as readout_frame rounds it
    gzc_t = tl.trans(zc * g[None, :])  # (NP, KP)
    v_sum = tl.zeros((KP, NP), dtype=zc.dtype)  # V = -sum_b w_bk z_bk, without zc's share until the end
    w_col = tl.zeros((KP,), dtype=zc.dtype)  # sum_b w_bk
    zu = tl.zeros((NP, NP), dtype=zc.dtype)  # sum_b zq_b^T U_b
    grad_r = tl.sum(tl.zeros((KP,), dtype=zc.dtype), axis=0)
    for start in range(lo, hi, BB):  # hi - lo is a multiple of BB but at the batch's end: rows < B bounds the blocks
        rows = start + tl.arange(0, BB)
        live = (rows[:, None] < B) & (kk[None, :] < K)  # (BB, KP)
        zq = mm(load_rows(q_ptr, rows, B, N, NP), tl.trans(rot))  # (BB, NP) R q
        d2 = cc[None, :] - 2.0 * mm(zq, gzc_t) + tl.sum(zq * g[None, :] * zq, axis=1)[:, None]
        spd = sqrt_ieee(tl.maximum(d2, 0.0))  # cc carries +eps: spd >= sqrt(eps) on the live candidates
        logit = bias[None, :] + neg_scale * spd
        e = tl.exp(logit - tl.max(logit, axis=1)[:, None])
        pi = div_ieee(e, tl.broadcast_to(tl.sum(e, axis=1)[:, None], e.shape))
        mask = tl.load(mask_ptr + rows[:, None] * K + kk[None, :], mask=live, other=0.0)
        p_y = tl.sum(pi * mask, axis=1)
        p_y = tl.where(rows < B, p_y, 1.0)  # padded rows: no 0 / 0 or log 0
        if ONE_HOT:
            w = mask - pi
        else:
            w = div_ieee(pi * mask, tl.broadcast_to(p_y[:, None], pi.shape)) - pi
        w = div_ieee(div_ieee(w * beta_r, tl.where(live, spd, 1.0)), batch)  # the batch mean's share
        w = tl.where(live, w, 0.0)  # padded rows and candidates add nothing
        tl.store(loss_ptr + rows, -tl.log(p_y), mask=rows < B)
        if ONE_HOT:  # the candidates are the V prototypes in label order
            tl.store(probs_ptr + rows[:, None] * V + kk[None, :], pi, mask=(rows[:, None] < B) & (kk[None, :] < V))
        else:  # p_v sums the weights of every candidate labelled v, VB classes at a time
            for first in range(0, V, VB):
                vv = first + tl.arange(0, VB)
                hit = tl.where(labels[:, None] == vv[None, :], 1.0, 0.0).to(pi.dtype)  # (KP, VB)
                at = probs_ptr + rows[:, None] * V + vv[None, :]
                tl.store(at, mm(pi, hit), mask=(rows[:, None] < B) & (vv[None, :] < V))
        w_row = tl.sum(w, axis=1)  # (BB,)
        u = zq * w_row[:, None] - mm(w, zc)  # U = sum_k w_bk (zq_b - zc_k)
        w_col += tl.sum(w, axis=0)
        v_sum -= mm(tl.trans(w), zq)
        zu += mm(tl.trans(zq), u)
        grad_r += tl.sum(tl.sum(w * spd * spd, axis=1), axis=0)
    return w_col, v_sum, zu, grad_r


@triton.jit
def store_grads(
    rot, g, zc, r_sc, w_col, v_sum, zu, grad_r, grad_g_ptr, gcov_ptr, grad_protos_ptr, grad_r_ptr, N, V,
    NP: tl.constexpr, KP: tl.constexpr,
):  # fmt: skip
    """Every readout gradient from the batch's sums (batch_sums' four)."""
    kk, nn = tl.arange(0, KP), tl.arange(0, NP)
    v = zc * w_col[:, None] + v_sum  # (KP, NP): V = sum_b w_bk (zc_k - zq_b)
    cov = zu + mm(tl.trans(zc), v)  # (NP, NP)
    gr = g * r_sc
    grad_protos = mm(v * gr[None, :], rot)  # dloss/dc_k = -R^T (R_sc g sum_b w_bk z_bk)
    tl.store(grad_protos_ptr + kk[:, None] * N + nn[None, :], grad_protos, mask=(kk[:, None] < V) & (nn[None, :] < N))
    diag = tl.sum(tl.where(nn[:, None] == nn[None, :], cov, 0.0), axis=1)
    tl.store(grad_g_ptr + nn, diag * r_sc * 0.5, mask=nn < N)
    tl.store(gcov_ptr + nn[:, None] * N + nn[None, :], gr[:, None] * cov, mask=(nn[:, None] < N) & (nn[None, :] < N))
    tl.store(grad_r_ptr, grad_r)


def part_size(np_: int, kp: int) -> int:
    """Elements of one program's four sums as padded tiles: w_col (KP,), V (KP, NP), zU (NP, NP), R_sc's gradient."""
    return kp + kp * np_ + np_ * np_ + 1


@triton.jit
def store_sums(at, w_col, v_sum, zu, grad_r, NP: tl.constexpr, KP: tl.constexpr):
    """One program's four sums, padded tiles one after another from `at` (part_size elements)."""
    kk, nn = tl.arange(0, KP), tl.arange(0, NP)
    tl.store(at + kk, w_col)
    tl.store(at + KP + kk[:, None] * NP + nn[None, :], v_sum)
    tl.store(at + KP + KP * NP + nn[:, None] * NP + nn[None, :], zu)
    tl.store(at + KP + KP * NP + NP * NP, grad_r)


@triton.jit
def load_sums(at, NP: tl.constexpr, KP: tl.constexpr):
    """The four sums store_sums wrote from `at`."""
    kk, nn = tl.arange(0, KP), tl.arange(0, NP)
    w_col = tl.load(at + kk)
    v_sum = tl.load(at + KP + kk[:, None] * NP + nn[None, :])
    zu = tl.load(at + KP + KP * NP + nn[:, None] * NP + nn[None, :])
    return w_col, v_sum, zu, tl.load(at + KP + KP * NP + NP * NP)


@triton.jit
def readout_grads_kernel(
    q_ptr,  # (B, n) the free equilibrium's coordinates
    rot_ptr,  # (n, n) R
    g_ptr,  # (n,) the metric's diagonal
    zc_ptr,  # (K, n) R c_k
    cc_ptr,  # (K,) g(c_k, c_k) + eps
    bias_ptr,  # (K,) 0, or -inf for an empty slot
    labels_ptr,  # (K,) each candidate's class
    mask_ptr,  # (B, K) 1 where candidate k carries example b's label
    r_sc_ptr,  # 0-dim R_sc
    consts_ptr,  # (2,) beta_r and B in the readout's dtype (a float argument would be float32)
    loss_ptr,  # (B,) out: -log p_y
    probs_ptr,  # (B, V) out: class probabilities
    grad_g_ptr,  # (n,) out
    gcov_ptr,  # (n, n) out: R_sc g_i cov_ij, what the rotor's angle gradient reads
    grad_protos_ptr,  # (V, n) out
    grad_r_ptr,  # 0-dim out
    part_ptr,  # (P, PART) out where SPLIT: each program's four sums, padded tiles (part_size)
    B,
    N,
    K,
    V,
    ROWS,  # rows a program (ROWS_PER_PROGRAM, a multiple of BB): one program holds a batch of at most ROWS
    PART: tl.constexpr,
    SPLIT: tl.constexpr,  # several programs: store the sums for readout_sum_kernel, else the gradients
    ONE_HOT: tl.constexpr,
    BB: tl.constexpr,
    NP: tl.constexpr,
    KP: tl.constexpr,
    VB: tl.constexpr,
):
    """readout_loss_and_grads over the program's ROWS rows, the batch-mean sums carried from block to block."""
    rot = load_tile(rot_ptr, N, N, N, NP, NP)
    g = load_vec(g_ptr, N, NP)
    zc = load_tile(zc_ptr, N, K, N, KP, NP)
    cc = load_vec(cc_ptr, K, KP)
    kk = tl.arange(0, KP)
    bias = tl.load(bias_ptr + kk, mask=kk < K, other=float("-inf"))  # padded candidates: softmax weight 0
    labels = tl.load(labels_ptr + kk, mask=kk < K, other=-1)
    r_sc = tl.load(r_sc_ptr)
    lo = tl.program_id(0) * ROWS
    w_col, v_sum, zu, grad_r = batch_sums(
        q_ptr, rot, g, zc, cc, bias, labels, mask_ptr, r_sc, tl.load(consts_ptr), tl.load(consts_ptr + 1),
        loss_ptr, probs_ptr, lo, tl.minimum(lo + ROWS, B), B, K, V, N,
        ONE_HOT=ONE_HOT, BB=BB, NP=NP, KP=KP, VB=VB,
    )  # fmt: skip
    if SPLIT:
        store_sums(part_ptr + tl.program_id(0) * PART, w_col, v_sum, zu, grad_r, NP, KP)
    else:
        store_grads(
            rot, g, zc, r_sc, w_col, v_sum, zu, grad_r, grad_g_ptr, gcov_ptr, grad_protos_ptr, grad_r_ptr, N, V, NP, KP
        )


@triton.jit
def readout_sum_kernel(
    rot_ptr, g_ptr, zc_ptr, r_sc_ptr, part_ptr, grad_g_ptr, gcov_ptr, grad_protos_ptr, grad_r_ptr, P, N, K, V,
    PART: tl.constexpr, NP: tl.constexpr, KP: tl.constexpr,
):  # fmt: skip
    """The P programs' sums added in program order (the same order every call: no atomics), then the gradients."""
    rot = load_tile(rot_ptr, N, N, N, NP, NP)
    zc = load_tile(zc_ptr, N, K, N, KP, NP)
    w_col = tl.zeros((KP,), dtype=zc.dtype)
    v_sum = tl.zeros((KP, NP), dtype=zc.dtype)
    zu = tl.zeros((NP, NP), dtype=zc.dtype)
    grad_r = tl.sum(tl.zeros((KP,), dtype=zc.dtype), axis=0)
    for p in range(0, P):
        w_p, v_p, zu_p, r_p = load_sums(part_ptr + p * PART, NP, KP)
        w_col += w_p
        v_sum += v_p
        zu += zu_p
        grad_r += r_p
    store_grads(
        rot, load_vec(g_ptr, N, NP), zc, tl.load(r_sc_ptr), w_col, v_sum, zu, grad_r,
        grad_g_ptr, gcov_ptr, grad_protos_ptr, grad_r_ptr, N, V, NP, KP,
    )  # fmt: skip


class ReadoutGrads:
    """The retrieval readout's `loss_and_grads` for a batch of B rows, n coordinates and K candidates of V classes, in
    one launch (two past ROWS_PER_PROGRAM rows) plus the rotor's angle gradient. Its outputs live in buffers made once:
    each call returns the same tensors, overwritten (read a result before the next call, as a batch step does).
    `launches` counts the launches (a Python int), as the other kernels' wrappers do."""

    def __init__(
        self,
        batch: int,
        coordinates: int,
        candidates: int,
        num_classes: int,
        beta_r: float,
        like: Tensor,
        rotor: RotorAngleGrad | None = None,
    ) -> None:
        def new(*shape: int) -> Tensor:
            return torch.zeros(shape, dtype=like.dtype, device=like.device)

        self.sizes = (batch, coordinates, candidates, num_classes)
        self.consts = torch.tensor([beta_r, batch], dtype=like.dtype, device=like.device)
        self.loss, self.probs, self.grad_r = new(batch), new(batch, num_classes), new()
        self.grad_g, self.gcov, self.grad_protos = (
            new(coordinates),
            new(coordinates, coordinates),
            new(num_classes, coordinates),
        )
        self.blocks = (padded(coordinates), padded(candidates))
        self.warps = 4 if self.blocks[0] * self.blocks[1] <= 2048 else 8  # as compiled ahead of time (docs/triton.md)
        self.programs = triton.cdiv(batch, ROWS_PER_PROGRAM)
        self.part = part_size(*self.blocks)  # each program's sums as padded tiles, where several share the batch
        self.parts = new(self.programs, self.part) if self.programs > 1 else new(1)
        self.rotor = rotor  # the angle gradient's kernel, or None: rotor_angle_grad's torch operators
        self.launches = 0

    def __call__(self, q: Tensor, f: CostFrame, mask: Tensor) -> ReadoutResult:
        """Loss (B,), probabilities (B, V) and the batch-mean gradients of every readout parameter at q (B, n)."""
        (b, n, k, v), (np_, kp), r = self.sizes, self.blocks, f.readout
        row_major(q, mask, r.rot, r.zc)
        sized(self.loss.dtype, q=(q, (b, n)), mask=(mask, (b, k)), rot=(r.rot, (n, n)), zc=(r.zc, (k, n)))
        split = self.programs > 1
        readout_grads_kernel[(self.programs,)](
            q, r.rot, r.g, r.zc, r.cc, r.bias, f.cand.labels, mask, r.r_sc, self.consts,
            self.loss, self.probs, self.grad_g, self.gcov, self.grad_protos, self.grad_r, self.parts,
            b, n, k, v, ROWS_PER_PROGRAM,
            PART=self.part, SPLIT=split, ONE_HOT=f.one_hot, BB=BLOCK_B, NP=np_, KP=kp, VB=BLOCK_V, num_warps=self.warps,
        )  # fmt: skip
        self.launches += 1
        if split:
            readout_sum_kernel[(1,)](
                r.rot, r.g, r.zc, r.r_sc, self.parts, self.grad_g, self.gcov, self.grad_protos, self.grad_r,
                self.programs, n, k, v, PART=self.part, NP=np_, KP=kp, num_warps=self.warps,
            )  # fmt: skip
            self.launches += 1
        grad_theta = (rotor_angle_grad if self.rotor is None else self.rotor)(self.gcov, r.suffix, f.layout)
        return ReadoutResult(
            self.loss, self.probs, ReadoutParams(self.grad_g, grad_theta, self.grad_protos, self.grad_r)
        )
