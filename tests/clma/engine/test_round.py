"""clma.engine.round: the bare engine loop. Its result does not depend on how the training
call is chunked; selection is seeded; the first quarantine fixes the merge reference; a
round's steps can be driven one by one (what the Prefect flow and a Flower strategy do)
with the same outcome as ``run_round``. The flow's parity with the bare loop is
tests/flows/test_engine_parity.py (slow)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from clma.engine.state import snapshot_files

DRIFT = {"events": [
    {"round": 2, "kind": "label_rotation", "shift": 1, "family": "plus", "clients": [0, 2, 4]},
    {"round": 2, "kind": "label_rotation", "shift": -1, "family": "minus", "clients": [1, 3, 5]},
]}


FLAGS = {2: range(6)}  # the drifted clients raise their flag at round 2


@pytest.fixture
def drift_config(tiny_config):
    """12 clients, a drift at round 2 (two opposite families, flagged by their devices),
    seeded noise, simulated dropouts, every evaluation released."""
    return tiny_config(clients=12, rounds=2, drift=DRIFT, training={"local_epochs": 1},
                       model={"hidden": [32]}, evaluation={"min_cohort": 2, "dropout_rate": 0.1})


def _run(engine, rounds, **kw):
    return [engine.run_round(r, **kw) for r in rounds]


def _comparable(res):
    return {"round": res.round, "cohorts": res.cohorts, "flagged": res.flagged,
            "quarantined": res.quarantined, "new_cohorts": res.new_cohorts,
            "merges": res.merges, "regional": json.dumps(res.regional, sort_keys=True),
            "divergence": res.divergence, "participants": res.participants,
            "dropouts": res.dropouts,
            "envelopes": None if res.evaluation is None else res.evaluation.envelopes}


def test_result_does_not_depend_on_the_chunk_size(drift_config, make_engine):
    one, eight = make_engine(drift_config, flags=FLAGS), make_engine(drift_config, flags=FLAGS)
    a = _run(one, (1, 2), chunk_size=1)
    b = _run(eight, (1, 2), chunk_size=8)
    assert [_comparable(x) for x in a] == [_comparable(x) for x in b]
    assert a[1].quarantined == 6 and len(a[1].new_cohorts) == 2  # a real cohorting round
    assert a[0].evaluation is not None and a[0].regional["metrics"]["accuracy"]["global"]
    fa, fb = snapshot_files(one.state), snapshot_files(eight.state)
    assert fa["registry.json"] == fb["registry.json"]
    assert fa["evaluation.json"] == fb["evaluation.json"]
    assert sorted(one.state.cohort_models) == sorted(eight.state.cohort_models)
    for c, v in one.state.cohort_models.items():
        assert v.tobytes() == eight.state.cohort_models[c].tobytes()
    assert one.state.merge_reference.tobytes() == eight.state.merge_reference.tobytes()


def test_steps_one_by_one_equal_run_round(drift_config, make_engine):
    """The flow's recipe (begin, train per chunk, accept, after_training, secure sums,
    evaluate, finish) is run_round."""
    bare, steps = make_engine(drift_config, flags=FLAGS), make_engine(drift_config, flags=FLAGS)
    want = _run(bare, (1,))[0]
    ctx = steps.begin_round(1)
    chunks = [ctx.selected[i:i + 5] for i in range(0, len(ctx.selected), 5)]
    steps.accept(ctx, [steps.train(ctx, c) for c in reversed(chunks)])  # any order
    steps.after_training(ctx)
    assert steps.evaluation_due(1)
    steps.evaluate(ctx, steps.secure_sums(ctx))
    got = steps.finish(ctx)
    assert _comparable(got) == _comparable(want)
    assert steps.state.rounds_done == bare.state.rounds_done == 1
    assert steps.state.cohort_models[0].tobytes() == bare.state.cohort_models[0].tobytes()


def test_selection_is_seeded_and_sized_by_participation(tiny_config, make_engine):
    engine = make_engine(tiny_config(training={"participation": 0.35}))
    picks = [engine.select(r) for r in (1, 2, 3)]
    assert all(len(p) == 7 for p in picks)  # ceil(0.35 * 20)
    assert all(len(set(p)) == 7 and set(p) <= set(range(20)) for p in picks)
    assert picks[0] != picks[1]
    again = make_engine(tiny_config(training={"participation": 0.35}))
    assert [again.select(r) for r in (1, 2, 3)] == picks
    ctx = engine.begin_round(2)
    assert ctx.selected == picks[1] and ctx.assignments == dict.fromkeys(picks[1], 0)
    assert ctx.start_models[0] is not engine.state.cohort_models[0]  # a copy
    with pytest.raises(ValueError, match="round_number"):
        engine.begin_round(0)


def test_first_quarantine_fixes_the_merge_reference(drift_config, make_engine):
    cfg = drift_config.model_copy(update={
        "divergence": drift_config.divergence.model_copy(update={"enabled": False}),
        "evaluation": drift_config.evaluation.model_copy(update={"every": 5})})
    engine = make_engine(cfg, flags=FLAGS)
    first = engine.run_round(1)
    assert first.quarantined == 0 and engine.state.merge_reference is None
    model_after_1 = engine.state.cohort_models[0].copy()
    engine.run_round(2)
    # the start model of the first quarantined client's cohort: round 2's start model
    assert engine.state.merge_reference.tobytes() == model_after_1.tobytes()


def test_plain_fedavg_quarantines_nobody(tiny_config, make_engine):
    cfg = tiny_config(clients=12, rounds=2, drift=DRIFT, training={"local_epochs": 1},
                      model={"hidden": [32]}, cohort={"enabled": False},
                      divergence={"enabled": False}, evaluation={"every": 5})
    engine = make_engine(cfg, flags=FLAGS)
    res = _run(engine, (1, 2))
    assert res[1].flagged == 6  # the devices still flag
    assert [r.quarantined for r in res] == [0, 0] and res[1].cohorts == {0: 12}
    assert [r.evaluation for r in res] == [None, None]  # evaluation every 5 rounds
    assert engine.state.merge_reference is None
    np.testing.assert_array_equal(sorted(engine.state.cohort_models), [0])


def test_server_learning_rate_steps_the_aggregate_of_each_existing_cohort(tiny_config,
                                                                          make_engine):
    """training.server_learning_rate = eta: the round's model of cohort 0 is start + eta *
    (FedAvg - start), from the same updates as eta = 1 (literal formula, float64)."""
    cfg1 = tiny_config(clients=12, rounds=1, training={"local_epochs": 1,
                                                       "server_learning_rate": 1.0},
                       model={"hidden": [32]})
    cfg2 = tiny_config(clients=12, rounds=1, training={"local_epochs": 1,
                                                       "server_learning_rate": 1.5,
                                                       "server_learning_rate_scope": "all"},
                       model={"hidden": [32]})
    plain, stepped = make_engine(cfg1), make_engine(cfg2)
    start = plain.state.cohort_models[0].astype(np.float64)
    assert np.array_equal(start, stepped.state.cohort_models[0].astype(np.float64))
    plain.run_round(1)
    stepped.run_round(1)
    avg = plain.state.cohort_models[0].astype(np.float64)
    want = (start + 1.5 * (avg - start)).astype(np.float32)
    assert not np.array_equal(avg, start)
    np.testing.assert_array_equal(stepped.state.cohort_models[0], want)


def test_server_momentum_carries_each_cohorts_velocity_across_rounds(tiny_config,
                                                                    make_engine):
    """training.server_momentum = beta: the round-2 model of cohort 0 is start + eta * (beta
    * c * v1 + FedAvg - start) with v1 = (round-1 model - its start) / eta and c = min(1,
    ||FedAvg - start|| / ||v1||) (clma.rounds.server_step), the FedAvg taken
    from an engine without the step on the same state; the velocity survives the state
    files, and a re-run of round 2 from them gives the same models and velocity bitwise."""
    from clma.engine.state import restore_files

    def cfg(eta, beta):
        return tiny_config(clients=12, rounds=2, model={"hidden": [32]}, training={
            "local_epochs": 1, "server_learning_rate": eta, "server_momentum": beta,
            "server_learning_rate_scope": "all"})

    engine = make_engine(cfg(1.5, 0.3))
    s1 = engine.state.cohort_models[0].astype(np.float64)
    assert engine.state.server_velocity == {}
    engine.run_round(1)
    m1 = engine.state.cohort_models[0]
    v1 = engine.state.server_velocity[0]
    np.testing.assert_array_equal(v1, ((m1.astype(np.float64) - s1) / 1.5).astype(np.float32))
    files = snapshot_files(engine.state)
    assert "velocity.npz" in files
    plain = make_engine(cfg(1.0, 0.0), state=restore_files(files, 1))
    plain.run_round(2)
    avg = plain.state.cohort_models[0].astype(np.float64)
    assert plain.state.server_velocity == {}  # no momentum: nothing kept
    engine.run_round(2)
    s2, prev = m1.astype(np.float64), v1.astype(np.float64)
    c = min(1.0, float(np.linalg.norm(avg - s2)) / float(np.linalg.norm(prev)))
    want = (s2 + 1.5 * (0.3 * c * prev + (avg - s2))).astype(np.float32)
    np.testing.assert_array_equal(engine.state.cohort_models[0], want)
    assert not np.array_equal(want, (s2 + 1.5 * (avg - s2)).astype(np.float32))
    again = make_engine(cfg(1.5, 0.3), state=restore_files(files, 1))
    again.run_round(2)
    assert snapshot_files(again.state) == snapshot_files(engine.state)
    # a velocity for a cohort the registry does not hold is refused
    bad = dict(files, **{"velocity.npz": _npz(cohort_9=np.zeros_like(m1))})
    with pytest.raises(ValueError, match="velocity.npz: cohort 9"):
        restore_files(bad, 1)


def test_a_cohort_nobody_updated_keeps_its_model_under_momentum(drift_config, make_engine):
    """Every member of the root cohort quarantined at round 2: the root has no usable
    update, so the momentum step does not move it (its start model comes out unchanged)."""
    cfg = drift_config.model_copy(update={"training": drift_config.training.model_copy(
        update={"server_learning_rate_scope": "all", "server_momentum": 0.5})})
    engine = make_engine(cfg, flags={2: range(12)})
    engine.run_round(1)
    assert 0 in engine.state.server_velocity
    ctx = engine.begin_round(2)
    engine.accept(ctx, [engine.train(ctx)])
    engine.detect_drift(ctx)
    engine.score_divergence(ctx)
    assert sorted(ctx.quarantined) == list(range(12))
    engine.aggregate(ctx)
    assert ctx.stepped == []
    assert ctx.models[0].tobytes() == ctx.start_models[0].tobytes()


def _npz(**arrays) -> bytes:
    import io

    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def test_server_step_scope_drift_cohorts_steps_only_cohorts_with_a_parent(drift_config,
                                                                         make_engine):
    """server_learning_rate_scope = "drift_cohorts": round 2 forms two child cohorts (born
    unstepped, so the states after round 2 are equal); at round 3 each child's model is
    start + eta * (FedAvg - start) and the root cohort's is FedAvg, byte for byte."""
    def cfg(**training):
        return drift_config.model_copy(update={"rounds": 3, "training": drift_config
                                               .training.model_copy(update=training)})
    plain = make_engine(cfg(server_learning_rate=1.0), flags=FLAGS)
    scoped = make_engine(cfg(server_learning_rate=1.5,
                             server_learning_rate_scope="drift_cohorts"), flags=FLAGS)
    for engine in (plain, scoped):
        assert engine.run_round(1).quarantined == 0
        assert len(engine.run_round(2).new_cohorts) == 2
    children = [c for c in scoped.state.cohort_models if c != 0]
    assert len(children) == 2 and all(scoped.state.registry.cohort(c).parents == [0]
                                      for c in children)
    start = {c: m.astype(np.float64) for c, m in scoped.state.cohort_models.items()}
    for c, m in plain.state.cohort_models.items():
        assert m.tobytes() == scoped.state.cohort_models[c].tobytes()
    plain.run_round(3)
    scoped.run_round(3)
    assert scoped.state.cohort_models[0].tobytes() == plain.state.cohort_models[0].tobytes()
    for c in children:
        avg = plain.state.cohort_models[c].astype(np.float64)
        assert not np.array_equal(avg, start[c])
        want = (start[c] + 1.5 * (avg - start[c])).astype(np.float32)
        np.testing.assert_array_equal(scoped.state.cohort_models[c], want)
