"""The README and docs/ cannot drift from the code: every trainer command they show parses with the real command
line (and its config validates), every relative link resolves, and the README stays a five-minute read."""

from __future__ import annotations

import argparse
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from trainer2 import cli
from trainer2.config import ConfigError, build_config
from trainer2.flags import config_layers

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MAX_README_BYTES = 15_000
PYTHON = {"python", "python3"}
CONFIG_PROGS = {"trainer2", "trainer2 bench"}  # parsers whose namespace layers into a TrainConfig


@dataclass(frozen=True)
class Command:
    """One trainer invocation found in a Markdown file: where, the text, the argv after the program name."""

    where: str
    text: str
    argv: tuple[str, ...]
    refused: bool  # the doc shows it refused: the next line of its block starts with "trainer2: error"


def code_blocks(text: str) -> list[tuple[int, list[str]]]:
    """(first line number, lines) of every fenced and every indented code block of a Markdown text."""
    blocks: list[tuple[int, list[str]]] = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        if lines[i].lstrip().startswith("```"):
            j = i + 1
            while j < len(lines) and not lines[j].lstrip().startswith("```"):
                j += 1
            blocks.append((i + 2, lines[i + 1 : j]))
            i = j + 1
        elif lines[i].startswith("    ") and (i == 0 or not lines[i - 1].strip()):
            j = i
            while j < len(lines) and (lines[j].startswith("    ") or not lines[j].strip()):
                j += 1
            blocks.append((i + 1, [line[4:] for line in lines[i:j]]))
            i = j
        else:
            i += 1
    return blocks


def trainer_argv(tokens: list[str]) -> list[str] | None:
    """The arguments after the trainer's program name, or None when the tokens do not invoke the trainer."""
    while tokens and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\S*", tokens[0]):  # OMP_NUM_THREADS=1 ...
        tokens = tokens[1:]
    if not tokens:
        return None
    if tokens[0] == "trainer2":
        return tokens[1:]
    if tokens[0] in PYTHON and tokens[1:3] == ["-m", "trainer2"]:
        return tokens[3:]
    if tokens[0] in PYTHON and len(tokens) > 1 and tokens[1].endswith("main.py"):
        return tokens[2:]
    if tokens[0] == "torchrun" or (tokens[0] in PYTHON and tokens[1:3] == ["-m", "torch.distributed.run"]):
        script = next((i for i, t in enumerate(tokens) if t.endswith("main.py")), None)
        return None if script is None else tokens[script + 1 :]
    return None


def split_commands(line: str) -> list[list[str]]:
    """The simple commands of one shell line (split at &&, ||, ;, |), each as tokens, comments dropped."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token and set(token) <= set(";&|"):
            commands.append([])
        else:
            commands[-1].append(token)
    return [c for c in commands if c]


def commands_in(path: Path, text: str | None = None) -> list[Command]:
    """Every trainer command in the code blocks of a Markdown file, and in its inline code spans that pass arguments."""
    text = path.read_text(encoding="utf-8") if text is None else text
    found: list[Command] = []
    for start, lines in code_blocks(text):
        joined: list[tuple[int, str]] = []
        for k, line in enumerate(lines):  # join backslash continuations
            if joined and joined[-1][1].endswith("\\"):
                joined[-1] = (joined[-1][0], joined[-1][1][:-1] + " " + line.strip())
            else:
                joined.append((start + k, line))
        for k, (lineno, line) in enumerate(joined):
            refused = k + 1 < len(joined) and joined[k + 1][1].lstrip().startswith("trainer2: error")
            found += commands_on(f"{path.name}:{lineno}", line.strip().removeprefix("$ "), refused)
    for lineno, line in enumerate(text.split("\n"), 1):
        for span in re.findall(r"(?<!`)`([^`]+)`(?!`)", line):
            found += [c for c in commands_on(f"{path.name}:{lineno}", span, False) if len(c.argv) > 1 or any(
                a.startswith("--") for a in c.argv)]
    return found


def commands_on(where: str, line: str, refused: bool) -> list[Command]:
    try:
        simple = split_commands(line)
    except ValueError:  # not shell (an unbalanced quote in prose or output)
        return []
    return [Command(where, line, tuple(argv), refused) for tokens in simple if (argv := trainer_argv(tokens)) is not None]


class Parsed(Exception):
    """Raised in place of returning from parse_args, so the command stops before it does anything."""

    def __init__(self, parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
        super().__init__(parser.prog)
        self.parser, self.namespace = parser, args


def parse(argv: tuple[str, ...], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> str | None:
    """Run the real command line on argv up to its parser; None if it parses and its config validates, else why not."""
    original = argparse.ArgumentParser.parse_args

    def stop_after_parsing(self, args=None, namespace=None):  # type: ignore[no-untyped-def]
        raise Parsed(self, original(self, args, namespace))

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", stop_after_parsing)
        try:
            cli.main(list(argv))
        except Parsed as p:
            parsed = p
        except SystemExit as e:  # argparse refused the arguments (or printed --help)
            if e.code == 0 and ("--help" in argv or "-h" in argv):
                return None
            return capsys.readouterr().err.strip().split("\n")[-1]  # the error line, without the usage above it
        else:
            return "the command returned without parsing its arguments"
    if parsed.parser.prog in CONFIG_PROGS:
        try:
            build_config(config_layers(parsed.namespace))
        except ConfigError as e:
            return str(e)
    return None


def all_commands() -> list[Command]:
    return [c for path in DOCS for c in commands_in(path)]


@pytest.mark.parametrize("command", all_commands(), ids=lambda c: c.where)
def test_documented_command_parses(command: Command, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    error = parse(command.argv, monkeypatch, capsys)
    if command.refused:
        assert error is not None, f"{command.where}: the doc shows `{command.text}` refused, but it is accepted"
    else:
        assert error is None, f"{command.where}: `{command.text}` no longer parses:\n{error}"


def test_readme_shows_every_command() -> None:
    """The extractor finds the README's commands: each subcommand, torchrun, and the setup line."""
    found = commands_in(ROOT / "README.md")
    first = {c.argv[0] if c.argv and c.argv[0] in cli.COMMANDS else "train" for c in found}
    assert first == set(cli.COMMANDS), f"README commands cover {sorted(first)}, not every command {sorted(cli.COMMANDS)}"
    assert any(c.text.startswith("torchrun") for c in found)
    assert any(c.text.startswith("pip install") and c.argv == ("--preset", "dev") for c in found)


def test_unknown_flag_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A doc command with a flag the parser does not know, or a value the config refuses, fails the check."""
    doc = tmp_path / "doc.md"
    doc.write_text("Run:\n\n```bash\nOMP_NUM_THREADS=1 python main.py --preset dev --no_such_flag 3\n"
                   "torchrun --nproc_per_node 2 main.py --preset dev --spectral_cap 2\n"
                   "python main.py sample --checkpoint c --temprature 0.8\n```\n\nor `trainer2 --preset dev --max_w 3`.\n")
    commands = commands_in(doc)
    assert [c.argv[-2] for c in commands] == ["--no_such_flag", "--spectral_cap", "--temprature", "--max_w"]
    errors = [parse(c.argv, monkeypatch, capsys) for c in commands]
    assert "unrecognized arguments: --no_such_flag 3" in errors[0]
    assert "spectral_cap" in errors[1]
    assert "unrecognized arguments: --temprature" in errors[2]
    assert "unrecognized arguments: --max_w" in errors[3]


def test_readme_size() -> None:
    size = (ROOT / "README.md").stat().st_size
    assert size <= MAX_README_BYTES, f"README.md is {size} bytes; keep it a five-minute read (<= {MAX_README_BYTES})"


def anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_links_resolve(path: Path) -> None:
    """Every relative link of the README and docs/ names a file that exists, and a heading in it when it has #anchor."""
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, frag = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        assert dest.exists(), f"{path.name}: link {target} names a missing file"
        if frag and dest.suffix == ".md":
            headings = {anchor(h) for h in re.findall(r"^#+ (.+)$", dest.read_text(encoding="utf-8"), flags=re.M)}
            assert frag in headings, f"{path.name}: link {target} names no heading of {dest.name}"
