"""CSV feature data: header detection, the label column, the same rows as an .npz of the same numbers, refusals that
name the file, line and column, and training from the command line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from trainer2.cli import main
from trainer2.data.csv_table import CsvFile
from trainer2.data.dataset import DataError
from trainer2.data.load import DataConfig, find_format, load_data

TINY = [
    "--hidden_sizes",
    "8",
    "--coord_dim_n",
    "4",
    "--rotor_k",
    "4",
    "--batch_size",
    "10",
    "--free_steps",
    "8",
    "--nudge_steps",
    "4",
    "--max_windows",
    "4",
    "--log_every_windows",
    "2",
]


def write(path: Path, text: str) -> str:
    path.write_text(text, encoding="utf-8")
    return str(path)


def table(rows: int = 40, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """rows x 3 features (float, exactly printable as %.4f) and labels 0..2."""
    rng = np.random.default_rng(seed)
    return np.round(rng.normal(size=(rows, 3)), 4), rng.integers(0, 3, rows)


def as_csv(x: np.ndarray, y: np.ndarray, header: str | None, label_at: int) -> str:
    lines = [header] if header else []
    for row, label in zip(x, y, strict=True):
        cells = [f"{v:.4f}" for v in row]
        cells.insert(label_at, str(int(label)))
        lines.append(",".join(cells))
    return "\n".join(lines) + "\n"


def load(path: str, **fields) -> object:
    return load_data(DataConfig(data=path, **fields))


@pytest.mark.parametrize(
    "header,label_at,fields",
    [
        ("a,b,label,c", 2, {}),  # a column named label
        ("a,b,c,Target", 3, {}),
        ("cls,a,b,c", 0, {"label_column": "cls"}),  # named by label_column
        (None, 3, {}),  # no header: the last column
        ("a,b,c,d", 3, {}),  # a header without label / y / target: the last column
    ],
)
def test_the_label_column_and_the_rows_are_those_of_an_npz_of_the_same_numbers(tmp_path, header, label_at, fields):
    x, y = table()
    path = write(tmp_path / "t.csv", as_csv(x, y, header, label_at))
    data = load(path, **fields)
    np.savez(tmp_path / "t.npz", x=x, y=y)
    ref = load(str(tmp_path / "t.npz"))
    assert data.kind == "features" and data.input_dim == 3 and data.num_classes == ref.num_classes
    for split in ("train", "heldout", "train_y", "heldout_y"):
        assert torch.equal(getattr(data, split), getattr(ref, split)), split
    assert data.num_examples("heldout") == 4  # heldout_fraction 0.1 of 40 rows, the last ones


def test_auto_reads_csv_by_its_suffix_not_as_text(tmp_path):
    assert find_format(str(tmp_path / "a.csv"), "auto") is CsvFile
    assert find_format(str(tmp_path / "A.CSV"), "auto") is CsvFile
    assert find_format(str(tmp_path / "a.txt"), "auto") is not CsvFile


def test_blank_lines_a_byte_order_mark_and_quoted_numbers_are_read(tmp_path):
    path = write(tmp_path / "t.csv", '\ufeffx1,x2,y\n"1.5",2,0\n\n3,4,1\n5,6,1\n\n')
    data = load(path, heldout_fraction=0.34)
    assert data.train.tolist() == [[1.5, 2.0], [3.0, 4.0]] and data.train_y.tolist() == [0, 1]
    assert data.heldout.tolist() == [[5.0, 6.0]] and data.heldout_y.tolist() == [1]


@pytest.mark.parametrize(
    "text,fields,pattern",
    [
        ("", {}, "file is empty"),
        ("\n\n", {}, "file is empty"),
        ("a,b,label\n", {}, "no data rows below the header"),
        ("a,label\n1,0\n2,oops\n", {}, r"line 3, column 1 \('a'\): '2' |line 3, column 2 \('label'\): 'oops'"),
        ("a,b,label\n1,2,0\n1,x,1\n", {}, r"line 3, column 2 \('b'\): 'x' is not a finite number"),
        ("1,2,0\n1,,1\n", {}, r"line 2, column 2: '' is not a finite number"),
        ("1,2,0\n1,nan,1\n", {}, r"line 2, column 2: 'nan' is not a finite number"),
        ("1,2,0\n1,2,0\n1,2\n", {}, r"line 3: 2 columns, but the first row has 3"),
        ("a,b,y\n1,2,0\n1,2,3,4\n", {}, r"line 3: 4 columns, but the header has 3"),
        ("a,b,y\n1,2,0\n1,2,-1\n", {}, r"line 3, column 3 \('y'\) \(the label\): -1 is not a class label"),
        ("a,b,y\n1,2,0\n1,2,0.5\n", {}, r"line 3, column 3 \('y'\) \(the label\): 0.5 is not a class label"),
        ("a,b,y\n1,2,cat\n1,2,dog\n", {}, r"line 2, column 3 \('y'\): 'cat' .*class labels must be integers"),
        ("a,b,y\n1,2,0\n1,2,1\n", {"label_column": "z"}, r"label_column 'z' is not in the header"),
        ("1,2,0\n1,2,1\n", {"label_column": "y"}, r"has no header row"),
        ("label\n0\n1\n", {}, "one column only"),
        ("a,y\n1,0\n", {}, "need at least 2 rows"),
        ("a,y\n1,0\n2,7\n", {}, "class indices 0..K-1"),
    ],
)
def test_malformed_tables_are_refused_naming_the_file_and_where(tmp_path, text, fields, pattern):
    path = write(tmp_path / "bad.csv", text)
    with pytest.raises(DataError, match=pattern) as e:
        load(path, **fields)
    assert str(e.value).startswith(f"{path}: ")


def test_bytes_that_are_not_utf8_are_refused(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_bytes(b"a,y\n1,0\n\xff\xfe,1\n")
    with pytest.raises(DataError, match="not valid UTF-8"):
        load(str(path))


def test_the_command_line_trains_on_a_csv_and_refuses_a_bad_one_in_one_line(tmp_path, capsys):
    x, y = table(60)
    good = write(tmp_path / "good.csv", as_csv(x, y, "f1,f2,f3,label", 3))
    assert main(["--data", good, "--checkpoint_dir", str(tmp_path / "runs"), *TINY]) == 0
    assert "acc" in capsys.readouterr().out  # a classifier's accuracy, not a text model's bits per character
    bad = write(tmp_path / "bad.csv", "f1,label\n1,0\n2,1\nthree,0\n")
    assert main(["--data", bad, "--checkpoint_dir", str(tmp_path / "runs"), *TINY]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"trainer2: error: {bad}: line 4, column 1 ('f1')"), err
