"""What every coupling of the energy provides: the interface the window, the machine and the learning rule use.

A coupling joins the layer below it (the clamped input, or a state layer) to the layer above and adds one term
to the energy. It owns its parameters (by name), its share of each neighbour's drive, its term of the energy,
its EP gradient and its stability constraint. Layers are (R, size) row blocks whose `shape` a coupling may
view differently (a (C, H, W) image layer is (R, C*H*W) in the workspace). Every method that writes takes an
`out`, so a window allocates nothing.

A coupling of your own is a class with these members (subclassing trainer2.Dense or trainer2.Conv is the short way),
named in the config by its dotted path: `layers: [{my_couplings.WideDense: 64}]`, `--layers my_couplings.WideDense:64`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, Protocol

import torch
from torch import Tensor

Sides = tuple[Tensor, Tensor]  # (below, above): a coupling's two layers in one nudged phase
CLIP_SLACK = 1.02  # spectral_cap_mode clip: an update that lifts a norm over this x cap scales the coupling too


class Coupling(Protocol):
    """One interaction of the energy: E_c(below, above), with analytic derivatives in both layers."""

    kind: ClassVar[str]  # the name the config's `layers` entries and the registry use ("dense")
    name: str  # its parameters are named <P>_<name> (W_1, b_1, ..., W_out, b_out)
    below_shape: tuple[int, ...]
    above_shape: tuple[int, ...]

    @staticmethod
    def spec_size(spec: object, below: tuple[int, ...] | None = None) -> tuple[int, ...]:
        """The shape of the layer a `{kind: spec}` entry makes above a layer of shape `below` ((D,) flat, (C, H, W) an
        image); without `below`, only the spec is checked. A spec that cannot work is a ValueError saying why."""

    @classmethod
    def init(
        cls, name: str, below: tuple[int, ...], spec: object, scale: float, gen: torch.Generator, dtype: torch.dtype
    ) -> "Coupling":
        """A new coupling from the layer of shape `below` to the one `spec` makes, its random parameters drawn from
        `gen` (scale multiplies their initial size; the coupling into q gets out_init_scale)."""

    @classmethod
    def param_count(cls, below: tuple[int, ...], spec: object) -> int:
        """How many numbers a coupling of this spec learns above a layer of shape `below` (before it is built)."""

    @classmethod
    def workspace_bytes(cls, below: tuple[int, ...], spec: object, rows: int, itemsize: int) -> int:
        """Bytes its operations (pulls, EP statistic) allocate beyond the workspace at their peak, over `rows` rows of
        `itemsize`-byte numbers: trainer2.running.sizes adds it to the workspace before anything is built."""

    def parameters(self) -> dict[str, Tensor]:
        """Its learned tensors by name, in the one parameter order."""

    def decayed(self) -> frozenset[str]:
        """The names of its parameters that weight decay applies to."""

    def rebind(self, named: dict[str, Tensor]) -> "Coupling":
        """The same coupling over other tensors (views of the machine's flat buffer), taken by name."""

    def up(self, below: Tensor, out: Tensor) -> Tensor:
        """out (R, above) = -dE_c/d above, the pull of `below` (R, below) on the layer above (bias included)."""

    def add_up(self, below: Tensor, out: Tensor) -> Tensor:
        """out += the pull of `below` on the layer above, without the bias (the bias is folded elsewhere)."""

    def add_up_linear(self, below: Tensor, at: Tensor, out: Tensor) -> Tensor:
        """out += the pull on the layer above linearised where the layer below is `at`, applied to `below`, without the
        bias: add_up itself for a bilinear term; max pooling keeps the argmax of `at` (recurrent backprop's adjoint)."""

    def down(self, above: Tensor, below: Tensor, base: Tensor, out: Tensor) -> Tensor:
        """out (R, below) = base + -dE_c/d below, the pull of `above` on the layer below, whose current value is
        `below`: a term that is not bilinear (max pooling) reads it, and then out must be another tensor."""

    def add_down(self, above: Tensor, below: Tensor, out: Tensor) -> Tensor:
        """out += the pull of `above` (R, above) on the layer below, whose current value is `below`."""

    @property
    def down_reads_below(self) -> bool:
        """Whether the pull on the layer below reads that layer's own value (max pooling): a step that moves the layer
        below must then form that pull before it overwrites the layer. Such a coupling may also provide
        `up_reading(below, out) -> read` (up, returning what the pull on the layer below reads of `below`) and
        `add_down_read(above, read, out)` (add_down from it): the even/odd step then forms that read once, in the up
        pull, not again in the pull down (Conv: the argmax of its max pooling)."""

    @property
    def bias(self) -> Tensor:
        """(above,) the constant part of its pull on the layer above."""

    def energy(self, below: Tensor, above: Tensor) -> Tensor:
        """E_c per example (R,); for tests and diagnostics, not the hot loop."""

    def ep_grads(self, plus: Sides, minus: Sides, scale: float, at: Tensor | None = None) -> dict[str, Tensor]:
        """The EP statistic scale * (dE_c/dtheta(s+) - dE_c/dtheta(s-)), summed over rows, per parameter name; plus and
        minus are (below, above) of the two nudged equilibria. A piecewise term (max pooling, down_reads_below) takes
        both on the piece of `at`, the layer below at the free equilibrium, or with None each on its own (CHL;
        `maxpool_argmax: own`); a bilinear one is never handed `at`, so it may take three arguments."""

    def ep_grads_clamped(
        self, x: Tensor, plus: Tensor, minus: Tensor, scale: float, input_grad: bool = True
    ) -> tuple[dict[str, Tensor], Tensor | None]:
        """As ep_grads for a coupling whose layer below is the clamped input x (the same in both phases), and the
        per-example gradient with respect to x (R, below), or None when input_grad is False (nothing learns x)."""

    @property
    def power_size(self) -> int:
        """Length of the persistent vector of its spectral cap's power iteration."""

    def cap_exact(self, cap: float) -> None:
        """Scale the coupling so its operator norm is at most `cap` (exact; at build, once)."""

    def cap_power(self, cap: Tensor | float, u: Tensor, clip: bool = False) -> None:
        """Bring the coupling's operator norm, estimated by two power-iteration steps from u, to at most cap: scaled
        (`bring_under_cap`), or with clip the excess taken off its top singular direction (handed only under
        spectral_cap_mode clip, so a coupling written without `clip` still caps by scaling). u is updated in place.
        On the device, no host sync."""


def bring_under_cap(weight: Tensor, sigma: Tensor, cap: Tensor | float, top: Tensor | None = None) -> None:
    """Bring a coupling whose linear part has operator norm sigma (0-dim, estimated) under `cap`, in place, no host
    sync. top None: scale the weight by cap / sigma. top = d sigma / d weight (the top singular pair's correlation):
    take the excess off that direction (the first-order projection, the smallest step that lowers sigma to cap) and
    leave the others; only where the update lifted sigma over CLIP_SLACK x cap is the whole weight then scaled by
    CLIP_SLACK x cap / sigma as well, which keeps every other direction under CLIP_SLACK x cap too."""
    if top is None:
        weight.mul_(torch.div(cap, sigma).clamp_(max=1.0))
        return
    excess = torch.sub(sigma, cap).clamp_(min=0.0)
    weight.sub_(top.mul_(excess / top.square().sum().clamp_(min=torch.finfo(top.dtype).tiny)))
    weight.mul_(torch.div(cap * CLIP_SLACK, sigma).clamp_(max=1.0))


def power_step(
    u: Tensor, adjoint: Callable[[Tensor], Tensor], forward: Callable[[Tensor], Tensor]
) -> tuple[Tensor, Tensor]:
    """One power-iteration step on an operator L given as its forward and adjoint over (1, size) rows: u <- L L^T u /
    |L L^T u| in place; returns (sigma, v), v = L^T u / |L^T u|, sigma = |L v| = u^T L v (the conv couplings')."""
    v = adjoint(u.view(1, -1)).reshape(-1)
    v.div_(torch.linalg.vector_norm(v).clamp_min_(1e-12))
    u.copy_(forward(v.view(1, -1)).flatten())
    sigma = torch.linalg.vector_norm(u).clamp_min_(1e-12)
    u.div_(sigma)
    return sigma, v


def cap_by_iteration(
    weight: Tensor, size: int, step: Callable[[Tensor], tuple[Tensor, Tensor]], cap: float, iters: int
) -> None:
    """Scale `weight` so its operator's norm, found by `iters` steps of `step` from a fixed random u (size,), is at most
    `cap` (at build, once: an operator too big to factor)."""
    gen = torch.Generator().manual_seed(0)
    u = torch.randn(size, generator=gen, dtype=weight.dtype).to(weight.device)
    for _ in range(iters):
        sigma, _ = step(u)
    norm = float(sigma)
    if norm > cap:
        weight.mul_(cap / norm)
