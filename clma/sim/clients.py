"""In-process simulated clients: the default transport of the ``Clients`` seam.

:class:`SimulatedClients` plays every device of a :class:`SimulatedFederation` in the
server's process. The simulation owns what a device owns: its data (a shard of the data
set, drifted by the config's drift schedule as of the round asked: data of round r carry
every event with ``event.round <= r``), its drift detector state (per client, keyed by
round, :class:`clma.drift.RoundKeyedState`) and its secure-aggregation secrets
(:class:`clma.device.DeviceSecAgg`). The on-device rules are :mod:`clma.device`'s.

Device state lives in memory, and in ``device_dir`` when one is given (one JSON file per
client, written atomically): that folder is the simulated devices' own storage, never the
server's state folder. Simulated dropouts (``evaluation.dropout_rate``) are drawn by the
devices, seeded per round: a dropped client stops answering before its masked input or
before unmasking.

Simulation ground truth (who drifted how, each client's accuracy) is available through
:meth:`SimulatedClients.truth`; it is not part of the seam and only a simulation has it.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from clma.device import (
    DeviceSecAgg,
    LocalFit,
    choose_cohort,
    quantised_report,
    train_on_device,
)
from clma.drift import RoundKeyedState
from clma.engine.clients import (
    ChoiceRequest,
    ClientInfo,
    Replies,
    ReportRequest,
    Roster,
    ShareKeysRequest,
    TrainRequest,
    TrainSettings,
)
from clma.privacy.secagg import (
    AdvertiseKeys,
    EncryptedShare,
    MaskedInput,
    ShareKeys,
    UnmaskingRequest,
    UnmaskingResponse,
)
from clma.rounds import ClientUpdate
from clma.sim.drift import AppliedDrift, apply_drifts
from clma.sim.federation import ClientEvaluation, SimClient, SimulatedFederation
from clma.sim.training import local_train, model_predictor, predict_proba

__all__ = ["DeviceStore", "SimLearner", "SimulatedClients", "simulated_dropouts"]


def simulated_dropouts(seed: int, rate: float, client_ids: Sequence[int],
                       round_number: int) -> dict[int, str]:
    """Seeded simulated dropouts of an evaluation round: client id -> stage
    (``masked_input``: leaves before sending its masked input; ``unmasking``: before
    unmasking). One draw pair per client in ascending id order."""
    if rate <= 0.0:
        return {}
    rng = np.random.default_rng([seed, round_number, 211])
    out = {}
    for c in sorted(client_ids):
        drop, stage = rng.random(), rng.random()
        if drop < rate:
            out[c] = "masked_input" if stage < 0.5 else "unmasking"
    return out


class DeviceStore:
    """Each simulated device's own storage: its :class:`RoundKeyedState`, in memory and,
    with ``root``, in ``root/client_<id>.json`` (temporary file, fsync, rename)."""

    def __init__(self, root: str | os.PathLike | None = None) -> None:
        self.root = Path(root) if root is not None else None
        self._cache: dict[int, RoundKeyedState] = {}
        self._lock = threading.Lock()

    def _path(self, client_id: int) -> Path:
        assert self.root is not None
        return self.root / f"client_{int(client_id):06d}.json"

    def load(self, client_id: int) -> RoundKeyedState:
        with self._lock:
            st = self._cache.get(client_id)
        if st is not None:
            return st
        st = RoundKeyedState()
        if self.root is not None and self._path(client_id).exists():
            st = RoundKeyedState.from_dict(json.loads(self._path(client_id).read_text("utf-8")))
        with self._lock:
            self._cache[client_id] = st
        return st

    def save(self, client_id: int, state: RoundKeyedState) -> None:
        with self._lock:
            self._cache[client_id] = state
        if self.root is None:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        p = self._path(client_id)
        tmp = p.with_name(p.name + f".tmp-{os.getpid()}-{threading.get_ident()}")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps(state.to_dict(), sort_keys=True))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)


class SimLearner:
    """A simulated device's :class:`clma.device.LocalLearner`: the federation's MLP on the
    client's shard, drifted as of the round asked (``fit`` also gives the drifted
    training inputs, for an input-based drift detector)."""

    def __init__(self, federation: SimulatedFederation, client: SimClient) -> None:
        self.fed = federation
        self.client = client
        self._cache: dict[tuple[tuple[AppliedDrift, ...], int | None],
                          tuple[np.ndarray, ...]] = {}

    def data(self, round_number: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Current (drifted) ``train_x, train_y, eval_x, eval_y`` at ``round_number``; under
        ``data.record_churn`` the training records are the round's seeded subset."""
        drifts = tuple(self.fed.drifts_for(self.client.client_id, round_number))
        churn = self.fed.config.data.record_churn
        key = (drifts, int(round_number) if churn else None)
        hit = self._cache.get(key)
        if hit is None:
            cl = self.client
            tx, ty = apply_drifts(cl.train_x, cl.train_y, list(drifts), cl.n_classes)
            ex, ey = apply_drifts(cl.eval_x, cl.eval_y, list(drifts), cl.n_classes)
            if churn:
                n = int(ty.shape[0])
                rng = np.random.default_rng(
                    [self.fed.config.seed, int(round_number), cl.client_id, 13])
                keep = np.sort(rng.choice(n, max(1, round((1.0 - churn) * n)), replace=False))
                tx, ty = tx[keep], ty[keep]
            hit = (tx, ty, ex, ey)
            self._cache = {key: hit}  # the data change at drift events (and every round
            # under churn): keep the latest
        return hit  # type: ignore[return-value]

    def fit(self, params: np.ndarray, settings: TrainSettings, round_number: int) -> LocalFit:
        tx, ty, _, _ = self.data(round_number)
        rng = np.random.default_rng([self.fed.config.seed, round_number, self.client.client_id, 7])
        res = local_train(self.fed.spec, params, tx, ty, epochs=settings.local_epochs,
                          learning_rate=settings.learning_rate, batch_size=settings.batch_size,
                          rng=rng)
        return LocalFit(res.vector, res.pre_loss, res.n_samples, inputs=tx)

    def predict(self, params: np.ndarray, round_number: int) -> tuple[np.ndarray, np.ndarray]:
        _, _, ex, ey = self.data(round_number)
        return predict_proba(self.fed.spec, params, ex), ey

    def predict_training(self, params: np.ndarray, round_number: int
                         ) -> tuple[np.ndarray, np.ndarray]:
        tx, ty, _, _ = self.data(round_number)
        return predict_proba(self.fed.spec, params, tx), ty


class SimulatedClients:
    """The devices of a simulated federation, in process (module docstring).

    Args:
        federation: the simulated federation (clients' data, drift schedule, config).
        device_dir: the devices' own storage folder (None: memory only).
        client_ids: play only these clients (default: all; a Dask worker plays a subset).
    """

    transport = "simulation"

    def __init__(self, federation: SimulatedFederation, *,
                 device_dir: str | os.PathLike | None = None,
                 client_ids: Sequence[int] | None = None) -> None:
        self.federation = federation
        ids = sorted(federation.clients) if client_ids is None else sorted(int(c) for c in client_ids)
        unknown = [c for c in ids if c not in federation.clients]
        if unknown:
            raise ValueError("client_ids: not clients of the federation")
        self.client_ids = ids
        self.store = DeviceStore(device_dir)
        self.learners = {c: SimLearner(federation, federation.clients[c]) for c in ids}
        self._secagg: dict[int, DeviceSecAgg] = {}
        self._dropouts: dict[int, dict[int, str]] = {}

    # ---------------------------------------------------------------- seam
    def roster(self) -> Roster:
        cl = self.federation.clients
        return Roster(tuple(ClientInfo(c, cl[c].region) for c in self.client_ids))

    def train(self, request: TrainRequest) -> Replies[ClientUpdate]:
        out: Replies[ClientUpdate] = Replies()
        for c, cohort in sorted(request.assignments.items()):
            if c not in self.learners:
                out.failed[c] = "not a client of this transport"
                continue
            try:  # one device's failure is its own (the contract: never raise for one)
                history = self.store.load(c)
                out.ok[c] = train_on_device(c, cohort, request.models[cohort],
                                            request.settings, request.round,
                                            self.learners[c], history)
                self.store.save(c, history)
            except Exception as exc:
                out.ok.pop(c, None)
                out.failed[c] = f"device error: {type(exc).__name__}"
        return out

    def _dropped_at(self, round_number: int, client_id: int, stage: str) -> bool:
        return self._dropouts.get(round_number, {}).get(client_id) == stage

    def secagg_advertise(self, request: ReportRequest) -> Replies[Mapping[str, AdvertiseKeys]]:
        members = sorted({c for s in request.sessions.values() for c in s.members})
        self._dropouts[request.round] = simulated_dropouts(
            self.federation.config.seed, self.federation.config.evaluation.dropout_rate,
            members, request.round)
        out: Replies[Mapping[str, AdvertiseKeys]] = Replies()
        for c in members:
            if c not in self.learners:
                continue
            try:
                proba, labels = self.learners[c].predict(
                    request.models[request.assignments[c]], request.round)
                q = quantised_report(proba, labels, request.layout, request.quantisation_levels)
                dev = DeviceSecAgg(c, request.round)
                self._secagg[c] = dev
                out.ok[c] = dev.advertise(q, request.sessions_of(c))
            except Exception as exc:
                out.failed[c] = f"device error: {type(exc).__name__}"
        return out

    def _step(self, round_number: int, requests: Mapping[int, Mapping[str, Any]], stage: str,
              call: str) -> Replies:
        out: Replies = Replies()
        for c, req in sorted(requests.items()):
            dev = self._secagg.get(c)
            if dev is None or dev.round != round_number:
                out.failed[c] = "no secure-aggregation state for this round"
                continue
            if self._dropped_at(round_number, c, stage):
                out.failed[c] = "dropped out (simulated)"
                continue
            try:  # e.g. SecAggAbort: a device refuses to unmask a session twice
                out.ok[c] = getattr(dev, call)(req)
            except Exception as exc:
                out.failed[c] = f"device error: {type(exc).__name__}"
        return out

    def secagg_share_keys(self, round: int, requests: Mapping[int, Mapping[str, ShareKeysRequest]]  # noqa: A002
                          ) -> Replies[Mapping[str, ShareKeys]]:
        return self._step(round, requests, "share_keys", "share_keys")

    def secagg_masked_input(self, round: int,  # noqa: A002
                            inboxes: Mapping[int, Mapping[str, Sequence[EncryptedShare]]]
                            ) -> Replies[Mapping[str, MaskedInput]]:
        return self._step(round, inboxes, "masked_input", "masked_input")

    def secagg_unmask(self, round: int, requests: Mapping[int, Mapping[str, UnmaskingRequest]]  # noqa: A002
                      ) -> Replies[Mapping[str, UnmaskingResponse]]:
        return self._step(round, requests, "unmasking", "unmask")

    def choose(self, request: ChoiceRequest) -> Replies[int]:
        out: Replies[int] = Replies()
        for c, candidates in sorted(request.candidates.items()):
            if c not in self.learners:
                out.failed[c] = "not a client of this transport"
                continue
            try:
                out.ok[c] = choose_cohort(candidates, request.models, self.learners[c],
                                          request.round)
            except Exception as exc:
                out.failed[c] = f"device error: {type(exc).__name__}"
        return out

    def close(self) -> None:
        self._secagg.clear()

    # ---------------------------------------------------------------- simulation only
    def truth(self, round_number: int, assignments: Mapping[int, int],
              models: Mapping[int, np.ndarray], loss_max: float) -> list[ClientEvaluation]:
        """Simulation ground truth: each listed client's accuracy and clipped loss of its
        cohort model on its local evaluation data (never part of a private release)."""
        out = []
        predictors: dict[int, Any] = {}  # one model per cohort, not one per client
        for c in sorted(assignments):
            k = int(assignments[c])
            if k not in predictors:
                predictors[k] = model_predictor(self.federation.spec, models[k])
            _, _, ex, ey = self.learners[c].data(round_number)
            proba = predictors[k](ex)
            p_true = np.clip(proba[np.arange(ey.shape[0]), ey], 1e-12, 1.0)
            loss = float(np.clip(-np.log(p_true).mean(), 0.0, loss_max))
            acc = float((proba.argmax(axis=1) == ey).mean())
            out.append(ClientEvaluation(c, self.federation.clients[c].region,
                                        int(assignments[c]), acc, loss, int(ey.shape[0])))
        return out
