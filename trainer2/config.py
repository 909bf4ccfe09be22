"""TrainConfig: every knob of a run in one validated pydantic model, and the layering of presets.

Layers, lowest first: field defaults < preset YAML (configs/NAME.yaml) < --config FILE < flags.
The presets ship inside the package as `trainer2.configs` (built from the top-level configs/).
"""

from __future__ import annotations

import importlib.resources
import math
import re
import reprlib
import stat
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from trainer2.physics.couplings import KINDS

MAX_YAML_BYTES = 1 << 20  # a config is a few hundred bytes; the cap bounds what a hostile file can cost
MAX_REPR = 200  # characters of an offending value an error message shows
MAX_ERRORS = 10  # validation errors listed per message
MAX_LR = 1.0  # largest learning rate of any parameter group (see _numerics)
MAX_WIDTH, MAX_DEPTH = 2**20, 1024  # hidden layers: sane bounds; what fits in memory is trainer2.io.sizes' to say

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

CHECKOUT_PRESETS = Path(__file__).resolve().parent.parent / "configs"  # configs/ beside trainer2/ in a source tree


class ConfigError(ValueError):
    """A bad config key, value, file or combination; the message names it."""


def short_repr(value: Any) -> str:
    """repr(value) cut to about MAX_REPR characters (reprlib stops early), so an error never echoes a huge input."""
    r = reprlib.Repr()
    r.maxstring = r.maxother = MAX_REPR
    text = r.repr(value)
    return text if len(text) <= MAX_REPR else text[: MAX_REPR - 3] + "..."


class _ConfigLoader(yaml.SafeLoader):
    """SafeLoader without aliases (an alias bomb expands a few hundred bytes into gigabytes) that reads
    1e-3 as a float, as YAML 1.2 does (PyYAML's YAML 1.1 rules make it a string)."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            raise yaml.composer.ComposerError(
                None, None, "aliases (*name) are not allowed in a config file", self.peek_event().start_mark
            )
        return super().compose_node(parent, index)


def _unique_keys(loader: _ConfigLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    """A mapping whose keys are unique: `lr: 1` twice in one file is a mistake, not "the last one wins"."""
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            duplicate = key in seen
        except TypeError:
            continue  # an unhashable key: the constructor below refuses it
        if duplicate:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {short_repr(key)}", key_node.start_mark)
        seen.add(key)
    return yaml.SafeLoader.construct_mapping(loader, node, deep)


_ConfigLoader.add_constructor("tag:yaml.org,2002:map", lambda loader, node: _unique_keys(loader, node))
_ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789")
)


class TrainConfig(BaseModel):
    """One run of trainer2. Every field is also a command-line flag of the same name."""

    # strict: no bool-as-int (YAML `max_windows: true` is not 1) and no numbers from strings; an int is
    # still a valid float. allow_inf_nan=False: every float must be finite (YAML .inf, --dt inf).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True, allow_inf_nan=False)

    # --- run ---
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
    dtype: Literal["float32", "float64"] = Field("float32", description="Floating-point type of every tensor.")
    cpu_threads: int = Field(
        1,
        ge=0,
        le=1024,
        description="Threads for CPU math per process (torch.set_num_threads); 0 = every core this "
        "process may use (OMP_NUM_THREADS when set). 1 by default: the matrices are small, so a second "
        "thread gains little on an idle machine and stalls the run when another process is busy.",
    )
    checkpoint_dir: str = Field("checkpoints", description="Directory holding one folder per run.")

    # --- data ---
    data: str | None = Field(
        None,
        description=(
            "UTF-8 text file, .npz feature or image set, MNIST IDX / CIFAR-10 batches directory, or "
            "torchvision:NAME:ROOT; none = built-in pydoc corpus."
        ),
    )
    context_len: int = Field(8, ge=1, le=2**16, description="Characters of context per example (text data).")
    embed_dim: int = Field(16, ge=1, le=2**16, description="Embedding size per context character (text data).")
    heldout_fraction: float = Field(0.1, gt=0.0, lt=1.0, description="Fraction of the data, by position, held out.")
    augment_shift: int = Field(
        0,
        ge=0,
        le=8,
        description="Image data only: translate each training image by up to this many pixels in each direction "
        "(edge-padded), fresh draws every window; 0 = off. Held-out images are never moved.",
    )
    token_cache: str = Field(
        "auto",
        min_length=1,
        description="Where a text file's memory-mapped token cache lives: 'auto' (beside the file, else in "
        "~/.cache/trainer2/tokens when that directory is read-only), a directory, or 'off' (tokenize into memory at "
        "every start).",
    )

    # --- machine ---
    layers: list[dict[str, Any]] = Field(
        [{"dense": 256}],
        min_length=1,
        description="The hidden layers h_1..h_M, lowest first, each {kind: spec} with the "
        "kind of coupling that drives it from below: [{dense: 256}] is one dense layer of 256 units (on the command "
        "line: --layers dense:256). --hidden_sizes 256 128 is shorthand for dense layers of those sizes.",
    )
    coord_dim_n: int = Field(16, ge=2, le=2048, description="Dimension n of the output coordinates q.")
    rotor_k: int = Field(32, ge=0, le=2**24, description="Number of Givens rotations in the readout's rotor frame.")
    retrieval_beta: float = Field(
        1.0, gt=0.0, description="Inverse temperature of retrieval: p = softmax(-beta * cost)."
    )
    eps: float = Field(1e-6, gt=0.0, description="Added under the square root of the quadratic form spd.")
    g_min: float = Field(0.05, gt=0.0, description="Lower clamp of the metric diagonal g_diag.")
    g_max: float = Field(20.0, gt=0.0, description="Upper clamp of the metric diagonal g_diag.")
    r_init: float = Field(16.0, gt=0.0, description="Initial resistance R_sc.")
    r_min: float = Field(0.05, gt=0.0, description="Lower clamp of the resistance R_sc.")
    out_init_scale: float = Field(0.5, gt=0.0, description="W_out starts at this multiple of the 1/sqrt(fan_in) scale.")
    proto_init_scale: float = Field(0.1, gt=0.0, description="Standard deviation of the initial prototypes.")
    spectral_cap: float = Field(
        0.7,
        gt=0.0,
        lt=1.0,
        description="Cap kappa on the couplings' part of E's Hessian, so its smallest "
        "curvature is >= 1 - kappa at any depth: "
        "each coupling between state layers is capped at kappa / (2 cos(pi/(M+2))) "
        "for M hidden layers (kappa itself for one).",
    )
    memory_capacity: int = Field(
        0, ge=0, le=2**31, description="Slots of the memory bank of recent equilibria; 0 = off."
    )

    # --- dynamics ---
    free_steps: int = Field(
        64, ge=1, le=10**6, description="Free-phase relaxation steps per window (formerly tbptt_window_steps)."
    )
    nudge_steps: int = Field(16, ge=1, le=10**6, description="Steps of each nudged phase.")
    beta_nudge: float = Field(0.003, gt=0.0, description="Nudging strength beta.")
    symmetric_nudge: bool = Field(
        True, description="Nudge with +beta and -beta (bias O(beta^2)) instead of +beta only."
    )
    dt: float = Field(1.0, gt=0.0, description="Integrator step size.")
    gamma: float = Field(1.0, ge=0.0, description="Damping; 0 = energy-conserving Stormer-Verlet (diagnostics only).")
    mass: float = Field(1.0, gt=0.0, description="Mass of every state coordinate.")
    relaxation: Literal["jacobi", "even_odd"] = Field(
        "jacobi",
        description="Order of the fixed-point steps: 'jacobi' moves every layer from its neighbours' old values; "
        "'even_odd' moves the odd layers (h_1, h_3, ...) from their neighbours, then the even ones from the new odd "
        "ones (block coordinate descent: about half the steps to a given residual). even_odd needs dt = gamma = "
        "mass = 1.",
    )

    # --- update ---
    eta_update: float = Field(
        0.003, gt=0.0, description="Base learning rate (energy couplings; other groups scale it)."
    )
    eta_readout_scale: float = Field(1.0, gt=0.0, description="Readout learning rate as a multiple of eta_update.")
    eta_embed_scale: float = Field(1.0, gt=0.0, description="Embedding learning rate as a multiple of eta_update.")
    update_rule: Literal["momentum", "adam"] = Field(
        "adam", description="Hand-written update: heavy-ball momentum or Adam."
    )
    momentum: float = Field(0.9, ge=0.0, lt=1.0, description="Heavy-ball momentum, or Adam's beta1.")
    adam_beta2: float = Field(0.999, ge=0.0, lt=1.0, description="Adam's second-moment decay.")
    adam_eps: float = Field(1e-8, gt=0.0, description="Adam's denominator epsilon.")
    weight_decay: float = Field(0.0, ge=0.0, description="L2 weight decay on the energy couplings.")
    lr_warmup_windows: int = Field(0, ge=0, description="Windows of linear learning-rate warm-up.")
    lr_schedule: Literal["constant", "cosine"] = Field("constant", description="Learning-rate decay after warm-up.")
    lr_min_ratio: float = Field(
        0.1, ge=0.0, le=1.0, description="Final learning rate as a fraction of the peak (cosine)."
    )

    # --- batching and speed ---
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
    window_backend: Literal["auto", "torch", "triton"] = Field(
        "auto",
        description="Relaxation phases: 'torch' operators, or 'triton' (one kernel launch per phase; needs the kernels "
        "extra and a CUDA device); 'auto' takes triton on CUDA where it can run, torch otherwise.",
    )
    cudnn_benchmark: bool = Field(False, description="Set torch.backends.cudnn.benchmark.")
    cudnn_deterministic: bool = Field(False, description="Set torch.backends.cudnn.deterministic.")
    allow_tf32: bool = Field(False, description="Allow TF32 matmuls on Ampere and newer GPUs.")

    # --- loop, logging, evaluation, checkpoints ---
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

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", v):
            raise ValueError(f"expected 'auto', 'cpu', 'cuda' or 'cuda:N', got {short_repr(v)}")
        return v

    @model_validator(mode="before")
    @classmethod
    def _legacy_names(cls, data: Any) -> Any:
        return upgrade_legacy(data) if isinstance(data, dict) else data

    @field_validator("layers")
    @classmethod
    def _layers(cls, v: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if len(v) > MAX_DEPTH:
            raise ValueError(f"at most {MAX_DEPTH} hidden layers, got {len(v)}")
        for i, entry in enumerate(v):
            if len(entry) != 1 or next(iter(entry)) not in KINDS:
                raise ValueError(
                    f"layer {i}: expected one {{kind: spec}} entry with a kind in {sorted(KINDS)}, "
                    f"got {short_repr(entry)}"
                )
            ((kind, spec),) = entry.items()
            try:
                size = math.prod(KINDS[kind].spec_size(spec))
            except ValueError as e:
                raise ValueError(f"layer {i} ({kind}): {e}") from None
            if size > MAX_WIDTH:
                raise ValueError(f"layer {i} ({kind}): at most {MAX_WIDTH} units a layer, got {size}")
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

    @model_validator(mode="after")
    def _cross_field(self) -> "TrainConfig":
        if self.g_min >= self.g_max:
            raise ValueError(f"g_min ({self.g_min}) must be below g_max ({self.g_max})")
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
        if self.relaxation == "even_odd" and not self.dt == self.gamma == self.mass == 1.0:
            raise ValueError(
                f"relaxation even_odd runs the fixed-point steps only (dt = gamma = mass = 1), this run has dt "
                f"{self.dt:g}, gamma {self.gamma:g}, mass {self.mass:g}: the leapfrog moves every layer at once "
                "(--relaxation jacobi)"
            )
        self._numerics()
        return self

    def _numerics(self) -> None:
        """Refuse values that cannot work whatever the data: an unstable integrator, a learning rate above 1."""
        # Damped leapfrog on a unit-stiffness mode: p <- (1 - gamma dt) p - dt s, s <- s + dt p / mass has
        # |eigenvalues| < 1 iff dt^2/mass + 2 gamma dt < 4. The energy's Hessian has unit diagonal, so its
        # stiffest mode is >= 1: outside this bound the free phase diverges for any couplings.
        stiffness = self.dt**2 / self.mass + 2 * self.gamma * self.dt
        if not stiffness < 4:
            raise ValueError(
                f"dt^2/mass + 2*gamma*dt = {stiffness:g} must be below 4 (dt {self.dt:g}, gamma {self.gamma:g}, "
                f"mass {self.mass:g}): beyond it the leapfrog step is unstable on the energy's unit stiffness and the "
                "free phase can never settle; lower dt or gamma, or raise mass (dt = gamma = mass = 1 is the default)"
            )
        for group, scale in (("energy", 1.0), ("readout", self.eta_readout_scale), ("embed", self.eta_embed_scale)):
            lr = self.eta_update * scale
            if lr > MAX_LR:
                what = "eta_update" if group == "energy" else f"eta_update * eta_{group}_scale"
                raise ValueError(
                    f"the {group} learning rate {what} = {lr:g} must be at most {MAX_LR:g}: an Adam step moves every "
                    "parameter by about the learning rate, and the couplings live below spectral_cap < 1, so a larger "
                    "rate wrecks the model in one update (useful rates are around 1e-3 to 1e-2)"
                )


# Names a config may still use, and what they became: tbptt_window_steps was renamed (a note says so);
# hidden_sizes is a shorthand for dense layers.
RENAMED = {"tbptt_window_steps": "free_steps"}
SHORTHANDS = ("hidden_sizes",)


def upgrade_legacy(values: dict[str, Any]) -> dict[str, Any]:
    """`values` with the old names replaced by the new ones: tbptt_window_steps -> free_steps, hidden_sizes [N, ...]
    -> layers [{dense: N}, ...]. Giving both an old and its new name is refused."""
    out = dict(values)
    for old, new in RENAMED.items():
        if old in out:
            if new in out:
                raise ValueError(f"{old} is the old name of {new}: give one of them")
            out[new] = out.pop(old)
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


def preset_dir() -> Path | Traversable:
    """Where the presets are: configs/ of the source tree trainer2 runs from, else the installed package data.

    A source tree (configs/ and pyproject.toml beside trainer2/) comes first, so a checkout always reads its
    own configs/, even when another checkout is installed in editable mode."""
    if CHECKOUT_PRESETS.is_dir() and (CHECKOUT_PRESETS.parent / "pyproject.toml").is_file():
        return CHECKOUT_PRESETS
    try:
        return importlib.resources.files("trainer2.configs")
    except ModuleNotFoundError:  # neither installed nor a checkout; the error below lists no presets
        return CHECKOUT_PRESETS


def preset_names() -> list[str]:
    """The names --preset accepts (dev, production, profiling, ...)."""
    found = preset_dir()
    return (
        sorted(p.name.removesuffix(".yaml") for p in found.iterdir() if p.name.endswith(".yaml"))
        if found.is_dir()
        else []
    )


def preset_path(name: str) -> Path | Traversable:
    """The preset NAME (a .yaml in the presets), or NAME itself when it is a path to a YAML file."""
    path = Path(name)
    if path.suffix in (".yaml", ".yml") and path.exists():
        return path
    found = preset_dir() / f"{name}.yaml"
    if not found.is_file():
        raise ConfigError(
            f"unknown preset {short_repr(name)}: expected one of {preset_names()} or a path to a YAML file "
            f"(presets in {preset_dir()})"
        )
    return found


def read_yaml(path: Path | Traversable) -> dict[str, Any]:
    """A YAML mapping of config fields; unknown keys are refused here, naming the file."""
    try:
        if path.is_dir():
            raise ConfigError(f"config file {path} is a directory; expected a YAML file of field: value lines")
        if isinstance(path, Path):
            if not stat.S_ISREG(path.stat().st_mode):  # a FIFO would block the read forever, /dev/zero never end
                raise ConfigError(
                    f"config file {path} is not a regular file (a pipe, socket or device); expected a YAML file"
                )
            size = path.stat().st_size
            if size > MAX_YAML_BYTES:
                raise ConfigError(
                    f"config file {path} is {size} bytes; a config file may be at most {MAX_YAML_BYTES} bytes"
                )
            with open(path, encoding="utf-8") as f:  # a stream, so YAML errors name the file
                data = yaml.load(f, Loader=_ConfigLoader)
        else:  # a preset shipped inside the package, not on a plain file system
            data = yaml.load(path.read_text(encoding="utf-8"), Loader=_ConfigLoader)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read ({e.strerror})") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(
            f"config file {path} is not valid YAML: {e}"
        ) from None  # PyYAML cuts its snippets at 75 characters
    except RecursionError:
        raise ConfigError(f"config file {path} is nested too deeply; expected a flat mapping of field: value") from None
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of field: value, got {type(data).__name__}")
    unknown = sorted(set(data) - accepted_keys(), key=str)
    if unknown:
        raise ConfigError(
            f"config file {path}: unknown key(s) {short_repr(unknown)}; every key must be a TrainConfig field "
            "(see --help)"
        )
    return data


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


def build_config(layers: list[tuple[str, dict[str, Any]]]) -> TrainConfig:
    """Merge (source, values) layers, lowest first, and validate; errors name the field and its source."""
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
