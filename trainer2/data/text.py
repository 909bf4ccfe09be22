"""Character text: the built-in corpus (the CPython reference documentation, nothing downloaded) and UTF-8 text files.

A text file is tokenized once into a memory-mapped token cache (trainer2/data/token_cache.py) unless token_cache is
"off"; the first (1 - heldout_fraction) of the characters train, the rest are held out.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import torch

from trainer2.data.dataset import DataError, Dataset, check_file
from trainer2.data.load import DataConfig
from trainer2.data.token_cache import cached_text_dataset
from trainer2.data.tokens import read_text_chunks, refuse_binary, text_dataset
from trainer2.io.memory import available_bytes

BUILTIN_SOURCE = "builtin:pydoc_data.topics"


def builtin_text() -> str:
    """The CPython pydoc topics (~465k characters), joined in sorted-key order so it is reproducible."""
    from pydoc_data.topics import topics

    return "\n".join(topics[key] for key in sorted(topics))


class BuiltinCorpus:
    """No --data: the Python reference documentation that ships inside CPython (pydoc_data.topics)."""

    name: ClassVar[str] = "builtin"

    @staticmethod
    def recognises(path: str | None) -> bool:
        return path is None

    @staticmethod
    def load(path: str | None, cfg: DataConfig) -> Dataset:
        text = builtin_text()
        return text_dataset(lambda: iter([text]), BUILTIN_SOURCE, cfg.context_len, cfg.heldout_fraction)


class TextFile:
    """A UTF-8 text file (any path that is not a directory and no other format's), served from its token cache."""

    name: ClassVar[str] = "text"

    @staticmethod
    def recognises(path: str | None) -> bool:
        return path is not None and not Path(path).is_dir()

    @staticmethod
    def load(path: str | None, cfg: DataConfig) -> Dataset:
        if path is None:
            raise DataError("the text format needs a file: pass --data FILE")
        if cfg.token_cache != "off":
            return cached_text_dataset(path, cfg.token_cache, cfg.context_len, cfg.heldout_fraction)
        sniff_text(path, check_file(path, "a UTF-8 text file or a .npz feature file"))
        return text_dataset(lambda: read_text_chunks(path), path, cfg.context_len, cfg.heldout_fraction)


def sniff_text(path: str, size: int) -> None:
    """Refuse before reading it all a text file that is larger than the memory free for its tokens, or that holds
    NUL bytes in its first chunk (a binary file, or a file of zeros, would train as a meaningless corpus)."""
    free = available_bytes(torch.device("cpu"))
    if free is not None and size > free:  # one token of >= 1 byte per character, at most one character per byte
        raise DataError(
            f"{path}: {size / 2**30:.1f} GiB of text would need about as much memory for its tokens, but "
            f"{free / 2**30:.1f} GiB is free; use a smaller file"
        )
    refuse_binary(path)
