"""Learning quality: the EP trainer against exact gradients on the same machine, and feed-forward backprop.

    python -m benchmarks.quality [--preset production] [--examples 2000000] [--FIELD VALUE ...]

Trains, for the same number of examples and from the same initialisation and data order: the trainer
(EP estimate), the exact-gradient reference (`Trainer(cfg, gradients=exact_gradients)`: the same everything,
but autograd's gradient through the unrolled free window), and a feed-forward network of the same sizes with backprop
and Adam. Prints the held-out loss of each (bpc on text; nats per example on feature and image classes) and accuracy,
the EP / exact ratio of the losses, the cosine between the EP update and the exact gradient at the preset's window
lengths, dropped updates and the largest rise of the held-out loss above its best along each run. Any TrainConfig
flag after the options overrides the preset; a conv machine, for example:

    python -m benchmarks.quality --preset conv --data mnist5000.npz --heldout_fraction 0.2 --examples 64000

A graph machine (`couplings`: conv_res, hopfield_resnet13) runs EP against exact as a chain does; the feed-forward
baseline knows chains only, so it is refused there, before any run, unless left out:

    python -m benchmarks.quality --preset conv_res --data mnist5000.npz --heldout_fraction 0.2 --examples 640 --skip ff
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import time
from pathlib import Path

from benchmarks.ep_cosine import measure
from benchmarks.exact_gradient_reference import FF_CHAINS_ONLY, benchmark_config, exact_trainer, train_feedforward
from trainer2.data.dataset import DataError
from trainer2.running.signals import exit_code
from trainer2.running.trainer import Trainer
from trainer2.train_config import ConfigError, TrainConfig

TOLERANCE = 0.02  # |EP / exact - 1| the two runs must stay within, either way


def agrees(ratio: float, tolerance: float = TOLERANCE) -> bool:
    """Two-sided: EP much worse than the reference fails, and so does a reference much worse than EP."""
    return abs(ratio - 1.0) <= tolerance


def max_rise(history: list[dict[str, float]], metric: str = "heldout_bpc") -> float:
    """Largest rise of the held-out metric above its best so far along a run (0 when it never rises)."""
    best, rise = math.inf, 0.0
    for row in history:
        if metric in row:
            best = min(best, row[metric])
            rise = max(rise, row[metric] - best)
    return rise


class Stopped(Exception):
    """A run was stopped by a signal (Ctrl-C, SIGTERM): a part-trained run's figures compare nothing, so none print."""

    def __init__(self, summary: dict) -> None:
        self.signal = signal.Signals[summary["interrupted"]]
        super().__init__(f"stopped by {self.signal.name} after window {summary['windows']}; no figures")


def run(trainer: Trainer, metric: str) -> dict[str, float | list]:
    summary = trainer.train()
    if summary["interrupted"]:
        raise Stopped(summary)
    curve = [(int(r["examples"]), round(r[metric], 4)) for r in trainer.history if metric in r]
    return {**summary, "max_rise": max_rise(trainer.history, metric), "curve": curve}


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, TrainConfig]:
    """The benchmark's options and the config both runs train with (ConfigError names a bad flag, or the feed-forward
    baseline asked of a graph machine)."""
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__.split("\n")[0], epilog="Unknown arguments are TrainConfig flags."
    )
    p.add_argument("--preset", default="production", help="preset whose settings both machines use")
    p.add_argument(
        "--examples", type=int, default=2_000_000, help="training examples for each run (rounded up to whole batches)"
    )
    p.add_argument("--cosine_batches", type=int, default=4, help="training batches the EP cosine is averaged over")
    p.add_argument(
        "--ff_head", choices=["readout", "linear"], default="readout", help="head of the feed-forward baseline"
    )
    p.add_argument("--skip", nargs="*", default=[], choices=["exact", "ff"], help="runs to leave out")
    p.add_argument("--json", help="also write the figures to this JSON file")
    args, flags = p.parse_known_args(argv)
    cfg = benchmark_config(args.preset, args.examples, flags)
    if "ff" not in args.skip and not cfg.plan().graph.is_chain:  # before any run, not after EP and exact have trained
        raise ConfigError(f"{FF_CHAINS_ONLY}: pass --skip ff")
    return args, cfg


def main() -> None:
    args, cfg = parse()
    quiet = lambda *_: None  # noqa: E731
    print(
        f"preset {args.preset}: {cfg.max_windows} windows x {cfg.batch_size} = "
        f"{cfg.max_windows * cfg.batch_size} examples per run; "
        f"T_free={cfg.free_steps}, T_nudge={cfg.nudge_steps}, beta={cfg.beta_nudge}, rule={cfg.rule}",
        flush=True,
    )
    res: dict[str, dict] = {}
    ep = Trainer(cfg, log=quiet)
    # text is scored in bits per character; feature and image classes by the held-out loss in nats per example
    metric = "heldout_bpc" if ep.data.kind == "text" else "heldout_loss"
    res["ep"] = run(ep, metric)
    cos = measure(ep, args.cosine_batches, cfg.free_steps)
    if "exact" not in args.skip:
        res["exact"] = run(exact_trainer(cfg.model_copy(update={"run_name": "quality_exact"}), log=quiet), metric)
    if "ff" not in args.skip:
        start = time.perf_counter()
        res["ff"] = {
            **train_feedforward(cfg, cfg.max_windows * cfg.batch_size, head_kind=args.ff_head),
            "wall_seconds": time.perf_counter() - start,
        }

    label = "held-out bpc" if metric == "heldout_bpc" else "held-out nats"
    print(f"\n{'run':<32} {label:>13} {'acc':>6} {'max rise':>9} {'dropped':>8} {'wall s':>7}")
    names = {"ep": "EP trainer", "exact": "exact-gradient reference", "ff": f"feed-forward backprop ({args.ff_head})"}
    for k, r in res.items():
        rise = f"{r['max_rise']:9.3f}" if "max_rise" in r else f"{'-':>9}"
        dropped = f"{r['dropped_updates']:8.0f}" if "dropped_updates" in r else f"{'-':>8}"
        print(f"{names[k]:<32} {r[metric]:13.4f} {r['heldout_acc']:6.3f} {rise} {dropped} {r['wall_seconds']:7.0f}")
    if "exact" in res:
        ratio = res["ep"][metric] / res["exact"][metric]
        print(
            f"\nratio EP / exact: {ratio:.4f} ({'within' if agrees(ratio) else 'OUTSIDE'} {TOLERANCE:.0%} either way)"
        )
        res["ratio"], res["agrees"] = ratio, agrees(ratio)
    print(
        "EP cosine to the exact gradient (same window, end of training): "
        + ", ".join(f"{k} {v:.4f}" for k, v in cos.items())
    )
    print(
        f"{label} curve (examples, value): EP "
        + str(res["ep"]["curve"])
        + ("; exact " + str(res["exact"]["curve"]) if "exact" in res else "")
    )
    res["cosine"] = cos
    if args.json:
        Path(args.json).write_text(json.dumps({"config": cfg.model_dump(), **res}, indent=2) + "\n")


def cli() -> None:
    """main, with a user's mistake or a stop signal one line on stderr and the trainer's exit status."""
    try:
        main()
    except (ConfigError, DataError) as e:
        print(f"{Path(__file__).name}: error: {e}", file=sys.stderr)
        sys.exit(2)  # as the trainer's command line does
    except Stopped as e:
        print(f"{Path(__file__).name}: {e}", file=sys.stderr)
        sys.exit(exit_code(e.signal))  # 128 + the signal's number, as the trainer's command line exits


if __name__ == "__main__":
    cli()
