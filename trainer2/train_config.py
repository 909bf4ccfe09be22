"""TrainConfig: every knob of a run in one validated model, assembled from the sections of the components, and the
layering of presets, files and flags into one.

Layers, lowest first: field defaults < preset YAML (configs/NAME.yaml, trainer2/presets.py) < --config FILE < flags.
Each component owns its section (trainer2/section.py) and is handed only that (`TrainConfig.section`); the fields
that steer a run (where it writes, how the step runs, how long, what it logs) are this module's own.
"""

from __future__ import annotations

import re
import warnings
from typing import Any, Literal, TypeVar

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from trainer2.components import check_consent, named_components
from trainer2.data.load import DataConfig
from trainer2.learning.rules import RuleConfig
from trainer2.learning.update import UpdateConfig
from trainer2.physics.machine import MachineConfig
from trainer2.physics.relaxation import DynamicsConfig
from trainer2.section import ConfigError, Section, short_repr

MAX_ERRORS = 10  # validation errors listed per message
# The sources of layers the user wrote in this call (flags, Python arguments); every other layer was read from a file
# (a preset or --config YAML, a checkpoint), whose dotted component names need consent (trainer2.components).
USER_SOURCES = ("command line", "arguments")
S = TypeVar("S", bound=Section)


class RunConfig(Section):
    """Which run this is and where it computes and writes."""

    run_name: str = Field(
        "run",
        description="Name of the run; outputs go to <checkpoint_dir>/<run_name>/. On the command "
        "line, a run started without one gets a fresh name <preset>-<N> (or run-<N>).",
    )
    seed: int = Field(
        0,
        ge=-(2**63),
        lt=2**64,
        description="Seed for initialisation and the data sampler (what torch.manual_seed takes).",
    )
    device: str = Field("auto", description="'auto' (CUDA when present, else CPU), 'cpu', 'cuda' or 'cuda:N'.")
    cpu_threads: int = Field(
        1,
        ge=0,
        le=1024,
        description="Threads for CPU math per process (torch.set_num_threads); 0 = measured: every core this process "
        "may use (OMP_NUM_THREADS when set) while that is faster than one thread, one while the machine is shared "
        "(timed every 2 minutes; a run whose count changes is not bitwise reproducible). 1 by default: the "
        "matrices are small, so a second thread gains little on an idle machine and stalls the run when another "
        "process is busy.",
    )
    checkpoint_dir: str = Field("checkpoints", description="Directory holding one folder per run.")

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", v):
            raise ValueError(f"expected 'auto', 'cpu', 'cuda' or 'cuda:N', got {short_repr(v)}")
        return v

    @field_validator("run_name")
    @classmethod
    def _run_name(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", v) or v.startswith("."):
            raise ValueError(f"expected letters, digits, '_', '-' or '.' (not first), got {short_repr(v)}")
        if re.fullmatch(r"step_\d+", v):  # a run directory named like a checkpoint would be taken for one
            raise ValueError(f"{short_repr(v)} is shaped like a checkpoint directory (step_<N>); pick another name")
        return v

    @field_validator("checkpoint_dir")
    @classmethod
    def _checkpoint_dir(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must name a directory (use '.' for the current one)")
        return v


class SpeedConfig(Section):
    """How the batch step runs: batch shape, graphs, compilation, GPU library switches."""

    batch_size: int = Field(
        64,
        ge=1,
        le=2**24,
        description="Examples per window and process (under torchrun the global batch is batch_size x world size); "
        "follows capture_batch_size when only that is given.",
    )
    static_shapes: bool = Field(
        False, description="Keep every tensor's shape fixed for the whole run (needed for graphs)."
    )
    capture_batch_size: int | None = Field(
        None, ge=1, description="Batch size the CUDA graph is captured at; must equal batch_size."
    )
    use_cudagraphs: bool = Field(False, description="Capture the batch step as a CUDA graph and replay it (CUDA only).")
    warmup_steps: int = Field(3, ge=0, le=10**4, description="Eager windows on a side stream before graph capture.")
    use_torch_compile: bool = Field(False, description="Compile the batch step with torch.compile.")
    compile_mode: Literal["default", "reduce-overhead", "max-autotune-no-cudagraphs"] = Field(
        "default",
        description="torch.compile mode; 'reduce-overhead' lets torch.compile record CUDA graphs itself "
        "instead of the runner capturing the compiled step.",
    )
    cudnn_benchmark: bool = Field(False, description="Set torch.backends.cudnn.benchmark.")
    cudnn_deterministic: bool = Field(False, description="Set torch.backends.cudnn.deterministic.")
    allow_tf32: bool = Field(False, description="Allow TF32 matmuls on Ampere and newer GPUs.")


class LoopConfig(Section):
    """How long a run goes, and how often it logs, evaluates and saves."""

    max_windows: int | None = Field(
        2000, ge=1, le=10**15, description="Stop after this many windows (batches); none = no limit."
    )
    max_epochs: float | None = Field(
        None, gt=0.0, le=1e9, description="Stop after this many passes over the training data; none = no limit."
    )
    log_every_windows: int = Field(50, ge=1, description="Windows between metric syncs (progress bar and telemetry).")
    eval_every_windows: int = Field(500, ge=0, description="Windows between held-out evaluations; 0 = only at the end.")
    eval_batches: int | None = Field(
        None, ge=1, description="Held-out batches per evaluation; none = the whole held-out split."
    )
    save_every_windows: int = Field(0, ge=0, description="Windows between checkpoints; 0 = only at the end.")
    keep_last: int = Field(3, ge=1, description="Checkpoints kept per run; older ones are pruned.")
    step_progress_every: int = Field(
        0, ge=0, description="Report progress inside a window every K steps (eager only); 0 = off."
    )
    timing_debug: bool = Field(False, description="Time each phase of every window and print a table.")
    profile_windows: int = Field(
        0, ge=0, description="torch.profiler trace of this many windows after warm-up, into the run directory; 0 = off."
    )
    tensorboard: bool = Field(
        False,
        description="Also write every telemetry value to <run_dir>/tb/ for TensorBoard, the window as the step "
        "(needs the tensorboard extra).",
    )
    cleanup_every: int = Field(50, ge=1, description="Windows between checks of the CUDA cache (CUDA only).")
    cleanup_threshold: float = Field(
        0.9, gt=0.0, le=1.0, description="Empty the CUDA cache when allocated/reserved memory exceeds this ratio."
    )
    dist_timeout_seconds: float = Field(
        120.0,
        gt=0.0,
        description="Under torchrun: a collective that waits longer than this for another process fails the run.",
    )


class TrainConfig(
    LoopConfig, SpeedConfig, UpdateConfig, RuleConfig, DynamicsConfig, MachineConfig, DataConfig, RunConfig
):
    """One run of trainer2: the union of the sections. Every field is also a command-line flag of the same name."""

    @model_validator(mode="before")
    @classmethod
    def _legacy_names(cls, data: Any) -> Any:
        return upgrade_legacy(data) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _cross_section(self) -> "TrainConfig":
        if self.use_cudagraphs and not self.static_shapes:
            raise ValueError("use_cudagraphs needs static_shapes (a graph replays fixed shapes): add --static_shapes")
        if self.use_cudagraphs and self.capture_batch_size is None:
            raise ValueError("use_cudagraphs needs capture_batch_size (the batch size to capture at)")
        if self.capture_batch_size is not None and self.capture_batch_size != self.batch_size:
            raise ValueError(
                f"capture_batch_size ({self.capture_batch_size}) must equal batch_size ({self.batch_size}): "
                "a captured graph replays one batch shape"
            )
        if 0 < self.memory_capacity < self.batch_size:
            raise ValueError(
                f"memory_capacity ({self.memory_capacity}) must be 0 (off) or at least batch_size ({self.batch_size}): "
                "each window writes one slot per example"
            )
        if self.max_windows is None and self.max_epochs is None:
            raise ValueError("set max_windows or max_epochs, or the run never ends")
        return self

    def section(self, kind: type[S]) -> S:
        """This config's values of one section's fields, as that section (the settings one component reads)."""
        return kind.model_construct(**{name: getattr(self, name) for name in kind.model_fields})


# Names a config may still use, and what they became: tbptt_window_steps was renamed (a note says so);
# hidden_sizes is a shorthand for dense layers; symmetric_nudge is the old spelling of rule (true: ep, false:
# ep_positive).
RENAMED = {"tbptt_window_steps": "free_steps"}
SHORTHANDS = ("hidden_sizes", "symmetric_nudge")
SPELLS = {"tbptt_window_steps": "free_steps", "hidden_sizes": "layers", "symmetric_nudge": "rule"}  # old -> field
NUDGE_RULES = {True: "ep", False: "ep_positive"}  # symmetric_nudge -> rule


def upgrade_legacy(values: dict[str, Any]) -> dict[str, Any]:
    """`values` with the old names replaced by the new ones: tbptt_window_steps -> free_steps, hidden_sizes [N, ...]
    -> layers [{dense: N}, ...], symmetric_nudge true / false -> rule ep / ep_positive. Giving both an old and its new
    name is refused (for symmetric_nudge, only when they disagree)."""
    out = dict(values)
    for old, new in RENAMED.items():
        if old in out:
            if new in out:
                raise ValueError(f"{old} is the old name of {new}: give one of them")
            out[new] = out.pop(old)
    if "symmetric_nudge" in out:
        symmetric = out.pop("symmetric_nudge")
        if not isinstance(symmetric, bool):
            raise ValueError(f"symmetric_nudge: expected true or false, got {short_repr(symmetric)}")
        rule = NUDGE_RULES[symmetric]
        if out.get("rule", rule) != rule:
            raise ValueError(
                f"symmetric_nudge {str(symmetric).lower()} is the old spelling of rule {rule}, and rule is "
                f"{short_repr(out['rule'])}: give one of them"
            )
        out["rule"] = rule
    if "hidden_sizes" in out:
        if "layers" in out:
            raise ValueError("hidden_sizes is a shorthand for layers: give one of them")
        sizes = out.pop("hidden_sizes")
        if (
            not isinstance(sizes, list)
            or not sizes
            or any(isinstance(h, bool) or not isinstance(h, int) or h < 1 for h in sizes)
        ):
            raise ValueError(f"hidden_sizes: expected a non-empty list of integers >= 1, got {short_repr(sizes)}")
        out["layers"] = [{"dense": h} for h in sizes]
    return out


def field_names() -> list[str]:
    return list(TrainConfig.model_fields)


def accepted_keys() -> set[str]:
    """Every key a config file or layer may hold: the fields, their old names and the shorthands."""
    return set(field_names()) | set(RENAMED) | set(SHORTHANDS)


def _follow_capture_batch(layer: dict[str, Any]) -> dict[str, Any]:
    """A layer that sets capture_batch_size but not batch_size sets batch_size to match."""
    if layer.get("capture_batch_size") is not None and "batch_size" not in layer:
        layer = {**layer, "batch_size": layer["capture_batch_size"]}
    return layer


def merge_layers(layers: list[tuple[str, dict[str, Any]]]) -> tuple[dict[str, Any], dict[str, str]]:
    """(merged values, the source of each) of (source, values) layers, lowest first; higher layers win."""
    merged: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for source, layer in layers:
        for old in sorted(set(RENAMED) & set(layer)):
            if not source.startswith("checkpoint"):  # a user's file or flag, not a checkpoint written before the rename
                warnings.warn(
                    f"{old} is now called {RENAMED[old]} ({source}); the old name still works",
                    FutureWarning,
                    stacklevel=2,
                )
        try:
            layer = upgrade_legacy(layer)
        except ValueError as e:
            raise ConfigError(f"{source}: {e}") from None
        layer = _follow_capture_batch(layer)
        merged.update(layer)
        origin.update({k: source for k in layer})
    return merged, origin


def config_origins(layers: list[tuple[str, dict[str, Any]]]) -> dict[str, str]:
    """Field -> the source of the layer its value came from; fields no layer sets are absent (defaults)."""
    return merge_layers(layers)[1]


def build_config(layers: list[tuple[str, dict[str, Any]]], trust_code: bool = False) -> TrainConfig:
    """Merge (source, values) layers, lowest first, and validate; errors name the field and its source. Code named in
    a layer read from a file is imported only with trust_code or when a user layer names it too (UntrustedCodeError
    before anything is imported)."""
    given = {name for source, values in layers if source in USER_SOURCES for _, name in named_components(values)}
    check_consent([(s, v) for s, v in layers if s not in USER_SOURCES], given, trust_code)
    merged, origin = merge_layers(layers)
    try:
        return TrainConfig(**merged)
    except ValidationError as e:
        lines = []
        for err in e.errors()[:MAX_ERRORS]:
            field = ".".join(str(p) for p in err["loc"]) or "config"
            top = str(err["loc"][0]) if err["loc"] else field
            where = f" (from {origin[top]})" if top in origin else ""
            msg = err["msg"].removeprefix("Value error, ")
            shown = (
                "input" not in err or field == "config" or short_repr(err["input"]) in msg
            )  # the message names it already
            lines.append(f"{field}{where}: {msg}" + ("" if shown else f" (got {short_repr(err['input'])})"))
        if e.error_count() > MAX_ERRORS:
            lines.append(f"... and {e.error_count() - MAX_ERRORS} more")
        raise ConfigError("invalid config:\n  " + "\n  ".join(lines)) from None


def to_yaml(cfg: TrainConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(), sort_keys=False)


def annotated_yaml(cfg: TrainConfig, origins: dict[str, str]) -> str:
    """The resolved config as YAML, one field a line; a value that is not its field's default carries a comment
    naming the layer it came from (`# preset PATH`, `# config FILE`, `# command line`)."""
    values = cfg.model_dump(mode="json")
    lines = [
        "# resolved config; layers, lowest first: field defaults < --preset < --config < flags",
        "# a comment names the layer each non-default value came from",
    ]
    for name, field in TrainConfig.model_fields.items():
        line = yaml.safe_dump({name: values[name]}, default_flow_style=True, width=2**16).strip()[
            1:-1
        ]  # "{k: v}" -> "k: v"
        if values[name] != field.default:
            line += f"  # {origins.get(name, 'default')}"
        lines.append(line)
    return "\n".join(lines) + "\n"
