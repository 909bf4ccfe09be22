"""End-to-end: a short run learns; grad mode stays off; graphs without CUDA warn once and run eagerly."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from trainer2.cli import main
from trainer2.learning.step import BatchStep
from trainer2.running.trainer import Trainer
from trainer2.train_config import build_config

FAST = dict(
    hidden_sizes=[32],
    coord_dim_n=8,
    rotor_k=8,
    context_len=4,
    embed_dim=4,
    batch_size=16,
    free_steps=12,
    nudge_steps=6,
    log_every_windows=20,
    eval_every_windows=0,
    eta_update=0.01,
)


def fast_config(tmp_path: Path, data: Path, **overrides):
    return build_config([("test", {**FAST, "data": str(data), "checkpoint_dir": str(tmp_path / "ck"), **overrides})])


def test_short_run_lowers_heldout_loss_and_writes_summary(tmp_path, small_text):
    trainer = Trainer(fast_config(tmp_path, small_text, max_windows=300), log=lambda *_: None)
    before = trainer.evaluate()["heldout_loss"]
    summary = trainer.train()
    assert summary["heldout_loss"] < 0.7 * before
    written = json.loads((tmp_path / "ck" / "run" / "summary.json").read_text())
    for key in ("heldout_bpc", "heldout_acc", "windows", "examples_seen", "wall_seconds", "windows_per_second"):
        assert key in written
    assert written["windows"] == 300 and written["examples_seen"] == 300 * 16


def test_grad_mode_is_off_and_no_tensor_requires_grad(tmp_path, small_text, monkeypatch):
    seen: list[tuple[bool, bool]] = []
    original = BatchStep.step

    def spy(self, inputs, targets):
        seen.append((torch.is_grad_enabled(), torch.is_inference_mode_enabled()))
        original(self, inputs, targets)

    monkeypatch.setattr(BatchStep, "step", spy)
    trainer = Trainer(fast_config(tmp_path, small_text, max_windows=5, memory_capacity=32), log=lambda *_: None)
    trainer.train()
    assert seen == [(False, True)] * 5  # every step in inference mode (grad off, no version counters)
    tensors = [*trainer.machine.named_params().values(), trainer.machine.flat, trainer.updater.state.bufs]
    assert not any(t.requires_grad for t in tensors)
    # What the step updates in place stays an ordinary tensor: a resumed or evaluated run can still write it.
    assert not any(t.is_inference() for t in trainer.state_tensors().values())


def test_package_never_uses_autograd_or_torch_optim():
    pattern = re.compile(
        r"\.backward\(|torch\.autograd|torch\.optim|enable_grad|requires_grad_\(True\)|requires_grad=True"
    )
    root = Path(__file__).resolve().parent.parent / "trainer2"
    offenders = [
        f"{p.name}:{i}"
        for p in root.rglob("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert offenders == []


def test_graphs_without_cuda_warn_once_and_run_eagerly(tmp_path, small_text, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code = main(
        [
            "--data",
            str(small_text),
            "--checkpoint_dir",
            str(tmp_path),
            "--use_cudagraphs",
            "--static_shapes",
            "--capture_batch_size",
            "8",
            "--max_windows",
            "3",
            "--hidden_sizes",
            "16",
            "--eval_batches",
            "1",
        ]
    )
    out = capsys.readouterr()
    assert code == 0
    assert (out.out + out.err).count("needs a CUDA device") == 1
    assert "done: 3 windows" in out.out
