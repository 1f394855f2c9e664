"""Simulated clients hosted by Dask workers: the ``dask`` transport of the Clients seam.

:class:`DaskClients` spreads the simulated devices over a Dask cluster: each worker hosts
one :class:`clma.sim.clients.SimulatedClients` for its share of the clients as a Dask
*actor* (the devices' data, detector state and secure-aggregation secrets stay on that
worker), built there from the federation config (the data are made by the code on the
worker, never shipped). Every protocol call fans out to the actors in parallel and merges
their replies; only models, updates and protocol messages cross the network. Clients are
dealt to workers in ascending id order, round robin.

* ``orchestration.dask_address = "tcp://host:8786"``: an existing scheduler whose workers
  have this project installed (same versions). The devices' ``device_state_dir`` must be a
  folder every worker can write (shared storage), or None (memory only: the devices then
  forget their detector state when the cluster restarts).
* ``orchestration.dask_local_workers = n``: a temporary ``distributed.LocalCluster`` with n
  worker processes of one thread each, started by :func:`open_dask_clients` and closed by
  :meth:`DaskClients.close`.

Each actor sets ``torch.set_num_threads(1)`` (as the flow does in its own process), so
float results do not depend on the worker's thread count: the same seed gives the same
updates, hence the same cohorts, as in-process simulated clients.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from clma.config import FederationConfig
from clma.engine.clients import ChoiceRequest, Replies, ReportRequest, Roster, TrainRequest

__all__ = ["DaskClients", "DeviceHost", "open_dask_clients"]


class DeviceHost:
    """A Dask actor: the simulated devices of one worker (built on the worker)."""

    def __init__(self, config_json: str, client_ids: list[int], device_dir: str | None) -> None:
        import torch

        from clma.config import FederationConfig
        from clma.sim.clients import SimulatedClients
        from clma.sim.federation import build_federation

        torch.set_num_threads(1)
        cfg = FederationConfig.model_validate_json(config_json)
        self.clients = SimulatedClients(build_federation(cfg), device_dir=device_dir,
                                        client_ids=client_ids)

    def call(self, name: str, *args: Any) -> Any:
        return getattr(self.clients, name)(*args)


class DaskClients:
    """The ``dask`` transport (module docstring).

    Args:
        client: a connected ``distributed.Client``.
        config: the federation config (workers build their devices from it).
        device_dir: the devices' own storage (see module docstring).
        roster: the federation's roster (who exists, regions; public).
        cluster: a LocalCluster this transport started (closed with it), or None.
    """

    transport = "dask"

    def __init__(self, client: Any, config: FederationConfig, device_dir: str | None,
                 roster: Roster, cluster: Any = None) -> None:
        self._client = client
        self._cluster = cluster
        self._roster = roster
        workers = sorted(client.scheduler_info()["workers"])
        if not workers:
            raise RuntimeError("orchestration: the Dask cluster has no workers")
        ids = roster.client_ids
        shares = {w: ids[i::len(workers)] for i, w in enumerate(workers)}
        payload = config.model_dump_json()
        self._hosts: dict[str, Any] = {}
        self._owner: dict[int, str] = {}
        futures = {w: client.submit(DeviceHost, payload, cs, device_dir, actor=True,
                                    workers=[w], pure=False)
                   for w, cs in shares.items() if cs}
        for w, f in futures.items():
            self._hosts[w] = f.result()
            for c in shares[w]:
                self._owner[c] = w
        self.address = client.scheduler.address

    def roster(self) -> Roster:
        return self._roster

    def _fan_out(self, name: str, split: Callable[[str], tuple | None]) -> Replies:
        pending = []
        for w, host in self._hosts.items():
            args = split(w)
            if args is not None:
                pending.append(host.call(name, *args))
        out: Replies = Replies()
        for p in pending:
            out = out.merge(p.result())
        return out

    def _by_owner(self, mapping: Mapping[int, Any], w: str) -> dict[int, Any]:
        return {c: v for c, v in mapping.items() if self._owner.get(c) == w}

    def train(self, request: TrainRequest) -> Replies:
        unknown = [c for c in request.assignments if c not in self._owner]

        def split(w: str) -> tuple | None:
            mine = [c for c in request.assignments if self._owner.get(c) == w]
            return (request.for_clients(mine),) if mine else None

        out = self._fan_out("train", split)
        out.failed.update({c: "not a client of this transport" for c in unknown})
        return out

    def choose(self, request: ChoiceRequest) -> Replies:
        unknown = [c for c in request.candidates if c not in self._owner]

        def split(w: str) -> tuple | None:
            mine = [c for c in request.candidates if self._owner.get(c) == w]
            return (request.for_clients(mine),) if mine else None

        out = self._fan_out("choose", split)
        out.failed.update({c: "not a client of this transport" for c in unknown})
        return out

    def secagg_advertise(self, request: ReportRequest) -> Replies:
        return self._fan_out("secagg_advertise", lambda w: (request,))

    def _step(self, name: str, round_number: int, requests: Mapping[int, Any]) -> Replies:
        def split(w: str) -> tuple | None:
            mine = self._by_owner(requests, w)
            return (round_number, mine) if mine else None

        return self._fan_out(name, split)

    def secagg_share_keys(self, round: int, requests: Mapping[int, Any]) -> Replies:  # noqa: A002
        return self._step("secagg_share_keys", round, requests)

    def secagg_masked_input(self, round: int, inboxes: Mapping[int, Any]) -> Replies:  # noqa: A002
        return self._step("secagg_masked_input", round, inboxes)

    def secagg_unmask(self, round: int, requests: Mapping[int, Any]) -> Replies:  # noqa: A002
        return self._step("secagg_unmask", round, requests)

    def close(self) -> None:
        """Release the actors; disconnect, and stop the local cluster if this started one."""
        self._hosts.clear()
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._cluster is not None:
            self._cluster.close()
            self._cluster = None


def open_dask_clients(config: FederationConfig, roster: Roster,
                      device_dir: str | None) -> DaskClients:
    """The Dask transport ``config.orchestration`` asks for (module docstring).

    Raises:
        ImportError: the ``dask`` extra is not installed (message says so).
        OSError: the scheduler at ``dask_address`` cannot be reached.
    """
    orch = config.orchestration
    try:
        import distributed
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("federation.transport 'dask' needs the 'dask' extra: "
                          "pip install 'clma[dask]'") from exc
    cluster = None
    if orch.dask_local_workers is not None:
        cluster = distributed.LocalCluster(n_workers=orch.dask_local_workers,
                                           threads_per_worker=1, processes=True,
                                           dashboard_address=":0")
        address = cluster.scheduler_address
    else:
        address = str(orch.dask_address)
    client = distributed.Client(address)
    try:
        return DaskClients(client, config, device_dir, roster, cluster=cluster)
    except BaseException:
        client.close()
        if cluster is not None:
            cluster.close()
        raise
