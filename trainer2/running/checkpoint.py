"""Checkpoints: <checkpoint_dir>/<run_name>/step_<N>/ with tensors.safetensors and a meta.json sidecar.

This module does the atomic I/O and the validation; what goes into a checkpoint is the Trainer's
(`Trainer.state_dict` / `load_state_dict`), and the resume policy is trainer2.running.resume's.

A save writes a temporary directory beside the target, fsyncs it and renames it into place, so a
directory named step_<N> is always complete; the sidecar (written last) carries the size and sha256
of the tensor file, so truncation and corruption are caught on load. Loading copies into the live
tensors in place, so anything holding them (a captured CUDA graph) still sees the same buffers.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from trainer2.data.dataset import Dataset, InputSpec
from trainer2.io import strictjson
from trainer2.io.safeio import not_regular, open_regular, refuse_links
from trainer2.section import short_repr
from trainer2.train_config import SPELLS, TrainConfig, upgrade_legacy

FORMAT_VERSION = 2  # 2: the sampler state is O(1) (no stored permutation); text tokens hashed in their smallest type
TENSORS_FILE = "tensors.safetensors"
META_FILE = "meta.json"
TMP_PREFIX = ".tmp-"
STEP_RE = re.compile(r"step_(\d{8,})")
SAVE_FILES = (TENSORS_FILE, META_FILE)  # all a save writes into step_<N>/ (the sidecar last), and all pruning deletes

# Fields that only steer the run; they may change on resume. Every other field defines the model,
# the data or the learning rule and must match the checkpoint (a new field is fixed until listed here).
RESUME_FREE_FIELDS = frozenset(
    {
        "run_name",
        "device",
        "cpu_threads",
        "checkpoint_dir",
        "static_shapes",
        "capture_batch_size",
        "use_cudagraphs",
        "warmup_steps",
        "use_torch_compile",
        "cudnn_benchmark",
        "cudnn_deterministic",
        "allow_tf32",
        "max_windows",
        "max_epochs",
        "log_every_windows",
        "eval_every_windows",
        "eval_batches",
        "save_every_windows",
        "keep_last",
        "step_progress_every",
        "timing_debug",
        "compile_mode",
        "profile_windows",
        "cleanup_every",
        "cleanup_threshold",
        "tensorboard",
        "dist_timeout_seconds",
        "window_backend",  # how the relaxation is computed, not what: either backend's checkpoint resumes on the other
        "update_backend",  # likewise for the update
        "readout_backend",  # and for the readout's gradients
        "ema_decay",  # what evaluation scores, not how the parameters train: an average is kept, dropped or begun anew
        "token_cache",  # where the tokens are cached; the data fingerprint says whether they are the same tokens
        # per process: the global batch (batch_size x world size) is what must match, checked by Trainer.load_checkpoint
        "batch_size",
        # the data file's path: its contents must match, checked by their fingerprint (check_data), so a moved file
        # resumes
        "data",
        "data_format",  # how the data file is read; the fingerprint says whether it is the same data
    }
)


# Fields added after checkpoints were first written, with the value that reproduces what those checkpoints' runs
# did: a checkpoint without the field is compared, resumed and evaluated as if it held this value.
# `rule` came with the learning rules: older checkpoints hold symmetric_nudge, its old spelling (false: ep_positive),
# which upgrade_legacy turns into rule, so the value here is for a checkpoint holding neither.
ADDED_FIELDS: dict[str, Any] = {
    "augment_shift": 0,
    "data_format": "auto",
    "label_column": None,  # CSV data came later: no earlier run read one
    "relaxation": "jacobi",
    "rule": "ep",
    "cost": "retrieval",
    "validation_fraction": 0.0,
    "maxpool_argmax": "own",  # what the EP statistic always did (each phase's own argmax)
    "spectral_cap_mode": "scale",  # what the spectral cap always did (the whole coupling scaled)
    "couplings": [],  # every earlier energy was a chain
}


def saved_config(config: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's config as the lowest layer of a run built from it: a field added since it was written takes the
    value its run used (ADDED_FIELDS), not today's default, with a note where the default has changed since; a field
    the checkpoint holds under an old spelling (symmetric_nudge for rule) is left to that spelling."""
    out = dict(config)
    for field, value in ADDED_FIELDS.items():
        if field in out or any(SPELLS.get(old) == field for old in out):
            continue
        out[field] = value
        default = TrainConfig.model_fields[field].default
        if value != default:
            warnings.warn(
                f"{field}: the checkpoint predates this field, so it goes on with {field} {value!r} as its run did; "
                f"the default is now {default!r}",
                FutureWarning,
                stacklevel=2,
            )
    return out


class CheckpointError(ValueError):
    """A missing, partial, corrupt or mismatched checkpoint; the message names the file and the problem."""


def fixed_fields() -> list[str]:
    """Config fields that must equal the checkpoint's on resume."""
    return [f for f in TrainConfig.model_fields if f not in RESUME_FREE_FIELDS]


# --- layout ---


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def step_of(path: Path) -> int:
    return int(STEP_RE.fullmatch(path.name).group(1))


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run (directories named step_<N>), oldest first; temporary ones never count."""
    if not run_dir.is_dir():
        return []
    found = [p for p in run_dir.iterdir() if p.is_dir() and STEP_RE.fullmatch(p.name)]
    return sorted(found, key=step_of)


def find_latest(run_dir: Path) -> Path:
    """The newest complete checkpoint of a run; a run with none is an error, never a silent fresh start."""
    found = list_checkpoints(run_dir)
    if not found:
        raise CheckpointError(
            f"no checkpoint to resume in {run_dir}: expected a directory step_<N>/ there "
            "(check --run_name and --checkpoint_dir, or drop --resume to start afresh)"
        )
    return found[-1]


def resolve_checkpoint(spec: str, run_dir: Path) -> Path:
    """'latest' -> the run's newest checkpoint; anything else is a checkpoint directory or a run folder (its newest)."""
    if spec == "latest":
        return find_latest(run_dir)
    path = Path(spec)
    if not path.is_dir():
        raise CheckpointError(
            f"checkpoint {path}: no such directory; expected 'latest', a run folder or a step_<N>/ directory"
        )
    return checkpoint_in(path)


def checkpoint_in(path: Path) -> Path:
    """The checkpoint directory `path` names: itself (a step_<N>/ directory, or any directory with a sidecar), or the
    newest checkpoint of the run folder `path`."""
    if STEP_RE.fullmatch(path.name) or (path / META_FILE).exists() or not path.is_dir():
        return path  # a broken one is refused by read_meta, naming what is missing
    found = list_checkpoints(path)
    if not found:
        raise CheckpointError(
            f"{path}: neither a checkpoint (a step_<N>/ directory with {META_FILE}) nor a run folder holding one; "
            "pass a run folder whose run has saved, a step_<N>/ directory, or 'latest'"
        )
    return found[-1]


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
    target = run_dir / step_name(step)
    refuse_links(run_dir, target)  # a planted link would carry the checkpoint (or the pruning) elsewhere
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f"{TMP_PREFIX}{target.name}-{os.getpid()}"
    if tmp.is_symlink():  # never followed: the link goes, not what it points to
        tmp.unlink()
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        # safetensors wants contiguous CPU tensors that share no storage.
        save_file(
            {k: t.detach().to("cpu", copy=True).contiguous() for k, t in tensors.items()}, str(tmp / TENSORS_FILE)
        )
        _fsync(tmp / TENSORS_FILE)
        meta = {
            **meta,
            "format_version": FORMAT_VERSION,
            "step": step,
            "tensors": {
                "file": TENSORS_FILE,
                "bytes": (tmp / TENSORS_FILE).stat().st_size,
                "sha256": _sha256(tmp / TENSORS_FILE),
            },
        }
        with open(tmp / META_FILE, "w", encoding="utf-8") as f:
            f.write(strictjson.dumps(meta, indent=1))  # a diverged run's history holds NaN: null, not NaN
            f.flush()
            os.fsync(f.fileno())
        if target.exists():  # re-saving a step (a resume from an older checkpoint): swap, then drop the old one
            for name in foreign_entries(target):  # what no save wrote (a user's notes) moves into the new one
                os.rename(target / name, tmp / name)
        _fsync(tmp)
        if target.exists():
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


def recorded_run(path: Path) -> str | None:
    """The run id a checkpoint's sidecar records (None: unreadable, or written before runs had ids)."""
    try:
        with open_regular(path / META_FILE) as f:
            rid = json.loads(f.read().decode("utf-8")).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None
    return rid if isinstance(rid, str) else None


def prune(run_dir: Path, keep_last: int, run_id: str) -> list[Path]:
    """Delete all but the newest keep_last of the run's own checkpoints: those whose sidecar records `run_id`. A
    directory merely named like a checkpoint (another run's, a link) is never removed, and of one holding anything a
    save does not write only the save's files go, with a warning naming what stays. Returns the checkpoints removed."""
    own = [p for p in list_checkpoints(run_dir) if not p.is_symlink() and recorded_run(p) == run_id]
    old = own[:-keep_last]
    for path in old:
        kept = foreign_entries(path)
        if not kept:
            shutil.rmtree(path)
            continue
        for name in SAVE_FILES:  # the sidecar last: until it goes, the directory is still this run's to finish pruning
            (path / name).unlink(missing_ok=True)
        shown = ", ".join(kept[:5]) + (f" and {len(kept) - 5} more" if len(kept) > 5 else "")
        warnings.warn(
            f"pruning checkpoint {path}: removed the save's own files but kept the directory, which holds what no save "
            f"writes: {shown}; move or delete them yourself",
            stacklevel=2,
        )
    return old


def foreign_entries(path: Path) -> list[str]:
    """Names in checkpoint directory `path` that its save did not write (another run's directory, a user's notes)."""
    own = {name for name in SAVE_FILES if (path / name).is_file() and not (path / name).is_symlink()}
    return sorted(p.name for p in path.iterdir() if p.name not in own)


# --- reading ---


def read_meta(path: Path) -> dict[str, Any]:
    """The validated sidecar of a checkpoint directory."""
    file = path / META_FILE
    if not path.is_dir():
        what = "is not a directory" if path.exists() else "no such directory"
        raise CheckpointError(f"checkpoint {path}: {what}; expected a step_<N>/ checkpoint directory")
    try:
        with open_regular(file) as f:
            raw = f.read()
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint {path}: missing {META_FILE} (the sidecar); the save did not finish or the file was removed"
        ) from None
    except OSError as e:
        raise CheckpointError(f"{file}: {e.strerror}; expected the checkpoint's JSON sidecar") from None
    try:
        meta = json.loads(raw.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: not valid JSON ({e}); the sidecar is corrupt") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got {type(meta).__name__}")
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{file}: checkpoint format version {version!r}; this trainer reads version {FORMAT_VERSION}"
        )
    kinds = {"step": int, "config": dict, "counters": dict, "data": dict, "history": list, "tensors": dict}
    missing = [k for k in kinds if k not in meta]
    if missing:
        raise CheckpointError(f"{file}: missing key(s) {missing}; the sidecar is incomplete")
    for key, kind in kinds.items():
        if not isinstance(meta[key], kind):
            raise CheckpointError(f"{file}: {key!r} must be a JSON {kind.__name__}, got {type(meta[key]).__name__}")
    if not isinstance(meta["tensors"].get("bytes"), int) or not isinstance(meta["tensors"].get("sha256"), str):
        raise CheckpointError(f"{file}: 'tensors' must record the tensor file's 'bytes' and 'sha256'")
    check_fields(meta, file)
    named = STEP_RE.fullmatch(path.name)
    if named and int(named.group(1)) != meta["step"]:
        raise CheckpointError(
            f"{file}: records step {meta['step']}, but its directory is named {path.name}; "
            "was it renamed or copied over?"
        )
    return meta


def _count(v: Any, least: int) -> bool:
    """Whether v is a JSON integer >= least (not a bool, not a float)."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= least


def check_fields(meta: dict[str, Any], file: Path) -> None:
    """The sidecar's fields that the trainer reads as numbers, rows or names must be of those types (a hand-edited or
    corrupt one is refused here, not with a traceback later, nor after training has finished)."""
    c = meta["counters"]
    bad = [
        f"counters.{k} must be an integer >= {least}, got {short_repr(c.get(k))}"
        for k, least, needed in (
            ("window", 0, True),
            ("examples", 0, True),
            ("sampler_epoch", 0, False),
            ("sampler_pos", 0, False),
            ("global_batch", 1, False),
            ("world_size", 1, False),
        )
        if (needed or k in c) and not _count(c.get(k), least)
    ]
    wall = c.get("wall_seconds")
    if not (isinstance(wall, (int, float)) and not isinstance(wall, bool) and math.isfinite(wall) and wall >= 0):
        bad.append(f"counters.wall_seconds must be a finite number >= 0, got {short_repr(wall)}")
    if not _count(meta["step"], 0) or (_count(c.get("window"), 0) and c["window"] != meta["step"]):
        bad.append(f"step must equal counters.window, got {short_repr(meta['step'])} and {short_repr(c.get('window'))}")
    rows = [i for i, r in enumerate(meta["history"]) if not isinstance(r, dict)]
    if rows:
        bad.append(
            f"history[{rows[0]}] must be a JSON object (a logged row), got {short_repr(meta['history'][rows[0]])}"
        )
    for key, kind in (("versions", dict), ("run_id", str), ("saved_at", str)):
        if key in meta and not isinstance(meta[key], kind):
            bad.append(f"{key!r} must be a JSON {'object' if kind is dict else 'string'}, got {short_repr(meta[key])}")
    if bad:
        raise CheckpointError(f"{file}: " + "; ".join(bad) + "; the sidecar is corrupt or was edited")


def check_generators(loaded: dict[str, Tensor], file: Path) -> None:
    """Refuse random-generator states (of torch and the sampler) that torch cannot take back, before any is set."""
    for key in ("rng.cpu", "sampler.generator"):
        if key in loaded:
            try:
                torch.Generator().set_state(loaded[key].to(torch.uint8))
            except RuntimeError as e:
                raise CheckpointError(f"{file}: tensor {key!r} is no valid random-generator state ({e})") from None


def read_verified(path: Path) -> dict[str, Any]:
    """The sidecar of checkpoint directory `path`, returned only once its tensor file matches the size and sha256 the
    sidecar records: nothing of a checkpoint (its config least of all) is used before its integrity is checked."""
    meta = read_meta(path)
    check_integrity(path, meta)
    return meta


def check_integrity(path: Path, meta: dict[str, Any]) -> Path:
    """The checkpoint's tensor file, refused unless it is a regular file of the size and sha256 the sidecar records."""
    file, want = path / TENSORS_FILE, meta["tensors"]
    if not file.exists():
        raise CheckpointError(f"checkpoint {path}: missing {TENSORS_FILE}; the checkpoint is partial")
    kind = not_regular(file.stat().st_mode)
    if kind is not None:
        raise CheckpointError(f"{file}: is not a regular file ({kind}); expected the checkpoint's tensors")
    size = file.stat().st_size
    if size != want["bytes"]:
        raise CheckpointError(
            f"{file}: {size} bytes, the sidecar records {want['bytes']}; the file is truncated or was replaced"
        )
    if _sha256(file) != want["sha256"]:
        raise CheckpointError(f"{file}: sha256 differs from the one in {META_FILE}; the file is corrupt")
    return file


def load_tensors(path: Path, meta: dict[str, Any]) -> dict[str, Tensor]:
    """The tensor file, checked against the size and sha256 recorded in the sidecar."""
    file = check_integrity(path, meta)
    try:
        return load_file(str(file))
    except Exception as e:  # the Rust reader's error type differs between safetensors versions
        raise CheckpointError(f"{file}: cannot be read as safetensors ({e})") from None


def check_config(saved: dict[str, Any], cfg: TrainConfig, source: Path) -> None:
    """Refuse a config whose model/data/learning fields differ from the checkpoint's, naming each with both values."""
    now = cfg.model_dump(mode="json")
    try:
        saved = {**ADDED_FIELDS, **upgrade_legacy(saved)}  # a checkpoint written before a rename uses the old name
    except ValueError as e:
        raise CheckpointError(f"checkpoint {source}: its config cannot be read: {e}") from None
    bad = [
        f"{k}: checkpoint has {saved.get(k)!r}, requested {now[k]!r}" for k in fixed_fields() if saved.get(k) != now[k]
    ]
    if bad:
        raise CheckpointError(
            f"checkpoint {source} does not match the requested config (these fields define the model, "
            "data or learning rule and cannot change on resume; start a new --run_name to change them):\n  "
            + "\n  ".join(bad)
        )


# --- trainer state ---


def data_fingerprint(data: Dataset) -> dict[str, Any]:
    """What identifies the data: source, vocabulary, split sizes and a sha256 of every split's contents; with what a
    machine needs of its inputs (InputSpec), so a checkpoint loads without its data."""
    digest = data.digest  # a token cache's: the same hash, taken when the cache was made
    if digest is None:
        h = hashlib.sha256()
        for t in (data.train, data.heldout, data.train_y, data.heldout_y, data.validation, data.validation_y):
            if t is not None:
                h.update(t.contiguous().numpy())  # the buffer itself: no copy of a 100 MB corpus
        digest = h.hexdigest()
    return {
        "source": data.source,
        "kind": data.kind,
        "vocab": data.vocab,
        "num_train": data.num_examples("train"),
        "num_heldout": data.num_examples("heldout"),
        **({"num_validation": data.num_examples("validation")} if data.validation is not None else {}),
        "sha256": digest,
        **InputSpec.of(data).to_json(),
    }


def versions() -> dict[str, str]:
    """Library versions, recorded in every checkpoint."""
    import platform

    import numpy
    import pydantic
    import safetensors

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "safetensors": safetensors.__version__,
        "numpy": numpy.__version__,
        "pydantic": pydantic.__version__,
    }


def check_data(saved: dict[str, Any], now: dict[str, Any], path: Path) -> None:
    """Refuse a checkpoint whose data fingerprint differs from the data loaded now, naming what differs."""
    for key in ("kind", "vocab", "num_train", "num_heldout", "sha256"):
        if saved.get(key) != now[key]:
            what = "vocabulary" if key == "vocab" else key
            raise CheckpointError(
                f"checkpoint {path}: the data differs from the checkpoint's ({what}: checkpoint "
                f"{short_repr(saved.get(key))}, now {short_repr(now[key])}; source {now['source']})"
            )


def check_tensors(
    loaded: dict[str, Tensor], like: dict[str, Tensor], file: Path, optional: frozenset[str] = frozenset()
) -> None:
    """Refuse a tensor file whose names, shapes or dtypes differ from `like` (names in `optional` may be absent or
    extra)."""
    missing = sorted(set(like) - set(loaded) - optional)
    extra = sorted(set(loaded) - set(like) - optional)
    if missing or extra:
        raise CheckpointError(f"{file}: tensor names do not match this trainer (missing {missing}, unexpected {extra})")
    for k, dst in like.items():
        if k not in loaded:
            continue
        src = loaded[k]
        if src.shape != dst.shape or src.dtype != dst.dtype:
            raise CheckpointError(
                f"{file}: tensor {k!r} is {src.dtype} {tuple(src.shape)}, expected {dst.dtype} {tuple(dst.shape)}"
            )


def load_checked(
    path: Path,
    cfg: TrainConfig,
    fingerprint: dict[str, Any] | None,
    live: dict[str, Tensor],
    only: tuple[str, ...] | None = None,
    optional: frozenset[str] = frozenset(),
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """(tensors, meta) of checkpoint directory `path`, checked against this run before anything is copied: its
    config (the fields that define the model), the data's fingerprint (None: no data at hand, as for a model loaded
    to predict), every tensor's name, shape and dtype against `live` (only the keys with the given prefixes, when
    `only` is set), and its counters. The one place a checkpoint is validated; training, evaluation and loading a
    model all go through it."""
    meta = read_meta(path)
    loaded = load_tensors(path, meta)  # its integrity (size, sha256) first: nothing of a corrupt checkpoint is used
    check_config(meta["config"], cfg, path)
    if fingerprint is not None:
        check_data(meta["data"], fingerprint, path)
    if only is not None:
        loaded = {k: v for k, v in loaded.items() if k.startswith(only)}
    check_tensors(loaded, live, path / TENSORS_FILE, optional=optional)
    check_counters(meta, path)
    check_generators(loaded, path / TENSORS_FILE)
    check_finite(loaded, path)
    return loaded, meta


def nonfinite_tensor(tensors: dict[str, Tensor]) -> str | None:
    """The key of the first floating-point tensor holding a NaN or an infinity, None when all are finite. The metric
    sums are not judged: a window whose update was dropped may leave a non-finite loss there (health.py's to judge)."""
    for key, t in tensors.items():
        if key != "metrics" and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return key
    return None


def last_finite(path: Path) -> Path | None:
    """The newest checkpoint of `path`'s run older than `path` whose tensors are intact and finite, or None."""
    for other in reversed([p for p in list_checkpoints(path.parent) if step_of(p) < step_of(path)]):
        try:
            if nonfinite_tensor(load_tensors(other, read_meta(other))) is None:
                return other
        except CheckpointError:
            continue
    return None


def check_finite(loaded: dict[str, Tensor], path: Path) -> None:
    """Refuse a checkpoint whose parameters (or update state, or memory bank) are not finite, naming the tensor and
    the run's last checkpoint that is finite: a corrupt or hand-edited file whose checksum was made to match."""
    key = nonfinite_tensor(loaded)
    if key is None:
        return
    t = loaded[key]
    bad = int((~torch.isfinite(t)).sum())
    good = last_finite(path) if STEP_RE.fullmatch(path.name) else None
    hint = (
        f"the run's last checkpoint with finite tensors is {good} (resume it into a new --run_name, or remove "
        f"{path} first)"
        if good
        else "the run has no older checkpoint with finite tensors"
    )
    raise CheckpointError(
        f"{path / TENSORS_FILE}: tensor {key!r} holds {bad} non-finite value(s) (NaN or inf) of {t.numel()}; {hint}"
    )


def check_counters(meta: dict[str, Any], path: Path) -> None:
    """The sidecar's counters must be numbers."""
    c = meta["counters"]
    for k in ("window", "examples", "wall_seconds"):
        if not isinstance(c.get(k), (int, float)) or isinstance(c.get(k), bool):
            raise CheckpointError(f"{path / META_FILE}: counters.{k} must be a number, got {c.get(k)!r}")
