"""Conv layers or augment_shift on data that is no images: the first error names image data as the fix, not a
change that only leads to a second error."""

from __future__ import annotations

import pytest

from trainer2.cli import main

IMAGE_FIX = "pass --data an MNIST IDX directory, a CIFAR-10 directory, an .npz of images"


def error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("trainer2: error: "), err
    return err[0]


@pytest.mark.parametrize("extra", [[], ["--augment_shift", "0"]])
def test_the_conv_preset_without_data_asks_for_image_data(tmp_path, capsys, extra):
    assert main(["--preset", "conv", "--checkpoint_dir", str(tmp_path), *extra]) == 2
    line = error_line(capsys)
    assert "conv layers 0, 1 need image data" in line and IMAGE_FIX in line and "torchvision:NAME:ROOT" in line
    assert "--augment_shift 0" not in line  # dropping the shift alone would not be enough
    assert not list(tmp_path.iterdir())  # refused before the run wrote anything


def test_augment_shift_alone_on_text_names_both_ways_out(tmp_path, capsys):
    assert main(["--augment_shift", "1", "--max_windows", "1", "--checkpoint_dir", str(tmp_path)]) == 2
    line = error_line(capsys)
    assert "augment_shift: 1 moves images" in line and IMAGE_FIX in line and "or use --augment_shift 0" in line
