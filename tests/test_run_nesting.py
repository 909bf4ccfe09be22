"""Issue 62: no run is deleted by another (no run directory inside another run, pruning removes only what saves wrote),
and trainer2.train holds its arguments to the command line's rules."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from test_checkpoint import config, flags, run_dir

import trainer2
from trainer2.cli import main
from trainer2.running import checkpoint as ck
from trainer2.running.rundir import RunDirError
from trainer2.running.trainer import Trainer
from trainer2.train_config import RunConfig


def quiet(msg: str) -> None:
    del msg


def tree(root: Path) -> dict[str, bytes | None]:
    """Every path under root, with a file's bytes (None for a directory)."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


@pytest.fixture
def parent(tmp_path, small_text) -> Path:
    """Run 'parent' of 4 windows with checkpoints step_00000002 and step_00000004."""
    Trainer(config(tmp_path, small_text, run_name="parent", max_windows=4, save_every_windows=2), log=quiet).train()
    rd = run_dir(tmp_path, "parent")
    assert [p.name for p in ck.list_checkpoints(rd)] == ["step_00000002", "step_00000004"]
    return rd


def tiny(tmp_path: Path, small_text: Path, **kw) -> trainer2.TrainConfig:
    return config(tmp_path, small_text, max_windows=2, **kw)


# --- no run inside another ---


@pytest.mark.parametrize("inside", ["step_00000002", ".", ".tmp-step_00000006-4242"])
def test_the_command_line_refuses_a_run_inside_another_and_touches_nothing(
    tmp_path, small_text, parent, capsys, inside
):
    root = parent / inside
    root.mkdir(exist_ok=True)
    before = tree(tmp_path)
    assert main(flags(tmp_path, small_text, max_windows=2, checkpoint_dir=str(root), run_name="child")) == 2
    err = capsys.readouterr().err
    assert err.startswith("trainer2: error: run directory ") and err.count("\n") == 1
    assert str(root / "child") in err and str(parent) in err and f"--checkpoint_dir outside {parent}" in err
    assert tree(tmp_path) == before  # the parent's checkpoints as they were, and no child directory made


@pytest.mark.parametrize("where", ["checkpoint", "run_dir"])
def test_the_library_refuses_a_run_inside_another_and_touches_nothing(tmp_path, small_text, parent, where):
    inside = (parent / "step_00000004" if where == "checkpoint" else parent) / "child"
    before = tree(tmp_path)
    with pytest.raises(RunDirError) as e:
        trainer2.train(tiny(tmp_path, small_text), run_dir=inside, log=quiet)
    assert str(inside) in str(e.value) and f"--checkpoint_dir outside {parent} (in Python: a run_dir" in str(e.value)
    assert tree(tmp_path) == before


def test_a_run_directory_holding_another_run_is_refused(tmp_path, small_text, parent, capsys):
    before = tree(tmp_path)
    with pytest.raises(RunDirError) as e:
        trainer2.train(tiny(tmp_path, small_text), run_dir=tmp_path / "ck", log=quiet)
    assert f"holds the directory of another run, {parent}" in str(e.value) and "move" in str(e.value)
    assert tree(tmp_path) == before


def test_a_run_beside_another_still_starts(tmp_path, small_text, parent):
    (tmp_path / ".lock").write_text("4242\n")  # another tool's lock (pytest's basetemp has one) marks no run
    (tmp_path / "config.yaml").write_text("a: 1\n")  # nor does a config of the user's alone
    run = trainer2.train(tiny(tmp_path, small_text), run_dir=tmp_path / "ck" / "sibling", log=quiet)
    assert run.checkpoint == tmp_path / "ck" / "sibling" / "step_00000002" and run.checkpoint.is_dir()
    assert [p.name for p in ck.list_checkpoints(parent)] == ["step_00000002", "step_00000004"]


# --- pruning removes only what the run's saves wrote ---


def test_pruning_keeps_what_no_save_wrote_and_warns_naming_it(tmp_path, small_text, parent, capsys):
    nested = parent / "step_00000002" / "child"  # a run nested there before nesting was refused, and a user's note
    (nested / "step_00000001").mkdir(parents=True)
    (nested / "summary.json").write_text("{}\n")
    (parent / "step_00000002" / "notes.txt").write_text("keep me")
    argv = ["--resume", "latest", "--checkpoint_dir", str(tmp_path / "ck"), "--run_name", "parent"]
    assert main([*argv, "--keep_last", "1", "--max_windows", "6", "--save_every_windows", "2"]) == 0
    err = capsys.readouterr().err
    assert f"trainer2: note: pruning checkpoint {parent / 'step_00000002'}" in err and "child, notes.txt" in err
    assert str(parent / "step_00000004") not in err  # a checkpoint of only the save's files goes without a word
    assert (nested / "summary.json").read_text() == "{}\n" and (nested / "step_00000001").is_dir()
    assert (parent / "step_00000002" / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in (parent / "step_00000002").iterdir()) == ["child", "notes.txt"]  # the save's: gone
    assert not (parent / "step_00000004").exists() and (parent / "step_00000006" / ck.META_FILE).is_file()


def test_prune_returns_the_checkpoints_it_removed_whole_or_in_part(tmp_path):
    rd = tmp_path / "r"
    for step in (1, 2, 3):
        d = rd / ck.step_name(step)
        d.mkdir(parents=True)
        (d / ck.TENSORS_FILE).write_bytes(b"t")
        (d / ck.META_FILE).write_text(json.dumps({"run_id": "mine"}))
    (rd / "step_00000001" / "keep.txt").write_text("mine, not the save's")
    with pytest.warns(UserWarning, match=r"step_00000001.*keep\.txt"):
        removed = ck.prune(rd, 1, "mine")
    assert [p.name for p in removed] == ["step_00000001", "step_00000002"]
    assert [p.name for p in (rd / "step_00000001").iterdir()] == ["keep.txt"] and not (rd / "step_00000002").exists()
    assert ck.prune(rd, 1, "mine") == []  # what stays is no checkpoint of the run's any more: no second warning


# --- train() as strict as the command line ---


@pytest.mark.parametrize("name", ["step_00000005", ".lock", ".hidden", "a b", ".."])
def test_run_dir_obeys_the_run_name_rules_of_the_command_line(tmp_path, small_text, capsys, name):
    with pytest.raises(RunDirError) as lib:
        trainer2.train(tiny(tmp_path, small_text), run_dir=tmp_path / "ck" / name, log=quiet)
    with pytest.raises(ValueError) as rule:  # the rule itself, as --run_name meets it
        RunConfig(run_name=name)
    why = rule.value.errors()[0]["msg"].removeprefix("Value error, ")
    assert why in str(lib.value) and "Pass a run_dir ending in such a name" in str(lib.value)
    assert main(flags(tmp_path, small_text, max_windows=2, run_name=name)) == 2
    assert why in capsys.readouterr().err
    assert not (tmp_path / "ck").exists()


def test_a_run_dir_that_is_a_file_is_refused_naming_it(tmp_path, small_text, capsys):
    (tmp_path / "ck").mkdir()
    file = tmp_path / "ck" / "taken"
    file.write_text("a file of the user's")
    with pytest.raises(RunDirError, match=re.escape(f"run directory {file} is a file") + ".*pick another"):
        trainer2.train(tiny(tmp_path, small_text), run_dir=file, log=quiet)
    with pytest.raises(RunDirError, match=re.escape(f"{file} is not a directory")):
        trainer2.train(tiny(tmp_path, small_text), run_dir=file / "r", log=quiet)
    assert main(flags(tmp_path, small_text, max_windows=2, run_name="taken")) == 2
    assert f"trainer2: error: run directory {file} is a file" in capsys.readouterr().err
    assert file.read_text() == "a file of the user's" and sorted(p.name for p in (tmp_path / "ck").iterdir()) == [
        "taken"
    ]


@pytest.mark.parametrize("data", [np.zeros((4, 3), np.float32), "data.npz", {"x": [1]}])
def test_data_that_is_not_a_dataset_is_refused_with_the_fix(tmp_path, small_text, data):
    with pytest.raises(trainer2.DataError) as e:
        trainer2.train(tiny(tmp_path, small_text), data, run_dir=tmp_path / "ck" / "r", log=quiet)
    assert "trainer2.from_arrays(" in str(e.value) and "cfg.data" in str(e.value)
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("cfg", [{"max_windows": 5}, None, "dev"])
def test_a_cfg_that_is_not_a_train_config_is_refused_with_the_fix(tmp_path, cfg):
    with pytest.raises(trainer2.ConfigError, match=r"cfg must be a trainer2\.TrainConfig.*trainer2\.config\("):
        trainer2.train(cfg, run_dir=tmp_path / "ck" / "r", log=quiet)
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("resume", [5, True, ["latest"]])
def test_a_resume_of_the_wrong_type_is_refused(tmp_path, small_text, resume):
    with pytest.raises(trainer2.CheckpointError, match="resume must be 'latest' or a checkpoint directory"):
        trainer2.train(tiny(tmp_path, small_text), run_dir=tmp_path / "ck" / "r", resume=resume, log=quiet)
    assert not (tmp_path / "ck").exists()


def test_run_dir_error_is_exported():
    assert trainer2.RunDirError is RunDirError and "RunDirError" in trainer2.__all__


def test_re_saving_a_step_keeps_what_no_save_wrote(tmp_path):
    """A step saved again (the same window, after a resume) swaps its directory; a user's file in it moves across."""
    import torch

    first = ck.save(tmp_path, 2, {"w": torch.zeros(3)}, {"config": {}})
    (first / "notes.txt").write_text("mine")
    again = ck.save(tmp_path, 2, {"w": torch.ones(3)}, {"config": {}})
    assert (again / "notes.txt").read_text() == "mine"
    assert ck.load_tensors(again, json.loads((again / "meta.json").read_text()))["w"].sum() == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002"]  # no temporary directory left
