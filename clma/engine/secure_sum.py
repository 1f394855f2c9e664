"""The server side of secure aggregation, run over the ``Clients`` seam.

One evaluation round runs several secure-aggregation sessions at once (one per
aggregated group); each protocol step is ONE call of the transport for all sessions and
clients (:mod:`clma.engine.clients`), so a networked transport needs four round-trips per
evaluation round whatever the number of groups. Per session the library's
:class:`clma.privacy.secagg.SecAggServer` does the work (Bonawitz et al. CCS 2017; SecAgg+
graph, Bell et al. CCS 2020); this module only batches and routes.

The cohort floor is applied before the server can learn anything: a session whose
masked inputs come from fewer than ``floor`` clients is stopped before unmasking
(``below_floor``; the masked vectors are uniform and reveal nothing), and so is a session
the caller's ``may_unmask`` check refuses (e.g. the cross-round guard of
:mod:`clma.engine.evaluation`). A session with fewer than t survivors aborts
(``aborted``). A client that does not answer a step, or answers something malformed, is a
dropout of that session. :attr:`SessionResult.summed` records every set of clients whose
sum the server learned (the audit record).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from clma.engine.clients import Clients, Replies, ReportRequest, ShareKeysRequest
from clma.privacy.secagg import (
    AdvertiseKeys,
    MaskedInput,
    SecAggAbort,
    SecAggServer,
    ShareKeys,
    UnmaskingResponse,
)

__all__ = ["SessionResult", "run_sessions"]


@dataclass
class SessionResult:
    """Server-side outcome of one session (never published as is).

    Attributes:
        session_id: the session.
        members: the client ids asked.
        status: ``ok`` (sum known), ``below_floor`` (fewer than ``floor`` clients would be
            in the sum, or fewer than ``floor`` completed every step: nothing released),
            ``aborted`` (fewer than t clients remained: nothing learned), ``refused``
            (``may_unmask`` refused: nothing learned).
        contributors: clients whose input is in the sum (0 unless ok).
        sum_quantised: uint64 ``(d,)`` exact modular sum (None unless ok).
        dropped: members that failed or left at some step (including malformed replies).
        reason: why the session is not ok.
        summed: the clients whose exact sum the server learned (None: it learned none).
    """

    session_id: str
    members: tuple[int, ...]
    status: str = "ok"
    contributors: int = 0
    sum_quantised: np.ndarray | None = None
    dropped: set[int] = field(default_factory=set)
    reason: str | None = None
    summed: tuple[int, ...] | None = None
    _server: SecAggServer | None = field(default=None, repr=False)

    @property
    def open(self) -> bool:
        return self.status == "ok" and self._server is not None


def _answers(replies: Replies, sid: str, asked: set[int], res: SessionResult,
             kind: type) -> dict[int, object]:
    """Session ``sid``'s well-typed answers from the asked clients; the rest dropped."""
    out: dict[int, object] = {}
    for c in asked:
        msg = replies.ok.get(c, {}).get(sid) if isinstance(replies.ok.get(c), Mapping) else None
        if isinstance(msg, kind) and getattr(msg, "client_id", c) == c:
            out[c] = msg
        else:
            res.dropped.add(c)
    return out


def _stop(res: SessionResult, status: str, reason: str) -> None:
    res.status, res.reason, res._server = status, reason, None


def run_sessions(clients: Clients, request: ReportRequest, *, floor: int,
                 may_unmask: Callable[[str, frozenset[int]], str | None] | None = None,
                 ) -> dict[str, SessionResult]:
    """Run every session of ``request`` to the end; returns session id -> result.

    Args:
        clients: the transport.
        request: the report request (models, layout, sessions).
        floor: minimum number of clients in any sum the server learns (the cohort floor).
        may_unmask: ``(session id, survivors) -> reason`` to refuse unmasking (None: go on).

    Never raises for a client's behaviour: failures become dropouts, a session that cannot
    finish safely is ``aborted`` or ``below_floor``.
    """
    results: dict[str, SessionResult] = {}
    servers: dict[str, SecAggServer] = {}
    for sid, sess in request.sessions.items():
        servers[sid] = SecAggServer(sess.config, sess.members)
        results[sid] = SessionResult(sid, tuple(sess.members), _server=servers[sid])
    rnd = request.round

    # step 1: reports computed on the device, public keys advertised
    adv = clients.secagg_advertise(request)
    rosters: dict[str, dict[int, dict[int, AdvertiseKeys]]] = {}
    for sid, res in results.items():
        got = _answers(adv, sid, set(res.members), res, AdvertiseKeys)
        try:
            rosters[sid] = res._server.collect_advertisements(list(got.values()))
        except SecAggAbort as exc:
            _stop(res, "aborted", str(exc))

    # step 2: encrypted key shares
    asked2: dict[int, dict[str, ShareKeysRequest]] = {}
    for sid, res in results.items():
        if not res.open:
            continue
        for u, ro in rosters[sid].items():
            # the neighbours the session's graph fixes (the client checks them against its
            # config), and the public keys of those of them that advertised (it shares
            # only with those)
            asked2.setdefault(u, {})[sid] = ShareKeysRequest(
                ro, tuple(res._server.neighbours[u]))
    shares = clients.secagg_share_keys(rnd, asked2) if asked2 else Replies()
    inboxes: dict[int, dict[str, list]] = {}
    for sid, res in results.items():
        if not res.open:
            continue
        asked = {u for u, m in asked2.items() if sid in m}
        got = _answers(shares, sid, asked, res, ShareKeys)
        try:
            box = res._server.route_shares(list(got.values()))
        except SecAggAbort as exc:
            _stop(res, "aborted", str(exc))
            continue
        for u, msgs in box.items():
            inboxes.setdefault(u, {})[sid] = msgs

    # step 3: masked inputs; the floor is checked before anything can be unmasked
    masked = clients.secagg_masked_input(rnd, inboxes) if inboxes else Replies()
    asked4: dict[int, dict[str, object]] = {}
    for sid, res in results.items():
        if not res.open:
            continue
        asked = {u for u, m in inboxes.items() if sid in m}
        got = _answers(masked, sid, asked, res, MaskedInput)
        if len(got) < floor:
            _stop(res, "below_floor", "fewer masked inputs than the cohort floor: not unmasked")
            continue
        try:
            req = res._server.collect_masked_inputs(list(got.values()))
        except (SecAggAbort, ValueError) as exc:
            _stop(res, "aborted", str(exc))
            continue
        refusal = may_unmask(sid, frozenset(req.survivors)) if may_unmask else None
        if refusal is not None:
            _stop(res, "refused", refusal)
            continue
        for u in req.survivors:
            asked4.setdefault(u, {})[sid] = req

    # step 4: unmasking
    unmask = clients.secagg_unmask(rnd, asked4) if asked4 else Replies()
    for sid, res in results.items():
        if not res.open:
            continue
        asked = {u for u, m in asked4.items() if sid in m}
        got = _answers(unmask, sid, asked, res, UnmaskingResponse)
        try:
            out = res._server.finalize(list(got.values()))
        except SecAggAbort as exc:
            _stop(res, "aborted", str(exc))
            continue
        res.sum_quantised, res.contributors, res._server = out.sum_quantised, out.contributors, None
        res.summed = tuple(out.survivors)
        res.dropped |= set(out.dropped)
        if len(res.members) - len(res.dropped | set(out.rejected)) < floor:
            res.sum_quantised, res.contributors = None, 0
            res.status, res.reason = "below_floor", "fewer clients than the cohort floor completed"
    for sid, res in results.items():  # a client whose message was malformed is a dropout
        res.dropped |= set(servers[sid].rejected)
    return results
