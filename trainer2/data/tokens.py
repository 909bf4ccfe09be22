"""Characters to token ids: streaming UTF-8 decoding, the vocabulary, and the train / held-out split of a token stream.

Shared by the text readers (trainer2/data/text.py) and the memory-mapped token cache (token_cache.py).
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Iterator

import numpy as np
import torch

from trainer2.data.dataset import DataError, Dataset

TEXT_CHUNK = 1 << 22  # bytes of a text file decoded at a time
MAX_CODEPOINT = 0x10FFFF


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


def read_text_chunks(path: str) -> Iterator[str]:
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


def codepoints(text: str) -> np.ndarray:
    """str of length T -> uint32 [T] of its Unicode code points."""
    return np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)


def token_dtype(vocab_size: int) -> torch.dtype:
    """The smallest integer type that holds ids 0..vocab_size-1: tokens cost 1 byte each for <= 256 symbols."""
    if vocab_size <= 256:
        return torch.uint8
    return torch.int16 if vocab_size <= 2**15 else torch.int32


def text_dataset(
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
        seen[codepoints(text)] = True
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
        np.take(to_id, codepoints(text), out=out[pos:end], mode="clip")  # "clip" never clips here; it skips a buffer
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
