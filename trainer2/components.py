"""Components found by name: the couplings of an energy, the costs of its output, the learning rules and the readers
of data formats.

A name is a built-in's short name (`dense`, `npz`) or a dotted path `module.Name` to a class in the user's own module
(torchtune's `_component_` convention), imported when it is first resolved. The name as written is what config.yaml
and checkpoints record, so a run that names `my_couplings.WideDense` resumes only where that module imports.

A file may have been handed over, and a file is data, never code: a dotted name written inside one (a checkpoint's
config, a YAML file) is imported only with the user's consent (`untrusted_names`, checked by
trainer2.train_config.build_config before anything is imported), as Hugging Face's `trust_remote_code` does.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from trainer2.section import ConfigError

# kind -> built-in short name -> dotted path; the dotted path is what a user's own component is named by, too.
BUILTIN: dict[str, dict[str, str]] = {
    "coupling": {
        "dense": "trainer2.physics.couplings.dense.Dense",
        "conv": "trainer2.physics.couplings.conv.Conv",
        "conv1d": "trainer2.physics.couplings.conv1d.Conv1d",
    },
    "cost": {
        "retrieval": "trainer2.physics.costs.retrieval.Retrieval",
        "mse": "trainer2.physics.costs.mse.MSE",
        "cross_entropy": "trainer2.physics.costs.cross_entropy.CrossEntropy",
    },
    "rule": {
        "ep": "trainer2.learning.rules.ep.EP",
        "ep_positive": "trainer2.learning.rules.ep.EPPositive",
        "ep_negative": "trainer2.learning.rules.ep.EPNegative",
        "chl": "trainer2.learning.rules.chl.CHL",
        "coupled": "trainer2.learning.rules.coupled.Coupled",
        "rbp": "trainer2.learning.rules.rbp.RBP",
    },
    "data format": {
        "builtin": "trainer2.data.text.BuiltinCorpus",
        "torchvision": "trainer2.data.images.TorchvisionSet",
        "npz": "trainer2.data.npz.NpzFile",
        "mnist": "trainer2.data.images.MnistDir",
        "cifar10": "trainer2.data.images.Cifar10Dir",
        "csv": "trainer2.data.csv_table.CsvFile",
        "text": "trainer2.data.text.TextFile",
    },
}
# What each kind of component must provide (checked when it is resolved, so a wrong class fails with its name).
REQUIRED: dict[str, tuple[str, ...]] = {
    "coupling": (
        "spec_size",
        "init",
        "param_count",
        "workspace_bytes",
        "parameters",
        "up",
        "down",
        "ep_grads",
        "cap_power",
    ),
    "cost": ("frame", "force", "target", "scores", "loss_and_grads", "folded", "memory_bank", "uses_target"),
    "rule": ("scheme", "gradients"),
    "data format": ("recognises", "load"),
}


# config field -> the kind of component it names (the `layers` entries' keys name couplings)
NAMED_FIELDS: dict[str, str] = {"rule": "rule", "cost": "cost", "data_format": "data format"}
CONSENT = "--trust_code on the command line, trust_code=True in Python"


class ComponentError(ConfigError):
    """A component name that names nothing usable: unknown, not importable, or missing what its kind needs."""


class UntrustedCodeError(ComponentError):
    """A file names code outside trainer2 (a dotted component name), and the user has not consented to import it."""


def builtin_names(kind: str) -> list[str]:
    """The short names of a kind's built-in components, in their registry order."""
    return list(BUILTIN[kind])


def resolve(kind: str, name: str) -> Any:
    """The component `name` of `kind` ("coupling", "cost", "rule", "data format"): a built-in by short name, or the
    object a dotted path `module.Name` names. Any failure is a ComponentError naming `name`."""
    if not isinstance(name, str) or not name:
        raise ComponentError(f"a {kind} name must be a non-empty string, got {name!r}")
    path = BUILTIN[kind].get(name, name)
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ComponentError(
            f"unknown {kind} {name!r}: expected one of {builtin_names(kind)} or a dotted path module.Name to your own"
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ComponentError(
            f"{kind} {name!r}: no module named {e.name!r} (is it on the Python path? the command line adds the "
            "working directory)"
        ) from None
    except Exception as e:  # a user's module that fails to import: say which and why, in one line
        raise ComponentError(f"{kind} {name!r}: importing {module_name} failed ({type(e).__name__}: {e})") from None
    found = getattr(module, attr, None)
    if found is None:
        raise ComponentError(f"{kind} {name!r}: module {module_name!r} has no {attr!r}")
    missing = [m for m in REQUIRED[kind] if not hasattr(found, m)]
    if missing:
        raise ComponentError(f"{kind} {name!r} is not a {kind}: it lacks {', '.join(missing)}")
    return found


def is_builtin(kind: str, name: str) -> bool:
    """Whether `name` is one of trainer2's own components of `kind`: a short name or a built-in's dotted path."""
    return name in BUILTIN[kind] or name in BUILTIN[kind].values()


def named_components(values: dict[str, Any]) -> list[tuple[str, str]]:
    """(field, name) of every component a layer of config values names by a dotted path that is not a built-in, in
    field order; reads raw values (a malformed one is skipped here and refused by validation, which imports nothing
    before the check)."""
    found = []
    for field, kind in NAMED_FIELDS.items():
        name = values.get(field)
        if isinstance(name, str) and "." in name and not is_builtin(kind, name):
            found.append((field, name))
    for field in ("layers", "couplings"):  # a chain's layers, or a graph's couplings, are keyed by their kinds
        entries = values.get(field)
        for i, entry in enumerate(entries if isinstance(entries, list) else []):
            for name in entry if isinstance(entry, dict) else []:
                if isinstance(name, str) and "." in name and not is_builtin("coupling", name):
                    found.append((f"{field}[{i}]", name))
    return found


def check_consent(files: list[tuple[str, dict[str, Any]]], given: set[str], trust_code: bool) -> None:
    """Refuse, naming each, the dotted component names written in `files` ((source, values) read from files) that the
    user neither gave in this call (`given`) nor consented to with trust_code; nothing is imported."""
    if trust_code:
        return
    foreign = [(source, field, name) for source, values in files for field, name in named_components(values)]
    foreign = [(source, field, name) for source, field, name in foreign if name not in given]
    if foreign:
        named = "; ".join(
            f"{field} {name!r} (module {name.rpartition('.')[0]}) in {source}" for source, field, name in foreign[:4]
        )
        raise UntrustedCodeError(
            f"not importing code named in a file: {named}. A file may have been handed over, so a name in it runs no "
            f"code without your consent: if you trust it, pass {CONSENT}, or name the same component yourself "
            "(for example --rule / --layers / --cost / --data_format with that name)"
        )


def takes_keyword(fn: Callable[..., Any], name: str) -> bool:
    """Whether fn accepts the keyword argument `name`, by name or through **kwargs (a component written to the
    protocol before the argument came may not)."""
    params = inspect.signature(fn).parameters
    return name in params or any(p.kind == p.VAR_KEYWORD for p in params.values())
