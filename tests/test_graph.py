"""Energies as graphs: skip and residual couplings, per-layer boxes, gains and learning-rate multipliers; exact forces
and recurrent backprop against autograd in float64, the colouring, bad graphs refused by name, and a chain written as a
graph is the chain."""

from __future__ import annotations

import math

import pytest
import torch
from test_conv import conv_machine
from test_window import NewStorage
from tiny import tiny_batch, tiny_config, tiny_machine

from benchmarks.autograd_reference import cosine, exact_grads
from trainer2.learning.params import ParamTable
from trainer2.learning.step import build_step
from trainer2.physics.energy import energy, forces, input_drive
from trainer2.physics.graph import Graph, plan
from trainer2.physics.kernels.backend import choose_backend, graph_blocker
from trainer2.physics.machine import build_machine, coupling_cap
from trainer2.running.step_runner import step_tensors
from trainer2.section import ConfigError
from trainer2.train_config import TrainConfig

F64 = torch.float64
NAMED = [{"name": "h1"}, {"name": "h2", "box": "relu6"}, {"name": "h3"}]
# a triangle h1-h2-h3 (three colours), a skip from the input to h2 and one between states, h1 -> h3
DENSE_GRAPH = [
    {"dense": 8, "from": "input", "to": "h1"},
    {"dense": 6, "from": "h1", "to": "h2", "gain": 1.5},
    {"dense": 6, "from": "input", "to": "h2", "lr": 2.0},
    {"dense": 5, "from": "h2", "to": "h3"},
    {"dense": 5, "from": "h1", "to": "h3"},
    {"from": "h3", "to": "output"},
]
# a residual block on images: a 3x3 conv, a 3x3 stride-2 conv and a 1x1 stride-2 skip from the input, relu6 boxes
CONV_GRAPH = [
    {"conv": {"channels": 2, "kernel": 3}, "from": "input", "to": "a"},
    {"conv": {"channels": 2, "kernel": 3, "stride": 2, "padding": 1}, "from": "a", "to": "b"},
    {"conv": {"channels": 2, "kernel": 1, "stride": 2, "padding": 0}, "from": "input", "to": "b", "gain": 0.7},
    {"dense": 5, "from": "b", "to": "c"},
    {"dense": 5, "from": "a", "to": "c"},
]
CONV_LAYERS = [{"name": "a", "box": "relu6"}, {"name": "b", "box": "relu6"}, {"name": "c"}]
IMAGE = (1, 6, 6)


def dense_graph(**overrides):
    cfg = tiny_config(layers=NAMED, couplings=DENSE_GRAPH, **overrides)
    return cfg, tiny_machine(cfg)


def conv_graph(**overrides):
    return conv_machine(CONV_LAYERS, image=IMAGE, couplings=CONV_GRAPH, **overrides)


def case(kind: str, **overrides):
    """(cfg, machine, clamped-input rows x, the batch's inputs, targets) of the dense or the conv graph."""
    if kind == "dense":
        cfg, m = dense_graph(**overrides)
        inputs, y = tiny_batch(cfg)
        return cfg, m, m.input_vectors(inputs), inputs, y
    cfg, m, x, y = conv_graph(**overrides)
    return cfg, m, x, x, y


@pytest.mark.parametrize("kind", ["dense", "conv"])
def test_graph_forces_are_minus_autograds_gradient_of_the_energy(kind):
    """Every layer's force on a graph (skips into a driven layer and between states, several couplings into one layer,
    a relu6 box) is -dE/ds of the energy written as its terms, in float64."""
    cfg, m, x, _, _ = case(kind)
    e, g = m.energy.for_window(), m.energy.graph
    gen = torch.Generator().manual_seed(5)
    s = [torch.rand(x.shape[0], h, generator=gen, dtype=F64) * 3 for h in m.state_sizes()]
    drives = [torch.zeros(x.shape[0], m.state_sizes()[j], dtype=F64) for j in g.driven]
    input_drive(x, e, drives)
    out = [torch.zeros_like(t) for t in s]
    forces(s, drives, e, out)
    leaves = [t.clone().requires_grad_(True) for t in s]
    (grad,) = [torch.autograd.grad(energy(leaves, x, m.energy).sum(), leaves)]
    for j, (f, ref) in enumerate(zip(out, grad, strict=True)):
        torch.testing.assert_close(f, -ref, rtol=1e-10, atol=1e-10, msg=f"layer {g.names[j]}")


@pytest.mark.parametrize("kind", ["dense", "conv"])
@pytest.mark.parametrize("relaxation", ["jacobi", "even_odd"])
def test_rbp_is_autograds_exact_gradient_on_graphs_with_skips(kind, relaxation):
    """The acceptance test on graphs: the adjoint through skip couplings and boxes of [0, 6] has cosine >= 0.9999 to
    autograd's gradient of the loss through the unrolled free window (the reference's own colouring; its forces autograd
    of the energy for Jacobi, its own pulls for even/odd, where a double backward through the groups is too slow)."""
    cfg, m, _, inputs, y = case(kind, free_steps=60, nudge_steps=60, relaxation=relaxation)
    step = build_step(m, cfg, cfg, cfg.batch_size, rule="rbp")
    with torch.no_grad():
        est = step.gradients(step.relax, inputs, y).grads
    c = cfg
    forces = "energy" if relaxation == "jacobi" else "pulls"
    ref, _ = exact_grads(
        m, inputs, y, c.free_steps, c.dt, c.gamma, c.mass, c.retrieval_beta, c.eps, c.relaxation, forces=forces
    )
    assert est.keys() == ref.keys()
    assert any(float(s.max()) > 1.0 for s in step.relax.s0.s[:-1])  # a relu6 layer really sits above the unit box
    for name, g in ref.items():
        assert cosine(est[name], g) >= 0.9999, name


@pytest.mark.parametrize("kind", ["dense", "conv"])
def test_centred_ep_follows_the_exact_gradient_on_a_graph(kind):
    cfg, m, _, inputs, y = case(kind, free_steps=80, nudge_steps=80, beta_nudge=1e-3, relaxation="even_odd")
    step = build_step(m, cfg, cfg, cfg.batch_size, rule="ep")
    with torch.no_grad():
        est = step.gradients(step.relax, inputs, y).grads
    c = cfg
    ref, _ = exact_grads(
        m, inputs, y, c.free_steps, c.dt, c.gamma, c.mass, c.retrieval_beta, c.eps, c.relaxation, forces="pulls"
    )
    energy_names = list(m.energy.parameters())
    both = [torch.cat([d[n].flatten() for n in energy_names]) for d in (est, ref)]
    assert cosine(*both) >= 0.999


def test_the_leapfrog_relaxes_a_graph_to_the_fixed_points_equilibrium():
    """The damped leapfrog (dt 0.5) and the coloured fixed point reach the same free equilibrium of a graph."""
    equilibria = []
    for overrides in (dict(relaxation="even_odd", free_steps=80), dict(dt=0.5, gamma=1.2, free_steps=400)):
        cfg, m, _, inputs, y = case("dense", **overrides)
        step = build_step(m, cfg, cfg, cfg.batch_size, rule="ep")
        with torch.no_grad():
            step.relax.free_phase(inputs, y)
        equilibria.append([t.clone() for t in step.relax.s0.s])
    for a, b in zip(*equilibria, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-7)


@pytest.mark.parametrize("relaxation", ["jacobi", "even_odd"])
def test_a_graph_window_allocates_nothing_after_warm_up(relaxation):
    cfg, m, _, inputs, y = case("dense", relaxation=relaxation)
    step = build_step(m, cfg, cfg, cfg.batch_size, rule="ep")
    relax = step.relax
    with torch.no_grad():
        free = relax.free_phase(inputs, y)
        relax.nudged_phases(free)  # warm-up
        known = {t.untyped_storage().data_ptr() for t in step_tensors([relax, m.energy, free])}
        for ws, nudged, steps in ((relax.ws, False, cfg.free_steps), (relax.ws_nudged, True, cfg.nudge_steps)):
            with NewStorage(known) as spy:
                relax.run(ws, free, 0, steps, nudged)
            assert spy.fresh == [], set(spy.fresh)


def test_a_chain_written_as_a_graph_is_the_chain():
    """A graph whose couplings join each layer to the next with [0, 1] boxes is a chain: the same parameters, drawn
    in the same order, and the chain's own steps; its gradients are the chain's bit for bit."""
    chain_cfg = tiny_config(hidden_sizes=[8, 6], relaxation="even_odd", free_steps=20, nudge_steps=20)
    graph_cfg = tiny_config(
        layers=[{"name": "h1"}, {"name": "h2"}],
        couplings=[{"dense": 8, "from": "input", "to": "h1"}, {"dense": 6, "from": "h1", "to": "h2"}],
        relaxation="even_odd",
        free_steps=20,
        nudge_steps=20,
    )
    results = []
    for cfg in (chain_cfg, graph_cfg):
        m = tiny_machine(cfg)
        assert m.energy.graph.is_chain
        step = build_step(m, cfg, cfg, cfg.batch_size, rule="ep")
        with torch.no_grad():
            results.append(step.gradients(step.relax, *tiny_batch(cfg)).grads)
    assert results[0].keys() == results[1].keys()
    for name in results[0]:
        assert torch.equal(results[0][name], results[1][name]), name


def test_colourings_keep_coupled_layers_apart():
    chain = Graph.chain(4)
    assert chain.colouring == ((0, 2, 4), (1, 3))  # odd layers h_1, h_3, q, then the even ones: even/odd's halves
    g = plan(NAMED, DENSE_GRAPH, 4, 0.5).graph
    assert len(g.colouring) == 3  # the triangle h1-h2-h3 needs three
    for group in g.colouring:
        assert all(i not in g.neighbours(j) for i in group for j in group), group
    assert sorted(j for group in g.colouring for j in group) == list(range(len(g.names)))


def test_the_spectral_cap_of_a_graph_follows_its_adjacency():
    """A chain's cap is the closed form; a graph's divides by its adjacency's largest eigenvalue (the triangle plus q's
    edge: the Perron root of that 4-node graph)."""
    chain = tiny_config(hidden_sizes=[8, 6], spectral_cap=0.5)
    assert coupling_cap(chain) == 0.5 / (2 * math.cos(math.pi / 4))
    assert math.isclose(Graph.chain(2).adjacency_norm(), 2 * math.cos(math.pi / 4), rel_tol=1e-12)
    cfg, m = dense_graph()
    adjacency = torch.zeros(4, 4, dtype=F64)
    for b, a in m.energy.graph.edges:
        if b >= 0:
            adjacency[a, b] = adjacency[b, a] = 1.0
    top = float(torch.linalg.eigvalsh(adjacency).max())
    assert math.isclose(coupling_cap(cfg), cfg.spectral_cap / top, rel_tol=1e-10)
    for c in m.energy.between_states:
        assert float(torch.linalg.matrix_norm(c.weight, ord=2)) <= coupling_cap(cfg) * (1 + 1e-9)


def test_gains_scale_the_initial_weights_and_lr_multiplies_the_couplings_rate():
    base = [dict(e) for e in DENSE_GRAPH]
    base[2] = {k: v for k, v in base[2].items() if k != "lr"}
    doubled = [dict(e) for e in base]
    doubled[2]["gain"] = 2.0
    weights = []
    for couplings in (base, doubled):
        cfg = tiny_config(layers=NAMED, couplings=couplings)
        m = build_machine(cfg, 7, cfg.context_len, True, torch.device("cpu"), seed=cfg.seed)
        weights.append(m.energy.couplings[2].weight.clone())  # from the input: not capped
    torch.testing.assert_close(weights[1], 2.0 * weights[0], rtol=1e-15, atol=0)
    cfg, m = dense_graph()
    table = ParamTable.build(m, {"energy": 1.0, "readout": 1.0, "embed": 1.0}, 0.0)
    span = table.span_of("W_3")
    assert table.mult is not None and torch.all(table.mult[span] == 2.0)
    assert torch.all(table.mult[table.span_of("W_1")] == 1.0)


def test_the_triton_window_says_it_serves_chains_and_auto_takes_torch_for_a_graph():
    _, m = dense_graph()
    why = graph_blocker(m.energy.graph)
    assert why is not None and "graph" in why
    assert graph_blocker(Graph.chain(2)) is None
    with pytest.raises(ConfigError, match="graph"):
        choose_backend("triton", torch.device("cpu"), F64, None, [8, 6, 4], 7, ["dense"] * 3, why)


BAD = [
    (NAMED, [*DENSE_GRAPH[:-1], {"dense": 5, "from": "h9", "to": "h3"}], "from 'h9' is no layer"),
    (NAMED + [{"name": "h4"}], DENSE_GRAPH, "layer h4: no coupling reaches it"),
    (NAMED, [{"dense": 5, "from": "h3", "to": "h1"}, *DENSE_GRAPH], "from a lower layer to a higher one"),
    (NAMED, [{"dense": 5, "to": "h1"}, *DENSE_GRAPH], "needs `from`"),
    ([{"name": "h1"}, {"name": "h1"}], DENSE_GRAPH, "name 'h1' is used twice"),
    ([{"name": "h1", "box": "relu7"}], DENSE_GRAPH, "box 'relu7'"),
    (NAMED, [*DENSE_GRAPH, {"from": "h2", "to": "output"}], "only one coupling reaches output"),
    (NAMED, [*DENSE_GRAPH[:-1], {"dense": 5, "from": "h3", "to": "output"}], "dense head into q"),
    (NAMED, [{**DENSE_GRAPH[0], "gain": -1}, *DENSE_GRAPH[1:]], "gain must be a number"),
    (NAMED, [{"dense": 8, "conv": {"channels": 2}, "from": "input", "to": "h1"}, *DENSE_GRAPH[1:]], "coupling 0"),
    ([{"dense": 8}], DENSE_GRAPH, "named state layers"),
    (NAMED, [], "couplings is empty"),
]


@pytest.mark.parametrize("layers,couplings,message", BAD)
def test_bad_graphs_are_refused_by_name_in_the_config(layers, couplings, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        tiny_config(layers=layers, couplings=couplings)


def test_shapes_that_do_not_meet_are_refused_before_any_tensor():
    """A stride-2 conv into a layer that a stride-1 skip also reaches: refused naming both, by the size check that runs
    before the machine is built (and by the build itself)."""
    couplings = [dict(e) for e in CONV_GRAPH]
    couplings[2] = {"conv": {"channels": 2, "kernel": 1, "padding": 0}, "from": "input", "to": "b"}
    cfg = TrainConfig(**{**tiny_config().model_dump(), "layers": CONV_LAYERS, "couplings": couplings})
    with pytest.raises(ConfigError, match=r"coupling 2 \(input -> b, conv\).*do not meet"):
        build_machine(cfg, 5, math.prod(IMAGE), False, torch.device("cpu"), IMAGE, seed=0)


def test_a_residual_graph_from_yaml_trains_and_resumes_bitwise_identical(tmp_path, capsys):
    """A graph written in a --config YAML (strided convs, a skip, relu6, gain and lr) trains from the command line,
    records its couplings in the checkpoint, prints them with --print_config, and an interrupted run resumes bitwise."""
    from safetensors.torch import load_file
    from test_image_data import write_mnist

    from trainer2.cli import main

    write_mnist(tmp_path / "mnist", n_train=40)
    cfg = tmp_path / "res.yaml"
    cfg.write_text(
        "layers: [{name: a, box: relu6}, {name: b}]\n"
        "couplings:\n"
        "  - {conv: {channels: 2, kernel: 3, pool: 2}, from: input, to: a}\n"
        "  - {conv: {channels: 3, kernel: 3, stride: 2, padding: 1}, from: a, to: b, gain: 0.5}\n"
        "  - {conv: {channels: 3, kernel: 1, stride: 2, padding: 0}, from: a, to: b, lr: 2.0}\n"
    )
    common = ["--data", str(tmp_path / "mnist"), "--config", str(cfg), "--checkpoint_dir", str(tmp_path / "ck")]
    common += ["--coord_dim_n", "4", "--rotor_k", "3", "--batch_size", "8", "--free_steps", "4", "--nudge_steps", "2"]
    common += ["--relaxation", "even_odd"]
    assert main([*common, "--print_config"]) == 0
    printed = capsys.readouterr().out
    assert "couplings:" in printed and "stride: 2" in printed and "box: relu6" in printed
    assert main([*common, "--run_name", "whole", "--max_windows", "6"]) == 0
    assert main([*common, "--run_name", "cut", "--max_windows", "3"]) == 0
    resume = ["--resume", "latest", "--checkpoint_dir", str(tmp_path / "ck"), "--run_name", "cut", "--max_windows", "6"]
    assert main(resume) == 0
    assert "resumed from" in capsys.readouterr().out
    whole, cut = (
        load_file(str(tmp_path / "ck" / n / "step_00000006" / "tensors.safetensors")) for n in ("whole", "cut")
    )
    assert whole["param.W_2"].shape == (3, 2, 3, 3) and whole["param.W_3"].shape == (3, 2, 1, 1)
    for k in whole:
        assert torch.equal(whole[k], cut[k]), k


def test_code_a_graphs_couplings_name_in_a_file_needs_consent():
    """A dotted coupling kind in a file's `couplings` is refused before anything imports it, as one in `layers` is."""
    from trainer2.components import UntrustedCodeError
    from trainer2.train_config import build_config

    values = {"layers": [{"name": "h1"}], "couplings": [{"nowhere_module.Wide": 8, "from": "input", "to": "h1"}]}
    with pytest.raises(UntrustedCodeError, match=r"couplings\[0\] 'nowhere_module.Wide'"):
        build_config([("config graph.yaml", values)])


def test_hopfield_resnet13_builds_and_trains_a_few_windows_on_the_cpu(tmp_path):
    """The field's topology as the preset ships it (channels, boxes, couplings), on small 3x16x16 images at batch 2:
    it builds, relaxes in its three colour groups and takes finite updates."""
    import numpy as np

    import trainer2

    cfg = trainer2.config(
        "hopfield_resnet13", batch_size=2, free_steps=2, nudge_steps=1, max_windows=2, eval_every_windows=0,
        eval_batches=1, cpu_threads=1, augment_shift=0,
    )  # fmt: skip
    graph = cfg.plan().graph
    assert len(graph.edges) == 13 and len(graph.colouring) == 3 and all(b == (0.0, 6.0) for b in graph.boxes)
    rng = np.random.default_rng(0)
    x, y = rng.random((12, 3, 16, 16)).astype(np.float32), rng.integers(0, 10, 12)
    run = trainer2.train(cfg, trainer2.from_arrays(x, y, heldout_fraction=0.25), run_dir=tmp_path / "r")
    assert run.summary["windows"] == 2 and not run.summary["diverged"] and run.summary["dropped_updates"] == 0
    assert math.isfinite(run.summary["heldout_loss"])


def test_dead_units_are_counted_at_each_layers_own_faces():
    """A relu6 unit at 6 for every row is dead (it gets no EP gradient); at 1 it is not."""
    from trainer2.physics.dead_units import dead_units

    h = torch.tensor([[6.0, 1.0, 0.0, 3.0], [6.0, 1.0, 0.0, 2.0]])
    assert int(dead_units([h], torch.device("cpu"), ((0.0, 6.0),))) == 2  # units 0 (at 6) and 2 (at 0)
    assert int(dead_units([h], torch.device("cpu"))) == 2  # in a unit box: units 1 (at 1) and 2 (at 0)
