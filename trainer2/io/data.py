"""Data sets (character text or numeric features), a checkpointable batch sampler and held-out batching."""

from __future__ import annotations

import codecs
import os
import pickle
import stat
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from trainer2.io import image_data
from trainer2.io.sizes import available_bytes

BUILTIN_SOURCE = "builtin:pydoc_data.topics"
SPLITS = ("train", "heldout")
TEXT_CHUNK = 1 << 22  # bytes of a text file decoded at a time
MAX_CODEPOINT = 0x10FFFF


class DataError(ValueError):
    """Bad data file or data set; the message names the file and what was expected."""


@dataclass(eq=False)  # eq=False: comparing tensor fields with == is ambiguous
class Dataset:
    """A loaded data set: text (a stream of character ids) or features (rows x [N, D] with labels y [N])."""

    kind: str
    source: str
    vocab: list[str]
    num_classes: int
    input_dim: int
    context_len: int
    train: torch.Tensor
    heldout: torch.Tensor
    train_y: torch.Tensor | None
    heldout_y: torch.Tensor | None
    digest: str | None = None  # sha256 of the text's tokens when known (a token cache's), so nobody hashes them again
    input_shape: tuple[int, ...] | None = None  # (C, H, W) of an image data set, whose rows are flattened images

    def _split(self, split: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(tokens [T] or x [N, D], None or y [N]) of one split."""
        if split == "train":
            return self.train, self.train_y
        if split == "heldout":
            return self.heldout, self.heldout_y
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")

    def num_examples(self, split: str) -> int:
        """Number of examples in `split`: text T - context_len windows, features N rows."""
        data, _ = self._split(split)
        return len(data) - self.context_len if self.kind == "text" else len(data)

    def batch(self, split: str, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """idx int64 [B] -> text: (contexts int64 [B, context_len], targets int64 [B]);
        features: (x float32 [B, D], y int64 [B])."""
        data, y = self._split(split)
        n = self.num_examples(split)
        # Negative indices would silently wrap around, so reject them rather than return wrong examples.
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
            raise IndexError(f"example indices must be in [0, {n}) for split {split!r}")
        if y is not None:
            return data[idx], y[idx]
        # Tokens are stored in the smallest integer type; int64 only for the batch, where indexing needs it.
        windows = data[idx[:, None] + torch.arange(self.context_len + 1)].to(torch.int64)
        return windows[:, :-1], windows[:, -1]

    def encode(self, text: str) -> torch.Tensor:
        """str of length T -> int64 [T] of vocabulary ids (text data sets only)."""
        self._require_text("encode")
        return encode(text, self.vocab, self.source)

    def decode(self, ids: torch.Tensor | Sequence[int]) -> str:
        """int ids [T] -> str of length T (text data sets only)."""
        self._require_text("decode")
        return "".join(self.vocab[i] for i in torch.as_tensor(ids).reshape(-1).tolist())

    def _require_text(self, what: str) -> None:
        if self.kind != "text":
            raise DataError(f"{self.source}: {what} needs a text data set, this one is {self.kind!r}")


def encode(text: str, vocab: Sequence[str], source: str) -> torch.Tensor:
    """str of length T -> int64 [T] of ids into `vocab`; an unknown character is a DataError naming it and `source`."""
    stoi = {c: i for i, c in enumerate(vocab)}
    unknown = next((c for c in text if c not in stoi), None)
    if unknown is not None:
        raise DataError(f"{source}: character {unknown!r} is not in the vocabulary")
    return torch.tensor([stoi[c] for c in text], dtype=torch.int64)


def load_dataset(path: str | None, context_len: int, heldout_fraction: float = 0.1) -> Dataset:
    """path None -> the built-in corpus; '*.npz' -> a feature or image data set (x [N, D] or [N, (C,) H, W]); a
    directory -> MNIST IDX files or CIFAR-10 python batches; 'torchvision:NAME:ROOT' -> a torchvision data set on disk
    (trainer2.io.image_data); anything else -> a UTF-8 text file."""
    if not 0.0 < heldout_fraction < 1.0:
        raise DataError(f"{path or BUILTIN_SOURCE}: heldout_fraction must be in (0, 1), got {heldout_fraction}")
    if not (path is None or path.strip()):  # Path("") is the current directory
        raise DataError("--data: empty; expected a data file or directory (drop --data for the built-in corpus)")
    if path is None:
        text = _builtin_text()
        return _text_dataset(lambda: iter([text]), BUILTIN_SOURCE, context_len, heldout_fraction)
    if path.startswith(image_data.TORCHVISION_PREFIX):
        return _image_dataset(path, lambda: image_data.load_torchvision(path, heldout_fraction))
    if path.endswith(".npz"):
        return _feature_dataset(path, heldout_fraction)
    if Path(path).is_dir():
        return _image_dataset(path, lambda: image_data.load_image_dir(path, heldout_fraction))
    _sniff_text(path, _check_file(path, "a UTF-8 text file or a .npz feature file"))
    return _text_dataset(lambda: _read_text_chunks(path), path, context_len, heldout_fraction)


def _builtin_text() -> str:
    """The CPython pydoc topics (~465k characters), joined in sorted-key order so it is reproducible."""
    from pydoc_data.topics import topics

    return "\n".join(topics[key] for key in sorted(topics))


def _check_file(path: str, expected: str) -> int:
    """The size in bytes of a regular file; a missing path, a directory, or anything that is no regular file (a
    FIFO or a device such as /dev/zero, which would block or never end) is a DataError naming the path."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise DataError(f"{path}: file does not exist; expected {expected}") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read file ({e.strerror}); expected {expected}") from None
    if stat.S_ISDIR(st.st_mode):
        raise DataError(f"{path}: is a directory; expected {expected}")
    if not stat.S_ISREG(st.st_mode):
        raise DataError(f"{path}: is not a regular file (a pipe, socket or device); expected {expected}")
    return st.st_size


def _sniff_text(path: str, size: int) -> None:
    """Refuse before reading it all a text file that is larger than the memory free for its tokens, or that holds
    NUL bytes in its first chunk (a binary file, or a file of zeros, would train as a meaningless corpus)."""
    free = available_bytes(torch.device("cpu"))
    if free is not None and size > free:  # one token of >= 1 byte per character, at most one character per byte
        raise DataError(
            f"{path}: {size / 2**30:.1f} GiB of text would need about as much memory for its tokens, but "
            f"{free / 2**30:.1f} GiB is free; use a smaller file"
        )
    refuse_binary(path)


def refuse_binary(path: str) -> None:
    """Refuse a file that holds NUL bytes in its first chunk: a binary file, or a file of zeros, is no corpus."""
    try:
        with open(path, "rb") as f:
            head = f.read(TEXT_CHUNK)
    except OSError as e:
        raise DataError(f"{path}: cannot read file ({e.strerror})") from None
    nul = head.find(b"\0")
    if nul >= 0:
        raise DataError(
            f"{path}: holds NUL bytes (the first at offset {nul}): a binary file, not text; expected a UTF-8 "
            "text file or a .npz feature file"
        )


def _read_text_chunks(path: str) -> Iterator[str]:
    """The file decoded as UTF-8, TEXT_CHUNK bytes at a time (a whole 100 MB str would cost 100-400 MB);
    every failure becomes a DataError naming the path."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0  # bytes of the file handed to the decoder so far
    try:
        with open(path, "rb") as f:
            while True:
                raw = f.read(TEXT_CHUNK)
                pending = len(decoder.getstate()[0])  # bytes of a character split by the previous chunk
                try:
                    text = decoder.decode(raw, final=not raw)
                except UnicodeDecodeError as e:
                    raise DataError(
                        f"{path}: not valid UTF-8 (bad byte at offset {offset - pending + e.start}); "
                        "expected a UTF-8 text file"
                    ) from None
                offset += len(raw)
                if text:
                    yield text
                if not raw:
                    return
    except OSError as e:
        raise DataError(f"{path}: cannot read file ({e.strerror})") from e


def _codepoints(text: str) -> np.ndarray:
    """str of length T -> uint32 [T] of its Unicode code points."""
    return np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)


def token_dtype(vocab_size: int) -> torch.dtype:
    """The smallest integer type that holds ids 0..vocab_size-1: tokens cost 1 byte each for <= 256 symbols."""
    if vocab_size <= 256:
        return torch.uint8
    return torch.int16 if vocab_size <= 2**15 else torch.int32


def _text_dataset(
    chunks: Callable[[], Iterator[str]], source: str, context_len: int, heldout_fraction: float
) -> Dataset:
    """Character-level data set: first (1 - heldout_fraction) of the characters train, the rest held-out.

    `chunks` gives the text in pieces and is called twice: once for the vocabulary and length, once to
    fill the token array, so only one chunk is ever held as a str."""
    if context_len < 1:
        raise DataError(f"{source}: context_len must be at least 1, got {context_len}")
    seen = np.zeros(MAX_CODEPOINT + 1, dtype=bool)
    length = 0
    for text in chunks():
        seen[_codepoints(text)] = True
        length += len(text)
    if not length:
        raise DataError(f"{source}: file is empty; expected UTF-8 text")
    text_split_sizes(length, source, context_len, heldout_fraction)  # refuse a short text before tokenizing it
    # Vocabulary over the whole text (sorted by code point), so held-out never contains an unknown character.
    present = np.flatnonzero(seen)
    vocab = [chr(c) for c in present]
    tokens = torch.empty(length, dtype=token_dtype(len(vocab)))
    out, pos = tokens.numpy(), 0
    to_id = np.zeros(MAX_CODEPOINT + 1, dtype=out.dtype)  # code point -> vocabulary id
    to_id[present] = np.arange(len(vocab))
    changed = DataError(f"{source}: the file changed while it was being read; try again")
    for text in chunks():
        end = pos + len(text)
        if end > length:
            raise changed
        np.take(to_id, _codepoints(text), out=out[pos:end], mode="clip")  # "clip" never clips here; it skips a buffer
        pos = end
    if pos != length:
        raise changed
    return text_split(tokens, vocab, source, context_len, heldout_fraction)


def text_split_sizes(length: int, source: str, context_len: int, heldout_fraction: float) -> int:
    """Characters of the train split of a text of `length`; a split too short for one window is a DataError."""
    n_train = length - round(length * heldout_fraction)
    need = context_len + 1  # one full window plus its target
    for split, size in (("train", n_train), ("heldout", length - n_train)):
        if size < need:
            raise DataError(
                f"{source}: too short: the {split} split has {size} characters but needs at least {need} "
                f"(context_len + 1); the text has {length} characters in total"
            )
    return n_train


def text_split(
    tokens: torch.Tensor, vocab: list[str], source: str, context_len: int, heldout_fraction: float
) -> Dataset:
    """The text data set over tokens [T] (ids into vocab; in memory or mapped from a file): train, then held-out."""
    n_train = text_split_sizes(len(tokens), source, context_len, heldout_fraction)
    return Dataset(
        kind="text",
        source=source,
        vocab=vocab,
        num_classes=len(vocab),
        input_dim=context_len,
        context_len=context_len,
        train=tokens[:n_train],
        heldout=tokens[n_train:],
        train_y=None,
        heldout_y=None,
    )


def _image_dataset(source: str, read: Callable[[], image_data.ImageSplits]) -> Dataset:
    """An "images" data set from a reader of trainer2.io.image_data (its errors become DataErrors)."""
    try:
        im = read()
    except image_data.DataError as e:
        raise DataError(str(e)) from None
    return Dataset(
        kind="images",
        source=source,
        vocab=[],
        num_classes=im.num_classes,
        input_dim=im.train.shape[1],
        context_len=0,
        train=im.train,
        heldout=im.heldout,
        train_y=im.train_y,
        heldout_y=im.heldout_y,
        input_shape=im.shape,
    )


def _feature_dataset(path: str, heldout_fraction: float) -> Dataset:
    """Features from an .npz with x [N, D] (images: [N, H, W] or [N, C, H, W]) and y [N]; the last heldout_fraction
    of rows is held-out.

    Rows are NOT shuffled: the split is by position, so pre-shuffle the file if its rows are ordered.
    """
    x, y = _read_npz(path)
    if x.ndim > 2:
        return _image_dataset(path, lambda: image_data.image_splits(path, x, y, None, None, heldout_fraction))
    n = len(x)
    # At least one row on each side, whatever the fraction.
    n_train = min(n - 1, max(1, n - round(n * heldout_fraction)))
    x_t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    y_t = torch.from_numpy(np.ascontiguousarray(y, dtype=np.int64))
    return Dataset(
        kind="features",
        source=path,
        vocab=[],
        num_classes=int(y_t.max()) + 1,
        input_dim=x.shape[1],
        context_len=0,
        train=x_t[:n_train],
        heldout=x_t[n_train:],
        train_y=y_t[:n_train],
        heldout_y=y_t[n_train:],
    )


def _check_npz_sizes(path: str) -> None:
    """Refuse, from the zip directory and the .npy headers alone, an .npz whose arrays would not fit in memory (a
    few hundred compressed bytes can expand into gigabytes) or whose header's shape does not match its size."""
    try:
        with zipfile.ZipFile(path) as z:
            need, shapes = 0.0, {}  # bytes once loaded; each array's shape as its header says
            for key in ("x", "y"):
                if f"{key}.npy" not in z.namelist():
                    continue  # the loader below names a missing array
                info = z.getinfo(f"{key}.npy")
                with z.open(info) as f:
                    version = np.lib.format.read_magic(f)
                    read = (
                        np.lib.format.read_array_header_1_0
                        if version == (1, 0)
                        else np.lib.format.read_array_header_2_0
                    )
                    shape, _, dtype = read(f)
                    header = f.tell()
                shapes[key] = tuple(shape)
                held = int(np.prod(shape, dtype=object)) * dtype.itemsize
                if dtype.hasobject:
                    raise DataError(
                        f"{path}: array {key!r} holds Python objects (pickled), which are never loaded; "
                        "expected numbers saved with numpy.savez"
                    )
                if held != info.file_size - header:
                    raise DataError(
                        f"{path}: array {key!r}: its header says {dtype} {tuple(shape)} ({held} bytes), but it "
                        f"holds {info.file_size - header} bytes; the file is corrupt"
                    )
                need += held + int(np.prod(shape, dtype=object)) * 8  # the array, and its float32 / int64 copy
        rows = [shapes[k][0] if shapes[k] else None for k in ("x", "y") if k in shapes]
        if len(rows) == 2 and rows[0] != rows[1]:
            raise DataError(
                f"{path}: x and y must have the same number of rows, found {rows[0]} and {rows[1]} (in their headers)"
            )
    except zipfile.BadZipFile:
        return  # not a zip archive: the loader below says what it is
    except DataError:
        raise
    except (OSError, ValueError, EOFError) as e:
        raise DataError(
            f"{path}: cannot load as .npz ({e}); expected arrays 'x' and 'y' saved with numpy.savez"
        ) from None
    free = available_bytes(torch.device("cpu"))
    if free is not None and need > free:
        raise DataError(
            f"{path}: its arrays would take about {need / 2**30:.1f} GiB once decompressed, but "
            f"{free / 2**30:.1f} GiB is free; use a smaller file"
        )


def _read_npz(path: str) -> tuple[np.ndarray, np.ndarray]:
    """Validated (x [N, D] float or int, y [N] int >= 0) from an .npz.

    Every problem becomes a DataError naming the path."""
    _check_file(path, "an .npz feature file with arrays 'x' and 'y'")
    _check_npz_sizes(path)
    try:
        archive = np.load(path, allow_pickle=False, mmap_mode="r")  # mmap: a big .npy is refused without reading it
        if not isinstance(archive, np.lib.npyio.NpzFile):  # e.g. a single .npy array renamed .npz
            raise DataError(
                f"{path}: not an .npz archive but a single array (an .npy file renamed?); "
                "expected arrays 'x' and 'y' saved with numpy.savez"
            )
        with archive:
            for key in ("x", "y"):
                if key not in archive.files:
                    found = sorted(archive.files)
                    raise DataError(f"{path}: missing array {key!r}; expected 'x' and 'y', found {found}")
            x, y = archive["x"], archive["y"]
    except DataError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, pickle.UnpicklingError) as e:
        raise DataError(f"{path}: cannot load as .npz ({e}); expected arrays 'x' and 'y' saved with numpy.savez") from e
    if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
        raise DataError(f"{path}: x must be a floating or integer array, found dtype {x.dtype}")
    if x.ndim not in (2, 3, 4) or 0 in x.shape[1:]:
        raise DataError(f"{path}: x must be [N, D] features or [N, H, W] / [N, C, H, W] images, found shape {x.shape}")
    if not np.issubdtype(y.dtype, np.integer):
        raise DataError(f"{path}: y must be an integer array of class labels, found dtype {y.dtype}")
    if y.ndim != 1:
        raise DataError(f"{path}: y must be 1-D [N], found shape {y.shape}")
    if len(x) != len(y):
        raise DataError(f"{path}: x and y must have the same number of rows, found {len(x)} and {len(y)}")
    if len(x) < 2:
        raise DataError(f"{path}: need at least 2 rows (one train, one held-out), found {len(x)}")
    if y.min() < 0:
        raise DataError(f"{path}: labels in y must be >= 0, found {y.min()}")
    if y.max() >= len(y):
        # One prototype per class up to the largest label: a sparse label would allocate classes no row has.
        raise DataError(
            f"{path}: labels in y must be class indices 0..K-1 with K <= N = {len(y)} rows, found label {y.max()}; "
            "remap the labels to 0..K-1"
        )
    finite = np.isfinite(x.astype(np.float32))  # checked after the float32 cast, since that is what trains
    if not finite.all():
        row = int(np.argwhere(~finite)[0, 0])
        raise DataError(f"{path}: x must be finite, found {x[row][~finite[row]][0]} in row {row}")
    return x, y


def check_batch(num_examples: int, batch_size: int) -> None:
    """Refuse a batch size a sampler over `num_examples` cannot draw."""
    if batch_size < 1:
        raise DataError(f"batch_size must be at least 1, got {batch_size}")
    if batch_size > num_examples:
        raise DataError(f"batch_size {batch_size} is larger than the number of examples {num_examples}")


class Sampler:
    """Shuffled epochs of fixed-size batches over `num_examples`, driven by its own torch.Generator.

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


def heldout_batches(num_examples: int, batch_size: int, max_batches: int | None) -> Iterator[torch.Tensor]:
    """Deterministic consecutive int64 index batches [<= batch_size] over the held-out split; the last may be smaller.

    At most max_batches (None = all); when that limits it, the batches are spread evenly over the split,
    not just taken from its start.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    if max_batches is not None and max_batches < 0:
        raise ValueError(f"max_batches must be >= 0 or None, got {max_batches}")
    total = -(-num_examples // batch_size)
    count = total if max_batches is None else min(total, max_batches)
    for k in range(count):
        # k * total // count picks distinct batch slots spread over the whole split; identity when count == total.
        start = (k * total // count) * batch_size
        yield torch.arange(start, min(start + batch_size, num_examples))
