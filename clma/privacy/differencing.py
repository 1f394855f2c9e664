"""The differencing rule: no linear combination of learned sums isolates fewer than m clients.

A server that learned the sums ``sum_{e in S_i} x_e`` of several sets ``S_1 .. S_k`` of
reports also knows every linear combination ``sum_i y_i (sum_{e in S_i} x_e)``. Such a
combination reveals a function of few clients when its support -- the elements with a
non-zero coefficient -- holds fewer than m distinct clients (a single client's exact
report when the support is one client). The rule: the span of the learned sets' indicator
vectors holds no non-zero vector supported on fewer than m clients.

Elements are ``(client, digest)`` pairs: a client's report depends on the parameters it
evaluated (and the metric layout), so two sums share an unknown only where the same client
evaluated bit-identical parameters (``digest``: SHA-256 of the layout version and the
parameter bytes, no cohort id or group name). Treating a client's report under one digest
as one unknown across rounds is conservative: its data may have changed, which only makes
differences less exact.

Computation (exact, rational arithmetic):

1. *Atoms*: elements grouped by the sets that contain them. Every vector of the span is
   constant on atoms, so the question is one about the atom-incidence matrix ``A`` (sets x
   atoms, 0/1).
2. Only atoms with fewer than m clients ("small") can be in a bad support. ``W``, the
   vectors of the row space of ``A`` supported on small atoms alone, is ``{y^T A :
   y^T A[:, large] = 0}``: computed from a basis of the left null space of the large
   atoms' columns. ``W = 0`` (the common case) means the rule holds.
3. Otherwise a vector of ``W`` supported inside a set ``T`` of small atoms exists iff
   ``rank(W[:, not T]) < dim W``; the sets ``T`` with fewer than m clients are searched
   among the atoms some vector of ``W`` touches, smallest first.

Sets that share no element are independent problems (connected components).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Hashable, Iterable, Sequence
from fractions import Fraction

__all__ = ["exposed_clients", "holds_floor"]

Element = tuple[int, Hashable]


def _rref(rows: list[list[Fraction]], ncols: int) -> tuple[list[list[Fraction]], list[int]]:
    """Reduced row echelon form over the rationals; (non-zero rows, pivot columns)."""
    m = [list(r) for r in rows]
    pivots: list[int] = []
    r = 0
    for c in range(ncols):
        p = next((i for i in range(r, len(m)) if m[i][c] != 0), None)
        if p is None:
            continue
        m[r], m[p] = m[p], m[r]
        inv = 1 / m[r][c]
        m[r] = [v * inv for v in m[r]]
        for i in range(len(m)):
            if i != r and m[i][c] != 0:
                f = m[i][c]
                m[i] = [a - f * b for a, b in zip(m[i], m[r], strict=True)]
        pivots.append(c)
        r += 1
        if r == len(m):
            break
    return m[:r], pivots


def _rank(rows: list[list[int]], ncols: int) -> int:
    """Exact rank of an integer matrix (fraction-free elimination, Python integers)."""
    m = [list(r) for r in rows if any(r)]
    rank = 0
    for c in range(ncols):
        p = next((i for i in range(rank, len(m)) if m[i][c] != 0), None)
        if p is None:
            continue
        m[rank], m[p] = m[p], m[rank]
        piv = m[rank]
        for i in range(rank + 1, len(m)):
            f = m[i][c]
            if f:
                m[i] = [piv[c] * a - f * b for a, b in zip(m[i], piv, strict=True)]
                g = math.gcd(*m[i])
                if g > 1:
                    m[i] = [v // g for v in m[i]]
        rank += 1
        if rank == len(m):
            break
    return rank


def _integer_rows(rows: list[list[Fraction]]) -> list[list[int]]:
    """Each row times the lcm of its denominators (the same rank, integer entries)."""
    out = []
    for r in rows:
        scale = math.lcm(*(v.denominator for v in r)) if r else 1
        out.append([int(v * scale) for v in r])
    return out


def _null_basis_rows(incidence: list[list[int]], n_atoms: int) -> list[list[Fraction]]:
    """Rows of a null-space basis K of ``incidence`` (one row per atom, k columns)."""
    red, pivots = _rref([[Fraction(v) for v in row] for row in incidence], n_atoms)
    free = [c for c in range(n_atoms) if c not in set(pivots)]
    k = [[Fraction(0)] * len(free) for _ in range(n_atoms)]
    for j, f in enumerate(free):
        k[f][j] = Fraction(1)
        for i, p in enumerate(pivots):
            k[p][j] = -red[i][f]
    return k


def _components(sets: Sequence[frozenset[Element]]) -> list[list[int]]:
    parent = list(range(len(sets)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[Element, int] = {}
    for i, s in enumerate(sets):
        for e in s:
            if e in owner:
                a, b = find(i), find(owner[e])
                if a != b:
                    parent[a] = b
            else:
                owner[e] = i
    groups: dict[int, list[int]] = {}
    for i in range(len(sets)):
        groups.setdefault(find(i), []).append(i)
    return list(groups.values())


def _exposed_in(sets: Sequence[frozenset[Element]], m: int) -> frozenset[int] | None:
    signature: dict[Element, tuple[int, ...]] = {}
    for i, s in enumerate(sets):
        for e in s:
            signature[e] = (*signature.get(e, ()), i)
    atoms: dict[tuple[int, ...], set[Element]] = {}
    for e, sig in signature.items():
        atoms.setdefault(sig, set()).add(e)
    keys = sorted(atoms)
    clients = [frozenset(int(c) for c, _ in atoms[k]) for k in keys]
    small = [j for j, cs in enumerate(clients) if len(cs) < m]
    if not small:
        return None
    large = [j for j in range(len(keys)) if j not in set(small)]
    # W: the vectors of the row space supported on small atoms only, y^T A with
    # y^T A[:, large] = 0 (y in the left null space of the large atoms' columns)
    col = [[1 if i in keys[j] else 0 for i in range(len(sets))] for j in large]
    y = _null_basis_rows(col, len(sets)) if col else [
        [Fraction(int(i == t)) for t in range(len(sets))] for i in range(len(sets))]
    width = len(y[0]) if y else 0
    w_rows = [[sum((y[i][t] for i in range(len(sets)) if i in keys[j]), Fraction(0))
               for j in small] for t in range(width)]
    w_frac, _ = _rref(w_rows, len(small))
    w = _integer_rows(w_frac)
    d = len(w)
    if d == 0:
        return None  # no combination lives on the small atoms alone
    support = [x for x in range(len(small)) if any(r[x] != 0 for r in w)]
    for size in range(1, m):
        for combo in itertools.combinations(support, size):
            who = frozenset().union(*(clients[small[x]] for x in combo))
            if len(who) >= m:
                continue
            rest = [x for x in range(len(small)) if x not in combo]
            if _rank([[r[x] for x in rest] for r in w], len(rest)) < d:
                return who  # some vector of W vanishes outside combo
    return None


def exposed_clients(sets: Iterable[Collection[Element]], m: int, *,
                    touching: Collection[Element] | None = None) -> frozenset[int] | None:
    """Clients of a linear combination of the sums over ``sets`` that holds fewer than m of
    them, or None when there is none (the rule holds).

    The span of sets in different connected components (sharing no element) is a direct
    sum, and a combination's client count is at least that of its part in any one
    component, so each component is checked on its own.

    Args:
        sets: each a collection of ``(client id, digest)`` elements whose sum was (or
            would be) learned; empty sets and repeats are allowed.
        m: the cohort floor (``m >= 1``).
        touching: check only the components with a set that shares an element with this
            one (the server checking one new set against a history that kept the rule:
            the other components are unchanged). None: every component.

    Returns:
        The distinct clients of one such combination's support (fewer than m), or None.

    Raises:
        ValueError: ``m < 1``.
    """
    if m < 1:
        raise ValueError("m: the cohort floor must be at least 1")
    uniq = sorted({frozenset(s) for s in sets if s}, key=lambda s: sorted(map(repr, s)))
    key = None if touching is None else frozenset(touching)
    for comp in _components(uniq):
        if key is not None and not any(uniq[i] & key for i in comp):
            continue
        found = _exposed_in([uniq[i] for i in comp], m)
        if found is not None:
            return found
    return None


def holds_floor(sets: Iterable[Collection[Element]], m: int) -> bool:
    """True when no linear combination of the sums over ``sets`` isolates fewer than m
    clients (:func:`exposed_clients` is None)."""
    return exposed_clients(sets, m) is None
