"""The data section of a config, and loading a data set by its format: one reader per format, found by name.

A data format is a class with `recognises(path) -> bool` and `load(path, cfg: DataConfig) -> Dataset`. With
`data_format: auto` the first built-in that recognises the path reads it (the built-in corpus, torchvision:NAME:ROOT,
.npz, an MNIST or a CIFAR-10 directory, .csv, else a text file); a name picks one, also a dotted path to your own.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Protocol

from pydantic import Field, field_validator

from trainer2.components import builtin_names, resolve
from trainer2.data.dataset import DATA_FORMATS, DataError, Dataset
from trainer2.section import Section


class DataConfig(Section):
    """Where the data comes from and how it is split and shown to the machine."""

    data: str | None = Field(
        None,
        description=(
            "UTF-8 text file, .npz feature or image set, .csv table of numbers, MNIST IDX / CIFAR-10 batches "
            "directory, or torchvision:NAME:ROOT; none = built-in pydoc corpus."
        ),
    )
    data_format: str = Field(
        "auto",
        min_length=1,
        description="How --data is read: 'auto' (recognised by its path), a built-in format (builtin, torchvision, "
        "npz, mnist, cifar10, csv, text) or a dotted path module.Class to your own reader.",
    )
    label_column: str | None = Field(
        None,
        min_length=1,
        description="CSV data: the header name of the column of class labels; none = a column named label, y or "
        "target when there is one, else the last column.",
    )
    context_len: int = Field(8, ge=1, le=2**16, description="Characters of context per example (text data).")
    heldout_fraction: float = Field(0.1, gt=0.0, lt=1.0, description="Fraction of the data, by position, held out.")
    validation_fraction: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Fraction of the training data, by position (its end), set apart as a validation split; a run with "
        "one scores it (validation_*) instead of the held-out split, so settings are tuned without seeing a held-out "
        "figure (`evaluate` scores that when asked); 0 = none.",
    )
    augment_shift: int = Field(
        0,
        ge=0,
        le=8,
        description="Image data only: translate each training image by up to this many pixels in each direction "
        "(edge-padded), fresh draws every window; 0 = off. Held-out images are never moved.",
    )
    token_cache: str = Field(
        "auto",
        min_length=1,
        description="Where a text file's memory-mapped token cache lives: 'auto' ($XDG_CACHE_HOME/trainer2/tokens, "
        "default ~/.cache/trainer2/tokens; never beside the data), a directory, or 'off' (tokenize into memory at "
        "every start).",
    )

    @field_validator("data")
    @classmethod
    def _data(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():  # Path("") is the current directory
            raise ValueError("empty; expected a data file or directory (leave it out for the built-in corpus)")
        return v


class DataFormat(Protocol):
    """A reader of one format of data on disk."""

    name: ClassVar[str]  # its short name (the registry's; a user's reader may name itself anything)

    @staticmethod
    def recognises(path: str | None) -> bool:
        """Whether `path` (None: no --data given) is in this format, judged cheaply (a name, a few file names)."""

    @staticmethod
    def load(path: str | None, cfg: DataConfig) -> Dataset:
        """The data set at `path`; anything wrong with it is a DataError naming the file."""


def find_format(path: str | None, name: str) -> DataFormat:
    """The reader named `name`, or with "auto" the first built-in that recognises `path`."""
    if name != "auto":
        return resolve("data format", name)
    for builtin in builtin_names("data format"):
        reader = resolve("data format", builtin)
        if reader.recognises(path):
            return reader
    if path is not None and Path(path).is_dir():
        raise DataError(
            f"{path}: a directory, but neither MNIST IDX files (train-images-idx3-ubyte[.gz], ...) nor CIFAR-10 "
            f"python batches (data_batch_1, ..., test_batch); expected {DATA_FORMATS}"
        )
    raise DataError(f"{path}: no data format recognises it; name one with --data_format")


def load_data(cfg: DataConfig, data: Dataset | None = None) -> Dataset:
    """The data set cfg.data names, read by its format (cfg.data_format), or `data` (given in memory); with the end
    of its training split set apart for validation when cfg.validation_fraction > 0."""
    if data is None:
        reader = find_format(cfg.data, cfg.data_format)
        if cfg.data_format == "auto" and reader.name == "text" and cfg.data and not Path(cfg.data).exists():
            # text is only the fallback for a path no other format claims: a missing one may have meant any of them
            raise DataError(f"{cfg.data}: file does not exist; expected {DATA_FORMATS}")
        data = reader.load(cfg.data, cfg)
    if cfg.validation_fraction and data.validation is None:
        data = data.with_validation(cfg.validation_fraction)
    return data


def load_dataset(
    path: str | None, context_len: int = 8, heldout_fraction: float = 0.1, token_cache: str = "off"
) -> Dataset:
    """The data set at `path` (None: the built-in corpus), its format recognised from the path; text is tokenized into
    memory unless token_cache names where to cache it ("auto": the user cache directory)."""
    if not 0.0 < heldout_fraction < 1.0:
        raise DataError(f"{path or 'the built-in corpus'}: heldout_fraction must be in (0, 1), got {heldout_fraction}")
    given = {"data": path, "context_len": context_len, "heldout_fraction": heldout_fraction, "token_cache": token_cache}
    return load_data(DataConfig.model_construct(**{**DataConfig().model_dump(), **given}))  # the readers check them
