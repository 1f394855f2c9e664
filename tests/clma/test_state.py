"""Durable federation state (clma/state.py): atomic commit, verification, restore."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from clma.config import load_config
from clma.sim.federation import build_federation
from clma.state import (
    StateCorrupt,
    StateError,
    StateLocked,
    StateStore,
    restore_federation,
    resume_fingerprint,
    snapshot_federation,
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


def test_snapshot_restore_round_trip_of_a_federation(tmp_path):
    cfg = load_config(SMALL)
    fed = build_federation(cfg)
    # mutate: a split, a new cohort model, detector state and a drift
    fed.registry.split(0, {0: [0, 2], 1: [1, 3]}, round=2)
    fed.cohort_models = {c: np.full(fed.initial_model.shape, float(c), np.float32)
                         for c in fed.registry.active_cohorts()}
    fed.merge_reference = fed.initial_model * 2
    fed.clients[4].detector_state = {"kind": "LossThresholdDetector", "gamma": 0.5,
                                     "previous_loss": 1.25, "n_updates": 2, "n_flags": 0}
    fed.inject_drift(3)
    store = StateStore(tmp_path / "s")
    store.commit(2, snapshot_federation(fed, 2))
    fresh = build_federation(cfg)
    assert restore_federation(fresh, store.load()) == 2
    assert fresh.registry.to_dict() == fed.registry.to_dict()
    assert sorted(fresh.cohort_models) == [0, 1, 2]
    for c in fresh.cohort_models:
        np.testing.assert_array_equal(fresh.cohort_models[c], fed.cohort_models[c])
        assert fresh.cohort_models[c].dtype == np.float32
    np.testing.assert_array_equal(fresh.merge_reference, fed.merge_reference)
    assert fresh.clients[4].detector_state == fed.clients[4].detector_state
    assert [c for c, cl in fresh.clients.items() if cl.drifts] == fed.drifted_clients()
    assert fresh.clients[0].drifts == fed.clients[0].drifts
    # no client data or RNG state in the snapshot: the files are small JSON + npz
    files = store.load().files
    assert set(files) == {"registry.json", "models.npz", "clients.json", "federation.json"}
    assert json.loads(files["federation.json"])["round"] == 2


def test_restore_refuses_another_configuration(tmp_path):
    cfg = load_config(SMALL)
    fed = build_federation(cfg)
    store = StateStore(tmp_path / "s")
    store.commit(1, snapshot_federation(fed, 1))
    other = build_federation(cfg.with_overrides(seed=cfg.seed + 1))
    with pytest.raises(StateError, match="config: differs"):
        restore_federation(other, store.load())
    # rounds may change when resuming
    more = cfg.with_overrides(rounds=cfg.rounds + 3)
    assert resume_fingerprint(more) == resume_fingerprint(cfg)
    assert restore_federation(build_federation(more), store.load()) == 1
