"""The round's story for the operator: what one round did, told on the round's own Prefect
flow run (run logs, a markdown artifact and a table artifact).

Input is what is published anyway (:func:`flows.federation.published_round` and the
round's published evaluation report): participant bands, cohort ids, region names,
released values with their published error bars, release keys and refusal reasons. No
client id and no exact count of clients reaches a log line or an artifact; bands are shown
as the ranges they stand for, from the band and the published cohort floor ``m``
(``minimum_to_under_double`` with m = 5 reads "5–9 clients").

Every planned release appears once, with its outcome: ``published`` (value ± 95 % bar,
contributors band), ``refused`` (the ledger's reason: over the line's epoch cap, over the
lifetime cap, training frozen), ``not released`` (off the regional cadence, nothing to
release: nothing charged); regions below the cohort floor are shown as a band of regions;
each borrow request with its decision (approver, approved or the refusal).
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "RoundStory",
    "band_label",
    "federation_round_line",
    "publish_round_story",
    "region_band_label",
    "release_rows",
    "round_story",
    "story_artifact_key",
]

GLOBAL = "global"

_REGION_BANDS = {"none": "no regions", "1_to_2": "1–2 regions", "3_to_5": "3–5 regions",
                 "6_or_more": "6 or more regions"}

#: Why a planned release was not drawn, in the operator's words.
REASONS = {
    "exceeds_line_cap": "refused: over the budget line's cap for this epoch",
    "exceeds_lifetime_cap": "refused: over the lifetime privacy cap",
    "training_frozen": "refused: the line is frozen for this epoch",
    "off_cadence": "not released: off the regional cadence (nothing charged)",
    "not_charged": "not released: nothing to release (not charged)",
    "no_budget_view": "not released",
}


def band_label(band: str, min_cohort: int) -> str:
    """A participant band (:func:`clma.release.count_band`) as the range it stands for,
    e.g. ``minimum_to_under_double`` with ``min_cohort`` 5 -> ``"5–9 clients"``."""
    m = int(min_cohort)
    labels = {
        "none": "no clients",
        "below_minimum": (f"1–{m - 1} clients (below the floor m = {m})" if m > 2
                          else f"fewer than {m} clients (below the floor m = {m})"),
        "minimum_to_under_double": f"{m}–{2 * m - 1} clients",
        "double_to_under_fourfold": f"{2 * m}–{4 * m - 1} clients",
        "fourfold_or_more": f"{4 * m} or more clients",
    }
    return labels.get(str(band), str(band).replace("_", " "))


def region_band_label(band: str) -> str:
    """A suppressed-regions band (``3_to_5``) as text (``"3–5 regions"``)."""
    return _REGION_BANDS.get(str(band), str(band).replace("_", " "))


def _num(v: Any, digits: int = 3) -> float | None:
    return None if v is None else round(float(v), digits)


def _published_entry(report: Mapping[str, Any], name: str, region: str) -> Mapping | None:
    source = report.get("health", {}) if name.startswith("health.") else report.get("metrics", {})
    rep = source.get(name) or {}
    return rep.get("global") if region == GLOBAL else (rep.get("regions") or {}).get(region)


def _plan_name(name: str, region: str) -> str:
    return f"{'global' if region == GLOBAL else 'regional'}.{name}"


def _refusal(report: Mapping[str, Any], name: str, region: str) -> str:
    """The code of why ``name`` / ``region`` was not drawn (:data:`REASONS`)."""
    info = report.get("budget")
    if not info:
        return "no_budget_view"
    plan = _plan_name(name, region)
    if plan in (info.get("refused") or {}):
        return str(info["refused"][plan])
    if plan in (info.get("off_cadence") or ()):
        return "off_cadence"
    if plan in (info.get("not_charged") or ()):
        return "not_charged"
    return "no_budget_view"


def release_rows(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per planned release of the round: published (rounded value, bar, band) or
    not, with the reason. ``report``: the round's published evaluation report."""
    m = int(report.get("min_cohort", 1))
    rows: list[dict[str, Any]] = []
    for rel in report.get("releases", []):
        pub = _published_entry(report, rel["name"], rel["region"]) or {}
        rows.append({
            "metric": rel["name"], "group": rel["region"], "line": rel["line"],
            "outcome": "published", "reason": "",
            "value": _num(pub.get("value")), "error_bar_95": _num(pub.get("error_bar")),
            "contributors": band_label(pub.get("participant_band", "unknown"), m),
            "epsilon": _num(rel.get("epsilon"), 4),
        })
    for rel in report.get("refused_releases", []):
        code = _refusal(report, rel["name"], rel["region"])
        rows.append({
            "metric": rel["name"], "group": rel["region"], "line": rel["line"],
            "outcome": "refused" if code in ("exceeds_line_cap", "exceeds_lifetime_cap",
                                             "training_frozen") else "not released",
            "reason": code, "value": None, "error_bar_95": None, "contributors": "",
            "epsilon": _num(rel.get("epsilon"), 4),
        })
    return rows


def _borrow_text(b: Mapping[str, Any]) -> str:
    who = b.get("approver") or "no approver"
    if b.get("approved"):
        return (f"borrow for line {b.get('line')} of epoch {b.get('epoch')}: APPROVED by "
                f"{who} (epsilon {_num(b.get('epsilon'), 4)}): {b.get('approver_reason', '')}")
    refusal = str(b.get("refusal") or "refused").replace("_", " ")
    return (f"borrow for line {b.get('line')} of epoch {b.get('epoch')}: DENIED ({refusal}; "
            f"approver: {who})" + (f": {b['approver_reason']}" if b.get("approver_reason") else ""))


@dataclass(frozen=True)
class RoundStory:
    """The round as told to the operator: log ``lines``, ``markdown`` and table ``rows``."""

    round: int
    lines: list[str]
    markdown: str
    rows: list[dict[str, Any]]


def round_story(published: Mapping[str, Any], *, federation: str, min_cohort: int,
                participants_band: str) -> RoundStory:
    """The story of one round from its published record (``published_round``: bands only)
    and ``participants_band`` (:func:`clma.release.count_band` of the participants)."""
    m = int(min_cohort)
    r = int(published["round"])
    lab = lambda band: band_label(band, m)  # noqa: E731
    head = [
        f"participants: {lab(participants_band)} (cohort floor m = {m})",
        f"drift flagged: {lab(published['flagged_clients'])}; quarantined: "
        f"{lab(published['quarantined_clients'])}",
        "cohorts: " + (", ".join(f"{c} ({lab(b)})" for c, b in published["cohorts"].items())
                       or "none"),
    ]
    splits: dict[str, list[str]] = {}
    for child, v in published.get("new_cohorts", {}).items():
        splits.setdefault(str(v["parent"]), []).append(f"{child} ({lab(v['band'])})")
    lines = list(head)
    lines += [f"split: cohort {p} -> {', '.join(ch)}" for p, ch in sorted(splits.items())]
    bands = published["cohorts"]
    lines += [f"merge: cohorts {', '.join(map(str, g['merged']))} -> {g['into']}"
              + (f" ({lab(bands[str(g['into'])])})" if str(g["into"]) in bands else "")
              for g in published.get("merges", [])]
    report = published.get("regional")
    rows: list[dict[str, Any]] = []
    if report:
        rows = release_rows(report)
        for row in rows:
            what = f"release {row['metric']} / {row['group']}"
            if row["outcome"] == "published":
                lines.append(f"{what}: published {row['value']:.3f} ± {row['error_bar_95']:.3f} "
                             f"(95 %, {row['contributors']}, epsilon {row['epsilon']:g})")
            else:
                lines.append(f"{what}: {REASONS.get(row['reason'], row['reason'])} "
                             f"[{row['reason']}; line {row['line']}]")
        lines.append("regions below the cohort floor or not evaluated: "
                     f"{region_band_label(report.get('suppressed_regions_band', 'none'))}")
        lines += [f"region {g}: not evaluated" for g in report.get("not_evaluated", [])]
        lines += [_borrow_text(b) for b in (report.get("budget") or {}).get("borrows", [])]
        lines.append(f"alerts fired: {int(report.get('alerts_fired', 0))}")
    else:
        lines.append("no evaluation this round (off the evaluation cadence or no participants)")
    n_pub = sum(row["outcome"] == "published" for row in rows)
    n_ref = sum(row["outcome"] == "refused" for row in rows)
    n_not = len(rows) - n_pub - n_ref
    md = [f"# {federation}: round {r}", "",
          f"Releases: **{n_pub} published**, **{n_ref} refused**, {n_not} not released.", ""]
    md += [f"- {line}" for line in lines if not line.startswith("release ")]
    if rows:
        md += ["", "| metric | group | outcome | value ± 95% bar | contributors | reason |",
               "|---|---|---|---|---|---|"]
        for row in rows:
            val = (f"{row['value']:.3f} ± {row['error_bar_95']:.3f}"
                   if row["outcome"] == "published" else "—")
            md.append(f"| {row['metric']} | {row['group']} | {row['outcome']} | {val} | "
                      f"{row['contributors']} | {REASONS.get(row['reason'], row['reason'])} |")
    md += ["", "Counts of clients are bands (ranges from the cohort floor m), never counts; "
           "values are differentially private releases."]
    table = [{"round": r, **row, "reason": REASONS.get(row["reason"], row["reason"])}
             for row in rows]
    return RoundStory(r, [f"round {r}: {line}" for line in lines], "\n".join(md) + "\n", table)


def federation_round_line(published: Mapping[str, Any], federation: str) -> str:
    """The federation run's log line for one committed round: its cohorts and how many
    planned releases were published, refused or not released, and where the round's
    story is (the round run's name). Cohort ids and release counts only: no client."""
    r = int(published["round"])
    rows = release_rows(published["regional"]) if published.get("regional") else []
    n_pub = sum(row["outcome"] == "published" for row in rows)
    n_ref = sum(row["outcome"] == "refused" for row in rows)
    cohorts = ", ".join(published["cohorts"]) or "none"
    releases = (f"releases {n_pub} published, {n_ref} refused, {len(rows) - n_pub - n_ref} "
                "not released" if rows else "no evaluation")
    return (f"round {r} committed: cohorts {cohorts}; {releases} (the round's story: run "
            f"{federation}-round-{r})")


def story_artifact_key(federation: str) -> str:
    """Prefect artifact key of the round stories of ``federation`` (lowercase, dashes)."""
    slug = re.sub(r"[^a-z0-9]+", "-", federation.lower()).strip("-") or "federation"
    return f"clma-round-{slug[:40]}-{hashlib.sha256(federation.encode()).hexdigest()[:8]}"


_API_ONLY = logging.getLogger("clma.operator")


def run_logger() -> logging.LoggerAdapter:
    """The Prefect run logger, at INFO also when the console is kept quiet
    (``PREFECT_LOGGING_LEVEL=WARNING``, the ``clma`` default): the story then goes to the
    Prefect API only (the run's logs in the UI), not to the terminal. Outside a flow or
    task run, the ``clma`` logger."""
    from prefect import get_run_logger
    from prefect.exceptions import MissingContextError
    from prefect.logging.handlers import APILogHandler

    try:
        logger = get_run_logger()
    except MissingContextError:  # called outside a run (a flow's .fn, a script)
        return logging.LoggerAdapter(logging.getLogger("clma"), {})
    if logger.isEnabledFor(logging.INFO):
        return logger
    if not _API_ONLY.handlers:
        _API_ONLY.addHandler(APILogHandler())
        _API_ONLY.setLevel(logging.INFO)
        _API_ONLY.propagate = False
    return logging.LoggerAdapter(_API_ONLY, dict(logger.extra or {}))


def publish_round_story(story: RoundStory, federation: str) -> None:
    """Log the story on the current (round) flow run and attach its markdown and table
    artifacts to it."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    log = run_logger()
    for line in story.lines:
        log.info(line)
    key = story_artifact_key(federation)
    desc = f"{federation}: round {story.round}"
    create_markdown_artifact(key=key, markdown=story.markdown, description=desc)
    if story.rows:
        create_table_artifact(key=f"{key}-releases", table=story.rows,
                              description=f"{desc}: every planned release and its outcome")
