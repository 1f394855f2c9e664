"""The versioned privacy policy: loading, field errors, hashes, caps and the borrow rule."""

from __future__ import annotations

import hashlib
import math
from importlib import resources
from pathlib import Path

import pytest

from clma.budget.policy import (
    BorrowApproval,
    BorrowRefusal,
    BorrowRequest,
    LineItem,
    PolicyError,
    default_policy,
    evaluate_borrow,
    load_policy,
)

POLICY_TEXT = resources.files("clma").joinpath("policy", "privacy_policy_v2.toml").read_text()
# Pinned on purpose: a change to a policy file must be reviewed and this hash updated.
PINNED_FILE_SHA256 = "e52c19f816b7fd1768050d4026bb8c0b6868302e0e63677bcc8660a5491e9a06"
# v1 predates the lifetime cap; it stays, unchanged, for the ledgers and tests that use it.
PINNED_V1_FILE_SHA256 = "00472d04da1e9e38d379218e0825e0129527d3d511c3f65165d9193aa98e926d"


def policy_with(tmp_path: Path, **replace: str):
    """Write the shipped policy with whole lines replaced (``key=new line``)."""
    lines = POLICY_TEXT.splitlines()
    for key, new in replace.items():
        idx = [i for i, line in enumerate(lines) if line.split("=")[0].strip() == key]
        assert len(idx) == 1, key
        lines[idx[0]] = new
    path = tmp_path / "policy.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_shipped_policy_values_and_hash():
    p = default_policy()
    assert p.policy_version == "clma-privacy-policy-v2"
    assert p.budget.epsilon_per_client_per_epoch == 10.0
    assert p.budget.delta_per_client_per_epoch == 1e-5
    assert p.lifetime_cap() == (50.0, 5e-5)  # five epochs at the full cap
    assert (p.budget.training_fraction, p.budget.evaluation_fraction) == (0.7, 0.3)
    assert (p.evaluation.global_fraction, p.evaluation.regional_fraction) == (0.5, 0.5)
    assert p.evaluation.minimum_group_size == 5
    assert p.borrowing.approvers == ("privacy-officer", "dpo-deputy")
    assert p.borrowing.max_borrows_per_epoch == 1
    assert p.mechanism_version("laplace") == "v1"
    raw = resources.files("clma").joinpath("policy", "privacy_policy_v2.toml").read_bytes()
    assert p.content_hash == hashlib.sha256(raw).hexdigest() == PINNED_FILE_SHA256


def test_v1_policies_still_load_without_a_lifetime_cap():
    v1 = load_policy("privacy_policy_v1.toml")
    assert v1.policy_version == "clma-privacy-policy-v1" and v1.lifetime_cap() is None
    assert v1.content_hash == PINNED_V1_FILE_SHA256
    assert load_policy("simulation_policy_v1.toml").lifetime_cap() is None
    # the same rules as v2 apart from the lifetime cap
    a = v1.model_dump(exclude={"policy_version", "content_hash", "source"})
    b = default_policy().model_dump(exclude={"policy_version", "content_hash", "source"})
    b["budget"].update(lifetime_epsilon_per_client=None, lifetime_delta_per_client=None)
    assert a == b


def test_hashes_stable_across_loads_and_rules_hash_ignores_comments(tmp_path):
    a, b = load_policy(), load_policy()
    assert a.content_hash == b.content_hash and a.rules_hash == b.rules_hash
    commented = tmp_path / "c.toml"
    commented.write_text("# an extra comment\n" + POLICY_TEXT)
    c = load_policy(commented)
    assert c.content_hash != a.content_hash  # the file changed
    assert c.rules_hash == a.rules_hash  # the rules did not
    changed = load_policy(policy_with(tmp_path, epoch_length_rounds="epoch_length_rounds = 5"))
    assert changed.rules_hash != a.rules_hash


def test_line_caps_split_the_cap_exactly():
    p = default_policy()
    caps = {line: p.line_cap(line) for line in LineItem}
    assert caps[LineItem.TRAINING] == pytest.approx((7.0, 7e-6), rel=1e-15)
    assert caps[LineItem.EVALUATION_GLOBAL] == pytest.approx((1.5, 1.5e-6), rel=1e-15)
    assert caps[LineItem.EVALUATION_REGIONAL] == pytest.approx((1.5, 1.5e-6), rel=1e-15)
    assert math.fsum(c[0] for c in caps.values()) == pytest.approx(10.0, rel=1e-15)
    assert math.fsum(c[1] for c in caps.values()) == pytest.approx(1e-5, rel=1e-12)


def test_epoch_of_round():
    p = default_policy()
    assert [p.epoch_of_round(r) for r in (0, 9, 10, 19, 20)] == [0, 0, 1, 1, 2]
    for bad in (-1, 1.0, True):
        with pytest.raises(PolicyError, match="round"):
            p.epoch_of_round(bad)


@pytest.mark.parametrize(
    ("key", "line", "field"),
    [
        ("training_fraction", "training_fraction = 0.8", "budget"),
        ("epsilon_per_client_per_epoch", "epsilon_per_client_per_epoch = -1.0",
         "budget.epsilon_per_client_per_epoch"),
        ("epsilon_per_client_per_epoch", "epsilon_per_client_per_epoch = nan",
         "budget.epsilon_per_client_per_epoch"),
        ("epsilon_per_client_per_epoch", "epsilon_per_client_per_epoch = inf",
         "budget.epsilon_per_client_per_epoch"),
        ("epoch_length_rounds", "epoch_length_rounds = true", "budget.epoch_length_rounds"),
        ("epoch_length_rounds", "epoch_length_rounds = 0", "budget.epoch_length_rounds"),
        ("delta_per_client_per_epoch", "delta_per_client_per_epoch = 1.5",
         "budget.delta_per_client_per_epoch"),
        ("global_fraction", "global_fraction = 0.6", "evaluation"),
        ("minimum_group_size", "minimum_group_size = 1", "evaluation.minimum_group_size"),
        ("regional_cadence_rounds", "regional_cadence_rounds = \"2\"",
         "evaluation.regional_cadence_rounds"),
        ("approvers", "approvers = []", "borrowing.approvers"),
        ("approvers", "approvers = [\"a\", \"a\"]", "borrowing.approvers"),
        ("approvers", "approvers = [\" a\"]", "borrowing.approvers"),
        ("max_borrows_per_epoch", "max_borrows_per_epoch = 2", "borrowing.max_borrows_per_epoch"),
        ("max_fraction_of_next_epoch", "max_fraction_of_next_epoch = 1.5",
         "borrowing.max_fraction_of_next_epoch"),
        ("laplace", "laplace = \"1\"", "mechanisms.laplace"),
        ("gaussian", "gaussian = \"v01\"", "mechanisms.gaussian"),
        ("policy_version", "policy_version = \"\"", "policy_version"),
        ("pld_value_discretization_interval", "pld_value_discretization_interval = 0.0",
         "accounting.pld_value_discretization_interval"),
        ("approval_timeout_seconds", "approval_timeout_seconds = 1.5",
         "borrowing.approval_timeout_seconds"),
        ("lifetime_epsilon_per_client", "lifetime_epsilon_per_client = 9.5",
         "budget.lifetime_epsilon_per_client"),
        ("lifetime_epsilon_per_client", "lifetime_epsilon_per_client = -1.0",
         "budget.lifetime_epsilon_per_client"),
        ("lifetime_epsilon_per_client", "lifetime_epsilon_per_client = nan",
         "budget.lifetime_epsilon_per_client"),
        ("lifetime_delta_per_client", "lifetime_delta_per_client = 5e-6",
         "budget.lifetime_delta_per_client"),
        ("lifetime_delta_per_client", "lifetime_delta_per_client = 1.0",
         "budget.lifetime_delta_per_client"),
        ("lifetime_epsilon_per_client", "", "budget.lifetime_delta_per_client"),
        ("lifetime_delta_per_client", "", "budget.lifetime_delta_per_client"),
    ],
)
def test_bad_value_fails_naming_the_field(tmp_path, key, line, field):
    path = policy_with(tmp_path, **{key: line})
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    msg = str(info.value)
    assert f"field '{field}'" in msg
    assert msg.count("field '") == 1  # one clear error


def test_lifetime_cap_rule_messages(tmp_path):
    below = policy_with(tmp_path, lifetime_epsilon_per_client="lifetime_epsilon_per_client = 9.5")
    with pytest.raises(PolicyError, match="lifetime cap below the epoch cap is an error"):
        load_policy(below)
    alone = policy_with(tmp_path, lifetime_delta_per_client="")
    with pytest.raises(PolicyError, match="give both or neither"):
        load_policy(alone)
    at = policy_with(tmp_path, lifetime_epsilon_per_client="lifetime_epsilon_per_client = 10.0",
                     lifetime_delta_per_client="lifetime_delta_per_client = 1e-5")
    assert load_policy(at).lifetime_cap() == (10.0, 1e-5)  # equal to the epoch cap is allowed


def test_unknown_key_and_missing_key_are_named(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text(POLICY_TEXT.replace("[budget]\n", "[budget]\nsurprise = 1\n"))
    with pytest.raises(PolicyError, match=r"field 'budget\.surprise'"):
        load_policy(path)
    path.write_text(POLICY_TEXT.replace("epoch_length_rounds = 10\n", ""))
    with pytest.raises(PolicyError, match=r"field 'budget\.epoch_length_rounds'"):
        load_policy(path)
    path.write_text("content_hash = \"x\"\n" + POLICY_TEXT)
    with pytest.raises(PolicyError, match="content_hash"):
        load_policy(path)


def test_unreadable_or_invalid_toml(tmp_path):
    with pytest.raises(PolicyError, match="cannot be read"):
        load_policy(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("policy_version = \n")
    with pytest.raises(PolicyError, match="not valid TOML"):
        load_policy(bad)


# ------------------------------------------------------------------ borrowing rule


def _req(eps=0.5, line=LineItem.EVALUATION_GLOBAL):
    return BorrowRequest(epoch=0, line=line, epsilon=eps, run_id="run-1", reason="eval overspend")


@pytest.mark.parametrize(
    ("approval", "already", "eps", "expected"),
    [
        (None, 0, 0.5, BorrowRefusal.TIMEOUT),
        (BorrowApproval(approver="mallory", approve=True), 0, 0.5, BorrowRefusal.NOT_ON_ALLOW_LIST),
        (BorrowApproval(approver="Privacy-Officer", approve=True), 0, 0.5,
         BorrowRefusal.NOT_ON_ALLOW_LIST),
        (BorrowApproval(approver="mallory", approve=True), 1, 0.5, BorrowRefusal.NOT_ON_ALLOW_LIST),
        (BorrowApproval(approver="privacy-officer", approve=True), 1, 0.5,
         BorrowRefusal.ALREADY_BORROWED_THIS_EPOCH),
        (BorrowApproval(approver="privacy-officer", approve=False), 0, 0.5, BorrowRefusal.DENIED),
        (BorrowApproval(approver="dpo-deputy", approve=True), 0, 0.75, None),
        (BorrowApproval(approver="dpo-deputy", approve=True), 0, 0.7500001,
         BorrowRefusal.EXCEEDS_BORROW_LIMIT),
        (BorrowApproval(approver="privacy-officer", approve=True, reason="ok"), 0, 0.1, None),
    ],
)
def test_evaluate_borrow_rule(approval, already, eps, expected):
    # next epoch's global line is 1.5; limit = 0.5 * 1.5 = 0.75
    got = evaluate_borrow(_req(eps), approval, default_policy(),
                          borrows_approved_this_epoch=already, next_epoch_line_epsilon=1.5)
    assert got is expected


def test_borrow_request_validation():
    with pytest.raises(ValueError, match="only evaluation lines may borrow"):
        BorrowRequest(epoch=0, line="training", epsilon=0.1)
    with pytest.raises(ValueError):
        BorrowRequest(epoch=0, line="evaluation.global", epsilon=float("inf"))
    with pytest.raises(ValueError):
        BorrowRequest(epoch=-1, line="evaluation.global", epsilon=0.1)
    assert BorrowRequest(epoch=0, line="evaluation.regional", epsilon=0.1).line is (
        LineItem.EVALUATION_REGIONAL
    )
    with pytest.raises(ValueError):
        BorrowApproval(approver="x", approve="yes")


def test_bundled_simulation_policy_by_file_name(tmp_path, monkeypatch):
    from clma.budget.policy import PolicyError, load_policy

    monkeypatch.chdir(tmp_path)  # no such file in the working directory
    sim = load_policy("simulation_policy_v2.toml")
    prod = load_policy()
    assert sim.policy_version == "clma-simulation-policy-v2"
    assert sim.source == "clma/policy/simulation_policy_v2.toml"
    assert sim.budget.epsilon_per_client_per_epoch == 8 * prod.budget.epsilon_per_client_per_epoch
    assert sim.budget.lifetime_epsilon_per_client == 8 * prod.budget.lifetime_epsilon_per_client
    assert sim.budget.lifetime_delta_per_client == prod.budget.lifetime_delta_per_client
    # every rule except the cap is the production policy's
    a = sim.model_dump(exclude={"policy_version", "content_hash", "source", "rules_hash", "budget"})
    b = prod.model_dump(exclude={"policy_version", "content_hash", "source", "rules_hash", "budget"})
    assert a == b
    with pytest.raises(PolicyError, match="cannot be read"):
        load_policy("no_such_policy.toml")
