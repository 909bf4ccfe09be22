"""A config section: the strict pydantic model behind every component's settings, and the error a bad value raises.

Each component declares the settings it reads as one `Section` beside its code (the data's in trainer2/data/load.py,
the machine's in physics/machine.py, the relaxation's in physics/relaxation.py, the update's in learning/update.py).
The application's `TrainConfig` (trainer2/train_config.py) is all of them at once, so one flat YAML file or flag line
sets any field, and each component is handed only its own section.
"""

from __future__ import annotations

import reprlib
from typing import Any

from pydantic import BaseModel, ConfigDict

MAX_REPR = 200  # characters of an offending value an error message shows


class ConfigError(ValueError):
    """A bad config key, value, file or combination; the message names it."""


def short_repr(value: Any) -> str:
    """repr(value) cut to about MAX_REPR characters (reprlib stops early), so an error never echoes a huge input."""
    r = reprlib.Repr()
    r.maxstring = r.maxother = MAX_REPR
    text = r.repr(value)
    return text if len(text) <= MAX_REPR else text[: MAX_REPR - 3] + "..."


class Section(BaseModel):
    """Settings of one component. Strict: no bool-as-int (YAML `max_windows: true` is not 1) and no numbers from
    strings (an int is still a valid float); every float finite (YAML .inf, --dt inf); unknown keys refused."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True, allow_inf_nan=False)
