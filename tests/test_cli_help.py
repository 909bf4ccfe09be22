"""The command line's help and mistakes: a mistyped flag or command is one short line naming the one meant, and
--help lists the commands first and the config flags by section."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from trainer2.cli import COMMANDS, main, train_parser
from trainer2.section import ConfigError
from trainer2.train_config import TrainConfig, build_config

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = (
    "RunConfig",
    "DataConfig",
    "MachineConfig",
    "DynamicsConfig",
    "RuleConfig",
    "UpdateConfig",
    "SpeedConfig",
    "LoopConfig",
)


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> list[str]:
    """stderr's lines of a command line argparse refuses, checking it exits 2 without a usage dump."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert e.value.code == 2 and 1 <= len(lines) <= 3 and "usage:" not in err, err
    return lines


@pytest.mark.parametrize(
    "argv, meant",
    [
        (["--batch", "32"], "did you mean --batch_size?"),
        (["--batch=32"], "did you mean --batch_size?"),
        (["--max_w", "3"], "did you mean --max_windows?"),
        (["evaluate", "--checkpoint", "x", "--eval_b", "3"], "did you mean --eval_batches?"),
        (["sample", "--checkpoint", "x", "--temprature", "0.5"], "did you mean --temperature?"),
        (["plot", "x", "--outt", "y"], "did you mean --out?"),
        (["bench", "--bach_sizes", "8"], "did you mean --batch_sizes?"),
    ],
)
def test_a_mistyped_flag_is_one_line_naming_the_flag_meant(argv, meant, capsys):
    (line,) = refused(argv, capsys)
    assert meant in line and "--help" in line


def test_several_mistyped_flags_each_get_their_suggestion(capsys):
    (line,) = refused(["--hiden", "5", "--max_w", "3"], capsys)
    assert "--hidden_sizes (for --hiden)" in line and "--max_windows (for --max_w)" in line


def test_a_mistyped_command_names_the_command_meant(capsys):
    (line,) = refused(["evalute", "--checkpoint", "x"], capsys)
    assert line.startswith("trainer2: error: unknown command evalute; did you mean evaluate?"), line


def test_a_flag_far_from_every_flag_gets_no_guess(capsys):
    (line,) = refused(["--zzzzzzzz", "1"], capsys)
    assert "did you mean" not in line and "unrecognized arguments: --zzzzzzzz 1" in line


def test_a_bad_value_is_short_and_names_the_flag(capsys):
    (line,) = refused(["--batch_size", "x"], capsys)
    assert "--batch_size" in line and "'x'" in line


def test_the_script_prints_no_usage_for_a_mistyped_flag():
    r = subprocess.run(
        [sys.executable, "main.py", "--batch", "32"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) <= 3 and "usage:" not in r.stderr, r.stderr
    assert "did you mean --batch_size?" in lines[-1]


def test_help_lists_the_commands_first_then_the_flags_by_section(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    lines = out.splitlines()
    first_flag = next(i for i, line in enumerate(lines) if line.lstrip().startswith("-"))
    listed = [line.split()[0] for line in lines[:first_flag] if line.startswith("  ") and line.split()]
    assert sorted(listed) == sorted(COMMANDS) and listed[0] == "train" and "(default)" in lines[lines.index("") + 2]
    assert lines[0].startswith("usage: trainer2") and first_flag < 20
    headings = [line[:-1] for line in lines if line[:-1] in SECTIONS and line.endswith(":")]
    assert headings == list(SECTIONS)  # every section once, in the config's order
    run = lines.index("RunConfig:")
    assert lines[run + 1].strip() == "Which run this is and where it computes and writes."


def test_each_flag_sits_in_the_group_of_the_section_declaring_it():
    groups = {g.title: {a.dest for a in g._group_actions} for g in train_parser()._action_groups}
    for name in TrainConfig.model_fields:
        owner = next(c for c in TrainConfig.__mro__ if name in vars(c).get("__annotations__", {}))
        assert name in groups[owner.__name__], (name, owner.__name__)
    assert {"batch_size", "capture_batch_size"} <= groups["SpeedConfig"]
    assert "hidden_sizes" in groups["MachineConfig"] and "tbptt_window_steps" in groups["DynamicsConfig"]


def test_a_conv_size_on_the_command_line_says_to_write_it_in_yaml(capsys):
    (line,) = refused(["--layers", "conv:16"], capsys)
    assert "--layers" in line and "YAML" in line and "--config FILE" in line
    assert "{conv: {channels: 16, kernel: 5, pool: 2}}" in line and "dense:256" in line
    assert train_parser().parse_args(["--layers", "dense:8", "dense:4"]).layers == [{"dense": 8}, {"dense": 4}]


def test_a_conv_size_in_a_config_says_how_to_write_the_spec():
    with pytest.raises(ConfigError) as e:
        build_config([("test", {"layers": [{"conv": 16}]})])
    assert "YAML" in str(e.value) and "{conv: {channels: 16, kernel: 5, pool: 2}}" in str(e.value)
    with pytest.raises(ConfigError) as e:
        build_config([("test", {"layers": [{"dense": 0}]})])
    assert "YAML" not in str(e.value)  # a bad size of a sized kind is not a spec problem
