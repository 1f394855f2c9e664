"""Durable federation state (clma/state.py): atomic commit, verification, restore."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from clma.config import load_config, validate_config, with_cohort_method
from clma.engine import FederationEngine, ServerState
from clma.sim.clients import SimulatedClients
from clma.sim.federation import build_federation
from clma.state import (
    CONFIG_ADDITIONS,
    FINGERPRINT_SCHEME,
    StateCorrupt,
    StateError,
    StateLocked,
    StateStore,
    accepted_fingerprints,
    restore_server,
    resume_fingerprint,
    snapshot_server,
)

SMALL = Path(__file__).parents[1] / "flows" / "small.toml"


def test_commit_then_load_round_trips_bytes_and_round(tmp_path):
    store = StateStore(tmp_path / "s")
    assert store.load() is None
    store.commit(3, {"a.json": b'{"x": 1}\n', "b.npz": b"\x00\x01"}, meta={"k": "v"})
    snap = store.load()
    assert snap.round == 3
    assert snap.files == {"a.json": b'{"x": 1}\n', "b.npz": b"\x00\x01"}
    assert snap.json("a.json") == {"x": 1}
    assert snap.meta == {"k": "v"}


def test_failure_during_replace_leaves_old_state_readable(tmp_path, monkeypatch):
    store = StateStore(tmp_path / "s")
    store.commit(1, {"a.json": b"old"})

    def boom(src, dst):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="simulated"):
        store.commit(2, {"a.json": b"new"})
    monkeypatch.undo()
    snap = store.load()
    assert (snap.round, snap.files) == (1, {"a.json": b"old"})
    # the next commit cleans up and succeeds
    store.commit(2, {"a.json": b"new"})
    assert store.load().files == {"a.json": b"new"}


def test_failure_midway_through_writing_files_leaves_old_state(tmp_path, monkeypatch):
    import clma.state as st

    store = StateStore(tmp_path / "s")
    store.commit(1, {"a.json": b"old-a", "b.json": b"old-b"})
    real = st._write_synced
    calls = []

    def flaky(path, data):
        calls.append(path.name)
        if len(calls) == 2:  # first file written, crash on the second
            raise OSError("crash mid-write (simulated)")
        real(path, data)

    monkeypatch.setattr(st, "_write_synced", flaky)
    with pytest.raises(OSError, match="mid-write"):
        store.commit(2, {"a.json": b"new-a", "b.json": b"new-b"})
    monkeypatch.undo()
    snap = store.load()
    assert snap.round == 1
    assert snap.files == {"a.json": b"old-a", "b.json": b"old-b"}
    # a partial folder exists but is not named by CURRENT; the next commit removes it
    assert list((tmp_path / "s" / "commits").glob(".tmp-*"))
    store.commit(2, {"a.json": b"new-a"})
    assert not list((tmp_path / "s" / "commits").glob(".tmp-*"))


def test_tampered_file_is_detected(tmp_path):
    store = StateStore(tmp_path / "s")
    folder = store.commit(1, {"a.json": b"abc"})
    (folder / "a.json").write_bytes(b"abd")
    with pytest.raises(StateCorrupt, match="a.json: content does not match"):
        store.load()
    (folder / "a.json").unlink()
    with pytest.raises(StateCorrupt, match="a.json: missing"):
        store.load()


def test_prune_keeps_last_commits(tmp_path):
    store = StateStore(tmp_path / "s", keep=2)
    for r in range(5):
        store.commit(r, {"a.json": str(r).encode()})
    names = sorted(p.name[:12] for p in (tmp_path / "s" / "commits").iterdir())
    assert names == ["round_000003", "round_000004"]
    assert store.load().round == 4


def test_bad_arguments_raise_naming_the_field(tmp_path):
    with pytest.raises(StateError, match="keep"):
        StateStore(tmp_path, keep=0)
    store = StateStore(tmp_path / "s")
    with pytest.raises(StateError, match="round_number"):
        store.commit(-1, {})
    with pytest.raises(StateError, match="invalid snapshot file name"):
        store.commit(1, {"../x": b""})
    with pytest.raises(StateError, match="invalid snapshot file name"):
        store.commit(1, {"manifest.json": b""})


def test_lock_is_exclusive(tmp_path):
    a, b = StateStore(tmp_path / "s"), StateStore(tmp_path / "s")
    with a.lock():
        # flock is per open file description: a second open in this process conflicts too
        with pytest.raises(StateLocked), b.lock():
            pass
    with b.lock():
        pass


def _engine(cfg):
    sim = build_federation(cfg)
    return FederationEngine(cfg, sim.assets(), SimulatedClients(sim))


def test_snapshot_restore_round_trip_of_the_server_state(tmp_path):
    cfg = load_config(SMALL)
    engine = _engine(cfg)
    st = engine.state
    initial = engine.assets.initial_model
    # mutate: a split, new cohort models, a merge reference and the evaluation state
    st.registry.split(0, {0: [0, 2], 1: [1, 3]}, round=2)
    st.registry.record_round(2)
    st.cohort_models = {c: np.full(initial.shape, float(c), np.float32)
                        for c in st.registry.active_cohorts()}
    st.merge_reference = initial * 2
    ev = engine.evaluator.state  # created on first use, initial bounds from the config
    ev.evaluations_done = 2
    ev.merges.observe(engine.assets.partition.region_ids, ["west"])
    store = StateStore(tmp_path / "s")
    store.commit(2, snapshot_server(st, cfg, 2))
    fresh = restore_server(store.load(), cfg)
    assert isinstance(fresh, ServerState) and fresh.rounds_done == 2
    assert fresh.registry.to_dict() == st.registry.to_dict()
    assert sorted(fresh.cohort_models) == [0, 1, 2]
    for c in fresh.cohort_models:
        np.testing.assert_array_equal(fresh.cohort_models[c], st.cohort_models[c])
        assert fresh.cohort_models[c].dtype == np.float32
    np.testing.assert_array_equal(fresh.merge_reference, st.merge_reference)
    assert fresh.evaluation == ev and fresh.evaluation.evaluations_done == 2
    # an engine continues from it: same assignments, its evaluator on the restored state
    again = FederationEngine(cfg, engine.assets, engine.clients, state=fresh)
    assert again.state.assignments([0, 1, 4]) == st.assignments([0, 1, 4])
    assert again.evaluator.state is fresh.evaluation
    # nothing of a client: no clients.json, no detector state, small JSON + npz
    files = store.load().files
    assert set(files) == {"registry.json", "models.npz", "evaluation.json", "federation.json"}
    assert json.loads(files["federation.json"])["round"] == 2
    for name in ("registry.json", "evaluation.json", "federation.json"):
        assert "previous_loss" not in files[name].decode() and "detector" not in files[name].decode()


def test_snapshot_before_the_first_evaluation_and_without_a_merge_reference(tmp_path):
    cfg = load_config(SMALL)
    engine = _engine(cfg)
    store = StateStore(tmp_path / "s")
    store.commit(0, snapshot_server(engine.state, cfg, 0))
    assert store.load().json("evaluation.json") is None
    fresh = restore_server(store.load(), cfg)
    assert fresh.evaluation is None and fresh.merge_reference is None and fresh.rounds_done == 0
    np.testing.assert_array_equal(fresh.cohort_models[0], engine.assets.initial_model)


def test_models_that_do_not_match_the_registry_are_corrupt(tmp_path):
    cfg = load_config(SMALL)
    st = _engine(cfg).state
    files = snapshot_server(st, cfg, 1)
    st.registry.split(0, {0: [0, 2], 1: [1, 3]}, round=1)  # the registry moved on alone
    files["registry.json"] = snapshot_server(st, cfg, 1)["registry.json"]
    store = StateStore(tmp_path / "s")
    store.commit(1, files)
    with pytest.raises(StateCorrupt, match="cohort models do not match"):
        restore_server(store.load(), cfg)


def test_restore_refuses_another_configuration(tmp_path):
    cfg = load_config(SMALL)
    st = _engine(cfg).state
    store = StateStore(tmp_path / "s")
    store.commit(1, snapshot_server(st, cfg, 1))
    with pytest.raises(StateError, match="config: differs"):
        restore_server(store.load(), cfg.with_overrides(seed=cfg.seed + 1))
    # rounds (and the transport section) may change when resuming
    more = cfg.with_overrides(rounds=cfg.rounds + 3)
    assert resume_fingerprint(more) == resume_fingerprint(cfg)
    assert restore_server(store.load(), more).rounds_done == 1
    moved = cfg.model_copy(update={"federation": cfg.federation.model_copy(
        update={"device_state_dir": str(tmp_path / "elsewhere")})})
    assert resume_fingerprint(moved) == resume_fingerprint(cfg)


# ------------------------------------------------------- resuming a folder of an earlier version

DEFAULT = Path(__file__).parents[2] / "clma" / "configs" / "default.toml"
#: resume_fingerprint of the default config as clma 0.1.0 wrote it into federation.json at
#: commit 6015c7a (before drift.input_ks existed) and at 42e4594 (with it, whole-dump hash,
#: no fingerprint scheme); computed by those versions' own code.
FP_6015C7A = "7ef4bc85045d54f21017427fe0ed56ec0638fbdc3b745893c29d22b3e2a1a978"
FP_42E4594 = "42593013c41e43a920bd54825726860d8c0c1d6150f8d6f00e90ef9c511a2ff0"


def _with_input_ks_alpha(cfg, alpha):
    drift = cfg.drift.model_copy(update={"input_ks": cfg.drift.input_ks.model_copy(
        update={"alpha": alpha})})
    return cfg.model_copy(update={"drift": drift})


def _legacy_snapshot(tmp_path, cfg, fingerprint, scheme=None, config_json=None):
    files = snapshot_server(_engine(cfg).state, cfg, 1)
    info = {"round": 1, "name": cfg.name, "seed": cfg.seed, "resume_fingerprint": fingerprint}
    if scheme is not None:
        info["fingerprint_scheme"] = scheme
    files["federation.json"] = (json.dumps(info) + "\n").encode()
    if config_json is not None:
        files["config.json"] = (json.dumps(config_json) + "\n").encode()
    store = StateStore(tmp_path / f"s{abs(hash(fingerprint)) % 10**6}-{scheme}")
    store.commit(1, files)
    return store.load()


def _first_release_default():
    """The default federation as the first release ran it: default.toml with the paper's
    cohorting method (the library default until issue 46)."""
    return validate_config(with_cohort_method(load_config(DEFAULT).model_dump(mode="json"),
                                              "paper"))


def test_resume_fingerprint_of_the_default_config_is_the_one_the_first_release_wrote():
    cfg = _first_release_default()
    # drift.input_ks keeps its legacy value, so it is left out: the hash of 6015c7a
    assert resume_fingerprint(cfg) == FP_6015C7A
    assert accepted_fingerprints(cfg, None) == {FP_6015C7A, FP_42E4594}
    assert accepted_fingerprints(cfg, FINGERPRINT_SCHEME) == {FP_6015C7A}
    changed = _with_input_ks_alpha(cfg, 0.05)
    assert resume_fingerprint(changed) != FP_6015C7A
    assert FP_6015C7A not in accepted_fingerprints(changed, None)
    assert FP_42E4594 not in accepted_fingerprints(changed, None)


@pytest.mark.parametrize("fingerprint", [FP_6015C7A, FP_42E4594])
def test_a_folder_of_an_earlier_version_resumes_when_nothing_changed(tmp_path, fingerprint):
    cfg = _first_release_default()
    snap = _legacy_snapshot(tmp_path, cfg, fingerprint)
    assert restore_server(snap, cfg).rounds_done == 1
    assert restore_server(snap, cfg.with_overrides(rounds=cfg.rounds + 5)).rounds_done == 1


def test_a_folder_of_an_earlier_version_refuses_a_field_it_never_had_set_otherwise(tmp_path):
    cfg = _first_release_default()
    old_dump = json.loads(Path(__file__).parents[1].joinpath(
        "fixtures", "config_fields_6015c7a.json").read_text())  # names only
    assert "drift.input_ks.alpha" not in old_dump["fields"]
    stored = cfg.model_dump(mode="json")
    del stored["drift"]["input_ks"]  # as 6015c7a wrote config.json
    snap = _legacy_snapshot(tmp_path, cfg, FP_6015C7A, config_json=stored)
    changed = _with_input_ks_alpha(cfg, 0.05)
    with pytest.raises(StateError) as err:
        restore_server(snap, changed)
    # names the field, never its value
    assert "at drift.input_ks.alpha (only rounds," in str(err.value)
    assert "0.05" not in str(err.value) and "0.01" not in str(err.value)
    with pytest.raises(StateError, match=r"differs from the federation stored in the state "
                                         r"directory at seed \(only"):
        restore_server(snap, cfg.with_overrides(seed=cfg.seed + 1))


def test_a_folder_of_the_paper_method_refuses_todays_default_method_and_resumes_alone(
        tmp_path):
    """A federation from before issue 46 ran the paper's method; resumed with a config at
    today's defaults (the improved method) it is refused, naming the fields; resumed from
    its own stored config (no cohort.method in it) it runs the paper's method."""
    from tasks.durable import stored_config

    old = _first_release_default()
    stored = old.model_dump(mode="json")
    del stored["cohort"]["method"], stored["cohort"]["leading_split_alpha"]
    del stored["training"]["server_learning_rate"]
    del stored["training"]["server_learning_rate_scope"]
    snap = _legacy_snapshot(tmp_path, old, FP_6015C7A, config_json=stored)
    with pytest.raises(StateError) as err:
        restore_server(snap, load_config(DEFAULT))
    for name in ("cohort.components", "cohort.direction_rule", "cohort.method",
                 "training.server_learning_rate"):
        assert name in str(err.value)
    (tmp_path / "st").mkdir()
    StateStore(tmp_path / "st").commit(1, {"config.json": (json.dumps(stored) + "\n").encode()})
    back = stored_config(tmp_path / "st")
    assert back == old  # the paper's method, not today's defaults
    assert restore_server(snap, back).rounds_done == 1


def test_a_new_folder_carries_the_scheme_and_an_unknown_scheme_is_refused(tmp_path):
    cfg = load_config(SMALL)
    files = snapshot_server(_engine(cfg).state, cfg, 1)
    info = json.loads(files["federation.json"])
    assert info["fingerprint_scheme"] == FINGERPRINT_SCHEME == 2
    assert info["resume_fingerprint"] == resume_fingerprint(cfg)
    snap = _legacy_snapshot(tmp_path, cfg, resume_fingerprint(cfg), scheme=3)
    with pytest.raises(StateError, match="fingerprint scheme 3 is not known to this version"):
        restore_server(snap, cfg)


def test_every_field_added_since_the_first_release_is_registered_with_its_legacy_value():
    """A field added to the schema must be in CONFIG_ADDITIONS (else every earlier state
    folder refuses to resume), and its legacy value is its default today (else a config
    at the default would not resume a folder from before the field: decide and update)."""
    first = set(json.loads(Path(__file__).parents[1].joinpath(
        "fixtures", "config_fields_6015c7a.json").read_text())["fields"])
    cfg = load_config(DEFAULT)

    def leaves(o, p=""):
        if isinstance(o, dict):
            return [x for k, v in o.items() for x in leaves(v, f"{p}.{k}" if p else k)]
        return [p]

    added = {f for f in leaves(cfg.model_dump(mode="json")) if f not in first}
    registered = [path for path, _ in CONFIG_ADDITIONS]
    unregistered = {f for f in added
                    if not any(f == r or f.startswith(r + ".") for r in registered)}
    assert unregistered == set()
    assert registered == ["drift.input_ks", "cohort.leading_split_alpha",
                          "cohort.leading_split_min_size", "training.server_learning_rate",
                          "training.server_learning_rate_scope", "model.factory",
                          "data.source", "model.weights", "data.probe", "cohort.method",
                          "cohort.leading_split_family_ratio", "cohort.cosine_refinement",
                          "cohort.one_component", "cohort.refit_without_outliers",
                          "cohort.client_choice", "drift.paired_loss",
                          "training.server_momentum", "data.record_churn"]
    # decided (issue 46): the default cohorting method changed from the paper's to the
    # improved one, so a config at the defaults no longer resumes a federation from before
    # (refused, naming the fields); with cohort.method = "paper" it does (the paper
    # method's values are the legacy ones)
    changed = {"cohort.method", "cohort.leading_split_alpha",
               "cohort.leading_split_family_ratio", "cohort.cosine_refinement",
               "cohort.one_component", "cohort.refit_without_outliers", "cohort.client_choice",
               "training.server_learning_rate", "training.server_learning_rate_scope"}
    paper = load_config(DEFAULT).model_dump(mode="json")
    paper["cohort"]["method"] = "paper"
    for key in ("components", "direction_rule", "leading_split_alpha",
                "leading_split_family_ratio", "cosine_refinement", "one_component",
                "refit_without_outliers", "client_choice"):
        del paper["cohort"][key]
    del paper["training"]["server_learning_rate"], paper["training"]["server_learning_rate_scope"]
    dumps = {"default": cfg.model_dump(mode="json"),
             "paper": validate_config(paper).model_dump(mode="json")}
    for path, legacy in CONFIG_ADDITIONS:
        values = {}
        for name, dump in dumps.items():
            node = dump
            for part in path.split("."):
                node = node[part]
            values[name] = node
        assert values["paper"] == legacy, path
        assert (values["default"] == legacy) == (path not in changed), path
