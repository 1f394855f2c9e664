"""Clustered-FL peers of CLMA, as experiment baselines: CFL and IFCA.

Both run on the same simulated federation as CLMA and FedAvg (:mod:`clma.sim`: the same
clients, shards, drift schedule, local training of :class:`clma.sim.clients.SimLearner`
with the same per-client seeds, the same participation rule) and report the figures of
:class:`flows.experiments.clma_vs_fedavg.MethodRun` computed as ``flows/federation.py``
computes them for CLMA: at the end of each round, each participant's cluster model's
accuracy on its local evaluation data (stationary / drifted means), and at each drift
round the adjusted Rand index (scikit-learn) of the drifted clients' clusters against
their injected families. These are harness baselines, not product features: no privacy
release, no Prefect, no MLflow here (the experiment command logs the results).

* **CFL** -- Clustered Federated Learning (F. Sattler, K.-R. Mueller, W. Samek, IEEE
  TNNLS 32(8), 2021; arXiv 1910.01991), Algorithm 2: every cluster trains by FedAvg; a
  cluster whose weighted mean update is small (``||sum_i w_i dtheta_i|| < eps1``: the
  joint objective is near a stationary point) while some client's update is still large
  (``max_i ||dtheta_i|| > eps2``) is bi-partitioned by the cosine similarity of its
  clients' updates (Algorithm 1, :func:`cosine_bipartition`), recursively over rounds.
* **IFCA** -- Iterative Federated Clustering Algorithm (A. Ghosh, J. Chung, D. Yin,
  K. Ramchandran, NeurIPS 2020; arXiv 2006.04088), Algorithm 2 with model averaging:
  ``k`` cluster models; each round every client evaluates all ``k`` on its local training
  data, trains the one with the lowest loss, and each model is the sample-weighted mean of
  the clients that chose it (a model nobody chose is kept).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from sklearn.cluster import AgglomerativeClustering

from clma.config import FederationConfig
from clma.engine.clients import TrainSettings
from clma.params import AllParams, model_to_vector
from clma.rounds import select_clients
from clma.sim.clients import SimulatedClients
from clma.sim.federation import SimulatedFederation, build_federation
from clma.sim.training import mean_loss
from clma.sim.truth import drift_event_ari, families_separated, mean_or_none
from flows.experiments.clma_vs_fedavg import MethodRun, post_drift_rounds

__all__ = [
    "CFL_EPS1",
    "CFL_EPS2",
    "Bipartition",
    "PeerRun",
    "cosine_bipartition",
    "cosine_similarity_matrix",
    "ifca_default_k",
    "run_cfl",
    "run_ifca",
]

#: CFL's default criteria: L2 norms of float32 model updates (the model vector's units).
#: They are absolute, as in the paper, so they depend on the model, learning rate and
#: local epochs. Chosen from one measurement: the bundled clma_vs_fedavg scenario (10
#: clients, 5 local epochs), seed 0, rounds 1-5 without splits: weighted mean update
#: norm 1.88 / 3.12 / 2.00 / 1.72 / 2.42 and max 2.57 / 3.57 / 4.07 / 3.63 / 4.54 (drift
#: at rounds 3 and 5), so 2.5 / 3.5 split from the first drift round on and not before.
#: Other scenarios need their own: ``PeerRun.details["norms"]`` records every cluster's
#: mean and max update norm per round.
CFL_EPS1 = 2.5
CFL_EPS2 = 3.5


# ----------------------------------------------------------------------------- results


@dataclass(frozen=True)
class PeerRun(MethodRun):
    """One baseline run's figures: :class:`MethodRun`'s fields (accuracies in [0, 1],
    None = not measured; ``ari_per_drift_event`` keyed by the drift round as a string)
    plus the cluster assignment of every participant at the end of every round
    (``assignment_history[round][client] = cluster``) and method notes (``details``:
    CFL's splits, IFCA's ``k``)."""

    assignment_history: dict[int, dict[int, int]] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)

    def to_method_run(self) -> MethodRun:
        """The :class:`MethodRun` of this run (same fields, history dropped)."""
        keep = MethodRun.__dataclass_fields__
        return MethodRun(**{k: v for k, v in asdict(self).items() if k in keep})


# ----------------------------------------------------------------------------- CFL kernel


def cosine_similarity_matrix(updates: np.ndarray) -> np.ndarray:
    """``alpha[i, j] = <u_i, u_j> / (||u_i|| ||u_j||)`` of the rows of ``updates``
    ``(n, d)``, float64 ``(n, n)``; a zero row has similarity 0 with every other row and
    1 with itself. Raises ValueError for a non-2-D or non-finite input."""
    u = np.asarray(updates, dtype=np.float64)
    if u.ndim != 2 or u.shape[0] < 1:
        raise ValueError("updates: must be a (n_clients, n_params) array")
    if not np.isfinite(u).all():
        raise ValueError("updates: must be finite")
    norms = np.linalg.norm(u, axis=1)
    safe = np.where(norms > 0, norms, 1.0)
    unit = u / safe[:, None]
    alpha = np.clip(unit @ unit.T, -1.0, 1.0)
    np.fill_diagonal(alpha, 1.0)
    return alpha


@dataclass(frozen=True)
class Bipartition:
    """A split of one cluster: positions (into the cluster's member list) of the two
    parts, and the largest cosine similarity across them (``alpha_cross_max``) and the
    smallest within either part (``alpha_intra_min``; 1.0 for singleton parts)."""

    first: tuple[int, ...]
    second: tuple[int, ...]
    alpha_cross_max: float
    alpha_intra_min: float


def cosine_bipartition(alpha: np.ndarray) -> Bipartition:
    """CFL's optimal bipartition (Sattler et al., Algorithm 1): the split of the clients
    into two non-empty parts that minimises the largest cross-part cosine similarity
    ``max_{i in c1, j in c2} alpha[i, j]``.

    Algorithm 1 merges the clients of the most similar remaining pair until two groups
    are left: single-linkage agglomeration on the distance ``1 - alpha``
    (``sklearn.cluster.AgglomerativeClustering(metric="precomputed",
    linkage="single")``), which attains that minimum. The part holding client 0 comes
    first. Raises ValueError for fewer than 2 clients or a non-square matrix.
    """
    a = np.asarray(alpha, dtype=np.float64)
    if a.ndim != 2 or a.shape[0] != a.shape[1]:
        raise ValueError("alpha: must be a square (n, n) similarity matrix")
    n = a.shape[0]
    if n < 2:
        raise ValueError("alpha: a bipartition needs at least 2 clients")
    dist = np.clip(1.0 - (a + a.T) / 2.0, 0.0, 2.0)
    np.fill_diagonal(dist, 0.0)
    labels = AgglomerativeClustering(n_clusters=2, metric="precomputed",
                                     linkage="single").fit(dist).labels_
    first = tuple(int(i) for i in np.flatnonzero(labels == labels[0]))
    second = tuple(int(i) for i in np.flatnonzero(labels != labels[0]))
    cross = float(a[np.ix_(first, second)].max())
    intra = [float(a[np.ix_(p, p)].min()) for p in (first, second) if len(p) > 1]
    return Bipartition(first, second, cross, min(intra) if intra else 1.0)


# ----------------------------------------------------------------------------- shared loop


class _World:
    """The federation, its simulated devices and the bookkeeping both baselines share."""

    def __init__(self, config: FederationConfig, seed: int) -> None:
        data = config.model_dump()
        data["seed"] = int(seed)
        self.config = FederationConfig.model_validate(data)
        self.fed: SimulatedFederation = build_federation(self.config)
        self.clients = SimulatedClients(self.fed)
        t = self.config.training
        self.settings = TrainSettings(t.local_epochs, t.learning_rate, t.batch_size,
                                      self.config.drift.gamma)
        self.history: dict[int, dict[int, int]] = {}
        self.truth_rows: list[dict[str, Any]] = []
        self.events: dict[str, float] = {}
        self.separated: list[bool] = []

    def select(self, round_number: int) -> list[int]:
        """The engine's seeded selection (``[seed, round, 11]``, clma/engine/round.py)."""
        rng = np.random.default_rng([self.config.seed, round_number, 11])
        return select_clients(self.fed.client_ids, self.config.training.participation, rng)

    def fit(self, client: int, model: np.ndarray, round_number: int) -> tuple[np.ndarray, int]:
        res = self.clients.learners[client].fit(model, self.settings, round_number)
        return np.asarray(res.params, dtype=np.float32), int(res.n_samples)

    def record(self, round_number: int, assignment: Mapping[int, int],
               models: Mapping[int, np.ndarray]) -> None:
        """Truth of the round, as flows/federation.py's ``_truth`` computes it."""
        a = {int(c): int(k) for c, k in sorted(assignment.items())}
        self.history[round_number] = a
        evals = self.clients.truth(round_number, a, models, self.config.evaluation.loss_max)
        acc = {e.client_id: e.accuracy for e in evals}
        self.truth_rows.append({
            "round": round_number,
            "stationary_accuracy": mean_or_none(
                [acc[c] for c in self.fed.stationary_clients(round_number) if c in acc]),
            "drifted_accuracy": mean_or_none(
                [acc[c] for c in self.fed.drifted_clients(round_number) if c in acc]),
        })
        drifted_now = {c: f for c, f in self.fed.drifted_at(round_number).items() if c in a}
        if drifted_now:
            self.events[str(round_number)] = drift_event_ari(drifted_now, a)
            self.separated.append(families_separated(drifted_now, a))

    def result(self, method: str, details: dict[str, Any]) -> PeerRun:
        lo, hi = post_drift_rounds(self.config) if self.config.drift.events else (1, 0)
        window = [r["stationary_accuracy"] for r in self.truth_rows
                  if lo <= r["round"] <= hi and r["stationary_accuracy"] is not None]
        last = self.truth_rows[-1] if self.truth_rows else {}
        return PeerRun(
            method=method, seed=self.config.seed,
            stationary_final_accuracy=last.get("stationary_accuracy"),
            stationary_post_drift_accuracy=float(np.mean(window)) if window else None,
            drifted_final_accuracy=last.get("drifted_accuracy"),
            families_separated_every_event=bool(self.separated) and all(self.separated),
            ari_per_drift_event=dict(self.events),
            assignment_history=self.history, details=details)


def _weighted_mean(vectors: Sequence[np.ndarray], weights: Sequence[int]) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    return (np.tensordot(w / w.sum(), np.stack(vectors).astype(np.float64), axes=1)
            ).astype(np.float32)


# ----------------------------------------------------------------------------- CFL


def run_cfl(config: FederationConfig, seed: int, *, eps1: float = CFL_EPS1,
            eps2: float = CFL_EPS2, min_cluster_size: int = 3,
            warmup_rounds: int = 1) -> PeerRun:
    """Clustered FL (module docstring) on ``config``'s simulated federation with ``seed``.

    Each round: every selected client trains its cluster's model; for each cluster with
    at least ``min_cluster_size`` participants (the authors' code splits clusters of more
    than 2) and after ``warmup_rounds`` rounds, if ``||sum_i w_i dtheta_i|| < eps1`` and
    ``max_i ||dtheta_i|| > eps2`` (``w_i`` = sample share; L2 norms of float32 updates)
    the cluster splits by :func:`cosine_bipartition` of its updates; then every cluster's
    model becomes the sample-weighted mean of its members' trained models (FedAvg), the
    parts of a split each from their own members. Splits happen in the round whose
    updates show them, so a drift round's assignment can already separate its families.

    Returns a :class:`PeerRun` (``details["splits"]``: round, parent, sizes, norms and
    ``alpha_cross_max`` of each split; ``details["norms"]``: every cluster's mean and max
    update norm in every round, to calibrate ``eps1`` / ``eps2``). Raises ValueError for a non-positive ``eps1`` /
    ``eps2`` or ``min_cluster_size`` < 2.
    """
    if not (eps1 > 0 and eps2 > 0 and np.isfinite(eps1) and np.isfinite(eps2)):
        raise ValueError("eps1, eps2: must be finite and > 0")
    if isinstance(min_cluster_size, bool) or min_cluster_size < 2:
        raise ValueError("min_cluster_size: must be an integer >= 2")
    w = _World(config, seed)
    cluster_of = dict.fromkeys(w.fed.client_ids, 0)
    models = {0: w.fed.initial_model.copy()}
    splits: list[dict[str, Any]] = []
    norms: list[dict[str, Any]] = []
    next_id = 1
    for r in range(1, w.config.rounds + 1):
        chosen = w.select(r)
        trained: dict[int, tuple[np.ndarray, int]] = {
            c: w.fit(c, models[cluster_of[c]], r) for c in chosen}
        for k in sorted({cluster_of[c] for c in chosen}):
            members = [c for c in chosen if cluster_of[c] == k]
            upd = np.stack([trained[c][0].astype(np.float64) - models[k] for c in members])
            n = np.asarray([trained[c][1] for c in members], dtype=np.float64)
            mean_norm = float(np.linalg.norm((n / n.sum()) @ upd))
            max_norm = float(np.linalg.norm(upd, axis=1).max())
            norms.append({"round": r, "cluster": k, "n": len(members),
                          "mean_update_norm": mean_norm, "max_update_norm": max_norm})
            parts = [members]
            if (r > warmup_rounds and len(members) >= min_cluster_size
                    and mean_norm < eps1 and max_norm > eps2):
                bp = cosine_bipartition(cosine_similarity_matrix(upd))
                parts = [[members[i] for i in bp.first], [members[i] for i in bp.second]]
                new = next_id
                next_id += 1
                for c in parts[1]:
                    cluster_of[c] = new
                # clients of cluster k that did not take part stay with k
                splits.append({"round": r, "parent": k, "child": new,
                               "sizes": [len(parts[0]), len(parts[1])],
                               "mean_update_norm": mean_norm, "max_update_norm": max_norm,
                               "alpha_cross_max": bp.alpha_cross_max})
            for part in parts:
                kid = cluster_of[part[0]]
                models[kid] = _weighted_mean([trained[c][0] for c in part],
                                             [trained[c][1] for c in part])
        w.record(r, {c: cluster_of[c] for c in chosen}, models)
    return w.result("cfl", {"eps1": eps1, "eps2": eps2, "min_cluster_size": min_cluster_size,
                            "warmup_rounds": warmup_rounds, "splits": splits, "norms": norms,
                            "final_clusters": len(set(cluster_of.values()))})


# ----------------------------------------------------------------------------- IFCA


def ifca_default_k(config: FederationConfig) -> int:
    """Ground-truth group count: distinct drift families plus one for the clients that
    never drift (if any). An oracle choice, favourable to IFCA."""
    fams = {ev.family for ev in config.drift.events}
    drifted = {c for ev in config.drift.events for c in ev.clients}
    return max(1, len(fams) + int(len(drifted) < config.clients))


def run_ifca(config: FederationConfig, seed: int, k: int | None = None) -> PeerRun:
    """IFCA (module docstring) with ``k`` cluster models (None: :func:`ifca_default_k`).

    Model 0 starts from the federation's initial model, model ``j > 0`` from the same
    architecture built with seed ``(seed, j)`` (the paper's random initialisation). Each
    round every selected client computes the mean cross-entropy of every model on its
    current local training data (:func:`clma.sim.training.mean_loss`), picks the lowest
    (ties: the lowest index), trains it; each chosen model becomes the sample-weighted
    mean of its clients' trained models.

    Returns a :class:`PeerRun` (``details``: ``k``, ``k_source``, the number of models
    chosen in the last round). Raises ValueError for ``k`` < 1.
    """
    k_source = "argument"
    if k is None:
        k, k_source = ifca_default_k(config), "ground-truth groups"
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError("k: must be an integer >= 1")
    w = _World(config, seed)
    spec = w.fed.spec
    models = {0: w.fed.initial_model.copy()}
    for j in range(1, k):
        s = int(np.random.default_rng([w.config.seed, j, 907]).integers(2**31))
        models[j] = model_to_vector(spec.build(seed=s), AllParams())
    used_last = 0
    for r in range(1, w.config.rounds + 1):
        chosen = w.select(r)
        pick: dict[int, int] = {}
        for c in chosen:
            tx, ty, _, _ = w.clients.learners[c].data(r)
            losses = [mean_loss(spec, models[j], tx, ty) for j in range(k)]
            pick[c] = int(np.argmin(losses))
        trained = {c: w.fit(c, models[pick[c]], r) for c in chosen}
        for j in sorted(set(pick.values())):
            members = [c for c in chosen if pick[c] == j]
            models[j] = _weighted_mean([trained[c][0] for c in members],
                                       [trained[c][1] for c in members])
        used_last = len(set(pick.values()))
        w.record(r, pick, models)
    return w.result("ifca", {"k": k, "k_source": k_source, "models_chosen_last_round": used_last})
