"""The run policy: where a run writes, which checkpoint a resumed run continues from and with which config,
and when a start is refused.

Where a run writes comes from the command line, or else from the checkpoint's own location (a resumed
run) or a fresh name (a new run), never from paths stored inside a checkpoint. The checkpoint's saved
config is the lowest layer of a resumed run; presets, --config and flags go on top, and only the
run-steering fields (checkpoint.RESUME_FREE_FIELDS) may differ from it.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any

from trainer2.components import UntrustedCodeError, named_components
from trainer2.running.checkpoint import (
    META_FILE,
    CheckpointError,
    check_config,
    list_checkpoints,
    read_meta,
    read_verified,
    resolve_checkpoint,
    saved_config,
    step_of,
)
from trainer2.running.rundir import RUN_FILES, RunDirError, fresh_name, lock_holder, newest_run, owner, run_files
from trainer2.train_config import ConfigError, TrainConfig, build_config

Layers = list[tuple[str, dict[str, Any]]]
LOCATION = ("checkpoint_dir", "run_name")


def given(layers: Layers) -> dict[str, Any]:
    """The fields the user's layers set (the top one wins)."""
    out: dict[str, Any] = {}
    for _, layer in layers:
        out.update(layer)
    return out


def fresh_layers(layers: Layers, prefix: str, trust_code: bool = False) -> Layers:
    """The layers of a new run: the user's, and, when none sets run_name, a fresh one, `<prefix>-<N>`."""
    if "run_name" in given(layers):
        return layers
    root = Path(build_config(layers, trust_code).checkpoint_dir)
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
        run_dir = latest_run(Path(user.get("checkpoint_dir", default_root)), user.get("run_name"), "to resume")
    else:
        own = checkpoint_of(spec, Path(spec))  # a run folder: its newest checkpoint
        own = own if own.parent.name else own.resolve()  # "step_N" inside its run: the full path
        run_dir = Path(user.get("checkpoint_dir", own.parent.parent)) / user.get("run_name", own.parent.name)
    read_meta(checkpoint_of(spec, run_dir))  # no checkpoint there: refused before anything is created or locked
    return run_dir


def checkpoint_of(spec: str, run_dir: Path) -> Path:
    """resolve_checkpoint(spec, run_dir), except that a run with no checkpoint yet whose lock another process holds
    is said to be in use (a RunDirError naming the holder), not to have nothing to resume."""
    try:
        return resolve_checkpoint(spec, run_dir)
    except CheckpointError:
        run = run_dir if spec == "latest" else Path(spec)
        holder = lock_holder(run)
        if holder is not None:
            raise RunDirError(
                f"run {run.name!r} ({run}) has no checkpoint yet: it is in use by {holder}, still running; wait for "
                "it to save a checkpoint, or stop it first (Ctrl-C saves one)"
            ) from None
        raise


def latest_run(root: Path, run_name: str | None, purpose: str) -> Path:
    """The run `latest` means: `run_name` under root, or else the run under root that saved most recently."""
    run_dir = root / run_name if run_name else newest_run(root)
    if run_dir is None:
        going = [
            f"{p.name} ({h})"
            for p in (sorted(root.iterdir()) if root.is_dir() else ())
            if p.is_dir() and (h := lock_holder(p))
        ]
        running = (
            f"; {', '.join(going)} {'is' if len(going) == 1 else 'are'} still running without a checkpoint yet: wait "
            "for a save, or stop it first (Ctrl-C saves one)"
            if going
            else ""
        )
        raise CheckpointError(
            f"no run with a checkpoint under {root} {purpose}: name the run with --run_name and --checkpoint_dir, "
            f"or give a run folder or step_<N>/ directory{running}"
        )
    return run_dir


def named_checkpoint(spec: str, run_name: str | None = None, checkpoint_dir: str | None = None) -> Path:
    """The checkpoint directory that evaluate and sample take: 'latest' (of run_name under checkpoint_dir, else of
    the run saved most recently there), a run folder (its newest checkpoint) or a step_<N>/ directory."""
    if spec != "latest":
        return checkpoint_of(spec, Path(spec))
    root = Path(checkpoint_dir or TrainConfig.model_fields["checkpoint_dir"].default)
    return checkpoint_of(spec, latest_run(root, run_name, "to load"))


def add_checkpoint_flags(parser: argparse.ArgumentParser) -> None:
    """--checkpoint (a step_<N>/ directory, a run folder or 'latest') and the --run_name / --checkpoint_dir that
    'latest' reads, for the commands that load a checkpoint (evaluate, sample)."""
    parser.add_argument(
        "--checkpoint",
        required=True,
        metavar="PATH|latest",
        help="A step_<N>/ checkpoint directory, a run folder (its newest checkpoint, e.g. checkpoints/dev-1) or "
        "'latest' (the newest checkpoint of --run_name, or of the run saved most recently).",
    )
    parser.add_argument("--run_name", default=None, help="With --checkpoint latest: the run whose newest to take.")
    parser.add_argument(
        "--checkpoint_dir", default=None, help="With --checkpoint latest: where runs are (default: checkpoints)."
    )


def checkpoint_from(args: argparse.Namespace) -> Path:
    """The checkpoint directory evaluate / sample were pointed at, said in one line on stderr when it was found (a
    run folder's or 'latest''s newest)."""
    if args.checkpoint != "latest" and (args.run_name or args.checkpoint_dir):
        raise ConfigError("--run_name and --checkpoint_dir go with --checkpoint latest; a path names its checkpoint")
    path = named_checkpoint(args.checkpoint, args.run_name, args.checkpoint_dir)
    if str(path) != args.checkpoint:
        print(f"trainer2: checkpoint {path} (the newest of {path.parent})", file=sys.stderr)
    return path


def resume_layers(path: Path, meta: dict[str, Any], layers: Layers, run_dir: Path) -> Layers:
    """The layers of a run resumed from checkpoint `path` into `run_dir`: the checkpoint's config (fields added since
    at the values its run used: checkpoint.saved_config) without its location (a copied checkpoint's paths mean
    nothing here), run_dir as the location, then the user's layers (which, where they name a location, named run_dir:
    see resume_target)."""
    saved = {k: v for k, v in saved_config(meta["config"]).items() if k not in LOCATION}
    location = {"checkpoint_dir": str(run_dir.parent), "run_name": run_dir.name}
    return [(f"checkpoint {path}", saved), ("the run directory", location), *layers]


def resume_config(spec: str, layers: Layers, run_dir: Path, trust_code: bool = False) -> tuple[TrainConfig, Path]:
    """(config, checkpoint path) for --resume into `run_dir` (resume_target): the checkpoint's saved config
    overlaid by the user's layers, with run_dir as its location; checked whole (sha256) before its config is read, and
    code it names imported only with trust_code (or named again by the user)."""
    path = resolve_checkpoint(spec, run_dir)
    meta = read_verified(path)
    try:
        cfg = build_config(resume_layers(path, meta, layers, run_dir), trust_code)
    except UntrustedCodeError:
        raise
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
    if named_components(cfg.model_dump()):  # the run's own code, which its checkpoint names: this user consented to it
        line += " --trust_code"
    return line
