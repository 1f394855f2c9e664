"""A client's detector state keyed by the round that produced it (device side).

A server that crashes mid-round re-runs the round from its last committed state and
asks the same clients to train the same round again. If a client simply fed its drift
detector a second time, its "previous loss" would be the re-run round's own loss and the
flag could change. :class:`RoundKeyedState` keeps the detector's state per round: for
round ``r`` the client starts from the state recorded for the latest round ``< r`` and
records its new state under ``r`` (replacing a state of a previous attempt at ``r`` and
dropping any state recorded for a later round), so asking a round again gives the same
flag as the first time. Only the last ``keep`` states are kept, and a detector may slim
all but the newest two (:meth:`RoundKeyedState.record`).

State is JSON data: ``{"keep": k, "rounds": {"<round>": <detector state_dict>}}``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["RoundKeyedState"]


def _round(r: object, field: str = "round") -> int:
    if isinstance(r, bool) or not isinstance(r, int) or r < 0:
        raise ValueError(f"{field}: must be an integer >= 0")
    return r


class RoundKeyedState:
    """Detector states of one client, keyed by round (see module docstring).

    Args:
        keep: states kept (>= 2: the state before the current round and the current one).

    Raises:
        ValueError: ``keep`` < 2.
    """

    def __init__(self, keep: int = 4) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 2:
            raise ValueError("keep: must be an integer >= 2")
        self.keep = keep
        self._rounds: dict[int, dict[str, Any]] = {}

    def before(self, round_number: int) -> dict[str, Any] | None:
        """The state recorded for the latest round strictly before ``round_number``
        (None: the client's first round)."""
        r = _round(round_number)
        earlier = [k for k in self._rounds if k < r]
        return None if not earlier else dict(self._rounds[max(earlier)])

    def record(self, round_number: int, state: Mapping[str, Any], *,
               slim: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> None:
        """Record ``state`` as the state after ``round_number`` (later rounds dropped).

        ``slim``: applied to every kept state but the newest two (the only ones a round
        asked again reads: the state before it and its own), e.g. to drop a detector's
        copy of a model; a state read after a deeper rollback is then the slimmed one.
        """
        r = _round(round_number)
        for k in [k for k in self._rounds if k >= r]:
            del self._rounds[k]
        self._rounds[r] = dict(state)
        rounds = sorted(self._rounds)
        for k in rounds[: max(0, len(rounds) - self.keep)]:
            del self._rounds[k]
        if slim is not None:
            for k in sorted(self._rounds)[:-2]:
                self._rounds[k] = dict(slim(dict(self._rounds[k])))

    @property
    def rounds(self) -> list[int]:
        return sorted(self._rounds)

    def to_dict(self) -> dict[str, Any]:
        return {"keep": self.keep, "rounds": {str(k): v for k, v in sorted(self._rounds.items())}}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RoundKeyedState:
        """Inverse of :meth:`to_dict`. Raises ValueError for malformed data."""
        if not isinstance(data, Mapping) or not isinstance(data.get("rounds"), Mapping):
            raise ValueError("state: must be {'keep': k, 'rounds': {round: state}}")
        out = cls(int(data.get("keep", 4)))
        for k, v in data["rounds"].items():
            if not isinstance(v, Mapping):
                raise ValueError("state.rounds: each entry must be a detector state_dict")
            try:
                r = int(k)
            except ValueError:
                raise ValueError("state.rounds: keys must be round numbers") from None
            out._rounds[_round(r, "state.rounds key")] = dict(v)
        return out
