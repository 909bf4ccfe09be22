"""Text corpora as memory-mapped token files: tokenize once in a streaming pass, map the cache at every later start.

A cache file holds a header (source fingerprint: size, mtime, a hash of sampled blocks; vocabulary; token type and
count; a hash of the tokens) and the tokens, 1 or 2 bytes each, at a page-aligned offset. It lives beside the data
(`<file>.trainer2-tokens`) or, where that directory is read-only, in the user cache directory; `token_cache` may
also name a directory, or be "off" (tokenize into memory at every start, as before). A cache is never trusted:
a bad magic or header hash, a wrong length or payload sample, or a source whose size, mtime or sampled hash
differs gets it rebuilt (or refused where it cannot be rewritten). Creation takes a lock beside the cache, writes
a temporary file and renames it into place, so concurrent processes (a torchrun job) tokenize once and all map
the same file.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import struct
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from trainer2.data import TEXT_CHUNK, Dataset, DataError, _check_file, _read_text_chunks, _text_dataset, load_dataset, text_split

MAGIC = b"TRAINER2-TOKENS\0"
VERSION = 1
SUFFIX = ".trainer2-tokens"
PREFIX = struct.Struct("<16sIQI32s")  # magic, version, header offset and length, sha256 of the header
ALIGN = 4096  # the tokens start on the first page boundary after the prefix
SAMPLES = 64  # blocks hashed for a fingerprint, spread evenly over the file
SAMPLE_BYTES = 1 << 16
PROGRESS_BYTES = 64 << 20  # a progress bar from this source size on


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
    """The source's size (bytes), mtime (ns) and sampled hash."""
    st = path.stat()
    with open(path, "rb") as f:
        return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sampled_sha256": sampled_hash(f, st.st_size)}


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
        f = open(path, "rb")
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
            raise DataError(f"{path}: token cache is stale: made from a source with {header['source']}, the source now "
                            f"has {source}")
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


def write_cache(path: Path, source_path: Path, source: dict[str, Any], context_len: int, heldout_fraction: float) -> None:
    """Tokenize `source_path` in a streaming pass into a temporary file beside `path`, then rename it into place.
    Layout: prefix | tokens from offset ALIGN | header (JSON), so the tokens are written once, where they stay."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "r+b") as f:
            mapped: list[np.memmap] = []

            def alloc(length: int, dtype: torch.dtype) -> torch.Tensor:
                np_dtype = np.dtype(str(dtype).removeprefix("torch."))
                f.truncate(ALIGN + length * np_dtype.itemsize)
                mapped.append(np.memmap(f, dtype=np_dtype, mode="r+", offset=ALIGN, shape=(length,)))
                return torch.from_numpy(mapped[-1])

            data = _text_dataset(_progress_chunks(source_path, source["size"]), str(source_path), context_len,
                                 heldout_fraction, alloc)
            tokens = mapped.pop()
            tokens.flush()
            nbytes = len(tokens) * tokens.dtype.itemsize
            header = {"source": source, "vocab": [ord(c) for c in data.vocab], "dtype": tokens.dtype.str,
                      "length": len(tokens), "tokens_sha256": _sha256(tokens),
                      "tokens_sampled_sha256": sampled_hash(_Window(f, ALIGN), nbytes)}
            del data, tokens
            blob = json.dumps(header).encode()
            f.seek(ALIGN + nbytes)
            f.write(blob)
            f.seek(0)
            f.write(PREFIX.pack(MAGIC, VERSION, ALIGN + nbytes, len(blob), hashlib.sha256(blob).digest()))
            f.flush()
            os.fsync(f.fileno())
        if source_fingerprint(source_path) != source:
            raise DataError(f"{source_path}: the file changed while it was being read; try again")
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the cache from other users of the data
        os.replace(tmp, path)  # whole or not at all: a reader sees the old file, no file, or the new one
    finally:
        tmp.unlink(missing_ok=True)


def _sha256(tokens: np.ndarray) -> str:
    """sha256 of the token bytes, in chunks (what checkpoint.data_fingerprint hashes of a text data set)."""
    h = hashlib.sha256()
    step = TEXT_CHUNK * 4
    for i in range(0, len(tokens), step):
        h.update(np.ascontiguousarray(tokens[i:i + step]))
    return h.hexdigest()


def _progress_chunks(path: Path, size: int):
    """_read_text_chunks for the tokenizer's two passes, with a progress bar on stderr for a large file."""
    def chunks():
        with tqdm(total=size, unit="B", unit_scale=True, desc=f"tokenizing {path.name}", file=sys.stderr,
                  disable=size < PROGRESS_BYTES, mininterval=1.0) as bar:
            for text in _read_text_chunks(str(path)):
                bar.update(len(text))  # characters: bytes for ASCII, a little less otherwise
                yield text

    return chunks


def cache_path(source: Path, where: str) -> Path:
    """The cache file of `source`: beside it ("auto"), or in directory `where` (named for the source's path)."""
    if where == "auto":
        return source.with_name(source.name + SUFFIX)
    tag = hashlib.sha256(str(source.resolve()).encode()).hexdigest()[:16]
    return Path(where).expanduser() / f"{source.name}.{tag}{SUFFIX}"


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
    _check_file(path, "a UTF-8 text file or a .npz feature file")
    source = Path(path)
    places = [where] if where != "auto" else ["auto", str(user_cache_dir())]
    errors = []
    for place in places:
        try:
            cache = open_cache(source, place, context_len, heldout_fraction)
        except OSError as e:  # read-only or full: try the next place
            errors.append(f"{cache_path(source, place).parent}: {e.strerror or e}")
            continue
        vocab = [chr(c) for c in cache.header["vocab"]]
        return text_split(map_tokens(cache), vocab, path, context_len, heldout_fraction)
    raise DataError(f"{path}: cannot write a token cache ({'; '.join(errors)}); pass --token_cache DIR (a writable "
                    "directory) or --token_cache off")


def load_text_or_features(path: str | None, context_len: int, heldout_fraction: float, token_cache: str) -> Dataset:
    """data.load_dataset, with text files served from their token cache unless token_cache is "off"."""
    if path is None or path.endswith(".npz") or token_cache == "off":
        return load_dataset(path, context_len, heldout_fraction)
    return cached_text_dataset(path, token_cache, context_len, heldout_fraction)
