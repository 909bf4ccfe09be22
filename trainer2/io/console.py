"""The run's output streams, which may go away at any time (`python main.py | head`, a closed terminal or SSH
connection, stderr to /dev/full or closed): what cannot be written is dropped, and the run goes on to write its
checkpoints and summary.json; the exit status is the training's, never the terminal's."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, TextIO

Log = Callable[[str], None]
LogChoice = Log | Literal["quiet", "verbose"]  # what `trainer2.train(..., log=)` takes
WARNING = "warning:"  # how every warning of a run begins, so a quiet log can keep them


def silence(stream: TextIO | None) -> None:
    """Point `stream`'s file descriptor at /dev/null and drop what it holds buffered, so that later writes (also the
    interpreter's last flush at exit, which would fail again) succeed and go nowhere."""
    try:
        fd = stream.fileno()  # type: ignore[union-attr]
    except (AttributeError, OSError, ValueError):  # None, closed, or not backed by a descriptor (io.StringIO)
        return
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, fd)
    os.close(null)
    try:
        stream.flush()  # type: ignore[union-attr]
    except (OSError, ValueError):
        pass


def say(msg: str) -> None:
    """print(msg) and flush; once stdout fails, it and every later line go to /dev/null instead."""
    try:
        print(msg, flush=True)
    except (OSError, ValueError):  # a broken pipe, a full device, a closed descriptor
        silence(sys.stdout)


def warnings_only(log: Log) -> Log:
    """`log` for the lines that are warnings; the config, backends, checkpoints and notes are dropped."""

    def log_warnings(msg: str) -> None:
        if msg.startswith(WARNING):
            log(msg)

    return log_warnings


@dataclass(frozen=True)
class RunLog:
    """Where a run's lines go. notes: the resolved config, backends, checkpoints, notes and warnings; headline: the
    one-line start and end of a run (and how to continue a stopped one), or None where a callable log takes every
    line as it always has (the command line prints its own ending)."""

    notes: Log
    headline: Log | None

    @staticmethod
    def of(log: LogChoice) -> RunLog:
        """The lines `log` asks for: "quiet" the headline and warnings; "verbose" all; a callable every note, no
        headline."""
        if isinstance(log, str) and log in ("quiet", "verbose"):
            return RunLog(say if log == "verbose" else warnings_only(say), say)
        if callable(log):
            return RunLog(log, None)
        raise ValueError(
            f"log must be 'quiet', 'verbose' or a function taking each line (e.g. print or a_list.append), "
            f"got {log!r:.80}"
        )


class Dropping:
    """A text stream that writes through to `stream` until a write or flush fails, then silences it and drops
    everything after; None (a descriptor closed before Python started) drops from the start."""

    def __init__(self, stream: TextIO | None) -> None:
        self.stream, self.broken = stream, stream is None

    def write(self, text: str) -> int:
        if not self.broken:
            try:
                return self.stream.write(text)  # type: ignore[union-attr]
            except (OSError, ValueError):
                self.drop()
        return len(text)

    def flush(self) -> None:
        if not self.broken:
            try:
                self.stream.flush()  # type: ignore[union-attr]
            except (OSError, ValueError):
                self.drop()

    def isatty(self) -> bool:
        return not self.broken and self.stream.isatty()  # type: ignore[union-attr]

    def drop(self) -> None:
        self.broken = True
        silence(self.stream)

    def __getattr__(self, name: str) -> Any:  # encoding, fileno, ...: the stream's own
        if name == "stream":  # not set yet (a copy in the making): no recursion
            raise AttributeError(name)
        return getattr(self.stream, name)


def reopen_closed() -> None:
    """Open /dev/null on each of the descriptors 0, 1 and 2 that is closed (`2>&-`), so that no file the run opens
    takes its number and receives what is meant for the terminal."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)  # the lowest free number: fd itself unless a lower one is closed too
            if null != fd:
                os.dup2(null, fd)
                os.close(null)


@contextmanager
def guarded_streams() -> Iterator[None]:
    """While active, sys.stdout and sys.stderr are `Dropping` streams (progress bar, log lines, warnings, errors),
    flushed before they are put back; closed standard descriptors are reopened on /dev/null first."""
    reopen_closed()
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = Dropping(saved[0]), Dropping(saved[1])  # type: ignore[assignment]
    try:
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        sys.stdout, sys.stderr = saved
