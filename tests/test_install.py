"""A real install: build a wheel from the sources, install it into an empty directory, and run the commands
from another directory, so nothing can come from the checkout (presets included)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "README.md", "trainer2", "configs")  # what a wheel is built from


def why_no_wheel() -> str | None:
    """None when a wheel can be built here offline (setuptools in this environment), else the reason."""
    if importlib.util.find_spec("setuptools") is None:
        return "setuptools is not installed, so no wheel can be built offline (pip install -e '.[dev]' brings it)"
    import setuptools

    major, minor = (int(x) for x in setuptools.__version__.split(".")[:2])
    if (major, minor) < (70, 1) and importlib.util.find_spec("wheel") is None:
        return (
            f"setuptools {setuptools.__version__} needs the wheel package to build a wheel; "
            "pip install -e '.[dev]' brings a newer one"
        )
    return None


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A directory holding the installed wheel (pip install --target), built from a copy of the sources."""
    reason = why_no_wheel()
    if reason:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, src / name)
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    pip = [sys.executable, "-m", "pip"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", str(tmp / "dist"), str(src)],
        check=True,
        env=env,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = (tmp / "dist").glob("trainer2-*.whl")
    site = tmp / "site"
    subprocess.run(
        [*pip, "install", "--no-deps", "--no-index", "-q", "--target", str(site), str(wheel)],
        check=True,
        env=env,
        capture_output=True,
        timeout=300,
    )
    return site


def run_in(cwd: Path, site: Path, *argv: str | Path) -> subprocess.CompletedProcess:
    # the installed package first; any PYTHONPATH already set stays after it (dependencies may live there)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    return subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_installed_wheel_runs_every_command_from_another_directory(installed, tmp_path):
    site, work = installed, tmp_path
    # The installed copy is the one imported, and its presets are its own package data.
    r = run_in(
        work,
        site,
        sys.executable,
        "-c",
        "import trainer2, trainer2.presets as c; print(trainer2.__file__); print(c.preset_path('dev'))",
    )
    assert r.returncode == 0, r.stderr
    module, preset = (Path(line) for line in r.stdout.splitlines())
    assert module.is_relative_to(site) and preset == site / "trainer2" / "configs" / "dev.yaml"

    r = run_in(work, site, site / "bin" / "trainer2", "--preset", "dev", "--print_config")
    assert r.returncode == 0, r.stderr
    assert f"free_steps: 6  # preset {preset}" in r.stdout.splitlines()

    r = run_in(
        work,
        site,
        site / "bin" / "trainer2",
        "--preset",
        "dev",
        "--max_windows",
        "3",
        "--eval_batches",
        "2",
        "--checkpoint_dir",
        "ck",
        "--run_name",
        "dev",
    )
    assert r.returncode == 0, r.stderr
    assert "done: 3 windows" in r.stdout
    ckpt = work / "ck" / "dev" / "step_00000003"
    assert yaml.safe_load((work / "ck" / "dev" / "config.yaml").read_text())["free_steps"] == 6

    r = run_in(work, site, sys.executable, "-m", "trainer2", "evaluate", "--checkpoint", ckpt, "--eval_batches", "1")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["window"] == 3

    r = run_in(
        work,
        site,
        sys.executable,
        "-m",
        "trainer2",
        "sample",
        "--checkpoint",
        ckpt,
        "--prompt",
        "The ",
        "--length",
        "5",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("The ") and len(r.stdout) == len("The ") + 5 + 1  # prompt, 5 characters, print's newline

    r = run_in(
        work,
        site,
        site / "bin" / "trainer2",
        "bench",
        "--preset",
        "dev",
        "--batch_sizes",
        "8",
        "--modes",
        "eager",
        "--windows",
        "2",
        "--rounds",
        "1",
    )
    assert r.returncode == 0, r.stderr
    assert "eager" in r.stdout and "USDT" not in r.stderr

    if importlib.util.find_spec("matplotlib") is not None:  # the plot extra
        r = run_in(work, site, site / "bin" / "trainer2", "plot", "ck/dev")
        assert r.returncode == 0, r.stderr
        assert (work / "ck" / "dev" / "plots" / "bpc.png").is_file()


def test_python_m_trainer2_cli_prints_help(installed, tmp_path):
    for module in ("trainer2", "trainer2.cli"):
        r = run_in(tmp_path, installed, sys.executable, "-m", module, "--help")
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith("usage: trainer2") and "--print_config" in r.stdout and "--tensorboard" in r.stdout
