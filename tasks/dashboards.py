"""Dashboards of the published evaluation: one figure per metric, one panel per region.

Input is only what was *published* (the regional report of each evaluation round,
``EvaluationOutcome.published``: its ``metrics`` and round-``health`` entries): values, published 95 % error bars, participant bands
and fired alerts -- never exact counts, never client ids. :class:`DashboardHistory` keeps
the published series across rounds (JSON round trip, stored in the durable state so a
resumed federation draws its whole history).

Each figure (``dashboards/<metric>.png``) has one panel per region plus ``global``:

1. the uncertainty band ``value +- error_bar`` is drawn FIRST (``fill_between``, lowest
   z-order), so the eye meets the uncertainty before the number; a release with no
   published neighbour (a single point, which a band cannot show) gets an error bar
   (``errorbar``) instead;
2. the published value as a line with markers SECOND;
3. the contributors band labelled on EVERY panel: the participant band of the LAST
   PUBLISHED release (with its round when a later round was not published), and why the
   latest round was not published when it was not: ``suppressed (floor)`` (the group was
   under the cohort floor), ``refused (budget)`` (the ledger refused the charge),
   ``not released (off cadence)``, ``not evaluated (aggregation aborted)``,
   ``merged into <group>``;
4. alerts marked with a red triangle at the alerted round and value.

Rounds where a region was not published are gaps (NaN), not zeros. A release whose 95 %
interval is as wide as the whole clip range (``2 * error_bar >= clip_high - clip_low``, e.g.
a dropout rate of 0.79 +- 0.9 on [0, 1]: the band covers the whole range) says nothing: it
is a gap, and a panel (region) with nothing else is not drawn (the figure names
it); a metric with no informative release at all gets a notice instead of panels. Round axes have integer
ticks and start at round 1; figures are rendered at :data:`DPI` dots per inch, at least
:data:`MIN_WIDTH_PX` pixels wide.

Outputs per evaluation round (:func:`publish_dashboards`): the PNGs logged to MLflow
(``log_figure``, ``dashboards/<metric>.png``, overwritten: the latest figure holds the
whole history) and written to ``<out>/dashboards/``; a Prefect markdown artifact and a
table artifact (key ``clma-dashboard-<federation>``) with the round's published values,
bars, bands and alerts, so the Prefect UI shows what happened without opening MLflow.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "DashboardHistory",
    "SeriesPoint",
    "artifact_key",
    "dashboard_figures",
    "publish_dashboards",
    "summary_markdown",
    "summary_rows",
]

GLOBAL = "global"
DPI = 150
MIN_WIDTH_PX = 1200
PUBLISHED = "published"
SUPPRESSED = "suppressed (floor)"
REFUSED = "refused (budget)"
OFF_CADENCE = "not released (off cadence)"
ABORTED = "not evaluated (aggregation aborted)"


class SeriesPoint(BaseModel):
    """One published release: round, value, error bar, participant band (None values =
    suppressed / not evaluated that round)."""

    model_config = ConfigDict(extra="forbid")

    round: int
    value: float | None = None
    error_bar: float | None = None
    band: str = "suppressed"
    clip_low: float | None = None
    clip_high: float | None = None
    # why a round has no value (:data:`SUPPRESSED`, :data:`REFUSED`, ...); "" in histories
    # stored before the field existed (read as suppressed)
    status: str = ""

    @property
    def published(self) -> bool:
        return self.value is not None

    @property
    def why_not_published(self) -> str:
        return self.status or SUPPRESSED

    @property
    def uninformative(self) -> bool:
        """The release is noise: its 95 % interval ``value +- error_bar`` is at least as wide
        as the whole clip range (``2 * error_bar >= clip_high - clip_low``), so wherever the
        noise put the value, the clamped band covers (nearly) all of the range."""
        if self.value is None or self.clip_low is None or self.clip_high is None:
            return False
        width = float(self.clip_high) - float(self.clip_low)
        return width > 0 and 2.0 * float(self.error_bar or 0.0) >= width


class DashboardHistory(BaseModel):
    """Published series ``metric -> region -> [points]`` and fired alerts over rounds."""

    model_config = ConfigDict(extra="forbid")

    series: dict[str, dict[str, list[SeriesPoint]]] = Field(default_factory=dict)
    alerts: list[dict[str, Any]] = Field(default_factory=list)
    rounds: list[int] = Field(default_factory=list)

    def add_report(self, report: Mapping[str, Any]) -> None:
        """Add one published regional report (``EvaluationOutcome.published``).

        A round already present is replaced (re-run after a crash: no double points).
        """
        rnd = int(report["round"])
        if rnd in self.rounds:
            self.drop_round(rnd)
        self.rounds.append(rnd)
        self.rounds.sort()
        for name, rep in _published_metrics(report).items():
            regions = dict(rep.get("regions") or {})
            if rep.get("global") is not None:
                regions[GLOBAL] = rep["global"]
            by_region = self.series.setdefault(name, {})
            for region in set(by_region) | set(regions):
                pub = regions.get(region)
                if pub is None or pub.get("value") is None:
                    pt = SeriesPoint(round=rnd, status=_why_missing(report, name, region))
                else:
                    pt = SeriesPoint(round=rnd, value=float(pub["value"]),
                                     error_bar=float(pub.get("error_bar") or 0.0),
                                     band=str(pub.get("participant_band", "unknown")),
                                     clip_low=pub.get("clip_low"),
                                     clip_high=pub.get("clip_high"), status=PUBLISHED)
                by_region.setdefault(region, []).append(pt)
                by_region[region].sort(key=lambda p: p.round)
        for a in report.get("alerts", []):
            self.alerts.append({k: a[k] for k in ("metric", "region", "round", "value")
                                if k in a})

    def drop_round(self, rnd: int) -> None:
        self.rounds = [r for r in self.rounds if r != rnd]
        for by_region in self.series.values():
            for region, pts in by_region.items():
                by_region[region] = [p for p in pts if p.round != rnd]
        self.alerts = [a for a in self.alerts if a.get("round") != rnd]

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DashboardHistory:
        return cls.model_validate(dict(data))


def _published_metrics(report: Mapping[str, Any]) -> dict[str, Any]:
    """Scalar metrics and round-health metrics of a report: name -> {regions, global}."""
    out = dict(report.get("metrics") or {})
    out.update(report.get("health") or {})
    return out


def _why_missing(report: Mapping[str, Any], name: str, region: str) -> str:
    """Why ``name`` has no published value for ``region`` in ``report``: the ledger's view
    (``budget``: refused / off cadence), aborted aggregation, a merge, else the floor."""
    budget = report.get("budget") or {}
    entry = f"{GLOBAL if region == GLOBAL else 'regional'}.{name}"
    if entry in (budget.get("refused") or {}):
        return REFUSED
    if entry in (budget.get("off_cadence") or []):
        return OFF_CADENCE
    if any(r.get("name") == name and r.get("region") == region
           for r in report.get("refused_releases") or []):
        return REFUSED  # planned but not drawn (no ledger view: not approved)
    if region in (report.get("not_evaluated") or []):
        return ABORTED
    for rep in (report.get("metrics") or {}).values():
        for group, members in (rep.get("merged_regions") or {}).items():
            if region != group and region in members:
                return f"merged into {group}"
    return SUPPRESSED


def _contributors_label(pts: Sequence[SeriesPoint]) -> str:
    """The contributors text of a panel: band of the last published release, and why the
    latest round was not published when it was not."""
    if not pts:
        return "contributors: none published"
    latest = pts[-1]
    last_pub = next((p for p in reversed(pts) if p.published), None)
    if latest.published:
        text = f"contributors: {latest.band}"
        if latest.uninformative:
            text += "\n(latest release uninformative: its bar covers the whole range)"
        return text
    head = ("contributors: none published" if last_pub is None
            else f"contributors: {last_pub.band} (round {last_pub.round})")
    return f"{head}\nround {latest.round}: {latest.why_not_published}"


def _regions_order(regions: Sequence[str]) -> list[str]:
    return sorted(r for r in regions if r != GLOBAL) + ([GLOBAL] if GLOBAL in regions else [])


def dashboard_figures(history: DashboardHistory) -> dict[str, Any]:
    """One matplotlib figure per metric (a panel per region; see module docs).

    Returns ``metric -> Figure``; the caller closes them (:func:`publish_dashboards` does).
    A metric whose every release is uninformative (error bar as wide as the clip range)
    gets a notice figure without panels that says so.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.ticker import MaxNLocator

    figs: dict[str, Any] = {}
    last_round = max([1, *history.rounds])
    for name, by_region in sorted(history.series.items()):
        regions, noise_only = [], []
        for region in _regions_order(list(by_region)):
            pts = by_region[region]
            if (any(p.uninformative for p in pts)
                    and not any(p.published and not p.uninformative for p in pts)):
                noise_only.append(region)  # only noise was published: no panel
            else:
                regions.append(region)
        if not regions:  # nothing but noise was published: a notice, no panel
            fig = plt.figure(figsize=(MIN_WIDTH_PX / DPI, 2.2), dpi=DPI)
            fig.text(0.5, 0.5, f"{name}: no informative release to draw\n"
                     "every published 95% error bar is as wide as the whole range "
                     f"({', '.join(noise_only)}): the values are noise", ha="center",
                     va="center", fontsize=10, wrap=True)
            figs[name] = fig
            continue
        ncols = min(3, len(regions))
        nrows = math.ceil(len(regions) / ncols)
        width = max(MIN_WIDTH_PX / DPI, 4.6 * ncols)
        fig, axes = plt.subplots(nrows, ncols, figsize=(width, 3.4 * nrows + 0.9), dpi=DPI,
                                 squeeze=False, sharex=True)
        for ax in axes.flat[len(regions):]:
            ax.set_visible(False)
        for ax, region in zip(axes.flat, regions, strict=False):
            pts = by_region[region]
            shown = [p.published and not p.uninformative for p in pts]
            x = np.array([p.round for p in pts], dtype=float)
            y = np.array([p.value if ok else np.nan for p, ok in zip(pts, shown, strict=True)],
                         dtype=float)
            bar = np.array([float(p.error_bar or 0.0) if ok else np.nan
                            for p, ok in zip(pts, shown, strict=True)], dtype=float)
            # the band is clamped to the metric's clip range, like the envelope's interval
            # (post-processing): an accuracy band never leaves [0, 1]
            lo = np.array([-np.inf if p.clip_low is None else p.clip_low for p in pts])
            hi = np.array([np.inf if p.clip_high is None else p.clip_high for p in pts])
            low, high = np.maximum(y - bar, lo), np.minimum(y + bar, hi)
            # 1. uncertainty band first (drawn below everything else)
            ax.fill_between(x, low, high, color="tab:blue", alpha=0.25, lw=0,
                            zorder=1, label="95% error bar")
            # ... and an error bar where a band cannot show: a release with no published
            # neighbour (a single point)
            alone = [i for i, ok in enumerate(shown) if ok
                     and not (i > 0 and shown[i - 1]) and not (i + 1 < len(shown) and shown[i + 1])]
            if alone:
                idx = np.array(alone)
                ax.errorbar(x[idx], y[idx], yerr=np.vstack([y[idx] - low[idx], high[idx] - y[idx]]),
                            fmt="none", ecolor="tab:blue", elinewidth=1.5, capsize=5,
                            alpha=0.6, zorder=1.5, label="95% error bar (single release)")
            # 2. the published value second
            ax.plot(x, y, color="tab:blue", marker="o", ms=4, lw=1.5, zorder=2,
                    label="published value")
            # 4. alerts
            fired = [a for a in history.alerts if a.get("metric") == name
                     and a.get("region") == region]
            if fired:
                ax.scatter([a["round"] for a in fired], [a["value"] for a in fired],
                           marker="v", s=60, color="tab:red", zorder=3, label="alert")
            # 3. contributors band, on every panel
            ax.text(0.02, 0.96, _contributors_label(pts), transform=ax.transAxes, va="top",
                    fontsize=7, bbox={"boxstyle": "round", "fc": "white", "alpha": 0.8},
                    zorder=4)
            finite_lo = [p.clip_low for p in pts if p.clip_low is not None]
            finite_hi = [p.clip_high for p in pts if p.clip_high is not None]
            if finite_lo and finite_hi and np.isfinite(y).any():
                c_lo, c_hi = min(finite_lo), max(finite_hi)
                pad = 0.05 * (c_hi - c_lo) if c_hi > c_lo else 0.05
                y0, y1 = ax.get_ylim()
                ax.set_ylim(max(y0, c_lo - pad), min(y1, c_hi + pad))
            ax.set_title(f"{name} - {region}", fontsize=9)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
        for ax in axes.flat:  # shared: integer rounds from 1
            ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
            ax.set_xlim(0.5, last_round + 0.5)
        for ax in axes[-1]:
            ax.set_xlabel("round", fontsize=8)
        axes.flat[0].legend(fontsize=6, loc="lower right")
        title = (f"{name}: published value with its 95% error band\n"
                 "(contributors band per panel; alerts in red)")
        if noise_only:
            title += ("\nnot drawn, only noise published (95% error bar covers the whole "
                      f"range): {', '.join(noise_only)}")
        fig.suptitle(title, fontsize=9)
        fig.tight_layout()
        figs[name] = fig
    return figs


def summary_rows(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Table rows of one published report: metric, region, value, error bar, band, alert."""
    alerted = {(a["metric"], a["region"]) for a in report.get("alerts", [])}
    rows: list[dict[str, Any]] = []
    for name, rep in sorted(_published_metrics(report).items()):
        regions = dict(rep.get("regions") or {})
        if rep.get("global") is not None:
            regions[GLOBAL] = rep["global"]
        for region in _regions_order(list(regions)):
            pub = regions[region]
            rows.append({
                "round": int(report["round"]), "metric": name, "region": region,
                "value": round(float(pub["value"]), 4),
                "error_bar_95": round(float(pub.get("error_bar") or 0.0), 4),
                "contributors_band": str(pub.get("participant_band", "unknown")),
                "alert": (name, region) in alerted,
            })
    return rows


def summary_markdown(report: Mapping[str, Any], federation: str) -> str:
    """Markdown summary of one evaluation round (Prefect UI): bands as the ranges they
    stand for, values rounded, and how many planned releases were not drawn (their reasons
    are in the round run's own story, :mod:`tasks.story`)."""
    from tasks.story import band_label, region_band_label, release_rows

    rows = summary_rows(report)
    m = int(report.get("min_cohort", 1))
    planned = release_rows(report)
    n_pub = sum(r["outcome"] == "published" for r in planned)
    n_ref = sum(r["outcome"] == "refused" for r in planned)
    lines = [f"# {federation}: round {int(report['round'])}", "",
             f"Releases: {n_pub} published, {n_ref} refused, {len(planned) - n_pub - n_ref} "
             "not released; alerts fired: "
             f"{int(report.get('alerts_fired', len(report.get('alerts', []))))}; "
             "regions below the cohort floor or not evaluated: "
             f"{region_band_label(report.get('suppressed_regions_band', 'none'))}.", "",
             "| metric | region | value ± 95% bar | contributors | alert |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['metric']} | {r['region']} | {r['value']:.3f} ± "
                     f"{r['error_bar_95']:.3f} | {band_label(r['contributors_band'], m)} | "
                     f"{'**ALERT**' if r['alert'] else ''} |")
    lines += ["", f"Values are differentially private releases (noise once on the secure "
              f"aggregate); contributors are bands from the cohort floor m = {m}, never "
              "counts."]
    return "\n".join(lines) + "\n"


def artifact_key(federation: str) -> str:
    """Prefect artifact key: lowercase letters, digits and dashes."""
    slug = re.sub(r"[^a-z0-9]+", "-", federation.lower()).strip("-") or "federation"
    return f"clma-dashboard-{slug[:40]}-{hashlib.sha256(federation.encode()).hexdigest()[:8]}"


def render_dashboard_files(history: Mapping[str, Any], folder: str) -> dict[str, str]:
    """Draw :func:`dashboard_figures` of ``history`` (:meth:`DashboardHistory.to_dict`) to
    ``folder/<metric>.png`` at :data:`DPI`; returns ``metric -> path``. A plain function of
    JSON data, so a worker process can run it (:class:`DashboardRenderer`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figs = dashboard_figures(DashboardHistory.from_dict(dict(history)))
    out: dict[str, str] = {}
    try:
        base = Path(folder)
        base.mkdir(parents=True, exist_ok=True)
        for name, fig in figs.items():
            path = base / f"{name}.png"
            fig.savefig(path, dpi=DPI)  # rendered once, the same file goes to MLflow
            out[name] = str(path)
    finally:
        for fig in figs.values():
            plt.close(fig)
    return out


def _warm_up() -> None:
    """Import the drawing stack in the worker (its one-time start-up)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401


class DashboardRenderer:
    """Draws the dashboard PNGs in one worker process, off the round's critical path (and
    runs other jobs there: the cohort models' export, :meth:`submit_job`).

    Drawing the figures of one evaluation round costs about 2 s of CPU (matplotlib: layout,
    rasterisation, PNG); in a worker process it runs on another core while the next round
    trains, and its CPU time still counts as the federation's (a child process). The flow
    keeps the order: :meth:`submit` first waits for the previous drawing and logs its PNGs
    (at most one drawing is pending; evaluation rounds are rounds apart, so it is done
    by then), :meth:`wait` logs a pending drawing (the session calls it before a durable
    commit and at the end of the flow run), :meth:`close` waits and stops the worker.
    An error while drawing is raised by the :meth:`wait` that collects it; a worker that
    cannot start or dies (``BrokenProcessPool``) makes :meth:`wait` draw in the calling
    thread instead, then and for later rounds.

    What a crash can lose: the PNGs of the latest evaluation round when the process dies
    while they are drawn (at most one round's; without a state dir there is no resume,
    and with one the commit of that round waits for them, see
    :meth:`tasks.durable.FederationSession.round_done`). The published history itself
    (``DashboardHistory``) is updated synchronously.

    ``processes=False`` draws in the calling thread at :meth:`submit` (no worker).
    """

    def __init__(self, *, processes: bool = True) -> None:
        self.processes = processes
        self._pool: Any = None
        self._pending: tuple[Any, Any, Any, str] | None = None  # (job, tracker, doc, folder)
        self._tmp: Any = None
        self._closed = False

    def start(self) -> None:
        """Start the worker process and import matplotlib there (one-time start-up)."""
        if not self.processes or self._pool is not None:
            return
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        # spawn: the flow's process has threads (Prefect, MLflow); fork would copy their
        # locks in whatever state they are
        self._pool = ProcessPoolExecutor(max_workers=1,
                                         mp_context=multiprocessing.get_context("spawn"))
        self._pool.submit(_warm_up)

    def submit_job(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` (a module-level function of picklable data) in the worker
        process, after the jobs before it; returns its ``concurrent.futures.Future``, or
        None when there is no worker (``processes=False``, closed, or it could not start):
        the caller then runs ``fn`` itself. Used for the cohort models' export
        (:meth:`tasks.lineage.CohortLineageTracker.collect`)."""
        if not self.processes or self._closed:
            return None
        from concurrent.futures.process import BrokenProcessPool

        self.start()
        try:
            return self._pool.submit(fn, *args)
        except BrokenProcessPool:
            return None

    def scratch(self) -> Path:
        """A folder for PNGs when the run has no out folder (removed by :meth:`close`)."""
        import tempfile

        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="clma-dashboards-")
        return Path(self._tmp.name)

    def submit(self, history: DashboardHistory, folder: Path, tracker: Any = None
               ) -> dict[str, str]:
        """Draw ``history`` into ``folder``; the PNGs go to ``tracker``'s run
        (``dashboards/<metric>.png``) when collected. Returns ``metric -> path`` when
        drawn here (``processes=False``), else ``{}``."""
        self.wait()
        doc = history.to_dict()
        if self.processes:
            from concurrent.futures.process import BrokenProcessPool

            self.start()
            try:
                job = self._pool.submit(render_dashboard_files, doc, str(folder))
            except BrokenProcessPool:  # see wait()
                job = None
            self._pending = (job, tracker, doc, str(folder))
            return {}
        self._pending = (render_dashboard_files(doc, str(folder)), tracker, doc, str(folder))
        return self.wait()

    def wait(self) -> dict[str, str]:
        """Collect the pending drawing (if any): wait for it and log its PNGs; returns
        ``metric -> path`` (empty when nothing was pending)."""
        if self._pending is None:
            return {}
        from concurrent.futures.process import BrokenProcessPool

        job, tracker, doc, folder = self._pending
        self._pending = None
        try:
            paths = job if isinstance(job, dict) else job.result() if job else None
        except BrokenProcessPool:  # the worker could not start (e.g. a __main__ script
            paths = None  # without a main guard, which spawn re-imports) or died
        if paths is None:  # draw here instead, and from now on
            self.processes = False
            paths = render_dashboard_files(doc, folder)
        if tracker is not None and getattr(tracker, "run_id", None):
            for path in paths.values():
                tracker.client.log_artifact(tracker.run_id, path, "dashboards")
        return paths

    def close(self) -> None:
        """Wait for a pending drawing, stop the worker and remove the scratch folder."""
        self._closed = True
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
            if self._tmp is not None:
                self._tmp.cleanup()
                self._tmp = None


def publish_dashboards(history: DashboardHistory, report: Mapping[str, Any], *,
                       federation: str, tracker: Any = None, out_dir: str | None = None,
                       prefect_artifacts: bool = True,
                       renderer: DashboardRenderer | None = None) -> dict[str, Path | None]:
    """Add ``report`` to ``history`` and publish the dashboards (see module docs).

    ``renderer``: draw the PNGs there (:class:`DashboardRenderer`, asynchronous; returns
    ``{}`` at once, the PNGs are logged when it collects them); None: draw them here.
    Returns ``metric -> PNG path`` (None when no out folder was given).
    """
    history.add_report(report)
    if renderer is not None:
        folder = Path(out_dir) / "dashboards" if out_dir else renderer.scratch()
        renderer.submit(history, folder, tracker)
        written: dict[str, Path | None] = {}
    else:
        sync = DashboardRenderer(processes=False)
        try:
            folder = Path(out_dir) / "dashboards" if out_dir else sync.scratch()
            paths = sync.submit(history, folder, tracker)  # draws and logs at once
            written = {name: Path(p) if out_dir else None for name, p in paths.items()}
        finally:
            sync.close()
    if prefect_artifacts:
        from prefect.artifacts import create_markdown_artifact, create_table_artifact

        key = artifact_key(federation)
        rnd = int(report["round"])
        create_markdown_artifact(key=key, markdown=summary_markdown(report, federation),
                                 description=f"Published evaluation, round {rnd}")
        create_table_artifact(key=f"{key}-table", table=summary_rows(report),
                              description=f"Published evaluation, round {rnd}")
    return written
