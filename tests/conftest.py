"""Shared pytest fixtures."""

from __future__ import annotations

import os

import pytest

# The suite runs on CPU tensors, where Triton kernels run only in Triton's interpreter; triton reads this when a kernel
# is defined, so it is set before any test can import one (tests/test_triton_window.py). An explicit
# TRITON_INTERPRET=0 is kept, and the kernel tests then skip saying so.
os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def small_text(tmp_path):
    """A small, learnable UTF-8 text file: repeated phrases, so a short run can lower held-out loss."""
    words = ["the cat sat on the mat. ", "a dog ran in the fog. ", "we see the sea. "]
    text = "".join(words[i % 3] for i in range(300))
    path = tmp_path / "small.txt"
    path.write_text(text, encoding="utf-8")
    return path
