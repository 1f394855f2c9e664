"""Dividing the client pool among clients: IID shards or Dirichlet(alpha) over labels."""

from __future__ import annotations

import numpy as np

__all__ = ["PartitionError", "iid_partition", "dirichlet_partition"]


class PartitionError(ValueError):
    """No Dirichlet draw gave every client its minimum size (a property of the seed, the
    alpha and the number of clients, not of the code): the federation cannot be built."""


def iid_partition(n_samples: int, n_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffle ``range(n_samples)`` and cut it into ``n_clients`` near-equal shards.

    Returns a list of sorted int64 index arrays. Raises ValueError if a client would get
    fewer than 2 samples.
    """
    if n_clients < 1 or n_samples < 2 * n_clients:
        raise ValueError("clients: each client needs at least 2 samples (too many clients)")
    perm = rng.permutation(n_samples)
    return [np.sort(s) for s in np.array_split(perm, n_clients)]


def dirichlet_partition(
    labels: np.ndarray,
    n_clients: int,
    alpha: float,
    rng: np.random.Generator,
    *,
    min_size: int = 8,
    max_tries: int = 100,
) -> list[np.ndarray]:
    """Label-skewed partition: for each class, client shares ~ Dirichlet(alpha * 1).

    Small ``alpha`` gives very skewed clients; large ``alpha`` approaches IID. Draws are
    repeated (up to ``max_tries``) until every client has at least ``min_size`` samples
    (Hsu et al., 2019, "Measuring the effects of non-identical data distribution").
    Returns sorted int64 index arrays into ``labels``. Raises ValueError for a bad argument
    and :class:`PartitionError` (a ValueError) when no draw of ``max_tries`` fits.
    """
    if alpha <= 0:
        raise ValueError("data.dirichlet_alpha must be positive")
    if labels.shape[0] < n_clients * min_size:
        raise ValueError("clients: not enough samples for the minimum client size")
    classes = np.unique(labels)
    for _ in range(max_tries):
        shards: list[list[int]] = [[] for _ in range(n_clients)]
        for c in classes:
            idx = rng.permutation(np.flatnonzero(labels == c))
            props = rng.dirichlet(np.full(n_clients, alpha))
            cuts = (np.cumsum(props) * idx.shape[0]).astype(int)[:-1]
            for k, part in enumerate(np.split(idx, cuts)):
                shards[k].extend(part.tolist())
        if min(len(s) for s in shards) >= min_size:
            return [np.sort(np.asarray(s, dtype=np.int64)) for s in shards]
    raise PartitionError(
        "data.dirichlet_alpha: no partition with at least "
        f"{min_size} samples per client found in {max_tries} draws; raise alpha or lower clients"
    )
