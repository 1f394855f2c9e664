"""The exchange journal of the Flower transport: no committed client exchange runs twice.

Every exchange the transport completes (one protocol call of one round: a training
chunk, a secure-aggregation step) is recorded with, per client, the digest of the exact
message it was sent (:func:`clma.flower.codec.content_digest`) and its outcome. When a
later call of the same round and step asks a client the same message -- a Prefect retry,
or the round re-run after the orchestrating process crashed and the federation was resumed
from its last committed round -- that client gets its recorded outcome back and is not
sent anything; only clients the record does not cover are asked. Rounds are deterministic
given the committed state (every random choice is seeded by (seed, round)), so a resumed
round asks the same messages (a client that has since left is simply not asked).

With a state folder the journal lives in ``<state dir>/flower/`` (server-internal, not
part of the committed snapshots):

* ``rounds/round_NNNNNN/<call>-<key>.json`` (``.npz`` for training): the replies of one
  exchange (what the server received over the wire: updates, public keys, encrypted shares,
  masked vectors, unmasking shares; never a client's data or raw metric), written
  atomically; removed once the round is committed in the state folder;
* ``progress.jsonl``: one line per exchange (Flower run id, round, call, key, ``sent`` or
  ``replayed``, counts, seconds) -- the per-round step progress;
* ``runs.jsonl``: one line per Flower run that drove the federation.

Without a state folder the journal is kept in memory (a retry inside the run is still
answered from it).
"""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["ExchangeJournal", "JournalEntry", "committed_round"]

FORMAT = "clma.flower.journal/1"


def committed_round(state_dir: str | os.PathLike) -> int:
    """The round committed in a federation state folder (0 when nothing is)."""
    from clma.state import StateStore

    name = StateStore(state_dir).current_name()
    if name is None:
        return 0
    return int(name.split("_", 1)[1].split("-", 1)[0])


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class JournalEntry:
    """The recorded replies of one exchange: ``ok`` client id -> stored reply (bytes, or a
    train reply ``(params, n_samples, drift_flag, cohort_id)``), ``failed`` client id ->
    reason."""

    def __init__(self, ok: dict[int, Any], failed: dict[int, str], meta: dict[str, Any]) -> None:
        self.ok, self.failed, self.meta = ok, failed, meta


class ExchangeJournal:
    """Recorded exchanges of the rounds in progress (module docstring).

    Args:
        state_dir: the federation's state folder (None: memory only).
        run_id: the Flower run driving the federation now (recorded with every line).
    """

    def __init__(self, state_dir: str | os.PathLike | None, run_id: int | None = None) -> None:
        self.state_dir = Path(state_dir) if state_dir is not None else None
        self.root = self.state_dir / "flower" if self.state_dir is not None else None
        self.run_id = run_id
        self._memory: dict[tuple[int, str, str], JournalEntry] = {}
        self._lock = threading.Lock()
        self.lines: list[dict[str, Any]] = []
        if self.root is not None:
            self.root.mkdir(parents=True, exist_ok=True)
            self._append("runs.jsonl", {"flower_run_id": run_id, "pid": os.getpid(),
                                        "committed_round": self.committed(), "at": time.time()})

    # ---------------------------------------------------------------- files
    def committed(self) -> int:
        return committed_round(self.state_dir) if self.state_dir is not None else 0

    def _append(self, name: str, doc: Mapping[str, Any]) -> None:
        assert self.root is not None
        with open(self.root / name, "a", encoding="utf-8") as f:
            f.write(json.dumps(dict(doc), sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def _path(self, round_number: int, call: str, key: str, train: bool) -> Path:
        assert self.root is not None
        return (self.root / "rounds" / f"round_{round_number:06d}"
                / f"{call}-{key}.{'npz' if train else 'json'}")

    def prune(self) -> None:
        """Remove the recorded exchanges of committed rounds (they are never asked again)."""
        if self.root is None:
            return
        done = self.committed()
        base = self.root / "rounds"
        if not base.is_dir():
            return
        for p in base.iterdir():
            if p.is_dir() and p.name.startswith("round_") and int(p.name[6:]) <= done:
                shutil.rmtree(p, ignore_errors=True)

    # ---------------------------------------------------------------- entries
    def lookup(self, round_number: int, call: str, key: str) -> JournalEntry | None:
        """The recorded exchange with this key, or None."""
        with self._lock:
            hit = self._memory.get((round_number, call, key))
        if hit is not None or self.root is None:
            return hit
        train = call == "train"
        p = self._path(round_number, call, key, train)
        if not p.exists():
            return None
        try:
            return self._load(p, train)
        except (OSError, ValueError, KeyError):  # a torn or foreign file: not a record
            return None

    def covered(self, round_number: int, call: str, digests: Mapping[int, str]
                ) -> dict[int, tuple[str, Any]]:
        """The clients whose exact request (``digests``: client id -> digest of the message
        it would be sent) a recorded exchange of this round and call already carried:
        client id -> ``("ok", stored reply)`` or ``("failed", reason)``, as recorded."""
        entries: list[JournalEntry] = []
        with self._lock:
            entries += [e for (r, c, _), e in self._memory.items()
                        if r == round_number and c == call]
        if self.root is not None:
            folder = self.root / "rounds" / f"round_{round_number:06d}"
            train = call == "train"
            for f in sorted(folder.glob(f"{call}-*.{'npz' if train else 'json'}")):
                try:
                    entries.append(self._load(f, train))
                except (OSError, ValueError, KeyError):  # torn or foreign: not a record
                    continue
        out: dict[int, tuple[str, Any]] = {}
        for e in entries:
            sent = {int(c): d for c, d in e.meta.get("digests", {}).items()}
            for c, d in digests.items():
                if c in out or sent.get(c) != d:
                    continue
                if c in e.ok:
                    out[c] = ("ok", e.ok[c])
                elif c in e.failed:
                    out[c] = ("failed", e.failed[c])
        return out

    def clients_in_progress(self) -> set[int]:
        """Clients that recorded exchanges of rounds not committed yet were sent: a resumed
        round asks them again (a client gone since is a dropout of the steps it misses,
        not a change of the round)."""
        out: set[int] = set()
        done = self.committed()
        with self._lock:
            for (r, _, _), e in self._memory.items():
                if r > done:
                    out |= {int(c) for c in e.meta.get("digests", {})}
        if self.root is None or not (self.root / "rounds").is_dir():
            return out
        for folder in (self.root / "rounds").iterdir():
            if not folder.name.startswith("round_") or int(folder.name[6:]) <= done:
                continue
            for f in folder.iterdir():
                if f.suffix not in (".json", ".npz") or f.name.startswith("."):
                    continue
                try:
                    e = self._load(f, f.suffix == ".npz")
                except (OSError, ValueError, KeyError):
                    continue
                out |= {int(c) for c in e.meta.get("digests", {})}
        return out

    def record(self, round_number: int, call: str, key: str, entry: JournalEntry) -> None:
        """Record one completed exchange (atomically, before its replies are used)."""
        with self._lock:
            self._memory[(round_number, call, key)] = entry
        if self.root is None:
            return
        train = call == "train"
        _write_atomic(self._path(round_number, call, key, train), self._dump(entry, train))

    def log(self, **fields: Any) -> None:
        """One line of step progress."""
        doc = {"flower_run_id": self.run_id, "at": time.time(), **fields}
        self.lines.append(doc)
        if self.root is not None:
            self._append("progress.jsonl", doc)

    # ---------------------------------------------------------------- encoding
    @staticmethod
    def _dump(entry: JournalEntry, train: bool) -> bytes:
        meta = {"format": FORMAT, "meta": entry.meta,
                "failed": {str(c): r for c, r in sorted(entry.failed.items())}}
        if not train:
            meta["ok"] = {str(c): base64.b64encode(b).decode("ascii")
                          for c, b in sorted(entry.ok.items())}
            return (json.dumps(meta, sort_keys=True) + "\n").encode("utf-8")
        meta["ok"] = {str(c): [int(n), bool(f), int(k)] for c, (_, n, f, k) in sorted(entry.ok.items())}
        buf = io.BytesIO()
        np.savez(buf, meta=np.frombuffer(json.dumps(meta, sort_keys=True).encode(), np.uint8),
                 **{f"params_{c}": np.asarray(p, dtype=np.float32)
                    for c, (p, _, _, _) in sorted(entry.ok.items())})
        return buf.getvalue()

    @staticmethod
    def _load(path: Path, train: bool) -> JournalEntry:
        if not train:
            doc = json.loads(path.read_text("utf-8"))
            if doc.get("format") != FORMAT:
                raise ValueError("journal: unknown format")
            ok = {int(c): base64.b64decode(b) for c, b in doc["ok"].items()}
            return JournalEntry(ok, {int(c): r for c, r in doc["failed"].items()}, doc["meta"])
        with np.load(path, allow_pickle=False) as z:
            doc = json.loads(bytes(z["meta"]).decode("utf-8"))
            if doc.get("format") != FORMAT:
                raise ValueError("journal: unknown format")
            ok = {int(c): (z[f"params_{c}"].astype(np.float32), int(n), bool(f), int(k))
                  for c, (n, f, k) in doc["ok"].items()}
        return JournalEntry(ok, {int(c): r for c, r in doc["failed"].items()}, doc["meta"])

