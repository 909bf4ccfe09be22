"""Add-k smoothed character n-grams on the trainer's own split: the classical yardstick for held-out bpc.

    python -m benchmarks.ngram [--orders 1 2 3 4 5] [--context_len 8] [--data PATH]

Counts come from the training split only. Every held-out character after the first `context_len` is predicted
(the trainer's held-out examples, same targets) from the n-1 characters before it:
p(x | h) = (c(h, x) + k) / (c(h) + k V), V the vocabulary size. k is chosen per order from a grid by its
held-out bpc, so the baseline is an optimistic one (tuned on the numbers it reports); benchmarks/compressors.py
chooses k on a validation split instead. Prints one row per order.
"""

from __future__ import annotations

import argparse
import math

import numpy as np

from trainer2.data.load import load_dataset

K_GRID = (1.0, 0.5, 0.2, 0.1, 0.05, 0.02, 0.01, 0.005, 0.002, 0.001, 0.0005, 0.0002, 0.0001)


def keys(tokens: np.ndarray, n: int, vocab: int, ends: np.ndarray) -> np.ndarray:
    """int64 [len(ends)]: the n-gram ending at each position of `ends` (inclusive), as one base-`vocab` number."""
    key = np.zeros(len(ends), dtype=np.int64)
    for back in range(n - 1, -1, -1):
        key = key * vocab + tokens[ends - back]
    return key


def lookup(table_keys: np.ndarray, table_counts: np.ndarray, query: np.ndarray) -> np.ndarray:
    """Counts of `query` keys in a sorted (keys, counts) table; 0 where absent."""
    pos = np.searchsorted(table_keys, query).clip(max=len(table_keys) - 1)
    return np.where(table_keys[pos] == query, table_counts[pos], 0)


def held_out_bits(
    train: np.ndarray, heldout: np.ndarray, n: int, vocab: int, context_len: int, ks: tuple[float, ...] = K_GRID
) -> dict[float, float]:
    """k -> mean bits per held-out character of the add-k n-gram (n >= 1), for each k of `ks`."""
    train_ends = np.arange(n - 1, len(train))
    gram_keys, gram_counts = np.unique(keys(train, n, vocab, train_ends), return_counts=True)
    ends = np.arange(context_len, len(heldout))
    c_gram = lookup(gram_keys, gram_counts, keys(heldout, n, vocab, ends)).astype(np.float64)
    if n == 1:
        c_hist = np.full(len(ends), float(len(train_ends)))
    else:  # the history's count as a prefix of a training n-gram, so numerator and denominator agree
        hist_keys, hist_counts = np.unique(keys(train, n - 1, vocab, train_ends - 1), return_counts=True)
        c_hist = lookup(hist_keys, hist_counts, keys(heldout, n - 1, vocab, ends - 1)).astype(np.float64)
    return {k: float(-np.log2((c_gram + k) / (c_hist + k * vocab)).mean()) for k in ks}


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--orders", type=int, nargs="+", default=[1, 2, 3, 4, 5], help="n-gram orders to fit")
    parser.add_argument(
        "--context_len",
        type=int,
        default=8,
        help="the trainer's context length (sets which held-out characters are predicted)",
    )
    parser.add_argument("--data", default=None, help="text file (default: the built-in corpus)")
    args = parser.parse_args()
    if any(n < 1 or n > args.context_len + 1 for n in args.orders):
        parser.error(f"--orders must lie in 1..context_len+1 = {args.context_len + 1}")
    data = load_dataset(args.data, args.context_len)
    if data.kind != "text":
        parser.error(f"{data.source}: n-grams need a text data set")
    vocab = len(data.vocab)
    if vocab ** max(args.orders) >= 2**63:
        parser.error(f"vocabulary of {vocab} is too large for {max(args.orders)}-gram keys")
    train, heldout = data.train.numpy().astype(np.int64), data.heldout.numpy().astype(np.int64)
    print(
        f"{data.source}: vocabulary {vocab}, train {len(train)} characters, held-out {len(heldout)} "
        f"({len(heldout) - args.context_len} predicted)"
    )
    print("| order | best k | held-out bpc |\n| --- | --- | --- |")
    for n in args.orders:
        bits = held_out_bits(train, heldout, n, vocab, args.context_len)
        k = min(bits, key=bits.get)
        assert math.isfinite(bits[k])
        print(f"| {n} | {k:g} | {bits[k]:.3f} |")


if __name__ == "__main__":
    main()
