"""Writes that never go through a symbolic link the run did not make: a link planted in a run directory (as
.lock, a temporary file, config.yaml) would otherwise make the run truncate or rewrite the file it points to. And
reads that open only regular files: a FIFO would block the read forever, a device (/dev/zero) never end it."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # POSIX; elsewhere links are not checked


def link_refused(path: Path | str) -> OSError:
    """The error for a symbolic link where the run writes a file of its own."""
    return OSError(
        errno.ELOOP, "is a symbolic link; a run writes only files it made itself (remove the link)", str(path)
    )


def refuse_links(*paths: Path) -> None:
    """Refuse a symbolic link at any of `paths` (a directory or file a run is about to write into or over)."""
    for path in paths:
        if path.is_symlink():
            raise link_refused(path)


def nofollow_open(path: str, flags: int) -> int:
    """An `opener` for open(): the file descriptor, refusing a symbolic link as the last component, and anything that
    is no regular file (opened non-blocking, so a FIFO cannot hold the run)."""
    try:
        fd = os.open(path, flags | NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise link_refused(path) from None
        if e.errno == errno.ENXIO:  # a FIFO nobody reads
            raise OSError(errno.EINVAL, "is not a regular file (a FIFO)", str(path)) from None
        raise
    kind = not_regular(os.fstat(fd).st_mode)
    if kind is not None:
        os.close(fd)
        raise OSError(errno.EINVAL, f"is not a regular file ({kind})", str(path))
    return fd


def write_replace(path: Path, data: bytes) -> None:
    """Replace `path` by a file holding `data`, whole or not at all: a fresh temporary file beside it (a leftover
    one, or a link by that name, is removed first, never followed), fsync, rename over `path`. A link at `path`
    is refused."""
    refuse_links(path)
    tmp = path.parent / f".{path.name}.tmp"
    if os.path.lexists(tmp):
        os.unlink(tmp)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as e:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise OSError(e.errno, e.strerror, str(path)) from None


def not_regular(mode: int) -> str | None:
    """What a file of this st_mode is when it is no regular file ('a directory', 'a FIFO', ...); None for a regular
    file."""
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "a directory"
    return "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"


def open_regular(path: Path | str) -> BinaryIO:
    """`path` opened for binary reading if it is a regular file; anything else is refused without being opened, as an
    OSError whose strerror says what it is ('is not a regular file (a FIFO)')."""
    kind = not_regular(os.stat(path).st_mode)
    if kind is None:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO swapped in since the stat must not block either
        kind = not_regular(os.fstat(fd).st_mode)
        if kind is None:
            return os.fdopen(fd, "rb")
        os.close(fd)
    raise OSError(errno.EINVAL, f"is not a regular file ({kind})", str(path))
