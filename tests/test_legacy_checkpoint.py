"""A checkpoint written by main before the energy became a list of couplings (dc24e50: `hidden_sizes`,
`tbptt_window_steps`, float32) still evaluates and resumes, and the resumed run continues as that main's did."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from trainer2.cli import main

LEGACY = Path(__file__).resolve().parent / "data" / "main_dc24e50"
REPO = LEGACY.parent.parent.parent  # the checkpoint names its corpus relative to the repository root


@pytest.fixture
def legacy_run(tmp_path, monkeypatch) -> Path:
    # The checkpoint names its corpus as tests/data/main_dc24e50/corpus.txt: a copy there, under a temporary working
    # directory, so the token cache a run makes beside the corpus never lands in the source tree.
    corpus = LEGACY.relative_to(REPO) / "corpus.txt"
    (tmp_path / corpus).parent.mkdir(parents=True)
    shutil.copy2(REPO / corpus, tmp_path / corpus)
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "ck" / "legacy"
    shutil.copytree(LEGACY / "legacy", run)
    return run


def test_a_checkpoint_of_main_before_the_couplings_evaluates(legacy_run, capsys):
    assert main(["evaluate", "--checkpoint", str(legacy_run / "step_00000004")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["window"] == 4 and 0.0 <= out["heldout_acc"] <= 1.0 and out["heldout_bpc"] > 0


def test_a_checkpoint_of_main_before_the_couplings_resumes_as_that_main_did(legacy_run):
    assert main(["--resume", str(legacy_run / "step_00000004"), "--max_windows", "6"]) == 0
    want = json.loads((LEGACY / "resumed_to_6.json").read_text())  # main dc24e50 resumed the same checkpoint to 6
    got = load_file(legacy_run / "step_00000006" / "tensors.safetensors")
    for name, norm in want["param_norms"].items():
        assert float(got[name].double().norm()) == pytest.approx(norm, rel=1e-6, abs=1e-9), name
