"""A data set from arrays already in memory: numpy arrays or torch tensors, features [N, D] or images [N, (C,) H, W].

Checked like an .npz file's arrays and built the same way (images normalised per channel by the training split), so a
machine trained on arrays and one trained on the same arrays saved with numpy.savez see the same rows.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from trainer2.data.dataset import DataError, Dataset, check_arrays, feature_dataset
from trainer2.data.images import image_dataset

ARRAYS_SOURCE = "arrays"


def as_numpy(a: Any, name: str) -> np.ndarray:
    """A numpy view of a numpy array, torch tensor (moved to the CPU) or nested list; anything else is a DataError."""
    if isinstance(a, torch.Tensor):
        return a.detach().cpu().numpy()
    try:
        return np.asarray(a)
    except (ValueError, TypeError) as e:
        raise DataError(f"{ARRAYS_SOURCE}: {name} is not an array ({e})") from None


def from_arrays(
    x_train: Any,
    y_train: Any,
    x_test: Any = None,
    y_test: Any = None,
    *,
    heldout_fraction: float = 0.1,
    source: str = ARRAYS_SOURCE,
) -> Dataset:
    """A classification data set: x_train [N, D] features or [N, H, W] / [N, C, H, W] images with labels y_train [N]
    (0..K-1), and the held-out split x_test, y_test (else the last heldout_fraction of the training rows)."""
    if (x_test is None) != (y_test is None):
        raise DataError(f"{source}: give both x_test and y_test, or neither (then the last rows are held out)")
    if not 0.0 < heldout_fraction < 1.0:
        raise DataError(f"{source}: heldout_fraction must be in (0, 1), got {heldout_fraction}")
    x, y = as_numpy(x_train, "x_train"), as_numpy(y_train, "y_train")
    held = None if x_test is None else (as_numpy(x_test, "x_test"), as_numpy(y_test, "y_test"))
    check_arrays(f"{source} (train)", x, y) if held is None else check_labelled(source, x, y, *held)
    make = feature_dataset if x.ndim == 2 else image_dataset
    return make(source, x, y, *(held or (None, None)), heldout_fraction)


def check_labelled(source: str, x: np.ndarray, y: np.ndarray, x_test: np.ndarray, y_test: np.ndarray) -> None:
    """Both splits checked as arrays of their own, with the same row shape and labels 0..K-1 for K up to all rows."""
    for split, a, b in (("train", x, y), ("test", x_test, y_test)):
        check_arrays(f"{source} ({split})", a, b, min_rows=1, rows=len(y) + len(y_test))
    if x.shape[1:] != x_test.shape[1:]:
        raise DataError(f"{source}: x_train rows are {x.shape[1:]} but x_test rows are {x_test.shape[1:]}")
