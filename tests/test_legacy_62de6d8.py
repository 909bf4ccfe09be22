"""Checkpoints written by main at 62de6d8 (before the library API and the config sections) resume as 62de6d8 resumed
them: a conv machine on images (max and average pooling, shifted images) and a dense machine on feature vectors
(momentum, weight decay, a memory bank) continue from window 2 to 4 bitwise as 62de6d8 continued them on a CPU of a
recorded kind (tensor sha256s recorded there), and within 1e-4 of its tensors' norms on any other CPU (another
instruction set rounds the products differently: forcing the generic kernels moves them by up to 2e-5)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from trainer2.cli import main

LEGACY = Path(__file__).resolve().parent / "data" / "main_62de6d8"


@pytest.fixture
def legacy_dir(tmp_path, monkeypatch) -> Path:
    # The checkpoints name their data relative to the directory they were made in (images.npz, features.npz).
    for name in ("images.npz", "features.npz"):
        shutil.copy2(LEGACY / name, tmp_path / name)
    shutil.copytree(LEGACY / "ck", tmp_path / "ck")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("run", ["conv", "features"])
def test_a_checkpoint_of_62de6d8_resumes_bitwise(legacy_dir, run):
    assert main(["--resume", f"ck/{run}/step_00000002", "--max_windows", "4"]) == 0
    recorded = json.loads((LEGACY / "resumed_to_4.json").read_text())
    known = [recorded["runs"][run]] + [machine[run] for machine in recorded["runs_elsewhere"]]
    norms = recorded["norms"][run]
    got = load_file(legacy_dir / "ck" / run / "step_00000004" / "tensors.safetensors")
    digests = {k: hashlib.sha256(v.contiguous().numpy().tobytes()).hexdigest() for k, v in got.items() if k in norms}
    close = {k: float(got[k].double().norm()) == pytest.approx(n, rel=1e-4, abs=1e-12) for k, n in norms.items()}
    assert digests in known or all(close.values()), sorted(k for k, ok in close.items() if not ok)


@pytest.mark.parametrize("run", ["conv", "features"])
def test_a_checkpoint_of_62de6d8_evaluates(legacy_dir, run, capsys):
    assert main(["evaluate", "--checkpoint", f"ck/{run}/step_00000002"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["window"] == 2 and 0.0 <= out["heldout_acc"] <= 1.0
