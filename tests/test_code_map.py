"""docs/design.md's code map matches the tree: every module it lists exists where it says, and every module of the
package is listed (a subpackage's __init__.py, a package marker or a few re-exports, excepted)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "trainer2"
DESIGN = ROOT / "docs" / "design.md"


def code_map(text: str) -> list[tuple[int, str, str]]:
    """(line number, folder, module) of every module the '## Code map' table lists. A row with an empty folder cell
    is in the folder of the row above; 'trainer2/' is the package itself, any other folder is relative to it."""
    lines = text.split("\n")
    start = next(i for i, line in enumerate(lines) if line.strip() == "## Code map")
    found, folder = [], None
    for number, line in enumerate(lines[start + 1 :], start + 2):
        if line.startswith("## "):
            break
        if not line.startswith("|") or set(line) <= set("|- "):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == "folder":  # the header row
            continue
        if cells[0]:
            name = re.fullmatch(r"`([\w/]+/)`", cells[0])
            assert name, f"design.md:{number}: folder cell {cells[0]!r} is not one `folder/`"
            folder = "" if name.group(1) == "trainer2/" else name.group(1)
        assert folder is not None, f"design.md:{number}: the first row names no folder"
        modules = re.findall(r"`([^`]+)`", cells[1])
        assert modules, f"design.md:{number}: no module in {cells[1]!r}"
        found += [(number, folder, m) for m in modules]
    return found


def test_the_parser_reads_folders_continued_rows_and_every_module():
    table = "\n".join(
        [
            "## Code map",
            "| folder | module | idea |",
            "| --- | --- | --- |",
            "| `trainer2/` | `cli.py` | x |",
            "| `data/` | `a.py`, `b.py` | y |",
            "| | `c.py` | z |",
            "## Next",
            "| `io/` | `late.py` | not in the map |",
        ]
    )
    assert [(f, m) for _, f, m in code_map(table)] == [
        ("", "cli.py"),
        ("data/", "a.py"),
        ("data/", "b.py"),
        ("data/", "c.py"),
    ]


@pytest.fixture(scope="module")
def listed() -> list[tuple[int, str, str]]:
    return code_map(DESIGN.read_text(encoding="utf-8"))


def test_every_listed_module_exists_where_the_map_puts_it(listed):
    missing = [
        f"design.md:{n}: trainer2/{folder}{m}" for n, folder, m in listed if not (PACKAGE / folder / m).is_file()
    ]
    assert not missing, "the code map lists modules that are not there:\n" + "\n".join(missing)


def test_every_module_of_the_package_is_listed(listed):
    named = {(PACKAGE / folder / m).resolve() for _, folder, m in listed}
    unlisted = [
        str(p.relative_to(ROOT))
        for p in sorted(PACKAGE.rglob("*.py"))
        if p.resolve() not in named and not (p.name == "__init__.py" and p.parent != PACKAGE)
    ]
    assert not unlisted, "docs/design.md's code map leaves out:\n" + "\n".join(unlisted)


def test_no_module_is_listed_twice(listed):
    paths = [f"{folder}{m}" for _, folder, m in listed]
    assert len(paths) == len(set(paths)), sorted({p for p in paths if paths.count(p) > 1})
