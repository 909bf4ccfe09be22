"""Text generation from a trained machine: one free-phase relaxation per character, then a draw from the readout.

The context is the last context_len characters; a shorter prompt is left-padded with a space (or the
first vocabulary character when the vocabulary has no space). Sampling stays on the device: the
characters come back to the host once, at the end.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
from torch import Tensor

from trainer2.data.dataset import encode
from trainer2.flags import add_trust_flag, user_modules_from_cwd
from trainer2.io.parser import Parser
from trainer2.physics.relaxation import Relaxation
from trainer2.running.model import WEIGHTS, WEIGHTS_HELP, load
from trainer2.running.resume import add_checkpoint_flags, checkpoint_from
from trainer2.section import ConfigError

MAX_LENGTH = 1_000_000  # characters per call: one free phase each, so about a day of CPU at the limit


def pad_char(vocab: list[str]) -> str:
    """The character a short prompt is left-padded with: a space when the vocabulary has one."""
    return " " if " " in vocab else vocab[0]


@torch.no_grad()
def next_char_probs(relax: Relaxation, contexts: Tensor) -> Tensor:
    """contexts int64 (B, context_len) -> class probabilities (B, V) after a free phase (B = relax.batch)."""
    # beta = 0 in the free phase, so the targets it takes only pick the loss, which is not used here.
    targets = torch.zeros(contexts.shape[0], dtype=torch.long, device=contexts.device)
    _, probs = relax.readout_scores(relax.free_phase(contexts, targets))
    return probs


@torch.no_grad()
def generate(relax: Relaxation, vocab: list[str], prompt: str, length: int, temperature: float, seed: int) -> str:
    """The `length` characters that follow `prompt`. temperature scales the log-probabilities (0 = argmax);
    draws come from a torch.Generator seeded with `seed`, so a fixed seed gives the same text."""
    if relax.batch != 1:
        raise ValueError(f"generate needs a Relaxation of batch size 1, got {relax.batch}")
    if not 0 <= length <= MAX_LENGTH or not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(
            f"length must be in 0..{MAX_LENGTH} and temperature finite and >= 0, got {length} and {temperature}"
        )
    ctx_len, device = relax.m.context_len, relax.device
    ids = encode(prompt, vocab, "--prompt")
    ids = torch.cat([encode(pad_char(vocab) * ctx_len, vocab, "pad"), ids])[-ctx_len:].to(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    out = torch.empty(length, dtype=torch.long, device=device)
    for t in range(length):
        probs = next_char_probs(relax, ids[None])[0]
        if temperature == 0:
            nxt = probs.argmax()
        else:
            logp = (
                probs.double().log()
            )  # shifted so the likeliest is 0: a tiny temperature sends the rest to -inf, not NaN
            nxt = torch.multinomial(torch.softmax((logp - logp.max()) / temperature, 0), 1, generator=gen)[0]
        out[t] = nxt
        ids = torch.cat([ids[1:], nxt[None]])
    return "".join(vocab[i] for i in out.tolist())


def sample_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="trainer2 sample",
        description="Generate text from a checkpoint: one free-phase relaxation per character, "
        "in the checkpoint's own vocabulary.",
    )
    add_checkpoint_flags(p)
    p.add_argument(
        "--prompt",
        default="",
        help="Text to continue. Only its last context_len characters condition the "
        "model; a shorter prompt is left-padded with spaces (or the first vocabulary character when the "
        "vocabulary has no space). Every character must be in the checkpoint's vocabulary.",
    )
    p.add_argument(
        "--length", type=int, default=200, help=f"Characters to generate, at most {MAX_LENGTH:,} (default: 200)."
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="Divides the log-probabilities; 0 = always the most likely character (default: 1.0).",
    )
    p.add_argument("--seed", type=int, default=0, help="Seed of the sampling generator (default: 0).")
    p.add_argument("--device", default="cpu", help="Device to run on (default: cpu).")
    p.add_argument("--weights", choices=WEIGHTS, default="auto", help=WEIGHTS_HELP)
    add_trust_flag(p)
    return p


def cmd_sample(argv: list[str]) -> int:
    p = sample_parser()
    args = p.parse_args(argv)
    if not 0 <= args.length <= MAX_LENGTH:
        p.error(f"--length must be in 0..{MAX_LENGTH:,}, got {args.length:,}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        p.error(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if not -(2**63) <= args.seed < 2**64:
        p.error(f"--seed must be in -2**63..2**64-1 (what torch.Generator takes), got {args.seed}")
    user_modules_from_cwd(args)
    path = checkpoint_from(args)
    model = load(path, device=args.device, weights=args.weights, trust_code=args.trust_code)
    print(f"loaded {path} (window {model.window}, {model.weights} weights)", file=sys.stderr)
    vocab = list(model.inputs.vocab)
    if not vocab:
        raise ConfigError(
            f"--checkpoint {path}: trained on {model.inputs.kind}, not text; sample generates text, so it needs a "
            "text model (score this one with trainer2 evaluate)"
        )
    print(args.prompt + generate(model.relaxation(1), vocab, args.prompt, args.length, args.temperature, args.seed))
    return 0
