"""--window_backend: auto keeps torch on the CPU, asking for triton where it cannot run is one clear message (no
traceback), and old checkpoints still resume (the field is free on resume). Needs no triton."""

from __future__ import annotations

import importlib.util

import pytest
from tiny import tiny_config, tiny_machine

from trainer2.cli import main
from trainer2.learning.step import build_step
from trainer2.physics.dynamics import Integrator, fixed_point_steps, leapfrog_steps
from trainer2.physics.kernels import backend
from trainer2.physics.relaxation import Relaxation
from trainer2.section import ConfigError

FIXED = Integrator(1.0, 1.0, 1.0)
CPU = backend.torch.device("cpu")


def relax(**overrides) -> Relaxation:
    cfg = tiny_config(**overrides)
    return Relaxation(tiny_machine(cfg), cfg, cfg.batch_size)


def test_auto_and_torch_take_the_torch_window_on_the_cpu():
    for requested in ("auto", "torch"):
        r = relax(window_backend=requested)
        assert r.backend.name == "torch" and r.steps_fn is fixed_point_steps
    r = relax(dt=0.5)
    assert r.backend.name == "torch" and r.steps_fn is leapfrog_steps and "fixed-point" in r.backend.reason


@pytest.mark.parametrize(
    "overrides,reason",
    [
        (dict(dt=0.5), "fixed-point iteration only"),
        (dict(hidden_sizes=[2000]), "2000 hidden units (at most 1024)"),
        (dict(hidden_sizes=[4, 4, 4, 4]), "1 to 3 hidden layers"),
    ],
)
def test_triton_where_it_cannot_run_is_a_config_error_naming_the_reason(overrides, reason):
    with pytest.raises(ConfigError, match="window_backend: triton cannot run here") as e:
        relax(window_backend="triton", **overrides)
    assert reason in str(e.value)


def test_triton_on_the_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    reason = backend.triton_blocker(
        backend.torch.device("cpu"), backend.torch.float64, FIXED, [12, 4], 7, ["dense", "dense"]
    )
    assert "CUDA device" in reason and "TRITON_INTERPRET=1" in reason


def test_triton_missing_is_named(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        backend.importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a)
    )
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    reason = backend.triton_blocker(
        backend.torch.device("cpu"), backend.torch.float64, FIXED, [12, 4], 7, ["dense", "dense"]
    )
    assert reason == "triton is not installed (pip install -e '.[kernels]')"
    cuda = backend.choose_backend(
        "auto", backend.torch.device("cuda"), backend.torch.float32, FIXED, [12, 4], 7, ["dense", "dense"]
    )
    assert cuda.name == "torch" and "not installed" in cuda.reason


def test_the_cli_prints_one_line_not_a_traceback(tmp_path, small_text, capsys):
    code = main(
        [
            "--data",
            str(small_text),
            "--checkpoint_dir",
            str(tmp_path),
            "--device",
            "cpu",
            "--max_windows",
            "1",
            "--hidden_sizes",
            "8",
            "--batch_size",
            "4",
            "--window_backend",
            "triton",
            "--dt",
            "0.5",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "window_backend: triton cannot run here" in err and "Traceback" not in err


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed (pip install -e '.[kernels]')"
)
def test_auto_takes_triton_on_cuda_only_where_the_layers_fit_in_registers(monkeypatch):
    """No CUDA tensor is made: the choice only reads the device type, the shapes and whether triton imports."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cuda = backend.torch.device("cuda")
    default = backend.choose_backend("auto", cuda, backend.torch.float32, FIXED, [256, 16], 16, ["dense", "dense"])
    assert default.name == "triton" and "the shapes fit" in default.reason  # measured faster on a GPU
    monkeypatch.setattr(backend, "AUTO_TAKES_TRITON", False)
    off = backend.choose_backend("auto", cuda, backend.torch.float32, FIXED, [256, 16], 16, ["dense", "dense"])
    assert off.name == "torch" and "AUTO_TAKES_TRITON is off" in off.reason
    deep = backend.choose_backend("auto", cuda, backend.torch.float32, FIXED, [1024, 32], 100, ["dense", "dense"])
    assert deep.name == "torch" and "1024 hidden units (at most 256)" in deep.reason and "runs it anyway" in deep.reason
    assert (
        backend.choose_backend("triton", cuda, backend.torch.float32, FIXED, [1024, 32], 100, ["dense", "dense"]).name
        == "triton"
    )


# --- --update_backend: the fused update's choice follows the same rules ---


def test_the_update_backend_is_torch_on_the_cpu_unless_triton_is_asked_for(monkeypatch):
    cfg = tiny_config()
    for requested in ("auto", "torch"):
        upd = cfg.model_copy(update={"update_backend": requested})
        step = build_step(tiny_machine(cfg), cfg, upd, cfg.batch_size)
        assert step.updater.backend.name == "torch" and step.updater.fused is None
    assert backend.choose_update_backend("auto", CPU, backend.torch.float64).reason.startswith("auto: the ")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="update_backend: triton cannot run here: the device is cpu"):
        build_step(tiny_machine(cfg), cfg, cfg.model_copy(update={"update_backend": "triton"}), cfg.batch_size)


def test_the_update_backend_names_a_missing_triton(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        backend.importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a)
    )
    cuda = backend.choose_update_backend("auto", backend.torch.device("cuda"), backend.torch.float32)
    assert cuda.name == "torch" and "triton is not installed" in cuda.reason
    with pytest.raises(ConfigError, match="triton is not installed"):
        backend.choose_update_backend("triton", backend.torch.device("cuda"), backend.torch.float32)


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed (pip install -e '.[kernels]')"
)
def test_auto_takes_the_fused_update_on_cuda_unless_switched_off(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cuda = backend.torch.device("cuda")
    assert backend.choose_update_backend("auto", cuda, backend.torch.float32).name == "triton"
    monkeypatch.setattr(backend, "AUTO_TAKES_TRITON_UPDATE", False)
    off = backend.choose_update_backend("auto", cuda, backend.torch.float32)
    assert off.name == "torch" and "AUTO_TAKES_TRITON_UPDATE is off" in off.reason
    assert backend.choose_update_backend("torch", cuda, backend.torch.float32).name == "torch"


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed (pip install -e '.[kernels]')"
)
def test_auto_takes_the_readout_kernel_on_cuda_where_it_fits_unless_switched_off(monkeypatch):
    """No CUDA tensor is made: the choice reads only `like`'s device, dtype and item size."""
    from types import SimpleNamespace

    from trainer2.physics.costs.retrieval import Retrieval

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    like = SimpleNamespace(device=backend.torch.device("cuda"), dtype=backend.torch.float32, element_size=lambda: 4)
    dev = (128, 16, 100, 100)  # the dev preset's batch, coordinates and one-hot candidates
    taken = backend.choose_readout_backend("auto", like, Retrieval, dev)
    assert taken.name == "triton" and "the readout fits" in taken.reason  # measured faster on an H200
    past = backend.choose_readout_backend("auto", like, Retrieval, (128, 16, 1024, 100))
    assert past.name == "torch" and "1024 candidates x 16 coordinates" in past.reason
    monkeypatch.setattr(backend, "AUTO_TAKES_TRITON_READOUT", False)
    off = backend.choose_readout_backend("auto", like, Retrieval, dev)
    assert off.name == "torch" and "AUTO_TAKES_TRITON_READOUT is off" in off.reason


def test_the_cli_refuses_the_fused_update_in_one_line(tmp_path, small_text, capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    argv = ["--data", str(small_text), "--checkpoint_dir", str(tmp_path), "--device", "cpu", "--max_windows", "1"]
    code = main([*argv, "--hidden_sizes", "8", "--batch_size", "4", "--update_backend", "triton"])
    err = capsys.readouterr().err
    assert code == 2 and "update_backend: triton cannot run here: the device is cpu" in err and "Traceback" not in err


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed (pip install -e '.[kernels]')"
)
def test_tiles_past_the_gpus_shared_memory_are_refused_naming_the_sizes(monkeypatch):
    """The deep preset's 1024 x 32 float32 pair asked an H200 for 234 KiB of its 227 (measured): refused, while the
    dev preset's 256 x 16 fits; float64 doubles the need. No CUDA tensor is made: the limit is faked."""
    monkeypatch.setattr(backend, "runtime_blocker", lambda device: None)
    monkeypatch.setattr(backend, "shared_memory_limit", lambda device: 232448)
    cuda, f32 = backend.torch.device("cuda"), backend.torch.float32
    need, pair = backend.shared_memory_need([1024, 32], 100, 4)
    assert pair == (1024, 32) and 239616 <= need
    deep = backend.choose_backend("auto", cuda, f32, FIXED, [1024, 32], 100, ["dense", "dense"])
    assert deep.name == "torch" and "1024 x 32 float32 coupling needs about 240 KiB" in deep.reason
    with pytest.raises(ConfigError, match="this GPU has 227 KiB"):
        backend.choose_backend("triton", cuda, f32, FIXED, [1024, 32], 100, ["dense", "dense"])
    assert backend.choose_backend("auto", cuda, f32, FIXED, [256, 16], 16, ["dense", "dense"]).name == "triton"
    assert backend.choose_backend("triton", cuda, f32, FIXED, [512, 32], 100, ["dense", "dense"]).name == "triton"
    with pytest.raises(ConfigError, match="512 x 32 float64"):
        backend.choose_backend("triton", cuda, backend.torch.float64, FIXED, [512, 32], 100, ["dense", "dense"])
    monkeypatch.setattr(backend, "shared_memory_limit", lambda device: None)  # the CPU: nothing to check against
    assert backend.choose_backend("triton", cuda, f32, FIXED, [1024, 32], 100, ["dense", "dense"]).name == "triton"


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed (pip install -e '.[kernels]')"
)
def test_the_interpreter_is_never_taken_for_a_gpus_tensors(monkeypatch):
    """TRITON_INTERPRET=1 (the CPU suite's setting) on a CUDA device would interpret the kernels on host copies: auto
    keeps torch, and asking for triton names the variable."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cuda = backend.torch.device("cuda")
    auto = backend.choose_backend("auto", cuda, backend.torch.float32, FIXED, [256, 16], 16, ["dense", "dense"])
    assert auto.name == "torch" and "TRITON_INTERPRET=1 is set" in auto.reason
    assert backend.choose_update_backend("auto", cuda, backend.torch.float32).name == "torch"
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1 is set"):
        backend.choose_update_backend("triton", cuda, backend.torch.float32)
