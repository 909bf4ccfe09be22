"""Subnormal floats stay out of a run (issue 26), and dead hidden units are counted in the telemetry."""

from __future__ import annotations

import json

import pytest
import torch
from test_update import make_state
from tiny import tiny_config

from trainer2.learning.subnormals import count_subnormals, flush_denormal, flush_subnormals_
from trainer2.learning.update import flat_update
from trainer2.physics.dead_units import dead_units
from trainer2.running.trainer import Trainer
from trainer2.train_config import build_config


@pytest.fixture
def ieee_arithmetic():
    """Subnormal arithmetic as the CPU does it by default, whatever an earlier test's setup switched on; restored."""
    torch.set_flush_denormal(False)
    yield
    torch.set_flush_denormal(False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_flush_subnormals_zeroes_subnormals_and_keeps_every_other_value(dtype, ieee_arithmetic):
    tiny = torch.finfo(dtype).tiny
    small = torch.tensor([tiny / 3, -tiny / 1000, tiny, -tiny], dtype=dtype)
    kept = torch.tensor(
        [0.0, 1.0, -0.5, 3e-30, -123.0, 1.0000001 * tiny, -2 * tiny, float("inf"), float("nan")], dtype=dtype
    )
    x = torch.cat([small, kept])
    flush_subnormals_([x])
    assert not x[:4].any()
    assert torch.equal(x[4:-1], kept[:-1]) and x[-1].isnan()  # bitwise, and a NaN stays a NaN (the divergence check)


@pytest.mark.parametrize("rule", ["momentum", "adam"])
def test_zero_gradients_never_leave_subnormal_moments(rule, ieee_arithmetic):
    """A hidden unit stuck at its box's edge gets zero gradients: its moments decay geometrically. Without the flush,
    Adam's first moment sticks at the smallest subnormals (m - 0.1 m rounds back to m) and the run slows down."""
    cfg = tiny_config(dtype="float32", update_rule=rule, momentum=0.9)
    tiny = torch.finfo(torch.float32).tiny
    flat = torch.tensor([1.0, -2.0, 0.5, 0.0], dtype=torch.float32)
    st = make_state(flat, rule)
    st.lr, st.count, st.dropped = (t.float() for t in (st.lr, st.count, st.dropped))
    st.bufs.copy_(torch.tensor([1e-3, 1.4e-45, -3e-40, 5 * tiny]))  # seeded with subnormals, as issue 26's checkpoint
    if rule == "adam":
        st.sq.copy_(torch.tensor([1e-6, 1e-42, 2e-39, 1e-30]))
    step = torch.empty_like(flat)
    for _ in range(50):
        flat_update(flat, torch.zeros_like(flat), st, None, None, cfg, step)
    for t in (st.bufs, st.sq):
        assert count_subnormals(t) == 0, t
    assert float(st.bufs[0]) > 0 and float(flat[0]) != 1.0  # a normal moment still decays and moves its parameter


def test_after_the_setup_subnormal_arithmetic_on_this_thread_gives_zero(ieee_arithmetic):
    x = torch.tensor([1e-40, -3e-39, 1.0], dtype=torch.float32)
    assert count_subnormals(x * 1.0) == 2  # IEEE by default
    if not flush_denormal():
        pytest.skip("this CPU cannot flush subnormals (no FTZ/DAZ)")
    assert torch.equal(x * 1.0, torch.tensor([0.0, 0.0, 1.0]))


def test_dead_units_counts_units_at_0_or_1_for_every_row():
    h1 = torch.tensor([[0.0, 1.0, 0.5, 0.0, 1.0], [0.0, 1.0, 0.0, 1.0, 1.0], [0.0, 1.0, 1.0, 0.0, 1.0]])
    h2 = torch.tensor([[0.2, 0.0], [0.3, 0.0], [0.0, 0.0]])
    assert int(dead_units([h1, h2], torch.device("cpu"))) == 3 + 1  # h1: units 0, 1, 4; h2: unit 1
    assert int(dead_units([h1[:, 2:4]], torch.device("cpu"))) == 0  # at 0 or 1 but not for the whole batch


def test_the_telemetry_logs_the_dead_units_of_the_last_batch(small_text, tmp_path, ieee_arithmetic):
    cfg = build_config(
        [
            (
                "test",
                dict(
                    data=str(small_text),
                    checkpoint_dir=str(tmp_path),
                    run_name="t",
                    device="cpu",
                    hidden_sizes=[8, 6],
                    coord_dim_n=4,
                    rotor_k=3,
                    context_len=3,
                    embed_dim=3,
                    batch_size=8,
                    free_steps=6,
                    nudge_steps=3,
                    max_windows=4,
                    log_every_windows=2,
                    eval_every_windows=0,
                    eval_batches=1,
                ),
            )
        ]
    )
    trainer = Trainer(cfg, log=lambda s: None)
    with torch.no_grad():  # bias one unit of each layer far below 0, so it sits at 0 for every example
        trainer.machine.energy.biases[0][3] = -1e3
        trainer.machine.energy.biases[1][2] = -1e3
    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "t" / "telemetry.jsonl").read_text().splitlines()]
    expected = int(dead_units(trainer.relaxation.s0.s[:-1], torch.device("cpu")))
    assert expected >= 2 and rows[-1]["dead_units"] == expected
