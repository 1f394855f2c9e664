"""The round's story (tasks/story.py): every planned release with its outcome and reason,
bands as the ranges they stand for, values rounded, no raw enum text."""

from __future__ import annotations

from tasks.story import (
    band_label,
    federation_round_line,
    region_band_label,
    round_story,
    story_artifact_key,
)


def _pub(value, bar, band="minimum_to_under_double"):
    return {"value": value, "error_bar": bar, "participant_band": band}


def _rel(name, region, line, eps=0.1):
    return {"name": name, "region": region, "line": line, "epsilon": eps, "delta": None,
            "round": 3, "key": f"3:{name}:{region}", "mechanism": "laplace"}


def _published_round():
    report = {
        "round": 3, "min_cohort": 5,
        "metrics": {"accuracy": {"regions": {}, "global": None},
                    "mean_loss": {"regions": {}, "global": None}},
        "health": {"health.dropout_rate": {"regions": {},
                                           "global": _pub(3.3000000000000003, 0.123456)}},
        "releases": [_rel("health.dropout_rate", "global", "evaluation.global",
                          0.05000000000000001)],
        "refused_releases": [_rel("accuracy", "global", "evaluation.global"),
                             _rel("mean_loss", "global", "evaluation.global"),
                             _rel("accuracy", "west", "evaluation.regional")],
        "budget": {"released": ["global.health.dropout_rate"], "republished": [],
                   "refused": {"global.accuracy": "exceeds_line_cap",
                               "global.mean_loss": "exceeds_line_cap"},
                   "off_cadence": ["regional.accuracy"], "not_charged": [],
                   "borrows": [{"epoch": 0, "line": "evaluation.global", "epsilon": 0.5,
                                "approved": False, "refusal": "denied", "approver": "alice",
                                "approver_reason": "not this quarter"}]},
        "suppressed_regions_band": "3_to_5", "not_evaluated": [], "alerts_fired": 0,
    }
    return {"round": 3, "cohorts": {"0": "minimum_to_under_double", "1": "below_minimum",
                                    "2": "below_minimum"},
            "flagged_clients": "minimum_to_under_double",
            "quarantined_clients": "minimum_to_under_double",
            "new_cohorts": {"1": {"parent": 0, "band": "below_minimum"},
                            "2": {"parent": 0, "band": "below_minimum"}},
            "merges": [], "regional": report}


def test_band_labels_are_ranges_from_the_floor():
    assert band_label("minimum_to_under_double", 5) == "5–9 clients"
    assert band_label("double_to_under_fourfold", 5) == "10–19 clients"
    assert band_label("fourfold_or_more", 5) == "20 or more clients"
    assert band_label("below_minimum", 5) == "1–4 clients (below the floor m = 5)"
    assert band_label("none", 5) == "no clients"
    assert region_band_label("3_to_5") == "3–5 regions"


def test_story_tells_refusals_with_reasons_bands_and_rounded_values():
    story = round_story(_published_round(), federation="fed-a", min_cohort=5,
                        participants_band="double_to_under_fourfold")
    text = "\n".join(story.lines) + story.markdown
    assert "Releases: **1 published**, **2 refused**, 1 not released." in story.markdown
    assert "round 3: participants: 10–19 clients (cohort floor m = 5)" in story.lines
    assert "round 3: drift flagged: 5–9 clients; quarantined: 5–9 clients" in story.lines
    assert any("split: cohort 0 -> 1 (1–4 clients" in line for line in story.lines)
    assert any(line.startswith("round 3: release accuracy / global: refused: over the budget "
                               "line's cap") and "exceeds_line_cap" in line
               for line in story.lines)
    assert any("accuracy / west: not released: off the regional cadence" in line
               for line in story.lines)
    assert "published 3.300 ± 0.123" in text
    assert any("DENIED (denied; approver: alice): not this quarter" in line
               for line in story.lines)
    assert "3–5 regions" in text
    for raw in ("minimum_to_under_double", "double_to_under_fourfold", "3_to_5",
                "3.3000000000000003", "0.05000000000000001"):
        assert raw not in story.markdown, raw
    rows = {(r["metric"], r["group"]): r for r in story.rows}
    assert rows[("health.dropout_rate", "global")]["value"] == 3.3
    assert rows[("health.dropout_rate", "global")]["epsilon"] == 0.05
    assert rows[("accuracy", "global")]["outcome"] == "refused"
    assert rows[("accuracy", "west")]["outcome"] == "not released"


def test_artifact_key_is_a_valid_prefect_key():
    key = story_artifact_key("My Fed_2")
    assert key.startswith("clma-round-my-fed-2-")
    assert key == key.lower() and set(key) <= set("abcdefghijklmnopqrstuvwxyz0123456789-")


def test_federation_round_line_counts_outcomes_and_names_the_round_run():
    line = federation_round_line(_published_round(), "fed-a")
    assert line == ("round 3 committed: cohorts 0, 1, 2; releases 1 published, 2 refused, "
                    "1 not released (the round's story: run fed-a-round-3)")
    quiet = {**_published_round(), "regional": None, "cohorts": {"0": "below_minimum"}}
    assert federation_round_line(quiet, "fed-a") == (
        "round 3 committed: cohorts 0; no evaluation (the round's story: run fed-a-round-3)")
