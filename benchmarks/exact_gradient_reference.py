"""The same machine trained with the exact gradient instead of the EP estimate, and a feed-forward baseline.

    python -m benchmarks.exact_gradient_reference --preset production --examples 200000 [--ff]

`exact_gradients` is a gradient source for the trainer's seam, `Trainer(cfg, gradients=exact_gradients)`:
every parameter gets autograd's gradient of the batch-mean loss through the unrolled free window (same
T_free, integrator, relaxation order, dtype). The Trainer builds its batch step around it, so initialisation, data,
sampler, update rule, learning rates, schedule, constraints and logged metrics are the trainer's own,
and a gap between the two runs is the cost of the learning rule alone. Lives outside trainer2/ because
it uses autograd.

`train_feedforward` trains, for context, a plain feed-forward network of the same sizes (embedding,
hidden layers, n outputs, then the same geometric readout or a linear softmax head) with backprop and
torch.optim.Adam, from the same initial tensors, data order and held-out split. It knows chains only: a graph energy
(`couplings`: skips, residual blocks) has no single feed-forward order to copy, so it is refused (`--skip ff`), while
the exact gradient works on graphs as on chains.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
from torch import Tensor

import trainer2
from benchmarks.autograd_reference import exact_grads, has_pulls, readout_loss, up
from trainer2.data.dataset import DataError, heldout_batches
from trainer2.data.sampler import RandpermSampler as Sampler
from trainer2.flags import flag_overrides
from trainer2.learning.gradients import StepResult
from trainer2.learning.update import lr_at
from trainer2.physics.machine import Machine, project_constraints
from trainer2.physics.readout import ReadoutScratch, readout_frame, readout_loss_and_grads, target_mask
from trainer2.physics.relaxation import Relaxation, WindowStats
from trainer2.running.evaluation import EVAL_BATCH
from trainer2.running.trainer import Trainer
from trainer2.train_config import ConfigError, TrainConfig


def exact_gradients(relax: Relaxation, inputs: Tensor, targets: Tensor) -> StepResult:
    """Gradient source: autograd's gradient of the batch-mean loss through the unrolled free window, for every
    parameter (a conv machine's forces from its couplings' pulls, `pull_forces`).

    The trainer's own free phase runs too, so the logged loss, accuracy and window statistics are measured
    exactly as the EP trainer's are; no nudged phase runs (lior_nudge and spd_last_nudge are 0)."""
    cfg, m = relax.cfg, relax.m
    with relax.phase("free"):
        free = relax.free_phase(inputs, targets)
        stats = relax.free_stats()
        loss, probs = relax.readout_scores(free)
    with relax.phase("update"), torch.inference_mode(False):  # the step runs in inference mode; autograd needs it off
        exact, _ = exact_grads(
            m,
            inputs,
            targets,
            cfg.free_steps,
            cfg.dt,
            cfg.gamma,
            cfg.mass,
            m.spec.retrieval_beta,
            m.spec.eps,
            cfg.relaxation,
            forces="pulls",  # a conv machine's batch about 10x faster than through its energy; tests: the same
        )
    zero = torch.zeros_like(stats["lior_mean"])
    return StepResult(exact, loss, probs, WindowStats(**stats, lior_nudge=zero, spd_last_nudge=zero))


def exact_trainer(cfg: TrainConfig, log=print) -> Trainer:
    """A Trainer for `cfg` (same init, data, sampler, update) built around the exact gradient source; CPU only."""
    if cfg.memory_capacity:
        raise ConfigError("the exact-gradient reference has no memory bank: set memory_capacity 0")
    if cfg.device not in ("cpu", "auto"):
        raise ConfigError(f"the exact-gradient reference runs on the CPU, got device {cfg.device!r}")
    if cfg.use_torch_compile or cfg.use_cudagraphs:
        raise ConfigError(
            "the exact-gradient reference runs eagerly (autograd inside the step): "
            "drop --use_torch_compile / --use_cudagraphs"
        )
    return Trainer(cfg.model_copy(update={"device": "cpu"}), gradients=exact_gradients, log=log)


FF_CHAINS_ONLY = "the feed-forward baseline knows chains only, and this machine's energy is a graph (its `couplings`)"


def check_feedforward(m: Machine) -> None:
    """The feed-forward baseline runs a chain of built-in couplings; anything else is a ConfigError naming --skip ff."""
    if not m.energy.graph.is_chain:
        raise ConfigError(f"{FF_CHAINS_ONLY}: pass --skip ff")
    if not has_pulls(m.energy):
        raise ConfigError("the feed-forward baseline knows the built-in dense and conv couplings only: --skip ff")


def ff_forward(m: Machine, inputs: Tensor, act: str, head: list[Tensor] | None) -> Tensor:
    """Embedding -> act(W h + b) per hidden layer -> q (B, n); then logits (B, V) through `head` [weight (V, n),
    bias (V,)] when given, else q itself. A chain's only (a graph energy is a ConfigError)."""
    if not m.energy.graph.is_chain:
        raise ConfigError(f"{FF_CHAINS_ONLY}: pass --skip ff")
    h = m.input_vectors(inputs)
    *hidden, out = m.energy.couplings
    for c in hidden:
        z = up(c, h)  # the coupling's pull on the layer above, W h + b (a conv: pooled convolution)
        h = z.clamp(0.0, 1.0) if act == "clamp" else torch.relu(z)
    q = up(out, h)
    return q @ head[0].T + head[1] if head is not None else q


def ff_loss(
    m: Machine, cfg: TrainConfig, inputs: Tensor, targets: Tensor, act: str, head: list[Tensor] | None
) -> Tensor:
    """Per-example loss (B,) in nats: the linear softmax head when given, else the machine's geometric readout."""
    out = ff_forward(m, inputs, act, head)
    if head is not None:
        return torch.nn.functional.cross_entropy(out, targets, reduction="none")
    r = m.readout
    return readout_loss(out, targets, r.g_diag, r.theta, r.protos, r.r_sc, m, cfg.retrieval_beta, cfg.eps)


def train_feedforward(
    cfg: TrainConfig, examples: int, act: str = "relu", head_kind: str = "readout", capped: bool = False
) -> dict[str, float]:
    """Backprop + Adam on the feed-forward net for `examples` examples; returns held-out bpc and accuracy.

    Same initial tensors (build_machine with cfg.seed), same sampler order and held-out split as the trainer.
    """
    trainer = Trainer(cfg.model_copy(update={"device": "cpu"}), log=lambda *_: None)
    data, m = trainer.data, trainer.machine
    check_feedforward(m)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    dtype = m.readout.protos.dtype
    head = None
    if head_kind == "linear":
        head = [
            torch.randn(m.num_classes, cfg.coord_dim_n, generator=gen, dtype=dtype) / math.sqrt(cfg.coord_dim_n),
            torch.zeros(m.num_classes, dtype=dtype),
        ]
    named = {**m.named_params(), **({"head.weight": head[0], "head.bias": head[1]} if head else {})}
    scale = {"energy": 1.0, "readout": cfg.eta_readout_scale, "embed": cfg.eta_embed_scale}
    group_of = {**m.param_groups(), "head.weight": "readout", "head.bias": "readout"}
    groups = [{"params": [p], "mult": scale[group_of[n]]} for n, p in named.items()]
    for g in groups:
        g["params"][0].requires_grad_(True)
    opt = torch.optim.Adam(groups, lr=cfg.eta_update, betas=(cfg.momentum, cfg.adam_beta2), eps=cfg.adam_eps)
    sampler = Sampler(data.num_examples("train"), cfg.batch_size, cfg.seed)
    power_vecs = trainer.updater.state.power_vecs if capped else []
    total_windows = math.ceil(examples / cfg.batch_size)
    for w in range(total_windows):
        for g in opt.param_groups:
            g["lr"] = lr_at(cfg, w, total_windows) * g["mult"]  # the trainer's schedule and per-group scales
        inputs, targets = data.batch("train", sampler.next())
        loss = ff_loss(m, cfg, inputs, targets, act, head).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        with torch.no_grad():
            project_constraints(m, power_vecs)  # no power vectors: readout clamps only, no spectral caps
    total, correct, count = 0.0, 0, 0
    with torch.no_grad():
        for idx in heldout_batches(data.num_examples("heldout"), EVAL_BATCH, cfg.eval_batches):
            inputs, targets = data.batch("heldout", idx)
            out = ff_forward(m, inputs, act, head)
            if head is None:  # score with the trainer's own readout code, as its evaluation does
                cand = m.prototype_candidates()
                frame = readout_frame(m.readout, cand, m.layout, cfg.retrieval_beta, cfg.eps)
                mask = target_mask(cand.labels, targets, out.dtype)
                sc = ReadoutScratch.allocate(out.shape[0], out.shape[1], cand.coords.shape[0], out)
                res = readout_loss_and_grads(out, frame, cand, mask, m.num_classes, m.layout, sc)
                loss, probs = res.loss, res.probs
            else:
                loss, probs = torch.nn.functional.cross_entropy(out, targets, reduction="none"), out
            total += float(loss.sum())
            correct += int((probs.argmax(1) == targets).sum())
            count += len(idx)
    loss = total / count
    return {"heldout_loss": loss, "heldout_bpc": loss / math.log(2), "heldout_acc": correct / count}


def benchmark_config(preset: str, examples: int, flags: list[str], run_name: str = "quality") -> TrainConfig:
    """The preset on the CPU, resized to `examples` (whole batches, schedule included); later flags override it."""
    cfg = trainer2.config(preset, **{"device": "cpu", "run_name": run_name, **flag_overrides(flags)})
    return cfg.model_copy(update={"max_windows": math.ceil(examples / cfg.batch_size), "max_epochs": None})


def main() -> None:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__.split("\n")[0], epilog="Unknown arguments are TrainConfig flags."
    )
    p.add_argument("--preset", default="production")
    p.add_argument("--examples", type=int, default=200_000, help="training examples (rounded up to whole batches)")
    p.add_argument("--ff", action="store_true", help="also train the feed-forward backprop baseline")
    args, flags = p.parse_known_args()
    cfg = benchmark_config(args.preset, args.examples, flags, "exact_reference")
    if args.ff and not cfg.plan().graph.is_chain:  # refused before the exact run, not after it
        raise ConfigError(f"{FF_CHAINS_ONLY}: drop --ff")
    summary = exact_trainer(cfg).train()
    print(
        f"exact-gradient reference: held-out bpc {summary['heldout_bpc']:.4f} "
        f"after {summary['examples_seen']} examples "
        f"({summary['wall_seconds']:.0f} s)"
    )
    if args.ff:
        ff = train_feedforward(cfg, summary["examples_seen"])
        print(f"feed-forward backprop: held-out bpc {ff['heldout_bpc']:.4f}, acc {ff['heldout_acc']:.3f}")


if __name__ == "__main__":
    try:
        main()
    except (ConfigError, DataError) as e:
        print(f"{Path(__file__).name}: error: {e}", file=sys.stderr)
        sys.exit(2)  # as the trainer's command line does
