"""A dense coupling: every unit of the layer above sees every unit of the layer below.

    E_c(below, above) = -above . (W below + b),   W (H_above, H_below), b (H_above,)

Rows are examples, so W below is below @ W^T. Its pulls are W below + b (on the layer above) and W^T above (on
the layer below); its EP statistic is the outer product of the two layers; its cap is the spectral norm of W.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch
from torch import Tensor

from trainer2.physics.couplings.coupling import Sides, bring_under_cap


@dataclass(frozen=True)
class Dense:
    """W_<name> (H_above, H_below) and b_<name> (H_above,); `wt` is W^T, a view made once."""

    kind: ClassVar[str] = "dense"  # the name the config's layers use
    name: str
    weight: Tensor
    bias_: Tensor
    wt: Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "wt", self.weight.T)

    @staticmethod
    def spec_size(spec: object, below: tuple[int, ...] | None = None) -> tuple[int, ...]:
        """The shape of the layer a `{dense: N}` entry of the config makes above any layer: (N,)."""
        if isinstance(spec, bool) or not isinstance(spec, int) or spec < 1:
            raise ValueError(f"a dense layer's size must be an integer >= 1, got {spec!r}")
        return (spec,)

    @classmethod
    def param_count(cls, below: tuple[int, ...], spec: object) -> int:
        """Numbers learned above a layer of shape `below`: W (N, prod(below)) and b (N,)."""
        (size,) = cls.spec_size(spec)
        return size * math.prod(below) + size

    @classmethod
    def workspace_bytes(cls, below: tuple[int, ...], spec: object, rows: int, itemsize: int) -> int:
        """Bytes allocated beyond the workspace at the peak of its operations over `rows` rows: the pulls write into
        the workspace; the EP statistic forms W-sized products (two at once) and an (rows, N) difference."""
        (size,) = cls.spec_size(spec)
        return itemsize * (2 * size * math.prod(below) + rows * size)

    @classmethod
    def init(
        cls, name: str, below: tuple[int, ...], spec: object, scale: float, gen: torch.Generator, dtype: torch.dtype
    ) -> "Dense":
        """Uniform(+-scale/sqrt(fan_in)) weights, zero bias; a (C, H, W) layer below is seen flat."""
        fan_in, fan_out = math.prod(below), math.prod(cls.spec_size(spec))
        bound = 1.0 / math.sqrt(fan_in) * scale
        weight = (torch.rand(fan_out, fan_in, generator=gen, dtype=dtype) * 2 - 1) * bound
        return cls(name, weight, torch.zeros(fan_out, dtype=dtype))

    @property
    def below_shape(self) -> tuple[int, ...]:
        return (self.weight.shape[1],)

    @property
    def above_shape(self) -> tuple[int, ...]:
        return (self.weight.shape[0],)

    @property
    def bias(self) -> Tensor:
        return self.bias_

    def parameters(self) -> dict[str, Tensor]:
        return {f"W_{self.name}": self.weight, f"b_{self.name}": self.bias_}

    def decayed(self) -> frozenset[str]:
        return frozenset({f"W_{self.name}"})

    def rebind(self, named: dict[str, Tensor]) -> "Dense":
        return replace(self, weight=named[f"W_{self.name}"], bias_=named[f"b_{self.name}"])

    # --- pulls (the fixed-point sweep and the forces) ---

    def up(self, below: Tensor, out: Tensor) -> Tensor:
        return torch.addmm(self.bias_, below, self.wt, out=out)

    def add_up(self, below: Tensor, out: Tensor) -> Tensor:
        return out.addmm_(below, self.wt)

    def add_up_linear(self, below: Tensor, at: Tensor, out: Tensor) -> Tensor:
        return self.add_up(below, out)  # bilinear: the pull is its own linearisation

    def down(self, above: Tensor, below: Tensor, base: Tensor, out: Tensor) -> Tensor:
        return torch.addmm(base, above, self.weight, out=out)  # bilinear: the pull does not depend on below

    def add_down(self, above: Tensor, below: Tensor, out: Tensor) -> Tensor:
        return out.addmm_(above, self.weight)

    @property
    def down_reads_below(self) -> bool:
        return False  # bilinear

    def energy(self, below: Tensor, above: Tensor) -> Tensor:
        return -(above * (below @ self.weight.T + self.bias_)).sum(1)

    # --- learning ---

    def ep_grads(self, plus: Sides, minus: Sides, scale: float, at: Tensor | None = None) -> dict[str, Tensor]:
        """-dE/dW = above below^T and -dE/db = above, so the statistic is scale (above- below-^T - above+ below+^T);
        bilinear everywhere, so `at` is not read."""
        (bp, ap), (bm, am) = plus, minus
        gw = torch.addmm(torch.mm(am.T, bm), ap.T, bp, beta=scale, alpha=-scale)
        return {f"W_{self.name}": gw, f"b_{self.name}": torch.sub(am, ap).sum(0).mul_(scale)}

    def ep_grads_clamped(
        self, x: Tensor, plus: Tensor, minus: Tensor, scale: float, input_grad: bool = True
    ) -> tuple[dict[str, Tensor], Tensor | None]:
        """Both phases share x, so the weight statistic is one product of (above- - above+) with x."""
        d = torch.sub(minus, plus).mul_(scale)
        grads = {f"W_{self.name}": torch.mm(d.T, x), f"b_{self.name}": d.sum(0)}
        return grads, torch.mm(d, self.weight) if input_grad else None

    # --- stability: the spectral cap ---

    @property
    def power_size(self) -> int:
        return self.weight.shape[0]

    def cap_exact(self, cap: float) -> None:
        norm = float(torch.linalg.matrix_norm(self.weight, ord=2))
        if norm > cap:
            self.weight.mul_(cap / norm)

    def cap_power(self, cap: Tensor | float, u: Tensor, clip: bool = False) -> None:
        w = self.weight
        for _ in range(2):  # each product normalised, so a coupling of any scale keeps u a unit vector
            v = torch.mv(w.T, u)
            v.div_(torch.linalg.vector_norm(v).clamp_min_(1e-12))
            torch.mv(w, v, out=u)
            sigma = torch.linalg.vector_norm(u).clamp_min_(1e-12)  # |W v| = u'^T W v for u' = W v / |W v|
            u.div_(sigma)
        bring_under_cap(w, sigma, cap, torch.outer(u, v) if clip else None)  # u^T W v = sigma: u v^T = d sigma / dW
