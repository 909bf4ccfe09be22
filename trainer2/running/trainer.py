"""The training recipe: setup, train, evaluate, save. Grad mode is off throughout; nothing here uses autograd.

The Trainer builds its parts once, in __init__ (the machine, the batch step from the config's learning rule or from
the gradient source it is given, the runner, the sampler, the callbacks), and never replaces them. The loop is
`run_windows`; what runs beside it (progress bar, telemetry, divergence checks, stop signals, checkpoints) are its
callbacks.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from torch import Tensor

from trainer2.callbacks import Callback, Callbacks, LoopState
from trainer2.data.augment import shift_images, window_generator
from trainer2.data.dataset import Dataset
from trainer2.data.sampler import STATE_KEYS as SAMPLER_KEYS
from trainer2.data.sampler import Sampler, sampler_state
from trainer2.io.console import Log
from trainer2.learning.averaging import average_keys
from trainer2.learning.gradients import GradientSource
from trainer2.learning.params import ParamTable
from trainer2.learning.step import BatchStep, build_step
from trainer2.learning.update import ADDED_METRICS, UpdateConfig, lr_at
from trainer2.monitor.monitor import Monitor
from trainer2.monitor.progress import ProgressBar
from trainer2.physics.dead_units import dead_units
from trainer2.physics.machine import Machine
from trainer2.physics.memory import MemoryBank
from trainer2.physics.relaxation import DynamicsConfig
from trainer2.running import checkpoint as ck
from trainer2.running.checkpointing import (
    Checkpointer,
    Progress,
    check_global_batch,
    check_sampler,
    restore_counters,
    restore_rng,
    resume_notes,
    rng_tensors,
)
from trainer2.running.checkpointing import run_meta as make_meta
from trainer2.running.distributed import Distributed
from trainer2.running.evaluation import evaluate_split, relaxation_cache
from trainer2.running.health import Diverged, Health, all_finite, divergence_message
from trainer2.running.metrics import metric_row
from trainer2.running.parts import all_cpu_threads, build_parts, resolve_device, set_library_switches
from trainer2.running.resume import resume_command
from trainer2.running.rundir import claim, write_error
from trainer2.running.signals import SignalStop, StopSignals
from trainer2.running.step_runner import StepRunner, kernels_for_mode
from trainer2.running.summary import last_evaluation, run_header, summary, write_summary
from trainer2.running.threads import thread_tuners
from trainer2.train_config import TrainConfig, to_yaml


@dataclass(frozen=True)
class Parts:
    """What a trainer computes with, wired once: data, machine, memory bank, parameter table, batch step, runner."""

    data: Dataset
    machine: Machine
    memory: MemoryBank | None
    params: ParamTable
    batch_step: BatchStep
    runner: StepRunner
    sampler: Sampler


def total_windows(cfg: TrainConfig, batches_per_epoch: float) -> int:
    """Windows a run will do: the tighter of max_windows and max_epochs (epochs of `batches_per_epoch` windows)."""
    limits = [] if cfg.max_windows is None else [cfg.max_windows]
    if cfg.max_epochs is not None:
        limits.append(math.ceil(cfg.max_epochs * batches_per_epoch))
    return min(limits)


def start_line(run_dir: Path, window: int, total: int, device: torch.device) -> str:
    """The one line a run from Python starts with: where it writes, which windows it trains, on which device."""
    if window == 0:
        return f"training {run_dir}: {total} windows on {device}"
    return f"training {run_dir}: windows {window + 1} to {total} on {device} (resumed at window {window})"


def announce(trainer: Trainer, total: int) -> None:
    """Before the first window: the resolved config, the data, device and backends (the log's notes, which a quiet
    run drops), then the one-line start (the headline, where there is one)."""
    trainer.log("config:\n" + to_yaml(trainer.cfg).rstrip())
    backends = {"window": trainer.relaxation.backend, "readout": trainer.relaxation.readout_backend}
    trainer.log(run_header(trainer.data, trainer.device, trainer.average, **backends, update=trainer.updater.backend))
    if trainer.kernel_note is not None:
        trainer.log(trainer.kernel_note)
    if trainer.headline is not None:
        trainer.headline(start_line(trainer.run_dir, trainer.progress.window, total, trainer.device))


class Trainer:
    """setup (in __init__) / train / evaluate; state_tensors, save_checkpoint and load_checkpoint for checkpoints.
    Evaluation and the run's model score `scored_machine`: the weight average when ema_decay > 0, else the machine."""

    def __init__(
        self,
        cfg: TrainConfig,
        gradients: GradientSource | None = None,
        log: Log = print,
        dist: Distributed | None = None,
        *,
        data: Dataset | None = None,
        resume_hint: str | None = None,
        headline: Log | None = None,  # the one-line start (trainer2.train's own log); None: none, as on the CLI
        callbacks: tuple[Callback, ...] = (),  # the caller's own, called after the trainer's at every hook
    ) -> None:
        self.cfg, self.log, self.headline = cfg, log, headline
        self.resume_hint = resume_command(cfg) if resume_hint is None else resume_hint  # summary.json's, when stopped
        self.dist = Distributed() if dist is None else dist  # one process unless torchrun started this one
        self.device = self.dist.place(resolve_device(cfg), cfg.device)
        torch.manual_seed(cfg.seed)  # the global RNGs too, so anything drawing from them repeats (and is checkpointed)
        set_library_switches(cfg)
        step_kernels = kernels_for_mode(cfg, self.device)  # the backends a compiled, captured step can run
        self.kernel_note = step_kernels.note
        built = build_parts(cfg, self.device, data, world=self.dist.world_size)  # sizes checked before anything large
        dynamics, self.update_cfg = step_kernels.cfg.section(DynamicsConfig), step_kernels.cfg.section(UpdateConfig)
        params = ParamTable.build(built.machine, self.update_cfg.eta_scales, self.update_cfg.weight_decay)
        machine, memory, dist = built.machine, built.memory, self.dist
        step = build_step(machine, dynamics, self.update_cfg, cfg.batch_size, memory, gradients, params, dist, cfg.rule)
        self.global_batch = cfg.batch_size * self.dist.world_size  # every rank draws it; rank r trains on slice r
        sampler = Sampler(built.data.num_examples("train"), self.global_batch, cfg.seed)
        self.parts = Parts(
            built.data, built.machine, built.memory, params, step, StepRunner.from_config(step, cfg, log), sampler
        )
        self.progress = Progress()
        self.history: list[dict[str, Any]] = []
        # The average's, when kept; evaluation runs eagerly, so with the config's own backends (not kernels_for_mode's)
        self.scoring = relaxation_cache(self.scored_machine, cfg.section(DynamicsConfig), built.memory)
        self.run_dir = Path(cfg.checkpoint_dir) / cfg.run_name
        self.run_id = uuid.uuid4().hex  # stamps this run's checkpoints: pruning removes only those (a resume keeps it)
        self.saved_at = -1  # window of the last checkpoint this trainer saved or loaded
        self.interval = (time.perf_counter(), 0)  # (clock, window) where the current log interval began
        self.signals = StopSignals()
        bar = ProgressBar(cfg.run_name, show=self.dist.is_main)
        eager = not ((cfg.use_cudagraphs and self.device.type == "cuda") or cfg.use_torch_compile)  # else timed whole
        self.monitor = Monitor(cfg, self.device, self.run_dir, eager, step.relax, bar, log, writes=self.dist.is_main)
        health = Health(cfg.eps, log, uniform_loss=math.log(max(built.data.num_classes, 2)))
        saver = Checkpointer(cfg.save_every_windows, self.save_checkpoint, lambda: all_finite(params.tensors))
        # Order matters at each hook: the bar first (the monitor hooks step progress into it), the stop signal
        # before the checkpointer (which saves at the window a stop was asked for), the monitor's record last.
        tuners = thread_tuners(cfg.cpu_threads, all_cpu_threads(), self.device.type, log)  # cpu_threads 0: measured
        stop = SignalStop(self.signals, self.dist, self.device)
        self.callbacks = Callbacks((*tuners, bar, health, stop, saver, self.monitor, *callbacks))

    # --- the wired parts, by name (read-only: Parts is frozen, and these properties have no setter) ---

    data = property(lambda self: self.parts.data)
    machine = property(lambda self: self.parts.machine)
    memory = property(lambda self: self.parts.memory)
    params = property(lambda self: self.parts.params)
    batch_step = property(lambda self: self.parts.batch_step)
    runner = property(lambda self: self.parts.runner)
    sampler = property(lambda self: self.parts.sampler)
    gradients = property(lambda self: self.parts.batch_step.gradients, doc="The gradient source every step calls.")
    updater = property(lambda self: self.parts.batch_step.updater)
    relaxation = property(lambda self: self.parts.batch_step.relax)
    average = property(lambda self: self.parts.batch_step.average, doc="The weight average (None: ema_decay 0).")
    scored_machine = property(lambda self: self.machine if self.average is None else self.average.machine)

    # --- training ---

    def next_batch(self) -> tuple[Tensor, Tensor]:
        """This rank's slice of the global batch, as host tensors; the StepRunner stages them onto the device."""
        b, r = self.cfg.batch_size, self.dist.rank
        inputs, targets = self.data.batch("train", self.sampler.next()[r * b : (r + 1) * b])
        if self.cfg.augment_shift:  # the draws depend on (seed, window, rank) only, so a resumed run repeats them
            gen = window_generator(self.cfg.seed, self.progress.window, r)
            inputs = shift_images(inputs, self.data.input_shape, self.cfg.augment_shift, gen)
        return inputs, targets

    @torch.no_grad()
    def train(self) -> dict[str, Any]:
        """Run to total_windows, save a checkpoint and the summary, and return the summary. The first stop signal
        (trainer2.running.signals) stops the run after the current window, still saving both (summary["interrupted"]
        names the signal, summary["resume_command"] continues the run); a divergence stops it without saving, and
        raises Diverged."""
        total = total_windows(self.cfg, self.sampler.batches_per_epoch)
        announce(self, total)
        if self.dist.is_main:
            claim(self.run_dir, self.run_id)
        state = LoopState(self.progress.window, total, eager=self.monitor.eager)
        with self.signals:
            self.callbacks.start(state)
            try:
                self.run_windows(state)
            finally:  # also when a write fails: the bar and the telemetry file are closed either way
                self.callbacks.end(state)
            if state.stop is not None and state.stop.diverged is not None:
                message = divergence_message(*state.stop.diverged, self.run_dir)
                self.save_summary(diverged=message)
                raise Diverged(message)
            if self.progress.window != self.saved_at:
                self.save_checkpoint()
            stopped = (state.stop.signal or state.stop.reason) if state.stop is not None and not state.done else None
            return self.save_summary(interrupted=stopped)

    def run_windows(self, state: LoopState) -> None:
        """The loop: windows until state.total or a stop asked for by a callback; metrics at log intervals, held-out
        evaluation at its cadence. A divergence ends it after recording its row, with state.stop saying why."""
        cfg, mon, hooks = self.cfg, self.monitor, self.callbacks
        start = time.perf_counter() - self.progress.wall_seconds
        self.interval = (time.perf_counter(), self.progress.window)
        lr = self.updater.state.lr
        self.dist.check_in(self.updater.metrics.values, self.params.tensors, everywhere=False)  # same start everywhere?
        while state.stop is None and not state.done:
            hooks.window_start(state)
            lr.fill_(lr_at(self.update_cfg, state.window, state.total))
            with mon.phase("data"):
                inputs, targets = self.next_batch()
            with mon.step_phase():
                self.runner.step(inputs, targets)
            self.progress.window += 1
            self.progress.examples += self.global_batch
            self.progress.wall_seconds = time.perf_counter() - start
            state.window = self.progress.window
            evaluating = bool(cfg.eval_every_windows) and state.window % cfg.eval_every_windows == 0
            # an evaluation window is logged too, whatever log_every_windows says: its figures need a row
            state.logged = state.window % cfg.log_every_windows == 0 or evaluating or state.done
            if state.logged:
                with mon.phase("logging"):
                    row = self.sync_metrics()
                hooks.metrics(state, row)
                diverged = state.stop is not None
                if not diverged and (evaluating or state.done):
                    row.update(self.evaluate())
                self.progress.wall_seconds = time.perf_counter() - start
                row["wall_seconds"] = self.progress.wall_seconds
                self.interval = (time.perf_counter(), state.window)  # evaluation stays out of windows/s
                if not diverged:
                    self.history.append(row)
                hooks.log(state, row)
            hooks.window_end(state)

    def sync_metrics(self) -> dict[str, Any]:
        """One device-to-host transfer of every accumulated metric (summed over the ranks), then reset them."""
        st = self.updater.state
        self.dist.check_in(self.updater.metrics.values, self.params.tensors, everywhere=True)  # all ranks' sums
        boxes = self.machine.energy.graph.boxes
        dead = dead_units(self.relaxation.s0.s[:-1], self.device, boxes)  # at the last window's free equilibrium
        sums, (lr, dropped_total, dead) = self.updater.metrics.read(st.lr, st.dropped, dead)
        p, (t0, w0) = self.progress, self.interval
        speed = (p.window - w0) / max(time.perf_counter() - t0, 1e-9)
        epoch = p.window / self.sampler.batches_per_epoch
        return metric_row(sums, p.window, p.examples, epoch, lr, dropped_total, int(dead), speed, self.data.tokens)

    # --- evaluation ---

    def evaluate(self, max_batches: int | None = None) -> dict[str, float]:
        """Validation (with a validation split; the held-out split is then left for `trainer2 evaluate`) or held-out
        loss in nats per example, accuracy and, for text, bits per character. Under torchrun each rank scores every
        world_size-th batch and the sums are added up."""
        limit = max_batches if max_batches is not None else self.cfg.eval_batches
        shard = (self.dist.rank, self.dist.world_size)
        return evaluate_split(self.scoring, self.data, self.device, limit, shard, self.dist.all_reduce_sum)

    # --- state ---

    def state_tensors(self) -> dict[str, Tensor]:
        """Every live tensor of the run's state, by checkpoint key; loading copies into these in place, so a
        captured graph still sees the same buffers: parameters, update state, metric sums, memory bank."""
        out = {f"param.{k}": v for k, v in zip(self.params.names, self.params.tensors, strict=True)}
        out.update(self.updater.tensors())
        if self.memory is not None:
            out.update(self.memory.tensors())
        return out | (self.average.tensors() if self.average is not None else {})

    def checkpoint_tensors(self) -> dict[str, Tensor]:
        """The tensors of a checkpoint: the live state, the sampler's state and the RNG states."""
        sampler = {f"sampler.{k}": v for k, v in self.sampler.state_dict().items()}
        return {**self.state_tensors(), **sampler, **rng_tensors(self.device)}

    def save_checkpoint(self) -> Path:
        """Write <run_dir>/step_<window>/ atomically (trainer2.running.checkpoint) and prune to keep_last; under
        torchrun every rank calls it (the metric sums are gathered into rank 0's) and rank 0 writes."""
        self.dist.check_in(self.updater.metrics.values, self.params.tensors, everywhere=False)
        path = self.run_dir / ck.step_name(self.progress.window)
        if self.dist.is_main:
            meta = make_meta(
                self.cfg, self.run_id, self.progress, self.sampler, self.dist.world_size, self.data, self.history
            )
            try:
                path = ck.save(self.run_dir, self.progress.window, self.checkpoint_tensors(), meta)
            except (OSError, SafetensorError) as e:  # disk full, read-only, quota: save removed its temporary dir
                raise write_error(path, e, "checkpoints saved before it are intact") from None
            ck.prune(self.run_dir, self.cfg.keep_last, self.run_id)
            self.log(f"checkpoint: {path}")
        self.saved_at = self.progress.window
        return path

    def load_checkpoint(self, path: Path) -> None:
        """Restore the run from checkpoint directory `path` in place; everything is checked before anything is
        copied, and a captured graph is captured again after warm-up."""
        path = Path(path)
        optional = frozenset({"rng.cuda", *(f"metrics.{k}" for k in ADDED_METRICS)}) | SAMPLER_KEYS  # older: absent
        optional |= average_keys(self.machine)  # ema_decay may change on resume: an average is kept or taken up anew
        fingerprint = ck.data_fingerprint(self.data)
        loaded, meta = ck.load_checked(path, self.cfg, fingerprint, self.checkpoint_tensors(), optional=optional)
        check_sampler(loaded, self.sampler, path)
        resume_notes(meta, self.data, path, self.log)
        check_global_batch(meta, path, self.cfg.batch_size, self.dist.world_size)
        for k, dst in self.state_tensors().items():  # a metric sum added since the checkpoint (ADDED_METRICS): from 0
            dst.copy_(loaded[k]) if k in loaded else dst.zero_()
        if self.average is not None and self.average.begun_anew(loaded):
            self.log(f"note: checkpoint {path} holds no weight average; it starts here from the resumed parameters")
        self.sampler.load_state_dict(sampler_state(loaded))
        restore_rng(loaded, self.device)
        restore_counters(self.progress, meta)
        self.history = list(meta["history"])
        if isinstance(meta.get("run_id"), str) and path.resolve().parent == self.run_dir.resolve():
            self.run_id = meta["run_id"]  # the same run goes on; a branch into a new directory is a run of its own
        if not self.dist.is_main:
            self.updater.metrics.values.zero_()  # the saved sums are every rank's: rank 0 alone carries them on
        self.saved_at = self.progress.window
        self.runner.invalidate()
        self.log(f"resumed from {path} at window {self.progress.window}")

    def save_summary(self, interrupted: str | None = None, diverged: str | None = None) -> dict[str, Any]:
        """Write <run_dir>/summary.json and return it. Its figures (validation, with a validation split, else held-out)
        come from the last evaluation (heldout_window says when); a stopped run is not evaluated again."""
        last = last_evaluation(self.history)
        if last is None and interrupted is None and diverged is None:
            last = {"window": self.progress.window, **self.evaluate()}
        values = summary(
            last,
            self.data.kind,
            self.progress,
            dropped_updates=float(self.updater.state.dropped),
            device=str(self.device),
            window_backend=self.relaxation.backend.name,
            update_backend=self.updater.backend.name,
            readout_backend=self.relaxation.readout_backend.name,
            scored_weights="raw" if self.average is None else "average",
            interrupted=interrupted,
            **({"resume_command": self.resume_hint} if interrupted else {}),  # the terminal may be gone
            diverged=diverged is not None,
            **({"error": diverged} if diverged else {}),
        )
        if self.dist.is_main:
            write_summary(self.run_dir, values)
        return values
