"""Cohort registry lineage/history and the displacement merge rule (issue 3, items 4, 6b)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from clma.cohort import (
    CohortRegistry,
    RegistryError,
    displacement_cosine_distances,
    merge_candidates,
    raw_cosine_distances,
)


def build() -> CohortRegistry:
    reg = CohortRegistry()
    root = reg.create_root([f"c{i}" for i in range(6)] + [7], round=0)
    assert root == 0
    reg.record_round(0)
    new = reg.split(0, {0: ["c1", "c2"], 1: ["c4", 7]}, round=3, reason="drift")
    assert new == {0: 1, 1: 2}
    reg.record_round(3)
    merged = reg.merge([1, 2], round=6, reason="reconverged")
    assert merged == 3
    reg.move("c5", 3, round=7, reason="manual")
    reg.record_round(7)
    return reg


def test_ids_members_status_lineage() -> None:
    reg = build()
    assert reg.active_cohorts() == [0, 3]
    assert reg.members(0) == ["c0", "c3"]
    assert reg.members(3) == ["c1", "c2", "c4", 7, "c5"]
    assert reg.cohort_of(7) == 3 and reg.cohort_of("c0") == 0
    assert reg.cohort(1).status == "merged" and reg.cohort(1).ended_round == 6
    assert reg.cohort(3).parents == [1, 2] and reg.cohort(3).created_round == 6
    assert reg.cohort(1).parents == [0]
    assert reg.descendants(0) == [1, 2, 3]
    assert reg.descendants(1) == [3]
    assert reg.ancestors(3) == [0, 1, 2]
    kinds = [(e.kind, e.round, e.parents, e.children) for e in reg.lineage]
    assert kinds == [("create", 0, [], [0]), ("split", 3, [0], [1, 2]),
                     ("merge", 6, [1, 2], [3]), ("move", 7, [0], [3])]
    assert reg.lineage[2].reason == "reconverged"


def test_history_per_round() -> None:
    reg = build()
    assert reg.history == {
        0: {0: ["c0", "c1", "c2", "c3", "c4", "c5", 7]},
        3: {0: ["c0", "c3", "c5"], 1: ["c1", "c2"], 2: ["c4", 7]},
        7: {0: ["c0", "c3"], 3: ["c1", "c2", "c4", 7, "c5"]},
    }


def test_roundtrip_through_json_exact() -> None:
    reg = build()
    data = json.loads(json.dumps(reg.to_dict()))
    back = CohortRegistry.from_dict(data)
    assert back.to_dict() == reg.to_dict()
    assert back.history == reg.history and back.cohort_of(7) == 3  # int id survives JSON
    assert back.split(0, {0: ["c0"]}, round=8) == {0: 4}  # ids continue, never reused


def test_emptied_parent_is_retired() -> None:
    reg = CohortRegistry()
    reg.create_root(["a", "b"], 0)
    reg.split(0, {0: ["a"], 1: ["b"]}, round=2)
    assert reg.cohort(0).status == "retired" and reg.active_cohorts() == [1, 2]
    # the retirement is in the lineage, after the split that emptied the cohort
    kinds = [(e.kind, e.round, e.parents, e.children, e.reason) for e in reg.lineage]
    assert kinds[1:] == [("split", 2, [0], [1, 2], "drift"),
                         ("retire", 2, [0], [], "emptied by a split")]


def test_cohort_emptied_by_a_move_is_retired_in_the_lineage() -> None:
    reg = CohortRegistry()
    reg.create_root(["a", "b"], 0)
    reg.split(0, {0: ["a"]}, round=2)  # "b" stays in 0
    reg.move("a", 0, round=3, reason="manual")
    assert reg.cohort(1).status == "retired" and reg.cohort(1).ended_round == 3
    assert [(e.kind, e.parents, e.children, e.reason) for e in reg.lineage[2:]] == [
        ("move", [1], [0], "manual"), ("retire", [1], [], "emptied by a move")]
    back = CohortRegistry.from_dict(json.loads(json.dumps(reg.to_dict())))
    assert back.lineage == reg.lineage


@pytest.mark.parametrize("op, match", [
    (lambda r: r.split(0, {0: ["zz"]}, 1), "not a member"),
    (lambda r: r.split(0, {0: ["a"], 1: ["a"]}, 1), "two groups"),
    (lambda r: r.split(9, {0: ["a"]}, 1), "parent_id"),
    (lambda r: r.merge([0], 1), "at least two"),
    (lambda r: r.create_root(["a"], 1), "already belong"),
    (lambda r: r.split(0, {0: ["a"]}, -1), "round"),
])
def test_invalid_operations(op, match) -> None:
    reg = CohortRegistry()
    reg.create_root(["a", "b", "c"], 0)
    with pytest.raises((RegistryError, ValueError), match=match):
        op(reg)


def test_merged_cohort_cannot_be_split() -> None:
    reg = CohortRegistry()
    reg.create_root(["a"], 0)
    reg.create_root(["b"], 0)
    reg.merge([0, 1], 2)
    with pytest.raises(RegistryError, match="merged, not active"):
        reg.split(0, {0: ["a"]}, 3)
    with pytest.raises(TypeError, match="client id"):
        reg.create_root([True], 3)


# ---------------------------------------------------------------- merging


def test_merge_at_threshold_not_above() -> None:
    ref = np.zeros(2, dtype=np.float32)
    theta = 0.3
    models = {"A": np.array([1.0, 0.0], np.float32),
              "B": np.array([np.cos(theta), np.sin(theta)], np.float32)}
    d = displacement_cosine_distances(models, ref)[0, 1]
    assert d == pytest.approx(1 - np.cos(theta), rel=1e-6)
    assert merge_candidates(models, ref, d) == [["A", "B"]]           # at the threshold
    assert merge_candidates(models, ref, np.nextafter(d, 0)) == []    # just below: no merge
    assert merge_candidates(models, ref, None) == []                  # off by default


def test_complete_linkage_groups() -> None:
    ref = np.zeros(3)
    models = {0: np.array([1.0, 0, 0]), 1: np.array([1.0, 0.01, 0]),
              2: np.array([0, 1.0, 0]), 3: np.array([0, 1.0, 0.01]), 4: np.array([0, 0, 1.0])}
    assert merge_candidates(models, ref, 0.01) == [[0, 1], [2, 3]]


def test_displacement_rule_vs_raw_vectors() -> None:
    # Shared initialisation (norm ~ 0.05 * sqrt(p)) plus two clearly different drifts.
    rng = np.random.default_rng(0)
    p = 50_000
    ref = rng.normal(0, 0.05, p).astype(np.float32)
    a = (ref + rng.normal(0, 0.01, p)).astype(np.float32)
    b = (ref + rng.normal(0, 0.01, p)).astype(np.float32)
    models = {"a": a, "b": b}
    raw = raw_cosine_distances(models)[0, 1]
    disp = displacement_cosine_distances(models, ref)[0, 1]
    assert 0.005 <= raw <= 0.05   # raw vectors look close...
    assert disp > 0.9             # ...the displacements are unrelated (~orthogonal)
    # The raw rule would merge at 0.05; the displacement rule does not.
    assert raw <= 0.05 and merge_candidates(models, ref, 0.05) == []
    # Reconverged cohorts (same displacement up to small noise) do merge.
    c = (a + rng.normal(0, 0.001, p)).astype(np.float32)
    assert merge_candidates({"a": a, "c": c}, ref, 0.05) == [["a", "c"]]


def test_zero_displacement_conventions_and_errors() -> None:
    ref = np.ones(4, np.float32)
    models = {"same1": ref.copy(), "same2": ref.copy(), "moved": ref + 1}
    dist = displacement_cosine_distances(models, ref)
    assert dist[0, 1] == 0.0 and dist[0, 2] == 1.0
    assert merge_candidates(models, ref, 0.0) == [["same1", "same2"]]
    with pytest.raises(ValueError, match="cohort 'x'"):
        merge_candidates({"x": np.ones(3), "y": ref}, ref, 0.1)
    with pytest.raises(ValueError, match="cohort 'y'"):
        merge_candidates({"x": ref, "y": np.full(4, np.nan)}, ref, 0.1)
    with pytest.raises(ValueError, match="threshold"):
        merge_candidates(models, ref, 3.0)
