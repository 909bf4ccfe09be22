"""Checkpoints: <checkpoint_dir>/<run_name>/step_<N>/ with tensors.safetensors and a meta.json sidecar.

A save writes a temporary directory beside the target, fsyncs it and renames it into place, so a
directory named step_<N> is always complete; the sidecar (written last) carries the size and sha256
of the tensor file, so truncation and corruption are caught on load. Loading copies into the live
tensors in place, so anything holding them (a captured CUDA graph) still sees the same buffers.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from trainer2.config import ConfigError, TrainConfig, build_config

if TYPE_CHECKING:
    from trainer2.data import Dataset
    from trainer2.trainer import Trainer

FORMAT_VERSION = 1
TENSORS_FILE = "tensors.safetensors"
META_FILE = "meta.json"
TMP_PREFIX = ".tmp-"
STEP_RE = re.compile(r"step_(\d{8,})")

# Fields that only steer the run; they may change on resume. Every other field defines the model,
# the data or the learning rule and must match the checkpoint (a new field is fixed until listed here).
RESUME_FREE_FIELDS = frozenset({
    "run_name", "device", "checkpoint_dir",
    "static_shapes", "capture_batch_size", "use_cudagraphs", "warmup_steps", "use_torch_compile",
    "cudnn_benchmark", "cudnn_deterministic", "allow_tf32",
    "max_windows", "max_epochs", "log_every_windows", "eval_every_windows", "eval_batches",
    "save_every_windows", "keep_last", "step_progress_every", "timing_debug",
    "compile_mode", "profile_windows", "cleanup_every", "cleanup_threshold", "tensorboard",
})


class CheckpointError(ValueError):
    """A missing, partial, corrupt or mismatched checkpoint; the message names the file and the problem."""


def fixed_fields() -> list[str]:
    """Config fields that must equal the checkpoint's on resume."""
    return [f for f in TrainConfig.model_fields if f not in RESUME_FREE_FIELDS]


# --- layout ---


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def _step_of(path: Path) -> int:
    return int(STEP_RE.fullmatch(path.name).group(1))


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run (directories named step_<N>), oldest first; temporary ones never count."""
    if not run_dir.is_dir():
        return []
    found = [p for p in run_dir.iterdir() if p.is_dir() and STEP_RE.fullmatch(p.name)]
    return sorted(found, key=_step_of)


def find_latest(run_dir: Path) -> Path:
    """The newest complete checkpoint of a run; a run with none is an error, never a silent fresh start."""
    found = list_checkpoints(run_dir)
    if not found:
        raise CheckpointError(f"no checkpoint to resume in {run_dir}: expected a directory step_<N>/ there "
                              "(check --run_name and --checkpoint_dir, or drop --resume to start afresh)")
    return found[-1]


def resolve_checkpoint(spec: str, run_dir: Path) -> Path:
    """'latest' -> the run's newest checkpoint; anything else is a checkpoint directory path."""
    if spec == "latest":
        return find_latest(run_dir)
    path = Path(spec)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path}: no such directory; expected 'latest' or a step_<N>/ directory")
    return path


# --- saving ---


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def save(run_dir: Path, step: int, tensors: dict[str, Tensor], meta: dict[str, Any]) -> Path:
    """Write run_dir/step_<N>/ atomically: temp dir, fsync files and dirs, rename. Returns the new path."""
    run_dir.mkdir(parents=True, exist_ok=True)
    target = run_dir / step_name(step)
    tmp = run_dir / f"{TMP_PREFIX}{target.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        # safetensors wants contiguous CPU tensors that share no storage.
        save_file({k: t.detach().to("cpu", copy=True).contiguous() for k, t in tensors.items()}, str(tmp / TENSORS_FILE))
        _fsync(tmp / TENSORS_FILE)
        meta = {**meta, "format_version": FORMAT_VERSION, "step": step,
                "tensors": {"file": TENSORS_FILE, "bytes": (tmp / TENSORS_FILE).stat().st_size, "sha256": _sha256(tmp / TENSORS_FILE)}}
        with open(tmp / META_FILE, "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync(tmp)
        if target.exists():  # re-saving a step (a resume from an older checkpoint): swap, then drop the old one
            old = run_dir / f"{TMP_PREFIX}old-{target.name}-{os.getpid()}"
            os.rename(target, old)
            os.rename(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, target)
        _fsync(run_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def prune(run_dir: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest keep_last complete checkpoints; returns what was removed."""
    old = list_checkpoints(run_dir)[:-keep_last]
    for path in old:
        shutil.rmtree(path)
    return old


# --- reading ---


def read_meta(path: Path) -> dict[str, Any]:
    """The validated sidecar of a checkpoint directory."""
    file = path / META_FILE
    if not file.is_file():
        raise CheckpointError(f"checkpoint {path}: missing {META_FILE} (the sidecar); the save did not finish or the file was removed")
    try:
        meta = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: not valid JSON ({e}); the sidecar is corrupt") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got {type(meta).__name__}")
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{file}: checkpoint format version {version!r}; this trainer reads version {FORMAT_VERSION}")
    kinds = {"step": int, "config": dict, "counters": dict, "data": dict, "history": list, "tensors": dict}
    missing = [k for k in kinds if k not in meta]
    if missing:
        raise CheckpointError(f"{file}: missing key(s) {missing}; the sidecar is incomplete")
    for key, kind in kinds.items():
        if not isinstance(meta[key], kind):
            raise CheckpointError(f"{file}: {key!r} must be a JSON {kind.__name__}, got {type(meta[key]).__name__}")
    if not isinstance(meta["tensors"].get("bytes"), int) or not isinstance(meta["tensors"].get("sha256"), str):
        raise CheckpointError(f"{file}: 'tensors' must record the tensor file's 'bytes' and 'sha256'")
    named = STEP_RE.fullmatch(path.name)
    if named and int(named.group(1)) != meta["step"]:
        raise CheckpointError(f"{file}: records step {meta['step']}, but its directory is named {path.name}; "
                              "was it renamed or copied over?")
    return meta


def load_tensors(path: Path, meta: dict[str, Any]) -> dict[str, Tensor]:
    """The tensor file, checked against the size and sha256 recorded in the sidecar."""
    file, want = path / TENSORS_FILE, meta["tensors"]
    if not file.is_file():
        raise CheckpointError(f"checkpoint {path}: missing {TENSORS_FILE}; the checkpoint is partial")
    size = file.stat().st_size
    if size != want["bytes"]:
        raise CheckpointError(f"{file}: {size} bytes, the sidecar records {want['bytes']}; the file is truncated or was replaced")
    if _sha256(file) != want["sha256"]:
        raise CheckpointError(f"{file}: sha256 differs from the one in {META_FILE}; the file is corrupt")
    try:
        return load_file(str(file))
    except Exception as e:  # the Rust reader's error type differs between safetensors versions
        raise CheckpointError(f"{file}: cannot be read as safetensors ({e})") from None


def check_config(saved: dict[str, Any], cfg: TrainConfig, source: Path) -> None:
    """Refuse a config whose model/data/learning fields differ from the checkpoint's, naming each with both values."""
    now = cfg.model_dump(mode="json")
    bad = [f"{k}: checkpoint has {saved.get(k)!r}, requested {now[k]!r}" for k in fixed_fields() if saved.get(k) != now[k]]
    if bad:
        raise CheckpointError(f"checkpoint {source} does not match the requested config (these fields define the model, "
                              "data or learning rule and cannot change on resume; start a new --run_name to change them):\n  "
                              + "\n  ".join(bad))


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
    newer = [p for p in list_checkpoints(Path(cfg.checkpoint_dir) / cfg.run_name) if _step_of(p) > meta["step"] and p.resolve() != path.resolve()]
    if newer:
        raise CheckpointError(f"checkpoint {path} is older than {newer[-1]} of the same run; continuing here would mix "
                              "two histories: pass --run_name NEW to branch off, or --resume latest")
    return cfg, path


# --- trainer state ---


def data_fingerprint(data: Dataset) -> dict[str, Any]:
    """What identifies the data: source, vocabulary, split sizes and a sha256 of every split's contents."""
    h = hashlib.sha256()
    for t in (data.train, data.heldout, data.train_y, data.heldout_y):
        if t is not None:
            h.update(t.contiguous().numpy().tobytes())
    return {"source": data.source, "kind": data.kind, "vocab": data.vocab, "num_train": data.num_examples("train"),
            "num_heldout": data.num_examples("heldout"), "sha256": h.hexdigest()}


def live_tensors(tr: Trainer) -> dict[str, Tensor]:
    """Every tensor of the run's state that load copies into in place: parameters, update state, metrics, memory."""
    out = {f"param.{k}": v for k, v in tr.machine.named_params().items()}
    out.update(tr.learner.update.tensors(tr.learner.names))
    out["metrics"] = tr.learner.metrics
    if tr.memory is not None:
        out.update(tr.memory.tensors())
    return out


def _versions() -> dict[str, str]:
    import numpy
    import pydantic
    import safetensors

    return {"python": platform.python_version(), "torch": torch.__version__, "safetensors": safetensors.__version__,
            "numpy": numpy.__version__, "pydantic": pydantic.__version__}


def save_trainer(tr: Trainer) -> Path:
    """Checkpoint the trainer at its current window, then prune to keep_last."""
    tensors = dict(live_tensors(tr))
    tensors.update({f"sampler.{k}": v for k, v in tr.sampler.state_dict().items()})
    tensors["rng.cpu"] = torch.get_rng_state()
    if tr.device.type == "cuda":
        tensors["rng.cuda"] = torch.cuda.get_rng_state(tr.device)
    p = tr.progress
    meta = {
        "config": tr.cfg.model_dump(mode="json"),
        "counters": {"window": p.window, "examples": p.examples, "epoch": p.window / tr.sampler.batches_per_epoch,
                     "sampler_epoch": tr.sampler.epoch, "sampler_pos": int(tr.sampler.state_dict()["pos"]),
                     "wall_seconds": p.wall_seconds},
        "data": data_fingerprint(tr.data),
        "history": tr.history,
        "versions": _versions(),
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    path = save(tr.run_dir, p.window, tensors, meta)
    prune(tr.run_dir, tr.cfg.keep_last)
    return path


def load_trainer(tr: Trainer, path: Path) -> dict[str, Any]:
    """Restore a trainer from a checkpoint in place; everything is checked before anything is copied. Returns the sidecar."""
    meta = read_meta(path)
    check_config(meta["config"], tr.cfg, path)
    data = data_fingerprint(tr.data)
    for key in ("kind", "vocab", "num_train", "num_heldout", "sha256"):
        if meta["data"].get(key) != data[key]:
            what = "vocabulary" if key == "vocab" else key
            raise CheckpointError(f"checkpoint {path}: the data differs from the checkpoint's ({what}: checkpoint "
                                  f"{meta['data'].get(key)!r}, now {data[key]!r}; source {data['source']})")
    loaded = load_tensors(path, meta)
    live = live_tensors(tr)
    sampler_keys = {f"sampler.{k}" for k in tr.sampler.state_dict()}
    expected = set(live) | sampler_keys | {"rng.cpu"}
    file = path / TENSORS_FILE
    missing, extra = sorted(expected - set(loaded)), sorted(set(loaded) - expected - {"rng.cuda"})
    if missing or extra:
        raise CheckpointError(f"{file}: tensor names do not match this trainer (missing {missing}, unexpected {extra})")
    like = {**live, **{f"sampler.{k}": v for k, v in tr.sampler.state_dict().items()}, "rng.cpu": torch.get_rng_state()}
    for k, dst in like.items():
        src = loaded[k]
        if src.shape != dst.shape or src.dtype != dst.dtype:
            raise CheckpointError(f"{file}: tensor {k!r} is {src.dtype} {tuple(src.shape)}, expected {dst.dtype} {tuple(dst.shape)}")
    c = meta["counters"]
    for k in ("window", "examples", "wall_seconds"):
        if not isinstance(c.get(k), (int, float)):
            raise CheckpointError(f"{path / META_FILE}: counters.{k} must be a number, got {c.get(k)!r}")
    if meta.get("versions", {}).get("torch") != torch.__version__:
        tr.log(f"warning: checkpoint {path} was written with torch {meta.get('versions', {}).get('torch')}, "
               f"this is {torch.__version__}; the resumed run may not be bitwise identical")
    for k, dst in live.items():
        dst.copy_(loaded[k])
    tr.sampler.load_state_dict({k.removeprefix("sampler."): loaded[k] for k in sampler_keys})
    torch.set_rng_state(loaded["rng.cpu"])
    if tr.device.type == "cuda" and "rng.cuda" in loaded:
        torch.cuda.set_rng_state(loaded["rng.cuda"], tr.device)
    tr.progress.window, tr.progress.examples, tr.progress.wall_seconds = int(c["window"]), int(c["examples"]), float(c["wall_seconds"])
    tr.history = list(meta["history"])
    return meta


def fresh_run_guard(cfg: TrainConfig) -> None:
    """Refuse to start a fresh run over a run directory that already holds checkpoints (pruning would mix them)."""
    found = list_checkpoints(Path(cfg.checkpoint_dir) / cfg.run_name)
    if found:
        raise CheckpointError(f"run {cfg.run_name!r} already has checkpoints (newest {found[-1]}): pass --resume latest "
                              "to continue it, or a new --run_name to start another run")


def load_for_inference(path: str | Path, overrides: dict[str, Any] | None = None) -> "Trainer":
    """A Trainer restored from checkpoint directory `path`, for evaluation or sampling; `overrides` may set
    run-steering fields such as device or eval_batches. Progress messages go to stderr."""
    import sys

    from trainer2.trainer import Trainer

    path = Path(path)
    meta = read_meta(path)
    cfg = build_config([(f"checkpoint {path}", meta["config"]), ("command line", overrides or {})])
    trainer = Trainer(cfg, log=lambda msg: print(msg, file=sys.stderr))
    trainer.load_checkpoint(path)
    return trainer
