"""The example Flower app (examples/flower_digits) in Flower's simulation engine (Ray)
against the Prefect round flow on the same config and seed: same cohorts, same members,
bit-identical cohort models."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

from clma.config import load_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "flower_digits"
TINY = ROOT / "tests" / "scale_out" / "tiny_dask.toml"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def example_modules():
    sys.path.insert(0, str(EXAMPLE))
    old = os.environ.get("PYTHONPATH")
    # Ray's worker processes import client_app/task from here
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(EXAMPLE), old) if p)
    import client_app
    import server_app

    yield server_app, client_app
    sys.path.remove(str(EXAMPLE))
    if old is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = old


@pytest.fixture(scope="module")
def flower_run(example_modules):
    import ray
    from flwr.simulation import run_simulation

    server_app, client_app = example_modules
    cfg = load_config(TINY)
    try:
        run_simulation(
            server_app=server_app.make_server_app(str(TINY)),
            client_app=client_app.make_client_app(str(TINY)),
            num_supernodes=cfg.clients,
            backend_config={"client_resources": {"num_cpus": 1},
                            "init_args": {"num_cpus": 2, "include_dashboard": False}},
        )
    finally:
        if ray.is_initialized():
            ray.shutdown()
    return dict(server_app.LAST_RUN)


@pytest.fixture(scope="module")
def prefect_run(prefect_harness):
    import torch

    from clma.sim.federation import build_federation
    from flows.federation import round_flow

    torch.set_num_threads(1)  # as federation_flow does
    cfg = load_config(TINY)
    fed = build_federation(cfg)
    for r in range(1, cfg.rounds + 1):
        round_flow(fed, r)
    return fed


def test_flower_cohorts_match_the_prefect_flow_exactly(flower_run, prefect_run):
    import ray

    assert not ray.is_initialized()  # the simulation's Ray was shut down
    history = flower_run["cohort_history"]
    assert history == prefect_run.registry.history
    # the drift at round 3 split the two label-rotation families from the stationary pair
    assert history[2] == {0: [0, 1, 2, 3, 4, 5]}
    assert {tuple(m) for m in history[3].values()} == {(4, 5), (0, 2), (1, 3)}
    strategy = flower_run["strategy"]
    assert [e.model_dump() for e in strategy.registry.lineage] == [
        e.model_dump() for e in prefect_run.registry.lineage]
    assert sorted(strategy.cohort_models) == sorted(prefect_run.cohort_models)
    for c, v in prefect_run.cohort_models.items():
        np.testing.assert_array_equal(strategy.cohort_models[c], v)


def test_flower_result_carries_cohort_metrics_and_the_largest_cohort_model(flower_run):
    result, strategy = flower_run["result"], flower_run["strategy"]
    last = result.train_metrics_clientapp[3]
    assert last["n-cohorts"] == 3 and last["quarantined"] == 4
    # drift-flag averaged with num-examples weights: 4 of 6 clients flagged, equal-ish shards
    assert 0.5 < last["drift-flag"] < 0.8
    assert result.train_metrics_clientapp[1]["drift-flag"] == 0.0
    largest = strategy.layout.to_vector(result.arrays)
    sizes = {c: len(strategy.registry.members(c)) for c in strategy.cohort_models}
    best = min(sizes, key=lambda c: (-sizes[c], c))
    np.testing.assert_array_equal(largest, strategy.cohort_models[best])
    acc = result.evaluate_metrics_clientapp[3]["accuracy"]
    assert 0.0 <= acc <= 1.0


def test_private_evaluation_releases_the_secure_sum_noised_once(flower_run, prefect_run):
    """The released accuracy/loss are aggregate_sum(exact secure sum of the clients'
    clipped, quantised metrics) with the recorded seed: the secure aggregation carried in
    Flower messages recovered the exact sum, and noise was added once, on the sum."""
    from clma.privacy.secagg import FixedPointQuantiser
    from clma.release import FederatedMetricEnvelope, MetricSpec, aggregate_sum
    from clma.sim.federation import evaluate_clients

    strategy, result = flower_run["strategy"], flower_run["result"]
    cfg = load_config(TINY)
    fed = prefect_run  # drifted to round 3, its cohort models == the Flower ones
    evs = evaluate_clients([fed.clients[c] for c in fed.client_ids],
                           fed.models_for(fed.client_ids),
                           {c: fed.registry.cohort_of(c) for c in fed.client_ids}, fed.spec,
                           cfg.evaluation.loss_max)
    specs = [MetricSpec("accuracy", 0.0, 1.0), MetricSpec("loss", 0.0, cfg.evaluation.loss_max)]
    quant = FixedPointQuantiser([0.0, 0.0], [1.0, cfg.evaluation.loss_max])
    q_sum = sum(quant.quantise([e.accuracy, e.loss]) for e in evs)
    sums = quant.dequantise_sum(q_sum, len(evs))
    assert strategy.protocol[3] == {"advertised": 6, "survivors": 6, "dropped": 0,
                                    "aborted": None}
    for j, spec in enumerate(specs):
        expected = aggregate_sum(float(sums[j]), 6, spec, epsilon=cfg.evaluation.epsilon,
                                 min_cohort=5, seed=np.random.default_rng([cfg.seed, 3, j]))
        got = strategy.releases[3][spec.name]
        assert got.value == expected.value and got.noise_scale == spec.sensitivity / cfg.evaluation.epsilon
        published = result.evaluate_metrics_clientapp[3][spec.name]
        assert published == float(np.clip(expected.value, spec.clip_low, spec.clip_high))
        env = FederatedMetricEnvelope.from_json(strategy.envelopes[3][spec.name])
        assert env.aggregate_value == pytest.approx(published)
        assert "participant_count" not in env.to_dict()
