"""The quality benchmark: exact-gradient reference, feed-forward baseline, figures, and the production preset's EP
accuracy."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest
import torch
from test_conv import conv_machine
from tiny import tiny_batch, tiny_config, tiny_machine

from benchmarks import autograd_reference, quality
from benchmarks import exact_gradient_reference as ref_module
from benchmarks.autograd_reference import cosine, exact_grads, exact_grads_energy
from benchmarks.exact_gradient_reference import benchmark_config, exact_gradients, exact_trainer, train_feedforward
from trainer2.learning.gradients import ep_gradients
from trainer2.learning.update import Updater, lr_at
from trainer2.physics.relaxation import Relaxation
from trainer2.running.trainer import Trainer
from trainer2.train_config import ConfigError, build_config

FAST = dict(
    hidden_sizes=[16],
    coord_dim_n=4,
    rotor_k=4,
    context_len=3,
    embed_dim=3,
    batch_size=16,
    free_steps=12,
    nudge_steps=6,
    beta_nudge=0.003,
    r_init=4.0,
    proto_init_scale=0.3,
    log_every_windows=10,
    eval_every_windows=20,
    eval_batches=2,
    eta_update=0.01,
    max_windows=40,
)


def fast_config(tmp_path, data, **overrides):
    return build_config(
        [("test", {**FAST, "data": str(data), "checkpoint_dir": str(tmp_path), "device": "cpu", **overrides})]
    )


def test_exact_gradient_source_is_autograds_gradient():
    cfg = tiny_config(beta_nudge=1e-3, free_steps=60, nudge_steps=60)
    m = tiny_machine(cfg)
    inputs, targets = tiny_batch(cfg)
    with torch.no_grad():
        ep = ep_gradients(Relaxation(m, cfg, cfg.batch_size), inputs, targets)
        ex = exact_gradients(Relaxation(m, cfg, cfg.batch_size), inputs, targets)
    ref, loss = exact_grads(
        m, inputs, targets, cfg.free_steps, cfg.dt, cfg.gamma, cfg.mass, cfg.retrieval_beta, cfg.eps
    )
    assert ex.grads.keys() == ep.grads.keys() == set(m.named_params())
    for name, g_ex in ex.grads.items():
        torch.testing.assert_close(g_ex, ref[name])  # the autograd gradient itself, parameter by parameter
        assert cosine(g_ex, ep.grads[name]) > 0.999, name  # which EP estimates at small beta
    torch.testing.assert_close(ex.loss, ep.loss)  # same free phase, same readout
    torch.testing.assert_close(ex.loss.mean(), loss)
    assert (
        float(ex.stats.lior_mean) > 0 and float(ex.stats.lior_nudge) == float(ex.stats.spd_last_nudge) == 0.0
    )  # real free-phase statistics, no nudged phase
    assert float(ep.stats.spd_last_nudge) > 0


def test_the_reference_trainer_steps_with_its_own_gradient_source_every_window(tmp_path, small_text, monkeypatch):
    """The bug this guards against: a gradient source swapped in after the step was wired was never called."""
    calls: list[int] = []
    real = ref_module.exact_grads
    monkeypatch.setattr(ref_module, "exact_grads", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    applied_lr: list[float] = []
    real_apply = Updater.apply
    monkeypatch.setattr(
        Updater,
        "apply",
        lambda self, out, targets: (applied_lr.append(float(self.state.lr)), real_apply(self, out, targets))[1],
    )
    cfg = fast_config(
        tmp_path, small_text, max_windows=6, lr_warmup_windows=4, lr_schedule="cosine", log_every_windows=3
    )
    ex = exact_trainer(cfg, log=lambda *_: None)
    assert ex.gradients is exact_gradients and ex.runner.batch_step is ex.batch_step
    ex.train()
    assert len(calls) == 6  # autograd's gradient, on every step the runner ran
    assert applied_lr == pytest.approx(
        [lr_at(cfg, w, 6) for w in range(6)]
    )  # the schedule reaches the update that runs
    rows = [r for r in ex.history if "train_loss" in r]
    assert len(rows) == 2 and all(r["train_loss"] > 0.5 and r["train_bpc"] > 0.5 and r["lior_mean"] > 0 for r in rows)


def test_exact_and_ep_trainers_start_identical_then_part_and_both_learn(tmp_path, small_text):
    cfg = fast_config(tmp_path, small_text)
    ep, ex = (
        Trainer(cfg, log=lambda *_: None),
        exact_trainer(cfg.model_copy(update={"run_name": "exact"}), log=lambda *_: None),
    )
    assert ep.gradients is ep_gradients
    for a, b in zip(ep.machine.named_params().values(), ex.machine.named_params().values()):
        assert torch.equal(a, b)
    before = ep.evaluate()["heldout_bpc"]
    ep_bpc, ex_bpc = ep.train()["heldout_bpc"], ex.train()["heldout_bpc"]
    differ = [n for n, a in ep.machine.named_params().items() if not torch.equal(a, ex.machine.named_params()[n])]
    assert "W_1" in differ and "emb" in differ  # two learning rules, two trajectories
    assert ep_bpc < before - 0.5 and ex_bpc < before - 0.5
    assert quality.agrees(ep_bpc / ex_bpc, 0.05)  # the two rules agree on a converged, convex machine


def test_quality_check_is_two_sided():
    assert quality.agrees(1.0) and quality.agrees(1.019) and quality.agrees(0.981)
    assert not quality.agrees(1.03)  # EP much worse than the reference
    assert not quality.agrees(0.97)  # a reference much worse than EP (as when it trained with EP at a constant rate)
    assert not quality.agrees(0.88)


def test_wired_parts_cannot_be_replaced(tmp_path, small_text):
    t = Trainer(fast_config(tmp_path, small_text), log=lambda *_: None)
    for name in ("batch_step", "runner", "machine", "params"):
        with pytest.raises(AttributeError, match="has no setter"):
            setattr(t, name, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.batch_step.gradients = exact_gradients  # type: ignore[misc]


@pytest.mark.parametrize("pooling", ["avg", "max"])
def test_exact_gradient_source_of_a_conv_machine_is_autograd_through_its_energy(pooling, monkeypatch):
    """quality.py's reference on a conv machine: autograd through the unrolled window, whose forces it takes from
    the couplings' pulls (faster), equal to autograd through the energy's own forces (exact_grads_energy)."""
    layers = [{"conv": {"channels": 3, "kernel": 3, "pool": 2, "pooling": pooling}}, {"dense": 6}]
    cfg, m, x, y = conv_machine(layers, beta_nudge=1e-2, free_steps=60, nudge_steps=60)
    calls = []
    pulls = autograd_reference.pull_forces
    monkeypatch.setattr(autograd_reference, "pull_forces", lambda *a: calls.append(1) or pulls(*a))
    with torch.no_grad():
        ep = ep_gradients(Relaxation(m, cfg, cfg.batch_size), x, y)
        ex = exact_gradients(Relaxation(m, cfg, cfg.batch_size), x, y)
    assert len(calls) == cfg.free_steps  # the source ran the pulls (one call a Jacobi step)
    monkeypatch.undo()
    ref, loss = exact_grads_energy(m, x, y, cfg.free_steps, cfg.dt, cfg.gamma, cfg.mass, cfg.retrieval_beta, cfg.eps)
    assert ex.grads.keys() == set(m.named_params())
    for name, g_ex in ex.grads.items():
        torch.testing.assert_close(g_ex, ref[name])
        assert cosine(g_ex, ep.grads[name]) > 0.999, name
    torch.testing.assert_close(ex.loss.mean(), loss)


def test_exact_reference_refuses_a_memory_bank(tmp_path, small_text):
    with pytest.raises(ConfigError, match="memory_capacity"):
        exact_trainer(fast_config(tmp_path, small_text, memory_capacity=32))


@pytest.mark.parametrize("head", ["readout", "linear"])
def test_feedforward_baseline_learns(tmp_path, small_text, head):
    cfg = fast_config(tmp_path, small_text)
    before = Trainer(cfg, log=lambda *_: None).evaluate()["heldout_bpc"]
    after = train_feedforward(cfg, 40 * 16, head_kind=head)["heldout_bpc"]
    assert after < before - 0.5


def test_max_rise_is_the_largest_rise_above_the_best_so_far():
    rows = [
        {"heldout_bpc": 3.0},
        {"train_bpc": 9.0},
        {"heldout_bpc": 2.0},
        {"heldout_bpc": 2.3},
        {"heldout_bpc": 1.5},
        {"heldout_bpc": 1.6},
    ]
    assert quality.max_rise(rows) == pytest.approx(0.3)
    assert quality.max_rise([{"heldout_bpc": 3.0}, {"heldout_bpc": 2.0}]) == 0.0


def test_quality_prints_both_figures_and_their_ratio(tmp_path, small_text, monkeypatch, capsys):
    out = tmp_path / "q.json"
    argv = [
        "quality.py",
        "--preset",
        "dev",
        "--examples",
        "320",
        "--cosine_batches",
        "1",
        "--json",
        str(out),
        "--data",
        str(small_text),
        "--checkpoint_dir",
        str(tmp_path),
    ]
    for k, v in FAST.items():
        if k != "max_windows":
            argv += [f"--{k}", *map(str, v)] if isinstance(v, list) else [f"--{k}", str(v)]
    monkeypatch.setattr(sys, "argv", argv)
    quality.main()
    text = capsys.readouterr().out
    figures = json.loads(out.read_text())
    assert figures["ep"]["examples_seen"] == figures["exact"]["examples_seen"] == 320
    assert figures["ratio"] == pytest.approx(figures["ep"]["heldout_bpc"] / figures["exact"]["heldout_bpc"])
    assert figures["ff"]["heldout_bpc"] > 0 and figures["agrees"] == quality.agrees(figures["ratio"])
    assert f"ratio EP / exact: {figures['ratio']:.4f}" in text
    assert "feed-forward backprop" in text and "EP cosine" in text
    assert figures["cosine"]["energy"] > 0.99


def test_production_preset_ep_update_tracks_the_exact_gradient():
    """On real batches of the built-in corpus, at the preset's own window lengths, beta and dtype."""
    cfg = benchmark_config("production", 16, ["--batch_size", "16"])
    trainer = Trainer(cfg, log=lambda *_: None)
    inputs, targets = trainer.next_batch()
    with torch.no_grad():
        est = trainer.gradients(trainer.relaxation, inputs, targets).grads
    ref, _ = exact_grads(
        trainer.machine, inputs, targets, cfg.free_steps, cfg.dt, cfg.gamma, cfg.mass, cfg.retrieval_beta, cfg.eps
    )
    keep = [n for n in est if n[:2] in ("W_", "b_", "em")]
    a = torch.cat([est[n].flatten() for n in keep])
    b = torch.cat([ref[n].flatten() for n in keep])
    assert cosine(a, b) > 0.999


def test_a_run_stopped_by_a_signal_ends_the_benchmark_with_its_exit_status(monkeypatch, capsys):
    """A stopped run's summary has no held-out figure; the benchmark says so and exits as the trainer would."""

    class StoppedTrainer:
        data = dataclasses.make_dataclass("Data", [("kind", str)])("images")
        history: list = []

        def __init__(self, cfg, log) -> None:
            pass

        def train(self) -> dict:
            return {"interrupted": "SIGTERM", "windows": 7}

    monkeypatch.setattr(quality, "Trainer", StoppedTrainer)
    monkeypatch.setattr(sys, "argv", ["quality.py", "--preset", "dev", "--examples", "64"])
    with pytest.raises(SystemExit) as e:
        quality.cli()
    err = capsys.readouterr().err
    assert e.value.code == 143 and "quality.py: stopped by SIGTERM after window 7; no figures" in err
