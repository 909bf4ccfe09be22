"""Issue 62: no silent nonsense (non-finite inputs, a split that is not there, a model's data that lives only in
memory), refusals that name the fix (a rule's scheme, numpy numbers, beta_nudge, a base that is no YAML file, plot's
--out), and cliffs (cpu_threads above the cores, from_arrays' memory)."""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest
import torch
from test_library import TINY, blobs, quiet

import trainer2
from trainer2.cli import main
from trainer2.learning.rules.rule import rule_scheme
from trainer2.physics.relaxation import DynamicsConfig
from trainer2.presets import yaml_layers
from trainer2.running import threads
from trainer2.running.health import Health, divergence_message


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny machine trained on feature arrays (no validation split), its data and its loaded checkpoint."""
    x, y = blobs()
    data = trainer2.from_arrays(x[:320], y[:320], x[320:], y[320:])
    run = trainer2.train(
        trainer2.config(None, **{**TINY, "max_windows": 4}), data, run_dir=tmp_path_factory.mktemp("r") / "a", log=quiet
    )
    return run, data, x, trainer2.load(run.checkpoint)


# --- A. no silent nonsense ---


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_predict_refuses_non_finite_rows_naming_them(trained, bad):
    run, _, x, _ = trained
    rows = x[:10].copy()
    rows[3, 1] = rows[7, 0] = bad
    for model in (run.model, trained[3]):
        for given in (rows, torch.from_numpy(rows)):
            with pytest.raises(trainer2.DataError, match=r"rows 3, 7 hold NaN or inf.*drop or impute"):
                model.predict(given)
            with pytest.raises(trainer2.DataError, match=r"rows 3, 7 "):
                model.predict_proba(given)
    assert run.model.predict(x[:10]).shape == (10,)  # finite rows still predict


def test_predict_names_the_first_few_rows_and_counts_the_rest_and_sees_float64_beyond_float32(trained):
    run, _, x, _ = trained
    rows = x[:20].astype(np.float64)
    rows[2:12, 0] = np.nan
    with pytest.raises(trainer2.DataError, match=r"rows 2, 3, 4, 5, 6 and 5 more hold"):
        run.model.predict(rows)
    rows = x[:4].astype(np.float64)
    rows[1, 2] = 1e300  # finite in float64, inf as the float32 the machine reads
    with pytest.raises(trainer2.DataError, match=r"row 1 holds"):
        run.model.predict(rows)


def test_predict_refuses_non_finite_images_before_normalising(tmp_path):
    rng = np.random.default_rng(2)
    y = rng.integers(0, 2, 60)
    x = rng.normal(size=(60, 4, 4)).astype(np.float32)
    run = trainer2.train(
        trainer2.config(None, **{**TINY, "max_windows": 2}),
        trainer2.from_arrays(x, y),
        run_dir=tmp_path / "i",
        log=quiet,
    )
    bad = x[:6].copy()
    bad[4, 2, 3] = np.nan
    with pytest.raises(trainer2.DataError, match=r"row 4 holds NaN"):
        run.model.predict(bad)
    with pytest.raises(trainer2.DataError, match=r"row 4 holds NaN"):
        trainer2.load(run.checkpoint).predict(bad[:, None])  # [N, C, H, W] too
    assert run.model.predict(x[:6]).shape == (6,)


def test_evaluate_refuses_a_split_the_data_lacks_or_does_not_know(trained):
    run, data, x, loaded = trained
    with pytest.raises(trainer2.DataError, match=r"no validation split.*with_validation.*split='heldout'"):
        run.model.evaluate(data, split="validation")
    with pytest.raises(trainer2.DataError, match=r"no validation split"):
        run.model.evaluate(split="validation")  # the data it was trained on has none either
    with pytest.raises(trainer2.DataError, match=r"split: expected one of train, validation, heldout, got 'test'"):
        run.model.evaluate(data, split="test")
    with_val = data.with_validation(0.25)
    scores = run.model.evaluate(with_val, split="validation")
    assert set(scores) == {"validation_loss", "validation_acc"} and scores["validation_loss"] > 0


def test_evaluate_without_data_on_a_model_trained_from_arrays_asks_for_the_data(trained):
    run, data, _, loaded = trained
    assert run.model.evaluate() == run.model.evaluate(data)  # the run's model holds its data
    with pytest.raises(trainer2.DataError, match=r"given in memory \(arrays\).*model.evaluate\(trainer2.from_arrays"):
        loaded.evaluate()
    assert loaded.evaluate(data) == run.model.evaluate(data)


# --- B. messages that name the fix ---


def test_a_rule_whose_scheme_returns_no_nudge_scheme_is_refused_by_name(tmp_path, monkeypatch):
    (tmp_path / "odd_rules.py").write_text(
        "from trainer2.learning.gradients import ep_gradients\n"
        "class NoScheme:\n"
        "    kind = 'no_scheme'\n"
        "    scheme = staticmethod(lambda dynamics: None)\n"
        "    gradients = staticmethod(ep_gradients)\n"
        "class Tuple(NoScheme):\n"
        "    scheme = staticmethod(lambda dynamics: (dynamics.beta_nudge, -dynamics.beta_nudge))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    says = r"rule 'odd_rules.NoScheme': scheme\(dynamics\) returned None .*must return a .*NudgeScheme"
    with pytest.raises(trainer2.ComponentError, match=says):
        rule_scheme("odd_rules.NoScheme", DynamicsConfig())
    with pytest.raises(trainer2.ComponentError, match=r"returned \(0.003, -0.003\) \(tuple\)"):
        rule_scheme("odd_rules.Tuple", DynamicsConfig())
    x, y = blobs(100)
    cfg = trainer2.config(None, **{**TINY, "max_windows": 2}, rule="odd_rules.NoScheme")
    with pytest.raises(trainer2.ComponentError, match=says):  # before any window runs the default rule instead
        trainer2.train(cfg, trainer2.from_arrays(x, y), run_dir=tmp_path / "r", log=quiet)
    assert rule_scheme("ep", DynamicsConfig()).betas == (0.003, -0.003)


def test_numpy_numbers_are_taken_as_the_python_numbers_they_are():
    cfg = trainer2.config(
        None,
        max_windows=np.int64(7),
        eta_update=np.float32(0.5),
        batch_size=np.uint16(8),
        use_cudagraphs=np.bool_(False),
        layers=[{"dense": np.int32(12)}],
    )
    assert (cfg.max_windows, cfg.eta_update, cfg.batch_size, cfg.use_cudagraphs) == (7, 0.5, 8, False)
    assert type(cfg.max_windows) is int and type(cfg.eta_update) is float and type(cfg.use_cudagraphs) is bool
    same = trainer2.config(
        None, max_windows=7, eta_update=0.5, batch_size=8, use_cudagraphs=False, layers=[{"dense": 12}]
    )
    assert cfg == same
    assert trainer2.config(None, hidden_sizes=np.array([5, 6])) == trainer2.config(None, hidden_sizes=[5, 6])
    with pytest.raises(trainer2.ConfigError, match="max_windows"):
        trainer2.config(None, max_windows=np.int64(-1))  # converted, then checked as any number is


def test_beta_nudge_far_out_of_range_is_refused_naming_it_and_a_dropped_run_names_it_too(tmp_path, capsys):
    with pytest.raises(trainer2.ConfigError, match=r"beta_nudge 1e\+30 is above 1.*0.003 \(the default\)"):
        trainer2.config(None, beta_nudge=1e30)
    assert trainer2.config(None, beta_nudge=1.0).beta_nudge == 1.0  # the largest sane nudge stays allowed
    assert main(["--beta_nudge", "1e30", "--print_config"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("trainer2: error:") and "beta_nudge" in err and "Traceback" not in err
    health = Health(1e-6, quiet)
    found = None
    for w in range(10, 70, 10):
        found = health.diverged({"window": w, "train_loss": 1.0, "dropped": 1.0, "nonfinite_params": False}, w - 10)
    assert found is not None and "was dropped" in found[0]
    assert "a smaller beta_nudge" in divergence_message(*found, tmp_path)
    assert "beta_nudge" not in divergence_message("the parameters became non-finite", 3, tmp_path)


def test_a_base_that_is_no_yaml_file_is_refused_saying_what_a_base_must_be(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("max_windows: 3\n")
    for base in ("notes.txt", "sub/dev", "../x.json"):
        path = tmp_path / "run.yaml"
        path.write_text(f"base: {base}\n")
        with pytest.raises(trainer2.ConfigError, match=r"not a YAML file; a base file must be a \.yaml or \.yml"):
            yaml_layers(str(path), "config")
        assert main(["--config", str(path), "--print_config"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("trainer2: error:") and "unknown preset" not in err and "preset name" in err
        assert len(err.strip().splitlines()) == 1
    path.write_text("base: dev\nmax_windows: 3\n")  # a preset's name still works
    assert trainer2.config(path).max_windows == 3


def test_plot_out_that_is_a_file_is_refused_saying_it_must_be_a_directory(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "telemetry.jsonl").write_text(json.dumps({"window": 1, "train_loss": 1.0}) + "\n")
    out = tmp_path / "file.png"
    out.write_text("x")
    assert main(["plot", str(run_dir), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--out must be a directory" in err and str(out) in err and "Traceback" not in err
    assert "File exists" not in err and out.read_text() == "x"
    assert main(["plot", str(run_dir), "--out", str(out / "below")]) == 2
    assert "--out must be a directory" in capsys.readouterr().err
    assert main(["plot", str(run_dir), "--out", str(tmp_path / "plots")]) == 0


# --- C. cliffs ---


def test_cpu_threads_above_the_usable_cores_warn_once_naming_what_0_does(tmp_path, monkeypatch):
    said: list[str] = []
    threads.warn_oversubscribed(5, said.append, cores=4)
    threads.warn_oversubscribed(4, said.append, cores=4)
    threads.warn_oversubscribed(0, said.append, cores=4)
    assert len(said) == 1 and "cpu_threads 5 is more than the 4 core(s)" in said[0]
    assert "oversubscribe" in said[0] and "or 0 (measured" in said[0]

    monkeypatch.setattr(threads, "usable_cores", lambda: 1)  # a one-core machine, whatever this one has
    before = torch.get_num_threads()
    said.clear()
    x, y = blobs(100)
    try:
        trainer2.train(
            trainer2.config(None, **{**TINY, "max_windows": 20}, cpu_threads=2),
            trainer2.from_arrays(x, y),
            run_dir=tmp_path / "t",
            log=said.append,
        )
    finally:
        torch.set_num_threads(before)
    warned = [s for s in said if "oversubscribe" in s]
    assert len(warned) == 1 and "cpu_threads 2 is more than the 1 core(s)" in warned[0]  # once in the run


def test_from_arrays_checks_finiteness_without_a_copy_of_the_arrays():
    x = np.random.default_rng(0).normal(size=(100_000, 100)).astype(np.float32)  # 40 MB
    y = np.arange(len(x)) % 3
    tracemalloc.start()
    try:
        data = trainer2.from_arrays(x, y)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 0.2 * x.nbytes, peak  # allocated beyond the arrays given (float32 rows are used in place)
    assert data.num_examples("train") + data.num_examples("heldout") == len(x)
    x[61_234, 7] = np.inf  # in a later chunk
    with pytest.raises(trainer2.DataError, match=r"x must be finite, found inf in row 61234"):
        trainer2.from_arrays(x, y)
    wide = np.zeros((50, 3))
    wide[49, 2] = 1e300  # finite as float64, inf as the float32 that trains
    with pytest.raises(trainer2.DataError, match=r"found 1e\+300 in row 49"):
        trainer2.from_arrays(wide, np.arange(50) % 2)
