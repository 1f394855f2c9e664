"""The differencing rule (clma.privacy.differencing) on the cases of the privacy review and
against a brute-force check that uses the other formulation (a column-removal rank drop)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clma.privacy.differencing import exposed_clients, holds_floor

D = "model-a"


def _s(*clients, digest=D):
    return {(c, digest) for c in clients}


def test_a_partition_of_groups_at_the_floor_holds():
    assert holds_floor([_s(*range(0, 5)), _s(*range(5, 11)), _s(*range(11, 16))], 5)


def test_the_same_set_twice_holds_and_one_client_fewer_does_not():
    g = _s(*range(6))
    assert holds_floor([g, g], 5)
    assert exposed_clients([g, _s(*range(1, 6))], 5) == {0}


def test_the_renamed_group_of_the_review_is_caught():
    """south(r8) - [central+south(r10) - central(r8)] is one client's report when one
    south client is missing at r10 (all models unchanged)."""
    south, central = _s(*range(0, 5)), _s(*range(5, 17))
    merged = _s(*range(1, 17))  # client 0 not sampled at r10
    assert holds_floor([south, central], 5)
    assert exposed_clients([south, central, merged], 5) == {0}


def test_a_difference_of_two_clients_is_caught():
    """S1 = x + z, S2 = y + z: S1 - S2 = x - y involves two clients only."""
    z = set(range(10, 20))
    assert exposed_clients([_s(0, *z), _s(1, *z)], 5) == {0, 1}
    # ... unless the two differ by m clients or more
    assert holds_floor([_s(*range(5), *z), _s(*range(5, 10), *z)], 5)


def test_other_parameters_are_other_unknowns():
    """The same clients evaluating other parameters share no unknown with the first sum."""
    assert holds_floor([_s(*range(6)), _s(*range(1, 6), digest="model-b")], 5)
    # a client counts once, whatever the digests of its elements
    mixed = _s(0, 1, 2) | _s(0, 1, digest="model-b")
    assert holds_floor([mixed], 3) and exposed_clients([mixed], 4) == {0, 1, 2}


def test_bad_floor_is_refused():
    with pytest.raises(ValueError, match="m: the cohort floor must be at least 1"):
        exposed_clients([], 0)


def _brute_force(sets: list[set], m: int) -> bool:
    """True when the rule holds: for every set T of atoms with fewer than m clients,
    removing T's columns keeps the rank (numpy's SVD rank on a small 0/1 matrix)."""
    sets = [s for s in sets if s]
    if not sets:
        return True
    universe = sorted(set().union(*sets))
    sig = {e: tuple(i for i, s in enumerate(sets) if e in s) for e in universe}
    atoms = sorted(set(sig.values()))
    members = {a: {e for e in universe if sig[e] == a} for a in atoms}
    a_mat = np.array([[1.0 if i in a else 0.0 for a in atoms] for i in range(len(sets))])
    full = np.linalg.matrix_rank(a_mat)
    for size in range(1, len(atoms) + 1):
        for t in itertools.combinations(range(len(atoms)), size):
            clients = {c for j in t for c, _ in members[atoms[j]]}
            if len(clients) >= m:
                continue
            rest = [j for j in range(len(atoms)) if j not in t]
            r = np.linalg.matrix_rank(a_mat[:, rest]) if rest else 0
            if r < full:
                return False
    return True


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sets(st.integers(0, 9), max_size=9), min_size=1, max_size=5),
       st.integers(1, 5), st.integers(0, 2))
def test_matches_the_brute_force_check(raw, m, n_digests):
    sets = [{(c, f"d{c % (n_digests + 1)}") for c in s} for s in raw]
    assert holds_floor(sets, m) == _brute_force(sets, m)
    found = exposed_clients(sets, m)
    assert found is None or len(found) < m


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sets(st.integers(0, 9), min_size=1, max_size=9), min_size=1, max_size=5),
       st.sets(st.integers(0, 9), min_size=1, max_size=9), st.integers(1, 5))
def test_checking_only_the_new_sets_component_is_the_same_answer(history, new, m):
    """Against a history that keeps the rule, the components a new set does not touch
    cannot break it: checking the new set's component alone gives the same verdict."""
    hist = [{(c, "d" if c < 5 else "e") for c in s} for s in history]
    if not holds_floor(hist, m):
        return  # the server never holds such a history
    cand = {(c, "d" if c < 5 else "e") for c in new}
    full = exposed_clients([*hist, cand], m)
    fast = exposed_clients([*hist, cand], m, touching=cand)
    assert (full is None) == (fast is None)
