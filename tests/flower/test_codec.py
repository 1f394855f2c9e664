"""The Flower transport's wire format (clma.flower.codec): every request and reply round
trips exactly, and every malformed input is refused with a CodecError naming the field."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from clma.engine.clients import (
    ReportRequest,
    SecAggSession,
    ShareKeysRequest,
    TrainRequest,
    TrainSettings,
)
from clma.flower import codec
from clma.flower.codec import CodecError
from clma.metrics import DeviceMetricLayout
from clma.privacy.secagg import (
    SecAggClient,
    SecAggConfig,
    SecAggServer,
    UnmaskingRequest,
)
from clma.rounds import ClientUpdate

SETTINGS = TrainSettings(local_epochs=2, learning_rate=0.25, batch_size=8, drift_gamma=0.5)
MODEL = np.linspace(-1, 1, 11, dtype=np.float32)


def _train_request() -> TrainRequest:
    return TrainRequest(4, {3: 1, 5: 0}, {0: MODEL, 1: MODEL * 2}, SETTINGS)


def _protocol(n=4, sid="eval-2-global"):
    """A real secure-aggregation exchange between n clients (ids 0..n-1)."""
    cfg = SecAggConfig(n_clients=n, threshold=3, vector_length=5, round_id=sid)
    clients = {u: SecAggClient(u, cfg) for u in range(n)}
    server = SecAggServer(cfg, list(range(n)))
    adverts = {u: c.advertise() for u, c in clients.items()}
    rosters = server.collect_advertisements(list(adverts.values()))
    share_reqs = {u: ShareKeysRequest(ro, tuple(server.neighbours[u])) for u, ro in rosters.items()}
    shares = {u: clients[u].share_keys(r.roster, r.neighbours) for u, r in share_reqs.items()}
    inbox = server.route_shares(list(shares.values()))
    for u, box in inbox.items():
        clients[u].receive_shares(box)
    masked = {u: clients[u].masked_input(np.arange(5, dtype=np.uint64) + u) for u in clients}
    unmask_req = server.collect_masked_inputs(list(masked.values()))
    responses = {u: clients[u].unmask(unmask_req) for u in clients}
    return cfg, adverts, share_reqs, shares, inbox, masked, unmask_req, responses


# ------------------------------------------------------------------ round trips
def test_train_request_and_reply_round_trip_exactly(run_id):
    content = codec.encode_train_request(_train_request(), 3)
    got = codec.decode_train_request(content)
    assert (got.round, got.client_id, got.cohort_id, got.settings) == (4, 3, 1, SETTINGS)
    np.testing.assert_array_equal(got.model, MODEL * 2)
    upd = ClientUpdate(3, 1, MODEL + 1, 17, True)
    back = codec.decode_train_reply(codec.encode_train_reply(upd, 4), round_number=4,
                                    client_id=3, cohort_id=1, n_params=11)
    assert (back.client_id, back.cohort_id, back.n_samples, back.drift_flag) == (3, 1, 17, True)
    assert back.params.dtype == np.float32
    np.testing.assert_array_equal(back.params, MODEL + 1)
    reply = codec.encode_train_reply(upd, 4)  # Flower's own strategies can read it too
    assert dict(reply[codec.METRICS]) == {"num-examples": 17, "drift-flag": 1}


def test_report_request_carries_only_the_clients_sessions(run_id):
    cfg, *_ = _protocol()
    other = SecAggConfig(n_clients=2, threshold=2, vector_length=5, round_id="eval-2-north")
    layout = DeviceMetricLayout(l_max=3.0, version="1+v2")
    req = ReportRequest(2, {0: 0, 1: 1, 2: 0, 3: 0}, {0: MODEL, 1: MODEL * 3}, layout, 2**16 - 1,
                        {cfg.round_id: SecAggSession(cfg.round_id, cfg, (0, 1, 2, 3)),
                         other.round_id: SecAggSession(other.round_id, other, (1, 3))})
    got = codec.decode_report_request(codec.encode_report_request(req, 1))
    assert set(got.sessions) == {cfg.round_id, other.round_id}
    assert got.sessions[other.round_id].members == (1, 3) and got.layout == layout
    np.testing.assert_array_equal(got.model, MODEL * 3)
    got0 = codec.decode_report_request(codec.encode_report_request(req, 0))
    assert set(got0.sessions) == {cfg.round_id}  # never told about a session it is not in
    assert got0.sessions[cfg.round_id].config == cfg


def test_every_secure_aggregation_message_round_trips(run_id):
    cfg, adverts, share_reqs, shares, inbox, masked, unmask_req, responses = _protocol()
    sid = cfg.round_id
    cases = [
        ("secagg_share_keys", share_reqs[1], None),
        ("secagg_masked_input", inbox[1], None),
        ("secagg_unmask", unmask_req, None),
    ]
    for call, item, _ in cases:
        rnd, cid, items = codec.decode_step_request(
            call, codec.encode_step_request(call, 2, 1, {sid: item}))
        assert (rnd, cid) == (2, 1)
        assert items[sid] == item or list(items[sid]) == list(item)
    for call, item in [("secagg_advertise", adverts[1]), ("secagg_share_keys", shares[1]),
                       ("secagg_masked_input", masked[1]), ("secagg_unmask", responses[1])]:
        content = codec.encode_step_reply(call, 2, 1, {sid: item})
        got = codec.decode_step_reply(call, content, round_number=2, client_id=1, sessions=[sid])
        if call == "secagg_masked_input":
            assert got[sid].client_id == 1
            np.testing.assert_array_equal(got[sid].masked, item.masked)
        else:
            assert got[sid] == item
        assert codec.step_items_from_payload(call, codec.step_payload(call, {sid: item})).keys() == {sid}


def test_content_digest_depends_on_content_only(run_id):
    a = codec.encode_train_request(_train_request(), 3)
    b = codec.encode_train_request(_train_request(), 3)
    assert codec.content_digest(a) == codec.content_digest(b)
    c = codec.encode_train_request(TrainRequest(4, {3: 1}, {1: MODEL * 2 + 1e-7}, SETTINGS), 3)
    assert codec.content_digest(c) != codec.content_digest(a)


# ------------------------------------------------------------------ malformed
def _reply(**over):
    head = {"schema": codec.SCHEMA, "call": "train", "round": 4, "client-id": 3, "cohort-id": 1}
    metrics = {"num-examples": 17, "drift-flag": 0}
    arrays = {"params": Array(MODEL.copy())}
    for k, v in over.items():
        target = metrics if k in metrics or k.startswith("m:") else head
        k = k.removeprefix("m:")
        if k == "arrays":
            arrays = v
            continue
        if v is None:
            target.pop(k, None)
        else:
            target[k] = v
    return RecordDict({"clma": ConfigRecord(head), "arrays": ArrayRecord(arrays),
                       "metrics": MetricRecord(metrics)})


@pytest.mark.parametrize(("over", "field"), [
    ({"schema": "clma.flower/0"}, "clma.schema"),
    ({"call": "secagg_unmask"}, "clma.call"),
    ({"round": 5}, "clma.round"),
    ({"round": -1}, "clma.round"),
    ({"round": 2**40}, "clma.round"),
    ({"round": True}, "clma.round"),
    ({"round": 4.0}, "clma.round"),
    ({"client-id": 4}, "clma.client-id"),
    ({"client-id": "3"}, "clma.client-id"),
    ({"cohort-id": 2}, "clma.cohort-id"),
    ({"cohort-id": None}, "clma.cohort-id"),
    ({"num-examples": 0}, "metrics.num-examples"),
    ({"num-examples": -5}, "metrics.num-examples"),
    ({"num-examples": 2**50}, "metrics.num-examples"),
    ({"num-examples": 17.0}, "metrics.num-examples"),
    ({"num-examples": None}, "metrics.num-examples"),
    ({"drift-flag": 2}, "metrics.drift-flag"),
    ({"drift-flag": 0.5}, "metrics.drift-flag"),
    ({"arrays": {"params": Array(MODEL.astype(np.float64))}}, "arrays.params"),
    ({"arrays": {"params": Array(MODEL[:5].copy())}}, "arrays.params"),
    ({"arrays": {"params": Array(np.array([1.0, np.nan], np.float32))}}, "arrays.params"),
    ({"arrays": {"params": Array(MODEL.reshape(1, -1).copy())}}, "arrays.params"),
    ({"arrays": {"w": Array(MODEL.copy())}}, "arrays"),
    ({"arrays": {"params": Array(MODEL.copy()), "x": Array(MODEL.copy())}}, "arrays"),
])
def test_a_malformed_train_reply_is_refused_naming_the_field(over, field):
    with pytest.raises(CodecError, match=f"^{field.replace('.', '[.]')}"):
        codec.decode_train_reply(_reply(**over), round_number=4, client_id=3, cohort_id=1,
                                 n_params=11)


def test_missing_records_and_foreign_content_are_refused():
    with pytest.raises(CodecError, match="content: must be a RecordDict"):
        codec.header_of({"clma": {}}, "train")
    with pytest.raises(CodecError, match="clma: the ConfigRecord header is missing"):
        codec.header_of(RecordDict({}), "train")
    no_metrics = RecordDict({"clma": _reply()["clma"], "arrays": _reply()["arrays"]})
    with pytest.raises(CodecError, match="metrics: the MetricRecord is missing"):
        codec.decode_train_reply(no_metrics, round_number=4, client_id=3, cohort_id=1)
    with pytest.raises(CodecError, match="clma.partition-id"):
        codec.decode_roster_reply(RecordDict({"clma": ConfigRecord(
            {"schema": codec.SCHEMA, "call": "roster", "partition-id": 9})}), 6)


def _step_reply(call, payload, **head):
    h = {"schema": codec.SCHEMA, "call": call, "round": 2, "client-id": 1, "payload": payload}
    h.update(head)
    return RecordDict({"clma": ConfigRecord(h)})


def test_malformed_secure_aggregation_replies_are_refused(run_id):
    cfg, adverts, _, shares, _, masked, _, responses = _protocol()
    sid = cfg.round_id
    good = codec.step_payload("secagg_advertise", {sid: adverts[1]})

    def refused(call, payload, match, sessions=(sid,), **head):
        with pytest.raises(CodecError, match=match):
            codec.decode_step_reply(call, _step_reply(call, payload, **head), round_number=2,
                                    client_id=1, sessions=sessions)

    refused("secagg_advertise", good[:-3], "payload ends early")
    refused("secagg_advertise", good + b"\x00", "trailing bytes")
    refused("secagg_advertise", "not bytes", "payload: must be bytes")
    refused("secagg_advertise", codec.step_payload("secagg_share_keys", {sid: shares[1]}),
            "not a format-2 reply secagg_advertise payload")
    refused("secagg_advertise", good, "answers a session the client was not asked about",
            sessions=("eval-2-north",))
    refused("secagg_advertise", codec.step_payload("secagg_advertise", {sid: adverts[2]}),
            "names another client")
    refused("secagg_advertise", good, "clma.client-id", **{"client-id": 2})
    # a 31-byte public key: the length prefix says 31
    bad_key = bytearray(good)
    pos = bad_key.index(adverts[1].c_pk)
    bad_key[pos - 4:pos] = (31).to_bytes(4, "little")
    refused("secagg_advertise", bytes(bad_key), "c_pk: must be 32 bytes")
    # masked words beyond the modulus range; a huge session count
    big = codec.step_payload("secagg_masked_input", {sid: masked[1]})
    arr = bytearray(big)
    arr[-8:] = (2**63).to_bytes(8, "little")
    refused("secagg_masked_input", bytes(arr), "masked: words must be below 2\\^62")
    huge = bytes([2, 12]) + (10**6).to_bytes(4, "little")
    refused("secagg_advertise", huge, "sessions: must be at most 256")
    # the commitment to b_u is part of every share-keys reply, 32 bytes exactly
    sk = bytearray(codec.step_payload("secagg_share_keys", {sid: shares[1]}))
    pos = sk.index(shares[1].b_commitment)
    sk[pos - 4:pos] = (31).to_bytes(4, "little")
    refused("secagg_share_keys", bytes(sk), "b_commitment: must be 32 bytes")
    dup = codec.step_payload("secagg_unmask", {sid: responses[1]})
    refused("secagg_unmask", dup[:2] + (2).to_bytes(4, "little") + dup[6:] + dup[6:],
            "session id listed twice")


def test_malformed_requests_are_refused_on_the_device(run_id):
    cfg, *_ = _protocol()
    layout = DeviceMetricLayout()
    req = ReportRequest(2, {1: 0}, {0: MODEL}, layout, 2**16 - 1,
                        {cfg.round_id: SecAggSession(cfg.round_id, cfg, (0, 1, 2, 3))})
    content = codec.encode_report_request(req, 1)
    content["clma"]["layout"] = '{"l_max": -1}'
    with pytest.raises(CodecError, match="clma.layout: not a valid DeviceMetricLayout"):
        codec.decode_report_request(content)
    content = codec.encode_report_request(req, 1)
    content["clma"]["quantisation-levels"] = 7
    with pytest.raises(CodecError, match="quantisation levels differ"):
        codec.decode_report_request(content)
    bad = TrainRequest(4, {3: 1}, {1: MODEL}, TrainSettings(2, float("nan"), 8, 0.5))
    with pytest.raises(CodecError, match="clma.learning-rate"):
        codec.decode_train_request(codec.encode_train_request(bad, 3))
    with pytest.raises(CodecError, match="unmasking request: a client is listed twice"):
        payload = codec.encode_step_request("secagg_unmask", 2, 1, {cfg.round_id: UnmaskingRequest(
            frozenset({0, 1}), frozenset())})["clma"]["payload"]
        # survivors count 2 -> 3 with a repeated id
        i = payload.index((2).to_bytes(4, "little") + (0).to_bytes(4, "little"))
        patched = (payload[:i] + (3).to_bytes(4, "little") + (0).to_bytes(4, "little")
                   + (0).to_bytes(4, "little") + payload[i + 8:])
        codec.decode_step_request("secagg_unmask", _step_reply("secagg_unmask", patched))


def test_the_train_request_carries_the_drift_detector_spec(run_id):
    from clma.drift import DetectorSpec

    spec = DetectorSpec.of("cusum", {"k": 0.25, "h": 3.0})
    settings = TrainSettings(2, 0.25, 8, 0.5, detector=spec)
    req = TrainRequest(4, {3: 1}, {1: MODEL * 2}, settings)
    content = codec.encode_train_request(req, 3)
    assert codec.decode_train_request(content).settings == settings
    # a server that predates the field: the loss threshold
    del content[codec.RECORD]["drift-detector"]
    assert codec.decode_train_request(content).settings.detector == DetectorSpec()
    content[codec.RECORD]["drift-detector"] = '{"kind": "cusum", "params": {"h": -1.0}}'
    with pytest.raises(CodecError, match=r"clma\.drift-detector: drift\.cusum\.h"):
        codec.decode_train_request(content)


# ------------------------------------------------------------------ choose
def _choice_request():
    from clma.engine.clients import ChoiceRequest

    return ChoiceRequest(5, {3: (8, 7), 4: (7, 8)}, {7: MODEL, 8: MODEL * 3})


def test_the_choice_request_and_reply_round_trip_exactly(run_id):
    content = codec.encode_choice_request(_choice_request(), 3)
    got = codec.decode_choice_request(content)
    assert (got.round, got.client_id, got.candidates) == (5, 3, (8, 7))
    np.testing.assert_array_equal(got.models[8], MODEL * 3)
    np.testing.assert_array_equal(got.models[7], MODEL)
    reply = codec.encode_choice_reply(5, 3, 7)
    assert codec.decode_choice_reply(reply, round_number=5, client_id=3, candidates=(8, 7)) == 7
    assert codec.MESSAGE_TYPES["choose"] == "query.clma_choose"


@pytest.mark.parametrize(("patch", "match"), [
    (lambda c: c["clma"].__setitem__("candidates", [8, 8]), "must not repeat a cohort"),
    (lambda c: c["clma"].__setitem__("candidates", []), "list of 1 to 64 cohort ids"),
    (lambda c: c["clma"].__setitem__("candidates", [8, -1]), "clma.candidates"),
    (lambda c: c["arrays"].__delitem__("model-7"), "one array model-<id> per candidate"),
    (lambda c: c["arrays"].__setitem__("model-7", Array(MODEL[:5].copy())),
     "the same length"),
    (lambda c: c["arrays"].__setitem__("model-7", Array(np.full(11, np.nan, np.float32))),
     "must be finite"),
])
def test_a_malformed_choice_request_is_refused_on_the_device(run_id, patch, match):
    content = codec.encode_choice_request(_choice_request(), 3)
    patch(content)
    with pytest.raises(CodecError, match=match):
        codec.decode_choice_request(content)


def test_a_choice_reply_outside_the_candidates_is_refused(run_id):
    with pytest.raises(CodecError, match="clma.cohort-id: not one of the candidate cohorts"):
        codec.decode_choice_reply(codec.encode_choice_reply(5, 3, 9), round_number=5,
                                  client_id=3, candidates=(8, 7))
    with pytest.raises(CodecError, match="clma.client-id"):
        codec.decode_choice_reply(codec.encode_choice_reply(5, 4, 7), round_number=5,
                                  client_id=3, candidates=(8, 7))
