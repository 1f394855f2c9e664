"""The client side of the Clients seam: what ONE device does at each step of a round.

Every transport's clients run these functions on the device (the simulated clients in
process, a Dask worker, a Flower ClientApp on a SuperNode), so the on-device rules exist
once:

* :func:`train_on_device` — the CLMA client round (Algorithm 2): the received model's
  loss on the current local data before training feeds the on-device drift detector
  that ``settings.detector`` names (:class:`clma.drift.DetectorSpec`: the loss threshold
  when the settings name none, or CUSUM / Page-Hinkley / ADWIN, or the KS test of the
  device's own inputs ``input_ks``, given :attr:`LocalFit.inputs`, or ``paired_loss``, the
  loss threshold confirmed on the model received the round before, the federation's
  default under ``cohort.method = "improved"``; state keyed by round:
  :class:`clma.drift.RoundKeyedState`), then local training; the reply holds the model,
  the sample count and the flag bit — never the loss, never the inputs;
* :func:`quantised_report` — the on-device metric report (:func:`clma.metrics.compute_device_report`),
  clipped to the announced layout and quantised to integers in ``[0, Q]``;
* :class:`DeviceSecAgg` — the device's secure-aggregation state of one round (one
  :class:`clma.privacy.secagg.SecAggClient` per session; its secrets never leave it),
  answering each protocol step, and unmasking at most once per session. In distributed
  DP mode (the session config carries a :class:`clma.privacy.distributed.DistributedNoise`)
  it adds the device's discrete Gaussian share to the report before masking
  (:func:`clma.privacy.distributed.noisy_words`, OpenDP's sampler). It serialises to
  plain data (:meth:`DeviceSecAgg.to_dict`) for transports whose device process does not
  live between steps (a Flower ClientApp).

The local model is the device's own: a :class:`LocalLearner` (the simulation's MLP on its
shard, or a user's torch model and data loader).
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from clma.drift import RoundKeyedState
from clma.engine.clients import ReportRequest, SecAggSession, ShareKeysRequest, TrainSettings
from clma.privacy.distributed import noisy_words
from clma.privacy.secagg import (
    AdvertiseKeys,
    EncryptedShare,
    FixedPointQuantiser,
    MaskedInput,
    SecAggAbort,
    SecAggClient,
    SecAggConfig,
    ShareKeys,
    UnmaskingRequest,
    UnmaskingResponse,
)
from clma.rounds import ClientUpdate

if TYPE_CHECKING:  # the metrics stack is imported by the step that computes the report
    from clma.metrics import DeviceMetricLayout

__all__ = [
    "DeviceSecAgg",
    "LocalFit",
    "LocalLearner",
    "choose_cohort",
    "quantised_report",
    "records_loss",
    "train_on_device",
]


@dataclass(frozen=True)
class LocalFit:
    """Result of local training on the device.

    ``params``: float32 ``(n_params,)`` trained model; ``pre_loss``: the received model's
    mean loss on the current local training data before training (nats; stays on the
    device); ``n_samples``: local training examples (>= 1); ``inputs``: the current local
    training inputs ``(n, ...)`` (float; stays on the device, never in any reply: it feeds
    an input-based drift detector such as ``input_ks``, whose state keeps a subsample of
    it on the device). None: this learner gives no inputs (a detector that needs them
    then fails the round).
    """

    params: np.ndarray
    pre_loss: float
    n_samples: int
    inputs: np.ndarray | None = None


class LocalLearner(Protocol):
    """The device's model and data (implemented by the simulation or by the user)."""

    def fit(self, params: np.ndarray, settings: TrainSettings, round_number: int) -> LocalFit:
        """Train from ``params`` (float32 ``(n_params,)``) on the local data of this round."""
        ...

    def predict(self, params: np.ndarray, round_number: int) -> tuple[np.ndarray, np.ndarray]:
        """``(probabilities (n, n_classes) float, labels (n,) int)`` of the model ``params``
        on the local evaluation data of this round."""
        ...

    # Optional: ``predict_training(params, round_number)``, the same on the current local
    # training data. :func:`choose_cohort` then scores all local records; without it, the
    # evaluation records only (fewer: a weaker choice, docs/realistic_drift.md section 8).


def train_on_device(client_id: int, cohort_id: int, params: np.ndarray, settings: TrainSettings,
                    round_number: int, learner: LocalLearner,
                    history: RoundKeyedState) -> ClientUpdate:
    """One client's training step (module docstring); updates ``history`` for the round.

    The detector starts from the state of the last round before ``round_number``, so a
    round asked again (server retry) gives the same flag; a detector that tests inputs
    gets ``fit.inputs`` and the seed ``(client_id, round_number)`` for its subsample; one
    that scores the previous model (``paired_loss``) gets the received model and
    :func:`records_loss` of it and of the model it kept from its previous update.

    Raises:
        ValueError: the detector needs inputs and the learner gave none (names
            ``drift.detector``; ``history`` is unchanged). A transport turns it into a
            dropout of this client.
    """
    received = np.asarray(params, dtype=np.float32)
    fit = learner.fit(received, settings, round_number)
    det = settings.detector.restore(history.before(round_number), settings.drift_gamma)
    if det.needs_previous_model:
        previous = det.previous_model  # type: ignore[attr-defined]
        flag = bool(det.update(  # type: ignore[call-arg]
            fit.pre_loss, model=received,
            reference=records_loss(learner, received, round_number),
            same_model=(None if previous is None
                        else records_loss(learner, previous, round_number))))
    elif det.needs_inputs:
        if fit.inputs is None:
            raise ValueError(f"drift.detector: {settings.detector.kind} needs the device's "
                             "current inputs (LocalFit.inputs) and this learner gives none")
        flag = bool(det.update(fit.pre_loss, fit.inputs,  # type: ignore[call-arg]
                               seed=(int(client_id), int(round_number))))
    else:
        flag = bool(det.update(fit.pre_loss))
    # a detector that keeps a model copy slims the states older than the newest two
    history.record(round_number, det.state_dict(), slim=getattr(det, "slim_state", None))
    return ClientUpdate(int(client_id), int(cohort_id), np.asarray(fit.params, dtype=np.float32),
                        int(fit.n_samples), flag)


def records_loss(learner: LocalLearner, params: np.ndarray, round_number: int) -> float:
    """Mean cross-entropy (nats) of the model ``params`` (float32 ``(n_params,)``) on the
    device's current training records (``learner.predict_training``) or, for a learner
    without it, its evaluation records (``learner.predict``). Stays on the device.

    Raises:
        ValueError: no records, or probabilities whose shape does not match the labels.
    """
    from clma.drift import mean_cross_entropy

    score = getattr(learner, "predict_training", None)
    if not callable(score):
        score = learner.predict
    proba, labels = score(np.asarray(params, dtype=np.float32), round_number)
    return mean_cross_entropy(proba, labels, f"learner.{score.__name__}")


def choose_cohort(candidates: Sequence[int], models: Mapping[int, np.ndarray],
                  learner: LocalLearner, round_number: int) -> int:
    """The cohort, among ``candidates``, whose model fits this device's data best: the
    lowest mean cross-entropy (nats) over all its local records of the round -- the
    training records (``learner.predict_training``, when the learner has it) and the
    evaluation records (``learner.predict``). IFCA's cluster-identity estimate (Ghosh et
    al., "An Efficient Framework for Clustered Federated Learning", NeurIPS 2020), applied
    once, after a split. Ties keep the first candidate (the cohort the split chose). Only
    the returned id leaves the device; the losses do not.

    Args:
        candidates: cohort ids, the split's choice first.
        models: cohort id -> float32 model vector ``(n_params,)`` (every candidate).
        learner: the device's model and data.
        round_number: the round (the data of that round are scored).

    Raises:
        ValueError: no candidates, no local records, or probabilities whose shape does not
            match the labels (a transport turns it into a failed reply: the client keeps
            the split's cohort).
    """
    if not candidates:
        raise ValueError("candidates: at least one cohort to choose among")
    scorers = [learner.predict]
    if callable(getattr(learner, "predict_training", None)):
        scorers.insert(0, learner.predict_training)  # type: ignore[attr-defined]
    best, best_loss = int(candidates[0]), math.inf
    for k in candidates:
        params = np.asarray(models[k], dtype=np.float32)
        total, n = 0.0, 0
        for score in scorers:
            proba, labels = score(params, round_number)
            proba, labels = np.asarray(proba, dtype=np.float64), np.asarray(labels)
            if labels.ndim != 1 or proba.ndim != 2 or proba.shape[0] != labels.size:
                raise ValueError(f"learner.{score.__name__}: probabilities must be "
                                 "(n, n_classes) for n labels")
            p = proba[np.arange(labels.size), labels.astype(np.int64)]
            total += float(-np.log(np.clip(p, 1e-12, None)).sum())
            n += labels.size
        if n == 0:
            raise ValueError("learner: no local records to choose a cohort with")
        loss = total / n
        if loss < best_loss:
            best, best_loss = int(k), loss
    return best


def quantised_report(probabilities: Any, labels: Any, layout: DeviceMetricLayout,
                     levels: int) -> np.ndarray:
    """The device's metric report, clipped to ``layout`` and quantised: uint64 ``(32,)``
    in ``[0, levels]`` (:class:`clma.privacy.secagg.FixedPointQuantiser`)."""
    from clma.metrics import compute_device_report

    report = compute_device_report(probabilities, labels, layout)
    quant = FixedPointQuantiser(layout.lower_bounds(), layout.upper_bounds(), levels)
    return quant.quantise(report.vector)


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode("ascii")


def _unb64(s: str) -> bytes:
    return base64.b64decode(s.encode("ascii"))


class DeviceSecAgg:
    """One device's secure-aggregation state for one round (module docstring).

    Args:
        client_id: the device's client id (its id inside every session).
        round_number: the round; a request for another round is refused.
    """

    def __init__(self, client_id: int, round_number: int) -> None:
        self.client_id = int(client_id)
        self.round = int(round_number)
        self.sessions: dict[str, SecAggClient] = {}
        self.inputs: dict[str, np.ndarray] = {}
        self.unmasked: set[str] = set()

    def _check_round(self, round_number: int) -> None:
        if int(round_number) != self.round:
            raise SecAggAbort("request for another round than the one in progress")

    def advertise(self, quantised: np.ndarray, sessions: Mapping[str, SecAggSession]
                  ) -> dict[str, AdvertiseKeys]:
        """Start every listed session with this report; its public keys per session."""
        out = {}
        for sid, sess in sorted(sessions.items()):
            if self.client_id not in sess.members:
                continue
            c = SecAggClient(self.client_id, sess.config)
            self.sessions[sid] = c
            q = np.asarray(quantised, dtype=np.uint64)
            noise = sess.config.noise
            # distributed DP: the noise share is drawn here, on the device, once per
            # session, and only the noisy ring words are kept (and masked)
            self.inputs[sid] = (q if noise is None
                                else noisy_words(q, noise, sess.config.modulus_bits))
            out[sid] = c.advertise()
        return out

    def share_keys(self, requests: Mapping[str, ShareKeysRequest]) -> dict[str, ShareKeys]:
        return {sid: self.sessions[sid].share_keys(r.roster, r.neighbours)
                for sid, r in sorted(requests.items()) if sid in self.sessions}

    def masked_input(self, inboxes: Mapping[str, Sequence[EncryptedShare]]) -> dict[str, MaskedInput]:
        out = {}
        for sid, box in sorted(inboxes.items()):
            if sid not in self.sessions:
                continue
            c = self.sessions[sid]
            c.receive_shares(list(box))
            out[sid] = c.masked_input(self.inputs[sid])
        return out

    def unmask(self, requests: Mapping[str, UnmaskingRequest]) -> dict[str, UnmaskingResponse]:
        """Answer each session's unmasking request once; the session's secrets are then
        dropped (a second request for it is refused)."""
        out = {}
        for sid, req in sorted(requests.items()):
            if sid in self.unmasked:
                raise SecAggAbort("unmasking already answered for this session")
            if sid not in self.sessions:
                continue
            out[sid] = self.sessions[sid].unmask(req)
            self.unmasked.add(sid)
            del self.sessions[sid]
            self.inputs.pop(sid, None)
        return out

    # ------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data holding the device's secrets (store it on the device only)."""
        sess = {}
        for sid, c in self.sessions.items():
            held = c._held
            sess[sid] = {
                "config": c.config.model_dump(mode="json"),
                "c_sk": _b64(c._c_sk.private_bytes_raw()),
                "s_sk": _b64(c._s_sk.private_bytes_raw()),
                "b": _b64(c._b),
                "neighbours": list(c._neighbours),
                "roster": {str(v): [_b64(k.c_pk), _b64(k.s_pk)] for v, k in c._roster.items()},
                "held": {str(o): [int(h[0]), *(_b64(x) for x in h[1:])] for o, h in held.items()},
                "sent_input": bool(c._sent_input),
                "input": [int(x) for x in self.inputs[sid]],
            }
        return {"client_id": self.client_id, "round": self.round, "sessions": sess,
                "unmasked": sorted(self.unmasked)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DeviceSecAgg:
        """Inverse of :meth:`to_dict`."""
        from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

        out = cls(int(data["client_id"]), int(data["round"]))
        for sid, d in data["sessions"].items():
            c = SecAggClient(out.client_id, SecAggConfig.model_validate(d["config"]))
            c._c_sk = X25519PrivateKey.from_private_bytes(_unb64(d["c_sk"]))
            c._s_sk = X25519PrivateKey.from_private_bytes(_unb64(d["s_sk"]))
            c._b = _unb64(d["b"])
            c._neighbours = tuple(int(v) for v in d["neighbours"])
            c._roster = {int(v): AdvertiseKeys(int(v), _unb64(a), _unb64(b))
                         for v, (a, b) in d["roster"].items()}
            c._held = {int(o): (int(h[0]), *(_unb64(x) for x in h[1:]))
                       for o, h in d["held"].items()}
            c._sent_input = bool(d["sent_input"])
            out.sessions[sid] = c
            out.inputs[sid] = np.asarray(d["input"], dtype=np.uint64)
        out.unmasked = set(data.get("unmasked", []))
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> DeviceSecAgg:
        return cls.from_dict(json.loads(text))


def report_request_for(request: ReportRequest, client_id: int) -> dict[str, SecAggSession]:
    """The sessions of ``request`` that list ``client_id``."""
    return request.sessions_of(client_id)
