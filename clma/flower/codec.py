"""Wire format of the Flower transport (schema ``clma.flower/2``): the ``Clients`` seam's
requests and replies as Flower records, validated on both ends.

Every message content is a ``RecordDict`` holding

* ``"clma"`` -- a ``ConfigRecord`` header: ``schema`` (str), ``call`` (str), ``round``,
  ``client-id`` (ints), call-specific scalars, and for the secure-aggregation steps
  ``payload`` (bytes): the step's protocol messages, one per session, in a compact binary
  encoding (little-endian; ids u32; keys, shares and ciphertexts length-prefixed;
  masked words u64; Shamir shares 17-byte little-endian elements of GF(2^130 - 5); each
  client's share-keys message carries its 32-byte commitment to its self-mask seed);
* ``"arrays"`` -- an ``ArrayRecord`` with one float32 vector: the model sent
  (``"model"``) or the trained parameters returned (``"params"``);
* ``"metrics"`` -- a train reply's ``MetricRecord``: ``num-examples`` (int) and
  ``drift-flag`` (0/1), the keys Flower's own strategies read.

=====================  ===========================  =====================================
call                   message type                 request / reply
=====================  ===========================  =====================================
``roster``             ``query.clma_roster``        - / ``partition-id``
``train``              ``train``                    model, cohort, settings / params,
                                                    ``num-examples``, ``drift-flag``
``secagg_advertise``   ``evaluate.clma_advertise``  model, cohort, layout, Q, sessions /
                                                    public keys per session
``secagg_share_keys``  ``evaluate.clma_share_keys`` roster + neighbours per session /
                                                    encrypted shares per session
``secagg_masked_input`` ``evaluate.clma_masked``    routed shares per session / masked
                                                    vector per session
``secagg_unmask``      ``evaluate.clma_unmask``     survivors + dropped per session /
                                                    unmasking shares per session
``choose``             ``query.clma_choose``        candidate cohorts and their models
                                                    (``model-<id>``) / ``cohort-id``
=====================  ===========================  =====================================

Decoding never trusts the sender: every field's type, range and length is checked and a
violation raises :class:`CodecError` naming the field and the rule (the transport turns it
into a failed reply; the ClientApp into an error reply). Decoding does not import torch.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from clma.drift.spec import DetectorSpec
from clma.engine.clients import (
    ChoiceRequest,
    ReportRequest,
    SecAggSession,
    ShareKeysRequest,
    TrainSettings,
)
from clma.privacy.secagg import (
    SHAMIR_PRIME,
    AdvertiseKeys,
    EncryptedShare,
    MaskedInput,
    SecAggConfig,
    ShareKeys,
    UnmaskingRequest,
    UnmaskingResponse,
)
from clma.rounds import ClientUpdate

__all__ = [
    "CALLS",
    "MESSAGE_TYPES",
    "SCHEMA",
    "STEP_CALLS",
    "CodecError",
    "content_digest",
    "step_items_from_payload",
    "step_payload",
    "DeviceReportRequest",
    "DeviceTrainRequest",
    "DeviceChoiceRequest",
    "decode_choice_reply",
    "decode_choice_request",
    "decode_report_request",
    "decode_roster_layout",
    "decode_roster_reply",
    "decode_step_reply",
    "decode_step_request",
    "decode_train_reply",
    "decode_train_request",
    "encode_choice_reply",
    "encode_choice_request",
    "encode_report_request",
    "encode_roster_reply",
    "encode_roster_request",
    "encode_step_reply",
    "encode_step_request",
    "encode_train_reply",
    "encode_train_request",
    "header_of",
]

SCHEMA = "clma.flower/2"  # 2: prime-field Shamir shares, b_u commitments
RECORD, ARRAYS, METRICS = "clma", "arrays", "metrics"
MODEL, PARAMS = "model", "params"
NUM_EXAMPLES, DRIFT_FLAG = "num-examples", "drift-flag"

#: Seam call -> Flower message type (``<category>[.<action>]``).
MESSAGE_TYPES: dict[str, str] = {
    "roster": "query.clma_roster",
    "train": "train",
    "secagg_advertise": "evaluate.clma_advertise",
    "secagg_share_keys": "evaluate.clma_share_keys",
    "secagg_masked_input": "evaluate.clma_masked",
    "secagg_unmask": "evaluate.clma_unmask",
    "choose": "query.clma_choose",
}
CALLS = tuple(MESSAGE_TYPES)
#: The three secure-aggregation steps after advertising (request and reply: payload only).
STEP_CALLS = ("secagg_share_keys", "secagg_masked_input", "secagg_unmask")

MAX_ID = 2**31 - 1  # client, cohort and partition ids; also rounds
MAX_SAMPLES = 2**40
MAX_SESSIONS = 256
MAX_ITEMS = 1_000_000  # members, roster entries, shares per session
MAX_VECTOR = 4096  # masked-input length
MAX_PARAMS = 2**31 - 1
MAX_TEXT = 65_536  # session ids, JSON of a session config or layout
KEY_BYTES, MAX_CIPHERTEXT = 32, 4096
#: one Shamir share: an element of GF(2^130 - 5), little-endian (clma.privacy.secagg)
SHARE_BYTES = (SHAMIR_PRIME.bit_length() + 7) // 8
COMMITMENT_BYTES = 32  # clma.privacy.secagg.self_mask_commitment
MAX_WORD = 2**62  # masked words live in [0, 2^k), k <= 62
_FORMAT = 2  # binary payload format version (2: 17-byte shares, b_u commitments)
#: Payload kinds: a request payload is never read as a reply, nor one step as another.
_KIND = {"sessions": 1, "request:secagg_share_keys": 3, "request:secagg_masked_input": 4,
         "request:secagg_unmask": 5, "reply:secagg_advertise": 12,
         "reply:secagg_share_keys": 13, "reply:secagg_masked_input": 14,
         "reply:secagg_unmask": 15}


class CodecError(ValueError):
    """A message does not follow schema ``clma.flower/2``; the text names the field and
    the rule (never a value of the message)."""


# ----------------------------------------------------------------------------- scalars


def _int(v: Any, field: str, lo: int = 0, hi: int = MAX_ID) -> int:
    if isinstance(v, bool) or not isinstance(v, int | np.integer):
        raise CodecError(f"{field}: must be an integer")
    v = int(v)
    if not lo <= v <= hi:
        raise CodecError(f"{field}: must be in [{lo}, {hi}]")
    return v


def _float(v: Any, field: str, lo: float, hi: float, *, open_lo: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise CodecError(f"{field}: must be a number")
    v = float(v)
    if not math.isfinite(v) or v < lo or v > hi or (open_lo and v <= lo):
        raise CodecError(f"{field}: must be a finite number in {'(' if open_lo else '['}"
                         f"{lo}, {hi}]")
    return v


def _text(v: Any, field: str, max_len: int = 200) -> str:
    if not isinstance(v, str) or not 1 <= len(v) <= max_len:
        raise CodecError(f"{field}: must be a string of 1..{max_len} characters")
    return v


# ----------------------------------------------------------------------------- binary


class _Writer:
    def __init__(self, kind: str) -> None:
        self.parts = [struct.pack("<BB", _FORMAT, _KIND[kind])]

    def u32(self, v: int) -> None:
        self.parts.append(struct.pack("<I", _int(v, "id or count", 0, 2**32 - 1)))

    def u64(self, v: int) -> None:
        self.parts.append(struct.pack("<Q", int(v)))

    def blob(self, b: bytes) -> None:
        self.u32(len(b))
        self.parts.append(bytes(b))

    def text(self, s: str) -> None:
        self.blob(s.encode("utf-8"))

    def bytes(self) -> bytes:
        return b"".join(self.parts)


class _Reader:
    def __init__(self, data: Any, kind: str) -> None:
        if not isinstance(data, bytes):
            raise CodecError("payload: must be bytes")
        self.data, self.pos = data, 0
        if self._take(2, "payload") != struct.pack("<BB", _FORMAT, _KIND[kind]):
            raise CodecError(f"payload: not a format-{_FORMAT} {kind.replace(':', ' ')} "
                             "payload")

    def _take(self, n: int, field: str) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise CodecError(f"{field}: payload ends early")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def u32(self, field: str, hi: int = MAX_ID) -> int:
        v = struct.unpack("<I", self._take(4, field))[0]
        if v > hi:
            raise CodecError(f"{field}: must be at most {hi}")
        return v

    def count(self, field: str, hi: int) -> int:
        n = self.u32(field, hi)
        return n

    def u64(self, field: str, hi: int) -> int:
        v = struct.unpack("<Q", self._take(8, field))[0]
        if v >= hi:
            raise CodecError(f"{field}: must be below 2^{hi.bit_length() - 1}")
        return v

    def blob(self, field: str, exact: int | None = None, lo: int = 0, hi: int = MAX_TEXT
             ) -> bytes:
        n = self.u32(f"{field} length", 2**32 - 1)
        if exact is not None and n != exact:
            raise CodecError(f"{field}: must be {exact} bytes")
        if not lo <= n <= hi:
            raise CodecError(f"{field}: must be {lo}..{hi} bytes")
        return self._take(n, field)

    def text(self, field: str, hi: int = 200) -> str:
        try:
            s = self.blob(field, lo=1, hi=hi).decode("utf-8")
        except UnicodeDecodeError:
            raise CodecError(f"{field}: must be UTF-8 text") from None
        return s

    def ids(self, field: str) -> list[int]:
        return [self.u32(field) for _ in range(self.count(f"{field} count", MAX_ITEMS))]

    def done(self) -> None:
        if self.pos != len(self.data):
            raise CodecError("payload: trailing bytes after the last field")


def _session_ids(n: int, r: _Reader, field: str) -> Iterable[str]:
    seen: set[str] = set()
    for _ in range(n):
        sid = r.text(f"{field} session id")
        if sid in seen:
            raise CodecError(f"{field}: session id listed twice")
        seen.add(sid)
        yield sid


def _write_ids(w: _Writer, ids: Iterable[int]) -> None:
    ids = sorted(int(i) for i in ids)
    w.u32(len(ids))
    for i in ids:
        w.u32(i)


# ----------------------------------------------------------------------------- header


def _header(call: str, round_number: int, client_id: int, **extra: Any) -> ConfigRecord:
    return ConfigRecord({"schema": SCHEMA, "call": call, "round": int(round_number),
                         "client-id": int(client_id), **extra})


def header_of(content: Any, call: str, *, round_number: int | None = None,
              client_id: int | None = None) -> ConfigRecord:
    """The ``"clma"`` header of ``content``, checked: schema, call and (when given) the
    round and client id it must name. Raises :class:`CodecError`."""
    if not isinstance(content, RecordDict):
        raise CodecError("content: must be a RecordDict")
    rec = content.config_records.get(RECORD) if RECORD in content else None
    if not isinstance(rec, ConfigRecord):
        raise CodecError(f"{RECORD}: the ConfigRecord header is missing")
    if rec.get("schema") != SCHEMA:
        raise CodecError(f"{RECORD}.schema: must be {SCHEMA!r}")
    if rec.get("call") != call:
        raise CodecError(f"{RECORD}.call: must be {call!r}")
    if call != "roster":
        r = _int(rec.get("round"), f"{RECORD}.round", 1)
        if round_number is not None and r != round_number:
            raise CodecError(f"{RECORD}.round: names another round than the one asked")
        c = _int(rec.get("client-id"), f"{RECORD}.client-id")
        if client_id is not None and c != client_id:
            raise CodecError(f"{RECORD}.client-id: names another client than the one asked")
    return rec


def _vector(content: RecordDict, name: str, n: int | None = None) -> np.ndarray:
    """The float32 vector ``name`` of the content's ``"arrays"`` record (finite)."""
    rec = content.array_records.get(ARRAYS) if ARRAYS in content else None
    if not isinstance(rec, ArrayRecord):
        raise CodecError(f"{ARRAYS}: the ArrayRecord is missing")
    if list(rec.keys()) != [name]:
        raise CodecError(f"{ARRAYS}: must hold exactly one array, {name!r}")
    arr = rec[name]
    if arr.dtype != "float32" or len(arr.shape) != 1 or not 1 <= arr.shape[0] <= MAX_PARAMS:
        raise CodecError(f"{ARRAYS}.{name}: must be a non-empty float32 vector")
    if n is not None and arr.shape[0] != n:
        raise CodecError(f"{ARRAYS}.{name}: must have {n} values")
    try:
        v = arr.numpy()
    except Exception:  # a malformed array payload
        raise CodecError(f"{ARRAYS}.{name}: not a readable numpy array") from None
    if v.dtype != np.float32 or v.shape != tuple(arr.shape):
        raise CodecError(f"{ARRAYS}.{name}: content differs from its declared dtype/shape")
    if not np.all(np.isfinite(v)):
        raise CodecError(f"{ARRAYS}.{name}: must be finite")
    return v


def _arrays(name: str, vector: np.ndarray) -> ArrayRecord:
    v = np.ascontiguousarray(np.asarray(vector, dtype=np.float32).ravel())
    return ArrayRecord({name: Array(v)})


# ----------------------------------------------------------------------------- roster


def encode_roster_request() -> RecordDict:
    return RecordDict({RECORD: ConfigRecord({"schema": SCHEMA, "call": "roster"})})


def encode_roster_reply(partition_id: int, layout: tuple[int, str] | None = None
                        ) -> RecordDict:
    """The roster reply: the node's partition id and, when given, its model's layout
    ``(n_params, digest)`` (:func:`clma.models.checks.model_layout`)."""
    rec = ConfigRecord({"schema": SCHEMA, "call": "roster",
                        "partition-id": _int(partition_id, "partition-id")})
    if layout is not None:
        rec["n-params"] = _int(layout[0], "n-params", 1, 2**62)
        rec["model-layout"] = str(layout[1])
    return RecordDict({RECORD: rec})


def decode_roster_reply(content: Any, n_clients: int) -> int:
    """The node's partition id (its client id), in ``[0, n_clients)``."""
    rec = header_of(content, "roster")
    return _int(rec.get("partition-id"), f"{RECORD}.partition-id", 0, n_clients - 1)


def decode_roster_layout(content: Any) -> tuple[int, str] | None:
    """The model layout ``(n_params, digest)`` a roster reply reports (None: none).
    Raises :class:`CodecError` on a malformed one."""
    rec = header_of(content, "roster")
    if "n-params" not in rec and "model-layout" not in rec:
        return None
    n = _int(rec.get("n-params"), f"{RECORD}.n-params", 1, 2**62)
    digest = rec.get("model-layout")
    if not isinstance(digest, str) or len(digest) != 64 or not all(
            c in "0123456789abcdef" for c in digest):
        raise CodecError(f"{RECORD}.model-layout: must be a sha256 hex digest")
    return n, digest


# ----------------------------------------------------------------------------- train


@dataclass(frozen=True)
class DeviceTrainRequest:
    """What one device receives for training (decoded)."""

    round: int
    client_id: int
    cohort_id: int
    model: np.ndarray
    settings: TrainSettings


def encode_train_request(request: Any, client_id: int) -> RecordDict:
    """The train message for one client of a :class:`~clma.engine.clients.TrainRequest`."""
    cohort = int(request.assignments[client_id])
    s = request.settings
    head = _header("train", request.round, client_id, **{
        "cohort-id": cohort, "local-epochs": int(s.local_epochs),
        "learning-rate": float(s.learning_rate), "batch-size": int(s.batch_size),
        "drift-gamma": float(s.drift_gamma), "drift-detector": s.detector.to_json()})
    return RecordDict({RECORD: head, ARRAYS: _arrays(MODEL, request.models[cohort])})


def _detector(v: Any) -> DetectorSpec:
    """The detector spec of a train request (absent: the loss threshold, as sent by a
    server that predates the field)."""
    if v is None:
        return DetectorSpec()
    text = _text(v, f"{RECORD}.drift-detector", 4000)
    try:
        return DetectorSpec.from_json(text)
    except ValueError as exc:
        raise CodecError(f"{RECORD}.drift-detector: {exc}") from None


def decode_train_request(content: Any) -> DeviceTrainRequest:
    rec = header_of(content, "train")
    settings = TrainSettings(
        local_epochs=_int(rec.get("local-epochs"), f"{RECORD}.local-epochs", 1, 10_000),
        learning_rate=_float(rec.get("learning-rate"), f"{RECORD}.learning-rate", 0.0, 1e3,
                             open_lo=True),
        batch_size=_int(rec.get("batch-size"), f"{RECORD}.batch-size", 1, 2**31 - 1),
        drift_gamma=_float(rec.get("drift-gamma"), f"{RECORD}.drift-gamma", 0.0, 1e6),
        detector=_detector(rec.get("drift-detector")),
    )
    return DeviceTrainRequest(int(rec["round"]), int(rec["client-id"]),
                              _int(rec.get("cohort-id"), f"{RECORD}.cohort-id"),
                              _vector(content, MODEL), settings)


def encode_train_reply(update: ClientUpdate, round_number: int) -> RecordDict:
    head = _header("train", round_number, update.client_id, **{"cohort-id": int(update.cohort_id)})
    metrics = MetricRecord({NUM_EXAMPLES: _int(update.n_samples, NUM_EXAMPLES, 1, MAX_SAMPLES),
                            DRIFT_FLAG: int(bool(update.drift_flag))})
    return RecordDict({RECORD: head, ARRAYS: _arrays(PARAMS, update.params), METRICS: metrics})


def decode_train_reply(content: Any, *, round_number: int, client_id: int, cohort_id: int,
                       n_params: int | None = None) -> ClientUpdate:
    """A checked :class:`~clma.rounds.ClientUpdate` from one node's train reply."""
    rec = header_of(content, "train", round_number=round_number, client_id=client_id)
    if _int(rec.get("cohort-id"), f"{RECORD}.cohort-id") != cohort_id:
        raise CodecError(f"{RECORD}.cohort-id: names another cohort than the one assigned")
    m = content.metric_records.get(METRICS) if METRICS in content else None
    if not isinstance(m, MetricRecord):
        raise CodecError(f"{METRICS}: the MetricRecord is missing")
    n = _int(m.get(NUM_EXAMPLES), f"{METRICS}.{NUM_EXAMPLES}", 1, MAX_SAMPLES)
    flag = _int(m.get(DRIFT_FLAG), f"{METRICS}.{DRIFT_FLAG}", 0, 1)
    return ClientUpdate(client_id, cohort_id, _vector(content, PARAMS, n_params), n, bool(flag))


# ----------------------------------------------------------------------------- choose

#: at most this many candidate cohorts in one choice (a split makes few)
MAX_CANDIDATES = 64


@dataclass(frozen=True)
class DeviceChoiceRequest:
    """What one device receives to choose its cohort after a split (decoded)."""

    round: int
    client_id: int
    candidates: tuple[int, ...]
    models: dict[int, np.ndarray]


def encode_choice_request(request: ChoiceRequest, client_id: int) -> RecordDict:
    """The choose message for one client of a :class:`~clma.engine.clients.ChoiceRequest`:
    its candidates (the split's cohort first) and one ``model-<id>`` vector each."""
    cands = [int(k) for k in request.candidates[client_id]]
    head = _header("choose", request.round, client_id, candidates=cands)
    arrays = ArrayRecord({f"model-{k}": Array(np.ascontiguousarray(
        np.asarray(request.models[k], dtype=np.float32).ravel())) for k in cands})
    return RecordDict({RECORD: head, ARRAYS: arrays})


def decode_choice_request(content: Any) -> DeviceChoiceRequest:
    rec = header_of(content, "choose")
    raw = rec.get("candidates")
    if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_CANDIDATES:
        raise CodecError(f"{RECORD}.candidates: must be a list of 1 to {MAX_CANDIDATES} "
                         "cohort ids")
    cands = tuple(_int(k, f"{RECORD}.candidates") for k in raw)
    if len(set(cands)) != len(cands):
        raise CodecError(f"{RECORD}.candidates: must not repeat a cohort")
    arrays = content.array_records.get(ARRAYS) if ARRAYS in content else None
    if not isinstance(arrays, ArrayRecord):
        raise CodecError(f"{ARRAYS}: the ArrayRecord is missing")
    if sorted(arrays.keys()) != sorted(f"model-{k}" for k in cands):
        raise CodecError(f"{ARRAYS}: must hold exactly one array model-<id> per candidate")
    models = {k: _vector(RecordDict({ARRAYS: ArrayRecord({MODEL: arrays[f"model-{k}"]})}),
                         MODEL) for k in cands}
    if len({v.shape for v in models.values()}) != 1:
        raise CodecError(f"{ARRAYS}: the candidates' models must have the same length")
    return DeviceChoiceRequest(int(rec["round"]), int(rec["client-id"]), cands, models)


def encode_choice_reply(round_number: int, client_id: int, cohort_id: int) -> RecordDict:
    return RecordDict({RECORD: _header("choose", round_number, client_id,
                                       **{"cohort-id": _int(cohort_id, "cohort-id")})})


def decode_choice_reply(content: Any, *, round_number: int, client_id: int,
                        candidates: Sequence[int]) -> int:
    """The cohort id one node chose, among the ``candidates`` it was sent."""
    rec = header_of(content, "choose", round_number=round_number, client_id=client_id)
    k = _int(rec.get("cohort-id"), f"{RECORD}.cohort-id")
    if k not in candidates:
        raise CodecError(f"{RECORD}.cohort-id: not one of the candidate cohorts")
    return k


# ----------------------------------------------------------------------------- advertise


@dataclass(frozen=True)
class DeviceReportRequest:
    """What one device receives to compute its report and advertise keys (decoded)."""

    round: int
    client_id: int
    cohort_id: int
    model: np.ndarray
    layout: Any  # clma.metrics.DeviceMetricLayout
    quantisation_levels: int
    sessions: dict[str, SecAggSession]


def encode_report_request(request: ReportRequest, client_id: int) -> RecordDict:
    """The advertise message for one client of a :class:`ReportRequest` (its sessions)."""
    cohort = int(request.assignments[client_id])
    w = _Writer("sessions")
    mine = request.sessions_of(client_id)
    w.u32(len(mine))
    for sid, sess in sorted(mine.items()):
        w.text(sid)
        w.text(sess.config.model_dump_json())
        _write_ids(w, sess.members)
    head = _header("secagg_advertise", request.round, client_id, **{
        "cohort-id": cohort, "layout": request.layout.model_dump_json(),
        "quantisation-levels": int(request.quantisation_levels), "payload": w.bytes()})
    return RecordDict({RECORD: head, ARRAYS: _arrays(MODEL, request.models[cohort])})


def decode_report_request(content: Any) -> DeviceReportRequest:
    from pydantic import ValidationError

    from clma.metrics.device import DeviceMetricLayout

    rec = header_of(content, "secagg_advertise")
    cid = int(rec["client-id"])
    try:
        layout = DeviceMetricLayout.model_validate_json(_text(rec.get("layout"), "layout",
                                                              MAX_TEXT))
    except ValidationError:
        raise CodecError(f"{RECORD}.layout: not a valid DeviceMetricLayout") from None
    q = _int(rec.get("quantisation-levels"), f"{RECORD}.quantisation-levels", 1, 2**40)
    r = _Reader(rec.get("payload"), "sessions")
    sessions: dict[str, SecAggSession] = {}
    for sid in _session_ids(r.count("sessions", MAX_SESSIONS), r, "sessions"):
        try:
            cfg = SecAggConfig.model_validate_json(r.text("session config", MAX_TEXT))
            sess = SecAggSession(sid, cfg, tuple(r.ids("session members")))
        except (ValidationError, ValueError) as exc:
            if isinstance(exc, CodecError):
                raise
            raise CodecError("sessions: a session's config or members are invalid") from None
        if cid not in sess.members:
            raise CodecError("sessions: lists a session this client is not a member of")
        if cfg.quantisation_levels != q:
            raise CodecError("sessions: a session's quantisation levels differ from the "
                             "request's")
        sessions[sid] = sess
    r.done()
    if not sessions:
        raise CodecError("sessions: the request names no session")
    return DeviceReportRequest(int(rec["round"]), cid,
                               _int(rec.get("cohort-id"), f"{RECORD}.cohort-id"),
                               _vector(content, MODEL), layout, q, sessions)


# ----------------------------------------------------------------------------- step items


def _w_adverts(w: _Writer, items: Mapping[str, AdvertiseKeys]) -> None:
    for sid, a in items:
        w.text(sid)
        w.u32(a.client_id)
        w.blob(a.c_pk)
        w.blob(a.s_pk)


def _r_adverts(r: _Reader, sid: str) -> AdvertiseKeys:
    return AdvertiseKeys(r.u32("client id"), r.blob("c_pk", KEY_BYTES), r.blob("s_pk", KEY_BYTES))


def _w_share_req(w: _Writer, items: Iterable[tuple[str, ShareKeysRequest]]) -> None:
    for sid, req in items:
        w.text(sid)
        w.u32(len(req.roster))
        for v, a in sorted(req.roster.items()):
            w.u32(v)
            w.blob(a.c_pk)
            w.blob(a.s_pk)
        _write_ids(w, req.neighbours)


def _r_share_req(r: _Reader, sid: str) -> ShareKeysRequest:
    roster: dict[int, AdvertiseKeys] = {}
    for _ in range(r.count("roster count", MAX_ITEMS)):
        v = r.u32("roster id")
        if v in roster:
            raise CodecError("roster: a client is listed twice")
        roster[v] = AdvertiseKeys(v, r.blob("c_pk", KEY_BYTES), r.blob("s_pk", KEY_BYTES))
    neighbours = r.ids("neighbours")
    if len(set(neighbours)) != len(neighbours):
        raise CodecError("neighbours: a client is listed twice")
    return ShareKeysRequest(roster, tuple(neighbours))


def _w_shares(w: _Writer, shares: Sequence[EncryptedShare]) -> None:
    w.u32(len(shares))
    for s in shares:
        w.u32(s.sender)
        w.u32(s.recipient)
        w.blob(s.ciphertext)


def _r_shares(r: _Reader) -> list[EncryptedShare]:
    return [EncryptedShare(r.u32("share sender"), r.u32("share recipient"),
                           r.blob("ciphertext", lo=16, hi=MAX_CIPHERTEXT))
            for _ in range(r.count("share count", MAX_ITEMS))]


def _w_share_keys(w: _Writer, items: Iterable[tuple[str, ShareKeys]]) -> None:
    for sid, sk in items:
        w.text(sid)
        w.u32(sk.client_id)
        w.blob(sk.b_commitment)
        _w_shares(w, sk.shares)


def _r_share_keys(r: _Reader, sid: str) -> ShareKeys:
    cid = r.u32("client id")
    commitment = r.blob("b_commitment", COMMITMENT_BYTES)
    return ShareKeys(cid, tuple(_r_shares(r)), commitment)


def _w_inbox(w: _Writer, items: Iterable[tuple[str, Sequence[EncryptedShare]]]) -> None:
    for sid, box in items:
        w.text(sid)
        _w_shares(w, list(box))


def _r_inbox(r: _Reader, sid: str) -> list[EncryptedShare]:
    return _r_shares(r)


def _w_masked(w: _Writer, items: Iterable[tuple[str, MaskedInput]]) -> None:
    for sid, m in items:
        w.text(sid)
        w.u32(m.client_id)
        y = np.asarray(m.masked, dtype=np.uint64)
        w.u32(y.shape[0])
        w.parts.append(np.ascontiguousarray(y, dtype="<u8").tobytes())


def _r_masked(r: _Reader, sid: str) -> MaskedInput:
    cid = r.u32("client id")
    d = r.count("masked length", MAX_VECTOR)
    y = np.frombuffer(r._take(8 * d, "masked"), dtype="<u8").astype(np.uint64)
    if np.any(y >= np.uint64(MAX_WORD)):
        raise CodecError(f"masked: words must be below 2^{MAX_WORD.bit_length() - 1}")
    return MaskedInput(cid, y)


def _w_unmask_req(w: _Writer, items: Iterable[tuple[str, UnmaskingRequest]]) -> None:
    for sid, req in items:
        w.text(sid)
        _write_ids(w, req.survivors)
        _write_ids(w, req.dropped)


def _r_unmask_req(r: _Reader, sid: str) -> UnmaskingRequest:
    s, d = r.ids("survivors"), r.ids("dropped")
    if len(set(s)) != len(s) or len(set(d)) != len(d):
        raise CodecError("unmasking request: a client is listed twice")
    return UnmaskingRequest(frozenset(s), frozenset(d))


def _w_unmask(w: _Writer, items: Iterable[tuple[str, UnmaskingResponse]]) -> None:
    for sid, resp in items:
        w.text(sid)
        w.u32(resp.client_id)
        w.u32(len(resp.self_mask_shares))
        for o, (i, b) in sorted(resp.self_mask_shares.items()):
            w.u32(o)
            w.u32(i)
            w.blob(b)
        w.u32(len(resp.key_shares))
        for o, (i, a, b) in sorted(resp.key_shares.items()):
            w.u32(o)
            w.u32(i)
            w.blob(a)
            w.blob(b)


def _r_unmask(r: _Reader, sid: str) -> UnmaskingResponse:
    cid = r.u32("client id")
    b_out: dict[int, tuple[int, bytes]] = {}
    for _ in range(r.count("self-mask share count", MAX_ITEMS)):
        o, i = r.u32("share owner"), r.u32("share index")
        if o in b_out:
            raise CodecError("self-mask shares: an owner is listed twice")
        b_out[o] = (i, r.blob("self-mask share", SHARE_BYTES))
    k_out: dict[int, tuple[int, bytes, bytes]] = {}
    for _ in range(r.count("key share count", MAX_ITEMS)):
        o, i = r.u32("share owner"), r.u32("share index")
        if o in k_out:
            raise CodecError("key shares: an owner is listed twice")
        k_out[o] = (i, r.blob("key share", SHARE_BYTES), r.blob("key share", SHARE_BYTES))
    return UnmaskingResponse(cid, b_out, k_out)


_REQUEST_CODECS = {
    "secagg_share_keys": (_w_share_req, _r_share_req),
    "secagg_masked_input": (_w_inbox, _r_inbox),
    "secagg_unmask": (_w_unmask_req, _r_unmask_req),
}
_REPLY_CODECS = {
    "secagg_advertise": (_w_adverts, _r_adverts, AdvertiseKeys),
    "secagg_share_keys": (_w_share_keys, _r_share_keys, ShareKeys),
    "secagg_masked_input": (_w_masked, _r_masked, MaskedInput),
    "secagg_unmask": (_w_unmask, _r_unmask, UnmaskingResponse),
}


def _payload(kind: str, items: Mapping[str, Any], write: Any) -> bytes:
    if len(items) > MAX_SESSIONS:
        raise CodecError(f"sessions: at most {MAX_SESSIONS} per message")
    w = _Writer(kind)
    w.u32(len(items))
    write(w, sorted(items.items()))
    return w.bytes()


def _items(kind: str, payload: Any, read: Any) -> dict[str, Any]:
    r = _Reader(payload, kind)
    out = {sid: read(r, sid) for sid in _session_ids(r.count("sessions", MAX_SESSIONS), r,
                                                       "sessions")}
    r.done()
    return out


def encode_step_request(call: str, round_number: int, client_id: int,
                        items: Mapping[str, Any]) -> RecordDict:
    """One client's request of a secure-aggregation step (``call`` in :data:`STEP_CALLS`):
    session id -> :class:`ShareKeysRequest` / list of :class:`EncryptedShare` /
    :class:`UnmaskingRequest`."""
    payload = _payload(f"request:{call}", items, _REQUEST_CODECS[call][0])
    return RecordDict({RECORD: _header(call, round_number, client_id, payload=payload)})


def decode_step_request(call: str, content: Any) -> tuple[int, int, dict[str, Any]]:
    """``(round, client id, session id -> request item)`` of a step request."""
    rec = header_of(content, call)
    items = _items(f"request:{call}", rec.get("payload"), _REQUEST_CODECS[call][1])
    return int(rec["round"]), int(rec["client-id"]), items


def encode_step_reply(call: str, round_number: int, client_id: int,
                      items: Mapping[str, Any]) -> RecordDict:
    """One client's reply to a secure-aggregation call (advertise included): session id
    -> its protocol message."""
    payload = _payload(f"reply:{call}", items, _REPLY_CODECS[call][0])
    return RecordDict({RECORD: _header(call, round_number, client_id, payload=payload)})


def decode_step_reply(call: str, content: Any, *, round_number: int, client_id: int,
                      sessions: Iterable[str]) -> dict[str, Any]:
    """Session id -> protocol message of one client's reply, checked: the round and client
    it names, only sessions it was asked about, each message from that client."""
    rec = header_of(content, call, round_number=round_number, client_id=client_id)
    items = _items(f"reply:{call}", rec.get("payload"), _REPLY_CODECS[call][1])
    asked = set(sessions)
    if not set(items) <= asked:
        raise CodecError("payload: answers a session the client was not asked about")
    for m in items.values():
        if m.client_id != client_id:
            raise CodecError("payload: a protocol message names another client")
    return items


def step_payload(call: str, items: Mapping[str, Any]) -> bytes:
    """The binary reply payload of a secure-aggregation call (what the journal stores)."""
    return _payload(f"reply:{call}", items, _REPLY_CODECS[call][0])


def step_items_from_payload(call: str, payload: bytes) -> dict[str, Any]:
    """Inverse of :func:`step_payload`."""
    return _items(f"reply:{call}", payload, _REPLY_CODECS[call][1])


def content_digest(content: RecordDict) -> str:
    """SHA-256 of a message content (every record, key, value and array), independent of
    Python object identity: equal contents, equal digests."""
    h = hashlib.sha256()
    for name in sorted(content.keys()):
        rec = content[name]
        h.update(f"[{type(rec).__name__}:{name}]".encode())
        for k in sorted(rec.keys()):
            v = rec[k]
            h.update(f"<{k}>".encode())
            if isinstance(v, Array):
                h.update(f"{v.dtype}{tuple(v.shape)}{v.stype}".encode())
                h.update(hashlib.sha256(v.data).digest())
            elif isinstance(v, bytes):
                h.update(b"b" + hashlib.sha256(v).digest())
            elif isinstance(v, list):
                h.update(repr([hashlib.sha256(x).hexdigest() if isinstance(x, bytes) else x
                               for x in v]).encode())
            else:
                h.update(f"{type(v).__name__}:{v!r}".encode())
    return h.hexdigest()
