"""Which code relaxes the phases (--window_backend): torch's operators (trainer2.physics.dynamics.fixed_point_steps)
or one Triton launch per phase (kernels/free_phase.py, kernels/nudged_phase.py); and which code updates the parameters
(--update_backend): torch's operators (trainer2.learning.update.flat_update) or the fused update (kernels/
fused_update.py); and which computes the retrieval readout's loss and gradients (--readout_backend): the cost's
torch operators or one launch (kernels/readout_grads.py). Each is chosen once per run; triton is imported only when it
is chosen, so a run without it never loads it."""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass

import torch

from trainer2.physics.costs.retrieval import Retrieval
from trainer2.physics.dynamics import FoldBlocks, Integrator, PhaseFn, PhaseRun, Workspace, phase_function
from trainer2.physics.graph import Graph
from trainer2.physics.graph_steps import graph_steps
from trainer2.physics.nudge import NudgeScheme
from trainer2.physics.readout import RotorLayout
from trainer2.section import ConfigError

# A program keeps whole layers in registers (tiles padded to powers of two >= 16). Within FITS (the dev and production
# presets, 256 x 16) they fit, and auto takes triton; within RUNS --window_backend triton runs them with more warps
# per program, where they may spill, and where the GPU's shared memory holds their tiles (the deep preset's 1024 x 32
# does not fit an H100's or H200's: SHARED_SLACK below); beyond RUNS the weights
# would have to be streamed in chunks, which the kernels do not do.
MAX_DEPTH = 3
# The compiled kernels passed benchmarks/gpu_checks.py on an H200 (24634eb: equal to the torch window and update,
# graph replay bitwise equal to eager), and triton+graph ran 1.38x (dev, batch 8), 1.72x (batch 64) and 1.71x
# (production) the windows/s of graph (docs/performance.md): auto takes them on a CUDA device where the shapes fit.
AUTO_TAKES_TRITON = True
AUTO_TAKES_TRITON_UPDATE = True
# The readout's loss and gradients in one launch (kernels/readout_grads.py) passed benchmarks/triton_window_check.py
# compiled on an H200 (batches 1, 8, 13, 64 and 200; float32 and float64; a memory bank), and the dev preset's
# triton+graph window with it ran 1.17x (batch 8), 1.07x (128) and 1.06x (4096) the windows/s with the readout in
# torch (docs/triton.md).
AUTO_TAKES_TRITON_READOUT = True
# The readout's frame and fold in one launch (kernels/readout_frame.py) passed benchmarks/triton_window_check.py
# compiled on an H200 (64c1620: the CUDA tests), its graph replay equals eager bitwise, and the dev preset's
# triton+graph batch step with it ran 1.13x (batch 8) and 1.08x (4096) the windows/s without it, in 64 kernels
# against 97 (docs/performance.md): auto takes it beside the readout kernel.
AUTO_TAKES_TRITON_FRAME = True
# The window's metric sums in two launches (kernels/window_metrics.py) beside the fused update, where the torch
# operators take 13: off on a GPU until a GPU session has run benchmarks/update_check.py with it compiled (equal to the
# torch metrics) and counted the batch step's kernels; in Triton's interpreter it always joins the fused update.
AUTO_TAKES_TRITON_METRICS = False
# The EP statistic of each dense coupling in one launch (kernels/ep_statistic.py) beside the Triton window, where the
# torch operators take five: off on a GPU until a GPU session has compared it compiled (benchmarks/
# triton_window_check.py) and counted the batch step's kernels; in Triton's interpreter it always joins the window.
AUTO_TAKES_TRITON_EP = False
# The window's observables in one launch (kernels/window_stats.py) beside the Triton window, where the torch operators
# take nine: off on a GPU until a GPU session has compared it compiled (benchmarks/triton_window_check.py) and counted
# the batch step's kernels; in Triton's interpreter it always joins the window.
AUTO_TAKES_TRITON_STATS = False
# The rotor's angle gradient in one launch (kernels/rotor_angle_grad.py) beside the readout kernel, where the torch
# operators take four: off on a GPU until a GPU session has compared it compiled (benchmarks/triton_window_check.py)
# and counted the batch step's kernels; in Triton's interpreter it always joins the readout kernel.
AUTO_TAKES_TRITON_ROTOR = False
# Triton stages each tl.dot's operands through shared memory, and the kernels' dots take whole layers: the largest
# pair (BLOCK_ROWS rows of state and a coupling tile, padded) has to fit the GPU's shared memory per block. The slack
# covers the kernel's other buffers: on an H200 the deep preset's 1024 x 32 float32 pair (192 KiB) asked for 234 KiB,
# 1.22x, past the 227 KiB an H100 or H200 has.
SHARED_SLACK = 1.25
FITS = {"hidden units": 256, "coordinates": 64, "candidates": 256}
RUNS = {"hidden units": 1024, "coordinates": 64, "candidates": 1024}


@dataclass(frozen=True)
class Backend:
    """The window backend in use, "torch" or "triton", and why it was chosen."""

    name: str
    reason: str


def unmeasured_kernel_wanted(switched_on: bool, device: torch.device) -> bool:
    """Whether a kernel not yet measured on a GPU runs beside the kernels it joins: in Triton's interpreter (the CPU's
    tests and benches) always, on a CUDA device while its AUTO_TAKES_TRITON_* switch (`switched_on`) is on."""
    return device.type == "cpu" or switched_on


def interpreting() -> bool:
    """Triton's interpreter is on (TRITON_INTERPRET=1): kernels run on CPU tensors, through numpy."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")


def nudge_blocker(scheme: NudgeScheme, cost: str, folded: bool) -> str | None:
    """Why the nudged kernel cannot run a learning rule's nudged phases (`scheme`) with this cost (`folded`: its pull
    is the retrieval readout's, which the kernel holds), or None; a scheme without nudged phases (the adjoint of
    recurrent backprop, which runs in torch after the free kernel) needs only the free kernel."""
    if scheme.clamp:
        return f"the nudged kernel pulls q by a force, and rule {scheme.rule} clamps q in its nudged phases"
    if scheme.phases and not folded:
        return f"the nudged kernel pulls q by the retrieval cost, and this run's cost is {cost}"
    return None


def triton_blocker(
    device: torch.device,
    dtype: torch.dtype,
    integ: Integrator,
    sizes: list[int],
    candidates: int,
    kinds: list[str],
    nudge: str | None = None,
) -> str | None:
    """Why the Triton window cannot run for this machine on this device (sizes = [H_1, ..., H_M, n], kinds = the kind
    of each coupling; nudge: why it cannot run the rule's nudged phases, `nudge_blocker`), or None. The run's own
    reasons come first: installing triton or finding a GPU would not help with those."""
    if nudge is not None:
        return nudge
    if any(kind != "dense" for kind in kinds):
        return f"the kernels run chains of dense couplings, this machine has {', '.join(sorted(set(kinds)))} couplings"
    if not integ.fixed_point:
        return (
            f"the kernels run the fixed-point iteration only (dt = gamma = mass = 1), this run has "
            f"dt {integ.dt:g}, gamma {integ.gamma:g}, mass {integ.mass:g}"
        )
    if dtype not in (torch.float32, torch.float64):
        return f"the kernels run float32 or float64, this run is {dtype}"
    if not 1 <= len(sizes) - 1 <= MAX_DEPTH:
        return f"the kernels support 1 to {MAX_DEPTH} hidden layers, this machine has {len(sizes) - 1}"
    wide = too_large(sizes, candidates, RUNS)
    if wide is not None:
        return wide
    return runtime_blocker(device) or shared_memory_blocker(device, dtype, sizes, candidates)


def runtime_blocker(device: torch.device) -> str | None:
    """Why no Triton kernel can run on `device` (no CUDA device and no interpreter, triton missing or broken), or
    None."""
    if device.type != "cuda" and not (device.type == "cpu" and interpreting()):
        return (
            f"the device is {device.type}: Triton kernels need a CUDA device "
            "(or the CPU with TRITON_INTERPRET=1, for tests)"
        )
    for module in ("triton", "numpy") if interpreting() else ("triton",):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed (pip install -e '.[kernels]')"
    try:
        importlib.import_module("triton")
    except Exception as e:  # a broken install: name it instead of failing inside the first window
        return f"triton does not import ({type(e).__name__}: {e})"
    if device.type == "cuda" and interpreting():
        return (
            "TRITON_INTERPRET=1 is set, so Triton would run the kernels in its interpreter on host copies of the "
            "GPU's tensors (unset it to compile them)"
        )
    return None


def kernel_blocker(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why a kernel over whole buffers (the fused update, the readout) cannot run: its dtype, or `runtime_blocker`."""
    if dtype not in (torch.float32, torch.float64):
        return f"the kernel runs float32 or float64, this run is {dtype}"
    return runtime_blocker(device)


def shared_memory_limit(device: torch.device) -> int | None:
    """The shared memory a block may use on a CUDA `device`, bytes (None where it cannot be read: no CUDA here)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    limit = getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", None)
    if limit is None:
        from triton.runtime import driver

        index = device.index if device.index is not None else torch.cuda.current_device()
        limit = driver.active.utils.get_device_properties(index).get("max_shared_mem")
    return int(limit) if limit else None


def shared_memory_need(sizes: list[int], candidates: int, itemsize: int) -> tuple[int, tuple[int, int]]:
    """The estimated shared memory (bytes) of the kernels' largest dot, and its pair of widths: BLOCK_ROWS rows of
    the wider layer and the coupling tile between two neighbours of [H_1, ..., H_M, n, candidates], padded, x
    SHARED_SLACK."""
    from trainer2.physics.kernels.chain import BLOCK_ROWS, padded

    widths = [*sizes, candidates]
    pairs = [(padded(a), padded(b)) for a, b in zip(widths[:-1], widths[1:])]
    need = {pair: int(SHARED_SLACK * (BLOCK_ROWS * max(pair) + pair[0] * pair[1]) * itemsize) for pair in pairs}
    worst = max(need, key=need.__getitem__)
    return need[worst], worst


def shared_memory_blocker(device: torch.device, dtype: torch.dtype, sizes: list[int], candidates: int) -> str | None:
    """Why the kernels' tiles do not fit the GPU's shared memory (the compiled kernel would refuse to launch), or None;
    None also where the limit cannot be read (the CPU, the interpreter)."""
    limit = shared_memory_limit(device)
    if limit is None:
        return None
    need, (a, b) = shared_memory_need(sizes, candidates, torch.empty((), dtype=dtype).element_size())
    if need <= limit:
        return None
    return (
        f"the kernels hold whole layers on chip, and this machine's {a} x {b} {str(dtype).removeprefix('torch.')} "
        f"coupling needs about {need // 1024} KiB of shared memory per program, this GPU has {limit // 1024} KiB"
    )


def too_large(sizes: list[int], candidates: int, limits: dict[str, int]) -> str | None:
    """Which of the machine's widths (sizes = [H_1, ..., H_M, n]; candidates = prototypes + memory slots) exceed
    `limits`, or None."""
    have = {"hidden units": max(sizes[:-1]), "coordinates": sizes[-1], "candidates": candidates}
    over = [f"{have[k]} {k} (at most {v})" for k, v in limits.items() if have[k] > v]
    return f"the kernels hold whole layers on chip, and this machine has {', '.join(over)}" if over else None


def choose_backend(
    requested: str,
    device: torch.device,
    dtype: torch.dtype,
    integ: Integrator,
    sizes: list[int],
    candidates: int,
    kinds: list[str],
    nudge: str | None = None,
) -> Backend:
    """auto: triton on a CUDA device where it can run, else torch. Asking for triton where it cannot run is a
    ConfigError naming the reason (the CLI prints it, no traceback)."""
    if requested == "torch":
        return Backend("torch", "--window_backend torch")
    blocker = triton_blocker(device, dtype, integ, sizes, candidates, kinds, nudge)
    if requested == "triton":
        if blocker is not None:
            raise ConfigError(f"window_backend: triton cannot run here: {blocker}; use --window_backend auto or torch")
        return Backend("triton", "--window_backend triton")
    if blocker is None and device.type == "cuda":
        tight = too_large(sizes, candidates, FITS)
        if tight is None and AUTO_TAKES_TRITON:
            return Backend("triton", "auto: a CUDA device, triton imports and the shapes fit the kernels")
        if tight is None:
            return Backend("torch", "auto: AUTO_TAKES_TRITON is off; --window_backend triton runs the kernels")
        blocker = f"{tight}; --window_backend triton runs it anyway, its registers may spill"
    return Backend("torch", f"auto: {blocker or 'the CPU (triton runs there only in its interpreter, when asked for)'}")


def choose_readout_backend(requested: str, like: torch.Tensor, cost: type, sizes: tuple[int, int, int, int]) -> Backend:
    """The readout's backend for this cost class and sizes (batch, coordinates, candidates, classes) on `like`'s device
    and dtype. The kernel computes the Retrieval cost itself (a subclass may compute otherwise) for a readout one
    program holds; asking for triton where it cannot run is a ConfigError."""
    if requested == "torch":
        return Backend("torch", "--readout_backend torch")
    blocker = (
        f"the kernel computes the retrieval cost, this run's is {getattr(cost, 'kind', cost)}"
        if cost is not Retrieval
        else kernel_blocker(like.device, like.dtype)
    )
    if blocker is None and (requested == "triton" or like.device.type == "cuda"):  # triton imports, and may be taken
        from trainer2.physics.kernels import readout_grads

        _, coordinates, candidates, _ = sizes
        if not readout_grads.fits(coordinates, candidates, like.element_size()):
            blocker = (
                f"{candidates} candidates x {coordinates} coordinates of {like.dtype} are more than one program "
                f"holds ({readout_grads.MAX_BYTES // 1024} KiB padded)"
            )
    if requested == "triton":
        if blocker is not None:
            raise ConfigError(
                f"readout_backend: triton cannot run here: {blocker}; use --readout_backend auto or torch"
            )
        return Backend("triton", "--readout_backend triton")
    if blocker is None and like.device.type == "cuda":
        if AUTO_TAKES_TRITON_READOUT:
            return Backend("triton", "auto: a CUDA device, triton imports and the readout fits")
        return Backend("torch", "auto: AUTO_TAKES_TRITON_READOUT is off; --readout_backend triton runs the kernel")
    return Backend("torch", f"auto: {blocker or 'the CPU (triton runs there only in its interpreter, when asked for)'}")


def readout_kernel(
    backend: Backend, sizes: tuple[int, int, int, int], beta_r: float, layout: RotorLayout, like: torch.Tensor
):
    """The Triton readout (kernels/readout_grads.py) where `backend` is triton, else None; imports triton only then.
    Its rotor's angle gradient takes one launch more (kernels/rotor_angle_grad.py) in Triton's interpreter or where
    AUTO_TAKES_TRITON_ROTOR is on, else the torch function."""
    if backend.name != "triton":
        return None
    from trainer2.physics.kernels.readout_grads import ReadoutGrads
    from trainer2.physics.kernels.rotor_angle_grad import RotorAngleGrad

    rotor = RotorAngleGrad(layout, like) if unmeasured_kernel_wanted(AUTO_TAKES_TRITON_ROTOR, like.device) else None
    return ReadoutGrads(*sizes, beta_r, like, rotor)


def frame_kernel(
    readout: Backend,
    requested: str,
    layout: RotorLayout,
    candidates: int,
    beta_r: float,
    eps: float,
    blocks: FoldBlocks,
    like: torch.Tensor,
):
    """The Triton frame and fold (kernels/readout_frame.py) beside the readout kernel (`readout`: its backend), where
    --readout_backend triton asked for the kernels or auto took them and AUTO_TAKES_TRITON_FRAME is on, and the rotor
    fits one program; else None (the torch functions). Imports triton only then."""
    if readout.name != "triton" or not (requested == "triton" or AUTO_TAKES_TRITON_FRAME):
        return None
    from trainer2.physics.kernels import readout_frame

    if not readout_frame.fits(layout.index.shape[1], layout.n, like.element_size()):
        return None
    return readout_frame.FrameKernel(layout, candidates, beta_r, eps, blocks, like)


def choose_update_backend(requested: str, device: torch.device, dtype: torch.dtype) -> Backend:
    """The update's backend. The fused kernel runs any machine (it works on the flat parameter buffer), so only the
    device, the dtype and triton itself can refuse it; asking for triton where it cannot run is a ConfigError."""
    if requested == "torch":
        return Backend("torch", "--update_backend torch")
    blocker = kernel_blocker(device, dtype)
    if requested == "triton":
        if blocker is not None:
            raise ConfigError(f"update_backend: triton cannot run here: {blocker}; use --update_backend auto or torch")
        return Backend("triton", "--update_backend triton")
    if blocker is None and device.type == "cuda":
        if AUTO_TAKES_TRITON_UPDATE:
            return Backend("triton", "auto: a CUDA device and triton imports")
        return Backend("torch", "auto: AUTO_TAKES_TRITON_UPDATE is off; --update_backend triton runs the kernel")
    return Backend("torch", f"auto: {blocker or 'the CPU (triton runs there only in its interpreter, when asked for)'}")


def ep_kernel(window: Backend, energy, scale: float, like: torch.Tensor):
    """The Triton EP statistic (kernels/ep_statistic.py) beside the Triton window (`window`: its backend) where every
    coupling is trainer2's Dense and Triton runs in its interpreter or AUTO_TAKES_TRITON_EP is on; else None (the
    couplings' own ep_grads). Imports triton only then."""
    if window.name != "triton" or not unmeasured_kernel_wanted(AUTO_TAKES_TRITON_EP, like.device):
        return None
    from trainer2.physics.kernels import ep_statistic

    return ep_statistic.EPStatistic(scale, like) if ep_statistic.serves(energy) else None


def stats_kernel(window: Backend, ws: Workspace, ws_nudged: Workspace | None, dt: float):
    """The Triton window observables (kernels/window_stats.py) over the free and nudged workspaces' spd histories
    (ws_nudged None without nudged phases) beside the Triton window (`window`: its backend) where Triton runs in its
    interpreter or AUTO_TAKES_TRITON_STATS is on; else None (Relaxation.free_stats and nudged_stats)."""
    like = ws.spd_hist
    if window.name != "triton" or not unmeasured_kernel_wanted(AUTO_TAKES_TRITON_STATS, like.device):
        return None
    from trainer2.physics.kernels.window_stats import WindowStatsKernel

    nudged = None if ws_nudged is None else tuple(ws_nudged.spd_hist.shape)
    return WindowStatsKernel(tuple(like.shape), nudged, dt, like)


def metrics_kernel_wanted(device: torch.device) -> bool:
    """Whether the fused update on `device` brings the metrics kernel: in Triton's interpreter (the CPU's tests and
    benches) always, on a CUDA device while AUTO_TAKES_TRITON_METRICS is on."""
    return unmeasured_kernel_wanted(AUTO_TAKES_TRITON_METRICS, device)


class TritonWindow:
    """The fixed-point steps of a phase (Jacobi or even/odd, by the run's integrator) as one Triton launch per call, a
    PhaseFn like fixed_point_steps. It does a phase's set-up itself (`sets_up`): a free run at rest starts from 0, a
    free run of free_phase (`to_s0`) writes its last state into `s0` (the saved free equilibrium's layers) as well, and
    a nudged run reads its rows' drive and target mask from the free workspace `free_ws`, starts from `s0` at step 0
    (every nudged phase starts there) and forms its rows' factors, so the caller neither zeroes, copies nor sets them.
    `launches` counts the calls (a Python int, no tensor work), so a test can prove the kernels ran rather than a
    silent fallback."""

    sets_up = True

    def __init__(self, s0: list[torch.Tensor], free_ws: Workspace) -> None:
        from trainer2.physics.kernels.free_phase import free_window
        from trainer2.physics.kernels.nudged_phase import nudged_window

        self.free, self.nudged, self.s0, self.free_ws = free_window, nudged_window, s0, free_ws
        self.launches = 0

    def __call__(self, run: PhaseRun) -> None:
        if run.nudged:
            s0 = self.s0 if run.start == 0 else None  # a later run of the phase goes on from the workspace's state
            even_odd, free = run.integ.even_odd, self.free_ws
            self.nudged(run.ws, run.energy, run.fold, run.start, run.steps, run.one_hot, even_odd, free, s0)
        else:
            s0 = self.s0 if run.to_s0 else None
            self.free(run.ws, run.energy, run.fold, run.start, run.steps, run.integ.even_odd, run.at_rest, s0)
        self.launches += 1


def make_phase_function(
    backend: Backend, integ: Integrator, graph: Graph, s0: list[torch.Tensor], free_ws: Workspace
) -> PhaseFn:
    """The steps function of the chosen backend, for a chain or a graph energy; s0: the free equilibrium's layers,
    which the Triton free kernel writes, and free_ws the free phase's workspace: the nudged kernel reads both."""
    if backend.name == "triton":
        return TritonWindow(s0, free_ws)
    return graph_steps if integ.fixed_point and not graph.is_chain else phase_function(integ)


def graph_blocker(graph: Graph) -> str | None:
    """Why the Triton window cannot serve an energy of this topology (it runs chains), or None."""
    if graph.is_chain:
        return None
    return (
        f"the kernels run chains, and this energy is a graph of {len(graph.edges)} couplings over "
        f"{len(graph.names)} layers (skip couplings or boxes other than [0, 1]); its steps run in torch"
    )
