"""Held-out bits per character of the standard compressors, add-k n-grams and trained machines, side by side.

    python -m benchmarks.compressors [--data FILE] [--context_len 8] [--checkpoint CKPT ...] [--preset NAME ...]

Every row predicts the same characters: the trainer's own held-out split (the last heldout_fraction of the text) after
its first `context_len` characters, given everything before them.
- zlib -9, bzip2 -9, xz -9e: the bits a compressor adds for those characters when it has compressed the training
  split (and the held-out prefix) before them, C(before + predicted) - C(before), over the characters predicted.
- add-k n-grams of orders 1-6 (benchmarks/ngram.py): k chosen per order, and the best order, on a validation split
  (the last --validation_fraction of the training split, counts from the rest); held-out bpc from counts over the
  whole training split at those choices. The held-out split is never used to choose.
- a checkpoint (--checkpoint, trained on this file with its split): its held-out bpc over the whole split; a preset
  (--preset) is trained on the file first (its own run directory under --run_root), then scored the same way.
A machine whose context_len differs from --context_len predicts a few more or fewer characters; the table says so.
"""

from __future__ import annotations

import argparse
import bz2
import lzma
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

import trainer2
from benchmarks.ngram import held_out_bits
from trainer2.data.dataset import Dataset
from trainer2.data.load import load_dataset

COMPRESSORS: dict[str, Callable[[bytes], bytes]] = {
    "zlib -9": lambda b: zlib.compress(b, 9),
    "bzip2 -9": lambda b: bz2.compress(b, 9),
    "xz -9e": lambda b: lzma.compress(b, preset=9 | lzma.PRESET_EXTREME),
}
ORDERS = (1, 2, 3, 4, 5, 6)
WHOLE_SPLIT = 10**9  # evaluation batches: more than any held-out split has, so every example is scored


def text_of(data: Dataset, tokens: np.ndarray) -> str:
    """The characters of a token id array."""
    return "".join(np.asarray(data.vocab, dtype=object)[tokens])


def compressor_bits(before: str, predicted: str) -> dict[str, float]:
    """Compressor name -> bits per character it adds for `predicted` once it has seen `before`."""
    a, ab = before.encode(), (before + predicted).encode()
    return {name: 8 * (len(fn(ab)) - len(fn(a))) / len(predicted) for name, fn in COMPRESSORS.items()}


def ngram_rows(data: Dataset, validation_fraction: float, context_len: int) -> tuple[list[tuple], int]:
    """([(order, k, validation bpc, held-out bpc)], the best order by validation bpc): k chosen per order on the
    trainer's validation split (Dataset.with_validation), the held-out bpc from counts over the whole training split."""
    train, heldout = data.train.numpy().astype(np.int64), data.heldout.numpy().astype(np.int64)
    split = data.with_validation(validation_fraction)
    fit, validation = split.train.numpy().astype(np.int64), split.validation.numpy().astype(np.int64)
    vocab, rows = len(data.vocab), []
    for n in ORDERS:
        on_validation = held_out_bits(fit, validation, n, vocab, context_len)
        k = min(on_validation, key=on_validation.get)
        rows.append((n, k, on_validation[k], held_out_bits(train, heldout, n, vocab, context_len, ks=(k,))[k]))
    return rows, min(rows, key=lambda r: r[2])[0]


def machine_bpc(checkpoint: Path) -> tuple[float, int]:
    """(held-out bpc over the whole split, context_len) of a trained text checkpoint, on the data it was trained on."""
    model = trainer2.load(checkpoint)
    metrics = model.evaluate(max_batches=WHOLE_SPLIT)
    if "heldout_bpc" not in metrics:
        raise SystemExit(f"{checkpoint}: not a text machine (no bits per character)")
    return metrics["heldout_bpc"], model.cfg.context_len


def train_preset(name: str, data_path: str | None, run_root: Path) -> Path:
    """Train preset `name` on the file (its own split) and return its checkpoint."""
    cfg = trainer2.config(name, **({"data": data_path} if data_path else {}))
    run = trainer2.train(cfg, run_dir=run_root / f"{Path(name).stem}-{time.time_ns()}")
    return run.checkpoint


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--data", default=None, help="text file (default: the built-in corpus)")
    p.add_argument("--context_len", type=int, default=8, help="characters before the first one predicted (>= 5)")
    p.add_argument("--heldout_fraction", type=float, default=0.1, help="the trainer's held-out fraction")
    p.add_argument("--validation_fraction", type=float, default=0.1, help="of the training split, to choose n-grams")
    p.add_argument("--checkpoint", type=Path, action="append", default=[], help="a text checkpoint trained on --data")
    p.add_argument("--preset", action="append", default=[], help="a preset to train on --data and score")
    p.add_argument("--run_root", type=Path, default=Path("/tmp/compressors"), help="where --preset runs write")
    args = p.parse_args()
    if args.context_len < max(ORDERS) - 1:
        p.error(f"--context_len must be at least {max(ORDERS) - 1}: the 6-gram reads 5 characters back")
    data = load_dataset(args.data, args.context_len, args.heldout_fraction)
    if data.kind != "text":
        p.error(f"{data.source}: the compressors compare text data sets")
    if len(data.vocab) ** max(ORDERS) >= 2**63:
        p.error(f"{data.source}: a vocabulary of {len(data.vocab)} is too large for 6-gram keys")
    train, heldout = data.train.numpy(), data.heldout.numpy()
    before = text_of(data, train) + text_of(data, heldout[: args.context_len])
    predicted = text_of(data, heldout[args.context_len :])
    checkpoints = list(args.checkpoint) + [train_preset(n, args.data, args.run_root) for n in args.preset]

    print(
        f"{data.source}: {len(train) + len(heldout)} characters, vocabulary {len(data.vocab)}; "
        f"held-out bpc over {len(predicted)} characters (the last {args.heldout_fraction:g} after "
        f"{args.context_len} of context)"
    )
    print("| predictor | chosen on validation | held-out bpc |\n| --- | --- | --- |")
    for name, bits in compressor_bits(before, predicted).items():
        print(f"| {name} (given the training split) | - | {bits:.3f} |")
    rows, best = ngram_rows(data, args.validation_fraction, args.context_len)
    for n, k, on_validation, bits in rows:
        mark = " (best on validation)" if n == best else ""
        print(f"| add-k {n}-gram{mark} | k {k:g} ({on_validation:.3f} bpc) | {bits:.3f} |")
    for ckpt in checkpoints:
        bits, context_len = machine_bpc(ckpt)
        note = "" if context_len == args.context_len else f", context {context_len}"
        print(f"| {ckpt}{note} | its preset | {bits:.3f} |")


if __name__ == "__main__":
    main()
