"""The hot loop: the relaxation steps of one phase on E + beta * loss over a preallocated workspace.

(A window is one batch step: a free phase, the nudged phases and the update; each phase is a run of the steps
here.) Two integrators, chosen once per run (`phase_function`):

    damped leapfrog:  p <- (1 - gamma dt) p + dt F(s),  s <- box(s + dt p / mass),  F = -dE/ds - beta dloss/dq
    fixed point:      s_i <- box(W_i s_{i-1} + b_i + W_{i+1}^T s_{i+1}) - beta dloss/dq on q

The fixed point is the leapfrog's exact special case dt = gamma = mass = 1 (the momentum is forgotten
every step, so p = F and s + F is the local minimiser); it needs no momenta and no force buffers.
Both update every layer from the previous state (Jacobi), so they give the same trajectory. The fixed point
also runs in even/odd order (`even_odd_steps`): the odd layers h_1, h_3, ... (h_0 = x, q = h_{M+1}) from their
neighbours, then the even layers from the new odd ones, each half step the exact minimiser of its layers.

A workspace holds R rows: the batch (free phase) or the nudged phases stacked (2B rows for +beta and -beta, with a
per-row strength, so both nudged phases cost one set of operators). A nudged phase moves q by its cost's pull (the
retrieval cost's is folded into a few matrices for the fixed point, `readout_nudge`; any other cost's is its force
dloss/dq, `q_forced`) or holds q clamped (`q_clamped`, the clamping rules); which one is chosen once per phase run.
Every tensor a step touches lives in the workspace; a step allocates nothing, never syncs with the host and never
branches on a tensor value, so a whole window can be captured as a CUDA graph and replayed. The speed of the velocity,
spd = sqrt(g(v, v) + eps), fills one row of `spd_hist` per step (the fixed point forms every row after its
loop, from the q it keeps per step); the LIoR path length is R_sc dt sum(spd) and is formed once, after the phase.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from trainer2.physics.couplings import Coupling
from trainer2.physics.energy import Energy, forces
from trainer2.physics.readout import ReadoutFrame, ReadoutScratch, readout_force

ORDERS = ("jacobi", "even_odd")


@dataclass(frozen=True)
class Integrator:
    """Step size dt, damping gamma (0 = Stormer-Verlet, conserves energy) and mass; dt = gamma = mass = 1
    is the fixed-point iteration s <- box(argmin of the local quadratic). order: "jacobi" (every layer from the
    previous state) or "even_odd" (odd layers, then even layers from the new odd ones; the fixed point only)."""

    dt: float
    gamma: float
    mass: float
    order: str = "jacobi"

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise ValueError(f"relaxation order must be one of {list(ORDERS)}, got {self.order!r}")
        if self.even_odd and not self.fixed_point:
            raise ValueError(
                f"even/odd relaxation runs the fixed-point iteration only (dt = gamma = mass = 1), got dt {self.dt:g}, "
                f"gamma {self.gamma:g}, mass {self.mass:g}"
            )

    @property
    def fixed_point(self) -> bool:
        return self.dt == 1.0 and self.gamma == 1.0 and self.mass == 1.0

    @property
    def even_odd(self) -> bool:
        return self.order == "even_odd"


@dataclass
class State:
    """Positions s = (h_1..h_M, q) and momenta p, each (R, H_i); momenta are empty for the fixed point, which has
    none."""

    s: list[Tensor]
    p: list[Tensor]

    @staticmethod
    def zeros(rows: int, sizes: list[int], like: Tensor, momenta: bool = True) -> "State":
        def new() -> list[Tensor]:
            return [torch.zeros(rows, h, dtype=like.dtype, device=like.device) for h in sizes]

        return State(new(), new() if momenta else [])

    def tensors(self) -> list[Tensor]:
        return self.s + self.p

    def copy_(self, other: "State") -> None:
        torch._foreach_copy_(self.tensors(), other.tensors())

    def zero_(self) -> None:
        torch._foreach_zero_(self.tensors())


@dataclass
class FoldedFrame:
    """The readout folded into small matrices once per batch, for the fixed-point step.

    With L = diag(sqrt g) R, y = q L^T are coordinates in which the metric is Euclidean, A = L^T L and
    C_k = c_k A the candidates seen from q. Nudged: q @ mq_nudge + b_nudge = [b - q | 0 | y | 1 | qA]; W h_M is
    then added to the first n columns (dq), -w @ caug to the first n + 1 ([dq | sum w]), and [y | 1] @ yc2 gives
    |y - yc_k|^2 + eps less |y|^2."""

    # mq_nudge: h_M only reaches dq (W h_M is added on its own)
    mq_nudge: Tensor  # (n, 3n + 2) q -> [dq | 0 | y | 0 | qA]: [-I, 0, L^T, 0, A]
    b_nudge: Tensor  # (3n + 2,) [b | 0 | 0 | 1 | 0]
    lt: Tensor  # (n, n + 1) [L^T | 0]
    c: Tensor  # (n + 1,) [0 .. 0, sqrt(eps)]: |v L^T, sqrt(eps)| = spd of the velocity v
    yc2: Tensor  # (n + 1, K) [-2 Yc^T ; |yc_k|^2 + eps]
    caug: Tensor  # (K, n + 1) [C | -1]: -w @ caug = [-w C | sum w]
    bias: Tensor  # (K,) logit bias (0, or -inf for an empty memory slot)
    neg_scale: Tensor  # 0-dim -retrieval_beta * R_sc


@dataclass(frozen=True)
class FoldBlocks:
    """The constant blocks of a FoldedFrame, made once per workspace size so that folding is a few products and
    concatenations: [-I | 0] (n, n + 1), a zero column (n, 1), b_nudge's tail [0 | 0 | 1 | 0] (2n + 2,), c, and a
    column of -1 (K, 1)."""

    neg_eye: Tensor
    zero_col: Tensor
    b_tail: Tensor
    c: Tensor
    minus_one: Tensor

    @staticmethod
    def make(n: int, k: int, eps: float, like: Tensor) -> "FoldBlocks":
        def new(*shape: int) -> Tensor:
            return torch.zeros(shape, dtype=like.dtype, device=like.device)

        neg_eye, b_tail, c = new(n, n + 1), new(2 * n + 2), new(n + 1)
        neg_eye[:, :n] = -torch.eye(n, dtype=like.dtype, device=like.device)
        b_tail[n + 1] = 1.0
        c[n] = math.sqrt(eps)
        return FoldBlocks(neg_eye, new(n, 1), b_tail, c, torch.full((k, 1), -1.0, dtype=like.dtype, device=like.device))


def fold_frame(e: Energy, f: ReadoutFrame, blocks: FoldBlocks) -> FoldedFrame:
    """Per batch (outside the window): the top coupling's bias and the readout frame folded for the fixed-point
    step, in a dozen operators (a product or concatenation each; it ran 26 when it refilled preallocated blocks)."""
    sg = f.g.sqrt()
    l_t = f.rot.T * sg  # L^T = R^T diag(sqrt g)
    lt = torch.cat([l_t, blocks.zero_col], dim=1)  # [L^T | 0]
    a = l_t @ l_t.T  # A = L^T L
    yc = f.zc * sg  # (K, n) candidates in the Euclidean coordinates
    return FoldedFrame(
        mq_nudge=torch.cat([blocks.neg_eye, lt, a], dim=1),
        b_nudge=torch.cat([e.output.bias, blocks.b_tail]),
        lt=lt,
        c=blocks.c,
        yc2=torch.cat([yc.T * -2.0, f.cc[None]]),  # f.cc = g(c_k, c_k) + eps = |yc_k|^2 + eps
        caug=torch.cat([f.gzc_t.T @ f.rot, blocks.minus_one], dim=1),  # C = yc L^T = (g * zc) R
        bias=f.bias,
        neg_scale=f.neg_scale,
    )


@dataclass
class Workspace:
    """Everything a phase touches, allocated once for R rows and at most T steps."""

    state: State  # the running state
    drive: Tensor  # (R, H_1) W_1 x + b_1, filled before the window (the stacked nudged rows': torch's steps only)
    drives: list[Tensor]  # (R, H_j) per layer the input drives: [drive] for a chain (energy.input_drive)
    target_mask: Tensor  # (R, K) 1 where candidate k carries the example's label
    beta_sign: Tensor  # (R, 1) the nudging strength of each row (+beta, -beta or 0), fixed at allocation
    beta_col: Tensor  # (R, 1) per-row factor of the q nudge, set once per batch (torch's steps; Triton forms its own)
    mask_beta: Tensor  # (R, K) target_mask * beta_col, set once per batch (fixed point, torch's steps)
    neg_beta: Tensor  # (R, 1) -beta_col (fixed point, torch's steps)
    spd_hist: Tensor  # (T, R) spd of every step
    spd_rows: list[Tensor]  # the rows of spd_hist, made once (a leapfrog step writes one)
    # fixed point
    q_hist: Tensor  # (T + 1, R, n) q before every step and after the last
    q_rows: list[Tensor]  # its rows, made once
    q_before: Tensor  # (T, R, n) q_hist[:-1] and q_hist[1:], views made once (a whole phase's speeds slice nothing)
    q_after: Tensor
    vel: Tensor  # (T, R, n) the velocity q_{t+1} - q_t of every step
    vel_flat: Tensor  # the same as (T R, n)
    zv_hist: Tensor  # (T, R, n + 1) [v L^T | sqrt(eps)] of every step
    zv_flat: Tensor  # the same as (T R, n + 1)
    out: Tensor  # (R, 3n + 2) [dq | sum w | y | 1 | qA] of a nudged step, and views of its blocks
    dq: Tensor
    dqs: Tensor  # [dq | sum w]
    wsum: Tensor
    y: Tensor
    y1: Tensor  # [y | 1]
    qa: Tensor
    # (R, H_i) Jacobi: the new lower hidden layers h_1..h_{M-1} (empty for one hidden layer); even/odd: the staged
    # layers (`staged_layers`), none for dense and average-pooled chains
    temp: list[Tensor]
    zv: Tensor  # (R, n + 1)
    ny: Tensor  # (R, 1) |y|^2
    y_rows: Tensor  # (R, 1, n), y_cols (R, n, 1) and ny_batch (R, 1, 1): views for |y|^2 as one batched product
    y_cols: Tensor
    ny_batch: Tensor
    rspd: Tensor  # (R, K) 1 / spd(q - c_k)
    logit: Tensor  # (R, K)
    pi: Tensor  # (R, K)
    w: Tensor  # (R, K) beta_col dloss/dcost_k / (beta_r R_sc spd_k)
    py: Tensor  # (R, 1)
    # leapfrog (and scoring)
    force: list[Tensor]  # (R, H_i) -dE/ds_i; empty for the fixed point
    gnudge: Tensor  # (R, n) dloss/dq
    target: Tensor  # (R, n) c_y per row, set per batch where a cost's force or a clamp reads it
    readout: ReadoutScratch

    @staticmethod
    def allocate(
        rows: int,
        sizes: list[int],
        num_candidates: int,
        steps: int,
        betas: list[float],
        like: Tensor,
        fixed: bool,
        temps: list[int] | None = None,
        driven: list[int] | None = None,
    ) -> "Workspace":
        """sizes = [H_1, ..., H_M, n]; betas: one nudging strength per block of rows (e.g. [0], [b] or [b, -b]);
        fixed: for the fixed-point window (no momenta, no forces) rather than the leapfrog; temps: the widths of its
        temp buffers (default: Jacobi's, H_1 .. H_{M-1}); driven: the widths of the layers the input drives (default
        a chain's, [H_1])."""
        n, k = sizes[-1], num_candidates

        def new(*shape: int) -> Tensor:
            return torch.zeros(shape, dtype=like.dtype, device=like.device)

        out, ny = new(rows, 3 * n + 2), new(rows, 1)
        y = out[:, n + 1 : 2 * n + 1]
        q_hist, vel, zv_hist = new(steps + 1, rows, n), new(steps, rows, n), new(steps, rows, n + 1)
        spd_hist = new(steps, rows)
        per = rows // len(betas)
        beta_sign = torch.cat([torch.full((per, 1), b, dtype=like.dtype, device=like.device) for b in betas])
        drives = [new(rows, h) for h in ([sizes[0]] if driven is None else driven)]
        return Workspace(
            state=State.zeros(rows, sizes, like, momenta=not fixed),
            drive=drives[0],
            drives=drives,
            target_mask=new(rows, k),
            beta_sign=beta_sign,
            beta_col=new(rows, 1),
            mask_beta=new(rows, k),
            neg_beta=new(rows, 1),
            spd_hist=spd_hist,
            spd_rows=list(spd_hist.unbind(0)),
            q_hist=q_hist,
            q_rows=list(q_hist.unbind(0)),
            q_before=q_hist[:-1],
            q_after=q_hist[1:],
            vel=vel,
            vel_flat=vel.view(-1, n),
            zv_hist=zv_hist,
            zv_flat=zv_hist.view(-1, n + 1),
            out=out,
            dq=out[:, :n],
            dqs=out[:, : n + 1],
            wsum=out[:, n : n + 1],
            y=y,
            y1=out[:, n + 1 : 2 * n + 2],
            qa=out[:, 2 * n + 2 :],
            temp=[new(rows, h) for h in (sizes[:-2] if temps is None else temps)] if fixed else [],
            zv=new(rows, n + 1),
            ny=ny,
            y_rows=y.unsqueeze(1),
            y_cols=y.unsqueeze(2),
            ny_batch=ny.view(rows, 1, 1),
            rspd=new(rows, k),
            logit=new(rows, k),
            pi=new(rows, k),
            w=new(rows, k),
            py=new(rows, 1),
            force=[] if fixed else [new(rows, h) for h in sizes],
            gnudge=new(rows, n),
            target=new(rows, n),
            readout=ReadoutScratch.allocate(rows, n, k, like),
        )


Force = Callable[[Tensor, Tensor], Tensor]  # (q (R, n), out (R, n)) -> out = dloss/dq of each row, allocation-free


@dataclass(frozen=True)
class PhaseRun:
    """One run of the relaxation loop: `steps` steps (start .. start + steps - 1 of the phase) from ws.state over
    the energy; the readout enters through its frame (leapfrog) or its folded matrices (fixed point); nudged rows
    are pulled toward their targets; one_hot: every label has exactly one candidate (no memory bank). force: the
    cost's dloss/dq for a nudged phase (None: the retrieval readout's, folded in the fixed point); clamp: the nudged
    rows hold q where it is. q_step, the fixed point's step of q, follows from them once per run."""

    ws: Workspace
    energy: Energy
    frame: ReadoutFrame
    fold: FoldedFrame
    integ: Integrator
    start: int
    steps: int
    nudged: bool
    one_hot: bool
    force: Force | None = None
    clamp: bool = False
    at_rest: bool = False  # the run starts from 0 in every layer (a free phase's first run): torch's steps read the
    # zeroed state and skip the pulls of layers still at 0; the Triton free kernel starts from 0 whatever it holds
    replicas: int = 1  # ws.state is this many identical row blocks at step `start` (the nudged phases, from s0;
    # torch's steps: the Triton nudged kernel reads s0 itself at step 0)
    to_s0: bool = False  # a free phase's run: the Triton free kernel also writes its last state into s0 (torch's steps
    # leave the copy to free_phase)
    q_step: Callable[["PhaseRun", Tensor, Tensor, Tensor], None] = field(init=False, repr=False)
    # What the even/odd step's up pulls found for the pulls down (`layer_pulls`); None: no coupling's pull down reads
    # its layer below (dense, average pooling), or one cannot tell what
    reads: dict[int, Tensor] | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.nudged:
            step = q_free
        elif self.clamp:
            step = q_clamped
        else:
            step = q_folded if self.force is None else q_forced
        object.__setattr__(self, "q_step", step)
        readers = [c for c in self.energy.couplings if c.down_reads_below]
        tells = all(hasattr(c, "up_reading") and hasattr(c, "add_down_read") for c in readers)
        reads = {} if readers and tells else None  # None: nothing to keep, or a coupling that cannot tell it
        object.__setattr__(self, "reads", reads)


PhaseFn = Callable[[PhaseRun], None]


def fixed_point_steps(run: PhaseRun) -> None:
    """Fixed-point steps: every hidden layer moves to box(its pull from below + its pull from above), q to its
    pull from h_M (nudged: plus the readout's pull); q_t is kept in ws.q_rows[t].

    A dense chain costs one addmm per layer and neighbour plus one clamp per step (3 ops per free step with one
    hidden layer). Nudged: [dq | 0 | y | 1 | qA] from q, the output coupling's pull (no bias: it is folded into
    b_nudge) added to dq, the readout's pull added from y and qA, q_{t+1} = q_t + dq. The steps' spd comes from
    the q history after the loop, in three operators for all of them."""
    ws, start, steps = run.ws, run.start, run.steps
    s, c = ws.state.s, run.energy.couplings  # c[i] joins layer i - 1 (the input for i = 0) to layer i
    last = len(s) - 1
    top = s[last - 1]  # h_M is updated in place: only q reads it, and q's step is formed first
    # Lower hidden layers go to temp (they read old neighbours); the top one in place (it reads the old q; the output
    # coupling c[last] is dense, so its pull does not read the layer it writes).
    moving = [*enumerate(ws.temp), (last - 1, top)]  # (layer, where its new value goes)
    ws.q_rows[start].copy_(s[last])
    for t in range(start, start + steps):
        q = ws.q_rows[t]
        run.q_step(run, top, q, ws.q_rows[t + 1])
        rest = run.at_rest and t == start  # every neighbour is 0: the pulls from above vanish (one transposed conv)
        shared = run.replicas > 1 and t == start  # every layer reads the identical blocks: formed on the first
        for j, out in moving:
            above = s[j + 1] if j + 1 < last else q
            if shared:
                first_block_pulls(c, s, ws.drive, j, above, out, not rest, run.replicas)
            else:
                layer_pulls(c, s, ws.drive, j, above, out, not rest)
        top.clamp_(0.0, 1.0)
        if ws.temp:
            torch._foreach_clamp_min_(ws.temp, 0.0)
            torch._foreach_clamp_max_(ws.temp, 1.0)
            torch._foreach_copy_(s[: last - 1], ws.temp)
    record_speeds(run)


def q_free(run: PhaseRun, top: Tensor, q: Tensor, q_new: Tensor) -> None:
    """q_new = the minimiser in q given h_M = top: its pull W h_M + b."""
    run.energy.output.up(top, q_new)


def q_folded(run: PhaseRun, top: Tensor, q: Tensor, q_new: Tensor) -> None:
    """q_free plus the retrieval readout's pull at q: [dq | 0 | y | 1 | qA] from q, W h_M added to dq without its bias
    (b_nudge holds it), the pull added by readout_nudge, q_new = q + dq."""
    torch.addmm(run.fold.b_nudge, q, run.fold.mq_nudge, out=run.ws.out)  # [b - q | 0 | y | 1 | qA]
    run.energy.output.add_up(top, run.ws.dq)  # the pull of h_M into dq alone (y and qA do not see h_M)
    readout_nudge(run.ws, run.fold, run.one_hot)
    torch.add(q, run.ws.dq, out=q_new)


def q_forced(run: PhaseRun, top: Tensor, q: Tensor, q_new: Tensor) -> None:
    """q_free plus each row's pull beta_col dloss/dq at q from the cost's force (beta_col = -beta, set_nudge_scale)."""
    run.energy.output.up(top, q_new)
    q_new.addcmul_(run.force(q, run.ws.gnudge), run.ws.beta_col)


def q_clamped(run: PhaseRun, top: Tensor, q: Tensor, q_new: Tensor) -> None:
    """q stays where `clamp_output` put it; the hidden layers relax around it."""
    q_new.copy_(q)


def record_speeds(run: PhaseRun) -> None:
    """After fixed-point steps start .. start + steps - 1: q into the state, and spd_t = |v_t L^T, sqrt(eps)| of the
    velocities v_t = q_{t+1} - q_t of these steps into spd_hist, all at once (three operators)."""
    ws, fold, start, end = run.ws, run.fold, run.start, run.start + run.steps
    ws.state.s[-1].copy_(ws.q_rows[end])
    if start == 0 and end == len(ws.vel):  # the whole phase (a run in chunks reports progress): every buffer whole
        torch.sub(ws.q_after, ws.q_before, out=ws.vel)
        torch.addmm(fold.c, ws.vel_flat, fold.lt, out=ws.zv_flat)
        torch.linalg.vector_norm(ws.zv_hist, dim=2, out=ws.spd_hist)
        return
    rows = ws.vel.shape[1]
    torch.sub(ws.q_hist[start + 1 : end + 1], ws.q_hist[start:end], out=ws.vel[start:end])
    torch.addmm(fold.c, ws.vel_flat[start * rows : end * rows], fold.lt, out=ws.zv_flat[start * rows : end * rows])
    torch.linalg.vector_norm(ws.zv_hist[start:end], dim=2, out=ws.spd_hist[start:end])


def layer_pulls(
    c: list[Coupling],
    s: list[Tensor],
    drive: Tensor,
    j: int,
    above: Tensor,
    out: Tensor,
    from_above: bool,
    reads: dict[int, Tensor] | None = None,
) -> None:
    """out = hidden layer j's pull from below (c[j] from s[j - 1]; h_1's is the drive) plus, with from_above, the pull
    of `above` through c[j + 1] (at layer j's current value s[j], which a max-pooled coupling reads).

    reads (the even/odd step's): by coupling index, what a coupling whose down pull reads its layer below found of
    that layer in its up pull (max pooling: the argmax of conv_K(below), `Conv.up_reading`). The pull down takes it
    instead of convolving again; layer j changes after this call, so c[j + 1]'s entry goes either way."""
    if j == 0:
        if not from_above:
            out.copy_(drive)
        elif reads is not None and 1 in reads:
            c[1].add_down_read(above, reads[1], out.copy_(drive))
        else:
            c[1].down(above, s[0], drive, out)
    else:
        if reads is not None and c[j].down_reads_below:
            reads[j] = c[j].up_reading(s[j - 1], out)
        else:
            c[j].up(s[j - 1], out)
        if from_above and reads is not None and j + 1 in reads:
            c[j + 1].add_down_read(above, reads[j + 1], out)
        elif from_above:
            c[j + 1].add_down(above, s[j], out)
    if reads is not None:
        reads.pop(j + 1, None)


def first_block_pulls(
    c: list[Coupling], s: list[Tensor], drive: Tensor, j: int, above: Tensor, out: Tensor, from_above: bool, blocks: int
) -> None:
    """layer_pulls formed on the first of `blocks` identical row blocks and copied into the others: the first step of
    phases that start as copies of one state (the nudged phases from s0), where no pull here reads the moved q."""
    rows = out.shape[0] // blocks
    layer_pulls(c, [x[:rows] for x in s], drive[:rows], j, above[:rows], out[:rows], from_above)
    out[rows:].view(-1, rows, out.shape[1]).copy_(out[:rows])


def staged_layers(e: Energy) -> list[int]:
    """The hidden layers j whose even/odd step goes through a temp buffer: those whose coupling above reads them (max
    pooling places its pull at the argmax of the layer's current value), so the step forms that pull from the old
    value before it writes the layer. Empty for dense and average-pooled chains."""
    c = e.couplings
    return [j for j in range(len(c) - 1) if c[j + 1].down_reads_below]


def even_odd_steps(run: PhaseRun) -> None:
    """Even/odd fixed-point steps: the odd layers h_1, h_3, ... move to box(pull from below + pull from above) from
    their neighbours, then the even layers from the new odd ones (q = h_{M+1} with its parity; its step and the
    readout's pull at the old q are fixed_point_steps'). Layers of one parity do not interact, so each half step is
    the exact minimiser of E in its layers given the rest (block coordinate descent) and is written in place: no
    temp copies, and about half the steps of the Jacobi sweep to a given residual. A layer under a max-pooled coupling
    is staged through ws.temp instead (`staged_layers`); its half step uses the argmax of its old value (a majoriser's
    minimiser, so E still falls), as the Jacobi sweep does: the argmax the other half's up pull found at that value
    (run.reads), not a second convolution of it. q_t is kept in ws.q_rows[t]; spd as fixed_point_steps."""
    ws, start, steps = run.ws, run.start, run.steps
    s, c = ws.state.s, run.energy.couplings
    last = len(s) - 1
    staged = dict(zip(staged_layers(run.energy), ws.temp, strict=True))
    order = run.energy.graph.colouring  # a chain's: its odd layers h_1, h_3, ..., then its even ones
    ws.q_rows[start].copy_(s[last])
    for t in range(start, start + steps):
        q_now, q_new = ws.q_rows[t], ws.q_rows[t + 1]
        q_moved = False
        for k, half in enumerate(order):
            # From rest, the first half's neighbours (the other half) are still 0: the pulls from above vanish (for a
            # conv chain, the transposed convolution of the first layer, the costliest operator of a step).
            rest = run.at_rest and t == start and k == 0
            boxed = []  # the layers of this half written in place, clamped together
            for j in half:
                if j == last:
                    run.q_step(run, s[last - 1], q_now, q_new)
                    q_now, q_moved = q_new, True  # the other half's h_M reads the new q
                    continue
                above = s[j + 1] if j + 1 < last else q_now
                out = staged.get(j, s[j])
                if run.replicas > 1 and t == start:
                    # The nudged phases start as copies of s0 and only q's step sees the nudge: in their first step
                    # every pull not from the moved q is the same in each block, formed once on the first block's
                    # rows (a conv chain: its first layer's transposed conv and the conv above it, on 1/k the rows).
                    from_q = j + 1 == last and q_moved
                    first_block_pulls(c, s, ws.drive, j, above, out, not (rest or from_q), run.replicas)
                    if from_q:
                        c[last].add_down(q_now, s[j], out)
                    if run.reads is not None:
                        run.reads.pop(j + 1, None)  # layer j changes (nothing was read on these rows alone)
                else:
                    layer_pulls(c, s, ws.drive, j, above, out, not rest, run.reads)
                if out is s[j]:
                    boxed.append(out)
                else:
                    torch.clamp(out, 0.0, 1.0, out=s[j])  # the clamp is the copy back
            if len(boxed) == 1:
                boxed[0].clamp_(0.0, 1.0)
            elif boxed:
                torch._foreach_clamp_min_(boxed, 0.0)
                torch._foreach_clamp_max_(boxed, 1.0)
    record_speeds(run)


def readout_nudge(ws: Workspace, fold: FoldedFrame, one_hot: bool) -> None:
    """Adds the readout's pull at the old q to ws.dq: beta_col sum_k w_k (qA - C_k), w_k = (mask_k pi_k / p_y - pi_k)
    / spd_k, from ws.y and ws.qa (beta_col carries -beta beta_r R_sc, see `set_nudge_scale`)."""
    rspd = ws.rspd
    torch.bmm(ws.y_rows, ws.y_cols, out=ws.ny_batch)  # |y|^2 into ny (one operator; a norm and its square are two)
    torch.addmm(ws.ny, ws.y1, fold.yc2, out=rspd)  # |y|^2 + |yc|^2 + eps - 2 y.yc
    rspd.clamp_(min=0.0).rsqrt_()  # 1 / spd(q - c_k); the clamp guards rounding
    torch.addcdiv(fold.bias, fold.neg_scale, rspd, out=ws.logit)  # bias - beta_r R_sc spd
    torch._softmax(ws.logit, 1, False, out=ws.pi)
    if one_hot:
        torch.addcmul(ws.mask_beta, ws.pi, ws.neg_beta, out=ws.w).mul_(rspd)  # beta_col (mask - pi) / spd
    else:
        torch.mul(ws.pi, ws.target_mask, out=ws.w)
        torch.sum(ws.w, dim=1, keepdim=True, out=ws.py)
        # -beta_col (pi - mask pi / p_y) / spd: the same bits as beta_col (mask pi / p_y - pi) / spd, one operator fewer
        torch.addcdiv(ws.pi, ws.w, ws.py, value=-1.0, out=ws.w).mul_(rspd).mul_(ws.neg_beta)
    ws.dqs.addmm_(ws.w, fold.caug, alpha=-1.0)  # [dq | 0] += [-w C | sum w]
    ws.dq.addcmul_(ws.wsum, ws.qa)


def leapfrog_steps(run: PhaseRun) -> None:
    """Damped-leapfrog steps from ws.state (any dt, gamma, mass), chain or graph (each hidden layer kept in its box);
    nudged rows pull q by -beta dloss/dq."""
    ws, integ = run.ws, run.integ
    s, p, f = ws.state.s, ws.state.p, ws.force
    decay, kick, drift = 1.0 - integ.gamma * integ.dt, integ.dt, integ.dt / integ.mass
    last, boxes = len(s) - 1, run.energy.graph.boxes
    drive = ws.drive if run.energy.graph.is_chain else ws.drives
    for t in range(run.start, run.start + run.steps):
        forces(s, drive, run.energy, f)
        if run.clamp:  # q's momentum was zeroed with the clamp (`clamp_output`), so q stays
            f[last].zero_()
        elif run.nudged:
            if run.force is None:
                readout_force(s[last], run.frame, ws.target_mask, ws.readout, ws.gnudge)
            else:
                run.force(s[last], ws.gnudge)
            f[last].addcmul_(ws.gnudge, ws.beta_col)
        for i in range(len(s)):
            p[i].mul_(decay).add_(f[i], alpha=kick)
            s[i].add_(p[i], alpha=drift)
            if i < last:
                s[i].clamp_(*boxes[i])
        # v = (q_t - q_{t-1}) / dt = p_q / mass (q is never clamped); spd = |v L^T, sqrt(eps)|.
        torch.addmm(run.fold.c, p[last], run.fold.lt, alpha=1.0 / integ.mass, out=ws.zv)
        torch.linalg.vector_norm(ws.zv, dim=1, out=ws.spd_rows[t])


def set_nudge_scale(ws: Workspace, fold: FoldedFrame, integ: Integrator, folded: bool = True) -> None:
    """Per batch, after the target mask: the factor of each row's q nudge. The folded fixed-point pull (the retrieval
    cost's, `folded`) lacks beta_r R_sc (so beta_col = -beta * beta_r * R_sc, folded into its weights with mask_beta
    and neg_beta); the leapfrog and a cost's force add beta_col * dloss/dq (beta_col = -beta)."""
    if integ.fixed_point and folded:
        torch.mul(ws.beta_sign, fold.neg_scale, out=ws.beta_col)
        torch.mul(ws.target_mask, ws.beta_col, out=ws.mask_beta)
        torch.neg(ws.beta_col, out=ws.neg_beta)
    else:
        torch.neg(ws.beta_sign, out=ws.beta_col)


def phase_function(integ: Integrator) -> PhaseFn:
    """The integrator's steps, chosen once per run."""
    if integ.even_odd:
        return even_odd_steps
    return fixed_point_steps if integ.fixed_point else leapfrog_steps


def clamp_output(ws: Workspace) -> None:
    """Per batch, for the clamping rules: each row's q (the free equilibrium's q0) moved to q0 + b (target - q0), b its
    block's strength (beta_sign: 1 for CHL, +-eta for coupled learning), and q's momentum zeroed, so q stays there."""
    q = ws.state.s[-1]
    q.addcmul_(torch.sub(ws.target, q, out=ws.gnudge), ws.beta_sign)
    if ws.state.p:
        ws.state.p[-1].zero_()
