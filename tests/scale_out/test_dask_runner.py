"""The Prefect flow's client tasks on a real local Dask cluster (scheduler and two worker
processes) give the same federation as the default thread-pool runner, same seed."""

from __future__ import annotations

from pathlib import Path

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


def test_dask_cluster_gives_the_same_cohorts_as_the_thread_pool(both_runs):
    _, default, on_dask = both_runs
    per_round = [r["cohorts"] for r in default["rounds"]]
    # the drift at round 3 split the root cohort: the test is about a real cohorting
    assert per_round[0] == {"0": 6}
    assert per_round[1] == {"0": 6}
    assert len(per_round[2]) >= 3
    assert [r["cohorts"] for r in on_dask["rounds"]] == per_round
    assert on_dask["final_cohorts"] == default["final_cohorts"]
    assert [r["new_cohorts"] for r in on_dask["rounds"]] == [
        r["new_cohorts"] for r in default["rounds"]]
    # bit-identical training: the seeded regional releases (computed from every client's
    # evaluation of its cohort model) are equal too
    assert _without_timing(on_dask) == _without_timing(default)


def test_open_client_runner_default_is_the_thread_pool_and_leaves_the_flow_alone():
    from flows.federation import round_flow
    from tasks.scale_out import open_client_runner

    runner = open_client_runner(load_config(TINY))
    assert runner.address is None and runner.kind == "thread-pool"
    assert runner.apply(round_flow) is round_flow
    runner.close()


def test_runner_on_an_address_uses_a_dask_task_runner_for_the_round_flow():
    from prefect_dask import DaskTaskRunner

    from flows.federation import round_flow
    from tasks.scale_out import ClientRunner

    flow = ClientRunner(address="tcp://127.0.0.1:1", kind="dask").apply(round_flow)
    assert isinstance(flow.task_runner, DaskTaskRunner)
    assert flow.task_runner.address == "tcp://127.0.0.1:1"
    assert flow.fn is round_flow.fn


def test_both_dask_targets_at_once_is_a_config_error():
    from clma.config import FederationConfig

    base = load_config(TINY).model_dump()
    base["orchestration"].update(dask_address="tcp://10.0.0.5:8786", dask_local_workers=2)
    with pytest.raises((ConfigError, ValueError), match="at most one of dask_address"):
        FederationConfig.model_validate(base)
