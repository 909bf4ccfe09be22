"""A loaded data set (character text, feature vectors or images), its batches, and held-out batching.

Readers of the formats on disk (trainer2/data/text.py, npz.py, images.py) and `from_arrays` (arrays.py) all build
this one `Dataset`; everything downstream sees only it.
"""

from __future__ import annotations

import os
import stat
import sys
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

SPLITS = ("train", "validation", "heldout")
# Every form --data takes, for the messages about a path none of them reads
DATA_FORMATS = (
    "a UTF-8 text file, an .npz feature or image set (arrays x and y), a .csv table of numbers, an MNIST IDX or "
    "CIFAR-10 batches directory, or torchvision:NAME:ROOT"
)


class DataError(ValueError):
    """Bad data file or data set; the message names the file and what was expected."""


class LabelWarning(UserWarning):
    """Class labels that leave classes without an example (gaps, a stray large label) or held-out classes the
    training split never shows: the data set still loads, with one class per index up to the largest label."""


@dataclass(eq=False)  # eq=False: comparing tensor fields with == is ambiguous
class Dataset:
    """A loaded data set: text (a stream of character ids), or features / images (rows x [N, D] with labels y [N];
    an image's row is its (C, H, W) pixels, normalised per channel by `normalise`)."""

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
    # images: per-channel (mean, std) that made the rows from the raw pixels, (x - mean) / std, so new images can be
    # scored the same way (trainer2.running.model)
    normalise: tuple[tuple[float, ...], tuple[float, ...]] | None = None
    # the end of the training data set apart for tuning (with_validation), empty when there is none
    validation: torch.Tensor | None = None
    validation_y: torch.Tensor | None = None

    @property
    def tokens(self) -> bool:
        """Whether the inputs are token ids (text): the machine learns an embedding, and losses read as bits per
        character."""
        return self.kind == "text"

    def _split(self, split: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(tokens [T] or x [N, D], None or y [N]) of one split."""
        if split == "train":
            return self.train, self.train_y
        if split == "heldout":
            return self.heldout, self.heldout_y
        if split == "validation" and self.validation is not None:
            return self.validation, self.validation_y
        if split == "validation":
            raise ValueError(f"{self.source}: no 'validation' split (set validation_fraction to make one)")
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")

    def num_examples(self, split: str) -> int:
        """Number of examples in `split`: text T - context_len windows, features N rows (0 for no validation)."""
        if split == "validation" and self.validation is None:
            return 0
        data, _ = self._split(split)
        return len(data) - self.context_len if self.tokens else len(data)

    def with_validation(self, fraction: float) -> "Dataset":
        """This data set with the last `fraction` of its training split (by position) set apart as the validation
        split; a split too short for one example is a DataError."""
        n = len(self.train)
        cut = n - max(1, round(n * fraction))
        need = self.context_len + 1 if self.tokens else 1  # text: a window and its target on each side
        if cut < need or n - cut < need:
            raise DataError(
                f"{self.source}: validation_fraction {fraction:g} of the {self.num_examples('train')} training "
                "examples leaves a split too short for one example; lower or raise it"
            )
        ys = (None, None) if self.train_y is None else (self.train_y[:cut], self.train_y[cut:])
        return replace(self, train=self.train[:cut], validation=self.train[cut:], train_y=ys[0], validation_y=ys[1])

    def batch(self, split: str, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """idx int64 [B] -> text: (contexts int64 [B, context_len], targets int64 [B]);
        features: (x float32 [B, D], y int64 [B])."""
        data, y = self._split(split)
        n = self.num_examples(split)
        # Negative indices would silently wrap around, so reject them rather than return wrong examples.
        if idx.numel():
            lo, hi = torch.aminmax(idx)
            if int(lo) < 0 or int(hi) >= n:
                raise IndexError(f"example indices must be in [0, {n}) for split {split!r}")
        if y is not None:
            return data[idx], y[idx]
        # Row i of the unfolded view is the window starting at token i (no copy); one gather takes the batch's rows.
        # Tokens are stored in the smallest integer type; int64 only for the batch, where indexing needs it.
        windows = data.unfold(0, self.context_len + 1, 1)[idx].to(torch.int64)
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
        if not self.tokens:
            raise DataError(f"{self.source}: {what} needs a text data set, this one is {self.kind!r}")


@dataclass(frozen=True)
class InputSpec:
    """What a machine's inputs are, without the data: enough to build the machine and to turn new raw inputs into its
    rows (a checkpoint records it, so a trained model loads and predicts without its data set)."""

    kind: str  # "text", "features" or "images"
    num_classes: int
    input_dim: int  # context_len for text (token ids per example), else the row width D = C*H*W
    context_len: int
    vocab: tuple[str, ...] = ()
    input_shape: tuple[int, ...] | None = None  # (C, H, W) of images
    normalise: tuple[tuple[float, ...], tuple[float, ...]] | None = None  # images: per-channel (mean, std)

    @property
    def tokens(self) -> bool:
        return self.kind == "text"

    @staticmethod
    def of(data: "Dataset") -> "InputSpec":
        return InputSpec(
            data.kind,
            data.num_classes,
            data.input_dim,
            data.context_len,
            tuple(data.vocab),
            data.input_shape,
            data.normalise,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "num_classes": self.num_classes,
            "input_dim": self.input_dim,
            "context_len": self.context_len,
            "input_shape": None if self.input_shape is None else list(self.input_shape),
            "normalise": None if self.normalise is None else [list(v) for v in self.normalise],
        }

    @staticmethod
    def from_json(values: dict[str, Any], vocab: Sequence[str]) -> "InputSpec":
        """The spec a checkpoint's data fingerprint records (vocab is the fingerprint's own field); a malformed one is
        a DataError."""
        try:
            shape, norm = values["input_shape"], values["normalise"]
            return InputSpec(
                str(values["kind"]),
                int(values["num_classes"]),
                int(values["input_dim"]),
                int(values["context_len"]),
                tuple(str(c) for c in vocab),
                None if shape is None else tuple(int(d) for d in shape),
                None if norm is None else (tuple(float(v) for v in norm[0]), tuple(float(v) for v in norm[1])),
            )
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise DataError(f"the recorded input spec is malformed ({type(e).__name__}: {e})") from None


def encode(text: str, vocab: Sequence[str], source: str) -> torch.Tensor:
    """str of length T -> int64 [T] of ids into `vocab`; an unknown character is a DataError naming it and `source`."""
    stoi = {c: i for i, c in enumerate(vocab)}
    unknown = next((c for c in text if c not in stoi), None)
    if unknown is not None:
        raise DataError(f"{source}: character {unknown!r} is not in the vocabulary")
    return torch.tensor([stoi[c] for c in text], dtype=torch.int64)


def check_file(path: str, expected: str) -> int:
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


def check_batch(num_examples: int, batch_size: int) -> None:
    """Refuse a batch size a sampler over `num_examples` cannot draw."""
    if batch_size < 1:
        raise DataError(f"batch_size must be at least 1, got {batch_size}")
    if batch_size > num_examples:
        raise DataError(f"batch_size {batch_size} is larger than the number of examples {num_examples}")


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


def check_arrays(source: str, x: np.ndarray, y: np.ndarray, min_rows: int = 2, rows: int | None = None) -> None:
    """Refuse arrays that cannot train, naming `source`: x must be float or int [N, D] features or [N, H, W] /
    [N, C, H, W] images, finite; y int [N] class indices 0..K-1 with K <= `rows` (N, or the rows of all splits); at
    least min_rows rows (two: one per split)."""
    if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
        raise DataError(f"{source}: x must be a floating or integer array, found dtype {x.dtype}")
    if x.ndim not in (2, 3, 4) or 0 in x.shape[1:]:
        raise DataError(
            f"{source}: x must be [N, D] features or [N, H, W] / [N, C, H, W] images, found shape {x.shape}"
        )
    if not np.issubdtype(y.dtype, np.integer):
        raise DataError(f"{source}: y must be an integer array of class labels, found dtype {y.dtype}")
    if y.ndim != 1:
        raise DataError(f"{source}: y must be 1-D [N], found shape {y.shape}")
    if len(x) != len(y):
        raise DataError(f"{source}: x and y must have the same number of rows, found {len(x)} and {len(y)}")
    if len(x) < min_rows:
        raise DataError(
            f"{source}: need at least {min_rows} rows"
            + (" (one train, one held-out)" if min_rows == 2 else "")
            + f", found {len(x)}"
        )
    if y.min() < 0:
        raise DataError(f"{source}: labels in y must be >= 0, found {y.min()}")
    rows = len(y) if rows is None else rows
    if y.max() >= rows:
        # One prototype per class up to the largest label: a sparse label would allocate classes no row has.
        raise DataError(
            f"{source}: labels in y must be class indices 0..K-1 with K <= N = {rows} rows, found label {y.max()}; "
            "remap the labels to 0..K-1"
        )
    row = nonfinite_row(x)
    if row is not None:
        with np.errstate(over="ignore"):  # a float64 beyond float32's range is what is reported
            finite = np.isfinite(np.asarray(x[row], dtype=np.float32))
        raise DataError(
            f"{source}: x must be finite, found {x[row][~finite].flat[0]} in row {row}; drop or impute such rows"
        )


FINITE_CHUNK = 1 << 20  # values checked at a time: the check's temporaries stay a few MB, whatever the array's size


def nonfinite_row(x: np.ndarray) -> int | None:
    """The first row of x [N, ...] holding a value that is not finite as float32 (what trains), or None; checked a
    chunk of rows at a time, so no temporary the size of x is made."""
    if not np.issubdtype(x.dtype, np.floating):
        return None  # integers are finite, and every int64 is within float32's range
    step = max(1, FINITE_CHUNK // max(1, int(np.prod(x.shape[1:]))))
    with np.errstate(over="ignore"):  # the cast of a value beyond float32's range: inf, which is what is found
        for start in range(0, len(x), step):
            chunk = x[start : start + step]
            # float32 and narrower are finite as float32 exactly when finite; wider ones are cast, a chunk at a time
            finite = np.isfinite(chunk if chunk.dtype.itemsize <= 4 else chunk.astype(np.float32))
            if not finite.all():
                return start + int(np.argwhere(~finite)[0, 0])
    return None


def split_rows(n: int, heldout_fraction: float) -> int:
    """Rows of the train split when the last heldout_fraction of n rows is held out: at least one on each side."""
    return min(n - 1, max(1, n - round(n * heldout_fraction)))


def held_out(
    x: np.ndarray, y: np.ndarray, x_held: np.ndarray | None, y_held: np.ndarray | None, heldout_fraction: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x, y, x_held, y_held): the given held-out split, else the last heldout_fraction of the rows, by position."""
    if x_held is not None and y_held is not None:
        return x, y, x_held, y_held
    n_train = split_rows(len(x), heldout_fraction)
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


def feature_dataset(
    source: str,
    x: np.ndarray,
    y: np.ndarray,
    x_held: np.ndarray | None,
    y_held: np.ndarray | None,
    heldout_fraction: float,
) -> Dataset:
    """Feature rows x [N, D] (float32 as they are: features are not normalised) with labels y [N]; held-out: the given
    split, else the last heldout_fraction of the rows, by position (shuffle ordered rows first)."""
    x, y, x_held, y_held = held_out(x, y, x_held, y_held, heldout_fraction)

    def rows(a: np.ndarray, dtype: type) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=dtype))

    return Dataset(
        kind="features",
        source=source,
        vocab=[],
        num_classes=class_count(source, y, y_held),
        input_dim=x.shape[1],
        context_len=0,
        train=rows(x, np.float32),
        heldout=rows(x_held, np.float32),
        train_y=rows(y, np.int64),
        heldout_y=rows(y_held, np.int64),
    )


def class_count(source: str, y: np.ndarray, y_held: np.ndarray) -> int:
    """The class count K = largest label + 1 of a data set's train and held-out labels; warns (LabelWarning, naming
    `source`) when some class below K has no example, or a held-out class has no training example, since either
    usually means labels that were never renumbered 0..K-1 or ordered rows cut into splits unshuffled."""
    train, held = np.unique(y), np.unique(y_held)  # small: one label per row
    present = np.union1d(train, held)
    k = int(present[-1]) + 1
    notes = []
    if len(present) < k:
        missing = np.setdiff1d(np.arange(k), present, assume_unique=True)
        notes.append(
            f"labels {spans(present)}: {counted(missing, 'class', 'classes')} no example; the machine gets {k} "
            "classes. Renumber them 0..K-1 if that is not meant"
        )
    unseen = np.setdiff1d(held, train, assume_unique=True)
    if len(unseen):
        notes.append(
            f"held-out {counted(unseen, 'label', 'labels')} no training example, so the machine cannot learn "
            f"{'it' if len(unseen) == 1 else 'them'}; shuffle rows ordered by class before the held-out split is cut, "
            "or give a held-out split whose classes the training split has"
        )
    if notes:
        warnings.warn(f"{source}: " + "; ".join(notes), LabelWarning, stacklevel=caller_level())
    return k


def counted(values: np.ndarray, one: str, many: str) -> str:
    """'class 3 has' or 'classes 1, 3 have': the noun and verb agreeing with how many values there are."""
    return f"{one} {spans(values)} has" if len(values) == 1 else f"{many} {spans(values)} have"


def caller_level() -> int:
    """warnings.warn's stacklevel for the innermost caller outside trainer2, so a warning points at the user's line
    (from_arrays(...)) rather than at the reader inside trainer2 that found the problem."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    frame, level = sys._getframe(1), 1  # level 1: the function that calls warnings.warn
    while frame.f_back is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def spans(values: np.ndarray, most: int = 8) -> str:
    """Sorted ints as a person reads them: '1, 3, 4', runs of three or more as '7..99', and at most `most` parts
    ('and N more' after), so a label of a million still makes a short message."""
    v = [int(a) for a in values]
    parts: list[str] = []
    start = 0
    for i in range(1, len(v) + 1):
        if i == len(v) or v[i] != v[i - 1] + 1:
            run = v[start:i]
            parts += [f"{run[0]}..{run[-1]}"] if len(run) >= 3 else [str(a) for a in run]
            start = i
    shown = ", ".join(parts[:most])
    return shown if len(parts) <= most else f"{shown} and {len(parts) - most} more"
