"""Which drift detector a device runs: :class:`DetectorSpec`, sent with the round's
training settings (``drift.detector`` and its parameters in the config).

A device builds its detector from the spec every round and restores it from the state it
recorded for its previous round (:class:`clma.drift.RoundKeyedState`): the server's
parameters are the ones in force, the state supplies the observations. A state recorded
by another kind of detector (the server switched ``drift.detector``) is not carried
over: the new detector starts empty.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from clma.drift.cusum import CusumDetector, CusumParams, _params
from clma.drift.detectors import DriftDetector, LossThresholdDetector, check_loss
from clma.drift.input_ks import InputKSDetector, InputKSParams
from clma.drift.paired import PairedLossDetector, PairedLossParams
from clma.drift.river_detectors import (
    ADWINDetector,
    ADWINParams,
    PageHinkleyDetector,
    PageHinkleyParams,
)

__all__ = ["DETECTOR_KINDS", "DetectorSpec"]

#: ``drift.detector`` value -> (detector class, parameter model or None).
DETECTOR_KINDS: dict[str, tuple[type[DriftDetector], Any]] = {
    "loss_threshold": (LossThresholdDetector, None),
    "cusum": (CusumDetector, CusumParams),
    "page_hinkley": (PageHinkleyDetector, PageHinkleyParams),
    "adwin": (ADWINDetector, ADWINParams),
    "input_ks": (InputKSDetector, InputKSParams),
    "paired_loss": (PairedLossDetector, PairedLossParams),
}


@dataclass(frozen=True)
class DetectorSpec:
    """A detector kind and its parameters (validated on construction).

    ``kind``: one of :data:`DETECTOR_KINDS`; ``params``: the parameter model's fields as
    sorted ``(name, value)`` pairs (empty for ``loss_threshold``, whose ``gamma`` travels
    as ``TrainSettings.drift_gamma``, as do ``input_ks``'s and ``paired_loss``'s). Build
    one with :meth:`of`.

    Raises:
        ValueError: unknown kind or a parameter outside its domain (names the field).
    """

    kind: str = "loss_threshold"
    params: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in DETECTOR_KINDS:
            raise ValueError(f"drift.detector: must be one of {', '.join(DETECTOR_KINDS)}")
        model = DETECTOR_KINDS[self.kind][1]
        if model is None:
            if self.params:
                raise ValueError("drift.detector: loss_threshold takes no parameters "
                                 "(its threshold is drift.gamma)")
            return
        checked = _params(model, dict(self.params), f"drift.{self.kind}.")
        object.__setattr__(self, "params", tuple(sorted(checked.model_dump().items())))

    @classmethod
    def of(cls, kind: str, params: Mapping[str, Any] | Any = None) -> DetectorSpec:
        """A spec from a kind and a mapping (or parameter model) of parameters."""
        if params is None:
            items: dict[str, Any] = {}
        elif hasattr(params, "model_dump"):
            items = params.model_dump()
        else:
            items = dict(params)
        if kind not in DETECTOR_KINDS:
            raise ValueError(f"drift.detector: must be one of {', '.join(DETECTOR_KINDS)}")
        if DETECTOR_KINDS[kind][1] is None:
            return cls(kind, ())
        return cls(kind, tuple(sorted(items.items())))

    @property
    def needs_inputs(self) -> bool:
        """Whether this kind of detector reads the device's inputs (``LocalFit.inputs``)."""
        return bool(DETECTOR_KINDS[self.kind][0].needs_inputs)

    @property
    def needs_previous_model(self) -> bool:
        """Whether this kind of detector scores the model received the round before."""
        return bool(DETECTOR_KINDS[self.kind][0].needs_previous_model)

    def build(self, gamma: float) -> DriftDetector:
        """A fresh detector (``gamma``, nats, is used by ``loss_threshold``,
        ``paired_loss`` and ``input_ks``'s loss-threshold rule only)."""
        det_cls = DETECTOR_KINDS[self.kind][0]
        if det_cls is LossThresholdDetector:
            return LossThresholdDetector(gamma)
        if det_cls in (InputKSDetector, PairedLossDetector):
            return det_cls(gamma, **dict(self.params))
        return det_cls(**dict(self.params))

    def restore(self, state: Mapping[str, Any] | None, gamma: float) -> DriftDetector:
        """The detector with this spec's parameters, holding the observations of
        ``state`` when it is a state of the same kind (else a fresh one)."""
        det = self.build(gamma)
        if state is None:
            return det
        own = det.state_dict()
        if state.get("kind") != own["kind"]:
            return det
        if isinstance(det, LossThresholdDetector):
            det.load_state_dict({**state, "gamma": float(check_loss(gamma, "gamma"))})
        elif isinstance(det, (InputKSDetector, PairedLossDetector)):
            det.load_state_dict({**state, "params": own["params"], "gamma": det.gamma})
        else:
            det.load_state_dict({**state, "params": own["params"]})
        return det

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "params": dict(self.params)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DetectorSpec:
        """Inverse of :meth:`to_dict` (validated)."""
        if not isinstance(data, Mapping) or not isinstance(data.get("params", {}), Mapping):
            raise ValueError("drift.detector: must be {'kind': ..., 'params': {...}}")
        return cls.of(str(data.get("kind")), data.get("params") or {})

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> DetectorSpec:
        try:
            data = json.loads(text)
        except (TypeError, ValueError):
            raise ValueError("drift.detector: not a JSON detector spec") from None
        return cls.from_dict(data)
