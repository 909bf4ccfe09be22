"""TensorBoard logging (--tensorboard): the event files hold exactly the telemetry rows, resume continues them."""

from __future__ import annotations

import math
import shutil
import sys
from pathlib import Path

import pytest

from trainer2.cli import main
from trainer2.monitor.telemetry import read_telemetry
from trainer2.monitor.tensorboard import TB_DIR, tag
from trainer2.running.trainer import Trainer
from trainer2.train_config import ConfigError, build_config


def tiny(data: Path, ck: Path, **over) -> list[str]:
    flags = dict(
        data=data,
        checkpoint_dir=ck,
        run_name="t",
        hidden_sizes=8,
        coord_dim_n=4,
        rotor_k=3,
        context_len=3,
        embed_dim=3,
        batch_size=8,
        free_steps=4,
        nudge_steps=2,
        max_windows=6,
        log_every_windows=2,
        eval_every_windows=4,
        eval_batches=1,
    )
    flags.update(over)
    return [x for k, v in flags.items() for x in ((f"--{k}",) if v is True else (f"--{k}", str(v)))]


def events(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Tag -> [(step, value)] as TensorBoard reads the run directory's tb/."""
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = accumulator.EventAccumulator(str(run_dir / TB_DIR), size_guidance={accumulator.SCALARS: 0})
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def expected(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """The same, from telemetry rows: every number but the window, which is the step."""
    out: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        for k, v in r.items():
            if k != "window" and isinstance(v, (int, float)) and not isinstance(v, bool):
                out.setdefault(tag(k), []).append((r["window"], v))
    return out


def assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for t in want:
        assert [s for s, _ in got[t]] == [s for s, _ in want[t]], t
        for (_, a), (_, b) in zip(got[t], want[t]):
            assert a == pytest.approx(b, rel=1e-6, abs=1e-30) or (math.isnan(a) and math.isnan(b)), (
                t
            )  # stored as float32


def test_tags_group_the_telemetry_keys():
    assert [
        tag(k)
        for k in (
            "train_bpc",
            "heldout_acc",
            "lior_mean",
            "spd_last",
            "spd_last_nudge",
            "update_norm_embed",
            "lr",
            "windows_per_second",
            "mem_reserved_mib",
            "time_free_ms",
            "epoch",
            "something_new",
        )
    ] == [
        "train/bpc",
        "heldout/acc",
        "lior/mean",
        "lior/spd_last",
        "lior/spd_last_nudge",
        "update/norm_embed",
        "update/lr",
        "speed/windows_per_second",
        "memory/reserved_mib",
        "time/free_ms",
        "progress/epoch",
        "other/something_new",
    ]


def test_event_files_hold_the_telemetry_rows(small_text, tmp_path, capsys):
    pytest.importorskip("tensorboard")
    assert main(tiny(small_text, tmp_path, tensorboard=True, timing_debug=True)) == 0
    run_dir = tmp_path / "t"
    rows = read_telemetry(run_dir / "telemetry.jsonl")
    got = events(run_dir)
    assert_same(got, expected(rows))
    assert {
        "train/bpc",
        "heldout/bpc",
        "lior/mean",
        "update/norm_energy",
        "update/lr",
        "speed/windows_per_second",
        "time/free_ms",
        "memory/cache_cleanups",
    } <= set(got)
    assert [s for s, _ in got["train/loss"]] == [2, 4, 6] and [s for s, _ in got["heldout/loss"]] == [4, 6]


def test_resume_continues_the_stream_and_drops_what_an_interrupted_run_logged_after_its_checkpoint(
    small_text, tmp_path, capsys
):
    pytest.importorskip("tensorboard")
    ck = tmp_path / "ck"
    assert main(tiny(small_text, ck, tensorboard=True, save_every_windows=4, keep_last=5)) == 0
    run_dir = ck / "t"
    # An interrupted run: it logged window 6 but died before saving it; the newest checkpoint is window 4.
    shutil.rmtree(run_dir / "step_00000006")
    assert main(["--resume", "latest", *tiny(small_text, ck, tensorboard=True, max_windows=8)]) == 0
    rows = read_telemetry(run_dir / "telemetry.jsonl")
    assert [r["window"] for r in rows] == [2, 4, 6, 8]  # the resumed run replaced what was logged after its checkpoint
    assert_same(events(run_dir), expected(rows))  # and TensorBoard shows the resumed run's window 6 only
    assert len(list((run_dir / TB_DIR).iterdir())) == 2  # one event file per process, one directory, one run


def test_missing_tensorboard_is_refused_before_anything_is_loaded_or_written(small_text, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard now raises ImportError
    assert main(tiny(tmp_path / "no_such_data.txt", tmp_path, tensorboard=True)) == 2
    err = capsys.readouterr().err
    assert "pip install 'trainer2[tensorboard]'" in err and "Traceback" not in err
    assert not (tmp_path / "t").exists()
    # Through the API too: the run stops at start, before telemetry or config.yaml are written.
    cfg = build_config(
        [
            (
                "test",
                {
                    "data": str(small_text),
                    "checkpoint_dir": str(tmp_path),
                    "run_name": "api",
                    "tensorboard": True,
                    "hidden_sizes": [8],
                    "coord_dim_n": 4,
                    "rotor_k": 3,
                    "context_len": 3,
                    "embed_dim": 3,
                    "batch_size": 8,
                    "free_steps": 2,
                    "nudge_steps": 1,
                    "max_windows": 2,
                },
            )
        ]
    )
    with pytest.raises(ConfigError, match="tensorboard"):
        Trainer(cfg, log=lambda s: None).train()
    assert not (tmp_path / "api" / "telemetry.jsonl").exists()
