"""Durable federation state: what must survive between flow runs, committed atomically.

A state directory holds one federation::

    STATE_DIR/
      CURRENT                       name of the committed snapshot in force (one line)
      commits/round_NNNNNN-<id>/    one committed snapshot (the last ``keep`` are kept)
        manifest.json               schema, round, file -> SHA-256 and size, metadata
        registry.json               cohort registry with lineage (CohortRegistry.to_dict)
        models.npz                  each active cohort's current model (float32 vectors)
        evaluation.json             evaluation state: alert baselines, clip bounds, merges
        federation.json             round counter, config resume-fingerprint and its
                                    scheme (resume_fingerprint; CONFIG_ADDITIONS)
        <name>.json                 documents of the orchestration layer (MLflow run ids,
                                    dashboards, per-round records)
      progress.json                 last round started (operators, tests)
      audit/secure_sums_round_NNN.json  every set of clients whose secure sum the server
                                    learned in round NNN, with the digests of the
                                    parameters evaluated (server-internal; a re-run adds
                                    to it, never replaces it)
      audit/learned_sums.jsonl      write-ahead journal of the differencing rule: one line
                                    per set, appended and fsync'ed BEFORE the server
                                    unmasks its sum; never rewritten (a crash between the
                                    sums and the commit loses nothing)
      ledger/                       the privacy ledger (its own transactional SQLite store)
      .lock                         flock: one flow run at a time per state directory
      serve.lock                    flock: one ``clma serve`` per state directory; holds
                                    who serves it (pid, host, deployment, since)

Nothing random is stored: every random choice of a round is seeded by (seed, round), so a
round re-run from the same snapshot makes the same choices. Nothing of a client is stored
here: the clients keep their own state on their side of the seam (the simulated devices in
their own folder, :class:`clma.sim.clients.DeviceStore`; a Flower SuperNode in its node
state).

Atomic commit (:meth:`StateStore.commit`): every file is written into a fresh temporary
folder and fsync'ed, the manifest (with each file's SHA-256) last; the folder is fsync'ed
and renamed to its final name; then ``CURRENT`` is replaced through a temporary file,
fsync and ``os.replace`` (atomic on POSIX), and the directory fsync'ed. A crash at any
point leaves ``CURRENT`` naming the previous complete snapshot; a half-written folder is
never named by ``CURRENT`` and is removed by the next commit. :meth:`StateStore.load`
verifies every file against the manifest (:class:`StateCorrupt` otherwise).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clma.config import (
    CONFIG_ADDITIONS,
    FederationConfig,
    with_legacy_additions,
)
from clma.config import (
    config_hash as _hash,
)
from clma.config import (
    without_additions as _without,
)
from clma.engine.state import ServerState, restore_files, snapshot_files

__all__ = [
    "CONFIG_ADDITIONS",
    "FINGERPRINT_SCHEME",
    "STATE_SCHEMA",
    "accepted_fingerprints",
    "config_differences",
    "config_mismatch_message",
    "CommittedState",
    "StateCorrupt",
    "StateError",
    "ServeLocked",
    "StateLocked",
    "StateStore",
    "default_state_dir",
    "restore_server",
    "resume_fingerprint",
    "snapshot_server",
]

STATE_SCHEMA = "clma.state/1"
#: Config fields that may change between flow runs of one federation.
RESUMABLE_FIELDS = ("rounds", "schedule", "state", "tracking", "orchestration", "federation")
_NAME_OK = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


class StateError(ValueError):
    """The state directory cannot be used as asked (message says which rule)."""


class StateCorrupt(StateError):
    """A committed snapshot does not match its manifest (file missing or altered)."""


class StateLocked(StateError):
    """Another process holds the state directory's lock (a flow run is in progress)."""


class ServeLocked(StateLocked):
    """Another process serves the state directory (``clma serve``); ``holder`` says which:
    ``{"pid", "host", "deployment", "since"}`` (empty if it could not be read)."""

    def __init__(self, message: str, holder: Mapping[str, Any]) -> None:
        super().__init__(message)
        self.holder = dict(holder)


def default_state_dir(config: FederationConfig, cwd: str | Path | None = None) -> Path:
    """``config.state.dir`` or ``<cwd>/state/<config.name>``."""
    if config.state.dir:
        return Path(config.state.dir)
    return Path(cwd or Path.cwd()) / "state" / config.name


#: The fingerprint scheme written into federation.json. Scheme 2 leaves out every registered
#: addition that keeps its legacy value; folders without a scheme (written before it) hashed
#: the whole dump of the version that wrote them.
FINGERPRINT_SCHEME = 2
#: How many of CONFIG_ADDITIONS existed before the scheme (folders without one knew at most
#: these: drift.input_ks at 42e4594).
_UNVERSIONED_ADDITIONS = 1


def _resume_dump(config: FederationConfig) -> dict[str, Any]:
    data = config.model_dump(mode="json")
    for k in RESUMABLE_FIELDS:
        data.pop(k, None)
    data.get("budget", {}).pop("state_dir", None)  # the ledger lives in the state dir
    return data


def resume_fingerprint(config: FederationConfig) -> str:
    """SHA-256 (hex) of the config a federation is resumed under.

    Leaves out the fields a resumed run may change (:data:`RESUMABLE_FIELDS`: rounds,
    schedule, state, tracking, orchestration, federation; and ``budget.state_dir``, which
    follows the state directory) and every field added since the first release
    (:data:`CONFIG_ADDITIONS`) that keeps the value reproducing the behaviour before it, so
    a federation committed by an earlier version resumes under this one when the user
    changed nothing, and is refused when a field it never had is set otherwise."""
    return _hash(_without(_resume_dump(config), CONFIG_ADDITIONS))


def accepted_fingerprints(config: FederationConfig, scheme: int | None) -> set[str]:
    """The stored fingerprints ``config`` may resume: its :func:`resume_fingerprint` for a
    folder written with scheme 2; for an older folder (no scheme), the whole-dump hash as
    each earlier version wrote it (the first ``i`` additions present, the rest absent)."""
    if scheme == FINGERPRINT_SCHEME:
        return {resume_fingerprint(config)}
    if scheme is not None:
        raise StateError(f"federation.json: fingerprint scheme {scheme!r} is not known to "
                         f"this version (it knows {FINGERPRINT_SCHEME}); upgrade clma")
    data = _resume_dump(config)
    return {_hash(_without(data, CONFIG_ADDITIONS[i:]))
            for i in range(_UNVERSIONED_ADDITIONS + 1)}


def _differing_fields(a: Any, b: Any, prefix: str = "") -> list[str]:
    """Dotted names where two config dumps differ (names only: never values)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[str] = []
        for k in sorted(set(a) | set(b)):
            out += _differing_fields(a.get(k), b.get(k), f"{prefix}.{k}" if prefix else k)
        return out
    return [] if a == b else [prefix]


def config_differences(config: FederationConfig, stored: Mapping[str, Any]) -> list[str]:
    """Dotted names of the fields where ``config`` differs from ``stored`` (a config dump,
    e.g. a state folder's config.json) in what :func:`resume_fingerprint` covers; names
    only, never values. A field of :data:`CONFIG_ADDITIONS` missing from ``stored`` counts
    as its legacy value."""
    other = with_legacy_additions(stored)
    for k in RESUMABLE_FIELDS:
        other.pop(k, None)
    if isinstance(other.get("budget"), dict):
        other["budget"].pop("state_dir", None)
    return _differing_fields(_resume_dump(config), other)


def config_mismatch_message(config: FederationConfig, stored: Mapping[str, Any] | None,
                            field: str = "config") -> str:
    """The refusal of a ``config`` that differs from the federation ``stored`` (a config
    dump; None when the state directory has none, then no field is named) in a state
    directory: ``field``, the differing field names (:func:`config_differences`, at most
    :data:`NAMED_DIFFERENCES` named) and the fields that may change when resuming. Names only, never values."""
    names = [] if stored is None else config_differences(config, stored)
    return (f"{field}: differs from the federation stored in the state directory"
            + _at(names) + " (only "
            + ", ".join(RESUMABLE_FIELDS) + " may change when resuming)")


#: Differing fields a refusal names (the rest are counted): enough for every field a
#: change of ``cohort.method`` sets (clma.config.COHORT_METHODS, 12 with the method).
NAMED_DIFFERENCES = 12


def _at(names: list[str]) -> str:
    if not names:
        return ""
    k = NAMED_DIFFERENCES
    return " at " + ", ".join(names[:k]) + (f" and {len(names) - k} more" if len(names) > k
                                            else "")


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


@dataclass(frozen=True)
class CommittedState:
    """A verified snapshot: ``round`` committed, ``files`` name -> bytes, ``manifest``."""

    round: int
    files: dict[str, bytes]
    manifest: dict[str, Any]
    path: Path

    def json(self, name: str) -> Any:
        """Parsed ``<name>`` (a JSON file of the snapshot); KeyError if absent."""
        return json.loads(self.files[name].decode("utf-8"))

    @property
    def meta(self) -> dict[str, Any]:
        return dict(self.manifest.get("meta", {}))


class StateStore:
    """A federation's state directory (see module docs).

    Args:
        root: the state directory (created on first commit).
        keep: committed snapshots kept (>= 1; older ones are removed after a commit).
    """

    def __init__(self, root: str | Path, keep: int = 2) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise StateError("keep: must be an integer >= 1")
        self.root = Path(root)
        self.keep = keep

    @property
    def commits_dir(self) -> Path:
        return self.root / "commits"

    @property
    def ledger_dir(self) -> Path:
        return self.root / "ledger"

    def current_name(self) -> str | None:
        """Folder name of the snapshot in force, or None for a fresh directory."""
        p = self.root / "CURRENT"
        if not p.exists():
            return None
        name = p.read_text("utf-8").strip()
        if not name or not set(name) <= _NAME_OK:
            raise StateCorrupt("CURRENT: does not name a snapshot folder")
        return name

    def load(self) -> CommittedState | None:
        """The verified snapshot in force, or None when nothing was committed yet.

        Raises:
            StateCorrupt: a file is missing or its SHA-256 differs from the manifest.
        """
        name = self.current_name()
        if name is None:
            return None
        folder = self.commits_dir / name
        try:
            manifest = json.loads((folder / "manifest.json").read_text("utf-8"))
        except (OSError, ValueError):
            raise StateCorrupt(f"{name}/manifest.json: missing or not JSON") from None
        if manifest.get("schema") != STATE_SCHEMA:
            raise StateCorrupt(f"{name}/manifest.json: schema is not {STATE_SCHEMA}")
        files: dict[str, bytes] = {}
        for fname, info in sorted(manifest["files"].items()):
            try:
                data = (folder / fname).read_bytes()
            except OSError:
                raise StateCorrupt(f"{name}/{fname}: missing") from None
            if _sha(data) != info["sha256"] or len(data) != info["size"]:
                raise StateCorrupt(f"{name}/{fname}: content does not match the manifest")
            files[fname] = data
        return CommittedState(int(manifest["round"]), files, manifest, folder)

    def commit(self, round_number: int, files: Mapping[str, bytes],
               meta: Mapping[str, Any] | None = None) -> Path:
        """Atomically make ``files`` the state of ``round_number`` (see module docs).

        Returns the snapshot folder. Raises StateError for a bad file name or round.
        """
        if isinstance(round_number, bool) or not isinstance(round_number, int) or round_number < 0:
            raise StateError("round_number: must be an integer >= 0")
        for fname in files:
            if fname == "manifest.json" or not fname or not set(fname) <= _NAME_OK \
                    or fname.startswith("."):
                raise StateError(f"files: invalid snapshot file name {fname!r}")
        self.commits_dir.mkdir(parents=True, exist_ok=True)
        self._remove_partial()
        final_name = f"round_{round_number:06d}-{uuid.uuid4().hex[:8]}"
        tmp = self.commits_dir / f".tmp-{final_name}"
        tmp.mkdir()
        manifest = {
            "schema": STATE_SCHEMA,
            "round": round_number,
            "files": {},
            "meta": dict(meta or {}),
        }
        for fname, data in sorted(files.items()):
            _write_synced(tmp / fname, data)
            manifest["files"][fname] = {"sha256": _sha(data), "size": len(data)}
        _write_synced(tmp / "manifest.json",
                      (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode())
        _fsync_dir(tmp)
        final = self.commits_dir / final_name
        os.rename(tmp, final)
        _fsync_dir(self.commits_dir)
        cur_tmp = self.root / f".CURRENT.tmp-{os.getpid()}"
        _write_synced(cur_tmp, (final_name + "\n").encode())
        os.replace(cur_tmp, self.root / "CURRENT")
        _fsync_dir(self.root)
        self._prune(final_name)
        return final

    def mark_started(self, round_number: int) -> None:
        """Record that ``round_number`` started (``progress.json``; informational)."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".progress.tmp-{os.getpid()}"
        _write_synced(tmp, json.dumps({"started_round": int(round_number),
                                       "pid": os.getpid()}).encode())
        os.replace(tmp, self.root / "progress.json")

    def write_audit(self, round_number: int, sums: list[dict[str, Any]]) -> Path:
        """Write ``audit/secure_sums_round_NNN.json`` atomically. A re-run of the round
        (after a crash before its commit) adds its entries to those already there: what
        the server learned in an attempt is never dropped from the record.

        ``sums``: ``[{"group", "session", "clients": [ids], "status", "models"}]``.
        """
        folder = self.root / "audit"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"secure_sums_round_{int(round_number):03d}.json"
        tmp = folder / f".{path.name}.tmp-{os.getpid()}"
        try:
            earlier = json.loads(path.read_text("utf-8"))["secure_sums"]
        except (OSError, ValueError, KeyError, TypeError):
            earlier = []
        seen = {json.dumps(e, sort_keys=True) for e in earlier}
        merged = list(earlier) + [e for e in sums if json.dumps(e, sort_keys=True) not in seen]
        doc = {"schema": "clma.audit.secure_sums/1", "round": int(round_number),
               "secure_sums": merged}
        _write_synced(tmp, (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode())
        os.replace(tmp, path)
        return path

    def append_learned(self, entry: Mapping[str, Any]) -> None:
        """Append one learned set to ``audit/learned_sums.jsonl`` and fsync it (the
        differencing rule's write-ahead journal; called before the sum is unmasked).
        Raises OSError when it cannot be made durable (the caller then refuses)."""
        folder = self.root / "audit"
        fresh = not folder.exists()
        folder.mkdir(parents=True, exist_ok=True)
        if fresh:
            _fsync_dir(self.root)
        path = folder / "learned_sums.jsonl"
        new_file = not path.exists()
        line = (json.dumps(dict(entry), sort_keys=True) + "\n").encode()
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)
        if new_file:
            _fsync_dir(folder)

    def learned_entries(self) -> list[dict[str, Any]]:
        """The journal's entries (:meth:`append_learned`), oldest first; a torn last line
        (a crash while appending, before the sum was unmasked) is skipped."""
        try:
            lines = (self.root / "audit" / "learned_sums.jsonl").read_text("utf-8")
        except OSError:
            return []
        out = []
        for line in lines.splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def progress(self) -> dict[str, Any] | None:
        p = self.root / "progress.json"
        try:
            return json.loads(p.read_text("utf-8"))
        except (OSError, ValueError):
            return None

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Exclusive lock for a flow run (non-blocking). Raises :class:`StateLocked`."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise StateLocked(f"state dir {str(self.root)!r}: another run holds its "
                                  "lock") from None
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def serve_lock(self, deployment: str) -> Iterator[dict[str, Any]]:
        """Exclusive lock of one serving process (``clma serve``) on this state directory.

        An ``flock`` on ``serve.lock`` (non-blocking), so the kernel releases it when the
        process ends, also by a crash or SIGKILL: a stale file never blocks the next serve.
        The holder (``pid``, ``host``, ``deployment``, ``since`` as UTC ISO 8601) is written
        into the file while held and cleared on release. Yields the holder.

        Raises:
            ServeLocked: another process holds it; the message names that process.
        """
        import datetime
        import socket

        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / "serve.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                try:
                    holder = json.loads(path.read_text("utf-8") or "{}")
                except (OSError, ValueError):
                    holder = {}
                who = (f"deployment {holder.get('deployment')!r}, pid {holder.get('pid')} on "
                       f"{holder.get('host')}, since {holder.get('since')}"
                       if holder else "a process that has not yet written its name")
                raise ServeLocked(f"state dir {str(self.root)!r} is already served ({who}); "
                                  "stop that `clma serve` first (SIGTERM or Ctrl-C)",
                                  holder) from None
            holder = {"pid": os.getpid(), "host": socket.gethostname(),
                      "deployment": deployment,
                      "since": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(holder).encode(), 0)
            os.fsync(fd)
            try:
                yield holder
            finally:
                os.ftruncate(fd, 0)
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def _remove_partial(self) -> None:
        for p in self.commits_dir.glob(".tmp-*"):
            shutil.rmtree(p, ignore_errors=True)

    def _prune(self, current: str) -> None:
        done = sorted(p.name for p in self.commits_dir.iterdir()
                      if p.is_dir() and p.name.startswith("round_"))
        old = [n for n in done if n != current]
        for n in old[: max(0, len(done) - self.keep)]:
            shutil.rmtree(self.commits_dir / n, ignore_errors=True)


# ----------------------------------------------------------------------------- federation


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode("utf-8")


def snapshot_server(state: ServerState, config: FederationConfig, round_number: int
                    ) -> dict[str, bytes]:
    """The server state after ``round_number`` as snapshot files (registry, models,
    evaluation state, federation)."""
    files = snapshot_files(state)
    files["federation.json"] = _json_bytes({
        "round": int(round_number),
        "name": config.name,
        "seed": config.seed,
        "resume_fingerprint": resume_fingerprint(config),
        "fingerprint_scheme": FINGERPRINT_SCHEME,
    })
    return files


def restore_server(snapshot: CommittedState, config: FederationConfig) -> ServerState:
    """The server state of a snapshot, for a federation with ``config``.

    Raises:
        StateError: the snapshot belongs to a federation with another configuration
            (name, seed, data, model, drift schedule, cohorting, evaluation, budget...).
        StateCorrupt: the models do not match the registry.
    """
    info = snapshot.json("federation.json")
    if info.get("resume_fingerprint") not in accepted_fingerprints(
            config, info.get("fingerprint_scheme")):
        stored = snapshot.json("config.json") if "config.json" in snapshot.files else None
        raise StateError(config_mismatch_message(
            config, stored if isinstance(stored, dict) or stored is None else {}))
    try:
        return restore_files(snapshot.files, int(info["round"]))
    except ValueError as exc:
        raise StateCorrupt(str(exc)) from None
