"""Cohort registry with lineage: global cohort ids, members, parents, history.

Every cohort gets a global integer id, starting at 0 and increasing by one per created
cohort (never reused). A client belongs to exactly one active cohort at a time. Events:

* ``create_root(members, round)``: a new cohort with no parent (round 0: the federation).
* ``split(parent_id, groups, round, reason)``: each group of the parent's members becomes a
  new child cohort (the CLMA quarantine: the cohorter's local groups); members not named
  stay in the parent; a parent left empty is ``retired`` (a ``retire`` lineage event
  follows the split's).
* ``move(client, cohort_id, round, reason)`` / ``assign``: one client changes cohort; a
  source left empty is ``retired`` (with its ``retire`` event).
* ``merge(ids, round, reason)``: the cohorts become one new cohort whose parents are all of
  them; the sources are marked ``merged``.
* ``record_round(round)``: snapshot of the active cohorts' members for that round.

State is JSON-able (:meth:`CohortRegistry.to_dict` / :meth:`CohortRegistry.from_dict`
round-trip exactly), to be stored durably between flow runs and mirrored to MLflow.
Client ids are ``str`` or ``int`` (JSON scalars; ``bool`` is refused).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["CohortRecord", "CohortRegistry", "CohortStatus", "LineageEvent", "RegistryError"]

ClientId = str | int
CohortStatus = Literal["active", "merged", "retired"]


class RegistryError(ValueError):
    """An operation is inconsistent with the registry's state (message says which rule)."""


class CohortRecord(BaseModel):
    """One cohort: id, current members, parents, creation round, status, end round."""

    model_config = ConfigDict(extra="forbid")

    cohort_id: int
    members: list[ClientId]
    parents: list[int] = Field(default_factory=list)
    created_round: int
    status: CohortStatus = "active"
    ended_round: int | None = None


class LineageEvent(BaseModel):
    """A change of the cohort structure.

    ``kind`` split | merge | move | create | retire; ``parents`` the source cohorts,
    ``children`` the resulting ones, ``clients`` the clients concerned (for split/move).
    """

    model_config = ConfigDict(extra="forbid")

    kind: Literal["create", "split", "merge", "move", "retire"]
    round: int
    parents: list[int] = Field(default_factory=list)
    children: list[int] = Field(default_factory=list)
    clients: list[ClientId] = Field(default_factory=list)
    reason: str = ""


def _check_client(c: Any) -> ClientId:
    if isinstance(c, bool) or not isinstance(c, (str, int)):
        raise TypeError("client id: must be a str or an int")
    return c


def _check_round(r: Any) -> int:
    if isinstance(r, bool) or not isinstance(r, int) or r < 0:
        raise ValueError("round: must be an integer >= 0")
    return r


class CohortRegistry:
    """Global cohort ids, membership, lineage and per-round history (see module docs)."""

    def __init__(self) -> None:
        self._cohorts: dict[int, CohortRecord] = {}
        self._client_cohort: dict[ClientId, int] = {}
        self._lineage: list[LineageEvent] = []
        self._history: dict[int, dict[int, list[ClientId]]] = {}
        self._next_id = 0

    # ------------------------------------------------------------------ queries
    def cohort(self, cohort_id: int) -> CohortRecord:
        """The record of ``cohort_id`` (a copy). Raises ``KeyError`` if unknown."""
        if cohort_id not in self._cohorts:
            raise KeyError(f"cohort_id: unknown cohort {cohort_id!r}")
        return self._cohorts[cohort_id].model_copy(deep=True)

    def cohort_of(self, client: ClientId) -> int:
        """Active cohort id of ``client``. Raises ``KeyError`` if the client is unknown."""
        if client not in self._client_cohort:
            raise KeyError(f"client: {client!r} is in no cohort")
        return self._client_cohort[client]

    def members(self, cohort_id: int) -> list[ClientId]:
        """Current members of ``cohort_id``."""
        return list(self.cohort(cohort_id).members)

    def active_cohorts(self) -> list[int]:
        """Ids of active cohorts, ascending."""
        return sorted(c for c, r in self._cohorts.items() if r.status == "active")

    @property
    def cohorts(self) -> dict[int, CohortRecord]:
        """All cohort records by id (copies)."""
        return {c: r.model_copy(deep=True) for c, r in self._cohorts.items()}

    @property
    def history(self) -> dict[int, dict[int, list[ClientId]]]:
        """round -> {cohort id: members} as recorded by :meth:`record_round`."""
        return {r: {c: list(m) for c, m in snap.items()} for r, snap in self._history.items()}

    @property
    def lineage(self) -> list[LineageEvent]:
        """All structure events in order."""
        return [e.model_copy(deep=True) for e in self._lineage]

    def children(self, cohort_id: int) -> list[int]:
        """Cohorts that list ``cohort_id`` among their parents."""
        self.cohort(cohort_id)
        return sorted(c for c, r in self._cohorts.items() if cohort_id in r.parents)

    def descendants(self, cohort_id: int) -> list[int]:
        """Every cohort reachable from ``cohort_id`` through splits and merges (ascending)."""
        seen: set[int] = set()
        stack = self.children(cohort_id)
        while stack:
            c = stack.pop()
            if c not in seen:
                seen.add(c)
                stack.extend(self.children(c))
        return sorted(seen)

    def ancestors(self, cohort_id: int) -> list[int]:
        """Every cohort ``cohort_id`` descends from (ascending)."""
        seen: set[int] = set()
        stack = list(self.cohort(cohort_id).parents)
        while stack:
            c = stack.pop()
            if c not in seen:
                seen.add(c)
                stack.extend(self._cohorts[c].parents)
        return sorted(seen)

    # ------------------------------------------------------------------ changes
    def _new(self, members: list[ClientId], parents: list[int], round_: int) -> int:
        cid = self._next_id
        self._next_id += 1
        self._cohorts[cid] = CohortRecord(cohort_id=cid, members=list(members),
                                          parents=list(parents), created_round=round_)
        for m in members:
            self._client_cohort[m] = cid
        return cid

    def _active(self, cohort_id: int, field: str = "cohort_id") -> CohortRecord:
        if cohort_id not in self._cohorts:
            raise RegistryError(f"{field}: unknown cohort {cohort_id!r}")
        rec = self._cohorts[cohort_id]
        if rec.status != "active":
            raise RegistryError(f"{field}: cohort {cohort_id} is {rec.status}, not active")
        return rec

    def _end(self, rec: CohortRecord, status: CohortStatus, round_: int) -> None:
        rec.status = status
        rec.ended_round = round_

    def _retire_emptied(self, rec: CohortRecord, round_: int, reason: str) -> None:
        """End a cohort a split or a move left without members, with its ``retire``
        lineage event (after the event that emptied it)."""
        self._end(rec, "retired", round_)
        self._lineage.append(LineageEvent(kind="retire", round=round_,
                                          parents=[rec.cohort_id], reason=reason))

    def create_root(self, members: Iterable[ClientId], round: int = 0,  # noqa: A002
                    reason: str = "initial cohort") -> int:
        """Create a parentless cohort of clients not yet in any cohort; returns its id."""
        r = _check_round(round)
        mem = [_check_client(m) for m in members]
        if len(set(mem)) != len(mem):
            raise RegistryError("members: duplicate client ids")
        taken = [m for m in mem if m in self._client_cohort]
        if taken:
            raise RegistryError(f"members: clients {taken[:5]} already belong to a cohort")
        cid = self._new(mem, [], r)
        self._lineage.append(LineageEvent(kind="create", round=r, children=[cid],
                                          clients=mem, reason=reason))
        return cid

    def split(self, parent_id: int, groups: Mapping[int, Iterable[ClientId]], round: int,  # noqa: A002
              reason: str = "drift") -> dict[int, int]:
        """Move each group of the parent's members into a new child cohort.

        ``groups`` maps a local group id (e.g. ``CohortAssignment.groups_by_cohort()``) to
        member clients, all current members of ``parent_id``. Returns local id -> new global
        id (children created in ascending local id). Members not in any group stay in the
        parent; an emptied parent becomes ``retired``, recorded by a ``retire`` lineage event
        (reason "emptied by a split") after the split's.
        """
        r = _check_round(round)
        parent = self._active(parent_id, "parent_id")
        seen: set[ClientId] = set()
        ordered = sorted(groups)
        for g in ordered:
            for c in groups[g]:
                _check_client(c)
                if c in seen:
                    raise RegistryError(f"groups: client {c!r} appears in two groups")
                if self._client_cohort.get(c) != parent_id:
                    raise RegistryError(f"groups: client {c!r} is not a member of cohort "
                                        f"{parent_id}")
                seen.add(c)
        mapping: dict[int, int] = {}
        moved: list[ClientId] = []
        for g in ordered:
            mem = list(groups[g])
            if not mem:
                raise RegistryError(f"groups: group {g} is empty")
            mapping[g] = self._new(mem, [parent_id], r)
            moved.extend(mem)
        parent.members = [m for m in parent.members if m not in seen]
        self._lineage.append(LineageEvent(kind="split", round=r, parents=[parent_id],
                                          children=list(mapping.values()), clients=moved,
                                          reason=reason))
        if not parent.members:
            self._retire_emptied(parent, r, "emptied by a split")
        return mapping

    def move(self, client: ClientId, cohort_id: int, round: int,  # noqa: A002
             reason: str = "reassigned") -> None:
        """Move one client into an existing active cohort (a client new to the registry is
        simply added). An emptied source cohort becomes ``retired``, recorded by a
        ``retire`` lineage event (reason "emptied by a move") after the move's."""
        r = _check_round(round)
        _check_client(client)
        target = self._active(cohort_id)
        source_id = self._client_cohort.get(client)
        if source_id == cohort_id:
            return
        if source_id is not None:
            source = self._cohorts[source_id]
            source.members = [m for m in source.members if m != client]
        target.members.append(client)
        self._client_cohort[client] = cohort_id
        self._lineage.append(LineageEvent(
            kind="move", round=r, parents=[] if source_id is None else [source_id],
            children=[cohort_id], clients=[client], reason=reason))
        if source_id is not None and not self._cohorts[source_id].members:
            self._retire_emptied(self._cohorts[source_id], r, "emptied by a move")

    assign = move

    def merge(self, cohort_ids: Iterable[int], round: int,  # noqa: A002
              reason: str = "reconverged") -> int:
        """Merge two or more active cohorts into a new one (parents = the sources, which are
        marked ``merged``); returns the new id."""
        r = _check_round(round)
        ids = list(dict.fromkeys(cohort_ids))
        if len(ids) < 2:
            raise RegistryError("cohort_ids: need at least two distinct cohorts to merge")
        recs = [self._active(c, "cohort_ids") for c in ids]
        members = [m for rec in recs for m in rec.members]
        for rec in recs:
            self._end(rec, "merged", r)
            rec.members = []
        new = self._new(members, ids, r)
        self._lineage.append(LineageEvent(kind="merge", round=r, parents=ids, children=[new],
                                          clients=members, reason=reason))
        return new

    def retire(self, cohort_id: int, round: int, reason: str = "retired") -> None:  # noqa: A002
        """Retire an active cohort that has no members left."""
        r = _check_round(round)
        rec = self._active(cohort_id)
        if rec.members:
            raise RegistryError(f"cohort_id: cohort {cohort_id} still has members")
        self._end(rec, "retired", r)
        self._lineage.append(LineageEvent(kind="retire", round=r, parents=[cohort_id],
                                          reason=reason))

    def record_round(self, round: int) -> dict[int, list[ClientId]]:  # noqa: A002
        """Record (or overwrite) the membership of active cohorts for ``round``."""
        r = _check_round(round)
        snap = {c: list(self._cohorts[c].members) for c in self.active_cohorts()}
        self._history[r] = snap
        return {c: list(m) for c, m in snap.items()}

    # ------------------------------------------------------------------ persistence
    def to_dict(self) -> dict[str, Any]:
        """JSON-able state (lists only, so int client/cohort ids survive JSON)."""
        return {
            "version": 1,
            "next_id": self._next_id,
            "cohorts": [r.model_dump() for r in self._cohorts.values()],
            "lineage": [e.model_dump() for e in self._lineage],
            "history": [{"round": r, "cohorts": [{"cohort_id": c, "members": list(m)}
                                                 for c, m in snap.items()]}
                        for r, snap in sorted(self._history.items())],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CohortRegistry:
        """Rebuild a registry from :meth:`to_dict` output (validated)."""
        if data.get("version") != 1:
            raise RegistryError("version: unsupported registry state version")
        reg = cls()
        for raw in data["cohorts"]:
            rec = CohortRecord.model_validate(raw)
            if rec.cohort_id in reg._cohorts:
                raise RegistryError(f"cohorts: duplicate cohort id {rec.cohort_id}")
            reg._cohorts[rec.cohort_id] = rec
            if rec.status == "active":
                for m in rec.members:
                    if m in reg._client_cohort:
                        raise RegistryError(f"cohorts: client {m!r} in two active cohorts")
                    reg._client_cohort[m] = rec.cohort_id
        reg._lineage = [LineageEvent.model_validate(e) for e in data["lineage"]]
        reg._history = {int(h["round"]): {int(c["cohort_id"]): list(c["members"])
                                          for c in h["cohorts"]} for h in data["history"]}
        reg._next_id = int(data["next_id"])
        if reg._cohorts and reg._next_id <= max(reg._cohorts):
            raise RegistryError("next_id: must exceed every cohort id")
        return reg
