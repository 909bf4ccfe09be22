"""Strided and explicitly padded conv couplings (residual networks: a 3x3 stride-2 conv in place of pooling, a 1x1
stride-2 skip): their pulls, EP statistic and spectral cap against autograd and explicit matrices, their spec
errors, and that today's specs are unchanged by the new keys' defaults."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from trainer2.physics.couplings import Conv
from trainer2.physics.couplings import conv as conv_module
from trainer2.train_config import TrainConfig

F64 = torch.float64
GEOMETRIES = [(3, 2, 1), (1, 2, 0), (3, 1, 0)]  # (kernel, stride, padding)
IMAGES = [(2, 7, 7), (2, 8, 8), (2, 7, 8)]
CASES = [(below, {"channels": 3, "kernel": k, "stride": s, "padding": p}) for k, s, p in GEOMETRIES for below in IMAGES]
IDS = [f"k{k}s{s}p{p}_{h}x{w}" for k, s, p in GEOMETRIES for _, h, w in IMAGES]
# today's specs (test_conv's cases): pooled, pool 1, max pooled, with images the pooling divides and does not
TODAY = [
    ((2, 8, 8), {"channels": 3, "kernel": 3, "pool": 2}),
    ((1, 9, 9), {"channels": 2, "kernel": 5, "pool": 2}),
    ((3, 5, 5), {"channels": 2, "kernel": 3}),
    ((2, 9, 7), {"channels": 2, "kernel": 3, "pool": 3}),
    ((2, 8, 8), {"channels": 3, "kernel": 3, "pool": 2, "pooling": "max"}),
    ((1, 9, 7), {"channels": 2, "kernel": 5, "pool": 3, "pooling": "max"}),
]
TODAY_IDS = ["pool2", "pool2_odd", "pool1", "pool3", "max2", "max3_odd"]


def make(below, spec, seed: int = 0) -> Conv:
    c = Conv.init("1", below, spec, 1.0, torch.Generator().manual_seed(seed), F64)
    c.bias_.copy_(torch.randn(c.bias_.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=F64))
    return c


def rand(rows: int, size: int, seed: int) -> torch.Tensor:
    return torch.rand(rows, size, generator=torch.Generator().manual_seed(seed), dtype=F64)


def matrix(c: Conv) -> torch.Tensor:
    """L as an explicit matrix: its columns are L of the unit vectors (the rows of the identity)."""
    return c.linear(torch.eye(math.prod(c.below_shape), dtype=F64)).T


def out_size(n: int, k: int, s: int, p: int) -> int:
    return (n + 2 * p - k) // s + 1


@pytest.mark.parametrize("below,spec", CASES, ids=IDS)
def test_the_layer_above_and_the_pull_up_are_torchs_strided_convolution(below, spec):
    """The shape is (C_out, (H + 2p - k) // s + 1, ...), and up is F.conv2d at the spec's stride and padding."""
    k, s, p = spec["kernel"], spec["stride"], spec["padding"]
    c = make(below, spec)
    above = (3, out_size(below[1], k, s, p), out_size(below[2], k, s, p))
    assert Conv.spec_size(spec, below) == c.above_shape == c.linear_shape == above
    assert (c.stride, c.padding) == (s, p)
    lo = rand(4, math.prod(below), 2)
    want = F.conv2d(lo.view(4, *below), c.weight, c.bias_, stride=s, padding=p).flatten(1)
    torch.testing.assert_close(c.up(lo, torch.empty(4, math.prod(above), dtype=F64)), want, rtol=0, atol=1e-14)
    assert c.transpose(rand(4, math.prod(above), 3)).shape == (4, *below)  # the adjoint returns exactly (H, W)


@pytest.mark.parametrize("below", [(2, 7, 7), (2, 8, 8)], ids=["7x7", "8x8"])
def test_a_residual_blocks_strided_conv_and_its_skip_land_on_the_same_layer(below):
    conv = {"channels": 3, "kernel": 3, "stride": 2, "padding": 1}
    skip = {"channels": 3, "kernel": 1, "stride": 2, "padding": 0}
    assert Conv.spec_size(conv, below) == Conv.spec_size(skip, below) == (3, 4, 4)


@pytest.mark.parametrize("below,spec", CASES, ids=IDS)
def test_every_pull_is_minus_the_energy_terms_gradient(below, spec):
    c = make(below, spec)
    lo, hi = rand(4, math.prod(c.below_shape), 2), rand(4, math.prod(c.above_shape), 3)
    lo.requires_grad_(True), hi.requires_grad_(True)
    d_lo, d_hi = torch.autograd.grad(c.energy(lo, hi).sum(), [lo, hi])
    lo, hi = lo.detach(), hi.detach()
    base = rand(4, lo.shape[1], 4)
    torch.testing.assert_close(c.up(lo, torch.empty_like(hi)), -d_hi)
    torch.testing.assert_close(c.add_up(lo, base[:, :1].expand(4, hi.shape[1]).clone()), -d_hi - c.bias + base[:, :1])
    torch.testing.assert_close(c.add_up_linear(lo, lo, torch.zeros_like(hi)), -d_hi - c.bias)
    torch.testing.assert_close(c.down(hi, lo, base, torch.empty_like(lo)), base - d_lo)
    torch.testing.assert_close(c.add_down(hi, lo, base.clone()), base - d_lo)
    assert d_lo.norm() > 0 and (d_hi + c.bias).norm() > 0  # nothing trivially zero
    if c.stride > 1 and any(c.output_padding):  # rows and columns the stride drops get no pull
        dropped = torch.zeros(c.below_shape, dtype=torch.bool)
        dropped[:, below[1] - c.output_padding[0] :, :] = True
        dropped[:, :, below[2] - c.output_padding[1] :] = True
        if c.padding == 0:
            assert not d_lo.view(4, *below)[:, dropped].any()


@pytest.mark.parametrize("below,spec", CASES, ids=IDS)
def test_ep_statistic_is_the_difference_of_the_energy_terms_parameter_gradients(below, spec):
    """ep_grads = scale (dE/dtheta(s+) - dE/dtheta(s-)), and the clamped form's, with its gradient in x."""
    c, scale = make(below, spec), 0.37
    size, above = math.prod(c.below_shape), math.prod(c.above_shape)
    bp, bm, ap, am = rand(3, size, 5), rand(3, size, 6), rand(3, above, 7), rand(3, above, 8)
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in c.parameters().items()}
    cl = c.rebind(leaves)
    gp = torch.autograd.grad(cl.energy(bp, ap).sum(), list(leaves.values()))
    gm = torch.autograd.grad(cl.energy(bm, am).sum(), list(leaves.values()))
    got = c.ep_grads((bp, ap), (bm, am), scale)
    assert got.keys() == leaves.keys()
    for k, p, m in zip(leaves, gp, gm):
        assert got[k].shape == leaves[k].shape
        torch.testing.assert_close(got[k], scale * (p - m))
        assert (p - m).norm() > 0
    x = bp.clone().requires_grad_(True)
    gp = torch.autograd.grad(cl.energy(x, ap).sum(), [*leaves.values(), x])
    gm = torch.autograd.grad(cl.energy(x, am).sum(), [*leaves.values(), x])
    got, gx = c.ep_grads_clamped(bp, ap, am, scale)
    for k, p, m in zip(leaves, gp, gm):
        torch.testing.assert_close(got[k], scale * (p - m))
    torch.testing.assert_close(gx, scale * (gp[-1] - gm[-1]))
    assert c.ep_grads_clamped(bp, ap, am, scale, input_grad=False)[1] is None


@pytest.mark.parametrize("below,spec", CASES, ids=IDS)
def test_power_iteration_finds_the_top_singular_value_of_the_explicit_matrix(below, spec):
    c = make(below, spec)
    top = torch.linalg.matrix_norm(matrix(c), ord=2)
    u = torch.randn(c.power_size, generator=torch.Generator().manual_seed(4), dtype=F64)
    for _ in range(conv_module.EXACT_ITERS):
        sigma, v = c.power_step(u)
    assert abs(float(sigma) / float(top) - 1) < 1e-3, (sigma, top)
    assert v.shape == (math.prod(below),) and u.shape == (c.power_size,)
    c.weight.mul_(5.0)  # well above the cap
    assert torch.linalg.matrix_norm(matrix(c), ord=2) > 1.0
    c.cap_exact(0.5)
    assert abs(float(torch.linalg.matrix_norm(matrix(c), ord=2)) / 0.5 - 1) < 1e-3
    c = make(below, spec)
    c.weight.mul_(5.0)
    u = torch.ones(c.power_size, dtype=F64)
    for _ in range(200):
        c.cap_power(0.5, u)
    assert abs(float(torch.linalg.matrix_norm(matrix(c), ord=2)) / 0.5 - 1) < 1e-3


@pytest.mark.parametrize("below,spec", CASES, ids=IDS)
def test_the_workspace_estimate_takes_the_strided_output(below, spec):
    """The estimate's pull and statistic terms use L's real output, (H + 2p - k) // s + 1 per side, not H // s."""
    k, s, p = spec["kernel"], spec["stride"], spec["padding"]
    linear = 3 * out_size(below[1], k, s, p) * out_size(below[2], k, s, p)
    pixels = math.prod(below)
    want = 8 * 5 * max(2 * linear + pixels, 2 * (linear + pixels))
    assert Conv.workspace_bytes(below, spec, 5, 8) == want
    assert Conv.param_count(below, spec) == 3 * 2 * k * k + 3


@pytest.mark.parametrize("below,spec", TODAY, ids=TODAY_IDS)
def test_the_new_keys_defaults_are_todays_geometry(below, spec):
    """Explicit stride 1 and padding k // 2 change nothing: the same shape, L, adjoint padding and bitwise pulls;
    and the pull up is bitwise today's ops (the pooled kernel at stride p, or conv_K then max pooling)."""
    k, pool = spec["kernel"], spec.get("pool", 1)
    explicit = {**spec, "stride": 1, "padding": k // 2}
    assert (
        Conv.spec_size(spec, below)
        == Conv.spec_size(explicit, below)
        == (spec["channels"], *[n // pool for n in below[1:]])
    )
    assert Conv.workspace_bytes(below, spec, 7, 4) == Conv.workspace_bytes(below, explicit, 7, 4)
    c, e = make(below, spec), make(below, explicit)
    assert torch.equal(c.weight, e.weight)
    maxpool = spec.get("pooling") == "max" and pool > 1
    stride = 1 if maxpool else pool
    assert (
        (c.stride, c.padding, c.linear_shape)
        == (e.stride, e.padding, e.linear_shape)
        == (stride, k // 2, c.linear_shape)
    )
    (_, h, w), (_, lh, lw) = below, c.linear_shape
    assert c.output_padding == e.output_padding == (h - lh * stride, w - lw * stride)  # today's formula
    lo, hi = rand(4, math.prod(below), 2), rand(4, math.prod(c.above_shape), 3)
    up = c.up(lo, torch.empty_like(hi))
    assert torch.equal(up, e.up(lo, torch.empty_like(hi)))
    kernel = c.weight if maxpool else conv_module.pooled_kernel(c.weight, pool)
    z = F.conv2d(lo.view(4, *below), kernel, c.bias_, stride=stride, padding=k // 2)
    assert torch.equal(up, (F.max_pool2d(z, pool) if maxpool else z).flatten(1))
    assert torch.equal(c.add_down(hi, lo, lo.clone()), e.add_down(hi, lo, lo.clone()))
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            c.ep_grads((lo, hi), (lo, hi * 2), 0.5).values(), e.ep_grads((lo, hi), (lo, hi * 2), 0.5).values()
        )
    )


@pytest.mark.parametrize(
    "spec,below,error",
    [
        ({"channels": 2, "stride": 2, "pool": 2}, None, r"conv stride 2 with pool 2: use one of them"),
        ({"channels": 2, "stride": 2, "pool": 2, "pooling": "max"}, None, r"conv stride 2 with pool 2"),
        ({"channels": 2, "padding": 0, "pool": 2}, None, r"conv padding 0 with pool 2: pooling assumes same padding"),
        ({"channels": 2, "kernel": 3, "padding": 3}, None, r"conv padding must be an integer in 0\.\.2 .*got 3"),
        ({"channels": 2, "kernel": 1, "padding": 1}, None, r"conv padding must be an integer in 0\.\.0 .*got 1"),
        ({"channels": 2, "padding": -1}, None, r"conv padding must be an integer"),
        ({"channels": 2, "padding": True}, None, r"conv padding must be an integer"),
        ({"channels": 2, "stride": 0}, None, r"conv stride must be an integer in 1\.\.1048576, got 0"),
        ({"channels": 2, "stride": 1.5}, None, r"conv stride must be an integer"),
        ({"channels": 2, "kernel": 4, "stride": 2}, None, r"must be odd"),
        (
            {"channels": 2, "kernel": 5, "padding": 0},
            (1, 4, 6),
            r"conv kernel 5 with padding 0 and stride 1 leaves no pixel of the 4x6 image below it .*0x2",
        ),
        (
            {"channels": 2, "kernel": 3, "stride": 2, "padding": 0},
            (1, 2, 2),
            r"kernel 3 with padding 0 and stride 2 .* 2x2 image",
        ),
    ],
    ids=[
        "stride_pool",
        "stride_maxpool",
        "padding_pool",
        "padding_kernel",
        "padding_1x1",
        "negative_padding",
        "bool_padding",
        "zero_stride",
        "float_stride",
        "even_kernel",
        "too_small",
        "too_small_strided",
    ],
)
def test_a_malformed_stride_or_padding_is_refused_by_name(spec, below, error):
    with pytest.raises(ValueError, match=error):
        Conv.spec_size(spec, below)
    if below is None:
        with pytest.raises(ValueError, match=error):
            TrainConfig(layers=[{"conv": spec}])
    else:
        with pytest.raises(ValueError, match=error):
            Conv.init("1", below, spec, 1.0, torch.Generator().manual_seed(0), F64)
        with pytest.raises(ValueError, match=error):
            Conv.workspace_bytes(below, spec, 2, 8)


def test_the_largest_padding_and_a_one_pixel_output_are_accepted():
    assert Conv.spec_size({"channels": 2, "kernel": 3, "padding": 2}, (1, 4, 4)) == (2, 6, 6)
    assert Conv.spec_size({"channels": 2, "kernel": 3, "padding": 0, "stride": 2}, (1, 3, 4)) == (2, 1, 1)
    assert Conv.spec_size({"channels": 2, "pool": 2, "stride": 1, "padding": 1}, (1, 4, 4)) == (2, 2, 2)
