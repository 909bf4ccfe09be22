"""The progress bar over windows (tqdm.auto: a widget in a Jupyter notebook with ipywidgets, else text), a callback
of the training loop: rank 0 shows it, the others do not."""

from __future__ import annotations

from typing import Any

from tqdm.auto import tqdm
from tqdm.autonotebook import tqdm as chosen
from tqdm.std import tqdm as text_bar

from trainer2.callbacks import Callback, LoopState

WIDGET = chosen is not text_bar  # tqdm.auto chose the notebook's widget: it redraws in place, never floods
PIPE_INTERVAL = 30.0  # seconds between bar lines when stderr is no terminal (a pipe, CI): a line every 30 s, no flood


class ProgressBar(Callback):
    """A tqdm bar of `total` windows named `desc`, with the latest training (and held-out) figures beside it."""

    def __init__(self, desc: str, show: bool) -> None:
        self.desc, self.show = desc, show
        self.bar: tqdm | None = None
        self.first = 0  # the window the run started at: a compiled or captured step spends it compiling

    def on_start(self, state: LoopState) -> None:
        self.first = state.window
        self.bar = tqdm(
            total=state.total,
            initial=state.window,
            desc=self.desc,
            unit="win",
            dynamic_ncols=True,
            mininterval=1.0,
            **({} if self.show else {"disable": True}),  # shown: tqdm's own default, so TQDM_DISABLE=1 still hides it
        )
        if not (WIDGET or self.bar.disable or getattr(self.bar.fp, "isatty", lambda: False)()):
            self.bar.mininterval = self.bar.maxinterval = PIPE_INTERVAL

    def on_log(self, state: LoopState, row: dict[str, Any]) -> None:
        self.bar.set_postfix(postfix(row), refresh=False)

    def on_window_end(self, state: LoopState) -> None:
        if state.window == self.first + 1 and not state.eager:
            self.bar.unpause()  # count the compile apart: keep it out of the bar's rate and ETA
        self.bar.update(1)

    def on_end(self, state: LoopState) -> None:
        if self.bar is not None:
            self.bar.close()


def postfix(row: dict[str, Any]) -> dict[str, str]:
    """The figures the bar shows of a log row: loss, bits per character (text), accuracy, LIoR, the residual."""
    out = {"loss": f"{row['train_loss']:.3f}"}
    if "train_bpc" in row:
        out["bpc"] = f"{row['train_bpc']:.3f}"
    out.update(acc=f"{row['train_acc']:.3f}", lior=f"{row['lior_mean']:.3g}", spd=f"{row['spd_last']:.2g}")
    for split, short in (("validation", "val"), ("heldout", "held")):  # text: bits per character; else accuracy
        key = f"{split}_bpc" if f"{split}_bpc" in row else f"{split}_acc"
        if key in row:
            out[f"{short}_{key.rsplit('_', 1)[1]}"] = f"{row[key]:.3f}"
    return out
