"""MNIST and CIFAR-10 loaders: tiny self-made fixtures (always run) and the real files (when present).

The fixtures have the exact layout of docs/data.md: ``mnist/train-{images-idx3,labels-idx1}-ubyte.gz``
(gzipped IDX) and ``cifar10/cifar10-jpg-train.tar.gz`` (``train/<class>/NNNN.jpg``, JPEGs made with
Pillow, the decoder the loader uses). Tests on the real datasets go through the ``real_data``
fixture of conftest.py: skipped with the reason when the files are absent, failed under ``CI=true``.
"""

from __future__ import annotations

import gzip
import io
import re
import struct
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from graphfl.common.config import DataConfig
from graphfl.tasks import labeled, registry
from graphfl.tasks.base import DataError
from graphfl.tasks.labeled import CIFAR_CLASSES

MNIST_IMAGES = "mnist/train-images-idx3-ubyte.gz"
MNIST_LABELS = "mnist/train-labels-idx1-ubyte.gz"
CIFAR_TRAIN = "cifar10/cifar10-jpg-train.tar.gz"
CIFAR_TEST = "cifar10/cifar10-jpg-test.tar.gz"


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch) -> Path:
    """A decoded-dataset cache per test: the CIFAR cache is keyed by the tarball's size only."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("GRAPHFL_CACHE", str(cache))
    return cache


# --------------------------------------------------------------------------- fixture writers


def idx_bytes(array: np.ndarray) -> bytes:
    """IDX encoding of a uint8 array: magic 0x0000 08 <ndim>, big-endian int32 dims, data."""
    assert array.dtype == np.uint8
    return struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()


def tiny_mnist_arrays(n: int = 40) -> tuple[np.ndarray, np.ndarray]:
    """``n`` 28×28 images whose pixels encode (image index, row, column); labels 0..9 cycling."""
    i, r, c = np.meshgrid(np.arange(n), np.arange(28), np.arange(28), indexing="ij")
    images = ((i * 7 + r * 3 + c) % 256).astype(np.uint8)
    return images, (np.arange(n) % 10).astype(np.uint8)


def write_tiny_mnist(root: Path, n: int = 40) -> tuple[np.ndarray, np.ndarray]:
    images, labels = tiny_mnist_arrays(n)
    (root / "mnist").mkdir(parents=True, exist_ok=True)
    (root / MNIST_IMAGES).write_bytes(gzip.compress(idx_bytes(images)))
    (root / MNIST_LABELS).write_bytes(gzip.compress(idx_bytes(labels)))
    return images, labels


def class_colour(label: int, k: int) -> tuple[int, int, int]:
    """A solid colour per (class, image) that survives JPEG within a few levels."""
    return (20 * label + 10, 250 - 20 * label, 40 + 60 * k)


def jpeg_bytes(colour: tuple[int, int, int], size: tuple[int, int] = (32, 32)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="JPEG", quality=95, subsampling=0)
    return buf.getvalue()


def write_tar(path: Path, members: dict[str, bytes]) -> Path:
    """A gzipped tarball with ``members`` (name -> bytes), sorted like the real one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        for name in sorted(members):
            info = tarfile.TarInfo(name)
            info.size = len(members[name])
            tar.addfile(info, io.BytesIO(members[name]))
    return path


def tiny_cifar_members(per_class: int = 3, split: str = "train") -> dict[str, bytes]:
    return {f"{split}/{cls}/{k:04d}.jpg": jpeg_bytes(class_colour(label, k))
            for label, cls in enumerate(CIFAR_CLASSES) for k in range(per_class)}


def write_tiny_cifar(root: Path, per_class: int = 3) -> Path:
    return write_tar(root / CIFAR_TRAIN, tiny_cifar_members(per_class))


def data_error_naming(path: Path):
    return pytest.raises(DataError, match=re.escape(str(path)))


# --------------------------------------------------------------------------- MNIST


def test_mnist_loader_reads_idx_gzip_and_normalises(tmp_path):
    images, labels = write_tiny_mnist(tmp_path, n=40)
    task = registry.create("mnist", data=DataConfig(min_partition_size=5), data_dir=str(tmp_path))
    x, y = task.load_pool()
    assert x.shape == (40, 1, 28, 28) and x.dtype == np.float32
    assert y.dtype == np.int64 and np.array_equal(y, labels)
    want = (images[:, None].astype(np.float32) / 255.0 - 0.1307) / 0.3081
    np.testing.assert_allclose(x, want, rtol=1e-6, atol=1e-6)

    parts = [task.client_data(pid, 2) for pid in range(2)]
    assert sum(p.num_train + p.num_test for p in parts) == 40            # the whole pool, split once
    for p in parts:
        assert p.x_train.shape[1:] == (1, 28, 28) and p.num_test >= 1
        assert set(np.unique(np.concatenate([p.y_train, p.y_test]))) <= set(range(10))
    model = task.build_model()
    assert model(torch.as_tensor(parts[0].x_train[:2])).shape == (2, 10)


def test_mnist_truncated_gzip_is_a_data_error_naming_the_file(tmp_path):
    write_tiny_mnist(tmp_path)
    path = tmp_path / MNIST_IMAGES
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    task = registry.create("mnist", data_dir=str(tmp_path))
    with data_error_naming(path) as err:
        task.load_pool()
    assert "not a readable gzip file" in str(err.value)


@pytest.mark.parametrize("damage", ["not-gzip", "corrupt-stream"])
def test_mnist_corrupt_gzip_is_a_data_error_naming_the_file(tmp_path, damage):
    write_tiny_mnist(tmp_path)
    path = tmp_path / MNIST_LABELS
    raw = bytearray(path.read_bytes())
    if damage == "not-gzip":
        raw[:4] = b"PK\x03\x04"                              # a zip header, not gzip's 1f 8b
    else:
        raw[12:-8] = bytes(b ^ 0xFF for b in raw[12:-8])      # the deflate stream, header and trailer kept
    path.write_bytes(bytes(raw))
    task = registry.create("mnist", data_dir=str(tmp_path))
    with data_error_naming(path) as err:
        task.load_pool()
    assert "not a readable gzip file" in str(err.value)
    assert err.value.__cause__ is None and err.value.__suppress_context__   # no bare zlib/gzip traceback


def test_mnist_short_header_and_mismatched_sizes_are_data_errors(tmp_path):
    write_tiny_mnist(tmp_path)
    labels = tmp_path / MNIST_LABELS
    labels.write_bytes(gzip.compress(b"\x00\x00\x08"))            # 3 bytes: shorter than the 8-byte header
    task = registry.create("mnist", data_dir=str(tmp_path))
    with pytest.raises(DataError, match=re.escape(str(labels)) + ".*8-byte IDX header"):
        task.load_pool()
    labels.write_bytes(gzip.compress(idx_bytes(np.zeros(39, np.uint8))))   # 39 labels for 40 images
    with pytest.raises(DataError, match="sizes do not match"):
        task.load_pool()


def test_missing_data_file_names_the_file(tmp_path):
    task = registry.create("mnist", data_dir=str(tmp_path))
    with pytest.raises(DataError, match="train-images-idx3-ubyte.gz"):
        task.client_data(0, 2)
    (tmp_path / "mnist").mkdir()
    (tmp_path / MNIST_IMAGES).write_bytes(gzip.compress(idx_bytes(tiny_mnist_arrays(4)[0])))
    with pytest.raises(DataError, match="train-labels-idx1-ubyte.gz"):
        task.client_data(0, 2)
    cifar = registry.create("cifar10", data_dir=str(tmp_path))
    with pytest.raises(DataError, match="cifar10-jpg-train.tar.gz"):
        cifar.client_data(0, 2)


# --------------------------------------------------------------------------- CIFAR-10


def test_cifar_loader_decodes_jpegs_normalises_and_caches(tmp_path, private_cache, monkeypatch):
    tar_path = write_tiny_cifar(tmp_path / "data", per_class=3)
    task = registry.create("cifar10", data=DataConfig(min_partition_size=5), data_dir=str(tmp_path / "data"))
    x, y = task.load_pool()
    assert x.shape == (30, 3, 32, 32) and x.dtype == np.float32
    assert y.dtype == np.int64 and np.array_equal(np.bincount(y), np.full(10, 3))  # label = class folder

    raw = x * labeled.CIFAR10.std + labeled.CIFAR10.mean                     # undo the normalisation
    for i, label in enumerate(y):
        k = int(np.flatnonzero(y == label).tolist().index(i))                 # tar order: 0000, 0001, ...
        want = np.array(class_colour(int(label), k), np.float32)[:, None, None] / 255.0
        np.testing.assert_allclose(raw[i], np.broadcast_to(want, (3, 32, 32)), atol=3 / 255)

    cached = sorted(p.name for p in private_cache.glob("cifar10-train-*.npy"))
    size = tar_path.stat().st_size
    assert cached == [f"cifar10-train-{size}-x.npy", f"cifar10-train-{size}-y.npy"]
    assert np.load(private_cache / cached[0]).dtype == np.uint8                 # raw pixels are cached

    def no_decoding(path):
        raise AssertionError(f"decoded {path} again instead of reading the cache")

    monkeypatch.setattr(labeled, "_decode_cifar_tar", no_decoding)
    x2, y2 = task.load_pool()
    assert np.array_equal(x2, x) and np.array_equal(y2, y)

    parts = [task.client_data(pid, 2) for pid in range(2)]
    assert sum(p.num_train + p.num_test for p in parts) == 30
    model = task.build_model()
    assert model(torch.as_tensor(parts[0].x_train[:2])).shape == (2, 10)


def cifar_damage(tmp_path: Path, damage: str) -> tuple[Path, str]:
    """A damaged CIFAR tarball under ``tmp_path/data`` and the text its DataError must carry."""
    path = tmp_path / "data" / CIFAR_TRAIN
    members = tiny_cifar_members(per_class=1)
    if damage == "truncated":
        write_tar(path, members)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        return path, "not a readable tar.gz"
    if damage == "not-gzip":
        path.parent.mkdir(parents=True)
        path.write_bytes(b"this is not a tarball\n" * 100)
        return path, "not a readable tar.gz"
    if damage == "not-a-tar":
        path.parent.mkdir(parents=True)
        path.write_bytes(gzip.compress(b"\x01" * 4096))
        return path, "not a readable tar.gz"
    if damage == "bad-jpeg":
        members["train/cat/0000.jpg"] = b"\xff\xd8 not really a jpeg"
        write_tar(path, members)
        return path, "train/cat/0000.jpg"
    if damage == "wrong-size":
        members["train/dog/0000.jpg"] = jpeg_bytes((1, 2, 3), size=(28, 28))
        write_tar(path, members)
        return path, "train/dog/0000.jpg.*28x28"
    if damage == "missing-class":
        del members["train/truck/0000.jpg"]
        write_tar(path, members)
        return path, "truck"
    if damage == "unknown-class":
        members["train/unicorn/0000.jpg"] = jpeg_bytes((1, 2, 3))
        write_tar(path, members)
        return path, "unicorn"
    if damage == "empty":
        write_tar(path, {"README": b"no images here"})
        return path, "no JPEG images"
    raise AssertionError(damage)


@pytest.mark.parametrize("damage", ["truncated", "not-gzip", "not-a-tar", "bad-jpeg", "wrong-size",
                                    "missing-class", "unknown-class", "empty"])
def test_cifar_damaged_tarball_is_a_data_error_naming_the_file(tmp_path, private_cache, damage):
    path, detail = cifar_damage(tmp_path, damage)
    task = registry.create("cifar10", data_dir=str(tmp_path / "data"))
    with data_error_naming(path) as err:
        task.client_data(0, 2)
    assert re.search(detail, str(err.value)), str(err.value)
    assert not list(private_cache.glob("cifar10-*")), "a failed decode must not leave a cache behind"


# --------------------------------------------------------------------------- the real datasets


def test_real_mnist_pool(real_data):
    root = real_data(MNIST_IMAGES, MNIST_LABELS)
    task = registry.create("mnist", data=DataConfig(max_samples=3000), data_dir=str(root))
    x, y = task.load_pool()
    assert x.shape == (60000, 1, 28, 28) and x.dtype == np.float32
    assert np.bincount(y).tolist() == [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
    assert abs(float(x.mean())) < 0.01 and abs(float(x.std()) - 1.0) < 0.01   # MNIST's mean/std constants
    d = task.client_data(0, 5)
    assert d.x_train.shape[1:] == (1, 28, 28) and d.x_train.dtype == np.float32
    assert set(np.unique(d.y_train)) <= set(range(10))
    model = task.build_model()
    assert model(torch.as_tensor(d.x_train[:2])).shape == (2, 10)


def test_real_cifar_jpeg_decoding(real_data):
    root = real_data(CIFAR_TEST)
    x, y = labeled._decode_cifar_tar(root / CIFAR_TEST)
    assert x.shape == (10000, 3, 32, 32) and x.dtype == np.uint8
    assert np.array_equal(np.bincount(y), np.full(10, 1000))
    mean = x.reshape(10000, 3, -1).mean(axis=(0, 2)) / 255.0
    np.testing.assert_allclose(mean, labeled.CIFAR10.mean.ravel(), atol=0.01)  # README: JPEG keeps the mean
    model = registry.create("cifar10").build_model()
    out = model(torch.as_tensor(x[:2].astype(np.float32) / 255))
    assert out.shape == (2, 10)
