"""CIFAR-10's python-version batch files (``data_batch_1`` .. ``data_batch_5``,
``test_batch``: pickled dicts with ``data`` uint8 (N, 3072) in channel-major order and
``labels``), read with :func:`clma.datasets.load_cifar10`.

- The simulation reads them itself: ``[data] dataset = "cifar10"``, ``data_dir``.
- :func:`site_images` -- a SuperNode's source (node config ``data-source``, with
  ``data-dir`` naming the folder): the images of client ``partition-id`` only (an IID
  split of the training batches seeded by the federation's seed, 75% training, 25%
  evaluation), with the federation's ``label_rotation`` events naming it applied from
  their round (the example plays the drift; a real site reads its own images here).
- :func:`write_probe` -- the server's public probe set: the first 64 images of
  ``test_batch`` (no client holds them).
- :func:`write_batches` -- small files in exactly that format, for trying the example
  without the real data set (the tests use them; their figures are not CIFAR-10's).
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["site_images", "write_batches", "write_probe"]


def site_images(node_config: dict[str, Any], federation: Any) -> dict[str, Any]:
    """Client ``node_config["partition-id"]``'s images from ``node_config["data-dir"]``."""
    from clma.datasets import iid_partition, load_cifar10

    pid = int(node_config["partition-id"])
    ds = load_cifar10(node_config["data-dir"])
    rng = np.random.default_rng([federation.seed, 1])
    shards = iid_partition(ds.labels.shape[0], federation.clients, rng)
    mine = np.asarray(shards[pid])
    n_eval = max(1, round(0.25 * len(mine)))
    train, ev = mine[n_eval:], mine[:n_eval]
    shifts = [(e.round, e.shift) for e in federation.drift.events
              if e.kind == "label_rotation" and pid in e.clients]

    def at(idx: np.ndarray):
        def part(round_number: int) -> tuple[np.ndarray, np.ndarray]:
            y = ds.labels[idx]
            for r, shift in shifts:
                if r <= round_number:
                    y = (y + shift) % 10
            return ds.images[idx], y.astype(np.int64)

        return part

    return {"train": at(train), "eval": at(ev)}


def _read(path: Path) -> dict:
    with open(path, "rb") as f:
        return pickle.load(f, encoding="bytes")  # noqa: S301 - CIFAR-10's own format


def write_probe(data_dir: str, path: str) -> None:
    """The first 64 images of ``test_batch`` as an .npz with float32 ``features``
    (64, 3, 32, 32) in [0, 1]."""
    batch = _read(Path(data_dir) / "test_batch")
    x = np.asarray(batch[b"data"][:64], dtype=np.uint8).reshape(-1, 3, 32, 32)
    np.savez(path, features=(x.astype(np.float32) / 255.0))


def write_batches(folder: str, per_batch: int = 200, seed: int = 0) -> None:
    """Small batch files in CIFAR-10's python format (``data_batch_1`` .. ``5`` and
    ``test_batch``, ``per_batch`` images each): each class a colour and a stripe
    orientation under noise, so a CNN can learn them. Not CIFAR-10."""
    rng = np.random.default_rng(seed)
    colours = rng.uniform(0.2, 0.8, size=(10, 3))
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in names:
        y = rng.integers(0, 10, size=per_batch)
        img = np.empty((per_batch, 3, 32, 32), np.float32)
        grid = np.arange(32)
        for k, c in enumerate(y):
            stripes = ((grid[:, None] if c % 2 else grid[None, :]) // (2 + c // 2)) % 2
            img[k] = colours[c][:, None, None] * (0.6 + 0.4 * stripes)[None]
        img += rng.normal(0, 0.08, size=img.shape)
        data = (np.clip(img, 0, 1) * 255).astype(np.uint8).reshape(per_batch, 3072)
        with open(out / name, "wb") as f:
            pickle.dump({b"data": data, b"labels": [int(v) for v in y],
                         b"batch_label": name.encode()}, f)


if __name__ == "__main__":  # python -m cifar.data small DIR | probe DATA_DIR OUT
    if sys.argv[1] == "small":
        write_batches(sys.argv[2])
    else:
        write_probe(sys.argv[2], sys.argv[3])
