"""TrainConfig validation, preset layering and the generated flags."""

from __future__ import annotations

import os

import pytest
import yaml

from trainer2.cli import main, train_parser
from trainer2.flags import resolve_config
from trainer2.presets import preset_dir, preset_names, read_yaml
from trainer2.train_config import ConfigError, TrainConfig, build_config


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
    cfg = config_from(["--no-tensorboard", "--eval_batches", "none", "--hidden_sizes", "32", "16"])
    assert cfg.tensorboard is False and cfg.eval_batches is None and cfg.layers == [{"dense": 32}, {"dense": 16}]
    assert config_from(["--no-symmetric_nudge"]).rule == "ep_positive"  # the old spelling of --rule ep_positive


@pytest.mark.parametrize("name", preset_names())
def test_presets_are_valid(name):
    assert (preset_dir() / f"{name}.yaml").is_file()
    config_from(["--preset", name])


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ConfigError, match="dev"):
        config_from(["--preset", "nope"])


def test_cli_reports_config_errors_with_exit_code_2(capsys):
    assert main(["--batch_size", "0"]) == 2
    assert "batch_size" in capsys.readouterr().err


# --- bad config files and values (each a clear error, exit code 2) ---


def train(argv: list[str], tmp_path) -> int:
    """main() on training flags, writing under tmp_path should a refusal regress into a run."""
    return main([*argv, "--checkpoint_dir", str(tmp_path / "ck")])


def test_config_or_preset_that_is_a_directory_is_refused(tmp_path, capsys):
    folder = tmp_path / "dir.yaml"
    folder.mkdir()
    for flag in ("--config", "--preset"):
        assert train([flag, str(folder)], tmp_path) == 2
        err = capsys.readouterr().err
        assert f"config file {folder} is a directory" in err and "Traceback" not in err


def test_yaml_aliases_are_refused(tmp_path, capsys):
    # A "billion laughs" file: each level repeats the one below 9 times (here 9**4 = 6561 leaves; real
    # ones go to 9**9 and take minutes and gigabytes). Aliases are refused before anything expands.
    lines = ['l0: &l0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"l{i}: &l{i} [" + ",".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, 4)]
    lines.append("hidden_sizes: [" + ",".join(["*l3"] * 9) + "]")
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(lines) + "\n")
    assert train(["--config", str(bomb)], tmp_path) == 2
    err = capsys.readouterr().err
    assert "aliases (*name) are not allowed" in err and str(bomb) in err and len(err) < 1000


def test_yaml_file_size_is_bounded(tmp_path, capsys):
    big = tmp_path / "big.yaml"
    big.write_text("seed: 1\n" + "#" * (1 << 20) + "\n")
    assert train(["--config", str(big)], tmp_path) == 2
    assert (
        f"config file {big} is {big.stat().st_size} bytes; a config file may be at most 1048576"
        in capsys.readouterr().err
    )


def test_deeply_nested_yaml_is_refused(tmp_path, capsys):
    deep = tmp_path / "deep.yaml"
    deep.write_text("hidden_sizes: " + "[" * 5000 + "]" * 5000 + "\n")
    assert train(["--config", str(deep)], tmp_path) == 2
    assert "nested too deeply" in capsys.readouterr().err


def test_error_messages_cap_the_offending_input():
    with pytest.raises(ConfigError) as e:
        build_config([("test", {"run_name": "a/" * 100_000})])
    assert "run_name" in str(e.value) and len(str(e.value)) < 800
    # 10,000 bad list items: refused by a message that shows a few of them.
    with pytest.raises(ConfigError) as e:
        build_config([("test", {"hidden_sizes": ["x"] * 10_000})])
    assert "hidden_sizes" in str(e.value) and len(str(e.value)) < 800
    # Many bad fields: the first few errors are listed, then a count.
    numeric = [f for f, info in TrainConfig.model_fields.items() if info.annotation in (int, float)]
    with pytest.raises(ConfigError) as e:
        build_config([("test", {f: "x" for f in numeric})])
    assert f"... and {len(numeric) - 10} more" in str(e.value) and len(str(e.value)) < 3000


@pytest.mark.parametrize(
    "line, field",
    [
        ("max_windows: true", "max_windows"),  # was taken as 1 window
        ("batch_size: false", "batch_size"),
        ("eta_update: true", "eta_update"),
        ("static_shapes: 1", "static_shapes"),  # and no int-as-bool either
    ],
)
def test_yaml_bool_is_not_a_number(tmp_path, capsys, line, field):
    path = tmp_path / "c.yaml"
    path.write_text(line + "\n")
    assert train(["--config", str(path)], tmp_path) == 2
    err = capsys.readouterr().err
    assert f"{field} (from config {path}): Input should be a valid" in err


def test_yaml_numbers_still_read_as_expected(tmp_path):
    # Ints are valid floats, and 1e-3 is a float (PyYAML alone would read it as the string '1e-3').
    path = tmp_path / "c.yaml"
    path.write_text("dt: 1\neta_update: 1e-3\nbeta_nudge: 3.0e-3\nmax_epochs: 2\n")
    cfg = config_from(["--config", str(path)])
    assert (cfg.dt, cfg.eta_update, cfg.beta_nudge, cfg.max_epochs) == (1.0, 0.001, 0.003, 2.0)
    assert isinstance(cfg.dt, float) and isinstance(cfg.max_epochs, float)


@pytest.mark.parametrize(
    "argv",
    [
        ["--max_w", "3"],
        ["evaluate", "--checkpoint", "x", "--eval_b", "3"],
        ["sample", "--checkpoint", "x", "--temp", "0.5"],
        ["plot", "x", "--ou", "y"],
    ],
)
def test_abbreviated_flags_are_refused(argv, capsys):
    # `--max_w 3` used to mean --max_windows 3: a typo or an ambiguous prefix must not pick a flag.
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and f"unrecognized arguments: {argv[-2]}" in capsys.readouterr().err


# --- numerical values: finite, and not absurd ---


@pytest.mark.parametrize(
    "argv, field",
    [
        (["--eta_update", "inf"], "eta_update"),
        (["--dt", "inf"], "dt"),
        (["--dt", "nan"], "dt"),
        (["--beta_nudge", "nan"], "beta_nudge"),
        (["--max_epochs", "inf"], "max_epochs"),
    ],
)
def test_non_finite_values_are_refused(argv, field, capsys, tmp_path):
    assert train(argv, tmp_path) == 2
    assert f"{field} (from command line): Input should be a finite number" in capsys.readouterr().err


def test_yaml_inf_is_refused(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("eta_update: .inf\n")
    assert train(["--config", str(path)], tmp_path) == 2
    assert f"eta_update (from config {path}): Input should be a finite number" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--dt", "5", "--gamma", "0"], "dt^2/mass + 2*gamma*dt = 25 must be below 4"),  # never settled, said nothing
        (["--dt", "1", "--gamma", "1.6"], "= 4.2 must be below 4"),
        (["--dt", "1", "--mass", "0.2"], "= 7 must be below 4"),
        (["--eta_update", "1e3"], "energy learning rate eta_update = 1000 must be at most 1"),  # exited 0 with bpc inf
        (["--eta_update", "1e300"], "must be at most 1"),  # crashed
        (["--eta_embed_scale", "1e3"], "embed learning rate eta_update * eta_embed_scale = 3 must be at most 1"),
        (["--seed", str(2**64)], "seed"),  # overflowed torch.manual_seed
    ],
)
def test_absurd_values_are_refused_saying_the_sane_range(argv, needle, capsys, tmp_path):
    assert train(argv, tmp_path) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize(
    "values",
    [
        {"dt": 1.9, "gamma": 0.0},  # undamped leapfrog up to dt 2
        {"dt": 1.0, "gamma": 1.4},
        {"dt": 2.5, "gamma": 0.0, "mass": 2.0},
        {"eta_update": 1.0},
        {"seed": -(2**63)},
        {"seed": 2**64 - 1},
    ],
)
def test_sane_values_near_the_limits_are_accepted(values):
    build_config([("test", values)])


# --- --print_config ---


def printed(capsys, argv: list[str]) -> tuple[str, dict[str, str]]:
    """Run `trainer2 ARGV --print_config`; (stdout, field -> its trailing comment, '' when none)."""
    assert main([*argv, "--print_config"]) == 0
    out = capsys.readouterr().out
    comments = {}
    for line in out.splitlines():
        if line and not line.startswith("#"):
            key, _, rest = line.partition(":")
            comments[key] = rest.partition("  # ")[2]
    return out, comments


def test_print_config_shows_every_layer_and_reads_no_data(tmp_path, capsys):
    over = tmp_path / "c.yaml"
    over.write_text(yaml.safe_dump({"batch_size": 16, "seed": 5, "hidden_sizes": [32, 16]}))
    ck_dir = tmp_path / "ck"
    argv = [
        "--preset",
        "dev",
        "--config",
        str(over),
        "--seed",
        "7",
        "--data",
        str(tmp_path / "no_such_file.txt"),
        "--checkpoint_dir",
        str(ck_dir),
    ]
    out, comments = printed(capsys, argv)
    # valid YAML that rebuilds exactly the config a run would use
    assert build_config([("printed", yaml.safe_load(out))]) == config_from(argv).model_copy(
        update={"run_name": "dev-1"}
    )
    assert list(comments) == list(TrainConfig.model_fields)
    dev = str(preset_dir() / "dev.yaml")
    assert comments["free_steps"] == comments["lr_schedule"] == f"preset {dev}"
    assert comments["batch_size"] == comments["layers"] == f"config {over}"
    assert comments["seed"] == comments["data"] == comments["checkpoint_dir"] == "command line"
    assert comments["dt"] == comments["rotor_k"] == ""  # defaults carry no comment
    assert comments["run_name"] == "a fresh run name"  # the one this run would get: dev-1
    assert not ck_dir.exists()  # nothing written, and the missing data file was never opened


def test_print_config_refuses_a_bad_config_with_exit_code_2(capsys):
    assert main(["--batch_size", "0", "--print_config"]) == 2
    err = capsys.readouterr().err
    assert "batch_size (from command line)" in err


def test_print_config_with_resume_shows_the_checkpoint_layer(tmp_path, small_text, capsys):
    ck_dir = tmp_path / "ck"
    base = [
        "--data",
        str(small_text),
        "--checkpoint_dir",
        str(ck_dir),
        "--run_name",
        "r",
        "--hidden_sizes",
        "8",
        "--coord_dim_n",
        "4",
        "--rotor_k",
        "3",
        "--context_len",
        "3",
        "--embed_dim",
        "3",
        "--batch_size",
        "8",
        "--free_steps",
        "3",
        "--nudge_steps",
        "2",
        "--max_windows",
        "2",
        "--eval_batches",
        "1",
    ]
    assert main(base) == 0
    capsys.readouterr()
    files = sorted(p for p in ck_dir.rglob("*"))
    out, comments = printed(
        capsys, ["--resume", "latest", "--checkpoint_dir", str(ck_dir), "--run_name", "r", "--max_windows", "5"]
    )
    step = ck_dir / "r" / "step_00000002"
    assert comments["layers"] == comments["batch_size"] == f"checkpoint {step}"
    assert comments["max_windows"] == comments["run_name"] == "command line"
    assert yaml.safe_load(out)["max_windows"] == 5
    assert sorted(p for p in ck_dir.rglob("*")) == files  # nothing written


def test_cpu_threads_are_set_where_the_device_is_resolved(monkeypatch):
    import torch

    from trainer2.running.parts import all_cpu_threads, resolve_device

    before = torch.get_num_threads()
    try:
        assert resolve_device(TrainConfig(device="cpu")).type == "cpu" and torch.get_num_threads() == 1  # the default
        resolve_device(TrainConfig(device="cpu", cpu_threads=2))
        assert torch.get_num_threads() == 2
        monkeypatch.setenv("OMP_NUM_THREADS", "3")  # 0: OMP_NUM_THREADS when set (torchrun sets 1)...
        resolve_device(TrainConfig(device="cpu", cpu_threads=0))
        assert torch.get_num_threads() == 3
        monkeypatch.delenv("OMP_NUM_THREADS")  # ...else every core this process may use, whatever ran before
        torch.set_num_threads(1)
        resolve_device(TrainConfig(device="cpu", cpu_threads=0))
        assert torch.get_num_threads() == all_cpu_threads() >= 1
        if hasattr(os, "sched_getaffinity"):
            assert all_cpu_threads() == len(os.sched_getaffinity(0))
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ConfigError, match="cpu_threads"):
        build_config([("command line", {"cpu_threads": -1})])


def test_layers_describe_the_architecture_and_hidden_sizes_is_their_shorthand(tmp_path):
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("layers: [{dense: 32}, {dense: 16}]\n")
    from_yaml = build_config([("config", read_yaml(yaml_file))])
    assert from_yaml.layers == [{"dense": 32}, {"dense": 16}]
    assert config_from(["--layers", "dense:32", "dense:16"]).layers == from_yaml.layers
    assert config_from(["--hidden_sizes", "32", "16"]).layers == from_yaml.layers
    assert TrainConfig(hidden_sizes=[32, 16]).layers == from_yaml.layers  # a checkpoint's saved config, too
    # a higher layer's shorthand overrides a lower layer's list, and the other way round
    assert build_config([("preset", {"layers": [{"dense": 8}]}), ("flags", {"hidden_sizes": [4]})]).layers == [
        {"dense": 4}
    ]
    assert build_config([("preset", {"hidden_sizes": [4]}), ("flags", {"layers": [{"dense": 8}]})]).layers == [
        {"dense": 8}
    ]


@pytest.mark.parametrize(
    "layers, words",
    [
        ([{"conv": 3}], "layer 0 (conv): a conv layer's spec must be a mapping"),
        ([{"pool": 3}], "kind in ['conv', 'conv1d', 'dense']"),
        ([{"dense": 0}], "integer >= 1"),
        ([{"dense": 8, "other": 2}], "one {kind: spec} entry"),
        ([], "at least 1"),
    ],
)
def test_a_bad_layer_is_refused_naming_it(layers, words):
    with pytest.raises(ConfigError) as e:
        build_config([("test", {"layers": layers})])
    assert "layers" in str(e.value) and words in str(e.value)


def test_a_bad_layers_flag_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        config_from(["--layers", "dense256"])
    assert "KIND:SIZE" in capsys.readouterr().err


def test_the_old_name_of_free_steps_still_works_with_a_note(tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text("tbptt_window_steps: 7\n")
    with pytest.warns(FutureWarning, match="tbptt_window_steps is now called free_steps"):
        assert build_config([(f"config {old}", read_yaml(old))]).free_steps == 7
    with pytest.warns(FutureWarning):
        assert config_from(["--tbptt_window_steps", "9"]).free_steps == 9
    with pytest.raises(ConfigError, match="old name of free_steps"), pytest.warns(FutureWarning):
        build_config([("test", {"tbptt_window_steps": 7, "free_steps": 8})])
    with pytest.raises(ConfigError, match="shorthand for layers"):
        build_config([("test", {"hidden_sizes": [7], "layers": [{"dense": 8}]})])


def test_the_command_line_shows_the_rename_as_one_note(capsys):
    assert main(["--tbptt_window_steps", "9", "--print_config"]) == 0
    captured = capsys.readouterr()
    assert "free_steps: 9  # command line" in captured.out
    assert (
        captured.err
        == "trainer2: note: tbptt_window_steps is now called free_steps (command line); the old name still works\n"
    )


def test_bench_refuses_an_abbreviated_flag(capsys):
    """`bench --max_w 3` must not quietly mean --max_windows 3 (every parser takes flags spelled out in full)."""
    with pytest.raises(SystemExit) as e:
        main(["bench", "--max_w", "3"])
    assert e.value.code == 2 and "--max_w" in capsys.readouterr().err
