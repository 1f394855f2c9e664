"""Leak scan over every output of a run (issue 21 item 8): summary.json and the output
folder, MLflow params / metrics / tags / artifacts, Prefect artifacts. Nothing published
names a client, holds an exact count of a data-derived group, or a per-client value.

The run: the embedded default config (60 clients in 5 regions, one of 3 clients, below
the floor of 5), 4 rounds with the drift at round 4, 10 % simulated dropouts, evaluation
every 2 rounds, tracked in a temporary MLflow store.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from clma.config import load_config

pytestmark = pytest.mark.slow

#: The configured federation size is the operator's public setting, not data-derived.
PUBLIC_SETTINGS = ("summary/federation/clients", "summary.json/federation/clients")

#: Keys that would hold an exact count of clients, or client ids, if they appeared.
FORBIDDEN_KEYS = {"contributors", "participant_count", "selected", "dropped", "n_clients",
                  "size", "members", "clients", "client_id", "client_ids", "flagged",
                  "quarantined", "n_flagged", "n_reweighted", "quarantined_atypical",
                  "count", "n_eval", "n_samples"}


def _walk(obj: Any, path: str, out: list[tuple[str, str, Any]]) -> None:
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.append((path, str(k), v))
            _walk(v, f"{path}/{k}", out)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            _walk(v, f"{path}[{i}]", out)


@pytest.fixture(scope="module")
def run(tmp_path_factory, prefect_harness):
    tmp = tmp_path_factory.mktemp("leak")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    old = os.environ.get("MLFLOW_TRACKING_URI")
    os.environ["MLFLOW_TRACKING_URI"] = uri
    truth: list[Any] = []
    try:
        from flows.federation import federation_flow

        cfg = load_config(None).with_overrides(rounds=4)
        cfg = cfg.model_copy(update={
            "evaluation": cfg.evaluation.model_copy(update={"dropout_rate": 0.1}),
            "tracking": cfg.tracking.model_copy(update={"experiment": "leak-scan"})})
        summary = federation_flow(cfg, out_dir=str(tmp / "out"), state_dir=str(tmp / "state"),
                                  on_divergence=truth.append)
    finally:
        if old is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = old
    return summary, tmp, uri, truth


def _published_documents(tmp: Path, uri: str, summary: dict) -> dict[str, Any]:
    """Every published document of the run, by where it was found."""
    from mlflow import MlflowClient

    docs: dict[str, Any] = {"summary": summary}
    for p in sorted((tmp / "out").rglob("*.json")):
        docs[f"out/{p.relative_to(tmp / 'out')}"] = json.loads(p.read_text())
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("leak-scan")
    runs = client.search_runs([exp.experiment_id])
    assert runs
    dl = tmp / "mlflow-download"
    for r in runs:
        rid = r.info.run_id
        docs[f"mlflow/{rid}/params"] = dict(r.data.params)
        docs[f"mlflow/{rid}/tags"] = {k: v for k, v in r.data.tags.items()
                                      if not k.startswith("mlflow.")}
        docs[f"mlflow/{rid}/metrics"] = dict(r.data.metrics)
        local = Path(client.download_artifacts(rid, "", str(dl / rid)))
        for p in sorted(local.rglob("*.json")):
            docs[f"mlflow/{rid}/artifacts/{p.relative_to(local)}"] = json.loads(p.read_text())
    from prefect.artifacts import Artifact  # noqa: F401  (the harness's API)
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as pc:
        for a in pc.read_artifacts():
            docs[f"prefect/{a.key}/{a.id}"] = a.data
    return docs


def test_nothing_published_holds_a_count_of_clients_or_client_ids(run):
    summary, tmp, uri, _ = run
    docs = _published_documents(tmp, uri, summary)
    bad = []
    for where, doc in docs.items():
        if isinstance(doc, str):  # markdown / table artifacts: parse what can be parsed
            try:
                doc = json.loads(doc)
            except ValueError:
                continue
        items: list[tuple[str, str, Any]] = []
        _walk(doc, where, items)
        for path, key, value in items:
            suspicious = key in FORBIDDEN_KEYS or re.search(r"client", key) or re.search(
                r"/(final_)?cohorts$|/rounds/\d+$", path)  # cohort id -> size maps
            numeric = (isinstance(value, int) and not isinstance(value, bool)) or (
                isinstance(value, list) and any(isinstance(v, int) for v in value)) or (
                isinstance(value, str) and value.isdigit())
            if suspicious and numeric and not f"{path}/{key}".endswith(PUBLIC_SETTINGS) \
                    and not path.endswith("/params"):
                bad.append(f"{path}/{key}={value!r}")
    assert not bad, bad[:20]
    # MLflow metric names: no per-client and no client-count metrics
    for where, doc in docs.items():
        if where.endswith("/metrics"):
            assert not [k for k in doc if "client" in k or k.endswith("n_flagged")], where


def test_no_per_client_value_and_no_small_count_appears(run):
    summary, tmp, uri, truth = run
    docs = _published_documents(tmp, uri, summary)
    text = json.dumps(docs, sort_keys=True, default=str)
    # per-client divergence scores (server-internal) never appear in a published document
    scores = {repr(float(s)) for outcome in truth
              for s in outcome.representation.scores.values()}
    assert scores and not [s for s in scores if s in text]
    # the region of 3 clients is never published on its own, and no cohort size is
    for rnd in summary["rounds"]:
        if rnd["regional"]:
            assert "islands" not in rnd["regional"]["metrics"]["accuracy"]["regions"]
        for band in rnd["cohorts"].values():
            assert band in {"none", "below_minimum", "minimum_to_under_double",
                            "double_to_under_fourfold", "fourfold_or_more"}


def test_the_audit_record_of_the_run_keeps_the_rule(run):
    summary, tmp, *_ = run
    m = summary["federation"]["min_cohort"]
    files = sorted((tmp / "state" / "audit").glob("secure_sums_round_*.json"))
    assert [f.name for f in files] == ["secure_sums_round_002.json",
                                       "secure_sums_round_004.json"]
    for f in files:
        doc = json.loads(f.read_text())
        sets = [set(s["clients"]) for s in doc["secure_sums"]]
        assert sets
        for a in sets:
            assert len(a) >= m
            for b in sets:
                if a < b:
                    assert len(b - a) >= m
                elif a is not b and a != b:
                    assert not a & b
    # the rule across rounds, from the records alone (docs/private_evaluation.md)
    from clma.privacy.differencing import exposed_clients

    learned = [{(c, d) for d, cs in e["models"].items() for c in cs}
               for f in files for e in json.loads(f.read_text())["secure_sums"]]
    assert all(sorted(c for cs in e["models"].values() for c in cs) == e["clients"]
               for f in files for e in json.loads(f.read_text())["secure_sums"])
    assert exposed_clients(learned, m) is None
