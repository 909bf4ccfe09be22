"""The command line's argument parser: a mistake is one line on stderr naming the nearest flag or command, exit 2.

argparse's own error prints the whole usage (some 40 lines for the trainer's ~80 flags) above the one line that
matters, and never says which flag was meant; every parser trainer2 builds is a `Parser` instead.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Iterable
from typing import Any, NoReturn

UNRECOGNIZED = "unrecognized arguments: "  # argparse's wording, which scripts and tests match on


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line with a 'did you mean' for a mistyped flag or command; --help is
    argparse's. `commands`: the subcommands a first word could have meant (the trainer's top-level parser)."""

    def __init__(self, *args: Any, commands: Iterable[str] = (), **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)  # --max_w 3 must not quietly mean --max_windows 3
        super().__init__(*args, **kwargs)
        self.commands = tuple(commands)

    def error(self, message: str) -> NoReturn:
        """Print `PROG: error: MESSAGE` with a suggestion, no usage, and exit 2 (argparse's status for a bad call)."""
        self.exit(2, f"{self.prog}: error: {self.explain(message)}\n")

    def explain(self, message: str) -> str:
        """The error line after `PROG: error: `: an unknown flag or command gets the nearest real one."""
        if not message.startswith(UNRECOGNIZED):
            return f"{message} (see {self.prog} --help)"
        words = message[len(UNRECOGNIZED) :].split(" ")
        command = self.nearest_command(words[0])
        if command:  # `evalute --checkpoint x`: the flags after it are the command's, so name only the command
            return (
                f"unknown command {words[0]}; did you mean {command}? "
                f"(a command comes first: {self.prog} {command} --help)"
            )
        meant = {w: self.nearest_flag(w) for w in words if w.startswith("-")}
        meant = {w: m for w, m in meant.items() if m}
        if len(meant) == 1:
            hint = f"; did you mean {next(iter(meant.values()))}?"
        elif meant:
            hint = "; did you mean " + ", ".join(f"{m} (for {w})" for w, m in meant.items()) + "?"
        else:
            hint = ""
        return f"{message}{hint} ({self.prog} --help lists every flag)"

    def nearest_command(self, word: str) -> str | None:
        """The subcommand a non-flag word was probably meant to be (`evalute` -> evaluate), if any is close."""
        if word.startswith("-") or not self.commands:
            return None
        close = difflib.get_close_matches(word, self.commands, n=1)
        return close[0] if close else None

    def nearest_flag(self, word: str) -> str | None:
        """The option a mistyped flag was probably meant to be: the one it abbreviates, else the closest spelling."""
        flag = word.split("=", 1)[0]  # --batch=32
        options = [o for o in self._option_string_actions if o.startswith("--")]
        starting = [o for o in options if o.startswith(flag)]
        if len(starting) == 1:
            return starting[0]
        close = difflib.get_close_matches(flag, starting or options, n=1)
        return close[0] if close else None
