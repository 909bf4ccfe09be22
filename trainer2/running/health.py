"""Is the run still learning? Read from each log row (no extra device work) by the `Health` callback: a divergence
stops the run, a free phase that does not settle is warned about once."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from trainer2.callbacks import Callback, LoopState, Stop
from trainer2.running import checkpoint as ck

# A settled free phase ends at spd_last = sqrt(eps): the dev preset sits at 1.00-1.02x; 3 or 6 free steps instead of
# 12 end at up to 2.5x and 26x and learn as well; gamma 0.2 ends at 230-460x and learns visibly worse.
UNSETTLED_FACTOR = 100.0
# Updates dropped in a row (non-finite gradients) that mean learning has stopped; healthy runs drop none.
DROPPED_STREAK = 50
# Windows in a row whose training loss stays above UNIFORM_FACTOR x the uniform-prediction loss ln(V) that mean the run
# has diverged: a fresh machine starts near ln(V) (prototypes close together) and a learning one only goes below it
# (dev preset, momentum 0.99 at lr 1: 4.3 nats at first, then 5.4-8.4 from window 80 on, against ln(103) = 4.6).
LOSS_STREAK = 200
UNIFORM_FACTOR = 1.1
DROPPED = "every update from window"  # how a run of dropped updates is reported (divergence_message reads it)


class Diverged(RuntimeError):
    """The run stopped because it diverged; the message names the windows and the last checkpoint before."""


@dataclass
class Health(Callback):
    """A callback that checks each log row of windows since+1..window: a divergence sets state.stop; it holds the
    state of a run of dropped updates and the warning."""

    eps: float
    log: Callable[[str], None]
    uniform_loss: float = math.inf  # ln(V) nats: the loss of predicting every one of V classes alike
    dropped_from: int | None = None  # first window of the current run of dropped updates
    above_from: int | None = None  # first window of the current run of log rows with the loss above the bound
    warned: bool = False
    since: int = 0  # the window the current log interval began after

    def on_start(self, state: LoopState) -> None:
        self.since = state.window

    def on_metrics(self, state: LoopState, row: dict[str, Any]) -> None:
        found = self.diverged(row, self.since)
        if found is not None and state.stop is None:
            state.stop = Stop(diverged=found)
        self.since = row["window"]

    def on_log(self, state: LoopState, row: dict[str, Any]) -> None:
        if state.stop is None or state.stop.diverged is None:
            self.warn_unsettled(row)

    def diverged(self, row: dict[str, Any], since: int) -> tuple[str, int] | None:
        """None, or (what happened, the last window whose checkpoint is still good): a parameter became
        non-finite, every update was dropped for DROPPED_STREAK windows in a row, the training loss became
        non-finite, or it stayed above UNIFORM_FACTOR x ln(V) for LOSS_STREAK windows in a row."""
        w, loss = row["window"], row["train_loss"]
        self.dropped_from = (self.dropped_from or since + 1) if row["dropped"] >= 1.0 else None
        bound = UNIFORM_FACTOR * self.uniform_loss
        self.above_from = (self.above_from or since + 1) if not loss <= bound else None  # NaN counts as above
        if row["nonfinite_params"]:
            return nonfinite(since, w), w  # every saved checkpoint was checked finite
        if not math.isfinite(loss):
            return f"the training loss became non-finite ({loss}) between windows {since + 1} and {w}", since
        if self.above_from is not None and w - self.above_from + 1 >= LOSS_STREAK:
            return (
                f"the training loss stayed above {bound:.3g} nats "
                f"({UNIFORM_FACTOR:g} x ln({math.exp(self.uniform_loss):.0f}), "
                f"the loss of a uniform prediction) from window {self.above_from} to {w}, at {loss:.3g} last",
                self.above_from - 1,
            )
        if self.dropped_from is not None and w - self.dropped_from + 1 >= DROPPED_STREAK:
            return (
                f"{DROPPED} {self.dropped_from} to {w} was dropped (non-finite gradients: learning has stopped)",
                self.dropped_from - 1,
            )
        return None

    def warn_unsettled(self, row: dict[str, Any]) -> None:
        """Warn once when the free phase ends far above its settled residual sqrt(eps): the window is too short or
        the dynamics too stiff, and the EP estimate is then not the gradient at a fixed point."""
        floor, spd = math.sqrt(self.eps), row["spd_last"]
        if self.warned or not math.isfinite(spd) or spd <= UNSETTLED_FACTOR * floor:
            return  # a non-finite spd comes with a divergence, reported as one
        self.warned = True
        self.log(
            f"warning: the free phase does not settle: spd_last {spd:.3g} at window {row['window']}, "
            f"{spd / floor:.3g}x its settled floor sqrt(eps) = {floor:.3g}. Give it more steps (free_steps), "
            "a smaller dt, more damping (gamma) or a lower spectral_cap"
        )


def all_finite(tensors: tuple[Tensor, ...]) -> bool:
    """Whether every tensor is finite (one host sync; checked before each save)."""
    return bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())


def nonfinite(since: int, window: int) -> str:
    return f"the parameters became non-finite between windows {since + 1} and {window}"


def divergence_message(what: str, good_until: int, run_dir: Path) -> str:
    """What happened, the newest checkpoint up to window `good_until`, and what to change."""
    saved = [p for p in ck.list_checkpoints(run_dir) if ck.step_of(p) <= good_until]
    good = f"the last checkpoint before it is {saved[-1]}" if saved else "no checkpoint was saved before it"
    # non-finite gradients come from the phases (a nudge too strong for the energy) as well as from the parameters
    nudge = ", or a smaller beta_nudge (the nudged phases' strength)" if what.startswith(DROPPED) else ""
    return (
        f"the run diverged: {what}; {good}. Lower eta_update (or eta_readout_scale, eta_embed_scale, "
        f"weight_decay) or add lr_warmup_windows{nudge}, and start a new run"
    )
