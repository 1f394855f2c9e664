"""The CLMA ClientApp: one device of a federation on a Flower SuperNode.

``make_client_app(learner_factory)`` returns a ``flwr.clientapp.ClientApp`` answering the
Flower transport's calls (:mod:`clma.flower.transport`, wire format
:mod:`clma.flower.codec`) with the on-device rules of :mod:`clma.device`:

* ``query.clma_roster`` -- the node's ``partition-id`` (its client id; node config) and
  the layout of the model the run names (parameter count and digest,
  :func:`clma.models.checks.model_layout`): the server refuses a node whose model differs
  from its own;
* ``train`` -- :func:`clma.device.train_on_device`: the received model's loss on the
  current local data feeds the drift detector (state keyed by round,
  :class:`clma.drift.RoundKeyedState`), local training, reply with the parameters, the
  sample count and the flag bit (never the loss);
* ``evaluate.clma_advertise`` -- the metric report on the local evaluation data, clipped
  and quantised (:func:`clma.device.quantised_report`), and the public keys of every
  secure-aggregation session the node is in (:class:`clma.device.DeviceSecAgg`);
* ``evaluate.clma_share_keys`` / ``clma_masked`` / ``clma_unmask`` -- the next steps;
* ``query.clma_choose`` -- after a split, :func:`clma.device.choose_cohort`: the candidate
  cohort whose model has the lowest loss on the local evaluation data (its id only).

Device state -- the detector's :class:`RoundKeyedState`, the round's
:class:`DeviceSecAgg` secrets and the replies already given -- lives in the node's
``context.state`` (Flower keeps it between the messages of a run) and is never sent. A new
Flower run starts with an empty ``context.state``: to carry the state across runs (a
resumed federation, one run per scheduled round), give the SuperNode a folder of its own,
``--node-config "... state-dir='/var/lib/clma'"``; the state is mirrored there
(atomically, one file per federation: run config ``federation-id``) and read back when the
run's context is empty.

Idempotent per round: a request asked again (a retried or resumed server step) gets the
reply the device already gave, from its state; a *different* request for a step the device
already answered in that round is refused -- answering two versions of one
secure-aggregation step could let the server learn a sum over fewer clients (or reuse an
AES-GCM nonce). Training re-asked for a round starts from the detector state before that
round, so the flag is the same.

Bad server messages get an error reply naming the field and the rule; the node keeps
running. Error codes: :data:`BAD_REQUEST`, :data:`REFUSED`, :data:`DEVICE_ERROR`.

The model and data are the user's: a ``learner_factory(context) -> LocalLearner``
(:class:`clma.flower.learner.TorchLearner` over a torch model factory and data loaders).
The default factory, :func:`default_learner_factory`, builds the model the server names in
the run config (``model-spec``: the federation's ``[model] factory``, imported on the
device, or the built-in MLP) over the data of the node config's ``data-source``
(:mod:`clma.flower.device_data`); the built-in demo is
``data-source='clma.sim.demo:simulated_shard'``. A data source that does not import or
returns data of the wrong shape gets an error reply (:data:`DEVICE_ERROR`) naming
``node config 'data-source'``; the server records it as that node's failure.
"""

from __future__ import annotations

import base64
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp

from clma.drift import RoundKeyedState
from clma.flower import codec

__all__ = [
    "BAD_REQUEST",
    "DEVICE_ERROR",
    "REFUSED",
    "DeviceRefusal",
    "DeviceState",
    "default_learner_factory",
    "digits_learner_factory",
    "make_client_app",
    "partition_id_of",
]

BAD_REQUEST, REFUSED, DEVICE_ERROR = 4001, 4003, 4500
STATE_KEY = "clma.device"
STATE_FILE_FORMAT = "clma.device-state/1"
_log = logging.getLogger("clma.flower.clientapp")


class DeviceRefusal(RuntimeError):
    """The device refuses a well-formed request (wrong client, another round's step, a
    second version of an answered step)."""


# ----------------------------------------------------------------------------- state


class DeviceState:
    """The device's own state (module docstring): ``detector`` (RoundKeyedState),
    ``secagg`` (the round's :meth:`DeviceSecAgg.to_dict`, or None) and ``answered``
    (call -> ``{"digest", "reply"}`` of the secure-aggregation round in progress)."""

    def __init__(self, detector: RoundKeyedState | None = None, secagg: dict | None = None,
                 answered: dict[str, dict[str, str]] | None = None) -> None:
        self.detector = detector if detector is not None else RoundKeyedState()
        self.secagg = secagg
        self.answered = answered or {}

    def to_json(self) -> str:
        return json.dumps({"format": STATE_FILE_FORMAT, "detector": self.detector.to_dict(),
                           "secagg": self.secagg, "answered": self.answered}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> DeviceState:
        doc = json.loads(text)
        if doc.get("format") != STATE_FILE_FORMAT:
            raise ValueError("device state: unknown format")
        return cls(RoundKeyedState.from_dict(doc["detector"]), doc.get("secagg"),
                   dict(doc.get("answered") or {}))

    # ------------------------------------------------------------ storage
    @staticmethod
    def _file(context: Context) -> Path | None:
        d = context.node_config.get("state-dir")
        if not isinstance(d, str) or not d:
            return None
        pid = context.node_config.get("partition-id", "x")
        return Path(d) / f"clma-device-{pid}-{federation_of(context)}.json"

    @classmethod
    def load(cls, context: Context) -> DeviceState:
        rec = context.state.config_records.get(STATE_KEY) if STATE_KEY in context.state else None
        if rec is not None and isinstance(rec.get("json"), str):
            return cls.from_json(rec["json"])
        f = cls._file(context)
        if f is not None and f.exists():
            return cls.from_json(f.read_text("utf-8"))
        return cls()

    def save(self, context: Context) -> None:
        from flwr.app import ConfigRecord

        text = self.to_json()
        context.state[STATE_KEY] = ConfigRecord({"json": text})
        f = self._file(context)
        if f is not None:
            f.parent.mkdir(parents=True, exist_ok=True)
            tmp = f.with_name(f".{f.name}.tmp-{os.getpid()}")
            with open(tmp, "w", encoding="utf-8") as fh:
                fh.write(text)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, f)


def federation_of(context: Context) -> str:
    """The federation this run belongs to (run config ``federation-id``, set by the
    server: the same for a resumed federation, another for a new one); a device keeps one
    state per federation."""
    v = context.run_config.get("federation-id")
    if isinstance(v, str) and v and len(v) <= 64 and all(c.isalnum() or c in "-_" for c in v):
        return v
    return "default"


# ----------------------------------------------------------------------------- learners


def digits_learner_factory(context: Context) -> Any:
    """The built-in demo's learner whatever the node config says: the simulated digits
    client of the node's ``partition-id`` in the run's federation (``config-json``) --
    the default factory with ``data-source = clma.sim.demo:simulated_shard``
    (:func:`clma.flower.device_data.device_learner_factory`)."""
    from clma.flower.device_data import DATA_SOURCE, DEMO_SOURCE, device_learner_factory

    demo = Context(run_id=context.run_id, node_id=context.node_id,
                   node_config={**dict(context.node_config), DATA_SOURCE: DEMO_SOURCE},
                   state=context.state, run_config=context.run_config)
    return device_learner_factory(demo)


def default_learner_factory(context: Context) -> Any:
    """The ClientApp's default learner: the node config's ``data-source`` under the model
    the server names (:func:`clma.flower.device_data.device_learner_factory`)."""
    from clma.flower.device_data import device_learner_factory

    return device_learner_factory(context)


def partition_id_of(context: Context) -> int:
    """The node's client id: node config ``partition-id``, an integer >= 0.

    Raises:
        DeviceRefusal: missing or not such an integer.
    """
    v = context.node_config.get("partition-id")
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= codec.MAX_ID:
        raise DeviceRefusal("node config 'partition-id': must be an integer >= 0 "
                            "(flower-supernode --node-config \"partition-id=N\")")
    return v


_partition_id = partition_id_of


# ----------------------------------------------------------------------------- handlers


def _digest(content: RecordDict) -> str:
    return codec.content_digest(content)


def _answered(state: DeviceState, call: str, digest: str) -> bytes | None:
    """The reply already given to this exact request; refuse another version of it."""
    prev = state.answered.get(call)
    if prev is None:
        return None
    if prev["digest"] != digest:
        raise DeviceRefusal(f"{call}: already answered another request for this round "
                            "(a device answers each secure-aggregation step once)")
    return base64.b64decode(prev["reply"])


def _remember(state: DeviceState, call: str, digest: str, payload: bytes) -> None:
    state.answered[call] = {"digest": digest, "reply": base64.b64encode(payload).decode()}


def _train(msg: Message, context: Context, factory: Callable[[Context], Any]) -> RecordDict:
    import torch

    from clma.device import train_on_device

    torch.set_num_threads(1)  # thread-independent float results (as the server's flow)
    req = codec.decode_train_request(msg.content)
    if req.client_id != _partition_id(context):
        raise DeviceRefusal("train: the request names another client than this node")
    learner = factory(context)
    state = DeviceState.load(context)
    update = train_on_device(req.client_id, req.cohort_id, req.model, req.settings, req.round,
                             learner, state.detector)
    state.save(context)
    return codec.encode_train_reply(update, req.round)


def _advertise(msg: Message, context: Context, factory: Callable[[Context], Any]) -> RecordDict:
    from clma.device import DeviceSecAgg, quantised_report

    call = "secagg_advertise"
    req = codec.decode_report_request(msg.content)
    if req.client_id != _partition_id(context):
        raise DeviceRefusal(f"{call}: the request names another client than this node")
    state = DeviceState.load(context)
    digest = _digest(msg.content)
    current = state.secagg.get("round") if state.secagg else None
    if current is not None and current > req.round:
        raise DeviceRefusal(f"{call}: the device already takes part in a later round")
    if current == req.round:  # asked again: the same keys, or a refusal (never new keys)
        prev = _answered(state, call, digest)
        if prev is None:
            raise DeviceRefusal(f"{call}: this round's secure aggregation already started")
        return RecordDict({codec.RECORD: _reply_header(call, req.round, req.client_id, prev)})
    import torch

    torch.set_num_threads(1)
    learner = factory(context)
    proba, labels = learner.predict(req.model, req.round)
    q = quantised_report(proba, labels, req.layout, req.quantisation_levels)
    dev = DeviceSecAgg(req.client_id, req.round)
    adverts = dev.advertise(q, req.sessions)
    payload = codec.step_payload(call, adverts)
    state.secagg, state.answered = dev.to_dict(), {}
    _remember(state, call, digest, payload)
    state.save(context)
    return RecordDict({codec.RECORD: _reply_header(call, req.round, req.client_id, payload)})


def _choose(msg: Message, context: Context, factory: Callable[[Context], Any]) -> RecordDict:
    import torch

    from clma.device import choose_cohort

    torch.set_num_threads(1)
    req = codec.decode_choice_request(msg.content)
    if req.client_id != _partition_id(context):
        raise DeviceRefusal("choose: the request names another client than this node")
    k = choose_cohort(req.candidates, req.models, factory(context), req.round)
    return codec.encode_choice_reply(req.round, req.client_id, k)


def _reply_header(call: str, round_number: int, client_id: int, payload: bytes) -> Any:
    from flwr.app import ConfigRecord

    return ConfigRecord({"schema": codec.SCHEMA, "call": call, "round": int(round_number),
                         "client-id": int(client_id), "payload": payload})


def _step(call: str, method: str) -> Callable[[Message, Context, Any], RecordDict]:
    def handle(msg: Message, context: Context, factory: Any) -> RecordDict:
        from clma.device import DeviceSecAgg

        rnd, cid, items = codec.decode_step_request(call, msg.content)
        if cid != _partition_id(context):
            raise DeviceRefusal(f"{call}: the request names another client than this node")
        state = DeviceState.load(context)
        if not state.secagg or state.secagg.get("round") != rnd:
            raise DeviceRefusal(f"{call}: no secure-aggregation state for this round on the "
                                "device (advertise first)")
        digest = _digest(msg.content)
        prev = _answered(state, call, digest)
        if prev is not None:
            return RecordDict({codec.RECORD: _reply_header(call, rnd, cid, prev)})
        dev = DeviceSecAgg.from_dict(state.secagg)
        unknown = sorted(set(items) - set(dev.sessions))
        if unknown:
            raise DeviceRefusal(f"{call}: names a session the device did not advertise")
        out = getattr(dev, method)(items)
        payload = codec.step_payload(call, out)
        state.secagg = dev.to_dict()
        _remember(state, call, digest, payload)
        state.save(context)
        return RecordDict({codec.RECORD: _reply_header(call, rnd, cid, payload)})

    return handle


def _roster(msg: Message, context: Context, factory: Any) -> RecordDict:
    codec.header_of(msg.content, "roster")
    return codec.encode_roster_reply(_partition_id(context), layout=_layout(context))


def _layout(context: Context) -> tuple[int, str] | None:
    """``(n_params, digest)`` of the model the server names (run config ``model-spec``, or
    the federation config's model), for the roster's check; None when the run config
    names neither (a run that is not a CLMA federation's)."""
    text = context.run_config.get("config-json")
    spec_text = context.run_config.get("model-spec")
    if not (isinstance(spec_text, str) and spec_text) and not (isinstance(text, str) and text):
        return None
    from clma.config import ConfigError, validate_config
    from clma.flower.device_data import device_model_spec
    from clma.models.checks import model_layout

    cfg = None
    if not (isinstance(spec_text, str) and spec_text):
        try:
            cfg = validate_config(json.loads(text))
        except (ValueError, ConfigError) as exc:
            raise DeviceRefusal(f"run config 'config-json': {exc}") from None
    import torch

    torch.set_num_threads(1)
    return model_layout(device_model_spec(context.run_config, cfg).build())


_HANDLERS: dict[str, Callable[[Message, Context, Any], RecordDict]] = {
    "roster": _roster,
    "train": _train,
    "secagg_advertise": _advertise,
    "secagg_share_keys": _step("secagg_share_keys", "share_keys"),
    "secagg_masked_input": _step("secagg_masked_input", "masked_input"),
    "secagg_unmask": _step("secagg_unmask", "unmask"),
    "choose": _choose,
}


def handle(call: str, msg: Message, context: Context,
           factory: Callable[[Context], Any] = default_learner_factory) -> Message:
    """Answer one message of ``call`` (the ClientApp's handlers call this; tests too):
    the reply, or an error reply naming what was wrong."""
    from clma.privacy.secagg import SecAggAbort

    try:
        return Message(content=_HANDLERS[call](msg, context, factory), reply_to=msg)
    except codec.CodecError as exc:
        code, reason = BAD_REQUEST, f"clma: {call}: bad request: {exc}"
    except (DeviceRefusal, SecAggAbort) as exc:
        code, reason = REFUSED, f"clma: {call}: refused: {exc}"
    except Exception as exc:  # the learner or the protocol failed on this device
        first = str(exc).splitlines()[0][:200] if str(exc) else ""
        code, reason = DEVICE_ERROR, f"clma: {call}: device error: {type(exc).__name__}: {first}"
        _log.exception("clma ClientApp: %s failed", call)
    _log.error("%s", reason)
    return Message(Error(code=code, reason=reason), reply_to=msg)


def make_client_app(learner_factory: Callable[[Context], Any] | None = None) -> ClientApp:
    """The CLMA ClientApp (module docstring) over ``learner_factory(context) ->
    LocalLearner`` (default :func:`default_learner_factory`: the node config's
    ``data-source`` under the model the server names)."""
    factory = learner_factory or default_learner_factory
    app = ClientApp()

    def register(call: str) -> None:
        category, _, action = codec.MESSAGE_TYPES[call].partition(".")
        decorator = getattr(app, category)(action) if action else getattr(app, category)()

        @decorator
        def _handler(msg: Message, context: Context) -> Message:
            return handle(call, msg, context, factory)

    for call in codec.CALLS:
        register(call)
    return app
