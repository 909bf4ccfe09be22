"""A trained machine as a model: class probabilities and predictions for new inputs, held-out evaluation, and `load`
from a checkpoint (which needs no data set where the checkpoint records its inputs' shape).

Inputs are what the data set held before it became rows: feature rows [N, D], raw images [N, H, W] or [N, C, H, W]
(normalised here as the training images were), or token ids [N, context_len] for text. A numpy array comes back as
numpy, a torch tensor as a torch tensor on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from trainer2.components import UntrustedCodeError
from trainer2.data.dataset import SPLITS, DataError, Dataset, InputSpec
from trainer2.data.images import normalised_rows
from trainer2.data.load import DataConfig, load_data
from trainer2.data.text import BUILTIN_SOURCE
from trainer2.learning.averaging import COUNT, PREFIX, average_keys
from trainer2.physics.machine import Machine
from trainer2.physics.memory import MemoryBank
from trainer2.physics.relaxation import DynamicsConfig, Relaxation
from trainer2.running.checkpoint import (
    CheckpointError,
    check_data,
    checkpoint_in,
    data_fingerprint,
    load_checked,
    read_verified,
    saved_config,
)
from trainer2.running.evaluation import EVAL_BATCH, heldout_metrics, relaxation_cache
from trainer2.running.parts import build_machine_for, resolve_device
from trainer2.section import ConfigError
from trainer2.train_config import TrainConfig, accepted_keys, build_config


@dataclass
class Model:
    """A machine (and memory bank) with what it needs to read new inputs; `data` is the data set it was trained on,
    when at hand (loaded from the config's data on first use otherwise)."""

    cfg: TrainConfig
    machine: Machine
    memory: MemoryBank | None
    inputs: InputSpec
    device: torch.device
    window: int  # windows trained
    fingerprint: dict[str, Any]  # of the data it was trained on (trainer2.running.checkpoint.data_fingerprint)
    checkpoint: Path | None = None  # where it was loaded from, or the final checkpoint of the run that trained it
    data: Dataset | None = None
    weights: str = "raw"  # which parameters: "raw" (the trained ones) or "average" (their moving average, ema_decay)
    relaxation: Callable[[int], Relaxation] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.relaxation = relaxation_cache(self.machine, self.cfg.section(DynamicsConfig), self.memory)

    @torch.no_grad()
    def predict_proba(self, x: Any) -> Any:
        """Class probabilities (N, num_classes) of inputs x, one free-phase relaxation per example (in batches)."""
        rows = self.rows(x)
        out = []
        for start in range(0, len(rows), EVAL_BATCH):
            chunk = rows[start : start + EVAL_BATCH].to(self.device)
            relax = self.relaxation(len(chunk))
            targets = torch.zeros(len(chunk), dtype=torch.long, device=self.device)  # beta = 0: only picks the loss
            _, probs = relax.readout_scores(relax.free_phase(chunk, targets))
            out.append(probs.cpu())
        probs = torch.cat(out) if out else torch.zeros(0, self.inputs.num_classes)
        return probs if isinstance(x, Tensor) else probs.numpy()

    def predict(self, x: Any) -> Any:
        """Class ids (N,) of inputs x: the likeliest class of each."""
        return self.predict_proba(x).argmax(1)

    def evaluate(
        self, data: Dataset | None = None, max_batches: int | None = None, split: str = "heldout"
    ) -> dict[str, float]:
        """Loss (nats per example), accuracy and, for text, bits per character on the held-out split (or `split`) of
        `data` (default: the data set the model was trained on, checked to be the same by its fingerprint)."""
        if data is None:
            if self.data is None:
                self.refuse_data_from_memory()
                self.data = load_data(self.cfg.section(DataConfig))
                check_data(self.fingerprint, data_fingerprint(self.data), self.checkpoint or Path("this model"))
            data = self.data
        spec = self.inputs
        if (data.tokens, data.input_dim) != (spec.tokens, spec.input_dim) or data.num_classes > spec.num_classes:
            raise DataError(
                f"{data.source}: {data.kind} of {data.input_dim} values in {data.num_classes} classes; this model "
                f"reads {spec.kind} of {spec.input_dim} values in {spec.num_classes} classes"
            )
        check_split(data, split)
        limit = max_batches if max_batches is not None else self.cfg.eval_batches
        return heldout_metrics(self.relaxation, data, self.device, limit, split)

    def refuse_data_from_memory(self) -> None:
        """A model trained on arrays (no cfg.data, a source other than the built-in corpus) cannot reload its data:
        without this, evaluate() would load the built-in corpus and report that the data differs."""
        source = self.fingerprint.get("source")
        if self.cfg.data is None and source != BUILTIN_SOURCE:
            raise DataError(
                f"this model was trained on data given in memory ({source}), which no file names; pass the data: "
                "model.evaluate(trainer2.from_arrays(x_train, y_train, x_test, y_test))"
            )

    def rows(self, x: Any) -> Tensor:
        """The machine's input rows of raw inputs x, checked against the inputs it was trained on."""
        spec = self.inputs
        a = x.detach().cpu().numpy() if isinstance(x, Tensor) else np.asarray(x)
        if spec.tokens:
            if a.ndim != 2 or a.shape[1] != spec.context_len or not np.issubdtype(a.dtype, np.integer):
                raise DataError(f"x: expected token ids [N, {spec.context_len}], got {a.dtype} {a.shape}")
            if a.size and (a.min() < 0 or a.max() >= spec.num_classes):
                raise DataError(f"x: token ids must be in 0..{spec.num_classes - 1}")
            return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
        if not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer)):
            raise DataError(f"x: expected numbers, got dtype {a.dtype}")
        if spec.input_shape is not None:  # images: (C, H, W), normalised by the training split's statistics
            a = a[:, None] if a.ndim == 3 and len(spec.input_shape) == 3 and spec.input_shape[0] == 1 else a
            if a.shape[1:] != tuple(spec.input_shape):
                raise DataError(f"x: expected images [N, {', '.join(map(str, spec.input_shape))}], got {a.shape}")
            check_finite(a)  # before normalising, so the message names the rows as given
            return normalised_rows(a, np.array(spec.normalise[0]), np.array(spec.normalise[1]))
        if a.ndim != 2 or a.shape[1] != spec.input_dim:
            raise DataError(f"x: expected feature rows [N, {spec.input_dim}], got {a.shape}")
        with np.errstate(over="ignore"):  # a float64 beyond float32's range becomes inf, refused just below
            rows = np.ascontiguousarray(a, dtype=np.float32)
        check_finite(rows)  # after the float32 cast: a float64 1e300 becomes inf there
        return torch.from_numpy(rows)


SHOWN_ROWS = 5  # non-finite rows named in the message; the count says how many more


def check_finite(a: np.ndarray) -> None:
    """Refuse inputs holding NaN or inf (or, above float32, values float32 cannot hold), naming the first rows: a
    machine relaxed from them returns probabilities that mean nothing."""
    if not np.issubdtype(a.dtype, np.floating) or not a.size:
        return  # integers are finite (and every int64 fits float32's range)
    ok = np.isfinite(a)
    if a.dtype.itemsize > 4:
        ok &= np.abs(a) <= np.finfo(np.float32).max
    bad = np.flatnonzero(~ok.reshape(len(a), -1).all(axis=1))
    if len(bad):
        more = f" and {len(bad) - SHOWN_ROWS} more" if len(bad) > SHOWN_ROWS else ""
        which = f"{'row' if len(bad) == 1 else 'rows'} {', '.join(map(str, bad[:SHOWN_ROWS]))}{more}"
        raise DataError(
            f"x: {which} {'holds' if len(bad) == 1 else 'hold'} NaN or inf (or values beyond float32); predictions "
            "need finite inputs: drop or impute those rows"
        )


def check_split(data: Dataset, split: str) -> None:
    """Refuse a split `data` lacks, or no split at all: scoring one would report loss 0 and accuracy 0."""
    if split not in SPLITS:
        raise DataError(f"split: expected one of {', '.join(SPLITS)}, got {split!r}")
    if split == "validation" and data.validation is None:
        raise DataError(
            f"{data.source}: has no validation split; set one apart with data.with_validation(fraction) (in a "
            "config: validation_fraction), or evaluate split='heldout'"
        )
    if data.num_examples(split) < 1:
        raise DataError(f"{data.source}: its {split} split holds no examples to score")


WEIGHTS = ("auto", "average", "raw")
WEIGHTS_HELP = (
    "Which parameters: the weight average the run kept (ema_decay > 0), the raw ones, or auto (default): the average "
    "where there is one."
)


def load(
    path: str | Path, device: str | None = None, weights: str = "auto", *, trust_code: bool = False, **overrides: Any
) -> Model:
    """The model saved in checkpoint directory `path` (parameters and memory bank; no update state). weights: "auto"
    (the weight average where the run kept one, ema_decay > 0, as its evaluation did; else the parameters),
    "average" or "raw". `device` and other run-steering fields (eval_batches, ...) may be set; everything is checked
    before a tensor is copied, and code the checkpoint names (a coupling, rule, cost or data format of someone's own
    module) is imported only with trust_code=True."""
    path = checkpoint_in(Path(path))  # a run folder: its newest checkpoint
    if weights not in WEIGHTS:
        raise ConfigError(f"weights: expected one of {', '.join(WEIGHTS)}, got {weights!r}")
    if not isinstance(trust_code, bool):
        raise ConfigError(f"trust_code: expected True or False, got {trust_code!r}")
    unknown = sorted(set(overrides) - accepted_keys())
    if unknown:  # the caller's mistake, not the checkpoint's
        raise ConfigError(f"load: unknown keyword argument(s) {unknown}; every keyword must be a TrainConfig field")
    meta = read_verified(path)  # its tensors' sha256 checked before its config is read
    try:
        cfg = build_config(
            [
                (f"checkpoint {path}", saved_config(meta["config"])),
                ("arguments", {**overrides, **({"device": device} if device else {})}),
            ],
            trust_code,
        )
    except UntrustedCodeError:
        raise
    except ConfigError as e:
        raise CheckpointError(f"{path}: its config cannot be used: {e}") from None
    data = None
    try:
        spec = InputSpec.from_json(meta["data"], meta["data"].get("vocab", []))
    except DataError:  # written before checkpoints recorded their inputs' shape: read it off the data
        data = load_data(cfg.section(DataConfig))
        spec = InputSpec.of(data)
    device_ = resolve_device(cfg)
    counts = (int(meta["data"].get("num_train") or cfg.batch_size), int(meta["data"].get("num_heldout") or 1))
    machine, memory = build_machine_for(cfg, spec, device_, counts)
    named = machine.named_params()  # the parameters, or their average, go into it: both are checked
    live = {f"param.{k}": v for k, v in named.items()} | {PREFIX + k: v for k, v in named.items()}
    if memory is not None:
        live.update(memory.tensors())
    fingerprint = None if data is None else data_fingerprint(data)
    averages = average_keys(machine) - {COUNT}  # the averaged parameters (load reads no update count)
    loaded, meta = load_checked(path, cfg, fingerprint, live, only=("param.", "memory.", PREFIX), optional=averages)
    if weights == "average" and not averages <= loaded.keys():
        raise CheckpointError(
            f"{path}: holds no weight average (its run had ema_decay 0); score its parameters with --weights raw "
            "(weights='raw' in Python)"
        )
    use = "average" if weights != "raw" and averages <= loaded.keys() else "raw"
    skip = "param." if use == "average" else PREFIX
    for k, dst in live.items():
        if not k.startswith(skip):
            dst.copy_(loaded[k])
    return Model(cfg, machine, memory, spec, device_, int(meta["step"]), meta["data"], path, data, weights=use)
