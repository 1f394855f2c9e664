"""Opening the transport a federation's config names (the ``Clients`` seam's far side).

``simulation`` (default): :class:`clma.sim.clients.SimulatedClients` in this process;
``dask``: :class:`clma.sim.dask.DaskClients` (devices hosted by Dask workers); ``flower``:
real clients on Flower SuperNodes, reached from inside a Flower ServerApp
(:mod:`flows.flower_serverapp`, started by ``clma run`` with ``flwr run``:
:mod:`flows.flower_launch`), which hands its transport
(:class:`clma.flower.transport.FlowerTransport`) to the flow.

For a simulation the server's public assets (model architecture, initial model, probe set,
region partition) come from the simulated world; the simulated devices keep their own state
in ``federation.device_state_dir`` (default ``<state dir>.devices``, beside the server's
state folder and never inside it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from clma.config import FederationConfig
from clma.engine import Clients, ServerAssets

__all__ = ["Transport", "device_dir_for", "open_transport"]


class Transport:
    """An open transport: the clients and the server's assets; for simulations also the
    simulated world and an in-process view of its devices' data for ground truth
    (``simulation`` / ``truth``; None for real clients); ``details``: what
    ``summary.json`` records about it (``federation.transport_details``, e.g. the Flower
    run id), None for none.

    Not a dataclass, and without ``__dict__``: Prefect records a flow's parameters with
    FastAPI's ``jsonable_encoder``, which deep-copies dataclasses (``dataclasses.asdict``:
    the simulated world, a Dask client's event loop) and walks ``vars()``; a slotted
    object is recorded as ``<Transport>`` at once."""

    __slots__ = ("name", "clients", "assets", "simulation", "truth", "executor", "details")

    def __init__(self, name: str, clients: Clients, assets: ServerAssets,
                 simulation: Any = None, truth: Any = None, executor: str = "in-process",
                 details: dict[str, Any] | None = None) -> None:
        self.name = name
        self.clients = clients
        self.assets = assets
        self.simulation = simulation  # clma.sim.federation.SimulatedFederation
        self.truth = truth  # clma.sim.clients.SimulatedClients (ground truth only)
        self.executor = executor
        self.details = details

    def __repr__(self) -> str:
        return f"<Transport {self.name} ({self.executor})>"

    def close(self) -> None:
        self.clients.close()


def device_dir_for(config: FederationConfig, state_dir: str | Path | None) -> str | None:
    """The simulated devices' storage: ``federation.device_state_dir``, else
    ``<state_dir>.devices`` when there is a state dir, else None (memory)."""
    if config.federation.device_state_dir:
        return config.federation.device_state_dir
    if state_dir is None:
        return None
    return str(Path(state_dir).with_name(Path(state_dir).name + ".devices"))


def open_transport(config: FederationConfig, state_dir: str | Path | None = None) -> Transport:
    """Build the simulated world (when simulated) and open ``config.transport``.

    Raises:
        DatasetError / PartitionError / ValueError: the data cannot host the federation
            (messages name the field).
        ValueError: ``flower``: real clients are reached from a Flower ServerApp
            (``clma run`` starts one), not opened here.
    """
    if config.transport == "flower":
        raise ValueError("federation.transport = 'flower': the flow runs inside a Flower "
                         "ServerApp, which passes its transport in (clma run submits it with "
                         "flwr run: flows/flower_launch.py)")
    from clma.sim.clients import SimulatedClients
    from clma.sim.federation import build_federation

    sim = build_federation(config)
    devices = device_dir_for(config, state_dir)
    local = SimulatedClients(sim, device_dir=devices)
    if config.transport == "dask":
        from clma.sim.dask import open_dask_clients

        clients = open_dask_clients(config, local.roster(), devices)
        executor = (f"local-dask-{config.orchestration.dask_local_workers}"
                    if config.orchestration.dask_local_workers else "dask")
        return Transport("dask", clients, sim.assets(), sim, local, executor)
    return Transport("simulation", local, sim.assets(), sim, local)
