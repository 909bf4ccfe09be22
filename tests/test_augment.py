"""Random translations of training images (trainer2.data.augment): each image moves as a per-pixel reference says, the
draws are a function of (seed, window, rank) only, a run uses them on training batches alone, and text refuses them."""

from __future__ import annotations

import numpy as np
import torch
from test_image_data import CONV, write_mnist

from trainer2.cli import main
from trainer2.data.augment import shift_images, window_generator
from trainer2.running.trainer import Trainer
from trainer2.train_config import TrainConfig


def shifted_reference(img: torch.Tensor, dy: int, dx: int) -> torch.Tensor:
    """img (C, H, W) read at (y + dy, x + dx), coordinates clamped to the border: one pixel at a time."""
    c, h, w = img.shape
    out = torch.empty_like(img)
    for y in range(h):
        for x in range(w):
            out[:, y, x] = img[:, min(max(y + dy, 0), h - 1), min(max(x + dx, 0), w - 1)]
    return out


def test_each_image_is_one_edge_padded_translation_within_the_shift():
    shape, shift = (2, 5, 6), 2
    rows = torch.randn(16, 2 * 5 * 6)
    out = shift_images(rows, shape, shift, window_generator(7, 3, 0))
    assert out.shape == rows.shape
    # the generator's first draw is every (dy, dx) (B dys, then B dxs): a resumed run of an earlier main draws the same
    dy, dx = torch.randint(0, 2 * shift + 1, (2, 16), generator=window_generator(7, 3, 0)) - shift
    drawn = list(zip(dy.tolist(), dx.tolist(), strict=True))
    seen = []
    for img, got in zip(rows.view(-1, *shape), out.view(-1, *shape), strict=True):
        moves = [
            (dy, dx)
            for dy in range(-shift, shift + 1)
            for dx in range(-shift, shift + 1)
            if torch.equal(shifted_reference(img, dy, dx), got)
        ]
        assert len(moves) == 1, moves  # random pixels: exactly one translation reproduces the image
        seen.append(moves[0])
    assert seen == drawn and len(set(seen)) > 3  # the images do not all move alike


def test_the_draws_depend_on_seed_window_and_rank_only():
    rows, shape = torch.randn(32, 1 * 6 * 6), (1, 6, 6)
    again = shift_images(rows, shape, 1, window_generator(5, 11, 1))
    assert torch.equal(shift_images(rows, shape, 1, window_generator(5, 11, 1)), again)
    for other in (window_generator(6, 11, 1), window_generator(5, 12, 1), window_generator(5, 11, 0)):
        assert not torch.equal(shift_images(rows, shape, 1, other), again)


def test_a_run_shifts_its_training_batches_and_never_its_heldout_ones(tmp_path):
    write_mnist(tmp_path / "mnist", n_train=40)
    common = dict(data=str(tmp_path / "mnist"), layers=CONV, coord_dim_n=4, rotor_k=4, batch_size=8)
    plain = Trainer(TrainConfig(**common, checkpoint_dir=str(tmp_path / "a")), log=lambda *_: None)
    moved = Trainer(TrainConfig(**common, augment_shift=1, checkpoint_dir=str(tmp_path / "b")), log=lambda *_: None)
    shape = moved.data.input_shape
    for window in range(3):
        moved.progress.window = plain.progress.window = window
        (x0, y0), (x1, y1) = plain.next_batch(), moved.next_batch()
        assert torch.equal(y0, y1)  # the same examples, in the same order
        assert torch.equal(x1, shift_images(x0, shape, 1, window_generator(0, window, 0)))
        assert not torch.equal(x0, x1)
    assert moved.evaluate() == plain.evaluate()  # the same machine scores the same, unmoved, held-out images


def test_text_data_refuses_augment_shift(tmp_path, capsys):
    args = ["--augment_shift", "1", "--max_windows", "1", "--checkpoint_dir", str(tmp_path)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "augment_shift: 1 moves images" in err and "Traceback" not in err
    assert not np.any([p.is_file() for p in tmp_path.rglob("*")])  # refused before the run wrote anything
