"""Command line: `trainer2 [train] [--preset NAME] [--config FILE] [--FIELD VALUE ...]`.

Every TrainConfig field is a flag of the same name, generated from the model so flags never drift.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any, Callable, Literal

from trainer2.checkpoint import CheckpointError, fresh_run_guard, load_for_inference, read_meta, resume_config
from trainer2.config import ConfigError, TrainConfig, annotated_yaml, build_config, config_origins, preset_path, read_yaml
from trainer2.data import DataError
from trainer2.plot import cmd_plot
from trainer2.tracking import check_tracking


def _none_or(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse_optional(text: str) -> Any:
        return None if text.lower() in ("none", "null") else parse(text)

    parse_optional.__name__ = getattr(parse, "__name__", "value")
    return parse_optional


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per TrainConfig field; absent flags stay out of the namespace so lower layers show through."""
    group = parser.add_argument_group("config fields (each overrides presets and --config)")
    for name, field in TrainConfig.model_fields.items():
        ann = field.annotation
        args = typing.get_args(ann)
        optional = typing.get_origin(ann) in (typing.Union, types.UnionType) and type(None) in args
        base = next(a for a in args if a is not type(None)) if optional else ann
        kw: dict[str, Any] = {"default": argparse.SUPPRESS, "help": f"{field.description} (default: {field.default})"}
        if base is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(base) is Literal:
            kw["choices"] = list(typing.get_args(base))
        elif typing.get_origin(base) is list:
            kw.update(nargs="+", type=typing.get_args(base)[0], metavar="N")
        else:
            kw.update(type=_none_or(base) if optional else base, metavar=base.__name__.upper())
        group.add_argument(f"--{name}", **kw)


def train_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="trainer2",
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


def resolve_config(args: argparse.Namespace) -> TrainConfig:
    """Build the layered config from parsed arguments."""
    return build_config(config_layers(args))


def config_layers(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    """(source, values) layers from --preset, --config and flags, lowest first."""
    layers: list[tuple[str, dict[str, Any]]] = []
    if args.preset:
        path = preset_path(args.preset)
        layers.append((f"preset {path}", read_yaml(path)))
    if args.config:
        layers.append((f"config {args.config}", read_yaml(Path(args.config))))
    flags = {k: v for k, v in vars(args).items() if k in TrainConfig.model_fields}
    layers.append(("command line", flags))
    return layers


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

    if args.resume:
        cfg, path = resume_config(args.resume, config_layers(args))
        check_tracking(cfg)
        trainer = Trainer(cfg)
        trainer.load_checkpoint(path)
    else:
        cfg = resolve_config(args)
        fresh_run_guard(cfg)
        check_tracking(cfg)
        trainer = Trainer(cfg)
    summary = trainer.train()
    score = f"bpc {summary['heldout_bpc']:.3f}" if "heldout_bpc" in summary else f"loss {summary['heldout_loss']:.3f} nats/example"
    print(
        f"done: {summary['windows']} windows, {summary['examples_seen']} examples in {summary['wall_seconds']:.1f}s "
        f"({summary['windows_per_second']:.2f} win/s); held-out {score}, acc {summary['heldout_acc']:.3f}"
    )
    return 0


def cmd_bench(argv: list[str]) -> int:
    try:
        from benchmarks.bench import main as bench_main
    except ImportError as e:
        raise ConfigError(f"bench needs the source checkout's benchmarks/ package on the path ({e})") from None
    return bench_main(argv)


def cmd_sample(argv: list[str]) -> int:
    from trainer2.sampling import cmd_sample as run

    return run(argv)


def cmd_evaluate(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="trainer2 evaluate", description="Print the held-out metrics of a checkpoint as JSON.")
    p.add_argument("--checkpoint", required=True, metavar="PATH", help="A step_<N>/ checkpoint directory.")
    p.add_argument("--device", default=argparse.SUPPRESS, help="Device to evaluate on (default: the checkpoint's).")
    p.add_argument("--eval_batches", type=_none_or(int), default=argparse.SUPPRESS, metavar="N",
                   help="Held-out batches of 512 to score; none = all (default: the checkpoint's).")
    args = vars(p.parse_args(argv))
    path = Path(args.pop("checkpoint"))
    trainer = load_for_inference(path, args)
    out = {"checkpoint": str(path), "window": trainer.progress.window, **trainer.evaluate()}
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
        print(f"trainer2: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # python -m trainer2.cli
    sys.exit(main())
