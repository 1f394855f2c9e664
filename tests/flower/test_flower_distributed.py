"""Distributed DP over the Flower transport, in process (a loopback grid hands every
message to the real ClientApp; no SuperLink, no deployment): each node's ClientApp draws
its own noise share (clma.device through the handlers), the engine unmasks only a noisy
sum and publishes it with the distributed mechanism."""

from __future__ import annotations

import math

import numpy as np
import pytest

import clma.privacy.distributed as distributed
from clma.config import validate_config
from clma.engine import FederationEngine
from clma.flower.transport import FlowerTransport
from clma.privacy.distributed import dg_variance
from clma.sim.clients import SimulatedClients
from clma.sim.federation import build_federation

from .conftest import tiny_config
from .test_flower_transport import _grid


@pytest.fixture(scope="module")
def world():
    import torch

    torch.set_num_threads(1)
    data = tiny_config().model_dump(mode="json")
    data["federation"]["transport"] = "flower"
    data["evaluation"].update(noise="distributed", noise_seeded=False)
    data["budget"]["enabled"] = False
    cfg = validate_config(data)
    return cfg, build_federation(cfg)


def test_clientapps_add_the_noise_and_the_server_sees_only_the_noisy_sum(
        run_id, world, monkeypatch):
    cfg, fed = world
    draws: list[int] = []
    real = distributed.sample_noise

    def spy(sigma, size):  # called inside the ClientApp's handler, on the node
        draws.append(int(size))
        return real(sigma, size)

    monkeypatch.setattr(distributed, "sample_noise", spy)
    transport = FlowerTransport(_grid(cfg), cfg, partition=fed.partition, timeout=5)
    eng = FederationEngine(cfg, fed.assets(), transport)
    ctx = eng.begin_round(1)
    eng.accept(ctx, [eng.train(ctx)])
    eng.after_training(ctx)
    sums = eng.secure_sums(ctx)
    g = sums.groups["global"]
    assert g.status == "ok" and g.contributors == cfg.clients
    assert draws == [2] * cfg.clients  # one share (accuracy, mean loss) per node
    from clma.device import quantised_report

    sim = SimulatedClients(fed)
    exact = np.sum([quantised_report(*sim.learners[c].predict(eng.state.cohort_models[0], 1),
                                     sums.layout, 2**16 - 1) for c in range(cfg.clients)],
                   axis=0).astype(np.int64)
    noise = g.sum_quantised[:2] - exact[:2]
    assert np.all(noise != 0)
    assert np.all(np.abs(noise) < 8 * math.sqrt(cfg.clients * dg_variance(g.noise.sigma)))
    assert np.all(g.sum_quantised[2:] == 0)
    out = eng.evaluate(ctx, sums)
    pub = out.published["metrics"]["accuracy"]["global"]
    assert pub["mechanism"] == "distributed_discrete_gaussian"
    assert out.published["noise"]["mode"] == "distributed"
