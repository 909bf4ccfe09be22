"""Config flags: one command-line flag per TrainConfig field, generated from the model so flags never drift,
and the layering of --preset, --config and flags into a TrainConfig."""

from __future__ import annotations

import argparse
import os
import sys
import types
import typing
from typing import Any, Callable, Literal

from trainer2.components import BUILTIN, named_components, resolve
from trainer2.io.parser import Parser
from trainer2.presets import yaml_layers
from trainer2.section import ConfigError
from trainer2.train_config import TrainConfig, accepted_keys, build_config


def none_or(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse_optional(text: str) -> Any:
        return None if text.lower() in ("none", "null") else parse(text)

    parse_optional.__name__ = getattr(parse, "__name__", "value")
    return parse_optional


LAYERS_HELP = (
    "KIND:SIZE is a layer of SIZE units, such as dense:256 (or module.Class:SIZE of your own coupling); a layer whose "
    "spec is a mapping, such as conv's {channels, kernel, pool, pooling}, is written in a YAML file passed with "
    "--config FILE: layers: [{conv: {channels: 16, kernel: 5, pool: 2}}]"
)


YAML_ONLY = ("couplings",)  # a graph's couplings are mappings, written in a YAML file (--config FILE), not flags


def yaml_only(name: str) -> Callable[[str], Any]:
    """The type of a flag whose values are mappings: any value is refused, saying to write it in YAML."""

    def refuse(text: str) -> Any:
        raise argparse.ArgumentTypeError(
            f"{name} are mappings ({{conv: {{...}}, from: LAYER, to: LAYER}}), written in a YAML file passed with "
            f"--config FILE (docs/design.md#the-energy-as-a-graph), not on the command line"
        )

    refuse.__name__ = name
    return refuse


def layer_flag(text: str) -> dict[str, Any]:
    """--layers entries: KIND:SIZE (dense:256, my_couplings.WideDense:64) -> {KIND: SIZE}; the config validates kind
    and size, but a built-in kind whose spec is not a size (conv) is refused here, saying how to write it."""
    kind, sep, size = (part.strip() for part in text.partition(":"))
    if not sep or not size.lstrip("-").isdigit():
        raise argparse.ArgumentTypeError(f"expected KIND:SIZE, got {text!r}: {LAYERS_HELP}")
    if kind in BUILTIN["coupling"] and int(size) >= 1:  # dense:0 is left to the config, which names the bound
        try:
            resolve("coupling", kind).spec_size(int(size))
        except ValueError:  # the kind's spec is a mapping, which KIND:SIZE cannot write
            raise argparse.ArgumentTypeError(
                f"{text!r}: a {kind} layer takes a spec, not a size; {LAYERS_HELP}"
            ) from None
    return {kind: int(size)}


def add_trust_flag(parser: argparse.ArgumentParser) -> None:
    """--trust_code: consent to import the code a checkpoint or YAML file names (its own coupling, rule, cost or data
    format); without it such a name is refused, since a file may have been handed over."""
    parser.add_argument(
        "--trust_code",
        action="store_true",
        help="Import the code that a checkpoint or YAML file names by a dotted path (module.Class of someone's own "
        "coupling, rule, cost or data format); without it such a file is refused, since a file may have been handed "
        "over. Built-in components and names you give on this command line need no consent.",
    )


def user_modules_from_cwd(args: argparse.Namespace) -> None:
    """Let the working directory's modules be imported, as `python -m` would, only where the user asked for code of
    their own: a dotted component name on this command line, or --trust_code. A checkpoint never brings it in."""
    flags = {k: v for k, v in vars(args).items() if k in accepted_keys()}
    if (getattr(args, "trust_code", False) or named_components(flags)) and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())


def section_of(name: str) -> type:
    """The config section (RunConfig, MachineConfig, ...) that declares a TrainConfig field: the first class of
    TrainConfig's MRO whose own annotations name it."""
    return next(c for c in TrainConfig.__mro__ if name in vars(c).get("__annotations__", {}))


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per TrainConfig field, grouped by the section that declares it (--help lists them so); absent flags
    stay out of the namespace so lower layers show through."""
    groups: dict[type, argparse._ArgumentGroup] = {}
    for name, field in TrainConfig.model_fields.items():
        section = section_of(name)
        if section not in groups:
            doc = (section.__doc__ or "").strip().split("\n")[0]
            groups[section] = parser.add_argument_group(section.__name__, doc)
        group = groups[section]
        ann = field.annotation
        args = typing.get_args(ann)
        optional = typing.get_origin(ann) in (typing.Union, types.UnionType) and type(None) in args
        base = next(a for a in args if a is not type(None)) if optional else ann
        kw: dict[str, Any] = {"default": argparse.SUPPRESS, "help": f"{field.description} (default: {field.default})"}
        if name == "layers":
            kw.update(nargs="+", type=layer_flag, metavar="KIND:SIZE")
        elif name in YAML_ONLY:
            kw.update(nargs="+", type=yaml_only(name), metavar="YAML")
        elif base is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(base) is Literal:
            kw["choices"] = list(typing.get_args(base))
        elif typing.get_origin(base) is list:
            kw.update(nargs="+", type=typing.get_args(base)[0], metavar="N")
        else:
            kw.update(type=none_or(base) if optional else base, metavar=base.__name__.upper())
        group.add_argument(f"--{name}", **kw)
    groups[section_of("layers")].add_argument(
        "--hidden_sizes",
        nargs="+",
        type=int,
        metavar="N",
        default=argparse.SUPPRESS,
        help="Shorthand for --layers dense:N ...: dense hidden layers of these sizes.",
    )
    groups[section_of("rule")].add_argument(
        "--symmetric_nudge",
        action=argparse.BooleanOptionalAction,
        default=argparse.SUPPRESS,
        help="Old spelling of --rule: --symmetric_nudge is --rule ep, --no-symmetric_nudge --rule ep_positive.",
    )
    groups[section_of("free_steps")].add_argument(
        "--tbptt_window_steps",
        type=int,
        metavar="INT",
        default=argparse.SUPPRESS,
        help="Old name of --free_steps (still accepted).",
    )


def resolve_config(args: argparse.Namespace) -> TrainConfig:
    """Build the layered config from parsed arguments."""
    return build_config(config_layers(args))


def config_layers(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    """(source, values) layers from --preset, --config and flags, lowest first."""
    layers: list[tuple[str, dict[str, Any]]] = []
    for flag in ("preset", "config"):
        if getattr(args, flag) == "":
            raise ConfigError(
                f"--{flag}: empty; expected " + ("a preset name or a YAML path" if flag == "preset" else "a YAML path")
            )
    if args.preset:
        layers.extend(yaml_layers(args.preset, "preset"))
    if args.config:
        layers.extend(yaml_layers(args.config, "config"))
    flags = {k: v for k, v in vars(args).items() if k in accepted_keys()}
    layers.append(("command line", flags))
    return layers


def flag_overrides(argv: list[str]) -> dict[str, Any]:
    """The config fields a list of `--FIELD VALUE` flags sets, parsed as the command line parses them (the same
    types, old names and errors); for scripts that pass flags on to `trainer2.config(preset, **overrides)`."""
    parser = Parser(prog="trainer2 flags")
    add_config_flags(parser)
    return {k: v for k, v in vars(parser.parse_args(argv)).items() if k in accepted_keys()}
