"""A durable, transactional privacy-budget ledger (SQLite, WAL mode).

Model. Every client holds the same per-epoch cap (policy); the ledger accounts the
worst-case client, i.e. one that takes part in every release of a line. Each budget epoch
has three line items (:class:`~clma.budget.policy.LineItem`): ``training``,
``evaluation.global`` and ``evaluation.regional``; a charge that would take its line above
the line's cap is refused *before any noise is drawn*.

Adjacency: replace-one client, for every line
(:data:`clma.budget.accounting.ADJACENCY`); it is reported in every row of :meth:`table`.

Composition (see :mod:`clma.budget.accounting`): sequential across the rounds of an
epoch, with dp-accounting's RDP accountant for lines with DP-FedAvg rounds (sampled
without replacement), its PLD accountant (cross-checked by RDP) for other lines with
Gaussian events, or, for lines with only Laplace events, the exact running sum of the
epsilons. Parallel composition across
regions: the regional line is charged ``max over regions`` of each region's composed
spend while every client stays in one region for the whole epoch, and the composition of
all regional events (the *sum*) as soon as one client moves region within the epoch (the
ledger tracks client -> region per epoch from the ``membership`` passed with each
regional charge, as keyed HMACs of the client ids, or the caller declares
``region_membership_stable=False``). A move that would take the line above its cap refuses
that charge. Training (DP-FedAvg, Gaussian noise on each cohort's clipped sum) charges
one event per round,
``MechanismEvent.gaussian_sampled_without_replacement(z, population_size, sample_size)``
(:meth:`PrivacyLedger.charge_training`); with several cohorts pass the smallest noise
multiplier (each client is in one cohort per round, but clients change cohorts between
rounds, so the worst cohort is charged every round). Poisson-sampled events (older
ledgers) are refused.

Lifetime cap (policy ``[budget] lifetime_epsilon_per_client``,
``lifetime_delta_per_client``): a charge that would take a client's lifetime spend past it
is refused with ``exceeds_lifetime_cap`` (after the line-cap check). Lifetime spend is the
basic composition of the per-epoch totals (epsilons add, deltas add), each epoch's total
being the basic composition of its line items, i.e. the same rule as within an epoch: a
conservative bound (it does not compose the Gaussian rounds of different epochs with
PLD / RDP, and it charges the worst-case client of every epoch, whichever region that
client is in). Spend only grows, so a refusal persists across re-runs and reopenings; a
key granted before the cap was reached keeps its reservation (idempotency unchanged).
Rows of :meth:`PrivacyLedger.table` report it next to the epoch spend.

Idempotency and crashes. A charge is keyed by ``(epoch, round, release)``. The two-phase
API writes a PENDING row in the same transaction as the cap check (``reserve``), the
caller then draws noise, and ``commit`` marks it COMMITTED and stores the published
payload (e.g. the envelope JSON). PENDING rows count as spent. A re-run with the same key
reuses the PENDING reservation (a crash between noise and commit therefore charges once)
or returns the COMMITTED payload so the caller republishes it instead of drawing new
noise; the same key with different parameters raises :class:`IdempotencyConflictError`.
Noise drawn before a crash was never published, so drawing fresh noise on a re-run of a
PENDING reservation releases nothing twice.

Concurrency: every read-check-write runs in ``BEGIN IMMEDIATE`` (one writer at a time,
across threads and processes); each operation opens its own connection.

Borrowing and back-off: :meth:`PrivacyLedger.record_borrow_decision` (called by
:func:`clma.budget.policy.decide_borrow`) and :meth:`PrivacyLedger.freeze_training`.
Every charge, refusal and decision records the policy version.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import math
import secrets
import sqlite3
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from clma.budget.accounting import ADJACENCY_NAME, CompositionResult, MechanismEvent, compose
from clma.budget.policy import (
    BorrowApproval,
    BorrowDecision,
    BorrowRefusal,
    BorrowRequest,
    LineItem,
    PrivacyPolicy,
    default_policy,
    evaluate_borrow,
)

__all__ = [
    "DEFAULT_LEDGER_FILENAME",
    "IdempotencyConflictError",
    "LedgerError",
    "LedgerRow",
    "PrivacyLedger",
    "Reservation",
    "ReservationStatus",
]

DEFAULT_LEDGER_FILENAME = "privacy_ledger.sqlite"
_SCHEMA_VERSION = "1"
_RELEASE_MAX_LEN = 200
# Deltas are sums of policy fractions of the epoch delta (e.g. 0.7 * 1e-5): a lifetime delta
# exactly at the cap may exceed it by rounding, so the comparison allows this relative slack.
_DELTA_RELATIVE_TOLERANCE = 1e-9

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS epoch_lines (
    epoch INTEGER NOT NULL, line TEXT NOT NULL,
    base_epsilon REAL NOT NULL, delta REAL NOT NULL, policy_version TEXT NOT NULL,
    PRIMARY KEY (epoch, line));
CREATE TABLE IF NOT EXISTS epoch_state (
    epoch INTEGER PRIMARY KEY,
    training_frozen INTEGER NOT NULL DEFAULT 0,
    regional_moved INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS charges (
    id INTEGER PRIMARY KEY,
    epoch INTEGER NOT NULL, round INTEGER NOT NULL, release TEXT NOT NULL,
    line TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('pending', 'committed')),
    events TEXT NOT NULL,
    line_epsilon_after REAL NOT NULL,
    result TEXT,
    policy_version TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 1,
    reserved_at TEXT NOT NULL, committed_at TEXT,
    UNIQUE (epoch, round, release));
CREATE TABLE IF NOT EXISTS membership (
    epoch INTEGER NOT NULL, client_key TEXT NOT NULL, region TEXT NOT NULL,
    PRIMARY KEY (epoch, client_key));
CREATE TABLE IF NOT EXISTS borrows (
    id INTEGER PRIMARY KEY,
    epoch INTEGER NOT NULL, line TEXT NOT NULL, epsilon REAL NOT NULL,
    approved INTEGER NOT NULL, refusal TEXT, approver TEXT, approver_reason TEXT NOT NULL,
    run_id TEXT NOT NULL, request_reason TEXT NOT NULL, training_frozen INTEGER NOT NULL,
    policy_version TEXT NOT NULL, decided_at TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS decisions (
    id INTEGER PRIMARY KEY,
    epoch INTEGER, kind TEXT NOT NULL, detail TEXT NOT NULL,
    policy_version TEXT NOT NULL, decided_at TEXT NOT NULL);
"""


class LedgerError(ValueError):
    """A ledger call broke a rule (the message names the argument and the rule)."""


class IdempotencyConflictError(LedgerError):
    """The idempotency key was already used for a charge with different parameters."""


class ReservationStatus(StrEnum):
    """Outcome of :meth:`PrivacyLedger.reserve`.

    ``granted``: a new PENDING charge was written; draw noise, then commit.
    ``reused_pending``: the key had a PENDING charge (crash or retry); it is reused, no
    new charge; draw noise, then commit. ``already_committed``: the release was published;
    do not draw noise, republish :attr:`Reservation.stored_result`. ``refused``: the line
    would exceed its cap or is frozen; draw no noise.
    """

    GRANTED = "granted"
    REUSED_PENDING = "reused_pending"
    ALREADY_COMMITTED = "already_committed"
    REFUSED = "refused"


@dataclass
class Reservation:
    """The answer to a reservation. ``may_draw_noise`` is the one flag callers test."""

    ledger: PrivacyLedger = field(repr=False)
    epoch: int
    round: int
    release: str
    line: LineItem
    status: ReservationStatus
    refusal: str | None = None
    line_epsilon_after: float | None = None
    line_cap_epsilon: float | None = None
    lifetime_epsilon_after: float | None = None
    lifetime_delta_after: float | None = None
    stored_result: str | None = None
    committed: bool = False

    @property
    def may_draw_noise(self) -> bool:
        return self.status in (ReservationStatus.GRANTED, ReservationStatus.REUSED_PENDING)

    @property
    def already_committed(self) -> bool:
        return self.status is ReservationStatus.ALREADY_COMMITTED

    @property
    def refused(self) -> bool:
        return self.status is ReservationStatus.REFUSED

    def commit(self, result: str | None = None) -> str | None:
        """Commit this reservation, storing ``result`` (the published payload).

        Returns the stored payload: if another attempt committed the same key first, its
        payload wins and is returned (publish that one).
        """
        if not self.may_draw_noise:
            raise LedgerError("commit: only a granted or reused reservation can be committed")
        stored = self.ledger.commit(self.round, self.release, result)
        self.committed = True
        self.stored_result = stored
        return stored


class LedgerRow(BaseModel):
    """One row of :meth:`PrivacyLedger.table` (per client, per epoch, per line item).

    The ``lifetime_*`` columns are per client over epochs, the same in every row of an
    epoch: ``lifetime_spent_epsilon`` / ``lifetime_spent_delta`` is the spend of all epochs
    up to and including this one (basic composition of the per-epoch totals),
    ``lifetime_cap_*`` the policy's lifetime cap (``None``: a policy without one) and
    ``lifetime_remaining_epsilon`` the cap minus that spend (at least 0). ``adjacency`` is
    the neighbouring relation every spend is accounted under
    (:data:`clma.budget.accounting.ADJACENCY_NAME`).
    """

    model_config = ConfigDict(frozen=True)

    epoch: int
    line_item: str
    cap_epsilon: float
    spent_epsilon: float
    remaining_epsilon: float
    delta: float
    borrowed_epsilon: float
    lent_epsilon: float
    approver: str
    training_frozen: bool
    composition: str
    pending_charges: int
    policy_version: str
    lifetime_spent_epsilon: float = 0.0
    lifetime_spent_delta: float = 0.0
    lifetime_cap_epsilon: float | None = None
    lifetime_cap_delta: float | None = None
    lifetime_remaining_epsilon: float | None = None
    adjacency: str = ADJACENCY_NAME


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds")


def _canonical(obj: object) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


class PrivacyLedger:
    """Durable privacy-budget ledger for one federation.

    Args:
        path: a directory (the ledger is ``<path>/privacy_ledger.sqlite``) or a file path
            (anything with a suffix, e.g. ``state/ledger.sqlite``). A missing path without
            a suffix is created as a directory.
        policy: the privacy policy (default: the shipped one). Caps of an epoch are fixed
            by the policy in force when the epoch is first touched; entries record the
            version.
        busy_timeout_s: how long a writer waits for the lock.
    """

    def __init__(
        self,
        path: str | Path,
        policy: PrivacyPolicy | None = None,
        *,
        busy_timeout_s: float = 60.0,
    ) -> None:
        p = Path(path)
        if p.is_dir() or (not p.suffix and not p.exists()):
            p.mkdir(parents=True, exist_ok=True)
            p = p / DEFAULT_LEDGER_FILENAME
        else:
            p.parent.mkdir(parents=True, exist_ok=True)
        self.path = p
        self.policy = policy if policy is not None else default_policy()
        self._timeout = float(busy_timeout_s)
        with self._connect() as con:
            con.execute("PRAGMA journal_mode=WAL")
            con.executescript(_SCHEMA)
            with self._tx(con):
                con.execute(
                    "INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (_SCHEMA_VERSION,)
                )
                con.execute(
                    "INSERT OR IGNORE INTO meta VALUES ('membership_key', ?)",
                    (secrets.token_hex(32),),
                )
                last = con.execute(
                    "SELECT value FROM meta WHERE key = 'policy_version'"
                ).fetchone()
                if last is None or last[0] != self.policy.policy_version:
                    con.execute(
                        "INSERT OR REPLACE INTO meta VALUES ('policy_version', ?)",
                        (self.policy.policy_version,),
                    )
                    self._decide(con, None, "policy_opened", {
                        "previous_policy_version": None if last is None else last[0],
                        "content_hash": self.policy.content_hash,
                    })
            self._membership_key = bytes.fromhex(
                con.execute("SELECT value FROM meta WHERE key = 'membership_key'").fetchone()[0]
            )

    # ------------------------------------------------------------------ plumbing

    @contextlib.contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        con = sqlite3.connect(self.path, timeout=self._timeout, isolation_level=None)
        try:
            con.execute("PRAGMA synchronous=FULL")
            con.execute("PRAGMA foreign_keys=ON")
            yield con
        finally:
            con.close()

    @contextlib.contextmanager
    def _tx(self, con: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
        con.execute("BEGIN IMMEDIATE")
        try:
            yield con
        except BaseException:
            con.execute("ROLLBACK")
            raise
        else:
            con.execute("COMMIT")

    def _decide(self, con: sqlite3.Connection, epoch: int | None, kind: str, detail: dict) -> int:
        cur = con.execute(
            "INSERT INTO decisions (epoch, kind, detail, policy_version, decided_at)"
            " VALUES (?, ?, ?, ?, ?)",
            (epoch, kind, _canonical(detail), self.policy.policy_version, _now()),
        )
        return int(cur.lastrowid)

    def _ensure_epoch(self, con: sqlite3.Connection, epoch: int) -> None:
        for line in LineItem:
            eps, delta = self.policy.line_cap(line)
            con.execute(
                "INSERT OR IGNORE INTO epoch_lines VALUES (?, ?, ?, ?, ?)",
                (epoch, line.value, eps, delta, self.policy.policy_version),
            )
        con.execute("INSERT OR IGNORE INTO epoch_state (epoch) VALUES (?)", (epoch,))

    def _line_params(self, con: sqlite3.Connection, epoch: int, line: LineItem) -> tuple[float, float, str]:
        row = con.execute(
            "SELECT base_epsilon, delta, policy_version FROM epoch_lines WHERE epoch=? AND line=?",
            (epoch, line.value),
        ).fetchone()
        if row is None:
            eps, delta = self.policy.line_cap(line)
            return eps, delta, self.policy.policy_version
        return float(row[0]), float(row[1]), str(row[2])

    def _borrowed(self, con: sqlite3.Connection, epoch: int, line: LineItem) -> tuple[float, float, str]:
        into = con.execute(
            "SELECT epsilon, approver FROM borrows WHERE epoch=? AND line=? AND approved=1",
            (epoch, line.value),
        ).fetchall()
        lent = con.execute(
            "SELECT epsilon FROM borrows WHERE epoch=? AND line=? AND approved=1",
            (epoch - 1, line.value),
        ).fetchall()
        return (
            math.fsum(r[0] for r in into),
            math.fsum(r[0] for r in lent),
            ",".join(sorted({r[1] for r in into if r[1]})),
        )

    def _cap(self, con: sqlite3.Connection, epoch: int, line: LineItem) -> float:
        base, _, _ = self._line_params(con, epoch, line)
        borrowed, lent, _ = self._borrowed(con, epoch, line)
        return base + borrowed - lent

    def _state(self, con: sqlite3.Connection, epoch: int) -> tuple[bool, bool]:
        row = con.execute(
            "SELECT training_frozen, regional_moved FROM epoch_state WHERE epoch=?", (epoch,)
        ).fetchone()
        return (False, False) if row is None else (bool(row[0]), bool(row[1]))

    def _line_events(
        self, con: sqlite3.Connection, epoch: int, line: LineItem
    ) -> list[tuple[str | None, MechanismEvent]]:
        out: list[tuple[str | None, MechanismEvent]] = []
        for (events_json,) in con.execute(
            "SELECT events FROM charges WHERE epoch=? AND line=?", (epoch, line.value)
        ):
            for region, ev in json.loads(events_json):
                out.append((region, MechanismEvent.model_validate(ev)))
        return out

    def _compose_line(
        self,
        line: LineItem,
        delta: float,
        events: Sequence[tuple[str | None, MechanismEvent]],
        regional_moved: bool,
    ) -> CompositionResult:
        acc = self.policy.accounting
        kw = {
            "value_discretization_interval": acc.pld_value_discretization_interval,
            "rdp_tolerance": acc.rdp_cross_check_tolerance,
        }
        if line is not LineItem.EVALUATION_REGIONAL or regional_moved:
            return compose([ev for _, ev in events], delta, **kw)
        by_region: dict[str | None, list[MechanismEvent]] = {}
        for region, ev in events:
            by_region.setdefault(region, []).append(ev)
        results = [compose(evs, delta, **kw) for evs in by_region.values()]
        if not results:
            return compose([], delta, **kw)
        worst = max(results, key=lambda r: r.epsilon)
        # a client of a region with Gaussian releases spends the line's delta even when a
        # pure-epsilon region has the largest epsilon
        return worst.model_copy(update={"delta": max(r.delta for r in results)})

    def _epochs(self, con: sqlite3.Connection) -> list[int]:
        return [int(r[0]) for r in con.execute("SELECT DISTINCT epoch FROM epoch_lines ORDER BY epoch")]

    def _epoch_total(
        self, con: sqlite3.Connection, epoch: int,
        override: tuple[LineItem, CompositionResult] | None = None,
    ) -> tuple[float, float]:
        """(epsilon, delta) of one epoch for the worst-case client: basic composition of
        its line items (``override`` replaces one line's composed spend)."""
        _, moved = self._state(con, epoch)
        eps: list[float] = []
        deltas: list[float] = []
        for line in LineItem:
            if override is not None and override[0] is line:
                res = override[1]
            else:
                _, delta, _ = self._line_params(con, epoch, line)
                res = self._compose_line(line, delta, self._line_events(con, epoch, line), moved)
            eps.append(res.epsilon)
            deltas.append(res.delta)
        return math.fsum(eps), math.fsum(deltas)

    def _lifetime_totals(
        self, con: sqlite3.Connection,
        override: tuple[int, LineItem, CompositionResult] | None = None,
    ) -> dict[int, tuple[float, float]]:
        """Per touched epoch, its (epsilon, delta) total (see :meth:`_epoch_total`)."""
        out = {}
        for e in self._epochs(con):
            line_override = None
            if override is not None and override[0] == e:
                line_override = (override[1], override[2])
            out[e] = self._epoch_total(con, e, line_override)
        return out

    def _client_key(self, client_id: str) -> str:
        return hmac.new(self._membership_key, str(client_id).encode("utf-8"), hashlib.sha256).hexdigest()

    # ------------------------------------------------------------------ charges

    def reserve(
        self,
        round: int,  # noqa: A002 - the field's term
        release: str,
        line: LineItem | str,
        events: Sequence[MechanismEvent] | Mapping[str, MechanismEvent],
        *,
        membership: Mapping[str, str] | None = None,
        region_membership_stable: bool = True,
    ) -> Reservation:
        """Check the line and write a PENDING charge in one transaction (phase 1).

        Args:
            round: round index (>= 0); the epoch is ``policy.epoch_of_round(round)``.
            release: release name, unique within the round (the idempotency key is
                ``(epoch, round, release)``).
            line: the line item to charge.
            events: for ``training`` / ``evaluation.global`` a sequence of events; for
                ``evaluation.regional`` a mapping region -> event (one release per region).
            membership: regional only; client id -> region of this release's clients.
                Stored per epoch as keyed HMACs; a client seen in another region earlier in
                the epoch switches the epoch's regional line to the sum.
            region_membership_stable: regional only; ``False`` declares that some client
                moved region within the epoch (sum instead of max from now on).

        Returns:
            :class:`Reservation` (refused reservations are also recorded as decisions).

        Raises:
            LedgerError: bad arguments. IdempotencyConflictError: the key was used with
            different parameters.
        """
        line = self._check_line(line)
        epoch = self.policy.epoch_of_round(round)
        if not isinstance(release, str) or not 0 < len(release) <= _RELEASE_MAX_LEN:
            raise LedgerError(f"release: a non-empty name of at most {_RELEASE_MAX_LEN} characters")
        tagged = self._tag_events(line, events)
        if line is not LineItem.EVALUATION_REGIONAL and (
            membership is not None or region_membership_stable is not True
        ):
            raise LedgerError("membership: only regional charges carry region membership")
        events_json = _canonical([[r, ev.to_record()] for r, ev in tagged])
        with self._connect() as con, self._tx(con):
            self._ensure_epoch(con, epoch)
            row = con.execute(
                "SELECT line, status, events, result FROM charges WHERE epoch=? AND round=? AND release=?",
                (epoch, round, release),
            ).fetchone()
            common = dict(ledger=self, epoch=epoch, round=round, release=release, line=line)
            if row is not None:
                if row[0] != line.value or row[2] != events_json:
                    raise IdempotencyConflictError(
                        "idempotency key (epoch, round, release): already used with other parameters"
                    )
                if row[1] == "committed":
                    return Reservation(**common, status=ReservationStatus.ALREADY_COMMITTED,
                                       stored_result=row[3], committed=True)
                con.execute(
                    "UPDATE charges SET attempts = attempts + 1 WHERE epoch=? AND round=? AND release=?",
                    (epoch, round, release),
                )
                return Reservation(**common, status=ReservationStatus.REUSED_PENDING)
            frozen, moved = self._state(con, epoch)
            if line is LineItem.TRAINING and frozen:
                return self._refuse(con, common, "training_frozen")
            new_moved = moved
            client_rows: list[tuple[str, str]] = []
            if line is LineItem.EVALUATION_REGIONAL:
                if not region_membership_stable:
                    new_moved = True
                for client, region in (membership or {}).items():
                    if not isinstance(region, str) or not region:
                        raise LedgerError("membership: every region must be a non-empty string")
                    key = self._client_key(client)
                    prev = con.execute(
                        "SELECT region FROM membership WHERE epoch=? AND client_key=?", (epoch, key)
                    ).fetchone()
                    if prev is not None and prev[0] != region:
                        new_moved = True
                    if prev is None:
                        client_rows.append((key, region))
            _, delta, _ = self._line_params(con, epoch, line)
            cap = self._cap(con, epoch, line)
            prospective = self._compose_line(
                line, delta, self._line_events(con, epoch, line) + tagged, new_moved
            )
            if not prospective.epsilon <= cap:
                return self._refuse(con, common, "exceeds_line_cap",
                                    line_epsilon_after=prospective.epsilon, cap=cap)
            lifetime = self.policy.lifetime_cap()
            totals = self._lifetime_totals(con, (epoch, line, prospective))
            life_eps = math.fsum(t[0] for t in totals.values())
            life_delta = math.fsum(t[1] for t in totals.values())
            if lifetime is not None and (
                not life_eps <= lifetime[0]
                or life_delta > lifetime[1] * (1.0 + _DELTA_RELATIVE_TOLERANCE)
            ):
                return self._refuse(con, common, "exceeds_lifetime_cap",
                                    line_epsilon_after=prospective.epsilon, cap=cap,
                                    lifetime_epsilon_after=life_eps,
                                    lifetime_delta_after=life_delta)
            con.execute(
                "INSERT INTO charges (epoch, round, release, line, status, events,"
                " line_epsilon_after, policy_version, reserved_at)"
                " VALUES (?, ?, ?, ?, 'pending', ?, ?, ?, ?)",
                (epoch, round, release, line.value, events_json, prospective.epsilon,
                 self.policy.policy_version, _now()),
            )
            con.executemany(
                "INSERT OR IGNORE INTO membership VALUES (?, ?, ?)",
                [(epoch, k, r) for k, r in client_rows],
            )
            if new_moved and not moved:
                con.execute("UPDATE epoch_state SET regional_moved=1 WHERE epoch=?", (epoch,))
                self._decide(con, epoch, "regional_membership_moved",
                             {"round": round, "release": release})
            return Reservation(**common, status=ReservationStatus.GRANTED,
                               line_epsilon_after=prospective.epsilon, line_cap_epsilon=cap,
                               lifetime_epsilon_after=life_eps,
                               lifetime_delta_after=life_delta)

    def _refuse(self, con: sqlite3.Connection, common: dict, reason: str,
                line_epsilon_after: float | None = None, cap: float | None = None,
                lifetime_epsilon_after: float | None = None,
                lifetime_delta_after: float | None = None) -> Reservation:
        self._decide(con, common["epoch"], "charge_refused", {
            "round": common["round"], "release": common["release"],
            "line": common["line"].value, "reason": reason,
        })
        return Reservation(**common, status=ReservationStatus.REFUSED, refusal=reason,
                           line_epsilon_after=line_epsilon_after, line_cap_epsilon=cap,
                           lifetime_epsilon_after=lifetime_epsilon_after,
                           lifetime_delta_after=lifetime_delta_after)

    def commit(self, round: int, release: str, result: str | None = None) -> str | None:  # noqa: A002
        """Mark the charge ``(epoch, round, release)`` COMMITTED (phase 2), storing ``result``.

        Idempotent: committing an already committed key keeps (and returns) the first
        stored payload. Raises :class:`LedgerError` if no reservation exists.
        """
        if result is not None and not isinstance(result, str):
            raise LedgerError("result: the published payload must be a string (e.g. envelope JSON)")
        epoch = self.policy.epoch_of_round(round)
        with self._connect() as con, self._tx(con):
            row = con.execute(
                "SELECT status, result FROM charges WHERE epoch=? AND round=? AND release=?",
                (epoch, round, release),
            ).fetchone()
            if row is None:
                raise LedgerError("commit: no reservation for this (epoch, round, release)")
            if row[0] == "committed":
                return row[1]
            con.execute(
                "UPDATE charges SET status='committed', result=?, committed_at=?"
                " WHERE epoch=? AND round=? AND release=?",
                (result, _now(), epoch, round, release),
            )
            return result

    @contextlib.contextmanager
    def charge(
        self,
        round: int,  # noqa: A002
        release: str,
        line: LineItem | str,
        events: Sequence[MechanismEvent] | Mapping[str, MechanismEvent],
        *,
        membership: Mapping[str, str] | None = None,
        region_membership_stable: bool = True,
    ) -> Iterator[Reservation]:
        """Reserve, yield the :class:`Reservation`, and commit on normal exit.

        Usage::

            with ledger.charge(r, "eval.global.loss", LineItem.EVALUATION_GLOBAL,
                               [MechanismEvent.laplace(0.5)]) as res:
                if res.already_committed:
                    payload = res.stored_result          # republish, no new noise
                elif res.may_draw_noise:
                    payload = res.commit(draw_and_build_envelope().to_json())
                else:
                    ...                                  # refused: no noise drawn

        If the block raises, the reservation stays PENDING (counted as spent) and a
        re-run with the same key reuses it, so the release is charged exactly once.
        """
        res = self.reserve(round, release, line, events, membership=membership,
                           region_membership_stable=region_membership_stable)
        yield res
        if res.may_draw_noise and not res.committed:
            res.commit(None)

    def charge_training(
        self, round: int, noise_multiplier: float, *,  # noqa: A002
        population_size: int, sample_size: int, release: str = "training",
    ):
        """Context manager charging one DP-FedAvg round to the training line: the Gaussian
        mechanism with ``noise_multiplier = sigma / (2 C)`` on a uniform sample of exactly
        ``sample_size`` of ``population_size`` clients
        (:meth:`MechanismEvent.gaussian_sampled_without_replacement`); see :meth:`charge`.
        For the two-phase use (commit after cohorting) reserve that event with
        :meth:`reserve`."""
        event = MechanismEvent.gaussian_sampled_without_replacement(
            noise_multiplier, population_size, sample_size)
        return self.charge(round, release, LineItem.TRAINING, [event])

    def charge_global(self, round: int, release: str, event: MechanismEvent):  # noqa: A002
        """Context manager charging one global evaluation release; see :meth:`charge`."""
        return self.charge(round, release, LineItem.EVALUATION_GLOBAL, [event])

    def charge_regional(
        self, round: int, release: str,  # noqa: A002
        per_region: Mapping[str, MechanismEvent], *,
        membership: Mapping[str, str] | None = None,
        region_membership_stable: bool = True,
    ):
        """Context manager charging one regional release (one event per region, parallel
        composition); see :meth:`reserve` for ``membership`` and the max / sum rule."""
        return self.charge(round, release, LineItem.EVALUATION_REGIONAL, per_region,
                           membership=membership,
                           region_membership_stable=region_membership_stable)

    def _check_line(self, line: LineItem | str) -> LineItem:
        try:
            return LineItem(line)
        except ValueError:
            raise LedgerError("line: must be training, evaluation.global or evaluation.regional") from None

    def _tag_events(self, line: LineItem, events: object) -> list[tuple[str | None, MechanismEvent]]:
        if line is LineItem.EVALUATION_REGIONAL:
            if not isinstance(events, Mapping) or not events:
                raise LedgerError("events: a regional charge takes a non-empty mapping region -> event")
            tagged = [(str(r), ev) for r, ev in sorted(events.items())]
        else:
            if isinstance(events, Mapping) or isinstance(events, MechanismEvent) or not events:
                raise LedgerError("events: a non-empty sequence of MechanismEvent")
            tagged = [(None, ev) for ev in events]
        if any(not isinstance(ev, MechanismEvent) for _, ev in tagged):
            raise LedgerError("events: every event must be a MechanismEvent")
        if any(ev.sampling == "poisson" for _, ev in tagged):
            raise LedgerError(
                "events: a Poisson-sampled event (sampling_probability < 1) is not charged"
                " under replace-one accounting; charge"
                " MechanismEvent.gaussian_sampled_without_replacement"
            )
        return tagged

    # ------------------------------------------------------------------ back-off, borrowing

    def freeze_training(self, epoch: int, reason: str) -> None:
        """Training backs off: refuse every further training charge in ``epoch``.

        Evaluation lines are untouched (they keep their reserved allocation). Recorded as
        a decision with the policy version.
        """
        if type(epoch) is not int or epoch < 0:
            raise LedgerError("epoch: a non-negative integer")
        with self._connect() as con, self._tx(con):
            self._ensure_epoch(con, epoch)
            con.execute("UPDATE epoch_state SET training_frozen=1 WHERE epoch=?", (epoch,))
            self._decide(con, epoch, "training_frozen", {"reason": str(reason)[:1000]})

    def record_borrow_decision(
        self, request: BorrowRequest, approval: BorrowApproval | None
    ) -> BorrowDecision:
        """Decide (with :func:`~clma.budget.policy.evaluate_borrow`) and record a borrow
        in one transaction; on refusal freeze training for the epoch. Use
        :func:`clma.budget.policy.decide_borrow`."""
        epoch, line = request.epoch, request.line
        with self._connect() as con, self._tx(con):
            self._ensure_epoch(con, epoch)
            self._ensure_epoch(con, epoch + 1)
            n_approved = con.execute(
                "SELECT COUNT(*) FROM borrows WHERE epoch=? AND approved=1", (epoch,)
            ).fetchone()[0]
            next_base, _, _ = self._line_params(con, epoch + 1, line)
            refusal = evaluate_borrow(
                request, approval, self.policy,
                borrows_approved_this_epoch=int(n_approved), next_epoch_line_epsilon=next_base,
            )
            if refusal is None:
                # The next epoch must still cover what it already spent on that line.
                _, nd, _ = self._line_params(con, epoch + 1, line)
                _, next_moved = self._state(con, epoch + 1)
                spent_next = self._compose_line(
                    line, nd, self._line_events(con, epoch + 1, line), next_moved
                ).epsilon
                if spent_next > self._cap(con, epoch + 1, line) - request.epsilon:
                    refusal = BorrowRefusal.EXCEEDS_BORROW_LIMIT
            approved = refusal is None
            frozen = not approved
            cur = con.execute(
                "INSERT INTO borrows (epoch, line, epsilon, approved, refusal, approver,"
                " approver_reason, run_id, request_reason, training_frozen, policy_version,"
                " decided_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (epoch, line.value, request.epsilon, int(approved),
                 None if refusal is None else refusal.value,
                 None if approval is None else approval.approver,
                 "" if approval is None else approval.reason,
                 request.run_id, request.reason, int(frozen),
                 self.policy.policy_version, _now()),
            )
            if frozen:
                con.execute("UPDATE epoch_state SET training_frozen=1 WHERE epoch=?", (epoch,))
            self._decide(con, epoch, "borrow_" + ("approved" if approved else "refused"), {
                "borrow_id": cur.lastrowid, "line": line.value,
                "refusal": None if refusal is None else refusal.value,
                "approver": None if approval is None else approval.approver,
            })
            return BorrowDecision(
                decision_id=int(cur.lastrowid), epoch=epoch, line=line, epsilon=request.epsilon,
                approved=approved, refusal=refusal,
                approver=None if approval is None else approval.approver,
                approver_reason="" if approval is None else approval.reason,
                training_frozen=frozen, policy_version=self.policy.policy_version,
            )

    # ------------------------------------------------------------------ reporting

    def spent(self, epoch: int, line: LineItem | str) -> CompositionResult:
        """Composed spend of one line of one epoch (PENDING and COMMITTED charges)."""
        line = self._check_line(line)
        with self._connect() as con:
            _, delta, _ = self._line_params(con, epoch, line)
            _, moved = self._state(con, epoch)
            return self._compose_line(line, delta, self._line_events(con, epoch, line), moved)

    def remaining(self, epoch: int, line: LineItem | str) -> float:
        """Remaining epsilon of one line of one epoch (cap minus spent, at least 0)."""
        line = self._check_line(line)
        spent = self.spent(epoch, line).epsilon
        with self._connect() as con:
            return max(0.0, self._cap(con, epoch, line) - spent)

    def lifetime_spent(self) -> tuple[float, float]:
        """Per-client (epsilon, delta) spent over all epochs (PENDING and COMMITTED
        charges): basic composition of the per-epoch totals, each the basic composition
        of the epoch's line items (the worst-case client, as every line is accounted)."""
        with self._connect() as con:
            totals = self._lifetime_totals(con)
        return math.fsum(t[0] for t in totals.values()), math.fsum(t[1] for t in totals.values())

    def lifetime_remaining(self) -> float | None:
        """Lifetime epsilon cap minus :meth:`lifetime_spent` (at least 0); ``None`` under a
        policy without a lifetime cap."""
        cap = self.policy.lifetime_cap()
        if cap is None:
            return None
        return max(0.0, cap[0] - self.lifetime_spent()[0])

    def table(self, epoch: int | None = None) -> list[LedgerRow]:
        """Rows for reporting (MLflow table, Prefect table artifact): per epoch the
        ``training`` and ``evaluation`` line items (evaluation = global + regional, basic
        composition) followed by the two evaluation sub-lines, each with the client's
        lifetime spend up to that epoch next to the epoch spend (:class:`LedgerRow`).
        Epochs are those touched so far (or only ``epoch``)."""
        lifetime = self.policy.lifetime_cap()
        with self._connect() as con:
            totals = self._lifetime_totals(con)
            if epoch is None:
                epochs = self._epochs(con)
            else:
                epochs = [epoch]
            rows: list[LedgerRow] = []
            for e in epochs:
                upto = [t for k, t in totals.items() if k <= e]
                life = {
                    "lifetime_spent_epsilon": math.fsum(t[0] for t in upto),
                    "lifetime_spent_delta": math.fsum(t[1] for t in upto),
                    "lifetime_cap_epsilon": None if lifetime is None else lifetime[0],
                    "lifetime_cap_delta": None if lifetime is None else lifetime[1],
                }
                life["lifetime_remaining_epsilon"] = (
                    None if lifetime is None
                    else max(0.0, lifetime[0] - life["lifetime_spent_epsilon"]))
                frozen, moved = self._state(con, e)
                per_line: dict[LineItem, LedgerRow] = {}
                for line in LineItem:
                    base, delta, version = self._line_params(con, e, line)
                    borrowed, lent, approver = self._borrowed(con, e, line)
                    cap = base + borrowed - lent
                    res = self._compose_line(line, delta, self._line_events(con, e, line), moved)
                    pending = con.execute(
                        "SELECT COUNT(*) FROM charges WHERE epoch=? AND line=? AND status='pending'",
                        (e, line.value),
                    ).fetchone()[0]
                    comp = res.method
                    if line is LineItem.EVALUATION_REGIONAL:
                        comp += ":sum_over_regions" if moved else ":max_over_regions"
                    per_line[line] = LedgerRow(
                        epoch=e, line_item=line.value, cap_epsilon=cap, spent_epsilon=res.epsilon,
                        remaining_epsilon=max(0.0, cap - res.epsilon), delta=delta,
                        borrowed_epsilon=borrowed, lent_epsilon=lent, approver=approver,
                        training_frozen=frozen if line is LineItem.TRAINING else False,
                        composition=comp, pending_charges=int(pending), policy_version=version,
                        **life,
                    )
                g, r = per_line[LineItem.EVALUATION_GLOBAL], per_line[LineItem.EVALUATION_REGIONAL]
                evaluation = LedgerRow(
                    epoch=e, line_item="evaluation", cap_epsilon=g.cap_epsilon + r.cap_epsilon,
                    spent_epsilon=g.spent_epsilon + r.spent_epsilon,
                    remaining_epsilon=g.remaining_epsilon + r.remaining_epsilon,
                    delta=g.delta + r.delta, borrowed_epsilon=g.borrowed_epsilon + r.borrowed_epsilon,
                    lent_epsilon=g.lent_epsilon + r.lent_epsilon,
                    approver=",".join(sorted({a for a in (g.approver, r.approver) if a})),
                    training_frozen=False, composition="basic_sum_of_sublines",
                    pending_charges=g.pending_charges + r.pending_charges,
                    policy_version=g.policy_version, **life,
                )
                rows += [per_line[LineItem.TRAINING], evaluation, g, r]
            return rows

    def table_columns(self, epoch: int | None = None) -> dict[str, list]:
        """:meth:`table` as columns (``mlflow.log_table(data=...)`` takes this shape)."""
        rows = self.table(epoch)
        names = list(LedgerRow.model_fields)
        return {n: [getattr(r, n) for r in rows] for n in names}

    def entries(self, epoch: int | None = None) -> list[dict]:
        """Audit view of the charges (key, line, status, events, policy version)."""
        q = ("SELECT epoch, round, release, line, status, events, line_epsilon_after,"
             " policy_version, attempts FROM charges")
        args: tuple = ()
        if epoch is not None:
            q, args = q + " WHERE epoch=?", (epoch,)
        cols = ["epoch", "round", "release", "line", "status", "events",
                "line_epsilon_after", "policy_version", "attempts"]
        with self._connect() as con:
            return [dict(zip(cols, r, strict=True)) for r in con.execute(q + " ORDER BY id", args)]

    def decisions(self, epoch: int | None = None) -> list[dict]:
        """Audit view of the decisions (refusals, borrows, freezes, policy changes)."""
        q = "SELECT id, epoch, kind, detail, policy_version, decided_at FROM decisions"
        args: tuple = ()
        if epoch is not None:
            q, args = q + " WHERE epoch=?", (epoch,)
        cols = ["id", "epoch", "kind", "detail", "policy_version", "decided_at"]
        with self._connect() as con:
            out = [dict(zip(cols, r, strict=True)) for r in con.execute(q + " ORDER BY id", args)]
        for d in out:
            d["detail"] = json.loads(d["detail"])
        return out

    def borrows(self, epoch: int | None = None) -> list[dict]:
        """Audit view of every borrowing decision."""
        q = ("SELECT id, epoch, line, epsilon, approved, refusal, approver, approver_reason,"
             " run_id, training_frozen, policy_version, decided_at FROM borrows")
        args: tuple = ()
        if epoch is not None:
            q, args = q + " WHERE epoch=?", (epoch,)
        cols = ["id", "epoch", "line", "epsilon", "approved", "refusal", "approver",
                "approver_reason", "run_id", "training_frozen", "policy_version", "decided_at"]
        with self._connect() as con:
            return [dict(zip(cols, r, strict=True)) for r in con.execute(q + " ORDER BY id", args)]
