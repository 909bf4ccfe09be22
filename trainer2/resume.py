"""The resume policy: which checkpoint a run continues from, with which config, and when a fresh start is refused.

The checkpoint's saved config is the lowest layer; presets, --config and flags go on top, and only
the run-steering fields (checkpoint.RESUME_FREE_FIELDS) may differ from it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainer2.checkpoint import META_FILE, CheckpointError, check_config, list_checkpoints, read_meta, resolve_checkpoint, step_of
from trainer2.config import ConfigError, TrainConfig, build_config


def resume_config(spec: str, layers: list[tuple[str, dict[str, Any]]]) -> tuple[TrainConfig, Path]:
    """(config, checkpoint path) for --resume: the checkpoint's saved config overlaid by the user's layers."""
    given: dict[str, Any] = {}
    for _, layer in layers:
        given.update(layer)
    fields = TrainConfig.model_fields
    run_dir = Path(given.get("checkpoint_dir", fields["checkpoint_dir"].default)) / given.get("run_name", fields["run_name"].default)
    path = resolve_checkpoint(spec, run_dir)
    meta = read_meta(path)
    try:
        cfg = build_config([(f"checkpoint {path}", meta["config"]), *layers])
    except ConfigError as e:
        raise CheckpointError(f"{path / META_FILE}: its config cannot be used: {e}") from None
    check_config(meta["config"], cfg, path)
    newer = [p for p in list_checkpoints(Path(cfg.checkpoint_dir) / cfg.run_name) if step_of(p) > meta["step"] and p.resolve() != path.resolve()]
    if newer:
        raise CheckpointError(f"checkpoint {path} is older than {newer[-1]} of the same run; continuing here would mix "
                              "two histories: pass --run_name NEW to branch off, or --resume latest")
    return cfg, path


def fresh_run_guard(cfg: TrainConfig) -> None:
    """Refuse to start a fresh run over a run directory that already holds checkpoints (pruning would mix them)."""
    found = list_checkpoints(Path(cfg.checkpoint_dir) / cfg.run_name)
    if found:
        raise CheckpointError(f"run {cfg.run_name!r} already has checkpoints (newest {found[-1]}): pass --resume latest "
                              "to continue it, or a new --run_name to start another run")
