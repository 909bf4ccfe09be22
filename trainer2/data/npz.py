"""The .npz format: arrays x ([N, D] feature rows, or [N, H, W] / [N, C, H, W] images) and y ([N] class labels).

Checked from the zip directory and the .npy headers before anything is loaded (a few hundred compressed bytes can
expand into gigabytes); the last heldout_fraction of the rows is held out, by position, so shuffle ordered rows first.
"""

from __future__ import annotations

import pickle
import zipfile
from typing import ClassVar

import numpy as np
import torch

from trainer2.data.dataset import DataError, Dataset, check_arrays, check_file, feature_dataset
from trainer2.data.images import image_dataset
from trainer2.data.load import DataConfig
from trainer2.io.memory import available_bytes


class NpzFile:
    """A numpy .npz archive with arrays 'x' and 'y' (numpy.savez)."""

    name: ClassVar[str] = "npz"

    @staticmethod
    def recognises(path: str | None) -> bool:
        return path is not None and path.endswith(".npz")

    @staticmethod
    def load(path: str | None, cfg: DataConfig) -> Dataset:
        if path is None:
            raise DataError("the npz format needs a file: pass --data FILE.npz")
        x, y = read_npz(path)
        if x.ndim > 2:
            return image_dataset(path, x, y, None, None, cfg.heldout_fraction)
        return feature_dataset(path, x, y, None, None, cfg.heldout_fraction)


def check_npz_sizes(path: str) -> None:
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


def read_npz(path: str) -> tuple[np.ndarray, np.ndarray]:
    """Validated (x [N, D] float or int, y [N] int >= 0) from an .npz.

    Every problem becomes a DataError naming the path."""
    check_file(path, "an .npz feature file with arrays 'x' and 'y'")
    check_npz_sizes(path)
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
    check_arrays(path, x, y)
    return x, y
