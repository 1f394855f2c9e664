"""The seam between the server's round engine and the clients: the ``Clients`` protocol.

The engine (:mod:`clma.engine.round`) reaches clients only through an object that
implements :class:`Clients`. A transport implements it: in-process simulated clients
(:class:`clma.sim.clients.SimulatedClients`), Dask workers (:class:`clma.sim.dask.DaskClients`)
or Flower SuperNodes (:mod:`clma.flower.transport`). Everything that crosses the seam is
a plain dataclass of numbers, bytes and ids defined here; a client's data, its drift
detector state and its raw metric values stay on the client side.

What every transport must implement (one call per protocol step and round; a transport
may batch all the clients of a call into one network round-trip):

==========================  ==========================================================
call                        the client side does
==========================  ==========================================================
``roster()``                names the clients that exist and the region of each
                            (the public, versioned partition: no data involved)
``train(request)``          loads its cohort's model, measures the model's loss on its
                            current local data, updates its on-device drift detector,
                            trains locally and returns :class:`ClientUpdate` (model,
                            sample count, the detector's flag bit; never the loss)
``secagg_advertise(req)``   computes its metric report on its local evaluation data
                            with the announced model and layout, clips and quantises
                            it, and answers :class:`~clma.privacy.secagg.AdvertiseKeys`
                            for every secure-aggregation session it belongs to
``secagg_share_keys(...)``  Shamir-shares its secrets to its neighbours (encrypted)
``secagg_masked_input(...)`` receives its shares, answers its masked report
``secagg_unmask(...)``      answers the unmasking request once per session
``choose(request)``         (after a drift round's split, under ``cohort.client_choice``)
                            scores each candidate cohort's model on its local evaluation
                            data and answers the id of the one it fits best
                            (:func:`clma.device.choose_cohort`; never a loss)
``close()``                 releases the transport (processes, connections)
==========================  ==========================================================

Failures. A transport never raises for one client: a client that fails, times out or
has nothing to say is absent from :attr:`Replies.ok` and named in
:attr:`Replies.failed` with a reason (it is a dropout for that step). The engine checks
every reply it receives (:func:`check_update`, and the secure-aggregation server's own
range checks) and treats a malformed one the same way: a dropout, never an exception
that aborts the round.

Idempotency. ``train`` for round r may be asked again after a crash of the server (the
round is re-run from the last committed state). A client keys its detector state by the
round that produced it and, for round r, starts from its state of the last round before
r, so a re-asked round gives the same flag (:class:`clma.drift.RoundKeyedState`).

The divergence scores (activation patterns on a probe set) are computed by the server on
the parameter vectors it already holds (CLMA's design), so a transport needs no probe
call.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar, runtime_checkable

import numpy as np

from clma.drift.spec import DetectorSpec
from clma.privacy.secagg import (
    AdvertiseKeys,
    EncryptedShare,
    MaskedInput,
    SecAggConfig,
    ShareKeys,
    UnmaskingRequest,
    UnmaskingResponse,
)
from clma.rounds import ClientUpdate

if TYPE_CHECKING:  # annotation only: devices import this module without the metrics stack
    from clma.metrics import DeviceMetricLayout

__all__ = [
    "TRANSPORTS",
    "ChoiceRequest",
    "ClientInfo",
    "Clients",
    "ClientUpdate",
    "Replies",
    "ReportRequest",
    "Roster",
    "SecAggSession",
    "ShareKeysRequest",
    "TrainRequest",
    "TrainSettings",
    "check_choice",
    "check_update",
]

#: Transport names recorded in ``summary.json`` (``federation.transport``).
TRANSPORTS = ("simulation", "dask", "flower")

T = TypeVar("T")


@dataclass(frozen=True)
class ClientInfo:
    """One client of the federation: its id and its region (public partition)."""

    client_id: int
    region: str


@dataclass(frozen=True)
class Roster:
    """Who exists, and where: the clients in ascending id order.

    Raises:
        ValueError: duplicate or negative client ids, or an empty region name.
    """

    clients: tuple[ClientInfo, ...]

    def __post_init__(self) -> None:
        ids = [c.client_id for c in self.clients]
        if len(set(ids)) != len(ids):
            raise ValueError("roster: client ids must be distinct")
        if any(type(c) is not int or c < 0 for c in ids):
            raise ValueError("roster: client ids must be integers >= 0")
        if any(not c.region for c in self.clients):
            raise ValueError("roster: every client needs a region")
        object.__setattr__(self, "clients",
                           tuple(sorted(self.clients, key=lambda c: c.client_id)))

    @property
    def client_ids(self) -> list[int]:
        return [c.client_id for c in self.clients]

    def region_of(self) -> dict[int, str]:
        """Client id -> region."""
        return {c.client_id: c.region for c in self.clients}


@dataclass(frozen=True)
class TrainSettings:
    """What the server tells every client about local training (like Flower's
    ``ConfigRecord``): SGD epochs, learning rate, batch size, the loss-threshold
    detector's ``gamma`` (nats) and which detector the device runs (``detector``, default
    the loss threshold)."""

    local_epochs: int
    learning_rate: float
    batch_size: int
    drift_gamma: float
    detector: DetectorSpec = field(default_factory=DetectorSpec)


@dataclass(frozen=True)
class TrainRequest:
    """One round's training instruction.

    Attributes:
        round: the round (>= 1).
        assignments: client id -> the cohort whose model it trains (the clients asked).
        models: cohort id -> float32 model vector ``(n_params,)`` (every cohort named in
            ``assignments``).
        settings: local training hyper-parameters.
    """

    round: int
    assignments: Mapping[int, int]
    models: Mapping[int, np.ndarray]
    settings: TrainSettings

    def for_clients(self, client_ids: Sequence[int]) -> TrainRequest:
        """The same request restricted to ``client_ids`` (and the models they need)."""
        a = {int(c): self.assignments[int(c)] for c in client_ids}
        return TrainRequest(self.round, a, {k: self.models[k] for k in sorted(set(a.values()))},
                            self.settings)


@dataclass
class Replies(Generic[T]):
    """The answers of one protocol step: ``ok`` client id -> reply, ``failed`` client id
    -> reason (a dropout at this step; never an exception)."""

    ok: dict[int, T] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)

    def merge(self, other: Replies[T]) -> Replies[T]:
        """Both steps' answers (disjoint clients)."""
        return Replies({**self.ok, **other.ok}, {**self.failed, **other.failed})


@dataclass(frozen=True)
class SecAggSession:
    """One secure-aggregation instance of an evaluation round.

    ``session_id`` is unique within the round and equals ``config.round_id``;
    ``members`` are the client ids taking part (also their ids inside the protocol).
    """

    session_id: str
    config: SecAggConfig
    members: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.session_id != self.config.round_id:
            raise ValueError("session_id: must equal config.round_id (bound into every key)")
        if len(self.members) != self.config.n_clients or len(set(self.members)) != len(self.members):
            raise ValueError("members: must be config.n_clients distinct client ids")


@dataclass(frozen=True)
class ReportRequest:
    """Step 1 of the private evaluation: compute the metric report and advertise keys.

    Attributes:
        round: the round.
        assignments: client id -> cohort whose model it evaluates.
        models: cohort id -> float32 model vector ``(n_params,)``.
        layout: the fixed on-device metric layout in force (edges, ``l_max``, version).
        quantisation_levels: Q of the fixed-point quantiser (each coordinate clipped to
            the layout's bounds, then mapped to an integer in ``[0, Q]``).
        sessions: session id -> :class:`SecAggSession`; a client takes part in every
            session that lists it.
    """

    round: int
    assignments: Mapping[int, int]
    models: Mapping[int, np.ndarray]
    layout: DeviceMetricLayout
    quantisation_levels: int
    sessions: Mapping[str, SecAggSession]

    def sessions_of(self, client_id: int) -> dict[str, SecAggSession]:
        return {s: sess for s, sess in self.sessions.items() if client_id in sess.members}


@dataclass(frozen=True)
class ShareKeysRequest:
    """Step 2, for one client and session: the public keys of its neighbours that
    advertised, and its neighbour set in the session's graph."""

    roster: Mapping[int, AdvertiseKeys]
    neighbours: tuple[int, ...]


@dataclass(frozen=True)
class ChoiceRequest:
    """After a drift round split quarantined clients into new cohorts: each of them
    chooses among the cohorts the round made (IFCA's rule, Ghosh et al. 2020, applied
    once; which cohorts are candidates: :meth:`clma.engine.FederationEngine.choose`).

    Attributes:
        round: the round of the split.
        candidates: client id -> the cohort ids it chooses among (its own first: the
            cohort the split put it in, kept on ties).
        models: cohort id -> float32 model vector ``(n_params,)`` of every candidate; for
            a cohort of one client, the model its source cohort started the round from
            (the cohort's model without that client's update).
    """

    round: int
    candidates: Mapping[int, tuple[int, ...]]
    models: Mapping[int, np.ndarray]

    def for_clients(self, client_ids: Sequence[int]) -> ChoiceRequest:
        """The same request restricted to ``client_ids`` (and the models they need)."""
        c = {int(i): self.candidates[int(i)] for i in client_ids}
        return ChoiceRequest(self.round, c,
                             {k: self.models[k] for k in sorted({k for v in c.values()
                                                                  for k in v})})


@runtime_checkable
class Clients(Protocol):
    """What a transport implements (module docstring). ``transport`` is one of
    :data:`TRANSPORTS`."""

    transport: str

    def roster(self) -> Roster: ...

    def train(self, request: TrainRequest) -> Replies[ClientUpdate]: ...

    def secagg_advertise(self, request: ReportRequest) -> Replies[Mapping[str, AdvertiseKeys]]: ...

    def secagg_share_keys(
        self, round: int, requests: Mapping[int, Mapping[str, ShareKeysRequest]]  # noqa: A002
    ) -> Replies[Mapping[str, ShareKeys]]: ...

    def secagg_masked_input(
        self, round: int, inboxes: Mapping[int, Mapping[str, Sequence[EncryptedShare]]]  # noqa: A002
    ) -> Replies[Mapping[str, MaskedInput]]: ...

    def secagg_unmask(
        self, round: int, requests: Mapping[int, Mapping[str, UnmaskingRequest]]  # noqa: A002
    ) -> Replies[Mapping[str, UnmaskingResponse]]: ...

    def choose(self, request: ChoiceRequest) -> Replies[int]: ...

    def close(self) -> None: ...


def check_choice(choice: object, request: ChoiceRequest, client_id: int) -> str | None:
    """Why a choice reply cannot be used (None: it can). Never raises.

    Rule: an ``int`` (not a bool) among the candidates the request gave ``client_id``.
    """
    if client_id not in request.candidates:
        return "reply from a client the request did not ask"
    if isinstance(choice, bool) or not isinstance(choice, int | np.integer):
        return "choice: must be an integer cohort id"
    if int(choice) not in request.candidates[client_id]:
        return "choice: not one of the candidate cohorts"
    return None


def check_update(update: object, request: TrainRequest, n_params: int) -> str | None:
    """Why a training reply cannot be used (None: it can). Never raises.

    Rules: a :class:`ClientUpdate` from a client the request asked, for the cohort it was
    assigned, with a finite float32 ``params`` vector of length ``n_params``, an integer
    ``n_samples >= 1`` and a boolean ``drift_flag``.
    """
    if not isinstance(update, ClientUpdate):
        return "reply is not a ClientUpdate"
    if type(update.client_id) is not int or update.client_id not in request.assignments:
        return "reply from a client the request did not ask"
    if type(update.cohort_id) is not int or update.cohort_id != request.assignments[update.client_id]:
        return "reply names another cohort than the one assigned"
    p = update.params
    if not isinstance(p, np.ndarray) or p.dtype != np.float32 or p.shape != (n_params,):
        return f"params: must be a float32 vector of length {n_params}"
    if not np.all(np.isfinite(p)):
        return "params: must be finite"
    n = update.n_samples
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1 or not math.isfinite(n):
        return "n_samples: must be an integer >= 1"
    if not isinstance(update.drift_flag, bool | np.bool_):
        return "drift_flag: must be a boolean"
    return None
