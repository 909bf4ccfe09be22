"""Depth sweep: does a deeper machine still settle, get a faithful EP estimate in every layer, and learn?

    OMP_NUM_THREADS=1 python -m benchmarks.depth [--preset dev] [--depths 1 2 3 4] [--width 256] [--train_windows 3000]

For each depth (hidden layers [width] * depth) on the preset's settings (the built-in corpus unless the preset
names data), from the same seed:
  settling   a long free phase (--settle_steps) from rest on one training batch, at initialisation and after
             training: the first step from which the readout speed spd (the trainer's own residual) stays within
             2x of its floor sqrt(eps), and likewise the largest change of any state coordinate per step (floor:
             its rounding level); spd at the preset's T_free as a multiple of the floor, and that largest change
             at step T_free;
  cosine     EP update vs autograd through a converged float64 relaxation, per parameter (benchmarks/ep_cosine.py);
  learning   per parameter: EP gradient norm, the mean relative update per window (probed every --probe_every
             windows), and the relative change from initialisation to the end, both |a - b| / max(|a|, |b|);
  quality    held-out bpc and accuracy after --train_windows windows (the preset's schedule over that length);
  speed      training windows per second (eager, this process's threads).
Prints a detail block per depth, then one summary table.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

import trainer2
from benchmarks.ep_cosine import measure
from trainer2.flags import flag_overrides
from trainer2.learning.update import lr_at
from trainer2.physics.relaxation import Relaxation
from trainer2.running.trainer import Trainer


def settle_profile(
    trainer: Trainer, inputs: torch.Tensor, targets: torch.Tensor, steps: int
) -> tuple[list[float], list[float]]:
    """Free phase of `steps` steps from rest with the trainer's own window: per step, the batch-mean spd and the
    largest |s_t - s_{t-1}| over every state coordinate."""
    cfg = trainer.cfg.model_copy(update={"free_steps": steps})
    relax = Relaxation(trainer.machine, cfg, inputs.shape[0])
    prev = [torch.zeros_like(t) for t in relax.ws.state.s]
    moved: list[float] = []

    def on_steps(name: str, step: int, total: int, spd_last: float, lior: float) -> None:
        now = relax.ws.state.s
        moved.append(max(float((a - b).abs().max()) for a, b in zip(now, prev)))
        torch._foreach_copy_(prev, now)

    relax.progress_every, relax.on_steps = 1, on_steps
    with torch.no_grad():
        relax.free_phase(inputs.to(trainer.device), targets.to(trainer.device))
    return relax.ws.spd_hist[:steps].mean(1).tolist(), moved


def first_within(trace: list[float], floor: float) -> float:
    """The first step (1-based) from which the trace stays within 2x of `floor`; nan if it never does."""
    above = [t for t, v in enumerate(trace) if v > 2 * floor]
    return float("nan") if above and above[-1] == len(trace) - 1 else (above[-1] + 2 if above else 1)


def settle_summary(spd: list[float], moved: list[float], t_free: int, eps: float) -> dict[str, float]:
    """spd's floor is sqrt(eps); the state's is its rounding level, taken as the smallest change over the last
    quarter of the long window but at least 1e-6 (a float32 state stops moving near 1e-7)."""
    state_floor = max(min(moved[-max(1, len(moved) // 4) :]), 1e-6)
    return {
        "settle_spd": first_within(spd, eps**0.5),
        "settle_state": first_within(moved, state_floor),
        "spd_T": spd[t_free - 1] / eps**0.5,
        "moved_T": moved[t_free - 1],
    }


def grad_norms(trainer: Trainer, inputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    with torch.no_grad():
        est = trainer.gradients(trainer.relaxation, inputs.to(trainer.device), targets.to(trainer.device)).grads
    return {n: float(g.norm()) for n, g in est.items()}


def snapshot(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in zip(trainer.params.names, trainer.params.tensors)}


def rel_change(after: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> dict[str, float]:
    """|after - before| / max(|before|, |after|) per tensor: relative, and finite for tensors that start at zero
    (biases)."""
    return {
        n: float((after[n] - before[n]).norm() / torch.maximum(before[n].norm(), after[n].norm()).clamp_min(1e-12))
        for n in before
    }


def run_depth(
    args: argparse.Namespace, depth: int, ck_dir: str
) -> tuple[dict[str, float], list[tuple[str, list[float]]]]:
    """One depth: returns (summary row, per-parameter detail rows)."""
    flags = [
        "--preset",
        args.preset,
        "--device",
        "cpu",
        "--run_name",
        f"depth{depth}",
        "--checkpoint_dir",
        ck_dir,
        "--hidden_sizes",
        *[str(args.width)] * depth,
        "--max_windows",
        str(max(1, args.train_windows)),
        "--eval_batches",
        "none",
        *args.extra,
    ]
    cfg = trainer2.config(None, **flag_overrides(flags))
    trainer = Trainer(cfg, log=lambda *_: None)
    probe_in, probe_tg = trainer.next_batch()  # one fixed batch for the settling and gradient-norm probes
    row: dict[str, float] = {"depth": depth}
    detail: dict[str, list[float]] = {}

    def probes(tag: str) -> None:
        s = settle_summary(*settle_profile(trainer, probe_in, probe_tg, args.settle_steps), cfg.free_steps, cfg.eps)
        row.update({f"{k}_{tag}": v for k, v in s.items()})
        cos = measure(trainer, args.cosine_batches, args.true_steps, per_param=True)
        row[f"cos_{tag}"] = cos["all"]
        layers = {n: v for n, v in cos.items() if n[:2] in ("W_", "b_")}
        row[f"cos_min_{tag}"] = min(layers.values())
        for n, v in grad_norms(trainer, probe_in, probe_tg).items():
            detail.setdefault(n, []).extend([cos[n], v])

    probes("init")
    start = snapshot(trainer)
    steps: dict[str, float] = {n: 0.0 for n in start}
    lr, probed, run_s = trainer.updater.state.lr, 0, 0.0
    for w in range(args.train_windows):
        lr.fill_(lr_at(cfg, w, args.train_windows))
        inputs, targets = trainer.next_batch()
        probe = w % args.probe_every == 0
        before = snapshot(trainer) if probe else None
        t0 = time.perf_counter()
        trainer.runner.step(inputs, targets)
        run_s += time.perf_counter() - t0
        if before is not None:
            for n, v in rel_change(snapshot(trainer), before).items():
                steps[n] += v
            probed += 1
    row["win_s"] = args.train_windows / run_s if run_s else float("nan")
    total = rel_change(snapshot(trainer), start)
    for n in start:
        detail[n].extend([steps[n] / max(1, probed), total[n]])
    if args.train_windows:
        probes("trained")
    ev = trainer.evaluate()
    row["bpc"], row["acc"] = ev.get("heldout_bpc", float("nan")), ev.get("heldout_acc", float("nan"))
    return row, list(detail.items())


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="dev")
    p.add_argument("--depths", type=int, nargs="+", default=[1, 2, 3, 4], help="numbers of hidden layers")
    p.add_argument("--width", type=int, default=256, help="size of every hidden layer")
    p.add_argument("--train_windows", type=int, default=3000)
    p.add_argument(
        "--settle_steps", type=int, default=80, help="length of the long free phase the settling is read from"
    )
    p.add_argument("--cosine_batches", type=int, default=2)
    p.add_argument("--true_steps", type=int, default=400, help="relaxation steps of the converged autograd reference")
    p.add_argument("--probe_every", type=int, default=50, help="windows between update-norm probes")
    p.add_argument("extra", nargs="*", help="more trainer flags after --, e.g. -- --free_steps 24")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as ck_dir:
        for depth in args.depths:
            row, detail = run_depth(args, depth, ck_dir)
            rows.append(row)
            print(
                f"\nhidden {[args.width] * depth}: per parameter (cos = EP vs exact, |g| = EP gradient norm; "
                f"step = mean relative change per window, total = relative change from init to end: "
                f"|a - b| / max(|a|, |b|))"
            )
            print(f"{'':>7} {'cos init':>9} {'|g| init':>9} {'step':>9} {'total':>9} {'cos end':>9} {'|g| end':>9}")
            for n, v in detail:
                end = v[4:6] if len(v) >= 6 else [float("nan")] * 2
                print(f"{n:>7} {v[0]:9.5f} {v[1]:9.2e} {v[2]:9.2e} {v[3]:9.2e} {end[0]:9.5f} {end[1]:9.2e}", flush=True)
    cols = [
        ("depth", "{:>5.0f}"),
        ("settle_spd_init", "{:>15.0f}"),
        ("settle_spd_trained", "{:>18.0f}"),
        ("settle_state_init", "{:>17.0f}"),
        ("settle_state_trained", "{:>20.0f}"),
        ("spd_T_init", "{:>10.2f}"),
        ("spd_T_trained", "{:>13.2f}"),
        ("moved_T_init", "{:>12.1e}"),
        ("moved_T_trained", "{:>15.1e}"),
        ("cos_init", "{:>8.5f}"),
        ("cos_trained", "{:>11.5f}"),
        ("cos_min_init", "{:>12.5f}"),
        ("cos_min_trained", "{:>15.5f}"),
        ("bpc", "{:>6.3f}"),
        ("acc", "{:>6.3f}"),
        ("win_s", "{:>6.1f}"),
    ]
    print(
        f"\npreset {args.preset}, width {args.width}, {args.train_windows} training windows; "
        "settle_* = first step from which spd / the largest "
        f"state change stays within 2x of its floor (of {args.settle_steps} steps); "
        "spd_T = spd at the preset's T_free / floor; moved_T = max |s_T - s_(T-1)|; "
        "cos_min = lowest per-tensor energy cosine (W_i, b_i)"
    )
    print(" ".join(f"{name:>5}" for name, _ in cols))
    for r in rows:
        print(" ".join(fmt.format(r.get(name, float("nan"))) for name, fmt in cols))


if __name__ == "__main__":
    main()
