"""Runs the whole batch step (`BatchStep.step`) eagerly, compiled, or as a replayed CUDA graph: one code path.

Every batch is first copied into static device buffers. Graph mode warms the step up on a side
stream, captures it once with torch.cuda.graph (free window, nudged windows, update, constraints,
memory write, metrics) and from then on replays it. The graph replays the eager code itself, so
anything that changes between batches lives in a tensor updated in place (parameters, lr, ...).
If compiling or capturing fails, one message is printed and the run goes on eagerly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from trainer2.learning.step import BatchStep
from trainer2.section import ConfigError
from trainer2.train_config import TrainConfig

Log = Callable[[str], None]
KERNEL_FIELDS = ("window_backend", "update_backend", "readout_backend")


class StepKernels(NamedTuple):
    """The config a run builds its batch step from, and the line that says what changed (None: the run's config)."""

    cfg: TrainConfig
    note: str | None


def kernels_for_mode(cfg: TrainConfig, device: torch.device) -> StepKernels:
    """Under torch.compile with CUDA graphs (own or reduce-overhead's) on CUDA, `auto` backends take torch and triton is
    refused: on an H200 (64c1620) each set of Triton kernels tried made the compiled step's capture fail."""
    graphs = cfg.use_cudagraphs or cfg.compile_mode == "reduce-overhead"
    if not (cfg.use_torch_compile and graphs and device.type == "cuda"):
        return StepKernels(cfg, None)
    for name in KERNEL_FIELDS:
        if getattr(cfg, name) == "triton":
            raise ConfigError(
                f"{name}: triton cannot run inside a torch.compile'd step captured as a CUDA graph "
                "(--use_torch_compile with --use_cudagraphs or --compile_mode reduce-overhead: its capture fails); "
                f"drop --use_torch_compile or use --{name} auto or torch"
            )
    auto = [name for name in KERNEL_FIELDS if getattr(cfg, name) == "auto"]
    if not auto:
        return StepKernels(cfg, None)
    note = (
        f"torch.compile with CUDA graphs: {', '.join(auto)} set from auto to torch (a compiled step with a Triton "
        "kernel in it failed capture; CUDA graphs without --use_torch_compile leave auto its kernels)"
    )
    return StepKernels(cfg.model_copy(update=dict.fromkeys(auto, "torch")), note)


def reason(e: BaseException) -> str:
    """The root cause of an exception in one line, for a fallback message."""
    while e.__cause__ is not None or getattr(e, "inner_exception", None) is not None:
        e = e.__cause__ or e.inner_exception
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def step_tensors(step: object) -> list[Tensor]:
    """Every tensor a batch step (or any part of one) reads or writes in place (parameters, update state, memory,
    workspace), once each. Walks dataclasses, trainer2 objects, lists, tuples and dicts."""
    found: dict[int, Tensor] = {}
    seen: set[int] = set()

    def walk(obj: object) -> None:
        if isinstance(obj, Tensor):
            found.setdefault(id(obj), obj)
            return
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, (list, tuple)):
            for o in obj:
                walk(o)
        elif isinstance(obj, dict):
            for o in obj.values():
                walk(o)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            for f in dataclasses.fields(obj):
                walk(getattr(obj, f.name))
        elif type(obj).__module__.startswith("trainer2.") and hasattr(obj, "__dict__"):
            for o in vars(obj).values():
                walk(o)

    walk(step)
    return list(found.values())


@dataclass
class StaticBatch:
    """Device buffers inputs (B, ...) and targets (B,) at fixed addresses, which a captured graph reads.

    With CUDA, host batches are staged through two pinned slots; slot k's event marks when the device has
    read it, so the host never overwrites a slot whose copy is still queued behind a replay."""

    inputs: Tensor
    targets: Tensor
    pinned: list[tuple[Tensor, Tensor]]
    read: list[torch.cuda.Event]
    slot: int = 0

    @staticmethod
    def allocate(inputs: Tensor, targets: Tensor, device: torch.device) -> "StaticBatch":
        def new(t: Tensor) -> Tensor:
            return torch.zeros(t.shape, dtype=t.dtype, device=device)

        cuda = device.type == "cuda"
        pinned = [
            (torch.zeros_like(inputs, device="cpu").pin_memory(), torch.zeros_like(targets, device="cpu").pin_memory())
            for _ in range(2 if cuda else 0)
        ]
        return StaticBatch(new(inputs), new(targets), pinned, [torch.cuda.Event() for _ in pinned])

    def load(self, inputs: Tensor, targets: Tensor) -> None:
        """Copy one batch in; host tensors go through a pinned slot and a non-blocking copy on CUDA."""
        if inputs.shape != self.inputs.shape or targets.shape != self.targets.shape:
            raise ValueError(
                f"batch of shape {tuple(inputs.shape)} / {tuple(targets.shape)} does not fit the static buffers "
                f"{tuple(self.inputs.shape)} / {tuple(self.targets.shape)}: a static step runs one batch shape"
            )
        if self.pinned and inputs.device.type == "cpu":
            k, self.slot = self.slot, 1 - self.slot
            self.read[k].synchronize()  # the copy that last read slot k has run (returns at once if never recorded)
            pin_x, pin_y = self.pinned[k]
            pin_x.copy_(inputs)
            pin_y.copy_(targets)
            self.inputs.copy_(pin_x, non_blocking=True)
            self.targets.copy_(pin_y, non_blocking=True)
            self.read[k].record()
        else:
            self.inputs.copy_(inputs, non_blocking=True)
            self.targets.copy_(targets, non_blocking=True)


class StepRunner:
    """`step(inputs, targets)` = `BatchStep.step` on static buffers, run eagerly, through torch.compile, or by
    replaying a CUDA graph captured after `warmup_steps` eager steps on a side stream."""

    def __init__(
        self,
        step: BatchStep,
        *,
        graphs: bool = False,
        compile: bool = False,
        warmup_steps: int = 3,
        compile_mode: str = "default",
        compile_backend: str | Callable = "inductor",
        log: Log = print,
    ) -> None:
        self.batch_step, self.log = step, log
        self.device = step.device
        if graphs and self.device.type != "cuda":
            log("warning: --use_cudagraphs needs a CUDA device; none is in use here, so the run goes on eagerly")
            graphs = False
        # torch.compile's reduce-overhead mode records its own CUDA graphs, so the runner does not capture on top.
        self.own_graphs = graphs and not (compile and compile_mode == "reduce-overhead")
        self.warmup = max(warmup_steps, 1)  # capture needs one run first: lazy cuBLAS handles, compilation
        self.compiled: Callable[[Tensor, Tensor], None] | None = None
        self.compiled_ok = False
        self.cudagraph_trees = compile and compile_mode == "reduce-overhead" and self.device.type == "cuda"
        if compile:
            kw = {"mode": compile_mode} if compile_backend == "inductor" else {}
            # fullgraph: the step is one graph or nothing, so a failed compile has run none of it.
            self.compiled = torch.compile(step.step, fullgraph=True, dynamic=False, backend=compile_backend, **kw)
            if self.cudagraph_trees:
                for t in step_tensors(step):  # updated in place: graphs may keep their addresses
                    torch._dynamo.mark_static_address(t)
        self.batch: StaticBatch | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.side: torch.cuda.Stream | None = None
        self.steps = 0

    @staticmethod
    def from_config(step: BatchStep, cfg: TrainConfig, log: Log = print) -> "StepRunner":
        return StepRunner(
            step,
            graphs=cfg.use_cudagraphs,
            compile=cfg.use_torch_compile,
            warmup_steps=cfg.warmup_steps,
            compile_mode=cfg.compile_mode,
            log=log,
        )

    @property
    def mode(self) -> str:
        """What runs now, after any fallback: 'eager', 'compile', 'graph' or 'compile+graph'."""
        graph = self.own_graphs or self.cudagraph_trees
        return {
            (False, False): "eager",
            (True, False): "compile",
            (False, True): "graph",
            (True, True): "compile+graph",
        }[(self.compiled is not None, graph)]

    def step(self, inputs: Tensor, targets: Tensor) -> None:
        """One batch step on (inputs (B, ...), targets (B,)), on the host or the device."""
        if self.batch is None:
            self.batch = StaticBatch.allocate(inputs, targets, self.device)
            if self.cudagraph_trees:
                torch._dynamo.mark_static_address(self.batch.inputs)
                torch._dynamo.mark_static_address(self.batch.targets)
        self.batch.load(inputs, targets)
        self.steps += 1
        # Inference mode, not just no_grad: every operator skips the autograd bookkeeping that no_grad still does, and
        # the step's temporaries carry no version counter; on the CPU, where a dev window is some 300 small operators,
        # that is most of commit c4ac50d's 1.11x (docs/performance.md). Entered here, around the compiled function
        # rather than inside it (torch.compile refuses it there).
        with torch.inference_mode():
            if self.graph is not None:
                self.graph.replay()
            elif not self.own_graphs:
                self._call()
            elif self.steps <= self.warmup:
                self._warm_up()
            elif self._capture():
                self.graph.replay()  # capturing records the step without running it
            else:
                self._call()

    def invalidate(self) -> None:
        """Drop the captured graph (after replacing any tensor the step touches); it is captured again after warm-up."""
        self.graph, self.steps = None, 0

    # --- internals ---

    def _call(self) -> None:
        b = self.batch
        if self.compiled is not None:
            if self.cudagraph_trees:
                torch.compiler.cudagraph_mark_step_begin()
            try:
                self.compiled(b.inputs, b.targets)
                self.compiled_ok = True
                return
            except Exception as e:
                if self.compiled_ok:
                    raise  # it compiled and ran before: this is a real error, not a missing toolchain
                self.compiled, self.cudagraph_trees = None, False
                rest = "without compiling" if self.own_graphs else "eagerly"
                self.log(f"warning: torch.compile of the batch step failed ({reason(e)}); the run goes on {rest}")
        self.batch_step.step(b.inputs, b.targets)

    def _warm_up(self) -> None:
        """One eager (or compiling) step on a side stream, as CUDA graph capture requires."""
        if self.side is None:
            self.side = torch.cuda.Stream(self.device)
        self.side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side):
            self._call()
        torch.cuda.current_stream(self.device).wait_stream(self.side)

    def _capture(self) -> bool:
        """Record the whole step on the static buffers; False (after one message) if CUDA refuses it."""
        fn = self.compiled or self.batch_step.step
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                fn(self.batch.inputs, self.batch.targets)
        except Exception as e:
            self.log(
                f"warning: CUDA graph capture of the batch step failed ({reason(e)}); the run goes on without graphs"
            )
            self.own_graphs = False
            torch.cuda.synchronize(self.device)
            return False
        self.graph = graph
        return True
