"""Image data sets in the formats people have on disk: an image .npz, the MNIST IDX files, the CIFAR-10 python batches.

Every reader returns uint8 or float arrays x [N, C, H, W] and int labels y [N]; `image_dataset` normalises each channel
by the training split's mean and standard deviation (kept in the data set, so new images are scored alike) and
flattens the images into rows, keeping their (C, H, W) shape for the couplings. The official test split is the
held-out split where the format has one. Nothing downloads.
"""

from __future__ import annotations

import gzip
import pickle
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from trainer2.data.dataset import DataError, Dataset, class_count, held_out
from trainer2.data.load import DataConfig
from trainer2.io.safeio import open_regular

IDX_TYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
MAX_IDX_BYTES = 1 << 33  # 8 GiB: a header claiming more is a corrupt or hostile file, refused before reading
CIFAR_TRAIN = [f"data_batch_{i}" for i in range(1, 6)]
# What the CIFAR-10 pickles may name: numpy's array reconstruction and nothing else (a pickle can run any callable).
CIFAR_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("_codecs", "encode"),
}


def image_dataset(
    source: str,
    x: np.ndarray,
    y: np.ndarray,
    x_held: np.ndarray | None,
    y_held: np.ndarray | None,
    heldout_fraction: float,
) -> Dataset:
    """Images x [N, H, W] or [N, C, H, W] with labels y [N] as normalised rows; held-out: the given split, else the
    last heldout_fraction of the rows (by position). Each channel is normalised by the training split's mean and std."""
    x, y, x_held, y_held = held_out(x, y, x_held, y_held, heldout_fraction)
    x, x_held = (a[:, None] if a.ndim == 3 else a for a in (x, x_held))
    if x.shape[1:] != x_held.shape[1:]:
        raise DataError(f"{source}: the train images are {x.shape[1:]} but the held-out ones {x_held.shape[1:]}")
    mean = x.mean(axis=(0, 2, 3), dtype=np.float64)
    std = np.maximum(x.std(axis=(0, 2, 3), dtype=np.float64), 1e-8)  # a constant channel stays 0, not NaN

    def labels(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))

    train = normalised_rows(x, mean, std)
    return Dataset(
        kind="images",
        source=source,
        vocab=[],
        num_classes=class_count(source, y, y_held),
        input_dim=train.shape[1],
        context_len=0,
        train=train,
        heldout=normalised_rows(x_held, mean, std),
        train_y=labels(y),
        heldout_y=labels(y_held),
        input_shape=tuple(int(d) for d in x.shape[1:]),
        normalise=(tuple(float(m) for m in mean), tuple(float(d) for d in std)),
    )


def normalised_rows(a: np.ndarray, mean: np.ndarray, std: np.ndarray) -> torch.Tensor:
    """float32 rows [N, C*H*W] of images a [N, C, H, W]: (a - mean) / std per channel, in float32 as they train."""
    mean32, std32 = np.asarray(mean, np.float32)[:, None, None], np.asarray(std, np.float32)[:, None, None]
    out = (a.astype(np.float32) - mean32) / std32
    return torch.from_numpy(np.ascontiguousarray(out.reshape(len(a), -1)))


def check_images(source: str, x: np.ndarray, y: np.ndarray) -> None:
    """Refuse image arrays that cannot train: wrong rank or dtype, labels that are not class indices, non-finite
    pixels."""
    if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
        raise DataError(f"{source}: images must be a floating or integer array, found dtype {x.dtype}")
    if x.ndim not in (3, 4) or 0 in x.shape[1:]:
        raise DataError(f"{source}: images must be [N, H, W] or [N, C, H, W], found shape {x.shape}")
    if not np.issubdtype(y.dtype, np.integer) or y.ndim != 1:
        raise DataError(f"{source}: labels must be a 1-D integer array, found {y.dtype} of shape {y.shape}")
    if len(x) != len(y):
        raise DataError(f"{source}: {len(x)} images but {len(y)} labels")
    if len(y) and (y.min() < 0 or y.max() >= max(len(y), 256)):
        raise DataError(f"{source}: labels must be class indices 0..K-1, found {y.min()}..{y.max()}")
    if np.issubdtype(x.dtype, np.floating) and not np.isfinite(x).all():
        raise DataError(f"{source}: images must be finite")


class MnistDir:
    """A directory of MNIST IDX files (train-images-idx3-ubyte and friends, gzipped or not; Fashion-MNIST too); the
    t10k files are the held-out split when present."""

    name: ClassVar[str] = "mnist"

    @staticmethod
    def recognises(path: str | None) -> bool:
        return path is not None and Path(path).is_dir() and find(Path(path), "train-images", "idx3-ubyte") is not None

    @staticmethod
    def load(path: str | None, cfg: DataConfig) -> Dataset:
        return from_splits(str(path), read_mnist_dir(Path(str(path))), cfg.heldout_fraction)


class Cifar10Dir:
    """The CIFAR-10 python batches (cifar-10-batches-py: data_batch_1..5, test_batch as the held-out split)."""

    name: ClassVar[str] = "cifar10"

    @staticmethod
    def recognises(path: str | None) -> bool:
        return path is not None and Path(path).is_dir() and (Path(path) / CIFAR_TRAIN[0]).exists()

    @staticmethod
    def load(path: str | None, cfg: DataConfig) -> Dataset:
        return from_splits(str(path), read_cifar10_dir(Path(str(path))), cfg.heldout_fraction)


def from_splits(
    path: str, splits: tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None], heldout_fraction: float
) -> Dataset:
    """The image data set of a directory reader's (train images, labels, test images or None, labels or None)."""
    x, y, xt, yt = splits
    if len(x) < (1 if xt is not None else 2):
        raise DataError(f"{path}: too few training images ({len(x)})")
    return image_dataset(path, x, y, xt, yt, heldout_fraction)


def find(d: Path, stem: str, suffix: str) -> Path | None:
    """d/<stem>-<suffix> or d/<stem>.<suffix> (both spellings circulate), gzipped or not; None if absent."""
    for sep in ("-", "."):
        for gz in ("", ".gz"):
            p = d / f"{stem}{sep}{suffix}{gz}"
            if p.is_file():
                return p
    return None


def read_mnist_dir(d: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """(train images, labels, test images, labels) of an MNIST-layout directory; the test pair is None if absent."""
    pairs = []
    for split in ("train", "t10k"):
        images, labels = find(d, f"{split}-images", "idx3-ubyte"), find(d, f"{split}-labels", "idx1-ubyte")
        if images is None and labels is None and split == "t10k":
            return (*pairs[0], None, None)
        if images is None or labels is None:
            missing = f"{split}-images-idx3-ubyte" if images is None else f"{split}-labels-idx1-ubyte"
            raise DataError(f"{d}: {missing}[.gz] is missing (the MNIST layout has both images and labels)")
        x, y = read_idx(images), read_idx(labels)
        if x.ndim != 3 or y.ndim != 1:
            raise DataError(f"{images}: expected [N, H, W] images and [N] labels, found {x.shape} and {y.shape}")
        check_images(str(images), x, y.astype(np.int64))
        pairs.append((x, y.astype(np.int64)))
    return (*pairs[0], *pairs[1])


def read_idx(path: Path) -> np.ndarray:
    """One IDX file (gzipped or not): magic 0 0 <type> <ndim>, ndim big-endian uint32 sizes, then the data."""
    try:
        with open_regular(path) as f:  # a FIFO would block the read forever
            head = f.read(2)
        opener = gzip.open if head == b"\x1f\x8b" else open
        with opener(path, "rb") as f:
            magic = f.read(4)
            if len(magic) < 4 or magic[:2] != b"\0\0" or magic[2] not in IDX_TYPES or magic[3] == 0:
                raise DataError(f"{path}: not an IDX file (bad magic number {magic.hex()}); expected MNIST-format data")
            dims = np.frombuffer(f.read(4 * magic[3]), dtype=">u4")
            dtype = np.dtype(IDX_TYPES[magic[2]])
            if len(dims) != magic[3]:
                raise DataError(f"{path}: truncated IDX header")
            size = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
            if size > MAX_IDX_BYTES:
                raise DataError(f"{path}: the IDX header claims {size} bytes of data; refusing (corrupt file?)")
            raw = f.read(size + 1)
    except OSError as e:  # gzip.BadGzipFile too
        raise DataError(f"{path}: cannot read as an IDX file ({e.strerror or e})") from None
    except EOFError as e:
        raise DataError(f"{path}: cannot read as an IDX file ({e})") from None
    if len(raw) != size:
        raise DataError(
            f"{path}: the IDX header says {size} bytes of data, the file has "
            f"{'more' if len(raw) > size else len(raw)}; truncated or corrupt"
        )
    return np.frombuffer(raw, dtype=dtype).reshape(tuple(int(n) for n in dims))


class _ArraysOnly(pickle.Unpickler):
    """An unpickler that builds numpy arrays, lists, dicts and bytes, and refuses every other global."""

    def find_class(self, module: str, name: str) -> type:
        if (module, name) not in CIFAR_GLOBALS:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a CIFAR batch")
        return super().find_class(module, name)


def read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(x uint8 [N, 3, 32, 32], y [N]) of one CIFAR-10 python batch file (a pickled dict: b'data', b'labels')."""
    try:
        with open_regular(path) as f:  # a FIFO would block the read forever
            batch = _ArraysOnly(f, encoding="bytes").load()
    except MemoryError:  # a length field the unpickler tried to allocate before reading
        raise DataError(
            f"{path}: cannot read as a CIFAR-10 python batch (it declares an object too large to allocate; "
            "corrupt or hostile)"
        ) from None
    except OSError as e:  # its strerror, without the errno and the path said already
        raise DataError(f"{path}: cannot read as a CIFAR-10 python batch ({e.strerror or e})") from None
    except (EOFError, pickle.UnpicklingError, ValueError, TypeError, AttributeError, IndexError) as e:
        raise DataError(f"{path}: cannot read as a CIFAR-10 python batch ({e})") from None
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        raise DataError(f"{path}: not a CIFAR-10 batch (expected a dict with b'data' and b'labels')")
    x, y = np.asarray(batch[b"data"]), np.asarray(batch[b"labels"])
    if x.ndim != 2 or x.shape[1] != 3 * 32 * 32 or x.dtype != np.uint8:
        raise DataError(f"{path}: data must be uint8 [N, 3072], found {x.dtype} {x.shape}")
    x = x.reshape(-1, 3, 32, 32)
    check_images(str(path), x, y)
    return x, y.astype(np.int64)


def read_cifar10_dir(d: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """The data_batch_N files present (in order) as train, test_batch (if present) as held-out."""
    batches = [read_cifar_batch(d / name) for name in CIFAR_TRAIN if (d / name).exists()]
    x, y = np.concatenate([b[0] for b in batches]), np.concatenate([b[1] for b in batches])
    if (d / "test_batch").exists():
        return (x, y, *read_cifar_batch(d / "test_batch"))
    return x, y, None, None


TORCHVISION_PREFIX = "torchvision:"
# torchvision data sets whose arrays sit in memory once built: (train kwargs, test kwargs, labels attribute).
TORCHVISION_SETS = {
    "MNIST": ({"train": True}, {"train": False}, "targets"),
    "FashionMNIST": ({"train": True}, {"train": False}, "targets"),
    "KMNIST": ({"train": True}, {"train": False}, "targets"),
    "CIFAR10": ({"train": True}, {"train": False}, "targets"),
    "CIFAR100": ({"train": True}, {"train": False}, "targets"),
    "SVHN": ({"split": "train"}, {"split": "test"}, "labels"),
}


class TorchvisionSet:
    """`torchvision:NAME:ROOT`: a torchvision data set (MNIST, CIFAR10, ...) already under ROOT, never downloaded; its
    test split is the held-out split."""

    name: ClassVar[str] = "torchvision"

    @staticmethod
    def recognises(path: str | None) -> bool:
        return path is not None and path.startswith(TORCHVISION_PREFIX)

    @staticmethod
    def load(path: str | None, cfg: DataConfig) -> Dataset:
        return load_torchvision(str(path), cfg.heldout_fraction)


def load_torchvision(spec: str, heldout_fraction: float) -> Dataset:
    """`torchvision:NAME:ROOT`: the torchvision data set NAME (MNIST, CIFAR10, ...) already under ROOT, never
    downloaded; its test split is the held-out split. heldout_fraction is unused (every supported set has a test
    split)."""
    name, sep, root = spec.removeprefix(TORCHVISION_PREFIX).partition(":")
    if not sep or not root:
        raise DataError(f"{spec}: expected torchvision:NAME:ROOT, e.g. torchvision:MNIST:/data/torchvision")
    if name not in TORCHVISION_SETS:
        supported = ", ".join(sorted(TORCHVISION_SETS))
        raise DataError(f"{spec}: torchvision data set {name!r} is not supported; supported: {supported}")
    try:
        from torchvision import datasets
    except ImportError:
        raise DataError(f"{spec}: torchvision is not installed (pip install torchvision), or point --data at the files")
    if not Path(root).is_dir():
        raise DataError(f"{spec}: the root {root} is not a directory")
    train_kw, test_kw, labels = TORCHVISION_SETS[name]
    splits = []
    for kw in (train_kw, test_kw):
        try:
            ds = getattr(datasets, name)(root, download=False, **kw)
        except (RuntimeError, OSError, ValueError) as e:  # torchvision's "Dataset not found", a corrupt file
            raise DataError(f"{spec}: {name} is not readable under {root} ({e}); trainer2 never downloads") from None
        x, y = np.asarray(ds.data), np.asarray(getattr(ds, labels), dtype=np.int64)
        if name.startswith("CIFAR"):  # stored [N, H, W, C]
            x = x.transpose(0, 3, 1, 2)
        check_images(f"{spec} ({kw})", x, y)
        splits.append((x, y))
    (x, y), (xt, yt) = splits
    return image_dataset(spec, x, y, xt, yt, heldout_fraction)
