"""Test isolation: a temporary PREFECT_HOME (set before prefect is imported anywhere),
quiet Prefect, one session-wide Prefect test harness for flow tests only, and a
temporary MLflow store per test that asks for it."""

from __future__ import annotations

import os
import tempfile
import warnings

_PREFECT_HOME = tempfile.mkdtemp(prefix="clma-prefect-home-")
os.environ["PREFECT_HOME"] = _PREFECT_HOME
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("PREFECT_SERVER_LOGGING_LEVEL", "CRITICAL")
os.environ.setdefault("DO_NOT_TRACK", "true")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS",
                      os.environ.get("CLMA_TEST_PREFECT_STARTUP_TIMEOUT", "120"))
os.environ.pop("PREFECT_API_URL", None)
os.environ.pop("MLFLOW_TRACKING_URI", None)
warnings.filterwarnings("ignore", category=DeprecationWarning, module="sqlalchemy")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def prefect_harness():
    """A temporary Prefect API for the whole session (started on first use, ~7 s; on a
    loaded machine allow longer with CLMA_TEST_PREFECT_STARTUP_TIMEOUT, seconds)."""
    from prefect.testing.utilities import prefect_test_harness

    # one bound for the harness and the ephemeral server (120 s unless set: a loaded machine)
    timeout = int(os.environ.get("CLMA_TEST_PREFECT_STARTUP_TIMEOUT",
                                 os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"]))
    with prefect_test_harness(server_startup_timeout=timeout):
        yield


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    """A fresh SQLite MLflow store; returns its tracking URI."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


def pytest_collection_modifyitems(config, items):
    """Longest first: the files that start servers or a Flower deployment, then the other
    files with end-to-end (``slow``) tests, then the rest; files and the tests within each
    file keep their collection order (a stable sort by the file's tier). With ``-n 2 --dist
    loadfile --no-loadscope-reorder`` (the Makefile's) the workers take files in this order,
    so the Flower deployment module starts at once on one worker while the other works
    through the rest, instead of running alone at the end."""
    def tier(item) -> int:
        marks = {m.name for m in item.iter_markers()}
        return 0 if "server" in marks else 1 if "slow" in marks else 2

    files: dict[str, int] = {}
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        files[path] = min(files.get(path, 2), tier(item))
    items.sort(key=lambda item: files[item.nodeid.split("::", 1)[0]])
