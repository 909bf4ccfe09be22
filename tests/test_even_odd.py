"""Even/odd relaxation (--relaxation even_odd) against the Jacobi sweep: the same fixed point, the exact relation
between the two orders, about half the steps to a given residual, the EP gradient, its operators and buffers."""

from __future__ import annotations

import pytest
import torch
from test_conv import conv_machine
from tiny import tiny_batch, tiny_config, tiny_machine

from benchmarks.autograd_reference import cosine, exact_grads, relax
from trainer2.learning.gradients import ep_gradients
from trainer2.physics.couplings import Conv, Dense
from trainer2.physics.dynamics import Integrator, even_odd_steps, fixed_point_steps
from trainer2.physics.relaxation import Relaxation
from trainer2.running.bench import profile_call
from trainer2.train_config import ConfigError, build_config

DENSE = [[12], [9, 7], [9, 7, 6]]
CONV = {
    "conv_avg": [{"conv": {"channels": 3, "kernel": 3, "pool": 2}}, {"conv": {"channels": 2, "kernel": 3}}],
    # the coupling above h_1 is max-pooled: its pull on h_1 reads h_1's own argmax
    "conv_max": [
        {"conv": {"channels": 3, "kernel": 3}},
        {"conv": {"channels": 2, "kernel": 3, "pool": 2, "pooling": "max"}},
    ],
}
# three conv layers, the top one max-pooled: h_2, a middle layer, is staged; its energy is not convex in h_2 (for
# h_3 >= 0, -h_3 . maxpool(conv h_2) is concave), and the two orders settle in different equilibria
MAX3 = [
    {"conv": {"channels": 3, "kernel": 3}},
    {"conv": {"channels": 2, "kernel": 3}},
    {"conv": {"channels": 2, "kernel": 3, "pool": 2, "pooling": "max"}},
]
# two max-pooled couplings in a row (the DCHN pattern): h_2's pull from below finds an argmax while its pull from above
# takes the one h_3's up pull found
MAXMAX = [
    {"conv": {"channels": 3, "kernel": 3}},
    {"conv": {"channels": 2, "kernel": 3, "pool": 2, "pooling": "max"}},
    {"conv": {"channels": 2, "kernel": 3, "pool": 2, "pooling": "max"}},
]
MACHINES = [f"dense{len(h)}" for h in DENSE] + list(CONV)


def machine(name: str, order: str, **overrides):
    """(cfg, machine, inputs, targets) of a tiny float64 machine by name, relaxing in `order`."""
    overrides = {"relaxation": order, "beta_nudge": 0.05, **overrides}
    if name in CONV or name in ("max3", "maxmax"):
        return conv_machine({"max3": MAX3, "maxmax": MAXMAX}.get(name) or CONV[name], **overrides)
    cfg = tiny_config(hidden_sizes=DENSE[int(name.removeprefix("dense")) - 1], **overrides)
    return (cfg, tiny_machine(cfg), *tiny_batch(cfg))


def relaxed(name: str, order: str, steps: int, nudged: bool) -> list[torch.Tensor]:
    """The state after a free phase of `steps` steps (nudged: then the stacked nudged phases of `steps` steps, after a
    converged free phase)."""
    cfg, m, x, y = machine(name, order, free_steps=300 if nudged else steps, nudge_steps=steps)
    r = Relaxation(m, cfg, cfg.batch_size)
    with torch.no_grad():
        free = r.free_phase(x, y)
        if not nudged:
            return [t.clone() for t in r.s0.s]
        r.nudged_phases(free)
    return [t.clone() for t in r.ws_nudged.state.s]


def distance(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((u - v).abs().max()) for u, v in zip(a, b, strict=True))


@pytest.mark.parametrize("name", MACHINES)
def test_even_odd_reaches_the_jacobi_fixed_point(name):
    for nudged in (False, True):
        jacobi, even_odd = relaxed(name, "jacobi", 300, nudged), relaxed(name, "even_odd", 300, nudged)
        assert distance(jacobi, even_odd) < 1e-12, (nudged, distance(jacobi, even_odd))
        assert distance(jacobi, relaxed(name, "jacobi", 3, nudged)) > 1e-4  # three steps are far from it


@pytest.mark.parametrize("name", ["dense1", "dense2", "dense3", "conv_avg"])
def test_a_free_even_odd_step_is_two_jacobi_steps(name):
    """From rest, the Jacobi sweep runs two interleaved even/odd sequences: after k even/odd steps the even layers
    (h_2, ..., and q when M + 1 is even) are Jacobi's after 2k steps, the odd ones Jacobi's after 2k - 1. This pins
    the order (odd first; q from the h_M of its turn) layer by layer."""
    cfg, m, x, y = machine(name, "jacobi", free_steps=8)
    jac = Relaxation(m, cfg, cfg.batch_size)
    with torch.no_grad():
        free = jac.free_phase(x, y)
        jac.ws.state.zero_()
        history = [[t.clone() for t in jac.ws.state.s]]
        for t in range(8):
            jac.run(jac.ws, free, t, 1, False)
            history.append([t.clone() for t in jac.ws.state.s])
    for k in (1, 2, 4):
        got = relaxed(name, "even_odd", k, False)
        for j, layer in enumerate(got):  # layer j is h_{j+1}: odd for even j
            want = history[2 * k - 1 if j % 2 == 0 else 2 * k][j]
            torch.testing.assert_close(layer, want, rtol=1e-13, atol=1e-15, msg=f"k {k}, layer {j}")


@pytest.mark.parametrize("name", MACHINES)
def test_even_odd_needs_about_half_the_steps_to_a_given_residual(name):
    """Distance to the fixed point after k even/odd steps against Jacobi's: free, at most Jacobi's after 2k - 1
    steps; nudged (q's readout pull is at its own old value, which even/odd moves once a step), after 2k - 2."""
    for nudged, lag in ((False, 1), (True, 2)):
        star = relaxed(name, "jacobi", 300, nudged)
        for k in (3, 5):
            eo = distance(relaxed(name, "even_odd", k, nudged), star)
            jacobi = distance(relaxed(name, "jacobi", 2 * k - lag, nudged), star)
            same_steps = distance(relaxed(name, "jacobi", k, nudged), star)
            assert eo <= jacobi < same_steps, (nudged, k, eo, jacobi, same_steps)


def test_a_layer_under_max_pooling_steps_from_its_old_argmax():
    """max3's h_2 sits under a max-pooled coupling, so its even/odd step goes through a buffer: the pull from h_3 is
    placed at the argmax of the old h_2, formed before the pull from h_1 is written (as written out here by hand)."""
    cfg, m, x, y = machine("max3", "even_odd", free_steps=2)
    r = Relaxation(m, cfg, cfg.batch_size)
    assert [t.shape for t in r.ws.temp] == [r.ws.state.s[1].shape]  # the staged layer h_2, nothing else
    c2, c3, c_out = m.energy.couplings[1:]
    with torch.no_grad():
        free = r.free_phase(x, y)
        h1, h2, h3, q = (t.clone() for t in r.ws.state.s)
        new_h1 = (r.ws.drive + c2.adjoint(h2, h1).flatten(1)).clamp(0.0, 1.0)
        new_h3 = (c3.apply(h2, c3.bias_).flatten(1) + q @ c_out.weight).clamp(0.0, 1.0)
        from_below = c2.apply(new_h1, c2.bias_).flatten(1)
        pull = c3.adjoint(new_h3, h2).flatten(1)  # at the old h_2's argmax
        new_h2 = (from_below + pull).clamp(0.0, 1.0)
        new_q = new_h3 @ c_out.weight.T + c_out.bias  # q = h_4 is even: from the new h_3
        r.run(r.ws, free, 0, 1, False)  # one more step from the state the phase left
    for got, want in zip(r.ws.state.s, (new_h1, new_h2, new_h3, new_q), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-15)
    # written in place, the pull would sit at the argmax of the half-written layer (its pull from below): not the same
    assert not torch.allclose(pull, c3.adjoint(new_h3, from_below).flatten(1))
    assert not torch.equal(pull, c3.adjoint(new_h3, new_h2).flatten(1))  # and the argmax moved in this step


@pytest.mark.parametrize("name", ["conv_max", "max3", "maxmax"])
def test_max_pooling_convolves_for_its_argmax_only_where_no_up_pull_found_it(name, monkeypatch):
    """Even/odd: the pull through a max-pooled coupling on its layer below is placed at the argmax its up pull found at
    that layer's current value (`Conv.up_reading`), so it convolves that layer again only where no up pull has run
    since it changed: never in a free phase (from rest the first half has no pull from above), and in the nudged phases
    only before the first up pull (their first step's pulls are formed on one block of rows, without reads): max3's
    pooled layer h_3 moves in the first half, conv_max's h_2 in the second, after h_1's pull down. The states are
    bitwise those of convolving every time."""
    calls = []
    argmax = Conv.argmax

    def counted(self, below):
        calls.append(below.shape[0])
        return argmax(self, below)

    monkeypatch.setattr(Conv, "argmax", counted)
    steps, runs = 4, {}
    for reads in (True, False):
        if not reads:
            monkeypatch.delattr(Conv, "up_reading")  # a coupling that cannot tell: every pull down convolves
        cfg, m, x, y = machine(name, "even_odd", free_steps=steps, nudge_steps=steps)
        r = Relaxation(m, cfg, cfg.batch_size)
        with torch.no_grad():
            calls.clear()
            free = r.free_phase(x, y)
            free_calls = len(calls)
            r.nudged_phases(free)
        runs[reads] = (free_calls, len(calls) - free_calls, [t.clone() for t in r.ws_nudged.state.s])
    # (free, nudged) argmax convolutions with reads and without; from rest conv_max's h_1 has no pull from above
    want = {
        "conv_max": ((0, 2), (steps - 1, steps)),
        "max3": ((0, 1), (steps, steps)),
        "maxmax": ((0, 3), (2 * steps - 1, 2 * steps)),  # two pulls down through max pooling a step
    }[name]
    assert (runs[True][:2], runs[False][:2]) == want
    for got, want in zip(runs[True][2], runs[False][2], strict=True):
        assert torch.equal(got, want)


def test_under_max_pooling_each_order_settles_in_an_equilibrium_of_both():
    """Max pooling makes the equilibrium non-unique (max3: the two orders end up to 1e-2 apart); what each order
    reaches is still a fixed point of both orders' steps (a consistent argmax), not an artefact of one of them."""
    ends = {order: relaxed("max3", order, 300, False) for order in ("jacobi", "even_odd")}
    for end, order in ((ends["even_odd"], "jacobi"), (ends["jacobi"], "even_odd")):
        cfg, m, x, y = machine("max3", order, free_steps=1)
        r = Relaxation(m, cfg, cfg.batch_size)
        with torch.no_grad():
            free = r.free_phase(x, y)
            for t, e in zip(r.ws.state.s, end, strict=True):
                t.copy_(e)
            r.run(r.ws, free, 0, 1, False)
        assert distance(r.ws.state.s, end) < 1e-12, order
    assert distance(ends["jacobi"], ends["even_odd"]) > 1e-3  # two equilibria: the order picks one


@pytest.mark.parametrize("name", MACHINES)
def test_even_odd_ep_gradient_matches_autograd(name):
    """EP through even/odd phases against autograd's gradient of the loss through the unrolled even/odd free window."""
    cfg, m, x, y = machine(name, "even_odd", beta_nudge=1e-3, free_steps=25, nudge_steps=25)
    with torch.no_grad():
        est = ep_gradients(Relaxation(m, cfg, cfg.batch_size), x, y).grads
    ref, _ = exact_grads(m, x, y, cfg.free_steps, 1.0, 1.0, 1.0, cfg.retrieval_beta, cfg.eps, "even_odd")
    assert set(est) == set(m.named_params())
    for k, g in est.items():
        assert ref[k].norm() > 0, k
        assert cosine(g, ref[k]) > 0.999, (k, cosine(g, ref[k]))


def test_the_autograd_reference_unrolls_the_trainers_even_odd_window():
    """A few steps (far from the fixed point), so a reference in the other order would differ."""
    cfg, m, x, y = machine("dense3", "even_odd", free_steps=4)
    r = Relaxation(m, cfg, cfg.batch_size)
    with torch.no_grad():
        r.free_phase(x, y)
    xin = m.input_vectors(x)
    for order, same in (("even_odd", True), ("jacobi", False)):
        s = relax(xin, m.energy.weights, m.energy.biases, 4, 1.0, 1.0, 1.0, order)
        assert (distance(s, r.s0.s) < 1e-13) == same, order


@pytest.mark.parametrize("order", ["jacobi", "even_odd"])
@pytest.mark.parametrize("name", [*MACHINES, "max3"])
def test_a_free_phase_from_rest_skips_the_pulls_of_layers_at_rest_and_changes_nothing(name, order, monkeypatch):
    """The free phase starts from rest, so in its first step the layers above (Jacobi: every neighbour; even/odd: the
    other half) are 0 and their pulls vanish: skipped, one for each hidden layer that step moves (a transposed
    convolution for a conv layer, the costliest operator of its step), and the state is the one every pull gives."""
    cfg, m, x, y = machine(name, order, free_steps=3)
    r = Relaxation(m, cfg, cfg.batch_size)
    pulls = []  # "kind.method" of each pull from above formed (Conv's add_down is its add_down_read)
    for cls, methods in ((Conv, ("down", "add_down_read")), (Dense, ("down", "add_down"))):
        for method in methods:
            real = getattr(cls, method)
            spy = lambda self, *a, _real=real, _n=f"{cls.kind}.{method}": pulls.append(_n) or _real(self, *a)  # noqa: E731
            monkeypatch.setattr(cls, method, spy)
    with torch.no_grad():
        free = r.free_phase(x, y)
        skipped, from_rest = [t.clone() for t in r.s0.s], list(pulls)
        r.ws.state.zero_()
        pulls.clear()
        r.run(r.ws, free, 0, 3, False)  # the same steps from the same rest, every pull formed
        full = [t.clone() for t in r.ws.state.s]
    for a, b in zip(skipped, full, strict=True):
        assert torch.equal(a, b)
    assert all(bool(t.abs().sum() > 0) for t in full)
    depth = len(full) - 1
    first = range(depth) if order == "jacobi" else range(0, depth, 2)  # the hidden layers the first (half) step moves
    assert len(pulls) - len(from_rest) == len(first), (pulls, from_rest)
    c = m.energy.couplings  # c[j + 1] pulls on layer j; c[depth], the output's, is dense
    convs = sum(1 for j in first if isinstance(c[j + 1], Conv))

    def conv_pulls(names: list[str]) -> int:
        return sum(n.startswith("conv.") for n in names)

    assert conv_pulls(pulls) - conv_pulls(from_rest) == convs


@pytest.mark.parametrize("order", ["jacobi", "even_odd"])
@pytest.mark.parametrize("name", [*MACHINES, "max3"])
def test_the_nudged_phases_form_the_pulls_they_share_once_in_their_first_step(name, order, monkeypatch):
    """The k nudged phases start as k copies of s0 and only q's step sees the nudge, so in their first step every pull
    not read from the moved q is the same in each block: formed on one block (B rows) and copied. The phases end where
    forming every pull on all k B rows leaves them, and a conv chain's first transposed convolution runs on B rows."""
    cfg, m, x, y = machine(name, order, free_steps=3, nudge_steps=4)  # four: Jacobi's nudge reaches max3's h_1
    r = Relaxation(m, cfg, cfg.batch_size)
    rows = []  # rows of each transposed convolution of the nudged phases
    transpose, relax = Conv.transpose, Relaxation.relax
    monkeypatch.setattr(Conv, "transpose", lambda self, u, *a: rows.append(u.shape[0]) or transpose(self, u, *a))
    ends = []
    for replicas in (True, False):
        if not replicas:  # every pull on every row
            monkeypatch.setattr(Relaxation, "relax", lambda self, *a, replicas=1, **kw: relax(self, *a, **kw))
        with torch.no_grad():
            free = r.free_phase(x, y)
            rows.clear()
            r.nudged_phases(free)
        ends.append(([t.clone() for t in r.ws_nudged.state.s], list(rows)))
    (shared, shared_rows), (full, full_rows) = ends
    for a, b in zip(shared, full, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    k, rows_b = r.nudge.phases, cfg.batch_size
    for layer in (shared[0], shared[-1]):  # the nudge reached h_1 and q, differently in each phase
        assert not torch.equal(layer[:rows_b], layer[rows_b:])
    if name.startswith("dense"):
        assert shared_rows == full_rows == []
    else:
        assert shared_rows[0] == rows_b and set(full_rows) == {k * rows_b}
        assert len(shared_rows) == len(full_rows) and sum(shared_rows) < sum(full_rows)


def ops_per_step(name: str, order: str, nudged: bool) -> float:
    cfg, m, x, y = machine(name, order, free_steps=6, nudge_steps=6)
    r = Relaxation(m, cfg, cfg.batch_size)
    with torch.no_grad():
        free = r.free_phase(x, y)
        r.nudged_phases(free)
        ws = r.ws_nudged if nudged else r.ws
        ops, _ = profile_call(lambda: r.run(ws, free, 0, 6, nudged), False)
    return ops / 6


@pytest.mark.parametrize("name", ["dense1", "dense2", "dense3"])
def test_even_odd_runs_no_more_operators_and_no_temp_buffers(name):
    """bench's operator count: even/odd needs no temp copies (and one clamp per half), so a step is never dearer than
    Jacobi's and two or three hidden layers are cheaper; a dense chain has no temp buffers."""
    for nudged in (False, True):
        eo, jacobi = ops_per_step(name, "even_odd", nudged), ops_per_step(name, "jacobi", nudged)
        assert eo <= jacobi - (0 if name == "dense1" else 1), (nudged, eo, jacobi)
    cfg, m, _, _ = machine(name, "even_odd")
    r = Relaxation(m, cfg, cfg.batch_size)
    assert r.steps_fn is even_odd_steps and r.ws.temp == [] and r.ws_nudged.temp == []
    jac = Relaxation(m, cfg.model_copy(update={"relaxation": "jacobi"}), cfg.batch_size)
    assert jac.steps_fn is fixed_point_steps and len(jac.ws.temp) == len(m.energy.couplings) - 2


def test_even_odd_refuses_the_leapfrog():
    with pytest.raises(ConfigError, match=r"relaxation even_odd runs the fixed-point steps only .*--relaxation jacobi"):
        build_config([("test", {"relaxation": "even_odd", "dt": 0.5})])
    with pytest.raises(ValueError, match="fixed-point iteration only"):
        Integrator(1.0, 0.5, 1.0, "even_odd")
    with pytest.raises(ValueError, match="relaxation order must be one of"):
        Integrator(1.0, 1.0, 1.0, "red_black")
    assert build_config([("test", {"relaxation": "even_odd"})]).relaxation == "even_odd"


def test_the_step_count_benchmark_compares_both_orders(small_text, monkeypatch, capsys):
    """benchmarks/step_counts.py on a tiny machine: a row per order and window, and even/odd ahead of Jacobi at the same
    step count in the distance to the fixed point."""
    from benchmarks import step_counts

    argv = ["step_counts.py", "--preset", "dev", "--train_windows", "0", "--batches", "1", "--free_steps", "3", "6"]
    flags = ["--data", str(small_text), "--hidden_sizes", "8", "--coord_dim_n", "4", "--batch_size", "4"]
    monkeypatch.setattr("sys.argv", argv + ["--true_steps", "60", *flags])
    step_counts.main()
    rows = {tuple(line.split()[:3]): line.split()[3:] for line in capsys.readouterr().out.splitlines()[2:]}
    assert set(rows) == {(o, t, n) for o in ("jacobi", "even_odd") for t, n in (("3", "2"), ("6", "3"))}
    for t, n in (("3", "2"), ("6", "3")):
        assert float(rows["even_odd", t, n][2]) < float(rows["jacobi", t, n][2])  # err free
        assert all(0.9 < float(c) <= 1.0 for c in rows["even_odd", t, n][3:])  # the cosines
