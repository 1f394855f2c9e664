"""Dashboards (tasks/dashboards.py): band first, line second, contributors band on every
panel, alerts marked, suppressed rounds are gaps; summary rows and markdown."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.collections import LineCollection, PathCollection, PolyCollection  # noqa: E402
from matplotlib.container import ErrorbarContainer  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

from tasks.dashboards import (  # noqa: E402
    DashboardHistory,
    DashboardRenderer,
    artifact_key,
    dashboard_figures,
    publish_dashboards,
    summary_markdown,
    summary_rows,
)


def _value_line(ax):
    return next(ln for ln in ax.lines if ln.get_label() == "published value")


def _errorbar_segments(ax):
    """(x, low, high) of every error bar drawn on ``ax`` (ErrorbarContainer objects)."""
    out = []
    for cont in ax.containers:
        if isinstance(cont, ErrorbarContainer):
            for coll in cont.lines[2]:
                assert isinstance(coll, LineCollection)
                for seg in coll.get_segments():
                    (x0, y0), (_, y1) = seg
                    out.append((round(float(x0), 6), round(float(min(y0, y1)), 6),
                                round(float(max(y0, y1)), 6)))
    return sorted(out)


def _pub(v, bar, band="double_to_under_fourfold"):
    return {"value": v, "error_bar": bar, "participant_band": band}


def _report(rnd, north, south=None, alerts=()):
    regions = {"north": _pub(*north)}
    if south is not None:
        regions["south"] = _pub(*south)
    return {"round": rnd, "metrics": {"accuracy": {"regions": regions,
                                                   "global": _pub(0.8, 0.01, "fourfold_or_more")}},
            "alerts": [dict(a) for a in alerts], "alerts_fired": len(alerts),
            "suppressed_regions_band": "none"}


@pytest.fixture
def history():
    h = DashboardHistory()
    h.add_report(_report(1, (0.9, 0.05), (0.7, 0.1)))
    h.add_report(_report(2, (0.5, 0.05), None,  # south suppressed in round 2
                         alerts=[{"metric": "accuracy", "region": "north", "round": 2,
                                  "value": 0.5}]))
    h.add_report(_report(3, (0.55, 0.04), (0.72, 0.1, "minimum_to_under_double")))
    return h


def test_history_keeps_gaps_and_replaces_a_rerun_round(history):
    south = history.series["accuracy"]["south"]
    assert [(p.round, p.value) for p in south] == [(1, 0.7), (2, None), (3, 0.72)]
    history.add_report(_report(3, (0.6, 0.04), (0.7, 0.1)))  # re-run of round 3
    north = history.series["accuracy"]["north"]
    assert [(p.round, p.value) for p in north] == [(1, 0.9), (2, 0.5), (3, 0.6)]
    assert history.rounds == [1, 2, 3]
    assert DashboardHistory.from_dict(history.to_dict()) == history


def test_figure_draws_band_first_line_second_band_label_and_alerts(history):
    figs = dashboard_figures(history)
    try:
        fig = figs["accuracy"]
        panels = [ax for ax in fig.axes if ax.get_visible()]
        assert [ax.get_title() for ax in panels] == [
            "accuracy - north", "accuracy - south", "accuracy - global"]
        for ax in panels:
            children = ax.get_children()
            band = next(i for i, c in enumerate(children) if isinstance(c, PolyCollection))
            line = next(i for i, c in enumerate(children)
                        if isinstance(c, Line2D) and c.get_label() == "published value")
            assert band < line
            poly = children[band]
            line_art = children[line]
            assert poly.get_zorder() < line_art.get_zorder()
            texts = [t.get_text() for t in ax.texts]
            assert any(t.startswith("contributors: ") for t in texts)
        north, south, glob = panels
        assert "contributors: double_to_under_fourfold" in [t.get_text() for t in north.texts]
        assert "contributors: minimum_to_under_double" in [t.get_text() for t in south.texts]
        assert "contributors: fourfold_or_more" in [t.get_text() for t in glob.texts]
        # band edges = value -/+ error bar at round 1 of north
        verts = north.collections[0].get_paths()[0].vertices
        ys = sorted({round(float(y), 6) for y in verts[:, 1]})
        assert ys == [0.45, 0.51, 0.55, 0.59, 0.85, 0.95]  # value -/+ bar, rounds 1-3
        # suppressed round is a gap in the line
        y_south = _value_line(south).get_ydata()
        assert math.isnan(y_south[1])
        # the alert is marked in red at (2, 0.5) on north only
        offsets = [c.get_offsets() for c in north.collections[1:]
                   if isinstance(c, PathCollection)]
        assert any((o == [[2, 0.5]]).all() for o in offsets)
        assert not [c for c in south.collections if isinstance(c, PathCollection)]
        # south's releases (rounds 1 and 3) have no published neighbour: error bars
        assert _errorbar_segments(south) == [(1.0, 0.6, 0.8), (3.0, 0.62, 0.82)]
        assert _errorbar_segments(north) == []  # a continuous band
    finally:
        for f in figs.values():
            plt.close(f)


def test_summary_rows_and_markdown_have_bands_not_counts():
    rep = _report(4, (0.5, 0.05), (0.7, 0.1),
                  alerts=[{"metric": "accuracy", "region": "south", "round": 4, "value": 0.7}])
    rows = summary_rows(rep)
    assert [(r["region"], r["alert"]) for r in rows] == [
        ("north", False), ("south", True), ("global", False)]
    assert rows[0] == {"round": 4, "metric": "accuracy", "region": "north", "value": 0.5,
                       "error_bar_95": 0.05, "contributors_band": "double_to_under_fourfold",
                       "alert": False}
    md = summary_markdown({**rep, "min_cohort": 5}, "fed-a")
    assert "| accuracy | south | 0.700 ± 0.100 | 10–19 clients | **ALERT** |" in md
    assert "double_to_under_fourfold" not in md and "from the cohort floor m = 5" in md
    assert "contributors" in md and "count" not in md.replace("counts", "")


def test_publish_writes_nonempty_pngs(tmp_path, history):
    out = publish_dashboards(history, _report(5, (0.6, 0.05), (0.7, 0.1)), federation="f",
                             out_dir=str(tmp_path), prefect_artifacts=False)
    png = out["accuracy"]
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


class _Client:
    def __init__(self):
        self.logged = []

    def log_artifact(self, run_id, path, artifact_path):
        self.logged.append((run_id, Path(path).name, artifact_path, Path(path).read_bytes()))


class _Tracker:
    run_id = "run-1"

    def __init__(self):
        self.client = _Client()


def test_worker_process_draws_the_same_pngs_and_logs_them_when_collected(tmp_path, history):
    """The renderer's worker process writes byte-identical PNGs to drawing them here, and
    they reach the MLflow run only when collected (wait), never twice."""
    here = publish_dashboards(history, _report(5, (0.6, 0.05), (0.7, 0.1)), federation="f",
                              out_dir=str(tmp_path / "here"), prefect_artifacts=False)
    h2 = DashboardHistory.from_dict(history.to_dict())
    h2.drop_round(5)
    renderer, tracker = DashboardRenderer(), _Tracker()
    try:
        out = publish_dashboards(h2, _report(5, (0.6, 0.05), (0.7, 0.1)), federation="f",
                                 out_dir=str(tmp_path / "worker"), prefect_artifacts=False,
                                 tracker=tracker, renderer=renderer)
        assert out == {} and tracker.client.logged == []  # drawn off the calling thread
        paths = renderer.wait()
        assert sorted(paths) == sorted(here) == ["accuracy"]
        assert [(r, n, a) for r, n, a, _ in tracker.client.logged] == [
            ("run-1", "accuracy.png", "dashboards")]
        assert tracker.client.logged[0][3] == here["accuracy"].read_bytes()
        assert renderer.wait() == {}  # collected once
    finally:
        renderer.close()
    assert renderer._pool is None


def test_a_drawing_error_is_raised_when_collected(tmp_path, history):
    """An error in the worker (here: the PNG folder is a file) surfaces at collection."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    renderer = DashboardRenderer()
    try:
        renderer.submit(history, blocker, _Tracker())
        with pytest.raises(OSError):
            renderer.wait()
        assert renderer.wait() == {}  # nothing pending after the error
    finally:
        renderer.close()


def test_a_dead_worker_falls_back_to_drawing_in_the_calling_thread(tmp_path, history):
    """A worker that dies (BrokenProcessPool) does not lose the round's dashboards: they
    are drawn in the calling thread, logged once, and later rounds are drawn there too."""
    import os
    import signal
    import time

    renderer, tracker = DashboardRenderer(), _Tracker()
    try:
        renderer.start()
        renderer._pool.submit(int).result()  # the worker is up
        for pid in list(renderer._pool._processes):
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)
        renderer.submit(history, tmp_path / "d", tracker)
        paths = renderer.wait()
        assert sorted(paths) == ["accuracy"] and Path(paths["accuracy"]).stat().st_size > 5000
        assert [n for _, n, _, _ in tracker.client.logged] == ["accuracy.png"]
        assert renderer.processes is False
    finally:
        renderer.close()


def test_artifact_key_is_prefect_safe():
    k = artifact_key("My Fed_v1.2")
    assert k.startswith("clma-dashboard-my-fed-v1-2-")
    assert set(k) <= set("abcdefghijklmnopqrstuvwxyz0123456789-")


def test_band_is_clamped_to_the_clip_range():
    h = DashboardHistory()
    near_top = {"value": 0.95, "error_bar": 0.3, "participant_band": "fourfold_or_more",
                "clip_low": 0.0, "clip_high": 1.0}
    near_bottom = {"value": 0.1, "error_bar": 0.3, "participant_band": "fourfold_or_more",
                   "clip_low": 0.0, "clip_high": 1.0}
    for rnd, pub in ((1, near_top), (2, near_bottom)):
        h.add_report({"round": rnd, "metrics": {"accuracy": {"regions": {"north": pub}}},
                      "alerts": [], "alerts_fired": 0, "suppressed_regions_band": "none"})
    figs = dashboard_figures(h)
    try:
        ax = next(a for a in figs["accuracy"].axes if a.get_title() == "accuracy - north")
        ys = sorted({round(float(y), 6) for y in ax.collections[0].get_paths()[0].vertices[:, 1]})
        assert ys == [0.0, 0.4, 0.65, 1.0]  # clamped at 0 and 1, not -0.2 and 1.25
    finally:
        for f in figs.values():
            plt.close(f)


# ------------------------------------------------------------------ issue 14 item 3
# Image tests: assertions on the matplotlib Axes; every figure is also written as a PNG to
# a kept folder (pytest's tmp dir, or $CLMA_TEST_ARTEFACTS when set) to look at.

import os  # noqa: E402
import struct  # noqa: E402

from tasks.dashboards import DPI, MIN_WIDTH_PX, REFUSED, SUPPRESSED  # noqa: E402


@pytest.fixture(scope="module")
def artefacts(tmp_path_factory):
    env = os.environ.get("CLMA_TEST_ARTEFACTS")
    if env:
        p = Path(env) / "dashboards"
        p.mkdir(parents=True, exist_ok=True)
        return p
    return tmp_path_factory.mktemp("dashboard-png")


def _keep(figs, folder, tag):
    for name, fig in figs.items():
        fig.savefig(folder / f"{tag}-{name}.png", dpi=DPI)


def _acc(v, bar, band="fourfold_or_more"):
    return {"value": v, "error_bar": bar, "participant_band": band,
            "clip_low": 0.0, "clip_high": 1.0}


def _rep(rnd, regions, glob=None, budget=None, health=None, **extra):
    rep = {"round": rnd, "metrics": {"accuracy": {"regions": regions}}, "alerts": [],
           "alerts_fired": 0, "suppressed_regions_band": "none", **extra}
    if glob is not None:
        rep["metrics"]["accuracy"]["global"] = glob
    if budget is not None:
        rep["budget"] = budget
    if health is not None:
        rep["health"] = {"health.dropout_rate": health}
    return rep


def _panel(fig, title):
    return next(a for a in fig.axes if a.get_visible() and a.get_title() == title)


def _label(ax):
    return next(t.get_text() for t in ax.texts if t.get_text().startswith("contributors: "))


def _visible_xticks(ax):
    lo, hi = ax.get_xlim()
    return [float(t) for t in ax.get_xticks() if lo <= t <= hi]


def _png_size(path):
    head = Path(path).read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_single_published_point_has_an_error_bar_and_integer_round_axis(artefacts):
    h = DashboardHistory()
    h.add_report(_rep(1, {"north": _acc(1.0, 0.04)}))
    figs = dashboard_figures(h)
    try:
        _keep(figs, artefacts, "single-point")
        ax = _panel(figs["accuracy"], "accuracy - north")
        conts = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
        assert len(conts) == 1  # the lone release is drawn with its error bar
        assert _errorbar_segments(ax) == [(1.0, 0.96, 1.0)]  # clamped at the clip high
        lo, hi = ax.get_ylim()
        assert lo <= 0.96 and hi >= 1.0 and hi <= 1.05 + 1e-9  # the bar is inside the view
        # rounds are integers, the axis starts at round 1
        loc = ax.xaxis.get_major_locator()
        assert isinstance(loc, matplotlib.ticker.MaxNLocator) and loc._integer
        assert ax.get_xlim() == (0.5, 1.5)
        assert _visible_xticks(ax) == [1.0]
    finally:
        for f in figs.values():
            plt.close(f)


def test_round_ticks_are_integers_over_many_rounds(artefacts):
    h = DashboardHistory()
    for r in range(1, 8):
        h.add_report(_rep(r, {"north": _acc(0.8 + 0.01 * r, 0.05)}))
    figs = dashboard_figures(h)
    try:
        _keep(figs, artefacts, "seven-rounds")
        ax = _panel(figs["accuracy"], "accuracy - north")
        ticks = _visible_xticks(ax)
        assert ticks and all(t == int(t) for t in ticks) and min(ticks) >= 1
        assert not [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    finally:
        for f in figs.values():
            plt.close(f)


def test_label_is_from_the_last_published_point_refused_vs_suppressed(artefacts):
    h = DashboardHistory()
    h.add_report(_rep(1, {"north": _acc(0.9, 0.1)}))  # west not published yet (floor)
    for r in range(2, 7):  # west published as minimum_to_under_double in rounds 2-6
        h.add_report(_rep(r, {"north": _acc(0.9, 0.1),
                              "west": _acc(0.7, 0.2, "minimum_to_under_double")}))
    h.add_report(_rep(7, {"north": _acc(0.9, 0.1)}))  # west under the floor in round 7
    # round 8: the ledger refused the regional accuracy entry (budget), global published
    h.add_report(_rep(8, {}, glob=_acc(0.85, 0.05),
                      budget={"refused": {"regional.accuracy": "exceeds_line_cap"},
                              "off_cadence": [], "released": ["global.accuracy"]}))
    figs = dashboard_figures(h)
    try:
        _keep(figs, artefacts, "refused-vs-suppressed")
        fig = figs["accuracy"]
        west, north, glob = (_panel(fig, f"accuracy - {r}") for r in ("west", "north", "global"))
        assert _label(west) == ("contributors: minimum_to_under_double (round 6)\n"
                                f"round 8: {REFUSED}")
        assert _label(north) == ("contributors: fourfold_or_more (round 7)\n"
                                 "round 8: refused (budget)")
        assert _label(glob) == "contributors: fourfold_or_more"
        pts = {p.round: p for p in h.series["accuracy"]["west"]}
        assert pts[7].status == SUPPRESSED == "suppressed (floor)"
        assert pts[8].status == "refused (budget)" and min(pts) == 2
        assert "suppressed" not in _label(west)
    finally:
        for f in figs.values():
            plt.close(f)
    # a region under the floor in the latest round says so, distinct from a refusal
    h2 = DashboardHistory()
    h2.add_report(_rep(1, {"north": _acc(0.9, 0.1), "west": _acc(0.7, 0.2, "minimum_to_under_double")}))
    h2.add_report(_rep(2, {"north": _acc(0.9, 0.1)}))
    figs = dashboard_figures(h2)
    try:
        west = _panel(figs["accuracy"], "accuracy - west")
        assert _label(west) == ("contributors: minimum_to_under_double (round 1)\n"
                                "round 2: suppressed (floor)")
    finally:
        for f in figs.values():
            plt.close(f)


def test_other_reasons_off_cadence_aborted_and_merged():
    h = DashboardHistory()
    h.add_report(_rep(1, {"west": _acc(0.7, 0.2), "south": _acc(0.6, 0.2),
                          "islands": _acc(0.5, 0.2)}))
    h.add_report(_rep(2, {}, budget={"refused": {}, "off_cadence": ["regional.accuracy"]}))
    h.add_report(_rep(3, {"islands+west": _acc(0.7, 0.2)}, not_evaluated=["south"]))
    h.series["accuracy"]["islands+west"][0]  # created at round 3
    st = {r: [p.status for p in pts] for r, pts in h.series["accuracy"].items()}
    assert st["west"][1] == "not released (off cadence)"
    assert st["south"][2] == "not evaluated (aggregation aborted)"
    rep = _rep(4, {"islands+west": _acc(0.7, 0.2)})
    rep["metrics"]["accuracy"]["merged_regions"] = {"islands+west": ["islands", "west"]}
    h.add_report(rep)
    assert h.series["accuracy"]["west"][-1].status == "merged into islands+west"
    # a history stored before statuses existed still loads (read as suppressed)
    old = {"series": {"accuracy": {"north": [{"round": 1, "value": None, "error_bar": None,
                                              "band": "suppressed"}]}},
           "alerts": [], "rounds": [1]}
    assert DashboardHistory.from_dict(old).series["accuracy"]["north"][0].why_not_published \
        == SUPPRESSED


def test_figures_are_readable_resolution(tmp_path, artefacts, history):
    out = publish_dashboards(history, _report(4, (0.6, 0.05), (0.7, 0.1)), federation="f",
                             out_dir=str(tmp_path), prefect_artifacts=False)
    w, h = _png_size(out["accuracy"])
    assert w >= MIN_WIDTH_PX and h >= 500
    (artefacts / "published-accuracy.png").write_bytes(out["accuracy"].read_bytes())
    # one panel is as wide too
    one = DashboardHistory()
    one.add_report(_rep(1, {}, glob=_acc(0.9, 0.05)))
    figs = dashboard_figures(one)
    try:
        fig = figs["accuracy"]
        assert fig.get_size_inches()[0] * fig.dpi >= MIN_WIDTH_PX and fig.dpi == DPI
    finally:
        for f in figs.values():
            plt.close(f)


def _noise(v=0.79):
    return {"value": v, "error_bar": 0.9, "participant_band": "fourfold_or_more",
            "clip_low": 0.0, "clip_high": 1.0}


def test_health_panel_of_pure_noise_is_not_drawn(tmp_path, artefacts):
    h = DashboardHistory()
    for r, v in ((1, 0.79), (2, 0.1), (3, 0.5)):
        h.add_report(_rep(r, {"north": _acc(0.9, 0.1)}, glob=_acc(0.9, 0.05),
                          health={"regions": {"north": _noise(v)}, "global": _noise(v / 2)}))
    figs = dashboard_figures(h)
    try:
        _keep(figs, artefacts, "health-noise")
        fig = figs["health.dropout_rate"]
        assert fig.axes == []  # every release is as wide as [0, 1]: no panel, a notice
        text = " ".join(t.get_text() for t in fig.texts)
        assert "no informative release" in text and "north, global" in text
        assert fig.get_size_inches()[0] * fig.dpi >= MIN_WIDTH_PX
        assert [a.get_title() for a in figs["accuracy"].axes if a.get_visible()] == [
            "accuracy - north", "accuracy - global"]
    finally:
        for f in figs.values():
            plt.close(f)
    out = publish_dashboards(h, _rep(4, {"north": _acc(0.9, 0.1)},
                                     health={"regions": {"north": _noise()}}),
                             federation="f", out_dir=str(tmp_path), prefect_artifacts=False)
    assert _png_size(out["health.dropout_rate"])[0] >= MIN_WIDTH_PX


def test_health_panel_is_honest_when_partly_informative(artefacts):
    h = DashboardHistory()
    good = {"value": 0.02, "error_bar": 0.03, "participant_band": "fourfold_or_more",
            "clip_low": 0.0, "clip_high": 1.0}
    for r in (1, 2, 3):
        h.add_report(_rep(r, {"north": _acc(0.9, 0.1)},
                          health={"regions": {"north": _noise(), "south": _noise(0.3)},
                                  "global": good if r != 2 else _noise()}))
    figs = dashboard_figures(h)
    try:
        _keep(figs, artefacts, "health-partly")
        fig = figs["health.dropout_rate"]
        titles = [a.get_title() for a in fig.axes if a.get_visible()]
        assert titles == ["health.dropout_rate - global"]  # noise-only regions: no panel
        assert "north, south" in fig._suptitle.get_text()
        ax = fig.axes[0]
        y = _value_line(ax).get_ydata()
        assert y[0] == 0.02 and math.isnan(y[1]) and y[2] == 0.02  # noise is a gap
        # the drawn band is the honest one: [0, 0.05], never the whole [0, 1]
        assert _errorbar_segments(ax) == [(1.0, 0.0, 0.05), (3.0, 0.0, 0.05)]
        assert ax.get_ylim()[1] < 0.5
    finally:
        for f in figs.values():
            plt.close(f)
