"""benchmarks.quality_seeds: one quality run per seed, side by side, resumable, and the ratios' mean and error."""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import numpy as np
import pytest
from test_quality import FAST

from benchmarks import quality, quality_seeds
from benchmarks.exact_gradient_reference import train_feedforward
from trainer2.train_config import ConfigError


def test_seed_lists_and_the_summary():
    assert quality_seeds.parse_seeds("0-3,7") == [0, 1, 2, 3, 7]
    st = quality_seeds.summarize([1.0, 1.02, 0.97, 1.05])
    assert st["mean"] == pytest.approx(1.01)
    assert st["sd"] == pytest.approx(statistics.stdev([1.0, 1.02, 0.97, 1.05]))
    assert st["se"] == pytest.approx(st["sd"] / 2)
    assert quality_seeds.summarize([0.99])["se"] == 0.0


def test_two_seeds_side_by_side_then_resumed_without_rerunning(tmp_path, small_text, capsys):
    flags = ["--preset", "dev", "--examples", "160", "--cosine_batches", "1", "--skip", "ff", "--data", str(small_text)]
    for k, v in FAST.items():
        if k != "max_windows":
            flags += [f"--{k}", *map(str, v)] if isinstance(v, list) else [f"--{k}", str(v)]
    out = tmp_path / "sweep"
    assert quality_seeds.main(["--seeds", "0-1", "--jobs", "2", "--out", str(out), "--", *flags]) == 0
    text = capsys.readouterr().out
    runs = [json.loads((out / f"quality-s{s}.json").read_text()) for s in (0, 1)]
    assert [r["config"]["seed"] for r in runs] == [0, 1]
    assert runs[0]["ratio"] != runs[1]["ratio"]  # two seeds, two trajectories
    assert f"mean {statistics.mean(r['ratio'] for r in runs):.4f}" in text
    assert (out / "checkpoints-s0").is_dir() and (out / "checkpoints-s1").is_dir()  # no two runs share a folder

    stamps = [(out / f"quality-s{s}.json").stat().st_mtime_ns for s in (0, 1)]
    assert quality_seeds.main(["--seeds", "0-1", "--out", str(out), "--", *flags]) == 0
    assert "started" not in capsys.readouterr().out  # both JSONs there: nothing runs again
    assert [(out / f"quality-s{s}.json").stat().st_mtime_ns for s in (0, 1)] == stamps


def tiny_digits(tmp_path: Path) -> Path:
    """An image .npz of 48 random 8x8 images in 3 classes (tmp_path/digits.npz)."""
    rng = np.random.default_rng(0)
    data = tmp_path / "digits.npz"
    np.savez(data, x=rng.integers(0, 256, (48, 8, 8)).astype(np.uint8), y=np.arange(48) % 3)
    return data


def test_a_graph_machine_runs_ep_against_exact_end_to_end(tmp_path, capsys):
    """conv_res (a residual conv graph: strided convs, a skip, three colour groups) on tiny images: the sweep's one seed
    trains EP and the exact reference and writes a finite ratio and cosine; the feed-forward baseline, which knows
    chains only, is refused before any run unless skipped."""
    data = tiny_digits(tmp_path)
    flags = ["--preset", "conv_res", "--data", str(data), "--heldout_fraction", "0.25", "--examples", "16"]
    flags += ["--batch_size", "8", "--free_steps", "4", "--nudge_steps", "2", "--cosine_batches", "1"]
    flags += ["--eval_batches", "1", "--cpu_threads", "1"]
    out = tmp_path / "sweep"
    assert quality_seeds.main(["--seeds", "0", "--out", str(out), "--", *flags]) == 2  # ff is on by default
    captured = capsys.readouterr()
    assert "knows chains only" in captured.err and "--skip ff" in captured.err and "started" not in captured.out
    _, cfg = quality.parse([*flags, "--skip", "ff", "--checkpoint_dir", str(tmp_path / "ff")])
    with pytest.raises(ConfigError, match="knows chains only.*--skip ff"):  # the baseline itself, called anyway
        train_feedforward(cfg, 16)
    assert quality_seeds.main(["--seeds", "0", "--out", str(out), "--", *flags, "--skip", "ff"]) == 0
    text = capsys.readouterr().out
    run = json.loads((out / "quality-s0.json").read_text())
    assert [c["to"] for c in run["config"]["couplings"]] == ["a", "b", "c", "c"]  # the graph it trained
    assert run["ep"]["examples_seen"] == run["exact"]["examples_seen"] == 16 and "ff" not in run
    figures = [run["ep"]["heldout_loss"], run["exact"]["heldout_loss"], run["ratio"], run["cosine"]["all"]]
    assert all(math.isfinite(f) for f in figures) and run["ratio"] > 0
    assert run["ratio"] == pytest.approx(run["ep"]["heldout_loss"] / run["exact"]["heldout_loss"])
    assert f"mean {run['ratio']:.4f}" in text


def test_a_failed_seed_is_named_with_its_log(tmp_path, capsys):
    out = tmp_path / "sweep"
    flags = ["--preset", "dev", "--examples", "16", "--data", str(tmp_path / "missing.txt")]
    assert quality_seeds.main(["--seeds", "3", "--out", str(out), "--", *flags]) == 1
    captured = capsys.readouterr()
    assert f"seed 3: failed (exit 2; {out}/quality-s3.log)" in captured.out
    assert "missing.txt" in (out / "quality-s3.log").read_text() and "seeds without a ratio" in captured.err


@pytest.mark.parametrize(
    "argv,says",
    [
        (["--seeds", "5-3"], "low <= high"),
        (["--seeds", "a-b"], "like 0-15"),
        (["--seeds", "0-2", "--jobs", "0"], "at least 1"),
        (["--seeds", "0", "--", "--preset", "dev", "--seed", "4"], "set per seed"),
        (["--seeds", "0", "--", "--preset", "dev", "--json=x.json"], "set per seed"),
    ],
)
def test_bad_sweep_options_are_refused_by_name(tmp_path, capsys, argv, says):
    with pytest.raises(SystemExit):
        quality_seeds.main([*argv[:2], "--out", str(tmp_path), *argv[2:]])
    assert says in capsys.readouterr().err


def test_seeds_run_once_each_and_bad_quality_flags_are_refused_before_any_run(tmp_path, capsys):
    assert quality_seeds.parse_seeds("0-3,2-5") == [0, 1, 2, 3, 4, 5]
    out = tmp_path / "sweep"
    for flags, says in [
        (["--preset", "no_such_preset"], "no_such_preset"),
        (["--preset", "dev", "--no_such_flag", "1"], "no_such_flag"),
        (["--preset", "dev", "--skip", "exact"], "--skip exact"),
    ]:
        assert quality_seeds.main(["--seeds", "0-1", "--out", str(out), "--", *flags]) == 2
        captured = capsys.readouterr()
        assert says in captured.err and "started" not in captured.out


def test_a_folder_keeps_its_sweeps_flags(tmp_path, capsys):
    out = tmp_path / "sweep"
    out.mkdir()
    (out / "sweep.json").write_text('{"flags": ["--preset", "conv"]}')
    assert quality_seeds.main(["--seeds", "0", "--out", str(out), "--", "--preset", "dev"]) == 2
    assert "--preset conv" in capsys.readouterr().err  # the folder's flags, named


def test_an_out_that_is_a_file_is_refused_naming_it(tmp_path, capsys):
    out = tmp_path / "results.txt"
    out.write_text("kept")
    for extra in ([], ["--report_only"]):
        assert quality_seeds.main(["--seeds", "0", "--out", str(out), *extra, "--", "--preset", "dev"]) == 2
        err = capsys.readouterr().err
        assert f"--out {out} is a file; --out must be a folder" in err and "Traceback" not in err
    assert out.read_text() == "kept"
    assert quality_seeds.main(["--seeds", "0", "--out", str(out / "below"), "--", "--preset", "dev"]) == 2
    assert "cannot make the folder" in capsys.readouterr().err


def test_a_seed_range_beyond_the_cap_is_refused_before_it_is_made(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        quality_seeds.main(["--seeds", "0-100000000", "--out", str(tmp_path)])
    assert e.value.code == 2 and f"at most {quality_seeds.MAX_SEEDS} seeds" in capsys.readouterr().err
    with pytest.raises(argparse.ArgumentTypeError, match="at most"):
        quality_seeds.parse_seeds("0-5000,6000-12000")  # counted over every part
    assert len(quality_seeds.parse_seeds(f"0-{quality_seeds.MAX_SEEDS - 1}")) == quality_seeds.MAX_SEEDS


def test_a_dense_image_machine_runs_ep_against_exact_in_float64(tmp_path):
    """mnist_mlp's shape (one dense layer on images): the exact reference's dense chain takes the image rows, which load
    as float32, in its float64 machine's dtype (it failed there with a dtype mismatch), and the cosine is finite."""
    data = tiny_digits(tmp_path)
    flags = ["--preset", "mnist_mlp", "--data", str(data), "--heldout_fraction", "0.25", "--examples", "16"]
    flags += ["--layers", "dense:16", "--batch_size", "8", "--cosine_batches", "1", "--eval_batches", "1"]
    flags += ["--cpu_threads", "1", "--skip", "ff"]
    out = tmp_path / "sweep"
    assert quality_seeds.main(["--seeds", "0", "--out", str(out), "--", *flags]) == 0
    run = json.loads((out / "quality-s0.json").read_text())
    assert run["config"]["layers"] == [{"dense": 16}] and run["ep"]["examples_seen"] == run["exact"]["examples_seen"]
    assert math.isfinite(run["ratio"]) and 0.9 < run["cosine"]["all"] <= 1.0 + 1e-9
