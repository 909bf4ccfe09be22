"""A file handed over is data, never code: a dotted component name written in a checkpoint or a YAML file is imported
only with the user's consent (--trust_code, trust_code=True, or the same name given in this call), from every entry
point; a checkpoint's integrity is checked before its config is read; built-in checkpoints need no consent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_library import MY_COUPLINGS  # a dense layer twice as wide as its spec says
from tiny import clustered

import trainer2
from trainer2.components import UntrustedCodeError, named_components
from trainer2.running.checkpoint import CheckpointError
from trainer2.running.resume import resume_command

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
FLAGS = dict(max_windows=2, eval_batches=1, eval_every_windows=0, batch_size=8, layers=[{"dense": 8}], coord_dim_n=4)


def hostile(marker: Path) -> str:
    """A module that leaves `marker` behind when it is imported (and names a class, so a name in it resolves)."""
    return f"from pathlib import Path\nPath({str(marker)!r}).write_text('imported')\n\nclass Thing:\n    pass\n"


def features(n: int = 64) -> trainer2.Dataset:
    return trainer2.from_arrays(*clustered(n), heldout_fraction=0.25)


@pytest.fixture(scope="module")
def built_in_checkpoint(tmp_path_factory) -> Path:
    """A checkpoint of a run with built-in components only (feature data: it loads without its data set)."""
    root = tmp_path_factory.mktemp("trusted")
    run = trainer2.train(trainer2.config("dev", **FLAGS), features(), run_dir=root / "ck" / "w", log=lambda m: None)
    return run.checkpoint


def planted(source: Path, dest: Path, **config: object) -> Path:
    """A copy of checkpoint `source` at `dest` whose sidecar's config names other components (a hand-edited file)."""
    dest.mkdir(parents=True)
    for f in source.iterdir():
        (dest / f.name).write_bytes(f.read_bytes())
    meta = json.loads((dest / "meta.json").read_text())
    meta["config"].update(config)
    (dest / "meta.json").write_text(json.dumps(meta))
    return dest


def cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "main.py"), *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=300
    )


def test_named_components_lists_only_code_outside_trainer2():
    values = {
        "rule": "ep",
        "cost": "my_costs.Hinge",
        "data_format": "trainer2.data.npz.NpzFile",  # a built-in's own dotted path
        "layers": [{"dense": 8}, {"evil.Coupling": 4}, {"trainer2.physics.couplings.conv.Conv": {}}],
    }
    assert named_components(values) == [("cost", "my_costs.Hinge"), ("layers[1]", "evil.Coupling")]
    assert named_components({"layers": "not a list", "rule": 3}) == []  # malformed values are validation's to refuse


@pytest.mark.parametrize(
    "field",
    ["rule", "cost", "layers", "data_format"],
)
def test_load_refuses_code_a_checkpoint_names_and_imports_nothing(built_in_checkpoint, tmp_path, monkeypatch, field):
    marker, module = tmp_path / "imported", f"evil_{field}"  # a module of its own: one imported stays in sys.modules
    (tmp_path / f"{module}.py").write_text(hostile(marker))
    monkeypatch.syspath_prepend(str(tmp_path))  # importable: only the trust boundary stands between it and the import
    value = [{f"{module}.Thing": 8}] if field == "layers" else f"{module}.Thing"
    path = planted(built_in_checkpoint, tmp_path / "ck" / "w" / built_in_checkpoint.name, **{field: value})
    with pytest.raises(UntrustedCodeError) as e:
        trainer2.load(path)
    assert isinstance(e.value, trainer2.ComponentError)
    assert module in str(e.value) and "trust_code=True" in str(e.value) and "--trust_code" in str(e.value)
    assert not marker.exists()
    if field == "data_format":  # a model loaded to predict reads no data, so with consent its reader is not needed
        assert trainer2.load(path, trust_code=True).window == 2
        return
    with pytest.raises(CheckpointError, match="is not a"):  # with consent it is imported, then found no component
        trainer2.load(path, trust_code=True)
    assert marker.exists()


def test_a_checkpoints_integrity_is_checked_before_its_config_is_read(built_in_checkpoint, tmp_path, monkeypatch):
    marker = tmp_path / "imported"
    (tmp_path / "evil_corrupt.py").write_text(hostile(marker))
    monkeypatch.syspath_prepend(str(tmp_path))
    path = planted(built_in_checkpoint, tmp_path / "ck" / "w" / built_in_checkpoint.name, rule="evil_corrupt.Thing")
    tensors = path / "tensors.safetensors"
    data = bytearray(tensors.read_bytes())
    data[-1] ^= 0xFF
    tensors.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="sha256"):
        trainer2.load(path, trust_code=True)  # even with consent: a corrupt checkpoint's config is never used
    assert not marker.exists()


def test_every_command_refuses_a_checkpoint_naming_code_and_imports_nothing(built_in_checkpoint, tmp_path):
    """evaluate, sample, --resume and --print_config --resume, run from the directory holding the module (which the
    command line no longer puts on the Python path for a checkpoint), and a module carried inside the checkpoint's own
    folder (a namespace package)."""
    marker = tmp_path / "imported"
    (tmp_path / "evil_mod.py").write_text(hostile(marker))
    path = planted(built_in_checkpoint, tmp_path / "ck" / "w" / built_in_checkpoint.name, rule="evil_mod.Thing")
    carried = planted(
        built_in_checkpoint,
        tmp_path / "ck2" / "w" / built_in_checkpoint.name,
        data_format=f"ck2.w.{built_in_checkpoint.name}.pkg.evil.Thing",
    )
    (carried / "pkg").mkdir()
    (carried / "pkg" / "evil.py").write_text(hostile(marker))
    rel, rel2 = str(path.relative_to(tmp_path)), str(carried.relative_to(tmp_path))
    for args in (
        ["evaluate", "--checkpoint", rel],
        ["sample", "--checkpoint", rel],
        ["--resume", rel, "--max_windows", "3"],
        ["--resume", rel, "--print_config"],
        ["evaluate", "--checkpoint", rel2],
        ["--resume", rel2, "--run_name", "branch", "--max_windows", "3"],
    ):
        proc = cli(args, tmp_path)
        assert proc.returncode == 2, (args, proc.stderr)
        assert "Traceback" not in proc.stderr, proc.stderr
        assert "--trust_code" in proc.stderr and "not importing code" in proc.stderr, proc.stderr
        assert not marker.exists(), args
    assert not (tmp_path / "ck" / "branch").exists()
    proc = cli(["evaluate", "--checkpoint", rel, "--trust_code"], tmp_path)  # consent: the working directory's module
    assert proc.returncode == 2 and "is not a rule" in proc.stderr, proc.stderr
    assert marker.exists()


def test_a_yaml_file_naming_code_needs_consent(tmp_path, monkeypatch):
    marker = tmp_path / "imported"
    (tmp_path / "evil_yaml.py").write_text(hostile(marker))
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "shared.yaml").write_text(yaml.safe_dump({"base": "dev", "layers": [{"evil_yaml.Thing": 8}]}))
    (tmp_path / "child.yaml").write_text(yaml.safe_dump({"base": "shared.yaml", "max_windows": 5}))
    for name in ("shared.yaml", "child.yaml"):  # in the file itself, or in a base: it names
        with pytest.raises(UntrustedCodeError, match="evil_yaml"):
            trainer2.config(str(tmp_path / name))
    proc = cli(["--config", "shared.yaml", "--print_config"], tmp_path)
    assert proc.returncode == 2 and "--trust_code" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not marker.exists()
    with pytest.raises(trainer2.ConfigError, match="is not a coupling"):
        trainer2.config(str(tmp_path / "child.yaml"), trust_code=True)
    assert marker.exists()


def test_the_users_own_coupling_runs_and_resumes_with_its_name_or_consent(tmp_path, monkeypatch):
    """Named on the command line it runs as before; its resume command carries --trust_code (this user's own code),
    and a resume naming the same coupling again needs no flag."""
    (tmp_path / "my_couplings.py").write_text(MY_COUPLINGS)
    base = ["--eval_batches", "1", "--checkpoint_dir", "ck", "--run_name", "w", "--coord_dim_n", "4"]
    proc = cli(["--preset", "dev", *base, "--max_windows", "2", "--layers", "my_couplings.WideDense:8"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    monkeypatch.syspath_prepend(str(tmp_path))  # a script in the user's directory finds the module there
    model = trainer2.load(tmp_path / "ck" / "w" / "step_00000002", trust_code=True)
    assert type(model.machine.energy.couplings[0]).__name__ == "WideDense"
    assert resume_command(model.cfg).endswith("--trust_code")  # what an interrupted run prints and saves
    proc = cli([*base, "--resume", "latest", "--max_windows", "3"], tmp_path)
    assert proc.returncode == 2 and "my_couplings.WideDense" in proc.stderr and "--trust_code" in proc.stderr
    proc = cli([*base, "--resume", "latest", "--max_windows", "3", "--trust_code"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    proc = cli([*base, "--resume", "latest", "--max_windows", "4", "--layers", "my_couplings.WideDense:8"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "ck" / "w" / "step_00000004").is_dir()


def test_built_in_checkpoints_and_yaml_need_no_consent(built_in_checkpoint):
    model = trainer2.load(built_in_checkpoint)
    assert model.window == 2
    assert "--trust_code" not in resume_command(model.cfg)
    with pytest.raises(trainer2.ConfigError, match="trust_code"):
        trainer2.load(built_in_checkpoint, trust_code="yes")


def test_load_blames_an_unknown_keyword_not_the_checkpoint(built_in_checkpoint):
    with pytest.raises(trainer2.ConfigError, match="bogus_field") as e:
        trainer2.load(built_in_checkpoint, bogus_field=1)
    assert not isinstance(e.value, CheckpointError)
