"""Tests for trainer2.data.dataset: loading, batching, encoding, errors, Sampler and heldout_batches."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from trainer2.data.dataset import DataError, Dataset, heldout_batches
from trainer2.data.load import load_dataset
from trainer2.data.sampler import RandpermSampler as Sampler
from trainer2.data.text import BUILTIN_SOURCE

TEXT = "the quick brown fox jumps over the lazy dog. " * 10


@pytest.fixture(scope="module")
def builtin() -> Dataset:
    return load_dataset(None, context_len=8)


def write_text(tmp_path: Path, content: str | bytes, name: str = "corpus.txt") -> str:
    path = tmp_path / name
    if isinstance(content, str):
        path.write_text(content, encoding="utf-8")
    else:
        path.write_bytes(content)
    return str(path)


def write_npz(tmp_path: Path, name: str = "data.npz", **arrays: np.ndarray) -> str:
    path = tmp_path / name
    np.savez(path, **arrays)
    return str(path)


# --- text ---------------------------------------------------------------------------------------


def test_builtin_corpus_size_vocab_and_split(builtin: Dataset) -> None:
    total = len(builtin.train) + len(builtin.heldout)
    assert total > 400_000
    assert builtin.kind == "text" and builtin.source == BUILTIN_SOURCE
    assert builtin.vocab == sorted(set(builtin.vocab)) and builtin.num_classes == len(builtin.vocab)
    assert builtin.input_dim == builtin.context_len == 8
    assert builtin.train_y is None and builtin.heldout_y is None
    assert builtin.train.dtype == builtin.heldout.dtype == torch.uint8  # under 256 symbols: one byte per character
    assert abs(len(builtin.heldout) - 0.1 * total) <= 1
    assert int(builtin.heldout.max()) < len(builtin.vocab) and int(builtin.heldout.min()) >= 0
    # Every vocabulary entry is a single character that actually occurs somewhere.
    used = torch.cat([builtin.train, builtin.heldout]).unique()
    assert len(used) == len(builtin.vocab) and all(len(c) == 1 for c in builtin.vocab)


def test_builtin_matches_pydoc_topics(builtin: Dataset) -> None:
    from pydoc_data.topics import topics

    expected = "\n".join(topics[k] for k in sorted(topics))
    assert builtin.decode(torch.cat([builtin.train, builtin.heldout])) == expected


def test_text_split_is_by_position(tmp_path: Path) -> None:
    ds = load_dataset(write_text(tmp_path, TEXT), context_len=4, heldout_fraction=0.2)
    n_held = round(len(TEXT) * 0.2)
    assert ds.decode(ds.train) == TEXT[:-n_held]
    assert ds.decode(ds.heldout) == TEXT[-n_held:]
    assert ds.num_examples("train") == len(TEXT) - n_held - 4
    assert ds.num_examples("heldout") == n_held - 4


def test_text_batch_matches_slicing(builtin: Dataset) -> None:
    for split, tokens in (("train", builtin.train), ("heldout", builtin.heldout)):
        text = builtin.decode(tokens)
        n = builtin.num_examples(split)
        assert n == len(tokens) - 8
        idx = torch.tensor([0, 1, 1234, n - 1])
        contexts, targets = builtin.batch(split, idx)
        assert contexts.shape == (4, 8) and targets.shape == (4,)
        assert contexts.dtype == targets.dtype == torch.int64
        for row, i in enumerate(idx.tolist()):
            assert builtin.decode(contexts[row]) == text[i : i + 8]
            assert builtin.decode(targets[row : row + 1]) == text[i + 8]


def test_batch_rejects_bad_split_and_out_of_range(builtin: Dataset) -> None:
    with pytest.raises(ValueError, match="no 'validation' split"):
        builtin.batch("validation", torch.tensor([0]))
    with pytest.raises(ValueError, match="'test'"):
        builtin.num_examples("test")
    with pytest.raises(IndexError):
        builtin.batch("heldout", torch.tensor([builtin.num_examples("heldout")]))
    with pytest.raises(IndexError):
        builtin.batch("train", torch.tensor([-1]))


def test_encode_decode_round_trip(builtin: Dataset) -> None:
    text = "def f(x):\n    return x + 1"
    ids = builtin.encode(text)
    assert ids.dtype == torch.int64 and ids.shape == (len(text),)
    assert [builtin.vocab[i] for i in ids.tolist()] == list(text)
    assert builtin.decode(ids) == text
    assert builtin.decode(ids.tolist()) == text


def test_encode_unknown_character(builtin: Dataset) -> None:
    assert "\u2603" not in builtin.vocab
    with pytest.raises(DataError, match=r"'\u2603'.*not in the vocabulary"):
        builtin.encode("snow \u2603")


def test_utf8_text_file(tmp_path: Path) -> None:
    content = "héllo wörld — ünïcode " * 5
    path = write_text(tmp_path, content)
    ds = load_dataset(path, context_len=3)
    assert ds.source == path
    assert ds.vocab == sorted(set(content))
    assert ds.decode(torch.cat([ds.train, ds.heldout])) == content


def test_tokens_use_the_smallest_integer_type(tmp_path: Path) -> None:
    # 300 distinct symbols do not fit a byte: int16. Batches are int64 either way.
    wide = "".join(chr(0x400 + i) for i in range(300)) * 3
    ds = load_dataset(write_text(tmp_path, wide), context_len=3)
    assert ds.train.dtype == torch.int16 and len(ds.vocab) == 300
    assert ds.decode(torch.cat([ds.train, ds.heldout])) == wide
    contexts, targets = ds.batch("train", torch.tensor([0, 5]))
    assert contexts.dtype == targets.dtype == torch.int64 and ds.decode(targets) == wide[3] + wide[8]


def test_text_read_in_chunks_splits_no_character(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 7-byte chunks cut 2-, 3- and 4-byte characters in half; the result must equal a whole-file decode.
    monkeypatch.setattr("trainer2.data.tokens.TEXT_CHUNK", 7)
    content = "a\u00e9\u2014\U0001f600 zb\n" * 40
    ds = load_dataset(write_text(tmp_path, content), context_len=3)
    assert ds.vocab == sorted(set(content))
    assert ds.decode(torch.cat([ds.train, ds.heldout])) == content
    bad = write_text(tmp_path, "\u2014".encode() * 20 + b"\xff" + b"x" * 40, "bad.txt")
    with pytest.raises(DataError, match="offset 60"):
        load_dataset(bad, context_len=3)


def test_missing_file(tmp_path: Path) -> None:
    path = str(tmp_path / "nope.txt")
    with pytest.raises(DataError, match="does not exist") as err:
        load_dataset(path, context_len=4)
    assert path in str(err.value)


def test_directory(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="directory") as err:
        load_dataset(str(tmp_path), context_len=4)
    assert str(tmp_path) in str(err.value)


def test_not_utf8(tmp_path: Path) -> None:
    path = write_text(tmp_path, b"hello world " * 5 + b"\xff\xfe rest of file")
    with pytest.raises(DataError, match="UTF-8") as err:
        load_dataset(path, context_len=4)
    assert path in str(err.value) and "offset 60" in str(err.value)


def test_empty_file(tmp_path: Path) -> None:
    path = write_text(tmp_path, "")
    with pytest.raises(DataError, match="empty") as err:
        load_dataset(path, context_len=4)
    assert path in str(err.value)


def test_too_short_for_heldout(tmp_path: Path) -> None:
    # 40 characters: held-out gets 4, but context_len 4 needs 5 on each side.
    path = write_text(tmp_path, "a" * 40)
    with pytest.raises(DataError, match="too short") as err:
        load_dataset(path, context_len=4)
    message = str(err.value)
    assert path in message and "heldout" in message and "has 4 characters" in message and "at least 5" in message
    # 50 characters: held-out gets 5, exactly enough.
    ok = load_dataset(write_text(tmp_path, "a" * 50, "ok.txt"), context_len=4)
    assert ok.num_examples("heldout") == 1


def test_too_short_for_train(tmp_path: Path) -> None:
    path = write_text(tmp_path, "abcdefghij")
    with pytest.raises(DataError, match="train split has 1 characters") as err:
        load_dataset(path, context_len=2, heldout_fraction=0.9)
    assert path in str(err.value)


def test_context_len_must_be_positive(tmp_path: Path) -> None:
    path = write_text(tmp_path, TEXT)
    with pytest.raises(DataError, match="context_len") as err:
        load_dataset(path, context_len=0)
    assert path in str(err.value)


def test_features_only_text_methods(tmp_path: Path) -> None:
    ds = load_dataset(write_npz(tmp_path, x=np.zeros((4, 2)), y=np.zeros(4, dtype=np.int64)), context_len=3)
    with pytest.raises(DataError, match="text"):
        ds.encode("abc")


# --- features -----------------------------------------------------------------------------------


def test_npz_happy_path(tmp_path: Path) -> None:
    x = np.arange(40, dtype=np.float64).reshape(20, 2)
    y = np.array([0, 1, 2, 4] * 5, dtype=np.int32)
    path = write_npz(tmp_path, x=x, y=y)
    ds = load_dataset(path, context_len=5)
    assert ds.kind == "features" and ds.source == path and ds.vocab == []
    assert ds.num_classes == 5 and ds.input_dim == 2 and ds.context_len == 0
    assert ds.train.dtype == torch.float32 and ds.train_y is not None and ds.train_y.dtype == torch.int64
    # Last 10% of rows held out, in file order (no shuffling).
    assert torch.equal(ds.train, torch.tensor(x[:18], dtype=torch.float32))
    assert torch.equal(ds.heldout, torch.tensor(x[18:], dtype=torch.float32))
    assert ds.heldout_y is not None and ds.heldout_y.tolist() == [2, 4]
    assert ds.num_examples("train") == 18 and ds.num_examples("heldout") == 2
    bx, by = ds.batch("train", torch.tensor([3, 0]))
    assert bx.dtype == torch.float32 and by.dtype == torch.int64
    assert bx.tolist() == [[6.0, 7.0], [0.0, 1.0]] and by.tolist() == [4, 0]


def test_npz_integer_x_and_label_from_heldout(tmp_path: Path) -> None:
    # The largest label only occurs in the held-out rows but must still count towards num_classes.
    path = write_npz(tmp_path, x=np.ones((10, 3), dtype=np.int16), y=np.array([0] * 9 + [7]))
    ds = load_dataset(path, context_len=1)
    assert ds.num_classes == 8 and ds.train.dtype == torch.float32


def test_npz_two_rows_splits_one_each(tmp_path: Path) -> None:
    ds = load_dataset(write_npz(tmp_path, x=np.zeros((2, 1)), y=np.array([0, 1])), context_len=1)
    assert ds.num_examples("train") == 1 and ds.num_examples("heldout") == 1


BAD_NPZ = [
    ("missing_y", {"x": np.zeros((4, 2))}, "missing array 'y'"),
    ("missing_x", {"y": np.zeros(4, dtype=np.int64), "z": np.zeros(4)}, r"missing array 'x'.*\['y', 'z'\]"),
    (
        "x_1d",
        {"x": np.zeros(4), "y": np.zeros(4, dtype=np.int64)},
        r"\[N, D\] features or .* images, found shape \(4,\)",
    ),
    ("y_2d", {"x": np.zeros((4, 2)), "y": np.zeros((4, 1), dtype=np.int64)}, r"1-D.*\(4, 1\)"),
    ("length", {"x": np.zeros((4, 2)), "y": np.zeros(3, dtype=np.int64)}, "4 and 3"),
    ("float_y", {"x": np.zeros((4, 2)), "y": np.zeros(4)}, "integer.*float64"),
    ("bool_x", {"x": np.zeros((4, 2), dtype=bool), "y": np.zeros(4, dtype=np.int64)}, "floating or integer.*bool"),
    ("negative", {"x": np.zeros((4, 2)), "y": np.array([0, 1, -3, 2])}, ">= 0.*-3"),
    ("nan", {"x": np.array([[0.0, 1.0], [2.0, np.nan]] * 2), "y": np.zeros(4, dtype=np.int64)}, "finite.*nan.*row 1"),
    ("inf", {"x": np.array([[0.0, 1.0], [2.0, 3.0], [np.inf, 0.0]]), "y": np.zeros(3, dtype=np.int64)}, "finite.*inf"),
    ("sparse_label", {"x": np.zeros((4, 2)), "y": np.array([0, 1, 9, 2])}, r"0\.\.K-1 with K <= N = 4.*found label 9"),
    ("one_row", {"x": np.zeros((1, 2)), "y": np.zeros(1, dtype=np.int64)}, "at least 2 rows.*found 1"),
]


@pytest.mark.parametrize("name,arrays,pattern", BAD_NPZ, ids=[case[0] for case in BAD_NPZ])
def test_malformed_npz(tmp_path: Path, name: str, arrays: dict[str, np.ndarray], pattern: str) -> None:
    path = write_npz(tmp_path, f"{name}.npz", **arrays)
    with pytest.raises(DataError, match=pattern) as err:
        load_dataset(path, context_len=4)
    assert path in str(err.value)


@pytest.mark.parametrize("content", [b"not a zip file at all", b""], ids=["garbage", "empty"])
def test_npz_not_loadable(tmp_path: Path, content: bytes) -> None:
    path = write_text(tmp_path, content, "broken.npz")
    with pytest.raises(DataError, match="npz") as err:
        load_dataset(path, context_len=4)
    assert path in str(err.value)


def test_npy_renamed_npz_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.npz"
    np.save(tmp_path / "x.npy", np.zeros((4, 2)))
    (tmp_path / "x.npy").rename(path)  # was a TypeError traceback
    with pytest.raises(DataError, match=r"not an \.npz archive but a single array \(an \.npy file renamed\?\)") as err:
        load_dataset(str(path), context_len=4)
    assert str(path) in str(err.value)


def test_npz_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "d.npz").mkdir()
    with pytest.raises(DataError, match="is a directory"):
        load_dataset(str(tmp_path / "d.npz"), context_len=4)


def test_npz_missing_file(tmp_path: Path) -> None:
    path = str(tmp_path / "absent.npz")
    with pytest.raises(DataError) as err:
        load_dataset(path, context_len=4)
    assert path in str(err.value)


def test_npz_object_array(tmp_path: Path) -> None:
    path = write_npz(tmp_path, x=np.array([[object()]] * 2, dtype=object), y=np.zeros(2, dtype=np.int64))
    with pytest.raises(DataError) as err:
        load_dataset(path, context_len=4)
    assert path in str(err.value)


# --- Sampler ------------------------------------------------------------------------------------


def test_sampler_epochs_are_permutations() -> None:
    sampler = Sampler(num_examples=23, batch_size=5, seed=0)
    assert sampler.batches_per_epoch == 4
    epochs = []
    for epoch in range(3):
        batches = [sampler.next() for _ in range(sampler.batches_per_epoch)]
        assert sampler.epoch == epoch
        assert all(b.shape == (5,) and b.dtype == torch.int64 for b in batches)
        seen = torch.cat(batches)
        assert len(seen.unique()) == 20  # no repeats within an epoch; the ragged 3 are dropped
        assert int(seen.min()) >= 0 and int(seen.max()) < 23
        epochs.append(seen)
    sampler.next()
    assert sampler.epoch == 3
    # A fresh permutation each epoch, not the same order repeated.
    assert not torch.equal(epochs[0], epochs[1]) and not torch.equal(epochs[1], epochs[2])


def test_sampler_covers_all_when_divisible() -> None:
    sampler = Sampler(num_examples=12, batch_size=4, seed=3)
    seen = torch.cat([sampler.next() for _ in range(3)])
    assert sorted(seen.tolist()) == list(range(12))


def test_sampler_is_seeded() -> None:
    a, b, c = Sampler(50, 7, seed=1), Sampler(50, 7, seed=1), Sampler(50, 7, seed=2)
    draws_a = [a.next() for _ in range(10)]
    assert all(torch.equal(x, b.next()) for x in draws_a)
    assert not all(torch.equal(x, c.next()) for x in draws_a)


def test_sampler_state_dict_round_trip() -> None:
    sampler = Sampler(num_examples=17, batch_size=4, seed=5)
    for _ in range(3):
        sampler.next()
    state = sampler.state_dict()
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    assert state["generator"].dtype == torch.uint8
    assert state["pos"].dtype == state["epoch"].dtype == torch.int64 and state["pos"].dim() == 0
    # Draws cross several epoch boundaries, so the generator state must be restored too, not only the permutation.
    expected = [sampler.next() for _ in range(13)]
    restored = Sampler(num_examples=17, batch_size=4, seed=999)
    restored.load_state_dict(state)
    assert restored.epoch == 0
    actual = [restored.next() for _ in range(13)]
    assert all(torch.equal(e, a) for e, a in zip(expected, actual))
    assert restored.epoch == sampler.epoch == 3


@pytest.mark.parametrize("draws", range(10))
def test_sampler_resumes_exactly_from_any_position(draws: int) -> None:
    # 4 batches per epoch: saves at the start, middle and end of epochs 0-2, each loaded into a fresh sampler.
    sampler = Sampler(num_examples=17, batch_size=4, seed=11)
    for _ in range(draws):
        sampler.next()
    restored = Sampler(num_examples=17, batch_size=4, seed=0)
    restored.load_state_dict(sampler.state_dict())
    assert all(torch.equal(sampler.next(), restored.next()) for _ in range(12))
    assert restored.epoch == sampler.epoch


def test_sampler_state_dict_is_a_snapshot() -> None:
    sampler = Sampler(num_examples=9, batch_size=3, seed=0)
    state = sampler.state_dict()
    first = [sampler.next() for _ in range(5)]
    sampler.load_state_dict(state)
    assert all(torch.equal(f, sampler.next()) for f in first)


def test_sampler_errors() -> None:
    with pytest.raises(DataError, match="larger than"):
        Sampler(num_examples=3, batch_size=4, seed=0)
    state = Sampler(num_examples=10, batch_size=2, seed=0).state_dict()
    with pytest.raises(DataError, match="for 10 examples, expected 11"):
        Sampler(num_examples=11, batch_size=2, seed=0).load_state_dict(state)


def test_sampler_state_does_not_grow_with_the_data() -> None:
    # The permutation is recomputed on load, never stored: a checkpoint stays small whatever the corpus.
    small, big = Sampler(100, 4, seed=0).state_dict(), Sampler(1_000_000, 4, seed=0).state_dict()
    assert {k: v.shape for k, v in small.items()} == {k: v.shape for k, v in big.items()}
    assert sum(v.numel() * v.element_size() for v in big.values()) < 10_000


def test_sampler_order_is_successive_randperms_of_one_generator() -> None:
    # The order every earlier run used (and the README's figures were measured with): epoch e is the
    # e-th randperm drawn from one generator seeded with `seed`.
    gen = torch.Generator().manual_seed(7)
    expected = torch.cat([torch.randperm(10, generator=gen)[:8] for _ in range(3)])
    sampler = Sampler(num_examples=10, batch_size=4, seed=7)
    assert torch.equal(torch.cat([sampler.next() for _ in range(6)]), expected)


# --- heldout_batches ----------------------------------------------------------------------------


def test_heldout_batches_cover_everything() -> None:
    batches = list(heldout_batches(num_examples=23, batch_size=5, max_batches=None))
    assert [len(b) for b in batches] == [5, 5, 5, 5, 3]
    assert torch.cat(batches).tolist() == list(range(23))
    assert torch.cat(list(heldout_batches(23, 5, 100))).tolist() == list(range(23))


def test_heldout_batches_respect_max_batches_and_spread() -> None:
    batches = list(heldout_batches(num_examples=100, batch_size=10, max_batches=3))
    assert len(batches) == 3
    assert all(len(b) == 10 and torch.equal(b, torch.arange(int(b[0]), int(b[0]) + 10)) for b in batches)
    starts = [int(b[0]) for b in batches]
    assert starts == sorted(set(starts)) and starts[0] == 0
    assert starts[-1] >= 50  # spread over the split, not just its first 30 examples
    assert list(heldout_batches(100, 10, 0)) == []


def test_heldout_batches_are_deterministic() -> None:
    first = list(heldout_batches(57, 8, 4))
    second = list(heldout_batches(57, 8, 4))
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
