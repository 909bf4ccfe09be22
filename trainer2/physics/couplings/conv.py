"""A convolutional coupling: a convolution of the layer below, pooled (average or max) into the layer above.

    E_c(below, above) = -above . (P(conv_K below) + b),   K (C_out, C_in, k, k), b (C_out,),  P = avgpool_p or maxpool_p

Layers are (C, H, W) images stored as (R, C*H*W) rows. The convolution is stride 1 with same padding (k // 2) by
default; without pooling (p = 1) the spec may give it a stride s and padding q instead (residual networks: a 3x3
stride-2 conv in place of pooling, a 1x1 stride-2 skip), making the layer above (C_out, (H + 2q - k) // s + 1, ...).
Pooling assumes the default stride and padding. A strided conv_K is linear like the pooled ones below: L = conv_K at
stride s, its adjoint conv_transpose2d at stride s, its EP statistic the same correlation at dilation s.

Average pooling: A = avgpool_p o conv_K is linear, so the term is bilinear like a dense one. Pooling p x p after a
k x k convolution is one convolution of stride p with the (k+p-1)^2 kernel K' = K * box_p / p^2 (the box filter's
full convolution with K), so the pull on the layer above is conv2d(below, K', stride p) + b, and the pull on the
layer below its adjoint, conv_transpose2d(above, K', stride p). The EP statistic is the correlation of the two layers
(itself a convolution, rows as channels), carried back from K' to K by the box filter's adjoint.

Max pooling (the conv Hopfield energies of Laborieux et al. 2021): the term is piecewise bilinear; where the argmax of
each window of conv_K(below) is unique, -dE/d(below) = conv_K^T unpool(above) with the argmax positions of the
current `below` (the pulls on the layer below take it), and the EP statistic is the correlation of unpool(above)
with below at stride 1, each phase unpooled at its own argmax (ep_grads' `at` None: `maxpool_argmax: own`, the
default, and CHL's finite contrast), or both at the argmax of `at`, the free equilibrium's lower layer (`free`: the
piece of E the exact gradient differentiates; each at its own adds a jump of O(1/beta) wherever a window's argmax
differs between the phases; docs/images.md).

The spectral cap is power iteration on the linear part (A; for max pooling conv_K, since max pooling is
1-Lipschitz). Each pull allocates its convolution's output (torch has no out= convolution), and the adjoint one
channels-last copy of its input; nothing syncs with the host or branches on a value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from trainer2.physics.couplings.coupling import Sides, bring_under_cap, cap_by_iteration, power_step

SPEC_KEYS = {"channels", "kernel", "pool", "pooling", "stride", "padding"}
POOLINGS = ("avg", "max")
EXACT_ITERS = 500  # power-iteration steps of the build-time cap: a conv's top singular values crowd together
MAX_SPEC = 2**20  # channels, kernel, pool, stride: far beyond any image, and products of them stay countable (sizes.py)


def workspace_bytes(below: tuple[int, ...], spec: object, rows: int, itemsize: int) -> int:
    """Bytes a conv coupling allocates beyond the workspace at the peak of its operations over `rows` rows: a pull's
    convolution output (full resolution before max pooling, with its argmax and unpooled plane) and the adjoint's
    channels-last copy; the EP statistic's rows of both phases concatenated and their copies with rows as channels
    (the correlation is one convolution); under max pooling, the int64 argmax a step keeps between its halves."""
    channels, kernel, pool, pooling, stride, padding = parse_spec(spec)
    maxpool = pooling == "max" and pool > 1
    if pool > 1:
        stride = 1 if maxpool else pool
        linear = channels * (below[1] // stride) * (below[2] // stride)  # L's output
    else:
        linear = channels * math.prod(strided_size(below[1], below[2], kernel, stride, padding))
    pull = 2 * linear + math.prod(below) + (3 * linear if maxpool else 0)  # argmax int64 + unpooled plane
    statistic = 2 * (linear + math.prod(below))
    kept = 8 * (linear // (pool * pool)) if maxpool else 0  # the argmax an even/odd step keeps for the pull down
    return itemsize * rows * max(pull, statistic) + rows * kept


def spec_size(spec: object, below: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """The shape of the layer a `{conv: {channels: C, kernel: k, pool: p}}` entry makes above a (C_in, H, W) layer:
    (C, H // p, W // p), or with p = 1 (C, (H + 2q - k) // s + 1, ...) at stride s and padding q; without `below`,
    only the spec is checked and (C,) returned."""
    channels, kernel, pool, _, stride, padding = parse_spec(spec)
    if below is None:
        return (channels,)
    _, h, w = image_below(below, pool)
    if pool > 1:
        return (channels, h // pool, w // pool)
    return (channels, *strided_size(h, w, kernel, stride, padding))


def param_count(below: tuple[int, ...], spec: object) -> int:
    """Numbers a conv coupling learns above a (C_in, H, W) layer: K (C_out, C_in, k, k) and b (C_out,)."""
    channels, kernel, *_ = parse_spec(spec)
    return channels * below[0] * kernel * kernel + channels


@dataclass(frozen=True)
class Conv:
    """W_<name> (C_out, C_in, k, k) and b_<name> (C_out,), from a (C_in, H, W) layer to (C_out, H // p, W // p), or
    without pooling to (C_out, (H + 2q - k) // s + 1, (W + 2q - k) // s + 1) at the spec's stride s and padding q."""

    kind: ClassVar[str] = "conv"  # the name the config's layers use
    name: str
    weight: Tensor
    bias_: Tensor
    pool: int
    pooling: str  # "avg" or "max"
    below_shape: tuple[int, ...]
    above_shape: tuple[int, ...]
    kernel: Tensor | None = None  # L's kernel derived once for a window (`with_kernel`); None: derived at every pull
    conv_stride: int = 1  # the spec's stride (1 under pooling); L's stride is the `stride` property
    conv_padding: int | None = None  # the spec's padding; None: k // 2 (same padding)

    spec_size = staticmethod(spec_size)  # the layer's shape a spec makes (the module's function)
    param_count = staticmethod(param_count)
    workspace_bytes = staticmethod(workspace_bytes)

    @classmethod
    def init(
        cls, name: str, below: tuple[int, ...], spec: object, scale: float, gen: torch.Generator, dtype: torch.dtype
    ) -> "Conv":
        """Uniform(+-scale/sqrt(C_in k^2)) kernels, zero bias."""
        channels, kernel, pool, pooling, stride, padding = parse_spec(spec)
        above = cls.spec_size(spec, below)
        bound = scale / math.sqrt(below[0] * kernel * kernel)
        weight = (torch.rand(channels, below[0], kernel, kernel, generator=gen, dtype=dtype) * 2 - 1) * bound
        bias = torch.zeros(channels, dtype=dtype)
        return cls(name, weight, bias, pool, pooling, tuple(below), above, conv_stride=stride, conv_padding=padding)

    @property
    def bias(self) -> Tensor:
        """(C_out H' W',) the bias broadcast over each channel's pixels (a new tensor; not the parameter)."""
        return self.bias_.repeat_interleave(self.above_shape[1] * self.above_shape[2])

    def parameters(self) -> dict[str, Tensor]:
        return {f"W_{self.name}": self.weight, f"b_{self.name}": self.bias_}

    def decayed(self) -> frozenset[str]:
        return frozenset({f"W_{self.name}"})

    def rebind(self, named: dict[str, Tensor]) -> "Conv":
        return replace(self, weight=named[f"W_{self.name}"], bias_=named[f"b_{self.name}"], kernel=None)

    def with_kernel(self) -> "Conv":
        """This coupling with L's kernel derived once, for the pulls of a window (K' costs a pad and a pool, ~75 us)."""
        return replace(self, kernel=self.linear_kernel())

    # --- the linear part L, the pooling, and their adjoints ---

    @property
    def maxpool(self) -> bool:
        """Max pooling over windows of more than one pixel (max pooling with p = 1 is no pooling)."""
        return self.pooling == "max" and self.pool > 1

    @property
    def padding(self) -> int:
        """L's padding: the spec's, by default (and always under pooling) k // 2."""
        return self.weight.shape[-1] // 2 if self.conv_padding is None else self.conv_padding

    @property
    def stride(self) -> int:
        """L's stride: p (average pooling folded into L), 1 (max pooling follows L), or without pooling the spec's."""
        return (1 if self.maxpool else self.pool) if self.pool > 1 else self.conv_stride

    @property
    def linear_kernel_size(self) -> int:
        """k_L, the side of L's kernel: k + p - 1 (K') under average pooling, else k."""
        return self.weight.shape[-1] + (0 if self.maxpool else self.pool - 1)

    @property
    def linear_shape(self) -> tuple[int, ...]:
        """(C_out, H_L, W_L), L's output: the layer above, or the full-resolution plane that max pooling reduces."""
        return (self.above_shape[0], *self.below_shape[1:]) if self.maxpool else self.above_shape

    @property
    def output_padding(self) -> tuple[int, int]:
        """Rows and columns L's stride drops (H - ((H_L - 1) s - 2 q + k_L), ...; H mod p under pooling): the adjoint
        gives them back as zeros' pull, so it returns exactly (H, W)."""
        (_, h, w), (_, lh, lw) = self.below_shape, self.linear_shape
        span = -2 * self.padding + self.linear_kernel_size
        return (h - ((lh - 1) * self.stride + span), w - ((lw - 1) * self.stride + span))

    def linear_kernel(self) -> Tensor:
        """L's kernel: the window's once derived (with_kernel), else K under max pooling, else K' = pooled_kernel(K)."""
        if self.kernel is not None:
            return self.kernel
        return self.weight if self.maxpool else pooled_kernel(self.weight, self.pool)

    def convolve(self, below: Tensor, bias: Tensor | None) -> Tensor:
        """L below (+ b) as (R, *linear_shape) from below (R, C_in H W)."""
        return F.conv2d(self.image(below), self.linear_kernel(), bias, stride=self.stride, padding=self.padding)

    def transpose(self, u: Tensor, where: Tensor | None = None) -> Tensor:
        """L^T u as (R, C_in, H, W) (channels-last strides) from u (R, prod(linear_shape)), or from u (R, C_out H' W')
        unpooled to the argmax positions `where`. The transposed convolution takes its input channels-last: on the CPU
        that is oneDNN's path, about 3x faster than the default one (benchmarks/conv_speed.py)."""
        u = u if where is None else self.unpool(u, where)
        u = u.view(u.shape[0], *self.linear_shape).contiguous(memory_format=torch.channels_last)
        return F.conv_transpose2d(
            u, self.linear_kernel(), stride=self.stride, padding=self.padding, output_padding=self.output_padding
        )

    def argmax(self, below: Tensor) -> Tensor:
        """(R, C_out, H', W') int64: where in each p x p window of conv_K(below) + b the maximum lies (max pooling; b is
        constant over a window), found as the up pull finds it (`up_reading`), so every pull rounds its ties alike."""
        return F.max_pool2d(self.convolve(below, self.bias_), self.pool, return_indices=True)[1]

    def unpool(self, above: Tensor, where: Tensor) -> Tensor:
        """above (R, C_out H' W') placed at the argmax positions `where` in a (R, C_out, H, W) plane of zeros."""
        a = above.view(above.shape[0], *self.above_shape)
        return F.max_unpool2d(a, where, self.pool, output_size=self.below_shape[1:])

    def apply(self, below: Tensor, bias: Tensor | None) -> Tensor:
        """P(conv_K below) (+ b) as (R, C_out, H', W') from below (R, C_in H W)."""
        z = self.convolve(below, bias)
        return F.max_pool2d(z, self.pool) if self.maxpool else z

    def adjoint(self, above: Tensor, below: Tensor) -> Tensor:
        """-dE_c/d below without the bias, as (R, C_in, H, W) (channels-last strides), from above (R, C_out H' W'):
        L^T above, `above` first unpooled to the argmax of conv_K(below) under max pooling (else below is unused)."""
        return self.transpose(above, self.argmax(below) if self.maxpool else None)

    def image(self, t: Tensor) -> Tensor:
        """A (R, C_in H W) row block of the layer below viewed as (R, C_in, H, W)."""
        return t.view(t.shape[0], *self.below_shape)

    # --- pulls (the fixed-point sweep and the forces) ---

    def up(self, below: Tensor, out: Tensor) -> Tensor:
        return out.copy_(self.apply(below, self.bias_).view(out.shape))

    def add_up(self, below: Tensor, out: Tensor) -> Tensor:
        return out.add_(self.apply(below, None).view(out.shape))

    def add_up_linear(self, below: Tensor, at: Tensor, out: Tensor) -> Tensor:
        """Average pooling: add_up. Max pooling: L below read at the argmax of each window of L `at` (the pull's
        derivative where the layer below is `at`)."""
        if not self.maxpool:
            return self.add_up(below, out)
        z = self.convolve(below, None).flatten(2)  # (R, C_out, H W)
        return out.add_(z.gather(2, self.argmax(at).flatten(2)).view(out.shape))

    def down(self, above: Tensor, below: Tensor, base: Tensor, out: Tensor) -> Tensor:
        torch.add(self.image(base), self.adjoint(above, below), out=self.image(out))
        return out

    def add_down(self, above: Tensor, below: Tensor, out: Tensor) -> Tensor:
        return self.add_down_read(above, self.argmax(below) if self.maxpool else None, out)

    @property
    def down_reads_below(self) -> bool:
        return self.maxpool  # the argmax of conv_K(below) places the pull; average pooling is bilinear

    def up_reading(self, below: Tensor, out: Tensor) -> Tensor:
        """up, returning argmax(below) from the same convolution: what the pull on the layer below reads of it."""
        z, where = F.max_pool2d(self.convolve(below, self.bias_), self.pool, return_indices=True)
        out.copy_(z.view(out.shape))
        return where

    def add_down_read(self, above: Tensor, where: Tensor | None, out: Tensor) -> Tensor:
        """add_down, given the argmax positions `where` of the layer below (None without max pooling)."""
        self.image(out).add_(self.transpose(above, where))
        return out

    def energy(self, below: Tensor, above: Tensor) -> Tensor:
        """Written as the textbook conv then pool (not the fused kernel), so tests check one against the other."""
        x = below.reshape(below.shape[0], *self.below_shape)
        pool = F.max_pool2d if self.pooling == "max" else F.avg_pool2d
        z = pool(F.conv2d(x, self.weight, self.bias_, stride=self.conv_stride, padding=self.padding), self.pool)
        return -(above * z.flatten(1)).sum(1)

    # --- learning ---

    def correlation(self, above: Tensor, below: Tensor) -> Tensor:
        """sum over rows of above (x) below, the gradient of above . (L below) in K (C_out, C_in, k, k) (max pooling:
        `above` unpooled to (R, C_out, H, W), stride 1). One convolution with rows as channels, g[i, o, u, v] = sum_ryx
        below[r, i, s y + u, s x + v] above[r, o, y, x] (padded by q): 5-7x faster than unfold and a product
        (conv_speed)."""
        rows, stride = below.shape[0], self.stride
        ke = self.linear_kernel_size  # L's kernel: K' under average pooling
        x = self.image(below).transpose(0, 1)
        a = above.reshape(rows, *self.linear_shape).transpose(0, 1)
        g = F.conv2d(x, a, padding=self.padding, dilation=stride)[:, :, :ke, :ke].transpose(0, 1)
        # K' is linear in K (the box filter); its adjoint is the p x p box sum / p^2 at stride 1.
        return F.avg_pool2d(g, self.pool, stride=1) if self.pool > 1 and not self.maxpool else g.contiguous()

    def channel_sum(self, above: Tensor) -> Tensor:
        """(C_out,) the sum of `above` over rows and pixels: the gradient of above . b in b."""
        return above.reshape(above.shape[0], self.above_shape[0], -1).sum((0, 2))

    def ep_grads(self, plus: Sides, minus: Sides, scale: float, at: Tensor | None = None) -> dict[str, Tensor]:
        """scale (corr(s-) - corr(s+)) of above with below (-dE/dK), one correlation; `at`: the module docstring."""
        (bp, ap), (bm, am) = plus, minus
        if self.maxpool:
            wp, wm = (self.argmax(bp), self.argmax(bm)) if at is None else (self.argmax(at),) * 2
            am, ap = self.unpool(am, wm), self.unpool(ap, wp)
        gw = self.correlation(torch.cat([am, ap.neg()]), torch.cat([bm, bp])).mul_(scale)
        return {f"W_{self.name}": gw, f"b_{self.name}": self.channel_sum(torch.sub(am, ap)).mul_(scale)}

    def ep_grads_clamped(
        self, x: Tensor, plus: Tensor, minus: Tensor, scale: float, input_grad: bool = True
    ) -> tuple[dict[str, Tensor], Tensor | None]:
        """Both phases share x, so the kernel statistic is one correlation of (above- - above+) with x."""
        d = torch.sub(minus, plus).mul_(scale)
        plane = self.unpool(d, self.argmax(x)) if self.maxpool else d  # both phases share x's argmax
        grads = {f"W_{self.name}": self.correlation(plane, x), f"b_{self.name}": self.channel_sum(d)}
        return grads, self.transpose(plane).reshape(d.shape[0], -1) if input_grad else None

    # --- stability: the spectral cap ---

    @property
    def power_size(self) -> int:
        return math.prod(self.linear_shape)

    def linear(self, below: Tensor) -> Tensor:
        """L below as (R, power_size) from (R, C_in H W): A = avgpool o conv_K, or conv_K under max pooling."""
        return self.convolve(below, None).flatten(1)

    def power_step(self, u: Tensor) -> tuple[Tensor, Tensor]:
        """u <- L L^T u / |L L^T u| in place; returns (sigma, v), v = L^T u / |L^T u|, sigma = |L v| = u^T L v. Both
        poolings are 1-Lipschitz, so capping L caps the pull's Lipschitz constant."""
        return power_step(u, self.transpose, self.linear)

    def cap_exact(self, cap: float) -> None:
        """Power iteration to convergence from a fixed random vector (at build, once; a conv's matrix is too big to
        factor): within 1e-3 of the norm at the tested sizes, and the per-update cap keeps converging from there."""
        cap_by_iteration(self.weight, self.power_size, self.power_step, cap, EXACT_ITERS)

    def cap_power(self, cap: Tensor | float, u: Tensor, clip: bool = False) -> None:
        steady = self.with_kernel()  # both steps see the same K: derive K' once
        for _ in range(2):
            sigma, v = steady.power_step(u)
        bring_under_cap(self.weight, sigma, cap, steady.correlation(u.view(1, -1), v.view(1, -1)) if clip else None)


def pooled_kernel(weight: Tensor, pool: int) -> Tensor:
    """K' (C_out, C_in, k+p-1, k+p-1) = K convolved with the p x p box / p^2: conv then avgpool as one conv."""
    return weight if pool == 1 else F.avg_pool2d(F.pad(weight, (pool - 1,) * 4), pool, stride=1)


def image_below(below: tuple[int, ...], pool: int) -> tuple[int, ...]:
    """`below` itself, once checked to be an image (C, H, W) of at least pool x pool pixels (else a ValueError)."""
    if len(below) != 3:
        raise ValueError(
            f"a conv layer needs an image-shaped layer (C, H, W) below it, got shape {below} "
            "(image data gives (C, H, W); a dense layer or feature vectors are flat)"
        )
    _, h, w = below
    if h < pool or w < pool:
        raise ValueError(f"pool {pool} is larger than the {h}x{w} image below it")
    return below


def strided_size(h: int, w: int, kernel: int, stride: int, padding: int) -> tuple[int, int]:
    """(H', W') = ((H + 2q - k) // s + 1, ...) of a stride-s, q-padded k x k convolution of an H x W image, once
    checked to be at least 1 x 1 (else a ValueError naming the sizes)."""
    oh, ow = ((n + 2 * padding - kernel) // stride + 1 for n in (h, w))
    if oh < 1 or ow < 1:
        raise ValueError(
            f"conv kernel {kernel} with padding {padding} and stride {stride} leaves no pixel of the {h}x{w} image "
            f"below it (the layer above would be {max(oh, 0)}x{max(ow, 0)})"
        )
    return oh, ow


def parse_spec(spec: object) -> tuple[int, int, int, str, int, int]:
    """(channels, kernel, pool, pooling, stride, padding) of a conv entry's spec {channels: C, kernel: k (odd, default
    3), pool: p (default 1), pooling: avg or max (default avg), stride: s (default 1), padding: q (0..k-1, default
    k // 2)}; a stride or padding other than the default needs pool 1."""
    if not isinstance(spec, dict):
        raise ValueError(
            "a conv layer's spec must be a mapping {channels: C, kernel: k, pool: p, pooling: avg|max, stride: s, "
            f"padding: q}}, got {spec!r}"
        )
    unknown = sorted(set(spec) - SPEC_KEYS)
    if unknown:
        raise ValueError(f"unknown conv key(s) {unknown}; expected {sorted(SPEC_KEYS)}")
    if "channels" not in spec:
        raise ValueError("a conv layer needs `channels` (the number of feature maps)")
    values = {"channels": spec["channels"], "kernel": spec.get("kernel", 3), "pool": spec.get("pool", 1)}
    values["stride"] = spec.get("stride", 1)
    for key, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_SPEC:
            raise ValueError(f"conv {key} must be an integer in 1..{MAX_SPEC}, got {v!r}")
    if values["kernel"] % 2 == 0:
        raise ValueError(f"conv kernel must be odd (same padding is symmetric only then), got {values['kernel']}")
    pooling = spec.get("pooling", "avg")
    if pooling not in POOLINGS:
        raise ValueError(f"conv pooling must be one of {list(POOLINGS)}, got {pooling!r}")
    kernel, pool, stride = values["kernel"], values["pool"], values["stride"]
    padding = spec.get("padding", kernel // 2)
    if isinstance(padding, bool) or not isinstance(padding, int) or not 0 <= padding < kernel:
        raise ValueError(
            f"conv padding must be an integer in 0..{kernel - 1} (below kernel {kernel}: with more, the border "
            f"pixels of the layer above would see only padding), got {padding!r}"
        )
    if pool > 1 and stride > 1:
        raise ValueError(
            f"conv stride {stride} with pool {pool}: use one of them (stride: {stride} with pool: 1, or pool: {pool} "
            "with stride: 1)"
        )
    if pool > 1 and padding != kernel // 2:
        raise ValueError(
            f"conv padding {padding} with pool {pool}: pooling assumes same padding (kernel // 2 = {kernel // 2}); "
            "drop padding, or use pool: 1 (with a stride in place of the pooling)"
        )
    return values["channels"], kernel, pool, pooling, stride, padding
