"""The relaxation of one batch: its settings (`DynamicsConfig`), workspaces, free and nudged phases, window statistics
and held-out scoring.

This is everything evaluation and sampling need; it holds no update state. `Relaxation` owns the
preallocated workspaces for one batch size, so its windows allocate nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import Field, field_validator, model_validator
from torch import Tensor

from trainer2.components import resolve, takes_keyword
from trainer2.physics.adjoint import AdjointWorkspace, adjoint_steps, set_masks
from trainer2.physics.costs import CostFrame
from trainer2.physics.dynamics import (
    FoldBlocks,
    FoldedFrame,
    Integrator,
    PhaseRun,
    State,
    Workspace,
    clamp_output,
    fold_frame,
    set_nudge_scale,
    staged_layers,
)
from trainer2.physics.energy import Energy, ep_grads, input_drive
from trainer2.physics.graph_steps import staged_graph_layers
from trainer2.physics.kernels.backend import (
    choose_backend,
    choose_readout_backend,
    ep_kernel,
    frame_kernel,
    graph_blocker,
    make_phase_function,
    nudge_blocker,
    readout_kernel,
    stats_kernel,
)
from trainer2.physics.machine import Machine
from trainer2.physics.memory import MemoryBank
from trainer2.physics.nudge import NudgeScheme
from trainer2.physics.readout import Candidates, ReadoutFrame, ReadoutResult, readout_frame
from trainer2.section import ConfigError, Section

MAX_BETA = 1.0  # the largest beta_nudge: a nudge as strong as the energy's own unit stiffness


class DynamicsConfig(Section):
    """How a batch relaxes: the phases' step counts, the nudge, the integrator and the code that runs the steps."""

    free_steps: int = Field(
        64, ge=1, le=10**6, description="Free-phase relaxation steps per window (formerly tbptt_window_steps)."
    )
    nudge_steps: int = Field(16, ge=1, le=10**6, description="Steps of each nudged phase.")
    beta_nudge: float = Field(
        0.003,
        gt=0.0,
        description="Nudging strength beta of the EP rules, at most 1; coupled learning's eta (it clamps q to q0 +- "
        "eta (target - q0)); CHL clamps q to the target itself.",
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
    window_backend: Literal["auto", "torch", "triton"] = Field(
        "auto",
        description="Relaxation phases: 'torch' operators, or 'triton' (one kernel launch per phase; needs the kernels "
        "extra and a CUDA device); 'auto' takes triton on CUDA where it can run, torch otherwise.",
    )
    maxpool_argmax: Literal["own", "free"] = Field(
        "own",
        description="Max pooling: where the EP rules' statistic unpools the nudged phases: 'own', each phase at its "
        "own argmax (as autograd of the energy per phase does, Laborieux et al. 2021; a window whose argmax differs "
        "between the phases adds a jump of O(1/beta)); 'free', both at the free equilibrium's (one linear piece of E, "
        "the one the exact gradient differentiates: nearer it, but conv_deep trains worse so). CHL always takes own, "
        "rbp always s0's; a rule of your own passes dynamics.own_argmax to its NudgeScheme.",
    )
    readout_backend: Literal["auto", "torch", "triton"] = Field(
        "auto",
        description="The retrieval readout's loss and gradients at the free equilibrium: 'torch' operators, or "
        "'triton' (one kernel launch; needs the kernels extra and a CUDA device); 'auto' keeps torch until a GPU has "
        "run the kernel.",
    )

    @property
    def own_argmax(self) -> bool:
        return self.maxpool_argmax == "own"

    @field_validator("beta_nudge")
    @classmethod
    def _nudge(cls, v: float) -> float:
        # EP's estimate is a finite difference in beta, good while the nudge is a small pull beside the energy's
        # forces; coupled learning's eta beyond 1 clamps q past the target. Far above 1 the nudged phases overflow,
        # every update is dropped and the run stops blaming the learning rate.
        if v > MAX_BETA:
            raise ValueError(
                f"beta_nudge {v:g} is above {MAX_BETA:g}: the nudge would outweigh the energy (EP's estimate is no "
                "longer a gradient; coupled learning would clamp q past the target); give beta_nudge a small value "
                "such as 0.003 (the default) to 0.1"
            )
        return v

    @model_validator(mode="after")
    def _stable(self) -> "DynamicsConfig":
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
        if self.relaxation == "even_odd" and not self.dt == self.gamma == self.mass == 1.0:
            raise ValueError(
                f"relaxation even_odd runs the fixed-point steps only (dt = gamma = mass = 1), this run has dt "
                f"{self.dt:g}, gamma {self.gamma:g}, mass {self.mass:g}: the leapfrog moves every layer at once "
                "(--relaxation jacobi)"
            )
        return self


@dataclass
class WindowStats:
    """Window observables, each a 0-dim tensor: free-phase LIoR path length, mean and last spd (the free phase's
    convergence residual), mean R_sc (batch means), and the nudged phases' path length and last spd (their residual;
    both 0 when a gradient source runs no nudged phase)."""

    lior_mean: Tensor
    spd_mean: Tensor
    spd_last: Tensor
    R_mean: Tensor
    lior_nudge: Tensor
    spd_last_nudge: Tensor


@dataclass
class FreeState:
    """What the free phase fixes for the rest of the batch: the clamped input x (B, D), the readout frame
    (and its folded matrices), the retrieval candidates, the cost's view of them and the energy with what it derives
    from the parameters for the window. The equilibrium itself is in `Relaxation.s0`."""

    x: Tensor
    frame: ReadoutFrame
    fold: FoldedFrame
    cand: Candidates
    cost: CostFrame
    energy: Energy  # the machine's energy for this window (Energy.for_window)


class Relaxation:
    """Workspaces and the saved free equilibrium s0 for one batch size. The free phase relaxes B rows; the nudged
    phases the learning rule asks for (its NudgeScheme; by default EP's +beta and -beta) relax one stacked workspace
    of phases x B rows; an adjoint scheme (recurrent backprop) gets the adjoint's workspace instead. The readout's
    cost (the machine's `cost`) scores q and pulls it in the nudged phases."""

    def __init__(
        self,
        machine: Machine,
        cfg: DynamicsConfig,
        batch: int,
        memory: MemoryBank | None = None,
        scheme: NudgeScheme | None = None,
    ) -> None:
        self.m, self.cfg, self.batch, self.memory = machine, cfg, batch, memory
        like = machine.readout.protos
        sizes = machine.state_sizes()
        num_cand = machine.num_classes + (0 if memory is None else memory.coords.shape[0])
        self.integ = Integrator(cfg.dt, cfg.gamma, cfg.mass, cfg.relaxation)  # the one place the order is read
        self.cost = resolve("cost", machine.spec.cost)  # trainer2.physics.costs, found once
        self.nudge = NudgeScheme.centred(cfg.beta_nudge, own_argmax=cfg.own_argmax) if scheme is None else scheme
        refuse_pieces_without_at(machine, self.nudge)
        # The relaxation's backend (torch operators, or one Triton launch per phase), chosen once per run, not per step
        graph = machine.energy.graph
        kinds = machine.energy.kinds()
        served = graph_blocker(graph) or nudge_blocker(self.nudge, self.cost.kind, self.cost.folded)
        self.backend = choose_backend(
            cfg.window_backend, like.device, like.dtype, self.integ, sizes, num_cand, kinds, served
        )
        # The EP statistic (trainer2.physics.energy.ep_grads), or one Triton launch a coupling beside the Triton window;
        # a scheme without nudged phases (recurrent backprop's adjoint) forms no statistic
        phases = self.nudge.phases
        kernel = ep_kernel(self.backend, machine.energy, 1.0 / (self.nudge.divisor * batch), like) if phases else None
        self.ep_statistic = kernel or ep_grads
        # The retrieval readout's loss and gradients at s0: the cost's torch operators, or one Triton launch
        counts = (batch, sizes[-1], num_cand, machine.num_classes)
        self.readout_backend = choose_readout_backend(cfg.readout_backend, like, self.cost, counts)
        beta_r, layout = machine.spec.retrieval_beta, machine.layout
        self.readout_kernel = readout_kernel(self.readout_backend, counts, beta_r, layout, like)
        self.one_hot = memory is None  # every label has exactly one candidate, its prototype
        self.targets = self.cost.uses_target or self.nudge.clamp  # each batch forms c_y per row (not the default)
        fixed, phases = self.integ.fixed_point, self.nudge.phases
        if not graph.is_chain:
            temps = [sizes[j] for j in staged_graph_layers(machine.energy, self.integ.even_odd)]
        else:
            temps = [sizes[j] for j in staged_layers(machine.energy)] if self.integ.even_odd else None
        driven = [sizes[j] for j in graph.driven]
        self.ws = Workspace.allocate(batch, sizes, num_cand, cfg.free_steps, [0.0], like, fixed, temps, driven)
        self.ws_nudged = None  # none without nudged phases
        if phases:
            betas = list(self.nudge.betas)
            self.ws_nudged = Workspace.allocate(
                phases * batch, sizes, num_cand, cfg.nudge_steps, betas, like, fixed, temps, driven
            )
        self.adjoint = adjoint_workspace(machine, batch, self.integ) if self.nudge.kind == "adjoint" else None
        # The window's observables (free_stats and nudged_stats), or one Triton launch beside the Triton window
        self.stats_kernel = stats_kernel(self.backend, self.ws, self.ws_nudged, cfg.dt)
        self.protos = machine.prototype_candidates()  # the live prototypes; labels and bias made once
        self.fold_blocks = FoldBlocks.make(sizes[-1], num_cand, machine.spec.eps, like)
        # The readout's frame and its fold once a batch: the torch functions, or one Triton launch beside the readout's
        self.frame_kernel = frame_kernel(
            self.readout_backend, cfg.readout_backend, layout, num_cand, beta_r,
            machine.spec.eps, self.fold_blocks, like,
        )  # fmt: skip
        self.s0 = State.zeros(batch, sizes, like, momenta=not self.integ.fixed_point)
        self.steps_fn = make_phase_function(self.backend, self.integ, graph, self.s0.s, self.ws)  # a phase's steps
        self.kernels_set_up = getattr(self.steps_fn, "sets_up", False)  # rest, s0, the nudged start (Triton)
        # The nudged equilibria, as views of the stacked workspace (the nudge scheme says which rows are which).
        nudged = self.ws_nudged.state.s if phases else []
        self.s_plus = self.nudge.plus(nudged, self.s0.s, batch) if phases else []  # none without nudged phases
        self.s_minus = self.nudge.minus(nudged, self.s0.s, batch) if phases else []
        # What every nudged phase starts from (the free phase's mask, drive, equilibrium and targets), copied in one
        # operator for torch's steps (the Triton kernel reads them in place): each of the stacked workspace's
        # (phases x B, H) buffers seen as `phases` blocks of the batch's rows
        pairs: list[tuple[Tensor, Tensor]] = []
        if phases:
            pairs = [(self.ws_nudged.target_mask, self.ws.target_mask)]
            pairs += zip(self.ws_nudged.drives, self.ws.drives, strict=True)
            pairs += zip(self.ws_nudged.state.tensors(), self.s0.tensors(), strict=True)
            pairs += [(self.ws_nudged.target, self.ws.target)] if self.targets else []
        self.nudged_start = ([dst.view(phases, batch, -1) for dst, _ in pairs], [src for _, src in pairs])
        # Observability hooks (trainer2.monitor.telemetry): a timed/labelled context per phase, and progress
        # inside a window, on_steps(phase, step, steps, spd_last, lior), every progress_every steps.
        self.phase: Callable[[str], AbstractContextManager[None]] = lambda name: nullcontext()
        self.progress_every = 0
        self.on_steps: Callable[[str, int, int, float, float], None] | None = None

    @property
    def device(self) -> torch.device:
        return self.ws.drive.device

    def candidates(self) -> Candidates:
        return self.protos if self.memory is None else self.memory.candidates(self.protos)

    def free_phase(self, inputs: Tensor, targets: Tensor) -> FreeState:
        """Clamp the input, relax T_free steps from rest; leaves s0 in self.s0 and the window's spd in ws.spd_hist."""
        m, ws, cfg = self.m, self.ws, self.cfg
        x = m.input_vectors(inputs)
        cand = self.candidates()
        if self.frame_kernel is not None:
            frame, fold = self.frame_kernel(m.readout, cand, m.energy.output.bias)
        else:
            frame = readout_frame(m.readout, cand, m.layout, m.spec.retrieval_beta, m.spec.eps)
            fold = fold_frame(m.energy, frame, self.fold_blocks)
        cost = self.cost.frame(m.readout, frame, cand, m.num_classes, m.layout, self.one_hot)
        torch.eq(targets[:, None], cand.labels[None, :], out=ws.target_mask)  # 1.0 where the labels match
        if self.targets:
            self.cost.target(cost, ws.target_mask, ws.target)
        energy = m.energy.for_window()
        input_drive(x, energy, ws.drives)
        if not self.kernels_set_up:
            ws.state.zero_()
        free = FreeState(x, frame, fold, cand, cost, energy)
        self.relax(ws, free, cfg.free_steps, False, "free", at_rest=True, to_s0=True)
        if not self.kernels_set_up:
            self.s0.copy_(ws.state)
        return free

    def free_stats(self) -> dict[str, Tensor]:
        """The free window's observables (call right after free_phase): batch means, 0-dim."""
        spd_mean = self.ws.spd_hist.mean()  # (T, B): spd_hist holds exactly this window's steps
        return {
            "lior_mean": lior(self.m.readout.r_sc, self.cfg.dt * self.cfg.free_steps, spd_mean),
            "spd_mean": spd_mean,
            "spd_last": self.ws.spd_rows[-1].mean(),
            "R_mean": self.m.readout.r_sc.clone(),
        }

    def nudged_phases(self, free: FreeState) -> None:
        """Relax T_nudge steps from s0 on E + beta * loss (force blocks) or with q clamped (clamp blocks), every nudged
        phase at once (stacked rows)."""
        ws, k = self.ws_nudged, self.nudge.phases
        if not self.kernels_set_up:  # the Triton kernel reads the free rows, forms their factors (and never clamps)
            torch._foreach_copy_(*self.nudged_start)
            if self.nudge.clamp:
                clamp_output(ws)
            else:
                set_nudge_scale(ws, free.fold, self.integ, self.cost.folded)
        # Unclamped, the k phases start as k identical copies of s0 (their nudge enters through q's step alone).
        self.relax(ws, free, self.cfg.nudge_steps, True, "nudged", replicas=1 if self.nudge.clamp else k)

    def adjoint_phase(self, free: FreeState) -> list[Tensor]:
        """Recurrent backprop's second phase (an adjoint scheme): g = dloss/dq at q0, the box masks at s0, then
        nudge_steps sweeps of the adjoint (trainer2.physics.adjoint); returns mu, one (B, H_i) per state layer."""
        aw, ws = self.adjoint, self.ws
        self.cost.force(self.s0.s[-1], free.cost, ws.target_mask, ws.target, ws.readout, aw.g)
        set_masks(aw, self.s0.s, free.energy)
        adjoint_steps(free.energy, self.s0.s, aw, self.cfg.nudge_steps, self.integ.even_odd)
        return aw.mu

    def nudged_stats(self) -> dict[str, Tensor]:
        """The nudged phases' observables (after nudged_phases), 0-dim: their LIoR path length and their spd at the
        last step, the mean over the rows of every nudged phase (their convergence residual, as spd_last is the
        free phase's); both 0 when the scheme has no nudged phase (recurrent backprop)."""
        if self.ws_nudged is None:
            zero = torch.zeros((), dtype=self.ws.drive.dtype, device=self.device)
            return {"lior_nudge": zero, "spd_last_nudge": zero.clone()}
        path = lior(self.m.readout.r_sc, self.cfg.dt * self.cfg.nudge_steps, self.ws_nudged.spd_hist.mean())
        return {"lior_nudge": path, "spd_last_nudge": self.ws_nudged.spd_rows[-1].mean()}

    def window_stats(self) -> WindowStats:
        """The window's observables, after its phases and before the update moves R_sc: the stats kernel's one launch
        (views of its buffer, overwritten by the next window), or free_stats and nudged_stats."""
        if self.stats_kernel is None:
            return WindowStats(**self.free_stats(), **self.nudged_stats())
        nudged = None if self.ws_nudged is None else self.ws_nudged.spd_hist
        return WindowStats(**self.stats_kernel(self.m.readout.r_sc, self.ws.spd_hist, nudged))

    def run(
        self,
        ws: Workspace,
        free: FreeState,
        start: int,
        steps: int,
        nudged: bool,
        at_rest: bool = False,
        replicas: int = 1,
        to_s0: bool = False,
    ) -> None:
        """Relaxation steps start .. start + steps - 1 of a phase over workspace ws; at_rest: the phase starts from 0 in
        every layer (PhaseRun.at_rest), so the first step skips the pulls of layers still at 0; to_s0: free_phase's run
        (PhaseRun.to_s0); replicas: ws.state is that
        many identical row blocks (the unclamped nudged phases from s0), so the first step forms the pulls that do not
        read the nudged q on one block."""
        force = None
        if nudged and not self.cost.folded:  # the cost's force on this workspace's rows (retrieval's is folded)
            cost, f = self.cost, free.cost

            def force(q: Tensor, out: Tensor) -> Tensor:
                return cost.force(q, f, ws.target_mask, ws.target, ws.readout, out)

        clamp = nudged and self.nudge.clamp
        self.steps_fn(
            PhaseRun(
                ws,
                free.energy,
                free.frame,
                free.fold,
                self.integ,
                start,
                steps,
                nudged,
                self.one_hot,
                force,
                clamp,
                at_rest=at_rest,
                replicas=replicas,
                to_s0=to_s0,
            )
        )

    def relax(
        self,
        ws: Workspace,
        free: FreeState,
        steps: int,
        nudged: bool,
        name: str,
        at_rest: bool = False,
        replicas: int = 1,
        to_s0: bool = False,
    ) -> None:
        """A phase of `steps` steps; with on_steps set, in chunks of progress_every steps, each followed by one
        transfer of [spd_last mean, lior mean] (the chunks give the same result as one run)."""
        every = self.progress_every
        if self.on_steps is None or every < 1:
            self.run(ws, free, 0, steps, nudged, at_rest, replicas, to_s0)
            return
        for done in range(0, steps, every):
            n = min(every, steps - done)
            self.run(ws, free, done, n, nudged, at_rest and done == 0, replicas if done == 0 else 1, to_s0)
            path = lior(self.m.readout.r_sc, self.cfg.dt * (done + n), ws.spd_hist[: done + n].mean())
            spd_last, path_so_far = torch.stack([ws.spd_hist[done + n - 1].mean(), path]).tolist()
            self.on_steps(name, done + n, steps, spd_last, path_so_far)

    def readout_scores(self, free: FreeState) -> tuple[Tensor, Tensor]:
        """Per-example loss (B,) in nats and class probabilities (B, V) at s0, by the cost, without any gradient."""
        return self.cost.scores(self.s0.s[-1], free.cost, self.ws.target_mask, self.ws.readout)

    def readout_grads(self, free: FreeState) -> ReadoutResult:
        """Loss, probabilities and the readout's exact gradients (batch means) at s0, by the cost (or its kernel)."""
        if self.readout_kernel is not None:
            return self.readout_kernel(self.s0.s[-1], free.cost, self.ws.target_mask)
        return self.cost.loss_and_grads(self.s0.s[-1], free.cost, self.ws.target_mask, self.ws.readout)

    @torch.no_grad()
    def score(self, inputs: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        """Held-out scoring: (summed loss in nats, number correct), both 0-dim, after a free phase."""
        loss, probs = self.readout_scores(self.free_phase(inputs, targets))
        return loss.sum(), (probs.argmax(1) == targets).sum()


def lior(r_sc: Tensor, span: float, spd_mean: Tensor) -> Tensor:
    """The LIoR path length R_sc dt sum(spd) (batch mean, 0-dim) of steps spanning `span` = dt x steps whose mean spd
    is spd_mean. Two products, not one addcmul: CUDA's and Inductor's addcmul multiply in another order (other bits)."""
    return torch.mul(r_sc, span).mul_(spd_mean)


def refuse_pieces_without_at(machine: Machine, nudge: NudgeScheme) -> None:
    """A piecewise coupling (down_reads_below) whose ep_grads takes no `at` (written to the protocol before it) is
    refused by name where the rule hands it one: `maxpool_argmax: free`, and recurrent backprop (s0's piece)."""
    if not nudge.on_free_piece:
        return  # each phase on its own piece: ep_grads is called with three arguments
    e = machine.energy
    for c, kind, (below, _) in zip(e.couplings, e.kinds(), e.graph.edges):
        if below >= 0 and c.down_reads_below and not takes_keyword(c.ep_grads, "at"):
            why = "recurrent backprop (rule: rbp)" if nudge.kind == "adjoint" else "maxpool_argmax: free"
            raise ConfigError(
                f"coupling {kind} is piecewise (down_reads_below) and its ep_grads takes no `at`, the lower layer "
                f"whose piece {why} differentiates: add `at: Tensor | None = None` (trainer2.Coupling.ep_grads), "
                "or use maxpool_argmax: own with an EP rule"
            )


def adjoint_workspace(machine: Machine, batch: int, integ: Integrator) -> AdjointWorkspace:
    """The adjoint's buffers for `batch` rows (Jacobi's next values unless the order is even/odd); every coupling must
    linearise its pull (`add_up_linear` of the Coupling protocol)."""
    lacking = [
        kind for c, kind in zip(machine.energy.couplings, machine.energy.kinds()) if not hasattr(c, "add_up_linear")
    ]
    if lacking:
        raise ConfigError(
            f"rule: recurrent backprop's adjoint needs each coupling's add_up_linear (trainer2.Coupling), and coupling "
            f"{lacking[0]} has none"
        )
    like = machine.readout.protos
    return AdjointWorkspace.allocate(batch, machine.state_sizes(), like, jacobi=not integ.even_odd)
