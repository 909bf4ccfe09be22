"""Command line: `trainer2 [train] [--preset NAME] [--config FILE] [--FIELD VALUE ...]`.

Every TrainConfig field is a flag of the same name (trainer2.flags); subcommands evaluate, sample, plot and bench.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable

from trainer2.checkpoint import CheckpointError, read_meta
from trainer2.config import ConfigError, annotated_yaml, build_config, config_origins
from trainer2.data import DataError
from trainer2.distributed import DistributedError, init_distributed, rank_label
from trainer2.flags import add_config_flags, config_layers, none_or, resolve_config
from trainer2.plot import cmd_plot
from trainer2.resume import fresh_run_guard, resume_config
from trainer2.tracking import check_tracking


def train_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="trainer2",
        allow_abbrev=False,  # --max_w 3 must not quietly mean --max_windows 3
        description="Train a physics-style learning machine with Equilibrium Propagation (no autograd).",
        epilog="Layers, lowest first: field defaults < --preset < --config < flags. "
        "Other commands: trainer2 evaluate|sample|bench|plot --help",
    )
    p.add_argument("--preset", help="Preset name (dev, production, profiling; shipped in the package) or a YAML path.")
    p.add_argument("--config", help="YAML file of config fields, applied over the preset.")
    p.add_argument("--resume", metavar="latest|PATH", help="Continue from the run's newest checkpoint ('latest') or a "
                   "step_<N>/ directory; its config is the lowest layer, and model/data fields must match it.")
    p.add_argument("--print_config", action="store_true", help="Print the resolved config as YAML, each non-default "
                   "value commented with the layer it came from, and exit without loading data or touching checkpoints.")
    add_config_flags(p)
    return p


def print_config(args: argparse.Namespace) -> int:
    """--print_config: the resolved YAML with the layer of each non-default value; reads no data, writes nothing."""
    layers = config_layers(args)
    if args.resume:  # what the resumed run would use: the checkpoint's config is the lowest layer
        cfg, path = resume_config(args.resume, layers)
        layers = [(f"checkpoint {path}", read_meta(path)["config"]), *layers]
    else:
        cfg = build_config(layers)
    print(annotated_yaml(cfg, config_origins(layers)), end="")
    return 0


def cmd_train(argv: list[str]) -> int:
    args = train_parser().parse_args(argv)
    if args.print_config:
        return print_config(args)
    from trainer2.trainer import Trainer

    path = None
    if args.resume:
        cfg, path = resume_config(args.resume, config_layers(args))
    else:
        cfg = resolve_config(args)
        fresh_run_guard(cfg)
    check_tracking(cfg)
    dist = init_distributed(cfg)  # under torchrun: this process's rank and its process group
    try:
        trainer = Trainer(cfg, log=print if dist.is_main else quiet, dist=dist)
        if path is not None:
            trainer.load_checkpoint(path)
        summary = trainer.train()
    finally:
        dist.close()
    if not dist.is_main:
        return 0
    score = f"bpc {summary['heldout_bpc']:.3f}" if "heldout_bpc" in summary else f"loss {summary['heldout_loss']:.3f} nats/example"
    print(
        f"done: {summary['windows']} windows, {summary['examples_seen']} examples in {summary['wall_seconds']:.1f}s "
        f"({summary['windows_per_second']:.2f} win/s); held-out {score}, acc {summary['heldout_acc']:.3f}"
    )
    return 0


def quiet(msg: str) -> None:
    """The log of ranks other than 0: they print nothing."""


def cmd_bench(argv: list[str]) -> int:
    from trainer2.bench import main as bench_main

    return bench_main(argv)


def cmd_sample(argv: list[str]) -> int:
    from trainer2.sampling import cmd_sample as run

    return run(argv)


def cmd_evaluate(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="trainer2 evaluate", allow_abbrev=False, description="Print the held-out metrics of a checkpoint as JSON.")
    p.add_argument("--checkpoint", required=True, metavar="PATH", help="A step_<N>/ checkpoint directory.")
    p.add_argument("--device", default=argparse.SUPPRESS, help="Device to evaluate on (default: the checkpoint's).")
    p.add_argument("--eval_batches", type=none_or(int), default=argparse.SUPPRESS, metavar="N",
                   help="Held-out batches of 512 to score; none = all (default: the checkpoint's).")
    args = vars(p.parse_args(argv))
    path = Path(args.pop("checkpoint"))
    from trainer2.evaluation import load_trained

    trained = load_trained(path, args)
    out = {"checkpoint": str(path), "window": trained.window, **trained.evaluate()}
    print(json.dumps(out, indent=2))
    return 0


COMMANDS: dict[str, Callable[[list[str]], int]] = {"train": cmd_train, "evaluate": cmd_evaluate, "plot": cmd_plot, "sample": cmd_sample, "bench": cmd_bench}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = COMMANDS.get(argv[0]) if argv else None
    run = command or cmd_train
    try:
        return run(argv[1:] if command else argv)
    except (ConfigError, DataError, CheckpointError) as e:
        print(f"trainer2: error{rank_label()}: {e}", file=sys.stderr)
        return 2
    except DistributedError as e:  # a failed or timed-out collective, or ranks that diverged; names the rank(s)
        print(f"trainer2: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # python -m trainer2.cli
    sys.exit(main())
