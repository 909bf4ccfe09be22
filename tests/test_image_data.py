"""Image data in the formats on disk (image .npz, MNIST IDX, CIFAR-10 batches), their refusal when malformed, and a
conv machine training on them."""

from __future__ import annotations

import gzip
import math
import pickle
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from trainer2.cli import main
from trainer2.data.dataset import DataError
from trainer2.data.load import load_dataset
from trainer2.running.trainer import Trainer
from trainer2.train_config import TrainConfig


def idx_bytes(a: np.ndarray) -> bytes:
    """An array as an IDX file: magic 0 0 0x08 (uint8) ndim, big-endian sizes, the data."""
    return bytes([0, 0, 0x08, a.ndim]) + np.array(a.shape, dtype=">u4").tobytes() + a.astype(np.uint8).tobytes()


def write_mnist(d, n_train: int = 30, n_test: int = 10, gz: bool = True):
    rng = np.random.default_rng(0)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 6, 5)),
        "train-labels-idx1-ubyte": rng.integers(0, 4, n_train),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 6, 5)),
        "t10k-labels-idx1-ubyte": rng.integers(0, 4, n_test),
    }
    d.mkdir(exist_ok=True)
    for i, (name, a) in enumerate(arrays.items()):
        if gz and i % 2 == 0:  # a mix of gzipped and plain files, as people unpack them
            (d / f"{name}.gz").write_bytes(gzip.compress(idx_bytes(a)))
        else:
            (d / name).write_bytes(idx_bytes(a))
    return arrays


def write_cifar(d, sizes=(8, 6), n_test: int = 5):
    rng = np.random.default_rng(1)
    d.mkdir(exist_ok=True)
    out = []
    for name, n in [*((f"data_batch_{i + 1}", n) for i, n in enumerate(sizes)), ("test_batch", n_test)]:
        x, y = rng.integers(0, 256, (n, 3072)).astype(np.uint8), [int(v) for v in rng.integers(0, 10, n)]
        with open(d / name, "wb") as f:
            pickle.dump({b"batch_label": name.encode(), b"labels": y, b"data": x}, f)
        out.append((x, np.array(y)))
    return out


def test_image_npz_is_normalised_per_channel_and_keeps_its_shape(tmp_path):
    rng = np.random.default_rng(2)
    x = (
        rng.normal(size=(40, 3, 4, 5)) * np.array([1.0, 5.0, 0.1])[:, None, None]
        + np.array([0.0, 10.0, -3.0])[:, None, None]
    )
    np.savez(tmp_path / "im.npz", x=x.astype(np.float32), y=rng.integers(0, 3, 40))
    ds = load_dataset(str(tmp_path / "im.npz"), 8, heldout_fraction=0.25)
    assert ds.kind == "images" and ds.input_shape == (3, 4, 5) and ds.input_dim == 60
    assert ds.num_examples("train") == 30 and ds.num_examples("heldout") == 10
    per_channel = ds.train.view(30, 3, 20)
    np.testing.assert_allclose(per_channel.mean((0, 2)).numpy(), 0.0, atol=1e-5)
    np.testing.assert_allclose(per_channel.std((0, 2), unbiased=False).numpy(), 1.0, atol=1e-4)
    gray = load_dataset(
        _write(tmp_path / "g.npz", x=rng.integers(0, 256, (12, 7, 7)).astype(np.uint8), y=np.arange(12) % 2), 8
    )
    assert gray.input_shape == (1, 7, 7) and gray.train.dtype.is_floating_point


def _write(path, **arrays) -> str:
    np.savez(path, **arrays)
    return str(path)


@pytest.mark.parametrize("gz", [True, False], ids=["gzipped", "plain"])
def test_mnist_idx_directory_uses_the_official_test_split(tmp_path, gz):
    arrays = write_mnist(tmp_path / "mnist", gz=gz)
    ds = load_dataset(str(tmp_path / "mnist"), 8)
    assert ds.kind == "images" and ds.input_shape == (1, 6, 5)
    assert ds.num_examples("train") == 30 and ds.num_examples("heldout") == 10
    assert ds.heldout_y.tolist() == arrays["t10k-labels-idx1-ubyte"].tolist()
    raw = arrays["t10k-images-idx3-ubyte"].reshape(10, -1).astype(np.float64)
    corr = np.corrcoef(raw.ravel(), ds.heldout.numpy().ravel())[0, 1]
    assert corr > 0.9999  # the same pixels, affinely normalised


def test_cifar10_batches_directory_joins_the_training_batches(tmp_path):
    (x1, y1), (x2, y2), (xt, yt) = write_cifar(tmp_path / "cifar-10-batches-py")
    ds = load_dataset(str(tmp_path / "cifar-10-batches-py"), 8)
    assert ds.input_shape == (3, 32, 32) and ds.num_examples("train") == 14 and ds.num_examples("heldout") == 5
    assert ds.train_y.tolist() == [*y1, *y2] and ds.heldout_y.tolist() == list(yt)
    np.testing.assert_allclose(ds.train.view(14, 3, -1).mean((0, 2)).numpy(), 0.0, atol=1e-4)


def _truncated_idx(d):
    write_mnist(d, gz=False)
    p = d / "train-images-idx3-ubyte"
    p.write_bytes(p.read_bytes()[:-7])
    return p


def _bad_magic(d):
    write_mnist(d, gz=False)
    p = d / "t10k-labels-idx1-ubyte"
    p.write_bytes(b"\x12\x34" + p.read_bytes()[2:])
    return p


def _missing_labels(d):
    write_mnist(d, gz=False)
    (d / "train-labels-idx1-ubyte").unlink()
    return d


def _hostile_pickle(d):
    write_cifar(d)
    p = d / "test_batch"
    p.write_bytes(pickle.dumps(print))  # any global but numpy's array reconstruction is refused
    return p


def _bad_cifar_shape(d):
    write_cifar(d)
    with open(d / "data_batch_2", "wb") as f:
        pickle.dump({b"labels": [0, 1], b"data": np.zeros((2, 100), dtype=np.uint8)}, f)
    return d / "data_batch_2"


def _unknown_dir(d):
    d.mkdir()
    (d / "readme.txt").write_text("hello")
    return d


def _five_d_npz(d):
    d.mkdir()
    return _write(d / "x.npz", x=np.zeros((4, 1, 2, 2, 2), dtype=np.float32), y=np.zeros(4, dtype=np.int64))


@pytest.mark.parametrize(
    "make,pattern",
    [
        (_truncated_idx, "truncated or corrupt"),
        (_bad_magic, "not an IDX file"),
        (_missing_labels, "train-labels-idx1-ubyte"),
        (_hostile_pickle, "not allowed in a CIFAR batch"),
        (_bad_cifar_shape, "must be uint8 \\[N, 3072\\]"),
        (_unknown_dir, "neither MNIST IDX files"),
        (_five_d_npz, "\\[N, C, H, W\\] images"),
    ],
    ids=["truncated_idx", "bad_magic", "missing_labels", "hostile_pickle", "bad_cifar_shape", "unknown_dir", "five_d"],
)
def test_malformed_image_data_is_refused_naming_the_file(tmp_path, make, pattern):
    bad = make(tmp_path / "data")
    with pytest.raises(DataError, match=pattern) as e:
        load_dataset(str(tmp_path / "data") if not str(bad).endswith(".npz") else str(bad), 8)
    assert str(bad) in str(e.value)


CONV = [{"conv": {"channels": 4, "kernel": 3, "pool": 2}}, {"dense": 12}]


def test_a_conv_machine_trains_on_mnist_files(tmp_path):
    write_mnist(tmp_path / "mnist", n_train=40)
    cfg = TrainConfig(
        data=str(tmp_path / "mnist"),
        layers=CONV,
        coord_dim_n=4,
        rotor_k=4,
        batch_size=8,
        free_steps=8,
        nudge_steps=4,
        max_windows=6,
        eval_every_windows=3,
        checkpoint_dir=str(tmp_path),
    )
    t = Trainer(cfg, log=lambda *_: None)
    w = t.machine.named_params()["W_1"]
    before = w.clone()
    summary = t.train()
    assert (
        summary["data_kind"] == "images" and math.isfinite(summary["heldout_loss"]) and 0 <= summary["heldout_acc"] <= 1
    )
    assert w.shape == (4, 1, 3, 3) and not w.equal(before)  # the kernel learned
    assert t.machine.state_sizes() == [4 * 3 * 2, 12, 4]  # 6x5 pooled by 2 -> 3x2


def test_cli_refuses_a_conv_layer_above_feature_vectors(tmp_path, capsys):
    feats = _write(tmp_path / "f.npz", x=np.zeros((10, 4), dtype=np.float32), y=np.arange(10) % 2)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("layers:\n  - conv: {channels: 2}\n")
    assert (
        main(
            [
                "--data",
                feats,
                "--config",
                str(cfg),
                "--checkpoint_dir",
                str(tmp_path),
                "--max_windows",
                "2",
                "--batch_size",
                "4",
            ]
        )
        == 2
    )
    assert "layers: conv layer 0 needs image data, but the data" in capsys.readouterr().err


def test_the_conv_preset_runs_on_mnist_sized_images(tmp_path, capsys):
    rng = np.random.default_rng(3)
    data = _write(tmp_path / "digits.npz", x=rng.integers(0, 256, (24, 28, 28)).astype(np.uint8), y=np.arange(24) % 3)
    args = [
        "--preset",
        "conv",
        "--data",
        data,
        "--max_windows",
        "2",
        "--batch_size",
        "8",
        "--checkpoint_dir",
        str(tmp_path),
    ]
    assert main(args) == 0
    assert "acc" in capsys.readouterr().out


@pytest.mark.parametrize("augment_shift,top", [("0", "{channels: 2}"), ("2", "{channels: 2, pool: 2, pooling: max}")])
def test_a_conv_run_on_mnist_files_resumes_bitwise_identical(tmp_path, capsys, augment_shift, top):
    """The kernels, power vectors and sampler of a conv machine (average or max pooling) on image data round-trip
    through a checkpoint; the image shifts of a resumed run are the ones the uncut run drew."""
    write_mnist(tmp_path / "mnist", n_train=40)
    cfg = tmp_path / "conv.yaml"
    cfg.write_text(
        f"layers:\n  - conv: {{channels: 3, kernel: 3, pool: 2}}\n  - conv: {top}\n"
    )  # power.0: the second conv's, over its 2x3x2 convolution (before a max pooling)
    common = [
        "--data",
        str(tmp_path / "mnist"),
        "--config",
        str(cfg),
        "--checkpoint_dir",
        str(tmp_path / "ck"),
        "--coord_dim_n",
        "4",
        "--rotor_k",
        "3",
        "--batch_size",
        "8",
        "--free_steps",
        "4",
        "--nudge_steps",
        "2",
        "--augment_shift",
        augment_shift,
    ]
    assert main([*common, "--run_name", "whole", "--max_windows", "8"]) == 0
    assert main([*common, "--run_name", "cut", "--max_windows", "4"]) == 0
    assert (
        main(
            ["--resume", "latest", "--checkpoint_dir", str(tmp_path / "ck"), "--run_name", "cut", "--max_windows", "8"]
        )
        == 0
    )
    assert "resumed from" in capsys.readouterr().out
    whole, cut = (
        load_file(str(tmp_path / "ck" / n / "step_00000008" / "tensors.safetensors")) for n in ("whole", "cut")
    )
    assert (
        whole.keys() == cut.keys()
        and whole["param.W_1"].shape == (3, 1, 3, 3)
        and whole["power.0"].shape == (2 * 3 * 2,)
    )
    for k in whole:
        assert torch.equal(whole[k], cut[k]), k


class _FakeSet:
    """Stands in for a torchvision data set class: the arrays it keeps in memory, and its refusal without files."""

    def __init__(self, root, download, train=True, split=None, *, hwc=False, labels="targets"):
        assert download is False  # trainer2 never asks torchvision to download
        if not (Path(root) / "present").exists():
            raise RuntimeError("Dataset not found. You can use download=True to download it")
        n = 7 if (train and split != "test") else 3
        rng = np.random.default_rng(n)
        shape = (n, 5, 4, 3) if hwc else (n, 5, 4)
        data = rng.integers(0, 256, shape).astype(np.uint8)
        self.data = data if hwc else torch.from_numpy(data)  # as torchvision keeps them: CIFAR numpy, MNIST tensor
        setattr(self, labels, list(rng.integers(0, 3, n)))


@pytest.fixture
def fake_torchvision(monkeypatch):
    """A `torchvision.datasets` module with MNIST (tensor [N, H, W]) and CIFAR10 (numpy [N, H, W, C]) look-alikes."""
    datasets = types.ModuleType("torchvision.datasets")
    datasets.MNIST = lambda root, download, **kw: _FakeSet(root, download, **kw)
    datasets.CIFAR10 = lambda root, download, **kw: _FakeSet(root, download, hwc=True, **kw)
    package = types.ModuleType("torchvision")
    package.datasets = datasets
    monkeypatch.setitem(sys.modules, "torchvision", package)
    monkeypatch.setitem(sys.modules, "torchvision.datasets", datasets)


def test_a_torchvision_set_by_name_uses_its_test_split(tmp_path, fake_torchvision):
    (tmp_path / "present").write_text("")
    mnist = load_dataset(f"torchvision:MNIST:{tmp_path}", 8)
    assert (mnist.kind, mnist.input_shape) == ("images", (1, 5, 4))
    assert (mnist.num_examples("train"), mnist.num_examples("heldout")) == (7, 3)
    cifar = load_dataset(f"torchvision:CIFAR10:{tmp_path}", 8)
    assert cifar.input_shape == (3, 5, 4)  # stored [N, H, W, C], turned to channels first
    raw = np.random.default_rng(7).integers(0, 256, (7, 5, 4, 3)).astype(np.uint8).transpose(0, 3, 1, 2)
    mean, std = raw.mean(axis=(0, 2, 3)), raw.std(axis=(0, 2, 3))
    expect = (raw - mean[:, None, None]) / std[:, None, None]
    torch.testing.assert_close(cifar.train, torch.from_numpy(expect.reshape(7, -1)).float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "spec, pattern",
    [
        ("torchvision:MNIST", "expected torchvision:NAME:ROOT"),
        ("torchvision:ImageNet:{root}", "'ImageNet' is not supported"),
        ("torchvision:MNIST:{root}/nowhere", "is not a directory"),
        ("torchvision:MNIST:{root}", "never downloads"),  # the root holds no data set
    ],
)
def test_a_torchvision_set_that_cannot_be_read_is_refused_by_name(tmp_path, fake_torchvision, spec, pattern):
    with pytest.raises(DataError, match=pattern):
        load_dataset(spec.format(root=tmp_path), 8)


def test_torchvision_missing_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchvision", None)  # import torchvision raises ImportError
    with pytest.raises(DataError, match="torchvision is not installed"):
        load_dataset(f"torchvision:MNIST:{tmp_path}", 8)
