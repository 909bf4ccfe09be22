"""A window's metric sums (trainer2.learning.update.Updater.apply: the loss, the correct predictions, the dropped flag,
the window's observables, the update's norm per parameter group, the non-finite flag) added in two Triton launches
where the torch operators take 13: partial sums over the flat buffers by many programs, then one program that adds
them up in a fixed order, with the batch's loss and argmax, into the metric sums. It runs beside the fused update.

Its torch reference is Updater.window_metrics, the dict Updater.apply adds without it; tests/test_window_metrics.py
compares the two: the counts, the correct predictions and the flags equal, the sums within rounding (another order
of addition).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from trainer2.physics.kernels.chain import row_major, sized, sqrt_ieee

BLOCK = 4096  # flat elements per step of a partial-sums program
MAX_PARTS = 1024  # at most this many programs of partial sums, which the metrics program adds up
ROWS = 32  # batch rows per step of the metrics program
# The metric sums this kernel adds, in this order of its slot argument (MetricSums keeps its own order).
SLOTS = (
    "windows",
    "examples",
    "loss_sum",
    "correct_sum",
    "dropped",
    "lior_mean",
    "spd_mean",
    "spd_last",
    "R_mean",
    "lior_nudge",
    "spd_last_nudge",
    "update_norm_energy",
    "update_norm_readout",
    "update_norm_embed",
    "nonfinite_params",
)


@triton.jit
def partial_sums_kernel(
    step_ptr, flat_ptr, parts_ptr, n, per_program, e_lo, e_hi, r_lo, r_hi, m_lo, m_hi, BLOCK: tl.constexpr
):
    """parts[pid] = (the squares of the update's energy, readout and embedding elements, the parameters' sum) over the
    elements [pid * per_program, (pid + 1) * per_program); NaN and inf carry through, as in torch's sums."""
    pid = tl.program_id(0)
    dt = flat_ptr.dtype.element_ty
    energy = tl.zeros([BLOCK], dtype=dt)
    readout = tl.zeros([BLOCK], dtype=dt)
    embed = tl.zeros([BLOCK], dtype=dt)
    total = tl.zeros([BLOCK], dtype=dt)
    for k in range(0, per_program, BLOCK):
        offs = pid * per_program + k + tl.arange(0, BLOCK)
        inside = offs < n
        s = tl.load(step_ptr + offs, mask=inside, other=0.0)
        sq = s * s
        energy += tl.where((offs >= e_lo) & (offs < e_hi), sq, 0.0)
        readout += tl.where((offs >= r_lo) & (offs < r_hi), sq, 0.0)
        embed += tl.where((offs >= m_lo) & (offs < m_hi), sq, 0.0)
        total += tl.load(flat_ptr + offs, mask=inside, other=0.0)
    tl.store(parts_ptr + pid * 4 + 0, tl.sum(energy, axis=0))
    tl.store(parts_ptr + pid * 4 + 1, tl.sum(readout, axis=0))
    tl.store(parts_ptr + pid * 4 + 2, tl.sum(embed, axis=0))
    tl.store(parts_ptr + pid * 4 + 3, tl.sum(total, axis=0))


@triton.jit
def first_argmax(p, cols, inside):
    """torch.argmax along axis 1 of a (ROWS, V) tile: the first maximum, or the first NaN where a row has one."""
    big = 2147483647
    nan = (p != p) & inside
    first_nan = tl.min(tl.where(nan, cols, big), axis=1)
    top = tl.max(tl.where(inside & ~nan, p, float("-inf")), axis=1)
    first_top = tl.min(tl.where(inside & (p == top[:, None]), cols, big), axis=1)
    return tl.where(first_nan < big, first_nan, first_top)


@triton.jit
def add_to(sums_ptr, slot_ptr, i, value):
    """sums[slot[i]] += value."""
    slot = tl.load(slot_ptr + i)
    tl.store(sums_ptr + slot, tl.load(sums_ptr + slot) + value)


@triton.jit
def window_metrics_kernel(
    sums_ptr,  # (M,) the metric sums, added to in place
    slot_ptr,  # (15,) int64: each of SLOTS' index in sums
    loss_ptr,  # (B,) per-example loss
    probs_ptr,  # (B, V) class probabilities, row-major
    target_ptr,  # (B,) int64 class ids
    ok_ptr,  # () 1 where the update was applied, 0 where it was dropped
    lior_ptr,
    spd_mean_ptr,
    spd_last_ptr,
    r_ptr,
    lior_nudge_ptr,
    spd_nudge_ptr,
    parts_ptr,  # (programs, 4) partial_sums_kernel's sums
    programs,
    B,
    V,
    V_PAD: tl.constexpr,
    ROWS: tl.constexpr,
    PARTS: tl.constexpr,
):
    """One program: the batch's loss sum and correct count, the partial sums added up, everything added to its slot."""
    dt = sums_ptr.dtype.element_ty
    loss = tl.zeros([ROWS], dtype=dt)
    correct = tl.zeros([ROWS], dtype=dt)
    cols = tl.arange(0, V_PAD)
    for r0 in range(0, B, ROWS):
        rows = r0 + tl.arange(0, ROWS)
        live = rows < B
        loss += tl.load(loss_ptr + rows, mask=live, other=0.0)
        inside = live[:, None] & (cols[None, :] < V)
        p = tl.load(probs_ptr + rows[:, None] * V + cols[None, :], mask=inside, other=0.0)
        pred = first_argmax(p, cols[None, :], inside)
        y = tl.load(target_ptr + rows, mask=live, other=-1)
        correct += tl.where(live & (pred.to(tl.int64) == y), 1.0, 0.0)
    k = tl.arange(0, PARTS)
    mine = k < programs
    energy = tl.sum(tl.load(parts_ptr + k * 4 + 0, mask=mine, other=0.0), axis=0)
    readout = tl.sum(tl.load(parts_ptr + k * 4 + 1, mask=mine, other=0.0), axis=0)
    embed = tl.sum(tl.load(parts_ptr + k * 4 + 2, mask=mine, other=0.0), axis=0)
    total = tl.sum(tl.load(parts_ptr + k * 4 + 3, mask=mine, other=0.0), axis=0)
    one = tl.full([], 1.0, dt)
    add_to(sums_ptr, slot_ptr, 0, one)
    add_to(sums_ptr, slot_ptr, 1, one * B)
    add_to(sums_ptr, slot_ptr, 2, tl.sum(loss, axis=0))
    add_to(sums_ptr, slot_ptr, 3, tl.sum(correct, axis=0))
    add_to(sums_ptr, slot_ptr, 4, one - tl.load(ok_ptr))
    add_to(sums_ptr, slot_ptr, 5, tl.load(lior_ptr))
    add_to(sums_ptr, slot_ptr, 6, tl.load(spd_mean_ptr))
    add_to(sums_ptr, slot_ptr, 7, tl.load(spd_last_ptr))
    add_to(sums_ptr, slot_ptr, 8, tl.load(r_ptr))
    add_to(sums_ptr, slot_ptr, 9, tl.load(lior_nudge_ptr))
    add_to(sums_ptr, slot_ptr, 10, tl.load(spd_nudge_ptr))
    add_to(sums_ptr, slot_ptr, 11, sqrt_ieee(energy))
    add_to(sums_ptr, slot_ptr, 12, sqrt_ieee(readout))
    add_to(sums_ptr, slot_ptr, 13, sqrt_ieee(embed))
    # NaN or inf anywhere in the parameters carries through their sum, and sum * 0 is NaN exactly then
    add_to(sums_ptr, slot_ptr, 14, tl.where(total * 0.0 == 0.0, 0.0, 1.0).to(dt))


def fits(classes: int) -> bool:
    """The metrics program holds ROWS rows of the class probabilities padded to a power of two: at most 2,048 classes
    (256 KiB of float32 a step)."""
    return classes <= 2048


class WindowMetrics:
    """`kernel(sums, loss, probs, targets, ok, stats, step, flat)`: adds one window's metrics to the sums (the
    MetricSums tensor, slots by name in `slots`). The update's norm of a group absent from `spans` is 0. Allocates
    nothing and reads nothing back, so a CUDA graph captures it; `launches` counts the launches (a Python int)."""

    def __init__(self, flat: Tensor, spans: dict[str, slice], slots: dict[str, int], classes: int) -> None:
        self.n, self.dtype, self.classes = flat.numel(), flat.dtype, classes
        self.per_program = BLOCK * triton.cdiv(triton.cdiv(self.n, MAX_PARTS), BLOCK)
        self.programs = triton.cdiv(self.n, self.per_program)
        self.parts = flat.new_zeros(self.programs, 4)
        self.slots = torch.tensor([slots[k] for k in SLOTS], dtype=torch.int64, device=flat.device)
        groups = [spans.get(g, slice(0, 0)) for g in ("energy", "readout", "embed")]  # an absent group: no elements
        self.spans = [bound for span in groups for bound in (span.start, span.stop)]
        self.v_pad = triton.next_power_of_2(max(classes, 2))
        self.launches = 0

    def __call__(
        self,
        sums: Tensor,
        loss: Tensor,
        probs: Tensor,
        targets: Tensor,
        ok: Tensor,
        stats: tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor],
        step: Tensor,
        flat: Tensor,
    ) -> None:
        batch = loss.shape[0]
        row_major(sums, loss, probs, step, flat)
        sized(
            self.dtype,
            loss=(loss, (batch,)),
            probs=(probs, (batch, self.classes)),
            ok=(ok, ()),
            step=(step, (self.n,)),
            flat=(flat, (self.n,)),
            **{f"stats[{i}]": (s, ()) for i, s in enumerate(stats)},
        )
        sized(torch.int64, targets=(targets, (batch,)))
        n, per = self.n, self.per_program
        partial_sums_kernel[(self.programs,)](step, flat, self.parts, n, per, *self.spans, BLOCK=BLOCK)
        window_metrics_kernel[(1,)](
            sums,
            self.slots,
            loss,
            probs,
            targets,
            ok,
            *stats,
            self.parts,
            self.programs,
            batch,
            self.classes,
            V_PAD=self.v_pad,
            ROWS=ROWS,
            PARTS=MAX_PARTS,
        )
        self.launches += 2
