"""The .csv format: comma-separated rows of numbers, one row an example, one column its class label.

A first row that is not all numbers is the header. The label column is `label_column` by its header name, else a
column named label, y or target, else the last column; every other column is a feature. Labels are integers 0..K-1.
The last heldout_fraction of the rows is held out, by position, as for .npz feature files: shuffle ordered rows first.
"""

from __future__ import annotations

import csv
import math
from array import array
from typing import ClassVar

import numpy as np

from trainer2.data.dataset import DataError, Dataset, check_arrays, check_file, feature_dataset
from trainer2.data.load import DataConfig

LABEL_NAMES = ("label", "y", "target")  # header names taken for the label column when label_column is not given
EXPECTED = "a CSV file of comma-separated numbers (an optional header row, one column of integer class labels)"


class CsvFile:
    """A .csv table of numbers: feature columns and one integer label column."""

    name: ClassVar[str] = "csv"

    @staticmethod
    def recognises(path: str | None) -> bool:
        return path is not None and path.lower().endswith(".csv")

    @staticmethod
    def load(path: str | None, cfg: DataConfig) -> Dataset:
        if path is None:
            raise DataError("the csv format needs a file: pass --data FILE.csv")
        x, y = read_csv(path, cfg.label_column)
        return feature_dataset(path, x, y, None, None, cfg.heldout_fraction)


def _number(cell: str) -> float | None:
    """The cell's value, or None when it is no finite number."""
    try:
        v = float(cell)
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def label_index(path: str, header: list[str] | None, width: int, label_column: str | None) -> int:
    """The label column's index: label_column by its header name, else label / y / target, else the last column."""
    if label_column is not None:
        if header is None:
            raise DataError(
                f"{path}: label_column {label_column!r} names a header column, but the file has no header row "
                "(its first row is all numbers); add a header row or leave label_column out (the last column)"
            )
        names = [h.strip() for h in header]
        if names.count(label_column) != 1:
            found = "appears more than once" if label_column in names else "is not in the header"
            raise DataError(f"{path}: label_column {label_column!r} {found}; the header has columns {names}")
        return names.index(label_column)
    if header is not None:
        for i, h in enumerate(header):
            if h.strip().lower() in LABEL_NAMES:
                return i
    return width - 1


def read_csv(path: str, label_column: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Validated (x float64 [N, D], y int64 [N]) from a CSV file; every problem is a DataError naming the file, and
    where it lies, its line and column."""
    check_file(path, EXPECTED)
    header: list[str] | None = None
    values = array("d")  # every cell of the data rows, row by row: 8 bytes a number, not a Python float's 24
    lines = array("q")  # each data row's line in the file, for the messages about labels
    width = col = 0
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:  # -sig: a byte-order mark (Excel) is no header
            reader = csv.reader(f)
            for row in reader:
                line = f"line {reader.line_num}"
                if not row or all(not cell.strip() for cell in row):
                    continue  # a blank line (often the last) holds no example
                nums = [_number(cell) for cell in row]
                if not width:
                    width = len(row)
                    header = row if None in nums else None  # a first row that is not all numbers is the header
                    col = label_index(path, header, width, label_column)
                    if header is not None:
                        continue
                if len(row) != width:
                    raise DataError(
                        f"{path}: {line}: {len(row)} columns, but the {'header' if header else 'first row'} has "
                        f"{width}; every row needs the same number of comma-separated cells"
                    )
                bad = next((i for i, v in enumerate(nums) if v is None), None)
                if bad is not None:
                    column = _column_name(bad, header)
                    hint = "class labels must be integers 0..K-1" if bad == col else f"expected {EXPECTED}"
                    raise DataError(f"{path}: {line}, column {column}: {row[bad]!r} is not a finite number; {hint}")
                values.extend(nums)  # type: ignore[arg-type]  (no None left)
                lines.append(reader.line_num)
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not valid UTF-8 ({e.reason}); expected {EXPECTED}") from None
    except csv.Error as e:
        raise DataError(f"{path}: not a readable CSV file ({e}); expected {EXPECTED}") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read file ({e.strerror}); expected {EXPECTED}") from None
    rows = len(lines)
    if not rows:
        raise DataError(
            f"{path}: {'no data rows below the header' if header else 'file is empty'}; expected {EXPECTED}"
        )
    if width < 2:
        raise DataError(f"{path}: one column only; expected at least one feature column beside the label column")
    table = np.frombuffer(values, dtype=np.float64).reshape(rows, width)
    labels = table[:, col]
    wrong = np.flatnonzero((labels < 0) | (labels != np.round(labels)) | (labels >= 2**53))  # 2**53: exact in float
    if len(wrong):
        raise DataError(
            f"{path}: line {lines[int(wrong[0])]}, column {_column_name(col, header)} (the label): "
            f"{labels[wrong[0]]:g} is not a class label; labels must be integers 0..K-1"
        )
    x = np.delete(table, col, axis=1)
    y = labels.astype(np.int64)
    check_arrays(path, x, y)
    return x, y


def _column_name(i: int, header: list[str] | None) -> str:
    """Column i as a person counts it (from 1), with its header name when there is one."""
    return f"{i + 1}" if header is None else f"{i + 1} ({header[i].strip()!r})"
