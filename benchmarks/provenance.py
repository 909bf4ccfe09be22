"""The commit a benchmark measured, for the rows it prints."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def commit_of(given: str | None = None) -> str:
    """`given` where the caller names the commit, else this checkout's short HEAD ('unknown' where git cannot say)."""
    if given:
        return given
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    except OSError:
        return "unknown"
    return out.stdout.strip() or "unknown"
