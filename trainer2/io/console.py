"""The run's lines on stdout, which may go away mid-run (`python main.py | head`, a closed terminal): the run goes on,
and still writes its checkpoint and summary.json."""

from __future__ import annotations

import os
import sys


def say(msg: str) -> None:
    """print(msg) and flush; once stdout is a broken pipe, it and every later line go to /dev/null instead."""
    try:
        print(msg, flush=True)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # also the interpreter's last flush at exit, which would fail again
        os.close(devnull)
