"""benchmarks/gpu_checks.py, which a GPU session runs, cannot rot: its CPU smoke run goes through every part a CPU can
run (bench rows, graph = eager, the conv and hopfield_resnet13 epochs, the FLOP count, the CUDA tests' selection) and
prints the goal rows in the form docs/performance.md keeps, then the table of every mode."""

from __future__ import annotations

import importlib.util
import re

import torch

from benchmarks import gpu_checks
from trainer2.physics.kernels.backend import interpreting
from trainer2.running.bench import make_step

GOAL = re.compile(r"^\| gpu-goal \| abc1234 \| CPU \(smoke\) \| ([^|]+) \| [^|]+ \| [^|]+ \| (met|not met) \|$")


def test_the_smoke_run_prints_every_goal_row_and_the_table_last(capsys):
    threads = torch.get_num_threads()
    try:
        assert gpu_checks.main(["--smoke", "--commit", "abc1234"]) == 0
    finally:
        torch.set_num_threads(threads)  # the smoke run uses one
    lines = capsys.readouterr().out.strip().splitlines()
    names = [m.group(1).strip() for m in map(GOAL.match, lines) if m]
    for name in (
        "triton+graph / compile+graph",
        "kernels per batch step",
        "share of fp32 peak",
        "graph = eager (dense)",
        "graph = eager (conv)",
        "conv epoch (DCHN shape)",
        "conv epoch (DCHN shape, 16 / 8 steps)",
        "hopfield_resnet13 epoch",
        "mnist_mlp epoch (60,000 images)",
        "mnist_conv epoch (60,000 images)",
        "mnist_res epoch (60,000 images)",
        "CUDA tests",
    ):
        assert name in names, (name, names)
    assert not any(line.startswith("| gpu-goal |") and not GOAL.match(line) for line in lines)
    table = lines[lines.index("== every mode ==") + 1 :]
    assert table[0].startswith("| machine | batch | mode |") and all(row.startswith("| ") for row in table)
    rows = {tuple(c.strip() for c in row.split("|")[1:4]): row.split("|") for row in table[2:]}
    assert int(rows[("dev", "4", "eager")][6]) > 0  # ops of the profiled batch step
    assert "CUDA graphs need a CUDA device" in rows[("dev", "4", "graph")][4]
    if importlib.util.find_spec("triton") and interpreting():
        # 2 window launches, the EP statistic of the 2 couplings, the observables, the readout's frame, its loss and
        # gradients and its rotor's angle gradient, 2 of the fused update, 1 cap, 2 of the window's metrics, the weight
        # average (the dev preset keeps one); in the interpreter the EP, observables, rotor and metrics kernels join the
        # Triton window, readout and update whatever their switches say
        assert rows[("dev", "4", "triton")][7].strip() == "14"
        assert rows[("dev, torch readout", "4", "triton")][7].strip() == "11"  # the readout part: its kernels left out
        assert rows[("dev, frame kernel", "4", "triton")][7].strip() == "14"  # the frame part: the readout kernels
        assert rows[("dev, EP + metrics kernels", "4", "triton")][7].strip() == "14"
    collected = re.search(r"CUDA tests \| (\d+) CUDA tests collected", "\n".join(lines))
    assert collected and int(collected.group(1)) >= 8  # pytest -m cuda finds the marked tests
    assert re.search(r"conv epoch \(DCHN shape\) \| [\d.]+ s \(the whole epoch, eager", "\n".join(lines))
    # the same machine at the settled steps, each epoch row with its last batch's residuals
    settled = re.search(r"conv epoch \(DCHN shape, 16 / 8 steps\) \| [\d.]+ s \(the whole epoch, eager; .*"
                        r"res free ([\d.]+) / nudged ([\d.]+)\)", "\n".join(lines))  # fmt: skip
    assert settled and all(float(r) >= 0.999 for r in settled.groups())  # spd / sqrt(eps): never below the floor
    # the graph preset, shrunk: its epoch ran whole, and its FLOPs were counted
    assert re.search(
        r"hopfield_resnet13 epoch \| [\d.]+ s \(the whole epoch, eager; [\d.]+ TFLOP/s; res free [\d.]+ / nudged "
        r"[\d.]+\) \| <= 90 s",
        "\n".join(lines),
    )
    # the full-MNIST presets, shrunk: each epoch on 1x28x28 images, a time stated with no goal
    for preset in ("mnist_mlp", "mnist_conv", "mnist_res"):
        assert re.search(
            preset + r" epoch \(60,000 images\) \| [\d.]+ s \(the whole epoch, eager.*\| stated \(no goal\) \| met",
            "\n".join(lines),
        )


def test_the_flop_count_follows_the_shapes():
    """A dense coupling is out x in multiply-adds a pull; a max-pooled 3x3 conv runs at the full image below it."""
    cfg = gpu_checks.config("conv", True, **gpu_checks.SMOKE_DCHN, augment_shift=0)
    data = gpu_checks.synthetic_images(16, (3, 8, 8), 10, 0)
    machine = make_step(cfg, data, 8, torch.device("cpu")).updater.m
    first, second, out = machine.energy.couplings
    assert gpu_checks.coupling_macs(first) == 4 * 3 * 9 * 8 * 8
    assert gpu_checks.coupling_macs(second) == 8 * 4 * 9 * 4 * 4
    assert gpu_checks.coupling_macs(out) == out.weight.numel() == cfg.coord_dim_n * 8 * 2 * 2


def test_the_smoke_resnet_is_the_presets_graph_shrunk_and_its_flops_follow_the_graph():
    """The smoke resnet-epoch runs hopfield_resnet13's own 13 couplings (strides, 1x1 skips) at 4-8 channels; a strided
    conv without pooling is counted at its output's size, and the drive is every coupling from the input (0 and the
    skip 2), the rest between states both ways every step."""
    overrides = gpu_checks.epoch_overrides("resnet-epoch", True)
    cfg = gpu_checks.config("hopfield_resnet13", True, **overrides, augment_shift=0)
    assert gpu_checks.takes_images(cfg)
    full = gpu_checks.config("hopfield_resnet13", False).plan().graph
    assert cfg.plan().graph.edges == full.edges and len(full.edges) == 13
    data = gpu_checks.synthetic_images(16, (3, 16, 16), 10, 0)
    machine = make_step(cfg, data, 8, torch.device("cpu")).updater.m
    c = machine.energy.couplings
    assert {tuple(k.weight.shape[:2]) for k in c[:-1]} <= {(4, 3), (4, 4), (8, 4), (8, 8)}
    assert gpu_checks.coupling_macs(c[1]) == 4 * 4 * 9 * 8 * 8  # 3x3 stride 2: 16x16 -> 8x8
    assert gpu_checks.coupling_macs(c[2]) == 4 * 3 * 1 * 8 * 8  # the 1x1 stride-2 skip from the input
    macs = [gpu_checks.coupling_macs(k) for k in c]
    drive, between = macs[0] + macs[2], sum(macs) - macs[0] - macs[2]
    n, free, nudge = cfg.coord_dim_n, cfg.free_steps, cfg.nudge_steps  # its rule, ep: two nudged phases (+-beta)
    want = 2.0 * (drive * 3 + free * (2 * between + n * n) + nudge * 2 * (2 * between + 2 * n * n + 2 * n * 10))
    assert gpu_checks.window_flops(machine, cfg, 10) == want


def test_the_frame_parts_graph_case_joins_the_graph_parts_and_its_error_fails_the_run(monkeypatch, capsys, tmp_path):
    """On a GPU (faked: no kernel runs, the parts are stubs) the frame part replays FRAME_GRAPH_CASES after its bench
    rows; whichever of it and the graph part runs first, both parts' cases reach the goal rows, and a case's error makes
    the run exit 1."""
    calls = []

    def graph_part(plan, device, log, cases=gpu_checks.GRAPH_CASES):
        calls.append([name for name, *_ in cases])
        return {name: "error: CompilationError: x" if "frame" in name else "bitwise" for name, *_ in cases}

    monkeypatch.setattr(gpu_checks.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_checks.torch.cuda, "get_device_name", lambda device: "Fake GPU")
    monkeypatch.setattr(gpu_checks.tempfile, "mkdtemp", lambda prefix: str(tmp_path))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # restored after the test
    monkeypatch.setattr(gpu_checks, "bench_part", lambda plan, part, device, log: [])
    monkeypatch.setattr(gpu_checks, "graph_part", graph_part)
    for parts in (["frame", "graph"], ["graph", "frame"]):
        calls.clear()
        assert gpu_checks.main(["--commit", "abc1234", "--tests", "none", "--parts", *parts]) == 1
        out = capsys.readouterr().out
        assert sorted(calls) == [["dense", "dense, triton", "conv"], ["dense, frame kernel"]]
        assert "| graph = eager (dense, frame kernel) | error: CompilationError: x | bitwise | not met |" in out
        assert "| graph = eager (dense) | bitwise | bitwise | met |" in out


def test_the_settled_conv_epoch_is_the_dchn_at_fewer_even_odd_steps():
    """conv-epoch-settled runs the DCHN's own machine and batch (only the step counts differ), in the conv preset's
    even/odd order, so its row and conv-epoch's compare the steps alone."""
    real, settled = (gpu_checks.epoch_overrides(part, False) for part in ("conv-epoch", "conv-epoch-settled"))
    steps = ("free_steps", "nudge_steps")
    assert {k: v for k, v in settled.items() if k not in steps} == {k: v for k, v in real.items() if k not in steps}
    assert [settled[k] for k in steps] == [16, 8] and [real[k] for k in steps] == [60, 15]
    assert gpu_checks.config("conv", False, **settled).relaxation == "even_odd"
