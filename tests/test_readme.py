"""The README and docs/ cannot drift from the code: every trainer and benchmark command they show parses with the
real command line (and its config validates), every relative link resolves, and the README stays a five-minute read."""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from trainer2 import cli
from trainer2.flags import config_layers
from trainer2.train_config import ConfigError, build_config

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MAX_README_BYTES = 15_000
PYTHON = {"python", "python3"}
CONFIG_PROGS = {"trainer2", "trainer2 bench", "trainer2 sweep"}  # parsers whose namespace layers into a TrainConfig
Patch = pytest.MonkeyPatch
Capture = pytest.CaptureFixture[str]


@dataclass(frozen=True)
class Command:
    """One invocation found in a Markdown file: where, the text, the program, the argv after the program's name."""

    where: str
    text: str
    program: str  # "trainer2", or a benchmark module such as "benchmarks.quality"
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


def invocation(tokens: list[str]) -> tuple[str, list[str]] | None:
    """(program, the arguments after its name) when the tokens run the trainer or a benchmark, else None."""
    while tokens and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\S*", tokens[0]):  # OMP_NUM_THREADS=1 ...
        tokens = tokens[1:]
    if not tokens:
        return None
    python = tokens[0] in PYTHON and len(tokens) > 1
    if tokens[0] == "trainer2":
        return "trainer2", tokens[1:]
    if python and tokens[1:3] == ["-m", "trainer2"]:
        return "trainer2", tokens[3:]
    if (
        python
        and tokens[1:2] == ["-m"]
        and len(tokens) > 2
        and (bench := re.fullmatch(r"benchmarks\.(\w+)", tokens[2]))
    ):
        return f"benchmarks.{bench.group(1)}", tokens[3:]  # the benchmarks import trainer2 and each other as packages
    if python and tokens[1].endswith("main.py"):
        return "trainer2", tokens[2:]
    if tokens[0] == "torchrun" or (python and tokens[1:3] == ["-m", "torch.distributed.run"]):
        script = next((i for i, t in enumerate(tokens) if t.endswith("main.py")), None)
        return None if script is None else ("trainer2", tokens[script + 1 :])
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
    """Every trainer or benchmark command in a Markdown file's code blocks, and in its inline code spans that pass
    arguments (a bare `trainer2 plot` in prose names the command, it does not run it)."""
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
            found += [
                c
                for c in commands_on(f"{path.name}:{lineno}", span, False)
                if c.program != "trainer2" or len(c.argv) > 1 or any(a.startswith("--") for a in c.argv)
            ]
    return found


def commands_on(where: str, line: str, refused: bool) -> list[Command]:
    """The trainer and benchmark commands of one shell line."""
    try:
        simple = split_commands(line)
    except ValueError:  # not shell (an unbalanced quote in prose or output)
        return []
    return [Command(where, line, run[0], tuple(run[1]), refused) for tokens in simple if (run := invocation(tokens))]


class Parsed(Exception):
    """Raised in place of returning from the first parse, so the command stops before it does anything."""

    def __init__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, extras: list[str]) -> None:
        super().__init__(parser.prog)
        self.parser, self.namespace, self.extras = parser, namespace, extras


def parse_only(run: Callable[[], object], monkeypatch: Patch, capsys: Capture) -> Parsed | str:
    """Start a command and stop it at its first argument parser: what the parser made of the arguments, or its error."""
    parse_args, parse_known_args = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
    inside: list[bool] = []  # parse_args calls parse_known_args: only the outer call stops the command

    def stop_known(self, args=None, namespace=None):  # type: ignore[no-untyped-def]
        if inside:
            return parse_known_args(self, args, namespace)
        inside.append(True)
        try:
            namespace, extras = parse_known_args(self, args, namespace)
        finally:
            inside.pop()
        raise Parsed(self, namespace, extras)

    def stop(self, args=None, namespace=None):  # type: ignore[no-untyped-def]
        inside.append(True)
        try:
            namespace = parse_args(self, args, namespace)
        finally:
            inside.pop()
        raise Parsed(self, namespace, [])

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", stop)
        m.setattr(argparse.ArgumentParser, "parse_known_args", stop_known)
        try:
            run()
        except Parsed as p:
            return p
        except SystemExit:  # argparse refused the arguments
            return capsys.readouterr().err.strip().split("\n")[-1]  # the error line, without the usage above it
    return "the command returned without parsing its arguments"


def parse(argv: tuple[str, ...], monkeypatch: Patch, capsys: Capture) -> str | None:
    """Run the real command line on argv up to its parser; None if it parses and its config validates, else why not."""
    if "--help" in argv or "-h" in argv:
        return None
    parsed = parse_only(lambda: cli.main(list(argv)), monkeypatch, capsys)
    if isinstance(parsed, str):
        return parsed
    if parsed.parser.prog in CONFIG_PROGS:
        try:
            build_config(config_layers(parsed.namespace))
        except ConfigError as e:
            return str(e)
    return None


def check(command: Command, monkeypatch: Patch, capsys: Capture) -> str | None:
    """None when a documented command parses (and its config validates), else why not. A benchmark's own parser
    reads its arguments, then the trainer's parser the trainer flags it passes on."""
    if command.program == "trainer2":
        return parse(command.argv, monkeypatch, capsys)
    module = importlib.import_module(command.program)
    monkeypatch.setattr("sys.argv", [f"{command.program.replace('.', '/')}.py", *command.argv])
    parsed = parse_only(module.main, monkeypatch, capsys)
    if isinstance(parsed, str):
        return parsed
    inner = getattr(parsed.namespace, "quality_flags", None)  # quality_seeds: the quality benchmark's command line
    if inner is not None:
        argv = tuple(inner[1:] if inner[:1] == ["--"] else inner)
        return check(Command(command.where, command.text, "benchmarks.quality", argv, False), monkeypatch, capsys)
    flags = [*parsed.extras, *getattr(parsed.namespace, "extra", [])]  # unknown arguments, or those after --
    preset = getattr(parsed.namespace, "preset", None)
    if not flags:
        return None
    return parse(tuple(["--preset", preset] if preset else []) + tuple(flags), monkeypatch, capsys)


def all_commands() -> list[Command]:
    return [c for path in DOCS for c in commands_in(path)]


@pytest.mark.parametrize("command", all_commands(), ids=lambda c: c.where)
def test_documented_command_parses(command: Command, monkeypatch: Patch, capsys: Capture) -> None:
    error = check(command, monkeypatch, capsys)
    if command.refused:
        assert error is not None, f"{command.where}: the doc shows `{command.text}` refused, but it is accepted"
    else:
        assert error is None, f"{command.where}: `{command.text}` no longer parses:\n{error}"


def test_readme_shows_every_command() -> None:
    """The extractor finds the README's commands: each subcommand, torchrun, and the setup line."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    found = commands_in(ROOT / "README.md")
    first = {c.argv[0] if c.argv and c.argv[0] in cli.COMMANDS else "train" for c in found}
    assert first == set(cli.COMMANDS), f"README shows {sorted(first)}, not every command {sorted(cli.COMMANDS)}"
    assert any(c.text.startswith("torchrun") for c in found)
    assert "python -m pytest -q" in [line.strip() for _, lines in code_blocks(readme) for line in lines]  # CI reads it
    assert any(c.text.startswith("pip install") and c.argv == ("--preset", "dev") for c in found)


def test_unknown_flag_is_caught(tmp_path: Path, monkeypatch: Patch, capsys: Capture) -> None:
    """A doc command with a flag the parser does not know, or a value the config refuses, fails the check."""
    doc = tmp_path / "doc.md"
    doc.write_text(
        "Run:\n\n```bash\nOMP_NUM_THREADS=1 python main.py --preset dev --no_such_flag 3\n"
        "torchrun --nproc_per_node 2 main.py --preset dev --spectral_cap 2\n"
        "python main.py sample --checkpoint c --temprature 0.8\n```\n\n"
        "or `trainer2 --preset dev --max_w 3`, or\n\n"
        "    python -m benchmarks.quality --skip exact ff --hiden_sizes 512\n"
        "    python -m benchmarks.ep_cosine --preset dev --train_steps 3000\n"
        "    python -m benchmarks.quality_seeds --seeds 0-3 --out o -- --preset dev --skip ff --hiden 5 --max_w 3\n"
    )
    commands = commands_in(doc)
    assert [c.argv[-2] for c in commands] == [
        "--no_such_flag",
        "--spectral_cap",
        "--temprature",
        "--hiden_sizes",
        "--train_steps",
        "--max_w",
        "--max_w",
    ]
    errors = [check(c, monkeypatch, capsys) for c in commands]
    assert "unrecognized arguments: --no_such_flag 3" in errors[0]
    assert "spectral_cap" in errors[1]
    assert "unrecognized arguments: --temprature" in errors[2]
    assert "unrecognized arguments: --hiden_sizes 512" in errors[3]
    assert "unrecognized arguments: --train_steps 3000" in errors[4]
    assert "unrecognized arguments: --hiden 5 --max_w 3" in errors[5]  # quality_seeds: quality's flags checked too
    assert "unrecognized arguments: --max_w" in errors[6]


EXTERNAL_FLAGS = {"--index-url", "--nproc_per_node", "--standalone", "--logdir"}  # pip's, torchrun's, tensorboard's


def known_flags(monkeypatch: Patch, capsys: Capture) -> set[str]:
    """Every option string of the trainer's commands, read from their parsers."""
    flags: set[str] = set()
    for argv in (
        ["--preset", "dev"],
        ["evaluate", "--checkpoint", "c"],
        ["sample", "--checkpoint", "c"],
        ["bench"],
        ["plot", "run"],
        ["sweep", "--space", "s.yaml"],
    ):
        parsed = parse_only(lambda: cli.main(argv), monkeypatch, capsys)
        assert isinstance(parsed, Parsed), parsed
        flags |= set(parsed.parser._option_string_actions)
    return flags


def test_readme_names_only_real_flags(monkeypatch: Patch, capsys: Capture) -> None:
    """Every --flag the README names, in prose and tables too, is an option of one of the trainer's commands."""
    named = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", (ROOT / "README.md").read_text(encoding="utf-8")))
    unknown = named - known_flags(monkeypatch, capsys) - EXTERNAL_FLAGS
    assert not unknown, f"README.md names flags no command has: {sorted(unknown)}"


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
