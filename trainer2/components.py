"""Components found by name: the couplings of an energy, the costs of its output, the learning rules and the readers
of data formats.

A name is a built-in's short name (`dense`, `npz`) or a dotted path `module.Name` to a class in the user's own module
(torchtune's `_component_` convention), imported when it is first resolved. The name as written is what config.yaml
and checkpoints record, so a run that names `my_couplings.WideDense` resumes only where that module imports.
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


class ComponentError(ConfigError):
    """A component name that names nothing usable: unknown, not importable, or missing what its kind needs."""


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


def takes_keyword(fn: Callable[..., Any], name: str) -> bool:
    """Whether fn accepts the keyword argument `name`, by name or through **kwargs (a component written to the
    protocol before the argument came may not)."""
    params = inspect.signature(fn).parameters
    return name in params or any(p.kind == p.VAR_KEYWORD for p in params.values())
