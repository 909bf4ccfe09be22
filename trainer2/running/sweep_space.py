"""A sweep's search space: the YAML file that names config fields and their ranges, checked against the config before
any trial starts, and the values a trial's suggestions make of it.

    eta_update: {low: 1.0e-4, high: 1.0e-2, log: true}   # a float range (log-uniform)
    free_steps: {low: 4, high: 12}                       # an int field: an int range (step: 2 for every other)
    relaxation: {choices: [jacobi, even_odd]}            # one of these values
    layers.0.dense: {low: 8, high: 64}                   # inside a list or mapping field: the first layer's size
    couplings.3.gain: {low: 0.5, high: 2.0, log: true}   # a key the entry may take but does not set yet

The sweep's first trial takes the base config's own values (where they lie in the space), so the config a sweep
starts from is scored beside what it proposes.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer2.physics.graph import unset_value
from trainer2.presets import read_mapping
from trainer2.section import ConfigError, short_repr
from trainer2.train_config import TrainConfig, build_config

Layers = list[tuple[str, dict[str, Any]]]
# Fields a trial may not change: where it writes (the sweep names it), and the data and its splits (every trial must
# be scored on the same validation split, or the values are not comparable).
FIXED = ("run_name", "checkpoint_dir", "data", "data_format", "label_column", "heldout_fraction", "validation_fraction")
RANGE_KEYS, CHOICE_KEYS = {"low", "high", "log", "step"}, {"choices"}
UNSET = object()  # the value of a mapping's key the base config does not set (the config's default applies)


@dataclass(frozen=True)
class Param:
    """One swept name (a field, or field.index.key inside one): a float or int range (low..high, log-uniform when
    log, on a grid of `step` when given) or a list of choices."""

    name: str
    kind: str  # "float", "int" or "choice"
    low: float = 0.0
    high: float = 0.0
    log: bool = False
    step: float | None = None
    choices: tuple[Any, ...] = ()

    def suggest(self, trial: Any) -> Any:
        """The value an optuna trial proposes (or a retried trial's fixed one)."""
        if self.kind == "choice":
            return trial.suggest_categorical(self.name, list(self.choices))
        if self.kind == "int":
            return trial.suggest_int(self.name, int(self.low), int(self.high), step=int(self.step or 1), log=self.log)
        return trial.suggest_float(self.name, self.low, self.high, step=self.step, log=self.log)

    def edges(self) -> tuple[Any, ...]:
        """The values the config must accept for the range to be usable: its ends, or every choice."""
        return self.choices if self.kind == "choice" else (self.low, self.high)


def read_space(space: str | Path | dict[str, Any], base: TrainConfig) -> list[Param]:
    """The parameters of a space file (or a mapping of the same), each checked for shape; `base` (the sweep's config
    without the space) says which names exist and what type each field is."""
    where = "space" if isinstance(space, dict) else f"space file {space}"
    entries = space if isinstance(space, dict) else read_mapping(Path(space))
    if not entries:
        raise ConfigError(f"{where} names no field; expected lines such as eta_update: {{low: 1.0e-4, high: 1.0e-2}}")
    return [parse_param(where, str(name), spec, base) for name, spec in entries.items()]


def parse_param(where: str, name: str, spec: Any, base: TrainConfig) -> Param:
    field = name.split(".")[0]
    if field not in TrainConfig.model_fields:
        raise ConfigError(f"{where}: {short_repr(name)} is not a config field (see trainer2 --help for the fields)")
    if field in FIXED:
        raise ConfigError(
            f"{where}: {field} cannot be swept: every trial writes where the sweep says and is scored on the same "
            "data and validation split; give it as a flag instead"
        )
    target(base, name, where)  # a dotted name must lead to an existing entry
    if not isinstance(spec, dict) or not (set(spec) <= RANGE_KEYS or set(spec) == CHOICE_KEYS):
        raise ConfigError(
            f"{where}: {name}: expected {{low: A, high: B}} (with log: true or step: S) or {{choices: [...]}}, got "
            f"{short_repr(spec)}"
        )
    if "choices" in spec:
        choices = spec["choices"]
        if not isinstance(choices, list) or not choices:
            raise ConfigError(f"{where}: {name}: choices must be a non-empty list, got {short_repr(choices)}")
        if any(c is not None and not isinstance(c, (bool, int, float, str)) for c in choices):
            raise ConfigError(f"{where}: {name}: each choice must be a number, a string, true/false or null")
        return Param(name, "choice", choices=tuple(choices))
    low, high, log, step = spec.get("low"), spec.get("high"), spec.get("log", False), spec.get("step")
    for key, v in (("low", low), ("high", high), ("step", step)):
        if (v is not None or key != "step") and not (isinstance(v, (int, float)) and not isinstance(v, bool)):
            raise ConfigError(f"{where}: {name}: {key} must be a number, got {short_repr(v)}")
        if v is not None and not math.isfinite(v):
            raise ConfigError(f"{where}: {name}: {key} must be finite, got {v}")
    if not low < high:
        raise ConfigError(
            f"{where}: {name}: empty range (low {low} must be below high {high}); to fix a value, give it as a flag"
        )
    if not isinstance(log, bool) or (log and low <= 0) or (log and step is not None):
        raise ConfigError(f"{where}: {name}: log must be true or false, needs low > 0 and takes no step")
    if step is not None and not 0 < step <= high - low:
        raise ConfigError(f"{where}: {name}: step must be in (0, high - low], got {step}")
    whole = all(isinstance(v, int) for v in (low, high) if v is not None) and isinstance(step or 1, int)
    kind = "int" if whole and isinstance(current(base, name), int) else "float"  # an unset key: a float range
    return Param(name, kind, float(low), float(high), log, None if step is None else float(step))


def target(cfg: TrainConfig, name: str, where: str = "space") -> tuple[str, list[str | int]]:
    """(field, path inside it) of a swept name; a path that does not lead to an existing entry is refused, except a
    last key of a mapping (whether the config takes that key is the config's to say: check_space)."""
    field, *rest = name.split(".")
    value: Any = getattr(cfg, field)
    path: list[str | int] = []
    for i, part in enumerate(rest):
        key: str | int = int(part) if part.isdigit() and isinstance(value, list) else part
        if i == len(rest) - 1 and isinstance(value, dict) and key not in value:
            path.append(key)
            break
        try:
            value = value[key]
        except (KeyError, IndexError, TypeError):
            raise ConfigError(
                f"{where}: {short_repr(name)}: {field} has no entry {part!r} "
                f"(its value: {short_repr(getattr(cfg, field))})"
            ) from None
        path.append(key)
    return field, path


def current(cfg: TrainConfig, name: str) -> Any:
    """The base config's value of a swept name: for a coupling's unset gain or lr the value it then takes; UNSET for
    any other key of a mapping that the config does not set."""
    field, path = target(cfg, name)
    value: Any = getattr(cfg, field)
    for key in path:
        if isinstance(value, dict) and key not in value:
            coupling = field == "couplings" and len(path) == 2
            known = unset_value(value, str(key), cfg.out_init_scale) if coupling else None
            return UNSET if known is None else known
        value = value[key]
    return value


def in_space(p: Param, value: Any) -> bool:
    """Whether `value` is one that p's range or choices can propose."""
    if p.kind == "choice":
        return any(value == c and type(value) is type(c) for c in p.choices)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not p.low <= value <= p.high:
        return False
    return p.step is None or math.isclose((value - p.low) / p.step, round((value - p.low) / p.step), abs_tol=1e-9)


def start_values(params: list[Param], base: TrainConfig) -> dict[str, Any]:
    """The first trial's values: the base config's own, for each swept name whose value lies in its range (the
    others are proposed by the sampler)."""
    values = {p.name: current(base, p.name) for p in params}
    return {p.name: values[p.name] for p in params if in_space(p, values[p.name])}


def fields_of(values: dict[str, Any], base: TrainConfig) -> dict[str, Any]:
    """The config fields a trial's values set: a dotted name replaces one entry inside a copy of base's field."""
    out: dict[str, Any] = {}
    for name, value in values.items():
        field, path = target(base, name)
        if not path:
            out[field] = value
            continue
        whole = out.setdefault(field, copy.deepcopy(getattr(base, field)))
        for key in path[:-1]:
            whole = whole[key]
        whole[path[-1]] = value
    return out


# The values a trial takes come from files: the space file and the study's storage (shared with other workers). A
# layer from this source is a file's, so code it names is imported only with --trust_code (train_config.build_config).
TRIAL_SOURCE = "the sweep's space file and study"


def trial_config(layers: Layers, values: dict[str, Any], base: TrainConfig, trust_code: bool) -> TrainConfig:
    """The config of a trial taking `values` (swept field -> value) over the sweep's own layers."""
    return build_config([*layers, (TRIAL_SOURCE, fields_of(values, base))], trust_code)


def check_space(params: list[Param], layers: Layers, base: TrainConfig, trust_code: bool, where: str) -> None:
    """Refuse, by name, a range end or choice the config refuses (with the config's own message)."""
    for p in params:
        for value in p.edges():
            v = int(value) if p.kind == "int" else value
            try:
                trial_config(layers, {p.name: v}, base, trust_code)
            except ConfigError as e:
                why = str(e).removeprefix("invalid config:").strip()
                raise ConfigError(f"{where}: {p.name}: the config refuses {short_repr(v)}: {why}") from None
