"""Shuffled epochs without an O(N) permutation: a seeded Feistel bijection of [0, N) per epoch, with cycle walking.

Position p of epoch e maps to example perm_e(p): a Feistel network over the smallest even number of bits b with
2^b >= N permutes [0, 2^b); applying it again while the result is >= N (cycle walking) restricts it to a bijection
of [0, N), at most ~4 applications on average since 2^b < 4N. The state is five integers whatever N is, and any
position of any epoch is computed directly, so a resume mid-epoch continues bit for bit.
"""

from __future__ import annotations

import numpy as np
import torch

from trainer2.data.dataset import DataError, check_batch

FORMAT = 2  # sampler state format: 1 = torch.randperm epochs (checkpoints before issue 26), 2 = this Feistel sampler
ROUNDS = 6  # Feistel rounds; 4 already give a pseudo-random permutation for a random round function
MASK64 = (1 << 64) - 1
KEYS = ("format", "seed", "num_examples", "epoch", "pos")
LEGACY_KEYS = ("generator", "num_examples", "epoch", "pos")
BLOCK = 1 << 14  # positions of an epoch permuted at once: a batch's numpy work (dozens of small ufuncs) amortised
STATE_KEYS = frozenset(f"sampler.{k}" for k in KEYS + LEGACY_KEYS)  # a checkpoint holds one of the two sets


def mix64(x: int) -> int:
    """splitmix64's finaliser of a Python int (taken mod 2^64): a well-spread 64-bit hash."""
    x &= MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def mix64_array(x: np.ndarray) -> np.ndarray:
    """mix64 over a uint64 array (multiplication wraps mod 2^64, as numpy's unsigned arrays do)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def round_keys(seed: int, epoch: int) -> list[np.uint64]:
    """The ROUNDS round keys of one epoch, from (seed, epoch) alone."""
    base = mix64(mix64(seed) ^ (epoch * 0x9E3779B97F4A7C15))
    return [np.uint64(mix64(base + r)) for r in range(ROUNDS)]


def feistel(x: np.ndarray, keys: list[np.uint64], half: int) -> np.ndarray:
    """A bijection of [0, 2^(2 half)) applied to uint64 [K]: balanced Feistel rounds with a hashed round function."""
    mask = np.uint64((1 << half) - 1)
    shift = np.uint64(half)
    left, right = x >> shift, x & mask
    for k in keys:
        left, right = right, left ^ (mix64_array(right ^ k) & mask)
    return (left << shift) | right


def permute(positions: np.ndarray, n: int, seed: int, epoch: int) -> np.ndarray:
    """perm_e(p) for uint64 positions [K] in [0, n): epoch `epoch`'s bijection of [0, n), by cycle walking."""
    bits = max(2, (n - 1).bit_length())
    half = (bits + 1) // 2
    keys = round_keys(seed, epoch)
    out = feistel(positions, keys, half)
    outside = out >= n
    while outside.any():  # each walk ends: the cycle through a position in [0, n) comes back into [0, n)
        out[outside] = feistel(out[outside], keys, half)
        outside = out >= n
    return out


class Sampler:
    """Shuffled epochs of fixed-size batches over `num_examples`; each epoch is a seeded bijection of the examples.

    O(1) state (format, seed, num_examples, epoch, pos). A checkpoint with the randperm sampler's state (format 1,
    trainer2 before issue 26) continues with that sampler, in the same order as before."""

    def __init__(self, num_examples: int, batch_size: int, seed: int) -> None:
        check_batch(num_examples, batch_size)
        self.num_examples = num_examples
        self.batch_size = batch_size
        self.batches_per_epoch = num_examples // batch_size
        self.seed = seed % (1 << 63)  # stored as int64
        self._epoch = 0
        self._pos = 0
        self._legacy: RandpermSampler | None = None  # set by loading a format-1 state
        self._block: tuple[int, int, np.ndarray] | None = None  # (epoch, first position, indices): derived, not state

    @property
    def epoch(self) -> int:
        return self._legacy.epoch if self._legacy is not None else self._epoch

    def next(self) -> torch.Tensor:
        """Next int64 [batch_size] of example indices; the ragged tail of each epoch is dropped so shapes stay fixed."""
        if self._legacy is not None:
            return self._legacy.next()
        if self._pos + self.batch_size > self.num_examples:
            self._epoch, self._pos = self._epoch + 1, 0
        start, self._pos = self._pos, self._pos + self.batch_size
        return torch.from_numpy(self.indices(start, self.batch_size).copy())

    def indices(self, start: int, count: int) -> np.ndarray:
        """int64 [count]: the examples at positions start .. start + count - 1 of the current epoch, read from a block
        of BLOCK positions permuted at once (the same values as permuting each batch alone)."""
        block = self._block
        if (
            block is None
            or block[0] != self._epoch
            or not block[1] <= start <= start + count <= block[1] + len(block[2])
        ):
            end = min(self.num_examples, start + max(BLOCK, count))
            positions = np.arange(start, end, dtype=np.uint64)
            block = (self._epoch, start, permute(positions, self.num_examples, self.seed, self._epoch).astype(np.int64))
            self._block = block
        return block[2][start - block[1] : start - block[1] + count]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """All state as int64 [] tensors (format 2), or the randperm sampler's (format 1) when resumed from one."""
        if self._legacy is not None:
            return self._legacy.state_dict()
        values = (FORMAT, self.seed, self.num_examples, self._epoch, self._pos)
        return {k: torch.tensor(v, dtype=torch.int64) for k, v in zip(KEYS, values, strict=True)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore from state_dict() of either format; afterwards next() continues exactly as the saved sampler."""
        if "generator" in state and "format" not in state:  # format 1: keep its randperm order
            legacy = RandpermSampler(self.num_examples, self.batch_size, 0)
            legacy.load_state_dict(state)
            self._legacy = legacy
            return
        missing = set(KEYS) - state.keys()
        if missing:
            raise DataError(
                f"sampler state is missing {sorted(missing)}; expected format {FORMAT} ({', '.join(KEYS)}) "
                f"or format 1 ({', '.join(LEGACY_KEYS)})"
            )
        if int(state["format"]) != FORMAT:
            raise DataError(
                f"sampler state has format {int(state['format'])}; this trainer reads format {FORMAT} "
                "(Feistel epochs) and format 1 (randperm epochs)"
            )
        if int(state["num_examples"]) != self.num_examples:
            raise DataError(
                f"sampler state is for {int(state['num_examples'])} examples, "
                f"expected {self.num_examples} (the data set changed?)"
            )
        pos = int(state["pos"])
        if not 0 <= pos <= self.num_examples:
            raise DataError(f"sampler state has position {pos}, expected 0..{self.num_examples}")
        self._legacy, self._block = None, None
        self.seed, self._epoch, self._pos = int(state["seed"]), int(state["epoch"]), pos


def sampler_state(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The sampler's entries of a checkpoint's tensors, without their "sampler." prefix."""
    return {k.removeprefix("sampler."): v for k, v in tensors.items() if k.startswith("sampler.")}


class RandpermSampler:
    """The sampler of checkpoints before issue 26 (format 1): shuffled epochs drawn by torch.randperm from its own
    torch.Generator; a run resumed from such a checkpoint keeps its order.

    Its state is O(1) whatever the data size: the generator state at the start of the current epoch, the
    epoch and the position in it; the epoch's permutation is recomputed from them on load, never stored."""

    def __init__(self, num_examples: int, batch_size: int, seed: int) -> None:
        check_batch(num_examples, batch_size)
        self.num_examples = num_examples
        self.batch_size = batch_size
        self.batches_per_epoch = num_examples // batch_size
        self.epoch = 0
        self._generator = torch.Generator().manual_seed(seed)
        self._epoch_start = self._generator.get_state()
        self._perm: torch.Tensor | None = None  # drawn on first use: a sampler about to be loaded (resume,
        self._pos = 0  # evaluate, sample) never draws a permutation it would throw away

    def _permutation(self) -> torch.Tensor:
        """This epoch's order, drawn on first use from the generator, which then sits at the epoch's start."""
        if self._perm is None:
            # int32 halves the memory and gives the same permutation as int64 (randperm's draws do not depend on it).
            dtype = torch.int32 if self.num_examples < 2**31 else torch.int64
            self._perm = torch.randperm(self.num_examples, generator=self._generator, dtype=dtype)
        return self._perm

    def next(self) -> torch.Tensor:
        """Next int64 [batch_size] of example indices; the ragged tail of each epoch is dropped so shapes stay fixed."""
        if self._pos + self.batch_size > self.num_examples:
            self._permutation()  # the generator must be past this epoch's draw before the next epoch starts
            self._epoch_start, self._perm, self._pos = self._generator.get_state(), None, 0
            self.epoch += 1
        batch = self._permutation()[self._pos : self._pos + self.batch_size].to(torch.int64)
        self._pos += self.batch_size
        return batch

    def state_dict(self) -> dict[str, torch.Tensor]:
        """All state as small tensors (generator at the epoch's start uint8 [S]; num_examples, epoch, pos int64 [])."""
        return {
            "generator": self._epoch_start.clone(),
            "num_examples": torch.tensor(self.num_examples, dtype=torch.int64),
            "epoch": torch.tensor(self.epoch, dtype=torch.int64),
            "pos": torch.tensor(self._pos, dtype=torch.int64),
        }

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore from state_dict(); afterwards next() continues exactly as the saved sampler would have."""
        missing = {"generator", "num_examples", "epoch", "pos"} - state.keys()
        if missing:
            raise DataError(f"sampler state is missing {sorted(missing)}")
        if int(state["num_examples"]) != self.num_examples:
            raise DataError(
                f"sampler state is for {int(state['num_examples'])} examples, "
                f"expected {self.num_examples} (the data set changed?)"
            )
        pos = int(state["pos"])
        if not 0 <= pos <= self.num_examples:
            raise DataError(f"sampler state has position {pos}, expected 0..{self.num_examples}")
        self._epoch_start = state["generator"].to(torch.uint8).clone()
        self._generator.set_state(self._epoch_start)
        self._perm, self._pos, self.epoch = None, pos, int(state["epoch"])  # the permutation is redrawn on use
