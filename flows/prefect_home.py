"""A readable refusal when the local Prefect database was written by another Prefect.

Without ``PREFECT_API_URL`` every ``clma`` command runs Prefect's temporary local API on
the SQLite database of ``PREFECT_HOME`` (``~/.prefect/prefect.db`` by default). If a newer
Prefect wrote that database (a second environment on the same machine, say Prefect 3.9.1
next to this project's 3.7.7), its schema revision is one the installed Prefect does not
know: the local API cannot migrate it, fails to start in the background, and the command
only reports, after the start-up timeout (120 s here), "Timed out while attempting to
connect to ephemeral Prefect API server". :func:`check_local_database` reads the revision
first (read-only, no migration, no lock) and names the problem and the ways out.
"""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

__all__ = ["PrefectDatabaseError", "check_local_database", "local_database_path"]

_REVISION = re.compile(r"^revision\s*=\s*[\"']([0-9a-f]+)[\"']", re.M)


class PrefectDatabaseError(RuntimeError):
    """The local Prefect database cannot be used by the installed Prefect (message says why)."""


def local_database_path() -> Path | None:
    """The SQLite file the temporary local Prefect API would open, or None when the
    commands talk to a configured server (``PREFECT_API_URL``) or the database is not
    SQLite. Reads Prefect's settings (``PREFECT_HOME``,
    ``PREFECT_SERVER_DATABASE_CONNECTION_URL``)."""
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    if settings.api.url:
        return None
    url = settings.server.database.connection_url
    text = url.get_secret_value() if url is not None else ""
    if not text.startswith("sqlite") or ":memory:" in text:
        return None
    # sqlite+aiosqlite:////abs/path.db -> /abs/path.db ; sqlite:///rel.db -> rel.db
    path = text.split("://", 1)[1]
    path = path[1:] if path.startswith("/") else path
    return Path(path.split("?", 1)[0]).expanduser()


def _known_revisions() -> set[str]:
    """Alembic revisions of the installed Prefect's SQLite migrations: the ``revision =``
    line of each migration script (read as text: importing them costs seconds)."""
    import prefect

    folder = (Path(prefect.__file__).parent / "server" / "database" / "_migrations"
              / "versions" / "sqlite")
    found = set()
    for script in folder.glob("*.py"):
        m = _REVISION.search(script.read_text("utf-8"))
        if m:
            found.add(m.group(1))
    return found


def check_local_database(path: Path | None = None) -> None:
    """Refuse a local Prefect database whose schema revision the installed Prefect does not
    know (module docstring). A missing file, an empty one and a configured server pass.

    Args:
        path: the SQLite file (default: :func:`local_database_path`).

    Raises:
        PrefectDatabaseError: unreadable database, or a revision unknown to this Prefect;
            the message names the file, the revision, the installed version and the fixes.
    """
    import prefect

    path = local_database_path() if path is None else path
    if path is None or not path.exists() or path.stat().st_size == 0:
        return
    try:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            has_table = con.execute("SELECT name FROM sqlite_master WHERE type='table' AND "
                                    "name='alembic_version'").fetchone()
            rows = con.execute("SELECT version_num FROM alembic_version").fetchall() \
                if has_table else []
        finally:
            con.close()
    except sqlite3.DatabaseError as exc:
        raise PrefectDatabaseError(
            f"the local Prefect database {path} cannot be read ({exc}); move it aside or "
            "set PREFECT_HOME to another folder") from None
    unknown = sorted({str(r[0]) for r in rows} - _known_revisions())
    if unknown:
        raise PrefectDatabaseError(
            f"the local Prefect database {path} is at schema revision {', '.join(unknown)}, "
            f"which the installed Prefect {prefect.__version__} does not know (it was written "
            "by another, probably newer, Prefect). The local API cannot start on it. Use "
            "another Prefect home (export PREFECT_HOME=~/.prefect-clma), move the file aside, "
            "or point PREFECT_API_URL at a running Prefect server.")
