"""clma.drift.RoundKeyedState: a client's detector state keyed by the round that produced
it, so a round asked again (server crash and re-run) starts from the same state."""

from __future__ import annotations

import json

import pytest

from clma.drift import LossThresholdDetector, RoundKeyedState


def _state(loss: float, n: int = 1) -> dict:
    return {"kind": "LossThresholdDetector", "gamma": 0.5, "previous_loss": loss,
            "n_updates": n, "n_flags": 0}


def test_before_is_the_latest_state_strictly_before_the_round():
    h = RoundKeyedState()
    assert h.before(1) is None and h.rounds == []
    h.record(1, _state(2.0))
    h.record(3, _state(1.5, 2))
    assert h.before(1) is None
    assert h.before(2) == _state(2.0) and h.before(3) == _state(2.0)
    assert h.before(4) == _state(1.5, 2) and h.before(99) == _state(1.5, 2)
    got = h.before(4)
    got["previous_loss"] = -1.0  # a copy: the stored state is not changed through it
    assert h.before(4) == _state(1.5, 2)


def test_recording_a_round_again_replaces_it_and_drops_later_rounds():
    h = RoundKeyedState()
    for r, loss in ((1, 3.0), (2, 2.0), (3, 1.0)):
        h.record(r, _state(loss))
    h.record(2, _state(9.0))  # round 2 asked again: its state is replaced, round 3 forgotten
    assert h.rounds == [1, 2]
    assert h.before(3) == _state(9.0) and h.before(2) == _state(3.0)


def test_only_the_last_keep_states_are_kept():
    h = RoundKeyedState(keep=2)
    for r in range(1, 6):
        h.record(r, _state(float(r)))
    assert h.rounds == [4, 5]
    assert h.before(5) == _state(4.0)
    assert RoundKeyedState().keep == 4


def test_json_round_trip_keeps_every_state():
    h = RoundKeyedState(keep=3)
    for r in (2, 5, 7):
        h.record(r, LossThresholdDetector(0.25).state_dict() | {"previous_loss": r / 10})
    data = json.loads(json.dumps(h.to_dict()))
    assert data["keep"] == 3 and sorted(data["rounds"]) == ["2", "5", "7"]
    back = RoundKeyedState.from_dict(data)
    assert back.rounds == h.rounds and back.keep == 3
    assert back.to_dict() == h.to_dict()
    assert all(back.before(r) == h.before(r) for r in range(10))


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2", None])
def test_rounds_must_be_integers_from_zero(bad):
    h = RoundKeyedState()
    with pytest.raises(ValueError, match="round: must be an integer >= 0"):
        h.record(bad, _state(1.0))
    with pytest.raises(ValueError, match="round: must be an integer >= 0"):
        h.before(bad)
    h.record(0, _state(1.0))  # round 0 is a round (the state before the first)
    assert h.before(1) == _state(1.0)


@pytest.mark.parametrize("keep", [1, 0, True, 2.0])
def test_keep_is_validated(keep):
    with pytest.raises(ValueError, match="keep: must be an integer >= 2"):
        RoundKeyedState(keep)


@pytest.mark.parametrize("data, match", [
    ([], "state: must be"),
    ({"keep": 4}, "state: must be"),
    ({"rounds": {"1": 3.0}}, "each entry must be a detector state_dict"),
    ({"rounds": {"one": {}}}, "keys must be round numbers"),
    ({"rounds": {"-2": {}}}, "state.rounds key: must be an integer >= 0"),
])
def test_malformed_data_is_one_clear_error(data, match):
    with pytest.raises(ValueError, match=match):
        RoundKeyedState.from_dict(data)


def test_slim_applies_to_every_kept_state_but_the_newest_two():
    h = RoundKeyedState(keep=4)

    def slim(state):
        return {**state, "previous_loss": None}

    for r in range(1, 7):
        h.record(r, _state(float(r), r), slim=slim)
    assert h.rounds == [3, 4, 5, 6]
    assert [h.to_dict()["rounds"][str(r)]["previous_loss"] for r in h.rounds] == [
        None, None, 5.0, 6.0]
    h.record(6, _state(9.0, 6), slim=slim)  # round 6 again: 5 and 6 stay whole
    assert h.before(6)["previous_loss"] == 5.0 and h.before(7)["previous_loss"] == 9.0
    h.record(7, _state(7.0, 7))  # without slim nothing else changes
    assert [h.to_dict()["rounds"][str(r)]["previous_loss"] for r in h.rounds] == [
        None, 5.0, 9.0, 7.0]
