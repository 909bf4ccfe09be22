"""A sequence coupling: one convolution along the tokens of the layer below into the layer above (text machines).

    E_c(below, above) = -sum_t above_t . (W window_t(below) + b),   W (C_out, k C_in), b (C_out,)

Layers are (L, C) sequences stored token-major, (R, L*C) rows: the layout of a text machine's clamped input, its
context_len embeddings side by side, so the first coupling reads the embeddings as they are gathered. window_t is the
k tokens from s t on, k C_in consecutive numbers of a row, and the layer above is (L', C_out) with L' = (L - k) // s + 1
(no padding: every window lies inside the context; tokens past the last window get no pull). The same W at every
position is a dense coupling shared along the sequence: windows are a strided view of the rows, the pull up one
product with W^T, the pull down W^T above per window summed back onto the tokens it covers (k strided adds; one add
when k = s, whose windows tile the sequence), the EP statistic one product of above with the windows. A stack of them
at stride 2 or more sees a context of hundreds of characters in a few layers (a WaveNet-like tree, no causal mask:
every token of the context precedes the one predicted).

The term is bilinear, so nothing reads the layer's own value. The spectral cap is power iteration on the operator
(overlapping windows: its norm is above |W|). Each pull allocates its product's output; nothing syncs with the host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from trainer2.physics.couplings.coupling import Sides, bring_under_cap, cap_by_iteration, power_step

SPEC_KEYS = {"channels", "kernel", "stride"}
EXACT_ITERS = 500  # power-iteration steps of the build-time cap (the conv coupling's: singular values crowd)
MAX_SPEC = 2**20  # channels, kernel, stride: far beyond any context, and products of them stay countable


def parse_spec(spec: object) -> tuple[int, int, int]:
    """(channels, kernel, stride) of a `{conv1d: {channels: C, kernel: k (default 3), stride: s (default 1)}}` entry."""
    if not isinstance(spec, dict):
        raise ValueError(f"a conv1d layer's spec must be a mapping {{channels: C, kernel: k, stride: s}}, got {spec!r}")
    unknown = sorted(set(spec) - SPEC_KEYS)
    if unknown:
        raise ValueError(f"unknown conv1d key(s) {unknown}; expected {sorted(SPEC_KEYS)}")
    if "channels" not in spec:
        raise ValueError("a conv1d layer needs `channels` (the features per position)")
    values = {"channels": spec["channels"], "kernel": spec.get("kernel", 3), "stride": spec.get("stride", 1)}
    for key, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_SPEC:
            raise ValueError(f"conv1d {key} must be an integer in 1..{MAX_SPEC}, got {v!r}")
    return values["channels"], values["kernel"], values["stride"]


def sequence_below(below: tuple[int, ...]) -> tuple[int, int]:
    """(L, C) of the layer below, once checked to be a sequence (else a ValueError saying what it is)."""
    if len(below) != 2:
        raise ValueError(
            f"a conv1d layer needs a sequence-shaped layer (L, C) below it, got shape {below} (text data gives "
            "(context_len, embed_dim); a conv1d layer gives (L', channels); a dense layer is flat, images (C, H, W))"
        )
    return below[0], below[1]


def spec_size(spec: object, below: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """(L', C_out) = ((L - k) // s + 1, channels) above an (L, C_in) layer; without `below`, (C_out,) once checked."""
    channels, kernel, stride = parse_spec(spec)
    if below is None:
        return (channels,)
    length, _ = sequence_below(below)
    if length < kernel:
        raise ValueError(f"conv1d kernel {kernel} is longer than the {length} positions below it")
    return ((length - kernel) // stride + 1, channels)


def param_count(below: tuple[int, ...], spec: object) -> int:
    """Numbers learned above an (L, C_in) layer: W (C_out, k C_in) and b (C_out,)."""
    channels, kernel, _ = parse_spec(spec)
    return channels * kernel * below[1] + channels


def workspace_bytes(below: tuple[int, ...], spec: object, rows: int, itemsize: int) -> int:
    """Bytes allocated beyond the workspace at the peak over `rows` rows: the windows' copy (overlapping windows are
    no view of a matrix) and the product; the pull down's per-window products; the EP statistic's two of each."""
    channels, kernel, _ = parse_spec(spec)
    length, c_in = spec_size(spec, below)[0], below[1]
    windows, product = length * kernel * c_in, length * channels
    return itemsize * rows * 2 * (windows + product)


@dataclass(frozen=True)
class Conv1d:
    """W_<name> (C_out, k C_in) and b_<name> (C_out,), from an (L, C_in) sequence to ((L - k) // s + 1, C_out)."""

    kind: ClassVar[str] = "conv1d"  # the name the config's layers use
    name: str
    weight: Tensor
    bias_: Tensor
    stride: int
    below_shape: tuple[int, ...]
    above_shape: tuple[int, ...]

    spec_size = staticmethod(spec_size)
    param_count = staticmethod(param_count)
    workspace_bytes = staticmethod(workspace_bytes)

    @classmethod
    def init(
        cls, name: str, below: tuple[int, ...], spec: object, scale: float, gen: torch.Generator, dtype: torch.dtype
    ) -> "Conv1d":
        """Uniform(+-scale/sqrt(k C_in)) weights, zero bias."""
        channels, kernel, stride = parse_spec(spec)
        above = spec_size(spec, below)
        fan_in = kernel * below[1]
        weight = (torch.rand(channels, fan_in, generator=gen, dtype=dtype) * 2 - 1) * (scale / math.sqrt(fan_in))
        return cls(name, weight, torch.zeros(channels, dtype=dtype), stride, tuple(below), above)

    @property
    def kernel(self) -> int:
        """k, the tokens each window covers."""
        return self.weight.shape[1] // self.below_shape[1]

    @property
    def bias(self) -> Tensor:
        """(L' C_out,) the bias at every position (a new tensor; not the parameter)."""
        return self.bias_.repeat(self.above_shape[0])

    def parameters(self) -> dict[str, Tensor]:
        return {f"W_{self.name}": self.weight, f"b_{self.name}": self.bias_}

    def decayed(self) -> frozenset[str]:
        return frozenset({f"W_{self.name}"})

    def rebind(self, named: dict[str, Tensor]) -> "Conv1d":
        return replace(self, weight=named[f"W_{self.name}"], bias_=named[f"b_{self.name}"])

    # --- the windows, the operator and its adjoint ---

    def windows(self, below: Tensor) -> Tensor:
        """(R L', k C_in) the windows of below (R, L C_in): a view where the rows allow it (k <= s on contiguous rows),
        else one copy."""
        if below.stride(-1) != 1:
            below = below.contiguous()
        length, c_in = self.above_shape[0], self.below_shape[1]
        view = below.as_strided(
            (below.shape[0], length, self.weight.shape[1]),
            (below.stride(0), self.stride * c_in, 1),
            below.storage_offset(),
        )
        return view.reshape(-1, self.weight.shape[1])

    def apply(self, below: Tensor, bias: Tensor | None) -> Tensor:
        """W window_t(below) (+ b) at every position, as (R L', C_out)."""
        w = self.windows(below)
        return torch.mm(w, self.weight.T) if bias is None else torch.addmm(bias, w, self.weight.T)

    def spread(self, above: Tensor, out: Tensor) -> Tensor:
        """out (R, L C_in) += W^T above_t summed onto the tokens of window t, from above (R, L' C_out)."""
        rows, (length, c_out), (full, c_in) = above.shape[0], self.above_shape, self.below_shape
        k, s = self.kernel, self.stride
        g = torch.mm(above.reshape(-1, c_out), self.weight).view(rows, length, k, c_in)
        tokens = out.view(rows, full, c_in)
        if k == s:  # the windows tile the first L' k tokens: one add
            tokens[:, : length * k].add_(g.view(rows, length * k, c_in))
            return out
        for j in range(k):  # token j of every window: a strided slice of the sequence
            tokens[:, j : j + s * (length - 1) + 1 : s].add_(g[:, :, j])
        return out

    def transpose(self, above: Tensor) -> Tensor:
        """L^T above as a new (R, L C_in) tensor."""
        return self.spread(above, above.new_zeros(above.shape[0], math.prod(self.below_shape)))

    # --- pulls (the fixed-point sweep and the forces) ---

    def up(self, below: Tensor, out: Tensor) -> Tensor:
        return out.copy_(self.apply(below, self.bias_).view(out.shape))

    def add_up(self, below: Tensor, out: Tensor) -> Tensor:
        return out.add_(self.apply(below, None).view(out.shape))

    def add_up_linear(self, below: Tensor, at: Tensor, out: Tensor) -> Tensor:
        return self.add_up(below, out)  # bilinear: the pull is its own linearisation

    def down(self, above: Tensor, below: Tensor, base: Tensor, out: Tensor) -> Tensor:
        return self.spread(above, out.copy_(base))  # bilinear: `below` is not read

    def add_down(self, above: Tensor, below: Tensor, out: Tensor) -> Tensor:
        return self.spread(above, out)

    @property
    def down_reads_below(self) -> bool:
        return False  # bilinear

    def energy(self, below: Tensor, above: Tensor) -> Tensor:
        """Written as torch's conv1d over (R, C_in, L), not the windows' product: tests check one by the other."""
        (length, c_in), c_out = self.below_shape, self.above_shape[1]
        x = below.reshape(below.shape[0], length, c_in).transpose(1, 2)
        kernel = self.weight.view(c_out, self.kernel, c_in).transpose(1, 2)
        z = F.conv1d(x, kernel, self.bias_, stride=self.stride).transpose(1, 2).reshape(below.shape[0], -1)
        return -(above * z).sum(1)

    # --- learning ---

    def correlation(self, above: Tensor, below: Tensor) -> Tensor:
        """sum over rows and positions of above_t (x) window_t(below): the gradient of above . (L below) in W."""
        return torch.mm(above.reshape(-1, self.above_shape[1]).T, self.windows(below))

    def channel_sum(self, above: Tensor) -> Tensor:
        """(C_out,) the sum of `above` over rows and positions: the gradient of above . b in b."""
        return above.reshape(-1, self.above_shape[1]).sum(0)

    def ep_grads(self, plus: Sides, minus: Sides, scale: float, at: Tensor | None = None) -> dict[str, Tensor]:
        """scale (corr(s-) - corr(s+)) (-dE/dW at each phase); bilinear everywhere, so `at` is not read."""
        (bp, ap), (bm, am) = plus, minus
        c_out = self.above_shape[1]
        gw = torch.addmm(self.correlation(am, bm), ap.reshape(-1, c_out).T, self.windows(bp), beta=scale, alpha=-scale)
        return {f"W_{self.name}": gw, f"b_{self.name}": self.channel_sum(torch.sub(am, ap)).mul_(scale)}

    def ep_grads_clamped(
        self, x: Tensor, plus: Tensor, minus: Tensor, scale: float, input_grad: bool = True
    ) -> tuple[dict[str, Tensor], Tensor | None]:
        """Both phases share x, so the weight statistic is one product of (above- - above+) with x's windows."""
        d = torch.sub(minus, plus).mul_(scale)
        grads = {f"W_{self.name}": self.correlation(d, x), f"b_{self.name}": self.channel_sum(d)}
        return grads, self.transpose(d) if input_grad else None

    # --- stability: the spectral cap ---

    @property
    def power_size(self) -> int:
        return math.prod(self.above_shape)

    def power_step(self, u: Tensor) -> tuple[Tensor, Tensor]:
        """u <- L L^T u / |L L^T u| in place; returns (sigma, v), v = L^T u / |L^T u|, sigma = |L v| = u^T L v."""
        return power_step(u, self.transpose, lambda v: self.apply(v, None))

    def cap_exact(self, cap: float) -> None:
        """Power iteration to convergence from a fixed random vector (at build, once)."""
        cap_by_iteration(self.weight, self.power_size, self.power_step, cap, EXACT_ITERS)

    def cap_power(self, cap: Tensor | float, u: Tensor, clip: bool = False) -> None:
        for _ in range(2):
            sigma, v = self.power_step(u)
        top = self.correlation(u.view(1, -1), v.view(1, -1)) if clip else None  # u^T L v = sigma: d sigma / dW
        bring_under_cap(self.weight, sigma, cap, top)
