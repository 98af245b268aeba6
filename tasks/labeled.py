"""Classification tasks over a pooled labelled dataset split by a Dirichlet partition.

``digits`` (scikit-learn's load_digits, no files needed), ``mnist`` and ``cifar10`` (from
files in the data directory; see docs/data.md). Each client gets a Dirichlet(α) share of the
pool (ALGORITHMS.md §1.3), then an 80/20 local train/test split (``data.test-fraction``).
"""

from __future__ import annotations

import gzip
import io
import logging
import os
import tarfile
import zlib
from functools import lru_cache
from pathlib import Path

import numpy as np

from graphfl.tasks.base import ClientData, DataError, Task, TaskSpec
from graphfl.tasks.partition import client_rng, dirichlet_partition, train_test_split

logger = logging.getLogger(__name__)


def default_data_dir() -> Path:
    """``$GRAPHFL_DATA``, else ``~/.cache/graphfl/data``."""
    env = os.environ.get("GRAPHFL_DATA")
    return Path(env) if env else Path.home() / ".cache" / "graphfl" / "data"


def cache_dir() -> Path:
    """Writable cache for decoded datasets (``$GRAPHFL_CACHE``, else ``~/.cache/graphfl``)."""
    env = os.environ.get("GRAPHFL_CACHE")
    path = Path(env) if env else Path.home() / ".cache" / "graphfl"
    path.mkdir(parents=True, exist_ok=True)
    return path


class LabeledPoolTask(Task):
    """A classification task whose clients split one labelled pool."""

    num_classes = 10

    def load_pool(self) -> tuple[np.ndarray, np.ndarray]:  # pragma: no cover - abstract
        raise NotImplementedError

    def resolve_data_dir(self) -> Path:
        return Path(self.data_dir) if self.data_dir else default_data_dir()

    def _partition(self, num_partitions: int) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
        key = (type(self).__name__, str(self.resolve_data_dir()), self.seed, num_partitions, self.data)
        return _partition_cached(key, self)

    def client_data(self, partition_id: int, num_partitions: int) -> ClientData:
        self.check_num_partitions(num_partitions)
        if not 0 <= partition_id < num_partitions:
            raise ValueError(f"partition id {partition_id} outside 0..{num_partitions - 1}")
        x, y, parts = self._partition(num_partitions)
        tr, te = train_test_split(parts[partition_id], self.data.test_fraction,
                                  client_rng(self.seed, 2, partition_id))
        return ClientData(x[tr], y[tr], x[te], y[te])

    def label_histogram(self, num_partitions: int) -> np.ndarray:
        """(clients × classes) counts, for docs and tests."""
        _, y, parts = self._partition(num_partitions)
        return np.stack([np.bincount(y[p], minlength=self.num_classes) for p in parts])


@lru_cache(maxsize=8)
def _partition_cached(key, task: LabeledPoolTask):
    x, y = task.load_pool()
    rng = client_rng(task.seed, 1)
    if task.data.max_samples and task.data.max_samples < len(y):
        keep = np.sort(rng.choice(len(y), task.data.max_samples, replace=False))
        x, y = x[keep], y[keep]
    num_partitions = key[3]
    parts = dirichlet_partition(y, num_partitions, task.data.dirichlet_alpha, rng,
                                min_size=task.data.min_partition_size)
    return x, y, parts


class Digits(LabeledPoolTask):
    """scikit-learn's 8×8 digits (1,797 images); MLP 64→64→10."""

    spec = TaskSpec("digits", "classification", default_nodes=4,
                    summary="scikit-learn load_digits (1,797 8x8 images), Dirichlet split, MLP")

    def load_pool(self):
        # Cached as .npy: importing scikit-learn costs ~1 s in every ClientApp process.
        x_file, y_file = cache_dir() / "digits-x.npy", cache_dir() / "digits-y.npy"
        if x_file.is_file() and y_file.is_file():
            return np.load(x_file), np.load(y_file)
        from sklearn.datasets import load_digits

        d = load_digits()
        x, y = (d.data / 16.0).astype(np.float32), d.target.astype(np.int64)
        _save_atomic(y_file, y)
        _save_atomic(x_file, x)
        return x, y

    def build_model(self):
        from graphfl.tasks.models import MLP, seeded

        return seeded(self.seed, MLP, 64, (64,), 10)


class PermutedDigits(Digits):
    """Digits over clients in 3 groups; group ``g = pid mod 3`` relabels with permutation π_g.

    A real dataset with planted cluster structure (for FeSEM / BiG-FL):

    ``cluster_labels`` = group; ``client_graph`` = a ring inside each group (no edges across).
    """

    spec = TaskSpec("digits-permuted", "classification", default_nodes=12,
                    summary="digits, 3 client groups with permuted labels (planted clusters)")
    groups = 3

    def permutation(self, group: int) -> np.ndarray:
        if group == 0:
            return np.arange(10)
        return np.random.default_rng([self.seed, 20, group]).permutation(10)

    def client_data(self, partition_id: int, num_partitions: int) -> ClientData:
        base = super().client_data(partition_id, num_partitions)
        perm = self.permutation(partition_id % self.groups)
        return ClientData(base.x_train, perm[base.y_train], base.x_test, perm[base.y_test])

    def cluster_labels(self, num_partitions: int) -> np.ndarray:
        return np.arange(num_partitions) % self.groups

    def client_graph(self, num_partitions: int) -> np.ndarray:
        adj = np.zeros((num_partitions, num_partitions))
        for g in range(self.groups):
            members = np.arange(g, num_partitions, self.groups)
            if len(members) < 2:
                continue
            for a, b in zip(members, np.roll(members, -1)):
                if a != b:
                    adj[a, b] = adj[b, a] = 1.0
        return adj


def _save_atomic(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.npy")
    np.save(tmp, array)
    tmp.replace(path)


def _require(path: Path, what: str) -> Path:
    if not path.is_file():
        raise DataError(
            f"{what}: missing file {path}. Put the dataset in the layout of docs/data.md under "
            f"--data-dir or $GRAPHFL_DATA (currently {path.parent.parent}); graphfl never "
            f"downloads data at run time."
        )
    return path


def read_idx(path: Path, offset: int) -> np.ndarray:
    """The bytes of a gzipped IDX file after its ``offset``-byte header, as uint8.

    A truncated or corrupt file is a :class:`DataError` naming it (never a bare zlib error).
    """
    try:
        with gzip.open(path, "rb") as fh:
            raw = fh.read()
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(f"{path} is not a readable gzip file ({type(exc).__name__}: {exc}); "
                        "re-copy it from the dataset's source") from None
    if len(raw) < offset:
        raise DataError(f"{path} is {len(raw)} bytes after decompression, shorter than its {offset}-byte IDX header")
    return np.frombuffer(raw, np.uint8, offset=offset)


class MNIST(LabeledPoolTask):
    """MNIST train set (60,000) from ``<data>/mnist/*-idx?-ubyte.gz``; CNN (2 conv + 2 FC)."""

    spec = TaskSpec("mnist", "classification", default_nodes=10, needs_data_dir=True,
                    summary="MNIST (IDX .gz files), Dirichlet split, 2-conv+2-FC CNN")

    def load_pool(self):
        root = self.resolve_data_dir() / "mnist"
        images = read_idx(_require(root / "train-images-idx3-ubyte.gz", "mnist"), 16)
        labels = read_idx(_require(root / "train-labels-idx1-ubyte.gz", "mnist"), 8)
        if images.size != labels.size * 784:
            raise DataError(f"mnist: {root} images/labels sizes do not match ({images.size} vs {labels.size})")
        x = ((images.reshape(-1, 1, 28, 28).astype(np.float32) / 255.0) - 0.1307) / 0.3081
        return x, labels.astype(np.int64)

    def build_model(self):
        from graphfl.tasks.models import CNN, seeded

        return seeded(self.seed, CNN, 1, 28, 10)


CIFAR_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


class CIFAR10(LabeledPoolTask):
    """CIFAR-10 train set (50,000 JPEGs in ``<data>/cifar10/cifar10-jpg-train.tar.gz``).

    Decoding is done once and cached as ``.npy`` under ``$GRAPHFL_CACHE``.
    """

    spec = TaskSpec("cifar10", "classification", default_nodes=10, needs_data_dir=True,
                    summary="CIFAR-10 (JPEG tarball), Dirichlet split, 2-conv+2-FC CNN")
    mean = np.array([0.4914, 0.4822, 0.4465], np.float32)[:, None, None]
    std = np.array([0.2470, 0.2435, 0.2616], np.float32)[:, None, None]

    def load_pool(self):
        tar_path = _require(self.resolve_data_dir() / "cifar10" / "cifar10-jpg-train.tar.gz", "cifar10")
        stat = tar_path.stat()
        stem = cache_dir() / f"cifar10-train-{stat.st_size}"
        x_file, y_file = Path(f"{stem}-x.npy"), Path(f"{stem}-y.npy")
        if x_file.is_file() and y_file.is_file():
            raw, labels = np.load(x_file), np.load(y_file)
        else:
            raw, labels = _decode_cifar_tar(tar_path)
            _save_atomic(y_file, labels)
            _save_atomic(x_file, raw)
        x = (raw.astype(np.float32) / 255.0 - self.mean) / self.std
        return x, labels

    def build_model(self):
        from graphfl.tasks.models import CNN, seeded

        return seeded(self.seed, CNN, 3, 32, 10)


class CIFAR10ResNet18(CIFAR10):
    """CIFAR-10 as :class:`CIFAR10`, with a ResNet-18 (GroupNorm, 11.17M parameters) as the model.

    The real-model-size workload: its data, split and caching are ``cifar10``'s.
    """

    spec = TaskSpec("cifar10-resnet18", "classification", default_nodes=10, needs_data_dir=True,
                    summary="CIFAR-10 (JPEG tarball), Dirichlet split, ResNet-18 with GroupNorm (11.2M parameters)")

    def build_model(self):
        from graphfl.tasks.models import ResNet18, seeded

        return seeded(self.seed, ResNet18, 3, 10)


def _decode_cifar_tar(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Decode every ``<split>/<class>/NNNN.jpg`` of a CIFAR-10 JPEG tarball to uint8 (N, 3, 32, 32).

    A corrupt or truncated tarball, an unreadable JPEG, an image that is not 32×32, an
    unknown class folder or a class with no images is a :class:`DataError` naming the file.
    """
    from PIL import Image

    logger.info("decoding %s once (cached afterwards)", path)
    images, labels = [], []
    try:
        with tarfile.open(path, "r:gz") as tar:
            for member in tar:
                if not member.isfile() or not member.name.endswith(".jpg"):
                    continue
                cls = Path(member.name).parent.name
                if cls not in CIFAR_CLASSES:
                    raise DataError(f"cifar10: unexpected class folder {cls!r} in {path}")
                fh = tar.extractfile(member)
                if fh is None:
                    raise DataError(f"cifar10: member {member.name} of {path} cannot be read")
                data = fh.read()
                try:
                    img = Image.open(io.BytesIO(data)).convert("RGB")
                except OSError as exc:  # PIL.UnidentifiedImageError and truncated images are OSErrors
                    raise DataError(f"cifar10: member {member.name} of {path} is not a readable JPEG "
                                    f"({type(exc).__name__}: {exc}); re-copy the tarball") from None
                if img.size != (32, 32):
                    raise DataError(f"cifar10: member {member.name} of {path} is {img.size[0]}x{img.size[1]}, "
                                    "not 32x32")
                images.append(np.asarray(img, dtype=np.uint8).transpose(2, 0, 1))
                labels.append(CIFAR_CLASSES.index(cls))
    except DataError:
        raise
    except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
        raise DataError(f"{path} is not a readable tar.gz file ({type(exc).__name__}: {exc}); "
                        "re-copy it from the dataset's source") from None
    if not images:
        raise DataError(f"cifar10: no JPEG images found in {path}")
    counts = np.bincount(labels, minlength=len(CIFAR_CLASSES))
    missing = [c for c, n in zip(CIFAR_CLASSES, counts) if n == 0]
    if missing:
        raise DataError(f"cifar10: {path} has no images for class folder(s) {', '.join(missing)} "
                        "(expected <split>/<class>/NNNN.jpg for all 10 classes)")
    return np.stack(images), np.asarray(labels, dtype=np.int64)
