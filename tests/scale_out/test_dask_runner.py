"""The ``dask`` transport (clma.sim.dask.DaskClients): the simulated devices hosted as
Dask actors on a real local cluster (scheduler and two worker processes) give the same
federation as the in-process simulated clients, same seed; devices are placed round
robin, replies of the workers are merged, and a client unknown to the cluster is a
failure."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from clma.config import ConfigError, load_config

TINY = Path(__file__).with_name("tiny_dask.toml")

pytestmark = pytest.mark.slow


def _without_timing(summary: dict) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "seconds"} for r in summary["rounds"]]


@pytest.fixture(scope="module")
def both_runs(prefect_harness):
    from flows.federation import federation_flow

    cfg = load_config(TINY)
    default = federation_flow(cfg)
    on_dask = federation_flow(cfg.model_copy(update={
        "orchestration": cfg.orchestration.model_copy(update={"dask_local_workers": 2})}))
    return cfg, default, on_dask


def test_dask_transport_gives_the_same_cohorts_as_in_process_clients(both_runs):
    _, default, on_dask = both_runs
    assert (default["federation"]["transport"], default["federation"]["executor"]) == (
        "simulation", "in-process")
    assert (on_dask["federation"]["transport"], on_dask["federation"]["executor"]) == (
        "dask", "local-dask-2")
    per_round = [r["cohorts"] for r in default["rounds"]]
    # the drift at round 3 split the root cohort: the test is about a real cohorting
    assert per_round[0] == {"0": "minimum_to_under_double"}  # 6 clients, floor 5
    assert per_round[1] == {"0": "minimum_to_under_double"}
    assert len(per_round[2]) >= 3
    assert [r["cohorts"] for r in on_dask["rounds"]] == per_round
    assert on_dask["final_cohorts"] == default["final_cohorts"]
    assert [r["new_cohorts"] for r in on_dask["rounds"]] == [
        r["new_cohorts"] for r in default["rounds"]]
    # bit-identical training and the same device reports: the seeded regional releases
    # (secure sums of every client's report on its cohort model) are equal too
    assert _without_timing(on_dask) == _without_timing(default)
    assert default["sim_truth"] == on_dask["sim_truth"]


# ----------------------------------------------------------------- DaskClients itself


@pytest.fixture(scope="module")
def cluster():
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=":0") as c:
        yield c


@pytest.fixture(scope="module")
def world():
    from clma.sim.clients import SimulatedClients
    from clma.sim.federation import build_federation

    cfg = load_config(TINY)
    sim = build_federation(cfg)
    return cfg, sim, SimulatedClients(sim)


@pytest.fixture
def dask_clients(cluster, world, tmp_path):
    import distributed

    from clma.sim.dask import DaskClients

    cfg, _, local = world
    dc = DaskClients(distributed.Client(cluster.scheduler_address), cfg,
                     str(tmp_path / "devices"), local.roster())
    yield dc
    dc.close()


def _request(sim, ids, round_number=1):
    from clma.engine import TrainRequest, TrainSettings

    t = sim.config.training
    settings = TrainSettings(local_epochs=t.local_epochs, learning_rate=t.learning_rate,
                             batch_size=t.batch_size, drift_gamma=sim.config.drift.gamma)
    return TrainRequest(round_number, dict.fromkeys(ids, 0), {0: sim.initial_model}, settings)


def test_devices_are_placed_round_robin_and_replies_merged(dask_clients, world, tmp_path):
    _, sim, local = world
    workers = sorted(dask_clients._hosts)
    assert len(workers) == 2
    ids = sim.client_ids
    for i, w in enumerate(workers):  # ascending ids dealt to the sorted workers in turn
        hosted = dask_clients._hosts[w].call("roster").result().client_ids
        assert hosted == ids[i::2]
        assert all(dask_clients._owner[c] == w for c in hosted)
    assert dask_clients.roster() == local.roster()
    got = dask_clients.train(_request(sim, ids))
    want = local.train(_request(sim, ids))
    assert got.failed == {} and sorted(got.ok) == ids  # both workers' replies, merged
    for c in ids:  # bit-identical training on the workers (one torch thread each)
        assert got.ok[c].params.tobytes() == want.ok[c].params.tobytes()
        assert (got.ok[c].n_samples, got.ok[c].drift_flag) == (want.ok[c].n_samples,
                                                               want.ok[c].drift_flag)
    # each worker's devices wrote their own state into the devices' folder
    assert sorted(p.name for p in (tmp_path / "devices").iterdir()) == [
        f"client_{c:06d}.json" for c in ids]


def test_a_client_unknown_to_the_cluster_is_a_failure(dask_clients, world):
    _, sim, _ = world
    out = dask_clients.train(_request(sim, [0, 3, 99]))
    assert sorted(out.ok) == [0, 3]
    assert out.failed == {99: "not a client of this transport"}


def test_choices_over_dask_equal_the_in_process_ones(dask_clients, world):
    from clma.engine import ChoiceRequest

    _, sim, local = world
    ids = sim.client_ids
    rng = np.random.default_rng(0)
    models = {k: (sim.initial_model + rng.normal(0, 0.5, sim.initial_model.shape)
                  ).astype(np.float32) for k in (1, 2, 3)}
    req = ChoiceRequest(1, {c: (1 + c % 3, 1 + (c + 1) % 3, 1 + (c + 2) % 3) for c in ids}
                        | {99: (1, 2)}, models)
    got, want = dask_clients.choose(req), local.choose(req)
    assert got.failed == want.failed == {99: "not a client of this transport"}
    assert got.ok == want.ok and sorted(got.ok) == ids
    assert any(got.ok[c] != req.candidates[c][0] for c in ids)  # a real choice (seed 0)


def test_secure_sums_over_dask_equal_the_in_process_ones(dask_clients, world):
    from clma.engine import FederationEngine

    cfg, sim, local = world
    sums = {}
    for name, clients in (("dask", dask_clients), ("local", local)):
        engine = FederationEngine(cfg, sim.assets(), clients)
        ids = engine.roster.client_ids
        sums[name] = engine.evaluator.secure_sums(
            clients, 1, ids, engine.region_of, engine.state.assignments(ids),
            engine.state.cohort_models)
    g, h = sums["dask"].groups["global"], sums["local"].groups["global"]
    assert g.status == h.status == "ok" and g.contributors == h.contributors == 6
    np.testing.assert_array_equal(g.sum_quantised, h.sum_quantised)


def test_both_dask_targets_at_once_is_a_config_error():
    from clma.config import FederationConfig

    base = load_config(TINY).model_dump()
    base["orchestration"].update(dask_address="tcp://10.0.0.5:8786", dask_local_workers=2)
    with pytest.raises((ConfigError, ValueError), match="at most one of dask_address"):
        FederationConfig.model_validate(base)


def test_dask_transport_needs_a_target():
    from clma.config import FederationConfig

    base = load_config(TINY).model_dump()
    base["federation"] = {"transport": "dask"}
    with pytest.raises((ConfigError, ValueError), match="needs orchestration.dask_address"):
        FederationConfig.model_validate(base)
    base["orchestration"]["dask_local_workers"] = 2
    cfg = FederationConfig.model_validate(base)
    assert cfg.transport == "dask"
    del base["federation"]
    assert FederationConfig.model_validate(base).transport == "dask"  # implied by the target
