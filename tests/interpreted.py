"""The module-level skip of the Triton kernel tests: they need triton and numpy, and run on CPU tensors only in Triton's
interpreter (TRITON_INTERPRET=1, which tests/conftest.py sets before anything imports triton)."""

from __future__ import annotations

import importlib.util

import pytest

from trainer2.physics.kernels.backend import interpreting


def require_interpreted_triton(what: str) -> None:
    """Skip the calling test module, saying why, unless triton and numpy are installed and Triton interprets; `what`
    names the kernel it tests ("the fused update")."""
    if importlib.util.find_spec("triton") is None or importlib.util.find_spec("numpy") is None:
        pytest.skip(
            f"triton and numpy are not installed (pip install -e '.[kernels]'): {what} is not tested",
            allow_module_level=True,
        )
    if not interpreting():
        pytest.skip(
            f"TRITON_INTERPRET is off: {what} runs on CPU tensors only in Triton's interpreter", allow_module_level=True
        )
