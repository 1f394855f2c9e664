"""Pairwise-masking secure aggregation (Bonawitz et al. CCS 2017; SecAgg+ graph of Bell et al. CCS 2020).

The server learns the SUM over the surviving clients of their clipped,
quantised metric vectors, and nothing else about any single vector.  Only the
protocol is written here; the cryptographic primitives come from
``cryptography`` (X25519 key agreement, HKDF-SHA256, AES-CTR as the mask PRG,
AES-GCM for shares in transit, SHA-256 for commitments).  Shamir secret sharing
is the textbook scheme over the prime field GF(p), ``p = 2^130 - 5``, written
here (:func:`shamir_split`, :func:`shamir_reconstruct`).

Threat model
------------
* Server: semi-honest (honest-but-curious, Bonawitz et al. §6.2): it follows the
  protocol -- sends every survivor the same unmasking request, draws the graph
  seed at random -- and tries to learn more from what it sees.  An actively
  malicious server (different requests to different clients, a graph seed
  ground against chosen victims) needs the consistency-check round with
  signatures of Bonawitz et al. §4 / Bell et al. §4, which is not implemented.
* Clients: up to a fraction ``corrupted_fraction`` (gamma) of them may collude
  with the server (they hand over their secrets); any client may be hostile
  towards the round (malformed or contradictory messages) -- the server
  validates every message and treats a client whose contribution is malformed
  as a dropout (``SecAggResult.rejected``), never aborting the round for it.
  A hostile client cannot be stopped from adding an arbitrary value mod 2^k to
  the sum: masked words are uniform, so an input's range cannot be checked
  without zero-knowledge proofs (out of scope).
* Dropouts: up to a fraction ``dropout_fraction`` (delta) of the clients go
  silent at any step; the bounds below assume the dropped and the corrupted
  clients do not depend on the neighbour graph (they are fixed before the graph
  seed is drawn).  Dropouts chosen *after* seeing the graph cannot make the
  server learn a sum over part of the survivors: every client refuses to unmask
  unless the survivors are connected in the graph and at least the survivor
  floor (below), so the round aborts instead.  (Corrupted clients among the
  survivors can still bridge a graph that is disconnected among the honest ones;
  that case is covered by the bound only for dropouts independent of the graph.)

Quantisation
------------
Each coordinate j is clipped to ``[lower_j, upper_j]`` and mapped to an integer
``q = round((x - lower_j) / (upper_j - lower_j) * Q)`` in ``[0, Q]`` with
``Q = quantisation_levels`` (default ``2^16 - 1``).  Arithmetic is modulo
``2^k`` (``modulus_bits = k``, default 32, words held in uint64).  The sum of
n clients is exact (no wrap-around) iff ``n * Q < 2^k``; this is checked when
the round is configured (default: up to 65,537 clients).  With distributed DP
(``SecAggConfig.noise``) an input is ``q`` plus the client's noise share, any ring
element; the ring is then sized so that the noisy sum wraps with probability at most
``2^-statistical_security`` (:mod:`clma.privacy.distributed`), checked here too.  Rounding error on the
de-quantised sum is at most ``n * (upper - lower) / (2 Q)`` per coordinate.

Neighbour graph and its seed
----------------------------
``neighbour_degree=None`` (or ``>= n - 1``): complete graph (original SecAgg).
An even ``neighbour_degree = k < n - 1``: the Harary graph H(k, n) on a random
ring order of the clients (SecAgg+): each client is linked to the k/2 clients
on either side of it on the ring, masks with and secret-shares to those k
neighbours only.  A client's share holders are its neighbours and itself
(k + 1 holders); the share index of a holder is its rank in the sorted holder
list (1-based).  The ring order is ``numpy.random.default_rng(graph_seed)
.permutation`` of the sorted client ids, so the graph is fixed by
``(client_ids, graph_seed)`` in :class:`SecAggConfig`, which the server sends in
round 0, before any client has generated (let alone advertised) a key: the
server cannot choose the graph after seeing keys.  Each client derives its own
neighbours from the config and refuses a neighbour list that differs.  The
bounds below need the ring to be independent of who is corrupted: a
semi-honest server draws ``graph_seed`` at random (``secrets.randbits(64)``);
against a malicious server the seed would have to come from a public beacon or
a coin-flipping round (not implemented).

SecAgg+ parameters (Bell et al. 2020, the semi-honest conditions)
-----------------------------------------------------------------
With ``c = ceil(gamma n)`` corrupted clients and at most ``d = ceil(delta n)``
dropouts, the round is secure and correct when (Bell et al. §3):

(S1) no honest client has t or more corrupted holders (else the corrupted
     clients give the server the second secret of that client and its input
     is revealed);
(S2) the honest survivors stay connected in the neighbour graph (else the
     server learns the sum of each connected component separately: the
     partition attack);
(C)  every client whose secret must be reconstructed keeps at least t
     responding holders, and the survivors stay connected.

On the random ring, a client's k neighbours are a uniform k-subset of the
other n - 1 clients, so its number of corrupted (dropped) neighbours is
hypergeometric, ``Hyp(n - 1, c, k)`` (``Hyp(n - 1, d, k)``).  Removing a fixed
set R of r clients disconnects H(k, n) only if two disjoint windows of k/2
consecutive ring positions lie in R; a fixed pair of windows lies in R with
probability ``C(r, k) / C(n, k)``, and there are fewer than ``C(n, 2)`` pairs.
Union bounds over the n clients give the inequalities this module implements
(exact rational arithmetic), with ``sigma = statistical_security`` and
``eta = correctness``::

    security    : n * P[Hyp(n-1, c, k) >= t] + C(n,2) * C(c+d, k) / C(n, k)  <=  2^-sigma
    correctness : n * max(P[Hyp(n-1, d, k) >= k+2-t], P[Hyp(n-1, d-1, k) >= k+1-t])
                  + C(n,2) * C(d, k) / C(n, k)                                <=  2^-eta
    structure   : t >= 2 and 2 t > k + 1 (a strict majority of the holders)

(in the correctness line the first term is a surviving owner, which answers for
itself, the second a dropped one).  On the complete graph (k = n - 1) there is
no randomness and both lines are exact: ``c < t <= n - d``.  The majority rule
keeps honest holders from ever supplying both kinds of share of one client.
:func:`secagg_plus_parameters` returns the smallest even k < n - 1 that admits a
t (else the complete graph) and the middle of the admissible t interval;
:class:`SecAggConfig` refuses any ``(neighbour_degree, threshold)`` that
violates a line for its ``corrupted_fraction``, ``dropout_fraction``,
``statistical_security`` and ``correctness`` (all four default to values that
make every line trivially true -- no corruption, no dropout assumed -- so a
caller must pass its assumptions).  Bell et al. state the conditions for their
random graphs with Chernoff-style bounds; the bound above is computed for the
Harary graph on a random ring that this module draws, and it is what is enforced.

Messages and what the server sees
---------------------------------
Round 0 ``AdvertiseKeys`` (client -> server -> neighbours): two X25519 public
    keys per client: ``c_pk`` (share encryption) and ``s_pk`` (pairwise
    masks).  The server sees public keys only; it rejects wrong lengths,
    low-order points and keys used twice.
Round 1 ``ShareKeys`` (client -> server -> recipients): client u draws a
    16-byte self-mask seed ``b_u`` and Shamir-shares it and its 32-byte mask
    private key ``s_sk_u`` (as two 16-byte halves) with threshold t among its
    holders, and commits to ``b_u`` with ``SHA-256("clma-secagg|b-commitment|"
    round_id "|" u "|" b_u)``.  Each share is AES-GCM encrypted under
    ``HKDF(X25519(c_sk_u, c_pk_v))``.  The server routes ciphertexts and sees
    who sends to whom, their fixed length and the commitment (which hides the
    128-bit random ``b_u``).
Round 2 ``MaskedInput`` (client -> server): ``y_u = q_u + PRG(b_u) +
    sum_{v in N(u), u<v} PRG(s_uv) - sum_{v in N(u), v<u} PRG(s_uv) mod 2^k``
    with ``s_uv = HKDF(X25519(s_sk_u, s_pk_v))`` and PRG = AES-CTR keystream.
    Because of the self mask ``PRG(b_u)`` each ``y_u`` is uniform on
    ``Z_{2^k}^d`` whatever ``q_u`` is (tested: chi-square against uniform, and
    identical distributions when one client's input changes).
Round 3 ``Unmasking`` (server -> clients -> server): the server announces the
    survivors S (sent a valid y) and the dropped D (shared keys, no valid y).
    Each client answers at most one request per round, and only if ``S ∩ D =
    ∅``, it is in S, ``|S|`` is at least ``SecAggConfig.survivor_floor``, at
    least t of its holders are in S and (SecAgg+) the survivors are connected
    in the neighbour graph; it then returns shares of ``b_u`` for u in S and
    shares of ``s_sk_u`` for u in D -- never both for one u.  The server
    reconstructs ``b_u`` (u in S; checked against the commitment) and
    ``s_sk_u`` (u in D; checked against ``s_pk_u``), decoding around bad shares
    (Berlekamp-Welch) when the first t shares do not check, removes the self
    masks of the survivors and the pairwise masks between survivors and
    dropped clients; pairwise masks between survivors cancel.  It learns
    ``sum_{u in S} q_u mod 2^k`` and nothing about an individual ``q_u``.
Cost
----
Per client: 2k X25519 agreements (one per neighbour for the share encryption key,
kept for decryption, and one for the pairwise mask), k + 1 AES-CTR expansions (one
call per seed) and three sharing polynomials evaluated at k + 1 points.  Server:
all shares of a round are checked at once (numpy: field range, the holder's share
index); each secret is interpolated from its t lowest share indices with Lagrange
coefficients cached per index set (one set serves every owner whose first t
holders answered); one AES-CTR expansion per seed, the masks summed as one array;
per dropped client one agreement per surviving neighbour.
``benchmarks/bench_secagg.py`` measures it against Flower's SecAgg+ primitives.

Abort: fewer than t survivors, a survivor set below the floor or disconnected,
fewer than t responding holders of one client, or no consistent set of t
shares for one client raises :class:`SecAggAbort` -- the sum is refused, never
approximated.  The randomness of keys, self-mask seeds and sharing polynomials
is ``os.urandom`` (directly and via ``cryptography``) and deliberately
unseedable; only the neighbour-graph permutation is seeded.
"""

from __future__ import annotations

import math
import operator
import os
import struct
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from functools import lru_cache
from typing import Any, NamedTuple

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from clma.privacy.distributed import DistributedNoise, wrap_probability

__all__ = [
    "SHAMIR_PRIME",
    "AdvertiseKeys",
    "EncryptedShare",
    "FixedPointQuantiser",
    "MaskedInput",
    "SecAggAbort",
    "SecAggClient",
    "SecAggConfig",
    "SecAggPlusBounds",
    "SecAggPlusParameters",
    "SecAggResult",
    "SecAggServer",
    "ShareKeys",
    "UnmaskingRequest",
    "UnmaskingResponse",
    "harary_neighbours",
    "run_secure_aggregation",
    "secagg_plus_degree",
    "secagg_plus_failure_bounds",
    "secagg_plus_parameters",
    "self_mask_commitment",
    "shamir_reconstruct",
    "shamir_split",
]


#: The Shamir field GF(p), p = 2^130 - 5 (prime; holds any 128-bit chunk).
SHAMIR_PRIME = (1 << 130) - 5
_SHARE_BYTES = 17  # ceil(130 / 8)
_MASK130 = (1 << 130) - 1
_HEADER = struct.Struct("<qqI")  # owner, recipient, share index
_PAYLOAD_BYTES = _HEADER.size + 3 * _SHARE_BYTES
_CIPHERTEXT_BYTES = _PAYLOAD_BYTES + 16  # AES-GCM tag
_COMMITMENT_BYTES = 32
_INT64 = (-(2**63), 2**63 - 1)

# X25519 public keys of small order (libsodium's blacklist; X25519 ignores the top bit):
# an exchange with one of them yields the all-zero secret.
_LOW_ORDER_POINTS = frozenset(bytes.fromhex(h) for h in (
    "0000000000000000000000000000000000000000000000000000000000000000",
    "0100000000000000000000000000000000000000000000000000000000000000",
    "e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b800",
    "5f9c95bca3508c24b1d0b1559c83ef5b04445cc4581c8e86d8224eddd09f1157",
    "ecffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f",
    "edffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f",
    "eeffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f",
))


class SecAggAbort(RuntimeError):
    """The round cannot finish safely (too few survivors or holders, an unsafe request)."""


# --------------------------------------------------------------------------
# SecAgg+ parameters (Bell et al. 2020): the bounds of the module docstring
# --------------------------------------------------------------------------


def _count(fraction: float, n: int) -> int:
    """``ceil(fraction * n)`` in exact decimal arithmetic (0.05 * 100 is 5, not 6)."""
    return math.ceil(Fraction(repr(float(fraction))) * n)


def _hyp_tails(population: int, successes: int, draws: int) -> list[int]:
    """Integer numerators of ``P[Hyp >= x]`` for x = 0..draws+1 (denominator C(population, draws))."""
    pmf = [0] * (draws + 1)
    for j in range(max(0, draws - (population - successes)), min(successes, draws) + 1):
        pmf[j] = math.comb(successes, j) * math.comb(population - successes, draws - j)
    tails = [0] * (draws + 2)
    for j in range(draws, -1, -1):
        tails[j] = tails[j + 1] + pmf[j]
    return tails


def _disconnection(n: int, removed: int, degree: int) -> Fraction:
    """Upper bound on P[H(degree, n) on a random ring minus a fixed set of ``removed`` nodes
    is disconnected]: ``C(n, 2) C(removed, degree) / C(n, degree)``; 0 on the complete graph."""
    if degree >= n - 1 or removed < degree:
        return Fraction(0)
    return Fraction(math.comb(n, 2) * math.comb(removed, degree), math.comb(n, degree))


class _Bounds:
    """Exact failure bounds for one (n, k, gamma, delta), as functions of t."""

    def __init__(self, n: int, degree: int, corrupted: int, dropped: int) -> None:
        self.n, self.k, self.c, self.d = n, min(degree, n - 1), corrupted, dropped
        k = self.k
        self.den = math.comb(n - 1, k)
        self.tail_c = _hyp_tails(n - 1, min(corrupted, n - 1), k)
        self.tail_d = _hyp_tails(n - 1, min(dropped, n - 1), k)
        self.tail_d1 = _hyp_tails(n - 1, min(max(dropped - 1, 0), n - 1), k)
        self.conn_sec = _disconnection(n, corrupted + dropped, k)
        self.conn_cor = _disconnection(n, dropped, k)

    def _tail(self, tails: list[int], x: int) -> int:
        if x <= 0:
            return tails[0]
        return tails[x] if x < len(tails) else 0

    def security(self, t: int) -> Fraction:
        return Fraction(self.n * self._tail(self.tail_c, t), self.den) + self.conn_sec

    def correctness(self, t: int) -> Fraction:
        k = self.k
        worst = self._tail(self.tail_d, k + 2 - t)
        if self.d >= 1:
            worst = max(worst, self._tail(self.tail_d1, k + 1 - t))
        return Fraction(self.n * worst, self.den) + self.conn_cor


class SecAggPlusParameters(NamedTuple):
    """Neighbour degree k (``n - 1`` = complete graph) and Shamir threshold t."""

    degree: int
    threshold: int


class SecAggPlusBounds(NamedTuple):
    """Failure probabilities bounded by the module's inequalities (floats of exact values)."""

    security: float
    correctness: float


def _check_assumptions(n_clients: int, corrupted_fraction: float, dropout_fraction: float,
                       statistical_security: int, correctness: int) -> None:
    if isinstance(n_clients, bool) or int(n_clients) != n_clients or n_clients < 2:
        raise ValueError("n_clients: must be an integer >= 2")
    for name, value in (("corrupted_fraction", corrupted_fraction),
                        ("dropout_fraction", dropout_fraction)):
        if not (isinstance(value, (int, float)) and 0.0 <= value < 1.0):
            raise ValueError(f"{name}: must be a fraction in [0, 1), got {value!r}")
    for name, value, hi in (("statistical_security", statistical_security, 256),
                            ("correctness", correctness, 128)):
        if isinstance(value, bool) or int(value) != value or not 1 <= value <= hi:
            raise ValueError(f"{name}: must be an integer in [1, {hi}] (bits), got {value!r}")


def secagg_plus_failure_bounds(
    n_clients: int, degree: int, threshold: int, *, corrupted_fraction: float,
    dropout_fraction: float,
) -> SecAggPlusBounds:
    """Evaluate the security and correctness lines of the module docstring.

    Args:
        n_clients: n.  degree: k (``>= n - 1`` = complete graph).  threshold: t.
        corrupted_fraction, dropout_fraction: gamma, delta (c = ceil(gamma n),
            d = ceil(delta n)).

    Returns:
        :class:`SecAggPlusBounds` ``(security, correctness)``: the left-hand sides.
    """
    _check_assumptions(n_clients, corrupted_fraction, dropout_fraction, 40, 20)
    b = _Bounds(n_clients, degree, _count(corrupted_fraction, n_clients),
                _count(dropout_fraction, n_clients))
    return SecAggPlusBounds(float(b.security(threshold)), float(b.correctness(threshold)))


_MAX_SPARSE_DEGREE = 1024


def secagg_plus_parameters(
    n_clients: int, *, corrupted_fraction: float, dropout_fraction: float,
    statistical_security: int = 40, correctness: int = 20,
) -> SecAggPlusParameters:
    """SecAgg+ neighbour degree k and threshold t for n clients (Bell et al. 2020).

    The smallest even ``k < n - 1`` for which some t satisfies the security line
    (``<= 2^-statistical_security``), the correctness line (``<= 2^-correctness``)
    and the structure rule of the module docstring; else the complete graph
    (``k = n - 1``) with the exact rule ``c < t <= n - d``.  t is the middle of the
    admissible interval (rounded up): margin both against more corruption and
    against more dropouts than assumed.

    Args:
        n_clients: clients in the round (>= 2).
        corrupted_fraction: gamma, assumed fraction of clients colluding with the server.
        dropout_fraction: delta, fraction of clients that may drop out at any step.
        statistical_security: sigma, bits (default 40).
        correctness: eta, bits (default 20: the round aborts with probability
            <= 2^-20 when at most ``ceil(delta n)`` clients drop out).

    Returns:
        :class:`SecAggPlusParameters` ``(degree, threshold)``; pass
        ``neighbour_degree=None if degree >= n_clients - 1 else degree``.

    Raises:
        ValueError: arguments out of range, or no (k, t) in the safe region (the
            message names the rule).
    """
    _check_assumptions(n_clients, corrupted_fraction, dropout_fraction, statistical_security,
                       correctness)
    n = int(n_clients)
    c, d = _count(corrupted_fraction, n), _count(dropout_fraction, n)
    sec_budget = Fraction(1, 2**int(statistical_security))
    cor_budget = Fraction(1, 2**int(correctness))
    # complete graph: exact rule c < t <= n - d with t > n / 2
    lo_complete, hi_complete = max(2, n // 2 + 1, c + 1), n - d
    if lo_complete > hi_complete:
        raise ValueError(
            f"corrupted_fraction={corrupted_fraction}, dropout_fraction={dropout_fraction}: no "
            f"safe threshold for n_clients={n} (rule: some t with t >= 2, 2t > holders, "
            f"t > ceil(corrupted_fraction*n) = {c} and t <= n - ceil(dropout_fraction*n) = "
            f"{hi_complete} must exist, even on the complete graph; roughly "
            f"dropout_fraction < 1/2 and corrupted_fraction + dropout_fraction < 1)")
    # a sparse graph can only help when delta < 1/2 and gamma + delta < 1 (large-k limit)
    if dropout_fraction < 0.5 and corrupted_fraction + dropout_fraction < 1.0:
        for k in range(2, min(n - 2, _MAX_SPARSE_DEGREE) + 1, 2):
            b = _Bounds(n, k, c, d)
            if b.conn_sec > sec_budget or b.conn_cor > cor_budget:
                continue
            lo = max(2, (k + 1) // 2 + 1)
            while lo <= k + 1 and b.security(lo) > sec_budget:
                lo += 1
            hi = k + 1
            while hi >= lo and b.correctness(hi) > cor_budget:
                hi -= 1
            if lo <= hi:
                return SecAggPlusParameters(k, (lo + hi + 1) // 2)
    return SecAggPlusParameters(n - 1, (lo_complete + hi_complete + 1) // 2)


def secagg_plus_degree(n_clients: int) -> int:
    """Legacy degree ``d = 2 ceil(log2 n)``, capped below n - 1 (even).

    No corruption or dropout assumption stands behind it: use
    :func:`secagg_plus_parameters`.
    """
    if n_clients < 2:
        raise ValueError("n_clients must be >= 2")
    d = 2 * math.ceil(math.log2(n_clients))
    cap = n_clients - 1 if (n_clients - 1) % 2 == 0 else n_clients - 2
    return max(2, min(d, cap))


# --------------------------------------------------------------------------
# configuration and quantisation
# --------------------------------------------------------------------------


class SecAggConfig(BaseModel):
    """Parameters of one secure-aggregation round (sent to every client in round 0).

    Attributes:
        n_clients: clients selected for the round (>= 2).
        threshold: Shamir threshold t (strict majority of each client's holders).
        vector_length: d, values per client (e.g. 32).
        modulus_bits: k, arithmetic modulo 2^k (8..62).
        quantisation_levels: Q, integer levels per coordinate range.
        neighbour_degree: None or ``>= n_clients - 1`` (complete graph), or an even
            degree ``< n_clients - 1`` (SecAgg+ Harary graph).
        round_id: bound into every key derivation (a key is never reused across rounds).
        graph_seed: seed of the ring permutation; draw it at random (``secrets.randbits(64)``).
        corrupted_fraction, dropout_fraction: gamma, delta assumed by the caller; the
            ``(neighbour_degree, threshold)`` pair must satisfy the module's security and
            correctness lines for them (defaults 0: nothing assumed, only the
            structure rule binds).
        statistical_security, correctness: sigma, eta in bits (40, 20).
        min_survivors: clients refuse to unmask a sum over fewer survivors (e.g. the
            cohort floor); None = threshold.  See :attr:`survivor_floor`.
        client_ids: the sorted ids of the round's clients, so that each client derives
            the graph itself (required by clients for their checks on a SecAgg+ graph;
            :func:`run_secure_aggregation` fills it in).
        noise: distributed DP (:class:`clma.privacy.distributed.DistributedNoise`): each
            client adds its discrete Gaussian share to the listed coordinates before
            masking, and its input may then be any ring element (None: inputs in
            ``[0, Q]``, no noise).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    n_clients: int = Field(ge=2)
    threshold: int = Field(ge=2)
    vector_length: int = Field(ge=1)
    modulus_bits: int = Field(default=32, ge=8, le=62)
    quantisation_levels: int = Field(default=2**16 - 1, ge=1)
    neighbour_degree: int | None = None
    round_id: str = Field(default="round-0", min_length=1)
    graph_seed: int = Field(default=0, ge=0)
    corrupted_fraction: float = Field(default=0.0, ge=0.0, lt=1.0)
    dropout_fraction: float = Field(default=0.0, ge=0.0, lt=1.0)
    statistical_security: int = Field(default=40, ge=1, le=256)
    correctness: int = Field(default=20, ge=1, le=128)
    min_survivors: int | None = Field(default=None, ge=2)
    client_ids: tuple[int, ...] | None = None
    noise: DistributedNoise | None = None

    @field_validator("client_ids")
    @classmethod
    def _sorted_ids(cls, v: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if v is None:
            return None
        if len(set(v)) != len(v):
            raise ValueError("client_ids: ids must be distinct")
        if any(not _INT64[0] <= u <= _INT64[1] for u in v):
            raise ValueError("client_ids: ids must fit in a signed 64-bit integer")
        return tuple(sorted(v))

    @model_validator(mode="after")
    def _check(self) -> SecAggConfig:
        n = self.n_clients
        if n * self.quantisation_levels >= 2**self.modulus_bits:
            raise ValueError(
                "overflow bound violated: n_clients * quantisation_levels must be < "
                "2**modulus_bits"
            )
        if self.noise is not None:
            if max(self.noise.coordinates) >= self.vector_length:
                raise ValueError("noise.coordinates: an index is outside the vector")
            wrap = wrap_probability(n, self.quantisation_levels, self.noise.sigma,
                                    len(self.noise.coordinates), self.modulus_bits)
            if wrap > 2.0 ** -self.statistical_security:
                raise ValueError(
                    "modulus_bits: the noisy sum may wrap around the ring with probability "
                    f"above 2^-{self.statistical_security} (rule: 2 d exp(-(2^(k-1) - "
                    "ceil(n Q / 2))^2 / (2 n sigma^2)) <= 2^-statistical_security); use "
                    "clma.privacy.distributed.ring_bits()")
        if self.neighbour_degree is not None and self.neighbour_degree < n - 1:
            k = self.neighbour_degree
            if k < 2 or k % 2:
                raise ValueError("neighbour_degree must be an even integer >= 2 "
                                 "(or >= n_clients - 1 for the complete graph)")
        holders = self.holders_per_client
        if self.threshold > holders:
            raise ValueError("threshold must not exceed the number of share holders per client")
        if 2 * self.threshold <= holders:
            raise ValueError(
                "threshold must be a strict majority of the share holders per client"
            )
        if self.client_ids is not None and len(self.client_ids) != n:
            raise ValueError("client_ids: must name exactly n_clients clients")
        b = _Bounds(n, holders - 1, _count(self.corrupted_fraction, n),
                    _count(self.dropout_fraction, n))
        where = (f"n_clients={n}, neighbour_degree={holders - 1}, threshold={self.threshold}, "
                 f"corrupted_fraction={self.corrupted_fraction}, "
                 f"dropout_fraction={self.dropout_fraction}")
        sec = b.security(self.threshold)
        if sec > Fraction(1, 2**self.statistical_security):
            raise ValueError(
                f"threshold/neighbour_degree: outside the safe region ({where}): security "
                f"failure bound {float(sec):.3g} > 2^-{self.statistical_security} (rule: "
                "n*P[Hyp(n-1,c,k) >= t] + C(n,2)*C(c+d,k)/C(n,k) <= 2^-statistical_security); "
                "use secagg_plus_parameters()")
        cor = b.correctness(self.threshold)
        if cor > Fraction(1, 2**self.correctness):
            raise ValueError(
                f"threshold/neighbour_degree: outside the safe region ({where}): correctness "
                f"failure bound {float(cor):.3g} > 2^-{self.correctness} (rule: every client "
                "needing reconstruction keeps >= t responding holders and the survivors stay "
                "connected, with probability >= 1 - 2^-correctness); use secagg_plus_parameters()")
        floor = self.survivor_floor
        if floor > n - _count(self.dropout_fraction, n):
            raise ValueError(
                f"min_survivors: {floor} survivors cannot be guaranteed when "
                f"ceil(dropout_fraction*n) = {_count(self.dropout_fraction, n)} of {n} clients "
                "drop out (rule: max(threshold, min_survivors) <= n - ceil(dropout_fraction*n))")
        return self

    @classmethod
    def from_assumptions(
        cls, n_clients: int, vector_length: int, *, corrupted_fraction: float,
        dropout_fraction: float, statistical_security: int = 40, correctness: int = 20,
        **kwargs: Any,
    ) -> SecAggConfig:
        """Config with ``(neighbour_degree, threshold)`` from :func:`secagg_plus_parameters`.

        ``kwargs``: the other fields (``round_id``, ``graph_seed``, ``client_ids``,
        ``min_survivors``, ``quantisation_levels``, ...).
        """
        k, t = secagg_plus_parameters(
            n_clients, corrupted_fraction=corrupted_fraction, dropout_fraction=dropout_fraction,
            statistical_security=statistical_security, correctness=correctness)
        return cls(n_clients=n_clients, vector_length=vector_length, threshold=t,
                   neighbour_degree=None if k >= n_clients - 1 else k,
                   corrupted_fraction=corrupted_fraction, dropout_fraction=dropout_fraction,
                   statistical_security=statistical_security, correctness=correctness,
                   **kwargs)

    @property
    def complete_graph(self) -> bool:
        return self.neighbour_degree is None or self.neighbour_degree >= self.n_clients - 1

    @property
    def holders_per_client(self) -> int:
        """Share holders of one client: its neighbours and itself."""
        if self.complete_graph:
            return self.n_clients
        return int(self.neighbour_degree) + 1  # type: ignore[arg-type]

    @property
    def survivor_floor(self) -> int:
        """Fewest survivors a client agrees to unmask: ``max(threshold, min_survivors)``."""
        return max(self.threshold, self.min_survivors or 0)

    @property
    def modulus_mask(self) -> int:
        return (1 << self.modulus_bits) - 1


def _ring_permutation(n: int, seed: int) -> np.ndarray:
    """``perm[i]`` = (index in the id list of) the client at ring position i."""
    return np.random.default_rng(seed).permutation(n)


def _ring(ids: Sequence[int], seed: int) -> list[int]:
    """Ring order of the clients: a seeded permutation of ``ids`` (in the order given)."""
    ids = list(ids)
    return [ids[i] for i in _ring_permutation(len(ids), seed)]


def _ring_offsets(degree: int, with_self: bool = False) -> np.ndarray:
    half = degree // 2
    return np.arange(-half, half + 1) if with_self else np.concatenate(
        [np.arange(-half, 0), np.arange(1, half + 1)])


def _neighbour_matrix(n: int, degree: int, seed: int, with_self: bool = False) -> np.ndarray:
    """(n, degree [+ 1]) int64: row j = the list indices of client j's neighbours [and j]."""
    perm = _ring_permutation(n, seed)
    pos = np.empty(n, dtype=np.int64)
    pos[perm] = np.arange(n)
    return perm[(pos[:, None] + _ring_offsets(degree, with_self)[None, :]) % n]


def harary_neighbours(ids: Sequence[int], degree: int | None, seed: int) -> dict[int, tuple[int, ...]]:
    """Neighbour sets of a Harary graph H(degree, n) on a seeded permutation.

    ``degree=None`` or ``>= n - 1`` gives the complete graph.  Each client is
    linked to the ``degree / 2`` clients on either side of it on a randomly
    permuted ring (Bell et al. 2020 use a random k-regular graph; the Harary
    construction is the standard way to get one with minimum degree).
    """
    ids = list(ids)
    n = len(ids)
    if degree is None or degree >= n - 1:
        return {u: tuple(v for v in ids if v != u) for u in ids}
    arr = np.asarray(ids, dtype=np.int64)
    nb = arr[_neighbour_matrix(n, degree, seed)]
    nb.sort(axis=1)
    return dict(zip(ids, map(tuple, nb.tolist()), strict=True))


def _connected_on_ring(positions: np.ndarray, n: int, degree: int) -> bool:
    """Whether the clients at these ring positions induce a connected subgraph of
    H(degree, n): two of them are adjacent iff at most ``degree / 2`` ring steps apart,
    so the induced graph is connected iff at most one cyclic gap between consecutive
    members exceeds ``degree / 2`` steps."""
    if positions.size <= 1:
        return True
    pos = np.sort(positions)
    gaps = np.diff(pos, append=pos[0] + n)
    return int(np.count_nonzero(gaps > degree // 2)) <= 1


def _ring_connected(ring: Sequence[int], members: frozenset[int], degree: int) -> bool:
    """Whether ``members`` induce a connected subgraph of H(degree, n) on ``ring``."""
    pos = np.flatnonzero(np.fromiter((u in members for u in ring), dtype=bool, count=len(ring)))
    return _connected_on_ring(pos, len(ring), degree)


class FixedPointQuantiser:
    """Clip-and-quantise to ``[0, Q]`` per coordinate; de-quantise sums.

    Args:
        lower, upper: per-coordinate bounds, float ``(d,)``; a coordinate with
            ``lower == upper`` (padding) always quantises to 0.
        levels: Q.
    """

    def __init__(self, lower: Any, upper: Any, levels: int = 2**16 - 1) -> None:
        lo = np.asarray(lower, dtype=np.float64)
        hi = np.asarray(upper, dtype=np.float64)
        if lo.ndim != 1 or lo.shape != hi.shape:
            raise ValueError("lower and upper must be 1-D arrays of the same shape")
        if not (np.all(np.isfinite(lo)) and np.all(np.isfinite(hi))) or np.any(hi < lo):
            raise ValueError("bounds must be finite with upper >= lower")
        if levels < 1:
            raise ValueError("levels must be >= 1")
        self.lower, self.upper, self.levels = lo, hi, int(levels)
        self._range = hi - lo
        self._inv = np.divide(levels, self._range, out=np.zeros_like(lo), where=self._range > 0)

    @property
    def dim(self) -> int:
        return int(self.lower.size)

    def quantise(self, x: Any) -> np.ndarray:
        """uint64 ``(d,)`` in ``[0, Q]`` (clips first: NaN rejected)."""
        v = np.asarray(x, dtype=np.float64)
        if v.shape != self.lower.shape:
            raise ValueError("input vector has the wrong length for the quantiser")
        if np.isnan(v).any():
            raise ValueError("input vector must not contain NaN")
        v = np.clip(v, self.lower, self.upper)
        return np.rint((v - self.lower) * self._inv).astype(np.uint64)

    def dequantise_sum(self, q_sum: Any, n: int) -> np.ndarray:
        """Float64 ``(d,)`` estimate of the sum of n clipped vectors."""
        s = np.asarray(q_sum, dtype=np.float64)
        return n * self.lower + s * self._range / self.levels

    def l1_sensitivity_quantised(self) -> np.ndarray:
        """Per-coordinate replace-one sensitivity in quantisation units (Q, or 0 for padding)."""
        return np.where(self._range > 0, float(self.levels), 0.0)


# --------------------------------------------------------------------------
# Shamir secret sharing over GF(2^130 - 5) (the textbook scheme)
# --------------------------------------------------------------------------


def shamir_split(secret: int, threshold: int, xs: Sequence[int]) -> list[int]:
    """Shares ``f(x)`` for x in ``xs`` of a uniformly random polynomial f over
    GF(SHAMIR_PRIME) of degree ``threshold - 1`` with ``f(0) = secret``.

    Any ``threshold`` shares determine the secret; fewer are independent of it.
    """
    p = SHAMIR_PRIME
    if not 0 <= secret < p:
        raise ValueError("secret: must be an integer in [0, SHAMIR_PRIME)")
    if threshold < 1 or len(xs) < threshold:
        raise ValueError("threshold: need 1 <= threshold <= number of shares")
    if len(set(xs)) != len(xs) or any(not 0 < x < p for x in xs):
        raise ValueError("xs: share points must be distinct and nonzero")
    return _split_many([secret], threshold, xs)[0]


def _random_field_elements(count: int) -> list[int]:
    """``count`` independent uniform elements of GF(SHAMIR_PRIME) from ``os.urandom``
    (130-bit draws, rejection of the 5 values >= p)."""
    out: list[int] = []
    while len(out) < count:
        need = count - len(out)
        raw = os.urandom(_SHARE_BYTES * need)
        for i in range(need):
            v = int.from_bytes(raw[i * _SHARE_BYTES:(i + 1) * _SHARE_BYTES], "little") & _MASK130
            if v < SHAMIR_PRIME:
                out.append(v)
    return out


def _split_many(secret_values: Sequence[int], threshold: int, xs: Sequence[int]) -> list[list[int]]:
    """Shamir shares at ``xs`` of several secrets (one random polynomial each): the
    powers ``x^j mod p`` are computed once and shared by the polynomials."""
    p = SHAMIR_PRIME
    coeffs = _random_field_elements(len(secret_values) * (threshold - 1))
    powers = []
    for x in xs:
        row, acc = [], 1
        for _ in range(threshold - 1):
            acc = acc * x % p
            row.append(acc)
        powers.append(row)
    out = []
    for i, secret in enumerate(secret_values):
        c = coeffs[i * (threshold - 1):(i + 1) * (threshold - 1)]
        out.append([(secret + sum(map(operator.mul, c, row))) % p for row in powers])
    return out


@lru_cache(maxsize=8192)
def _lagrange_at_zero(xs: tuple[int, ...]) -> tuple[int, ...]:
    """Lagrange coefficients l_i with ``f(0) = sum_i l_i f(x_i)`` for deg f < len(xs):
    ``l_i = prod_{j != i} x_j / (x_j - x_i)``, with one modular inversion for all i
    (Montgomery's batch trick)."""
    p = SHAMIR_PRIME
    nums, dens = [], []
    for i, xi in enumerate(xs):
        num = den = 1
        for j, xj in enumerate(xs):
            if j != i:
                num = num * xj % p
                den = den * (xj - xi) % p
        nums.append(num)
        dens.append(den)
    prefix, acc = [], 1
    for v in dens:
        prefix.append(acc)
        acc = acc * v % p
    inv = pow(acc, -1, p)
    out = [0] * len(xs)
    for i in range(len(xs) - 1, -1, -1):
        out[i] = nums[i] * (inv * prefix[i] % p) % p
        inv = inv * dens[i] % p
    return tuple(out)


def shamir_reconstruct(points: Sequence[tuple[int, int]]) -> int:
    """``f(0)`` from exactly ``threshold`` shares ``(x, f(x))`` (Lagrange interpolation)."""
    xs = tuple(int(x) for x, _ in points)
    if len(set(xs)) != len(xs) or any(not 0 < x < SHAMIR_PRIME for x in xs):
        raise ValueError("points: share points must be distinct and nonzero")
    lam = _lagrange_at_zero(xs)
    return sum(la * int(y) for la, (_, y) in zip(lam, points, strict=True)) % SHAMIR_PRIME


def _solve_mod_p(rows: list[list[int]], n_unknowns: int) -> list[int] | None:
    """One solution of a linear system over GF(p) (augmented rows), free unknowns 0."""
    p = SHAMIR_PRIME
    a = [r[:] for r in rows]
    pivots: list[int] = []
    r = 0
    for col in range(n_unknowns):
        piv = next((i for i in range(r, len(a)) if a[i][col] % p), None)
        if piv is None:
            continue
        a[r], a[piv] = a[piv], a[r]
        inv = pow(a[r][col], -1, p)
        a[r] = [v * inv % p for v in a[r]]
        for i in range(len(a)):
            if i != r and a[i][col]:
                f = a[i][col]
                a[i] = [(v - f * w) % p for v, w in zip(a[i], a[r], strict=True)]
        pivots.append(col)
        r += 1
    if any(row[-1] % p for row in a[r:]):
        return None
    sol = [0] * n_unknowns
    for i, col in enumerate(pivots):
        sol[col] = a[i][-1]
    return sol


def _poly_eval(coeffs: Sequence[int], x: int) -> int:
    acc = 0
    for c in reversed(coeffs):  # coeffs lowest degree first
        acc = (acc * x + c) % SHAMIR_PRIME
    return acc


def _poly_through(points: Sequence[tuple[int, int]]) -> list[int]:
    """Coefficients (lowest degree first) of the polynomial of degree < len(points)
    through the points (distinct nonzero x)."""
    p = SHAMIR_PRIME
    rows = [[pow(x, i, p) for i in range(len(points))] + [y % p] for x, y in points]
    sol = _solve_mod_p(rows, len(points))
    assert sol is not None  # a Vandermonde system with distinct points is regular
    return sol


def _berlekamp_welch(points: Sequence[tuple[int, int]], threshold: int) -> list[int] | None:
    """The polynomial (lowest degree first) of degree < ``threshold`` through all but at
    most ``(m - threshold) // 2`` of the m points (Reed-Solomon decoding), or None."""
    p = SHAMIR_PRIME
    m = len(points)
    e = (m - threshold) // 2
    if e < 1:
        return None
    nq = threshold + e
    rows = []
    for x, y in points:
        powers = [pow(x, i, p) for i in range(nq)]
        rows.append(powers + [(-y * powers[i]) % p for i in range(e)] + [y * pow(x, e, p) % p])
    sol = _solve_mod_p(rows, nq + e)
    if sol is None:
        return None
    q, err = sol[:nq], sol[nq:] + [1]  # E monic of degree e
    quotient = [0] * (nq - e)
    rem = q[:]
    for i in range(nq - 1, e - 1, -1):  # long division by the monic E
        coef = rem[i]
        quotient[i - e] = coef
        if coef:
            for j in range(e + 1):
                rem[i - e + j] = (rem[i - e + j] - coef * err[j]) % p
    if any(rem[:e]) or any(quotient[threshold:]):
        return None
    poly = quotient[:threshold]
    agree = sum(1 for x, y in points if _poly_eval(poly, x) == y % p)
    return poly if agree >= m - e else None


def _to_share(v: int) -> bytes:
    return v.to_bytes(_SHARE_BYTES, "little")


def _from_share(b: Any) -> int | None:
    if not isinstance(b, (bytes, bytearray)) or len(b) != _SHARE_BYTES:
        return None
    v = int.from_bytes(b, "little")
    return v if v < SHAMIR_PRIME else None


# --------------------------------------------------------------------------
# primitives (thin wrappers; all cryptography from the libraries)
# --------------------------------------------------------------------------


def _raw(pk: X25519PublicKey) -> bytes:
    return pk.public_bytes(Encoding.Raw, PublicFormat.Raw)


def _hkdf(secret: bytes, info: bytes, length: int = 32) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=None, info=info).derive(secret)


_GCM_NONCE = b"\x00" * 12


@lru_cache(maxsize=16)
def _zeros(nbytes: int) -> bytes:
    return bytes(nbytes)


def prg_words(seed: bytes, d: int, modulus_mask: int) -> np.ndarray:
    """Expand a 16/32-byte seed into d uniform words mod 2^k (AES-CTR keystream).

    The keystream is AES-CTR under ``seed`` from the initial counter block
    ``0^96 || 0x00000002``, ``8 d`` bytes read as d little-endian uint64 words and
    reduced mod 2^k (a power of two, so uniform words stay uniform).  It is computed
    in one call as ``AESGCM(seed).encrypt(0^96, 0^(8d))`` minus its tag -- GCM encrypts
    with exactly that CTR keystream (NIST SP 800-38D; tested) -- which costs half of
    the generic ``Cipher`` route.  Every seed is a fresh key (the round id is bound
    into each derivation), so the fixed counter block never repeats a keystream for
    two different masks.
    """
    stream = AESGCM(seed).encrypt(_GCM_NONCE, _zeros(8 * d), None)
    return np.frombuffer(stream, dtype="<u8", count=d) & np.uint64(modulus_mask)


def _pair_info(kind: str, round_id: str, u: int, v: int) -> bytes:
    a, b = (u, v) if u < v else (v, u)
    return f"clma-secagg|{kind}|{round_id}|{a}|{b}".encode()


def self_mask_commitment(round_id: str, client_id: int, b: bytes) -> bytes:
    """``SHA-256("clma-secagg|b-commitment|" round_id "|" u "|" b_u)`` (32 bytes)."""
    h = hashes.Hash(hashes.SHA256())
    h.update(f"clma-secagg|b-commitment|{round_id}|{client_id}|".encode() + b)
    return h.finalize()


_LOW_ORDER_ANY = _LOW_ORDER_POINTS | {p[:31] + bytes([p[31] | 0x80]) for p in _LOW_ORDER_POINTS}


def _low_order(pk: bytes) -> bool:
    return pk in _LOW_ORDER_ANY


# --------------------------------------------------------------------------
# messages
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AdvertiseKeys:
    """Round 0: public keys of one client (32-byte raw X25519)."""

    client_id: int
    c_pk: bytes
    s_pk: bytes


@dataclass(frozen=True, slots=True)
class EncryptedShare:
    """Round 1: one AES-GCM ciphertext from ``sender`` to ``recipient``."""

    sender: int
    recipient: int
    ciphertext: bytes


@dataclass(frozen=True, slots=True)
class ShareKeys:
    """Round 1: all encrypted shares of one client and its commitment to ``b_u``.

    ``b_commitment``: :func:`self_mask_commitment` of the client's self-mask seed (32 bytes);
    ``b""`` (a message from a codec that does not carry it yet) leaves the
    reconstruction of that client's ``b_u`` unverified.
    """

    client_id: int
    shares: tuple[EncryptedShare, ...]
    b_commitment: bytes = b""


@dataclass(frozen=True, slots=True)
class MaskedInput:
    """Round 2: masked vector, ``(d,)`` integers in ``[0, 2^k)`` (uint64 from honest clients;
    the server accepts any integer array-like and range-checks it)."""

    client_id: int
    masked: Any


@dataclass(frozen=True, slots=True)
class UnmaskingRequest:
    """Round 3 (server -> clients): survivors S and dropped D."""

    survivors: frozenset[int]
    dropped: frozenset[int]


@dataclass(frozen=True, slots=True)
class UnmaskingResponse:
    """Round 3 (client -> server): shares of b_u (u in S) and s_sk_u (u in D).

    ``self_mask_shares[u] = (index, 17 bytes)``;
    ``key_shares[u] = (index, 17 bytes, 17 bytes)`` (the two 16-byte key halves);
    shares are little-endian elements of GF(2^130 - 5).
    """

    client_id: int
    self_mask_shares: dict[int, tuple[int, bytes]]
    key_shares: dict[int, tuple[int, bytes, bytes]]


@dataclass
class SecAggResult:
    """Output of a round.

    Attributes:
        sum_quantised: uint64 ``(d,)``, exact sum over survivors of quantised inputs.
        contributors: number of survivors whose input is in the sum.
        survivors, dropped: client ids (dropped: shared keys, but no valid masked input).
        client_seconds, server_seconds: wall time spent in client and server code
            (filled by :func:`run_secure_aggregation`), per phase.  Server phase
            ``unmasking`` splits into ``unmasking.self_masks`` (reconstructing
            survivors' self masks) and ``unmasking.dropout_recovery``
            (reconstructing dropped clients' keys and removing their pairwise masks).
        rejected: client id -> reason, for every client whose message the server
            refused (``"<step>: <rule>"``).  Refused before or at its masked input, the
            client is a dropout (absent, or in ``dropped``); refused at unmasking (a
            malformed response, or shares inconsistent with the verified secret), its
            response is ignored -- its own input is in the sum like that of any
            survivor that goes silent before unmasking.
    """

    sum_quantised: np.ndarray
    contributors: int
    survivors: tuple[int, ...]
    dropped: tuple[int, ...]
    client_seconds: dict[str, float] = field(default_factory=dict)
    server_seconds: dict[str, float] = field(default_factory=dict)
    rejected: dict[int, str] = field(default_factory=dict)


# --------------------------------------------------------------------------
# client
# --------------------------------------------------------------------------


class SecAggClient:
    """One client's side of the protocol (holds its secrets; never sends them in clear)."""

    def __init__(self, client_id: int, config: SecAggConfig) -> None:
        self.id = int(client_id)
        self.config = config
        self._c_sk = X25519PrivateKey.generate()
        self._s_sk = X25519PrivateKey.generate()
        self._b = os.urandom(16)  # self-mask seed (AES-128 key for the PRG)
        self._neighbours: tuple[int, ...] = ()
        self._roster: dict[int, AdvertiseKeys] = {}
        self._enc_keys: dict[int, AESGCM] = {}  # cached share-encryption key agreements
        # owner -> (share index, b share, s share half a, s share half b), 17 bytes each
        self._held: dict[int, tuple[int, bytes, bytes, bytes]] = {}
        self._sent_input = False
        self._answered = False
        self._graph: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    # the graph fixed by the config
    def _ring(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(sorted client ids, ring permutation, ring position of each id index)."""
        if self._graph is None:
            cfg = self.config
            if cfg.client_ids is None:
                raise SecAggAbort("the config names no client_ids: this client cannot derive "
                                  "the neighbour graph to check the server's requests")
            ids = np.asarray(cfg.client_ids, dtype=np.int64)
            perm = _ring_permutation(len(ids), cfg.graph_seed)
            pos = np.empty(len(ids), dtype=np.int64)
            pos[perm] = np.arange(len(ids))
            self._graph = ids, perm, pos
        return self._graph

    def _dense(self, members: Sequence[int] | frozenset[int]) -> np.ndarray:
        """Indices of client ids in the sorted id list (SecAggAbort if one is unknown)."""
        ids = self._ring()[0]
        arr = np.fromiter(members, dtype=np.int64, count=len(members))
        j = np.searchsorted(ids, arr)
        if np.any(j >= len(ids)) or np.any(ids[np.minimum(j, len(ids) - 1)] != arr):
            raise SecAggAbort("a client outside the config's client_ids")
        return j

    def _holder_matrix(self, owners: Sequence[int]) -> np.ndarray:
        """(len(owners), k + 1) sorted ids of each owner's holders (SecAgg+ graph)."""
        ids, perm, pos = self._ring()
        offs = _ring_offsets(int(self.config.neighbour_degree), with_self=True)  # type: ignore[arg-type]
        rows = ids[perm[(pos[self._dense(owners)][:, None] + offs[None, :]) % len(ids)]]
        rows.sort(axis=1)
        return rows

    def _graph_neighbours(self, u: int) -> tuple[int, ...] | None:
        """Neighbours of ``u`` in the graph the config fixes (None: the config names no ids)."""
        cfg = self.config
        if cfg.client_ids is None:
            return None
        if cfg.complete_graph:
            if u not in cfg.client_ids:
                raise SecAggAbort("a client outside the config's client_ids")
            return tuple(v for v in cfg.client_ids if v != u)
        row = self._holder_matrix([u])[0].tolist()
        row.remove(u)
        return tuple(row)

    # Round 0
    def advertise(self) -> AdvertiseKeys:
        return AdvertiseKeys(self.id, _raw(self._c_sk.public_key()), _raw(self._s_sk.public_key()))

    def _aead(self, other: int) -> AESGCM:
        key = self._enc_keys.get(other)
        if key is None:
            peer = X25519PublicKey.from_public_bytes(self._roster[other].c_pk)
            secret = self._c_sk.exchange(peer)
            key = AESGCM(_hkdf(secret, _pair_info("share-enc", self.config.round_id, self.id, other)))
            self._enc_keys[other] = key
        return key

    # Round 1
    def share_keys(self, roster: Mapping[int, AdvertiseKeys], neighbours: Sequence[int]) -> ShareKeys:
        """Shamir-share ``b_u`` and ``s_sk_u`` among neighbours + self; encrypt each share.

        ``neighbours``: the server's list, checked against the graph the config fixes
        (when the config names ``client_ids``); ``roster``: the advertised keys of
        those neighbours that advertised.
        """
        self._neighbours = tuple(sorted(int(v) for v in neighbours))
        self._roster = {int(k): v for k, v in roster.items()}
        if self.id in self._neighbours:
            raise ValueError("a client cannot be its own neighbour")
        expected = self._graph_neighbours(self.id)
        if expected is not None and self._neighbours != expected:
            raise SecAggAbort("the server's neighbour list differs from the graph fixed by "
                              "the config (client_ids, graph_seed)")
        if not set(self._roster) <= set(self._neighbours):
            raise SecAggAbort("the roster names a client that is not a neighbour")
        keys = [m.c_pk for m in self._roster.values()] + [m.s_pk for m in self._roster.values()]
        if len(set(keys)) != len(keys):
            raise SecAggAbort("duplicate public keys in the roster")
        t = self.config.threshold
        recipients = [v for v in self._neighbours if v in self._roster]
        if len(recipients) + 1 < t:
            raise SecAggAbort("fewer share holders than the threshold")
        rank = {h: i + 1 for i, h in enumerate(sorted((*self._neighbours, self.id)))}
        s_raw = self._s_sk.private_bytes_raw()
        holders = [*recipients, self.id]
        xs = [rank[h] for h in holders]
        b_sh, sa_sh, sb_sh = _split_many(
            [int.from_bytes(self._b, "little"), int.from_bytes(s_raw[:16], "little"),
             int.from_bytes(s_raw[16:], "little")], t, xs)
        nonce = struct.pack("<q", self.id) + b"\x00" * 4
        out = []
        for holder, x, b, sa, sb in zip(holders, xs, b_sh, sa_sh, sb_sh, strict=True):
            shares = (_to_share(b), _to_share(sa), _to_share(sb))
            if holder == self.id:
                self._held[self.id] = (x, *shares)
                continue
            payload = _HEADER.pack(self.id, holder, x) + b"".join(shares)
            ad = struct.pack("<qq", self.id, holder)
            out.append(EncryptedShare(self.id, holder, self._aead(holder).encrypt(nonce, payload, ad)))
        return ShareKeys(self.id, tuple(out), self_mask_commitment(self.config.round_id, self.id, self._b))

    def receive_shares(self, shares: Sequence[EncryptedShare]) -> None:
        """Decrypt and keep the shares routed to this client (AES-GCM verifies them).

        A share is kept under this client's own share index for its owner (its rank among
        the owner's holders, known from the graph) and a value outside the field is kept
        as 0: a dealer's wrong header or value then makes one bad share, which the
        server's decoding works around, not a malformed response from this client.
        """
        cfg = self.config
        shares = list(shares)
        for sh in shares:
            if sh.recipient != self.id or sh.sender not in self._neighbours:
                raise SecAggAbort("share routed to the wrong client or from a non-neighbour")
        if cfg.complete_graph:  # the owner's holders are everyone, as are this client's
            my_rank = sorted((*self._neighbours, self.id)).index(self.id) + 1
            ranks = [my_rank] * len(shares)
        elif cfg.client_ids is not None and shares:
            rows = self._holder_matrix([sh.sender for sh in shares])
            ranks = (np.count_nonzero(rows < self.id, axis=1) + 1).tolist()
        else:
            ranks = [None] * len(shares)
        for sh, rank in zip(shares, ranks, strict=True):
            nonce = struct.pack("<q", sh.sender) + b"\x00" * 4
            ad = struct.pack("<qq", sh.sender, self.id)
            pt = self._aead(sh.sender).decrypt(nonce, sh.ciphertext, ad)
            if len(pt) != _PAYLOAD_BYTES:
                raise SecAggAbort("share payload has the wrong length")
            owner, recipient, idx = _HEADER.unpack(pt[:_HEADER.size])
            if owner != sh.sender or recipient != self.id:
                raise SecAggAbort("share header does not match its envelope")
            body = pt[_HEADER.size:]
            parts = tuple(body[i * _SHARE_BYTES:(i + 1) * _SHARE_BYTES] for i in range(3))
            parts = tuple(p if _from_share(p) is not None else _to_share(0) for p in parts)
            self._held[owner] = (idx if rank is None else rank, *parts)

    def _pair_seed(self, other: int) -> bytes:
        peer = X25519PublicKey.from_public_bytes(self._roster[other].s_pk)
        return _hkdf(self._s_sk.exchange(peer), _pair_info("pairwise", self.config.round_id, self.id, other))

    # Round 2
    def masked_input(self, quantised: np.ndarray) -> MaskedInput:
        """``y = q + PRG(b) + sum_{v>u} p_uv - sum_{v<u} p_uv mod 2^k``.

        Pairwise masks only with neighbours that completed ShareKeys (U1).
        """
        q = np.asarray(quantised)
        cfg = self.config
        if q.shape != (cfg.vector_length,) or q.dtype != np.uint64:
            raise ValueError("quantised input must be uint64 of shape (vector_length,)")
        if cfg.noise is None and np.any(q > np.uint64(cfg.quantisation_levels)):
            raise ValueError("quantised input exceeds quantisation_levels")
        if cfg.noise is not None and np.any(q > np.uint64(cfg.modulus_mask)):
            raise ValueError("noisy input must be a ring element (< 2**modulus_bits)")
        mask = np.uint64(cfg.modulus_mask)
        y = q + prg_words(self._b, cfg.vector_length, cfg.modulus_mask)
        for v in self._neighbours:
            if v not in self._held:  # v dropped before sharing keys
                continue
            p = prg_words(self._pair_seed(v), cfg.vector_length, cfg.modulus_mask)
            y = y + p if self.id < v else y - p
        self._sent_input = True
        return MaskedInput(self.id, y & mask)

    # Round 3
    def unmask(self, request: UnmaskingRequest) -> UnmaskingResponse:
        """Reveal b-shares of survivors and key shares of dropped clients, never both.

        Answers at most one request per round (a second one, even identical, is
        refused), and only a request under which the server learns one sum over
        at least :attr:`SecAggConfig.survivor_floor` clients: ``S ∩ D = ∅``, this
        client in S, at least t of its holders in S and, on a SecAgg+ graph, the
        survivors connected in the graph fixed by the config.
        """
        if self._answered:
            raise SecAggAbort("this client already received an unmasking request this round: "
                              "it answers at most once per round")
        self._answered = True
        s, d = frozenset(request.survivors), frozenset(request.dropped)
        cfg = self.config
        if s & d:
            raise SecAggAbort("a client is listed both as survivor and as dropped")
        if self.id not in s:
            raise SecAggAbort("only survivors take part in unmasking")
        if cfg.client_ids is not None and not (s | d) <= set(cfg.client_ids):
            raise SecAggAbort("the request names clients outside this round")
        if len(s) < cfg.survivor_floor:
            raise SecAggAbort(
                f"only {len(s)} survivors: this client refuses to unmask a sum over fewer than "
                f"{cfg.survivor_floor} clients")
        holders = set(self._neighbours) | {self.id}
        if len(holders & s) < cfg.threshold:
            raise SecAggAbort("fewer survivors among this client's holders than the threshold")
        if not cfg.complete_graph:
            ids, _, pos = self._ring()
            if not _connected_on_ring(pos[self._dense(s)], len(ids), int(cfg.neighbour_degree)):  # type: ignore[arg-type]
                raise SecAggAbort("the survivors are disconnected in the neighbour graph: the "
                                  "server could unmask the sum of each component separately")
        b_out: dict[int, tuple[int, bytes]] = {}
        k_out: dict[int, tuple[int, bytes, bytes]] = {}
        for owner, (idx, b_sh, sa, sb) in self._held.items():
            if owner in s:
                b_out[owner] = (idx, b_sh)
            elif owner in d:
                k_out[owner] = (idx, sa, sb)
        return UnmaskingResponse(self.id, b_out, k_out)


# --------------------------------------------------------------------------
# server
# --------------------------------------------------------------------------


def _as_words(x: Any, d: int, bits: int) -> tuple[np.ndarray | None, str]:
    """Validate a masked vector: integer dtype, shape (d,), every word in [0, 2^bits)."""
    try:
        arr = x if isinstance(x, np.ndarray) else np.asarray(x)
    except (ValueError, TypeError, OverflowError):
        return None, "masked_input: not an integer vector"
    if arr.dtype == object:
        flat = arr.ravel().tolist()
        if not all(type(w) is int for w in flat):
            return None, "masked_input: words must be integers"
        if arr.shape != (d,):
            return None, f"masked_input: wrong length (expected {d} words)"
        if any(not 0 <= w < 1 << bits for w in flat):
            return None, f"masked_input: word outside [0, 2^{bits})"
        return np.asarray(flat, dtype=np.uint64), ""
    if arr.dtype.kind not in "iu":
        return None, f"masked_input: words must be integers (dtype {arr.dtype})"
    if arr.shape != (d,):
        return None, f"masked_input: wrong length (expected {d} words)"
    if arr.dtype.kind == "i" and d and int(arr.min()) < 0:
        return None, f"masked_input: word outside [0, 2^{bits})"
    if d and int(arr.max()) >= 1 << bits:
        return None, f"masked_input: word outside [0, 2^{bits})"
    return arr.astype(np.uint64), ""


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


class SecAggServer:
    """Server side: routes messages, never holds a client secret, outputs only the sum.

    Every message is validated; a client whose message breaks a rule is recorded in
    :attr:`rejected` and treated as a dropout from that step on (a malformed
    unmasking response is ignored).  Only too few clients left, or a secret with no
    consistent set of t shares, abort the round (:class:`SecAggAbort`).

    Unmasking is batched: all shares are range- and index-checked at once (numpy),
    grouped by owner, and each secret is interpolated from its t lowest share indices
    with Lagrange coefficients cached per index set (one set serves every owner whose
    first t holders answered); masks are expanded with one AES-CTR call per seed and
    summed as one array.
    """

    def __init__(self, config: SecAggConfig, client_ids: Sequence[int]) -> None:
        ids = [int(c) for c in client_ids]
        if len(ids) != config.n_clients or len(set(ids)) != len(ids):
            raise ValueError("client_ids must be n_clients distinct integers")
        if config.client_ids is not None and tuple(sorted(ids)) != config.client_ids:
            raise ValueError("client_ids: must equal the config's client_ids")
        self.config = config
        self.ids = tuple(sorted(ids))
        self._idset = frozenset(self.ids)
        self._dense = {u: i for i, u in enumerate(self.ids)}
        n = len(self.ids)
        self._H: np.ndarray | None = None  # (n, k+1) sorted dense holders of each owner
        if config.complete_graph:
            self.neighbours = {u: self.ids[:i] + self.ids[i + 1:] for i, u in enumerate(self.ids)}
        else:
            k = int(config.neighbour_degree)  # type: ignore[arg-type]
            holders = _neighbour_matrix(n, k, config.graph_seed, with_self=True)
            holders.sort(axis=1)  # dense order is id order
            self._H = holders
            others = holders[holders != np.arange(n)[:, None]].reshape(n, k)
            ids_arr = np.asarray(self.ids, dtype=np.int64)
            self.neighbours = dict(zip(self.ids, map(tuple, ids_arr[others].tolist()), strict=True))
        self._roster: dict[int, AdvertiseKeys] = {}
        self._u1: set[int] = set()
        self._commitments: dict[int, bytes] = {}
        self._masked: dict[int, np.ndarray] = {}
        self._request: UnmaskingRequest | None = None
        self._rejected: dict[int, str] = {}

    @property
    def rejected(self) -> dict[int, str]:
        """Client id -> reason for every message refused so far."""
        return dict(self._rejected)

    def _reject(self, u: Any, reason: str) -> None:
        if _is_int(u):
            self._rejected.setdefault(int(u), reason)

    def collect_advertisements(self, msgs: Sequence[AdvertiseKeys]) -> dict[int, dict[int, AdvertiseKeys]]:
        """Round 0: returns, per accepted client, the public keys of its neighbours."""
        seen: dict[int, AdvertiseKeys] = {}
        twice: set[int] = set()
        for m in msgs:
            u = getattr(m, "client_id", None)
            if not _is_int(u) or int(u) not in self._idset:
                self._reject(u, "advertise_keys: not a client of this round")
                continue
            u = int(u)
            if u in seen or u in twice:
                twice.add(u)
                seen.pop(u, None)
                self._reject(u, "advertise_keys: sent twice")
                continue
            c_pk, s_pk = getattr(m, "c_pk", None), getattr(m, "s_pk", None)
            if type(c_pk) is not bytes or type(s_pk) is not bytes or len(c_pk) != 32 \
                    or len(s_pk) != 32:
                self._reject(u, "advertise_keys: public keys must be 32 bytes")
                continue
            if c_pk in _LOW_ORDER_ANY or s_pk in _LOW_ORDER_ANY:
                self._reject(u, "advertise_keys: low-order public key")
                continue
            seen[u] = m
        owners: dict[bytes, list[int]] = {}
        for u, m in seen.items():
            owners.setdefault(m.c_pk, []).append(u)
            owners.setdefault(m.s_pk, []).append(u)
        for us in owners.values():
            if len(us) > 1:
                for u in us:
                    self._reject(u, "advertise_keys: public key used twice")
                    seen.pop(u, None)
        self._roster = seen
        if len(self._roster) < self.config.threshold:
            raise SecAggAbort("fewer clients advertised keys than the threshold")
        roster = self._roster
        return {u: {v: roster[v] for v in self.neighbours[u] if v in roster} for u in roster}

    def _share_keys_problem(self, u: int, m: Any) -> str:
        shares = getattr(m, "shares", None)
        if type(shares) not in (tuple, list):
            return "share_keys: shares must be a sequence"
        roster = self._roster
        expected = {v for v in self.neighbours[u] if v in roster}
        if len(shares) != len(expected) or (shares and set(map(type, shares)) != {EncryptedShare}):
            return "share_keys: no share for some advertised neighbour"
        if shares and {sh.sender for sh in shares} != {u}:
            return "share_keys: share from another sender"
        if {sh.recipient for sh in shares} != expected:
            return "share_keys: no share for some advertised neighbour"
        cts = [sh.ciphertext for sh in shares]
        if cts and (set(map(type, cts)) != {bytes} or set(map(len, cts)) != {_CIPHERTEXT_BYTES}):
            return f"share_keys: ciphertext must be {_CIPHERTEXT_BYTES} bytes"
        c = getattr(m, "b_commitment", b"")
        if type(c) is not bytes or len(c) not in (0, _COMMITMENT_BYTES):
            return f"share_keys: b_commitment must be {_COMMITMENT_BYTES} bytes"
        return ""

    def route_shares(self, msgs: Sequence[ShareKeys]) -> dict[int, list[EncryptedShare]]:
        """Round 1: routes ciphertexts; U1 = clients whose ShareKeys was valid."""
        accepted: dict[int, ShareKeys] = {}
        twice: set[int] = set()
        for m in msgs:
            u = getattr(m, "client_id", None)
            if not _is_int(u) or int(u) not in self._roster:
                self._reject(u, "share_keys: not an advertised client")
                continue
            u = int(u)
            if u in accepted or u in twice:
                twice.add(u)
                accepted.pop(u, None)
                self._reject(u, "share_keys: sent twice")
                continue
            reason = self._share_keys_problem(u, m)
            if reason:
                self._reject(u, reason)
                continue
            accepted[u] = m
        self._u1 = set(accepted)
        self._commitments = {u: m.b_commitment for u, m in accepted.items()}
        if len(self._u1) < self.config.threshold:
            raise SecAggAbort("fewer clients shared keys than the threshold")
        inbox: dict[int, list[EncryptedShare]] = {u: [] for u in self._u1}
        for m in accepted.values():
            for sh in m.shares:
                box = inbox.get(sh.recipient)
                if box is not None:
                    box.append(sh)
        return inbox

    def collect_masked_inputs(self, msgs: Sequence[MaskedInput]) -> UnmaskingRequest:
        """Round 2: keeps valid masked vectors; aborts below t (or the floor of) survivors."""
        cfg = self.config
        d, bits = cfg.vector_length, cfg.modulus_bits
        vectors: dict[int, np.ndarray] = {}
        twice: set[int] = set()
        for m in msgs:
            u = getattr(m, "client_id", None)
            if not _is_int(u) or int(u) not in self._u1:
                if _is_int(u) and int(u) in self._idset:
                    self._reject(u, "masked_input: did not share keys")
                continue
            u = int(u)
            if u in vectors or u in twice:
                twice.add(u)
                vectors.pop(u, None)
                self._reject(u, "masked_input: sent twice")
                continue
            y = getattr(m, "masked", None)
            if type(y) is np.ndarray and y.dtype == np.uint64 and y.shape == (d,):
                vectors[u] = y  # range-checked below, all at once
                continue
            y, reason = _as_words(y, d, bits)
            if y is None:
                self._reject(u, reason)
                continue
            vectors[u] = y
        if vectors:
            us = list(vectors)
            over = np.flatnonzero((np.stack(list(vectors.values())) >> np.uint64(bits)).any(axis=1))
            for i in over.tolist():
                self._reject(us[i], f"masked_input: word outside [0, 2^{bits})")
                del vectors[us[i]]
        self._masked = vectors
        survivors = frozenset(self._masked)
        if len(survivors) < cfg.threshold:
            raise SecAggAbort(
                f"only {len(survivors)} clients sent masked input; the threshold is "
                f"{cfg.threshold}: the round is aborted and no sum is released"
            )
        if len(survivors) < cfg.survivor_floor:
            raise SecAggAbort(
                f"only {len(survivors)} clients sent masked input; the survivor floor is "
                f"{cfg.survivor_floor}: the round is aborted and no sum is released")
        if not cfg.complete_graph:
            perm = _ring_permutation(len(self.ids), cfg.graph_seed)
            pos = np.empty(len(self.ids), dtype=np.int64)
            pos[perm] = np.arange(len(self.ids))
            dense = np.fromiter(map(self._dense.__getitem__, survivors), dtype=np.int64,
                                count=len(survivors))
            if not _connected_on_ring(pos[dense], len(self.ids), int(cfg.neighbour_degree)):  # type: ignore[arg-type]
                raise SecAggAbort("the survivors are disconnected in the neighbour graph: the "
                                  "round is aborted (the clients would refuse to unmask)")
        self._request = UnmaskingRequest(survivors, frozenset(self._u1 - survivors))
        return self._request

    # ---------------------------------------------------------------- unmasking
    def _gather(self, responses: Sequence[UnmaskingResponse]) -> tuple[_Shares, _Shares]:
        """All shares of valid responses, checked at once; others rejected."""
        req = self._request
        assert req is not None
        s, d = req.survivors, req.dropped
        hmax = self.config.holders_per_client
        by_client: dict[int, Any] = {}
        twice: set[int] = set()
        for r in responses:
            u = getattr(r, "client_id", None)
            if not _is_int(u) or int(u) not in s:
                if _is_int(u) and int(u) in self._idset:
                    self._reject(u, "unmasking: not a survivor")
                continue
            u = int(u)
            if u in by_client or u in twice:
                twice.add(u)
                by_client.pop(u, None)
                self._reject(u, "unmasking: answered twice")
                continue
            by_client[u] = r
        b, k = _Shares(1), _Shares(2)
        for u, r in by_client.items():
            bmap, kmap = getattr(r, "self_mask_shares", None), getattr(r, "key_shares", None)
            if not isinstance(bmap, Mapping) or not isinstance(kmap, Mapping):
                self._reject(u, "unmasking: shares must be mappings")
                continue
            if bmap.keys() & kmap.keys():
                self._reject(u, "unmasking: both kinds of share for one client")
                continue
            if not bmap.keys() <= s:
                self._reject(u, "unmasking: self-mask share of a client that is not a survivor")
                continue
            if not kmap.keys() <= d:
                self._reject(u, "unmasking: key share of a client that is not dropped")
                continue
            reason = b.add(u, bmap, hmax) or k.add(u, kmap, hmax)
            if reason:
                b.drop_last(u)
                k.drop_last(u)
                self._reject(u, reason)
        bad: set[int] = set()
        for table in (b, k):
            for u, reason in table.check(self._dense, self._H).items():
                self._reject(self.ids[u], reason)
                bad.add(u)
        b.discard(bad)  # a response with one bad share is ignored as a whole
        k.discard(bad)
        return b, k

    def _recover(self, owner: int, pts: list[tuple[Any, ...]], verify: Any, kind: str,
                 trust_consistent: bool = False) -> list[int]:
        """Secrets of one owner from its shares ``(index, holder, y...)``.

        The t lowest indices first; if their secret fails ``verify`` (commitment or
        public key), Berlekamp-Welch decoding around up to ``(m - t) // 2`` bad shares,
        whose holders are recorded as rejected.  ``trust_consistent``: if all m > t
        shares lie on one polynomial whose secret still fails ``verify``, the owner's
        own check value is what is wrong -- accept that secret and reject the owner.
        """
        t = self.config.threshold
        if len(pts) < t:
            raise SecAggAbort(f"too few responding holders to remove a {kind}: round aborted")
        pts = sorted(pts)
        n_sec = len(pts[0]) - 2
        first = pts[:t]
        lam = _lagrange_at_zero(tuple(p[0] for p in first))
        cand = [sum(la * p[2 + j] for la, p in zip(lam, first, strict=True)) % SHAMIR_PRIME
                for j in range(n_sec)]
        if verify(cand):
            return cand
        polys = [_berlekamp_welch([(p[0], p[2 + j]) for p in pts], t) for j in range(n_sec)]
        if all(poly is not None for poly in polys):
            decoded = [poly[0] for poly in polys]  # type: ignore[index]
            bad = [p for p in pts if any(_poly_eval(poly, p[0]) != p[2 + j]  # type: ignore[arg-type]
                                         for j, poly in enumerate(polys))]
            if verify(decoded):
                for p in bad:
                    self._reject(p[1], "unmasking: share inconsistent with the verified "
                                       "secret (bad at this holder or at its dealer)")
                return decoded
            if trust_consistent and not bad and len(pts) > t:
                self._reject(owner, "share_keys: commitment does not match the client's shares")
                return decoded
        elif trust_consistent and len(pts) > t:  # too few shares for decoding: all must agree
            polys = [_poly_through([(p[0], p[2 + j]) for p in first]) for j in range(n_sec)]
            if all(_poly_eval(poly, p[0]) == p[2 + j] for p in pts
                   for j, poly in enumerate(polys)):
                self._reject(owner, "share_keys: commitment does not match the client's shares")
                return [poly[0] for poly in polys]
        raise SecAggAbort(f"no consistent set of t shares to remove a {kind}: round aborted")

    def _secrets(self, table: _Shares, owners: frozenset[int], verify: Any, kind: str,
                 trust_consistent: bool = False) -> dict[int, list[int]]:
        """owner -> its secrets, for every owner (abort if one has fewer than t shares)."""
        t = self.config.threshold
        out: dict[int, list[int]] = {}
        p = SHAMIR_PRIME
        mul = operator.mul
        for o, idx, rows, holders in table.groups():
            owner = self.ids[o]
            if len(idx) < t:
                break
            lam = _lagrange_at_zero(tuple(idx[:t]))
            cand = [sum(map(mul, lam, table.values(rows[:t], j))) % p for j in range(table.width)]
            if verify(owner, cand):
                out[owner] = cand
                continue
            pts = [(i, self.ids[h], *ys) for i, h, ys in
                   zip(idx, holders, zip(*(table.values(rows, j) for j in range(table.width)),
                                         strict=True), strict=True)]
            out[owner] = self._recover(owner, pts, lambda c, owner=owner: verify(owner, c), kind,
                                       trust_consistent)
        if len(out) != len(owners):
            raise SecAggAbort(f"too few responding holders to remove a {kind}: round aborted")
        return out

    def finalize(self, responses: Sequence[UnmaskingResponse]) -> SecAggResult:
        """Round 3: reconstruct self masks (survivors) and mask keys (dropped); output the sum."""
        if self._request is None:
            raise RuntimeError("collect_masked_inputs must run before finalize")
        cfg = self.config
        req = self._request
        d, mmask = cfg.vector_length, cfg.modulus_mask
        b_tab, k_tab = self._gather(responses)
        total = np.stack(list(self._masked.values())).sum(axis=0, dtype=np.uint64)
        clock = time.perf_counter()
        commitments, round_id = self._commitments, cfg.round_id

        def check_b(u: int, c: list[int]) -> bool:
            commit = commitments.get(u, b"")
            return c[0] < 1 << 128 and (not commit or self_mask_commitment(
                round_id, u, c[0].to_bytes(16, "little")) == commit)

        b_secrets = self._secrets(b_tab, req.survivors, check_b, "survivor's self mask",
                                  trust_consistent=True)
        if any(c[0] >= 1 << 128 for c in b_secrets.values()):
            raise SecAggAbort("no consistent set of t shares to remove a survivor's self mask: "
                              "round aborted")
        masks = [prg_words(c[0].to_bytes(16, "little"), d, mmask) for c in b_secrets.values()]
        total = total - np.stack(masks).sum(axis=0, dtype=np.uint64)
        t_self = time.perf_counter() - clock
        clock = time.perf_counter()
        roster = self._roster

        def check_s(u: int, c: list[int]) -> bool:
            if c[0] >= 1 << 128 or c[1] >= 1 << 128:
                return False
            sk = X25519PrivateKey.from_private_bytes(
                c[0].to_bytes(16, "little") + c[1].to_bytes(16, "little"))
            return _raw(sk.public_key()) == roster[u].s_pk

        if req.dropped:
            k_secrets = self._secrets(k_tab, req.dropped, check_s, "dropped client's masks")
            peers: dict[int, X25519PublicKey] = {}
            plus, minus = [], []
            for u, (lo, hi) in k_secrets.items():
                s_sk_u = X25519PrivateKey.from_private_bytes(
                    lo.to_bytes(16, "little") + hi.to_bytes(16, "little"))
                for v in self.neighbours[u]:
                    if v not in req.survivors:
                        continue
                    peer = peers.get(v)
                    if peer is None:
                        peer = peers[v] = X25519PublicKey.from_public_bytes(roster[v].s_pk)
                    seed = _hkdf(s_sk_u.exchange(peer), _pair_info("pairwise", cfg.round_id, u, v))
                    # survivor v added +p if v < u, else -p: undo it
                    (minus if v < u else plus).append(prg_words(seed, d, mmask))
            for book, sign in ((plus, 1), (minus, -1)):
                if book:
                    part = np.stack(book).sum(axis=0, dtype=np.uint64)
                    total = total + part if sign > 0 else total - part
        t_drop = time.perf_counter() - clock
        return SecAggResult(
            sum_quantised=total & np.uint64(mmask),
            contributors=len(req.survivors),
            survivors=tuple(sorted(req.survivors)),
            dropped=tuple(sorted(req.dropped)),
            server_seconds={"unmasking.self_masks": t_self, "unmasking.dropout_recovery": t_drop},
            rejected=dict(self._rejected),
        )

    @property
    def received_masked_inputs(self) -> dict[int, np.ndarray]:
        """What the server saw in round 2 (for audits and tests)."""
        return dict(self._masked)


class _Shares:
    """Unmasking shares of one kind, as flat arrays: owner (dense), share index, holder
    (dense) and ``width`` 17-byte values per share (1: self-mask seed; 2: key halves)."""

    def __init__(self, width: int) -> None:
        self.width = width
        self.owner: list[int] = []
        self.index: list[int] = []
        self.holder: list[int] = []
        self.blobs: list[list[bytes]] = [[] for _ in range(width)]
        self._last: dict[int, int] = {}  # holder id -> number of shares it added last

    def add(self, u: int, shares: Mapping[int, Any], hmax: int) -> str:
        """Append holder ``u``'s shares after structural checks; "" or the broken rule."""
        vals = list(shares.values())
        if not vals:
            self._last[u] = 0
            return ""
        if set(map(type, vals)) != {tuple} or set(map(len, vals)) != {1 + self.width}:
            return "unmasking: malformed share"
        idx = [v[0] for v in vals]
        if set(map(type, idx)) != {int} or min(idx) < 1 or max(idx) > hmax:
            return "unmasking: share with a wrong index"
        cols = [[v[1 + j] for v in vals] for j in range(self.width)]
        for col in cols:
            if set(map(type, col)) != {bytes} or set(map(len, col)) != {_SHARE_BYTES}:
                return f"unmasking: share must be {_SHARE_BYTES} bytes below the field prime"
        self.owner.extend(shares.keys())
        self.index.extend(idx)
        self.holder.extend([u] * len(vals))
        for j in range(self.width):
            self.blobs[j].append(b"".join(cols[j]))
        self._last[u] = len(vals)
        return ""

    def drop_last(self, u: int) -> None:
        """Undo the last :meth:`add` of holder ``u`` (its response was rejected)."""
        m = self._last.pop(u, 0)
        if m and self.holder[-m:] == [u] * m:
            del self.owner[-m:], self.index[-m:], self.holder[-m:]
            for j in range(self.width):
                self.blobs[j].pop()

    def check(self, dense: dict[int, int], holders: np.ndarray | None) -> dict[int, str]:
        """Vectorised checks of every share; returns dense holder -> reason for failures."""
        self.O = np.fromiter(map(dense.__getitem__, self.owner), dtype=np.int64,
                             count=len(self.owner))
        self.H = np.fromiter(map(dense.__getitem__, self.holder), dtype=np.int64,
                             count=len(self.holder))
        self.I = np.asarray(self.index, dtype=np.int64)
        self.raw = [np.frombuffer(b"".join(col), dtype=np.uint8).reshape(-1, _SHARE_BYTES)
                    for col in self.blobs]
        if holders is None:  # complete graph: holder h is every owner's holder h + 1
            wrong = self.I != self.H + 1
        else:
            wrong = holders[self.O, self.I - 1] != self.H
        over = np.zeros(len(self.I), dtype=bool)
        for raw in self.raw:  # v >= 2^130 - 5 <=> top byte > 3, or == 3 and v exact
            top = raw[:, 16]
            over |= top > 3
            for r in np.flatnonzero(top == 3).tolist():
                over[r] |= int.from_bytes(raw[r].tobytes(), "little") >= SHAMIR_PRIME
        out: dict[int, str] = {}
        for r in np.flatnonzero(wrong | over).tolist():
            h = int(self.H[r])
            if over[r]:
                out.setdefault(h, f"unmasking: share must be {_SHARE_BYTES} bytes below the "
                                  "field prime")
            elif holders is not None and not np.any(holders[self.O[r]] == h):
                out.setdefault(h, "unmasking: share of a client this one does not hold")
            else:
                out.setdefault(h, "unmasking: share with a wrong index")
        return out

    def discard(self, bad_holders: set[int]) -> None:
        """Drop every share of these (dense) holders (after :meth:`check`)."""
        if not bad_holders:
            return
        keep = ~np.isin(self.H, np.fromiter(bad_holders, dtype=np.int64, count=len(bad_holders)))
        self.O, self.I, self.H = self.O[keep], self.I[keep], self.H[keep]
        self.raw = [raw[keep] for raw in self.raw]

    def groups(self) -> Any:
        """Per owner (dense): share indices ascending, their rows, their holders (dense)."""
        order = np.lexsort((self.I, self.O))
        owners = self.O[order]
        if not len(owners):
            return
        starts = np.flatnonzero(np.r_[True, owners[1:] != owners[:-1]])
        ends = np.r_[starts[1:], len(owners)]
        idx, holders, rows = self.I[order].tolist(), self.H[order].tolist(), order.tolist()
        self._bytes = [memoryview(raw.tobytes()) for raw in self.raw]
        for st, en, o in zip(starts.tolist(), ends.tolist(), owners[starts].tolist(), strict=True):
            yield o, idx[st:en], rows[st:en], holders[st:en]

    def values(self, rows: Sequence[int], j: int) -> list[int]:
        """The field elements of column j at these rows."""
        mv, w = self._bytes[j], _SHARE_BYTES
        return [int.from_bytes(mv[r * w:(r + 1) * w], "little") for r in rows]


# --------------------------------------------------------------------------
# in-process simulation
# --------------------------------------------------------------------------


def run_secure_aggregation(
    inputs: Mapping[int, Any],
    config: SecAggConfig,
    *,
    drop_before_share_keys: Sequence[int] = (),
    drop_before_masked_input: Sequence[int] = (),
    drop_before_unmasking: Sequence[int] = (),
    server_view: dict[int, np.ndarray] | None = None,
) -> SecAggResult:
    """Run one round in-process with explicit messages; returns the exact sum.

    Args:
        inputs: client id -> quantised uint64 vector ``(vector_length,)`` in [0, Q]
            (use :class:`FixedPointQuantiser` to produce them on the device).
        config: round parameters (``n_clients == len(inputs)``); ``client_ids`` is
            filled in from ``inputs`` when the config leaves it None.
        drop_before_share_keys / drop_before_masked_input / drop_before_unmasking:
            clients that go silent before that step.
        server_view: if given, filled with the masked vectors the server received.

    Returns:
        :class:`SecAggResult` with per-phase client and server wall times.

    Raises:
        SecAggAbort: fewer than t clients remain at any step, or a client refuses the
            unmasking request.
    """
    ids = sorted(int(k) for k in inputs)
    if config.client_ids is None:
        config = SecAggConfig.model_validate({**config.model_dump(), "client_ids": tuple(ids)})
    t0 = time.perf_counter
    cs: dict[str, float] = {}
    ss: dict[str, float] = {}

    def tick(book: dict[str, float], key: str, start: float) -> None:
        book[key] = book.get(key, 0.0) + t0() - start

    st = t0()
    server = SecAggServer(config, ids)
    tick(ss, "setup", st)
    st = t0()
    clients = {u: SecAggClient(u, config) for u in ids}
    adverts = [c.advertise() for c in clients.values()]
    tick(cs, "advertise_keys", st)

    st = t0()
    rosters = server.collect_advertisements(adverts)
    tick(ss, "advertise_keys", st)

    gone = set(int(u) for u in drop_before_share_keys)
    st = t0()
    share_msgs = [clients[u].share_keys(rosters[u], server.neighbours[u]) for u in ids if u not in gone]
    tick(cs, "share_keys", st)
    st = t0()
    inbox = server.route_shares(share_msgs)
    tick(ss, "share_keys", st)
    st = t0()
    for u, msgs in inbox.items():
        clients[u].receive_shares(msgs)
    tick(cs, "share_keys", st)

    gone |= set(int(u) for u in drop_before_masked_input)
    st = t0()
    masked = [clients[u].masked_input(np.asarray(inputs[u])) for u in ids if u not in gone]
    tick(cs, "masked_input", st)
    st = t0()
    request = server.collect_masked_inputs(masked)
    tick(ss, "masked_input", st)
    if server_view is not None:
        server_view.update(server.received_masked_inputs)

    gone |= set(int(u) for u in drop_before_unmasking)
    st = t0()
    responses = [clients[u].unmask(request) for u in sorted(request.survivors) if u not in gone]
    tick(cs, "unmasking", st)
    st = t0()
    result = server.finalize(responses)
    tick(ss, "unmasking", st)
    result.client_seconds = cs
    result.server_seconds = {**ss, **result.server_seconds}
    return result
