"""Recurrent backprop (Almeida 1987, Pineda 1987): the exact gradient of the loss at the free equilibrium, from the
linear adjoint system of the fixed point, with the couplings' analytic transposes and the box's masks (no autograd).

The free equilibrium is the fixed point s = box(Phi(s)), Phi_j = the pulls of the couplings layer j touches (a
chain's: up_j(s_{j-1}) + b_j + down_{j+1}(s_{j+1}); q is not boxed). With D the mask of the hidden units strictly
inside their boxes at s0 (1 on q), K = dPhi/ds the couplings between
state layers (symmetric; max pooling linearised at s0's argmax) and g = dloss/ds (nonzero on q only), the adjoint solves
lambda = g + K D lambda, and with mu = D lambda

    dloss/dtheta = mu^T dPhi/dtheta:  mu_a b^T + a mu_b^T for a coupling from b (below) to a (above), mu_a for its bias

(the input's gradient is W_1^T mu_1 for a chain). The sweep mu <- D (g + K mu) from mu = 0 converges because the
spectral cap keeps |K| <= spectral_cap < 1; T sweeps are the first-order effect of a T-step nudged phase (which
moves s by -beta mu), so the adjoint takes nudge_steps sweeps, in the relaxation's order (Jacobi, or the graph's
colour groups: a chain's odd layers, then its even ones).

The gradient is the EP statistic of each coupling (`ep_grads`, `ep_grads_clamped`) at s0 - eps mu and s0 + eps mu,
scaled by 1/(2 eps): the eps^2 terms of a bilinear term cancel, so it is exact at any eps, and mu is normalised by its
largest entry so eps = 1 (every entry moves by at most 1, no loss of precision). Max pooling is bilinear on one piece,
and both sides take s0's (its argmax), so it is exact at eps = 1 too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from trainer2.physics.energy import Energy, ep_grads


@dataclass
class AdjointWorkspace:
    """mu (B, H_i) per state layer, Jacobi's next mu per layer (empty for even/odd, which writes in place), the mask D
    (B, H_i) per hidden layer and g = dloss/dq (B, n) at q0, all allocated once."""

    mu: list[Tensor]
    new: list[Tensor]
    mask: list[Tensor]
    g: Tensor

    @staticmethod
    def allocate(batch: int, sizes: list[int], like: Tensor, jacobi: bool) -> "AdjointWorkspace":
        def new(h: int) -> Tensor:
            return torch.zeros(batch, h, dtype=like.dtype, device=like.device)

        return AdjointWorkspace(
            [new(h) for h in sizes],
            [new(h) for h in sizes] if jacobi else [],
            [new(h) for h in sizes[:-1]],
            new(sizes[-1]),
        )


def set_masks(aw: AdjointWorkspace, s0: list[Tensor], e: Energy) -> None:
    """D from the free equilibrium: 1 where a hidden unit is strictly inside its box (a unit on a face stays there
    under a small change of the parameters), else 0. Per batch, outside the sweeps."""
    for m, s, (low, high) in zip(aw.mask, s0[:-1], e.graph.boxes, strict=True):
        torch.logical_and(s > low, s < high, out=m)


def adjoint_layer(e: Energy, s0: list[Tensor], aw: AdjointWorkspace, j: int, out: Tensor) -> None:
    """out = D_j (g_j + [K mu]_j): the pulls of mu through the couplings into layer j from state layers, linearised
    at s0, and through the transposes of the couplings from j to the layers above, at s0 (no biases, no input: both
    are constant in s). A chain's: mu_{j-1} through coupling j, mu_{j+1} through coupling j + 1."""
    g, c, mu, last = e.graph, e.couplings, aw.mu, len(aw.mu) - 1
    if j == last:  # q: not boxed, and the only layer the loss reaches
        out.copy_(aw.g)
    else:
        out.zero_()
    for k in g.into[j]:
        below = g.edges[k][0]
        if below >= 0:
            c[k].add_up_linear(mu[below], s0[below], out)
    for k in g.out_of[j]:
        c[k].add_down(mu[g.edges[k][1]], s0[j], out)
    if j != last:
        out.mul_(aw.mask[j])


def adjoint_steps(e: Energy, s0: list[Tensor], aw: AdjointWorkspace, steps: int, even_odd: bool) -> None:
    """`steps` sweeps mu <- D (g + K mu) from mu = 0: every layer from the previous mu (Jacobi, through aw.new), or
    the groups of the graph's colouring in turn (a chain's odd layers h_1, h_3, ... then its even ones), each in place:
    layers of one group do not read each other. Allocation-free for dense chains."""
    torch._foreach_zero_(aw.mu)
    last = len(aw.mu) - 1
    for _ in range(steps):
        if even_odd:
            for group in e.graph.colouring:
                for j in group:
                    adjoint_layer(e, s0, aw, j, aw.mu[j])
        else:
            for j in range(last + 1):
                adjoint_layer(e, s0, aw, j, aw.new[j])
            torch._foreach_copy_(aw.mu, aw.new)


def adjoint_grads(
    s0: list[Tensor], mu: list[Tensor], x: Tensor, e: Energy, batch: int, input_grad: bool = True
) -> tuple[dict[str, Tensor], Tensor | None]:
    """dloss/dtheta of every coupling parameter by name (batch mean, from per-example mu) and the per-example gradient
    in the clamped input x (B, D) (None without input_grad): each coupling's EP statistic at s0 -+ eps mu over 2 eps
    (module docstring). mu is scaled by its largest entry on the device: no host read."""
    size = torch.stack([t.abs().amax() for t in mu]).amax().clamp_min_(torch.finfo(s0[0].dtype).tiny)
    unit = [torch.div(t, size) for t in mu]

    lower = [torch.sub(s, u) for s, u in zip(s0, unit)]
    upper = [torch.add(s, u) for s, u in zip(s0, unit)]
    # a max-pooled term's both sides on s0's piece (at=s0): the statistic is then exact at any eps (eps = 1 here)
    grads, gx = ep_grads(lower, upper, x, e, 1.0 / (2 * batch), at=s0, input_grad=input_grad)
    for g in grads.values():
        g.mul_(size)
    return grads, None if gx is None else gx.mul_(size)
