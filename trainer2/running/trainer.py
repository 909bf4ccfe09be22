"""The training recipe: setup, train, evaluate, save. Grad mode is off throughout; nothing here uses autograd.

The Trainer is the one owner of a run's parts: it builds the machine, the batch step (from the gradient
source it is given, EP by default) and the runner once, in __init__, and never replaces them.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from torch import Tensor
from tqdm import tqdm

from trainer2.config import ConfigError, TrainConfig, to_yaml
from trainer2.io.augment import shift_images, window_generator
from trainer2.io.data import DataError, Dataset
from trainer2.io.safeio import write_replace
from trainer2.io.sampler import STATE_KEYS as SAMPLER_KEYS
from trainer2.io.sampler import Sampler, sampler_state
from trainer2.io.telemetry import Monitor
from trainer2.learning.gradients import GradientSource, ep_gradients
from trainer2.learning.params import ParamTable
from trainer2.learning.step import BatchStep, build_step
from trainer2.learning.update import ADDED_METRICS, Updater
from trainer2.physics.dead_units import dead_units
from trainer2.physics.machine import Machine
from trainer2.physics.memory import MemoryBank
from trainer2.physics.relaxation import Relaxation
from trainer2.running import checkpoint as ck
from trainer2.running.distributed import Distributed
from trainer2.running.evaluation import heldout_from_sums, heldout_sums, relaxation_cache
from trainer2.running.health import Diverged, Health, divergence_message, nonfinite
from trainer2.running.parts import build_parts, resolve_device
from trainer2.running.rundir import SUMMARY_FILE, claim, write_error
from trainer2.running.signals import STOP_SIGNALS, StopSignals
from trainer2.running.step_runner import StepRunner

# Parts wired once in __init__; assigning one afterwards is refused (pass gradients= to Trainer instead).
WIRED = frozenset(
    {
        "cfg",
        "dist",
        "device",
        "data",
        "machine",
        "memory",
        "params",
        "batch_step",
        "runner",
        "sampler",
        "monitor",
        "run_dir",
    }
)
HISTORY_ROWS = 200  # logged rows a checkpoint's meta.json keeps; telemetry.jsonl is the full record


def lr_at(cfg: TrainConfig, window: int, total: int) -> float:
    """Learning rate for window `window` of `total`: linear warm-up, then constant or cosine to lr_min_ratio."""
    if window < cfg.lr_warmup_windows:
        return cfg.eta_update * (window + 1) / cfg.lr_warmup_windows
    if cfg.lr_schedule == "constant":
        return cfg.eta_update
    frac = min(1.0, (window - cfg.lr_warmup_windows) / max(1, total - cfg.lr_warmup_windows))
    return cfg.eta_update * (cfg.lr_min_ratio + (1 - cfg.lr_min_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


@dataclass
class Progress:
    """Host-side counters of a run."""

    window: int = 0
    examples: int = 0
    wall_seconds: float = 0.0


class Trainer:
    """setup (in __init__) / train / evaluate / save_summary; state_dict / load_state_dict for checkpoints."""

    def __init__(
        self, cfg: TrainConfig, gradients: GradientSource = ep_gradients, log=print, dist: Distributed | None = None
    ) -> None:
        self.cfg, self.log = cfg, log
        self.dist = Distributed() if dist is None else dist  # one process unless torchrun started this one
        if self.dist.world_size > 1 and cfg.memory_capacity:
            raise ConfigError(
                "memory_capacity: the memory bank is per process and would differ between ranks; "
                "multi-process runs need --memory_capacity 0"
            )
        self.device = self.dist.place(resolve_device(cfg), cfg.device)
        graphs = cfg.use_cudagraphs and self.device.type == "cuda"  # without CUDA the StepRunner warns once
        torch.manual_seed(cfg.seed)  # the global RNGs too, so anything drawing from them repeats (and is checkpointed)
        torch.backends.cudnn.benchmark = cfg.cudnn_benchmark
        torch.backends.cudnn.deterministic = cfg.cudnn_deterministic
        torch.backends.cuda.matmul.allow_tf32 = cfg.allow_tf32
        parts = build_parts(cfg, self.device, world=self.dist.world_size)  # sizes checked before anything large
        self.data: Dataset = parts.data
        self.machine: Machine = parts.machine
        self.memory: MemoryBank | None = parts.memory
        self.params = ParamTable.build(self.machine, cfg)
        self.batch_step: BatchStep = build_step(
            self.machine, cfg, cfg.batch_size, self.memory, gradients, self.params, self.dist
        )
        self.runner = StepRunner.from_config(self.batch_step, cfg, log)
        self.global_batch = cfg.batch_size * self.dist.world_size  # every rank draws it; rank r trains on slice r
        self.sampler = Sampler(self.data.num_examples("train"), self.global_batch, cfg.seed)
        self.progress = Progress()
        self.history: list[dict[str, float]] = []
        self._relaxation_for = relaxation_cache(self.machine, cfg, self.memory)  # scoring only: no update state
        self.run_dir = Path(cfg.checkpoint_dir) / cfg.run_name
        self.monitor = Monitor(
            cfg,
            self.device,
            self.run_dir,
            eager=not (graphs or cfg.use_torch_compile),
            log=log,
            writes=self.dist.is_main,
        )
        self._interval = (time.perf_counter(), 0)  # (clock, window) where the current log interval began
        self._saved_at = -1  # window of the last checkpoint this trainer saved or loaded
        self.run_id = uuid.uuid4().hex  # stamps this run's checkpoints: pruning removes only those (a resume keeps it)
        self.health = Health(cfg.eps, log, uniform_loss=math.log(max(self.data.num_classes, 2)))
        self.text = self.data.kind == "text"  # bits per character only mean something for text

    def __setattr__(self, name: str, value: Any) -> None:
        if name in WIRED and name in self.__dict__:
            raise AttributeError(
                f"Trainer.{name} is wired once at set-up and cannot be replaced; "
                "pass another gradient source as Trainer(cfg, gradients=...) instead"
            )
        super().__setattr__(name, value)

    @property
    def gradients(self) -> GradientSource:
        """The gradient source every batch step calls."""
        return self.batch_step.gradients

    @property
    def updater(self) -> Updater:
        return self.batch_step.updater

    @property
    def relaxation(self) -> Relaxation:
        return self.batch_step.relax

    # --- sizes ---

    def total_windows(self) -> int:
        """Windows this run will do: the tighter of max_windows and max_epochs."""
        limits = []
        if self.cfg.max_windows is not None:
            limits.append(self.cfg.max_windows)
        if self.cfg.max_epochs is not None:
            limits.append(math.ceil(self.cfg.max_epochs * self.sampler.batches_per_epoch))
        return min(limits)

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
        """Run to total_windows(), save a checkpoint and the summary, and return the summary. The first stop signal
        (SIGINT, SIGTERM, SIGHUP, SIGQUIT) stops the run after the current window, still saving both
        (summary["interrupted"] names the
        signal); a divergence (trainer2.running.health) stops it without saving, and raises Diverged."""
        cfg, total = self.cfg, self.total_windows()
        self.log("config:\n" + to_yaml(cfg).rstrip())
        self.log(
            f"data: {self.data.source} ({self.data.kind}, {self.data.num_examples('train')} train / "
            f"{self.data.num_examples('heldout')} held-out examples, {self.data.num_classes} classes); "
            f"device: {self.device}"
        )
        self.log(f"window backend: {self.relaxation.backend.name} ({self.relaxation.backend.reason})")
        quiet = {} if self.dist.is_main else {"disable": True}  # only rank 0 shows a bar
        bar = tqdm(
            total=total,
            initial=self.progress.window,
            desc=cfg.run_name,
            unit="win",
            dynamic_ncols=True,
            mininterval=1.0,
            **quiet,
        )
        if not bar.disable and not getattr(bar.fp, "isatty", lambda: False)():
            bar.mininterval = bar.maxinterval = 30.0  # in a pipe or CI: a line every 30 s, not a flood
        if self.dist.is_main:
            claim(self.run_dir, self.run_id)
        mon = self.monitor
        mon.attach(self.relaxation, bar, cfg.run_name)
        mon.start(self.progress.window)
        with StopSignals() as signals:
            try:
                diverged = self.run_windows(total, bar, signals)
            finally:  # also when a write fails: the bar and the telemetry file are closed either way
                bar.close()
                mon.close()
            if diverged is not None:
                message = divergence_message(*diverged, self.run_dir)
                self.save_summary(diverged=message)
                raise Diverged(message)
            if self.progress.window != self._saved_at:
                self.save_checkpoint()
            stopped = signals.received if self.progress.window < total else None
            return self.save_summary(interrupted=stopped.name if stopped else None)

    def run_windows(self, total: int, bar: tqdm, signals: StopSignals) -> tuple[str, int] | None:
        """The loop: windows until `total` or a stop signal, with logging, evaluation and periodic saves.
        Returns None, or (what happened, last good window) when the run diverged (it then stops unsaved)."""
        cfg, mon = self.cfg, self.monitor
        start = time.perf_counter() - self.progress.wall_seconds
        self._interval = (time.perf_counter(), self.progress.window)
        lr = self.updater.state.lr
        first = self.progress.window  # a compiled or captured step spends its first window compiling
        self.dist.check_in(
            self.updater.metrics.values, self.params.tensors, everywhere=False
        )  # same start on every rank?
        while self.progress.window < total:
            w = self.progress.window
            mon.before_window(w)
            lr.fill_(lr_at(cfg, w, total))
            with mon.phase("data"):
                inputs, targets = self.next_batch()
            with mon.step_phase():
                self.runner.step(inputs, targets)
            if w == first and not mon.eager:
                bar.unpause()  # count the compile apart: keep it out of the bar's rate and ETA
            self.progress.window += 1
            self.progress.examples += self.global_batch
            bar.update(1)
            done = self.progress.window == total
            self.progress.wall_seconds = time.perf_counter() - start
            logged = self.progress.window % cfg.log_every_windows == 0 or done
            if logged:
                since = self._interval[1]
                with mon.phase("logging"):
                    row = self.sync_metrics()
                diverged = self.health.diverged(row, since)
                if diverged is not None:
                    mon.record(row)
                    return diverged
                if (cfg.eval_every_windows and self.progress.window % cfg.eval_every_windows == 0) or done:
                    row.update(self.evaluate())
                self.progress.wall_seconds = time.perf_counter() - start
                row["wall_seconds"] = self.progress.wall_seconds
                self._interval = (time.perf_counter(), self.progress.window)  # evaluation stays out of windows/s
                mon.record(row)
                self.history.append(row)
                bar.set_postfix(self.postfix(row), refresh=False)
                self.health.warn_unsettled(row)
            asked = self.stop_asked(signals, logged)
            if (cfg.save_every_windows and self.progress.window % cfg.save_every_windows == 0) or asked or done:
                if not self.params_finite():  # never save poisoned parameters, even between log intervals
                    return nonfinite(self._interval[1], self.progress.window), self.progress.window
                if not done:  # the final checkpoint is train()'s
                    self.save_checkpoint()
            mon.after_window(self.progress.window)
            if asked:
                break
        return None

    def stop_asked(self, signals: StopSignals, logged: bool) -> bool:
        """Whether a stop signal ends the run after this window. Under torchrun the ranks must stop at the same
        window: they agree at log intervals (one all-reduce), and a rank that got no signal takes another's."""
        if not self.dist.launched:
            return signals.received is not None
        if not logged:
            return False
        got = torch.tensor([float(signals.received == sig) for sig in STOP_SIGNALS], device=self.device)
        self.dist.all_reduce_sum(got, "the stop-signal exchange")
        agreed = bool(got.any())  # not this rank's flag: a signal may land here during the exchange (next interval's)
        if agreed and signals.received is None:
            signals.received = STOP_SIGNALS[int(got.argmax())]
        return agreed

    def params_finite(self) -> bool:
        """Whether every parameter is finite (one host sync; checked before each save)."""
        return bool(torch.stack([torch.isfinite(t).all() for t in self.params.tensors]).all())

    def sync_metrics(self) -> dict[str, Any]:
        """One device-to-host transfer of every accumulated metric, then reset the accumulators."""
        st = self.updater.state
        self.dist.check_in(self.updater.metrics.values, self.params.tensors, everywhere=True)  # all ranks' sums
        dead = dead_units(self.relaxation.s0.s[:-1], self.device)  # at the last window's free equilibrium
        sums, (lr, dropped_total, dead) = self.updater.metrics.read(st.lr, st.dropped, dead)
        wins, ex = max(sums["windows"], 1.0), max(sums["examples"], 1.0)
        loss = sums["loss_sum"] / ex
        row: dict[str, Any] = {
            "window": self.progress.window,
            "examples": self.progress.examples,
            "epoch": self.progress.window / self.sampler.batches_per_epoch,
            "train_loss": loss,
            "train_acc": sums["correct_sum"] / ex,
            "lr": lr,
            "dropped_total": dropped_total,
        }
        if self.text:
            row["train_bpc"] = loss / math.log(2)
        for k in (
            "lior_mean",
            "spd_mean",
            "spd_last",
            "lior_nudge",
            "spd_last_nudge",
            "R_mean",
            "dropped",
            "update_norm_energy",
            "update_norm_readout",
            "update_norm_embed",
        ):
            row[k] = sums[k] / wins
        row["dead_units"] = int(dead)  # hidden units at 0 or 1 for the whole last batch (trainer2.physics.dead_units)
        row["nonfinite_params"] = sums["nonfinite_params"]  # windows of the interval that left a parameter non-finite
        row["lior_diff"] = row["lior_nudge"] - row["lior_mean"]  # the nudge's extra path length
        t0, w0 = self._interval
        row["windows_per_second"] = (self.progress.window - w0) / max(time.perf_counter() - t0, 1e-9)
        return row

    @staticmethod
    def postfix(row: dict[str, Any]) -> dict[str, str]:
        out = {"loss": f"{row['train_loss']:.3f}"}
        if "train_bpc" in row:
            out["bpc"] = f"{row['train_bpc']:.3f}"
        out.update(acc=f"{row['train_acc']:.3f}", lior=f"{row['lior_mean']:.3g}", spd=f"{row['spd_last']:.2g}")
        if "heldout_bpc" in row:
            out["val_bpc"] = f"{row['heldout_bpc']:.3f}"
        elif "heldout_acc" in row:
            out["val_acc"] = f"{row['heldout_acc']:.3f}"
        return out

    # --- evaluation ---

    def evaluate(self, max_batches: int | None = None) -> dict[str, float]:
        """Held-out loss (nats per example), accuracy and, for text, bits per character; one sync at the end.
        Under torchrun each rank scores every world_size-th batch and the sums are added up."""
        limit = max_batches if max_batches is not None else self.cfg.eval_batches
        sums = heldout_sums(self._relaxation_for, self.data, self.device, limit, (self.dist.rank, self.dist.world_size))
        self.dist.all_reduce_sum(sums, "the held-out evaluation")
        return heldout_from_sums(sums, self.data.kind)

    # --- state ---

    def state_tensors(self) -> dict[str, Tensor]:
        """Every live tensor of the run's state, by checkpoint key; loading copies into these in place, so a
        captured graph still sees the same buffers: parameters, update state, metric sums, memory bank."""
        out = {f"param.{k}": v for k, v in zip(self.params.names, self.params.tensors, strict=True)}
        out.update(self.updater.tensors())
        if self.memory is not None:
            out.update(self.memory.tensors())
        return out

    def checkpoint_tensors(self) -> dict[str, Tensor]:
        """The tensors of a checkpoint: the live state, the sampler's state and the RNG states."""
        tensors = dict(self.state_tensors())
        tensors.update({f"sampler.{k}": v for k, v in self.sampler.state_dict().items()})
        tensors["rng.cpu"] = torch.get_rng_state()
        if self.device.type == "cuda":
            tensors["rng.cuda"] = torch.cuda.get_rng_state(self.device)
        return tensors

    def state_dict(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """(tensors, sidecar) of a checkpoint at the current window: live state, sampler and RNG; config, counters,
        data fingerprint and history."""
        tensors = self.checkpoint_tensors()
        p = self.progress
        meta = {
            "config": self.cfg.model_dump(mode="json"),
            "run_id": self.run_id,
            "counters": {
                "window": p.window,
                "examples": p.examples,
                "epoch": p.window / self.sampler.batches_per_epoch,
                "sampler_epoch": self.sampler.epoch,
                "sampler_pos": int(self.sampler.state_dict()["pos"]),
                "global_batch": self.global_batch,
                "world_size": self.dist.world_size,
                "wall_seconds": p.wall_seconds,
            },
            "data": ck.data_fingerprint(self.data),
            "history": self.history[-HISTORY_ROWS:],
            "versions": ck.versions(),
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        return tensors, meta

    def load_state_dict(self, tensors: dict[str, Tensor], meta: dict[str, Any]) -> None:
        """Copy a checkpoint's state into the live tensors in place and restore sampler, RNG, counters and history."""
        for k, dst in self.state_tensors().items():
            if k in tensors:
                dst.copy_(tensors[k])
            else:  # a metric sum added after the checkpoint was written (load_checked allows only those): from 0
                dst.zero_()
        self.sampler.load_state_dict(sampler_state(tensors))
        torch.set_rng_state(tensors["rng.cpu"])
        if self.device.type == "cuda" and "rng.cuda" in tensors:
            torch.cuda.set_rng_state(tensors["rng.cuda"], self.device)
        c = meta["counters"]
        self.progress.window, self.progress.examples, self.progress.wall_seconds = (
            int(c["window"]),
            int(c["examples"]),
            float(c["wall_seconds"]),
        )
        self.history = list(meta["history"])

    # --- outputs ---

    def save_checkpoint(self) -> Path:
        """Write <run_dir>/step_<window>/ atomically (trainer2.running.checkpoint) and prune to keep_last; under
        torchrun every rank calls it (the metric sums are gathered into rank 0's) and rank 0 writes."""
        self.dist.check_in(self.updater.metrics.values, self.params.tensors, everywhere=False)
        path = self.run_dir / ck.step_name(self.progress.window)
        if self.dist.is_main:
            tensors, meta = self.state_dict()
            try:
                path = ck.save(self.run_dir, self.progress.window, tensors, meta)
            except (OSError, SafetensorError) as e:  # disk full, read-only, quota: save removed its temporary directory
                raise write_error(path, e, "checkpoints saved before it are intact") from None
            ck.prune(self.run_dir, self.cfg.keep_last, self.run_id)
            self.log(f"checkpoint: {path}")
        self._saved_at = self.progress.window
        return path

    def load_checkpoint(self, path: Path) -> None:
        """Restore the run from checkpoint directory `path` in place; everything is checked before anything is
        copied."""
        path = Path(path)
        loaded, meta = ck.load_checked(
            path,
            self.cfg,
            self.data,
            self.checkpoint_tensors(),
            optional=frozenset({"rng.cuda", *(f"metrics.{k}" for k in ADDED_METRICS)}) | SAMPLER_KEYS,
        )
        try:  # the sampler checks its own state, in one of two formats (trainer2.io.sampler), on a throwaway copy
            Sampler(self.sampler.num_examples, self.sampler.batch_size, 0).load_state_dict(sampler_state(loaded))
        except DataError as e:
            raise ck.CheckpointError(f"{path / ck.TENSORS_FILE}: {e}") from None
        if meta["data"].get("source") != self.data.source:
            self.log(
                f"note: the data is read from {self.data.source}, the checkpoint's from {meta['data'].get('source')}; "
                "its contents are the same (sha256), so the run goes on"
            )
        self.check_global_batch(meta, path)
        saved_torch = meta.get("versions", {}).get("torch")
        if saved_torch != torch.__version__:
            self.log(
                f"warning: checkpoint {path} was written with torch {saved_torch}, this is {torch.__version__}; "
                "the resumed run may not be bitwise identical"
            )
        self.load_state_dict(loaded, meta)
        if isinstance(meta.get("run_id"), str) and path.resolve().parent == self.run_dir.resolve():
            self.run_id = meta["run_id"]  # the same run goes on; a branch into a new directory is a run of its own
        if not self.dist.is_main:
            self.updater.metrics.values.zero_()  # the saved sums are every rank's: rank 0 alone carries them on
        self._saved_at = self.progress.window
        # recapture after load (the copies are in place, but a fresh capture is the safe default)
        self.runner.invalidate()
        self.log(f"resumed from {path} at window {self.progress.window}")

    def check_global_batch(self, meta: dict[str, Any], path: Path) -> None:
        """A checkpoint resumes on any number of processes, as long as the global batch is the same."""
        saved = meta["counters"].get("global_batch", meta["config"].get("batch_size"))  # older ones: one process
        world = meta["counters"].get("world_size", 1)
        if saved != self.global_batch:
            raise ck.CheckpointError(
                f"checkpoint {path} was trained at a global batch of {saved} "
                f"(batch_size {meta['config'].get('batch_size')} x "
                f"{world} process(es)); this run's is {self.global_batch} (batch_size {self.cfg.batch_size} x "
                f"{self.dist.world_size}); "
                + (
                    f"pass --batch_size {saved // self.dist.world_size}"
                    if saved % self.dist.world_size == 0
                    else f"use a number of processes that divides {saved}"
                )
            )

    def save_summary(self, interrupted: str | None = None, diverged: str | None = None) -> dict[str, Any]:
        """Write <run_dir>/summary.json (strict JSON: a non-finite number is null) and return it. Held-out figures
        come from the last evaluation (heldout_window says when); a stopped run is not evaluated again."""
        last = next((r for r in reversed(self.history) if "heldout_loss" in r), None)
        if last is None and interrupted is None and diverged is None:
            last = {"window": self.progress.window, **self.evaluate()}
        wall = self.progress.wall_seconds
        summary = {
            **({k: last[k] for k in ("heldout_bpc", "heldout_acc", "heldout_loss") if k in last} if last else {}),
            **({"heldout_window": last["window"]} if last else {}),
            "data_kind": self.data.kind,
            "windows": self.progress.window,
            "examples_seen": self.progress.examples,
            "wall_seconds": wall,
            "windows_per_second": self.progress.window / wall if wall > 0 else 0.0,
            "dropped_updates": float(self.updater.state.dropped),
            "device": str(self.device),
            "window_backend": self.relaxation.backend.name,
            "interrupted": interrupted,
            "diverged": diverged is not None,
            **({"error": diverged} if diverged else {}),
        }
        summary = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in summary.items()}
        if self.dist.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            write_replace(self.run_dir / SUMMARY_FILE, (json.dumps(summary, indent=2, allow_nan=False) + "\n").encode())
        return summary
