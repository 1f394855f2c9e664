"""The hospitals' data: scikit-learn's bundled breast-cancer set (569 patients, 30
features, 2 classes), standardised with the whole set's mean and standard deviation (a
published reference normalisation, so every hospital scales its records the same way).

- :func:`breast_cancer` -- the simulation's source (``[data] source``): all records; CLMA
  splits them among the hospitals (``[data] partition = "dirichlet"``: skewed over the
  label) and applies the config's drift events (``feature_scale``: a hospital's instrument
  recalibrated).
- :func:`hospital_data` -- a SuperNode's source (node config ``data-source``): the records
  of hospital ``partition-id`` only, from a Dirichlet split of the same set, with the
  federation's ``feature_scale`` events naming this hospital applied from their round (the
  example plays a real recalibration; a real hospital reads its own records here).
- :func:`write_probe` -- the server's public probe set for a deployment (``[data] probe``).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

__all__ = ["breast_cancer", "hospital_data", "write_probe"]


def breast_cancer() -> tuple[np.ndarray, np.ndarray]:
    """``(features float32 (569, 30), labels int64 (569,))``, standardised per feature."""
    from sklearn.datasets import load_breast_cancer

    d = load_breast_cancer()
    x = d.data.astype(np.float64)
    x = (x - x.mean(axis=0)) / x.std(axis=0)
    return x.astype(np.float32), d.target.astype(np.int64)


def hospital_data(node_config: dict[str, Any], federation: Any) -> dict[str, Any]:
    """Hospital ``node_config["partition-id"]``'s records: a Dirichlet(alpha) split over
    the label of the federation's ``clients`` hospitals (seeded by the federation's seed;
    the last 64 records are left out: the server's probe set), 75% for training and 25%
    for evaluation, and the federation's ``feature_scale`` drift events naming this
    hospital applied from their round on."""
    from clma.datasets import dirichlet_partition

    pid = int(node_config["partition-id"])
    x, y = breast_cancer()
    x, y = x[:-64], y[:-64]
    rng = np.random.default_rng([federation.seed, 1])
    shards = dirichlet_partition(y, federation.clients, federation.data.dirichlet_alpha, rng)
    mine = np.asarray(shards[pid])
    mine = mine[np.random.default_rng([federation.seed, 2, pid]).permutation(len(mine))]
    n_eval = max(1, round(0.25 * len(mine)))
    train, ev = mine[n_eval:], mine[:n_eval]
    events = [e for e in federation.drift.events
              if e.kind == "feature_scale" and pid in e.clients]

    def at(idx: np.ndarray):
        def part(round_number: int) -> tuple[np.ndarray, np.ndarray]:
            xs = x[idx]
            for e in events:
                if e.round <= round_number:
                    xs = xs * np.float32(e.magnitude)
            return xs.astype(np.float32), y[idx]

        return part

    return {"train": at(train), "eval": at(ev)}


def write_probe(path: str) -> None:
    """The server's probe set: the last 64 records (no hospital holds them), as an .npz
    with a float32 array ``features`` (64, 30)."""
    x, _ = breast_cancer()
    np.savez(path, features=x[-64:])


if __name__ == "__main__":  # python -m hospitals.data probe.npz
    write_probe(sys.argv[1] if len(sys.argv) > 1 else "probe.npz")
