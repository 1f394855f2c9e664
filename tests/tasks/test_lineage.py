"""Cohort lineage in MLflow (tasks/lineage.py) on a real SQLite store, without a flow:
nested cohort runs, the documented descendants search, band tags, registered models with
per-cohort aliases, idempotent re-sync, lineage JSON + PNG."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from clma.config import load_config
from clma.engine import FederationEngine
from clma.sim.clients import SimulatedClients
from clma.sim.federation import build_federation

SMALL = Path(__file__).parents[1] / "flows" / "small.toml"
BANDS = {"minimum_to_under_double", "double_to_under_fourfold", "fourfold_or_more",
         "below_minimum", "none"}


@pytest.fixture(scope="module")
def synced(tmp_path_factory):
    from mlflow import MlflowClient
    from tasks.lineage import CohortLineageTracker, registered_model_name

    tmp = tmp_path_factory.mktemp("lineage")
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp / 'mlflow.db'}")
    exp = client.create_experiment("lin", artifact_location=(tmp / "art").as_uri())
    parent = client.create_run(exp, run_name="federation").info.run_id
    cfg = load_config(SMALL)
    sim = build_federation(cfg)
    fed = FederationEngine(cfg, sim.assets(), SimulatedClients(sim))  # the server's engine
    reg = fed.state.registry
    name = registered_model_name(fed.config)
    lt = CohortLineageTracker(client, exp, parent, name)
    docs = {}

    def models(rnd, frozen=()):  # every active cohort's model changes, except `frozen`
        st = fed.state
        st.cohort_models = {
            c: st.cohort_models[c] if c in frozen
            else np.full(fed.assets.initial_model.shape, 0.01 * c + 0.001 * rnd, np.float32)
            for c in reg.active_cohorts()}

    docs[1] = lt.sync_round(fed, 1)                                  # root 0 only
    reg.split(0, {0: [0, 2, 4, 6, 8], 1: [1, 3, 5, 7, 9]}, round=2)  # 0 -> 1, 2 (0 retired)
    models(2)
    docs[2] = lt.sync_round(fed, 2)
    reg.split(1, {0: [0, 2]}, round=3)                               # 1 -> 3
    models(3)
    docs[3] = lt.sync_round(fed, 3)
    reg.merge([2, 3], round=4)                                       # 2 + 3 -> 4
    models(4, frozen={1})                                            # 1 unchanged
    docs[4] = lt.sync_round(fed, 4)
    return client, exp, parent, fed, lt, docs, name


def _ids(runs):
    return sorted(int(r.data.tags["clma.cohort.id"]) for r in runs)


def test_documented_descendants_filter_finds_every_descendant(synced):
    from tasks.lineage import descendants_filter

    client, exp, parent, fed, *_ = synced
    assert descendants_filter(3) == "tags.`clma.cohort.ancestor.3` = 'true'"
    for cid in range(5):
        runs = client.search_runs([exp], filter_string=f"tags.`clma.cohort.ancestor.{cid}` = 'true'")
        assert _ids(runs) == fed.state.registry.descendants(cid)
    assert _ids(client.search_runs([exp], descendants_filter(1, parent))) == [3, 4]
    assert _ids(client.search_runs([exp], descendants_filter(0))) == [1, 2, 3, 4]
    assert client.search_runs([exp], descendants_filter(4)) == []
    with pytest.raises(ValueError, match="cohort_id"):
        descendants_filter(-1)


def test_cohort_runs_are_nested_and_tagged(synced):
    client, exp, parent, fed, *_ = synced
    runs = client.search_runs([exp], f"tags.`mlflow.parentRunId` = '{parent}'")
    assert _ids(runs) == [0, 1, 2, 3, 4]
    tags = {int(r.data.tags["clma.cohort.id"]): r.data.tags for r in runs}
    assert tags[4]["clma.cohort.parents"] == "2,3"
    assert tags[3]["clma.cohort.parents"] == "1"
    assert tags[0]["clma.cohort.parents"] == ""
    assert {k for k in tags[4] if k.startswith("clma.cohort.ancestor.")} == {
        "clma.cohort.ancestor.0", "clma.cohort.ancestor.1", "clma.cohort.ancestor.2",
        "clma.cohort.ancestor.3"}
    assert tags[4]["clma.cohort.created_round"] == "4"
    assert tags[2]["clma.cohort.status"] == "merged"
    assert tags[2]["clma.cohort.merged_round"] == "4"
    assert tags[0]["clma.cohort.status"] == "retired"
    assert tags[0]["clma.cohort.retired_round"] == "2"
    # bands, never counts (floor = max(min_cohort 2, policy 5) = 5: 7 members -> minimum_to_under_double)
    assert tags[4]["clma.release.participant_band"] == "minimum_to_under_double"
    assert tags[1]["clma.release.participant_band"] == "below_minimum"   # 3 members
    assert tags[2]["clma.release.participant_band"] == "none"            # merged: empty
    for t in tags.values():
        assert t["clma.release.participant_band"] in BANDS
        assert not any("client" in k for k in t)


def test_models_registered_with_cohort_alias_and_loadable(synced, monkeypatch):
    import mlflow.pytorch
    import torch

    from clma.params import AllParams, vector_to_model

    client, exp, parent, fed, lt, docs, name = synced
    for cid in fed.state.registry.active_cohorts():
        mv = client.get_model_version_by_alias(name, f"cohort-{cid}")
        assert mv.tags["clma.cohort.id"] == str(cid)
    mv4 = client.get_model_version_by_alias(name, "cohort-4")
    assert mv4.tags["clma.round"] == "4"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", client._tracking_client.tracking_uri)
    model = mlflow.pytorch.load_model(f"models:/{name}@cohort-4")
    spec = fed.assets.model_spec
    x = torch.rand(5, spec.n_features)
    ref = vector_to_model(fed.state.cohort_models[4], spec.build(seed=0), AllParams()).eval()
    with torch.no_grad():
        np.testing.assert_allclose(model(x).numpy(), ref(x).numpy(), rtol=1e-5, atol=1e-6)
    # cohort 1 changed its model in rounds 2 and 3 -> two versions; alias on the later one
    v1 = client.search_model_versions(f"name = '{name}' and run_id = '{lt.state.cohort_runs['1']}'")
    assert sorted(v.tags["clma.round"] for v in v1) == ["2", "3"]
    assert client.get_model_version_by_alias(name, "cohort-1").tags["clma.round"] == "3"


def test_resync_is_idempotent(synced):
    from tasks.lineage import CohortLineageTracker, LineageState

    client, exp, parent, fed, lt, docs, name = synced
    n_runs = len(client.search_runs([exp]))
    n_versions = len(client.search_model_versions(f"name = '{name}'"))
    # a resumed flow run that lost the tracker's state re-syncs round 4
    fresh = CohortLineageTracker(client, exp, parent, name, state=LineageState())
    fresh.sync_round(fed, 4)
    assert len(client.search_runs([exp])) == n_runs
    assert len(client.search_model_versions(f"name = '{name}'")) == n_versions


def test_lineage_artifacts_json_and_png(synced, tmp_path):
    from tasks.lineage import write_lineage_files

    client, exp, parent, fed, lt, docs, name = synced
    doc = docs[4]
    assert doc["schema"] == "clma.lineage/1"
    kinds = [(e["kind"], e["round"], e["parents"], e["children"]) for e in doc["events"]]
    assert ("split", 2, [0], [1, 2]) in kinds
    assert ("merge", 4, [2, 3], [4]) in kinds
    assert "clients" not in json.dumps(doc)
    stored = json.loads(Path(client.download_artifacts(parent, "lineage/lineage.json",
                                                       str(tmp_path))).read_text())
    assert stored == json.loads(json.dumps(doc))
    png = Path(client.download_artifacts(parent, "lineage/lineage.png", str(tmp_path)))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    j, p = write_lineage_files(doc, tmp_path / "out")
    assert json.loads(j.read_text())["cohorts"][4]["parents"] == [2, 3]
    assert p.stat().st_size > 5000


# ------------------------------------------------------------------ issue 14 item 3


def test_lineage_figure_title_inside_round_axis_from_1_readable(synced, tmp_path):
    import os

    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    from tasks.dashboards import MIN_WIDTH_PX
    from tasks.lineage import lineage_figure, render_lineage_png

    doc = synced[5][4]
    assert doc["cohorts"][0]["created_round"] == 0  # the root starts at the federation start
    fig = lineage_figure(doc)
    try:
        folder = os.environ.get("CLMA_TEST_ARTEFACTS")
        keep = (Path(folder) / "dashboards") if folder else tmp_path
        keep.mkdir(parents=True, exist_ok=True)
        fig.savefig(keep / "lineage.png", dpi=fig.dpi)
        ax = fig.axes[0]
        renderer = fig.canvas.get_renderer()
        title = ax.title.get_window_extent(renderer)
        page = fig.bbox
        assert title.x0 >= page.x0 and title.x1 <= page.x1 and title.y1 <= page.y1
        assert ax.get_xlim()[0] == 0.5  # the round axis starts at round 1
        loc = ax.xaxis.get_major_locator()
        assert isinstance(loc, MaxNLocator) and loc._integer
        lo, hi = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
        assert min(ticks) == 1 and all(t == int(t) for t in ticks)
        assert min(min(ln.get_xdata()) for ln in ax.lines) >= 1  # life lines from round 1
        assert fig.get_size_inches()[0] * fig.dpi >= MIN_WIDTH_PX
    finally:
        plt.close(fig)
    png = render_lineage_png(doc, tmp_path / "l.png")
    import struct

    w, _ = struct.unpack(">II", png.read_bytes()[16:24])
    assert w >= MIN_WIDTH_PX


def test_registered_model_description_keeps_the_alias_placeholder(synced):
    from tasks.lineage import REGISTERED_MODEL_DESCRIPTION, CohortLineageTracker

    client, exp, parent, fed, lt, docs, name = synced
    desc = client.get_registered_model(name).description
    assert desc == REGISTERED_MODEL_DESCRIPTION
    assert "`cohort-{id}`" in desc and "<" not in desc and ">" not in desc
    # a model registered by an older version gets the fixed description
    client.update_registered_model(name, description="alias cohort-<id> = latest")
    CohortLineageTracker(client, exp, parent, name)._ensure_registered_model()
    assert client.get_registered_model(name).description == REGISTERED_MODEL_DESCRIPTION


class _RecordingClient:
    """The MLflow calls sync_round makes, recorded (no store): PNGs logged, in order."""

    def __init__(self):
        self.pngs: list[tuple[str, bytes]] = []
        self.dicts: list[dict] = []
        self._n = 0

    def search_runs(self, *a, **k):
        return []

    def create_run(self, *a, **k):
        from types import SimpleNamespace

        self._n += 1
        return SimpleNamespace(info=SimpleNamespace(run_id=f"run-{self._n}"))

    def log_batch(self, *a, **k):
        pass

    def set_terminated(self, *a, **k):
        pass

    def log_dict(self, run_id, doc, artifact_file):
        self.dicts.append(json.loads(json.dumps(doc)))

    def log_artifact(self, run_id, path, artifact_path=None):
        assert artifact_path == "lineage"
        self.pngs.append((str(path), Path(path).read_bytes()))


def test_lineage_png_is_drawn_when_the_graph_changed_or_at_the_last_round(tmp_path):
    """lineage.json after every round; lineage.png only when the graph changed (a split,
    a merge) or at the flow run's last round, rendered once: the out folder's file is the
    one logged."""
    from tasks.lineage import CohortLineageTracker, render_lineage_png

    cfg = load_config(SMALL)
    sim = build_federation(cfg)
    fed = FederationEngine(cfg, sim.assets(), SimulatedClients(sim))
    reg = fed.state.registry
    client = _RecordingClient()
    lt = CohortLineageTracker(client, "exp", "fed-run", "m", log_models=False)
    out = tmp_path / "out"
    drawn = []
    for rnd in range(1, 6):
        if rnd == 3:
            reg.split(0, {0: [0, 2, 4, 6, 8], 1: [1, 3, 5, 7, 9]}, round=3)
        before = len(client.pngs)
        doc = lt.sync_round(fed, rnd, out_dir=out, final=rnd == 5)
        if len(client.pngs) > before:
            drawn.append(rnd)
        assert client.dicts[-1] == json.loads(json.dumps(doc)) and doc["rounds_done"] == rnd
        on_disk = json.loads((out / "lineage" / "lineage.json").read_text())
        assert on_disk["rounds_done"] == rnd  # the JSON is current every round
    assert drawn == [1, 3, 5]  # first draw, the split, the last round
    path, data = client.pngs[-1]
    assert path == str(out / "lineage" / "lineage.png") and data == Path(path).read_bytes()
    assert data == render_lineage_png(doc, tmp_path / "again.png").read_bytes()  # round 5's
    # a tracker without an out folder logs a temporary file of the same drawing
    client2 = _RecordingClient()
    lt2 = CohortLineageTracker(client2, "exp", "fed-run", "m", log_models=False)
    lt2.sync_round(fed, 5)
    assert [d for _, d in client2.pngs] == [data]


def _versions(client, name, lt):
    """cohort id -> sorted (round, sha) of its registered versions, and the aliases."""
    out = {}
    for key, rid in lt.state.cohort_runs.items():
        out[int(key)] = sorted((v.tags["clma.round"], v.tags["clma.model.sha256"])
                               for v in client.search_model_versions(
                                   f"name = '{name}' and run_id = '{rid}'"))
    aliases = {int(k): client.get_model_version(name, v).tags["clma.round"]
               for k, v in lt.state.model_versions.items()}
    return out, aliases


@pytest.mark.parametrize("processes", [True, False, "killed"],
                         ids=["worker", "no-worker", "dead-worker"])
def test_models_exported_in_the_worker_register_the_same_versions(synced, tmp_path,
                                                                  processes):
    """Models exported in the DashboardRenderer's process (registered by collect(), at the
    next sync_round) end as the same versions, rounds, parameter hashes and aliases as
    exported at once; processes=False (no worker: submit_job returns None) and a worker
    killed after its start (BrokenProcessPool) export at collect()."""
    from mlflow import MlflowClient
    from tasks.dashboards import DashboardRenderer
    from tasks.lineage import CohortLineageTracker

    client0, _, _, fed0, lt0, _, name = synced
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.create_experiment("lin", artifact_location=(tmp_path / "art").as_uri())
    parent = client.create_run(exp, run_name="federation").info.run_id
    cfg = load_config(SMALL)
    sim = build_federation(cfg)
    fed = FederationEngine(cfg, sim.assets(), SimulatedClients(sim))
    reg = fed.state.registry
    worker = DashboardRenderer(processes=bool(processes))
    if processes == "killed":
        import os
        import signal
        import time

        worker.start()
        worker._pool.submit(int).result()  # the worker is up
        for pid in list(worker._pool._processes):
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)
    lt = CohortLineageTracker(client, exp, parent, name, worker=worker)

    def models(rnd, frozen=()):  # as in the `synced` fixture
        st = fed.state
        st.cohort_models = {
            c: st.cohort_models[c] if c in frozen
            else np.full(fed.assets.initial_model.shape, 0.01 * c + 0.001 * rnd, np.float32)
            for c in reg.active_cohorts()}

    try:
        lt.sync_round(fed, 1)
        assert len(lt._pending) == 1 and lt.state.model_versions == {}  # not yet registered
        if processes is True:
            assert lt._pending[0].job is not None
        reg.split(0, {0: [0, 2, 4, 6, 8], 1: [1, 3, 5, 7, 9]}, round=2)
        models(2)
        lt.sync_round(fed, 2)  # registers round 1's model, submits cohorts 1 and 2
        assert set(lt.state.model_versions) == {"0"}
        reg.split(1, {0: [0, 2]}, round=3)
        models(3)
        lt.sync_round(fed, 3)
        reg.merge([2, 3], round=4)
        models(4, frozen={1})
        lt.sync_round(fed, 4)
        lt.collect()
    finally:
        worker.close()
    assert lt._pending == []
    assert _versions(client, name, lt) == _versions(client0, name, lt0)
    assert lt.state.model_sha == lt0.state.model_sha
    import mlflow.pytorch
    import torch

    x = torch.rand(3, fed.assets.model_spec.n_features)
    for cid, rnd in ((1, 3), (4, 4)):  # the exported graphs compute the same function
        out = []
        for c, t, tag in ((client, lt, "got"), (client0, lt0, "ref")):
            local = c.download_artifacts(t.state.cohort_runs[str(cid)],
                                         f"model/round_{rnd:03d}", str(tmp_path / f"{tag}{cid}"))
            with torch.no_grad():
                out.append(mlflow.pytorch.load_model(local)(x).numpy())
        np.testing.assert_array_equal(out[0], out[1])
