"""The training recipe: setup, train, evaluate, save. Grad mode is off throughout; nothing here uses autograd."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from trainer2.checkpoint import load_trainer, save_trainer
from trainer2.capture import StepRunner
from trainer2.config import ConfigError, TrainConfig, to_yaml
from trainer2.data import Dataset, Sampler, heldout_batches, load_dataset
from trainer2.learning import METRICS, Learner
from trainer2.machine import Machine, build_machine
from trainer2.memory import MemoryBank
from trainer2.telemetry import Monitor

EVAL_BATCH = 512


def resolve_device(name: str) -> torch.device:
    """'auto' -> CUDA when present, else CPU; an explicit CUDA device without CUDA is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device: {name!r} asked for, but CUDA is not available on this machine; use --device cpu")
    return torch.device(name)


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
    """setup (in __init__) / train / evaluate / save_summary."""

    def __init__(self, cfg: TrainConfig, log=print) -> None:
        self.cfg, self.log = cfg, log
        self.device = resolve_device(cfg.device)
        self.graphs = cfg.use_cudagraphs and self.device.type == "cuda"  # without CUDA the StepRunner warns once
        torch.manual_seed(cfg.seed)  # the global RNGs too, so anything drawing from them repeats (and is checkpointed)
        torch.backends.cudnn.benchmark = cfg.cudnn_benchmark
        torch.backends.cudnn.deterministic = cfg.cudnn_deterministic
        torch.backends.cuda.matmul.allow_tf32 = cfg.allow_tf32
        self.data: Dataset = load_dataset(cfg.data, cfg.context_len, cfg.heldout_fraction)
        self.machine: Machine = build_machine(cfg, self.data.num_classes, self.data.input_dim, self.data.kind == "text", self.device)
        like = self.machine.readout.protos
        self.memory = MemoryBank.allocate(cfg.memory_capacity, cfg.coord_dim_n, cfg.batch_size, like) if cfg.memory_capacity else None
        self.learner = Learner(self.machine, cfg, cfg.batch_size, self.memory)
        self.runner = StepRunner.from_config(self.learner, cfg, log)
        self.sampler = Sampler(self.data.num_examples("train"), cfg.batch_size, cfg.seed)
        self.progress = Progress()
        self.history: list[dict[str, float]] = []
        self._eval_learners: dict[int, Learner] = {}
        self.run_dir = Path(cfg.checkpoint_dir) / cfg.run_name
        self.monitor = Monitor(cfg, self.device, self.run_dir, eager=not (self.graphs or cfg.use_torch_compile), log=log)
        self._interval = (time.perf_counter(), 0)  # (clock, window) where the current log interval began
        self.text = self.data.kind == "text"  # bits per character only mean something for text

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

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Host tensors; the StepRunner stages them onto the device (pinned, non-blocking on CUDA)."""
        return self.data.batch("train", self.sampler.next())

    @torch.no_grad()
    def train(self) -> dict[str, float]:
        cfg, total = self.cfg, self.total_windows()
        self.log("config:\n" + to_yaml(cfg).rstrip())
        self.log(f"data: {self.data.source} ({self.data.kind}, {self.data.num_examples('train')} train / "
                 f"{self.data.num_examples('heldout')} held-out examples, {self.data.num_classes} classes); device: {self.device}")
        bar = tqdm(total=total, initial=self.progress.window, desc=cfg.run_name, unit="win", dynamic_ncols=True, mininterval=1.0)
        if not bar.disable and not getattr(bar.fp, "isatty", lambda: False)():
            bar.mininterval = bar.maxinterval = 30.0  # in a pipe or CI: a line every 30 s, not a flood
        mon = self.monitor
        mon.attach(self.learner, bar)
        mon.start(self.progress.window)
        start = time.perf_counter() - self.progress.wall_seconds
        self._interval = (time.perf_counter(), self.progress.window)
        first = self.progress.window  # a compiled or captured step spends its first window compiling
        while self.progress.window < total:
            w = self.progress.window
            mon.before_window(w)
            self.learner.update.lr.fill_(lr_at(cfg, w, total))
            with mon.phase("data"):
                inputs, targets = self.next_batch()
            with mon.step_phase():
                self.runner.step(inputs, targets)
            if w == first and not mon.eager:
                bar.unpause()  # count the compile apart: keep it out of the bar's rate and ETA
            self.progress.window += 1
            self.progress.examples += cfg.batch_size
            bar.update(1)
            done = self.progress.window == total
            if self.progress.window % cfg.log_every_windows == 0 or done:
                with mon.phase("logging"):
                    row = self.sync_metrics()
                if (cfg.eval_every_windows and self.progress.window % cfg.eval_every_windows == 0) or done:
                    row.update(self.evaluate())
                self.progress.wall_seconds = time.perf_counter() - start
                row["wall_seconds"] = self.progress.wall_seconds
                self._interval = (time.perf_counter(), self.progress.window)  # evaluation stays out of windows/s
                mon.record(row)
                self.history.append(row)
                bar.set_postfix(self.postfix(row), refresh=False)
            if cfg.save_every_windows and self.progress.window % cfg.save_every_windows == 0 and not done:
                self.progress.wall_seconds = time.perf_counter() - start
                self.save_checkpoint()
            mon.after_window(self.progress.window)
        bar.close()
        mon.close()
        self.progress.wall_seconds = time.perf_counter() - start
        self.save_checkpoint()
        return self.save_summary()

    def sync_metrics(self) -> dict[str, float]:
        """One device-to-host transfer of every accumulated metric, then reset the accumulators."""
        upd = self.learner.update
        *values, lr, dropped_total = torch.cat([self.learner.metrics, upd.lr.reshape(1), upd.dropped.reshape(1)]).tolist()
        vals = dict(zip(METRICS, values))
        self.learner.metrics.zero_()
        wins, ex = max(vals["windows"], 1.0), max(vals["examples"], 1.0)
        loss = vals["loss_sum"] / ex
        row = {"window": self.progress.window, "examples": self.progress.examples,
               "epoch": self.progress.window / self.sampler.batches_per_epoch,
               "train_loss": loss, "train_acc": vals["correct_sum"] / ex, "lr": lr, "dropped_total": dropped_total}
        if self.text:
            row["train_bpc"] = loss / math.log(2)
        for k in ("lior_mean", "spd_mean", "spd_last", "lior_nudge", "R_mean", "dropped",
                  "update_norm_energy", "update_norm_readout", "update_norm_embed"):
            row[k] = vals[k] / wins
        row["lior_diff"] = row["lior_nudge"] - row["lior_mean"]  # the nudge's extra path length
        t0, w0 = self._interval
        row["windows_per_second"] = (self.progress.window - w0) / max(time.perf_counter() - t0, 1e-9)
        return row

    @staticmethod
    def postfix(row: dict[str, float]) -> dict[str, str]:
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

    def _eval_learner(self, batch: int) -> Learner:
        if batch not in self._eval_learners:
            self._eval_learners[batch] = Learner(self.machine, self.cfg, batch, self.memory)
        return self._eval_learners[batch]

    @torch.no_grad()
    def evaluate(self, max_batches: int | None = None) -> dict[str, float]:
        """Held-out loss (nats per example), accuracy and, for text, bits per character; one sync at the end."""
        n = self.data.num_examples("heldout")
        loss = torch.zeros((), dtype=torch.float64, device=self.device)
        correct = torch.zeros((), dtype=torch.float64, device=self.device)
        count = 0
        for idx in heldout_batches(n, EVAL_BATCH, max_batches if max_batches is not None else self.cfg.eval_batches):
            inputs, targets = self.data.batch("heldout", idx)
            l, c = self._eval_learner(len(idx)).score(inputs.to(self.device), targets.to(self.device))
            loss += l
            correct += c
            count += len(idx)
        loss_v, correct_v = torch.stack([loss, correct]).tolist()
        mean = loss_v / max(count, 1)
        out = {"heldout_loss": mean, "heldout_acc": correct_v / max(count, 1)}
        if self.text:
            out["heldout_bpc"] = mean / math.log(2)
        return out

    # --- outputs ---

    def save_checkpoint(self) -> Path:
        """Write <run_dir>/step_<window>/ (see trainer2.checkpoint) and prune to keep_last."""
        path = save_trainer(self)
        self.log(f"checkpoint: {path}")
        return path

    def load_checkpoint(self, path: Path) -> None:
        """Restore parameters, update state, metrics, memory, RNG, sampler and counters in place from `path`."""
        load_trainer(self, Path(path))
        self.log(f"resumed from {path} at window {self.progress.window}")

    def save_summary(self) -> dict[str, float]:
        """Write <run_dir>/summary.json and return it; held-out figures come from the last evaluation."""
        last = next((r for r in reversed(self.history) if "heldout_loss" in r), None) or self.evaluate()
        wall = self.progress.wall_seconds
        summary = {
            **{k: last[k] for k in ("heldout_bpc", "heldout_acc", "heldout_loss") if k in last}, "data_kind": self.data.kind,
            "windows": self.progress.window, "examples_seen": self.progress.examples, "wall_seconds": wall,
            "windows_per_second": self.progress.window / wall if wall > 0 else 0.0,
            "dropped_updates": float(self.learner.update.dropped), "device": str(self.device),
        }
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        return summary
