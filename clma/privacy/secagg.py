"""Pairwise-masking secure aggregation (Bonawitz et al. CCS 2017; SecAgg+ graph of Bell et al. CCS 2020).

The server learns the SUM over the surviving clients of their clipped,
quantised metric vectors, and nothing else about any single vector
(honest-but-curious server, Bonawitz et al. §6.2).  Only the protocol is
written here; the primitives come from ``cryptography`` (X25519 key
agreement, HKDF-SHA256, AES-CTR as the mask PRG, AES-GCM for shares in
transit) and ``pycryptodome`` (Shamir secret sharing over GF(2^128)).

Quantisation
------------
Each coordinate j is clipped to ``[lower_j, upper_j]`` and mapped to an integer
``q = round((x - lower_j) / (upper_j - lower_j) * Q)`` in ``[0, Q]`` with
``Q = quantisation_levels`` (default ``2^16 - 1``).  Arithmetic is modulo
``2^k`` (``modulus_bits = k``, default 32, words held in uint64).  The sum of
n clients is exact (no wrap-around) iff ``n * Q < 2^k``; this is checked when
the round is configured (default: up to 65,537 clients).  Rounding error on the
de-quantised sum is at most ``n * (upper - lower) / (2 Q)`` per coordinate.

Neighbour graph
---------------
``neighbour_degree=None``: complete graph (original SecAgg).  An even
``neighbour_degree = d < n - 1``: a Harary graph H(d, n) on a seeded random
permutation of the clients (SecAgg+, Bell et al. §3), each client masking with
and secret-sharing to its d neighbours only; ``secagg_plus_degree(n)`` gives
``d = 2 ceil(log2 n)`` (O(log n)).  A client's share holders are its
neighbours and itself; the threshold t must be a strict majority of the
holders (so a server cannot obtain both kinds of share of one client from two
disjoint sets of honest clients) and at least 2.

Messages and what the server sees
---------------------------------
Round 0 ``AdvertiseKeys`` (client -> server -> neighbours): two X25519 public
    keys per client: ``c_pk`` (share encryption) and ``s_pk`` (pairwise
    masks).  The server sees public keys only.
Round 1 ``ShareKeys`` (client -> server -> recipients): client u draws a
    16-byte self-mask seed ``b_u`` and Shamir-shares it and its 32-byte mask
    private key ``s_sk_u`` (as two 16-byte halves) with threshold t among its
    holders.  Each share is AES-GCM encrypted under
    ``HKDF(X25519(c_sk_u, c_pk_v))``.  The server routes ciphertexts and sees
    only who sends to whom and their (fixed) length.
Round 2 ``MaskedInput`` (client -> server): ``y_u = q_u + PRG(b_u) +
    sum_{v in N(u), u<v} PRG(s_uv) - sum_{v in N(u), v<u} PRG(s_uv) mod 2^k``
    with ``s_uv = HKDF(X25519(s_sk_u, s_pk_v))`` and PRG = AES-CTR keystream.
    Because of the self mask ``PRG(b_u)`` each ``y_u`` is uniform on
    ``Z_{2^k}^d`` whatever ``q_u`` is (tested: chi-square against uniform, and
    identical distributions when one client's input changes).
Round 3 ``Unmasking`` (server -> clients -> server): the server announces the
    survivors S (sent y) and the dropped D (shared keys, sent no y).  Each
    responding client checks ``S ∩ D = ∅`` and that at least t of its holders
    survived, then returns shares of ``b_u`` for u in S and shares of
    ``s_sk_u`` for u in D — never both for one u.  The server reconstructs
    ``b_u`` (u in S) and ``s_sk_u`` (u in D), removes the self masks of the
    survivors and the pairwise masks between survivors and dropped clients;
    pairwise masks between survivors cancel.  It learns ``sum_{u in S} q_u mod
    2^k`` and nothing about an individual ``q_u``.
Abort: fewer than t survivors (or, for one client, fewer than t responding
holders) raises :class:`SecAggAbort` — the sum is refused, never approximated.
So the sum is recovered exactly whenever at most ``n - t`` clients drop out
(complete graph), at any stage after ShareKeys.

This is the semi-honest protocol (no consistency-check round, no signatures):
an actively malicious server is out of scope and noted as such.  The
randomness of keys and self-mask seeds is ``os.urandom`` via ``cryptography``
and deliberately unseedable; only the neighbour-graph permutation is seeded.
"""

from __future__ import annotations

import math
import os
import struct
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from Crypto.Protocol.SecretSharing import Shamir
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "AdvertiseKeys",
    "EncryptedShare",
    "FixedPointQuantiser",
    "MaskedInput",
    "SecAggAbort",
    "SecAggClient",
    "SecAggConfig",
    "SecAggResult",
    "SecAggServer",
    "ShareKeys",
    "UnmaskingRequest",
    "UnmaskingResponse",
    "harary_neighbours",
    "run_secure_aggregation",
    "secagg_plus_degree",
]

_ZERO_NONCE16 = b"\x00" * 16


class SecAggAbort(RuntimeError):
    """The round cannot finish safely (too few survivors or holders)."""


# --------------------------------------------------------------------------
# configuration and quantisation
# --------------------------------------------------------------------------


class SecAggConfig(BaseModel):
    """Parameters of one secure-aggregation round.

    Attributes:
        n_clients: clients selected for the round (>= 2).
        threshold: Shamir threshold t (strict majority of each client's holders).
        vector_length: d, values per client (e.g. 32).
        modulus_bits: k, arithmetic modulo 2^k (8..62).
        quantisation_levels: Q, integer levels per coordinate range.
        neighbour_degree: None (complete graph) or even d < n_clients - 1 (SecAgg+).
        round_id: bound into every key derivation (a key is never reused across rounds).
        graph_seed: seed of the neighbour-graph permutation.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    n_clients: int = Field(ge=2)
    threshold: int = Field(ge=2)
    vector_length: int = Field(ge=1)
    modulus_bits: int = Field(default=32, ge=8, le=62)
    quantisation_levels: int = Field(default=2**16 - 1, ge=1)
    neighbour_degree: int | None = None
    round_id: str = Field(default="round-0", min_length=1)
    graph_seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> SecAggConfig:
        if self.n_clients * self.quantisation_levels >= 2**self.modulus_bits:
            raise ValueError(
                "overflow bound violated: n_clients * quantisation_levels must be < "
                "2**modulus_bits"
            )
        if self.neighbour_degree is not None:
            d = self.neighbour_degree
            if d < 2 or d % 2:
                raise ValueError("neighbour_degree must be an even integer >= 2")
        holders = self.holders_per_client
        if self.threshold > holders:
            raise ValueError("threshold must not exceed the number of share holders per client")
        if 2 * self.threshold <= holders:
            raise ValueError(
                "threshold must be a strict majority of the share holders per client"
            )
        return self

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
    def modulus_mask(self) -> int:
        return (1 << self.modulus_bits) - 1


def secagg_plus_degree(n_clients: int) -> int:
    """SecAgg+ neighbour degree ``d = 2 ceil(log2 n)``, capped below n - 1 (even)."""
    if n_clients < 2:
        raise ValueError("n_clients must be >= 2")
    d = 2 * math.ceil(math.log2(n_clients))
    cap = n_clients - 1 if (n_clients - 1) % 2 == 0 else n_clients - 2
    return max(2, min(d, cap))


def harary_neighbours(ids: Sequence[int], degree: int | None, seed: int) -> dict[int, tuple[int, ...]]:
    """Neighbour sets of a Harary graph H(degree, n) on a seeded permutation.

    ``degree=None`` or ``>= n - 1`` gives the complete graph.  Each client is
    linked to the ``degree / 2`` clients on either side of it on a randomly
    permuted ring (Bell et al. 2020, §3.1 use a random k-regular graph; the
    Harary construction is the standard way to get one with minimum degree).
    """
    ids = list(ids)
    n = len(ids)
    if degree is None or degree >= n - 1:
        return {u: tuple(v for v in ids if v != u) for u in ids}
    perm = [ids[i] for i in np.random.default_rng(seed).permutation(n)]
    half = degree // 2
    out: dict[int, set[int]] = {u: set() for u in ids}
    for i, u in enumerate(perm):
        for j in range(1, half + 1):
            v = perm[(i + j) % n]
            out[u].add(v)
            out[v].add(u)
    return {u: tuple(sorted(vs)) for u, vs in out.items()}


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
# primitives (thin wrappers; all cryptography from the libraries)
# --------------------------------------------------------------------------


def _raw(pk: X25519PublicKey) -> bytes:
    return pk.public_bytes(Encoding.Raw, PublicFormat.Raw)


def _hkdf(secret: bytes, info: bytes, length: int = 32) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=None, info=info).derive(secret)


def prg_words(seed: bytes, d: int, modulus_mask: int) -> np.ndarray:
    """Expand a 16/32-byte seed into d uniform words mod 2^k (AES-CTR keystream)."""
    enc = Cipher(algorithms.AES(seed), modes.CTR(_ZERO_NONCE16)).encryptor()
    stream = enc.update(b"\x00" * (8 * d)) + enc.finalize()
    return np.frombuffer(stream, dtype="<u8").astype(np.uint64) & np.uint64(modulus_mask)


def _pair_info(kind: str, round_id: str, u: int, v: int) -> bytes:
    a, b = (u, v) if u < v else (v, u)
    return f"clma-secagg|{kind}|{round_id}|{a}|{b}".encode()


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
    """Round 1: all encrypted shares of one client."""

    client_id: int
    shares: tuple[EncryptedShare, ...]


@dataclass(frozen=True, slots=True)
class MaskedInput:
    """Round 2: masked vector, uint64 ``(d,)`` with values in ``[0, 2^k)``."""

    client_id: int
    masked: np.ndarray


@dataclass(frozen=True, slots=True)
class UnmaskingRequest:
    """Round 3 (server -> clients): survivors S and dropped D."""

    survivors: frozenset[int]
    dropped: frozenset[int]


@dataclass(frozen=True, slots=True)
class UnmaskingResponse:
    """Round 3 (client -> server): shares of b_u (u in S) and s_sk_u (u in D).

    ``self_mask_shares[u] = (index, 16 bytes)``;
    ``key_shares[u] = (index, 16 bytes, 16 bytes)``.
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
        survivors, dropped: client ids.
        client_seconds, server_seconds: wall time spent in client and server code
            (filled by :func:`run_secure_aggregation`), per phase.  Server phase
            ``unmasking`` splits into ``unmasking.self_masks`` (reconstructing
            survivors' self masks) and ``unmasking.dropout_recovery``
            (reconstructing dropped clients' keys and removing their pairwise masks).
    """

    sum_quantised: np.ndarray
    contributors: int
    survivors: tuple[int, ...]
    dropped: tuple[int, ...]
    client_seconds: dict[str, float] = field(default_factory=dict)
    server_seconds: dict[str, float] = field(default_factory=dict)


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
        self._enc_keys: dict[int, AESGCM] = {}
        # owner -> (share index, b share, s share half a, s share half b)
        self._held: dict[int, tuple[int, bytes, bytes, bytes]] = {}
        self._sent_input = False

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
        """Shamir-share ``b_u`` and ``s_sk_u`` among neighbours + self; encrypt each share."""
        self._neighbours = tuple(sorted(int(v) for v in neighbours))
        self._roster = {int(k): v for k, v in roster.items()}
        if self.id in self._neighbours:
            raise ValueError("a client cannot be its own neighbour")
        if len({m.c_pk for m in self._roster.values()}) != len(self._roster):
            raise SecAggAbort("duplicate public keys in the roster")
        holders = sorted((*self._neighbours, self.id))
        t = self.config.threshold
        if len(holders) < t:
            raise SecAggAbort("fewer share holders than the threshold")
        s_raw = self._s_sk.private_bytes_raw()
        b_shares = Shamir.split(t, len(holders), self._b)
        s_a = Shamir.split(t, len(holders), s_raw[:16])
        s_b = Shamir.split(t, len(holders), s_raw[16:])
        out = []
        for pos, holder in enumerate(holders):
            idx = pos + 1
            assert b_shares[pos][0] == idx
            payload = struct.pack("<qqI", self.id, holder, idx) + b_shares[pos][1] + s_a[pos][1] + s_b[pos][1]
            if holder == self.id:
                self._held[self.id] = (idx, b_shares[pos][1], s_a[pos][1], s_b[pos][1])
                continue
            nonce = struct.pack("<q", self.id) + b"\x00" * 4
            ad = struct.pack("<qq", self.id, holder)
            ct = self._aead(holder).encrypt(nonce, payload, ad)
            out.append(EncryptedShare(self.id, holder, ct))
        return ShareKeys(self.id, tuple(out))

    def receive_shares(self, shares: Sequence[EncryptedShare]) -> None:
        """Decrypt and keep the shares routed to this client (AES-GCM verifies them)."""
        for sh in shares:
            if sh.recipient != self.id or sh.sender not in self._neighbours:
                raise SecAggAbort("share routed to the wrong client or from a non-neighbour")
            nonce = struct.pack("<q", sh.sender) + b"\x00" * 4
            ad = struct.pack("<qq", sh.sender, self.id)
            pt = self._aead(sh.sender).decrypt(nonce, sh.ciphertext, ad)
            owner, recipient, idx = struct.unpack("<qqI", pt[:20])
            if owner != sh.sender or recipient != self.id:
                raise SecAggAbort("share header does not match its envelope")
            self._held[owner] = (idx, pt[20:36], pt[36:52], pt[52:68])

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
        if np.any(q > np.uint64(cfg.quantisation_levels)):
            raise ValueError("quantised input exceeds quantisation_levels")
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
        """Reveal b-shares of survivors and key shares of dropped clients, never both."""
        s, d = request.survivors, request.dropped
        if s & d:
            raise SecAggAbort("a client is listed both as survivor and as dropped")
        if self.id not in s:
            raise SecAggAbort("only survivors take part in unmasking")
        holders = set(self._neighbours) | {self.id}
        if len(holders & s) < self.config.threshold:
            raise SecAggAbort("fewer survivors among this client's holders than the threshold")
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


class SecAggServer:
    """Server side: routes messages, never holds a client secret, outputs only the sum."""

    def __init__(self, config: SecAggConfig, client_ids: Sequence[int]) -> None:
        ids = [int(c) for c in client_ids]
        if len(ids) != config.n_clients or len(set(ids)) != len(ids):
            raise ValueError("client_ids must be n_clients distinct integers")
        self.config = config
        self.ids = tuple(sorted(ids))
        self.neighbours = harary_neighbours(
            self.ids, None if config.complete_graph else config.neighbour_degree, config.graph_seed
        )
        self._roster: dict[int, AdvertiseKeys] = {}
        self._u1: set[int] = set()
        self._masked: dict[int, np.ndarray] = {}
        self._request: UnmaskingRequest | None = None

    def collect_advertisements(self, msgs: Sequence[AdvertiseKeys]) -> dict[int, dict[int, AdvertiseKeys]]:
        """Round 0: returns, per client, the public keys of its neighbours."""
        self._roster = {m.client_id: m for m in msgs}
        if len(self._roster) < self.config.threshold:
            raise SecAggAbort("fewer clients advertised keys than the threshold")
        return {
            u: {v: self._roster[v] for v in self.neighbours[u] if v in self._roster}
            for u in self._roster
        }

    def route_shares(self, msgs: Sequence[ShareKeys]) -> dict[int, list[EncryptedShare]]:
        """Round 1: routes ciphertexts; U1 = clients that sent their shares."""
        self._u1 = {m.client_id for m in msgs}
        if len(self._u1) < self.config.threshold:
            raise SecAggAbort("fewer clients shared keys than the threshold")
        inbox: dict[int, list[EncryptedShare]] = {u: [] for u in self._u1}
        for m in msgs:
            for sh in m.shares:
                if sh.recipient in inbox:
                    inbox[sh.recipient].append(sh)
        return inbox

    def collect_masked_inputs(self, msgs: Sequence[MaskedInput]) -> UnmaskingRequest:
        """Round 2: keeps masked vectors; aborts below t survivors."""
        d = self.config.vector_length
        self._masked = {}
        for m in msgs:
            if m.client_id not in self._u1:
                continue
            y = np.asarray(m.masked)
            if y.shape != (d,) or y.dtype != np.uint64:
                raise ValueError("masked input must be uint64 of shape (vector_length,)")
            self._masked[m.client_id] = y
        survivors = frozenset(self._masked)
        if len(survivors) < self.config.threshold:
            raise SecAggAbort(
                f"only {len(survivors)} clients sent masked input; the threshold is "
                f"{self.config.threshold}: the round is aborted and no sum is released"
            )
        self._request = UnmaskingRequest(survivors, frozenset(self._u1 - survivors))
        return self._request

    def finalize(self, responses: Sequence[UnmaskingResponse]) -> SecAggResult:
        """Round 3: reconstruct self masks (survivors) and mask keys (dropped); output the sum."""
        if self._request is None:
            raise RuntimeError("collect_masked_inputs must run before finalize")
        cfg = self.config
        req = self._request
        t = cfg.threshold
        resp = [r for r in responses if r.client_id in req.survivors]
        b_shares: dict[int, list[tuple[int, bytes]]] = {u: [] for u in req.survivors}
        k_shares: dict[int, list[tuple[int, bytes, bytes]]] = {u: [] for u in req.dropped}
        for r in resp:
            for owner, sh in r.self_mask_shares.items():
                if owner in b_shares:
                    b_shares[owner].append(sh)
            for owner, ksh in r.key_shares.items():
                if owner in k_shares:
                    k_shares[owner].append(ksh)
        mm = np.uint64(cfg.modulus_mask)
        total = np.zeros(cfg.vector_length, dtype=np.uint64)
        for y in self._masked.values():
            total = total + y
        clock = time.perf_counter()
        for shares in b_shares.values():
            if len(shares) < t:
                raise SecAggAbort(
                    "too few responding holders to remove a survivor's self mask: round aborted"
                )
            b_u = Shamir.combine(shares[:t])
            total = total - prg_words(b_u, cfg.vector_length, cfg.modulus_mask)
        t_self = time.perf_counter() - clock
        clock = time.perf_counter()
        for u, kshares in k_shares.items():
            if len(kshares) < t:
                raise SecAggAbort(
                    "too few responding holders to remove a dropped client's masks: round aborted"
                )
            sk = Shamir.combine([(i, a) for i, a, _ in kshares[:t]]) + Shamir.combine(
                [(i, b) for i, _, b in kshares[:t]]
            )
            s_sk_u = X25519PrivateKey.from_private_bytes(sk)
            for v in self.neighbours[u]:
                if v not in req.survivors:
                    continue
                peer = X25519PublicKey.from_public_bytes(self._roster[v].s_pk)
                seed = _hkdf(s_sk_u.exchange(peer), _pair_info("pairwise", cfg.round_id, u, v))
                p = prg_words(seed, cfg.vector_length, cfg.modulus_mask)
                # survivor v added +p if v < u, else -p: undo it
                total = total - p if v < u else total + p
        t_drop = time.perf_counter() - clock
        return SecAggResult(
            sum_quantised=total & mm,
            contributors=len(req.survivors),
            survivors=tuple(sorted(req.survivors)),
            dropped=tuple(sorted(req.dropped)),
            server_seconds={"unmasking.self_masks": t_self, "unmasking.dropout_recovery": t_drop},
        )

    @property
    def received_masked_inputs(self) -> dict[int, np.ndarray]:
        """What the server saw in round 2 (for audits and tests)."""
        return dict(self._masked)


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
        config: round parameters (``n_clients == len(inputs)``).
        drop_before_share_keys / drop_before_masked_input / drop_before_unmasking:
            clients that go silent before that step.
        server_view: if given, filled with the masked vectors the server received.

    Returns:
        :class:`SecAggResult` with per-phase client and server wall times.

    Raises:
        SecAggAbort: fewer than t clients remain at any step.
    """
    ids = sorted(int(k) for k in inputs)
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
