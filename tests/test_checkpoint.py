"""Checkpoints: exact resume, atomic saves, pruning, and refusal of broken or mismatched checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trainer2.cli import main
from trainer2.running import checkpoint as ck
from trainer2.running.trainer import Trainer
from trainer2.train_config import TrainConfig

TINY = dict(
    hidden_sizes=[8],
    coord_dim_n=4,
    rotor_k=3,
    context_len=3,
    embed_dim=3,
    batch_size=8,
    free_steps=4,
    nudge_steps=2,
    log_every_windows=10,
    eval_every_windows=10,
    eval_batches=2,
    memory_capacity=16,
    lr_warmup_windows=5,
    max_windows=40,
)


def config(tmp_path: Path, data: Path, **kw) -> TrainConfig:
    return TrainConfig(**{**TINY, "data": str(data), "checkpoint_dir": str(tmp_path / "ck"), **kw})


def flags(tmp_path: Path, data: Path, **kw) -> list[str]:
    out = []
    for k, v in {**TINY, "data": str(data), "checkpoint_dir": str(tmp_path / "ck"), **kw}.items():
        out += [f"--{k}", *(str(x) for x in (v if isinstance(v, list) else [v]))]
    return out


def quiet(cfg: TrainConfig) -> Trainer:
    return Trainer(cfg, log=lambda msg: None)


def run_dir(tmp_path: Path, name: str) -> Path:
    return tmp_path / "ck" / name


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file of every checkpoint under a run directory (telemetry beside them is the run's log, not a
    checkpoint)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.glob("step_*/**/*")) if p.is_file()}


def strip_wall(rows: list[dict]) -> list[dict]:
    """History rows without the wall-clock figures, which differ between any two runs, and the CUDA allocator's
    (mem_*, cache_cleanups), which belong to the process (a resumed process starts afresh)."""
    process = ("wall_seconds", "windows_per_second", "cache_cleanups")
    return [{k: v for k, v in r.items() if k not in process and not k.startswith(("time_", "mem_"))} for r in rows]


def assert_same_checkpoint(a: Path, b: Path) -> None:
    ta, tb = load_file(str(a / ck.TENSORS_FILE)), load_file(str(b / ck.TENSORS_FILE))
    assert sorted(ta) == sorted(tb)
    different = [k for k in ta if not torch.equal(ta[k], tb[k])]
    assert not different, f"tensors differ: {different}"
    ma, mb = ck.read_meta(a), ck.read_meta(b)
    assert strip_wall(ma["history"]) == strip_wall(mb["history"])
    assert {k: v for k, v in ma["counters"].items() if k != "wall_seconds"} == {
        k: v for k, v in mb["counters"].items() if k != "wall_seconds"
    }


@pytest.fixture(name="saved")
def fixture_saved(tmp_path, small_text) -> Path:
    """A run 'r' of 10 windows with its final checkpoint step_00000010."""
    quiet(config(tmp_path, small_text, run_name="r", max_windows=10)).train()
    return run_dir(tmp_path, "r") / "step_00000010"


# --- exact resume ---


def test_interrupted_run_resumes_bitwise_identical(tmp_path, small_text, capsys):
    assert main(flags(tmp_path, small_text, run_name="whole", max_windows=40)) == 0
    assert main(flags(tmp_path, small_text, run_name="cut", max_windows=20)) == 0
    assert (
        main(
            ["--resume", "latest", "--checkpoint_dir", str(tmp_path / "ck"), "--run_name", "cut", "--max_windows", "40"]
        )
        == 0
    )
    assert "resumed from" in capsys.readouterr().out
    whole, cut = run_dir(tmp_path, "whole"), run_dir(tmp_path, "cut")
    assert_same_checkpoint(whole / "step_00000040", cut / "step_00000040")
    sw, sc = (json.loads((d / "summary.json").read_text()) for d in (whole, cut))
    for k in ("heldout_loss", "heldout_bpc", "heldout_acc", "windows", "examples_seen"):
        assert sw[k] == sc[k], k


def test_resume_mid_epoch_after_several_epochs_is_bitwise_identical(tmp_path):
    # 11 windows per epoch: the cut falls mid-epoch 1 and the run goes on through epoch 3, so the
    # permutation recomputed on resume and every later one must be the ones the whole run drew.
    short = tmp_path / "short.txt"
    short.write_text("the cat sat on the mat. a dog ran. " * 3, encoding="utf-8")
    assert main(flags(tmp_path, short, run_name="whole", max_windows=40, memory_capacity=0)) == 0
    assert main(flags(tmp_path, short, run_name="cut", max_windows=20, memory_capacity=0)) == 0
    c = ck.read_meta(run_dir(tmp_path, "cut") / "step_00000020")["counters"]
    assert c["sampler_epoch"] == 1 and 0 < c["sampler_pos"] < 80  # mid-epoch
    assert (
        main(
            ["--resume", "latest", "--checkpoint_dir", str(tmp_path / "ck"), "--run_name", "cut", "--max_windows", "40"]
        )
        == 0
    )
    assert_same_checkpoint(run_dir(tmp_path, "whole") / "step_00000040", run_dir(tmp_path, "cut") / "step_00000040")


def test_checkpoint_size_does_not_grow_with_the_corpus(tmp_path, small_text):
    # The sampler's state is O(1): a corpus 20 times longer (same vocabulary) gives a checkpoint of the same size.
    big = tmp_path / "big.txt"
    big.write_text(small_text.read_text(encoding="utf-8") * 20, encoding="utf-8")
    for name, data in (("small", small_text), ("big", big)):
        quiet(config(tmp_path, data, run_name=name, max_windows=2)).train()
    sizes = {
        name: (run_dir(tmp_path, name) / "step_00000002" / ck.TENSORS_FILE).stat().st_size for name in ("small", "big")
    }
    assert sizes["small"] == sizes["big"], sizes


def test_resume_from_periodic_checkpoint_in_place_with_cosine_schedule(tmp_path, small_text):
    # log_every 15: the saved metric accumulators are mid-interval, so they must be restored too.
    cfg = config(
        tmp_path,
        small_text,
        run_name="a",
        lr_schedule="cosine",
        save_every_windows=20,
        keep_last=5,
        log_every_windows=15,
        eval_every_windows=0,
    )
    a = quiet(cfg)
    a.train()
    assert [p.name for p in ck.list_checkpoints(run_dir(tmp_path, "a"))] == ["step_00000020", "step_00000040"]
    b = quiet(cfg.model_copy(update={"run_name": "b"}))
    live = b.state_tensors()
    ptrs = {k: t.data_ptr() for k, t in live.items()}
    torch.rand(7)  # disturb the global RNG: the load must restore it
    b.load_checkpoint(run_dir(tmp_path, "a") / "step_00000020")
    assert {k: t.data_ptr() for k, t in b.state_tensors().items()} == ptrs  # copied in place
    assert b.progress.window == 20 and b.sampler.state_dict()["pos"] == 160
    b.train()
    for k, t in a.state_tensors().items():
        assert torch.equal(t, live[k]), k
    assert strip_wall(a.history) == strip_wall(b.history)
    assert a.evaluate() == b.evaluate()
    assert_same_checkpoint(run_dir(tmp_path, "a") / "step_00000040", run_dir(tmp_path, "b") / "step_00000040")


# --- atomic saves and picking ---


def test_killed_save_is_never_picked_up(tmp_path, small_text, saved, capsys):
    rd = saved.parent
    stale = rd / ".tmp-step_00000020-99999"  # what a save killed before its rename leaves behind
    stale.mkdir()
    (stale / ck.TENSORS_FILE).write_bytes((saved / ck.TENSORS_FILE).read_bytes()[:100])
    assert ck.find_latest(rd) == saved
    assert (
        main(["--resume", "latest", "--checkpoint_dir", str(tmp_path / "ck"), "--run_name", "r", "--max_windows", "12"])
        == 0
    )
    assert f"resumed from {saved} at window 10" in capsys.readouterr().out
    assert ck.find_latest(rd).name == "step_00000012"


def test_failed_save_leaves_previous_checkpoints_untouched(tmp_path, small_text, saved, monkeypatch):
    before = snapshot(saved.parent)

    def dies(tensors, filename):
        Path(filename).write_bytes(b"half a file")
        raise KeyboardInterrupt

    tr = quiet(config(tmp_path, small_text, run_name="r", max_windows=12))
    tr.load_checkpoint(saved)
    monkeypatch.setattr(ck, "save_file", dies)
    with pytest.raises(KeyboardInterrupt):
        tr.train()
    assert snapshot(saved.parent) == before
    assert ck.list_checkpoints(saved.parent) == [saved]


def test_pruning_keeps_exactly_keep_last(tmp_path, small_text):
    quiet(config(tmp_path, small_text, run_name="p", max_windows=14, save_every_windows=3, keep_last=2)).train()
    assert [p.name for p in ck.list_checkpoints(run_dir(tmp_path, "p"))] == ["step_00000012", "step_00000014"]
    rd = tmp_path / "manual"
    for step in (1, 5, 10, 100, 7, 3, 200):
        (rd / ck.step_name(step)).mkdir(parents=True)
        if step not in (3, 200):  # 3: another run's; 200: no sidecar (a directory merely named like a checkpoint)
            (rd / ck.step_name(step) / ck.META_FILE).write_text(
                json.dumps({"run_id": "mine" if step != 3 else "theirs"})
            )
    removed = ck.prune(rd, 3, "mine")
    assert [p.name for p in removed] == ["step_00000001", "step_00000005"]
    assert [p.name for p in ck.list_checkpoints(rd)] == [
        "step_00000003",
        "step_00000007",
        "step_00000010",
        "step_00000100",
        "step_00000200",
    ]


# --- refusals ---


def truncate(d: Path) -> None:
    f = d / ck.TENSORS_FILE
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def flip_byte(d: Path) -> None:
    f = d / ck.TENSORS_FILE
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    f.write_bytes(bytes(raw))


def other_version(d: Path) -> None:
    meta = json.loads((d / ck.META_FILE).read_text())
    (d / ck.META_FILE).write_text(json.dumps({**meta, "format_version": 99}))


@pytest.mark.parametrize(
    "damage, message",
    [
        (truncate, "tensors.safetensors: {n} bytes, the sidecar records"),
        (flip_byte, "tensors.safetensors: sha256 differs"),
        (lambda d: (d / ck.META_FILE).unlink(), "missing meta.json"),
        (lambda d: (d / ck.TENSORS_FILE).unlink(), "missing tensors.safetensors"),
        (lambda d: (d / ck.META_FILE).write_text('{"format_version": 1,'), "meta.json: not valid JSON"),
        (other_version, f"meta.json: checkpoint format version 99; this trainer reads version {ck.FORMAT_VERSION}"),
        (
            lambda d: (d / ck.META_FILE).write_text(
                json.dumps({**json.loads((d / ck.META_FILE).read_text()), "history": None})
            ),
            "meta.json: 'history' must be a JSON list, got NoneType",
        ),
    ],
)
def test_broken_checkpoint_is_refused_and_nothing_is_harmed(tmp_path, small_text, saved, capsys, damage, message):
    damage(saved)
    before = snapshot(tmp_path / "ck")
    assert main(["--resume", str(saved), "--max_windows", "12"]) == 2
    err = capsys.readouterr().err
    n = (saved / ck.TENSORS_FILE).stat().st_size if (saved / ck.TENSORS_FILE).exists() else 0
    assert message.format(n=n) in err and str(saved) in err
    assert snapshot(tmp_path / "ck") == before


def test_refusal_comes_before_any_tensor_is_touched(tmp_path, small_text, saved):
    truncate(saved)
    tr = quiet(config(tmp_path, small_text, run_name="r", max_windows=12))
    before = {k: t.clone() for k, t in tr.state_tensors().items()}
    with pytest.raises(ck.CheckpointError, match="truncated"):
        tr.load_checkpoint(saved)
    assert all(torch.equal(t, before[k]) for k, t in tr.state_tensors().items())
    assert tr.progress.window == 0


def test_mismatched_model_field_is_refused_naming_both_values(tmp_path, saved, capsys):
    base = ["--resume", "latest", "--checkpoint_dir", str(tmp_path / "ck"), "--run_name", "r"]
    assert main([*base, "--hidden_sizes", "16", "--context_len", "4"]) == 2
    err = capsys.readouterr().err
    assert "layers: checkpoint has [{'dense': 8}], requested [{'dense': 16}]" in err
    assert "context_len: checkpoint has 3, requested 4" in err
    # Run-steering fields may change.
    assert (
        main(
            [*base, "--max_windows", "11", "--log_every_windows", "1", "--eval_every_windows", "0", "--keep_last", "1"]
        )
        == 0
    )
    assert [p.name for p in ck.list_checkpoints(saved.parent)] == ["step_00000011"]


def test_changed_data_is_refused(tmp_path, small_text, saved, capsys):
    small_text.write_text(small_text.read_text().replace("cat", "cow"))
    assert main(["--resume", str(saved)]) == 2
    assert "the data differs from the checkpoint's" in capsys.readouterr().err


def test_every_field_is_either_fixed_or_free_on_resume():
    fields = set(TrainConfig.model_fields)
    assert ck.RESUME_FREE_FIELDS <= fields
    assert set(ck.fixed_fields()) | ck.RESUME_FREE_FIELDS == fields
    for f in ("layers", "free_steps", "coord_dim_n", "context_len", "embed_dim", "dtype", "memory_capacity", "seed"):
        assert f in ck.fixed_fields(), f
    # batch_size is per process: the global batch (batch_size x world size) is checked instead (next test); data is a
    # path: the contents are checked instead, by their fingerprint, so a moved file resumes.
    for f in (
        "max_windows",
        "max_epochs",
        "log_every_windows",
        "eval_every_windows",
        "device",
        "use_cudagraphs",
        "keep_last",
        "batch_size",
        "data",
    ):
        assert f in ck.RESUME_FREE_FIELDS, f


def test_a_changed_global_batch_is_refused_naming_both(tmp_path, saved, capsys):
    before = snapshot(saved.parent)
    assert main(["--resume", str(saved), "--batch_size", "16", "--memory_capacity", "16"]) == 2
    err = capsys.readouterr().err
    assert "global batch of 8 (batch_size 8 x 1 process(es)); this run's is 16 (batch_size 16 x 1)" in err
    assert "pass --batch_size 8" in err
    assert snapshot(saved.parent) == before


def test_resume_without_checkpoint_says_so(tmp_path, capsys):
    assert main(["--resume", "latest", "--checkpoint_dir", str(tmp_path / "ck"), "--run_name", "nothing"]) == 2
    assert "no checkpoint to resume in" in capsys.readouterr().err
    assert main(["--resume", str(tmp_path / "nowhere")]) == 2
    assert "no such directory" in capsys.readouterr().err
    assert not (tmp_path / "ck").exists()


def test_fresh_run_over_existing_checkpoints_is_refused(tmp_path, small_text, saved, capsys):
    before = snapshot(saved.parent)
    assert main(flags(tmp_path, small_text, run_name="r", max_windows=5)) == 2
    assert "already has checkpoints" in capsys.readouterr().err
    assert snapshot(saved.parent) == before


def test_resuming_an_older_checkpoint_needs_a_new_run_name(tmp_path, small_text, capsys):
    quiet(config(tmp_path, small_text, run_name="r", max_windows=10, save_every_windows=5)).train()
    old = run_dir(tmp_path, "r") / "step_00000005"
    assert main(["--resume", str(old)]) == 2
    assert "would mix two histories" in capsys.readouterr().err
    assert main(["--resume", str(old), "--run_name", "branch", "--max_windows", "6"]) == 0
    assert ck.find_latest(run_dir(tmp_path, "branch")).name == "step_00000006"


# --- evaluate command ---


def test_evaluate_command_prints_heldout_metrics(tmp_path, saved, capsys):
    capsys.readouterr()
    assert main(["evaluate", "--checkpoint", str(saved), "--device", "cpu"]) == 0
    out = json.loads(capsys.readouterr().out)
    summary = json.loads((saved.parent / "summary.json").read_text())
    assert out["window"] == 10
    for k in ("heldout_loss", "heldout_bpc", "heldout_acc"):
        assert out[k] == summary[k], k
    truncate(saved)
    assert main(["evaluate", "--checkpoint", str(saved)]) == 2
    assert "truncated" in capsys.readouterr().err


def test_checkpoint_copied_under_another_step_name_is_refused(tmp_path, saved, capsys):
    shutil.copytree(saved, saved.with_name("step_00000050"))
    assert main(["--resume", "latest", "--checkpoint_dir", str(tmp_path / "ck"), "--run_name", "r"]) == 2
    assert "meta.json: records step 10, but its directory is named step_00000050" in capsys.readouterr().err
