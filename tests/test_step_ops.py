"""benchmarks/step_ops.py: a batch step's operators by issuing function add up to bench's count of the same step."""

from __future__ import annotations

import torch

import trainer2
from benchmarks.step_ops import main, step_ops
from trainer2.data.load import DataConfig, load_data
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
