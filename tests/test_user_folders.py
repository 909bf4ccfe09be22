"""Training reads the user's data folder and writes nothing into it: the token cache and its lock go to the user
cache directory ($XDG_CACHE_HOME/trainer2/tokens), never beside the data."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_csv_data import TINY  # the same tiny machine as the CSV tests'

from trainer2.cli import main


def listing(folder: Path) -> dict[str, tuple[int, int, int]]:
    """Every entry under `folder`: its (size, mtime in ns, mode)."""
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns, p.stat().st_mode)
        for p in sorted(folder.rglob("*"))
    }


@pytest.fixture
def read_only_data(tmp_path, monkeypatch):
    """A data folder (mode 0o555) holding a text file and a CSV table; the user cache directory in tmp_path."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "notes.txt").write_text("the cat sat on the mat. a dog ran in the fog. " * 40, encoding="utf-8")
    rows = [f"{i % 7 * 0.5},{i % 3 - 1.0},{i % 2}" for i in range(60)]
    (folder / "table.csv").write_text("a,b,label\n" + "\n".join(rows) + "\n", encoding="utf-8")
    folder.chmod(0o555)  # as root (CI) this stops nothing, so the tests compare listings, not permission errors
    yield folder
    folder.chmod(0o755)


@pytest.mark.parametrize("name", ["notes.txt", "table.csv"])
def test_training_leaves_a_read_only_data_folder_as_it_was(read_only_data, tmp_path, name, capsys):
    before = listing(read_only_data)
    runs = tmp_path / "runs"
    assert main(["--data", str(read_only_data / name), "--checkpoint_dir", str(runs), *TINY]) == 0, (
        capsys.readouterr().err
    )
    assert listing(read_only_data) == before
    if name.endswith(".txt"):  # the text file's token cache and its lock went to the user cache directory
        cached = sorted(p.name for p in (tmp_path / "cache" / "trainer2" / "tokens").iterdir())
        assert [n for n in cached if n.startswith("notes.txt.")] and all(not n.endswith(".tmp") for n in cached)
