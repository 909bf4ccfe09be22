"""The stacked +beta/-beta nudged phase as one Triton launch: all T fixed-point steps of the hidden chain, and q's
step with the readout's pull inside the loop (distances to every candidate under the metric, the softmax, the one-hot
or memory-bank mask, each row's beta), the q history and each step's spd. Its torch reference is
trainer2.physics.dynamics.fixed_point_steps (nudged=True) with readout_nudge, or even_odd_steps with EVEN_ODD.

Each program owns BLOCK_ROWS rows of the stacked workspace; a row's beta comes in through its beta_sign (the kernel
forms set_nudge_scale's factors from it, so the torch operators that set them do not run), so the two phases are the
same program on different rows. A row reads its start (s0), its drive and its target mask from the free phase's row it
stands for, so nothing is copied into the stacked workspace before the phase."""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from trainer2.physics.dynamics import FoldedFrame, Workspace
from trainer2.physics.energy import Energy
from trainer2.physics.kernels.chain import (
    chain_args,
    div_ieee,
    even_half,
    hidden_slots,
    hidden_step,
    load_chain,
    load_couplings,
    load_rows,
    load_tile,
    mm,
    odd_half,
    padded,
    row_major,
    sized,
    speed,
    sqrt_ieee,
    store_chain,
    store_rows,
    top_layer,
)


@triton.jit
def readout_pull(
    q, lt, a, yc_t, cc, c, bias, neg_scale, mask, beta, neg_beta, live, K, ONE_HOT: tl.constexpr, KP: tl.constexpr
):
    """sum_k w_k (qA - C_k) (BR, NP) at q (BR, NP), w_k = beta_col (mask_k pi_k / p_y - pi_k) / spd_k: readout_nudge's
    pull. yc_t (NP, KP) is -2 Yc^T, cc (KP,) |yc_k|^2 + eps, c (KP, NP) the candidates C_k; mask (BR, KP) is
    mask_beta (one-hot) or the target mask, beta (BR,) beta_col and neg_beta (BR,) -beta_col; live (BR,) marks real
    rows. Padding (candidates beyond K, rows beyond the batch) is kept finite, so it never makes an inf or a nan."""
    real = tl.arange(0, KP)[None, :] < K
    y = mm(q, lt)  # coordinates in which the metric is Euclidean
    d2 = tl.sum(y * y, axis=1)[:, None] + mm(y, yc_t) + cc[None, :]  # |y - yc_k|^2 + eps
    d2 = tl.where(real, d2, 1.0)
    rspd = div_ieee(tl.full(d2.shape, 1.0, d2.dtype), sqrt_ieee(tl.maximum(d2, 0.0)))  # the clamp guards rounding
    logit = bias[None, :] + div_ieee(tl.full(d2.shape, 0.0, d2.dtype) + neg_scale, rspd)  # bias - beta_r R_sc spd
    e = tl.exp(logit - tl.max(logit, axis=1)[:, None])  # padded candidates carry bias -inf: e = 0
    pi = div_ieee(e, tl.broadcast_to(tl.sum(e, axis=1)[:, None], e.shape))
    if ONE_HOT:
        w = (mask + pi * neg_beta[:, None]) * rspd  # beta_col (mask - pi) / spd
    else:
        p_y = tl.where(live, tl.sum(pi * mask, axis=1), 1.0)
        w = (div_ieee(pi * mask, tl.broadcast_to(p_y[:, None], pi.shape)) - pi) * rspd * beta[:, None]
    return tl.sum(w, axis=1)[:, None] * mm(q, a) - mm(w, c)


@triton.jit
def nudged_phase_kernel(
    h1_ptr,
    h2_ptr,
    h3_ptr,
    q_ptr,
    drive_ptr,
    w2_ptr,
    w3_ptr,
    wo_ptr,
    b2_ptr,
    b3_ptr,
    bo_ptr,
    lt_ptr,
    lt_stride,
    a_ptr,
    a_stride,
    yc_ptr,
    c_ptr,
    c_stride,
    c_eps_ptr,
    bias_ptr,
    scale_ptr,
    mask_ptr,
    sign_ptr,
    qh_ptr,
    spd_ptr,
    s0_h1_ptr,
    s0_h2_ptr,
    s0_h3_ptr,
    s0_q_ptr,
    rows,
    src_rows,
    start,
    steps,
    H1,
    H2,
    H3,
    N,
    HM,
    K,
    DEPTH: tl.constexpr,
    EVEN_ODD: tl.constexpr,
    ONE_HOT: tl.constexpr,
    FROM_S0: tl.constexpr,
    BR: tl.constexpr,
    P1: tl.constexpr,
    P2: tl.constexpr,
    P3: tl.constexpr,
    PM: tl.constexpr,
    NP: tl.constexpr,
    KP: tl.constexpr,
):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    # The stacked rows are `rows / src_rows` blocks of the batch: row r reads the free phase's row r % src_rows (its
    # drive, its target mask and, FROM_S0, its equilibrium; the torch path copies them in); rows past the end none.
    src = tl.where(r < rows, r % src_rows, src_rows)
    if FROM_S0:  # a phase's first run starts at the free equilibrium s0
        h1, h2, h3, q, wo, bo, b2, b3 = load_chain(
            s0_h1_ptr, s0_h2_ptr, s0_h3_ptr, s0_q_ptr, wo_ptr, b2_ptr, b3_ptr, bo_ptr,
            src, src_rows, H1, H2, H3, N, HM, P1, P2, P3, PM, NP,
        )  # fmt: skip
    else:  # a later run (a chunk of the phase) goes on from the workspace's state
        h1, h2, h3, q, wo, bo, b2, b3 = load_chain(
            h1_ptr, h2_ptr, h3_ptr, q_ptr, wo_ptr, b2_ptr, b3_ptr, bo_ptr,
            r, rows, H1, H2, H3, N, HM, P1, P2, P3, PM, NP,
        )  # fmt: skip
    drive = load_rows(drive_ptr, src, src_rows, H1, P1)
    # The readout, fixed for the window: L^T, A = L^T L, -2 Yc^T and |yc|^2 + eps (yc2's rows), C, bias, the scale.
    lt = load_tile(lt_ptr, lt_stride, N, N, NP, NP)
    a = load_tile(a_ptr, a_stride, N, N, NP, NP)
    yc_t = load_tile(yc_ptr, K, N, K, NP, KP)
    kk = tl.arange(0, KP)
    cc = tl.load(yc_ptr + N * K + kk, mask=kk < K, other=0.0)
    c = load_tile(c_ptr, c_stride, K, N, KP, NP)
    bias = tl.load(bias_ptr + kk, mask=kk < K, other=float("-inf"))
    neg_scale = tl.load(scale_ptr)
    c_eps = tl.load(c_eps_ptr + N)  # sqrt(eps)
    # Each row's factors, as set_nudge_scale forms them in torch (the same products): beta_col = beta_sign * -beta_r
    # R_sc, neg_beta = -beta_col and, one-hot, mask_beta = target_mask * beta_col
    beta = tl.load(sign_ptr + r, mask=r < rows, other=0.0) * neg_scale
    neg_beta = -beta
    mask = load_rows(mask_ptr, src, src_rows, K, KP)
    if ONE_HOT:
        mask = mask * beta[:, None]
    store_rows(qh_ptr + start * rows * N, q, r, rows, N, NP)
    for t in range(start, start + steps):
        w2, w3 = load_couplings(w2_ptr, w3_ptr, wo, H1, H2, H3, DEPTH, P1, P2, P3)
        if EVEN_ODD:  # odd layers, then q (from h_M as it is then), then h_2 from them; the pull is at the old q
            h1, h3 = odd_half(h1, h2, h3, q, drive, w2, w3, wo, b3, DEPTH)
            dq = bo[None, :] - q + mm(top_layer(h1, h2, h3, DEPTH), tl.trans(wo))
            dq += readout_pull(q, lt, a, yc_t, cc, c, bias, neg_scale, mask, beta, neg_beta, r < rows, K, ONE_HOT, KP)
            q_new = q + dq
            h2 = even_half(h1, h2, h3, q_new, w2, w3, wo, b2, DEPTH)
        else:
            dq = bo[None, :] - q + mm(top_layer(h1, h2, h3, DEPTH), tl.trans(wo))  # W h_M + b - q from the old h_M
            h1, h2, h3 = hidden_step(h1, h2, h3, q, drive, w2, w3, wo, b2, b3, DEPTH)
            dq += readout_pull(q, lt, a, yc_t, cc, c, bias, neg_scale, mask, beta, neg_beta, r < rows, K, ONE_HOT, KP)
            q_new = q + dq
        store_rows(qh_ptr + (t + 1) * rows * N, q_new, r, rows, N, NP)
        tl.store(spd_ptr + t * rows + r, speed(q_new - q, lt, c_eps), mask=r < rows)
        q = q_new
    store_chain(h1_ptr, h2_ptr, h3_ptr, q_ptr, h1, h2, h3, q, r, rows, H1, H2, H3, N, DEPTH, P1, P2, P3, NP)


def nudged_window(
    ws: Workspace,
    params: Energy,
    fold: FoldedFrame,
    start: int,
    steps: int,
    one_hot: bool,
    even_odd: bool,
    free: Workspace,
    s0: list[Tensor] | None = None,
) -> None:
    """`steps` nudged fixed-point steps of every stacked row of ws in one launch (each row's beta from its beta_sign and
    the frame's -beta_r R_sc, formed in the kernel as set_nudge_scale forms it), Jacobi or even/odd; fills ws.q_hist
    and ws.spd_hist as fixed_point_steps (even_odd_steps) does. free: the free phase's workspace (B rows), whose drive
    and target mask stacked row r reads at row r % B; s0 (its layers, (B, H_i) each): the state the run starts from,
    row r at r % B (else ws.state: a later run of the phase)."""
    args = chain_args(ws, params)
    row_major(
        fold.lt,
        fold.c,
        fold.mq_nudge,
        fold.yc2,
        fold.caug,
        fold.bias,
        free.drive,
        free.target_mask,
        ws.beta_sign,
    )
    src_rows = free.drive.shape[0]
    if args["rows"] % src_rows:
        raise ValueError(
            f"Triton nudged kernel: {args['rows']} stacked rows are not blocks of the free phase's {src_rows} rows"
        )
    start_from = ws.state.s if s0 is None else s0
    want = {"free drive": (free.drive, (src_rows, ws.drive.shape[1]))}
    want["free target mask"] = (free.target_mask, (src_rows, ws.target_mask.shape[1]))
    if s0 is not None:
        want |= {f"s0[{i}]": (t, (src_rows, h.shape[1])) for i, (t, h) in enumerate(zip(s0, ws.state.s, strict=True))}
        row_major(*s0)
    sized(ws.drive.dtype, **want)
    hidden = hidden_slots(start_from)
    n, k = args["N"], fold.yc2.shape[1]
    a = fold.mq_nudge[:, 2 * n + 2 :]  # A = L^T L, the last block of [-I | 0 | L^T | 0 | A]
    grid = (triton.cdiv(args["rows"], args["BR"]),)
    args["drive_ptr"] = free.drive
    nudged_phase_kernel[grid](
        lt_ptr=fold.lt,
        lt_stride=fold.lt.stride(0),
        a_ptr=a,
        a_stride=a.stride(0),
        yc_ptr=fold.yc2,
        c_ptr=fold.caug,
        c_stride=fold.caug.stride(0),
        c_eps_ptr=fold.c,
        bias_ptr=fold.bias,
        scale_ptr=fold.neg_scale,
        mask_ptr=free.target_mask,
        sign_ptr=ws.beta_sign,
        qh_ptr=ws.q_hist,
        spd_ptr=ws.spd_hist,
        s0_h1_ptr=hidden[0],
        s0_h2_ptr=hidden[1],
        s0_h3_ptr=hidden[2],
        s0_q_ptr=start_from[-1],
        src_rows=src_rows,
        start=start,
        steps=steps,
        K=k,
        EVEN_ODD=even_odd,
        ONE_HOT=one_hot,
        FROM_S0=s0 is not None,
        KP=padded(k),
        **args,
    )
