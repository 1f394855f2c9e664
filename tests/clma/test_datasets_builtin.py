"""clma.datasets.builtin: digits, IDX (Fashion-MNIST) and CIFAR-10 pickle loaders, held-out split."""

from __future__ import annotations

import gzip
import pickle
import struct

import numpy as np
import pytest

from clma.datasets.builtin import (
    Dataset,
    DatasetError,
    holdout_split,
    load_cifar10,
    load_dataset,
    load_digits,
    load_fashion_mnist,
    read_idx,
)


def _idx_bytes(arr: np.ndarray) -> bytes:
    arr = np.asarray(arr, dtype=np.uint8)
    head = bytes([0, 0, 0x08, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape)
    return head + arr.tobytes()


def _write(path, data: bytes, gz: bool):
    if gz:
        with gzip.open(path, "wb") as fh:
            fh.write(data)
    else:
        path.write_bytes(data)


@pytest.fixture
def fmnist_arrays():
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(5, 28, 28), dtype=np.uint8)
    images[0, 0, 0], images[1, 0, 0] = 0, 255
    labels = np.array([0, 9, 3, 3, 7], dtype=np.uint8)
    return images, labels


@pytest.mark.parametrize("gz", [False, True])
def test_fashion_mnist_idx_round_trip(tmp_path, fmnist_arrays, gz):
    images, labels = fmnist_arrays
    suffix = ".gz" if gz else ""
    _write(tmp_path / f"train-images-idx3-ubyte{suffix}", _idx_bytes(images), gz)
    _write(tmp_path / f"train-labels-idx1-ubyte{suffix}", _idx_bytes(labels), gz)
    ds = load_fashion_mnist(tmp_path)
    assert ds.name == "fashion_mnist" and ds.n_classes == 10
    assert ds.images.shape == (5, 1, 28, 28) and ds.images.dtype == np.float32
    assert ds.labels.dtype == np.int64
    np.testing.assert_array_equal(ds.labels, labels.astype(np.int64))
    np.testing.assert_array_equal(ds.images[:, 0], images.astype(np.float32) / 255.0)
    assert ds.images.min() == 0.0 and ds.images.max() == 1.0
    assert ds.n_features == 784


def test_read_idx_plain_and_gz_equal(tmp_path, fmnist_arrays):
    images, _ = fmnist_arrays
    _write(tmp_path / "a", _idx_bytes(images), False)
    _write(tmp_path / "a.gz", _idx_bytes(images), True)
    np.testing.assert_array_equal(read_idx(tmp_path / "a"), images)
    np.testing.assert_array_equal(read_idx(tmp_path / "a.gz"), images)


def test_t10k_split_and_bad_split(tmp_path, fmnist_arrays):
    images, labels = fmnist_arrays
    _write(tmp_path / "t10k-images-idx3-ubyte", _idx_bytes(images[:2]), False)
    _write(tmp_path / "t10k-labels-idx1-ubyte", _idx_bytes(labels[:2]), False)
    assert load_fashion_mnist(tmp_path, split="t10k").images.shape == (2, 1, 28, 28)
    with pytest.raises(DatasetError, match="split must be"):
        load_fashion_mnist(tmp_path, split="valid")


def test_idx_bad_magic(tmp_path, fmnist_arrays):
    images, _ = fmnist_arrays
    data = bytearray(_idx_bytes(images))
    data[0] = 0x1F
    (tmp_path / "x").write_bytes(bytes(data))
    with pytest.raises(DatasetError, match="bad magic number"):
        read_idx(tmp_path / "x")


def test_idx_bad_type_code(tmp_path, fmnist_arrays):
    images, _ = fmnist_arrays
    data = bytearray(_idx_bytes(images))
    data[2] = 0x0D  # float
    (tmp_path / "x").write_bytes(bytes(data))
    with pytest.raises(DatasetError, match="type code"):
        read_idx(tmp_path / "x")


@pytest.mark.parametrize("delta", [-1, +1])
def test_idx_payload_size_mismatch(tmp_path, fmnist_arrays, delta):
    images, _ = fmnist_arrays
    data = _idx_bytes(images)
    data = data[:-1] if delta < 0 else data + b"\x00"
    _write(tmp_path / "x.gz", data, True)
    with pytest.raises(DatasetError, match="payload size does not match"):
        read_idx(tmp_path / "x.gz")


def test_idx_truncated_header(tmp_path):
    # magic says 3 dimensions but only one dimension follows
    (tmp_path / "x").write_bytes(bytes([0, 0, 8, 3]) + struct.pack(">I", 5))
    with pytest.raises(DatasetError, match="header"):
        read_idx(tmp_path / "x")


def test_idx_missing_and_not_gzip(tmp_path):
    with pytest.raises(DatasetError, match="not found"):
        read_idx(tmp_path / "absent")
    (tmp_path / "y.gz").write_bytes(b"\x00\x00\x08\x01" + struct.pack(">I", 1) + b"\x05")
    with pytest.raises(DatasetError, match="gzip"):
        read_idx(tmp_path / "y.gz")


def test_fashion_mnist_missing_files_and_count_mismatch(tmp_path, fmnist_arrays):
    images, labels = fmnist_arrays
    with pytest.raises(DatasetError, match=r"train-images-idx3-ubyte\[\.gz\] not found"):
        load_fashion_mnist(tmp_path)
    _write(tmp_path / "train-images-idx3-ubyte", _idx_bytes(images), False)
    with pytest.raises(DatasetError, match=r"train-labels-idx1-ubyte\[\.gz\] not found"):
        load_fashion_mnist(tmp_path)
    _write(tmp_path / "train-labels-idx1-ubyte", _idx_bytes(labels[:4]), False)
    with pytest.raises(DatasetError, match="same n"):
        load_fashion_mnist(tmp_path)
    _write(tmp_path / "train-labels-idx1-ubyte", _idx_bytes(np.array([0, 1, 2, 3, 10])), False)
    with pytest.raises(DatasetError, match=r"0\.\.9"):
        load_fashion_mnist(tmp_path)


def _cifar_batch(n: int, seed: int) -> tuple[np.ndarray, list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(n, 3072), dtype=np.uint8), [int(v) for v in
                                                                  rng.integers(0, 10, n)]


def _write_cifar(folder, b: int, data, labels):
    with open(folder / f"data_batch_{b}", "wb") as fh:
        pickle.dump({b"data": data, b"labels": labels, b"batch_label": b"x"}, fh)


def test_cifar10_pickle_batches_channel_major(tmp_path):
    d1, l1 = _cifar_batch(3, 1)
    d2, l2 = _cifar_batch(2, 2)
    _write_cifar(tmp_path, 1, d1, l1)
    _write_cifar(tmp_path, 2, d2, l2)
    ds = load_cifar10(tmp_path, batches=(1, 2))
    assert ds.name == "cifar10" and ds.images.shape == (5, 3, 32, 32)
    assert ds.images.dtype == np.float32 and ds.labels.dtype == np.int64
    np.testing.assert_array_equal(ds.labels, np.array(l1 + l2))
    # channel-major: the first 1024 bytes are the red plane, row by row
    assert ds.images[0, 0, 0, 0] == np.float32(d1[0, 0]) / 255.0
    assert ds.images[0, 0, 0, 1] == np.float32(d1[0, 1]) / 255.0
    assert ds.images[0, 0, 1, 0] == np.float32(d1[0, 32]) / 255.0
    assert ds.images[0, 1, 0, 0] == np.float32(d1[0, 1024]) / 255.0
    assert ds.images[0, 2, 31, 31] == np.float32(d1[0, 3071]) / 255.0
    np.testing.assert_array_equal(ds.images[3:].reshape(2, -1), d2.astype(np.float32) / 255.0)
    assert 0.0 <= ds.images.min() and ds.images.max() <= 1.0


def test_cifar10_malformed(tmp_path):
    with pytest.raises(DatasetError, match="data_batch_1 not found"):
        load_cifar10(tmp_path, batches=(1,))
    (tmp_path / "data_batch_1").write_bytes(b"not a pickle")
    with pytest.raises(DatasetError, match="not a CIFAR-10 pickle batch"):
        load_cifar10(tmp_path, batches=(1,))
    with open(tmp_path / "data_batch_1", "wb") as fh:
        pickle.dump({b"data": np.zeros((1, 3072), np.uint8)}, fh)
    with pytest.raises(DatasetError, match="missing b'data' or b'labels'"):
        load_cifar10(tmp_path, batches=(1,))
    _write_cifar(tmp_path, 1, np.zeros((2, 3000), np.uint8), [0, 1])
    with pytest.raises(DatasetError, match=r"shape \(n, 3072\)"):
        load_cifar10(tmp_path, batches=(1,))
    _write_cifar(tmp_path, 1, np.zeros((2, 3072), np.uint8), [0])
    with pytest.raises(DatasetError, match="one per image"):
        load_cifar10(tmp_path, batches=(1,))
    _write_cifar(tmp_path, 1, np.zeros((2, 3072), np.uint8), [0, 12])
    with pytest.raises(DatasetError, match=r"0\.\.9"):
        load_cifar10(tmp_path, batches=(1,))


def test_digits_shape_dtype_range():
    ds = load_digits()
    assert ds.images.shape == (1797, 1, 8, 8) and ds.images.dtype == np.float32
    assert ds.labels.shape == (1797,) and ds.labels.dtype == np.int64
    assert ds.images.min() == 0.0 and ds.images.max() == 1.0
    assert set(np.unique(ds.labels).tolist()) == set(range(10))
    assert ds.n_classes == 10 and ds.n_features == 64
    from sklearn.datasets import load_digits as sk

    np.testing.assert_array_equal(ds.images[:, 0] * 16.0, sk().images)


def test_load_dataset_dispatch_errors():
    assert load_dataset("digits").name == "digits"
    with pytest.raises(DatasetError, match="data_dir is required"):
        load_dataset("fashion_mnist")
    with pytest.raises(DatasetError, match="must be digits"):
        load_dataset("imagenet", "/tmp")


def test_dataset_shape_checks_and_subset():
    with pytest.raises(DatasetError, match=r"features must have shape \(n, ...\)"):
        Dataset(np.zeros(2, np.float32), np.zeros(2, np.int64), 10, "x")
    assert Dataset(np.zeros((2, 8), np.float32), np.zeros(2, np.int64), 10, "x").n_features == 8
    with pytest.raises(DatasetError, match="labels"):
        Dataset(np.zeros((2, 1, 8, 8), np.float32), np.zeros(3, np.int64), 10, "x")
    ds = load_digits().subset(np.array([5, 1]))
    assert ds.images.shape == (2, 1, 8, 8)
    np.testing.assert_array_equal(ds.labels, load_digits().labels[[5, 1]])


def test_holdout_split_disjoint_stratified_reproducible():
    labels = load_digits().labels
    s = holdout_split(labels, holdout_fraction=0.2, probe_size=128, seed=0)
    n = labels.shape[0]
    assert s.probe.shape == (128,)
    held = np.concatenate([s.test, s.probe])
    assert held.shape[0] == int(np.ceil(0.2 * n))  # sklearn rounds the test share up
    allidx = np.concatenate([s.pool, s.test, s.probe])
    assert np.array_equal(np.sort(allidx), np.arange(n))  # disjoint cover
    # stratified: each class's held-out share within 1 sample of 20 %
    for c in range(10):
        n_c = int((labels == c).sum())
        assert abs(int((labels[held] == c).sum()) - 0.2 * n_c) <= 1.0
    s2 = holdout_split(labels, holdout_fraction=0.2, probe_size=128, seed=0)
    for a, b in ((s.test, s2.test), (s.probe, s2.probe), (s.pool, s2.pool)):
        np.testing.assert_array_equal(a, b)
    s3 = holdout_split(labels, holdout_fraction=0.2, probe_size=128, seed=1)
    assert not np.array_equal(s.probe, s3.probe)
    with pytest.raises(DatasetError, match="probe_size"):
        holdout_split(labels, holdout_fraction=0.05, probe_size=90, seed=0)
