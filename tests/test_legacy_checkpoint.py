"""A checkpoint written by main before the energy became a list of couplings (dc24e50: `hidden_sizes`,
`tbptt_window_steps`, float32) still evaluates and resumes, and the resumed run continues as that main's did."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from trainer2.cli import main
from trainer2.running.checkpoint import ADDED_FIELDS
from trainer2.train_config import TrainConfig, build_config

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


@pytest.fixture
def even_odd_default():
    """TrainConfig as it would be with even/odd relaxation as the default (rebuilt back afterwards)."""
    field = TrainConfig.model_fields["relaxation"]
    assert field.default == "jacobi" and ADDED_FIELDS["relaxation"] == "jacobi"  # what checkpoints before it ran
    field.default = "even_odd"
    TrainConfig.model_rebuild(force=True)
    try:
        assert TrainConfig().relaxation == "even_odd"
        yield
    finally:
        field.default = "jacobi"
        TrainConfig.model_rebuild(force=True)


def test_a_checkpoint_from_before_even_odd_resumes_with_jacobi_when_the_default_changes(
    legacy_run, even_odd_default, capsys
):
    """The checkpoint lacks `relaxation`: its layer takes ADDED_FIELDS' value (what its run did), so it resumes as that
    main did, not with the new default, and a note names the field; a fresh run takes the new default."""
    assert main(["--resume", str(legacy_run / "step_00000004"), "--max_windows", "6"]) == 0
    err = capsys.readouterr().err
    assert "note: relaxation: the checkpoint predates this field" in err and "the default is now 'even_odd'" in err
    saved = json.loads((legacy_run / "step_00000006" / "meta.json").read_text())["config"]
    assert saved["relaxation"] == "jacobi"  # written down now, so the next resume needs no note
    want = json.loads((LEGACY / "resumed_to_6.json").read_text())
    got = load_file(legacy_run / "step_00000006" / "tensors.safetensors")
    for name, norm in want["param_norms"].items():
        assert float(got[name].double().norm()) == pytest.approx(norm, rel=1e-6, abs=1e-9), name
    assert main(["evaluate", "--checkpoint", str(legacy_run / "step_00000004")]) == 0
    assert "note: relaxation" in capsys.readouterr().err
    assert build_config([("test", {})]).relaxation == "even_odd"
