"""Shared pytest fixtures."""

from __future__ import annotations

import importlib
import importlib.util
import os
import pkgutil
import signal

import pytest

# The suite runs on CPU tensors, where Triton kernels run only in Triton's interpreter; triton reads this when a kernel
# is defined, so it is set before any test can import one (tests/test_triton_window.py). An explicit
# TRITON_INTERPRET=0 is kept, and the kernel tests then skip saying so.
os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True, scope="session")
def kernels_defined_under_the_suites_setting():
    """Every kernel module imported once, now: a test that unsets TRITON_INTERPRET (to ask what a GPU would choose)
    and first imports a kernel would define it compiled, and every later interpreted launch of it would fail."""
    if importlib.util.find_spec("triton") is None:
        return
    import trainer2.physics.kernels as kernels

    for module in pkgutil.iter_modules(kernels.__path__):
        try:
            importlib.import_module(f"{kernels.__name__}.{module.name}")
        except Exception:  # a triton that does not import: the kernel tests skip, naming why (runtime_blocker)
            continue


@pytest.fixture(autouse=True, scope="session")
def signals_as_from_a_terminal():
    """The stop signals at their defaults, as in a terminal. Started under nohup or as a background job, pytest
    inherits SIGHUP, SIGQUIT or SIGINT ignored, and trainer2 (and every child a test starts) leaves an ignored signal
    ignored, so the tests of stopping on them would fail for the way the suite was started."""
    defaults = {
        signal.SIGINT: signal.default_int_handler,
        signal.SIGHUP: signal.SIG_DFL,
        signal.SIGQUIT: signal.SIG_DFL,
    }
    before = {sig: signal.getsignal(sig) for sig in defaults}
    for sig, handler in defaults.items():
        if before[sig] is signal.SIG_IGN:
            signal.signal(sig, handler)
    yield
    for sig, handler in before.items():
        signal.signal(sig, handler)


@pytest.fixture
def small_text(tmp_path):
    """A small, learnable UTF-8 text file: repeated phrases, so a short run can lower held-out loss."""
    words = ["the cat sat on the mat. ", "a dog ran in the fog. ", "we see the sea. "]
    text = "".join(words[i % 3] for i in range(300))
    path = tmp_path / "small.txt"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture(autouse=True)
def user_cache_in_tmp(tmp_path_factory, monkeypatch):
    """The token cache ($XDG_CACHE_HOME/trainer2/tokens) in a temporary folder, never the real home; children a test
    starts inherit it through the environment."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg_cache")))
