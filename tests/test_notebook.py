"""trainer2.train from Python and in a notebook: quiet by default (a one-line start, warnings and a one-line result),
everything with log="verbose", today's lines for a function; the progress bar a widget in a notebook kernel."""

from __future__ import annotations

import json
import re
import signal
import sys
from pathlib import Path

import numpy as np
import pytest

import trainer2
from trainer2.io.console import RunLog
from trainer2.learning.gradients import ep_gradients

SETTINGS = dict(max_windows=3, eval_every_windows=0, batch_size=16, layers=[{"dense": 8}], coord_dim_n=4)
BAR = re.compile(r"\d+/\d+ \[")  # a text bar's count and clock, "3/3 [00:01<00:00"; the result line has neither
# The cell a notebook user writes; trainer2.config's "dev" preset at the sizes above.
CELL = f"""
import numpy as np
import trainer2
rng = np.random.default_rng(0)
x, y = rng.normal(size=(64, 6)).astype("float32"), rng.integers(0, 3, 64)
cfg = trainer2.config("dev", **{SETTINGS!r})
run = trainer2.train(cfg, trainer2.from_arrays(x[:48], y[:48], x[48:], y[48:]), run_dir="runs/a")
"""


def tiny_data() -> trainer2.Dataset:
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 6)).astype("float32"), rng.integers(0, 3, 64)
    return trainer2.from_arrays(x[:48], y[:48], x[48:], y[48:])


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def test_train_says_a_start_and_a_result_line_by_default_and_the_config_when_verbose(tmp_path, capsys):
    run = trainer2.train(trainer2.config("dev", **SETTINGS), tiny_data(), run_dir=tmp_path / "a")
    out = lines(capsys.readouterr().out)
    assert out == [f"training {tmp_path / 'a'}: 3 windows on cpu", out[1]], out
    assert out[1].startswith("done: 3 windows, 48 examples") and run.summary["windows"] == 3
    trainer2.train(trainer2.config("dev", **SETTINGS), tiny_data(), run_dir=tmp_path / "b", log="verbose")
    out = capsys.readouterr().out
    assert "config:\nrun_name: b\n" in out and "window backend: torch" in out and "checkpoint: " in out
    assert f"training {tmp_path / 'b'}: 3 windows on cpu" in out and "\ndone: 3 windows" in out


def test_a_quiet_run_still_says_its_warnings_and_a_resumed_one_where_it_starts(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("trainer2.running.threads.usable_cores", lambda: 0)  # cpu_threads 1 oversubscribes: a warning
    trainer2.train(trainer2.config("dev", **SETTINGS), tiny_data(), run_dir=tmp_path / "a")
    out = lines(capsys.readouterr().out)
    assert len(out) == 3 and out[0].startswith("warning: cpu_threads 1 is more than the 0 core(s)"), out
    monkeypatch.undo()
    cfg = trainer2.config("dev", **{**SETTINGS, "max_windows": 5})
    trainer2.train(cfg, tiny_data(), run_dir=tmp_path / "a", resume="latest")
    out = lines(capsys.readouterr().out)
    assert out[0] == f"training {tmp_path / 'a'}: windows 4 to 5 on cpu (resumed at window 3)" and len(out) == 2, out


def test_a_quiet_run_stopped_by_ctrl_c_says_how_to_continue_in_place_of_its_result(tmp_path, capsys):
    windows = []

    def interrupted_at_window_2(relax, inputs, targets):
        windows.append(None)
        if len(windows) == 2:
            signal.raise_signal(signal.SIGINT)
        return ep_gradients(relax, inputs, targets)

    cfg = trainer2.config("dev", **SETTINGS)
    run = trainer2.train(cfg, tiny_data(), run_dir=tmp_path / "a", gradients=interrupted_at_window_2)
    out = lines(capsys.readouterr().out)
    assert run.summary["interrupted"] == "SIGINT" and len(out) == 2, out
    assert out[1].startswith("stopped by SIGINT after window 2; continue with trainer2.train(")
    assert out[1].endswith("resume='latest')")


def test_a_function_as_log_gets_every_line_but_the_start_and_result_as_the_command_line_does(tmp_path, capsys):
    said: list[str] = []
    trainer2.train(trainer2.config("dev", **SETTINGS), tiny_data(), run_dir=tmp_path / "a", log=said.append)
    assert capsys.readouterr().out == ""
    assert said[0].startswith("config:\n") and any(s.startswith("checkpoint: ") for s in said)
    assert not any(s.startswith(("training ", "done: ")) for s in said)


def test_a_log_that_is_neither_a_level_nor_a_function_is_refused_before_anything_is_made(tmp_path):
    for bad in ("loud", None, 3):
        with pytest.raises(ValueError, match="log must be 'quiet', 'verbose' or a function"):
            trainer2.train(trainer2.config("dev", **SETTINGS), tiny_data(), run_dir=tmp_path / "a", log=bad)
    assert not (tmp_path / "a").exists()
    assert RunLog.of(print) == RunLog(print, None)  # a function keeps every line, the start and result are its own


def test_a_train_cell_in_a_notebook_prints_a_few_lines_and_a_widget_bar(tmp_path, monkeypatch):
    """The cell run by a real ipykernel (this interpreter's, by a kernel spec of its own, so no other installed
    "python3" kernel is picked up): at most 5 lines besides the bar, and with ipywidgets the bar is a widget."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    spec = tmp_path / "jupyter" / "kernels" / "trainer2-test"
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "trainer2 test", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(spec.parent.parent))
    monkeypatch.delenv("TQDM_DISABLE", raising=False)  # the bar shows, as for a notebook user
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(CELL)])
    client = nbclient.NotebookClient(
        notebook,
        kernel_name="trainer2-test",
        timeout=120,
        startup_timeout=120,
        resources={"metadata": {"path": str(tmp_path)}},  # the kernel's working directory: runs/a goes there
    )
    client.execute()  # starts the kernel and shuts it down when the cell is done (or has failed: it raises then)
    outputs = notebook.cells[0].outputs
    text = "".join(o["text"] for o in outputs if o["output_type"] == "stream")
    said = [line for line in lines(text.replace("\r", "\n")) if not BAR.search(line)]
    assert len(said) <= 5, said
    assert any(line.startswith("training ") for line in said) and any(line.startswith("done: ") for line in said)
    assert (tmp_path / "runs" / "a" / "summary.json").is_file()
    widgets = [o for o in outputs if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    if has_ipywidgets():
        assert widgets and not BAR.search(text), outputs  # the widget, no text bar beside it
    else:
        assert BAR.search(text), outputs  # tqdm.auto falls back to text


def has_ipywidgets() -> bool:
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True


def test_the_dev_extra_installs_what_the_notebook_test_runs():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 and later
    dev = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    names = {re.split(r"[<>=!~\[ ]", d)[0] for d in dev["project"]["optional-dependencies"]["dev"]}
    assert {"nbclient", "nbformat", "ipykernel", "ipywidgets"} <= names
