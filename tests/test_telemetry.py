"""Observability: telemetry.jsonl, phase timing and the profiler trace, cache cleanup, step progress, plots."""

from __future__ import annotations

import io
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tiny import tiny_batch, tiny_config, tiny_machine
from tqdm import std as tqdm_std
from tqdm import tqdm

from trainer2.callbacks import LoopState
from trainer2.cli import main
from trainer2.learning.step import build_step
from trainer2.monitor.monitor import CacheCleaner, Monitor, should_cleanup
from trainer2.monitor.profiling import PHASES, PhaseTimer, drop_kineto_markers
from trainer2.monitor.progress import ProgressBar
from trainer2.monitor.telemetry import Telemetry, TelemetryError, read_telemetry
from trainer2.presets import read_yaml, yaml_layers
from trainer2.running.trainer import Trainer
from trainer2.train_config import ConfigError, build_config

ROOT = Path(__file__).resolve().parent.parent
ROW_KEYS = {
    "window",
    "epoch",
    "examples",
    "train_loss",
    "train_bpc",
    "lior_mean",
    "R_mean",
    "spd_mean",
    "spd_last",
    "spd_last_nudge",
    "lior_diff",
    "update_norm_energy",
    "update_norm_readout",
    "update_norm_embed",
    "dropped",
    "dropped_total",
    "lr",
    "windows_per_second",
    "mem_allocated_mib",
    "mem_reserved_mib",
    "cache_cleanups",
}
HELDOUT_KEYS = {"heldout_loss", "heldout_bpc", "heldout_acc"}


def run_flags(data: Path, ck: Path, **over) -> dict:
    """A tiny, fast text run on the CPU, also where a GPU is present (float64 not needed: these tests check records,
    not numerics)."""
    flags = dict(
        data=str(data),
        checkpoint_dir=str(ck),
        run_name="t",
        device="cpu",
        hidden_sizes=[8],
        coord_dim_n=4,
        rotor_k=3,
        context_len=3,
        embed_dim=3,
        batch_size=8,
        free_steps=6,
        nudge_steps=3,
        max_windows=6,
        log_every_windows=2,
        eval_every_windows=4,
        eval_batches=1,
    )
    flags.update(over)
    return flags


def test_telemetry_has_one_json_line_per_interval_with_the_keys(small_text, tmp_path):
    cfg = build_config([("test", run_flags(small_text, tmp_path, timing_debug=True))])
    trainer = Trainer(cfg, log=lambda s: None)
    trainer.train()
    run_dir = tmp_path / "t"
    lines = (run_dir / "telemetry.jsonl").read_text().split("\n")
    assert lines[-1] == "" and len(lines) == 4  # three intervals, each a whole line
    rows = [json.loads(line) for line in lines[:-1]]
    assert [r["window"] for r in rows] == [2, 4, 6]
    assert [r["examples"] for r in rows] == [16, 32, 48]
    assert all(type(r["window"]) is int and type(r["examples"]) is int for r in rows)  # counts, not floats
    for r in rows:
        assert ROW_KEYS <= r.keys(), ROW_KEYS - r.keys()
        assert {f"time_{p}_ms" for p in PHASES} <= r.keys()
        assert all(r[f"time_{p}_ms"] > 0 for p in ("data", "free", "nudged", "update"))
        assert r["lior_diff"] == pytest.approx(r["lior_nudge"] - r["lior_mean"])
        assert r["train_bpc"] == pytest.approx(r["train_loss"] / math.log(2))
        assert r["lr"] == pytest.approx(cfg.eta_update) and r["windows_per_second"] > 0
        assert r["mem_allocated_mib"] is None and r["cache_cleanups"] == 0  # CPU: no CUDA allocator
    assert [HELDOUT_KEYS <= r.keys() for r in rows] == [False, True, True]  # eval at 4 and at the end
    assert rows == json.loads(json.dumps(trainer.history))  # the file is the run's history
    # config.yaml is the resolved config and rebuilds it exactly
    assert build_config([("saved", read_yaml(run_dir / "config.yaml"))]) == cfg


def test_a_log_interval_reads_the_device_once(small_text, tmp_path, monkeypatch):
    cfg = build_config([("test", run_flags(small_text, tmp_path, timing_debug=True))])
    trainer = Trainer(cfg, log=lambda s: None)
    state = LoopState(0, 2)
    trainer.monitor.bar.on_start(state)
    trainer.monitor.on_start(state)
    for _ in range(2):
        trainer.batch_step.step(*trainer.next_batch())
        trainer.progress.window += 1
    reads = []
    for name in ("tolist", "item", "__float__", "__int__", "__bool__", "numpy"):
        orig = getattr(torch.Tensor, name)
        monkeypatch.setattr(
            torch.Tensor, name, lambda self, *a, _o=orig, _n=name, **k: (reads.append(_n), _o(self, *a, **k))[1]
        )
    row = trainer.sync_metrics()
    trainer.monitor.on_log(state, row)
    monkeypatch.undo()
    trainer.monitor.on_end(state)
    assert reads == ["tolist"]
    assert row["window"] == 2 and row["dropped_total"] == 0.0 and row["lr"] == pytest.approx(cfg.eta_update)


def test_a_killed_run_leaves_only_whole_lines(small_text, tmp_path):
    flags = run_flags(small_text, tmp_path, max_windows=100000, log_every_windows=1, eval_every_windows=0)
    argv = [sys.executable, str(ROOT / "main.py")]
    for k, v in flags.items():
        argv += [f"--{k}", *map(str, v if isinstance(v, list) else [v])]
    path = tmp_path / "t" / "telemetry.jsonl"
    proc = subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    try:
        deadline = time.monotonic() + 120
        while not (path.exists() and path.read_text().count("\n") >= 5):
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "the run wrote no telemetry"
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stderr.close()
    text = path.read_text()
    assert text.endswith("\n")
    windows = [json.loads(line)["window"] for line in text.splitlines()]
    assert windows == list(range(1, len(windows) + 1))


def test_an_evaluation_off_the_log_cadence_still_runs_and_gets_its_row(small_text, tmp_path):
    # eval every 3 windows, log every 2: windows 3 and 6 are evaluated (3 was skipped silently once: no row to carry it)
    cfg = build_config([("test", run_flags(small_text, tmp_path, max_windows=7, eval_every_windows=3))])
    Trainer(cfg, log=lambda s: None).train()
    rows = [json.loads(line) for line in (tmp_path / "t" / "telemetry.jsonl").read_text().splitlines()]
    assert [r["window"] for r in rows] == [2, 3, 4, 6, 7]
    assert [r["window"] for r in rows if "heldout_bpc" in r] == [3, 6, 7]


def test_telemetry_appends_and_stores_non_finite_values_as_null(tmp_path):
    cfg = tiny_config()
    t = Telemetry(tmp_path, cfg)
    t.write({"window": 1, "train_loss": float("nan"), "lr": float("inf")})
    t.close()
    t = Telemetry(tmp_path, cfg)  # a resumed run continues the file
    t.write({"window": 2, "train_loss": 1.5, "lr": 0.1})
    t.close()
    rows = read_telemetry(tmp_path / "telemetry.jsonl")
    assert rows == [{"window": 1, "train_loss": None, "lr": None}, {"window": 2, "train_loss": 1.5, "lr": 0.1}]


def test_read_telemetry_skips_a_torn_last_line_and_refuses_a_bad_one(tmp_path):
    path = tmp_path / "telemetry.jsonl"
    path.write_text('{"window": 1}\n{"window": 2}\n{"wind')
    assert read_telemetry(path) == [{"window": 1}, {"window": 2}]
    path.write_text('{"window": 1}\nnot json\n')
    with pytest.raises(TelemetryError, match="line 2 is not valid JSON"):
        read_telemetry(path)
    with pytest.raises(TelemetryError, match="no such file"):
        read_telemetry(tmp_path / "missing.jsonl")


def test_profiling_preset_writes_a_trace_that_names_every_phase(small_text, tmp_path, capfd):
    preset = yaml_layers("profiling")
    assert preset[-1][1]["timing_debug"] and preset[-1][1]["profile_windows"] > 0
    over = run_flags(small_text, tmp_path, run_name="profiling", max_windows=9, log_every_windows=4, profile_windows=4)
    cfg = build_config([*preset, ("test", over)])
    Trainer(cfg, log=lambda s: None).train()
    run_dir = tmp_path / "profiling"
    trace = json.loads((run_dir / "profile_trace.json").read_text())
    names = {e.get("name") for e in (trace["traceEvents"] if isinstance(trace, dict) else trace)}
    assert {f"phase/{p}" for p in PHASES} <= names
    top = (run_dir / "profile_top_ops.txt").read_text()
    assert "top operators by self CPU time" in top and "aten::" in top
    out, err = capfd.readouterr()
    assert out.count("timing @ window") == 3  # windows 4, 8 and the end (9)
    assert out.count("residual at the last step, spd / sqrt(eps): free ") == 3 and "x, nudged " in out
    assert all(p in out for p in PHASES)
    assert "USDT" not in err and "profiler_start" not in err  # the profiler backend's start/stop markers


def test_kineto_markers_are_dropped_and_every_other_stderr_line_is_kept(capfd):
    with drop_kineto_markers():
        os.write(
            2, b"USDT:2026-01-01 00:00:00 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\nkept: a warning\n"
        )
        os.write(2, b"USDT:2026-01-01 00:00:00 1:1 SyncActivityProfilerHandler.cpp:59] profiler_stop\nkept: another\n")
    assert capfd.readouterr().err == "kept: a warning\nkept: another\n"


@pytest.mark.parametrize(
    ("allocated", "reserved", "fires"), [(95, 100, True), (90, 100, False), (50, 100, False), (0, 0, False)]
)
def test_cleanup_rule_fires_only_above_the_threshold(allocated, reserved, fires):
    assert should_cleanup(allocated, reserved, 0.9) is fires


def test_cache_cleaner_checks_every_n_windows_and_counts():
    stats = iter([(95, 100), (50, 100), (99, 100)])
    emptied = []
    cleaner = CacheCleaner(every=3, threshold=0.9, stats=lambda: next(stats), empty=lambda: emptied.append(1))
    fired = [cleaner.after_window(w) for w in range(1, 10)]
    assert fired == [False, False, True, False, False, False, False, False, True]  # 95% at 3, 50% at 6, 99% at 9
    assert cleaner.fired == len(emptied) == 2
    assert CacheCleaner.for_device(tiny_config(), torch.device("cpu")) is None


def test_cleanup_threshold_outside_0_1_is_refused():
    with pytest.raises(ConfigError, match="cleanup_threshold"):
        build_config([("command line", {"cleanup_threshold": 1.5})])


@pytest.mark.parametrize("relaxation", ["jacobi", "even_odd"])
def test_step_progress_and_phase_timing_leave_the_result_unchanged(relaxation):
    cfg = tiny_config(free_steps=8, nudge_steps=4, relaxation=relaxation)
    plain, watched = tiny_machine(cfg), tiny_machine(cfg)
    calls, timer = [], PhaseTimer(torch.device("cpu"), timing=True)
    a, b = build_step(plain, cfg, cfg, cfg.batch_size), build_step(watched, cfg, cfg, cfg.batch_size)
    b.relax.phase, b.relax.progress_every, b.relax.on_steps = timer.phase, 3, lambda *args: calls.append(args)
    with torch.no_grad():
        for seed in (1, 2):
            batch = tiny_batch(cfg, seed=seed)
            a.step(*batch)
            b.step(*batch)
    for (name, p), q in zip(plain.named_params().items(), watched.named_params().values()):
        assert torch.equal(p, q), name
    assert torch.equal(a.updater.metrics.values, b.updater.metrics.values)
    one = [c[:3] for c in calls[: len(calls) // 2]]
    assert one == [("free", 3, 8), ("free", 6, 8), ("free", 8, 8)] + [
        ("nudged", 3, 4),
        ("nudged", 4, 4),
    ]  # +-beta stacked: one window
    assert all(math.isfinite(c[3]) and c[4] >= 0 for c in calls)
    times = timer.collect(2)
    assert all(times[f"time_{p}_ms"] > 0 for p in ("free", "nudged", "update"))


def test_a_step_that_is_not_eager_is_timed_whole_and_reports_progress_at_window_boundaries(tmp_path):
    cfg = tiny_config(step_progress_every=4, timing_debug=True, free_steps=8, nudge_steps=4)
    step = build_step(tiny_machine(cfg), cfg, cfg, cfg.batch_size)
    said = []
    mon = Monitor(cfg, torch.device("cpu"), tmp_path, False, step.relax, ProgressBar("run", True), log=said.append)
    mon.attach(
        step.relax, tqdm(disable=False, file=io.StringIO()), "run"
    )  # as with CUDA graphs or torch.compile: nothing may run inside the step
    assert step.relax.on_steps is None and step.relax.phase != mon.timer.phase
    assert len(said) == 1 and "window boundaries" in said[0]
    with torch.no_grad(), mon.step_phase():
        step.step(*tiny_batch(cfg))
    times = mon.timer.collect(1)
    assert list(times) == ["time_step_ms"] and times["time_step_ms"] > 0


def test_progress_bar_in_a_pipe_does_not_flood(small_text, tmp_path, capsys, monkeypatch):
    bars = []

    class Spy(tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "disable": False})  # a bar that shows, whatever TQDM_DISABLE says
            bars.append(self)

    monkeypatch.setattr("trainer2.monitor.progress.tqdm", Spy)
    cfg = build_config(
        [
            (
                "test",
                run_flags(
                    small_text,
                    tmp_path,
                    max_windows=40,
                    log_every_windows=1,
                    eval_every_windows=0,
                    step_progress_every=2,
                ),
            )
        ]
    )
    Trainer(cfg, log=lambda s: None).train()
    err = capsys.readouterr().err  # pytest's capture is not a TTY
    assert bars[0].mininterval >= 30  # step progress refreshes no more often than this either
    assert err.count("\r") + err.count("\n") <= 4, err


def test_the_compile_is_kept_out_of_the_progress_bars_rate_and_eta(small_text, tmp_path, monkeypatch):
    clock = [1000.0]  # the bar's clock, advanced only by the step below
    monkeypatch.setattr(tqdm_std, "time", lambda: clock[0])
    bars = []

    class Spy(tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "disable": False, "file": io.StringIO()})
            bars.append(self)

        def close(self):
            self.last = dict(self.format_dict)
            super().close()

    monkeypatch.setattr("trainer2.monitor.progress.tqdm", Spy)
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)  # a "compiled" step that is the eager one
    cfg = build_config(
        [("test", run_flags(small_text, tmp_path, use_torch_compile=True, max_windows=6, eval_every_windows=0))]
    )
    trainer = Trainer(cfg, log=lambda s: None)
    real, calls = trainer.runner.step, []

    def step(inputs, targets):  # the first call compiles for 600 s, every later window takes 1 s
        clock[0] += 1.0 if calls else 600.0
        calls.append(1)
        real(inputs, targets)

    monkeypatch.setattr(trainer.runner, "step", step)
    trainer.train()
    last = bars[0].last
    assert last["n"] == 6 and last["elapsed"] == pytest.approx(5.0)  # 5 windows of 1 s; the compile is not one


def test_a_disabled_bar_with_step_progress_runs_and_reads_nothing_per_step(small_text, tmp_path, monkeypatch):
    """TQDM_DISABLE=1 (as CI and users set) used to end in AttributeError: 'tqdm' object has no attribute 'desc'."""

    class Disabled(tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "disable": True})  # what TQDM_DISABLE=1 does (tqdm reads it at import)

    monkeypatch.setattr("trainer2.monitor.progress.tqdm", Disabled)
    cfg = build_config(
        [
            (
                "test",
                run_flags(
                    small_text,
                    tmp_path,
                    max_windows=3,
                    log_every_windows=1,
                    eval_every_windows=0,
                    step_progress_every=2,
                ),
            )
        ]
    )
    trainer = Trainer(cfg, log=lambda s: None)
    assert trainer.train()["windows"] == 3
    assert trainer.relaxation.on_steps is None  # nothing shows progress, so none is read back


def write_rows(path: Path, n: int) -> None:
    rows = [
        {
            "window": w,
            "train_bpc": 5 - w / 10,
            "train_acc": w / 20,
            "lior_mean": 2.0,
            "spd_mean": 0.1,
            "spd_last": 1e-3,
            "windows_per_second": 10.0,
            "time_free_ms": 3.0,
            "time_nudged_ms": 2.0,
        }
        for w in range(1, n + 1)
    ]
    rows[-1].update(heldout_bpc=4.0, heldout_acc=0.3)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_plot_writes_pngs_from_a_small_telemetry_file(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    write_rows(tmp_path / "telemetry.jsonl", 5)
    assert main(["plot", str(tmp_path)]) == 0
    pngs = sorted(p.name for p in (tmp_path / "plots").glob("*.png"))
    assert pngs == ["accuracy.png", "bpc.png", "error.png", "lior_spd.png", "speed.png", "timing.png"]
    assert all((tmp_path / "plots" / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    assert "bpc.png" in capsys.readouterr().out


def test_plot_of_several_runs_draws_one_curve_per_run_against_wall_seconds(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    for name, n in (("a", 4), ("b", 6)):
        (tmp_path / name).mkdir()
        write_rows(tmp_path / name / "telemetry.jsonl", n)
        rows = [json.loads(line) for line in (tmp_path / name / "telemetry.jsonl").read_text().splitlines()]
        for r in rows:
            r["wall_seconds"] = 2.0 * r["window"]
        (tmp_path / name / "telemetry.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    drawn = {}  # file name -> {label: (x, y)}, read off each figure as it is saved
    save = Figure.savefig

    def record(fig, path, **kw):
        ax = fig.axes[0]
        drawn[Path(path).name] = {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax.lines}
        assert ax.get_xlabel() == "wall seconds"
        return save(fig, path, **kw)

    monkeypatch.setattr(Figure, "savefig", record)
    out = tmp_path / "cmp"
    assert main(["plot", str(tmp_path / "a"), str(tmp_path / "b"), "--x", "wall_seconds", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.glob("*.png")) == [
        "accuracy.png",
        "bpc.png",
        "error.png",
        "lior_spd.png",
        "speed.png",
    ]
    # each run's evaluated curve, not its per-batch train_* noise; error is 100 (1 - acc) at the run's wall seconds
    assert drawn["error.png"] == {
        "a heldout_error": ([8.0], [pytest.approx(70.0)]),
        "b heldout_error": ([12.0], [pytest.approx(70.0)]),
    }
    assert set(drawn["lior_spd.png"]) == {f"{r} {k}" for r in "ab" for k in ("lior_mean", "spd_mean", "spd_last")}
    assert drawn["speed.png"]["b windows_per_second"][0] == [2.0, 4.0, 6.0, 8.0, 10.0, 12.0]
    assert main(["plot", str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    assert "--out" in capsys.readouterr().err


def test_plot_without_matplotlib_says_what_to_install(tmp_path, capsys, monkeypatch):
    write_rows(tmp_path / "telemetry.jsonl", 2)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert main(["plot", str(tmp_path)]) == 2
    assert "pip install 'trainer2[plot]'" in capsys.readouterr().err


def test_plot_refuses_a_directory_without_telemetry(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main(["plot", str(tmp_path)]) == 2
    assert "telemetry.jsonl: no such file" in capsys.readouterr().err
    assert main(["plot", str(tmp_path / "nope")]) == 2
    assert "not a directory" in capsys.readouterr().err


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_phases_are_timed_with_events_and_memory_and_device_ops_are_recorded(small_text, tmp_path):
    over = run_flags(
        small_text,
        tmp_path,
        device="cuda",
        timing_debug=True,
        profile_windows=2,
        max_windows=8,
        log_every_windows=4,
        cleanup_every=1,
        cleanup_threshold=0.01,
    )
    Trainer(build_config([("test", over)]), log=lambda s: None).train()
    rows = read_telemetry(tmp_path / "t" / "telemetry.jsonl")
    assert all(r["time_free_ms"] > 0 and r["time_nudged_ms"] > 0 and r["mem_reserved_mib"] > 0 for r in rows)
    assert rows[-1]["cache_cleanups"] >= 1  # the threshold is low, so the rule holds at every check
    assert "top operators by self device time" in (tmp_path / "t" / "profile_top_ops.txt").read_text()
