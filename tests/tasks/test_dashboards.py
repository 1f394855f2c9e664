"""Dashboards (tasks/dashboards.py): band first, line second, contributors band on every
panel, alerts marked, suppressed rounds are gaps; summary rows and markdown."""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.collections import PolyCollection  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

from tasks.dashboards import (  # noqa: E402
    DashboardHistory,
    artifact_key,
    dashboard_figures,
    publish_dashboards,
    summary_markdown,
    summary_rows,
)


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
        y_south = south.lines[0].get_ydata()
        assert math.isnan(y_south[1])
        # the alert is marked in red at (2, 0.5) on north only
        offsets = [c.get_offsets() for c in north.collections[1:]]
        assert any((o == [[2, 0.5]]).all() for o in offsets)
        assert len(south.collections) == 1
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
