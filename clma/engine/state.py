"""What the server holds: public assets, and the state that must survive between rounds.

:class:`ServerAssets` are fixed for a federation and public (no client data): the model
architecture, the initial model, the shared probe set used for divergence scoring, and the
versioned region partition. :class:`ServerState` changes every round: the cohort registry
with lineage, every active cohort's model, the merge reference, the evaluation state
(alert baselines, clip-bound versions, monitoring merges) and the round counter. It holds
no client data and no raw per-client value; :func:`snapshot_files` / :func:`restore_files`
turn it into the durable state directory's files (:mod:`clma.state`).
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from clma.regions import RegionPartition

if TYPE_CHECKING:  # the cohorting stack (scikit-learn) is imported where a registry is made
    from clma.cohort import CohortRegistry

__all__ = ["ModelSpec", "ServerAssets", "ServerState", "restore_files", "snapshot_files"]


class ModelSpec(Protocol):
    """The model architecture: ``build(seed=None)`` returns a fresh ``torch.nn.Module``."""

    def build(self, seed: int | None = None) -> Any: ...


@dataclass(frozen=True)
class ServerAssets:
    """Public, fixed inputs of the server (no client data).

    Attributes:
        model_spec: the architecture (:class:`ModelSpec`).
        initial_model: float32 ``(n_params,)`` full state (``AllParams`` order).
        probe_x: float32 ``(P, ...)`` shared probe inputs (divergence scoring).
        partition: the versioned region partition (regions, neighbours, version, hash).
        dataset_name: name of the data set (recorded in summaries).
    """

    model_spec: Any
    initial_model: np.ndarray
    probe_x: np.ndarray
    partition: RegionPartition
    dataset_name: str

    @property
    def n_params(self) -> int:
        return int(self.initial_model.shape[0])


@dataclass
class ServerState:
    """The server's state between rounds (module docstring).

    Attributes:
        registry: cohort registry with lineage (client ids, never their data).
        cohort_models: active cohort id -> float32 ``(n_params,)``.
        merge_reference: pre-drift consensus model for merging (None until the first
            quarantine).
        evaluation: the evaluation path's state (:class:`clma.engine.evaluation.EvaluationState`),
            created at the first evaluation.
        rounds_done: last completed round (0 before the first).
        selection_key: 32-byte server secret (None until first used; server-internal,
            never published) keying the client sampling under secure DP-FedAvg and the
            secure-aggregation graph seeds under secure noise: neither is derivable from
            published values (the seed is published), and both are the same when a round
            is re-run from durable state.
        divergence_persistence: signal (``representation`` / ``parameter``) -> client id ->
            EWMA ``s`` of its clipped robust z (:mod:`clma.divergence.flags`); empty until
            the first scored round. Server-internal, keyed by client id, never published.
        update_history: under ``cohort.features = "relative"``, each client's running mean
            of its previous stable updates (:class:`clma.cohort.features.UpdateHistory`), a
            function of updates the server already received in the clear; server-internal,
            never published. None otherwise.
        server_velocity: under ``training.server_momentum`` > 0, active cohort id -> its
            float32 ``(n_params,)`` server-momentum velocity (:func:`clma.rounds.server_velocity`
            of its released models); cohorts never stepped have none (velocity 0).
    """

    registry: CohortRegistry
    cohort_models: dict[int, np.ndarray]
    merge_reference: np.ndarray | None = None
    evaluation: Any = None
    rounds_done: int = 0
    selection_key: bytes | None = None
    divergence_persistence: dict[str, dict[int, float]] = field(default_factory=dict)
    update_history: Any = None
    server_velocity: dict[int, np.ndarray] = field(default_factory=dict)

    @classmethod
    def fresh(cls, client_ids: list[int], initial_model: np.ndarray) -> ServerState:
        """Every client in root cohort 0 with the initial model."""
        from clma.cohort import CohortRegistry

        registry = CohortRegistry()
        root = registry.create_root(sorted(client_ids), 0)
        return cls(registry=registry,
                   cohort_models={root: np.asarray(initial_model, dtype=np.float32).copy()})

    def models_for(self, client_ids: list[int]) -> dict[int, np.ndarray]:
        """Client id -> the model of its current cohort."""
        return {c: self.cohort_models[self.registry.cohort_of(c)] for c in client_ids}

    def assignments(self, client_ids: list[int]) -> dict[int, int]:
        """Client id -> its current cohort id."""
        return {int(c): int(self.registry.cohort_of(c)) for c in client_ids}


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode("utf-8")


def snapshot_files(state: ServerState) -> dict[str, bytes]:
    """The state as snapshot files: ``registry.json``, ``models.npz`` (cohort models and
    merge reference, float32), ``evaluation.json`` (null before the first evaluation) and,
    once the sampling key exists, ``selection.json`` (server-internal secret); under
    relative cohorting features ``update_history.npz`` (server-internal); under server
    momentum, once a cohort was stepped, ``velocity.npz`` (float32 per cohort)."""
    buf = io.BytesIO()
    arrays = {f"cohort_{c}": np.asarray(v, dtype=np.float32)
              for c, v in sorted(state.cohort_models.items())}
    if state.merge_reference is not None:
        arrays["merge_reference"] = np.asarray(state.merge_reference, dtype=np.float32)
    np.savez(buf, **arrays)
    ev = state.evaluation
    out = {
        "registry.json": _json_bytes(state.registry.to_dict()),
        "models.npz": buf.getvalue(),
        "evaluation.json": _json_bytes(ev.to_dict() if ev is not None else None),
    }
    if state.selection_key is not None:
        out["selection.json"] = _json_bytes({"key": state.selection_key.hex()})
    if state.divergence_persistence:
        out["divergence.json"] = _json_bytes({
            sig: {str(c): float(v) for c, v in sorted(m.items())}
            for sig, m in sorted(state.divergence_persistence.items())})
    if state.update_history is not None:
        hbuf = io.BytesIO()
        np.savez(hbuf, **state.update_history.to_arrays())
        out["update_history.npz"] = hbuf.getvalue()
    if state.server_velocity:
        vbuf = io.BytesIO()
        np.savez(vbuf, **{f"cohort_{c}": np.asarray(v, dtype=np.float32)
                          for c, v in sorted(state.server_velocity.items())})
        out["velocity.npz"] = vbuf.getvalue()
    return out


def restore_files(files: Mapping[str, bytes], rounds_done: int) -> ServerState:
    """Inverse of :func:`snapshot_files`.

    Raises:
        ValueError: the models do not match the registry's active cohorts; a velocity of a
            cohort that is not active or whose shape is not its model's.
    """
    from clma.cohort import CohortRegistry
    from clma.engine.evaluation import EvaluationState

    registry = CohortRegistry.from_dict(json.loads(files["registry.json"].decode("utf-8")))
    with np.load(io.BytesIO(files["models.npz"])) as z:
        models = {int(k.split("_", 1)[1]): z[k].astype(np.float32) for k in z.files
                  if k.startswith("cohort_")}
        ref = z["merge_reference"].astype(np.float32) if "merge_reference" in z.files else None
    if set(models) != set(registry.active_cohorts()):
        raise ValueError("models.npz: cohort models do not match the registry's active cohorts")
    ev = None
    if "evaluation.json" in files:
        doc = json.loads(files["evaluation.json"].decode("utf-8"))
        ev = EvaluationState.from_dict(doc) if doc is not None else None
    key = None
    if "selection.json" in files:
        key = bytes.fromhex(json.loads(files["selection.json"].decode("utf-8"))["key"])
    persistence: dict[str, dict[int, float]] = {}
    if "divergence.json" in files:
        doc = json.loads(files["divergence.json"].decode("utf-8"))
        persistence = {str(sig): {int(c): float(v) for c, v in m.items()}
                       for sig, m in doc.items()}
    history = None
    if "update_history.npz" in files:
        from clma.cohort.features import UpdateHistory

        with np.load(io.BytesIO(files["update_history.npz"])) as z:
            history = UpdateHistory.from_arrays({k: z[k] for k in z.files})
    velocity: dict[int, np.ndarray] = {}
    if "velocity.npz" in files:
        with np.load(io.BytesIO(files["velocity.npz"])) as z:
            velocity = {int(k.split("_", 1)[1]): z[k].astype(np.float32) for k in z.files}
        for c, v in velocity.items():
            if c not in models or v.shape != models[c].shape:
                raise ValueError(f"velocity.npz: cohort {c}'s velocity matches no active "
                                 "cohort's model")
    return ServerState(registry=registry, cohort_models=models, merge_reference=ref,
                       evaluation=ev, rounds_done=int(rounds_done), selection_key=key,
                       divergence_persistence=persistence, update_history=history,
                       server_velocity=velocity)
