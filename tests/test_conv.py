"""The convolutional coupling: its pulls, EP statistic and spectral cap against autograd and explicit matrices."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from tiny import tiny_config

from benchmarks.autograd_reference import cosine, exact_grads_energy, pull_forces
from trainer2.learning.gradients import ep_gradients
from trainer2.learning.step import build_step
from trainer2.physics.couplings import Conv
from trainer2.physics.couplings import conv as conv_module
from trainer2.physics.energy import Energy, energy
from trainer2.physics.machine import build_machine
from trainer2.physics.relaxation import Relaxation
from trainer2.running.step_runner import StepRunner
from trainer2.train_config import ConfigError, TrainConfig

F64 = torch.float64
# (below shape, spec): pooling that divides the image, that drops a row and column (9 by 2), stride-1 (pool 1), pool 3
CASES = [
    ((2, 8, 8), {"channels": 3, "kernel": 3, "pool": 2}),
    ((1, 9, 9), {"channels": 2, "kernel": 5, "pool": 2}),
    ((3, 5, 5), {"channels": 2, "kernel": 3}),
    ((2, 9, 7), {"channels": 2, "kernel": 3, "pool": 3}),
    ((2, 8, 8), {"channels": 3, "kernel": 3, "pool": 2, "pooling": "max"}),
    ((1, 9, 7), {"channels": 2, "kernel": 5, "pool": 3, "pooling": "max"}),
]
IDS = ["pool2", "pool2_odd", "pool1", "pool3", "max2", "max3_odd"]


def make(below, spec, seed: int = 0) -> Conv:
    c = Conv.init("1", below, spec, 1.0, torch.Generator().manual_seed(seed), F64)
    c.bias_.copy_(torch.randn(c.bias_.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=F64))
    return c


def rand(rows: int, size: int, seed: int) -> torch.Tensor:
    return torch.rand(rows, size, generator=torch.Generator().manual_seed(seed), dtype=F64)


def matrix(c: Conv) -> torch.Tensor:
    """The linear part L (A; conv_K under max pooling) as an explicit matrix: its columns are L of the unit vectors."""
    return c.linear(torch.eye(math.prod(c.below_shape), dtype=F64)).T


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
    torch.testing.assert_close(c.down(hi, lo, base, torch.empty_like(lo)), base - d_lo)
    torch.testing.assert_close(c.add_down(hi, lo, base.clone()), base - d_lo)
    assert d_lo.norm() > 0 and (d_hi + c.bias).norm() > 0  # nothing trivially zero


def piece_energy(c: Conv, below: torch.Tensor, above: torch.Tensor, where: torch.Tensor | None) -> torch.Tensor:
    """The term per row; under max pooling on the linear piece of the argmax positions `where`: conv_K(below) + b read
    there, whichever window maximum `below` itself has."""
    if where is None:
        return c.energy(below, above)
    z = F.conv2d(c.image(below), c.weight, c.bias_, padding=c.padding).flatten(2)
    return -(above * z.gather(2, where.flatten(2)).flatten(1)).sum(1)


@pytest.mark.parametrize("shared", [True, False], ids=["free_piece", "own_pieces"])
@pytest.mark.parametrize("below,spec", CASES, ids=IDS)
def test_ep_statistic_is_the_difference_of_the_energy_terms_parameter_gradients(below, spec, shared):
    """ep_grads = scale (dE/dtheta(s+) - dE/dtheta(s-)) exactly: under max pooling on the linear piece of `at` (the
    free equilibrium's argmax for both phases), or with at None each phase on its own; the clamped form's gradient in
    x matches too."""
    c, scale = make(below, spec), 0.37
    size = math.prod(c.below_shape)
    above = math.prod(c.above_shape)
    bp, bm, ap, am, s0 = rand(3, size, 5), rand(3, size, 6), rand(3, above, 7), rand(3, above, 8), rand(3, size, 12)
    at = s0 if shared else None
    if not c.maxpool:
        wp = wm = None
    elif shared:
        wp = wm = c.argmax(s0)
    else:
        wp, wm = c.argmax(bp), c.argmax(bm)
    if c.maxpool:  # the phases' own argmax differ from each other's and s0's: the cases the choice tells apart
        assert (c.argmax(bp) != c.argmax(s0)).any() and (c.argmax(bm) != c.argmax(bp)).any()
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in c.parameters().items()}
    cl = c.rebind(leaves)
    gp = torch.autograd.grad(piece_energy(cl, bp, ap, wp).sum(), list(leaves.values()))
    gm = torch.autograd.grad(piece_energy(cl, bm, am, wm).sum(), list(leaves.values()))
    want = {k: scale * (p - m) for k, p, m in zip(leaves, gp, gm)}
    got = c.ep_grads((bp, ap), (bm, am), scale, at)
    for k in want:
        torch.testing.assert_close(got[k], want[k])
    x = bp.clone().requires_grad_(True)
    gp = torch.autograd.grad(cl.energy(x, ap).sum(), [*leaves.values(), x])
    gm = torch.autograd.grad(cl.energy(x, am).sum(), [*leaves.values(), x])
    got, gx = c.ep_grads_clamped(bp, ap, am, scale)
    for k, p, m in zip(leaves, gp, gm):
        torch.testing.assert_close(got[k], scale * (p - m))
    torch.testing.assert_close(gx, scale * (gp[-1] - gm[-1]))


@pytest.mark.parametrize(
    "below,spec", [case for case in CASES if case[1].get("pooling") == "max"], ids=["max2", "max3_odd"]
)
def test_max_pooled_statistic_has_no_jump_where_the_phases_argmax_differ(below, spec):
    """Phases m +- t v about the free state m, one upper layer: the statistic is -2 t scale corr(unpool(a), v), linear
    in t, also at a t that routes windows differently in the two phases (each phase at its own argmax adds a jump of
    O(1) / t there)."""
    c, scale = make(below, spec), 0.37
    m, v = rand(3, math.prod(c.below_shape), 9), rand(3, math.prod(c.below_shape), 10) - 0.5
    a = rand(3, math.prod(c.above_shape), 11)
    assert (c.argmax(m + 0.05 * v) != c.argmax(m - 0.05 * v)).any()  # at t = 0.05 some windows flip; at 5e-6 none

    def per_t(t: float, at: torch.Tensor | None) -> torch.Tensor:
        return c.ep_grads((m + t * v, a), (m - t * v, a), scale, at)[f"W_{c.name}"] / t

    torch.testing.assert_close(per_t(0.05, m), per_t(0.05e-4, m))
    assert per_t(0.05, m).norm() > 0
    own = per_t(0.05, None) - per_t(0.05e-4, None)  # each phase at its own argmax: the flips' jump
    assert own.norm() > 0.1 * per_t(0.05, m).norm()


@pytest.mark.parametrize("below,spec", CASES, ids=IDS)
def test_spectral_cap_bounds_the_operator_norm_of_the_explicit_matrix(below, spec):
    c = make(below, spec)
    c.weight.mul_(5.0)  # well above the cap
    norm = torch.linalg.matrix_norm(matrix(c), ord=2)
    u = torch.ones(c.power_size, dtype=F64)
    for _ in range(200):
        c.cap_power(0.5, u)
    capped = torch.linalg.matrix_norm(matrix(c), ord=2)
    assert norm > 1.0 and 0.5 * (1 - 1e-3) < capped < 0.5 * (1 + 1e-3), (norm, capped)
    c = make(below, spec)
    c.weight.mul_(5.0)
    c.cap_exact(0.5)
    assert 0.5 * (1 - 1e-3) < torch.linalg.matrix_norm(matrix(c), ord=2) < 0.5 * (1 + 1e-3)
    c.cap_exact(10.0)  # a cap above the norm leaves the coupling alone
    assert torch.linalg.matrix_norm(matrix(c), ord=2) < 0.5 * (1 + 1e-3)


def test_capped_max_pooling_pull_moves_no_more_than_the_cap_allows():
    """Max pooling is 1-Lipschitz, so capping conv_K at 0.5 bounds |up(x) - up(y)| by 0.5 |x - y|, and the bound is
    nearly reached (the cap is not vacuous)."""
    c = make((2, 8, 8), {"channels": 3, "kernel": 3, "pool": 2, "pooling": "max"})
    c.weight.mul_(5.0)
    c.cap_exact(0.5)
    x = rand(64, 128, 11)
    # y - x along L's top right-singular vector, so the linear part stretches it by the cap
    v = torch.linalg.svd(matrix(c)).Vh[0]
    y = x + 1e-4 * v
    up = c.apply
    ratios = (up(y, None) - up(x, None)).flatten(1).norm(dim=1) / (y - x).norm(dim=1)
    assert ratios.max() <= 0.5 * (1 + 1e-3) and ratios.max() > 0.25, ratios
    z = rand(64, 128, 12)
    assert ((up(z, None) - up(x, None)).flatten(1).norm(dim=1) <= 0.5 * (1 + 1e-3) * (z - x).norm(dim=1)).all()


@pytest.mark.parametrize(
    "spec,error",
    [
        (16, "must be a mapping"),
        ({"kernel": 3}, "needs `channels`"),
        ({"channels": 4, "kernel": 4}, "must be odd"),
        ({"channels": 4, "dilation": 2}, "unknown conv key"),
        ({"channels": 0}, r"channels must be an integer in 1\.\.1048576, got 0"),
        ({"channels": 2, "kernel": 99999999999999999999}, r"kernel must be an integer in 1\.\.1048576"),
        ({"channels": 2, "pool": True}, "pool must be an integer"),
        ({"channels": 2, "pool": 2, "pooling": "min"}, r"conv pooling must be one of \['avg', 'max'\], got 'min'"),
    ],
    ids=["int", "no_channels", "even_kernel", "unknown_key", "zero_channels", "huge_kernel", "bool_pool", "pooling"],
)
def test_config_refuses_a_malformed_conv_entry(spec, error):
    with pytest.raises(ValueError, match=error):
        TrainConfig(layers=[{"conv": spec}])


def test_conv_above_flat_data_is_a_config_error_naming_the_layer():
    cfg = TrainConfig(layers=[{"dense": 8}, {"conv": {"channels": 2}}])
    with pytest.raises(ConfigError, match=r"layers: layer 1 \(conv\): a conv layer needs an image-shaped layer"):
        build_machine(cfg, 3, 12, False, torch.device("cpu"), (3, 2, 2), seed=cfg.seed)


def conv_machine(layers, image=(2, 6, 6), **overrides):
    cfg = TrainConfig(**{**tiny_config().model_dump(), "layers": layers, **overrides})
    m = build_machine(cfg, 5, math.prod(image), False, torch.device("cpu"), image, seed=cfg.seed)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for c in m.energy.couplings:
            c.bias_.copy_(torch.randn(c.bias_.shape, generator=gen, dtype=F64) * 0.3)
        m.readout.theta.copy_(torch.randn(m.readout.theta.shape, generator=gen, dtype=F64))
        m.readout.g_diag.copy_(torch.rand(m.readout.g_diag.shape, generator=gen, dtype=F64) * 1.5 + 0.5)
    x = torch.rand(cfg.batch_size, math.prod(image), generator=gen, dtype=F64)
    return cfg, m, x, torch.randint(0, 5, (cfg.batch_size,), generator=gen)


@pytest.mark.parametrize(
    "layers",
    [
        [{"conv": {"channels": 3, "kernel": 3, "pool": 2}}],
        [{"conv": {"channels": 3, "kernel": 3, "pool": 2}}, {"conv": {"channels": 2, "kernel": 3}}, {"dense": 6}],
        [{"conv": {"channels": 3, "kernel": 3, "pool": 2, "pooling": "max"}}],
        [{"conv": {"channels": 3, "kernel": 3}}, {"conv": {"channels": 2, "kernel": 3, "pool": 2, "pooling": "max"}}],
    ],
    ids=["conv", "conv_conv_dense", "max", "conv_max"],
)
def test_symmetric_ep_matches_autograd_for_a_conv_machine(layers):
    cfg, m, x, y = conv_machine(layers, beta_nudge=1e-2, free_steps=60, nudge_steps=60)
    with torch.no_grad():
        est = ep_gradients(Relaxation(m, cfg, cfg.batch_size), x, y).grads
    ref, _ = exact_grads_energy(m, x, y, cfg.free_steps, cfg.dt, cfg.gamma, cfg.mass, cfg.retrieval_beta, cfg.eps)
    assert set(est) == set(m.named_params())
    for name, g in est.items():
        assert ref[name].norm() > 0, name
        assert cosine(g, ref[name]) > 0.999, (name, cosine(g, ref[name]))


@pytest.mark.parametrize("order", ["jacobi", "even_odd"])
@pytest.mark.parametrize(
    "layers,image",
    [
        ([{"conv": {"channels": 3, "kernel": 3, "pool": 2}}, {"conv": {"channels": 2, "kernel": 3}}], (2, 6, 6)),
        # a 7 x 7 plane pooled to 3 x 3 above the first coupling: the adjoint gives the dropped row and column back
        ([{"conv": {"channels": 3, "kernel": 3}}, {"conv": {"channels": 2, "kernel": 3, "pool": 2}}], (2, 7, 7)),
        (  # the conv preset's shape of chain: kernel 5, two poolings, a dense layer
            [
                {"conv": {"channels": 3, "kernel": 5, "pool": 2}},
                {"conv": {"channels": 2, "kernel": 3, "pool": 2}},
                {"dense": 6},
            ],
            (1, 8, 8),
        ),
        (
            [
                {"conv": {"channels": 3, "kernel": 3}},
                {"conv": {"channels": 2, "kernel": 3, "pool": 2, "pooling": "max"}},
            ],
            (2, 7, 7),
        ),
    ],
    ids=["avg_conv", "avg_odd", "k5_avg_avg_dense", "odd_max"],
)
def test_the_exact_reference_through_the_pulls_is_the_one_through_the_energy(layers, image, order):
    """The quality benchmark's exact gradient takes the couplings' pulls (one backward) for speed: its forces and
    its gradients are autograd's through the energy (a double backward), at every layer."""
    cfg, m, x, y = conv_machine(layers, image)
    s = [torch.rand(x.shape[0], n, dtype=F64, requires_grad=True) for n in m.energy.state_sizes()]
    every = list(range(len(s)))
    by_energy = torch.autograd.grad(energy(s, x, m.energy).sum(), s)
    for i, f in enumerate(pull_forces(s, x, m.energy, every)):
        torch.testing.assert_close(f, -by_energy[i], rtol=1e-12, atol=1e-12)
    odd_only = pull_forces(s, x, m.energy, [0])  # a group's layers move; the rest get no force
    assert all(not f.any() for f in odd_only[1:]) and torch.equal(odd_only[0], pull_forces(s, x, m.energy, every)[0])
    args = (m, x, y, 12, cfg.dt, cfg.gamma, cfg.mass, cfg.retrieval_beta, cfg.eps, order)
    ref, ref_loss = exact_grads_energy(*args, forces="energy")
    got, loss = exact_grads_energy(*args, forces="pulls")
    assert got.keys() == ref.keys() == set(m.named_params())
    for name in ref:
        assert ref[name].norm() > 0, name
        torch.testing.assert_close(got[name], ref[name], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)


@pytest.mark.parametrize("below,spec", CASES, ids=IDS)
def test_a_windows_derived_kernel_is_the_per_pull_kernel_and_a_rebind_drops_it(below, spec):
    c = make(below, spec)
    w = c.with_kernel()
    lo, hi = rand(4, math.prod(c.below_shape), 2), rand(4, math.prod(c.above_shape), 3)
    assert torch.equal(w.up(lo, torch.empty_like(hi)), c.up(lo, torch.empty_like(hi)))
    assert torch.equal(w.add_down(hi, lo, lo.clone()), c.add_down(hi, lo, lo.clone()))
    assert w.kernel is not None and torch.equal(w.kernel, c.linear_kernel())
    assert w.rebind({"W_1": c.weight.mul(2), "b_1": c.bias_}).kernel is None  # a new K never meets an old K'


def test_the_window_derives_the_pooled_kernel_once_and_a_conv_run_is_unchanged(monkeypatch):
    """Bitwise the same steps with the kernel derived at every pull, across updates (the kernel is the window's)."""
    layers = [{"conv": {"channels": 3, "kernel": 3, "pool": 2}}, {"conv": {"channels": 2, "kernel": 3, "pool": 2}}]
    runs = []
    for per_pull in (False, True):
        if per_pull:
            monkeypatch.setattr(Energy, "for_window", lambda self: self)
        # three Jacobi nudged steps: the nudge reaches h_1 (with two, W_1's EP statistic is 0)
        cfg, m, x, y = conv_machine(layers, image=(2, 12, 12), free_steps=4, nudge_steps=3)
        step = build_step(m, cfg, cfg, cfg.batch_size)
        calls = []
        real = conv_module.pooled_kernel
        monkeypatch.setattr(conv_module, "pooled_kernel", lambda w, p: calls.append(1) or real(w, p))
        with torch.no_grad():
            for _ in range(3):
                step.step(x, y)
        monkeypatch.setattr(conv_module, "pooled_kernel", real)
        runs.append(([t.clone() for t in m.named_params().values()], len(calls)))
    (cached, n_cached), (per_pull, n_per_pull) = runs
    assert all(torch.equal(a, b) for a, b in zip(cached, per_pull))
    fresh = conv_machine(layers, image=(2, 12, 12))[1].energy.couplings
    assert all((w - c.weight).abs().max() > 1e-4 for w, c in zip(cached[:4:2], fresh[:2], strict=True))  # it learned
    assert n_cached <= n_per_pull / 2  # once per coupling and window, not at every pull (the cap's own remain)


def test_a_conv_step_traces_whole_under_dynamo_and_equals_eager():
    """The window's derived kernel (a dataclass replace inside the step) must not break torch.compile's fullgraph
    trace: a graph break would make the runner fall back to eager, warning. aot_eager keeps it fast on the CPU."""
    layers = [{"conv": {"channels": 3, "kernel": 3, "pool": 2}}, {"conv": {"channels": 2, "kernel": 3, "pool": 2}}]
    steps, logs = [], []
    for compiled in (False, True):
        cfg, m, x, y = conv_machine(layers, image=(2, 12, 12), free_steps=4, nudge_steps=2)
        step = build_step(m, cfg, cfg, cfg.batch_size)
        runner = StepRunner(step, compile=compiled, compile_backend="aot_eager", log=logs.append)
        with torch.no_grad():
            for _ in range(2):
                runner.step(x, y)
        steps.append((runner.mode, list(m.named_params().values())))
    (_, eager), (mode, traced) = steps
    assert logs == [] and mode == "compile"
    for a, b in zip(eager, traced):  # float64: the decomposed convolutions sum in another order (1e-8 relative seen)
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)
