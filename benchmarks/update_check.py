"""The fused Triton update against the torch update on one device (issue 38): the largest difference of the parameters,
moments, applied step, count and dropped count after several updates, for Adam and heavy-ball momentum, each with and
without weight decay and per-group learning rates, one gradient non-finite (the update dropped); on CUDA also one
update captured in a CUDA graph and replayed against its eager call (bitwise, no host sync). Then the weight average's
kernel (kernels/weight_average.py, beside the fused update) against the torch operators it replaces, the rotor's
angles winding past +-pi, and on CUDA its graph replay; and the window metrics' kernel (kernels/window_metrics.py)
against the Updater's torch metrics (counts and flags equal, sums within METRIC_ULPS ulps), on CUDA its graph replay.

    python -m benchmarks.update_check [--preset dev] [--steps 6] [--FIELD VALUE ...]

The torch update is flat_update then clamp_readout (what the Updater runs with update_backend torch). Exits 1 when a
difference exceeds the tolerance: steps x the dtype's machine epsilon, relative to the tensor's largest entry (Adam's
bias corrections are exp2(t log2 b) in the kernel and pow in torch, the CPU's vectorised sqrt is not correctly rounded,
and on the GPU Triton fuses multiply-adds that torch rounds twice: a few ulps a step). On the CPU it needs
TRITON_INTERPRET=1 (Triton's interpreter); tests/test_fused_update.py runs it there and asserts more."""

from __future__ import annotations

import argparse
import math
import sys

import torch
from torch import Tensor

from trainer2.flags import add_config_flags, resolve_config
from trainer2.learning.params import GROUPS, ParamTable
from trainer2.learning.update import UpdateState, flat_update, fused_update
from trainer2.physics.machine import build_machine, clamp_readout
from trainer2.running.parts import resolve_device
from trainer2.train_config import TrainConfig

VARIANTS = {  # name -> the fields that make it
    "plain": {"weight_decay": 0.0, "eta_readout_scale": 1.0, "eta_embed_scale": 1.0},
    "decay+mult": {"weight_decay": 0.01, "eta_readout_scale": 3.0, "eta_embed_scale": 0.5},
}
CLASSES = 7
METRIC_ULPS = 64  # the window metrics' sums against torch's, relative to each sum (tolerance(cfg, 1) each)


def relative(got: Tensor, want: Tensor) -> float:
    """max |got - want| / max |want|: 0.0 when bitwise equal, inf when either holds a NaN the other does not."""
    if torch.equal(got, want):
        return 0.0
    return float(((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).nan_to_num(nan=math.inf))


def exercised(cfg: TrainConfig, device: torch.device) -> tuple:
    """A machine whose readout sits outside its bounds (so the clamps act) and its table."""
    m = build_machine(cfg, CLASSES, cfg.context_len, True, device, seed=cfg.seed)
    with torch.no_grad():
        r = m.readout
        r.g_diag.copy_(torch.linspace(0.0, 2 * cfg.g_max, r.g_diag.numel(), dtype=r.g_diag.dtype))
        r.theta.copy_(torch.linspace(-7.0, 7.0, r.theta.numel(), dtype=r.theta.dtype))
        r.r_sc.fill_(0.0)
    return m, ParamTable.build(m, cfg.eta_scales, cfg.weight_decay)


def compare(cfg: TrainConfig, device: torch.device, steps: int = 6, drop_at: int = 3) -> tuple[dict[str, float], dict]:
    """Run `steps` updates of identical machines through the torch update and the fused one, gradient `drop_at`
    non-finite; returns (relative difference by tensor, facts about what the run exercised)."""
    gen = torch.Generator().manual_seed(0)
    (m_ref, t_ref), (m_tri, t_tri) = exercised(cfg, device), exercised(cfg, device)
    n = t_ref.flat.numel()
    states = [UpdateState.allocate(t.flat, [], cfg) for t in (t_ref, t_tri)]
    quiet = torch.arange(n, device=device) % 5 == 0  # zero gradient there: the moments decay towards subnormals
    tiny = torch.finfo(t_ref.flat.dtype).tiny
    for st in states:  # moments already subnormal where the gradient is zero: the flush must zero them
        st.bufs[quiet] = tiny / 4
        if st.sq.numel():
            st.sq[quiet] = tiny / 8
    fused = fused_update(t_tri, cfg, cfg)
    steps_out = [torch.zeros_like(t_ref.flat), torch.zeros_like(t_tri.flat)]
    oks, facts = [], {}
    for k in range(steps):
        g = torch.randn(n, generator=gen, dtype=torch.float64) * (1e-3 if k % 2 else 1.0)
        g = g.to(device=device, dtype=t_ref.flat.dtype).masked_fill(quiet, 0.0)
        if k == drop_at:
            g[n - 1 - k] = math.nan if k % 2 else math.inf  # in the last block: every partial sum must be read
        ok_ref = flat_update(t_ref.flat, g.clone(), states[0], t_ref.mult, t_ref.decay_flat, cfg, steps_out[0])
        clamp_readout(m_ref)
        s = states[1]
        mult, decay = t_tri.mult, t_tri.decay_flat
        ok_tri = fused(t_tri.flat, g.clone(), s.bufs, s.sq, s.count, s.lr, s.dropped, mult, decay, steps_out[1])
        oks.append((float(ok_ref), float(ok_tri)))
        if k == 0:  # the kernel's own first result: the flush and every clamp acted
            facts.update(first_step_facts(m_tri, t_tri, states[1], quiet, cfg))
    ref, tri = states
    errors = {
        "param": relative(t_tri.flat, t_ref.flat),
        "momentum": relative(tri.bufs, ref.bufs),
        "second moment": relative(tri.sq, ref.sq) if ref.sq.numel() else 0.0,
        "step": relative(steps_out[1], steps_out[0]),
        "count": relative(tri.count, ref.count),
        "dropped": relative(tri.dropped, ref.dropped),
        "ok": float(any(a != b for a, b in oks)),
    }
    facts.update(oks=[a for a, _ in oks], launches=fused.launches, programs=fused.programs, sums=fused.n_sums)
    if device.type == "cuda":
        errors["graph replay"] = graph_replay(fused, t_tri, tri, g.nan_to_num(0.0))
    return errors, facts


def graph_replay(fused, table: ParamTable, st: UpdateState, grad: Tensor) -> float:
    """One fused update captured in a CUDA graph and replayed from the same start, against the eager call; a host sync
    in either is an error (torch.cuda.set_sync_debug_mode)."""
    step = torch.zeros_like(table.flat)

    def update() -> None:
        fused(table.flat, grad, st.bufs, st.sq, st.count, st.lr, st.dropped, table.mult, table.decay_flat, step)

    return replayed(update, [table.flat, st.bufs, st.sq, st.count, st.dropped, step])


def compare_average(cfg: TrainConfig, device: torch.device, steps: int = 6) -> tuple[dict[str, float], dict]:
    """`steps` moves of a weight average by its Triton kernel and by the torch operators, after random parameter
    steps with every angle winding by 1.5 a step (so the short way round crosses the wrap); from t = 6 with decay 0.55
    the weight 1 - d runs 9 / 16, 9 / 17, 0.5 (lerp's other branch), 9 / 19, then the clamp's 0.45. Returns (relative
    difference by tensor, facts)."""
    from trainer2.learning.averaging import WeightAverage

    m, table = exercised(cfg, device)
    ref, tri = WeightAverage.of(m, 0.55), WeightAverage.of(m, 0.55, table.span_of("theta"))
    for average in (ref, tri):
        average.count.fill_(6.0)
    gen, theta, turned = torch.Generator().manual_seed(1), m.readout.theta, 0
    for _ in range(steps):
        with torch.no_grad():
            move = torch.randn(m.flat.numel(), generator=gen, dtype=torch.float64) * 0.3
            m.flat.add_(move.to(device=device, dtype=m.flat.dtype))
            theta.add_(1.5 + math.pi).remainder_(2 * math.pi).sub_(math.pi)  # as the update wraps them
        turned += int(torch.round((theta - ref.machine.readout.theta) / (2 * math.pi)).ne(0).sum())
        ref.update()
        tri.update()
    errors = {"average": relative(tri.machine.flat, ref.machine.flat), "average count": relative(tri.count, ref.count)}
    facts = {"average launches": tri.kernel.launches, "turns": turned}  # before the replay's eager call and capture
    if device.type == "cuda":
        errors["average graph replay"] = replayed(tri.update, [tri.machine.flat, tri.count])
    return errors, facts


def compare_metrics(cfg: TrainConfig, device: torch.device, steps: int = 6) -> tuple[dict[str, float], dict]:
    """`steps` windows' metric sums by the metrics kernel (kernels/window_metrics.py, built here whatever
    AUTO_TAKES_TRITON_METRICS says) and by the Updater's torch operators, on random losses, probabilities (a row with
    tied maxima, and one with a NaN in the middle step), targets, update steps and an ok that drops every third update.
    Returns (difference by kind: counts and flags exact, sums relative to each slot, the largest; facts)."""
    from trainer2.learning.gradients import StepResult
    from trainer2.learning.update import METRICS, MetricSums, UpdateConfig, Updater
    from trainer2.physics.kernels.window_metrics import WindowMetrics
    from trainer2.physics.relaxation import WindowStats

    m, table = exercised(cfg, device)
    updater = Updater(m, cfg.section(UpdateConfig).model_copy(update={"update_backend": "torch"}), table)
    spans = {g: table.spans[g] for g in GROUPS if g in table.spans}
    kernel = WindowMetrics(table.flat, spans, MetricSums.slots(), CLASSES)
    ref, tri = MetricSums(table.flat), MetricSums(table.flat)
    gen, like = torch.Generator().manual_seed(2), table.flat

    def rand(*shape: int) -> Tensor:
        return torch.rand(*shape, generator=gen, dtype=torch.float64).to(device=device, dtype=like.dtype)

    batch = 37
    for k in range(steps):
        probs = rand(batch, CLASSES).softmax(1)
        probs[0, 1:3] = probs[0].max() + 0.5  # tied maxima: the first one counts
        if k == steps // 2:
            probs[1, 3] = math.nan  # torch's argmax takes the NaN
        targets = torch.randint(0, CLASSES, (batch,), generator=gen).to(device)
        targets[0] = 1
        updater.step.copy_(rand(like.numel()) - 0.5)
        ok = torch.tensor(float(k % 3 != 1), dtype=like.dtype, device=device)
        stats = WindowStats(*(rand(()) for _ in range(6)))
        out = StepResult({}, rand(batch), probs, stats)
        ref.add(updater.window_metrics(out, targets, ok))
        order = (stats.lior_mean, stats.spd_mean, stats.spd_last, stats.R_mean, stats.lior_nudge, stats.spd_last_nudge)
        kernel(tri.values, out.loss, probs, targets, ok, order, updater.step, like)
    want, got = ref.values.double(), tri.values.double()
    exact = [METRICS.index(k) for k in ("windows", "examples", "correct_sum", "dropped", "nonfinite_params")]
    near = [i for i in range(len(METRICS)) if i not in exact]
    errors = {  # a count or flag off by any amount fails
        "metrics counts": 0.0 if torch.equal(got[exact], want[exact]) else math.inf,
        "metrics sums": float(((got[near] - want[near]).abs() / want[near].abs().clamp_min(1e-30)).max()),
    }
    facts = {"metrics launches": kernel.launches, "metrics programs": kernel.programs, "correct": float(want[exact[2]])}
    if device.type == "cuda":
        kernel_call = lambda: kernel(tri.values, out.loss, probs, targets, ok, order, updater.step, like)  # noqa: E731
        errors["metrics graph replay"] = replayed(kernel_call, [tri.values])
    return errors, facts


def replayed(fn, live: list[Tensor]) -> float:
    """`fn` captured in a CUDA graph and replayed from the same start as its eager call: the largest difference of
    the tensors `live` it changes; a host sync is an error."""
    start = [t.clone() for t in live]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        eager = [t.clone() for t in live]
        for t, t0 in zip(live, start):
            t.copy_(t0)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        for t, t0 in zip(live, start):
            t.copy_(t0)
        graph.replay()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return max(relative(t, e) for t, e in zip(live, eager))


def first_step_facts(m, table: ParamTable, st: UpdateState, quiet: Tensor, cfg: TrainConfig) -> dict[str, bool]:
    """Whether the subnormal moments were flushed (where nothing decays) and the readout clamped to each bound."""
    still = quiet if table.decay_flat is None else quiet & (table.decay_flat == 0)
    r, like = m.readout, table.flat
    bound = lambda v: torch.tensor(v, dtype=like.dtype, device=like.device)  # noqa: E731
    return {
        "flushed": bool((st.bufs[still] == 0).all()) and bool(still.any()),
        "clamped": bool(r.g_diag.min() == bound(cfg.g_min))
        and bool(r.g_diag.max() == bound(cfg.g_max))
        and bool(r.theta.min() >= -bound(math.pi))
        and bool(r.theta.max() <= bound(math.pi))
        and bool(r.r_sc == bound(cfg.r_min)),
    }


def tolerance(cfg: TrainConfig, steps: int) -> float:
    return steps * torch.finfo(getattr(torch, cfg.dtype)).eps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.update_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", help="Preset name in configs/ or a YAML path (the machine's shapes).")
    p.add_argument("--config", help="YAML file of config fields, applied over the preset.")
    p.add_argument("--steps", type=int, default=6, help="Updates per comparison (one of them dropped).")
    add_config_flags(p)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    base = resolve_config(args)
    device = resolve_device(base)
    tol, worst = tolerance(base, args.steps), 0.0
    print(f"fused update vs torch update: {device}, {base.dtype}, {args.steps} steps, tolerance {tol:.3g}")
    for rule in ("adam", "momentum", "nesterov"):
        for name, fields in VARIANTS.items():
            cfg = base.model_copy(update={"update_rule": rule, "update_backend": "triton", **fields})
            errors, facts = compare(cfg, device, args.steps, drop_at=args.steps // 2)
            # a replayed graph runs the very kernels of its eager call: any difference fails
            worst = max(worst, *errors.values(), math.inf if errors.get("graph replay") else 0.0)
            print(f"{rule:>8} {name:<10}: " + ", ".join(f"{k} {v:.2g}" for k, v in errors.items()) + f"; {facts}")
    errors, facts = compare_average(base, device, args.steps)
    worst = max(worst, *errors.values(), math.inf if errors.get("average graph replay") else 0.0)
    print(" weight average: " + ", ".join(f"{k} {v:.2g}" for k, v in errors.items()) + f"; {facts}")
    errors, facts = compare_metrics(base, device, args.steps)
    # the sums add in another order (and over up to a million elements): METRIC_ULPS ulps, not a few a step
    metrics_ok = errors["metrics sums"] <= METRIC_ULPS * tolerance(base, 1) and errors["metrics counts"] == 0.0
    metrics_ok = metrics_ok and not errors.get("metrics graph replay")
    print(" window metrics: " + ", ".join(f"{k} {v:.2g}" for k, v in errors.items()) + f"; {facts}")
    passed = worst <= tol and metrics_ok
    print(
        f"largest relative difference {worst:.3g}, window metrics {'equal' if metrics_ok else 'NOT equal'}: "
        f"{'PASS' if passed else 'FAIL'}"
    )
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
