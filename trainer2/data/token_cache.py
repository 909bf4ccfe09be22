"""Text corpora as memory-mapped token files: tokenize once in a streaming pass, map the cache at every later start.

A cache file holds a header (source fingerprint: size, mtime, a hash of sampled blocks; vocabulary; token type and
count; a hash of the tokens) and the tokens, 1 or 2 bytes each (4 above 32,768 symbols), from a page boundary.
It lives in the user cache directory ($XDG_CACHE_HOME/trainer2/tokens, default ~/.cache/trainer2/tokens), never in
the user's data folder; `token_cache` may also name a directory, or be "off" (tokenize into memory at every start,
as before). A file's cache is named for its absolute path, so an edited file replaces its cache rather than leaving
old ones behind; whether it holds this file's tokens is judged by content. A cache is never trusted: a bad magic
or header hash, a wrong length or payload sample, or a source whose size, mtime or sampled hash differs gets it
rebuilt (or refused where it cannot be rewritten). Creation takes a lock beside the cache, writes a temporary file
and renames it into place, so concurrent processes (a torchrun job) tokenize once and all map the same file.
"""

from __future__ import annotations

import codecs
import fcntl
import hashlib
import json
import os
import struct
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from trainer2.data.dataset import DataError, Dataset, check_file
from trainer2.data.tokens import MAX_CODEPOINT, codepoints, refuse_binary, text_split, text_split_sizes, token_dtype
from trainer2.io.safeio import open_regular

MAGIC = b"TRAINER2-TOKENS\0"
VERSION = 1
SUFFIX = ".trainer2-tokens"
PREFIX = struct.Struct("<16sIQI32s")  # magic, version, header offset and length, sha256 of the header
ALIGN = 4096  # the tokens start on the first page boundary after the prefix
SAMPLES = 64  # blocks hashed for a fingerprint, spread evenly over the file
SAMPLE_BYTES = 1 << 16
PROGRESS_BYTES = 64 << 20  # a progress bar from this source size on
CHUNK = 1 << 18  # bytes read at a time: numpy indexes with int64 (8 bytes a character), and small chunks stay in cache


def user_cache_dir() -> Path:
    """$XDG_CACHE_HOME/trainer2/tokens, else ~/.cache/trainer2/tokens."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trainer2" / "tokens"


def sampled_hash(f, size: int) -> str:
    """sha256 over SAMPLES blocks of SAMPLE_BYTES spread evenly over a file of `size` bytes (the whole of a small
    file): O(1) reading, catches a changed or swapped file of the same size and mtime in practice."""
    h = hashlib.sha256(str(size).encode())
    if size <= SAMPLES * SAMPLE_BYTES:
        f.seek(0)
        h.update(f.read(size))
        return h.hexdigest()
    for k in range(SAMPLES):
        f.seek((size - SAMPLE_BYTES) * k // (SAMPLES - 1))
        h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def source_fingerprint(path: Path) -> dict[str, Any]:
    """The source's size (bytes), mtime (ns) and sampled hash; an unreadable source is a DataError naming it."""
    try:
        st = path.stat()
        with open(path, "rb") as f:
            return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sampled_sha256": sampled_hash(f, st.st_size)}
    except OSError as e:  # not the cache's fault: no fallback to another cache directory would help
        raise DataError(f"{path}: cannot read file ({e.strerror})") from None


@dataclass
class CacheFile:
    """A validated cache: its header and where the tokens are."""

    path: Path
    header: dict[str, Any]
    offset: int


def read_cache(path: Path, source: dict[str, Any]) -> CacheFile | None:
    """The cache at `path` if it is whole, ours and of this `source` fingerprint; None when absent; a DataError
    saying why when it exists but must not be used (corrupt, foreign, stale)."""
    try:
        f = open_regular(path)  # a FIFO would block the read forever
    except FileNotFoundError:
        return None
    except OSError as e:
        raise DataError(f"{path}: cannot read token cache ({e.strerror})") from None
    with f:
        raw = f.read(PREFIX.size)
        if len(raw) < PREFIX.size:
            raise DataError(f"{path}: token cache is truncated")
        magic, version, at, length, digest = PREFIX.unpack(raw)
        if magic != MAGIC:
            raise DataError(f"{path}: not a trainer2 token cache (bad magic)")
        if version != VERSION:
            raise DataError(f"{path}: token cache version {version}; this trainer reads version {VERSION}")
        size = os.fstat(f.fileno()).st_size
        if at + length != size:
            raise DataError(f"{path}: token cache is {size} bytes, its prefix says {at + length} (truncated?)")
        f.seek(at)
        blob = f.read(length)
        if hashlib.sha256(blob).digest() != digest:
            raise DataError(f"{path}: token cache header is corrupt (hash mismatch)")
        header = json.loads(blob)
        if at != ALIGN + header["length"] * np.dtype(header["dtype"]).itemsize:
            raise DataError(f"{path}: token cache header does not match its size")
        if header["source"] != source:
            raise DataError(
                f"{path}: token cache is stale: made from a source with {header['source']}, the source now has {source}"
            )
        if sampled_hash(_Window(f, ALIGN), at - ALIGN) != header["tokens_sampled_sha256"]:
            raise DataError(f"{path}: token cache is corrupt (the tokens do not match their hash)")
    return CacheFile(path, header, ALIGN)


class _Window:
    """A file seen from `offset` on (seek and read only), so sampled_hash can hash the tokens alone."""

    def __init__(self, f, offset: int) -> None:
        self.f, self.offset = f, offset

    def seek(self, pos: int) -> None:
        self.f.seek(self.offset + pos)

    def read(self, n: int) -> bytes:
        return self.f.read(n)


def map_tokens(cache: CacheFile) -> torch.Tensor:
    """The cache's tokens [T] as a tensor over a copy-on-write map of the file: pages load on use and are shared
    with every other process mapping it (nothing ever writes to them)."""
    h = cache.header
    arr = np.memmap(cache.path, dtype=np.dtype(h["dtype"]), mode="c", offset=cache.offset, shape=(h["length"],))
    return torch.from_numpy(arr)


def _code_units(text: str) -> np.ndarray:
    """str -> its code points as uint16 [T] when all are below 0x10000 (UTF-16 has no surrogate pairs then, and
    encodes 4x faster than UTF-32), else uint32 [T]."""
    units = text.encode("utf-16-le")
    if len(units) == 2 * len(text):
        return np.frombuffer(units, dtype=np.uint16)
    return codepoints(text)


def codepoint_chunks(path: Path) -> Iterator[np.ndarray]:
    """The file's characters as code point arrays, CHUNK bytes at a time: an all-ASCII chunk is its own bytes (uint8,
    no decoding), any other is UTF-8-decoded (uint16, or uint32 with characters above 0xFFFF); a DataError names the
    path."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0  # bytes of the file read so far
    try:
        with open(path, "rb") as f:
            while True:
                raw = f.read(CHUNK)
                b = np.frombuffer(raw, dtype=np.uint8)
                pending = len(decoder.getstate()[0])  # bytes of a character split by the previous chunk
                if raw and not pending and int(b.max()) < 0x80:
                    yield b
                else:
                    try:
                        text = decoder.decode(raw, final=not raw)
                    except UnicodeDecodeError as e:
                        raise DataError(
                            f"{path}: not valid UTF-8 (bad byte at offset {offset - pending + e.start}); "
                            "expected a UTF-8 text file"
                        ) from None
                    if text:
                        yield _code_units(text)
                offset += len(raw)
                if not raw:
                    return
    except OSError as e:
        raise DataError(f"{path}: cannot read file ({e.strerror})") from e


def write_cache(
    path: Path, source_path: Path, source: dict[str, Any], context_len: int, heldout_fraction: float
) -> None:
    """Tokenize `source_path` in two streaming passes (vocabulary, then tokens written in order) into a temporary file
    beside `path`, then rename it into place. Layout: prefix | tokens from offset ALIGN | header (JSON). The ids and
    their type are those of the in-memory tokenizer (trainer2.data.tokens.text_dataset), so the data fingerprint of a
    checkpoint does not change."""
    name = str(source_path)
    seen = np.zeros(MAX_CODEPOINT + 1, dtype=bool)
    length = 0
    with _bar(source_path, source["size"], "vocabulary") as bar:
        for cp in codepoint_chunks(source_path):
            if cp.dtype == np.uint32:
                seen[cp] = True
            else:  # a histogram over the 256 or 65,536 values of the type: faster than scattering into `seen`
                width = np.iinfo(cp.dtype).max + 1
                seen[:width] |= np.bincount(cp, minlength=width) > 0
            length += len(cp)
            bar.update(len(cp))
    if not length:
        raise DataError(f"{name}: file is empty; expected UTF-8 text")
    text_split_sizes(length, name, context_len, heldout_fraction)  # refuse a short text before tokenizing it
    present = np.flatnonzero(seen)
    dtype = np.dtype(str(token_dtype(len(present))).removeprefix("torch."))
    to_id = np.zeros(MAX_CODEPOINT + 1, dtype=dtype)
    to_id[present] = np.arange(len(present))
    tables = {
        np.dtype(np.uint8): to_id[:256].copy(),
        np.dtype(np.uint16): to_id[:65536].copy(),
        np.dtype(np.uint32): to_id,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "r+b") as f:
            f.write(bytes(ALIGN))  # the prefix goes here last
            h, written = hashlib.sha256(), 0
            with _bar(source_path, source["size"], "tokens") as bar:
                for cp in codepoint_chunks(source_path):
                    ids = np.take(tables[cp.dtype], cp)  # the smallest table the chunk's type can index
                    h.update(ids)
                    f.write(ids)
                    written += len(ids)
                    bar.update(len(cp))
            if written != length:
                raise DataError(f"{name}: the file changed while it was being read; try again")
            nbytes = length * dtype.itemsize
            f.flush()
            header = {
                "source": source,
                "vocab": present.tolist(),
                "dtype": dtype.str,
                "length": length,
                "tokens_sha256": h.hexdigest(),
                "tokens_sampled_sha256": sampled_hash(_Window(f, ALIGN), nbytes),
            }
            blob = json.dumps(header).encode()
            f.seek(ALIGN + nbytes)
            f.write(blob)
            f.seek(0)
            f.write(PREFIX.pack(MAGIC, VERSION, ALIGN + nbytes, len(blob), hashlib.sha256(blob).digest()))
            f.flush()
            os.fsync(f.fileno())
        if source_fingerprint(source_path) != source:
            raise DataError(f"{name}: the file changed while it was being read; try again")
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the cache from other users of the data
        os.replace(tmp, path)  # whole or not at all: a reader sees the old file, no file, or the new one
    finally:
        tmp.unlink(missing_ok=True)


def _bar(path: Path, size: int, what: str) -> tqdm:
    """A progress bar on stderr (characters, against the size in bytes) for a file of PROGRESS_BYTES or more."""
    return tqdm(
        total=size,
        unit="B",
        unit_scale=True,
        desc=f"tokenizing {path.name} ({what})",
        file=sys.stderr,
        disable=size < PROGRESS_BYTES,
        mininterval=1.0,
    )


def cache_path(source: Path, where: str) -> Path:
    """The cache file of `source` in directory `where` ("auto": the user cache directory), named for the source's
    absolute path (two files of one name do not share a cache; the header says whether it is of this content)."""
    folder = user_cache_dir() if where == "auto" else Path(where).expanduser()
    tag = hashlib.sha256(str(source.resolve()).encode()).hexdigest()[:16]
    return folder / f"{source.name}.{tag}{SUFFIX}"


def open_cache(source: Path, where: str, context_len: int, heldout_fraction: float) -> CacheFile:
    """A valid cache of `source` in `where`, made (under a lock, once across processes) when missing or bad;
    an OSError when the directory cannot be written."""
    path = cache_path(source, where)
    fp = source_fingerprint(source)
    try:
        found = read_cache(path, fp)
        if found is not None:
            return found
    except DataError:
        pass  # rebuilt below (under the lock, after looking again)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # another process may be making it: wait, then look again
        try:
            found = read_cache(path, fp)
        except DataError:
            found = None
        if found is None:
            write_cache(path, source, fp, context_len, heldout_fraction)
            found = read_cache(path, fp)
    if found is None:
        raise DataError(f"{path}: token cache vanished right after it was written")
    return found


def cached_text_dataset(path: str, where: str, context_len: int, heldout_fraction: float) -> Dataset:
    """The text data set of file `path` over its mapped token cache (see the module docstring for `where`)."""
    check_file(path, "a UTF-8 text file or a .npz feature file")
    refuse_binary(path)  # before a pass over it: NUL bytes mean a binary file (its tokens need no memory: mapped)
    source = Path(path)
    try:
        cache = open_cache(source, where, context_len, heldout_fraction)
    except OSError as e:  # read-only or full
        raise DataError(
            f"{path}: cannot write a token cache ({cache_path(source, where).parent}: {e.strerror or e}); pass "
            "--token_cache DIR (a writable directory) or --token_cache off"
        ) from None
    vocab = [chr(c) for c in cache.header["vocab"]]
    data = text_split(map_tokens(cache), vocab, path, context_len, heldout_fraction)
    data.digest = cache.header["tokens_sha256"]
    return data
