"""The same machine written plainly with autograd: the reference the trainer's EP update is checked against.

Lives outside trainer2/ because it uses autograd. Relaxation is the same damped leapfrog from rest,
unrolled, so its gradient is the exact gradient of the loss at the (approximate) free equilibrium.
"""

from __future__ import annotations

import torch
from torch import Tensor

from trainer2.physics.couplings import Conv, Conv1d, Coupling, Dense
from trainer2.physics.energy import Energy, energy
from trainer2.physics.machine import Machine
from trainer2.physics.readout import rotor_layers, rotor_matrix


def leapfrog_step(
    s: list[Tensor],
    p: list[Tensor],
    force: list[Tensor],
    dt: float,
    gamma: float,
    mass: float,
    boxes: tuple[tuple[float, float], ...] | None = None,
) -> tuple[list[Tensor], list[Tensor]]:
    """One damped-leapfrog step of (positions, momenta) under `force`, the hidden layers boxed (to [0, 1], or each to
    its own box of a graph's `boxes`), q free."""
    p = [(1 - gamma * dt) * pi + dt * fi for pi, fi in zip(p, force)]
    s = [si + dt * pi / mass for si, pi in zip(s, p)]
    boxes = boxes or ((0.0, 1.0),) * (len(s) - 1)
    return [si.clamp(*boxes[i]) if i < len(s) - 1 else si for i, si in enumerate(s)], p


def groups(layers: int, order: str, colouring: tuple[tuple[int, ...], ...] | None = None) -> list[list[int]]:
    """The layers each part of a step moves: all at once (jacobi), or the odd layers h_1, h_3, ... (list indices 0, 2,
    ...) and then the even ones (even_odd; a graph's colour groups, written here independently of the trainer's
    steps, when `colouring` is given)."""
    if order == "jacobi":
        return [list(range(layers))]
    if colouring is not None:
        return [list(group) for group in colouring]
    return [list(range(0, layers, 2)), list(range(1, layers, 2))]


def partial_step(
    s: list[Tensor],
    p: list[Tensor],
    force: list[Tensor],
    dt: float,
    gamma: float,
    mass: float,
    group: list[int],
    boxes: tuple[tuple[float, float], ...] | None = None,
) -> tuple[list[Tensor], list[Tensor]]:
    """leapfrog_step for the layers in `group`; the others keep their positions and momenta."""
    s_new, p_new = leapfrog_step(s, p, force, dt, gamma, mass, boxes)
    return [s_new[i] if i in group else s[i] for i in range(len(s))], [
        p_new[i] if i in group else p[i] for i in range(len(p))
    ]


def relax(
    x: Tensor,
    weights: list[Tensor],
    biases: list[Tensor],
    steps: int,
    dt: float,
    gamma: float,
    mass: float,
    order: str = "jacobi",
) -> list[Tensor]:
    """Unrolled damped leapfrog on the layered energy from s = p = 0, every layer at once or in even/odd order;
    returns the final state [h_1.., q]."""
    s = [torch.zeros(x.shape[0], w.shape[0], dtype=x.dtype) for w in weights]
    p = [torch.zeros_like(t) for t in s]
    for _ in range(steps):
        for group in groups(len(s), order):
            below = [x, *s[:-1]]
            force = []
            for i in range(len(s)):
                f = -s[i] + below[i] @ weights[i].T + biases[i]
                if i + 1 < len(s):
                    f = f + s[i + 1] @ weights[i + 1]
                force.append(f)
            s, p = partial_step(s, p, force, dt, gamma, mass, group)
    return s


def readout_loss(
    q: Tensor,
    targets: Tensor,
    g_diag: Tensor,
    theta: Tensor,
    protos: Tensor,
    r_sc: Tensor,
    machine: Machine,
    beta_r: float,
    eps: float,
) -> Tensor:
    """Per-example -log p_y with explicit (B, V, n) differences and log_softmax."""
    rot = rotor_matrix(rotor_layers(theta, machine.layout))
    z = (q[:, None, :] - protos[None]) @ rot.T
    cost = r_sc * torch.sqrt((g_diag * z * z).sum(-1) + eps)
    return -torch.log_softmax(-beta_r * cost, dim=1).gather(1, targets[:, None]).squeeze(1)


def cost_loss(
    q: Tensor, targets: Tensor, leaves: dict[str, Tensor], machine: Machine, beta_r: float, eps: float, cost: str
) -> Tensor:
    """Per-example loss of a cost (trainer2.physics.costs) written plainly: retrieval's readout_loss, mse's
    1/2 |q - c_y|^2 (the codes held fixed: no gradient reaches them), cross_entropy's -log softmax(-R/2 |q - c|^2)_y."""
    protos = leaves["protos"]
    if cost == "mse":
        return 0.5 * ((q - protos.detach()[targets]) ** 2).sum(1)
    if cost == "cross_entropy":
        logits = -0.5 * leaves["r_sc"] * ((q[:, None, :] - protos[None]) ** 2).sum(-1)
        return -torch.log_softmax(logits, dim=1).gather(1, targets[:, None]).squeeze(1)
    return readout_loss(q, targets, leaves["g_diag"], leaves["theta"], protos, leaves["r_sc"], machine, beta_r, eps)


def exact_grads(
    machine: Machine,
    inputs: Tensor,
    targets: Tensor,
    steps: int,
    dt: float,
    gamma: float,
    mass: float,
    beta_r: float,
    eps: float,
    order: str = "jacobi",
    cost: str = "retrieval",
    forces: str = "energy",
) -> tuple[dict[str, Tensor], Tensor]:
    """Autograd gradient of the batch-mean loss (of `cost`, `cost_loss`) at the free equilibrium for every named
    parameter, and the loss; the free window unrolled in the trainer's order. A machine with couplings other than
    dense (a conv machine on images) goes through `exact_grads_energy`, with `forces` as relax_energy's."""
    if any(c.kind != "dense" for c in machine.energy.couplings) or not machine.energy.graph.is_chain:
        return exact_grads_energy(machine, inputs, targets, steps, dt, gamma, mass, beta_r, eps, order, cost, forces)
    names = list(machine.named_params())
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in machine.named_params().items()}
    with torch.enable_grad():
        # feature and image rows in the machine's dtype (they load as float32; a float64 reference needs them so)
        x = leaves["emb"][inputs].flatten(1) if "emb" in leaves else machine.input_vectors(inputs)
        last = len(machine.energy.weights) - 1
        tags = [("out" if i == last else str(i + 1)) for i in range(last + 1)]
        weights, biases = [leaves[f"W_{t}"] for t in tags], [leaves[f"b_{t}"] for t in tags]
        s = relax(x, weights, biases, steps, dt, gamma, mass, order)
        loss = cost_loss(s[-1], targets, leaves, machine, beta_r, eps, cost).mean()
        grads = torch.autograd.grad(loss, [leaves[n] for n in names], allow_unused=True)
    return {n: (torch.zeros_like(leaves[n]) if g is None else g) for n, g in zip(names, grads)}, loss.detach()


def cosine(a: Tensor, b: Tensor) -> float:
    return float((a.flatten() @ b.flatten()) / (a.norm() * b.norm()).clamp_min(1e-30))


def relax_energy(
    x: Tensor,
    e: Energy,
    steps: int,
    dt: float,
    gamma: float,
    mass: float,
    order: str = "jacobi",
    forces: str = "energy",
) -> list[Tensor]:
    """As `relax` for a chain of any couplings. forces "energy": autograd's -dE/ds of the energy as the couplings
    write it (`energy`), so the pulls the trainer uses are not involved; "pulls": the built-in couplings' own pulls
    (`pull_forces`; other couplings' forces as "energy"), the same forces without a double backward (tests check the
    two against each other)."""
    if forces not in ("energy", "pulls"):
        raise ValueError(f"forces is 'energy' or 'pulls', got {forces!r}")
    pulls = forces == "pulls" and has_pulls(e)  # a coupling of the user's: its energy's forces
    chain = e.graph.is_chain
    colouring = None if chain else tuple(greedy_colouring(e))
    boxes = None if chain else e.graph.boxes
    s = [torch.zeros(x.shape[0], h, dtype=x.dtype) for h in e.state_sizes()]
    p = [torch.zeros_like(t) for t in s]
    for _ in range(steps):
        for group in groups(len(s), order, colouring):
            if pulls:
                s, p = partial_step(s, p, pull_forces(s, x, e, group), dt, gamma, mass, group, boxes)
                continue
            # the partial derivative in the moving layers at the current state: taken at fresh copies of them, since
            # the other layers were computed from their values (else autograd returns a total derivative, and under
            # three or more colour groups its graph grows exponentially with the steps)
            at = [t.clone() if i in group else t for i, t in enumerate(s)]
            at = [t if t.requires_grad else t.requires_grad_(True) for t in at]
            # only the moving layers' forces: the others' would be computed and dropped (half of them under even/odd)
            pulled = torch.autograd.grad(energy(at, x, e).sum(), [at[i] for i in group], create_graph=True)
            force = [torch.zeros_like(t) for t in s]
            for i, g in zip(group, pulled):
                force[i] = -g
            s, p = partial_step(s, p, force, dt, gamma, mass, group, boxes)
    return s


def greedy_colouring(e: Energy) -> list[tuple[int, ...]]:
    """A graph energy's state layers in groups no two of which are coupled, lowest layer first, from its edges (the
    reference's own colouring, not the trainer's)."""
    layers = len(e.state_sizes())
    coupled = {(b, a) for b, a in e.graph.edges if b >= 0} | {(a, b) for b, a in e.graph.edges if b >= 0}
    colour: dict[int, int] = {}
    for j in range(layers):
        colour[j] = min(set(range(layers)) - {colour[i] for i in colour if (i, j) in coupled})
    return [tuple(j for j in range(layers) if colour[j] == c) for c in sorted(set(colour.values()))]


def pull_forces(s: list[Tensor], x: Tensor, e: Energy, group: list[int]) -> list[Tensor]:
    """-dE/ds_j = -s_j + (pulls from below) + (pulls from above) for the layers in `group` (zeros elsewhere), from the
    dense and conv couplings' pulls written with autograd (`up`, `down`: the arithmetic of the trainer's pulls), over
    the energy's edges (a chain's: coupling j from layer j - 1, coupling j + 1 from layer j + 1)."""
    force = [torch.zeros_like(t) for t in s]
    for j in group:
        force[j] = -s[j]
        for (b, a), c in zip(e.graph.edges, e.couplings):
            if a == j:
                force[j] = force[j] + up(c, x if b < 0 else s[b])
            elif b == j:
                force[j] = force[j] + down(c, s[a], s[j])
    return force


def has_pulls(e: Energy) -> bool:
    """Whether every coupling is a built-in dense or conv one (a subclass may change its energy), so `up` and `down`
    are its pulls."""
    return all(type(c) in (Dense, Conv, Conv1d) for c in e.couplings)


def up(c: Coupling, below: Tensor) -> Tensor:
    """The pull of `below` (R, size) on the layer above, W below + b (a conv: pooled convolution), as (R, size)."""
    if type(c) is Conv:
        return c.apply(below, c.bias_).reshape(below.shape[0], -1)
    if type(c) is Dense:
        return below @ c.weight.T + c.bias_
    if type(c) is Conv1d:
        return c.apply(below, c.bias_).reshape(below.shape[0], -1)
    raise TypeError(f"the autograd reference writes the dense, conv and conv1d pulls, not {type(c).__qualname__}'s")


def down(c: Coupling, above: Tensor, below: Tensor) -> Tensor:
    """The pull of `above` (R, size) on the layer below, W^T above (a conv: L^T above, under max pooling `above` first
    unpooled at the argmax of conv_K(below)), as (R, size)."""
    if type(c) is Conv:
        with torch.no_grad():  # integer positions: no gradient flows through them, so record no graph
            where = c.argmax(below) if c.maxpool else None
        return c.transpose(above, where).reshape(above.shape[0], -1)
    if type(c) is Dense:
        return above @ c.weight
    if type(c) is Conv1d:
        return c.transpose(above)
    raise TypeError(f"the autograd reference writes the dense, conv and conv1d pulls, not {type(c).__qualname__}'s")


def exact_grads_energy(
    machine: Machine,
    x: Tensor,
    targets: Tensor,
    steps: int,
    dt: float,
    gamma: float,
    mass: float,
    beta_r: float,
    eps: float,
    order: str = "jacobi",
    cost: str = "retrieval",
    forces: str = "energy",
) -> tuple[dict[str, Tensor], Tensor]:
    """As `exact_grads` for a feature or image machine (x (B, D) clamped) whose couplings may be of any kind: the
    gradients and the batch-mean loss; `forces` as relax_energy's."""
    names = list(machine.named_params())
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in machine.named_params().items()}
    with torch.enable_grad():
        # a learned embedding's rows from its leaf; feature and image rows in the machine's dtype (they load as float32)
        x = leaves["emb"][x].flatten(1) if "emb" in leaves else machine.input_vectors(x)
        s = relax_energy(x, machine.energy.rebind(leaves), steps, dt, gamma, mass, order, forces)
        loss = cost_loss(s[-1], targets, leaves, machine, beta_r, eps, cost).mean()
        grads = torch.autograd.grad(loss, [leaves[n] for n in names], allow_unused=True)
    return {n: (torch.zeros_like(leaves[n]) if g is None else g) for n, g in zip(names, grads)}, loss.detach()
