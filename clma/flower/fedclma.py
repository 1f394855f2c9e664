"""fed-clma 0.1.1's message format, spoken by :class:`clma.flower.CLMA` to the nodes that
run a fed-clma-style ClientApp (one that registers only ``@app.train()``).

Which nodes: the strategy asks every node its partition id (``query.clma_roster``); a
ClientApp without a query handler answers with Flower's error reply "No query function
registered with name 'clma_roster'" (:func:`is_unregistered_query`). Such a node is a
fed-clma-format client: it gets one of the client ids no node claimed (in node-id order),
its train messages are :func:`encode_train_request` (what fed-clma's strategy sends) and
its replies :func:`decode_train_reply`.

Train message (fed-clma's ``CLMA._build_messages``): ``"arrays"`` -- the cohort's model as
a named ``ArrayRecord`` with the keys, shapes and dtypes of the strategy's
``initial_arrays`` (so ``msg.content["arrays"].to_torch_state_dict()`` loads it) -- and
``"config"`` -- the ``ConfigRecord`` given to ``start(train_config=...)`` plus
``server-round`` and ``clma-cohort``.

A fed-clma ClientApp (``clma.client.DriftReporter.build_reply``) replies with a
``RecordDict`` holding ``"arrays"`` -- the model as a named ``ArrayRecord`` (e.g. a torch
``state_dict``) -- and one ``MetricRecord`` with ``num-examples``, ``clma-drift`` (0/1) and
optionally ``clma-loss``; it has no ``"clma"`` header. :func:`decode_train_reply` turns
such a reply into the same checked :class:`clma.rounds.ClientUpdate` as this project's
wire format (:func:`clma.flower.codec.decode_train_reply`), so the round engine runs one
copy of every rule on both. The header's round / client / cohort checks are replaced by
Flower's own reply-to pairing (the transport matches each reply to the message it answers)
and the cohort the engine assigned.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from clma.flower.arrays import ArrayLayout
from clma.flower.codec import MAX_SAMPLES, RECORD, CodecError
from clma.interop import COHORT_KEY, DRIFT_KEY, LOSS_KEY, NUM_EXAMPLES_KEY
from clma.rounds import ClientUpdate

__all__ = ["COHORT_KEY", "DRIFT_KEY", "LOSS_KEY", "NUM_EXAMPLES_KEY", "decode_train_reply",
           "encode_train_request", "is_fedclma_reply", "is_unregistered_query"]

ROUND_KEY, CONFIG = "server-round", "config"
#: Flower's ClientApp refusal of a message type it has no function for
#: (``flwr.clientapp.ClientApp.__call__``), as the SuperNode reports it in the error reply.
_UNREGISTERED_ROSTER = "No query function registered with name 'clma_roster'"


def is_unregistered_query(reason: str | None) -> bool:
    """True if an error reply's ``reason`` is Flower's "no query function registered" for
    the roster query: the node's ClientApp has no query handler (a fed-clma ClientApp)."""
    return _UNREGISTERED_ROSTER in str(reason or "")


def encode_train_request(request: Any, client_id: int, layout: ArrayLayout,
                         config: Mapping[str, Any] | None = None) -> RecordDict:
    """fed-clma's train message for one client of a :class:`~clma.engine.clients.
    TrainRequest`: the cohort's model as a named record and the ``config`` (module
    docstring). Raises ValueError if ``config`` cannot be a ``ConfigRecord``."""
    cohort = int(request.assignments[client_id])
    cfg = ConfigRecord(dict(config or {}))
    cfg[ROUND_KEY] = int(request.round)
    cfg[COHORT_KEY] = cohort
    return RecordDict({"arrays": layout.to_record(request.models[cohort]), CONFIG: cfg})


def is_fedclma_reply(content: Any) -> bool:
    """True if ``content`` has no ``"clma"`` header but a ``clma-drift`` metric."""
    if not isinstance(content, RecordDict) or RECORD in content:
        return False
    return any(DRIFT_KEY in m for m in content.metric_records.values())


def _int(v: Any, field: str, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v \
            or not lo <= int(v) <= hi:
        raise CodecError(f"{field}: must be an integer in [{lo}, {hi}]")
    return int(v)


def decode_train_reply(content: Any, layout: ArrayLayout, *, client_id: int,
                       cohort_id: int, arrays_key: str = "arrays") -> ClientUpdate:
    """A checked ClientUpdate from a fed-clma-format train reply. Raises CodecError."""
    if not isinstance(content, RecordDict):
        raise CodecError("content: must be a RecordDict")
    rec = content.array_records.get(arrays_key) if arrays_key in content else None
    if not isinstance(rec, ArrayRecord):
        raise CodecError(f"{arrays_key}: the ArrayRecord is missing")
    metrics = [m for m in content.metric_records.values() if DRIFT_KEY in m]
    if len(metrics) != 1 or not isinstance(metrics[0], MetricRecord):
        raise CodecError(f"metrics: exactly one MetricRecord must carry {DRIFT_KEY!r}")
    m = metrics[0]
    flag = _int(m.get(DRIFT_KEY), f"metrics.{DRIFT_KEY}", 0, 1)
    n = _int(m.get(NUM_EXAMPLES_KEY), f"metrics.{NUM_EXAMPLES_KEY}", 1, MAX_SAMPLES)
    try:
        vector = layout.to_vector(rec)
    except Exception as exc:
        raise CodecError(f"{arrays_key}: {exc}") from None
    if not np.all(np.isfinite(vector)):
        raise CodecError(f"{arrays_key}: must be finite")
    return ClientUpdate(int(client_id), int(cohort_id), vector, n, bool(flag))
