"""A local Prefect database written by another Prefect is refused at once, by name
(flows/prefect_home.py), instead of a 120 s "Timed out while attempting to connect to
ephemeral Prefect API server"."""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import prefect
import pytest

from flows.prefect_home import (
    PrefectDatabaseError,
    _known_revisions,
    check_local_database,
)

ROOT = Path(__file__).resolve().parents[2]
UNKNOWN = "ffffffffffff"  # not a revision of any Prefect


def _db(path: Path, revision: str | None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    con = sqlite3.connect(path)
    if revision is not None:
        con.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)")
        con.execute("INSERT INTO alembic_version VALUES (?)", (revision,))
    con.execute("CREATE TABLE other (x INTEGER)")
    con.commit()
    con.close()
    return path


def test_known_revisions_are_the_installed_migrations():
    folder = (Path(prefect.__file__).parent / "server" / "database" / "_migrations"
              / "versions" / "sqlite")
    scripts = [p for p in folder.glob("*.py") if "revision =" in p.read_text("utf-8")]
    revs = _known_revisions()
    assert len(revs) == len(scripts) > 50
    # newer file names carry their revision: YYYY_MM_DD_HHMMSS_<revision>_<what>.py
    named = {m.group(1) for p in scripts if (m := re.match(r"\d{4}_\d\d_\d\d_\d{6}_([0-9a-f]{12})_",
                                                              p.name))}
    assert len(named) > 20 and named <= revs
    assert UNKNOWN not in revs


def test_unknown_revision_is_refused_naming_file_revision_and_version(tmp_path):
    db = _db(tmp_path / "prefect.db", UNKNOWN)
    with pytest.raises(PrefectDatabaseError) as ei:
        check_local_database(db)
    msg = str(ei.value)
    assert str(db) in msg and UNKNOWN in msg and prefect.__version__ in msg
    assert "PREFECT_HOME" in msg and "PREFECT_API_URL" in msg


@pytest.mark.parametrize("case", ["known", "missing", "empty", "fresh"])
def test_usable_databases_pass(tmp_path, case):
    db = tmp_path / "prefect.db"
    if case == "known":
        _db(db, sorted(_known_revisions())[0])
    elif case == "empty":
        db.write_bytes(b"")
    elif case == "fresh":  # a database without Prefect's tables yet
        _db(db, None)
    check_local_database(db)  # no error
    if case != "missing":
        assert db.exists()


def test_not_a_database_is_refused(tmp_path):
    db = tmp_path / "prefect.db"
    db.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(PrefectDatabaseError, match="cannot be read"):
        check_local_database(db)


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PREFECT_") and k != "MLFLOW_TRACKING_URI"}
    env.update(PREFECT_HOME=str(home), PYTHONPATH=str(ROOT), **extra)
    return env


@pytest.mark.parametrize("api_url", [None, "http://127.0.0.1:9/api"])
def test_local_database_path_follows_prefect_settings(tmp_path, api_url):
    home = tmp_path / "home"
    extra = {} if api_url is None else {"PREFECT_API_URL": api_url}
    r = subprocess.run([sys.executable, "-c",
                        "from flows.prefect_home import local_database_path as f; print(f())"],
                       env=_env(home, **extra), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    expected = "None" if api_url else str(home / "prefect.db")
    assert r.stdout.strip() == expected


def test_clma_run_refuses_at_once_and_writes_nothing(tmp_path):
    home = tmp_path / "home"
    _db(home / "prefect.db", UNKNOWN)
    before = (home / "prefect.db").read_bytes()
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "flows.cli", "run", "--no-tracking", "--rounds",
                        "1", "--out", str(out)], env=_env(home), capture_output=True,
                       text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert "schema revision ffffffffffff" in r.stderr and "Timed out" not in r.stderr
    assert not out.exists()  # refused before the output folder is made
    assert (home / "prefect.db").read_bytes() == before  # read-only: nothing migrated


@pytest.mark.parametrize("argv, rc", [
    # runs Prefect flows: refused at once
    (["experiment", "atypical-client", "--seeds", "0", "--rounds", "2"], 2),
    # the bare engine only (USES_PREFECT = False): never starts the local API, not refused
    (["experiment", "realistic-drift", "--tabulate", "--no-tracking", "--seeds", "0",
      "--scenarios", "label2-iid", "--methods", "fedavg"], 0),
])
def test_experiments_are_refused_only_when_they_use_prefect(tmp_path, argv, rc):
    home = tmp_path / "home"
    _db(home / "prefect.db", UNKNOWN)
    r = subprocess.run([sys.executable, "-m", "flows.cli", *argv, "--out", str(tmp_path / "o")],
                       env=_env(home), capture_output=True, text=True, timeout=300,
                       cwd=tmp_path)
    assert r.returncode == rc, r.stderr[-2000:]
    assert ("schema revision ffffffffffff" in r.stderr) is (rc == 2)
