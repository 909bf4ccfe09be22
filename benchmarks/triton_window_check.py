"""The Triton window against the torch window on one device, at a preset's shapes (issue 24): the largest relative error
of each phase's states, q history and spd, of the EP statistic kernel against the couplings' own (kernels/
ep_statistic.py), of the observables and rotor angle kernels against their torch functions (kernels/window_stats.py,
kernels/rotor_angle_grad.py), and on CUDA a captured-and-replayed Triton window against its eager run.

    python -m benchmarks.triton_window_check [--preset dev] [--batch_sizes 8 64 512 4096] [--FIELD VALUE ...]

Exits 1 when an error exceeds the tolerance (1e-5 float32, 1e-10 float64). On the CPU it needs TRITON_INTERPRET=1
(Triton's interpreter: slow, use small shapes); tests/test_triton_window.py runs it both ways."""

from __future__ import annotations

import argparse
import sys

import torch

from trainer2.data.load import load_dataset
from trainer2.flags import add_config_flags, resolve_config
from trainer2.physics.machine import build_machine
from trainer2.physics.memory import MemoryBank
from trainer2.physics.readout import ReadoutResult
from trainer2.physics.relaxation import Relaxation
from trainer2.running.parts import resolve_device

TOL = {"float32": 1e-5, "float64": 1e-10}


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


@torch.no_grad()
def check(cfg, batch: int, device: torch.device) -> dict[str, float]:
    """Relative errors (name -> error) of the Triton window against the torch window for one batch of the config's data,
    the free phase then the stacked nudged phase; on CUDA also a graph replay of each Triton phase against eager."""
    data = load_dataset(cfg.data, cfg.context_len, cfg.heldout_fraction)
    inputs, targets = data.batch("train", torch.arange(batch) * 7 % data.num_examples("train"))
    relax = {}
    for backend in ("triton", "torch"):
        c = cfg.model_copy(update={"window_backend": backend, "readout_backend": backend})
        m = build_machine(c, data.num_classes, data.input_dim, data.tokens, device, seed=c.seed)
        bank = None
        if c.memory_capacity:  # filled with the first batch's coordinates, so the bank's candidates take part
            bank = MemoryBank.allocate(c.memory_capacity, c.coord_dim_n, batch, m.readout.protos)
            gen = torch.Generator().manual_seed(4)
            coords = torch.randn(batch, c.coord_dim_n, generator=gen, dtype=m.readout.protos.dtype)
            bank.write(coords.to(device), targets.to(device))
        relax[backend] = Relaxation(m, c, batch, bank)
    tri, ref = relax["triton"], relax["torch"]
    x, y = inputs.to(device), targets.to(device)
    errors = {}
    # Stale values where the Triton kernels now do the set-up themselves (a start from rest, the copy into s0, the
    # nudged rows' start, drive, target mask and factors): a kernel that read them would part from the torch window
    nudged = tri.ws_nudged
    stale = [*tri.ws.state.s, *tri.s0.s, *nudged.state.s, nudged.drive, nudged.target_mask]
    for t in [*stale, nudged.beta_col, nudged.mask_beta, nudged.neg_beta]:
        t.fill_(1.0)
    frees = {k: r.free_phase(x, y) for k, r in relax.items()}
    if tri.readout_kernel is not None:  # the readout's loss and gradients at the free equilibrium, in one launch
        errors.update(readout_errors(tri.readout_grads(frees["triton"]), ref.readout_grads(frees["torch"])))
    for phase in ("free", "nudged"):
        if phase == "nudged":
            for k, r in relax.items():
                r.nudged_phases(frees[k])
        a, b = (r.ws_nudged if phase == "nudged" else r.ws for r in (tri, ref))
        for i, (s, t) in enumerate(zip(a.state.s, b.state.s, strict=True)):
            errors[f"{phase} layer {i}"] = relative(s, t)
        errors[f"{phase} q history"] = relative(a.q_hist, b.q_hist)
        errors[f"{phase} spd"] = relative(a.spd_hist, b.spd_hist)
    errors.update(ep_errors(tri, frees["triton"].x))
    errors.update(stats_errors(tri))
    errors.update(rotor_errors(tri))
    if device.type == "cuda":
        errors.update(graph_replay(tri, frees["triton"]))
    return errors


def ep_errors(relax: Relaxation, x: torch.Tensor) -> dict[str, float]:
    """The EP statistic kernel (kernels/ep_statistic.py, built here whatever AUTO_TAKES_TRITON_EP says) against
    energy.ep_grads on the same nudged states. The statistic is a difference of two nearly equal products, so each error
    is relative to the size of those products (the statistic of |s+| against zero), at which both sides round."""
    from trainer2.physics.energy import ep_grads
    from trainer2.physics.kernels.ep_statistic import EPStatistic, serves

    e = relax.m.energy
    if not serves(e) or not relax.s_plus:
        return {}
    scale = 1.0 / (relax.nudge.divisor * relax.batch)
    got, got_gx = EPStatistic(scale, x)(relax.s_plus, relax.s_minus, x, e, scale, None)
    want, want_gx = ep_grads(relax.s_plus, relax.s_minus, x, e, scale, None)
    sizes, _ = ep_grads([s.abs() for s in relax.s_plus], [0 * s for s in relax.s_plus], x.abs(), e, scale, None)
    out = {
        f"ep {k}": float((got[k] - w).abs().max()) / max(float(sizes[k].abs().max()), 1e-30) for k, w in want.items()
    }
    out["ep input grad"] = relative(got_gx, want_gx)
    return out


def stats_errors(relax: Relaxation) -> dict[str, float]:
    """The window observables kernel (kernels/window_stats.py, built here whatever AUTO_TAKES_TRITON_STATS says)
    against Relaxation.free_stats and nudged_stats on the same workspaces, after both phases."""
    from trainer2.physics.kernels.window_stats import WindowStatsKernel

    nudged = relax.ws_nudged.spd_hist if relax.ws_nudged is not None else None
    shape = None if nudged is None else tuple(nudged.shape)
    kernel = WindowStatsKernel(tuple(relax.ws.spd_hist.shape), shape, relax.cfg.dt, relax.ws.spd_hist)
    got = kernel(relax.m.readout.r_sc, relax.ws.spd_hist, nudged)
    want = {**relax.free_stats(), **relax.nudged_stats()}
    return {f"stats {k}": relative(got[k], w) for k, w in want.items()}


def rotor_errors(relax: Relaxation) -> dict[str, float]:
    """The rotor's angle gradient kernel (kernels/rotor_angle_grad.py, built here whatever AUTO_TAKES_TRITON_ROTOR
    says) against rotor_angle_grad at the machine's rotor layout, on random angles and a random C: a fresh machine's
    angles are 0 (every suffix the identity), which would hide a wrong layer or plane."""
    from trainer2.physics.kernels.rotor_angle_grad import RotorAngleGrad
    from trainer2.physics.readout import rotor_angle_grad, rotor_layers, rotor_suffixes

    layout, like = relax.m.layout, relax.m.readout.theta
    gen = torch.Generator().manual_seed(5)
    theta = torch.randn(like.shape, generator=gen, dtype=torch.float64).to(like)
    c = torch.randn(layout.n, layout.n, generator=gen, dtype=torch.float64).to(like)
    suffix = rotor_suffixes(rotor_layers(theta, layout)).contiguous()
    got = RotorAngleGrad(layout, c)(c, suffix, layout)
    return {"rotor angle grad": relative(got, rotor_angle_grad(c, suffix, layout))}


def readout_errors(got: ReadoutResult, want: ReadoutResult) -> dict[str, float]:
    """The readout kernel's loss, probabilities and gradients against the torch operators'. Each gradient's error is
    relative to the largest readout gradient: at theta = 0 the angles' gradient is rounding noise (about 1e-16)."""
    out = {"readout loss": relative(got.loss, want.loss), "readout probs": relative(got.probs, want.probs)}
    names = ("g_diag", "theta", "protos", "r_sc")
    scale = max(float(getattr(want.grads, k).abs().max()) for k in names)
    for k in names:
        a, b = getattr(got.grads, k), getattr(want.grads, k)
        out[f"readout grad {k}"] = float((a - b).abs().max()) / max(scale, 1e-30)
    return out


def graph_replay(relax: Relaxation, free) -> dict[str, float]:
    """Each Triton phase captured in a CUDA graph and replayed from the same start: its error against the eager run."""
    out = {}
    for name, ws, steps, nudged in (
        ("free", relax.ws, relax.cfg.free_steps, False),
        ("nudged", relax.ws_nudged, relax.cfg.nudge_steps, True),
    ):
        start = [s.clone() for s in ws.state.s]

        def window() -> None:
            relax.run(ws, free, 0, steps, nudged)

        for s, s0 in zip(ws.state.s, start):
            s.copy_(s0)
        window()
        eager = [s.clone() for s in ws.state.s] + [ws.spd_hist.clone()]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            window()
        for s, s0 in zip(ws.state.s, start):
            s.copy_(s0)
        graph.replay()
        torch.cuda.synchronize()
        out[f"{name} graph replay"] = max(relative(a, b) for a, b in zip([*ws.state.s, ws.spd_hist], eager))
    if relax.readout_kernel is not None:  # the readout kernel captured and replayed at the free equilibrium
        eager = [t.clone() for t in readout_tensors(relax.readout_grads(free))]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            res = relax.readout_grads(free)
        for t in readout_tensors(res):
            t.zero_()
        graph.replay()
        torch.cuda.synchronize()
        out["readout graph replay"] = max(relative(a, b) for a, b in zip(readout_tensors(res), eager))
    return out


def readout_tensors(res: ReadoutResult) -> list[torch.Tensor]:
    g = res.grads
    return [res.loss, res.probs, g.g_diag, g.theta, g.protos, g.r_sc]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.triton_window_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", help="Preset name in configs/ or a YAML path.")
    p.add_argument("--config", help="YAML file of config fields, applied over the preset.")
    p.add_argument("--batch_sizes", type=int, nargs="+", default=[8, 64])
    add_config_flags(p)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    cfg = resolve_config(args)
    device = resolve_device(cfg)
    tol, worst = TOL[cfg.dtype], 0.0
    print(
        f"Triton window vs torch window: {device}, {cfg.dtype}, layers {cfg.layers}, n {cfg.coord_dim_n}, "
        f"memory {cfg.memory_capacity}, {cfg.free_steps} free + {cfg.nudge_steps} nudged steps; "
        f"tolerance {tol:g}"
    )
    for batch in args.batch_sizes:
        errors = check(cfg, batch, device)
        worst = max(worst, *errors.values())
        print(f"batch {batch:>5}: " + ", ".join(f"{k} {v:.2g}" for k, v in errors.items()))
    print(f"largest relative error {worst:.3g}: {'PASS' if worst <= tol else 'FAIL'}")
    return 0 if worst <= tol else 1


if __name__ == "__main__":
    sys.exit(main())
