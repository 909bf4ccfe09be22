"""benchmarks/compressors.py: each row predicts the trainer's held-out characters, and nothing is chosen on them."""

from __future__ import annotations

import math
import random
import subprocess
import sys
import zlib

import numpy as np

import trainer2
from benchmarks.compressors import compressor_bits, machine_bpc, ngram_rows, text_of
from benchmarks.ngram import held_out_bits
from trainer2.data.load import load_dataset


def test_compressor_bits_are_what_the_predicted_text_adds():
    rng = random.Random(0)
    before = "".join(rng.choice("abcdefgh") for _ in range(5000))
    repeat = compressor_bits(before, before[-2000:])  # seen already: almost free
    fresh = compressor_bits(before, "".join(rng.choice("abcdefgh") for _ in range(2000)))  # 3 bits of entropy each
    assert repeat["zlib -9"] < 0.2 and repeat["xz -9e"] < 0.2, repeat  # both find the 2,000-character match
    assert all(repeat[name] < fresh[name] - 0.3 for name in repeat), (repeat, fresh)  # bzip2's sort finds it less
    assert all(2.8 < fresh[name] < 4.5 for name in fresh), fresh
    want = 8 * (len(zlib.compress((before + "xyz" * 100).encode(), 9)) - len(zlib.compress(before.encode(), 9))) / 300
    assert compressor_bits(before, "xyz" * 100)["zlib -9"] == want


def test_text_of_decodes_the_tokens(small_text):
    data = load_dataset(str(small_text), context_len=6)
    whole = np.concatenate([data.train.numpy(), data.heldout.numpy()])
    assert text_of(data, whole) == small_text.read_text(encoding="utf-8")


def test_ngram_k_and_order_are_chosen_on_validation_never_on_held_out(small_text):
    data = load_dataset(str(small_text), context_len=6)
    rows, best = ngram_rows(data, 0.2, 6)
    train = data.train.numpy().astype(np.int64)
    cut = len(train) - round(len(train) * 0.2)
    for n, k, on_validation, bits in rows:
        grid = held_out_bits(train[:cut], train[cut:], n, len(data.vocab), 6)
        assert k == min(grid, key=grid.get) and on_validation == grid[k]
        whole = held_out_bits(train, data.heldout.numpy().astype(np.int64), n, len(data.vocab), 6)
        assert bits == whole[k]
    assert best == min(rows, key=lambda r: r[2])[0]
    scrambled = data.heldout[np.random.default_rng(0).permutation(len(data.heldout))]
    again, best_again = ngram_rows(type(data)(**{**data.__dict__, "heldout": scrambled}), 0.2, 6)
    assert [r[:3] for r in again] == [r[:3] for r in rows] and best_again == best  # held-out text moves no choice


def test_a_checkpoint_row_is_its_held_out_bpc_over_the_whole_split(small_text, tmp_path):
    cfg = trainer2.config("dev", data=str(small_text), max_windows=20, eval_batches=1, context_len=6)
    run = trainer2.train(cfg, run_dir=tmp_path / "run")
    bits, context_len = machine_bpc(run.checkpoint)
    assert context_len == 6
    assert math.isclose(bits, trainer2.load(run.checkpoint).evaluate(max_batches=10**6)["heldout_bpc"])


def test_the_command_prints_one_row_per_predictor(small_text):
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.compressors", "--data", str(small_text), "--context_len", "6"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [r.split(" |")[0] for r in rows[:3]] == [
        "| zlib -9 (given the training split)",
        "| bzip2 -9 (given the training split)",
        "| xz -9e (given the training split)",
    ]
    assert len(rows) == 9 and sum("best on validation" in r for r in rows) == 1
    assert all(math.isfinite(float(r.rsplit("|", 2)[1])) for r in rows)
