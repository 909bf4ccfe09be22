"""benchmarks/step_ops.py: a batch step's operators by issuing function add up to bench's count of the same step."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import trainer2
from benchmarks.step_ops import dispatched_ops, main, step_ops
from trainer2.data.load import DataConfig, load_data
from trainer2.physics.kernels.backend import interpreting
from trainer2.running.bench import host_batches, make_step, profile_call
from trainer2.running.step_runner import StepRunner


def test_the_operators_by_function_add_up_to_benchs_count(capsys):
    cfg = trainer2.config("dev", window_backend="torch", update_backend="torch")
    ops = step_ops(cfg, 4)
    data = load_data(cfg.section(DataConfig))
    runner = StepRunner(make_step(cfg, data, 4, torch.device("cpu")), log=print)
    feed = host_batches(data, 4, 4, 0)
    with torch.no_grad():
        for x, y in feed[:3]:
            runner.step(x, y)
        counted, _ = profile_call(lambda: runner.step(*feed[3]), False)
    assert sum(ops.values()) == counted
    # the window's readout pull, the update and the cap are where the dev step's operators are
    for where in ("dynamics.py:readout_nudge", "update.py:flat_update", "dense.py:cap_power"):
        assert any(k.endswith(where) for k in ops), (where, ops)
    assert main(["--preset", "dev", "--batch_size", "4"]) == 0
    assert f"{counted} kernel-running operators a batch step" in capsys.readouterr().out


def test_the_dispatch_count_agrees_with_the_profile():
    """With the torch backends both counts see the same operators (the profile may count a composite operator as one
    that dispatch sees as its parts: at most 2 here)."""
    cfg = trainer2.config("dev", window_backend="torch", update_backend="torch")
    ops, launches = dispatched_ops(cfg, 4)
    assert launches == 0 and abs(sum(ops.values()) - sum(step_ops(cfg, 4).values())) <= 2


def test_the_dispatch_count_leaves_out_the_interpreters_work():
    """In Triton's interpreter with every kernel asked for: the kernels' launches are counted (2 window, 2 EP
    statistic, 1 observables, readout frame, loss and rotor angles, 2 update, 1 cap, 2 metrics, 1 average) and the
    interpreter's own torch calls are not, so what is left is the torch operators a GPU would run beside them; none of
    them from what the kernels took over (the observables, the nudge's row factors, the rotor's angle gradient, the
    free phase's rest and its copy into s0, the nudged phases' start copied from the free rows)."""
    if importlib.util.find_spec("triton") is None or not interpreting():
        pytest.skip("needs triton and TRITON_INTERPRET=1 (pip install -e '.[kernels]')")
    names = ("window_backend", "update_backend", "readout_backend")
    ops, launches = dispatched_ops(trainer2.config("dev", **dict.fromkeys(names, "triton")), 8)
    assert launches == 14
    assert sum(ops.values()) == 10, ops  # docs/triton.md lists them
    taken = ("relaxation.py:lior", "relaxation.py:free_stats", "relaxation.py:nudged_stats")
    taken += ("dynamics.py:set_nudge_scale", "readout.py:rotor_angle_grad", "dynamics.py:zero_", "dynamics.py:copy_")
    taken += ("relaxation.py:nudged_phases",)
    assert not any(k.endswith(taken) for k in ops), ops
    assert not any(k.startswith(("physics/couplings/dense.py:ep_grads", "learning/update.py:apply")) for k in ops), ops
