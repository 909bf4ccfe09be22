"""The conv1d coupling along a text context (issue 73): its pulls, EP statistic and spectral cap against autograd and
explicit matrices in float64, its spec errors, and text machines built from it: recurrent backprop is autograd's exact
gradient, centred EP follows it, and one trains and resumes bitwise from the command line."""

from __future__ import annotations

import math

import pytest
import torch
from tiny import tiny_batch, tiny_config, tiny_machine

from benchmarks.autograd_reference import cosine, exact_grads
from trainer2.learning.step import build_step
from trainer2.physics.couplings import Conv1d
from trainer2.physics.couplings import conv1d as conv1d_module
from trainer2.physics.relaxation import Relaxation
from trainer2.section import ConfigError

F64 = torch.float64
GEOMETRIES = [(3, 1), (4, 2), (2, 2), (4, 4), (1, 1), (2, 3)]  # (kernel, stride): overlapping, tiling, gapped
LENGTHS = [8, 9]
CASES = [(length, k, s) for k, s in GEOMETRIES for length in LENGTHS]
IDS = [f"k{k}s{s}_L{length}" for length, k, s in CASES]


def make(length: int, k: int, s: int, seed: int = 0) -> Conv1d:
    spec = {"channels": 3, "kernel": k, "stride": s}
    c = Conv1d.init("1", (length, 2), spec, 1.0, torch.Generator().manual_seed(seed), F64)
    c.bias_.copy_(torch.randn(3, generator=torch.Generator().manual_seed(seed + 1), dtype=F64))
    return c


def rand(rows: int, size: int, seed: int) -> torch.Tensor:
    return torch.rand(rows, size, generator=torch.Generator().manual_seed(seed), dtype=F64)


def matrix(c: Conv1d) -> torch.Tensor:
    """L as an explicit matrix: its columns are L of the unit vectors."""
    eye = torch.eye(math.prod(c.below_shape), dtype=F64)
    return c.apply(eye, None).reshape(eye.shape[0], -1).T


@pytest.mark.parametrize("length,k,s", CASES, ids=IDS)
def test_the_pull_up_is_the_textbook_convolution_by_loops(length, k, s):
    """above[t, o] = b[o] + sum_j,i W[o, j C + i] below[s t + j, i], written as loops over positions."""
    c = make(length, k, s)
    out_len = (length - k) // s + 1
    assert c.above_shape == (out_len, 3) == Conv1d.spec_size({"channels": 3, "kernel": k, "stride": s}, (length, 2))
    lo = rand(4, length * 2, 2)
    seq = lo.view(4, length, 2)
    want = torch.stack([seq[:, s * t : s * t + k].reshape(4, -1) @ c.weight.T + c.bias_ for t in range(out_len)], 1)
    got = c.up(lo, torch.empty(4, out_len * 3, dtype=F64))
    torch.testing.assert_close(got, want.reshape(4, -1), rtol=0, atol=1e-14)


@pytest.mark.parametrize("length,k,s", CASES, ids=IDS)
def test_every_pull_is_minus_the_energy_terms_gradient(length, k, s):
    c = make(length, k, s)
    lo, hi = rand(4, length * 2, 2), rand(4, math.prod(c.above_shape), 3)
    lo.requires_grad_(True), hi.requires_grad_(True)
    d_lo, d_hi = torch.autograd.grad(c.energy(lo, hi).sum(), [lo, hi])
    lo, hi = lo.detach(), hi.detach()
    base = rand(4, lo.shape[1], 4)
    torch.testing.assert_close(c.up(lo, torch.empty_like(hi)), -d_hi)
    torch.testing.assert_close(c.add_up(lo, base[:, :1].expand(4, hi.shape[1]).clone()), -d_hi - c.bias + base[:, :1])
    torch.testing.assert_close(c.add_up_linear(lo, lo, torch.zeros_like(hi)), -d_hi - c.bias)
    torch.testing.assert_close(c.down(hi, lo, base, torch.empty_like(lo)), base - d_lo)
    torch.testing.assert_close(c.add_down(hi, lo, base.clone()), base - d_lo)
    torch.testing.assert_close(c.transpose(hi), -d_lo)
    assert d_lo.norm() > 0 and (d_hi + c.bias).norm() > 0
    covered = torch.zeros(length, dtype=torch.bool)  # tokens no window covers get no pull
    for t in range(c.above_shape[0]):
        covered[s * t : s * t + k] = True
    assert not d_lo.view(4, length, 2)[:, ~covered].any()
    assert d_lo.view(4, length, 2)[:, covered].abs().amin(-1).gt(0).all()


def test_pulls_read_and_write_row_blocks_of_a_wider_buffer():
    """The workspace's layers are column blocks of one (R, total) buffer: strided rows in, strided rows out."""
    c = make(9, 4, 2)
    size, above = 18, math.prod(c.above_shape)
    buf = rand(4, 3 + size + above + 5, 9)
    lo, hi = buf[:, 3 : 3 + size], buf[:, 3 + size : 3 + size + above]
    want_up = c.up(lo.contiguous(), torch.empty(4, above, dtype=F64))
    want_down = c.add_down(hi.contiguous(), lo, lo.contiguous().clone())
    out = torch.zeros(4, 2 * above + 7, dtype=F64)[:, 7 : 7 + above]
    torch.testing.assert_close(c.up(lo, out), want_up, rtol=0, atol=0)
    keep = buf.clone()
    torch.testing.assert_close(c.add_down(hi, lo, lo), want_down, rtol=0, atol=0)
    assert torch.equal(buf[:, :3], keep[:, :3]) and torch.equal(buf[:, 3 + size :], keep[:, 3 + size :])


@pytest.mark.parametrize("length,k,s", CASES, ids=IDS)
def test_ep_statistic_is_the_difference_of_the_energy_terms_parameter_gradients(length, k, s):
    c, scale = make(length, k, s), 0.37
    size, above = length * 2, math.prod(c.above_shape)
    bp, bm, ap, am = rand(3, size, 5), rand(3, size, 6), rand(3, above, 7), rand(3, above, 8)
    leaves = {n: v.detach().clone().requires_grad_(True) for n, v in c.parameters().items()}
    cl = c.rebind(leaves)
    gp = torch.autograd.grad(cl.energy(bp, ap).sum(), list(leaves.values()))
    gm = torch.autograd.grad(cl.energy(bm, am).sum(), list(leaves.values()))
    got = c.ep_grads((bp, ap), (bm, am), scale)
    assert got.keys() == leaves.keys()
    for n, p, m in zip(leaves, gp, gm):
        assert got[n].shape == leaves[n].shape
        torch.testing.assert_close(got[n], scale * (p - m))
        assert (p - m).norm() > 0
    x = bp.clone().requires_grad_(True)
    gp = torch.autograd.grad(cl.energy(x, ap).sum(), [*leaves.values(), x])
    gm = torch.autograd.grad(cl.energy(x, am).sum(), [*leaves.values(), x])
    got, gx = c.ep_grads_clamped(bp, ap, am, scale)
    for n, p, m in zip(leaves, gp, gm):
        torch.testing.assert_close(got[n], scale * (p - m))
    torch.testing.assert_close(gx, scale * (gp[-1] - gm[-1]))
    assert c.ep_grads_clamped(bp, ap, am, scale, input_grad=False)[1] is None


@pytest.mark.parametrize("length,k,s", CASES, ids=IDS)
def test_the_spectral_cap_finds_and_bounds_the_explicit_matrixs_norm(length, k, s):
    c = make(length, k, s)
    top = torch.linalg.matrix_norm(matrix(c), ord=2)
    u = torch.randn(c.power_size, generator=torch.Generator().manual_seed(4), dtype=F64)
    for _ in range(conv1d_module.EXACT_ITERS):
        sigma, v = c.power_step(u)
    assert abs(float(sigma) / float(top) - 1) < 1e-3, (sigma, top)
    c.weight.mul_(5.0)
    c.cap_exact(0.5)
    assert abs(float(torch.linalg.matrix_norm(matrix(c), ord=2)) / 0.5 - 1) < 1e-3
    for clip in (False, True):
        c = make(length, k, s)
        c.weight.mul_(5.0)
        u = torch.ones(c.power_size, dtype=F64)
        for _ in range(200):
            c.cap_power(0.5, u, clip=clip)
        assert float(torch.linalg.matrix_norm(matrix(c), ord=2)) < 0.5 * 1.03, clip


def test_the_estimates_count_what_it_learns_and_allocates():
    spec = {"channels": 3, "kernel": 4, "stride": 2}
    learned = sum(t.numel() for t in make(9, 4, 2).parameters().values())
    assert Conv1d.param_count((9, 2), spec) == 3 * 4 * 2 + 3 == learned
    assert Conv1d.workspace_bytes((9, 2), spec, 5, 8) == 8 * 5 * 2 * (3 * 4 * 2 + 3 * 3)


@pytest.mark.parametrize(
    "spec,below,message",
    [
        (16, (8, 2), r"spec must be a mapping"),
        ({"channels": 2, "pool": 2}, (8, 2), r"unknown conv1d key\(s\) \['pool'\]"),
        ({"kernel": 3}, (8, 2), r"needs `channels`"),
        ({"channels": 0}, (8, 2), r"conv1d channels must be an integer"),
        ({"channels": 2, "stride": True}, (8, 2), r"conv1d stride must be an integer"),
        ({"channels": 2, "kernel": 9}, (8, 2), r"kernel 9 is longer than the 8 positions"),
        ({"channels": 2}, (16,), r"needs a sequence-shaped layer \(L, C\) below it, got shape \(16,\)"),
        ({"channels": 2}, (1, 4, 4), r"images \(C, H, W\)"),
    ],
)
def test_bad_specs_are_refused_saying_why(spec, below, message):
    with pytest.raises(ValueError, match=message):
        Conv1d.spec_size(spec, below)


# --- text machines of conv1d couplings ---

TEXT = [{"conv1d": {"channels": 4, "kernel": 2, "stride": 2}}, {"conv1d": {"channels": 3, "kernel": 3}}, {"dense": 6}]


def text_case(layers=TEXT, **overrides):
    cfg = tiny_config(layers=layers, context_len=8, **overrides)
    m = tiny_machine(cfg)
    return cfg, m, *tiny_batch(cfg)


def test_a_text_machines_input_is_its_context_token_major():
    cfg, m, x, _ = text_case()
    first = m.energy.couplings[0]
    assert first.below_shape == (8, 3) and first.above_shape == (4, 4) and m.context_len == 8
    assert [c.above_shape for c in m.energy.couplings[1:-1]] == [(2, 3), (6,)]
    rows = m.input_vectors(x).view(x.shape[0], 8, 3)
    assert torch.equal(rows[:, 5], m.emb[x[:, 5]])  # token 5's embedding is the sixth C-block of the row


@pytest.mark.parametrize("relaxation", ["jacobi", "even_odd"])
def test_rbp_is_autograds_exact_gradient_on_a_conv1d_text_machine(relaxation):
    """In float64 the adjoint's gradient has cosine >= 0.9999 to autograd's through the unrolled free window, for every
    parameter, the embedding included (its gradient flows through the first conv1d's adjoint)."""
    cfg, m, x, y = text_case(free_steps=30, nudge_steps=30, relaxation=relaxation)
    step = build_step(m, cfg, cfg, cfg.batch_size, rule="rbp")
    with torch.no_grad():
        est = step.gradients(step.relax, x, y).grads
    c = cfg
    ref, _ = exact_grads(m, x, y, c.free_steps, c.dt, c.gamma, c.mass, c.retrieval_beta, c.eps, c.relaxation)
    assert est.keys() == ref.keys() and "emb" in ref and "W_1" in ref
    for name, g in ref.items():
        assert g.norm() > 0, name
        assert cosine(est[name], g) >= 0.9999, (name, cosine(est[name], g))


def test_centred_ep_follows_the_exact_gradient_on_a_conv1d_text_machine():
    from trainer2.learning.gradients import ep_gradients

    cfg, m, x, y = text_case(beta_nudge=1e-2, free_steps=60, nudge_steps=60)
    with torch.no_grad():
        est = ep_gradients(Relaxation(m, cfg, cfg.batch_size), x, y).grads
    c = cfg
    ref, _ = exact_grads(m, x, y, c.free_steps, c.dt, c.gamma, c.mass, c.retrieval_beta, c.eps)
    for name, g in ref.items():
        assert cosine(est[name], g) > 0.999, (name, cosine(est[name], g))


def test_the_reference_takes_the_conv1d_pulls_and_the_energys_gradient_alike():
    """The autograd reference's two force modes agree on a conv1d machine (its `up` and `down` are the pulls)."""
    cfg, m, x, y = text_case(free_steps=20, nudge_steps=20)
    c = cfg
    a, _ = exact_grads(m, x, y, c.free_steps, c.dt, c.gamma, c.mass, c.retrieval_beta, c.eps, forces="energy")
    b, _ = exact_grads(m, x, y, c.free_steps, c.dt, c.gamma, c.mass, c.retrieval_beta, c.eps, forces="pulls")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-10, atol=1e-12)


def test_a_conv1d_above_a_dense_layer_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"layer 1 \(conv1d\): a conv1d layer needs a sequence-shaped layer"):
        text_case(layers=[{"dense": 6}, {"conv1d": {"channels": 2}}, {"dense": 4}])


def test_a_conv1d_text_machine_trains_and_resumes_bitwise_from_the_command_line(tmp_path, capsys):
    from safetensors.torch import load_file

    from trainer2.cli import main

    cfg = tmp_path / "seq.yaml"
    cfg.write_text(
        "layers:\n  - {conv1d: {channels: 4, kernel: 4, stride: 4}}\n"
        "  - {conv1d: {channels: 4, kernel: 2, stride: 2}}\n  - {dense: 8}\ncontext_len: 16\nembed_dim: 4\n"
    )
    common = ["--config", str(cfg), "--checkpoint_dir", str(tmp_path / "ck"), "--coord_dim_n", "4", "--rotor_k", "3"]
    common += ["--batch_size", "8", "--free_steps", "4", "--nudge_steps", "2", "--relaxation", "even_odd"]
    assert main([*common, "--run_name", "whole", "--max_windows", "6"]) == 0
    assert main([*common, "--run_name", "cut", "--max_windows", "3"]) == 0
    resume = ["--resume", "latest", "--checkpoint_dir", str(tmp_path / "ck"), "--run_name", "cut", "--max_windows", "6"]
    assert main(resume) == 0
    assert "resumed from" in capsys.readouterr().out
    whole, cut = (
        load_file(str(tmp_path / "ck" / n / "step_00000006" / "tensors.safetensors")) for n in ("whole", "cut")
    )
    assert whole["param.W_1"].shape == (4, 4 * 4) and whole["param.W_2"].shape == (4, 2 * 4)
    for k in whole:
        assert torch.equal(whole[k], cut[k]), k
