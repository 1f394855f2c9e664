"""MLflow defaults of tasks/tracking.py: the experiment opens on its runs ("Model training",
not MLflow 3's GenAI view) and has a description; every Prefect flow run that advances a
federation is recorded; a value and its error bar share a name prefix."""

from __future__ import annotations

from tasks.tracking import FederationTracker, error_bar_key


def test_new_experiment_is_typed_for_model_training_and_described(mlflow_store):
    t = FederationTracker(mlflow_store)
    t.start("fed-a", run_name="fed-a-seed1", params={"rounds": "2"}, tags={})
    tags = t.client.get_experiment(t.experiment_id).tags
    assert tags["mlflow.experimentKind"] == "custom_model_development"
    assert "fed-a" in tags["mlflow.note.content"] and "error bars" in tags["mlflow.note.content"]


def test_existing_experiment_gets_missing_tags_and_keeps_the_operators(mlflow_store):
    t = FederationTracker(mlflow_store)
    eid = t.client.create_experiment("fed-b", tags={"mlflow.note.content": "mine"})
    t.start("fed-b", run_name="r", params={}, tags={})
    tags = t.client.get_experiment(eid).tags
    assert tags["mlflow.note.content"] == "mine"
    assert tags["mlflow.experimentKind"] == "custom_model_development"


def test_every_prefect_flow_run_of_the_federation_is_recorded(mlflow_store):
    t = FederationTracker(mlflow_store)
    t.start("fed-c", run_name="r", params={}, tags={})
    t.record_prefect_run("11111111-1111-1111-1111-111111111111", 1)
    runs = t.record_prefect_run("22222222-2222-2222-2222-222222222222", 3)
    assert runs == [{"flow_run_id": "11111111-1111-1111-1111-111111111111", "first_round": 1},
                    {"flow_run_id": "22222222-2222-2222-2222-222222222222", "first_round": 3}]
    tags = t.client.get_run(t.run_id).data.tags
    assert tags["clma.prefect_flow_run_id"] == "22222222-2222-2222-2222-222222222222"
    assert tags["clma.prefect_flow_run.11111111-1111-1111-1111-111111111111"] == "1"
    import json
    from pathlib import Path

    local = t.client.download_artifacts(t.run_id, "prefect_flow_runs.json")
    assert json.loads(Path(local).read_text())["flow_runs"] == runs


def test_error_bar_shares_the_values_name():
    assert error_bar_key("eval.global.accuracy") == "eval.global.accuracy.error_bar"


def test_set_tags_writes_every_tag_in_batches_of_100(mlflow_store):
    t = FederationTracker(mlflow_store)
    t.start("fed-d", run_name="r", params={}, tags={})
    want = {f"clma.t{i:03d}": f"v{i}" for i in range(250)}  # three batches: 100, 100, 50
    t.set_tags(want)
    t.set_tags({"clma.t000": "again"})  # a later value replaces the earlier one
    tags = t.client.get_run(t.run_id).data.tags
    assert {k: tags[k] for k in want} == {**want, "clma.t000": "again"}
