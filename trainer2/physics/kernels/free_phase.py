"""The free relaxation phase as one Triton launch: all T fixed-point steps of the whole hidden chain, q's step, the
q history and each step's spd. Its torch reference is trainer2.physics.dynamics.fixed_point_steps (nudged=False), or
even_odd_steps with EVEN_ODD.

Each program owns BLOCK_ROWS batch rows (rows are independent while relaxing) and keeps them in registers for the
whole window; W_out and L^T are loaded once, the hidden-to-hidden couplings are re-read every step (from cache)."""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from trainer2.physics.dynamics import FoldedFrame, Workspace
from trainer2.physics.energy import Energy
from trainer2.physics.kernels.chain import (
    chain_args,
    even_half,
    hidden_slots,
    hidden_step,
    load_chain,
    load_couplings,
    load_rows,
    load_tile,
    mm,
    odd_half,
    row_major,
    sized,
    speed,
    store_chain,
    store_rows,
    top_layer,
)


@triton.jit
def free_phase_kernel(
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
    c_ptr,
    qh_ptr,
    spd_ptr,
    s0_h1_ptr,
    s0_h2_ptr,
    s0_h3_ptr,
    s0_q_ptr,
    rows,
    start,
    steps,
    H1,
    H2,
    H3,
    N,
    HM,
    DEPTH: tl.constexpr,
    EVEN_ODD: tl.constexpr,
    AT_REST: tl.constexpr,
    TO_S0: tl.constexpr,
    BR: tl.constexpr,
    P1: tl.constexpr,
    P2: tl.constexpr,
    P3: tl.constexpr,
    PM: tl.constexpr,
    NP: tl.constexpr,
):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    h1, h2, h3, q, wo, bo, b2, b3 = load_chain(
        h1_ptr,
        h2_ptr,
        h3_ptr,
        q_ptr,
        wo_ptr,
        b2_ptr,
        b3_ptr,
        bo_ptr,
        r,
        rows,
        H1,
        H2,
        H3,
        N,
        HM,
        P1,
        P2,
        P3,
        PM,
        NP,
    )
    drive = load_rows(drive_ptr, r, rows, H1, P1)
    if AT_REST:  # the phase starts from rest: every layer 0, whatever the state holds (the torch path zeroes it)
        h1, h2, h3, q = tl.zeros_like(h1), tl.zeros_like(h2), tl.zeros_like(h3), tl.zeros_like(q)
    lt = load_tile(lt_ptr, lt_stride, N, N, NP, NP)  # L^T, the metric's square root, for spd
    c_eps = tl.load(c_ptr + N)  # sqrt(eps)
    store_rows(qh_ptr + start * rows * N, q, r, rows, N, NP)
    for t in range(start, start + steps):
        w2, w3 = load_couplings(w2_ptr, w3_ptr, wo, H1, H2, H3, DEPTH, P1, P2, P3)
        if EVEN_ODD:  # odd layers, then q (its h_M is new for DEPTH 1 and 3, old for 2), then h_2 from them
            h1, h3 = odd_half(h1, h2, h3, q, drive, w2, w3, wo, b3, DEPTH)
            q_new = mm(top_layer(h1, h2, h3, DEPTH), tl.trans(wo)) + bo[None, :]
            h2 = even_half(h1, h2, h3, q_new, w2, w3, wo, b2, DEPTH)
        else:
            q_new = mm(top_layer(h1, h2, h3, DEPTH), tl.trans(wo)) + bo[None, :]  # the minimiser in q, old h_M
            h1, h2, h3 = hidden_step(h1, h2, h3, q, drive, w2, w3, wo, b2, b3, DEPTH)
        store_rows(qh_ptr + (t + 1) * rows * N, q_new, r, rows, N, NP)
        tl.store(spd_ptr + t * rows + r, speed(q_new - q, lt, c_eps), mask=r < rows)
        q = q_new
    store_chain(h1_ptr, h2_ptr, h3_ptr, q_ptr, h1, h2, h3, q, r, rows, H1, H2, H3, N, DEPTH, P1, P2, P3, NP)
    if TO_S0:  # the same rows into the saved free equilibrium (the torch path copies them after the phase)
        store_chain(
            s0_h1_ptr, s0_h2_ptr, s0_h3_ptr, s0_q_ptr, h1, h2, h3, q, r, rows, H1, H2, H3, N, DEPTH, P1, P2, P3, NP
        )


def free_window(
    ws: Workspace,
    params: Energy,
    fold: FoldedFrame,
    start: int,
    steps: int,
    even_odd: bool = False,
    at_rest: bool = False,
    s0: list[Tensor] | None = None,
) -> None:
    """`steps` free fixed-point steps from ws.state in one launch, Jacobi or even/odd; fills
    ws.q_hist[start:start + steps + 1] and ws.spd_hist[start:start + steps] as fixed_point_steps (even_odd_steps) does
    (its ws.vel and ws.zv_hist scratch stays untouched). at_rest: start from 0 in every layer, whatever ws.state holds;
    s0 (the state's layers, (B, H_i) each): where the last state is written as well."""
    args = chain_args(ws, params)
    row_major(fold.lt, fold.c)
    out = ws.state.s  # stands in for s0 without TO_S0, never written
    if s0 is not None:
        shapes = {f"s0[{i}]": (t, tuple(h.shape)) for i, (t, h) in enumerate(zip(s0, ws.state.s, strict=True))}
        sized(ws.drive.dtype, **shapes)
        row_major(*s0)
        out = s0
    hidden = hidden_slots(out)
    grid = (triton.cdiv(args["rows"], args["BR"]),)
    free_phase_kernel[grid](
        lt_ptr=fold.lt,
        lt_stride=fold.lt.stride(0),
        c_ptr=fold.c,
        qh_ptr=ws.q_hist,
        spd_ptr=ws.spd_hist,
        s0_h1_ptr=hidden[0],
        s0_h2_ptr=hidden[1],
        s0_h3_ptr=hidden[2],
        s0_q_ptr=out[-1],
        start=start,
        steps=steps,
        EVEN_ODD=even_odd,
        AT_REST=at_rest,
        TO_S0=s0 is not None,
        **args,
    )
