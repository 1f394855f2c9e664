"""Shared pieces of the Flower digits example: the federation config, each node's
simulated client (same data, same drift schedule as the Prefect flow), the cohorter.

Everything comes from the library: :func:`clma.sim.federation.build_federation` gives
the clients' data (deterministic in the config's seed), ``SimulatedFederation.inject_drift``
applies the drift schedule, and the training is :func:`clma.sim.federation.train_clients`,
exactly what the Prefect flow's ``train-clients`` task runs.
"""

from __future__ import annotations

import dataclasses
import threading
from importlib import resources
from typing import Any

from clma.cohort import AutoKMeans, CLMACohorter
from clma.config import FederationConfig, load_config
from clma.sim.federation import SimClient, SimulatedFederation, build_federation

DEFAULT_CONFIG = "clma_vs_fedavg.toml"

_lock = threading.Lock()
_cache: dict[str, tuple[SimulatedFederation, int]] = {}


def config_from(run_config: dict[str, Any], config_path: str | None = None) -> FederationConfig:
    """The federation config: ``config_path``, else run config ``config-path``, else the
    bundled ``clma/configs/clma_vs_fedavg.toml`` (the CLMA-vs-FedAvg scenario)."""
    path = config_path or str(run_config.get("config-path", "") or "")
    if not path:
        path = str(resources.files("clma.configs").joinpath(DEFAULT_CONFIG))
    return load_config(path)


def federation_at(config: FederationConfig, round_number: int) -> SimulatedFederation:
    """This process's copy of the simulated federation, drifted up to ``round_number``.

    Built once per process and config (deterministic), drift events applied round by
    round as in the flow (rebuilt if an earlier round is asked for: a new run).
    """
    key = config.fingerprint()
    with _lock:
        fed, done = _cache.get(key, (None, 0))
        if fed is None or round_number < done:
            fed, done = build_federation(config), 0
        for r in range(done + 1, round_number + 1):
            fed.inject_drift(r)
        _cache[key] = (fed, max(done, round_number))
        return fed


def client_at(config: FederationConfig, client_id: int, round_number: int,
              detector_state: dict | None) -> SimClient:
    """A private copy of one simulated client at ``round_number`` with the node's
    detector state."""
    cl = federation_at(config, round_number).clients[client_id]
    return dataclasses.replace(cl, drifts=list(cl.drifts), detector_state=detector_state)


def make_cohorter(config: FederationConfig) -> CLMACohorter:
    """The cohorter the config describes (as ``tasks.round.make_cohorter``)."""
    c = config.cohort
    return CLMACohorter(
        clusterer=AutoKMeans(fixed_k=c.fixed_k, max_k=c.max_k, min_silhouette=c.min_silhouette,
                             random_state=config.seed),
        variance_threshold=c.variance_threshold, center=c.center,
        min_ks_magnitude=c.min_ks_magnitude,
    )
