"""TrainConfig validation, preset layering and the generated flags."""

from __future__ import annotations

import pytest
import yaml

from trainer2.cli import main, resolve_config, train_parser
from trainer2.config import PRESET_DIR, ConfigError, TrainConfig, build_config, read_yaml


def config_from(argv: list[str]) -> TrainConfig:
    return resolve_config(train_parser().parse_args(argv))


def test_every_field_has_a_description_and_a_flag():
    parser = train_parser()
    flags = {a.dest for a in parser._actions}
    for name, field in TrainConfig.model_fields.items():
        assert field.description, name
        assert name in flags, name


def test_unknown_yaml_key_is_refused_naming_key_and_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("batch_size: 8\nbatch_sise: 9\n")
    with pytest.raises(ConfigError, match=r"batch_sise") as e:
        read_yaml(path)
    assert str(path) in str(e.value)


def test_unknown_flag_is_an_error(capsys):
    with pytest.raises(SystemExit):
        train_parser().parse_args(["--batch_sise", "8"])
    assert "batch_sise" in capsys.readouterr().err


@pytest.mark.parametrize(
    "values, field",
    [
        ({"batch_size": 0}, "batch_size"),
        ({"device": "tpu"}, "device"),
        ({"dtype": "float16"}, "dtype"),
        ({"spectral_cap": 1.5}, "spectral_cap"),
        ({"hidden_sizes": [0]}, "hidden_sizes"),
        ({"run_name": "a/b"}, "run_name"),
    ],
)
def test_bad_value_names_the_field(values, field):
    with pytest.raises(ConfigError, match=field):
        build_config([("test", values)])


@pytest.mark.parametrize(
    "values, needle",
    [
        ({"use_cudagraphs": True, "capture_batch_size": 8}, "static_shapes"),
        ({"use_cudagraphs": True, "static_shapes": True}, "capture_batch_size"),
        ({"capture_batch_size": 8, "batch_size": 16}, "must equal batch_size"),
        ({"g_min": 2.0, "g_max": 1.0}, "g_min"),
        ({"max_windows": None}, "max_windows or max_epochs"),
    ],
)
def test_cross_field_rules(values, needle):
    with pytest.raises(ConfigError, match=needle):
        build_config([("test", values)])


def test_layers_apply_in_order(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text(yaml.safe_dump({"seed": 1, "batch_size": 32, "eta_update": 0.5}))
    over = tmp_path / "c.yaml"
    over.write_text(yaml.safe_dump({"seed": 2, "batch_size": 16}))
    cfg = config_from(["--preset", str(preset), "--config", str(over), "--seed", "3"])
    assert (cfg.seed, cfg.batch_size, cfg.eta_update) == (3, 16, 0.5)


def test_capture_batch_size_alone_sets_the_batch_size():
    cfg = config_from(["--use_cudagraphs", "--static_shapes", "--capture_batch_size", "8"])
    assert cfg.batch_size == 8 and cfg.capture_batch_size == 8


def test_boolean_flags_take_no_prefix_and_optional_ints_take_none():
    cfg = config_from(["--no-symmetric_nudge", "--eval_batches", "none", "--hidden_sizes", "32", "16"])
    assert cfg.symmetric_nudge is False and cfg.eval_batches is None and cfg.hidden_sizes == [32, 16]


@pytest.mark.parametrize("name", ["dev", "production", "profiling"])
def test_presets_are_valid(name):
    assert (PRESET_DIR / f"{name}.yaml").exists()
    config_from(["--preset", name])


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ConfigError, match="dev"):
        config_from(["--preset", "nope"])


def test_cli_reports_config_errors_with_exit_code_2(capsys):
    assert main(["--batch_size", "0"]) == 2
    assert "batch_size" in capsys.readouterr().err
