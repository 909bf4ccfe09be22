"""Presets and config files: finding them, reading them strictly, the `base:` a file inherits from, and `config()`,
the library's way to build a TrainConfig from a preset and overrides (the command line's layers and checks).

A preset is configs/NAME.yaml (shipped inside the package as trainer2.configs). A YAML file may start from another:
`base: production` (a preset name, or a path relative to the file) takes every value of that file and sets only what
differs; chains are followed, cycles refused.
"""

from __future__ import annotations

import importlib.resources
import re
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import yaml

from trainer2.section import ConfigError, short_repr
from trainer2.train_config import TrainConfig, accepted_keys, build_config

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

MAX_YAML_BYTES = 1 << 20  # a config is a few hundred bytes; the cap bounds what a hostile file can cost
MAX_BASES = 16  # a chain of base: files longer than this is a mistake
BASE = "base"  # the key naming the file a YAML file starts from
CHECKOUT_PRESETS = Path(__file__).resolve().parent.parent / "configs"  # configs/ beside trainer2/ in a source tree

Layers = list[tuple[str, dict[str, Any]]]


class _ConfigLoader(yaml.SafeLoader):
    """SafeLoader without aliases (an alias bomb expands a few hundred bytes into gigabytes) that reads
    1e-3 as a float, as YAML 1.2 does (PyYAML's YAML 1.1 rules make it a string)."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            raise yaml.composer.ComposerError(
                None, None, "aliases (*name) are not allowed in a config file", self.peek_event().start_mark
            )
        return super().compose_node(parent, index)


def _unique_keys(loader: _ConfigLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    """A mapping whose keys are unique: `lr: 1` twice in one file is a mistake, not "the last one wins"."""
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            duplicate = key in seen
        except TypeError:
            continue  # an unhashable key: the constructor below refuses it
        if duplicate:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {short_repr(key)}", key_node.start_mark)
        seen.add(key)
    return yaml.SafeLoader.construct_mapping(loader, node, deep)


_ConfigLoader.add_constructor("tag:yaml.org,2002:map", lambda loader, node: _unique_keys(loader, node))
_ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789")
)


def preset_dir() -> Path | Traversable:
    """Where the presets are: configs/ of the source tree trainer2 runs from, else the installed package data.

    A source tree (configs/ and pyproject.toml beside trainer2/) comes first, so a checkout always reads its
    own configs/, even when another checkout is installed in editable mode."""
    if CHECKOUT_PRESETS.is_dir() and (CHECKOUT_PRESETS.parent / "pyproject.toml").is_file():
        return CHECKOUT_PRESETS
    try:
        return importlib.resources.files("trainer2.configs")
    except ModuleNotFoundError:  # neither installed nor a checkout; the error below lists no presets
        return CHECKOUT_PRESETS


def preset_names() -> list[str]:
    """The names --preset accepts (dev, production, profiling, ...)."""
    found = preset_dir()
    return (
        sorted(p.name.removesuffix(".yaml") for p in found.iterdir() if p.name.endswith(".yaml"))
        if found.is_dir()
        else []
    )


def preset_path(name: str) -> Path | Traversable:
    """The preset NAME (a .yaml in the presets), or NAME itself when it is a path to a YAML file."""
    path = Path(name)
    if path.suffix in (".yaml", ".yml") and path.exists():
        return path
    found = preset_dir() / f"{name}.yaml"
    if not found.is_file():
        raise ConfigError(
            f"unknown preset {short_repr(name)}: expected one of {preset_names()} or a path to a YAML file "
            f"(presets in {preset_dir()})"
        )
    return found


def read_yaml(path: Path | Traversable) -> dict[str, Any]:
    """A YAML mapping of config fields (and maybe `base`); unknown keys are refused here, naming the file."""
    data = read_mapping(path)
    unknown = sorted(set(data) - accepted_keys() - {BASE}, key=str)
    if unknown:
        raise ConfigError(
            f"config file {path}: unknown key(s) {short_repr(unknown)}; every key must be a TrainConfig field "
            "(see --help)"
        )
    return data


def read_mapping(path: Path | Traversable) -> dict[str, Any]:
    """A YAML file's mapping, read as strictly as a config file (size cap, no aliases, unique keys, 1e-3 a float);
    its keys are the caller's to check."""
    try:
        if path.is_dir():
            raise ConfigError(f"config file {path} is a directory; expected a YAML file of field: value lines")
        if isinstance(path, Path):
            if not stat.S_ISREG(path.stat().st_mode):  # a FIFO would block the read forever, /dev/zero never end
                raise ConfigError(
                    f"config file {path} is not a regular file (a pipe, socket or device); expected a YAML file"
                )
            size = path.stat().st_size
            if size > MAX_YAML_BYTES:
                raise ConfigError(
                    f"config file {path} is {size} bytes; a config file may be at most {MAX_YAML_BYTES} bytes"
                )
            with open(path, encoding="utf-8") as f:  # a stream, so YAML errors name the file
                data = yaml.load(f, Loader=_ConfigLoader)
        else:  # a preset shipped inside the package, not on a plain file system
            data = yaml.load(path.read_text(encoding="utf-8"), Loader=_ConfigLoader)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read ({e.strerror})") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(
            f"config file {path} is not valid YAML: {e}"
        ) from None  # PyYAML cuts its snippets at 75 characters
    except RecursionError:
        raise ConfigError(f"config file {path} is nested too deeply; expected a flat mapping of field: value") from None
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of field: value, got {type(data).__name__}")
    return data


def yaml_layers(name: str | Path | Traversable, what: str = "preset") -> Layers:
    """(source, values) layers of a preset name or YAML path and the chain of files it names as `base`, lowest
    first: `base: production` puts production's values under the file's own."""
    path = name if not isinstance(name, str) else preset_path(name) if what == "preset" else Path(name)
    chain: Layers = []
    seen: list[str] = []
    while True:
        if str(path) in seen or len(seen) >= MAX_BASES:
            raise ConfigError(
                f"{what} {seen[0]}: its base: files form a cycle or a chain too long ({' -> '.join(seen)})"
            )
        seen.append(str(path))
        values = read_yaml(path)
        base = values.pop(BASE, None)
        source = f"{what} {path}" if len(seen) == 1 else f"preset {path} (base of {seen[0]})"
        chain.append((source, values))
        if base is None:
            return chain[::-1]
        if not isinstance(base, str) or not base:
            raise ConfigError(f"{path}: base must name a preset or a YAML file, got {short_repr(base)}")
        # a file name is relative to the file that names it; anything else is a preset's name
        if base.endswith((".yaml", ".yml")):
            path = Path(str(path)).parent / base
        elif Path(base).suffix or "/" in base or "\\" in base:  # a file, but not YAML: "unknown preset" would mislead
            raise ConfigError(
                f"{path}: base {short_repr(base)} is not a YAML file; a base file must be a .yaml or .yml file "
                f"(its path relative to {Path(str(path)).name}), or a preset name from {preset_names()}"
            )
        else:
            path = preset_path(base)


def config(preset: str | Path | None = None, *, trust_code: bool = False, **overrides: Any) -> TrainConfig:
    """A TrainConfig from a preset name or YAML path (None: the defaults), with the given fields set over it, by the
    command line's layers and checks: a bad value or combination is a ConfigError naming the field. A component of
    your own named inside the YAML file is imported only with trust_code=True (or named again in `overrides`)."""
    unknown = sorted(set(overrides) - accepted_keys())
    if unknown:
        raise ConfigError(f"unknown config field(s) {unknown}; every keyword must be a TrainConfig field")
    layers = yaml_layers(str(preset)) if preset is not None else []
    return build_config([*layers, ("arguments", {k: plain(v) for k, v in overrides.items()})], trust_code=trust_code)


def plain(value: Any) -> Any:
    """`value` with numpy scalars and arrays made Python numbers and lists (np.int64(7) -> 7, np.bool_ -> bool), inside
    lists and dicts too: the config's fields are strict, and a number computed with numpy is still the number meant."""
    if isinstance(value, np.generic | np.ndarray):
        return value.tolist()  # a scalar's .tolist() is its Python value, as .item() is
    if isinstance(value, list | tuple):
        return type(value)(plain(v) for v in value)
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value
