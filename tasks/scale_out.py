"""Client tasks on a Dask cluster (prefect-dask) instead of the thread pool.

A Prefect flow's task runner is fixed on its ``@flow`` decorator, so the round flow is
re-optioned at run time: :func:`open_client_runner` reads ``config.orchestration`` and
returns a :class:`ClientRunner` whose :meth:`ClientRunner.apply` gives
``round_flow.with_options(task_runner=DaskTaskRunner(address=...))`` when a Dask target
is configured, and the flow unchanged otherwise (the default ``ThreadPoolTaskRunner``).

Only the tasks the round *submits* run on the runner: the mapped client chunks
(``train-clients``, ``evaluate-clients``); the server-side steps are called directly and
stay in the flow's process.

* ``orchestration.dask_address = "tcp://host:8786"``: an existing scheduler. Its workers
  must have this project installed (same versions: they unpickle ``SimClient``, numpy
  arrays, the pydantic config and run ``tasks.round``) and must reach the Prefect API the
  flow uses (``PREFECT_API_URL``) -- see ``docs/scale_out.md``.
* ``orchestration.dask_local_workers = n``: a temporary ``distributed.LocalCluster`` with
  n worker *processes* of one thread each, started once for the whole federation (not
  per round) and closed by :meth:`ClientRunner.close`.

Every worker gets :class:`SingleTorchThread` (``torch.set_num_threads(1)``), as the flow
sets in its own process: float results then do not depend on the worker's thread count,
so the same seed gives the same updates, hence the same cohorts, as the thread pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from clma.config import FederationConfig

__all__ = ["ClientRunner", "SingleTorchThread", "open_client_runner"]


class SingleTorchThread:
    """Dask worker plugin: ``torch.set_num_threads(1)`` when the worker starts."""

    name = "clma-single-torch-thread"

    def setup(self, worker: Any) -> None:
        import torch

        torch.set_num_threads(1)

    def teardown(self, worker: Any) -> None:  # pragma: no cover - nothing to undo
        return None


def _as_plugin() -> Any:
    from distributed.diagnostics.plugin import WorkerPlugin

    class _Plugin(SingleTorchThread, WorkerPlugin):
        pass

    return _Plugin()


@dataclass
class ClientRunner:
    """Where the round's client tasks run. ``address`` None = the default thread pool."""

    address: str | None = None
    kind: str = "thread-pool"
    _cluster: Any = field(default=None, repr=False)
    _client: Any = field(default=None, repr=False)

    def apply(self, round_flow: Any) -> Any:
        """``round_flow`` with a ``DaskTaskRunner`` on the cluster, or unchanged."""
        if self.address is None:
            return round_flow
        from prefect_dask import DaskTaskRunner

        return round_flow.with_options(task_runner=DaskTaskRunner(address=self.address))

    def close(self) -> None:
        """Disconnect, and stop the local cluster if this runner started one."""
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._cluster is not None:
            self._cluster.close()
            self._cluster = None


def open_client_runner(config: FederationConfig) -> ClientRunner:
    """The runner ``config.orchestration`` asks for (see the module docstring).

    Raises:
        ImportError: a Dask target is configured but the ``dask`` extra
            (``prefect-dask``) is not installed (message says so).
        OSError: the scheduler at ``dask_address`` cannot be reached (from
            ``distributed``, after its connect timeout).
    """
    orch = config.orchestration
    if orch.dask_address is None and orch.dask_local_workers is None:
        return ClientRunner()
    try:
        import distributed
        import prefect_dask  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "orchestration.dask_address / dask_local_workers need the 'dask' extra: "
            "pip install 'clma[dask]'"
        ) from exc
    cluster = None
    if orch.dask_local_workers is not None:
        cluster = distributed.LocalCluster(
            n_workers=orch.dask_local_workers, threads_per_worker=1, processes=True,
            dashboard_address=":0",
        )
        address, kind = cluster.scheduler_address, f"local-dask-{orch.dask_local_workers}"
    else:
        address, kind = str(orch.dask_address), "dask"
    client = distributed.Client(address)
    client.register_plugin(_as_plugin())
    return ClientRunner(address=address, kind=kind, _cluster=cluster, _client=client)
