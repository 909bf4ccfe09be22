"""Strict JSON out of run records: NaN and infinities are not JSON (Python writes them as NaN / Infinity, which
other readers refuse), so every non-finite float becomes null, at any depth."""

from __future__ import annotations

import json
import math
from typing import Any


def finite(obj: Any) -> Any:
    """obj with every non-finite float (in dicts, lists and tuples, at any depth) replaced by None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def dumps(obj: Any, **kw: Any) -> str:
    """json.dumps of finite(obj); never writes NaN or Infinity."""
    return json.dumps(finite(obj), allow_nan=False, **kw)
