"""fed-clma 0.1.1's train-reply format, accepted by :class:`clma.flower.CLMA`.

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

from typing import Any

import numpy as np
from flwr.app import ArrayRecord, MetricRecord, RecordDict

from clma.flower.arrays import ArrayLayout
from clma.flower.codec import MAX_SAMPLES, RECORD, CodecError
from clma.rounds import ClientUpdate

__all__ = ["DRIFT_KEY", "LOSS_KEY", "NUM_EXAMPLES_KEY", "decode_train_reply", "is_fedclma_reply"]

DRIFT_KEY, LOSS_KEY, NUM_EXAMPLES_KEY = "clma-drift", "clma-loss", "num-examples"


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
