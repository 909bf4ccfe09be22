"""trainer2 as a library: config from a preset and overrides, data from arrays, train, predict, load; components by
name (also a coupling of the user's own module, by its dotted path); presets that inherit; the examples run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import trainer2
from trainer2.cli import main
from trainer2.data.load import DataConfig, load_data
from trainer2.learning.gradients import ep_gradients
from trainer2.presets import preset_dir, preset_names, yaml_layers

REPO = Path(__file__).resolve().parent.parent
TINY = dict(
    layers=[{"dense": 12}],
    coord_dim_n=4,
    rotor_k=3,
    batch_size=16,
    free_steps=12,
    nudge_steps=6,
    max_windows=30,
    log_every_windows=10,
    eval_every_windows=0,
    eta_update=0.02,
)


def blobs(n: int = 400, d: int = 6, k: int = 3, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """k Gaussian blobs in d dimensions, float32 rows and int labels."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, k, n)
    return (rng.normal(size=(k, d))[y] * 2 + rng.normal(size=(n, d)) * 0.5).astype(np.float32), y


def quiet(msg: str) -> None:
    del msg


# --- config ---


def test_config_takes_a_preset_and_overrides_and_refuses_as_the_command_line_does(tmp_path, capsys):
    cfg = trainer2.config("dev", max_windows=300)
    assert cfg.max_windows == 300 and cfg.free_steps == 6  # the override, and the preset under it
    assert cfg.relaxation == "even_odd"
    assert trainer2.config(None).free_steps == trainer2.TrainConfig().free_steps  # no preset: the defaults
    with pytest.raises(trainer2.ConfigError) as lib:
        trainer2.config("dev", spectral_cap=2.0)
    assert main(["--preset", "dev", "--spectral_cap", "2", "--print_config"]) == 2
    cli = capsys.readouterr().err
    assert "spectral_cap (from arguments)" in str(lib.value) and "spectral_cap (from command line)" in cli
    assert str(lib.value).split("): ", 1)[1] in cli  # the same message, naming the field and what it got
    with pytest.raises(trainer2.ConfigError, match="unknown config field.*no_such"):
        trainer2.config("dev", no_such=1)
    with pytest.raises(trainer2.ConfigError, match="unknown preset"):
        trainer2.config("no-such-preset")


# --- arrays, train, predict, load ---


def test_train_on_arrays_predicts_and_the_loaded_model_predicts_the_same(tmp_path):
    x, y = blobs()
    data = trainer2.from_arrays(x[:320], y[:320], x[320:], y[320:])
    assert data.kind == "features" and data.num_examples("heldout") == 80
    run = trainer2.train(trainer2.config(None, **TINY), data, run_dir=tmp_path / "runs" / "a", log=quiet)
    assert run.run_dir == tmp_path / "runs" / "a" and run.checkpoint == run.run_dir / "step_00000030"
    assert run.checkpoint.is_dir() and json.loads((run.run_dir / "summary.json").read_text()) == run.summary
    pred = run.model.predict(x[320:])
    assert isinstance(pred, np.ndarray) and pred.shape == (80,)
    assert np.mean(pred == y[320:]) == pytest.approx(run.summary["heldout_acc"])  # evaluation scores the same way
    probs = run.model.predict_proba(torch.from_numpy(x[320:]))
    assert isinstance(probs, torch.Tensor) and torch.allclose(probs.sum(1), torch.ones(80, dtype=probs.dtype))
    loaded = trainer2.load(run.checkpoint)
    assert np.array_equal(loaded.predict(x[320:]), pred) and loaded.window == 30
    assert loaded.evaluate(data) == run.model.evaluate(data)
    with pytest.raises(trainer2.DataError, match="feature rows"):
        loaded.predict(x[:, :3])


def test_images_from_arrays_train_a_conv_machine_and_raw_images_are_normalised_as_in_training(tmp_path):
    rng = np.random.default_rng(1)
    y = rng.integers(0, 2, 120)
    x = rng.integers(0, 60, size=(120, 8, 8)).astype(np.uint8)
    x[y == 1, 2:6, 2:6] += 150  # a bright square marks class 1
    data = trainer2.from_arrays(x[:96], y[:96], x[96:], y[96:])
    assert data.input_shape == (1, 8, 8) and data.normalise is not None
    cfg = trainer2.config(None, **{**TINY, "layers": [{"conv": {"channels": 3, "pool": 2}}], "max_windows": 20})
    run = trainer2.train(cfg, data, run_dir=tmp_path / "conv", log=quiet)
    assert type(run.model.machine.energy.couplings[0]) is trainer2.Conv
    pred = trainer2.load(run.checkpoint).predict(x[96:])  # raw uint8 images, as given to from_arrays
    assert np.array_equal(pred, run.model.predict(x[96:]))
    assert np.mean(pred == y[96:]) == pytest.approx(run.summary["heldout_acc"])


def test_bad_arrays_are_refused_naming_what_is_wrong():
    x, y = blobs(20)
    with pytest.raises(trainer2.DataError, match="same number of rows"):
        trainer2.from_arrays(x, y[:10])
    with pytest.raises(trainer2.DataError, match="class indices"):
        trainer2.from_arrays(x, y + 100)
    with pytest.raises(trainer2.DataError, match="x_train rows are"):
        trainer2.from_arrays(x, y, x[:, :2], y)
    with pytest.raises(trainer2.DataError, match="both x_test and y_test"):
        trainer2.from_arrays(x, y, x)
    with pytest.raises(trainer2.DataError, match="finite"):
        trainer2.from_arrays(np.full_like(x, np.nan), y)


def test_runs_without_a_directory_get_fresh_names_and_a_resume_continues_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    x, y = blobs()
    data = trainer2.from_arrays(x, y)
    cfg = trainer2.config(None, **TINY)
    first, second = trainer2.train(cfg, data, log=quiet), trainer2.train(cfg, data, log=quiet)
    assert (first.run_dir.name, second.run_dir.name) == ("run-1", "run-2")
    longer = trainer2.train(cfg.model_copy(update={"max_windows": 40}), data, run_dir=first.run_dir, resume="latest")
    assert longer.summary["windows"] == 40 and longer.checkpoint.name == "step_00000040"
    straight = trainer2.train(cfg.model_copy(update={"max_windows": 40}), data, run_dir="straight", log=quiet)
    for a, b in zip(longer.model.machine.named_params().values(), straight.model.machine.named_params().values()):
        assert torch.equal(a, b)  # resumed at 30, the same as never stopped
    with pytest.raises(trainer2.CheckpointError, match="no checkpoint to resume"):
        trainer2.train(cfg, data, run_dir="empty", resume="latest")


def test_ctrl_c_in_a_script_saves_returns_and_says_how_to_continue(tmp_path):
    x, y = blobs()
    said, windows = [], []

    def interrupted_at_window_5(relax, inputs, targets):
        windows.append(None)
        if len(windows) == 5:
            signal.raise_signal(signal.SIGINT)
        return ep_gradients(relax, inputs, targets)

    run = trainer2.train(
        trainer2.config(None, **TINY),
        trainer2.from_arrays(x, y),
        run_dir=tmp_path / "r",
        gradients=interrupted_at_window_5,
        log=said.append,
    )
    assert run.summary["interrupted"] == "SIGINT" and run.summary["windows"] == 5 and run.checkpoint.is_dir()
    assert any("resume='latest'" in str(line) and str(tmp_path / "r") in str(line) for line in said)


# --- components by name ---


MY_COUPLINGS = '''
import trainer2


class WideDense(trainer2.Dense):
    """A dense layer twice as wide as its spec says: which class ran shows in the checkpoint's shapes."""

    @staticmethod
    def spec_size(spec, below=None):
        return (2 * trainer2.Dense.spec_size(spec, below)[0],)
'''


def test_a_coupling_of_the_users_own_module_trains_by_its_dotted_name(tmp_path, monkeypatch):
    (tmp_path / "my_couplings.py").write_text(MY_COUPLINGS)
    flags = [
        "--preset",
        "dev",
        "--max_windows",
        "3",
        "--eval_batches",
        "1",
        "--checkpoint_dir",
        "ck",
        "--run_name",
        "w",
    ]
    proc = subprocess.run(
        [sys.executable, str(REPO / "main.py"), *flags, "--layers", "my_couplings.WideDense:8"],
        cwd=tmp_path,  # the user's own directory, not the checkout's
        env={**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    saved = yaml.safe_load((tmp_path / "ck" / "w" / "config.yaml").read_text())
    assert saved["layers"] == [{"my_couplings.WideDense": 8}]
    meta = json.loads((tmp_path / "ck" / "w" / "step_00000003" / "meta.json").read_text())
    assert meta["config"]["layers"] == [{"my_couplings.WideDense": 8}]
    monkeypatch.syspath_prepend(str(tmp_path))  # a script in the user's directory finds the module there
    model = trainer2.load(tmp_path / "ck" / "w" / "step_00000003", trust_code=True)  # the checkpoint names its code
    assert type(model.machine.energy.couplings[0]).__name__ == "WideDense"
    assert model.machine.energy.couplings[0].weight.shape[0] == 16  # its spec_size ran: 2 x 8 units


THREE_ARGUMENT_COUPLING = '''
import trainer2

CALLS = []


class ThreeArgumentDense(trainer2.Dense):
    """Written before ep_grads took `at` (max pooling's piece): its statistic takes three arguments."""

    def ep_grads(self, plus, minus, scale):
        CALLS.append(scale)
        return trainer2.Dense.ep_grads(self, plus, minus, scale)
'''


@pytest.mark.parametrize("rule", ["ep", "rbp"])
def test_a_coupling_whose_statistic_takes_the_three_arguments_of_before_still_trains(tmp_path, monkeypatch, rule):
    """`at` goes only to a piecewise coupling (down_reads_below), so a bilinear coupling of the user's written to the
    protocol before it is still called, by EP's statistic and by recurrent backprop's, once a window."""
    module = f"old_couplings_{rule}"  # one module per case: its CALLS count that case's windows
    (tmp_path / f"{module}.py").write_text(THREE_ARGUMENT_COUPLING)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    layers = [{"dense": 8}, {f"{module}.ThreeArgumentDense": 6}]  # the second: not driven by the input
    cfg = trainer2.config("dev", layers=layers, rule=rule, max_windows=2, eval_batches=1, checkpoint_dir="ck")
    run = trainer2.train(cfg)
    assert run.summary["windows"] == 2 and len(sys.modules[module].CALLS) == 2


THREE_ARGUMENT_MAX_POOLED = '''
import trainer2


class ThreeArgumentConv(trainer2.Conv):
    """A max-pooled coupling written before ep_grads took `at`."""

    def ep_grads(self, plus, minus, scale):
        return trainer2.Conv.ep_grads(self, plus, minus, scale)


class KeywordConv(trainer2.Conv):
    """One that passes on whatever keywords it is given."""

    def ep_grads(self, plus, minus, scale, **kw):
        return trainer2.Conv.ep_grads(self, plus, minus, scale, **kw)
'''


@pytest.mark.parametrize(
    ("cls", "flags", "says"),
    [
        ("ThreeArgumentConv", {}, None),
        ("ThreeArgumentConv", {"rule": "rbp"}, "recurrent backprop"),
        ("ThreeArgumentConv", {"maxpool_argmax": "free"}, "maxpool_argmax: free"),
        ("KeywordConv", {"rule": "rbp"}, None),
    ],
)
def test_a_piecewise_coupling_without_at_is_refused_by_name_where_its_piece_is_handed_to_it(
    tmp_path, monkeypatch, cls, flags, says
):
    """Each phase at its own argmax calls the three arguments, so the default trains; recurrent backprop and the free
    equilibrium's argmax would hand `at` to a statistic that cannot take it: refused up front, naming the coupling;
    one that takes any keyword (**kw) is handed `at` and trains."""
    module = f"old_pooled_{cls}_{len(flags) and next(iter(flags))}"
    (tmp_path / f"{module}.py").write_text(THREE_ARGUMENT_MAX_POOLED)
    monkeypatch.syspath_prepend(str(tmp_path))
    rng = np.random.default_rng(1)
    y = rng.integers(0, 2, 64)
    x = rng.integers(0, 255, size=(64, 8, 8)).astype(np.uint8)
    data = trainer2.from_arrays(x[:48], y[:48], x[48:], y[48:])
    pooled = {f"{module}.{cls}": {"channels": 3, "pool": 2, "pooling": "max"}}
    layers = [{"conv": {"channels": 2, "pool": 1}}, pooled]  # the second: handed `at` where a rule reads its piece
    cfg = trainer2.config(None, **{**TINY, "layers": layers, "max_windows": 2, **flags})
    if says is None:
        assert trainer2.train(cfg, data, run_dir=tmp_path / "own", log=quiet).summary["windows"] == 2
        return
    with pytest.raises(trainer2.ConfigError, match=f"coupling {module}.{cls} is piecewise") as e:
        trainer2.train(cfg, data, run_dir=tmp_path / "refused", log=quiet)
    assert says in str(e.value) and "at: Tensor | None = None" in str(e.value)


@pytest.mark.parametrize(
    ("kind", "says"),
    [
        ("no_such_module.Dense", "no module named 'no_such_module'"),
        ("trainer2.NoSuchCoupling", "has no 'NoSuchCoupling'"),
        ("trainer2.load", "is not a coupling: it lacks"),
        ("denes", "kind in ['conv', 'conv1d', 'dense'] or a dotted path"),
    ],
)
def test_a_coupling_that_names_nothing_usable_is_one_line_naming_it(kind, says, capsys):
    assert main(["--preset", "dev", "--layers", f"{kind}:8", "--print_config"]) == 2
    err = capsys.readouterr().err
    assert says in err and kind in err and "Traceback" not in err


def test_a_data_format_is_found_by_its_reader_or_by_name(tmp_path):
    x, y = blobs(40)
    np.savez(tmp_path / "blobs.npz", x=x, y=y)
    (tmp_path / "blobs.npz").rename(tmp_path / "blobs.bin")  # no suffix to recognise it by
    cfg = trainer2.config(None, **{**TINY, "data": str(tmp_path / "blobs.bin"), "data_format": "npz"})
    data = load_data(cfg.section(DataConfig))
    assert data.kind == "features" and data.num_classes == 3
    with pytest.raises(trainer2.ConfigError, match="data format 'parquet'"):
        load_data(cfg.section(DataConfig).model_copy(update={"data_format": "parquet"}))


# --- presets ---


def test_presets_inherit_from_a_base_and_the_list_of_presets_is_the_directory(tmp_path):
    deep = yaml.safe_load((preset_dir() / "deep.yaml").read_text())
    own = ("layers", "coord_dim_n", "embed_dim", "batch_size", "max_windows", "eta_update", "weight_decay")
    assert deep["base"] == "production" and set(deep) == {"base", *own}  # says only what differs
    cfg, production = trainer2.config("deep"), trainer2.config("production")
    assert cfg.layers == [{"dense": 2048}] and cfg.coord_dim_n == 32 and cfg.embed_dim == 32
    assert cfg.weight_decay == 0.0005 and production.weight_decay == 0.0
    same = {k for k in trainer2.TrainConfig.model_fields if k not in own}
    assert {k: getattr(cfg, k) for k in same} == {k: getattr(production, k) for k in same}
    assert preset_names() == sorted(p.stem for p in preset_dir().glob("*.yaml"))
    (tmp_path / "mine.yaml").write_text("base: deep\nmax_windows: 7\n")
    layers = yaml_layers(str(tmp_path / "mine.yaml"), "config")
    assert [source.split()[0] for source, _ in layers] == ["preset", "preset", "config"]  # production, deep, mine
    assert trainer2.config(tmp_path / "mine.yaml").max_windows == 7
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(trainer2.ConfigError, match="cycle"):
        trainer2.config(tmp_path / "a.yaml")


def test_the_help_names_every_preset(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert all(name in out for name in preset_names()) and "conv" in preset_names()


# --- examples ---


@pytest.mark.parametrize("example", ["train_on_arrays.py", "custom_coupling.py"])
def test_every_example_runs(example, tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / example)],
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    accuracy = float(proc.stdout.split("held-out accuracy ")[1].split()[0])
    assert accuracy > 0.9  # well-separated blobs: a machine that learned at all gets nearly all of them


def test_the_readme_shows_the_arrays_example_as_it_is():
    readme = (REPO / "README.md").read_text()
    block = readme.split("## From Python", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    code = (REPO / "examples" / "train_on_arrays.py").read_text().split('"""', 2)[2].lstrip("\n")
    assert block == code and len(block.strip().splitlines()) <= 15


def test_the_readme_lists_every_preset_and_only_those():
    readme = (REPO / "README.md").read_text().split("## Presets", 1)[1].split("\n\n", 2)[1]
    rows = [line.split("|")[1].strip().strip("`") for line in readme.splitlines()[2:] if line.startswith("|")]
    assert sorted(rows) == preset_names()
