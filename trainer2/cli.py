"""Command line: `trainer2 [train] [--preset NAME] [--config FILE] [--FIELD VALUE ...]`.

Every TrainConfig field is a flag of the same name, generated from the model so flags never drift.
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from pathlib import Path
from typing import Any, Callable, Literal

from trainer2.config import ConfigError, TrainConfig, build_config, preset_path, read_yaml
from trainer2.data import DataError


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
    p.add_argument("--preset", help="Preset name in configs/ (dev, production, profiling) or a YAML path.")
    p.add_argument("--config", help="YAML file of config fields, applied over the preset.")
    add_config_flags(p)
    return p


def resolve_config(args: argparse.Namespace) -> TrainConfig:
    """Build the layered config from parsed arguments."""
    layers: list[tuple[str, dict[str, Any]]] = []
    if args.preset:
        path = preset_path(args.preset)
        layers.append((f"preset {path}", read_yaml(path)))
    if args.config:
        layers.append((f"config {args.config}", read_yaml(Path(args.config))))
    flags = {k: v for k, v in vars(args).items() if k in TrainConfig.model_fields}
    layers.append(("command line", flags))
    return build_config(layers)


def cmd_train(argv: list[str]) -> int:
    args = train_parser().parse_args(argv)
    cfg = resolve_config(args)
    from trainer2.trainer import Trainer

    summary = Trainer(cfg).train()
    print(
        f"done: {summary['windows']} windows, {summary['examples_seen']} examples in {summary['wall_seconds']:.1f}s "
        f"({summary['windows_per_second']:.2f} win/s); held-out bpc {summary['heldout_bpc']:.3f}, "
        f"acc {summary['heldout_acc']:.3f}"
    )
    return 0


def cmd_bench(argv: list[str]) -> int:
    try:
        from benchmarks.bench import main as bench_main
    except ImportError as e:
        raise ConfigError(f"bench needs the source checkout's benchmarks/ package on the path ({e})") from None
    return bench_main(argv)


COMMANDS: dict[str, Callable[[list[str]], int]] = {"train": cmd_train, "bench": cmd_bench}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = COMMANDS.get(argv[0]) if argv else None
    run = command or cmd_train
    try:
        return run(argv[1:] if command else argv)
    except (ConfigError, DataError) as e:
        print(f"trainer2: error: {e}", file=sys.stderr)
        return 2
