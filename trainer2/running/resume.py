"""The run policy: where a run writes, which checkpoint a resumed run continues from and with which config,
and when a start is refused.

Where a run writes comes from the command line, or else from the checkpoint's own location (a resumed
run) or a fresh name (a new run), never from paths stored inside a checkpoint. The checkpoint's saved
config is the lowest layer of a resumed run; presets, --config and flags go on top, and only the
run-steering fields (checkpoint.RESUME_FREE_FIELDS) may differ from it.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any

from trainer2.running.checkpoint import (
    META_FILE,
    CheckpointError,
    check_config,
    list_checkpoints,
    read_meta,
    resolve_checkpoint,
    saved_config,
    step_of,
)
from trainer2.running.rundir import RUN_FILES, RunDirError, fresh_name, newest_run, owner, run_files
from trainer2.train_config import ConfigError, TrainConfig, build_config

Layers = list[tuple[str, dict[str, Any]]]
LOCATION = ("checkpoint_dir", "run_name")


def given(layers: Layers) -> dict[str, Any]:
    """The fields the user's layers set (the top one wins)."""
    out: dict[str, Any] = {}
    for _, layer in layers:
        out.update(layer)
    return out


def fresh_layers(layers: Layers, prefix: str) -> Layers:
    """The layers of a new run: the user's, and, when none sets run_name, a fresh one, `<prefix>-<N>`."""
    if "run_name" in given(layers):
        return layers
    root = Path(build_config(layers).checkpoint_dir)
    return [*layers, ("a fresh run name", {"run_name": fresh_name(root, re.sub(r"[^A-Za-z0-9_.-]", "_", prefix))})]


def fresh_run_guard(run_dir: Path) -> None:
    """Refuse to start a fresh run in a directory that holds another run's files (its checkpoints would be
    pruned, its telemetry continued with restarting window numbers)."""
    found = run_files(run_dir)
    if found:
        what = "checkpoints" if any(f.startswith("step_") for f in found) else "files"
        raise RunDirError(
            f"run {run_dir.name!r} already has {what} ({', '.join(found[-4:])} in {run_dir}): pass --resume latest "
            f"--run_name {run_dir.name} to continue it, pick a new --run_name (or none: a fresh name is chosen), "
            f"or delete {run_dir}"
        )


def check_owner(run_dir: Path, meta: dict[str, Any], path: Path) -> None:
    """Refuse to resume checkpoint `path` in its own directory when that directory's files belong to another run: its
    .run records another id, or it has none and holds run files beside a checkpoint that has one (copied in)."""
    rid, mine = meta.get("run_id"), owner(run_dir)
    files = [f for f in run_files(run_dir) if f in RUN_FILES]
    if (mine is not None and mine != rid) or (mine is None and isinstance(rid, str) and files):
        raise RunDirError(
            f"cannot resume {path} in {run_dir}: that directory holds files of another run "
            f"({', '.join(files[-4:])}), which the resumed run would overwrite; move the checkpoint "
            "into a directory of its own, or pass --run_name NEW to branch off into a new one"
        )


def resume_target(spec: str, layers: Layers) -> Path:
    """The run directory a resumed run writes into: --checkpoint_dir / --run_name when given, else the checkpoint's
    own run (--resume PATH: PATH's parent; --resume latest: the run under checkpoint_dir saved most recently)."""
    user = given(layers)
    default_root = TrainConfig.model_fields["checkpoint_dir"].default
    if spec == "latest":
        root = Path(user.get("checkpoint_dir", default_root))
        run_dir = root / user["run_name"] if "run_name" in user else newest_run(root)
        if run_dir is None:
            raise CheckpointError(
                f"no run with a checkpoint under {root} to resume: start one without --resume, "
                "or name the run with --run_name and --checkpoint_dir"
            )
    else:
        own = Path(spec) if Path(spec).parent.name else Path(spec).resolve()  # "step_N" inside its run: the full path
        run_dir = Path(user.get("checkpoint_dir", own.parent.parent)) / user.get("run_name", own.parent.name)
    read_meta(resolve_checkpoint(spec, run_dir))  # no checkpoint there: refused before anything is created or locked
    return run_dir


def resume_layers(path: Path, meta: dict[str, Any], layers: Layers, run_dir: Path) -> Layers:
    """The layers of a run resumed from checkpoint `path` into `run_dir`: the checkpoint's config (fields added since
    at the values its run used: checkpoint.saved_config) without its location (a copied checkpoint's paths mean
    nothing here), run_dir as the location, then the user's layers (which, where they name a location, named run_dir:
    see resume_target)."""
    saved = {k: v for k, v in saved_config(meta["config"]).items() if k not in LOCATION}
    location = {"checkpoint_dir": str(run_dir.parent), "run_name": run_dir.name}
    return [(f"checkpoint {path}", saved), ("the run directory", location), *layers]


def resume_config(spec: str, layers: Layers, run_dir: Path) -> tuple[TrainConfig, Path]:
    """(config, checkpoint path) for --resume into `run_dir` (resume_target): the checkpoint's saved config
    overlaid by the user's layers, with run_dir as its location."""
    path = resolve_checkpoint(spec, run_dir)
    meta = read_meta(path)
    try:
        cfg = build_config(resume_layers(path, meta, layers, run_dir))
    except ConfigError as e:
        raise CheckpointError(f"{path / META_FILE}: its config cannot be used: {e}") from None
    check_config(meta["config"], cfg, path)
    return cfg, path


def check_resume(path: Path, run_dir: Path) -> None:
    """Refuse to resume checkpoint `path` into `run_dir` (call it holding the run's lock): a branch (a checkpoint of
    another run) only into a directory without run files; the same run only when its files are this run's and the
    checkpoint is its newest."""
    meta = read_meta(path)
    source = path.resolve().parent
    if source != run_dir.resolve():  # a branch: a new run that starts from another run's checkpoint
        found = run_files(run_dir)
        if found:
            raise RunDirError(
                f"cannot resume {path} (a checkpoint of run {source.name!r}) into run {run_dir.name!r}: "
                f"{run_dir} already holds that run's own files ({', '.join(found[-4:])}). To branch off, pass a "
                f"new --run_name; to continue {run_dir.name!r}, pass --resume latest --run_name {run_dir.name}"
            )
        return
    check_owner(run_dir, meta, path)
    newer = [p for p in list_checkpoints(run_dir) if step_of(p) > meta["step"] and p.resolve() != path.resolve()]
    if newer:
        raise CheckpointError(
            f"checkpoint {path} is older than {newer[-1]} of the same run; continuing here would mix "
            "two histories: pass --run_name NEW to branch off, or --resume latest"
        )


def resume_command(cfg: TrainConfig) -> str:
    """The command line that continues this run, as this process was started (`python main.py`, `trainer2`)."""
    arg0 = Path(sys.argv[0])
    if arg0.name == "__main__.py" and arg0.parent.name == "trainer2":
        prog = "python -m trainer2"
    elif arg0.name == "trainer2":
        prog = "trainer2"
    else:
        prog = f"python {shlex.quote(sys.argv[0]) if arg0.name == 'main.py' else 'main.py'}"
    if "WORLD_SIZE" in os.environ:  # started by torchrun, whose options this process cannot see
        prog = "torchrun [the same options] " + prog.removeprefix("python ")
    line = f"{prog} --resume latest --run_name {shlex.quote(cfg.run_name)}"
    if cfg.checkpoint_dir != TrainConfig.model_fields["checkpoint_dir"].default:
        line += f" --checkpoint_dir {shlex.quote(cfg.checkpoint_dir)}"
    return line
