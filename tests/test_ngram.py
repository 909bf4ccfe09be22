"""benchmarks/ngram.py: the add-k n-gram yardstick counts and scores what its docstring says."""

from __future__ import annotations

import math

import numpy as np

from benchmarks.ngram import K_GRID, held_out_bits


def test_add_k_bits_on_an_alternating_sequence_match_the_formula():
    train, heldout = np.array([0, 1] * 50), np.array([0, 1] * 10)
    unigram = held_out_bits(train, heldout, 1, vocab=2, context_len=1)
    assert all(math.isclose(b, 1.0) for b in unigram.values())  # 50 / 50 counts: one bit whatever k
    bigram = held_out_bits(train, heldout, 2, vocab=2, context_len=1)
    for k in K_GRID:  # after 0 (50 times in train, always followed by 1): 10 held-out 1s; after 1 (49 times): 9 0s
        want = -(10 * math.log2((50 + k) / (50 + 2 * k)) + 9 * math.log2((49 + k) / (49 + 2 * k))) / 19
        assert math.isclose(bigram[k], want, rel_tol=1e-12)


def test_an_unseen_history_gets_the_uniform_distribution():
    train, heldout = np.array([0, 0, 0, 0, 1]), np.array([2, 2, 2])
    bits = held_out_bits(train, heldout, 3, vocab=3, context_len=2)
    assert all(math.isclose(b, math.log2(3)) for b in bits.values())  # history (2, 2) never seen


def test_the_scored_characters_are_the_trainers_held_out_examples(small_text):
    """Same targets, same histories as Dataset.batch('heldout'): a bigram scored from the trainer's own examples."""
    import torch

    from trainer2.data.load import load_dataset

    data = load_dataset(str(small_text), context_len=4)
    vocab, k = len(data.vocab), 0.1
    train, heldout = data.train.numpy().astype(np.int64), data.heldout.numpy().astype(np.int64)
    pairs, hist = {}, {}
    for a, b in zip(train[:-1], train[1:]):
        pairs[a, b], hist[a] = pairs.get((a, b), 0) + 1, hist.get(a, 0) + 1
    contexts, targets = data.batch("heldout", torch.arange(data.num_examples("heldout")))
    want = -np.mean(
        [
            math.log2((pairs.get((c, t), 0) + k) / (hist.get(c, 0) + k * vocab))
            for c, t in zip(contexts[:, -1].tolist(), targets.tolist())
        ]
    )
    assert math.isclose(held_out_bits(train, heldout, 2, vocab, 4)[k], want, rel_tol=1e-12)
