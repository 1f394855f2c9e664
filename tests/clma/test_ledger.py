"""The privacy-budget ledger: caps under concurrency, idempotency, crashes, composition,
parallel composition across regions, borrowing and reporting."""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import sqlite3
import threading
from importlib import resources
from pathlib import Path

import dp_accounting
import pytest
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant

from clma.budget import (
    AccountingError,
    BorrowApproval,
    BorrowRefusal,
    BorrowRequest,
    IdempotencyConflictError,
    LedgerError,
    LineItem,
    MechanismEvent,
    PolicyError,
    PrivacyLedger,
    ReservationStatus,
    decide_borrow,
    default_policy,
    load_policy,
)

G, R, T = LineItem.EVALUATION_GLOBAL, LineItem.EVALUATION_REGIONAL, LineItem.TRAINING
POLICY_TEXT = resources.files("clma").joinpath("policy", "privacy_policy_v2.toml").read_text()
LAP = MechanismEvent.laplace


@pytest.fixture
def ledger(tmp_path):
    return PrivacyLedger(tmp_path / "state")


def _charge(ledger, rnd, release, line, events, **kw):
    with ledger.charge(rnd, release, line, events, **kw) as res:
        return res


# ------------------------------------------------------------------ basics


def test_wal_mode_file_layout_and_durability(tmp_path):
    led = PrivacyLedger(tmp_path / "state")
    assert led.path == tmp_path / "state" / "privacy_ledger.sqlite"
    con = sqlite3.connect(led.path)
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    con.close()
    assert _charge(led, 0, "g", G, [LAP(0.5)]).status is ReservationStatus.GRANTED
    reopened = PrivacyLedger(tmp_path / "state")
    assert reopened.spent(0, G).epsilon == 0.5
    assert reopened.table() == led.table()


def test_refused_before_any_noise_is_drawn(ledger):
    draws = []
    assert _charge(ledger, 0, "g1", G, [LAP(1.0)]).status is ReservationStatus.GRANTED
    with ledger.charge(0, "g2", G, [LAP(0.75)]) as res:  # 1.75 > 1.5
        if res.may_draw_noise:
            draws.append(1)
    assert res.refused and res.refusal == "exceeds_line_cap" and draws == []
    assert ledger.spent(0, G).epsilon == 1.0
    assert res.line_epsilon_after == 1.75 and res.line_cap_epsilon == 1.5
    refused = [d for d in ledger.decisions(0) if d["kind"] == "charge_refused"]
    assert refused[0]["detail"] == {"line": "evaluation.global", "reason": "exceeds_line_cap",
                                    "release": "g2", "round": 0}
    # the line can still be filled exactly to its cap
    assert _charge(ledger, 0, "g3", G, [LAP(0.5)]).status is ReservationStatus.GRANTED
    assert ledger.remaining(0, G) == 0.0


def test_bad_arguments(ledger):
    with pytest.raises(LedgerError, match="line"):
        ledger.reserve(0, "x", "evaluation", [LAP(0.1)])
    with pytest.raises(LedgerError, match="events"):
        ledger.reserve(0, "x", G, {"north": LAP(0.1)})
    with pytest.raises(LedgerError, match="events"):
        ledger.reserve(0, "x", R, [LAP(0.1)])
    with pytest.raises(LedgerError, match="membership"):
        ledger.reserve(0, "x", G, [LAP(0.1)], membership={"c": "north"})
    with pytest.raises(LedgerError, match="release"):
        ledger.reserve(0, "", G, [LAP(0.1)])
    with pytest.raises(PolicyError, match="round"):
        ledger.reserve(-1, "x", G, [LAP(0.1)])
    with pytest.raises(ValueError):
        MechanismEvent.laplace(float("nan"))
    with pytest.raises(ValueError):
        MechanismEvent(mechanism="laplace", epsilon=1.0, noise_multiplier=1.0)
    with pytest.raises(LedgerError, match="no reservation"):
        ledger.commit(0, "never")


# ------------------------------------------------------------------ idempotency and crashes


def test_idempotent_rerun_charges_once_and_returns_the_published_payload(ledger):
    with ledger.charge(3, "g.loss", G, [LAP(0.5)]) as res:
        assert res.status is ReservationStatus.GRANTED
        stored = res.commit('{"aggregate_value":0.25}\n')
    assert stored == '{"aggregate_value":0.25}\n'
    for _ in range(3):  # Prefect retries / re-runs
        with ledger.charge(3, "g.loss", G, [LAP(0.5)]) as again:
            assert again.already_committed and not again.may_draw_noise
            assert again.stored_result == stored
    assert ledger.spent(0, G).epsilon == 0.5
    assert len(ledger.entries()) == 1
    with pytest.raises(IdempotencyConflictError):
        ledger.reserve(3, "g.loss", G, [LAP(0.25)])
    with pytest.raises(IdempotencyConflictError):
        ledger.reserve(3, "g.loss", T, [MechanismEvent.gaussian(4.0)])


def test_crash_between_noise_and_commit_rerun_charges_once(ledger):
    drawn = []
    with pytest.raises(RuntimeError, match="crash"):
        with ledger.charge(1, "g.loss", G, [LAP(0.5)]) as res:
            assert res.may_draw_noise
            drawn.append("noise")
            raise RuntimeError("crash after drawing noise")
    # the pending charge counts as spent, so nothing can overspend meanwhile
    assert ledger.entries()[0]["status"] == "pending"
    assert ledger.spent(0, G).epsilon == 0.5
    assert ledger.table(0)[2].pending_charges == 1
    with ledger.charge(1, "g.loss", G, [LAP(0.5)]) as res2:
        assert res2.status is ReservationStatus.REUSED_PENDING
        res2.commit("payload")
    (entry,) = ledger.entries()
    assert entry["status"] == "committed" and entry["attempts"] == 2
    assert ledger.spent(0, G).epsilon == 0.5  # charged once, not lost


def _reserve_then_die(path: str) -> None:
    led = PrivacyLedger(path)
    res = led.reserve(2, "g.loss", G, [LAP(0.5)])
    assert res.may_draw_noise
    os._exit(3)  # hard crash after "drawing noise", before commit


def test_hard_process_crash_leaves_a_state_whose_rerun_charges_once(tmp_path):
    path = str(tmp_path / "state")
    PrivacyLedger(path)
    proc = mp.get_context("fork").Process(target=_reserve_then_die, args=(path,))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 3
    led = PrivacyLedger(path)
    assert [e["status"] for e in led.entries()] == ["pending"]
    with led.charge(2, "g.loss", G, [LAP(0.5)]) as res:
        assert res.status is ReservationStatus.REUSED_PENDING
    assert [e["status"] for e in led.entries()] == ["committed"]
    assert led.spent(0, G).epsilon == 0.5


def test_first_commit_wins(ledger):
    a = ledger.reserve(0, "g", G, [LAP(0.5)])
    b = ledger.reserve(0, "g", G, [LAP(0.5)])  # a concurrent retry of the same release
    assert a.status is ReservationStatus.GRANTED and b.status is ReservationStatus.REUSED_PENDING
    assert a.commit("first") == "first"
    assert b.commit("second") == "first"
    assert ledger.spent(0, G).epsilon == 0.5


# ------------------------------------------------------------------ concurrency


def test_threads_never_exceed_the_cap(ledger):
    # evaluation.global cap 1.5 = 6 x 0.25 exactly; 8 threads try 5 releases each
    results: list[ReservationStatus] = []
    lock = threading.Lock()

    def worker(t: int) -> None:
        for k in range(5):
            res = _charge(ledger, 0, f"t{t}.r{k}", G, [LAP(0.25)])
            with lock:
                results.append(res.status)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert results.count(ReservationStatus.GRANTED) == 6
    assert results.count(ReservationStatus.REFUSED) == 34
    assert ledger.spent(0, G).epsilon == 1.5


def _process_worker(args: tuple[str, int]) -> list[str]:
    path, w = args
    led = PrivacyLedger(path)
    out = []
    for k in range(4):
        with led.charge(10, f"p{w}.r{k}", R, {"north": LAP(0.25), "south": LAP(0.125)}) as res:
            out.append(res.status.value)
    return out


def test_processes_never_exceed_the_cap(tmp_path):
    path = str(tmp_path / "state")
    PrivacyLedger(path)
    with mp.get_context("fork").Pool(4) as pool:
        statuses = [s for chunk in pool.map(_process_worker, [(path, w) for w in range(4)])
                    for s in chunk]
    # regional cap 1.5, max over regions: north 0.25 per release -> exactly 6 releases
    assert statuses.count("granted") == 6 and statuses.count("refused") == 10
    led = PrivacyLedger(path)
    assert led.spent(1, R).epsilon == 1.5
    assert len(led.entries(1)) == 6


def test_concurrent_borrow_approvals_borrow_once(tmp_path):
    led = PrivacyLedger(tmp_path / "s")
    decisions = []

    def approve() -> None:
        decisions.append(decide_borrow(
            BorrowRequest(epoch=0, line=G, epsilon=0.5),
            BorrowApproval(approver="privacy-officer", approve=True), led.policy, led))

    threads = [threading.Thread(target=approve) for _ in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert sum(d.approved for d in decisions) == 1
    assert {d.refusal for d in decisions if not d.approved} == {
        BorrowRefusal.ALREADY_BORROWED_THIS_EPOCH}
    assert len(led.borrows(0)) == 6


# ------------------------------------------------------------------ composition


def test_training_charge_is_the_sampled_gaussian_accounted_by_rdp_under_replace_one(ledger):
    for rnd in range(10):
        with ledger.charge_training(rnd, 1.5, population_size=60, sample_size=15) as res:
            assert res.status is ReservationStatus.GRANTED
    (entry, *_) = ledger.entries()
    assert '"population_size":60' in entry["events"] and '"sample_size":15' in entry["events"]
    spent = ledger.spent(0, T)
    rdp = RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    rdp.compose(dp_accounting.SampledWithoutReplacementDpEvent(
        60, 15, dp_accounting.GaussianDpEvent(1.5)), 10)
    assert spent.method == "rdp" and spent.delta == pytest.approx(7e-6, rel=1e-12)
    assert spent.epsilon == pytest.approx(rdp.get_epsilon(7e-6), rel=1e-12)
    assert spent.adjacency == "replace_one"
    row = ledger.table(0)[0]
    assert (row.line_item, row.composition, row.adjacency) == ("training", "rdp", "replace_one")


def test_poisson_sampled_charges_are_refused_and_mixed_lines_compose_by_pld(ledger):
    # the old DP-FedAvg charge (Poisson sampling) is not charged any more ...
    poisson = MechanismEvent.model_validate({"mechanism": "gaussian", "epsilon": None,
                                             "noise_multiplier": 1.5, "sampling_probability": 0.2})
    with pytest.raises(LedgerError, match="gaussian_sampled_without_replacement"):
        ledger.reserve(0, "training", T, [poisson])
    assert ledger.entries() == []
    # a line mixing Laplace and unsampled Gaussian releases is composed by PLD, not summed
    _charge(ledger, 0, "g.a", G, [LAP(0.25)])
    _charge(ledger, 0, "g.b", G, [MechanismEvent.gaussian(8.0)])
    mixed = PLDAccountant(value_discretization_interval=1e-3)
    mixed.compose(dp_accounting.LaplaceDpEvent(4.0))
    mixed.compose(dp_accounting.GaussianDpEvent(8.0))
    got = ledger.spent(0, G)
    assert got.method == "pld" and got.epsilon == pytest.approx(mixed.get_epsilon(1.5e-6), rel=1e-9)
    # ... and a finer PLD discretisation agrees to 1e-3
    fine = PLDAccountant(value_discretization_interval=1e-4)
    fine.compose(dp_accounting.LaplaceDpEvent(4.0))
    fine.compose(dp_accounting.GaussianDpEvent(8.0))
    assert got.epsilon == pytest.approx(fine.get_epsilon(1.5e-6), abs=1e-3)


def test_a_ledger_with_old_poisson_charges_opens_but_does_not_compose_them(tmp_path):
    """Ledgers written before replace-one accounting still open and list their charges; the
    Poisson-sampled training charges they hold cannot be composed (no valid bound)."""
    led = PrivacyLedger(tmp_path / "s")
    con = sqlite3.connect(led.path)
    con.execute(
        "INSERT INTO charges (epoch, round, release, line, status, events, line_epsilon_after,"
        " policy_version, reserved_at) VALUES (0, 0, 'training', 'training', 'committed', ?,"
        " 0.5, 'clma-privacy-policy-v1', 'then')",
        ('[[null,{"epsilon":null,"mechanism":"gaussian","noise_multiplier":1.5,'
         '"sampling_probability":0.2}]]',))
    con.commit()
    con.close()
    reopened = PrivacyLedger(tmp_path / "s")
    assert [e["release"] for e in reopened.entries()] == ["training"]
    with pytest.raises(AccountingError, match="Poisson"):
        reopened.spent(0, T)


def test_pure_epsilon_line_is_the_exact_running_sum(ledger):
    for k, eps in enumerate([0.25, 0.5, 0.125, 0.0625]):
        _charge(ledger, k, f"g{k}", G, [LAP(eps)])
    spent = ledger.spent(0, G)
    assert spent.method == "exact_sum" and spent.delta == 0.0 and spent.epsilon_rdp is None
    assert spent.epsilon == 0.9375  # exact in binary
    # why not PLD: at delta = 0 it reports infinity even for Laplace releases
    pld = PLDAccountant()
    pld.compose(dp_accounting.LaplaceDpEvent(4.0))
    assert pld.get_epsilon(0.0) == float("inf")


# ------------------------------------------------------------------ parallel composition


def _regional(ledger, rnd, north, south, **kw):
    return _charge(ledger, rnd, "r.loss", R, {"north": LAP(north), "south": LAP(south)}, **kw)


def test_regional_line_charges_max_over_regions_while_membership_is_stable(ledger):
    m = {"c1": "north", "c2": "south", "c3": "north"}
    assert _regional(ledger, 0, 0.5, 0.25, membership=m).status is ReservationStatus.GRANTED
    assert ledger.spent(0, R).epsilon == 0.5  # max, not the sum 0.75
    assert _regional(ledger, 2, 0.25, 0.5, membership=m).status is ReservationStatus.GRANTED
    # per-region totals: north 0.75, south 0.75 -> 0.75 (tighter than sum of per-round maxima)
    assert ledger.spent(0, R).epsilon == 0.75
    row = [r for r in ledger.table(0) if r.line_item == "evaluation.regional"][0]
    assert row.composition == "exact_sum:max_over_regions"


def test_a_client_moving_region_switches_the_epoch_to_the_sum(ledger):
    assert _regional(ledger, 0, 0.5, 0.25, membership={"c1": "north", "c2": "south"}).status \
        is ReservationStatus.GRANTED
    res = _regional(ledger, 2, 0.25, 0.25, membership={"c1": "south", "c2": "south"})
    assert res.status is ReservationStatus.GRANTED
    assert ledger.spent(0, R).epsilon == 1.25  # 0.5 + 0.25 + 0.25 + 0.25
    kinds = [d["kind"] for d in ledger.decisions(0)]
    assert "regional_membership_moved" in kinds
    row = [r for r in ledger.table(0) if r.line_item == "evaluation.regional"][0]
    assert row.composition == "exact_sum:sum_over_regions"
    # the next epoch starts stable again
    _regional(ledger, 10, 0.5, 0.25, membership={"c1": "north"})
    assert ledger.spent(1, R).epsilon == 0.5


def test_declared_move_and_a_move_that_would_overspend(ledger):
    _regional(ledger, 0, 0.5, 0.5, membership={"c1": "north", "c2": "south"})
    # a move now would make the line 0.5+0.5+0.5+0.5 = 2.0 > 1.5: refused, stays stable
    res = _regional(ledger, 2, 0.5, 0.5, membership={"c1": "south"})
    assert res.refused and res.refusal == "exceeds_line_cap"
    assert ledger.spent(0, R).epsilon == 0.5
    assert "regional_membership_moved" not in [d["kind"] for d in ledger.decisions(0)]
    # the same release without a move is granted (max: 1.0)
    res = _charge(ledger, 2, "r.loss2", R, {"north": LAP(0.5), "south": LAP(0.5)},
                  membership={"c1": "north", "c2": "south"})
    assert res.status is ReservationStatus.GRANTED and ledger.spent(0, R).epsilon == 1.0
    # declared instability (no membership given) switches to the sum: 2.0 + 0.25 > 1.5 refused
    res = _charge(ledger, 4, "r.x", R, {"north": LAP(0.25)}, region_membership_stable=False)
    assert res.refused


# ------------------------------------------------------------------ borrowing and back-off


def _exhaust_global(led, rnd=0):
    assert _charge(led, rnd, f"g.full.{rnd}", G, [LAP(1.5)]).status is ReservationStatus.GRANTED
    assert _charge(led, rnd, f"g.more.{rnd}", G, [LAP(0.5)]).refused


def test_borrow_once_per_epoch_with_an_allowed_approver(ledger):
    _exhaust_global(ledger)
    d = decide_borrow(BorrowRequest(epoch=0, line=G, epsilon=0.5, run_id="run-a"),
                      BorrowApproval(approver="privacy-officer", approve=True, reason="alerting"),
                      ledger.policy, ledger)
    assert d.approved and d.refusal is None and not d.training_frozen
    assert d.policy_version == "clma-privacy-policy-v2"
    assert _charge(ledger, 1, "g.more.after", G, [LAP(0.5)]).status is ReservationStatus.GRANTED
    rows = {(r.epoch, r.line_item): r for r in ledger.table()}
    assert rows[(0, "evaluation.global")].cap_epsilon == 2.0
    assert rows[(0, "evaluation.global")].borrowed_epsilon == 0.5
    assert rows[(0, "evaluation.global")].approver == "privacy-officer"
    assert rows[(1, "evaluation.global")].cap_epsilon == 1.0
    assert rows[(1, "evaluation.global")].lent_epsilon == 0.5
    assert rows[(0, "evaluation")].cap_epsilon == 3.5
    # a second borrow in the same epoch is refused and recorded, even for another line
    d2 = decide_borrow(BorrowRequest(epoch=0, line=R, epsilon=0.1),
                       BorrowApproval(approver="dpo-deputy", approve=True), ledger.policy, ledger)
    assert not d2.approved and d2.refusal is BorrowRefusal.ALREADY_BORROWED_THIS_EPOCH
    assert [b["approved"] for b in ledger.borrows(0)] == [1, 0]
    assert ledger.borrows(0)[1]["refusal"] == "already_borrowed_this_epoch"
    # the next epoch may borrow once itself
    d3 = decide_borrow(BorrowRequest(epoch=1, line=G, epsilon=0.25),
                       BorrowApproval(approver="dpo-deputy", approve=True), ledger.policy, ledger)
    assert d3.approved


def test_non_allow_listed_approver_refused_recorded_and_training_backs_off(ledger):
    _exhaust_global(ledger)
    with ledger.charge_training(0, 4.0, population_size=60, sample_size=60) as res:
        assert res.status is ReservationStatus.GRANTED
    d = decide_borrow(BorrowRequest(epoch=0, line=G, epsilon=0.5),
                      BorrowApproval(approver="mallory", approve=True, reason="trust me"),
                      ledger.policy, ledger)
    assert not d.approved and d.refusal is BorrowRefusal.NOT_ON_ALLOW_LIST and d.training_frozen
    (b,) = ledger.borrows(0)
    assert (b["approved"], b["refusal"], b["approver"], b["approver_reason"]) == (
        0, "not_on_allow_list", "mallory", "trust me")
    # training backs off for the rest of the epoch ...
    with ledger.charge_training(1, 4.0, population_size=60, sample_size=60) as res:
        assert res.refused and res.refusal == "training_frozen"
    assert [r for r in ledger.table(0) if r.line_item == "training"][0].training_frozen
    # ... while evaluation keeps its reserved allocation (regional line untouched)
    assert _regional(ledger, 1, 0.5, 0.5).status is ReservationStatus.GRANTED
    assert ledger.spent(0, G).epsilon == 1.5  # no borrowed budget appeared
    # the next epoch trains again
    with ledger.charge_training(10, 4.0, population_size=60, sample_size=60) as res:
        assert res.status is ReservationStatus.GRANTED


@pytest.mark.parametrize(
    ("approval", "eps", "reason"),
    [
        (None, 0.5, BorrowRefusal.TIMEOUT),
        (BorrowApproval(approver="privacy-officer", approve=False, reason="no"), 0.5,
         BorrowRefusal.DENIED),
        (BorrowApproval(approver="privacy-officer", approve=True), 0.8,
         BorrowRefusal.EXCEEDS_BORROW_LIMIT),
    ],
)
def test_timeout_denial_and_limit_refused_and_freeze_training(ledger, approval, eps, reason):
    d = decide_borrow(BorrowRequest(epoch=0, line=G, epsilon=eps), approval, ledger.policy, ledger)
    assert d.refusal is reason and d.training_frozen
    assert ledger.borrows(0)[0]["refusal"] == reason.value
    assert ledger.table(0)[0].training_frozen
    assert ledger.table(0)[2].cap_epsilon == 1.5


def test_borrow_refused_when_the_next_epoch_already_spent_it(ledger):
    _charge(ledger, 10, "g.next", G, [LAP(1.25)])  # epoch 1 already spent 1.25 of 1.5
    d = decide_borrow(BorrowRequest(epoch=0, line=G, epsilon=0.5),
                      BorrowApproval(approver="privacy-officer", approve=True), ledger.policy, ledger)
    assert d.refusal is BorrowRefusal.EXCEEDS_BORROW_LIMIT


def test_decide_borrow_requires_the_ledger_policy(tmp_path, ledger):
    other = tmp_path / "other.toml"
    other.write_text(POLICY_TEXT.replace('"clma-privacy-policy-v2"', '"clma-privacy-policy-v3"'))
    with pytest.raises(PolicyError, match="policy_version"):
        decide_borrow(BorrowRequest(epoch=0, line=G, epsilon=0.1), None, load_policy(other), ledger)


# ------------------------------------------------------------------ policy version, reporting


def test_policy_version_recorded_everywhere_and_caps_fixed_per_epoch(tmp_path):
    path = tmp_path / "s"
    led = PrivacyLedger(path)
    _charge(led, 0, "g", G, [LAP(0.5)])
    led.freeze_training(0, "manual")
    decide_borrow(BorrowRequest(epoch=0, line=G, epsilon=0.1), None, led.policy, led)
    v3_file = tmp_path / "v3.toml"
    v3_file.write_text(POLICY_TEXT.replace('"clma-privacy-policy-v2"', '"clma-privacy-policy-v3"')
                       .replace("epsilon_per_client_per_epoch = 10.0",
                                "epsilon_per_client_per_epoch = 20.0"))
    led2 = PrivacyLedger(path, load_policy(v3_file))
    _charge(led2, 20, "g", G, [LAP(0.5)])
    assert [e["policy_version"] for e in led2.entries()] == [
        "clma-privacy-policy-v2", "clma-privacy-policy-v3"]
    assert all(d["policy_version"] for d in led2.decisions())
    assert {d["kind"] for d in led2.decisions()} >= {
        "policy_opened", "training_frozen", "borrow_refused"}
    assert [b["policy_version"] for b in led2.borrows()] == ["clma-privacy-policy-v2"]
    rows = {(r.epoch, r.line_item): r for r in led2.table()}
    # epoch 0 keeps the caps of the policy in force when it started; epoch 2 uses v3
    assert rows[(0, "evaluation.global")].cap_epsilon == 1.5
    assert rows[(0, "evaluation.global")].policy_version == "clma-privacy-policy-v2"
    assert rows[(2, "evaluation.global")].cap_epsilon == 3.0
    assert rows[(2, "evaluation.global")].policy_version == "clma-privacy-policy-v3"


def test_table_rows_and_columns(ledger):
    with ledger.charge_training(0, 4.0, population_size=60, sample_size=60):
        pass
    _charge(ledger, 0, "g", G, [LAP(0.5)])
    _regional(ledger, 0, 0.25, 0.125)
    rows = ledger.table(0)
    assert [r.line_item for r in rows] == [
        "training", "evaluation", "evaluation.global", "evaluation.regional"]
    tr, ev, g, r = rows
    assert tr.cap_epsilon == 7.0 and tr.remaining_epsilon == pytest.approx(7.0 - tr.spent_epsilon)
    # one DP-FedAvg round, all 60 of 60 clients, z = 4, delta 7e-6: dp-accounting's RDP
    rdp = RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    rdp.compose(dp_accounting.SampledWithoutReplacementDpEvent(
        60, 60, dp_accounting.GaussianDpEvent(4.0)))
    assert tr.spent_epsilon == pytest.approx(rdp.get_epsilon(7e-6), rel=1e-12)
    assert 1.0 < tr.spent_epsilon < 1.1
    assert (g.spent_epsilon, r.spent_epsilon, ev.spent_epsilon) == (0.5, 0.25, 0.75)
    assert (ev.cap_epsilon, ev.remaining_epsilon) == (3.0, 2.25)
    # lifetime spend next to the epoch spend, the same in every row of the epoch
    total = tr.spent_epsilon + 0.5 + 0.25
    for x in rows:
        assert x.lifetime_spent_epsilon == pytest.approx(total, rel=1e-15)
        assert x.lifetime_spent_delta == pytest.approx(7e-6, rel=1e-12)  # only training has delta
        assert (x.lifetime_cap_epsilon, x.lifetime_cap_delta) == (50.0, 5e-5)
        assert x.lifetime_remaining_epsilon == pytest.approx(50.0 - total, rel=1e-15)
        assert x.adjacency == "replace_one"
    cols = ledger.table_columns(0)
    assert cols["line_item"] == [x.line_item for x in rows]
    assert set(cols) == set(type(rows[0]).model_fields)
    assert {"lifetime_spent_epsilon", "lifetime_cap_epsilon", "adjacency"} <= set(cols)
    untouched = ledger.table(5)  # an epoch not started yet shows the policy's allocation
    assert [(x.cap_epsilon, x.spent_epsilon) for x in untouched] == [
        (7.0, 0.0), (3.0, 0.0), (1.5, 0.0), (1.5, 0.0)]


def test_default_policy_is_used_when_none_given(ledger):
    assert ledger.policy == default_policy()
    assert isinstance(ledger.path, Path)


# ------------------------------------------------------------------ lifetime cap


def _lifetime_policy(tmp_path, epsilon="12.0", delta="5e-5"):
    text = (POLICY_TEXT
            .replace("lifetime_epsilon_per_client = 50.0", f"lifetime_epsilon_per_client = {epsilon}")
            .replace("lifetime_delta_per_client = 5e-5", f"lifetime_delta_per_client = {delta}")
            .replace('"clma-privacy-policy-v2"', '"clma-privacy-policy-lifetime-test"'))
    path = tmp_path / "lifetime.toml"
    path.write_text(text)
    return load_policy(path)


def test_lifetime_cap_below_at_and_above(tmp_path):
    # epoch cap 10 (global line 1.5) and lifetime cap 12 = 8 epochs of a full global line
    led = PrivacyLedger(tmp_path / "s", _lifetime_policy(tmp_path))
    for epoch in range(7):  # below: 1.5 ... 10.5
        res = _charge(led, 10 * epoch, "g", G, [LAP(1.5)])
        assert res.status is ReservationStatus.GRANTED
        assert res.lifetime_epsilon_after == 1.5 * (epoch + 1)
    at = _charge(led, 70, "g", G, [LAP(1.5)])  # exactly at the cap: granted
    assert at.status is ReservationStatus.GRANTED and at.lifetime_epsilon_after == 12.0
    assert led.lifetime_spent() == (12.0, 0.0) and led.lifetime_remaining() == 0.0
    above = _charge(led, 80, "g", G, [LAP(0.25)])  # the epoch's own line is untouched
    assert above.refused and above.refusal == "exceeds_lifetime_cap"
    assert above.lifetime_epsilon_after == 12.25 and above.line_epsilon_after == 0.25
    assert led.spent(8, G).epsilon == 0.0 and len(led.entries()) == 8
    (refusal,) = [d for d in led.decisions() if d["kind"] == "charge_refused"]
    assert refusal["detail"] == {"line": "evaluation.global", "reason": "exceeds_lifetime_cap",
                                 "release": "g", "round": 80}
    # the line cap is checked first: a charge over both caps names the line
    over_both = _charge(led, 81, "g2", G, [LAP(2.0)])
    assert over_both.refusal == "exceeds_line_cap"
    rows = {(r.epoch, r.line_item): r for r in led.table()}
    assert [rows[(e, "training")].lifetime_spent_epsilon for e in range(9)] == [
        1.5, 3.0, 4.5, 6.0, 7.5, 9.0, 10.5, 12.0, 12.0]
    assert rows[(8, "evaluation.global")].lifetime_remaining_epsilon == 0.0


def test_lifetime_refusal_persists_after_reopening_and_idempotency_is_unchanged(tmp_path):
    policy = _lifetime_policy(tmp_path)
    led = PrivacyLedger(tmp_path / "s", policy)
    for epoch in range(8):
        with led.charge(10 * epoch, "g", G, [LAP(1.5)]) as res:
            res.commit(f"payload-{epoch}")
    assert _charge(led, 80, "g", G, [LAP(0.5)]).refusal == "exceeds_lifetime_cap"
    reopened = PrivacyLedger(tmp_path / "s", policy)
    again = _charge(reopened, 80, "g", G, [LAP(0.5)])  # a re-run of the refused release
    assert again.refused and again.refusal == "exceeds_lifetime_cap"
    assert [d["detail"]["reason"] for d in reopened.decisions()
            if d["kind"] == "charge_refused"] == ["exceeds_lifetime_cap"] * 2
    assert len(reopened.entries()) == 8  # nothing was written for the refused key
    # a release committed before the cap was reached still republishes its payload
    done = _charge(reopened, 70, "g", G, [LAP(1.5)])
    assert done.already_committed and done.stored_result == "payload-7"
    # another training or regional charge is refused as well
    assert _charge(reopened, 85, "r", R, {"north": LAP(0.1)}).refusal == "exceeds_lifetime_cap"


def test_lifetime_delta_cap(tmp_path):
    # lifetime delta = the epoch delta (1e-5): one epoch of Gaussian training (7e-6) fits,
    # a second does not; pure-epsilon lines spend no delta
    led = PrivacyLedger(tmp_path / "s", _lifetime_policy(tmp_path, epsilon="1000.0", delta="1e-5"))
    with led.charge_training(0, 4.0, population_size=60, sample_size=60) as res:
        assert res.status is ReservationStatus.GRANTED
    assert led.lifetime_spent()[1] == pytest.approx(7e-6, rel=1e-12)
    with led.charge_training(10, 4.0, population_size=60, sample_size=60) as res:
        assert res.refused and res.refusal == "exceeds_lifetime_cap"
        assert res.lifetime_delta_after == pytest.approx(1.4e-5, rel=1e-12)
    assert _charge(led, 10, "g", G, [LAP(1.0)]).status is ReservationStatus.GRANTED


def test_lifetime_is_the_basic_composition_of_the_epoch_totals(tmp_path):
    led = PrivacyLedger(tmp_path / "s")  # shipped policy: lifetime cap 50
    m = {"c1": "north", "c2": "south"}
    for epoch in range(3):
        r0 = 10 * epoch
        with led.charge_training(r0, 3.0, population_size=60, sample_size=20):
            pass
        with led.charge_training(r0 + 1, 3.0, population_size=60, sample_size=20):
            pass
        _charge(led, r0, "g", G, [LAP(0.5)])
        _regional(led, r0, 0.75, 0.25, membership=m)  # max over regions: 0.75
    parts = [led.spent(e, line).epsilon for e in range(3) for line in (T, G, R)]
    assert led.lifetime_spent()[0] == pytest.approx(math.fsum(parts), rel=1e-15)
    assert led.spent(0, R).epsilon == 0.75
    rdp = RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    rdp.compose(dp_accounting.SampledWithoutReplacementDpEvent(
        60, 20, dp_accounting.GaussianDpEvent(3.0)), 2)
    assert led.lifetime_spent()[0] == pytest.approx(3 * (rdp.get_epsilon(7e-6) + 1.25), rel=1e-12)
    assert led.lifetime_spent()[1] == pytest.approx(3 * 7e-6, rel=1e-12)


def test_a_policy_without_lifetime_cap_reports_spend_and_refuses_nothing_for_it(tmp_path):
    v1 = load_policy("privacy_policy_v1.toml")
    assert v1.lifetime_cap() is None
    led = PrivacyLedger(tmp_path / "s", v1)
    for epoch in range(12):  # 12 epochs x 1.5 = 18, refused by no lifetime cap
        assert _charge(led, 10 * epoch, "g", G, [LAP(1.5)]).status is ReservationStatus.GRANTED
    assert led.lifetime_spent()[0] == 18.0 and led.lifetime_remaining() is None
    row = led.table(11)[0]
    assert row.lifetime_spent_epsilon == 18.0 and row.lifetime_cap_epsilon is None
    assert row.lifetime_remaining_epsilon is None
