"""Secure aggregation, this project's protocol against Flower's SecAgg+ primitives (issue 15).

Both run in this process on the same inputs: n clients, 32 values each (uniform in
[0, 1]), the same 5 % of the clients going silent before their masked input (the
server must recover their pairwise masks), and the same SecAgg+ graph degree k and
threshold t, from ``secagg_plus_parameters(n, corrupted_fraction=0.05,
dropout_fraction=0.05)``.

* ours: the library's ``SecAggClient`` / ``SecAggServer`` exchanging their explicit
  messages, in the order :func:`clma.privacy.secagg.run_secure_aggregation` uses.
* flower: the legacy building blocks that ``SecAggPlusWorkflow`` uses
  (``flwr.common.secure_aggregation``: ``create_shares`` / ``combine_shares``
  (pycryptodome's Shamir over GF(2^128)), ``generate_shared_key`` (ECDH P-384 + HKDF),
  ``pseudo_rand_gen``, Fernet, the ndarray arithmetic), driven as its four stages
  drive them: the client side is ``secaggplus_mod``'s ``_setup`` / ``_share_keys`` /
  ``_collect_masked_vectors`` / ``_unmask``; the server side reproduces
  ``SecAggPlusWorkflow``'s stages -- ring of ``num_shares = k + 1`` nodes around each
  node on a shuffled order, public-key and share forwarding, the masked-vector sum, and
  the unmask stage (``combine_shares`` of every collected share per node, the self mask
  of each active node, the pairwise masks of each dead node with every neighbour, the
  modular reduction and de-quantisation).

On both sides, building and transporting messages and persisting node state between
stages are left out; clients run one after the other, so "client ms" is the mean wall
time of one client's work over the round, and "server s" is the server's total (ours:
the median of ``--repeat`` runs for n <= 1000, as the shared machine's load makes single
runs noisy; flower: one run).  The ratio is ours / flower (server).  Flower's side is slow (pure-Python Shamir over
GF(2^128) for 15+ chunks per secret and ECDH on P-384); ``--flower-max`` (default 1000)
skips it for larger n; ``--flower-estimate`` then runs it on ``k + 2`` nodes with that n's
degree and threshold (each node's server work -- one ``combine_shares`` of its k + 1
shares, a self mask or a dead node's k pairwise masks -- depends on k and t, not on n)
and prints the per-node server cost times n, marked "~".

    .venv/bin/python benchmarks/bench_secagg.py                 # 100, 1000, 10000
    .venv/bin/python benchmarks/bench_secagg.py --quick         # 100 only
    .venv/bin/python benchmarks/bench_secagg.py --sizes 10000 --flower-max 10000
    .venv/bin/python benchmarks/bench_secagg.py --sizes 10000 --flower-estimate
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from typing import Any

import numpy as np

from clma.privacy.secagg import (
    FixedPointQuantiser,
    SecAggClient,
    SecAggConfig,
    SecAggServer,
    secagg_plus_parameters,
)

D = 32


def ours(x: np.ndarray, dropped: list[int], k: int, t: int, seed: int) -> dict[str, Any]:
    """This project's protocol, message by message as run_secure_aggregation drives it
    (client and server timed separately, wall and CPU); checks the exact sum."""
    n = len(x)
    quant = FixedPointQuantiser(np.zeros(D), np.ones(D))
    inputs = {u: quant.quantise(x[u]) for u in range(n)}
    cfg = SecAggConfig(n_clients=n, threshold=t, vector_length=D,
                       neighbour_degree=None if k >= n - 1 else k, graph_seed=seed,
                       round_id=f"bench-{n}", corrupted_fraction=0.05, dropout_fraction=0.05,
                       client_ids=tuple(range(n)))
    clock = {"client": 0.0, "server": 0.0, "server_cpu": 0.0}

    def client(f: Any, *a: Any) -> Any:
        st = time.perf_counter()
        out = f(*a)
        clock["client"] += time.perf_counter() - st
        return out

    def server(f: Any, *a: Any) -> Any:
        st, cpu = time.perf_counter(), time.process_time()
        out = f(*a)
        clock["server"] += time.perf_counter() - st
        clock["server_cpu"] += time.process_time() - cpu
        return out

    ids = list(range(n))
    srv = server(SecAggServer, cfg, ids)
    clients = client(lambda: {u: SecAggClient(u, cfg) for u in ids})
    adverts = client(lambda: [c.advertise() for c in clients.values()])
    rosters = server(srv.collect_advertisements, adverts)
    share_msgs = client(lambda: [clients[u].share_keys(rosters[u], srv.neighbours[u]) for u in ids])
    inbox = server(srv.route_shares, share_msgs)
    client(lambda: [clients[u].receive_shares(box) for u, box in inbox.items()])
    gone = set(dropped)
    masked = client(lambda: [clients[u].masked_input(inputs[u]) for u in ids if u not in gone])
    request = server(srv.collect_masked_inputs, masked)
    responses = client(lambda: [clients[u].unmask(request) for u in sorted(request.survivors)])
    res = server(srv.finalize, responses)
    expect = sum(inputs[u] for u in ids if u not in gone) & np.uint64(2**32 - 1)
    assert np.array_equal(res.sum_quantised, expect), "ours: secure sum mismatch"
    assert res.dropped == tuple(dropped) and not res.rejected
    return {"client_ms": 1000 * clock["client"] / n, "server_s": clock["server"],
            "server_cpu_s": clock["server_cpu"],
            "recovery_s": res.server_seconds["unmasking.dropout_recovery"]}


def flower(x: np.ndarray, dropped: list[int], k: int, t: int, seed: int,
           verbose: bool = False) -> dict[str, Any]:
    """Flower's SecAgg+ primitives, stage by stage as SecAggPlusWorkflow runs them."""
    from flwr.app import ConfigRecord
    from flwr.client.mod.secure_aggregation.secaggplus_mod import (
        SecAggPlusState,
        _collect_masked_vectors,
        _setup,
        _share_keys,
        _unmask,
    )
    from flwr.common import bytes_to_ndarray, ndarrays_to_parameters
    from flwr.common.secure_aggregation.crypto.shamir import combine_shares
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key
    from flwr.common.secure_aggregation.ndarrays_arithmetic import (
        factor_extract,
        get_parameters_shape,
        parameters_addition,
        parameters_mod,
        parameters_subtraction,
    )
    from flwr.common.secure_aggregation.quantization import dequantize
    from flwr.common.secure_aggregation.secaggplus_constants import Key
    from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen
    from flwr.supercore.primitives.asymmetric import bytes_to_private_key, bytes_to_public_key

    n = len(x)
    num_shares, threshold = k + 1, t
    clipping_range, target_range, mod_range, max_weight = 1.0, 2**16, 2**32, 1.0
    nids = list(range(1, n + 1))  # Flower node ids
    dead_before_masked = {nids[u] for u in dropped}
    clock = {"client": 0.0, "server": 0.0, "server_cpu": 0.0}

    def client(f: Any, *a: Any) -> Any:
        st = time.perf_counter()
        out = f(*a)
        clock["client"] += time.perf_counter() - st
        return out

    def server(f: Any, *a: Any) -> Any:
        st, cpu = time.perf_counter(), time.process_time()  # process: all threads' CPU
        out = f(*a)
        clock["server"] += time.perf_counter() - st
        clock["server_cpu"] += time.process_time() - cpu
        return out

    def progress(stage: str) -> None:
        if verbose:
            print(f"  flower n={n}: {stage} done; client {clock['client']:.1f} s, server "
                  f"{clock['server']:.1f} s so far", file=sys.stderr, flush=True)

    states = {nid: SecAggPlusState() for nid in nids}
    for nid in nids:
        states[nid].nid = nid

    # stage 0 (setup): ring of num_shares nodes around each node on a shuffled order
    def setup_server() -> dict[int, set[int]]:
        order = list(nids)
        random.Random(seed).shuffle(order)
        half = num_shares >> 1
        return {nid: {order[(i + off) % n] for off in range(-half, half + 1)}
                for i, nid in enumerate(order)}

    nid_to_neighbours = server(setup_server)
    setup_cfg = ConfigRecord({Key.SAMPLE_NUMBER: n, Key.SHARE_NUMBER: num_shares,
                              Key.THRESHOLD: threshold, Key.CLIPPING_RANGE: clipping_range,
                              Key.TARGET_RANGE: target_range, Key.MOD_RANGE: mod_range,
                              Key.MAX_WEIGHT: max_weight})
    keys = {nid: client(_setup, states[nid], setup_cfg) for nid in nids}

    def collect_keys() -> dict[int, list[bytes]]:
        return {nid: [r[Key.PUBLIC_KEY_1], r[Key.PUBLIC_KEY_2]] for nid, r in keys.items()}

    nid_to_publickeys = server(collect_keys)
    active = set(nids)
    progress("setup")

    # stage 1 (share keys): each node gets its neighbours' public keys, returns ciphertexts
    share_replies = {}
    for nid in nids:
        cfg = ConfigRecord({str(v): nid_to_publickeys[v] for v in nid_to_neighbours[nid] & active})
        share_replies[nid] = client(_share_keys, states[nid], cfg)

    def forward() -> tuple[dict[int, list[bytes]], dict[int, list[int]]]:
        fwd_ct: dict[int, list[bytes]] = {nid: [] for nid in active}
        fwd_src: dict[int, list[int]] = {nid: [] for nid in active}
        for nid, res in share_replies.items():
            for dst, ct in zip(res[Key.DESTINATION_LIST], res[Key.CIPHERTEXT_LIST], strict=True):
                if dst in fwd_ct:
                    fwd_ct[dst].append(ct)
                    fwd_src[dst].append(nid)
        return fwd_ct, fwd_src

    fwd_ct, fwd_src = server(forward)
    progress("share keys")

    # stage 2 (collect masked vectors): 5 % go silent here
    masked_replies = {}
    for u, nid in enumerate(nids):
        if nid in dead_before_masked:
            continue
        cfg = ConfigRecord({Key.CIPHERTEXT_LIST: fwd_ct[nid], Key.SOURCE_LIST: fwd_src[nid]})
        params = ndarrays_to_parameters([x[u].astype(np.float64)])
        masked_replies[nid] = client(_collect_masked_vectors, states[nid], cfg, 1, params)

    def sum_masked() -> list[np.ndarray]:
        total = None
        for res in masked_replies.values():
            vec = [bytes_to_ndarray(b) for b in res[Key.MASKED_PARAMETERS]]
            total = vec if total is None else parameters_addition(total, vec)
        return parameters_mod(total, mod_range)  # type: ignore[arg-type]

    masked_vector = server(sum_masked)
    progress("collect masked vectors")
    active_nids = set(masked_replies)
    dead_nids = set(nids) - active_nids

    # stage 3 (unmask): shares of active nodes' seeds and of dead nodes' keys
    unmask_replies = {}
    for nid in sorted(active_nids):
        nb = nid_to_neighbours[nid]
        cfg = ConfigRecord({Key.ACTIVE_NODE_ID_LIST: list(nb & active_nids),
                            Key.DEAD_NODE_ID_LIST: list(nb & dead_nids)})
        unmask_replies[nid] = client(_unmask, states[nid], cfg)

    def unmask_server() -> list[np.ndarray]:
        collected: dict[int, list[bytes]] = {nid: [] for nid in nids}
        for res in unmask_replies.values():
            for owner, share in zip(res[Key.NODE_ID_LIST], res[Key.SHARE_LIST], strict=True):
                collected[owner].append(share)
        vec = masked_vector
        for nid, share_list in collected.items():
            if len(share_list) < threshold:
                raise RuntimeError("flower: not enough shares to recover a secret")
            secret = combine_shares(share_list)
            if nid in active_nids:
                private_mask = pseudo_rand_gen(secret, mod_range, get_parameters_shape(vec))
                vec = parameters_subtraction(vec, private_mask)
            else:
                neighbours = set(nid_to_neighbours[nid])
                neighbours.remove(nid)
                for other in neighbours:
                    shared_key = generate_shared_key(
                        bytes_to_private_key(secret), bytes_to_public_key(nid_to_publickeys[other][0]))
                    pairwise_mask = pseudo_rand_gen(shared_key, mod_range, get_parameters_shape(vec))
                    if nid > other:
                        vec = parameters_addition(vec, pairwise_mask)
                    else:
                        vec = parameters_subtraction(vec, pairwise_mask)
        recon = parameters_mod(vec, mod_range)
        q_total_ratio, recon = factor_extract(recon)
        inv_dq_total_ratio = target_range / q_total_ratio
        out = dequantize(recon, clipping_range, target_range)
        offset = -(len(active_nids) - 1) * clipping_range
        for arr in out:
            arr += offset
            arr *= inv_dq_total_ratio
        return out

    aggregated = server(unmask_server)
    progress("unmask")
    survivors = [u for u, nid in enumerate(nids) if nid in active_nids]
    mean = x[survivors].mean(axis=0)
    assert np.allclose(aggregated[0], mean, atol=1e-3), "flower: aggregate mismatch"
    return {"client_ms": 1000 * clock["client"] / n, "server_s": clock["server"],
            "server_cpu_s": clock["server_cpu"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="n = 100 only (smoke run)")
    ap.add_argument("--sizes", type=int, nargs="*", default=None)
    ap.add_argument("--dropout", type=float, default=0.05,
                    help="fraction of clients silent before their masked input (and delta)")
    ap.add_argument("--corrupted", type=float, default=0.05, help="gamma for the parameters")
    ap.add_argument("--flower-max", type=int, default=1000,
                    help="largest n for which Flower's side is run")
    ap.add_argument("--repeat", type=int, default=3,
                    help="runs of our side per n <= 1000 (median reported; one run above)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--verbose", action="store_true", help="Flower's stage times on stderr")
    ap.add_argument("--flower-estimate", action="store_true",
                    help="for n > --flower-max, run Flower on k + 2 nodes with n's degree and "
                         "threshold and extrapolate its per-node server cost to n (marked ~)")
    args = ap.parse_args()
    sizes = args.sizes or ([100] if args.quick else [100, 1000, 10_000])
    print(f"vector length {D}, modulus 2^32, {args.dropout:.0%} silent before masked input, "
          f"parameters from gamma = {args.corrupted}, delta = {args.dropout}, seed {args.seed}")
    print(f"load average {' '.join(f'{v:.1f}' for v in os.getloadavg())} on "
          f"{os.cpu_count()} cores (server s = wall, in parentheses CPU s)")
    print(f"{'n':>6} {'k':>4} {'t':>4} {'drop':>5} {'ours client ms':>15} {'ours server s':>20} "
          f"{'flower client ms':>17} {'flower server s':>20} {'ratio':>7}")
    warm = np.random.default_rng(1).uniform(0, 1, (12, D))
    ours(warm, [0], 4, 3, 1)  # warm-up (library initialisation), discarded
    rows = {}
    for n in sizes:
        rng = np.random.default_rng([args.seed, n])
        x = rng.uniform(0, 1, (n, D))
        dropped = sorted(rng.choice(n, size=int(round(args.dropout * n)), replace=False).tolist())
        k, t = secagg_plus_parameters(n, corrupted_fraction=args.corrupted,
                                      dropout_fraction=args.dropout)
        runs = [ours(x, dropped, k, t, args.seed)
                for _ in range(max(1, args.repeat) if n <= 1000 else 1)]
        a = {key: float(np.median([r[key] for r in runs])) for key in runs[0]}
        b, mark = None, " "
        if n <= args.flower_max:
            b = flower(x, dropped, k, t, args.seed, args.verbose)
        elif args.flower_estimate:  # every node's server work depends on k and t, not on n
            m = k + 2
            small = flower(x[:m], list(range(max(1, round(args.dropout * m)))), k, t, args.seed,
                           args.verbose)
            b = {"client_ms": small["client_ms"], "server_s": small["server_s"] * n / m,
                 "server_cpu_s": small["server_cpu_s"] * n / m}
            mark = "~"
        ratio = a["server_s"] / b["server_s"] if b else float("nan")
        rows[n] = (a, b if mark == " " else None, ratio)
        fl = (f"{mark}{b['client_ms']:>16.1f} {mark}{b['server_s']:>9.2f} "
              f"({b['server_cpu_s']:>7.2f}) {ratio:>7.4f}" if b else
              f"{'(skipped)':>17} {'(skipped)':>20} {'-':>7}")
        print(f"{n:>6} {k:>4} {t:>4} {len(dropped):>5} {a['client_ms']:>15.2f} "
              f"{a['server_s']:>10.3f} ({a['server_cpu_s']:>7.3f}) {fl}", flush=True)
    print(f"load average {' '.join(f'{v:.1f}' for v in os.getloadavg())} at the end")
    if 1000 in rows and rows[1000][1]:
        a, b, ratio = rows[1000]
        print(f"secagg 1000: ours {a['server_s']:.3f} s, flower {b['server_s']:.2f} s, "
              f"ratio {ratio:.4f}")


if __name__ == "__main__":
    main()
