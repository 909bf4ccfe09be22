"""benchmarks.text_context: a backprop network per context length on the trainer's own validation split."""

from __future__ import annotations

import sys

import pytest

from benchmarks import text_context


def test_it_trains_one_network_per_context_and_scores_the_validation_split(tmp_path, monkeypatch, capsys):
    text = tmp_path / "t.txt"
    text.write_text("the cat sat on the mat. " * 200)
    argv = ["text_context", "--data", str(text), "--contexts", "4", "8", "--steps", "150", "--hidden", "16"]
    monkeypatch.setattr(sys, "argv", argv)
    text_context.main()
    out = capsys.readouterr().out
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| 4 ") or line.startswith("| 8 ")]
    assert [r[0] for r in rows] == ["| 4", "| 8"]
    for r in rows:
        fit, val = float(r[4]), float(r[5])
        assert 0 < val < 2.5 and 0 < fit < 2.5  # learned: the uniform guess over 9 characters is log2(9) = 3.17 bpc
    assert "validation characters" in out


def test_a_non_text_file_is_refused(tmp_path, monkeypatch, capsys):
    table = tmp_path / "t.csv"
    table.write_text("a,b,label\n" + "".join(f"{i},{i + 1},{i % 2}\n" for i in range(40)))
    monkeypatch.setattr(sys, "argv", ["text_context", "--data", str(table)])
    with pytest.raises(SystemExit):
        text_context.main()
    assert "a text file is needed" in capsys.readouterr().err
