"""Which clients are atypical: one-sided, two-sided and persistence-based flags on robust z.

The scores of :mod:`clma.divergence.scores` give every client of a round a robust z
(``(D_c - median) / (1.4826 MAD)``). The paper's claim (arXiv:2605.22266, Pérez-Corral et
al. 2026, Sec. 4-5) is that a shifting client shows *consistently* different divergence
across rounds; a shifted client can also be atypical by diverging much *less* than the
others (e.g. a client alone in its cohort, scored against its own previous model). Three
flags, all with the robust z of one signal as input:

* ``one_sided``: ``z > z_threshold`` (the library's original rule, :func:`build_report`);
* ``two_sided``: ``|z| > z_threshold``;
* ``persistent``: an exponentially weighted moving average of each client's *clipped* z,

  ``s_0 = 0``, ``s_t = lam * clip(z_t, -c, c) + (1 - lam) * s_{t-1}``,

  flagged when **both** ``|s_t| > persistence_threshold`` (absolute: the smoothed z is
  large in z units) **and** ``|zs_t| > z_threshold``, with ``zs`` the robust z (median,
  1.4826 MAD, :func:`clma.divergence.robust_z_stats`) of ``s`` across the round's clients
  (relative: the client's smoothed z stands out from the other clients' smoothed z). EWMA
  control chart of Roberts (1959), Technometrics 1(3). The absolute condition alone
  assumes the robust z of a regular client is i.i.d. N(0, 1), for which ``s`` has the
  asymptotic standard deviation ``sqrt(lam / (2 - lam))`` (Lucas & Saccucci, 1990,
  Technometrics 32(1); 0.42 at ``lam = 0.3``). Measured on ``clma experiment
  atypical-client`` it is not: regular clients keep a level of their own (label mix) and
  their per-round z are heavy-tailed, so their ``s`` spreads about twice as wide
  (docs/atypical_client.md). The relative condition calibrates the flag to that spread as
  the federation shows it, the same outlier rule as the per-round z; the absolute one keeps
  it from firing when every ``s`` is small and the 10-client MAD is tiny. Clipping at
  ``c`` (default 3, the default ``z_threshold``: a round counts at most as much as a round
  just flagged per round) bounds one round's influence: from ``s = 0`` no fewer than
  four rounds pass ``|s| > 2`` (at the clip, ``3 (1 - 0.7^4) = 2.28``; three give 1.97).

A client that misses a round (no finite z) keeps its ``s``; a client seen for the first
time starts from ``s = 0``. The state (client id -> ``s``) is server-side state
(:class:`clma.engine.state.ServerState`), never published.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping

import numpy as np

from clma.divergence.scores import robust_z_stats

__all__ = [
    "FLAG_KINDS",
    "ewma_step",
    "flag_clients",
    "one_sided_flags",
    "persistence_z",
    "persistent_flags",
    "two_sided_flags",
    "update_persistence",
]

FLAG_KINDS = ("one_sided", "two_sided", "persistent")


def _check_positive(value: object, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{field} must be a real number")
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{field} must be finite and > 0")
    return value


def _check_lam(lam: object) -> float:
    lam = _check_positive(lam, "lam")
    if lam > 1:
        raise ValueError("lam must be in (0, 1]")
    return lam


def _finite(z: float) -> bool:
    return isinstance(z, int | float) and math.isfinite(z)


def one_sided_flags(z: Mapping[int, float], z_threshold: float) -> list[int]:
    """Clients with ``z > z_threshold`` (NaN never flags), sorted.

    Args:
        z: client id -> robust z of one round.
        z_threshold: finite, > 0.
    """
    t = _check_positive(z_threshold, "z_threshold")
    return sorted(c for c, v in z.items() if _finite(v) and v > t)


def two_sided_flags(z: Mapping[int, float], z_threshold: float) -> list[int]:
    """Clients with ``|z| > z_threshold`` (NaN never flags), sorted.

    Args:
        z: client id -> robust z of one round.
        z_threshold: finite, > 0.
    """
    t = _check_positive(z_threshold, "z_threshold")
    return sorted(c for c, v in z.items() if _finite(v) and abs(v) > t)


def ewma_step(previous: float, z: float, *, lam: float = 0.3, clip: float = 3.0) -> float:
    """One EWMA step ``lam * clip(z, -clip, clip) + (1 - lam) * previous`` (module docstring).

    Args:
        previous: ``s_{t-1}`` (0 for a client's first round), finite.
        z: this round's robust z, finite.
        lam: weight of the new value, in ``(0, 1]``.
        clip: bound on ``|z|`` before averaging, finite and > 0.

    Raises:
        TypeError / ValueError: non-finite ``previous`` or ``z``; ``lam`` or ``clip`` out of
            range.
    """
    lam = _check_lam(lam)
    clip = _check_positive(clip, "clip")
    if not (_finite(previous) and _finite(z)):
        raise ValueError("previous and z must be finite")
    return lam * min(max(float(z), -clip), clip) + (1.0 - lam) * float(previous)


def update_persistence(
    state: Mapping[int, float], z: Mapping[int, float], *, lam: float = 0.3,
    clip: float = 3.0,
) -> dict[int, float]:
    """The persistence state after one round: a new dict, ``state`` is not changed.

    Args:
        state: client id -> ``s_{t-1}`` (clients never seen are absent: they start at 0).
        z: client id -> this round's robust z; a NaN z (fewer than 3 clients) leaves the
            client's ``s`` unchanged, as does absence from the round.
        lam, clip: see :func:`ewma_step`.

    Returns:
        client id -> ``s_t`` for every client in ``state`` or ``z`` with a finite z.
    """
    out = {int(c): float(v) for c, v in state.items()}
    for c, v in z.items():
        if _finite(v):
            out[int(c)] = ewma_step(out.get(int(c), 0.0), v, lam=lam, clip=clip)
    return out


def persistence_z(state: Mapping[int, float],
                  clients: Collection[int] | None = None) -> dict[int, float]:
    """Robust z of the EWMA ``s`` across clients: ``(s_c - median) / scale``.

    Args:
        state: client id -> EWMA ``s`` (:func:`update_persistence`).
        clients: the clients to standardise over (the round's); ``None``: all of ``state``.
            A client absent from ``state`` has ``s = 0``.

    Returns:
        client id -> ``zs`` (float; NaN for all with fewer than 3 clients), the median /
        1.4826 MAD rule of :func:`clma.divergence.robust_z_stats` applied to ``s``.
    """
    ids = sorted(state) if clients is None else sorted({int(c) for c in clients})
    s = np.array([float(state.get(c, 0.0)) for c in ids], dtype=np.float64)
    return dict(zip(ids, (float(v) for v in robust_z_stats(s).z), strict=True))


def persistent_flags(state: Mapping[int, float], persistence_threshold: float,
                     z_threshold: float, clients: Collection[int] | None = None
                     ) -> list[int]:
    """Clients with ``|s| > persistence_threshold`` and ``|zs| > z_threshold``, sorted.

    Args:
        state: client id -> EWMA ``s`` (:func:`update_persistence`).
        persistence_threshold: bound on ``|s|``, finite, > 0.
        z_threshold: bound on ``|zs|`` (:func:`persistence_z`), finite, > 0.
        clients: optional collection: only these clients are standardised together and
            can be flagged (the round's); ``None``: every client of ``state``.

    Raises:
        TypeError / ValueError: a threshold that is not a finite number > 0.
    """
    t = _check_positive(persistence_threshold, "persistence_threshold")
    tz = _check_positive(z_threshold, "z_threshold")
    zs = persistence_z(state, clients)
    return sorted(c for c, q in zs.items()
                  if abs(state.get(c, 0.0)) > t and _finite(q) and abs(q) > tz)


def flag_clients(
    kind: str, z: Mapping[int, float], persistence: Mapping[int, float], *,
    z_threshold: float, persistence_threshold: float,
) -> list[int]:
    """The clients of one round flagged under ``kind`` (:data:`FLAG_KINDS`), sorted.

    ``persistence`` is the state *after* this round (:func:`update_persistence`); only
    clients present in ``z`` can be flagged, and under ``persistent`` their ``s`` are
    standardised together (:func:`persistent_flags`). Raises ``ValueError`` for another
    kind.
    """
    if kind == "one_sided":
        return one_sided_flags(z, z_threshold)
    if kind == "two_sided":
        return two_sided_flags(z, z_threshold)
    if kind == "persistent":
        return persistent_flags(persistence, persistence_threshold, z_threshold,
                                clients=list(z))
    raise ValueError("divergence.flag must be 'one_sided', 'two_sided' or 'persistent'")
