"""The built-in data sets (below the simulation and the devices: both load from here).

- :func:`load_digits` — scikit-learn's bundled handwritten digits (1,797 8x8 greyscale
  images, 10 classes): the embedded real dataset, no download.
- :func:`load_fashion_mnist` — Fashion-MNIST from its IDX files on disk
  (``train-images-idx3-ubyte[.gz]`` and ``train-labels-idx1-ubyte[.gz]``).
- :func:`load_cifar10` — CIFAR-10 from the python pickle batches on disk
  (``cifar-10-batches-py/data_batch_1..5``).

All loaders return a :class:`Dataset`: ``images`` float32 in [0, 1] of shape
``(n, channels, height, width)``, ``labels`` int64 ``(n,)``. Nothing is fetched from the
network.
"""

from __future__ import annotations

import gzip
import pickle
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "Dataset",
    "DatasetError",
    "load_digits",
    "load_fashion_mnist",
    "load_cifar10",
    "load_dataset",
    "holdout_split",
]


class DatasetError(ValueError):
    """A dataset file is missing or malformed. The message names the file and the rule."""


@dataclass(frozen=True)
class Dataset:
    """Features ``(n, ...)`` float32 and labels ``(n,)`` int64: the built-in data sets
    are images ``(n, c, h, w)`` in [0, 1]; a user's source (:mod:`clma.datasets`) may be
    any shape with a sample axis first."""

    images: np.ndarray
    labels: np.ndarray
    n_classes: int
    name: str

    def __post_init__(self) -> None:
        if self.images.ndim < 2:
            raise DatasetError("features must have shape (n, ...) with a feature axis")
        if self.labels.shape != (self.images.shape[0],):
            raise DatasetError("labels must have shape (n,) matching images")

    @property
    def n_features(self) -> int:
        return int(np.prod(self.images.shape[1:]))

    def subset(self, idx: np.ndarray) -> Dataset:
        return Dataset(self.images[idx], self.labels[idx], self.n_classes, self.name)


def load_digits() -> Dataset:
    """scikit-learn's handwritten digits: 1,797 images (1, 8, 8), pixel values / 16."""
    from sklearn.datasets import load_digits as _sk

    d = _sk()
    images = (d.images.astype(np.float32) / 16.0)[:, None, :, :]
    return Dataset(images, d.target.astype(np.int64), 10, "digits")


def _open_maybe_gz(path: Path):
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def _find(folder: Path, stem: str) -> Path:
    for cand in (folder / stem, folder / f"{stem}.gz"):
        if cand.exists():
            return cand
    raise DatasetError(f"{stem}[.gz] not found in {str(folder)!r}")


def read_idx(path: str | Path) -> np.ndarray:
    """Read an IDX file (the MNIST/Fashion-MNIST format), optionally gzip-compressed.

    Raises :class:`DatasetError` on a missing or unreadable file, a corrupt gzip stream, a
    bad magic number, an unsupported type code, a truncated header, or a payload whose
    size does not match the header.
    """
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path.name}: IDX file not found in {str(path.parent)!r}")
    try:
        with _open_maybe_gz(path) as fh:
            head = fh.read(4)
            if len(head) != 4 or head[0] != 0 or head[1] != 0:
                raise DatasetError(f"{path.name}: not an IDX file (bad magic number)")
            type_code, ndim = head[2], head[3]
            if type_code != 0x08:
                raise DatasetError(f"{path.name}: IDX type code must be 0x08 (unsigned byte)")
            raw_dims = fh.read(4 * ndim)
            if len(raw_dims) != 4 * ndim:
                raise DatasetError(f"{path.name}: truncated IDX header ({ndim} dimensions)")
            dims = struct.unpack(f">{ndim}I", raw_dims)
            payload = fh.read()
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise DatasetError(f"{path.name}: unreadable (corrupt gzip or I/O error)") from exc
    expected = int(np.prod(dims)) if dims else 0
    if len(payload) != expected:
        raise DatasetError(f"{path.name}: payload size does not match the IDX header")
    return np.frombuffer(payload, dtype=np.uint8).reshape(dims)


def load_fashion_mnist(folder: str | Path, *, split: str = "train") -> Dataset:
    """Fashion-MNIST (or MNIST) from IDX files in ``folder``; ``split`` 'train' or 't10k'."""
    if split not in ("train", "t10k"):
        raise DatasetError("split must be 'train' or 't10k'")
    folder = Path(folder)
    images = read_idx(_find(folder, f"{split}-images-idx3-ubyte"))
    labels = read_idx(_find(folder, f"{split}-labels-idx1-ubyte"))
    if images.ndim != 3 or labels.ndim != 1 or images.shape[0] != labels.shape[0]:
        raise DatasetError("images must be (n, h, w) and labels (n,) with the same n")
    if labels.size and labels.max() > 9:
        raise DatasetError("labels must be in 0..9")
    return Dataset(
        (images.astype(np.float32) / 255.0)[:, None], labels.astype(np.int64), 10,
        "fashion_mnist",
    )


def load_cifar10(folder: str | Path, *, batches: tuple[int, ...] = (1, 2, 3, 4, 5)) -> Dataset:
    """CIFAR-10 from the python pickle batches (``data_batch_<i>``) in ``folder``.

    Each batch holds ``b'data'`` (n, 3072) uint8 in channel-major order and ``b'labels'``.
    """
    folder = Path(folder)
    xs, ys = [], []
    for b in batches:
        path = folder / f"data_batch_{b}"
        if not path.exists():
            raise DatasetError(f"data_batch_{b} not found in {str(folder)!r}")
        with open(path, "rb") as fh:
            try:
                batch = pickle.load(fh, encoding="bytes")  # noqa: S301 - the dataset's format
            except Exception as exc:  # noqa: BLE001
                raise DatasetError(f"data_batch_{b}: not a CIFAR-10 pickle batch") from exc
        if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
            raise DatasetError(f"data_batch_{b}: missing b'data' or b'labels'")
        data = np.asarray(batch[b"data"], dtype=np.uint8)
        if data.ndim != 2 or data.shape[1] != 3072:
            raise DatasetError(f"data_batch_{b}: b'data' must have shape (n, 3072)")
        xs.append(data.reshape(-1, 3, 32, 32))
        ys.append(np.asarray(batch[b"labels"], dtype=np.int64))
    images = np.concatenate(xs).astype(np.float32) / 255.0
    labels = np.concatenate(ys)
    if labels.shape[0] != images.shape[0] or (labels.size and labels.max() > 9):
        raise DatasetError("labels must be one per image, in 0..9")
    return Dataset(images, labels, 10, "cifar10")


def load_dataset(name: str, data_dir: str | None = None) -> Dataset:
    """Dispatch on the config's ``data.dataset``."""
    if name == "digits":
        return load_digits()
    if data_dir is None:
        raise DatasetError(f"data.data_dir is required for dataset {name!r}")
    if name == "fashion_mnist":
        return load_fashion_mnist(data_dir)
    if name == "cifar10":
        return load_cifar10(data_dir)
    raise DatasetError(f"data.dataset must be digits, fashion_mnist or cifar10, not {name!r}")


@dataclass(frozen=True)
class HoldoutSplit:
    """Indices of the fixed held-out test set, the shared probe set and the client pool."""

    test: np.ndarray
    probe: np.ndarray
    pool: np.ndarray


def holdout_split(
    labels: np.ndarray, *, holdout_fraction: float, probe_size: int, seed: int
) -> HoldoutSplit:
    """A fixed, stratified held-out split; the probe set is drawn i.i.d. from it.

    The held-out part (``holdout_fraction`` of the data, stratified by label) is split into
    the probe set (``probe_size`` samples) and the test set (the rest). The remaining pool
    is divided among clients. Raises :class:`DatasetError` if the probe does not fit.
    """
    from sklearn.model_selection import train_test_split

    idx = np.arange(labels.shape[0])
    pool, held = train_test_split(
        idx, test_size=holdout_fraction, stratify=labels, random_state=seed
    )
    if probe_size >= held.shape[0]:
        raise DatasetError(
            "data.probe_size must be smaller than the held-out split "
            "(holdout_fraction * dataset size)"
        )
    rng = np.random.default_rng(seed)
    held = rng.permutation(held)
    return HoldoutSplit(
        test=np.sort(held[probe_size:]), probe=np.sort(held[:probe_size]), pool=np.sort(pool)
    )
