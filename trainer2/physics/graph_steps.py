"""The fixed-point steps of an energy that is a graph, not a chain (skip and residual couplings: physics.graph).

Every hidden layer moves to box(its pulls), the sum over the couplings it touches (`energy.graph_pulls`), and q to its
pull from the head's layer (nudged: plus the readout's pull, as the chain's steps). In even/odd order the layers move
in the groups of the graph's colouring, each from the latest values of the others: no two layers of a group are
coupled, so each group's move is the exact minimiser of E in its layers (block coordinate descent), written in place;
a chain's colouring is its odd and even layers. In Jacobi order every layer moves from the previous state, through
temp buffers. A layer whose coupling above reads its value (max pooling) is staged through a temp buffer in either
order. Allocation-free, no host sync, no branch on a tensor value: a window captures as one CUDA graph, as a chain's.
A chain keeps its own steps (trainer2.physics.dynamics), which fuse what a graph cannot.
"""

from __future__ import annotations

import torch
from torch import Tensor

from trainer2.physics.dynamics import PhaseRun, record_speeds
from trainer2.physics.energy import Energy, graph_pulls


def staged_graph_layers(e: Energy, even_odd: bool) -> list[int]:
    """The hidden layers a graph's step writes through a temp buffer: all of them in Jacobi order (each reads the old
    values of its neighbours), in even/odd order only those a coupling above reads (max pooling)."""
    g = e.graph
    return [j for j in range(g.last) if not even_odd or any(e.couplings[k].down_reads_below for k in g.out_of[j])]


def graph_steps(run: PhaseRun) -> None:
    """Fixed-point steps start .. start + steps - 1 over a graph energy, by colour groups (even/odd) or all at once
    (Jacobi); q_t is kept in ws.q_rows[t], and the steps' spd is formed after the loop as the chain's."""
    ws, e, start = run.ws, run.energy, run.start
    g, s = e.graph, ws.state.s
    last, top = g.last, s[g.edges[g.head][0]]  # top: the layer the head reads
    groups = g.colouring if run.integ.even_odd else (tuple(range(last + 1)),)
    staged = dict(zip(staged_graph_layers(e, run.integ.even_odd), ws.temp, strict=True))
    drives = dict(zip(g.driven, ws.drives, strict=True))
    boxes = g.boxes
    q_now: list[Tensor] = [ws.q_rows[start]]  # the q the other layers read: the newest one a group has made

    def value(i: int) -> Tensor:
        return q_now[0] if i == last else s[i]

    q_now[0].copy_(s[last])
    for t in range(start, start + run.steps):
        q_now[0] = ws.q_rows[t]
        for group in groups:
            hidden = [j for j in group if j != last]
            for j in hidden:
                graph_pulls(e, s, drives, j, value, staged.get(j, s[j]))
            if last in group:  # after the group's other layers, which (Jacobi) read the old q
                run.q_step(run, top, q_now[0], ws.q_rows[t + 1])
            for j in hidden:
                if j in staged:
                    torch.clamp(staged[j], *boxes[j], out=s[j])  # the clamp is the copy back
                else:
                    s[j].clamp_(*boxes[j])
            if last in group:
                q_now[0] = ws.q_rows[t + 1]
    record_speeds(run)
