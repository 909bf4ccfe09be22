"""Every GPU check of trainer2 (issues 24 and 38) in one run of about 8.5 minutes on an H200, ending with the goal rows
and the table of every mode.

    python -m benchmarks.gpu_checks [--commit HASH] [--tests cuda|all|none] [--budget 540] [--parts NAME ...]
    python -m benchmarks.gpu_checks --smoke     # on the CPU: tiny sizes, every path a CPU can run (tests run it)

The parts, in this order while the time budget lasts (a part whose estimate no longer fits is skipped, saying so; run
it in a second call with --parts):
  dev8        bench at the dev preset, batch 8: eager, graph, compile+graph, triton+graph (the Triton window, readout
              and fused update), with an empty Triton cache, so setup_s includes compiling the kernels;
  graph       graph = eager, bitwise: windows of the dev machine (torch, and Triton window, readout and fused update)
              and of the conv preset's machine, eagerly and replayed as a CUDA graph (conv again with
              cudnn.deterministic if not);
  dev4096     dev preset at batch 4096 (graph, triton+graph): the relaxation's share of the fp32 peak;
  conv-epoch  the DCHN of Scellier et al. 2023 (3x3 conv layers 128-256-512-512, max pooling) on 50,000 synthetic
              3x32x32 images, batch 128, 60 free / 15 nudged steps, replayed as a CUDA graph: seconds per epoch (the
              whole epoch when it fits in its budget, else timed batches extrapolated to the epoch's 390);
  conv-epoch-settled  the same machine at 16 free / 8 nudged even/odd steps, where its shape has settled (the CPU's
              step counts at a sixteenth of the width: docs/relaxation.md): the goal's accuracy-preserving steps. Both
              epoch rows print the last batch's residuals (res free / nudged: 1 at the floor), so the full width's
              settling is read beside its time;
  resnet-epoch  the same for the hopfield_resnet13 preset (Hopfield-ResNet13: a graph energy of 3x3 convs, stride-2
              convs in place of pooling and 1x1 stride-2 skips, 128-256-512-512 channels, relu6 boxes) at its own
              steps, batch 128;
  mnist-mlp-epoch  an epoch of the full-MNIST dense preset (mnist_mlp: 60,000 synthetic 1x28x28 images, its own
              width, batch and steps; issue 72): the GPU column of docs/mnist.md, a time stated, no goal;
  mnist-conv-epoch  the same for the full-MNIST convolutional preset (mnist_conv: conv_deep's three conv layers,
              batch 64, 8 / 4 steps);
  mnist-res-epoch  the same for the full-MNIST residual preset (mnist_res: that chain and a skip from the input);
  tests       the tests that need CUDA (`pytest -m cuda`: graph capture, the compiled Triton kernels against torch, ...;
              --tests all: the whole suite);
  readout     dev batch 8 and 4096, triton+graph with the readout's loss and gradients in torch (--readout_backend
              torch): beside dev8's and dev4096's triton+graph rows, what the readout kernel saves
              (AUTO_TAKES_TRITON_READOUT);
  frame       dev batch 8 and 4096, triton+graph with the readout's frame and fold in one launch as well
              (--readout_backend triton), and its graph = eager case (`dense, frame kernel`); since 64c1620's rows
              (AUTO_TAKES_TRITON_FRAME on) dev8's and dev4096's triton+graph rows take it too, so these repeat them
              with the kernels asked for by name;
  ep-metrics  dev batch 8 and 4096, triton+graph with the EP statistic a launch per coupling, the window's
              observables in one launch, the rotor's angle gradient in one and the window's metrics in two as well
              (kernels/ep_statistic.py, window_stats.py, rotor_angle_grad.py, window_metrics.py; AUTO_TAKES_TRITON_EP,
              _STATS, _ROTOR and _METRICS switched on for these rows only): where the CUDA tests pass
              (triton_window_check and update_check compare them) and these rows beat dev8's and dev4096's
              triton+graph rows, set the switches;
  conv, dev64, production, deep   more bench rows: the conv preset at batch 128 (eager, graph, compile+graph), dev
              batch 64 (as dev8), production and deep (eager, graph, triton+graph).

It prints one line per part as it goes, then one row per goal in the form docs/performance.md keeps,
`| gpu-goal | <commit> | <device> | <name> | <value> | <goal> | met/not met |`, and last the table of every mode.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from unittest.mock import patch

import torch

from benchmarks.provenance import commit_of

ROOT = Path(__file__).resolve().parent.parent
GOAL_TRITON_SPEEDUP = 5.0  # triton+graph over compile+graph windows/s, dev batch 8
GOAL_KERNELS = 30  # kernels per batch step, triton+graph, dev batch 8
GOAL_PEAK_SHARE = 30.0  # % of the fp32 peak at batch 4096
GOAL_EPOCH_S = 20.0  # seconds per conv-machine epoch on an H100
GOAL_RESNET_EPOCH_S = 90.0  # seconds per hopfield_resnet13 epoch (50,000 images, batch 128)
GOAL_FIRST_WINDOW_S = 30.0  # start to the first replayed triton+graph window, cold Triton cache (issue 24)
GOAL_GRAPH_SPEEDUP = 5.0  # graph over eager windows/s, dev batch 8
# Non-tensor-core fp32 peaks in TFLOP/s, first match in the device name wins: the Triton dots are "ieee" FMAs, not TF32.
FP32_PEAK_TFLOPS = {"H100 PCIe": 51.2, "H100": 66.9, "H200": 66.9, "A100": 19.5}
DCHN_LAYERS = [{"conv": {"channels": c, "kernel": 3, "pool": 2, "pooling": "max"}} for c in (128, 256, 512, 512)]
DCHN = {"layers": DCHN_LAYERS, "batch_size": 128, "free_steps": 60, "nudge_steps": 15}
# The same machine at the even/odd steps where the DCHN's shape has settled: at a sixteenth of its width on MNIST,
# 16 / 8 ends where 60 / 15 ends (residuals 1.000 / 1.000, the EP cosine to the exact gradient equal to 5 digits, the
# free state 9e-8 from its fixed point; docs/relaxation.md#the-dchns-shape), with 2.8x fewer steps a window
DCHN_SETTLED = {**DCHN, "free_steps": 16, "nudge_steps": 8}
# The CPU smoke run: the same parts at sizes the CPU (and Triton's interpreter) get through in seconds.
SMOKE_DENSE = {"layers": [{"dense": 16}], "coord_dim_n": 4, "free_steps": 3, "nudge_steps": 2, "device": "cpu"}
SMOKE_DCHN = {
    "layers": [{"conv": {"channels": c, "kernel": 3, "pool": 2, "pooling": "max"}} for c in (4, 8)],
    "batch_size": 8,
    "free_steps": 3,
    "nudge_steps": 2,
}
SMOKE_RESNET = {"batch_size": 8, "free_steps": 3, "nudge_steps": 2}  # and a graph preset's couplings, smoke_graph
SMOKE_MNIST_MLP = {"layers": [{"dense": 16}], "batch_size": 8, "free_steps": 3, "nudge_steps": 2}
SMOKE_MNIST_CONV = {**SMOKE_DCHN, "layers": [{"conv": {"channels": 4, "kernel": 3, "pool": 2}}] * 2}


@dataclass
class Plan:
    """What one run measures, at real (GPU) or smoke (CPU) sizes."""

    smoke: bool
    windows: int  # timed windows per bench row
    epoch_images: int
    image: tuple[int, int, int]
    epoch_budget_s: float  # the conv epoch runs whole when its estimate fits in this, else it is extrapolated
    big_batch: int
    bench: dict[str, tuple[str, list[int], list[str]]] = field(default_factory=dict)  # part -> (preset, batches, modes)

    @staticmethod
    def make(smoke: bool) -> "Plan":
        torch_modes = ["eager", "graph", "compile+graph", "triton+graph"]
        if smoke:  # no compile on the CPU (inductor takes minutes); graph rows say n/a; triton runs interpreted
            modes = ["eager", "graph", "triton", "triton+graph"]
            smoke_bench = {
                "dev8": ("dev", [4], modes),
                "readout": ("dev", [4], ["triton"]),
                "frame": ("dev", [4], ["triton"]),
                "ep-metrics": ("dev", [4], ["triton"]),
            }
            return Plan(True, 2, 48, (3, 16, 16), 5.0, 16, {**smoke_bench, "dev4096": ("dev", [16], modes[:2])})
        return Plan(
            False,
            200,
            50_000,
            (3, 32, 32),
            60.0,
            4096,
            {
                "dev8": ("dev", [8], torch_modes),
                "readout": ("dev", [8, 4096], ["triton+graph"]),
                "frame": ("dev", [8, 4096], ["triton+graph"]),
                "ep-metrics": ("dev", [8, 4096], ["triton+graph"]),
                "dev4096": ("dev", [4096], ["graph", "triton+graph"]),
                "dev64": ("dev", [64], torch_modes),
                "conv": ("conv", [128], ["eager", "graph", "compile+graph"]),
                "production": ("production", [64], ["eager", "graph", "triton+graph"]),
                "deep": ("deep", [8, 64], ["eager", "graph", "triton+graph"]),
            },
        )


# Estimated seconds of each part on an H200 (the CUDA tests and compiling dominate), for the budget; the parts run in
# this order, the goal rows' parts first. The "(N s in)" lines of a run give the real figures.
ESTIMATE_S = {  # 64c1620 on an H200 took 59, 4, 5, 34, 258, 1, 1, 66 (alone), 31, 2 and 3 s (resnet-epoch: none yet)
    "dev8": 75,
    "graph": 15,
    "dev4096": 15,
    "conv-epoch": 45,
    "conv-epoch-settled": 25,  # a third of conv-epoch's steps; its warm-up and capture besides
    "resnet-epoch": 80,  # its timed batches stop at the epoch budget (60 s); warm-up and capture besides
    "mnist-mlp-epoch": 20,  # 938 batches of one dense layer; warm-up and capture besides (none measured yet)
    "mnist-conv-epoch": 40,  # 937 batches of three small conv layers at 8 / 4 steps (none measured yet)
    "mnist-res-epoch": 50,  # the same and one more conv coupling (none measured yet)
    "tests": 300,  # the compile tests and the Triton window check, each in a child process
    "readout": 10,
    "frame": 10,
    "ep-metrics": 10,
    "conv": 75,  # compile+graph's compile takes most of it
    "dev64": 40,
    "production": 10,
    "deep": 10,
}


# A part that benches a preset with other settings, and the name its rows carry in the table
VARIANTS = {
    "readout": ("dev, torch readout", {"readout_backend": "torch"}),
    "frame": ("dev, frame kernel", {"readout_backend": "triton"}),
    "ep-metrics": ("dev, EP + metrics kernels", {}),
}
# A part whose rows run with `auto` switches of trainer2/physics/kernels/backend.py on that a run does not have on yet
# (a kernel never compiled on a GPU spoils only those rows if it fails)
SWITCHED_ON = {
    "ep-metrics": (
        "AUTO_TAKES_TRITON_EP",
        "AUTO_TAKES_TRITON_STATS",
        "AUTO_TAKES_TRITON_ROTOR",
        "AUTO_TAKES_TRITON_METRICS",
    )
}


# The image presets: smoke runs keep their layers (the epoch parts shrink them), not SMOKE_DENSE's
IMAGE_PRESETS = ("conv", "hopfield_resnet13")


def config(preset: str, smoke: bool, **overrides):
    """A preset's config with overrides (smoke: shrunk to tiny sizes on the CPU)."""
    import trainer2

    small = {**SMOKE_DENSE} if smoke and preset not in IMAGE_PRESETS else {"device": "cpu"} if smoke else {}
    if smoke and preset == "conv":
        small.update(layers=[{"conv": {"channels": 4, "kernel": 3, "pool": 2}}], free_steps=3, nudge_steps=2)
    if "couplings" in overrides:  # a graph keeps its own named layers (mnist_res)
        small.pop("layers", None)
    return trainer2.config(preset, **{**small, **overrides})


def synthetic_images(n: int, shape: tuple[int, int, int], classes: int, seed: int):
    """An image data set of n normal-noise images and random labels, in memory (the held-out split: its first 256)."""
    from trainer2.data.dataset import Dataset

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, shape[0] * shape[1] * shape[2], generator=gen)
    y = torch.randint(0, classes, (n,), generator=gen)
    held = min(256, n)
    return Dataset(
        kind="images",
        source=f"synthetic {n} x {shape}",
        vocab=[],
        num_classes=classes,
        input_dim=x.shape[1],
        context_len=0,
        train=x,
        heldout=x[:held],
        train_y=y,
        heldout_y=y[:held],
        input_shape=shape,
    )


def smoke_graph(preset: str) -> list[dict]:
    """A graph preset's couplings at smoke sizes: the same topology (kernels, strides, paddings, the 1x1 skips), 4 or 8
    channels in place of 128 or more."""
    import trainer2

    def shrunk(entry: dict) -> dict:
        if "conv" not in entry:
            return entry
        return {**entry, "conv": {**entry["conv"], "channels": min(8, max(4, entry["conv"]["channels"] // 32))}}

    return [shrunk(e) for e in trainer2.config(preset).couplings]


def takes_images(cfg) -> bool:
    """Whether the machine convolves its input: a chain's first layer, or a graph's coupling from the input, is conv."""
    if cfg.couplings:
        return any("conv" in e for e in cfg.couplings if e.get("from") == "input")
    return bool(cfg.layers) and "conv" in cfg.layers[0]


def data_for(cfg):
    """The data a bench part runs on: the preset's text, or synthetic images (MNIST's shape) for a conv machine."""
    from trainer2.data.load import DataConfig, load_data

    if takes_images(cfg):
        return synthetic_images(2048, (1, 28, 28), 10, cfg.seed)
    return load_data(cfg.section(DataConfig))


def coupling_macs(c) -> int:
    """Multiply-adds of one pull of a coupling for one row: a dense W (out x in); a conv K (C_out, C_in, k, k) at the
    resolution it runs at (max pooling: the full image below; average pooling: a stride-p conv with the (k+p-1)^2
    kernel; no pooling: the conv's own output, the layer above, at its stride and padding)."""
    if c.kind == "dense":
        return c.weight.numel()
    c_out, c_in, k, _ = c.weight.shape
    _, h, w = c.below_shape
    if c.pool > 1 and c.pooling == "max":
        return c_out * c_in * k * k * h * w
    if c.pool > 1:
        return c_out * c_in * (k + c.pool - 1) ** 2 * (h // c.pool) * (w // c.pool)
    _, h_out, w_out = c.above_shape
    return c_out * c_in * k * k * h_out * w_out


def window_flops(machine, cfg, candidates: int) -> float:
    """FLOPs of one batch step's relaxation per example, counted from the machine's shapes: each phase's input drive
    once (the couplings from the clamped input), every step each coupling between state layers both ways, and on
    nudged steps the readout (y = q L^T, the distances to the candidates, their pull: 2 n^2 + 2 n K). The EP
    statistics and the update are left out (a few %), so a share of the peak from this is a lower bound."""
    from trainer2.learning.rules.rule import rule_scheme

    e = machine.energy
    driven = [c for c, (below, _) in zip(e.couplings, e.graph.edges) if below < 0]  # a chain's: couplings[0]
    between = [c for c, (below, _) in zip(e.couplings, e.graph.edges) if below >= 0]
    n, phases = cfg.coord_dim_n, max(1, rule_scheme(cfg.rule, cfg).phases)  # rbp: its adjoint, about one phase
    chain = 2 * sum(coupling_macs(c) for c in between)
    drive = sum(coupling_macs(c) for c in driven) * (1 + phases)
    nudged = cfg.nudge_steps * phases * (chain + 2 * n * n + 2 * n * candidates)
    return 2.0 * (drive + cfg.free_steps * (chain + n * n) + nudged)


def bench_part(plan: Plan, part: str, device: torch.device, log: Callable[[str], None]) -> list[tuple[str, object]]:
    """(preset, bench row) of one part (bench.measure on a fresh machine per mode)."""
    import torch._dynamo

    from trainer2.physics.kernels import backend
    from trainer2.running.bench import measure

    preset, batches, modes = plan.bench[part]
    label, overrides = VARIANTS.get(part, (preset, {}))
    cfg = config(preset, plan.smoke, **overrides)
    data = data_for(cfg)
    rows = []
    with ExitStack() as switches:
        for name in SWITCHED_ON.get(part, ()):
            switches.enter_context(patch.object(backend, name, True))
        for b in batches:
            torch._dynamo.reset()  # every compile is of BatchStep.step: keep dynamo's recompile limit out of the way
            windows = plan.windows if b < 1024 else max(2, plan.windows // 4)
            for r in measure(cfg, data, device, b, modes, windows, cfg.warmup_steps + 2, 5):
                log(f"  {label} batch {b} {r.mode}: {r.windows_per_s or 0:.1f} windows/s {r.note}".rstrip())
                rows.append((label, r))
    return rows


def graph_equals_eager(cfg, data, device: torch.device, windows: int, graphs: bool = True) -> str:
    """Run `windows` batch steps of two identical machines, one eagerly and one replayed as a CUDA graph (graphs=False:
    eagerly too, the run-to-run baseline; lr changing between windows as a schedule does); 'bitwise' when every
    tensor the step touches is equal, else the largest difference."""
    from trainer2.running.bench import host_batches, make_step
    from trainer2.running.step_runner import StepRunner, step_tensors

    steps = [make_step(cfg, data, cfg.batch_size, device) for _ in range(2)]
    logs: list[str] = []
    runners = [StepRunner(steps[0]), StepRunner(steps[1], graphs=graphs, warmup_steps=2, log=logs.append)]
    with torch.no_grad():
        for i, (x, y) in enumerate(host_batches(data, cfg.batch_size, windows, cfg.seed)):
            for step, runner in zip(steps, runners):
                step.updater.state.lr.fill_(cfg.eta_update / (1 + i))
                runner.step(x, y)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    worst = max(difference(a, b) for a, b in zip(*map(step_tensors, steps)))
    if runners[1].mode != ("graph" if graphs else "eager"):
        why = "no CUDA device" if device.type != "cuda" else logs[-1] if logs else "not captured"
        return f"n/a (ran {runners[1].mode}: {why}; largest difference {worst:.2g})"
    return "bitwise" if worst == 0.0 else f"differs by up to {worst:.3g}"


def difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """0.0 when a and b hold the same values (NaN where the other has NaN), else the largest |a - b| where they differ
    (inf where only one is NaN or infinite)."""
    same = (a == b) | (a.isnan() & b.isnan())
    if bool(same.all()):
        return 0.0
    return float((a[~same].double() - b[~same].double()).abs().nan_to_num(nan=float("inf")).max())


# The graph part's cases: (name, preset, window and update backend, readout backend). On a GPU `auto` gives the triton
# machine the readout's loss kernel; on the CPU auto takes no kernel, so the triton case asks for both by name.
GRAPH_CASES = (
    ("dense", "dev", "torch", "torch"),
    ("dense, triton", "dev", "triton", "auto"),
    ("conv", "conv", "torch", "torch"),
)
# The readout's frame kernel, never yet compiled on a GPU, replays in the frame part, after the goal parts: a kernel
# that faults the device (a sticky error) spoils only the parts after it
FRAME_GRAPH_CASES = (("dense, frame kernel", "dev", "triton", "triton"),)


def graph_part(
    plan: Plan, device: torch.device, log: Callable[[str], None], cases: tuple = GRAPH_CASES
) -> dict[str, str]:
    """Graph = eager for each case's machine (GRAPH_CASES: the dense machine with torch, with the Triton window,
    readout and fused update, and the conv preset's machine)."""
    from trainer2.physics.kernels.backend import runtime_blocker

    windows = 4 if plan.smoke else 30
    out = {}
    for name, preset, backend, readout in cases:
        if backend == "triton" and runtime_blocker(device) is not None:  # the CPU without triton's interpreter
            continue
        readout = "triton" if readout == "auto" and device.type != "cuda" else readout
        backends = {"window_backend": backend, "update_backend": backend, "readout_backend": readout}
        cfg = config(preset, plan.smoke, **backends, batch_size=8)
        try:  # a kernel that fails to compile spoils its own case, not the others
            out[name] = graph_equals_eager(cfg, data_for(cfg), device, windows)
            if name == "conv" and out[name].startswith("differs"):
                # cuDNN may pick nondeterministic algorithms: is eager against eager equal, and graph under
                # determinism?
                again = graph_equals_eager(cfg, data_for(cfg), device, windows, False)
                out[name] += f"; eager against eager: {again}"
                torch.backends.cudnn.deterministic = True
                try:
                    determined = graph_equals_eager(cfg, data_for(cfg), device, windows)
                    out[name] += f"; with cudnn.deterministic: {determined}"
                finally:
                    torch.backends.cudnn.deterministic = False
        except Exception as e:
            out[name] = f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        log(f"  graph = eager, {name}: {out[name]}")
    return out


# The epoch parts: part -> (preset, its overrides at GPU sizes, at smoke sizes, the goal row's name, the goal in s or
# None: a time stated, no goal)
EPOCH_PARTS = {
    "conv-epoch": ("conv", DCHN, SMOKE_DCHN, "conv epoch (DCHN shape)", GOAL_EPOCH_S),
    "conv-epoch-settled": ("conv", DCHN_SETTLED, SMOKE_DCHN, "conv epoch (DCHN shape, 16 / 8 steps)", GOAL_EPOCH_S),
    "resnet-epoch": ("hopfield_resnet13", {}, SMOKE_RESNET, "hopfield_resnet13 epoch", GOAL_RESNET_EPOCH_S),
    "mnist-mlp-epoch": ("mnist_mlp", {}, SMOKE_MNIST_MLP, "mnist_mlp epoch (60,000 images)", None),
    "mnist-conv-epoch": ("mnist_conv", {}, SMOKE_MNIST_CONV, "mnist_conv epoch (60,000 images)", None),
    "mnist-res-epoch": ("mnist_res", {}, SMOKE_RESNET, "mnist_res epoch (60,000 images)", None),
}
MNIST_SHAPE = (1, 28, 28)  # the full-MNIST parts' images (60,000 of them at GPU sizes); the others take the plan's


def epoch_images(part: str, plan: Plan) -> tuple[int, tuple[int, int, int]]:
    """(images, shape) of an epoch part's synthetic data set: MNIST's for the mnist parts, else the plan's."""
    if part.startswith("mnist-"):
        return (plan.epoch_images if plan.smoke else 60_000), MNIST_SHAPE
    return plan.epoch_images, plan.image


def epoch_overrides(part: str, smoke: bool) -> dict:
    """An epoch part's overrides of its preset (smoke: tiny sizes; a graph preset's couplings shrunk, smoke_graph)."""
    preset, real, small, _, _ = EPOCH_PARTS[part]
    if not smoke:
        return real
    import trainer2

    return {**small, "couplings": smoke_graph(preset)} if trainer2.config(preset).couplings else small


def image_epoch(
    plan: Plan,
    device: torch.device,
    log: Callable[[str], None],
    preset: str,
    overrides: dict,
    label: str,
    images: tuple[int, tuple[int, int, int]],
) -> dict[str, float | str]:
    """Seconds per epoch of an image preset's machine (with overrides) on synthetic `images` (count, shape), replayed
    as a CUDA graph (eager on the CPU), wall clock from the first batch drawn to the last step done, after warm-up and
    capture."""
    from trainer2.data.sampler import Sampler
    from trainer2.running.bench import make_step
    from trainer2.running.step_runner import StepRunner

    cuda = device.type == "cuda"
    cfg = config(preset, plan.smoke, **{**overrides, "augment_shift": 0})
    data = synthetic_images(*images, 10, cfg.seed)
    step = make_step(cfg, data, cfg.batch_size, device)
    runner = StepRunner(step, graphs=cuda, warmup_steps=cfg.warmup_steps, log=log)
    sampler = Sampler(data.num_examples("train"), cfg.batch_size, cfg.seed)
    total = sampler.batches_per_epoch

    def batches(n: int) -> float:
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(n):
            runner.step(*data.batch("train", sampler.next()))
        if cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    with torch.no_grad():
        batches(cfg.warmup_steps + 2)  # warm-up and capture, untimed
        probe = min(10, total)
        seconds = batches(probe)
        fits = seconds / probe * total <= plan.epoch_budget_s
        more = (
            total - probe if fits else max(0, min(total - probe, int(plan.epoch_budget_s / (seconds / probe)) - probe))
        )
        seconds += batches(more)
    timed = probe + more
    epoch = seconds / timed * total
    flops = window_flops(step.updater.m, cfg, data.num_classes) * cfg.batch_size * timed / seconds
    how = "the whole epoch" if timed == total else f"{timed} batches after warm-up, extrapolated to {total}"
    how += f", cudnn TF32 {'on' if torch.backends.cudnn.allow_tf32 else 'off'}" if cuda else ""
    # The last batch's residuals (spd at each phase's last step / sqrt(eps), 1 at the floor): whether these steps settle
    floor = cfg.eps**0.5
    free, nudged = (float(ws.spd_rows[-1].mean()) / floor for ws in (step.relax.ws, step.relax.ws_nudged))
    res = f"res free {free:.3f} / nudged {nudged:.3f}"
    log(f"  {label}: {epoch:.1f} s ({how}; {runner.mode}); {flops / 1e12:.1f} TFLOP/s counted; {res}")
    return {"seconds": epoch, "how": f"{how}, {runner.mode}", "tflops": flops / 1e12, "res": res}


def cuda_tests(which: str, smoke: bool, timeout: float) -> str:
    """Run the tests that need CUDA (`-m cuda`), or all; smoke: only collect the CUDA tests (none can run here)."""
    select = [] if which == "all" else ["-m", "cuda"]
    # no:logging: a failing compile test's captured DEBUG logs would bury its traceback in the printed tail
    cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "--tb=short", "-p", "no:logging", *select, "tests"]
    cmd += ["--collect-only"] if smoke else []
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f} s"
    print(proc.stdout[-20000:], proc.stderr[-4000:], sep="\n")
    if smoke:
        found = re.search(r"(\d+)(?:/\d+)? tests? collected", proc.stdout)
        return f"{found.group(1) if found else 0} CUDA tests collected"
    counts = {k: len(re.findall(rf"^{k} ", proc.stdout, re.M)) for k in ("PASSED", "FAILED", "ERROR", "SKIPPED")}
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", proc.stdout, re.M)
    return (
        f"{counts['PASSED']} passed, {counts['FAILED'] + counts['ERROR']} failed, {counts['SKIPPED']} skipped"
        + (f" ({', '.join(failed)})" if failed else "")
        + ("" if proc.returncode in (0, 5) or failed else f" (pytest exit {proc.returncode})")
    )


def goal_rows(rows: list, results: dict, commit: str, device_name: str, plan: Plan) -> list[str]:
    """One `| gpu-goal | ... |` row per goal; a goal that was not measured is 'not met' with the reason."""
    by = {(preset, r.batch, r.mode): r for preset, r in rows}
    out = []

    def row(name: str, value: str, goal: str, met: bool) -> None:
        out.append(
            f"| gpu-goal | {commit} | {device_name} | {name} | {value} | {goal} | {'met' if met else 'not met'} |"
        )

    def rate(preset: str, batch: int, mode: str) -> float | None:
        r = by.get((preset, batch, mode))
        return r.windows_per_s if r is not None else None

    small = plan.bench["dev8"][1][0]
    tri, comp = rate("dev", small, "triton+graph"), rate("dev", small, "compile+graph")
    ratio = tri / comp if tri and comp else None
    row(
        "triton+graph / compile+graph",
        f"{ratio:.2f}x ({tri:.0f} / {comp:.0f} windows/s, dev batch {small})" if ratio else "not measured",
        f">= {GOAL_TRITON_SPEEDUP:g}x",
        ratio is not None and ratio >= GOAL_TRITON_SPEEDUP,
    )
    r = by.get(("dev", small, "triton+graph"))
    k = r.kernels_per_batch if r is not None else None
    row(
        "kernels per batch step",
        f"{k} (triton+graph, dev batch {small})" if k is not None else "not measured",
        f"<= {GOAL_KERNELS}",
        k is not None and k <= GOAL_KERNELS,
    )
    eager, graph = rate("dev", small, "eager"), rate("dev", small, "graph")
    ratio = graph / eager if graph and eager else None
    row(
        "graph / eager",
        f"{ratio:.2f}x (dev batch {small})" if ratio else "not measured",
        f">= {GOAL_GRAPH_SPEEDUP:g}x",
        ratio is not None and ratio >= GOAL_GRAPH_SPEEDUP,
    )
    setup = r.setup_s if r is not None and r.windows_per_s else None
    row(
        "first replayed window, cold Triton cache",
        f"{setup:.1f} s (triton+graph, dev batch {small})" if setup is not None else "not measured",
        f"<= {GOAL_FIRST_WINDOW_S:g} s",
        setup is not None and setup <= GOAL_FIRST_WINDOW_S,
    )
    share, text = results.get("peak share") or (None, "not measured")
    row(
        "share of fp32 peak",
        text,
        f">= {GOAL_PEAK_SHARE:g} % at batch {plan.big_batch}",
        (share or 0.0) >= GOAL_PEAK_SHARE,
    )
    for name, value in results.get("graph", {}).items():
        row(f"graph = eager ({name})", value, "bitwise", value == "bitwise")
    for _, _, _, name, goal in EPOCH_PARTS.values():
        epoch = results.get(name)
        row(
            name,
            f"{epoch['seconds']:.1f} s ({epoch['how']}; {epoch['tflops']:.1f} TFLOP/s; {epoch['res']})"
            if epoch
            else "not measured",
            "stated (no goal)" if goal is None else f"<= {goal:g} s",
            bool(epoch) and (goal is None or epoch["seconds"] <= goal),
        )
    tests = results.get("tests", "not run")
    row("CUDA tests", tests, "all pass", bool(re.match(r"\d+ passed, 0 failed", tests)))
    for part, why in results.get("errors", {}).items():
        row(f"part {part}", why, "runs", False)
    return out


def peak_share(rows: list, plan: Plan, device: torch.device, device_name: str) -> tuple[float | None, str] | None:
    """(% of the device's fp32 peak, what it says) for the fastest mode's relaxation FLOP/s at the big batch."""
    from trainer2.running.bench import make_step

    big = [r for preset, r in rows if r.batch == plan.big_batch and r.windows_per_s and preset == "dev"]
    best = max(big, key=lambda r: r.windows_per_s, default=None)
    if best is None:
        return None
    cfg = config("dev", plan.smoke)
    data = data_for(cfg)
    machine = make_step(cfg, data, 1, torch.device("cpu")).updater.m  # shapes only: nothing more runs on the GPU
    tflops = window_flops(machine, cfg, data.num_classes) * best.batch * best.windows_per_s / 1e12
    peak = next((v for k, v in FP32_PEAK_TFLOPS.items() if k in device_name), None)
    if peak is None:
        return None, f"n/a: {tflops:.3g} TFLOP/s ({best.mode}), no fp32 peak known for {device_name}"
    share = 100 * tflops / peak
    return share, f"{share:.1f} % ({tflops:.2f} of {peak:g} TFLOP/s, {best.mode}, dev)"


def mode_table(rows: list) -> list[str]:
    """Every measured (machine, batch, mode) as a Markdown table."""
    eager = {(preset, r.batch): r.windows_per_s for preset, r in rows if r.mode == "eager"}
    lines = [
        "| machine | batch | mode | windows/s | vs eager | kernels/batch step | Triton launches/batch step | setup s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for preset, r in rows:
        if r.windows_per_s is None:
            lines.append(f"| {preset} | {r.batch} | {r.mode} | {r.note.replace('|', '/')} | | | | |")
            continue
        base = eager.get((preset, r.batch))
        vs = f"{r.windows_per_s / base:.2f}x" if base else "-"
        kernels = "-" if r.kernels_per_batch is None else str(r.kernels_per_batch)
        lines.append(
            f"| {preset} | {r.batch} | {r.mode} | {r.windows_per_s:.1f} | {vs} | {kernels} | {r.triton_per_batch} "
            f"| {r.setup_s:.1f} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_checks", description=__doc__.split("\n\n")[0])
    p.add_argument("--commit", help="The commit measured (default: git rev-parse --short HEAD, where git works).")
    p.add_argument("--tests", choices=("cuda", "all", "none"), default="cuda", help="Which tests the tests part runs.")
    p.add_argument("--budget", type=float, default=540.0, help="Seconds the parts may take together (estimated).")
    p.add_argument("--parts", nargs="+", choices=list(ESTIMATE_S), default=list(ESTIMATE_S), help="Parts to run.")
    p.add_argument("--smoke", action="store_true", help="CPU smoke run: tiny sizes, eager only (tests run it).")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        print("gpu_checks: torch sees no CUDA GPU here; run with --smoke for the CPU smoke run", file=sys.stderr)
        return 1
    device = torch.device("cuda" if cuda else "cpu")
    if args.smoke:
        torch.set_num_threads(1)  # tiny sizes: a second thread only waits for the first (docs/performance.md, Threads)
    device_name = torch.cuda.get_device_name(device) if cuda else "CPU (smoke)"
    if cuda:  # a cold cache: the triton rows' setup_s includes compiling the kernels
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="trainer2-triton-")
    plan = Plan.make(args.smoke)
    start, rows, results = time.perf_counter(), [], {"errors": {}}
    print(f"gpu_checks on {device_name}, torch {torch.__version__}, budget {args.budget:.0f} s", flush=True)

    def log(text: str) -> None:
        print(text, flush=True)

    for part in args.parts:
        if part in plan.bench or part in EPOCH_PARTS or part in ("graph", "tests"):
            left = args.budget - (time.perf_counter() - start)
            if not args.smoke and ESTIMATE_S[part] > left:
                log(f"{part}: skipped, its estimate {ESTIMATE_S[part]} s exceeds the {left:.0f} s left")
                results["errors"][part] = f"skipped for the time budget ({left:.0f} s left); rerun with --parts {part}"
                continue
            log(f"{part}: ({time.perf_counter() - start:.0f} s in)")
            try:
                if part in plan.bench:
                    rows += bench_part(plan, part, device, log)
                    if part == "frame" and device.type == "cuda":
                        results.setdefault("graph", {}).update(graph_part(plan, device, log, FRAME_GRAPH_CASES))
                elif part == "graph":
                    results.setdefault("graph", {}).update(graph_part(plan, device, log))
                elif part in EPOCH_PARTS:
                    preset, _, _, name, _ = EPOCH_PARTS[part]
                    over = epoch_overrides(part, args.smoke)
                    results[name] = image_epoch(plan, device, log, preset, over, name, epoch_images(part, plan))
                elif args.tests != "none":
                    results["tests"] = cuda_tests(args.tests, args.smoke, max(60.0, left))
                    log(f"  tests: {results['tests']}")
            except Exception as e:  # every part reports; one failing part must not hide the others' results
                results["errors"][part] = f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
                log(f"  {part}: {results['errors'][part]}")
    results["peak share"] = peak_share(rows, plan, device, device_name)
    goals = goal_rows(rows, results, commit_of(args.commit), device_name, plan)
    print(f"\n== gpu_checks: {device_name}, {time.perf_counter() - start:.0f} s; goal rows for docs/performance.md ==")
    print("\n".join(goals))
    print("\n== every mode ==")
    print("\n".join(mode_table(rows)))
    # Exit 1 when something is wrong (a part failed or was skipped, a test failed, a graph differs from eager); a speed
    # goal that is not met is a finding, in its row, not a failure of the run.
    graphs = results.get("graph", {}).values()
    wrong = results["errors"] or any(not (v == "bitwise" or v.startswith("n/a")) for v in graphs)
    tests = results.get("tests", "")
    return 1 if wrong or re.search(r"[1-9]\d* failed|timed out", tests) else 0


if __name__ == "__main__":
    sys.exit(main())
